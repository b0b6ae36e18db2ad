"""The spec's counters, as vLLM's offloading metrics (``vllm:kvtier_*``)."""

from __future__ import annotations

import threading
from collections import Counter

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

M_LOOKUPS = "vllm:kvtier_lookup_chunks"
M_STORE = "vllm:kvtier_store_blocks"
M_LOADED = "vllm:kvtier_loaded_blocks"
M_LOAD_FAILED = "vllm:kvtier_load_failed_blocks"

METRICS: dict[str, OffloadingMetricMetadata] = {
    M_LOOKUPS: OffloadingCounterMetadata(
        documentation="kvtier lookups by result (hit_host, hit_disk, miss, pending: store in flight, "
                      "filtered_host, filtered_disk: held, but the request's kv_load_tiers excludes the tier, "
                      "unavailable: daemon bypassed, retry: already loaded for this request)",
        labelnames=("result",)),
    M_STORE: OffloadingCounterMetadata(
        documentation="Blocks offered to kvtier by result (stored, present, dropped: no slot, failed)",
        labelnames=("result",)),
    M_LOADED: OffloadingCounterMetadata(documentation="Blocks loaded from kvtier into vLLM's KV cache"),
    M_LOAD_FAILED: OffloadingCounterMetadata(
        documentation="Blocks whose load failed and which vLLM recomputes (missing: evicted or failed "
                      "its checksum; error: daemon down or timed out; test: a test engine's injected failure)",
        labelnames=("reason",)),
}


class Counts:
    """Counters (name, labels) -> value, drained into an OffloadingConnectorStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self.total: Counter[tuple[str, tuple[str, ...]]] = Counter()

    def add(self, name: str, n: int = 1, *labels: str) -> None:
        if n:
            with self._lock:
                self._c[(name, labels)] += n
                self.total[(name, labels)] += n

    def take(self) -> OffloadingConnectorStats | None:
        with self._lock:
            c, self._c = self._c, Counter()
        if not c:
            return None
        stats = OffloadingConnectorStats()
        for (name, labels), n in c.items():
            stats.increase_counter(name, n, labels)
        return stats

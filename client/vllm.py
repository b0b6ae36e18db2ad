"""kvtier as a KV offloading backend of vLLM's ``OffloadingConnector``: :class:`KvtierOffloadingSpec`.

Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                      "spec_module_path": "kvtier.client.vllm",
                                      "kvtier_socket": "/run/kvtier/kvtierd.sock"}}'

with ``kvtierd`` running on the node. Supported vLLM: :data:`SUPPORTED_VLLM` (checked at
import; the offloading API is experimental upstream and changes between minor versions).
``kvtier.client.vllm`` is the only part of kvtier that imports vLLM.

How it maps to kvtier
    * The **manager** (vLLM's scheduler process) answers lookups from the daemon's
      shared-memory key table (``Sidecar.lookup``): no RPC per lookup. A chunk is a hit when
      every tensor-parallel rank's shard of it is held (host or disk); a chunk whose store has
      been prepared but not completed is ``HIT_PENDING``, never loadable before it completes.
      ``prepare_store`` offers back, in the order given, the chunks kvtier does not hold yet.
      A request's ``kv_transfer_params["kv_load_tiers"]`` (vLLM's per-request tier filter)
      is honoured: host is the ``CPU`` medium, disk ``STORAGE``, both ``LOCAL``; a chunk held
      in a tier the request excludes is a miss (recomputed), counted ``filtered_host`` or
      ``filtered_disk``.
    * The **worker** (each vLLM worker process) moves the pages. If the KV tensors can be
      registered with the daemon (CUDA tensors, or CPU tensors in a sealed memfd) it
      registers them once through :class:`~kvtier.client.engine.KVConnector` and the daemon's
      copy engine moves pages by block id (``kvtier_copy: daemon``). vLLM's CPU backend keeps
      its KV cache in ordinary anonymous (heap) memory, which the daemon cannot map: there the
      worker copies pages itself between vLLM's tensors and the daemon's host pool through a
      :class:`~kvtier.client.Sidecar` (``put``/``get`` write and read the pool mapping, one
      gather or scatter per transfer) on a background thread (``kvtier_copy: process``).
    * Keys: vLLM's offload key (a block hash plus a 4-byte KV-cache group index) covers one
      chunk of ``blocks_per_chunk`` blocks. Each block of a chunk gets its own kvtier key,
      ``blake2b(offload_key || blocks from it to the chunk's last as u32 LE, digest_size=16,
      key=Namespace(model, tenant).digest())``, so loads may start mid-chunk and kvtier keys
      stay 16 bytes, separated by model and tenant. The tensor-parallel rank and size are in
      the layout fingerprint (:class:`~kvtier.tiers.layout.Layout`), with the model's layers,
      KV dtype, page size and block tokens.
    * ``take_events`` (when vLLM publishes KV events) reports the chunks this engine stored,
      as the key table shows them over time: medium ``CPU`` while in kvtier's host tier,
      ``STORAGE`` once on its disk tier, removed when gone.

Failures
    A daemon that is down or slow, a block evicted between lookup and load, or one that fails
    its checksum on the disk tier never yields a wrong page: the worker leaves those pages
    untouched and reports their block ids as load errors, which vLLM recomputes (with
    ``"kv_load_failure_policy": "recompute"``; vLLM's default, ``"fail"``, fails the request
    instead). Each failure is counted (``vllm:kvtier_load_failed_blocks``, by reason) and
    kvtier is bypassed (lookups miss, stores are skipped) for ``kvtier_retry_s`` before the
    daemon is tried again, in the background. Store failures only cost future hits.

Configuration: ``kv_connector_extra_config`` keys (all optional)
    * ``kvtier_socket``: the daemon's unix socket (default: ``$KVTIER_SOCKET``, else the
      daemon's default socket path).
    * ``kvtier_model``: the model id that namespaces keys (default: vLLM's ``--model``).
      Engines that must share blocks use the same id, and the same weights.
    * ``kvtier_tenant``: a tenant salt; engines with different salts never share blocks
      (default: the daemon's secret salt for this process's tenant, from its credential socket).
    * ``kvtier_timeout_s``: deadline of each call to the daemon (default 2.0).
    * ``kvtier_register_timeout_s``: deadline of the KV tensors' registration at startup
      (default 600): on a GPU the daemon pins its host pool then, about 0.085 s per GiB (two
      minutes for 1.5 TiB), and a registration that timed out would leave ``auto`` copying in
      this process. Registrations again later (the daemon restarted) use ``kvtier_timeout_s``
      and are retried: the daemon keeps the pin it was making.
    * ``kvtier_retry_s``: after a failed call, how long kvtier is bypassed (default 5.0).
    * ``kvtier_settle_s``: daemon copies: how long a transfer whose call failed without the
      daemon's answer is waited for (until the daemon says it ended) before its blocks are
      reported failed anyway (default 60; see :meth:`Transfer._settled
      <kvtier.client.engine.connector.Transfer._settled>`).
    * ``kvtier_copy``: ``auto`` (default: ``daemon`` when the KV tensors can be registered,
      else ``process``), ``daemon`` or ``process`` (see above).
    * ``kvtier_events_max_keys``: how many stored chunks ``take_events`` follows (default
      65536); ``kvtier_events_scan``: how many it re-reads from the key table per call
      (default 1024, one batched read).
    * Test only, never in production: ``kvtier_test_corrupt_loads`` (zero every page after
      loading it: a negative control that must change outputs) and
      ``kvtier_test_fail_loads`` (treat every load as failed: exercises the recompute path).

vLLM's own keys keep their meaning: ``blocks_per_chunk`` (or ``block_size``) and
``offload_prompt_only`` (default true: only prompt blocks are offloaded).

Limits: one KV-cache group (full-attention models; vLLM's block-level recompute does not
support more), no pipeline or context parallelism (tensor parallelism is supported).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_VLLM = ((0, 32), (0, 33))
"""vLLM versions this module is written and tested against: at least the first, below the second."""

_VERSION_OVERRIDE_ENV = "KVTIER_VLLM_ANY_VERSION"


def _parse_version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ImportError(f"kvtier.client.vllm: cannot read the vLLM version {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str) -> None:
    """Raise ImportError unless ``version`` is in :data:`SUPPORTED_VLLM` (or the override is set)."""
    lo, hi = SUPPORTED_VLLM
    if lo <= _parse_version(version) < hi or os.environ.get(_VERSION_OVERRIDE_ENV) == "1":
        return
    raise ImportError(
        f"kvtier.client.vllm supports vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (its KV offloading API is "
        f"experimental and changes between minor versions); this is vLLM {version}. Install a supported "
        f"vLLM (pip install -e '.[vllm]' in a kvtier checkout), or set {_VERSION_OVERRIDE_ENV}=1 to try anyway.")


try:
    import vllm
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("kvtier.client.vllm needs vLLM (pip install -e '.[vllm]' in a kvtier checkout); the rest of kvtier "
                      "does not") from e

check_vllm_version(getattr(vllm, "__version__", "0.0"))

import grpc  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.client import KvtierError, Namespace, Sidecar  # noqa: E402
from kvtier.client.engine import KVConnector, KVConnectorError  # noqa: E402
from kvtier.client.engine.keys import daemon_key_salt  # noqa: E402
from kvtier.tiers.layout import DTYPE_BYTES, Layout, TensorSpec  # noqa: E402

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: its handler, format and level

# -- configuration ---------------------------------------------------------------------------

_COPY_MODES = ("auto", "daemon", "process")


@dataclass(frozen=True)
class KvtierSettings:
    """The ``kvtier_*`` keys of ``kv_connector_extra_config`` (module docstring)."""

    socket: str | None = None
    model: str | None = None
    tenant: str = ""
    timeout_s: float = 2.0
    register_timeout_s: float = 600.0
    retry_s: float = 5.0
    settle_s: float = 60.0
    copy: str = "auto"
    events_max_keys: int = 65536
    events_scan: int = 1024
    test_corrupt_loads: bool = False
    test_fail_loads: bool = False

    @classmethod
    def from_extra(cls, extra: Any) -> KvtierSettings:
        known = {f"kvtier_{name}" for name in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if str(k).startswith("kvtier_") and k not in known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; kvtier's keys are {sorted(known)}")
        kw: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            raw = extra.get(f"kvtier_{name}")
            if raw is None:
                continue
            if f.type in ("bool", bool):
                kw[name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
            elif f.type in ("float", float):
                kw[name] = float(raw)
            elif f.type in ("int", int):
                kw[name] = int(raw)
            else:
                kw[name] = str(raw)
        s = cls(**kw)
        if s.copy not in _COPY_MODES:
            raise ValueError(f"kvtier_copy is {s.copy!r}; one of {', '.join(_COPY_MODES)}")
        if s.timeout_s <= 0 or s.register_timeout_s <= 0 or s.retry_s < 0 or s.settle_s < 0:
            raise ValueError("kvtier_timeout_s and kvtier_register_timeout_s must be positive, kvtier_retry_s and "
                             "kvtier_settle_s not negative")
        return s


# -- metrics -----------------------------------------------------------------------------------

M_LOOKUPS = "vllm:kvtier_lookup_chunks"
M_STORE = "vllm:kvtier_store_blocks"
M_LOADED = "vllm:kvtier_loaded_blocks"
M_LOAD_FAILED = "vllm:kvtier_load_failed_blocks"

_METRICS: dict[str, OffloadingMetricMetadata] = {
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
                      "its checksum; error: daemon down or timed out; test: kvtier_test_fail_loads)",
        labelnames=("reason",)),
}


class _Counts:
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


# -- keys and layouts --------------------------------------------------------------------------


class KeyMap:
    """vLLM offload keys -> kvtier keys: one 16-byte key per block of a chunk (module docstring)."""

    def __init__(self, namespace: Namespace | Callable[[], Namespace], blocks_per_chunk: int) -> None:
        # a callable: resolved on first use (the daemon's secret tenant salt, asked for then)
        self._namespace = namespace
        self._digest = namespace.digest() if isinstance(namespace, Namespace) else None
        self.blocks_per_chunk = blocks_per_chunk
        # block i of a chunk: its distance from the chunk's last block, whose hash the offload
        # key is, so (hash of block k, d) names block k - d whatever blocks_per_chunk an engine
        # uses (counted from the chunk's first block, engines with other chunk sizes met on
        # the same keys for different blocks)
        self._suffix = [(blocks_per_chunk - 1 - i).to_bytes(4, "little") for i in range(blocks_per_chunk)]

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            assert callable(self._namespace)
            self._digest = self._namespace().digest()
        return self._digest

    def chunk(self, key: bytes) -> tuple[bytes, ...]:
        return tuple(hashlib.blake2b(bytes(key) + s, digest_size=16, key=self.digest).digest()
                     for s in self._suffix)


def group_layout(config: Any, rank: int, num_blocks: int = 1) -> Layout:
    """The kvtier layout of one worker's KV pages for vLLM's (single) offloaded group.

    Built from vLLM's offloading config alone, so the scheduler and every worker agree on it:
    one tensor per layer, ``[num_blocks, page]`` in the KV dtype, where a layer's page is the
    worker's KV bytes per block split evenly over the group's layers (the worker checks its
    tensors against it)."""
    group = config.groups[0]
    layers = group.layer_names
    raw = str(config.model.dtype)
    dtype = raw if raw in DTYPE_BYTES else "uint8"
    total = config.worker_kv_bytes_per_block
    if not layers or total <= 0 or total % len(layers):
        raise ValueError(f"kvtier: {total} KV bytes per block do not split over {len(layers)} layers")
    page = total // len(layers)
    if page % DTYPE_BYTES[dtype]:
        dtype = "uint8"
    elems = page // DTYPE_BYTES[dtype]
    # a KV dtype carried as bytes (fp8 variants, int8 with scales) names itself in the tensor
    # names, so two such dtypes of one model never share a layout fingerprint (nor blocks)
    tag = "" if dtype == raw else f"@{raw}"
    tensors = tuple(TensorSpec(name + tag, dtype, (num_blocks, elems), 0) for name in layers)
    return Layout(tensors, group.tokens_per_block, tp_rank=rank, tp_size=config.parallel.world_size)


def block_keys_for(chunks: Sequence[tuple[bytes, ...]], spec: GPULoadStoreSpec,
                   blocks_per_chunk: int) -> list[bytes]:
    """The kvtier key of each engine block of ``spec`` (one group), given the keys of the
    chunks it spans in order: the first chunk may start at block ``block_indices[0] %
    blocks_per_chunk`` (a load that starts mid-chunk), the last may end early."""
    size = int(spec.group_sizes[0])
    skip = int(spec.block_indices[0]) % blocks_per_chunk
    if len(chunks) != -(-(size + skip) // blocks_per_chunk) or len(spec.block_ids) != size:
        raise ValueError(f"{len(chunks)} chunks for {size} blocks starting at {skip} of {blocks_per_chunk}")
    return [chunks[(skip + j) // blocks_per_chunk][(skip + j) % blocks_per_chunk] for j in range(size)]


class KvtierLoadSpec(LoadStoreSpec):
    """Where a load comes from: the kvtier keys of each chunk, in the order vLLM gave them."""

    def __init__(self, chunks: list[tuple[bytes, ...]]) -> None:
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"KvtierLoadSpec({len(self.chunks)} chunks)"


class KvtierStoreSpec(LoadStoreSpec):
    """Where a store goes: the kvtier keys of each chunk to store, in ``keys_to_store`` order."""

    def __init__(self, chunks: list[tuple[bytes, ...]]) -> None:
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"KvtierStoreSpec({len(self.chunks)} chunks)"


def _check_supported(config: Any) -> None:
    p = config.parallel
    if len(config.groups) != 1:
        raise ValueError(f"kvtier supports models with one KV-cache group (full attention); this one has "
                         f"{len(config.groups)} (vLLM recomputes failed loads block by block only with one)")
    if p.pp_size != 1 or p.pcp_size != 1 or p.dcp_size != 1:
        raise ValueError("kvtier supports tensor parallelism only: no pipeline or context parallelism")


# -- the manager (scheduler process) -----------------------------------------------------------


class _Daemon:
    """A Sidecar with the layouts of every TP rank registered, or None while bypassed.

    After a failed call kvtier is bypassed for ``retry_s``; a background thread reconnects."""

    def __init__(self, settings: KvtierSettings, layouts: list[Layout], client_name: str) -> None:
        self.settings = settings
        self.layouts = layouts
        self.client_name = client_name
        self._lock = threading.Lock()
        self._sc: Sidecar | None = None
        self.lids: list[int] = []
        self._retry_at = 0.0
        self._connecting = False
        self._closed = False
        self.failures = 0

    def connect(self) -> bool:
        """Connect now (blocking, bounded by the timeout); False when the daemon is not there."""
        s = self.settings
        sc = Sidecar(s.socket, client_name=self.client_name, timeout=s.timeout_s)
        try:
            lids = [sc.register_layout(lay) for lay in self.layouts]
        except KvtierError as e:
            sc.close()
            log.warning("kvtier: daemon at %s not reachable (%s); retrying every %.1f s",
                        sc.target, e, s.retry_s)
            self._retry_at = time.monotonic() + s.retry_s
            return False
        with self._lock:
            if self._closed:
                sc.close()
                return False
            self._sc, self.lids = sc, lids
        return True

    def get(self) -> Sidecar | None:
        sc = self._sc
        if sc is not None:
            return sc
        if not self._connecting and not self._closed and time.monotonic() >= self._retry_at:
            self._connecting = True
            threading.Thread(target=self._reconnect, name="kvtier-reconnect", daemon=True).start()
        return None

    def _reconnect(self) -> None:
        try:
            if self.connect():
                log.info("kvtier: connected to the daemon")
        finally:
            self._connecting = False

    def failed(self, sc: Sidecar, err: Exception) -> None:
        self.failures += 1
        with self._lock:
            if self._sc is sc:
                self._sc = None
                self._retry_at = time.monotonic() + self.settings.retry_s
        log.warning("kvtier: daemon call failed (%s); bypassing kvtier for %.1f s", err, self.settings.retry_s)
        try:
            sc.close()
        except Exception:  # noqa: BLE001 - closing a broken client
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sc, self._sc = self._sc, None
        if sc is not None:
            sc.close()


@dataclass
class _ReqState:
    tiers: dict[bytes, str] = field(default_factory=dict)  # offload key -> tier found at lookup
    loaded: set[bytes] = field(default_factory=set)        # offload keys this request has loaded


def _req_state(req_context: ReqContext) -> _ReqState:
    state = req_context.get_state(_ReqState)
    if state is None:
        state = _ReqState()
        req_context.set_state(state)
    return state


class _Events:
    """Chunks this engine stored, re-read from the key table to report where they are."""

    def __init__(self, max_keys: int, scan: int) -> None:
        self.max_keys = max_keys
        self.scan = scan
        self.where: OrderedDict[bytes, frozenset[Medium]] = OrderedDict()
        self.out: list[OffloadingEvent] = []

    def follow(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.where.setdefault(k, frozenset())
            self.where.move_to_end(k)
        while len(self.where) > self.max_keys:
            self.where.popitem(last=False)

    def rescan(self, tiers_of: Any) -> None:
        """Re-read up to ``scan`` chunks (oldest first, then rotated to the back) and queue events."""
        n = min(self.scan, len(self.where))
        keys = [k for k, _ in zip(self.where, range(n), strict=False)]
        added: dict[Medium, list[bytes]] = {Medium.CPU: [], Medium.STORAGE: []}
        removed: dict[Medium, list[bytes]] = {Medium.CPU: [], Medium.STORAGE: []}
        for k, tier in zip(keys, tiers_of(keys), strict=True):
            before = self.where.pop(k)
            now = set()
            if tier == "host":
                now.add(Medium.CPU)
                if Medium.STORAGE in before:
                    now.add(Medium.STORAGE)  # promoted back from disk: the disk copy stays
            elif tier == "disk":
                now.add(Medium.STORAGE)
            for m in now - before:
                added[m].append(k)
            for m in before - now:
                removed[m].append(k)
            if now:
                self.where[k] = frozenset(now)
        for m in (Medium.CPU, Medium.STORAGE):
            if added[m]:
                self.out.append(OffloadingEvent(keys=[OffloadKey(k) for k in added[m]], medium=m, removed=False))
            if removed[m]:
                self.out.append(OffloadingEvent(keys=[OffloadKey(k) for k in removed[m]], medium=m, removed=True))


_MEDIA = {"host": Medium.CPU, "disk": Medium.STORAGE}  # kvtier's tiers as vLLM's media (kv_load_tiers)


class KvtierOffloadingManager(OffloadingManager):
    """Scheduler side: lookups from the key table, stores tracked until they complete."""

    def __init__(self, settings: KvtierSettings, keymap: KeyMap, layouts: list[Layout], client_name: str,
                 events: bool) -> None:
        self.settings = settings
        self.keymap = keymap
        self.daemon = _Daemon(settings, layouts, client_name)
        self.daemon.connect()
        self.pending: set[bytes] = set()
        self.counts = _Counts()
        self.events = _Events(settings.events_max_keys, settings.events_scan) if events else None

    # lookups through the key table: shared memory, no RPC
    def _tiers(self, sc: Sidecar, chunks: Sequence[tuple[bytes, ...]]) -> list[str | None]:
        """Per chunk: ``host`` when every block of every rank is in host, ``disk`` when all
        are held and some only on disk, else None. One table read per rank for them all."""
        flat = [k for c in chunks for k in c]
        out: list[str | None] = ["host"] * len(chunks)
        for lid in self.daemon.lids:
            names = sc.lookup(lid, flat) if flat else []
            for i, c in enumerate(chunks):
                for t in names[i * len(c):(i + 1) * len(c)]:
                    if out[i] is None:
                        break
                    if t == "disk":
                        out[i] = "disk"
                    elif t != "host":
                        out[i] = None
        return out

    def _tier_or_down(self, key: bytes) -> str | None:
        sc = self.daemon.get()
        if sc is None:
            return "unavailable"
        try:
            return self._tiers(sc, [self.keymap.chunk(key)])[0]
        except KvtierError as e:
            self.daemon.failed(sc, e)
            return "unavailable"

    def _excluded(self, tier: str, req_context: ReqContext) -> bool:
        """Whether the request's kv_load_tiers leaves kvtier's ``tier`` (host, disk) out: then
        the chunk is a miss and vLLM recomputes it (counted ``filtered_<tier>``)."""
        if req_context.load_tier_filter.allows(_MEDIA[tier], Locality.LOCAL):
            return False
        self.counts.add(M_LOOKUPS, 1, f"filtered_{tier}")
        return True

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self.pending:
            if self._excluded("host", req_context):  # (its store is bound for host)
                return LookupResult.MISS
            self.counts.add(M_LOOKUPS, 1, "pending")
            return LookupResult.HIT_PENDING
        state = _req_state(req_context)
        if bytes(key) in state.loaded:
            # asked again after loading it: its load failed (vLLM recomputes from the first
            # failed block and looks up again) or the request was preempted. Never load a
            # chunk twice for one request: that bounds a failing daemon to one try.
            self.counts.add(M_LOOKUPS, 1, "retry")
            return LookupResult.MISS
        tier = self._tier_or_down(key)
        if tier in _MEDIA:
            if self._excluded(tier, req_context):
                return LookupResult.MISS
            self.counts.add(M_LOOKUPS, 1, f"hit_{tier}")
            state.tiers[bytes(key)] = tier
            return LookupResult.HIT
        self.counts.add(M_LOOKUPS, 1, "unavailable" if tier == "unavailable" else "miss")
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = req_context.get_state(_ReqState)
        tier = state.tiers.get(bytes(key)) if state is not None else None
        return {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
            tier or "", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        _req_state(req_context).loaded.update(bytes(k) for k in keys)
        return KvtierLoadSpec([self.keymap.chunk(k) for k in keys])

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        sc = self.daemon.get()
        todo: list[OffloadKey] = []
        if sc is not None:
            offered = [k for k in keys if k not in self.pending]
            try:  # in the order offered: vLLM lays out the source blocks in that order
                held = self._tiers(sc, [self.keymap.chunk(k) for k in offered])
                todo = [k for k, t in zip(offered, held, strict=True) if t is None]
            except KvtierError as e:
                self.daemon.failed(sc, e)
                todo = []
        self.pending.update(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=KvtierStoreSpec([self.keymap.chunk(k) for k in todo]),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.pending.difference_update(keys)
        if self.events is not None:
            self.events.follow(bytes(k) for k in keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        sc = self.daemon.get()
        if sc is not None and self.events.where:
            try:
                self.events.rescan(lambda ks: self._tiers(sc, [self.keymap.chunk(k) for k in ks]))
            except KvtierError as e:
                self.daemon.failed(sc, e)
        out, self.events.out = self.events.out, []
        return out

    def reset_cache(self) -> None:
        # kvtier's tiers are the node's, shared with other engines: a reset of this engine's
        # cache forgets what it has in flight but does not evict them (kvtier evict does)
        self.pending.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.counts.take()

    def shutdown(self) -> None:
        self.daemon.close()


# -- the worker (each worker process) ----------------------------------------------------------


@dataclass
class _Job:
    job_id: int
    load: bool
    keys: list[bytes]
    block_ids: np.ndarray
    start: float = field(default_factory=time.perf_counter)
    failed: np.ndarray | None = None   # block ids whose load failed
    nbytes: int = 0
    transfer: Any = None               # daemon copy in flight (KVConnector Transfer)
    done: bool = False


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: moves pages between vLLM's KV tensors and kvtier (module docstring)."""

    def __init__(self, settings: KvtierSettings, keymap: KeyMap, layout: Layout, kv_caches: CanonicalKVCaches,
                 client_name: str) -> None:
        self.settings = settings
        self.keymap = keymap
        self.layout = layout
        self.client_name = client_name
        self.tensors, self.pages = self._tensors(kv_caches, layout)
        self.block_bytes = sum(self.pages)
        self.counts = _Counts()
        self._cv = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[_Job] = []
        self._failed_blocks: set[int] = set()
        self._retry_at = 0.0
        self.conn: KVConnector | None = None
        self._stale = False               # the daemon copy registration must be made (again)
        self.sc: Sidecar | None = None
        self.lid = 0
        self.mode = self._open(settings.copy)
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._thread: threading.Thread | None = None
        if self.mode == "process":
            self._thread = threading.Thread(target=self._run, name="kvtier-copy", daemon=True)
            self._thread.start()

    @staticmethod
    def _tensors(kv_caches: CanonicalKVCaches, layout: Layout) -> tuple[list[Any], list[int]]:
        """vLLM's distinct page tensors of the group, checked against the layout."""
        seen: list[int] = []
        for ref in kv_caches.group_data_refs[0]:
            if ref.tensor_idx not in seen:
                seen.append(ref.tensor_idx)
        tensors = [kv_caches.tensors[i].tensor for i in seen]
        pages = [t.shape[1] * t.element_size() for t in tensors]
        want = [t.shape[1] * DTYPE_BYTES[t.dtype] for t in layout.tensors]
        if pages != want:
            raise ValueError(f"kvtier: vLLM's KV pages are {pages} bytes per tensor, but its offloading config "
                             f"implies {want}; this KV cache layout is not supported")
        return tensors, pages

    # -- connection ---------------------------------------------------------------------------

    def _open(self, mode: str) -> str:
        """Pick how pages move (``kvtier_copy``) and connect. Never blocks past the timeout:
        a daemon that is not there yet is connected to later."""
        if mode != "process":
            if not self._daemon_up():
                if mode == "daemon" or self.tensors[0].device.type == "cuda":
                    self._stale = True  # registered once the daemon answers
                    self._down(KVConnectorError(grpc.StatusCode.UNAVAILABLE, "daemon not reachable"))
                    return "daemon"
            else:
                try:
                    self._open_daemon(self.settings.register_timeout_s)
                    return "daemon"
                except KVConnectorError as e:
                    if mode == "daemon":
                        raise
                    log.info("kvtier: KV tensors not registrable with the daemon (%s); copying in this process",
                             e.details.split(";")[0])
        s = self.settings
        self.sc = Sidecar(s.socket, client_name=self.client_name, timeout=s.timeout_s)
        try:
            self.lid = self.sc.register_layout(self.layout)
        except KvtierError as e:
            log.warning("kvtier: daemon not reachable (%s); loads miss until it is", e)
            self.lid = 0
        return "process"

    def _daemon_up(self) -> bool:
        """Whether the daemon answers within the timeout (registration itself waits for it forever)."""
        try:
            with Sidecar(self.settings.socket, client_name=self.client_name, timeout=self.settings.timeout_s,
                         use_key_table=False) as probe:
                probe.stats()
            return True
        except KvtierError:
            return False

    def _open_daemon(self, timeout: float | None = None) -> None:
        """Register the KV tensors with the daemon (``timeout``: the registration's deadline,
        else ``kvtier_timeout_s``)."""
        torch = _torch()
        num_blocks = self.tensors[0].shape[0]
        layout = Layout(tuple(TensorSpec(t.name, t.dtype, (num_blocks, t.shape[1]), 0) for t in self.layout.tensors),
                        self.layout.block_tokens, self.layout.tp_rank, self.layout.tp_size)
        views = [t.view(getattr(torch, spec.dtype)) for t, spec in zip(self.tensors, layout.tensors, strict=True)]
        conn = KVConnector(self.settings.socket, client_name=self.client_name, timeout=self.settings.timeout_s,
                           settle_s=self.settings.settle_s)
        try:
            conn.register(layout, views, timeout=timeout)
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self._stale = False
        self._retry_at = 0.0

    def _reopen_daemon(self) -> bool:
        """After the daemon failed (or restarted: registrations do not survive it), register
        again, once the copies in flight have ended."""
        for job in list(self._jobs.values()):
            if job.transfer is not None:
                self._end_daemon_copy(job)
        old, self.conn = self.conn, None
        if old is not None:
            try:
                old.close()
            except (KVConnectorError, grpc.RpcError):
                pass  # the daemon is gone, and the registration with it
        if not self._daemon_up():
            self._down(KVConnectorError(grpc.StatusCode.UNAVAILABLE, "daemon not reachable"))
            return False
        try:
            self._open_daemon()
        except KVConnectorError as e:
            self._down(e)
            return False
        log.info("kvtier: registered the KV tensors with the daemon again")
        return True

    def _sidecar(self) -> Sidecar | None:
        """The sidecar with the layout registered, or None while kvtier is bypassed."""
        if self.sc is None or time.monotonic() < self._retry_at:
            return None
        if not self.lid:
            try:
                self.lid = self.sc.register_layout(self.layout)
            except KvtierError as e:
                self._down(e)
                return None
        return self.sc

    def _down(self, err: Exception) -> None:
        self._retry_at = time.monotonic() + self.settings.retry_s
        log.warning("kvtier: daemon call failed (%s); bypassing kvtier for %.1f s", err, self.settings.retry_s)

    # -- OffloadingWorker ---------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierStoreSpec)
        keys = block_keys_for(dst_spec.chunks, src_spec, self.keymap.blocks_per_chunk)
        self._submit(_Job(job_id, False, keys, np.asarray(src_spec.block_ids, dtype=np.int64)))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvtierLoadSpec)
        ids = np.asarray(dst_spec.block_ids, dtype=np.int64)
        try:
            keys = block_keys_for(src_spec.chunks, dst_spec, self.keymap.blocks_per_chunk)
        except ValueError as e:  # never a wrong page: a load that cannot be mapped is recomputed
            log.error("kvtier: load %d not understood (%s); recomputing it", job_id, e)
            job = _Job(job_id, True, [], ids, failed=ids)
            self.counts.add(M_LOAD_FAILED, len(ids), "error")
            self._finish(job)
            return True
        self._submit(_Job(job_id, True, keys, ids))
        return True

    def _submit(self, job: _Job) -> None:
        with self._cv:
            self._jobs[job.job_id] = job
        if self.mode == "daemon":
            self._start_daemon_copy(job)
        else:
            self._q.put((0 if job.load else 1, job.job_id, job))  # loads first: a request waits on them

    def get_finished(self) -> list[TransferResult]:
        if self.mode == "daemon":
            self._poll_daemon()
        with self._cv:
            done, self._finished = self._finished, []
            for job in done:
                if job.failed is not None and len(job.failed):
                    self._failed_blocks.update(int(b) for b in job.failed)
        return [TransferResult(job_id=j.job_id, success=True, transfer_size=j.nbytes,
                               transfer_time=time.perf_counter() - j.start) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        if self.mode == "daemon":
            for jid in job_ids:
                job = self._jobs.get(jid)
                if job is not None and job.transfer is not None:
                    self._end_daemon_copy(job)
            return
        with self._cv:
            while any(jid in self._jobs for jid in job_ids):
                self._cv.wait()

    def take_failed_block_ids(self) -> set[int]:
        """Engine block ids whose load failed since the last call (vLLM recomputes them)."""
        with self._cv:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        if self._thread is not None:
            self._q.put((-1, -1, None))
            self._thread.join(timeout=30)
            self._thread = None
        for job in list(self._jobs.values()):  # the connector closes once its copies have ended
            if job.transfer is not None:
                self._end_daemon_copy(job)
        if self.conn is not None:
            try:
                self.conn.close()
            except (KVConnectorError, grpc.RpcError):
                pass  # the daemon is gone, and the registration with it
            self.conn = None
        if self.sc is not None:
            self.sc.close()
            self.sc = None

    def _finish(self, job: _Job) -> None:
        job.done = True
        with self._cv:
            self._jobs.pop(job.job_id, None)
            self._finished.append(job)
            self._cv.notify_all()

    # -- in-process copies (background thread) ------------------------------------------------

    def _run(self) -> None:
        while True:
            _, _, job = self._q.get()
            if job is None:
                return
            try:
                if job.load:
                    self._load(job)
                else:
                    self._store(job)
            except Exception as e:  # noqa: BLE001 - a failed copy must not kill the engine
                log.exception("kvtier: %s %d failed", "load" if job.load else "store", job.job_id)
                self._down(e)
                self._count_failed(job)
            self._finish(job)

    def _count_failed(self, job: _Job) -> None:
        """A job none of whose blocks moved: a load's blocks are all reported failed (vLLM
        recomputes them), a store's keys counted as failed."""
        if job.load:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, len(job.block_ids), "error")
        else:
            self.counts.add(M_STORE, len(job.keys), "failed")

    def _store(self, job: _Job) -> None:
        sc = self._sidecar()
        if sc is None:
            self.counts.add(M_STORE, len(job.keys), "failed")
            return
        torch = _torch()
        ids = torch.as_tensor(job.block_ids, device=self.tensors[0].device)
        staged = torch.cat([t.index_select(0, ids) for t in self.tensors], dim=1).cpu()
        rows = staged.numpy().view(np.uint8)
        try:
            res = sc.put(self.lid, job.keys, list(rows))
        except KvtierError as e:
            self._down(e)
            self.counts.add(M_STORE, len(job.keys), "failed")
            return
        job.nbytes = res.stored * self.block_bytes
        self.counts.add(M_STORE, res.stored, "stored")
        self.counts.add(M_STORE, res.present, "present")
        self.counts.add(M_STORE, len(res.dropped), "dropped")

    def _load(self, job: _Job) -> None:
        n = len(job.keys)
        sc = None if self.settings.test_fail_loads else self._sidecar()
        if sc is None:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, n, "test" if self.settings.test_fail_loads else "error")
            return
        buf = np.empty((n, self.block_bytes), dtype=np.uint8)
        try:
            got = sc.get(self.lid, job.keys, out=list(buf))
        except KvtierError as e:
            self._down(e)
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, n, "error")
            return
        ok = np.array([g is not None for g in got], dtype=bool)
        job.failed = job.block_ids[~ok]
        self.counts.add(M_LOAD_FAILED, int((~ok).sum()), "missing")
        if ok.any():
            self._scatter(job.block_ids[ok], buf[ok])
            job.nbytes = int(ok.sum()) * self.block_bytes
            self.counts.add(M_LOADED, int(ok.sum()))

    def _scatter(self, block_ids: np.ndarray, rows: np.ndarray) -> None:
        torch = _torch()
        dev = self.tensors[0].device
        ids = torch.as_tensor(block_ids, device=dev)
        staged = torch.from_numpy(rows).view(torch.int8).to(dev)
        off = 0
        for t, page in zip(self.tensors, self.pages, strict=True):
            t.index_copy_(0, ids, staged[:, off:off + page])
            if self.settings.test_corrupt_loads:
                t.index_fill_(0, ids, 0)
            off += page

    # -- daemon copies (KVConnector) ----------------------------------------------------------

    def _start_daemon_copy(self, job: _Job) -> None:
        if job.load and self.settings.test_fail_loads:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, len(job.block_ids), "test")
            self._finish(job)
            return
        if time.monotonic() < self._retry_at or (self._stale and not self._reopen_daemon()):
            self._daemon_copy_failed(job, None)
            return
        assert self.conn is not None
        try:
            job.transfer = (self.conn.onboard(job.keys, job.block_ids) if job.load
                            else self.conn.offload(job.keys, job.block_ids))
        except (KVConnectorError, grpc.RpcError) as e:
            self._daemon_copy_failed(job, e)

    def _poll_daemon(self) -> None:
        for job in list(self._jobs.values()):
            if job.transfer is not None and job.transfer.done():
                self._end_daemon_copy(job)

    def _end_daemon_copy(self, job: _Job) -> None:
        try:
            # (no deadline of its own: the call's deadline bounds the reply, and a failed load is
            # reported only once the daemon has ended it, or else vLLM would recompute into pages
            # a late copy may still write; KVConnector.settle_s bounds that)
            statuses = job.transfer.wait(None)
        except (KVConnectorError, TimeoutError) as e:
            self._daemon_copy_failed(job, e)
            return
        job.transfer = None
        st = np.array(statuses)
        if job.load:
            bad = st != "copied"
            job.failed = job.block_ids[bad]
            self.counts.add(M_LOAD_FAILED, int(bad.sum()), "missing")
            self.counts.add(M_LOADED, int((~bad).sum()))
            job.nbytes = int((~bad).sum()) * self.block_bytes
            if self.settings.test_corrupt_loads and (~bad).any():
                self._zero(job.block_ids[~bad])
        else:
            for name, label in (("copied", "stored"), ("present", "present"), ("no_space", "dropped")):
                self.counts.add(M_STORE, int((st == name).sum()), label)
            job.nbytes = int((st == "copied").sum()) * self.block_bytes
        self._finish(job)

    def _daemon_copy_failed(self, job: _Job, err: Exception | None) -> None:
        if err is not None:
            self._down(err)
            self._stale = True
        job.transfer = None
        self._count_failed(job)
        self._finish(job)

    def _zero(self, block_ids: np.ndarray) -> None:
        torch = _torch()
        ids = torch.as_tensor(block_ids, device=self.tensors[0].device)
        for t in self.tensors:
            t.index_fill_(0, ids, 0)


def _torch() -> Any:
    import torch  # noqa: PLC0415 - vLLM brings it

    return torch


# -- the spec --------------------------------------------------------------------------------


def _attach(worker: KvtierOffloadingWorker, spec: OffloadingSpec) -> bool:
    """Give vLLM's worker-side connector serving ``spec`` two things the OffloadingConnector of
    vLLM 0.32 leaves out for its backends: the block ids of failed loads (vLLM's
    ``get_block_ids_with_load_errors``, which its recompute policy acts on) and this worker's
    counters (``get_kv_connector_stats``). Returns False when that connector is not found."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group  # noqa: PLC0415

    if not has_kv_transfer_group():
        return False
    top = get_kv_transfer_group()
    for conn in [top, *getattr(top, "_connectors", [])]:
        if getattr(getattr(conn, "connector_worker", None), "spec", None) is spec:
            _hook(conn, worker)
            policy = getattr(getattr(conn, "_kv_transfer_config", None), "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                log.warning("kvtier: kv_load_failure_policy is %r: a failed kvtier load fails its request. Set "
                            "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to recompute "
                            "it instead.", policy)
            return True
    return False


def _hook(conn: Any, worker: KvtierOffloadingWorker) -> None:
    errors, stats = conn.get_block_ids_with_load_errors, conn.get_kv_connector_stats

    def load_errors() -> set[int]:
        return set(errors()) | worker.take_failed_block_ids()

    def kv_stats() -> Any:
        own, theirs = worker.counts.take(), stats()
        if own is None or theirs is None:
            return own or theirs
        return own.aggregate(theirs)

    conn.get_block_ids_with_load_errors = load_errors
    conn.get_kv_connector_stats = kv_stats


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` backed by the node's kvtierd (module docstring)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(_METRICS)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _check_supported(config)
        self.settings = KvtierSettings.from_extra(self.extra_config)
        model, s = self.settings.model or config.model.name, self.settings
        # no kvtier_tenant: the daemon's secret salt for this process's tenant, asked for on first use
        ns = Namespace(model, s.tenant) if s.tenant else (lambda: Namespace(model, daemon_key_salt(s.socket, s.timeout_s)))
        self.keymap = KeyMap(ns, self.blocks_per_chunk)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None
        if self.settings.test_corrupt_loads or self.settings.test_fail_loads:
            log.warning("kvtier: test-only fault injection is on (%s): never use it in production",
                        "corrupt loads" if self.settings.test_corrupt_loads else "fail loads")

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            world = self.config.parallel.world_size
            layouts = [group_layout(self.config, r) for r in range(world)]
            self._manager = KvtierOffloadingManager(
                self.settings, self.keymap, layouts, f"vllm-scheduler:{self.config.engine_id}",
                events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            num_blocks = kv_caches.tensors[0].tensor.shape[0]
            self._worker = KvtierOffloadingWorker(
                self.settings, self.keymap, group_layout(self.config, rank, num_blocks), kv_caches,
                f"vllm-worker:{self.config.engine_id}:{rank}")
            if not _attach(self._worker, self):
                self._worker.shutdown()
                self._worker = None
                raise RuntimeError("kvtier: vLLM's OffloadingConnector serving this spec was not found, so "
                                   "failed loads could not be recomputed; use kv_connector OffloadingConnector")
            log.info("kvtier: worker rank %d copies pages %s", rank,
                     "through the daemon's copy engine" if self._worker.mode == "daemon" else "in process")
        return self._worker


__all__ = ["SUPPORTED_VLLM", "KeyMap", "KvtierLoadSpec", "KvtierOffloadingManager", "KvtierOffloadingSpec",
           "KvtierOffloadingWorker", "KvtierSettings", "KvtierStoreSpec", "block_keys_for", "check_vllm_version",
           "group_layout"]

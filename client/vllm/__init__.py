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

Parts, by vLLM's roles: :mod:`~kvtier.client.vllm.version` (the supported vLLM, checked on
import), :mod:`~kvtier.client.vllm.config` (the settings below),
:mod:`~kvtier.client.vllm.keys` (offload keys and KV pages in kvtier's terms),
:mod:`~kvtier.client.vllm.manager` (the scheduler side), :mod:`~kvtier.client.vllm.worker` (the
worker side), :mod:`~kvtier.client.vllm.metrics` (its counters); the spec is here. The
settings parser and the bypass after a failure are the engine adapters' shared core,
:mod:`kvtier.client.engine.adapter`, which SGLang's backend uses too.

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

    Unknown ``kvtier_*`` keys are refused, with the list of valid ones; values are typed.

vLLM's own keys keep their meaning: ``blocks_per_chunk`` (or ``block_size``) and
``offload_prompt_only`` (default true: only prompt blocks are offloaded).

Models with several KV-cache groups
    Sliding-window (Gemma-3, gpt-oss), linear-attention and Mamba (Qwen3-Next and other
    hybrids) groups beside full attention: each offloaded group is a layout of its own
    (:func:`~kvtier.client.vllm.keys.group_layout`), so a block of one group and a block of
    another at the same position are different kvtier blocks; vLLM's scheduler chooses what to
    store and load per group (full-attention chunk boundaries, the sliding window's tail,
    Mamba state at chunk boundaries in "align" mode) and kvtier serves each key of each group.
    The worker copies those pages itself (``kvtier_copy`` ``auto`` or ``process``). A failed or
    partial load fails the whole request's load: vLLM recomputes that request from its start
    (it recomputes block by block only with one group).

Limits: no pipeline or context parallelism (tensor parallelism is supported).
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.client.vllm.version import SUPPORTED_VLLM, check_vllm_version

try:
    import vllm  # (absolute: the vLLM package, not this one)
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("kvtier.client.vllm needs vLLM (pip install -e '.[vllm]' in a kvtier checkout); the rest of kvtier "
                      "does not") from e

check_vllm_version(getattr(vllm, "__version__", "0.0"))

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from kvtier.client.engine.keys import Namespace, daemon_key_salt  # noqa: E402
from kvtier.client.vllm.config import KvtierSettings  # noqa: E402
from kvtier.client.vllm.keys import (  # noqa: E402
    KeyMap,
    KvtierLoadSpec,
    KvtierStoreSpec,
    block_keys_for,
    check_supported,
    group_block_keys,
    group_layout,
    group_layouts,
)
from kvtier.client.vllm.manager import KvtierOffloadingManager  # noqa: E402
from kvtier.client.vllm.metrics import M_LOAD_FAILED, M_LOADED, M_LOOKUPS, M_STORE, METRICS  # noqa: E402
from kvtier.client.vllm.worker import KvtierOffloadingWorker  # noqa: E402

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: its handler, format and level


def _attach(worker: KvtierOffloadingWorker, spec: OffloadingSpec) -> bool:
    """Give vLLM's worker-side connector serving ``spec`` two things the OffloadingConnector
    leaves out for its backends: the failed loads, which its recompute policy acts on, and
    this worker's counters (``get_kv_connector_stats``). Returns False when that connector is
    not found.

    Failed loads reach vLLM as block ids (``get_block_ids_with_load_errors``: it recomputes
    from the first failed block) with one KV-cache group, and as failed receives of their
    requests (``get_transfer_results().failed_recving``: it recomputes the request whole) with
    several, where a block id names a block only within its group."""
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
    if worker.multi_group:
        _hook_failed_requests(conn, worker)


def _hook_failed_requests(conn: Any, worker: KvtierOffloadingWorker) -> None:
    """Report the requests of failed loads as failed receives (several KV-cache groups). The
    connector's worker maps load jobs to requests (``_load_jobs``) until they finish, in the
    very call that drains them from kvtier's worker: read the map before that call."""
    results = conn.get_transfer_results
    jobs = getattr(conn.connector_worker, "_load_jobs", None)
    if not isinstance(jobs, dict):
        raise RuntimeError("kvtier: vLLM's offloading connector keeps no map of load jobs to requests "
                           "(connector_worker._load_jobs), which kvtier needs to report a failed load of a "
                           "model with several KV-cache groups; this vLLM is not supported for such models")

    def transfer_results(finished_req_ids: set[str]) -> Any:
        before = dict(conn.connector_worker._load_jobs)
        out = results(finished_req_ids)
        # (a synchronous load's job maps to None: refused at start with several groups)
        failed = {before[j] for j in worker.take_failed_jobs() if before.get(j) is not None}
        if failed:
            out.failed_recving |= failed
        return out

    conn.get_transfer_results = transfer_results


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` backed by the node's kvtierd (the package docstring)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(METRICS)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of vLLM's ``vllm:kv_offload_config_info`` gauge (0.33) this spec fills."""
        return ("kvtier_socket", "kvtier_copy", "kvtier_groups")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        check_supported(config)
        if len(config.groups) > 1 and int(self.extra_config.get("sync_load_budget_bytes") or 0) > 0:
            raise ValueError("kvtier: sync_load_budget_bytes (vLLM's synchronous loads) with several KV-cache groups: "
                             "vLLM cannot recompute a failed synchronous load of such a model (it recomputes them "
                             "request by request, and only requests still waiting for their load); leave "
                             "sync_load_budget_bytes unset")
        self.settings = KvtierSettings.from_extra(self.extra_config)
        model, s = self.settings.model or config.model.name, self.settings
        # no kvtier_tenant: the daemon's secret salt for this process's tenant, asked for on first use
        ns = Namespace(model, s.tenant) if s.tenant else (lambda: Namespace(model, daemon_key_salt(s.socket, s.timeout_s)))
        self.keymap = KeyMap(ns, self.blocks_per_chunk)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            world = self.config.parallel.world_size
            layouts = [group_layouts(self.config, r) for r in range(world)]
            self._manager = KvtierOffloadingManager(
                self.settings, self.keymap, layouts, f"vllm-scheduler:{self.config.engine_id}",
                events=self.kv_events_config.enable_kv_cache_events,
                group_ids=[g.group_id for g in self.config.groups])
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            num_blocks = kv_caches.tensors[0].tensor.shape[0]
            self._worker = KvtierOffloadingWorker(
                self.settings, self.keymap, group_layouts(self.config, rank, num_blocks), kv_caches,
                f"vllm-worker:{self.config.engine_id}:{rank}")
            if not _attach(self._worker, self):
                self._worker.shutdown()
                self._worker = None
                raise RuntimeError("kvtier: vLLM's OffloadingConnector serving this spec was not found, so "
                                   "failed loads could not be recomputed; use kv_connector OffloadingConnector")
            log.info("kvtier: worker rank %d copies pages %s", rank,
                     "through the daemon's copy engine" if self._worker.mode == "daemon" else "in process")
        return self._worker


__all__ = ["M_LOADED", "M_LOAD_FAILED", "M_LOOKUPS", "M_STORE", "SUPPORTED_VLLM", "KeyMap", "KvtierLoadSpec",
           "KvtierOffloadingManager", "KvtierOffloadingSpec", "KvtierOffloadingWorker", "KvtierSettings",
           "KvtierStoreSpec", "block_keys_for", "check_vllm_version", "group_block_keys", "group_layout", "group_layouts"]

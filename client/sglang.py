"""SGLang HiCache L3 storage on the node's kvtierd: :class:`KvtierHiCacheStorage`.

SGLang loads it with its "dynamic" storage backend (docs/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"kvtier","module_path":"kvtier.client.sglang",
        "class_name":"KvtierHiCacheStorage","interface_v1":1}'

SGLang's storage factory constructs it as ``KvtierHiCacheStorage(storage_config, kwargs)`` and
then calls ``register_mem_pool_host(host_pool)`` with its ``MHATokenToKVPoolHost`` or
``MLATokenToKVPoolHost``. With ``interface_v1`` its cache controller calls:

* ``batch_exists(keys)``: how many leading pages are stored; answered from the daemon's
  shared-memory key table (:meth:`Sidecar.prefix_length`), no RPC;
* ``batch_get_v1(keys, host_indices)`` / ``batch_set_v1(keys, host_indices)``: copy pages
  between the host pool (page ``i`` starts at host row ``host_indices[i * page_size]``) and
  kvtier's host pool; per-page success.

A hybrid model's ``HybridCacheController`` also registers its other host pools
(``register_mem_host_pool_v2``) and moves them with the v2 calls, one ``PoolTransfer`` per pool:
``batch_set_v2`` / ``batch_get_v2`` and ``batch_exists_v2`` (the usable prefix under each pool's
hit policy: ``all_pages``, or ``trailing_pages`` for a sliding window's last pages and the Mamba
state at a stop point). The backend stores the sliding-window pool (``swa``, an MHA/MLA host
pool, copied as the KV pool is) and the Mamba state pool (``mamba``: one state per slot, copied
as the pool's own flat page), each under keys and a layout of its own; other pools (DSA indexer,
DeepSeek-V4 compressed state, draft pools) are refused when they register.

A page's bytes are the host pool's own flat page (``get_data_page(index, flat=True)``): for the
``layer_first`` layout the page's rows of every layer's K and V, for ``page_first`` the page's
K rows then its V rows (MLA: one contiguous run), for ``page_first_direct`` the page's block.
The copy goes through the page's view (``get_data_page(index, flat=False)``): a contiguous page
(MLA's ``page_first`` and ``page_first_direct``) is read by the sidecar straight out of, or
written straight into, SGLang's pool (one copy); a strided one (every MHA page: its K and V
halves lie apart) goes through a reusable staging buffer. A get writes only the pages the daemon
holds: a miss leaves its page untouched.

Keys. SGLang's page keys are strings (chained page hashes) that name tokens, not a model or a
shard; the backend maps each to a 16-byte kvtier key with blake2b keyed by the namespace
(:class:`~kvtier.client.engine.keys.Namespace`: model and tenant), the shard (pipeline stage;
tensor-parallel rank and size, which MLA models leave out: their KV is replicated across TP
ranks; context-parallel and decode-context-parallel ranks) and the key epoch (below). The
kvtier :class:`~kvtier.tiers.layout.Layout` is the host pool's buffer (dtype, shape, the
page or token dimension, the layout name) with the TP rank and size, so its fingerprint, too,
tells layouts and ranks apart.

``clear()``: kvtier has no delete-by-namespace; each shard keeps a random 16-byte key epoch in
kvtierd (a small marker block), hashed into every key. ``clear()`` replaces it, so nothing
stored before is visible again; the old pages age out by LRU. Other processes serving the same
shard pick the new epoch up within ``kvtier_epoch_refresh_s``. The marker is stored durably
where the daemon has a disk tier (it survives a restart with the pages on disk); a marker lost
anyway is replaced by a new epoch: the cache starts cold, never stale.

Failures: a daemon that is gone, restarting or stuck never raises into SGLang's cache
controller: the call answers misses (``False`` per page, 0 pages present), the failure is
counted (:meth:`KvtierHiCacheStorage.kvtier_stats`), and for ``kvtier_retry_s`` later calls
answer misses at once; then a connect to the unix socket (microseconds) says whether to try
the daemon again, through a new sidecar, re-reading the key epoch. The first call after the
daemon dies waits up to ``kvtier_timeout_s``. That bypass is the engine adapters' shared
:class:`~kvtier.client.engine.adapter.Breaker`, as in vLLM's spec. Configuration errors (an
unknown ``kvtier_*`` key, refused with the list of valid ones; a value of the wrong type; an
unsupported pool or layout) raise at attach.

SGLang is not a dependency of kvtier. With SGLang importable the class derives from its
``HiCacheStorage`` (the factory checks); without it from a stand-in (the class implements
every method itself), so this module imports, and the backend runs, anywhere kvtier and torch
do (the tests use that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
except ImportError as _torch_missing:  # pragma: no cover - the torch extra is what this module needs
    raise ImportError("kvtier.client.sglang copies SGLang's torch host pools and needs torch: "
                      "pip install -e '.[torch]' in a kvtier checkout (SGLang brings torch with it)") from _torch_missing

from kvtier.client.engine import adapter
from kvtier.client.engine.adapter import Breaker, accepts_connections, is_down_error, setting
from kvtier.client.engine.keys import Namespace
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.engine.transport import FailedPrecondition, KvtierError, Unavailable
from kvtier.tiers.layout import DTYPE_BYTES, Layout, TensorSpec

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _HiCacheStorageBase
    SGLANG_IMPORT_ERROR: ImportError | None = None
except ImportError as _sglang_missing:  # kvtier never requires SGLang
    SGLANG_IMPORT_ERROR = _sglang_missing

    class _HiCacheStorageBase:  # type: ignore[no-redef]
        """Stand-in for ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` where SGLang is not
        importable (install SGLang, e.g. ``pip install sglang``, in the engine's environment to
        load this backend from SGLang)."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

SGLANG_AVAILABLE = SGLANG_IMPORT_ERROR is None

try:  # the v2 (hybrid pools) interface's types, where this SGLang has them
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult
    _KV: Any = PoolName.KV
    _ALL_PAGES: Any = PoolHitPolicy.ALL_PAGES
    _TRAILING_PAGES: Any = PoolHitPolicy.TRAILING_PAGES
except ImportError:
    _KV, _ALL_PAGES, _TRAILING_PAGES = "kv", "all_pages", "trailing_pages"

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        """Stand-in for SGLang's ``PoolTransferResult`` (the v2 hit query's answer)."""

        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: list[int] | None = None

__all__ = ["SGLANG_AVAILABLE", "BackendConfig", "KvtierHiCacheStorage", "page_layout", "shard_identity"]

logger = logging.getLogger(__name__)

KEY_SCHEME = "sglang-hicache/1"
EPOCH_BYTES = 16
PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # tested; others are refused
EXTRA_CONFIG = "--hicache-storage-backend-extra-config"


# -- configuration ------------------------------------------------------------------------------

def _mib(raw: Any) -> int:
    try:
        return max(1, int(float(raw) * (1 << 20)))
    except (TypeError, ValueError):
        raise ValueError("a number (MiB)") from None


@dataclass(frozen=True)
class BackendConfig:
    """The ``kvtier_*`` keys of ``--hicache-storage-backend-extra-config`` (docs/sglang.md), parsed by
    the adapters' one parser (:func:`kvtier.client.engine.adapter.parse_extra`): unknown
    ``kvtier_*`` keys are refused."""

    socket: str | None = None        # kvtier_socket: the daemon's unix socket (else $KVTIER_SOCKET, the default)
    target: str | None = None        # kvtier_target: a gRPC target instead (no key table: lookups are RPCs)
    model: str = ""                  # kvtier_model: the namespace's model id (else SGLang's model name)
    tenant: str = ""                 # kvtier_tenant: tenant salt; tenants never share pages
    timeout_s: float = adapter.timeout_setting("sglang")  # kvtier_timeout_s: one daemon call
    retry_s: float = adapter.retry_setting("sglang")      # kvtier_retry_s: after a failure, answer misses this long
    # kvtier_staging_mib: bytes copied per daemon call (and staging)
    staging_bytes: int = setting(64 << 20, key="kvtier_staging_mib", parse=_mib)
    durable: bool = False            # kvtier_durable: puts return once the pages are on disk
    epoch_refresh_s: float = 10.0    # kvtier_epoch_refresh_s: re-read the shard's key epoch this often

    @classmethod
    def from_extra_config(cls, extra: dict | None, model_name: str | None) -> BackendConfig:
        config = adapter.parse_extra(cls, extra, EXTRA_CONFIG)
        return config if config.model else dataclasses.replace(config, model=str(model_name or ""))


def shard_identity(storage_config: Any) -> dict:
    """What tells this rank's pages from other ranks' (HiCacheStorageConfig fields): the pipeline
    stage; the TP rank and size unless the model is MLA (its KV is replicated across TP ranks,
    one rank writes and all read); context-parallel and DCP ranks where they split pages."""
    c = storage_config
    ident: dict = {"pp": [int(c.pp_rank), int(c.pp_size)]}
    if not c.is_mla_model:
        ident["tp"] = [int(c.tp_rank), int(c.tp_size)]
    if int(getattr(c, "attn_cp_size", 1)) > 1:
        ident["cp"] = [int(c.attn_cp_rank), int(c.attn_cp_size)]
    if int(getattr(c, "dcp_size", 1)) > 1:
        ident["dcp"] = [int(c.dcp_rank), int(c.dcp_size), int(c.logical_page_size or 0)]
    return ident


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _block_dim(buffer: torch.Tensor, page: torch.Tensor, page_size: int, pool_size: int) -> tuple[int, bool]:
    """The dimension of ``buffer`` the page view ``page`` cuts, and whether it is token-indexed
    (``page_size`` rows of ``pool_size``) rather than page-indexed (one of the pages)."""
    if buffer.dim() != page.dim():
        raise ValueError(f"page view {tuple(page.shape)} is not a slice of buffer {tuple(buffer.shape)}")
    cut = [d for d in range(buffer.dim()) if buffer.shape[d] != page.shape[d]]
    if len(cut) != 1:
        raise ValueError(f"page view {tuple(page.shape)} is not a slice along one dimension of "
                         f"buffer {tuple(buffer.shape)}")
    d = cut[0]
    if page.shape[d] == page_size and buffer.shape[d] == pool_size:
        return d, True
    if page.shape[d] == 1:
        return d, False
    raise ValueError(f"page view cuts dimension {d} to {page.shape[d]}; expected {page_size} rows or one page")


def page_layout(host_pool: Any, storage_config: Any, pool: str = "kv") -> Layout:
    """The kvtier layout of one SGLang page of ``host_pool`` for this rank.

    One tensor, the pool's ``kv_buffer`` (dtype and shape as allocated; the page or token
    dimension found from the pool's own page view), named after the model kind, the pool (a
    hybrid model's sliding-window pool: ``swa``; the KV pool is unnamed), the host layout and
    the pool's storage format tag, with the TP rank and size (MLA: 0 and 1, shared by all
    ranks). Its block is the page's flat bytes."""
    buffer = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{type(host_pool).__name__} has no single kv_buffer tensor; kvtier stores the plain "
                         f"MHA/MLA KV pool (layouts {', '.join(PAGE_LAYOUTS)})")
    page = host_pool.get_data_page(0, flat=False)
    if not isinstance(page, torch.Tensor) or page.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        # (a pool whose page is decoded into a temporary, say: a get would fill the temporary
        # and leave the host pool as it was, reporting a hit)
        raise ValueError(f"{type(host_pool).__name__}'s pages are not views of its kv_buffer; kvtier copies "
                         f"pages in place and cannot store this pool")
    d, token_indexed = _block_dim(buffer, page, int(host_pool.page_size), int(host_pool.size))
    name = ".".join(filter(None, ["sglang", "mla" if storage_config.is_mla_model else "mha",
                                  None if pool == "kv" else pool, host_pool.layout,
                                  getattr(host_pool, "storage_format_tag", None)]))
    # the KV's own dtype where the buffer stores it as bytes (SGLang keeps both fp8 formats as
    # uint8): e4m3 and e5m2 pages must never meet on one key
    logical = getattr(getattr(host_pool, "device_pool", None), "dtype", None)
    if isinstance(logical, torch.dtype) and logical != buffer.dtype:
        name = f"{name}@{_dtype_name(logical)}"
    elif buffer.dtype in (torch.uint8, torch.int8) and logical is None:
        raise ValueError(f"{type(host_pool).__name__} stores its KV as {_dtype_name(buffer.dtype)} and names no "
                         f"device pool dtype: kvtier cannot tell which KV format its bytes are")
    dtype, shape = _dtype_name(buffer.dtype), tuple(int(x) for x in buffer.shape)
    if dtype not in DTYPE_BYTES:  # described as bytes; the dtype stays in the name
        name, shape = f"{name}.{dtype}", (*shape[:-1], shape[-1] * buffer.element_size())
        dtype = "uint8"
    mla = bool(storage_config.is_mla_model)
    tp_rank, tp_size = (0, 1) if mla else (int(storage_config.tp_rank), int(storage_config.tp_size))
    layout = Layout((TensorSpec(name, dtype, shape, d, token_indexed),), int(host_pool.page_size), tp_rank, tp_size)
    if layout.block_bytes != page.numel() * page.element_size():
        raise ValueError(f"layout block {layout.block_bytes} bytes != page view {page.numel() * page.element_size()}")
    return layout


MAMBA_LAYOUTS = ("page_first", "page_first_direct")  # MambaPoolHost's own (it refuses layer_first)


def _is_mamba_pool(host_pool: Any) -> bool:
    return all(hasattr(host_pool, a) for a in ("temporal_buffer", "conv_buffer", "size_per_token",
                                               "get_data_page", "set_from_flat_data_page"))


def mamba_layout(host_pool: Any, storage_config: Any) -> Layout:
    """The kvtier layout of one state slot of SGLang's ``MambaPoolHost`` (page size 1): its
    temporal (SSM) state, its conv states and any per-slot side state, in the order of the pool's
    own flat page (``get_data_page``: each component's bytes, one after the other). Mamba state
    is sharded across TP ranks even where the model's attention is MLA: the TP rank and size are
    always part of it."""
    if getattr(host_pool, "layout", None) not in MAMBA_LAYOUTS:
        raise ValueError(f"kvtier stores Mamba state in the layouts {', '.join(MAMBA_LAYOUTS)}, not "
                         f"{getattr(host_pool, 'layout', None)!r}")
    if int(host_pool.page_size) != 1:
        raise ValueError(f"a Mamba host pool holds one state per slot (page size 1), not {host_pool.page_size}")
    parts = [("temporal", host_pool.temporal_buffer)]
    parts += [(f"conv{i}", b) for i, b in enumerate(host_pool.conv_buffer)]
    parts += [(f"state{i}", b) for i, b in enumerate(getattr(host_pool, "slot_state_buffers", None) or [])]
    specs = []
    for label, buf in parts:
        if buf.numel() == 0:  # (conv-only linear attention has no SSM state; its page leaves it out too)
            continue
        if int(buf.shape[0]) != int(host_pool.size):
            raise ValueError(f"Mamba {label} buffer {tuple(buf.shape)} is not indexed by state slot first")
        dtype, shape = _dtype_name(buf.dtype), tuple(int(x) for x in buf.shape)
        name = f"sglang.mamba.{host_pool.layout}.{label}"
        if dtype not in DTYPE_BYTES:
            name, shape, dtype = f"{name}.{dtype}", (*shape[:-1], shape[-1] * buf.element_size()), "uint8"
        specs.append(TensorSpec(name, dtype, shape, 0, True))
    layout = Layout(tuple(specs), 1, int(storage_config.tp_rank), int(storage_config.tp_size))
    page = int(host_pool.get_dummy_flat_data_page().numel())
    if layout.block_bytes != page:
        raise ValueError(f"Mamba layout block {layout.block_bytes} bytes != the pool's flat page {page} bytes")
    return layout


# -- byte views -----------------------------------------------------------------------------------

def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 array over the same memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _as_typed(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Flat bytes ``arr`` as a tensor shaped and typed like ``like`` (same memory)."""
    return torch.from_numpy(arr).view(like.dtype).view(like.shape)


class _Staging(threading.local):
    """A per-thread buffer strided pages are gathered into (puts) and scattered from (gets)."""

    buf: np.ndarray | None = None

    def slots(self, n: int, size: int) -> list[np.ndarray]:
        if self.buf is None or self.buf.size < n * size:
            self.buf = np.empty(n * size, dtype=np.uint8)
        return [self.buf[i * size:(i + 1) * size] for i in range(n)]


def _storage_metrics_class() -> Any:
    """SGLang's ``StorageMetrics`` class (its module moved between SGLang versions), or None."""
    for module in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
        try:
            return importlib.import_module(module).StorageMetrics
        except (ImportError, AttributeError):
            continue
    return None


# -- the backend ----------------------------------------------------------------------------------

@dataclass
class _Pool:
    """A hybrid model's extra host pool that the backend stores (v2 interface): its sliding-window
    KV pool (pages copied through the pool's page views, as the KV pool's) or its Mamba state pool
    (one state per slot, copied as the pool's own flat page)."""

    name: str
    host: Any
    layout: Layout
    page_len: int
    chunk: int
    flat: bool          # pages are the pool's flat copies (get_data_page / set_from_flat_data_page)
    tag: bytes          # mixed into the pool's keys: its pages never meet the KV pool's or each other's
    lid: int = 0        # the daemon's layout id (0 until registered)


_COUNTERS = ("exists_calls", "exists_pages", "exists_hit_pages", "get_pages", "get_hit_pages", "set_pages",
             "set_stored_pages", "set_present_pages", "set_failed_pages", "daemon_failures", "errors",
             "skipped_while_down_pages", "epoch_changes", "pool_get_pages", "pool_get_hit_pages", "pool_set_pages",
             "pool_set_stored_pages")


class KvtierHiCacheStorage(_HiCacheStorageBase):
    """SGLang ``HiCacheStorage`` on kvtierd (module docstring). ``storage_config`` is SGLang's
    ``HiCacheStorageConfig`` (or an object with its fields); ``kwargs`` what the factory passes."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None) -> None:
        if SGLANG_IMPORT_ERROR is not None:
            logger.info("SGLang is not importable here (%s): KvtierHiCacheStorage runs on a stand-in base; "
                        "SGLang itself loads it only where SGLang is installed", SGLANG_IMPORT_ERROR)
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvtier does not store split-head pages (tp_lcm_size): drop tp_lcm_size from the "
                             "extra config")
        if int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
            raise ValueError("kvtier does not store decode-context-parallel pages (dcp_size > 1); SGLang's storage "
                             "paths do not support them either")
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra_config(getattr(storage_config, "extra_config", None),
                                                      getattr(storage_config, "model_name", None))
        if self.config.target and not self.config.tenant:  # a configuration error: said at attach, not retried
            raise ValueError("kvtier_target (TCP) needs kvtier_tenant: the daemon hands out its secret key salt "
                             "only over its unix socket")
        if not self.config.model:
            logger.warning("kvtier: no model name from SGLang and no kvtier_model: pages are shared by every "
                           "model of this tenant with the same KV geometry; set kvtier_model")
        self.shard = shard_identity(storage_config)
        self.namespace: Namespace | None = None  # the tenant salt: kvtier_tenant, else the daemon's (at connect)
        if self.config.tenant:
            self._set_namespace(self.config.tenant)
        self.mem_pool_host: Any = None
        self.layout: Layout | None = None
        self._pools: dict[str, _Pool] = {}  # a hybrid model's sliding-window and Mamba pools, by name
        self._sc = self._new_sidecar()
        self._lock = threading.RLock()     # readiness, epoch, down state
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}
        # SGLang's StorageMetrics (where this SGLang has it): without it nothing is recorded
        self._storage_metrics = _storage_metrics_class() if getattr(storage_config, "enable_storage_metrics",
                                                                    False) else None
        self._lid = self._marker_lid = 0
        self._epoch: bytes | None = None
        self._epoch_digest = b""
        self._epoch_at = 0.0
        self._marker_durable = True
        self._awaited: tuple[bytes | None, float] | None = None  # (epoch cleared, until when) on MLA ranks > 0
        # after a failed call: answer misses for retry_s, then attach again in the background
        self.breaker = Breaker(self.config.retry_s, logger)
        self.last_error = ""
        self._staging = _Staging()

    # -- registration ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool; raises (failing the attach) for a pool or layout kvtier
        cannot store."""
        layout_name = getattr(mem_pool_host, "layout", None)
        if layout_name not in PAGE_LAYOUTS:
            raise ValueError(f"kvtier supports the host layouts {', '.join(PAGE_LAYOUTS)}, not {layout_name!r}: "
                             f"set --hicache-mem-layout")
        layout = page_layout(mem_pool_host, self.storage_config)
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host, self.layout = mem_pool_host, layout
        self._page_len = int(mem_pool_host.page_size)  # (SGLang reads page i at host_indices[i * page_size])
        self._chunk = max(1, self.config.staging_bytes // layout.block_bytes)
        self._attach()  # registers now if the daemon is up; otherwise in the background, later

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one pool of a hybrid model's host pool group (SGLang's HybridCacheController
        registers each after the KV pool): its sliding-window KV pool (``swa``: an MHA/MLA host
        pool in one of :data:`PAGE_LAYOUTS`) or its Mamba state pool (``mamba``). Any other pool
        (DSA indexer, DeepSeek-V4 compressed state, speculative-decoding draft pools) is refused:
        raises, failing the attach, with the reason and what serves it instead."""
        name = str(host_pool_name)
        if name == "kv" and (self.mem_pool_host is None or host_pool is self.mem_pool_host):
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            return
        if name == "swa" and isinstance(getattr(host_pool, "kv_buffer", None), torch.Tensor):
            if getattr(host_pool, "layout", None) not in PAGE_LAYOUTS:
                raise ValueError(f"kvtier supports the host layouts {', '.join(PAGE_LAYOUTS)}, not "
                                 f"{getattr(host_pool, 'layout', None)!r}: set --hicache-mem-layout")
            layout, flat, ident = page_layout(host_pool, self.storage_config, pool=name), False, {"pool": name}
        elif name == "mamba" and _is_mamba_pool(host_pool):
            layout, flat = mamba_layout(host_pool, self.storage_config), True
            # Mamba state is TP-sharded even where MLA's KV is shared across ranks
            ident = {"pool": name, "tp": [int(self.storage_config.tp_rank), int(self.storage_config.tp_size)]}
        else:
            raise NotImplementedError(
                f"kvtier stores the KV pool and a hybrid model's sliding-window (swa) and Mamba (mamba) pools, not "
                f"pool {name} ({type(host_pool).__name__}): serve this model with SGLang's hierarchical cache "
                f"without --hicache-storage-backend, or with SGLang's file or mooncake storage backend, which "
                f"store that pool")
        tag = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
        pool = _Pool(name, host_pool, layout, int(host_pool.page_size),
                     max(1, self.config.staging_bytes // layout.block_bytes), flat, tag)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[name] = pool
        if self.layout is not None:
            self._attach()  # registers the pool's layout now if the daemon is up; otherwise later

    def on_host_pools_registered(self) -> None:
        pass

    # -- SGLang's v1 interface -------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored (in any kvtier tier), from the key table."""
        self._count(exists_calls=1, exists_pages=len(keys))
        if not keys or not self._ready():
            return 0
        try:
            n = self._sc.prefix_length(self._lid, self._keys(keys))[1]
        except Exception as e:
            self._failed("batch_exists", e)
            return 0
        self._count(exists_hit_pages=n)
        return n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Copy the stored pages into the host pool at ``host_indices``; per page, whether it was
        found and copied (a miss leaves its page as it was)."""
        self._count(get_pages=len(keys))
        ok = self._page_batch("batch_get_v1", keys, host_indices, self._get_pages, "prefetch")
        if ok is not None:
            self._count(get_hit_pages=sum(ok))
            return ok
        return [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; per page, whether it is
        stored now (written, or already held)."""
        self._count(set_pages=len(keys))
        ok = self._page_batch("batch_set_v1", keys, host_indices, self._set_pages, "backup")
        if ok is not None:
            self._count(set_failed_pages=len(ok) - sum(ok))
            return ok
        self._count(set_failed_pages=len(keys))
        return [False] * len(keys)

    def _page_batch(self, what: str, keys: list[str], host_indices: torch.Tensor,
                    move: Callable[[list[bytes], Any], list[bool]], metric: str) -> list[bool] | None:
        """Run one v1 page batch (``move`` of the kvtier keys and the pool's pages) and time it;
        None when nothing was moved: no usable pages, no keys, no daemon, or a failure (counted
        and logged by :meth:`_failed`)."""
        pages = self._pages(keys, host_indices)
        if pages is None or not keys or not self._ready():
            self._missed(keys)
            return None
        t0 = time.perf_counter()
        try:
            ok = move(self._keys(keys), pages)
        except Exception as e:
            self._failed(what, e)
            return None
        self._metric(metric, len(keys), time.perf_counter() - t0)
        return ok

    # -- SGLang's v2 interface: a hybrid model's pools ------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The usable prefix of ``keys`` with every pool it needs (SGLang's ``PoolTransferResult``):
        the KV pages held from the start, cut by each extra pool's hit policy: ``all_pages``
        needs the pool's page at every position, ``trailing_pages`` (sliding window, Mamba) only
        the last ``len(transfer.keys)`` pages before a stop point. ``restorable_prefix_pages``
        lists every stop point all pools can resume from (a trailing pool leaves holes)."""
        self._count(exists_calls=1, exists_pages=len(keys))
        if not keys or not self._ready():
            return PoolTransferResult(0, {}, [])
        try:
            kv_pages = self._sc.prefix_length(self._lid, self._keys(keys))[1]
            hits: dict = {_KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                pool = self._pool(transfer)
                if pool is None or not pool.lid:
                    restorable = []
                    break
                held = [t is not None for t in self._sc.lookup(pool.lid, self._keys(keys[:kv_pages], pool))]
                policy = getattr(transfer, "hit_policy", _ALL_PAGES)
                if policy == _ALL_PAGES:
                    boundary = held.index(False) if False in held else kv_pages
                    stops = set(range(1, boundary + 1))
                elif policy == _TRAILING_PAGES:
                    window = max(1, len(transfer.keys) if transfer.keys else 1)
                    stops = {n for n in range(1, kv_pages + 1) if all(held[max(0, n - window):n])}
                    boundary = max(stops, default=0)
                else:  # (a policy of pools kvtier does not store: refused when they register)
                    logger.error("kvtier batch_exists_v2: pool %s has hit policy %s, which kvtier does not serve",
                                 pool.name, policy)
                    stops, boundary = set(), 0
                if boundary:
                    hits[transfer.name] = boundary
                restorable = [n for n in restorable if n in stops]
        except Exception as e:
            self._failed("batch_exists_v2", e)
            return PoolTransferResult(0, {}, [])
        final = restorable[-1] if restorable else 0
        self._count(exists_hit_pages=final)
        return PoolTransferResult(final, hits, restorable)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict:
        """Read each transfer's pages into its pool (``host_indices`` of that pool, page ``i`` at
        ``host_indices[i * pool page size]``); per pool name, per page, whether it was read."""
        return self._pool_batch("batch_get_v2", transfers, get=True)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict:
        """Store each transfer's pages of its pool; per pool name, per page, whether it is stored."""
        return self._pool_batch("batch_set_v2", transfers, get=False)

    def _pool(self, transfer: Any) -> _Pool | None:
        name = str(transfer.name)
        pool = self._pools.get(name)
        if pool is None and name != "kv":
            self._count(errors=1)
            logger.error("kvtier: pool %s was not registered (register_mem_host_pool_v2)", name)
        return pool

    def _pool_batch(self, what: str, transfers: Any, get: bool) -> dict:
        out: dict = {}
        ready = self._ready()
        for transfer in transfers or []:
            keys = list(transfer.keys or [])
            out[transfer.name] = [False] * len(keys)
            if not keys:
                continue
            if str(transfer.name) == "kv":  # the KV pool through v2: as batch_get_v1 / batch_set_v1
                fn = self.batch_get_v1 if get else self.batch_set_v1
                out[transfer.name] = fn(keys, transfer.host_indices)
                continue
            self._count(**{"pool_get_pages" if get else "pool_set_pages": len(keys)})
            pool = self._pool(transfer)
            if pool is None:
                continue
            pages = self._pages(keys, transfer.host_indices, pool)
            if pages is None or not ready or not pool.lid:
                self._missed(keys)
                if ready and not pool.lid:
                    self._in_background()  # (registers the pool's layout once the daemon answers)
                continue
            try:
                kkeys = self._keys(keys, pool)
                ok = self._get_pages(kkeys, pages, pool) if get else self._set_pages(kkeys, pages, pool)
            except Exception as e:
                self._failed(what, e)
                continue
            if get:
                self._count(pool_get_hit_pages=sum(ok))
            out[transfer.name] = ok
        return out

    # -- the interface's other (older) methods: flat pages as tensors ------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Flat pages (``get_dummy_flat_data_page`` tensors, filled on a hit; new ones where a
        target is None); None per miss."""
        self._count(get_pages=len(keys))
        if not keys or not self._ready():
            self._missed(keys)
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        outs = [t if t is not None else self._flat_page() for t in targets]
        if len(outs) != len(keys) or not all(self._is_flat_page(t) for t in outs):
            self._count(errors=1)
            logger.error("kvtier batch_get: targets must be %d contiguous CPU tensors of %d bytes",
                         len(keys), self.layout.block_bytes if self.layout else 0)
            return [None] * len(keys)
        try:
            got = self._sc.get(self._lid, self._keys(keys), out=[_bytes_of(t) for t in outs])
        except Exception as e:
            self._failed("batch_get", e)
            return [None] * len(keys)
        self._count(get_hit_pages=sum(g is not None for g in got))
        return [t if g is not None else None for t, g in zip(outs, got, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages (``get_data_page(index)`` tensors); True if all are stored."""
        self._count(set_pages=len(keys))
        vals = list(values) if values is not None else []
        if not keys or not self._ready() or len(vals) != len(keys):
            self._count(set_failed_pages=len(keys))
            return False
        try:
            res = self._sc.put(self._lid, self._keys(keys), [v.contiguous() for v in vals], durable=self.config.durable)
        except Exception as e:
            self._failed("batch_set", e)
            self._count(set_failed_pages=len(keys))
            return False
        self._count(set_stored_pages=res.stored, set_present_pages=res.present, set_failed_pages=len(res.dropped))
        return not res.dropped

    def clear(self) -> bool:
        """Make every page stored so far invisible (a new key epoch for this shard; module docstring)."""
        if not self._ready():
            return False
        if "tp" not in self.shard and int(self.storage_config.tp_rank) != 0:
            # MLA: the TP ranks share one shard, and SGLang clears every rank: rank 0 (the one
            # that writes MLA pages) makes the new epoch; the others re-read it (each making its
            # own, they raced, and rank 0 then wrote under an epoch the others did not read)
            with self._lock:
                self._awaited = (self._epoch, time.monotonic() + self.config.epoch_refresh_s)
                self._epoch_at = 0.0
            return True
        try:
            with self._lock:
                self._sc.evict(self._marker_lid, [self._marker_key])
                self._set_epoch(self._load_epoch())
        except Exception as e:
            self._failed("clear", e)
            return False
        logger.info("kvtier: storage cleared (new key epoch for shard %s)", self.shard)
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup since the last call)
        when storage metrics are on; else None. kvtier's counters: :meth:`kvtier_stats`."""
        if self._storage_metrics is None:
            return None
        m = self._storage_metrics()
        with self._stats_lock:
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def kvtier_stats(self) -> dict:
        """Counters of this backend (pages asked, found, stored; daemon failures; misses answered
        while the daemon was down) and its state."""
        with self._stats_lock:
            out: dict = dict(self._counts)
        out.update(ready=bool(self._lid and self._epoch), down=self.breaker.down, last_error=self.last_error,
                   epoch=self._epoch.hex() if self._epoch else "",
                   layout_fingerprint=self.layout.fingerprint.hex() if self.layout else "", shard=self.shard)
        return out

    def close(self) -> None:
        self.breaker.close()
        with contextlib.suppress(Exception):
            self._sc.close()

    # -- readiness, epochs, failures ----------------------------------------------------------

    def _ready(self) -> bool:
        """Registered with the daemon and holding the shard's key epoch; False while down
        (misses are answered without calling). Reconnecting and refreshing the epoch run on a
        thread of their own, never on SGLang's: a daemon that is stopped but still accepts
        connections would hold each of SGLang's storage threads for ``timeout_s`` (and with it
        every TP rank, whose answers SGLang all-reduces)."""
        if self.layout is None:
            return False
        if self._epoch is not None and not self.breaker.down:
            if time.monotonic() >= self._epoch_at:
                self._in_background()  # (the epoch in hand serves meanwhile)
            return True
        if not self.breaker.bypassed():
            self._in_background()
        return False

    def _in_background(self) -> None:
        """Start :meth:`_attach` on a thread of its own unless one is running (never waits: the
        running one holds ``_lock`` through its calls)."""
        self.breaker.in_background(self._attach, "kvtier-sglang-attach")

    def _attach(self) -> bool:
        """Register with the daemon and take the shard's key epoch when the daemon is reachable
        (at most ``timeout_s`` a call); False when it is not."""
        now = time.monotonic()
        with self._lock:
            if self.breaker.bypassed():
                return False
            # a connect, not a call that would wait for the daemon
            if not accepts_connections(self.config.socket, self.config.target):
                self._failed("connect", Unavailable(f"nothing listens at {self._sc.target}"))
                return False
            if self.breaker.down:
                self._renew_sidecar()
            try:
                self._connect(now)
            except Exception as e:
                self._failed("connect", e)
                return False
            self.breaker.ok(self._sc.target)
            return True

    def _new_sidecar(self) -> Sidecar:
        return Sidecar(self.config.socket, target=self.config.target, timeout=self.config.timeout_s,
                       client_name=f"sglang-hicache:tp{self.storage_config.tp_rank}:pid{os.getpid()}")

    def _renew_sidecar(self) -> None:
        """After an outage, talk to the daemon through a new sidecar: new registrations, pool
        mappings and session. (A sidecar whose own restart recovery failed while the daemon was
        down can open a session on the restarted daemon and read its lease offsets from the old
        daemon's pool mapping; a new one cannot.) The old one is closed once a call still on it
        has surely ended (its deadline, twice over)."""
        old, self._sc = self._sc, self._new_sidecar()
        self._lid = self._marker_lid = 0
        for pool in self._pools.values():
            pool.lid = 0

        def close_old() -> None:
            with contextlib.suppress(Exception):
                old.close()

        t = threading.Timer(2 * self.config.timeout_s + 1.0, close_old)
        t.daemon = True
        t.start()

    def _set_namespace(self, salt: str) -> None:
        if not salt:
            raise FailedPrecondition("no tenant key salt: over kvtier_target (TCP) set kvtier_tenant; the daemon "
                                     "hands out its secret salt only over its unix socket")
        self.namespace = Namespace(self.config.model, salt)
        blob = json.dumps({"scheme": KEY_SCHEME, "shard": self.shard}, sort_keys=True, separators=(",", ":"))
        self._shard_digest = hashlib.blake2b(blob.encode(), digest_size=32, key=self.namespace.digest()).digest()
        self._marker_key = hashlib.blake2b(b"epoch", digest_size=16, key=self._shard_digest).digest()

    def _connect(self, now: float) -> None:
        if self.namespace is None:  # no kvtier_tenant: the daemon's secret salt for this client's tenant
            self._set_namespace(self._sc.key_salt)
        if not (self._lid and self._marker_lid):  # (registering again is a no-op in the sidecar)
            self._lid = self._sc.register_layout(self.layout)
            self._marker_lid = self._sc.register_layout(Layout.flat(EPOCH_BYTES, block_tokens=1, name="sglang.epoch"))
        for pool in list(self._pools.values()):
            if not pool.lid:
                pool.lid = self._sc.register_layout(pool.layout)
        if self._epoch is None or now >= self._epoch_at:
            self._set_epoch(self._load_epoch())

    def _load_epoch(self) -> bytes:
        """The shard's key epoch as kvtierd holds it, storing a new random one if it holds none."""
        got = self._sc.get(self._marker_lid, [self._marker_key])[0]
        if got is None:
            self._put_marker(os.urandom(EPOCH_BYTES))
            got = self._sc.get(self._marker_lid, [self._marker_key])[0]  # another process's may have won
            if got is None:
                raise Unavailable("the key epoch marker could not be stored")
        return bytes(got)

    def _put_marker(self, epoch: bytes) -> None:
        """Store the epoch marker, on disk where the daemon has a disk tier (it outlives a restart
        there, with the pages on disk)."""
        if self._marker_durable:
            try:
                self._sc.put(self._marker_lid, [self._marker_key], [epoch], durable=True)
                return
            except FailedPrecondition:  # no disk tier
                self._marker_durable = False
        self._sc.put(self._marker_lid, [self._marker_key], [epoch])

    def _set_epoch(self, epoch: bytes) -> None:
        if self._epoch is not None and epoch != self._epoch:
            self._count(epoch_changes=1)
        self._epoch = epoch
        self._epoch_digest = hashlib.blake2b(epoch, digest_size=32, key=self._shard_digest).digest()
        now = time.monotonic()
        self._epoch_at = now + self.config.epoch_refresh_s
        if self._awaited is not None:  # an MLA rank's clear: re-read soon until rank 0's new epoch is in
            old, until = self._awaited
            if epoch != old or now >= until:
                self._awaited = None
            else:
                self._epoch_at = now + min(0.1, self.config.epoch_refresh_s)

    def _failed(self, op: str, e: BaseException) -> None:
        """A call that failed: the daemon being gone or stuck (:func:`is_down_error`) trips the
        breaker for ``retry_s``; other failures (no room, a bad argument, a bug) fail the call
        alone and are logged, but for a failed connect (a refused registration, say), which is
        tried again only after ``retry_s`` too. Never waits on ``_lock`` (held by a background
        attach through its calls): the breaker has a lock of its own."""
        self.last_error = f"{op}: {e}"
        if not is_down_error(e):
            self._count(errors=1)
            logger.warning("kvtier %s failed: %s", op, e, exc_info=not isinstance(e, KvtierError))
            if op != "connect":
                return
        else:
            self._count(daemon_failures=1)
        self.breaker.failed(e, op)
        self._epoch_at = 0.0  # re-read the epoch when the daemon is back (it may have restarted)

    def _missed(self, keys: Sequence[str]) -> list[bool]:
        if self.breaker.down:
            self._count(skipped_while_down_pages=len(keys))
        return [False] * len(keys)

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for k, v in inc.items():
                self._counts[k] += v

    def _metric(self, kind: str, pages: int, seconds: float) -> None:
        if self._storage_metrics is None or self.layout is None:
            return
        gb = pages * self.layout.block_bytes / (1 << 30)
        with self._stats_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / max(seconds, 1e-9))

    # -- keys and pages -----------------------------------------------------------------------

    def _keys(self, keys: Sequence[str], pool: _Pool | None = None) -> list[bytes]:
        """kvtier keys of SGLang page keys, in this namespace, shard and epoch (and for a hybrid
        model's extra pool, that pool's: its state for a page is another object than the page's KV)."""
        d = self._epoch_digest
        if pool is not None:
            d = hashlib.blake2b(pool.tag, digest_size=32, key=d).digest()
        return [hashlib.blake2b(k.encode(), digest_size=16, key=d).digest() for k in keys]

    def _pages(self, keys: Sequence[str], host_indices: Any, pool: _Pool | None = None) -> list[int] | None:
        """The host row each page starts at (of the KV pool, or of ``pool``); None (and an error
        logged) if the indices do not cover ``len(keys)`` whole pages."""
        if self.layout is None:
            return None
        n, page_len = len(keys), self._page_len if pool is None else pool.page_len
        if host_indices is None or int(host_indices.numel()) != n * page_len:
            self._count(errors=1)
            logger.error("kvtier: %d keys need %d host indices%s, got %s", n, n * page_len,
                         "" if pool is None else f" of pool {pool.name}",
                         None if host_indices is None else int(host_indices.numel()))
            return None
        return [int(i) for i in host_indices[::page_len][:n].tolist()]

    def _view(self, index: int, pool: _Pool | None = None) -> torch.Tensor:
        host, layout = (self.mem_pool_host, self.layout) if pool is None else (pool.host, pool.layout)
        v = host.get_data_page(index, flat=False)
        if v.numel() * v.element_size() != layout.block_bytes:
            raise ValueError(f"host row {index} is not the start of a whole page in the host pool")
        return v

    def _flat_page(self) -> torch.Tensor:
        make = getattr(self.mem_pool_host, "get_dummy_flat_data_page", None)
        if make is not None:
            return make()
        return torch.empty(self.layout.block_bytes, dtype=torch.uint8)

    def _is_flat_page(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and t.numel() * t.element_size() == self.layout.block_bytes)

    def _get_pages(self, kkeys: list[bytes], pages: list[int], pool: _Pool | None = None) -> list[bool]:
        """Read pages into the host pool (``pool``: a hybrid model's extra pool; None: the KV
        pool); per page, whether the daemon held it. A miss leaves its page as it was."""
        lid, chunk, size = self._geometry(pool)
        ok = [False] * len(kkeys)
        for start in range(0, len(kkeys), chunk):
            end = min(len(kkeys), start + chunk)
            if pool is not None and pool.flat:  # a copy of the page: read, then set into the pool
                outs = self._staging.slots(end - start, size)
                got = self._sc.get(lid, kkeys[start:end], out=outs)
                for j, g in enumerate(got):
                    if g is not None:
                        pool.host.set_from_flat_data_page(pages[start + j], torch.from_numpy(outs[j]))
                        ok[start + j] = True
                continue
            views = [self._view(p, pool) for p in pages[start:end]]
            slots = self._staging.slots(end - start, size) if not all(v.is_contiguous() for v in views) else []
            outs = [_bytes_of(v) if v.is_contiguous() else slots[j] for j, v in enumerate(views)]
            got = self._sc.get(lid, kkeys[start:end], out=outs)
            for j, (v, g) in enumerate(zip(views, got, strict=True)):
                if g is None:
                    continue
                if not v.is_contiguous():
                    v.copy_(_as_typed(outs[j], v))
                ok[start + j] = True
        return ok

    def _set_pages(self, kkeys: list[bytes], pages: list[int], pool: _Pool | None = None) -> list[bool]:
        """Store the host pool's pages (``pool`` as in :meth:`_get_pages`); per page, whether it
        is stored now (written, or already held)."""
        lid, chunk, size = self._geometry(pool)
        held = self._sc.lookup(lid, kkeys)  # key table: pages already stored are not copied again
        ok = [t is not None for t in held]
        todo = [i for i, h in enumerate(ok) if not h]
        if pool is None:
            self._count(set_present_pages=len(kkeys) - len(todo))
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            if pool is not None and pool.flat:
                blocks = [_bytes_of(pool.host.get_data_page(pages[i], flat=True)) for i in part]
                if any(b.size != size for b in blocks):
                    raise ValueError(f"{pool.name} page is not {size} bytes")
            else:
                views = [self._view(pages[i], pool) for i in part]
                slots = self._staging.slots(len(part), size) if not all(v.is_contiguous() for v in views) else []
                blocks = []
                for j, v in enumerate(views):
                    if v.is_contiguous():
                        blocks.append(_bytes_of(v))
                    else:
                        _as_typed(slots[j], v).copy_(v)
                        blocks.append(slots[j])
            res = self._sc.put(lid, [kkeys[i] for i in part], blocks, durable=self.config.durable)
            dropped = set(res.dropped)
            for i in part:
                ok[i] = kkeys[i] not in dropped
            if pool is None:
                self._count(set_stored_pages=res.stored, set_present_pages=res.present)
            else:
                self._count(pool_set_stored_pages=res.stored)
        return ok

    def _geometry(self, pool: _Pool | None) -> tuple[int, int, int]:
        """(daemon layout id, pages per daemon call, page bytes) of the KV pool or ``pool``."""
        if pool is None:
            return self._lid, self._chunk, self.layout.block_bytes
        return pool.lid, pool.chunk, pool.layout.block_bytes

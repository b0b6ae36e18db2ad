"""kvtier as SGLang's HiCache L3 storage (:mod:`kvtier.client.sglang`) against a real kvtierd.

What SGLang's cache controllers do with a ``HiCacheStorage`` (sglang 0.5.23,
``managers/cache_controller.py`` and ``mem_cache/hybrid_cache/hybrid_cache_controller.py``):
``batch_exists`` for the count of leading pages stored, ``batch_get_v1`` / ``batch_set_v1``
with host indices into its host KV pool (page ``i`` at ``host_indices[i * page_size]``),
per-page results; for a hybrid model (sliding-window and Mamba pools beside the KV pool)
``register_mem_host_pool_v2`` per pool, ``batch_exists_v2`` with the pools' hit policies, and
``batch_get_v2`` / ``batch_set_v2`` with one ``PoolTransfer`` per pool.

Where SGLang imports (``.ci/sglang``: a venv layered on kvtier's with ``sglang`` installed
without its CUDA dependencies), the tests build SGLang's own host pools on the CPU
(``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` in every page layout,
``MambaPoolHost``), its ``HiCacheStorageConfig``, ``HiCacheStorageExtraInfo`` and
``PoolTransfer`` objects, load the backend through its ``StorageBackendFactory`` and run its
controllers' own steps on it, so a change of SGLang's interface fails them. Where it does not
(kvtier's main venv: SGLang's import patches transformers, which the vLLM tests there must not
see) the v1 tests run on stand-ins with the buffer shapes, strides and page accessors of SGLang
0.5.23's ``pool_host/mha.py`` and ``pool_host/mla.py`` (checked against the real ones where
SGLang imports), and the tests that need SGLang itself are skipped, saying why
(``KVTIER_REQUIRE_SGLANG=1`` makes that an error instead).

SGLang's memory-pool modules import ``torchvision`` at module level for image preprocessing of
multimodal models (``sglang.srt.multimodal.internvl_utils``). PyPI's torchvision is built against
CUDA torch and does not load beside the CPU torch, so while those modules are imported a
placeholder ``torchvision`` stands in (:func:`_placeholder_torchvision`); nothing here calls it.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import subprocess
import sys
import textwrap
import time
import types
import warnings
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from kvtier.client.sglang import SGLANG_AVAILABLE, SGLANG_IMPORT_ERROR, KvtierHiCacheStorage, page_layout  # noqa: E402
from kvtier.client.tools.local_daemon import DaemonProcess  # noqa: E402


@contextlib.contextmanager
def _placeholder_torchvision():
    """While importing SGLang's memory-pool modules: a ``torchvision`` whose names are
    placeholders that raise when used, where torchvision itself does not import (module
    docstring). Removed again afterwards, so transformers' own checks still find no torchvision."""
    try:
        import torchvision  # noqa: F401
        yield
        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]

    class Absent:
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("torchvision is not importable here (a placeholder for SGLang's imports)")

    def attr(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    for name in names:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mod.__getattr__ = attr
        sys.modules[name] = mod
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _import_sglang() -> tuple[types.SimpleNamespace | None, str]:
    """SGLang's storage-interface classes the tests use, or None and why not."""
    if not SGLANG_AVAILABLE:
        return None, f"SGLang does not import here ({SGLANG_IMPORT_ERROR})"
    try:
        with warnings.catch_warnings(), _placeholder_torchvision():
            warnings.simplefilter("ignore")  # SGLang warns about its CUDA kernels being absent
            from sglang.srt.managers.cache_controller import HiCacheController
            from sglang.srt.mem_cache import device_pool_info
            from sglang.srt.mem_cache import hicache_storage as hs
            from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
            from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
            from sglang.srt.mem_cache.utils import get_storage_hash_str
    except Exception as e:  # (an SGLang whose storage modules need more than this venv has)
        return None, f"SGLang's storage modules do not import here: {type(e).__name__}: {e}"
    return types.SimpleNamespace(
        hs=hs, info=device_pool_info, HiCacheController=HiCacheController, HybridCacheController=HybridCacheController,
        MambaPoolHost=MambaPoolHost, MHATokenToKVPoolHost=MHATokenToKVPoolHost, MLATokenToKVPoolHost=MLATokenToKVPoolHost,
        StorageBackendFactory=StorageBackendFactory, get_storage_hash_str=get_storage_hash_str), ""


SG, SG_MISSING = _import_sglang()
if SG is None and os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
    raise RuntimeError(f"KVTIER_REQUIRE_SGLANG=1 but {SG_MISSING}")

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 3, 2, 8, 4, 64
KV_LORA, ROPE = 16, 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KINDS = ("mha", "mla")


# -- SGLang's host pools and config (real ones where SGLang imports) ---------------------------

def _mha_dims(layout: str, size: int, page_num: int) -> tuple[int, ...]:
    return {"layer_first": (2, LAYERS, size, HEADS, HEAD_DIM), "page_first": (2, size, LAYERS, HEADS, HEAD_DIM),
            "page_first_direct": (2, page_num, LAYERS, PAGE, HEADS, HEAD_DIM),
            "page_head": (2, page_num, HEADS, PAGE, LAYERS, HEAD_DIM)}[layout]


def _mla_dims(layout: str, size: int, page_num: int) -> tuple[int, ...]:
    dim = KV_LORA + ROPE
    return {"layer_first": (LAYERS, size, 1, dim), "page_first": (size, LAYERS, 1, dim),
            "page_first_direct": (page_num, LAYERS, PAGE, 1, dim)}[layout]


class StandInPool:
    """SGLang 0.5.23's MHATokenToKVPoolHost / MLATokenToKVPoolHost: kv_buffer as init_kv_buffer
    allocates it (size = (device tokens * ratio) // page_size + 1 pages), and the page accessors."""

    def __init__(self, kind: str, layout: str, dtype: torch.dtype = torch.bfloat16, ratio: float = 2.0) -> None:
        self.kind, self.layout, self.page_size, self.dtype = kind, layout, PAGE, dtype
        self.page_num = int(DEVICE_TOKENS * ratio) // PAGE + 1
        self.size = self.page_num * PAGE
        dims = (_mha_dims if kind == "mha" else _mla_dims)(layout, self.size, self.page_num)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)
        # the page's shape as get_dummy_flat_data_page builds it (before flatten)
        self._page_shape = ((2, LAYERS, PAGE, HEADS, HEAD_DIM) if kind == "mha"
                            else (LAYERS, PAGE, 1, KV_LORA + ROPE))

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        b, lead = self.kv_buffer, (slice(None),) if self.kind == "mha" else ()
        if self.layout == "layer_first":
            page = b[(*lead, slice(None), slice(index, index + PAGE))]
        elif self.layout == "page_first":
            page = b[(*lead, slice(index, index + PAGE))]
        else:  # page_first_direct, page_head: one page of the page dimension
            page = b[(*lead, slice(index // PAGE, index // PAGE + 1))]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page_shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        view = self.get_data_page(index, flat=False)
        view.copy_(data_page.reshape(view.shape))


def real_pool(kind: str, layout: str, layers: int = LAYERS):
    """SGLang's own host pool, built on the CPU (as SGLang's assembler would from device buffers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about its CUDA kernels being absent
        return _real_pool(kind, layout, layers)


def _real_pool(kind: str, layout: str, layers: int):
    if kind == "mha":
        k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers))
        v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers))

        def ptrs(ts):
            return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

        i = SG.info
        info = i.MHABufferInfo(buffers=i.KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                                   layout=i.KVBufferLayout.NHD),
                               page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                               dtype=torch.bfloat16, device=torch.device("cpu"))
        return SG.MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                       device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers)
    MLABufferInfo, MLATokenToKVPoolHost = SG.info.MLABufferInfo, SG.MLATokenToKVPoolHost

    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, KV_LORA + ROPE, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def make_pool(kind: str, layout: str):
    return real_pool(kind, layout) if SG is not None else StandInPool(kind, layout)


@dataclass
class StandInConfig:
    """The fields of SGLang 0.5.23's HiCacheStorageConfig."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: str | None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None
    _unused: dict = field(default_factory=dict)


def make_config(socket: str, kind: str = "mha", layout: str = "layer_first", tp: tuple[int, int] = (0, 1),
                model: str = "org/model-a", metrics: bool = False, **extra):
    cfg = dict(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
               is_mla_model=kind == "mla", enable_storage_metrics=metrics, is_page_first_layout=layout == "page_first",
               model_name=model,
               extra_config={"backend_name": "kvtier", "module_path": "kvtier.client.sglang",
                             "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "kvtier_socket": socket,
                             "kvtier_timeout_s": 2.0, **extra})
    if SG is not None:
        return SG.hs.HiCacheStorageConfig(**cfg)
    return StandInConfig(**cfg)


# -- helpers --------------------------------------------------------------------------------------

def page_keys(n: int, tag: str = "seq") -> list[str]:
    """SGLang-like page keys (hex strings of chained hashes)."""
    return [f"{tag}-{i:04d}".encode().hex() * 2 for i in range(n)]


def host_indices(pages: list[int]) -> torch.Tensor:
    """Host indices of whole pages (page p is rows p*PAGE .. p*PAGE+PAGE-1), as SGLang passes them."""
    return torch.tensor([p * PAGE + r for p in pages for r in range(PAGE)], dtype=torch.int64)


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def raw(pool) -> torch.Tensor:
    """A copy of the pool's bytes (compared as bytes: random bf16 bits hold NaNs)."""
    return pool.kv_buffer.view(torch.uint8).clone()


def page_bytes(pool, page: int) -> bytes:
    return pool.get_data_page(page * PAGE, flat=True).view(torch.uint8).numpy().tobytes()


def assert_pages_equal(dst, dst_pages: list[int], src, src_pages: list[int]) -> None:
    for d, s in zip(dst_pages, src_pages, strict=True):
        assert page_bytes(dst, d) == page_bytes(src, s), f"page {d} differs from source page {s}"


def flip_last_byte(pool, page: int) -> None:
    """Flip one bit of the last byte of ``page`` (V of the last layer, for MHA) in place."""
    v = pool.get_data_page(page * PAGE, flat=False)
    last = v.storage_offset() + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
    pool.kv_buffer.view(torch.uint8).reshape(-1)[(last + 1) * v.element_size() - 1] ^= 1


def eventually(ok, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.1)


def backend(socket: str, kind: str = "mha", layout: str = "layer_first", pool=None, **kw) -> KvtierHiCacheStorage:
    be = KvtierHiCacheStorage(make_config(socket, kind, layout, **kw), {})
    be.register_mem_pool_host(pool if pool is not None else make_pool(kind, layout))
    return be


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    d = DaemonProcess(str(tmp_path_factory.mktemp("sglang")), host_capacity="32MiB")
    d.start()
    yield d
    d.cleanup()


# -- tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_pages_round_trip_byte_exact(shared_daemon, kind: str, layout: str) -> None:
    """Pages written from one host pool come back byte-exact into another (a second engine
    process of the same shard), at other host indices; other pages are not touched."""
    tag = f"rt-{kind}-{layout}"
    src_pool, dst_pool = make_pool(kind, layout), make_pool(kind, layout)
    fill_random(src_pool, 1)
    fill_random(dst_pool, 2)
    before = {p: page_bytes(dst_pool, p) for p in range(dst_pool.page_num)}
    writer = backend(shared_daemon.socket, kind, layout, src_pool)
    reader = backend(shared_daemon.socket, kind, layout, dst_pool)
    keys, src_pages, dst_pages = page_keys(5, tag), [3, 7, 1, 12, 8], [20, 2, 9, 30, 4]
    try:
        assert writer.batch_set_v1(keys, host_indices(src_pages)) == [True] * 5
        assert writer.batch_set_v1(keys, host_indices(src_pages)) == [True] * 5  # already held
        assert reader.batch_exists(keys) == 5
        assert reader.batch_get_v1(keys, host_indices(dst_pages)) == [True] * 5
        assert_pages_equal(dst_pool, dst_pages, src_pool, src_pages)
        for p in set(range(dst_pool.page_num)) - set(dst_pages):  # the rest of the pool is as it was
            assert page_bytes(dst_pool, p) == before[p], p
        stats = writer.kvtier_stats()
        assert stats["set_stored_pages"] == 5 and stats["set_present_pages"] == 5
        assert reader.kvtier_stats()["get_hit_pages"] == 5
    finally:
        writer.close()
        reader.close()


def test_byte_check_negative_control(shared_daemon) -> None:
    """The byte comparison the round trips rely on fails on one flipped byte and on a wrong page."""
    src, dst = make_pool("mha", "layer_first"), make_pool("mha", "layer_first")
    fill_random(src, 3)
    be = backend(shared_daemon.socket, pool=src)
    rd = backend(shared_daemon.socket, pool=dst)
    keys = page_keys(2, "neg")
    try:
        assert be.batch_set_v1(keys, host_indices([1, 2])) == [True, True]
        assert rd.batch_get_v1(keys, host_indices([5, 6])) == [True, True]
        assert_pages_equal(dst, [5, 6], src, [1, 2])
        with pytest.raises(AssertionError):
            assert_pages_equal(dst, [5, 6], src, [2, 1])  # pages swapped
        flip_last_byte(dst, 6)
        with pytest.raises(AssertionError):
            assert_pages_equal(dst, [5, 6], src, [1, 2])
    finally:
        be.close()
        rd.close()


def test_batch_exists_counts_leading_pages(shared_daemon) -> None:
    pool = make_pool("mha", "page_first")
    fill_random(pool, 4)
    be = backend(shared_daemon.socket, "mha", "page_first", pool)
    keys = page_keys(6, "prefix")
    try:
        assert be.batch_exists(keys) == 0
        assert be.batch_exists([]) == 0
        assert be.batch_set_v1(keys[:3] + keys[4:5], host_indices([0, 1, 2, 4])) == [True] * 4
        assert be.batch_exists(keys) == 3          # page 3 missing: pages 4.. do not count
        assert be.batch_exists(keys[4:]) == 1
        assert be.exists(keys[4]) and not be.exists(keys[3])
        # the controller then reads what batch_exists promised; a gap reads as a miss
        assert be.batch_get_v1(keys[:5], host_indices([10, 11, 12, 13, 14])) == [True, True, True, False, True]
    finally:
        be.close()


def test_miss_leaves_destination_untouched(shared_daemon) -> None:
    src, dst = make_pool("mla", "layer_first"), make_pool("mla", "layer_first")
    fill_random(src, 5)
    fill_random(dst, 6)
    be = backend(shared_daemon.socket, "mla", "layer_first", src)
    rd = backend(shared_daemon.socket, "mla", "layer_first", dst)
    keys = page_keys(4, "miss")
    try:
        assert be.batch_set_v1([keys[0], keys[2]], host_indices([1, 3])) == [True, True]
        sentinel = {p: page_bytes(dst, p) for p in (10, 11, 12, 13)}
        assert rd.batch_get_v1(keys, host_indices([10, 11, 12, 13])) == [True, False, True, False]
        assert_pages_equal(dst, [10, 12], src, [1, 3])
        assert page_bytes(dst, 11) == sentinel[11] and page_bytes(dst, 13) == sentinel[13]
        # indices that do not cover whole pages: all misses, nothing written, no exception
        assert rd.batch_get_v1(keys[:2], host_indices([11])) == [False, False]
        assert page_bytes(dst, 11) == sentinel[11]
    finally:
        be.close()
        rd.close()


def test_tp_ranks_models_tenants_and_layouts_are_separate(shared_daemon) -> None:
    """MHA ranks, models, tenants and host layouts never see each other's pages (keys and layout
    fingerprints differ); MLA ranks share (SGLang writes MLA KV from one rank, all read it)."""
    s = shared_daemon.socket
    keys = page_keys(3, "iso")
    src = make_pool("mha", "layer_first")
    fill_random(src, 7)
    writer = backend(s, tp=(0, 2), pool=src)
    others = {
        "tp rank 1": backend(s, tp=(1, 2)),
        "tp size 4": backend(s, tp=(0, 4)),
        "model b": backend(s, tp=(0, 2), model="org/model-b"),
        "tenant": backend(s, tp=(0, 2), kvtier_tenant="other"),
        "page_first": backend(s, "mha", "page_first", tp=(0, 2)),
    }
    mla_src = make_pool("mla", "page_first")
    fill_random(mla_src, 8)
    mla0 = backend(s, "mla", "page_first", mla_src, tp=(0, 2))
    mla1 = backend(s, "mla", "page_first", tp=(1, 2))
    try:
        assert writer.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert writer.batch_exists(keys) == 3
        for name, be in others.items():
            assert be.batch_exists(keys) == 0, name
            before = raw(be.mem_pool_host)
            assert be.batch_get_v1(keys, host_indices([4, 5, 6])) == [False] * 3, name
            assert torch.equal(raw(be.mem_pool_host), before), name
        fps = {writer.layout.fingerprint, *(be.layout.fingerprint for be in others.values())}
        assert len(fps) == 4  # rank 0/2, rank 1/2, rank 0/4, page_first (model and tenant: keys only)
        assert mla0.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert mla0.layout.fingerprint == mla1.layout.fingerprint
        assert mla1.batch_exists(keys) == 3
        assert mla1.batch_get_v1(keys, host_indices([7, 8, 9])) == [True] * 3
        assert_pages_equal(mla1.mem_pool_host, [7, 8, 9], mla_src, [0, 1, 2])
    finally:
        for be in (writer, *others.values(), mla0, mla1):
            be.close()


def test_clear_hides_everything_stored_before(shared_daemon) -> None:
    src = make_pool("mha", "page_first_direct")
    fill_random(src, 9)
    a = backend(shared_daemon.socket, "mha", "page_first_direct", src, kvtier_epoch_refresh_s=0.2)
    b = backend(shared_daemon.socket, "mha", "page_first_direct", kvtier_epoch_refresh_s=0.2)
    old, new = page_keys(2, "before"), page_keys(2, "after")
    try:
        assert a.batch_set_v1(old, host_indices([1, 2])) == [True, True]
        assert b.batch_exists(old) == 2
        assert a.clear() is True
        assert a.batch_exists(old) == 0
        eventually(lambda: b.batch_exists(old) == 0)  # b re-reads the shard's epoch (in the background)
        assert b.batch_get_v1(old, host_indices([5, 6])) == [False, False]
        assert a.batch_set_v1(new, host_indices([1, 2])) == [True, True]
        assert b.batch_exists(new) == 2
        assert b.kvtier_stats()["epoch_changes"] == 1
    finally:
        a.close()
        b.close()


def test_flat_page_interface(shared_daemon) -> None:
    """get/set/batch_get/batch_set/exists (SGLang's generic path, without interface_v1) store the
    same bytes as the v1 path: the pool's flat pages."""
    src, dst = make_pool("mla", "page_first_direct"), make_pool("mla", "page_first_direct")
    fill_random(src, 10)
    w = backend(shared_daemon.socket, "mla", "page_first_direct", src)
    r = backend(shared_daemon.socket, "mla", "page_first_direct", dst)
    keys = page_keys(3, "flat")
    try:
        assert w.batch_set(keys[:2], [src.get_data_page(p * PAGE) for p in (1, 2)]) is True
        assert w.set(keys[2], src.get_data_page(3 * PAGE)) is True
        got = r.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        assert all(g is not None for g in got)
        for g, p in zip(got, (1, 2, 3), strict=True):
            assert g.view(torch.uint8).numpy().tobytes() == page_bytes(src, p)
        assert r.get(page_keys(1, "absent")[0]) is None
        assert w.set(page_keys(1, "short")[0], src.get_data_page(0)[:-1]) is False  # a bad page: that call alone
        assert w.kvtier_stats()["errors"] == 1 and not w.kvtier_stats()["down"]
        assert r.exists(keys[0]) and not r.exists(page_keys(1, "absent")[0])
        # v1 reads what the flat interface wrote
        assert r.batch_get_v1(keys, host_indices([6, 7, 8])) == [True] * 3
        assert_pages_equal(dst, [6, 7, 8], src, [1, 2, 3])
    finally:
        w.close()
        r.close()


def test_daemon_down_means_misses_then_recovery(tmp_path) -> None:
    """Daemon killed (its socket file and key table left behind): every call answers misses (False per page, 0 present), counted, never an
    exception, and quickly once it is known down; started again: pages are stored and read again."""
    d = DaemonProcess(str(tmp_path), host_capacity="16MiB").start()
    src, dst = make_pool("mha", "layer_first"), make_pool("mha", "layer_first")
    fill_random(src, 11)
    fill_random(dst, 12)
    be = backend(d.socket, pool=src, kvtier_timeout_s=1.0, kvtier_retry_s=0.3)
    rd = backend(d.socket, pool=dst, kvtier_timeout_s=1.0, kvtier_retry_s=0.3)
    keys, fresh = page_keys(3, "down"), page_keys(3, "fresh")
    try:
        assert be.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        d.kill()  # (a SIGTERM stop waits out the daemon's grace period for our sessions: 5 s)
        before = raw(dst)
        assert rd.batch_get_v1(keys, host_indices([5, 6, 7])) == [False] * 3   # notices: waits <= timeout
        assert be.batch_set_v1(fresh, host_indices([0, 1, 2])) == [False] * 3  # (keys the table never held)
        t0 = time.monotonic()
        for _ in range(20):                                                    # known down: at once
            assert rd.batch_exists(keys) == 0
            assert rd.batch_get_v1(keys, host_indices([5, 6, 7])) == [False] * 3
            assert be.batch_set_v1(fresh, host_indices([0, 1, 2])) == [False] * 3
        assert time.monotonic() - t0 < 2.5  # one 1 s timeout would be 60 s here
        assert torch.equal(raw(dst), before)
        assert rd.get(keys[0]) is None and be.set(keys[0], src.get_data_page(0)) is False
        assert be.clear() is False
        s = rd.kvtier_stats()
        assert s["down"] and s["daemon_failures"] >= 1 and s["skipped_while_down_pages"] > 0, s
        d2 = DaemonProcess(str(tmp_path), host_capacity="16MiB")  # the same socket path, a new daemon
        d2.start()
        try:
            fill_random(src, 13)  # new bytes: a read from the old daemon's pool would show
            # back within retry_s of the daemon answering (polled: this machine may be loaded)
            eventually(lambda: be.batch_set_v1(keys + fresh, host_indices([0, 1, 2, 3, 4, 5])) == [True] * 6)
            eventually(lambda: rd.batch_exists(keys + fresh) == 6)  # (rd reconnects in the background)
            assert rd.batch_get_v1(keys, host_indices([5, 6, 7])) == [True] * 3
            assert_pages_equal(dst, [5, 6, 7], src, [0, 1, 2])
            assert not rd.kvtier_stats()["down"]
        finally:
            be.close()
            rd.close()
            d2.cleanup()
    finally:
        d.cleanup()


def test_durable_pages_and_epoch_survive_a_daemon_restart(start_daemon, tmp_path) -> None:
    """With a disk tier and kvtier_durable, a backup is on disk when it returns; the shard's key
    epoch is kept on disk too, so an engine started after the daemon restarted (a killed one,
    here) finds the pages, byte-exact."""
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "16MiB"]
    d = start_daemon(*disk, host_capacity="8MiB")
    src = make_pool("mla", "page_first")
    fill_random(src, 15)
    be = backend(d.socket, "mla", "page_first", src, kvtier_durable=True)
    keys = page_keys(3, "durable")
    assert be.batch_set_v1(keys, host_indices([1, 2, 3])) == [True] * 3
    epoch = be.kvtier_stats()["epoch"]
    be.close()
    d.kill()
    d2 = start_daemon(*disk, host_capacity="8MiB", name="restarted")
    dst = make_pool("mla", "page_first")
    rd = backend(d2.socket, "mla", "page_first", dst)
    try:
        assert rd.batch_exists(keys) == 3 and rd.kvtier_stats()["epoch"] == epoch
        assert rd.batch_get_v1(keys, host_indices([7, 8, 9])) == [True] * 3
        assert_pages_equal(dst, [7, 8, 9], src, [1, 2, 3])
    finally:
        rd.close()


def test_daemon_absent_at_attach(tmp_path) -> None:
    """No daemon when SGLang attaches: the attach succeeds at once, calls answer misses."""
    t0 = time.monotonic()
    be = backend(str(tmp_path / "nobody.sock"), kvtier_timeout_s=5.0)
    try:
        assert be.batch_exists(page_keys(2)) == 0
        assert be.batch_set_v1(page_keys(2), host_indices([0, 1])) == [False, False]
        assert time.monotonic() - t0 < 4.0  # below the 5 s timeout: no call waited for it
    finally:
        be.close()


def test_unsupported_pools_are_refused_at_attach(tmp_path) -> None:
    sock = str(tmp_path / "nobody.sock")
    be = KvtierHiCacheStorage(make_config(sock), {})
    with pytest.raises(ValueError, match="page_head"):
        be.register_mem_pool_host(StandInPool("mha", "page_head"))
    be.register_mem_pool_host(StandInPool("mha", "layer_first"))
    with pytest.raises(NotImplementedError, match="mamba"):
        be.register_mem_host_pool_v2(object(), "mamba")
    be.close()
    with pytest.raises(ValueError, match="split-head"):
        cfg = make_config(sock)
        cfg.should_split_heads = True
        KvtierHiCacheStorage(cfg, {})


def test_layout_describes_the_host_buffer() -> None:
    """The kvtier layout's block is exactly one flat SGLang page, for every kind and layout."""
    for kind in KINDS:
        for layout in LAYOUTS:
            pool = make_pool(kind, layout)
            lay = page_layout(pool, make_config("unused", kind, layout))
            assert lay.block_bytes == pool.get_data_page(0).numel() * 2
            assert lay.block_tokens == PAGE
            assert lay.tensors[0].name == f"sglang.{kind}.{layout}"


def test_kvtier_does_not_need_sglang() -> None:
    """kvtier.client never imports SGLang; kvtier.client.sglang imports and works without it (its
    stand-in base), here even where SGLang is installed."""
    code = textwrap.dedent("""
        import sys
        import kvtier.client, kvtier.client.engine
        assert "sglang" not in sys.modules
        sys.modules["sglang"] = None  # as if not installed
        import kvtier.client.sglang as m
        assert not m.SGLANG_AVAILABLE and isinstance(m.SGLANG_IMPORT_ERROR, ImportError)
        assert [c.__name__ for c in m.KvtierHiCacheStorage.__mro__][1] == "_HiCacheStorageBase"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- against SGLang itself, where it imports ---------------------------------------------------

needs_sglang = pytest.mark.skipif(SG is None, reason=SG_MISSING or "SGLang imports")


@needs_sglang
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_stand_in_pools_match_sglang(kind: str, layout: str) -> None:
    real, fake = real_pool(kind, layout), StandInPool(kind, layout)
    assert (real.size, real.page_size, real.page_num) == (fake.size, fake.page_size, fake.page_num)
    assert real.kv_buffer.shape == fake.kv_buffer.shape and real.kv_buffer.stride() == fake.kv_buffer.stride()
    for p in (0, 5):
        r, f = real.get_data_page(p * PAGE, flat=False), fake.get_data_page(p * PAGE, flat=False)
        assert (r.shape, r.stride(), r.storage_offset()) == (f.shape, f.stride(), f.storage_offset())
    assert real.get_dummy_flat_data_page().shape == fake.get_dummy_flat_data_page().shape


@needs_sglang
def test_sglang_factory_loads_the_backend(shared_daemon) -> None:
    """SGLang's StorageBackendFactory ("dynamic") constructs it from the extra config, as its
    cache controller does, then registers the host pool; storage metrics come as StorageMetrics."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = real_pool("mha", "page_first")
    fill_random(pool, 13)
    cfg = make_config(shared_daemon.socket, "mha", "page_first", metrics=True)
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        assert isinstance(be, KvtierHiCacheStorage) and isinstance(be, HiCacheStorage)
        be.register_mem_pool_host(pool)
        keys = page_keys(2, "factory")
        assert be.batch_set_v1(keys, host_indices([1, 2])) == [True, True]
        assert be.batch_exists(keys) == 2
        m = be.get_stats()
        assert isinstance(m, StorageMetrics) and m.backup_pgs == [2]
    finally:
        be.close()


@needs_sglang
def test_sglang_cache_controller_paths(shared_daemon) -> None:
    """SGLang's own cache-controller steps, run on the backend: page hashes of real token ids
    (get_storage_hash_str), the backup (_page_set_zero_copy), the hit query (_storage_hit_query:
    batch_exists in batches) and the prefetch read (_page_get_zero_copy)."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController, get_storage_hash_str
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    src, dst = real_pool("mha", "layer_first"), real_pool("mha", "layer_first")
    fill_random(src, 14)
    writer = backend(shared_daemon.socket, "mha", "layer_first", src)
    reader = backend(shared_daemon.socket, "mha", "layer_first", dst)
    tokens = list(range(1000, 1040))  # 10 pages
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    assert len(hashes) == 10 and all(isinstance(h, str) for h in hashes)
    try:
        w = SimpleNamespace(storage_backend=writer, page_size=PAGE)
        assert HiCacheController._page_set_zero_copy(w, hashes[:6], host_indices(list(range(6))),
                                                     HiCacheStorageExtraInfo(prefix_keys=[])) is True
        r = SimpleNamespace(storage_backend=reader, page_size=PAGE)
        op = SimpleNamespace(last_hash=None, token_ids=tokens, prefix_keys=None, request_id="r1")
        hit_hashes, hit_tokens = HiCacheController._storage_hit_query(r, op)
        assert (hit_hashes, hit_tokens) == (hashes[:6], 6 * PAGE)
        dst_pages = [20, 21, 22, 23, 24, 25]
        assert HiCacheController._page_get_zero_copy(r, op, hit_hashes, host_indices(dst_pages)) == 6
        assert_pages_equal(dst, dst_pages, src, list(range(6)))
        # a read past what is stored stops at the first miss, as the controller counts it
        assert HiCacheController._page_get_zero_copy(r, op, hashes[4:8], host_indices([26, 27, 28, 29])) == 2
    finally:
        writer.close()
        reader.close()


class _DevicePool:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def test_fp8_formats_stored_as_bytes_never_share_a_layout() -> None:
    """SGLang keeps both fp8 KV formats (e4m3, e5m2) as uint8 in its pools: the layout (and so
    the keys) came out the same for both, so one engine loaded the other's pages as the wrong
    float format. The device pool's own dtype now names the layout; a byte pool that names none
    is refused."""
    cfg = make_config("unused")
    fps = set()
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        pool = StandInPool("mha", "page_first", dtype=torch.uint8)
        pool.device_pool = _DevicePool(fmt)
        lay = page_layout(pool, cfg)
        assert lay.tensors[0].name.endswith("@" + str(fmt).removeprefix("torch."))
        fps.add(lay.fingerprint)
    assert len(fps) == 2, "e4m3 and e5m2 pages share one key space"
    with pytest.raises(ValueError, match="cannot tell which KV format"):
        page_layout(StandInPool("mha", "page_first", dtype=torch.uint8), cfg)
    plain = StandInPool("mha", "page_first")
    plain.device_pool = _DevicePool(torch.bfloat16)  # (the KV's own dtype: nothing added)
    assert page_layout(plain, cfg).tensors[0].name == "sglang.mha.page_first"


def test_a_pool_whose_pages_are_copies_is_refused() -> None:
    """kvtier fills pages in place (zero copy): a pool whose page accessor returns a fresh
    tensor (a decoded page, say) would take a hit into that temporary and keep its own bytes."""

    class Decoding(StandInPool):
        def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
            return super().get_data_page(index, flat).clone()

    with pytest.raises(ValueError, match="not views of its kv_buffer"):
        page_layout(Decoding("mha", "page_first"), make_config("unused"))


def test_configuration_errors_are_refused_at_attach(tmp_path) -> None:
    """A TCP target without a tenant salt was taken for a daemon outage: one warning, then
    misses for good. It is a configuration error, said when SGLang attaches."""
    with pytest.raises(ValueError, match="kvtier_tenant"):
        KvtierHiCacheStorage(make_config(str(tmp_path / "x.sock"), kvtier_target="127.0.0.1:1"), {})


def test_storage_metrics_are_not_kept_where_sglang_cannot_take_them(shared_daemon) -> None:
    """With storage metrics on but no StorageMetrics class to hand them to, every prefetch and
    backup was appended to lists nobody emptied."""
    be = backend(shared_daemon.socket, metrics=True)
    try:
        if be._storage_metrics is not None:
            pytest.skip("this SGLang has StorageMetrics")
        be.batch_set_v1(page_keys(3, "metrics"), host_indices([0, 1, 2]))
        assert be.get_stats() is None
        assert not any(be._metrics.values()), "metrics kept with nobody to take them"
    finally:
        be.close()


def test_a_stopped_daemon_never_holds_sglangs_threads(tmp_path) -> None:
    """A daemon that is stopped (SIGSTOP: a stuck process) still accepts connections. Once its
    retry time had passed, the next call reconnected on SGLang's own thread and waited out the
    call timeout there, holding every other storage thread behind the backend's lock, even
    ``batch_exists``, which makes no call. Reconnecting now runs on a thread of its own: calls
    answer misses at once meanwhile, and the backend recovers once the daemon runs again."""
    import signal

    d = DaemonProcess(str(tmp_path), host_capacity="16MiB").start()
    src = make_pool("mha", "layer_first")
    fill_random(src, 21)
    be = backend(d.socket, pool=src, kvtier_timeout_s=1.0, kvtier_retry_s=0.2)
    keys = page_keys(2, "stopped")
    try:
        assert be.batch_set_v1(keys, host_indices([0, 1])) == [True, True]
        os.kill(d.pid, signal.SIGSTOP)
        try:
            assert be.batch_get_v1(keys, host_indices([4, 5])) == [False, False]  # notices: one timeout
            assert be.kvtier_stats()["down"]
            slowest, t_end = 0.0, time.monotonic() + 2.5   # past retry_s, again and again
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                assert be.batch_exists(keys) == 0
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.02)
            assert slowest < 0.5, f"batch_exists waited {slowest:.2f} s on a stopped daemon"
        finally:
            os.kill(d.pid, signal.SIGCONT)
        eventually(lambda: be.batch_exists(keys) == 2)
        assert be.batch_get_v1(keys, host_indices([4, 5])) == [True, True]
    finally:
        be.close()
        d.cleanup()


@pytest.mark.parametrize("first", [0, 1], ids=["rank0-first", "rank1-first"])
def test_mla_ranks_agree_on_the_epoch_after_clear(shared_daemon, first: int) -> None:
    """MLA: the TP ranks share one shard (one key epoch), SGLang clears every rank, and only
    rank 0 writes pages. Each rank made its own new epoch, so rank 0 could write under one the
    others never read (misses for everyone until the next re-read, 10 s). Now rank 0 makes it
    and the other ranks re-read until they have it, whichever clears first."""
    ranks = [backend(shared_daemon.socket, "mla", "page_first", tp=(r, 2)) for r in (0, 1)]
    try:
        src = ranks[0].mem_pool_host
        fill_random(src, 31)
        before = ranks[0].kvtier_stats()["epoch"]
        assert ranks[1].kvtier_stats()["epoch"] == before
        for r in (first, 1 - first):
            assert ranks[r].clear() is True
        keys = page_keys(2, f"mla-clear-{first}")
        assert ranks[0].batch_set_v1(keys, host_indices([1, 2])) == [True, True]
        eventually(lambda: ranks[1].batch_exists(keys) == 2, timeout=3.0)
        assert ranks[0].kvtier_stats()["epoch"] == ranks[1].kvtier_stats()["epoch"] != before
    finally:
        for be in ranks:
            be.close()


# -- SGLang's interfaces, and a hybrid model's pools (v2), against SGLang itself ---------------

SWA_LAYERS, MAMBA_LAYERS, MAMBA_SLOTS = 2, 2, 8


def mamba_pool(layout: str = "page_first"):
    """SGLang's MambaPoolHost on the CPU: per slot, an SSM (temporal) state and one conv state,
    in different dtypes."""
    info = SG.info.MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 3, 16, dtype=torch.bfloat16),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SG.MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu",
                                layout=layout)


def fill_mamba(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in pool.kv_buffer:
        raw_bytes = buf.view(torch.uint8)
        raw_bytes.copy_(torch.randint(0, 256, raw_bytes.shape, dtype=torch.uint8, generator=g))


def hybrid(socket: str, layout: str, kv_pool, swa, mamba, kind: str = "mha", **kw) -> KvtierHiCacheStorage:
    """The backend attached as SGLang's HybridCacheController attaches it: the factory
    ("dynamic"), register_mem_pool_host with the KV (anchor) pool, register_mem_host_pool_v2 for
    every pool of the group (the KV pool too), then on_host_pools_registered."""
    PoolName = SG.hs.PoolName
    be = SG.StorageBackendFactory.create_backend("dynamic", make_config(socket, kind, layout, **kw), kv_pool)
    be.register_mem_pool_host(kv_pool)
    for name, pool in ((PoolName.KV, kv_pool), (PoolName.SWA, swa), (PoolName.MAMBA, mamba)):
        if pool is not None:
            be.register_mem_host_pool_v2(pool, name)
    be.on_host_pools_registered()
    return be


def transfer(name, keys: list[str], rows: list[int], page: int, policy=None):
    """SGLang's PoolTransfer of ``keys`` at host pages ``rows`` of a pool of page size ``page``."""
    hs = SG.hs
    idx = torch.tensor([r * page + i for r in rows for i in range(page)], dtype=torch.int64)
    return hs.PoolTransfer(name=name, host_indices=idx, keys=keys,
                           hit_policy=policy if policy is not None else hs.PoolHitPolicy.TRAILING_PAGES)


@needs_sglang
def test_backend_implements_sglangs_storage_interface() -> None:
    """Every method of SGLang's HiCacheStorage (abstract or not: v1, v2, registration) is
    kvtier's own, and takes the parameters SGLang passes, by SGLang's names: a method SGLang adds
    or a parameter it renames fails here, not in a running server."""
    import inspect

    base = SG.hs.HiCacheStorage
    assert issubclass(KvtierHiCacheStorage, base)
    assert not getattr(KvtierHiCacheStorage, "__abstractmethods__", None)
    methods = [n for n, f in inspect.getmembers(base, inspect.isfunction) if not n.startswith("_")]
    for name in ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_exists_v2", "batch_get_v2", "batch_set_v2",
                 "register_mem_pool_host", "register_mem_host_pool_v2", "on_host_pools_registered", "get", "set",
                 "batch_get", "batch_set", "exists", "clear", "get_stats"):
        assert name in methods, f"SGLang's HiCacheStorage has no {name} any more"
    for name in methods:
        ours = getattr(KvtierHiCacheStorage, name)
        assert ours is not getattr(base, name), f"{name} is SGLang's default, not kvtier's"
        theirs = inspect.signature(getattr(base, name)).parameters
        mine = inspect.signature(ours).parameters
        for p in theirs.values():
            assert p.name in mine, f"{name}: SGLang passes {p.name}, kvtier's {name} does not take it"
            if p.default is inspect.Parameter.empty:
                assert list(theirs).index(p.name) == list(mine).index(p.name), f"{name}: {p.name} out of place"


@needs_sglang
@pytest.mark.parametrize("mamba_layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_pools_round_trip_through_sglangs_controller(shared_daemon, layout: str, mamba_layout: str) -> None:
    """A hybrid model (full-attention KV, sliding-window KV, Mamba state) written and read the
    way SGLang's HybridCacheController does: KV pages through v1, the sliding window's trailing
    pages and the Mamba state of the last page through batch_set_v2 / batch_get_v2 with
    SGLang's PoolTransfer, the hit query through the controller's own _storage_hit_query
    (batch_exists_v2). Every pool comes back byte-exact into a second engine's pools."""
    hs, PoolName = SG.hs, SG.hs.PoolName
    tag = f"hy-{layout}-{mamba_layout}"
    w_kv, w_swa, w_mamba = real_pool("mha", layout), real_pool("mha", layout, SWA_LAYERS), mamba_pool(mamba_layout)
    r_kv, r_swa, r_mamba = real_pool("mha", layout), real_pool("mha", layout, SWA_LAYERS), mamba_pool(mamba_layout)
    for i, p in enumerate((w_kv, w_swa, r_kv, r_swa)):
        fill_random(p, 100 + i)
    fill_mamba(w_mamba, 110)
    fill_mamba(r_mamba, 111)
    writer = hybrid(shared_daemon.socket, layout, w_kv, w_swa, w_mamba)
    reader = hybrid(shared_daemon.socket, layout, r_kv, r_swa, r_mamba)
    tokens = [hash((tag, i)) % 50000 for i in range(6 * PAGE)]
    hashes = SG.get_storage_hash_str(tokens, None, page_size=PAGE)
    try:
        assert isinstance(writer, KvtierHiCacheStorage)
        # two backups, as the controller makes them for a 3-page and then the 6-page prefix:
        # KV pages, the sliding window's last 2 pages, the Mamba state at the span's end
        for span, swa_rows, slot in ((hashes[:3], [5, 6], 2), (hashes[3:], [7, 8], 3)):
            info = hs.HiCacheStorageExtraInfo(prefix_keys=[])
            rows = [hashes.index(h) for h in span]
            assert SG.HiCacheController._page_set_zero_copy(
                types.SimpleNamespace(storage_backend=writer), span, host_indices(rows), info) is True
            got = writer.batch_set_v2([transfer(PoolName.SWA, span[-2:], swa_rows, PAGE),
                                       transfer(PoolName.MAMBA, span[-1:], [slot], 1)], extra_info=info)
            assert got == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        # the hit query: SGLang's own (hybrid) controller step
        op = types.SimpleNamespace(token_ids=tokens, last_hash=None, assume_stored=False, prefix_keys=None,
                                   pool_transfers=[transfer(PoolName.SWA, [None, None], [0, 1], PAGE),
                                                   transfer(PoolName.MAMBA, [None], [0], 1)],
                                   pool_storage_result=hs.PoolTransferResult.empty(), query_pool_hit_pages=None)
        ctl = types.SimpleNamespace(storage_backend=reader, page_size=PAGE)
        hit_hashes, hit_tokens = SG.HybridCacheController._storage_hit_query(ctl, op)
        assert (hit_hashes, hit_tokens) == (hashes, 6 * PAGE)
        assert op.pool_storage_result.restorable_prefix_pages == [3, 6]  # where window and state were stored
        assert op.query_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 6, PoolName.MAMBA: 6}
        # the prefetch: KV through v1, then each sidecar pool through v2 (a new engine's rows)
        assert SG.HiCacheController._page_get_zero_copy(ctl, op, hashes, host_indices([10, 11, 12, 13, 14, 15])) == 6
        assert_pages_equal(r_kv, [10, 11, 12, 13, 14, 15], w_kv, [0, 1, 2, 3, 4, 5])
        got = reader.batch_get_v2([transfer(PoolName.SWA, hashes[-2:], [20, 21], PAGE),
                                   transfer(PoolName.MAMBA, hashes[-1:], [6], 1)])
        assert hs.count_pool_hits(got) == {PoolName.SWA: 2, PoolName.MAMBA: 1}
        assert_pages_equal(r_swa, [20, 21], w_swa, [7, 8])
        assert torch.equal(r_mamba.get_data_page(6), w_mamba.get_data_page(3))
        assert not torch.equal(r_mamba.get_data_page(5), w_mamba.get_data_page(3))  # other slots untouched
        # a shorter prefix resumes at the 3-page stop point: window and state of that backup
        got = reader.batch_get_v2([transfer(PoolName.SWA, hashes[1:3], [22, 23], PAGE),
                                   transfer(PoolName.MAMBA, hashes[2:3], [7], 1)])
        assert hs.count_pool_hits(got) == {PoolName.SWA: 2, PoolName.MAMBA: 1}
        assert_pages_equal(r_swa, [22, 23], w_swa, [5, 6])
        assert torch.equal(r_mamba.get_data_page(7), w_mamba.get_data_page(2))
        stats = reader.kvtier_stats()
        assert stats["pool_get_hit_pages"] == 6 and writer.kvtier_stats()["pool_set_stored_pages"] == 6
    finally:
        writer.close()
        reader.close()


@needs_sglang
def test_trailing_pools_cut_the_usable_prefix(shared_daemon) -> None:
    """batch_exists_v2 with SGLang's hit policies: a prefix is usable only where every pool can
    resume; a Mamba state stored at page 3 and 6 leaves 4 and 5 unusable (holes), an all-pages
    pool stops at its first missing page, and a pool the query names but kvtier never stored
    (nothing held for it) gives no usable prefix at all."""
    hs, PoolName, Policy = SG.hs, SG.hs.PoolName, SG.hs.PoolHitPolicy
    kv, swa, mamba = real_pool("mha", "page_first"), real_pool("mha", "page_first", SWA_LAYERS), mamba_pool()
    for i, p in enumerate((kv, swa)):
        fill_random(p, 120 + i)
    fill_mamba(mamba, 122)
    be = hybrid(shared_daemon.socket, "page_first", kv, swa, mamba)
    keys = page_keys(6, "holes")
    try:
        assert be.batch_set_v1(keys, host_indices([0, 1, 2, 3, 4, 5])) == [True] * 6
        for key, slot in ((keys[2], 1), (keys[5], 2)):  # (one transfer per pool and call, as SGLang's)
            assert be.batch_set_v2([transfer(PoolName.MAMBA, [key], [slot], 1)]) == {PoolName.MAMBA: [True]}
        r = be.batch_exists_v2(keys, [transfer(PoolName.MAMBA, [None], [0], 1)], hs.HiCacheStorageExtraInfo())
        assert isinstance(r, hs.PoolTransferResult)
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [3, 6])
        r = be.batch_exists_v2(keys[:5], [transfer(PoolName.MAMBA, [None], [0], 1)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [3])
        # the sliding window (2 pages) stored for pages 1-4 only: all-pages stops at 4, trailing at 4 too
        assert be.batch_set_v2([transfer(PoolName.SWA, keys[:4], [0, 1, 2, 3], PAGE)]) == {PoolName.SWA: [True] * 4}
        r = be.batch_exists_v2(keys, [transfer(PoolName.SWA, [None] * 6, [0], PAGE, Policy.ALL_PAGES)])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.SWA]) == (4, 4)
        r = be.batch_exists_v2(keys, [transfer(PoolName.SWA, [None, None], [0, 1], PAGE),
                                      transfer(PoolName.MAMBA, [None], [0], 1)])
        assert r.restorable_prefix_pages == [3] and r.kv_hit_pages == 3
        # the KV pages alone (v1) still count all 6
        assert be.batch_exists(keys) == 6
        # nothing of another engine's pools: a pool stored under other keys does not count
        other = page_keys(6, "holes-other")
        assert be.batch_set_v1(other, host_indices([6, 7, 8, 9, 10, 11])) == [True] * 6
        r = be.batch_exists_v2(other, [transfer(PoolName.MAMBA, [None], [0], 1)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    finally:
        be.close()


@needs_sglang
def test_hybrid_pools_are_separate_objects_and_mamba_state_is_per_tp_rank(shared_daemon) -> None:
    """A page's sliding-window KV, its Mamba state and its full-attention KV are three objects
    under one page hash (a get of one never returns another's bytes); Mamba state is sharded
    across TP ranks even for an MLA model, whose KV the ranks share."""
    PoolName = SG.hs.PoolName
    key = page_keys(1, "separate")
    kv, swa, mamba = real_pool("mla", "page_first"), real_pool("mla", "page_first", SWA_LAYERS), mamba_pool()
    fill_random(kv, 130)
    fill_random(swa, 131)
    fill_mamba(mamba, 132)
    r0 = [real_pool("mla", "page_first"), real_pool("mla", "page_first", SWA_LAYERS), mamba_pool()]
    r1 = [real_pool("mla", "page_first"), real_pool("mla", "page_first", SWA_LAYERS), mamba_pool()]
    w = hybrid(shared_daemon.socket, "page_first", kv, swa, mamba, kind="mla", tp=(0, 2))
    rank0 = hybrid(shared_daemon.socket, "page_first", *r0, kind="mla", tp=(0, 2))
    rank1 = hybrid(shared_daemon.socket, "page_first", *r1, kind="mla", tp=(1, 2))
    try:
        assert w.batch_set_v2([transfer(PoolName.SWA, key, [1], PAGE)]) == {PoolName.SWA: [True]}
        assert w.batch_exists(key) == 0  # the window's page is not the page's KV
        assert w.batch_set_v2([transfer(PoolName.MAMBA, key, [1], 1)]) == {PoolName.MAMBA: [True]}
        assert rank1.batch_get_v2([transfer(PoolName.SWA, key, [2], PAGE)]) == {PoolName.SWA: [True]}  # MLA: shared
        assert_pages_equal(r1[1], [2], swa, [1])
        assert rank1.batch_get_v2([transfer(PoolName.MAMBA, key, [2], 1)]) == {PoolName.MAMBA: [False]}
        assert rank0.batch_get_v2([transfer(PoolName.MAMBA, key, [2], 1)]) == {PoolName.MAMBA: [True]}
        assert torch.equal(r0[2].get_data_page(2), mamba.get_data_page(1))
        assert w.batch_set_v1(key, host_indices([3])) == [True]
        assert rank1.batch_get_v1(key, host_indices([4])) == [True]
        assert_pages_equal(r1[0], [4], kv, [3])
        assert page_bytes(r1[0], 4) != page_bytes(swa, 1)[:len(page_bytes(r1[0], 4))]
        fps = {w.layout.fingerprint, w._pools["swa"].layout.fingerprint, w._pools["mamba"].layout.fingerprint}
        assert len(fps) == 3
    finally:
        for be in (w, rank0, rank1):
            be.close()


@needs_sglang
def test_v2_misuse_moves_nothing(shared_daemon) -> None:
    """A v2 transfer whose host indices do not cover its keys' pages, or that names a pool never
    registered, answers False per page, writes nothing and never raises into the controller."""
    PoolName = SG.hs.PoolName
    kv, swa, mamba = real_pool("mha", "layer_first"), real_pool("mha", "layer_first", SWA_LAYERS), mamba_pool()
    fill_random(swa, 140)
    fill_mamba(mamba, 141)
    be = hybrid(shared_daemon.socket, "layer_first", kv, swa, None)
    keys = page_keys(2, "misuse")
    try:
        before = raw(swa)
        short = SG.hs.PoolTransfer(name=PoolName.SWA, host_indices=host_indices([1])[:-1], keys=keys)
        assert be.batch_set_v2([short]) == {PoolName.SWA: [False, False]}
        assert be.batch_get_v2([short]) == {PoolName.SWA: [False, False]}
        assert torch.equal(raw(swa), before)
        assert be.batch_set_v2([transfer(PoolName.MAMBA, keys[:1], [0], 1)]) == {PoolName.MAMBA: [False]}
        assert be.kvtier_stats()["errors"] >= 3 and not be.kvtier_stats()["down"]
    finally:
        be.close()


@needs_sglang
def test_pools_kvtier_does_not_store_are_refused_at_attach(tmp_path) -> None:
    """An indexer (DSA), DeepSeek-V4 or draft pool, a non-Mamba object as the Mamba pool and a
    sliding-window pool in an unsupported layout fail the attach, saying what serves them."""
    PoolName = SG.hs.PoolName
    be = hybrid(str(tmp_path / "nobody.sock"), "page_first", real_pool("mha", "page_first"), None, None)
    try:
        for name in (PoolName.INDEXER, PoolName.DEEPSEEK_V4_C4, PoolName.DRAFT):
            with pytest.raises(NotImplementedError, match="file or mooncake"):
                be.register_mem_host_pool_v2(real_pool("mha", "page_first"), name)
        with pytest.raises(NotImplementedError, match="mamba"):
            be.register_mem_host_pool_v2(real_pool("mha", "page_first"), PoolName.MAMBA)
        with pytest.raises(ValueError, match="page_head"):
            be.register_mem_host_pool_v2(StandInPool("mha", "page_head"), PoolName.SWA)
        assert not be._pools
    finally:
        be.close()

"""kvtier as SGLang's HiCache L3 storage (:mod:`kvtier.client.sglang`) against a real kvtierd.

What SGLang's cache controller does with a ``HiCacheStorage`` (sglang 0.5.23,
``managers/cache_controller.py``): ``batch_exists`` for the count of leading pages stored,
``batch_get_v1`` / ``batch_set_v1`` with host indices into its host KV pool (page ``i`` at
``host_indices[i * page_size]``), per-page results.

Host pools: where SGLang imports (``sglang.srt.mem_cache.pool_host``), the tests build SGLang's
real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` on the CPU and its real
``HiCacheStorageConfig``, check that the stand-ins below match them (buffer shapes, strides,
page views), and load the backend through SGLang's own ``StorageBackendFactory`` ("dynamic").
Where SGLang does not import (kvtier's CI: SGLang needs CUDA-only packages), they use the
stand-ins: the same buffer shapes, strides and page accessors as SGLang 0.5.23's
``pool_host/mha.py`` and ``pool_host/mla.py`` (``init_kv_buffer``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``) and a config with the fields of
its ``HiCacheStorageConfig``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from kvtier.client.sglang import SGLANG_AVAILABLE, KvtierHiCacheStorage, page_layout  # noqa: E402
from kvtier.client.tools.local_daemon import DaemonProcess  # noqa: E402

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


def real_pool(kind: str, layout: str):
    """SGLang's own host pool, built on the CPU (as SGLang's assembler would from device buffers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about its CUDA kernels being absent
        return _real_pool(kind, layout)


def _real_pool(kind: str, layout: str):
    if kind == "mha":
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
        v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))

        def ptrs(ts):
            return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                               layout=KVBufferLayout.NHD),
                             page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
        return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS)
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, KV_LORA + ROPE, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def make_pool(kind: str, layout: str):
    return real_pool(kind, layout) if SGLANG_AVAILABLE else StandInPool(kind, layout)


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
    if SGLANG_AVAILABLE:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        return HiCacheStorageConfig(**cfg)
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

needs_sglang = pytest.mark.skipif(not SGLANG_AVAILABLE, reason="SGLang does not import here")


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

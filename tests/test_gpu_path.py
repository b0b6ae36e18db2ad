"""The engine data path (Transfer service) against a real kvtierd: CPU stand-in in CI, and
the same tests on CUDA (marked ``gpu``) when a GPU is there (scripts/gpu-check.sh).

Each test registers KV tensors through :class:`KVConnector`, moves blocks with the daemon's
copy engine, and compares bytes exactly. Engine processes other than the test itself are
started with subprocess (spawned, never forked)."""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _demotions import demotions_over  # noqa: E402

from kvtier.client.engine import ExportError, KVConnector, KVConnectorError, SharedKVArena  # noqa: E402
from kvtier.client.engine.sidecar import Sidecar  # noqa: E402
from kvtier.tiers.copy_engine import CopyError, check_engine_ids, plan_chunks  # noqa: E402
from kvtier.tiers.copy_engine import TensorRef as Ref  # noqa: E402
from kvtier.tiers.layout import Layout  # noqa: E402

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
BACKENDS = ["host", pytest.param("cuda", marks=[pytest.mark.gpu,
                                                pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(n)]


class Engine:
    """KV tensors of one layout in this process (CPU shared memory or CUDA) plus a connector."""

    def __init__(self, backend: str, layout: Layout, socket: str, shm_dir: str) -> None:
        self.layout = layout
        self.arena = None
        gen = torch.Generator().manual_seed(len(layout.tensors))
        if backend == "cuda":
            self.tensors = [torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="cuda") for t in layout.tensors]
        else:
            self.arena = SharedKVArena(layout, shm_dir)
            self.tensors = self.arena.tensors
        for t in self.tensors:
            t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
        self.conn = KVConnector(socket, ring_dir=shm_dir, ring_slots=4)
        self.layout_id = self.conn.register(layout, self.tensors)

    def snapshot(self) -> list:
        return [t.clone() for t in self.tensors]

    def close(self) -> None:
        self.conn.close()
        if self.arena is not None:
            self.arena.close()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvtier-engine-", dir="/dev/shm")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


@pytest.fixture(params=BACKENDS)
def kvd(request, start_daemon):
    """(backend, daemon) with the copy engine that backend needs."""
    engine = "cuda" if request.param == "cuda" else "host"
    return request.param, start_daemon("--copy-engine", engine, host_capacity="128MiB")


def block_slices(tensors: list, layout: Layout, ids: np.ndarray) -> bytes:
    """A block's payload built naively from the tensors (DESIGN.md's data model)."""
    out = []
    for t, spec in zip(tensors, layout.tensors, strict=True):
        idx = torch.as_tensor(ids.tolist(), device=t.device)
        part = t.index_select(spec.block_dim, idx) if spec.token_indexed else t.select(spec.block_dim, int(ids[0]))
        if spec.token_indexed:
            part = part.movedim(spec.block_dim, 0) if spec.block_dim else part
        out.append(part.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(out)


@pytest.mark.parametrize("kv_first", [True, False], ids=["2xNB", "NBx2"])
def test_vllm_offload_overwrite_onboard_elsewhere(kvd, shm_dir, kv_first: bool) -> None:
    backend, d = kvd
    layout = Layout.vllm(num_layers=4, num_blocks=48, block_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16",
                         kv_first=kv_first)
    eng = Engine(backend, layout, d.socket, shm_dir)
    try:
        n = 16
        keys = keys_for(f"vllm{kv_first}", n)
        src = np.random.default_rng(1).permutation(48)[:n]
        dst = np.setdiff1d(np.arange(48), src)[:n][::-1].copy()
        before = eng.snapshot()
        assert eng.conn.offload(keys, src).wait() == ["copied"] * n
        # the host payload is the DESIGN.md byte string, readable by any sidecar
        with Sidecar(d.socket) as sc:
            lid = sc.register_layout(layout)
            got = sc.get(lid, keys[:3])
        for i in range(3):
            assert bytes(got[i]) == block_slices(before, layout, src[i:i + 1])
        for t in eng.tensors:
            t.fill_(7)
        assert eng.conn.onboard(keys, dst).wait() == ["copied"] * n
        bd = layout.tensors[0].block_dim
        for t, b in zip(eng.tensors, before, strict=True):
            moved = t.index_select(bd, torch.as_tensor(dst.tolist(), device=t.device))
            want = b.index_select(bd, torch.as_tensor(src.tolist(), device=b.device))
            assert torch.equal(moved.view(torch.int16), want.view(torch.int16))
            untouched = np.setdiff1d(np.arange(48), dst)
            rest = t.index_select(bd, torch.as_tensor(untouched.tolist(), device=t.device))
            assert bool((rest == 7).all())
        assert eng.conn.offload(keys[:2], src[:2]).wait() == ["present", "present"]
    finally:
        eng.close()
    with Sidecar(d.socket) as sc:
        c = sc.stats()["counters"]
    assert c["kv_registrations_opened"] == c["kv_registrations_closed"] == 1
    assert c["kv_handles_opened"] == c["kv_handles_closed"] >= 1
    if backend == "host":  # four tensors in one shared file: that allocation is opened once
        assert c["kv_handles_opened"] == 1


def test_sglang_token_indexed_roundtrip(kvd, shm_dir) -> None:
    backend, d = kvd
    bt = 8
    layout = Layout.sglang(num_layers=3, num_tokens=512, block_tokens=bt, kv_heads=2, head_dim=32, dtype="float16")
    eng = Engine(backend, layout, d.socket, shm_dir)
    try:
        n = 10
        keys = keys_for("sglang", n)
        perm = np.random.default_rng(2).permutation(512)
        src, dst = perm[:n * bt].reshape(n, bt), perm[n * bt:2 * n * bt].reshape(n, bt)
        before = eng.snapshot()
        assert eng.conn.offload(keys, src).wait() == ["copied"] * n
        with Sidecar(d.socket) as sc:
            got = sc.get(sc.register_layout(layout), keys[:2])
        assert bytes(got[1]) == block_slices(before, layout, src[1])
        for t in eng.tensors:
            t.zero_()
        tr = eng.conn.onboard(keys, dst)
        deadline = time.monotonic() + 30
        while not tr.done():  # the non-blocking completion an engine's scheduler polls
            assert time.monotonic() < deadline, "onboard never completed"
            time.sleep(0.001)
        assert tr.statuses == ["copied"] * n
        for t, b in zip(eng.tensors, before, strict=True):
            moved = t[torch.as_tensor(dst.ravel().tolist(), device=t.device)]
            want = b[torch.as_tensor(src.ravel().tolist(), device=b.device)]
            assert torch.equal(moved.view(torch.int16), want.view(torch.int16))
        assert int(np.count_nonzero(np.concatenate(
            [t.cpu().view(torch.int16).numpy()[np.setdiff1d(np.arange(512), dst.ravel())].ravel()
             for t in eng.tensors]))) == 0
    finally:
        eng.close()


def test_layouts_never_mix_and_missing_keys_leave_pages_untouched(kvd, shm_dir) -> None:
    backend, d = kvd
    a = Layout.vllm(num_layers=2, num_blocks=16, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    b = Layout.vllm(num_layers=2, num_blocks=16, block_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16")
    ea, eb = Engine(backend, a, d.socket, shm_dir), Engine(backend, b, d.socket, shm_dir)
    try:
        keys = keys_for("mix", 4)
        assert ea.conn.offload(keys[:3], [0, 1, 2]).wait() == ["copied"] * 3
        before_b = eb.snapshot()
        # same keys, other layout: nothing is found, nothing is written
        assert eb.conn.onboard(keys[:3], [5, 6, 7]).wait() == ["missing"] * 3
        for t, s in zip(eb.tensors, before_b, strict=True):
            assert torch.equal(t, s)
        # one missing key among hits: its page stays as it was
        before_a = ea.snapshot()
        assert ea.conn.onboard(keys, [8, 9, 10, 11]).wait() == ["copied", "copied", "copied", "missing"]
        for t, s in zip(ea.tensors, before_a, strict=True):
            assert torch.equal(t[:, 11], s[:, 11])
            assert torch.equal(t[:, 8], s[:, 0])
    finally:
        ea.close()
        eb.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_onboard_of_blocks_demoted_to_disk(start_daemon, shm_dir, tmp_path, backend: str) -> None:
    """Offload more than the host tier holds: the oldest blocks go to disk, and onboarding
    them promotes them back to host first, with the same bytes."""
    layout = Layout.vllm(num_layers=2, num_blocks=32, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    d = start_daemon("--copy-engine", "cuda" if backend == "cuda" else "host", "--disk-dir", str(tmp_path / "disk"),
                     "--disk-capacity", "4MiB", "--demote-min-seen", "1", host_capacity=str(6 * layout.slot_bytes))
    eng = Engine(backend, layout, d.socket, shm_dir)
    try:
        keys = keys_for("disk", 12)
        before = eng.snapshot()
        for i in range(0, 12, 3):
            assert eng.conn.offload(keys[i:i + 3], list(range(i, i + 3))).wait() == ["copied"] * 3
        with Sidecar(d.socket) as sc:
            demotions_over(sc)  # the victims are written in the background
            where = sc.lookup(sc.register_layout(layout), keys[:3])
        assert where == ["disk"] * 3
        assert eng.conn.onboard(keys[:3], [20, 21, 22]).wait() == ["copied"] * 3
        for t, b in zip(eng.tensors, before, strict=True):
            assert torch.equal(t[:, 20:23], b[:, 0:3])
    finally:
        eng.close()


def test_bad_requests_are_refused_and_change_nothing(kvd, shm_dir) -> None:
    backend, d = kvd
    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    eng = Engine(backend, layout, d.socket, shm_dir)
    try:
        keys = keys_for("bad", 2)
        for ids, what in (([0], "2 keys"), ([0, 8], "outside"), ([3, 3], "twice")):
            with pytest.raises(KVConnectorError) as e:
                eng.conn.offload(keys, ids).wait()
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert what.split()[0] in e.value.details or what in e.value.details
        with Sidecar(d.socket) as sc:
            lid = sc.register_layout(layout)
            assert sc.lookup(lid, keys) == [None, None]
            assert sc.stats()["tiers"]["host"]["used_bytes"] == 0
        assert eng.conn.offload(keys, [0, 1]).wait() == ["copied", "copied"]
    finally:
        eng.close()


def hold_a_slot(conn: KVConnector, socket: str, tag: str):
    """Have the daemon hold one of ``conn``'s two event slots: an offload in it waits for a "KV
    written" record that never comes (until ``--transfer-wait-s``). The other slot is taken, so
    the connector's next transfer is given the held one. Returns (the offload's call, the held
    slot, the other slot, when the offload was sent)."""
    from kvtier.proto import transfer_pb2

    assert conn.reg is not None
    with Sidecar(socket) as sc:
        before = sc.stats()["tiers"]["host"]["used_bytes"]
    slot = conn._take_slot()
    sent = time.monotonic()
    stuck = conn._stub.Offload.future(transfer_pb2.TransferRequest(
        session_id=conn.session_id, registration_id=conn.reg.registration_id, keys=keys_for(tag, 1),
        engine_ids=[0], event_slot=slot, seq=next(conn._seq), wait_written=True), timeout=30)
    with Sidecar(socket) as sc:  # the daemon has taken it up (granted its slot, now waits)
        deadline = time.monotonic() + 10
        while sc.stats()["tiers"]["host"]["used_bytes"] == before:
            assert not stuck.done() and time.monotonic() < deadline, "the stuck offload was not taken up"
            time.sleep(0.01)
    other = conn._take_slot()
    conn._free_slot(slot)
    return stuck, slot, other, sent


def test_a_failed_onboard_is_reported_only_once_the_daemon_has_ended_it(start_daemon, shm_dir) -> None:
    """An onboard whose deadline passes may still be in the daemon's hands, and its copy may
    still come, into engine pages the engine reuses once told the load failed (vLLM recomputes
    into them). So before it raises DEADLINE_EXCEEDED the connector sends an empty onboard on
    the same event slot, which the daemon answers only once the failed one has
    ended there, and raises after that. Here the daemon holds the slot for 7 s (an older
    offload in it waits for a "KV written" record that never comes): the onboard's 1 s
    deadline passes, and its failure must not be reported before those 7 s."""

    d = start_daemon("--copy-engine", "host", "--transfer-wait-s", "7", host_capacity="64MiB")
    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    arena = SharedKVArena(layout, shm_dir)
    conn = KVConnector(d.socket, ring_dir=shm_dir, ring_slots=2, timeout=1.0)
    try:
        conn.register(layout, arena.tensors)
        assert conn.reg is not None
        stuck, slot, other, sent = hold_a_slot(conn, d.socket, "stuck")
        onboard = conn.onboard(keys_for("late", 2), [4, 5])
        assert onboard.slot == slot
        assert time.monotonic() - sent < 5, "too slow to set up: the onboard's 1 s deadline would not pass in the hold"
        with pytest.raises(KVConnectorError) as e:
            onboard.wait()
        failed_after = time.monotonic() - sent
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert failed_after >= 6.5, (f"the onboard's failure was reported {failed_after:.2f} s in, while the daemon "
                                     f"still held it (until 7 s): its pages could still be written")
        assert conn.counts_settled == 1
        with pytest.raises(grpc.RpcError) as stuck_err:
            stuck.result(10)
        assert stuck_err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # its "KV written" never came
        conn._free_slot(other)
        assert slot in conn._free, "a settled onboard's slot was not given back"
        keys = keys_for("after", 2)  # the connector works on afterwards, on that slot too
        assert conn.offload(keys, [1, 2]).wait() == ["copied"] * 2
        assert conn.onboard(keys, [6, 7]).wait() == ["copied"] * 2
    finally:
        conn.close()
        arena.close()


def test_a_failed_onboard_whose_session_ended_is_settled_at_once(start_daemon, shm_dir) -> None:
    """A failed onboard is settled by asking the daemon (an empty onboard on its slot). When the
    engine's session has ended meanwhile (the daemon restarted, say), the daemon refuses that
    question (FAILED_PRECONDITION: session not open); it was asked again every 2 ms until
    ``settle_s`` had passed, the engine's load unreported all the while. A refusal now settles it:
    the registration went with the session, once its copies had ended."""

    d = start_daemon("--copy-engine", "host", "--transfer-wait-s", "5", host_capacity="64MiB")
    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    arena = SharedKVArena(layout, shm_dir)
    conn = KVConnector(d.socket, ring_dir=shm_dir, ring_slots=2, timeout=1.0, settle_s=20.0)
    try:
        conn.register(layout, arena.tensors)
        assert conn.reg is not None
        hold_a_slot(conn, d.socket, "stuck2")
        onboard = conn.onboard(keys_for("gone", 2), [4, 5])
        while not onboard._future.done():  # (its deadline passes)
            time.sleep(0.01)
        conn._transport.session.close()   # the engine's session ends: the daemon closes its registration
        t0 = time.monotonic()
        with pytest.raises(KVConnectorError):
            onboard.wait()
        took = time.monotonic() - t0
        assert took < 10, f"settling a refused question took {took:.1f} s (asked again until settle_s)"
    finally:
        arena.close()


def test_cpu_tensor_without_a_sealed_memfd_is_refused(start_daemon, shm_dir) -> None:
    d = start_daemon("--copy-engine", "host")
    layout = Layout.vllm(num_layers=1, num_blocks=4, block_tokens=16, kv_heads=1, head_dim=16, dtype="float16")
    conn = KVConnector(d.socket, ring_dir=shm_dir)
    try:
        with pytest.raises(ExportError, match="memfd sealed against shrinking"):
            conn.register(layout, [torch.zeros(layout.tensors[0].shape, dtype=torch.float16)])
    finally:
        conn.close()


def test_cuda_registration_without_cuda_engine_is_refused(start_daemon) -> None:
    """A daemon with the host engine only says how to get a CUDA one (no GPU needed)."""
    from kvtier.proto import node_pb2, transfer_pb2
    from kvtier.tiers.layout import layout_to_proto

    d = start_daemon("--copy-engine", "host")
    layout = Layout.vllm(num_layers=1, num_blocks=4, block_tokens=16, kv_heads=1, head_dim=16, dtype="float16")
    conn = KVConnector(d.socket)
    try:
        sid = conn._open_session()
        # the connector's own stub: a session is its opener's (another channel is another caller)
        stub = conn._stub
        req = transfer_pb2.RegisterKVRequest(session_id=sid, layout=layout_to_proto(layout, node_pb2.LayoutSpec),
                                             backend="cuda", ring_slots=1,
                                             allocations=[transfer_pb2.KVAllocation(ipc_handle=b"\0" * 64,
                                                                                    size=1 << 20)],
                                             tensors=[transfer_pb2.KVTensorRef(allocation=0, offset=0)])
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterKV(req)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--copy-engine cuda" in e.value.details()
    finally:
        conn.close()


def _run_engine_until(socket: str, backend: str, shm_dir: str, mode: str, until: str,
                      reached: Callable[[], bool] | None = None) -> int:
    """Start an engine process (tests/kv_engine_proc.py), read its lines until one starts with
    ``until`` (and then, if given, until ``reached()``: polled, bounded), then kill it; returns
    the last round it finished."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "kv_engine_proc.py"), socket, backend, shm_dir, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    rounds = -1  # (unbuffered: select() sees every line not yet read)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"the engine never printed {until!r}"
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = proc.stdout.readline().decode()
            assert line, f"engine exited: {proc.stderr.read().decode()}"
            if line.startswith("round"):
                rounds = int(line.split()[1])
            if line.startswith(until):
                break
        if reached is not None:  # the daemon is where the test needs it (no sleep racing a busy machine)
            while not reached():
                assert time.monotonic() < deadline, "the engine's request never reached the daemon"
                time.sleep(0.01)
        else:
            time.sleep(0.004)  # a copy may start: the kill lands anywhere in the loop
    finally:
        proc.kill()
        proc.wait()
    for line in proc.stdout.read().decode().splitlines():  # rounds finished before the kill landed
        if line.startswith("round"):
            rounds = int(line.split()[1])
    return rounds


def _wait_closed(sc: Sidecar, registrations: int) -> dict:
    deadline = time.monotonic() + 20
    while True:
        s = sc.stats()
        c = s["counters"]
        if s["sessions"] == 0 and c.get("kv_registrations_closed", 0) == registrations == c["kv_registrations_opened"]:
            return c
        assert time.monotonic() < deadline, f"registration not closed after the engine died: {s}"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_killed_mid_transfer_leaves_nothing_open(start_daemon, shm_dir, backend: str) -> None:
    sys.path.insert(0, str(HERE))
    import kv_engine_proc as proc_mod

    d = start_daemon("--copy-engine", "cuda" if backend == "cuda" else "host", host_capacity="96MiB")
    # an observer holding no session (lookups from the key table would open one): sessions == 0 below
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(proc_mod.LAYOUT)
        # 1. killed while the daemon's offload waits for KV the engine never finished writing
        slots = proc_mod.LAYOUT.slot_bytes * proc_mod.BLOCKS

        def waiting() -> bool:  # round 0 is held, and the stalled offload's slots are granted
            return backend == "cuda" or sc.stats()["tiers"]["host"]["used_bytes"] >= 2 * slots

        _run_engine_until(d.socket, backend, shm_dir, "stall", "stalled", waiting)
        c = _wait_closed(sc, 1)
        if backend == "host":  # (a CUDA wait on an event never recorded passes at once)
            assert c["kv_inflight_at_close"] == 1 and c["kv_offloads_aborted"] == 1
            assert sc.lookup(lid, proc_mod.round_keys(1)) == [None] * proc_mod.BLOCKS
        # 2. killed anywhere in a loop of offloads and onboards
        rounds = _run_engine_until(d.socket, backend, shm_dir, "loop", "round 2")
        c = _wait_closed(sc, 2)
        assert c["kv_handles_closed"] == c["kv_handles_opened"] >= 2
        assert c["kv_events_closed"] == c["kv_events_opened"] >= 2
        for r in range(rounds + 2):
            sc.evict(lid, proc_mod.round_keys(r))
        # no grant and no pin survives: with every block evicted, no slot is in use
        assert sc.stats()["tiers"]["host"]["used_bytes"] == 0
    # a new engine registers again on the same daemon and moves blocks
    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    eng = Engine(backend, layout, d.socket, shm_dir)
    try:
        assert eng.conn.offload(keys_for("again", 2), [0, 1]).wait() == ["copied", "copied"]
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_daemon_and_torch_read_the_same_gpu_uuids() -> None:
    """The daemon matches an engine's GPU by the UUID torch gives the connector: cupy (or
    cuda.bindings) must read each GPU's the same, byte for byte, or every registration is refused."""
    from kvtier.client.engine.connector import uuid_bytes
    from kvtier.tiers.copy_engine import CudaCopyEngine

    eng = CudaCopyEngine(0)
    try:
        assert eng.visible_uuids == [uuid_bytes(torch.cuda.get_device_properties(i).uuid)
                                     for i in range(torch.cuda.device_count())]
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("how", ["kernel", "batch"])
def test_cuda_backends_move_the_same_bytes(start_daemon, shm_dir, how: str) -> None:
    d = start_daemon("--copy-engine", "cuda", "--cuda-backend", how, host_capacity="128MiB")
    layout = Layout.vllm(num_layers=4, num_blocks=64, block_tokens=16, kv_heads=4, head_dim=128, dtype="bfloat16")
    eng = Engine("cuda", layout, d.socket, shm_dir)
    try:
        assert eng.conn.copy_engine == f"cuda-{how}"
        keys = keys_for(how, 24)
        src, dst = np.arange(0, 48, 2), np.arange(1, 49, 2)
        before = eng.snapshot()
        assert eng.conn.offload(keys, src).wait() == ["copied"] * 24
        stream = torch.cuda.Stream()
        tr = eng.conn.onboard(keys, dst)
        assert tr.wait_on(stream) == ["copied"] * 24  # the stream waits; the CPU only for the reply
        stream.synchronize()
        for t, b in zip(eng.tensors, before, strict=True):
            assert torch.equal(t[:, torch.as_tensor(dst, device="cuda")].view(torch.int16),
                               b[:, torch.as_tensor(src, device="cuda")].view(torch.int16))
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_expandable_segments_memory_is_refused_naming_the_cause(start_daemon, shm_dir) -> None:
    d = start_daemon("--copy-engine", "cuda")
    code = (
        "import sys, torch\n"
        "from kvtier.client.engine import ExportError, KVConnector\n"
        "from kvtier.tiers.layout import Layout\n"
        "lay = Layout.vllm(num_layers=1, num_blocks=8, block_tokens=16, kv_heads=1, head_dim=64, dtype='float16')\n"
        "t = torch.zeros(lay.tensors[0].shape, dtype=torch.float16, device='cuda')\n"
        "c = KVConnector(sys.argv[1])\n"
        "try:\n"
        "    c.register(lay, [t])\n"
        "    print('REGISTERED')\n"
        "except ExportError as e:\n"
        "    print('REFUSED', e)\n")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run([sys.executable, "-c", code, d.socket], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "expandable_segments" in out.stdout


def test_daemon_imports_no_torch_and_no_cuda_with_the_host_engine() -> None:
    code = ("import sys\n"
            "from kvtier.daemon.config import load_config\n"
            "from kvtier.daemon.gpu import build_engines\n"
            "engines = build_engines(load_config(['--copy-engine', 'host']))\n"
            "bad = [m for m in ('torch', 'cupy', 'cuda') if m in sys.modules]\n"
            "print(sorted(engines), bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['host'] []", out.stdout + out.stderr


def test_plan_chunks_matches_the_payload_order() -> None:
    """Pure logic: chunk offsets of a [NB, 2, ...] layout, one tensor at offset 4096."""
    layout = Layout.vllm(num_layers=2, num_blocks=10, block_tokens=4, kv_heads=1, head_dim=8, dtype="float32",
                         kv_first=False)
    ids = check_engine_ids(layout, np.array([7, 2]), 2)
    plan = plan_chunks(layout, [Ref(0, 0), Ref(0, 4096)], ids, np.array([0, 8192]))
    inner = 2 * 4 * 8 * 4
    assert plan.chunks_per_block == 2
    assert plan.kv_off.tolist() == [7 * inner, 4096 + 7 * inner, 2 * inner, 4096 + 2 * inner]
    assert plan.pool_off.tolist() == [0, inner, 8192, 8192 + inner]
    assert plan.size.tolist() == [inner] * 4
    with pytest.raises(CopyError, match="outside"):
        check_engine_ids(layout, np.array([10, 0]), 2)

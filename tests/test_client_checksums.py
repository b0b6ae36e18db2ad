"""The client takes each block's checksum as it copies it into the pool
(client/engine/copyin.py) and sends them with its Commit; the daemon records them instead of
hashing (daemon/store.py ``_commit``), and still hashes a commit that brings none. A wrong
checksum only makes its own block fail a later verification (a counted miss), never serves
other bytes. Real daemons over real sockets."""

from __future__ import annotations

import os
import tempfile
import time

import grpc
import numpy as np
import pytest
from _demotions import demotions_over

from kvtier.client import Sidecar
from kvtier.client.engine import copyin
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.host import PoolMapping, payload_checksum
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") + b"checksum"


def block(seed: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonProcess(tmp, host_capacity="4MiB", name="sums").start()
        try:
            yield d
        finally:
            d.cleanup()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunked hashing and the threaded copy for small blocks too (the paths big puts take)."""
    monkeypatch.setattr(copyin, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(copyin, "PARALLEL_MIN_BYTES", 0)


def _commits(sc: Sidecar) -> list:
    """Every CommitRequest the sidecar sends, as sent."""
    sent: list = []
    transport = sc._transport
    start, unary = transport._start, transport._unary

    def logged_start(call):
        if call.method == "Commit":
            sent.append(call.request)
        return start(call)

    async def logged_unary(call):
        if call.method == "Commit":
            sent.append(call.request)
        return await unary(call)

    transport._start, transport._unary = logged_start, logged_unary
    return sent


class Raw:
    """A client's own Allocate / write / Commit, to send what a sidecar would not."""

    def __init__(self, sc: Sidecar, block_bytes: int = BLOCK) -> None:
        self.sc, self.n = sc, block_bytes
        self.stub = node_pb2_grpc.NodeStub(sc._channel)
        layout = Layout.flat(block_bytes)
        self.lid = sc.register_layout(layout)
        self.reg = self.stub.RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=layout_to_proto(layout, node_pb2.LayoutSpec)))
        self.pool = PoolMapping(self.reg.pool_path, self.reg.pool_bytes)

    def put(self, k: bytes, payload: bytes, checksums: list[int] | None) -> node_pb2.AllocateReply.Grant:
        sid = self.sc._ensure_session()
        g = self.stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=self.reg.layout_id,
                                                        keys=[k])).grants[0]
        assert g.status == node_pb2.GRANTED
        self.pool.arr[g.offset:g.offset + self.n] = np.frombuffer(payload, dtype=np.uint8)
        self.stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=[g.grant_id], checksums=checksums or []))
        return g

    def close(self) -> None:
        self.pool.close()


def failures(sc: Sidecar) -> int:
    return sc.stats()["counters"].get("checksum_failures", 0)


def test_the_compiled_copy_is_built() -> None:
    """CI builds tiers/_copyhash.c (``pip install``); without it puts fall back to numpy."""
    assert copyin.COMPILED, "kvtier.tiers._copyhash was not built (gcc and python3-dev at install?)"


@pytest.mark.parametrize("size", [1, 64, 4095, 4097, (256 << 10) - 1, 256 << 10, (256 << 10) + 1,
                                  3 * (1 << 20) + 7])
@pytest.mark.parametrize("compiled", [True, False])
def test_copy_hash_is_payload_checksum_at_odd_sizes(size, compiled, small_chunks) -> None:
    """The compiled copy (chunks of 256 KiB) and numpy's (chunks of 4 KiB here) copy exactly
    and give exactly payload_checksum, at any size and any alignment."""
    src = np.frombuffer(block(size, size), dtype=np.uint8)
    dst = np.zeros(size + 8, dtype=np.uint8)
    assert copyin.copy_hash(dst[3:3 + size], src, compiled) == payload_checksum(src)
    assert bytes(dst[3:3 + size]) == src.tobytes() and not dst[:3].any() and not dst[-5:].any()
    # a batch striped over the copy threads, and back out
    pool = np.zeros(3 * size + 1, dtype=np.uint8)
    arrs = [src, src[::-1].copy(), src]
    offsets = [1, 1 + size, 1 + 2 * size]
    assert copyin.put_blocks(pool, offsets, arrs, compiled) == [payload_checksum(a) for a in arrs]
    assert bytes(pool[1:]) == b"".join(a.tobytes() for a in arrs)
    out = [np.zeros(size, dtype=np.uint8) for _ in range(3)]
    copyin.get_blocks(pool, offsets, out, compiled)
    assert [bytes(o) for o in out] == [a.tobytes() for a in arrs]


def test_put_sends_the_checksums_and_a_verified_get_passes(daemon, small_chunks) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sent = _commits(sc)
        payloads = [block(100 + i) for i in range(6)]
        before = failures(sc)
        assert sc.put(lid, [key(100 + i) for i in range(6)], payloads).stored == 6
        assert [list(c.checksums) for c in sent] == [[payload_checksum(p) for p in payloads]]
        got = sc.get(lid, [key(100 + i) for i in range(6)], verify=True)
        assert [bytes(g) for g in got] == payloads
        assert failures(sc) == before


def test_a_wrong_client_checksum_is_a_counted_miss_never_wrong_bytes(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        raw = Raw(sc)
        try:
            mine = block(7)
            before = failures(sc)
            raw.put(key(7), mine, [payload_checksum(mine) ^ 1])
            assert sc.get(raw.lid, [key(7)], verify=True) == [None]   # found wrong: a miss
            assert failures(sc) == before + 1
            assert sc.lookup(raw.lid, [key(7)]) == [None]              # and dropped
            # the right one: stored and served
            raw.put(key(8), mine, [payload_checksum(mine)])
            assert bytes(sc.get(raw.lid, [key(8)], verify=True)[0]) == mine
            assert failures(sc) == before + 1
        finally:
            raw.close()


def test_a_commit_without_checksums_is_hashed_by_the_daemon(daemon) -> None:
    """An older client (or one that does not send them): the daemon takes the checksum, so a
    write after the commit is still found by a verified read."""
    with Sidecar(daemon.socket) as sc:
        raw = Raw(sc)
        try:
            before = failures(sc)
            g = raw.put(key(9), block(9), None)
            assert bytes(sc.get(raw.lid, [key(9)], verify=True)[0]) == block(9)
            raw.pool.arr[g.offset:g.offset + BLOCK] = 0xAB                # a write after the commit
            assert sc.get(raw.lid, [key(9)], verify=True) == [None]
            assert failures(sc) == before + 1
        finally:
            raw.close()


def test_checksums_not_one_per_grant_are_refused_and_change_nothing(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        raw = Raw(sc)
        try:
            with pytest.raises(grpc.RpcError) as err:
                raw.put(key(10), block(10), [1, 2])
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "2 checksums for 1 grants" in err.value.details()
            assert sc.lookup(raw.lid, [key(10)]) == [None]
        finally:
            raw.close()


def test_client_checksums_carry_through_demotion_to_disk(start_daemon, tmp_path, small_chunks) -> None:
    """Blocks put with client checksums are demoted (the disk compares its copy with the
    recorded checksum) and read back from disk verified; one with a wrong checksum is not
    demoted (counted), nor served."""
    d = start_daemon("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "16MiB", "--demote-min-seen", "1",
                     host_capacity=str(2 * BLOCK))
    with Sidecar(d.socket) as sc:
        raw = Raw(sc)
        try:
            payloads = [block(20 + i) for i in range(2)]
            assert sc.put(raw.lid, [key(20), key(21)], payloads).stored == 2
            raw.put(key(22), block(22), [payload_checksum(block(22)) ^ 2])
            # the next puts evict 20, 21 and 22 to disk (22 refused there: its bytes differ)
            assert sc.put(raw.lid, [key(23), key(24)], [block(23), block(24)]).stored == 2
            demotions_over(sc)  # (written in the background)
            wait = [sc.lookup(raw.lid, [key(20), key(21), key(22)])]
            assert wait[-1] == ["disk", "disk", None], wait
            assert failures(sc) == 1
            got = sc.get(raw.lid, [key(20), key(21), key(22)], verify=True)
            assert [bytes(g) if g is not None else None for g in got] == [*payloads, None]
            assert failures(sc) == 1
        finally:
            raw.close()


def _exit_code(pid: int, timeout_s: float, hung: str) -> int:
    """A forked child's exit code; killed, and ``hung`` raised, if it has not exited in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.03)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(hung)


def test_a_forked_child_copies_on_threads_of_its_own() -> None:
    """The copy threads are the parent's: a child forked after a large put (an engine forking
    its workers) gets its own pool instead of waiting on threads it does not have."""
    pool = np.zeros(4 << 20, dtype=np.uint8)
    arrs = [np.full(1 << 20, i, dtype=np.uint8) for i in range(4)]
    big = copyin.PARALLEL_MIN_BYTES
    copyin.PARALLEL_MIN_BYTES = 0
    try:
        copyin.put_blocks(pool, [0, 1 << 20, 2 << 20, 3 << 20], arrs)   # the parent's threads start
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its put finished (a hang is killed below)
            try:
                copyin.put_blocks(pool, [0, 1 << 20, 2 << 20, 3 << 20], arrs[::-1])
                os._exit(0 if pool[0] == 3 else 1)
            finally:
                os._exit(2)
        assert _exit_code(pid, 10.0, "the forked child's put hung on its parent's copy threads") == 0
    finally:
        copyin.PARALLEL_MIN_BYTES = big


# -- tiers/_copyhash.c and client/engine/copyin.py under hostile input ---------------------------
# Crash-prone cases run in a child process: a crash (or an ASan report, when built with
# sanitizers) fails the test instead of killing pytest.

_CHILD_SWEEP = r"""
import numpy as np, xxhash
from kvtier.tiers import _copyhash as c
C = c.CHUNK_BYTES
sizes = sorted({0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 239, 240, 241,
                255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, (3 << 20) + 7, 5 << 20}
               | {C + d for d in (-129, -128, -65, -64, -17, -16, -1, 0, 1, 15, 16, 63, 64, 127, 128)}
               | {2 * C + d for d in (-1, 0, 1)})
src = np.random.default_rng(1).integers(0, 256, max(sizes) + 64, dtype=np.uint8)
dst = np.zeros(max(sizes) + 128, dtype=np.uint8)
for n in sizes:
    for so, do in ((0, 0), (1, 3), (5, 16), (16, 63)):
        s, d = src[so:so + n], dst[do:do + n]
        dst[:do + n + 64] = 0
        assert c.copy_hash(d, s) == xxhash.xxh3_64_intdigest(s), (n, so, do)
        assert bytes(d) == s.tobytes() and not dst[:do].any() and not dst[do + n:do + n + 64].any(), (n, so, do)
        dst[:do + n + 64] = 0
        c.copy(d, s)
        assert bytes(d) == s.tobytes() and not dst[:do].any() and not dst[do + n:do + n + 64].any(), (n, so, do)
print(c.AVX2)
"""


def _child(code: str, **env: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.skipif(not copyin.COMPILED, reason="kvtier.tiers._copyhash not built")
@pytest.mark.parametrize("baseline", ["1", "0"])
def test_copy_hash_is_xxh3_at_every_size_on_both_loops(baseline) -> None:
    """Sizes around 16/64/128-byte steps, xxh3's 240-byte step and the 256 KiB chunk, up to 5
    MiB, at odd source and destination alignments: the checksum is xxhash's and the copy exact,
    on the AVX2 loop and on the baseline one (KVTIER_COPYHASH_BASELINE=1 forces it)."""
    r = _child(_CHILD_SWEEP, KVTIER_COPYHASH_BASELINE=baseline)
    assert r.returncode == 0, r.stderr[-3000:]
    with open("/proc/cpuinfo") as f:
        cpu_avx2 = " avx2" in f.read()
    assert r.stdout.split()[-1] == ("0" if baseline == "1" else str(int(cpu_avx2)))


_CHILD_HOSTILE = r"""
import mmap
import numpy as np, xxhash
from kvtier.tiers import _copyhash as c
src = np.arange(1000, dtype=np.uint8)

def refused(exc, f, *args):
    try:
        f(*args)
    except exc:
        return
    raise AssertionError(f"{f.__name__}{tuple(type(a).__name__ for a in args)} was not refused with {exc}")

for f in (c.copy_hash, c.copy):
    refused(TypeError, f, bytes(1000), src)                                   # read-only destination
    refused(TypeError, f, np.frombuffer(bytes(1000), np.uint8), src)
    refused(ValueError, f, np.zeros(999, np.uint8), src)                      # lengths differ
    refused(ValueError, f, np.zeros(1001, np.uint8), src)
    refused((ValueError, BufferError), f, np.zeros(500, np.uint8), src[::2])  # not contiguous
    refused((TypeError, BufferError), f, np.zeros(2000, np.uint8)[::2], src)
    refused((ValueError, BufferError), f, np.zeros(1000, np.uint8), np.asfortranarray(src.reshape(10, 100)))
    refused(TypeError, f, bytearray(3), "abc")
    refused(TypeError, f, None, src)
    refused(TypeError, f, src)
    big = np.zeros(3 << 20, np.uint8)
    refused(ValueError, f, big[1:(2 << 20) + 1], big[:2 << 20])               # overlapping
    refused(ValueError, f, big[:2 << 20], big[4096:(2 << 20) + 4096])
    m = mmap.mmap(-1, 1 << 20)
    pool = np.frombuffer(m, np.uint8)
    refused(ValueError, f, pool[(1 << 20) - 10:], src[:20])                   # a slot past the mapping's end
    # lengths are bytes whatever the item size: 250 float32 are 1000 bytes
    f(np.zeros(250, np.float32), src)
    f(np.zeros(1000, np.uint8), np.ones(250, np.float32))
    assert f(bytearray(), b"") in (None, xxhash.xxh3_64_intdigest(b""))
    # unaligned streamed destinations in a shared mapping (the non-temporal stores' alignment)
    s = np.random.default_rng(0).integers(0, 256, (1 << 19) + 100, dtype=np.uint8)
    for off in (1, 3, 15, 17, 63):
        n = (1 << 19) + 5
        h = f(pool[off:off + n], s[1:1 + n])
        assert bytes(pool[off:off + n]) == s[1:1 + n].tobytes() and h in (None, xxhash.xxh3_64_intdigest(s[1:1 + n]))
    del pool
    m.close()
print("ok")
"""


@pytest.mark.skipif(not copyin.COMPILED, reason="kvtier.tiers._copyhash not built")
def test_the_compiled_copy_refuses_hostile_buffers_cleanly() -> None:
    """Read-only or short destinations, non-contiguous or overlapping buffers, a slot past the
    mapping: a Python exception each, never a crash or a write out of bounds; other item sizes
    count in bytes, and unaligned destinations stream correctly."""
    r = _child(_CHILD_HOSTILE)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("compiled", [True, False])
def test_put_and_get_blocks_count_bytes_for_any_dtype(compiled, small_chunks) -> None:
    """Blocks of float16 (a torch/numpy KV dtype) land at their offsets as bytes on both paths:
    numpy's copy casting element by element, or a slot sliced by element count, would differ."""
    arrs = [np.random.default_rng(i).standard_normal(3000).astype(np.float16) for i in range(3)]
    pool = np.zeros(3 * 6000 + 8, dtype=np.uint8)
    offsets = [8, 8 + 6000, 8 + 12000]
    assert copyin.put_blocks(pool, offsets, arrs, compiled) == [payload_checksum(a.tobytes()) for a in arrs]
    assert bytes(pool[8:]) == b"".join(a.tobytes() for a in arrs) and not pool[:8].any()
    out = [np.zeros(3000, dtype=np.float16) for _ in range(3)]
    copyin.get_blocks(pool, offsets, out, compiled)
    assert all(np.array_equal(o, a) for o, a in zip(out, arrs, strict=True))
    with pytest.raises((TypeError, ValueError)):  # a read-only destination: refused on both paths
        copyin.get_blocks(pool, offsets[:1], [np.frombuffer(bytes(6000), dtype=np.uint8)], compiled)
    with pytest.raises(ValueError):               # overlapping: refused on both paths
        copyin.copy_hash(pool[1:6001], pool[:6000], compiled)


def test_a_put_copies_when_the_copy_threads_are_shut_down(small_chunks) -> None:
    """The copy threads' pool refusing work (shut down, as at interpreter exit): the caller's
    thread copies every block instead of the put failing (or returning while a thread it did
    start still writes into slots the failed put gives back)."""
    arrs = [np.full(1 << 16, i, dtype=np.uint8) for i in range(6)]
    pool = np.zeros(6 << 16, dtype=np.uint8)
    copyin._executor().shutdown()
    try:
        sums = copyin.put_blocks(pool, [i << 16 for i in range(6)], arrs)
    finally:
        copyin._pool = None
    assert sums == [payload_checksum(a) for a in arrs] and bytes(pool) == b"".join(a.tobytes() for a in arrs)


def test_a_child_forked_while_the_pool_lock_is_held_still_copies() -> None:
    """A fork while another thread holds the copy threads' lock (it is taken for each large
    batch) must not leave the child waiting on a lock no thread of its own will release."""
    with copyin._pool_lock:
        pid = os.fork()
        if pid == 0:
            try:
                copyin._executor()
                os._exit(0)
            finally:
                os._exit(2)
    assert _exit_code(pid, 3.0, "the forked child hung on the copy threads' lock") == 0


def test_a_get_into_a_read_only_buffer_is_invalid_argument_and_copies_nothing(daemon) -> None:
    """A read-only (bytes) or non-contiguous output buffer is the caller's error, named before
    any block is copied; its leases go back, so the next get of the same keys is served."""
    from kvtier.client import InvalidArgument
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        payloads = [block(300 + i) for i in range(2)]
        keys = [key(300 + i) for i in range(2)]
        assert sc.put(lid, keys, payloads).stored == 2
        first = bytearray(BLOCK)
        with pytest.raises(InvalidArgument, match="read-only"):
            sc.get(lid, keys, out=[first, bytes(BLOCK)])
        with pytest.raises(InvalidArgument, match="not a contiguous buffer"):
            sc.get(lid, keys, out=[first, np.zeros(2 * BLOCK, dtype=np.uint8)[::2]])
        assert not any(first)
        assert [bytes(g) for g in sc.get(lid, keys)] == payloads

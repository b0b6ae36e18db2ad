"""Ids are capabilities, safe KV registration, quotas and expiring grants
and leases. One test per attack, each refused; against real daemons where the attack comes over
the wire, in process where it is about what the daemon maps."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
import time

import grpc
import numpy as np
import pytest
from _wait import wait_for

from kvtier.client.engine.sidecar import Sidecar
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.gpu import KVRegistration, TransferOrder, Transfers
from kvtier.daemon.sessions import Limits
from kvtier.daemon.store import BlockStore
from kvtier.proto import node_pb2, node_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from kvtier.tiers.copy_engine import (
    AllocationRef,
    EngineMemoryError,
    HostCopyEngine,
    TensorRef,
    map_sealed_fd,
    sealed_memfd,
)
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 64 * 1024
LAYOUT = Layout.flat(BLOCK)


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "big") + b"\0" * (11 - len(tag)) for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(BLOCK) for _ in range(n)]


def refused(code: grpc.StatusCode, fn, *args, **kw) -> str:
    """Call ``fn``; it must fail with ``code``; returns the details."""
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    return e.value.details()


class Raw:
    """A Sidecar's session and raw Node stub, for requests a Sidecar would never send."""

    def __init__(self, socket: str) -> None:
        self.sc = Sidecar(socket)
        self.lid = self.sc.register_layout(LAYOUT)
        self.sid = self.sc._ensure_session()
        self.dlid = self.sc._layouts[self.lid].daemon_id
        self.stub: node_pb2_grpc.NodeStub = self.sc._stub

    def allocate(self, ks: list[bytes]) -> list[int]:
        reply = self.stub.Allocate(node_pb2.AllocateRequest(session_id=self.sid, layout_id=self.dlid, keys=ks))
        return [g.grant_id for g in reply.grants if g.status == node_pb2.GRANTED]

    def acquire(self, ks: list[bytes]) -> list[int]:
        reply = self.stub.Acquire(node_pb2.AcquireRequest(session_id=self.sid, layout_id=self.dlid, keys=ks))
        return [lease.lease_id for lease in reply.leases]

    def commit(self, gids: list[int], sid: int | None = None) -> int:
        req = node_pb2.CommitRequest(session_id=self.sid if sid is None else sid, grant_ids=gids)
        return self.stub.Commit(req).committed

    def release(self, lids: list[int], sid: int | None = None) -> None:
        self.stub.Release(node_pb2.ReleaseRequest(session_id=self.sid if sid is None else sid, lease_ids=lids))

    def close(self) -> None:
        self.sc.close()


# -- ids are capabilities -----------------------------------------------------------------------

def test_ids_are_random_not_sequential(daemon) -> None:
    """An attacker who saw one id cannot compute the next: session, grant and lease ids are
    random (63 bits), none 0, none a neighbour of another."""
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    try:
        gids = a.allocate(keys(32, b"seq"))
        a.commit(gids)
        lids = a.acquire(keys(32, b"seq"))
        ids = [a.sid, b.sid, *gids, *lids]
        assert 0 not in ids and len(set(ids)) == len(ids)
        diffs = np.diff(np.array(sorted(ids), dtype=np.float64))
        assert diffs.min() > 1e6, "ids are close together: sequential?"
        assert max(ids).bit_length() > 48  # spread over the id space
    finally:
        a.close()
        b.close()


def test_another_sessions_grant_is_refused(daemon) -> None:
    """Session B commits (or aborts) a grant session A holds: refused as an id nobody holds
    (INVALID_ARGUMENT, the same words: B does not learn the id is live), and A's grant is
    untouched (A still commits it)."""
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    try:
        k = keys(1, b"grant")
        gid = a.allocate(k)[0]
        why = refused(grpc.StatusCode.INVALID_ARGUMENT, b.commit, [gid])
        unknown = refused(grpc.StatusCode.INVALID_ARGUMENT, b.commit, [gid ^ 0x5A5A5A])
        assert why.replace(str(gid), "ID") == unknown.replace(str(gid ^ 0x5A5A5A), "ID")
        abort = node_pb2.CommitRequest(session_id=b.sid, abort_grant_ids=[gid])
        refused(grpc.StatusCode.INVALID_ARGUMENT, b.stub.Commit, abort)
        assert a.commit([gid]) == 1
    finally:
        a.close()
        b.close()


def test_another_sessions_lease_is_refused(daemon) -> None:
    """Session B releases a lease session A holds (which would let A's slot be reused mid-copy):
    refused as an id nobody holds (INVALID_ARGUMENT, the same words), and the lease stays A's."""
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    try:
        k = keys(1, b"lease")
        a.sc.put(a.lid, k, blocks(1))
        lid = a.acquire(k)[0]
        why = refused(grpc.StatusCode.INVALID_ARGUMENT, b.release, [lid])
        unknown = refused(grpc.StatusCode.INVALID_ARGUMENT, b.release, [lid ^ 0x5A5A5A])
        assert why.replace(str(lid), "ID") == unknown.replace(str(lid ^ 0x5A5A5A), "ID")
        a.release([lid])  # still A's to release
    finally:
        a.close()
        b.close()


def test_an_internal_session_cannot_be_named(tmp_path) -> None:
    """The Transfer service's own session (holding a registration's copies) is never reachable by
    id from the wire, even by the caller it works for."""
    async def body(store: BlockStore, transfers: Transfers, sid: int, kv_fd: int, ring_fd: int) -> None:
        await transfers.register(registration(sid, kv_fd, ring_fd))
        internal = next(s for s in store.sessions.ids() if store.sessions[s].internal)
        from kvtier.daemon.auth import LOCAL  # noqa: PLC0415
        with pytest.raises(StoreError) as e:
            store.session(internal, LOCAL)
        assert e.value.code == Code.FAILED_PRECONDITION
    in_process(tmp_path, body)


def test_another_sessions_registration_is_refused(tmp_path) -> None:
    """Session B asks for an onboard (a write into engine memory) through session A's KV
    registration: PERMISSION_DENIED, nothing copied."""
    async def body(store: BlockStore, transfers: Transfers, sid: int, kv_fd: int, ring_fd: int) -> None:
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        other = store.open_session("attacker", os.getpid()).session_id
        order = TransferOrder(other, reg.registration_id, keys(1, b"reg"), np.array([0]), 0, 1)
        for call in (transfers.onboard, transfers.offload):
            with pytest.raises(StoreError) as e:
                await call(order)
            assert e.value.code == Code.PERMISSION_DENIED and "another session" in str(e.value)
        with pytest.raises(StoreError) as e:
            await transfers.unregister(other, reg.registration_id)
        assert e.value.code == Code.PERMISSION_DENIED
        assert reg.registration_id in transfers.registrations
    in_process(tmp_path, body)


# -- safe KV registration -----------------------------------------------------------------------

def test_register_kv_of_a_path_is_refused(daemon, tmp_path) -> None:
    """RegisterKV naming a file (any file the daemon's user can open, e.g. its own pool) is
    refused INVALID_ARGUMENT, saying to pass a descriptor; the daemon opened nothing."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * (4 * BLOCK))
    a = Raw(daemon.socket)
    try:
        stub = transfer_pb2_grpc.TransferStub(a.sc._channel)
        layout = Layout.flat(BLOCK, num_blocks=4)
        for alloc, ring in ((transfer_pb2.KVAllocation(path=str(victim), size=4 * BLOCK), ""),
                            (transfer_pb2.KVAllocation(size=4 * BLOCK, fd_handle="00" * 16), str(victim))):
            req = transfer_pb2.RegisterKVRequest(
                session_id=a.sid, layout=layout_to_proto(layout, node_pb2.LayoutSpec), backend="host",
                allocations=[alloc], tensors=[transfer_pb2.KVTensorRef(allocation=0, offset=0)],
                event_ring_path=ring, ring_slots=8)
            why = refused(grpc.StatusCode.INVALID_ARGUMENT, stub.RegisterKV, req)
            assert "file descriptor" in why and "path" in why
        with open(f"/proc/{daemon.proc.pid}/maps") as fh:
            assert str(victim) not in fh.read()
        assert victim.stat().st_size == 4 * BLOCK
    finally:
        a.close()


def test_a_sealed_region_cannot_shrink_and_an_unsealed_one_is_refused(tmp_path) -> None:
    """Truncating registered engine memory would SIGBUS the daemon: the memfd the client makes
    refuses to shrink, and memory that could shrink is refused at registration."""
    fd = sealed_memfd("kvtier-test", 4 * BLOCK)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, BLOCK)
        assert os.fstat(fd).st_size == 4 * BLOCK
        map_sealed_fd(fd, 4 * BLOCK, "kv").close()
    finally:
        os.close(fd)
    unsealed = os.memfd_create("kvtier-unsealed", os.MFD_ALLOW_SEALING)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    grow_only = os.memfd_create("kvtier-grow-only", os.MFD_ALLOW_SEALING)
    try:
        for f in (unsealed, plain, grow_only):
            os.ftruncate(f, 4 * BLOCK)
        fcntl.fcntl(grow_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        for f in (unsealed, plain, grow_only):
            with pytest.raises(EngineMemoryError, match="F_SEAL_SHRINK"):
                map_sealed_fd(f, 4 * BLOCK, "kv")
    finally:
        for f in (unsealed, plain, grow_only):
            os.close(f)


def test_register_kv_of_an_unsealed_fd_is_refused(tmp_path) -> None:
    """Through the Transfer domain: an engine passing a memfd it could still shrink is refused,
    and no registration, handle or mapping stays."""
    async def body(store: BlockStore, transfers: Transfers, sid: int, kv_fd: int, ring_fd: int) -> None:
        unsealed = os.memfd_create("kvtier-unsealed", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(unsealed, 4 * BLOCK)
            with pytest.raises(StoreError) as e:
                await transfers.register(registration(sid, unsealed, ring_fd))
            assert e.value.code == Code.FAILED_PRECONDITION and "F_SEAL_SHRINK" in str(e.value)
            assert not transfers.registrations
        finally:
            os.close(unsealed)
    in_process(tmp_path, body)


# -- quotas, deadlines, caps --------------------------------------------------------------------

def test_a_session_over_its_quota_is_refused_while_another_puts(start_daemon) -> None:
    """One session tries to hold more than its quota in grants (never committing): refused
    RESOURCE_EXHAUSTED naming the quota, holding only what it had; another session's put works."""
    d = start_daemon("--session-quota", str(4 * BLOCK), host_capacity=str(64 * BLOCK))
    hog, other = Raw(d.socket), Raw(d.socket)
    try:
        assert len(hog.allocate(keys(4, b"hog"))) == 4
        why = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, hog.allocate, keys(1, b"hog2"))
        assert "session quota" in why and "--session-quota" in why
        lid = hog.acquire([])  # an empty acquire is nothing to hold
        assert lid == []
        res = other.sc.put(other.lid, keys(3, b"ok"), blocks(3))
        assert not res.dropped
        assert [bytes(x) for x in other.sc.get(other.lid, keys(3, b"ok"))] == blocks(3)
    finally:
        hog.close()
        other.close()


def test_an_expired_lease_is_refused_and_its_slot_is_reusable(start_daemon) -> None:
    """A lease held past --lease-ttl-s is unpinned: its Release is refused DEADLINE_EXCEEDED
    saying it expired, and its slot can be given to another block."""
    nslots = 4
    d = start_daemon("--lease-ttl-s", "0.4", "--session-quota", str(nslots * BLOCK), host_capacity=str(nslots * BLOCK))
    a = Raw(d.socket)
    try:
        k = keys(1, b"old")
        a.sc.put(a.lid, k, blocks(1))
        lid = a.acquire(k)[0]
        time.sleep(0.5)
        wait_for(lambda: a.sc.stats()["counters"]["leases_reclaimed"] >= 1, what="the lease's expiry sweep")
        why = refused(grpc.StatusCode.DEADLINE_EXCEEDED, a.release, [lid])
        assert "expired" in why and "--lease-ttl-s" in why
        # no pin left: a pool's worth of new blocks fits, evicting the old one
        fresh = keys(nslots, b"new")
        assert not a.sc.put(a.lid, fresh, blocks(nslots, 1)).dropped
        assert a.sc.lookup(a.lid, k) == [None]
    finally:
        a.close()


def test_an_expired_grant_cannot_be_committed(start_daemon) -> None:
    """A grant not committed within --grant-ttl-s is aborted: a late Commit is refused
    DEADLINE_EXCEEDED, the key stays invisible, and its slot is back in the pool."""
    nslots = 4
    d = start_daemon("--grant-ttl-s", "0.4", "--session-quota", str(nslots * BLOCK), host_capacity=str(nslots * BLOCK))
    a = Raw(d.socket)
    try:
        k = keys(1, b"late")
        gid = a.allocate(k)[0]
        time.sleep(0.5)
        wait_for(lambda: a.sc.stats()["counters"]["grants_reclaimed"] >= 1, what="the grant's expiry sweep")
        why = refused(grpc.StatusCode.DEADLINE_EXCEEDED, a.commit, [gid])
        assert "expired" in why and "--grant-ttl-s" in why
        assert a.sc.lookup(a.lid, k) == [None]
        assert not a.sc.put(a.lid, keys(nslots, b"fill"), blocks(nslots)).dropped
    finally:
        a.close()


def test_session_streams_over_the_cap_are_refused(start_daemon) -> None:
    """A client opening Session streams without end: past --max-sessions they are refused
    RESOURCE_EXHAUSTED; closing one makes room."""
    d = start_daemon("--max-sessions", "2")
    a, b = Raw(d.socket), Raw(d.socket)
    try:
        stub = node_pb2_grpc.NodeStub(a.sc._channel)
        hello = node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name="third", pid=1))
        call = stub.Session(iter([hello]))
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in e.value.details()
        b.close()
        c = Raw(d.socket)
        c.close()
    finally:
        a.close()


def test_a_transfer_whose_kv_is_never_written_times_out(tmp_path) -> None:
    """An offload whose "KV written" record never comes holds a copy thread only until
    --transfer-wait-s: then DEADLINE_EXCEEDED, and its grants are given back."""
    async def body(store: BlockStore, transfers: Transfers, sid: int, kv_fd: int, ring_fd: int) -> None:
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        order = TransferOrder(sid, reg.registration_id, keys(2, b"never"), np.array([0, 1]), 0, 7,
                              wait_written=True)
        t = time.monotonic()
        with pytest.raises(StoreError) as e:  # bounded: an unbounded wait fails here, never hangs the suite
            await asyncio.wait_for(transfers.offload(order), 10)
        assert e.value.code == Code.DEADLINE_EXCEEDED and "--transfer-wait-s" in str(e.value)
        assert time.monotonic() - t < 5
        assert not any(store.sessions[s].grants for s in store.sessions.ids())
        assert store.lookup(reg.layout_id, keys(2, b"never")) == [None, None]
    in_process(tmp_path, body, Limits(transfer_wait_s=0.3))


# -- in-process helpers -------------------------------------------------------------------------

KV_LAYOUT = Layout.flat(BLOCK, num_blocks=4)


def registration(sid: int, kv_fd: int, ring_fd: int) -> KVRegistration:
    return KVRegistration(sid, KV_LAYOUT, "host", [AllocationRef(4 * BLOCK, fd=kv_fd)], [TensorRef(0, 0)], 8,
                          event_ring_fd=ring_fd)


def in_process(tmp_path, body, limits: Limits | None = None, engine: HostCopyEngine | None = None) -> None:
    """Run ``body(store, transfers, session id, kv memfd, ring memfd)`` on a real store and host
    copy engine (``engine``: one made to behave as another engine does where a test needs it)."""
    shm = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    kv_fd, ring_fd = sealed_memfd("kvtier-test-kv", 4 * BLOCK), sealed_memfd("kvtier-test-ring", 64)

    async def main() -> None:
        store = BlockStore(HostTier(shm, 16 * BLOCK, "sec"), limits=limits)
        transfers = Transfers(store, {"host": engine or HostCopyEngine(1)}, threads=2)
        try:
            sid = store.open_session("engine", os.getpid()).session_id
            await body(store, transfers, sid, kv_fd, ring_fd)
        finally:
            await transfers.close()
            store.close()

    try:
        asyncio.run(main())
    finally:
        os.close(kv_fd)
        os.close(ring_fd)
        shutil.rmtree(shm, ignore_errors=True)


# -- two authenticated callers (the transport's credential handshake) ---------------------------

def test_another_callers_session_is_refused(daemon) -> None:
    """Caller B names caller A's session in every call that takes one: PERMISSION_DENIED (the
    message says what was refused, not whose it is), and A's grants and leases are untouched."""
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    try:
        k = keys(2, b"xcall")
        a.sc.put(a.lid, k[:1], blocks(1))
        lid = a.acquire(k[:1])[0]
        gid = a.allocate(k[1:])[0]
        calls = [
            (b.stub.Allocate, node_pb2.AllocateRequest(session_id=a.sid, layout_id=b.dlid, keys=keys(1, b"b"))),
            (b.stub.Commit, node_pb2.CommitRequest(session_id=a.sid, grant_ids=[gid])),
            (b.stub.Commit, node_pb2.CommitRequest(session_id=a.sid, abort_grant_ids=[gid])),
            (b.stub.Acquire, node_pb2.AcquireRequest(session_id=a.sid, layout_id=b.dlid, keys=k[:1])),
            (b.stub.Release, node_pb2.ReleaseRequest(session_id=a.sid, lease_ids=[lid])),
        ]
        for call, req in calls:
            why = refused(grpc.StatusCode.PERMISSION_DENIED, call, req)
            assert f"session {a.sid}" in why and "another caller" in why
        a.release([lid])
        assert a.commit([gid]) == 1
    finally:
        a.close()
        b.close()


def test_another_callers_registration_is_refused(daemon) -> None:
    """Caller B asks for an onboard into caller A's registered KV memory, naming A's session or
    its own: PERMISSION_DENIED both ways, and A's engine memory is untouched."""
    torch = pytest.importorskip("torch")
    from kvtier.client.engine import KVConnector, SharedKVArena  # noqa: PLC0415

    layout = Layout.vllm(num_layers=1, num_blocks=4, block_tokens=16, kv_heads=1, head_dim=16, dtype="float16")
    arena = SharedKVArena(layout)
    conn = KVConnector(daemon.socket, ring_slots=2)
    b = Raw(daemon.socket)
    try:
        for t in arena.tensors:
            t.copy_(torch.ones(t.shape, dtype=t.dtype))
        conn.register(layout, arena.tensors)
        assert conn.reg is not None
        stub = transfer_pb2_grpc.TransferStub(b.sc._channel)
        for sid in (conn.session_id, b.sid):
            req = transfer_pb2.TransferRequest(session_id=sid, registration_id=conn.reg.registration_id,
                                               keys=keys(1, b"xreg"), engine_ids=[0], event_slot=0, seq=1)
            refused(grpc.StatusCode.PERMISSION_DENIED, stub.Onboard, req)
            unreg = transfer_pb2.UnregisterKVRequest(session_id=sid, registration_id=conn.reg.registration_id)
            refused(grpc.StatusCode.PERMISSION_DENIED, stub.UnregisterKV, unreg)
        assert all(bool((t == 1).all()) for t in arena.tensors)
    finally:
        b.close()
        conn.close()
        arena.close()

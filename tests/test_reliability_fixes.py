"""Issue 14, items 6 and 7: the failure cases 0.1 left open, each on real components.

In process (a BlockStore on a real tmpfs HostTier, the daemon's own LocationLog), or against
a real kvtierd over its socket; each test names the promise it guards.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import tracemalloc

import pytest

from kvtier.client.engine.sidecar import Sidecar
from kvtier.daemon.events import LocationLog, event_bytes
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"fixes-14" + i.to_bytes(24, "big")   # 32 bytes: the longest key


def test_the_event_ring_is_bounded_in_bytes(shm) -> None:
    """One-key events weigh about 290 bytes each in the daemon's heap: a ring bounded only by
    its key count (1,048,576 by default) grew the heap by hundreds of MiB. With
    ``event_log_bytes`` the ring's heap stays under its bound, measured with tracemalloc, and
    its accounting equals the events it holds."""
    layout = Layout.flat(BLOCK)

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * layout.slot_bytes, "ring"))
        bound = 256 * 1024
        loc = LocationLog(store, "node", epoch=1, max_keys=1 << 20, max_bytes=bound)
        await store.register_layout(layout)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(6000):
                loc.stored(Tier.HOST, layout.fingerprint, [key(i)])
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        held = loc.since(loc.first_seq - 1)
        assert held is not None and loc.first_seq > 1, "nothing was dropped: the ring is not bounded in bytes"
        assert loc._ring_bytes == sum(event_bytes(ev.keys) for ev in held) <= bound
        assert grown < 1.25 * bound, f"the ring took {grown} bytes of heap for a bound of {bound}"
        assert held[-1].keys[0] == key(5999)

    asyncio.run(main())


# -- the sidecar across daemon restarts (real kvtierd subprocesses) ------------------------------

def _mapped(shm_dir: str, suffix: str) -> list[str]:
    """Files of ``shm_dir`` ending in ``suffix`` this process maps ('... (deleted)' once unlinked)."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and shm_dir in line and suffix in line})


def test_a_put_retried_after_a_restart_counts_each_key_once(start_daemon, tmp_path) -> None:
    """The daemon is killed and restarted between a durable put's Allocate and its Commit (a
    real kill -9 at that exact step, through the transport's call seam): the transparent retry
    runs the put again, and its PutResult counts each key once (0.1's sync sidecar counted the
    first attempt's present keys again, so ``durable == len(keys)`` could pass with fewer)."""
    disk = str(tmp_path / "disk")
    d = start_daemon("--disk-dir", disk, "--disk-capacity", "64MiB")
    old, new = [key(i) for i in range(2)], [key(10 + i) for i in range(2)]
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, old, [bytes([i]) * BLOCK for i in range(2)], durable=True).durable == 2
        transport, seen = sc._transport, []
        unary = transport._unary

        async def kill_before_the_commit(call):
            if call.method == "Commit" and not seen:
                seen.append(call)
                d.kill()        # SIGKILL: its durable blocks survive on disk, nothing else does
                d.start()
            return await unary(call)

        transport._unary = kill_before_the_commit
        r = sc.put(lid, old + new, [bytes([i]) * BLOCK for i in range(4)], durable=True)
        assert seen, "the put never reached its Commit"
        assert (r.stored, r.present, r.dropped, r.durable) == (2, 2, [], 4), r
        assert None not in sc.lookup(lid, old + new)


def test_a_sidecar_maps_one_key_table_across_daemon_kills(start_daemon) -> None:
    """Each kill -9 and restart of the daemon: the sidecar moves to the new daemon's key table
    and unmaps the dead one's (0.1 kept one more mapping per restart)."""
    d = start_daemon()
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, [key(0)], [bytes(BLOCK)])
        assert sc.lookup(lid, [key(0)]) == ["host"]
        assert len(_mapped(d.shm_dir, ".keys")) == 1
        for _ in range(2):   # 0.1 kept one more mapping per restart: two show it
            d.kill()
            d.start()
            assert sc.lookup(lid, [key(0)]) == [None]   # the restarted daemon holds nothing (not durable)
            sc.put(lid, [key(1)], [bytes(BLOCK)])
            assert sc.lookup(lid, [key(1)]) == ["host"]
            now = _mapped(d.shm_dir, ".keys")
            assert len(now) == 1 and "(deleted)" not in now[0], f"dead daemons' key tables still mapped: {now}"


# -- a ring slot belongs to its newest sequence number (in process: real store and copy engine) --

def _engine_views(kv_fd: int, ring_fd: int):
    import mmap

    import numpy as np

    kv_map, ring_map = mmap.mmap(kv_fd, 4 * BLOCK), mmap.mmap(ring_fd, 64)
    return kv_map, ring_map, np.frombuffer(kv_map, dtype=np.uint8), np.frombuffer(ring_map, dtype=np.uint64)


def _close_maps(*maps) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass  # a view is still alive (a failed assertion's traceback): the mapping goes with it


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    """Yield to the loop until ``cond()``; fails naming ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def _count(name: str):
    from kvtier.daemon.counters import Count

    return getattr(Count, name, None)


def _granted(store) -> bool:
    """Whether some session holds a grant (an offload is between its Allocate and its commit)."""
    return any(store.sessions[s].grants for s in store.sessions.ids())


def _slot_transfers(body) -> None:
    from attacks_sessions import in_process

    from kvtier.daemon.sessions import Limits

    in_process_dir = tempfile.mkdtemp(prefix="kvtier-fixes-")
    try:
        in_process(__import__("pathlib").Path(in_process_dir), body, Limits(transfer_wait_s=20))
    finally:
        shutil.rmtree(in_process_dir, ignore_errors=True)


def test_a_reused_ring_slot_supersedes_the_transfer_still_in_it_and_stale_seqs_are_refused() -> None:
    """The engine asked an offload (slot 0, seq 5) whose "KV written" it never recorded, gave up
    on it (its deadline), reused page 0 for other KV and asked a new offload in the same slot
    (seq 9). The old transfer must not copy page 0's new bytes under its own key (0.1 did: its
    wait saw the newer record and committed them); the new one commits; a late request with an
    older seq in that slot is refused FAILED_PRECONDITION and changes nothing."""
    import numpy as np
    from attacks_sessions import KV_LAYOUT, registration

    from kvtier.daemon.errors import Code, StoreError
    from kvtier.daemon.gpu import TransferOrder

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = await transfers.register(registration(sid, kv_fd, ring_fd))
            rid, fp = reg.registration_id, KV_LAYOUT.fingerprint
            kv[:BLOCK] = 1                                                    # page 0: key A's KV (never marked written)
            old = asyncio.ensure_future(transfers.offload(
                TransferOrder(sid, rid, [key(100)], np.array([0]), 0, 5, wait_written=True)))
            await _until(lambda: _granted(store), "the old offload to wait for its KV")
            kv[:BLOCK] = 2                                                    # the engine reused page 0 ...
            ring[0] = 2 * 9                                                   # ... and slot 0 for request 9
            new = await transfers.offload(TransferOrder(sid, rid, [key(101)], np.array([0]), 0, 9, wait_written=True))
            assert [s.name for s in new.status] == ["COPIED"]
            with pytest.raises(StoreError) as e:
                await asyncio.wait_for(old, 10)
            assert e.value.code is Code.CANCELLED and "superseded" in str(e.value)
            assert store.lookup(reg.layout_id, [key(100), key(101)]) == [None, Tier.HOST], \
                "the superseded offload committed the reused page's bytes under its own key"
            assert (await store.tiers.payloads([fp + key(101)]))[fp + key(101)][0] == bytes([2]) * BLOCK
            with pytest.raises(StoreError) as e:                             # a late, older request
                await transfers.offload(TransferOrder(sid, rid, [key(102)], np.array([1]), 0, 5, wait_written=True))
            assert e.value.code is Code.FAILED_PRECONDITION and "stale" in str(e.value)
            assert store.lookup(reg.layout_id, [key(102)]) == [None]
            assert int(ring[0]) == 2 * 9 + 1   # the slot shows the newest request complete
            assert store.counters.counts.get(_count("KV_TRANSFERS_SUPERSEDED")) == 1
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)


def test_an_offload_the_engine_gave_up_on_is_never_committed() -> None:
    """The engine's deadline passes while its offload waits for "KV written" (the RPC is
    cancelled); the engine then reuses the page, and its late record arrives: the daemon's
    copy may run, but the block is not committed (the engine was told the offload failed)."""
    import numpy as np
    from attacks_sessions import registration

    from kvtier.daemon.gpu import TransferOrder

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = await transfers.register(registration(sid, kv_fd, ring_fd))
            rid = reg.registration_id
            call = asyncio.ensure_future(transfers.offload(
                TransferOrder(sid, rid, [key(110)], np.array([0]), 0, 5, wait_written=True)))
            await _until(lambda: _granted(store), "the offload to wait for its KV")
            call.cancel()                                   # the engine's deadline: it was told DEADLINE_EXCEEDED
            with pytest.raises(asyncio.CancelledError):
                await call
            kv[:BLOCK] = 3
            ring[0] = 2 * 5                                 # a late "KV written" for the abandoned request
            await _until(lambda: not _granted(store), "the abandoned copy to end")
            assert store.lookup(reg.layout_id, [key(110)]) == [None], "an offload the engine gave up on was committed"
            assert not any(store.sessions[s].grants for s in store.sessions.ids())
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)


# -- key length limits reached through raw RPCs (the sidecar's own checks bypassed) --------------

def test_the_daemon_refuses_keys_outside_8_to_32_bytes_on_every_rpc(daemon) -> None:
    """The sidecar and its key table refuse a bad key client-side, so the daemon's own check was
    never reached by a test: here every keyed RPC goes raw over the channel. Each is refused
    INVALID_ARGUMENT naming the limit, nothing is stored, and the key table is kept (0.1's
    daemon, given a 40-byte key, gave up the whole table)."""
    from kvtier.proto import locations_pb2_grpc, node_pb2_grpc

    good = [key(200), key(201)]
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, good, [bytes(BLOCK)] * 2).stored == 2
        assert sc.lookup(lid, good) == ["host", "host"]     # answered from the key table
        sid = sc._transport.session.session_id
        node, loc = node_pb2_grpc.NodeStub(sc._channel), locations_pb2_grpc.LocationsStub(sc._channel)
        for length in (33, 40, 7):
            _refused_everywhere(node, loc, sid, lid, [key(202), b"k" * length], length)
        st = sc.stats()
        assert st["tiers"]["host"]["blocks"] == 2 and st["counters"].get("key_table_errors", 0) == 0
        info = sc._layouts[lid]
        assert info.table is not None and sc.lookup(lid, [*good, key(202)]) == ["host", "host", None]
        assert sc._layouts[lid].table is info.table   # still the same table, still vouched for


def _refused_everywhere(node, loc, sid: int, lid: int, bad: list[bytes], length: int) -> None:
    """Every keyed RPC, raw, with ``bad`` keys: refused INVALID_ARGUMENT naming the limit."""
    import grpc

    from kvtier.proto import locations_pb2, node_pb2

    calls = {
        "Allocate": lambda: node.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=lid, keys=bad)),
        "Acquire": lambda: node.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=lid, keys=bad)),
        "Lookup": lambda: node.Lookup(node_pb2.LookupRequest(layout_id=lid, keys=bad)),
        "Evict": lambda: node.Evict(node_pb2.EvictRequest(layout_id=lid, keys=bad)),
        "Prefetch": lambda: node.Prefetch(node_pb2.PrefetchRequest(layout_id=lid, keys=bad)),
        "ReportDeviceBlocks": lambda: loc.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
            worker_id="w", layout_id=lid, stored=bad, session_id=sid)),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        assert f"{length} bytes" in e.value.details() and "8 to 32" in e.value.details(), (name, e.value.details())


def test_the_route_server_refuses_keys_over_32_bytes() -> None:
    """The route server's upper bound on key length (its tests sent only short keys)."""
    import grpc

    from kvtier.client.routing.route_server import RouterService
    from kvtier.client.routing.router import Router, RouterConfig
    from kvtier.proto import locations_pb2 as L
    from kvtier.proto import router_pb2 as R
    from kvtier.proto import router_pb2_grpc

    sock_dir = tempfile.mkdtemp(prefix="kvtier-route-")
    sock = f"unix:{sock_dir}/route.sock"

    async def main() -> None:
        server = grpc.aio.server()
        router = Router(RouterConfig())
        router.apply("t", L.WatchLocationsReply(epoch=5, node=L.NodeInfo(node_id="A", epoch=5)))
        router.apply("t", L.WatchLocationsReply(epoch=5, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True)))
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
        server.add_insecure_port(sock)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(sock) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for n in (33, 64):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Route(R.RouteRequest(keys=[key(1), b"k" * n]), timeout=30)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert f"{n} bytes" in e.value.details() and "8 to 32" in e.value.details()
                ok = await stub.Route(R.RouteRequest(keys=[key(1)]), timeout=30)
                assert ok.n_blocks == 1
        finally:
            await server.stop(None)

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_late_completion_record_never_moves_a_slot_back() -> None:
    """The stand-in copy engine's completion record of request 5 lands after the engine already
    wrote request 9's "KV written" into the slot (the engine gave up on 5 and reused the slot
    while 5's copy ran): the slot keeps 9's record, else the daemon would wait for 9's KV until
    --transfer-wait-s and refuse it. (On the real engine, through its copy call.)"""
    import numpy as np
    from attacks_sessions import registration

    from kvtier.tiers.copy_engine import ONBOARD, plan_chunks

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = transfers.registrations[(await transfers.register(registration(sid, kv_fd, ring_fd))).registration_id]
            engine = transfers.engines["host"]
            plan = plan_chunks(reg.layout, reg.tensors, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
            ring[0] = 2 * 9
            engine.copy(reg.memory, reg.pool_path, plan, ONBOARD, 0, 5, False).wait_done()
            assert int(ring[0]) == 2 * 9, "a late completion record moved the slot back"
            engine.copy(reg.memory, reg.pool_path, plan, ONBOARD, 1, 5, False).wait_done()
            assert int(ring[1]) == 2 * 5 + 1
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)

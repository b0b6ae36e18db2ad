"""Size limits held on real components: the daemon's event ring stays within its bound in bytes
(in process: a BlockStore on a real tmpfs HostTier, the daemon's own LocationLog), and keys
outside 8 to 32 bytes are refused on every keyed RPC of a real kvtierd and by the route server.
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
    return b"sizelims" + i.to_bytes(24, "big")   # 32 bytes: the longest key


def test_the_event_ring_is_bounded_in_bytes(shm) -> None:
    """One-key events weigh about 290 bytes each in the daemon's heap, so a ring bounded only
    by its key count (1,048,576 by default) would grow the heap by hundreds of MiB. With
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


# -- key length limits reached through raw RPCs (the sidecar's own checks bypassed) --------------

def test_the_daemon_refuses_keys_outside_8_to_32_bytes_on_every_rpc(daemon) -> None:
    """The sidecar and its key table refuse a bad key client-side, so every keyed RPC goes raw
    over the channel here, to the daemon's own check. Each is refused INVALID_ARGUMENT naming
    the limit, nothing is stored, and the key table is kept (a 40-byte key does not make the
    daemon give up the whole table)."""
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
    """The route server's upper bound on key length."""
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

"""The location feed, the router's fold and the key table against the store's real state.

Each test reproduces a way the published state could drift from what the daemons hold: on
real components in process (a BlockStore on a real tmpfs HostTier and a real O_DIRECT
DiskTier with LMDB, the daemon's own LocationLog and KeyTablePublisher) driven into the
interleavings a busy daemon sees, or on a router following a real kvtierd.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import numpy as np
import pytest

from kvtier.client.engine.transport import open_channel
from kvtier.daemon.counters import Count
from kvtier.daemon.events import EventKind, LocationEvent, LocationLog
from kvtier.daemon.keytable import KeyTablePublisher
from kvtier.daemon.store import BlockStore, StoreError
from kvtier.proto import locations_pb2 as L
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.keytable import TIER_BITS
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"feedtest" + i.to_bytes(8, "big")


def fold(events: list[LocationEvent]) -> dict[tuple[Tier, bytes], set[bytes]]:
    """{(tier, fingerprint): keys} from a node's events (host and disk), as a router folds them."""
    out: dict[tuple[Tier, bytes], set[bytes]] = {}
    for ev in events:
        if ev.kind is EventKind.STORED:
            out.setdefault((ev.tier, ev.fingerprint), set()).update(ev.keys)
        elif ev.kind is EventKind.REMOVED:
            out.setdefault((ev.tier, ev.fingerprint), set()).difference_update(ev.keys)
        elif ev.kind is EventKind.CLEARED:
            for loc in out:
                if loc[0] == ev.tier:
                    out[loc] = set()
    return {loc: ks for loc, ks in out.items() if ks}


def holdings(store: BlockStore) -> dict[tuple[Tier, bytes], set[bytes]]:
    return {(tier, fp): set(keys) for tier, fp, keys in store.holdings() if keys}


def test_a_grant_committed_while_its_key_is_being_demoted_stays_published(shm, tmp_path) -> None:
    """Two sessions hold grants for one key (allowed: the first commit wins). The key is
    committed by one, then chosen as a host victim and demoted to disk. While the demotion
    is on disk, the key is in no tier (the feed and the key table must not show it in host);
    then the other session commits its grant, so it is visible in host again, and the
    victim's "removed from host" must not be published after that commit: the feed's fold
    and the key table must show the key in host, where the store holds it."""
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint

    async def main() -> None:
        disk = DiskTier(str(tmp_path / "disk"), capacity=8 * BLOCK)
        # three slots: session 1's early grant, the key itself, one more block
        store = BlockStore(HostTier(shm, 3 * layout.slot_bytes, "race"), disk=disk, demote_min_seen=1)
        loc = LocationLog(store, "node", epoch=1)
        table = KeyTablePublisher(store, shm, "race", 1, lambda: 11 * BLOCK)
        store.observers.add(table, loc)
        lid = (await store.register_layout(layout)).layout_id
        s1 = store.open_session("one", os.getpid()).session_id
        s2 = store.open_session("two", os.getpid()).session_id
        try:
            g1 = (await store.allocate(s1, lid, [key(0)]))[0].grant_id   # granted, not committed yet
            g2 = (await store.allocate(s2, lid, [key(0)]))[0].grant_id
            await store.commit(s2, [g2], [], durable=False)               # key 0 visible in host
            g3 = (await store.allocate(s2, lid, [key(1)]))[0].grant_id
            await store.commit(s2, [g3], [], durable=False)          # host full
            evicting = asyncio.ensure_future(store.allocate(s2, lid, [key(2)]))
            deadline = time.monotonic() + 10   # it runs up to the disk write (loop steps, not a count of them)
            while fp + key(0) in store.host.entries and not evicting.done() and time.monotonic() < deadline:
                await asyncio.sleep(0)
            assert not evicting.done() and fp + key(0) not in store.host.entries, "key 0 is not mid-demotion"
            # mid-demotion the key is in no tier an acquire finds it in: the feed and the table agree
            assert fold(loc.since(0)) == holdings(store)
            assert not table.writer.masks(fp, [key(0)])[0] & TIER_BITS["host"], "the key table shows a key in host"
            await store.commit(s1, [g1], [], durable=False)          # key 0 visible in host again
            await evicting
            assert fp + key(0) in store.host.entries
            assert fold(loc.since(0)) == holdings(store)
            masks = table.writer.masks(fp, [key(0), key(1)])
            assert masks[0] & TIER_BITS["host"], "the key table lost a key the host tier holds"
            want = np.array([TIER_BITS["host"] | TIER_BITS["disk"], TIER_BITS["host"]], dtype=np.uint8)
            assert masks.tolist() == want.tolist()
        finally:
            table.close()
            store.close()

    asyncio.run(main())


def test_a_saved_router_state_with_no_keys_keeps_its_positions(tmp_path) -> None:
    """A router whose daemons hold nothing yet (or whose blocks were all removed) saves its
    positions; started again it resumes from them instead of discarding the file."""
    from kvtier.client.routing.router import Router, RouterConfig

    r = Router(RouterConfig())
    r.apply("t", L.WatchLocationsReply(epoch=5, node=L.NodeInfo(node_id="A", epoch=5, head_seq=7)))
    r.apply("t", L.WatchLocationsReply(epoch=5, snapshot=L.SnapshotPart(at_seq=7, first=True, last=True)))
    path = str(tmp_path / "router.state")
    r.save_state(path)
    again = Router(RouterConfig(state_path=path))
    again.load_state(path)
    assert again.positions() == {"A": (5, 7)}
    assert again.indexed_keys() == 0


def test_a_workers_device_blocks_go_with_its_session_even_if_it_reports_again_at_once(shm) -> None:
    """An engine's sidecar session ends (the engine died) and a new engine under the same
    worker id reports its own device blocks before the daemon's periodic session check ran:
    the dead engine's blocks must not be published as the new engine's."""
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * layout.slot_bytes, "dev"))
        loc = LocationLog(store, "node", epoch=1)
        store.observers.add(loc)
        device = store.device
        lid = (await store.register_layout(layout)).layout_id
        try:
            old = store.open_session("engine", 1).session_id
            device.report("w", lid, [key(1), key(2)], [], False, old)
            store.close_session(old)                                  # the engine is gone
            new = store.open_session("engine", 2).session_id
            device.report("w", lid, [key(3)], [], False, new)         # its successor, at once
            device.drop_ended_sessions()                              # the periodic check
            assert device.held == {"w": {fp: {key(3)}}}
            gpu: set[bytes] = set()
            for ev in loc.since(0):
                if ev.kind is EventKind.STORED:
                    gpu.update(ev.keys)
                elif ev.kind is EventKind.REMOVED:
                    gpu.difference_update(ev.keys)
                elif ev.kind is EventKind.CLEARED:
                    gpu.clear()
            assert gpu == {key(3)}
            _, entries = loc.snapshot()
            snap = {k for e in entries if e.worker == "w" for k in e.keys}
            assert snap == {key(3)}
            assert store.lookup(lid, [key(1), key(3)]) == [None, Tier.GPU]
            store.close_session(new)                                  # and the successor's go with it
            assert device.held == {} and loc.snapshot()[1] == []
            assert store.lookup(lid, [key(3)]) == [None]
        finally:
            store.close()

    asyncio.run(main())


def _ghost_state(path: str, target: str) -> list[bytes]:
    """A saved router state in which ``target`` served node "ghost", holding a few keys."""
    from kvtier.client.routing.router import Router, RouterConfig

    ks = [key(100 + i) for i in range(4)]
    r = Router(RouterConfig())
    r.apply(target, L.WatchLocationsReply(epoch=5, node=L.NodeInfo(node_id="ghost", epoch=5, head_seq=1)))
    r.apply(target, L.WatchLocationsReply(epoch=5, snapshot=L.SnapshotPart(
        at_seq=1, first=True, last=True,
        entries=[L.LocationEvent(seq=1, kind=L.STORED, tier=int(Tier.HOST), fingerprint=b"f" * 16, keys=ks)])))
    assert r.holdings("ghost")
    r.save_state(path)
    return ks


@pytest.mark.parametrize("via", ["static", "dns"])
def test_a_reloaded_state_forgets_nodes_no_configured_feed_serves(start_daemon, tmp_path, via: str) -> None:
    """The router saved its index while it followed a daemon that is no longer configured
    (the static list changed, or its address left DNS while the router was down). Started
    again from that file, it must not keep routing to the old node's workers and blocks."""
    from kvtier.client.routing.router import Router, RouterConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon("--node-id", "A", "--tcp", f"127.0.0.1:{port}", "--insecure-tcp", name="A", host_capacity="16MiB")
    path = str(tmp_path / "router.state")
    ks = _ghost_state(path, "unix:/nonexistent/kvtierd.sock" if via == "static" else f"127.0.0.2:{port}")

    async def resolve(host: str, p: int) -> list[str]:
        return ["127.0.0.1"]

    if via == "static":
        cfg = RouterConfig(daemons=(f"unix:{d.socket}",), state_path=path, reconnect_min_s=0.05)
    else:
        cfg = RouterConfig(dns=(f"kvtierd.test:{port}",), state_path=path, resolve_interval_s=0.1,
                           reconnect_min_s=0.05)
    with Router(cfg, resolve=resolve).start() as r:
        assert r.wait_synced(15, nodes=1), r.status()
        deadline = time.monotonic() + 10
        while "ghost" in r.positions() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(r.positions()) == ["A"]
        assert [w for w, _ in r.workers()] == ["A"]
        assert r.route(ks, dispatch=False).ranked[0].overlap.host == 0


def test_the_route_server_refuses_bad_requests_with_clear_errors(tmp_path) -> None:
    """Malformed Route calls get INVALID_ARGUMENT (a token request as long as the key limit
    allows at most, an empty candidate name) and the server keeps serving."""
    import grpc

    from kvtier.client.routing.route_server import MAX_KEYS, RouterService
    from kvtier.client.routing.router import Router, RouterConfig
    from kvtier.proto import router_pb2 as R
    from kvtier.proto import router_pb2_grpc

    r = Router(RouterConfig())
    r.apply("t", L.WatchLocationsReply(epoch=5, node=L.NodeInfo(node_id="A", epoch=5)))
    r.apply("t", L.WatchLocationsReply(epoch=5, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True)))
    sock = f"unix:{tmp_path / 'route.sock'}"
    ns = R.NamespaceSpec(model="m")

    async def main() -> None:
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(r), server)
        server.add_insecure_port(sock)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(sock) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                bad = [
                    (R.RouteRequest(token_ids=[1] * (MAX_KEYS + 1), namespace=ns, block_tokens=1), "at most"),
                    (R.RouteRequest(keys=[key(1)], candidates=["A", ""]), "candidate 1"),
                    (R.RouteRequest(keys=[b"short"]), "8 to 32 bytes"),
                    (R.RouteRequest(token_ids=[1, 2], block_tokens=1), "namespace"),
                    (R.RouteRequest(keys=[key(1)], token_ids=[1]), "not both"),
                ]
                for req, words in bad:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Route(req, timeout=30)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.details(), words)
                    assert words in e.value.details()
                ok = await stub.Route(R.RouteRequest(token_ids=list(range(64)), namespace=ns, block_tokens=16),
                                      timeout=30)
                assert ok.n_blocks == 4 and [w.worker_id for w in ok.ranked] == ["A"]
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert [w for w, _ in r.workers()] == ["A"]  # no worker named "" was made up


def _table_view(table: KeyTablePublisher, fp: bytes, pool: list[bytes]) -> dict[tuple[Tier, bytes], set[bytes]]:
    """{(tier, fingerprint): keys} the key table shows in host and disk, among ``pool``."""
    masks = table.writer.masks(fp, pool)
    out: dict[tuple[Tier, bytes], set[bytes]] = {}
    for k, m in zip(pool, masks.tolist(), strict=True):
        for tier in (Tier.HOST, Tier.DISK):
            if m & TIER_BITS[tier.label]:
                out.setdefault((tier, fp), set()).add(k)
    return out


async def _random_op(store: BlockStore, rng, sid: int, lid: int, pool: list[bytes]) -> None:
    """A put (some durable), get, evict or prefetch of a few random keys."""
    ks = rng.sample(pool, rng.randrange(1, 4))
    r = rng.random()
    try:
        if r < 0.5:
            grants = await store.allocate(sid, lid, ks)
            await asyncio.sleep(0)
            await store.commit(sid, [g.grant_id for g in grants if g.granted], [], durable=rng.random() < 0.2)
        elif r < 0.7:
            leases = await store.acquire(sid, lid, ks)
            store.release(sid, [x.lease_id for x in leases if x.hit])
        elif r < 0.85:
            store.evict(lid, ks)
        else:
            await store.prefetch(lid, ks)
    except StoreError:
        pass  # e.g. a batch that found no slot: not what this test is about


@pytest.mark.parametrize("seed", range(6))
def test_the_feed_and_the_key_table_equal_the_store_at_every_step_of_concurrent_operations(
        shm, tmp_path, seed: int) -> None:
    """Sessions put (some durably), get (promoting from disk), evict and prefetch at once
    on a small host tier over a small disk tier, so evictions, demotions, promotions and
    disk evictions interleave at their awaits. After every step of the event loop, the
    fold of the location log and the key table both equal what the store holds."""
    import random

    block = 16 * 1024
    layout = Layout.flat(block)
    fp = layout.fingerprint
    pool = [key(i) for i in range(40)]
    rng = random.Random(seed)

    async def main() -> None:
        disk = DiskTier(str(tmp_path / "disk"), capacity=12 * block)
        store = BlockStore(HostTier(shm, 6 * layout.slot_bytes, "mix"), disk=disk, demote_min_seen=1)
        loc = LocationLog(store, "node", epoch=1)
        table = KeyTablePublisher(store, shm, "mix", 1, lambda: 18 * block)
        store.observers.add(table, loc)
        lid = (await store.register_layout(layout)).layout_id
        sids = [store.open_session(f"s{i}", os.getpid()).session_id for i in range(3)]

        def check(where: str) -> None:
            held = holdings(store)
            assert fold(loc.since(0)) == held, f"the feed's fold differs from the store ({where})"
            assert _table_view(table, fp, pool) == held, f"the key table differs from the store ({where})"

        try:
            for step in range(150):
                tasks = [asyncio.ensure_future(_random_op(store, rng, rng.choice(sids), lid, pool))
                         for _ in range(rng.randrange(1, 4))]
                for _ in range(rng.randrange(4)):
                    await asyncio.sleep(0)
                    check(f"step {step}, operations in flight")
                await asyncio.gather(*tasks)
                check(f"step {step}")
            c = store.counters
            assert c[Count.DEMOTIONS] and c[Count.PROMOTIONS], "no interleaving exercised"
        finally:
            table.close()
            store.close()

    asyncio.run(main())


def test_a_resumed_feed_ends_with_the_workers_a_fresh_subscriber_sees(start_daemon, tmp_path) -> None:
    """While a router was away, an engine reported device blocks and its sidecar then went
    away (its worker cleared). The router resumes from its saved position and replays both
    events; it must end with the node's current workers, as a fresh subscriber does, not
    keep routing to the worker that is gone."""
    from kvtier.client import Sidecar
    from kvtier.client.routing.router import Router, RouterConfig

    d = start_daemon("--node-id", "N", name="N", host_capacity="16MiB")
    path = str(tmp_path / "router.state")
    cfg = RouterConfig(daemons=(f"unix:{d.socket}",), state_path=path, reconnect_min_s=0.05)
    layout = Layout.flat(4096)
    ks = [key(200 + i) for i in range(4)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(layout)
        sc.put(lid, ks[:1], [bytes(4096)])
        with Router(cfg).start() as r:
            assert r.wait_synced(15, nodes=1)
            assert r.workers() == [("N", "N")]
            epoch, seq = r.positions()["N"]
        engine = Sidecar(d.socket)
        engine.report_device_blocks(engine.register_layout(layout), stored=ks, worker_id="N/gpu0")
        engine.close()                                   # the engine is gone: its worker is cleared
        with Router(RouterConfig(daemons=cfg.daemons)).start() as fresh:
            assert fresh.wait_synced(15, nodes=1)
            want = fresh.workers()
        assert want == [("N", "N")]
        with Router(cfg).start() as r:                   # resumes from the saved position
            assert r.wait_synced(15, nodes=1)
            assert r.status()[0].resumes == 1 and r.status()[0].snapshots == 0
            assert r.workers() == want
            assert r.route(ks, dispatch=False).worker == "N"
    # the daemon's side: after the replayed events it sends its NodeInfo again, so any
    # subscriber learns the current workers without having to infer them

    from kvtier.proto import locations_pb2_grpc

    with open_channel(f"unix:{d.socket}") as ch:
        call = locations_pb2_grpc.LocationsStub(ch).WatchLocations(
            L.WatchLocationsRequest(epoch=epoch, from_seq=seq), timeout=10)
        got = []
        for reply in call:
            got.append(reply)
            if reply.WhichOneof("body") == "node" and len(got) > 1 or len(got) == 4:
                call.cancel()
                break
    kinds = [m.WhichOneof("body") for m in got]
    assert kinds[0] == "node" and [w.worker_id for w in got[0].node.workers] == []
    assert kinds[1] == "events" and [ev.kind for ev in got[1].events.events] == [L.STORED, L.CLEARED]
    assert kinds[2] == "node" and [w.worker_id for w in got[2].node.workers] == [], kinds


def test_a_tensor_parallel_workers_device_blocks_go_with_any_ranks_session(shm) -> None:
    """A tensor-parallel worker's ranks report their shards through their own sidecars (one
    session and layout fingerprint each). When one rank's session ends, that rank's blocks
    are gone: the worker (which holds a block only when every rank does) holds nothing, even
    if the other rank's session, which reported last, is still open. A sidecar that
    reconnects under a new session while its old one is still closing keeps its blocks."""
    from kvtier.tiers.layout import TensorSpec

    rank0 = Layout((TensorSpec("kv", "uint8", (1, BLOCK), 0),), 16, tp_rank=0, tp_size=2)
    rank1 = Layout((TensorSpec("kv", "uint8", (1, BLOCK), 0),), 16, tp_rank=1, tp_size=2)

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * rank0.slot_bytes, "tp"))
        loc = LocationLog(store, "node", epoch=1)
        store.observers.add(loc)
        device = store.device
        l0 = (await store.register_layout(rank0)).layout_id
        l1 = (await store.register_layout(rank1)).layout_id
        try:
            s0 = store.open_session("rank0", 1).session_id
            s1 = store.open_session("rank1", 2).session_id
            ks = [key(1), key(2)]
            device.report("w", l0, ks, [], False, s0)
            device.report("w", l1, ks, [], False, s1)            # rank 1 reported last
            store.close_session(s0)                              # rank 0's engine is gone
            assert device.held["w"] == {rank0.fingerprint: set(), rank1.fingerprint: set(ks)}
            _, entries = loc.snapshot()
            assert {(e.fingerprint, k) for e in entries for k in e.keys} == {(rank1.fingerprint, k) for k in ks}
            # rank 1's sidecar reconnects: its new session reports before the old one closes
            s1b = store.open_session("rank1", 2).session_id
            device.report("w", l1, [key(3)], [], False, s1b)
            store.close_session(s1)
            assert device.held["w"][rank1.fingerprint] == {*ks, key(3)}
            store.close_session(s1b)                             # every rank gone: the worker too
            assert device.held == {}
        finally:
            store.close()

    asyncio.run(main())

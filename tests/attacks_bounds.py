"""Bounded inputs and bounded feed subscribers, against real kvtierd subprocesses. Each
oversized input is refused with its limit in the message and changes nothing; the daemon keeps
serving."""

from __future__ import annotations

import socket
import time
import urllib.request

import grpc
import pytest

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.tools.local_daemon import rss_bytes
from kvtier.proto import locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc
from kvtier.tiers import layout as layout_limits
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 4096


def key(prefix: str, i: int) -> bytes:
    return prefix.encode().ljust(8, b"_")[:8] + i.to_bytes(8, "big")


def spec(**over) -> node_pb2.LayoutSpec:
    """A valid flat layout as the wire carries it, with ``over`` applied to its one tensor
    (``tensors=N`` for N tensors; ``block_tokens``/``tp_size`` on the layout)."""
    msg = layout_to_proto(Layout.flat(BLOCK), node_pb2.LayoutSpec)
    if "tensors" in over:
        t = msg.tensors[0]
        del msg.tensors[:]
        for i in range(over.pop("tensors")):
            msg.tensors.add(name=f"t{i}", dtype=t.dtype, shape=list(t.shape), block_dim=0)
    for field in ("block_tokens", "tp_size"):
        if field in over:
            setattr(msg, field, over.pop(field))
    t = msg.tensors[0]
    for field, value in over.items():
        if field == "shape":
            del t.shape[:]
            t.shape.extend(value)
        else:
            setattr(t, field, value)
    return msg


def refused(fn, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def serving(sc: Sidecar) -> None:
    """The daemon still answers and nothing failed inside it."""
    lid = sc.register_layout(Layout.flat(BLOCK, name="still-serving"))
    k = key("alive", 1)
    assert sc.put(lid, [k], [b"x" * BLOCK]).stored == 1
    assert [bytes(b) for b in sc.get(lid, [k])] == [b"x" * BLOCK]
    assert "errors:INTERNAL" not in sc.stats()["counters"]


@pytest.mark.parametrize(("over", "limit"), [
    ({"tensors": layout_limits.MAX_TENSORS + 1}, str(layout_limits.MAX_TENSORS)),
    ({"shape": [1] * (layout_limits.MAX_DIMS + 1)}, str(layout_limits.MAX_DIMS)),
    ({"shape": [1, layout_limits.MAX_EXTENT + 1]}, str(layout_limits.MAX_EXTENT)),
    ({"name": "n" * 100_000}, str(layout_limits.MAX_NAME_CHARS)),
    ({"dtype": "d" * 100_000}, "unknown dtype"),
    ({"block_tokens": layout_limits.MAX_BLOCK_TOKENS + 1}, str(layout_limits.MAX_BLOCK_TOKENS)),
    ({"tp_size": layout_limits.MAX_TP_SIZE + 1}, str(layout_limits.MAX_TP_SIZE)),
    ({"shape": [1, layout_limits.MAX_BLOCK_BYTES + 1]}, str(layout_limits.MAX_BLOCK_BYTES)),
], ids=["tensors", "dims", "extent", "name", "dtype", "block_tokens", "tp_size", "block_bytes"])
def test_oversized_layout_is_refused_with_its_limit(daemon, over, limit) -> None:
    with Sidecar(daemon.socket) as sc:
        details = refused(lambda: sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=spec(**over)),
                                                          timeout=10))
        assert limit in details and len(details) < 1000, details
        assert not sc._stub.Stats(node_pb2.StatsRequest(), timeout=5).layouts  # nothing registered
        serving(sc)


def test_new_slot_sizes_beyond_the_limit_are_refused(start_daemon) -> None:
    d = start_daemon(host_capacity="64MiB")
    with Sidecar(d.socket) as sc:
        sizes = layout_limits.MAX_SLOT_SIZES
        for i in range(sizes):  # a new slot size (pool file) each
            sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=spec(shape=[1, BLOCK * (i + 1)])))
        details = refused(lambda: sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=spec(shape=[1, BLOCK * (sizes + 1)]))), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert f"limit is {sizes} slot sizes" in details
        # a layout of a slot size already in use still registers
        sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=spec(shape=[1, BLOCK], name="again")))
        assert len(sc._stub.Stats(node_pb2.StatsRequest()).layouts) == sizes + 1


def test_layouts_beyond_the_limit_are_refused(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        n = layout_limits.MAX_LAYOUTS
        for i in range(n):  # one slot size: only the layout count grows
            sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=spec(name=f"lay{i}")))
        details = refused(lambda: sc._stub.RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=spec(name="one-too-many"))), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert f"limit is {n} layouts" in details
        assert len(sc._stub.Stats(node_pb2.StatsRequest()).layouts) == n


def test_commit_and_release_id_lists_over_the_batch_limit_are_refused(start_daemon) -> None:
    d = start_daemon("--max-batch-keys", "8")
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        dlid = sc._layouts[lid].daemon_id
        sid = sc._ensure_session()
        ks = [key("grant", i) for i in range(8)]
        grants = [g.grant_id for g in sc._stub.Allocate(node_pb2.AllocateRequest(
            session_id=sid, layout_id=dlid, keys=ks)).grants]
        details = refused(lambda: sc._stub.Commit(node_pb2.CommitRequest(
            session_id=sid, grant_ids=grants[:5], abort_grant_ids=grants[5:] + grants[:1])))
        assert "limit is 8" in details
        details = refused(lambda: sc._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=grants[:2] * 2)))
        assert "twice" in details
        # nothing was committed or aborted: every grant commits now
        assert sc._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=grants)).committed == 8
        leases = [x.lease_id for x in sc._stub.Acquire(node_pb2.AcquireRequest(
            session_id=sid, layout_id=dlid, keys=ks)).leases]
        assert all(leases)
        details = refused(lambda: sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid,
                                                                           lease_ids=leases + leases[:1])))
        assert "limit is 8" in details
        sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=leases))  # all still held
        serving(sc)


def test_acquire_naming_a_key_twice_is_refused_and_pins_nothing(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        dlid = sc._layouts[lid].daemon_id
        k = key("pinme", 1)
        sc.put(lid, [k], [b"p" * BLOCK])
        sid = sc._ensure_session()
        details = refused(lambda: sc._stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=dlid,
                                                                           keys=[k] * 1000)))
        assert "more than once" in details
        # no pin was taken: evicting the key removes it at once
        assert sc.evict(lid, [k]) == 1
        assert sc.lookup(lid, [k]) == [None]
        serving(sc)


def test_report_lookups_overflow_is_refused_and_stats_and_metrics_stay_ok(start_daemon) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon("--metrics-port", str(port))
    with Sidecar(d.socket) as sc:
        # the most tokens per block a layout may have: each allowed report adds 2^40 * 2^16 tokens
        lid = sc.register_layout(Layout.flat(BLOCK, block_tokens=layout_limits.MAX_BLOCK_TOKENS))
        dlid = sc._layouts[lid].daemon_id
        u64 = (1 << 64) - 1
        details = refused(lambda: sc._stub.ReportLookups(node_pb2.ReportLookupsRequest(
            layouts=[node_pb2.LookupCounts(layout_id=dlid, hit_host=u64, miss=u64)])))
        assert "2^40" in details
        assert sc.stats()["counters"]["lookup_hit_blocks:host"] == 0  # the refused report counted nothing
        most = node_pb2.LookupCounts(layout_id=dlid, hit_host=1 << 40)
        for _ in range(300):  # 300 * 2^56 tokens: past what a uint64 holds
            sc._stub.ReportLookups(node_pb2.ReportLookupsRequest(layouts=[most]))
        counters = sc.stats()["counters"]  # answers (it failed INTERNAL once past 2^64)
        assert counters["lookup_hit_blocks:host"] == 300 << 40
        assert counters["lookup_hit_tokens:host"] == u64  # saturated, not wrapped or failing
        reply = sc._stub.Stats(node_pb2.StatsRequest())
        assert max(h.tokens for h in reply.hits) == u64
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'kvtier_hit_tokens_total{' in text
        serving(sc)


def test_report_device_blocks_with_session_0_is_refused(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        dlid = sc._layouts[lid].daemon_id
        stub = locations_pb2_grpc.LocationsStub(sc._channel)
        details = refused(lambda: stub.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
            worker_id="fake-gpu", layout_id=dlid, stored=[key("fake", i) for i in range(4)], session_id=0)))
        assert "session_id 0" in details
        info = stub.GetNodeInfo(locations_pb2.NodeInfoRequest())
        assert not info.workers and info.head_seq == 0
        assert sc.lookup(lid, [key("fake", 0)]) == [None]
        serving(sc)


def test_long_names_are_refused_with_their_limit(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        stub = node_pb2_grpc.NodeStub(sc._channel)
        hello = node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name="c" * 100_000, pid=1))
        call = stub.Session(iter([hello]))
        details = refused(lambda: next(call))
        assert "limit is 256" in details
        feed = locations_pb2_grpc.LocationsStub(sc._channel)
        details = refused(lambda: next(feed.WatchLocations(locations_pb2.WatchLocationsRequest(
            subscriber="s" * 100_000))))
        assert "limit is 256" in details
        assert sc._stub.Stats(node_pb2.StatsRequest()).sessions == 0
        serving(sc)


def test_feed_subscribers_over_the_cap_are_refused(start_daemon) -> None:
    d = start_daemon("--max-feed-subscribers", "2")
    channel = open_channel(f"unix:{d.socket}")
    stub = locations_pb2_grpc.LocationsStub(channel)
    req = locations_pb2.WatchLocationsRequest(subscriber="cap-test")
    first, second = stub.WatchLocations(req), stub.WatchLocations(req)
    assert next(first).HasField("node") and next(second).HasField("node")
    details = refused(lambda: next(stub.WatchLocations(req)), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "--max-feed-subscribers" in details and "limit is 2" in details
    first.cancel()
    deadline = time.monotonic() + 10
    while True:  # the cancelled stream's place is given back
        third = stub.WatchLocations(req)
        try:
            assert next(third).HasField("node")
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.1)
    second.cancel()
    third.cancel()
    channel.close()


def test_slow_subscriber_is_dropped_with_bounded_memory(start_daemon) -> None:
    """Subscribers that never read, while 1.5M keys of events flow through a ring of 100k: each
    is dropped RESOURCE_EXHAUSTED ("fell behind"), what reached it is bounded by gRPC's flow
    control, and once the allocator is warm the daemon's memory stays flat however many events
    flow (no copy per subscriber, no dropped event kept by the ring)."""
    # --grpc-idle-s: a dropped subscriber's status waits behind its unread window; a connection
    # whose streams all ended on the daemon's side counts as idle, and its close would beat it
    d = start_daemon("--event-log-keys", "100000", "--grpc-idle-s", "600")
    subscribers, batch = 8, 65536
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.report_device_blocks(lid, stored=[key("held", i) for i in range(batch)], worker_id="w0")  # snapshots

        def flow(rounds: int, tag: str) -> int:
            for r in range(rounds):
                ks = [key(f"{tag}{r}", i) for i in range(batch)]
                sc.report_device_blocks(lid, stored=ks, worker_id="w1")
                sc.report_device_blocks(lid, removed=ks, worker_id="w1")
            return 2 * batch * rounds

        # a fixed receive window (no BDP growth): what gRPC lets through to a reader that does
        # not read is then the same every run
        channel = open_channel(f"unix:{d.socket}", options=[("grpc.max_receive_message_length", 64 << 20),
                                                                      ("grpc.http2.bdp_probe", 0)])
        stub = locations_pb2_grpc.LocationsStub(channel)
        calls = [stub.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber=f"slow{i}"))
                 for i in range(subscribers)]
        time.sleep(1.0)   # each has taken its snapshot and filled its window
        flowed = flow(4, "warm")   # warms the allocator (and drops the subscribers)
        rss_before = rss_bytes(d.pid)
        flowed += flow(8, "flow")
        assert flowed >= 1_500_000
        deadline = time.monotonic() + 20
        while sc.stats()["counters"].get("location_subscribers_behind", 0) < subscribers:
            assert time.monotonic() < deadline, "slow subscribers were not dropped"
            time.sleep(0.1)
        rss_after = rss_bytes(d.pid)
        for call in calls:
            got = 0
            with pytest.raises(grpc.RpcError) as e:
                for reply in call:
                    got += sum(len(ev.keys) for ev in reply.events.events) + sum(
                        len(ev.keys) for ev in reply.snapshot.entries)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fell behind by" in e.value.details() and "resubscribe" in e.value.details()
            # what reached it is what gRPC's flow control let through (its window: one snapshot
            # part seen here), not the events that flowed
            assert got <= 2 * batch, got
        channel.close()
        assert rss_after - rss_before < 32 << 20, (rss_before, rss_after)
        # the daemon still serves a subscriber that reads
        feed = locations_pb2_grpc.LocationsStub(sc._channel).WatchLocations(
            locations_pb2.WatchLocationsRequest(subscriber="reader"))
        assert next(feed).HasField("node")
        feed.cancel()
        serving(sc)
    assert d.proc.poll() is None


def test_router_dropped_for_falling_behind_resubscribes_and_converges(start_daemon) -> None:
    """The router's feed (client/routing/feed.py) is dropped while it cannot fold (its lock
    held), then resubscribes, takes a snapshot and ends with the daemon's holdings."""
    d = start_daemon("--event-log-keys", "100000", "--node-id", "N")
    batch = 65536
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        held = [key("held", i) for i in range(1000)]
        sc.report_device_blocks(lid, stored=held, worker_id="w0")
        cfg = RouterConfig(daemons=(f"unix:{d.socket}",), reconnect_min_s=0.05, reconnect_max_s=0.3)
        with Router(cfg).start() as r:
            assert r.wait_synced(15, nodes=1), r.status()
            snapshots = r.status()[0].snapshots
            with r._lock:  # the router cannot fold: its feed stops reading
                for rnd in range(64):
                    ks = [key(f"r{rnd}", i) for i in range(batch)]
                    sc.report_device_blocks(lid, stored=ks, worker_id="w1")
                    sc.report_device_blocks(lid, removed=ks, worker_id="w1")
                    if sc.stats()["counters"].get("location_subscribers_behind", 0):
                        break
                else:
                    raise AssertionError("the router's feed was not dropped")
            deadline = time.monotonic() + 20
            while not (r.status()[0].snapshots > snapshots and r.wait_synced(0.2, nodes=1)):
                assert time.monotonic() < deadline, r.status()
            assert {k: v for k, v in r.holdings("N").items() if v} == {
                ("N", "gpu", "w0", sc._layouts[lid].layout.fingerprint): set(held)}


def test_concurrent_rpcs_over_the_cap_are_refused(start_daemon) -> None:
    d = start_daemon("--max-concurrent-rpcs", "2")
    channel = open_channel(f"unix:{d.socket}")
    stub = locations_pb2_grpc.LocationsStub(channel)
    streams = [stub.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber=f"s{i}")) for i in range(2)]
    for s in streams:
        assert next(s).HasField("node")
    details = refused(lambda: stub.GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=5),
                      grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "limit" in details.lower()
    for s in streams:
        s.cancel()
    deadline = time.monotonic() + 10
    while True:
        try:
            stub.GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=5)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    channel.close()

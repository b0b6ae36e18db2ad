"""The location feed and the router against real kvtierd subprocesses over real sockets."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from _wait import wait_for

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.sidecar import KvtierError, Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.routing.index import LocationIndex
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.routing.scoring import Overlap, ScorerConfig
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import locations_pb2, locations_pb2_grpc, router_pb2, router_pb2_grpc
from kvtier.tiers.layout import Layout

BLOCK_TOKENS = 16
LAYOUT = Layout.flat(4096, BLOCK_TOKENS)
NS = Namespace("test-model")


def session_keys(session: int, blocks: int) -> list[bytes]:
    tokens = np.arange(blocks * BLOCK_TOKENS, dtype=np.int64) + session * 1_000_003
    return block_keys(tokens % 50_000, BLOCK_TOKENS, NS)


def put(sc: Sidecar, lid: int, keys: list[bytes]) -> None:
    res = sc.put(lid, keys, [k * (4096 // len(k)) for k in keys])
    assert not res.dropped


@pytest.fixture
def three(start_daemon) -> dict[str, DaemonProcess]:
    return {n: start_daemon("--node-id", n, name=n, host_capacity="64MiB") for n in "ABC"}


def router_for(daemons: dict[str, DaemonProcess], **kw) -> Router:
    cfg = RouterConfig(daemons=tuple(f"unix:{d.socket}" for d in daemons.values()), reconnect_min_s=0.05,
                       reconnect_max_s=0.3, **kw)
    r = Router(cfg).start()
    assert r.wait_synced(15, nodes=len(daemons)), r.status()
    return r


def test_routes_to_the_host_holder_then_after_eviction_to_the_next(three) -> None:
    keys = session_keys(1, 32)
    sidecars = {n: Sidecar(d.socket) for n, d in three.items()}
    try:
        lids = {n: sc.register_layout(LAYOUT) for n, sc in sidecars.items()}
        put(sidecars["A"], lids["A"], keys)
        put(sidecars["B"], lids["B"], keys[:24])  # B: host here; disk once the disk tier merges
        with router_for(three) as r:
            d = wait_for(lambda: (d := r.route(keys, dispatch=False)).ranked[1].overlap.host == 24 and d,
                         what="both holders in the index")
            assert d.workers == ["A", "B", "C"]
            # remote: what each could fetch from another node's host (pulls are on by default)
            assert [x.overlap for x in d.ranked] == [Overlap(0, 32, 32), Overlap(0, 24, 24, 32), Overlap(0, 0, 0, 32)]
            assert d.nodes == ["A", "B", "C"]
            assert sidecars["A"].evict(lids["A"], keys) == 32
            d = wait_for(lambda: (d := r.route(keys, dispatch=False)).worker == "B" and d,
                         what="A's eviction in the index")
            assert d.ranked[0].overlap == Overlap(0, 24, 24)
            assert all(x.overlap == Overlap(0, 0, 0, 24) for x in d.ranked[1:])
    finally:
        for sc in sidecars.values():
            sc.close()


def test_host_holder_wins_over_disk_holder_until_it_evicts(start_daemon, tmp_path) -> None:
    """A holds the prefix in host, B only on disk: A wins (host loads faster); once A evicts
    them, B's disk copy still beats recomputing on C."""
    keys = session_keys(7, 32)
    a = start_daemon("--node-id", "A", name="A", host_capacity="1MiB")
    b = start_daemon("--node-id", "B", "--disk-dir", str(tmp_path / "b-disk"), "--disk-capacity", "8MiB",
                     name="B", host_capacity="64KiB")  # 16 slots of 4 KiB
    c = start_daemon("--node-id", "C", name="C", host_capacity="1MiB")
    daemons = {"A": a, "B": b, "C": c}
    with Sidecar(a.socket) as sa, Sidecar(b.socket) as sb:
        la, lb = sa.register_layout(LAYOUT), sb.register_layout(LAYOUT)
        put(sa, la, keys)
        for i in range(0, 32, 8):  # a batch must fit B's 16-slot host pool
            assert sb.put(lb, keys[i:i + 8], [k * (4096 // len(k)) for k in keys[i:i + 8]], durable=True).durable == 8
        put(sb, lb, session_keys(8, 16))  # push B's copies out of host: they stay on disk
        assert sb.lookup(lb, keys) == ["disk"] * 32
        # KV of this layout: 256 B per token; disk at 2 GB/s loads far faster than recompute
        scorer = ScorerConfig(bytes_per_token=4096 / BLOCK_TOKENS)
        with router_for(daemons, scorer=scorer, pulls=False) as r:  # own tiers only (C could pull from A)
            d = wait_for(lambda: (d := r.route(keys, dispatch=False)).ranked[1].overlap.disk == 32 and d,
                         what="A's host and B's disk blocks in the index")
            assert [x.worker for x in d.ranked] == ["A", "B", "C"]
            assert d.ranked[0].overlap == Overlap(0, 32, 32) and d.ranked[1].overlap == Overlap(0, 0, 32)
            assert d.ranked[0].cost < d.ranked[1].cost < d.ranked[2].cost
            assert sa.evict(la, keys) == 32
            d = wait_for(lambda: (d := r.route(keys, dispatch=False)).worker == "B" and d,
                         what="A's eviction in the index")
            assert d.ranked[0].overlap == Overlap(0, 0, 32)


def test_device_blocks_reported_by_a_sidecar_route_to_that_worker(three) -> None:
    keys = session_keys(2, 16)
    a = Sidecar(three["A"].socket)
    b = Sidecar(three["B"].socket)
    try:
        la, lb = a.register_layout(LAYOUT), b.register_layout(LAYOUT)
        put(a, la, keys)                 # A: host
        with router_for(three) as r:
            wait_for(lambda: r.route(keys, dispatch=False).worker == "A", what="A's host blocks")
            b.report_device_blocks(lb, stored=keys, worker_id="B/gpu0")  # B's engine holds them on device
            d = wait_for(lambda: (d := r.route(keys, dispatch=False)).worker == "B/gpu0" and d,
                         what="B's device blocks")
            assert d.nodes[0] == "B" and d.ranked[0].overlap == Overlap(16, 16, 16)
            assert d.ranked[1].worker == "A" and d.ranked[1].overlap == Overlap(0, 16, 16)
            b.report_device_blocks(lb, removed=keys[8:], worker_id="B/gpu0")
            wait_for(lambda: r.route(keys, dispatch=False).ranked[0].overlap == Overlap(0, 16, 16),
                     what="a partial device prefix to lose to A's full host prefix")
            b.close()  # the engine's sidecar exits: its device blocks go with it
            wait_for(lambda: ("B/gpu0", "B") not in r.workers() and ("B", "B") in r.workers(),
                     what="B's worker to be cleared")
            assert r.holdings("B") == {}
    finally:
        a.close()
        b.close()


def test_bad_device_reports_are_refused_and_change_nothing(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(LAYOUT)
        with pytest.raises(KvtierError) as e:
            sc.report_device_blocks(lid, stored=[b"short"], worker_id="w")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        stub = locations_pb2_grpc.LocationsStub(sc._channel)
        for req, code in [(locations_pb2.ReportDeviceBlocksRequest(worker_id="", layout_id=1), "INVALID_ARGUMENT"),
                          (locations_pb2.ReportDeviceBlocksRequest(worker_id="w", layout_id=99),
                           "FAILED_PRECONDITION"),
                          (locations_pb2.ReportDeviceBlocksRequest(worker_id="w", layout_id=1, session_id=12345),
                           "FAILED_PRECONDITION")]:
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportDeviceBlocks(req, timeout=5)
            assert err.value.code().name == code, err.value.details()
        info = stub.GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=5)
        assert info.head_seq == 0 and not info.workers


def _route_server(tmp_path, daemons: dict[str, DaemonProcess], *extra: str) -> tuple[subprocess.Popen, str]:
    sock = str(tmp_path / "router.sock")
    if os.path.exists(sock):  # left by a server killed with SIGKILL: wait for the new one's, not this
        os.unlink(sock)
    args = [sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"unix:{sock}"]
    for d in daemons.values():
        args += ["--daemon", f"unix:{d.socket}"]
    log = open(tmp_path / "router.log", "ab")
    proc = subprocess.Popen([*args, *extra], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, what="route-server socket")
    assert proc.poll() is None, (tmp_path / "router.log").read_text()
    return proc, f"unix:{sock}"


def _status(target: str) -> router_pb2.RouterStatusReply:
    with grpc.insecure_channel(target) as ch:
        return router_pb2_grpc.RouterStub(ch).Status(router_pb2.RouterStatusRequest(), timeout=5)


class _Writer(threading.Thread):
    """Puts and evicts blocks on every daemon until stopped; keeps the truth per node."""

    def __init__(self, daemons: dict[str, DaemonProcess]) -> None:
        super().__init__(daemon=True)
        self.daemons = daemons
        self.stop_flag = threading.Event()
        self.truth: dict[str, set[bytes]] = {n: set() for n in daemons}
        self.rounds = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(5)
        scs = {n: Sidecar(d.socket) for n, d in self.daemons.items()}
        try:
            lids = {n: sc.register_layout(LAYOUT) for n, sc in scs.items()}
            while not self.stop_flag.is_set():
                for n, sc in scs.items():
                    keys = session_keys(rng.randrange(400), rng.randrange(1, 12))
                    put(sc, lids[n], keys)
                    self.truth[n].update(keys)
                    if self.truth[n] and rng.random() < 0.5:
                        gone = rng.sample(sorted(self.truth[n]), min(len(self.truth[n]), rng.randrange(1, 8)))
                        sc.evict(lids[n], gone)
                        self.truth[n].difference_update(gone)
                self.rounds += 1
        except BaseException as e:  # surfaced by the test
            self.error = e
        finally:
            for sc in scs.values():
                sc.close()


def test_router_killed_mid_stream_resumes_and_ends_equal_to_a_fresh_subscriber(three, tmp_path) -> None:
    state = tmp_path / "router-state.npz"
    writer = _Writer(three)
    writer.start()
    proc, target = _route_server(tmp_path, three, "--state-path", str(state), "--save-interval-s", "0.1")
    try:
        wait_for(lambda: state.exists() and writer.rounds > 20, what="a saved state mid-stream")
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with np.load(state) as z:
            saved = LocationIndex()
            saved.load_state({k: z[k] for k in z.files if k != "router_meta"})
        saved_pos = {n: (v.epoch, v.seq) for n, v in saved.nodes.items()}
        assert len(saved_pos) == 3 and all(seq > 0 for _, seq in saved_pos.values()), saved_pos
        rounds_at_kill = writer.rounds
        wait_for(lambda: writer.rounds > rounds_at_kill + 10, what="more writes while the router is down")
        proc, target = _route_server(tmp_path, three, "--state-path", str(state), "--save-interval-s", "0.1")
        time.sleep(0.5)  # events keep flowing while it resumes
    finally:
        writer.stop_flag.set()
        writer.join(30)
    assert writer.error is None, writer.error
    try:
        with router_for(three) as fresh:
            want = fresh.positions()
            fresh_holdings = fresh.holdings()
            assert all(want[n][1] > saved_pos[n][1] for n in want)  # there was something to catch up on
            # the fresh subscriber holds exactly what the daemons hold
            assert {n: set().union(*[ks for (node, *_), ks in fresh_holdings.items() if node == n])
                    for n in "ABC"} == writer.truth
            wait_for(lambda: {f.node_id: (f.epoch, f.seq) for f in _status(target).feeds} == want,
                     what="the restarted router to catch up")
            st = _status(target)
            assert sum(f.resumes for f in st.feeds) == 3 and sum(f.snapshots for f in st.feeds) == 0
            # and it routes exactly as the fresh subscriber does
            with grpc.insecure_channel(target) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for s in range(0, 400, 7):
                    k = session_keys(s, 11)
                    got = stub.Route(router_pb2.RouteRequest(keys=k), timeout=5).ranked
                    exp = fresh.route(k, dispatch=False)
                    assert [(x.worker_id, x.overlap.host) for x in got] == \
                        [(x.worker, x.overlap.host) for x in exp.ranked]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "router.log").read_text()
    with np.load(state) as z:
        restarted = LocationIndex()
        restarted.load_state({k: z[k] for k in z.files if k != "router_meta"})
    assert restarted.locations() == fresh_holdings
    assert {n: (v.epoch, v.seq) for n, v in restarted.nodes.items()} == want


def test_a_daemon_restart_is_noticed_as_a_new_epoch(three) -> None:
    keys = session_keys(3, 8)
    with Sidecar(three["B"].socket) as sc:
        put(sc, sc.register_layout(LAYOUT), keys)
    epochs: list[tuple[str, int, int]] = []
    with router_for(three) as r:
        r.on_epoch_change = lambda node, old, new: epochs.append((node, old, new))
        wait_for(lambda: r.route(keys, dispatch=False).worker == "B", what="B's blocks")
        old_epoch = r.positions()["B"][0]
        three["B"].stop()
        three["B"].start()
        wait_for(lambda: r.positions()["B"][0] not in (0, old_epoch), what="B's new epoch")
        assert r.wait_synced(10)
        assert [(n, o) for n, o, _ in epochs] == [("B", old_epoch)]
        assert r.holdings("B") == {}  # a restarted daemon's host tier is empty
        assert r.route(keys, dispatch=False).ranked[0].overlap == Overlap()
        assert [f.epoch_changes for f in r.status() if f.node_id == "B"] == [1]


def test_identical_requests_route_identically_across_runs(three, tmp_path) -> None:
    scs = {n: Sidecar(d.socket) for n, d in three.items()}
    try:
        for i, (_, sc) in enumerate(scs.items()):
            put(sc, sc.register_layout(LAYOUT), session_keys(10 + i, 6 + 2 * i))
    finally:
        for sc in scs.values():
            sc.close()
    requests = [session_keys(s, 12) for s in range(8, 30)]
    runs = []
    for _ in range(2):
        with router_for(three) as r:
            wait_for(lambda r=r: r.indexed_keys() == 6 + 8 + 10, what="all holdings")
            runs.append([r.route(k, dispatch=False).workers for k in requests])
    assert runs[0] == runs[1]
    assert len({w[0] for w in runs[0]}) == 3  # new sessions spread over the workers
    proc, target = _route_server(tmp_path, three)
    try:
        with grpc.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            wait_for(lambda: _status(target).indexed_keys == 24, what="route-server index")
            served = [[x.worker_id for x in stub.Route(router_pb2.RouteRequest(keys=k), timeout=5).ranked]
                      for k in requests]
            assert served == runs[0]
            s = 12
            tokens = ((np.arange(s * BLOCK_TOKENS) + 11 * 1_000_003) % 50_000).tolist()
            by_tokens = stub.Route(router_pb2.RouteRequest(
                token_ids=tokens, namespace=router_pb2.NamespaceSpec(model="test-model"),
                block_tokens=BLOCK_TOKENS), timeout=5)
            assert by_tokens.ranked[0].node_id == "B" and by_tokens.ranked[0].overlap.host == 8
            dispatched = stub.Route(router_pb2.RouteRequest(keys=requests[0], dispatch=True), timeout=5)
            first = runs[0][0][0]
            assert dispatched.decision_id and dispatched.ranked[0].worker_id == first
            busy = stub.Route(router_pb2.RouteRequest(keys=requests[0]), timeout=5)
            mine = next(x for x in busy.ranked if x.worker_id == first)
            assert mine.active_requests == 1 and mine.queued_blocks == 12 and mine.overlap.gpu == 12
            assert stub.Finish(router_pb2.FinishRequest(decision_id=dispatched.decision_id), timeout=5).found
            assert not stub.Finish(router_pb2.FinishRequest(decision_id=dispatched.decision_id), timeout=5).found
            again = stub.Route(router_pb2.RouteRequest(keys=requests[0] + session_keys(99, 1)), timeout=5)
            assert again.ranked[0].worker_id == first and again.ranked[0].overlap.gpu == 12
            for bad in [router_pb2.RouteRequest(keys=[b"x" * 16], token_ids=[1]),
                        router_pb2.RouteRequest(token_ids=[1, 2], block_tokens=1),
                        router_pb2.RouteRequest(keys=[b"tiny"])]:
                with pytest.raises(grpc.RpcError) as e:
                    stub.Route(bad, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_a_session_sticks_to_one_worker_before_any_event_arrives(three) -> None:
    with router_for(three, speculative_ttl_s=30.0) as r:
        chosen: dict[int, list[str]] = {s: [] for s in range(9)}
        for turn in range(1, 6):
            for s in chosen:
                d = r.route(session_keys(100 + s, 4 * turn))
                chosen[s].append(d.worker)  # type: ignore[arg-type]
                if turn > 1:
                    assert d.ranked[0].overlap.gpu == 4 * (turn - 1)  # speculative: nothing was stored
                r.finish(d.decision_id)
        assert all(len(set(ws)) == 1 for ws in chosen.values()), chosen
        assert len({ws[0] for ws in chosen.values()}) > 1  # sessions spread, each one sticks
        assert r.holdings() == {}
    with router_for(three, speculative_ttl_s=0.2) as r:
        keys = session_keys(200, 4)
        t = time.monotonic()  # the router's clock, given: no sleep races the 0.2 s TTL on a busy machine
        r.finish(r.route(keys, now=t).decision_id)
        assert r.route(keys, dispatch=False, now=t + 0.19).ranked[0].overlap.gpu == 4
        assert r.route(keys, dispatch=False, now=t + 0.45).ranked[0].overlap.gpu == 0  # unconfirmed: expired


def test_dns_names_follow_the_addresses_they_resolve_to(start_daemon) -> None:
    import socket as _socket

    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = start_daemon("--node-id", "A", "--tcp", f"127.0.0.1:{port}", "--insecure-tcp", name="A", host_capacity="16MiB")
    b = start_daemon("--node-id", "B", "--tcp", f"127.0.0.2:{port}", "--insecure-tcp", name="B", host_capacity="16MiB")
    addresses = ["127.0.0.1", "127.0.0.2"]

    async def resolve(host: str, p: int) -> list[str]:
        assert (host, p) == ("kvtierd.test", port)
        return list(addresses)

    with Sidecar(b.socket) as sc:
        put(sc, sc.register_layout(LAYOUT), session_keys(5, 4))
    cfg = RouterConfig(dns=(f"kvtierd.test:{port}",), resolve_interval_s=0.1, reconnect_min_s=0.05)
    with Router(cfg, resolve=resolve).start() as r:
        assert r.wait_synced(15, nodes=2)
        assert sorted(r.positions()) == ["A", "B"]
        assert r.route(session_keys(5, 4), dispatch=False).worker == "B"
        addresses.remove("127.0.0.2")
        wait_for(lambda: sorted(r.positions()) == ["A"], what="B to leave with its address")
        assert r.route(session_keys(5, 4), dispatch=False).ranked[0].overlap == Overlap()
    del a


def _watch(target: str, epoch: int, from_seq: int, messages: int) -> list[locations_pb2.WatchLocationsReply]:
    with open_channel(target) as ch:
        call = locations_pb2_grpc.LocationsStub(ch).WatchLocations(
            locations_pb2.WatchLocationsRequest(epoch=epoch, from_seq=from_seq), timeout=10)
        out = []
        for reply in call:
            out.append(reply)
            if len(out) == messages:
                call.cancel()
                break
        return out


def test_the_feed_resumes_from_its_ring_and_sends_a_snapshot_when_too_far_behind(start_daemon) -> None:
    d = start_daemon("--node-id", "A", "--event-log-keys", "64", name="A", host_capacity="16MiB")
    target = f"unix:{d.socket}"
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(LAYOUT)
        for s in range(20):  # 20 events of 8 keys: the ring keeps the newest 64 keys (8 events)
            put(sc, lid, session_keys(300 + s, 8))
        sc.evict(lid, session_keys(300, 8))
    node, first = _watch(target, 0, 0, 2)
    epoch = node.node.epoch
    assert node.node.head_seq == 21 and first.snapshot.first and first.snapshot.at_seq == 21
    assert sum(len(e.keys) for e in first.snapshot.entries) == 19 * 8
    _, resumed = _watch(target, epoch, 17, 2)  # still in the ring: the events after 17
    assert [e.seq for e in resumed.events.events] == [18, 19, 20, 21]
    assert resumed.events.events[-1].kind == locations_pb2.REMOVED
    _, behind = _watch(target, epoch, 3, 2)  # fell out of the ring: a snapshot instead
    assert behind.WhichOneof("body") == "snapshot" and behind.snapshot.at_seq == 21
    _, other = _watch(target, epoch + 1, 20, 2)  # another epoch: a snapshot
    assert other.WhichOneof("body") == "snapshot"
    _, current = _watch(target, epoch, 21, 2)  # up to date: nothing to send until a heartbeat
    assert current.WhichOneof("body") == "events" and not current.events.events
    assert current.events.head_seq == 21


def test_capacity_evictions_reach_the_index(start_daemon) -> None:
    d = start_daemon("--node-id", "A", name="A", host_capacity="1MiB")  # 256 slots of 4 KiB
    keys = [k for s in range(50) for k in session_keys(500 + s, 8)]  # 400 blocks
    with Sidecar(d.socket) as sc, router_for({"A": d}) as r:
        lid = sc.register_layout(LAYOUT)
        for i in range(0, len(keys), 40):
            sc.put(lid, keys[i:i + 40], [bytes(4096)] * 40)
        held = {k for k, t in zip(keys, sc.lookup(lid, keys), strict=True) if t == "host"}
        assert 0 < len(held) < len(keys)

        def indexed() -> set[bytes]:
            return set().union(*r.holdings("A").values()) if r.holdings("A") else set()

        wait_for(lambda: indexed() == held, what="the index to match the daemon after evictions")


def test_the_async_sidecar_reports_device_blocks_too(daemon) -> None:
    import asyncio

    from kvtier.client.engine.sidecar import AsyncSidecar

    keys = session_keys(600, 4)

    async def report() -> int:
        async with AsyncSidecar(daemon.socket) as sc:
            lid = await sc.register_layout(LAYOUT)
            seq = await sc.report_device_blocks(lid, stored=keys, worker_id="w-async")
            info = await locations_pb2_grpc.LocationsStub(sc._channel).GetNodeInfo(locations_pb2.NodeInfoRequest())
            assert [w.worker_id for w in info.workers] == ["w-async"]
            assert info.workers[0].fingerprints == [LAYOUT.fingerprint]
            return seq

    assert asyncio.run(report()) == 1
    # the sidecar is gone: its session ended, so its device blocks were cleared
    wait_for(lambda: not _watch(f"unix:{daemon.socket}", 0, 0, 2)[1].snapshot.entries,
             what="the worker's device blocks to be cleared")


def _cluster_feeds(rng: random.Random, chains: list[list[bytes]]) -> dict[str, list]:
    """Three nodes of two workers each holding random leading parts of the chains in gpu,
    host, disk and the shared store, with holes removed from host."""
    fp = bytes(range(16))
    feeds: dict[str, list] = {}
    seqs: dict[str, int] = {}
    for n in range(3):
        node = f"n{n}"
        info = locations_pb2.NodeInfo(node_id=node, epoch=1)
        for w in range(2):
            info.workers.add(worker_id=f"{node}-w{w}", fingerprints=[fp])
        info.tiers.add(tier=1 + 1, capacity_bytes=1 << 40, load_gbps=rng.choice([0.0, 20.0, 300.0]))  # host
        info.tiers.add(tier=2 + 1, capacity_bytes=1 << 43, load_gbps=rng.choice([0.0, 2.0]))  # disk
        feeds[node] = [locations_pb2.WatchLocationsReply(epoch=1, node=info),
                       locations_pb2.WatchLocationsReply(epoch=1, snapshot=locations_pb2.SnapshotPart(
                           at_seq=0, first=True, last=True))]
        seqs[node] = 0
    for chain in chains:
        for _ in range(rng.randint(1, 3)):
            node = f"n{rng.randrange(3)}"
            length = rng.randint(1, len(chain))
            cuts = sorted(rng.randint(0, length) for _ in range(3))
            batch = locations_pb2.EventBatch()
            for tier, lo, hi, who in ((1, 0, cuts[0], f"{node}-w{rng.randrange(2)}"), (2, cuts[0], cuts[1], ""),
                                      (3, cuts[1], cuts[2], ""), (4, cuts[2], length, "")):
                if hi > lo:
                    seqs[node] += 1
                    batch.events.add(seq=seqs[node], kind=locations_pb2.STORED, tier=tier, worker_id=who,
                                     fingerprint=fp, keys=chain[lo:hi])
            if cuts[1] > cuts[0] and rng.random() < 0.3:
                seqs[node] += 1
                mid = rng.randint(cuts[0], cuts[1] - 1)
                batch.events.add(seq=seqs[node], kind=locations_pb2.REMOVED, tier=2, fingerprint=fp,
                                 keys=chain[mid:mid + 1])
            if batch.events:
                batch.head_seq = seqs[node]
                feeds[node].append(locations_pb2.WatchLocationsReply(epoch=1, events=batch))
    return feeds


def test_a_router_restored_from_its_state_file_routes_exactly_as_before(tmp_path, caplog) -> None:
    """A --state-path file, as this router saves it and as routers saved it before the key
    table's arrays were saved, gives a router that ranks every request as the saved one did;
    a state of a format this router does not read is logged and the router starts empty."""
    from _state_formats import earlier_format_state

    from kvtier.proto import node_pb2
    assert (node_pb2.TIER_GPU, node_pb2.TIER_HOST, node_pb2.TIER_DISK, node_pb2.TIER_REMOTE) == (1, 2, 3, 4)
    rng = random.Random(5)
    chains = [[rng.randbytes(16) for _ in range(rng.randint(4, 40))] for _ in range(80)]
    before = Router(RouterConfig())
    for node, msgs in _cluster_feeds(rng, chains).items():
        for m in msgs:
            before.apply(node, m)
    requests = [c[:rng.randint(1, len(c))] + [rng.randbytes(16) for _ in range(rng.randint(0, 3))] for c in chains]
    want = [(d.ranked, d.fetch) for d in (before.route(k, dispatch=False) for k in requests)]
    assert any(r[0].overlap.host for r, _ in want)
    saved, earlier, newer = (str(tmp_path / f"{n}.npz") for n in ("saved", "earlier", "newer"))
    before.save_state(saved)
    router_meta = before.state_arrays()["router_meta"]
    np.savez(earlier, **earlier_format_state(before.index), router_meta=router_meta)
    arrays = before.state_arrays()
    meta = json.loads(bytes(arrays["meta"]))
    np.savez(newer, **{**arrays, "meta": np.frombuffer(json.dumps({**meta, "format": 99}).encode(), dtype=np.uint8)})
    for path in (saved, earlier):
        after = Router(RouterConfig())
        after.load_state(path)  # what start() does with --state-path (its feeds then drop nodes no daemon serves)
        assert after.positions() == before.positions()
        assert [(d.ranked, d.fetch) for d in (after.route(k, dispatch=False) for k in requests)] == want
    caplog.set_level(logging.WARNING)
    after = Router(RouterConfig(state_path=newer)).start()
    try:
        assert len(after.index) == 0 and after.positions() == {}
        assert any("saved router state unreadable" in r.getMessage() for r in caplog.records)
    finally:
        after.close()

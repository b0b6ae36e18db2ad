"""Cluster sharing on the router side: the remote tier in decisions, fetch hints
from Router and `kvtier route-server`, membership (silent daemons leave, columns are
reclaimed, load reports expire). Real daemons over real sockets."""

from __future__ import annotations

import os
import signal
import socket

import grpc
import numpy as np
import pytest
from _wait import wait_for
from pki import make_ca, make_cert
from test_router import LAYOUT, _route_server, put, router_for, session_keys

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.routing.fetch import FetchHint
from kvtier.client.routing.index import LocationIndex
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.routing.scoring import Overlap
from kvtier.proto import router_pb2, router_pb2_grpc

# default scorer (131072 B/token, 20k tokens/s, async loads: w = 1/(1+r)): w_host = 0.950,
# w_remote = 0.792 (10 GB/s). For 32 blocks: the holder costs 1.6 + 0.15 x queued; a free worker
# that pulls costs 6.6, one that recomputes 32. At 60 queued blocks (cost 10.6) a pull wins,
# recomputing does not.
HOLDER_QUEUED = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict:
    """Three daemons that are each other's peers (mTLS on, distinct ports and node ids); A holds
    a 32-block prefix in host."""
    from kvtier.client.tools.local_daemon import DaemonProcess

    root = tmp_path_factory.mktemp("cluster")
    pki = tmp_path_factory.mktemp("pki")
    make_ca(pki, "ca")
    ports = {n: _free_port() for n in "ABC"}
    for n in "ABC":
        make_cert(pki, f"node-{n}", "ca", f"node-{n}", "IP:127.0.0.1")
    same_tenant = ",".join(f"cn:node-{n}=default" for n in "ABC")

    def args(n: str) -> list[str]:
        peers = ",".join(f"127.0.0.1:{ports[p]}" for p in "ABC" if p != n)
        return ["--node-id", n, "--tcp", f"127.0.0.1:{ports[n]}", "--tls-cert", str(pki / f"node-{n}.pem"),
                "--tls-key", str(pki / f"node-{n}.key"), "--tls-ca", str(pki / "ca.pem"), "--peer-serve",
                "--peers", peers, "--tenants", same_tenant, "--peer-resolve-s", "0.5", "--peer-timeout-s", "5"]

    daemons = {n: DaemonProcess(str(root), *args(n), name=n, host_capacity="16MiB").start() for n in "ABC"}
    keys = session_keys(40, 32)
    with Sidecar(daemons["A"].socket) as sc:
        put(sc, sc.register_layout(LAYOUT), keys)
        yield {"daemons": daemons, "keys": keys, "root": root}
    for d in daemons.values():
        d.cleanup()


def test_a_loaded_holder_sends_the_request_to_a_free_worker_with_a_fetch_hint(cluster) -> None:
    daemons, keys = cluster["daemons"], cluster["keys"]
    with router_for(daemons) as r:
        d = wait_for(lambda: (d := r.route(keys, dispatch=False)).ranked[0].overlap.host == 32 and d,
                     what="A's blocks in the index")
        assert d.worker == "A" and d.fetch == []  # the holder is free: no pull
        r.set_load("A", HOLDER_QUEUED, 0)
        d = r.route(keys, dispatch=False)
        assert d.worker in ("B", "C"), d
        assert d.ranked[0].overlap == Overlap(0, 0, 0, 32)
        assert d.fetch == [FetchHint(d.worker, "A", tuple(keys), 0, 32)]
        # the remote blocks count at the remote weight: 32 x (1 - w_remote) = 32 r/(1+r) to recompute
        r_remote = 131072 * 20000 / 10e9
        assert d.ranked[0].cost == pytest.approx(32 * r_remote / (1 + r_remote), rel=1e-6)
    with router_for(daemons, pulls=False) as r:
        wait_for(lambda: r.route(keys, dispatch=False).ranked[0].overlap.host == 32, what="A's blocks")
        r.set_load("A", HOLDER_QUEUED, 0)
        d = r.route(keys, dispatch=False)
        assert d.worker == "A" and d.fetch == []
        assert d.ranked[1].overlap == Overlap(0, 0, 0, 0)  # pulls off: nothing counted remote


def test_route_server_returns_the_fetch_hint(cluster, tmp_path) -> None:
    daemons, keys = cluster["daemons"], cluster["keys"]
    proc, target = _route_server(tmp_path, daemons)
    try:
        with grpc.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def route(ks, **kw) -> router_pb2.RouteReply:
                return stub.Route(router_pb2.RouteRequest(keys=ks, **kw), timeout=5)

            def synced() -> bool:
                try:
                    return route(keys).ranked[0].overlap.host == 32
                except grpc.RpcError as e:  # no feed heard from yet: FAILED_PRECONDITION, wait
                    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                    return False

            wait_for(synced, what="A's blocks in the route-server")
            # load A through the router's own accounting: 64 fresh blocks dispatched to it
            fresh = session_keys(41, 64)
            assert route(fresh, candidates=["A"], dispatch=True).ranked[0].worker_id == "A"
            reply = route(keys)
            best = reply.ranked[0]
            assert best.worker_id in ("B", "C") and best.overlap.remote == 32 and best.overlap.disk == 0
            assert [(h.worker_id, h.from_node, list(h.keys), h.start, h.end) for h in reply.fetch] == \
                [(best.worker_id, "A", keys, 0, 32)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_a_fetch_hint_applied_through_the_sidecar_lands_in_the_workers_host_tier(cluster) -> None:
    daemons, keys = cluster["daemons"], cluster["keys"]
    with router_for(daemons) as r:
        wait_for(lambda: r.route(keys, dispatch=False).ranked[0].overlap.host == 32, what="A's blocks")
        r.set_load("A", HOLDER_QUEUED, 0)
        d = r.route(keys, dispatch=False)
        with Sidecar(daemons[d.worker].socket) as sc:
            lid = sc.register_layout(LAYOUT)
            assert d.worker in ("B", "C") and d.fetch and all(h.from_node == "A" for h in d.fetch)
            assert sc.lookup(lid, keys) == [None] * 32
            for hint in d.fetch:
                hint.apply(sc, lid)
            # the prefix is now served from the free worker's own host tier, byte-exact
            assert sc.lookup(lid, keys) == ["host"] * 32
            got = sc.get(lid, keys, verify=True)
            assert [bytes(g) for g in got] == [k * (4096 // len(k)) for k in keys]
            assert sc.stats()["counters"]["peer_blocks_fetched"] >= 32
            assert sc.evict(lid, keys) == 32  # A alone holds the prefix again, for the tests below


def test_a_silent_daemon_leaves_the_index_and_comes_back_from_a_snapshot(cluster) -> None:
    """SIGSTOP: no heartbeats (every 5 s), so after --node-timeout-s the node is dropped and its
    columns given back; SIGCONT: the feed reconnects and the node returns from a snapshot."""
    daemons, keys = cluster["daemons"], cluster["keys"]
    a = daemons["A"]
    with router_for(daemons, node_timeout_s=6.5) as r:
        wait_for(lambda: r.route(keys, dispatch=False).worker == "A", what="A's blocks")
        cols_before = r.index.columns
        os.kill(a.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: "A" not in dict(r.workers()), timeout=20, what="A to time out")
            assert not [loc for loc in r.index._columns if loc[0] == "A"]  # its columns were given back
            assert r.index._free_cols
            d = r.route(keys, dispatch=False)
            assert d.workers == ["B", "C"] or d.workers == ["C", "B"]
            assert all(x.overlap == Overlap() for x in d.ranked)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # (A's blocks back, not only A chosen: with no overlap anywhere a tie may pick A first)
        d = wait_for(lambda: (d := r.route(keys, dispatch=False)).worker == "A" and d.ranked[0].overlap.host == 32
                     and d, timeout=20, what="A back from a snapshot")
        assert d.ranked[0].overlap.host == 32
        assert r.index.columns == cols_before  # its new columns are the reclaimed ones
        st = [f for f in r.status() if f.node_id == "A"][0]
        assert st.epoch_changes == 0 and st.snapshots >= 2  # the same run, re-read from a snapshot


def test_reclaimed_columns_never_show_a_departed_nodes_blocks() -> None:
    idx = LocationIndex()
    ks = [bytes([i]) * 16 for i in range(1, 9)]
    fp = b"f" * 16
    for cycle in range(20):  # nodes come and go (pods with new names): the columns stay bounded
        node = f"pod-{cycle}"
        idx.set_node_info(node, {f"{node}-w": [fp]})
        idx.stored(node, "gpu", f"{node}-w", fp, ks)
        idx.stored(node, "host", "", fp, ks)
        idx.stored(node, "remote", "", fp, ks[:4])
        idx.speculate(f"{node}-w", ks)
        if cycle:
            idx.drop_node(f"pod-{cycle - 1}")
        lead = idx.holdings(idx.rows(ks))
        assert [w.name for w in idx.plan().workers] == [f"{node}-w"]
        assert lead[:, 0].tolist() == [8, 8, 8, 8]
        fresh = f"new-{cycle}"
        idx.set_node_info(fresh, {f"{fresh}-w": [fp]})  # a newcomer holds nothing of its own
        lead = idx.holdings(idx.rows(ks))
        col = idx.worker(f"{fresh}-w").index
        assert lead[:3, col].tolist() == [0, 0, 0] and lead[3, col] == 8  # (it could fetch from the pod)
        idx.drop_node(fresh)
    assert idx.columns < 24, idx.columns


def test_engine_load_reports_expire() -> None:
    r = Router(RouterConfig(load_report_ttl_s=30.0))
    r.index.set_node_info("n", {"w1": [b"f" * 16], "w2": [b"f" * 16]})
    r.set_load("w1", 500.0, 3.0, now=100.0)
    assert r.route([b"k" * 16], dispatch=False, now=101.0).worker == "w2"
    assert r.load("w1").queued_blocks == 500.0
    r.route([b"k" * 16], dispatch=False, now=131.0)  # 31 s later: no new report, no load
    assert r.load("w1").queued_blocks == 0.0
    assert np.all(r._loads.queued == 0)
    r.set_load("w1", 7.0, 1.0, now=140.0)  # a report renews it
    r.route([b"k" * 16], dispatch=False, now=160.0)
    assert r.load("w1").queued_blocks == 7.0

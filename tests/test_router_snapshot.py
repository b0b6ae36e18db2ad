"""Router replicas that start from an index snapshot in a real Redis Cluster (TLS, ACL user),
against real kvtierd subprocesses and ``kvtier route-server`` processes; the snapshot store's
chunks, digest and encoding against the same cluster."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest
from _wait import wait_for
from redis_cluster import cluster_fixture, free_ports
from test_router import LAYOUT, _route_server, _status, _Writer, put, router_for, session_keys

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.routing.router import Router
from kvtier.client.routing.snapshot import SnapshotError, Snapshots, SnapshotStore, decode, encode
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import router_pb2, router_pb2_grpc

NAME = "fleet-a"


@pytest.fixture(scope="module")
def redis_cluster():
    yield from cluster_fixture()


@pytest.fixture
def three(start_daemon) -> dict[str, DaemonProcess]:
    return {n: start_daemon("--node-id", n, name=n, host_capacity="64MiB") for n in "ABC"}


def snapshot_args(cluster) -> list[str]:
    nodes = cluster.nodes
    return ["--index-snapshot", f"rediss://{nodes}", "--snapshot-tls-ca", cluster.file("redis-ca.pem"),
            "--snapshot-tls-cert", cluster.file("kvtier-client.pem"), "--snapshot-tls-key",
            cluster.file("kvtier-client.key"), "--snapshot-user", cluster.USER, "--snapshot-password-file",
            cluster.file("store-password"), "--snapshot-name", NAME]


def route_server(tmp_path, daemons: dict[str, DaemonProcess], *extra: str) -> tuple[subprocess.Popen, str]:
    """A route-server process following ``daemons`` that retries a dropped feed quickly."""
    return _route_server(tmp_path, daemons, "--reconnect-min-s", "0.05", "--reconnect-max-s", "0.3", *extra)


def manifest(cluster) -> dict | None:
    c = cluster.client()
    try:
        raw = c.get(f"kvtier:router:{{{NAME}}}:latest")
    finally:
        c.close()
    return json.loads(raw) if raw else None


def clear_snapshot(cluster) -> None:
    c = cluster.client()
    try:
        # the manifest and counter (kvtier:router:{NAME}:...), the chunks (kvtier:router:{NAME:GEN:I})
        for key in c.scan_iter(match=f"kvtier:router:{{{NAME}*", target_nodes=c.ALL_NODES):
            c.delete(key)
    finally:
        c.close()


def ranking(reply_or_decision) -> list[tuple]:
    if isinstance(reply_or_decision, router_pb2.RouteReply):
        return [(x.worker_id, x.node_id, x.overlap.gpu, x.overlap.host, x.overlap.disk, x.overlap.remote,
                 round(x.cost, 6)) for x in reply_or_decision.ranked]
    d = reply_or_decision
    return [(x.worker, n, x.overlap.gpu, x.overlap.host, x.overlap.disk, x.overlap.remote, round(x.cost, 6))
            for x, n in zip(d.ranked, d.nodes, strict=True)]


@pytest.mark.parametrize("layout", ["matrix", "pairs"])
def test_a_router_started_from_a_snapshot_routes_as_one_that_read_every_feed(three, redis_cluster, tmp_path,
                                                                            layout: str) -> None:
    """Of either index layout; the reference is a router of the bit matrix that read every feed."""
    clear_snapshot(redis_cluster)
    writer = _Writer(three)
    writer.start()
    snap = [*snapshot_args(redis_cluster), "--index-layout", layout]
    proc, target = route_server(tmp_path, three, *snap, "--snapshot-interval-s", "0.1")
    try:
        wait_for(lambda: (m := manifest(redis_cluster)) and m["nodes"] == 3 and writer.rounds > 20,
                 what="a snapshot of three nodes mid-stream")
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)  # no last snapshot on the way out
        proc.wait()
        saved = manifest(redis_cluster)
        saved_pos = {n: tuple(p) for n, p in saved["positions"].items()}
        assert len(saved_pos) == 3 and all(seq > 0 for _, seq in saved_pos.values()), saved_pos
        rounds_at_kill = writer.rounds
        wait_for(lambda: writer.rounds > rounds_at_kill + 10, what="more writes while no router runs")
        proc, target = route_server(tmp_path, three, *snap, "--snapshot-interval-s", "60")
        time.sleep(0.5)  # events keep flowing while it resumes
    finally:
        writer.stop_flag.set()
        writer.join(30)
    assert writer.error is None, writer.error
    try:
        with router_for(three) as fresh:
            want = fresh.positions()
            assert all(want[n][1] > saved_pos[n][1] for n in want)  # there was something to catch up on
            wait_for(lambda: {f.node_id: (f.epoch, f.seq) for f in _status(target).feeds} == want,
                     what="the router started from the snapshot to catch up")
            st = _status(target)
            # every feed resumed from the snapshot's position: no daemon sent a snapshot
            assert sum(f.resumes for f in st.feeds) == 3 and sum(f.snapshots for f in st.feeds) == 0, st
            with grpc.insecure_channel(target) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for s in range(0, 400, 3):
                    k = session_keys(s, 11)
                    got = stub.Route(router_pb2.RouteRequest(keys=k), timeout=5)
                    assert ranking(got) == ranking(fresh.route(k, dispatch=False)), s
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "router.log").read_text()
    assert "index snapshot 'fleet-a' loaded" in (tmp_path / "router.log").read_text()
    assert manifest(redis_cluster)["gen"] > saved["gen"]  # and it saved on stop


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not served")


def test_a_restarted_router_answers_from_its_snapshot_while_catching_up(three, redis_cluster, tmp_path) -> None:
    """A feed whose daemon is down: the router still routes to that node's blocks from the
    snapshot, and says it has not caught up (Status, metrics) until the daemon answers."""
    clear_snapshot(redis_cluster)
    keys = session_keys(7, 12)
    with Sidecar(three["C"].socket) as sc:
        put(sc, sc.register_layout(LAYOUT), keys)
    snap = snapshot_args(redis_cluster)
    proc, target = route_server(tmp_path, three, *snap)
    try:
        wait_for(lambda: _status(target).indexed_keys == 12, what="C's blocks")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "router.log").read_text()
    assert manifest(redis_cluster)["keys"] == 12  # saved on stop
    three["C"].stop()
    port = free_ports(1)[0]
    proc, target = route_server(tmp_path, three, *snap, "--metrics-port", str(port))
    try:
        with grpc.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            got = stub.Route(router_pb2.RouteRequest(keys=keys), timeout=5)
            assert got.ranked[0].node_id == "C" and got.ranked[0].overlap.host == 12
        wait_for(lambda: {f.node_id for f in _status(target).feeds if f.connected} == {"A", "B"},
                 what="A's and B's feeds")
        c = [f for f in _status(target).feeds if f.target.endswith(str(three["C"].socket))]
        assert len(c) == 1 and not c[0].connected and c[0].last_error
        wait_for(lambda: metric(port, "kvtier_router_index_snapshot_restored") == 1, what="metrics")
        assert metric(port, "kvtier_router_catching_up") == 1 and _status(target).catching_up
        assert metric(port, "kvtier_router_index_bytes") > 0  # (the loaded index's arrays)
        three["C"].start()
        wait_for(lambda: metric(port, "kvtier_router_catching_up") == 0, what="every feed caught up")
        st = _status(target)
        assert not st.catching_up and all(f.connected and f.seq >= f.head_seq for f in st.feeds)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "router.log").read_text()


def store(cluster, name: str, **kw) -> SnapshotStore:
    return SnapshotStore([("127.0.0.1", p) for p in cluster.ports], name, tls_ca=cluster.file("redis-ca.pem"),
                         tls_cert=cluster.file("kvtier-client.pem"), tls_key=cluster.file("kvtier-client.key"),
                         user=cluster.USER, password=cluster.password, **kw)


def test_a_snapshots_chunks_spread_over_the_masters_and_load_whole(redis_cluster) -> None:
    data = os.urandom(3 << 20)
    st = store(redis_cluster, "spread", chunk_bytes=64 << 10, io_threads=3)
    try:
        first = st.save(data)
        gen = st.save(data[::-1])  # replaces the first; its chunks are deleted
        m = st.manifest()
        assert m["gen"] == gen and m["chunks"] == 48 and m["bytes"] == len(data) and "xxh3_128" in m
        masters = {redis_cluster.port_of(st.chunk_key(gen, i)) for i in range(m["chunks"])}
        assert masters == set(redis_cluster.ports)  # every master holds some of them
        got, m2 = store(redis_cluster, "spread", io_threads=3).load()
        assert bytes(got) == data[::-1] and m2 == m
        c = redis_cluster.client()
        try:
            assert not any(c.exists(st.chunk_key(first, i)) for i in range(48))
        finally:
            c.close()
    finally:
        st.close()


def test_a_chunk_gone_or_altered_is_read_again_and_fails_only_when_it_stays_so(redis_cluster) -> None:
    st = store(redis_cluster, "damaged", chunk_bytes=32 << 10, io_threads=2)
    c = redis_cluster.client()
    try:
        old = st.save(os.urandom(100_000))
        stale = st.manifest()
        data = os.urandom(200_000)
        new = st.save(data)
        latest = st.manifest()
        assert new > old and latest["gen"] == new
        # a reader holding the manifest a save replaced meanwhile finds its chunks gone ...
        assert st._read(stale) == "a chunk is gone (replaced by a newer save)"
        c.set(st.latest_key, json.dumps(stale))  # ... and one that keeps finding it so gives up
        with pytest.raises(SnapshotError, match="a chunk is gone"):
            st.load()
        c.set(st.latest_key, json.dumps(latest))
        got, _ = st.load()  # the latest manifest: read whole
        assert bytes(got) == data
        key = st.chunk_key(new, 3)
        c.set(key, bytes(32 << 10))  # same length, other bytes
        assert st._read(st.manifest()) == "its digest does not match its manifest"
        c.set(key, b"short")  # another length
        assert st._read(st.manifest()) == "a chunk is gone (replaced by a newer save)"
        with pytest.raises(SnapshotError, match="could not be read whole"):
            st.load()
        router = Router()
        assert Snapshots(st, router, 30).restore() is None  # the router starts from the daemons then
        assert st.save(data) > new
        got, _ = st.load()
        assert bytes(got) == data
    finally:
        c.close()
        st.close()


def test_snapshot_bytes_are_numpy_savez_and_load_as_aligned_views() -> None:
    arrays = {"meta": np.frombuffer(b'{"columns": []}', dtype=np.uint8), "key_lengths": np.full(5, 16, np.uint8),
              "key_bytes": np.arange(80, dtype=np.uint8), "bits": np.arange(35, dtype=np.uint64).reshape(5, 7),
              "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)), "empty": np.zeros((0, 3), np.uint64)}
    data = bytearray(encode(arrays))
    with np.load(io.BytesIO(bytes(data))) as z:  # what numpy.load reads
        assert set(z.files) == set(arrays) and all(np.array_equal(z[k], v) for k, v in arrays.items())
    got = decode(data)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), k
        assert not got[k].flags.owndata and got[k].flags.aligned and got[k].flags.writeable, k  # views
        if got[k].size:
            assert np.shares_memory(got[k], np.frombuffer(data, dtype=np.uint8)), k
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # numpy's own writer: read too (copies where unaligned)
    assert all(np.array_equal(decode(buf.getvalue())[k], v) for k, v in arrays.items())
    with pytest.raises(ValueError):
        decode(b"not a zip")

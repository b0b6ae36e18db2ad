"""Blocks fetched from peer daemons over mutual TLS.

Real daemons on loopback, each with its own node id, TCP port and certificate (one test CA):
``A`` holds blocks and serves peers; ``C`` fetches from it, by ``prefetch(from_node=...)`` and
by a get's read-through; ``B``'s certificate is mapped to another tenant on ``A``, so it gets
nothing of the default tenant's. A fourth daemon, slowed down (``--peer-serve-delay-s``), is
killed with SIGKILL mid-stream: ``C`` keeps the blocks that arrived whole, misses the rest,
and serves no partial block; started again, it is a new epoch that ``C`` fetches from anew.
"""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest
from pki import make_ca, make_cert, tls_channel

from kvtier.client import Sidecar
from kvtier.proto import peer_pb2, peer_pb2_grpc
from kvtier.tiers.layout import Layout

BLOCK = 256 * 1024
LAYOUT = Layout.flat(BLOCK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key(i: int) -> bytes:
    return b"peer" + i.to_bytes(4, "big") * 3


def payload(i: int) -> bytes:
    return (key(i) * (BLOCK // 16 + 1))[:BLOCK]


def counters(sc: Sidecar) -> dict:
    return sc.stats()["counters"]


def wait_until(pred, timeout: float = 15.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    for name in ("node-a", "node-b", "node-c", "node-d"):
        make_cert(d, name, "ca", name, "IP:127.0.0.1,DNS:localhost")
    return d


def _tls(pki, name: str) -> list[str]:
    return ["--tls-cert", str(pki / f"{name}.pem"), "--tls-key", str(pki / f"{name}.key"),
            "--tls-ca", str(pki / "ca.pem")]


@pytest.fixture(scope="module")
def cluster(pki, tmp_path_factory):
    """A (serves), B (another tenant on A; serves C's certificate as the default tenant), C
    (fetches; read-through); D's port reserved."""
    from kvtier.client.tools.local_daemon import DaemonProcess

    work = str(tmp_path_factory.mktemp("peers"))
    ports = {n: free_port() for n in "abcd"}
    common = ["--peer-resolve-s", "0.5", "--peer-backoff-max-s", "1", "--peer-timeout-s", "3"]
    a = DaemonProcess(work, "--node-id", "peer-a", "--tcp", f"127.0.0.1:{ports['a']}", *_tls(pki, "node-a"),
                      "--peer-serve", "--tenants", "cn:node-b=bob,cn:node-c=default", *common, name="a")
    b = DaemonProcess(work, "--node-id", "peer-b", "--tcp", f"127.0.0.1:{ports['b']}", *_tls(pki, "node-b"),
                      "--peer-serve", "--tenants", f"{os.geteuid()}=bob,cn:node-c=default", "--peers", f"localhost:{ports['a']}",
                      "--peer-read-through", *common, name="b")
    c = DaemonProcess(work, "--node-id", "peer-c", "--tcp", f"127.0.0.1:{ports['c']}", *_tls(pki, "node-c"),
                      "--peer-serve", "--peers", f"127.0.0.1:{ports['a']},127.0.0.1:{ports['d']}",
                      "--peer-read-through", "--peer-chunk-bytes", "64KiB", *common, name="c")
    procs = [a, b, c]
    try:
        for p in procs:
            p.start()
        yield {"a": a, "b": b, "c": c, "ports": ports, "work": work}
    finally:
        for p in procs:
            p.cleanup()


def test_a_block_put_on_a_is_fetched_byte_exact_by_c(cluster) -> None:
    with Sidecar(cluster["a"].socket, client_name="writer") as sa, Sidecar(cluster["c"].socket) as sc:
        lid = sa.register_layout(LAYOUT)
        sa.put(lid, [key(i) for i in range(6)], [payload(i) for i in range(6)])
        assert sc.register_layout(LAYOUT) == lid  # ids come from the fingerprint: the same on every node
        assert sc.lookup(lid, [key(0), key(1)]) == [None, None]
        # a prefetch naming the peer: from A into C's host tier
        assert sc.prefetch(lid, [key(0), key(1), key(99)], from_node="peer-a") == 2
        assert sc.lookup(lid, [key(0), key(1), key(99)]) == ["host", "host", None]
        got = sc.get(lid, [key(0), key(1)], verify=True)
        assert [bytes(g) for g in got] == [payload(0), payload(1)]
        # a get's miss in every local tier reads through: C asks its live peers, A has them
        got = sc.get(lid, [key(2), key(3), key(98)])
        assert [bytes(g) for g in got[:2]] == [payload(2), payload(3)] and got[2] is None
        assert sc.lookup(lid, [key(2), key(3)]) == ["host", "host"]
        n = counters(sc)
        assert n["peer_blocks_fetched"] == 4 and n["peer_bytes_fetched"] == 4 * BLOCK
        assert n["acquire_hit_blocks:remote"] == 2
        assert n["peer_blocks_missed"] >= 1 and n["checksum_failures"] == 0
        assert counters(sa)["peer_blocks_served"] == 4
        # a node id no peer has: misses, counted, no error
        assert sc.prefetch(lid, [key(4)], from_node="no-such-node") == 0
        assert counters(sc)["peer_unknown_node"] == 1


def test_another_tenant_cannot_fetch_the_blocks(cluster, pki) -> None:
    with Sidecar(cluster["a"].socket, client_name="writer") as sa, Sidecar(cluster["b"].socket) as sb:
        lid = sa.register_layout(LAYOUT)
        sa.put(lid, [key(10), key(11)], [payload(10), payload(11)])
        assert sb.register_layout(LAYOUT) == lid
        assert sb.tenant == "bob"
        # B (found through DNS: localhost) is tenant bob on A; A holds those keys for tenant default
        assert sb.prefetch(lid, [key(10), key(11)], from_node="peer-a") == 0
        assert sb.get(lid, [key(10), key(11)]) == [None, None]
        n = counters(sb)
        assert n["peer_blocks_fetched"] == 0 and n["peer_blocks_missed"] >= 2
    # asking A for the default tenant with B's certificate is refused outright
    with tls_channel(pki, cluster["ports"]["a"], "node-b") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        req = peer_pb2.FetchBlocksRequest(fingerprint=LAYOUT.fingerprint, block_bytes=BLOCK, keys=[key(10)],
                                          tenant="default")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchBlocks(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            stub.Holds(peer_pb2.HoldsRequest(fingerprint=LAYOUT.fingerprint, keys=[key(10)], tenant="default"),
                       timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # as itself (bob) it is served, and A has nothing of bob's under those keys
        req.tenant = "bob"
        replies = list(stub.FetchBlocks(req, timeout=10))
        assert replies[0].hello.tenant == "bob" and replies[0].hello.node_id == "peer-a"
        assert [r.WhichOneof("msg") for r in replies[1:]] == ["missing"]
    # and with node-c's certificate (tenant default there) the same keys are served
    with tls_channel(pki, cluster["ports"]["a"], "node-c") as ch:
        req.tenant = "default"
        replies = list(peer_pb2_grpc.PeerStub(ch).FetchBlocks(req, timeout=10))
        assert b"".join(r.chunk.data for r in replies[1:]) == payload(10)


def test_a_peer_killed_mid_stream_leaves_misses_and_no_partial_block(cluster, pki) -> None:
    from kvtier.client.tools.local_daemon import DaemonProcess

    port = cluster["ports"]["d"]
    d = DaemonProcess(cluster["work"], "--node-id", "peer-d", "--tcp", f"127.0.0.1:{port}", *_tls(pki, "node-d"),
                      "--peer-serve", "--peer-serve-delay-s", "0.05", "--tenants", "cn:node-c=default",
                      name="d").start()
    n = 24  # 4 chunks of 64 KiB a block, 50 ms after each: about 5 s for all of them
    keys = [key(100 + i) for i in range(n)]
    try:
        with Sidecar(d.socket) as sd:
            lid = sd.register_layout(LAYOUT)
            sd.put(lid, keys, [payload(100 + i) for i in range(n)])
        with Sidecar(cluster["c"].socket) as sc:
            sc.register_layout(LAYOUT)
            before = counters(sc)
            import threading
            result: list[int] = []
            t = threading.Thread(target=lambda: result.append(sc.prefetch(lid, keys, from_node="peer-d")))
            t.start()
            with Sidecar(cluster["c"].socket) as watch:  # kill once a few blocks arrived whole
                wait_until(lambda: counters(watch)["peer_blocks_fetched"] - before["peer_blocks_fetched"] >= 3)
            d.kill()
            t.join(30)
            assert not t.is_alive() and result and 3 <= result[0] < n
            got = sc.get(lid, keys, verify=True)
            hits = [i for i, g in enumerate(got) if g is not None]
            assert len(hits) == result[0]  # what the prefetch brought; the rest missed (D is down)
            for i in hits:
                assert bytes(got[i]) == payload(100 + i)
            after = counters(sc)
            assert after["peer_stream_errors"] + after["peer_timeouts"] > before["peer_stream_errors"] + \
                before["peer_timeouts"]
            assert after["peer_marked_down"] > before["peer_marked_down"]
            assert after["peer_blocks_missed"] - before["peer_blocks_missed"] >= n - result[0]
            assert after["checksum_failures"] == 0
            # D comes back on the same address: a new epoch, a new peer (tried again after its backoff)
            d.cleanup()  # the killed D's pool files (its shm directory) go with it
            d = DaemonProcess(cluster["work"], "--node-id", "peer-d", "--tcp", f"127.0.0.1:{port}",
                              *_tls(pki, "node-d"), "--peer-serve", "--tenants", "cn:node-c=default",
                              name="d").start()
            with Sidecar(d.socket) as sd:
                sd.register_layout(LAYOUT)
                sd.put(lid, [key(200)], [payload(200)])
            assert sc.prefetch(lid, [key(200)], from_node="peer-d") == 1
            assert bytes(sc.get(lid, [key(200)])[0]) == payload(200)
            assert counters(sc)["peer_new_epochs"] == after["peer_new_epochs"] + 1
    finally:
        d.cleanup()


def test_an_engine_prefetches_from_a_peer_then_onboards_byte_exact(cluster, tmp_path) -> None:
    """The engine side of a fetch hint: a KVConnector on C prefetches blocks an engine on A
    offloaded (``from_node``), then onboards them into its own pages: the bytes A's engine had."""
    import tempfile

    import torch

    from kvtier.client.engine.connector import KVConnector, SharedKVArena

    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="float16")
    shm = tempfile.mkdtemp(prefix="kvtier-peer-kv-", dir="/dev/shm")
    arenas = [SharedKVArena(layout, shm) for _ in range(2)]
    conns: list[KVConnector] = []
    try:
        gen = torch.Generator().manual_seed(7)
        for t in arenas[0].tensors:
            t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
        keys = [b"engine-peer-%04d" % i for i in range(4)]
        on_a = KVConnector(cluster["a"].socket, ring_dir=shm, ring_slots=4)
        conns.append(on_a)
        on_a.register(layout, arenas[0].tensors)
        assert on_a.offload(keys, [0, 1, 2, 3]).wait(30) == ["copied"] * 4
        on_c = KVConnector(cluster["c"].socket, ring_dir=shm, ring_slots=4)
        conns.append(on_c)
        on_c.register(layout, arenas[1].tensors)
        assert on_c.prefetch(keys + [b"engine-peer-none"], from_node="peer-a") == 4
        assert on_c.onboard(keys, [4, 5, 6, 7]).wait(30) == ["copied"] * 4
        for src, dst in zip(arenas[0].tensors, arenas[1].tensors, strict=True):
            assert torch.equal(src[:, 0:4], dst[:, 4:8])  # [2 (K, V), block, ...]: blocks 0-3 -> 4-7
    finally:
        for c in conns:
            c.close()
        for a in arenas:
            a.close()
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
        os.rmdir(shm)


def test_a_default_peer_cannot_name_another_tenants_stored_fingerprint(cluster, pki) -> None:
    """B holds bob's blocks (its local clients are bob); node-c's certificate is the default
    tenant on B. The default tenant's stored fingerprint is the layout's own, and bob's is
    computable (tenant_fingerprint is not secret), so a default peer naming bob's stored
    fingerprint was served bob's blocks. Only a layout the caller's tenant registered on B is
    served: held nowhere and missing, as for keys B does not hold."""
    from kvtier.daemon.layouts import tenant_fingerprint

    with Sidecar(cluster["b"].socket) as sb:
        assert sb.tenant == "bob"
        lid = sb.register_layout(LAYOUT)
        sb.put(lid, [key(40), key(41)], [payload(40), payload(41)])
    bobs = tenant_fingerprint("bob", LAYOUT.fingerprint)
    with tls_channel(pki, cluster["ports"]["b"], "node-c") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        held = stub.Holds(peer_pb2.HoldsRequest(fingerprint=bobs, keys=[key(40), key(41)], tenant="default"),
                          timeout=10)
        assert list(held.tiers) == [0, 0]
        req = peer_pb2.FetchBlocksRequest(fingerprint=bobs, block_bytes=BLOCK, keys=[key(40), key(41)],
                                          tenant="default")
        replies = list(stub.FetchBlocks(req, timeout=10))
        assert replies[0].hello.tenant == "default"
        assert [r.WhichOneof("msg") for r in replies[1:]] == ["missing"]
        assert list(replies[1].missing.index) == [0, 1]


# -- a hostile or broken peer's stream: the fetching side's checks ---------------------------------
# The wire below stands in for the network peer (what a FetchBlocks stream delivers); the
# fetching daemon's Peers is the real one.

class _HostileWire:
    def __init__(self, mode: str) -> None:
        self.mode, self.sent = mode, 0

    async def node_info(self, peer):
        return ("n1", 1)

    async def holds(self, *args):
        return []

    async def fetch(self, peer, tenant, fingerprint, block_bytes, keys):
        import asyncio

        import xxhash

        from kvtier.daemon.peers import Block, Hello, Missing
        if self.mode == "no-hello":  # another tenant's block, sent with no hello to say whose
            p = b"x" * block_bytes
            yield Block(0, p, xxhash.xxh3_64_intdigest(p))
            return
        yield Hello("n1", 1, tenant)
        while True:  # never ends: one small reply well within the per-reply timeout each time
            await asyncio.sleep(0.005)
            self.sent += 1
            yield Missing([0]) if self.mode == "missing" else Hello("n1", 1, tenant)

    async def drop(self, peer):
        pass

    async def close(self):
        pass


@pytest.mark.parametrize("mode", ["no-hello", "missing", "hello"])
def test_a_peer_stream_out_of_order_or_without_end_is_refused(mode) -> None:
    """A block before the peer's hello is not taken (the hello says whose blocks follow); a
    stream that never ends (lists of missing keys, or hellos, each in time) is cut off, not
    left holding the fetch (and the host pins it took) for good."""
    import asyncio

    from kvtier.daemon.counters import Count, Counters
    from kvtier.daemon.peers import Peers, PeerState

    async def body() -> None:
        wire, counters = _HostileWire(mode), Counters()
        peers = Peers(["10.0.0.1:1"], wire, counters, timeout_s=0.5)
        st = PeerState("10.0.0.1:1", "", "10.0.0.1:1")
        st.node_id, st.epoch = "n1", 1
        peers.peers[st.address] = st
        keys = [LAYOUT.fingerprint + key(i) for i in range(2)]
        got = await asyncio.wait_for(peers.fetch("default", LAYOUT, keys, from_node="n1"), 5)
        assert got == [] or not any(got), got
        assert counters[Count.PEER_BLOCKS_MISSED] == 2
        assert wire.sent <= 3
    asyncio.run(body())

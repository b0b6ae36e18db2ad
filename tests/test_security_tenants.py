"""Issue 12, item 2: tenants that cannot see each other (the data side).

Each test is one attack by tenant B on tenant A's blocks, against a real kvtierd serving over
its real unix socket: B looks up, gets, evicts, prefetches A's keys, follows the feed, reads
its key table, routes on its feed, reads its pool file, reports device blocks under A's
worker id. Each must find nothing of A's and change nothing of A's.

The daemon runs in this process (a thread with its own event loop) so that the test can give
it an authenticator: :class:`MetadataTenantAuthenticator`, a TEST FIXTURE ONLY, takes the
tenant from the caller's ``x-test-tenant`` metadata. Real deployments authenticate the
tenant from peer credentials or client certificates (kvtier.daemon.auth); this fixture only
stands in for that so two tenants can be tested on one socket.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

import kvtier.daemon.services.locations as locations_service
import kvtier.daemon.services.node as node_service
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.daemon.auth import LOCAL, Authenticator, Principal
from kvtier.daemon.config import load_config
from kvtier.daemon.server import Daemon
from kvtier.proto import locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc
from kvtier.tiers.host import PoolMapping
from kvtier.tiers.keytable import KeyTableReader
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 8192
LAYOUT = Layout.flat(BLOCK)
OTHER_LAYOUT = Layout.flat(BLOCK, name="only-a")   # a layout only tenant A registers
HOST, DISK, GPU = node_pb2.TIER_HOST, node_pb2.TIER_DISK, node_pb2.TIER_GPU


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


A_KEYS = [key(i) for i in range(1, 5)]
A_BYTES = b"A-SECRET" * (BLOCK // 8)


class MetadataTenantAuthenticator(Authenticator):
    """TEST FIXTURE ONLY: trusts the caller's ``x-test-tenant`` metadata (see the module docstring)."""

    def principal(self, context) -> Principal:
        for k, v in context.invocation_metadata() or ():
            if k == "x-test-tenant":
                return Principal(tenant=v, caller=f"test:{v}")
        return LOCAL


class InProcessDaemon:
    """A real kvtierd (kvtier.daemon.server.Daemon) on its own event loop in a thread."""

    def __init__(self, workdir: str, shm_dir: str, *args: str) -> None:
        self.cfg = load_config(["--socket", os.path.join(workdir, "kvtierd.sock"), "--shm-dir", shm_dir,
                                "--host-capacity", "16MiB", "--log-format", "text", *args], env={})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.daemon = Daemon(self.cfg)
        asyncio.run_coroutine_threadsafe(self.daemon.start(), self.loop).result(60)
        self.target = f"unix:{self.cfg.socket}"

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.daemon.stop(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class Tenant:
    """One tenant's client: raw stubs on the daemon's socket, every call tagged with the tenant."""

    def __init__(self, target: str, name: str) -> None:
        self.name = name
        self.md = (("x-test-tenant", name),)
        self.channel = grpc.insecure_channel(target)
        self.node = node_pb2_grpc.NodeStub(self.channel)
        self.locations = locations_pb2_grpc.LocationsStub(self.channel)
        self._out: queue.Queue = queue.Queue()
        self._stream = self.node.Session(iter(self._out.get, None), metadata=self.md)
        self._out.put(node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=name, pid=os.getpid())))
        self.session_id = next(self._stream).opened.session_id
        self.pools: dict[str, PoolMapping] = {}

    def close(self) -> None:
        self._out.put(None)
        self._stream.cancel()
        for p in self.pools.values():
            p.close()
        self.channel.close()

    def register(self, layout: Layout = LAYOUT) -> node_pb2.RegisterLayoutReply:
        return self.node.RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=layout_to_proto(layout, node_pb2.LayoutSpec)), metadata=self.md)

    def pool(self, reply: node_pb2.RegisterLayoutReply) -> PoolMapping:
        if reply.pool_path not in self.pools:
            self.pools[reply.pool_path] = PoolMapping(reply.pool_path, reply.pool_bytes)
        return self.pools[reply.pool_path]

    def put(self, reg: node_pb2.RegisterLayoutReply, keys: list[bytes], payload: bytes, durable: bool = False) -> None:
        grants = self.node.Allocate(node_pb2.AllocateRequest(session_id=self.session_id, layout_id=reg.layout_id,
                                                             keys=keys), metadata=self.md).grants
        pool = self.pool(reg)
        for g in grants:
            assert g.grant_id, "no slot granted"
            pool.mm[g.offset:g.offset + len(payload)] = payload
        self.node.Commit(node_pb2.CommitRequest(session_id=self.session_id, grant_ids=[g.grant_id for g in grants],
                                                durable=durable), metadata=self.md)

    def get(self, reg: node_pb2.RegisterLayoutReply, keys: list[bytes]) -> list[bytes | None]:
        leases = self.node.Acquire(node_pb2.AcquireRequest(session_id=self.session_id, layout_id=reg.layout_id,
                                                           keys=keys), metadata=self.md).leases
        pool = self.pool(reg)
        out = [bytes(pool.mm[le.offset:le.offset + BLOCK]) if le.lease_id else None for le in leases]
        self.node.Release(node_pb2.ReleaseRequest(session_id=self.session_id,
                                                  lease_ids=[le.lease_id for le in leases if le.lease_id]),
                          metadata=self.md)
        return out

    def lookup(self, layout_id: int, keys: list[bytes]) -> list[int]:
        return list(self.node.Lookup(node_pb2.LookupRequest(layout_id=layout_id, keys=keys), metadata=self.md).tiers)

    def feed(self, n: int) -> list[locations_pb2.WatchLocationsReply]:
        """The first ``n`` replies of a new subscription."""
        stream = self.locations.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber=self.name),
                                               metadata=self.md, timeout=10)
        out = []
        try:
            for reply in stream:
                out.append(reply)
                if len(out) >= n:
                    break
        finally:
            stream.cancel()
        return out


def feed_keys(replies: list[locations_pb2.WatchLocationsReply]) -> set[bytes]:
    keys: set[bytes] = set()
    for r in replies:
        if r.HasField("snapshot"):
            for e in r.snapshot.entries:
                keys.update(e.keys)
        if r.HasField("events"):
            for e in r.events.events:
                keys.update(e.keys)
    return keys


@pytest.fixture
def shm() -> Iterator[str]:
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tenant_auth(monkeypatch) -> None:
    """Every servicer the daemon builds authenticates with the test fixture's authenticator."""
    monkeypatch.setattr(node_service, "Authenticator", MetadataTenantAuthenticator)
    monkeypatch.setattr(locations_service, "Authenticator", MetadataTenantAuthenticator)


@pytest.fixture
def node(tenant_auth, tmp_path, shm) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon(str(tmp_path), shm, "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB")
    yield d
    d.stop()


@pytest.fixture
def tenants(node) -> Iterator[tuple[Tenant, Tenant]]:
    """(A, B); A has put ``A_KEYS`` under ``LAYOUT`` and registered ``OTHER_LAYOUT``."""
    a, b = Tenant(node.target, "alice"), Tenant(node.target, "bob")
    reg = a.register()
    a.register(OTHER_LAYOUT)
    a.put(reg, A_KEYS, A_BYTES)
    assert a.lookup(reg.layout_id, A_KEYS) == [HOST] * len(A_KEYS)
    yield a, b
    a.close()
    b.close()


def test_tenant_b_lookup_does_not_find_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg = b.register()   # the same layout: B must still find nothing of A's
    assert b.lookup(reg.layout_id, A_KEYS) == [node_pb2.TIER_NONE] * len(A_KEYS)


def test_tenant_b_cannot_use_a_layout_id_tenant_a_registered(tenants) -> None:
    a, b = tenants
    a_only = a.register(OTHER_LAYOUT).layout_id
    with pytest.raises(grpc.RpcError) as seen:
        b.lookup(a_only, A_KEYS)
    with pytest.raises(grpc.RpcError) as unknown:
        b.lookup(a_only ^ 0x5A5A5A, A_KEYS)   # an id nobody registered
    # the same answer as for an id that does not exist: B does not learn A registered it
    assert seen.value.code() == unknown.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert seen.value.details().replace(str(a_only), "ID") == unknown.value.details().replace(
        str(a_only ^ 0x5A5A5A), "ID")
    with pytest.raises(grpc.RpcError) as alloc:
        b.node.Allocate(node_pb2.AllocateRequest(session_id=b.session_id, layout_id=a_only, keys=[key(99)]),
                        metadata=b.md)
    assert alloc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_tenant_b_get_misses_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    assert b.get(reg_b, A_KEYS) == [None] * len(A_KEYS)
    assert a.get(a.register(), A_KEYS[:1]) == [A_BYTES]


def test_tenant_b_put_of_the_same_key_does_not_reach_tenant_a(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    b.put(reg_b, A_KEYS[:1], b"B-BYTES!" * (BLOCK // 8))   # not PRESENT: B has no such block
    assert a.get(a.register(), A_KEYS[:1]) == [A_BYTES]
    assert b.get(reg_b, A_KEYS[:1]) == [b"B-BYTES!" * (BLOCK // 8)]


def test_tenant_b_evict_leaves_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    evicted = b.node.Evict(node_pb2.EvictRequest(layout_id=reg_b.layout_id, keys=A_KEYS), metadata=b.md).evicted
    assert evicted == 0
    assert a.lookup(a.register().layout_id, A_KEYS) == [HOST] * len(A_KEYS)


def test_tenant_b_prefetch_does_not_promote_tenant_a_keys(tenant_auth, tmp_path, shm) -> None:
    """A's blocks are on disk only (the daemon restarted: this also shows a tenant's blocks
    are found again under its layout after a restart). B's Prefetch of them promotes
    nothing; A's does."""
    args = ("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB")
    d = InProcessDaemon(str(tmp_path), shm, *args)
    try:
        a = Tenant(d.target, "alice")
        a.put(a.register(), A_KEYS, A_BYTES, durable=True)
        a.close()
    finally:
        d.stop()
    d = InProcessDaemon(str(tmp_path), shm, *args)
    try:
        a, b = Tenant(d.target, "alice"), Tenant(d.target, "bob")
        reg_a, reg_b = a.register(), b.register()
        assert a.lookup(reg_a.layout_id, A_KEYS) == [DISK] * len(A_KEYS)
        assert b.lookup(reg_b.layout_id, A_KEYS) == [node_pb2.TIER_NONE] * len(A_KEYS)
        promoted = b.node.Prefetch(node_pb2.PrefetchRequest(layout_id=reg_b.layout_id, keys=A_KEYS),
                                   metadata=b.md).promoted
        assert promoted == 0
        assert a.lookup(reg_a.layout_id, A_KEYS) == [DISK] * len(A_KEYS)
        assert b.get(reg_b, A_KEYS) == [None] * len(A_KEYS)
        assert a.node.Prefetch(node_pb2.PrefetchRequest(layout_id=reg_a.layout_id, keys=A_KEYS),
                               metadata=a.md).promoted == len(A_KEYS)
        assert a.get(reg_a, A_KEYS[:1]) == [A_BYTES]
        a.close()
        b.close()
    finally:
        d.stop()


def test_tenant_b_feed_shows_no_tenant_a_keys_workers_or_layouts(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
        session_id=a.session_id, worker_id="engine-a", layout_id=reg_a.layout_id, stored=[key(50)]), metadata=a.md)
    b.put(reg_b, [key(60)], b"B" * BLOCK)
    replies = b.feed(3)   # NodeInfo, the snapshot (one part), and A's put is not an event of B's
    info = replies[0].node
    assert [w.worker_id for w in info.workers] == []
    assert {lay.fingerprint for lay in info.layouts} == {reg_b.fingerprint}
    seen = feed_keys(replies)
    assert seen == {key(60)}
    # live: A's next put reaches A's feed and not B's
    stream = b.locations.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber="b"), metadata=b.md,
                                        timeout=10)
    try:
        first = [next(stream), next(stream)]   # NodeInfo, snapshot
        a.put(reg_a, [key(70)], A_BYTES)
        b.put(reg_b, [key(71)], b"B" * BLOCK)  # B's own event marks where A's would have been
        live: list[locations_pb2.WatchLocationsReply] = []
        while key(71) not in feed_keys(live):
            live.append(next(stream))
    finally:
        stream.cancel()
    assert key(70) not in feed_keys(first + live) and not set(A_KEYS) & feed_keys(first + live)
    info_b = b.locations.GetNodeInfo(locations_pb2.NodeInfoRequest(), metadata=b.md)
    assert [w.worker_id for w in info_b.workers] == []
    # A's own feed has all of it
    mine = a.feed(3)
    assert set(A_KEYS) | {key(50), key(70)} <= feed_keys(mine)
    assert [w.worker_id for w in mine[0].node.workers] == ["engine-a"]


def test_tenant_b_device_report_under_tenant_a_worker_id_touches_nothing_of_a(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
        session_id=a.session_id, worker_id="engine-a", layout_id=reg_a.layout_id, stored=[key(50)]), metadata=a.md)
    assert a.lookup(reg_a.layout_id, [key(50)]) == [GPU]
    assert b.lookup(reg_b.layout_id, [key(50)]) == [node_pb2.TIER_NONE]
    b.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
        session_id=b.session_id, worker_id="engine-a", layout_id=reg_b.layout_id, clear=True, removed=[key(50)]), metadata=b.md)
    assert a.lookup(reg_a.layout_id, [key(50)]) == [GPU]
    assert [w.worker_id for w in a.feed(1)[0].node.workers] == ["engine-a"]


def test_tenant_b_key_table_shows_no_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    assert reg_b.key_table_path and reg_a.key_table_path and reg_b.key_table_path != reg_a.key_table_path
    table_b = KeyTableReader(reg_b.key_table_path)
    table_a = KeyTableReader(reg_a.key_table_path)
    try:
        assert table_b.tiers(LAYOUT.fingerprint, A_KEYS) == [None] * len(A_KEYS)
        assert table_a.tiers(LAYOUT.fingerprint, A_KEYS) == ["host"] * len(A_KEYS)
        b.put(reg_b, [key(60)], b"B" * BLOCK)
        assert table_b.tiers(LAYOUT.fingerprint, [key(60)]) == ["host"]
        assert table_a.tiers(LAYOUT.fingerprint, [key(60)]) == [None]
        assert table_b.tiers(OTHER_LAYOUT.fingerprint, A_KEYS) == [None] * len(A_KEYS)
    finally:
        table_a.close()
        table_b.close()


def test_tenant_b_router_fed_by_its_feed_never_routes_on_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
        session_id=a.session_id, worker_id="engine-a", layout_id=reg_a.layout_id, stored=A_KEYS), metadata=a.md)
    b.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
        session_id=b.session_id, worker_id="engine-b", layout_id=reg_b.layout_id, stored=[key(80)]), metadata=b.md)
    router = Router(RouterConfig())
    for reply in b.feed(2):
        router.apply("daemon", reply)
    held = router.holdings()
    assert all(not set(A_KEYS) & keys for keys in held.values())
    assert {w for w, _ in router.workers()} == {"engine-b"}
    decision = router.route(A_KEYS, dispatch=False)
    assert decision.workers == ["engine-b"]
    assert decision.ranked[0].saved_blocks == 0


def test_tenant_pool_files_are_separate_and_b_never_maps_a_bytes(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    assert reg_a.pool_path != reg_b.pool_path
    b.put(reg_b, [key(60)], b"B" * BLOCK)
    with open(reg_b.pool_path, "rb") as f:
        assert b"A-SECRET" not in f.read()
    with open(reg_a.pool_path, "rb") as f:
        assert b"A-SECRET" in f.read()


def test_tenant_b_stats_list_only_its_layouts(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    stats_b = b.node.Stats(node_pb2.StatsRequest(), metadata=b.md)
    assert [lay.fingerprint for lay in stats_b.layouts] == [reg_b.fingerprint]
    assert [lay.host_blocks for lay in stats_b.layouts] == [0]   # A's blocks of the same layout are not B's
    stats_a = a.node.Stats(node_pb2.StatsRequest(), metadata=a.md)
    assert {lay.fingerprint for lay in stats_a.layouts} == {LAYOUT.fingerprint, OTHER_LAYOUT.fingerprint}

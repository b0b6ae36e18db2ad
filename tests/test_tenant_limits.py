"""No tenant can take a whole per-daemon limit: each has its share (docs/SECURITY.md).

Each test is one tenant (alice, this process, root) taking all it can of one per-daemon limit
of a real kvtierd subprocess with two tenants (``--tenants ROOT=alice,65534=bob``), then
checking that it is refused RESOURCE_EXHAUSTED naming its per-tenant limit while the other
tenant (bob, a child process running as ``nobody``: :class:`Bob`) is still served. Before
the shares, alice took the whole limit and bob was refused.

Also here: a grant or lease id another session holds is answered exactly as an id nobody
holds (the reply does not tell which ids are live elsewhere).

Run as a script (``python test_tenant_limits.py SOCKET UID``), this file is bob's child.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from collections.abc import Iterator

import attacks_tenants
import grpc
import pytest
from attacks_tenants import NOBODY, NobodyTenant, RemoteRpcError, Tenant, serve_as

from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.daemon.device import MAX_WORKERS
from kvtier.proto import locations_pb2, node_pb2
from kvtier.tiers.layout import MAX_LAYOUTS, MAX_SLOT_SIZES, Layout

BLOCK = 8192
LAYOUT = Layout.flat(BLOCK)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class BobsTenant(Tenant):
    """What bob's child can do beyond :class:`attacks_tenants.Tenant`."""

    def open_session(self) -> int:
        """Open one more Session stream (kept open until the child ends); its id."""
        call, q = open_stream(self, "bob-more")
        self.__dict__.setdefault("more", []).append((call, q))
        return next(call).opened.session_id

    def first_feed_reply_has_node(self) -> bool:
        return self.feed(1)[0].HasField("node")


class Bob(NobodyTenant):
    """Tenant bob: a :class:`BobsTenant` in a child process running as ``nobody``."""

    def __init__(self, socket_path: str, uid: int = NOBODY) -> None:  # not super(): another child script
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), socket_path, str(uid)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.session_id = self._call("get_session_id")
        assert self.whoami() == (uid, "bob"), "tenant B's child is not nobody/bob"


def refused(fn, *args, **kw) -> str:
    """``fn`` must be refused RESOURCE_EXHAUSTED; its details."""
    with pytest.raises((grpc.RpcError, RemoteRpcError)) as e:
        fn(*args, **kw)
    assert e.value.code() == EXHAUSTED, (e.value.code(), e.value.details())
    return e.value.details()


class TwoTenants:
    """A real kvtierd where this process's uid is tenant alice and 65534 tenant bob (no
    per-tenant flag given: the daemon's default shares), both clients connected."""

    def __init__(self, shared_dir: str, *args: str) -> None:
        me = os.geteuid()
        self.d = DaemonProcess(shared_dir, "--allowed-uids", f"{me},{NOBODY}", "--tenants",
                               f"{me}=alice,{NOBODY}=bob", *args, host_capacity="64MiB").start()
        self.alice = Tenant(self.d.socket, "alice")
        self.bob = Bob(self.d.socket)
        assert self.alice.creds.tenant == "alice"

    def close(self) -> None:
        self.bob.close()
        self.alice.close()
        self.d.cleanup()


@pytest.fixture
def two(shared_dir) -> Iterator:
    """Factory: ``two(*daemon_args)`` -> a started :class:`TwoTenants`, cleaned up after."""
    made: list[TwoTenants] = []

    def make(*args: str) -> TwoTenants:
        made.append(TwoTenants(shared_dir, *args))
        return made[-1]

    yield make
    for t in made:
        t.close()


def open_stream(tenant: Tenant, name: str) -> tuple[grpc.Future, queue.Queue]:
    """A Session stream of ``tenant``'s caller that stays open until its queue gets None."""
    q: queue.Queue = queue.Queue()
    q.put(node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=name, pid=os.getpid())))
    return tenant.node.Session(iter(q.get, None), metadata=tenant.md), q


# -- sessions ----------------------------------------------------------------------------------

def test_one_tenant_cannot_take_every_session(two) -> None:
    """alice opens Session streams without end: past her share (8 // 4 = 2; she already holds
    one) she is refused naming --max-sessions-per-tenant, and bob still opens his."""
    t = two("--max-sessions", "8")
    alice, bob = t.alice, t.bob
    streams = []
    details = ""
    try:
        for _ in range(8):
            call, q = open_stream(alice, "hog")
            streams.append((call, q))
            try:
                next(call)
            except grpc.RpcError as e:
                assert e.code() == EXHAUSTED, e.details()
                details = e.details()
                break
        assert "--max-sessions-per-tenant" in details and "limit is 2 per tenant" in details, details
        assert len(streams) == 2  # her Tenant's own session, one more, and this one refused
        assert bob.open_session() > 0   # bob: his second session
        assert "--max-sessions-per-tenant" in refused(bob.open_session)  # his share is as bounded
    finally:
        for call, q in streams:
            q.put(None)
            call.cancel()


# -- layouts and slot sizes --------------------------------------------------------------------

def test_one_tenant_cannot_take_every_layout(two) -> None:
    """alice registers layouts until refused: at her share (256 // 4), naming
    --max-layouts-per-tenant; bob still registers his."""
    t = two()
    alice, bob = t.alice, t.bob
    share = MAX_LAYOUTS // 4
    for i in range(MAX_LAYOUTS):  # one slot size: only the layout count grows
        try:
            alice.register(Layout.flat(BLOCK, name=f"alice-{i}"))
        except grpc.RpcError as e:
            assert e.code() == EXHAUSTED, e.details()
            assert f"limit is {share} layouts per tenant (--max-layouts-per-tenant)" in e.details(), e.details()
            assert i == share
            break
    else:
        pytest.fail("alice registered every layout of the daemon")
    assert bob.register(LAYOUT).layout_id
    assert bob.register(Layout.flat(BLOCK, name="bob-2")).layout_id
    alice.register(Layout.flat(BLOCK, name="alice-0"))  # one she has is answered as before


def test_one_tenant_cannot_take_every_slot_size(two) -> None:
    """alice registers layouts of a new block size each until refused: at her share of the
    16 slot sizes (4), naming --max-slot-sizes-per-tenant; bob still registers new sizes."""
    t = two()
    alice, bob = t.alice, t.bob
    share = MAX_SLOT_SIZES // 4
    for i in range(MAX_SLOT_SIZES):
        try:
            alice.register(Layout.flat(BLOCK * (i + 1)))
        except grpc.RpcError as e:
            assert e.code() == EXHAUSTED, e.details()
            assert f"limit is {share} slot sizes (pool files) per tenant (--max-slot-sizes-per-tenant)" \
                in e.details(), e.details()
            assert i == share
            break
    else:
        pytest.fail("alice took every slot size of the daemon")
    for i in range(share):   # bob's share, of sizes alice holds too: pools are per tenant
        assert bob.register(Layout.flat(BLOCK * (i + 1))).layout_id
    alice.register(Layout.flat(BLOCK, name="same-size"))  # a size she has: still registers


# -- workers reporting device blocks -----------------------------------------------------------

def test_one_tenant_cannot_take_every_reporting_worker(two) -> None:
    """alice reports device blocks under new worker ids until refused: at her share of the
    1024 workers (256), naming --max-workers-per-tenant; bob still reports a new worker."""
    t = two()
    alice, bob = t.alice, t.bob
    reg = alice.register(LAYOUT)
    share = MAX_WORKERS // 4
    for i in range(MAX_WORKERS):
        try:
            alice.report(reg, f"w{i}", [key(1)])
        except grpc.RpcError as e:
            assert e.code() == EXHAUSTED, e.details()
            assert f"limit is {share} workers per tenant (--max-workers-per-tenant)" in e.details(), e.details()
            assert i == share
            break
    else:
        pytest.fail("alice took every worker place of the daemon")
    reg_b = bob.register(LAYOUT)
    bob.report(reg_b, "bob-engine", [key(1)])
    alice.report(reg, "w0", [key(2)])  # a worker she has still reports


def test_a_worker_cannot_report_device_blocks_without_end(two) -> None:
    """One worker reports ever more device blocks: past --max-device-blocks-per-worker (all its
    layouts together) the report is refused and changes nothing; a report that removes makes
    room; another worker and the other tenant are still served."""
    t = two("--max-device-blocks-per-worker", "100")
    alice, bob = t.alice, t.bob
    reg, other = alice.register(LAYOUT), alice.register(Layout.flat(BLOCK, name="rank-1"))
    alice.report(reg, "w", [key(i) for i in range(60)])
    alice.report(other, "w", [key(i) for i in range(40)])        # 100: at the limit
    alice.report(reg, "w", [key(i) for i in range(60)])          # known keys: no more
    details = refused(alice.report, other, "w", [key(1000)])
    assert "limit is 100 per worker" in details and "--max-device-blocks-per-worker" in details, details
    details = refused(alice.report, reg, "w", [key(i) for i in range(1000, 1100)], clear=False)
    assert alice.lookup(reg.layout_id, [key(1000)]) == [node_pb2.TIER_NONE]   # nothing of it applied
    alice.report(reg, "w", [key(1000)], removed=[key(0)])          # one in, one out: 100
    alice.report(reg, "w", [key(i) for i in range(2000, 2060)], clear=True)  # clear makes room: 100
    assert alice.lookup(reg.layout_id, [key(2000), key(0), key(1000)]) == [node_pb2.TIER_GPU] + [
        node_pb2.TIER_NONE] * 2
    alice.report(reg, "w2", [key(i) for i in range(100)])         # another worker: its own 100
    reg_b = bob.register(LAYOUT)
    bob.report(reg_b, "w", [key(i) for i in range(100)])          # bob's "w" is his own worker


# -- feed subscribers --------------------------------------------------------------------------

def test_one_tenant_cannot_take_every_feed_subscriber_place(two) -> None:
    """alice subscribes to the location feed without end: past her share (8 // 4 = 2) she is
    refused naming --max-feed-subscribers-per-tenant; bob still subscribes."""
    t = two("--max-feed-subscribers", "8")
    alice, bob = t.alice, t.bob
    req = locations_pb2.WatchLocationsRequest(subscriber="hog")
    streams = []
    details = ""
    try:
        for _ in range(8):
            call = alice.locations.WatchLocations(req, metadata=alice.md, timeout=30)
            streams.append(call)
            try:
                assert next(call).HasField("node")
            except grpc.RpcError as e:
                assert e.code() == EXHAUSTED, e.details()
                details = e.details()
                break
        assert "limit is 2 per tenant (--max-feed-subscribers-per-tenant)" in details, details
        assert len(streams) == 3
        assert bob.first_feed_reply_has_node()
    finally:
        for call in streams:
            call.cancel()


# -- ids held by another session ---------------------------------------------------------------

def test_another_sessions_grant_or_lease_is_answered_as_an_unknown_id(two) -> None:
    """bob names a grant and a lease alice's session holds: the answer is the one for an id
    nobody holds (code and words; only the id differs), and alice's grant and lease stay hers."""
    t = two()
    alice, bob = t.alice, t.bob
    reg_a, reg_b = alice.register(LAYOUT), bob.register(LAYOUT)
    grant = alice.node.Allocate(node_pb2.AllocateRequest(session_id=alice.session_id, layout_id=reg_a.layout_id,
                                                         keys=[key(1)]), metadata=alice.md).grants[0]
    assert grant.grant_id
    alice.put(reg_a, [key(2)], b"x" * BLOCK)
    lease = alice.node.Acquire(node_pb2.AcquireRequest(session_id=alice.session_id, layout_id=reg_a.layout_id,
                                                       keys=[key(2)]), metadata=alice.md).leases[0]
    assert lease.lease_id
    assert reg_b.layout_id
    unknown = grant.grant_id ^ 0x5A5A5A5A5A

    def answer(method: str, request) -> tuple[str, str]:
        with pytest.raises(RemoteRpcError) as e:
            bob.rpc("node", method, request)
        return e.value.code().name, e.value.details()

    for make in (lambda gid: node_pb2.CommitRequest(session_id=bob.session_id, grant_ids=[gid]),
                 lambda gid: node_pb2.CommitRequest(session_id=bob.session_id, abort_grant_ids=[gid])):
        held, nobodys = answer("Commit", make(grant.grant_id)), answer("Commit", make(unknown))
        assert held[0] == nobodys[0] == "INVALID_ARGUMENT"
        assert held[1].replace(str(grant.grant_id), "ID") == nobodys[1].replace(str(unknown), "ID"), (held, nobodys)
    held = answer("Release", node_pb2.ReleaseRequest(session_id=bob.session_id, lease_ids=[lease.lease_id]))
    nobodys = answer("Release", node_pb2.ReleaseRequest(session_id=bob.session_id, lease_ids=[lease.lease_id ^ 0xA5A5]))
    assert held[0] == nobodys[0] == "INVALID_ARGUMENT"
    assert held[1].replace(str(lease.lease_id), "ID") == nobodys[1].replace(str(lease.lease_id ^ 0xA5A5), "ID")
    # still alice's: she commits and releases them
    assert alice.node.Commit(node_pb2.CommitRequest(session_id=alice.session_id, grant_ids=[grant.grant_id]),
                             metadata=alice.md).committed == 1
    alice.node.Release(node_pb2.ReleaseRequest(session_id=alice.session_id, lease_ids=[lease.lease_id]),
                       metadata=alice.md)


# -- defaults ----------------------------------------------------------------------------------

def test_shares_default_to_the_whole_limit_with_one_tenant_and_a_quarter_with_more() -> None:
    from kvtier.daemon.config import load_config
    from kvtier.daemon.sessions import Limits

    one = load_config([], {})
    lim = Limits.from_config(one)
    assert one.single_tenant()
    assert (lim.sessions_per_tenant, lim.layouts_per_tenant, lim.slot_sizes_per_tenant, lim.workers_per_tenant) == (
        1024, MAX_LAYOUTS, MAX_SLOT_SIZES, MAX_WORKERS)
    assert one.tenant_share("max_feed_subscribers_per_tenant", one.max_feed_subscribers) == 64
    assert load_config(["--tenants", "1000=default"], {}).single_tenant()
    many = load_config(["--tenants", "1000=alice"], {})
    lim = Limits.from_config(many)
    assert not many.single_tenant()
    assert (lim.sessions_per_tenant, lim.layouts_per_tenant, lim.slot_sizes_per_tenant, lim.workers_per_tenant) == (
        256, 64, 4, 256)
    assert many.tenant_share("max_feed_subscribers_per_tenant", many.max_feed_subscribers) == 16
    # a TLS listener's clients are tenants by their certificates: the feed is served on it, the
    # rest only with --tcp-services all
    tls = ["--tcp", "127.0.0.1:1", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"]
    feed_only = load_config(tls, {})
    assert Limits.from_config(feed_only).layouts_per_tenant == MAX_LAYOUTS
    assert feed_only.tenant_share("max_feed_subscribers_per_tenant", 64) == 16
    assert Limits.from_config(load_config([*tls, "--tcp-services", "all"], {})).layouts_per_tenant == 64
    set_ = load_config(["--tenants", "1000=alice", "--max-sessions-per-tenant", "1000",
                        "--max-slot-sizes-per-tenant", "16"], {})
    assert Limits.from_config(set_).sessions_per_tenant == 1000
    assert Limits.from_config(set_).slot_sizes_per_tenant == 16
    from kvtier.daemon.config import ConfigError
    with pytest.raises(ConfigError, match="--max-slot-sizes-per-tenant"):
        load_config(["--max-slot-sizes-per-tenant", "17"], {})
    with pytest.raises(ConfigError, match="--max-sessions-per-tenant"):
        load_config(["--max-sessions", "8", "--max-sessions-per-tenant", "9"], {})


if __name__ == "__main__":
    attacks_tenants.Tenant = BobsTenant   # serve_as makes the child's client of this class
    serve_as(sys.argv[1], int(sys.argv[2]))

"""Tenants that cannot see each other (the data side).

Each test is one attack by tenant B on tenant A's blocks, against a real kvtierd subprocess
serving over its real unix socket, with tenants taken from the real uid -> tenant map
(``--allowed-uids ROOT,65534 --tenants ROOT=alice,65534=bob``): tenant A ("alice") is this
process (root); tenant B ("bob") is a child process running as ``nobody`` (uid 65534: forked
as root, then setgid/setuid before it connects), which performs B's operations for the test
(:class:`NobodyTenant`, one request at a time over a pipe). B looks up, gets, evicts,
prefetches A's keys, follows the feed, reads its key table, routes on its feed, reads its
pool file, reports device blocks under A's worker id. Each must find nothing of A's and
change nothing of A's.

Both tenants authenticate as every client does (the credential socket: ``SO_PEERCRED``, a
token in every call) and map their pool files and key tables through the credential
socket's ``open`` (the daemon hands the file over as a descriptor): the files are the
daemon's uid's alone (0600 / 0400, in a 0700 directory), so B, as nobody, could not open them
by path.

Run as a script (``python test_security_tenants.py SOCKET UID``), this file is that child.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import queue
import struct
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc._channel  # noqa: F401  (loaded while the child can still read the interpreter's files)
import grpc._common  # noqa: F401
import grpc._utilities  # noqa: F401
import numpy as np
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import Sidecar
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.handshake import Credentials, HandshakeError
from kvtier.proto import locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc
from kvtier.tiers.host import PoolMapping
from kvtier.tiers.keytable import KeyTableReader
from kvtier.tiers.layout import Layout, layout_to_proto

NOBODY = 65534
BLOCK = 8192
HEARTBEAT = slice(40, 48)  # where a key table's header keeps its writer's heartbeat (kvtier.tiers.keytable)
LAYOUT = Layout.flat(BLOCK)
OTHER_LAYOUT = Layout.flat(BLOCK, name="only-a")   # a layout only tenant A registers
SMALL = Layout.flat(2048, name="small")  # 4 KiB slots: so many fit that its first block grows the key table
HOST, DISK, GPU, NONE = node_pb2.TIER_HOST, node_pb2.TIER_DISK, node_pb2.TIER_GPU, node_pb2.TIER_NONE


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


A_KEYS = [key(i) for i in range(1, 5)]
A_BYTES = b"A-SECRET" * (BLOCK // 8)
B_BYTES = b"B-BYTES!" * (BLOCK // 8)


class Tenant:
    """One tenant's client, as any local client is: hand-shaken on the credential socket (its
    uid is its tenant), raw stubs on the daemon's socket with the token in every call, pool
    files and key tables mapped from the descriptors the daemon hands over."""

    def __init__(self, socket_path: str, name: str) -> None:
        self.socket = socket_path
        self.creds = Credentials(socket_path, name).connect()
        self.md = self.creds.metadata
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.node = node_pb2_grpc.NodeStub(self.channel)
        self.locations = locations_pb2_grpc.LocationsStub(self.channel)
        self._out: queue.Queue = queue.Queue()
        self._stream = self.node.Session(iter(self._out.get, None), metadata=self.md)
        self._out.put(node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=name, pid=os.getpid())))
        self.session_id = next(self._stream).opened.session_id
        self.pools: dict[str, PoolMapping] = {}
        self.tables: dict[str, KeyTableReader] = {}
        self._table_opens = 0
        self._watch: Any = None

    def close(self) -> None:
        self._out.put(None)
        self._stream.cancel()
        self.watch_stop()
        for p in self.pools.values():
            p.close()
        for t in self.tables.values():
            t.close()
        self.channel.close()
        self.creds.close()

    # -- who, and files through the credential socket --

    def get_session_id(self) -> int:
        return self.session_id

    def whoami(self) -> tuple[int, str]:
        return os.getuid(), self.creds.tenant

    def _opener(self, path: str) -> int:
        self._table_opens += 1
        try:
            return self.creds.open(path)
        except HandshakeError as e:
            raise OSError(errno.EACCES, str(e)) from None

    def open_code(self, path: str) -> tuple[str, str]:
        """(code, message) of asking the daemon for ``path`` through the credential socket."""
        try:
            fd = self.creds.open(path)
        except HandshakeError as e:
            return e.code, e.details
        os.close(fd)
        return "OK", ""

    @staticmethod
    def open_directly(path: str) -> str:
        """What opening ``path`` by name (read-only) does for this process: "OK" or the errno name."""
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as e:
            return errno.errorcode.get(e.errno or 0, str(e.errno))
        return "OK"

    def pool(self, reply: node_pb2.RegisterLayoutReply) -> PoolMapping:
        if reply.pool_path not in self.pools:
            fd = self.creds.open(reply.pool_path)   # never opened by path
            self.pools[reply.pool_path] = PoolMapping(reply.pool_path, reply.pool_bytes, fd=fd)
        return self.pools[reply.pool_path]

    def pool_holds(self, reply: node_pb2.RegisterLayoutReply, needle: bytes) -> bool:
        """Whether the pool file ``reply`` names, as this tenant maps it, holds ``needle`` anywhere."""
        return needle in bytes(self.pool(reply).mm)

    def table_tiers(self, path: str, fingerprint: bytes, keys: list[bytes]) -> list[str | None]:
        """The key table at ``path`` (mapped from the daemon's descriptor) on these keys."""
        if path not in self.tables:
            self.tables[path] = KeyTableReader(path, opener=self._opener)
        return self.tables[path].tiers(fingerprint, keys)

    def table_opens(self) -> int:
        """How many times this client's key table readers (re)opened a table (each through the daemon)."""
        return self._table_opens

    def sidecar_roundtrip(self) -> dict[str, Any]:
        """put, get and lookup (the key table) with the kvtier Sidecar, as this process's uid."""
        with Sidecar(self.socket, client_name="sidecar") as sc:
            lid = sc.register_layout(LAYOUT)
            out: dict[str, Any] = {"tenant": sc.tenant, "before": sc.lookup(lid, [key(90)])}
            out["stored"] = sc.put(lid, [key(90)], [np.frombuffer(B_BYTES, dtype=np.uint8)]).stored
            got = sc.get(lid, [key(90), key(1)])
            out["got"] = [None if g is None else bytes(g) for g in got]
            out["after"] = sc.lookup(lid, [key(90), key(1)])
            out["table"] = sc._layouts[lid].table is not None and sc._vouched(sc._layouts[lid])
        return out

    # -- calls --

    def rpc(self, service: str, method: str, request: Message) -> Any:
        return getattr(getattr(self, service), method)(request, metadata=self.md, timeout=30)

    def register(self, layout: Layout = LAYOUT) -> node_pb2.RegisterLayoutReply:
        return self.node.RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=layout_to_proto(layout, node_pb2.LayoutSpec)), metadata=self.md)

    def put(self, reg: node_pb2.RegisterLayoutReply, keys: list[bytes], payload: bytes, durable: bool = False) -> None:
        grants = self.node.Allocate(node_pb2.AllocateRequest(session_id=self.session_id, layout_id=reg.layout_id,
                                                             keys=keys), metadata=self.md).grants
        pool = self.pool(reg)
        for g in grants:
            assert g.grant_id, "no slot granted"
            pool.mm[g.offset:g.offset + len(payload)] = payload
        self.node.Commit(node_pb2.CommitRequest(session_id=self.session_id, grant_ids=[g.grant_id for g in grants],
                                                durable=durable), metadata=self.md)

    def get(self, reg: node_pb2.RegisterLayoutReply, keys: list[bytes], size: int = BLOCK) -> list[bytes | None]:
        leases = self.node.Acquire(node_pb2.AcquireRequest(session_id=self.session_id, layout_id=reg.layout_id,
                                                           keys=keys), metadata=self.md).leases
        pool = self.pool(reg)
        out = [bytes(pool.mm[le.offset:le.offset + size]) if le.lease_id else None for le in leases]
        self.node.Release(node_pb2.ReleaseRequest(session_id=self.session_id,
                                                  lease_ids=[le.lease_id for le in leases if le.lease_id]),
                          metadata=self.md)
        return out

    def lookup(self, layout_id: int, keys: list[bytes]) -> list[int]:
        return list(self.node.Lookup(node_pb2.LookupRequest(layout_id=layout_id, keys=keys), metadata=self.md).tiers)

    def report(self, reg: node_pb2.RegisterLayoutReply, worker: str, stored: list[bytes] = (),
               removed: list[bytes] = (), clear: bool = False) -> None:
        self.locations.ReportDeviceBlocks(locations_pb2.ReportDeviceBlocksRequest(
            session_id=self.session_id, worker_id=worker, layout_id=reg.layout_id, stored=stored, removed=removed,
            clear=clear), metadata=self.md)

    def feed(self, n: int) -> list[locations_pb2.WatchLocationsReply]:
        """The first ``n`` replies of a new subscription."""
        stream = self.locations.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber=self.creds.tenant),
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

    def view(self, reg: node_pb2.RegisterLayoutReply, keys: list[bytes]) -> dict[str, Any]:
        """Everything this tenant reads of the node that is not its own doing: its Stats (less
        the uptime), NodeInfo, a new feed subscription's NodeInfo and snapshot, its layout's
        registration again, Lookup of ``keys``, a new handshake's reply (less the token and
        caller, new each time), its key table's and pool file's bytes, and the health check."""
        stats = self.rpc("node", "Stats", node_pb2.StatsRequest())
        stats.uptime_s = 0
        again = self.register(LAYOUT)
        creds = Credentials(self.socket, "view").connect()
        try:
            hello = (creds.tenant, creds.key_salt)
        finally:
            creds.close()
        with os.fdopen(self.creds.open(reg.key_table_path), "rb") as f:
            table = bytearray(f.read())
        table[HEARTBEAT] = bytes(len(table[HEARTBEAT]))  # the writer's clock, refreshed every 0.1 s
        pool = hashlib.sha256(bytes(self.pool(reg).mm)).hexdigest()
        health = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return {"stats": stats, "node_info": self.rpc("locations", "GetNodeInfo", locations_pb2.NodeInfoRequest()),
                "feed": self.feed(2), "register": again, "lookup": self.lookup(reg.layout_id, keys),
                "hello": hello, "key_table": hashlib.sha256(table).hexdigest(), "pool": pool,
                "health": health.status}

    def watch_start(self) -> None:
        self._watch = self.locations.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber="watch"),
                                                    metadata=self.md, timeout=30)

    def watch_next(self) -> locations_pb2.WatchLocationsReply:
        return next(self._watch)

    def watch_stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


# -- tenant B: a child running as nobody -----------------------------------------------------------

_LEN = struct.Struct(">I")
_MESSAGES = {cls.DESCRIPTOR.full_name: cls for mod in (node_pb2, locations_pb2) for cls in vars(mod).values()
             if isinstance(cls, type) and issubclass(cls, Message)}


def _message(name: str, data: bytes) -> Message:
    return _MESSAGES[name].FromString(data)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Message):
            return _message, (obj.DESCRIPTOR.full_name, obj.SerializeToString())
        return NotImplemented


def _send(f: Any, obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    f.write(_LEN.pack(len(buf.getvalue())) + buf.getvalue())
    f.flush()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name == "_message":   # this module is __main__ in the child, not in the test
            return _message
        return super().find_class(module, name)


def _recv(f: Any) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    return _Unpickler(io.BytesIO(f.read(_LEN.unpack(head)[0]))).load()


class RemoteRpcError(Exception):
    """A gRPC error of a call the child made (``code()`` and ``details()`` as grpc.RpcError)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self._code, self._details = grpc.StatusCode[code], details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NobodyTenant:
    """Tenant B: a :class:`Tenant` in a child process running as ``uid``; each method call is
    performed there (``b.lookup(...)``, ``b.rpc("node", "Evict", req)``)."""

    def __init__(self, socket_path: str, uid: int = NOBODY) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), socket_path, str(uid)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.session_id = self._call("get_session_id")
        assert self.whoami() == (uid, "bob"), "tenant B's child is not nobody/bob"

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        _send(self.proc.stdin, (name, args, kw))
        kind, *rest = _recv(self.proc.stdout)
        if kind == "ok":
            return rest[0]
        if kind == "rpc":
            raise RemoteRpcError(*rest)
        raise AssertionError(f"tenant B's {name} failed in the child:\n{rest[0]}")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kw: self._call(name, *args, **kw)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_as(socket_path: str, uid: int) -> None:
    """The child: become ``uid``, hand-shake, perform the parent's requests until stdin closes."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    t = Tenant(socket_path, "bob")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        while True:
            try:
                name, args, kw = _recv(stdin)
            except EOFError:
                return
            try:
                result = getattr(t, name)(*args, **kw)
                _send(stdout, ("ok", result))
            except grpc.RpcError as e:
                _send(stdout, ("rpc", e.code().name, e.details()))
            except Exception:
                _send(stdout, ("error", traceback.format_exc()))
    finally:
        t.close()


# -- fixtures ----------------------------------------------------------------------------------

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



class Node:
    """A real kvtierd where uid 65534 is tenant bob and this process's uid is tenant alice."""

    def __init__(self, shared_dir: str, disk_dir: str) -> None:
        me = os.geteuid()
        assert me != NOBODY
        self.d = DaemonProcess(shared_dir, "--allowed-uids", f"{me},{NOBODY}", "--tenants", f"{me}=alice,{NOBODY}=bob",
                               "--disk-dir", disk_dir, "--disk-capacity", "256MiB", host_capacity="16MiB")
        self.socket = self.d.socket

    def start(self) -> Node:
        self.d.start()
        return self

    def stop(self) -> None:
        self.d.stop()

    def cleanup(self) -> None:
        self.d.cleanup()


@pytest.fixture
def node(shared_dir, tmp_path) -> Iterator[Node]:
    n = Node(shared_dir, str(tmp_path / "disk")).start()
    yield n
    n.cleanup()


@pytest.fixture
def tenants(node) -> Iterator[tuple[Tenant, NobodyTenant]]:
    """(A, B); A has put ``A_KEYS`` under ``LAYOUT`` and registered ``OTHER_LAYOUT``."""
    a = Tenant(node.socket, "alice")
    b = NobodyTenant(node.socket)
    try:
        assert a.creds.tenant == "alice"
        reg = a.register()
        a.register(OTHER_LAYOUT)
        a.put(reg, A_KEYS, A_BYTES)
        assert a.lookup(reg.layout_id, A_KEYS) == [HOST] * len(A_KEYS)
        yield a, b
    finally:
        b.close()
        a.close()


# -- the attacks -------------------------------------------------------------------------------

def test_tenant_b_lookup_does_not_find_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg = b.register()   # the same layout: B must still find nothing of A's
    assert b.lookup(reg.layout_id, A_KEYS) == [NONE] * len(A_KEYS)


def test_tenant_b_cannot_use_a_layout_id_tenant_a_registered(tenants) -> None:
    a, b = tenants
    a_only = a.register(OTHER_LAYOUT).layout_id
    with pytest.raises(RemoteRpcError) as seen:
        b.lookup(a_only, A_KEYS)
    with pytest.raises(RemoteRpcError) as unknown:
        b.lookup(a_only ^ 0x5A5A5A, A_KEYS)   # an id nobody registered
    # the same answer as for an id that does not exist: B does not learn A registered it
    assert seen.value.code() == unknown.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert seen.value.details().replace(str(a_only), "ID") == unknown.value.details().replace(
        str(a_only ^ 0x5A5A5A), "ID")
    with pytest.raises(RemoteRpcError) as alloc:
        b.rpc("node", "Allocate", node_pb2.AllocateRequest(session_id=b.session_id, layout_id=a_only, keys=[key(99)]))
    assert alloc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_tenant_b_get_misses_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    assert b.get(reg_b, A_KEYS) == [None] * len(A_KEYS)
    assert a.get(a.register(), A_KEYS[:1]) == [A_BYTES]


def test_tenant_b_put_of_the_same_key_does_not_reach_tenant_a(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    b.put(reg_b, A_KEYS[:1], B_BYTES)   # not PRESENT: B has no such block
    assert a.get(a.register(), A_KEYS[:1]) == [A_BYTES]
    assert b.get(reg_b, A_KEYS[:1]) == [B_BYTES]


def test_tenant_b_evict_leaves_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    evicted = b.rpc("node", "Evict", node_pb2.EvictRequest(layout_id=reg_b.layout_id, keys=A_KEYS)).evicted
    assert evicted == 0
    assert a.lookup(a.register().layout_id, A_KEYS) == [HOST] * len(A_KEYS)


def test_tenant_b_prefetch_does_not_promote_tenant_a_keys(shared_dir, tmp_path) -> None:
    """A's blocks are on disk only (the daemon restarted: this also shows a tenant's blocks
    are found again under its layout after a restart). B's Prefetch of them promotes
    nothing; A's does."""
    n = Node(shared_dir, str(tmp_path / "disk")).start()
    try:
        a = Tenant(n.socket, "alice")
        a.put(a.register(), A_KEYS, A_BYTES, durable=True)
        a.close()
        n.stop()
        n.start()
        a, b = Tenant(n.socket, "alice"), NobodyTenant(n.socket)
        try:
            reg_a, reg_b = a.register(), b.register()
            assert a.lookup(reg_a.layout_id, A_KEYS) == [DISK] * len(A_KEYS)
            assert b.lookup(reg_b.layout_id, A_KEYS) == [NONE] * len(A_KEYS)
            promoted = b.rpc("node", "Prefetch", node_pb2.PrefetchRequest(layout_id=reg_b.layout_id,
                                                                          keys=A_KEYS)).promoted
            assert promoted == 0
            assert a.lookup(reg_a.layout_id, A_KEYS) == [DISK] * len(A_KEYS)
            assert b.get(reg_b, A_KEYS) == [None] * len(A_KEYS)
            assert a.rpc("node", "Prefetch", node_pb2.PrefetchRequest(layout_id=reg_a.layout_id,
                                                                      keys=A_KEYS)).promoted == len(A_KEYS)
            assert a.get(reg_a, A_KEYS[:1]) == [A_BYTES]
        finally:
            b.close()
            a.close()
    finally:
        n.cleanup()


def test_tenant_b_feed_shows_no_tenant_a_keys_workers_or_layouts(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.report(reg_a, "engine-a", stored=[key(50)])
    b.put(reg_b, [key(60)], b"B" * BLOCK)
    replies = b.feed(3)   # NodeInfo, the snapshot (one part), and A's put is not an event of B's
    info = replies[0].node
    assert [w.worker_id for w in info.workers] == []
    assert {lay.fingerprint for lay in info.layouts} == {reg_b.fingerprint}
    assert feed_keys(replies) == {key(60)}
    # live: A's next put reaches A's feed and not B's
    b.watch_start()
    try:
        first = [b.watch_next(), b.watch_next()]   # NodeInfo, snapshot
        a.put(reg_a, [key(70)], A_BYTES)
        b.put(reg_b, [key(71)], b"B" * BLOCK)  # B's own event marks where A's would have been
        live: list[locations_pb2.WatchLocationsReply] = []
        while key(71) not in feed_keys(live):
            live.append(b.watch_next())
    finally:
        b.watch_stop()
    assert key(70) not in feed_keys(first + live) and not set(A_KEYS) & feed_keys(first + live)
    info_b = b.rpc("locations", "GetNodeInfo", locations_pb2.NodeInfoRequest())
    assert [w.worker_id for w in info_b.workers] == []
    # A's own feed has all of it
    mine = a.feed(3)
    assert set(A_KEYS) | {key(50), key(70)} <= feed_keys(mine)
    assert [w.worker_id for w in mine[0].node.workers] == ["engine-a"]


def test_tenant_b_device_report_under_tenant_a_worker_id_touches_nothing_of_a(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.report(reg_a, "engine-a", stored=[key(50)])
    assert a.lookup(reg_a.layout_id, [key(50)]) == [GPU]
    assert b.lookup(reg_b.layout_id, [key(50)]) == [NONE]
    b.report(reg_b, "engine-a", removed=[key(50)], clear=True)
    assert a.lookup(reg_a.layout_id, [key(50)]) == [GPU]
    assert [w.worker_id for w in a.feed(1)[0].node.workers] == ["engine-a"]


def test_tenant_b_key_table_shows_no_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    assert reg_b.key_table_path and reg_a.key_table_path and reg_b.key_table_path != reg_a.key_table_path
    fp = LAYOUT.fingerprint
    assert b.table_tiers(reg_b.key_table_path, fp, A_KEYS) == [None] * len(A_KEYS)
    assert a.table_tiers(reg_a.key_table_path, fp, A_KEYS) == ["host"] * len(A_KEYS)
    b.put(reg_b, [key(60)], b"B" * BLOCK)
    assert b.table_tiers(reg_b.key_table_path, fp, [key(60)]) == ["host"]
    assert a.table_tiers(reg_a.key_table_path, fp, [key(60)]) == [None]
    assert b.table_tiers(reg_b.key_table_path, OTHER_LAYOUT.fingerprint, A_KEYS) == [None] * len(A_KEYS)


def test_tenant_b_router_fed_by_its_feed_never_routes_on_tenant_a_keys(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    a.report(reg_a, "engine-a", stored=A_KEYS)
    b.report(reg_b, "engine-b", stored=[key(80)])
    router = Router(RouterConfig())
    for reply in b.feed(2):   # B's subscription, made by B's process
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
    assert not b.pool_holds(reg_b, b"A-SECRET")   # the whole pool B maps
    assert b.pool_holds(reg_b, b"B" * BLOCK)
    assert a.pool_holds(reg_a, b"A-SECRET")


def test_tenant_b_stats_list_only_its_layouts(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    stats_b = b.rpc("node", "Stats", node_pb2.StatsRequest())
    assert [lay.fingerprint for lay in stats_b.layouts] == [reg_b.fingerprint]
    assert [lay.host_blocks for lay in stats_b.layouts] == [0]   # A's blocks of the same layout are not B's
    stats_a = a.rpc("node", "Stats", node_pb2.StatsRequest())
    assert {lay.fingerprint for lay in stats_a.layouts} == {LAYOUT.fingerprint, OTHER_LAYOUT.fingerprint}



def _figures(stats: node_pb2.StatsReply) -> tuple:
    """Every counter of a Stats reply, and the tiers' use."""
    return (dict(stats.counters), dict(stats.totals), [(h.op, h.tier, h.blocks, h.tokens) for h in stats.hits],
            [(m.source, m.destination, m.bytes) for m in stats.bytes_moved],
            [(t.tier, t.used_bytes, t.blocks) for t in stats.tiers])


def test_tenant_b_stats_show_nothing_of_tenant_a_activity(tenants) -> None:
    a, b = tenants
    reg_b = b.register()
    b.put(reg_b, [key(70)], B_BYTES)
    before = b.rpc("node", "Stats", node_pb2.StatsRequest())
    # B sees its own puts, its one session and its one block; none of A's (4 blocks, A's session)
    assert before.counters["commits"] == 1 and before.counters["grants"] == 1
    assert before.sessions == 1
    assert {t.tier: t.blocks for t in before.tiers}[HOST] == 1
    reg_a = a.register()
    assert a.get(reg_a, A_KEYS) == [A_BYTES] * len(A_KEYS)
    assert a.lookup(reg_a.layout_id, A_KEYS) == [HOST] * len(A_KEYS)
    a.put(reg_a, [key(71)], A_BYTES)
    assert a.rpc("node", "Evict", node_pb2.EvictRequest(layout_id=reg_a.layout_id, keys=[key(71)])).evicted == 1
    after = b.rpc("node", "Stats", node_pb2.StatsRequest())
    assert _figures(after) == _figures(before)   # A's gets, lookups, puts and evicts moved nothing B reads
    assert after.sessions == 1
    # B's own activity is B's to see
    assert b.get(reg_b, [key(70)]) == [B_BYTES]
    assert b.rpc("node", "Stats", node_pb2.StatsRequest()).counters["acquire_hit_blocks:host"] == 1
    # the operator (the daemon's own uid: alice here) reads the node-wide figures
    node_wide = a.rpc("node", "Stats", node_pb2.StatsRequest())
    assert node_wide.counters["acquire_hit_blocks:host"] == len(A_KEYS) + 1
    assert node_wide.counters["commits"] == len(A_KEYS) + 2
    assert node_wide.sessions == 2
    assert {t.tier: t.blocks for t in node_wide.tiers}[HOST] == len(A_KEYS) + 1

def tcp_listeners(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (a metrics port, a TCP listener)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _flat(msg: Message, prefix: str = "") -> dict[str, Any]:
    """Every field set in ``msg``, by path (``tiers[1].load_gbps``, ``counters[commits]``)."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        name = prefix + fd.name
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            out.update({f"{name}[{k}]": v for k, v in value.items()})
        elif fd.is_repeated:
            for i, x in enumerate(value):
                out.update(_flat(x, f"{name}[{i}].") if isinstance(x, Message) else {f"{name}[{i}]": x})
        elif isinstance(value, Message):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _moved(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What moved from one Stats reply to the next: each number's difference, each other
    field's (before, after)."""
    out = {}
    for k in before.keys() | after.keys():
        b, a = before.get(k), after.get(k)
        if a != b:
            numbers = all(isinstance(v, (int, float)) or v is None for v in (a, b))
            out[k] = (a or 0) - (b or 0) if numbers else (b, a)
    return out


def test_tenant_b_view_of_every_endpoint_does_not_change_with_tenant_a_hits(shared_dir, tmp_path) -> None:
    """A's blocks are on disk only (put durable, then the daemon restarted). B takes its view of
    every endpoint it can reach (:meth:`Tenant.view`) twice, A hits and misses in every tier
    (Acquire from disk, which promotes and so loads from disk, then from host; Lookup;
    Prefetch from disk; a key-table lookup; a refused Acquire; an Evict), and B takes its view
    again: it is the same, but for what B's own view moves in its Stats (its Lookups), which
    moves exactly as much as between B's first two views. The daemon listens on no TCP port
    (the metrics port is off by default)."""
    n = Node(shared_dir, str(tmp_path / "disk")).start()
    try:
        a = Tenant(n.socket, "alice")
        a.put(a.register(), A_KEYS, A_BYTES, durable=True)
        a.close()
        n.stop()
        n.start()
        assert tcp_listeners(n.d.pid) == []
        a, b = Tenant(n.socket, "alice"), NobodyTenant(n.socket)
        try:
            reg_a, reg_b = a.register(), b.register()
            b.put(reg_b, [key(60)], B_BYTES)
            assert b.get(reg_b, [key(60)]) == [B_BYTES]
            first = b.view(reg_b, [key(60), *A_KEYS])
            before = b.view(reg_b, [key(60), *A_KEYS])
            assert a.lookup(reg_a.layout_id, A_KEYS) == [DISK] * len(A_KEYS)
            assert a.get(reg_a, A_KEYS[:2]) == [A_BYTES] * 2           # disk hits (promoted)
            assert a.get(reg_a, A_KEYS[:2] + [key(99)]) == [A_BYTES] * 2 + [None]  # host hits, a miss
            assert a.rpc("node", "Prefetch", node_pb2.PrefetchRequest(layout_id=reg_a.layout_id,
                                                                      keys=A_KEYS[2:])).promoted == 2
            assert a.table_tiers(reg_a.key_table_path, LAYOUT.fingerprint, A_KEYS) == ["host"] * len(A_KEYS)
            with pytest.raises(grpc.RpcError):
                a.get(reg_a, [A_KEYS[0], A_KEYS[0]])   # a key named twice: refused
            assert a.rpc("node", "Evict", node_pb2.EvictRequest(layout_id=reg_a.layout_id,
                                                                keys=A_KEYS[:1])).evicted >= 1
            after = b.view(reg_b, [key(60), *A_KEYS])
            changed = {k: (before[k], v) for k, v in after.items() if k != "stats" and v != before[k]}
            assert changed == {}, f"what B reads changed with A's hits: {changed}"
            own = _moved(_flat(first["stats"]), _flat(before["stats"]))   # B's own view's Lookups
            assert _moved(_flat(before["stats"]), _flat(after["stats"])) == own
        finally:
            b.close()
            a.close()
    finally:
        n.cleanup()


# -- tenant files reach only their tenant's clients, as descriptors ---------------------------------

def test_tenant_b_as_nobody_maps_its_own_pool_and_key_table_through_the_fd_op(tenants) -> None:
    a, b = tenants
    reg_b = b.register(SMALL)
    # the files are the daemon's uid's alone: B cannot open them by name ...
    assert b.open_directly(reg_b.pool_path) == "EACCES"
    assert b.open_directly(reg_b.key_table_path) == "EACCES"
    # ... and is handed them: it writes and reads its pool, and reads its key table
    assert b.open_code(reg_b.pool_path) == ("OK", "")
    assert b.open_code(reg_b.key_table_path) == ("OK", "")
    assert b.table_tiers(reg_b.key_table_path, SMALL.fingerprint, [key(60)]) == [None]
    assert b.table_opens() == 1
    small = b"b" * SMALL.block_bytes
    b.put(reg_b, [key(60)], small)   # the layout's first block: the daemon presizes (rebuilds) B's table
    assert b.get(reg_b, [key(60)], SMALL.block_bytes) == [small]
    # the reader reopened the rebuilt table, through the daemon too
    assert b.table_tiers(reg_b.key_table_path, SMALL.fingerprint, [key(60)]) == ["host"]
    assert b.table_opens() == 2
    assert b.lookup(reg_b.layout_id, [key(60)]) == [HOST]


def test_tenant_b_sidecar_as_nobody_puts_gets_and_reads_its_key_table(tenants) -> None:
    a, b = tenants
    out = b.sidecar_roundtrip()
    assert out["tenant"] == "bob"
    assert out["before"] == [None] and out["stored"] == 1
    assert out["got"] == [B_BYTES, None]   # key(1) is A's
    assert out["after"] == ["host", None] and out["table"], out


def test_tenant_b_cannot_open_tenant_a_files_through_the_fd_op(tenants) -> None:
    a, b = tenants
    reg_a, reg_b = a.register(), b.register()
    refused = [b.open_code(p) for p in (reg_a.pool_path, reg_a.key_table_path, reg_a.pool_path + ".nope",
                                        "/etc/shadow", os.path.dirname(reg_a.pool_path))]
    assert {code for code, _ in refused} == {"PERMISSION_DENIED"}, refused
    assert len({msg for _, msg in refused}) == 1, "the refusal tells which paths exist"
    # nor the other way round; and a refused open keeps the caller's credential (and token)
    assert a.open_code(reg_b.pool_path)[0] == "PERMISSION_DENIED"
    assert a.open_code(reg_a.pool_path) == ("OK", "")
    assert b.lookup(reg_b.layout_id, A_KEYS) == [NONE] * len(A_KEYS)


if __name__ == "__main__":
    serve_as(sys.argv[1], int(sys.argv[2]))

"""The engine library's transport (``kvtier.client.engine.transport``) against a real kvtierd over a
real unix socket: where a client finds the daemon, the errors it raises, the session stream's
lifetime, and how a daemon restart is told from a refusal. Every client of the engine library
(``Sidecar``, ``AsyncSidecar``, ``KVConnector``) goes through it."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import grpc
import pytest

from kvtier.client import AsyncSidecar, Sidecar
from kvtier.client.engine import (
    DeadlineExceeded,
    ExportError,
    FailedPrecondition,
    InvalidArgument,
    KVConnector,
    KVConnectorError,
    KvtierError,
    Unavailable,
)
from kvtier.client.engine.transport import (
    AsyncTransport,
    Transport,
    resolve_target,
    socket_path,
)
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.paths import default_socket_path
from kvtier.proto import node_pb2, transfer_pb2
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 64 * 1024
LAYOUT = Layout.flat(BLOCK)


def keys_for(n: int, tag: bytes = b"t") -> list[bytes]:
    return [tag * 8 + i.to_bytes(8, "big") for i in range(n)]


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def counters(d: DaemonProcess) -> dict:
    with Sidecar(d.socket, use_key_table=False) as sc:
        st = sc.stats()
    return {"sessions": st["sessions"], **st["counters"]}


def register_and_allocate(t: Transport, keys: list[bytes]) -> list[int]:
    """Through a bare transport: register LAYOUT, open the session, take grants for ``keys``."""
    reg = t.run(t.register_layout(node_pb2.RegisterLayoutRequest(
        layout=layout_to_proto(LAYOUT, node_pb2.LayoutSpec))))
    sid = t.session.open()
    reply = t.run(t.allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=reg.layout_id, keys=keys)))
    return [g.grant_id for g in reply.grants if g.status == node_pb2.GRANTED]


# -- where the daemon is --------------------------------------------------------------------

def test_target_resolution_order(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert socket_path() == default_socket_path() == str(tmp_path / "kvtier" / "kvtierd.sock")
    assert resolve_target() == f"unix:{default_socket_path()}"
    monkeypatch.setenv("KVTIER_SOCKET", "/env/kvtierd.sock")
    assert resolve_target() == "unix:/env/kvtierd.sock"                         # the env beats the default
    assert resolve_target("/given.sock") == "unix:/given.sock"                 # a given path beats the env
    assert resolve_target("unix:/given.sock") == "unix:/given.sock"            # given as a gRPC unix target
    assert resolve_target("unix:///abs/given.sock") == "unix:/abs/given.sock"
    assert resolve_target("/given.sock", target="node7:7070") == "node7:7070"  # a target beats them all
    monkeypatch.setenv("KVTIER_SOCKET", "unix:/env/other.sock")
    assert socket_path() == "/env/other.sock"


def test_every_client_finds_the_daemon_through_KVTIER_SOCKET(start_daemon, monkeypatch, tmp_path) -> None:
    d = start_daemon("--copy-engine", "host")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the default path holds no daemon
    monkeypatch.setenv("KVTIER_SOCKET", d.socket)
    with Sidecar(timeout=10) as sc:
        assert sc.target == f"unix:{d.socket}"
        assert sc.stats()["node_id"]
    conn = KVConnector(timeout=10)
    try:
        assert conn.target == f"unix:{d.socket}"
        assert conn._open_session() > 0
        assert counters(d)["sessions"] == 1
    finally:
        conn.close()

    async def go() -> str:
        async with AsyncSidecar(timeout=10) as asc:
            return (await asc.stats())["node_id"]

    assert asyncio.run(go())
    # a given socket beats the env: the env now names nothing, the given socket the daemon
    monkeypatch.setenv("KVTIER_SOCKET", str(tmp_path / "nothing.sock"))
    with Sidecar(d.socket, timeout=10) as sc:
        assert sc.stats()["node_id"]
    with Sidecar(target=f"unix:{d.socket}", timeout=10) as sc:
        assert sc.stats()["node_id"]


# -- errors ---------------------------------------------------------------------------------

def test_daemon_refusals_map_to_one_error_hierarchy(start_daemon, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    d = start_daemon("--copy-engine", "host")
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        with pytest.raises(InvalidArgument) as e:           # refused by the daemon, not the client
            sc.lookup(lid, [b"short"])
        assert isinstance(e.value, ValueError) and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "8 to 32 bytes" in e.value.details
        with pytest.raises(FailedPrecondition) as e:        # durable without a disk tier
            sc.put(lid, keys_for(1), [bytes(BLOCK)], durable=True)
        assert "--disk-dir" in e.value.details

    t = Transport(d.socket, timeout=10)
    try:
        sid = t.session.open()
        with pytest.raises(KvtierError) as e:  # a code without a subclass keeps the base class
            t.run(t.unregister_kv(transfer_pb2.UnregisterKVRequest(session_id=sid, registration_id=999)))
        assert type(e.value) is KvtierError and e.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        t.close()

    # the connector raises the same classes: KVConnectorError is KvtierError
    layout = Layout.vllm(num_layers=1, num_blocks=4, block_tokens=16, kv_heads=1, head_dim=16, dtype="float16")
    conn = KVConnector(d.socket, ring_dir=str(tmp_path))
    try:
        with pytest.raises(ExportError) as e:
            conn.register(layout, [torch.zeros(layout.tensors[0].shape, dtype=torch.float16)])
        assert isinstance(e.value, FailedPrecondition) and isinstance(e.value, KVConnectorError)
        with pytest.raises(InvalidArgument):
            conn.register(layout, [])
    finally:
        conn.close()


def test_no_daemon_is_unavailable_or_a_deadline(tmp_path) -> None:
    nothing = str(tmp_path / "none.sock")
    t = Transport(nothing, timeout=5)
    try:
        with pytest.raises(Unavailable):  # fails fast: no wait for the daemon
            t.run(t.stats(node_pb2.StatsRequest()))
    finally:
        t.close()
    started = time.monotonic()
    with Sidecar(nothing, timeout=5) as sc, pytest.raises(Unavailable, match="no daemon socket"):  # no wait either
        sc.stats()
    assert time.monotonic() - started < 3  # the timeout is 5 s
    with socket.socket(socket.AF_UNIX) as silent:  # a socket that is there but never answers
        silent.bind(str(tmp_path / "silent.sock"))
        silent.listen()
        started = time.monotonic()
        with Sidecar(str(tmp_path / "silent.sock"), timeout=0.5) as sc, pytest.raises(DeadlineExceeded):
            sc.stats()  # waits for it, up to the timeout
        assert time.monotonic() - started < 5


# -- background calls -------------------------------------------------------------------------

def _send_then_settle(t: Transport | AsyncTransport, sid: int) -> tuple:
    async def send():  # returns at once; the daemon refuses the release later
        t.release_later(node_pb2.ReleaseRequest(session_id=sid, lease_ids=[424242]))
        return "sent"

    return send, t.settle


def test_a_background_release_error_surfaces_at_the_next_settle(daemon) -> None:
    """What ``get`` relies on, blocking and asyncio alike: the release goes without waiting; the
    next SETTLE raises its refusal; a release whose session is gone is not an error."""
    t = Transport(daemon.socket, timeout=10)
    try:
        send, settle = _send_then_settle(t, t.session.open())
        assert t.run(send()) == "sent"
        with pytest.raises(InvalidArgument, match="not held"):
            t.run(settle())
        t.run(settle())  # settled once: nothing left
        gone, _ = _send_then_settle(t, 12345)  # no such session: the daemon already dropped its pins
        t.run(gone())
        t.run(settle())
    finally:
        t.close()

    async def go() -> None:
        at = AsyncTransport(daemon.socket, timeout=10)
        try:
            send, settle = _send_then_settle(at, await at.session.open())
            assert await at.run(send()) == "sent"
            with pytest.raises(InvalidArgument, match="not held"):
                await at.run(settle())
            gone, _ = _send_then_settle(at, 12345)
            await at.run(gone())
            await at.run(settle())
        finally:
            await at.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_sidecars_release_every_lease_they_take(daemon, kind: str) -> None:
    keys = keys_for(4, b"r")
    blocks = [bytes([i]) * BLOCK for i in range(4)]

    async def async_client() -> None:
        async with AsyncSidecar(daemon.socket) as sc:
            lid = await sc.register_layout(LAYOUT)
            await sc.put(lid, keys, blocks)
            for _ in range(3):
                assert [bytes(g) for g in await sc.get(lid, keys)] == blocks

    if kind == "async":
        asyncio.run(async_client())
    else:
        with Sidecar(daemon.socket) as sc:
            lid = sc.register_layout(LAYOUT)
            sc.put(lid, keys, blocks)
            for _ in range(3):
                assert [bytes(g) for g in sc.get(lid, keys)] == blocks
    wait_for(lambda: counters(daemon)["sessions"] == 0, "the session to close")
    assert counters(daemon).get("leases_reclaimed", 0) == 0, "a lease was left for the session's end"


# -- the session stream -------------------------------------------------------------------------

def test_ending_the_session_stream_makes_the_daemon_reclaim_its_grants(daemon) -> None:
    t = Transport(daemon.socket, timeout=10)
    try:
        assert not t.session.alive
        assert len(register_and_allocate(t, keys_for(3, b"g"))) == 3
        assert t.session.alive and counters(daemon)["sessions"] == 1
        t.session.close()
        assert not t.session.alive and t.session.session_id == 0
        wait_for(lambda: counters(daemon)["sessions"] == 0, "the daemon to close the session")
        assert counters(daemon)["grants_reclaimed"] == 3
    finally:
        t.close()


def test_ending_the_async_session_stream_makes_the_daemon_reclaim_its_grants(daemon) -> None:
    async def go() -> None:
        at = AsyncTransport(daemon.socket, timeout=10)
        try:
            reg = await at.run(at.register_layout(node_pb2.RegisterLayoutRequest(
                layout=layout_to_proto(LAYOUT, node_pb2.LayoutSpec))))
            sid = await at.session.open()
            assert await at.session.open() == sid  # held, not reopened
            reply = await at.run(at.allocate(node_pb2.AllocateRequest(
                session_id=sid, layout_id=reg.layout_id, keys=keys_for(2, b"a"))))
            assert [g.status for g in reply.grants] == [node_pb2.GRANTED] * 2
            at.session.close()  # the channel stays open: the stream alone ends
            assert not at.session.alive and at.session.session_id == 0
            deadline = time.monotonic() + 10
            while (await at.run(at.stats(node_pb2.StatsRequest()))).sessions:
                assert time.monotonic() < deadline, "the daemon kept the session"
                await asyncio.sleep(0.02)
        finally:
            await at.close()

    asyncio.run(go())
    assert counters(daemon)["grants_reclaimed"] == 2


# -- daemon restarts ----------------------------------------------------------------------------

def _refusal() -> KvtierError:
    return FailedPrecondition("session 1 is not open")


def test_a_restart_is_told_from_a_refusal_by_the_daemons_epoch(start_daemon) -> None:
    a = start_daemon(name="a")
    b = start_daemon(name="b")
    ta, tb = Transport(a.socket, timeout=10), Transport(b.socket, timeout=10)
    try:
        ta.session.open()
        assert ta.session.epoch and ta.session.alive
        # the daemon the session lives on answers with its epoch: a refusal, the session stays
        assert ta.run(ta.restarted(_refusal(), ta.session)) is False
        # another daemon (another epoch) answering for the session's target: a restart
        assert tb.run(tb.restarted(_refusal(), ta.session)) is True
        assert ta.run(ta.restarted(Unavailable("no daemon"), ta.session)) is True
        a.stop()  # the daemon goes: the session's stream ends
        wait_for(lambda: not ta.session.alive, "the session stream to end with its daemon")
        a.start()
        assert ta.run(ta.restarted(_refusal(), ta.session)) is True
    finally:
        ta.close()
        tb.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_sidecars_come_back_after_a_daemon_is_killed(start_daemon, kind: str) -> None:
    """kill -9 right after a get (its release possibly still in flight, never answered): the next
    get re-registers, opens a session on the new daemon and serves its blocks."""
    d = start_daemon()
    keys, blocks = keys_for(2, b"k"), [b"\x01" * BLOCK, b"\x02" * BLOCK]

    def restart() -> None:
        d.kill()
        d.start()

    async def async_client() -> tuple[int, int, int, int]:
        async with AsyncSidecar(d.socket, timeout=20) as sc:
            lid = await sc.register_layout(LAYOUT)
            await sc.put(lid, keys, blocks)
            await sc.get(lid, keys)
            before = (sc.epoch, sc.session_id)
            restart()
            assert await sc.get(lid, keys) == [None, None]  # host memory went with the daemon
            await sc.put(lid, keys, blocks)
            assert [bytes(g) for g in await sc.get(lid, keys)] == blocks
            return (*before, sc.epoch, sc.session_id)

    if kind == "async":
        epoch, sid, new_epoch, new_sid = asyncio.run(async_client())
    else:
        with Sidecar(d.socket, timeout=20) as sc:
            lid = sc.register_layout(LAYOUT)
            sc.put(lid, keys, blocks)
            sc.get(lid, keys)
            epoch, sid = sc.epoch, sc.session_id
            restart()
            assert sc.get(lid, keys) == [None, None]
            sc.put(lid, keys, blocks)
            assert [bytes(g) for g in sc.get(lid, keys)] == blocks
            new_epoch, new_sid = sc.epoch, sc.session_id
    assert new_epoch != epoch and new_sid not in (0, sid)
    assert os.path.exists(d.socket)


# -- typed calls ------------------------------------------------------------------------------

def test_typed_calls_send_their_stubs_method_and_a_blocking_run_never_suspends(daemon) -> None:
    """Each typed method sends the RPC it is named after, through the ``_unary`` seam, as the
    stub's own method on the transport's channel; the blocking transport runs a coroutine of
    them without an event loop, and refuses one that would suspend."""
    t = Transport(daemon.socket, timeout=10)
    try:
        sent = []
        unary = t._unary

        async def seen(call):
            sent.append(call)
            return await unary(call)

        t._unary = seen
        assert t.run(t.stats()).epoch
        assert t.run(t.register_layout(node_pb2.RegisterLayoutRequest(
            layout=layout_to_proto(LAYOUT, node_pb2.LayoutSpec)))).layout_id
        assert [(c.method, c.rpc) for c in sent] == [("Stats", t._node.Stats),
                                                    ("RegisterLayout", t._node.RegisterLayout)]

        async def suspends() -> None:
            await asyncio.sleep(0)

        with pytest.raises(RuntimeError, match="suspended"):
            t.run(suspends())
    finally:
        t.close()

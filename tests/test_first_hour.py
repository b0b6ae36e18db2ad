"""An engine's first hour with kvtierd, against real daemons: a wrong socket or a daemon that is
gone fails the next call at once, naming the socket and how to start the daemon (Sidecar,
AsyncSidecar and KVConnector alike: one transport), lookups included; after a kill -9, lookups
stop answering from the dead daemon's key table as soon as its session stream is seen closed;
after a restart only the new daemon's table is read.

Every client call that could hang runs through :func:`outcome`, in a thread with a deadline: a
call that hangs fails the test ("still blocked") instead of hanging the suite."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.client import AsyncSidecar, Sidecar
from kvtier.client.engine import DeadlineExceeded, KVConnector, SharedKVArena, Unavailable
from kvtier.client.engine.transport import AsyncTransport
from kvtier.tiers.layout import Layout

BLOCK = 4096
LAYOUT = Layout.flat(BLOCK)
FAST_S = 3.0    # "at once": a missing or refusing socket needs no timeout (a hang takes the 60 s timeout;
                # 3 s leaves a loaded CI machine room to start threads and channels)
BLOCKED_S = 10  # a call still running after this is a hang (the clients' timeout is 60 s)
REFUSED = "the daemon stopped or was killed"  # what a killed daemon's socket says
KV_LAYOUT = Layout.vllm(num_layers=1, num_blocks=8, block_tokens=16, kv_heads=1, head_dim=16, dtype="float16")


def keys_for(n: int, tag: bytes = b"f") -> list[bytes]:
    return [tag * 8 + i.to_bytes(8, "big") for i in range(n)]


def outcome(fn: Callable[[], Any], limit: float = BLOCKED_S) -> tuple[float, Any, BaseException | None]:
    """Run ``fn`` in a thread: (seconds, result, exception); fails the test if it is still
    running after ``limit`` seconds."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    started = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"still blocked after {limit} s"
    return time.monotonic() - started, box.get("result"), box.get("error")


def assert_unavailable_at_once(fn: Callable[[], Any], socket: str, *also: str) -> Unavailable:
    took, result, error = outcome(fn)
    assert isinstance(error, Unavailable), f"{took:.2f} s: expected Unavailable, got {error!r} / {result!r}"
    assert took < FAST_S, f"took {took:.2f} s: {error}"
    msg = str(error)
    for want in (socket, "is kvtierd running?", f"kvtierd --socket {socket}", "KVTIER_SOCKET", *also):
        assert want in msg, f"{want!r} not in: {msg}"
    return error


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while not cond():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - started


def connector_register(path: str, ring_dir: str) -> int:
    return connector_register_with_timeout(path, ring_dir, 60.0)


def connector_register_with_timeout(path: str, ring_dir: str, timeout: float) -> int:
    arena = SharedKVArena(KV_LAYOUT, ring_dir)
    conn = KVConnector(path, ring_dir=ring_dir, ring_slots=4, timeout=timeout)
    try:
        return conn.register(KV_LAYOUT, arena.tensors)
    finally:
        try:
            conn.close()
        finally:
            arena.close()


# -- a wrong socket ------------------------------------------------------------------------------

def _async(coro_fn: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: asyncio.run(coro_fn())


def _register_async(path: str) -> Callable[[], Any]:
    async def go() -> int:
        async with AsyncSidecar(path) as sc:
            return await sc.register_layout(LAYOUT)

    return _async(go)


def _register_sync(path: str) -> Callable[[], Any]:
    def go() -> int:
        with Sidecar(path) as sc:
            return sc.register_layout(LAYOUT)

    return go


@pytest.mark.parametrize("client", ["sidecar", "async", "connector"])
def test_a_wrong_socket_fails_at_once_naming_it(tmp_path, client: str) -> None:
    """register_layout fails at once, naming the path (not after the whole 60 s timeout with a
    bare DEADLINE_EXCEEDED); the connector's session does not wait forever."""
    wrong = str(tmp_path / "wrong" / "path.sock")
    if client == "sidecar":
        call = _register_sync(wrong)
    elif client == "async":
        call = _register_async(wrong)
    else:
        pytest.importorskip("torch")
        call = lambda: connector_register(wrong, str(tmp_path))  # noqa: E731
    err = assert_unavailable_at_once(call, wrong, "no daemon socket")
    assert f"directory {tmp_path / 'wrong'} does not exist" in str(err)
    if client == "connector":
        assert [p.name for p in tmp_path.iterdir()] == [], "the event ring was left behind"


def test_no_daemon_says_where_the_socket_path_came_from(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    default = str(tmp_path / "kvtier" / "kvtierd.sock")
    assert_unavailable_at_once(lambda: Sidecar(timeout=5).stats(), default, "the default path")
    env = str(tmp_path / "env.sock")
    monkeypatch.setenv("KVTIER_SOCKET", env)
    assert_unavailable_at_once(lambda: Sidecar(timeout=5).stats(), env, "from $KVTIER_SOCKET")
    not_a_socket = tmp_path / "file.sock"
    not_a_socket.write_text("")
    assert_unavailable_at_once(lambda: Sidecar(str(not_a_socket), timeout=5).stats(), str(not_a_socket),
                               "is not a socket")


def test_a_socket_that_never_answers_is_waited_for_at_most_the_timeout(tmp_path) -> None:
    """Something accepts connections but never answers (a stuck daemon): opening a session waits
    at most the client's timeout (the stream itself has no deadline), and says where."""
    pytest.importorskip("torch")
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as silent:
        silent.bind(path)
        silent.listen()
        took, _, error = outcome(lambda: connector_register_with_timeout(path, str(tmp_path), 0.5))
        assert isinstance(error, DeadlineExceeded) and 0.4 < took < 3, (took, error)
        assert f"unix:{path}" in str(error) and "open a session" in str(error)

        async def go() -> None:
            t = AsyncTransport(path, timeout=0.5)
            try:
                await t.session.open()
            finally:
                await t.close()

        took, _, error = outcome(lambda: asyncio.run(go()))
        assert isinstance(error, DeadlineExceeded) and 0.4 < took < 3, (took, error)
        assert f"unix:{path}" in str(error)


# -- a killed daemon -------------------------------------------------------------------------------

def test_a_killed_daemon_fails_the_sidecars_next_calls_at_once(start_daemon) -> None:
    """After a kill -9, get fails at once (not after the whole timeout), and put and a new
    session do not wait forever."""
    d = start_daemon()
    keys, blocks = keys_for(2), [b"\x01" * BLOCK, b"\x02" * BLOCK]
    sc = Sidecar(d.socket)
    try:
        lid = sc.register_layout(LAYOUT)
        sc.put(lid, keys, blocks)
        assert [bytes(g) for g in sc.get(lid, keys)] == blocks
        d.kill()
        for call in (lambda: sc.get(lid, keys), lambda: sc.put(lid, keys, blocks), sc.stats,
                     lambda: sc.lookup(lid, keys), lambda: sc.register_layout(Layout.flat(2 * BLOCK)),
                     _register_sync(d.socket)):  # (the last: a new client)
            assert_unavailable_at_once(call, d.socket, REFUSED)
        took, _, error = outcome(sc.close)
        assert error is None and took < FAST_S
    finally:
        sc.close()


def test_a_killed_daemon_fails_the_async_sidecars_next_calls_at_once(start_daemon) -> None:
    d = start_daemon()
    keys, blocks = keys_for(2), [b"\x01" * BLOCK, b"\x02" * BLOCK]

    async def go() -> None:
        async with AsyncSidecar(d.socket) as sc:
            lid = await sc.register_layout(LAYOUT)
            await sc.put(lid, keys, blocks)
            assert [bytes(g) for g in await sc.get(lid, keys)] == blocks
            d.kill()
            for name, call in (("get", lambda: sc.get(lid, keys)), ("put", lambda: sc.put(lid, keys, blocks)),
                               ("stats", sc.stats)):
                started = time.monotonic()
                with pytest.raises(Unavailable) as e:
                    await asyncio.wait_for(call(), BLOCKED_S)
                took = time.monotonic() - started
                assert took < FAST_S, f"{name} took {took:.2f} s"
                assert d.socket in str(e.value) and REFUSED in str(e.value) and "kvtierd --socket" in str(e.value)

    took, _, error = outcome(lambda: asyncio.run(go()), limit=4 * BLOCKED_S)
    assert error is None, repr(error)
    assert_unavailable_at_once(_register_async(d.socket), d.socket, REFUSED)


@contextlib.contextmanager
def host_connector(socket: str, tmp_path) -> Iterator[tuple[KVConnector, SharedKVArena, Any]]:
    """A KV connector on the host copy engine over a shared-memory arena of KV_LAYOUT, its
    event rings in ``tmp_path/rings``; closed (connector, then arena) on the way out."""
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    arena = SharedKVArena(KV_LAYOUT, str(tmp_path))
    conn = KVConnector(socket, ring_dir=str(ring_dir), ring_slots=4)
    try:
        yield conn, arena, ring_dir
    finally:
        conn.close()
        arena.close()


def test_a_killed_daemon_fails_the_connectors_next_calls_at_once(start_daemon, tmp_path) -> None:
    pytest.importorskip("torch")
    d = start_daemon("--copy-engine", "host")
    with host_connector(d.socket, tmp_path) as (conn, arena, ring_dir):
        conn.register(KV_LAYOUT, arena.tensors)
        assert conn.offload(keys_for(2, b"c"), [0, 1]).wait() == ["copied"] * 2
        d.kill()
        assert_unavailable_at_once(lambda: conn.onboard(keys_for(2, b"c"), [2, 3]).wait(), d.socket, REFUSED)
        # a new connector: its session is refused at once, and leaves no event ring behind
        assert_unavailable_at_once(lambda: connector_register(d.socket, str(ring_dir)), d.socket, REFUSED)
        assert [p.name for p in ring_dir.iterdir()] == []
        took, _, error = outcome(conn.close)  # the daemon that held the registration is gone: no error
        assert error is None and took < FAST_S, (took, error)


# -- lookups after a kill -9 -----------------------------------------------------------------------

def test_lookups_stop_answering_from_a_killed_daemons_table_at_once(start_daemon) -> None:
    """After a kill -9 the sidecar does not wait for the table's heartbeat to go stale (seconds):
    the first lookup after the session stream is seen closed stops reading it: it asks the
    daemon, and with none there raises Unavailable at once (as every lookup does while the
    daemon is away); the same sidecar answers again once the daemon is back."""
    d = start_daemon()
    keys = keys_for(4, b"h")
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(LAYOUT)
        sc.put(lid, keys, [bytes(BLOCK)] * 4)  # (a put opens the session in any version)
        assert sc.lookup(lid, keys) == ["host"] * 4
        assert sc._transport.session.alive
        d.kill()
        seen = wait_for(lambda: not sc._transport.session.alive, "the session stream to end with the daemon")
        assert seen < FAST_S
        assert_unavailable_at_once(lambda: sc.lookup(lid, keys), d.socket, REFUSED)  # the very next lookup
        assert_unavailable_at_once(lambda: sc.prefix_length(lid, keys), d.socket, REFUSED)

        def lookups() -> int:
            refused = 0
            for _ in range(50):
                with pytest.raises(Unavailable):
                    sc.lookup(lid, keys)
                refused += 1
            return refused

        took, refused, error = outcome(lookups)
        assert error is None and refused == 50 and took < FAST_S, (took, error)
        # the daemon comes back: the same sidecar, with nothing done by its caller, answers
        # the next lookup, and reads the new daemon's table once a session on it vouches for it
        d.start()
        assert sc.lookup(lid, keys) == [None] * 4
        assert sc.lookup(lid, keys) == [None] * 4 and sc._vouched(sc._info(lid))
        assert sc.put(lid, keys[:1], [bytes(BLOCK)]).stored == 1
        assert sc.lookup(lid, keys) == ["host"] + [None] * 3


def test_a_lookup_only_sidecar_stops_reading_a_killed_daemons_table_too(start_daemon) -> None:
    """A sidecar that only looks up (a scheduler's) holds no session from puts or gets: its
    first table lookup opens one, which vouches for the table and ends with the daemon."""
    d = start_daemon()
    keys = keys_for(3, b"o")
    with Sidecar(d.socket) as writer, Sidecar(d.socket) as reader:
        writer.put(writer.register_layout(LAYOUT), keys, [bytes(BLOCK)] * 3)
        lid = reader.register_layout(LAYOUT)
        assert reader.lookup(lid, keys) == ["host"] * 3
        d.kill()
        wait_for(lambda: not writer._transport.session.alive and not reader._transport.session.alive,
                 "the session streams to end with the daemon", timeout=FAST_S)
        assert_unavailable_at_once(lambda: reader.lookup(lid, keys), d.socket, REFUSED)
        assert_unavailable_at_once(lambda: reader.prefix_length(lid, keys), d.socket, REFUSED)


def test_async_lookups_stop_answering_from_a_killed_daemons_table_at_once(start_daemon) -> None:
    d = start_daemon()
    keys = keys_for(4, b"a")

    async def go() -> None:
        async with AsyncSidecar(d.socket) as sc:
            lid = await sc.register_layout(LAYOUT)
            await sc.put(lid, keys, [bytes(BLOCK)] * 4)
            assert await sc.lookup(lid, keys) == ["host"] * 4
            d.kill()
            deadline = time.monotonic() + FAST_S
            while sc._transport.session.alive:
                assert time.monotonic() < deadline, "the session stream outlived its daemon"
                await asyncio.sleep(0.01)
            for call in (lambda: sc.lookup(lid, keys), lambda: sc.prefix_length(lid, keys)):
                started = time.monotonic()
                with pytest.raises(Unavailable, match=REFUSED):
                    await call()
                assert time.monotonic() - started < FAST_S
            d.start()
            assert (await sc.put(lid, keys[:2], [bytes(BLOCK)] * 2)).stored == 2
            assert await sc.lookup(lid, keys) == ["host"] * 2 + [None] * 2

    took, _, error = outcome(lambda: asyncio.run(go()), limit=4 * BLOCKED_S)
    assert error is None, repr(error)


# -- after a restart ---------------------------------------------------------------------------------

def mapped(path: str) -> bool:
    with open("/proc/self/maps") as fh:
        return any(path in line for line in fh)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_after_a_quick_restart_only_the_new_daemons_table_is_read(start_daemon, tmp_path, kind: str) -> None:
    """After kill -9 and a quick restart only the two durable blocks survive (on disk): the first
    lookup answers what the new daemon holds (not "host" for all four keys, as the old table
    would), and the old table is never read again (and is unmapped)."""
    d = start_daemon("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "16MiB", host_capacity="16MiB")
    keys = keys_for(4, b"r")
    blocks = [bytes([i]) * BLOCK for i in range(4)]

    def truth() -> list[str | None]:
        with Sidecar(d.socket, use_key_table=False) as rpc:
            return rpc.lookup(rpc.register_layout(LAYOUT), keys)

    if kind == "sync":
        with Sidecar(d.socket, timeout=20) as sc:
            lid = sc.register_layout(LAYOUT)
            sc.put(lid, keys[:2], blocks[:2], durable=True)
            sc.put(lid, keys[2:], blocks[2:])
            assert sc.lookup(lid, keys) == ["host"] * 4
            old = sc._info(lid).table.path
            d.kill()
            d.start()
            assert sc.lookup(lid, keys) == ["disk", "disk", None, None] == truth()
            assert sc.prefix_length(lid, keys) == (0, 2)
            assert sc.lookup(lid, keys) == ["disk", "disk", None, None]
            info = sc._info(lid)
            assert sc._vouched(info) and info.table.path != old and sc._table_epochs[info.table.path] == sc.epoch
            assert not mapped(old), "the dead daemon's table is still mapped"
            assert [g is not None for g in sc.get(lid, keys)] == [True, True, False, False]
            assert sc.lookup(lid, keys) == ["host", "host", None, None] == truth()
        return

    async def go() -> None:
        async with AsyncSidecar(d.socket, timeout=20) as sc:
            lid = await sc.register_layout(LAYOUT)
            await sc.put(lid, keys[:2], blocks[:2], durable=True)
            await sc.put(lid, keys[2:], blocks[2:])
            assert await sc.lookup(lid, keys) == ["host"] * 4
            old = sc._info(lid).table.path
            # off the event loop, as an engine's loop keeps running: the stream's end is seen
            # by the loop (an asyncio client learns of it only while its loop runs)
            await asyncio.to_thread(d.kill)
            await asyncio.to_thread(d.start)
            assert await sc.lookup(lid, keys) == ["disk", "disk", None, None] == truth()
            assert await sc.prefix_length(lid, keys) == (0, 2)
            info = sc._info(lid)
            assert sc._vouched(info) and info.table.path != old and sc._table_epochs[info.table.path] == sc.epoch
            assert not mapped(old), "the dead daemon's table is still mapped"
            assert [g is not None for g in await sc.get(lid, keys)] == [True, True, False, False]
            assert await sc.lookup(lid, keys) == ["host", "host", None, None] == truth()

    took, _, error = outcome(lambda: asyncio.run(go()), limit=4 * BLOCKED_S)
    assert error is None, repr(error)


def test_a_table_of_another_epoch_is_never_read(start_daemon) -> None:
    """Two daemons: a sidecar whose session is on one never reads the other's table, even when
    handed it (as a restarted daemon's reply would hand a new table to a session not yet seen
    to end)."""
    a, b = start_daemon(name="a"), start_daemon(name="b")
    keys = keys_for(2, b"e")
    with Sidecar(a.socket) as sa, Sidecar(b.socket) as sb:
        la, lb = sa.register_layout(LAYOUT), sb.register_layout(LAYOUT)
        sb.put(lb, keys, [bytes(BLOCK)] * 2)  # only b holds them
        assert sb.lookup(lb, keys) == ["host"] * 2 and sa.lookup(la, keys) == [None] * 2
        info_a, info_b = sa._info(la), sb._info(lb)
        info_a.table = sa._open_table(info_b.table.path)  # b's table, a's session
        assert sa.lookup(la, keys) == [None] * 2      # answered by a, not from b's table
        assert sa.prefix_length(la, keys) == (0, 0)   # from a's own table again
        table = info_a.table
        assert table is not None and table.path != info_b.table.path
        assert sa._table_epochs[table.path] == sa.epoch != sb.epoch
    assert os.path.exists(a.socket) and os.path.exists(b.socket)


def test_a_sidecar_never_reads_a_restarted_daemons_blocks_through_the_old_pool(start_daemon) -> None:
    """A sidecar whose restart recovery failed while the daemon was down opens its next session
    on the restarted daemon: an operation on a session of another daemon epoch registers the
    layouts again first, so the new daemon's lease offsets are never read in the OLD daemon's
    pool mapping (the old bytes would come back for a key the new daemon holds with other
    bytes)."""
    d = start_daemon(host_capacity="16MiB")
    k = keys_for(1, b"r")
    with Sidecar(d.socket, timeout=2.0) as a, Sidecar(d.socket, timeout=2.0) as b:
        la, lb = a.register_layout(LAYOUT), b.register_layout(LAYOUT)
        a.put(la, k, [b"\x01" * BLOCK])
        assert bytes(b.get(lb, k)[0]) == b"\x01" * BLOCK
        d.kill()
        with pytest.raises(Unavailable):
            b.get(lb, k)  # its recovery fails: no daemon
        d.start()
        a.get(la, k)  # a recovers on the new daemon (which lost the block)
        a.put(la, k, [b"\x02" * BLOCK])
        got = b.get(lb, k)[0]
        assert got is not None and bytes(got) == b"\x02" * BLOCK


def test_one_layout_id_everywhere(start_daemon, tmp_path) -> None:
    """One layout id, the daemon's (from the layout's fingerprint): register_layout's,
    KVConnector.register's and `kvtier stats`' agree for the same daemon, and survive a
    restart."""
    pytest.importorskip("torch")
    d = start_daemon("--copy-engine", "host")
    with host_connector(d.socket, tmp_path) as (conn, arena, _), Sidecar(d.socket) as sc:
        lid = sc.register_layout(KV_LAYOUT)
        assert conn.register(KV_LAYOUT, arena.tensors) == lid
        assert [layout["layout_id"] for layout in sc.stats()["layouts"]] == [lid]
        assert conn.offload(keys_for(2, b"i"), [0, 1]).wait() == ["copied"] * 2
        assert sc.lookup(lid, keys_for(2, b"i")) == ["host"] * 2  # the connector's id works here

"""A big put or get through the sidecar is a pipeline of pieces (client/engine/sidecar.py
``_pieces``): the next piece's Allocate (Acquire) is in flight while a piece is copied, and a
piece's Commit while the next is copied; the call still returns only when every piece is
committed, counts per key, and a retry after a daemon restart counts each key once.
Real daemons; the transport's call seams only record (and, once, kill the daemon)."""

from __future__ import annotations

import pytest

from kvtier.client.engine import sidecar as sidecar_mod
from kvtier.client.engine.sidecar import InvalidArgument, Sidecar
from kvtier.tiers.layout import Layout

BLOCK = 2 << 20
N = 16  # 32 MiB: four pieces of 8 MiB


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"pipeline"


def blocks(lo: int, hi: int) -> list[bytes]:
    return [bytes([i % 251]) * 64 + bytes(BLOCK - 64) for i in range(lo, hi)]


@pytest.fixture(autouse=True)
def _pieces_of_8mib(monkeypatch) -> None:
    """The pipeline at the sizes it was built with (by default only batches of 256 MiB or
    more are pieces now: client/engine/sidecar.py ``PIPELINE_MIN_BYTES``)."""
    monkeypatch.setattr(sidecar_mod, "PIPELINE_MIN_BYTES", 16 << 20)
    monkeypatch.setattr(sidecar_mod, "PIPELINE_PIECE_BYTES", 8 << 20)


def _record(sc: Sidecar, log: list) -> None:
    """Log each call as it is sent (method, keys or grants) and each piece copied."""
    transport = sc._transport
    start, unary = transport._start, transport._unary

    def size(call) -> int:
        req = call.request
        return len(getattr(req, "keys", ())) or len(getattr(req, "grant_ids", ()))

    def logged_start(call):
        log.append(("send", call.method, size(call)))
        return start(call)

    async def logged_unary(call):
        log.append(("send", call.method, size(call)))
        return await unary(call)

    transport._start, transport._unary = logged_start, logged_unary
    write, read = sc._write, sc._read

    def logged_write(info, reply, keys, arrs, result):
        log.append(("copy", "in", len(keys)))
        return write(info, reply, keys, arrs, result)

    def logged_read(info, reply, out):
        log.append(("copy", "out", len(reply.leases)))
        return read(info, reply, out)

    sc._write, sc._read = logged_write, logged_read


def test_a_big_put_and_get_overlap_their_calls_with_the_copies(start_daemon) -> None:
    assert sidecar_mod._pieces(N, N * BLOCK) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    d = start_daemon(host_capacity="64MiB")
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, [key(i) for i in range(4)], blocks(0, 4)).stored == 4
        log: list = []
        _record(sc, log)
        r = sc.put(lid, [key(i) for i in range(N)], blocks(0, N))
        assert (r.stored, r.present, r.dropped) == (N - 4, 4, []), r
        puts = [e for e in log if e[1] in ("Allocate", "Commit", "in")]
        # the next piece's Allocate is sent before a piece is copied, its Commit right after (piece
        # 0 was all present: nothing to commit); the copies never wait for a Commit's answer
        a, c, w = ("send", "Allocate", 4), ("send", "Commit", 4), ("copy", "in", 4)
        assert puts == [a, a, w, a, w, c, a, w, c, w, c], puts
        assert sc.lookup(lid, [key(i) for i in range(N)]) == ["host"] * N  # committed when put returned
        log.clear()
        got = sc.get(lid, [key(i) for i in range(N)] + [key(99 + i) for i in range(4)])
        gets = [e for e in log if e[1] in ("Acquire", "out")]
        assert gets[:3] == [("send", "Acquire", 5), ("send", "Acquire", 5), ("copy", "out", 5)], gets
        assert [bytes(g[:64]) if g is not None else None for g in got] == \
            [b[:64] for b in blocks(0, N)] + [None] * 4
        with pytest.raises(InvalidArgument, match="3 output buffers for 20 keys"):
            sc.get(lid, [key(i) for i in range(N + 4)], out=[bytearray(BLOCK)] * 3)
        # a key twice, in different pieces: refused whole, before any call, as one batch is
        log.clear()
        with pytest.raises(InvalidArgument, match="appears more than once in one batch"):
            sc.put(lid, [key(100 + i) for i in range(N - 1)] + [key(100)], blocks(0, N))
        assert log == [] and sc.lookup(lid, [key(100)]) == [None]


def test_a_pipelined_put_retried_after_a_restart_counts_each_key_once(start_daemon, tmp_path) -> None:
    """kill -9 and restart between two pieces (as the second piece's Commit is sent): the retry
    runs the whole put again; each key is counted once, stored or present, and all are durable."""
    d = start_daemon("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "128MiB", host_capacity="64MiB")
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, [key(i) for i in range(2)], blocks(0, 2), durable=True).durable == 2
        transport, commits = sc._transport, []
        start = transport._start

        def kill_at_the_second_commit(call):
            if call.method == "Commit":
                commits.append(call)
                if len(commits) == 2:
                    d.kill()
                    d.start()
            return start(call)

        transport._start = kill_at_the_second_commit
        r = sc.put(lid, [key(i) for i in range(N)], blocks(0, N), durable=True)
        assert len(commits) >= 2, "the put never reached its second piece's Commit"
        assert r.stored + r.present == N and r.dropped == [] and r.durable == N, r
        assert r.present >= 2
        assert None not in sc.lookup(lid, [key(i) for i in range(N)])


def test_the_asyncio_sidecar_pipelines_the_same(start_daemon) -> None:
    """The same pieces through AsyncSidecar (its transport's start_* calls and their replies)."""
    import asyncio

    from kvtier.client.engine.sidecar import AsyncSidecar

    d = start_daemon(host_capacity="64MiB")

    async def run() -> None:
        sc = AsyncSidecar(d.socket)
        try:
            lid = await sc.register_layout(Layout.flat(BLOCK))
            started: list[str] = []
            start = sc._transport._start
            sc._transport._start = lambda call: started.append(call.method) or start(call)
            r = await sc.put(lid, [key(i) for i in range(N)], blocks(0, N))
            got = await sc.get(lid, [key(i) for i in range(N)])
            assert (r.stored, r.present, r.dropped) == (N, 0, []), r
            assert [bytes(g[:64]) for g in got] == [b[:64] for b in blocks(0, N)]
            assert started.count("Allocate") == 3 and started.count("Commit") == 4 and started.count("Acquire") == 3
        finally:
            await sc.close()

    asyncio.run(run())

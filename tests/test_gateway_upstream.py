# ruff: noqa: F811  (the fixtures imported from test_gateway are arguments here)
"""The gateway's client to its replicas (:mod:`kvtier.client.gateway.upstream`) against real
local HTTP servers: aiohttp apps, and raw asyncio servers where a replica must misbehave at the
byte level (close a kept-alive connection as a request arrives, stall mid-answer). Both the
client alone and the gateway in front of such replicas."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from _wait import wait_for
from test_gateway import (  # noqa: F401 (fixtures)
    PLAIN,
    REPLICA_HEADER,
    Loop,
    backend,
    chat,
    gateway,
    loop,
    post,
    tokenizer_dir,
)

from kvtier.client.gateway.upstream import AiohttpUpstream, Replica, Upstream, UpstreamError

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

# pieces with CRLFs, bytes that are not UTF-8, a chunk-size-looking line and an empty write
PIECES = [b'data: {"a":1}\r\n\r\n', b"\x00\xff\xfe 0\r\n\r\n", b"", b"5\r\nhello\r\n", b"x" * 70000, b"end"]


def streaming_app(seen_peers: list | None = None) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        if seen_peers is not None:
            seen_peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Up": "1"})
        await resp.prepare(request)  # (no length: chunked)
        for p in PIECES:
            await resp.write(p)
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    async def plain(request: web.Request) -> web.Response:
        await request.read()
        if seen_peers is not None:
            seen_peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=PLAIN, content_type="application/json")

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/plain", plain)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _all(answer) -> bytes:
    out = bytearray()
    try:
        while chunk := await answer.readany():
            out += chunk
    finally:
        answer.release()
    return bytes(out)


def test_a_chunked_answer_arrives_byte_for_byte() -> None:
    async def main() -> None:
        runner, base = await _serve(streaming_app())
        up = Upstream(2.0, 5.0)
        try:
            a = await up.post(Replica(base), b"/stream", b"Content-Type: application/json\r\n", b"{}")
            assert a.status == 200 and a.content_length is None and a.header("x-up") == "1"
            assert ("Transfer-Encoding", "chunked") in a.headers
            assert await _all(a) == b"".join(PIECES)
            a = await up.post(Replica(base), b"/plain", b"", b"{}")
            assert a.content_length == len(PLAIN) and await _all(a) == PLAIN
        finally:
            await up.close()
            await runner.cleanup()

    asyncio.run(main())


def test_kept_alive_connections_are_reused() -> None:
    async def main() -> None:
        peers: list = []
        runner, base = await _serve(streaming_app(peers))
        up = Upstream(2.0, 5.0)
        r = Replica(base)
        try:
            for i in range(10):
                a = await up.post(r, b"/stream" if i % 2 else b"/plain", b"", b"{}")
                await _all(a)
            assert up.connects == 1 and len(set(peers)) == 1 and up.idle_count(r) == 1
            # answers in flight at once: a connection each, all kept for later
            answers = await asyncio.gather(*(up.post(r, b"/stream", b"", b"{}") for _ in range(4)))
            assert [await _all(a) for a in answers] == [b"".join(PIECES)] * 4
            assert up.connects == 4 and up.idle_count(r) == 4
            # one not read to its end is not put back: its connection is closed
            a = await up.post(r, b"/stream", b"", b"{}")
            assert await a.readany()
            a.release()
            assert up.idle_count(r) == 3
        finally:
            await up.close()
            await runner.cleanup()

    asyncio.run(main())


class ClosingReplica:
    """A raw HTTP/1.1 replica that answers the first request of each connection (keep-alive) and
    closes the connection when the next one arrives on it, unanswered: as a server that drops an
    idle connection just as the client sends on it."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                n += 1
                if n > 1:
                    return  # (closed unanswered)
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(PLAIN), PLAIN))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_a_kept_alive_connection_the_replica_drops_is_retried_on_a_new_one(loop, gateway) -> None:
    """The replica closes a pooled connection as the next request goes out on it: the request is
    sent again on a new connection, the client gets its answer, the replica is not marked down."""
    rep = ClosingReplica()

    async def start() -> int:
        server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
        return server.sockets[0].getsockname()[1]

    port = loop.run(start())
    url, gw = gateway({"a": f"http://127.0.0.1:{port}"})
    for i in range(4):
        status, body, headers = post(url + "/v1/chat/completions", chat(5 + i))
        assert (status, body, headers[REPLICA_HEADER]) == (200, PLAIN, "a")
    assert rep.answered == 4 and rep.connections == 4
    assert "a" not in gw.down_until
    assert 'reason="replica_refused"' not in gw.metrics.render().decode()

    # the client alone: the same, and a fresh connection closed unanswered is the replica refusing
    async def alone() -> None:
        up = Upstream(2.0, 5.0)
        r = Replica(f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):
                assert await _all(await up.post(r, b"/v1/chat/completions", b"", b"{}")) == PLAIN
        finally:
            await up.close()

    loop.run(alone())
    assert rep.answered == 7


def test_a_5xx_before_the_first_byte_goes_to_the_next_replica(loop, gateway) -> None:
    seen: list = []
    five = f"http://127.0.0.1:{loop.serve(backend('five', seen, status=503))}"
    good = f"http://127.0.0.1:{loop.serve(backend('good', seen))}"
    url, gw = gateway({"five": five, "good": good}, policy="round-robin")
    answered = []
    for i in range(4):
        status, body, headers = post(url + "/v1/chat/completions", chat(5 + i, stream=bool(i % 2)))
        assert status == 200
        answered.append(headers[REPLICA_HEADER])
    assert set(answered) == {"good"} and "five" in gw.down_until
    assert [s[0] for s in seen].count("five") == 1  # tried once, then skipped for --down-s
    # every replica answering 5xx: the client gets the last answer as it was
    url, _ = gateway({"five": five})
    status, body, headers = post(url + "/v1/chat/completions", chat(5))
    assert (status, json.loads(body)) == (503, {"error": {"message": "boom"}})


class StallingReplica:
    """A raw replica that stalls: ``before`` the status line, or ``mid`` the body."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.where == "mid":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             b"\r\n5\r\ndata:\r\n")
            await reader.read()  # (until the client closes)
        finally:
            self.closed.set()
            writer.close()


def test_a_replica_silent_past_the_read_timeout_fails_the_read() -> None:
    async def main() -> None:
        for where in ("before", "mid"):
            rep = StallingReplica(where)
            server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
            up = Upstream(2.0, 0.3)
            r = Replica(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            try:
                if where == "before":
                    with pytest.raises(asyncio.TimeoutError):
                        await up.post(r, b"/", b"", b"{}")
                else:
                    a = await up.post(r, b"/", b"", b"{}")
                    assert await a.readany() == b"data:"
                    with pytest.raises(asyncio.TimeoutError):
                        await a.readany()
                    a.release()
                assert 0.25 < loop.time() - t0 < 3
                await asyncio.wait_for(rep.closed.wait(), 5)  # the replica sees its client go
                assert up.idle_count(r) == 0
            finally:
                await up.close()
                server.close()
        # the head's own bound (--first-byte-timeout-s), shorter than the read timeout
        rep = StallingReplica("before")
        server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
        up = Upstream(2.0, 60.0)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.TimeoutError):
            await up.post(Replica(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"), b"/", b"", b"{}", 0.3)
        assert asyncio.get_running_loop().time() - t0 < 3
        await up.close()
        server.close()

    asyncio.run(main())


def test_a_replica_silent_past_the_read_timeout_through_the_gateway(loop, gateway) -> None:
    """Silent before its status line: the next replica answers. Silent mid-answer: the client's
    answer is cut off (not completed) and counted upstream_broken."""
    seen: list = []
    stalls = {w: StallingReplica(w) for w in ("before", "mid")}

    async def start(rep: StallingReplica) -> str:
        server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    silent = loop.run(start(stalls["before"]))
    good = f"http://127.0.0.1:{loop.serve(backend('good', seen))}"
    url, gw = gateway({"silent": silent, "good": good}, policy="round-robin", read_timeout_s=0.3)
    for i in range(2):
        t0 = time.monotonic()
        status, body, headers = post(url + "/v1/chat/completions", chat(5 + i))
        assert (status, body, headers[REPLICA_HEADER]) == (200, PLAIN, "good")
        assert time.monotonic() - t0 < 3
    assert "silent" in gw.down_until

    url, gw = gateway({"mid": loop.run(start(stalls["mid"]))}, read_timeout_s=0.3)
    import http.client  # noqa: PLC0415

    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("POST", "/v1/chat/completions", json.dumps(chat(5, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    t0 = time.monotonic()
    with pytest.raises(http.client.IncompleteRead) as e:
        r.read()
    assert e.value.partial == b"data:" and time.monotonic() - t0 < 3
    wait_for(lambda: 'kvtier_gateway_errors_total{reason="upstream_broken"} 1.0' in gw.metrics.render().decode(),
             what="counted upstream_broken")


def test_unreachable_replicas_raise_upstream_errors() -> None:
    async def main() -> None:
        import socket  # noqa: PLC0415

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there: refused
        up = Upstream(2.0, 5.0)
        with pytest.raises(UpstreamError):
            await up.post(Replica(f"http://127.0.0.1:{port}"), b"/", b"", b"{}")
        await up.close()

    asyncio.run(main())


def test_replicas_the_lean_client_does_not_serve_go_through_aiohttp() -> None:
    """A replica URL with credentials (as https ones) is served by aiohttp's client, with the
    same answers: the body byte for byte, its credentials sent as basic auth."""
    seen: list = []

    async def main() -> None:
        app = streaming_app()

        async def auth(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization"))
            return web.Response(body=PLAIN, content_type="application/json")

        app.router.add_post("/auth", auth)
        runner, base = await _serve(app)
        r = Replica(base.replace("http://", "http://user:pw@"))
        assert not r.plain and Replica(base).plain and not Replica("https://10.0.0.1:8000").plain
        up = AiohttpUpstream(2.0, 5.0)
        try:
            a = await up.post(r, b"/stream", b"X-Test: 1\r\n", b"{}", 5.0)
            assert a.status == 200 and a.header("X-Up") == "1" and await _all(a) == b"".join(PIECES)
            assert await _all(await up.post(r, b"/auth", b"", b"{}")) == PLAIN
            assert seen == ["Basic dXNlcjpwdw=="]
        finally:
            await up.close()
            await runner.cleanup()

    asyncio.run(main())

# ruff: noqa: F811  (the fixtures imported from test_gateway are arguments here)
"""``kvtier gateway`` under clients and replicas that misbehave.

Each test starts the gateway as ``kvtier gateway`` serves it (its runner, on a real loopback
socket) in front of small aiohttp replicas written here (stand-ins for engine servers, no part
of kvtier), and drives it with raw sockets where a client must misbehave: one that leaves
mid-request, one that stops reading a stream, many large bodies at once; a replica whose error
body is huge; a kvtierd that stops answering its handshake while a prefetch needs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import pytest
from _wait import wait_for
from test_gateway import (  # noqa: F401 (fixtures)
    HOLDER_QUEUED,
    PLAIN,
    Loop,
    chat,
    gateway,
    loop,
    peers,
    post,
    tokenizer_dir,
)

from kvtier.client.gateway.server import MAX_ERROR_BODY, Gateway

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def serve_replica(loop: Loop, handle) -> str:
    """A stand-in replica whose handler is cancelled when the gateway drops its connection."""
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", handle)
    return f"http://127.0.0.1:{loop.serve(app, handler_cancellation=True)}"


def raw_post(url: str, body: bytes, rcvbuf: int = 0, sndbuf: int = 0, send: bool = True) -> socket.socket:
    """A client on a bare socket: POSTs ``body`` to the chat endpoint (headers only unless ``send``)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if sndbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    if send:
        s.sendall(body)
    return s


def metric(gw: Gateway, pattern: str) -> float:
    m = re.search("^" + pattern + r" (\S+)$", gw.metrics.render().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def released(gw: Gateway, name: str) -> bool:
    """Nothing held for a request any more: its forwarding slot, the replica's load, body bytes."""
    return (gw._slots._value == gw.cfg.max_concurrency and gw.policy.in_flight.get(name, 0) == 0
            and metric(gw, rf'kvtier_gateway_in_flight\{{replica="{name}"\}}') == 0 and gw._bodies.used == 0)


def slow_replica(events: list):
    """A replica that takes long: 30 s before a plain answer, a stream of 300 chunks 50 ms apart;
    ``events`` gets "start", then "ended" if the gateway drops its connection first."""

    async def slow(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        events.append("start")
        try:
            if not body.get("stream"):
                await asyncio.sleep(30)
                return web.Response(body=PLAIN, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(300):
                await resp.write(b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i)
                await asyncio.sleep(0.05)
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionError):
            events.append("ended")
            raise
    return slow


def test_a_client_that_leaves_before_the_answer_ends_the_replicas_request(loop, gateway) -> None:
    """A client that disconnects while the replica is still working on a plain answer has its
    handler cancelled: the replica's request is closed at once (the replica sees the
    disconnect), the slot, load and body bytes are given back, counted ``client_gone``."""
    events: list = []
    url, gw = gateway({"a": serve_replica(loop, slow_replica(events))})
    s = raw_post(url, json.dumps(chat(5)).encode())
    wait_for(lambda: events == ["start"], what="the replica working")
    s.close()
    wait_for(lambda: events == ["start", "ended"], timeout=5, what="the replica's request ended")
    wait_for(lambda: released(gw, "a"), timeout=5, what="slot and load given back")
    assert metric(gw, r'kvtier_gateway_errors_total\{reason="client_gone"\}') == 1
    assert metric(gw, r'kvtier_gateway_requests_total\{endpoint="chat",replica="a",status="client_gone"\}') == 1
    status, _, _ = post(url + "/v1/chat/completions", chat(5, stream=True))  # the gateway still serves
    assert status == 200


def test_a_client_that_leaves_mid_stream_is_counted_client_gone(loop, gateway) -> None:
    """A client that disconnects mid-stream: the replica's request is closed, and the metrics
    count ``client_gone``, not ``upstream_broken`` (the replica did nothing wrong)."""
    events: list = []
    url, gw = gateway({"a": serve_replica(loop, slow_replica(events))})
    s = raw_post(url, json.dumps(chat(5, stream=True)).encode())
    got = b""
    while b"tok0" not in got:  # mid-stream
        got += s.recv(65536)
    s.close()
    wait_for(lambda: events == ["start", "ended"], timeout=5, what="the streamed request ended")
    wait_for(lambda: released(gw, "a"), timeout=5, what="slot and load given back")
    assert metric(gw, r'kvtier_gateway_errors_total\{reason="upstream_broken"\}') == 0
    assert metric(gw, r'kvtier_gateway_errors_total\{reason="client_gone"\}') == 1
    assert metric(gw, r'kvtier_gateway_requests_total\{endpoint="chat",replica="a",status="client_gone"\}') == 1


def test_a_client_that_stops_reading_is_dropped(loop, gateway) -> None:
    """A client that never reads its streamed answer is dropped after --write-timeout-s: the
    gateway closes the replica's request and gives back what it held (counted
    ``client_stalled``), instead of waiting on the client forever."""
    events: list = []
    piece = b"data: " + b"x" * 65530 + b"\n\n"

    async def firehose(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events.append("start")
        try:
            for _ in range(8192):  # up to 512 MiB, far past every buffer on the way
                await resp.write(piece)
            events.append("all sent")
        except (asyncio.CancelledError, ConnectionError):
            events.append("ended")
            raise
        await resp.write_eof()
        return resp

    url, gw = gateway({"a": serve_replica(loop, firehose)}, write_timeout_s=0.5)
    s = raw_post(url, json.dumps(chat(5, stream=True)).encode(), rcvbuf=4096)  # and never reads
    try:
        wait_for(lambda: released(gw, "a") and events == ["start", "ended"], timeout=15,
                 what="the stalled client dropped")
        assert metric(gw, r'kvtier_gateway_errors_total\{reason="client_stalled"\}') == 1
        assert metric(gw, r'kvtier_gateway_requests_total\{endpoint="chat",replica="a",status="client_stalled"\}') == 1
        assert metric(gw, r'kvtier_gateway_errors_total\{reason="upstream_broken"\}') == 0
    finally:
        s.close()


def test_large_bodies_wait_for_room_before_they_are_read(loop, gateway) -> None:
    """Request bodies are read only when --max-body-bytes-in-flight has room for them: while one
    request holds the budget (its replica has not answered), a second client's 16 MiB body is
    not read (the client cannot send it all); once the first ends, it is read and forwarded."""
    go = threading.Event()
    seen: list = []

    async def held(request: web.Request) -> web.Response:
        raw = await request.read()
        seen.append(len(raw))
        while len(seen) == 1 and not go.is_set():
            await asyncio.sleep(0.02)
        return web.Response(body=PLAIN, content_type="application/json")

    url, gw = gateway({"a": serve_replica(loop, held)}, max_body_bytes_in_flight=1 << 20, queue_timeout_s=30)
    first = json.dumps({**chat(5), "x_pad": "p" * 800_000}).encode()
    t = threading.Thread(target=post, args=(url + "/v1/chat/completions", first))
    t.start()
    wait_for(lambda: seen == [len(first)], what="the first request at the replica")
    second = json.dumps({**chat(6), "x_pad": "q" * (16 << 20)}).encode()
    s = raw_post(url, second, sndbuf=65536, send=False)
    s.settimeout(0.2)
    sent, deadline = 0, time.monotonic() + 2.0
    while sent < len(second) and time.monotonic() < deadline:
        try:
            sent += s.send(memoryview(second)[sent:sent + (1 << 20)])
        except TimeoutError:
            pass
    try:
        assert sent < len(second) // 2, f"the gateway read {sent} bytes of a body it has no room for"
        assert gw._bodies.used == len(first)
        go.set()
        s.settimeout(20)
        s.sendall(memoryview(second)[sent:])
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        go.set()
        s.close()
        t.join(20)
    assert seen == [len(first), len(second)]
    wait_for(lambda: released(gw, "a"), timeout=5, what="the budget given back")


def test_a_client_cannot_sit_on_the_room_for_its_body(loop, gateway) -> None:
    """A client that declares a large body and sends almost nothing holds its room in
    --max-body-bytes-in-flight at most --body-timeout-s: then 408 (counted ``body_timeout``,
    no keep-alive), the room given back for the next request."""
    seen: list = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(len(await request.read()))
        return web.Response(body=PLAIN, content_type="application/json")

    url, gw = gateway({"a": serve_replica(loop, answer)}, max_body_bytes_in_flight=1 << 20, body_timeout_s=0.5,
                      queue_timeout_s=30)
    s = raw_post(url, b"x" * (1 << 20), send=False)
    try:
        s.sendall(b'{"model": "tiny", ')
        wait_for(lambda: gw._bodies.used == 1 << 20, what="the room taken")
        s.settimeout(10)
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in reply, reply[:300]
        assert b"Connection: close" in reply  # (aiohttp reads and drops the rest a while, then closes)
    finally:
        s.close()
    assert gw._bodies.used == 0
    assert metric(gw, r'kvtier_gateway_errors_total\{reason="body_timeout"\}') == 1
    status, _, _ = post(url + "/v1/chat/completions", {**chat(5), "x_pad": "p" * 900_000})
    assert status == 200 and seen and seen[0] > 900_000


def test_a_huge_replica_error_body_is_not_relayed(loop, gateway) -> None:
    """A replica answering 500 with a 32 MiB body: the gateway reads at most MAX_ERROR_BODY
    bytes of it and answers the status with its own short error; a short 5xx body still
    passes as the replica sent it."""
    big = b"e" * (1 << 20)

    async def failing(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if body.get("max_tokens") == 1:
            return web.Response(status=503, body=b'{"error":{"message":"busy"}}', content_type="application/json")
        resp = web.StreamResponse(status=500, headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        for _ in range(32):
            await resp.write(big)
        await resp.write_eof()
        return resp

    url, gw = gateway({"a": serve_replica(loop, failing)}, retries=0)
    status, body, _ = post(url + "/v1/chat/completions", chat(5))
    assert status == 500 and len(body) < MAX_ERROR_BODY, len(body)
    assert "error body over 65536 bytes" in json.loads(body)["error"]["message"]
    status, body, _ = post(url + "/v1/chat/completions", {**chat(5), "max_tokens": 1})
    assert (status, body) == (503, b'{"error":{"message":"busy"}}')
    wait_for(lambda: released(gw, "a"), timeout=5, what="the replica's load given back")


def prefix_on_loaded_a(gw: Gateway, peers: dict, start: int) -> dict:
    """A 32-block prompt whose blocks only A's host tier holds, A loaded: the router sends it to
    a free replica with a fetch hint."""
    from kvtier.client.engine.sidecar import Sidecar

    body = chat(128, start=start)
    keys = gw.keys.keys(gw.tokenizer.chat(body))
    with Sidecar(peers["daemons"]["A"].socket) as sc:
        assert not sc.put(sc.register_layout(peers["layout"]), keys, [k * (4096 // len(k)) for k in keys]).dropped
    wait_for(lambda: gw.router.route(keys, dispatch=False).ranked[0].overlap.host == len(keys), what="A's blocks")
    gw.router.set_load("A", HOLDER_QUEUED, 0)
    return body


def test_a_stuck_kvtierd_handshake_does_not_stall_the_gateway(loop, gateway, peers) -> None:
    """The prefetch channel to a replica's kvtierd over its unix socket hand-shakes with
    blocking socket calls (2 s timeout): against a stopped kvtierd (SIGSTOP) they run in a
    thread, so the gateway keeps answering while the request waits at most
    --prefetch-timeout-s for its prefetch. (Three kvtierds that are each other's peers; the
    gateway's feeds are their unix sockets.)"""
    from kvtier.client.routing.router import RouterConfig

    daemons = peers["daemons"]
    stopped = None
    try:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=PLAIN, content_type="application/json")

        urls = {n: serve_replica(loop, answer) for n in "ABC"}
        feeds = RouterConfig(daemons=tuple(f"unix:{daemons[n].socket}" for n in "ABC"))
        url, gw = gateway(urls, router=feeds, prefetch_timeout_s=0.3)
        body = prefix_on_loaded_a(gw, peers, 1000)
        d = gw.router.route(gw.keys.keys(gw.tokenizer.chat(body)), dispatch=False)
        chosen = d.ranked[0].worker
        assert chosen != "A" and d.fetch, d  # a free replica is chosen and pulls from A
        stopped = daemons[chosen].pid
        os.kill(stopped, signal.SIGSTOP)  # its credential socket accepts, and never answers

        result: list = []
        t = threading.Thread(target=lambda: result.append(post(url + "/v1/chat/completions", body)))
        t0 = time.monotonic()
        t.start()
        wait_for(lambda: metric(gw, rf'kvtier_gateway_decisions_total\{{policy="kvtier",replica="{chosen}"\}}') == 1,
                 what="the request dispatched")
        h0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            assert c.recv(1024).startswith(b"HTTP/1.1 200")
        health_s = time.monotonic() - h0
        t.join(20)
        assert result and result[0][0] == 200 and result[0][2]["X-Kvtier-Replica"] == chosen
        assert health_s < 0.5, f"/health took {health_s:.2f} s while a prefetch hand-shook"
        assert time.monotonic() - t0 < 1.5  # the request waited --prefetch-timeout-s, not the handshake
        assert metric(gw, r'kvtier_gateway_prefetches_total\{outcome="timeout"\}') == 1
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
    # the daemon back: a prefetch over the unix socket (its handshake in a thread) lands
    url, gw = gateway(urls, router=feeds, prefetch_timeout_s=10)
    status, _, headers = post(url + "/v1/chat/completions", prefix_on_loaded_a(gw, peers, 2000))
    assert status == 200 and headers["X-Kvtier-Replica"] != "A"
    assert metric(gw, r'kvtier_gateway_prefetches_total\{outcome="done"\}') == 1
    assert metric(gw, r"kvtier_gateway_prefetched_blocks_total") == 32


def test_body_budget_grants_in_order_and_gives_back_what_a_cancelled_wait_held() -> None:
    """The budget behind --max-body-bytes-in-flight: first come first served (a large body is
    not starved by small ones behind it), a body over the whole budget waits to be alone, and a
    wait that is given up (its client left, or --queue-timeout-s) takes nothing with it."""
    from kvtier.client.gateway.server import _BodyBudget

    async def run() -> None:
        b = _BodyBudget(100)
        assert await b.acquire(60) == 60
        big = asyncio.ensure_future(b.acquire(500))  # over the budget: waits until it is alone
        small = asyncio.ensure_future(b.acquire(10))  # fits, but queues behind the big one
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        b.release(60)
        assert await big == 100 and not small.done() and b.used == 100
        b.release(100)
        assert await small == 10
        late = asyncio.ensure_future(b.acquire(95))
        after = asyncio.ensure_future(b.acquire(5))
        await asyncio.sleep(0)
        late.cancel()  # the head gives up: the one behind it goes on
        assert await asyncio.wait_for(after, 1) == 5 and b.used == 15
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.acquire(90), 0.01)
        b.release(15)
        assert b.used == 0 and not b._waiters

    asyncio.run(run())


def test_bodies_parse_as_json_loads_parses_them() -> None:
    """The gateway parses bodies with orjson where it can and falls back to json: the result,
    or the error, is json's for every body, those orjson refuses included."""
    import json
    import math

    from kvtier.client.gateway.server import _loads

    bodies = [b'{"a": 1, "a": 2}', b'{"x": -0.0, "y": 0.1, "z": 1e308}', b'{"n": NaN, "i": -Infinity}',
              b'{"big": 123456789012345678901234567890}', b'{"f": 1e400}', b'{"s": "\\ud800 \\u0000 \\u00e9"}',
              b'[' * 600 + b']' * 600, '{"k": "é"}'.encode("latin-1")]
    for raw in bodies:
        try:
            want = json.loads(raw)
        except ValueError as e:
            with pytest.raises(ValueError) as err:
                _loads(raw)
            assert type(err.value) is type(e), raw[:40]
            continue
        got = _loads(raw)
        assert json.dumps(got) == json.dumps(want), raw[:40]
        if isinstance(want, dict) and "x" in want:
            assert math.copysign(1, got["x"]) == -1.0
    for bad in (b"", b"{", b'{"a": }', b"[1, 2"):
        with pytest.raises(json.JSONDecodeError):
            _loads(bad)

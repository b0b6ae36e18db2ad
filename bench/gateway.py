"""Gateway benchmark: the latency ``kvtier gateway`` adds to a request, and what it sustains.

    python bench/gateway.py [--requests 400] [--words 1024] [--block-tokens 16] [--concurrency 32]
                            [--seconds 5] [--policy kvtier] [--out FILE]

Three processes on this machine: a fast local HTTP backend (aiohttp: answers every
``/v1/chat/completions`` with a fixed 300-byte JSON body at once; it stands in for an engine
replica, so only the HTTP hops are timed), the real ``kvtier gateway`` (the CLI, ``--policy``,
the word-level test tokenizer with a chat template, two replica names both pointing at the
backend; no daemon, so the router ranks on its speculative entries), and this client
(aiohttp, keep-alive, one connection per concurrent request).

Measured:
    ``added_p50_ms``, ``added_p99_ms``: ``--requests`` chat requests (multi-turn sessions of
        ``--words`` words, each turn's prompt the previous one plus 64 new words) sent one at
        a time, each first directly to the backend and then through the gateway; the added
        latency of a request is its time through the gateway minus its time direct, and the
        figures are percentiles of those paired differences (so both see the same machine
        load). The gateway parses the body, renders the chat template, tokenizes, hashes
        the blocks (vLLM's sha256 chain and kvtier's keys), ranks, dispatches and streams the
        answer back.
    ``requests_per_s``: through the gateway, ``--concurrency`` requests in flight for
        ``--seconds`` seconds (``direct_requests_per_s``: the same against the backend alone).
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

ANSWER = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok5 tok7 tok9"},
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).encode()

BACKEND = f"""
import asyncio, sys, uvloop
from aiohttp import web
ANSWER = {ANSWER!r}
async def handle(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")
app = web.Application(client_max_size=1 << 26)
app.router.add_post("/v1/chat/completions", handle)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=lambda *a: print("ready", flush=True))
"""


def free_port() -> int:
    import socket  # noqa: PLC0415

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def requests_of(n: int, words: int, seed: int = 0) -> list[bytes]:
    """Bodies of multi-turn sessions (8 turns each), turn after turn."""
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        msgs: list[dict] = []
        text = " ".join(f"tok{rng.randrange(3, 1000)}" for _ in range(words))
        for _ in range(8):
            msgs = [*msgs, {"role": "user", "content": text}]
            out.append(json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 8}).encode())
            msgs.append({"role": "assistant", "content": "tok5 tok7 tok9"})
            text = " ".join(f"tok{rng.randrange(3, 1000)}" for _ in range(64))
    return out[:n]


async def timed(session, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t0


async def sequential(direct: str, gateway: str, bodies: list[bytes]) -> np.ndarray:
    import aiohttp  # noqa: PLC0415

    added = []
    async with aiohttp.ClientSession() as s:
        for b in bodies[:20]:  # warm both paths (connections, the tokenizer's caches)
            await timed(s, direct, b)
            await timed(s, gateway, b)
        for b in bodies:
            d = await timed(s, direct, b)
            g = await timed(s, gateway, b)
            added.append(g - d)
    return np.asarray(added)


async def throughput(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> float:
    import aiohttp  # noqa: PLC0415

    done = 0
    stop = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        async with aiohttp.ClientSession() as s:
            j = i
            while time.perf_counter() < stop:
                await timed(s, url, bodies[j % len(bodies)])
                done += 1
                j += concurrency
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--words", type=int, default=1024)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--policy", default="kvtier")
    ap.add_argument("--out")
    a = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's testsupport/
    from testsupport.tiny_tokenizer import build_tokenizer  # noqa: PLC0415

    tok = build_tokenizer(tempfile.mkdtemp(prefix="kvtier-gw-bench-"))
    bport = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", BACKEND, str(bport)], stdout=subprocess.PIPE, text=True)]
    try:
        assert procs[0].stdout.readline().strip() == "ready", "backend did not start"
        backend = f"http://127.0.0.1:{bport}"
        gw = subprocess.Popen([sys.executable, "-m", "kvtier.client.tools.cli", "gateway", "--listen", "127.0.0.1:0",
                               "--model", "tiny", "--tokenizer", tok, "--policy", a.policy, "--block-tokens",
                               str(a.block_tokens), "--replica", f"r1={backend}", "--replica", f"r2={backend}",
                               "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
        procs.append(gw)
        m = re.search(r"listening on (http://\S+?)[;,]", gw.stdout.readline())
        assert m, "gateway did not start"
        gateway = m.group(1) + "/v1/chat/completions"
        direct = backend + "/v1/chat/completions"
        bodies = requests_of(a.requests, a.words)
        added = asyncio.run(sequential(direct, gateway, bodies)) * 1e3
        rps = asyncio.run(throughput(gateway, bodies, a.concurrency, a.seconds))
        direct_rps = asyncio.run(throughput(direct, bodies, a.concurrency, a.seconds))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    emit({"added_p50_ms": round(float(np.percentile(added, 50)), 3),
          "added_p99_ms": round(float(np.percentile(added, 99)), 3),
          "added_mean_ms": round(float(added.mean()), 3),
          "requests_per_s": round(rps, 1), "direct_requests_per_s": round(direct_rps, 1),
          "requests": a.requests, "words": a.words, "block_tokens": a.block_tokens, "concurrency": a.concurrency,
          "policy": a.policy, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}, a.out)


if __name__ == "__main__":
    main()

"""Gateway benchmark: the latency ``kvtier gateway`` adds to a request, and what it sustains;
with ``--peers``, the same against the Rust routers.

    python bench/gateway.py [--requests 400] [--words 1024] [--block-tokens 16] [--concurrency 32]
                            [--seconds 5] [--new-requests 6000] [--policy kvtier] [--workers 1] [--out FILE]
    python bench/gateway.py --peers [--requests 2000] [--words 1200] [--concurrency 16] [--rounds 3]
                            [--seconds 5] [--new-requests 6000] [--workers 1] [--out FILE]

Processes on this machine: fast local HTTP backends (aiohttp: each answers every
``/v1/chat/completions`` with a fixed 300-byte JSON body at once, and the health and model
routes routers probe; they stand in for engine replicas, so only the HTTP hops are timed),
the router under test, and this client (aiohttp, keep-alive, one connection per concurrent
request). ``kvtier gateway`` runs as its CLI: the word-level test tokenizer with a chat
template, two replica names, no daemon (the router ranks on its speculative entries).

Measured, per router:
    ``added_p50_ms``, ``added_p99_ms``: ``--requests`` chat requests (multi-turn sessions of
        ``--words`` words, each turn's prompt the previous one plus 64 new words) sent one at
        a time (concurrency 1), each first directly to a backend and then through the router;
        the added latency of a request is its time through the router minus its time direct,
        and the figures are percentiles of those paired differences (so both see the same
        machine load). ``kvtier gateway --policy kvtier`` parses the body, renders the chat
        template, tokenizes and hashes what is new since the conversation's last turn (vLLM's
        sha256 chain and kvtier's keys), ranks, dispatches and streams the answer back.
    ``requests_per_s``: through the router, ``--concurrency`` requests in flight for
        ``--seconds`` seconds (``direct_requests_per_s``: the same against a backend alone).
        These go over the same bodies again and again (each request is a turn the router has
        seen before, so a router that keeps what it computed per conversation does little).
    ``requests_per_s_new``: ``--new-requests`` bodies of sessions never sent before (the same
        shape, another seed), each sent once, ``--concurrency`` in flight (a session's turns
        go out together, as the worker that takes each is free), over the time they took: every
        request is a turn the router has not seen, its new text to tokenize.

Without ``--peers``: one backend (two replica names on it) and ``kvtier gateway --policy
POLICY``; the last line of stdout is one JSON object with its figures.

With ``--peers``: two backends; the routers are ``kvtier gateway`` with ``--policy kvtier``
and ``--policy round-robin`` and, when their pip packages are installed (``pip install
'kvtier[peers]'``), vllm-router and sglang-router with ``--policy cache_aware``. Each round
starts every router fresh, one after another (the order rotated each round), and measures it;
the figures are the medians over ``--rounds`` rounds. The last line is one JSON object: the
top-level fields are ``kvtier gateway --policy kvtier``'s (as without ``--peers``),
``routers`` has each router's ``added_p50_ms``, ``added_p99_ms``, ``requests_per_s``,
``requests_per_s_new`` (and per round; a round's new sessions are the same for every router),
and ``ratios`` each peer's figures over kvtier's (``added_p50``: the peer's over kvtier's,
below 1 where the peer adds less; ``requests_per_s`` and ``requests_per_s_new``: kvtier's over
the peer's, below 1 where the peer sustains more). Routers not installed are listed in
``missing``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

ANSWER = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok5 tok7 tok9"},
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).encode()

BACKEND = f"""
import asyncio, json, sys, uvloop
from aiohttp import web
ANSWER = {ANSWER!r}
MODELS = json.dumps({{"object": "list", "data": [{{"id": "tiny", "object": "model", "owned_by": "bench"}}]}}).encode()
INFO = json.dumps({{"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True}}).encode()
async def handle(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")
async def ok(request):
    return web.Response(body=b"{{}}", content_type="application/json")
async def models(request):
    return web.Response(body=MODELS, content_type="application/json")
async def info(request):
    return web.Response(body=INFO, content_type="application/json")
app = web.Application(client_max_size=1 << 26)
app.router.add_post("/v1/chat/completions", handle)
for path in ("/health", "/health_generate", "/get_server_info", "/server_info", "/ping", "/load", "/get_load"):
    app.router.add_get(path, ok)
app.router.add_get("/v1/models", models)
app.router.add_get("/get_model_info", info)
app.router.add_get("/model_info", info)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=lambda *a: print("ready", flush=True))
"""

PEERS = {  # name -> (pip module, command given the port and worker URLs)
    "vllm-router": ("vllm_router", lambda port, urls: [
        *_entry("vllm-router", "vllm_router.launch_router"), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warning"]),
    "sglang-router": ("sglang_router", lambda port, urls: [
        *_entry("sglang-router", "sglang_router.launch_router", "launch"), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn"]),
}


def _entry(script: str, module: str, sub: str | None = None) -> list[str]:
    """The router's console script beside this Python, else its module."""
    exe = os.path.join(os.path.dirname(sys.executable), script)
    if os.path.exists(exe) or shutil.which(script):
        return [exe if os.path.exists(exe) else script, *([sub] if sub else [])]
    return [sys.executable, "-m", module]


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


async def sequential(direct: str | list[str], gateway: str, bodies: list[bytes]) -> np.ndarray:
    import aiohttp  # noqa: PLC0415

    directs = [direct] if isinstance(direct, str) else direct
    added = []
    async with aiohttp.ClientSession() as s:
        for i, b in enumerate(bodies[:20]):  # warm both paths (connections, the tokenizer's caches)
            await timed(s, directs[i % len(directs)], b)
            await timed(s, gateway, b)
        for i, b in enumerate(bodies):
            d = await timed(s, directs[i % len(directs)], b)
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


async def drain(url: str, bodies: list[bytes], concurrency: int) -> float:
    """Each body sent once, ``concurrency`` in flight; requests per second over the whole."""
    import aiohttp  # noqa: PLC0415

    async def worker(i: int) -> None:
        async with aiohttp.ClientSession() as s:
            for j in range(i, len(bodies), concurrency):
                await timed(s, url, bodies[j])
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return len(bodies) / (time.perf_counter() - t0)


def start_backend() -> tuple[subprocess.Popen, str]:
    port = free_port()
    # (stderr dropped: routers probing for HTTP/2 make aiohttp log a parse error per probe)
    p = subprocess.Popen([sys.executable, "-c", BACKEND, str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    assert p.stdout.readline().strip() == "ready", "backend did not start"
    return p, f"http://127.0.0.1:{port}"


def start_kvtier(tok: str, backends: list[str], policy: str, block_tokens: int, workers: int
                 ) -> tuple[subprocess.Popen, str]:
    names = [f"r{i + 1}={b}" for i, b in enumerate(backends if len(backends) > 1 else backends * 2)]
    args = [sys.executable, "-m", "kvtier.client.tools.cli", "gateway", "--listen", "127.0.0.1:0", "--model", "tiny",
            "--tokenizer", tok, "--policy", policy, "--block-tokens", str(block_tokens), "--log-level", "warning"]
    if workers > 1:
        args += ["--workers", str(workers)]
    for n in names:
        args += ["--replica", n]
    gw = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    m = re.search(r"listening on (http://\S+?)[;,]", gw.stdout.readline())
    assert m, "gateway did not start"
    return gw, m.group(1)


def start_peer(name: str, backends: list[str], timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(tempfile.gettempdir(), f"kvtier-bench-{name}.log"), "w")
    p = subprocess.Popen(PEERS[name][1](port, backends), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "tok3"}], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while True:  # ready: it answers a chat request through a backend
        try:
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return p, url
        except OSError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{name} did not start (exit {p.poll()}); see {log.name}")
        time.sleep(0.2)


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def measure(url: str, directs: list[str], bodies: list[bytes], concurrency: int, seconds: float,
            fresh: list[bytes]) -> dict:
    added = asyncio.run(sequential(directs, url + "/v1/chat/completions", bodies)) * 1e3
    rps = asyncio.run(throughput(url + "/v1/chat/completions", bodies, concurrency, seconds))
    out = {"added_p50_ms": round(float(np.percentile(added, 50)), 3),
           "added_p99_ms": round(float(np.percentile(added, 99)), 3),
           "added_mean_ms": round(float(added.mean()), 3), "requests_per_s": round(rps, 1)}
    if fresh:
        out["requests_per_s_new"] = round(asyncio.run(drain(url + "/v1/chat/completions", fresh, concurrency)), 1)
    return out


FIGURES = ("added_p50_ms", "added_p99_ms", "added_mean_ms", "requests_per_s", "requests_per_s_new")


def peers_run(a: argparse.Namespace, tok: str) -> dict:
    routers = ["kvtier", "kvtier-round-robin"]
    missing = []
    for name, (module, _) in PEERS.items():
        (routers if importlib.util.find_spec(module) is not None else missing).append(name)
    procs, backends = [], []
    results: dict[str, list[dict]] = {r: [] for r in routers}
    try:
        for _ in range(2):
            p, url = start_backend()
            procs.append(p)
            backends.append(url)
        directs = [b + "/v1/chat/completions" for b in backends]
        bodies = requests_of(a.requests, a.words)
        direct_rps = asyncio.run(throughput(directs[0], bodies, a.concurrency, a.seconds))
        for rnd in range(a.rounds):
            fresh = requests_of(a.new_requests, a.words, seed=1 + rnd)  # (sessions no router has seen)
            order = routers[rnd % len(routers):] + routers[:rnd % len(routers)]
            for r in order:
                if r.startswith("kvtier"):
                    policy = "round-robin" if r == "kvtier-round-robin" else "kvtier"
                    p, url = start_kvtier(tok, backends, policy, a.block_tokens, a.workers)
                else:
                    p, url = start_peer(r, backends)
                try:
                    results[r].append(measure(url, directs, bodies, a.concurrency, a.seconds, fresh))
                finally:
                    stop(p)
                print(f"round {rnd + 1} {r}: {json.dumps(results[r][-1])}", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            stop(p)
    summary = {}
    for r, runs in results.items():
        summary[r] = {k: round(float(np.median([x[k] for x in runs])), 3) for k in FIGURES if k in runs[0]}
        summary[r]["rounds"] = runs
    kv = summary["kvtier"]
    ratios = {r: {"added_p50": round(s["added_p50_ms"] / kv["added_p50_ms"], 3) if kv["added_p50_ms"] > 0 else None,
                  "added_p99": round(s["added_p99_ms"] / kv["added_p99_ms"], 3) if kv["added_p99_ms"] > 0 else None,
                  "requests_per_s": round(kv["requests_per_s"] / s["requests_per_s"], 3),
                  **({"requests_per_s_new": round(kv["requests_per_s_new"] / s["requests_per_s_new"], 3)}
                     if "requests_per_s_new" in s else {})}
              for r, s in summary.items() if r != "kvtier"}
    return {**{k: kv[k] for k in FIGURES if k in kv},
            "direct_requests_per_s": round(direct_rps, 1), "routers": summary, "ratios": ratios, "missing": missing,
            "rounds": a.rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, help="chat requests timed one at a time (default 400; --peers: 2000)")
    ap.add_argument("--words", type=int, help="words of a session's first turn (default 1024; --peers: 1200)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, help="requests in flight for requests_per_s (default 32; --peers: 16)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--new-requests", type=int, default=6000,
                    help="bodies of new sessions for requests_per_s_new, each sent once (0: not measured)")
    ap.add_argument("--policy", default="kvtier")
    ap.add_argument("--workers", type=int, default=1, help="kvtier gateway --workers")
    ap.add_argument("--peers", action="store_true", help="also vllm-router and sglang-router (cache_aware), and "
                                                         "kvtier's round-robin, in rotated rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    a.requests = a.requests or (2000 if a.peers else 400)
    a.words = a.words or (1200 if a.peers else 1024)
    a.concurrency = a.concurrency or (16 if a.peers else 32)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's testsupport/
    from testsupport.tiny_tokenizer import build_tokenizer  # noqa: PLC0415

    tok = build_tokenizer(tempfile.mkdtemp(prefix="kvtier-gw-bench-"))
    common = {"requests": a.requests, "words": a.words, "block_tokens": a.block_tokens, "concurrency": a.concurrency,
              "workers": a.workers, "cpus": os.cpu_count()}
    if a.peers:
        result = peers_run(a, tok)
        emit({**result, **common, "policy": "kvtier", "load_avg_1m": round(os.getloadavg()[0], 2)}, a.out)
        return
    procs = []
    try:
        bp, backend = start_backend()
        procs.append(bp)
        gw, url = start_kvtier(tok, [backend], a.policy, a.block_tokens, a.workers)
        procs.append(gw)
        direct = backend + "/v1/chat/completions"
        bodies = requests_of(a.requests, a.words)
        figures = measure(url, [direct], bodies, a.concurrency, a.seconds,
                          requests_of(a.new_requests, a.words, seed=1))
        direct_rps = asyncio.run(throughput(direct, bodies, a.concurrency, a.seconds))
    finally:
        for p in procs:
            stop(p)
    emit({**figures, "direct_requests_per_s": round(direct_rps, 1), **common, "policy": a.policy,
          "load_avg_1m": round(os.getloadavg()[0], 2)}, a.out)


if __name__ == "__main__":
    main()

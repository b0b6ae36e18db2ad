"""Host-tier throughput through the sidecar against a single-thread memcpy of the same bytes.

Starts a real kvtierd whose pool holds exactly the blocks moved, fills it once with other
blocks (warm-up, untimed: the state of a cache that has been running; the daemon prefaults
the pool at registration, the client maps each slot's pages on first use), then puts at least
1 GiB of distinct 2 MiB blocks in batches of 64 (each batch: Allocate RPC, which evicts the
warm-up blocks LRU-first, copy into the mapped pool taking each block's checksum on the way,
Commit RPC with the checksums), gets them all back into caller buffers (Acquire RPC, copy
out, Release RPC; the buffers are prefaulted numpy arrays, the same kind of memory as the
memcpy's destination), and times a one-key Lookup over the
unix socket (``lookup_*``: the Lookup RPC; ``shm_lookup_*``: the same call answered from the
shared-memory key table, the sidecar's default).
The limit, measured in the same run: one thread copying the same total bytes between two
prefaulted buffers (numpy, i.e. memcpy), timed batch by batch interleaved with the puts and
the gets (each put or get of a batch is followed by a copy of the same bytes), so that load
from other processes falls on both alike (``memcpy_gbps``; ``memcpy_after_gbps``: the best of
three copies of the whole after the run). A put is a pipeline of pieces (the
sidecar's): ``put_pieces`` per batch; a large batch is copied on ``copy_threads`` threads
(client/engine/copyin.py), the memcpy on one.

    python bench/host_tier.py [--gib 1] [--batch 64] [--block-mib 2] [--out FILE.json]

Last line of stdout: one JSON object (put_gbps, get_gbps, memcpy_gbps, ratio, lookup_p50_us,
lookup_p99_us, memcpy_after_gbps, put_pieces, put_cpu_gbps, put_client_cpu_gbps, memcpy_cpu_gbps,
cpu_ratio, put_client_cpu_s_per_gib, put_daemon_cpu_s_per_gib, memcpy_cpu_s_per_gib (CPU time:
see assemble), copy_threads, memcpy_same_threads_gbps (the memcpy split over copy_threads
threads, as a large put copies) and ratio_same_threads (against it), and the parameters).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client import Sidecar
from kvtier.client.engine import copyin
from kvtier.client.engine.sidecar import _pieces
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout


def memcpy_gbps(total: int, block: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, block * 64, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    n = max(1, total // src.size)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        best = max(best, n * src.size / (time.perf_counter() - t) / 1e9)
    return best


def memcpy_threads_gbps(total: int, block: int, threads: int) -> float:
    """A memcpy of the same bytes split over ``threads`` threads (numpy releases the GIL), the
    way a large put copies (client/engine/copyin.py): the limit on as many cores as the put
    uses. Best of 3, GB/s."""
    rows = 64
    src = np.random.default_rng(1).integers(0, 256, (rows, block), dtype=np.uint8)
    dst = np.ones_like(src)
    n = max(1, total // src.size)
    parts = [(i * rows // threads, (i + 1) * rows // threads) for i in range(threads)]
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                list(ex.map(lambda ab: np.copyto(dst[ab[0]:ab[1]], src[ab[0]:ab[1]]), parts))
            best = max(best, n * src.size / (time.perf_counter() - t) / 1e9)
    return best


def time_lookups(sc: Sidecar, lid: int, keys: list[bytes], n: int) -> list[float]:
    """Sorted latencies (us) of ``n`` one-key lookups of held keys."""
    sc.lookup(lid, keys[:1])  # warm the channel
    lat = []
    for i in range(n):
        k = keys[i % len(keys):i % len(keys) + 1]
        t = time.perf_counter()
        sc.lookup(lid, k)
        lat.append((time.perf_counter() - t) * 1e6)
    return sorted(lat)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of distinct blocks to move each way")
    ap.add_argument("--batch", type=int, default=64, help="blocks per put/get call")
    ap.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB")
    ap.add_argument("--lookups", type=int, default=2000, help="one-key lookups to time")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--shm-dir", help="the daemon's pool directory (default: a new one in /dev/shm); e.g. a "
                                      "tmpfs mounted with huge=within_size, to measure huge-page pools")
    return ap.parse_args()


def warm_fill(sc: Sidecar, lid: int, warm_keys: list[bytes], batch: int, blocks: np.ndarray) -> float:
    """Untimed warm-up: fill the pool once with other blocks; its seconds (for first_fill_gbps)."""
    t = time.perf_counter()
    for b0 in range(0, len(warm_keys), batch):
        sc.put(lid, warm_keys[b0:b0 + batch], list(blocks))
    return time.perf_counter() - t


def memcpy_s(dst: np.ndarray, src: np.ndarray, cpu: list[float]) -> float:
    """Seconds of one copy of ``src`` into ``dst`` (the limit, timed next to each batch); its
    CPU seconds are added to ``cpu[0]``."""
    c, t = time.process_time(), time.perf_counter()
    np.copyto(dst, src)
    t = time.perf_counter() - t
    cpu[0] += time.process_time() - c
    return t


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_puts(sc: Sidecar, lid: int, keys: list[bytes], batch: int, src: list[np.ndarray],
               dst: np.ndarray, cpu: dict) -> tuple[float, float]:
    """Puts of every key in batches, each block stamped with its index; seconds inside the put
    calls, and in a memcpy of the same bytes after each (CPU seconds of both into ``cpu``)."""
    put_s = mc_s = 0.0
    mc_cpu = [0.0]
    for b0 in range(0, len(keys), batch):
        payload = src[(b0 // batch) % 2]
        payload[:, :8] = np.arange(b0, b0 + batch, dtype="<u8").view(np.uint8).reshape(-1, 8)
        blocks = list(payload)
        c, t = time.process_time(), time.perf_counter()
        res = sc.put(lid, keys[b0:b0 + batch], blocks)
        put_s += time.perf_counter() - t
        cpu["put"] += time.process_time() - c
        mc_s += memcpy_s(dst, payload, mc_cpu)
        if res.stored != batch:
            raise SystemExit(f"put stored {res.stored} of {batch}: {res}")
    cpu["memcpy"] = mc_cpu[0]
    return put_s, mc_s


def timed_gets(sc: Sidecar, lid: int, keys: list[bytes], batch: int, out: list[np.ndarray],
               src: np.ndarray, dst: np.ndarray) -> tuple[float, float]:
    """Gets of every key in batches into ``out``, checking the stamp; seconds inside the get calls,
    and in a memcpy of the same bytes after each."""
    get_s = mc_s = 0.0
    for b0 in range(0, len(keys), batch):
        t = time.perf_counter()
        got = sc.get(lid, keys[b0:b0 + batch], out=out)
        get_s += time.perf_counter() - t
        mc_s += memcpy_s(dst, src, [0.0])
        if any(g is None for g in got):
            raise SystemExit("get missed a block that was put")
        if int.from_bytes(bytes(out[-1][:8]), "little") != b0 + batch - 1:
            raise SystemExit("get returned the wrong bytes")
    return get_s, mc_s


def run_daemon(ns: argparse.Namespace, block: int, nblocks: int) -> dict:
    """Everything measured through a real kvtierd whose pool holds exactly ``nblocks`` blocks."""
    rng = np.random.default_rng(1)
    # distinct payloads: a pool of random batches whose first 8 bytes carry the block index
    src = [rng.integers(0, 256, (ns.batch, block), dtype=np.uint8) for _ in range(2)]
    # the gets' destination: the same kind of memory as the memcpy's (a prefaulted numpy array)
    out = list(np.ones((ns.batch, block), dtype=np.uint8))
    dst = np.ones((ns.batch, block), dtype=np.uint8)  # prefaulted: the memcpy's destination
    keys = [i.to_bytes(8, "little") + b"kvtier-b" for i in range(nblocks)]
    warm_keys = [i.to_bytes(8, "little") + b"warm-up!" for i in range(nblocks)]

    with tempfile.TemporaryDirectory() as tmp:
        shm = tempfile.mkdtemp(prefix="kvtier-bench-", dir=ns.shm_dir) if ns.shm_dir else None
        d = DaemonProcess(tmp, host_capacity=str(nblocks * block), name="bench", shm_dir=shm).start()
        try:
            with Sidecar(d.socket) as sc:
                lid = sc.register_layout(Layout.flat(block))
                warm_s = warm_fill(sc, lid, warm_keys, ns.batch, src[0])
                cpu = {"put": 0.0, "daemon": proc_cpu_s(d.pid)}
                put_s, mc_put_s = timed_puts(sc, lid, keys, ns.batch, src, dst, cpu)
                cpu["daemon"] = proc_cpu_s(d.pid) - cpu["daemon"]
                get_s, mc_get_s = timed_gets(sc, lid, keys, ns.batch, out, src[1], dst)
                shm_lat = time_lookups(sc, lid, keys, ns.lookups)
            with Sidecar(d.socket, use_key_table=False) as rpc:  # one Lookup RPC over the socket
                lat = time_lookups(rpc, rpc.register_layout(Layout.flat(block)), keys, ns.lookups)
        finally:
            d.cleanup()
            if shm:
                shutil.rmtree(shm, ignore_errors=True)
    return {"warm_s": warm_s, "put_s": put_s, "get_s": get_s, "lat": lat, "shm_lat": shm_lat,
            "memcpy_s": mc_put_s + mc_get_s, "cpu": cpu}


def assemble(ns: argparse.Namespace, block: int, nblocks: int, run: dict,
             rates: tuple[float, float, float]) -> dict:
    """The JSON object (field names are a contract: see the module doc)."""
    total = nblocks * block
    put_gbps, get_gbps, mc = rates
    lat, shm_lat = run["lat"], run["shm_lat"]
    return {
        "put_gbps": round(put_gbps, 3), "get_gbps": round(get_gbps, 3), "memcpy_gbps": round(mc, 3),
        "ratio": round(min(put_gbps, get_gbps) / mc, 3),
        "lookup_p50_us": round(statistics.median(lat), 1), "lookup_p99_us": round(lat[int(len(lat) * 0.99)], 1),
        "shm_lookup_p50_us": round(statistics.median(shm_lat), 1),
        "shm_lookup_p99_us": round(shm_lat[int(len(shm_lat) * 0.99)], 1),
        "block_bytes": block, "batch": ns.batch, "blocks": nblocks, "bytes_each_way": total,
        "host_capacity": total, "lookups": ns.lookups, "memcpy_threads": 1,
        "first_fill_gbps": round(total / run["warm_s"] / 1e9, 3),
        "memcpy_after_gbps": round(run["memcpy_after_gbps"], 3),
        "put_pieces": len(_pieces(ns.batch, ns.batch * block)),
        # CPU seconds, which load from other processes disturbs much less than wall time: the
        # put's (this process, all its threads, inside the put calls, plus the daemon's over the
        # puts) against the interleaved memcpys' of the same bytes
        "put_cpu_gbps": round(total / (run["cpu"]["put"] + run["cpu"]["daemon"]) / 1e9, 3),
        "put_client_cpu_gbps": round(total / run["cpu"]["put"] / 1e9, 3),
        "memcpy_cpu_gbps": round(total / run["cpu"]["memcpy"] / 1e9, 3),
        "cpu_ratio": round(run["cpu"]["memcpy"] / (run["cpu"]["put"] + run["cpu"]["daemon"]), 3),
        # the same CPU seconds per GiB moved (client: this process inside the put calls; daemon:
        # kvtierd over the puts), and the threads a large put or get copies on
        "put_client_cpu_s_per_gib": round(run["cpu"]["put"] * (1 << 30) / total, 4),
        "put_daemon_cpu_s_per_gib": round(run["cpu"]["daemon"] * (1 << 30) / total, 4),
        "memcpy_cpu_s_per_gib": round(run["cpu"]["memcpy"] * (1 << 30) / total, 4),
        "copy_threads": copyin.COPY_THREADS,
        # the limit on as many threads as a large put copies on, and the ratio against it
        # (``ratio`` stays against the one-thread memcpy, as the goal defines it)
        "memcpy_same_threads_gbps": round(run["memcpy_mt_gbps"], 3),
        "ratio_same_threads": round(min(put_gbps, get_gbps) / run["memcpy_mt_gbps"], 3),
    }


def main() -> None:
    ns = parse_args()
    block = int(ns.block_mib * (1 << 20))
    nblocks = max(ns.batch, int(ns.gib * (1 << 30)) // block // ns.batch * ns.batch)
    total = nblocks * block
    run = run_daemon(ns, block, nblocks)
    run["memcpy_after_gbps"] = memcpy_gbps(total, block)
    run["memcpy_mt_gbps"] = memcpy_threads_gbps(total, block, copyin.COPY_THREADS)
    mc = 2 * total / run["memcpy_s"] / 1e9
    put_gbps, get_gbps = total / run["put_s"] / 1e9, total / run["get_s"] / 1e9
    result = assemble(ns, block, nblocks, run, (put_gbps, get_gbps, mc))
    print(f"put {put_gbps:.2f} GB/s, get {get_gbps:.2f} GB/s, memcpy {mc:.2f} GB/s "
          f"-> ratio {result['ratio']:.2f}; lookup p50 {result['lookup_p50_us']} us", file=sys.stderr)
    emit(result, ns.out)


if __name__ == "__main__":
    main()

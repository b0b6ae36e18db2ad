"""Disk tier bandwidth against raw O_DIRECT on the same directory, in the same run.

Starts its own kvtierd (``DaemonProcess``) with ``--disk-dir`` under a temporary directory on
a real filesystem (``--dir``, default /var/tmp; not tmpfs), then measures:

* ``write_gbps``: durable puts of ``--block-mib`` blocks through the tier (a Sidecar writes
  each batch into the host pool, the daemon writes it to disk, fdatasyncs, commits the LMDB
  index, then acknowledges), ``--gib`` in all;
* ``read_gbps``: gets of blocks that were evicted from host (the daemon promotes them from
  disk into host slots, verifies their checksums, the Sidecar copies them out), random order,
  ``--gib`` in all;
* ``raw_write_gbps`` / ``raw_read_gbps``: plain O_DIRECT writes of the same block size into a
  preallocated file in the same directory, one fdatasync per batch of the same size, and
  random O_DIRECT reads, both at the same queue depth (a thread pool; the GIL is released in
  the syscalls). The raw runs go once before and once after the tier runs; their mean is
  the reference, to damp the drift of a shared disk;
* ``ratio``: the lower of write/raw_write and read/raw_read (goal >= 0.85);
* ``promote_1block_p99_ms``: latency of a one-block get of a disk-only block;
* demotion under a put stream: ``--gib`` of plain (not durable) puts of
  blocks each put once, into a host tier of ``--host-mib``, so that from the second quarter on
  every put evicts host victims, once into a kvtierd with this disk tier (the victims are
  demoted while the disk's write queue has room, ``--demote-queue-bytes``, the daemon's
  default, and dropped when it has none: each was seen once) and once into one without a
  disk tier (victims dropped): ``demote_put_gbps`` and ``nodisk_put_gbps``, their ratio
  ``demote_put_ratio`` (1: demotion does not slow the puts), the put latencies
  ``demote_put_p99_ms`` / ``nodisk_put_p99_ms``, and ``demote_write_gbps``: the bytes demoted
  by the end of the puts over their time, against the raw write rate (``demote_write_ratio``:
  the share of the disk's write bandwidth the demotions used), with ``demoted_blocks``,
  ``demotions_ahead`` (of those, written ahead of their eviction: ``--demote-ahead-bytes``) and
  ``demotions_skipped_cold``. The run without a disk goes once before and once after the runs
  with one (``nodisk_runs_gbps``; their mean is the reference, as for the raw runs). The same
  put stream also goes into a kvtierd with the disk tier and ``--demote-ahead-bytes 0`` (the
  victims copied out instead of written ahead): ``noahead_put_gbps``, ``noahead_put_ratio``,
  ``noahead_write_gbps``, ``noahead_write_ratio``, ``noahead_put_p99_ms``, ``noahead_demoted_blocks``.

Prints one JSON object as its last line (bandwidths in 10^9 B/s).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout

MiB = 1024 * 1024
GiB = 1024 * MiB


def raw_write(path: str, nblocks: int, block: int, batch: int, qd: int) -> float:
    """O_DIRECT writes of ``block`` bytes at queue depth ``qd``, fdatasync per ``batch``; GB/s."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    bufs = [mmap.mmap(-1, block) for _ in range(qd)]
    for b in bufs:
        b.write(np.random.default_rng(1).bytes(block))
    try:
        os.posix_fallocate(fd, 0, nblocks * block)
        os.fsync(fd)
        with ThreadPoolExecutor(qd) as pool:
            t0 = time.perf_counter()
            for first in range(0, nblocks, batch):
                idx = range(first, min(first + batch, nblocks))
                list(pool.map(lambda i: os.pwritev(fd, [bufs[i % qd]], i * block), idx))
                os.fdatasync(fd)
            dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return nblocks * block / dt / 1e9


def raw_read(path: str, nblocks: int, block: int, qd: int) -> float:
    """Random O_DIRECT reads of ``block`` bytes at queue depth ``qd``; GB/s."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, block) for _ in range(qd)]
    order = list(range(nblocks))
    random.Random(2).shuffle(order)
    try:
        with ThreadPoolExecutor(qd) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda j: os.preadv(fd, [bufs[j % qd]], order[j] * block), range(nblocks)))
            dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return nblocks * block / dt / 1e9


def key(i: int) -> bytes:
    return b"benchdsk" + i.to_bytes(8, "big")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB moved each way (default 2)")
    ap.add_argument("--quick", action="store_true", help="0.25 GiB each way (a smoke run)")
    ap.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB (default 2)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per put / get (default 32)")
    ap.add_argument("--queue-depth", type=int, default=8, help="disk I/Os in flight (default 8)")
    ap.add_argument("--host-mib", type=int, default=0,
                    help="host tier capacity in MiB (default: a quarter of the bytes moved, at most 256)")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the temporary disk dir (a real filesystem)")
    ap.add_argument("--streams", type=int, default=2, help="concurrent writers of durable puts (default 2)")
    ap.add_argument("--latency-samples", type=int, default=200)
    ap.add_argument("--out", default="", help="also write the JSON here")
    return ap.parse_args()


def raw_pair(path: str, nblocks: int, block: int, batch: int, qd: int) -> tuple[float, float]:
    """One raw O_DIRECT write run then one random read run of the same file; (write, read) GB/s."""
    return raw_write(path, nblocks, block, batch, qd), raw_read(path, nblocks, block, qd)


def tier_run(args: argparse.Namespace, work: str, nblocks: int, block: int, host_mib: int) -> dict:
    """Starts a kvtierd with its disk tier under ``work``, measures it (``run_tier``), removes it."""
    qd = args.queue_depth
    disk_dir = os.path.join(work, "disk")
    d = DaemonProcess(work, "--disk-dir", disk_dir, "--disk-capacity", str(int(nblocks * block * 1.25)),
                      "--disk-queue-depth", str(qd), "--log-level", "warning",
                      # the warm-up blocks (seen once) are not demoted: only the durable puts write
                      "--demote-queue-bytes", "0", host_capacity=f"{host_mib}MiB").start()
    try:
        res = run_tier(d, nblocks, block, args.batch, args.latency_samples, args.streams, host_mib * MiB)
    finally:
        d.stop()
        d.cleanup()
    shutil.rmtree(disk_dir, ignore_errors=True)
    return res


def put_stream(d: DaemonProcess, nblocks: int, block: int, batch: int) -> tuple[float, list[float], dict]:
    """Plain puts of ``nblocks`` distinct blocks, ``batch`` a put, each put once; (seconds, the
    latency of each put, the daemon's counters right after the last put)."""
    payload = np.random.default_rng(5).bytes(block)
    lat = []
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(block))
        t0 = time.perf_counter()
        for first in range(0, nblocks, batch):
            idx = range(first, min(first + batch, nblocks))
            s = time.perf_counter()
            r = sc.put(lid, [b"benchdem" + i.to_bytes(8, "big") for i in idx], [payload] * len(idx))
            lat.append(time.perf_counter() - s)
            if r.stored != len(idx):
                raise SystemExit(f"put stored {r.stored} of {len(idx)} blocks: {r}")
        dt = time.perf_counter() - t0
        return dt, lat, sc.stats()["counters"]


def demote_run(args: argparse.Namespace, work: str, nblocks: int, block: int, host_mib: int) -> dict:
    """The put stream into a kvtierd without a disk tier, with one, with one and no write-ahead,
    and without one again (module doc)."""
    batch = max(1, args.batch // 4)
    disk_dir = os.path.join(work, "demote-disk")
    disk = ["--disk-dir", disk_dir, "--disk-capacity", str(int(nblocks * block * 1.25)),
            "--disk-queue-depth", str(args.queue_depth)]
    out = {}
    for name, extra in (("nodisk1", []), ("demote", disk), ("noahead", [*disk, "--demote-ahead-bytes", "0"]),
                        ("nodisk2", [])):
        d = DaemonProcess(work, *extra, "--log-level", "warning", host_capacity=f"{host_mib}MiB",
                          name=f"kvtierd-{name}").start()
        try:
            out[name] = put_stream(d, nblocks, block, batch)
        finally:
            d.stop()
            d.cleanup()
        shutil.rmtree(disk_dir, ignore_errors=True)
    (dem_s, dem_lat, dem_c), (noa_s, noa_lat, noa_c) = out["demote"], out["noahead"]
    nod = [nblocks * block / out[n][0] / 1e9 for n in ("nodisk1", "nodisk2")]
    return {"demote_put_gbps": nblocks * block / dem_s / 1e9, "nodisk_put_gbps": sum(nod) / 2,
            "nodisk_runs_gbps": nod,
            "demote_put_p99_ms": float(np.percentile(dem_lat, 99)) * 1e3,
            "nodisk_put_p99_ms": float(np.percentile(out["nodisk1"][1] + out["nodisk2"][1], 99)) * 1e3,
            "demote_write_gbps": dem_c.get("demotions", 0) * block / dem_s / 1e9,
            "demoted_blocks": int(dem_c.get("demotions", 0)),
            "demotions_ahead": int(dem_c.get("demotions_ahead", 0)),
            "demotions_skipped_cold": int(dem_c.get("demotions_skipped_cold", 0)), "demote_put_blocks": nblocks,
            "demote_batch_blocks": batch,
            "noahead_put_gbps": nblocks * block / noa_s / 1e9,
            "noahead_put_p99_ms": float(np.percentile(noa_lat, 99)) * 1e3,
            "noahead_write_gbps": noa_c.get("demotions", 0) * block / noa_s / 1e9,
            "noahead_demoted_blocks": int(noa_c.get("demotions", 0))}


def assemble(args: argparse.Namespace, res: dict, raw1: tuple[float, float], raw2: tuple[float, float],
             block: int, host_mib: int) -> dict:
    """The JSON object (field names are a contract: see the module doc)."""
    (rw1, rr1), (rw2, rr2) = raw1, raw2
    raw_w, raw_r = (rw1 + rw2) / 2, (rr1 + rr2) / 2
    return {
        "bench": "disk_tier",
        "write_gbps": round(res["write_gbps"], 3),
        "read_gbps": round(res["read_gbps"], 3),
        "raw_write_gbps": round(raw_w, 3),
        "raw_read_gbps": round(raw_r, 3),
        "ratio": round(min(res["write_gbps"] / raw_w, res["read_gbps"] / raw_r), 3),
        "write_ratio": round(res["write_gbps"] / raw_w, 3),
        "read_ratio": round(res["read_gbps"] / raw_r, 3),
        "promote_1block_p99_ms": round(res["p99_ms"], 3),
        "promote_1block_p50_ms": round(res["p50_ms"], 3),
        "raw_runs_gbps": {"write": [round(rw1, 3), round(rw2, 3)], "read": [round(rr1, 3), round(rr2, 3)]},
        "block_bytes": block, "batch_blocks": args.batch, "queue_depth": args.queue_depth,
        "write_streams": args.streams,
        "bytes_written": res["bytes_written"], "bytes_read": res["bytes_read"],
        "host_capacity_bytes": host_mib * MiB, "disk_dir_parent": args.dir,
        "checksum_failures": res["checksum_failures"], "cpus": os.cpu_count(),
        "demote_put_gbps": round(res["demote_put_gbps"], 3), "nodisk_put_gbps": round(res["nodisk_put_gbps"], 3),
        "demote_put_ratio": round(res["demote_put_gbps"] / res["nodisk_put_gbps"], 3),
        "demote_put_p99_ms": round(res["demote_put_p99_ms"], 2), "nodisk_put_p99_ms": round(res["nodisk_put_p99_ms"], 2),
        "demote_write_gbps": round(res["demote_write_gbps"], 3),
        "demote_write_ratio": round(res["demote_write_gbps"] / raw_w, 3),
        "demoted_blocks": res["demoted_blocks"], "demotions_skipped_cold": res["demotions_skipped_cold"],
        "demote_put_blocks": res["demote_put_blocks"], "demote_batch_blocks": res["demote_batch_blocks"],
        "demotions_ahead": res["demotions_ahead"],
        "nodisk_runs_gbps": [round(g, 3) for g in res["nodisk_runs_gbps"]],
        "noahead_put_gbps": round(res["noahead_put_gbps"], 3),
        "noahead_put_ratio": round(res["noahead_put_gbps"] / res["nodisk_put_gbps"], 3),
        "noahead_put_p99_ms": round(res["noahead_put_p99_ms"], 2),
        "noahead_write_gbps": round(res["noahead_write_gbps"], 3),
        "noahead_write_ratio": round(res["noahead_write_gbps"] / raw_w, 3),
        "noahead_demoted_blocks": res["noahead_demoted_blocks"],
    }


def main() -> None:
    args = parse_args()
    gib = 0.25 if args.quick else args.gib
    block = int(args.block_mib * MiB)
    nblocks = max(args.batch, int(gib * GiB) // block)
    qd, batch = args.queue_depth, args.batch
    host_mib = args.host_mib or max(int(2 * batch * args.block_mib), min(256, int(nblocks * args.block_mib) // 4))
    if host_mib * MiB >= nblocks * block:
        raise SystemExit(f"--host-mib {host_mib} holds every block: reads would never come from disk")
    work = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=args.dir)
    raw_path = os.path.join(work, "raw.dat")
    try:
        raw1 = raw_pair(raw_path, nblocks, block, batch, qd)
        os.unlink(raw_path)
        res = tier_run(args, work, nblocks, block, host_mib)
        res.update(demote_run(args, work, nblocks, block, host_mib))
        raw2 = raw_pair(raw_path, nblocks, block, batch, qd)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(assemble(args, res, raw1, raw2, block, host_mib), args.out)


def warm_host(sc: Sidecar, lid: int, host_blocks: int, batch: int, data: Callable[[int], bytes]) -> None:
    """Untimed warm-up: fill the host pool once (its tmpfs pages are allocated on first use) with
    blocks put once, which leave host without a disk write (below --demote-min-seen, with
    --demote-queue-bytes 0)."""
    for first in range(0, host_blocks, batch):
        idx = range(first, min(first + batch, host_blocks))
        sc.put(lid, [b"benchwrm" + i.to_bytes(8, "big") for i in idx], [data(i) for i in idx])


def timed_durable_puts(d: DaemonProcess, keys: list[bytes], block: int, batch: int, streams: int,
                       data: Callable[[int], bytes]) -> float:
    """Durable puts of every key from ``streams`` writers (each its own sidecar), so one writer's copy
    into the pool overlaps another's disk write, as an engine offloading every step would; seconds."""
    nblocks = len(keys)
    writers = [Sidecar(d.socket) for _ in range(streams)]
    wlids = [w.register_layout(Layout.flat(block)) for w in writers]

    def put_batches(w: int) -> None:
        for first in range(w * batch, nblocks, batch * streams):
            idx = range(first, min(first + batch, nblocks))
            r = writers[w].put(wlids[w], [keys[i] for i in idx], [data(i) for i in idx], durable=True)
            if r.stored != len(idx):
                raise SystemExit(f"durable put stored {r.stored} of {len(idx)} blocks: {r}")

    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        list(pool.map(put_batches, range(streams)))
        write_s = time.perf_counter() - t0
    for w in writers:
        w.close()
    return write_s


def timed_disk_gets(sc: Sidecar, lid: int, keys: list[bytes], order: list[int], out: list[bytearray],
                    data: Callable[[int], bytes]) -> tuple[int, float, int]:
    """Gets of blocks evicted from host, in ``order``, until as many blocks as were written;
    (blocks read, seconds inside the get calls, position reached in ``order``)."""
    nblocks, batch = len(keys), len(out)
    read_blocks, read_s, pos = 0, 0.0, 0
    while read_blocks < nblocks:
        if pos > 100 * nblocks:
            raise SystemExit("too few blocks left host: lower --host-mib")
        cand = [order[(pos + j) % nblocks] for j in range(batch * 2)]
        pos += batch * 2
        where = sc.lookup(lid, [keys[i] for i in cand])
        pick = [i for i, t in zip(cand, where, strict=True) if t == "disk"][:min(batch, nblocks - read_blocks)]
        if not pick:
            continue
        t0 = time.perf_counter()
        got = sc.get(lid, [keys[i] for i in pick], out=out[:len(pick)])
        read_s += time.perf_counter() - t0
        if any(g is None for g in got):
            raise SystemExit("a block evicted from host was not served from disk")
        if read_blocks == 0 and bytes(got[0]) != data(pick[0]):
            raise SystemExit("block served with wrong bytes")
        read_blocks += len(pick)
    return read_blocks, read_s, pos


def promote_latencies(sc: Sidecar, lid: int, keys: list[bytes], order: list[int], pos: int, samples: int,
                      out: list[bytearray]) -> list[float]:
    """Seconds of one-block gets of disk-only blocks, from ``order`` at ``pos`` on."""
    nblocks = len(keys)
    lat = []
    for j in range(samples):
        i = order[(pos + j) % nblocks]
        if sc.lookup(lid, [keys[i]]) != ["disk"]:
            continue
        t0 = time.perf_counter()
        g = sc.get(lid, [keys[i]], out=out[:1])
        lat.append(time.perf_counter() - t0)
        assert g[0] is not None
    return lat


def run_tier(d: DaemonProcess, nblocks: int, block: int, batch: int, samples: int, streams: int,
             host_bytes: int) -> dict:
    rng = np.random.default_rng(3)
    distinct = [rng.bytes(block) for _ in range(min(nblocks, 64))]
    keys = [key(i) for i in range(nblocks)]

    def data(i: int) -> bytes:
        return distinct[i % len(distinct)]

    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(block))
        warm_host(sc, lid, host_bytes // block, batch, data)
        write_s = timed_durable_puts(d, keys, block, batch, streams, data)
        st = sc.stats()
        if st["tiers"]["disk"]["blocks"] != nblocks or st["counters"].get("demotions", 0):
            raise SystemExit(f"disk tier holds {st['tiers']['disk']['blocks']} of {nblocks} blocks")

        # gets of blocks evicted from host, random order, until as many bytes as were written
        order = list(range(nblocks))
        random.Random(4).shuffle(order)
        out = [bytearray(block) for _ in range(batch)]
        before = sc.stats()["counters"]
        read_blocks, read_s, pos = timed_disk_gets(sc, lid, keys, order, out, data)
        after = sc.stats()["counters"]
        from_disk = after.get("acquire_hit_blocks:disk", 0) - before.get("acquire_hit_blocks:disk", 0)
        if from_disk != read_blocks:
            raise SystemExit(f"{read_blocks} blocks read, but the daemon promoted {from_disk}")

        lat_ms = np.array(promote_latencies(sc, lid, keys, order, pos, samples, out)) * 1e3
        return {"write_gbps": nblocks * block / write_s / 1e9, "read_gbps": read_blocks * block / read_s / 1e9,
                "bytes_written": nblocks * block, "bytes_read": read_blocks * block,
                "p99_ms": float(np.percentile(lat_ms, 99)), "p50_ms": float(np.percentile(lat_ms, 50)),
                "checksum_failures": int(after.get("checksum_failures", 0))}


if __name__ == "__main__":
    sys.exit(main())

"""Prefix lookups: the shared-memory key table against the Lookup RPC and a bare gRPC echo.

Starts a real kvtierd holding ``--daemon-blocks`` real 4 KiB blocks (put through the sidecar
in batches: the pool memory is really allocated, ``--daemon-blocks`` x 4 KiB), then times,
through the public sidecar API:

* ``shm_1key``: ``Sidecar.lookup`` of one held key, read from the mapped key table;
* ``shm_128keys``: ``Sidecar.prefix_length`` of 128 chained keys, from the key table;
* ``rpc_1key`` / ``rpc_128keys``: the same calls on a sidecar with ``use_key_table=False``
  (one Lookup RPC each over the daemon's unix socket);
* ``grpc_echo``: the physical limit of the RPC path, measured in the same run: a bare gRPC
  unary echo (generic handler, bytes in and out, grpc.aio on uvloop like the daemon) over a
  unix socket in the same directory, with a payload the size of a one-key LookupRequest.
  The echo and the two RPC series are timed interleaved, call by call, so that load from
  other processes on the machine falls on all three alike.

When ``--keys`` exceeds ``--daemon-blocks`` it also builds a key table of ``--keys`` keys with
the daemon's own writer code (no daemon, no block memory: the table alone) and times the
reader on it (``table_*`` fields), so the probe cost at the full key count is measured even
where the machine cannot hold that many real blocks. Keys are random 16-byte keys; a 128-key
prefix is a run of keys held (the probe walks all 128).

    python bench/lookup.py [--keys 1000000] [--daemon-blocks 1000000] [--out FILE.json]

Memory: ``--daemon-blocks`` x 4 KiB of tmpfs plus the daemon's index (the JSON reports the
daemon's RSS) and the table (40 B a slot, about 2.1 slots a key).

Last line of stdout: one JSON object: shm_1key_p50_us, shm_128keys_p99_us, rpc_1key_p50_us,
rpc_128keys_p99_us, grpc_echo_p50_us, their other percentiles, ``shm_1key_cpu_us`` and
``shm_128keys_cpu_us`` (this process's CPU time per lookup, over a second pass: less disturbed
by load than the percentiles), ``shm_128keys_p999_us`` and ``shm_128keys_over50`` (lookups over 50
us), ``control_128reads_*`` (128 random reads of an anonymous buffer the size of the key table,
timed the same way with no kvtier code: the machine's own memory-stall tail, see
``memory_control``), ``probe`` (``--probe``: compiled or numpy), the ratio of the RPC lookup to
the echo, ``daemon_bytes_per_block`` (the daemon's private memory, RssAnon, from its start to
holding the blocks, per block held: the pool and the key table are tmpfs files and not in it),
and the parameters.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

import grpc
import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess, rss_bytes, tmpfs_bytes
from kvtier.proto import node_pb2
from kvtier.tiers import keytable
from kvtier.tiers.keytable import KeyTableReader, KeyTableWriter
from kvtier.tiers.layout import Layout

BLOCK = 4096

_ECHO_SERVER = textwrap.dedent("""
    import asyncio, sys
    import grpc, uvloop

    async def echo(request, context):
        return request

    async def main(path):
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        server.add_insecure_port("unix:" + path)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main(sys.argv[1]))
""")


def timed(fn: Callable[[int], object], n: int, warmup: int = 200) -> np.ndarray:
    """Latencies of ``fn(i)`` for i in range(n), in microseconds (after ``warmup`` calls)."""
    for i in range(warmup):
        fn(i % n)
    out = np.empty(n)
    clock = time.perf_counter_ns
    for i in range(n):
        t = clock()
        fn(i)
        out[i] = clock() - t
    return out / 1e3


def cpu_per_call(fn: Callable[[int], object], n: int) -> float:
    """CPU time of this process per call of ``fn(i)`` (us): load from other processes inflates
    it much less than wall time."""
    t = time.process_time()
    for i in range(n):
        fn(i)
    return round((time.process_time() - t) / n * 1e6, 2)


def pct(lat: np.ndarray, q: float) -> float:
    return round(float(np.percentile(lat, q)), 2)


def interleaved(fns: list[Callable[[int], object]], n: int, warmup: int = 200) -> list[np.ndarray]:
    """Latencies (us) of each ``fns[j](i)``, called in turn for each i: one series per function."""
    for i in range(warmup):
        for fn in fns:
            fn(i % n)
    out = np.empty((len(fns), n))
    clock = time.perf_counter_ns
    for i in range(n):
        for j, fn in enumerate(fns):
            t = clock()
            fn(i)
            out[j, i] = clock() - t
    return list(out / 1e3)


def memory_control(nbytes: int, n: int, rng: random.Random) -> np.ndarray:
    """Latencies (us) of 128 random 8-byte reads of an anonymous mapping of ``nbytes`` (4 KiB
    pages, like the key table on tmpfs), timed as the 128-key lookups are: no kvtier code, so
    its tail is the machine's own. On a VM whose host pages out guest memory, touching a page
    not touched for a while stalls ~100-200 us (on-CPU for the guest, no guest page fault): a
    128-key lookup touches 128 random pages of the table, so its p99 carries those stalls too.
    Compare ``shm_128keys_over50`` with ``control_128reads_over50`` in the same run."""
    mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    buf = np.frombuffer(mm, dtype=np.uint64)
    buf[:] = 1  # touched once, as the daemon's writes touch every slot of the table
    picks = np.random.default_rng(rng.randrange(1 << 32)).integers(0, len(buf) // 8, (n, 128)) * 8
    return timed(lambda i: buf[picks[i]].sum(), n)  # the mapping goes with the last view of it


def start_echo_server(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def fill_daemon(sc: Sidecar, lid: int, keys: list[bytes], batch: int) -> float:
    block = bytes(BLOCK)
    t = time.perf_counter()
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        res = sc.put(lid, part, [block] * len(part))
        if res.dropped:
            raise SystemExit(f"the daemon dropped {len(res.dropped)} blocks: host capacity too small")
    return time.perf_counter() - t


def table_only(shm_dir: str, keys: list[bytes], n1: int, n128: int, rng: random.Random) -> dict:
    """Probe cost on a table of len(keys) keys written by the daemon's writer code (no daemon)."""
    path = os.path.join(shm_dir, "bench-table-only.keys")
    fp = Layout.flat(BLOCK).fingerprint
    writer = KeyTableWriter(path)
    writer.reserve(len(keys))
    for i in range(0, len(keys), 65536):
        writer.set(fp, keys[i:i + 65536], "host")
    reader = KeyTableReader(path, stale_ns=1 << 62)  # no daemon to beat the heartbeat here
    try:
        one = [[keys[rng.randrange(len(keys))]] for _ in range(n1)]
        starts = [rng.randrange(len(keys) - 128) for _ in range(n128)]
        lat1 = timed(lambda i: reader.masks(fp, one[i]), n1)
        lat128 = timed(lambda i: reader.prefix_length(fp, keys[starts[i]:starts[i] + 128]), n128)
        assert reader.prefix_length(fp, keys[:128]) == (128, 128)
        return {"table_keys": len(keys), "table_slots": writer.nslots,
                "table_shm_1key_p50_us": pct(lat1, 50), "table_shm_1key_p99_us": pct(lat1, 99),
                "table_shm_128keys_p50_us": pct(lat128, 50), "table_shm_128keys_p99_us": pct(lat128, 99)}
    finally:
        reader.close()
        writer.close()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys the table holds")
    ap.add_argument("--daemon-blocks", type=int, default=0,
                    help="real 4 KiB blocks put into the daemon (default: --keys); fewer where the machine "
                         "cannot spare --keys x 4 KiB, and the table-only run covers --keys")
    ap.add_argument("--n1", type=int, default=20000, help="one-key lookups to time (table)")
    ap.add_argument("--n128", type=int, default=5000, help="128-key prefix lookups to time (table)")
    ap.add_argument("--nrpc", type=int, default=3000, help="lookups to time per RPC series and echo")
    ap.add_argument("--batch", type=int, default=8192, help="blocks per put while filling")
    ap.add_argument("--probe", choices=("compiled", "numpy"), default="compiled" if keytable.COMPILED else "numpy",
                    help="the key-table probe the readers use (default: the compiled one when it is built)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--shm-dir", help="the daemon's pool and key-table directory (default: a new one in "
                                      "/dev/shm); e.g. a tmpfs mounted with huge=within_size")
    return ap.parse_args()


def rpc_against_echo(rpc: Sidecar, rid: int, held: list[bytes], one: list[list[bytes]], starts: list[int],
                     echo_path: str, n: int) -> dict:
    """The two Lookup RPC series and the bare gRPC echo, timed interleaved call by call."""
    payload = node_pb2.LookupRequest(layout_id=1, keys=[held[0]]).SerializeToString()
    with grpc.insecure_channel(f"unix:{echo_path}") as ch:
        call = ch.unary_unary("/bench.Echo/Echo")
        rpc1, echo, rpc128 = interleaved([
            lambda i: rpc.lookup(rid, one[i]),
            lambda i: call(payload, timeout=10),
            lambda i: rpc.prefix_length(rid, held[starts[i]:starts[i] + 128])], n)
    return {"rpc1": rpc1, "echo": echo, "rpc128": rpc128, "payload_bytes": len(payload)}


def daemon_series(ns: argparse.Namespace, daemon: DaemonProcess, echo_path: str, held: list[bytes],
                  rng: random.Random) -> dict:
    """Fills the daemon with ``held`` and times every series through the sidecar API."""
    blocks = len(held)
    layout = Layout.flat(BLOCK)
    private_before = rss_bytes(daemon.pid, "RssAnon")  # the daemon started, nothing registered or held
    with Sidecar(daemon.socket) as sc, Sidecar(daemon.socket, use_key_table=False) as rpc:
        lid, rid = sc.register_layout(layout), rpc.register_layout(layout)
        fill_s = fill_daemon(sc, lid, held, ns.batch)
        stats = rpc.stats()
        assert stats["tiers"]["host"]["blocks"] == blocks, stats["tiers"]
        table = sc._info(lid).table
        assert table is not None, "the sidecar did not map the key table"
        one = [[held[rng.randrange(blocks)]] for _ in range(max(ns.n1, ns.nrpc))]
        starts = [rng.randrange(blocks - 128) for _ in range(max(ns.n128, ns.nrpc))]
        assert sc.prefix_length(lid, held[starts[0]:starts[0] + 128]) == (128, 128)
        assert rpc.prefix_length(rid, held[starts[0]:starts[0] + 128]) == (128, 128)
        shm1 = timed(lambda i: sc.lookup(lid, one[i]), ns.n1)
        shm128 = timed(lambda i: sc.prefix_length(lid, held[starts[i]:starts[i] + 128]), ns.n128)
        control = memory_control(table.nslots * keytable.SLOT_BYTES, ns.n128, rng)
        cpu1 = cpu_per_call(lambda i: sc.lookup(lid, one[i]), ns.n1)
        cpu128 = cpu_per_call(lambda i: sc.prefix_length(lid, held[starts[i]:starts[i] + 128]), ns.n128)
        series = rpc_against_echo(rpc, rid, held, one, starts, echo_path, ns.nrpc)
        assert sc._info(lid).table is table, "the sidecar fell back to RPC during the run"
        daemon_rss = rss_bytes(daemon.pid)
        daemon_private = rss_bytes(daemon.pid, "RssAnon")  # without the pool pages it has touched
        pool_bytes = tmpfs_bytes([os.path.join(daemon.shm_dir, f) for f in os.listdir(daemon.shm_dir)
                                  if f.endswith(".pool")])
        return {"shm1": shm1, "shm128": shm128, "control": control, "cpu1": cpu1, "cpu128": cpu128, **series, "fill_s": fill_s, "daemon_rss": daemon_rss,
                "daemon_private": daemon_private, "daemon_private_before": private_before,
                "pool_bytes": pool_bytes, "table_slots": table.nslots}


def assemble(ns: argparse.Namespace, blocks: int, m: dict, extra: dict) -> dict:
    """The JSON object (field names are a contract: see the module doc)."""
    shm1, shm128, rpc1, rpc128, echo = m["shm1"], m["shm128"], m["rpc1"], m["rpc128"], m["echo"]
    return {
        "shm_1key_p50_us": pct(shm1, 50), "shm_1key_p99_us": pct(shm1, 99),
        "shm_128keys_p50_us": pct(shm128, 50), "shm_128keys_p99_us": pct(shm128, 99),
        "shm_128keys_p999_us": pct(shm128, 99.9), "shm_128keys_over50": int((shm128 > 50).sum()),
        "control_128reads_p50_us": pct(m["control"], 50), "control_128reads_p99_us": pct(m["control"], 99),
        "control_128reads_over50": int((m["control"] > 50).sum()),
        "shm_1key_cpu_us": m["cpu1"], "shm_128keys_cpu_us": m["cpu128"], "probe": ns.probe,
        "rpc_1key_p50_us": pct(rpc1, 50), "rpc_1key_p99_us": pct(rpc1, 99),
        "rpc_128keys_p50_us": pct(rpc128, 50), "rpc_128keys_p99_us": pct(rpc128, 99),
        "grpc_echo_p50_us": pct(echo, 50), "grpc_echo_p99_us": pct(echo, 99),
        "rpc_1key_over_echo_p50": round(pct(rpc1, 50) / pct(echo, 50), 2),
        "keys_held": blocks, "keys": ns.keys, "key_bytes": 16, "block_bytes": BLOCK, "layout": "flat(4096)",
        "daemon_table_slots": m["table_slots"], "fill_s": round(m["fill_s"], 1),
        "daemon_rss_bytes": m["daemon_rss"], "daemon_private_bytes": m["daemon_private"],
        "pool_tmpfs_bytes": m["pool_bytes"],
        # private (anonymous) memory the daemon gained from its start to holding keys_held blocks,
        # per block: the pool and the key table are tmpfs files, outside RssAnon
        "daemon_bytes_per_block": round((m["daemon_private"] - m["daemon_private_before"]) / blocks, 1),
        "n1": ns.n1, "n128": ns.n128, "nrpc": ns.nrpc, "echo_payload_bytes": m["payload_bytes"],
        **extra,
    }


def main() -> None:
    ns = parse_args()
    if ns.probe == "compiled" and keytable._cprobe is None:
        raise SystemExit("--probe compiled: the compiled probe is not built (pip install the project)")
    keytable.COMPILED = ns.probe == "compiled"  # the readers the sidecars open take this default
    blocks = ns.daemon_blocks or ns.keys
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(max(ns.keys, blocks))]
    held = keys[:blocks]

    workdir = tempfile.mkdtemp(prefix="kvtier-bench-lookup-")
    shm = tempfile.mkdtemp(prefix="kvtier-bench-lookup-", dir=ns.shm_dir) if ns.shm_dir else None
    daemon = DaemonProcess(workdir, "--log-level", "warning", host_capacity=str(blocks * BLOCK + (8 << 20)),
                           shm_dir=shm)
    echo_server = None
    try:
        daemon.start()
        echo_path = os.path.join(workdir, "echo.sock")
        echo_server = start_echo_server(echo_path)
        m = daemon_series(ns, daemon, echo_path, held, rng)
        extra = table_only(daemon.shm_dir, keys, ns.n1, ns.n128, rng) if ns.keys > blocks else {}
    finally:
        if echo_server is not None:
            echo_server.kill()
            echo_server.wait()
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    result = assemble(ns, blocks, m, extra)
    print(f"shm: 1 key p50 {result['shm_1key_p50_us']} us, 128 keys p99 {result['shm_128keys_p99_us']} us; "
          f"rpc: 1 key p50 {result['rpc_1key_p50_us']} us (echo {result['grpc_echo_p50_us']} us)", file=sys.stderr)
    emit(result, ns.out)


if __name__ == "__main__":
    main()

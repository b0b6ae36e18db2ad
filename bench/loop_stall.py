"""Does the daemon's event loop stall while it serves big feed snapshots?

    python bench/loop_stall.py [--keys 2000000] [--subscribers 10] [--out FILE.json]

Starts a real kvtierd and makes it hold ``--keys`` keys by the smallest path there is: an
engine's device-block reports (the gpu tier: keys without bytes, in the feed, the key table
and Stats like any other holding). Then ``--subscribers`` processes subscribe to the location
feed at the same moment (each gets a snapshot of every key) while this process times Lookup
RPCs (8 keys, the key table off) and Stats RPCs back to back on the daemon, from before the
subscribers join until every one has its whole snapshot.

Last line of stdout: one JSON object: lookup_p50_ms, lookup_p99_ms, lookup_max_ms, lookups,
stats_p99_ms, snapshot_s (until the last subscriber had its last part), keys_per_subscriber,
and the parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess, rss_bytes
from kvtier.tiers.layout import Layout

LAYOUT = Layout.flat(4096)


def keys_of(start: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(b"%d" % i, digest_size=16).digest() for i in range(start, start + n)]


def subscribe(socket: str, go: mp.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from kvtier.client.engine.transport import open_channel
    from kvtier.proto import locations_pb2, locations_pb2_grpc

    ch = open_channel(f"unix:{socket}", client_name="stall-sub")
    stub = locations_pb2_grpc.LocationsStub(ch)
    go.wait()
    t0 = time.monotonic()
    n = 0
    stream = stub.WatchLocations(locations_pb2.WatchLocationsRequest(subscriber="stall"))
    for reply in stream:
        if reply.HasField("snapshot"):
            n += sum(len(e.keys) for e in reply.snapshot.entries)
            if reply.snapshot.last:
                break
    stream.cancel()
    out.put((time.monotonic() - t0, n))


def time_rpcs(rpc: Sidecar, rid: int, probe: list[bytes], lat: list[float], stats_lat: list[float],
              done: threading.Event) -> None:
    """Lookup RPCs back to back, every tenth a Stats, until ``done``."""
    i = 0
    while not done.is_set():
        t = time.perf_counter()
        if i % 10 == 9:
            rpc.stats()
            stats_lat.append(time.perf_counter() - t)
        else:
            rpc.lookup(rid, probe)
            lat.append(time.perf_counter() - t)
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--subscribers", type=int, default=10)
    ap.add_argument("--out")
    ns = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvtier-stall-")
    daemon = DaemonProcess(work, "--event-log-keys", "65536", "--max-batch-keys", "65536",
                           host_capacity="16MiB").start()
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    subs = [ctx.Process(target=subscribe, args=(daemon.socket, go, out), daemon=True) for _ in range(ns.subscribers)]
    try:
        engine = Sidecar(daemon.socket, client_name="stall-engine")
        lid = engine.register_layout(LAYOUT)
        t0 = time.monotonic()
        step = 65536
        for start in range(0, ns.keys, step):
            engine.report_device_blocks(lid, stored=keys_of(start, min(step, ns.keys - start)), worker_id="w0")
        fill_s = time.monotonic() - t0
        for p in subs:
            p.start()
        rpc = Sidecar(daemon.socket, use_key_table=False, client_name="stall-probe")
        rid = rpc.register_layout(LAYOUT)
        probe = keys_of(0, 8)
        assert rpc.lookup(rid, probe) == ["gpu"] * 8
        time.sleep(3.0)  # the subscribers' interpreters are up, waiting on `go`
        lat: list[float] = []
        stats_lat: list[float] = []
        done = threading.Event()
        timer = threading.Thread(target=time_rpcs, args=(rpc, rid, probe, lat, stats_lat, done))
        timer.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        go.set()
        results = [out.get(timeout=600) for _ in subs]
        snapshot_s = time.monotonic() - t0
        time.sleep(0.5)
        done.set()
        timer.join()
        a = np.array(lat) * 1e3
        st = np.array(stats_lat) * 1e3
        emit({"lookup_p50_ms": round(float(np.percentile(a, 50)), 3), "lookup_p99_ms": round(float(np.percentile(a, 99)), 3),
              "lookup_max_ms": round(float(a.max()), 3), "lookups": len(a),
              "stats_p99_ms": round(float(np.percentile(st, 99)), 3) if len(st) else None,
              "snapshot_s": round(snapshot_s, 2), "keys_per_subscriber": sorted({n for _, n in results}),
              "fill_s": round(fill_s, 1), "daemon_rss_mib": round(rss_bytes(daemon.pid) / 2**20, 1),
              "keys": ns.keys, "subscribers": ns.subscribers, "cpus": os.cpu_count()}, ns.out)
    finally:
        for p in subs:
            if p.is_alive():
                p.kill()
        daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

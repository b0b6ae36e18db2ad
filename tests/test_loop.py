"""The event loop never stalls: feed snapshots built in parts and shared by
subscribers joining at once; the metrics thread reads a consistent copy of the latencies.
(The 2,000,000-key figure is bench/loop_stall.py's.)"""

from __future__ import annotations

import threading

from kvtier.client import Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.daemon.events import PackedKeys
from kvtier.daemon.metrics import OpLatency
from kvtier.proto import locations_pb2, locations_pb2_grpc
from kvtier.tiers.layout import Layout


def test_latency_copies_are_consistent_while_the_loop_observes() -> None:
    lat = OpLatency()
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            lat.observe("lookup", 1.0)  # every observation adds 1 to a bucket and 1.0 to the sum

    t = threading.Thread(target=observe)
    t.start()
    try:
        for _ in range(3000):
            counts, sums = lat.frozen()
            if "lookup" in counts:
                assert sum(counts["lookup"]) == sums["lookup"]
    finally:
        stop.set()
        t.join()


def test_packed_key_slices() -> None:
    keys = [bytes([i]) * 16 for i in range(50)]
    p = PackedKeys(keys)
    assert p[3:17] == keys[3:17] and p[40:100] == keys[40:] and p[10:5] == [] and p[::7] == keys[::7]


def snapshot_keys(socket: str, out: list) -> None:
    ch = open_channel(f"unix:{socket}")
    stream = locations_pb2_grpc.LocationsStub(ch).WatchLocations(locations_pb2.WatchLocationsRequest(subscriber="t"))
    keys, at = [], None
    for reply in stream:
        if reply.HasField("snapshot"):
            at = reply.snapshot.at_seq
            keys += [(e.tier, e.worker_id, k) for e in reply.snapshot.entries for k in e.keys]
            if reply.snapshot.last:
                break
    stream.cancel()
    out.append((at, sorted(keys)))


def test_subscribers_joining_at_once_share_one_exact_snapshot(daemon) -> None:
    layout = Layout.flat(4096)
    keys = [i.to_bytes(16, "little") for i in range(20000)]  # several parts, several chunks
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(layout)
        sc.put(lid, keys[:50], [bytes(4096)] * 50)
        sc.report_device_blocks(lid, stored=keys, worker_id="w0")
        out: list = []
        threads = [threading.Thread(target=snapshot_keys, args=(daemon.socket, out)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        expect = sorted([(2, "", k) for k in keys[:50]] + [(1, "w0", k) for k in keys])
        assert len(out) == 4
        assert all(o == (out[0][0], expect) for o in out)
        assert sc.stats()["counters"]["location_snapshots"] <= 4

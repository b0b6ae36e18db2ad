"""Backpressure and fairness across feeds: a flooding feed (tests/flood_feed.py, a real gRPC
Locations server in its own process) next to two real kvtierds. The router's decisions and the
other feeds' freshness stay within bounds, the flood's inbox overflows are counted, and the
flooding feed resubscribes from snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from _wait import wait_for
from redis_cluster import free_ports
from test_router import LAYOUT, put, session_keys

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.routing.feed import pieces
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.proto import locations_pb2 as L

HERE = os.path.dirname(__file__)
# bounds for a busy 2-core CI machine (the flood takes one core, the router most of the other)
FRESH_S = 3.0       # a quiet daemon's new blocks reach the index within this
DECISION_P99_S = 0.05


@pytest.fixture
def flood():
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "flood_feed.py"), str(port), "F"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("listening"), "flood feed did not start"
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_a_flooding_feed_neither_stalls_decisions_nor_starves_other_feeds(start_daemon, flood) -> None:
    quiet = {n: start_daemon("--node-id", n, name=n, host_capacity="64MiB") for n in "AB"}
    cfg = RouterConfig(daemons=(*(f"unix:{d.socket}" for d in quiet.values()), flood), reconnect_min_s=0.05,
                       reconnect_max_s=0.3, feed_queue_keys=32768, fold_keys=2048)
    sidecars = {n: Sidecar(d.socket) for n, d in quiet.items()}
    lids = {n: sc.register_layout(LAYOUT) for n, sc in sidecars.items()}
    with Router(cfg).start() as r:
        flooder = lambda: next(st for st in r.status() if st.target == flood)  # noqa: E731
        wait_for(lambda: r.wait_synced(0.01, nodes=3) or flooder().overflows, timeout=30,
                 what="the flood running")
        wait_for(lambda: flooder().overflows >= 2, timeout=60, what="the flood's inbox to overflow")
        fresh, took = [], []
        for i in range(20):
            node = "AB"[i % 2]
            keys = session_keys(1000 + i, 8)
            put(sidecars[node], lids[node], keys)
            t0 = time.monotonic()
            while True:  # route meanwhile: each decision timed
                t1 = time.perf_counter()
                d = r.route(keys, dispatch=False)
                took.append(time.perf_counter() - t1)
                if d.ranked[0].worker == node and d.ranked[0].overlap.host == 8:
                    break
                assert time.monotonic() - t0 < FRESH_S, \
                    f"{node}'s blocks not routed to within {FRESH_S} s under the flood: {r.status()}"
                time.sleep(0.002)
            fresh.append(time.monotonic() - t0)
        st = flooder()
        assert st.dropped_events > 0 and st.overflows >= 2, st
        assert st.snapshots >= 2, st  # each overflow resubscribed from a snapshot
        p99 = float(np.percentile(took, 99))
        assert p99 < DECISION_P99_S, f"decision p99 {p99 * 1e3:.1f} ms under the flood ({len(took)} decisions)"
        quiet_st = [s for s in r.status() if s.target != flood]
        assert all(s.overflows == 0 and s.dropped_events == 0 for s in quiet_st), quiet_st
        print(f"freshness max {max(fresh) * 1e3:.0f} ms, decision p99 {p99 * 1e6:.0f} us, flood overflows "
              f"{st.overflows}, dropped {st.dropped_events} events")
    for sc in sidecars.values():
        sc.close()


def test_pieces_fold_as_the_whole_message() -> None:
    """A message split into pieces of at most N keys keeps seqs, head_seq, at_seq, first and last."""
    evs = [L.LocationEvent(seq=i + 1, kind=L.STORED, tier=2, fingerprint=bytes(16),
                           keys=[bytes([i, j]) * 8 for j in range(3 + i % 4)]) for i in range(20)]
    batch = L.WatchLocationsReply(epoch=3, events=L.EventBatch(events=evs, head_seq=25))
    got = pieces(batch, 10)
    assert all(sum(len(e.keys) for e in p.events.events) <= 10 or len(p.events.events) == 1 for p in got)
    assert [e for p in got for e in p.events.events] == evs
    assert {(p.epoch, p.events.head_seq) for p in got} == {(3, 25)}
    snap = L.WatchLocationsReply(epoch=3, snapshot=L.SnapshotPart(at_seq=9, first=True, last=True, entries=evs))
    got = pieces(snap, 10)
    assert len(got) > 2 and [e for p in got for e in p.snapshot.entries] == evs
    assert [(p.snapshot.first, p.snapshot.last) for p in got] == \
        [(True, False)] + [(False, False)] * (len(got) - 2) + [(False, True)]
    assert {p.snapshot.at_seq for p in got} == {9}
    assert pieces(batch, 1000) == [batch]

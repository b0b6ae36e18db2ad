"""A simulated fleet against one router: index memory, ingest rate, decision latency under
ingest, and the hit-rate loss of sparse host/disk indexing, extrapolated to 1,000 nodes.

Three parts, each measured in this process:

1. Hit-rate loss (``--traces``): each public trace replayed (``kvtier.client.tools.replay``)
   at ``--replicas`` replicas with the ``kvtier`` policy, once with the router's dense index
   and once per stride pair with sparse host/disk indexing
   (:mod:`kvtier.client.routing.sparse`): the router folds every gpu event as it does, and
   the host/disk events into :class:`SparseHoldings`; the decision's host and disk leading
   runs are the sparse walk's, continued from the router's gpu run. ``hit_rate_loss`` is the
   dense hit rate less the sparse one (absolute). During the sparse replay each replica's
   estimate is also compared with the dense truth (its tiers' own leading runs) for every
   request: the share above the truth and more than ``stride - 1`` below it.
2. Fleet ingest (``--nodes``): N simulated daemons, each a feed of real
   ``WatchLocationsReply`` messages (a NodeInfo, an empty snapshot, then event batches:
   requests' chains stored in gpu and written through to host, least recently used blocks
   evicted and demoted to disk, at the replay's mix of stored and removed keys), folded by
   one :class:`Router` (``Router.apply``, the fold a route-server's feeds run, in process)
   while a second thread routes requests: events/s sustained, decision latency p50/p99
   under ingest, and the index's bytes (``LocationIndex.nbytes`` and the RSS growth) per
   block held: the bit matrix dense and sparse, and the pairs layout sparse (``--layouts``;
   sparse: the router's ``index_strides``, its decisions walking the sparse runs), and one
   point of ``--wide-nodes`` nodes (1,000) with the pairs layout, sparse: memory and
   decisions at the fleet's width (``wide``).
3. The model: bytes per block (dense gpu, sparse host/disk) and events/s per node, fitted
   over the measured N, extrapolated to ``--fleet-nodes`` nodes of ``--fleet-host-blocks``
   host and ``--fleet-disk-blocks`` disk blocks (1,000 x (1M + 5M)); whether it fits
   ``--replica-gb``.
4. Over real gRPC streams: simulated daemons as real ``kvtier.v1.Locations`` servers
   (:class:`SimLocations`, many per process, ``--feed-procs`` processes, each node on its own
   loopback port: a NodeInfo, the events after a subscriber's position while its ring of
   ``--ring-keys`` keys reaches back that far, else a snapshot of what it holds, then each
   request's events as made, ``--grpc-feed-rate`` (part a) or ``--feed-rate`` (part b)
   requests per node per second, about 170 key events each; every node starts with its host
   and disk tiers full).

   a. Ingest (``--grpc-nodes``): a :class:`Router` in this process follows them
      (``Router.start()``: the feeds, bounded inboxes and folder a route-server runs), dense and
      with ``index_strides=default``, while this thread routes for ``--ingest-s`` seconds:
      key events folded per second (the feeds' seq advance times the 28 keys of each event;
      at most what the daemons offer, so ``offered_key_events_per_s`` is shown next to it,
      with the lag and inbox overflows at the end) and decision latency p50/p99 under that
      ingest (``Router.route`` timed in this thread, as in part 2).
   b. Restart (``--catch-up-nodes``): a real Redis Cluster (tests/redis_cluster.py: three
      masters, TLS and ACL users, as tests/test_router_snapshot.py starts it) and a
      ``kvtier route-server`` process (``--index-strides default``, ``--index-snapshot
      rediss://...``, ``--snapshot-interval-s`` ``--snapshot-interval-s``) following the
      daemons. Once it has caught up and saved a snapshot, it runs ``--run-s`` more seconds,
      is killed with SIGKILL halfway between two snapshots (no snapshot on the way out), no
      router runs for ``--down-s`` seconds while the daemons go on making events, and a fresh
      route-server process starts with the same settings. ``serving_s``: seconds from
      starting that process until its ``Route`` (over its socket) ranks first the node that
      holds a request's blocks, for a request the node stored before the snapshot (in its host
      tier then): the router routes from the loaded snapshot. ``catch_up_s``: seconds from
      starting that process until its ``Status`` lists every feed and says it is no longer
      catching up (every feed connected, its seq at its daemon's newest event as last told).
      Both include the process's start (Python, imports). ``resumes`` and ``snapshots`` say
      how the feeds resumed (from the snapshot's positions, or from a daemon's snapshot);
      ``snapshot_load_s`` and ``router_caught_up_s`` are the route-server's own log's figures
      (reading the snapshot from Redis and loading it; start of its router to caught up);
      ``cold_*`` are the first route-server's, which started with no snapshot. Without
      ``redis-server`` the reason is printed and ``catch_up_s`` is null.

The last line is one JSON object: nodes, blocks_indexed, router_bytes_per_block,
events_per_s, decision_p99_us (part 2's largest sparse point), hit_rate_loss (per trace, at
the default strides), catch_up_s and serving_s (part 4b), grpc_events_per_s and
grpc_decision_p99_us (part 4a's last point), and the details (``curve``, ``model``, ``grpc``,
``restart``; ``sparse_walk_us_python``: the standalone Python walk of part 1, which a router
with the compiled extension does not run, ``sparse_walk_compiled_in_router`` says whether
this one has it). With ``--nodes ""`` parts 2 and 3 are skipped and their figures are null.

    python bench/fleet.py [--nodes 8,32,128] [--traces DIR] [--strides 4:8,8:16,16:32]
                          [--grpc-nodes 16] [--grpc-feed-rate 100] [--catch-up-nodes 16] [--feed-rate 10]
                          [--layouts matrix,pairs] [--wide-nodes 1000] [--plot FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import grpc
import numpy as np

from kvtier.client.routing import index as _index_mod
from kvtier.client.routing.pairs import LOAD_MAX as PAIRS_LOAD_MAX
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.routing.sparse import DEFAULT_STRIDES, SparseHoldings, sample, sparsify
from kvtier.client.tools.replay import Cluster, ReplayConfig, Request, load_trace
from kvtier.proto import locations_pb2 as L
from kvtier.proto import locations_pb2_grpc, router_pb2, router_pb2_grpc
from kvtier.tiers.vocab import Tier

TRACES = {  # file -> the replay's settings for it (the traces' README)
    "conversation_trace.jsonl": {},
    "synthetic_trace.jsonl": {},
    "agentic_sessions.jsonl": {"block_tokens": 256, "gpu_tokens": 300_000, "host_tokens": 2_000_000,
                               "disk_tokens": 8_000_000},
}
_DEEP = (int(Tier.HOST), int(Tier.DISK))


# -- 1. hit-rate loss on the traces ------------------------------------------------------------

class SparseRouting:
    """The replay's ``kvtier`` policy (its :class:`RouterPolicy`, wrapped) with sparse host and
    disk holdings: gpu events reach the router as they are; host and disk events go to a
    :class:`SparseHoldings` (the router sees them with no keys, so its positions follow), and
    the router's holdings are extended by the sparse walk before it scores."""

    follows_feeds = True

    def __init__(self, base, strides: dict[str, int], replicas) -> None:
        self.base, self.reps = base, replicas
        self.sparse = SparseHoldings(strides)
        self._keys: list[bytes] = []
        idx = base.router.index
        dense_holdings = idx.holdings
        sparse = self.sparse
        self.compared = self.above = self.below = 0
        self.bound = max(strides.values()) - 1

        def holdings(found, workers=None, remote=True):
            lead = dense_holdings(found, workers, remote)
            keys = self._keys
            if not keys:
                return lead
            plan = idx.plan()
            ws = plan.workers if workers is None else [plan.workers[i] for i in workers]
            masks = sparse.masks(keys)
            for c, w in enumerate(ws):
                h, d = sparse.extend(keys, w.node_id, int(lead[0, c]), masks)
                lead[1, c] = max(lead[1, c], h)
                lead[2, c] = max(lead[2, c], d)
                lead[3, c] = max(lead[3, c], lead[2, c])
            return lead

        idx.holdings = holdings                         # the sparse walk after the dense gpu run
        idx.decide = lambda *a, **kw: None              # the step-by-step path, which calls holdings

    @property
    def pulled(self):
        return self.base.pulled

    def feed(self, replica: int, reply: L.WatchLocationsReply) -> None:
        node = f"node{replica}"
        self.sparse.fold(node, reply)
        if reply.WhichOneof("body") == "events" and any(ev.tier in _DEEP for ev in reply.events.events):
            out = L.WatchLocationsReply()
            out.CopyFrom(reply)
            for ev in out.events.events:
                if ev.tier in _DEEP:
                    del ev.keys[:]
            reply = out
        self.base.feed(replica, reply)

    def choose(self, req: Request, keys: list[bytes], now: float, reps) -> int:
        self._keys = keys
        self._check(keys)
        return self.base.choose(req, keys, now, reps)

    def served(self, prefill_done_s: float, done_s: float) -> None:
        self.base.served(prefill_done_s, done_s)

    def _check(self, keys: list[bytes]) -> None:
        """Each replica's sparse estimate against its tiers' own leading runs."""
        masks = self.sparse.masks(keys)
        for i, rep in enumerate(self.reps):
            gpu, host, disk = (rep.node._policy.tiers[t] for t in (Tier.GPU, Tier.HOST, Tier.DISK))
            g = 0
            while g < len(keys) and keys[g] in gpu:
                g += 1
            h = g
            while h < len(keys) and (keys[h] in gpu or keys[h] in host):
                h += 1
            d = h
            while d < len(keys) and (keys[d] in gpu or keys[d] in host or keys[d] in disk):
                d += 1
            eh, ed = self.sparse.extend(keys, f"node{i}", g, masks)
            for dense, est in ((h, eh), (d, ed)):
                self.compared += 1
                self.above += est > dense
                self.below += est < dense - self.bound


def replay_hit_rate(requests: Sequence[Request], cfg: ReplayConfig, replicas: int,
                    strides: dict[str, int] | None, check: bool = False) -> dict:
    """One replay with the ``kvtier`` policy: dense (``strides`` None) or sparse."""
    cluster = Cluster(cfg, "kvtier", replicas)
    pol = None
    if strides is not None:
        pol = cluster.policy = SparseRouting(cluster.policy, strides, cluster.replicas)
        if not check:
            pol._check = lambda keys: None
    hits = total = 0
    t0 = time.perf_counter()
    for req in requests:
        _, served, _ = cluster.step(req)
        hits += sum(served)
        total += len(req.keys)
    out = {"hit_rate": hits / total, "wall_s": round(time.perf_counter() - t0, 1)}
    if pol is not None:
        out["records"] = pol.sparse.records
        if check and pol.compared:
            out["above_dense"] = pol.above / pol.compared
            out["below_bound"] = pol.below / pol.compared
    return out


def hit_rate_loss(trace_dir: str, replicas: int, stride_pairs: list[tuple[int, int]], check: bool,
                  limit: int | None) -> dict:
    out = {}
    for name, over in TRACES.items():
        path = os.path.join(trace_dir, name)
        if not os.path.exists(path):
            continue
        requests = load_trace(path)[:limit]
        cfg = replace(ReplayConfig(), **over)
        dense = replay_hit_rate(requests, cfg, replicas, None)
        rows = {"dense": dense}
        for kh, kd in stride_pairs:
            sp = replay_hit_rate(requests, cfg, replicas, {"host": kh, "disk": kd}, check)
            sp["loss"] = dense["hit_rate"] - sp["hit_rate"]
            rows[f"{kh}:{kd}"] = sp
            print(f"# {name} x{replicas} strides host {kh} disk {kd}: {json.dumps(sp)} (dense {dense['hit_rate']:.4f})",
                  file=sys.stderr, flush=True)
        out[name.split("_")[0]] = rows
    return out


# -- 2. fleet ingest ---------------------------------------------------------------------------

FP = bytes(range(16))
BATCH_KEYS = 4096


class SimDaemon:
    """One node's location feed: requests' chains of ``chain`` blocks (the first ``shared``
    blocks of each, a system prompt every node holds) stored in gpu and written through to
    host; gpu and host evict their oldest chains, host's go to disk, disk's are dropped
    (first in, first out by chain: prefix-closed holdings). Messages are serialised as a
    daemon sends them."""

    def __init__(self, i: int, gpu: int, host: int, disk: int, chain: int, shared: int) -> None:
        self.node, self.worker, self.epoch = f"n{i}", f"w{i}", 1000 + i
        self.caps = {Tier.GPU: gpu // chain, Tier.HOST: host // chain, Tier.DISK: disk // chain}
        self.held: dict[Tier, list[int]] = {t: [] for t in self.caps}
        self.chain, self.shared = chain, shared
        self.seq, self.made = 0, 0
        self._base = np.frombuffer(np.uint64(i * 2**40).tobytes(), dtype=np.uint8)
        self.prefix = [b"\x00" * 8 + s.to_bytes(8, "little") for s in range(shared)]

    def keys(self, c: int) -> list[bytes]:
        """Chain ``c``'s own blocks (after the shared prefix): 16-byte keys unique in the fleet."""
        lo = (int(self.node[1:]) << 40) | (c * self.chain)
        return [(lo + j).to_bytes(8, "little") + b"\x01" * 8 for j in range(self.chain - self.shared)]

    def opening(self) -> list[bytes]:
        info = L.NodeInfo(node_id=self.node, epoch=self.epoch)
        info.workers.add(worker_id=self.worker, fingerprints=[FP])
        for t in (Tier.HOST, Tier.DISK):
            info.tiers.add(tier=int(t), capacity_bytes=1 << 40, load_gbps=10.0)
        return [L.WatchLocationsReply(epoch=self.epoch, node=info).SerializeToString(),
                L.WatchLocationsReply(epoch=self.epoch, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True)
                                      ).SerializeToString()]

    def batch(self, n_chains: int) -> tuple[L.EventBatch, int]:
        """The next ``n_chains`` requests' events: (the batch, key events)."""
        batch, events = L.EventBatch(), 0

        def add(kind: int, tier: Tier, ks: list[bytes]) -> None:
            nonlocal events
            self.seq += 1
            events += len(ks)
            batch.events.add(seq=self.seq, kind=kind, tier=int(tier), worker_id=self.worker if tier == Tier.GPU else "",
                             fingerprint=FP, keys=ks)

        for _ in range(n_chains):
            c = self.made
            self.made += 1
            first = c == 0
            ks = (self.prefix if first else []) + self.keys(c)
            add(L.STORED, Tier.GPU, ks)
            add(L.STORED, Tier.HOST, ks)
            for t in (Tier.GPU, Tier.HOST):
                self.held[t].append(c)
            if len(self.held[Tier.GPU]) > self.caps[Tier.GPU]:
                add(L.REMOVED, Tier.GPU, self.keys(self.held[Tier.GPU].pop(0)))
            if len(self.held[Tier.HOST]) > self.caps[Tier.HOST]:
                demoted = self.held[Tier.HOST].pop(0)
                old = self.keys(demoted)
                add(L.REMOVED, Tier.HOST, old)
                add(L.STORED, Tier.DISK, old)
                self.held[Tier.DISK].append(demoted)
                if len(self.held[Tier.DISK]) > self.caps[Tier.DISK]:
                    add(L.REMOVED, Tier.DISK, self.keys(self.held[Tier.DISK].pop(0)))
        batch.head_seq = self.seq
        return batch, events

    def step(self, n_chains: int, strides: dict[str, int] | None) -> tuple[bytes, int]:
        """The next ``n_chains`` requests' events as one message: (serialised, key events)."""
        batch, events = self.batch(n_chains)
        reply = L.WatchLocationsReply(epoch=self.epoch, events=batch)
        if strides is not None:
            reply = sparsify(reply, strides)
        return reply.SerializeToString(), events

    def snapshot(self, part_keys: int = 4096) -> list[L.WatchLocationsReply]:
        """What the node holds now, as a daemon's snapshot parts (at its current seq)."""
        entries = []
        for t in (Tier.GPU, Tier.HOST, Tier.DISK):
            ks = [k for c in self.held[t] for k in self.keys(c)]
            if t != Tier.DISK and self.made:
                ks = self.prefix + ks
            for i in range(0, len(ks), part_keys):
                entries.append(L.LocationEvent(seq=self.seq, kind=L.STORED, tier=int(t), fingerprint=FP,
                                               worker_id=self.worker if t == Tier.GPU else "",
                                               keys=ks[i:i + part_keys]))
        parts = [entries[i:i + 1] for i in range(len(entries))] or [[]]
        return [L.WatchLocationsReply(epoch=self.epoch, snapshot=L.SnapshotPart(
            at_seq=self.seq, first=i == 0, last=i == len(parts) - 1, entries=es)) for i, es in enumerate(parts)]

    def holdings(self, tiers: Sequence[Tier] = (Tier.GPU, Tier.HOST, Tier.DISK)) -> int:
        """Blocks held in these tiers, each tier's holding counted."""
        return sum(len(self.held[t]) for t in tiers) * (self.chain - self.shared)

    def query(self, rng: random.Random) -> list[bytes]:
        """A request: the shared prefix and one of this node's recent chains (a later turn)."""
        c = self.held[Tier.HOST][rng.randrange(len(self.held[Tier.HOST]))] if self.held[Tier.HOST] else 0
        return self.prefix + self.keys(c)


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> None:
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def fleet_point(n: int, strides: dict[str, int] | None, gpu: int, host: int, disk: int, chain: int,  # noqa: PLR0915
                churn_chains: int, seed: int = 0, layout: str = "matrix") -> dict:
    """N daemons folded by one router (its index of ``layout``): fill every node's tiers, then
    churn while routing."""
    rng = random.Random(seed)
    shared = 4
    daemons = [SimDaemon(i, gpu, host, disk, chain, shared) for i in range(n)]
    fill = (host + disk) // chain + 1  # chains until host and disk are full
    per_msg = max(1, BATCH_KEYS // (6 * chain))
    # the messages, made before the clock starts
    fill_msgs = [[] for _ in range(n)]
    fill_events = 0
    for d in daemons:
        msgs = fill_msgs[d.epoch - 1000]
        msgs.extend(d.opening())
        done = 0
        while done < fill:
            m, e = d.step(min(per_msg, fill - done), None)  # (the router indexes sparsely itself)
            msgs.append(m)
            fill_events += e
            done += per_msg
    churn_msgs: list[tuple[int, bytes]] = []
    churn_events = 0
    for _ in range(max(1, churn_chains // per_msg)):
        for i, d in enumerate(daemons):
            m, e = d.step(per_msg, None)
            churn_msgs.append((i, m))
            churn_events += e
    queries = [daemons[rng.randrange(n)].query(rng) for _ in range(4000)]
    gc.collect()
    malloc_trim()
    before = rss()
    router = Router(RouterConfig(new_session_spread=0.0, index_layout=layout,
                                 index_strides=",".join(f"{t}={k}" for t, k in strides.items()) if strides else ""))
    parse = L.WatchLocationsReply.FromString
    t0 = time.perf_counter()
    for i, msgs in enumerate(fill_msgs):
        for m in msgs:
            router.apply(daemons[i].node, parse(m))
    fill_s = time.perf_counter() - t0
    gc.collect()
    malloc_trim()
    idx_bytes = router.index.nbytes()
    grown = rss() - before  # the messages are still held, as before the fold
    del fill_msgs
    rows = len(router.index)
    held = sum(d.holdings() for d in daemons)
    deep = sum(d.holdings((Tier.HOST, Tier.DISK)) for d in daemons)
    gpu_held = held - deep
    # churn while a second thread routes: decision latency under ingest
    lat: list[float] = []
    stop = threading.Event()

    def route() -> None:
        j = 0
        while not stop.is_set():
            q = queries[j % len(queries)]
            j += 1
            t = time.perf_counter()
            d = router.route(q, dispatch=True)
            lat.append(time.perf_counter() - t)
            router.finish(d.decision_id)

    th = threading.Thread(target=route)
    th.start()
    t0 = time.perf_counter()
    for i, m in churn_msgs:
        router.apply(daemons[i].node, parse(m))
    churn_s = time.perf_counter() - t0
    stop.set()
    th.join()
    quiet = []
    for q in queries[:2000]:
        t = time.perf_counter()
        d = router.route(q, dispatch=True)
        quiet.append(time.perf_counter() - t)
        router.finish(d.decision_id)
    a, b = np.array(lat) * 1e6, np.array(quiet) * 1e6
    return {"nodes": n, "sparse": strides is not None, "layout": layout, "blocks_held": held, "deep_held": deep, "gpu_held": gpu_held,
            "rows": rows,
            "index_bytes": idx_bytes, "rss_bytes": grown,
            "index_bytes_per_block": idx_bytes / held, "rss_bytes_per_block": grown / held,
            "index_bytes_per_row": idx_bytes / rows, "columns": router.index.columns,
            "fill_events_per_s": fill_events / fill_s, "churn_events_per_s": churn_events / churn_s,
            "decisions_under_ingest": len(a),
            "decision_p50_us": float(np.percentile(a, 50)) if len(a) else None,
            "decision_p99_us": float(np.percentile(a, 99)) if len(a) else None,
            "quiet_p50_us": float(np.percentile(b, 50)), "quiet_p99_us": float(np.percentile(b, 99))}


# -- 3. the model ------------------------------------------------------------------------------

def model(points: list[dict], fleet_nodes: int, gpu_blocks: int, host_blocks: int, disk_blocks: int,
          replica_gb: float, run_blocks: int, strides: dict[str, int]) -> dict:
    """Fit the index's bytes per row as key bytes + one bit per column (measured: the key
    table's bytes per row at each N, less the matrix's words per row), and the sparse tiers'
    records per held block (measured in the simulation; for the fleet, from its runs of
    ``run_blocks``), then project to the fleet: the router's bit matrix (every row as wide as
    the fleet's columns) and per-location tables of recorded keys."""
    matrix = [p for p in points if p.get("layout", "matrix") == "matrix"]
    paired = [p for p in points if p.get("layout") == "pairs"]
    sp = [p for p in matrix if p["sparse"]]
    key_bytes = float(np.mean([p["index_bytes_per_row"] - 8 * -(-p["columns"] // 64) for p in matrix]))
    measured_share = float(np.mean([(p["rows"] - p["gpu_held"]) / p["deep_held"] for p in sp])) if sp else 1.0
    run = list(range(run_blocks))
    share = ((host_blocks * len(sample(run, strides["host"])) + disk_blocks * len(sample(run, strides["disk"])))
             / run_blocks / (host_blocks + disk_blocks))
    cols = 5 * fleet_nodes + 2  # per node: gpu, host, disk; per worker two speculative (one worker a node)
    row = key_bytes + 8 * -(-cols // 64)
    deep = fleet_nodes * (host_blocks + disk_blocks)
    gpu = fleet_nodes * gpu_blocks
    dense_rows = deep  # gpu blocks are written through to host: no rows of their own
    sparse_rows = gpu + share * deep
    ingest = min(p["churn_events_per_s"] for p in points)
    rec = 16 / 0.8 + 2  # a recorded key in a per-location open table: 16-byte key at 80 % load, 2-byte location
    # the pairs layout, built: a pair per recorded key and location (a row of the matrix's model
    # is one location's key), at the bytes per pair measured (growth slack included) and at
    # the table's load limit (an index sized up front: --index-capacity)
    per_pair = float(np.mean([p["index_bytes"] / p["rows"] for p in paired])) if paired else None
    full_pair = 10 / PAIRS_LOAD_MAX
    pairs_gb = sparse_rows * per_pair / 1e9 if per_pair is not None else None
    return {"pairs_bytes_per_pair": round(per_pair, 2) if per_pair is not None else None,
            "pairs_bytes_per_pair_sized": full_pair,
            "sparse_pairs_gb": round(pairs_gb, 1) if pairs_gb is not None else None,
            "sparse_pairs_sized_gb": round(sparse_rows * full_pair / 1e9, 1),
            "fits_pairs": pairs_gb is not None and pairs_gb <= replica_gb,
            "fits_pairs_sized": sparse_rows * full_pair / 1e9 <= replica_gb,"fleet_nodes": fleet_nodes, "blocks": deep + gpu, "columns": cols, "key_bytes_per_row": round(key_bytes, 1),
            "matrix_bytes_per_row": round(row, 1), "sparse_row_share": round(share, 4),
            "sparse_row_share_simulated": round(measured_share, 4), "fleet_run_blocks": run_blocks,
            "dense_matrix_gb": round(dense_rows * row / 1e9, 1), "sparse_matrix_gb": round(sparse_rows * row / 1e9, 1),
            "sparse_per_location_gb": round((gpu + share * deep) * rec / 1e9, 1),
            "fits_replica_gb": replica_gb,
            "fits_matrix": sparse_rows * row / 1e9 <= replica_gb,
            "fits_per_location": (gpu + share * deep) * rec / 1e9 <= replica_gb,
            "router_key_events_per_s": round(ingest),  # the slowest measured point's ingest while routing
            "per_node_key_events_per_s_at_fleet": round(ingest / fleet_nodes, 1)}


def plot(result: dict, path: str, gpu_blocks: int, host_blocks: int, disk_blocks: int) -> None:
    """The curve: each layout's measured bytes per block by nodes (points, the wide point
    included), and the modelled index of a fleet of N nodes of the fleet model's blocks, in GB
    per replica, by layout (lines), against the replica's budget."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    m = result["model"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (lay, sparse), label in (((("matrix", False)), "bit matrix, dense"), (("matrix", True), "bit matrix, sparse"),
                                 (("pairs", True), "pairs, sparse")):
        pts = [p for p in result["curve"] if p.get("layout", "matrix") == lay and p["sparse"] == sparse]
        if lay == "pairs" and result.get("wide"):
            pts = pts + [result["wide"]]
        if pts:
            ax1.plot([p["nodes"] for p in pts], [p["index_bytes_per_block"] for p in pts], "o-", label=label)
    ax1.set(xscale="log", yscale="log", xlabel="nodes (measured)", ylabel="index bytes per block held",
            title="Measured (bench/fleet.py)")
    ax1.legend()
    nodes = np.array([8, 32, 128, 256, 512, 1000, 2000])
    deep = nodes * (host_blocks + disk_blocks)
    sparse_rows = nodes * gpu_blocks + m["sparse_row_share"] * deep
    width = 8 * np.ceil((5 * nodes + 2) / 64)
    lines = {"bit matrix, dense": deep * (m["key_bytes_per_row"] + width),
             "bit matrix, sparse": sparse_rows * (m["key_bytes_per_row"] + width)}
    if m.get("pairs_bytes_per_pair"):
        lines["pairs, sparse"] = sparse_rows * m["pairs_bytes_per_pair"]
        lines["pairs, sparse, sized"] = sparse_rows * m["pairs_bytes_per_pair_sized"]
    for label, total in lines.items():
        ax2.plot(nodes, total / 1e9, "-", label=label)
    ax2.axhline(m["fits_replica_gb"], color="k", ls="--", lw=1, label=f"{m['fits_replica_gb']:g} GB replica")
    ax2.set(xscale="log", yscale="log", xlabel="nodes (model)", ylabel="GB per router replica")
    ax2.set_title(f"Model, a node: {gpu_blocks / 1e3:g}k gpu, {host_blocks / 1e6:g}M host, {disk_blocks / 1e6:g}M "
                  f"disk blocks", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def walk_cost_us(workers: int, n_keys: int = 128, reps: int = 200) -> float:
    """The standalone Python sparse walk's cost per decision (:class:`SparseHoldings`: every
    worker's host and disk walk over a request's keys), the reference the replay's hit-rate
    part uses. Not what a router pays: a router built with the compiled extension walks in
    ``_route.c`` within its decision (``decision_p99_us`` includes it), and without it, with
    ``LocationIndex``'s own numpy walk (``sparse_walk_compiled_in_router`` says which)."""
    sh = SparseHoldings(DEFAULT_STRIDES)
    keys = [i.to_bytes(16, "little") for i in range(n_keys)]
    for w in range(workers):
        sh.stored(f"n{w}", "host", keys[: n_keys // 2])
        sh.stored(f"n{w}", "disk", keys)
    t0 = time.perf_counter()
    for _ in range(reps):
        m = sh.masks(keys)
        for w in range(workers):
            sh.extend(keys, f"n{w}", 0, m)
    return (time.perf_counter() - t0) / reps * 1e6


# -- 4. over real gRPC streams: simulated daemons, a route-server restarted from a snapshot -------

HEARTBEAT_S = 2.0


class SimLocations(locations_pb2_grpc.LocationsServicer):
    """One simulated daemon's ``kvtier.v1.Locations`` service, as kvtierd speaks it: a
    NodeInfo, then the events after the subscriber's position when its ring (``ring_keys``
    keys of events) still reaches back that far, else a snapshot of what the node holds, then
    the events as they are made (an empty batch as a heartbeat when there are none)."""

    def __init__(self, daemon: SimDaemon, ring_keys: int) -> None:
        self.d, self.ring_keys = daemon, ring_keys
        self.ring: deque[L.LocationEvent] = deque()
        self.held_keys = 0
        self.changed = asyncio.Event()
        self.snapshots = self.resumes = 0

    def publish(self, batch: L.EventBatch) -> None:
        for ev in batch.events:
            self.ring.append(ev)
            self.held_keys += len(ev.keys)
        while self.held_keys > self.ring_keys and len(self.ring) > 1:
            self.held_keys -= len(self.ring.popleft().keys)
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def since(self, pos: int, max_keys: int = BATCH_KEYS) -> list[L.LocationEvent] | None:
        """Events after ``pos`` (at most about ``max_keys`` keys), or None when the ring no
        longer reaches back to it."""
        first = self.ring[0].seq if self.ring else self.d.seq + 1
        if pos < first - 1:
            return None
        out, n = [], 0
        for ev in itertools.islice(self.ring, pos - first + 1, None):
            out.append(ev)
            n += len(ev.keys)
            if n >= max_keys:
                break
        return out

    async def WatchLocations(self, request, context):  # noqa: N802, ANN001, ANN201
        d = self.d
        info = L.NodeInfo(node_id=d.node, epoch=d.epoch, head_seq=d.seq)
        info.workers.add(worker_id=d.worker, fingerprints=[FP])
        for t in (Tier.HOST, Tier.DISK):
            info.tiers.add(tier=int(t), capacity_bytes=1 << 40, load_gbps=10.0)
        yield L.WatchLocationsReply(epoch=d.epoch, node=info)
        pos = None
        if request.epoch == d.epoch and request.from_seq <= d.seq and self.since(request.from_seq, 1) is not None:
            pos = request.from_seq
            self.resumes += 1
        while True:
            if pos is None:
                self.snapshots += 1
                pos = d.seq
                for part in d.snapshot():
                    yield part
            evs = self.since(pos)
            if evs is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "subscriber fell behind the ring; resubscribe")
            if evs:
                pos = evs[-1].seq
                yield L.WatchLocationsReply(epoch=d.epoch, events=L.EventBatch(events=evs, head_seq=d.seq))
                continue
            try:
                await asyncio.wait_for(self.changed.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                yield L.WatchLocationsReply(epoch=d.epoch, events=L.EventBatch(head_seq=d.seq))


async def serve_feeds(first: int, count: int, gpu: int, host: int, disk: int, chain: int, rate: float,
                      ring_keys: int) -> None:
    """Nodes ``first`` .. ``first + count - 1``, each a :class:`SimLocations` on its own
    loopback port, filled (host and disk full), then making ``rate`` requests' events per
    second each; prints ``listening PORT,PORT,...`` once they serve."""
    services, servers, ports = [], [], []
    fill = (host + disk) // chain + 1
    for i in range(first, first + count):
        d = SimDaemon(i, gpu, host, disk, chain, 4)
        while d.made < fill:
            d.batch(min(64, fill - d.made))
        svc = SimLocations(d, ring_keys)
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        locations_pb2_grpc.add_LocationsServicer_to_server(svc, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        services.append(svc)
        servers.append(server)
    print("listening " + ",".join(map(str, ports)), flush=True)
    t0, due = time.monotonic(), 0.0
    made = 0
    while True:
        await asyncio.sleep(0.05)
        due = (time.monotonic() - t0) * rate
        n = int(due) - made
        if n <= 0:
            continue
        made += n
        for svc in services:
            batch, _ = svc.d.batch(n)
            svc.publish(batch)


class FeedServers:
    """``procs`` processes of simulated daemons (``python bench/fleet.py --serve-feeds``), N
    nodes in all; ``targets`` are their loopback addresses, node ``n{i}`` at ``targets[i]``."""

    def __init__(self, n: int, procs: int, node_blocks: str, chain: int, rate: float, ring_keys: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.targets: list[str] = []
        per = -(-n // procs)
        try:
            for first in range(0, n, per):
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--serve-feeds", f"{first}:{min(per, n - first)}",
                     "--node-blocks", node_blocks, "--chain", str(chain), "--feed-rate", str(rate),
                     "--ring-keys", str(ring_keys)], stdout=subprocess.PIPE, text=True))
            for p in self.procs:
                line = p.stdout.readline()
                if not line.startswith("listening"):
                    raise RuntimeError(f"a feed server did not start (exit {p.poll()})")
                self.targets += [f"127.0.0.1:{x}" for x in line.split()[1].split(",")]
            self.started = time.time()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def grpc_ingest(n: int, args: argparse.Namespace, strides: str) -> dict:
    """N simulated daemons over real gRPC streams into one in-process :class:`Router`
    (``Router.start()``: its feeds, inboxes and folder, as a route-server runs them), while a
    second thread routes: key events folded per second (events folded, from the feeds' seqs,
    times the keys per event) and decision latency under that ingest."""
    gpu, host, disk = (int(x) for x in args.node_blocks.split(":"))
    feeds = FeedServers(n, args.feed_procs, args.node_blocks, args.chain, args.grpc_feed_rate, args.ring_keys)
    router = None
    try:
        t0 = time.perf_counter()
        router = Router(RouterConfig(daemons=tuple(feeds.targets), index_strides=strides, new_session_spread=0.0,
                                     reconnect_min_s=0.05, reconnect_max_s=0.5)).start()
        synced = router.wait_synced(120, nodes=n)
        sync_s = time.perf_counter() - t0
        rng = random.Random(1)
        queries = [SimDaemon(i, gpu, host, disk, args.chain, 4).prefix
                   + SimDaemon(i, gpu, host, disk, args.chain, 4).keys(rng.randrange(200, 700))
                   for i in (rng.randrange(n) for _ in range(1000))]
        seq0 = {st.target: st.seq for st in router.status()}
        lat: list[float] = []
        t1 = time.perf_counter()
        j = 0
        while time.perf_counter() - t1 < args.ingest_s:
            q = queries[j % len(queries)]
            j += 1
            t = time.perf_counter()
            d = router.route(q, dispatch=True)
            lat.append(time.perf_counter() - t)
            router.finish(d.decision_id)
            time.sleep(0.0005)
        span = time.perf_counter() - t1
        sts = router.status()
        folded = sum(st.seq - seq0.get(st.target, st.seq) for st in sts)
        a = np.array(lat) * 1e6
        keys_per_event = args.chain - 4
        return {"nodes": n, "index_strides": strides or "off", "synced": synced, "sync_s": round(sync_s, 2),
                "offered_key_events_per_s": round(n * args.grpc_feed_rate * 6 * keys_per_event),
                "events_per_s": round(folded * keys_per_event / span), "decisions": len(a),
                "decision_p50_us": round(float(np.percentile(a, 50)), 1),
                "decision_p99_us": round(float(np.percentile(a, 99)), 1),
                "lag_events_at_end": sum(max(st.head_seq - st.seq, 0) for st in sts),
                "overflows": sum(st.overflows for st in sts), "indexed_keys": router.indexed_keys()}
    finally:
        feeds.stop()  # (either order: Router.close ends its streams before its loop closes)
        if router is not None:
            router.close()


def _tests_support() -> None:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    if here not in sys.path:
        sys.path.insert(0, here)


def _route_server(tmp: str, tag: str, targets: list[str], extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    sock = os.path.join(tmp, f"{tag}.sock")
    logf = os.path.join(tmp, f"{tag}.log")
    args = [sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"unix:{sock}",
            "--reconnect-min-s", "0.05", "--reconnect-max-s", "0.5", *extra]
    for t in targets:
        args += ["--daemon", t]
    with open(logf, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"unix:{sock}", logf


def _poll(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, logf: str = "") -> float:  # noqa: ANN001
    """Poll ``cond`` until true; the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = open(logf, errors="replace").read()[-2000:] if logf else ""
            raise RuntimeError(f"the route-server exited ({proc.returncode}) waiting for {what}:\n{tail}")
        try:
            if cond():
                return time.monotonic()
        except grpc.RpcError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{what} not within {timeout} s")


_CAUGHT_UP = r"every feed caught up ([0-9.]+) s after start"


def _logged(path: str, pattern: str) -> float | None:
    """The number the last log line matching ``pattern`` gives, or None."""
    found = re.findall(pattern, open(path, errors="replace").read())
    return float(found[-1]) if found else None


def catch_up(n: int, args: argparse.Namespace, strides: str, layout: str = "matrix") -> dict:  # noqa: PLR0915
    """A route-server (its index of ``layout``) restarted from its index snapshot (see the
    module docstring, part 4)."""
    _tests_support()
    from redis_cluster import MISSING, REDIS_CLI, REDIS_SERVER, RedisCluster  # noqa: PLC0415

    if not (REDIS_SERVER and REDIS_CLI):
        raise RuntimeError(MISSING)
    gpu, host, disk = (int(x) for x in args.node_blocks.split(":"))
    cluster = RedisCluster(secure=True, maxmemory="1gb").start()
    feeds = None
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="kvtier-fleet-")
    try:
        feeds = FeedServers(n, args.feed_procs, args.node_blocks, args.chain, args.feed_rate, args.ring_keys)
        snap = ["--index-snapshot", f"rediss://{cluster.nodes}", "--snapshot-tls-ca", cluster.file("redis-ca.pem"),
                "--snapshot-tls-cert", cluster.file("kvtier-client.pem"), "--snapshot-tls-key",
                cluster.file("kvtier-client.key"), "--snapshot-user", cluster.USER, "--snapshot-password-file",
                cluster.file("store-password"), "--snapshot-name", "fleet-bench"]
        common = (["--index-strides", strides] if strides else []) + ["--index-layout", layout]

        def manifest() -> dict | None:
            c = cluster.client()
            try:
                raw = c.get("kvtier:router:{fleet-bench}:latest")
            finally:
                c.close()
            return json.loads(raw) if raw else None

        def status(target: str) -> router_pb2.RouterStatusReply:
            with grpc.insecure_channel(target) as ch:
                return router_pb2_grpc.RouterStub(ch).Status(router_pb2.RouterStatusRequest(), timeout=5)

        def caught_up(target: str) -> bool:
            st = status(target)
            return len(st.feeds) == n and not st.catching_up

        fill = (host + disk) // args.chain + 1

        def probe(at: float) -> tuple[str, list[bytes]]:
            """A request for a chain the last node stored 32 requests before wall time ``at``
            (then in its host tier, its gpu copy evicted): the node and the keys."""
            made = fill + int((at - feeds.started) * args.feed_rate)
            d = SimDaemon(n - 1, gpu, host, disk, args.chain, 4)
            return d.node, d.prefix + d.keys(max(0, made - 32))

        def serving(target: str, at: float) -> bool:
            node, keys = probe(at)
            with grpc.insecure_channel(target) as ch:
                got = router_pb2_grpc.RouterStub(ch).Route(router_pb2.RouteRequest(keys=keys), timeout=5)
            top = got.ranked[0] if got.ranked else None
            return top is not None and top.node_id == node and top.overlap.host + top.overlap.disk > 0

        def run(tag: str, extra: list[str]) -> tuple[subprocess.Popen, str, str, float]:
            t = time.monotonic()
            proc, target, logf = _route_server(tmp, tag, feeds.targets, [*common, *extra])
            procs.append(proc)
            return proc, target, logf, t

        # the first replica: every daemon's snapshot, then the live events; snapshots every interval
        proc, target, first_log, t0 = run("first", [*snap, "--snapshot-interval-s", str(args.snapshot_interval_s)])
        logf = first_log
        t_cold_serve = _poll(lambda: serving(target, time.time()), 300, "the first router to serve", proc, logf) - t0
        t_cold = _poll(lambda: caught_up(target), 300, "the first router to catch up", proc, logf) - t0
        # run on; kill it (no snapshot on the way out) halfway between two snapshots
        gen0 = (manifest() or {}).get("gen", 0)
        _poll(lambda: (manifest() or {}).get("gen", 0) > gen0, 60 + 3 * args.snapshot_interval_s,
              "a snapshot taken mid-run", proc, logf)
        time.sleep(args.run_s)
        m = manifest()
        wait = args.snapshot_interval_s / 2 - (time.time() - m["saved_at"])
        if wait > 0:
            time.sleep(wait)
        m = manifest()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.time()
        pos = {k: tuple(v) for k, v in m["positions"].items()}
        saved_at = m["saved_at"]
        # down for a while; the daemons keep making events
        time.sleep(args.down_s)
        proc, target, logf, t0 = run("restarted", [*snap, "--snapshot-interval-s", "600"])
        t_serve = _poll(lambda: serving(target, saved_at), 300, "the restarted router to serve", proc, logf) - t0
        t_caught = _poll(lambda: caught_up(target), 300, "the restarted router to catch up", proc, logf) - t0
        st = status(target)
        _poll(lambda: _logged(logf, _CAUGHT_UP) is not None, 10, "the route-server's caught-up log line", proc, logf)
        behind = sum(f.seq for f in st.feeds) - sum(p[1] for p in pos.values())
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        loaded = _logged(logf, r"index snapshot .* loaded: .* in ([0-9.]+) s")
        cold_caught = _logged(first_log, _CAUGHT_UP)
        caught = _logged(logf, _CAUGHT_UP)
        return {"nodes": n, "index_strides": strides or "off", "index_layout": layout, "snapshot_bytes": m["bytes"],
                "snapshot_keys": m["keys"], "snapshot_age_at_kill_s": round(killed - m["saved_at"], 2),
                "down_s": args.down_s, "offered_key_events_per_s": round(n * args.feed_rate * 6 * (args.chain - 4)),
                "events_since_snapshot_at_caught_up": behind,
                "serving_s": round(t_serve, 2), "catch_up_s": round(t_caught, 2),
                "resumes": sum(f.resumes for f in st.feeds), "snapshots": sum(f.snapshots for f in st.feeds),
                "overflows": sum(f.overflows for f in st.feeds),
                "cold_serving_s": round(t_cold_serve, 2), "cold_catch_up_s": round(t_cold, 2),
                "snapshot_load_s": loaded, "router_caught_up_s": caught, "cold_router_caught_up_s": cold_caught}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if feeds is not None:
            feeds.stop()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:  # noqa: C901, PLR0915
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,32,128", help="fleet sizes measured [%(default)s]")
    ap.add_argument("--node-blocks", default="512:4096:20480", help="per node gpu:host:disk blocks [%(default)s]")
    ap.add_argument("--chain", type=int, default=32, help="blocks a request stores [%(default)s]")
    ap.add_argument("--churn-chains", type=int, default=256, help="requests per node while routing [%(default)s]")
    ap.add_argument("--layouts", default="matrix,pairs",
                    help="index layouts measured in part 2: matrix dense and sparse, pairs sparse [%(default)s]")
    ap.add_argument("--wide-nodes", type=int, default=1000,
                    help="a part-2 point of this many nodes, each of --wide-node-blocks, with the pairs layout and "
                         "sparse host/disk: memory and decisions at the fleet's width (0: none) [%(default)s]")
    ap.add_argument("--wide-node-blocks", default="128:512:2048", help="per node gpu:host:disk blocks of that point "
                    "[%(default)s]")
    ap.add_argument("--traces", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces"),
                    help="folder of the three public traces (none there: no hit-rate part) [%(default)s]")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--strides", default="4:8,8:16,16:32", help="host:disk stride pairs replayed [%(default)s]")
    ap.add_argument("--trace-requests", type=int, default=None, help="only the first N requests of each trace")
    ap.add_argument("--fleet-nodes", type=int, default=1000)
    ap.add_argument("--fleet-gpu-blocks", type=int, default=160_000, help="per node (8 GPUs x 40 GiB of 2 MiB blocks)")
    ap.add_argument("--fleet-host-blocks", type=int, default=1_000_000)
    ap.add_argument("--fleet-disk-blocks", type=int, default=5_000_000)
    ap.add_argument("--replica-gb", type=float, default=16.0)
    ap.add_argument("--fleet-run-blocks", type=int, default=512,
                    help="blocks a put stores at once in the fleet (an 8k-token prompt of 16-token blocks) [%(default)s]")
    ap.add_argument("--grpc-nodes", default="16", help="fleet sizes fed over real gRPC streams (empty: none) "
                    "[%(default)s]")
    ap.add_argument("--catch-up-nodes", type=int, default=16,
                    help="simulated daemons of the route-server restarted from a snapshot (0: none) [%(default)s]")
    ap.add_argument("--feed-rate", type=float, default=10.0,
                    help="requests per second each simulated daemon stores while route-servers restart (about 170 key "
                         "events each) "
                         "[%(default)s]")
    ap.add_argument("--grpc-feed-rate", type=float, default=100.0,
                    help="requests per second each simulated daemon stores while the in-process router ingests "
                         "over gRPC [%(default)s]")
    ap.add_argument("--feed-procs", type=int, default=2, help="processes serving the simulated daemons [%(default)s]")
    ap.add_argument("--ring-keys", type=int, default=1 << 20,
                    help="keys of events each simulated daemon keeps for resuming subscribers [%(default)s]")
    ap.add_argument("--ingest-s", type=float, default=10.0, help="seconds routing while ingesting over gRPC")
    ap.add_argument("--snapshot-interval-s", type=float, default=2.0,
                    help="the first route-server's --snapshot-interval-s [%(default)s]")
    ap.add_argument("--run-s", type=float, default=3.0,
                    help="seconds the first route-server runs on after its first snapshot [%(default)s]")
    ap.add_argument("--down-s", type=float, default=3.0,
                    help="seconds no route-server runs between the kill and the restart [%(default)s]")
    ap.add_argument("--plot", default="", help="write the curve (measured bytes per block, the modelled GB per "
                    "replica by nodes) to this PNG (needs matplotlib)")
    ap.add_argument("--serve-feeds", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    gpu, host, disk = (int(x) for x in args.node_blocks.split(":"))
    if args.serve_feeds:
        first, count = (int(x) for x in args.serve_feeds.split(":"))
        asyncio.run(serve_feeds(first, count, gpu, host, disk, args.chain, args.feed_rate, args.ring_keys))
        return {}
    strides = dict(DEFAULT_STRIDES)
    points = []
    layouts = [x for x in args.layouts.split(",") if x]
    runs = [(st, lay) for lay in layouts for st in ((None, strides) if lay == "matrix" else (strides,))]
    for n in [int(x) for x in args.nodes.split(",") if x]:
        for st, lay in runs:
            p = fleet_point(n, st, gpu, host, disk, args.chain, args.churn_chains, layout=lay)
            points.append(p)
            print("# " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in p.items()}),
                  file=sys.stderr, flush=True)
    wide = None
    if args.wide_nodes and "pairs" in layouts:
        wg, wh, wd = (int(x) for x in args.wide_node_blocks.split(":"))
        wide = fleet_point(args.wide_nodes, strides, wg, wh, wd, args.chain, max(8, args.churn_chains // 16),
                           layout="pairs")
        print("# wide " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in wide.items()}),
              file=sys.stderr, flush=True)
    pairs = [tuple(int(y) for y in x.split(":")) for x in args.strides.split(",") if x]
    default = (strides["host"], strides["disk"])
    if default not in pairs:
        pairs.append(default)
    loss = hit_rate_loss(args.traces, args.replicas, pairs, True, args.trace_requests) if os.path.isdir(args.traces) else {}
    grpc_points = []
    for n in [int(x) for x in args.grpc_nodes.split(",") if x and int(x) > 0]:
        for st in ("", "default"):
            p = grpc_ingest(n, args, st)
            grpc_points.append(p)
            print("# grpc " + json.dumps(p), file=sys.stderr, flush=True)
    restart = None
    if args.catch_up_nodes:
        try:
            restart = catch_up(args.catch_up_nodes, args, "default", "pairs" if "pairs" in layouts else "matrix")
            print("# catch-up " + json.dumps(restart), file=sys.stderr, flush=True)
        except (RuntimeError, OSError, TimeoutError) as e:
            print(f"# catch-up not measured: {e}", file=sys.stderr, flush=True)
    m = big = dense = sparse_matrix = None
    if points:
        m = model(points, args.fleet_nodes, args.fleet_gpu_blocks, args.fleet_host_blocks, args.fleet_disk_blocks,
                  args.replica_gb, args.fleet_run_blocks, strides)
        fleet_layout = "pairs" if "pairs" in layouts else "matrix"
        big = max((p for p in points if p["sparse"] and p["layout"] == fleet_layout), key=lambda p: p["nodes"])
        dense = next((p for p in points if not p["sparse"] and p["nodes"] == big["nodes"]), None)
        sparse_matrix = next((p for p in points if p["sparse"] and p["layout"] == "matrix"
                              and p["nodes"] == big["nodes"]), None)
    else:
        print("# no --nodes: fleet ingest (part 2) and the model (part 3) skipped", file=sys.stderr, flush=True)

    def of(point: dict | None, key: str, digits: int | None = None) -> float | None:
        """A figure of a part-2 point (None without one), rounded to ``digits`` (0: an int)."""
        if point is None:
            return None
        v = point[key]
        return v if digits is None else round(v) if digits == 0 else round(v, digits)

    result = {"nodes": of(big, "nodes"), "blocks_indexed": of(big, "blocks_held"),
              "router_bytes_per_block": of(big, "index_bytes_per_block", 2),
              "router_bytes_per_block_dense": of(dense, "index_bytes_per_block", 2),
              "router_bytes_per_block_matrix_sparse": of(sparse_matrix, "index_bytes_per_block", 2),
              "index_layout": of(big, "layout"),
              "wide": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in wide.items()} if wide else None,
              "wide_decision_p99_us": of(wide, "decision_p99_us", 1),
              "wide_bytes_per_block": of(wide, "index_bytes_per_block", 2),
              "events_per_s": of(big, "churn_events_per_s", 0), "decision_p50_us": of(big, "decision_p50_us", 1),
              "decision_p99_us": of(big, "decision_p99_us", 1),
              "strides": strides,
              "hit_rate_loss": {t: round(rows[f"{default[0]}:{default[1]}"]["loss"], 4) for t, rows in loss.items()},
              "hit_rate_loss_by_strides": {t: {k: round(v["loss"], 4) for k, v in rows.items() if k != "dense"}
                                           for t, rows in loss.items()},
              "estimate_above_dense": {t: rows[f"{default[0]}:{default[1]}"].get("above_dense") for t, rows in loss.items()},
              "estimate_below_bound": {t: rows[f"{default[0]}:{default[1]}"].get("below_bound") for t, rows in loss.items()},
              "curve": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in p.items()
                         if k in ("nodes", "sparse", "layout", "blocks_held", "rows", "columns", "index_bytes_per_block",
                                  "rss_bytes_per_block", "churn_events_per_s", "decision_p99_us")} for p in points],
              "model": m,
              "sparse_walk_us_python": {str(w): round(walk_cost_us(w), 1) for w in (8, 128)},
              "sparse_walk_compiled_in_router": _index_mod._croute is not None,
              "grpc": grpc_points,
              "grpc_events_per_s": grpc_points[-1]["events_per_s"] if grpc_points else None,
              "grpc_decision_p99_us": grpc_points[-1]["decision_p99_us"] if grpc_points else None,
              "restart": restart,
              "serving_s": restart["serving_s"] if restart else None,
              "catch_up_s": restart["catch_up_s"] if restart else None}
    if args.plot and m is not None:
        plot(result, args.plot, args.fleet_gpu_blocks, args.fleet_host_blocks, args.fleet_disk_blocks)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

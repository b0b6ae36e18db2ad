"""Router benchmark: fold location events into the index, then route requests, on one core.

    python bench/router.py [--keys 1000000] [--workers 64] [--nodes 8] [--blocks 128]
                           [--decisions 20000] [--top-k 8] [--removals 8] [--peers dynamo] [--out FILE]

The cluster: ``--nodes`` daemons with ``--workers`` engine workers between them (each worker
declared with one layout fingerprint). The key space is ``--keys`` distinct 16-byte keys in
chains of ``--blocks`` (one chain per conversation prefix); each chain is held by 1 to 4
workers: the first holds all of it, the others a random leading part, each split at random
points into a GPU part (the worker's own), then its node's host tier, then its node's disk
tier. Those holdings become the feeds' messages exactly as daemons send them (NodeInfo, then
EventBatch messages of at most 32768 keys), serialised.

Measured:
    ``ingest_events_per_s``   block-level location events (one key in one event) per second,
                              from serialised feed messages: parse + fold into the index;
    ``index_bytes_per_block`` resident memory the index added (RSS after the fold minus
                              before) divided by the distinct keys it holds;
    ``decisions_per_s``, ``route_p99_us``: ``Router.route`` (dispatch on, so loads and
                              speculative entries are recorded) for requests of ``--blocks``
                              keys: half are a whole indexed chain, half a random leading part
                              of one followed by new keys; each dispatched request is finished
                              16 decisions later;
    ``first_route_ms``        the first decision after the fold (not dispatched, not in the
                              figures above): it builds the index's plan (per-worker columns,
                              the byte table), once per change of the workers;
    ``query_p50_us``, ``query_p99_us``: the raw prefix query of each request: the index's rows
                              and every worker's holdings in each tier (no scoring, no dispatch);
    ``worker_removal_ms``     a worker leaving as its daemon says so (a CLEARED event of its
                              GPU blocks, then a NodeInfo without it), median of ``--removals``
                              workers, each followed by a decision (``route_after_worker_removal_ms``:
                              it rebuilds the plan);
    ``node_removal_ms``       then a node with its remaining workers dropped (what a feed does
                              when its daemon's heartbeats stop), and the decision after it.

``--peers dynamo``: the same workload through Dynamo's KV indexer (``dynamo.llm.RadixTree`` of
ai-dynamo-runtime, :class:`Dynamo`) in the same run: its ingest rate and memory per block, its
``find_matches`` p50/p99 (interleaved with kvtier's decisions and queries, each first on every
other request), its ``remove_worker`` of the same workers and of the dropped node's, under
``dynamo``; ``vs_dynamo``: each of kvtier's figures over Dynamo's (decisions and queries both
over ``find_matches``). Skipped with a message when ``dynamo.llm`` is not importable.

Where a decision's time goes (2-core development VM shared with other work, 1M keys, about
14-15 us at the median with the compiled decision, client/routing/_route.c): about 10 us the
one compiled call (rows, holdings, cost and order, the tie digest, the speculative entries;
about 4-5 us when its data is in cache: the rest is reading the request's 128 key objects and
the index's rows from memory), 2-3 us the Python around it (the lock, expiry checks, the
Decision), 2-3 us dispatch and finishing (loads). In windows where other jobs take the
memory, about a tenth of the decisions take 100-300 us inside the compiled call, half the
total. Without the extension (numpy path): about 120 us, ~30 numpy calls of ~0.5-1 us each
plus the bookkeeping.
Decisions are not kept by the loop (a caller does not hold them all); checking where each
went is timed aside and not counted. ``--keys`` and ``--decisions`` shrink a run for
quick iterations.

The process pins itself to one CPU. Rates and latencies are per CPU-second of that core
(``time.thread_time``), so that other processes sharing the machine do not count against
the router; the same figures by the wall clock are the ``wall_*`` fields, and ``cpu_share``
is how much of the wall time the benchmark actually had the core. The last line of stdout
is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.tools.local_daemon import rss_bytes
from kvtier.proto import locations_pb2 as L
from kvtier.proto import node_pb2 as N

GOALS = {"ingest_events_per_s": 2_000_000, "decisions_per_s": 40_000, "route_p99_us": 500,
         "index_bytes_per_block": 128}
BATCH_KEYS = 32768


def build_feeds(n_keys: int, n_workers: int, n_nodes: int, blocks: int, rng: np.random.Generator,
                held: list[tuple[int, int, int]] | None = None
                ) -> tuple[list[list[bytes]], dict[str, list[bytes]], int]:
    """(chains of keys, serialised feed messages per node, block-level events in them);
    ``held`` (when given) gets each worker's holding as (worker, chain, leading blocks), all
    tiers together: what an indexer without tiers is told."""
    blob = rng.bytes(16 * n_keys)
    keys = [blob[i:i + 16] for i in range(0, 16 * n_keys, 16)]
    chains = [keys[i:i + blocks] for i in range(0, n_keys, blocks)]
    node_of = [w % n_nodes for w in range(n_workers)]
    fp = bytes(range(16))
    # per node: list of (tier, worker, keys)
    pending: dict[int, list[tuple[int, str, list[bytes]]]] = {n: [] for n in range(n_nodes)}
    n_events = 0
    for ci, chain in enumerate(chains):
        holders = rng.choice(n_workers, size=int(rng.integers(1, 5)), replace=False)
        for j, w in enumerate(holders.tolist()):
            length = len(chain) if j == 0 else int(rng.integers(1, len(chain) + 1))
            if held is not None:
                held.append((w, ci, length))
            c1, c2 = sorted(rng.integers(0, length + 1, size=2).tolist())
            node = node_of[w]
            for tier, lo, hi, who in ((N.TIER_GPU, 0, c1, f"w{w}"), (N.TIER_HOST, c1, c2, ""),
                                      (N.TIER_DISK, c2, length, "")):
                if hi > lo:
                    pending[node].append((tier, who, chain[lo:hi]))
                    n_events += hi - lo
    feeds: dict[str, list[bytes]] = {}
    for node, items in pending.items():
        epoch = 1000 + node
        info = L.NodeInfo(node_id=f"n{node}", epoch=epoch)
        for w in range(n_workers):
            if node_of[w] == node:
                info.workers.add(worker_id=f"w{w}", fingerprints=[fp])
        info.tiers.add(tier=N.TIER_HOST, capacity_bytes=1 << 40)
        info.tiers.add(tier=N.TIER_DISK, capacity_bytes=1 << 43)
        msgs = [L.WatchLocationsReply(epoch=epoch, node=info).SerializeToString(),
                L.WatchLocationsReply(epoch=epoch, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True)
                                      ).SerializeToString()]
        seq = 0
        batch = L.EventBatch()
        size = 0
        for tier, who, ks in items:
            seq += 1
            batch.events.add(seq=seq, kind=L.STORED, tier=tier, worker_id=who, fingerprint=fp, keys=ks)
            size += len(ks)
            if size >= BATCH_KEYS:
                batch.head_seq = seq
                msgs.append(L.WatchLocationsReply(epoch=epoch, events=batch).SerializeToString())
                batch, size = L.EventBatch(), 0
        if batch.events:
            batch.head_seq = seq
            msgs.append(L.WatchLocationsReply(epoch=epoch, events=batch).SerializeToString())
        feeds[f"n{node}"] = msgs
    return chains, feeds, n_events


def make_requests(chains: list[list[bytes]], n_req: int, blocks: int, rng: np.random.Generator) -> list[list[bytes]]:
    """Half a whole chain, half a leading part of one followed by new keys."""
    picks = rng.integers(0, len(chains), size=n_req)
    cuts = rng.integers(1, blocks + 1, size=n_req)
    fresh = rng.bytes(16 * blocks * 64)
    requests = []
    for i in range(n_req):
        chain = chains[int(picks[i])]
        if i % 2 == 0 or len(chain) < blocks:
            req = chain[:blocks]
        else:
            cut = int(cuts[i])
            off = 16 * blocks * (i % 64)
            req = chain[:cut] + [fresh[off + 16 * j: off + 16 * j + 16] for j in range(blocks - cut)]
        requests.append(req)
    return requests


def time_routing(router: Router, requests: list[list[bytes]], peer: Callable[[int], None] | None = None) -> dict:
    """Route every request (dispatching; each finished 16 decisions later): per-decision CPU
    and wall latencies, the totals without the aside checks, and how many went to a holder.
    ``peer(i)``: another indexer's query for request ``i``, timed alone and interleaved with
    the decisions (first on odd requests, second on even ones), so that both see the same
    moments of a shared machine (``peer_lat_cpu``: CPU of the whole process, as the peer's
    work may run on its own threads; the process is pinned to one core)."""
    n_req = len(requests)
    lat = np.empty(n_req, dtype=np.int64)
    lat_cpu = np.empty(n_req, dtype=np.int64)
    peer_cpu = np.empty(n_req if peer is not None else 0, dtype=np.int64)
    inflight: list[int] = []
    hits = 0
    aside_ns = aside_cpu_ns = 0  # checking where the request went, the peer: not the router's time
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, req in enumerate(requests):
        if peer is not None and i % 2:
            a, ac, pc = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            peer(i)
            peer_cpu[i] = time.process_time_ns() - pc
            aside_ns += time.perf_counter_ns() - a
            aside_cpu_ns += time.thread_time_ns() - ac
        s, sc = time.perf_counter_ns(), time.thread_time_ns()
        d = router.route(req)
        lat[i] = time.perf_counter_ns() - s
        lat_cpu[i] = time.thread_time_ns() - sc
        a, ac = time.perf_counter_ns(), time.thread_time_ns()
        hits += d.ranked[0].overlap.disk > 0  # decisions are not kept: a caller does not hold them all
        aside_ns += time.perf_counter_ns() - a
        aside_cpu_ns += time.thread_time_ns() - ac
        if peer is not None and not i % 2:
            a, ac, pc = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            peer(i)
            peer_cpu[i] = time.process_time_ns() - pc
            aside_ns += time.perf_counter_ns() - a
            aside_cpu_ns += time.thread_time_ns() - ac
        inflight.append(d.decision_id)
        if len(inflight) > 16:
            router.finish(inflight.pop(0))
    for did in inflight:
        router.finish(did)
    return {"wall_s": time.perf_counter() - t0 - aside_ns / 1e9, "cpu_s": time.thread_time() - c0 - aside_cpu_ns / 1e9,
            "lat": lat, "lat_cpu": lat_cpu, "hits": hits, "peer_lat_cpu": peer_cpu}


def time_queries(router: Router, requests: list[list[bytes]], peer: Callable[[int], None] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The raw prefix query of every request: the index's rows and per-worker holdings in each
    tier (no scoring, no dispatch), under the router's lock as a decision takes them; CPU ns
    per query, and the peer's, interleaved as in :func:`time_routing`."""
    n_req = len(requests)
    lat = np.empty(n_req, dtype=np.int64)
    peer_cpu = np.empty(n_req if peer is not None else 0, dtype=np.int64)
    idx, lock, pulls = router.index, router._lock, router.config.pulls
    for i, req in enumerate(requests):
        if peer is not None and i % 2:
            pc = time.process_time_ns()
            peer(i)
            peer_cpu[i] = time.process_time_ns() - pc
        sc = time.thread_time_ns()
        with lock:
            idx.holdings(idx.rows(req), None, pulls)
        lat[i] = time.thread_time_ns() - sc
        if peer is not None and not i % 2:
            pc = time.process_time_ns()
            peer(i)
            peer_cpu[i] = time.process_time_ns() - pc
    return lat, peer_cpu


def remove_worker(router: Router, node: str, worker: str) -> float:
    """CPU ms to take one worker out of the index as its daemon says so: a CLEARED event of
    its GPU blocks, then a NodeInfo that no longer lists it (what a daemon sends when the
    worker's engine leaves). The next decision rebuilds the plan (timed by the caller)."""
    idx = router.index
    epoch, seq = idx.position(node)
    view = idx.nodes[node]
    batch = L.EventBatch(head_seq=seq + 1)
    batch.events.add(seq=seq + 1, kind=L.CLEARED, tier=N.TIER_GPU, worker_id=worker)
    info = L.NodeInfo(node_id=node, epoch=epoch, head_seq=seq + 1)
    for w, fps in view.workers.items():
        if w != worker:
            info.workers.add(worker_id=w, fingerprints=list(fps))
    for tier, label in ((N.TIER_HOST, "host"), (N.TIER_DISK, "disk")):
        info.tiers.add(tier=tier, capacity_bytes=view.capacity_bytes.get(label, 0))
    msgs = [L.WatchLocationsReply(epoch=epoch, events=batch).SerializeToString(),
            L.WatchLocationsReply(epoch=epoch, node=info).SerializeToString()]
    c0 = time.thread_time()
    for raw in msgs:
        router.apply(node, L.WatchLocationsReply.FromString(raw))
    return (time.thread_time() - c0) * 1e3


class Dynamo:
    """Dynamo's KV indexer (``dynamo.llm.RadixTree`` of ai-dynamo-runtime) on the same
    workload: a worker's holding of a chain is one stored event of its leading blocks (all
    tiers together: the tree has none), a key's first 8 bytes its block hash and its last 8
    its tokens hash (what ``find_matches`` takes); worker ids are the worker numbers.

    The tree applies events and answers on a thread of its own: its times are CPU of the
    whole process (pinned to one core), and ingest and each removal end with an empty
    ``find_matches``, answered only once the tree has applied what came before it."""

    def __init__(self, radix_tree: type, chains: list[list[bytes]], held: list[tuple[int, int, int]]) -> None:
        self.tree = radix_tree()
        self.pending: list[tuple[int, bytes]] = []
        for n, (w, ci, length) in enumerate(held):
            blocks = [{"block_hash": int.from_bytes(k[:8], "little"), "tokens_hash": int.from_bytes(k[8:], "little")}
                      for k in chains[ci][:length]]
            self.pending.append((w, json.dumps({"event_id": n, "data": {"stored": {"parent_hash": None,
                                                                                   "blocks": blocks}},
                                                "dp_rank": 0}).encode()))

    def ingest(self, n_keys: int, n_events: int) -> dict:
        tree = self.tree
        gc.collect()
        malloc_trim()
        rss0 = rss_bytes(os.getpid())
        c0 = time.process_time()
        for w, ev in self.pending:
            tree.apply_event(w, ev)
        tree.find_matches([])
        cpu_s = time.process_time() - c0
        self.pending = []
        gc.collect()
        print(f"Dynamo ingested in {cpu_s:.2f} CPU s", file=sys.stderr)
        return {"ingest_events_per_s": round(n_events / cpu_s),
                "index_bytes_per_block": round((rss_bytes(os.getpid()) - rss0) / n_keys, 1)}

    @staticmethod
    def query(keys: list[bytes]) -> list[int]:
        return [int.from_bytes(k[8:], "little") for k in keys]

    def remove(self, workers: list[int]) -> float:
        """CPU ms to remove these workers."""
        c0 = time.process_time()
        for w in workers:
            self.tree.remove_worker(w)
        self.tree.find_matches([])
        return (time.process_time() - c0) * 1e3


def malloc_trim() -> None:
    """Give the C heap's free memory back, so the resident memory an indexer adds is its own
    (not freed memory of the workload's construction reused)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pct(a: np.ndarray, q: float, scale: float = 1000) -> float:
    return round(float(np.percentile(a, q)) / scale, 1)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def removals(router: Router, requests: list[list[bytes]], n: int, dyn: Dynamo | None) -> tuple[dict, dict]:
    """Workers leave one by one (each from another node where there are enough), each followed
    by a decision (it rebuilds the plan), interleaved with Dynamo's removal of the same worker;
    then a whole node of the rest leaves (its feed's daemon stopped answering), against
    Dynamo's removal of that node's remaining workers. (kvtier's figures, Dynamo's)."""
    plan_workers = router.workers()
    node_of = dict(plan_workers)
    gone = [w for w, _ in plan_workers][::max(1, len(plan_workers) // max(1, n))][:n]
    rem_ms, after_ms, dyn_ms = [], [], []
    for w in gone:
        rem_ms.append(remove_worker(router, node_of[w], w))
        c0 = time.thread_time()
        d = router.route(requests[1], dispatch=False)
        after_ms.append((time.thread_time() - c0) * 1e3)
        assert w not in d.workers
        if dyn is not None:
            dyn_ms.append(dyn.remove([int(w[1:])]))
    node = node_of[next(w for w, _ in plan_workers if w not in gone)]
    rest = [int(w[1:]) for w, x in router.workers() if x == node]
    c0 = time.thread_time()
    with router._lock:  # what a feed does when its daemon's heartbeats stop (--node-timeout-s)
        router.index.drop_node(node)
    node_ms = (time.thread_time() - c0) * 1e3
    c0 = time.thread_time()
    router.route(requests[1], dispatch=False)
    node_after_ms = (time.thread_time() - c0) * 1e3
    mine = {"worker_removal_ms": round(float(np.median(rem_ms)), 3), "worker_removal_max_ms": round(max(rem_ms), 3),
            "route_after_worker_removal_ms": round(float(np.median(after_ms)), 3),
            "node_removal_ms": round(node_ms, 3), "route_after_node_removal_ms": round(node_after_ms, 3)}
    theirs = {}
    if dyn is not None:
        theirs = {"worker_removal_ms": round(float(np.median(dyn_ms)), 3), "worker_removal_max_ms": round(max(dyn_ms), 3),
                  "node_workers_removal_ms": round(dyn.remove(rest), 3)}
    return mine, theirs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--removals", type=int, default=8, help="workers removed one by one at the end (timed)")
    ap.add_argument("--peers", default="", help="dynamo: the same workload through Dynamo's RadixTree "
                                                "(ai-dynamo-runtime) in the same run, with kvtier/Dynamo ratios; "
                                                "skipped with a message when it is not importable")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)
    ns.peers = [p for p in ns.peers.split(",") if p]
    if any(p != "dynamo" for p in ns.peers):
        ap.error(f"--peers: unknown peer(s) {', '.join(p for p in ns.peers if p != 'dynamo')} (known: dynamo)")
    return ns


def radix_tree_class(peers: list[str]) -> type | None:
    if "dynamo" not in peers:
        return None
    try:
        from dynamo.llm import RadixTree
    except Exception as e:  # ai-dynamo-runtime: the dev extra
        print(f"skipping Dynamo: dynamo.llm.RadixTree is not importable ({e}); "
              f"pip install 'ai-dynamo-runtime==1.6.1'", file=sys.stderr)
        return None
    return RadixTree


def vs_dynamo(result: dict, dres: dict) -> dict:
    """kvtier / Dynamo for each figure: above 1 is kvtier ahead for the ingest rate, behind for
    the rest. Decisions (``route_*``) are set against Dynamo's query: its tree has no more to
    decide."""
    out = {
        "ingest_events_per_s": ratio(result["ingest_events_per_s"], dres["ingest_events_per_s"]),
        "query_p50_us": ratio(result["query_p50_us"], dres["query_p50_us"]),
        "query_p99_us": ratio(result["query_p99_us"], dres["query_p99_us"]),
        "route_p50_us": ratio(result["route_p50_us"], dres["query_p50_us"]),
        "route_p99_us": ratio(result["route_p99_us"], dres["query_p99_us"]),
        "index_bytes_per_block": ratio(result["index_bytes_per_block"], dres["index_bytes_per_block"]),
        "worker_removal_ms": ratio(result["worker_removal_ms"], dres["worker_removal_ms"]),
        "node_removal_ms": ratio(result["node_removal_ms"], dres["node_workers_removal_ms"]),
    }
    for k, v in out.items():
        print(f"kvtier/Dynamo {k}: {v}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    radix_tree = radix_tree_class(ns.peers)
    rng = np.random.default_rng(ns.seed)
    t0 = time.perf_counter()
    held: list[tuple[int, int, int]] = []
    chains, feeds, n_events = build_feeds(ns.keys, ns.workers, ns.nodes, ns.blocks, rng, held)
    print(f"built {n_events} events for {ns.keys} keys in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    dyn = Dynamo(radix_tree, chains, held) if radix_tree is not None else None

    router = Router(RouterConfig(top_k=ns.top_k))
    gc.collect()
    malloc_trim()
    rss0 = rss_bytes(os.getpid())
    t0, c0 = time.perf_counter(), time.thread_time()
    for target, msgs in feeds.items():
        for raw in msgs:
            router.apply(target, L.WatchLocationsReply.FromString(raw))
    ingest_s, ingest_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    gc.collect()
    rss1 = rss_bytes(os.getpid())
    n_indexed = len(router.index)
    assert n_indexed == ns.keys, (n_indexed, ns.keys)
    print(f"ingested in {ingest_s:.2f} s; {n_indexed} keys, {router.index.columns} columns", file=sys.stderr)
    dres = dyn.ingest(n_indexed, n_events) if dyn is not None else {}

    n_req = ns.decisions
    requests = make_requests(chains, n_req, ns.blocks, rng)
    peer = None
    if dyn is not None:
        tree, dq = dyn.tree, [Dynamo.query(r) for r in requests]
        assert tree.find_matches(dq[0]).scores, "Dynamo matched nothing of an indexed chain"

        def peer(i: int) -> None:
            tree.find_matches(dq[i])
    # the first decision after the fold builds the index's plan (per-worker columns, the byte
    # table): once per change of workers, not per decision; timed on its own
    c0 = time.thread_time()
    router.route(requests[0], dispatch=False)
    first_route_ms = (time.thread_time() - c0) * 1e3
    r = time_routing(router, requests, peer)
    q_lat, q_peer = time_queries(router, requests, peer)
    mine, theirs = removals(router, requests, ns.removals, dyn)
    if dyn is not None:
        both = np.concatenate([r["peer_lat_cpu"], q_peer])
        dres.update(theirs, query_p50_us=pct(both, 50), query_p99_us=pct(both, 99))

    result = {
        "ingest_events_per_s": round(n_events / ingest_cpu_s),
        "decisions_per_s": round(n_req / r["cpu_s"]),
        "route_p99_us": pct(r["lat_cpu"], 99),
        "route_p50_us": pct(r["lat_cpu"], 50),
        "first_route_ms": round(first_route_ms, 1),
        "wall_ingest_events_per_s": round(n_events / ingest_s),
        "wall_decisions_per_s": round(n_req / r["wall_s"]),
        "wall_route_p50_us": pct(r["lat"], 50),
        "wall_route_p99_us": pct(r["lat"], 99),
        "cpu_share": round((ingest_cpu_s + r["cpu_s"]) / (ingest_s + r["wall_s"]), 3),
        "index_bytes_per_block": round((rss1 - rss0) / n_indexed, 1),
        "index_array_bytes_per_block": round(router.index.nbytes() / n_indexed, 1),
        "query_p50_us": pct(q_lat, 50),
        "query_p99_us": pct(q_lat, 99),
        **mine,
        "workers": ns.workers, "nodes": ns.nodes, "distinct_keys": n_indexed, "events": n_events,
        "request_blocks": ns.blocks, "decisions": n_req, "top_k": ns.top_k, "cpu": cpu,
        "routed_to_a_holder": round(r["hits"] / n_req, 4),
        "goals": GOALS,
    }
    result["goals_met"] = {
        "ingest_events_per_s": result["ingest_events_per_s"] >= GOALS["ingest_events_per_s"],
        "decisions_per_s": result["decisions_per_s"] >= GOALS["decisions_per_s"],
        "route_p99_us": result["route_p99_us"] < GOALS["route_p99_us"],
        "index_bytes_per_block": result["index_bytes_per_block"] <= GOALS["index_bytes_per_block"],
    }
    if dres:
        result["dynamo"] = dres
        result["vs_dynamo"] = vs_dynamo(result, dres)
    emit(result, ns.out)
    return result


if __name__ == "__main__":
    main()

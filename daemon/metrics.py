"""Prometheus metrics of a kvtierd, computed from a typed stats snapshot at scrape time.

The hot path only adds to the typed counters of :class:`~kvtier.daemon.counters.Counters`;
this collector turns a :class:`~kvtier.daemon.stats.NodeStats` snapshot into ``kvtier_*``
families with ``node``, ``tier``, ``op``, ``direction`` and ``code`` labels when Prometheus
scrapes, so metrics cost nothing between scrapes. No counter name is parsed:

    hits per (Op, Tier)          kvtier_hit_blocks_total{op, tier}, kvtier_hit_tokens_total{op, tier}
    misses per Op                kvtier_miss_blocks_total{op}, kvtier_miss_tokens_total{op}
    hits + misses per Op         kvtier_lookup_blocks_total{op}, kvtier_lookup_tokens_total{op}
    bytes per Flow               kvtier_bytes_total{direction="<src>-><dst>"}
    evictions per Tier           kvtier_evictions_total{tier} (host, disk)
    refusals per Code            kvtier_errors_total{code} (codes refused at least once)
    every Count member           kvtier_<name>_total

Also the tier gauges (``kvtier_tier_capacity_bytes``, ``kvtier_tier_used_bytes``,
``kvtier_tier_blocks``), ``kvtier_sessions``, ``kvtier_retained_bytes`` (every tenant's
retained slot bytes), ``kvtier_node_info{epoch, version}`` (always 1: which daemon this is,
so a reader can tell one daemon reached twice from two daemons) and
``kvtier_op_latency_seconds{op}``, a histogram of each RPC's handling time that the handlers
update in process (:class:`OpLatency`: one bisect and two increments per call).

Every family has the ``node`` label, and every series is exported from the first scrape, at
zero until it moves (every refusal code; every RPC the daemon times, :meth:`OpLatency.expect`),
so dashboards and alerts see them before the first event. Acquire never finds a block in gpu
(the daemon serves host and disk), so ``kvtier_hit_*_total{op="acquire", tier="gpu"}`` stays 0.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvtier.daemon.counters import Op
from kvtier.daemon.stats import NodeStats

#: upper bounds of the latency buckets, seconds: 25 us to 10 s, about x2 apart
LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0)


class OpLatency:
    """Per-operation latency histograms, updated by the handlers, read at scrape time.

    ``observe`` is called on the event loop; the scrape runs on the metrics thread and reads a
    consistent copy (:meth:`frozen`): ``observe`` makes a version odd while it writes and even
    after, and the copy is taken again until it saw the same even version before and after."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}   # op -> count per bucket (last: above every bound)
        self.sums: dict[str, float] = {}
        self.version = 0                          # odd while observe() writes

    def observe(self, op: str, seconds: float) -> None:
        self.version += 1
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(self.bounds) + 1)
            self.sums[op] = 0.0
        counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[op] += seconds
        self.version += 1

    def frozen(self) -> tuple[dict[str, list[int]], dict[str, float]]:
        """A consistent copy of (counts, sums), from any thread (see the class docstring)."""
        while True:
            v = self.version
            if v % 2 == 0:
                counts = {op: list(c) for op, c in list(self.counts.items())}
                sums = dict(self.sums)
                if self.version == v and counts.keys() <= sums.keys():
                    return counts, sums
            time.sleep(0)

    def expect(self, ops: Iterable[str]) -> None:
        """Export these ops from the first scrape, at zero until they are called."""
        for op in ops:
            if op not in self.counts:
                self.counts[op] = [0] * (len(self.bounds) + 1)
                self.sums[op] = 0.0

    def family(self, node: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily("kvtier_op_latency_seconds", "time to handle one RPC, by operation",
                                    labels=["node", "op"])
        all_counts, sums = self.frozen()
        for op, counts in all_counts.items():
            cumulative, running = [], 0
            for bound, n in zip((*map(str, self.bounds), "+Inf"), counts, strict=True):
                running += n
                cumulative.append((bound, running))
            fam.add_metric([node, op], cumulative, sums[op])
        return fam


class StoreCollector:
    """Collects the ``kvtier_*`` families from a :class:`NodeStats` snapshot and the latencies."""

    def __init__(self, node: str, stats: Callable[[], NodeStats], latency: OpLatency) -> None:
        self.node = node
        self.stats = stats
        self.latency = latency

    def collect(self) -> Iterator[Metric]:
        node = self.node
        stats = self.stats()
        c = stats.counters
        hit_b = CounterMetricFamily("kvtier_hit_blocks", "blocks found, by operation and tier", labels=["node", "op", "tier"])
        hit_t = CounterMetricFamily("kvtier_hit_tokens", "tokens found, by operation and tier", labels=["node", "op", "tier"])
        miss_b = CounterMetricFamily("kvtier_miss_blocks", "blocks not found in any tier, by operation",
                                     labels=["node", "op"])
        miss_t = CounterMetricFamily("kvtier_miss_tokens", "tokens not found in any tier, by operation",
                                     labels=["node", "op"])
        ask_b = CounterMetricFamily("kvtier_lookup_blocks", "blocks asked for (found in any tier or not), by operation",
                                    labels=["node", "op"])
        ask_t = CounterMetricFamily("kvtier_lookup_tokens", "tokens asked for (found in any tier or not), by operation",
                                    labels=["node", "op"])
        for op in Op:
            for tier, tally in c.hits[op].items():
                hit_b.add_metric([node, op.value, tier.label], tally.blocks)
                hit_t.add_metric([node, op.value, tier.label], tally.tokens)
            miss_b.add_metric([node, op.value], c.misses[op].blocks)
            miss_t.add_metric([node, op.value], c.misses[op].tokens)
            asked = c.asked(op)
            ask_b.add_metric([node, op.value], asked.blocks)
            ask_t.add_metric([node, op.value], asked.tokens)
        yield from (hit_b, hit_t, miss_b, miss_t, ask_b, ask_t)
        moved = CounterMetricFamily("kvtier_bytes", "payload bytes moved, by direction", labels=["node", "direction"])
        for flow, n in c.moved.items():
            moved.add_metric([node, flow.label], n)
        evictions = CounterMetricFamily("kvtier_evictions", "blocks evicted for capacity, by tier",
                                        labels=["node", "tier"])
        for tier, n in c.evictions.items():
            evictions.add_metric([node, tier.label], n)
        yield from (moved, evictions)
        errors = CounterMetricFamily("kvtier_errors", "requests refused, by gRPC status code", labels=["node", "code"])
        for code, n in c.errors.items():
            errors.add_metric([node, code.name], n)
        yield errors
        for count, n in c.counts.items():
            yield _plain(node, count.value, n)
        yield self.latency.family(node)
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "configured capacity", labels=["node", "tier"])
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "bytes of slots in use", labels=["node", "tier"])
        blocks = GaugeMetricFamily("kvtier_tier_blocks", "visible blocks", labels=["node", "tier"])
        for t in stats.tiers:
            cap.add_metric([node, t.tier.label], t.capacity_bytes)
            used.add_metric([node, t.tier.label], t.used_bytes)
            blocks.add_metric([node, t.tier.label], t.blocks)
        yield from (cap, used, blocks)
        sessions = GaugeMetricFamily("kvtier_sessions", "open client sessions", labels=["node"])
        sessions.add_metric([node], stats.sessions)
        retained = GaugeMetricFamily("kvtier_retained_bytes", "slot bytes of blocks retained (Retain), every "
                                     "tenant's", labels=["node"])
        retained.add_metric([node], stats.retained_bytes)
        yield retained
        info = GaugeMetricFamily("kvtier_node_info", "this daemon: its start epoch (as in the Stats reply) "
                                 "and version; always 1", labels=["node", "epoch", "version"])
        info.add_metric([node, str(stats.epoch), stats.version], 1)
        yield from (sessions, info)


def _plain(node: str, name: str, value: int) -> CounterMetricFamily:
    fam = CounterMetricFamily(f"kvtier_{name}", f"count of {name.replace('_', ' ')}", labels=["node"])
    fam.add_metric([node], value)
    return fam


class MetricsServer:
    """The ``/metrics`` listener: its HTTP server and the thread serving it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self.server, self.thread = server, thread
        self.port: int = server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def start_metrics_server(node: str, stats: Callable[[], NodeStats], latency: OpLatency, host: str,
                         port: int) -> MetricsServer:
    """Serve ``/metrics`` on host:port in a background thread. ``stats`` is called on the
    server's thread at each scrape. Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(node, stats, latency))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)

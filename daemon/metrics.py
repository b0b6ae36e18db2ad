"""Prometheus metrics of a kvtierd, computed from the store at scrape time.

The hot path only bumps plain counters in ``BlockStore.counters``; this collector turns them
into ``kvtier_*`` families with ``node``, ``tier``, ``op`` and ``direction`` labels when
Prometheus scrapes, so metrics cost nothing between scrapes.

Counter names in the store and what they become:
    ``<op>_hit_blocks:<tier>``    kvtier_hit_blocks_total{op, tier}
    ``<op>_hit_tokens:<tier>``    kvtier_hit_tokens_total{op, tier}
    ``<op>_miss_blocks``          kvtier_miss_blocks_total{op}
    ``<op>_miss_tokens``          kvtier_miss_tokens_total{op}
    ``bytes_<src>_to_<dst>``      kvtier_bytes_total{direction="<src>-><dst>"}
    ``evictions_<tier>``          kvtier_evictions_total{tier}
    ``errors:<CODE>``             kvtier_errors_total{code}
    anything else ``name``        kvtier_<name>_total

Also, at scrape time: ``kvtier_lookup_blocks_total{op}`` / ``kvtier_lookup_tokens_total{op}``
(blocks and tokens asked for: hits in every tier plus misses), the tier gauges
(``kvtier_tier_capacity_bytes``, ``kvtier_tier_used_bytes``, ``kvtier_tier_blocks``) and
``kvtier_op_latency_seconds{op}``, a histogram of each RPC's handling time that the handlers
update in process (:class:`OpLatency`: one bisect and two increments per call).

Every series in :data:`ALWAYS_EXPORTED` is exported from the first scrape, at zero until it
moves (hits and misses per op and tier, bytes per direction, evictions, demotions,
promotions, checksum failures), so dashboards and alerts see them before the first event.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvtier.proto import TIER_NAMES

if TYPE_CHECKING:
    from kvtier.daemon.service import NodeService

_HIT = re.compile(r"^(\w+)_hit_(blocks|tokens):(\w+)$")
_MISS = re.compile(r"^(\w+)_miss_(blocks|tokens)$")
_BYTES = re.compile(r"^bytes_(\w+)_to_(\w+)$")
_EVICT = re.compile(r"^evictions_(\w+)$")

_TIERS = ("gpu", "host", "disk")
#: store counters exported at zero before they first move (see the module docstring)
ALWAYS_EXPORTED: tuple[str, ...] = (
    *(f"{op}_hit_{unit}:{tier}" for op in ("lookup", "acquire") for unit in ("blocks", "tokens") for tier in _TIERS),
    *(f"{op}_miss_{unit}" for op in ("lookup", "acquire") for unit in ("blocks", "tokens")),
    *(f"bytes_{src}_to_{dst}" for src, dst in (("gpu", "host"), ("host", "gpu"), ("host", "disk"), ("disk", "host"),
                                                ("client", "host"), ("host", "client"))),
    "evictions_host", "evictions_disk", "demotions", "promotions", "checksum_failures",
)

#: upper bounds of the latency buckets, seconds: 25 us to 10 s, about x2 apart
LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0)


class OpLatency:
    """Per-operation latency histograms, updated by the handlers, read at scrape time.

    ``observe`` is called on the event loop; the scrape runs on the metrics thread and reads
    plain lists, which can at worst be one observation apart between a bucket and the sum."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}   # op -> count per bucket (last: above every bound)
        self.sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(self.bounds) + 1)
            self.sums[op] = 0.0
        counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[op] += seconds

    def family(self, node: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily("kvtier_op_latency_seconds", "time to handle one RPC, by operation",
                                    labels=["node", "op"])
        for op, counts in list(self.counts.items()):
            cumulative, running = [], 0
            for bound, n in zip((*map(str, self.bounds), "+Inf"), list(counts), strict=True):
                running += n
                cumulative.append((bound, running))
            fam.add_metric([node, op], cumulative, self.sums[op])
        return fam


class StoreCollector:
    def __init__(self, service: NodeService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        node = self.service.node_id
        stats = self.service.stats_message()
        fams: dict[str, CounterMetricFamily] = {}

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            if name not in fams:
                fams[name] = CounterMetricFamily(name, doc, labels=["node", *labels])
            return fams[name]

        counters = dict.fromkeys(ALWAYS_EXPORTED, 0)
        counters.update(stats.counters)
        asked: dict[tuple[str, str], int] = {}
        for key, value in counters.items():
            if m := _HIT.match(key) or _MISS.match(key):
                asked[m[1], m[2]] = asked.get((m[1], m[2]), 0) + value
            if m := _HIT.match(key):
                counter(f"kvtier_hit_{m[2]}", f"{m[2]} found, by operation and tier",
                        ["op", "tier"]).add_metric([node, m[1], m[3]], value)
            elif m := _MISS.match(key):
                counter(f"kvtier_miss_{m[2]}", f"{m[2]} not found in any tier, by operation",
                        ["op"]).add_metric([node, m[1]], value)
            elif m := _BYTES.match(key):
                counter("kvtier_bytes", "payload bytes moved, by direction",
                        ["direction"]).add_metric([node, f"{m[1]}->{m[2]}"], value)
            elif m := _EVICT.match(key):
                counter("kvtier_evictions", "blocks evicted for capacity, by tier", ["tier"]).add_metric(
                    [node, m[1]], value)
            elif key.startswith("errors:"):
                counter("kvtier_errors", "requests refused, by gRPC status code", ["code"]).add_metric(
                    [node, key.split(":", 1)[1]], value)
            else:
                counter(f"kvtier_{key}", f"count of {key.replace('_', ' ')}", []).add_metric([node], value)
        for (op, unit), value in sorted(asked.items()):
            counter(f"kvtier_lookup_{unit}", f"{unit} asked for (found in any tier or not), by operation",
                    ["op"]).add_metric([node, op], value)
        yield from fams.values()
        yield self.service.latency.family(node)
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "configured capacity", labels=["node", "tier"])
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "bytes of slots in use", labels=["node", "tier"])
        blocks = GaugeMetricFamily("kvtier_tier_blocks", "visible blocks", labels=["node", "tier"])
        for t in stats.tiers:
            name = TIER_NAMES.get(t.tier, "none")
            cap.add_metric([node, name], t.capacity_bytes)
            used.add_metric([node, name], t.used_bytes)
            blocks.add_metric([node, name], t.blocks)
        yield from (cap, used, blocks)
        yield GaugeMetricFamily("kvtier_sessions", "open client sessions", value=stats.sessions)


def start_metrics_server(service: NodeService, host: str, port: int) -> int:
    """Serve ``/metrics`` on host:port in a background thread; returns the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(service))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port

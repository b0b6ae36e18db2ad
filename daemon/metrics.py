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
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.proto import TIER_NAMES

if TYPE_CHECKING:
    from kvtier.daemon.service import NodeService

_HIT = re.compile(r"^(\w+)_hit_(blocks|tokens):(\w+)$")
_MISS = re.compile(r"^(\w+)_miss_(blocks|tokens)$")
_BYTES = re.compile(r"^bytes_(\w+)_to_(\w+)$")
_EVICT = re.compile(r"^evictions_(\w+)$")


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

        for key, value in stats.counters.items():
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
        yield from fams.values()
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

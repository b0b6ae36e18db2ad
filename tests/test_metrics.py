"""A real kvtierd with --metrics-port: a scripted workload moves each counter by exactly what it did.

The daemon is a subprocess on a private socket; /metrics is scraped over HTTP and parsed with
prometheus_client's own parser, before and after each step.
"""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Sidecar
from kvtier.client.testing.local_daemon import DaemonProcess
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.layout import Layout

BLOCK = 64 * 1024
TOKENS = 16  # Layout.flat's block_tokens
NODE = "metrics-node"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics as {(name, labels without node): value}; checks the node label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if fam.name.startswith("kvtier_") and fam.name != "kvtier_sessions":
                assert labels.pop("node") == NODE, s
            out[s.name, frozenset(labels.items())] = s.value
    return out


def v(m: dict, name: str, **labels: str) -> float:
    return m[name, frozenset(labels.items())]


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:06d}".encode() for i in range(n)]


@pytest.fixture
def metered(start_daemon) -> tuple[DaemonProcess, int]:
    port = free_port()
    # 1 MiB of host memory: sixteen 64 KiB slots
    d = start_daemon("--metrics-port", str(port), "--node-id", NODE, host_capacity="1MiB")
    return d, port


def test_every_listed_series_exists_at_zero_before_any_traffic(metered) -> None:
    _, port = metered
    m = scrape(port)
    for op in ("lookup", "acquire"):
        for tier in ("gpu", "host", "disk"):
            assert v(m, "kvtier_hit_blocks_total", op=op, tier=tier) == 0
            assert v(m, "kvtier_hit_tokens_total", op=op, tier=tier) == 0
        assert v(m, "kvtier_miss_blocks_total", op=op) == 0
        assert v(m, "kvtier_miss_tokens_total", op=op) == 0
        assert v(m, "kvtier_lookup_blocks_total", op=op) == 0
        assert v(m, "kvtier_lookup_tokens_total", op=op) == 0
    for direction in ("gpu->host", "host->gpu", "host->disk", "disk->host"):
        assert v(m, "kvtier_bytes_total", direction=direction) == 0
    for tier in ("host", "disk"):
        assert v(m, "kvtier_evictions_total", tier=tier) == 0
    for name in ("kvtier_demotions_total", "kvtier_promotions_total", "kvtier_checksum_failures_total"):
        assert v(m, name) == 0
    assert v(m, "kvtier_tier_capacity_bytes", tier="host") == 1 << 20
    assert v(m, "kvtier_tier_used_bytes", tier="host") == 0


def test_scripted_workload_moves_counters_exactly(metered) -> None:
    d, port = metered
    before = scrape(port)
    # lookup counters count what the daemon answers: ask it (the key table is read without it)
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        a = keys("a", 4)
        assert sc.put(lid, a, [bytes([i]) * BLOCK for i in range(4)]).stored == 4
        m = scrape(port)
        assert v(m, "kvtier_bytes_total", direction="client->host") == 4 * BLOCK
        assert v(m, "kvtier_tier_blocks", tier="host") == 4
        assert v(m, "kvtier_tier_used_bytes", tier="host") == 4 * BLOCK

        # lookup: 4 held, 2 not
        assert sc.lookup(lid, [*a, *keys("x", 2)]) == ["host"] * 4 + [None] * 2
        m = scrape(port)
        assert v(m, "kvtier_hit_blocks_total", op="lookup", tier="host") == 4
        assert v(m, "kvtier_hit_tokens_total", op="lookup", tier="host") == 4 * TOKENS
        assert v(m, "kvtier_miss_blocks_total", op="lookup") == 2
        assert v(m, "kvtier_miss_tokens_total", op="lookup") == 2 * TOKENS
        assert v(m, "kvtier_lookup_blocks_total", op="lookup") == 6
        assert v(m, "kvtier_lookup_tokens_total", op="lookup") == 6 * TOKENS
        assert v(m, "kvtier_hit_blocks_total", op="acquire", tier="host") == 0

        # get (acquire): 2 held, 1 not
        got = sc.get(lid, [a[0], keys("y", 1)[0], a[3]])
        assert [g is not None for g in got] == [True, False, True]
        m = scrape(port)
        assert v(m, "kvtier_hit_blocks_total", op="acquire", tier="host") == 2
        assert v(m, "kvtier_hit_tokens_total", op="acquire", tier="host") == 2 * TOKENS
        assert v(m, "kvtier_miss_blocks_total", op="acquire") == 1
        assert v(m, "kvtier_lookup_blocks_total", op="acquire") == 3
        assert v(m, "kvtier_bytes_total", direction="host->client") == 2 * BLOCK
        assert v(m, "kvtier_hit_blocks_total", op="lookup", tier="host") == 4  # unchanged

        # 16 more blocks into 16 slots: the 4 least recently used go
        assert sc.put(lid, keys("b", 16), [b"\x07" * BLOCK] * 16).stored == 16
        m = scrape(port)
        assert v(m, "kvtier_evictions_total", tier="host") == 4
        assert v(m, "kvtier_tier_blocks", tier="host") == 16
        assert v(m, "kvtier_bytes_total", direction="client->host") == 20 * BLOCK

    # a refused request is counted by status code and still timed
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            node_pb2_grpc.NodeStub(ch).Lookup(node_pb2.LookupRequest(layout_id=99, keys=[b"k" * 8]), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    m = scrape(port)
    assert v(m, "kvtier_errors_total", code="FAILED_PRECONDITION") == 1

    # latency histograms: one observation per RPC, by op
    calls = {"registerlayout": 1, "allocate": 2, "commit": 2, "lookup": 2, "acquire": 1, "release": 1}
    for op, n in calls.items():
        assert v(m, "kvtier_op_latency_seconds_count", op=op) == n
        assert v(m, "kvtier_op_latency_seconds_bucket", op=op, le="+Inf") == n
        assert 0 < v(m, "kvtier_op_latency_seconds_sum", op=op) < 60
    buckets = sorted((float(dict(lbl)["le"]), val) for (name, lbl), val in m.items()
                     if name == "kvtier_op_latency_seconds_bucket" and dict(lbl)["op"] == "lookup")
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)   # cumulative
    assert all(("kvtier_op_latency_seconds_count", frozenset({("op", op)})) not in before for op in calls)
    # nothing moved that the workload did not touch
    for direction in ("gpu->host", "host->gpu", "host->disk", "disk->host"):
        assert v(m, "kvtier_bytes_total", direction=direction) == 0
    for tier in ("gpu", "disk"):
        assert v(m, "kvtier_hit_blocks_total", op="lookup", tier=tier) == 0

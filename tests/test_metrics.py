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

from kvtier.client import KvtierError, Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc
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
            if fam.name.startswith("kvtier_"):
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
    with open_channel(f"unix:{d.socket}") as ch:
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
    assert all(v(before, "kvtier_op_latency_seconds_count", op=op) == 0 for op in calls)   # exported at zero
    # nothing moved that the workload did not touch
    for direction in ("gpu->host", "host->gpu", "host->disk", "disk->host"):
        assert v(m, "kvtier_bytes_total", direction=direction) == 0
    for tier in ("gpu", "disk"):
        assert v(m, "kvtier_hit_blocks_total", op="lookup", tier=tier) == 0


def test_stats_typed_fields_the_counters_map_and_the_metrics_agree(metered) -> None:
    """The Stats reply's typed fields, its counters map (the names clients read) and /metrics
    carry the same numbers: one typed source, no grammar parsed anywhere."""
    d, port = metered
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys("s", 16), [b"\x01" * BLOCK] * 16)        # the 16 slots
        sc.put(lid, keys("t", 4), [b"\x02" * BLOCK] * 4)          # s-0 .. s-3 evicted
        sc.lookup(lid, keys("s", 24))
        sc.get(lid, keys("s", 6))
        with pytest.raises(KvtierError):
            sc.lookup(lid, [b"short"])
    with open_channel(f"unix:{d.socket}") as ch:
        reply = node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=10)
    m = scrape(port)
    ops = {node_pb2.COUNTED_OP_LOOKUP: "lookup", node_pb2.COUNTED_OP_ACQUIRE: "acquire"}
    tiers = {node_pb2.TIER_GPU: "gpu", node_pb2.TIER_HOST: "host", node_pb2.TIER_DISK: "disk",
             node_pb2.TIER_REMOTE: "remote"}
    assert len(reply.hits) == 2 * 5
    for h in reply.hits:
        op = ops[h.op]
        if h.tier == node_pb2.TIER_NONE:
            assert v(m, "kvtier_miss_blocks_total", op=op) == h.blocks == reply.counters[f"{op}_miss_blocks"]
            assert v(m, "kvtier_miss_tokens_total", op=op) == h.tokens == reply.counters[f"{op}_miss_tokens"]
        else:
            tier = tiers[h.tier]
            assert v(m, "kvtier_hit_blocks_total", op=op, tier=tier) == h.blocks == \
                reply.counters[f"{op}_hit_blocks:{tier}"]
            assert v(m, "kvtier_hit_tokens_total", op=op, tier=tier) == h.tokens
    looked = {(h.op, h.tier): h.blocks for h in reply.hits}
    assert looked[node_pb2.COUNTED_OP_LOOKUP, node_pb2.TIER_HOST] == 12
    assert looked[node_pb2.COUNTED_OP_LOOKUP, node_pb2.TIER_NONE] == 12
    assert looked[node_pb2.COUNTED_OP_ACQUIRE, node_pb2.TIER_HOST] == 2
    ends = {node_pb2.ENDPOINT_GPU: "gpu", node_pb2.ENDPOINT_HOST: "host", node_pb2.ENDPOINT_DISK: "disk",
            node_pb2.ENDPOINT_CLIENT: "client"}
    assert len(reply.bytes_moved) == 6
    for b in reply.bytes_moved:
        src, dst = ends[b.source], ends[b.destination]
        assert v(m, "kvtier_bytes_total", direction=f"{src}->{dst}") == b.bytes == reply.counters[f"bytes_{src}_to_{dst}"]
    assert {tiers[e.tier]: e.blocks for e in reply.evictions} == {"host": 4, "disk": 0}
    for e in reply.evictions:
        assert v(m, "kvtier_evictions_total", tier=tiers[e.tier]) == e.blocks
    assert [(e.code, e.count) for e in reply.errors] == [("INVALID_ARGUMENT", 1)]
    assert v(m, "kvtier_errors_total", code="INVALID_ARGUMENT") == 1 == reply.counters["errors:INVALID_ARGUMENT"]
    assert reply.totals["grants"] == 20 and reply.totals["commits"] == 20
    for name, value in reply.totals.items():
        assert v(m, f"kvtier_{name}_total") == value == reply.counters[name], name


def test_locations_handlers_are_timed_and_their_refusals_counted(metered) -> None:
    d, port = metered
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.report_device_blocks(lid, stored=keys("d", 2), worker_id="w")
        with pytest.raises(KvtierError) as e:
            sc.report_device_blocks(lid, stored=[b"short"], worker_id="w")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with open_channel(f"unix:{d.socket}") as ch:
        locations_pb2_grpc.LocationsStub(ch).GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=10)
    m = scrape(port)
    assert v(m, "kvtier_op_latency_seconds_count", op="reportdeviceblocks") == 2
    assert v(m, "kvtier_op_latency_seconds_count", op="getnodeinfo") == 1
    assert v(m, "kvtier_errors_total", code="INVALID_ARGUMENT") == 1
    assert v(m, "kvtier_device_reports_total") == 1

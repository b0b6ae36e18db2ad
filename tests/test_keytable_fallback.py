"""The sidecar's fallback from the shared-memory key table to the Lookup RPC, on a real kvtierd.

When the daemon's table cannot answer (it was marked invalid, or its heartbeat stopped) the
sidecar asks the daemon for a new table at once, then at most every ``TABLE_RETRY_S``; in
between, lookups are one Lookup RPC each and still exact.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Sidecar
from kvtier.client.engine.sidecar import TABLE_RETRY_S
from kvtier.client.engine.transport import open_channel
from kvtier.tiers.keytable import STATE_INVALID
from kvtier.tiers.layout import Layout

STATE_OFFSET = 24  # the header's state field (tiers/keytable.py, "File format")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register_calls(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvtier_op_latency_seconds_count" and s.labels.get("op") == "registerlayout":
                return s.value
    return 0.0


def test_an_unusable_table_is_asked_for_again_at_most_once_per_retry_period(start_daemon) -> None:
    """The daemon gave up on its table (state invalid, as ``KeyTableWriter.invalidate``
    writes it): every lookup must not re-register the layouts and map the table again."""
    port = free_port()
    d = start_daemon("--metrics-port", str(port), host_capacity="4MiB")
    layout = Layout.flat(4096)
    keys = [b"fallback" + i.to_bytes(8, "big") for i in range(8)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(layout)
        sc.put(lid, keys[:4], [bytes(4096)] * 4)
        table = sc._info(lid).table
        assert table is not None, "the sidecar did not map the daemon's key table"
        os.chmod(table.path, 0o600)  # the test is the file's owner: mark it as the daemon would
        with open(table.path, "r+b") as fh:
            fh.seek(STATE_OFFSET)
            fh.write(struct.pack("<I", STATE_INVALID))
        before = register_calls(port)
        started = time.monotonic()
        for _ in range(20):
            assert sc.lookup(lid, keys) == ["host"] * 4 + [None] * 4   # exact, through the RPC
            assert sc.prefix_length(lid, keys) == (4, 4)
        elapsed = time.monotonic() - started
        calls = register_calls(port) - before
        assert calls <= 1 + elapsed / TABLE_RETRY_S, f"{calls} RegisterLayout calls in {elapsed:.2f} s"


def test_a_lookup_report_naming_an_unknown_layout_counts_nothing(daemon) -> None:
    import grpc
    import pytest

    from kvtier.proto import node_pb2, node_pb2_grpc

    layout = Layout.flat(4096)
    with Sidecar(daemon.socket) as sc:
        lid = sc._info(sc.register_layout(layout)).daemon_id  # the daemon's id of the layout
        before = sc.stats()["counters"]
        with open_channel(f"unix:{daemon.socket}") as ch:
            req = node_pb2.ReportLookupsRequest()
            req.layouts.add(layout_id=lid, hit_host=5, miss=3)
            req.layouts.add(layout_id=lid ^ 1, hit_host=1)
            with pytest.raises(grpc.RpcError) as e:
                node_pb2_grpc.NodeStub(ch).ReportLookups(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            req.layouts.pop()
            node_pb2_grpc.NodeStub(ch).ReportLookups(req, timeout=10)  # the good part alone counts
        after = sc.stats()["counters"]
        assert after["lookup_hit_blocks:host"] - before.get("lookup_hit_blocks:host", 0) == 5
        assert after["lookup_miss_blocks"] - before.get("lookup_miss_blocks", 0) == 3

"""``kvtier report`` against real daemons: the numbers are the workload's, an unreachable one is shown."""

from __future__ import annotations

import json
import socket

from kvtier.client import Sidecar
from kvtier.client.tools.report import NodeReport, _recent, format_table, main
from kvtier.tiers.layout import Layout

BLOCK = 64 * 1024


def _workload(sock: str, held: int, asked_missing: int) -> None:
    with Sidecar(sock) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        keys = [f"k-{i:08d}".encode() for i in range(held)]
        sc.put(lid, keys, [b"\x01" * BLOCK] * held)
        missing = [f"m-{i:08d}".encode() for i in range(asked_missing)]
        sc.lookup(lid, keys + missing)
        sc.get(lid, keys[:1] + missing[:1])


def test_once_json_two_nodes_and_an_unreachable_one(start_daemon, tmp_path, capsys) -> None:
    a = start_daemon("--node-id", "node-a", name="a")
    b = start_daemon("--node-id", "node-b", name="b")
    _workload(a.socket, held=3, asked_missing=1)   # lookup: 3 of 4
    _workload(b.socket, held=1, asked_missing=3)   # lookup: 1 of 4
    gone = str(tmp_path / "nobody.sock")
    rc = main(["--daemons", f"{a.socket},{b.socket},{gone}", "--once", "--json", "--timeout", "1"])
    assert rc == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    nodes = {n["target"]: n for n in out["nodes"]}
    na, nb, ng = nodes[a.socket], nodes[b.socket], nodes[gone]
    assert (na["node_id"], na["asked_blocks"], na["hit_blocks"]["host"], na["miss_blocks"]) == ("node-a", 4, 3, 1)
    assert na["hit_rate"] == 0.75 and na["hit_rate_by_tier"] == {"gpu": 0.0, "host": 0.75, "disk": 0.0, "remote": 0.0}
    assert na["reuse_tokens_share"] == 0.75
    assert (nb["asked_blocks"], nb["hit_rate"]) == (4, 0.25)
    assert not ng["reachable"] and ng["error"]
    assert out["fleet"]["asked_blocks"] == 8 and out["fleet"]["hit_rate"] == 0.5

    # acquire counts instead: each node read one held block and asked for one missing one
    assert main(["--daemons", f"{a.socket},{b.socket}", "--once", "--json", "--op", "acquire"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(n["asked_blocks"], n["hit_rate"]) for n in out["nodes"]] == [(2, 0.5), (2, 0.5)]

    assert main(["--daemons", f"{a.socket},{gone}", "--once", "--timeout", "1"]) == 1
    table = capsys.readouterr().out
    assert "node-a" in table and "75.0%" in table and "unreachable" in table and "(fleet)" in table


def test_recent_hit_rate_is_over_the_interval_and_resets_on_restart() -> None:
    prev = NodeReport("t", True, epoch=1, hit_blocks={"gpu": 0, "host": 10, "disk": 0}, miss_blocks=10)
    now = NodeReport("t", True, epoch=1, hit_blocks={"gpu": 0, "host": 13, "disk": 0}, miss_blocks=11)
    assert _recent({"t": prev}, [now]) == {"t": 0.75, "fleet": 0.75}
    restarted = NodeReport("t", True, epoch=2, hit_blocks={"gpu": 0, "host": 1, "disk": 0})
    assert _recent({"t": prev}, [restarted]) == {"t": None, "fleet": None}
    assert "-" in format_table([restarted], {"t": None, "fleet": None})


def test_prometheus_target_reports_the_same_numbers(start_daemon, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon("--node-id", "prom", "--metrics-port", str(port))
    _workload(d.socket, held=2, asked_missing=2)
    url = f"http://127.0.0.1:{port}"
    reports = []
    for target in (d.socket, url):   # one at a time: listed together they are one daemon, reported once
        assert main(["--daemons", target, "--once", "--json"]) == 0
        reports += json.loads(capsys.readouterr().out.strip().splitlines()[-1])["nodes"]
    via_rpc, via_prom = reports
    for field in ("node_id", "epoch", "asked_blocks", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens",
                  "hit_rate"):
        assert via_rpc[field] == via_prom[field], field
    assert via_prom["hit_rate"] == 0.5 and via_prom["capacity_bytes"]["host"] > 0
    assert main(["--daemons", "http://127.0.0.1:1", "--once", "--json", "--timeout", "1"]) == 1

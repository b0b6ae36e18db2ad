"""``kvtier``: the command-line tool.

    kvtier stats [--socket PATH | --target HOST:PORT] [--json]   a daemon's state
    kvtier demo [...]                                           a real daemon and a multi-turn workload
    kvtier report --daemons A,B [--once --json]                 live hit rate by tier and node
    kvtier route-server --daemon A [--daemon B] [--dns H:P]     the router as a gRPC service
    kvtier gateway --replica A=URL --model M --tokenizer DIR   OpenAI front door routing by cached prefix
    kvtier replay TRACE.jsonl [--replicas 1,2,4,8 ...]          offline hit rate by tier, replicas, policy
    kvtier health [SOCKET | HOST:PORT]                          exit 0 when a daemon serves (probes)
    kvtier trace from-chat LOG.jsonl --tokenizer DIR --block-tokens N   chat logs -> a trace
    kvtier measure --engines URL,... [--daemons ...] [--trace F]  prefix share and hit rate per replica

Each command lives in its own module with a ``main(argv)``; see COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from kvtier.client.engine.sidecar import KvtierError, Sidecar
from kvtier.client.engine.transport import ClientTls, socket_path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def stats_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier stats", description="Print a kvtierd's tiers, layouts and counters.")
    ap.add_argument("--socket", help="daemon unix socket (default: the daemon's default path)")
    ap.add_argument("--target", help="gRPC target instead of a socket, e.g. node7:7070")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tls-cert", help="with --target: client certificate (PEM) the daemon's --tls-ca signed "
                                       "(default $KVTIER_TLS_CERT); the daemon must serve Node on TCP "
                                       "(--tcp-services all)")
    ap.add_argument("--tls-key", help="with --target: the client certificate's key (default $KVTIER_TLS_KEY)")
    ap.add_argument("--tls-ca", help="with --target: CA of the daemon's certificate (default $KVTIER_TLS_CA)")
    ns = ap.parse_args(argv)
    tls = ClientTls(ns.tls_cert, ns.tls_key, ns.tls_ca) if ns.tls_cert and ns.tls_key and ns.tls_ca else None
    path = socket_path(ns.socket)
    if not ns.target and not os.path.exists(path):
        print(f"kvtier stats: no daemon socket at {path}; is kvtierd running? (--socket PATH)", file=sys.stderr)
        return 1
    try:
        with Sidecar(ns.socket, target=ns.target, timeout=10, tls=tls) as sc:
            st = sc.stats()
    except KvtierError as e:
        print(f"kvtier stats: {e}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(st))
        return 0
    print(f"node {st['node_id']}  epoch {st['epoch']}  up {st['uptime_s']:.0f} s  sessions {st['sessions']}  "
          f"version {st['version']}")
    tiers = [[tier, str(t["blocks"]), _fmt_bytes(t["used_bytes"]), _fmt_bytes(t["capacity_bytes"]),
              f"{t['used_bytes'] / t['capacity_bytes'] if t['capacity_bytes'] else 0.0:.0%}"]
             for tier, t in st["tiers"].items()]
    print("\n" + _table(["tier", "blocks", "used", "capacity", "full"], tiers, left=1))
    if st["layouts"]:
        layouts = [[str(lay["layout_id"]), lay["fingerprint"], _fmt_bytes(lay["block_bytes"]),
                    str(lay["host_blocks"]), str(lay["disk_blocks"])] for lay in st["layouts"]]
        print("\n" + _table(["layout", "fingerprint", "block", "host", "disk"], layouts, left=2))
    if st["counters"]:
        print("\ncounters")
        width = max(map(len, st["counters"]))
        for name in sorted(st["counters"]):
            print(f"  {name:<{width}}  {st['counters'][name]:>16}")
    return 0


def _table(head: list[str], rows: list[list[str]], left: int) -> str:
    """Columns as wide as their widest cell, two spaces apart: the first ``left`` left-aligned
    (names), the others right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in [head, *rows])


#: command -> (one-line description, module with a ``main(argv) -> int``); imported on use
COMMANDS = {
    "stats": ("a daemon's tiers, layouts and counters", "kvtier.client.tools.cli:stats_main"),
    "demo": ("start a daemon and play a multi-turn workload; print hit rate by tier", "kvtier.client.tools.demo:main"),
    "report": ("live hit rate by tier and node across daemons (--once --json for scripts)",
               "kvtier.client.tools.report:main"),
    "route-server": ("serve cache-aware routing decisions over gRPC (kvtier.v1.Router)",
                     "kvtier.client.routing.route_server:main"),
    "gateway": ("an OpenAI-compatible HTTP front door routing each request to the replica holding its prefix",
                "kvtier.client.gateway.server:main"),
    "replay": ("replay a Mooncake-format trace: hit rate by tier, replicas and router policy",
               "kvtier.client.tools.replay:main"),
    "health": ("exit 0 when a kvtierd's gRPC health service answers SERVING (probes)",
               "kvtier.client.tools.health:main"),
    "trace": ("make traces from chat logs (from-chat) and inspect them (stats)", "kvtier.client.tools.trace:main"),
    "measure": ("prefix share and hit rate per replica from engines' and daemons' metrics (--trace: predictions)",
                "kvtier.client.tools.measure:main"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvtier COMMAND [options]\n\ncommands:")
        for name, (doc, _) in COMMANDS.items():
            print(f"  {name:<14}{doc}")
        print("\n`kvtier COMMAND --help` for a command's options.")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"kvtier: unknown command {cmd!r}; see kvtier --help", file=sys.stderr)
        return 2
    module, func = COMMANDS[cmd][1].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvtier report [--daemons SOCK_OR_HOST:PORT,...]``: hit rate by tier and node, across a fleet.

Without ``--daemons`` it reports this node's kvtierd
(:func:`kvtier.client.engine.transport.socket_path`: ``$KVTIER_SOCKET``, else the default
socket path).

Reads each daemon's Stats RPC (its typed fields: hits per operation and tier, misses, tier
occupancy; the same counters its Prometheus endpoint exports) and shows,
per node and for the whole fleet: blocks asked for, the share found in each tier (gpu, host,
disk) and in any tier, and the share of tokens that were prefix reuse (tokens found / tokens
asked for). Counts are of one operation's requests, ``--op``: ``lookup`` (what engines and
routers asked, the default) or ``acquire`` (what clients actually read).

Live (default): the table is redrawn every ``--interval`` seconds, with the hit rate over the
last interval beside the totals since each daemon started (on a terminal the screen is cleared
first; into a pipe or a file each table follows the last). ``--once`` prints one table;
``--once --json`` prints one JSON object (``{"nodes": [...], "fleet": {...}}``) for scripts.
A daemon that does not answer within ``--timeout`` is shown as unreachable and the others
are still reported; the exit status is 1 if any was unreachable.

A target is a unix socket path (has a ``/`` or ends in ``.sock``), a Prometheus endpoint
(``http://HOST:PORT``, the daemon's ``--metrics-port``; ``/metrics`` is appended unless a path
is given), or else a gRPC ``HOST:PORT``. Both sources carry the same counters. A daemon named
twice (its socket and its TCP port or metrics URL) is reported and counted once: reports with
the same node id and epoch (the Stats reply's, or ``kvtier_node_info``'s) are one daemon, and
its other targets are listed in ``also``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from kvtier.client.engine.transport import ClientTls, KvtierError, open_channel, socket_path
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.vocab import ALL_TIERS, Tier

TIERS = tuple(t.label for t in ALL_TIERS)  # remote: blocks a get fetched from a peer or the store
STORED_TIERS = (Tier.HOST.label, Tier.DISK.label)  # the tiers a daemon holds bytes in: occupancy columns
#: ``--op`` -> the Stats reply's CountedOp
OPS = {"lookup": node_pb2.COUNTED_OP_LOOKUP, "acquire": node_pb2.COUNTED_OP_ACQUIRE}


@dataclass
class NodeReport:
    """One daemon's counters of one operation, cumulative since it started."""

    target: str
    reachable: bool = False
    error: str = ""
    node_id: str = ""
    epoch: int = 0
    uptime_s: float = 0.0
    hit_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    used_bytes: dict[str, int] = field(default_factory=dict)
    capacity_bytes: dict[str, int] = field(default_factory=dict)
    also: list[str] = field(default_factory=list)   # other targets that reached the same daemon

    @property
    def asked_blocks(self) -> int:
        return sum(self.hit_blocks.values()) + self.miss_blocks

    def hit_rate_by_tier(self) -> dict[str, float]:
        n = self.asked_blocks
        return {t: (self.hit_blocks.get(t, 0) / n if n else 0.0) for t in TIERS}

    def hit_rate(self) -> float:
        n = self.asked_blocks
        return sum(self.hit_blocks.values()) / n if n else 0.0

    def reuse_share(self) -> float:
        n = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / n if n else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(asked_blocks=self.asked_blocks, hit_rate=self.hit_rate(), hit_rate_by_tier=self.hit_rate_by_tier(),
                 reuse_tokens_share=self.reuse_share())
        return d


class Unreachable(Exception):
    """A target that did not answer; the message says why (``CODE: details``)."""


def from_stats_reply(target: str, reply: node_pb2.StatsReply, op: str = "lookup") -> NodeReport:
    """A :class:`NodeReport` from a Stats reply's typed fields (``hits``: per op and tier, the
    misses under TIER_NONE; ``tiers``: occupancy)."""
    rep = NodeReport(target, True, node_id=reply.node_id, epoch=reply.epoch, uptime_s=reply.uptime_s)
    want = OPS[op]
    for h in reply.hits:
        if h.op != want:
            continue
        if h.tier == node_pb2.TIER_NONE:
            rep.miss_blocks += h.blocks
            rep.miss_tokens += h.tokens
        else:
            rep.hit_blocks[Tier(h.tier).label] += h.blocks
            rep.hit_tokens += h.tokens
    for t in reply.tiers:
        if t.tier != node_pb2.TIER_NONE:
            rep.used_bytes[Tier(t.tier).label] = t.used_bytes
            rep.capacity_bytes[Tier(t.tier).label] = t.capacity_bytes
    return rep


def from_prometheus(target: str, text: str, op: str = "lookup") -> NodeReport:
    """A :class:`NodeReport` from /metrics text: the ``kvtier_hit_*``, ``kvtier_miss_*`` series of
    ``op`` and the tier gauges, by their labels, and the epoch of ``kvtier_node_info`` (0 from
    a daemon that does not export it)."""
    from prometheus_client.parser import text_string_to_metric_families

    rep = NodeReport(target, True)
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            lbl, value = smp.labels, int(smp.value)
            rep.node_id = lbl.get("node", rep.node_id)
            if smp.name == "kvtier_node_info" and lbl.get("epoch", "").isdigit():
                rep.epoch = int(lbl["epoch"])
            if lbl.get("op", op) != op:
                continue
            if smp.name == "kvtier_hit_blocks_total" and lbl.get("tier") in TIERS:
                rep.hit_blocks[lbl["tier"]] = value
            elif smp.name == "kvtier_hit_tokens_total":
                rep.hit_tokens += value
            elif smp.name == "kvtier_miss_blocks_total":
                rep.miss_blocks = value
            elif smp.name == "kvtier_miss_tokens_total":
                rep.miss_tokens = value
            elif smp.name in ("kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes") and lbl.get("tier") in TIERS:
                into = rep.used_bytes if smp.name == "kvtier_tier_used_bytes" else rep.capacity_bytes
                into[lbl["tier"]] = value
    return rep


class _PrometheusSource:
    def __init__(self, url: str, timeout: float) -> None:
        self.url = url if url.count("/") > 2 else url.rstrip("/") + "/metrics"
        self.timeout = timeout

    def report(self, target: str, op: str) -> NodeReport:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:
                return from_prometheus(target, resp.read().decode(), op)
        except (urllib.error.URLError, OSError) as e:
            raise Unreachable(f"UNAVAILABLE: {self.url}: {getattr(e, 'reason', e)}") from None

    def close(self) -> None:
        pass


class _GrpcSource:
    """A daemon's Stats RPC over its unix socket or gRPC ``HOST:PORT``."""

    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.channel: Any = None  # opened on first use (a unix socket's credential handshake first)
        self.timeout = timeout

    def report(self, target: str, op: str) -> NodeReport:
        try:
            if self.channel is None:
                self.channel = open_channel(self.target, tls=ClientTls.from_env(), timeout=self.timeout)
            reply = node_pb2_grpc.NodeStub(self.channel).Stats(node_pb2.StatsRequest(), timeout=self.timeout,
                                                               wait_for_ready=True)
        except KvtierError as e:
            raise Unreachable(f"{e.code.name}: {e.details}") from None
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE):
                self.close()  # a restarted daemon knows no old token: hand-shake again next time
            raise Unreachable(f"{e.code().name}: {e.details() or ''}") from None
        return from_stats_reply(target, reply, op)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            creds = getattr(self.channel, "kvtier_credentials", None)
            if creds is not None:
                creds.close()
            self.channel = None


def fleet_total(nodes: Sequence[NodeReport]) -> NodeReport:
    total = NodeReport("fleet", reachable=any(n.reachable for n in nodes), node_id="(fleet)")
    for n in nodes:
        if not n.reachable:
            continue
        for t in TIERS:
            total.hit_blocks[t] += n.hit_blocks.get(t, 0)
        total.miss_blocks += n.miss_blocks
        total.hit_tokens += n.hit_tokens
        total.miss_tokens += n.miss_tokens
        for tier, b in n.used_bytes.items():
            total.used_bytes[tier] = total.used_bytes.get(tier, 0) + b
        for tier, b in n.capacity_bytes.items():
            total.capacity_bytes[tier] = total.capacity_bytes.get(tier, 0) + b
    return total


def merge_duplicates(nodes: Sequence[NodeReport]) -> list[NodeReport]:
    """One report per daemon: reachable reports with the same node id and (known) epoch came
    from one daemon through several targets; the first stays, the others' targets go to its
    ``also``."""
    out: list[NodeReport] = []
    first: dict[tuple[str, int], NodeReport] = {}
    for n in nodes:
        key = (n.node_id, n.epoch)
        if n.reachable and n.epoch and key in first:
            first[key].also.append(n.target)
            continue
        if n.reachable and n.epoch:
            first[key] = n
        out.append(n)
    return out


def _source(target: str, timeout: float) -> _GrpcSource | _PrometheusSource:
    if target.startswith(("http://", "https://")):
        return _PrometheusSource(target, timeout)
    if "/" in target or target.endswith(".sock"):
        return _GrpcSource(f"unix:{target}", timeout)
    return _GrpcSource(target, timeout)


@contextlib.contextmanager
def until_interrupted() -> Iterator[threading.Event]:
    """An event that Ctrl-C (SIGINT) sets, instead of raising KeyboardInterrupt wherever the
    main thread is: a KeyboardInterrupt raised inside a blocking gRPC call leaves the call in
    flight, and closing its channel then can hang (grpc/grpc#19973; seen here as ``kvtier
    report``/``measure`` not exiting). A live loop checks the event between polls and sleeps
    on it, so it quits within one poll (at most ``--timeout``). Outside the main thread (no
    signal handlers there) the event is never set and Ctrl-C works as before."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old)


class Fleet:
    """Open channels to every target once; ``poll()`` reads them all."""

    def __init__(self, targets: Sequence[str], op: str, timeout: float) -> None:
        self.targets, self.op = list(targets), op
        self.clients = {t: _source(t, timeout) for t in self.targets}

    def poll(self) -> list[NodeReport]:
        out = []
        for t, source in self.clients.items():
            try:
                out.append(source.report(t, self.op))
            except Unreachable as e:
                out.append(NodeReport(t, False, error=str(e)))
        return merge_duplicates(out)

    def close(self) -> None:
        for source in self.clients.values():
            source.close()


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _gib(b: int) -> str:
    return f"{b / 2**30:.1f}"


def format_table(nodes: Sequence[NodeReport], recent: dict[str, float | None] | None = None) -> str:
    head = ["node", "target", "asked_blocks", *TIERS, "hit_rate", "reuse_tokens"]
    if recent is not None:
        head.append("hit_rate_recent")
    head += [f"{t}_GiB" for t in STORED_TIERS]
    lines = [head]
    for n in [*nodes, fleet_total(nodes)]:
        if not n.reachable:
            lines.append([n.node_id or "?", n.target, f"unreachable: {n.error}"[:60]])
            continue
        by = n.hit_rate_by_tier()
        row = [n.node_id, " = ".join([n.target, *n.also]), f"{n.asked_blocks:,}", *(_pct(by[t]) for t in TIERS),
               _pct(n.hit_rate()), _pct(n.reuse_share())]
        if recent is not None:
            r = recent.get(n.target)
            row.append("-" if r is None else _pct(r))
        for tier in STORED_TIERS:
            row.append(f"{_gib(n.used_bytes[tier])}/{_gib(n.capacity_bytes[tier])}" if tier in n.capacity_bytes else "-")
        lines.append(row)
    widths = [max(len(r[i]) for r in lines if i < len(r) and len(r) == len(head)) for i in range(len(head))]
    out = []
    for k, r in enumerate(lines):
        if len(r) != len(head):
            out.append("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2]]))
        else:
            out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _recent(prev: dict[str, NodeReport], nodes: Sequence[NodeReport]) -> dict[str, float | None]:
    """Hit rate over the last interval per target (and 'fleet'); None when nothing was asked."""
    out: dict[str, float | None] = {}
    hits_all = asked_all = 0
    for n in nodes:
        p = prev.get(n.target)
        if not n.reachable or p is None or not p.reachable or p.epoch != n.epoch:
            out[n.target] = None   # first sight, unreachable, or restarted: no interval to compare
            continue
        hits = sum(n.hit_blocks.values()) - sum(p.hit_blocks.values())
        asked = n.asked_blocks - p.asked_blocks
        if asked < 0 or hits < 0:   # counters went back: a restart seen through /metrics (no epoch there)
            out[n.target] = None
            continue
        out[n.target] = hits / asked if asked > 0 else None
        hits_all += hits
        asked_all += asked
    out["fleet"] = hits_all / asked_all if asked_all > 0 else None
    return out


def build_parser(prog: str = "kvtier report") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Hit rate by tier and node across kvtierd daemons.")
    ap.add_argument("--daemons", default=None,
                    help="comma list of daemon sockets (paths), gRPC HOST:PORT targets or http://HOST:PORT "
                         "metrics endpoints (default: this node's kvtierd: $KVTIER_SOCKET, else the default "
                         "socket path)")
    ap.add_argument("--op", choices=("lookup", "acquire"), default="lookup",
                    help="count lookups (asked) or acquires (read) [%(default)s]")
    ap.add_argument("--once", action="store_true", help="print once and exit")
    ap.add_argument("--json", action="store_true", help='with --once: one JSON object {"nodes": [...], "fleet": {...}}')
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes [%(default)s]")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each daemon [%(default)s]")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    targets = [t.strip() for t in (args.daemons or socket_path()).split(",") if t.strip()]
    if not targets:
        ap.error("--daemons needs at least one socket path or HOST:PORT")
    if args.json and not args.once:
        ap.error("--json needs --once")
    if args.interval <= 0:
        ap.error("--interval must be > 0")
    fleet = Fleet(targets, args.op, args.timeout)
    try:
        if args.once:
            nodes = fleet.poll()
            if args.json:
                print(json.dumps({"op": args.op, "nodes": [n.to_json() for n in nodes],
                                  "fleet": fleet_total(nodes).to_json()}))
            else:
                print(format_table(nodes))
            return 0 if all(n.reachable for n in nodes) else 1
        prev: dict[str, NodeReport] = {}
        prev_shown = False
        with until_interrupted() as stop:
            while not stop.is_set():
                _show_live(fleet, args, prev, prev_shown)
                prev_shown = True
                stop.wait(args.interval)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.close()


def _show_live(fleet: Fleet, args: argparse.Namespace, prev: dict[str, NodeReport], prev_shown: bool) -> None:
    """One refresh of the live table (``prev``: the last poll's reports, updated here)."""
    nodes = fleet.poll()
    recent = _recent(prev, nodes)
    prev.clear()
    prev.update({n.target: n for n in nodes})
    if sys.stdout.isatty():
        sys.stdout.write("\x1b[H\x1b[2J")  # home, clear screen
    elif prev_shown:
        print()
    print(f"kvtier report  op={args.op}  {time.strftime('%H:%M:%S')}  every {args.interval:g}s "
          f"(recent: over the last interval; Ctrl-C to quit)\n")
    print(format_table(nodes, recent))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())

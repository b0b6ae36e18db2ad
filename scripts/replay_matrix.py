"""The routing matrix: every trace x ``--rate-scale`` x policy, 8 replicas.

For each (trace, rate) it replays every policy and one pooled cache (1 replica with 8x the
capacity and 8x the disk write bandwidth: the hit rate 8 replicas could reach at most; with
disk writes modelled it moves a little with the rate, so it is replayed at each), and
checks kvtier's goals: hit rate >= 0.95 of the pooled one, p99 and mean TTFT no worse than
the best of the baselines (round-robin, random, session, prefix) at that rate.

    python scripts/replay_matrix.py                       # every trace, rates 1,2,4
    python scripts/replay_matrix.py --traces agentic --rates 1 --set new_session_spread=0
    python scripts/replay_matrix.py --json out.json       # the rows too

Single-threaded (one replay at a time: the machine is shared); the agentic trace first.
``--set FIELD=VALUE`` overrides a :class:`~kvtier.client.tools.replay.ReplayConfig` field for
every run (e.g. the router's new-session setting, to compare its values).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from kvtier.client.tools.replay import ReplayConfig, load_trace, pooled, replay

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "traces"
# name -> (path, capacities per replica as docs/replay.md uses them)
TRACES = {
    "agentic": (SHARED / "agentic_sessions.jsonl",
                {"gpu_tokens": 300_000, "host_tokens": 2_000_000, "disk_tokens": 8_000_000, "block_tokens": 256}),
    "conversation": (ROOT / "traces" / "conversation_trace.jsonl",
                     {"gpu_tokens": 100_000, "host_tokens": 1_000_000, "disk_tokens": 10_000_000}),
    "synthetic": (ROOT / "traces" / "synthetic_trace.jsonl",
                  {"gpu_tokens": 100_000, "host_tokens": 1_000_000, "disk_tokens": 10_000_000}),
}
BASELINES = ("round-robin", "random", "session", "prefix")
KVTIER = ("kvtier", "kvtier-pull")


def _value(field_type: object, text: str) -> object:
    kind = str(field_type)
    if "bool" in kind:
        return text.lower() in ("1", "true", "yes", "on")
    if "int" in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    return text


def parse_sets(items: list[str]) -> dict[str, object]:
    types = {f.name: f.type for f in fields(ReplayConfig)}
    out: dict[str, object] = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in types:
            raise SystemExit(f"--set {item}: no ReplayConfig field {name!r} (fields: {', '.join(types)})")
        out[name] = _value(types[name], text)
    return out


def run(traces: list[str], rates: list[float], policies: list[str], sets: dict[str, object],
        replicas: int = 8, peer_gbps: float = 10.0) -> list[dict]:
    rows: list[dict] = []
    for name in traces:
        path, caps = TRACES[name]
        base = load_trace(str(path))
        cfg = replace(ReplayConfig(), peer_gbps=peer_gbps, **caps, **sets)
        for rate in rates:
            reqs = base if rate == 1 else [replace(r, arrival_s=r.arrival_s / rate) for r in base]
            rcfg = replace(cfg, rate_scale=rate)
            t0 = time.monotonic()
            pool = pooled(reqs, rcfg, [replicas])[replicas].hit_rate
            print(f"# {name} {rate:g}x: pooled 1 x {replicas}x capacity hit rate {pool:.4f} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
            for pol in policies:
                t0 = time.monotonic()
                row = replay(reqs, rcfg, pol, replicas)
                d = asdict(row)
                d.update(trace=name, rate=rate, pooled_hit_rate=pool, wall_s=round(time.monotonic() - t0, 1))
                rows.append(d)
                print(f"# {name} {rate:g}x {pol}: {d['wall_s']} s", file=sys.stderr, flush=True)
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """One line per (trace, rate, kvtier policy): the three goals, met or not."""
    out = []
    cells: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["rate"]), []).append(r)
    for (trace, rate), rs in cells.items():
        base = [r for r in rs if r["policy"] in BASELINES and r["na"] is None]
        if not base:
            continue
        best_p99 = min(r["ttft_p99_s"] for r in base)
        best_mean = min(r["ttft_mean_s"] for r in base)
        for r in rs:
            if r["policy"] not in KVTIER:
                continue
            ratio = r["hit_rate"] / r["pooled_hit_rate"]
            ok = (ratio >= 0.95, r["ttft_p99_s"] <= best_p99, r["ttft_mean_s"] <= best_mean)
            out.append(f"{trace:12} {rate:>4g}x {r['policy']:12} hit/pooled {ratio:.3f} {'ok' if ok[0] else 'NO'}"
                       f"  p99 {r['ttft_p99_s']:.3f} vs {best_p99:.3f} {'ok' if ok[1] else 'NO'}"
                       f"  mean {r['ttft_mean_s']:.3f} vs {best_mean:.3f} {'ok' if ok[2] else 'NO'}")
    return out


def table(rows: list[dict]) -> str:
    lines = ["| trace | rate | policy | hit_rate | / pooled | remote | imbalance | ttft_mean_s | ttft_p99_s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["na"] is not None:
            lines.append(f"| {r['trace']} | {r['rate']:g}x | {r['policy']} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        lines.append(f"| {r['trace']} | {r['rate']:g}x | {r['policy']} | {r['hit_rate']:.4f} | "
                     f"{r['hit_rate'] / r['pooled_hit_rate']:.3f} | {r['remote_hit_rate']:.4f} | "
                     f"{r['imbalance']:.3f} | {r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="agentic,conversation,synthetic", help="comma list of " + ", ".join(TRACES))
    ap.add_argument("--rates", default="1,2,4", help="comma list of --rate-scale values")
    ap.add_argument("--policies", default=",".join(BASELINES + KVTIER))
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--peer-gbps", type=float, default=10.0, help="peers for kvtier-pull (others never pull)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a ReplayConfig field for every run")
    ap.add_argument("--json", metavar="FILE", help="write the rows and verdicts here")
    ap.add_argument("--baselines-from", metavar="FILE",
                    help="take the baseline policies' rows from an earlier --json FILE (same traces and rates: "
                         "the router's settings do not change them) instead of replaying them")
    args = ap.parse_args(argv)
    traces = [t for t in args.traces.split(",") if t]
    unknown = [t for t in traces if t not in TRACES]
    if unknown:
        ap.error(f"unknown trace(s) {unknown}; choose from {', '.join(TRACES)}")
    rates = [float(x) for x in args.rates.split(",")]
    policies = args.policies.split(",")
    earlier: list[dict] = []
    if args.baselines_from:
        earlier = [r for r in json.loads(Path(args.baselines_from).read_text())["rows"]
                   if r["policy"] in BASELINES and r["trace"] in traces and r["rate"] in rates]
        policies = [p for p in policies if p not in BASELINES]
    rows = run(traces, rates, policies, parse_sets(args.set), args.replicas, args.peer_gbps)
    if earlier:
        order = {(t, r): i for i, (t, r) in enumerate((t, r) for t in traces for r in rates)}
        rows = sorted(earlier + rows, key=lambda r: (order[(r["trace"], r["rate"])],
                                                     (BASELINES + KVTIER).index(r["policy"])
                                                     if r["policy"] in BASELINES + KVTIER else 99))
    print(table(rows))
    print()
    v = verdicts(rows)
    print("\n".join(v))
    if args.json:
        Path(args.json).write_text(json.dumps({"sets": args.set, "rows": rows, "verdicts": v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

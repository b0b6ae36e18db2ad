"""Host-tier hit rate of each eviction order (lru, kvtier, lirs, adaptive, lirs50, wtinylfu, opt) on the bundled traces.

One replica (``--policy round-robin --replicas 1``), a gpu tier of 64k tokens, no disk, host
capacities in blocks: the table at the named capacities (with the acceptance rule: a candidate
order at least lru + half of (opt - lru)), then a sweep from 1 % to 100 % of each trace's
distinct blocks (a candidate never below lru - 0.01). Prints both tables, writes a plot
(``--plot``, default docs/eviction-sweep.png) and prints one JSON object as the last line.

``lru``, ``kvtier``, ``lirs``, ``adaptive`` and ``opt`` are the replay's (``--eviction``). ``lirs50`` is the
policy's LIRS with half of host for HIR blocks (``Lirs(capacity, 0.5)``) in place of
``LIRS_HIR_SHARE``; ``wtinylfu`` is a model of W-TinyLFU here only (:class:`WTinyLFU`, not a
``TierPolicy`` order). Both run in the same model: the same gpu tier in front, one pooled host
cache, only a leading run served; on ``lru``, ``kvtier`` and ``lirs`` such a model gives the
replay's numbers.

    python scripts/eviction_sweep.py [--traces DIR] [--only NAME,...] [--fractions 0.01,0.1,1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import replace

from kvtier.client.tools.replay import ReplayConfig, load_trace, replay
from kvtier.tiers.policy import HOST, Lirs, TierPolicy

TRACES = {  # name: (block tokens, host capacities in blocks for the table)
    "conversation_trace": (512, (5000, 20000)),
    "synthetic_trace": (512, (5000, 10000)),
    "agentic_sessions": (256, (8000, 20000)),
}
EVICTIONS = ("lru", "kvtier", "lirs", "adaptive", "lirs50", "wtinylfu", "opt")
CANDIDATES = ("kvtier", "lirs", "adaptive", "lirs50", "wtinylfu")  # the orders held to the acceptance rules
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)


class WTinyLFU:
    """W-TinyLFU (Einziger et al.) with a chain's prefix rule. A window LRU (``window`` of the
    capacity) in front of a segmented main LRU (probation, and ``protected`` of the main); a
    frequency sketch (count-min, 4 rows of ``width`` x capacity 4-bit counters, a doorkeeper
    set in front, all halved every ``sample`` x capacity sightings) counts every key of every
    request. Prefix rule: keys are touched tail first (a chain's head ends the most recent);
    a request's new keys enter the window as one run and leave it as one, head first, each
    admitted to probation while its estimate beats the main's victim (probation's least
    recently used); the first key refused refuses the rest of its run (useless without it)."""

    def __init__(self, cap: int, window: float = 0.01, protected: float = 0.5, sample: int = 10,
                 width: int = 4) -> None:
        self.wcap = max(1, int(cap * window))
        self.mcap = cap - self.wcap
        self.pcap = int(self.mcap * protected)
        self.win: dict[int, int] = {}                       # key -> its run (request number)
        self.runs: OrderedDict[int, list[int]] = OrderedDict()
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        w = 16
        while w < cap * width:
            w <<= 1
        self.mask, self.rows = w - 1, [bytearray(w) for _ in range(4)]
        self.door: set[int] = set()
        self.sample, self.seen, self.req = max(1, sample * cap), 0, 0

    def _cells(self, k: int) -> list[int]:
        h = hash(k) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        return [((h ^ s) * 0xBF58476D1CE4E5B9 >> 29 ^ (h >> (7 * i))) & self.mask
                for i, s in enumerate((0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5))]

    def _add(self, k: int) -> None:
        if k not in self.door:
            self.door.add(k)
        else:
            for r, i in zip(self.rows, self._cells(k), strict=True):
                if r[i] < 15:
                    r[i] += 1
        self.seen += 1
        if self.seen >= self.sample:  # aging
            self.seen //= 2
            for r in self.rows:
                r[:] = bytes(x >> 1 for x in r)
            self.door.clear()

    def _est(self, k: int) -> int:
        return min(r[i] for r, i in zip(self.rows, self._cells(k), strict=True)) + (k in self.door)

    def __contains__(self, k: int) -> bool:
        return k in self.win or k in self.prob or k in self.prot

    def access(self, keys: tuple[int, ...]) -> None:
        self.req += 1
        win, prob, prot = self.win, self.prob, self.prot
        for k in keys:
            self._add(k)
        for k in reversed(keys):  # tail first
            if k in prot:
                prot.move_to_end(k)
            elif k in prob:
                del prob[k]
                prot[k] = None
                if len(prot) > self.pcap:
                    prob[prot.popitem(last=False)[0]] = None
        run = [k for k in keys if k not in prot and k not in prob]
        for k in run:
            win[k] = self.req  # a key seen again moves to this run
        if run:
            self.runs[self.req] = run
        self._drain()

    def _drain(self) -> None:
        """Runs leave the window, oldest first, until it fits: each admitted head first."""
        win, prob, prot = self.win, self.prob, self.prot
        while len(win) > self.wcap:
            r, ks = self.runs.popitem(last=False)
            cut = False
            for k in ks:
                if win.get(k) != r:
                    continue
                del win[k]
                if cut:
                    continue
                if len(prob) + len(prot) < self.mcap:
                    prob[k] = None
                    continue
                src = prob or prot
                v = next(iter(src))
                if self._est(k) > self._est(v):
                    del src[v]
                    prob[k] = None
                else:
                    cut = True


class LirsShare:
    """The policy's ``lirs`` order with another HIR share (a host tier alone, no disk)."""

    def __init__(self, cap: int, hir_share: float) -> None:
        self.policy = TierPolicy(0, cap, 0, eviction="lirs")
        self.policy._lirs = Lirs(cap, hir_share)
        self.held = self.policy.tiers[HOST]

    def __contains__(self, k: int) -> bool:
        return k in self.held

    def access(self, keys: tuple[int, ...]) -> None:
        self.policy.access(keys)


def _model_hit_rate(requests, block_tokens: int, host) -> float:
    """A host model's hit rate (blocks of leading runs / blocks), gpu LRU in front."""
    gpu_blocks = 64_000 // block_tokens
    gpu: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for req in requests:
        keys = req.keys
        for k in keys:
            if k not in gpu and k not in host:
                break
            hits += 1
        total += len(keys)
        host.access(keys)
        for k in keys:
            gpu[k] = None
            gpu.move_to_end(k)
        while len(gpu) > gpu_blocks:
            gpu.popitem(last=False)
    return hits / total if total else 0.0


def hit_rate(requests, block_tokens: int, host_blocks: int, eviction: str) -> float:
    if eviction == "wtinylfu":
        return _model_hit_rate(requests, block_tokens, WTinyLFU(host_blocks))
    if eviction == "lirs50":
        return _model_hit_rate(requests, block_tokens, LirsShare(host_blocks, 0.5))
    cfg = replace(ReplayConfig(), block_tokens=block_tokens, gpu_tokens=64_000, disk_tokens=0,
                  host_tokens=host_blocks * block_tokens, eviction=eviction)
    return replay(requests, cfg, "round-robin", 1).hit_rate or 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="/work/shared/traces", help="folder of the traces [%(default)s]")
    ap.add_argument("--only", help="comma list of trace names (default: all three)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="sweep points, shares of the trace's distinct blocks [%(default)s]")
    ap.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "..", "docs", "eviction-sweep.png"))
    ns = ap.parse_args(argv)
    names = ns.only.split(",") if ns.only else list(TRACES)
    fracs = [float(x) for x in ns.fractions.split(",") if x.strip()]
    table, sweep = [], {}
    for name in names:
        bt, caps = TRACES[name]
        reqs = load_trace(os.path.join(ns.traces, name + ".jsonl"))
        distinct = len({h for r in reqs for h in r.keys})
        for cap in caps:
            t = time.monotonic()
            r = {e: hit_rate(reqs, bt, cap, e) for e in EVICTIONS}
            goal = r["lru"] + (r["opt"] - r["lru"]) / 2
            met = {c: r[c] >= goal for c in CANDIDATES}
            table.append({"trace": name, "host_blocks": cap, **r, "goal": goal, "met": met})
            print(f"{name:20s} {cap:>7,d}  " + "  ".join(f"{e} {r[e]:.4f}" for e in EVICTIONS)
                  + f"  goal {goal:.4f} met: {[c for c in CANDIDATES if met[c]] or 'none'}"
                  f"  ({time.monotonic() - t:.0f}s)", flush=True)
        pts = []
        for f in fracs:
            cap = max(1, int(f * distinct))
            r = {e: hit_rate(reqs, bt, cap, e) for e in EVICTIONS}
            pts.append({"fraction": f, "host_blocks": cap, **r,
                        "margin": {c: r[c] - r["lru"] for c in CANDIDATES}})
            print(f"  sweep {name:20s} {f:5.0%} {cap:>7,d}  " + "  ".join(f"{e} {r[e]:.4f}" for e in EVICTIONS),
                  flush=True)
        sweep[name] = pts
    if ns.plot:
        _plot(sweep, ns.plot)
        print(f"plot written to {ns.plot}")
    pts = [p for ps in sweep.values() for p in ps]
    print(json.dumps({"table": table, "sweep": sweep,
                      "goal_met": {c: all(t["met"][c] for t in table) for c in CANDIDATES},
                      "min_margin_vs_lru": {c: min((p["margin"][c] for p in pts), default=None) for c in CANDIDATES},
                      "never_below_lru": {c: all(p["margin"][c] >= -0.01 for p in pts) for c in CANDIDATES}}))
    return 0


def _plot(sweep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, max(1, len(sweep)), figsize=(4.5 * max(1, len(sweep)), 3.8), squeeze=False)
    for ax, (name, pts) in zip(axes[0], sweep.items(), strict=False):
        xs = [p["fraction"] * 100 for p in pts]
        for e, style in (("lru", "o-"), ("kvtier", "s-"), ("lirs", "D-"), ("adaptive", "P-"), ("lirs50", "v-"),
                         ("wtinylfu", "^-"), ("opt", "k--")):
            ax.plot(xs, [p[e] for p in pts], style, markersize=4, label=e)
        ax.set_xscale("log")
        ax.set_xlabel("host capacity (% of distinct blocks)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("hit rate (1 replica, gpu 64k tokens, no disk)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""``kvtier replay TRACE.jsonl``: what hit rate, by tier, would N replicas behind this router get?

Replays a request trace in the Mooncake format (one JSON object a line, time-ordered:
``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``, optional
``session_id``) through the real routing cost (:class:`kvtier.client.routing.scoring.Scorer`) and the
real placement policy (:class:`kvtier.tiers.policy.TierPolicy`), as a simulation of metadata
only: no payload bytes move, so an hour of traffic replays in seconds.

The model
    * Each replica is one engine worker on its own node: one ``TierPolicy`` with the given gpu,
      host and disk capacities (tokens, turned into blocks of ``--block-tokens``).
    * Requests are routed in arrival order. The chosen replica's tiers serve the request's
      leading run of held blocks at once (the cache state moves in arrival order), and every
      block it used is then held there (see ``TierPolicy``).
    * Service: a replica prefills one request at a time, first come first served. A request's
      prefill takes (tokens not served from a tier) / ``--prefill-tps`` plus, for blocks served
      from host or disk, their bytes (``--kv-bytes-per-token``) over that tier's load bandwidth
      (never more than recomputing them would take: an engine would recompute instead).
      TTFT = time queued behind earlier prefills + own prefill. Decoding runs alongside (a
      continuous batch) at ``--decode-tps`` tokens per second per request; a request is
      *active* on its replica from dispatch until its last output token.
    * Hit rate is in blocks: blocks served from any tier / blocks in the trace. For one
      replica with unbounded capacity it equals the trace's ideal prefix hit rate.

Policies (``--policy``)
    ``round-robin``.
    ``random``: seeded by ``--seed``.
    ``session``: a session's requests stick to the replica its first request went to; new
    sessions, and requests without a session, go round-robin; n/a when no request of the
    trace has a ``session_id``.
    ``prefix``: Dynamo-like: cost = blocks to prefill, counting a device prefix as held, host
    blocks beyond it as 0.75 and disk blocks beyond that as 0.25, plus queued prefill blocks,
    plus the blocks held by the active requests; equal costs broken at random (seeded).
    ``kvtier``: ours: the Scorer's cost, with tier weights from the load bandwidths and the
    prefill rate, load = ``--queued-weight`` x queued prefill blocks + ``--active-weight`` x
    active requests, and its deterministic ties.

Per (policy, replicas) the output has: ``hit_rate``, ``hit_rate_by_tier`` {gpu, host, disk},
``prefill_tokens_saved``, ``imbalance`` (max / mean of the prefill tokens each replica
computed), ``ttft_mean_s``, ``ttft_p99_s``; a terminal table, ``--json`` (``{"rows": [...]}``
as the last line) and ``--plot FILE.png`` (needs the ``plot`` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvtier.client.routing.scoring import Load, Overlap, Scorer, ScorerConfig
from kvtier.tiers.policy import DISK, GPU, HOST, TierPolicy
from kvtier.tiers.vocab import TIER_LABELS as TIER_NAMES

POLICIES = ("round-robin", "random", "session", "prefix", "kvtier")
#: the Dynamo-like ``prefix`` policy's fixed tier weights
PREFIX_HOST_WEIGHT, PREFIX_DISK_WEIGHT = 0.75, 0.25

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """``"100k"`` -> 100000, ``"1M"`` -> 10**6, ``"2G"`` -> 2 * 10**9; plain integers as they are."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"not a token count: {text!r} (use e.g. 100000, 100k, 1M, 10G)")
    return int(float(m[1]) * _SUFFIX[m[2].lower()])


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[int, ...]
    session: str | None = None


def load_trace(path: str) -> list[Request]:
    """Read a Mooncake-format trace; raises ValueError naming the line of a malformed record."""
    out: list[Request] = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                sess = rec.get("session_id")
                out.append(Request(rec["timestamp"] / 1000.0, int(rec["input_length"]), int(rec["output_length"]),
                                   tuple(int(h) for h in rec["hash_ids"]), None if sess is None else str(sess)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({type(e).__name__}: {e}); expected "
                                 f"timestamp, input_length, output_length, hash_ids") from None
    out.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return out


@dataclass(frozen=True)
class ReplayConfig:
    """The simulated deployment: per-replica capacities (tokens) and the service model."""

    block_tokens: int = 512
    gpu_tokens: int = 100_000
    host_tokens: int = 1_000_000
    disk_tokens: int = 10_000_000
    demote_min_seen: int = 2
    prefill_tps: float = 20_000.0          # prefill tokens per second of one replica
    decode_tps: float = 50.0               # output tokens per second of one request
    kv_bytes_per_token: float = 131_072.0  # KV bytes of one token (all layers of the shard)
    host_load_gbps: float = 50.0           # host -> GPU, 10^9 B/s
    disk_load_gbps: float = 6.0            # disk -> host -> GPU, 10^9 B/s
    # the kvtier policy's load weights: the Scorer's a and b, with the router's defaults
    queued_weight: float = ScorerConfig.queued_weight
    active_weight: float = ScorerConfig.active_weight
    seed: int = 0

    def blocks(self, tokens: int) -> int:
        return tokens // self.block_tokens

    def scorer_config(self) -> ScorerConfig:
        return ScorerConfig(prefill_tokens_per_s=self.prefill_tps, bytes_per_token=self.kv_bytes_per_token,
                            host_load_gbps=self.host_load_gbps, disk_load_gbps=self.disk_load_gbps,
                            queued_weight=self.queued_weight, active_weight=self.active_weight)

    def block_load_s(self, tier: int) -> float:
        """Seconds to bring one block from ``tier`` into the gpu (capped at recomputing it)."""
        recompute = self.block_tokens / self.prefill_tps
        if tier == GPU:
            return 0.0
        gbps = self.host_load_gbps if tier == HOST else self.disk_load_gbps
        if gbps <= 0:
            return recompute
        return min(recompute, self.block_tokens * self.kv_bytes_per_token / (gbps * 1e9))


@dataclass
class Row:
    """One (policy, replicas) result; ``None`` values (and ``na``) when the policy does not apply."""

    policy: str
    replicas: int
    hit_rate: float | None = None
    hit_rate_by_tier: dict[str, float] | None = None
    prefill_tokens_saved: int | None = None
    imbalance: float | None = None
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    requests: int = 0
    blocks: int = 0
    na: str | None = None   # why the policy does not apply to this trace
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: int = 0
    promotions: int = 0


class Replica:
    """One simulated worker: its tiers and its queue."""

    __slots__ = ("policy", "free_at", "active", "active_blocks", "computed_tokens")

    def __init__(self, cfg: ReplayConfig) -> None:
        self.policy = TierPolicy(cfg.blocks(cfg.gpu_tokens), cfg.blocks(cfg.host_tokens),
                                 cfg.blocks(cfg.disk_tokens), cfg.demote_min_seen)
        self.free_at = 0.0                        # when its prefill queue drains
        self.active: list[tuple[float, int]] = []  # heap of (finish time, blocks held)
        self.active_blocks = 0
        self.computed_tokens = 0                  # prefill work done: tokens computed

    def advance(self, now: float) -> None:
        act = self.active
        while act and act[0][0] <= now:
            self.active_blocks -= heapq.heappop(act)[1]


Router = Callable[[Request, float, list[Replica]], int]


def make_router(policy: str, cfg: ReplayConfig, n: int) -> Router:
    """The routing decision of ``policy`` over ``n`` replicas: (request, now, replicas) -> index."""
    rng = random.Random(cfg.seed)
    bt_per_s = cfg.prefill_tps / cfg.block_tokens  # prefill blocks per second

    def queued_blocks(rep: Replica, now: float) -> float:
        return max(0.0, rep.free_at - now) * bt_per_s

    if policy == "round-robin":
        turn = itertools.count()
        return lambda req, now, reps: next(turn) % n
    if policy == "random":
        return lambda req, now, reps: rng.randrange(n)
    if policy == "session":
        sticky: dict[str, int] = {}
        turn = itertools.count()

        def session(req: Request, now: float, reps: list[Replica]) -> int:
            if req.session is None:           # a request without a session is a session of its own
                return next(turn) % n
            if req.session not in sticky:
                sticky[req.session] = next(turn) % n
            return sticky[req.session]
        return session
    if policy == "prefix":
        def prefix(req: Request, now: float, reps: list[Replica]) -> int:
            nblk = len(req.keys)
            costs = []
            for rep in reps:
                ov = Overlap.from_ranks(t.rank for t in rep.policy.leading_ranks(req.keys))
                held = ov.gpu + PREFIX_HOST_WEIGHT * (ov.host - ov.gpu) + PREFIX_DISK_WEIGHT * (ov.disk - ov.host)
                costs.append(nblk - held + queued_blocks(rep, now) + rep.active_blocks)
            best = min(costs)
            return rng.choice([i for i, c in enumerate(costs) if c - best <= 1e-9])
        return prefix
    if policy == "kvtier":
        scorer = Scorer(cfg.scorer_config())
        names = [str(i) for i in range(n)]

        def kvtier(req: Request, now: float, reps: list[Replica]) -> int:
            overlaps = {w: Overlap.from_ranks(t.rank for t in rep.policy.leading_ranks(req.keys)) for w, rep in zip(names, reps, strict=True)}
            loads = {w: Load(queued_blocks(rep, now), len(rep.active)) for w, rep in zip(names, reps, strict=True)}
            last = req.keys[-1].to_bytes(16, "little", signed=True) if req.keys else b""
            return int(scorer.rank(len(req.keys), names, overlaps, loads, last)[0].worker)
        return kvtier
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def replay(requests: Sequence[Request], cfg: ReplayConfig, policy: str, replicas: int,
           progress: Callable[[int], None] | None = None) -> Row:
    """Simulate ``requests`` on ``replicas`` workers routed by ``policy``; see the module docstring."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if policy == "session" and not any(r.session is not None for r in requests):
        return Row(policy, replicas, requests=len(requests), na="trace has no session_id")
    choose = make_router(policy, cfg, replicas)
    reps = [Replica(cfg) for _ in range(replicas)]
    bt = cfg.block_tokens
    load_s = {t: cfg.block_load_s(t) for t in (GPU, HOST, DISK)}
    ttft = np.empty(len(requests))
    hits = [0, 0, 0]
    total_blocks = 0
    saved_tokens = 0
    for i, req in enumerate(requests):
        now = req.arrival_s
        for rep in reps:
            rep.advance(now)
        rep = reps[choose(req, now, reps) if replicas > 1 else 0]
        ranks = rep.policy.access(req.keys)
        nblk = len(req.keys)
        total_blocks += nblk
        g, h, d = ranks.count(GPU), ranks.count(HOST), ranks.count(DISK)
        hits[0] += g
        hits[1] += h
        hits[2] += d
        saved = min(len(ranks) * bt, req.input_tokens)
        saved_tokens += saved
        computed = req.input_tokens - saved
        rep.computed_tokens += computed
        start = max(now, rep.free_at)
        rep.free_at = start + computed / cfg.prefill_tps + h * load_s[HOST] + d * load_s[DISK]
        ttft[i] = rep.free_at - now
        held = -(-(req.input_tokens + req.output_tokens) // bt)
        heapq.heappush(rep.active, (rep.free_at + req.output_tokens / cfg.decode_tps, held))
        rep.active_blocks += held
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(requests) % 256)
    work = [r.computed_tokens for r in reps]
    mean_work = sum(work) / len(work)
    counts = [r.policy.counts for r in reps]
    return Row(
        policy, replicas,
        hit_rate=sum(hits) / total_blocks if total_blocks else 0.0,
        hit_rate_by_tier={name: (hits[t] / total_blocks if total_blocks else 0.0) for t, name in enumerate(TIER_NAMES)},
        prefill_tokens_saved=saved_tokens,
        imbalance=max(work) / mean_work if mean_work else 1.0,
        ttft_mean_s=float(ttft.mean()) if len(ttft) else 0.0,
        ttft_p99_s=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
        requests=len(requests), blocks=total_blocks,
        evictions={name: sum(c.evictions[t] for c in counts) for t, name in enumerate(TIER_NAMES)},
        demotions=sum(c.demotions for c in counts), promotions=sum(c.promotions for c in counts))


# -- output ---------------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.label = ""
        self.started = self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last >= 0.2 or self.done >= self.total):
            self.last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            eta = (now - self.started) * (1 - frac) / frac if frac > 0 else 0.0
            sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%}  {self.label:<18} eta {eta:5.0f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 72 + "\r")
            sys.stderr.flush()


def _human(tokens: int) -> str:
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if tokens >= div and tokens % (div // 1000 or 1) == 0:
            return f"{tokens / div:g}{suffix}"
    return str(tokens)


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_table(rows: Sequence[Row]) -> str:
    head = ("policy", "replicas", "hit_rate", "gpu", "host", "disk", "tokens_saved", "imbalance",
            "ttft_mean_s", "ttft_p99_s")
    lines = [head]
    for r in rows:
        t = r.hit_rate_by_tier or {}
        lines.append((r.policy, str(r.replicas), _fmt(r.hit_rate, ".4f"), _fmt(t.get("gpu"), ".4f"),
                      _fmt(t.get("host"), ".4f"), _fmt(t.get("disk"), ".4f"),
                      _fmt(r.prefill_tokens_saved, ",d"), _fmt(r.imbalance, ".3f"), _fmt(r.ttft_mean_s, ".3f"),
                      _fmt(r.ttft_p99_s, ".3f")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot(rows: Sequence[Row], path: str, title: str = "") -> None:
    """Hit rate and imbalance against replicas, one line per policy (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks = sorted({r.replicas for r in rows})
    for pol in dict.fromkeys(r.policy for r in rows):
        pts = sorted((r.replicas, r.hit_rate, r.imbalance) for r in rows if r.policy == pol and r.na is None)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=pol)
        ax2.plot(xs, [p[2] for p in pts], marker="o", label=pol)
    for ax, ylabel in ((ax1, "hit rate (blocks, any tier)"), (ax2, "imbalance (max / mean prefill work)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("replicas")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("replica counts are integers >= 1, e.g. 1,2,4,8")
    return vals


def _policy_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in POLICIES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or text!r}; choose from {', '.join(POLICIES)}")
    return vals


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def build_parser(prog: str = "kvtier replay") -> argparse.ArgumentParser:
    d = ReplayConfig()
    ap = argparse.ArgumentParser(prog=prog, description="Replay a Mooncake-format trace through kvtier's router "
                                 "and tier policy (metadata only) and report hit rate by tier, imbalance and TTFT "
                                 "per (policy, replicas).")
    ap.add_argument("trace", help="JSONL trace: timestamp (ms), input_length, output_length, hash_ids[, session_id]")
    ap.add_argument("--block-tokens", type=int, default=d.block_tokens, help="tokens per hash id [%(default)s]")
    ap.add_argument("--replicas", type=_int_list, default=[1, 2, 4, 8], help="comma list [1,2,4,8]")
    ap.add_argument("--policy", type=_policy_list, default=list(POLICIES), help=f"comma list of {', '.join(POLICIES)} [all]")
    ap.add_argument("--gpu-tokens", type=_tokens, default=d.gpu_tokens, help="per replica, e.g. 100k [%(default)s]")
    ap.add_argument("--host-tokens", type=_tokens, default=d.host_tokens, help="per replica, e.g. 1M [%(default)s]")
    ap.add_argument("--disk-tokens", type=_tokens, default=d.disk_tokens, help="per replica, e.g. 10M [%(default)s]")
    ap.add_argument("--demote-min-seen", type=int, default=d.demote_min_seen,
                    help="host evictions go to disk only if used this often [%(default)s]")
    ap.add_argument("--prefill-tps", type=_positive, default=d.prefill_tps, help="prefill tokens/s per replica [%(default)s]")
    ap.add_argument("--decode-tps", type=_positive, default=d.decode_tps, help="output tokens/s per request [%(default)s]")
    ap.add_argument("--kv-bytes-per-token", type=_positive, default=d.kv_bytes_per_token,
                    help="KV bytes per token [%(default)s]")
    ap.add_argument("--host-load-gbps", type=float, default=d.host_load_gbps,
                    help="host -> GPU load bandwidth, 10^9 B/s [%(default)s]")
    ap.add_argument("--disk-load-gbps", type=float, default=d.disk_load_gbps,
                    help="disk -> GPU load bandwidth, 10^9 B/s [%(default)s]")
    ap.add_argument("--queued-weight", type=float, default=d.queued_weight,
                    help="kvtier policy: cost per queued prefill block [%(default)s]")
    ap.add_argument("--active-weight", type=float, default=d.active_weight,
                    help="kvtier policy: cost per active request [%(default)s]")
    ap.add_argument("--seed", type=int, default=d.seed, help="for random and prefix tie-breaks [%(default)s]")
    ap.add_argument("--json", action="store_true", help='print {"rows": [...]} as the last line')
    ap.add_argument("--plot", metavar="FILE.png", help="draw hit rate and imbalance against replicas per policy")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.block_tokens < 1:
        ap.error("--block-tokens must be >= 1")
    if args.demote_min_seen < 1:
        ap.error("--demote-min-seen must be >= 1")
    cfg = replace(ReplayConfig(), block_tokens=args.block_tokens, gpu_tokens=args.gpu_tokens,
                  host_tokens=args.host_tokens, disk_tokens=args.disk_tokens, demote_min_seen=args.demote_min_seen,
                  prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, kv_bytes_per_token=args.kv_bytes_per_token,
                  host_load_gbps=args.host_load_gbps, disk_load_gbps=args.disk_load_gbps,
                  queued_weight=args.queued_weight, active_weight=args.active_weight, seed=args.seed)
    try:
        requests = load_trace(args.trace)
    except OSError as e:
        print(f"kvtier replay: cannot read {args.trace}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvtier replay: {e}", file=sys.stderr)
        return 2
    runs = [(p, n) for p in args.policy for n in args.replicas]
    bar = Progress(len(requests) * len(runs), sys.stderr.isatty())
    rows = []
    for pol, n in runs:
        bar.label = f"{pol} x{n}"
        rows.append(replay(requests, cfg, pol, n, bar))
    bar.close()
    print(f"{args.trace}: {len(requests)} requests, {sum(len(r.keys) for r in requests)} blocks of "
          f"{cfg.block_tokens} tokens; per replica gpu {_human(cfg.gpu_tokens)}, host {_human(cfg.host_tokens)}, "
          f"disk {_human(cfg.disk_tokens)} tokens")
    print(format_table(rows))
    if args.plot:
        plot(rows, args.plot, title=f"{args.trace.rsplit('/', 1)[-1]}: gpu {_human(cfg.gpu_tokens)}, host "
             f"{_human(cfg.host_tokens)}, disk {_human(cfg.disk_tokens)} tokens per replica")
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({"config": asdict(cfg), "rows": [asdict(r) for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

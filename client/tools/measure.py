"""``kvtier measure``: prefix share and hit rate of a running fleet, per replica and in aggregate.

    kvtier measure --engines http://e1:8000,http://e2:8000 [--daemons SOCK,HOST:PORT,...]
                   [--trace TRACE.jsonl] [--once [--json]] [--interval S]

Engines (``--engines``): each replica's Prometheus endpoint (``/metrics`` is appended unless
the URL has a path), counters since the engine started:

* vLLM (``vllm:`` names, as vllm 0.32 exports them; summed over its ``engine`` labels):
  ``vllm:prompt_tokens_total`` (prompt tokens), ``vllm:prefix_cache_queries_total`` /
  ``vllm:prefix_cache_hits_total`` (tokens looked up in / found in its own GPU prefix cache),
  ``vllm:external_prefix_cache_queries_total`` / ``..._hits_total`` (tokens asked of / served
  by a KV connector such as kvtier's).
* SGLang (``sglang:``, with ``--enable-metrics``): ``sglang:prompt_tokens_total`` and
  ``sglang:cached_tokens_total`` by ``cache_source`` (``device``: its own cache; ``host``,
  ``storage_*``: HiCache, counted as external); an SGLang that exports only the
  ``sglang:cache_hit_rate`` gauge gives its hit rate and no token counts.

Per engine: ``prefix_share`` = prompt tokens served from any cache (its own or a connector's) /
prompt tokens: the share of the traffic that was not recomputed (the *reachable* share of the
true prefix share: a replica only finds what it computed itself or its connector holds);
``engine_hit_rate`` = its own cache's hits / queries; ``external_hit_rate`` = the connector's
hits / queries. The aggregate sums the counters of every reachable engine; ``replicas`` is
their count.

Daemons (``--daemons``, as ``kvtier report``'s: sockets, gRPC HOST:PORT, http://HOST:PORT
metrics): each kvtierd's lookup hit rate by tier (gpu, host, disk, remote) and in total.

``--trace FILE`` adds what ``kvtier replay`` predicts for that traffic: its ideal prefix hit
rate (one unbounded cache), and the hit rate of every routing policy at this replica count,
2x and 4x (capacities per replica: ``--gpu-tokens``, ``--host-tokens``, ``--disk-tokens``;
``--block-tokens``: the trace's, by default inferred from its records).

Without ``--once`` it refreshes every ``--interval`` seconds, as ``kvtier report`` does, and
adds the last interval's figures (``recent``); ``--once --json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.client.engine.transport import socket_path
from kvtier.client.tools import report

PREDICT_FACTORS = (1, 2, 4)


@dataclass
class EngineReport:
    """One engine's prefix-cache counters (tokens, cumulative since it started)."""

    url: str
    reachable: bool = False
    error: str = ""
    kind: str = ""                 # vllm | sglang | "" (no known metrics)
    model: str = ""
    prompt_tokens: int = 0
    cache_queries: int = 0         # tokens looked up in the engine's own cache
    cache_hits: int = 0            # ... and found there
    external_queries: int = 0      # tokens asked of a KV connector (vLLM) / HiCache beyond the device (SGLang)
    external_hits: int = 0
    hit_rate_gauge: float | None = None   # SGLang's cache_hit_rate when it has no token counters
    cached_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return self.cache_hits + self.external_hits

    def engine_hit_rate(self) -> float | None:
        if self.cache_queries:
            return self.cache_hits / self.cache_queries
        return self.hit_rate_gauge

    def external_hit_rate(self) -> float | None:
        return self.external_hits / self.external_queries if self.external_queries else None

    def prefix_share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(cached_tokens=self.cached_tokens, prefix_share=self.prefix_share(),
                 engine_hit_rate=self.engine_hit_rate(), external_hit_rate=self.external_hit_rate())
        return d


def _vllm_sample(rep: EngineReport, name: str, labels: dict[str, str], value: float) -> None:
    base = name.removeprefix("vllm:").removesuffix("_total")
    into = {"prompt_tokens": "prompt_tokens", "prefix_cache_queries": "cache_queries",
            "prefix_cache_hits": "cache_hits", "external_prefix_cache_queries": "external_queries",
            "external_prefix_cache_hits": "external_hits"}.get(base)
    if into is not None:
        setattr(rep, into, getattr(rep, into) + int(value))
    elif base == "prompt_tokens_cached_by_source" and "source" in labels:
        rep.cached_by_source[labels["source"]] = rep.cached_by_source.get(labels["source"], 0) + int(value)


def _sglang_sample(rep: EngineReport, name: str, labels: dict[str, str], value: float) -> None:
    base = name.removeprefix("sglang:").removesuffix("_total")
    if base == "prompt_tokens":
        rep.prompt_tokens += int(value)
    elif base == "cached_tokens":
        src = labels.get("cache_source", "device")
        rep.cached_by_source[src] = rep.cached_by_source.get(src, 0) + int(value)
    elif base == "cache_hit_rate":
        rep.hit_rate_gauge = float(value)


def from_engine_metrics(url: str, text: str) -> EngineReport:
    """An :class:`EngineReport` from an engine's /metrics text (vLLM or SGLang names)."""
    from prometheus_client.parser import text_string_to_metric_families

    rep = EngineReport(url, True)
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            name = smp.name
            if name.endswith("_created"):
                continue
            if name.startswith("vllm:"):
                rep.kind = "vllm"
                rep.model = rep.model or smp.labels.get("model_name", "")
                _vllm_sample(rep, name, smp.labels, smp.value)
            elif name.startswith("sglang:"):
                rep.kind = "sglang"
                rep.model = rep.model or smp.labels.get("model_name", "")
                _sglang_sample(rep, name, smp.labels, smp.value)
    if rep.kind == "sglang" and rep.cached_by_source:
        # SGLang counts every prompt token once: its own cache is asked for all of them, what it
        # misses is asked of HiCache (host, storage)
        device = rep.cached_by_source.get("device", 0)
        rep.cache_queries, rep.cache_hits = rep.prompt_tokens, device
        rep.external_hits = sum(v for k, v in rep.cached_by_source.items() if k != "device")
        rep.external_queries = rep.prompt_tokens - device if rep.external_hits else 0
    if not rep.kind:
        rep.error = "no vllm: or sglang: metrics at this endpoint"
    return rep


def scrape_engine(url: str, timeout: float) -> EngineReport:
    full = url if url.count("/") > 2 else url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            return from_engine_metrics(url, resp.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as e:
        return EngineReport(url, False, error=f"{full}: {getattr(e, 'reason', e)}")


def engine_total(engines: Sequence[EngineReport]) -> EngineReport:
    total = EngineReport("fleet", reachable=any(e.reachable for e in engines))
    kinds = {e.kind for e in engines if e.reachable and e.kind}
    total.kind = ",".join(sorted(kinds))
    gauges = []
    for e in engines:
        if not e.reachable:
            continue
        for f in ("prompt_tokens", "cache_queries", "cache_hits", "external_queries", "external_hits"):
            setattr(total, f, getattr(total, f) + getattr(e, f))
        for k, v in e.cached_by_source.items():
            total.cached_by_source[k] = total.cached_by_source.get(k, 0) + v
        if e.hit_rate_gauge is not None and not e.cache_queries:
            gauges.append(e.hit_rate_gauge)
    if gauges and not total.cache_queries:
        total.hit_rate_gauge = sum(gauges) / len(gauges)
    return total


# -- what the replay predicts for a trace ------------------------------------------------------

def infer_block_tokens(requests: Sequence[Any]) -> int:
    """The block size of a trace: the median of input_length / len(hash_ids) over its requests
    whose tokens fill their blocks, rounded to the nearest power of two."""
    ratios = [r.input_tokens / len(r.keys) for r in requests if r.keys]
    if not ratios:
        return 512
    med = statistics.median(ratios)
    return min((2**i for i in range(0, 16)), key=lambda b: abs(b - med))


def predict(path: str, replicas: int, cfg: Any, policies: Sequence[str] | None = None) -> dict:
    """The ideal prefix hit rate of the trace at ``path`` and the replay's hit rate by policy at
    ``replicas`` x 1, 2, 4."""
    from kvtier.client.tools import replay
    from kvtier.client.tools.trace import ideal_hit_rate

    reqs = replay.load_trace(path)
    if cfg.block_tokens <= 0:
        cfg = replace(cfg, block_tokens=infer_block_tokens(reqs))
    rate, blocks, distinct = ideal_hit_rate(r.keys for r in reqs)
    rows = []
    for pol in policies or replay.POLICIES:
        for f in PREDICT_FACTORS:
            row = replay.replay(reqs, cfg, pol, replicas * f)
            rows.append({"policy": pol, "replicas": replicas * f, "hit_rate": row.hit_rate,
                         "hit_rate_by_tier": row.hit_rate_by_tier, "imbalance": row.imbalance,
                         "ttft_p99_s": row.ttft_p99_s, "na": row.na})
    return {"trace": path, "requests": len(reqs), "blocks": blocks, "distinct_blocks": distinct,
            "block_tokens": cfg.block_tokens, "ideal_prefix_hit_rate": rate, "predicted": rows,
            "capacity_tokens_per_replica": {"gpu": cfg.gpu_tokens, "host": cfg.host_tokens, "disk": cfg.disk_tokens}}


# -- one measurement -----------------------------------------------------------------------------

@dataclass
class Measurement:
    engines: list[EngineReport]
    daemons: list[report.NodeReport]
    prediction: dict | None = None

    @property
    def replicas(self) -> int:
        return sum(e.reachable for e in self.engines)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"replicas": self.replicas, "engines": [e.to_json() for e in self.engines],
                               "engine_total": engine_total(self.engines).to_json(),
                               "daemons": [n.to_json() for n in self.daemons],
                               "daemon_total": report.fleet_total(self.daemons).to_json() if self.daemons else None}
        if self.prediction is not None:
            out["trace"] = self.prediction
        return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    full = [r for r in [head, *rows] if len(r) == len(head)]   # short rows (unreachable) do not set widths
    widths = [max(len(r[i]) for r in (full if i else [head, *rows])) for i in range(len(head))]
    out = []
    for k, r in enumerate([head, *rows]):
        if len(r) != len(head):
            out.append("  ".join([r[0].ljust(widths[0]), *r[1:]]))
        else:
            out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def format_engines(engines: Sequence[EngineReport], recent: dict[str, float | None] | None = None) -> list[str]:
    head = ["engine", "kind", "prompt_tokens", "prefix_share", "engine_hit_rate", "external_hit_rate"]
    if recent is not None:
        head.append("prefix_share_recent")
    rows = []
    for e in [*engines, engine_total(engines)]:
        if not e.reachable:
            rows.append([e.url, f"unreachable: {e.error}"[:70] if e.error else "nothing reachable"])
            continue
        row = [e.url, e.kind or "?", f"{e.prompt_tokens:,}", _pct(e.prefix_share()), _pct(e.engine_hit_rate()),
               _pct(e.external_hit_rate())]
        if recent is not None:
            row.append(_pct(recent.get(e.url)))
        rows.append(row)
    return _table(head, rows)


def format_measurement(m: Measurement, recent: dict[str, float | None] | None = None) -> str:
    lines = [f"replicas: {m.replicas} engine(s) reachable of {len(m.engines)}"]
    if m.engines:
        lines += ["", "engines (prefix share: prompt tokens served from any cache / prompt tokens)",
                  *format_engines(m.engines, recent)]
    if m.daemons:
        lines += ["", "kvtier daemons (lookups: hit rate by tier)", report.format_table(m.daemons)]
    p = m.prediction
    if p is not None:
        lines += ["", f"trace {p['trace']}: {p['requests']} requests, {p['blocks']} blocks of {p['block_tokens']} "
                      f"tokens; ideal prefix hit rate {p['ideal_prefix_hit_rate']:.4f} (one unbounded cache)",
                  "replay's prediction (hit rate, share of blocks) by policy and replicas:"]
        counts = sorted({r["replicas"] for r in p["predicted"]})
        rows = []
        for pol in dict.fromkeys(r["policy"] for r in p["predicted"]):
            by = {r["replicas"]: r for r in p["predicted"] if r["policy"] == pol}
            rows.append([pol, *("n/a" if by[n]["hit_rate"] is None else f"{by[n]['hit_rate']:.4f}" for n in counts)])
        lines += _table(["policy", *(f"x{n}" for n in counts)], rows)
    return "\n".join(lines)


def _recent(prev: dict[str, EngineReport], engines: Sequence[EngineReport]) -> dict[str, float | None]:
    """Prefix share over the last interval, per engine and for the fleet (None: no prompt tokens,
    first sight, or counters that went back: a restart)."""
    out: dict[str, float | None] = {}
    cached_all = prompt_all = 0
    for e in engines:
        p = prev.get(e.url)
        if not e.reachable or p is None or not p.reachable:
            out[e.url] = None
            continue
        prompt, cached = e.prompt_tokens - p.prompt_tokens, e.cached_tokens - p.cached_tokens
        if prompt <= 0 or cached < 0:
            out[e.url] = None
            continue
        out[e.url] = cached / prompt
        cached_all += cached
        prompt_all += prompt
    out["fleet"] = cached_all / prompt_all if prompt_all else None
    return out


def build_parser(prog: str = "kvtier measure") -> argparse.ArgumentParser:
    from kvtier.client.tools.replay import ReplayConfig, _tokens

    d = ReplayConfig()
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="", help="comma list of engines' metrics URLs (http://HOST:PORT[/metrics])")
    ap.add_argument("--daemons", default=None,
                    help="comma list of kvtierds as kvtier report takes them (sockets, HOST:PORT, http:// metrics); "
                         "default: none with --engines, else this node's kvtierd")
    ap.add_argument("--trace", metavar="FILE", help="add the replay's prediction for this trace: each policy at "
                                                   "this replica count, 2x and 4x")
    ap.add_argument("--block-tokens", type=int, default=0, help="the trace's tokens per hash id (0: inferred)")
    ap.add_argument("--gpu-tokens", type=_tokens, default=d.gpu_tokens, help="replay: per replica [%(default)s]")
    ap.add_argument("--host-tokens", type=_tokens, default=d.host_tokens, help="replay: per replica [%(default)s]")
    ap.add_argument("--disk-tokens", type=_tokens, default=d.disk_tokens, help="replay: per replica [%(default)s]")
    ap.add_argument("--replicas", type=int, default=0,
                    help="replica count for the prediction (0: the reachable engines, else the daemons, else 1)")
    ap.add_argument("--once", action="store_true", help="print once and exit")
    ap.add_argument("--json", action="store_true", help="with --once: one JSON object")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes [%(default)s]")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each endpoint [%(default)s]")
    return ap


def _live(poll: Callable[[], Measurement], interval: float) -> int:
    """Refresh every ``interval`` seconds until interrupted, as ``kvtier report`` does."""
    prev: dict[str, EngineReport] = {}
    with report.until_interrupted() as stop:
        while not stop.is_set():
            _show(poll, interval, prev)
            stop.wait(interval)
    return 0


def _show(poll: Callable[[], Measurement], interval: float, prev: dict[str, EngineReport]) -> None:
    """One refresh (``prev``: the last poll's engines, updated here)."""
    m = poll()
    recent = _recent(prev, m.engines)
    prev.clear()
    prev.update({e.url: e for e in m.engines})
    if sys.stdout.isatty():
        sys.stdout.write("\x1b[H\x1b[2J")
    print(f"kvtier measure  {time.strftime('%H:%M:%S')}  every {interval:g}s (recent: over the last "
          f"interval; Ctrl-C to quit)\n")
    print(format_measurement(m, recent))
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.client.tools.replay import ReplayConfig

    ap = build_parser()
    args = ap.parse_args(argv)
    engines = [u.strip() for u in args.engines.split(",") if u.strip()]
    bad = [u for u in engines if not u.startswith(("http://", "https://"))]
    if bad:
        ap.error(f"--engines takes http(s):// metrics URLs; not: {', '.join(bad)}")
    daemon_arg = args.daemons if args.daemons is not None else ("" if engines else socket_path())
    daemons = [t.strip() for t in daemon_arg.split(",") if t.strip()]
    if not engines and not daemons:
        ap.error("give --engines and/or --daemons")
    if args.json and not args.once:
        ap.error("--json needs --once")
    if args.interval <= 0 or args.block_tokens < 0 or args.replicas < 0:
        ap.error("--interval must be > 0, --block-tokens and --replicas >= 0")
    fleet = report.Fleet(daemons, "lookup", args.timeout) if daemons else None
    cfg = replace(ReplayConfig(), block_tokens=args.block_tokens, gpu_tokens=args.gpu_tokens,
                  host_tokens=args.host_tokens, disk_tokens=args.disk_tokens)
    prediction: dict | None = None

    def poll() -> Measurement:
        nonlocal prediction
        m = Measurement([scrape_engine(u, args.timeout) for u in engines], fleet.poll() if fleet else [])
        if args.trace and prediction is None:
            n = args.replicas or m.replicas or sum(d.reachable for d in m.daemons) or 1
            prediction = predict(args.trace, n, cfg)
        m.prediction = prediction
        return m

    try:
        if args.once:
            m = poll()
            print(json.dumps(m.to_json()) if args.json else format_measurement(m))
            return 0 if all(e.reachable for e in m.engines) and all(d.reachable for d in m.daemons) else 1
        return _live(poll, args.interval)
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as e:
        print(f"kvtier measure: {e}", file=sys.stderr)
        return 2
    finally:
        if fleet is not None:
            fleet.close()


if __name__ == "__main__":
    sys.exit(main())

"""``kvtier demo``: a real kvtierd and a multi-turn chat workload, with hit rate by tier.

Starts kvtierd with embedded defaults in a temporary directory (no external service), then
plays chat sessions that all resend one system prompt plus their growing history, the way an
agentic or multi-turn workload does. For each request the sidecar asks how much of the prefix
the daemon holds, fetches those blocks (checking every byte against what was stored),
"computes" the rest and stores it. The host tier is kept small so that it overflows: blocks
then come back from disk when the daemon has a disk tier, or are recomputed.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """The block's bytes, derived from its key, so every fetched block can be checked."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def leading_run(tiers: Sequence[str | None]) -> int:
    for i, t in enumerate(tiers):
        if t is None:
            return i
    return len(tiers)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16, help="concurrent chat sessions (default 16)")
    ap.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length (default 1024)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--host-capacity", default="48MiB", help="the demo daemon's host tier (default 48MiB)")
    ap.add_argument("--disk-capacity", default="512MiB", help="the demo daemon's disk tier (default 512MiB)")
    ap.add_argument("--no-disk", action="store_true", help="run without a disk tier")
    ap.add_argument("--seed", type=int, default=0)
    return ap


@dataclass
class Tally:
    """Blocks of the workload: served from each tier, recomputed, checked byte-exact."""

    by_tier: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    computed: int = 0
    verified: int = 0
    total: int = 0


def play_turn(sc: Sidecar, lid: int, keys: list[bytes], nbytes: int, tally: Tally) -> None:
    """One request: fetch the leading blocks the daemon holds (checking every byte), compute
    and store the rest."""
    tiers = sc.lookup(lid, keys)
    n_hit = leading_run(tiers)
    got = sc.get(lid, keys[:n_hit]) if n_hit else []
    n_ok = 0
    for k, g in zip(keys[:n_hit], got, strict=True):
        if g is None:  # evicted between lookup and get: recompute from here
            break
        if not np.array_equal(np.frombuffer(g, np.uint8), payload(k, nbytes)):
            raise SystemExit(f"block {k.hex()} came back with different bytes")
        n_ok += 1
    for t in tiers[:n_ok]:
        tally.by_tier[t] += 1
    tally.verified += n_ok
    missing = keys[n_ok:]
    if missing:
        sc.put(lid, missing, [payload(k, nbytes) for k in missing])
    tally.computed += len(missing)
    tally.total += len(keys)


def print_summary(tally: Tally, requests: int, sessions: int, bt: int, nbytes: int, elapsed: float,
                  counters: dict[str, int]) -> None:
    print(f"\nkvtier demo: {requests} requests from {sessions} sessions, {tally.total} blocks "
          f"of {bt} tokens ({nbytes // 1024} KiB each), {elapsed:.1f} s\n")
    print(f"{'served from':<14}{'blocks':>10}{'tokens':>12}{'share':>9}")
    rows = [("host", tally.by_tier["host"]), ("disk", tally.by_tier["disk"]), ("recomputed", tally.computed)]
    for name, n in rows:
        print(f"{name:<14}{n:>10}{n * bt:>12}{n / max(tally.total, 1):>9.1%}")
    hits = tally.by_tier["host"] + tally.by_tier["disk"]
    print(f"{'prefix reuse':<14}{hits:>10}{hits * bt:>12}{hits / max(tally.total, 1):>9.1%}")
    print(f"\n{tally.verified} fetched blocks checked byte-exact; daemon evictions: "
          f"{counters.get('evictions_host', 0)} from host, {counters.get('demotions', 0)} demoted to disk")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rng = random.Random(ns.seed)
    # a small 4-layer model shard: vLLM layout, fp16, 2 KV heads of 64 -> 64 KiB per 16-token block
    layout = Layout.vllm(num_layers=4, num_blocks=1024, block_tokens=ns.block_tokens, kv_heads=4, head_dim=64,
                         dtype="float16")
    nbytes = layout.block_bytes
    ns_model = Namespace("demo/llama-mini", tenant_salt="demo")
    system = [rng.randrange(32000) for _ in range(ns.system_tokens)]
    histories = {s: list(system) for s in range(ns.sessions)}
    schedule = [s for s in range(ns.sessions) for _ in range(ns.turns)]
    rng.shuffle(schedule)  # keep each session's turns in order but interleave sessions
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        # (a demo: its disk tier may sit on a tmpfs /tmp, which a real kvtierd refuses by default)
        args = [] if ns.no_disk else ["--disk-dir", f"{tmp}/disk", "--disk-capacity", ns.disk_capacity,
                                      "--disk-allow-tmpfs", "true"]
        print(f"starting kvtierd (host {ns.host_capacity}"
              f"{'' if ns.no_disk else f', disk {ns.disk_capacity}'}) in {tmp}", file=sys.stderr)
        daemon = DaemonProcess(tmp, *args, host_capacity=ns.host_capacity, name="demo").start()
        t0 = time.monotonic()
        try:
            with Sidecar(daemon.socket, client_name="kvtier-demo") as sc:
                lid = sc.register_layout(layout)
                for i, s in enumerate(schedule):
                    hist = histories[s]
                    hist.extend(rng.randrange(32000) for _ in range(rng.randint(60, 240)))  # user turn
                    play_turn(sc, lid, block_keys(hist, ns.block_tokens, ns_model), nbytes, tally)
                    hist.extend(rng.randrange(32000) for _ in range(rng.randint(100, 400)))  # reply
                    if (i + 1) % 16 == 0 or i + 1 == len(schedule):
                        print(f"\r  request {i + 1}/{len(schedule)}", end="", file=sys.stderr, flush=True)
                print(file=sys.stderr)
                stats = sc.stats()
        finally:
            daemon.cleanup()
    print_summary(tally, len(schedule), ns.sessions, ns.block_tokens, nbytes, time.monotonic() - t0, stats["counters"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

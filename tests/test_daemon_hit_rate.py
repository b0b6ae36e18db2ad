"""The replay predicts what a real kvtierd keeps: the same request sequence, the same hit rate.

`kvtier replay` and kvtierd share one :class:`~kvtier.tiers.policy.TierPolicy` class (its
default order is the daemon's), so a capacity plan or an eviction order measured with the
replay is what a deployment gets. tests/test_placement_equivalence.py checks the two hold the
same blocks after every random put, get and evict; this test checks the figure users read off
the replay, the hit rate, on the traffic the eviction order is designed for: a looping
multi-session workload (every turn re-reads its session's whole growing prefix, sessions
interleaved, a system prompt every session shares) whose live sessions are several times larger
than the host tier.

The daemon is driven as kvtier's vLLM spec drives it: per request, ``lookup`` finds the
leading run of held blocks, ``get`` loads it (the bytes are checked against what was stored),
the engine computes the rest, and of those the blocks kvtier already holds (after a gap in
the prefix) are marked used (``prefetch``) while the others are stored (``put``). The replay
runs the same requests at one replica with no gpu and no disk tier and the same host capacity
in blocks.
"""

from __future__ import annotations

import random

import pytest

from kvtier.client import Sidecar
from kvtier.client.tools.replay import ReplayConfig, Request, block_key, replay
from kvtier.tiers.layout import Layout

BLOCK = 16 * 1024          # bytes of one block (a 4 KiB multiple: one slot a block)
BLOCK_TOKENS = 32          # the replay's tokens per block (any: only block counts matter here)
HOST_BLOCKS = 64
SYSTEM_BLOCKS = 2          # the shared system prompt
SESSIONS = 12
TURNS = 8
PER_TURN = 3               # new blocks a turn adds (its user message and the last answer)


def workload(seed: int) -> list[Request]:
    """Sessions of ``TURNS`` turns, each turn's request its session's prefix so far plus
    ``PER_TURN`` new blocks; at each step one of the live sessions (a seeded choice) sends its
    next turn, so every session returns after most of the others have run."""
    rng = random.Random(seed)
    turns = {s: 0 for s in range(SESSIONS)}
    out: list[Request] = []
    while turns:
        s = rng.choice(sorted(turns))
        turns[s] += 1
        n = turns[s] * PER_TURN
        ids = tuple(range(SYSTEM_BLOCKS)) + tuple(1000 * (s + 1) + j for j in range(n))
        out.append(Request(float(len(out)), len(ids) * BLOCK_TOKENS, 1, ids, f"s{s}"))
        if turns[s] == TURNS:
            del turns[s]
    return out


def payload(key: bytes) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def daemon_hit_rate(sc: Sidecar, lid: int, requests: list[Request]) -> float:
    hits = total = 0
    for req in requests:
        keys = [block_key(h) for h in req.keys]
        lead = 0
        for tier in sc.lookup(lid, keys):
            if tier is None:
                break
            lead += 1
        if lead:
            got = sc.get(lid, keys[:lead])
            assert all(g is not None for g in got), "a block Lookup reported held was not served"
            assert all(bytes(g) == payload(k) for k, g in zip(keys[:lead], got, strict=True)), \
                "a block was served with other bytes than were stored"
        rest = keys[lead:]
        held = sc.lookup(lid, rest)
        used = [k for k, t in zip(rest, held, strict=True) if t is not None]
        if used:
            sc.prefetch(lid, used)
        new = [k for k, t in zip(rest, held, strict=True) if t is None]
        sc.put(lid, new, [payload(k) for k in new])
        hits += lead
        total += len(keys)
    return hits / total


@pytest.mark.parametrize("seed", [1, 2])
def test_daemon_hit_rate_is_the_replays(start_daemon, seed: int) -> None:
    requests = workload(seed)
    distinct = len({h for r in requests for h in r.keys})
    assert distinct > 4 * HOST_BLOCKS, "the sessions must be several times the host tier"
    cfg = ReplayConfig(block_tokens=BLOCK_TOKENS, gpu_tokens=0, host_tokens=HOST_BLOCKS * BLOCK_TOKENS,
                       disk_tokens=0)
    predicted = replay(requests, cfg, "round-robin", 1).hit_rate
    assert predicted is not None
    proc = start_daemon(host_capacity=str(HOST_BLOCKS * BLOCK))
    sc = Sidecar(proc.socket)
    try:
        lid = sc.register_layout(Layout.flat(BLOCK))
        measured = daemon_hit_rate(sc, lid, requests)
        stats = sc.stats()
    finally:
        sc.close()
    assert stats["tiers"]["host"]["blocks"] == HOST_BLOCKS, "the workload must fill the host tier"
    assert measured > 0.05, f"the workload must hit at all to compare: {measured:.4f}"
    assert abs(measured - predicted) <= 0.02, (
        f"kvtierd's hit rate {measured:.4f}, the replay's {predicted:.4f} for the same requests")

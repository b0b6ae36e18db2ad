"""The router's new-session rule: a new session whose only overlap is a short
prefix shared with other sessions (a system prompt) is not piled onto the worker that holds it.

Replayed through the real ``Router`` (``kvtier replay``'s kvtier policy, fed its simulated
nodes' location events). 4-token blocks at 4000 tokens/s: one block is 1 ms of prefill.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.client.routing.router import RouterConfig
from kvtier.client.tools.replay import Cluster, ReplayConfig, Request, replay

SESSIONS = 8
SHARED = [1, 2]  # the system prompt every session starts with


def _cfg(**kw) -> ReplayConfig:
    base = ReplayConfig(block_tokens=4, gpu_tokens=10**9, host_tokens=0, disk_tokens=0, prefill_tps=4000.0,
                        decode_tps=1.0, seed=0)
    return replace(base, **kw)


def _trace() -> list[Request]:
    """8 sessions start one a second (light load: each first request is 0.2 s of prefill):
    the shared 2-block prompt, then 200 private blocks. At t = 20 s every session sends its
    second turn at once: its whole first request (held where it ran) plus 100 new blocks."""
    reqs = []
    first = {}
    for i in range(SESSIONS):
        keys = SHARED + [10_000 * (i + 1) + j for j in range(200)]
        first[i] = keys
        reqs.append(Request(float(i), 4 * len(keys), 0, tuple(keys), f"s{i}"))
    for i in range(SESSIONS):
        keys = first[i] + [10_000 * (i + 1) + 5_000 + j for j in range(100)]
        reqs.append(Request(20.0 + 0.001 * i, 4 * len(keys), 0, tuple(keys), f"s{i}"))
    return reqs


def _placements(cfg: ReplayConfig) -> list[int]:
    cluster = Cluster(cfg, "kvtier", 4)
    return [cluster.step(r)[0] for r in _trace()[:SESSIONS]]


def test_new_sessions_spread_instead_of_piling_onto_the_prefix_holder() -> None:
    """With the rule off (spread 0, the default) every session lands on the
    worker holding the shared prompt, and the simultaneous second turns queue behind each
    other there; with it (``--new-session-spread 0.25``) the sessions spread over the 4 workers and the second turns run side by
    side, at no cost in hit rate beyond the shared prompt recomputed once per worker."""
    assert RouterConfig().new_session_spread == 0  # off by default
    old, new = _cfg(), _cfg(new_session_spread=0.25)
    assert len(set(_placements(old))) == 1  # piled: the holder wins every new session
    assert len(set(_placements(new))) == 4
    trace = _trace()
    r_old, r_new = replay(trace, old, "kvtier", 4), replay(trace, new, "kvtier", 4)
    # 8 second turns of 100 blocks (0.1 s each) queued on one worker: the last waits 0.8 s;
    # spread 2 per worker: 0.2 s
    assert r_old.ttft_p99_s > 0.7
    assert r_new.ttft_p99_s < 0.25
    assert r_new.ttft_mean_s < 0.6 * r_old.ttft_mean_s  # first requests 0.2 s in both
    assert r_new.hit_rate >= r_old.hit_rate - 6 / r_new.blocks  # the 2-block prompt, 3 more times
    assert r_new.hit_rate >= 0.95 * r_old.hit_rate


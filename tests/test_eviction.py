"""Eviction orders of the placement policy: ``kvtier`` evicts a chain's tail before its head,
``lru`` its head first; the replay's ``opt`` is the clairvoyant bound and never below either."""

from __future__ import annotations

import json

import pytest

from kvtier.client.tools.replay import ReplayConfig, Request, main, next_uses, replay
from kvtier.tiers.policy import DEFAULT_EVICTION, HOST, AdaptiveLirs, TierPolicy


def test_kvtier_evicts_a_chains_tail_first() -> None:
    """A chain a, b, c, d and then a new chain x, y past capacity 5: kvtier keeps the head a, b
    (the next request for the chain still hits them), lru keeps c, d (useless without a)."""
    kv, lru = TierPolicy(0, 5, 0, eviction="kvtier"), TierPolicy(0, 5, 0, eviction="lru")
    for p in (kv, lru):
        p.access(["a", "b", "c", "d"])
        p.access(["x", "y"])
    assert set(kv.tiers[HOST]) == {"a", "b", "c", "x", "y"}
    assert set(lru.tiers[HOST]) == {"b", "c", "d", "x", "y"}
    assert len(kv.leading_ranks(["a", "b", "c", "d"])) == 3
    assert len(lru.leading_ranks(["a", "b", "c", "d"])) == 0


def test_lru_is_the_default_and_a_kvtier_put_is_tail_first() -> None:
    """The default is the order kvtierd runs (its store builds TierPolicy without eviction)."""
    assert DEFAULT_EVICTION == "lru"
    assert TierPolicy(0, 3, 0).eviction == "lru" and ReplayConfig().eviction == "lru"
    p = TierPolicy(0, 3, 0, eviction="kvtier")
    p.put(["a", "b", "c"])
    assert list(p.victims(HOST)) == ["c", "b", "a"]
    p = TierPolicy(0, 3, 0)
    p.put(["a", "b", "c"])
    assert list(p.victims(HOST)) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        TierPolicy(0, 3, 0, eviction="nope")


def _loop(sessions: int, turns: int, length: int) -> list[Request]:
    """Sessions taking turns round-robin, each turn re-reading its whole chain plus one block."""
    out, t = [], 0.0
    for turn in range(turns):
        for s in range(sessions):
            keys = tuple(s * 10_000 + i for i in range(length + turn))
            out.append(Request(t, len(keys) * 16, 1, keys))
            t += 0.01
    return out


@pytest.mark.parametrize("host_blocks", [40, 100, 200])
def test_orders_on_a_loop_larger_than_host(host_blocks: int) -> None:
    """Sessions larger together than host: lru evicts each chain's head just before it returns;
    kvtier keeps heads; opt is the most any order reaches."""
    reqs = _loop(sessions=8, turns=6, length=12)
    cfg = ReplayConfig(block_tokens=16, gpu_tokens=0, host_tokens=host_blocks * 16, disk_tokens=0)
    rate = {e: replay(reqs, ReplayConfig(**{**cfg.__dict__, "eviction": e}), "round-robin", 1).hit_rate
            for e in ("lru", "kvtier", "opt")}
    assert rate["opt"] >= rate["kvtier"] - 1e-9 and rate["opt"] >= rate["lru"] - 1e-9
    assert rate["kvtier"] >= rate["lru"]
    if host_blocks == 100:  # past one turn of every session: lru keeps chains without heads
        assert rate["kvtier"] > 2 * rate["lru"]


def test_next_uses() -> None:
    reqs = [Request(0, 1, 1, (1, 2)), Request(1, 1, 1, (2,)), Request(2, 1, 1, (1,))]
    nu = [list(a) for a in next_uses(reqs)]
    assert nu[0] == [2, 1] and nu[1][0] > 2 and nu[2][0] > 2


def test_cli_eviction(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 64, "output_length": 1,
                                        "hash_ids": [i % 3, 10 + i % 3]}) + "\n" for i in range(30)))
    for e in ("lru", "kvtier", "opt"):
        assert main([str(path), "--block-tokens", "32", "--replicas", "1", "--policy", "round-robin",
                     "--host-tokens", "64", "--gpu-tokens", "0", "--disk-tokens", "0", "--eviction", e, "--json"]) == 0
        row = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert row["config"]["eviction"] == e


def test_lirs_keeps_low_reuse_distance_blocks_and_evicts_hir_first() -> None:
    """Host of 4 blocks under lirs: 3 LIR and 1 HIR. A new block is HIR and goes first (lru
    evicts the oldest block instead); a HIR block used again while still in the recency stack
    (here: the ghost of an evicted one) becomes LIR, and the oldest LIR block becomes HIR: the
    next victim."""
    lirs, lru = TierPolicy(0, 4, 0, eviction="lirs"), TierPolicy(0, 4, 0, eviction="lru")
    for p in (lirs, lru):
        for k in "abcde":
            p.access([k])
    assert set(lirs.tiers[HOST]) == {"a", "b", "c", "e"}  # d, HIR, went first
    assert set(lru.tiers[HOST]) == {"b", "c", "d", "e"}
    for p in (lirs, lru):
        p.access(["d"])
    assert set(lirs.tiers[HOST]) == {"a", "b", "c", "d"}  # d's ghost hit: LIR; a demoted; e (HIR) evicted
    assert list(lirs.victims(HOST)) == ["a", "b", "c", "d"]
    assert list(lru.victims(HOST)) == ["b", "c", "e", "d"]


def test_lirs_needs_the_policys_host_capacity() -> None:
    """lirs sizes its LIR set from host's block capacity: a caller-bounded host (kvtierd's) is refused."""
    with pytest.raises(ValueError):
        TierPolicy(0, None, 0, eviction="lirs")
    assert TierPolicy(0, 0, 0, eviction="lirs").access(["a"]) == []


@pytest.mark.parametrize("host_blocks", [40, 100])
def test_lirs_on_a_loop_larger_than_host(host_blocks: int) -> None:
    """Sessions taking turns, together larger than host: lru evicts each just before it returns
    and hits almost nothing; lirs keeps a stable subset of the sessions whole."""
    reqs = _loop(sessions=8, turns=6, length=12)
    cfg = ReplayConfig(block_tokens=16, gpu_tokens=0, host_tokens=host_blocks * 16, disk_tokens=0)
    rate = {e: replay(reqs, ReplayConfig(**{**cfg.__dict__, "eviction": e}), "round-robin", 1).hit_rate
            for e in ("lru", "kvtier", "lirs")}
    assert rate["lirs"] > rate["kvtier"] + 0.1 and rate["lirs"] > rate["lru"] + 0.1, rate


def _reuse_once(chains: int, length: int, gap: int) -> list[Request]:
    """Chains read twice each, the second time ``gap`` requests later (every block's first
    reuse comes soon: LRU keeps them all until then)."""
    order: list[int] = []
    for c in range(chains):
        order.append(c)
        if c >= gap:
            order.append(c - gap)
    return [Request(i * 0.01, length * 16, 1, tuple(c * 1000 + j for j in range(length))) for i, c in enumerate(order)]


def _rates(reqs: list[Request], host_blocks: int, evictions: tuple[str, ...]) -> dict[str, float]:
    cfg = ReplayConfig(block_tokens=16, gpu_tokens=0, host_tokens=host_blocks * 16, disk_tokens=0)
    return {e: replay(reqs, ReplayConfig(**{**cfg.__dict__, "eviction": e}), "round-robin", 1).hit_rate or 0.0
            for e in evictions}


@pytest.mark.parametrize("host_blocks", [40, 100])
def test_adaptive_takes_lirs_on_a_loop_larger_than_host(host_blocks: int) -> None:
    """A loop of sessions larger than host: the miniature simulations find LIRS's share better
    and host follows it, far above lru (which hits almost nothing)."""
    reqs = _loop(sessions=8, turns=30, length=12)
    rate = _rates(reqs, host_blocks, ("lru", "kvtier", "lirs", "adaptive"))
    assert rate["adaptive"] > rate["lru"] + 0.1 and rate["adaptive"] > rate["kvtier"] + 0.09, rate
    p = TierPolicy(0, host_blocks, 0, eviction="adaptive")
    for r in reqs:
        p.access(r.keys)
    assert isinstance(p._lirs, AdaptiveLirs) and p._lirs.share < 1.0 and p._lirs.choices >= 1


@pytest.mark.parametrize("host_blocks", [100, 400])
def test_adaptive_keeps_lru_where_lru_is_right(host_blocks: int) -> None:
    """Every chain reused once, soon: lru keeps each until its reuse, lirs evicts new blocks
    (HIR) first and misses nearly all; adaptive stays with lru's order."""
    reqs = _reuse_once(chains=400, length=8, gap=5)
    rate = _rates(reqs, host_blocks, ("lru", "lirs", "adaptive"))
    assert rate["lirs"] < rate["lru"] - 0.3, rate
    assert rate["adaptive"] >= rate["lru"] - 0.01, rate


def test_adaptive_host_state_is_consistent_across_changes() -> None:
    """Whatever the share, every block held in host is LIR or HIR, and host holds at most its capacity."""
    p = TierPolicy(0, 60, 0, eviction="adaptive")
    a = p._lirs
    assert isinstance(a, AdaptiveLirs) and a.share == 1.0 and a.lru
    for r in _loop(sessions=8, turns=8, length=10) + _reuse_once(chains=100, length=6, gap=3):
        p.access(r.keys)
        held = set(p.tiers[HOST])
        assert len(held) <= 60 and held == a.lir | set(a.hir)
    with pytest.raises(ValueError):
        TierPolicy(0, None, 0, eviction="adaptive")

"""The replay's picture: the pooled-cache reference, the overload measure
and the plot that draws them with hit rate by tier, p99 TTFT and imbalance.

Traces here use 4-token blocks, as in tests/test_replay.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvtier.client.tools.replay import ReplayConfig, Request, main, plot, pooled, replay


def cfg(**kw) -> ReplayConfig:
    base = ReplayConfig(block_tokens=4, gpu_tokens=8, host_tokens=0, disk_tokens=0, prefill_tps=4000.0,
                        decode_tps=1.0, seed=0)
    return replace(base, **kw)


# two sessions of growing prefixes, alternating; a gpu of 2 blocks holds one session's prefix
TRACE = [Request(float(t), 4 * (t // 2 + 2), 1, tuple(range(100 * (t % 2), 100 * (t % 2) + t // 2 + 2)))
         for t in range(8)]


def test_pooled_is_one_replica_with_n_times_the_capacity() -> None:
    c = cfg()
    pool = pooled(TRACE, c, [2, 1, 2])
    assert sorted(pool) == [1, 2]
    assert pool[1].hit_rate == replay(TRACE, c, "kvtier", 1).hit_rate
    assert pool[2].hit_rate == replay(TRACE, replace(c, gpu_tokens=16), "round-robin", 1).hit_rate
    assert (pool[2].policy, pool[2].replicas) == ("pooled", 2)
    assert pool[2].hit_rate > pool[1].hit_rate  # both sessions fit in the pooled gpu


def test_busiest_prefill_share_by_hand() -> None:
    """Each request computes what it does not find; at 4000 tokens/s a 4-token block is 1 ms."""
    c = cfg(gpu_tokens=10**6)
    one = replay(TRACE, c, "round-robin", 1)
    computed_blocks = sum(len(r.keys) for r in TRACE) - round(one.hit_rate * one.blocks)
    assert one.busiest_prefill_share == pytest.approx(computed_blocks * 0.001 / 7.0)
    slow = replay(TRACE, replace(c, prefill_tps=4.0), "round-robin", 1)  # 1 s a block: overloaded
    assert slow.busiest_prefill_share == pytest.approx(computed_blocks / 7.0) and slow.busiest_prefill_share > 1
    assert replay(TRACE[:1], c, "round-robin", 1).busiest_prefill_share is None  # no span


def test_plot_and_json_carry_the_pooled_reference(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.arrival_s * 1000, "input_length": r.input_tokens,
                                        "output_length": 1, "hash_ids": list(r.keys)}) + "\n" for r in TRACE))
    png = tmp_path / "p.png"
    assert main([str(path), "--block-tokens", "4", "--gpu-tokens", "8", "--host-tokens", "0", "--disk-tokens", "0",
                 "--prefill-tps", "4", "--replicas", "1,2", "--plot", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("pooled (1 replica with N x the capacity) hit rate: N=1: ") for line in out)
    got = json.loads(out[-1])
    assert [(p["policy"], p["replicas"]) for p in got["pooled"]] == [("pooled", 1), ("pooled", 2)]
    by = {(r["policy"], r["replicas"]): r for r in got["rows"]}
    assert by[("kvtier", 1)]["busiest_prefill_share"] > 1  # 1 s a block: one replica cannot keep up
    assert got["pooled"][0]["hit_rate"] == by[("kvtier", 1)]["hit_rate"]


def test_plot_draws_only_not_applicable_rows_without_failing(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    rows = [replay(TRACE, cfg(), "session", n) for n in (1, 2)]  # the trace has no session ids: n/a
    assert all(r.na for r in rows)
    plot(rows, str(tmp_path / "na.png"))
    assert (tmp_path / "na.png").stat().st_size > 0

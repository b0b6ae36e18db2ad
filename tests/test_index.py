"""Unit tests of the location index, the vectorised scorer and the feed fold (pure logic).

The references here are the definitions, written key by key: a worker's holdings are the
leading runs of keys it holds in each tier or a faster one (:func:`leading`), and the ranking
sorts workers by cost, queued blocks, active requests and the tie hash (:func:`reference_rank`).
"""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from kvtier.client.routing.feed import FeedError
from kvtier.client.routing.index import FoldError, LocationIndex
from kvtier.client.routing.router import Router, RouterConfig, RouterError, UnknownCandidates
from kvtier.client.routing.scoring import (
    Load,
    Overlap,
    Scorer,
    ScorerConfig,
    parse_loads,
    tie_hash,
    tie_hashes,
    worker_digests,
)
from kvtier.proto import locations_pb2 as L
from kvtier.proto import node_pb2 as N
from kvtier.tiers.vocab import Tier

FP = b"f" * 16
FP2 = b"g" * 16
RANK = {"gpu": 0, "host": 1, "disk": 2, "remote": 3}
NOT_HELD = 4


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:014d}".encode()[:16].ljust(16, b".") for i in range(n)]


def holdings_of(idx: LocationIndex, ks: list[bytes]) -> np.ndarray:
    """The index's holdings for a request of ``ks``, own tiers: (3, workers)."""
    return idx.holdings(idx.rows(ks))[:3]


def leading(ranks: list[int]) -> Overlap:
    """The definition: from each key's best tier rank (0 gpu, 1 host, 2 disk, 3 remote, 4 not
    held), in request order, the leading run held in gpu, in gpu or host, in any own tier,
    and in those or remote."""
    d = [0, 0, 0, 0]
    worst = 0  # tier t's run is unbroken while every key so far has rank <= t
    for r in ranks:
        worst = max(worst, r)
        if worst >= NOT_HELD:
            break
        for t in range(worst, 4):
            d[t] += 1
    return Overlap(*d)


def reference_rank(scorer: Scorer, n: int, overlaps: dict[str, Overlap], loads: dict[str, Load],
                   w_host: dict[str, float], w_disk: dict[str, float], last: bytes,
                   w_remote: dict[str, float] | None = None) -> list[tuple[str, float]]:
    """The definition of the order: (worker, cost) best first, one worker at a time."""
    c = scorer.config
    out = []
    for w, ov in overlaps.items():
        saved = ov.gpu + w_host[w] * (ov.host - ov.gpu) + w_disk[w] * (ov.disk - ov.host) + \
            (w_remote or {}).get(w, 0.0) * (ov.remote - ov.disk)
        ld = loads[w]
        out.append((w, n - saved + c.queued_weight * ld.queued_blocks + c.active_weight * ld.active_requests, ld))
    out.sort(key=lambda x: (round(x[1], 9), x[2].queued_blocks, x[2].active_requests, tie_hash(last, x[0])))
    return [(w, cost) for w, cost, _ in out]


def test_overlaps_match_the_definition_on_random_holdings() -> None:
    """d_t is the leading run held in tier t or faster, per worker (the definition: leading);
    remote: another node's host or disk, or the store (a remote column of any node)."""
    rng = random.Random(7)
    idx = LocationIndex()
    workers = {f"w{i}": f"n{i % 3}" for i in range(7)}
    for node in set(workers.values()):
        idx.set_node_info(node, {w: [FP] for w, n in workers.items() if n == node})
    ks = keys(200)
    held: dict[tuple[str, str], set[bytes]] = {}
    for _ in range(400):
        w = rng.choice(sorted(workers))
        tier = rng.choice(["gpu", "host", "disk", "remote"])
        who, node = (w, workers[w]) if tier == "gpu" else ("", workers[w])
        lo = rng.randrange(200)
        batch = ks[lo:lo + rng.randrange(1, 40)]
        loc = (who or node, tier)
        if rng.random() < 0.7:
            idx.stored(node, tier, who, FP, batch)
            held.setdefault(loc, set()).update(batch)
        else:
            idx.removed(node, tier, who, FP, batch)
            held.setdefault(loc, set()).difference_update(batch)
    for start in range(0, 200, 13):
        req = ks[start:start + 64] + keys(3, "new")
        lead = idx.holdings(idx.rows(req))
        for w in idx.plan().workers:
            node = workers[w.name]

            def rank(k: bytes, w: str = w.name, node: str = node) -> int:
                for tier, loc in (("gpu", w), ("host", node), ("disk", node)):
                    if k in held.get((loc, tier), ()):
                        return RANK[tier]
                if any(k in ks_ for (loc, tier), ks_ in held.items()
                       if tier == "remote" or (tier in ("host", "disk") and loc != node)):
                    return RANK["remote"]
                return NOT_HELD

            want = leading([rank(k) for k in req])
            assert (want.gpu, want.host, want.disk, want.remote) == tuple(lead[:, w.index]), w.name
            assert tuple(idx.holdings(idx.rows(req), remote=False)[:, w.index]) == \
                (want.gpu, want.host, want.disk, want.disk)


def test_a_tensor_parallel_worker_holds_a_block_only_when_every_rank_does() -> None:
    idx = LocationIndex()
    idx.set_node_info("n", {"tp2": [FP, FP2]})
    ks = keys(8)
    idx.stored("n", "host", "", FP, ks)
    idx.stored("n", "host", "", FP2, ks[:5])
    assert holdings_of(idx, ks)[:, 0].tolist() == [0, 5, 5]


def test_an_undeclared_node_is_one_worker_that_takes_any_fingerprint() -> None:
    idx = LocationIndex()
    ks = keys(6)
    idx.stored("solo", "host", "", FP, ks[:3])
    idx.stored("solo", "disk", "", FP2, ks[3:])
    assert [w.name for w in idx.plan().workers] == ["solo"]
    assert holdings_of(idx, ks)[:, 0].tolist() == [0, 3, 6]


def test_speculative_entries_expire_between_ttl_and_twice_ttl() -> None:
    idx = LocationIndex(speculative_ttl_s=1.0)
    idx.stored("n", "host", "", FP, keys(1, "other"))  # a node, so there is a worker
    ks = keys(4)
    idx.expire(0.0)
    idx.speculate("n", ks)
    idx.expire(0.99)
    assert holdings_of(idx, ks)[0, 0] == 4
    idx.expire(1.5)   # one rotation: the entry is in the older generation now, still there
    assert holdings_of(idx, ks)[0, 0] == 4
    idx.expire(2.01)  # second rotation: gone
    assert holdings_of(idx, ks)[0, 0] == 0
    idx.compact()
    assert len(idx) == 1  # only the stored key is left


def test_rows_of_removed_keys_are_reclaimed_and_reused() -> None:
    idx = LocationIndex()
    ks = keys(1000)
    idx.stored("n", "host", "", FP, ks)
    assert len(idx) == 1000
    idx.removed("n", "host", "", FP, ks[:600])
    assert idx.compact() == 600
    assert len(idx) == 400
    rows_before = idx._high
    idx.stored("n", "disk", "", FP, keys(500, "x"))
    assert idx._high == rows_before  # the 500 new keys took freed rows
    assert holdings_of(idx, ks[600:])[:, 0].tolist() == [0, 400, 400]
    assert holdings_of(idx, keys(500, "x"))[:, 0].tolist() == [0, 0, 500]


def test_a_batch_of_repeated_new_keys_gives_each_key_one_row() -> None:
    """A stored batch whose new keys repeat (some at once, some thousands of keys later), among
    known keys, taking freed rows and then new ones: one row per distinct key, the same row
    wherever it repeats, and every holding where it was stored."""
    rng = random.Random(5)
    idx = LocationIndex(initial_rows=16)
    known = keys(3000, "k")
    idx.stored("n", "host", "", FP, known)
    idx.removed("n", "host", "", FP, known[:1000])
    assert idx.compact() == 1000  # freed rows: taken first
    fresh = keys(4000, "x")
    batch = []
    for i, k in enumerate(fresh):
        batch.append(k)
        if i % 3 == 0:
            batch.append(k)  # at once
        if i % 5 == 0:
            batch.append(rng.choice(fresh[:i + 1]))  # later
        if i % 7 == 0:
            batch.append(rng.choice(known[1000:]))
    idx.stored("n", "disk", "", FP, batch)
    assert len(idx) == 2000 + 4000
    found = idx.rows(fresh + known[1000:])
    rows = found.rows[1:-1].tolist()
    assert found.indexed == len(rows) and len(set(rows)) == len(rows)
    row_of = dict(zip(fresh + known[1000:], rows, strict=True))
    assert idx.rows(batch).rows[1:-1].tolist() == [row_of[k] for k in batch]
    assert holdings_of(idx, fresh)[:, 0].tolist() == [0, 0, 4000]
    assert holdings_of(idx, known[1000:])[:, 0].tolist() == [0, 2000, 2000]


def test_state_round_trip_keeps_holdings_and_drops_speculation() -> None:
    idx = LocationIndex()
    idx.set_node_info("a", {"a0": [FP]}, {"host": 40.0})
    idx.stored("a", "gpu", "a0", FP, keys(5))
    idx.stored("a", "host", "", FP, keys(9, "h"))
    idx.stored("b", "disk", "", FP2, keys(3, "d"))
    idx.removed("a", "host", "", FP, keys(2, "h"))
    idx.speculate("b", keys(4, "s"))
    idx.fold("a", L.WatchLocationsReply(epoch=11, snapshot=L.SnapshotPart(at_seq=42, last=True)))  # a position
    copy = LocationIndex()
    copy.load_state(idx.state())
    assert copy.locations() == idx.locations()
    assert (copy.node("a").epoch, copy.node("a").seq) == (11, 42)
    assert copy.node("a").load_gbps == {"host": 40.0}
    assert holdings_of(copy, keys(4, "s"))[0].tolist() == [0, 0]
    for index in (idx, copy):
        lead = {w.name: holdings_of(index, keys(5)[:3] + keys(1, "zz"))[:, w.index].tolist()
                for w in index.plan().workers}
        assert lead == {"a0": [3, 3, 3], "b": [0, 0, 0]}
        lead = {w.name: holdings_of(index, keys(9, "h")[2:])[:, w.index].tolist() for w in index.plan().workers}
        assert lead == {"a0": [0, 7, 7], "b": [0, 0, 0]}
    copy.stored("b", "disk", "", FP2, keys(2, "new"))  # rows after a load are new rows, not row 0
    assert holdings_of(copy, keys(2, "new"))[:, 1].tolist() == [0, 0, 2]
    assert copy.locations()[("b", "disk", "", FP2)] == set(keys(3, "d")) | set(keys(2, "new"))


def _churned_index() -> tuple[LocationIndex, list[bytes]]:
    """An index after stores, removals, a compaction (free rows), speculation and a key of
    another length: what a long-running router holds."""
    rng = np.random.default_rng(7)
    ks = [bytes(k) for k in rng.integers(0, 256, size=(3000, 16), dtype=np.uint8)]
    idx = LocationIndex()
    idx.set_node_info("a", {"a0": [FP]}, {"host": 40.0})
    idx.stored("a", "gpu", "a0", FP, ks[:200])
    idx.stored("a", "host", "", FP, ks[:1800])
    idx.stored("b", "disk", "", FP2, ks[1000:])
    idx.stored("b", "host", "", FP2, [b"short-key", b"x" * 300])
    idx.removed("a", "host", "", FP, ks[400:1000])
    idx.removed("a", "gpu", "a0", FP, ks[400:1000])
    assert idx.compact() == 600
    idx.speculate("b", ks[2500:2520])
    idx.fold("a", L.WatchLocationsReply(epoch=11, snapshot=L.SnapshotPart(at_seq=42, last=True)))
    return idx, ks


def _same_answers(a: LocationIndex, b: LocationIndex, ks: list[bytes], same_rows: bool = True) -> None:
    assert a.locations() == b.locations()
    for lo, hi in ((0, 64), (180, 260), (390, 420), (990, 1100), (1790, 1830), (2990, 3000)):
        q = ks[lo:hi] + [b"short-key"]
        if same_rows:
            assert a.rows(q).rows.tolist() == b.rows(q).rows.tolist()
        assert holdings_of(a, q).tolist() == holdings_of(b, q).tolist()


def test_a_loaded_state_takes_the_snapshots_arrays_as_they_are() -> None:
    """The matrix and the packed keys of a snapshot's buffer become the index's own (no copy),
    rows keep their numbers (free rows included), and the index then answers and changes as
    the saved one does."""
    from kvtier.client.routing import snapshot

    idx, ks = _churned_index()
    arrays = snapshot.decode(bytearray(snapshot.encode(idx.state())))
    copy = LocationIndex()
    copy.load_state(arrays)
    assert np.shares_memory(copy._bits, arrays["bits"])
    assert np.shares_memory(copy._rows.packed, arrays["table_packed"])
    assert len(copy) == len(idx)
    _same_answers(idx, copy, ks)
    assert holdings_of(copy, ks[2500:2520])[0].tolist() == [0, 0]  # speculation is not saved
    new = keys(700, "new")  # the 600 freed rows first, then new ones
    for index in (idx, copy):
        index.speculate("a0", ks[2600:2610])
        index.stored("b", "disk", "", FP2, new)
        index.stored("a", "host", "", FP, ks[2000:2100])
    assert copy._high == idx._high
    _same_answers(idx, copy, ks + new)
    assert copy.rows(new).rows.tolist() == idx.rows(new).rows.tolist()


def test_a_state_of_the_earlier_format_is_rebuilt() -> None:
    """A state saved with the keys joined and the live rows' bits (routers before the key
    table's arrays were saved) loads: the same locations and answers."""
    from _state_formats import earlier_format_state

    idx, ks = _churned_index()
    copy = LocationIndex()
    copy.load_state(earlier_format_state(idx))
    assert len(copy) == len(idx)
    _same_answers(idx, copy, ks, same_rows=False)  # (rows numbered anew, in order)
    copy.stored("b", "disk", "", FP2, keys(2, "new"))
    assert holdings_of(copy, keys(2, "new"))[:, 1].tolist() == [0, 0, 2]


def test_a_state_this_index_cannot_take_raises_and_changes_nothing() -> None:
    idx, ks = _churned_index()
    good = idx.state()
    meta = json.loads(bytes(good["meta"]))
    newer = dict(good, meta=np.frombuffer(json.dumps({**meta, "format": 3}).encode(), dtype=np.uint8))
    short = dict(good, table_packed=good["table_packed"][:-1])
    free_live = dict(good, free_rows=np.array([1], dtype=np.int64))
    beyond = dict(good, meta=np.frombuffer(json.dumps({**meta, "high": len(good["bits"])}).encode(), dtype=np.uint8))
    reserved = dict(good, meta=np.frombuffer(json.dumps({**meta, "columns": [["n", "host", "", "00", 0]]}).encode(),
                                               dtype=np.uint8))
    target = LocationIndex()
    target.load_state(good)
    for bad, says in ((newer, "format 3"), (short, "rows of bits"), (free_live, "free"), (beyond, "given out"),
                      (reserved, "reserved")):
        with pytest.raises(ValueError, match=says):
            target.load_state(bad)
        _same_answers(idx, target, ks)
    with pytest.raises(KeyError):
        target.load_state({k: a for k, a in good.items() if k != "table_packed"})


def test_vectorised_cost_and_order_equal_the_definition() -> None:
    rng = np.random.default_rng(3)
    scorer = Scorer(ScorerConfig())
    published = [{"host": 30.0, "disk": 3.0, "remote": 20.0}, {}, {"disk": 0.0}, {"host": 0.5, "remote": 40.0}] * 10
    names = [f"worker-{i}" for i in range(40)]
    w_host = {w: scorer.tier_weight(Tier.HOST, bw.get("host", 0.0)) for w, bw in zip(names, published, strict=True)}
    w_disk = {w: scorer.tier_weight(Tier.DISK, bw.get("disk", 0.0)) for w, bw in zip(names, published, strict=True)}
    # a node that publishes no remote tier cannot fetch from peers or a store: w_remote = 0
    w_remote = {w: scorer.tier_weight(Tier.REMOTE, bw["remote"]) if "remote" in bw else 0.0
                for w, bw in zip(names, published, strict=True)}
    assert len(set(w_host.values())) == 3 and len(set(w_disk.values())) == 2 and len(set(w_remote.values())) == 3
    for trial in range(50):
        n = 64
        dg = rng.integers(0, 8, size=40) * (trial % 2)
        dh = dg + rng.integers(0, 20, size=40)
        dd = dh + rng.integers(0, 20, size=40)
        dr = dd + rng.integers(0, 20, size=40)
        q = rng.integers(0, 3, size=40).astype(float)
        a = rng.integers(0, 2, size=40).astype(float)
        last = bytes(rng.integers(0, 256, size=16, dtype=np.uint8))
        want = reference_rank(scorer, n, {w: Overlap(int(dg[i]), int(dh[i]), int(dd[i]), int(dr[i]))
                                          for i, w in enumerate(names)},
                              {w: Load(q[i], a[i]) for i, w in enumerate(names)}, w_host, w_disk, last, w_remote)
        cost, saved = scorer.costs(n, np.stack([dg, dh, dd, dr]), scorer.load_cost(q, a), scorer.weights(published))
        order = Scorer.order(cost, q, a, worker_digests(names), last)
        assert [names[i] for i in order] == [w for w, _ in want]
        assert np.allclose(cost[order], [c for _, c in want])


def test_tier_weights_follow_the_bandwidths() -> None:
    """r = bytes_per_token * prefill_tokens_per_s / bandwidth (131072 B/token at 20000 tokens/s:
    a tier at 2.62 GB/s loads as fast as the gpu recomputes). Async loads (the default) run
    beside the prefill, w_t = 1 / (1 + r): a slow tier still saves part of a recompute; serial
    loads hold it, w_t = max(0, 1 - r): a tier slower than recompute saves nothing."""
    for loads, w in (("async", lambda r: 1 / (1 + r)), ("serial", lambda r: max(0.0, 1 - r))):
        scorer = Scorer(ScorerConfig(loads=loads))
        assert scorer.tier_weight(Tier.GPU) == 1.0
        assert scorer.tier_weight(Tier.HOST) == pytest.approx(w(2.62144 / 50))      # the configured default
        assert scorer.tier_weight(Tier.HOST, 10.0) == pytest.approx(w(2.62144 / 10))  # a published one
        assert scorer.tier_weight(Tier.DISK) == pytest.approx(w(2.62144 / 2))
        assert scorer.tier_weight(Tier.DISK, 6.0) == pytest.approx(w(2.62144 / 6))
        assert scorer.tier_weight(Tier.REMOTE) == pytest.approx(w(2.62144 / 10))  # remote_load_gbps
        assert scorer.tier_weight(Tier.REMOTE, 25.0) == pytest.approx(w(2.62144 / 25))
        assert Scorer(ScorerConfig(loads=loads), pulls=False).tier_weight(Tier.REMOTE, 25.0) == 0.0  # pulls off
    assert Scorer(ScorerConfig(loads="serial")).tier_weight(Tier.DISK) == 0.0  # slower than recompute
    assert Scorer().tier_weight(Tier.DISK) == pytest.approx(0.4328, abs=1e-4)  # the default: async
    with pytest.raises(ValueError, match="not one of async, serial"):
        parse_loads("sync")


def test_tie_hash_is_stable_and_vectorised_the_same() -> None:
    names = ["a", "b", "engine-7:8000"]
    got = tie_hashes(b"k" * 16, worker_digests(names)).tolist()
    assert got == [tie_hash(b"k" * 16, w) for w in names]
    assert tie_hash(b"k" * 16, "a") == 0x386129ACDE85A366  # the same in every process and run


def _node(nid: str, epoch: int, head: int = 0, workers: dict[str, list[bytes]] | None = None) -> L.WatchLocationsReply:
    info = L.NodeInfo(node_id=nid, epoch=epoch, head_seq=head)
    for w, fps in (workers or {}).items():
        info.workers.add(worker_id=w, fingerprints=fps)
    return L.WatchLocationsReply(epoch=epoch, node=info)


def _snap(epoch: int, at: int, *entries: L.LocationEvent) -> L.WatchLocationsReply:
    return L.WatchLocationsReply(epoch=epoch, snapshot=L.SnapshotPart(at_seq=at, first=True, last=True,
                                                                      entries=list(entries)))


def _events(epoch: int, *events: L.LocationEvent) -> L.WatchLocationsReply:
    return L.WatchLocationsReply(epoch=epoch, events=L.EventBatch(events=list(events), head_seq=events[-1].seq))


def _ev(seq: int, kind: int, tier: int, ks: list[bytes], worker: str = "") -> L.LocationEvent:
    return L.LocationEvent(seq=seq, kind=kind, tier=tier, worker_id=worker, fingerprint=FP, keys=ks)


def test_feed_fold_rejects_gaps_and_duplicates_and_resets_on_a_new_epoch() -> None:
    r = Router()
    ks = keys(10)
    r.apply("t", _node("A", 5, 1))
    r.apply("t", _snap(5, 1, _ev(1, L.STORED, N.TIER_HOST, ks)))
    r.apply("t", _events(5, _ev(2, L.REMOVED, N.TIER_HOST, ks[:2])))
    with pytest.raises(FoldError):
        r.apply("t", _events(5, _ev(2, L.REMOVED, N.TIER_HOST, ks[:2])))  # duplicate
    with pytest.raises(FoldError):
        r.apply("t", _events(5, _ev(4, L.REMOVED, N.TIER_HOST, ks[:2])))  # gap
    with pytest.raises(FoldError):
        r.apply("t", _events(6, _ev(3, L.REMOVED, N.TIER_HOST, ks[:2])))  # another epoch
    with pytest.raises(FeedError):
        r.apply("u", _events(5, _ev(1, L.STORED, N.TIER_HOST, ks)))  # locations before a NodeInfo
    assert r.positions() == {"A": (5, 2)}
    seen = []
    r.on_epoch_change = lambda node, old, new: seen.append((node, old, new))
    r.apply("t", _node("A", 9, 0))
    r.apply("t", _snap(9, 0))
    assert seen == [("A", 5, 9)]
    assert r.positions() == {"A": (9, 0)}
    assert r.index.locations() == {}
    assert r.status()[0].epoch_changes == 1


def test_router_prefers_faster_tiers_and_records_loads() -> None:
    r = Router(RouterConfig(scorer=ScorerConfig(host_load_gbps=50.0, disk_load_gbps=2.0)))
    ks = keys(32)
    r.apply("a", _node("A", 1))
    r.apply("a", _snap(1, 1, _ev(1, L.STORED, N.TIER_HOST, ks)))
    r.apply("b", _node("B", 1))
    r.apply("b", _snap(1, 1, _ev(1, L.STORED, N.TIER_DISK, ks)))
    d = r.route(ks, dispatch=False)
    assert d.workers == ["A", "B"]
    assert d.ranked[0].overlap == Overlap(0, 32, 32) and d.ranked[1].overlap == Overlap(0, 0, 32)
    assert d.ranked[0].cost < d.ranked[1].cost
    d = r.route(ks)
    assert d.worker == "A" and r.load("A") == Load(pytest.approx(32 - d.ranked[0].saved_blocks), 1.0)
    assert r.finish(d.decision_id) and r.load("A") == Load(0.0, 0.0)
    assert not r.finish(d.decision_id)


def test_route_refuses_unknown_candidates_and_does_not_remember_them() -> None:
    r = Router()
    with pytest.raises(RouterError, match="no workers"):
        r.route(keys(3))
    with pytest.raises(RouterError, match="no workers"):
        r.route(keys(3), candidates=["x", "y"])
    r.apply("a", _node("A", 1))
    with pytest.raises(UnknownCandidates, match="'x', 'y'"):
        r.route(keys(3), candidates=["A", "x", "y"])
    assert r.workers() == [("A", "A")]
    d = r.route(keys(3), candidates=["A", "A"], dispatch=False)
    assert d.workers == ["A"] and d.nodes == ["A"]


def test_rows_equal_plain_dict_lookups_through_inserts_removals_and_reuse() -> None:
    """The run-based row lookup agrees with one dict probe per key, whatever the row order."""
    rng = random.Random(11)
    idx = LocationIndex()
    pool = keys(600) + keys(300, "z")
    for _ in range(60):
        lo = rng.randrange(len(pool))
        batch = pool[lo:lo + rng.randrange(1, 50)]
        if rng.random() < 0.3:
            batch = batch[::-1]  # rows in the opposite order of the keys
        if rng.random() < 0.75:
            idx.stored("n", rng.choice(["host", "disk"]), "", FP, batch)
        else:
            idx.removed("n", "host", "", FP, batch)
            idx.removed("n", "disk", "", FP, batch)
        if rng.random() < 0.1:
            idx.compact()  # frees rows that later keys take again
        for _ in range(5):
            start = rng.randrange(len(pool))
            req = pool[start:start + rng.randrange(0, 70)] + keys(rng.randrange(3), "new")
            if req and rng.random() < 0.3:
                req = req + req[: rng.randrange(len(req))]  # repeated keys
            if req and rng.random() < 0.3:
                req.insert(rng.randrange(len(req)), b"never-seen-key..")
            want = [idx._rows.get(k, -1) for k in req]
            rows, m = idx.rows(req)
            assert rows.tolist() == [-1, *want, -1]  # the empty row around: it bounds a walk
            assert not idx._bits[-1].any()
            assert m == (want.index(-1) if -1 in want else len(want))
    # a key out of place inside a run (the run's rows line up again after it)
    fresh = LocationIndex()
    ks = keys(12, "r")
    fresh.stored("n", "host", "", FP, ks)
    req = ks[0:2] + [ks[9]] + ks[3:8]
    assert fresh.rows(req)[0][1:-1].tolist() == [fresh._rows[k] for k in req]


def _reference_ranking(r: Router, req: list[bytes], names: list[str]) -> list[tuple[str, float, Overlap]]:
    """Holdings walked key by key from the index's locations, then the definition of the order."""
    locs = r.index.locations(speculative=True)
    node_of = {w: n for w, n in r.workers()}
    fps = {w: r.index.node(n).workers.get(w, ()) for w, n in node_of.items() if n}

    def has(node: str, tier: str, who: str, k: bytes, w: str) -> bool:
        where = [(node, tier, who, fp) for fp in fps.get(w, ())] or \
            [loc for loc in locs if loc[:3] == (node, tier, who)]
        if fps.get(w):
            return all(k in locs.get(loc, ()) for loc in where)
        return any(k in locs.get(loc, ()) for loc in where)

    def remote(k: bytes, w: str, node: str) -> bool:
        """Some node's host or disk, or any node's store column, under each of w's fingerprints
        (a tensor-parallel worker may hold one rank's shard itself and fetch the other's)."""
        need = fps.get(w) or None
        by_fp: dict[bytes, bool] = {}
        for (_, tier, _, fp), held in locs.items():
            if tier in ("host", "disk", "remote") and k in held:
                by_fp[fp] = True
        return any(by_fp.values()) if need is None else all(by_fp.get(fp, False) for fp in need)

    def rank(k: bytes, w: str, node: str) -> int:
        if k in locs.get(("", "speculative", w, b""), ()):
            return 0
        if not node:
            return NOT_HELD
        for t, (tier, who) in enumerate((("gpu", w), ("host", ""), ("disk", ""))):
            if has(node, tier, who, k, w):
                return t
        return RANK["remote"] if remote(k, w, node) else NOT_HELD

    overlaps = {w: leading([rank(k, w, node_of.get(w, "")) for k in req]) for w in names}
    bandwidth = {w: r.index.node(n).load_gbps if n else {} for w, n in node_of.items()}
    w_host = {w: r.scorer.tier_weight(Tier.HOST, bandwidth[w].get("host", 0.0)) for w in names}
    w_disk = {w: r.scorer.tier_weight(Tier.DISK, bandwidth[w].get("disk", 0.0)) for w in names}
    w_remote = {w: r.scorer.tier_weight(Tier.REMOTE, bandwidth[w]["remote"]) if "remote" in bandwidth[w] else 0.0
                for w in names}  # a node that publishes no remote tier cannot fetch
    ranked = reference_rank(r.scorer, len(req), overlaps, {w: r.load(w) for w in names}, w_host, w_disk,
                            req[-1] if req else b"", w_remote)
    return [(w, cost, overlaps[w]) for w, cost in ranked]


def _random_holdings(r: Router, rng: random.Random, tensor_parallel: bool) -> tuple[dict[str, list[str]], list[str],
                                                                                    list[list[bytes]]]:
    """Three nodes of three workers (with ``tensor_parallel``: one worker of two ranks and a
    node that declares no worker), random stores and removals of six chains of keys."""
    nodes = {f"n{j}": [f"n{j}w{i}" for i in range(3)] for j in range(3)}
    for node, ws in nodes.items():
        decl = {w: [FP] for w in ws}
        if tensor_parallel and node == "n1":
            decl[ws[0]] = [FP, FP2]
        r.index.set_node_info(node, decl, {"host": 4.0 + int(node[1]), "disk": 0.0, "remote": 3.0 + int(node[1])})
    others = [*nodes]
    if tensor_parallel:  # also a node that declares no worker: one worker, any fingerprint
        r.index.set_node_info("solo")
        others.append("solo")
    chains = [keys(40, f"c{c}") for c in range(6)]
    for _ in range(120):
        chain = rng.choice(chains)
        node = rng.choice(others)
        tier = rng.choice(["host", "disk", "remote"] if node == "solo" else ["gpu", "host", "disk", "remote"])
        who = rng.choice(nodes[node]) if tier == "gpu" else ""
        fp = FP2 if (node == "solo" and rng.random() < 0.5) or (tensor_parallel and rng.random() < 0.2) else FP
        lo = rng.randrange(0, 30)
        part = chain[lo:lo + rng.randrange(1, 40)]
        if rng.random() < 0.75:
            r.index.stored(node, tier, who, fp, part)
        else:
            r.index.removed(node, tier, who, fp, part)
    return nodes, others, chains


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_route_equals_the_reference_walk_and_rank_on_random_holdings(tensor_parallel: bool) -> None:
    """The vectorised route (row runs, segment walk, array cost and order, per-node tier
    weights, speculative entries and loads from dispatches) ranks exactly as the key-by-key
    definition."""
    rng = random.Random(5 + tensor_parallel)
    r = Router(RouterConfig(top_k=100))
    nodes, others, chains = _random_holdings(r, rng, tensor_parallel)
    inflight: list[int] = []
    for i in range(150):
        req = rng.choice(chains)[:rng.randrange(1, 41)] + keys(rng.randrange(0, 5), f"fresh{i % 7}")
        cands = None
        if i % 5 == 0:
            cands = rng.sample([w for ws in nodes.values() for w in ws] + others[len(nodes):] + ["ext"], 4)
            for c in cands:
                if r.index.worker(c) is None:
                    r.index.add_external_worker(c)
        names = [w for w, _ in r.workers()] if cands is None else list(dict.fromkeys(cands))
        now = float(i) * 0.5  # speculative entries expire along the way (ttl 10 s)
        r.index.expire(now)
        want = _reference_ranking(r, req, names)
        d = r.route(req, cands, dispatch=i % 3 != 0, now=now)
        got = [(x.worker, x.cost, x.overlap) for x in d.ranked]
        assert [g[0] for g in got] == [w[0] for w in want], (i, got, want)
        assert [g[2] for g in got] == [w[2] for w in want], (i, got, want)
        assert (r.index.plan().fast is None) == tensor_parallel  # the general path, or the fast one
        assert np.allclose([g[1] for g in got], [w[1] for w in want])
        if d.decision_id:
            inflight.append(d.decision_id)
        if len(inflight) > 4:
            r.finish(inflight.pop(rng.randrange(len(inflight))), prefill_only=rng.random() < 0.3)


def hkeys(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def test_removed_locations_never_score_and_a_returning_worker_starts_empty() -> None:
    """Removal is lazy (a location's column is given back with its bits still set and cleared
    only before the column is used again): whatever the order of removals and reuse, a worker
    that left is never ranked, one cleared holds nothing of what it held, and a worker or node
    that comes back (under the same name, on reused columns) holds only what it stores anew.
    Enough cycles that the matrix's spare columns run out and given-back ones are reused."""
    r = Router(RouterConfig())
    idx = r.index
    idx.set_node_info("keep", {"k0": [FP]})  # a node that stays, holding the keys of every cycle in host
    history: list[list[bytes]] = []
    for cycle in range(90):
        node, worker = f"n{cycle % 3}", f"w{cycle % 5}"
        mine = hkeys(8, f"gpu{cycle}")
        idx.set_node_info(node, {worker: [FP]})
        # a returning worker (same name, same node or another) holds nothing it held before
        for old in history[-12:]:
            lead = holdings_of(idx, old)[:, idx.worker(worker).index]
            assert lead[:3].tolist() == [0, 0, 0], (cycle, worker)
        idx.stored(node, "gpu", worker, FP, mine)
        idx.stored(node, "host", "", FP, hkeys(4, f"host{cycle}"))
        idx.stored("keep", "host", "", FP, mine)
        r.route(hkeys(6, f"spec{cycle}"), [worker])  # dispatched: speculative entries on the worker
        assert holdings_of(idx, mine)[0, idx.worker(worker).index] == 8
        if cycle % 2:  # its engine restarted: GPU cleared, the worker stays
            idx.cleared(node, "gpu", worker)
            assert holdings_of(idx, mine)[:, idx.worker(worker).index].tolist() == [0, 0, 0]
            idx.stored(node, "gpu", worker, FP, mine[:3])  # a new store after the clear counts alone
            assert holdings_of(idx, mine)[0, idx.worker(worker).index] == 3
        r.index.drop_node(node)  # the node leaves: its worker is never ranked again
        d = r.route(mine, dispatch=False)
        assert worker not in d.workers and node not in d.nodes
        assert d.ranked[0].overlap.host == 8  # the node that stays still holds them
        history += [mine, hkeys(4, f"host{cycle}"), hkeys(6, f"spec{cycle}")]
    assert idx.columns <= 128, idx.columns  # given-back columns were reused
    assert idx._free_cols
    keep = idx.worker("k0").index
    for compacted in (False, True):  # nothing stale anywhere, before a compaction and after
        if compacted:
            idx.compact()
        for i, old in enumerate(history):
            lead = holdings_of(idx, old)
            if i % 3 == 0:  # a cycle's GPU keys: in "keep"'s host tier only
                assert lead[1, keep] == 8 and lead[1].sum() == 8 and not lead[0].any()
            else:
                assert not lead.any()

"""The pairs layout of the router's index (client/routing/pairs.py, _pairs.c) against the bit
matrix: its table keeps exactly the pairs put and not removed through growth, removals and
column sweeps; and on random clusters (several nodes and workers, gpu/host/disk/remote
holdings, removals, cleared tiers, speculative entries and their expiry, sparse deep tiers)
a router of either layout makes every decision alike: rows' leading runs, holdings, costs,
the order, fetch hints, dispatch. Its state goes back and forth as it is."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_route_compiled import _feeds, _requests, _same

from kvtier.client.routing import pairs as pairs_mod
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.proto import locations_pb2 as L
from kvtier.proto import node_pb2 as N

needs_c = pytest.mark.skipif(pairs_mod._cpairs is None, reason="the pairs table is not built")


def test_the_install_built_the_pairs_table() -> None:
    assert pairs_mod._cpairs is not None, "kvtier.client.routing._pairs is missing: the install did not build it"


def _fp(key: bytes) -> bytes:
    return pairs_mod.fingerprint(key)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_the_table_holds_exactly_what_was_put_and_not_removed(seed: int) -> None:
    """Against a set of (key, column): inserts (repeats included), removals (of pairs held and
    not), sweeps of columns, in a table that starts at 16 slots and grows; every key's columns
    are read back through gather()."""
    rng = random.Random(seed)
    keys = [rng.randbytes(rng.choice([16, 16, 16, 3, 40])) for _ in range(rng.choice([40, 3000]))]
    t = pairs_mod.PairTable()
    want: set[tuple[bytes, int]] = set()
    for step in range(400):
        op = rng.random()
        col = rng.randrange(2, 200)
        batch = rng.sample(keys, rng.randint(1, min(len(keys), 60)))
        if op < 0.55:
            t.insert(batch, col)
            want.update((k, col) for k in batch)
        elif op < 0.9:
            t.remove(batch, col)
            want.difference_update((k, col) for k in batch)
        elif op < 0.97:
            mask = np.zeros(200, dtype=np.uint8)
            gone = rng.sample(range(200), rng.randint(1, 30))
            mask[gone] = 1
            t.clear(mask)
            want = {(k, c) for k, c in want if c not in gone}
        else:
            t.reserve(rng.randint(1, 5000))
        assert len(t) == len(want)
        if step % 20 == 0 or step == 399:
            bits = np.zeros((len(keys) + 3, 4), dtype=np.uint64)
            rows = np.empty(len(keys) + 2, dtype=np.int64)
            pairs_mod._cpairs.gather(t.fps, t.cols, keys, bits, 4, 1, rows)
            for i, k in enumerate(keys):
                got = {c for c in range(2, 256) if int(bits[i + 1, c >> 6]) >> (c & 63) & 1}
                assert got == {c for kk, c in want if kk == k}
                assert (rows[i + 1] == i + 1) == bool(got)
    assert len(t) <= pairs_mod.LOAD_MAX * len(t.fps)


@needs_c
def test_the_test_keys_have_distinct_fingerprints() -> None:
    rng = random.Random(7)
    keys = {rng.randbytes(16) for _ in range(200_000)} | {i.to_bytes(8, "little") + b"\x01" * 8 for i in range(50_000)}
    assert len({_fp(k) for k in keys}) == len(keys)


def _pair_of(cfg: RouterConfig) -> tuple[Router, Router]:
    from dataclasses import replace  # noqa: PLC0415
    return Router(cfg), Router(replace(cfg, index_layout="pairs"))


def _clusters(rng: random.Random, strides: str = "") -> tuple[Router, Router, list[list[bytes]]]:
    chains = [[rng.randbytes(16) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    feeds = _feeds(rng, rng.randint(1, 5), rng.choice([1, 3, 8, 64, 70]), chains, one_batch=rng.random() < 0.5)
    matrix, pairs = _pair_of(RouterConfig(top_k=rng.choice([1, 3, 8, 100]), index_strides=strides))
    for node, msgs in feeds.items():
        for msg in msgs:
            matrix.apply(node, msg)
            pairs.apply(node, msg)
    return matrix, pairs, chains


def _same_holdings(matrix: Router, pairs: Router) -> None:
    want = {loc: {_fp(k) for k in keys} for loc, keys in matrix.index.locations(speculative=True).items()}
    assert pairs.index.locations(speculative=True) == want


def _cleared(node: str, tier: int, seq: int, worker: str = "") -> L.WatchLocationsReply:
    batch = L.EventBatch(head_seq=seq)
    batch.events.add(seq=seq, kind=L.CLEARED, tier=tier, worker_id=worker)
    return L.WatchLocationsReply(epoch=1, events=batch)


@needs_c
@pytest.mark.parametrize(("seed", "strides"), [(0, ""), (1, ""), (2, ""), (3, "default"), (4, "host=2,disk=3"),
                                                (5, "host=4")])
def test_a_pairs_router_decides_as_the_matrix_router(seed: int, strides: str) -> None:
    rng = random.Random(300 + seed)
    rm, rp, chains = _clusters(rng, strides)
    _same_holdings(rm, rp)
    workers = [w for w, _ in rm.workers()]
    nodes = sorted({n for _, n in rm.workers()})
    seqs = {n: rm.index.position(n)[1] for n in nodes}
    now = 100.0
    for i, req in enumerate(_requests(rng, chains, 300)):
        now += rng.choice([0.0, 0.01, 3.0, 12.0])  # past the speculative entries' ttl now and then
        cand = rng.sample(workers, rng.randint(1, len(workers))) if i % 7 == 3 else None
        top_k = rng.choice([None, 1, 2, len(workers), 20])
        dispatch = i % 3 != 0
        if i % 11 == 5:
            w = rng.choice(workers)
            q, a = float(rng.randint(0, 3)), float(rng.randint(0, 2))
            rm.set_load(w, q, a, now)
            rp.set_load(w, q, a, now)
        if i % 50 == 49:  # a tier cleared: its column given back, swept before it is used again
            node = rng.choice(nodes)
            seqs[node] += 1
            msg = _cleared(node, rng.choice([N.TIER_HOST, N.TIER_DISK]), seqs[node])
            rm.apply(node, msg)
            rp.apply(node, msg)
        dm = rm.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        dp = rp.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        _same(dm, dp)
        if dispatch and i % 4 == 0:
            assert rm.finish(dm.decision_id) == rp.finish(dp.decision_id)
    _same_holdings(rm, rp)


@needs_c
def test_the_state_goes_back_and_forth_and_a_matrix_state_is_refused() -> None:
    rng = random.Random(9)
    rm, rp, chains = _clusters(rng, "")
    node = sorted({n for _, n in rm.workers()})[0]
    assert rp.workers() == rm.workers()  # (the plans made: both make the same columns from here)
    seq = rm.index.position(node)[1] + 1
    for r in (rm, rp):  # a given-back column: its pairs are not saved
        r.apply(node, _cleared(node, N.TIER_HOST, seq))
        r.route(chains[0], now=50.0)  # speculative entries: not saved
    arrays = rp.state_arrays()
    assert set(arrays) >= {"meta", "pair_fps", "pair_cols"}
    fresh_m, fresh_p = _pair_of(RouterConfig())
    fresh_p.index.load_state(arrays)
    fresh_m.index.load_state(rm.state_arrays())
    _same_holdings(fresh_m, fresh_p)
    assert isinstance(fresh_p.index, pairs_mod.PairIndex) and fresh_p.holdings() == rp.holdings()
    free = len(fresh_p.index._free_cols)
    assert free == len(fresh_m.index._free_cols) > 0
    for r in (fresh_m, fresh_p):  # new locations take every free column: they start empty
        for n in range(free + 1):
            r.index.stored(f"new{n}", "host", "", b"f", chains[n % len(chains)][:1])
    _same_holdings(fresh_m, fresh_p)
    for req in _requests(rng, chains, 100):
        _same(fresh_m.route(req, dispatch=False, now=60.0), fresh_p.route(req, dispatch=False, now=60.0))
    with pytest.raises(ValueError, match="layout"):
        fresh_p.index.load_state(rm.state_arrays())
    with pytest.raises(ValueError, match="layout"):
        fresh_m.index.load_state(arrays)
    _same_holdings(fresh_m, fresh_p)  # a refused state changed nothing


@needs_c
def test_a_pairs_index_costs_what_its_pairs_cost_not_the_fleets_width() -> None:
    """Keys held by one location each, in an index of 2,000 locations' columns: about 10 bytes
    a pair at the table's load, where the matrix's rows are 32 words wide."""
    _, rp = _pair_of(RouterConfig())
    idx = rp.index
    for n in range(2000):
        idx.stored(f"n{n}", "host", "", b"f", [bytes([n % 256, n // 256]) + bytes(14)])
    rng = random.Random(2)
    keys = [rng.randbytes(16) for _ in range(200_000)]
    idx.stored("n0", "disk", "", b"f", keys)
    assert idx.columns >= 2000
    assert idx.nbytes() / len(idx) < 10 / pairs_mod.GROW_TO + 1


@needs_c
def test_a_snapshot_of_a_pairs_router_routes_as_the_router_saved() -> None:
    """Through the bytes an index snapshot stores (snapshot.state_bytes, then load_into: the
    arrays adopted as views of the bytes read back)."""
    from kvtier.client.routing import snapshot  # noqa: PLC0415

    rng = random.Random(11)
    rm, rp, chains = _clusters(rng, "default")
    data, _ = snapshot.state_bytes(rp)
    restarted = Router(RouterConfig(index_layout="pairs", index_strides="default"))
    snapshot.load_into(restarted, bytearray(data))
    assert restarted.positions() == rp.positions() and restarted.holdings() == rp.holdings()
    for req in _requests(rng, chains, 100):
        _same(rm.route(req, dispatch=False, now=70.0), restarted.route(req, dispatch=False, now=70.0))


@needs_c
def test_bad_arguments_raise_and_change_nothing() -> None:
    c = pairs_mod._cpairs
    t = pairs_mod.PairTable()
    t.insert([b"k" * 16], 5)
    before = (t.fps.copy(), t.cols.copy())
    bits = np.zeros((4, 1), dtype=np.uint64)
    for call, err in [
        (lambda: c.insert(t.fps, t.cols, [b"a", "not bytes"], 3), TypeError),
        (lambda: c.insert(t.fps, t.cols, [b"a"], 70000), ValueError),
        (lambda: c.insert(t.fps.astype(np.uint32), t.cols, [b"a"], 3), ValueError),
        (lambda: c.insert(t.fps, t.cols[:-1], [b"a"], 3), ValueError),
        (lambda: c.gather(t.fps, t.cols, [b"a"] * 4, bits, 1, 1, None), ValueError),  # rows 1..4 of 4
        (lambda: c.gather(t.fps, t.cols, [b"a"], bits, 0, 1, None), ValueError),
        (lambda: c.gather(t.fps, t.cols, [b"a"], bits, 1, 1, np.zeros(2, dtype=np.int64)), ValueError),
        (lambda: c.remove(t.fps, t.cols, 5, 3), TypeError),
        (lambda: c.rehash(t.fps, t.cols, np.zeros(16, dtype=np.uint64), np.zeros(8, dtype=np.uint16)), ValueError),
    ]:
        with pytest.raises(err):
            call()
    full_f, full_c = np.ones(16, dtype=np.uint64), np.ones(16, dtype=np.uint16)
    with pytest.raises(RuntimeError, match="full"):
        c.insert(full_f, full_c, [b"x" * 16], 3)
    assert (t.fps == before[0]).all() and (t.cols == before[1]).all()
    assert c.insert(t.fps, t.cols, [b"a"], 3) == 1  # (the "a" of the first refused call was not added)

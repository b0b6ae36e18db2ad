"""The compiled decision (client/routing/_route.c) against the numpy path it replaces: built by
the install, and on random clusters (several nodes and workers, gpu/host/disk/remote holdings,
removals, speculative entries, published bandwidths, loads with ties) every decision equal:
rows, holdings, costs, saved blocks, the order (ties included), fetch hints, dispatch."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from kvtier.client.routing import index as index_mod
from kvtier.client.routing import rowtable as rowtable_mod
from kvtier.client.routing import scoring as scoring_mod
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.routing.scoring import Scorer, worker_digests
from kvtier.proto import locations_pb2 as L
from kvtier.proto import node_pb2 as N

needs_c = pytest.mark.skipif(index_mod._croute is None, reason="the compiled decision is not built")
FP = bytes(range(16))


@contextlib.contextmanager
def numpy_path():
    """Route with numpy (the fallback) inside the block."""
    saved = index_mod._croute, scoring_mod._croute, rowtable_mod._croute
    index_mod._croute = scoring_mod._croute = rowtable_mod._croute = None
    try:
        yield
    finally:
        index_mod._croute, scoring_mod._croute, rowtable_mod._croute = saved


def test_the_install_built_the_compiled_decision() -> None:
    """pip install (editable too) compiles client/routing/_route.c; routers use it by default."""
    assert index_mod._croute is not None, "kvtier.client.routing._route is missing: the install did not build it"
    assert scoring_mod._croute is index_mod._croute is rowtable_mod._croute


def _feeds(rng: random.Random, n_nodes: int, n_workers: int, chains: list[list[bytes]],
           one_batch: bool = False) -> dict[str, list]:
    """Feed messages of a random cluster holding random leading parts of the chains (with
    ``one_batch``, all of a node's events in one message: the fold's large-batch path)."""
    node_of = {f"w{w}": f"n{w % n_nodes}" for w in range(n_workers)}
    feeds: dict[str, list] = {}
    for n in range(n_nodes):
        node = f"n{n}"
        info = L.NodeInfo(node_id=node, epoch=1)
        for w, nd in node_of.items():
            if nd == node:
                info.workers.add(worker_id=w, fingerprints=[FP])
        info.tiers.add(tier=N.TIER_HOST, capacity_bytes=1 << 40, load_gbps=rng.choice([0.0, 20.0, 50.0, 300.0]))
        info.tiers.add(tier=N.TIER_DISK, capacity_bytes=1 << 43, load_gbps=rng.choice([0.0, 1.0, 2.0, 200.0]))
        if rng.random() < 0.7:  # the others cannot pull
            info.tiers.add(tier=N.TIER_REMOTE, load_gbps=rng.choice([0.0, 10.0, 100.0]))
        feeds[node] = [L.WatchLocationsReply(epoch=1, node=info),
                       L.WatchLocationsReply(epoch=1, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True))]
    seqs = dict.fromkeys(feeds, 0)
    for chain in chains:
        for _ in range(rng.randint(0, 4)):
            w = f"w{rng.randrange(n_workers)}"
            node = node_of[w]
            length = rng.randint(1, len(chain))
            cuts = sorted(rng.randint(0, length) for _ in range(3))
            batch = L.EventBatch()
            for tier, lo, hi, who in ((N.TIER_GPU, 0, cuts[0], w), (N.TIER_HOST, cuts[0], cuts[1], ""),
                                      (N.TIER_DISK, cuts[1], cuts[2], ""), (N.TIER_REMOTE, cuts[2], length, "")):
                if hi > lo:
                    seqs[node] += 1
                    batch.events.add(seq=seqs[node], kind=L.STORED, tier=tier, worker_id=who, fingerprint=FP,
                                     keys=chain[lo:hi])
            if rng.random() < 0.2 and cuts[1] > cuts[0]:  # a hole in the host part
                seqs[node] += 1
                mid = rng.randint(cuts[0], cuts[1] - 1)
                batch.events.add(seq=seqs[node], kind=L.REMOVED, tier=N.TIER_HOST, fingerprint=FP,
                                 keys=chain[mid:mid + 1])
            if batch.events:
                batch.head_seq = seqs[node]
                feeds[node].append(L.WatchLocationsReply(epoch=1, events=batch))
    return {node: _one_batch(msgs) for node, msgs in feeds.items()} if one_batch else feeds


def _one_batch(msgs: list) -> list:
    """A node's NodeInfo and snapshot, then all its event batches as one."""
    whole = L.EventBatch()
    for m in msgs[2:]:
        whole.events.extend(m.events.events)
        whole.head_seq = m.events.head_seq
    return msgs[:2] + ([L.WatchLocationsReply(epoch=1, events=whole)] if whole.events else [])


def _requests(rng: random.Random, chains: list[list[bytes]], count: int) -> list[list[bytes]]:
    out = []
    for i in range(count):
        chain = rng.choice(chains)
        kind = i % 5
        if kind == 0:
            out.append(list(chain))
        elif kind == 1:  # a leading part, then new keys
            cut = rng.randint(0, len(chain))
            out.append(chain[:cut] + [rng.randbytes(16) for _ in range(rng.randint(0, 12))])
        elif kind == 2:  # parts of two chains
            other = rng.choice(chains)
            out.append(chain[:rng.randint(1, len(chain))] + other[:rng.randint(0, len(other))])
        elif kind == 3:  # a key of zeros, or of another length, inside
            req = list(chain[:rng.randint(1, len(chain))])
            req.insert(rng.randint(0, len(req)), bytes(16) if rng.random() < 0.5 else b"odd-length-key")
            out.append(req)
        else:
            out.append([])
    return out


def _routers(rng: random.Random, n_nodes: int, n_workers: int, n_chains: int,
             one_batch: bool = False, strides: str = "") -> tuple[Router, Router, list]:
    chains = [[rng.randbytes(16) for _ in range(rng.randint(1, 40))] for _ in range(n_chains)]
    feeds = _feeds(rng, n_nodes, n_workers, chains, one_batch)
    cfg = RouterConfig(top_k=rng.choice([1, 3, 8, 100]), index_strides=strides)
    routers = Router(cfg), Router(cfg)
    for node, msgs in feeds.items():
        for msg in msgs:
            routers[0].apply(node, msg)
            with numpy_path():
                routers[1].apply(node, msg)
    assert routers[0].holdings() == routers[1].holdings()
    return routers[0], routers[1], chains


def _same(dc, dn) -> None:
    assert dc.workers == dn.workers
    assert dc.ranked == dn.ranked  # costs, saved blocks, overlaps, loads: exactly
    assert dc.fetch == dn.fetch
    assert dc.decision_id == dn.decision_id


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_numpy_decisions_agree_on_random_clusters(seed: int) -> None:
    rng = random.Random(seed)
    n_workers = rng.choice([1, 3, 8, 64, 70])
    rc, rn, chains = _routers(rng, rng.randint(1, 5), n_workers, 60, one_batch=seed % 2 == 1)
    workers = [w for w, _ in rc.workers()]
    now = 100.0
    for i, req in enumerate(_requests(rng, chains, 300)):
        now += rng.choice([0.0, 0.01, 3.0])
        cand = rng.sample(workers, rng.randint(1, len(workers))) if i % 7 == 3 else None
        top_k = rng.choice([None, 1, 2, len(workers), 20])
        dispatch = i % 3 != 0
        if i % 11 == 5:  # an engine's report: loads tie, then differ
            w = rng.choice(workers)
            q, a = float(rng.randint(0, 3)), float(rng.randint(0, 2))
            rc.set_load(w, q, a, now)
            rn.set_load(w, q, a, now)
        dc = rc.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        with numpy_path():
            dn = rn.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        _same(dc, dn)
        if dispatch and i % 4 == 0:
            assert rc.finish(dc.decision_id) == rn.finish(dn.decision_id)
    assert rc.holdings() == rn.holdings()
    assert rc.index.locations(speculative=True) == rn.index.locations(speculative=True)


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_candidates_naming_every_worker_take_the_compiled_decision(seed: int) -> None:
    """A gateway names every worker as candidates (in its own order): the one compiled call
    decides, with the numpy selection's answers (rows, holdings, costs and saved blocks to the
    bit, the order, fetch hints, dispatch, speculative entries)."""
    rng = random.Random(50 + seed)
    n_workers = [8, 70, 12][seed]
    rc, rn, chains = _routers(rng, rng.randint(1, 5), n_workers, 60, one_batch=seed % 2 == 1)
    workers = [w for w, _ in rc.workers()]
    now, fused = 100.0, 0
    for i, req in enumerate(_requests(rng, chains, 300)):
        now += rng.choice([0.0, 0.01, 3.0])
        cand = rng.sample(workers, len(workers)) if i % 2 else list(workers)
        top_k = rng.choice([None, 1, len(workers)])
        dispatch = i % 3 != 0
        if i % 11 == 5:
            w = rng.choice(workers)
            q, a = float(rng.randint(0, 3)), float(rng.randint(0, 2))
            rc.set_load(w, q, a, now)
            rn.set_load(w, q, a, now)
        dc = rc.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        with numpy_path():
            dn = rn.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        _same(dc, dn)
        fused += isinstance(dc._arrays, bytes)  # the compiled decision's
        if dispatch and i % 4 == 0:
            assert rc.finish(dc.decision_id) == rn.finish(dn.decision_id)
    assert fused > 200
    assert rc.holdings() == rn.holdings()
    assert rc.index.locations(speculative=True) == rn.index.locations(speculative=True)


SPARSE = ["host=2,disk=3", "host=4", "disk=5", "default", "host=3,disk=3", "host=8,disk=16"]


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_numpy_decisions_agree_with_sparse_deep_tiers(seed: int) -> None:
    """With ``index_strides`` the compiled decision walks the sparse host and disk runs itself
    (_route.c sparse()): the same decisions as the numpy walk (LocationIndex._sparse_walk)."""
    rng = random.Random(100 + seed)
    n_workers = rng.choice([1, 3, 8, 64, 70])
    rc, rn, chains = _routers(rng, rng.randint(1, 5), n_workers, 60, one_batch=seed % 2 == 1,
                              strides=SPARSE[seed % len(SPARSE)])
    workers = [w for w, _ in rc.workers()]
    now = 100.0
    walked = 0
    for i, req in enumerate(_requests(rng, chains, 300)):
        now += rng.choice([0.0, 0.01, 3.0])
        cand = rng.sample(workers, rng.randint(1, len(workers))) if i % 7 == 3 else None
        top_k = rng.choice([None, 1, 2, len(workers), 20])
        dispatch = i % 3 != 0
        dc = rc.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        with numpy_path():
            dn = rn.route(req, cand, dispatch=dispatch, top_k=top_k, now=now)
        _same(dc, dn)
        walked += any(r.overlap.host > 0 for r in dn.ranked)
        if dispatch and i % 4 == 0:
            assert rc.finish(dc.decision_id) == rn.finish(dn.decision_id)
    assert walked > 20  # the walks found host or disk runs
    assert rc.holdings() == rn.holdings()
    assert rc.index.locations(speculative=True) == rn.index.locations(speculative=True)


@needs_c
@pytest.mark.parametrize("table", ["byte table", "each worker's columns"])
@pytest.mark.parametrize("strides", SPARSE)
def test_compiled_sparse_holdings_match_the_numpy_walk(strides: str, table: str, monkeypatch) -> None:
    """LocationIndex.holdings with sparse deep tiers, every worker and selections of them,
    pulls on and off: the compiled walk's leads are the numpy walk's, over the plan's byte
    table and, for plans too wide for one, over each worker's columns (sparse_cols)."""
    if table != "byte table":
        monkeypatch.setattr(index_mod, "_TABLE_LIMIT", 0)
    rng = random.Random(sum(map(ord, strides)))
    rc, _, chains = _routers(rng, 4, 12, 80, strides=strides)
    idx = rc.index
    n_w = len(idx.plan().workers)
    longer = 0
    for req in _requests(rng, chains, 300):
        fc = idx.rows(req)
        sel = None if rng.random() < 0.5 else np.asarray(rng.sample(range(n_w), rng.randint(1, n_w)), dtype=np.int64)
        for remote in (True, False):
            hc = idx.holdings(fc, sel, remote)
            with numpy_path():
                fn = idx.rows(req)
                hn = idx.holdings(fn, sel, remote)
            assert hc.dtype == hn.dtype and hc.tolist() == hn.tolist(), (strides, req)
            longer += int((hn[2] > fn.indexed).any())
    assert longer  # some walks went past the first key not indexed


@needs_c
@pytest.mark.parametrize("table", ["byte table", "each worker's columns"])
def test_compiled_rows_and_holdings_match_numpy(table: str, monkeypatch) -> None:
    """Holdings compiled over the plan's byte table, or (plans too wide for one) over each
    worker's columns (lead_cols), are numpy's: every worker and selections, pulls on and off."""
    if table != "byte table":
        monkeypatch.setattr(index_mod, "_TABLE_LIMIT", 0)
    rng = random.Random(7)
    rc, _, chains = _routers(rng, 3, 12, 80)
    idx = rc.index
    n_w = len(idx.plan().workers)
    remote_only = 0
    for req in _requests(rng, chains, 400):
        fc = idx.rows(req)
        with numpy_path():
            fn = idx.rows(req)
        assert fc.indexed == fn.indexed
        assert fc.rows.tolist() == fn.rows.tolist()
        sel = None if rng.random() < 0.5 else np.asarray(rng.sample(range(n_w), rng.randint(1, n_w)), dtype=np.int64)
        for remote in (True, False):
            hc = idx.holdings(fc, sel, remote)
            with numpy_path():
                hn = idx.holdings(fn, sel, remote)
            assert hc.dtype == hn.dtype and hc.tolist() == hn.tolist()
            remote_only += int((hn[3] > hn[2]).any())
    assert remote_only  # some leads counted a peer's or the store's blocks


@needs_c
def test_compiled_rank_matches_costs_and_order_with_ties() -> None:
    """Equal costs (to 1e-9, and values a rounding splits), equal loads, equal tie hashes
    (a repeated worker name): the compiled order is numpy's lexsort order."""
    rng = np.random.default_rng(3)
    scorer = Scorer()
    for trial in range(400):
        w = int(rng.integers(1, 80))
        names = [f"w{int(x)}" for x in rng.integers(0, max(1, w // 2), size=w)]  # repeats: equal digests
        dig = worker_digests(names)
        lead = np.sort(rng.integers(0, 6, size=(4, w)), axis=0)
        weights = rng.choice([0.0, 0.25, 1 / 3, 0.5, 1.0, 0.1 + 1e-10], size=(4, w))
        q = rng.choice([0.0, 1.0, 2.5], size=w)
        a = rng.choice([0.0, 1.0], size=w)
        lc = scorer.load_cost(q, a) + rng.choice([0.0, 1e-10, 4e-10, 6e-10], size=w)
        n = int(rng.integers(0, 10))
        key = rng.bytes(16)
        top_k = [None, 1, 3, w, 17, 40][trial % 6]
        if trial % 2:  # a selection of workers' columns is Fortran-ordered (einsum adds it otherwise)
            weights = np.asfortranarray(weights)
        cost, saved, order = scorer.rank(n, lead, lc, weights, q, a, dig, key, top_k)
        cn, sn = scorer.costs(n, lead, lc, weights)
        on = scorer.order(cn, q, a, dig, key, top_k).tolist()
        assert order == on
        assert cost.tobytes() == cn.tobytes() and saved.tobytes() == sn.tobytes()


@needs_c
def test_compiled_fold_of_large_batches_matches_numpy() -> None:
    """Batches of thousands of keys (repeated keys, removals, keys of zeros and of other
    lengths): the same locations, the same rows for every key."""
    rng = random.Random(11)
    chains = [[rng.randbytes(16) for _ in range(rng.randint(1, 60))] for _ in range(400)]
    chains.append([bytes(16), b"short", *chains[0][:3]])
    feeds = _feeds(rng, 3, 9, chains, one_batch=True)
    assert max(sum(len(e.keys) for e in m.events.events) for msgs in feeds.values() for m in msgs[2:]) > 2000
    rc, rn = Router(), Router()
    for node, msgs in feeds.items():
        for msg in msgs:
            rc.apply(node, msg)
            with numpy_path():
                rn.apply(node, msg)
    assert rc.holdings() == rn.holdings()
    keys = [k for c in chains for k in c]
    assert rc.index.rows(keys).rows.tolist() == rn.index.rows(keys).rows.tolist()
    assert rc.index._removals == rn.index._removals  # removed events (compiled: unset()) count alike


# -- hostile inputs ----------------------------------------------------------------------------
# Each hostile call must raise a clean exception, never crash or read outside its arrays: the
# checks run in a child process, so a crash fails the test instead of killing the run.

def _in_child(fn: str) -> None:
    import os
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_route_compiled as t; "
            f"t.{fn}()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _raises(f, errors=(TypeError, ValueError, BufferError)) -> None:
    try:
        f()
    except errors:
        return
    raise AssertionError("no error")


def hostile_route_calls() -> None:
    from kvtier.client.routing import _route
    from kvtier.client.routing.rowtable import RowTable

    t = RowTable(64)
    keys = [bytes([i + 1]) * 16 for i in range(5)]
    t.insert(keys, np.arange(1, 6, dtype=np.int64))
    out = np.empty(len(keys) + 2, dtype=np.int64)
    assert _route.rows(keys, t.slots, t.tags, t.packed, 6, t._shift_i, out) == 5 and out[1:6].tolist() == [1, 2, 3, 4, 5]

    # wrong dtypes, non-contiguous or short arrays: refused before anything is read
    for i, bad in ((1, t.slots.astype(np.int64)), (1, t.slots.astype(np.float32)), (2, t.tags.astype(np.int32)),
                   (6, np.empty(7)), (6, np.empty(7, np.int32)), (6, np.empty(14, np.int64)[::2]),
                   (6, np.empty(6, np.int64)), (6, b"\0" * 56), (1, t.slots[::2])):
        args = [keys, t.slots, t.tags, t.packed, 6, t._shift_i, out]
        args[i] = bad
        _raises(lambda a=args: _route.rows(*a))
    for shift, high in ((t._shift_i + 1, 6), (0, 6), (64, 6), (t._shift_i, 10**6), (t._shift_i, 1 << 63)):
        _raises(lambda s=shift, h=high: _route.rows(keys, t.slots, t.tags, t.packed, h, s, out),
                (TypeError, ValueError, OverflowError))
    # a slot naming a row beyond packed (a corrupt table): never read, the key is not indexed
    slots, tags = t.slots.copy(), t.tags.copy()
    slots[slots >= 0] = 2**31 - 1
    assert _route.rows(keys, slots, tags, t.packed, 6, t._shift_i, out) == 0 and (out[1:6] == -1).all()

    class Clears:  # an int whose conversion empties the key list (checked keys must be re-checked)
        def __init__(self, v: int, victim: list) -> None:
            self.v, self.victim = v, victim

        def __index__(self) -> int:
            self.victim.clear()
            return self.v

    victim = list(keys)
    got = _route.rows(victim, t.slots, t.tags, t.packed, Clears(6, victim), t._shift_i, out)
    assert got == 0
    victim = list(keys)
    assert _route.insert(victim, np.arange(20, 25, dtype=np.int64), t.packed, t.live, t.slots.copy(),
                         t.tags.copy(), Clears(t._shift_i, victim)) == 1

    # rank: top_k 0 (an insertion sort must not read or write e[-1]), no workers, bad arrays
    w = 3
    lead, wt = np.zeros((4, w), np.int64), np.ones((4, w))
    lc, q, a = np.zeros(w), np.zeros(w), np.zeros(w)
    dig, cost, saved = np.arange(w, dtype=np.uint64), np.empty(w), np.empty(w)
    base = [10, lead, wt, lc, q, a, dig, 5, 2, cost, saved, False]
    assert len(_route.rank(*base)) == 2
    for k in (0, -1, -5, 10**6):
        args = list(base)
        args[8] = k
        assert sorted(_route.rank(*args)) == ([] if k == 0 else list(range(w))), k
    z = [np.zeros((4, 0), np.int64), np.ones((4, 0)), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0, np.uint64)]
    assert _route.rank(10, *z, 5, 3, np.empty(0), np.empty(0), False) == []
    for i, bad in ((1, lead.astype(np.float64)), (2, wt.astype(np.int64)), (6, dig.astype(np.float64)),
                   (1, np.zeros((4, 2 * w), np.int64)[:, ::2]), (3, np.zeros(w + 1)), (9, b"\0" * 24),
                   (10, np.empty(w, np.float32)), (0, "10")):
        args = list(base)
        args[i] = bad
        _raises(lambda a=args: _route.rank(*a))

    # lead: m, nwords, n_workers far beyond the buffers (sizes whose products overflow)
    bits = np.zeros((8, 1), np.uint64)
    table = np.zeros((2048, 4), np.uint64)
    rows = np.array([-1, 1, 2, -1], np.int64)
    lout = np.empty((4, 2), np.int64)
    _route.lead(rows, 2, bits, 1, table, 2, True, lout)
    for m_, nw, nwk in ((1 << 62, 1, 2), (3, 1, 2), (0, 1, 2), (2, 1 << 60, 2), (2, 0, 2), (2, 1, (1 << 63) - 1),
                        (2, 1, 65), (2, 1, 0), (2, 1, 3)):
        _raises(lambda m_=m_, nw=nw, nwk=nwk: _route.lead(rows, m_, bits, nw, table, nwk, True, lout))
    _raises(lambda: _route.lead(np.array([-1, 99, -1], np.int64), 1, bits, 1, table, 2, True, lout))


    # set_bit: a count beyond rows, a column beyond the words, rows outside the matrix
    for nw, cnt, col, rr in ((1, 1 << 61, 0, rows[1:3]), (1, 2, 64, rows[1:3]), (1, 2, -1, rows[1:3]),
                             (1 << 60, 1, 0, rows[1:3]), (1, 1, 0, np.array([8], np.int64)),
                             (1, 1, 0, np.array([1], np.int32)), (1, -1, 0, rows[1:3])):
        _raises(lambda nw=nw, cnt=cnt, col=col, rr=rr: _route.set_bit(bits, nw, rr, cnt, col))
    assert not bits.any()
    # insert / place: rows outside the table, a key list that is not one
    _raises(lambda: _route.insert(keys[:1], np.array([1 << 40], np.int64), t.packed, t.live, t.slots, t.tags,
                                  t._shift_i))
    _raises(lambda: _route.insert(tuple(keys), np.arange(5, dtype=np.int64), t.packed, t.live, t.slots, t.tags,
                                  t._shift_i))
    _raises(lambda: _route.place(np.array([-1], np.int64), t.packed, t.slots, t.tags, t._shift_i))
    _raises(lambda: _route.place(np.array([1], np.int64), t.packed, t.slots, t.tags.astype(np.int64), t._shift_i))


def hostile_sparse_calls() -> None:
    """sparse(): sizes beyond the buffers, bad strides, leads beyond the keys, rows outside the
    matrix, a wrongly typed lead; unset(): a column or words beyond the matrix, a row beyond it,
    a table that does not match: refused, never a write outside the arrays."""
    from kvtier.client.routing import _route
    from kvtier.client.routing.rowtable import RowTable

    t = RowTable(64)
    keys = [bytes([i + 1]) * 16 for i in range(5)]
    t.insert(keys, np.arange(1, 6, dtype=np.int64))
    m = np.full((8, 1), ~np.uint64(0), np.uint64)
    assert _route.unset(keys[:2] + [bytes(16)], t.slots, t.tags, t.packed, 6, t._shift_i, m, 1, 3) == 2
    assert m[1:3, 0].tolist() == [2**64 - 1 - 8] * 2 and (m[3:, 0] == ~np.uint64(0)).all()
    assert _route.unset(keys + [b"short"], t.slots, t.tags, t.packed, 6, t._shift_i, m, 1, 3) == -1
    for nw, col, mat in ((1, 64, m), (1, -1, m), (2, 0, m), (0, 0, m), (1 << 60, 0, m), (1, 0, m.astype(np.int32)),
                         (1, 0, m[:2])):
        _raises(lambda nw=nw, col=col, mat=mat: _route.unset(keys, t.slots, t.tags, t.packed, 6, t._shift_i, mat, nw,
                                                             col))
    _raises(lambda: _route.unset(keys, t.slots, t.tags, t.packed, 6, t._shift_i + 1, m, 1, 0))
    _raises(lambda: _route.unset(tuple(keys), t.slots, t.tags, t.packed, 6, t._shift_i, m, 1, 0))

    bits = np.zeros((8, 1), np.uint64)
    table = np.zeros((2048, 4), np.uint64)
    rows = np.array([-1, 1, 2, -1], np.int64)
    sl = np.zeros((4, 2), np.int64)
    _route.sparse(rows, 2, bits, 1, table, 2, 2, 4, sl)
    for n_, nw, nwk, kh, ka in ((1 << 62, 1, 2, 2, 4), (3, 1, 2, 2, 4), (-1, 1, 2, 2, 4), (2, 1 << 60, 2, 2, 4),
                                (2, 0, 2, 2, 4), (2, 1, (1 << 63) - 1, 2, 4), (2, 1, 65, 2, 4), (2, 1, 0, 2, 4),
                                (2, 1, 3, 2, 4), (2, 1, 2, 0, 4), (2, 1, 2, 4, 2), (2, 1, 2, -1, -1)):
        _raises(lambda n_=n_, nw=nw, nwk=nwk, kh=kh, ka=ka: _route.sparse(rows, n_, bits, nw, table, nwk, kh, ka, sl))
    _raises(lambda: _route.sparse(rows, 2, bits, 1, table, 2, 2, 4, np.full((4, 2), 3, np.int64)))
    _raises(lambda: _route.sparse(rows, 2, bits, 1, table, 2, 2, 4, np.full((4, 2), -1, np.int64)))
    _raises(lambda: _route.sparse(np.array([-1, 99, -1], np.int64), 1, bits, 1, table, 2, 2, 4, sl))
    _raises(lambda: _route.sparse(rows, 2, bits, 1, table, 2, 2, 4, sl.astype(np.int32)))
    fast = np.arange(2, 12, dtype=np.int64).reshape(5, 2)  # sparse_cols(): each worker's columns
    _route.sparse_cols(rows, 2, bits, 1, fast, 2, 2, 4, sl)
    for n_, nw, nwk, kh, ka in ((1 << 62, 1, 2, 2, 4), (3, 1, 2, 2, 4), (-1, 1, 2, 2, 4), (2, 1 << 60, 2, 2, 4),
                                (2, 0, 2, 2, 4), (2, 1, 3, 2, 4), (2, 1, -1, 2, 4), (2, 1, 2, 0, 4), (2, 1, 2, 4, 2)):
        _raises(lambda n_=n_, nw=nw, nwk=nwk, kh=kh, ka=ka: _route.sparse_cols(rows, n_, bits, nw, fast, nwk, kh, ka,
                                                                               sl))
    _raises(lambda: _route.sparse_cols(rows, 2, bits, 1, fast + 60, 2, 2, 4, sl))  # a column beyond the words
    _raises(lambda: _route.sparse_cols(rows, 2, bits, 1, -fast, 2, 2, 4, sl))
    _raises(lambda: _route.sparse_cols(np.array([-1, 99, -1], np.int64), 1, bits, 1, fast, 2, 2, 4, sl))
    _raises(lambda: _route.sparse_cols(rows, 2, bits, 1, fast, 2, 2, 4, np.full((4, 2), 3, np.int64)))
    rsel, rmask = np.zeros(2, np.int64), np.zeros((1, 1), np.uint64)  # lead_cols(): holdings over the columns
    _route.lead_cols(rows, 2, bits, 1, fast, rsel, rmask, True, sl)
    assert sl.tolist() == [[0, 0]] * 4
    for m_, nw in ((1 << 62, 1), (3, 1), (-1, 1), (2, 1 << 60), (2, 0), (2, 2)):
        _raises(lambda m_=m_, nw=nw: _route.lead_cols(rows, m_, bits, nw, fast, rsel, rmask, True, sl))
    _raises(lambda: _route.lead_cols(rows, 2, bits, 1, fast + 60, rsel, rmask, True, sl))
    _raises(lambda: _route.lead_cols(rows, 2, bits, 1, fast, rsel + 1, rmask, True, sl))  # no such mask
    _raises(lambda: _route.lead_cols(rows, 2, bits, 1, fast, rsel[:1], rmask, True, sl))
    _raises(lambda: _route.lead_cols(np.array([-1, 99, -1], np.int64), 1, bits, 1, fast, rsel, rmask, True, sl))
    _raises(lambda: _route.lead_cols(rows, 2, bits, 1, fast, rsel, rmask, True, sl.astype(np.int32)))


@needs_c
def test_hostile_route_calls_raise_never_crash() -> None:
    _in_child("hostile_route_calls")


@needs_c
def test_hostile_sparse_calls_raise_never_crash() -> None:
    _in_child("hostile_sparse_calls")


@needs_c
def test_scorer_rank_with_top_k_zero_matches_numpy() -> None:
    """Scorer.rank(top_k=0): no workers, as numpy's order gives (the compiled selection read and
    wrote the entry before its array)."""
    sc = Scorer()
    w = 5
    args = (10, np.zeros((4, w), np.int64), np.zeros(w), np.ones((4, w)), np.zeros(w), np.zeros(w),
            worker_digests([f"w{i}" for i in range(w)]), b"k" * 16)
    with numpy_path():
        want = sc.rank(*args, top_k=0)[2]
    assert want == [] and sc.rank(*args, top_k=0)[2] == want


# -- what a buggy or hostile daemon publishes ------------------------------------------------------

_FP = bytes(range(16))


def _info(node: str, workers: list[str], host: float = 0.0) -> list:
    i = L.NodeInfo(node_id=node, epoch=1)
    for w in workers:
        i.workers.add(worker_id=w, fingerprints=[_FP])
    i.tiers.add(tier=N.TIER_HOST, capacity_bytes=1 << 40, load_gbps=host)
    i.tiers.add(tier=N.TIER_DISK, capacity_bytes=1 << 40, load_gbps=0.0)
    return [L.WatchLocationsReply(epoch=1, node=i),
            L.WatchLocationsReply(epoch=1, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True))]


def _stored(tier: int, keys: list[bytes], worker: str = "") -> L.WatchLocationsReply:
    b = L.EventBatch(head_seq=1)
    b.events.add(seq=1, kind=L.STORED, tier=tier, worker_id=worker, fingerprint=_FP, keys=keys)
    return L.WatchLocationsReply(epoch=1, events=b)


def _both(msgs: dict[str, list]) -> tuple[Router, Router]:
    rc, rn = Router(RouterConfig()), Router(RouterConfig())
    for node, ms in msgs.items():
        for m in ms:
            rc.apply(node, m)
            with numpy_path():
                rn.apply(node, m)
    return rc, rn


def test_a_nan_bandwidth_is_taken_as_unknown_on_both_paths() -> None:
    """A daemon publishing NaN as a tier's bandwidth: the router uses the default for it (the
    worker's costs stay numbers, the compiled and numpy paths agree, and a dispatch there
    leaves a finite load), instead of a NaN cost that the compiled sort kept first."""
    keys = [bytes([i + 1]) * 16 for i in range(8)]
    rc, rn = _both({"a": _info("a", ["wa"], host=float("nan")) + [_stored(N.TIER_HOST, keys[:2])],
                    "b": _info("b", ["wb"]) + [_stored(N.TIER_GPU, keys, "wb")]})
    dc = rc.route(keys, dispatch=False)
    with numpy_path():
        dn = rn.route(keys, dispatch=False)
    assert all(np.isfinite(r.cost) for r in dc.ranked)
    assert [r.worker for r in dc.ranked] == [r.worker for r in dn.ranked] == ["wb", "wa"]
    for _ in range(3):  # dispatched where it goes: every load stays a number
        rc.route(keys[:2], now=1.0)
    assert all(np.isfinite(rc.load(w).queued_blocks) for w in ("wa", "wb"))


def test_a_worker_name_declared_by_two_nodes_is_routed_as_the_first_nodes() -> None:
    """Node b declares wb; node a (sorted first) declares a worker also named wb: one worker
    wb (node a's), not two copies sharing a name (one of which was never charged load)."""
    rc, _ = _both({"a": _info("a", ["wa", "wb"]), "b": _info("b", ["wb"])})
    assert sorted(rc.workers()) == [("wa", "a"), ("wb", "a")]


def test_a_key_over_255_bytes_does_not_break_saving_the_state(tmp_path) -> None:
    """The saved state's key lengths were uint8: a 300-byte key from a daemon made saving
    raise OverflowError (and the periodic save stopped). It saves, and loads back."""
    long_key = b"k" * 300
    rc, _ = _both({"a": _info("a", ["wa"]) + [_stored(N.TIER_HOST, [b"s" * 16, long_key])]})
    path = str(tmp_path / "state.npz")
    rc.save_state(path)
    again = Router(RouterConfig())
    again.load_state(path)
    assert len(again.index) == len(rc.index) == 2


def test_a_build_of_other_sources_is_not_called(monkeypatch, caplog) -> None:
    """An extension built from older sources (a checkout updated without rebuilding) states
    another interface, or none: the router takes the numpy path and says to rebuild, instead
    of failing mid-fold on arguments the build does not take."""
    import sys
    import types

    from kvtier.client.routing import compiled

    built = compiled.load_route()
    assert built is not None and built.ABI == compiled.ROUTE_ABI, "the extension built here is current"
    for abi in (None, compiled.ROUTE_ABI - 1):
        stale = types.ModuleType("kvtier.client.routing._route")
        if abi is not None:
            stale.ABI = abi
        monkeypatch.setitem(sys.modules, "kvtier.client.routing._route", stale)
        monkeypatch.setattr(compiled, "_warned", False)
        with caplog.at_level("WARNING", logger="kvtier.router"):
            assert compiled.load_route() is None
        assert "rebuild it with `pip install -e .`" in caplog.text
        caplog.clear()

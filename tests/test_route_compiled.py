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
             one_batch: bool = False) -> tuple[Router, Router, list]:
    chains = [[rng.randbytes(16) for _ in range(rng.randint(1, 40))] for _ in range(n_chains)]
    feeds = _feeds(rng, n_nodes, n_workers, chains, one_batch)
    cfg = RouterConfig(top_k=rng.choice([1, 3, 8, 100]))
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
def test_compiled_rows_and_holdings_match_numpy() -> None:
    rng = random.Random(7)
    rc, _, chains = _routers(rng, 3, 12, 80)
    idx = rc.index
    for req in _requests(rng, chains, 400):
        fc = idx.rows(req)
        with numpy_path():
            fn = idx.rows(req)
        assert fc.indexed == fn.indexed
        assert fc.rows.tolist() == fn.rows.tolist()
        for remote in (True, False):
            hc = idx.holdings(fc, None, remote)
            with numpy_path():
                hn = idx.holdings(fn, None, remote)
            assert hc.dtype == hn.dtype and hc.tolist() == hn.tolist()


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

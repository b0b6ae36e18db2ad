"""TierPolicy keeps seen counts as the values of its host and disk maps (no second map of every key).

A reference policy that keeps them the way the policy did before, in a separate ``seen`` dict
(the same class with its bookkeeping internals replaced by the former ones), and the policy
are driven through the same random sequences of every public operation, as the daemon's store
(decisions and facts, demotions in flight across other calls) and the replay (whole requests)
use them: every answer, every tier in recency order, every counter and every seen count must
be the same after each step.
"""

from __future__ import annotations

import gc
import itertools
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import pytest

from kvtier.tiers.policy import DISK, GPU, HOST, TierPolicy
from kvtier.tiers.vocab import TIERS


class SeparateSeen(TierPolicy):
    """The former bookkeeping: tiers map keys to None, counts live in one dict of all keys."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.seen_dict: dict[Hashable, int] = {}

    @property
    def seen(self) -> dict[Hashable, int]:  # type: ignore[override]
        return self.seen_dict

    def demotions(self, victims: Iterable[Hashable]) -> list[Hashable]:
        if self.capacity[DISK] == 0:
            return []
        disk, seen, need = self.tiers[DISK], self.seen_dict, self.demote_min_seen
        return [k for k in victims if k not in disk and seen.get(k, 0) >= need]

    def access(self, keys: Sequence[Hashable]) -> list:
        ranks = self.leading_ranks(keys)
        c = self.counts
        for r in ranks:
            c.hits[r.rank] += 1
        c.misses += len(keys) - len(ranks)
        self._see(keys)
        promoted = [k for k, r in zip(keys, ranks, strict=False) if r is DISK]
        if promoted:
            c.promotions += len(promoted)
            self._touch(DISK, promoted)
        self._write_through(HOST, keys)
        self._write_through(GPU, keys)
        return ranks

    def _see(self, keys: Iterable[Hashable]) -> None:
        seen = self.seen_dict
        for k in keys:
            seen[k] = seen.get(k, 0) + 1

    def _see_touch(self, tier: object, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        self._see(keys)
        self._touch(tier, keys)  # type: ignore[arg-type]

    def _touch(self, tier: object, keys: Iterable[Hashable]) -> None:
        od = self.tiers[tier]  # type: ignore[index]
        for k in keys:
            if k in od:
                od.move_to_end(k)
            else:
                od[k] = None

    def _pop(self, tier: object, keys: Iterable[Hashable]) -> None:
        od = self.tiers[tier]  # type: ignore[index]
        for k in keys:
            od.pop(k, None)

    def _forget(self, keys: Iterable[Hashable]) -> None:
        gpu, host, disk = (self.tiers[t] for t in TIERS)
        for k in keys:
            if k in self.seen_dict and k not in gpu and k not in host and k not in disk and k not in self._moving:
                del self.seen_dict[k]
                self.counts.dropped += 1


def _state(p: TierPolicy) -> tuple:
    c = p.counts
    return ([list(p.tiers[t]) for t in TIERS], dict(p.seen), sorted(p._moving),
            (c.hits, c.misses, c.evictions, c.demotions, c.promotions, c.dropped))


def _check_invariants(p: TierPolicy) -> None:
    host, disk, gpu, loose = p.tiers[HOST], p.tiers[DISK], p.tiers[GPU], p._loose
    assert all(v is None for v in gpu.values())
    assert all(host[k] == n for k, n in disk.items() if k in host)          # one count per key
    assert all(k not in host and k not in disk and n >= 1 for k, n in loose.items())
    assert all(k in p._moving or k in gpu for k in loose)                   # between calls


def _random_op(rng: random.Random, p: TierPolicy, keys: list[int], pending: list[list[int]]) -> tuple:
    """One public operation with random arguments; returns (name, answer)."""
    def some() -> list[int]:
        return [rng.choice(keys) for _ in range(rng.randrange(0, 7))]

    def write() -> None:  # a demotion in flight finishes, or a durable write
        ks = pending[0] if pending and rng.random() < 0.7 else some()
        return p.on_write(ks[: rng.randrange(0, len(ks) + 1)])

    def evict(tier: object) -> list:
        victims = list(itertools.islice(p.victims(tier, set(some())), rng.randrange(0, 5))) + some()[:1]
        demote = p.on_evict(tier, victims)
        if demote:
            pending.append(demote)
        return demote

    ops = {
        "commit": lambda: p.on_commit(iter(some())),
        "hit": lambda: p.on_hit(some()),
        "promote": lambda: p.on_promote(p.promotions(some())),
        "demotions": lambda: p.demotions(some() + list(itertools.islice(p.victims(HOST), 3))),
        "write": write,
        "evict_host": lambda: evict(HOST),
        "evict_disk": lambda: evict(DISK),
        "evict_gpu": lambda: evict(GPU),
        "end": lambda: p.on_demotion_end(pending.pop(0)) if pending else None,
        "remove": lambda: p.on_remove(rng.choice(TIERS), some()),
        "put": lambda: p.put(some(), durable=rng.random() < 0.3),
        "get": lambda: p.get(some()),
        "prefetch": lambda: p.prefetch(some()),
        "evict": lambda: p.evict(some()),
        "access": lambda: p.access(some()),
        "access_distinct": lambda: p.access(list(dict.fromkeys(some()))),
    }
    op = rng.choice(sorted(ops))
    return op, ops[op]()


CAPS = [None, 0, 1, 2, 3, 5, 8]


@pytest.mark.parametrize("seed", range(300))
def test_same_decisions_as_a_separate_seen_dict(seed: int) -> None:
    rng = random.Random(seed)
    caps = [rng.choice(CAPS) for _ in TIERS]
    min_seen = rng.choice((1, 2, 2, 3))
    new, ref = TierPolicy(*caps, demote_min_seen=min_seen), SeparateSeen(*caps, demote_min_seen=min_seen)
    keys = list(range(rng.choice((4, 8, 16))))
    pend_new: list[list[int]] = []
    pend_ref: list[list[int]] = []
    for step in range(200):
        s = rng.getstate()
        got = _random_op(rng, new, keys, pend_new)
        rng.setstate(s)
        want = _random_op(rng, ref, keys, pend_ref)
        assert got == want, (seed, step)
        assert _state(new) == _state(ref), (seed, step, got[0])
        assert pend_new == pend_ref
        if not pend_new:
            _check_invariants(new)
        for k in keys:
            assert new.seen.get(k) == ref.seen.get(k)
            assert (k in new.seen) == (k in ref.seen)
        assert len(new.seen) == len(ref.seen)


def test_access_drops_counts_like_before() -> None:
    """Dropped counts and restarts: a block longer than host in one request, host 0, gpu 0."""
    for caps in ((2, 3, 4), (0, 3, 4), (3, 0, 4), (2, 3, 0), (None, 3, 4)):
        new, ref = TierPolicy(*caps, demote_min_seen=2), SeparateSeen(*caps, demote_min_seen=2)
        for req in ([1, 2, 3, 4, 5], [1, 2], [1, 2, 6, 7, 8, 9], [1, 1, 2, 2], [9, 8, 7, 6, 5, 4, 3]):
            assert new.access(req) == ref.access(req)
            assert _state(new) == _state(ref), caps


def test_seen_is_a_read_only_view() -> None:
    p = TierPolicy(1, 2, 2, demote_min_seen=2)
    p.access([1, 2])
    p.access([1, 2])
    assert dict(p.seen) == {1: 2, 2: 2} and p.seen[1] == 2 and 3 not in p.seen
    with pytest.raises(KeyError):
        p.seen[3]
    with pytest.raises(TypeError):
        p.seen[1] = 5  # type: ignore[index]


def _traced(build: object) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        obj = build()  # type: ignore[operator]
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del obj
    return used


def test_no_second_map_of_every_key() -> None:
    """The policy's memory for a held host is its recency map, not a map more (the daemon's
    store: no gpu tier, host bounded by the caller)."""
    keys = [i.to_bytes(32, "little") for i in range(50_000)]

    def policy() -> TierPolicy:
        p = TierPolicy(0, None, None)
        for i in range(0, len(keys), 64):
            p.on_commit(keys[i:i + 64])
        return p

    def recency_map() -> OrderedDict:
        return OrderedDict.fromkeys(keys, 1)

    assert _traced(policy) < 1.05 * _traced(recency_map)

"""The host tier keeps no Python object per held block: a held entry is one
small int in ``HostTier.entries`` plus per-slot arrays, and ``get`` makes views of it. The views
of one entry share its pins and flags; an entry the tier gives up (a victim) keeps its own state
even when its slot is granted and committed again at once."""

from __future__ import annotations

import gc
import shutil
import tempfile
import tracemalloc

import pytest

from kvtier.tiers.host import HostTier

SLOT = 4096


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-hmem-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def put(t: HostTier, cls, names: list[bytes], block_bytes: int = SLOT, order=()):
    res = t.reserve(cls, names, block_bytes, order)
    res.backing.run()
    t.finish_eviction()
    for e in res.entries:
        assert e is not None and t.commit(e)
    return res


def test_held_blocks_cost_the_heap_no_object_each(shm) -> None:
    """20,000 held blocks: the tier's heap growth beyond the keys (made before) is the dict
    entry and one int per block (about 60 B here; 133 B when the tier kept an entry object per block)."""
    n = 20_000
    t = HostTier(shm, capacity=(n + 8) * SLOT, name_prefix="m")
    try:
        cls = t.size_class(SLOT)
        keys = [bytes(16) + i.to_bytes(16, "little") for i in range(n)]  # one layout fingerprint
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(0, n, 1000):
            res = t.reserve(cls, keys[i:i + 1000], SLOT)
            for e in res.entries:
                t.commit(e)
        del res, e
        gc.collect()
        per = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
        assert len(t.entries) == n
        assert per < 100, f"{per:.0f} B of heap per held block"
    finally:
        t.close()


def test_views_share_pins_and_removal(shm) -> None:
    t = HostTier(shm, capacity=4 * SLOT, name_prefix="v")
    try:
        cls = t.size_class(SLOT)
        put(t, cls, [b"a", b"b"])
        v1, v2 = t.get(b"a"), t.get(b"a")
        assert v1 == v2 and v1 is not v2 and hash(v1) == hash(v2) and v1 != t.get(b"b")
        t.pin(v1)
        assert v2.pins == 1
        assert [e.bkey for e in t.remove([b"a"])] == [b"a"]
        assert t.get(b"a") is None and v2.removed and v1.slot not in cls.free  # pinned: slot kept
        t.unpin(v2)                                   # the last pin, through the other view
        assert v1.slot in cls.free
        with pytest.raises(Exception, match="no pins|stale entry"):  # (the slot was freed: its generation moved)
            t.unpin(v1)
    finally:
        t.close()


def test_a_victim_keeps_its_state_when_its_slot_is_committed_again(shm) -> None:
    """A victim's slot goes to the new grant in the same reserve: while the victim is demoted
    (before finish_eviction) it reads its own checksum, and after the new block's commit still
    its own block bytes and flags, not the new holder's."""
    t = HostTier(shm, capacity=2 * SLOT, name_prefix="x")
    try:
        cls = t.size_class(SLOT)
        put(t, cls, [b"a", b"b"], block_bytes=3000)
        t.get(b"a").checksum = 1234
        res = t.reserve(cls, [b"c"], 1000, [b"a"])
        (victim,) = res.victims
        (grant,) = res.entries
        assert victim.bkey == b"a" and grant.slot == victim.slot
        assert victim.checksum == 1234
        t.finish_eviction()
        grant.checksum = 99
        assert t.commit(grant)
        t.pin(t.get(b"c"))
        assert (victim.block_bytes, victim.visible, victim.pins) == (3000, False, 0)
        assert (t.get(b"c").block_bytes, t.get(b"c").checksum) == (1000, 99)
        assert not grant.current or t.get(b"c") == grant
    finally:
        t.close()


def _put(t, rec, ref, cls, want, counts) -> None:
    """A put: victims in order (popped in the same step), then commit and count."""
    res = t.reserve(cls, want, cls.slot_bytes, iter(rec))
    res.backing.run()
    for v in res.victims:
        assert rec.pop(v.bkey) == ref.pop(v.bkey)
    t.finish_eviction()
    for e, n in zip(res.entries, counts, strict=False):
        if e is not None and t.commit(e):
            rec[e.bkey] = ref[e.bkey] = n


def _remove(t, rec, ref, k, pin: bool) -> None:
    """A removal (of a pinned entry, maybe): popped in the same step."""
    e = t.get(k)
    if e is not None and pin:
        t.pin(e)
    for g in [x.bkey for x in t.remove([k])]:
        assert rec.pop(g) == ref.pop(g)
    if e is not None and e.pins:
        t.unpin(e)


def test_the_host_recency_behaves_as_the_policys_ordered_dict(shm) -> None:
    """HostRecency (the daemon's host order, in the tier's slot arrays) against an OrderedDict
    under random commits, hits, evictions (victims in order, popped in the same step) and
    removals, across two size classes: the same order, counts and answers after every step."""
    import random
    from collections import OrderedDict

    t = HostTier(shm, capacity=48 * SLOT, name_prefix="r")
    try:
        rec = t.recency()
        ref: OrderedDict[bytes, int] = OrderedDict()
        classes = [t.size_class(SLOT), t.size_class(2 * SLOT)]  # two classes share the order
        rng = random.Random(7)
        names = [bytes([i]) * 32 for i in range(40)]
        for _ in range(1500):
            op = rng.random()
            if op < 0.45:
                want = [k for k in rng.sample(names, rng.randint(1, 4)) if k not in t.entries]
                _put(t, rec, ref, rng.choice(classes), want, [rng.randint(1, 5) for _ in want])
            elif op < 0.8:  # hits
                for k in [k for k in rng.sample(names, 3) if k in ref]:
                    rec.move_to_end(k)
                    ref.move_to_end(k)
                    rec[k] = ref[k] = ref[k] + 1
            else:
                _remove(t, rec, ref, rng.choice(names), rng.random() < 0.5)
            assert list(rec) == list(ref) and list(rec.items()) == list(ref.items()) and len(rec) == len(ref)
            assert all((k in rec) == (k in ref) and rec.get(k) == ref.get(k) for k in names)
            assert not t._gone
        assert len(ref) > 10
    finally:
        t.close()

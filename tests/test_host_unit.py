"""HostTier without a daemon, driven as the store drives it: victims in the placement policy's LRU
order (a real TierPolicy), pins, the byte budget across size classes."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

from kvtier.tiers.host import HostTier, HostTierError
from kvtier.tiers.policy import TierPolicy
from kvtier.tiers.vocab import Tier

SLOT = 4096


@pytest.fixture
def tier():
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-unit-")
    t = HostTier(d, capacity=4 * SLOT, name_prefix="u")
    t.policy = TierPolicy(0, None, 0)  # the store's: host bounded in bytes by the tier, no disk
    yield t
    t.close()
    shutil.rmtree(d)


def reserve(t: HostTier, cls, names: list[bytes], block_bytes: int = SLOT):
    """``reserve`` as the store calls it: victims in the policy's order, reported to it."""
    res = t.reserve(cls, names, block_bytes, t.policy.victims(Tier.HOST))
    t.policy.on_evict(Tier.HOST, [v.bkey for v in res.victims])
    return res


def put(t: HostTier, cls, names: list[bytes], block_bytes: int = SLOT):
    res = reserve(t, cls, names, block_bytes)
    res.backing.run()
    t.finish_eviction()
    t.policy.on_commit(e.bkey for e in res.entries if e is not None and t.commit(e))
    return res


def test_lru_evicts_oldest_unpinned(tier: HostTier) -> None:
    cls = tier.size_class(SLOT)
    put(tier, cls, [b"a", b"b", b"c", b"d"])
    tier.policy.on_hit([b"a"])
    tier.pin(tier.get(b"b"))
    res = put(tier, cls, [b"e", b"f"])
    assert [v.bkey for v in res.victims] == [b"c", b"d"]
    assert set(tier.entries) == {b"a", b"b", b"e", b"f"}
    # everything pinned: no space, nothing evicted
    for k in (b"a", b"e", b"f"):
        tier.pin(tier.get(k))
    res = reserve(tier, cls, [b"g"])
    assert res.entries == [None] and res.victims == []


def test_victims_come_in_the_order_given_and_only_visible_ones(tier: HostTier) -> None:
    """The tier keeps no order of its own: it takes the candidates it is given, in order,
    passing over unknown keys and pinned entries."""
    cls = tier.size_class(SLOT)
    put(tier, cls, [b"a", b"b", b"c", b"d"])
    tier.pin(tier.get(b"c"))
    res = tier.reserve(cls, [b"x", b"y"], SLOT, [b"nope", b"c", b"d", b"a", b"b"])
    assert [v.bkey for v in res.victims] == [b"d", b"a"]
    assert tier.reserve(cls, [b"z"], SLOT).entries == [None]  # no candidates: nothing to evict


def test_removed_while_pinned_frees_on_last_unpin(tier: HostTier) -> None:
    cls = tier.size_class(SLOT)
    put(tier, cls, [b"a"])
    e = tier.get(b"a")
    tier.pin(e)
    tier.pin(e)
    assert tier.remove([b"a"]) == [e] and tier.get(b"a") is None
    assert e.slot not in cls.free
    tier.unpin(e)
    assert e.slot not in cls.free
    tier.unpin(e)
    assert e.slot in cls.free
    with pytest.raises(HostTierError):
        tier.unpin(e)


def test_first_commit_wins(tier: HostTier) -> None:
    cls = tier.size_class(SLOT)
    r1 = tier.reserve(cls, [b"a"], SLOT)
    r2 = tier.reserve(cls, [b"a"], SLOT)
    assert tier.commit(r1.entries[0]) is True
    assert tier.commit(r2.entries[0]) is False
    assert tier.get(b"a") == r1.entries[0] and r2.entries[0].slot in cls.free


def test_budget_spans_size_classes_and_is_released(tier: HostTier) -> None:
    small = tier.size_class(SLOT)
    big = tier.size_class(2 * SLOT)
    put(tier, small, [b"a", b"b", b"c", b"d"])
    assert tier.backed_bytes == 4 * SLOT
    res = put(tier, big, [b"X"], 2 * SLOT)
    assert [v.bkey for v in res.victims] == [b"a", b"b"]
    assert tier.backed_bytes <= tier.capacity
    on_disk = sum(os.stat(c.path).st_blocks * 512 for c in tier.classes.values())
    assert on_disk <= tier.capacity


def test_prefaulted_pool_gives_budget_to_a_second_class(tier: HostTier) -> None:
    tier.close()
    t = HostTier(tier.shm_dir, capacity=4 * SLOT, name_prefix="p")
    t.policy = TierPolicy(0, None, 0)
    try:
        small = t.size_class(SLOT, prefault=True)
        t.prefault_job(small).run()
        assert t.backed_bytes == 4 * SLOT and t.used_bytes == 0
        big = t.size_class(2 * SLOT, prefault=True)  # not the first: not prefaulted
        res = reserve(t, big, [b"X", b"Y"], 2 * SLOT)
        res.backing.run()
        t.finish_eviction()
        assert all(e is not None for e in res.entries) and not res.victims
        assert t.backed_bytes <= t.capacity
    finally:
        t.close()


def test_registered_pool_memory_never_moves_to_another_class(tier: HostTier) -> None:
    small = tier.size_class(SLOT)
    put(tier, small, [b"a", b"b", b"c", b"d"])
    tier.mark_registered(small)
    big = tier.size_class(2 * SLOT)
    res = reserve(tier, big, [b"X"], 2 * SLOT)
    assert res.entries == [None] and res.victims == []  # nothing punched out of the pinned file
    assert set(tier.entries) == {b"a", b"b", b"c", b"d"}
    res = put(tier, small, [b"e"])  # its own slots are reused as usual
    assert [v.bkey for v in res.victims] == [b"a"]


def test_unregistered_pool_gives_its_free_memory_back(tier: HostTier) -> None:
    """The last KV registration of a CUDA pool closed (the engine died): its free slots go to
    another layout's class again (on the H200 a second layout found no space before)."""
    small = tier.size_class(SLOT)
    put(tier, small, [b"a", b"b", b"c", b"d"])
    tier.mark_registered(small)
    tier.remove([b"a", b"b", b"c", b"d"])  # the test evicts every block, as the GPU test does
    tier.policy.on_remove(Tier.HOST, [b"a", b"b", b"c", b"d"])
    assert tier.used_bytes == 0 and tier.backed_bytes == 4 * SLOT
    big = tier.size_class(2 * SLOT)
    assert reserve(tier, big, [b"X"], 2 * SLOT).entries == [None]  # still pinned: refused
    tier.unmark_registered(small)
    res = put(tier, big, [b"X", b"Y"], 2 * SLOT)
    assert all(e is not None for e in res.entries)
    assert tier.backed_bytes <= tier.capacity and set(tier.entries) == {b"X", b"Y"}


def test_stale_grant_never_commits_nor_frees_another_blocks_slot(tier: HostTier) -> None:
    """A grant whose slot changed hands (aborted, then granted to another key) is stale: its
    commit is refused and its abort gives nothing back (the slot is not handed out twice)."""
    cls = tier.size_class(SLOT)
    old = reserve(tier, cls, [b"a"]).entries[0]
    tier.abort(old)                                   # reclaimed
    new = reserve(tier, cls, [b"b"]).entries[0]
    assert new.slot == old.slot and not old.current and new.current
    assert not tier.commit(old) and tier.get(b"a") is None
    tier.abort(old)                                   # a late abort: nothing freed
    assert old.slot not in cls.free
    assert tier.commit(new) and tier.get(b"b") == new


def test_unpinned_within_reads_the_packed_state(tier: HostTier) -> None:
    """The write-ahead's look: in the order given, visible entries only, within the bytes and
    the count given (each visible one counted, pinned or skipped too), not pinned, not skipped."""
    small = tier.size_class(SLOT // 2)
    put(tier, small, [b"a", b"b", b"c", b"d", b"e", b"f"], SLOT // 2)
    tier.pin(tier.get(b"b"))
    order = [b"nope", b"a", b"b", b"c", b"d", b"e", b"f"]
    assert tier.unpinned_within(order, 4 * SLOT, 100, ()) == [b"a", b"c", b"d", b"e", b"f"]
    assert tier.unpinned_within(order, 2 * SLOT, 100, {b"c"}) == [b"a", b"d"]
    assert tier.unpinned_within(order, 4 * SLOT, 3, ()) == [b"a", b"c"]
    tier.unpin(tier.get(b"b"))
    assert tier.unpinned_within(order, SLOT, 100, ()) == [b"a", b"b"]


# -- checksums of large commits, taken on the hashing threads (HostTier.seal) ---------------------

BIG = 2 << 20  # over INLINE_HASH_BYTES: sealed on the hashing threads


def _write(cls, e, byte: int) -> None:
    with open(cls.path, "r+b") as f:
        f.seek(e.offset)
        f.write(bytes([byte]) * e.block_bytes)


@contextlib.contextmanager
def _big_tier(prefix: str):
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-unit-")
    t = HostTier(d, capacity=BIG, name_prefix=prefix)
    try:
        yield t
    finally:
        t.close()
        shutil.rmtree(d)


def _put_big(t: HostTier, cls, key: bytes, byte: int, candidates=()):
    res = t.reserve(cls, [key], BIG, list(candidates))
    res.backing.run()
    t.finish_eviction()
    e = res.entries[0]
    _write(cls, e, byte)
    assert t.commit(e)
    return res, e


def test_a_victim_evicted_while_its_checksum_is_taken_gets_it(tmp_path) -> None:
    """A large commit's checksum is still being taken when a reserve evicts it: the victim
    (what a demotion writes, with the checksum its payload must still have) gets the checksum
    once ``sealed`` returns, not None (the disk would then take whatever bytes are there)."""
    import asyncio  # noqa: PLC0415

    from kvtier.tiers.host import payload_checksum  # noqa: PLC0415

    async def body() -> None:
        with _big_tier("s") as t:
            cls = t.size_class(BIG)
            _, e = _put_big(t, cls, b"a" * 24, 7)
            t.seal([e])
            assert e.sealing is not None, "not sealed on the threads: the test needs a pending checksum"
            want = payload_checksum(cls.payload(e.offset, e.block_bytes))
            res = t.reserve(cls, [b"b" * 24], BIG, [b"a" * 24])  # a evicted before its checksum came
            victim = res.victims[0]
            await t.sealed(res.victims)
            assert victim.checksum == want
            t.finish_eviction()
    asyncio.run(body())


def test_a_late_checksum_never_lands_on_the_slots_next_block(tmp_path) -> None:
    """A large commit's checksum is still being taken when its block is removed and its slot
    goes to another block, committed with its own checksum: the late one must not replace it
    (the good block would then fail verification and be dropped)."""
    import asyncio  # noqa: PLC0415

    from kvtier.tiers.host import payload_checksum  # noqa: PLC0415

    async def body() -> None:
        with _big_tier("l") as t:
            cls = t.size_class(BIG)
            _, a = _put_big(t, cls, b"a" * 24, 7)
            t.seal([a])
            task = a.sealing
            assert task is not None
            t.remove([b"a" * 24])                               # its slot is free at once
            res = t.reserve(cls, [b"b" * 24], BIG - 4096)
            b = res.entries[0]
            assert b.slot == a.slot
            _write(cls, b, 9)
            assert t.commit(b)
            good = payload_checksum(cls.payload(b.offset, b.block_bytes))
            t.seal([b], [good])                                 # the client's checksum
            await task                                          # a's late checksum lands
            held = t.get(b"b" * 24)
            assert held.checksum == good
            assert await t.verify([held]) == []
    asyncio.run(body())


def test_a_stale_view_cannot_touch_the_next_blocks_pins_and_a_second_commit_is_refused(tier: HostTier) -> None:
    """A view of a removed block, kept past the last unpin that freed its slot, must not
    change the pins of the block that slot holds next; committing a committed grant again
    must not free its slot (it would be handed out while the block is visible)."""
    cls = tier.size_class(SLOT)
    put(tier, cls, [b"a"])
    old = tier.get(b"a")
    tier.pin(old)
    tier.remove([b"a"])
    tier.unpin(old)                                             # the last pin: the slot is freed
    res = put(tier, cls, [b"b"])
    b = tier.get(b"b")
    assert b.slot == old.slot
    tier.pin(b)
    with pytest.raises(HostTierError, match="stale"):
        tier.unpin(old)
    with pytest.raises(HostTierError, match="stale"):
        tier.pin(old)
    assert b.pins == 1
    tier.unpin(b)
    assert tier.commit(res.entries[0]) is False                 # committed already
    assert b.slot not in cls.free and tier.get(b"b") == b


def test_another_class_is_not_evicted_when_its_memory_cannot_make_a_slot(tmp_path) -> None:
    """Class A (4 KiB) has all the slots the capacity gives it (3): evicting class B's block
    frees budget A cannot use, so only A's own victim goes."""
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-unit-")
    t = HostTier(d, capacity=3 * SLOT + SLOT // 2, name_prefix="c")
    t.policy = TierPolicy(0, None, 0)
    try:
        a, b = t.size_class(SLOT), t.size_class(SLOT // 2)
        for cls, names in ((a, [b"a1", b"a2", b"a3"]), (b, [b"b1"])):
            res = t.reserve(cls, names, cls.slot_bytes)
            res.backing.run()
            t.finish_eviction()
            assert all(t.commit(e) for e in res.entries)
        res = t.reserve(a, [b"a4"], SLOT, [b"b1", b"a1"])
        t.finish_eviction()
        assert [v.bkey for v in res.victims] == [b"a1"]
        assert t.get(b"b1") is not None
    finally:
        t.close()
        shutil.rmtree(d)


def test_a_victims_memory_is_not_punched_once_its_class_was_pinned_for_a_gpu(tmp_path) -> None:
    """Another class's victim is punched after its demotion (``finish_eviction``), seconds
    later. A KV registration that pinned that class's pool for a GPU meanwhile would keep
    writing pages the file no longer holds: such a pending punch is now skipped."""
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-unit-")
    t = HostTier(d, capacity=2 * SLOT, name_prefix="p")
    t.policy = TierPolicy(0, None, 0)
    try:
        a, b = t.size_class(SLOT // 2), t.size_class(SLOT)
        for cls, names in ((a, [b"a1", b"a2"]), (b, [b"b1"])):
            res = t.reserve(cls, names, cls.slot_bytes)
            res.backing.run()
            t.finish_eviction()
            assert all(t.commit(e) for e in res.entries)
        backed = os.stat(b.path).st_blocks
        res = t.reserve(a, [b"a3"], SLOT // 2, [b"b1"])  # b1's memory makes a3's slot
        assert [v.bkey for v in res.victims] == [b"b1"]
        t.mark_registered(b)                        # (a registration pinned b's pool meanwhile)
        t.finish_eviction()
        assert os.stat(b.path).st_blocks == backed, "a pinned pool's memory was punched"
        # its memory is still there: counted as backed, a free slot of its class again
        assert res.victims[0].slot in b.free and res.victims[0].slot not in b.holes
        # (a pinned file counts whole: pinning makes every page of it resident)
        assert t.backed_bytes == b.pool_bytes + 3 * (SLOT // 2)
    finally:
        t.close()
        shutil.rmtree(d)



def test_unbacking_a_grant_of_a_class_pinned_meanwhile_punches_nothing() -> None:
    """A grant given back as unbacked (its allocate failed or was cancelled) after a GPU pinned its
    class's pool: punching its slot would leave the GPU writing pages the file no longer holds;
    the slot is a free (backed) one of its class instead."""
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-unit-")
    t = HostTier(d, capacity=4 * SLOT, name_prefix="p")
    try:
        cls = t.size_class(SLOT)
        res = t.reserve(cls, [b"a", b"b"], SLOT)
        res.backing.run()
        t.mark_registered(cls)                      # (a registration pinned the pool meanwhile)
        backed = os.stat(cls.path).st_blocks
        t.unback(res.entries)
        assert os.stat(cls.path).st_blocks == backed, "a pinned pool's memory was punched"
        assert all(e.slot in cls.free and e.slot not in cls.holes for e in res.entries)
    finally:
        t.close()
        shutil.rmtree(d)

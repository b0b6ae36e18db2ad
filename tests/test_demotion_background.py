"""Demotions within the disk's write queue's room run in the background: a put
that evicts host victims copies them out and goes on; their disk write finishes later.

In-process BlockStore on a real HostTier (tmpfs) and a real DiskTier, on one asyncio loop; the
disk writer thread (and the copy threads) are held with the race tests' gates, so a write is
provably in flight while the test puts, evicts or puts again.
"""

from __future__ import annotations

import asyncio

import pytest
from test_store_races import (
    BLOCK,
    FP,
    Gate,
    get,
    key,
    parked,
    payload,
    put,
    read_slot,
    run,
    settle,
    until,
    write_slot,
)

from kvtier.daemon.counters import Count
from kvtier.daemon.placement import _ingest_pool
from kvtier.tiers.vocab import Tier

QUICK_S = 5.0   # a put that does not wait for the disk returns well within this


def other_payload(k: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in payload(k)[:64]) + payload(k)[64:]


async def put_bytes(store, sid, lid, keys, datas):
    grants = await asyncio.wait_for(store.allocate(sid, lid, keys), QUICK_S)
    assert all(g.granted for g in grants), grants
    for g, data in zip(grants, datas, strict=True):
        write_slot(store, g.offset, data)
    await store.commit(sid, [g.grant_id for g in grants], [], durable=False)


def test_a_put_returns_before_its_victims_are_written(tmp_path):
    """Host full; a put evicts two victims within the room: it returns while their disk write
    is parked on the gated writer (they are in neither tier meanwhile), and once the write
    runs they are on disk with the bytes that were put. Before, the put waited for the disk."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])           # host full
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10), key(11)], [payload(key(10)), payload(key(11))])
        assert gate.queued() == 1, "the victims' write should be parked on the writer"
        assert store.lookup(lid, [key(0), key(1)]) == [None, None]      # in flight: in no tier
        assert store.tiers._writing_bytes == 2 * BLOCK                    # the room they take
        assert store.counters[Count.DEMOTIONS_STAGED] == 2 and store.counters[Count.DEMOTIONS] == 0
        gate.open()
        await settle(store, disk)
        assert store.tiers._writing_bytes == 0 and not disk._writing
        assert store.counters[Count.DEMOTIONS] == 2 and store.counters[Count.DEMOTIONS_STAGED_OVER] == 2
        assert store.lookup(lid, [key(0), key(1)]) == [Tier.DISK, Tier.DISK]
        assert await get(store, sid, lid, [key(0), key(1)]) == [payload(key(0)), payload(key(1))]
    run(tmp_path, body, disk_blocks=16, demote_min_seen=2)


def test_victims_beyond_the_room_seen_once_are_dropped_and_staging_stays_bounded(tmp_path):
    """The room is two blocks: of four seen-once victims two are staged, two dropped; while they
    are written the next put's victims find no room and are dropped too (the put does not wait).
    Staged bytes and staging memory never exceed --demote-queue-bytes."""
    async def body(store, disk, lid, sid):
        limit = store.tiers.demote_queue_bytes = 2 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])           # host full, each seen once
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10 + i) for i in range(4)], [payload(key(10 + i)) for i in range(4)])
        assert store.tiers._writing_bytes == limit and store.tiers._staging.allocated <= limit
        assert store.counters[Count.DEMOTIONS_STAGED] == 2 and store.counters[Count.DEMOTIONS_SKIPPED_COLD] == 2
        await put_bytes(store, sid, lid, [key(20), key(21)], [payload(key(20)), payload(key(21))])
        assert store.tiers._writing_bytes == limit and store.tiers._staging.allocated <= limit
        assert store.counters[Count.DEMOTIONS_STAGED] == 2 and store.counters[Count.DEMOTIONS_SKIPPED_COLD] == 4
        gate.open()
        await settle(store, disk)
        assert store.lookup(lid, [key(i) for i in range(4)]) == [Tier.DISK, Tier.DISK, None, None]
        assert store.counters[Count.DEMOTIONS] == 2 and store.tiers._writing_bytes == 0
        # room again: the next victims are staged, and the buffers are reused (still bounded)
        await put_bytes(store, sid, lid, [key(30), key(31)], [payload(key(30)), payload(key(31))])
        await settle(store, disk)
        assert store.lookup(lid, [key(12), key(13)]) == [Tier.DISK, Tier.DISK]
        assert store.tiers._staging.allocated <= limit
    run(tmp_path, body, disk_blocks=16, demote_min_seen=2)


def test_evict_or_put_again_during_a_staged_write(tmp_path):
    """While the victims' write is parked: an Evict of one leaves it nowhere (not on disk after
    the write ran, its disk slot not lost); a put of another with new bytes serves the new
    bytes, and the old write of that key never becomes visible on disk."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10), key(11)], [payload(key(10)), payload(key(11))])  # 0, 1 staged
        assert store.evict(lid, [key(0)]) == 0                            # in no tier: nothing to count
        new = other_payload(key(1))
        await put_bytes(store, sid, lid, [key(1)], [new])                 # 2 staged (and written later)
        assert store.lookup(lid, [key(0), key(1)]) == [None, Tier.HOST]
        gate.open()
        await settle(store, disk)
        assert store.lookup(lid, [key(0), key(1), key(2)]) == [None, Tier.HOST, Tier.DISK]
        assert store.on_disk(lid, [key(0), key(1)]) == [False, False], "a dropped write became visible"
        assert disk.used_bytes == len(disk.entries) * BLOCK and not disk._writing
        assert store.counters[Count.DEMOTIONS] == 1
        assert await get(store, sid, lid, [key(1), key(2)]) == [new, payload(key(2))]
    run(tmp_path, body, disk_blocks=16, demote_min_seen=2)


def test_evict_while_staged_blocks_are_copied_out(tmp_path):
    """A batch large enough to be copied out on the copy threads: an Evict while the copy runs
    (the write not planned yet) still keeps the block off disk."""
    n = 72  # 72 blocks of 64 KiB: past the 4 MiB a batch copies inline
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 2 * n * BLOCK
        await put(store, sid, lid, [key(i) for i in range(n)])
        gate = Gate(_ingest_pool(), 2)
        task = await parked(store.allocate(sid, lid, [key(1000 + i) for i in range(n)]))
        assert store.evict(lid, [key(0)]) == 0
        gate.open()
        grants = await task
        await store.commit(sid, [], [g.grant_id for g in grants], durable=False)   # (aborted)
        await settle(store, disk)
        where = store.lookup(lid, [key(i) for i in range(n)])
        assert where == [None] + [Tier.DISK] * (n - 1)
        assert disk.used_bytes == len(disk.entries) * BLOCK and not disk._writing
    run(tmp_path, body, host_blocks=n, disk_blocks=2 * n, demote_min_seen=2)


def test_a_staged_block_whose_bytes_changed_is_dropped_from_disk_only(tmp_path):
    """A victim whose slot was written after its commit fails the disk writer's checksum check:
    counted and not written; a new copy of the key put meanwhile stays in host."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])
        slot0 = store.host.get(store.layout(lid).layout.fingerprint + key(0)).offset
        write_slot(store, slot0, b"\xff" * 64)                            # a write after the commit
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10)], [payload(key(10))])  # 0 staged, with the bad bytes
        assert read_slot(store, slot0) == payload(key(10))                # its slot went on at once
        await put_bytes(store, sid, lid, [key(0)], [payload(key(0))])    # a new copy (1 staged)
        gate.open()
        await settle(store, disk)
        assert store.counters[Count.CHECKSUM_FAILURES] == 1
        assert store.lookup(lid, [key(0), key(1)]) == [Tier.HOST, Tier.DISK]
        assert await get(store, sid, lid, [key(0)]) == [payload(key(0))]
    run(tmp_path, body, disk_blocks=16, demote_min_seen=2)


def test_drain_waits_for_staged_writes(tmp_path):
    """Daemon shutdown drains the store before closing its files: drain returns only once the
    staged writes are over, and they are on disk then."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10), key(11)], [payload(key(10)), payload(key(11))])
        drain = asyncio.ensure_future(store.drain())
        await asyncio.sleep(0.05)
        assert not drain.done(), "drain returned while a staged write was in flight"
        gate.open()
        await asyncio.wait_for(drain, QUICK_S)
        assert store.on_disk(lid, [key(0), key(1)]) == [True, True] and not disk._writing
    run(tmp_path, body, disk_blocks=16, demote_min_seen=2)


def test_graceful_stop_finishes_background_demotions(start_daemon, tmp_path):
    """A real kvtierd stopped (SIGTERM) right after puts that staged demotions: it stops cleanly
    (no error logged), and the restarted daemon finds every staged block on disk, byte-exact."""
    from kvtier.client.engine.sidecar import Sidecar
    from kvtier.tiers.layout import Layout

    block = 256 * 1024
    args = ("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB",
            "--demote-ahead-bytes", "0")  # (every victim staged: the write-ahead has its own test)
    d = start_daemon(*args, host_capacity="1MiB")  # 4 blocks of host
    keys = [key(300 + i) for i in range(16)]
    data = {k: payload(k)[:block // 4] * 4 for k in keys}
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(block))
        for i in range(0, 16, 4):
            sc.put(lid, keys[i:i + 4], [data[k] for k in keys[i:i + 4]])
        staged = sc.stats()["counters"]["demotions_staged"]
    assert staged == 12
    assert d.stop() == 0
    logs = d.logs()
    assert '"level": "error"' not in logs and "Traceback" not in logs, logs[-2000:]
    d2 = start_daemon(*args, host_capacity="1MiB", name="restarted")
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(Layout.flat(block))
        assert sc.lookup(lid, keys[:12]) == ["disk"] * 12
        assert [bytes(g) for g in sc.get(lid, keys[:4])] == [data[k] for k in keys[:4]]


# -- write-ahead (--demote-ahead-bytes): the host's eviction end is on disk before it is evicted --

def test_blocks_near_eviction_are_written_ahead_and_their_eviction_frees_the_slot(tmp_path):
    """Host full (8 blocks), window 2 blocks: a put that evicts stages its victims and writes the
    next two of the eviction order ahead; they stay in host and are on disk too. A later put
    that evicts them copies nothing (none staged for them, none dropped): they are served from
    disk with the bytes that were put. Without the write-ahead they would be staged victims."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        store.tiers.demote_ahead_bytes = 2 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(8)])           # host full; nothing evicted
        await settle(store, disk)
        assert store.counters[Count.DEMOTIONS_STAGED] == 0               # (no eviction: no write-ahead yet)
        await put_bytes(store, sid, lid, [key(10), key(11)], [payload(key(10)), payload(key(11))])
        await settle(store, disk)
        assert store.counters[Count.DEMOTIONS_AHEAD] == 2                 # 2, 3 (0, 1 were staged victims)
        assert store.lookup(lid, [key(i) for i in range(4)]) == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST]
        assert store.on_disk(lid, [key(2), key(3)]) == [True, True]      # held in both tiers
        staged = store.counters[Count.DEMOTIONS_STAGED]
        await put_bytes(store, sid, lid, [key(20), key(21)], [payload(key(20)), payload(key(21))])
        await settle(store, disk)
        # victims 2, 3 were on disk already: not staged; the two queued since are 4, 5 written ahead
        assert store.counters[Count.DEMOTIONS_STAGED] == staged + 2
        assert store.counters[Count.DEMOTIONS_AHEAD] == 4
        assert store.counters[Count.DEMOTIONS_SKIPPED_COLD] == 0
        assert store.lookup(lid, [key(2), key(3), key(4), key(5)]) == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST]
        assert await get(store, sid, lid, [key(2), key(3)]) == [payload(key(2)), payload(key(3))]
        await settle(store, disk)
        assert store.tiers._writing_bytes == 0 and not disk._writing
    run(tmp_path, body, host_blocks=8, disk_blocks=32, demote_min_seen=2)


async def ahead_parked(store, disk, lid, sid) -> Gate:
    """Host full (8 blocks), window 2 blocks, the disk writer gated: a put of 10, 11 evicts 0, 1
    (staged) and queues the write-ahead of 2 and 3, parked behind the gate (returned)."""
    store.tiers.demote_queue_bytes = 8 * BLOCK
    store.tiers.demote_ahead_bytes = 2 * BLOCK
    await put(store, sid, lid, [key(i) for i in range(8)])
    gate = Gate(disk._writer, 1)
    await put_bytes(store, sid, lid, [key(10), key(11)], [payload(key(10)), payload(key(11))])
    await until(lambda: store.counters[Count.DEMOTIONS_STAGED] == 4, "the write-ahead of 2 and 3 to be queued")
    return gate


def test_a_block_being_written_ahead_is_passed_over_and_an_evict_keeps_it_off_disk(tmp_path):
    """While the write-ahead of 2 and 3 is parked on the gated writer: they are still served from
    host; a put that must evict passes over them (pinned) and takes 4; an Evict of 2 removes it
    from host at once and its write never becomes visible on disk. 3's write does."""
    async def body(store, disk, lid, sid):
        gate = await ahead_parked(store, disk, lid, sid)
        assert store.lookup(lid, [key(2), key(3)]) == [Tier.HOST, Tier.HOST]
        await put_bytes(store, sid, lid, [key(12)], [payload(key(12))])   # evicts past 2, 3: 4
        assert store.lookup(lid, [key(2), key(3), key(4)]) == [Tier.HOST, Tier.HOST, None]
        assert store.evict(lid, [key(2)]) == 1                              # its host copy
        assert store.lookup(lid, [key(2)]) == [None]
        gate.open()
        await settle(store, disk)
        assert store.on_disk(lid, [key(2), key(3)]) == [False, True], "an evicted block's write-ahead became visible"
        assert store.lookup(lid, [key(2), key(3)]) == [None, Tier.HOST]
        assert disk.used_bytes == len(disk.entries) * BLOCK and not disk._writing
        assert store.host.used_bytes == 7 * BLOCK                           # 2's slot is free (at its unpin)
    run(tmp_path, body, host_blocks=8, disk_blocks=32, demote_min_seen=2)


def test_a_durable_put_of_blocks_being_written_ahead_waits_for_that_write(tmp_path):
    """A durable put of 2 and 3 while their write-ahead is parked on the gated writer does not
    write them twice (the disk skips keys in flight) and does not answer before that write
    ends: it answers durable, and they are on disk."""
    async def body(store, disk, lid, sid):
        gate = await ahead_parked(store, disk, lid, sid)
        await until(lambda: bool(disk._writing), "the write-ahead of 2 and 3 to be in flight")
        durable = asyncio.ensure_future(store.allocate(sid, lid, [key(2), key(3)], durable=True))
        await asyncio.sleep(0.1)
        assert not durable.done(), "a durable put answered while its blocks' write was still in flight"
        gate.open()
        grants = await asyncio.wait_for(durable, 10)
        assert [g.durable for g in grants] == [True, True]
        assert store.on_disk(lid, [key(2), key(3)]) == [True, True]
        await settle(store, disk)
    run(tmp_path, body, host_blocks=8, disk_blocks=32, demote_min_seen=2)


def test_closing_while_a_write_ahead_is_in_flight_closes_the_tiers(tmp_path):
    """Closing the tiers without a drain while a write-ahead batch is parked on the gated writer
    (its slot views still exported) closes the disk and host tiers: nothing raises."""
    async def body(store, disk, lid, sid):
        gate = await ahead_parked(store, disk, lid, sid)
        await until(lambda: bool(disk._writing), "the write-ahead of 2 and 3 to be in flight")
        gate.open()
        store.tiers.close()
        assert not store.host.classes, "the host tier was not closed"
    run(tmp_path, body, host_blocks=8, disk_blocks=32, demote_min_seen=2)


def test_a_look_while_the_writer_is_behind_still_queues_the_new_window(tmp_path):
    """Write queue of 2 blocks, window of 2, the writer gated. Put 10 evicts 0 (staged) and
    queues 1, 2 for the write-ahead; 1 goes in flight, 2 waits for room. Put 11 evicts 2 (1 is
    pinned; no room: 2, seen once, is dropped) and looks again: 3 joins the queue, as the policy
    writes it at that put. Before, a look was skipped while the queue held blocks, so 3 was
    never written ahead: which blocks went depended on how far the writer had got."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 2 * BLOCK
        store.tiers.demote_ahead_bytes = 2 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(8)])
        gate = Gate(disk._writer, 1)
        await put_bytes(store, sid, lid, [key(10)], [payload(key(10))])
        await until(lambda: store.tiers._writing_bytes == 2 * BLOCK, "0 staged and 1 written ahead, in flight")
        assert len(store.tiers._ahead_queue) == 1                          # 2, waiting for room
        await put_bytes(store, sid, lid, [key(11)], [payload(key(11))])
        assert store.lookup(lid, [key(2)]) == [None]                       # evicted while queued
        gate.open()
        await settle(store, disk)
        assert store.on_disk(lid, [key(1), key(3)]) == [True, True], "the second look's block was not written ahead"
        assert store.lookup(lid, [key(3)]) == [Tier.HOST]                   # held in both tiers
        assert store.counters[Count.DEMOTIONS_AHEAD] == 2
        assert store.counters[Count.DEMOTIONS_STAGED] == store.counters[Count.DEMOTIONS_STAGED_OVER]
    run(tmp_path, body, host_blocks=8, disk_blocks=32, demote_min_seen=2)


async def staged_parked(store, disk, lid, sid) -> Gate:
    """Host full (4 blocks), the disk writer gated: a put of 10 evicts 0, staged, its write
    parked behind the gate (returned)."""
    store.tiers.demote_queue_bytes = 8 * BLOCK
    await put(store, sid, lid, [key(i) for i in range(4)])
    gate = Gate(disk._writer, 1)
    await put(store, sid, lid, [key(10)])
    await until(lambda: gate.queued() == 1, "the staged write to be queued")
    return gate


def test_an_evict_during_a_staged_write_is_durable_when_answered(tmp_path):
    """An Evict (evict_durably: answered once the index deletes committed) of a key whose
    staged write is parked on the disk writer: when it answers, the index must not hold the
    key, even though the write, which ran first, committed it (a crash then would bring the
    evicted key back with its old bytes). Later work on the writer is held by a second gate."""
    async def body(store, disk, lid, sid):
        g1 = await staged_parked(store, disk, lid, sid)
        evicted = asyncio.ensure_future(store.evict_durably(lid, [key(0)]))
        await until(lambda: g1.queued() >= 2, "the Evict's index work to be queued")
        g2 = Gate(disk._writer, 1)                                          # holds what comes after
        g1.open()
        await asyncio.wait_for(evicted, 10)
        with disk.env.begin(db=disk._blocks) as txn:
            assert txn.get(FP + key(0)) is None, "an answered Evict's key is still in the disk index"
        g2.open()
        await settle(store, disk)
        assert store.on_disk(lid, [key(0)]) == [False]
    run(tmp_path, body, host_blocks=4, disk_blocks=16, demote_min_seen=2)


def test_a_durable_re_put_during_the_old_copys_staged_write_is_made_durable(tmp_path):
    """0 is evicted and staged, its write parked; 0 is put again with a durable commit, which
    drops that write (a new put of the key) and cannot plan its own while the old one is in
    flight. Once the old write ends (dropped), the commit writes the new copy: durable."""
    async def body(store, disk, lid, sid):
        gate = await staged_parked(store, disk, lid, sid)
        grants = await store.allocate(sid, lid, [key(0)])
        assert grants[0].granted
        write_slot(store, grants[0].offset, payload(key(0)))
        commit = asyncio.ensure_future(store.commit(sid, [grants[0].grant_id], [], durable=True))
        await asyncio.sleep(0.1)
        assert not commit.done()
        gate.open()
        res = await asyncio.wait_for(commit, 10)
        assert (res.committed, res.durable) == (1, 1)
        assert store.on_disk(lid, [key(0)]) == [True]
        assert await get(store, sid, lid, [key(0)]) == [payload(key(0))]
        await settle(store, disk)
    run(tmp_path, body, host_blocks=4, disk_blocks=16, demote_min_seen=2)


def test_a_slab_that_cannot_be_opened_degrades_the_disk_and_leaks_nothing(tmp_path):
    """Opening a new slab file fails (ENOSPC) while a demotion is planned: the disk degrades
    as for a failed write; the put goes on, no key stays marked in flight, and a later durable
    commit answers (not durable) instead of waiting forever."""
    import errno  # noqa: PLC0415

    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK

        def no_space(slot_bytes):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        disk._open_slab = no_space
        await put(store, sid, lid, [key(i) for i in range(4)])
        await put(store, sid, lid, [key(10)])                               # 0 evicted: its demotion fails
        await settle(store, disk)
        assert disk.degraded and not disk._writing
        assert store.counters[Count.DEMOTIONS_STAGED] == store.counters[Count.DEMOTIONS_STAGED_OVER]
        grants = await store.allocate(sid, lid, [key(20)])
        write_slot(store, grants[0].offset, payload(key(20)))
        res = await asyncio.wait_for(store.commit(sid, [grants[0].grant_id], [], durable=True), 10)
        assert (res.committed, res.durable) == (1, 0)
    run(tmp_path, body, host_blocks=4, disk_blocks=16, demote_min_seen=2)


def test_an_evict_while_a_victims_checksum_is_awaited_keeps_it_off_disk(tmp_path):
    """Seen-often victims beyond the write queue's room are written before their slots go,
    once their checksums are taken. A large commit's checksums are taken on the hashing
    threads (held by a gate here): an Evict of a victim that arrives while its demotion
    awaits them must keep it off disk (it was written anyway: the Evict found it in no tier)."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 0                                  # no room: written in the put
        first = [key(i) for i in range(20)]                                 # 20 blocks: over INLINE_HASH_BYTES
        await put(store, sid, lid, [key(100 + i) for i in range(20)])       # (the hashing threads exist)
        await settle(store, disk)
        store.evict(lid, [key(100 + i) for i in range(20)])
        gate = Gate(store.host._hasher, 2)
        await put(store, sid, lid, first)                                   # their checksums: held
        assert await get(store, sid, lid, first) == [payload(k) for k in first]  # seen twice
        putting = asyncio.ensure_future(put(store, sid, lid, [key(200 + i) for i in range(4)]))  # evicts 0-3
        await until(lambda: store.lookup(lid, [key(0)]) == [None], "0 to be evicted, its demotion waiting")
        assert store.evict(lid, [key(0)]) == 0                              # in no tier yet
        gate.open()
        await asyncio.wait_for(putting, 10)
        await settle(store, disk)
        assert store.on_disk(lid, [key(0), key(1)]) == [False, True]
        assert store.lookup(lid, [key(0)]) == [None]
    run(tmp_path, body, host_blocks=20, disk_blocks=64, demote_min_seen=2)


def test_a_demotion_that_fails_gives_the_puts_slots_back(tmp_path):
    """The copy of a victim into staging fails (injected): the put gets the error, and the slot
    it was granted goes back (it stayed reserved for good: the host held one block less)."""
    async def body(store, disk, lid, sid):
        store.tiers.demote_queue_bytes = 8 * BLOCK
        await put(store, sid, lid, [key(i) for i in range(4)])

        async def broken(pairs):
            raise OSError(5, "Input/output error (injected)")
        store.tiers._copy_out = broken
        with pytest.raises(OSError, match="injected"):
            await put(store, sid, lid, [key(10)])
        del store.tiers._copy_out
        assert store.host.used_bytes == 3 * BLOCK                            # 0 evicted, no grant held
        await put(store, sid, lid, [key(20)])                                # the slot is there again
        assert store.lookup(lid, [key(1), key(20)]) == [Tier.HOST, Tier.HOST]
        await settle(store, disk)
    run(tmp_path, body, host_blocks=4, disk_blocks=16, demote_min_seen=1)


def test_an_evict_while_a_write_ahead_batch_awaits_its_checksums_keeps_it_off_disk(tmp_path):
    """A write-ahead batch is pinned and waits for its blocks' checksums (a large commit's,
    taken on the hashing threads: held by a gate). An Evict of one of them meanwhile is
    answered (the key in no tier after it); the batch must not write it to disk after."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.tiers import host as host_mod

    async def body(store, disk, lid, sid):
        pl = store.tiers
        pl.demote_queue_bytes = pl.demote_ahead_bytes = 64 * BLOCK
        store.host._hasher = ThreadPoolExecutor(host_mod.HASH_THREADS)
        gate = Gate(store.host._hasher, host_mod.HASH_THREADS)
        keys = [key(i) for i in range(20)]                                  # 20 blocks: hashed on the threads
        await put(store, sid, lid, keys)
        pl._write_ahead_soon()                                              # as a put that evicted does
        await until(lambda: any(store.host.get(FP + k).pins for k in keys), "the write-ahead batch to be pinned")
        victim = next(k for k in keys if store.host.get(FP + k).pins)
        assert await store.evict_durably(lid, [victim]) == 1
        gate.open()
        await settle(store, disk)
        assert store.on_disk(lid, [victim]) == [False], "an evicted block was written ahead after its Evict"
        assert await get(store, sid, lid, [victim]) == [None]
    run(tmp_path, body, host_blocks=24, disk_blocks=64, demote_min_seen=2)

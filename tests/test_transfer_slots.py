"""A transfer ring slot belongs to its newest sequence number, in process (a real BlockStore on a
real tmpfs HostTier, the daemon's transfers and its stand-in copy engine): a reused slot supersedes
the transfer still in it, a stale sequence number is refused, an offload the engine gave up on is
never committed, and a late completion record never moves a slot back.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest
from _wait import until

from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"slotseqs" + i.to_bytes(24, "big")   # 32 bytes: the longest key


def _engine_views(kv_fd: int, ring_fd: int):
    import mmap

    import numpy as np

    kv_map, ring_map = mmap.mmap(kv_fd, 4 * BLOCK), mmap.mmap(ring_fd, 64)
    return kv_map, ring_map, np.frombuffer(kv_map, dtype=np.uint8), np.frombuffer(ring_map, dtype=np.uint64)


def _close_maps(*maps) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass  # a view is still alive (a failed assertion's traceback): the mapping goes with it


def _count(name: str):
    from kvtier.daemon.counters import Count

    return getattr(Count, name, None)


def _granted(store) -> bool:
    """Whether some session holds a grant (an offload is between its Allocate and its commit)."""
    return any(store.sessions[s].grants for s in store.sessions.ids())


def _slot_transfers(body) -> None:
    from attacks_sessions import in_process

    from kvtier.daemon.sessions import Limits

    in_process_dir = tempfile.mkdtemp(prefix="kvtier-slots-")
    try:
        in_process(__import__("pathlib").Path(in_process_dir), body, Limits(transfer_wait_s=20))
    finally:
        shutil.rmtree(in_process_dir, ignore_errors=True)


def test_a_reused_ring_slot_supersedes_the_transfer_still_in_it_and_stale_seqs_are_refused() -> None:
    """The engine asked an offload (slot 0, seq 5) whose "KV written" it never recorded, gave up
    on it (its deadline), reused page 0 for other KV and asked a new offload in the same slot
    (seq 9). The old transfer must not copy page 0's new bytes under its own key (its wait
    sees the newer record, which is not its own); the new one commits; a late request with an
    older seq in that slot is refused FAILED_PRECONDITION and changes nothing."""
    import numpy as np
    from attacks_sessions import KV_LAYOUT, registration

    from kvtier.daemon.errors import Code, StoreError
    from kvtier.daemon.gpu import TransferOrder

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = await transfers.register(registration(sid, kv_fd, ring_fd))
            rid, fp = reg.registration_id, KV_LAYOUT.fingerprint
            kv[:BLOCK] = 1                                                    # page 0: key A's KV (never marked written)
            old = asyncio.ensure_future(transfers.offload(
                TransferOrder(sid, rid, [key(100)], np.array([0]), 0, 5, wait_written=True)))
            await until(lambda: _granted(store), "the old offload to wait for its KV")
            kv[:BLOCK] = 2                                                    # the engine reused page 0 ...
            ring[0] = 2 * 9                                                   # ... and slot 0 for request 9
            new = await transfers.offload(TransferOrder(sid, rid, [key(101)], np.array([0]), 0, 9, wait_written=True))
            assert [s.name for s in new.status] == ["COPIED"]
            with pytest.raises(StoreError) as e:
                await asyncio.wait_for(old, 10)
            assert e.value.code is Code.CANCELLED and "superseded" in str(e.value)
            assert store.lookup(reg.layout_id, [key(100), key(101)]) == [None, Tier.HOST], \
                "the superseded offload committed the reused page's bytes under its own key"
            assert (await store.tiers.payloads([fp + key(101)]))[fp + key(101)][0] == bytes([2]) * BLOCK
            with pytest.raises(StoreError) as e:                             # a late, older request
                await transfers.offload(TransferOrder(sid, rid, [key(102)], np.array([1]), 0, 5, wait_written=True))
            assert e.value.code is Code.FAILED_PRECONDITION and "stale" in str(e.value)
            assert store.lookup(reg.layout_id, [key(102)]) == [None]
            assert int(ring[0]) == 2 * 9 + 1   # the slot shows the newest request complete
            assert store.counters.counts.get(_count("KV_TRANSFERS_SUPERSEDED")) == 1
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)


def test_an_offload_the_engine_gave_up_on_is_never_committed() -> None:
    """The engine's deadline passes while its offload waits for "KV written" (the RPC is
    cancelled); the engine then reuses the page, and its late record arrives: the daemon's
    copy may run, but the block is not committed (the engine was told the offload failed)."""
    import numpy as np
    from attacks_sessions import registration

    from kvtier.daemon.gpu import TransferOrder

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = await transfers.register(registration(sid, kv_fd, ring_fd))
            rid = reg.registration_id
            call = asyncio.ensure_future(transfers.offload(
                TransferOrder(sid, rid, [key(110)], np.array([0]), 0, 5, wait_written=True)))
            await until(lambda: _granted(store), "the offload to wait for its KV")
            call.cancel()                                   # the engine's deadline: it was told DEADLINE_EXCEEDED
            with pytest.raises(asyncio.CancelledError):
                await call
            kv[:BLOCK] = 3
            ring[0] = 2 * 5                                 # a late "KV written" for the abandoned request
            await until(lambda: not _granted(store), "the abandoned copy to end")
            assert store.lookup(reg.layout_id, [key(110)]) == [None], "an offload the engine gave up on was committed"
            assert not any(store.sessions[s].grants for s in store.sessions.ids())
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)



def test_a_late_completion_record_never_moves_a_slot_back() -> None:
    """The stand-in copy engine's completion record of request 5 lands after the engine already
    wrote request 9's "KV written" into the slot (the engine gave up on 5 and reused the slot
    while 5's copy ran): the slot keeps 9's record, else the daemon would wait for 9's KV until
    --transfer-wait-s and refuse it. (On the real engine, through its copy call.)"""
    import numpy as np
    from attacks_sessions import registration

    from kvtier.tiers.copy_engine import ONBOARD, plan_chunks

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        kv_map, ring_map, kv, ring = _engine_views(kv_fd, ring_fd)
        try:
            reg = transfers.registrations[(await transfers.register(registration(sid, kv_fd, ring_fd))).registration_id]
            engine = transfers.engines["host"]
            plan = plan_chunks(reg.layout, reg.tensors, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
            ring[0] = 2 * 9
            engine.copy(reg.memory, reg.pool_path, plan, ONBOARD, 0, 5, False).wait_done()
            assert int(ring[0]) == 2 * 9, "a late completion record moved the slot back"
            engine.copy(reg.memory, reg.pool_path, plan, ONBOARD, 1, 5, False).wait_done()
            assert int(ring[1]) == 2 * 5 + 1
        finally:
            del kv, ring
            _close_maps(kv_map, ring_map)

    _slot_transfers(body)

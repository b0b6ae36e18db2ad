"""The BlockStore when state changes across an ``await``: cancelled requests, concurrent Evict,
failing fallocate. In-process BlockStore on a real HostTier (tmpfs under /dev/shm) and a real
DiskTier (O_DIRECT slab files, LMDB), driven on one asyncio loop so interleavings are exact.

The disk tier's threads are held busy with a gate (a job that waits on an Event) so that a
request is provably parked at its ``await`` when the test cancels it or changes the state.
A failing ``fallocate`` (a full tmpfs) is injected at the one OS boundary, ``BackingJob.run``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from kvtier.client.tools.local_daemon import shm_tempdir
from kvtier.daemon.counters import Count
from kvtier.daemon.errors import Code
from kvtier.daemon.gpu import KVRegistration, Transfers
from kvtier.daemon.results import GrantStatus
from kvtier.daemon.store import BlockStore, StoreError
from kvtier.tiers.copy_engine import AllocationRef, HostCopyEngine, TensorRef, sealed_memfd
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import BackingJob, HostTier
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024
LAYOUT = Layout.flat(BLOCK)
FP = LAYOUT.fingerprint


def key(i: int) -> bytes:
    return b"racetest" + i.to_bytes(8, "big")


def payload(k: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(k, "big")).bytes(BLOCK)


WAIT_S = 10.0       # the longest any wait of these tests may take: past it the test fails, never hangs
_GATES: list[Gate] = []   # every gate of the running test: ``run`` opens them all at its end


class Gate:
    """Holds every thread of an executor until opened (at the latest when its test ends, pass or
    fail: a test failing before it opened its gate must not hang the store's close forever)."""

    def __init__(self, executor, threads: int) -> None:
        self.event = threading.Event()
        self.executor = executor
        self.futs = [executor.submit(self.event.wait, 6 * WAIT_S) for _ in range(threads)]
        _GATES.append(self)

    def queued(self) -> int:
        """Jobs waiting behind the gate (submitted to the held executor, not started)."""
        return self.executor._work_queue.qsize()

    def open(self) -> None:
        self.event.set()
        for f in self.futs:
            f.result(WAIT_S)


async def until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Yield to the loop until ``cond()``; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.001)


async def settle(store: BlockStore, disk: DiskTier | None = None) -> None:
    """Let detached work finish: every other task of the loop ends (bounded), then the disk
    writer's queue drains, twice (a finished task may have queued more)."""
    for _ in range(2):
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            _, pending = await asyncio.wait(others, timeout=WAIT_S)
            assert not pending, f"{len(pending)} tasks still running after {WAIT_S} s: {pending}"
        if disk is not None:
            await asyncio.wait_for(asyncio.wrap_future(disk._writer.submit(lambda: None)), WAIT_S)
        await asyncio.sleep(0)


def write_slot(store: BlockStore, off: int, data: bytes) -> None:
    cls = store.host.size_class(LAYOUT.slot_bytes)
    with open(cls.path, "r+b") as fh:
        fh.seek(off)
        fh.write(data)


def read_slot(store: BlockStore, off: int) -> bytes:
    cls = store.host.size_class(LAYOUT.slot_bytes)
    with open(cls.path, "rb") as fh:
        fh.seek(off)
        return fh.read(BLOCK)


async def put(store: BlockStore, sid: int, lid: int, keys: list[bytes], durable: bool = False) -> tuple[int, int]:
    grants = await store.allocate(sid, lid, keys)
    assert all(g.granted for g in grants), grants
    for k, g in zip(keys, grants, strict=True):
        write_slot(store, g.offset, payload(k))
    done = await store.commit(sid, [g.grant_id for g in grants], [], durable=durable)
    return done.committed, done.durable


async def get(store: BlockStore, sid: int, lid: int, keys: list[bytes]) -> list[bytes | None]:
    leases = await store.acquire(sid, lid, keys)
    out = [read_slot(store, x.offset) if x.hit else None for x in leases]
    store.release(sid, [x.lease_id for x in leases if x.hit])
    return out


def drop_from_host(store: BlockStore, k: bytes) -> None:
    """Take a block out of the host tier only (as an eviction would, without demoting it)."""
    store.host.remove([FP + k])
    store.policy.on_remove(Tier.HOST, [FP + k])


def no_grant_held(store: BlockStore) -> bool:
    """No session holds a grant, and every host slot is free, a hole or a visible block's."""
    return not any(store.sessions[sid].grants for sid in store.sessions.ids())


def host_slots_accounted(host: HostTier) -> None:
    """Every slot below hwm is exactly one of: free, a hole, or held by a visible entry (the
    tests hold no grants and no leases when they call this)."""
    for cls in host.classes.values():
        held = [e.slot for e in host.held() if e.cls is cls]
        every = sorted(cls.free + cls.holes + held)
        assert every == list(range(cls.hwm)), (
            f"slots leaked or listed twice: free={sorted(cls.free)} holes={sorted(cls.holes)} held={sorted(held)}")


def run(tmp_path, body: Callable[[BlockStore, DiskTier | None, int, int], Awaitable[None]], *,
        host_blocks: int = 4, disk_blocks: int = 0, prefault: bool = True, demote_min_seen: int = 1) -> None:

    async def main() -> None:
        disk = DiskTier(str(tmp_path / "disk"), capacity=disk_blocks * BLOCK, queue_depth=1) if disk_blocks else None
        store = BlockStore(HostTier(shm, host_blocks * BLOCK, "race"), disk=disk,
                           demote_min_seen=demote_min_seen, prefault=prefault)
        try:
            lid = (await store.register_layout(LAYOUT)).layout_id
            sid = store.open_session("test", os.getpid()).session_id
            async with asyncio.timeout(6 * WAIT_S):   # (in this task: settle waits for the others)
                await body(store, disk, lid, sid)
        finally:
            for gate in _GATES:   # a failed assertion before a gate opened: let the threads go
                gate.event.set()
            _GATES.clear()
            await asyncio.sleep(0.05)
            store.close()

    with shm_tempdir() as shm:
        asyncio.run(main())


async def parked(coro: Awaitable) -> asyncio.Task:
    """Start ``coro`` and let it run until its work waits behind the (latest) gate: a job of it
    is queued on the gated executor, however many loop steps that takes."""
    gate = _GATES[-1]
    task = asyncio.ensure_future(coro)
    await until(lambda: gate.queued() > 0 or task.done(), "the request to reach the gated threads")
    assert not task.done(), "the request should be parked on the gated disk threads"
    return task


# -- a cancelled request (gRPC deadline, client gone) ------------------------------------------


def test_cancelled_durable_commit_still_reaches_disk_and_leaks_no_disk_slot(tmp_path):
    """A Commit(durable) whose RPC is cancelled while its disk write is queued: the write must
    run to its end (the host slot stays pinned until then) and leave the key writable; before
    the fix the write was orphaned: its key stayed in the writer set forever (never durable
    again) and its disk slot was lost."""
    async def body(store, disk, lid, sid):
        k = key(1)
        grants = await store.allocate(sid, lid, [k])
        write_slot(store, grants[0].offset, payload(k))
        gate = Gate(disk._writer, 1)
        task = await parked(store.commit(sid, [grants[0].grant_id], [], durable=True))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        await settle(store, disk)
        assert not disk._writing, "a cancelled write must not leave its key marked in flight"
        # the key can be made durable (it is already, since the write ran to its end)
        await store.allocate(sid, lid, [k], durable=True)
        assert store.on_disk(lid, [k]) == [True]
        assert disk.used_bytes == len(disk.entries) * BLOCK
        drop_from_host(store, k)
        assert await get(store, sid, lid, [k]) == [payload(k)]
    run(tmp_path, body, disk_blocks=8)


def test_cancelled_allocate_during_demotion_leaks_no_host_slot(tmp_path):
    """An Allocate cancelled while its victims' demotion is awaited: its reservation must not
    keep host slots nobody owns, and the victims' pending work must finish."""
    async def body(store, disk, lid, sid):
        await put(store, sid, lid, [key(i) for i in range(4)])           # host full
        gate = Gate(disk._writer, 1)
        task = await parked(store.allocate(sid, lid, [key(10), key(11)]))  # evicts 2, demotes them
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        await settle(store, disk)
        assert no_grant_held(store), "the cancelled allocate's grants were given back"
        host_slots_accounted(store.host)
        assert store.host.used_bytes == len(store.host.entries) * BLOCK
        # the capacity is all usable again, and the demoted blocks come back byte-exact
        assert store.lookup(lid, [key(0), key(1)]) == [Tier.DISK, Tier.DISK]
        await put(store, sid, lid, [key(20 + i) for i in range(4)])
        assert await get(store, sid, lid, [key(0), key(1)]) == [payload(key(0)), payload(key(1))]
    run(tmp_path, body, disk_blocks=16)


def test_cancelled_acquire_during_promotion_leaks_no_pin(tmp_path):
    """An Acquire cancelled while its promotion read is queued: the read finishes into a slot
    nobody else can get meanwhile, and the leases it took for the gone caller are released."""
    async def body(store, disk, lid, sid):
        await put(store, sid, lid, [key(i) for i in range(4)])
        await put(store, sid, lid, [key(4 + i) for i in range(4)])      # 0..3 demoted to disk
        assert store.lookup(lid, [key(0)]) == [Tier.DISK]
        gate = Gate(disk._io, 1)
        task = await parked(store.acquire(sid, lid, [key(0), key(4)]))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        await settle(store, disk)
        assert not store.sessions[sid].leases
        assert all(e.pins == 0 for e in store.host.held()), "a lease of the cancelled acquire is still held"
        assert all(e.pins == 0 for e in disk.entries.values())
        host_slots_accounted(store.host)
        assert await get(store, sid, lid, [key(0), key(4)]) == [payload(key(0)), payload(key(4))]
    run(tmp_path, body, disk_blocks=16)


# -- Evict of a key while it is promoted -------------------------------------------------------


def test_evict_during_promotion_does_not_bring_the_block_back(tmp_path):
    """Evict answers that the key is gone; a promotion of it already reading from disk must not
    make it visible in host afterwards."""
    async def body(store, disk, lid, sid):
        await put(store, sid, lid, [key(i) for i in range(4)])
        await put(store, sid, lid, [key(4 + i) for i in range(4)])      # 0..3 demoted to disk
        gate = Gate(disk._io, 1)
        task = await parked(store.prefetch(lid, [key(0)]))
        assert store.evict(lid, [key(0)]) == 1
        assert store.lookup(lid, [key(0)]) == [None]
        gate.open()
        assert await task == 0
        assert store.lookup(lid, [key(0)]) == [None], "an evicted key came back through its promotion"
        await settle(store, disk)
        host_slots_accounted(store.host)
        assert all(e.pins == 0 for e in disk.entries.values())
    run(tmp_path, body, disk_blocks=16)


def test_evict_during_durable_write_does_not_leave_the_block_on_disk(tmp_path):
    """Evict during a durable commit's disk write: the block must not appear on disk after the
    Evict answered (the commit then reports it not durable)."""
    async def body(store, disk, lid, sid):
        k = key(1)
        grants = await store.allocate(sid, lid, [k])
        write_slot(store, grants[0].offset, payload(k))
        gate = Gate(disk._writer, 1)
        task = await parked(store.commit(sid, [grants[0].grant_id], [], durable=True))
        assert store.evict(lid, [k]) == 1
        gate.open()
        done = await task
        assert (done.committed, done.durable) == (1, 0)
        await settle(store, disk)
        assert store.lookup(lid, [k]) == [None], "an evicted key came back through its durable write"
        assert store.on_disk(lid, [k]) == [False]
        host_slots_accounted(store.host)
    run(tmp_path, body, disk_blocks=16)


# -- a tmpfs that cannot back slots (fallocate fails) ------------------------------------------


@pytest.fixture
def failing_backing(monkeypatch):
    """``BackingJob.run`` (posix_fallocate of fresh slots) fails with ENOSPC while ``fail[0]``."""
    real = BackingJob.run
    fail = [True]
    calls = []

    def run_(self: BackingJob) -> None:
        calls.append(sum(r[2] for r in self.ranges))
        if fail[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self)

    monkeypatch.setattr(BackingJob, "run", run_)
    return fail, calls


def test_failed_pool_prefault_leaves_no_slot_counted_as_backed(tmp_path, failing_backing):
    """RegisterLayout whose pool prefault fails answers RESOURCE_EXHAUSTED; a retry must not
    then hand out slots that were never allocated (a client writing one would SIGBUS)."""
    fail, calls = failing_backing

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * BLOCK, "race"), prefault=True)
        try:
            with pytest.raises(StoreError) as ei:
                await store.register_layout(LAYOUT)
            assert ei.value.code is Code.RESOURCE_EXHAUSTED
            assert store.host.backed_bytes == 0
            fail[0] = False
            lid = (await store.register_layout(LAYOUT)).layout_id
            sid = store.open_session("test", os.getpid()).session_id
            calls.clear()
            grants = await store.allocate(sid, lid, [key(1), key(2)])
            assert [g.status for g in grants] == [GrantStatus.GRANTED, GrantStatus.GRANTED]
            assert sum(calls) == 2 * BLOCK, "the granted slots were never fallocated"
        finally:
            store.close()

    with shm_tempdir() as shm:
        asyncio.run(main())


def test_promotion_into_unbackable_slots_is_a_miss_and_leaks_nothing(tmp_path, failing_backing):
    """A promotion whose fresh host slots cannot be fallocated: a miss (not INTERNAL), the disk
    copy stays, and the reserved slots are not lost."""
    fail, _ = failing_backing
    fail[0] = False

    async def body(store, disk, lid, sid):
        await put(store, sid, lid, [key(0)], durable=True)
        assert store.on_disk(lid, [key(0)]) == [True]
        assert store.evict(lid, [key(0)]) == 2
        await put(store, sid, lid, [key(1)], durable=True)
        drop_from_host(store, key(1))                                    # on disk only; its slot free
        fail[0] = True
        # key 2 takes the one backed free slot; promoting key 1 needs a fresh one
        await put(store, sid, lid, [key(2)])
        out = await store.acquire(sid, lid, [key(1)])
        assert [x.hit for x in out] == [False]
        assert store.counters[Count.PROMOTIONS_NO_SPACE] == 1
        assert store.lookup(lid, [key(1)]) == [Tier.DISK]
        assert not any(e.pins for e in disk.entries.values())
        host_slots_accounted(store.host)
        fail[0] = False
        assert await get(store, sid, lid, [key(1)]) == [payload(key(1))]
    run(tmp_path, body, disk_blocks=16, prefault=False)


def test_session_closed_while_fresh_slots_fail_to_back_lists_each_slot_once(tmp_path, monkeypatch):
    """The session ends while its Allocate's fallocate runs, then the fallocate fails: every slot
    must end up exactly once in free or holes (twice would hand one slot to two writers)."""
    started, proceed = threading.Event(), threading.Event()

    def run_(self: BackingJob) -> None:
        started.set()
        proceed.wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body(store, disk, lid, sid):
        monkeypatch.setattr(BackingJob, "run", run_)
        task = asyncio.ensure_future(store.allocate(sid, lid, [key(1), key(2)]))
        await until(started.is_set, "the fallocate to start")
        store.close_session(sid)
        proceed.set()
        with pytest.raises(StoreError) as ei:
            await task
        assert ei.value.code is Code.CANCELLED
        host_slots_accounted(store.host)
        assert store.host.used_bytes == 0
    run(tmp_path, body, prefault=False)


# -- the Transfer service: a RegisterKV whose caller goes away while handles are opened ---------


def test_register_kv_cancelled_while_opening_leaves_no_registration_open(tmp_path):
    """The engine dies (its RPC is cancelled) while the daemon opens its KV allocations in an
    executor thread: the handles that thread opens must be closed (``close_kv``), not orphaned.
    The host stand-in's maps would go with garbage collection; the CUDA engine's IPC handles
    would stay open, so the test checks the contract: every opened memory is closed."""
    kv_fd, ring_fd = sealed_memfd("kvtier-test-kv", 4 * BLOCK), sealed_memfd("kvtier-test-ring", 8 * 8)
    kv_ino = os.fstat(kv_fd).st_ino
    layout = Layout.flat(BLOCK, num_blocks=4)

    async def body(store, disk, lid, sid):
        engine = HostCopyEngine(1)
        transfers = Transfers(store, {"host": engine}, threads=1)
        try:
            req = KVRegistration(sid, layout, "host", [AllocationRef(4 * BLOCK, fd=kv_fd)], [TensorRef(0, 0)], 8,
                                 event_ring_fd=ring_fd)
            await transfers.register(req)                        # a first one: pool attached, layout known
            # opening takes a while (cudaIpcOpenMemHandle can): hold the real open_kv until released
            opening, go = threading.Event(), threading.Event()
            real_open = engine.open_kv

            opened, closed = [], []
            real_close = engine.close_kv

            def slow_open(*args):
                opening.set()
                go.wait(5)
                mem = real_open(*args)
                opened.append(mem)
                return mem

            def close(mem):
                closed.append(mem)
                real_close(mem)

            engine.open_kv, engine.close_kv = slow_open, close
            task = asyncio.ensure_future(transfers.register(req))
            await until(opening.is_set, "the KV memory to be opening")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            go.set()
            # the open itself runs on a thread, not a loop task: wait for it to return (bounded)
            await until(lambda: len(opened) == 1, "the cancelled registration's open to return")
            await settle(store)
            store.close_session(sid)                             # the engine's session ends
            await settle(store)
            c = store.counters
            assert not transfers.registrations
            # every KV memory opened is closed explicitly (CUDA IPC handles are not freed by GC)
            await until(lambda: all(m in closed for m in opened), "the opened KV memory to be closed")
            assert len(opened) == 1 and [m for m in opened if m not in closed] == [], "opened KV memory never closed"
            assert c[Count.KV_HANDLES_OPENED] == c[Count.KV_HANDLES_CLOSED], c.counts
            assert c[Count.KV_EVENTS_OPENED] == c[Count.KV_EVENTS_CLOSED], c.counts
            with open("/proc/self/maps") as fh:  # (the inode column)
                assert f" {kv_ino} " not in fh.read(), "an engine allocation is still mapped by the daemon"
        finally:
            await transfers.close()
    try:
        run(tmp_path, body)
    finally:
        os.close(kv_fd)
        os.close(ring_fd)


def test_slots_of_a_session_closed_during_fallocate_are_not_handed_out_unbacked(tmp_path, monkeypatch):
    """The session ends while its Allocate's fallocate runs: another client's Allocate meanwhile
    must not be handed those slots (their memory may never be allocated: a write would SIGBUS
    on a full tmpfs); once the fallocate is done they are free again."""
    started, proceed = threading.Event(), threading.Event()
    real = BackingJob.run
    first = [True]

    def run_(self: BackingJob) -> None:
        if first[0]:
            first[0] = False
            started.set()
            proceed.wait(5)
        real(self)

    async def body(store, disk, lid, sid):
        monkeypatch.setattr(BackingJob, "run", run_)
        task = asyncio.ensure_future(store.allocate(sid, lid, [key(1), key(2)]))
        await until(started.is_set, "the fallocate to start")
        store.close_session(sid)
        other = store.open_session("other", os.getpid()).session_id
        grants = await store.allocate(other, lid, [key(3)])
        assert grants[0].granted and grants[0].offset not in (0, BLOCK), \
            "a slot whose fallocate is still running was handed to another client"
        proceed.set()
        with pytest.raises(StoreError) as ei:
            await task
        assert ei.value.code is Code.CANCELLED
        store.close_session(other)
        host_slots_accounted(store.host)
        assert store.host.used_bytes == 0
    run(tmp_path, body, prefault=False)


def test_drain_waits_for_requests_whose_callers_were_cancelled(tmp_path):
    """Daemon shutdown cancels calls past the grace period; drain (before the store closes its
    files) waits for their disk work, so nothing runs against closed files."""
    async def body(store, disk, lid, sid):
        grants = await store.allocate(sid, lid, [key(1)])
        write_slot(store, grants[0].offset, payload(key(1)))
        gate = Gate(disk._writer, 1)
        task = await parked(store.commit(sid, [grants[0].grant_id], [], durable=True))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        drain = asyncio.ensure_future(store.drain())
        await asyncio.sleep(0.05)
        assert not drain.done(), "drain returned while a cancelled request's disk write was pending"
        gate.open()
        await asyncio.wait_for(drain, 10)
        assert not disk._writing and store.on_disk(lid, [key(1)]) == [True]
    run(tmp_path, body, disk_blocks=8)


def test_evict_during_demotion_does_not_leave_the_block_on_disk(tmp_path):
    """Evict of a key whose demotion is being written: the block must not appear on disk
    after Evict answered, and its disk slot is not lost."""
    async def body(store, disk, lid, sid):
        await put(store, sid, lid, [key(i) for i in range(4)])
        gate = Gate(disk._writer, 1)
        task = await parked(store.allocate(sid, lid, [key(10), key(11)]))  # demotes 0 and 1
        store.evict(lid, [key(0)])
        gate.open()
        grants = await task
        for k, g in zip([key(10), key(11)], grants, strict=True):
            write_slot(store, g.offset, payload(k))
        await store.commit(sid, [g.grant_id for g in grants], [], durable=False)
        await settle(store, disk)
        assert store.lookup(lid, [key(0), key(1)]) == [None, Tier.DISK], "an evicted key came back through its demotion"
        assert disk.used_bytes == len(disk.entries) * BLOCK
        assert await get(store, sid, lid, [key(1)]) == [payload(key(1))]
    run(tmp_path, body, disk_blocks=16)


def test_concurrent_allocates_cannot_pass_the_quota_together(tmp_path):
    """Tenant and session quotas of 8 blocks; 6 Allocates of 8 keys each at once, for a tenant
    whose pool is not prefaulted (each awaits its slots' fallocate): one is granted, the others
    are refused RESOURCE_EXHAUSTED. The quota was checked before that await and charged after
    it, so all 6 passed (48 blocks held)."""
    from kvtier.daemon.sessions import Limits

    async def main(shm: str) -> None:
        store = BlockStore(HostTier(shm, 64 * BLOCK, "q"), prefault=True,
                           limits=Limits(session_quota=8 * BLOCK, tenant_quota=8 * BLOCK))
        await store.register_layout(LAYOUT)
        reg = await store.register_layout(LAYOUT, "b")  # the second pool: never prefaulted
        sess = store.open_session("c", os.getpid(), "b")

        async def alloc(j: int):
            return await store.allocate(sess.session_id, reg.layout_id, [key(j * 100 + i) for i in range(8)])
        results = await asyncio.gather(*[alloc(j) for j in range(6)], return_exceptions=True)
        granted = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, StoreError)]
        assert len(granted) == 1 and len(refused) == 5, results
        assert all(e.code == Code.RESOURCE_EXHAUSTED for e in refused)
        assert sess.held_bytes == 8 * BLOCK == store.sessions.tenant_bytes["b"]
        store.close()

    with shm_tempdir() as shm:
        asyncio.run(main(shm))

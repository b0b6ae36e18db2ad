"""Registration and copy races of the daemon's Transfer side that a CUDA copy engine exposes.
The CUDA engine cannot run here, so these run the
real store, host tier and Transfers with the host copy engine made to behave as the CUDA one
does where it matters: its pool attach pins (the host tier must never punch a pinned pool), and
a registration's close cannot interrupt its waits (``cancel`` does nothing on CUDA)."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from _wait import until
from attacks_sessions import BLOCK, in_process, registration

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.gpu import KVRegistration, TransferOrder
from kvtier.daemon.sessions import Limits
from kvtier.tiers.copy_engine import AllocationRef, HostCopyEngine, TensorRef, populate_mapping
from kvtier.tiers.host import PoolMapping
from kvtier.tiers.layout import Layout

pytestmark = pytest.mark.timeout(60)


def key(i: int) -> bytes:
    return b"gpuraces" + i.to_bytes(24, "big")   # 32 bytes: the longest key


class PinningEngine(HostCopyEngine):
    """The host copy engine, pinning its pool as the CUDA one does; the attach waits for ``go``."""

    backend = "cuda"  # (what Transfers reads: mark the pool registered while a registration uses it)

    def __init__(self) -> None:
        super().__init__(1)
        self.started, self.go = threading.Event(), threading.Event()
        self.pinned: set[str] = set()

    def attach_pool(self, path: str, size: int) -> float:
        self.started.set()
        assert self.go.wait(20)
        self.pinned.add(path)
        return 0.0

    def detach_pool(self, path: str) -> None:
        self.pinned.discard(path)


class UncancellableEngine(HostCopyEngine):
    """The host copy engine, with the CUDA engine's ``cancel`` (none), counting copies issued."""

    def __init__(self) -> None:
        super().__init__(1)
        self.issued: list[int] = []

    def cancel(self, memory) -> None:
        pass

    def copy(self, memory, pool_path, plan, direction, slot, seq, wait_written):
        self.issued.append(seq)
        return super().copy(memory, pool_path, plan, direction, slot, seq, wait_written)


def run(engine, body, limits: Limits | None = None) -> None:
    in_process(None, body, limits, engine)


def test_a_registration_cancelled_while_its_pool_is_pinned_keeps_the_pool_unpunchable() -> None:
    """RegisterKV cancelled (the engine gone, its deadline) while the copy engine pins the host
    pool: the pinning thread goes on. The pool stays marked until that attach has ended and
    been undone (unmarked at once, the host tier could punch holes under pages the GPU has
    pinned, and a later registration would reuse the stale pinning)."""
    engine = PinningEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        call = asyncio.ensure_future(transfers.register(registration(sid, kv_fd, ring_fd)))
        await until(engine.started.is_set, "the attach to start")
        (cls,) = store.host.classes.values()
        assert cls.key in store.host._registered
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert cls.key in store.host._registered, "a pool still being pinned was left open to punching"
        engine.go.set()
        await until(lambda: not transfers._pool_users and transfers._idle_pins, "the attach to end")
        # pinned, idle: still marked (never punched) until another pool needs its memory
        assert engine.pinned and cls.key in store.host._registered
        assert await transfers._unpin_idle("", 0)
        assert not engine.pinned and cls.key not in store.host._registered

    run(engine, body)


def test_a_pin_outlives_a_registerkv_whose_deadline_it_outlasted_and_the_retry_takes_it_over() -> None:
    """Pinning a large pool takes minutes (0.085 s/GiB measured on the H200), longer than a
    RegisterKV's deadline (the vLLM worker's kvtier_timeout_s, 2 s). The cancelled call's pin
    stays, and a retry while it still runs waits for it on no thread of its own; the retry takes
    it over, with no second pin (a pin undone with its call would make every retry pin anew and
    be cancelled again: the engine would never register)."""
    engine = PinningEngine()
    attaches = []
    real_attach = engine.attach_pool

    def attach(path, size):
        attaches.append(path)
        return real_attach(path, size)

    engine.attach_pool = attach

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        first = asyncio.ensure_future(transfers.register(registration(sid, kv_fd, ring_fd)))
        await until(engine.started.is_set, "the pin to start")
        first.cancel()                                  # its deadline passed
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = asyncio.ensure_future(transfers.register(registration(sid, kv_fd, ring_fd)))
        await asyncio.sleep(0.2)
        assert not retry.done() and len(attaches) == 1, "the retry started a second pin"
        engine.go.set()                                 # the pin ends
        reg = await asyncio.wait_for(retry, 10)
        assert reg.registration_id and len(attaches) == 1 and engine.pinned
        (cls,) = store.host.classes.values()
        assert cls.key in store.host._registered and not transfers._idle_pins

    run(engine, body)


def test_no_copy_is_issued_for_a_registration_whose_session_ended() -> None:
    """An offload waiting behind an older transfer in its event slot when the engine's session
    ends: once the older one ended, the offload checks, after its allocate, that the
    registration is not closing, and copies nothing (a copy into the gone engine's memory is
    undefined behaviour on CUDA, and a sticky CUDA error breaks the daemon's context for every
    engine). (The engine here does nothing on
    ``cancel``, so only that re-check can stop the copy.)"""
    engine = UncancellableEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        rid = reg.registration_id
        older = asyncio.ensure_future(transfers.offload(     # its "KV written" never comes (1 s wait)
            TransferOrder(sid, rid, [key(200)], np.array([0]), 0, 5, wait_written=True)))
        await until(lambda: engine.issued == [5], "the older offload to wait for its KV")
        newer = asyncio.ensure_future(transfers.offload(
            TransferOrder(sid, rid, [key(201)], np.array([1]), 0, 9, wait_written=True)))
        await asyncio.sleep(0.05)
        store.close_session(sid)                              # the engine is gone
        for call in (older, newer):
            with pytest.raises(StoreError) as e:
                await asyncio.wait_for(call, 10)
            assert e.value.code in (Code.CANCELLED, Code.DEADLINE_EXCEEDED)
        assert engine.issued == [5], "a copy was issued into the memory of an engine whose session had ended"
        assert store.lookup(reg.layout_id, [key(200), key(201)]) == [None, None]

    run(engine, body, Limits(transfer_wait_s=1))


def test_an_onboard_is_not_held_up_by_offloads_waiting_for_their_kv() -> None:
    """Offloads hold a copy thread while they wait for the engine's "KV written" record (up to
    a forward pass, or --transfer-wait-s). With as many of them as copy threads, an onboard, on
    which a request waits, could not even start until one ended. Onboards now have threads of
    their own."""
    engine = HostCopyEngine(1)

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        rid = reg.registration_id
        waiting = [asyncio.ensure_future(transfers.offload(   # (their records never come: 10 s waits)
            TransferOrder(sid, rid, [key(300 + i)], np.array([i]), i, 5, wait_written=True))) for i in range(2)]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiting)
        got = await asyncio.wait_for(transfers.onboard(
            TransferOrder(sid, rid, [key(310)], np.array([3]), 3, 6, wait_written=False)), 5)
        assert [st.name for st in got.status] == ["MISSING"]
        assert not any(w.done() for w in waiting), "(the offloads ended first: the check proved nothing)"
        store.close_session(sid)
        for w in waiting:
            with pytest.raises(StoreError):
                await asyncio.wait_for(w, 10)

    run(engine, body, Limits(transfer_wait_s=10))


# -- a pinned pool is resident whole -------------------------------------------------------------

class PopulatingEngine(PinningEngine):
    """The pinning engine that, as the CUDA one does, makes the whole pool file resident."""

    def __init__(self) -> None:
        super().__init__()
        self.go.set()
        self.maps: dict[str, PoolMapping] = {}

    def attach_pool(self, path: str, size: int) -> float:
        pool = PoolMapping(path, size)
        populate_mapping(pool.mm, size, 2)
        self.maps[path] = pool
        return super().attach_pool(path, size)

    def detach_pool(self, path: str) -> None:
        self.maps.pop(path).close()
        super().detach_pool(path)


def resident(host) -> int:
    """Bytes the host tier's pool files really hold (tmpfs blocks allocated)."""
    return sum(os.fstat(c.fd).st_blocks * 512 for c in host.classes.values())


def test_a_pinned_pool_counts_whole_so_two_block_sizes_never_take_the_node_past_capacity() -> None:
    """The daemon's first layout (here a block size a host-memory client uses) gets its pool
    file allocated whole (--host-prefault). A GPU engine of another block size then has its
    pool pinned whole too: the first pool's unused memory is given back before the pin, the
    pinned file counts whole, and the first block size gets only what is left of the budget
    (here: nothing), so the node never holds twice --host-capacity."""
    engine = PopulatingEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        host = store.host
        await store.register_layout(Layout.flat(2 * BLOCK), DEFAULT_TENANT)  # (prefaulted whole)
        (first,) = host.classes.values()
        assert resident(host) == first.pool_bytes == host.capacity
        await transfers.register(registration(sid, kv_fd, ring_fd))
        pinned = next(c for c in host.classes.values() if c is not first)
        assert engine.maps, "the pool was not pinned"
        assert resident(host) <= host.capacity, f"the node holds {resident(host)} B of pools, over the capacity"
        assert host.backed_bytes == resident(host) == pinned.pool_bytes
        got = host.reserve(first, [key(i) for i in range(4)], 2 * BLOCK)
        got.backing.run()
        assert got.entries == [None] * 4, "another block size was given memory the pinned pool holds"
        assert resident(host) <= host.capacity
        # the pinned class's own slots are all usable, with no memory added
        mine = host.reserve(pinned, [key(100 + i) for i in range(16)], BLOCK)
        mine.backing.run()
        assert None not in mine.entries and resident(host) == host.capacity

    run(engine, body)


def test_a_pool_that_cannot_be_pinned_whole_within_capacity_is_refused_and_nothing_is_pinned() -> None:
    """Another block size holds blocks: pinning this layout's pool whole would go past
    --host-capacity, so RegisterKV is refused with the reason, before anything is pinned (the
    other class's free slots were given back first)."""
    engine = PopulatingEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        host = store.host
        other = host.size_class(2 * BLOCK)
        held = host.reserve(other, [key(i) for i in range(3)], 2 * BLOCK)
        held.backing.run()
        for e in held.entries:
            assert e is not None and host.commit(e)
        spare = host.reserve(other, [key(50)], 2 * BLOCK)  # a slot handed out and given back: free
        spare.backing.run()
        host.abort(spare.entries[0])
        assert len(other.free) == 1
        with pytest.raises(StoreError) as e:
            await transfers.register(registration(sid, kv_fd, ring_fd))
        assert e.value.code == Code.FAILED_PRECONDITION and "--host-capacity" in str(e.value)
        assert not engine.maps and not host._registered and not transfers._pool_users
        assert not other.free and resident(host) == 3 * 2 * BLOCK, "the other class's free slot was kept"
        host.remove([e.bkey for e in held.entries])
        await transfers.register(registration(sid, kv_fd, ring_fd))  # room again: pinned
        assert engine.pinned and resident(host) <= host.capacity

    run(engine, body)


def test_an_idle_pin_is_undone_after_idle_pin_s_so_other_block_sizes_get_memory_again() -> None:
    """A pin kept after its last registration (for a retry or a restarting engine) holds the
    pool's memory; host-memory clients of another block size get none meanwhile, so it is undone
    after ``idle_pin_s`` unused, and the memory goes to the other class again."""
    engine = PopulatingEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        host = store.host
        transfers.idle_pin_s = 0.3
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        (pinned,) = host.classes.values()
        other = host.size_class(2 * BLOCK)
        assert host.reserve(other, [key(1)], 2 * BLOCK).entries == [None]   # all of it pinned
        await transfers.unregister(sid, reg.registration_id)
        assert engine.pinned and pinned.key in host._registered             # idle, still pinned
        await until(lambda: not engine.pinned, "the idle pin to be undone")
        await until(lambda: pinned.key not in host._registered, "the pool to be unmarked")
        got = host.reserve(other, [key(2)], 2 * BLOCK)
        got.backing.run()
        host.finish_eviction()
        assert got.entries[0] is not None, "the other block size still got no memory"
        assert resident(host) <= host.capacity

    run(engine, body)


# -- idle pins under cancellation -----------------------------------------------------------------

class CountingEngine(HostCopyEngine):
    """Counts a pool's attaches as CudaCopyEngine does (users + 1 on a pinned pool; unpinned when
    detaches bring it to 0); the attach waits for ``go``."""

    backend = "cuda"

    def __init__(self) -> None:
        super().__init__(1)
        self.go, self.started = threading.Event(), threading.Event()
        self.go.set()
        self.users: dict[str, int] = {}
        self.pins = 0  # pins made (cudaHostRegister calls)
        self._lock = threading.Lock()

    def attach_pool(self, path: str, size: int) -> float:
        self.started.set()
        assert self.go.wait(20)
        with self._lock:
            self.users[path] = self.users.get(path, 0) + 1
            self.pins += self.users[path] == 1
        return 0.0

    def detach_pool(self, path: str) -> None:
        with self._lock:
            self.users[path] -= 1
            if not self.users[path]:
                del self.users[path]


def q_registration(sid: int, kv_fd: int, ring_fd: int):
    """A registration of another block size (another pool) on the same engine memory."""
    return KVRegistration(sid, Layout.flat(2 * BLOCK, num_blocks=2), "host", [AllocationRef(4 * BLOCK, fd=kv_fd)],
                          [TensorRef(0, 0)], 8, event_ring_fd=ring_fd)


def test_a_retry_cancelled_while_it_waits_for_an_earlier_pin_stays_cancelled() -> None:
    engine = CountingEngine()
    engine.go.clear()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        first = asyncio.ensure_future(transfers.register(registration(sid, kv_fd, ring_fd)))
        await until(engine.started.is_set, "the pin to start")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        retry = asyncio.ensure_future(transfers.register(registration(sid, kv_fd, ring_fd)))
        await asyncio.sleep(0.1)
        retry.cancel()                      # its own deadline, while it waits for the first pin
        await asyncio.sleep(0.1)
        engine.go.set()
        with pytest.raises(asyncio.CancelledError):
            await retry
        await until(lambda: transfers._idle_pins and not transfers._pool_users, "the first pin to end idle")
        assert not transfers.registrations, "a cancelled RegisterKV left a registration open"
        assert engine.pins == 1 and sum(engine.users.values()) == 1

    run(engine, body)


def test_a_registration_cancelled_while_it_undoes_an_idle_pin_still_undoes_it_whole() -> None:
    """Cancelled while the idle pool's detach waits for a transfer thread: the detach goes on
    and unmarks the pool when it has ended (a detach that never ran would leave the pool pinned
    with nothing referring to it, later unmarked while still pinned: open to punching)."""
    engine = CountingEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        host = store.host
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        (p,) = host.classes.values()
        await transfers.unregister(sid, reg.registration_id)           # idle, pinned
        busy = threading.Event()
        blockers = [transfers._executor.submit(busy.wait) for _ in range(2)]  # every transfer thread busy
        q = asyncio.ensure_future(transfers.register(q_registration(sid, kv_fd, ring_fd)))
        await asyncio.sleep(0.1)
        q.cancel()                                                     # its deadline
        await asyncio.gather(q, return_exceptions=True)
        busy.set()
        for b in blockers:
            b.result(5)
        await until(lambda: p.path not in engine.users, "the idle pool's detach to run")
        await until(lambda: p.key not in host._registered, "the unpinned pool to be unmarked")
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        assert engine.pins >= 2 and engine.users.get(p.path) == 1, "a stale pin was reused"

    run(engine, body)


def test_a_registration_refused_anyway_keeps_the_idle_pin() -> None:
    """The idle pool holds cached blocks, so undoing its pin cannot make room for another pool:
    that pool is refused, and the pin kept for the restarting engine is kept too."""
    engine = CountingEngine()

    async def body(store, transfers, sid, kv_fd, ring_fd) -> None:
        host = store.host
        reg = await transfers.register(registration(sid, kv_fd, ring_fd))
        (p,) = host.classes.values()
        held = host.reserve(p, [key(i) for i in range(12)], BLOCK)    # 12 of 16 slots hold blocks
        for e in held.entries:
            assert host.commit(e)
        await transfers.unregister(sid, reg.registration_id)
        with pytest.raises(StoreError) as e:
            await transfers.register(q_registration(sid, kv_fd, ring_fd))
        assert e.value.code == Code.FAILED_PRECONDITION
        assert engine.users.get(p.path) == 1 and transfers._idle_pins and p.key in host._registered

    run(engine, body)

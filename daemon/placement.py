"""The tiers below gpu and the movement of blocks between them, decided by the placement policy.

:class:`Placement` holds the host tier, the disk tier (optional) and the node's
:class:`~kvtier.tiers.policy.TierPolicy`. The policy makes every order and rule decision:
which host and disk blocks are evicted first (``victims``, least recently used first), which
host victims are demoted (``demotions``: seen often enough, not on disk yet) and which
blocks a get promotes from disk (``promotions``). This module keeps what the policy cannot
know: pins (the tiers skip pinned victims), bytes across size classes, the I/O, the blocks
tenants retained (:attr:`Placement.retention`: offered as host and disk victims after every
other one), and telling the policy (``on_*``), the counters and the location observers of
every change.

Promises
    A block is visible in host only after its commit, a promoted block only after its
    checksum matched. A host victim is reported gone from host (observers, policy) in the
    loop step that took it, and its slot is not reused before its bytes were copied for its
    demotion (within the disk's write queue's room: into staging memory, then written
    off the serving path) or its demotion finished (beyond the room: seen-often victims). A disk
    read whose checksum fails drops the disk entry (``checksum_failures``) and is a miss. A
    full or failing disk degrades the tier to host-only (``disk_degraded``), never stops the
    daemon. Host evictions (reserve -> demotion -> ``finish_eviction``) are serialised by one
    lock, so a demotion never reads a slot another request had punched. A block whose
    background demotion is in flight is in no tier (a get misses); an Evict of it, or a new
    put of its key, drops that write (it never becomes visible on disk). ``drain`` awaits the
    background demotions; staging memory never exceeds ``demote_queue_bytes``.

Threading: every method runs on the daemon's event loop; blocking work (fallocate, disk I/O) is
awaited in an executor or on the disk tier's threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.daemon.counters import Count, Counters, Flow
from kvtier.daemon.observers import Observers
from kvtier.daemon.retention import Retention
from kvtier.tiers.disk import DiskEntry, DiskTier, ReadOutcome, WritePlan
from kvtier.tiers.host import HostEntry, HostTier, Reservation, SizeClass, payload_checksum
from kvtier.tiers.layout import Layout
from kvtier.tiers.policy import TierPolicy
from kvtier.tiers.vocab import Tier, group_by_fingerprint, key_of

log = logging.getLogger("kvtier.store")

HOST, DISK = Tier.HOST, Tier.DISK


INGEST_INLINE_BYTES = 4 * 1024**2  # ingest batches above this copy on threads
INGEST_THREADS = 2
AHEAD_SCAN = 256  # blocks of the host's eviction end a write-ahead look walks, at most
_INGEST_POOL: ThreadPoolExecutor | None = None


def _ingest_pool() -> ThreadPoolExecutor:
    global _INGEST_POOL  # noqa: PLW0603
    if _INGEST_POOL is None:
        _INGEST_POOL = ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="kvtier-ingest")
    return _INGEST_POOL


def _copy_hash(work: Sequence[tuple[bytes | memoryview, memoryview, int | None]]) -> list[int]:
    """Each payload copied into its slot view; the copy's checksum, or the given one (a payload
    its source verified already)."""
    out = []
    for payload, view, known in work:
        dst = view[:len(payload)]
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(payload, np.uint8))
        out.append(payload_checksum(dst) if known is None else known)
        dst.release()
    return out


async def _copy_hash_spread(work: list[tuple[bytes | memoryview, memoryview, int | None]], nbytes: int) -> list[int]:
    """:func:`_copy_hash` of ``work`` (``nbytes`` in all): inline up to ``INGEST_INLINE_BYTES``,
    else split over the ``INGEST_THREADS`` ingest threads (numpy's copy and xxhash release the
    GIL); the checksums in ``work``'s order."""
    if nbytes <= INGEST_INLINE_BYTES:
        return _copy_hash(work)
    n = min(INGEST_THREADS, len(work))
    loop = asyncio.get_running_loop()
    parts = await asyncio.gather(*(loop.run_in_executor(_ingest_pool(), _copy_hash, work[i::n]) for i in range(n)))
    sums = [0] * len(work)
    for i in range(n):
        sums[i::n] = parts[i]
    return sums


@dataclass(eq=False)
class _Staged:
    """A host victim copied out for its background demotion: what its write needs, captured
    while the victim's slot (and its size class's checksum entry) was still its own."""

    bkey: bytes
    block_bytes: int
    slot_bytes: int
    checksum: int | None = None
    buf: mmap.mmap | None = None  # page-aligned (O_DIRECT), slot_bytes long, once copied
    dropped: bool = False         # evicted, or put again, before its write was planned


class _StagingBuffers:
    """Anonymous mmaps (one per block, ``slot_bytes`` each), kept for reuse (no page faults per
    demotion); at most ``limit`` bytes allocated in all, free ones of other sizes let go first."""

    def __init__(self) -> None:
        self.free: dict[int, list[mmap.mmap]] = {}
        self.allocated = 0

    def take(self, slot_bytes: int, limit: int) -> mmap.mmap:
        free = self.free.get(slot_bytes)
        if free:
            return free.pop()
        for size, bufs in self.free.items():
            while bufs and self.allocated + slot_bytes > limit:
                bufs.pop().close()
                self.allocated -= size
        self.allocated += slot_bytes
        return mmap.mmap(-1, slot_bytes)

    def give(self, buf: mmap.mmap) -> None:
        self.free.setdefault(len(buf), []).append(buf)

    def close(self) -> None:
        for bufs in self.free.values():
            for b in bufs:
                b.close()
        self.free.clear()


class WriteBehind(Protocol):
    """Told of host commits and host victims, to write them elsewhere (the shared store,
    :mod:`kvtier.daemon.remote_store`); ``held`` is what it wrote (the feed's remote tier)."""

    held: Iterable[bytes]

    def committed(self, entries: Sequence[HostEntry]) -> None:
        """Clients' blocks just became visible in host (not those ingested from elsewhere)."""

    def fetched(self, entries: Sequence[HostEntry]) -> None:
        """Blocks ingested from a peer or the store just became visible in host."""

    async def evicted(self, victims: Sequence[HostEntry]) -> None:
        """Host victims, their slots intact until this returns; must not wait on the network."""


class Placement:
    """See the module docstring."""

    def __init__(self, host: HostTier, disk: DiskTier | None, policy: TierPolicy, counters: Counters,
                 observers: Observers) -> None:
        self.host = host
        self.disk = disk
        self.policy = policy
        self.counters = counters
        self.observers = observers
        self.disk_load_gbps = 0.0
        self.disk_load_gbps_of: dict[str, float] = {}  # pool group -> the same, of its own promotions
        self.remote_load_gbps = 0.0  # measured peer/store -> host bandwidth (0: not measured)
        self._evict_lock = asyncio.Lock()
        self.write_behind: WriteBehind | None = None  # the shared store's hooks
        # blocks tenants retained (kvtier.daemon.retention): offered as victims after every other one
        self.retention: Retention | None = None
        # disk admission: every host victim is demoted while the disk writes in flight
        # hold less than this many bytes (0: only the policy's seen-often ones)
        self.demote_queue_bytes = 0
        self._writing_bytes = 0  # bytes of disk writes in flight (demotions, durable writes)
        # demotions within the write queue's room, written in the background (from staging)
        self._staged: dict[bytes, _Staged] = {}
        self._staging = _StagingBuffers()
        self._stage_queue: list[_Staged] = []  # copied, not yet submitted (a staged write is in flight)
        self._staged_writes: set[asyncio.Task] = set()
        # write-ahead: the host's least recently used blocks within this many bytes of
        # eviction are written to disk before they are evicted, from their slots (pinned meanwhile,
        # no copy), while the write queue has room; their eviction then frees the slot at once
        self.demote_ahead_bytes = 0
        self._ahead: asyncio.Task | None = None
        self._demoting: dict[bytes, bool] = {}  # host victims being demoted, not staged yet: dropped?
        self._ahead_queue: collections.deque[bytes] = collections.deque()  # keys taken for the write-ahead, in order
        self._room_freed = asyncio.Event()  # set whenever a disk write in flight ends
        self._stopping = False  # drain or close: no new write-ahead
        self._closed = False
        self._pool_maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        if disk is not None:
            policy.on_write(list(disk.entries))  # restored blocks, oldest write first

    # -- what is held ----------------------------------------------------------------------

    def in_host(self, bkey: bytes) -> bool:
        return bkey in self.host.entries

    def on_disk(self, bkey: bytes) -> bool:
        return self.disk is not None and bkey in self.disk.entries

    def holdings(self) -> list[tuple[Tier, bytes, list[bytes]]]:
        """Every visible block of host and disk as (tier, fingerprint, keys)."""
        out: list[tuple[Tier, bytes, list[bytes]]] = []
        tiers: list[tuple[Tier, Iterable[bytes]]] = [(HOST, self.host.entries)]
        if self.disk is not None:
            tiers.append((DISK, self.disk.entries))
        if self.write_behind is not None:
            tiers.append((Tier.REMOTE, self.write_behind.held))
        for tier, entries in tiers:
            out.extend((tier, fp, keys) for fp, keys in group_by_fingerprint(list(entries)).items())
        return out

    def blocks_of(self, fingerprint: bytes) -> dict[Tier, int]:
        out = {HOST: self.host.per_fp.get(fingerprint, 0)}
        if self.disk is not None:
            out[DISK] = self.disk.per_fp.get(fingerprint, 0)
        return out

    # -- host slots ------------------------------------------------------------------------

    async def reserve(self, cls: SizeClass, bkeys: list[bytes], block_bytes: int,
                      stage_demotions: bool = True) -> list[HostEntry | None]:
        """Grant a host slot per key (None: no room), evicting the policy's victims in order
        (pinned ones are skipped) and demoting those it picks, before any slot is handed out
        (within the disk's write queue's room, with ``stage_demotions``, copied out and written off
        the serving path)."""
        async with self._evict_lock:
            order = self.policy.victims(HOST)
            last = self.retention.victims(order) if self.retention is not None else None
            try:
                res = self.host.reserve(cls, bkeys, block_bytes, order if last is None else last)
            finally:
                if last is not None:
                    last.settle(self.policy.tiers[HOST], self.host.entries)
            if res.victims:
                if last is not None:
                    self.retention.evicted(v.bkey for v in res.victims)  # type: ignore[union-attr]
                self._tell_write_room(res.victims)
                try:
                    await self._host_evicted(res.victims, stage=stage_demotions)
                except BaseException:  # the caller gets the error; the slots granted go back
                    self.host.finish_eviction()
                    fresh = {off for _, off, _ in res.backing.ranges}
                    for e in res.entries:
                        if e is not None:
                            if e.offset in fresh:
                                self.host.unback([e])  # (never backed: not a free slot)
                            else:
                                self.host.abort(e)
                    raise
            self.host.finish_eviction()
            if res.victims and stage_demotions:  # (the window moved; a promotion's: once it is over)
                self._write_ahead_soon()
        return await self._back(res)

    # -- write-ahead -----------------------------------------------------------------------

    def ahead_window(self) -> int:
        """The bytes at the host's eviction end kept written to disk ahead of eviction:
        ``demote_ahead_bytes``, at most a quarter of the host capacity."""
        return min(self.demote_ahead_bytes, self.host.capacity // 4)

    def _write_ahead_soon(self) -> None:
        """Queue the write-ahead window's unwritten blocks, taken now (the policy's rule, see
        :meth:`_ahead_window_blocks`), for the write-ahead task, and start it if it is not
        running. Each newly queued block counts in ``demotions_staged`` in this loop step.
        Blocks still queued from earlier looks (the writer is behind) stay ahead of them, as
        the policy wrote them at their look, unless they left host or are on disk by now
        (counted over)."""
        if not self.demote_ahead_bytes or not self.demote_queue_bytes:
            return
        disk = self.disk
        if disk is None or disk.degraded or self._stopping:
            return
        queue = self._ahead_queue
        new = self._ahead_window_blocks()
        if queue:
            held, on_disk = self.host.entries, disk.entries
            live = [k for k in queue if k in held and k not in on_disk]
            self.counters.add(Count.DEMOTIONS_STAGED_OVER, len(queue) - len(live))
            queued = set(live)
            new = [k for k in new if k not in queued]
            queue.clear()
            queue.extend(live)
        queue.extend(new)
        self.counters.add(Count.DEMOTIONS_STAGED, len(new))
        if queue and self._ahead is None:
            self._ahead = asyncio.ensure_future(self._write_ahead())

    def _ahead_window_blocks(self) -> list[bytes]:
        """The policy's write-ahead rule (:meth:`TierPolicy.ahead`) in bytes: while host has less
        free memory than the window, the keys of the blocks within the window's bytes of the
        eviction end (the policy's victim order) that are not on disk and not pinned (in use),
        in order."""
        disk, host = self.disk, self.host
        assert disk is not None
        window = self.ahead_window()
        if host.capacity - host.used_bytes >= window:
            return []
        return host.unpinned_within(self.policy.victims(HOST), window, AHEAD_SCAN, disk.entries)

    def _ahead_batch(self) -> list[HostEntry]:
        """Take the next batch off the write-ahead queue, in order: up to half the write
        queue's room (at least one block) and never more than the room. Queued blocks gone
        meanwhile (evicted, removed, on disk already, pinned) leave the queue, counted over."""
        disk, host, queue = self.disk, self.host, self._ahead_queue
        assert disk is not None
        limit = self.demote_queue_bytes
        room, half = limit - self._writing_bytes, limit // 2
        out: list[HostEntry] = []
        total = gone = 0
        while queue:
            bkey = queue[0]
            e = host.get(bkey)
            if e is None or bkey in disk.entries or e.pins:
                queue.popleft()
                gone += 1
                continue
            sb = e.cls.slot_bytes
            if sb > limit:  # larger than the whole write queue: never written ahead
                queue.popleft()
                gone += 1
                continue
            if total + sb > room or (out and total + sb > half):
                break
            queue.popleft()
            out.append(e)
            total += sb
        self.counters.add(Count.DEMOTIONS_STAGED_OVER, gone)
        return out

    async def _write_ahead(self) -> None:
        """Write the queued blocks to disk, a batch of up to half the write queue's room at a
        time, waiting for room; the blocks stay in host (pinned while written: an eviction
        passes over them) and are on disk too afterwards."""
        disk = self.disk
        assert disk is not None
        try:
            while self._ahead_queue and not self._stopping and not disk.degraded:
                batch = self._ahead_batch()
                if not batch:
                    if self._ahead_queue:
                        self._room_freed.clear()  # no room: wait until a disk write in flight ends
                        await self._room_freed.wait()
                    continue
                for e in batch:
                    self.host.pin(e)
                try:
                    n = await self.write_to_disk(batch)
                    self.counters.add(Count.DEMOTIONS_AHEAD, n)
                    self.counters.add(Count.DEMOTIONS, n)
                finally:
                    for e in batch:
                        self.host.unpin(e)
                    self.counters.add(Count.DEMOTIONS_STAGED_OVER, len(batch))
        except Exception as e:  # noqa: BLE001 (nobody awaits this task: say it here)
            log.error("write-ahead to disk failed", extra={"error": repr(e)})
        finally:
            self.counters.add(Count.DEMOTIONS_STAGED_OVER, len(self._ahead_queue))  # (stopping, degraded)
            self._ahead_queue.clear()
            self._ahead = None

    def _tell_write_room(self, victims: list[HostEntry]) -> None:
        """Tell the policy how many demotions the disk's write queue takes before it backs up."""
        limit = self.demote_queue_bytes
        if not limit or self.disk is None:
            self.policy.disk_write_room = None
            return
        per = max(v.cls.slot_bytes for v in victims)
        self.policy.disk_write_room = max(0, limit - self._writing_bytes) // per

    async def _back(self, res: Reservation) -> list[HostEntry | None]:
        """Allocate the memory of a reservation's fresh slots (before anyone may write them);
        returns its entries. Where the tmpfs cannot back them (full, or smaller than
        --host-capacity) those slots become holes and their entries None (no space), instead
        of letting a client fault writing them."""
        entries = list(res.entries)
        if not res.backing.ranges:
            return entries
        try:
            await asyncio.get_running_loop().run_in_executor(None, res.backing.run)
        except OSError as err:
            fresh = {off for _, off, _ in res.backing.ranges}
            dropped = [e for e in entries if e is not None and e.offset in fresh]
            self.host.unback(dropped)
            entries = [None if e is not None and e.offset in fresh else e for e in entries]
            if not self.counters[Count.HOST_BACKING_FAILURES]:
                log.error("host pool memory could not be allocated; the tmpfs is fuller than --host-capacity "
                          "allows. Serving with less.", extra={"error": str(err), "shm_dir": self.host.shm_dir})
            self.counters.add(Count.HOST_BACKING_FAILURES, len(dropped))
        return entries

    async def _host_evicted(self, victims: list[HostEntry], stage: bool = True) -> None:
        """Victims left the host tier (their bytes still intact until finish_eviction): report
        them gone from host at once, then demote those the policy picks.

        At once, in the step that took them out of ``host.entries``: while a demotion is
        awaited, the location feed, its snapshots and the key table must not show them in
        host (an acquire there misses), and a commit of another grant for one of them (which
        makes it visible in host again) must come after its removal, not before."""
        bkeys = [v.bkey for v in victims]
        self.counters.evicted(HOST, len(victims))
        already = sum(1 for b in bkeys if b in self.disk.entries) if self.disk is not None else 0
        room = self.policy.disk_write_room
        demote = self.policy.on_evict(HOST, bkeys)
        self.observers.removed_blocks(HOST, bkeys)
        ending = demote  # (those staged end with their background write)
        demoting = self._demoting  # an Evict or a new put of one of them while this awaits drops it
        for b in demote:
            demoting[b] = False
        try:
            if self.write_behind is not None:  # copies what it writes before the slots are reused
                await self.write_behind.evicted(victims)
            if self.disk is None:
                return
            self.counters.add(Count.DEMOTIONS_SKIPPED_COLD, len(victims) - len(demote) - already)
            if demote and self.disk.degraded:
                self.counters.add(Count.DEMOTIONS_SKIPPED_DEGRADED, len(demote))
            elif demote:
                by_key = {v.bkey: v for v in victims}
                n = min(room or 0, len(demote)) if stage else 0  # within the room: off the serving path
                if n:
                    staged = [b for b in demote[:n] if not demoting[b]]
                    ending = [b for b in demote[:n] if demoting[b]] + demote[n:]
                    if staged:
                        await self._stage([by_key[b] for b in staged])  # (from here on, _staged says)
                later = [by_key[b] for b in ending]
                if later:  # seen-often victims beyond the room: written before their slots go
                    await self.host.sealed(later)  # (the last await before they are planned)
                    later = [v for v in later if not demoting[v.bkey]]
                if later:
                    self._submit_staged()  # (after those staged: the disk is written in victim order)
                    self.counters.add(Count.DEMOTIONS, await self.write_to_disk(later))
        finally:
            for b in demote:
                demoting.pop(b, None)
            self.policy.on_demotion_end(ending)

    async def _stage(self, victims: list[HostEntry]) -> None:
        """Copy these victims (slots intact) into staging buffers and queue them for the
        background writer: their slots may be reused as soon as this returns. From now until
        their write is over their bytes count as disk writes in flight (the room), and an
        Evict or a new put of one of them drops its write."""
        items = [_Staged(v.bkey, v.block_bytes, v.cls.slot_bytes) for v in victims]
        for it in items:
            self._staged[it.bkey] = it
        self._writing_bytes += sum(it.slot_bytes for it in items)
        self.counters.add(Count.DEMOTIONS_STAGED, len(items))
        try:
            await self.host.sealed(victims)  # the checksums the payloads must still have
            for it, v in zip(items, victims, strict=True):
                it.checksum = v.checksum
                it.buf = self._staging.take(it.slot_bytes, self.demote_queue_bytes)
            srcs = [self._slot_view(v.cls, v.offset) for v in victims]
            try:
                await self._copy_out([(v, it.buf) for v, it in zip(srcs, items, strict=True)])
            finally:
                for v in srcs:
                    v.release()
        except BaseException:
            self._staged_over(items, [])
            raise
        self._stage_queue.extend(items)
        if not self._staged_writes:  # (else the write in flight submits the queue when it ends)
            self._submit_staged()

    async def _copy_out(self, pairs: list[tuple[memoryview, mmap.mmap | None]]) -> None:
        """The host slots copied into their staging buffers (not hashed: their checksums were
        taken at commit), on the ingest threads (a small batch inline)."""
        dsts = [memoryview(b) for _, b in pairs]  # type: ignore[arg-type]
        try:
            await _copy_hash_spread([(src, d, 0) for (src, _), d in zip(pairs, dsts, strict=True)],
                                    sum(len(d) for d in dsts))
        finally:
            for d in dsts:
                d.release()

    def _submit_staged(self) -> None:
        """Plan and submit every staged block queued so far as one disk write (one fdatasync,
        one index commit; blocks dropped meanwhile left out); a task finishes it. Plan and
        submit are one loop step: the disk writes plans in the order they were made."""
        items, self._stage_queue = self._stage_queue, []
        if not items:
            return
        disk = self.disk
        assert disk is not None
        live = [it for it in items if not it.dropped]
        plan, fut, views = None, None, [memoryview(it.buf) for it in live if it.buf is not None]
        try:
            if live and disk.degraded:
                self.counters.add(Count.DEMOTIONS_SKIPPED_DEGRADED, len(live))
            elif live:
                plan = self._plan_write([(it.bkey, it.block_bytes, it.slot_bytes) for it in live],
                                        [it.checksum for it in live])
                fut = self._submit_planned(plan, views)
        except Exception:
            self._staged_over(items, views)
            raise
        task = asyncio.ensure_future(self._finish_staged(items, views, plan, fut))
        self._staged_writes.add(task)

    async def _finish_staged(self, items: list[_Staged], views: list[memoryview], plan: WritePlan | None,
                             fut: Future[None] | None) -> None:
        """The background half of a staged write: await it, index it, free its room and buffers,
        then submit what was staged meanwhile."""
        try:
            if plan is not None:
                visible = await self._finish_planned(plan, fut)
                self.counters.add(Count.DEMOTIONS, len(visible))
                if plan.mismatched:  # the host slot changed after its commit: not written; the disk
                    self.counters.add(Count.CHECKSUM_FAILURES, len(plan.mismatched))  # side only
        except Exception as e:  # noqa: BLE001 (nobody awaits this task: say it here)
            log.error("background demotion failed", extra={"error": repr(e), "blocks": len(items)})
        finally:
            self._staged_over(items, views)
            self._staged_writes.discard(asyncio.current_task())  # type: ignore[arg-type]
        if not self._closed and not self._staged_writes:
            self._submit_staged()

    def _staged_over(self, items: list[_Staged], views: list[memoryview]) -> None:
        """Staged demotions are over (written, dropped or failed): their room and buffers are free."""
        for v in views:
            v.release()
        self._writing_bytes -= sum(it.slot_bytes for it in items)
        self._room_freed.set()
        self.counters.add(Count.DEMOTIONS_STAGED_OVER, len(items))
        for it in items:
            if self._staged.get(it.bkey) is it:
                del self._staged[it.bkey]
            if it.buf is not None:
                self._staging.give(it.buf)
        self.policy.on_demotion_end([it.bkey for it in items])

    def _drop_staged(self, bkeys: Iterable[bytes]) -> None:
        """These keys were evicted or put again: their background demotions must not make them
        visible on disk (not yet planned: skipped; being written: dropped when done)."""
        disk, demoting = self.disk, self._demoting
        for b in bkeys:
            if b in demoting:  # evicted, its demotion not staged or planned yet
                demoting[b] = True
            it = self._staged.get(b)
            if it is not None and not it.dropped:
                it.dropped = True
                if disk is not None and b not in disk.entries:
                    disk.remove([b])

    async def drain(self) -> None:
        """Wait until the demotions written in the background are over (a write-ahead stops
        after its batch in flight)."""
        self._stopping = True
        while self._staged_writes or self._ahead is not None:
            await asyncio.gather(*list(self._staged_writes), *([self._ahead] if self._ahead else []),
                                 return_exceptions=True)

    def commit(self, entries: Sequence[HostEntry], write_behind: bool = True) -> list[HostEntry]:
        """Make granted entries visible in host (the first commit of a key wins); returns those
        that became visible. ``write_behind``: the store may write them (not blocks that came
        from elsewhere)."""
        done = [e for e in entries if self.host.commit(e)]
        if done and (self._staged or self._demoting):  # put again while its demotion runs: the new copy wins
            self._drop_staged(e.bkey for e in done)
        if done:
            self.policy.on_commit(e.bkey for e in done)
            self.observers.stored_blocks(HOST, (e.bkey for e in done))
            if self.write_behind is not None:
                if write_behind:
                    self.write_behind.committed(done)
                else:
                    self.write_behind.fetched(done)
        return done

    def hit(self, entries: Sequence[HostEntry]) -> None:
        """A get found these host entries."""
        self.policy.on_hit(e.bkey for e in entries)

    # -- disk ------------------------------------------------------------------------------

    def _slot_view(self, cls: SizeClass, offset: int) -> memoryview:
        """The daemon's own view of one host slot (page-aligned: fit for O_DIRECT)."""
        pm = self._pool_maps.get(cls.slot_bytes)
        if pm is None:
            mm = mmap.mmap(cls.fd, cls.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            pm = self._pool_maps[cls.slot_bytes] = (mm, memoryview(mm))
        return pm[1][offset:offset + cls.slot_bytes]

    async def write_to_disk(self, entries: list[HostEntry]) -> int:
        """Write these host blocks to disk and index them; returns how many became visible there.
        The disk's victims are the policy's, in order (pinned ones skipped). The caller keeps
        the blocks' slots intact (pinned, or victims before finish_eviction)."""
        await self.host.sealed(entries)  # the checksums the payloads must still have
        # (an Evict while that awaited removed some: not written; the Evict found them in no tier)
        entries = [e for e in entries if not e.removed]
        plan = self._plan_write([(e.bkey, e.block_bytes, e.cls.slot_bytes) for e in entries],
                                [e.checksum for e in entries])
        srcs = [self._slot_view(e.cls, e.offset) for e in entries]
        writing = sum(e.cls.slot_bytes for e, d in zip(entries, plan.entries, strict=True) if d)
        self._writing_bytes += writing
        try:
            visible = await self._finish_planned(plan, self._submit_planned(plan, srcs))
        finally:
            self._writing_bytes -= writing
            self._room_freed.set()
            for v in srcs:
                v.release()
        if plan.mismatched:  # host payloads written after their commit: dropped, in host too
            self.counters.add(Count.CHECKSUM_FAILURES, len(plan.mismatched))
            bad = {d.bkey for d in plan.mismatched}  # (not a newer copy of the key, put since)
            gone = [e.bkey for e in self.host.remove([e.bkey for e in entries
                                                      if e.bkey in bad and self.host.get(e.bkey) == e])]
            self.policy.on_remove(HOST, gone)
            self.observers.removed_blocks(HOST, gone)
        return len(visible)

    def _plan_write(self, items: list[tuple[bytes, int, int]], sums: list[int | None]) -> WritePlan:
        """Reserve disk slots for (bkey, block_bytes, slot_bytes) items whose payloads must have
        these checksums; the disk's victims (the policy's, in order) are reported gone. The
        caller submits the plan in the same loop step (plans are written in the order made)."""
        disk = self.disk
        assert disk is not None
        order = self.policy.victims(DISK)
        last = self.retention.victims(order) if self.retention is not None else None
        try:
            plan = disk.plan_write(items, order if last is None else last, sums)
        finally:
            if last is not None:
                last.settle(self.policy.tiers[DISK], disk.entries)
        if plan.victims:
            gone = [v.bkey for v in plan.victims]
            if last is not None:
                self.retention.evicted(gone)  # type: ignore[union-attr]
            self.counters.evicted(DISK, len(gone))
            self.policy.on_evict(DISK, gone)
            self.observers.removed_blocks(DISK, gone)
        skipped = sum(1 for d in plan.entries if d is None)
        if skipped and not disk.degraded:
            self.counters.add(Count.DISK_NO_SPACE, skipped)
        return plan

    def _submit_planned(self, plan: WritePlan, srcs: list[memoryview]) -> Future[None] | None:
        """Submit a plan's writes (one source per item; those not planned are left out); None:
        nothing to write."""
        disk = self.disk
        assert disk is not None
        srcs = [v for v, d in zip(srcs, plan.entries, strict=True) if d]
        return disk.submit_write(plan, srcs) if srcs else None

    async def _finish_planned(self, plan: WritePlan, fut: Future[None] | None) -> list[bytes]:
        """Await a submitted plan and index it; returns the keys that became visible on disk
        (policy and observers told). A failing write degrades the tier; the daemon keeps
        serving."""
        disk = self.disk
        assert disk is not None
        if fut is None:
            disk.finish_write(plan, None)
            return []
        error: BaseException | None = None
        try:
            await asyncio.wrap_future(fut)
        except Exception as e:  # any failure degrades the tier; the daemon keeps serving
            error = e
        was_degraded = bool(disk.degraded)
        done = disk.finish_write(plan, error)
        if disk.degraded and not was_degraded:
            self.counters.add(Count.DISK_DEGRADED)
        self.counters.move(Flow.HOST_TO_DISK, sum(d.length for d in done))
        visible = [d.bkey for d in done]
        self.policy.on_write(visible)
        self.observers.stored_blocks(DISK, visible)
        return visible

    async def make_durable(self, bkeys: list[bytes]) -> int:
        """Write the host blocks of ``bkeys`` that are not on disk yet; returns how many of
        ``bkeys`` are on disk and indexed afterwards (their host slots are pinned meanwhile).
        Keys another write already has in flight (a write-ahead, a staged demotion) are not
        written twice: their write is awaited, so that the count says what it made durable."""
        disk = self.disk
        assert disk is not None
        for _ in range(2):  # (once more: a write awaited may have been dropped, by an Evict or a new put)
            todo = [e for e in (self.host.get(b) for b in bkeys if b not in disk.entries) if e is not None]
            if todo and not disk.degraded:
                for e in todo:
                    self.host.pin(e)
                try:
                    await self.write_to_disk(todo)
                finally:
                    for e in todo:
                        self.host.unpin(e)
            waited = False
            while not disk.degraded and any(disk.writing(b) for b in bkeys):
                self._room_freed.clear()  # set as each disk write in flight ends
                await self._room_freed.wait()
                waited = True
            if not waited:
                break
        return sum(1 for b in bkeys if b in disk.entries)

    async def promote(self, layout: Layout, bkeys: list[bytes], cls: SizeClass) -> set[bytes]:
        """Read the blocks the policy promotes among ``bkeys`` (on disk, not in host) into fresh
        host slots of ``cls`` (the layout's tenant's pool), verify them, make them visible in
        host; returns the keys promoted. A checksum failure drops the disk entry (a miss)."""
        disk = self.disk
        if disk is None:
            return set()
        dents = [d for d in (disk.get(b) for b in self.policy.promotions(bkeys)) if d is not None]
        if not dents:
            return set()
        for d in dents:
            disk.pin(d)
        try:
            pairs, results, elapsed = await self._read_into_host(layout, dents, cls)
        finally:
            for d in dents:
                disk.unpin(d)
        promoted: list[bytes] = []
        bad: list[bytes] = []
        for (d, h), outcome in zip(pairs, results, strict=True):
            if d.removed:  # evicted (Evict) while it was read: it must not come back in host
                self.host.abort(h)
            elif outcome is not ReadOutcome.OK:
                self._count_bad_read(d, outcome)
                self.host.abort(h)
                bad.append(d.bkey)
            else:
                h.checksum = d.checksum  # the bytes just verified against it
                if self.host.commit(h):
                    promoted.append(d.bkey)
        if bad:
            gone = [e.bkey for e in disk.remove(bad)]
            self.policy.on_remove(DISK, gone)
            self.observers.removed_blocks(DISK, gone)
        self._measured(sum(d.length for d, _ in pairs), elapsed, cls.group)
        self.counters.add(Count.PROMOTIONS, len(promoted))
        self.counters.move(Flow.DISK_TO_HOST, len(promoted) * layout.block_bytes)
        self.policy.on_promote(promoted)
        self.observers.stored_blocks(HOST, promoted)
        self._write_ahead_soon()  # (after the promotion: the disk's recency order is deterministic)
        return set(promoted)

    async def _read_into_host(self, layout: Layout, dents: list[DiskEntry], cls: SizeClass
                              ) -> tuple[list[tuple[DiskEntry, HostEntry]], list[ReadOutcome], float]:
        """Reserve host slots for the disk entries (as far as there is room) and read them in;
        returns the (disk, host) pairs read, each read's outcome and the seconds it took."""
        disk = self.disk
        assert disk is not None
        # (its victims' demotions end before the promoted blocks are used on disk: the disk's
        # recency order does not depend on which disk I/O finishes first)
        hosts = await self.reserve(cls, [d.bkey for d in dents], layout.block_bytes, stage_demotions=False)
        pairs = [(d, h) for d, h in zip(dents, hosts, strict=True) if h is not None]
        self.counters.add(Count.PROMOTIONS_NO_SPACE, len(dents) - len(pairs))
        views = [self._slot_view(h.cls, h.offset) for _, h in pairs]
        t0 = time.perf_counter()
        try:
            futs = disk.submit_read([d for d, _ in pairs], views)
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        except BaseException:
            for _, h in pairs:
                self.host.abort(h)
            raise
        finally:
            for v in views:
                v.release()
        return pairs, list(results), time.perf_counter() - t0

    def _count_bad_read(self, d: DiskEntry, outcome: ReadOutcome) -> None:
        checksum = outcome is ReadOutcome.CHECKSUM
        self.counters.add(Count.CHECKSUM_FAILURES if checksum else Count.DISK_READ_ERRORS)
        log.warning("disk block dropped: %s", "checksum mismatch" if checksum else "read error",
                    extra={"key": key_of(d.bkey).hex(), "slab": d.slab.path, "slot": d.slot})

    def _measured(self, nbytes: int, elapsed: float, group: str) -> None:
        """A promotion of ``group``'s blocks read ``nbytes`` in ``elapsed`` s: the node's
        measured disk bandwidth (the operator's) and the group's own (its tenant's: what one
        tenant reads does not move another's)."""
        if nbytes and elapsed > 0:
            gbps = nbytes / elapsed / 1e9
            self.disk_load_gbps = gbps if not self.disk_load_gbps else 0.8 * self.disk_load_gbps + 0.2 * gbps
            mine = self.disk_load_gbps_of.get(group, 0.0)
            self.disk_load_gbps_of[group] = gbps if not mine else 0.8 * mine + 0.2 * gbps

    # -- blocks from elsewhere (a peer, the shared store) ----------------------------------

    async def ingest(self, layout: Layout, cls: SizeClass,
                     blocks: Sequence[tuple[bytes, bytes | memoryview, int]], verified: bool = False) -> set[bytes]:
        """Put blocks that arrived from outside this node (a peer daemon, the shared store)
        into fresh host slots of ``cls`` (the layout's tenant's pool) and make them visible;
        ``blocks`` are (packed block id, payload, xxh3-64 checksum the sender took).

        Each payload is copied into its slot and hashed there (the copy the daemon will
        serve): a block is visible only once its length is the layout's and its bytes match
        the sender's checksum; one that does not is dropped and counted
        (``checksum_failures``), never visible. Keys already in host are skipped. Returns the
        keys that became visible in host (observers and the policy are told)."""
        todo = [(b, p, c) for b, p, c in blocks if b not in self.host.entries]
        bad = [b for b, p, _ in todo if len(p) != layout.block_bytes]
        todo = [t for t in todo if len(t[1]) == layout.block_bytes]
        if bad:
            self.counters.add(Count.CHECKSUM_FAILURES, len(bad))
            log.warning("blocks from elsewhere dropped: wrong length", extra={"blocks": len(bad)})
        if not todo:
            return set()
        hosts = await self.reserve(cls, [b for b, _, _ in todo], layout.block_bytes)
        pairs = [(t, h) for t, h in zip(todo, hosts, strict=True) if h is not None]
        # a large batch is copied (and hashed) off the loop; ``verified``: the source
        # hashed each payload as it arrived (the shared store), so the copy is not hashed again
        if pairs and (verified or len(pairs) * layout.block_bytes > INGEST_INLINE_BYTES):
            sums = await self._copy_in(pairs, verified)
        else:
            for (_, payload, _), h in pairs:
                view = self._slot_view(h.cls, h.offset)
                try:
                    view[:len(payload)] = payload
                finally:
                    view.release()
            sums = await self.host.checksums([h for _, h in pairs])
        done: list[HostEntry] = []
        for ((bkey, _, want), h), got in zip(pairs, sums, strict=True):
            if got != want:
                self.counters.add(Count.CHECKSUM_FAILURES)
                log.warning("block from elsewhere dropped: checksum mismatch", extra={"key": key_of(bkey).hex()})
                self.host.abort(h)
                continue
            h.checksum = got
            done.append(h)
        return {e.bkey for e in self.commit(done, write_behind=False)}

    async def _copy_in(self, pairs: list, verified: bool) -> list[int]:
        """(ingest, a large batch) each payload copied into its slot and the slot hashed
        (unless ``verified``), on ``INGEST_THREADS`` threads (numpy's copy and xxhash release
        the GIL); a small batch inline."""
        views = [self._slot_view(h.cls, h.offset) for _, h in pairs]
        work = [(p, v, c if verified else None) for ((_, p, c), _), v in zip(pairs, views, strict=True)]
        try:
            return await _copy_hash_spread(work, len(pairs) * pairs[0][1].block_bytes)
        finally:
            for v in views:
                v.release()

    async def payloads(self, bkeys: Sequence[bytes], verify: bool = True) -> dict[bytes, tuple[bytes, int]]:
        """Copies of the payloads of these blocks that host or disk holds, with their checksums
        (verified: a host payload against its commit checksum, a disk one as it is read), for
        sending to a peer or the store. Blocks held nowhere, or failing verification, are
        left out. ``verify=False`` skips hashing host payloads here and returns each with the
        checksum taken at its commit: for a receiver that verifies every block against that
        checksum before it is visible (a peer's ``ingest``), so a payload changed since its
        commit is dropped there instead, and the bytes are hashed once, not twice."""
        out: dict[bytes, tuple[bytes, int]] = {}
        held = [e for e in (self.host.get(b) for b in bkeys) if e is not None]
        for e in held:
            self.host.pin(e)
        try:
            await self.host.sealed(held)
            sums = await self.host.checksums(held) if verify else [e.checksum for e in held]
            for e, got in zip(held, sums, strict=True):
                if e.checksum is not None and got == e.checksum:
                    view = self._slot_view(e.cls, e.offset)
                    try:
                        out[e.bkey] = (bytes(view[:e.block_bytes]), got)
                    finally:
                        view.release()
        finally:
            for e in held:
                self.host.unpin(e)
        disk = self.disk
        rest = [d for d in (disk.get(b) for b in bkeys if b not in out) if d is not None] if disk else []
        if disk is not None and rest:
            out.update(await self._read_disk_payloads(rest))
        return out

    async def _read_disk_payloads(self, dents: list[DiskEntry]) -> dict[bytes, tuple[bytes, int]]:
        """Read disk blocks into page-aligned buffers (O_DIRECT), verified against their checksums."""
        disk = self.disk
        assert disk is not None
        for d in dents:
            disk.pin(d)
        bufs = [mmap.mmap(-1, d.slab.slot_bytes) for d in dents]
        views = [memoryview(b) for b in bufs]
        out: dict[bytes, tuple[bytes, int]] = {}
        try:
            futs = disk.submit_read(dents, views)
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
            for d, v, outcome in zip(dents, views, results, strict=True):
                if outcome is ReadOutcome.OK and not d.removed:
                    out[d.bkey] = (bytes(v[:d.length]), d.checksum)
                elif outcome is not ReadOutcome.OK:
                    self._count_bad_read(d, outcome)
        finally:
            for d in dents:
                disk.unpin(d)
            for v, b in zip(views, bufs, strict=True):
                v.release()
                b.close()
        return out

    def measured_remote(self, nbytes: int, elapsed: float) -> None:
        """Fold one fetch from a peer or the store (bytes, seconds) into ``remote_load_gbps``."""
        if nbytes and elapsed > 0:
            gbps = nbytes / elapsed / 1e9
            self.remote_load_gbps = gbps if not self.remote_load_gbps else 0.8 * self.remote_load_gbps + 0.2 * gbps

    # -- removal ---------------------------------------------------------------------------

    def remove(self, bkeys: list[bytes]) -> int:
        """Remove these blocks from host and disk (and from background demotions in flight);
        returns the entries removed."""
        if self._staged or self._demoting:
            self._drop_staged(bkeys)
        gone = [e.bkey for e in self.host.remove(bkeys)]
        self.policy.on_remove(HOST, gone)
        self.observers.removed_blocks(HOST, gone)
        n = len(gone)
        if self.disk is not None:
            gone = [e.bkey for e in self.disk.remove(bkeys)]
            self.policy.on_remove(DISK, gone)
            self.observers.removed_blocks(DISK, gone)
            n += len(gone)
        return n

    def close(self) -> None:
        """Close the tiers (after :meth:`drain`; background demotions still running are
        cancelled: never acknowledged, they are lost). A second call does nothing."""
        if self._closed:
            return
        self._closed = self._stopping = True
        pending = list(self._staged_writes) + ([self._ahead] if self._ahead is not None else [])
        for task in pending:
            task.cancel()
        if self._ahead is None:
            for mm, view in self._pool_maps.values():
                view.release()
                mm.close()
            self._pool_maps.clear()
        # (else a write-ahead batch's slot views may still be read on the disk's writer thread:
        # the pool maps stay mapped, and go with the process)
        if self.disk is not None:
            self.disk.close()
        if not pending:  # (else their buffers go with the cancelled tasks)
            self._staging.close()
        self.host.close()

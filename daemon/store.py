"""The daemon's block store: layouts, sessions, grants, leases and placement across tiers.

Owns
    * registered layouts (``layout_id`` -> :class:`Layout`; one id per fingerprint);
    * client sessions and what each holds: *grants* (slots handed out by ``allocate``, not
      yet committed) and *leases* (pins taken by ``acquire``, until ``release``). When a
      session closes, every grant is aborted and every lease released at once;
    * the host tier (:class:`~kvtier.tiers.host.HostTier`) and, when configured, the disk
      tier (:class:`~kvtier.tiers.disk.DiskTier`); blocks are stored under (fingerprint, key);
    * placement between them: host victims seen at least ``demote_min_seen`` times are
      written to disk before their slots are reused (demotion); an acquire or prefetch of a
      block held only on disk reads it into a fresh host slot and verifies its checksum
      before it becomes visible there (promotion; the disk copy stays); a durable commit
      (or every commit, with ``disk_write_through``) is acknowledged once the blocks are on
      disk and indexed;
    * counters (hits and misses per tier, in blocks and tokens; bytes per direction;
      evictions, ...), read by the Stats RPC and the Prometheus endpoint;
    * location observers: every change of what is visible in a tier is reported to each
      observer as ``stored``/``removed`` (tier, fingerprint, keys) after it happens, and
      ``cleared`` when a tier is emptied. The event log and the shared-memory key table
      are observers.

Promises
    A block is visible (``lookup``, ``acquire``) only after its commit; a promoted block only
    after its checksum matched. A slot is never reused while a lease pins it, and a host
    victim's slot is not reused before its demotion finished. A disk read whose checksum
    fails drops the disk entry (counted in ``checksum_failures``) and is a miss. A full or
    failing disk degrades the daemon to host-only (``disk_degraded``), never stops it; a
    durable commit then answers how many blocks did reach disk. ``allocate`` answers
    ``present`` for a key held on disk (nothing to write). A bad request raises
    :class:`StoreError` with a gRPC status code and a message a person can act on, and
    changes nothing.

Threading: every method runs on the daemon's event loop; blocking work (fallocate, disk I/O)
is awaited in an executor. Host evictions (reserve -> demotion -> ``finish_eviction``) are
serialised by one lock, so a demotion never reads a slot another request had punched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc

from kvtier.proto import TIER_BY_NAME
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import CapacityError, HostEntry, HostTier, Reservation, SizeClass
from kvtier.tiers.layout import Layout

log = logging.getLogger("kvtier.store")

KEY_MIN, KEY_MAX = 8, 32
TIERS = ("gpu", "host", "disk")
T = TypeVar("T")


def layout_id_of(fingerprint: bytes) -> int:
    """A layout's id is its fingerprint's first 31 bits: the same on every daemon and across
    restarts, so a client that kept an id from before a restart can never reach another
    layout's blocks with it (it gets FAILED_PRECONDITION and registers again)."""
    return int.from_bytes(fingerprint[:4], "little") & 0x7FFFFFFF or 1


class StoreError(Exception):
    """A request the store refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocationObserver(Protocol):
    """Told of every visibility change, after it happens, on the event loop."""

    def stored(self, tier: str, fingerprint: bytes, keys: Sequence[bytes]) -> None: ...

    def removed(self, tier: str, fingerprint: bytes, keys: Sequence[bytes]) -> None: ...

    def cleared(self, tier: str) -> None: ...


@dataclass(eq=False)
class Grant:
    entry: HostEntry
    layout_id: int
    session_id: int


@dataclass(eq=False)
class Session:
    session_id: int
    client_name: str
    pid: int
    opened_at: float = field(default_factory=time.monotonic)
    grants: dict[int, Grant] = field(default_factory=dict)
    leases: dict[int, HostEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class RegisteredLayout:
    layout_id: int
    layout: Layout


class BlockStore:
    """See the module docstring."""

    def __init__(self, host: HostTier, max_batch_keys: int = 65536, disk: DiskTier | None = None,
                 demote_min_seen: int = 2, disk_write_through: bool = False, prefault: bool = True) -> None:
        self.host = host
        self.prefault = prefault
        self.disk = disk
        self.demote_min_seen = demote_min_seen
        self.disk_write_through = disk_write_through
        self.disk_load_gbps = 0.0
        self._evict_lock = asyncio.Lock()
        self._pool_maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self.max_batch_keys = max_batch_keys
        self.layouts: dict[int, RegisteredLayout] = {}
        self._layout_by_fp: dict[bytes, int] = {}
        self.sessions: dict[int, Session] = {}
        # session, grant and lease ids start at a random point per daemon run, so an id a
        # client kept from before a restart names nothing here instead of someone else's
        self._ids = itertools.count(secrets.randbits(40) << 20)
        self.counters: Counter[str] = Counter()
        self.observers: list[LocationObserver] = []
        self.session_end_hooks: list[Callable[[int], None]] = []  # told each closed session id
        self._grants: dict[int, Grant] = {}
        self._to_end: set[asyncio.Task] = set()  # requests whose caller was cancelled, still running

    async def _run_to_end(self, coro: Awaitable[T], undo: Callable[[T], None] | None = None) -> T:
        """Run a request to its end even when its caller is cancelled (a gRPC deadline, a client
        gone): a cancellation at an ``await`` would leave host slots reserved by nobody, pins
        dropped while a disk thread still reads or writes the slot, and disk writes whose keys
        stay in flight forever. The caller sees the cancellation at once; the request finishes
        on its own, and ``undo`` gives back what it produced for the gone caller (grants, leases)."""
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._to_end.add(task)

            def done(t: asyncio.Task) -> None:
                self._to_end.discard(t)
                if t.cancelled() or t.exception() is not None:
                    return
                if undo is not None:
                    undo(t.result())

            task.add_done_callback(done)
            raise

    # -- layouts and sessions ------------------------------------------------------------

    async def register_layout(self, layout: Layout) -> RegisteredLayout:
        return await self._run_to_end(self._register_layout(layout))

    async def _register_layout(self, layout: Layout) -> RegisteredLayout:
        fp = layout.fingerprint
        lid = self._layout_by_fp.get(fp)
        if lid is not None:
            return self.layouts[lid]
        new_class = layout.slot_bytes not in self.host.classes
        try:
            cls = self.host.size_class(layout.slot_bytes, prefault=self.prefault)
        except CapacityError as e:
            raise StoreError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        job = self.host.prefault_job(cls) if new_class else None
        if job and job.ranges:
            t = time.monotonic()
            try:
                await asyncio.get_running_loop().run_in_executor(None, job.run)
            except OSError as e:
                # nothing of the pool is backed: its slots are handed out as fresh ones (each
                # fallocated first), never as if the prefault had allocated them
                cls.holes.extend(cls.free)
                cls.free.clear()
                raise StoreError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"cannot allocate the {cls.pool_bytes} B host pool in {self.host.shm_dir}: "
                                 f"{e.strerror}; lower --host-capacity or enlarge the tmpfs") from None
            dt = time.monotonic() - t
            log.info("host pool prefaulted", extra={"bytes": cls.pool_bytes, "seconds": round(dt, 3),
                                                    "s_per_gib": round(dt / (cls.pool_bytes / 2**30), 3)})
        if fp in self._layout_by_fp:  # registered by a concurrent call while we awaited
            return self.layouts[self._layout_by_fp[fp]]
        lid = layout_id_of(fp)
        other = self.layouts.get(lid)
        if other is not None:  # two fingerprints share 31 bits: refuse rather than mix them
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"layout id {lid} of fingerprint {fp.hex()} is taken by fingerprint "
                             f"{other.layout.fingerprint.hex()} on this daemon; restart it without one of them")
        reg = RegisteredLayout(lid, layout)
        self.layouts[lid] = reg
        self._layout_by_fp[fp] = lid
        log.info("layout registered", extra={"layout_id": lid, "fingerprint": fp.hex(),
                                             "block_bytes": layout.block_bytes})
        return reg

    def layout(self, layout_id: int) -> RegisteredLayout:
        reg = self.layouts.get(layout_id)
        if reg is None:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"layout_id {layout_id} is not registered on this daemon (it may have "
                             f"restarted): call RegisterLayout first")
        return reg

    def open_session(self, client_name: str, pid: int) -> Session:
        sess = Session(next(self._ids), client_name, pid)
        self.sessions[sess.session_id] = sess
        self.counters["sessions_opened"] += 1
        return sess

    def close_session(self, session_id: int) -> tuple[int, int]:
        """Abort the session's grants and release its leases; returns (grants, leases) reclaimed."""
        sess = self.sessions.pop(session_id, None)
        if sess is None:
            return 0, 0
        for gid, grant in sess.grants.items():
            self._grants.pop(gid, None)
            self.host.abort(grant.entry)
        for entry in sess.leases.values():
            self.host.unpin(entry)
        n = len(sess.grants), len(sess.leases)
        # emptied, so a request still holding this Session (awaiting) finds nothing to give back twice
        sess.grants.clear()
        sess.leases.clear()
        self.counters["grants_reclaimed"] += n[0]
        self.counters["leases_reclaimed"] += n[1]
        for hook in self.session_end_hooks:
            hook(session_id)
        return n

    def session(self, session_id: int) -> Session:
        sess = self.sessions.get(session_id)
        if sess is None:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"session {session_id} is not open: open a Session stream first and keep it open")
        return sess

    # -- validation ----------------------------------------------------------------------

    def check_keys(self, keys: Sequence[bytes], *, unique: bool) -> None:
        if len(keys) > self.max_batch_keys:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{len(keys)} keys in one request; the limit is {self.max_batch_keys} "
                             f"(--max-batch-keys): split the batch")
        for i, k in enumerate(keys):
            if not KEY_MIN <= len(k) <= KEY_MAX:
                raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"key {i} is {len(k)} bytes; keys are {KEY_MIN} to {KEY_MAX} bytes")
        if unique and len(set(keys)) != len(keys):
            dup = next(k for k, n in Counter(keys).items() if n > 1)
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"key {dup.hex()} appears more than once in one batch; send each key once")

    # -- put: allocate, (client writes), commit ------------------------------------------

    async def allocate(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                       durable: bool = False) -> list[tuple[str, int, int]]:
        """Per key: ("granted", grant_id, offset) | ("present", 0, 0) | ("no_space", 0, 0).
        See :meth:`_allocate`; a cancelled caller's grants are aborted once it finishes."""
        return await self._run_to_end(self._allocate(session_id, layout_id, keys, durable),
                                      lambda out: self._drop_grants(session_id, out))

    def _drop_grants(self, session_id: int, out: list[tuple[str, int, int]]) -> None:
        sess = self.sessions.get(session_id)
        if sess is None:
            return  # closing the session aborted them
        for status, gid, _ in out:
            grant = sess.grants.pop(gid, None) if status == "granted" else None
            if grant is not None:
                del self._grants[gid]
                self.host.abort(grant.entry)

    async def _allocate(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                        durable: bool = False) -> list[tuple[str, int, int]]:
        """Per key: ("granted", grant_id, offset) | ("present", 0, 0) | ("no_space", 0, 0).
        With ``durable``, present keys not yet on disk are written there first (see
        :meth:`on_disk` for which made it)."""
        sess = self.session(session_id)
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=True)
        if durable and self.disk is None:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             "durable put needs a disk tier: start kvtierd with --disk-dir")
        layout = reg.layout
        fp = layout.fingerprint
        if durable:
            present = [fp + k for k in keys if fp + k in self.host.entries]
            if present:
                await self._make_durable(present)
        cls = self.host.size_class(layout.slot_bytes)
        disk_entries = self.disk.entries if self.disk is not None else {}
        want = [i for i, k in enumerate(keys) if fp + k not in self.host.entries and fp + k not in disk_entries]
        async with self._evict_lock:
            res = self.host.reserve(cls, [fp + keys[i] for i in want], layout.block_bytes)
            if res.victims:
                await self._evicted(res.victims)
            self.host.finish_eviction()
        entries = await self._back(res)
        if session_id not in self.sessions:  # it ended while a demotion or the fallocate was awaited
            for entry in entries:
                if entry is not None:
                    self.host.abort(entry)
            raise StoreError(grpc.StatusCode.CANCELLED, "session closed during allocate")
        out: list[tuple[str, int, int]] = [("present", 0, 0)] * len(keys)
        for i, entry in zip(want, entries, strict=True):
            if entry is None:
                out[i] = ("no_space", 0, 0)
                continue
            gid = next(self._ids)
            grant = Grant(entry, layout_id, session_id)
            sess.grants[gid] = grant
            self._grants[gid] = grant
            out[i] = ("granted", gid, entry.offset)
        self.counters["grants"] += sum(1 for o in out if o[0] == "granted")
        self.counters["no_space"] += sum(1 for o in out if o[0] == "no_space")
        return out

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
            if not self.counters["host_backing_failures"]:
                log.error("host pool memory could not be allocated; the tmpfs is fuller than --host-capacity "
                          "allows. Serving with less.", extra={"error": str(err), "shm_dir": self.host.shm_dir})
            self.counters["host_backing_failures"] += len(dropped)
        return entries

    async def _evicted(self, victims: list[HostEntry]) -> None:
        """Victims left the host tier (their bytes still intact until finish_eviction): report
        them gone from host at once, then demote those seen often enough to disk.

        At once, in the step that took them out of ``host.entries``: while a demotion is
        awaited, the location feed, its snapshots and the key table must not show them in
        host (an acquire there misses), and a commit of another grant for one of them (which
        makes it visible in host again) must come after its removal, not before."""
        self.counters["evictions_host"] += len(victims)
        self._emit_grouped(self._emit_removed, "host", [v.bkey for v in victims])
        if self.disk is not None:
            hot = [v for v in victims if v.seen >= self.demote_min_seen]
            self.counters["demotions_skipped_cold"] += len(victims) - len(hot)
            on_disk = [d for d in (self.disk.get(v.bkey) for v in hot) if d is not None]
            for d in on_disk:
                self.disk.touch(d)
            todo = [v for v in hot if v.bkey not in self.disk.entries]
            if todo and self.disk.degraded:
                self.counters["demotions_skipped_degraded"] += len(todo)
            elif todo:
                written = await self._write_to_disk(todo)
                self.counters["demotions"] += written

    def _slot_view(self, cls: SizeClass, offset: int) -> memoryview:
        """The daemon's own view of one host slot (page-aligned: fit for O_DIRECT)."""
        pm = self._pool_maps.get(cls.slot_bytes)
        if pm is None:
            mm = mmap.mmap(cls.fd, cls.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            pm = self._pool_maps[cls.slot_bytes] = (mm, memoryview(mm))
        return pm[1][offset:offset + cls.slot_bytes]

    async def _write_to_disk(self, entries: list[HostEntry]) -> int:
        """Write these host blocks to disk and index them; returns how many became visible there.
        The caller keeps their slots intact (pinned, or victims before finish_eviction)."""
        disk = self.disk
        assert disk is not None
        plan = disk.plan_write([(e.bkey, e.block_bytes, e.cls.slot_bytes) for e in entries])
        if plan.victims:
            self.counters["evictions_disk"] += len(plan.victims)
            self._emit_grouped(self._emit_removed, "disk", [v.bkey for v in plan.victims])
        skipped = sum(1 for e, d in zip(entries, plan.entries, strict=True) if d is None)
        if skipped and not disk.degraded:
            self.counters["disk_no_space"] += skipped
        srcs = [self._slot_view(e.cls, e.offset) for e, d in zip(entries, plan.entries, strict=True) if d]
        if not srcs:
            disk.finish_write(plan, None)
            return 0
        error: BaseException | None = None
        try:
            await asyncio.wrap_future(disk.submit_write(plan, srcs))
        except Exception as e:  # any failure degrades the tier; the daemon keeps serving
            error = e
        finally:
            for v in srcs:
                v.release()
        was_degraded = bool(disk.degraded)
        visible = disk.finish_write(plan, error)
        if disk.degraded and not was_degraded:
            self.counters["disk_degraded"] += 1
        self.counters["bytes_host_to_disk"] += sum(d.length for d in visible)
        self._emit_grouped(self._emit_stored, "disk", [d.bkey for d in visible])
        return len(visible)

    async def _promote(self, layout: Layout, bkeys: list[bytes]) -> set[bytes]:
        """Read disk-only blocks into fresh host slots, verify, make them visible in host.
        Returns the keys promoted; a checksum failure drops the disk entry (a miss)."""
        disk = self.disk
        assert disk is not None
        dents = [d for d in dict.fromkeys(disk.get(b) for b in bkeys) if d is not None]
        if not dents:
            return set()
        for d in dents:
            disk.pin(d)
        try:
            cls = self.host.size_class(layout.slot_bytes)
            async with self._evict_lock:
                res = self.host.reserve(cls, [d.bkey for d in dents], layout.block_bytes)
                if res.victims:
                    await self._evicted(res.victims)
                self.host.finish_eviction()
            hosts = await self._back(res)
            pairs = [(d, h) for d, h in zip(dents, hosts, strict=True) if h is not None]
            self.counters["promotions_no_space"] += len(dents) - len(pairs)
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
            elapsed = time.perf_counter() - t0
        finally:
            for d in dents:
                disk.unpin(d)
        promoted: list[bytes] = []
        bad: list[bytes] = []
        for (d, h), status in zip(pairs, results, strict=True):
            if d.removed:  # evicted (Evict) while it was read: it must not come back in host
                self.host.abort(h)
                continue
            if status != "ok":
                self.counters["checksum_failures" if status == "checksum" else "disk_read_errors"] += 1
                log.warning("disk block dropped: %s", "checksum mismatch" if status == "checksum" else "read error",
                            extra={"key": d.bkey[16:].hex(), "slab": d.slab.path, "slot": d.slot})
                self.host.abort(h)
                bad.append(d.bkey)
                continue
            disk.touch(d)
            h.seen = d.hits + 1
            if self.host.commit(h):
                promoted.append(d.bkey)
        if bad:
            removed = disk.remove(bad)
            self._emit_grouped(self._emit_removed, "disk", [e.bkey for e in removed])
        nbytes = sum(d.length for d, _ in pairs)
        if nbytes and elapsed > 0:
            gbps = nbytes / elapsed / 1e9
            self.disk_load_gbps = gbps if not self.disk_load_gbps else 0.8 * self.disk_load_gbps + 0.2 * gbps
        self.counters["promotions"] += len(promoted)
        self.counters["bytes_disk_to_host"] += len(promoted) * layout.block_bytes
        self._emit_grouped(self._emit_stored, "host", promoted)
        return set(promoted)

    async def commit(self, session_id: int, grant_ids: Sequence[int], abort_ids: Sequence[int],
                     durable: bool) -> tuple[int, int]:
        """Abort ``abort_ids``, make ``grant_ids`` visible; returns (committed, on disk). A
        cancelled caller's durable write still runs to its end."""
        return await self._run_to_end(self._commit(session_id, grant_ids, abort_ids, durable))

    async def _commit(self, session_id: int, grant_ids: Sequence[int], abort_ids: Sequence[int],
                      durable: bool) -> tuple[int, int]:
        sess = self.session(session_id)
        for gid in itertools.chain(grant_ids, abort_ids):
            if gid not in sess.grants:
                raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"grant {gid} is not held by session {session_id} (already committed, "
                                 f"aborted, or never granted)")
        if len(set(grant_ids) | set(abort_ids)) != len(grant_ids) + len(abort_ids):
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "a grant id appears twice in one commit")
        if durable and self.disk is None:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             "durable commit needs a disk tier: start kvtierd with --disk-dir")
        durable = durable or self.disk_write_through
        for gid in abort_ids:
            grant = sess.grants.pop(gid)
            del self._grants[gid]
            self.host.abort(grant.entry)
        by_fp: dict[bytes, list[bytes]] = {}
        committed = 0
        bkeys: list[bytes] = []
        for gid in grant_ids:
            grant = sess.grants.pop(gid)
            del self._grants[gid]
            bkeys.append(grant.entry.bkey)
            if self.host.commit(grant.entry):
                committed += 1
                by_fp.setdefault(grant.entry.bkey[:16], []).append(grant.entry.bkey[16:])
                self.counters["bytes_client_to_host"] += grant.entry.block_bytes
        self.counters["commits"] += committed
        for fp, keys in by_fp.items():
            self._emit_stored("host", fp, keys)
        if not durable or self.disk is None:
            return committed, 0
        return committed, await self._make_durable(bkeys)

    def on_disk(self, layout_id: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is on disk and indexed (durable)."""
        if self.disk is None:
            return [False] * len(keys)
        fp = self.layout(layout_id).layout.fingerprint
        return [fp + k in self.disk.entries for k in keys]

    async def _make_durable(self, bkeys: list[bytes]) -> int:
        """Write the host blocks of ``bkeys`` that are not on disk yet; returns how many of
        ``bkeys`` are on disk and indexed afterwards (their host slots are pinned meanwhile)."""
        disk = self.disk
        assert disk is not None
        todo = [e for e in (self.host.get(b) for b in bkeys if b not in disk.entries) if e is not None]
        if todo and not disk.degraded:
            for e in todo:
                self.host.pin(e)
            try:
                await self._write_to_disk(todo)
            finally:
                for e in todo:
                    self.host.unpin(e)
        n = sum(1 for b in bkeys if b in disk.entries)
        self.counters["durable_commits"] += n
        return n

    # -- get: acquire, (client reads), release -------------------------------------------

    async def acquire(self, session_id: int, layout_id: int, keys: Sequence[bytes]) -> list[tuple[int, int, str | None]]:
        """Per key: (lease_id, offset, tier found in) or (0, 0, None) for a miss. Pins each hit.
        A cancelled caller's leases are released once the promotions it started finish."""
        return await self._run_to_end(self._acquire(session_id, layout_id, keys),
                                      lambda out: self._drop_leases(session_id, out))

    def _drop_leases(self, session_id: int, out: list[tuple[int, int, str | None]]) -> None:
        sess = self.sessions.get(session_id)
        if sess is None:
            return
        for lid, _, _ in out:
            entry = sess.leases.pop(lid, None) if lid else None
            if entry is not None:
                self.host.unpin(entry)

    async def _acquire(self, session_id: int, layout_id: int, keys: Sequence[bytes]) -> list[tuple[int, int, str | None]]:
        sess = self.session(session_id)
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        promoted: set[bytes] = set()
        held: list[HostEntry] = []   # host hits, pinned while the rest is promoted, so it cannot evict them
        for k in keys:
            entry = self.host.get(fp + k)
            if entry is not None:
                self.host.touch(entry)
                self.host.pin(entry)
                held.append(entry)
        try:
            if self.disk is not None:
                below = [fp + k for k in keys if fp + k not in self.host.entries and fp + k in self.disk.entries]
                if below:
                    promoted = await self._promote(reg.layout, below)
                    if session_id not in self.sessions:
                        raise StoreError(grpc.StatusCode.CANCELLED, "session closed during acquire")
            return self._lease(sess, reg.layout, keys, promoted)
        finally:
            for entry in held:
                self.host.unpin(entry)

    def _lease(self, sess: Session, layout: Layout, keys: Sequence[bytes],
               promoted: set[bytes]) -> list[tuple[int, int, str | None]]:
        fp = layout.fingerprint
        out: list[tuple[int, int, str | None]] = []
        hits: Counter[str] = Counter()
        for k in keys:
            entry = self.host.get(fp + k)
            if entry is None:
                out.append((0, 0, None))
                continue
            tier = "disk" if entry.bkey in promoted else "host"
            self.host.pin(entry)
            lid = next(self._ids)
            sess.leases[lid] = entry
            out.append((lid, entry.offset, tier))
            hits[tier] += 1
        self._count_hits("acquire", layout, dict(hits), len(keys) - hits.total())
        self.counters["bytes_host_to_client"] += hits.total() * layout.block_bytes
        return out

    def release(self, session_id: int, lease_ids: Sequence[int]) -> None:
        sess = self.session(session_id)
        missing = [lid for lid in lease_ids if lid not in sess.leases]
        if missing:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"lease {missing[0]} is not held by session {session_id} (already released?)")
        if len(set(lease_ids)) != len(lease_ids):
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "a lease id appears twice in one release")
        for lid in lease_ids:
            self.host.unpin(sess.leases.pop(lid))

    # -- lookup and evict ----------------------------------------------------------------

    def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        entries = self.host.entries
        disk_entries = self.disk.entries if self.disk is not None else {}
        out: list[str | None] = ["host" if fp + k in entries else "disk" if fp + k in disk_entries else None
                                 for k in keys]
        hits = Counter(t for t in out if t)
        self._count_hits("lookup", reg.layout, dict(hits), len(keys) - hits.total())
        return out

    def count_table_lookups(self, layout_id: int, hits: dict[str, int], misses: int) -> None:
        """Count lookups a client answered from the key table (reported in batches) as lookups."""
        self._count_hits("lookup", self.layout(layout_id).layout, hits, misses)

    def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        removed = self.host.remove(fp + k for k in keys)
        if removed:
            self._emit_removed("host", fp, [e.bkey[16:] for e in removed])
        n = len(removed)
        if self.disk is not None:
            gone = self.disk.remove(fp + k for k in keys)
            if gone:
                self._emit_removed("disk", fp, [e.bkey[16:] for e in gone])
            n += len(gone)
        self.counters["evicted_by_request"] += n
        return n

    # -- counters and observers ----------------------------------------------------------

    def _count_hits(self, op: str, layout: Layout, hits: dict[str, int], misses: int) -> None:
        c = self.counters
        for tier, n in hits.items():
            if n:
                c[f"{op}_hit_blocks:{tier}"] += n
                c[f"{op}_hit_tokens:{tier}"] += n * layout.block_tokens
        c[f"{op}_miss_blocks"] += misses
        c[f"{op}_miss_tokens"] += misses * layout.block_tokens

    def _emit_stored(self, tier: str, fp: bytes, keys: list[bytes]) -> None:
        for obs in self.observers:
            obs.stored(tier, fp, keys)

    def _emit_removed(self, tier: str, fp: bytes, keys: list[bytes]) -> None:
        for obs in self.observers:
            obs.removed(tier, fp, keys)

    @staticmethod
    def _emit_grouped(emit: Callable[[str, bytes, list[bytes]], None], tier: str, bkeys: Sequence[bytes]) -> None:
        """Call ``emit(tier, fp, keys)`` once per fingerprint among ``bkeys`` (fp + key)."""
        by_fp: dict[bytes, list[bytes]] = {}
        for b in bkeys:
            by_fp.setdefault(b[:16], []).append(b[16:])
        for fp, keys in by_fp.items():
            emit(tier, fp, keys)

    async def prefetch(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """See :meth:`_prefetch`; runs to its end even if the caller is cancelled."""
        return await self._run_to_end(self._prefetch(layout_id, keys))

    async def _prefetch(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """Bring these blocks from disk to host ahead of need; returns how many were promoted.
        Without a disk tier nothing is below host, so nothing is promoted."""
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        if self.disk is None:
            return 0
        fp = reg.layout.fingerprint
        below = [fp + k for k in keys if fp + k not in self.host.entries and fp + k in self.disk.entries]
        if not below:
            return 0
        promoted = await self._promote(reg.layout, below)
        self.counters["prefetch_promotions"] += len(promoted)
        return len(promoted)

    def extra_tier_stats(self) -> list[dict]:
        """TierStats fields of the tiers below host (none without a disk tier)."""
        if self.disk is None:
            return []
        return [{"tier": TIER_BY_NAME["disk"], "capacity_bytes": self.disk.capacity,
                 "used_bytes": self.disk.used_bytes, "blocks": len(self.disk.entries),
                 "load_gbps": self.disk_load_gbps}]

    def holdings(self) -> list[tuple[str, bytes, list[bytes]]]:
        """Every visible block below the gpu tier as (tier, fingerprint, keys), for the
        location log's snapshots; consistent because it runs within one loop step."""
        out = []
        tiers = [("host", self.host.entries)]
        if self.disk is not None:
            tiers.append(("disk", self.disk.entries))
        for tier, entries in tiers:
            by_fp: dict[bytes, list[bytes]] = {}
            for bkey in entries:
                by_fp.setdefault(bkey[:16], []).append(bkey[16:])
            out.extend((tier, fp, keys) for fp, keys in by_fp.items())
        return out

    def blocks_per_layout(self) -> dict[bytes, dict[str, int]]:
        out: dict[bytes, dict[str, int]] = {}
        for bkey in self.host.entries:
            d = out.setdefault(bkey[:16], {})
            d["host"] = d.get("host", 0) + 1
        if self.disk is not None:
            for fp, n in self.disk.per_fp.items():
                out.setdefault(fp, {})["disk"] = n
        return out

    async def drain(self) -> None:
        """Wait for requests whose callers were cancelled (they finish their disk and slot work)."""
        while self._to_end:
            await asyncio.gather(*list(self._to_end), return_exceptions=True)

    def close(self) -> None:
        for sid in list(self.sessions):
            self.close_session(sid)
        for mm, view in self._pool_maps.values():
            view.release()
            mm.close()
        self._pool_maps.clear()
        if self.disk is not None:
            self.disk.close()
        self.host.close()

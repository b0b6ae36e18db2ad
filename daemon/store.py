"""The daemon's block store: the requests of the Node service, on the node's tiers.

:class:`BlockStore` puts the parts together and runs each request from validation to its
typed result (:mod:`kvtier.daemon.results`):

* :class:`~kvtier.daemon.layouts.Layouts`: registered layouts (one id per tenant and
  fingerprint; a tenant's blocks are stored under its tenant fingerprint, so every request
  reaches the caller's tenant's blocks only, and each tenant has its own host pool files);
* :class:`~kvtier.daemon.sessions.Sessions`: client sessions, their grants and leases;
* :class:`~kvtier.daemon.placement.Placement`: the host tier, the disk tier (optional) and
  the movement between them, decided by the node's
  :class:`~kvtier.tiers.policy.TierPolicy` (:attr:`BlockStore.policy`);
* :class:`~kvtier.daemon.device.DeviceTier`: the gpu tier, as engines report it;
* :class:`~kvtier.daemon.retention.Retention`: the blocks tenants retained until a TTL
  (``retain``), which the placement evicts after every other one, within each tenant's
  retention budget;
* :class:`~kvtier.daemon.counters.Counters` and the location
  :class:`~kvtier.daemon.observers.Observers` (the event log, the key table).

Promises
    A block is visible (``lookup``, ``acquire``) only after its commit; a promoted block only
    after its checksum matched. A slot is never reused while a lease pins it. ``allocate``
    answers ``present`` for a key held on disk (nothing to write). A durable commit (or every
    commit, with ``disk_write_through``) is acknowledged once the blocks are on disk and
    indexed, and answers how many did reach disk. A bad request raises
    :class:`~kvtier.daemon.errors.StoreError` with a code and a message a person can act on,
    and changes nothing.

Threading: every method runs on the daemon's event loop. A request runs to its end even when
its caller is cancelled (see :meth:`BlockStore._run_to_end`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

from kvtier.daemon.auth import DEFAULT_TENANT, Principal
from kvtier.daemon.config import Config
from kvtier.daemon.counters import Count, Counters, Flow, Op, TenantCounters
from kvtier.daemon.device import DeviceTier
from kvtier.daemon.errors import Code, StoreError, check_ids, check_keys, check_layout_room
from kvtier.daemon.layouts import Layouts, RegisteredLayout, layout_id_of, split_worker
from kvtier.daemon.observers import Observers
from kvtier.daemon.placement import Placement
from kvtier.daemon.remote import RemoteSource
from kvtier.daemon.results import MISS, NO_SPACE, CommitResult, GrantResult, GrantStatus, LeaseResult
from kvtier.daemon.retention import RetainResult, Retention
from kvtier.daemon.sessions import Limits, Session, Sessions
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import CapacityError, HostEntry, HostTier, PoolFileError, SizeClass
from kvtier.tiers.layout import Layout
from kvtier.tiers.policy import TierPolicy
from kvtier.tiers.vocab import MAX_KEYS_PER_CALL, Tier, key_of, pack_block

log = logging.getLogger("kvtier.store")

T = TypeVar("T")

__all__ = ["BlockStore", "Code", "StoreError", "layout_id_of"]


class BlockStore:
    """See the module docstring."""

    def __init__(self, host: HostTier, max_batch_keys: int = MAX_KEYS_PER_CALL, disk: DiskTier | None = None,
                 demote_min_seen: int = 2, disk_write_through: bool = False, prefault: bool = True,
                 limits: Limits | Config | None = None) -> None:
        self.prefault = prefault
        self.disk_write_through = disk_write_through
        self.max_batch_keys = max_batch_keys
        self.counters = Counters()
        # each tenant's own share of the counters it may read in Stats (hits, misses, puts,
        # evictions it asked for): tenant -> Counters, made when it first counts (only a tenant
        # that registered a layout counts)
        self.tenant_counters: dict[str, TenantCounters] = {}
        self.observers = Observers()
        self.layouts = Layouts()
        # quotas and deadlines of sessions (kvtier.daemon.sessions): kvtierd passes its Config
        self.limits = Limits.from_config(limits) if isinstance(limits, Config) else limits or Limits()
        self.sessions = Sessions(host, self.counters, self.limits)
        # the daemon bounds host and disk in bytes (the tiers ask the policy for victims); the
        # gpu tier is the engines' (``device``), not placed here
        self.policy = TierPolicy(0, None, None if disk is not None else 0, demote_min_seen, host_map=host.recency())
        self.tiers = Placement(host, disk, self.policy, self.counters, self.observers)
        # blocks tenants asked to keep until a TTL (Retain), evicted after every other one
        self.retention = Retention(self.limits.retention_budget, lambda t, what, n: self.counters_of(t).add(what, n))
        self.tiers.retention = self.retention
        self.device = DeviceTier(self.layouts, self.sessions, self.observers, self.counters, max_batch_keys,
                                 workers_per_tenant=self.limits.workers_per_tenant,
                                 blocks_per_worker=self.limits.device_blocks_per_worker)
        self._to_end: set[asyncio.Task] = set()  # requests whose caller was cancelled, still running
        # told of each layout a tenant registers for the first time (the per-tenant feed and
        # key table publish what the disk tier restored under it)
        self.layout_hooks: list[Callable[[RegisteredLayout], None]] = []
        self.key_table_paths: dict[str, str] = {}  # tenant -> its key table (set by the publisher)
        # sources beyond this node (peers, the shared store; kvtier.daemon.remote), asked in order
        self.remotes: list[RemoteSource] = []

    @property
    def host(self) -> HostTier:
        return self.tiers.host

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.disk

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

    # -- layouts and sessions ----------------------------------------------------------------

    async def register_layout(self, layout: Layout, tenant: str = DEFAULT_TENANT) -> RegisteredLayout:
        """Register ``layout`` for ``tenant`` (its pool file is the tenant's own)."""
        return await self._run_to_end(self._register_layout(layout, tenant))

    async def _register_layout(self, layout: Layout, tenant: str) -> RegisteredLayout:
        reg = self.layouts.find_for(tenant, layout)
        if reg is not None:
            return reg
        group = self.layouts.group(tenant)
        new_class = (group, layout.slot_bytes) not in self.host.classes
        lim = self.limits
        check_layout_room(len(self.layouts), len(self.host.classes), new_class, self.layouts.count_of(tenant),
                          sum(1 for g, _ in self.host.classes if g == group), lim.layouts_per_tenant,
                          lim.slot_sizes_per_tenant)
        try:
            cls = self.host.size_class(layout.slot_bytes, prefault=self.prefault, group=group)
        except CapacityError as e:
            raise StoreError(Code.RESOURCE_EXHAUSTED, str(e)) from None
        except PoolFileError as e:
            raise StoreError(Code.FAILED_PRECONDITION, str(e)) from None
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
                raise StoreError(Code.RESOURCE_EXHAUSTED,
                                 f"cannot allocate the {cls.pool_bytes} B host pool in {self.host.shm_dir}: "
                                 f"{e.strerror}; lower --host-capacity or enlarge the tmpfs") from None
            dt = time.monotonic() - t
            log.info("host pool prefaulted", extra={"bytes": cls.pool_bytes, "seconds": round(dt, 3),
                                                    "s_per_gib": round(dt / (cls.pool_bytes / 2**30), 3)})
        known = len(self.layouts)
        reg = self.layouts.add(layout, tenant)  # (or the one a concurrent call registered while we awaited)
        if len(self.layouts) != known:
            log.info("layout registered", extra={"layout_id": reg.layout_id, "fingerprint": layout.fingerprint.hex(),
                                                 "block_bytes": layout.block_bytes, "pool_group": group or None})
            for hook in self.layout_hooks:
                hook(reg)
        return reg

    def layout(self, layout_id: int, tenant: str = DEFAULT_TENANT) -> RegisteredLayout:
        """The tenant's layout of this id (another tenant's id is unknown here)."""
        return self.layouts.get(layout_id, tenant)

    def pool(self, layout: Layout) -> SizeClass:
        """The host pool (size class) a registered layout's blocks live in: its tenant's
        (``layout`` as :class:`RegisteredLayout.layout` has it; a plain layout: the default
        tenant's)."""
        tenant = getattr(layout, "tenant", DEFAULT_TENANT)
        return self.host.size_class(layout.slot_bytes, group=self.layouts.group(tenant))

    def open_tenant_file(self, tenant: str, path: str) -> int:
        """A new descriptor of one of ``tenant``'s files, as a ``RegisterLayoutReply`` names them:
        a host pool file of its pool group (read-write) or its key table (read-only); opened
        ``O_NOFOLLOW | O_CLOEXEC`` and checked to be the very file the daemon made (a pool: the
        same inode as its own descriptor; the key table: a regular file of the daemon's uid).
        Any other path, another tenant's files included, is refused PERMISSION_DENIED with
        the same message, whether or not it exists. The caller closes the descriptor."""
        group = self.layouts.group_of(tenant)
        cls = None if group is None else next(
            (c for c in self.host.classes.values() if c.group == group and c.path == path), None)
        if cls is not None:
            fd = _open_checked(path, os.O_RDWR, os.fstat(cls.fd))
        elif path and self.key_table_paths.get(tenant) == path:
            fd = _open_checked(path, os.O_RDONLY, None)
        else:
            fd = None
        if fd is None:
            raise StoreError(Code.PERMISSION_DENIED, "not a pool file or key table of your tenant: the daemon "
                                                     "hands out only the files its RegisterLayout replies name")
        return fd

    def open_session(self, client_name: str, pid: int, principal: Principal | str | None = None, *,
                     internal: bool = False) -> Session:
        """A session owned by ``principal`` (None: the local caller; a str: the local caller in
        that tenant); ``internal``: the daemon's own (never named over the wire, never
        expires, not counted against ``max_sessions``)."""
        return self.sessions.open(client_name, pid, principal, internal=internal)

    def close_session(self, session_id: int) -> tuple[int, int]:
        """Abort the session's grants and release its leases; returns (grants, leases) reclaimed."""
        return self.sessions.close(session_id)

    def session(self, session_id: int, principal: Principal | None = None) -> Session:
        """The open session; with ``principal`` (a call from the wire) it must be that caller's
        own, else PERMISSION_DENIED (:meth:`Sessions.get`)."""
        return self.sessions.get(session_id, principal)

    def check_keys(self, keys: Sequence[bytes], *, unique: bool) -> None:
        check_keys(keys, self.max_batch_keys, unique=unique)

    # -- put: allocate, (client writes), commit ------------------------------------------------

    async def allocate(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                       durable: bool = False) -> list[GrantResult]:
        """One :class:`GrantResult` per key. See :meth:`_allocate`; a cancelled caller's grants
        are aborted once it finishes."""
        return await self._run_to_end(
            self._allocate(session_id, layout_id, keys, durable),
            lambda out: self.sessions.drop_grants(session_id, [g.grant_id for g in out if g.granted]))

    async def _allocate(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                        durable: bool = False) -> list[GrantResult]:
        """Slots for the keys not held in host or on disk (present ones need nothing). With
        ``durable``, present keys not yet on disk are written there first (``durable`` in
        their results says which made it)."""
        sess = self.session(session_id)
        layout = self.layout(layout_id, sess.tenant).layout
        self.check_keys(keys, unique=True)
        if durable and self.disk is None:
            raise StoreError(Code.FAILED_PRECONDITION, "durable put needs a disk tier: start kvtierd with --disk-dir")
        fp = layout.fingerprint
        bkeys = [pack_block(fp, k) for k in keys]
        tiers = self.tiers
        if durable:
            present = [b for b in bkeys if tiers.in_host(b)]
            if present:
                await tiers.make_durable(present)
        want = [i for i, b in enumerate(bkeys) if not tiers.in_host(b) and not tiers.on_disk(b)]
        cls = self.pool(layout)
        # no more can be granted than the pool has slots (the rest answers NO_SPACE, as always)
        need = min(len(want), cls.nslots) * cls.slot_bytes
        self.sessions.check_quota(sess, need)
        # charged while the reservation is awaited (a demotion, the fallocate), so that the
        # session's and tenant's other Allocates meanwhile see it; the grants are charged below
        self.sessions.hold_quota(sess, need)
        try:
            entries = await tiers.reserve(cls, [bkeys[i] for i in want], layout.block_bytes)
        finally:
            if session_id in self.sessions:  # (else its close refunded everything it held)
                self.sessions.release_quota(sess, need)
        if session_id not in self.sessions:  # it ended while a demotion or the fallocate was awaited
            for entry in entries:
                if entry is not None:
                    self.host.abort(entry)
            raise StoreError(Code.CANCELLED, "session closed during allocate")
        out = [GrantResult(GrantStatus.PRESENT, durable=durable and tiers.on_disk(b)) for b in bkeys]
        got = [(i, entry) for i, entry in zip(want, entries, strict=True) if entry is not None]
        gids = self.sessions.grant(sess, [entry for _, entry in got], len(got) * cls.slot_bytes)
        for i in want:
            out[i] = NO_SPACE
        for (i, entry), gid in zip(got, gids, strict=True):
            out[i] = GrantResult(GrantStatus.GRANTED, gid, entry.offset)
        granted = len(got)
        mine = self.counters_of(sess.tenant)
        mine.add(Count.GRANTS, granted)
        mine.add(Count.NO_SPACE, len(entries) - granted)
        return out

    async def commit(self, session_id: int, grant_ids: Sequence[int], abort_ids: Sequence[int],
                     durable: bool, checksums: Sequence[int] = ()) -> CommitResult:
        """Abort ``abort_ids``, make ``grant_ids`` visible. A cancelled caller's durable write
        still runs to its end. ``checksums``: none, or the xxh3-64 of each granted block's
        payload as the client wrote it (recorded instead of hashed: docs/DESIGN.md "Client
        checksums")."""
        return await self._run_to_end(self._commit(session_id, grant_ids, abort_ids, durable, checksums))

    async def _commit(self, session_id: int, grant_ids: Sequence[int], abort_ids: Sequence[int],
                      durable: bool, checksums: Sequence[int] = ()) -> CommitResult:
        sess = self.session(session_id)
        check_ids(grant_ids, self.max_batch_keys, "grant", more=abort_ids)
        if checksums and len(checksums) != len(grant_ids):
            raise StoreError(Code.INVALID_ARGUMENT, f"{len(checksums)} checksums for {len(grant_ids)} grants; "
                                                    f"send one per grant id, in order, or none")
        self.sessions.check_grants(sess, grant_ids, abort_ids)
        if durable and self.disk is None:
            raise StoreError(Code.FAILED_PRECONDITION, "durable commit needs a disk tier: start kvtierd with --disk-dir")
        stale = [gid for gid in grant_ids if not sess.grants[gid].current]
        if stale:  # its slot changed hands (reclaimed): committing it would publish another block's slot
            self.sessions.drop_grants(session_id, stale)
            raise StoreError(Code.FAILED_PRECONDITION, f"grant {stale[0]} was reclaimed and its slot given to "
                                                       f"another block; nothing committed")
        entries = self.sessions.take_grants(sess, grant_ids, abort_ids)
        done = self.tiers.commit(entries)
        if checksums:  # the client's, taken as it copied: recorded (same loop step as the commit)
            sent = {id(e): c for e, c in zip(entries, checksums, strict=True)}
            self.host.seal(done, [sent[id(e)] for e in done])
        else:
            self.host.seal(done)  # the payload checksums (a large batch's right after, on threads)
        mine = self.counters_of(sess.tenant)
        mine.add(Count.COMMITS, len(done))
        mine.move(Flow.CLIENT_TO_HOST, sum(e.block_bytes for e in done))
        if not (durable or self.disk_write_through) or self.disk is None:
            return CommitResult(len(done), 0)
        n = await self.tiers.make_durable([e.bkey for e in entries])
        mine.add(Count.DURABLE_COMMITS, n)
        return CommitResult(len(done), n)

    def on_disk(self, layout_id: int, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT) -> list[bool]:
        """Whether each key is on disk and indexed (durable)."""
        fp = self.layout(layout_id, tenant).layout.fingerprint
        return [self.tiers.on_disk(pack_block(fp, k)) for k in keys]

    # -- get: acquire, (client reads), release -------------------------------------------------

    async def acquire(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                      verify: bool = False) -> list[LeaseResult]:
        """One :class:`LeaseResult` per key; each hit is pinned. A cancelled caller's leases are
        released once the promotions it started finish. With ``verify``, each host block's
        payload is checked against the checksum taken at its commit first; one that changed is
        dropped and answered as a miss."""
        return await self._run_to_end(
            self._acquire(session_id, layout_id, keys, verify),
            lambda out: self.sessions.drop_leases(session_id, [r.lease_id for r in out]))

    async def _acquire(self, session_id: int, layout_id: int, keys: Sequence[bytes],
                       verify: bool = False) -> list[LeaseResult]:
        sess = self.session(session_id)
        layout = self.layout(layout_id, sess.tenant).layout
        self.check_keys(keys, unique=True)  # a key named twice would be pinned twice
        bkeys = [pack_block(layout.fingerprint, k) for k in keys]
        with self._used_in_host(bkeys) as held:
            promoted = await self.tiers.promote(layout, bkeys, self.pool(layout))
            found_in = dict.fromkeys(promoted, Tier.DISK)
            if self.remotes:
                found_in.update(dict.fromkeys(await self._read_through(sess.tenant, layout, bkeys), Tier.REMOTE))
            if verify and held:  # (promoted blocks were verified as they were read from disk)
                await self._verify_host(held)
            if session_id not in self.sessions:  # it ended while the promotion was awaited
                raise StoreError(Code.CANCELLED, "session closed during acquire")
            return self._lease(sess, layout, bkeys, found_in)

    @contextmanager
    def _used_in_host(self, bkeys: Sequence[bytes]) -> Iterator[list[HostEntry]]:
        """The host entries of ``bkeys``: made the most recent (a use, as a get's hits) and
        pinned while the body runs, so a promotion it awaits cannot evict them."""
        held = [e for e in map(self.host.get, bkeys) if e is not None]
        self.tiers.hit(held)
        for entry in held:
            self.host.pin(entry)
        try:
            yield held
        finally:
            for entry in held:
                self.host.unpin(entry)

    def _lease(self, sess: Session, layout: Layout, bkeys: list[bytes], found_in: Mapping[bytes, Tier]
               ) -> list[LeaseResult]:
        """Pin the host blocks of ``bkeys`` for the caller; ``found_in`` names where a block that
        is in host now came from in this get (disk, remote); the rest were in host."""
        found = [self.host.get(b) for b in bkeys]
        held = [e for e in found if e is not None]
        nbytes = len(held) * self.pool(layout).slot_bytes  # (one layout: one pool)
        self.sessions.check_quota(sess, nbytes)
        lids = iter(self.sessions.lease(sess, held, nbytes))
        out: list[LeaseResult] = []
        hits: Counter[Tier] = Counter()
        for b, entry in zip(bkeys, found, strict=True):
            if entry is None:
                out.append(MISS)
                continue
            tier = found_in.get(b, Tier.HOST)
            out.append(LeaseResult(next(lids), entry.offset, tier))
            hits[tier] += 1
        n = sum(hits.values())
        mine = self.counters_of(sess.tenant)
        mine.looked_up(Op.ACQUIRE, layout.block_tokens, hits, len(bkeys) - n)
        mine.move(Flow.HOST_TO_CLIENT, n * layout.block_bytes)
        return out

    async def _read_through(self, tenant: str, layout: Layout, bkeys: list[bytes]) -> set[bytes]:
        """Fetch the blocks of ``bkeys`` no local tier holds from the read-through sources, in
        order, into host; returns those now in host that way."""
        got: set[bytes] = set()
        for src in self.remotes:
            if not src.read_through:
                continue
            missing = [b for b in bkeys if b not in got and not self.tiers.in_host(b)]
            if not missing:
                break
            got |= await self.fetch_remote(src, tenant, layout, missing)
        return got

    async def fetch_remote(self, src: RemoteSource, tenant: str, layout: Layout, bkeys: list[bytes],
                           from_node: str | None = None) -> set[bytes]:
        """Fetch ``bkeys`` from one source into host (verified); returns those that became visible.
        The bandwidth seen feeds ``remote_load_gbps``."""
        t0 = time.perf_counter()
        stream = getattr(src, "stream", None)
        if stream is None:
            blocks = await src.fetch(tenant, layout, bkeys, from_node)
            if not blocks:
                return set()
            self.tiers.measured_remote(sum(len(p) for _, p, _ in blocks), time.perf_counter() - t0)
            return await self.tiers.ingest(layout, self.pool(layout), blocks, getattr(src, "verified", False))
        # a source that streams (peers): each batch goes into host before the next is read, so
        # a large fetch holds one batch in memory
        got: set[bytes] = set()
        nbytes = 0
        async for batch in stream(tenant, layout, bkeys, from_node):
            nbytes += sum(len(p) for _, p, _ in batch)
            got |= await self.tiers.ingest(layout, self.pool(layout), batch, getattr(src, "verified", False))
        if nbytes:
            self.tiers.measured_remote(nbytes, time.perf_counter() - t0)
        return got

    async def _verify_host(self, held: list[HostEntry]) -> None:
        """Drop the host blocks (pinned by the caller) whose payload changed since their commit."""
        bad = await self.host.verify(list({id(e): e for e in held}.values()))
        bad = [e for e in bad if self.host.get(e.bkey) == e]  # (not replaced while hashed)
        if not bad:
            return
        self.counters.add(Count.CHECKSUM_FAILURES, len(bad))
        for e in bad:
            log.warning("host block dropped: its payload changed after its commit (a write into a slot "
                        "its writer no longer held)", extra={"key": key_of(e.bkey).hex(), "slot": e.slot,
                                                             "pool": e.cls.path})
        gone = [e.bkey for e in self.host.remove([e.bkey for e in bad])]
        self.policy.on_remove(Tier.HOST, gone)
        self.observers.removed_blocks(Tier.HOST, gone)

    def release(self, session_id: int, lease_ids: Sequence[int], principal: Principal | None = None) -> None:
        check_ids(lease_ids, self.max_batch_keys, "lease")
        self.sessions.release(session_id, lease_ids, principal)

    # -- lookup, evict, prefetch ---------------------------------------------------------------

    def lookup(self, layout_id: int, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT) -> list[Tier | None]:
        """The fastest tier holding each of the tenant's keys: gpu (some engine worker of the
        tenant on this node holds it), host, disk; or None."""
        layout = self.layout(layout_id, tenant).layout
        self.check_keys(keys, unique=False)
        fp = layout.fingerprint
        device, tiers = self.device, self.tiers
        out: list[Tier | None] = []
        for k in keys:
            b = pack_block(fp, k)
            out.append(Tier.GPU if device.holds(fp, k) else Tier.HOST if tiers.in_host(b)
                       else Tier.DISK if tiers.on_disk(b) else None)
        hits = Counter(t for t in out if t is not None)
        self.counters_of(tenant).looked_up(Op.LOOKUP, layout.block_tokens, hits, len(keys) - sum(hits.values()))
        return out

    def count_table_lookups(self, layout_id: int, hits: Mapping[Tier, int], misses: int,
                            tenant: str = DEFAULT_TENANT) -> None:
        """Count lookups a client answered from the key table (reported in batches) as lookups."""
        block_tokens = self.layout(layout_id, tenant).layout.block_tokens
        self.counters_of(tenant).looked_up(Op.LOOKUP, block_tokens, hits, misses)

    def evict(self, layout_id: int, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT) -> int:
        """Remove these blocks of the tenant from host and disk; returns the entries removed."""
        fp = self.layout(layout_id, tenant).layout.fingerprint
        self.check_keys(keys, unique=False)
        n = self.tiers.remove([pack_block(fp, k) for k in keys])
        self.counters_of(tenant).add(Count.EVICTED_BY_REQUEST, n)
        return n

    def retain(self, layout_id: int, keys: Sequence[bytes], ttl_s: float, priority: int = 0,
               tenant: str = DEFAULT_TENANT) -> RetainResult:
        """Keep these blocks of the tenant through eviction pressure for ``ttl_s`` seconds, held
        now or stored later within it, within the tenant's retention budget
        (:mod:`kvtier.daemon.retention` has the rules). Refused as a whole or done as a whole."""
        layout = self.layout(layout_id, tenant).layout
        self.check_keys(keys, unique=False)
        fp, tiers = layout.fingerprint, self.tiers
        bkeys = list(dict.fromkeys(pack_block(fp, k) for k in keys))
        mine = self.counters_of(tenant)
        try:
            released, retained = self.retention.retain(tenant, bkeys, layout.slot_bytes, ttl_s, priority)
        except StoreError as e:
            if e.code is Code.RESOURCE_EXHAUSTED:
                mine.add(Count.RETAINS_REFUSED)
            raise
        mine.add(Count.RETAINED_KEYS, len(bkeys))
        held = sum(1 for b in bkeys if tiers.in_host(b) or tiers.on_disk(b))
        return RetainResult(len(bkeys), held, released, retained, self.retention.budget)

    def counters_of(self, tenant: str) -> TenantCounters:
        """The tenant's own counters (:attr:`tenant_counters`, what Stats answers it with);
        what is counted there is counted in :attr:`counters` too."""
        c = self.tenant_counters.get(tenant)
        if c is None:
            c = self.tenant_counters[tenant] = TenantCounters(self.counters)
        return c

    async def evict_durably(self, layout_id: int, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT) -> int:
        """:meth:`evict`, returning once the disk index deletes have committed: an Evict
        answered this way stays done across a crash."""
        n = self.evict(layout_id, keys, tenant)
        if self.disk is not None:
            await asyncio.wrap_future(self.disk.flush())
        return n

    async def prefetch(self, layout_id: int, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT,
                       from_node: str = "") -> int:
        """See :meth:`_prefetch`; runs to its end even if the caller is cancelled."""
        return await self._run_to_end(self._prefetch(layout_id, keys, tenant, from_node))

    async def _prefetch(self, layout_id: int, keys: Sequence[bytes], tenant: str, from_node: str = "") -> int:
        """These blocks of the tenant will be used (or an engine used them without loading
        them): those in host become its most recent (as a get's hits, without pins after the
        call), those only on disk are brought to host; with ``from_node`` (a peer's node id)
        those held in no local tier are fetched from that peer. Returns how many were brought
        to host. Without a disk tier nothing is below host, so nothing is promoted."""
        layout = self.layout(layout_id, tenant).layout
        self.check_keys(keys, unique=False)
        peer = None
        if from_node:
            peer = next((src for src in self.remotes if src.name == "peer"), None)
            if peer is None:
                raise StoreError(Code.FAILED_PRECONDITION, "prefetch from_node needs peers: start kvtierd with "
                                                           "--peers")
        bkeys = list(dict.fromkeys(pack_block(layout.fingerprint, k) for k in keys))
        with self._used_in_host(bkeys):
            promoted = await self.tiers.promote(layout, bkeys, self.pool(layout))
        self.counters.add(Count.PREFETCH_PROMOTIONS, len(promoted))
        if peer is None:
            return len(promoted)
        missing = [b for b in bkeys if not self.tiers.in_host(b) and not self.tiers.on_disk(b)]
        fetched = await self.fetch_remote(peer, tenant, layout, missing, from_node) if missing else set()
        return len(promoted) + len(fetched)

    # -- what is held --------------------------------------------------------------------------

    def holdings(self, tenant: str | None = None, fingerprint: bytes | None = None
                 ) -> list[tuple[Tier, bytes, list[bytes]]]:
        """Every visible block of host and disk as (tier, fingerprint, keys), for the location
        log's snapshots and the key table; consistent because it runs within one loop step.
        Without ``tenant``: every block, under tenant fingerprints (the node's own view). With
        ``tenant``: only the blocks of layouts that tenant registered, under the layouts' own
        fingerprints (what the tenant's clients see); ``fingerprint`` (a tenant fingerprint)
        narrows to one layout. (Device blocks are per worker: :meth:`DeviceTier.holdings`.)"""
        out = self.tiers.holdings()
        if fingerprint is not None:
            out = [h for h in out if h[1] == fingerprint]
        if tenant is None:
            return out
        find = self.layouts.find
        return [(tier, reg.wire_fingerprint, keys) for tier, fp, keys in out
                if (reg := find(fp)) is not None and reg.tenant == tenant]

    def device_holdings(self, tenant: str) -> list[tuple[str, bytes, list[bytes]]]:
        """The tenant's device blocks as (worker id, the layout's own fingerprint, keys)."""
        out = []
        for wkey, fp, keys in self.device.holdings():
            reg = self.layouts.find(fp)
            t, worker = split_worker(wkey)
            if reg is not None and t == tenant and reg.tenant == tenant:
                out.append((worker, reg.wire_fingerprint, keys))
        return out

    def blocks_of(self, fingerprint: bytes) -> dict[Tier, int]:
        """Blocks of one layout (its tenant fingerprint) per tier (gpu: held on some worker's device)."""
        return {Tier.GPU: self.device.blocks_of(fingerprint), **self.tiers.blocks_of(fingerprint)}

    # -- lifecycle -----------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait for requests whose callers were cancelled (they finish their disk and slot work),
        then for the demotions written in the background."""
        while self._to_end:
            await asyncio.gather(*list(self._to_end), return_exceptions=True)
        await self.tiers.drain()

    def close(self) -> None:
        for sid in self.sessions.ids():
            self.close_session(sid)
        self.sessions.close_all()
        self.tiers.close()


def _open_checked(path: str, flags: int, same_as: os.stat_result | None) -> int | None:
    """``path`` opened ``flags | O_NOFOLLOW | O_CLOEXEC``, if it is a regular file of this uid (and
    the same inode as ``same_as``); None otherwise. NOT_FOUND if it cannot be opened (a key
    table that was just closed, say)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StoreError(Code.NOT_FOUND, f"cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
            or (same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino))):
        os.close(fd)
        return None
    return fd

"""The daemon's block store: layouts, sessions, grants, leases and placement across tiers.

Owns
    * registered layouts (``layout_id`` -> :class:`Layout`; one id per fingerprint);
    * client sessions and what each holds: *grants* (slots handed out by ``allocate``, not
      yet committed) and *leases* (pins taken by ``acquire``, until ``release``). When a
      session closes, every grant is aborted and every lease released at once;
    * the host tier (:class:`~kvtier.tiers.host.HostTier`) and, when configured, the disk
      tier; blocks are stored under (fingerprint, key);
    * counters (hits and misses per tier, in blocks and tokens; bytes per direction;
      evictions, ...), read by the Stats RPC and the Prometheus endpoint;
    * location observers: every change of what is visible in a tier is reported to each
      observer as ``stored``/``removed`` (tier, fingerprint, keys) after it happens, and
      ``cleared`` when a tier is emptied. The event log and the shared-memory key table
      are observers.

Promises
    A block is visible (``lookup``, ``acquire``) only after its commit. A slot is never
    reused while a lease pins it. A bad request raises :class:`StoreError` with a gRPC
    status code and a message a person can act on, and changes nothing.

Threading: every method runs on the daemon's event loop; blocking work (fallocate, disk I/O)
is awaited in an executor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from kvtier.tiers.host import CapacityError, HostEntry, HostTier, Reservation
from kvtier.tiers.layout import Layout

log = logging.getLogger("kvtier.store")

KEY_MIN, KEY_MAX = 8, 32
TIERS = ("gpu", "host", "disk")


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

    def __init__(self, host: HostTier, max_batch_keys: int = 65536, prefault: bool = True) -> None:
        self.host = host
        self.prefault = prefault
        self.max_batch_keys = max_batch_keys
        self.layouts: dict[int, RegisteredLayout] = {}
        self._layout_by_fp: dict[bytes, int] = {}
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self.counters: Counter[str] = Counter()
        self.observers: list[LocationObserver] = []
        self.session_end_hooks: list[Callable[[int], None]] = []  # told each closed session id
        self._grants: dict[int, Grant] = {}

    # -- layouts and sessions ------------------------------------------------------------

    async def register_layout(self, layout: Layout) -> RegisteredLayout:
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
                raise StoreError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"cannot allocate the {cls.pool_bytes} B host pool in {self.host.shm_dir}: "
                                 f"{e.strerror}; lower --host-capacity or enlarge the tmpfs") from None
            dt = time.monotonic() - t
            log.info("host pool prefaulted", extra={"bytes": cls.pool_bytes, "seconds": round(dt, 3),
                                                    "s_per_gib": round(dt / (cls.pool_bytes / 2**30), 3)})
        if fp in self._layout_by_fp:  # registered by a concurrent call while we awaited
            return self.layouts[self._layout_by_fp[fp]]
        lid = len(self.layouts) + 1
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
        self.counters["grants_reclaimed"] += len(sess.grants)
        self.counters["leases_reclaimed"] += len(sess.leases)
        for hook in self.session_end_hooks:
            hook(session_id)
        return len(sess.grants), len(sess.leases)

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

    async def allocate(self, session_id: int, layout_id: int, keys: Sequence[bytes]) -> list[tuple[str, int, int]]:
        """Per key: ("granted", grant_id, offset) | ("present", 0, 0) | ("no_space", 0, 0)."""
        sess = self.session(session_id)
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=True)
        layout = reg.layout
        fp = layout.fingerprint
        cls = self.host.size_class(layout.slot_bytes)
        want = [i for i, k in enumerate(keys) if fp + k not in self.host.entries]
        res = self.host.reserve(cls, [fp + keys[i] for i in want], layout.block_bytes)
        out: list[tuple[str, int, int]] = [("present", 0, 0)] * len(keys)
        for i, entry in zip(want, res.entries, strict=True):
            if entry is None:
                out[i] = ("no_space", 0, 0)
                continue
            gid = next(self._ids)
            grant = Grant(entry, layout_id, session_id)
            sess.grants[gid] = grant
            self._grants[gid] = grant
            out[i] = ("granted", gid, entry.offset)
        if res.victims:
            await self._evicted(res.victims)
        self.host.finish_eviction()
        if res.backing.ranges:
            try:
                await asyncio.get_running_loop().run_in_executor(None, res.backing.run)
            except OSError as e:
                self._unbackable(sess, out, res, e)
        n_granted = sum(1 for o in out if o[0] == "granted")
        self.counters["grants"] += n_granted
        self.counters["no_space"] += sum(1 for o in out if o[0] == "no_space")
        # A session that ended while we awaited must not keep its grants.
        if session_id not in self.sessions:
            raise StoreError(grpc.StatusCode.CANCELLED, "session closed during allocate")
        return out

    def _unbackable(self, sess: Session, out: list[tuple[str, int, int]], res: Reservation, err: OSError) -> None:
        """The tmpfs could not back fresh slots (full, or smaller than --host-capacity): refuse
        those grants as no-space instead of letting a client fault writing them."""
        fresh = {off for _, off, _ in res.backing.ranges}
        dropped = []
        for i, (status, gid, off) in enumerate(out):
            if status == "granted" and off in fresh:
                grant = sess.grants.pop(gid)
                del self._grants[gid]
                dropped.append(grant.entry)
                out[i] = ("no_space", 0, 0)
        self.host.unback(dropped)
        if not self.counters["host_backing_failures"]:
            log.error("host pool memory could not be allocated; the tmpfs is fuller than --host-capacity "
                      "allows. Serving with less.", extra={"error": str(err), "shm_dir": self.host.shm_dir})
        self.counters["host_backing_failures"] += len(dropped)

    async def _evicted(self, victims: list[HostEntry]) -> None:
        """Victims left the host tier (their bytes still intact until finish_eviction)."""
        self.counters["evictions_host"] += len(victims)
        by_fp: dict[bytes, list[bytes]] = {}
        for v in victims:
            by_fp.setdefault(v.bkey[:16], []).append(v.bkey[16:])
        for fp, keys in by_fp.items():
            self._emit_removed("host", fp, keys)

    async def commit(self, session_id: int, grant_ids: Sequence[int], abort_ids: Sequence[int],
                     durable: bool) -> tuple[int, int]:
        sess = self.session(session_id)
        for gid in itertools.chain(grant_ids, abort_ids):
            if gid not in sess.grants:
                raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"grant {gid} is not held by session {session_id} (already committed, "
                                 f"aborted, or never granted)")
        if len(set(grant_ids) | set(abort_ids)) != len(grant_ids) + len(abort_ids):
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "a grant id appears twice in one commit")
        if durable:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             "durable commit needs a disk tier: start kvtierd with --disk-dir")
        for gid in abort_ids:
            grant = sess.grants.pop(gid)
            del self._grants[gid]
            self.host.abort(grant.entry)
        by_fp: dict[bytes, list[bytes]] = {}
        committed = 0
        for gid in grant_ids:
            grant = sess.grants.pop(gid)
            del self._grants[gid]
            if self.host.commit(grant.entry):
                committed += 1
                by_fp.setdefault(grant.entry.bkey[:16], []).append(grant.entry.bkey[16:])
                self.counters["bytes_client_to_host"] += grant.entry.block_bytes
        self.counters["commits"] += committed
        for fp, keys in by_fp.items():
            self._emit_stored("host", fp, keys)
        return committed, 0

    # -- get: acquire, (client reads), release -------------------------------------------

    async def acquire(self, session_id: int, layout_id: int, keys: Sequence[bytes]) -> list[tuple[int, int, str | None]]:
        """Per key: (lease_id, offset, tier found in) or (0, 0, None) for a miss. Pins each hit."""
        sess = self.session(session_id)
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        out: list[tuple[int, int, str | None]] = []
        hits = 0
        for k in keys:
            entry = self.host.get(fp + k)
            if entry is None:
                out.append((0, 0, None))
                continue
            self.host.touch(entry)
            self.host.pin(entry)
            lid = next(self._ids)
            sess.leases[lid] = entry
            out.append((lid, entry.offset, "host"))
            hits += 1
        self._count_hits("acquire", reg.layout, {"host": hits}, len(keys) - hits)
        self.counters["bytes_host_to_client"] += hits * reg.layout.block_bytes
        return out

    def release(self, session_id: int, lease_ids: Sequence[int]) -> None:
        sess = self.session(session_id)
        missing = [lid for lid in lease_ids if lid not in sess.leases]
        if missing:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"lease {missing[0]} is not held by session {session_id} (already released?)")
        for lid in lease_ids:
            self.host.unpin(sess.leases.pop(lid))

    # -- lookup and evict ----------------------------------------------------------------

    def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        entries = self.host.entries
        out: list[str | None] = ["host" if fp + k in entries else None for k in keys]
        hits = sum(1 for t in out if t)
        self._count_hits("lookup", reg.layout, {"host": hits}, len(keys) - hits)
        return out

    def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        reg = self.layout(layout_id)
        self.check_keys(keys, unique=False)
        fp = reg.layout.fingerprint
        removed = self.host.remove(fp + k for k in keys)
        if removed:
            self._emit_removed("host", fp, [e.bkey[16:] for e in removed])
        self.counters["evicted_by_request"] += len(removed)
        return len(removed)

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

    async def prefetch(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """Bring these blocks from disk to host ahead of need; returns how many were promoted.
        Without a disk tier nothing is below host, so nothing is promoted."""
        self.layout(layout_id)
        self.check_keys(keys, unique=False)
        return 0

    def extra_tier_stats(self) -> list[dict]:
        """TierStats fields of the tiers below host (none without a disk tier)."""
        return []

    def blocks_per_layout(self) -> dict[bytes, dict[str, int]]:
        out: dict[bytes, dict[str, int]] = {}
        for bkey in self.host.entries:
            d = out.setdefault(bkey[:16], {})
            d["host"] = d.get("host", 0) + 1
        return out

    def close(self) -> None:
        for sid in list(self.sessions):
            self.close_session(sid)
        self.host.close()

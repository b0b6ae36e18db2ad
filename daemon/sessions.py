"""Client sessions and what each holds: grants (slots to write) and leases (pins to read).

A session lives as long as its client's Session stream. *Grants* are host slots handed out by
Allocate and not committed yet; *leases* are pins taken by Acquire until Release. When a
session closes, every grant is aborted and every lease released at once, and the hooks in
:attr:`Sessions.end_hooks` are told its id (the gpu tier and the Transfer registrations
follow their sessions that way).

Ids are capabilities
    Session, grant and lease ids are random (63 bits from the OS's CSPRNG, never 0, never
    sequential, unique among the live ones), so an id a client kept from before a restart names
    nothing here instead of someone else's. A wire id is a uint64, so its own 63 bits are not
    the whole protection: every id is bound to the session that created it, and the session to
    its creator (``owner``: the principal's ``caller``, an unguessable id of at least 128
    random bits from the credential handshake, and ``tenant``). A call naming a session some
    other caller opened is refused PERMISSION_DENIED; a grant or lease id is looked up among
    the calling session's own only, so one some other session holds is answered exactly as one
    nobody holds (INVALID_ARGUMENT, "not held by session S": the reply does not tell whether
    the id is live elsewhere). Guessing a live id is useless without the caller's credential.

Quotas and deadlines (:class:`Limits`)
    The bytes of a session's grants and leases (slot bytes) are capped per session and per
    tenant; a request that would go over is refused RESOURCE_EXHAUSTED naming the quota (and
    changes nothing). Grants and leases of client sessions expire: an expired lease is
    unpinned, and a later Commit or Release naming an expired id is refused DEADLINE_EXCEEDED
    saying so. An expired grant's slot is *withheld*, not given to anyone else: its client may
    still be writing it (a stopped process resumed, a long pause), and a slot reused at once
    would let that late write change another key's committed block. It stays charged to the
    session until the client names the grant again (a late Commit or abort: the client is done
    writing; the call is refused and the slot goes back) or its session ends. Expiry is by buckets of creation time a quarter of the
    deadline wide (one sweep per bucket on the event loop, no per-id timer): an id expires
    between ``ttl`` and ``1.25 * ttl`` after it was handed out. Internal sessions (the Transfer
    service's, whose copies the daemon itself bounds) never expire. The number of open
    Session streams is capped (``max_sessions``), and so is each tenant's share of them
    (``sessions_per_tenant``: one tenant holding its share leaves the rest to the others).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.daemon.auth import DEFAULT_TENANT, Principal
from kvtier.daemon.config import Config
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.errors import Code, StoreError
from kvtier.tiers.host import HostEntry, HostTier

ID_BITS = 63            # wire ids are uint64; 63 bits keep them positive wherever an int64 holds one
MIN_DEFAULT_SESSION_QUOTA = 64 << 20  # the default session quota is half the pool, but not less
EXPIRED_MEMO = 1 << 16  # per session: expired ids remembered (a late call is told why) at most


def random_ids(n: int, taken: Callable[[set[int]], bool] | None = None) -> list[int]:
    """``n`` distinct random ids (see the module docstring), none 0 and, when ``taken`` is
    given, none for which ``taken(ids)`` reports a clash with the live ones."""
    if n <= 0:
        return []
    while True:
        ids = (np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - ID_BITS)).tolist()
        s = set(ids)
        if len(s) == n and 0 not in s and (taken is None or not taken(s)):
            return ids


@dataclass(frozen=True)
class Limits:
    """Quotas and deadlines of the sessions, and the tenants' retention budget (kvtierd sets them
    from its Config: ``--session-quota``, ``--tenant-quota``, ``--grant-ttl-s``, ``--lease-ttl-s``,
    ``--max-sessions``, ``--transfer-wait-s``, ``--retention-budget``). The defaults here (no
    caps, no expiry, no retention) are for stores built in process; the daemon's own defaults
    cap everything."""

    session_quota: int = 0          # bytes of grants + leases per session; 0: no cap
    tenant_quota: int = 0           # bytes of grants + leases per tenant; 0: no cap
    grant_ttl_s: float = math.inf   # a grant not committed by then is aborted
    lease_ttl_s: float = math.inf   # a lease not released by then is unpinned
    max_sessions: int = 0           # open Session streams at most; 0: no cap
    transfer_wait_s: float = math.inf  # a Transfer's wait for the engine's "KV written" record
    # one tenant's shares of per-daemon limits (no tenant may take them all; docs/SECURITY.md)
    sessions_per_tenant: int = 0    # open Session streams of one tenant; 0: no cap of its own
    layouts_per_tenant: int = 0     # layouts one tenant registers; 0: MAX_LAYOUTS
    slot_sizes_per_tenant: int = 0  # slot sizes (pool files) of one tenant's layouts; 0: MAX_SLOT_SIZES
    workers_per_tenant: int = 0     # workers of one tenant reporting device blocks; 0: MAX_WORKERS
    device_blocks_per_worker: int = 0  # device blocks one worker holds (all its layouts); 0: no cap
    kv_registrations_per_session: int = 0  # KV registrations (RegisterKV) one session holds; 0: no cap
    kv_registrations_per_tenant: int = 0   # KV registrations the sessions of one tenant hold; 0: no cap
    retention_budget: int = 0       # slot bytes one tenant may retain (Retain); 0: retention off

    @classmethod
    def from_config(cls, cfg: Config) -> Limits:
        """kvtierd's settings: a quota of 0 there means half (session; at least 64 MiB, or the
        whole of a smaller pool) or all (tenant) of ``--host-capacity``, never no cap (a tenant quota of the whole pool is enforced by the
        pool itself: its allocations answer NO_SPACE, as a full pool always did)."""
        tenant = cfg.tenant_quota or cfg.host_capacity
        # a tenant cap of the whole pool is the pool's own: a full pool answers NO_SPACE, as before
        session = cfg.session_quota or max(cfg.host_capacity // 2, min(cfg.host_capacity, MIN_DEFAULT_SESSION_QUOTA))
        from kvtier.daemon.device import MAX_WORKERS
        from kvtier.tiers.layout import MAX_LAYOUTS, MAX_SLOT_SIZES

        return cls(session, 0 if tenant >= cfg.host_capacity else tenant,
                   cfg.grant_ttl_s, cfg.lease_ttl_s, cfg.max_sessions, cfg.transfer_wait_s,
                   cfg.tenant_share("max_sessions_per_tenant", cfg.max_sessions),
                   cfg.tenant_share("max_layouts_per_tenant", MAX_LAYOUTS),
                   cfg.tenant_share("max_slot_sizes_per_tenant", MAX_SLOT_SIZES),
                   cfg.tenant_share("max_workers_per_tenant", MAX_WORKERS),
                   cfg.max_device_blocks_per_worker, cfg.max_kv_registrations_per_session,
                   cfg.max_kv_registrations_per_tenant
                   or cfg.tenant_share("max_sessions_per_tenant", cfg.max_sessions),
                   cfg.retention_budget_bytes())


class Held:
    """One session's grants (or leases): id -> entry, in buckets by creation time, oldest
    first, so that expiry takes whole buckets (see the module docstring). Dict-like."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: deque[tuple[float, dict[int, HostEntry]]] = deque()

    def add(self, deadline: float, ids: Sequence[int], entries: Sequence[HostEntry]) -> None:
        if not self.buckets or self.buckets[-1][0] != deadline:
            self.buckets.append((deadline, {}))
        self.buckets[-1][1].update(zip(ids, entries, strict=True))

    def get(self, hid: int) -> HostEntry | None:
        for _, d in reversed(self.buckets):  # the newest first: what is committed is mostly recent
            e = d.get(hid)
            if e is not None:
                return e
        return None

    def __contains__(self, hid: object) -> bool:
        return isinstance(hid, int) and self.get(hid) is not None

    def __getitem__(self, hid: int) -> HostEntry:
        e = self.get(hid)
        if e is None:
            raise KeyError(hid)
        return e

    def pop(self, hid: int, default: HostEntry | None = None) -> HostEntry | None:
        for _, d in reversed(self.buckets):
            e = d.pop(hid, None)
            if e is not None:
                return e
        return default

    def first_missing(self, ids: Sequence[int]) -> int | None:
        """The first of ``ids`` not held, or None (set operations: no Python loop per id)."""
        rest = set(ids)
        for _, d in self.buckets:
            if not rest:
                break
            rest -= d.keys()
        if not rest:
            return None
        return next(i for i in ids if i in rest)

    def take(self, ids: Sequence[int]) -> list[HostEntry]:
        """Remove and return the entries of ``ids``, all held (see :meth:`first_missing`)."""
        if len(self.buckets) == 1:
            d = self.buckets[0][1]
            return [d.pop(i) for i in ids]
        return [self.pop(i) for i in ids]  # type: ignore[misc]

    def clashes(self, ids: set[int]) -> bool:
        return any(not d.keys().isdisjoint(ids) for _, d in self.buckets)

    def values(self) -> Iterator[HostEntry]:
        return itertools.chain.from_iterable(d.values() for _, d in self.buckets)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(list(d) for _, d in self.buckets)

    def __len__(self) -> int:
        return sum(len(d) for _, d in self.buckets)

    def __bool__(self) -> bool:
        return any(d for _, d in self.buckets)

    def clear(self) -> None:
        self.buckets.clear()

    def expire(self, now: float) -> list[dict[int, HostEntry]]:
        """Take the buckets whose deadline has passed."""
        out = []
        while self.buckets and self.buckets[0][0] <= now:
            out.append(self.buckets.popleft()[1])
        return out

    def next_deadline(self) -> float:
        return self.buckets[0][0] if self.buckets else math.inf


@dataclass(eq=False)
class Session:
    session_id: int
    client_name: str
    pid: int
    owner: str = ""                    # the creator's Principal.caller (see the module docstring)
    tenant: str = DEFAULT_TENANT       # the creator's Principal.tenant
    internal: bool = False             # the daemon's own (Transfer copies): never named over the wire, never expires
    grants: Held = field(default_factory=Held)   # grant id -> its reserved slot
    leases: Held = field(default_factory=Held)   # lease id -> the pinned entry
    held_bytes: int = 0                # slot bytes of its grants and leases (the quota's measure)
    expired: dict[int, str] = field(default_factory=dict)  # expired id -> "grant" or "lease"
    withheld: dict[int, HostEntry] = field(default_factory=dict)  # expired grants' slots (see the module doc)


_SLOT_BYTES = operator.attrgetter("cls.slot_bytes")


def _slot_bytes(entries: Iterable[HostEntry]) -> int:
    return sum(map(_SLOT_BYTES, entries))


class Sessions:
    """The open sessions (see the module docstring)."""

    def __init__(self, host: HostTier, counters: Counters, limits: Limits | None = None) -> None:
        self.host = host
        self.counters = counters
        self.limits = limits or Limits()
        self._open: dict[int, Session] = {}
        self.streams = 0                            # open sessions that are not internal
        self.tenant_streams: dict[str, int] = {}    # tenant -> its open sessions that are not internal
        self.tenant_bytes: dict[str, int] = {}      # tenant -> slot bytes of its grants and leases
        self.end_hooks: list[Callable[[int], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # (time.monotonic) when it fires

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def __getitem__(self, session_id: int) -> Session:
        return self._open[session_id]

    def ids(self) -> list[int]:
        return list(self._open)

    def new_id(self) -> int:
        return random_ids(1, lambda s: not self._open.keys().isdisjoint(s))[0]

    def open(self, client_name: str, pid: int, principal: Principal | str | None = None, *,
             internal: bool = False) -> Session:
        """A new session owned by ``principal`` (None: in-process, owned by the local caller; a
        str: the local caller in that tenant). A client session over ``max_sessions`` is
        refused RESOURCE_EXHAUSTED."""
        p = Principal(tenant=principal) if isinstance(principal, str) else principal or Principal()
        cap = self.limits.max_sessions
        if not internal and cap and self.streams >= cap:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"{self.streams} Session streams are open; the limit is {cap} (--max-sessions): "
                             f"close idle clients, or raise the limit")
        share = self.limits.sessions_per_tenant
        mine = self.tenant_streams.get(p.tenant, 0)
        if not internal and share and mine >= share:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"this tenant's callers hold {mine} Session streams open; the limit is {share} per "
                             f"tenant (--max-sessions-per-tenant): close idle clients, or raise the limit")
        sess = Session(self.new_id(), client_name, pid, p.caller, p.tenant, internal)
        self._open[sess.session_id] = sess
        if not internal:
            self.streams += 1
            self.tenant_streams[p.tenant] = mine + 1
        self.counters.add(Count.SESSIONS_OPENED)
        return sess

    def get(self, session_id: int, principal: Principal | None = None) -> Session:
        """The open session ``session_id``. With ``principal`` (a call from the wire) it must be
        that caller's own: another caller's is PERMISSION_DENIED, an internal one is not open."""
        sess = self._open.get(session_id)
        if sess is None or (principal is not None and sess.internal):
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"session {session_id} is not open: open a Session stream first and keep it open")
        if principal is not None and (sess.owner != principal.caller or sess.tenant != principal.tenant):
            raise StoreError(Code.PERMISSION_DENIED,
                             f"session {session_id} was opened by another caller: name the session your own "
                             f"Session stream opened")
        return sess

    def close(self, session_id: int) -> tuple[int, int]:
        """Abort the session's grants and release its leases; returns (grants, leases) reclaimed."""
        sess = self._open.pop(session_id, None)
        if sess is None:
            return 0, 0
        if not sess.internal:
            self.streams -= 1
            left = self.tenant_streams.get(sess.tenant, 0) - 1
            if left > 0:
                self.tenant_streams[sess.tenant] = left
            else:
                self.tenant_streams.pop(sess.tenant, None)
        for entry in itertools.chain(sess.grants.values(), sess.withheld.values()):
            self.host.abort(entry)
        for entry in sess.leases.values():
            self.host.unpin(entry)
        n = len(sess.grants) + len(sess.withheld), len(sess.leases)
        # emptied, so a request still holding this Session (awaiting) finds nothing to give back twice
        sess.grants.clear()
        sess.withheld.clear()
        sess.leases.clear()
        sess.expired.clear()
        self._refund(sess, sess.held_bytes)
        self.counters.add(Count.GRANTS_RECLAIMED, n[0])
        self.counters.add(Count.LEASES_RECLAIMED, n[1])
        for hook in self.end_hooks:
            hook(session_id)
        return n

    # -- quotas ----------------------------------------------------------------------------

    def check_quota(self, sess: Session, nbytes: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) ``nbytes`` more of grants or leases over the session's or
        its tenant's quota."""
        if nbytes <= 0:
            return
        lim = self.limits
        if lim.session_quota and sess.held_bytes + nbytes > lim.session_quota:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"session quota: this session holds {sess.held_bytes} B of grants and leases and "
                             f"this request needs {nbytes} B more; the limit is {lim.session_quota} B per "
                             f"session (--session-quota): commit, release or split the batch")
        held = self.tenant_bytes.get(sess.tenant, 0)
        if lim.tenant_quota and held + nbytes > lim.tenant_quota:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"tenant quota: this tenant's sessions hold {held} B of grants and leases and this "
                             f"request needs {nbytes} B more; the limit is {lim.tenant_quota} B per tenant "
                             f"(--tenant-quota): commit or release first")

    def hold_quota(self, sess: Session, nbytes: int) -> None:
        """Count ``nbytes`` against the session's and tenant's quotas until :meth:`release_quota`
        (a request's grants while it awaits them)."""
        self._charge(sess, nbytes)

    def release_quota(self, sess: Session, nbytes: int) -> None:
        self._refund(sess, nbytes)

    def _charge(self, sess: Session, nbytes: int) -> None:
        sess.held_bytes += nbytes
        self.tenant_bytes[sess.tenant] = self.tenant_bytes.get(sess.tenant, 0) + nbytes

    def _refund(self, sess: Session, nbytes: int) -> None:
        if not nbytes:
            return
        sess.held_bytes -= nbytes
        left = self.tenant_bytes.get(sess.tenant, 0) - nbytes
        if left > 0:
            self.tenant_bytes[sess.tenant] = left
        else:
            self.tenant_bytes.pop(sess.tenant, None)

    # -- expiry ----------------------------------------------------------------------------

    def _deadline(self, sess: Session, ttl: float) -> float:
        """The bucket deadline of an id handed out now (see the module docstring)."""
        if sess.internal or math.isinf(ttl):
            return math.inf
        width = max(ttl / 4, 0.01)
        return (math.floor(time.monotonic() / width) + 1) * width + ttl

    def _arm(self, deadline: float) -> None:
        """Make sure a sweep runs by ``deadline`` (one timer for all sessions)."""
        if math.isinf(deadline):
            return
        if self._timer is not None and self._timer_at <= deadline + 1e-3:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # in-process use without a loop: sweep() is called by hand
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._swept)

    def _swept(self) -> None:
        self._timer = None
        self.sweep()

    def sweep(self, now: float | None = None) -> tuple[int, int]:
        """Abort expired grants and unpin expired leases; returns (grants, leases) expired."""
        now = time.monotonic() if now is None else now
        ng = nl = 0
        nxt = math.inf
        for sess in self._open.values():
            for d in sess.grants.expire(now):
                sess.withheld.update(d)  # not aborted: the client may still write them
                self.counters.add(Count.GRANTS_WITHHELD, len(d))
                ng += self._expired(sess, d, "grant")
            for d in sess.leases.expire(now):
                for entry in d.values():
                    self.host.unpin(entry)
                nl += self._expired(sess, d, "lease")
            nxt = min(nxt, sess.grants.next_deadline(), sess.leases.next_deadline())
        self.counters.add(Count.GRANTS_RECLAIMED, ng)
        self.counters.add(Count.LEASES_RECLAIMED, nl)
        self._arm(nxt)
        return ng, nl

    def _expired(self, sess: Session, d: dict[int, HostEntry], kind: str) -> int:
        if kind == "lease":  # (a withheld grant's slot stays charged until it goes back)
            self._refund(sess, _slot_bytes(d.values()))
        memo = sess.expired
        memo.update(dict.fromkeys(d, kind))
        over = len(memo) - EXPIRED_MEMO
        if over > 0:
            for k in list(itertools.islice(memo, over)):
                del memo[k]
        return len(d)

    def _late(self, sess: Session, hid: int) -> StoreError | None:
        """DEADLINE_EXCEEDED for an id of this session that expired, else None."""
        kind = sess.expired.get(hid)
        if kind is None:
            return None
        if kind == "grant":
            return StoreError(Code.DEADLINE_EXCEEDED,
                              f"grant {hid} expired: it was not committed within {self.limits.grant_ttl_s:g} s "
                              f"(--grant-ttl-s); its slot was withheld until now and is given back; allocate "
                              f"again, write, and commit within the deadline")
        return StoreError(Code.DEADLINE_EXCEEDED,
                          f"lease {hid} expired: it was not released within {self.limits.lease_ttl_s:g} s "
                          f"(--lease-ttl-s) and its block was unpinned, so what was read from its slot after "
                          f"that may not be the block; acquire again, read, and release within the deadline")

    def _not_held(self, sess: Session, hid: int, kind: str) -> StoreError:
        """Why ``hid`` is not among the session's grants (or leases): expired (this session's
        own, so it may be told), else not held. An id another session holds is answered exactly
        as one nobody holds: ids are looked up among the calling session's own only, so the
        reply never tells whether someone else holds it."""
        late = self._late(sess, hid)
        if late is not None:
            return late
        what = ("(already committed or aborted, or never granted to it)" if kind == "grant"
                else "(already released, or never leased to it)")
        verb = "commit or abort" if kind == "grant" else "release"
        return StoreError(Code.INVALID_ARGUMENT, f"{kind} {hid} is not held by session {sess.session_id} {what}: "
                                                 f"a session may {verb} only its own {kind}s")

    # -- grants ----------------------------------------------------------------------------

    def grant(self, sess: Session, entries: Sequence[HostEntry], nbytes: int | None = None) -> list[int]:
        """Record ``entries`` as the session's grants (``nbytes``: their slot bytes, when the
        caller knows them); returns their ids (the caller checked :meth:`check_quota`)."""
        return self._hold(sess, sess.grants, self.limits.grant_ttl_s, entries, nbytes)

    def check_grants(self, sess: Session, commit_ids: Sequence[int], abort_ids: Sequence[int]) -> None:
        """Refuse a commit naming a grant the session does not hold (expired: DEADLINE_EXCEEDED;
        else INVALID_ARGUMENT, the same whether or not another session holds it), or one grant
        twice."""
        for ids in (commit_ids, abort_ids):
            gid = sess.grants.first_missing(ids) if ids else None
            if gid is not None:
                self._give_back_withheld(sess, itertools.chain(commit_ids, abort_ids))
                raise self._not_held(sess, gid, "grant")
        if len(set(commit_ids) | set(abort_ids)) != len(commit_ids) + len(abort_ids):
            raise StoreError(Code.INVALID_ARGUMENT, "a grant id appears twice in one commit")

    def _give_back_withheld(self, sess: Session, grant_ids: Iterable[int]) -> None:
        """The client named these expired grants again: it is done writing their slots, which
        go back to the pool (and off the session's charge)."""
        back = [e for e in (sess.withheld.pop(g, None) for g in grant_ids) if e is not None]
        for entry in back:
            self.host.abort(entry)
        self._refund(sess, _slot_bytes(back))

    def take_grants(self, sess: Session, commit_ids: Sequence[int], abort_ids: Sequence[int]) -> list[HostEntry]:
        """:meth:`check_grants`, then abort ``abort_ids`` and return the entries of
        ``commit_ids`` (no longer grants). A bad call changes nothing."""
        self.check_grants(sess, commit_ids, abort_ids)
        aborted = sess.grants.take(abort_ids)
        taken = sess.grants.take(commit_ids)
        for entry in aborted:
            self.host.abort(entry)
        self._refund(sess, _slot_bytes(aborted) + _slot_bytes(taken))
        return taken

    def drop_grants(self, session_id: int, grant_ids: Iterable[int]) -> None:
        """Abort these grants if the session still holds them (its caller is gone)."""
        sess = self._open.get(session_id)
        if sess is None:
            return  # closing the session aborted them
        for gid in grant_ids:
            entry = sess.grants.pop(gid, None)
            if entry is not None:
                self.host.abort(entry)
                self._refund(sess, entry.cls.slot_bytes)

    # -- leases ----------------------------------------------------------------------------

    def lease(self, sess: Session, entries: Sequence[HostEntry], nbytes: int | None = None) -> list[int]:
        """Pin ``entries`` for the session (``nbytes``: their slot bytes, when the caller knows
        them); returns the lease ids (the caller checked :meth:`check_quota`)."""
        for entry in entries:
            self.host.pin(entry)
        return self._hold(sess, sess.leases, self.limits.lease_ttl_s, entries, nbytes)

    def _hold(self, sess: Session, held: Held, ttl_s: float, entries: Sequence[HostEntry],
              nbytes: int | None) -> list[int]:
        """Give ``entries`` new ids in ``held`` (the session's grants or leases), expiring after
        ``ttl_s``, and charge their slot bytes to the session and its tenant."""
        ids = random_ids(len(entries), held.clashes)
        deadline = self._deadline(sess, ttl_s)
        held.add(deadline, ids, entries)
        self._charge(sess, _slot_bytes(entries) if nbytes is None else nbytes)
        self._arm(deadline)
        return ids

    def release(self, session_id: int, lease_ids: Sequence[int], principal: Principal | None = None) -> None:
        """Unpin these leases; a lease not held (or named twice) refuses the whole call."""
        sess = self.get(session_id, principal)
        lid = sess.leases.first_missing(lease_ids) if lease_ids else None
        if lid is not None:
            raise self._not_held(sess, lid, "lease")
        if len(set(lease_ids)) != len(lease_ids):
            raise StoreError(Code.INVALID_ARGUMENT, "a lease id appears twice in one release")
        entries = sess.leases.take(lease_ids)
        for entry in entries:
            self.host.unpin(entry)
        self._refund(sess, _slot_bytes(entries))

    def drop_leases(self, session_id: int, lease_ids: Iterable[int]) -> None:
        """Release these leases if the session still holds them (its caller is gone)."""
        sess = self._open.get(session_id)
        if sess is None:
            return
        for lid in lease_ids:
            entry = sess.leases.pop(lid, None) if lid else None
            if entry is not None:
                self.host.unpin(entry)
                self._refund(sess, entry.cls.slot_bytes)

    def close_all(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""Client sessions and what each holds: grants (slots to write) and leases (pins to read).

A session lives as long as its client's Session stream. *Grants* are host slots handed out by
Allocate and not committed yet; *leases* are pins taken by Acquire until Release. When a
session closes, every grant is aborted and every lease released at once, and the hooks in
:attr:`Sessions.end_hooks` are told its id (the gpu tier and the Transfer registrations
follow their sessions that way).

Session, grant and lease ids start at a random point per daemon run, so an id a client kept
from before a restart names nothing here instead of someone else's.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.errors import Code, StoreError
from kvtier.tiers.host import HostEntry, HostTier


@dataclass(eq=False)
class Session:
    session_id: int
    client_name: str
    pid: int
    tenant: str = DEFAULT_TENANT  # whose blocks it reaches (issue 12)
    grants: dict[int, HostEntry] = field(default_factory=dict)   # grant id -> its reserved slot
    leases: dict[int, HostEntry] = field(default_factory=dict)   # lease id -> the pinned entry


class Sessions:
    """The open sessions (see the module docstring)."""

    def __init__(self, host: HostTier, counters: Counters) -> None:
        self.host = host
        self.counters = counters
        self._open: dict[int, Session] = {}
        self._ids = itertools.count(secrets.randbits(40) << 20)
        self.end_hooks: list[Callable[[int], None]] = []

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def __getitem__(self, session_id: int) -> Session:
        return self._open[session_id]

    def ids(self) -> list[int]:
        return list(self._open)

    def new_id(self) -> int:
        return next(self._ids)

    def open(self, client_name: str, pid: int, tenant: str = DEFAULT_TENANT) -> Session:
        sess = Session(self.new_id(), client_name, pid, tenant)
        self._open[sess.session_id] = sess
        self.counters.add(Count.SESSIONS_OPENED)
        return sess

    def get(self, session_id: int) -> Session:
        sess = self._open.get(session_id)
        if sess is None:
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"session {session_id} is not open: open a Session stream first and keep it open")
        return sess

    def close(self, session_id: int) -> tuple[int, int]:
        """Abort the session's grants and release its leases; returns (grants, leases) reclaimed."""
        sess = self._open.pop(session_id, None)
        if sess is None:
            return 0, 0
        for entry in sess.grants.values():
            self.host.abort(entry)
        for entry in sess.leases.values():
            self.host.unpin(entry)
        n = len(sess.grants), len(sess.leases)
        # emptied, so a request still holding this Session (awaiting) finds nothing to give back twice
        sess.grants.clear()
        sess.leases.clear()
        self.counters.add(Count.GRANTS_RECLAIMED, n[0])
        self.counters.add(Count.LEASES_RECLAIMED, n[1])
        for hook in self.end_hooks:
            hook(session_id)
        return n

    # -- grants ----------------------------------------------------------------------------

    def grant(self, sess: Session, entry: HostEntry) -> int:
        gid = self.new_id()
        sess.grants[gid] = entry
        return gid

    def check_grants(self, sess: Session, commit_ids: Sequence[int], abort_ids: Sequence[int]) -> None:
        """Refuse a commit naming a grant the session does not hold, or one grant twice."""
        for gid in itertools.chain(commit_ids, abort_ids):
            if gid not in sess.grants:
                raise StoreError(Code.INVALID_ARGUMENT,
                                 f"grant {gid} is not held by session {sess.session_id} (already committed, "
                                 f"aborted, or never granted)")
        if len(set(commit_ids) | set(abort_ids)) != len(commit_ids) + len(abort_ids):
            raise StoreError(Code.INVALID_ARGUMENT, "a grant id appears twice in one commit")

    def take_grants(self, sess: Session, commit_ids: Sequence[int], abort_ids: Sequence[int]) -> list[HostEntry]:
        """:meth:`check_grants`, then abort ``abort_ids`` and return the entries of
        ``commit_ids`` (no longer grants). A bad call changes nothing."""
        self.check_grants(sess, commit_ids, abort_ids)
        for gid in abort_ids:
            self.host.abort(sess.grants.pop(gid))
        return [sess.grants.pop(gid) for gid in commit_ids]

    def drop_grants(self, session_id: int, grant_ids: Iterable[int]) -> None:
        """Abort these grants if the session still holds them (its caller is gone)."""
        sess = self._open.get(session_id)
        if sess is None:
            return  # closing the session aborted them
        for gid in grant_ids:
            entry = sess.grants.pop(gid, None)
            if entry is not None:
                self.host.abort(entry)

    # -- leases ----------------------------------------------------------------------------

    def lease(self, sess: Session, entry: HostEntry) -> int:
        """Pin ``entry`` for the session; returns the lease id."""
        self.host.pin(entry)
        lid = self.new_id()
        sess.leases[lid] = entry
        return lid

    def release(self, session_id: int, lease_ids: Sequence[int]) -> None:
        """Unpin these leases; a lease not held (or named twice) refuses the whole call."""
        sess = self.get(session_id)
        missing = [lid for lid in lease_ids if lid not in sess.leases]
        if missing:
            raise StoreError(Code.INVALID_ARGUMENT,
                             f"lease {missing[0]} is not held by session {session_id} (already released?)")
        if len(set(lease_ids)) != len(lease_ids):
            raise StoreError(Code.INVALID_ARGUMENT, "a lease id appears twice in one release")
        for lid in lease_ids:
            self.host.unpin(sess.leases.pop(lid))

    def drop_leases(self, session_id: int, lease_ids: Iterable[int]) -> None:
        """Release these leases if the session still holds them (its caller is gone)."""
        sess = self._open.get(session_id)
        if sess is None:
            return
        for lid in lease_ids:
            entry = sess.leases.pop(lid, None) if lid else None
            if entry is not None:
                self.host.unpin(entry)

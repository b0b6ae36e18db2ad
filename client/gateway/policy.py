"""How the gateway orders the replicas for one request (``--policy``).

Every policy returns the healthy replicas in the order they are tried (the first is chosen;
the others are the retries when one refuses before answering):

* ``kvtier`` (default): the in-process :class:`~kvtier.client.routing.router.Router`'s ranking
  (tier-discounted prefix overlap from the daemons' location feeds and the router's
  speculative entries, against the load the gateway dispatched), with one override: a request
  of a known session goes back to its session's replica when that replica saves at least as
  many blocks as the best one (stickiness while the feeds have not caught up yet).
* ``round-robin``: the replicas in turn.
* ``session``: a session (the session header, else the body's ``user``) stays on the replica
  it was first sent to (the one with the fewest requests in flight then); requests without
  one go round-robin. What vLLM production-stack's session router does.
* ``prefix``: the replica the gateway last sent the longest leading run of this request's
  block keys to (the gateway's own memory, no daemon), else the one with the fewest requests
  in flight. What prefix-aware routers without engine feedback (SGLang's cache-aware router's
  approximate tree, production-stack's prefix router) do.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

POLICIES = ("kvtier", "round-robin", "session", "prefix")


@dataclass
class Choice:
    """The replicas to try, in order, and the router's view of the first (when it was asked)."""

    order: list[str]
    overlap: tuple[int, int, int] = (0, 0, 0)  # leading blocks of the chosen replica on gpu, host, disk
    n_blocks: int = 0
    # the router's ranking of the replicas: the replica tried is dispatched on it
    # (Router.dispatch), not ranked again
    ranking: Any = None
    # the ranking was dispatched on its first replica already (choose's ``dispatch``): trying
    # that replica takes this decision as it is
    dispatched: bool = False


class LruMap:
    """A bounded map, oldest entries dropped first; optionally expiring after ``ttl_s``."""

    def __init__(self, max_items: int, ttl_s: float = 0.0) -> None:
        self.max_items, self.ttl_s = max_items, ttl_s
        self._d: OrderedDict = OrderedDict()

    def get(self, key, now: float):
        v = self._d.get(key)
        if v is None:
            return None
        value, at = v
        if self.ttl_s and now - at > self.ttl_s:
            del self._d[key]
            return None
        return value

    def put(self, key, value, now: float) -> None:
        self._d[key] = (value, now)
        self._d.move_to_end(key)
        while len(self._d) > self.max_items:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class Policy:
    """Orders replicas for requests; told what was dispatched (:meth:`dispatched`)."""

    def __init__(self, name: str, router=None, max_sessions: int = 100_000, session_ttl_s: float = 3600.0,
                 prefix_max_keys: int = 1 << 20, sessions=None, prefixes=None) -> None:
        """``sessions``, ``prefixes``: the maps to keep them in (a
        :class:`~kvtier.client.gateway.shared.SharedMap` that ``--workers`` share), else this
        process's own :class:`LruMap`."""
        if name not in POLICIES:
            raise ValueError(f"policy {name!r} is not one of {', '.join(POLICIES)}")
        self.name, self.router = name, router
        self.sessions = sessions if sessions is not None else LruMap(max_sessions, session_ttl_s)
        self.prefixes = prefixes if prefixes is not None else LruMap(prefix_max_keys)
        self._know = [m.know for m in (self.sessions, self.prefixes) if hasattr(m, "know")]
        self.in_flight: dict[str, int] = {}
        self._rr = 0

    def _round_robin(self, names: Sequence[str]) -> list[str]:
        i = self._rr % len(names)
        self._rr += 1
        return [*names[i:], *names[:i]]

    def _least_busy(self, names: Sequence[str]) -> list[str]:
        rr = self._round_robin(names)
        return sorted(rr, key=lambda n: self.in_flight.get(n, 0))  # stable: ties keep the turn order

    def choose(self, names: Sequence[str], keys: Sequence[bytes], session: str | None,
               dispatch: bool = False) -> Choice:
        """``names``: the healthy replicas (non-empty), in a fixed order. ``dispatch``: where the
        first replica is the router's best (``kvtier`` with no session held elsewhere), the
        router dispatches the request on it in the same call as ranking (``Choice.dispatched``):
        what ranking and then :meth:`Router.dispatch` on that replica would do."""
        now = time.monotonic()
        for know in self._know:  # (shared maps keep a replica as its name's hash)
            know(names)
        ranking = None
        order: list[str] = []
        fused = False
        if self.router is not None:
            sticky = self.sessions.get(session, now) if session and self.name == "kvtier" else None
            fused = dispatch and self.name == "kvtier" and sticky is None
            ranking = self.router.route(keys, list(names), dispatch=fused, top_k=len(names))
            if self.name == "kvtier":
                order = ranking.workers
                # back to the session's replica when it saves as many blocks as the best
                if (sticky is not None and sticky != order[0] and sticky in order
                        and ranking.saved_blocks(sticky) >= ranking.saved_blocks(order[0])):
                    order = self._first(order, sticky)
        if not order and self.name == "session" and session:
            order = self._first(self._least_busy(names), self.sessions.get(session, now))
        elif not order and self.name == "prefix":
            order = self._first(self._least_busy(names), self._longest_prefix(keys, now))
        elif not order:
            order = self._round_robin(names)
        choice = Choice(order, n_blocks=len(keys), ranking=ranking, dispatched=fused)
        lead = ranking.leading(order[0]) if ranking is not None else None
        if lead is not None:
            choice.overlap = lead
        return choice

    @staticmethod
    def _first(order: list[str], name: str | None) -> list[str]:
        if name in order and name != order[0]:
            order.remove(name)
            order.insert(0, name)
        return order

    def _longest_prefix(self, keys: Sequence[bytes], now: float) -> str | None:
        """The replica the deepest of these keys was last sent to."""
        for k in reversed(keys):
            hit = self.prefixes.get(k, now)
            if hit is not None:
                return hit
        return None

    def dispatched(self, replica: str, keys: Sequence[bytes], session: str | None) -> None:
        now = time.monotonic()
        if session:
            self.sessions.put(session, replica, now)
        if self.name == "prefix":
            for k in keys:
                self.prefixes.put(k, replica, now)
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def ended(self, replica: str) -> None:
        self.in_flight[replica] = max(0, self.in_flight.get(replica, 0) - 1)

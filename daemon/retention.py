"""Retained blocks: what a tenant asked the daemon to keep through eviction pressure, until a TTL.

A retention is a tenant's hint that a prefix will be read again soon (a prompt cache's retention:
OpenAI's ``prompt_cache_retention``, Anthropic's ``cache_control`` TTL, Dynamo's
``nvext.cache_control``), sent as ``Node.Retain`` (``Sidecar.retain``). :class:`Retention`
keeps them, per packed block id (tenant fingerprint + key: a tenant retains only its own
blocks, and another tenant's identical key is another block).

Rules
    * **Eviction**: a retained block is evicted only when no unretained block is left to evict.
      The placement's victim order (:meth:`Retention.victims`) passes over the retained blocks
      and offers them last, lowest priority first, then the soonest to expire; host and disk
      alike. Retained blocks passed over by an eviction become the most recent of their tier
      once it is over, so the next eviction does not walk them again (each is passed over at
      most once per turn of the tier's order). A retained block evicted from host all the same
      is demoted to disk by the usual rule, and there is retained too.
    * **Not held yet**: a key is retained whether or not its block is held; the block is kept
      once it is stored within the TTL. An Evict removes the block, not the retention.
    * **Renewal**: retaining a retained key again keeps the later expiry and the higher
      priority, and makes it the most recently retained of its priority.
    * **Expiry**: at its TTL a retention ends (``retentions_expired``); the block stays where
      it is, an ordinary block again. Expiries are taken when a retain, an eviction or a Stats
      or metrics read looks (every one of them first; O(log n) each).
    * **Budget** (``--retention-budget``, per tenant, in slot bytes: the host memory each
      retained block takes): a retain whose new keys would take the tenant over its budget
      first releases the tenant's other retentions of no higher priority than its own, lowest
      priority first, then the least recently retained (``retentions_released``); if they
      cannot make room it is refused RESOURCE_EXHAUSTED naming the flag and changes nothing
      (``retains_refused``), as is a retain larger than the whole budget. Budget 0: retention
      is off and every retain of a key is refused RESOURCE_EXHAUSTED, naming the flag.

Threading: the event loop's, as the store's.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass

from kvtier.daemon.counters import Count
from kvtier.daemon.errors import Code, StoreError

MAX_TTL_S = 86400.0
"""The longest retention one retain asks for (24 h, OpenAI's ``prompt_cache_retention``)."""


def check_ttl(ttl_s: float) -> None:
    """Refuse (INVALID_ARGUMENT) a TTL that is not a number of seconds in (0, :data:`MAX_TTL_S`]."""
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and 0 < ttl_s <= MAX_TTL_S):
        raise StoreError(Code.INVALID_ARGUMENT, f"ttl_s is {ttl_s!r}: a retention lasts more than 0 and at most "
                                                f"{MAX_TTL_S:.0f} seconds (24 h)")


@dataclass(slots=True)
class Retained:
    """One retained block."""

    tenant: str
    nbytes: int       # its slot bytes, charged to the tenant's budget
    expires: float    # on the retention's clock
    priority: int


@dataclass(frozen=True)
class RetainResult:
    """What a retain did (``Node.Retain``'s reply)."""

    retained: int        # distinct keys retained, new or renewed
    held: int            # of them, held in host or on disk now
    released: int        # the tenant's other retentions released for room in its budget
    retained_bytes: int  # the tenant's retained bytes after it
    budget_bytes: int    # the tenant's budget


class RetainedLast:
    """An eviction order with the retained keys passed over and offered after every other one,
    lowest priority first, then the soonest to expire (see the module docstring). Iterate it
    once, as the tier's victims; then :meth:`settle` moves the retained keys it passed over
    to the recent end of the tier's order."""

    __slots__ = ("_keys", "_order", "passed")

    def __init__(self, keys: dict[bytes, Retained], order: Iterable[bytes]) -> None:
        self._keys = keys
        self._order = order
        self.passed: list[bytes] = []

    def __iter__(self) -> Iterator[bytes]:
        keys, passed = self._keys, self.passed
        for k in self._order:
            if k in keys:
                passed.append(k)
            else:
                yield k
        # nothing unretained left: the retained ones, last
        yield from sorted((k for k in passed if k in keys), key=lambda k: (keys[k].priority, keys[k].expires))

    def settle(self, recency: MutableMapping[bytes, object], held: Container[bytes]) -> None:
        """Make the retained keys passed over that are still ``held`` the most recent of
        ``recency`` (the tier's order), in the order they were passed."""
        for k in self.passed:
            if k in held and k in recency:
                recency.move_to_end(k)  # type: ignore[attr-defined]


class Retention:
    """Every tenant's retained blocks (see the module docstring). ``budget``: slot bytes one
    tenant may retain at once (0: retention off); ``count(tenant, count, n)``: told of each
    counted event (the store's per-tenant counters)."""

    def __init__(self, budget: int = 0, count: Callable[[str, Count, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.count = count or (lambda tenant, what, n: None)
        self.clock = clock
        self.keys: dict[bytes, Retained] = {}
        self.bytes_of: dict[str, int] = {}  # tenant -> slot bytes retained
        # tenant -> priority -> its keys, least recently retained first (release order)
        self._order: dict[str, dict[int, dict[bytes, None]]] = {}
        self._expiry: list[tuple[float, bytes]] = []  # (expires, key); stale entries skipped when popped

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_of.values())

    def victims(self, order: Iterable[bytes]) -> RetainedLast | None:
        """``order`` (a tier's victims) with the retained keys last (:class:`RetainedLast`);
        None while nothing is retained (use ``order`` as it is). Takes the expiries due first."""
        self.expire()
        return RetainedLast(self.keys, order) if self.keys else None

    def evicted(self, bkeys: Iterable[bytes]) -> None:
        """These blocks were evicted for capacity: count the retained ones (``retained_evictions``)."""
        per: dict[str, int] = {}
        for b in bkeys:
            r = self.keys.get(b)
            if r is not None:
                per[r.tenant] = per.get(r.tenant, 0) + 1
        for tenant, n in per.items():
            self.count(tenant, Count.RETAINED_EVICTIONS, n)

    def expire(self, now: float | None = None) -> int:
        """End the retentions whose TTL has passed; returns how many ended."""
        heap = self._expiry
        if not heap:
            return 0
        now = self.clock() if now is None else now
        if heap[0][0] > now:
            return 0
        keys = self.keys
        per: dict[str, int] = {}
        while heap and heap[0][0] <= now:
            t, b = heapq.heappop(heap)
            r = keys.get(b)
            if r is not None and r.expires == t:
                self._drop(b, r)
                per[r.tenant] = per.get(r.tenant, 0) + 1
        for tenant, n in per.items():
            self.count(tenant, Count.RETENTIONS_EXPIRED, n)
        return sum(per.values())

    def retain(self, tenant: str, bkeys: Sequence[bytes], nbytes: int, ttl_s: float, priority: int = 0
               ) -> tuple[int, int]:
        """Retain ``bkeys`` (distinct packed ids of ``tenant``'s blocks, ``nbytes`` slot bytes
        each) for ``ttl_s`` seconds; returns (released, the tenant's retained bytes after).
        Refused (StoreError) as the module docstring says, changing nothing."""
        check_ttl(ttl_s)
        if not self.budget:
            raise StoreError(Code.RESOURCE_EXHAUSTED, "retention is off on this daemon (--retention-budget 0): "
                                                      "start kvtierd with a retention budget to retain blocks")
        now = self.clock()
        self.expire(now)
        keys = self.keys
        new = [b for b in bkeys if b not in keys]
        need = len(new) * nbytes
        used = self.bytes_of.get(tenant, 0)
        if need > self.budget:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"retaining {len(new)} more blocks ({need} B) is more than a tenant's whole retention "
                             f"budget of {self.budget} B (--retention-budget): retain a shorter prefix")
        release = self._to_release(tenant, used + need - self.budget, priority, set(bkeys))
        expires = now + ttl_s
        for b in release:
            self._drop(b, keys[b])
        if release:
            self.count(tenant, Count.RETENTIONS_RELEASED, len(release))
        order = self._order.setdefault(tenant, {})
        heap = self._expiry
        for b in bkeys:
            r = keys.get(b)
            if r is None:
                r = keys[b] = Retained(tenant, nbytes, expires, priority)
                self.bytes_of[tenant] = self.bytes_of.get(tenant, 0) + nbytes
            else:  # renewed: the later expiry, the higher priority, the most recently retained
                del order[r.priority][b]
                if not order[r.priority]:
                    del order[r.priority]
                if expires <= r.expires and priority <= r.priority:
                    order.setdefault(r.priority, {})[b] = None
                    continue
                r.expires, r.priority = max(r.expires, expires), max(r.priority, priority)
            order.setdefault(r.priority, {})[b] = None
            heapq.heappush(heap, (r.expires, b))
        if len(heap) > 2 * len(keys) + 1024:  # renewals left stale entries: rebuild
            self._expiry = [(r.expires, b) for b, r in keys.items()]
            heapq.heapify(self._expiry)
        return len(release), self.bytes_of.get(tenant, 0)

    def _to_release(self, tenant: str, over: int, priority: int, keep: Container[bytes]) -> list[bytes]:
        """The tenant's retentions to release to free ``over`` bytes (none if ``over`` <= 0): of
        priority <= ``priority``, lowest first, then least recently retained, not in ``keep``.
        Refused RESOURCE_EXHAUSTED when they are not enough."""
        if over <= 0:
            return []
        out: list[bytes] = []
        freed = 0
        order = self._order.get(tenant, {})
        for p in sorted(order):
            if p > priority:
                break
            for b in order[p]:
                if b in keep:
                    continue
                out.append(b)
                freed += self.keys[b].nbytes
                if freed >= over:
                    return out
        raise StoreError(Code.RESOURCE_EXHAUSTED,
                         f"the tenant's retention budget of {self.budget} B (--retention-budget) is held by "
                         f"{self.bytes_of.get(tenant, 0)} B of retentions, {over - freed} B more than this retain "
                         f"may release (only those of priority {priority} or lower): retain fewer blocks, at a "
                         f"higher priority, or wait for retentions to expire")

    def _drop(self, b: bytes, r: Retained) -> None:
        del self.keys[b]
        left = self.bytes_of[r.tenant] - r.nbytes
        if left:
            self.bytes_of[r.tenant] = left
        else:
            del self.bytes_of[r.tenant]
        order = self._order[r.tenant]
        del order[r.priority][b]
        if not order[r.priority]:
            del order[r.priority]
            if not order:
                del self._order[r.tenant]


__all__ = ["MAX_TTL_S", "RetainResult", "Retained", "RetainedLast", "Retention", "check_ttl"]

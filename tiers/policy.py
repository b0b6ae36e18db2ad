"""Placement policy across the gpu, host and disk tiers, as metadata only (no bytes).

One :class:`TierPolicy` is one node with one engine worker: which block keys each tier holds,
in which recency order, and how blocks move between tiers when a request uses them. It is the
placement policy of DESIGN.md written as a small pure class, so the trace replay
(``kvtier.client.tools.replay``) and the daemon can share one definition of it. Keys are any
hashable values (the replay uses a trace's integer hash ids, the daemon key bytes).

Contract
    * Capacities are in blocks, per tier; a tier of capacity 0 holds nothing. Each tier is an
      LRU: a block that is used becomes the most recent; when a tier is over capacity its
      least recently used blocks leave it (oldest first).
    * ``gpu`` is what the engine holds in HBM. Every block a request uses ends up there: the
      blocks it found (onboarded from host or disk) and the ones it computed.
    * Write-through: every block that enters ``gpu`` is also written to ``host`` (the engine
      offloads what it computes), so with ``host >= gpu`` the host tier holds everything the
      gpu tier does and a gpu eviction moves nothing.
    * Demotion: a block evicted from ``host`` goes to ``disk`` if it has been *seen* (used by a
      request on this node) at least ``demote_min_seen`` times while it stayed in some tier;
      otherwise it is dropped. A victim that is already on disk stays there, untouched (an
      eviction is not a use). A block evicted from ``disk`` is dropped. A dropped block
      forgets its seen count: a later request starts it again at one.
    * Promotion: a block a request finds on disk (and nowhere faster) is copied into ``host``
      (and, as every used block, into ``gpu``); it stays on disk too.
    * Only a request's *leading run* of held blocks is served (keys are chained prefix
      hashes: a block after the first miss cannot be used); the blocks after the first miss
      are computed again even if some tier still holds them.

``access(keys)`` applies one request and returns the tier each block of its leading run was
served from; ``leading_ranks(keys)`` answers the same question without changing anything (a
router's probe). Counters of hits, evictions, demotions and promotions are kept in
:attr:`TierPolicy.counts`.

Not thread-safe; every method is O(len(keys)) dictionary operations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

GPU, HOST, DISK, NOT_HELD = 0, 1, 2, 3
TIER_NAMES = ("gpu", "host", "disk")


@dataclass
class PolicyCounts:
    """What happened so far, in blocks."""

    hits: list[int] = field(default_factory=lambda: [0, 0, 0])  # served from gpu, host, disk
    misses: int = 0                                               # computed (after the leading run)
    evictions: list[int] = field(default_factory=lambda: [0, 0, 0])  # left each tier for capacity
    demotions: int = 0                                            # host -> disk on eviction
    promotions: int = 0                                           # disk -> host on a hit
    dropped: int = 0                                              # left every tier


class TierPolicy:
    """LRU per tier, write-through to host, demote to disk when seen often, promote on a disk hit."""

    def __init__(self, gpu_blocks: int, host_blocks: int, disk_blocks: int, demote_min_seen: int = 2) -> None:
        if min(gpu_blocks, host_blocks, disk_blocks) < 0:
            raise ValueError("tier capacities are block counts >= 0")
        if demote_min_seen < 1:
            raise ValueError("demote_min_seen must be >= 1")
        self.capacity = (gpu_blocks, host_blocks, disk_blocks)
        self.demote_min_seen = demote_min_seen
        self.tiers: tuple[OrderedDict[Hashable, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self.seen: dict[Hashable, int] = {}
        self.counts = PolicyCounts()

    def tier_of(self, key: Hashable) -> int:
        """The fastest tier holding ``key`` (GPU, HOST, DISK) or NOT_HELD."""
        gpu, host, disk = self.tiers
        if key in gpu:
            return GPU
        if key in host:
            return HOST
        if key in disk:
            return DISK
        return NOT_HELD

    def leading_ranks(self, keys: Sequence[Hashable]) -> list[int]:
        """Fastest tier of each key of the leading run of held keys (stops at the first miss)."""
        gpu, host, disk = self.tiers
        out = []
        for k in keys:
            if k in gpu:
                out.append(GPU)
            elif k in host:
                out.append(HOST)
            elif k in disk:
                out.append(DISK)
            else:
                break
        return out

    def access(self, keys: Sequence[Hashable]) -> list[int]:
        """Apply one request that uses ``keys`` (in order); returns the leading run's tiers."""
        ranks = self.leading_ranks(keys)
        c = self.counts
        for r in ranks:
            c.hits[r] += 1
        c.misses += len(keys) - len(ranks)
        seen = self.seen
        for k in keys:
            seen[k] = seen.get(k, 0) + 1
        promoted = [k for k, r in zip(keys, ranks, strict=False) if r == DISK]
        if promoted:
            c.promotions += len(promoted)
            disk = self.tiers[DISK]
            for k in promoted:
                disk.move_to_end(k)  # a hit is a use on disk too
        self._store(HOST, keys)  # write-through (brings the promoted blocks up), before gpu so a
        self._store(GPU, keys)   # block the gpu cannot keep is already safe in host
        return ranks

    # -- internals -----------------------------------------------------------------------

    def _store(self, tier: int, keys: Sequence[Hashable]) -> None:
        od = self.tiers[tier]
        cap = self.capacity[tier]
        if cap == 0:
            for k in keys:
                self._maybe_forget(k)
            return
        for k in keys:
            if k in od:
                od.move_to_end(k)
            else:
                od[k] = None
        if len(od) > cap:
            self._evict(tier, len(od) - cap)

    def _evict(self, tier: int, n: int) -> None:
        od = self.tiers[tier]
        victims = [od.popitem(last=False)[0] for _ in range(n)]
        self.counts.evictions[tier] += n
        if tier == HOST:
            keep, disk = self.demote_min_seen, self.tiers[DISK]
            demote = [k for k in victims if k not in disk and self.seen.get(k, 0) >= keep]
            if demote and self.capacity[DISK]:
                self.counts.demotions += len(demote)
                self._store(DISK, demote)
        for k in victims:
            self._maybe_forget(k)

    def _maybe_forget(self, key: Hashable) -> None:
        gpu, host, disk = self.tiers
        if key not in gpu and key not in host and key not in disk and key in self.seen:
            del self.seen[key]
            self.counts.dropped += 1

"""The placement policy across the gpu, host and disk tiers, as metadata only (no bytes).

One :class:`TierPolicy` is the placement of one node: which blocks each tier holds, in which
recency order, how often each block was seen, and the rules that move blocks between tiers. It
is the one definition of placement. The daemon's store asks it for every order and rule
decision and tells it every change (the store itself keeps pins, bytes and I/O); the trace
replay (``kvtier.client.tools.replay``) and the tests run it alone, with block-count
capacities. Keys are any hashable values (the daemon uses packed block ids, fingerprint +
key; the replay a trace's integer hash ids).

Rules
    * LRU per tier: a block that is stored or used becomes the most recent one of its tier;
      :meth:`TierPolicy.victims` offers a tier's blocks least recently used first.
    * Eviction order (``eviction``, :data:`EVICTIONS`): ``lru`` (the default, kvtierd's) makes
      the keys of one call recent in the order given. ``kvtier`` (an option under evaluation,
      docs/eviction.md) makes the keys of one call (a put's commit, a get's hits, a
      promotion, one request of the replay) recent in host and on disk *tail first*: a call's
      keys are a chain's blocks in order, so its head ends the most recent and its tail is evicted first. A block is
      useful only while every block before it is held (only a leading run is served), so
      evicting a chain's tail first costs what it frees and nothing more, where ``lru``
      (head first, the order of the call) evicts the head and leaves the rest of the chain
      held but unusable. Between calls both are LRU. gpu is LRU in call order under every order.
      ``lirs`` (an option, docs/eviction.md; the replay's, with a host capacity in blocks) runs
      LIRS (Jiang and Zhang) in host, fed tail first as ``kvtier``: a block's *inter-reference
      recency* (how many other blocks were used between its last two uses) decides. Most of
      host (all but :data:`LIRS_HIR_SHARE`) holds the blocks of low inter-reference recency
      (LIR); the rest holds the others (HIR) and is where victims come from, oldest first. A
      block used again while it is still in the recency stack (a HIR block, or the ghost of an
      evicted one) has a recency lower than the stack's oldest LIR block: it becomes LIR and
      that block becomes HIR. So a loop of sessions larger than host keeps a stable subset of
      them whole instead of evicting each just before it returns (LRU's loss on multi-turn
      traffic), at the cost of blocks whose first reuse comes after more than the HIR share
      of host was used (see the sweep in docs/eviction.md). The stack keeps at most
      :data:`LIRS_GHOSTS` x capacity evicted keys. Disk runs ``kvtier``'s order under ``lirs``.
      ``adaptive`` (an option, docs/eviction.md; the replay's, with a host capacity in blocks)
      is ``lirs`` whose HIR share host chooses by miniature simulation (:class:`AdaptiveLirs`):
      small simulations of host under each share of :data:`ADAPTIVE_SHARES` (1.0: ``kvtier``'s
      LRU, where it starts) run on a sample of whole requests, and host follows the one that hit
      most over a recent window. LIRS's loop resistance where host is small against the
      traffic, LRU where LRU already keeps blocks until their first reuse. Disk as ``lirs``.
    * Seen count: every put and every hit of a block counts one (in :meth:`TierPolicy.access`,
      every request that uses it). The count is kept while the block is held in some tier (or
      on its way to disk); a block that leaves every tier forgets it and starts again at one.
      It is stored as the block's value in the host and disk recency maps (no second map of
      all keys: ~40 MiB at a million blocks); :attr:`TierPolicy.seen` is a read-only view.
    * Demotion (:meth:`TierPolicy.demotions`): a block evicted from ``host`` and not on disk
      already goes to ``disk`` while the disk's write queue has room
      (:attr:`TierPolicy.disk_write_room`, in blocks, set by the caller before it evicts;
      ``None`` or ``0``: none); when the victims need more than the room, those
      seen at least ``demote_min_seen`` times go, and as many others as the room has left
      (least recently used first); at most :attr:`TierPolicy.disk_write_cap` in all, seen-often
      ones first (``None``: no cap; the daemon queues, the replay drops what its disk's write
      bandwidth cannot take); the others are dropped. The seen-twice filter exists to spare
      the disk's write bandwidth, so it applies only when writes back up: applied always, it
      drops the blocks of a conversation's latest turn, which the next turn needs.
      A victim already on disk stays there, untouched: an eviction is not a use. A block
      evicted from ``disk`` is dropped.
    * Write-ahead (:attr:`TierPolicy.write_ahead`, in blocks; 0: none): while host has less
      free room than that, its first ``write_ahead`` blocks in eviction order are written to
      disk too, ahead of their eviction (those not on disk yet, in order, but not the blocks a
      get is using), so that evicting them later frees their room at once. They stay in host;
      a block that is used again before its eviction is simply held in both tiers. The daemon
      takes them after a put's reservation that evicted and after a promotion, and writes
      them in the background as the write queue has room (after the put's own demotions);
      :meth:`TierPolicy.put`, :meth:`TierPolicy.get` and :meth:`TierPolicy.prefetch` model it
      at those points (``tests/test_placement_equivalence.py``).
    * Promotion: a get that finds a block on disk and not in host brings it into host
      (:meth:`TierPolicy.promotions`); it stays on disk too, and the hit is a use there.
    * Only a request's *leading run* of held blocks can be served (keys are chained prefix
      hashes); :meth:`TierPolicy.leading_ranks` answers it without changing anything.

Capacities, per tier: a block count; ``0``: the tier does not exist (it holds nothing, and
without a disk nothing is demoted); ``None``: not bounded here, because the caller bounds the
tier (the daemon does, in bytes across size classes) and asks :meth:`TierPolicy.victims` for
room, skipping the victims it cannot use (pinned ones).

Two ways to drive it
    * Decisions and facts, as the daemon's store does: ask :meth:`~TierPolicy.victims`,
      :meth:`~TierPolicy.demotions`, :meth:`~TierPolicy.promotions`; report each change
      with the ``on_*`` methods (:meth:`~TierPolicy.on_commit`, :meth:`~TierPolicy.on_hit`,
      :meth:`~TierPolicy.on_promote`, :meth:`~TierPolicy.on_write`,
      :meth:`~TierPolicy.on_evict`, :meth:`~TierPolicy.on_demotion_end`,
      :meth:`~TierPolicy.on_remove`).
    * Whole requests with block-count capacities: :meth:`~TierPolicy.put`,
      :meth:`~TierPolicy.get`, :meth:`~TierPolicy.prefetch` and :meth:`~TierPolicy.evict`
      are the daemon's Allocate + Commit, Acquire, Prefetch and Evict, step for step as the
      store runs them (``tests/test_placement_equivalence.py`` checks a real daemon against
      them); :meth:`~TierPolicy.access` is one engine request as the replay models it: the
      leading run is served, then every block of the request is written through into host
      and gpu.

Counters of hits, evictions, demotions and promotions are kept in :attr:`TierPolicy.counts`.
Not thread-safe; every method is O(len(keys)) dictionary operations (``victims`` is lazy).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.tiers.vocab import TIERS, Tier

GPU, HOST, DISK = Tier.GPU, Tier.HOST, Tier.DISK

DEMOTE_MIN_SEEN = 2
"""The default ``demote_min_seen``: when the disk's write queue is full, a host victim is demoted
only if it was seen this many times (kvtierd's ``--demote-min-seen``, the replay's too)."""
EVICTIONS = ("adaptive", "kvtier", "lirs", "lru")
"""The eviction orders a :class:`TierPolicy` runs (see Eviction order in the module docstring)."""
DEFAULT_EVICTION = "lru"
"""The eviction order kvtierd runs (its store builds ``TierPolicy`` without ``eviction``), and
so the replay's default."""
LIRS_HIR_SHARE = 0.01
"""Under ``lirs``: the share of the host tier's block capacity that holds HIR blocks (at least one)."""
LIRS_GHOSTS = 2.0
"""Under ``lirs``: the evicted keys the recency stack keeps, as a multiple of the host's capacity."""
ADAPTIVE_SHARES = (0.01, 0.1, 0.5, 1.0)
"""Under ``adaptive``: the HIR shares host chooses from (1.0: tail-first LRU, ``kvtier``'s order);
host starts with the last one."""
ADAPTIVE_SAMPLE = 1 / 16
"""Under ``adaptive``: the share of requests (whole chains) the miniature simulations see, and
the share of host's capacity each of them has (at least :data:`ADAPTIVE_MIN_SHADOW` blocks)."""
ADAPTIVE_MIN_SHADOW = 4096
"""Under ``adaptive``: the least capacity of a miniature simulation, in blocks (a higher sampling
rate where host is small; at most host's capacity)."""
ADAPTIVE_EPOCH = 2.0
"""Under ``adaptive``: blocks the miniature simulations see between two choices, as a multiple
of their capacity; each choice then multiplies the hit counts by :data:`ADAPTIVE_DECAY`."""
ADAPTIVE_DECAY = 0.7
ADAPTIVE_MARGIN = 0.1
"""Under ``adaptive``: host changes its share only to one whose miniature simulation hit this
much more (relative) than the current one's over the window."""
DEMOTE_AHEAD_BYTES = 128 * 1024**2
"""The default write-ahead window in bytes (kvtierd's ``--demote-ahead-bytes``, the replay's
too), of which :attr:`TierPolicy.write_ahead` holds the whole blocks."""


def _per_tier() -> list[int]:
    return [0] * len(TIERS)


@dataclass
class PolicyCounts:
    """What happened so far, in blocks. Per-tier lists are in :data:`TIERS` order (index ``Tier.rank``)."""

    hits: list[int] = field(default_factory=_per_tier)       # served from each tier (access)
    misses: int = 0                                          # computed (after the leading run; access)
    evictions: list[int] = field(default_factory=_per_tier)  # left each tier for capacity
    demotions: int = 0                                       # host victims chosen for disk
    ahead: int = 0                                           # host blocks written to disk ahead of eviction
    promotions: int = 0                                      # disk -> host on a hit
    dropped: int = 0                                         # left every tier (their seen counts forgotten)


class PutOutcome(NamedTuple):
    """What :meth:`TierPolicy.put` did with each key (in the order given)."""

    stored: list[Hashable]    # new in host
    present: list[Hashable]   # already in host or on disk: nothing written
    dropped: list[Hashable]   # found no room


class SeenCounts(Mapping[Hashable, int]):
    """Read-only view of how often each block was seen (:attr:`TierPolicy.seen`): the blocks
    held in some tier or on their way to disk that were seen at least once."""

    def __init__(self, policy: TierPolicy) -> None:
        self._policy = policy

    def __getitem__(self, key: Hashable) -> int:
        n = self._policy._count(key)
        if not n:
            raise KeyError(key)
        return n

    def __iter__(self) -> Iterator[Hashable]:
        p = self._policy
        host, disk, loose = p.tiers[HOST], p.tiers[DISK], p._loose
        yield from (k for k, n in host.items() if n)
        yield from (k for k, n in disk.items() if n and k not in host)
        yield from (k for k, n in loose.items() if n and k not in host and k not in disk)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Lirs:
    """The host tier's LIRS state under the ``lirs`` eviction (see Eviction order in the module
    docstring). ``stack``: the recency stack, least recent first: every LIR block, and the HIR
    blocks (held, or evicted: ghosts) more recent than its oldest LIR block, which is always
    its first entry; ``hir``: the HIR blocks held, in eviction order; ``lir``: the LIR blocks;
    ``ghosts``: the evicted keys still in the stack, oldest first (at most ``ghost_cap``).
    Every held host block is in ``lir`` or ``hir``. O(1) amortised per key."""

    __slots__ = ("ghost_cap", "ghosts", "hir", "lir", "lir_cap", "lru", "stack")

    def __init__(self, capacity: int, hir_share: float = LIRS_HIR_SHARE, ghosts: float = LIRS_GHOSTS) -> None:
        self.lru = False  # host's victims in plain recency order instead (AdaptiveLirs at a share of 1.0)
        self.lir_cap = capacity - max(1, int(capacity * hir_share))
        self.ghost_cap = int(capacity * ghosts)
        self.stack: OrderedDict[Hashable, None] = OrderedDict()
        self.hir: OrderedDict[Hashable, None] = OrderedDict()
        self.lir: set[Hashable] = set()
        self.ghosts: OrderedDict[Hashable, None] = OrderedDict()

    def order(self) -> Iterator[Hashable]:
        """Host's blocks in eviction order: HIR ones oldest first, then LIR ones, least recent first."""
        yield from self.hir
        yield from (k for k in self.stack if k in self.lir)

    def use(self, keys: Iterable[Hashable]) -> None:
        """These blocks were used, in this order (each is held in host from now on)."""
        stack, hir, lir, ghosts = self.stack, self.hir, self.lir, self.ghosts
        for k in keys:
            if k in lir:  # the most recent; the stack's bottom moves on
                bottom = next(iter(stack)) == k
                stack.move_to_end(k)
                if bottom:
                    self._prune()
            elif k in hir:  # a HIR block used again: LIR if its recency beats the oldest LIR's
                if k in stack:
                    stack.move_to_end(k)
                    del hir[k]
                    lir.add(k)
                    self._demote()
                else:
                    stack[k] = None
                    hir.move_to_end(k)
            elif k in ghosts:  # evicted, used again within the stack: LIR
                del ghosts[k]
                stack.move_to_end(k)
                lir.add(k)
                if len(lir) > self.lir_cap:
                    self._demote()
            elif len(lir) < self.lir_cap:  # LIR has room (filling)
                lir.add(k)
                stack[k] = None
            else:  # new: HIR
                stack[k] = None
                hir[k] = None

    def gone(self, keys: Iterable[Hashable]) -> None:
        """These held blocks left host: a HIR one stays in the stack as a ghost; a LIR one leaves it."""
        stack, hir, lir, ghosts = self.stack, self.hir, self.lir, self.ghosts
        for k in keys:
            if k in hir:
                del hir[k]
                if k in stack:
                    ghosts[k] = None
                    if len(ghosts) > self.ghost_cap:
                        stack.pop(ghosts.popitem(last=False)[0], None)
            elif k in lir:
                lir.discard(k)
                stack.pop(k, None)
        self._prune()

    def _demote(self) -> None:
        """The stack's oldest LIR block becomes the most recent HIR one."""
        k = next(iter(self.stack))
        del self.stack[k]
        self.lir.discard(k)
        self.hir[k] = None
        self._prune()

    def _prune(self) -> None:
        """Drop HIR entries from the stack's bottom until a LIR block is there (ghosts go for good)."""
        stack, lir, ghosts = self.stack, self.lir, self.ghosts
        while stack:
            k = next(iter(stack))
            if k in lir:
                return
            del stack[k]
            ghosts.pop(k, None)


def _key_hash(key: Hashable) -> int:
    """A 64-bit hash of a block key that is the same in every process for bytes and ints (the
    daemon's and the replay's keys); other keys use ``hash``."""
    if isinstance(key, bytes):
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    x = hash(key) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finaliser
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class MiniCache:
    """One miniature simulation of :class:`AdaptiveLirs`: a host of ``capacity`` blocks under
    LIRS with HIR share ``share`` (1.0 or more: tail-first LRU), fed whole requests; it counts
    the blocks of their leading runs it holds."""

    __slots__ = ("capacity", "lirs", "recent")

    def __init__(self, capacity: int, share: float) -> None:
        self.capacity = capacity
        self.recent: OrderedDict[Hashable, None] | None = OrderedDict() if share >= 1 else None
        self.lirs = None if share >= 1 else Lirs(capacity, share)

    def access(self, head_first: Sequence[Hashable]) -> int:
        """One request's keys, head first: returns its leading run's length here, then holds them all."""
        n = 0
        od, lirs = self.recent, self.lirs
        if od is not None:
            for k in head_first:
                if k not in od:
                    break
                n += 1
            for k in reversed(head_first):
                if k in od:
                    od.move_to_end(k)
                else:
                    od[k] = None
            while len(od) > self.capacity:
                od.popitem(last=False)
            return n
        assert lirs is not None
        lir, hir = lirs.lir, lirs.hir
        for k in head_first:
            if k not in lir and k not in hir:
                break
            n += 1
        lirs.use(head_first[::-1])
        over = len(lir) + len(hir) - self.capacity
        if over > 0:
            lirs.gone(list(itertools.islice(lirs.order(), over)))
        return n


class AdaptiveLirs(Lirs):
    """The host tier's state under the ``adaptive`` eviction: :class:`Lirs` whose HIR share is
    chosen by miniature simulation (Waldspurger et al., 2017; set dueling, Qureshi et al.).
    One :class:`MiniCache` per share of :data:`ADAPTIVE_SHARES` runs on a sample of the calls
    (a call's keys are a request's chain; a call is in the sample when a hash of its second key
    (its only one, if it has one) is below :data:`ADAPTIVE_SAMPLE`: the first block is often a
    system prompt every request shares, the second names the conversation, so a chain and its
    later turns are in the sample or out of it whole), each with the sampled share of host's
    capacity. Every :data:`ADAPTIVE_EPOCH` x that capacity of sampled blocks, host takes the
    share whose simulation hit most (decayed counts, :data:`ADAPTIVE_DECAY`), if it beats the
    current one's by :data:`ADAPTIVE_MARGIN`: a smaller LIR set demotes its oldest LIR blocks
    at once (at most host's capacity, once per epoch: O(1) amortised), a larger one fills with
    new blocks; at a share of 1.0 host's victims are its blocks in recency order (``lru``),
    the LIRS state kept up to date for a later change. O(1) amortised per key; the simulations
    hold about ``len(ADAPTIVE_SHARES) x 3`` x their capacity keys (with ghosts)."""

    __slots__ = ("capacity", "choices", "epoch_blocks", "sampled", "scores", "shadows", "share", "threshold")

    def __init__(self, capacity: int, shares: Sequence[float] = ADAPTIVE_SHARES, sample: float = ADAPTIVE_SAMPLE,
                 min_shadow: int = ADAPTIVE_MIN_SHADOW) -> None:
        super().__init__(capacity, LIRS_HIR_SHARE)
        self.capacity = capacity
        mini = min(capacity, max(min_shadow, int(capacity * sample)))
        self.threshold = int(mini / capacity * 2**64)
        self.shadows = [(s, MiniCache(mini, s)) for s in shares]
        self.scores = [0.0] * len(shares)
        self.epoch_blocks = max(1, int(mini * ADAPTIVE_EPOCH))
        self.sampled = 0
        self.choices = 0  # how often the share changed
        self.share = shares[-1]
        self._set(len(shares) - 1)

    def _set(self, i: int) -> None:
        """Run host at the ``i``-th share. From LRU, LIRS starts afresh: every held block HIR
        (in their LIRS order), no history; the blocks used next fill the LIR set, whole chains
        as they come, as when LIRS starts empty."""
        was_lru = self.lru
        self.share = share = self.shadows[i][0]
        self.lru = share >= 1
        if self.lru:
            return
        self.lir_cap = self.capacity - max(1, int(self.capacity * share))
        if was_lru:
            held = list(self.order())
            self.stack.clear()
            self.lir.clear()
            self.ghosts.clear()
            self.hir = OrderedDict.fromkeys(held)
        while len(self.lir) > self.lir_cap and self.lir:
            self._demote()

    def use(self, keys: Iterable[Hashable]) -> None:
        """As :meth:`Lirs.use` (``keys`` tail first, as the policy makes them recent), but while
        the LIR set has room a held HIR block used becomes LIR; a sampled call is also a request
        of every miniature simulation."""
        keys = list(keys)
        lir, hir, stack = self.lir, self.hir, self.stack
        if len(lir) < self.lir_cap and hir:
            for k in keys:
                if len(lir) >= self.lir_cap:
                    break
                if k in hir:
                    del hir[k]
                    lir.add(k)
                    stack[k] = None
                    stack.move_to_end(k)
            self._prune()
        super().use(keys)
        if not keys or _key_hash(keys[-2] if len(keys) > 1 else keys[-1]) >= self.threshold:
            return
        head_first, scores = keys[::-1], self.scores
        for i, (_, mini) in enumerate(self.shadows):
            scores[i] += mini.access(head_first)
        self.sampled += len(keys)
        if self.sampled < self.epoch_blocks:
            return
        self.sampled = 0
        cur = next(i for i, (s, _) in enumerate(self.shadows) if s == self.share)
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != cur and scores[best] > scores[cur] * (1 + ADAPTIVE_MARGIN):
            self._set(best)
            self.choices += 1
        self.scores = [x * ADAPTIVE_DECAY for x in scores]


class TierPolicy:
    """LRU per tier, demote to disk when seen often, promote on a disk hit (see the module docstring).

    Each tier is an ``OrderedDict`` of its keys, least recently used first. In host and disk the
    values are the keys' seen counts: both store a key's current count where they hold it
    (``0``: not seen since it last left every tier). ``_loose`` holds the counts of keys in
    neither: held in gpu only (gpu values are None; the daemon has no gpu tier here and the
    replay's is small), host victims on their way to disk, and within a call keys seen before
    they enter host."""

    def __init__(self, gpu_blocks: int | None, host_blocks: int | None, disk_blocks: int | None,
                 demote_min_seen: int = DEMOTE_MIN_SEEN,
                 host_map: MutableMapping[Hashable, int | None] | None = None,
                 eviction: str = DEFAULT_EVICTION) -> None:
        caps = (gpu_blocks, host_blocks, disk_blocks)
        if any(c is not None and c < 0 for c in caps):
            raise ValueError("tier capacities are block counts >= 0 (or None: bounded by the caller)")
        if demote_min_seen < 1:
            raise ValueError("demote_min_seen must be >= 1")
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction {eviction!r}; choose from {', '.join(EVICTIONS)}")
        if eviction in ("lirs", "adaptive") and (host_blocks is None or host_map is not None):
            raise ValueError(f"eviction {eviction!r} needs a host capacity in blocks and the policy's own host map "
                             "(the replay's; kvtierd runs lru)")
        self.eviction = eviction
        self._tail_first = eviction != "lru"  # a call's keys made recent tail first (host, disk)
        # the host tier's LIRS state under lirs and adaptive (its victim order); None otherwise
        self._lirs: Lirs | None = None
        if host_blocks and eviction == "lirs":
            self._lirs = Lirs(host_blocks)
        elif host_blocks and eviction == "adaptive":
            self._lirs = AdaptiveLirs(host_blocks)
        self.capacity: dict[Tier, int | None] = dict(zip(TIERS, caps, strict=True))
        self.demote_min_seen = demote_min_seen
        # demotions the disk's write queue takes now before it backs up (None: no limit), and
        # the most a host eviction may demote at all (None: no cap); see demotions()
        self.disk_write_room: int | None = None
        self.disk_write_cap: int | None = None
        self.write_ahead = 0  # host blocks at the eviction end kept written to disk (see Write-ahead)
        # oldest first; host and disk map a key to its seen count, gpu to None (see the class docstring)
        self.tiers: dict[Tier, OrderedDict[Hashable, int | None]] = {t: OrderedDict() for t in TIERS}
        if host_map is not None:  # the daemon's: kept in the host tier's slot arrays (HostRecency)
            self.tiers[HOST] = host_map  # type: ignore[assignment]
        self._loose: dict[Hashable, int] = {}  # seen counts of keys in neither host nor disk
        self._moving: set[Hashable] = set()    # host victims on their way to disk: they keep their counts
        self.counts = PolicyCounts()

    @property
    def seen(self) -> SeenCounts:
        """How often each block held (or on its way to disk) was seen: a read-only mapping."""
        return SeenCounts(self)

    # -- what the tiers hold ---------------------------------------------------------------

    def holds(self, tier: Tier, key: Hashable) -> bool:
        return key in self.tiers[tier]

    def leading_ranks(self, keys: Sequence[Hashable]) -> list[Tier]:
        """The fastest tier of each key of the leading run of held keys (stops at the first miss)."""
        gpu, host, disk = (self.tiers[t] for t in TIERS)
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

    # -- decisions -------------------------------------------------------------------------

    def victims(self, tier: Tier, keep: Collection[Hashable] = ()) -> Iterator[Hashable]:
        """The blocks of ``tier`` in eviction order, least recently used first, without those in
        ``keep``. Lazy: take victims in order (skipping any you cannot evict, e.g. pinned ones),
        and report them with :meth:`on_evict` once taken; do not resume it after that. (Under
        ``lirs``, host's order is LIRS's: HIR blocks oldest first, then LIR blocks.)"""
        return (k for k in self._order(tier) if k not in keep)

    def _order(self, tier: Tier) -> Iterable[Hashable]:
        """``tier``'s blocks in eviction order."""
        if tier is HOST and self._lirs is not None and not self._lirs.lru:
            return self._lirs.order()
        return self.tiers[tier]

    def demotions(self, victims: Iterable[Hashable]) -> list[Hashable]:
        """Which host victims go to disk (in victim order): of those not on disk already (none
        without a disk tier), every one while :attr:`disk_write_room` holds them all; else
        those seen at least ``demote_min_seen`` times, and as many of the others (least
        recently used first) as the room has left; at most :attr:`disk_write_cap` in all,
        seen-often ones first."""
        if self.capacity[DISK] == 0:
            return []
        host, disk, loose, need = self.tiers[HOST], self.tiers[DISK], self._loose, self.demote_min_seen
        room, cap = self.disk_write_room or 0, self.disk_write_cap
        cands = [k for k in victims if k not in disk]
        if len(cands) <= room and (cap is None or len(cands) <= cap):
            return cands
        # writes back up: the frequency filter (a key not on disk has its count loose or in
        # host: _count, inlined; loose counts are >= 1)
        hot = [k for k in cands if (loose.get(k) or host.get(k) or 0) >= need]
        if cap is not None and len(hot) >= cap:
            keep = set(hot[:cap])
        else:
            left = max(0, room - len(hot)) if cap is None else max(0, min(room, cap) - len(hot))
            keep = set(hot)
            keep.update(itertools.islice((k for k in cands if k not in keep), left))
        return [k for k in cands if k in keep]

    def ahead(self, granted: int = 0, using: Collection[Hashable] = ()) -> list[Hashable]:
        """The host blocks to write to disk ahead of their eviction (see Write-ahead): none
        while host has ``write_ahead`` free blocks or more (``granted``: blocks given room but
        not stored yet, which take room already); else those of the first ``write_ahead`` in
        eviction order that are not on disk, in order, without ``using``."""
        n, host, cap = self.write_ahead, self.tiers[HOST], self.capacity[HOST]
        if not n or self.capacity[DISK] == 0 or (cap is not None and cap - len(host) - granted >= n):
            return []
        disk = self.tiers[DISK]
        return [k for k in itertools.islice(self._order(HOST), n) if k not in disk and k not in using]

    def promotions(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Which keys of a get to bring from disk into host: those on disk and not in host
        (each once, in order)."""
        host, disk = self.tiers[HOST], self.tiers[DISK]
        return [k for k in dict.fromkeys(keys) if k not in host and k in disk]

    # -- facts: what happened --------------------------------------------------------------

    def on_commit(self, keys: Iterable[Hashable]) -> None:
        """A put made these blocks visible in host: the most recent ones, seen once more."""
        self._see_touch(HOST, keys)

    def on_hit(self, keys: Iterable[Hashable]) -> None:
        """A get found these blocks in host: the most recent ones, seen once more."""
        self.on_commit(keys)

    def on_promote(self, keys: Iterable[Hashable]) -> None:
        """These blocks were read from disk into host (they stay on disk): the most recent ones
        of both tiers, seen once more."""
        keys = self._call_order(keys)
        self.counts.promotions += len(keys)
        self._see(keys)
        self._touch(DISK, keys)
        self._touch(HOST, keys)

    def on_write(self, keys: Iterable[Hashable]) -> None:
        """These blocks are now on disk (a demotion or a durable write finished, or a restart
        found them there, oldest first): the most recent ones of the disk tier."""
        self._touch(DISK, list(keys))

    def on_evict(self, tier: Tier, victims: Sequence[Hashable]) -> list[Hashable]:
        """These victims left ``tier`` for capacity. For host, returns the ones to demote
        (:meth:`demotions`); they keep their seen counts until :meth:`on_demotion_end`."""
        self._pop(tier, victims)
        self.counts.evictions[tier.rank] += len(victims)
        demote = self.demotions(victims) if tier is HOST else []
        self.counts.demotions += len(demote)
        self._moving.update(demote)
        self._forget(victims)
        return demote

    def on_demotion_end(self, keys: Iterable[Hashable]) -> None:
        """The demotion of these keys is over (written with :meth:`on_write`, or not at all)."""
        keys = list(keys)
        self._moving.difference_update(keys)
        self._forget(keys)

    def on_remove(self, tier: Tier, keys: Iterable[Hashable]) -> None:
        """These blocks left ``tier`` other than for capacity (an explicit evict, a checksum failure)."""
        keys = list(keys)
        self._pop(tier, keys)
        self._forget(keys)

    # -- whole requests, with block-count capacities (the daemon's, step for step) ----------

    def put(self, keys: Sequence[Hashable], durable: bool = False) -> PutOutcome:
        """Allocate + Commit of a put: keys held in host or on disk are present (with
        ``durable``, those in host are written to disk first); the others get room in host
        (evicting, and demoting the victims, before any is stored) in order until none is
        left, then become visible there; with ``durable`` they are then written to disk."""
        keys = list(dict.fromkeys(keys))
        host, disk = self.tiers[HOST], self.tiers[DISK]
        if durable:
            self._write_disk([k for k in keys if k in host])
        want = [k for k in keys if k not in host and k not in disk]
        n, victims = self._room(HOST, len(want))
        if victims:
            self._evict_host(victims)
            self._write_ahead(self.ahead(granted=n))
        self.on_commit(want[:n])
        if durable:
            self._write_disk(want[:n])
        return PutOutcome(want[:n], [k for k in keys if k not in want], want[n:])

    def get(self, keys: Sequence[Hashable]) -> list[Tier | None]:
        """Acquire: host hits are used (and kept from eviction while the rest is promoted); the
        keys only on disk are promoted (:meth:`prefetch`). Returns per key the tier it was found
        in (disk for a promoted one), or None."""
        host = self.tiers[HOST]
        hits = [k for k in keys if k in host]
        self.on_hit(hits)
        promoted = self._promote(self.promotions(keys), keep_host=set(hits))
        return [DISK if k in promoted else HOST if k in host else None for k in keys]

    def prefetch(self, keys: Sequence[Hashable]) -> int:
        """These blocks will be used (or an engine just used them without loading them): the
        keys in host become the most recent, seen once more, as a get's hits; those on disk and
        not in host are promoted. Returns how many were promoted."""
        host = self.tiers[HOST]
        hits = [k for k in dict.fromkeys(keys) if k in host]
        self.on_hit(hits)
        return len(self._promote(self.promotions(keys), keep_host=set(hits)))

    def evict(self, keys: Sequence[Hashable]) -> int:
        """Remove these keys from host and disk; returns the entries removed."""
        n = 0
        for tier in (HOST, DISK):
            gone = [k for k in dict.fromkeys(keys) if k in self.tiers[tier]]
            self.on_remove(tier, gone)
            n += len(gone)
        return n

    # -- one engine request, as the replay models it ---------------------------------------

    def access(self, keys: Sequence[Hashable]) -> list[Tier]:
        """Apply one request that uses ``keys`` (in order); returns the leading run's tiers.
        Its leading run is served (disk hits are promoted); then every block of the request is
        written through into host and gpu (the engine offloads what it computes), each tier
        evicting its least recently used blocks past its capacity."""
        ranks = self.leading_ranks(keys)
        c = self.counts
        for r in ranks:
            c.hits[r.rank] += 1
        c.misses += len(keys) - len(ranks)
        promoted = [k for k, r in zip(keys, ranks, strict=False) if r is DISK]
        if promoted:
            c.promotions += len(promoted)
            self._touch(DISK, self._call_order(promoted))  # a hit is a use on disk too
        evicted, demoted = c.evictions[HOST.rank], c.demotions
        self._write_through(HOST, keys, see=True)  # every key seen once more; before gpu, so a
        if self.write_ahead and c.evictions[HOST.rank] > evicted:  # (the write-ahead's room: what
            cap = self.disk_write_cap                              # the demotions left of the cap)
            ahead = self.ahead()
            self._write_ahead(ahead if cap is None else ahead[:max(0, cap - (c.demotions - demoted))])
        self._write_through(GPU, keys)             # block the gpu cannot keep is already safe in host
        return ranks

    # -- internals -------------------------------------------------------------------------

    def _count(self, key: Hashable) -> int:
        """How often ``key`` was seen (0: not held, or not seen since it entered a tier)."""
        n = self.tiers[HOST].get(key)
        if n is None:
            n = self.tiers[DISK].get(key)
        return self._loose.get(key, 0) if n is None else n

    def _see(self, keys: Iterable[Hashable]) -> None:
        """Count one more sighting of each key, in host and disk where they hold it (or loose)."""
        host, disk, loose = self.tiers[HOST], self.tiers[DISK], self._loose
        for k in keys:
            h, d = host.get(k), disk.get(k)
            if h is None and d is None:
                loose[k] = loose.get(k, 0) + 1
                continue
            n = (d if h is None else h) + 1
            if h is not None:
                host[k] = n  # a new value keeps the key's place
            if d is not None:
                disk[k] = n

    def _see_touch(self, tier: Tier, keys: Iterable[Hashable]) -> None:
        """:meth:`_see`, then :meth:`_touch` of ``tier`` (host or disk), in one pass."""
        od, other = self.tiers[tier], self.tiers[DISK if tier is HOST else HOST]
        get, other_get, loose_pop, move = od.get, other.get, self._loose.pop, od.move_to_end
        keys = self._call_order(keys)
        if tier is HOST and self._lirs is not None:
            self._lirs.use(keys)
        for k in keys:
            n = get(k)
            if n is not None:  # held here (and maybe in the other): the same count in both
                move(k)
                od[k] = n = n + 1
                if k in other:
                    other[k] = n
                continue
            n = other_get(k)
            if n is None:
                od[k] = loose_pop(k, 0) + 1
            else:
                od[k] = other[k] = n + 1

    def _call_order(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """The keys of one call in the order they become recent in host and disk: tail first
        under ``kvtier`` (the chain's head ends the most recent), as given under ``lru``."""
        keys = list(keys)
        if self._tail_first:
            keys.reverse()
        return keys

    def _touch(self, tier: Tier, keys: Iterable[Hashable]) -> None:
        """Make ``keys`` the most recent of ``tier``; a key new in host or disk brings its count."""
        od = self.tiers[tier]
        if tier is GPU:
            for k in keys:
                if k in od:
                    od.move_to_end(k)
                else:
                    od[k] = None
            return
        if tier is HOST and self._lirs is not None:
            keys = list(keys)
            self._lirs.use(keys)
        other_get = self.tiers[DISK if tier is HOST else HOST].get
        loose_pop, move = self._loose.pop, od.move_to_end
        for k in keys:
            if k in od:
                move(k)
            else:
                n = loose_pop(k, None)
                od[k] = other_get(k, 0) if n is None else n

    def _pop(self, tier: Tier, keys: Iterable[Hashable]) -> None:
        """Take ``keys`` out of ``tier``; the count of one now in neither host nor disk is kept
        loose (until :meth:`_forget`)."""
        od = self.tiers[tier]
        if tier is GPU:
            for k in keys:
                od.pop(k, None)
            return
        other, loose, pop = self.tiers[DISK if tier is HOST else HOST], self._loose, od.pop
        if tier is HOST and self._lirs is not None:
            keys = list(keys)
            self._lirs.gone(k for k in keys if k in od)
        for k in keys:
            n = pop(k, None)
            if n and k not in other:
                loose[k] = n

    def _forget(self, keys: Iterable[Hashable]) -> None:
        """Drop the counts of those of ``keys`` held in no tier and not on their way to disk."""
        loose, moving, gpu = self._loose, self._moving, self.tiers[GPU]
        for k in keys:
            if k in loose and k not in moving and k not in gpu:  # a loose key is in neither host nor disk
                del loose[k]
                self.counts.dropped += 1

    def _room(self, tier: Tier, n: int, keep: Collection[Hashable] = ()) -> tuple[int, list[Hashable]]:
        """How many of ``n`` new blocks ``tier`` admits (the first ones), and the victims that
        takes (not yet evicted): free room first, then victims in order."""
        cap = self.capacity[tier]
        if cap is None:
            return n, []
        free = max(0, cap - len(self.tiers[tier]))
        if n <= free:
            return n, []
        victims = list(itertools.islice(self.victims(tier, keep), n - free))
        return free + len(victims), victims

    def _evict_host(self, victims: Sequence[Hashable], keep_disk: Collection[Hashable] = ()) -> None:
        """Host victims leave; those worth it are written to disk (as the store's demotion)."""
        demote = self.on_evict(HOST, victims)
        try:
            self._write_disk(demote, keep_disk)
        finally:
            self.on_demotion_end(demote)

    def _write_ahead(self, keys: Sequence[Hashable], keep: Collection[Hashable] = ()) -> None:
        """Write host blocks to disk ahead of their eviction (:meth:`ahead`), counted in ``counts.ahead``."""
        if keys:
            self.counts.ahead += self._write_disk(keys, keep)

    def _write_disk(self, keys: Sequence[Hashable], keep: Collection[Hashable] = ()) -> int:
        """Write blocks not on disk yet, in order, while disk has room (as the store's disk
        writes); returns how many were written."""
        if self.capacity[DISK] == 0:
            return 0
        todo = [k for k in dict.fromkeys(keys) if k not in self.tiers[DISK]]
        n, victims = self._room(DISK, len(todo), keep)
        if victims:
            self.on_evict(DISK, victims)
        self.on_write(todo[:n])
        return n

    def _promote(self, below: list[Hashable], keep_host: Collection[Hashable] = ()) -> set[Hashable]:
        """Read ``below`` (on disk, not in host) into host, as far as host has room; the disk
        entries being read cannot be evicted by the demotions this causes."""
        if not below:
            return set()
        n, victims = self._room(HOST, len(below), keep_host)
        if victims:
            self._evict_host(victims, keep_disk=set(below))
        self.on_promote(below[:n])
        self._write_ahead(self.ahead(using=keep_host))
        return set(below[:n])

    def _write_through(self, tier: Tier, keys: Sequence[Hashable], see: bool = False) -> None:
        """Every key into ``tier`` as its most recent (with ``see``: seen once more, first; host
        only); then the least recently used past the capacity leave it (host victims worth it go
        to disk the same way)."""
        cap = self.capacity[tier]
        if cap == 0:
            if see:
                self._see(keys)
            self._forget(keys)
            return
        if see:
            self._see_touch(tier, keys)
        else:
            self._touch(tier, keys)
        od = self.tiers[tier]
        if cap is None or len(od) <= cap:
            return
        victims = list(itertools.islice(self.victims(tier), len(od) - cap))
        demote = self.on_evict(tier, victims)
        try:
            if demote:
                self._write_through(DISK, demote)
        finally:
            self.on_demotion_end(demote)


__all__ = ["ADAPTIVE_SHARES", "AdaptiveLirs", "DEFAULT_EVICTION", "DISK", "EVICTIONS", "GPU", "HOST", "LIRS_GHOSTS", "LIRS_HIR_SHARE", "Lirs", "MiniCache", "PolicyCounts", "PutOutcome", "SeenCounts", "TierPolicy"]

"""``kvtier replay TRACE.jsonl``: what hit rate, by tier, would N replicas behind this router get?

Replays a request trace in the Mooncake format (one JSON object a line, time-ordered:
``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``, optional
``session_id``) through the real router (:class:`kvtier.client.routing.router.Router`) and
the real placement policy (:class:`kvtier.tiers.policy.TierPolicy`), as a simulation of
metadata only: no payload bytes move, so an hour of traffic replays in seconds.

The model
    * Each replica is one engine worker on its own node (:class:`SimulatedNode`): one
      ``TierPolicy`` with the given gpu, host and disk capacities (tokens, turned into blocks
      of ``--block-tokens``). The node publishes what its tiers hold as a daemon does: a
      NodeInfo (its worker, layout fingerprint and tier bandwidths), then after every
      request the location events of what entered and left each tier.
    * Requests are routed in arrival order. The chosen replica's tiers serve the request's
      leading run of held blocks at once (the cache state moves in arrival order), and every
      block it used is then held there (see ``TierPolicy``); its events reach the router
      before the next request.
    * Service: a replica prefills one request at a time, first come first served, computing
      the tokens not served from a tier at ``--prefill-tps``. Blocks served from host, disk or
      a peer load at their bytes (``--kv-bytes-per-token``) over that tier's bandwidth.
      ``--loads async`` (the default; vLLM's offloading connector): when the request's turn
      comes its loads start, each source (host, disk, peer) reading one request after another,
      and the gpu goes on to the next requests meanwhile; the request computes once its loads
      are in, so its queue holds only compute. ``--loads serial``: the loads hold the gpu, and
      a block slower to load than to recompute is recomputed. TTFT = time queued + loads +
      own compute. Decoding runs alongside (a continuous batch) at ``--decode-tps`` tokens
      per second per request; a request is *active* on its replica from dispatch until its
      last output token.
    * Hit rate is in blocks: blocks served from any tier / blocks in the trace. For one
      replica with unbounded capacity it equals the trace's ideal prefix hit rate.

Policies (``--policy``)
    ``round-robin``.
    ``random``: seeded by ``--seed``.
    ``session``: a session's requests stick to the replica its first request went to; new
    sessions, and requests without a session, go round-robin; n/a when no request of the
    trace has a ``session_id``.
    ``prefix``: Dynamo-like, over the holdings of a ``LocationIndex`` fed by the nodes'
    events: cost = blocks to prefill, counting a device prefix as held, host blocks beyond
    it as 0.75 and disk blocks beyond that as 0.25, plus queued prefill blocks, plus the
    blocks held by the active requests; equal costs broken at random (seeded).
    ``kvtier``: ours, as ``kvtier route-server`` decides: a ``Router`` fed by the nodes'
    events, one ``Router.route`` per request (dispatching, so the chosen worker gets the
    request's speculative entries and its load), ``Router.finish`` with ``prefill_only`` when
    the prefill ends and without when the last token is out, as a gateway would call them.
    Its scorer settings are the replay's: ``--prefill-tps``, ``--kv-bytes-per-token``, the
    load bandwidths (which the nodes also publish), ``--queued-weight`` and
    ``--active-weight``.

    ``kvtier-pull`` (only when named): ``kvtier`` with pulls (``RouterConfig.pulls``, the
    route-server's default; ``kvtier`` is ``--no-pulls``). With ``--peer-gbps`` > 0 the
    router counts blocks other replicas hold in host or disk as the remote tier and returns
    fetch hints; the chosen replica serves the hint's keys that another replica still holds,
    past its own leading run, as remote hits, loaded at the peer bandwidth before its prefill.
    With ``--peer-gbps 0`` it is ``kvtier``. No shared store is modelled.

``--rate-scale X`` divides the arrival times by X.

Eviction (``--eviction``) orders the host and disk tiers' victims: ``lru`` (the default,
kvtierd's), ``kvtier`` (tail first) and ``lirs`` (LIRS in host: loop resistant, best where
host is small against the traffic) are :class:`~kvtier.tiers.policy.TierPolicy`'s (see
docs/eviction.md);
``opt`` is the clairvoyant bound: the victim is the block whose next use in the trace is the
farthest (Belady), with the same prefix rule (only a leading run is served). It needs the
future, so only a replay runs it: ``kvtier replay my.jsonl --policy round-robin --replicas 1
--eviction opt`` is the most any eviction order reaches on that trace and those capacities.

Per (policy, replicas) the output has: ``hit_rate`` (remote hits included), ``hit_rate_by_tier``
{gpu, host, disk}, ``remote_hit_rate`` (blocks pulled from peers),
``prefill_tokens_saved``, ``imbalance`` (max / mean of the prefill tokens each replica
computed), ``ttft_mean_s``, ``ttft_p99_s``, ``busiest_prefill_share`` (the time the busiest
replica spent prefilling, as a share of the trace's span: above 1 it is *overloaded*, its
queue grows for the whole trace and its TTFT measures the trace's length more than the
router); a terminal table, ``--json`` (``{"rows": [...]}`` as the last line) and ``--plot
FILE.png`` (needs the ``plot`` extra: matplotlib): hit rate by tier for each policy against
replicas, with the *pooled* reference (one replica with N times the capacity of one, the
most any router of N replicas could reach; :func:`pooled`), p99 TTFT with the overloaded
points marked, and imbalance.
"""

from __future__ import annotations

import argparse
import array
import heapq
import itertools
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import islice

import numpy as np

from kvtier.client.routing.index import LocationIndex
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.routing.scoring import LOAD_MODES, ScorerConfig
from kvtier.client.routing.sparse import parse_strides
from kvtier.proto import locations_pb2 as L
from kvtier.settings import format_size, parse_size
from kvtier.tiers.policy import DEFAULT_EVICTION, DEMOTE_AHEAD_BYTES, DEMOTE_MIN_SEEN, EVICTIONS, TierPolicy
from kvtier.tiers.vocab import TIER_LABELS, TIERS, Tier

#: the replay's eviction orders: the policy's, and the clairvoyant bound
REPLAY_EVICTIONS = (*EVICTIONS, "opt")

POLICIES = ("round-robin", "random", "session", "prefix", "kvtier", "kvtier-pull")
#: the policies run when ``--policy`` is not given (kvtier-pull needs ``--peer-gbps``)
DEFAULT_POLICIES = ("round-robin", "random", "session", "prefix", "kvtier")
#: the Dynamo-like ``prefix`` policy's fixed tier weights
PREFIX_HOST_WEIGHT, PREFIX_DISK_WEIGHT = 0.75, 0.25

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """``"100k"`` -> 100000, ``"1M"`` -> 10**6, ``"2G"`` -> 2 * 10**9; plain integers as they are."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"not a token count: {text!r} (use e.g. 100000, 100k, 1M, 10G)")
    return int(float(m[1]) * _SUFFIX[m[2].lower()])


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[int, ...]
    session: str | None = None


def block_key(hash_id: int) -> bytes:
    """A trace's hash id as the block key the nodes, the index and the router see (16 bytes)."""
    return hash_id.to_bytes(16, "little", signed=True)


def load_trace(path: str) -> list[Request]:
    """Read a Mooncake-format trace; raises ValueError naming the line of a malformed record."""
    out: list[Request] = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                sess = rec.get("session_id")
                out.append(Request(rec["timestamp"] / 1000.0, int(rec["input_length"]), int(rec["output_length"]),
                                   tuple(int(h) for h in rec["hash_ids"]), None if sess is None else str(sess)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({type(e).__name__}: {e}); expected "
                                 f"timestamp, input_length, output_length, hash_ids") from None
    out.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return out


_SCORER = ScorerConfig()
_ROUTER = RouterConfig()


@dataclass(frozen=True)
class ReplayConfig:
    """The simulated deployment: per-replica capacities (tokens) and the service model. The
    defaults shared with the router's scorer are the scorer's (one default each)."""

    block_tokens: int = 512
    gpu_tokens: int = 100_000
    host_tokens: int = 1_000_000
    disk_tokens: int = 10_000_000
    demote_min_seen: int = DEMOTE_MIN_SEEN     # kvtierd's --demote-min-seen
    disk_write_gbps: float = 2.0          # the disk's write bandwidth (0: not modelled; seen-often victims only)
    disk_write_burst_s: float = 8.0       # unused write bandwidth kept for later, in seconds of it
    demote_ahead_bytes: int = DEMOTE_AHEAD_BYTES  # kvtierd's --demote-ahead-bytes (whole blocks of it; 0: none)
    prefill_tps: float = _SCORER.prefill_tokens_per_s        # prefill tokens per second of one replica
    decode_tps: float = 50.0                                  # output tokens per second of one request
    kv_bytes_per_token: float = _SCORER.bytes_per_token       # KV bytes of one token (all layers of the shard)
    host_load_gbps: float = _SCORER.host_load_gbps            # host -> GPU, 10^9 B/s
    disk_load_gbps: float = _SCORER.disk_load_gbps            # disk -> host -> GPU, 10^9 B/s
    queued_weight: float = _SCORER.queued_weight              # the kvtier policy's load weights (a, b)
    active_weight: float = _SCORER.active_weight
    loads: str = _SCORER.loads                                # async: beside the prefill; serial: holding it
    seed: int = 0
    peer_gbps: float = 0.0      # another replica's host/disk -> this GPU, 10^9 B/s (0: no peers, no remote tier)
    rate_scale: float = 1.0     # arrival times were divided by this (recorded; main applies it)
    # the router's new-session rule (RouterConfig's defaults; spread 0: off)
    new_session_spread: float = _ROUTER.new_session_spread
    new_session_share: float = _ROUTER.new_session_share
    session_halflife_s: float = _ROUTER.session_halflife_s
    eviction: str = DEFAULT_EVICTION  # host and disk victim order: lru (kvtierd's), kvtier, lirs, adaptive or opt (REPLAY_EVICTIONS)
    index_strides: str = _ROUTER.index_strides  # the router's sparse host/disk index (RouterConfig.index_strides)

    def blocks(self, tokens: int) -> int:
        return tokens // self.block_tokens

    def scorer_config(self) -> ScorerConfig:
        return ScorerConfig(prefill_tokens_per_s=self.prefill_tps, bytes_per_token=self.kv_bytes_per_token,
                            host_load_gbps=self.host_load_gbps, disk_load_gbps=self.disk_load_gbps,
                            remote_load_gbps=self.peer_gbps or _SCORER.remote_load_gbps,
                            queued_weight=self.queued_weight, active_weight=self.active_weight,
                            loads=self.loads)

    def block_load_s(self, tier: Tier) -> float:
        """Seconds to bring one block from ``tier`` into the gpu (serial loads: capped at
        recomputing it, since an engine that loads in its prefill would recompute instead)."""
        recompute = self.block_tokens / self.prefill_tps
        if tier == Tier.GPU:
            return 0.0
        gbps = {Tier.HOST: self.host_load_gbps, Tier.DISK: self.disk_load_gbps}.get(tier, self.peer_gbps)
        if gbps <= 0:
            return recompute
        load = self.block_tokens * self.kv_bytes_per_token / (gbps * 1e9)
        return load if self.loads == "async" else min(recompute, load)


@dataclass
class Row:
    """One (policy, replicas) result; ``None`` values (and ``na``) when the policy does not apply."""

    policy: str
    replicas: int
    hit_rate: float | None = None
    hit_rate_by_tier: dict[str, float] | None = None
    prefill_tokens_saved: int | None = None
    imbalance: float | None = None
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    busiest_prefill_share: float | None = None  # the busiest replica's prefill time / the trace's span
    requests: int = 0
    blocks: int = 0
    na: str | None = None   # why the policy does not apply to this trace
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: int = 0
    promotions: int = 0
    remote_hit_rate: float | None = None  # blocks pulled from another replica's host or disk / blocks (in hit_rate)


# -- the simulated nodes -----------------------------------------------------------------------

FINGERPRINT = bytes(16)
"""The one layout fingerprint of every simulated worker."""

Feed = Callable[[L.WatchLocationsReply], None]


class SimulatedNode:
    """One replica's node: its tiers (a :class:`~kvtier.tiers.policy.TierPolicy`) and the
    location feed a daemon would publish for them (to ``feed``, when given).

    The adapter to ``TierPolicy``: the replay uses its API here and nowhere else (``access``,
    ``victims``, ``tiers``, ``counts``). What changed in a tier during a request is found from
    its blocks in least-recently-used order (``victims``): a request of ``n`` blocks stores at
    most ``n`` new ones in a tier, so what leaves is among the ``2n`` least recent before it;
    what enters is among the request's blocks and host's leavers (demoted to disk). Where the
    counts do not add up, the whole tier is compared with what was published instead."""

    def __init__(self, cfg: ReplayConfig, node_id: str, worker_id: str, feed: Feed | None = None) -> None:
        self.node_id, self.worker_id = node_id, worker_id
        caps = (cfg.blocks(cfg.gpu_tokens), cfg.blocks(cfg.host_tokens), cfg.blocks(cfg.disk_tokens))
        self._policy = (ClairvoyantPolicy(*caps, cfg.demote_min_seen) if cfg.eviction == "opt" else
                        TierPolicy(*caps, cfg.demote_min_seen, eviction=cfg.eviction))
        # the daemon's write-ahead window: at most a quarter of host, in whole blocks
        self._policy.write_ahead = int(min(cfg.demote_ahead_bytes, cfg.host_tokens * cfg.kv_bytes_per_token / 4)
                                       // (cfg.block_tokens * cfg.kv_bytes_per_token)) if cfg.disk_write_gbps > 0 else 0
        self._feed = feed
        self._published: dict[Tier, set[bytes]] = {t: set() for t in TIERS}
        self._seq = 0
        self._cfg = cfg
        self._credit, self._credit_at = 0.0, 0.0  # bytes the disk can still write now, as of when
        if feed is not None:
            info = L.NodeInfo(node_id=node_id, epoch=1)
            info.workers.add(worker_id=worker_id, fingerprints=[FINGERPRINT])
            block_bytes = int(cfg.block_tokens * cfg.kv_bytes_per_token)
            for tier, blocks, gbps in ((Tier.HOST, cfg.blocks(cfg.host_tokens), cfg.host_load_gbps),
                                       (Tier.DISK, cfg.blocks(cfg.disk_tokens), cfg.disk_load_gbps)):
                info.tiers.add(tier=int(tier), capacity_bytes=blocks * block_bytes, load_gbps=gbps)
            info.tiers.add(tier=int(Tier.REMOTE), capacity_bytes=0, load_gbps=cfg.peer_gbps)
            feed(L.WatchLocationsReply(epoch=1, node=info))
            feed(L.WatchLocationsReply(epoch=1, snapshot=L.SnapshotPart(at_seq=0, first=True, last=True)))

    def access(self, keys: list[bytes], now: float = 0.0,
               next_uses: Sequence[int] | None = None) -> tuple[int, int, int]:
        """Serve one request: blocks of its leading run found in gpu, host and disk. Every
        block it used is then held (``TierPolicy.access``); the changes go to the feed.
        ``next_uses``: the request index of each key's next use (the ``opt`` eviction's)."""
        policy = self._policy
        if isinstance(policy, ClairvoyantPolicy):
            policy.will_use(keys, next_uses if next_uses is not None else [NEVER] * len(keys))
        write_gbps = self._cfg.disk_write_gbps
        if write_gbps > 0:  # the disk writes at its bandwidth (a token bucket); demotions beyond it are dropped
            block_bytes = self._cfg.block_tokens * self._cfg.kv_bytes_per_token
            rate = write_gbps * 1e9
            self._credit = min(rate * self._cfg.disk_write_burst_s, self._credit + (now - self._credit_at) * rate)
            self._credit_at = now
            policy.disk_write_room = policy.disk_write_cap = int(self._credit // block_bytes)
            before = policy.counts.demotions + policy.counts.ahead
        if self._feed is None:
            ranks = policy.access(keys)
        else:
            fronts = {t: list(islice(policy.victims(t), 2 * len(keys) + 2)) for t in TIERS}
            ranks = policy.access(keys)
            self._publish(list(dict.fromkeys([*keys, *fronts[Tier.HOST]])), fronts)
        if write_gbps > 0:
            self._credit -= (policy.counts.demotions + policy.counts.ahead - before) * block_bytes
        return ranks.count(Tier.GPU), ranks.count(Tier.HOST), ranks.count(Tier.DISK)

    def _publish(self, entering: list[bytes], fronts: dict[Tier, list[bytes]]) -> None:
        batch = L.EventBatch()
        for tier in TIERS:
            od, pub, front = self._policy.tiers[tier], self._published[tier], fronts[tier]
            stored = [k for k in entering if k in od and k not in pub]
            gone = len(pub) + len(stored) - len(od)  # how many left, if all that entered is in stored
            removed = list(islice((k for k in front if k not in od), gone)) if gone > 0 else []
            if len(removed) != gone:  # a change beyond those looked at: compare the whole tier
                removed, stored = [k for k in pub if k not in od], [k for k in od if k not in pub]
            pub.difference_update(removed)
            pub.update(stored)
            worker = self.worker_id if tier == Tier.GPU else ""
            for kind, ks in ((L.REMOVED, removed), (L.STORED, stored)):
                if ks:
                    self._seq += 1
                    batch.events.add(seq=self._seq, kind=kind, tier=int(tier), worker_id=worker,
                                     fingerprint=FINGERPRINT, keys=ks)
        if batch.events:
            batch.head_seq = self._seq
            assert self._feed is not None
            self._feed(L.WatchLocationsReply(epoch=1, events=batch))

    def shares(self, key: bytes) -> bool:
        """Whether this node could serve ``key`` to a peer (its host or disk holds it)."""
        tiers = self._policy.tiers
        return key in tiers[Tier.HOST] or key in tiers[Tier.DISK]

    def tiers(self) -> tuple[set[bytes], ...]:
        """What gpu, host and disk hold now (for tests)."""
        return tuple(set(self._policy.tiers[t]) for t in TIERS)

    def counts(self) -> tuple[list[int], int, int]:
        """(evictions from gpu, host, disk; demotions; promotions) so far."""
        c = self._policy.counts
        return list(c.evictions), c.demotions, c.promotions


NEVER = 1 << 62
"""The next use of a key the trace does not use again."""


class ClairvoyantPolicy(TierPolicy):
    """The ``opt`` eviction: :class:`TierPolicy` whose host and disk victims are the blocks
    used again farthest in the future (or never), Belady's bound; gpu stays LRU. Before each
    request the replay tells it when each of the request's keys is used next
    (:meth:`will_use`); each tier keeps a heap of (-next use, key), checked lazily against
    what it holds. Everything else (demotions, promotions, counts) is the policy's."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self._next: dict[Hashable, int] = {}
        self._heaps: dict[Tier, list[tuple[int, Hashable]]] = {Tier.HOST: [], Tier.DISK: []}

    def will_use(self, keys: Sequence[Hashable], next_uses: Sequence[int]) -> None:
        nxt = self._next
        nxt.update(zip(keys, next_uses, strict=True))
        for tier, heap in self._heaps.items():
            if self.capacity[tier] == 0:
                continue
            if len(heap) > 4 * len(self.tiers[tier]) + 4096:  # drop stale entries
                heap[:] = [(-nxt[k], k) for k in self.tiers[tier] if k in nxt]
                heapq.heapify(heap)
            for k, n in zip(keys, next_uses, strict=True):
                heapq.heappush(heap, (-n, k))

    def victims(self, tier: Tier, keep: Collection[Hashable] = ()) -> Iterator[Hashable]:
        if tier is Tier.GPU:
            return super().victims(tier, keep)
        return self._farthest(tier, keep)

    def _farthest(self, tier: Tier, keep: Collection[Hashable]) -> Iterator[Hashable]:
        heap, held, nxt = self._heaps[tier], self.tiers[tier], self._next
        kept: list[tuple[int, Hashable]] = []
        given: set[Hashable] = set()
        try:
            while heap:
                n, k = heapq.heappop(heap)
                if k not in held or nxt.get(k) != -n or k in given:
                    continue  # stale: left the tier, or used since
                if k in keep:
                    kept.append((n, k))
                    continue
                given.add(k)
                yield k
        finally:
            for e in kept:
                heapq.heappush(heap, e)


def next_uses(requests: Sequence[Request]) -> list[array.array]:
    """For each request, the index of the next request that uses each of its keys (``NEVER``)."""
    out: list[array.array] = [array.array("q")] * len(requests)
    later: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        keys = requests[i].keys
        out[i] = array.array("q", [later.get(h, NEVER) for h in keys])
        for h in keys:
            later[h] = i
    return out


class Replica:
    """One simulated worker: its node and its queue."""

    __slots__ = ("node", "free_at", "io_free_at", "active", "active_blocks", "computed_tokens", "busy_s")

    def __init__(self, cfg: ReplayConfig, index: int = 0, feed: Feed | None = None) -> None:
        self.node = SimulatedNode(cfg, f"node{index}", f"replica{index}", feed)
        self.free_at = 0.0                        # when its prefill queue drains
        self.io_free_at = [0.0, 0.0, 0.0]         # async loads: when its host, disk and peer reads drain
        self.active: list[tuple[float, int]] = []  # heap of (finish time, blocks held)
        self.active_blocks = 0
        self.computed_tokens = 0                  # prefill work done: tokens computed
        self.busy_s = 0.0                         # time its gpu spent prefilling (serial loads: and loading)

    def advance(self, now: float) -> None:
        act = self.active
        while act and act[0][0] <= now:
            self.active_blocks -= heapq.heappop(act)[1]


# -- the policies ------------------------------------------------------------------------------

class Policy:
    """A routing policy: picks a replica for each request. One that follows the nodes' feeds
    gets every message of replica ``i``'s feed through :meth:`feed`."""

    follows_feeds = False
    pulled: tuple[int, int] | None = None  # keys [i, j) of the last choice to fetch from peers first

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        raise NotImplementedError

    def feed(self, replica: int, reply: L.WatchLocationsReply) -> None:
        """A message of replica ``replica``'s location feed."""

    def served(self, prefill_done_s: float, done_s: float) -> None:
        """The request just chosen will finish its prefill and its last token at these times."""


class RoundRobin(Policy):
    def __init__(self, n: int) -> None:
        self.n, self.turn = n, itertools.count()

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        return next(self.turn) % self.n


class RandomChoice(Policy):
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, random.Random(seed)

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        return self.rng.randrange(self.n)


class Sticky(Policy):
    """``session``: a session sticks where its first request went; others round-robin."""

    def __init__(self, n: int) -> None:
        self.n, self.turn = n, itertools.count()
        self.sticky: dict[str, int] = {}

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        if req.session is None:  # a request without a session is a session of its own
            return next(self.turn) % self.n
        if req.session not in self.sticky:
            self.sticky[req.session] = next(self.turn) % self.n
        return self.sticky[req.session]


class PrefixAware(Policy):
    """``prefix`` (Dynamo-like): fixed tier weights, load in blocks, random ties."""

    follows_feeds = True

    def __init__(self, cfg: ReplayConfig, n: int) -> None:
        self.index = LocationIndex()
        self.rng = random.Random(cfg.seed)
        self.blocks_per_s = cfg.prefill_tps / cfg.block_tokens
        self._plan: object = None
        self._column = list(range(n))  # replica -> its column in the holdings

    def feed(self, replica: int, reply: L.WatchLocationsReply) -> None:
        self.index.fold(f"node{replica}", reply)

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        lead = self.index.holdings(self.index.rows(keys), remote=False)[:3]
        plan = self.index.plan()
        if plan is not self._plan:
            pos = {w.name: w.index for w in plan.workers}
            self._column = [pos[f"replica{i}"] for i in range(len(reps))]
            self._plan = plan
        costs = []
        for rep, col in zip(reps, self._column, strict=True):
            g, h, d = lead[:, col].tolist()
            held = g + PREFIX_HOST_WEIGHT * (h - g) + PREFIX_DISK_WEIGHT * (d - h)
            queued = max(0.0, rep.free_at - now) * self.blocks_per_s
            costs.append(len(keys) - held + queued + rep.active_blocks)
        best = min(costs)
        return self.rng.choice([i for i, c in enumerate(costs) if c - best <= 1e-9])


class RouterPolicy(Policy):
    """``kvtier``: the real :class:`~kvtier.client.routing.router.Router`, fed by the nodes'
    feeds, deciding with ``Router.route`` and told of each request's end with
    ``Router.finish``, as a gateway in front of ``kvtier route-server`` would."""

    follows_feeds = True

    def __init__(self, cfg: ReplayConfig, n: int, pulls: bool = False) -> None:
        # kvtier: route-server with --no-pulls (each worker's own tiers); kvtier-pull: with
        # pulls, when there are peers to pull from (--peer-gbps)
        self.pulls = pulls and cfg.peer_gbps > 0
        self.router = Router(RouterConfig(scorer=cfg.scorer_config(), pulls=self.pulls,
                                          new_session_spread=cfg.new_session_spread,
                                          new_session_share=cfg.new_session_share,
                                          session_halflife_s=cfg.session_halflife_s,
                                          index_strides=cfg.index_strides))
        self.replica = {f"replica{i}": i for i in range(n)}
        self._finishes: list[tuple[float, int, bool]] = []  # heap of (at, decision id, prefill only)
        self._last = 0

    def feed(self, replica: int, reply: L.WatchLocationsReply) -> None:
        self.router.apply(f"node{replica}", reply)

    def choose(self, req: Request, keys: list[bytes], now: float, reps: list[Replica]) -> int:
        fin = self._finishes
        while fin and fin[0][0] <= now:
            _, did, prefill_only = heapq.heappop(fin)
            self.router.finish(did, prefill_only)
        d = self.router.route(keys, now=now)
        self._last = d.decision_id
        self.pulled = (d.fetch[0].start, d.fetch[-1].end) if d.fetch else None
        return self.replica[d.worker]  # type: ignore[index]

    def served(self, prefill_done_s: float, done_s: float) -> None:
        heapq.heappush(self._finishes, (prefill_done_s, self._last, True))
        heapq.heappush(self._finishes, (done_s, self._last, False))


def make_policy(policy: str, cfg: ReplayConfig, n: int) -> Policy:
    """The routing policy ``policy`` over ``n`` replicas."""
    makers: dict[str, Callable[[], Policy]] = {
        "round-robin": lambda: RoundRobin(n), "random": lambda: RandomChoice(n, cfg.seed),
        "session": lambda: Sticky(n), "prefix": lambda: PrefixAware(cfg, n), "kvtier": lambda: RouterPolicy(cfg, n),
        "kvtier-pull": lambda: RouterPolicy(cfg, n, pulls=True)}
    if policy not in makers:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return makers[policy]()


# -- the simulation ----------------------------------------------------------------------------

class Cluster:
    """``n`` replicas behind one policy, advanced one request at a time (:meth:`step`).
    ``observe(i, reply)``, when given, is a second subscriber: it gets every message of
    replica ``i``'s feed too, after the policy."""

    def __init__(self, cfg: ReplayConfig, policy: str, n: int,
                 observe: Callable[[int, L.WatchLocationsReply], None] | None = None) -> None:
        if n < 1:
            raise ValueError("replicas must be >= 1")
        self.cfg = cfg
        self.policy = make_policy(policy, cfg, n)
        routed = n > 1 and self.policy.follows_feeds

        def feed_of(i: int) -> Feed | None:
            if not routed and observe is None:
                return None

            def feed(reply: L.WatchLocationsReply) -> None:
                if routed:
                    self.policy.feed(i, reply)
                if observe is not None:
                    observe(i, reply)
            return feed

        self.replicas = [Replica(cfg, i, feed_of(i)) for i in range(n)]
        self._load_s = [cfg.block_load_s(t) for t in (*TIERS, Tier.REMOTE)]
        self.remote_hits = 0  # blocks served from peers so far

    def _pulled(self, i: int, keys: list[bytes], own: int) -> int:
        """Blocks the chosen replica ``i`` fetches from peers: the fetch hint's keys [a, b),
        from where its own leading run ``own`` ends (a <= own), while another replica still
        holds them in host or disk; 0 without peers or a hint."""
        span = self.policy.pulled
        if not self.cfg.peer_gbps or span is None or not span[0] <= own < span[1]:
            return 0
        others = [rep.node for j, rep in enumerate(self.replicas) if j != i]
        n = own
        while n < span[1] and any(node.shares(keys[n]) for node in others):
            n += 1
        return n - own

    def step(self, req: Request, next_uses: Sequence[int] | None = None) -> tuple[int, tuple[int, int, int], float]:
        """Route and serve one request: (replica, blocks served from gpu, host, disk, TTFT);
        blocks pulled from peers (the remote tier) are added to :attr:`remote_hits`.
        ``next_uses``: see :meth:`SimulatedNode.access` (the ``opt`` eviction's)."""
        cfg, reps = self.cfg, self.replicas
        now = req.arrival_s
        for rep in reps:
            rep.advance(now)
        keys = [block_key(h) for h in req.keys]
        i = self.policy.choose(req, keys, now, reps) if len(reps) > 1 else 0
        rep = reps[i]
        hits = rep.node.access(keys, now, next_uses)  # every key is held by rep from now on: pulled ones too
        remote = self._pulled(i, keys, sum(hits)) if self.policy.pulled else 0
        self.remote_hits += remote
        computed = req.input_tokens - min((sum(hits) + remote) * cfg.block_tokens, req.input_tokens)
        rep.computed_tokens += computed
        start = max(now, rep.free_at)
        loads = (hits[1] * self._load_s[1], hits[2] * self._load_s[2], remote * self._load_s[3])
        if cfg.loads == "async":
            # as vLLM's offloading connector: the loads start at the request's queue turn, each
            # source (pcie, disk, nic) reading one request after another; the gpu's queue holds
            # only compute (the engine runs the next requests while this one loads), and the
            # request computes once its loads are in
            loaded = start
            for t, s in enumerate(loads):
                if s > 0:
                    rep.io_free_at[t] = max(start, rep.io_free_at[t]) + s
                    loaded = max(loaded, rep.io_free_at[t])
            compute_s = computed / cfg.prefill_tps
            rep.busy_s += compute_s
            rep.free_at = start + compute_s
            prefilled = loaded + compute_s
        else:
            prefill_s = computed / cfg.prefill_tps + sum(loads)
            rep.busy_s += prefill_s
            rep.free_at = prefilled = start + prefill_s
        done = prefilled + req.output_tokens / cfg.decode_tps
        held = -(-(req.input_tokens + req.output_tokens) // cfg.block_tokens)
        heapq.heappush(rep.active, (done, held))
        rep.active_blocks += held
        self.policy.served(prefilled, done)
        return i, hits, prefilled - now


def replay(requests: Sequence[Request], cfg: ReplayConfig, policy: str, replicas: int,
           progress: Callable[[int], None] | None = None) -> Row:
    """Simulate ``requests`` on ``replicas`` workers routed by ``policy``; see the module docstring."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if policy == "session" and not any(r.session is not None for r in requests):
        return Row(policy, replicas, requests=len(requests), na="trace has no session_id")
    cluster = Cluster(cfg, policy, replicas)
    future = next_uses(requests) if cfg.eviction == "opt" else None
    ttft = np.empty(len(requests))
    hits = [0, 0, 0]
    saved_tokens = 0
    for i, req in enumerate(requests):
        before = cluster.remote_hits
        _, served, ttft[i] = cluster.step(req, None if future is None else future[i])
        for t in range(3):
            hits[t] += served[t]
        saved_tokens += min((sum(served) + cluster.remote_hits - before) * cfg.block_tokens, req.input_tokens)
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(requests) % 256)
    return _row(policy, cluster.replicas, requests, hits, saved_tokens, ttft, cluster.remote_hits)


def pooled(requests: Sequence[Request], cfg: ReplayConfig, replicas: Sequence[int],
           progress: Callable[[int], None] | None = None) -> dict[int, Row]:
    """The pooled reference for each replica count ``n``: one replica with ``n`` times the
    capacity of one in every tier, and ``n`` times its disk write bandwidth (one cache holding
    what all ``n`` hold, written by all ``n`` disks; no routing). Its hit rate is what a router
    of ``n`` replicas could reach at most."""
    out = {}
    for n in sorted(set(replicas)):
        big = replace(cfg, gpu_tokens=n * cfg.gpu_tokens, host_tokens=n * cfg.host_tokens,
                      disk_tokens=n * cfg.disk_tokens, disk_write_gbps=n * cfg.disk_write_gbps,
                      demote_ahead_bytes=n * cfg.demote_ahead_bytes)
        out[n] = replace(replay(requests, big, "round-robin", 1, progress), policy="pooled", replicas=n)
    return out


def _row(policy: str, reps: list[Replica], requests: Sequence[Request], hits: list[int], saved_tokens: int,
         ttft: np.ndarray, remote: int = 0) -> Row:
    total = sum(len(r.keys) for r in requests)
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    work = [r.computed_tokens for r in reps]
    mean_work = sum(work) / len(work)
    counts = [r.node.counts() for r in reps]
    return Row(
        policy, len(reps),
        hit_rate=(sum(hits) + remote) / total if total else 0.0,
        remote_hit_rate=remote / total if total else 0.0,
        hit_rate_by_tier={name: (hits[t] / total if total else 0.0) for t, name in enumerate(TIER_LABELS)},
        prefill_tokens_saved=saved_tokens,
        imbalance=max(work) / mean_work if mean_work else 1.0,
        ttft_mean_s=float(ttft.mean()) if len(ttft) else 0.0,
        ttft_p99_s=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
        busiest_prefill_share=max(r.busy_s for r in reps) / span if span > 0 else None,
        requests=len(requests), blocks=total,
        evictions={name: sum(c[0][t] for c in counts) for t, name in enumerate(TIER_LABELS)},
        demotions=sum(c[1] for c in counts), promotions=sum(c[2] for c in counts))


# -- output ---------------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.label = ""
        self.started = self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last >= 0.2 or self.done >= self.total):
            self.last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            eta = (now - self.started) * (1 - frac) / frac if frac > 0 else 0.0
            sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%}  {self.label:<18} eta {eta:5.0f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 72 + "\r")
            sys.stderr.flush()


def _human(tokens: int) -> str:
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if tokens >= div and tokens % (div // 1000 or 1) == 0:
            return f"{tokens / div:g}{suffix}"
    return str(tokens)


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    """The rows as aligned text, or with ``markdown`` as a Markdown table (docs/replay.md's)."""
    head = ("policy", "replicas", "hit_rate", "gpu", "host", "disk", "remote", "tokens_saved", "imbalance",
            "ttft_mean_s", "ttft_p99_s")
    lines = [head]
    for r in rows:
        t = r.hit_rate_by_tier or {}
        lines.append((r.policy, str(r.replicas), _fmt(r.hit_rate, ".4f"), _fmt(t.get("gpu"), ".4f"),
                      _fmt(t.get("host"), ".4f"), _fmt(t.get("disk"), ".4f"), _fmt(r.remote_hit_rate, ".4f"),
                      _fmt(r.prefill_tokens_saved, ",d"), _fmt(r.imbalance, ".3f"), _fmt(r.ttft_mean_s, ".3f"),
                      _fmt(r.ttft_p99_s, ".3f")))
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
                         + ["| " + " | ".join(line) + " |" for line in lines[1:]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


TIER_COLORS = {"gpu": "#1b7837", "host": "#2166ac", "disk": "#e08214", "remote": "#8073ac"}


def plot(rows: Sequence[Row], path: str, title: str = "", pooled: dict[int, Row] | None = None) -> None:
    """Hit rate by tier against replicas, one panel per policy (stacked: gpu, host, disk; the
    pooled reference as a dashed line); p99 TTFT per policy (log scale; overloaded points
    ringed); imbalance per policy (from 1.0). Needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]' in a kvtier checkout") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.na is None]
    policies = list(dict.fromkeys(r.policy for r in ok))
    ticks = sorted({r.replicas for r in rows})
    cols = max(2, len(policies))
    fig = plt.figure(figsize=(3.3 * cols, 8.6))
    grid = fig.add_gridspec(2, 2 * cols, height_ratios=[1.0, 1.0], hspace=0.42, wspace=0.9)
    top = max([(r.hit_rate or 0.0) for r in ok] +
              [p.hit_rate or 0.0 for p in (pooled or {}).values()] + [0.05])
    first = None
    for i, pol in enumerate(policies):
        ax = fig.add_subplot(grid[0, 2 * i:2 * i + 2], sharey=first)
        first = first or ax
        _hit_panel(ax, [r for r in ok if r.policy == pol], ticks, pooled, top, legend=i == 0)
        ax.set_title(pol)
        if i:
            ax.tick_params(labelleft=False)
    if first is not None:
        first.set_ylabel("hit rate (share of blocks)")
    ax_ttft = fig.add_subplot(grid[1, :cols])
    ax_imb = fig.add_subplot(grid[1, cols:])
    _ttft_panel(ax_ttft, ok, policies, ticks)
    _imbalance_panel(ax_imb, ok, policies, ticks)
    fig.suptitle((title or "kvtier replay") + "\nhit rate by tier, stacked (total above each bar); dashed: a "
                 "pooled cache, 1 replica with N x the capacity of one (what N replicas could reach at most)",
                 fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=0.08)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit_panel(ax, rows: Sequence[Row], ticks: list[int], pooled: dict[int, Row] | None, top: float,
               legend: bool) -> None:
    """One policy's hit rate by tier, stacked, per replica count; the pooled line over it."""
    xs = range(len(ticks))
    by_n = {r.replicas: {**(r.hit_rate_by_tier or {}), "remote": r.remote_hit_rate or 0.0} for r in rows}
    bottom = [0.0] * len(ticks)
    shown = [*TIER_LABELS, *(["remote"] if any(r.remote_hit_rate for r in rows) else [])]
    for tier in shown:
        vals = [by_n.get(n, {}).get(tier, 0.0) for n in ticks]
        ax.bar(xs, vals, 0.62, bottom=bottom, color=TIER_COLORS[tier], label=tier)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for x, n, total in zip(xs, ticks, bottom, strict=True):
        if n in by_n:
            ax.text(x, total + top * 0.015, f"{total:.2f}", ha="center", va="bottom", fontsize=7, zorder=5,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
    if pooled:
        ax.plot(xs, [pooled[n].hit_rate if n in pooled else float("nan") for n in ticks], "k--", marker="_",
                markersize=14, linewidth=1.2, label="pooled: 1 replica,\nN x the capacity")
    ax.set_xticks(list(xs), [str(n) for n in ticks])
    ax.set_xlabel("replicas")
    ax.set_ylim(0, top * 1.15)
    ax.grid(True, axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=7, loc="upper left")


def _ttft_panel(ax, rows: Sequence[Row], policies: list[str], ticks: list[int]) -> None:
    """p99 TTFT per policy (log scale), overloaded points ringed, and a note saying why."""
    for pol in policies:
        pts = sorted((r.replicas, r.ttft_p99_s) for r in rows if r.policy == pol)
        ax.plot([ticks.index(n) for n, _ in pts], [t for _, t in pts], marker="o", markersize=4, label=pol)
    over = [r for r in rows if r.busiest_prefill_share is not None and r.busiest_prefill_share > 1.0]
    for n, t in sorted({(r.replicas, r.ttft_p99_s) for r in over}):
        ax.plot([ticks.index(n)], [t], "o", markersize=15, markerfacecolor="none", markeredgecolor="red")
    if over:
        ax.text(0.99, 0.97, "ringed: overloaded. The busiest replica's prefill work is longer\nthan the trace ("
                + _overload_note(over, policies) + "):\nits queue grows all trace long, so TTFT there measures "
                "the\ntrace's length, not the router", transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
                color="red")
    ax.set_yscale("log")
    ax.set_xticks(range(len(ticks)), [str(n) for n in ticks])
    ax.set_xlabel("replicas")
    ax.set_ylabel("p99 TTFT (s, log scale)")
    ax.set_title("p99 time to first token")
    ax.grid(True, which="both", alpha=0.25)
    if policies:
        ax.legend(fontsize=7, loc="lower left")


def _overload_note(over: Sequence[Row], policies: list[str]) -> str:
    """"1 replica 2.6x; 2 replicas up to 1.3x (round-robin, random)": the overloaded rows by
    replica count, naming the policies when not all are."""
    parts = []
    for n in sorted({r.replicas for r in over}):
        these = [r for r in over if r.replicas == n]
        worst = max(r.busiest_prefill_share or 0.0 for r in these)
        which = "" if len(these) == len(policies) else f" ({', '.join(r.policy for r in these)})"
        up_to = "up to " if len({round(r.busiest_prefill_share or 0.0, 1) for r in these}) > 1 else ""
        parts.append(f"{n} replica{'s' if n > 1 else ''} {up_to}{worst:.1f}x{which}")
    return "; ".join(parts)


def _imbalance_panel(ax, rows: Sequence[Row], policies: list[str], ticks: list[int]) -> None:
    """Imbalance per policy, on an axis from 1.0 (perfect) so noise is not magnified."""
    worst = 1.0
    for pol in policies:
        pts = sorted((r.replicas, r.imbalance) for r in rows if r.policy == pol and r.imbalance is not None)
        worst = max([worst] + [v for _, v in pts])
        ax.plot([ticks.index(n) for n, _ in pts], [v for _, v in pts], marker="o", markersize=4, label=pol)
    ax.set_ylim(1.0, max(1.5, 1.0 + (worst - 1.0) * 1.25))
    ax.set_xticks(range(len(ticks)), [str(n) for n in ticks])
    ax.set_xlabel("replicas")
    ax.set_ylabel("imbalance (max / mean prefill work)")
    ax.set_title("imbalance (1.0: even)")
    ax.grid(True, alpha=0.3)
    if policies:
        ax.legend(fontsize=7, loc="upper left")


# -- command line ---------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("replica counts are integers >= 1, e.g. 1,2,4,8")
    return vals


def _policy_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in POLICIES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or text!r}; choose from {', '.join(POLICIES)}")
    return vals


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _index_stride(text: str) -> str:
    """--index-stride: K (host and disk), or what RouterConfig.index_strides takes."""
    t = text.strip()
    if t.isdigit():
        t = f"host={t},disk={t}"
    try:
        return parse_strides(t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(prog: str = "kvtier replay") -> argparse.ArgumentParser:
    d = ReplayConfig()
    ap = argparse.ArgumentParser(prog=prog, description="Replay a Mooncake-format trace through kvtier's router "
                                 "and tier policy (metadata only) and report hit rate by tier, imbalance and TTFT "
                                 "per (policy, replicas).")
    ap.add_argument("trace", help="JSONL trace: timestamp (ms), input_length, output_length, hash_ids[, session_id]")
    ap.add_argument("--block-tokens", type=int, default=d.block_tokens, help="tokens per hash id [%(default)s]")
    ap.add_argument("--replicas", type=_int_list, default=[1, 2, 4, 8], help="comma list [1,2,4,8]")
    ap.add_argument("--policy", type=_policy_list, default=list(DEFAULT_POLICIES),
                    help=f"comma list of {', '.join(POLICIES)} [{','.join(DEFAULT_POLICIES)}]")
    ap.add_argument("--gpu-tokens", type=_tokens, default=d.gpu_tokens, help="per replica, e.g. 100k [%(default)s]")
    ap.add_argument("--host-tokens", type=_tokens, default=d.host_tokens, help="per replica, e.g. 1M [%(default)s]")
    ap.add_argument("--disk-tokens", type=_tokens, default=d.disk_tokens, help="per replica, e.g. 10M [%(default)s]")
    ap.add_argument("--eviction", choices=REPLAY_EVICTIONS, default=d.eviction,
                    help="host and disk victim order: lru (kvtierd's), kvtier (a request's chain is evicted "
                         "tail first), lirs (LIRS in host: a stable subset of a loop of sessions larger than host "
                         "is kept whole; best where host is small, see docs/eviction.md), adaptive (LIRS whose "
                         "HIR share, or LRU, host picks by small simulations of sampled requests), or opt (the "
                         "clairvoyant bound: the block used again farthest ahead goes "
                         "first; the most any order reaches here) [%(default)s]")
    ap.add_argument("--index-stride", type=_index_stride, default=d.index_strides, metavar="K|host=K,disk=K",
                    help="the kvtier policies' router indexes the host and disk tiers sparsely (route-server's "
                         "--index-strides): every K-th key of a stored run and its last; K for both tiers, "
                         "host=K,disk=K, or default (host=8,disk=16); empty: every key [%(default)s]")
    ap.add_argument("--demote-min-seen", type=int, default=d.demote_min_seen,
                    help="when the disk's write queue is full, host evictions go to disk only if used "
                         "this often [%(default)s]")
    ap.add_argument("--disk-write-gbps", type=float, default=d.disk_write_gbps,
                    help="the disk's write bandwidth, 10^9 B/s: every host eviction is demoted while the "
                         "bandwidth has room for it (blocks used --demote-min-seen times first when it has not), "
                         "demotions beyond it are dropped; 0: not modelled, only blocks used --demote-min-seen "
                         "times are demoted [%(default)s]")
    ap.add_argument("--disk-write-burst-s", type=float, default=d.disk_write_burst_s,
                    help="write bandwidth left unused is kept for later up to this many seconds of it [%(default)s]")
    ap.add_argument("--demote-ahead-bytes", type=parse_size, default=d.demote_ahead_bytes,
                    help="kvtierd's write-ahead window: while host is full, its least recently used blocks within "
                         "this many bytes (whole blocks, at most a quarter of host) are written to disk before they "
                         f"are evicted, as far as the write bandwidth has room; 0: none [{format_size(d.demote_ahead_bytes)}]")
    ap.add_argument("--prefill-tps", type=_positive, default=d.prefill_tps, help="prefill tokens/s per replica [%(default)s]")
    ap.add_argument("--decode-tps", type=_positive, default=d.decode_tps, help="output tokens/s per request [%(default)s]")
    ap.add_argument("--kv-bytes-per-token", type=_positive, default=d.kv_bytes_per_token,
                    help="KV bytes per token [%(default)s]")
    ap.add_argument("--host-load-gbps", type=float, default=d.host_load_gbps,
                    help="host -> GPU load bandwidth, 10^9 B/s [%(default)s]")
    ap.add_argument("--disk-load-gbps", type=float, default=d.disk_load_gbps,
                    help="disk -> GPU load bandwidth, 10^9 B/s [%(default)s]")
    ap.add_argument("--loads", choices=LOAD_MODES, default=d.loads,
                    help="how the engine loads cached blocks: async (vLLM's offloading connector: the gpu "
                         "prefills other requests while a request's blocks load) or serial (the load holds the "
                         "gpu; a block slower to load than to recompute is recomputed) [%(default)s]")
    ap.add_argument("--queued-weight", type=float, default=d.queued_weight,
                    help="kvtier policy: cost per queued prefill block [%(default)s]")
    ap.add_argument("--active-weight", type=float, default=d.active_weight,
                    help="kvtier policy: cost per active request [%(default)s]")
    ap.add_argument("--seed", type=int, default=d.seed, help="for random and prefix tie-breaks [%(default)s]")
    ap.add_argument("--peer-gbps", type=float, default=d.peer_gbps,
                    help="peers: a block another replica holds in host or disk loads at this bandwidth, 10^9 B/s, "
                         "when the kvtier-pull policy's fetch hint asks for it (0: no peers) [%(default)s]")
    ap.add_argument("--rate-scale", type=_positive, default=d.rate_scale,
                    help="arrival times divided by this (2: twice the request rate) [%(default)s]")
    ap.add_argument("--new-session-spread", type=float, default=d.new_session_spread,
                    help="kvtier policies: a new session's cost per live session on a worker, in its own blocks "
                         "(0: off; route-server's --new-session-spread) [%(default)s]")
    ap.add_argument("--new-session-share", type=float, default=d.new_session_share,
                    help="a request is a new session when no worker holds more than this share of it [%(default)s]")
    ap.add_argument("--session-halflife-s", type=_positive, default=d.session_halflife_s,
                    help="live sessions per worker halve every this many seconds [%(default)s]")
    ap.add_argument("--json", action="store_true", help='print {"rows": [...]} as the last line')
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as Markdown (as docs/replay.md's tables are)")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="draw hit rate by tier (with the pooled reference: 1 replica with N x the capacity), "
                         "p99 TTFT and imbalance against replicas per policy")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.block_tokens < 1:
        ap.error("--block-tokens must be >= 1")
    if args.demote_min_seen < 1:
        ap.error("--demote-min-seen must be >= 1")
    if args.disk_write_gbps < 0 or args.disk_write_burst_s < 0:
        ap.error("--disk-write-gbps and --disk-write-burst-s must be >= 0")
    cfg = replace(ReplayConfig(), block_tokens=args.block_tokens, gpu_tokens=args.gpu_tokens,
                  host_tokens=args.host_tokens, disk_tokens=args.disk_tokens, demote_min_seen=args.demote_min_seen,
                  disk_write_gbps=args.disk_write_gbps, disk_write_burst_s=args.disk_write_burst_s,
                  demote_ahead_bytes=args.demote_ahead_bytes,
                  prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, kv_bytes_per_token=args.kv_bytes_per_token,
                  host_load_gbps=args.host_load_gbps, disk_load_gbps=args.disk_load_gbps,
                  queued_weight=args.queued_weight, active_weight=args.active_weight, seed=args.seed,
                  peer_gbps=args.peer_gbps, rate_scale=args.rate_scale, loads=args.loads, new_session_spread=args.new_session_spread,
                  new_session_share=args.new_session_share, session_halflife_s=args.session_halflife_s,
                  eviction=args.eviction, index_strides=args.index_stride)
    if args.peer_gbps < 0:
        ap.error("--peer-gbps must be >= 0 (0: no peers)")
    try:
        requests = load_trace(args.trace)
    except OSError as e:
        print(f"kvtier replay: cannot read {args.trace}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvtier replay: {e}", file=sys.stderr)
        return 2
    if cfg.rate_scale != 1.0:
        requests = [replace(r, arrival_s=r.arrival_s / cfg.rate_scale) for r in requests]
    runs = [(p, n) for p in args.policy for n in args.replicas]
    bar = Progress(len(requests) * (len(runs) + (len(set(args.replicas)) if args.plot else 0)), sys.stderr.isatty())
    rows = []
    for pol, n in runs:
        bar.label = f"{pol} x{n}"
        rows.append(replay(requests, cfg, pol, n, bar))
    bar.label = "pooled"
    pool = pooled(requests, cfg, args.replicas, bar) if args.plot else None
    bar.close()
    print(f"{args.trace}: {len(requests)} requests, {sum(len(r.keys) for r in requests)} blocks of "
          f"{cfg.block_tokens} tokens; per replica gpu {_human(cfg.gpu_tokens)}, host {_human(cfg.host_tokens)}, "
          f"disk {_human(cfg.disk_tokens)} tokens; eviction {cfg.eviction}")
    print(format_table(rows, markdown=args.markdown))
    if pool is not None:
        print("pooled (1 replica with N x the capacity) hit rate: "
              + ", ".join(f"N={n}: {r.hit_rate:.4f}" for n, r in pool.items()))
        plot(rows, args.plot, pooled=pool,
             title=f"{args.trace.rsplit('/', 1)[-1]}, {len(requests):,} requests; capacity per replica: "
                   f"gpu {_human(cfg.gpu_tokens)}, host {_human(cfg.host_tokens)}, disk {_human(cfg.disk_tokens)} "
                   f"tokens; disk load {cfg.disk_load_gbps:g} GB/s"
                   + (f"; peers {cfg.peer_gbps:g} GB/s" if cfg.peer_gbps else "")
                   + (f"; {cfg.rate_scale:g}x arrival rate" if cfg.rate_scale != 1.0 else ""))
        print(f"plot written to {args.plot}")
    if args.json:
        out = {"config": asdict(cfg), "rows": [asdict(r) for r in rows]}
        if pool is not None:
            out["pooled"] = [asdict(r) for r in pool.values()]
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

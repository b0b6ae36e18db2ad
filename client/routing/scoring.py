"""The routing cost: how much prefill a request would still need on each worker, plus load.

For a request of ``N`` blocks and one worker, ``d_t`` is the length of the request's leading
run of blocks that the worker holds in tier ``t`` or any faster tier (``d_gpu <= d_host <=
d_disk``: the index's holdings). Loading a block from tier ``t`` saves only part of
recomputing it. With ``r_t = load_time(t) / recompute_time = bytes_per_token *
prefill_tokens_per_s / load_bytes_per_s(t)``::

    w_t  = 1 / (1 + r_t)         loads="async" (the default)
         = max(0, 1 - r_t)       loads="serial"
    cost = N - [d_gpu + w_host (d_host - d_gpu) + w_disk (d_disk - d_host)
                + w_remote (d_remote - d_disk)]
             + queued_weight * queued_blocks + active_weight * active_requests

(all in blocks). Async loads are how vLLM's offloading connector and SGLang's HiCache load:
a request's blocks come in over the disk, NIC or PCIe while the GPU prefills other requests,
so a load costs the worker's prefill nothing and the request only the part of it that its
queue does not hide. ``1 / (1 + r)`` is the share of a run of blocks that loading saves when
loading and recomputing split the run between them and run side by side (the split that ends
both at once); it is 1 for an instant tier, about ``1 - r`` for a fast one, and still 0.43 for
a 2 GB/s disk under an 8B model (r = 1.31), which serial loads count as worth nothing.
``d_remote`` counts, past the worker's own tiers, the blocks its node could
fetch from a peer (another node's host or disk) or the shared store (the ``remote`` tier), at
the bandwidth the worker's daemon publishes for it (``remote_load_gbps`` when none); with
pulls off (``Scorer(pulls=False)``) ``w_remote`` is 0. The worker with the lowest cost wins; equal costs go to the least loaded
worker (queued blocks, then active requests), then to a stable hash of the request's last key
and the worker id, so a new session lands on a spread-out but reproducible worker. Never a
coin flip: the same inputs rank the same way in every process and run.

This module is arithmetic over numpy arrays of all workers at once: the index
(``kvtier.client.routing.index``) supplies the holdings, the router the loads, and the
daemons the bandwidths; the :class:`Scorer` owns the tier weights (:meth:`Scorer.weights`
from each worker's published bandwidths, falling back to :class:`ScorerConfig`'s), the cost
(:meth:`Scorer.costs`) and the order (:meth:`Scorer.order`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.client.routing.compiled import load_route
from kvtier.settings import parse_float, setting
from kvtier.tiers.vocab import Tier

# the compiled costs and order (client/routing/_route.c): same answers as numpy's; None where it is not built (or built from other sources)
_croute = load_route()


LOAD_MODES = ("async", "serial")


def parse_loads(text: str) -> str:
    if text not in LOAD_MODES:
        raise ValueError(f"{text!r}: not one of {', '.join(LOAD_MODES)}")
    return text


@dataclass(frozen=True)
class ScorerConfig:
    """Knobs of the cost (each also a ``kvtier route-server`` setting). Bandwidths are 10^9
    bytes per second, used for a tier whose node publishes none (0)."""

    prefill_tokens_per_s: float = setting(20000.0, "recompute rate of one worker (tokens/s)", parse_float, "TOK/S")
    bytes_per_token: float = setting(131072.0, "KV bytes per token of the model shard, all layers "
                                               "(131072: an 8B-class model in 16-bit)", parse_float, "BYTES")
    host_load_gbps: float = setting(50.0, "host->GPU load bandwidth when a daemon publishes none (10^9 B/s; "
                                          "pinned PCIe 5 copies measured 50-55)", parse_float, "GBPS")
    # 2.0: at or above every disk read measured so far (O_DIRECT 0.77-1.8 GB/s, 16 MiB and
    # 2 MiB blocks, on the CPU and GPU machines), so a disk the daemon has not measured yet is
    # not assumed faster than it has ever been seen; a daemon publishes its measured rate
    # once it has promoted blocks from disk, which then replaces this
    disk_load_gbps: float = setting(2.0, "disk->GPU load bandwidth when a daemon publishes none (10^9 B/s; "
                                         "O_DIRECT reads measured 0.8-1.8)", parse_float, "GBPS")
    # 10: a 100 Gb/s NIC at 80 %; a daemon publishes what its fetches from peers and the store
    # measure (its NodeInfo's remote tier), which then replaces this
    remote_load_gbps: float = setting(10.0, "peer/store->GPU load bandwidth (the remote tier) when a daemon "
                                            "publishes none (10^9 B/s)", parse_float, "GBPS")
    # a and b: cost per queued prefill block and per running request. Below 1: sending a turn
    # away from its session's cache also costs that session's later turns, so affinity is worth
    # a short queue (docs/replay.md: the sweep on conversation_trace.jsonl, 8 replicas).
    queued_weight: float = setting(0.15, "cost per queued prefill block (a)", parse_float, "A")
    active_weight: float = setting(0.1, "cost per running request (b)", parse_float, "B")
    # how the engine loads: "async" (vLLM's offloading connector, SGLang HiCache: a request's
    # loads run on the disk, NIC and PCIe while the GPU prefills other requests, w = 1/(1+r));
    # "serial" (the load holds the worker's prefill: w = 1 - r, 0 once a load is slower than
    # recomputing)
    loads: str = setting("async", "how engines load cached blocks: async (beside the prefill) or serial "
                                  "(holding it)", parse_loads, "MODE")


@dataclass(frozen=True)
class Overlap:
    """Leading blocks held in gpu, in host-or-faster, in any of the worker's tiers, and in
    those or the remote tier (``gpu <= host <= disk <= remote``)."""

    gpu: int = 0
    host: int = 0
    disk: int = 0
    remote: int = -1  # in any tier or fetchable from a peer or the store; -1 (not given): = disk

    def __post_init__(self) -> None:
        if self.remote < 0:
            object.__setattr__(self, "remote", self.disk)


@dataclass(frozen=True)
class Load:
    queued_blocks: float = 0.0
    active_requests: float = 0.0


@dataclass(frozen=True)
class Ranked:
    """One worker's place in a routing decision."""

    worker: str
    cost: float
    overlap: Overlap
    load: Load
    saved_blocks: float = field(default=0.0)  # the bracket: blocks of prefill the cache saves


_MIX1 = 0x9E3779B97F4A7C15  # odd: multiplication by it is a bijection mod 2^64
_M64 = (1 << 64) - 1
_MIX1_U64 = np.uint64(_MIX1)


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def tie_hash(last_key: bytes, worker: str) -> int:
    """Stable across processes and runs (unlike ``hash()``): a 64-bit digest of the last key
    xor one of the worker, multiplied by an odd constant (mod 2^64) so every bit of both
    reaches the high bits that decide the order. A router digests the key once per request
    and each worker once (:func:`tie_hashes`)."""
    return ((_digest64(last_key) ^ _digest64(worker.encode())) * _MIX1) & _M64


def worker_digests(workers: Sequence[str]) -> np.ndarray:
    """Each worker's digest, for :func:`tie_hashes`."""
    return np.fromiter((_digest64(w.encode()) for w in workers), dtype=np.uint64, count=len(workers))


def tie_hashes(last_key: bytes, digests: np.ndarray) -> np.ndarray:
    """:func:`tie_hash` of one key against many workers' :func:`worker_digests`, vectorised."""
    x = digests ^ np.uint64(_digest64(last_key))
    x *= _MIX1_U64
    return x


class Scorer:
    """Ranks workers by the cost in the module docstring."""

    def __init__(self, config: ScorerConfig | None = None, pulls: bool = True) -> None:
        self.config = config or ScorerConfig()
        self.pulls = pulls  # False: remote blocks count nothing (w_remote = 0)

    def tier_weight(self, tier: Tier, load_gbps: float = 0.0) -> float:
        """``w_t``: the fraction of a recompute that loading a block from ``tier`` saves, at
        ``load_gbps`` (0: the configured default for the tier)."""
        if tier == Tier.GPU:
            return 1.0
        c = self.config
        if tier == Tier.REMOTE and not self.pulls:
            return 0.0
        bw = load_gbps if load_gbps > 0 else {Tier.HOST: c.host_load_gbps, Tier.DISK: c.disk_load_gbps}.get(
            tier, c.remote_load_gbps)  # (not a positive number, NaN included: the default)
        if not bw > 0:
            return 0.0
        r = c.bytes_per_token * c.prefill_tokens_per_s / (bw * 1e9)  # load time / recompute time
        return 1.0 / (1.0 + r) if c.loads == "async" else max(0.0, 1.0 - r)

    def weights(self, load_gbps: Sequence[Mapping[str, float]]) -> np.ndarray:
        """The (4, workers) weights of :meth:`costs`: ``1 - w_host``, ``w_host - w_disk``,
        ``w_disk - w_remote``, ``w_remote``, from each worker's published bandwidths
        (``{"host": gbps, "disk": gbps, "remote": gbps}`` of its node; 0, or host/disk missing:
        the configured default; remote missing: the node cannot fetch, ``w_remote`` = 0)."""
        memo: dict[tuple[Tier, float], float] = {}  # (workers of a node share its bandwidths)

        def weight(tier: Tier, gbps: float) -> float:
            got = memo.get((tier, gbps))
            if got is None:
                got = memo[tier, gbps] = self.tier_weight(tier, gbps)
            return got

        def w(tier: Tier) -> np.ndarray:
            label = tier.label
            return np.array([weight(tier, bw.get(label, 0.0)) for bw in load_gbps], dtype=np.float64)

        w_host, w_disk, w_remote = w(Tier.HOST), w(Tier.DISK), w(Tier.REMOTE)
        # a node that publishes no remote tier has neither peers nor a store: it cannot pull
        w_remote *= np.array([Tier.REMOTE.label in bw for bw in load_gbps], dtype=np.float64)
        return np.stack([1.0 - w_host, w_host - w_disk, w_disk - w_remote, w_remote]).reshape(4, len(load_gbps))

    def costs(self, n_blocks: int, lead: np.ndarray, load_cost: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cost, saved) for many workers at once. ``lead`` is (4, workers): d_gpu, d_host,
        d_disk, d_remote (the index's holdings); ``load_cost`` is :meth:`load_cost` per worker;
        ``weights`` is :meth:`weights`, so that ``saved = d_gpu + w_host (d_host - d_gpu) +
        w_disk (d_disk - d_host) + w_remote (d_remote - d_disk)``."""
        saved = np.einsum("ij,ij->j", lead, weights)
        cost = n_blocks - saved
        cost += load_cost
        return cost, saved

    def load_cost(self, queued: np.ndarray, active: np.ndarray) -> np.ndarray:
        """``a * queued + b * active`` per worker."""
        c = self.config
        return c.queued_weight * queued + c.active_weight * active

    def rank(self, n_blocks: int, lead: np.ndarray, load_cost: np.ndarray, weights: np.ndarray,
             queued: np.ndarray, active: np.ndarray, digests: np.ndarray, last_key: bytes = b"",
             top_k: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """:meth:`costs` then :meth:`order` (as a list): (cost, saved, order). One compiled call
        where the extension is built (``lead`` int64, the rest float64, ``digests`` uint64, all
        contiguous), else numpy; the same answers."""
        if _croute is None:
            cost, saved = self.costs(n_blocks, lead, load_cost, weights)
            return cost, saved, self.order(cost, queued, active, digests, last_key, top_k).tolist()
        w = len(queued)
        cost, saved = np.empty(w), np.empty(w)
        # numpy's einsum (costs) adds a worker's 4 products in tier order, except where its
        # weights lie next to each other in memory (one worker; a selection of columns is
        # Fortran-ordered): then as (0 + 2) + (1 + 3). The compiled sum follows suit
        pairwise = w == 1 or not weights.flags.c_contiguous
        if not (lead.flags.c_contiguous and weights.flags.c_contiguous):
            lead, weights = np.ascontiguousarray(lead), np.ascontiguousarray(weights)
        order = _croute.rank(n_blocks, lead, weights, load_cost, queued, active, digests, _digest64(last_key),
                             -1 if top_k is None else top_k, cost, saved, pairwise)
        return cost, saved, order

    @staticmethod
    def order(cost: np.ndarray, queued: np.ndarray, active: np.ndarray, digests: np.ndarray,
              last_key: bytes = b"", top_k: int | None = None) -> np.ndarray:
        """Indices of the best ``top_k`` workers (all when None), best first: cost (to 1e-9),
        then queued, then active, then :func:`tie_hash` (``digests`` are the workers'
        :func:`worker_digests`)."""
        n = len(cost)
        k = n if top_k is None else min(top_k, n)
        idx = np.lexsort((tie_hashes(last_key, digests), active, queued, np.round(cost, 9)))
        return idx[:k]

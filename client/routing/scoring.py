"""The routing cost: how much prefill a request would still need on each worker, plus load.

For a request of ``N`` blocks and one worker, ``d_t`` is the length of the request's leading
run of blocks that the worker holds in tier ``t`` or any faster tier (``d_gpu <= d_host <=
d_disk``). Loading a block from tier ``t`` saves only part of recomputing it::

    w_t  = max(0, 1 - load_time(t) / recompute_time)
         = max(0, 1 - bytes_per_token * prefill_tokens_per_s / load_bytes_per_s(t))
    cost = N - [d_gpu + w_host (d_host - d_gpu) + w_disk (d_disk - d_host)]
             + queued_weight * queued_blocks + active_weight * active_requests

(all in blocks). The worker with the lowest cost wins; equal costs go to the least loaded
worker (queued blocks, then active requests), then to a stable hash of the request's last key
and the worker id, so a new session lands on a spread-out but reproducible worker. Never a
coin flip: the same inputs rank the same way in every process and run.

This module is pure arithmetic: the index (``kvtier.client.routing.index``) supplies the overlaps,
the router the loads, and the daemons the bandwidths. :meth:`Scorer.rank` works on
mappings; :meth:`Scorer.costs` and :meth:`Scorer.order` are the same cost and order over
numpy arrays of all workers at once (per-worker tier weights allowed), for the router's hot
path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: tier order, fastest first; a key's tier rank is its index here (3 = not held)
TIER_ORDER = ("gpu", "host", "disk")
NOT_HELD = len(TIER_ORDER)


@dataclass(frozen=True)
class ScorerConfig:
    """Knobs of the cost. Bandwidths are 10^9 bytes per second; 0 means "unknown, use default"."""

    prefill_tokens_per_s: float = 20000.0   # recompute rate of one worker
    bytes_per_token: float = 131072.0       # KV bytes per token of the model shard (all layers)
    host_load_gbps: float = 50.0            # host -> GPU (measured PCIe, see LIMITS.md)
    disk_load_gbps: float = 2.0             # disk -> host -> GPU
    # a and b: cost per queued prefill block and per running request. Below 1: sending a turn
    # away from its session's cache also costs that session's later turns, so affinity is worth
    # a short queue. On conversation_trace.jsonl with 8 replicas, 0.25/0.1 keeps 0.97 of the
    # pooled-capacity hit rate at imbalance 1.05, where 1.0/0.5 keeps 0.89 (docs/replay.md).
    queued_weight: float = 0.25
    active_weight: float = 0.1

    def tier_weight(self, tier: str, load_gbps: float | None = None) -> float:
        """``w_t``: the fraction of a recompute that loading a block from ``tier`` saves."""
        if tier == "gpu":
            return 1.0
        bw = load_gbps or (self.host_load_gbps if tier == "host" else self.disk_load_gbps)
        if bw <= 0:
            return 0.0
        return max(0.0, 1.0 - self.bytes_per_token * self.prefill_tokens_per_s / (bw * 1e9))


@dataclass(frozen=True)
class Overlap:
    """Leading blocks held in gpu, in host-or-faster, and in any tier (``gpu <= host <= disk``)."""

    gpu: int = 0
    host: int = 0
    disk: int = 0

    @classmethod
    def from_ranks(cls, ranks: Iterable[int]) -> Overlap:
        """From each key's best tier rank (0 gpu, 1 host, 2 disk, 3 not held), in request order."""
        d = [0, 0, 0]
        worst = 0  # tier t's leading run is unbroken while every key so far has rank <= t
        for r in ranks:
            worst = max(worst, r)
            if worst >= NOT_HELD:
                break
            for t in range(worst, NOT_HELD):
                d[t] += 1
        return cls(d[0], d[1], d[2])


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

    def __init__(self, config: ScorerConfig | None = None, load_gbps: Mapping[str, float] | None = None) -> None:
        self.config = config or ScorerConfig()
        self.set_bandwidths(load_gbps or {})

    def set_bandwidths(self, load_gbps: Mapping[str, float]) -> None:
        """Use measured load bandwidths per tier (as daemons publish them) for the weights."""
        self.w_host = self.config.tier_weight("host", load_gbps.get("host"))
        self.w_disk = self.config.tier_weight("disk", load_gbps.get("disk"))

    def saved(self, ov: Overlap) -> float:
        return ov.gpu + self.w_host * (ov.host - ov.gpu) + self.w_disk * (ov.disk - ov.host)

    def cost(self, n_blocks: int, ov: Overlap, load: Load) -> float:
        c = self.config
        return n_blocks - self.saved(ov) + c.queued_weight * load.queued_blocks + c.active_weight * load.active_requests

    def rank(self, n_blocks: int, workers: Sequence[str], overlaps: Mapping[str, Overlap],
             loads: Mapping[str, Load], last_key: bytes = b"") -> list[Ranked]:
        """Workers best first. Missing overlaps or loads count as zero."""
        out = []
        for w in workers:
            ov = overlaps.get(w, Overlap())
            ld = loads.get(w, Load())
            out.append(Ranked(w, self.cost(n_blocks, ov, ld), ov, ld, self.saved(ov)))
        out.sort(key=lambda r: (round(r.cost, 9), r.load.queued_blocks, r.load.active_requests,
                                tie_hash(last_key, r.worker)))
        return out

    def costs(self, n_blocks: int, lead: np.ndarray, load_cost: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cost, saved) for many workers at once. ``lead`` is (3, workers): d_gpu, d_host,
        d_disk; ``load_cost`` is ``a * queued + b * active`` per worker; ``weights`` is (3,
        workers): ``1 - w_host``, ``w_host - w_disk``, ``w_disk`` (see :meth:`lead_weights`),
        so that ``saved = d_gpu + w_host (d_host - d_gpu) + w_disk (d_disk - d_host)``."""
        saved = np.einsum("ij,ij->j", lead, weights)
        cost = n_blocks - saved
        cost += load_cost
        return cost, saved

    @staticmethod
    def lead_weights(w_host: np.ndarray, w_disk: np.ndarray) -> np.ndarray:
        """The (3, workers) weights of :meth:`costs` from per-worker tier weights."""
        return np.stack([1.0 - w_host, w_host - w_disk, w_disk])

    def load_cost(self, queued: np.ndarray, active: np.ndarray) -> np.ndarray:
        c = self.config
        return c.queued_weight * queued + c.active_weight * active

    @staticmethod
    def order(cost: np.ndarray, queued: np.ndarray, active: np.ndarray, digests: np.ndarray,
              last_key: bytes = b"", top_k: int | None = None) -> np.ndarray:
        """Indices of the best ``top_k`` workers (all when None), best first, in the order of
        :meth:`rank`: cost, then queued, then active, then :func:`tie_hash` (``digests`` are
        the workers' :func:`worker_digests`)."""
        n = len(cost)
        k = n if top_k is None else min(top_k, n)
        idx = np.lexsort((tie_hashes(last_key, digests), active, queued, np.round(cost, 9)))
        return idx[:k]

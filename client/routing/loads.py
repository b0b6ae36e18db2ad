"""The router's load accounting: what it dispatched to each worker and has not seen finish.

Owns, per worker, *queued* prefill blocks and *active* requests:
    * :meth:`Loads.dispatch` charges a worker a request's blocks to prefill (the cost's ``N -
      saved``) and one active request; :meth:`Loads.finish` with ``prefill_only`` takes the
      queued blocks off, without it also the active request (a request whose prefill was
      never reported done takes both off). A dispatch never finished stops counting
      ``load_ttl_s`` after it was made (:meth:`Loads.expire`);
    * an engine's own report (:meth:`Loads.report`) is a floor under both numbers, for
      ``report_ttl_s`` after it was made (0: until replaced): an engine that stops reporting
      (it died, or its reporter did) stops holding its worker's load up;
    * arrays aligned with the index's workers (:meth:`Loads.align`): ``queued``, ``active``
      and ``cost`` (the scorer's load term ``a * queued + b * active``), updated in place on
      every change, so routing reads them without a per-worker loop.

Counts never go below zero. Not thread-safe: the router serialises calls.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvtier.client.routing.scoring import Load, Scorer

# a dispatched request: [worker, queued blocks, prefilled] (a list: made on every decision)
_WORKER, _QUEUED, _PREFILLED = 0, 1, 2


class Loads:
    """See the module docstring; ``scorer`` prices the load (its
    :meth:`~kvtier.client.routing.scoring.Scorer.load_cost`)."""

    def __init__(self, load_ttl_s: float, scorer: Scorer, report_ttl_s: float = 0.0) -> None:
        self.load_ttl_s = load_ttl_s
        self.report_ttl_s = report_ttl_s
        self._reported_at: dict[str, float] = {}
        self._next_report_expiry = float("inf")
        self._load_cost = scorer.load_cost
        # the same term for one worker, inline: it is updated on every dispatch and finish
        self._qw, self._aw = scorer.config.queued_weight, scorer.config.active_weight
        self._ids = itertools.count(1)
        self._dispatched: dict[int, list] = {}  # id -> [worker, queued, prefilled]
        self._order: deque[tuple[float, int]] = deque()  # (dispatched at, id), oldest first
        self._queued: dict[str, float] = {}
        self._active: dict[str, float] = {}
        self._reported: dict[str, tuple[float, float]] = {}
        self._pos: dict[str, int] = {}
        self.align(())

    def align(self, workers: Sequence[str]) -> None:
        """Rebuild the arrays for these workers, in this order."""
        rep = self._reported
        none = (0.0, 0.0)
        # one (3, workers) array, queued, active and cost its rows: the compiled decision reads it at once
        self.qac = qac = np.zeros((3, len(workers)), dtype=np.float64)
        self.queued, self.active, self.cost = qac
        qac[0] = [max(self._queued.get(w, 0.0), rep.get(w, none)[0]) for w in workers]
        qac[1] = [max(self._active.get(w, 0.0), rep.get(w, none)[1]) for w in workers]
        qac[2] = self._load_cost(self.queued, self.active)
        # _add writes one element through these (a memoryview's item assignment is a fraction
        # of numpy's); the arrays are replaced only here
        self._views = (memoryview(self.queued), memoryview(self.active), memoryview(self.cost))
        self._pos = {w: i for i, w in enumerate(workers)}

    def dispatch(self, worker: str, queued: float, now: float) -> int:
        """Charge ``worker`` a request of ``queued`` blocks to prefill; returns its id."""
        did = next(self._ids)
        self._dispatched[did] = [worker, queued, False]
        self._order.append((now, did))
        self._add(worker, queued, 1.0)
        return did

    def finish(self, decision_id: int, prefill_only: bool = False) -> bool:
        """The dispatched request's prefill is done (``prefill_only``) or it ended; False for
        an id not dispatched (or already finished)."""
        if prefill_only:
            d = self._dispatched.get(decision_id)
            if d is None:
                return False
            if not d[_PREFILLED]:
                self._add(d[_WORKER], -d[_QUEUED], 0.0)
                d[_PREFILLED] = True
            return True
        d = self._dispatched.pop(decision_id, None)
        if d is None:
            return False
        self._add(d[_WORKER], 0.0 if d[_PREFILLED] else -d[_QUEUED], -1.0)
        return True

    def report(self, worker: str, queued_blocks: float, active_requests: float, now: float = 0.0) -> None:
        """An engine's own report of its load: at least this much is counted (until
        ``report_ttl_s`` after ``now``)."""
        self._reported[worker] = (queued_blocks, active_requests)
        if self.report_ttl_s > 0:
            self._reported_at[worker] = now
            self._next_report_expiry = min(self._next_report_expiry, now + self.report_ttl_s)
        self._add(worker, 0.0, 0.0)

    def _expire_reports(self, now: float) -> None:
        limit = now - self.report_ttl_s
        for worker in [w for w, at in self._reported_at.items() if at <= limit]:
            del self._reported_at[worker]
            del self._reported[worker]
            self._add(worker, 0.0, 0.0)
        self._next_report_expiry = min(self._reported_at.values(), default=float("inf")) + self.report_ttl_s

    def load(self, worker: str) -> Load:
        rq, ra = self._reported.get(worker, (0.0, 0.0))
        return Load(max(rq, self._queued.get(worker, 0.0)), max(ra, self._active.get(worker, 0.0)))

    def expire(self, now: float) -> None:
        """Finish what was dispatched more than ``load_ttl_s`` ago; drop finished entries
        from the front of the queue (so it holds about the requests still running); forget
        engine reports older than ``report_ttl_s``."""
        if now >= self._next_report_expiry:
            self._expire_reports(now)
        order = self._order
        if not order:
            return
        live = self._dispatched
        limit = now - self.load_ttl_s
        while order:
            at, did = order[0]
            if did in live:
                if at >= limit:
                    break
                self.finish(did)
            order.popleft()

    def _add(self, worker: str, queued: float, active: float) -> None:
        qd, ad = self._queued, self._active
        q = qd.get(worker, 0.0) + queued
        a = ad.get(worker, 0.0) + active
        if q < 0.0:
            q = 0.0
        if a < 0.0:
            a = 0.0
        qd[worker] = q
        ad[worker] = a
        i = self._pos.get(worker)
        if i is not None:
            rep = self._reported.get(worker)
            if rep is not None:
                q, a = max(q, rep[0]), max(a, rep[1])
            vq, va, vc = self._views
            vq[i] = q
            va[i] = a
            vc[i] = self._qw * q + self._aw * a

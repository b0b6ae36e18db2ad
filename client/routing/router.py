"""The cache-aware router: follows many daemons' location feeds and ranks workers for requests.

Owns, and puts together:
    * a :class:`~kvtier.client.routing.index.LocationIndex`: the fold of every feed; it
      answers which leading blocks of a request each worker holds in each tier;
    * the :class:`~kvtier.client.routing.feed.Feeds` that keep it current: the static targets
      of :class:`RouterConfig` and the addresses of its DNS names, each resumed from its
      node's position, reconnected with backoff;
    * a :class:`~kvtier.client.routing.scoring.Scorer`: tier weights from the bandwidths each
      node publishes, the cost and the order;
    * the :class:`~kvtier.client.routing.loads.Loads` it dispatched: per worker, queued
      prefill blocks and active requests from :meth:`Router.route` (``dispatch=True``) until
      :meth:`Router.finish` (or until ``load_ttl_s`` if never finished); an engine's own
      report (:meth:`Router.set_load`) is a floor under them;
    * speculative entries: a dispatched request's keys are marked as on the chosen worker's
      GPU at once, so the session's next turn sticks there before the engine's events
      arrive (they expire after ``speculative_ttl_s`` to ``2 * speculative_ttl_s``);
    * the vLLM event sources (:class:`~kvtier.client.routing.vllm_events.VllmEvents`): vLLM
      engines' own KV event publishers, folded into the same index as workers of their own
      nodes (``vllm_events``, :meth:`Router.add_vllm_events`; docs/integrations.md);
    * the saved position: with ``state_path`` the index, every node's position and which
      target served which node are written atomically every ``save_interval_s`` and on
      :meth:`close`; a router started again loads them and resumes each feed where the file
      says.

A decision (:meth:`Router.route`): the index's rows and holdings for the keys, the scorer's
cost over every worker (or the candidates, each of which must be a worker the router knows:
:class:`UnknownCandidates` otherwise) with the loads, its order, then (dispatching) the load
and the speculative entries. ``Router.route`` dispatches by default; the gRPC ``Route`` of
``kvtier route-server`` only ranks unless the request sets ``dispatch`` (a proto3 bool,
false when not set). ``kvtier route-server`` and ``kvtier replay`` decide through
this method. :meth:`Router.dispatch` dispatches a request to one worker of a ranking made
without dispatching (the gateway's: it ranks the replicas, then sends to one), as ranking that
worker again would.

Threading: feeds run on a private asyncio loop in a background thread; one lock serialises
the feeds' folding and :meth:`route`, so ``route`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.client.engine.transport import ClientTls
from kvtier.client.routing.feed import FOLD_KEYS, QUEUE_KEYS, Feeds, FeedStatus, Resolve
from kvtier.client.routing.fetch import FetchHint, hint_fingerprints
from kvtier.client.routing.index import LocationIndex, Rows, _rows
from kvtier.client.routing.loads import Loads
from kvtier.client.routing.scoring import (
    Load,
    Overlap,
    Ranked,
    Scorer,
    ScorerConfig,
    worker_digests,
)
from kvtier.client.routing.sparse import parse_strides, strides_of
from kvtier.client.routing.vllm_events import VllmEvents, VllmSource, VllmStreamStatus, parse_vllm_events
from kvtier.proto import locations_pb2
from kvtier.settings import group, parse_bool, parse_float, parse_int, parse_list, setting

log = logging.getLogger("kvtier.router")

__all__ = ["Decision", "FeedStatus", "FetchHint", "Router", "RouterConfig", "RouterError", "UnknownCandidates"]


def parse_layout(value: str) -> str:
    """An index layout name (RouterConfig.index_layout)."""
    if value not in ("matrix", "pairs"):
        raise ValueError(f"{value!r} is not an index layout (matrix or pairs)")
    return value


@dataclass(frozen=True)
class RouterConfig:
    """Every router setting, one name each; with the scorer's, the ``kvtier route-server``
    settings (flag ``--daemon``, variable ``KVTIER_ROUTER_DAEMON``, TOML key ``daemon``...)."""

    daemons: tuple[str, ...] = setting((), "a kvtierd to subscribe to: a socket path, unix:PATH or HOST:PORT; "
                                           "repeat for several (route-server, with neither --daemon nor --dns: "
                                           "this node's kvtierd, $KVTIER_SOCKET or the default socket)",
                                       parse_list, "TARGET", name="daemon", repeat=True)
    dns: tuple[str, ...] = setting((), "HOST:PORT whose DNS name resolves to several kvtierds (a feed per address); "
                                       "repeat for several", parse_list, "HOST:PORT", repeat=True)
    vllm_events: tuple[str, ...] = setting((), "a vLLM engine's KV event publisher to subscribe to: a ZMQ "
                                                "endpoint, then options such as replay=ENDPOINT, worker=NAME, "
                                                "model=NAME (e.g. tcp://HOST:5557,replay=tcp://HOST:5558,"
                                                "model=NAME; its blocks are routed as a daemon's; "
                                                "docs/integrations.md); repeat for several",
                                           parse_vllm_events, "ENDPOINT[,OPT=V...]", name="vllm_events",
                                           repeat=True)
    resolve_interval_s: float = setting(10.0, "seconds between DNS resolutions; an address that disappears takes its "
                                               "node out of the index", parse_float, "S")
    speculative_ttl_s: float = setting(10.0, "unconfirmed speculative entries expire after this to twice this "
                                             "(seconds)", parse_float, "S")
    load_ttl_s: float = setting(600.0, "a dispatched request never finished stops counting as load after this "
                                       "(seconds)", parse_float, "S")
    state_path: str = setting("", "file for the saved index and feed positions, so a restart resumes instead of "
                                  "taking snapshots (empty: none)",
                              metavar="FILE")
    save_interval_s: float = setting(30.0, "seconds between saves of --state-path (and on stop)", parse_float, "S")
    reconnect_min_s: float = setting(0.1, "first retry delay of a dropped feed (seconds; doubles up to "
                                          "--reconnect-max-s)", parse_float, "S")
    reconnect_max_s: float = setting(5.0, "longest retry delay of a dropped feed (seconds)", parse_float, "S")
    feed_queue_keys: int = setting(QUEUE_KEYS, "keys of a feed's messages read and waiting to be folded at most; an "
                                               "event batch beyond it drops them (counted) and the feed resubscribes "
                                               "from a snapshot", parse_int, "N")
    fold_keys: int = setting(FOLD_KEYS, "keys folded at once under the router's lock: the feeds take turns in "
                                        "pieces of this size, so a decision waits for one piece at most",
                             parse_int, "N")
    index_strides: str = setting("", "index the host and disk tiers sparsely, for fleets whose index would not fit: "
                                     "of each stored run every K-th key and its last (host=K,disk=K; 'default': "
                                     "host=8,disk=16, which lost at most 0.78 % of the hit rate on the public "
                                     "traces at 8 replicas), their leading runs then a bounded estimate; empty "
                                     "(the default): every key", parse_strides, "host=K,disk=K")
    index_layout: str = setting("matrix", "how the index stores where keys are: 'matrix' (a bit per key and location: "
                                          "exact, and the fastest decisions while the fleet's columns are few) or "
                                          "'pairs' (a 10-byte pair per key and location held, a 64-bit fingerprint of "
                                          "the key: its size follows the locations, not the fleet's width; for "
                                          "hundreds of nodes and more; docs/operations.md)", parse_layout,
                                metavar="matrix|pairs")
    index_capacity: int = setting(0, "pairs the 'pairs' index is sized for at start (it grows past them; 0: it "
                                     "grows from empty)", parse_int, "N")
    top_k: int = setting(8, "ranked workers returned (by route-server: when a request asks for 0)", parse_int, "N")
    name: str = setting("kvtier-router", "subscriber name in the daemons' logs")
    scorer: ScorerConfig = group(ScorerConfig, "Scoring")
    # -- cluster sharing --
    pulls: bool = setting(True, "count blocks a worker's daemon can fetch from a peer or the shared store (the "
                                "remote tier) and return fetch hints for them; --no-pulls: only a worker's own "
                                "tiers count", parse_bool, "BOOL")
    node_timeout_s: float = setting(15.0, "a daemon whose feed sends nothing for this long (it sends a heartbeat "
                                          "every 5 s) leaves the index (its columns are reclaimed) until it answers "
                                          "again (seconds; 0: never)",
                                    parse_float, "S")
    load_report_ttl_s: float = setting(30.0, "an engine's load report (set_load) counts for this long unless "
                                             "renewed (seconds; 0: until replaced)", parse_float, "S")
    # -- new sessions --
    # 0 (off) by default: on the traces we have (docs/replay.md, "New sessions") the rule
    # without spread, with pulls, meets every goal and the spread costs a little there; 0.25 wins where
    # many sessions share a short prompt and their later turns collide
    new_session_spread: float = setting(0.0, "a new session's request (no worker holds more than "
                                             "--new-session-share of it) costs this many of its blocks per live "
                                             "session its worker holds beyond the fewest any worker holds, at most "
                                             "what that worker's cache saves it (0: off, overlap and load only; "
                                             "try 0.25)", parse_float, "X")
    new_session_share: float = setting(0.8, "a request is a new session when no worker holds more than this share "
                                            "of its blocks (0..1)", parse_float, "X")
    session_halflife_s: float = setting(300.0, "a worker's live-session count (the new sessions placed there) "
                                               "halves every this many seconds", parse_float, "S")


class Decision:
    """The outcome of :meth:`Router.route`: workers best first (``ranked`` is built on first use)."""

    __slots__ = ("n_blocks", "decision_id", "fetch", "_names", "_nodes", "_order", "_arrays", "_ranked")

    def __init__(self, n_blocks: int, names: list[str], nodes: list[str], order: list[int],
                 arrays: tuple[np.ndarray, ...] | bytes) -> None:
        self.n_blocks = n_blocks
        self.decision_id = 0  # set when dispatched
        self.fetch: list[FetchHint] = []  # what the chosen worker should pull first (remote blocks)
        self._names, self._nodes, self._order, self._arrays = names, nodes, order, arrays
        self._ranked: list[Ranked] | None = None

    @property
    def worker(self) -> str | None:
        """The chosen worker (None when there was none to choose)."""
        return self._names[self._order[0]] if self._order else None

    @property
    def workers(self) -> list[str]:
        return [self._names[i] for i in self._order]

    @property
    def nodes(self) -> list[str]:
        """Node of each ranked worker ("" for a worker no daemon publishes)."""
        return [self._nodes[i] for i in self._order]

    def _lead(self) -> np.ndarray:
        """The (4, workers) leads: from the compiled decision's bytes, or the numpy one's arrays."""
        w = len(self._names)
        if not isinstance(self._arrays, bytes):
            return self._arrays[2]
        return np.frombuffer(self._arrays, dtype=np.int64, count=4 * w, offset=32 * w).reshape(4, w)

    def _saved(self, i: int) -> float:
        """Blocks of prefill the cache saves ranked worker ``i`` (an index into the names)."""
        if not isinstance(self._arrays, bytes):
            return float(self._arrays[1][i])
        return float(np.frombuffer(self._arrays, dtype=np.float64, count=1, offset=8 * (len(self._names) + i))[0])

    def saved_blocks(self, worker: str) -> float:
        """Blocks of prefill the cache saves ``worker`` (one of the ranked workers)."""
        return self._saved(self._names.index(worker))

    def leading(self, worker: str) -> tuple[int, int, int] | None:
        """``worker``'s leading blocks of the request on gpu, host-or-faster and any of its
        tiers (as :class:`Overlap`), or None when it was not ranked."""
        try:
            i = self._names.index(worker)
        except ValueError:
            return None
        lead = self._lead()
        return int(lead[0, i]), int(lead[1, i]), int(lead[2, i])

    @property
    def ranked(self) -> list[Ranked]:
        if self._ranked is None:
            arrays = self._arrays
            if isinstance(arrays, bytes):  # the compiled decision's: (cost, saved, queued, active), then the leads
                cost, saved, q, a = np.frombuffer(arrays, dtype=np.float64, count=4 * len(self._names)).reshape(4, -1)
                dg, dh, dd, dr = self._lead()
            else:
                cost, saved, (dg, dh, dd, dr), q, a = arrays
            self._ranked = [Ranked(self._names[i], float(cost[i]),
                                   Overlap(int(dg[i]), int(dh[i]), int(dd[i]), int(dr[i])),
                                   Load(float(q[i]), float(a[i])), float(saved[i])) for i in self._order]
        return self._ranked

    def __repr__(self) -> str:
        return (f"Decision(n_blocks={self.n_blocks}, decision_id={self.decision_id}, ranked={self.ranked!r}, "
                f"fetch={self.fetch!r})")


class RouterError(Exception):
    """A request the router cannot rank (no workers, malformed keys)."""


class UnknownCandidates(RouterError, ValueError):
    """Candidates naming workers the router does not know (a typo, or a worker whose daemon
    has not been heard from): refused, never ranked or remembered. ``names``: those workers."""

    def __init__(self, names: Sequence[str], known: Sequence[str]) -> None:
        shown = ", ".join(known[:12]) + (f" and {len(known) - 12} more" if len(known) > 12 else "")
        super().__init__(f"unknown candidate worker{'s' if len(names) > 1 else ''} "
                         f"{', '.join(repr(n) for n in names)}: no daemon the router follows publishes "
                         f"{'them' if len(names) > 1 else 'it'} (known workers: {shown or 'none'})")
        self.names = list(names)


@dataclass
class _Workers:
    """Per-worker arrays of one index plan (rebuilt only when the workers change)."""

    plan: Any = None
    names: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    weights: np.ndarray = field(default_factory=lambda: np.zeros((4, 0)))
    decide: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # plan.decide_workers()
    distinct: bool = True  # no two digests equal


def make_index(cfg: RouterConfig) -> LocationIndex:
    """The index of ``cfg``'s layout."""
    strides = strides_of(cfg.index_strides)
    if parse_layout(cfg.index_layout) == "pairs":
        from kvtier.client.routing.pairs import PairIndex  # noqa: PLC0415 - (needs the compiled extension)
        return PairIndex(cfg.speculative_ttl_s, capacity=cfg.index_capacity, strides=strides)
    return LocationIndex(cfg.speculative_ttl_s, strides=strides)


class Router:
    """See the module docstring."""

    def __init__(self, config: RouterConfig | None = None, resolve: Resolve | None = None,
                 tls: ClientTls | None = None) -> None:
        """``resolve(host, port)`` -> addresses, for the DNS feeds (default: the system resolver);
        ``tls``: the client certificate for daemons over TCP (their --tls-ca signs it)."""
        self.config = cfg = config or RouterConfig()
        self.scorer = Scorer(cfg.scorer, pulls=cfg.pulls)
        self.index = make_index(cfg)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()  # one state file written at a time (periodic saves, close)
        self._feeds = Feeds(self.index, self._lock, daemons=cfg.daemons, dns=cfg.dns,
                            resolve_interval_s=cfg.resolve_interval_s, reconnect_min_s=cfg.reconnect_min_s,
                            reconnect_max_s=cfg.reconnect_max_s, subscriber=cfg.name, resolve=resolve, tls=tls,
                            node_timeout_s=cfg.node_timeout_s, queue_keys=cfg.feed_queue_keys,
                            fold_keys=cfg.fold_keys)
        self._loads = Loads(cfg.load_ttl_s, self.scorer, cfg.load_report_ttl_s)
        self._w = _Workers()
        self.vllm = VllmEvents(self.index, self._lock, cfg.vllm_events, protect=self._feeds.foreign)
        self._started = False
        self._sessions: dict[str, float] = {}  # worker -> live sessions placed there (decaying)
        self._sessions_at = 0.0
        self._last_sel: tuple[Any, list[str], np.ndarray, bool] = (None, [], np.zeros(0, dtype=np.int64), False)

    @property
    def on_epoch_change(self) -> Callable[[str, int, int], None] | None:
        """Called with (node, old epoch, new epoch) when a daemon restarted."""
        return self._feeds.on_epoch_change

    @on_epoch_change.setter
    def on_epoch_change(self, fn: Callable[[str, int, int], None] | None) -> None:
        self._feeds.on_epoch_change = fn

    # -- routing --------------------------------------------------------------------------

    def route(self, keys: Sequence[bytes], candidates: Sequence[str] | None = None, *, dispatch: bool = True,
              top_k: int | None = None, now: float | None = None) -> Decision:
        """Rank workers for a request of these block keys (in order). With ``dispatch`` (the
        default here; the gRPC ``Route``'s ``dispatch`` defaults to false) the best one is
        charged the request's prefill and gets speculative entries for its keys; pass the
        returned ``decision_id`` to :meth:`finish` when the request ends. ``candidates``: rank
        only these workers; a name the router does not know raises :class:`UnknownCandidates`
        (nothing is ranked, dispatched or remembered)."""
        now = time.monotonic() if now is None else now
        if not isinstance(keys, list):
            keys = list(keys)
        n = len(keys)
        cfg = self.config
        k = max(1, cfg.top_k if top_k is None else top_k)
        with self._lock:
            idx, loads, w = self.index, self._loads, self._w
            idx.expire(now)
            loads.expire(now)
            if w.plan is None or w.plan is not idx._plan:
                w = self._workers()
            if not w.names:
                raise RouterError("no workers to route to: no daemon has been heard from yet (wait for the "
                                  "feeds: Router.start(wait_s=...) or wait_synced(); see status())")
            sel, every = self._selected(candidates, w) if candidates else (None, False)
            fused = None
            if (sel is None or every) and cfg.new_session_spread <= 0:  # the common case: one compiled call
                fused = idx.decide(keys, w.decide, loads.qac, k, cfg.pulls, dispatch, every)
            if fused is not None:  # _dispatch's steps, less what the call did (speculated, fetch known)
                rows, m, order, saved_best, fetch, speculated, arrays = fused
                decision = Decision(n, w.names, w.nodes, order, arrays)
                best = order[0]
                if fetch:  # it counted remote blocks: say where
                    lead = decision._lead()
                    decision.fetch = [FetchHint(w.names[best], src, tuple(keys[i:j]), i, j)
                                      for src, i, j in idx.sources(_rows(Rows, (rows, m)), best, int(lead[2, best]),
                                                                   int(lead[3, best]))]
                if dispatch:
                    decision.decision_id = loads.dispatch(w.names[best], n - saved_best, now)
                    if n and not speculated:
                        idx.speculate(w.names[best], keys, _rows(Rows, (rows, m)))
                return decision
            found = idx.rows(keys)
            lead = idx.holdings(found, sel, self.config.pulls)
            if sel is None:
                q, a, lc, wts, dig, names, nodes = loads.queued, loads.active, loads.cost, w.weights, w.digests, \
                    w.names, w.nodes
            else:
                q, a, lc, wts, dig = loads.queued[sel], loads.active[sel], loads.cost[sel], w.weights[:, sel], \
                    w.digests[sel]
                picked = sel.tolist()
                names = [w.names[i] for i in picked]
                nodes = [w.nodes[i] for i in picked]
            new_session = self._new_session(n, lead)
            if new_session:
                cost, saved = self.scorer.costs(n, lead, lc, wts)
                extra = self._session_spread(names, now)  # live sessions beyond the fewest
                cost += np.minimum(self.config.new_session_spread * n * extra, saved) + 1e-3 * extra
                order = self.scorer.order(cost, q, a, dig, keys[-1] if n else b"", k).tolist()
            else:  # costs and order in one call (compiled where built)
                cost, saved, order = self.scorer.rank(n, lead, lc, wts, q, a, dig, keys[-1] if n else b"", k)
            decision = Decision(n, names, nodes, order, (cost, saved, lead, q.copy(), a.copy()))
            return self._dispatch(decision, keys, found, lead, wts, saved.item(order[0]), sel, dispatch, new_session,
                                  now)

    def dispatch(self, ranked: Decision, worker: str, keys: Sequence[bytes], now: float | None = None) -> Decision:
        """Dispatch a request to ``worker`` on a ranking :meth:`route` made of it without
        dispatching (``ranked``; ``worker`` one of its workers, the first or another one):
        what ``route(keys, [worker], dispatch=True, top_k=1)`` would do next, without ranking
        again: the worker is charged the request's prefill less what its cache saves it (as
        ranked), gets the speculative entries and, where it counted remote blocks, the fetch
        hints (from where they are now); a new session counts on it as that call would count
        it. Returns the decision for that worker alone (its ``decision_id`` for
        :meth:`finish`). Raises :class:`UnknownCandidates` for a worker the router does not
        know (any more), :class:`RouterError` for one the ranking does not hold."""
        now = time.monotonic() if now is None else now
        if not isinstance(keys, list):
            keys = list(keys)
        n = len(keys)
        if n != ranked.n_blocks:
            raise RouterError(f"dispatch: {n} keys for a ranking of {ranked.n_blocks}")
        try:
            i = ranked._names.index(worker)
        except ValueError:
            raise RouterError(f"dispatch: worker {worker!r} is not in the ranking") from None
        with self._lock:
            idx, w = self.index, self._w
            idx.expire(now)
            self._loads.expire(now)
            if w.plan is None or w.plan is not idx._plan:
                w = self._workers()
            x = idx.worker(worker)
            if x is None:
                raise UnknownCandidates([worker], w.names)
            lead = ranked._lead()[:, i:i + 1]
            decision = Decision(n, ranked._names, ranked._nodes, [i], ranked._arrays)
            sel = np.array([x.index], dtype=np.int64)
            new_session = self._new_session(n, lead)
            if new_session:  # the live sessions decayed to now before this one counts (as ranking it would)
                self._session_spread([worker], now)
            return self._dispatch(decision, keys, idx.rows(keys), lead, w.weights[:, sel], ranked._saved(i), sel,
                                  True, new_session, now, best=0)

    def _dispatch(self, decision: Decision, keys: list[bytes], found: Rows, lead: np.ndarray, wts: np.ndarray,
                  saved_best: float, sel: np.ndarray | None, dispatch: bool, new_session: bool, now: float,
                  best: int | None = None) -> Decision:
        """A decision's fetch hints and (``dispatch``) its load, session and speculative
        entries on the best worker (``saved_best``: the blocks its cache saves). ``best``: its
        column in ``lead``, ``wts`` and ``sel`` (default: its place in the names, the first of
        the order). Under the lock."""
        idx, n = self.index, decision.n_blocks
        name = decision._names[decision._order[0]]
        best = decision._order[0] if best is None else best
        if wts.item(3, best) > 0 and lead.item(3, best) > lead.item(2, best):  # it counted remote blocks: say where
            plan_i = best if sel is None else int(sel[best])
            decision.fetch = [FetchHint(name, src, tuple(keys[i:j]), i, j)
                              for src, i, j in idx.sources(found, plan_i, int(lead[2, best]), int(lead[3, best]))]
        if dispatch:  # charge the best worker its prefill; its GPU holds the keys from now on
            decision.decision_id = self._loads.dispatch(name, n - saved_best, now)
            if new_session:
                self._sessions[name] = self._sessions.get(name, 0.0) + 1.0
            if n:
                idx.speculate(name, keys, found)
        return decision

    def _new_session(self, n: int, lead: np.ndarray) -> bool:
        """Whether this request starts a session, for the spread term: no worker holds (in any of
        its tiers, a peer's or the store: ``d_remote``; speculative entries included) more than
        ``new_session_share`` of its blocks. A later turn finds its previous turn on the worker
        that served it; a new session finds at most a prefix it shares with others (a system
        prompt), which a peer or another worker's host tier can serve anyway."""
        cfg = self.config
        if cfg.new_session_spread <= 0 or not n or not lead.shape[1]:
            return False
        return float(lead[3].max()) < cfg.new_session_share * n

    def _session_spread(self, names: list[str], now: float) -> np.ndarray:
        """Per worker, the live sessions it holds beyond the fewest any ranked worker holds.
        Live sessions: the new sessions placed on it, halving every ``session_halflife_s``.
        A new session costs ``new_session_spread * n`` blocks per such session, capped at the
        blocks the worker would save (what a session costs its worker is all its later turns,
        which stick to their cache; a short shared prefix is saved once: the term can cancel
        that prefix's pull, never push a session off a worker that holds none of it, which is
        the load's job), plus 0.001 block per session, so that among otherwise equal workers
        the one with fewer live sessions wins."""
        cfg, live = self.config, self._sessions
        dt = now - self._sessions_at
        if dt > 0 and live:
            f = 0.5 ** (dt / cfg.session_halflife_s) if cfg.session_halflife_s > 0 else 0.0
            for w in live:
                live[w] *= f
        self._sessions_at = max(self._sessions_at, now)
        held = np.fromiter((live.get(w, 0.0) for w in names), dtype=np.float64, count=len(names))
        return held - held.min()

    def _selected(self, candidates: Sequence[str], w: _Workers) -> tuple[np.ndarray, bool]:
        """:meth:`_select` (the last answer again for the same candidates and plan: a gateway
        names the same ones each time), and whether they name every worker: then they rank as
        all workers do, with the selection's sums (distinct tie hashes: the order does not
        depend on the candidates' order)."""
        names = candidates if isinstance(candidates, list) else list(candidates)
        last = self._last_sel
        if last[0] is w.plan and last[1] == names:
            return last[2], last[3]
        sel = self._select(names)
        sel.flags.writeable = False
        every = len(sel) == len(w.names) and w.distinct
        self._last_sel = (w.plan, list(names), sel, every)
        return sel, every

    def _select(self, candidates: Sequence[str]) -> np.ndarray:
        """Plan indices of the candidates (each once); raises :class:`UnknownCandidates`."""
        idx = self.index
        known = [idx.worker(c) for c in dict.fromkeys(candidates)]
        unknown = [c for c, x in zip(dict.fromkeys(candidates), known, strict=True) if x is None]
        if unknown:
            raise UnknownCandidates(unknown, self._w.names)
        return np.fromiter((x.index for x in known), dtype=np.int64)  # type: ignore[union-attr]

    def _workers(self) -> _Workers:
        """The per-worker arrays of the index's current plan."""
        plan = self.index.plan()
        w = self._w
        if w.plan is plan:
            return w
        nodes = self.index.nodes
        names = [x.name for x in plan.workers]
        bandwidths = [nodes[x.node_id].load_gbps if x.node_id in nodes else {} for x in plan.workers]
        digests, weights = worker_digests(names), self.scorer.weights(bandwidths)
        self._w = w = _Workers(plan, names, [x.node_id for x in plan.workers], digests, weights,
                               plan.decide_workers(weights, digests), len(np.unique(digests)) == len(digests))
        self._loads.align(names)
        return w

    def add_worker(self, name: str) -> None:
        """A worker no daemon publishes (yet), e.g. a gateway's static replica: it holds nothing
        but can be named as a candidate and picked."""
        with self._lock:
            self.index.add_external_worker(name)

    def hint_fingerprints(self, hint: FetchHint) -> list[bytes]:
        """The layout fingerprints to apply a fetch hint under (:func:`~.fetch.hint_fingerprints`)."""
        with self._lock:
            return hint_fingerprints(self.index, hint)

    def finish(self, decision_id: int, prefill_only: bool = False) -> bool:
        """The dispatched request's prefill is done (``prefill_only``) or it ended."""
        with self._lock:
            return self._loads.finish(decision_id, prefill_only)

    def set_load(self, worker: str, queued_blocks: float, active_requests: float, now: float | None = None) -> None:
        """An engine's own report of its load; the router counts at least this much, for
        ``load_report_ttl_s`` unless reported again."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._loads.report(worker, queued_blocks, active_requests, now)

    def load(self, worker: str) -> Load:
        with self._lock:
            return self._loads.load(worker)

    # -- feeds ----------------------------------------------------------------------------

    def apply(self, target: str, reply: locations_pb2.WatchLocationsReply) -> None:
        """Fold one message of ``target``'s feed into the index (also usable offline)."""
        with self._lock:
            self._feeds.apply(target, reply)

    def start(self, wait_s: float | None = None) -> Router:
        """Load the saved state (if any) and start every feed in a background thread. With
        ``wait_s``, then wait up to that many seconds until every feed has caught up with its
        daemon (:meth:`wait_synced`); if one has not, close the router and raise
        :class:`RouterError` naming each such feed and why (its last error)."""
        path = self.config.state_path
        if path and os.path.exists(path):
            try:
                self.load_state(path)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
                log.warning("saved router state unreadable; starting from snapshots",
                            extra={"path": path, "error": str(e)})
                with self._lock:
                    self.index.clear()
                    self._feeds.targets.clear()
        self._feeds.start(*([self._save_loop] if path else []))
        if self.vllm.sources:
            self.vllm.start()
        self._started = True
        if wait_s is not None and not self.wait_synced(wait_s):
            behind = [st for st in self.status() if not st.synced]
            why = "; ".join(f"{st.target}: " + (st.last_error or ("connected, still catching up" if st.connected
                                                                  else "not connected yet")) for st in behind)
            self.close()
            raise RouterError(f"the router's feeds did not catch up within {wait_s:g} s: "
                              f"{why or 'no feed started yet (DNS names not resolved?)'}")
        return self

    async def _save_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.save_interval_s)
            try:
                await loop.run_in_executor(None, self.save_state)
            except OSError as e:
                log.warning("saving the router state failed", extra={"path": self.config.state_path,
                                                                     "error": str(e)})

    def close(self) -> None:
        """Stop the feeds and save the state (with ``state_path``)."""
        self._started = False
        self.vllm.stop()
        if self._feeds.stop() and self.config.state_path:
            self.save_state()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_vllm_events(self, source: VllmSource | str) -> VllmSource:
        """Subscribe to another vLLM engine's KV events (an entry as ``--vllm-events`` takes it,
        e.g. ``"tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558"``); started at once if the
        router is running."""
        src = self.vllm.add(source)
        if self._started and not self.vllm.running:
            self.vllm.start()
        return src

    # -- waiting and inspection -----------------------------------------------------------

    def status(self) -> list[FeedStatus]:
        with self._lock:
            return [FeedStatus(**vars(st)) for st in self._feeds.status.values()]

    def vllm_status(self) -> list[VllmStreamStatus]:
        """Where each vLLM publisher's stream stands."""
        return self.vllm.status()

    def holdings(self, node_id: str | None = None) -> dict[tuple[str, str, str, bytes], set[bytes]]:
        """The index's locations, {(node, tier, worker, fingerprint): keys} (slow; tools, tests)."""
        with self._lock:
            return self.index.locations(node_id)

    def indexed_keys(self) -> int:
        """Keys in the index (the pairs layout: (key, location) pairs)."""
        with self._lock:
            return len(self.index)

    def index_bytes(self) -> int:
        """Bytes of the index's own arrays (what sizes a replica: docs/operations.md)."""
        with self._lock:
            return self.index.nbytes()

    def workers(self) -> list[tuple[str, str]]:
        """(worker, node) of every worker routed to ("" node: named by a caller only)."""
        with self._lock:
            return [(w.name, w.node_id) for w in self.index.plan().workers]

    def positions(self) -> dict[str, tuple[int, int]]:
        """node id -> (epoch, seq) applied."""
        with self._lock:
            return self.index.positions()

    def wait_synced(self, timeout: float = 10.0, nodes: int | None = None) -> bool:
        """Wait until every feed (at least ``nodes`` of them) applied its daemon's newest event
        known at its last message; False on timeout."""
        return self._feeds.wait_synced(timeout, nodes)

    # -- saved state ----------------------------------------------------------------------

    def save_state(self, path: str | None = None) -> None:
        """Write the index, every node's position and which target served which node
        atomically (tmp file, then rename)."""
        path = path or self.config.state_path
        if not path:
            raise ValueError("no state_path to save to")
        arrays = self.state_arrays()
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with self._save_lock:
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The index, every node's position and which target served which node, as arrays
        (what :meth:`save_state` writes; an index snapshot holds the same)."""
        with self._lock:
            arrays = self.index.state()
            targets = dict(self._feeds.targets)
        arrays["router_meta"] = np.frombuffer(json.dumps({"targets": targets}).encode(), dtype=np.uint8)
        return arrays

    def load_state(self, path: str) -> None:
        with np.load(path) as z:
            self.load_arrays({k: z[k] for k in z.files}, path)

    def load_arrays(self, arrays: dict[str, np.ndarray], path: str = "") -> None:
        """Replace the index and the feeds' targets with :meth:`state_arrays` (before :meth:`start`)."""
        meta = json.loads(bytes(arrays.pop("router_meta")).decode()) if "router_meta" in arrays else {}
        with self._lock:
            self.index.load_state(arrays)
            self._feeds.targets.clear()
            self._feeds.targets.update(meta.get("targets", {}))
        log.info("router state loaded", extra={"path": path, "keys": len(self.index),
                                               "positions": self.positions()})

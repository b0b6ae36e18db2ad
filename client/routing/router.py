"""The cache-aware router: subscribes to many daemons' location feeds and ranks workers.

Owns
    * a :class:`~kvtier.client.routing.index.LocationIndex` (the fold of every feed) and a
      :class:`~kvtier.client.routing.scoring.Scorer` (DESIGN.md's cost, tier weights from the
      bandwidths each node publishes);
    * one feed per daemon: the static targets of :class:`RouterConfig` (``unix:/path`` or
      ``host:port``) and the addresses DNS names resolve to (re-resolved every
      ``resolve_interval_s``; an address that disappears takes its node out of the index).
      Each feed runs ``WatchLocations`` from the node's position ``(epoch, seq)`` and
      reconnects with backoff; the daemon answers with the events after that position or a
      snapshot, so the index never has a gap or a duplicate. A new epoch (the daemon
      restarted) is noticed, counted and logged; its snapshot replaces the node's state;
    * the loads it dispatched: per worker, queued prefill blocks and active requests from
      :meth:`Router.route` (``dispatch=True``) until :meth:`Router.finish` (or until
      ``load_ttl_s`` if never finished); an engine's own report (:meth:`Router.set_load`)
      is a floor under them;
    * speculative entries: a dispatched request's keys are marked as on the chosen worker's
      GPU at once, so the session's next turn sticks there before the engine's events
      arrive (they expire after ``speculative_ttl_s`` to ``2 * speculative_ttl_s``);
    * the saved position: with ``state_path`` the index and every node's position are
      written atomically every ``save_interval_s`` and on :meth:`close`; a router started
      again loads them and resumes each feed where the file says; nodes of the file that no
      feed of the new run serves (a static target dropped, an address gone from DNS) are
      forgotten once the static feeds are started and every DNS name has resolved once.

Threading: feeds run on a private asyncio loop in a background thread; one lock serialises
the feeds' folding and :meth:`route`, so ``route`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import zipfile
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvtier.client.routing.index import LocationIndex
from kvtier.client.routing.scoring import Load, Overlap, Ranked, Scorer, ScorerConfig, worker_digests
from kvtier.proto import TIER_NAMES, locations_pb2, locations_pb2_grpc

log = logging.getLogger("kvtier.router")

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.keepalive_time_ms", 10000),
                    ("grpc.keepalive_timeout_ms", 5000)]


@dataclass(frozen=True)
class RouterConfig:
    """Every router setting, one name each (also the ``kvtier route-server`` flags)."""

    daemons: tuple[str, ...] = ()        # static feeds: "unix:/run/kvtier.sock", "10.0.0.5:7070"
    dns: tuple[str, ...] = ()            # "kvtierd.svc:7070": a feed per address it resolves to
    resolve_interval_s: float = 10.0     # how often DNS names are resolved again
    speculative_ttl_s: float = 10.0      # unconfirmed speculative entries live this to twice this
    load_ttl_s: float = 600.0            # a dispatched request never finished stops counting after this
    state_path: str = ""                 # saved index and positions ("" : none; start from snapshots)
    save_interval_s: float = 30.0        # how often the state is saved (and on close)
    reconnect_min_s: float = 0.1         # first retry delay of a dropped feed (doubles up to max)
    reconnect_max_s: float = 5.0
    top_k: int = 8                       # ranked workers returned by default
    name: str = "kvtier-router"          # subscriber name in the daemons' logs
    scorer: ScorerConfig = field(default_factory=ScorerConfig)


class Decision:
    """The outcome of :meth:`Router.route`: workers best first (``ranked`` is built on first use)."""

    __slots__ = ("n_blocks", "decision_id", "_names", "_nodes", "_order", "_arrays", "_ranked")

    def __init__(self, n_blocks: int, names: list[str], nodes: list[str], order: list[int],
                 arrays: tuple[np.ndarray, ...]) -> None:
        self.n_blocks = n_blocks
        self.decision_id = 0  # set when dispatched
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

    @property
    def ranked(self) -> list[Ranked]:
        if self._ranked is None:
            cost, saved, (dg, dh, dd), q, a = self._arrays
            self._ranked = [Ranked(self._names[i], float(cost[i]), Overlap(int(dg[i]), int(dh[i]), int(dd[i])),
                                   Load(float(q[i]), float(a[i])), float(saved[i])) for i in self._order]
        return self._ranked

    def __repr__(self) -> str:
        return f"Decision(n_blocks={self.n_blocks}, decision_id={self.decision_id}, ranked={self.ranked!r})"


@dataclass(slots=True)
class _Dispatched:
    worker: str
    queued: float
    at: float
    prefilled: bool = False


@dataclass
class FeedStatus:
    """Where one feed stands (for tools and tests)."""

    target: str
    node_id: str = ""
    connected: bool = False
    epoch: int = 0
    seq: int = 0
    head_seq: int = 0
    snapshots: int = 0
    resumes: int = 0
    epoch_changes: int = 0
    last_error: str = ""

    @property
    def synced(self) -> bool:
        return self.connected and self.epoch != 0 and self.seq >= self.head_seq


class RouterError(Exception):
    """A request the router cannot rank (no workers, malformed keys)."""


class Router:
    """See the module docstring."""

    def __init__(self, config: RouterConfig | None = None,
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None) -> None:
        """``resolve(host, port)`` -> addresses, for the DNS feeds (default: the system resolver)."""
        self.config = config or RouterConfig()
        self._resolve = resolve or _system_resolve
        self.scorer = Scorer(self.config.scorer)
        self._qw, self._aw = self.config.scorer.queued_weight, self.config.scorer.active_weight
        self.index = LocationIndex(self.config.scorer, self.config.speculative_ttl_s)
        self._lock = threading.RLock()
        self._decision_ids = itertools.count(1)
        self._dispatched: dict[int, _Dispatched] = {}
        self._dispatch_order: deque[tuple[float, int]] = deque()
        self._queued: dict[str, float] = {}
        self._active: dict[str, float] = {}
        self._reported: dict[str, tuple[float, float]] = {}
        self._load_plan: Any = None
        self._q = np.zeros(0)
        self._a = np.zeros(0)
        self._wh = np.zeros(0)
        self._wd = np.zeros(0)
        self._names: list[str] = []
        self._nodes: list[str] = []
        self._digests = np.zeros(0, dtype=np.uint64)
        self._weights = np.zeros((3, 0))
        self._load_cost = np.zeros(0)
        self._pos: dict[str, int] = {}
        self.feeds: dict[str, FeedStatus] = {}
        self._feed_tasks: dict[str, asyncio.Task] = {}
        self._node_owner: dict[str, str] = {}      # node id -> target of the feed that serves it
        self._target_node: dict[str, str] = {}     # target -> node id it served last
        self._node_epoch: dict[str, int] = {}      # node id -> epoch of its last NodeInfo
        self._unresolved: set[str] = set()         # DNS names not yet resolved in this run
        # node id -> (epoch, head_seq, workers) of its last NodeInfo: a gpu event at or before
        # that seq of a worker it does not list is history (the worker is gone since)
        self._info_workers: dict[str, tuple[int, int, frozenset[str]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._synced = threading.Condition(self._lock)
        self.on_epoch_change: Callable[[str, int, int], None] | None = None

    # -- routing --------------------------------------------------------------------------

    def route(self, keys: Sequence[bytes], candidates: Sequence[str] | None = None, *, dispatch: bool = True,
              top_k: int | None = None, now: float | None = None) -> Decision:
        """Rank workers for a request of these block keys (in order). With ``dispatch`` the
        best one is charged the request's prefill and gets speculative entries for its keys;
        pass the returned ``decision_id`` to :meth:`finish` when the request ends."""
        now = time.monotonic() if now is None else now
        if not isinstance(keys, list):
            keys = list(keys)
        n = len(keys)
        k = max(1, self.config.top_k if top_k is None else top_k)
        with self._lock:
            idx = self.index
            idx.expire(now)
            if self._dispatch_order:
                self._expire_loads(now)
            if candidates:
                for c in candidates:
                    if idx.worker(c) is None:
                        idx.add_external_worker(c)
            self._refresh_loads()
            if not self._names:
                raise RouterError("no workers to route to: no daemon has been heard from and no candidates "
                                  "were given")
            sel = None
            if candidates:
                sel = np.fromiter((idx.worker(c).index for c in dict.fromkeys(candidates)),  # type: ignore[union-attr]
                                  dtype=np.int64)
            rows, m = idx.rows(keys)  # m: the leading keys that are indexed
            lead = idx.overlaps_rows(rows, m, sel)
            if sel is None:
                q, a, lc, wts, dig, names, nodes = (self._q, self._a, self._load_cost, self._weights,
                                                    self._digests, self._names, self._nodes)
            else:
                q, a, lc, wts, dig = self._q[sel], self._a[sel], self._load_cost[sel], self._weights[:, sel], \
                    self._digests[sel]
                names = [self._names[i] for i in sel.tolist()]
                nodes = [self._nodes[i] for i in sel.tolist()]
            cost, saved = self.scorer.costs(n, lead, lc, wts)
            order = self.scorer.order(cost, q, a, dig, keys[-1] if n else b"", k).tolist()
            decision = Decision(n, names, nodes, order, (cost, saved, lead, q.copy(), a.copy()))
            if dispatch:
                best = order[0]
                decision.decision_id = self._dispatch(names[best], n - float(saved[best]), now)
                if n:
                    idx.speculate_rows(names[best], keys, rows, m)
            return decision

    def finish(self, decision_id: int, prefill_only: bool = False) -> bool:
        """The dispatched request's prefill is done (``prefill_only``) or it ended."""
        with self._lock:
            d = self._dispatched.get(decision_id)
            if d is None:
                return False
            if prefill_only:
                if not d.prefilled:
                    self._add_load(d.worker, -d.queued, 0.0)
                    d.prefilled = True
            else:
                self._add_load(d.worker, 0.0 if d.prefilled else -d.queued, -1.0)
                del self._dispatched[decision_id]
            return True

    def set_load(self, worker: str, queued_blocks: float, active_requests: float) -> None:
        """An engine's own report of its load; the router counts at least this much."""
        with self._lock:
            self._reported[worker] = (queued_blocks, active_requests)
            self._add_load(worker, 0.0, 0.0)

    def load(self, worker: str) -> Load:
        with self._lock:
            rq, ra = self._reported.get(worker, (0.0, 0.0))
            return Load(max(rq, self._queued.get(worker, 0.0)), max(ra, self._active.get(worker, 0.0)))

    def _dispatch(self, worker: str, queued: float, now: float) -> int:
        did = next(self._decision_ids)
        self._dispatched[did] = _Dispatched(worker, queued, now)
        self._dispatch_order.append((now, did))
        self._add_load(worker, queued, 1.0)
        return did

    def _add_load(self, worker: str, queued: float, active: float) -> None:
        q = self._queued.get(worker, 0.0) + queued
        a = self._active.get(worker, 0.0) + active
        if q < 0.0:
            q = 0.0
        if a < 0.0:
            a = 0.0
        self._queued[worker] = q
        self._active[worker] = a
        i = self._pos.get(worker)
        if i is not None:
            rep = self._reported.get(worker)
            if rep is not None:
                q, a = max(q, rep[0]), max(a, rep[1])
            self._q[i] = q
            self._a[i] = a
            self._load_cost[i] = self._qw * q + self._aw * a

    def _expire_loads(self, now: float) -> None:
        """Finish what was dispatched more than ``load_ttl_s`` ago; drop finished entries
        from the front of the queue (so it holds about the requests still running)."""
        order = self._dispatch_order
        live = self._dispatched
        limit = now - self.config.load_ttl_s
        while order:
            at, did = order[0]
            if did in live:
                if at >= limit:
                    break
                self.finish(did)
            order.popleft()

    def _refresh_loads(self) -> None:
        """Per-worker arrays of the current plan (rebuilt only when the workers change)."""
        plan = self.index.plan()
        if self._load_plan is plan:
            return
        names = [w.name for w in plan.workers]
        rep = self._reported
        self._q = np.array([max(self._queued.get(n, 0.0), rep.get(n, (0.0, 0.0))[0]) for n in names], dtype=np.float64)
        self._a = np.array([max(self._active.get(n, 0.0), rep.get(n, (0.0, 0.0))[1]) for n in names], dtype=np.float64)
        self._wh = np.array([w.w_host for w in plan.workers], dtype=np.float64)
        self._wd = np.array([w.w_disk for w in plan.workers], dtype=np.float64)
        self._weights = Scorer.lead_weights(self._wh, self._wd)
        self._load_cost = self.scorer.load_cost(self._q, self._a)
        self._pos = {name: i for i, name in enumerate(names)}
        self._digests = worker_digests(names)
        self._nodes = [w.node_id for w in plan.workers]
        self._names = names
        self._load_plan = plan

    # -- folding a feed -------------------------------------------------------------------

    def apply(self, target: str, reply: locations_pb2.WatchLocationsReply) -> None:
        """Fold one message of ``target``'s feed into the index (also usable offline)."""
        with self._lock:
            self._apply(target, reply)

    def _apply(self, target: str, reply: locations_pb2.WatchLocationsReply) -> None:
        st = self.feeds.setdefault(target, FeedStatus(target))
        body = reply.WhichOneof("body")
        idx = self.index
        if body == "node":
            info = reply.node
            old = self._target_node.get(target)
            if old and old != info.node_id:
                log.warning("feed now serves another node; forgetting the old one",
                            extra={"target": target, "old_node": old, "node": info.node_id})
                idx.drop_node(old)
                self._node_owner.pop(old, None)
            owner = self._node_owner.get(info.node_id)
            if owner is not None and owner != target and self.feeds.get(owner, FeedStatus(owner)).connected:
                raise _DuplicateNode(f"node {info.node_id!r} is already served by feed {owner}")
            self._node_owner[info.node_id] = target
            self._target_node[target] = info.node_id
            st.node_id = info.node_id
            st.head_seq = info.head_seq
            view = idx.node(info.node_id)
            known = self._node_epoch.get(info.node_id) or view.epoch
            if known and known != info.epoch:
                st.epoch_changes += 1
                log.info("daemon restarted (new epoch)", extra={"node": info.node_id, "old_epoch": known,
                                                                "epoch": info.epoch})
                if self.on_epoch_change:
                    self.on_epoch_change(info.node_id, known, info.epoch)
            self._node_epoch[info.node_id] = info.epoch
            self._info_workers[info.node_id] = (info.epoch, info.head_seq,
                                                frozenset(w.worker_id for w in info.workers))
            if view.epoch and view.epoch == info.epoch:  # resuming: the position stands
                st.epoch, st.seq = view.epoch, view.seq
            idx.set_node_info(info.node_id, {w.worker_id: list(w.fingerprints) for w in info.workers},
                              {TIER_NAMES[t.tier]: t.load_gbps for t in info.tiers if t.tier in TIER_NAMES},
                              {TIER_NAMES[t.tier]: t.capacity_bytes for t in info.tiers if t.tier in TIER_NAMES})
            return
        node = st.node_id
        if not node:
            raise _FeedError("feed sent locations before its NodeInfo")
        view = idx.node(node)
        if body == "snapshot":
            part = reply.snapshot
            if part.first:
                idx.reset_node(node)
                view.epoch = 0  # not a valid position until the last part
                st.snapshots += 1
            for ev in part.entries:
                self._fold(node, ev, reply.epoch)
            if part.last:
                view.epoch, view.seq = reply.epoch, part.at_seq
                st.epoch, st.seq = view.epoch, view.seq
                st.head_seq = max(st.head_seq, part.at_seq)
        elif body == "events":
            batch = reply.events
            if view.epoch != reply.epoch:
                raise _FeedError(f"events of epoch {reply.epoch} while at epoch {view.epoch}")
            for ev in batch.events:
                if ev.seq != view.seq + 1:
                    raise _FeedError(f"event seq {ev.seq} after {view.seq}: a gap or a duplicate")
                self._fold(node, ev, reply.epoch)
                view.seq = ev.seq
            st.epoch, st.seq = view.epoch, view.seq
            st.head_seq = max(batch.head_seq, view.seq)
        if st.synced:
            self._synced.notify_all()

    def _fold(self, node: str, ev: locations_pb2.LocationEvent, epoch: int) -> None:
        tier = TIER_NAMES.get(ev.tier)
        if tier is None:
            return
        idx = self.index
        if ev.kind == locations_pb2.STORED:
            declare = True
            if tier == "gpu":  # a resume replays events older than the NodeInfo that opened it
                info = self._info_workers.get(node)
                declare = info is None or info[0] != epoch or ev.seq > info[1] or ev.worker_id in info[2]
            idx.stored(node, tier, ev.worker_id, ev.fingerprint, ev.keys, declare=declare)
        elif ev.kind == locations_pb2.REMOVED:
            idx.removed(node, tier, ev.worker_id, ev.fingerprint, ev.keys)
        elif ev.kind == locations_pb2.CLEARED:
            idx.cleared(node, tier, ev.worker_id)

    # -- feeds ----------------------------------------------------------------------------

    def start(self) -> Router:
        """Load the saved state (if any) and start every feed in a background thread."""
        if self.config.state_path and os.path.exists(self.config.state_path):
            try:
                self.load_state(self.config.state_path)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
                log.warning("saved router state unreadable; starting from snapshots",
                            extra={"path": self.config.state_path, "error": str(e)})
                with self._lock:
                    self.index = LocationIndex(self.config.scorer, self.config.speculative_ttl_s)
                    self._target_node.clear()
                    self._load_plan = None
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._stopping = asyncio.Event()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_until_complete(self._run())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="kvtier-router-feeds", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    async def _run(self) -> None:
        for target in self.config.daemons:
            self._start_feed(target)
        self._unresolved = set(self.config.dns)
        if not self._unresolved:
            self._forget_unserved()
        tasks = [asyncio.ensure_future(self._resolve_loop(name)) for name in self.config.dns]
        if self.config.state_path:
            tasks.append(asyncio.ensure_future(self._save_loop()))
        await self._stopping.wait()
        for t in [*tasks, *self._feed_tasks.values()]:
            t.cancel()
        await asyncio.gather(*tasks, *self._feed_tasks.values(), return_exceptions=True)

    def _start_feed(self, target: str) -> None:
        if target not in self._feed_tasks:
            with self._lock:
                self.feeds.setdefault(target, FeedStatus(target))
            self._feed_tasks[target] = asyncio.ensure_future(self._feed(target))

    async def _stop_feed(self, target: str) -> None:
        task = self._feed_tasks.pop(target, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        with self._lock:
            st = self.feeds.pop(target, None)
            node = self._target_node.pop(target, None)
            if node and self._node_owner.get(node) == target:
                del self._node_owner[node]
                self.index.drop_node(node)
                log.info("node left (its address is gone)", extra={"target": target, "node": node})
            del st

    async def _feed(self, target: str) -> None:
        delay = self.config.reconnect_min_s
        while True:
            try:
                async with grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS) as channel:
                    stub = locations_pb2_grpc.LocationsStub(channel)
                    with self._lock:
                        node = self._target_node.get(target, "")
                        view = self.index.nodes.get(node) if node else None
                        epoch, seq = (view.epoch, view.seq) if view and view.epoch else (0, 0)
                    call = stub.WatchLocations(locations_pb2.WatchLocationsRequest(
                        epoch=epoch, from_seq=seq, subscriber=self.config.name), wait_for_ready=False)
                    n = 0
                    async for reply in call:
                        with self._lock:
                            st = self.feeds[target]
                            if n == 0:
                                st.connected = True
                            elif n == 1 and epoch and reply.WhichOneof("body") == "events":
                                st.resumes += 1
                            self._apply(target, reply)
                        n += 1
                        delay = self.config.reconnect_min_s
                    raise _StreamEnded("the daemon ended the stream (stopping?)")
            except asyncio.CancelledError:
                raise
            except (grpc.RpcError, _FeedError, _StreamEnded, _DuplicateNode) as e:
                msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                with self._lock:
                    st = self.feeds.get(target)
                    if st is not None:
                        if st.connected or st.last_error != msg:
                            log.info("feed dropped; reconnecting", extra={"target": target, "error": msg,
                                                                          "retry_s": delay})
                        st.connected, st.last_error = False, msg
                    if isinstance(e, _FeedError):
                        self._invalidate(target)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.reconnect_max_s)

    def _forget_unserved(self) -> None:
        """Forget the nodes of a loaded state that no feed of this run serves: their daemon
        left the static list, or its address left DNS while the router was down. (Nodes a
        feed drops while running are forgotten by :meth:`_stop_feed`.)"""
        with self._lock:
            gone = [t for t in self._target_node if t not in self._feed_tasks]
            for target in gone:
                del self._target_node[target]
            served = set(self._target_node.values())
            for node in [n for n in self.index.nodes if n not in served]:
                log.info("saved node not served by any feed now; forgotten", extra={"node": node})
                self.index.drop_node(node)
                self._node_owner.pop(node, None)
                self._node_epoch.pop(node, None)

    def _invalidate(self, target: str) -> None:
        """A feed broke its contract: drop its position so the next connect takes a snapshot."""
        node = self._target_node.get(target)
        if node and node in self.index.nodes:
            self.index.nodes[node].epoch = 0

    async def _resolve_loop(self, name: str) -> None:
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            log.error("DNS feed name is not HOST:PORT; ignored", extra={"name": name})
            return
        mine: set[str] = set()
        while True:
            try:
                found = {f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in await self._resolve(host, int(port))}
            except OSError as e:
                log.warning("DNS resolution failed; keeping the feeds we have",
                            extra={"name": name, "error": str(e)})
                found = mine
            for target in sorted(found - mine):
                self._start_feed(target)
            for target in sorted(mine - found):
                await self._stop_feed(target)
            mine = found
            if name in self._unresolved and mine:
                self._unresolved.discard(name)
                if not self._unresolved:  # every name answered once: the feeds are all known
                    self._forget_unserved()
            await asyncio.sleep(self.config.resolve_interval_s)

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
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stopping.set)
            thread.join(10)
            self._loop = self._thread = None
            if self.config.state_path:
                self.save_state()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- waiting and inspection -----------------------------------------------------------

    def status(self) -> list[FeedStatus]:
        with self._lock:
            return [FeedStatus(**vars(st)) for st in self.feeds.values()]

    def holdings(self, node_id: str | None = None) -> dict[tuple[str, str, str, bytes], set[bytes]]:
        """The index's contents, {(node, tier, worker, fingerprint): keys} (slow; tools, tests)."""
        with self._lock:
            return self.index.holdings(node_id)

    def indexed_keys(self) -> int:
        with self._lock:
            return len(self.index)

    def workers(self) -> list[tuple[str, str]]:
        """(worker, node) of every worker routed to ("" node: named by a caller only)."""
        with self._lock:
            return [(w.name, w.node_id) for w in self.index.plan().workers]

    def positions(self) -> dict[str, tuple[int, int]]:
        """node id -> (epoch, seq) applied."""
        with self._lock:
            return {n: (v.epoch, v.seq) for n, v in self.index.nodes.items()}

    def wait_synced(self, timeout: float = 10.0, nodes: int | None = None) -> bool:
        """Wait until every feed (at least ``nodes`` of them) applied its daemon's newest event
        known at its last message; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._synced:
            while True:
                sts = list(self.feeds.values())
                if sts and all(st.synced for st in sts) and (nodes is None or len(sts) >= nodes):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._synced.wait(min(left, 0.05))

    # -- saved state ----------------------------------------------------------------------

    def save_state(self, path: str | None = None) -> None:
        """Write the index and every node's position atomically (tmp file, then rename)."""
        path = path or self.config.state_path
        if not path:
            raise ValueError("no state_path to save to")
        with self._lock:
            arrays = self.index.state()
            targets = dict(self._target_node)
        arrays["router_meta"] = np.frombuffer(json.dumps({"targets": targets}).encode(), dtype=np.uint8)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def load_state(self, path: str) -> None:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("router_meta")).decode()) if "router_meta" in arrays else {}
        with self._lock:
            self.index.load_state(arrays)
            self._target_node = dict(meta.get("targets", {}))
            self._load_plan = None
        log.info("router state loaded", extra={"path": path, "keys": len(self.index),
                                               "positions": self.positions()})


async def _system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({ai[4][0] for ai in infos})


class _FeedError(Exception):
    """A feed broke the protocol (gap, duplicate, or no NodeInfo first)."""


class _StreamEnded(Exception):
    """The daemon closed the stream cleanly; reconnect from the position held."""


class _DuplicateNode(Exception):
    """Two feeds claim the same node id."""

"""vLLM's scheduler side: :class:`KvtierOffloadingManager` answers lookups from the daemon's
shared-memory key table and tracks stores until they complete (the package docstring)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.client.engine.adapter import Breaker
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.engine.transport import KvtierError
from kvtier.client.vllm.config import KvtierSettings
from kvtier.client.vllm.keys import KeyMap, KvtierLoadSpec, KvtierStoreSpec, offload_group
from kvtier.client.vllm.metrics import M_LOOKUPS, Counts
from kvtier.tiers.layout import Layout

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: its handler, format and level


class _Daemon:
    """A Sidecar with the layouts of every TP rank registered, or None while bypassed.

    After a failed call kvtier is bypassed for ``retry_s`` (:class:`Breaker`); then the next
    call starts a reconnect in the background and answers without the daemon meanwhile."""

    def __init__(self, settings: KvtierSettings, layouts: list[Layout], client_name: str) -> None:
        self.settings = settings
        self.layouts = layouts
        self.client_name = client_name
        self.breaker = Breaker(settings.retry_s, log)
        self._lock = threading.Lock()
        self._sc: Sidecar | None = None
        self.lids: list[int] = []

    def connect(self) -> bool:
        """Connect now (blocking, bounded by the timeout); False when the daemon is not there."""
        s = self.settings
        sc = Sidecar(s.socket, client_name=self.client_name, timeout=s.timeout_s)
        try:
            lids = [sc.register_layout(lay) for lay in self.layouts]
        except KvtierError as e:
            sc.close()
            self.breaker.failed(e, f"connecting to the daemon at {sc.target}")
            return False
        with self._lock:
            if self.breaker.closed:
                sc.close()
                return False
            self._sc, self.lids = sc, lids
        self.breaker.ok(sc.target)
        return True

    def get(self) -> Sidecar | None:
        sc = self._sc
        if sc is not None:
            return sc
        if not self.breaker.bypassed():
            self.breaker.in_background(self.connect)
        return None

    def failed(self, sc: Sidecar, err: Exception) -> None:
        with self._lock:
            mine = self._sc is sc
            if mine:
                self._sc = None
        if mine:
            self.breaker.failed(err)
        try:
            sc.close()
        except Exception:  # noqa: BLE001 - closing a broken client
            pass

    def close(self) -> None:
        self.breaker.close()
        with self._lock:
            sc, self._sc = self._sc, None
        if sc is not None:
            sc.close()


@dataclass
class _ReqState:
    tiers: dict[bytes, str] = field(default_factory=dict)  # offload key -> tier found at lookup
    loaded: set[bytes] = field(default_factory=set)        # offload keys this request has loaded


def _req_state(req_context: ReqContext) -> _ReqState:
    state = req_context.get_state(_ReqState)
    if state is None:
        state = _ReqState()
        req_context.set_state(state)
    return state


class _Events:
    """Chunks this engine stored, re-read from the key table to report where they are."""

    def __init__(self, max_keys: int, scan: int) -> None:
        self.max_keys = max_keys
        self.scan = scan
        self.where: OrderedDict[bytes, frozenset[Medium]] = OrderedDict()
        self.out: list[OffloadingEvent] = []

    def follow(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.where.setdefault(k, frozenset())
            self.where.move_to_end(k)
        while len(self.where) > self.max_keys:
            self.where.popitem(last=False)

    def rescan(self, tiers_of: Any) -> None:
        """Re-read up to ``scan`` chunks (oldest first, then rotated to the back) and queue events."""
        n = min(self.scan, len(self.where))
        keys = [k for k, _ in zip(self.where, range(n), strict=False)]
        added: dict[Medium, list[bytes]] = {Medium.CPU: [], Medium.STORAGE: []}
        removed: dict[Medium, list[bytes]] = {Medium.CPU: [], Medium.STORAGE: []}
        for k, tier in zip(keys, tiers_of(keys), strict=True):
            before = self.where.pop(k)
            now = set()
            if tier == "host":
                now.add(Medium.CPU)
                if Medium.STORAGE in before:
                    now.add(Medium.STORAGE)  # promoted back from disk: the disk copy stays
            elif tier == "disk":
                now.add(Medium.STORAGE)
            for m in now - before:
                added[m].append(k)
            for m in before - now:
                removed[m].append(k)
            if now:
                self.where[k] = frozenset(now)
        for m in (Medium.CPU, Medium.STORAGE):
            if added[m]:
                self.out.append(OffloadingEvent(keys=[OffloadKey(k) for k in added[m]], medium=m, removed=False))
            if removed[m]:
                self.out.append(OffloadingEvent(keys=[OffloadKey(k) for k in removed[m]], medium=m, removed=True))


_MEDIA = {"host": Medium.CPU, "disk": Medium.STORAGE}  # kvtier's tiers as vLLM's media (kv_load_tiers)


class KvtierOffloadingManager(OffloadingManager):
    """Scheduler side: lookups from the key table, stores tracked until they complete."""

    def __init__(self, settings: KvtierSettings, keymap: KeyMap, layouts: list[list[Layout]], client_name: str,
                 events: bool, group_ids: Sequence[int] = (0,)) -> None:
        """``layouts[rank][g]``: the layout of tensor-parallel rank ``rank``'s pages of the
        ``g``-th offloaded KV-cache group, whose id (in offload keys) is ``group_ids[g]``."""
        self.settings = settings
        self.keymap = keymap
        self.groups = len(group_ids)
        if any(len(r) != self.groups for r in layouts):
            raise ValueError(f"kvtier: a layout per rank for each of {self.groups} KV-cache groups")
        self._group_pos = {gid: g for g, gid in enumerate(group_ids)}
        # vLLM 0.33's scheduler holds it around its calls into the manager (0.32 does not read it)
        self._lock = threading.Lock()
        self.daemon = _Daemon(settings, [lay for r in layouts for lay in r], client_name)
        self.daemon.connect()
        # offload keys whose store is prepared and not complete -> their place in the order
        # prepare_store offered them (a chain's blocks, parents first)
        self.pending: dict[bytes, int] = {}
        self._offered = itertools.count()
        self.counts = Counts()
        self.events = _Events(settings.events_max_keys, settings.events_scan) if events else None

    # lookups through the key table: shared memory, no RPC
    def _tiers(self, sc: Sidecar, keys: Sequence[bytes]) -> list[str | None]:
        """Per offload key (a chunk of one KV-cache group): ``host`` when every block of every
        rank is in host, ``disk`` when all are held and some only on disk, else None. One table
        read per rank and group for them all."""
        out: list[str | None] = ["host"] * len(keys)
        by_group: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            g = self._group_pos.get(offload_group(k))
            if g is None:  # a group this engine does not offload: never held
                out[i] = None
            else:
                by_group.setdefault(g, []).append(i)
        for g, idx in by_group.items():
            chunks = [self.keymap.chunk(keys[i]) for i in idx]
            flat = [k for c in chunks for k in c]
            for lid in self.daemon.lids[g::self.groups]:
                names = sc.lookup(lid, flat)
                n = self.keymap.blocks_per_chunk
                for j, i in enumerate(idx):
                    for t in names[j * n:(j + 1) * n]:
                        if out[i] is None:
                            break
                        if t == "disk":
                            out[i] = "disk"
                        elif t != "host":
                            out[i] = None
        return out

    def _used(self, sc: Sidecar, keys: Sequence[bytes]) -> None:
        """The engine computed these chunks, which kvtier holds (after a gap in the request's
        prefix: they were not part of the leading run it loaded): tell the daemon they were used
        (``prefetch``: the most recent in host, promoted from disk), so the chain they complete
        again is kept as a whole, as if the request had loaded them."""
        by_group: dict[int, list[bytes]] = {}
        for k in keys:
            g = self._group_pos.get(offload_group(k))
            if g is not None:
                by_group.setdefault(g, []).extend(self.keymap.chunk(k))
        for g, flat in by_group.items():
            for lid in self.daemon.lids[g::self.groups]:
                sc.prefetch(lid, flat)

    def _tier_or_down(self, key: bytes) -> str | None:
        sc = self.daemon.get()
        if sc is None:
            return "unavailable"
        try:
            return self._tiers(sc, [key])[0]
        except KvtierError as e:
            self.daemon.failed(sc, e)
            return "unavailable"

    def _excluded(self, tier: str, req_context: ReqContext) -> bool:
        """Whether the request's kv_load_tiers leaves kvtier's ``tier`` (host, disk) out: then
        the chunk is a miss and vLLM recomputes it (counted ``filtered_<tier>``)."""
        if req_context.load_tier_filter.allows(_MEDIA[tier], Locality.LOCAL):
            return False
        self.counts.add(M_LOOKUPS, 1, f"filtered_{tier}")
        return True

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self.pending:
            if self._excluded("host", req_context):  # (its store is bound for host)
                return LookupResult.MISS
            self.counts.add(M_LOOKUPS, 1, "pending")
            return LookupResult.HIT_PENDING
        state = _req_state(req_context)
        if bytes(key) in state.loaded:
            # asked again after loading it: its load failed (vLLM recomputes from the first
            # failed block and looks up again) or the request was preempted. Never load a
            # chunk twice for one request: that bounds a failing daemon to one try.
            self.counts.add(M_LOOKUPS, 1, "retry")
            return LookupResult.MISS
        tier = self._tier_or_down(key)
        if tier in _MEDIA:
            if self._excluded(tier, req_context):
                return LookupResult.MISS
            self.counts.add(M_LOOKUPS, 1, f"hit_{tier}")
            state.tiers[bytes(key)] = tier
            return LookupResult.HIT
        self.counts.add(M_LOOKUPS, 1, "unavailable" if tier == "unavailable" else "miss")
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = req_context.get_state(_ReqState)
        tier = state.tiers.get(bytes(key)) if state is not None else None
        return {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
            tier or "", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        _req_state(req_context).loaded.update(bytes(k) for k in keys)
        return KvtierLoadSpec([self.keymap.chunk(k) for k in keys])

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        sc = self.daemon.get()
        todo: list[OffloadKey] = []
        if sc is not None:
            offered = [k for k in keys if k not in self.pending]
            try:  # in the order offered: vLLM lays out the source blocks in that order
                held = self._tiers(sc, offered)
                todo = [k for k, t in zip(offered, held, strict=True) if t is None]
            except KvtierError as e:
                self.daemon.failed(sc, e)
                todo = []
            else:
                used = [k for k, t in zip(offered, held, strict=True) if t is not None]
                try:
                    if used:
                        self._used(sc, used)
                except KvtierError as e:  # (only recency: the store goes on)
                    log.debug(f"kvtier: marking {len(used)} held chunks used failed: {e}")
        self.pending.update((k, next(self._offered)) for k in todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=KvtierStoreSpec([self.keymap.chunk(k) for k in todo]),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # vLLM hands a store's keys over as a set: follow them in the order they were offered, so
        # their events name parents before children (an indexer that links a block under its
        # parent, as Dynamo's radix tree does, drops a block whose parent it has not seen)
        ordered = sorted(keys, key=lambda k: self.pending.get(k, -1))
        for k in keys:
            self.pending.pop(k, None)
        if self.events is not None and success:  # (a failed store: whatever kvtier holds shows at the next rescan)
            self.events.follow(bytes(k) for k in ordered)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        sc = self.daemon.get()
        if sc is not None and self.events.where:
            try:
                self.events.rescan(lambda ks: self._tiers(sc, ks))
            except KvtierError as e:
                self.daemon.failed(sc, e)
        out, self.events.out = self.events.out, []
        return out

    @property
    def lock(self) -> threading.Lock:
        """The lock vLLM's scheduler (0.33) holds around its calls into this manager."""
        return self._lock

    def on_reset_flushed(self) -> None:
        """vLLM (0.33): every transfer in flight at :meth:`reset_cache` has ended. kvtier's tiers
        are the daemon's and outlive the reset: nothing here to reuse or free."""

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        """vLLM's ``vllm:kv_offload_config_info`` gauge (0.33): the labels
        :meth:`KvtierOffloadingSpec.config_info_keys` declares."""
        s = self.settings
        return [{"kvtier_socket": s.socket or "", "kvtier_copy": s.copy, "kvtier_groups": self.groups}]

    def reset_cache(self) -> None:
        # kvtier's tiers are the node's, shared with other engines: a reset of this engine's
        # cache forgets what it has in flight but does not evict them (kvtier evict does)
        self.pending.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.counts.take()

    def shutdown(self) -> None:
        self.daemon.close()



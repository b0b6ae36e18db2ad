"""The daemon's location log: every change of what the node holds, numbered, for routers.

Owns
    :class:`LocationLog`, a :class:`~kvtier.daemon.observers.LocationObserver` of the store.
    Every visibility change (stored, removed, cleared; tier, layout fingerprint, keys, and
    the worker for the gpu tier, which :class:`~kvtier.daemon.device.DeviceTier` reports)
    becomes one :class:`LocationEvent` numbered ``(epoch, seq)``: the epoch is the daemon's
    (a restart starts a new one), seq counts from 1. The newest events are kept in a ring
    bounded by ``event_log_keys`` keys (an event of k keys weighs max(1, k)) and by
    ``event_log_bytes`` bytes of daemon heap per tenant (:func:`event_bytes`: the keys' bytes
    and about 256 bytes of objects per event, measured with tracemalloc).

Tenants
    Each tenant has its own feed (:class:`TenantLog`: its own ring and numbering), holding only
    the blocks of layouts that tenant registered, under the layouts' own fingerprints, and
    its own workers by their own ids. :class:`LocationLog` is the default tenant's feed and
    hands every change to the feed of the tenant whose layout it is under
    (:meth:`LocationLog.for_tenant`). A change under a layout no tenant has registered
    since the start (blocks the disk tier restored) is published when its tenant registers
    it. Routers following one tenant's feed can therefore never learn another tenant's keys,
    workers, or how busy it is (seqs count the tenant's own events only).

Promises (the feed contract of ``locations.proto``; the Locations service,
:mod:`kvtier.daemon.services.locations`, serves it)
    A subscriber that applies, in order, the snapshot (if sent) and then the events gets the
    node's current holdings. A subscriber resuming at ``(epoch, from_seq)`` gets every event
    after ``from_seq`` exactly once when the ring still holds them (:meth:`LocationLog.since`
    answers None when it does not: the subscriber then needs a snapshot). A snapshot is
    exactly the state at its ``at_seq``: the tiers' key sets are copied in one loop step
    (C-speed copies), then grouped in chunks with the loop free in between, so millions of
    keys never stall it (:meth:`TenantLog.snapshot_async`); subscribers joining at once share
    one snapshot.
    :attr:`LocationLog.info_version` changes whenever the node's workers do, so NodeInfo can
    be sent again.

Load bandwidth: NodeInfo publishes per tier the measured bandwidth of loading a block into an
engine. The host -> GPU copy engine is not measured in this daemon yet, so host (and disk,
unless the disk tier reports one) publish 0, which routers read as "use your configured
default" (``ScorerConfig.host_load_gbps`` / ``disk_load_gbps``).

Threading: everything runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.config import EVENT_LOG_BYTES, EVENT_LOG_KEYS
from kvtier.daemon.counters import Count
from kvtier.daemon.layouts import RegisteredLayout, split_worker
from kvtier.daemon.stats import TierUsage, tier_usage
from kvtier.daemon.store import BlockStore
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier, group_by_fingerprint

SNAPSHOT_CHUNK_KEYS = 4096  # keys grouped and packed per loop step while a snapshot is built


class EventKind(enum.Enum):
    STORED = enum.auto()   # keys became visible in the tier (for gpu: on the worker)
    REMOVED = enum.auto()  # keys are no longer in the tier
    CLEARED = enum.auto()  # the tier was emptied (for gpu: the worker's device blocks); no keys


class PackedKeys(Sequence[bytes]):
    """An event's keys, kept as one bytes object when they share a length (as a layout's keys
    do): the ring holds up to ``event_log_keys`` keys, and a separate object per key cost the
    daemon about 55 bytes each (54 MiB at 2^20 keys, measured with bench/lookup.py)."""

    __slots__ = ("_blob", "_width", "_n")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._n = len(keys)
        widths = {len(k) for k in keys}
        if len(widths) == 1:
            self._width = widths.pop()
            self._blob: bytes | tuple[bytes, ...] = b"".join(keys)
        else:
            self._width = 0
            self._blob = tuple(keys)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, stride = i.indices(self._n)
            if not self._width or stride != 1:
                return [self[j] for j in range(start, stop, stride)]
            w = self._width
            blob = self._blob[start * w:max(start, stop) * w]
            return [blob[o:o + w] for o in range(0, len(blob), w)]
        if not self._width:
            return self._blob[i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._blob[i * self._width:(i + 1) * self._width]

    def __iter__(self):
        if not self._width:
            return iter(self._blob)
        w, blob = self._width, self._blob
        return (blob[o:o + w] for o in range(0, len(blob), w))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PackedKeys({list(self)!r})"

    @property
    def nbytes(self) -> int:
        """Heap bytes its keys take (a bytes object is 33 bytes plus its length, and a pointer)."""
        if self._width:
            return len(self._blob)  # type: ignore[arg-type]
        return sum(len(k) + 41 for k in self._blob)


EVENT_OVERHEAD = 256
"""Heap bytes of one ring event beside its keys (the event, its PackedKeys, the ring's slot;
measured: 289 bytes for an event of one 32-byte key, 3,450 for one of 100)."""


def event_bytes(keys: PackedKeys) -> int:
    """What one event of ``keys`` weighs against ``event_log_bytes``."""
    return EVENT_OVERHEAD + keys.nbytes


@dataclass(frozen=True)
class LocationEvent:
    seq: int
    kind: EventKind
    tier: Tier
    fingerprint: bytes          # empty for CLEARED
    keys: Sequence[bytes] = ()
    worker: str = ""            # gpu events only


_DROPPED = LocationEvent(0, EventKind.CLEARED, Tier.HOST, b"")
"""What stands in the ring's list for an event dropped from it until the list is compacted."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    epoch: int
    head_seq: int
    workers: list[tuple[str, list[bytes]]]   # (worker id, the layout fingerprints its ranks reported)
    tiers: list[TierUsage]
    layouts: list[Layout]


class TenantLog:
    """One tenant's feed (see the module docstring): fingerprints are the layouts' own,
    workers their own ids."""

    def __init__(self, store: BlockStore, node_id: str, epoch: int, max_keys: int = EVENT_LOG_KEYS,
                 tenant: str = DEFAULT_TENANT, max_bytes: int = EVENT_LOG_BYTES) -> None:
        self.tenant = tenant
        self.store = store
        self.node_id = node_id
        self.epoch = epoch
        self.max_keys = max(1, max_keys)
        self.max_bytes = max(1, max_bytes)
        self._ring_bytes = 0
        self.head = 0                          # seq of the newest event
        self._ring: list[LocationEvent] = []   # events first_seq .. head, from index _start
        self._start = 0
        self._ring_keys = 0
        self._changed = asyncio.Event()
        self.counters = store.counters
        self.closed = False
        self._building: asyncio.Future | None = None  # a snapshot being built (snapshot_async)

    @property
    def info_version(self) -> int:
        """Changes whenever the tenant's workers (or their layouts) do."""
        return self.store.device.versions[self.tenant]

    # -- the ring -------------------------------------------------------------------------

    @property
    def first_seq(self) -> int:
        """Oldest seq still held (head + 1 when none)."""
        return self.head - (len(self._ring) - self._start) + 1

    def _append(self, kind: EventKind, tier: Tier, fp: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        self.head += 1
        packed = PackedKeys(keys)
        self._ring.append(LocationEvent(self.head, kind, tier, fp, packed, worker))
        self._ring_keys += max(1, len(keys))
        self._ring_bytes += event_bytes(packed)
        while ((self._ring_keys > self.max_keys or self._ring_bytes > self.max_bytes)
               and len(self._ring) - self._start > 1):
            old = self._ring[self._start]
            self._ring_keys -= max(1, len(old.keys))
            self._ring_bytes -= event_bytes(old.keys)  # type: ignore[arg-type]
            self._ring[self._start] = _DROPPED  # its keys go now, not when the list is compacted
            self._start += 1
        if self._start > 4096 and self._start * 2 > len(self._ring):
            del self._ring[:self._start]
            self._start = 0
        self.counters.add(Count.LOCATION_EVENTS)
        self._notify()

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def close(self) -> None:
        """End every subscription (the daemon is stopping)."""
        self.closed = True
        self._notify()

    def since(self, seq: int, limit: int = 4096, max_keys: int = 0) -> list[LocationEvent] | None:
        """Up to ``limit`` events after ``seq`` (oldest first), and with ``max_keys`` no more
        events than hold that many keys (at least one), or None if some of them are no longer
        held. (A subscriber holds what it was given until it is sent: ``max_keys`` bounds that.)"""
        if seq >= self.head:
            return []
        if seq + 1 < self.first_seq:
            return None
        i = self._start + (seq + 1 - self.first_seq)
        out = self._ring[i:i + limit]
        if max_keys:
            n = 0
            for j, ev in enumerate(out):
                n += max(1, len(ev.keys))
                if n > max_keys and j:
                    return out[:j]
        return out

    def behind(self, seq: int) -> int:
        """How many events a subscriber that was sent everything up to ``seq`` is behind, when
        that is further than the ring reaches back (the events it needs next are gone): 0
        while it can still be served from the ring."""
        return self.head - seq if seq + 1 < self.first_seq else 0

    def can_resume(self, epoch: int, from_seq: int) -> bool:
        """Whether a subscriber at ``(epoch, from_seq)`` can be sent just the events after it."""
        return epoch == self.epoch and from_seq <= self.head and self.since(from_seq) is not None

    async def wait(self, seq: int, timeout: float) -> None:
        """Return once an event after ``seq`` exists, something else changed, or ``timeout``."""
        if self.head > seq:
            return
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- the tenant's changes (the layouts' own fingerprints, the workers' own ids) ----------

    def _stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if keys:
            self._append(EventKind.STORED, tier, fingerprint, keys, worker)

    def _removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if keys:
            self._append(EventKind.REMOVED, tier, fingerprint, keys, worker)

    def _cleared(self, tier: Tier, worker: str = "") -> None:
        self._append(EventKind.CLEARED, tier, b"", (), worker)

    # -- snapshot and node info -----------------------------------------------------------

    def snapshot(self) -> tuple[int, list[LocationEvent]]:
        """Everything of the tenant's visible now, as STORED entries, and the seq it is the state at."""
        at = self.head
        store, tenant = self.store, self.tenant
        entries = [LocationEvent(at, EventKind.STORED, tier, fp, keys)
                   for tier, fp, keys in store.holdings(tenant)]
        entries += [LocationEvent(at, EventKind.STORED, Tier.GPU, fp, keys, worker)
                    for worker, fp, keys in store.device_holdings(tenant)]
        self.counters.add(Count.LOCATION_SNAPSHOTS)
        return at, entries

    async def snapshot_async(self) -> tuple[int, list[LocationEvent]]:
        """:meth:`snapshot` without stalling the event loop, however many keys are held: the
        tiers' key sets are copied in the loop step that reads ``at`` (C-speed copies, so the
        state is exactly the one at ``at``), then grouped and packed in chunks of
        ``SNAPSHOT_CHUNK_KEYS`` with the loop free between chunks. Subscribers that join while
        one is being built share it (they then resume from its ``at`` with the ring's events,
        like any subscriber). The entries are :class:`PackedKeys` of at most a chunk each."""
        task = self._building
        if task is None:
            task = self._building = asyncio.ensure_future(self._build_snapshot())
            task.add_done_callback(lambda t: setattr(self, "_building", None) if self._building is t else None)
        return await asyncio.shield(task)

    async def _build_snapshot(self) -> tuple[int, list[LocationEvent]]:
        at = self.head
        store, tenant = self.store, self.tenant
        wire = {reg.fingerprint: reg.wire_fingerprint for reg in store.layouts.of_tenant(tenant)}
        tiers = store.tiers
        sources: list[tuple[Tier, str, list[bytes]]] = [(Tier.HOST, "", list(tiers.host.entries))]
        if tiers.disk is not None:
            sources.append((Tier.DISK, "", list(tiers.disk.entries)))
        device = [(split_worker(wkey)[1], fp, list(keys)) for wkey, per_fp in list(store.device.held.items())
                  if split_worker(wkey)[0] == tenant for fp, keys in per_fp.items() if keys and fp in wire]
        entries: list[LocationEvent] = []
        step = SNAPSHOT_CHUNK_KEYS
        for tier, _, packed in sources:
            for i in range(0, len(packed), step):
                for fp, keys in group_by_fingerprint(packed[i:i + step]).items():
                    if fp in wire:
                        entries.append(LocationEvent(at, EventKind.STORED, tier, wire[fp], PackedKeys(keys)))
                await asyncio.sleep(0)
        for worker, fp, keys in device:
            for i in range(0, len(keys), step):
                entries.append(LocationEvent(at, EventKind.STORED, Tier.GPU, wire[fp], PackedKeys(keys[i:i + step]),
                                             worker))
                await asyncio.sleep(0)
        self.counters.add(Count.LOCATION_SNAPSHOTS)
        return at, entries

    def node_info(self) -> NodeInfo:
        store = self.store
        return NodeInfo(self.node_id, self.epoch, self.head, store.device.workers(self.tenant), tier_usage(store, self.tenant),
                        [reg.wire for reg in store.layouts.of_tenant(self.tenant)])


class LocationLog(TenantLog):
    """The default tenant's feed, and the :class:`~kvtier.daemon.observers.LocationObserver`
    that hands each change to its tenant's feed (see the module docstring)."""

    def __init__(self, store: BlockStore, node_id: str, epoch: int, max_keys: int = EVENT_LOG_KEYS,
                 max_bytes: int = EVENT_LOG_BYTES) -> None:
        super().__init__(store, node_id, epoch, max_keys, DEFAULT_TENANT, max_bytes)
        self._logs: dict[str, TenantLog] = {DEFAULT_TENANT: self}
        store.layout_hooks.append(self._layout_registered)

    def for_tenant(self, tenant: str) -> TenantLog:
        """The tenant's feed (made on first use)."""
        log = self._logs.get(tenant)
        if log is None:
            log = self._logs[tenant] = TenantLog(self.store, self.node_id, self.epoch, self.max_keys, tenant,
                                                 self.max_bytes)
            log.closed = self.closed
        return log

    def close(self) -> None:
        for log in list(self._logs.values()):
            TenantLog.close(log)

    def _layout_registered(self, reg: RegisteredLayout) -> None:
        """A tenant registered a layout: what the tiers already hold under it (restored from
        disk) enters the tenant's feed now."""
        log = self.for_tenant(reg.tenant)
        for tier, fp, keys in self.store.holdings(reg.tenant, reg.fingerprint):
            log._stored(tier, fp, keys)

    def _route(self, fingerprint: bytes) -> tuple[TenantLog, bytes] | None:
        reg = self.store.layouts.find(fingerprint)
        if reg is None:  # nobody registered it since the start: published when registered
            return None
        return self.for_tenant(reg.tenant), reg.wire_fingerprint

    # -- LocationObserver -----------------------------------------------------------------

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        to = self._route(fingerprint)
        if to is not None and keys:
            to[0]._stored(tier, to[1], keys, split_worker(worker)[1])

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        to = self._route(fingerprint)
        if to is not None and keys:
            to[0]._removed(tier, to[1], keys, split_worker(worker)[1])

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        if tier is Tier.GPU:  # one worker's blocks: its tenant's feed
            tenant, wid = split_worker(worker)
            self.for_tenant(tenant)._cleared(tier, wid)
            return
        for log in list(self._logs.values()):
            log._cleared(tier, worker)

    def workers_changed(self) -> None:
        for log in list(self._logs.values()):
            log._notify()  # NodeInfo changed: wake the subscribers so they send it

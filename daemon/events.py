"""The daemon's location log and the ``kvtier.v1.Locations`` service that publishes it.

Owns
    * :class:`LocationLog`: a :class:`~kvtier.daemon.store.LocationObserver` registered in
      ``store.observers``. Every visibility change the store reports (stored, removed,
      cleared; tier, layout fingerprint, keys) and every device-block report of a worker's
      sidecar becomes one :class:`LocationEvent` numbered ``(epoch, seq)``: the epoch is the
      daemon's (a restart starts a new one), seq counts from 1. The newest events are kept
      in a ring bounded by ``event_log_keys`` keys (an event of k keys weighs max(1, k));
    * the gpu tier as reported by sidecars: per worker and layout fingerprint, the set of keys
      its engine holds in HBM. The daemon does not hold those blocks; it republishes what the
      engine says so routers see the device tier. When the reporting sidecar's session ends,
      the device blocks it reported are cleared at once (its engine is gone): the whole
      worker when no other session reports for it, else that rank's fingerprint only;
    * :class:`LocationsService`: ``WatchLocations``, ``ReportDeviceBlocks``, ``GetNodeInfo``.

Promises (the feed contract of ``locations.proto``)
    A subscriber that applies, in order, the snapshot (if sent) and then the events gets the
    node's current holdings. A subscriber resuming at ``(epoch, from_seq)`` gets every event
    after ``from_seq`` exactly once when the ring still holds them; otherwise (new, other
    epoch, too far behind, or fallen behind while connected) it gets a snapshot first. A
    snapshot is built in one pass of the event loop, so it is exactly the state at its
    ``at_seq``; its parts are sent afterwards. NodeInfo (its workers) is sent again whenever
    it changed, and once after the events a resume replays (they are older than the NodeInfo
    that opened the stream), so the subscriber ends with the node's current workers.

Load bandwidth: NodeInfo publishes per tier the measured bandwidth of loading a block into an
engine. The host -> GPU copy engine is not measured in this daemon yet, so host (and disk,
unless the disk tier reports one) publish 0, which routers read as "use your configured
default" (``ScorerConfig.host_load_gbps`` / ``disk_load_gbps``).

Threading: everything runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc

from kvtier.daemon.store import BlockStore, StoreError
from kvtier.proto import TIER_BY_NAME, locations_pb2, locations_pb2_grpc, node_pb2

log = logging.getLogger("kvtier.events")

SNAPSHOT_PART_KEYS = 32768   # keys per SnapshotPart message
BATCH_KEYS = 32768           # keys per EventBatch message (at least one event)
HEARTBEAT_S = 5.0            # an idle stream sends an empty EventBatch (head_seq) this often
SESSION_CHECK_S = 1.0        # how often device blocks of ended sessions are cleared
MAX_WORKER_ID = 256

Event = locations_pb2.LocationEvent


class LocationLog:
    """See the module docstring."""

    def __init__(self, store: BlockStore, node_id: str, epoch: int, max_keys: int = 1 << 20) -> None:
        self.store = store
        self.node_id = node_id
        self.epoch = epoch
        self.max_keys = max(1, max_keys)
        self.head = 0                   # seq of the newest event
        self._ring: list[Event] = []    # events first_seq .. head, from index _start
        self._start = 0
        self._ring_keys = 0
        self._changed = asyncio.Event()
        self.info_version = 0           # bumped when workers change
        # worker -> fingerprint -> keys its engine holds on device
        self.device: dict[str, dict[bytes, set[bytes]]] = {}
        # worker -> fingerprint -> the session that last reported it (a tensor-parallel
        # worker's ranks report their own fingerprints through their own sidecars)
        self.worker_sessions: dict[str, dict[bytes, int]] = {}
        self.counters = store.counters
        self.closed = False
        # cleared the moment the store closes the session: a successor engine reporting under
        # the same worker id right after must not inherit the dead engine's blocks
        store.session_end_hooks.append(self._session_ended)

    # -- the ring -------------------------------------------------------------------------

    @property
    def first_seq(self) -> int:
        """Oldest seq still held (head + 1 when none)."""
        return self.head - (len(self._ring) - self._start) + 1

    def _append(self, kind: int, tier: str, fp: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        self.head += 1
        ev = Event(seq=self.head, kind=kind, tier=TIER_BY_NAME[tier], worker_id=worker, fingerprint=fp,
                   keys=keys)
        self._ring.append(ev)
        self._ring_keys += max(1, len(keys))
        while self._ring_keys > self.max_keys and len(self._ring) - self._start > 1:
            old = self._ring[self._start]
            self._ring_keys -= max(1, len(old.keys))
            self._start += 1
        if self._start > 4096 and self._start * 2 > len(self._ring):
            del self._ring[:self._start]
            self._start = 0
        self.counters["location_events"] += 1
        self._notify()

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def close(self) -> None:
        """End every WatchLocations stream (the daemon is stopping)."""
        self.closed = True
        self._notify()

    def since(self, seq: int, limit: int = 4096) -> list[Event] | None:
        """Up to ``limit`` events after ``seq`` (oldest first), or None if some of them are no
        longer held."""
        if seq >= self.head:
            return []
        if seq + 1 < self.first_seq:
            return None
        i = self._start + (seq + 1 - self.first_seq)
        return self._ring[i:i + limit]

    async def wait(self, seq: int, timeout: float) -> None:
        """Return once an event after ``seq`` exists, something else changed, or ``timeout``."""
        if self.head > seq:
            return
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- LocationObserver -----------------------------------------------------------------

    def stored(self, tier: str, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        if keys:
            self._append(locations_pb2.STORED, tier, fingerprint, keys)

    def removed(self, tier: str, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        if keys:
            self._append(locations_pb2.REMOVED, tier, fingerprint, keys)

    def cleared(self, tier: str) -> None:
        self._append(locations_pb2.CLEARED, tier, b"", [])

    # -- the gpu tier, as sidecars report it ----------------------------------------------

    def report_device(self, worker: str, layout_id: int, stored: Sequence[bytes], removed: Sequence[bytes],
                      clear: bool, session_id: int = 0) -> int:
        """Apply one worker's device-block report; returns the seq of its last event (0: none).
        Raises StoreError (and changes nothing) for a bad report."""
        if not worker or len(worker) > MAX_WORKER_ID:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"worker_id must be 1 to {MAX_WORKER_ID} characters (e.g. the engine's address)")
        fp = self.store.layout(layout_id).layout.fingerprint
        self.store.check_keys(stored, unique=False)
        self.store.check_keys(removed, unique=False)
        if session_id and session_id not in self.store.sessions:
            raise StoreError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"session {session_id} is not open on this daemon: report with the sidecar's "
                             f"current session (or 0)")
        before = self.head
        per_fp = self.device.get(worker)
        if per_fp is None:
            per_fp = self.device[worker] = {}
            self.info_version += 1
        held = per_fp.get(fp)
        if held is None:
            held = per_fp[fp] = set()
            self.info_version += 1
        if session_id:
            self.worker_sessions.setdefault(worker, {})[fp] = session_id
        if clear and held:
            gone = list(held)
            held.clear()
            self._append(locations_pb2.REMOVED, "gpu", fp, gone, worker)
        new = list(dict.fromkeys(k for k in stored if k not in held))
        held.update(new)
        if new:
            self._append(locations_pb2.STORED, "gpu", fp, new, worker)
        gone = list(dict.fromkeys(k for k in removed if k in held))
        held.difference_update(gone)
        if gone:
            self._append(locations_pb2.REMOVED, "gpu", fp, gone, worker)
        self.counters["device_reports"] += 1
        if self.head == before:
            self._notify()  # NodeInfo may have changed
        return self.head if self.head != before else 0

    def _session_ended(self, session_id: int) -> None:
        self._release(lambda sid: sid == session_id)

    def drop_ended_sessions(self) -> int:
        """Clear the device blocks reported through sessions that ended; returns how many
        workers lost some. (Sessions the store closes are cleared at once through its
        session-end hook; this catches any other way a session could disappear.)"""
        return self._release(lambda sid: sid not in self.store.sessions)

    def _release(self, ended: Callable[[int], bool]) -> int:
        """Clear what ended sessions reported: a worker none of whose fingerprints is bound
        to an open session any more is cleared and forgotten; otherwise only the ended
        sessions' fingerprints are emptied (a tensor-parallel worker missing a rank then
        holds nothing, but still lists the rank, so it does not look whole)."""
        hit = 0
        for worker in list(self.worker_sessions):
            bound = self.worker_sessions[worker]
            gone = [fp for fp, sid in bound.items() if ended(sid)]
            if not gone:
                continue
            hit += 1
            for fp in gone:
                del bound[fp]
            if not bound:
                del self.worker_sessions[worker]
                self.device.pop(worker, None)
                self.info_version += 1
                self._append(locations_pb2.CLEARED, "gpu", b"", [], worker)
                log.info("device blocks cleared: the worker's session ended", extra={"worker_id": worker})
                continue
            per_fp = self.device.get(worker, {})
            for fp in gone:
                held = per_fp.get(fp)
                if held:
                    keys = list(held)
                    held.clear()
                    self._append(locations_pb2.REMOVED, "gpu", fp, keys, worker)
            log.info("device blocks of a rank cleared: its session ended",
                     extra={"worker_id": worker, "fingerprints": [fp.hex() for fp in gone]})
        return hit

    # -- snapshot and node info -----------------------------------------------------------

    def snapshot(self, part_keys: int = SNAPSHOT_PART_KEYS) -> tuple[int, list[locations_pb2.SnapshotPart]]:
        """Everything visible now, as parts; and the seq it is the state at."""
        at = self.head
        entries: list[tuple[str, str, bytes, list[bytes]]] = []
        for tier, fp, keys in self.store.holdings():
            entries.append((tier, "", fp, keys))
        for worker, per_fp in self.device.items():
            for fp, keys in per_fp.items():
                if keys:
                    entries.append(("gpu", worker, fp, list(keys)))
        parts: list[locations_pb2.SnapshotPart] = []
        cur = locations_pb2.SnapshotPart(at_seq=at)
        room = part_keys
        for tier, worker, fp, keys in entries:
            for i in range(0, len(keys), part_keys):
                chunk = keys[i:i + part_keys]
                if len(chunk) > room:
                    parts.append(cur)
                    cur = locations_pb2.SnapshotPart(at_seq=at)
                    room = part_keys
                cur.entries.append(Event(seq=at, kind=locations_pb2.STORED, tier=TIER_BY_NAME[tier],
                                         worker_id=worker, fingerprint=fp, keys=chunk))
                room -= len(chunk)
        parts.append(cur)
        parts[0].first = True
        parts[-1].last = True
        self.counters["location_snapshots"] += 1
        return at, parts

    def node_info(self) -> locations_pb2.NodeInfo:
        store = self.store
        info = locations_pb2.NodeInfo(node_id=self.node_id, epoch=self.epoch, head_seq=self.head)
        for worker in sorted(self.device):
            info.workers.add(worker_id=worker, fingerprints=sorted(self.device[worker]))
        info.tiers.add(tier=node_pb2.TIER_HOST, capacity_bytes=store.host.capacity, load_gbps=0.0)
        for extra in store.extra_tier_stats():
            info.tiers.add(tier=extra["tier"], capacity_bytes=extra.get("capacity_bytes", 0),
                           load_gbps=extra.get("load_gbps", 0.0))
        for reg in store.layouts.values():
            lay = reg.layout
            info.layouts.add(fingerprint=lay.fingerprint, block_bytes=lay.block_bytes,
                             block_tokens=lay.block_tokens, tp_rank=lay.tp_rank, tp_size=lay.tp_size)
        return info


def _batches(events: Sequence[Event], max_keys: int) -> Iterable[list[Event]]:
    batch: list[Event] = []
    n = 0
    for ev in events:
        if batch and n + len(ev.keys) > max_keys:
            yield batch
            batch, n = [], 0
        batch.append(ev)
        n += len(ev.keys)
    if batch:
        yield batch


class LocationsService(locations_pb2_grpc.LocationsServicer):
    """gRPC face of a :class:`LocationLog`."""

    def __init__(self, log_: LocationLog, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.log = log_
        self.heartbeat_s = heartbeat_s

    async def WatchLocations(self, request: locations_pb2.WatchLocationsRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[locations_pb2.WatchLocationsReply]:
        loc = self.log
        Reply = locations_pb2.WatchLocationsReply
        epoch = loc.epoch
        sent_version = loc.info_version
        yield Reply(epoch=epoch, node=loc.node_info())
        pos: int | None = None
        if request.epoch == epoch and request.from_seq <= loc.head and loc.since(request.from_seq) is not None:
            pos = request.from_seq
            loc.counters["location_resumes"] += 1
            if pos < loc.head:
                # the events replayed are older than the NodeInfo just sent (a worker they
                # report may be gone by now): send the NodeInfo again once they are through
                sent_version = -1
        log.info("location subscriber", extra={"subscriber": request.subscriber or context.peer(),
                                               "resumed": pos is not None, "from_seq": request.from_seq,
                                               "head": loc.head})
        while not loc.closed:
            if pos is None:
                pos, parts = loc.snapshot()
                for part in parts:
                    yield Reply(epoch=epoch, snapshot=part)
            events = loc.since(pos)
            if events is None:
                loc.counters["location_subscribers_behind"] += 1
                pos = None
                continue
            if events:
                for batch in _batches(events, BATCH_KEYS):
                    yield Reply(epoch=epoch, events=locations_pb2.EventBatch(events=batch, head_seq=loc.head))
                    pos = batch[-1].seq
                continue
            if loc.info_version != sent_version:
                sent_version = loc.info_version
                yield Reply(epoch=epoch, node=loc.node_info())
                continue
            head_before = loc.head
            await loc.wait(pos, self.heartbeat_s)
            if loc.closed:
                return
            if loc.head == head_before and loc.info_version == sent_version:
                yield Reply(epoch=epoch, events=locations_pb2.EventBatch(head_seq=loc.head))

    async def ReportDeviceBlocks(self, request: locations_pb2.ReportDeviceBlocksRequest,
                                 context: grpc.aio.ServicerContext) -> locations_pb2.ReportDeviceBlocksReply:
        try:
            seq = self.log.report_device(request.worker_id, request.layout_id, list(request.stored),
                                         list(request.removed), request.clear, request.session_id)
        except StoreError as e:
            self.log.counters[f"errors:{e.code.name}"] += 1
            await context.abort(e.code, str(e))
        return locations_pb2.ReportDeviceBlocksReply(seq=seq)

    async def GetNodeInfo(self, request: locations_pb2.NodeInfoRequest, context: Any) -> locations_pb2.NodeInfo:
        return self.log.node_info()


async def watch_sessions(log_: LocationLog, period_s: float = SESSION_CHECK_S) -> None:
    """Run forever: clear the device blocks of workers whose sidecar session ended."""
    while True:
        await asyncio.sleep(period_s)
        try:
            log_.drop_ended_sessions()
        except Exception:
            log.exception("clearing device blocks of ended sessions failed")

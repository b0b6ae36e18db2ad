"""gRPC servicer of ``kvtier.v1.Locations``: the location feed of a
:class:`~kvtier.daemon.events.LocationLog`, and the engines' device-block reports.

``WatchLocations`` answers NodeInfo, then either the events after the subscriber's
``(epoch, from_seq)`` or a snapshot (in parts of at most ``SNAPSHOT_PART_KEYS`` keys), then
live events in batches of at most ``BATCH_KEYS`` keys, and an empty batch (``head_seq``) as a
heartbeat when idle. NodeInfo is sent again whenever the workers change, and once after the
events a resume replays (they are older than the NodeInfo that opened the stream), so the
subscriber ends with the node's current workers. ``ReportDeviceBlocks`` applies a report to
the gpu tier (:class:`~kvtier.daemon.device.DeviceTier`) and answers the seq of the last
event it produced. Errors and timing: :mod:`kvtier.daemon.services.handlers`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc

from kvtier.daemon.auth import Authenticator
from kvtier.daemon.counters import Count
from kvtier.daemon.events import LocationEvent, LocationLog
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.services import convert
from kvtier.daemon.services.handlers import handled, handled_stream
from kvtier.proto import locations_pb2, locations_pb2_grpc

log = logging.getLogger("kvtier.events")

SNAPSHOT_PART_KEYS = 32768   # keys per SnapshotPart message
BATCH_KEYS = 32768           # keys per EventBatch message (at least one event)
HEARTBEAT_S = 5.0            # an idle stream sends an empty EventBatch (head_seq) this often

Reply = locations_pb2.WatchLocationsReply


def _batches(events: Sequence[LocationEvent], max_keys: int) -> Iterable[list[LocationEvent]]:
    batch: list[LocationEvent] = []
    n = 0
    for ev in events:
        if batch and n + len(ev.keys) > max_keys:
            yield batch
            batch, n = [], 0
        batch.append(ev)
        n += len(ev.keys)
    if batch:
        yield batch


def snapshot_parts(at: int, entries: Sequence[LocationEvent], part_keys: int = SNAPSHOT_PART_KEYS
                   ) -> list[locations_pb2.SnapshotPart]:
    """A snapshot's entries as parts of at most ``part_keys`` keys (first and last marked)."""
    parts: list[locations_pb2.SnapshotPart] = []
    cur = locations_pb2.SnapshotPart(at_seq=at)
    room = part_keys
    for ev in entries:
        for i in range(0, len(ev.keys), part_keys):
            chunk = ev.keys[i:i + part_keys]
            if len(chunk) > room:
                parts.append(cur)
                cur = locations_pb2.SnapshotPart(at_seq=at)
                room = part_keys
            cur.entries.append(locations_pb2.LocationEvent(
                seq=at, kind=locations_pb2.STORED, tier=int(ev.tier), worker_id=ev.worker, fingerprint=ev.fingerprint,
                keys=chunk))
            room -= len(chunk)
    parts.append(cur)
    parts[0].first = True
    parts[-1].last = True
    return parts


class LocationsService(locations_pb2_grpc.LocationsServicer):
    """gRPC face of a :class:`LocationLog` and of the gpu tier (see the module docstring)."""

    def __init__(self, log_: LocationLog, latency: OpLatency, heartbeat_s: float = HEARTBEAT_S,
                 auth: Authenticator | None = None) -> None:
        self.auth = auth or Authenticator()  # who is calling (kvtier.daemon.auth)
        self.log = log_
        self.store = log_.store
        self.counters = log_.store.counters
        self.latency = latency
        self.heartbeat_s = heartbeat_s

    @handled_stream
    async def WatchLocations(self, request: locations_pb2.WatchLocationsRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[locations_pb2.WatchLocationsReply]:
        loc = self.log
        epoch = loc.epoch
        sent_version = loc.info_version
        yield Reply(epoch=epoch, node=convert.node_info_to_wire(loc.node_info()))
        pos: int | None = None
        if loc.can_resume(request.epoch, request.from_seq):
            pos = request.from_seq
            self.counters.add(Count.LOCATION_RESUMES)
            if pos < loc.head:
                # the events replayed are older than the NodeInfo just sent (a worker they
                # report may be gone by now): send the NodeInfo again once they are through
                sent_version = -1
        log.info("location subscriber", extra={"subscriber": request.subscriber or context.peer(),
                                               "resumed": pos is not None, "from_seq": request.from_seq,
                                               "head": loc.head})
        while not loc.closed:
            if pos is None:
                pos, entries = loc.snapshot()
                for part in snapshot_parts(pos, entries):
                    yield Reply(epoch=epoch, snapshot=part)
            events = loc.since(pos)
            if events is None:
                self.counters.add(Count.LOCATION_SUBSCRIBERS_BEHIND)
                pos = None
                continue
            if events:
                for batch in _batches(events, BATCH_KEYS):
                    yield Reply(epoch=epoch, events=locations_pb2.EventBatch(
                        events=[convert.event_to_wire(ev) for ev in batch], head_seq=loc.head))
                    pos = batch[-1].seq
                continue
            if loc.info_version != sent_version:
                sent_version = loc.info_version
                yield Reply(epoch=epoch, node=convert.node_info_to_wire(loc.node_info()))
                continue
            head_before = loc.head
            await loc.wait(pos, self.heartbeat_s)
            if loc.closed:
                return
            if loc.head == head_before and loc.info_version == sent_version:
                yield Reply(epoch=epoch, events=locations_pb2.EventBatch(head_seq=loc.head))

    @handled
    async def ReportDeviceBlocks(self, request: locations_pb2.ReportDeviceBlocksRequest,
                                 context: Any) -> locations_pb2.ReportDeviceBlocksReply:
        if request.session_id:  # the reporting session must be the caller's own (issue 12)
            self.store.session(request.session_id, self.auth.principal(context))
        before = self.log.head
        self.store.device.report(request.worker_id, request.layout_id, list(request.stored), list(request.removed),
                                 request.clear, request.session_id)
        return locations_pb2.ReportDeviceBlocksReply(seq=self.log.head if self.log.head != before else 0)

    @handled
    async def GetNodeInfo(self, request: locations_pb2.NodeInfoRequest, context: Any) -> locations_pb2.NodeInfo:
        return convert.node_info_to_wire(self.log.node_info())

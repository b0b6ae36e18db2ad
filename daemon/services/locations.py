"""gRPC servicer of ``kvtier.v1.Locations``: the location feed of a
:class:`~kvtier.daemon.events.LocationLog`, and the engines' device-block reports.

``WatchLocations`` answers NodeInfo, then either the events after the subscriber's
``(epoch, from_seq)`` or a snapshot (in parts of at most ``SNAPSHOT_PART_KEYS`` keys), then
live events in batches of at most ``BATCH_KEYS`` keys, and an empty batch (``head_seq``) as a
heartbeat when idle. NodeInfo is sent again whenever the workers change, and once after the
events a resume replays (they are older than the NodeInfo that opened the stream), so the
subscriber ends with the node's current workers. At most ``max_subscribers`` streams are served
at once, at most ``max_tenant_subscribers`` of one tenant (one more is refused
RESOURCE_EXHAUSTED, naming the limit); a subscriber further behind than the event
ring reaches (``--event-log-keys``) is dropped, RESOURCE_EXHAUSTED "fell behind ...;
resubscribe", even while a write to it is blocked on its flow control, so what a subscriber
that never reads holds stays bounded (:meth:`LocationsService._send`). ``ReportDeviceBlocks``
applies a report to the gpu tier (:class:`~kvtier.daemon.device.DeviceTier`) and answers the
seq of the last event it produced. Errors and timing: :mod:`kvtier.daemon.services.handlers`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvtier.daemon.auth import Authenticator
from kvtier.daemon.counters import Count
from kvtier.daemon.errors import Code, StoreError, check_name
from kvtier.daemon.events import LocationEvent, LocationLog, TenantLog
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.services import convert
from kvtier.daemon.services.handlers import handled, handled_writer
from kvtier.proto import locations_pb2, locations_pb2_grpc

log = logging.getLogger("kvtier.events")

SNAPSHOT_PART_KEYS = 4096    # keys per SnapshotPart message: each write serializes one on the loop (about 1 ms)
BATCH_KEYS = 32768           # keys per EventBatch message (at least one event)
HEARTBEAT_S = 5.0            # an idle stream sends an empty EventBatch (head_seq) this often
MAX_SUBSCRIBERS = 64         # streams at once (--max-feed-subscribers)
CHECK_S = 0.25               # how often a blocked write looks whether its subscriber fell too far behind

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
                   ) -> Iterator[locations_pb2.SnapshotPart]:
    """A snapshot's entries as parts of at most ``part_keys`` keys (first and last marked),
    made one at a time as they are sent (a subscriber that does not read holds one part, not
    a copy of the whole snapshot in messages)."""
    cur = locations_pb2.SnapshotPart(at_seq=at, first=True)
    room = part_keys
    for ev in entries:
        for i in range(0, len(ev.keys), part_keys):
            chunk = ev.keys[i:i + part_keys]
            if len(chunk) > room:
                yield cur
                cur = locations_pb2.SnapshotPart(at_seq=at)
                room = part_keys
            cur.entries.append(locations_pb2.LocationEvent(
                seq=at, kind=locations_pb2.STORED, tier=int(ev.tier), worker_id=ev.worker, fingerprint=ev.fingerprint,
                keys=chunk))
            room -= len(chunk)
    cur.last = True
    yield cur


class _Subscriber:
    """Where one stream stands: the seq its replies so far bring it to."""

    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq


class LocationsService(locations_pb2_grpc.LocationsServicer):
    """gRPC face of a :class:`LocationLog` and of the gpu tier (see the module docstring)."""

    def __init__(self, log_: LocationLog, latency: OpLatency, heartbeat_s: float = HEARTBEAT_S,
                 auth: Authenticator | None = None, max_subscribers: int = MAX_SUBSCRIBERS,
                 check_s: float = CHECK_S, max_tenant_subscribers: int = 0) -> None:
        self.auth = auth or Authenticator()  # who is calling (kvtier.daemon.auth)
        self.log = log_
        self.store = log_.store
        self.counters = log_.store.counters
        self.latency = latency
        self.heartbeat_s = heartbeat_s
        self.max_subscribers = max_subscribers  # --max-feed-subscribers
        self.check_s = check_s
        self.subscribers = 0                    # WatchLocations streams open now
        self.max_tenant_subscribers = max_tenant_subscribers or max_subscribers  # --max-feed-subscribers-per-tenant
        self.tenant_subscribers: dict[str, int] = {}  # tenant -> its streams open now
        self._building: dict[str, asyncio.Future] = {}  # tenant -> its snapshot being built (_snapshot)

    @handled_writer
    async def WatchLocations(self, request: locations_pb2.WatchLocationsRequest,
                             context: grpc.aio.ServicerContext) -> None:
        """The feed, at most ``max_subscribers`` streams at once; each reply written only
        while the subscriber keeps up (see :meth:`_send`)."""
        check_name(request.subscriber, "subscriber")
        if self.subscribers >= self.max_subscribers:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"{self.subscribers} location subscribers are connected; the limit is "
                             f"{self.max_subscribers} (--max-feed-subscribers): retry later")
        tenant = self.auth.principal(context).tenant
        mine = self.tenant_subscribers.get(tenant, 0)
        if mine >= self.max_tenant_subscribers:  # no tenant takes every place (docs/SECURITY.md)
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"{mine} location subscribers of this tenant are connected; the limit is "
                             f"{self.max_tenant_subscribers} per tenant (--max-feed-subscribers-per-tenant): "
                             f"retry later")
        loc = self.log.for_tenant(tenant)   # the caller's tenant's feed only
        self.subscribers += 1
        self.tenant_subscribers[tenant] = mine + 1
        try:
            sub = _Subscriber(loc.head)
            async for reply in self._replies(request, context, sub, loc):
                await self._send(context, reply, sub, loc)
        finally:
            self.subscribers -= 1
            left = self.tenant_subscribers.get(tenant, 0) - 1
            if left > 0:
                self.tenant_subscribers[tenant] = left
            else:
                self.tenant_subscribers.pop(tenant, None)

    async def _send(self, context: grpc.aio.ServicerContext, reply: Reply, sub: _Subscriber, loc: TenantLog) -> None:
        """Write one reply. gRPC takes a write only while the subscriber's flow-control window
        has room, so a subscriber that does not read blocks here, holding what it was given
        (a snapshot, one batch) and gRPC's bounded buffer; once it is further behind than the
        ring reaches it is dropped, and with it what it held."""
        write = asyncio.ensure_future(context.write(reply))
        try:
            while True:
                done, _ = await asyncio.wait((write,), timeout=self.check_s)
                if done:
                    write.result()
                    return
                behind = loc.behind(sub.seq)
                if behind:
                    raise self._fell_behind(behind)
        finally:
            if not write.done():
                write.cancel()

    def _fell_behind(self, behind: int) -> StoreError:
        self.counters.add(Count.LOCATION_SUBSCRIBERS_BEHIND)
        return StoreError(Code.RESOURCE_EXHAUSTED,
                          f"subscriber fell behind by {behind} events (more than the {self.log.max_keys} keys "
                          f"of events kept, --event-log-keys); resubscribe")

    async def _replies(self, request: locations_pb2.WatchLocationsRequest, context: grpc.aio.ServicerContext,
                       sub: _Subscriber, loc: TenantLog) -> AsyncIterator[Reply]:
        """The replies of one stream on the tenant's feed ``loc`` (see the module docstring);
        ``sub.seq`` follows them."""
        epoch = loc.epoch
        sent_version = loc.info_version
        yield Reply(epoch=epoch, node=convert.node_info_to_wire(loc.node_info()))
        pos: int | None = None
        if loc.can_resume(request.epoch, request.from_seq):
            pos = sub.seq = request.from_seq
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
                # built once for every subscriber joining meanwhile, in parts, the loop free
                # between parts (see _snapshot); held until sent
                pos, parts = await self._snapshot(loc)
                sub.seq = pos
                for reply in parts:
                    yield reply
                del parts
            events = loc.since(pos, max_keys=BATCH_KEYS)
            if events is None:
                raise self._fell_behind(loc.head - pos)
            if events:
                for batch in _batches(events, BATCH_KEYS):
                    sub.seq = batch[-1].seq
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

    async def _snapshot(self, loc: TenantLog) -> tuple[int, list[Reply]]:
        """The tenant's snapshot as its replies, built once and shared by every subscriber that
        asks while it is being built (ten routers joining at once cost one snapshot, not ten),
        a part per loop step: the loop never stalls for millions of keys."""
        task = self._building.get(loc.tenant)
        if task is None:
            task = self._building[loc.tenant] = asyncio.ensure_future(self._build(loc))
            task.add_done_callback(lambda t, k=loc.tenant: self._building.pop(k, None)
                                   if self._building.get(k) is t else None)
        return await asyncio.shield(task)

    @staticmethod
    async def _build(loc: TenantLog) -> tuple[int, list[Reply]]:
        pos, entries = await loc.snapshot_async()
        replies = []
        for part in snapshot_parts(pos, entries):
            replies.append(Reply(epoch=loc.epoch, snapshot=part))
            await asyncio.sleep(0)
        return pos, replies

    @handled
    async def ReportDeviceBlocks(self, request: locations_pb2.ReportDeviceBlocksRequest,
                                 context: Any) -> locations_pb2.ReportDeviceBlocksReply:
        principal = self.auth.principal(context)
        if request.session_id:  # the reporting session must be the caller's own
            self.store.session(request.session_id, principal)
        tenant = principal.tenant
        loc = self.log.for_tenant(tenant)
        before = loc.head
        self.store.device.report(request.worker_id, request.layout_id, list(request.stored), list(request.removed),
                                 request.clear, request.session_id, tenant)
        return locations_pb2.ReportDeviceBlocksReply(seq=loc.head if loc.head != before else 0)

    @handled
    async def GetNodeInfo(self, request: locations_pb2.NodeInfoRequest, context: Any) -> locations_pb2.NodeInfo:
        return convert.node_info_to_wire(self.log.for_tenant(self.auth.principal(context).tenant).node_info())

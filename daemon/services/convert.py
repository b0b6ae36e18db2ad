"""Conversions between the daemon's typed domain values and the wire messages (``kvtier.proto``).

The only place, with the servicers beside it, where the daemon touches protobuf. Tiers need
no table: :class:`~kvtier.tiers.vocab.Tier` has the wire enum's values (``TIER_NONE``, 0, is
None). The ``counters`` map of the Stats reply keeps its names for the clients that read it
(``Sidecar.stats()``, ``kvtier stats``); :func:`counter_names` is the one writer of those names.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.daemon.counters import Counters, Op, Place
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.events import EventKind, LocationEvent, NodeInfo
from kvtier.daemon.gpu import KVRegistration, TransferOrder, TransferResult, TransferStatus
from kvtier.daemon.results import GrantResult, GrantStatus, LeaseResult
from kvtier.daemon.stats import NodeStats
from kvtier.proto import locations_pb2, node_pb2, transfer_pb2
from kvtier.tiers.copy_engine import AllocationRef, TensorRef
from kvtier.tiers.layout import MAX_LAYOUTS, Layout, layout_from_proto
from kvtier.tiers.vocab import ALL_TIERS, Tier

_GRANT = {GrantStatus.GRANTED: node_pb2.GRANTED, GrantStatus.PRESENT: node_pb2.PRESENT,
          GrantStatus.NO_SPACE: node_pb2.NO_SPACE}
_TRANSFER = {TransferStatus.COPIED: transfer_pb2.TRANSFER_COPIED, TransferStatus.PRESENT: transfer_pb2.TRANSFER_PRESENT,
             TransferStatus.NO_SPACE: transfer_pb2.TRANSFER_NO_SPACE, TransferStatus.MISSING: transfer_pb2.TRANSFER_MISSING}
_EVENT = {EventKind.STORED: locations_pb2.STORED, EventKind.REMOVED: locations_pb2.REMOVED,
          EventKind.CLEARED: locations_pb2.CLEARED}
_OP = {Op.LOOKUP: node_pb2.COUNTED_OP_LOOKUP, Op.ACQUIRE: node_pb2.COUNTED_OP_ACQUIRE}
_PLACE = {Place.GPU: node_pb2.ENDPOINT_GPU, Place.HOST: node_pb2.ENDPOINT_HOST, Place.DISK: node_pb2.ENDPOINT_DISK,
          Place.CLIENT: node_pb2.ENDPOINT_CLIENT}


def tier_to_wire(tier: Tier | None) -> int:
    return node_pb2.TIER_NONE if tier is None else int(tier)


def layout_from_wire(spec: node_pb2.LayoutSpec) -> Layout:
    """Raises :class:`~kvtier.tiers.layout.LayoutError` for a bad layout."""
    return layout_from_proto(spec)


# -- Node ------------------------------------------------------------------------------------

def allocate_reply(grants: Sequence[GrantResult]) -> node_pb2.AllocateReply:
    return node_pb2.AllocateReply(grants=[node_pb2.Grant(status=_GRANT[g.status], grant_id=g.grant_id,
                                                         offset=g.offset, durable=g.durable) for g in grants])


def acquire_reply(leases: Sequence[LeaseResult]) -> node_pb2.AcquireReply:
    return node_pb2.AcquireReply(leases=[node_pb2.Lease(lease_id=x.lease_id, offset=x.offset,
                                                        found_in=tier_to_wire(x.found_in)) for x in leases])


def lookup_reply(tiers: Sequence[Tier | None]) -> node_pb2.LookupReply:
    return node_pb2.LookupReply(tiers=[tier_to_wire(t) for t in tiers])


def reported_hits(counts: node_pb2.LookupCounts) -> dict[Tier, int]:
    return {Tier.GPU: counts.hit_gpu, Tier.HOST: counts.hit_host, Tier.DISK: counts.hit_disk}


MAX_REPORTED_LOOKUPS = 1 << 40
"""The most lookups (hits and misses, all layouts) one ReportLookups may carry: a sidecar
reports about every second, so no real report comes near it, while a forged one cannot push
the counters past what the wire (uint64) carries in any time that matters."""


def reported_lookups(request: node_pb2.ReportLookupsRequest) -> list[tuple[int, dict[Tier, int], int]]:
    """A report as (layout id, hits by tier, misses) per entry; refuses (INVALID_ARGUMENT, and
    so counts nothing) more entries than a daemon has layouts or more lookups than
    :data:`MAX_REPORTED_LOOKUPS`."""
    if len(request.layouts) > MAX_LAYOUTS:
        raise StoreError(Code.INVALID_ARGUMENT, f"{len(request.layouts)} layout entries in one report; the limit "
                                                f"is {MAX_LAYOUTS} (one per layout)")
    out = [(c.layout_id, reported_hits(c), c.miss) for c in request.layouts]
    total = sum(sum(hits.values()) + miss for _, hits, miss in out)
    if total > MAX_REPORTED_LOOKUPS:
        raise StoreError(Code.INVALID_ARGUMENT, f"a report of {total} lookups; the limit is {MAX_REPORTED_LOOKUPS} "
                                                f"(2^40) lookups per report")
    return out


U64_MAX = (1 << 64) - 1


def u64(n: int) -> int:
    """``n`` clamped to what a uint64 field carries: a counter past it reads as the maximum
    (saturated) instead of failing the whole reply."""
    return n if n <= U64_MAX else U64_MAX


def counter_names(c: Counters) -> dict[str, int]:
    """Every counter under its name in the Stats reply's ``counters`` map (error codes only
    once refused)."""
    out: dict[str, int] = {}
    for op in Op:
        for tier, tally in c.hits[op].items():
            out[f"{op.value}_hit_blocks:{tier.label}"] = tally.blocks
            out[f"{op.value}_hit_tokens:{tier.label}"] = tally.tokens
        out[f"{op.value}_miss_blocks"] = c.misses[op].blocks
        out[f"{op.value}_miss_tokens"] = c.misses[op].tokens
    for flow, n in c.moved.items():
        out[f"bytes_{flow.source.value}_to_{flow.destination.value}"] = n
    for tier, n in c.evictions.items():
        out[f"evictions_{tier.label}"] = n
    for code, n in c.errors.items():
        if n:
            out[f"errors:{code.name}"] = n
    for count, n in c.counts.items():
        out[count.value] = n
    return {name: u64(n) for name, n in out.items()}


def stats_reply(s: NodeStats) -> node_pb2.StatsReply:
    c = s.counters
    reply = node_pb2.StatsReply(node_id=s.node_id, epoch=s.epoch, uptime_s=s.uptime_s, sessions=s.sessions,
                                version=s.version, retained_bytes=s.retained_bytes,
                                retention_budget_bytes=s.retention_budget_bytes)
    for t in s.tiers:
        reply.tiers.add(tier=int(t.tier), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, blocks=t.blocks,
                        load_gbps=t.load_gbps)
    for lay in s.layouts:
        reply.layouts.add(layout_id=lay.layout_id, fingerprint=lay.fingerprint, block_bytes=lay.block_bytes,
                          host_blocks=lay.blocks.get(Tier.HOST, 0), disk_blocks=lay.blocks.get(Tier.DISK, 0),
                          gpu_blocks=lay.blocks.get(Tier.GPU, 0))
    reply.counters.update(counter_names(c))
    for op in Op:
        for tier in ALL_TIERS:
            tally = c.hits[op][tier]
            reply.hits.add(op=_OP[op], tier=int(tier), blocks=u64(tally.blocks), tokens=u64(tally.tokens))
        reply.hits.add(op=_OP[op], tier=node_pb2.TIER_NONE, blocks=u64(c.misses[op].blocks),
                       tokens=u64(c.misses[op].tokens))
    for flow, n in c.moved.items():
        reply.bytes_moved.add(source=_PLACE[flow.source], destination=_PLACE[flow.destination], bytes=u64(n))
    for tier, n in c.evictions.items():
        reply.evictions.add(tier=int(tier), blocks=u64(n))
    for code, n in c.errors.items():
        if n:
            reply.errors.add(code=code.name, count=u64(n))
    reply.totals.update({count.value: u64(n) for count, n in c.counts.items()})
    return reply


# -- Locations -------------------------------------------------------------------------------

def event_to_wire(ev: LocationEvent) -> locations_pb2.LocationEvent:
    return locations_pb2.LocationEvent(seq=ev.seq, kind=_EVENT[ev.kind], tier=int(ev.tier), worker_id=ev.worker,
                                       fingerprint=ev.fingerprint, keys=ev.keys)


def node_info_to_wire(info: NodeInfo) -> locations_pb2.NodeInfo:
    msg = locations_pb2.NodeInfo(node_id=info.node_id, epoch=info.epoch, head_seq=info.head_seq)
    for worker, fps in info.workers:
        msg.workers.add(worker_id=worker, fingerprints=fps)
    for t in info.tiers:
        msg.tiers.add(tier=int(t.tier), capacity_bytes=t.capacity_bytes, load_gbps=t.load_gbps)
    for lay in info.layouts:
        msg.layouts.add(fingerprint=lay.fingerprint, block_bytes=lay.block_bytes, block_tokens=lay.block_tokens,
                        tp_rank=lay.tp_rank, tp_size=lay.tp_size)
    return msg


# -- Transfer --------------------------------------------------------------------------------

def kv_registration(request: transfer_pb2.RegisterKVRequest) -> KVRegistration:
    """Raises :class:`~kvtier.tiers.layout.LayoutError` for a bad layout."""
    return KVRegistration(
        session_id=request.session_id, layout=layout_from_wire(request.layout), backend=request.backend,
        allocations=[AllocationRef(a.size, a.ipc_handle, a.path, a.device, device_uuid=a.device_uuid)
                     for a in request.allocations],
        tensors=[TensorRef(t.allocation, t.offset) for t in request.tensors], ring_slots=request.ring_slots,
        event_handles=tuple(request.event_handles), event_ring_path=request.event_ring_path)


def transfer_order(request: transfer_pb2.TransferRequest) -> TransferOrder:
    return TransferOrder(request.session_id, request.registration_id, list(request.keys),
                         np.asarray(request.engine_ids, dtype=np.int64), request.event_slot, request.seq,
                         request.wait_written)


def transfer_reply(result: TransferResult) -> transfer_pb2.TransferReply:
    return transfer_pb2.TransferReply(status=[_TRANSFER[s] for s in result.status], bytes=result.nbytes)

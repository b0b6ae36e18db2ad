"""gRPC servicer of ``kvtier.v1.Node``: translates messages to :class:`BlockStore` calls.

Every handler answers a refused request with the :class:`StoreError`'s status code and
message; an unexpected exception is logged with its traceback and answered ``INTERNAL``,
and the daemon keeps serving. Every handler's time (errors included) goes into the
``OpLatency`` histograms, exported as ``kvtier_op_latency_seconds{op}`` (op: the RPC's name in
lower case).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvtier import __version__
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.store import BlockStore, StoreError
from kvtier.proto import TIER_BY_NAME, node_pb2, node_pb2_grpc
from kvtier.tiers.layout import LayoutError, layout_from_proto

log = logging.getLogger("kvtier.service")

RECLAIM_DEADLINE_S = 1.0  # grants and pins are reclaimed this soon after a session's stream ends

_GRANT = {"granted": node_pb2.GRANTED, "present": node_pb2.PRESENT, "no_space": node_pb2.NO_SPACE}
T = TypeVar("T")


def _handle_errors(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    op = fn.__name__.lower()

    @functools.wraps(fn)
    async def wrapper(self: NodeService, request: Any, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        try:
            reply = await fn(self, request, context)
        except StoreError as e:
            code, message = e.code, str(e)
        except LayoutError as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, f"bad layout: {e}"
        except grpc.aio.AbortError:
            self.latency.observe(op, time.perf_counter() - started)
            raise
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the daemon log"
        else:
            self.latency.observe(op, time.perf_counter() - started)
            return reply
        # counted before the abort: the client sees the status as soon as abort sends it
        self.store.counters[f"errors:{code.name}"] += 1
        self.latency.observe(op, time.perf_counter() - started)
        await context.abort(code, message)
        raise AssertionError("unreachable")
    return wrapper


class NodeService(node_pb2_grpc.NodeServicer):
    def __init__(self, store: BlockStore, node_id: str, epoch: int, key_table_path: str = "") -> None:
        self.store = store
        self.key_table_path = key_table_path
        self.node_id = node_id
        self.epoch = epoch
        self.started = time.monotonic()
        self.latency = OpLatency()  # every handler's time, by op (exported as kvtier_op_latency_seconds)

    @_handle_errors
    async def RegisterLayout(self, request: node_pb2.RegisterLayoutRequest, context: Any) -> node_pb2.RegisterLayoutReply:
        if not request.HasField("layout"):
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "RegisterLayout needs a layout")
        reg = await self.store.register_layout(layout_from_proto(request.layout))
        cls = self.store.host.size_class(reg.layout.slot_bytes)
        return node_pb2.RegisterLayoutReply(
            layout_id=reg.layout_id, fingerprint=reg.layout.fingerprint, block_bytes=reg.layout.block_bytes,
            slot_bytes=cls.slot_bytes, pool_path=cls.path, pool_bytes=cls.pool_bytes,
            key_table_path=self.key_table_path)

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Session stream starts with a hello message")
        sess = self.store.open_session(first.hello.client_name, first.hello.pid)
        log.info("session opened", extra={"session_id": sess.session_id, "client": sess.client_name,
                                          "pid": sess.pid})
        try:
            await context.write(node_pb2.SessionServerMessage(opened=node_pb2.SessionOpened(
                session_id=sess.session_id, node_id=self.node_id, epoch=self.epoch,
                reclaim_deadline_s=RECLAIM_DEADLINE_S)))
            while (await context.read()) is not grpc.aio.EOF:
                pass
        finally:
            grants, leases = self.store.close_session(sess.session_id)
            log.info("session closed", extra={"session_id": sess.session_id, "grants_reclaimed": grants,
                                              "leases_reclaimed": leases})

    @_handle_errors
    async def Allocate(self, request: node_pb2.AllocateRequest, context: Any) -> node_pb2.AllocateReply:
        keys = list(request.keys)
        out = await self.store.allocate(request.session_id, request.layout_id, keys, request.durable)
        reply = node_pb2.AllocateReply(grants=[node_pb2.Grant(status=_GRANT[s], grant_id=g, offset=o)
                                               for s, g, o in out])
        if request.durable:
            for grant, on_disk in zip(reply.grants, self.store.on_disk(request.layout_id, keys), strict=True):
                grant.durable = grant.status == node_pb2.PRESENT and on_disk
        return reply

    @_handle_errors
    async def Commit(self, request: node_pb2.CommitRequest, context: Any) -> node_pb2.CommitReply:
        committed, durable = await self.store.commit(request.session_id, list(request.grant_ids),
                                                     list(request.abort_grant_ids), request.durable)
        return node_pb2.CommitReply(committed=committed, durable=durable)

    @_handle_errors
    async def Acquire(self, request: node_pb2.AcquireRequest, context: Any) -> node_pb2.AcquireReply:
        out = await self.store.acquire(request.session_id, request.layout_id, list(request.keys))
        return node_pb2.AcquireReply(leases=[
            node_pb2.Lease(lease_id=lid, offset=off, found_in=TIER_BY_NAME[t] if t else node_pb2.TIER_NONE)
            for lid, off, t in out])

    @_handle_errors
    async def Release(self, request: node_pb2.ReleaseRequest, context: Any) -> node_pb2.ReleaseReply:
        self.store.release(request.session_id, list(request.lease_ids))
        return node_pb2.ReleaseReply()

    @_handle_errors
    async def Lookup(self, request: node_pb2.LookupRequest, context: Any) -> node_pb2.LookupReply:
        tiers = self.store.lookup(request.layout_id, list(request.keys))
        return node_pb2.LookupReply(tiers=[TIER_BY_NAME[t] if t else node_pb2.TIER_NONE for t in tiers])

    @_handle_errors
    async def ReportLookups(self, request: node_pb2.ReportLookupsRequest, context: Any) -> node_pb2.ReportLookupsReply:
        for c in request.layouts:  # every layout checked first: a bad report counts nothing
            self.store.layout(c.layout_id)
        for c in request.layouts:
            self.store.count_table_lookups(c.layout_id, {"gpu": c.hit_gpu, "host": c.hit_host, "disk": c.hit_disk},
                                           c.miss)
        return node_pb2.ReportLookupsReply()

    @_handle_errors
    async def Evict(self, request: node_pb2.EvictRequest, context: Any) -> node_pb2.EvictReply:
        return node_pb2.EvictReply(evicted=self.store.evict(request.layout_id, list(request.keys)))

    @_handle_errors
    async def Prefetch(self, request: node_pb2.PrefetchRequest, context: Any) -> node_pb2.PrefetchReply:
        promoted = await self.store.prefetch(request.layout_id, list(request.keys))
        return node_pb2.PrefetchReply(promoted=promoted)

    @_handle_errors
    async def Stats(self, request: node_pb2.StatsRequest, context: Any) -> node_pb2.StatsReply:
        return self.stats_message()

    def stats_message(self) -> node_pb2.StatsReply:
        store = self.store
        host = store.host
        reply = node_pb2.StatsReply(node_id=self.node_id, epoch=self.epoch,
                                    uptime_s=time.monotonic() - self.started,
                                    sessions=len(store.sessions), version=__version__)
        reply.tiers.add(tier=node_pb2.TIER_HOST, capacity_bytes=host.capacity, used_bytes=host.used_bytes,
                        blocks=len(host.entries))
        for tier in store.extra_tier_stats():
            reply.tiers.add(**tier)
        per_layout = store.blocks_per_layout()
        for lid, reg in store.layouts.items():
            counts = per_layout.get(reg.layout.fingerprint, {})
            reply.layouts.add(layout_id=lid, fingerprint=reg.layout.fingerprint,
                              block_bytes=reg.layout.block_bytes, host_blocks=counts.get("host", 0),
                              disk_blocks=counts.get("disk", 0))
        for name, value in store.counters.items():
            reply.counters[name] = int(value)
        return reply

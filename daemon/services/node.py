"""gRPC servicer of ``kvtier.v1.Node``: each handler turns its request into a store call and the
typed result into its reply (:mod:`kvtier.daemon.services.convert`). Errors and timing:
:mod:`kvtier.daemon.services.handlers`.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from kvtier.daemon.auth import Authenticator
from kvtier.daemon.errors import MAX_NAME_CHARS, Code, StoreError
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.services import convert
from kvtier.daemon.services.handlers import handled
from kvtier.daemon.stats import StatsSource
from kvtier.daemon.store import BlockStore
from kvtier.proto import node_pb2, node_pb2_grpc

log = logging.getLogger("kvtier.service")

RECLAIM_DEADLINE_S = 1.0  # grants and pins are reclaimed this soon after a session's stream ends


class NodeService(node_pb2_grpc.NodeServicer):
    def __init__(self, store: BlockStore, stats: StatsSource, latency: OpLatency, key_table_path: str = "",
                 auth: Authenticator | None = None) -> None:
        self.auth = auth or Authenticator()  # who is calling (kvtier.daemon.auth)
        self.store = store
        self.counters = store.counters
        self.stats = stats
        self.latency = latency  # every handler's time, by op (exported as kvtier_op_latency_seconds)
        self.key_table_path = key_table_path

    @handled
    async def RegisterLayout(self, request: node_pb2.RegisterLayoutRequest, context: Any) -> node_pb2.RegisterLayoutReply:
        if not request.HasField("layout"):
            raise StoreError(Code.INVALID_ARGUMENT, "RegisterLayout needs a layout")
        tenant = self.auth.principal(context).tenant
        reg = await self.store.register_layout(convert.layout_from_wire(request.layout), tenant)
        cls = self.store.pool(reg.layout)   # the tenant's own pool file
        return node_pb2.RegisterLayoutReply(
            layout_id=reg.layout_id, fingerprint=reg.wire_fingerprint, block_bytes=reg.layout.block_bytes,
            slot_bytes=cls.slot_bytes, pool_path=cls.path, pool_bytes=cls.pool_bytes,
            key_table_path=self.store.key_table_paths.get(tenant, ""), epoch=self.stats.epoch)

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Session stream starts with a hello message")
        if len(first.hello.client_name) > MAX_NAME_CHARS:  # bounded
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"client_name is {len(first.hello.client_name)} "
                                f"characters; the limit is {MAX_NAME_CHARS}")
        try:  # a session belongs to its caller (ids are capabilities: kvtier.daemon.sessions)
            sess = self.store.open_session(first.hello.client_name, first.hello.pid, self.auth.principal(context))
        except StoreError as e:  # over --max-sessions
            self.counters.refused(e.code)
            await context.abort(grpc.StatusCode[e.code.name], str(e))
        log.info("session opened", extra={"session_id": sess.session_id, "client": sess.client_name,
                                          "pid": sess.pid})
        try:
            await context.write(node_pb2.SessionServerMessage(opened=node_pb2.SessionOpened(
                session_id=sess.session_id, node_id=self.stats.node_id, epoch=self.stats.epoch,
                reclaim_deadline_s=RECLAIM_DEADLINE_S)))
            while (await context.read()) is not grpc.aio.EOF:
                pass
        finally:
            grants, leases = self.store.close_session(sess.session_id)
            log.info("session closed", extra={"session_id": sess.session_id, "grants_reclaimed": grants,
                                              "leases_reclaimed": leases})

    @handled
    async def Allocate(self, request: node_pb2.AllocateRequest, context: Any) -> node_pb2.AllocateReply:
        self.store.session(request.session_id, self.auth.principal(context))  # the caller's own, else refused
        grants = await self.store.allocate(request.session_id, request.layout_id, list(request.keys), request.durable)
        return convert.allocate_reply(grants)

    @handled
    async def Commit(self, request: node_pb2.CommitRequest, context: Any) -> node_pb2.CommitReply:
        self.store.session(request.session_id, self.auth.principal(context))
        done = await self.store.commit(request.session_id, list(request.grant_ids), list(request.abort_grant_ids),
                                       request.durable, list(request.checksums))
        return node_pb2.CommitReply(committed=done.committed, durable=done.durable)

    @handled
    async def Acquire(self, request: node_pb2.AcquireRequest, context: Any) -> node_pb2.AcquireReply:
        self.store.session(request.session_id, self.auth.principal(context))
        return convert.acquire_reply(await self.store.acquire(request.session_id, request.layout_id, list(request.keys),
                                                              request.verify))

    @handled
    async def Release(self, request: node_pb2.ReleaseRequest, context: Any) -> node_pb2.ReleaseReply:
        self.store.release(request.session_id, list(request.lease_ids), self.auth.principal(context))
        return node_pb2.ReleaseReply()

    @handled
    async def Lookup(self, request: node_pb2.LookupRequest, context: Any) -> node_pb2.LookupReply:
        tenant = self.auth.principal(context).tenant
        return convert.lookup_reply(self.store.lookup(request.layout_id, list(request.keys), tenant))

    @handled
    async def ReportLookups(self, request: node_pb2.ReportLookupsRequest, context: Any) -> node_pb2.ReportLookupsReply:
        tenant = self.auth.principal(context).tenant
        reports = convert.reported_lookups(request)  # bounded
        for layout_id, _, _ in reports:  # every layout checked first: a bad report counts nothing
            self.store.layout(layout_id, tenant)
        for layout_id, hits, miss in reports:
            self.store.count_table_lookups(layout_id, hits, miss, tenant)
        return node_pb2.ReportLookupsReply()

    @handled
    async def Evict(self, request: node_pb2.EvictRequest, context: Any) -> node_pb2.EvictReply:
        tenant = self.auth.principal(context).tenant
        return node_pb2.EvictReply(evicted=await self.store.evict_durably(request.layout_id, list(request.keys), tenant))

    @handled
    async def Prefetch(self, request: node_pb2.PrefetchRequest, context: Any) -> node_pb2.PrefetchReply:
        tenant = self.auth.principal(context).tenant
        if len(request.from_node) > MAX_NAME_CHARS:  # bounded
            raise StoreError(Code.INVALID_ARGUMENT, f"from_node is {len(request.from_node)} characters; the limit "
                                                    f"is {MAX_NAME_CHARS}")
        return node_pb2.PrefetchReply(promoted=await self.store.prefetch(request.layout_id, list(request.keys), tenant,
                                                                         request.from_node))

    @handled
    async def Retain(self, request: node_pb2.RetainRequest, context: Any) -> node_pb2.RetainReply:
        tenant = self.auth.principal(context).tenant  # a tenant retains its own blocks only
        r = self.store.retain(request.layout_id, list(request.keys), request.ttl_s, request.priority, tenant)
        return node_pb2.RetainReply(retained=r.retained, held=r.held, released=r.released,
                                    retained_bytes=r.retained_bytes, budget_bytes=r.budget_bytes)

    @handled
    async def Stats(self, request: node_pb2.StatsRequest, context: Any) -> node_pb2.StatsReply:
        # the caller's tenant's layouts; node-wide counters, tiers and sessions for the operator
        # only, every other tenant its own (kvtier.daemon.stats)
        p = self.auth.principal(context)
        if self.auth.is_operator(p):
            return convert.stats_reply(self.stats.snapshot(p.tenant))
        return convert.stats_reply(self.stats.tenant_snapshot(p.tenant))

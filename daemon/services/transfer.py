"""gRPC servicer of ``kvtier.v1.Transfer``: engine KV registrations and their copies, served by
:class:`~kvtier.daemon.gpu.Transfers`. Errors and timing: :mod:`kvtier.daemon.services.handlers`
(the handlers share the Node service's latency histograms: ``kvtier_op_latency_seconds{op="offload"}``).
"""

from __future__ import annotations

from typing import Any

from kvtier.daemon.auth import Authenticator
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.gpu import Transfers
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.services import convert
from kvtier.daemon.services.handlers import handled
from kvtier.proto import transfer_pb2, transfer_pb2_grpc


class TransferService(transfer_pb2_grpc.TransferServicer):
    def __init__(self, transfers: Transfers, latency: OpLatency, auth: Authenticator | None = None) -> None:
        self.auth = auth or Authenticator()  # who is calling (kvtier.daemon.auth)
        self.transfers = transfers
        self.counters = transfers.counters
        self.latency = latency

    @handled
    async def RegisterKV(self, request: transfer_pb2.RegisterKVRequest, context: Any) -> transfer_pb2.RegisterKVReply:
        self.transfers.store.session(request.session_id)  # an unknown session is the first thing to say
        if not request.HasField("layout"):
            raise StoreError(Code.INVALID_ARGUMENT, "RegisterKV needs the KV layout")
        done = await self.transfers.register(convert.kv_registration(request))
        return transfer_pb2.RegisterKVReply(registration_id=done.registration_id, layout_id=done.layout_id,
                                            copy_engine=done.copy_engine, block_bytes=done.block_bytes)

    @handled
    async def UnregisterKV(self, request: transfer_pb2.UnregisterKVRequest, context: Any) -> transfer_pb2.UnregisterKVReply:
        await self.transfers.unregister(request.session_id, request.registration_id)
        return transfer_pb2.UnregisterKVReply()

    @handled
    async def Offload(self, request: transfer_pb2.TransferRequest, context: Any) -> transfer_pb2.TransferReply:
        return convert.transfer_reply(await self.transfers.offload(convert.transfer_order(request)))

    @handled
    async def Onboard(self, request: transfer_pb2.TransferRequest, context: Any) -> transfer_pb2.TransferReply:
        return convert.transfer_reply(await self.transfers.onboard(convert.transfer_order(request)))

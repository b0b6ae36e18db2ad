"""gRPC servicer of ``kvtier.v1.Transfer``: engine KV registrations and their copies, served by
:class:`~kvtier.daemon.gpu.Transfers`. Errors and timing: :mod:`kvtier.daemon.services.handlers`
(the handlers share the Node service's latency histograms: ``kvtier_op_latency_seconds{op="offload"}``).

Every request names a session, which must be the caller's own (PERMISSION_DENIED otherwise,
:mod:`kvtier.daemon.sessions`). Host-memory registrations bring their memory as file
descriptors the engine passed over the unix socket (``fd_handle``, ``event_ring_fd_handle``;
the authenticator hands them over with ``take_fd``); a path is refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvtier.daemon.auth import Authenticator, Principal
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.gpu import KVRegistration, Transfers
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
        principal = self.auth.principal(context)
        self.transfers.store.session(request.session_id, principal)  # an unknown or foreign session comes first
        if not request.HasField("layout"):
            raise StoreError(Code.INVALID_ARGUMENT, "RegisterKV needs the KV layout")
        want = convert.kv_registration(request)
        engine = self.transfers.check_memory(want)  # a path is refused before anything is taken
        fds: list[int] = []
        try:
            if engine.backend == "host":
                want = self._with_fds(want, request, principal, fds)
            done = await self.transfers.register(want, principal)
        finally:  # the copy engine maps what it keeps (a mapping holds its own reference)
            for fd in fds:
                os.close(fd)
        return transfer_pb2.RegisterKVReply(registration_id=done.registration_id, layout_id=done.layout_id,
                                            copy_engine=done.copy_engine, block_bytes=done.block_bytes)

    def _with_fds(self, want: KVRegistration, request: transfer_pb2.RegisterKVRequest, principal: Principal,
                  fds: list[int]) -> KVRegistration:
        """``want`` with the descriptors the caller passed for its memory and its event ring
        (each taken into ``fds``, which the caller closes)."""
        take = getattr(self.auth, "take_fd", None)
        if take is None:
            raise StoreError(Code.FAILED_PRECONDITION,
                             "this kvtierd cannot receive file descriptors, so it cannot map host-memory KV: "
                             "run a kvtierd with descriptor passing on its unix socket")

        def taken(handle: str, what: str) -> int:
            if not handle:
                raise StoreError(Code.INVALID_ARGUMENT,
                                 f"{what} has no fd_handle: pass its memory (a memfd sealed with F_SEAL_SHRINK) "
                                 f"over the unix socket and name the handle you were given")
            fds.append(take(principal, handle))
            return fds[-1]

        allocations = [dataclasses.replace(ref, fd=taken(a.fd_handle, f"allocation {i}"))
                       for i, (ref, a) in enumerate(zip(want.allocations, request.allocations, strict=True))]
        ring_fd = taken(request.event_ring_fd_handle, "the event ring")
        return dataclasses.replace(want, allocations=allocations, event_ring_fd=ring_fd)

    @handled
    async def UnregisterKV(self, request: transfer_pb2.UnregisterKVRequest, context: Any) -> transfer_pb2.UnregisterKVReply:
        self.transfers.store.session(request.session_id, self.auth.principal(context))
        await self.transfers.unregister(request.session_id, request.registration_id)
        return transfer_pb2.UnregisterKVReply()

    @handled
    async def Offload(self, request: transfer_pb2.TransferRequest, context: Any) -> transfer_pb2.TransferReply:
        self.transfers.store.session(request.session_id, self.auth.principal(context))
        return convert.transfer_reply(await self.transfers.offload(convert.transfer_order(request)))

    @handled
    async def Onboard(self, request: transfer_pb2.TransferRequest, context: Any) -> transfer_pb2.TransferReply:
        self.transfers.store.session(request.session_id, self.auth.principal(context))
        return convert.transfer_reply(await self.transfers.onboard(convert.transfer_order(request)))

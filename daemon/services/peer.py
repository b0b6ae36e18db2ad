"""``kvtier.v1.Peer``: this daemon's blocks for other daemons, and its calls to theirs.

:class:`PeerService` is served on the ``--tcp`` listener with ``--peer-serve``. The caller is
another daemon authenticated by its client certificate (mutual TLS); it is served only the
tenant its certificate names (:meth:`PeerAuthenticator.tcp_principal
<kvtier.daemon.auth.PeerAuthenticator.tcp_principal>`), and a request naming another tenant is
refused PERMISSION_DENIED. Blocks are found under the tenant fingerprint of the layout's own
fingerprint (layout ids are per daemon; fingerprints are the same everywhere), in host or on
disk, read with :meth:`Placement.payloads <kvtier.daemon.placement.Placement.payloads>`
(verified copies) one window of ``--peer-window-bytes`` at a time and streamed in chunks of
at most the requested size; gRPC's flow control holds the reader back when the caller is
slower, so a fetch never holds more than a window and what the transport buffers.

:class:`PeerClient` is the calling side (:class:`kvtier.daemon.peers.PeerWire`): one channel
per (peer address, client certificate), TLS with the daemon's peer certificate (the tenant's
own from ``--peer-tenant-certs``, else ``--peer-tls-cert``), each reply awaited at most
``--peer-timeout-s``; chunks reassembled into whole blocks, in order, or the stream is refused
as a protocol error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from kvtier.daemon.auth import Authenticator
from kvtier.daemon.config import PEER_CHUNK_BYTES, PEER_WINDOW_BYTES
from kvtier.daemon.counters import Count
from kvtier.daemon.errors import Code, StoreError, check_keys
from kvtier.daemon.layouts import tenant_fingerprint
from kvtier.daemon.metrics import OpLatency
from kvtier.daemon.peers import (
    Block,
    Hello,
    Missing,
    PeerError,
    PeerProtocolError,
    PeerRefused,
    PeerState,
    PeerTimeout,
    PeerUnavailable,
)
from kvtier.daemon.services.handlers import handled, handled_writer
from kvtier.daemon.store import BlockStore
from kvtier.proto import locations_pb2, locations_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvtier.tiers.vocab import FP_BYTES, Tier, pack_block

log = logging.getLogger("kvtier.peer")

DEFAULT_CHUNK_BYTES = PEER_CHUNK_BYTES
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 4 * 1024**2
MAX_BLOCK_BYTES = 1 << 31
#: gRPC message limit of peer channels: a chunk and its envelope
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * 1024
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
                   # the daemon backs off a peer itself (kvtier.daemon.peers); a channel that
                   # waited out gRPC's own reconnect backoff (up to 2 min) would fail calls fast
                   # long after the peer came back
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class PeerService(peer_pb2_grpc.PeerServicer):
    """See the module docstring."""

    def __init__(self, store: BlockStore, node_id: str, epoch: int, latency: OpLatency,
                 auth: Authenticator | None = None, window_bytes: int = PEER_WINDOW_BYTES, delay_s: float = 0.0) -> None:
        self.store = store
        self.counters = store.counters
        self.node_id = node_id
        self.epoch = epoch
        self.latency = latency
        self.auth = auth or Authenticator()
        self.window_bytes = window_bytes
        self.delay_s = delay_s  # --peer-serve-delay-s (tests: a slow link)

    def _tenant(self, asked: str, context: Any) -> str:
        tenant = self.auth.principal(context).tenant
        if asked and asked != tenant:
            raise StoreError(Code.PERMISSION_DENIED, f"this certificate is served as tenant {tenant!r}, not "
                                                     f"{asked!r} (the serving daemon's --tenants cn:NAME=TENANT)")
        return tenant

    def _fingerprint(self, fingerprint: bytes) -> None:
        if len(fingerprint) != FP_BYTES:
            raise StoreError(Code.INVALID_ARGUMENT, f"fingerprint is {len(fingerprint)} bytes; a layout's "
                                                    f"fingerprint is {FP_BYTES}")

    def _served(self, tenant: str, fingerprint: bytes) -> bytes | None:
        """The stored fingerprint of the caller's tenant's layout ``fingerprint`` (its wire
        fingerprint), or None unless that tenant registered the layout on this daemon. The
        default tenant's stored fingerprint is the wire one, and any tenant's is computable:
        without this a ``default`` peer could name another tenant's stored fingerprint and be
        served that tenant's blocks."""
        fp = tenant_fingerprint(tenant, fingerprint)
        reg = self.store.layouts.find(fp)
        return fp if reg is not None and reg.layout.tenant == tenant else None

    @handled
    async def Holds(self, request: peer_pb2.HoldsRequest, context: Any) -> peer_pb2.HoldsReply:
        tenant = self._tenant(request.tenant, context)
        self._fingerprint(request.fingerprint)
        check_keys(request.keys, self.store.max_batch_keys, unique=False)
        fp = self._served(tenant, request.fingerprint)
        if fp is None:  # not this tenant's layout here: held nowhere, as far as the caller may know
            return peer_pb2.HoldsReply(tiers=[0] * len(request.keys))
        tiers = self.store.tiers
        out = []
        for k in request.keys:
            b = pack_block(fp, k)
            out.append(Tier.HOST.value if tiers.in_host(b) else Tier.DISK.value if tiers.on_disk(b) else 0)
        return peer_pb2.HoldsReply(tiers=out)

    @handled_writer
    async def FetchBlocks(self, request: peer_pb2.FetchBlocksRequest, context: Any) -> None:
        tenant = self._tenant(request.tenant, context)
        self._fingerprint(request.fingerprint)
        keys = list(request.keys)
        check_keys(keys, self.store.max_batch_keys, unique=False)
        block_bytes = request.block_bytes
        if not 0 < block_bytes <= MAX_BLOCK_BYTES:
            raise StoreError(Code.INVALID_ARGUMENT, f"block_bytes {block_bytes} is not between 1 and {MAX_BLOCK_BYTES}")
        chunk = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
            raise StoreError(Code.INVALID_ARGUMENT, f"chunk_bytes {chunk} is not between {MIN_CHUNK_BYTES} and "
                                                    f"{MAX_CHUNK_BYTES}")
        fp = self._served(tenant, request.fingerprint)
        bkeys = [pack_block(fp, k) for k in keys] if fp is not None else []
        await context.write(peer_pb2.FetchBlocksReply(hello=peer_pb2.PeerHello(
            node_id=self.node_id, epoch=self.epoch, tenant=tenant)))
        if fp is None:  # not this tenant's layout here: every key missing, as for keys not held
            await context.write(peer_pb2.FetchBlocksReply(missing=peer_pb2.Missing(index=range(len(keys)))))
            return
        # half a window read while the other half is sent: at most a window of payloads in memory
        half = max(1, self.window_bytes // 2 // block_bytes)
        starts = range(0, len(bkeys), half)
        reading: asyncio.Future | None = None
        # not hashed here: each chunk carries the checksum taken at the block's commit, and the
        # fetching daemon verifies every block against it before it is visible (ingest)
        tiers = self.store.tiers
        try:
            for start in starts:
                if reading is None:
                    reading = asyncio.ensure_future(tiers.payloads(bkeys[start:start + half], verify=False))
                got = await reading
                nxt = start + half
                reading = asyncio.ensure_future(tiers.payloads(bkeys[nxt:nxt + half], verify=False)) \
                    if nxt < len(bkeys) else None
                await self._send_window(context, bkeys, got, start, min(len(bkeys), nxt), block_bytes, chunk)
        except asyncio.CancelledError:  # the caller went away (or the daemon stops)
            self.counters.add(Count.PEER_SERVE_ABORTED)
            raise
        finally:
            if reading is not None:
                await asyncio.gather(reading, return_exceptions=True)  # its pins are let go

    async def _send_window(self, context: Any, bkeys: list[bytes], got: dict[bytes, tuple[bytes, int]], start: int,
                           end: int, block_bytes: int, chunk: int) -> None:
        missing = [i for i in range(start, end)
                   if (p := got.get(bkeys[i])) is None or len(p[0]) != block_bytes]
        if missing:
            await context.write(peer_pb2.FetchBlocksReply(missing=peer_pb2.Missing(index=missing)))
        for i in range(start, end):
            p = got.pop(bkeys[i], None)
            if p is None or len(p[0]) != block_bytes:
                continue
            payload, xxh3 = p
            view = memoryview(payload)
            for off in range(0, block_bytes, chunk):
                await context.write(peer_pb2.FetchBlocksReply(chunk=peer_pb2.BlockChunk(
                    index=i, offset=off, data=bytes(view[off:off + chunk]) if block_bytes > chunk else payload,
                    xxh3=xxh3)))
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            self.counters.add(Count.PEER_BLOCKS_SERVED)
            self.counters.add(Count.PEER_BYTES_SERVED, block_bytes)


# -- the calling side ------------------------------------------------------------------------------

_REFUSALS = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
             grpc.StatusCode.NOT_FOUND}


def _error(e: grpc.RpcError, what: str, partial: bool = False) -> PeerError:
    code = e.code() if hasattr(e, "code") else None
    msg = f"{what}: {code.name if code else 'error'}: {e.details() if hasattr(e, 'details') else e}"
    if code in _REFUSALS:
        return PeerRefused(msg, partial)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerTimeout(msg, partial)
    return PeerUnavailable(msg, partial)


class PeerClient:
    """See the module docstring. ``credentials``: tenant -> channel credentials, ``""`` the
    default; None: plaintext (``--insecure-tcp``)."""

    def __init__(self, credentials: Mapping[str, grpc.ChannelCredentials] | None, timeout_s: float = 5.0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.credentials = dict(credentials) if credentials is not None else None
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _channel(self, peer: PeerState, tenant: str = "") -> grpc.aio.Channel:
        who = tenant if self.credentials is not None and tenant in self.credentials else ""
        ch = self._channels.get((peer.address, who))
        if ch is None:
            opts = list(CHANNEL_OPTIONS)
            if self.credentials is None:
                ch = grpc.aio.insecure_channel(peer.address, options=opts)
            else:
                if peer.server_name:
                    opts.append(("grpc.ssl_target_name_override", peer.server_name))
                ch = grpc.aio.secure_channel(peer.address, self.credentials[who], options=opts)
            self._channels[(peer.address, who)] = ch
        return ch

    async def node_info(self, peer: PeerState) -> tuple[str, int]:
        stub = locations_pb2_grpc.LocationsStub(self._channel(peer))
        try:
            info = await stub.GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=self.timeout_s,
                                          wait_for_ready=False)
        except grpc.RpcError as e:
            raise await self._failed(peer, _error(e, f"GetNodeInfo of {peer.address}")) from None
        return info.node_id, info.epoch

    async def holds(self, peer: PeerState, tenant: str, fingerprint: bytes, keys: Sequence[bytes]) -> list[int]:
        stub = peer_pb2_grpc.PeerStub(self._channel(peer, tenant))
        try:
            reply = await stub.Holds(peer_pb2.HoldsRequest(fingerprint=fingerprint, keys=keys, tenant=tenant),
                                     timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise await self._failed(peer, _error(e, f"Holds of {peer.address}")) from None
        return list(reply.tiers)

    async def fetch(self, peer: PeerState, tenant: str, fingerprint: bytes, block_bytes: int,
                    keys: Sequence[bytes]) -> AsyncIterator[Hello | Block | Missing]:
        stub = peer_pb2_grpc.PeerStub(self._channel(peer, tenant))
        call = stub.FetchBlocks(peer_pb2.FetchBlocksRequest(fingerprint=fingerprint, block_bytes=block_bytes,
                                                            keys=keys, tenant=tenant, chunk_bytes=self.chunk_bytes))
        parts: list[bytes] = []
        index = -1
        filled = 0
        chunk = self.chunk_bytes or DEFAULT_CHUNK_BYTES  # every chunk is this, a block's last the rest
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(call.read(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise await self._failed(peer, PeerTimeout(f"FetchBlocks of {peer.address}: no reply within "
                                                               f"{self.timeout_s} s", partial=bool(parts))) from None
                except grpc.RpcError as e:
                    raise await self._failed(peer, _error(e, f"FetchBlocks of {peer.address}",
                                                          partial=bool(parts))) from None
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("msg")
                if kind == "chunk":
                    c = msg.chunk
                    if (c.offset == 0) == bool(parts) or (parts and c.index != index) or c.offset != filled \
                            or len(c.data) != min(chunk, block_bytes - filled):
                        raise PeerProtocolError(f"FetchBlocks of {peer.address}: chunk of block {c.index} at "
                                                f"{c.offset} (+{len(c.data)} B) out of order", partial=bool(parts))
                    index = c.index
                    parts.append(c.data)
                    filled += len(c.data)
                    if filled == block_bytes:
                        yield Block(index, parts[0] if len(parts) == 1 else b"".join(parts), c.xxh3)
                        parts, filled = [], 0
                elif kind == "hello":  # (how many, and in what order: Peers' _StreamOrder)
                    yield Hello(msg.hello.node_id, msg.hello.epoch, msg.hello.tenant)
                elif kind == "missing":
                    yield Missing(list(msg.missing.index))
                else:  # an empty reply (a stream of them would never end)
                    raise PeerProtocolError(f"FetchBlocks of {peer.address}: an empty reply", partial=bool(parts))
            if parts:
                raise PeerProtocolError(f"FetchBlocks of {peer.address}: the stream ended inside block {index}",
                                        partial=True)
        finally:
            call.cancel()

    async def _failed(self, peer: PeerState, e: PeerError) -> PeerError:
        """A call failed with ``e``: a peer that is not answering loses its channels, so the next
        call connects afresh (not after gRPC's own reconnect backoff)."""
        if e.down:
            await self.drop(peer)
        return e

    async def drop(self, peer: PeerState) -> None:
        for key in [k for k in self._channels if k[0] == peer.address]:
            with contextlib.suppress(Exception):
                await self._channels.pop(key).close()

    async def close(self) -> None:
        chans = list(self._channels.values())
        self._channels.clear()
        for ch in chans:
            with contextlib.suppress(Exception):
                await ch.close()


def add_peer_service(server: grpc.aio.Server, peer: PeerService) -> None:
    peer_pb2_grpc.add_PeerServicer_to_server(peer, server)

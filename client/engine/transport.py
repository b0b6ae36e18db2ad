"""How the engine library reaches its node's kvtierd: one transport for both sidecars and the KV connector.

A transport holds what a client needs to talk to one daemon: where it is
(:class:`~kvtier.client.engine.endpoint.Endpoint`), who is calling
(:class:`~kvtier.client.engine.auth.Identity`), the channel, and the session stream
(:mod:`kvtier.client.engine.session`). It has one typed method per RPC the engine library
calls (:meth:`_Transport.allocate`, :meth:`_Transport.commit`, :meth:`_Transport.acquire`, ...),
each calling its stub's method (``NodeStub.Allocate``, ...), so that a call can be followed
from the client's operation (``Sidecar.put``) to the RPC it sends.

**One code path, blocking or awaited.** A sidecar operation (a put: Allocate, copy, Commit;
restart recovery around it) is written once, as a coroutine calling the typed methods, and
serves both clients. The asyncio transport (:class:`AsyncTransport`) awaits the aio stubs; the
blocking one (:class:`Transport`) calls the blocking stubs inside the same ``async def``
methods, which therefore never suspend: :meth:`Transport.run` completes such a coroutine with
a single ``send``, on the caller's thread, with no event loop. That is the only difference
between the blocking and the asyncio clients; anything that would suspend on the blocking
transport is a bug (``run`` raises ``RuntimeError``).

What the operations use beside the plain calls (each a method here, on both transports):

* ``start_allocate`` / ``start_commit`` / ``start_acquire``: send now, without waiting; the
  :class:`Pending` call's reply is :meth:`_Transport.reply` (a big put or get overlaps its
  calls with its copies this way);
* :meth:`_Transport.release_later`: send a Release without waiting; the next
  :meth:`_Transport.settle` waits for it and raises its error, unless the session it named is
  gone (its pins went with it). :meth:`_Transport.report_lookups_later`: sent, its outcome ignored;
* :meth:`_Transport.open_session`: the session id, opening the stream if none is open;
* :meth:`_Transport.locked`: the transport's lock (which opening the session takes too: code
  holding it must not open the session);
* :meth:`_Transport.restarted`: whether a FAILED_PRECONDITION or UNAVAILABLE answer means the
  daemon restarted (the session is gone) or is a refusal by the daemon the session lives on.

Every call goes through two seams, one per way of sending: ``_unary(call)`` (send and wait) and
``_start(call)`` (send now; a handle), where a :class:`Call` names the stub's method, its
request, and the RPC's name. A failed call raises :class:`KvtierError` (:meth:`_Transport.error`:
an absent daemon is named, at its socket); a call refused UNAUTHENTICATED (a restarted daemon
knows no old token) is sent again once the hand-shake is renewed.

The KV connector is blocking only: it runs the typed methods with :meth:`Transport.run`, and
sends its Offload and Onboard as gRPC futures (:meth:`Transport.offload_future`,
:meth:`Transport.onboard_future`) that its transfers poll.

The rest of the engine library's plumbing lives by role, and every name is importable from here
too: where the daemon is (:mod:`~kvtier.client.engine.endpoint`: :func:`resolve_target`,
:func:`socket_path`, :class:`Endpoint`), the errors (:mod:`~kvtier.client.engine.errors`:
:class:`KvtierError` and its subclasses), who is calling (:mod:`~kvtier.client.engine.auth`:
:class:`Identity`, :class:`ClientTls`, token interceptors, :func:`open_channel`), and the
session stream (:mod:`~kvtier.client.engine.session`).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier.client.engine.auth import (
    ClientTls,
    Identity,
    TokenInterceptor,
    async_token_interceptors,
    handshake_error,
    open_channel,
)
from kvtier.client.engine.endpoint import (
    CHANNEL_OPTIONS,
    UNIX_CHANNEL_OPTIONS,
    Endpoint,
    default_client_name,
    probe_socket,
    resolve_target,
    socket_path,
    unix_socket,
)
from kvtier.client.engine.errors import (
    GONE_CODES,
    RESTART_CODES,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    rpc_error,
)
from kvtier.client.engine.session import AsyncSessionStream, SessionStream, _Session
from kvtier.paths import SOCKET_ENV
from kvtier.proto import (
    locations_pb2,
    locations_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

__all__ = [
    "CHANNEL_OPTIONS", "RESTART_CODES", "SOCKET_ENV", "UNIX_CHANNEL_OPTIONS", "AsyncSessionStream", "AsyncTransport",
    "Call", "ClientTls", "DeadlineExceeded", "Endpoint", "FailedPrecondition", "Identity", "InvalidArgument",
    "KvtierError", "Pending", "PermissionDenied", "ResourceExhausted", "SessionStream", "TokenInterceptor",
    "Transport", "Unauthenticated", "Unavailable", "async_token_interceptors", "default_client_name",
    "handshake_error", "open_channel", "probe_socket", "resolve_target", "rpc_error", "socket_path", "unix_socket",
]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Call:
    """One unary RPC as a transport sends it: ``rpc`` is the stub's method (``NodeStub.Allocate``
    of the transport's channel), ``method`` the RPC's name (it names the call to whoever
    watches the seams; nothing dispatches on it); ``timeout`` None: the transport's."""

    method: str
    rpc: Any
    request: Message
    timeout: float | None = None
    wait_for_ready: bool = False


class Pending(Generic[R]):
    """A call sent without waiting for its reply (``start_*``); :meth:`_Transport.reply` waits for
    it. Wait for each: an abandoned call is cancelled when its handle goes."""

    __slots__ = ("call", "handle")

    def __init__(self, call: Call, handle: Any) -> None:
        self.call = call
        self.handle = handle


class _Held:
    """``async with``: hold a thread lock (the blocking transport's; never suspends)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class _Transport:
    """What both transports share: the target, the identity, the stubs, and the typed RPCs.

    The seams (``_unary``, ``_start``, ``_wait``, ``_reply``) and :meth:`open_session` are
    coroutines in both transports; the blocking one's never suspend (module docstring)."""

    session: SessionStream | AsyncSessionStream

    def __init__(self, path: str | None, target: str | None, client_name: str | None, timeout: float,
                 tls: ClientTls | None) -> None:
        self.endpoint = Endpoint(path, target)
        # over TCP: TLS with this client certificate (given, else $KVTIER_TLS_CERT/_KEY/_CA), else plaintext
        self.tls = (tls or ClientTls.from_env()) if self.endpoint.socket is None else None
        self.target = self.endpoint.target
        self.client_name = client_name or default_client_name()
        self.timeout = timeout
        self.identity = Identity(self.endpoint, self.client_name, timeout)
        self._options = CHANNEL_OPTIONS + (UNIX_CHANNEL_OPTIONS if self.endpoint.socket is not None else [])
        self._deferred: collections.deque = collections.deque()  # sent by release_later: settle() waits for them
        self._background: set = set()  # the others, referenced until done (gRPC cancels a dropped call)

    def _bind(self, channel: Any, calls: Any) -> None:
        """``channel``: for whoever speaks the protocol directly (its stubs ``node``, ``locations``,
        ``transfer``); ``calls``: the channel the typed methods call on."""
        self.channel = channel
        self.node = node_pb2_grpc.NodeStub(channel)
        self.locations = locations_pb2_grpc.LocationsStub(channel)
        self.transfer = transfer_pb2_grpc.TransferStub(channel)
        self._node = node_pb2_grpc.NodeStub(calls)
        self._locations = locations_pb2_grpc.LocationsStub(calls)
        self._transfer = transfer_pb2_grpc.TransferStub(calls)

    # -- the daemon's RPCs, one typed method each -----------------------------------------------

    async def register_layout(self, request: node_pb2.RegisterLayoutRequest, *,
                              wait_for_ready: bool = False) -> node_pb2.RegisterLayoutReply:
        """``Node.RegisterLayout``: the layout's id, its pool file and key table."""
        return await self._call(Call("RegisterLayout", self._node.RegisterLayout, request,
                                     wait_for_ready=wait_for_ready))

    async def allocate(self, request: node_pb2.AllocateRequest) -> node_pb2.AllocateReply:
        """``Node.Allocate``: a slot granted per key not yet held, under the session."""
        return await self._call(Call("Allocate", self._node.Allocate, request))

    def start_allocate(self, request: node_pb2.AllocateRequest) -> Pending[node_pb2.AllocateReply]:
        """:meth:`allocate`, sent now; its reply is :meth:`reply`'s."""
        return self._send(Call("Allocate", self._node.Allocate, request))

    async def commit(self, request: node_pb2.CommitRequest) -> node_pb2.CommitReply:
        """``Node.Commit``: publish the granted slots written (or abort grants)."""
        return await self._call(Call("Commit", self._node.Commit, request))

    def start_commit(self, request: node_pb2.CommitRequest) -> Pending[node_pb2.CommitReply]:
        """:meth:`commit`, sent now; its reply is :meth:`reply`'s."""
        return self._send(Call("Commit", self._node.Commit, request))

    async def acquire(self, request: node_pb2.AcquireRequest) -> node_pb2.AcquireReply:
        """``Node.Acquire``: pin the slots of the keys held, under the session."""
        return await self._call(Call("Acquire", self._node.Acquire, request))

    def start_acquire(self, request: node_pb2.AcquireRequest) -> Pending[node_pb2.AcquireReply]:
        """:meth:`acquire`, sent now; its reply is :meth:`reply`'s."""
        return self._send(Call("Acquire", self._node.Acquire, request))

    def release_later(self, request: node_pb2.ReleaseRequest) -> None:
        """``Node.Release``, sent without waiting: the next :meth:`settle` waits for it and raises
        its error (none when the session it named is gone: its pins went with it)."""
        self._deferred.append(self._start(Call("Release", self._node.Release, request)))

    async def lookup(self, request: node_pb2.LookupRequest) -> node_pb2.LookupReply:
        """``Node.Lookup``: the fastest tier holding each key."""
        return await self._call(Call("Lookup", self._node.Lookup, request))

    async def evict(self, request: node_pb2.EvictRequest) -> node_pb2.EvictReply:
        """``Node.Evict``: drop the keys from every tier."""
        return await self._call(Call("Evict", self._node.Evict, request))

    async def prefetch(self, request: node_pb2.PrefetchRequest) -> node_pb2.PrefetchReply:
        """``Node.Prefetch``: bring the keys to the host tier (from disk, or a peer)."""
        return await self._call(Call("Prefetch", self._node.Prefetch, request))

    async def retain(self, request: node_pb2.RetainRequest) -> node_pb2.RetainReply:
        """``Node.Retain``: keep the keys' blocks through eviction pressure until a TTL."""
        return await self._call(Call("Retain", self._node.Retain, request))

    async def stats(self, request: node_pb2.StatsRequest | None = None, *,
                    wait_for_ready: bool = False) -> node_pb2.StatsReply:
        """``Node.Stats``: the daemon's node, epoch, sessions, tiers, layouts and counters."""
        return await self._call(Call("Stats", self._node.Stats, request or node_pb2.StatsRequest(),
                                     wait_for_ready=wait_for_ready))

    async def report_lookups(self, request: node_pb2.ReportLookupsRequest, *,
                             timeout: float | None = None) -> node_pb2.ReportLookupsReply:
        """``Node.ReportLookups``: key table lookups, for the daemon's counters."""
        return await self._call(Call("ReportLookups", self._node.ReportLookups, request, timeout=timeout))

    def report_lookups_later(self, request: node_pb2.ReportLookupsRequest, *, timeout: float | None = None) -> None:
        """:meth:`report_lookups`, sent without waiting; its outcome is ignored."""
        handle = self._start(Call("ReportLookups", self._node.ReportLookups, request, timeout=timeout))
        self._background.add(handle)
        handle.add_done_callback(self._forget)

    async def report_device_blocks(self, request: locations_pb2.ReportDeviceBlocksRequest
                                   ) -> locations_pb2.ReportDeviceBlocksReply:
        """``Locations.ReportDeviceBlocks``: the blocks the engine itself holds in GPU memory."""
        return await self._call(Call("ReportDeviceBlocks", self._locations.ReportDeviceBlocks, request))

    async def register_kv(self, request: transfer_pb2.RegisterKVRequest, *, timeout: float | None = None,
                          wait_for_ready: bool = False) -> transfer_pb2.RegisterKVReply:
        """``Transfer.RegisterKV``: the engine's KV memory and its event ring, under the session."""
        return await self._call(Call("RegisterKV", self._transfer.RegisterKV, request, timeout=timeout,
                                     wait_for_ready=wait_for_ready))

    async def unregister_kv(self, request: transfer_pb2.UnregisterKVRequest) -> transfer_pb2.UnregisterKVReply:
        """``Transfer.UnregisterKV``: close a registration (after its copies)."""
        return await self._call(Call("UnregisterKV", self._transfer.UnregisterKV, request))

    # -- what operations use beside the calls -----------------------------------------------------

    async def reply(self, pending: Pending[R]) -> R:
        """The reply of a call sent by a ``start_*`` method (or its error)."""
        try:
            return await self._reply_of(pending.call, pending.handle)
        except grpc.RpcError as e:
            raise self.error(e) from None

    async def settle(self) -> None:
        """Wait for the calls :meth:`release_later` sent, raising the first error that is not the
        session being gone (its pins went with it)."""
        while self._deferred:
            handle = self._deferred.popleft()
            try:
                await self._wait(handle)
            except grpc.RpcError as e:
                if e.code() not in GONE_CODES:
                    raise self.error(e) from None

    async def restarted(self, error: KvtierError, session: _Session | None = None) -> bool:
        """Whether a FAILED_PRECONDITION or UNAVAILABLE answer means the session (default: this
        transport's) is gone with the daemon it lived on (UNAVAILABLE; its stream ended; the
        daemon answers with another epoch). A FAILED_PRECONDITION from the daemon the session
        still lives on is a refusal: the session is kept (dropping it would take the grants and
        pins other threads hold)."""
        session = self.session if session is None else session
        if error.code != grpc.StatusCode.FAILED_PRECONDITION or not session.epoch or not session.alive:
            return True
        try:
            reply = await self.stats()
        except KvtierError:
            return True
        return reply.epoch != session.epoch

    async def open_session(self) -> int:
        """The session id, opening the stream first if none is open."""
        raise NotImplementedError

    def locked(self) -> Any:
        """``async with transport.locked():`` the transport's lock (opening the session takes it
        too: code holding it must not open the session)."""
        raise NotImplementedError

    # -- identity -------------------------------------------------------------------------------

    @property
    def tenant(self) -> str:
        """The tenant the daemon knows this client as ("" over TCP: the certificate says)."""
        return self.identity.tenant

    @property
    def key_salt(self) -> str:
        """The daemon's key salt for this client's tenant ("" over TCP)."""
        return self.identity.key_salt

    def pass_fds(self, fds: Sequence[int]) -> list[str]:
        """Hand the daemon file descriptors over the credential connection; their handles."""
        return self.identity.pass_fds(fds)

    @property
    def local(self) -> bool:
        """A local daemon (unix socket): its files come as descriptors (:meth:`open_file`)."""
        return self.identity.credentials is not None

    def open_file(self, path: str) -> int:
        """A descriptor of one of this client's tenant's files that the daemon named (a pool
        file, read-write; a key table, read-only), handed over the credential connection;
        the caller closes it. :class:`PermissionDenied` for any other path."""
        return self.identity.open_file(path)

    def lookup_counters(self, fd: int) -> int:
        """Hand the daemon this client's lookup counters region over the credential connection;
        that connection's number. :class:`KvtierError` (UNIMPLEMENTED) where the daemon takes none."""
        return self.identity.lookup_counters(fd)

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` after each new credential connection (a local daemon only)."""
        if self.identity.credentials is not None:
            self.identity.credentials.on_connect.append(hook)

    # -- the seams --------------------------------------------------------------------------------

    def _timeout(self, call: Call) -> float:
        return self.timeout if call.timeout is None else call.timeout

    def error(self, e: grpc.RpcError, call: Call | None = None) -> KvtierError:
        """The :class:`KvtierError` of a failed call to this transport's daemon
        (:meth:`Endpoint.error`: an absent daemon is named, at its socket)."""
        return self.endpoint.error(e, self._timeout(call) if call is not None else None)

    async def _call(self, call: Call) -> Any:
        """Send ``call`` and wait for its reply; its error as a :class:`KvtierError`."""
        try:
            return await self._unary(call)
        except grpc.RpcError as e:
            raise self.error(e, call) from None

    def _send(self, call: Call) -> Pending:
        """Send ``call`` now, without waiting; :meth:`reply` waits for it."""
        return Pending(call, self._start(call))

    def _forget(self, handle: Any) -> None:
        self._background.discard(handle)

    async def _reply_of(self, call: Call, handle: Any) -> Any:
        """The reply of a call ``_start`` sent; refused UNAUTHENTICATED (a restarted daemon:
        refused before it acted) it is sent again once the hand-shake is renewed, as in ``_unary``."""
        try:
            return await self._reply(handle)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return await self._unary(call)

    async def _unary(self, call: Call) -> Any:
        """Send ``call`` and wait for its reply (raises ``grpc.RpcError``)."""
        raise NotImplementedError

    def _start(self, call: Call) -> Any:
        """Send ``call`` now; a handle for ``_reply`` or ``_wait``."""
        raise NotImplementedError

    async def _wait(self, handle: Any) -> None:
        raise NotImplementedError

    async def _reply(self, handle: Any) -> Any:
        raise NotImplementedError


class Transport(_Transport):
    """The blocking transport: a ``grpc.Channel``, thread-safe."""

    def __init__(self, path: str | None = None, *, target: str | None = None, client_name: str | None = None,
                 timeout: float = 60.0, tls: ClientTls | None = None) -> None:
        super().__init__(path, target, client_name, timeout, tls)
        # the typed methods call the plain channel and pass the token themselves (a client
        # interceptor costs tens of us a call); ``channel``, for whoever speaks the protocol
        # directly, adds it to every call
        if self.tls is not None:
            self._plain = grpc.secure_channel(self.target, self.tls.channel_credentials(), options=self._options)
        else:
            self._plain = grpc.insecure_channel(self.target, options=self._options)
        channel = (self._plain if self.identity.credentials is None else
                   grpc.intercept_channel(self._plain, TokenInterceptor(self.identity.metadata)))
        self._bind(channel, self._plain)
        self._lock = threading.RLock()
        self.session = SessionStream(self.node, self.client_name, self._lock, self.endpoint, timeout)
        self.session.identity = self.identity

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run a coroutine of this transport's typed methods (a sidecar operation) to its end,
        blocking; its result (or its error)."""
        return _blocking(coro)

    def offload_future(self, request: transfer_pb2.TransferRequest) -> grpc.Future:
        """``Transfer.Offload``, sent now: its future (a ``TransferReply``; a failure is a
        ``grpc.RpcError``, :meth:`error` makes it a :class:`KvtierError`)."""
        return self._start(Call("Offload", self._transfer.Offload, request))

    def onboard_future(self, request: transfer_pb2.TransferRequest) -> grpc.Future:
        """``Transfer.Onboard``, sent now: its future, as :meth:`offload_future`."""
        return self._start(Call("Onboard", self._transfer.Onboard, request))

    def close(self) -> None:
        self.session.close()
        self._plain.close()
        self.identity.close()

    async def open_session(self) -> int:
        return self.session.open()

    def locked(self) -> _Held:
        return _Held(self._lock)

    async def _unary(self, call: Call) -> Any:
        if call.wait_for_ready:  # it would wait for a daemon that is not there until the timeout
            self.endpoint.check()
        rpc, timeout = call.rpc, self._timeout(call)
        try:
            return rpc(call.request, timeout=timeout, wait_for_ready=call.wait_for_ready,
                       metadata=self.identity.metadata())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return rpc(call.request, timeout=timeout, wait_for_ready=call.wait_for_ready, metadata=self.identity.metadata())

    def _start(self, call: Call) -> Any:
        return call.rpc.future(call.request, timeout=self._timeout(call), metadata=self.identity.metadata())

    async def _wait(self, handle: Any) -> None:
        handle.result()

    async def _reply(self, handle: Any) -> Any:
        return handle.result()


class AsyncTransport(_Transport):
    """The asyncio transport: a ``grpc.aio.Channel``, used from one event loop."""

    def __init__(self, path: str | None = None, *, target: str | None = None, client_name: str | None = None,
                 timeout: float = 60.0, tls: ClientTls | None = None) -> None:
        super().__init__(path, target, client_name, timeout, tls)
        # the token goes with every call, the typed methods' and those of whoever uses ``channel`` directly
        interceptors = async_token_interceptors(self.identity.metadata) if self.identity.credentials else None
        if self.tls is not None:
            channel = grpc.aio.secure_channel(self.target, self.tls.channel_credentials(), options=self._options)
        else:
            channel = grpc.aio.insecure_channel(self.target, options=self._options, interceptors=interceptors)
        self._bind(channel, channel)
        self._lock = asyncio.Lock()
        self.session = AsyncSessionStream(self.node, self.client_name, self._lock, self.endpoint, timeout)
        self.session.identity = self.identity

    async def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Await a coroutine of this transport's typed methods (as :meth:`Transport.run`)."""
        return await coro

    async def close(self) -> None:
        self.session.close()
        await self.channel.close()
        self.identity.close()

    async def open_session(self) -> int:
        return await self.session.open()

    def locked(self) -> asyncio.Lock:
        return self._lock

    async def _unary(self, call: Call) -> Any:
        if call.wait_for_ready:
            self.endpoint.check()
        rpc, timeout = call.rpc, self._timeout(call)
        try:
            return await rpc(call.request, timeout=timeout, wait_for_ready=call.wait_for_ready)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return await rpc(call.request, timeout=timeout, wait_for_ready=call.wait_for_ready)

    def _start(self, call: Call) -> Any:
        return asyncio.ensure_future(call.rpc(call.request, timeout=self._timeout(call)))

    async def _wait(self, handle: Any) -> None:
        if not handle.cancelled():
            await handle

    async def _reply(self, handle: Any) -> Any:
        return await handle

    def _forget(self, handle: Any) -> None:
        super()._forget(handle)
        if not handle.cancelled():
            handle.exception()  # retrieved: a failed report is not worth a warning


def _blocking(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine that never suspends (the blocking transport's) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a blocking transport's coroutine suspended")

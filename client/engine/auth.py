"""Who is calling: a client's identity toward its daemon, and channels that carry it.

* Over a unix socket, a local client proves its uid on a credential connection
  (:class:`kvtier.handshake.Credentials`) and every call carries the token it got there
  (:class:`Identity`; :class:`TokenInterceptor` and :func:`async_token_interceptors` add it to
  a channel's calls). The same connection hands file descriptors both ways (pool files, key
  tables, lookup counters regions, KV memory). A daemon that restarted knows no old token: the
  hand-shake is made again and a call refused UNAUTHENTICATED is sent once more.
* Over TCP, TLS with a client certificate (:class:`ClientTls`) says who is calling.
* :func:`open_channel`: a channel to a kvtierd that carries either, for whoever speaks the
  protocol directly (tools, routers, tests).

Import these from :mod:`kvtier.client.engine.transport`.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.client.engine.endpoint import CHANNEL_OPTIONS, Endpoint, default_client_name, unix_socket
from kvtier.client.engine.errors import FailedPrecondition, KvtierError, coded_error
from kvtier.handshake import Credentials, HandshakeError


def handshake_error(e: HandshakeError, endpoint: Endpoint | None = None) -> KvtierError:
    """The :class:`KvtierError` of a failed credential handshake (an absent daemon named as
    :meth:`Endpoint.check` names it)."""
    if e.code == "UNAVAILABLE" and endpoint is not None:
        problem = endpoint.problem()
        if problem is not None:
            return endpoint.unavailable(problem)
    return coded_error(getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNAUTHENTICATED), e.details)


class _Meta(collections.namedtuple("_Meta", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                             "compression")), grpc.ClientCallDetails):
    pass


class TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds a local client's token (``metadata()``: the pairs to add) to every call of a blocking channel."""

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata

    def _details(self, d: Any) -> _Meta:
        return _Meta(d.method, d.timeout, (*(d.metadata or ()), *self._metadata()), d.credentials,
                     d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AsyncToken:
    """Adds a local client's token to every call of a ``grpc.aio`` channel (given when the channel
    is made; :func:`async_token_interceptors`)."""

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata

    def _details(self, d: Any) -> Any:
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), *self._metadata()))


class _AsyncUnaryUnary(_AsyncToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AsyncUnaryStream(_AsyncToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AsyncStreamUnary(_AsyncToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AsyncStreamStream(_AsyncToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def async_token_interceptors(metadata: Any) -> list:
    """The interceptors that add ``metadata()`` to every call of a ``grpc.aio`` channel (one per
    kind of call: an aio channel files each interceptor under the first kind it is)."""
    return [cls(metadata) for cls in (_AsyncUnaryUnary, _AsyncUnaryStream, _AsyncStreamUnary, _AsyncStreamStream)]


class Identity:
    """A client's identity toward one daemon: for a unix socket, its credential connection
    (:class:`kvtier.handshake.Credentials`, made on first need and re-made when the daemon that
    issued it is gone); for TCP, nothing here (TLS carries the client certificate)."""

    def __init__(self, endpoint: Endpoint, client_name: str, timeout: float | None) -> None:
        self.endpoint = endpoint
        self.credentials = (Credentials(endpoint.socket, client_name, timeout)
                            if endpoint.socket is not None else None)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The pairs every call carries (the token); hand-shakes first if not yet done."""
        creds = self.credentials
        if creds is None:
            return ()
        md = creds.metadata
        if md:
            return md
        self._ensure(creds)
        return creds.metadata

    def refresh(self) -> bool:
        """Re-hand-shake if the daemon closed the credential connection (it stopped or restarted);
        True if it did (a call refused UNAUTHENTICATED is then worth retrying once)."""
        return self.credentials is not None and self._ensure(self.credentials)

    def _ensure(self, creds: Credentials) -> bool:
        try:
            return creds.ensure()
        except HandshakeError as e:
            if e.code == "UNAVAILABLE" and self.endpoint.problem() is None:
                # something serves the gRPC socket but no credential socket: calls go without a
                # token (a kvtierd answers UNAUTHENTICATED; anything else, as it will)
                return False
            raise handshake_error(e, self.endpoint) from None

    def _do(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except HandshakeError as e:
            raise handshake_error(e, self.endpoint) from None

    @property
    def tenant(self) -> str:
        if self.credentials is None:
            return ""
        self.metadata()
        return self.credentials.tenant

    @property
    def key_salt(self) -> str:
        if self.credentials is None:
            return ""
        self.metadata()
        return self.credentials.key_salt

    def pass_fds(self, fds: Sequence[int]) -> list[str]:
        if self.credentials is None:
            raise FailedPrecondition("file descriptors can be passed only to a local daemon (unix socket)")
        return self._do(self.credentials.pass_fds, list(fds))

    def open_file(self, path: str) -> int:
        if self.credentials is None:
            raise FailedPrecondition("a daemon's files are handed out only to local clients (unix socket)")
        return self._do(self.credentials.open, path)

    def lookup_counters(self, fd: int) -> int:
        """Hand the daemon a lookup counters region; the number of the connection it went on
        (:meth:`kvtier.handshake.Credentials.lookup_counters`)."""
        if self.credentials is None:
            raise FailedPrecondition("lookup counters regions go only to a local daemon (unix socket)")
        return self._do(self.credentials.lookup_counters, fd)

    def close(self) -> None:
        if self.credentials is not None:
            self.credentials.close()


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS files for a daemon (or route server) over TCP: its certificate and key
    (the daemon requires one signed by its --tls-ca) and the CA that signed the server's."""

    cert: str
    key: str
    ca: str

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as fh:
                return fh.read()
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca), private_key=read(self.key),
                                            certificate_chain=read(self.cert))

    @classmethod
    def from_env(cls, env: Any = None) -> ClientTls | None:
        """From ``$KVTIER_TLS_CERT``, ``$KVTIER_TLS_KEY``, ``$KVTIER_TLS_CA`` (as the daemon's own
        settings are named); None unless all three are set."""
        env = os.environ if env is None else env
        files = [env.get(f"KVTIER_TLS_{n}", "") for n in ("CERT", "KEY", "CA")]
        return cls(*files) if all(files) else None


def open_channel(target: str, *, aio: bool = False, tls: ClientTls | None = None, client_name: str = "",
                 options: list | None = None, timeout: float | None = 10.0) -> Any:
    """A gRPC channel to a kvtierd: ``target`` a gRPC target (``unix:PATH``, ``HOST:PORT``).

    Over a unix socket the credential handshake is done first (raising :class:`KvtierError`:
    Unavailable, PermissionDenied) and every call carries the token; the credential connection
    lives as long as the channel object (``channel.kvtier_credentials``; closed with it when
    collected, or by ``channel.kvtier_credentials.close()``), and is made again before a call
    when the daemon closed it (a restart). Over TCP: TLS with ``tls`` (a client certificate),
    else plaintext."""
    options = list(CHANNEL_OPTIONS if options is None else options)
    path = unix_socket(target)
    if path is None:
        if tls is not None:
            creds = tls.channel_credentials()
            return (grpc.aio.secure_channel if aio else grpc.secure_channel)(target, creds, options=options)
        return (grpc.aio.insecure_channel if aio else grpc.insecure_channel)(target, options=options)
    identity = Credentials(path, client_name or default_client_name(), timeout)
    try:
        identity.connect()
    except HandshakeError as e:
        raise handshake_error(e) from None

    def metadata() -> tuple[tuple[str, str], ...]:
        # a daemon that restarted knows no old token: hand-shake again (one non-blocking peek a call)
        with contextlib.suppress(HandshakeError):
            identity.ensure()
        return identity.metadata

    if aio:
        channel = grpc.aio.insecure_channel(target, options=options, interceptors=async_token_interceptors(metadata))
    else:
        channel = grpc.intercept_channel(grpc.insecure_channel(target, options=options), TokenInterceptor(metadata))
    channel.kvtier_credentials = identity
    return channel

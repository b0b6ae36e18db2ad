"""How the engine library reaches its node's kvtierd: one transport for both sidecars and the KV connector.

Owned here, once:

* **Where the daemon is**, :func:`resolve_target`: an explicit gRPC ``target`` as given
  (``HOST:PORT``, ``unix:PATH``, any gRPC target string); else ``unix:`` and the socket path
  given; else ``$KVTIER_SOCKET`` (the daemon's ``--socket`` reads the same variable); else
  :func:`kvtier.paths.default_socket_path`. :func:`socket_path` is that path alone.
* **The channel**: blocking or asyncio, with :data:`CHANNEL_OPTIONS` (and, for a unix socket,
  :data:`UNIX_CHANNEL_OPTIONS`: a daemon that comes back is reconnected to within a quarter second).
* **A daemon that is not there** (:class:`Endpoint`) fails at once, never after the timeout: a
  unix socket that does not exist, is not a socket, or refuses connections (the daemon stopped
  or was killed) is checked before every call that would wait for the daemon (opening the
  session, ``wait_for_ready`` calls) and whenever a call fails UNAVAILABLE or DEADLINE_EXCEEDED.
  The :class:`Unavailable` raised names the socket, where its path came from, and how to start
  the daemon there (:func:`kvtier.paths.start_hint`); every UNAVAILABLE or DEADLINE_EXCEEDED
  names the target.
* **Errors**: every failure is a :class:`KvtierError` carrying a gRPC status code and the
  daemon's message (or the client's, for a misuse found before calling); the codes a caller
  acts on have subclasses (:class:`InvalidArgument`, also a ``ValueError``,
  :class:`FailedPrecondition`, :class:`ResourceExhausted`, :class:`Unavailable`,
  :class:`DeadlineExceeded`). :func:`rpc_error` maps a ``grpc.RpcError`` to one.
* **The session** (:class:`SessionStream`, :class:`AsyncSessionStream`): one
  ``Node.Session`` stream per client, opened on first need and held until the client
  closes it. Its lifetime is the session's: once the stream ends (close, exit, kill, a
  daemon restart) the daemon has reclaimed every grant, pin, KV registration and device
  block report made under it. The daemon's epoch comes with it; :func:`restarted` tells a
  daemon restart (new epoch, or the stream ended) from a refusal by the same daemon. The
  stream is also how a client learns at once that its daemon died (:attr:`_Session.ended`):
  the kernel closes a killed daemon's connections. Opening waits for the daemon at most the
  transport's timeout.
* **Running operations** (:class:`Transport`, :class:`AsyncTransport`): a client operation
  is written once, as a generator that yields *steps* and is sent their results (an
  operation's errors are thrown into it as :class:`KvtierError`):

  - :class:`Call`: one unary RPC; its reply;
  - :data:`SESSION`: the session id, opening the stream if none is open;
  - :class:`Background`: send an RPC without waiting for it (``settle=True``: the next
    :data:`SETTLE` waits for it and raises its error; else its outcome is ignored);
  - :data:`SETTLE`: wait for the ``settle=True`` background calls, raising the first error
    that is not the session being gone (its pins went with it);
  - :class:`Locked`: run another operation holding the transport's lock (which the session
    opening takes too: such an operation must not yield :data:`SESSION`).

  :func:`one_call` is the operation of a single :class:`Call`.

  :meth:`Transport.run` performs the steps with blocking calls; :meth:`AsyncTransport.run`
  awaits them. That is the only difference between the blocking and the asyncio clients.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import queue
import socket
import stat
import sys
import threading
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier.handshake import Credentials, HandshakeError
from kvtier.paths import SOCKET_ENV, default_socket_path, start_hint
from kvtier.proto import locations_pb2_grpc, node_pb2, node_pb2_grpc, transfer_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# A unix socket costs nothing to retry: reconnect to a daemon that comes back within 0.25 s
# (gRPC's default backoff grows to 120 s while the daemon is away, and a call that waits for
# the daemon would wait that long after it is back).
UNIX_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]

# A FAILED_PRECONDITION (unknown session or layout) or UNAVAILABLE answer may mean the daemon restarted.
RESTART_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
# A background call that failed with one of these lost nothing the caller must hear about: the
# session it named is gone and its pins with it (CANCELLED: the daemon's shutdown cancels calls;
# UNAUTHENTICATED: the token died with the daemon that issued it).
_GONE_CODES = (*RESTART_CODES, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAUTHENTICATED)

T = TypeVar("T")


# -- where the daemon is ------------------------------------------------------------------

def socket_path(path: str | None = None) -> str:
    """The daemon's unix socket: ``path``, else ``$KVTIER_SOCKET``, else the default path
    (``unix:`` prefixes are dropped)."""
    path = path or os.environ.get(SOCKET_ENV) or default_socket_path()
    if path.startswith("unix://"):
        return path[len("unix://"):]
    return path.removeprefix("unix:")


def resolve_target(path: str | None = None, target: str | None = None) -> str:
    """The gRPC target: ``target`` as given, else ``unix:`` + :func:`socket_path` of ``path``."""
    return target or f"unix:{socket_path(path)}"


def unix_socket(target: str) -> str | None:
    """The socket path of a ``unix:`` target; None for any other target."""
    if target.startswith("unix://"):
        return target[len("unix://"):]
    if target.startswith("unix:"):
        return target[len("unix:"):]
    return None


def probe_socket(path: str) -> str | None:
    """Why no daemon can answer at the unix socket ``path`` right now, or None when something
    accepts connections there. Never blocks (a non-blocking connect; a full backlog counts as
    a daemon that is there)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "."
        where = "" if os.path.isdir(parent) else f" (directory {parent} does not exist either)"
        return f"no daemon socket at {path}{where}"
    except OSError as e:
        return f"cannot reach the daemon socket {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket; it is no kvtierd socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
    except BlockingIOError:
        return None
    except ConnectionRefusedError:
        return f"nothing accepts connections on the daemon socket {path} (the daemon stopped or was killed)"
    except PermissionError:
        return f"permission denied connecting to the daemon socket {path} (it is owner-only: run as the daemon's user)"
    except OSError as e:
        return f"cannot connect to the daemon socket {path}: {e.strerror or e}"
    finally:
        s.close()
    return None


class Endpoint:
    """The daemon a client talks to, as its errors name it: ``target``, and for a unix socket
    its path (``socket``) and where that came from (``source``: ``"given"``, ``"$KVTIER_SOCKET"``,
    ``"default"``; ``"target"`` for an explicit target)."""

    def __init__(self, path: str | None = None, target: str | None = None) -> None:
        self.target = resolve_target(path, target)
        self.socket = unix_socket(self.target)
        self.source = ("target" if target else "given" if path else
                       f"${SOCKET_ENV}" if os.environ.get(SOCKET_ENV) else "default")

    def problem(self) -> str | None:
        """Why no daemon can answer at the unix socket now (see :func:`probe_socket`); None when
        something accepts connections there, and for targets other than a unix socket."""
        return probe_socket(self.socket) if self.socket is not None else None

    def check(self) -> None:
        """Raise :class:`Unavailable` at once if no daemon can answer at the unix socket."""
        problem = self.problem()
        if problem is not None:
            raise self.unavailable(problem)

    def unavailable(self, problem: str) -> Unavailable:
        assert self.socket is not None
        whence = {"default": f" (the default path: no socket given and ${SOCKET_ENV} is unset)",
                  f"${SOCKET_ENV}": f" (from ${SOCKET_ENV})"}.get(self.source, "")
        return Unavailable(f"{problem}{whence}; {start_hint(self.socket)}")

    def error(self, e: grpc.RpcError, timeout: float | None = None) -> KvtierError:
        """:func:`rpc_error`, naming the daemon in an UNAVAILABLE or DEADLINE_EXCEEDED, and an
        :class:`Unavailable` saying so when it is because no daemon is at the socket."""
        code, details = e.code(), e.details() or ""
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return rpc_error(e)
        problem = self.problem()
        if problem is not None:
            return self.unavailable(problem)
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"kvtierd at {self.target}: {details}")
        within = f" within {timeout:g} s" if timeout else ""
        return DeadlineExceeded(f"no answer from kvtierd at {self.target}{within} ({details})")

    def expired(self, timeout: float | None, what: str) -> KvtierError:
        """What a wait of ``timeout`` for ``what`` that ran out raises."""
        problem = self.problem()
        if problem is not None:
            return self.unavailable(problem)
        return DeadlineExceeded(f"kvtierd at {self.target} did not {what} within {timeout:g} s")


def default_client_name(prefix: str = "") -> str:
    """``[prefix:]program:pid``: how the daemon's logs name a client's session."""
    name = f"{os.path.basename(sys.argv[0] or 'python')}:{os.getpid()}"
    return f"{prefix}:{name}" if prefix else name


# -- errors ---------------------------------------------------------------------------------

class KvtierError(Exception):
    """A call the daemon (or the client, before calling) refused; ``code`` is a grpc.StatusCode,
    ``details`` the message saying what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class _CodedError(KvtierError):
    CODE: ClassVar[grpc.StatusCode]

    def __init__(self, message: str) -> None:
        super().__init__(self.CODE, message)


class InvalidArgument(_CodedError, ValueError):
    """A malformed argument (found by the client, or refused by the daemon)."""

    CODE = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(_CodedError):
    """Not now, or not this way: an unregistered layout, a feature the daemon was started without."""

    CODE = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(_CodedError):
    """The daemon lacks the memory or room asked for."""

    CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(_CodedError):
    """No daemon answered at the target."""

    CODE = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(_CodedError):
    """No answer within the client's timeout."""

    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(_CodedError):
    """The daemon does not know who is calling: no valid token (unix socket) or certificate (TCP)."""

    CODE = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(_CodedError):
    """The caller may not do this: its uid is not admitted, or it names another caller's id."""

    CODE = grpc.StatusCode.PERMISSION_DENIED


_ERROR_BY_CODE: dict[grpc.StatusCode, type[_CodedError]] = {
    cls.CODE: cls for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unavailable, DeadlineExceeded,
                              Unauthenticated, PermissionDenied)}


# -- who is calling (issue 12) ----------------------------------------------------------------

def handshake_error(e: HandshakeError, endpoint: Endpoint | None = None) -> KvtierError:
    """The :class:`KvtierError` of a failed credential handshake (an absent daemon named as
    :meth:`Endpoint.check` names it)."""
    if e.code == "UNAVAILABLE" and endpoint is not None:
        problem = endpoint.problem()
        if problem is not None:
            return endpoint.unavailable(problem)
    code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNAUTHENTICATED)
    cls = _ERROR_BY_CODE.get(code)
    return cls(e.details) if cls is not None else KvtierError(code, e.details)


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


def rpc_error(e: grpc.RpcError) -> KvtierError:
    """The :class:`KvtierError` (subclass, where the code has one) of a failed RPC."""
    code, details = e.code(), e.details() or ""
    cls = _ERROR_BY_CODE.get(code)
    return cls(details) if cls is not None else KvtierError(code, details)


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


# -- the session stream -------------------------------------------------------------------

class _Session:
    """What both session streams hold: the stream, and what the daemon said when it opened.

    ``endpoint``: checked before opening, and names the daemon in errors; ``timeout``: the
    longest wait for the daemon to open the stream (None: no limit)."""

    def __init__(self, node: Any, client_name: str, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        self._node = node
        self.identity: Identity | None = None  # set by the transport: the token the stream carries
        self.client_name = client_name
        self._endpoint = endpoint
        self._timeout = timeout
        self._call: Any = None
        self._done = [True]  # [the stream has ended]: set by its done callback (cheaper than call.done())
        self.session_id = 0
        self.node_id = ""
        self.epoch = 0  # kept when the session is dropped: a later answer is compared with it

    @property
    def alive(self) -> bool:
        """Open, and its stream has not ended (the session of an ended stream is gone)."""
        return self._call is not None and not self._done[0]

    @property
    def ended(self) -> bool:
        """Opened, and its stream has ended since without :meth:`close`: the daemon closed it,
        died (the kernel closes a killed process's connections) or restarted. Everything held
        under it is gone, and so is anything else the daemon it lived on published. (An asyncio
        client sees it once its event loop has run.)"""
        return self._call is not None and self._done[0]

    def _check(self) -> None:
        if self._endpoint is not None:
            self._endpoint.check()
        if self.identity is not None:
            self.identity.refresh()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self.identity.metadata() if self.identity is not None else ()

    def _error(self, e: grpc.RpcError) -> KvtierError:
        return self._endpoint.error(e) if self._endpoint is not None else rpc_error(e)

    def _expired(self) -> KvtierError:
        if self._endpoint is not None:
            return self._endpoint.expired(self._timeout, "open a session")
        return DeadlineExceeded(f"the daemon did not open a session within {self._timeout:g} s")

    def _hello(self) -> node_pb2.SessionClientMessage:
        return node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=self.client_name,
                                                                         pid=os.getpid()))

    def _opened(self, call: Any, msg: Any) -> int:
        if not isinstance(msg, node_pb2.SessionServerMessage) or not msg.HasField("opened"):
            call.cancel()
            target = f" at {self._endpoint.target}" if self._endpoint is not None else ""
            raise Unavailable(f"kvtierd{target} ended the session stream before opening it")
        done = self._done = [False]
        call.add_done_callback(lambda _call: done.__setitem__(0, True))  # at once if it has ended
        self._call = call
        self.session_id = msg.opened.session_id
        self.node_id = msg.opened.node_id
        self.epoch = msg.opened.epoch
        return self.session_id


class SessionStream(_Session):
    """The blocking client's session: the stream's requests are a generator that waits (on a
    gRPC thread) until :meth:`close`."""

    def __init__(self, node: Any, client_name: str, lock: threading.RLock, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(node, client_name, endpoint, timeout)
        self._lock = lock
        self._queue: queue.Queue | None = None

    def open(self) -> int:
        """The session id, opening the stream first if none is open (one for concurrent callers).

        Raises :class:`Unavailable` at once when no daemon is at the socket; waits for the
        daemon to open it at most the timeout."""
        if self._call is not None:
            return self.session_id
        with self._lock:
            if self._call is not None:
                return self.session_id
            self._check()
            q: queue.Queue = queue.Queue()
            hello = self._hello()

            def requests() -> Any:
                yield hello
                while q.get() is not None:
                    pass

            call = self._node.Session(requests(), wait_for_ready=True, timeout=None, metadata=self._metadata())
            expired = threading.Event()
            timer = None
            if self._timeout is not None:  # the stream has no deadline: only its opening is bounded

                def expire() -> None:
                    expired.set()
                    call.cancel()

                timer = threading.Timer(self._timeout, expire)
                timer.daemon = True
                timer.start()
            try:
                msg = next(call, None)
            except grpc.RpcError as e:
                q.put(None)
                raise (self._expired() if expired.is_set() else self._error(e)) from None
            finally:
                if timer is not None:
                    timer.cancel()
            if expired.is_set():  # it fired just as the daemon answered: the stream is cancelled
                q.put(None)
                raise self._expired()
            if msg is None:  # ended without a message or an error: _opened says so
                q.put(None)
            else:
                self._queue = q
            return self._opened(call, msg)

    def drop_if_ended(self) -> bool:
        """:meth:`close` the session if its stream has ended (nothing is lost: the daemon already
        reclaimed what it held), so that the next :meth:`open` opens a new one; True if it
        did. Skipped while another thread holds the lock (it is opening or recovering)."""
        if not self.ended or not self._lock.acquire(blocking=False):
            return False
        try:
            if not self.ended:
                return False
            self.close()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the stream: the daemon reclaims everything held under the session."""
        if self._queue is not None:
            self._queue.put(None)
        if self._call is not None:
            self._call.cancel()
        self._queue = self._call = None
        self.session_id = 0


class AsyncSessionStream(_Session):
    """The asyncio client's session."""

    def __init__(self, node: Any, client_name: str, lock: asyncio.Lock, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(node, client_name, endpoint, timeout)
        self._lock = lock

    async def open(self) -> int:
        """As :meth:`SessionStream.open`."""
        if self._call is not None:
            return self.session_id
        async with self._lock:
            if self._call is not None:
                return self.session_id
            self._check()
            call = self._node.Session(wait_for_ready=True)  # the channel's interceptor adds the token

            async def first() -> Any:
                await call.write(self._hello())
                return await call.read()

            try:
                msg = await asyncio.wait_for(first(), self._timeout)
            except asyncio.TimeoutError:
                call.cancel()
                raise self._expired() from None
            except grpc.RpcError as e:
                call.cancel()
                raise self._error(e) from None
            return self._opened(call, msg)

    def drop_if_ended(self) -> bool:
        """As :meth:`SessionStream.drop_if_ended` (one event loop: no other opener can interleave)."""
        if not self.ended:
            return False
        self.close()
        return True

    def close(self) -> None:
        """As :meth:`SessionStream.close`."""
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self.session_id = 0


# -- steps ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Call:
    """One unary RPC: ``service`` is ``node``, ``locations`` or ``transfer``; ``timeout`` None:
    the transport's."""

    service: str
    method: str
    request: Message
    timeout: float | None = None
    wait_for_ready: bool = False


@dataclass(frozen=True, slots=True)
class Background:
    """Send ``call`` without waiting for its reply (see the module docstring)."""

    call: Call
    settle: bool = False


@dataclass(frozen=True, slots=True)
class Locked:
    """Run ``op`` holding the transport's lock."""

    op: Generator


@dataclass(frozen=True, slots=True)
class Start:
    """Send ``call`` now without waiting; the step's result is a handle for :class:`Reply`
    (wait for each: an abandoned call is cancelled when its handle goes)."""

    call: Call


@dataclass(frozen=True, slots=True)
class Reply:
    """Wait for a call :class:`Start` sent; its reply (or its error)."""

    handle: Any


SESSION = "session"
SETTLE = "settle"

Step = Call | Background | Locked | Start | Reply | str
Op = Generator[Step, Any, T]


def one_call(call: Call) -> Op[Any]:
    """The operation of one call: its reply."""
    return (yield call)


def restarted(error: KvtierError, session: _Session) -> Op[bool]:
    """Whether a FAILED_PRECONDITION or UNAVAILABLE answer means the session is gone with the
    daemon it lived on (UNAVAILABLE; its stream ended; the daemon answers with another
    epoch). A FAILED_PRECONDITION from the daemon the session still lives on is a refusal:
    the session is kept (dropping it would take the grants and pins other threads hold)."""
    if error.code != grpc.StatusCode.FAILED_PRECONDITION or not session.epoch or not session.alive:
        return True
    try:
        reply = yield Call("node", "Stats", node_pb2.StatsRequest())
    except KvtierError:
        return True
    return reply.epoch != session.epoch


def _first_step(op: Generator) -> tuple[Any, Any]:
    """(the op's first step, None), or (None, its result) when it finished without one."""
    try:
        return op.send(None), None
    except StopIteration as stop:
        return None, stop.value


# -- transports -----------------------------------------------------------------------------

class _Transport:
    """What both transports share: the target, the stubs, and performing an operation's steps.

    The step primitives (``_unary``, ``_open``, ``_wait``, ``_locked``) are coroutines in both
    transports; the blocking one's never suspend, so :meth:`Transport.run` completes them
    with one ``send``."""

    session: Any

    def __init__(self, path: str | None, target: str | None, client_name: str | None, timeout: float,
                 channel: Any, tls: ClientTls | None = None) -> None:
        self.endpoint = Endpoint(path, target)
        # over TCP: TLS with this client certificate (given, else $KVTIER_TLS_CERT/_KEY/_CA), else plaintext
        self.tls = (tls or ClientTls.from_env()) if self.endpoint.socket is None else None
        self.target = self.endpoint.target
        self.client_name = client_name or default_client_name()
        self.timeout = timeout
        self.identity = Identity(self.endpoint, self.client_name, timeout)
        options = CHANNEL_OPTIONS + (UNIX_CHANNEL_OPTIONS if self.endpoint.socket is not None else [])
        self.channel = channel(self.target, options)
        self.node = node_pb2_grpc.NodeStub(self.channel)
        self.locations = locations_pb2_grpc.LocationsStub(self.channel)
        self.transfer = transfer_pb2_grpc.TransferStub(self.channel)
        # the operations' calls (:meth:`_method`): the blocking transport's go over its plain
        # channel and pass the token themselves (a client interceptor costs tens of us a call)
        plain = getattr(self, "_plain", None) or self.channel
        self._stubs = {"node": node_pb2_grpc.NodeStub(plain), "locations": locations_pb2_grpc.LocationsStub(plain),
                       "transfer": transfer_pb2_grpc.TransferStub(plain)}
        self._deferred: collections.deque = collections.deque()  # background calls SETTLE waits for
        self._background: set = set()  # the others, referenced until done (gRPC cancels a dropped call)

    def _method(self, call: Call) -> Any:
        return getattr(self._stubs[call.service], call.method)

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

    def _timeout(self, call: Call) -> float:
        return self.timeout if call.timeout is None else call.timeout

    def error(self, e: grpc.RpcError, call: Call | None = None) -> KvtierError:
        """The :class:`KvtierError` of a failed call to this transport's daemon
        (:meth:`Endpoint.error`: an absent daemon is named, at its socket)."""
        return self.endpoint.error(e, self._timeout(call) if call is not None else None)

    async def _drive(self, op: Generator, step: Any) -> Any:
        """Perform ``step`` and every later one of ``op``; its result."""
        while True:
            reply = error = None
            try:
                reply = await self._perform(step)
            except grpc.RpcError as e:
                error = self.error(e, step if type(step) is Call else None)
            except GeneratorExit:
                raise
            except BaseException as e:  # thrown into the op, which may clean up (abort, release)
                error = e
            try:
                step = op.send(reply) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value

    async def _complete(self, op: Generator) -> Any:
        step, result = _first_step(op)
        return result if step is None else await self._drive(op, step)

    async def _perform(self, step: Any) -> Any:
        if type(step) is Call:
            return await self._unary(step)
        if step is SESSION:
            return await self._open()
        if step is SETTLE:
            return await self._settle()
        if type(step) is Background:
            handle = self._start(step.call)
            if step.settle:
                self._deferred.append(handle)
            else:
                self._background.add(handle)
                handle.add_done_callback(self._forget)
            return None
        if type(step) is Locked:
            return await self._locked(step.op)
        if type(step) is Start:
            return step.call, self._start(step.call)
        if type(step) is Reply:
            return await self._reply_of(*step.handle)
        raise TypeError(f"not a transport step: {step!r}")

    async def _settle(self) -> None:
        while self._deferred:
            handle = self._deferred.popleft()
            try:
                await self._wait(handle)
            except grpc.RpcError as e:
                if e.code() not in _GONE_CODES:
                    raise self.error(e) from None

    def _forget(self, handle: Any) -> None:
        self._background.discard(handle)

    async def _reply_of(self, call: Call, handle: Any) -> Any:
        """The reply of a call :class:`Start` sent; refused UNAUTHENTICATED (a restarted daemon:
        refused before it acted) it is sent again once the hand-shake is renewed, as in ``_unary``."""
        try:
            return await self._reply(handle)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return await self._unary(call)

    async def _unary(self, call: Call) -> Any:
        raise NotImplementedError

    async def _open(self) -> int:
        raise NotImplementedError

    async def _wait(self, handle: Any) -> None:
        raise NotImplementedError

    async def _locked(self, op: Generator) -> Any:
        raise NotImplementedError

    async def _reply(self, handle: Any) -> Any:
        raise NotImplementedError

    def _start(self, call: Call) -> Any:
        raise NotImplementedError


class Transport(_Transport):
    """The blocking transport: a ``grpc.Channel``, thread-safe."""

    def __init__(self, path: str | None = None, *, target: str | None = None, client_name: str | None = None,
                 timeout: float = 60.0, tls: ClientTls | None = None) -> None:
        super().__init__(path, target, client_name, timeout, self._make_channel, tls)
        self._lock = threading.RLock()
        self.session = SessionStream(self.node, self.client_name, self._lock, self.endpoint, timeout)
        self.session.identity = self.identity

    def _make_channel(self, target: str, options: list) -> grpc.Channel:
        # the stubs call the plain channel and pass the token themselves (the cheapest);
        # ``channel``, for whoever speaks the protocol directly, adds it to every call
        if self.tls is not None:
            self._plain = grpc.secure_channel(target, self.tls.channel_credentials(), options=options)
        else:
            self._plain = grpc.insecure_channel(target, options=options)
        if self.identity.credentials is None:
            return self._plain
        return grpc.intercept_channel(self._plain, TokenInterceptor(self.identity.metadata))

    def run(self, op: Op[T]) -> T:
        """Perform ``op``'s steps, blocking; its result (or its error)."""
        step, result = _first_step(op)
        if step is None:  # answered without a call (a key table lookup)
            return result
        return _blocking(self._drive(op, step))

    def close(self) -> None:
        self.session.close()
        self._plain.close()
        self.identity.close()

    async def _unary(self, call: Call) -> Any:
        if call.wait_for_ready:  # it would wait for a daemon that is not there until the timeout
            self.endpoint.check()
        method = self._method(call)
        try:
            return method(call.request, timeout=self._timeout(call), wait_for_ready=call.wait_for_ready,
                          metadata=self.identity.metadata())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return method(call.request, timeout=self._timeout(call), wait_for_ready=call.wait_for_ready,
                      metadata=self.identity.metadata())

    async def _open(self) -> int:
        return self.session.open()

    def _start(self, call: Call) -> Any:
        return self._method(call).future(call.request, timeout=self._timeout(call), metadata=self.identity.metadata())

    async def _wait(self, handle: Any) -> None:
        handle.result()

    async def _reply(self, handle: Any) -> Any:
        return handle.result()

    async def _locked(self, op: Generator) -> Any:
        with self._lock:
            return await self._complete(op)


class AsyncTransport(_Transport):
    """The asyncio transport: a ``grpc.aio.Channel``, used from one event loop."""

    def __init__(self, path: str | None = None, *, target: str | None = None, client_name: str | None = None,
                 timeout: float = 60.0, tls: ClientTls | None = None) -> None:
        super().__init__(path, target, client_name, timeout, self._make_channel, tls)
        self._lock = asyncio.Lock()
        self.session = AsyncSessionStream(self.node, self.client_name, self._lock, self.endpoint, timeout)
        self.session.identity = self.identity

    def _make_channel(self, target: str, options: list) -> grpc.aio.Channel:
        # the token goes with every call, the stubs' and those of whoever uses ``channel`` directly
        interceptors = async_token_interceptors(self.identity.metadata) if self.identity.credentials else None
        if self.tls is not None:
            return grpc.aio.secure_channel(target, self.tls.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)

    async def run(self, op: Op[T]) -> T:
        """Perform ``op``'s steps, awaiting each; its result (or its error)."""
        return await self._complete(op)

    async def close(self) -> None:
        self.session.close()
        await self.channel.close()
        self.identity.close()

    async def _unary(self, call: Call) -> Any:
        if call.wait_for_ready:
            self.endpoint.check()
        method = self._method(call)
        try:
            return await method(call.request, timeout=self._timeout(call), wait_for_ready=call.wait_for_ready)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or not self.identity.refresh():
                raise
        return await method(call.request, timeout=self._timeout(call), wait_for_ready=call.wait_for_ready)

    async def _open(self) -> int:
        return await self.session.open()

    def _start(self, call: Call) -> Any:
        return asyncio.ensure_future(self._method(call)(call.request, timeout=self._timeout(call)))

    async def _wait(self, handle: Any) -> None:
        if not handle.cancelled():
            await handle

    async def _reply(self, handle: Any) -> Any:
        return await handle

    async def _locked(self, op: Generator) -> Any:
        async with self._lock:
            return await self._complete(op)

    def _forget(self, handle: Any) -> None:
        super()._forget(handle)
        if not handle.cancelled():
            handle.exception()  # retrieved: a failed report is not worth a warning


def _blocking(coro: Coroutine) -> Any:
    """Run a coroutine that never suspends (the blocking transport's) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a blocking transport's step suspended")

"""The credential handshake of a local kvtierd: who a unix-socket caller is.

gRPC cannot tell the uid of a unix-socket peer, so the daemon serves a second, small unix
socket beside its gRPC socket: :func:`auth_socket_path` (``<socket>.auth``). A client
connects there first and sends a hello; the daemon reads the peer's credentials from the
kernel (``SO_PEERCRED``: uid, gid, pid), refuses a uid and gid it does not allow, and answers
a *token* (128 random bits, hex), the caller's *tenant* and the tenant's *key salt*. The
client attaches the token to every gRPC call (metadata :data:`TOKEN_HEADER`) and keeps the
credential connection open for its whole life: the token is valid while that connection is
open, so a dead client's token dies with it (the kernel closes a killed process's sockets).

On the same connection a client can hand the daemon file descriptors (``SCM_RIGHTS``): each
is kept under a 128-bit *handle* bound to that connection's token, which a later gRPC call
(KV registration) names; a handle is usable by that caller only, and its fd is closed when
the connection closes unless the daemon took it.

And the daemon hands the client its tenant's files the same way (:meth:`Credentials.open`):
a pool file or key table that a ``RegisterLayoutReply`` named (``pool_path``,
``key_table_path``) comes back as an open descriptor (pool read-write, key table read-only),
so a client never opens a daemon file by its path, and the files stay 0600 (0400) to the
daemon's uid however many uids its tenants run as. Any other path, another tenant's files
included, is refused PERMISSION_DENIED without saying whether it exists.

Wire format: each message is a frame, a 4-byte big-endian length and that many bytes of a
JSON object (at most :data:`MAX_FRAME` bytes). Requests: ``{"op": "hello", "client": NAME,
"pid": PID}`` (first, once), ``{"op": "pass_fds", "count": N}`` sent in one ``sendmsg``
with N descriptors (at most :data:`MAX_FDS`), ``{"op": "open", "path": PATH}``, answered
``{"ok": true, "fds": 1}`` with the descriptor attached, and ``{"op": "lookup_counters"}`` sent
with one descriptor: the client's lookup counters region (:mod:`kvtier.tiers.lookup_counts`),
at most one per connection, which the daemon reads until the connection closes and one last
time then (a daemon that takes it says ``"lookup_counters": true`` in its hello reply).
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "code": CODE, "error": MESSAGE}`` (CODE: a
gRPC status name), after which the daemon closes the connection; except a refused ``open`` or
``lookup_counters``, and a ``pass_fds`` refused RESOURCE_EXHAUSTED (over a budget of passed
descriptors: the descriptors sent with it are closed), after which the connection (and its
token) stays. A body nested deeper than :data:`MAX_DEPTH` arrays and objects is refused
INVALID_ARGUMENT like any other body that is not a JSON object.

:class:`Credentials` is the client side (blocking; both the blocking and the asyncio
transports use it: the exchange is local and short).
"""

from __future__ import annotations

import array
import json
import os
import re
import socket
import struct
import threading
import time
from typing import Any

TOKEN_HEADER = "kvtier-token"
"""The gRPC metadata key that carries a local client's token."""

AUTH_SUFFIX = ".auth"
MAX_FRAME = 64 * 1024
MAX_FDS = 64
MAX_DEPTH = 16
"""The deepest nesting of arrays and objects a message may have (no message needs more than 2)."""
_LEN = struct.Struct(">I")
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


def auth_socket_path(grpc_socket: str) -> str:
    """The credential socket of the daemon serving gRPC on the unix socket ``grpc_socket``."""
    return grpc_socket + AUTH_SUFFIX


def frame(obj: dict[str, Any]) -> bytes:
    """One message as it goes on the wire."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"credential message of {len(body)} bytes; the most is {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def unframe(buf: bytearray) -> dict[str, Any] | None:
    """The first complete message of ``buf`` (removed from it), or None if it is not all there.
    Raises ValueError for a frame over :data:`MAX_FRAME` or a body that is not a JSON object."""
    if len(buf) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"credential message of {n} bytes; the most is {MAX_FRAME}")
    if len(buf) < _LEN.size + n:
        return None
    body = bytes(buf[_LEN.size:_LEN.size + n])
    del buf[:_LEN.size + n]
    if _depth(body) > MAX_DEPTH:
        raise ValueError(f"credential message nests arrays and objects more than {MAX_DEPTH} deep")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"credential message is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("credential message is not a JSON object")
    return obj


#: a string (to its end, closed or not: each is scanned once) or a bracket
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"?|[][{}]')


def _depth(body: bytes) -> int:
    """How deep ``body`` nests arrays and objects (brackets inside strings not counted), read
    in one pass without recursion: bounded before a decoder that recurses sees it."""
    depth = deepest = 0
    for m in _TOKEN.finditer(body):
        t = m.group()
        if t in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif t in (b"]", b"}"):
            depth -= 1
    return deepest


def fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an ``SCM_RIGHTS`` control message carried."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


class HandshakeError(Exception):
    """The daemon refused the handshake (``code``: a gRPC status name) or could not be reached
    (``code`` UNAVAILABLE)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.details = message


class Credentials:
    """A client's credential connection to its local daemon (see the module docstring).

    :meth:`connect` performs the handshake; :attr:`token`, :attr:`tenant`, :attr:`key_salt`
    and :attr:`uid` are what the daemon answered. :meth:`ensure` re-connects when the daemon
    closed the connection (it stopped, or restarted: a new daemon knows no old token)."""

    def __init__(self, grpc_socket: str, client_name: str = "", timeout: float | None = 10.0) -> None:
        self.path = auth_socket_path(grpc_socket)
        self.client_name = client_name
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.token = ""
        self.tenant = ""
        self.key_salt = ""
        self.uid = -1
        self.metadata: tuple[tuple[str, str], ...] = ()  # (TOKEN_HEADER, token) once connected
        self.connects = 0                  # handshakes so far: each connection's number
        self.takes_lookup_counters = False  # the daemon's hello said it takes a lookup counters region
        #: called (with no argument, under this object's lock) after each handshake: a new connection
        self.on_connect: list[Any] = []

    def connect(self) -> Credentials:
        """Hand-shake now (closing any previous connection). Raises :class:`HandshakeError`."""
        with self._lock:
            self._connect()
        return self

    def ensure(self) -> bool:
        """Connected, re-connecting if the daemon closed the connection; True if it (re)connected."""
        with self._lock:
            if self._sock is not None and self._alive():
                return False
            self._connect()
            return True

    @property
    def alive(self) -> bool:
        """Connected, and the daemon has not closed the connection (one non-blocking peek)."""
        with self._lock:
            return self._sock is not None and self._alive()

    def _alive(self) -> bool:
        assert self._sock is not None
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def _connect(self) -> None:
        self._close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        deadline = time.monotonic() + (self.timeout or 10.0)
        while True:
            # a blocking connect waits in the kernel for room in the daemon's accept queue (a
            # burst of connections, or another uid's flood) and is woken as soon as there is
            # some, bounded by the send timeout; polling from here would lose those races
            left = deadline - time.monotonic()
            s.settimeout(None)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                         struct.pack("ll", int(max(left, 0.001)), int(max(left, 0.001) % 1 * 1e6)))
            try:
                s.connect(self.path)
                break
            except (BlockingIOError, TimeoutError):  # the queue stayed full for the whole wait
                if time.monotonic() < deadline:
                    continue
                s.close()
                raise HandshakeError("UNAVAILABLE", f"the daemon's credential socket {self.path} accepts no "
                                                    f"connection (its queue stays full)") from None
            except OSError as e:
                s.close()
                raise HandshakeError("UNAVAILABLE", f"cannot connect to the daemon's credential socket "
                                                    f"{self.path}: {e.strerror or e}") from None
        s.settimeout(self.timeout)
        try:
            reply = self._exchange(s, {"op": "hello", "client": self.client_name, "pid": os.getpid()})
        except BaseException:
            s.close()
            raise
        self._sock = s
        self.token = str(reply["token"])
        self.tenant = str(reply.get("tenant", ""))
        self.key_salt = str(reply.get("key_salt", ""))
        self.uid = int(reply.get("uid", -1))
        self.metadata = ((TOKEN_HEADER, self.token),)
        self.takes_lookup_counters = reply.get("lookup_counters") is True
        self.connects += 1
        for hook in self.on_connect:
            hook()

    def _exchange(self, s: socket.socket, request: dict[str, Any], fds: list[int] | None = None,
                  received: list[int] | None = None) -> dict[str, Any]:
        """Send ``request`` (with ``fds``), and the reply; descriptors that came with the reply go
        to ``received`` (closed when None: nobody asked for them)."""
        data = frame(request)
        got: list[int] = []
        s.settimeout(self.timeout)
        try:
            try:
                if fds:
                    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
                else:
                    s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused the connection at once: its answer may be there to read
            buf = bytearray()
            while (reply := unframe(buf)) is None:
                chunk, anc, _, _ = s.recvmsg(MAX_FRAME, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
                got.extend(fds_of(anc))
                if not chunk:
                    raise HandshakeError("UNAVAILABLE", f"the daemon closed its credential socket "
                                                        f"{self.path} without an answer")
                buf += chunk
            if received is not None:
                received.extend(got)
                got = []
        except TimeoutError:
            raise HandshakeError("DEADLINE_EXCEEDED", f"no answer on the daemon's credential socket "
                                                      f"{self.path} within {self.timeout:g} s") from None
        except ValueError as e:
            raise HandshakeError("INTERNAL", f"bad answer on {self.path}: {e}") from None
        except OSError as e:
            raise HandshakeError("UNAVAILABLE", f"credential socket {self.path}: {e.strerror or e}") from None
        finally:
            s.settimeout(None)  # blocking without a timeout: a MSG_DONTWAIT peek (_alive) never waits
            for fd in got:
                os.close(fd)
        if not reply.get("ok"):
            raise HandshakeError(str(reply.get("code", "UNAUTHENTICATED")), str(reply.get("error", "refused")))
        return reply

    def pass_fds(self, fds: list[int]) -> list[str]:
        """Hand the daemon these file descriptors (each stays open here too); their handles,
        in order, for a later call to name. At most :data:`MAX_FDS` at once."""
        fds = [int(fd) for fd in fds]
        if not fds:
            return []
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} file descriptors at once; the most is {MAX_FDS}")
        with self._lock:
            if self._sock is None or not self._alive():
                self._connect()
            assert self._sock is not None
            reply = self._exchange(self._sock, {"op": "pass_fds", "count": len(fds)}, fds)
        handles = [str(h) for h in reply.get("handles", [])]
        if len(handles) != len(fds):
            raise HandshakeError("INTERNAL", f"the daemon answered {len(handles)} handles for {len(fds)} fds")
        return handles

    def open(self, path: str) -> int:
        """An open descriptor of one of this client's tenant's files that the daemon named
        (``pool_path`` read-write, ``key_table_path`` read-only), now the caller's to close.
        Raises :class:`HandshakeError` (PERMISSION_DENIED: not a file of this client's tenant)."""
        fds: list[int] = []
        with self._lock:
            if self._sock is None or not self._alive():
                self._connect()
            assert self._sock is not None
            try:
                self._exchange(self._sock, {"op": "open", "path": str(path)}, received=fds)
            except HandshakeError:
                for fd in fds:
                    os.close(fd)
                raise
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise HandshakeError("INTERNAL", f"the daemon answered {len(fds)} descriptors for {path}")
        return fds[0]

    def lookup_counters(self, fd: int) -> int:
        """Hand the daemon this client's lookup counters region (``fd`` stays open here too), on
        the current connection; that connection's number (:attr:`connects`): the daemon reads the
        region until that connection closes. Raises :class:`HandshakeError` (UNIMPLEMENTED: the
        daemon takes none; INVALID_ARGUMENT: it refused this region)."""
        with self._lock:
            if self._sock is None or not self._alive():
                self._connect()
            assert self._sock is not None
            if not self.takes_lookup_counters:
                raise HandshakeError("UNIMPLEMENTED", "this daemon takes no lookup counters region")
            self._exchange(self._sock, {"op": "lookup_counters"}, [int(fd)])
            return self.connects

    def close(self) -> None:
        """Close the connection: the daemon revokes the token (and closes fds it did not take)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.metadata = ()

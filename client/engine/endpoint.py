"""Where a client's daemon is, and how its absence is told.

* :func:`resolve_target`: an explicit gRPC ``target`` as given (``HOST:PORT``, ``unix:PATH``,
  any gRPC target string); else ``unix:`` and the socket path given; else ``$KVTIER_SOCKET``
  (the daemon's ``--socket`` reads the same variable); else
  :func:`kvtier.paths.default_socket_path`. :func:`socket_path` is that path alone.
* The channel's options: :data:`CHANNEL_OPTIONS`, and for a unix socket
  :data:`UNIX_CHANNEL_OPTIONS` (a daemon that comes back is reconnected to within a quarter second).
* **A daemon that is not there** (:class:`Endpoint`) fails at once, never after the timeout: a
  unix socket that does not exist, is not a socket, or refuses connections (the daemon stopped
  or was killed) is checked before every call that would wait for the daemon (opening the
  session, ``wait_for_ready`` calls) and whenever a call fails UNAVAILABLE or DEADLINE_EXCEEDED.
  The :class:`~kvtier.client.engine.errors.Unavailable` raised names the socket, where its
  path came from, and how to start the daemon there (:func:`kvtier.paths.start_hint`); every
  UNAVAILABLE or DEADLINE_EXCEEDED names the target.

Import these from :mod:`kvtier.client.engine.transport`.
"""

from __future__ import annotations

import os
import socket
import stat
import sys

import grpc

from kvtier.client.engine.errors import DeadlineExceeded, KvtierError, Unavailable, rpc_error
from kvtier.paths import SOCKET_ENV, default_socket_path, start_hint

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# A unix socket costs nothing to retry: reconnect to a daemon that comes back within 0.25 s
# (gRPC's default backoff grows to 120 s while the daemon is away, and a call that waits for
# the daemon would wait that long after it is back).
UNIX_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]


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
        """:func:`~kvtier.client.engine.errors.rpc_error`, naming the daemon in an UNAVAILABLE or
        DEADLINE_EXCEEDED, and an :class:`Unavailable` saying so when it is because no daemon
        is at the socket."""
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

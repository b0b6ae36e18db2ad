"""Default locations shared by the daemon and its clients.

The daemon serves on ``--socket`` (``$KVTIER_SOCKET``), else :func:`default_socket_path`; the
engine library's clients look in the same places, in the same order
(:func:`kvtier.client.engine.transport.socket_path`). :func:`start_hint` is what a client says
when nothing answers there."""

from __future__ import annotations

import os

SOCKET_ENV = "KVTIER_SOCKET"


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier/kvtierd.sock``, else ``/tmp/kvtier-$UID/kvtierd.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvtier") if runtime else f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(base, "kvtierd.sock")


def start_hint(path: str) -> str:
    """How to get a daemon listening at the unix socket ``path``, or a client looking elsewhere."""
    return (f"is kvtierd running? start it with `kvtierd --socket {path}`, or point {SOCKET_ENV} "
            f"(or the client's socket_path) at the socket it serves")

"""Default locations shared by the daemon and its clients."""

from __future__ import annotations

import os


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier/kvtierd.sock``, else ``/tmp/kvtier-$UID/kvtierd.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvtier") if runtime else f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(base, "kvtierd.sock")

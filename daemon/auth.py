"""Who is calling: the authenticated principal of each request (issue 12, security).

Every handler of the daemon's services asks its :class:`Authenticator` for the
:class:`Principal` of the call (``self.auth.principal(context)``) before it touches the store.
A principal names:

* ``tenant``: whose blocks the caller may see and use. Blocks, layouts, pools, the feed and
  the key table are per tenant; one tenant never sees another's.
* ``caller``: an unguessable id of the authenticated client (one per credential handshake on
  the unix socket; the certificate's subject on TCP). Sessions, grants, leases and KV
  registrations are bound to the caller that created them; any other caller is refused
  PERMISSION_DENIED.

How callers are authenticated (peer credentials on the unix socket, client certificates on
TCP) is the authenticator's business; the rest of the daemon only sees principals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller (see the module docstring)."""

    tenant: str = DEFAULT_TENANT
    caller: str = ""          # unguessable id of the authenticated client ("" only in-process)
    uid: int | None = None    # the peer's uid (unix socket)
    transport: str = "unix"   # "unix" or "tcp"


#: the principal of in-process use (tests of the store, tools running inside the daemon)
LOCAL = Principal()


class Authenticator:
    """Resolves the principal of a gRPC call. This base accepts every call as :data:`LOCAL`."""

    def principal(self, context: Any) -> Principal:
        return LOCAL

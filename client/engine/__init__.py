"""The engine library: what an engine process embeds to use its node's kvtierd.

* ``sidecar``: :class:`Sidecar` / :class:`AsyncSidecar` (sessions, puts and gets through the
  host pool, lookups from the shared-memory key table), one client run blocking or awaited;
* ``connector``: :class:`KVConnector` (the engine's registered KV memory: GPU <-> host copies
  done by the daemon) and :class:`SharedKVArena` (the CPU stand-in's KV memory);
* ``keys``: the key scheme (:func:`block_keys`, :class:`Namespace`, :func:`as_key`);
* ``adapter``: the core of the engine adapters (:mod:`kvtier.client.vllm`,
  :mod:`kvtier.client.sglang`): their ``kvtier_*`` settings parser, shared defaults and the
  breaker that bypasses a failed daemon for ``retry_s`` and reconnects in the background;
* ``transport``: what all of them share: where the daemon is (``KVTIER_SOCKET``), the channel,
  the session stream, and the one error type, :class:`KvtierError`, with a subclass per
  status code a caller acts on (``KVConnectorError`` is the same class).
"""

from kvtier.client.engine.connector import ExportError, KVConnector, KVConnectorError, SharedKVArena, Transfer
from kvtier.client.engine.keys import Namespace, as_key, block_keys
from kvtier.client.engine.sidecar import AsyncSidecar, PutResult, Sidecar
from kvtier.client.engine.transport import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    ResourceExhausted,
    Unavailable,
)

__all__ = ["AsyncSidecar", "DeadlineExceeded", "ExportError", "FailedPrecondition", "InvalidArgument", "KVConnector",
           "KVConnectorError", "KvtierError", "Namespace", "PutResult", "ResourceExhausted", "SharedKVArena",
           "Sidecar", "Transfer", "Unavailable", "as_key", "block_keys"]

"""The engine library: what an engine process embeds to use its node's kvtierd.

``Sidecar`` / ``AsyncSidecar`` (sessions, puts and gets through the host pool, lookups from the
shared-memory key table), ``KVConnector`` (the engine's registered KV memory: GPU <-> host
copies done by the daemon), and the key scheme (``block_keys``, ``Namespace``).
"""

from kvtier.client.engine.connector import ExportError, KVConnector, KVConnectorError, SharedKVArena, Transfer
from kvtier.client.engine.keys import Namespace, as_key, block_keys
from kvtier.client.engine.sidecar import AsyncSidecar, InvalidArgument, KvtierError, PutResult, Sidecar

__all__ = ["AsyncSidecar", "ExportError", "InvalidArgument", "KVConnector", "KVConnectorError", "KvtierError",
           "Namespace", "PutResult", "SharedKVArena", "Sidecar", "Transfer", "as_key", "block_keys"]

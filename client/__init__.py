"""What engines, routers and tools embed: the sidecar, key hashing, and the CLI."""

from kvtier.client.keys import Namespace, as_key, block_keys
from kvtier.client.sidecar import AsyncSidecar, InvalidArgument, KvtierError, PutResult, Sidecar

__all__ = ["AsyncSidecar", "InvalidArgument", "KvtierError", "Namespace", "PutResult", "Sidecar",
           "as_key", "block_keys"]

"""What other programs embed, split by audience:

* ``kvtier.client.engine``: the engine library (sidecars, the KV connector, key hashing);
* ``kvtier.client.routing``: the location feed and index, the scorer, the router;
* ``kvtier.client.tools``: the CLI, report, replay and demo;
* ``kvtier.client.testing``: a real daemon in a subprocess, for tests and benchmarks.

The engine library's main names are re-exported here.
"""

from kvtier.client.engine import (
    AsyncSidecar,
    InvalidArgument,
    KvtierError,
    Namespace,
    PutResult,
    Sidecar,
    as_key,
    block_keys,
)

__all__ = ["AsyncSidecar", "InvalidArgument", "KvtierError", "Namespace", "PutResult", "Sidecar",
           "as_key", "block_keys"]

"""What other programs embed, split by audience:

* ``kvtier.client.engine``: the engine library (sidecars, the KV connector, key hashing, and
  the core the engine adapters share: settings, the bypass after a failure);
* ``kvtier.client.vllm``, ``kvtier.client.sglang``: the engine adapters (vLLM's offloading
  spec, SGLang's HiCache storage backend);
* ``kvtier.client.routing``: the location feed and index, the scorer, the router;
* ``kvtier.client.tools``: the CLI, report, replay and demo, and a real daemon in a subprocess
  (``local_daemon``: the demo's, the tests' and the benchmarks').

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

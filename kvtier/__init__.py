"""kvtier: a tiered KV-cache offload daemon for LLM serving.

The parts live in sub-packages (docs/DESIGN.md, "Parts"): ``kvtier.proto`` (wire contract),
``kvtier.tiers`` (storage and movement, and the shared vocabulary ``kvtier.tiers.vocab``),
``kvtier.daemon`` (the kvtierd process) and ``kvtier.client`` (what engines, routers and tools
embed: ``client.engine``, ``client.vllm``, ``client.sglang``, ``client.routing``, ``client.tools``).
"""

__version__ = "0.1.0"

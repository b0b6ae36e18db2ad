"""kvtier: a tiered KV-cache offload daemon for LLM serving.

The parts live in sub-packages (see ../DESIGN and README): ``kvtier.proto`` (wire
contract), ``kvtier.tiers`` (storage and movement), ``kvtier.daemon`` (the kvtierd
process) and ``kvtier.client`` (what engines and routers embed).
"""

__version__ = "0.1.0"

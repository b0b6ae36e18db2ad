"""vLLM's offload keys and KV pages in kvtier's terms: :class:`KeyMap` (one 16-byte kvtier key
per block of a chunk), :func:`group_layout` (the kvtier layout of a worker's pages),
:func:`block_keys_for` and the load and store specs the manager hands the worker."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec

from kvtier.client.engine.keys import Namespace
from kvtier.tiers.layout import DTYPE_BYTES, Layout, TensorSpec


class KeyMap:
    """vLLM offload keys -> kvtier keys: one 16-byte key per block of a chunk (the package docstring)."""

    def __init__(self, namespace: Namespace | Callable[[], Namespace], blocks_per_chunk: int) -> None:
        # a callable: resolved on first use (the daemon's secret tenant salt, asked for then)
        self._namespace = namespace
        self._digest = namespace.digest() if isinstance(namespace, Namespace) else None
        self.blocks_per_chunk = blocks_per_chunk
        # block i of a chunk: its distance from the chunk's last block, whose hash the offload
        # key is, so (hash of block k, d) names block k - d whatever blocks_per_chunk an engine
        # uses (counted from the chunk's first block, engines with other chunk sizes met on
        # the same keys for different blocks)
        self._suffix = [(blocks_per_chunk - 1 - i).to_bytes(4, "little") for i in range(blocks_per_chunk)]

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            assert callable(self._namespace)
            self._digest = self._namespace().digest()
        return self._digest

    def chunk(self, key: bytes) -> tuple[bytes, ...]:
        return tuple(hashlib.blake2b(bytes(key) + s, digest_size=16, key=self.digest).digest()
                     for s in self._suffix)


def group_layout(config: Any, rank: int, num_blocks: int = 1) -> Layout:
    """The kvtier layout of one worker's KV pages for vLLM's (single) offloaded group.

    Built from vLLM's offloading config alone, so the scheduler and every worker agree on it:
    one tensor per layer, ``[num_blocks, page]`` in the KV dtype, where a layer's page is the
    worker's KV bytes per block split evenly over the group's layers (the worker checks its
    tensors against it)."""
    group = config.groups[0]
    layers = group.layer_names
    raw = str(config.model.dtype)
    dtype = raw if raw in DTYPE_BYTES else "uint8"
    total = config.worker_kv_bytes_per_block
    if not layers or total <= 0 or total % len(layers):
        raise ValueError(f"kvtier: {total} KV bytes per block do not split over {len(layers)} layers")
    page = total // len(layers)
    if page % DTYPE_BYTES[dtype]:
        dtype = "uint8"
    elems = page // DTYPE_BYTES[dtype]
    # a KV dtype carried as bytes (fp8 variants, int8 with scales) names itself in the tensor
    # names, so two such dtypes of one model never share a layout fingerprint (nor blocks)
    tag = "" if dtype == raw else f"@{raw}"
    tensors = tuple(TensorSpec(name + tag, dtype, (num_blocks, elems), 0) for name in layers)
    return Layout(tensors, group.tokens_per_block, tp_rank=rank, tp_size=config.parallel.world_size)


def block_keys_for(chunks: Sequence[tuple[bytes, ...]], spec: GPULoadStoreSpec,
                   blocks_per_chunk: int) -> list[bytes]:
    """The kvtier key of each engine block of ``spec`` (one group), given the keys of the
    chunks it spans in order: the first chunk may start at block ``block_indices[0] %
    blocks_per_chunk`` (a load that starts mid-chunk), the last may end early."""
    size = int(spec.group_sizes[0])
    skip = int(spec.block_indices[0]) % blocks_per_chunk
    if len(chunks) != -(-(size + skip) // blocks_per_chunk) or len(spec.block_ids) != size:
        raise ValueError(f"{len(chunks)} chunks for {size} blocks starting at {skip} of {blocks_per_chunk}")
    return [chunks[(skip + j) // blocks_per_chunk][(skip + j) % blocks_per_chunk] for j in range(size)]


class KvtierLoadSpec(LoadStoreSpec):
    """Where a load comes from: the kvtier keys of each chunk, in the order vLLM gave them."""

    def __init__(self, chunks: list[tuple[bytes, ...]]) -> None:
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"KvtierLoadSpec({len(self.chunks)} chunks)"


class KvtierStoreSpec(LoadStoreSpec):
    """Where a store goes: the kvtier keys of each chunk to store, in ``keys_to_store`` order."""

    def __init__(self, chunks: list[tuple[bytes, ...]]) -> None:
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"KvtierStoreSpec({len(self.chunks)} chunks)"


def check_supported(config: Any) -> None:
    p = config.parallel
    if len(config.groups) != 1:
        raise ValueError(f"kvtier supports models with one KV-cache group (full attention); this one has "
                         f"{len(config.groups)} (vLLM recomputes failed loads block by block only with one)")
    if p.pp_size != 1 or p.pcp_size != 1 or p.dcp_size != 1:
        raise ValueError("kvtier supports tensor parallelism only: no pipeline or context parallelism")



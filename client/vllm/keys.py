"""vLLM's offload keys and KV pages in kvtier's terms: :class:`KeyMap` (one 16-byte kvtier key
per block of a chunk), :func:`group_layout` (the kvtier layout of a worker's pages of one
KV-cache group), :func:`group_block_keys` (a transfer's keys, group by group) and the load and
store specs the manager hands the worker."""

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


def group_layout(config: Any, rank: int, num_blocks: int = 1, group: int = 0) -> Layout:
    """The kvtier layout of one worker's KV pages of vLLM's offloaded group ``group`` (its
    position in ``config.groups``).

    Built from vLLM's offloading config alone, so the scheduler and every worker agree on it:
    one tensor per layer of the group, ``[num_blocks, page]`` in the KV dtype, where a layer's
    page is the worker's KV bytes per block split evenly over the group's layers. That is how
    vLLM lays out the KV cache of every model: one group's pages, or, with several groups
    (sliding-window, linear-attention or Mamba layers beside full attention), groups of equal
    layer counts whose layers share one padded page size and one tensor per position (the
    worker checks its tensors against it and refuses a model laid out otherwise). Each group
    is a layout of its own: a sliding-window block and a full-attention block at the same
    position are different objects, of different layers."""
    g = config.groups[group]
    layers = g.layer_names
    raw = str(config.model.dtype)
    dtype = raw if raw in DTYPE_BYTES else "uint8"
    total = config.worker_kv_bytes_per_block
    if not layers or total <= 0 or total % len(layers):
        raise ValueError(f"kvtier: {total} KV bytes per block do not split over the {len(layers)} layers of "
                         f"KV-cache group {g.group_id}")
    page = total // len(layers)
    if page % DTYPE_BYTES[dtype]:
        dtype = "uint8"
    elems = page // DTYPE_BYTES[dtype]
    # a KV dtype carried as bytes (fp8 variants, int8 with scales) names itself in the tensor
    # names, so two such dtypes of one model never share a layout fingerprint (nor blocks)
    tag = "" if dtype == raw else f"@{raw}"
    tensors = tuple(TensorSpec(name + tag, dtype, (num_blocks, elems), 0) for name in layers)
    return Layout(tensors, g.tokens_per_block, tp_rank=rank, tp_size=config.parallel.world_size)


def group_layouts(config: Any, rank: int, num_blocks: int = 1) -> list[Layout]:
    """:func:`group_layout` of every offloaded group, in ``config.groups`` order."""
    return [group_layout(config, rank, num_blocks, g) for g in range(len(config.groups))]


def offload_group(key: bytes) -> int:
    """The KV-cache group id an offload key names (vLLM's ``make_offload_key``: the block hash,
    then the group id as 4 bytes big-endian)."""
    return int.from_bytes(bytes(key[-4:]), "big")


def block_keys_for(chunks: Sequence[tuple[bytes, ...]], spec: GPULoadStoreSpec,
                   blocks_per_chunk: int) -> list[bytes]:
    """The kvtier key of each engine block of ``spec`` (one group), given the keys of the
    chunks it spans in order: the first chunk may start at block ``block_indices[0] %
    blocks_per_chunk`` (a load that starts mid-chunk), the last may end early."""
    (part,) = group_block_keys(chunks, spec, blocks_per_chunk)
    return part[1]


def group_block_keys(chunks: Sequence[tuple[bytes, ...]], spec: GPULoadStoreSpec,
                     blocks_per_chunk: int) -> list[tuple[int, list[bytes], slice]]:
    """Per group of ``spec`` (vLLM orders a transfer's blocks group by group: ``group_sizes[g]``
    blocks of group ``g`` from its block index ``block_indices[g]``, and its chunks the same
    way): ``(g, the kvtier key of each of its engine blocks, its slice of spec.block_ids)``,
    for the groups with blocks. Raises ValueError when the chunks do not cover the blocks."""
    out: list[tuple[int, list[bytes], slice]] = []
    c = b = 0
    for g, (size, index) in enumerate(zip(spec.group_sizes, spec.block_indices, strict=True)):
        size = int(size)
        if size == 0:
            continue
        skip = int(index) % blocks_per_chunk
        n = -(-(size + skip) // blocks_per_chunk)
        mine = chunks[c:c + n]
        if len(mine) != n:
            break
        out.append((g, [mine[(skip + j) // blocks_per_chunk][(skip + j) % blocks_per_chunk] for j in range(size)],
                    slice(b, b + size)))
        c, b = c + n, b + size
    if c != len(chunks) or b != len(spec.block_ids) or sum(int(s) for s in spec.group_sizes) != b:
        raise ValueError(f"{len(chunks)} chunks for blocks {list(spec.group_sizes)} starting at "
                         f"{list(spec.block_indices)} of {blocks_per_chunk} a chunk")
    return out


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
    """Refuse, at start and with the reason, what the spec cannot serve."""
    p = config.parallel
    if p.pp_size != 1 or p.pcp_size != 1 or p.dcp_size != 1:
        raise ValueError("kvtier supports tensor parallelism only: no pipeline or context parallelism (vLLM's "
                         "offloading config gives a worker no way to name its pipeline stage's layers, and context "
                         "parallelism shards a block's tokens); run pipeline stages as separate engines, or use "
                         "tensor parallelism")
    if not config.groups:
        raise ValueError("kvtier: vLLM offered no KV-cache group to offload")
    for g in range(len(config.groups)):
        group_layout(config, 0, 1, g)  # each group's pages split over its layers, or a ValueError naming it

"""Block layouts: how an engine's paged KV cache is laid out, and what one block's payload is.

A :class:`Layout` lists the tensors of one model shard in payload order. A block's payload in
the host and disk tiers is one contiguous byte string: the block's slice of each tensor, one
after the other. For a tensor indexed by engine block id (vLLM: ``[2, num_blocks, ...]`` with
``block_dim=1``, or ``[num_blocks, 2, ...]`` with ``block_dim=0``) the slice is everything but
that dimension at one index. For a token-indexed tensor (SGLang page size 1) the slice is
``block_tokens`` rows along ``block_dim``.

The fingerprint is a hash of the canonical JSON of everything that fixes the payload's bytes:
tensor names, dtypes, shapes *without the extent of the block dimension* (two engines with
different numbers of GPU blocks share blocks), block tokens, tensor-parallel rank and size.
Blocks of different fingerprints never mix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

#: bytes per element of every dtype name a layout may use
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}

SLOT_ALIGN = 4096

# -- limits (a layout comes off the wire: each field is bounded, each refusal names its limit) --
MAX_TENSORS = 4096          #: tensors in one layout (SGLang: 2 per layer)
MAX_DIMS = 8                #: dimensions of one tensor's shape
MAX_EXTENT = 1 << 40        #: extent of one dimension
MAX_NAME_CHARS = 128        #: characters of a tensor name (and of a dtype name)
MAX_BLOCK_TOKENS = 1 << 16  #: tokens of one block
MAX_TP_SIZE = 4096          #: tensor-parallel size
MAX_BLOCK_BYTES = 1 << 30   #: payload bytes of one block (1 GiB): one host slot
MAX_LAYOUTS = 256           #: layouts one daemon accepts (each its own id, stats and NodeInfo entry)
MAX_SLOT_SIZES = 16         #: distinct slot sizes one daemon accepts (each a pool file and an fd)


class LayoutError(ValueError):
    """A layout that cannot describe a paged KV cache; the message says which field."""


@dataclass(frozen=True)
class TensorSpec:
    """One KV tensor: its name, dtype, full shape and the dimension blocks (or tokens) index."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    block_dim: int
    token_indexed: bool = False

    def slice_elems(self, block_tokens: int) -> int:
        """Elements of this tensor that belong to one block."""
        n = 1
        for i, extent in enumerate(self.shape):
            if i != self.block_dim:
                n *= extent
        return n * (block_tokens if self.token_indexed else 1)

    def canonical(self) -> dict:
        shape = list(self.shape)
        shape[self.block_dim] = -1
        return {"name": self.name, "dtype": self.dtype, "shape": shape,
                "block_dim": self.block_dim, "token_indexed": self.token_indexed}


def _short(text: str, n: int = 40) -> str:
    """``text`` cut for a message (the names checked here come off the wire, of any length)."""
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"


def check_tensor_count(n: int) -> None:
    if n > MAX_TENSORS:
        raise LayoutError(f"{n} tensors; the limit is {MAX_TENSORS} tensors per layout")


def check_dims(name: str, ndim: int) -> None:
    if ndim > MAX_DIMS:
        raise LayoutError(f"tensor {_short(name)}: {ndim} dimensions; the limit is {MAX_DIMS} per tensor")


def _validate_tensor(t: TensorSpec) -> None:
    """Refuse a tensor with a field out of its bounds (see the limits above)."""
    if len(t.name) > MAX_NAME_CHARS:
        raise LayoutError(f"tensor name {_short(t.name)} is too long; the limit is {MAX_NAME_CHARS} characters")
    if t.dtype not in DTYPE_BYTES:
        raise LayoutError(f"tensor {_short(t.name)}: unknown dtype {_short(t.dtype)}; known: {sorted(DTYPE_BYTES)}")
    check_dims(t.name, len(t.shape))
    if not t.shape or any(d <= 0 for d in t.shape):
        raise LayoutError(f"tensor {_short(t.name)}: shape {list(t.shape)} must be non-empty and positive")
    if any(d > MAX_EXTENT for d in t.shape):
        raise LayoutError(f"tensor {_short(t.name)}: shape {list(t.shape)} has an extent over the limit of "
                          f"{MAX_EXTENT} (2^40) per dimension")
    if not 0 <= t.block_dim < len(t.shape):
        raise LayoutError(f"tensor {_short(t.name)}: block_dim {t.block_dim} is outside shape {list(t.shape)}")


@dataclass(frozen=True)
class Layout:
    """The tensors of one model shard in payload order, plus block tokens and TP rank/size."""

    tensors: tuple[TensorSpec, ...]
    block_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    _fingerprint: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "_fingerprint", hashlib.blake2b(blob, digest_size=16).digest())

    def _validate(self) -> None:
        if not self.tensors:
            raise LayoutError("layout has no tensors: list every KV tensor of the model shard")
        check_tensor_count(len(self.tensors))
        if not 0 < self.block_tokens <= MAX_BLOCK_TOKENS:
            raise LayoutError(f"block_tokens must be 1 to {MAX_BLOCK_TOKENS}, got {self.block_tokens}")
        if not 0 < self.tp_size <= MAX_TP_SIZE:
            raise LayoutError(f"tp_size must be 1 to {MAX_TP_SIZE}, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        names = set()
        for t in self.tensors:
            _validate_tensor(t)
            if t.name in names:
                raise LayoutError(f"tensor name {t.name!r} appears twice")
            names.add(t.name)
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise LayoutError(f"one block would be {self.block_bytes} bytes; the limit is {MAX_BLOCK_BYTES} "
                              f"(1 GiB) per block: use fewer block_tokens or split the layout")

    def canonical(self) -> dict:
        return {"tensors": [t.canonical() for t in self.tensors], "block_tokens": self.block_tokens,
                "tp_rank": self.tp_rank, "tp_size": self.tp_size}

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    @property
    def block_bytes(self) -> int:
        """Payload size of one block: the sum of its slices of every tensor."""
        return sum(t.slice_elems(self.block_tokens) * DTYPE_BYTES[t.dtype] for t in self.tensors)

    @property
    def slot_bytes(self) -> int:
        """Block bytes rounded up to 4 KiB (O_DIRECT and page alignment)."""
        return -(-self.block_bytes // SLOT_ALIGN) * SLOT_ALIGN

    def tensor_offsets(self) -> list[int]:
        """Byte offset of each tensor's slice inside one block's payload."""
        out, off = [], 0
        for t in self.tensors:
            out.append(off)
            off += t.slice_elems(self.block_tokens) * DTYPE_BYTES[t.dtype]
        return out

    # -- constructors for the common engine layouts -------------------------------------

    @classmethod
    def vllm(cls, num_layers: int, num_blocks: int, block_tokens: int, kv_heads: int, head_dim: int,
             dtype: str = "bfloat16", kv_first: bool = True, tp_rank: int = 0, tp_size: int = 1) -> Layout:
        """vLLM per-layer tensors: ``[2, num_blocks, block_tokens, kv_heads, head_dim]`` when
        ``kv_first`` (flash-attention backend), else ``[num_blocks, 2, block_tokens, ...]``."""
        if kv_first:
            shape, block_dim = (2, num_blocks, block_tokens, kv_heads, head_dim), 1
        else:
            shape, block_dim = (num_blocks, 2, block_tokens, kv_heads, head_dim), 0
        tensors = tuple(TensorSpec(f"L{i}", dtype, shape, block_dim) for i in range(num_layers))
        return cls(tensors, block_tokens, tp_rank, tp_size)

    @classmethod
    def sglang(cls, num_layers: int, num_tokens: int, block_tokens: int, kv_heads: int, head_dim: int,
               dtype: str = "bfloat16", tp_rank: int = 0, tp_size: int = 1) -> Layout:
        """SGLang MHA token pool, page size 1: per layer separate K and V buffers
        ``[num_tokens, kv_heads, head_dim]``; a block is ``block_tokens`` gathered rows."""
        tensors = []
        for i in range(num_layers):
            for kv in ("K", "V"):
                tensors.append(TensorSpec(f"L{i}.{kv}", dtype, (num_tokens, kv_heads, head_dim), 0, True))
        return cls(tuple(tensors), block_tokens, tp_rank, tp_size)

    @classmethod
    def flat(cls, block_bytes: int, block_tokens: int = 16, num_blocks: int = 1, name: str = "kv") -> Layout:
        """An opaque layout of ``block_bytes`` per block (tests, benchmarks, CPU-only clients)."""
        return cls((TensorSpec(name, "uint8", (num_blocks, block_bytes), 0),), block_tokens)


def layout_to_proto(layout: Layout, msg_cls: type) -> object:
    """Fill a ``kvtier.v1.LayoutSpec`` (passed as ``msg_cls`` to keep tiers free of proto imports)."""
    msg = msg_cls(block_tokens=layout.block_tokens, tp_rank=layout.tp_rank, tp_size=layout.tp_size)
    for t in layout.tensors:
        msg.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape), block_dim=t.block_dim,
                        token_indexed=t.token_indexed)
    return msg


def layout_from_proto(msg: object) -> Layout:
    """Build a :class:`Layout` from a ``kvtier.v1.LayoutSpec``; raises :class:`LayoutError`."""
    tensors: Sequence = msg.tensors  # type: ignore[attr-defined]
    check_tensor_count(len(tensors))  # before a spec is built for each
    for t in tensors:
        check_dims(t.name, len(t.shape))
    specs: Sequence[TensorSpec] = tuple(
        TensorSpec(t.name, t.dtype, tuple(int(x) for x in t.shape), int(t.block_dim), bool(t.token_indexed))
        for t in tensors)
    tp_size = int(msg.tp_size) or 1  # type: ignore[attr-defined]
    return Layout(tuple(specs), int(msg.block_tokens), int(msg.tp_rank), tp_size)  # type: ignore[attr-defined]

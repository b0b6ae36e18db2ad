"""Copies between callers' buffers and the pool mapping: a put's copy takes each block's
checksum on the way, and large batches are copied on several threads.

A put copies each block into its granted slot anyway; :func:`copy_hash` copies it in chunks
of ``CHUNK_BYTES`` and feeds each chunk, while it is in the cache, to a streaming xxh3-64, so
the checksum costs a read from the cache, not a second pass over memory (nor the daemon's
CPU: the client sends the checksums with its Commit, docs/DESIGN.md "Client checksums"). The
result is exactly ``payload_checksum`` (xxh3-64 of the whole payload) of the bytes copied.

The compiled extension ``kvtier.tiers._copyhash`` (tiers/_copyhash.c, built by ``pip
install``) does a block in one call with the GIL released, hashing each chunk of the source
and then copying it from the cache with non-temporal stores (no read of each destination
line first: the pool's 4 KiB shared-memory pages make that dear); without it (no compiler
at install) numpy copies and the xxhash package hashes, same answers, slower
(``COMPILED`` says which; ``compiled=False`` on the functions forces numpy, for tests).

A batch of at least ``PARALLEL_MIN_BYTES`` is split, block by block, over ``COPY_THREADS``
threads (the caller's and a shared pool's): the pool's pages are 4 KiB shared-memory pages,
and one thread copying into or out of them reaches about two thirds of a memcpy between two
huge-page buffers on the machines we measured (bench/host_tier.py); two threads recover it.
numpy's copies and xxhash's updates release the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
import xxhash

try:
    from kvtier.tiers import _copyhash
except ImportError:  # built without a C compiler: numpy and the xxhash package (same answers)
    _copyhash = None

CHUNK_BYTES = 256 << 10            # hashed while in the cache (well inside L2)
# threads a large batch is copied on: $KVTIER_COPY_THREADS, else the CPUs up to 4 (read at import)
COPY_THREADS = max(1, int(os.environ.get("KVTIER_COPY_THREADS") or min(4, os.cpu_count() or 1)))
PARALLEL_MIN_BYTES = 8 << 20      # smaller batches: one thread (a handoff costs more than it saves)

COMPILED = _copyhash is not None

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()
T = TypeVar("T")


def copy_hash(dst: np.ndarray, src: np.ndarray, compiled: bool = True) -> int:
    """Copy ``src`` into ``dst`` (flat uint8 arrays of one size); the xxh3-64 of the bytes copied."""
    if compiled and _copyhash is not None:
        return _copyhash.copy_hash(dst, src)
    n = dst.size
    if n <= CHUNK_BYTES:
        dst[:] = src
        return xxhash.xxh3_64_intdigest(dst)
    h = xxhash.xxh3_64()
    for o in range(0, n, CHUNK_BYTES):
        d = dst[o:o + CHUNK_BYTES]
        d[:] = src[o:o + CHUNK_BYTES]
        h.update(d)
    return h.intdigest()


def _executor() -> ThreadPoolExecutor:
    """The shared copy threads; a new pool in a forked child (the parent's threads are not there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvtier-copy")
            _pool_pid = os.getpid()
        return _pool


def _striped(n: int, nbytes: int, run: Callable[[range], list[T]]) -> list[T]:
    """``run`` over all of ``range(n)``: in one call, or striped over the copy threads (the
    caller runs the first stripe) when the batch is large; results in index order."""
    k = min(COPY_THREADS, n)
    if k <= 1 or nbytes < PARALLEL_MIN_BYTES:
        return run(range(n))
    futures = [_executor().submit(run, range(i, n, k)) for i in range(1, k)]
    try:
        parts = [run(range(0, n, k))]
    finally:  # every stripe ends before the caller goes on (a failed put gives its slots back)
        wait(futures)
    parts += [f.result() for f in futures]
    out: list[T] = [None] * n  # type: ignore[list-item]
    for i, part in enumerate(parts):
        out[i::k] = part
    return out


def put_blocks(pool: np.ndarray, offsets: Sequence[int], arrs: Sequence[np.ndarray],
               compiled: bool = True) -> list[int]:
    """Copy ``arrs[i]`` into ``pool`` at ``offsets[i]``; each block's xxh3-64 as copied."""
    def run(idx: range) -> list[int]:
        return [copy_hash(pool[offsets[i]:offsets[i] + arrs[i].size], arrs[i], compiled) for i in idx]
    return _striped(len(arrs), sum(a.size for a in arrs), run)


def get_blocks(pool: np.ndarray, offsets: Sequence[int], dsts: Sequence[np.ndarray], compiled: bool = True) -> None:
    """Copy the block at ``offsets[i]`` of ``pool`` into ``dsts[i]``."""
    fast = _copyhash.copy if compiled and _copyhash is not None else None

    def run(idx: range) -> list[None]:
        for i in idx:
            src = pool[offsets[i]:offsets[i] + dsts[i].size]
            if fast is not None:
                fast(dsts[i], src)
            else:
                dsts[i][:] = src
        return [None] * len(idx)
    _striped(len(dsts), sum(d.size for d in dsts), run)

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
Both take any C-contiguous buffers and count bytes, whatever the dtype; ``dst`` and ``src``
must not overlap. ``KVTIER_COPYHASH_BASELINE=1`` (read when the extension is imported)
makes the extension use its baseline loop even where the CPU has AVX2 (``_copyhash.AVX2``
says which loop runs).

A batch of at least ``PARALLEL_MIN_BYTES`` is copied block by block on ``COPY_THREADS``
threads (the caller's and a shared pool's, each taking the next block when it is free): the
pool's pages are 4 KiB shared-memory pages, and one thread copying into or out of them
reaches about two thirds of a memcpy between two huge-page buffers on the machine we
measured (bench/host_tier.py); two threads make that up where the second core is free.
numpy's copies and xxhash's updates release the GIL.
"""

from __future__ import annotations

import itertools
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


def _bytes_of(a: np.ndarray, writable: bool) -> np.ndarray:
    """``a``'s bytes as a flat uint8 view (as the compiled copy takes it: any dtype, bytes
    counted); TypeError for a non-contiguous buffer, or a read-only one where ``writable``."""
    m = memoryview(a)
    if writable and m.readonly:
        raise TypeError(f"the destination ({type(a).__name__}) is read-only")
    return np.frombuffer(m.cast("B"), dtype=np.uint8)


def copy_hash(dst: np.ndarray, src: np.ndarray, compiled: bool = True) -> int:
    """Copy ``src`` into ``dst`` (C-contiguous buffers of as many bytes); the xxh3-64 of the bytes copied."""
    if compiled and _copyhash is not None:
        return _copyhash.copy_hash(dst, src)
    dst, src = _bytes_of(dst, True), _bytes_of(src, False)
    n = dst.size
    if n != src.size or (n and np.may_share_memory(dst, src)):
        raise ValueError(f"dst is {n} bytes but src is {src.size}" if n != src.size else "dst and src overlap")
    if n <= CHUNK_BYTES:
        dst[:] = src
        return xxhash.xxh3_64_intdigest(dst)
    h = xxhash.xxh3_64()
    for o in range(0, n, CHUNK_BYTES):
        d = dst[o:o + CHUNK_BYTES]
        d[:] = src[o:o + CHUNK_BYTES]
        h.update(d)
    return h.intdigest()


def _after_fork_in_child() -> None:
    """A child forked while a thread held ``_pool_lock`` would wait for it forever: a fresh lock."""
    global _pool_lock
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _executor() -> ThreadPoolExecutor:
    """The shared copy threads; a new pool in a forked child (the parent's threads are not there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvtier-copy")
            _pool_pid = os.getpid()
        return _pool


def _shared(n: int, nbytes: int, one: Callable[[int], T]) -> list[T]:
    """``[one(i) for i in range(n)]``; for a large batch on the copy threads, the caller's among
    them, each taking the next index as it gets to it (a thread the machine's load holds up
    does less, the others more). Every thread has stopped when this returns or raises."""
    k = min(COPY_THREADS, n)
    if k <= 1 or nbytes < PARALLEL_MIN_BYTES:
        return [one(i) for i in range(n)]
    out: list[T] = [None] * n  # type: ignore[list-item]
    todo = itertools.count()  # next() is atomic (C, under the GIL)
    failed: list[BaseException] = []

    def work() -> None:
        for i in todo:
            if i >= n or failed:
                return
            try:
                out[i] = one(i)
            except BaseException as e:
                failed.append(e)
                raise

    futures = []
    try:
        for _ in range(k - 1):
            futures.append(_executor().submit(work))
    except RuntimeError:  # the pool is shut down (interpreter exit): the threads started, and the caller's
        pass
    try:
        work()
    finally:  # every thread stops before the caller goes on (a failed put gives its slots back)
        _wait_all(futures, failed)
    for f in futures:
        f.result()
    return out


def _wait_all(futures: list, failed: list[BaseException]) -> None:
    """Wait for every copy thread, through Ctrl-C too: a thread still copying into a slot that
    the aborted put then gives back would write into another block. A Ctrl-C during the wait
    stops the threads at their next block and is raised once they have stopped."""
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            wait(futures)
            break
        except KeyboardInterrupt as e:
            failed.append(e)
            interrupted = e
    if interrupted is not None:
        raise interrupted


def put_blocks(pool: np.ndarray, offsets: Sequence[int], arrs: Sequence[np.ndarray],
               compiled: bool = True) -> list[int]:
    """Copy ``arrs[i]`` into ``pool`` at ``offsets[i]``; each block's xxh3-64 as copied."""
    def one(i: int) -> int:
        return copy_hash(pool[offsets[i]:offsets[i] + arrs[i].nbytes], arrs[i], compiled)
    return _shared(len(arrs), sum(a.nbytes for a in arrs), one)


def get_blocks(pool: np.ndarray, offsets: Sequence[int], dsts: Sequence[np.ndarray], compiled: bool = True) -> None:
    """Copy the block at ``offsets[i]`` of ``pool`` into ``dsts[i]``."""
    fast = _copyhash.copy if compiled and _copyhash is not None else None

    def one(i: int) -> None:
        src = pool[offsets[i]:offsets[i] + dsts[i].nbytes]
        if fast is not None:
            fast(dsts[i], src)
        else:
            d = _bytes_of(dsts[i], True)
            if d.size != src.size:
                raise ValueError(f"dst is {d.size} bytes but src is {src.size}")
            d[:] = src
    _shared(len(dsts), sum(d.nbytes for d in dsts), one)

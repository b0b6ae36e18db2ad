"""Copy engines: move batches of KV blocks between an engine's KV memory and the host pool.

Primitives and their contract
    ``attach_pool(path, size)``
        Map a host pool file read-write (the host tier's tmpfs file, same bytes clients see)
        and, for CUDA, touch it in parallel and ``cudaHostRegister`` it once. Returns the
        seconds per GiB that took. The engine owns the mapping until ``close``.
    ``open_kv(allocations, ring)`` -> :class:`KVMemory`
        Open an engine's KV memory: each allocation once (CUDA: ``cudaIpcOpenMemHandle``;
        stand-in: ``mmap`` of a file descriptor the engine passed, see "Engine memory on the
        stand-in" below), and its ring of completion events (CUDA: ``cudaIpcOpenEventHandle``
        per slot; stand-in: a descriptor of uint64 sequence numbers).
        The caller owns the returned memory and must ``close_kv`` it exactly once, after
        every copy issued on it has completed (``Completion.wait_done``).
    ``copy(mem, plan, direction, slot, seq, wait_written)`` -> :class:`Completion`
        Copy every chunk of ``plan`` (built by :func:`plan_chunks`) in ``direction``
        (``OFFLOAD``: engine memory -> pool; ``ONBOARD``: pool -> engine memory). When
        ``wait_written`` is set the copy first waits for the engine's "KV written" record in
        ``slot``; when the copy completes, completion is recorded into ``slot``. The stand-in's
        ring holds a uint64 per slot: the engine writes ``2*seq`` ("KV written") before asking,
        the copy engine writes ``2*seq + 1`` when the copy is complete. May block the calling thread (never call it on an event
        loop). It returns once the completion record is *issued*: on CUDA that is at
        enqueue time, on the stand-in once the bytes are copied. ``Completion.wait_done``
        blocks until the bytes are in place; only then may the caller publish pool slots
        it wrote (offload) or release pool slots it read (onboard).
    ``cancel(mem)``
        The engine is gone: a copy still waiting for its "KV written" record gives up with
        :class:`CopyError`, and a copy not started yet is refused.
    ``wait_timeout_s`` (an attribute; kvtierd's ``--transfer-wait-s``) bounds the wait for a
        "KV written" record: past it the copy gives up with :class:`WaitTimeout` and copies
        nothing. CUDA waits for the record on the CPU (cudaEventQuery) before it queues the
        stream wait and the copies: a stream wait cannot be withdrawn, so one on a record the
        engine never reaches would stall the stream for good.
    Offloads are cut into pieces of at most ``piece_bytes`` and onboards are served first
    between pieces, so a small onboard never waits behind a whole large offload (copy
    engines do not honour stream priorities).

Engine memory on the stand-in
    The host copy engine never opens a path: the engine's KV memory and its event ring come
    as file descriptors the engine passed over the unix socket (SCM_RIGHTS), and each must be
    a memfd sealed against shrinking (``F_SEAL_SHRINK``, checked with ``F_GET_SEALS``), so
    that the engine cannot truncate a region the daemon has mapped and kill it with SIGBUS.
    Anything else is refused (:func:`map_sealed_fd`). :func:`sealed_memfd` makes such memory.

Who owns what
    The engine process owns its KV memory and its events; the copy engine only holds opened
    handles, closed by ``close_kv``. The daemon owns pool slots (grants and leases in the
    store) and must keep them held until ``wait_done`` returns.

Backends
    :class:`HostCopyEngine` (the CPU stand-in): engine "device" memory is a shared-memory
    file; worker threads move the bytes with vectorised numpy gathers, onboard jobs ahead of
    offload pieces. :class:`CudaCopyEngine`: a cupy gather/scatter kernel (16-byte accesses,
    one thread block per chunk) over the registered pool mapping, or
    ``cudaMemcpyBatchAsync`` through cuda.bindings; ``backend="auto"`` picks the kernel for
    16-byte aligned chunks under 1 MiB and the batch copy otherwise. cupy and cuda.bindings
    are imported only when a :class:`CudaCopyEngine` is built.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import mmap
import os
import queue
import stat
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.tiers.host import PoolMapping
from kvtier.tiers.layout import DTYPE_BYTES, Layout

log = logging.getLogger("kvtier.copy")

OFFLOAD, ONBOARD = "offload", "onboard"
MADV_POPULATE_WRITE = 23
GIB = 1 << 30


class CopyError(Exception):
    """A copy or registration the engine refuses; the message says what to change."""


class EngineMemoryError(CopyError):
    """Engine memory that cannot be opened from another process (the message names why)."""


_CUDA_ERROR_NOT_READY = 600  # cudaErrorNotReady


class WaitTimeout(CopyError):
    """The engine's "KV written" record did not come within ``wait_timeout_s``; nothing was copied."""


@dataclass(frozen=True)
class AllocationRef:
    """One engine allocation: a CUDA IPC handle (CUDA) or a sealed memfd's descriptor (stand-in)."""

    size: int
    ipc_handle: bytes = b""
    path: str = ""   # refused by the host copy engine (a path names any file): pass ``fd``
    device: int = 0  # CUDA: the device ordinal in the engine's process
    fd: int = -1     # stand-in: a memfd sealed against shrinking (the caller keeps and closes it)
    device_uuid: bytes = b""  # CUDA: the 16-byte UUID of the allocation's GPU (empty: older clients)


@dataclass(frozen=True)
class TensorRef:
    """Where one layout tensor starts: allocation index and byte offset (C-contiguous)."""

    allocation: int
    offset: int


@dataclass(frozen=True)
class EventRing:
    """Completion events of one registration: CUDA IPC event handles, or a stand-in memfd."""

    slots: int
    handles: tuple[bytes, ...] = ()
    path: str = ""   # refused by the host copy engine: pass ``fd``
    fd: int = -1     # stand-in: a memfd sealed against shrinking, ``slots`` uint64s


@dataclass
class ChunkPlan:
    """One batch as flat, equally long arrays: per chunk, its allocation, byte offset there,
    byte offset in the pool and size. Chunks are ordered block by block."""

    alloc: np.ndarray     # int32
    kv_off: np.ndarray    # uint64
    pool_off: np.ndarray  # uint64
    size: np.ndarray      # uint64
    chunks_per_block: int

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())

    def __len__(self) -> int:
        return int(self.size.size)

    def pieces(self, piece_bytes: int) -> list[slice]:
        """Cut into slices of whole blocks, each at most ``piece_bytes`` (at least one block)."""
        n = len(self)
        if n == 0:
            return []
        per_block = self.chunks_per_block
        block_bytes = int(self.size[:per_block].sum())
        blocks = max(1, piece_bytes // max(block_bytes, 1))
        step = blocks * per_block
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def take(self, s: slice) -> ChunkPlan:
        return ChunkPlan(self.alloc[s], self.kv_off[s], self.pool_off[s], self.size[s], self.chunks_per_block)


def tensor_geometry(layout: Layout) -> list[tuple[int, int, int, int]]:
    """Per tensor: (outer, extent, inner_bytes, rows) where a block's slice is ``outer`` runs of
    ``rows`` pieces of ``inner_bytes``, and ``extent`` is the size of the block dimension."""
    out = []
    for t in layout.tensors:
        inner = math.prod(t.shape[t.block_dim + 1:]) * DTYPE_BYTES[t.dtype]
        outer = math.prod(t.shape[:t.block_dim])
        rows = layout.block_tokens if t.token_indexed else 1
        out.append((outer, t.shape[t.block_dim], inner, rows))
    return out


def ids_per_block(layout: Layout) -> int:
    """Engine ids per block: 1 for block-indexed layouts, block_tokens for token-indexed ones."""
    kinds = {t.token_indexed for t in layout.tensors}
    if len(kinds) != 1:
        raise CopyError("a layout mixes token-indexed and block-indexed tensors; register them separately")
    return layout.block_tokens if kinds.pop() else 1


def check_engine_ids(layout: Layout, engine_ids: np.ndarray, nkeys: int) -> np.ndarray:
    """``engine_ids`` as an (nkeys, ids_per_block) int64 array; raises CopyError when the count
    or a value is out of range (nothing has been touched)."""
    per = ids_per_block(layout)
    ids = np.asarray(engine_ids, dtype=np.int64)
    if ids.size != nkeys * per:
        what = f"{per} token indices" if per > 1 else "one engine block id"
        raise CopyError(f"{ids.size} engine ids for {nkeys} keys; this layout takes {what} per key")
    ids = ids.reshape(nkeys, per)
    extent = min(t.shape[t.block_dim] for t in layout.tensors)
    if ids.size and (ids.min() < 0 or ids.max() >= extent):
        bad = int(ids[(ids < 0) | (ids >= extent)][0])
        raise CopyError(f"engine id {bad} is outside [0, {extent}) of the registered KV tensors")
    return ids


def plan_chunks(layout: Layout, tensors: Sequence[TensorRef], ids: np.ndarray,
                pool_offsets: np.ndarray) -> ChunkPlan:
    """Every contiguous chunk of the blocks ``ids`` (from :func:`check_engine_ids`) and where it
    goes in the pool: block i's payload starts at ``pool_offsets[i]`` and lists each tensor's
    slice in layout order, as DESIGN.md's data model says. Vectorised; no per-chunk loop."""
    n = ids.shape[0]
    pool = np.asarray(pool_offsets, dtype=np.int64).reshape(n, 1)
    parts_alloc, parts_kv, parts_pool, parts_size = [], [], [], []
    toff = 0
    for ref, (outer, extent, inner, rows) in zip(tensors, tensor_geometry(layout), strict=True):
        o = np.arange(outer, dtype=np.int64).reshape(1, outer, 1)
        kv = ref.offset + (o * extent + ids.reshape(n, 1, rows)) * inner            # (n, outer, rows)
        unit = np.arange(outer * rows, dtype=np.int64).reshape(1, outer * rows)
        dst = pool + toff + unit * inner                                               # (n, outer*rows)
        parts_kv.append(kv.reshape(n, outer * rows))
        parts_pool.append(dst)
        parts_size.append(np.full((n, outer * rows), inner, dtype=np.int64))
        parts_alloc.append(np.full((n, outer * rows), ref.allocation, dtype=np.int32))
        toff += outer * rows * inner
    per_block = sum(p.shape[1] for p in parts_kv)
    return ChunkPlan(np.concatenate(parts_alloc, axis=1).ravel(),
                     np.concatenate(parts_kv, axis=1).ravel().astype(np.uint64),
                     np.concatenate(parts_pool, axis=1).ravel().astype(np.uint64),
                     np.concatenate(parts_size, axis=1).ravel().astype(np.uint64), per_block)


class KVMemory:
    """An engine's opened KV memory and event ring; each engine subclasses it with what it opened."""

    def __init__(self, allocations: Sequence[AllocationRef], ring: EventRing) -> None:
        self.allocations = list(allocations)
        self.ring = ring
        self.handles_open = 0
        self.events_open = 0
        self.cancelled = False


class HostKVMemory(KVMemory):
    """Stand-in: the mapped engine memory files and the mapped event ring file."""

    def __init__(self, allocations: Sequence[AllocationRef], ring: EventRing) -> None:
        super().__init__(allocations, ring)
        self.maps: list[mmap.mmap] = []
        self.arrays: list[np.ndarray] = []
        self.ring_map: mmap.mmap | None = None
        self.ring_arr: np.ndarray = np.zeros(0, dtype=np.uint64)


class CudaKVMemory(KVMemory):
    """CUDA: the device address of each opened allocation and the opened ring events, on the
    GPU (this process's ordinal) the engine's memory lives on."""

    def __init__(self, allocations: Sequence[AllocationRef], ring: EventRing, local: bool = False,
                 device: int = 0) -> None:
        super().__init__(allocations, ring)
        self.ptrs: list[int] = []
        self.events: list[int] = []
        self.local = local  # this process's own memory: no IPC handle to close
        self.device = device


class Completion:
    """A copy in flight. ``wait_done`` blocks until its bytes are in place."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait

    def wait_done(self) -> None:
        self._wait()


class CopyEngine(ABC):
    """See the module docstring for the contract."""

    name: str = ""
    backend: str = ""  # "cuda" or "host": the kind of engine memory it opens

    def __init__(self, piece_bytes: int) -> None:
        self.piece_bytes = piece_bytes
        self.pin_s_per_gib = 0.0
        self.wait_timeout_s = math.inf  # the stand-in's wait for "KV written" (module docstring)

    @abstractmethod
    def attach_pool(self, path: str, size: int) -> float: ...

    def detach_pool(self, path: str) -> None:  # noqa: B027 - optional: only an engine that pins overrides it
        """One ``attach_pool`` of ``path`` is over (its registration closed); an engine that
        pinned the pool unpins it when the last one is. No copy may be in flight to it."""

    @abstractmethod
    def open_kv(self, allocations: Sequence[AllocationRef], ring: EventRing) -> KVMemory: ...

    @abstractmethod
    def close_kv(self, mem: KVMemory) -> None: ...

    @abstractmethod
    def copy(self, mem: KVMemory, pool_path: str, plan: ChunkPlan, direction: str, slot: int, seq: int,
             wait_written: bool) -> Completion: ...

    def cancel(self, mem: KVMemory) -> None:
        mem.cancelled = True

    @abstractmethod
    def close(self) -> None: ...


def wait_written(reached: Any, mem: KVMemory, slot: int, seq: int, timeout_s: float) -> None:
    """Poll ``reached()`` (the engine's "KV written" record for request ``seq`` in event slot
    ``slot``) with a growing pause, at most ``timeout_s`` (:class:`WaitTimeout`), giving up as
    soon as the engine goes away (``mem.cancelled``: :class:`CopyError`). Nothing was copied
    when either is raised."""
    pause = 20e-6
    deadline = time.monotonic() + timeout_s
    while not reached():
        if mem.cancelled:
            raise CopyError("the engine went away before its KV was written; nothing was copied")
        if time.monotonic() > deadline:
            raise WaitTimeout(f"the engine's \"KV written\" record for request {seq} did not come in event slot "
                              f"{slot} within {timeout_s:g} s (--transfer-wait-s); nothing was copied: record it "
                              f"before asking for the copy")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _pool_for(pools: dict[str, Any], pool_path: str, mem: KVMemory, slot: int) -> Any:
    """The attached pool a copy goes to, after checking its event slot lies in the ring."""
    if not 0 <= slot < mem.ring.slots:
        raise CopyError(f"event slot {slot} is outside the ring of {mem.ring.slots}")
    return pools[pool_path]


def populate_mapping(mm: mmap.mmap, size: int, threads: int) -> None:
    """Fault in every page of a shared mapping from ``threads`` threads (MADV_POPULATE_WRITE,
    Linux >= 5.14; where the kernel does not know it (EINVAL), read one byte per page: a tmpfs
    read fault allocates the page too, and nothing is written, so a sidecar or copy writing the
    live pool meanwhile loses nothing). Any other failure (no memory left for the pool: ENOMEM,
    EFAULT) is a :class:`CopyError`: touching on would kill the daemon with SIGBUS."""
    step = max(2 << 20, -(-size // threads) // mmap.PAGESIZE * mmap.PAGESIZE)
    arr = np.frombuffer(mm, dtype=np.uint8)

    def touch(off: int) -> None:
        length = min(step, size - off)
        try:
            mm.madvise(MADV_POPULATE_WRITE, off, length)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise CopyError(f"faulting in {length} B of the host pool failed: {e.strerror} (is /dev/shm or "
                                f"memory too small for --host-capacity?)") from None
            int(arr[off:off + length:mmap.PAGESIZE].sum())

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(touch, range(0, size, step)))


def _rows(buf: np.ndarray, offsets: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A view of ``buf`` whose row k starts at byte ``k * g`` and is ``size`` long, with g the
    largest stride dividing every offset, and the row index of each offset."""
    g = int(np.gcd.reduce(np.append(offsets, np.uint64(size)).astype(np.int64)))
    rows = (buf.size - size) // g + 1
    view = np.lib.stride_tricks.as_strided(buf, shape=(rows, size), strides=(g, 1))
    return view, (offsets // np.uint64(g)).astype(np.int64)


def _record(mem: HostKVMemory, slot: int, seq: int) -> None:
    """The stand-in's completion record: never moves a slot back below a newer request's
    "KV written" record (an engine that gave up on request ``seq`` may have reused the slot)."""
    ring = mem.ring_arr
    if int(ring[slot]) < 2 * seq + 1:
        ring[slot] = 2 * seq + 1


class HostCopyEngine(CopyEngine):
    """CPU stand-in: engine KV memory is a shared-memory file; ``threads`` workers copy whole
    blocks with numpy (see :func:`_copy_blocks`). A copy is cut into jobs of at most
    ``piece_bytes``; queued onboard jobs run before queued offload jobs, so an onboard waits
    for at most the job each worker is running. The pool is mapped, not touched (its memory
    stays sparse, as the host tier's budget expects)."""

    name = "host"
    backend = "host"

    def __init__(self, threads: int = 4, piece_bytes: int = 8 << 20) -> None:
        super().__init__(piece_bytes)
        self._pools: dict[str, PoolMapping] = {}
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"kvtier-copy-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def attach_pool(self, path: str, size: int) -> float:
        if path in self._pools:
            return self.pin_s_per_gib
        self._pools[path] = PoolMapping(path, size)
        return self.pin_s_per_gib

    def open_kv(self, allocations: Sequence[AllocationRef], ring: EventRing) -> HostKVMemory:
        mem = HostKVMemory(allocations, ring)
        maps: list[mmap.mmap] = []
        try:
            for i, a in enumerate(allocations):
                if a.fd < 0:
                    raise EngineMemoryError(f"allocation {i}: {_FD_ONLY}")
                maps.append(map_sealed_fd(a.fd, a.size, f"allocation {i}"))
                mem.handles_open += 1
            if ring.fd < 0:
                raise EngineMemoryError(f"the event ring: {_FD_ONLY}")
            ring_map = map_sealed_fd(ring.fd, ring.slots * 8, "the event ring")
        except BaseException:
            for m in maps:
                m.close()
            raise
        mem.maps = maps
        mem.arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        mem.ring_map = ring_map
        mem.ring_arr = np.frombuffer(ring_map, dtype=np.uint64)
        mem.events_open = ring.slots
        return mem

    def close_kv(self, mem: KVMemory) -> None:
        assert isinstance(mem, HostKVMemory)
        mem.arrays = []
        mem.ring_arr = np.zeros(0, dtype=np.uint64)
        for m in [*mem.maps, mem.ring_map]:
            try:
                if m is not None:
                    m.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it
        mem.handles_open = mem.events_open = 0

    def copy(self, mem: KVMemory, pool_path: str, plan: ChunkPlan, direction: str, slot: int, seq: int,
             wait_written: bool) -> Completion:
        assert isinstance(mem, HostKVMemory)
        pool = _pool_for(self._pools, pool_path, mem, slot)
        if mem.cancelled:
            raise CopyError("the engine went away: nothing was copied")
        if wait_written:
            self._wait_written(mem, slot, 2 * seq, self.wait_timeout_s)
        jobs = plan.pieces(self.piece_bytes)
        done = threading.Event()
        remaining = [len(jobs)]
        errors: list[BaseException] = []

        def finished(err: BaseException | None) -> None:
            with self._lock:
                if err is not None:
                    errors.append(err)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                if not errors:
                    _record(mem, slot, seq)
                done.set()

        prio = 0 if direction == ONBOARD else 1
        if not jobs:
            _record(mem, slot, seq)
            done.set()
        for s in jobs:
            self._jobs.put((prio, next(self._order), mem, pool, plan.take(s), direction, finished))
        done.wait()

        def wait() -> None:
            if errors:
                raise CopyError(f"{direction} copy failed: {errors[0]}") from errors[0]

        wait()
        return Completion(wait)

    @staticmethod
    def _wait_written(mem: HostKVMemory, slot: int, mark: int, timeout_s: float = math.inf) -> None:
        """Wait for the engine's "KV written" record (the stand-in of cudaStreamWaitEvent), at
        most ``timeout_s`` (:class:`WaitTimeout`)."""
        ring = mem.ring_arr
        wait_written(lambda: int(ring[slot]) >= mark, mem, slot, mark // 2, timeout_s)
        if int(ring[slot]) > mark:  # a newer request's record: the engine gave up on this one
            raise CopyError(f"request {mark // 2} in event slot {slot} was superseded by a newer request "
                            f"before its KV was written; nothing was copied")

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item[2] is None:
                return
            _, _, mem, pool, plan, direction, finished = item
            try:
                _copy_blocks(mem.arrays, pool.arr, plan, direction)
            except BaseException as e:  # reported to the waiter, never lost
                finished(e)
            else:
                finished(None)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put((-1, next(self._order), None, None, None, None, None))
        for t in self._threads:
            t.join()
        for p in self._pools.values():
            p.close()
        self._pools.clear()


_FD_ONLY = ("the host copy engine maps engine memory only from a file descriptor passed over the unix socket "
            "(a memfd sealed with F_SEAL_SHRINK; kvtier.client.engine.SharedKVArena makes one), never from a path")
MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes sealed against shrinking and growing: memory an engine may
    hand the daemon (see the module docstring). The caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_sealed_fd(fd: int, size: int, what: str) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` read-write, only if it is a memfd sealed against shrinking
    (``F_SEAL_SHRINK``) and at least that large: such a region can never shrink under the
    mapping (no SIGBUS). ``what`` names it in the refusal (:class:`EngineMemoryError`)."""
    if size <= 0:
        raise EngineMemoryError(f"{what} has size {size}; give its size in bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    except OSError as e:
        raise EngineMemoryError(f"{what} is not a sealable memfd ({e.strerror}): {_FD_ONLY}") from None
    if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
        raise EngineMemoryError(f"{what} is not sealed against shrinking (F_SEAL_SHRINK): a region that can shrink "
                                f"after registration could take the daemon down; {_FD_ONLY}")
    if st.st_size < size:
        raise EngineMemoryError(f"{what} is {st.st_size} bytes, not the {size} registered")
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise EngineMemoryError(f"cannot map {what} read-write: {e.strerror} (a write-sealed memfd cannot "
                                f"be registered)") from None


def _copy_blocks(arrays: list[np.ndarray], pool: np.ndarray, plan: ChunkPlan, direction: str) -> None:
    """Copy whole blocks of ``plan``, one numpy call per block and run of same-sized chunks.

    A block's payload is contiguous in the pool, so a run of equal chunks (all of a vLLM
    block; each tensor's rows of an SGLang block) is one ``take`` from (offload) or one
    scatter into (onboard) a strided row view of the engine memory: a single copy with no
    temporary, the GIL released inside numpy."""
    per = plan.chunks_per_block
    nblocks = len(plan) // per
    alloc, size = plan.alloc[:per], plan.size[:per]
    cut = np.flatnonzero((alloc[1:] != alloc[:-1]) | (size[1:] != size[:-1])) + 1
    kv_off = plan.kv_off.reshape(nblocks, per)
    pool_off = plan.pool_off.reshape(nblocks, per)
    for c0, c1 in zip(np.r_[0, cut], np.r_[cut, per], strict=True):
        chunk = int(size[c0])
        view, rows = _rows(arrays[int(alloc[c0])], kv_off[:, c0:c1].ravel(), chunk)
        rows = rows.reshape(nblocks, c1 - c0)
        starts = pool_off[:, c0].astype(np.int64)
        run = (c1 - c0) * chunk
        for b in range(nblocks):
            region = pool[starts[b]:starts[b] + run].reshape(c1 - c0, chunk)
            if direction == OFFLOAD:
                np.take(view, rows[b], axis=0, out=region, mode="clip")
            else:
                view[rows[b]] = region


# -- CUDA ----------------------------------------------------------------------------------

_KERNEL = r"""
extern "C" __global__ void kv_copy(const unsigned long long* src, const unsigned long long* dst,
                                   const unsigned long long* size, const int n) {
    for (int c = blockIdx.x; c < n; c += gridDim.x) {
        const uint4* s = reinterpret_cast<const uint4*>(src[c]);
        uint4* d = reinterpret_cast<uint4*>(dst[c]);
        const unsigned long long m = size[c] >> 4;
        for (unsigned long long i = threadIdx.x; i < m; i += blockDim.x) d[i] = s[i];
    }
}
"""

CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2
CUDA_EVENT_DISABLE_TIMING, CUDA_EVENT_BLOCKING_SYNC = 2, 1
KERNEL_MAX_CHUNK = 1 << 20


def uuid_text(uuid: bytes) -> str:
    """A GPU UUID as nvidia-smi writes it (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``)."""
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(uuid) == 16 else f"<{h or 'none'}>"


def match_device(visible: Sequence[bytes], allocations: Sequence[AllocationRef], default: int) -> int:
    """The ordinal, in this process, of the GPU that ``allocations`` live on.

    By UUID when the engine sent one: device ordinals differ between processes that see
    different GPUs (an engine pod given one GPU sees it as device 0; a node's kvtierd sees every
    GPU of the node, ``NVIDIA_VISIBLE_DEVICES=all``), so an ordinal would name another GPU (and
    the engine's ring events cannot be recorded on another device's stream). ``visible``: the
    UUIDs of this process's devices, by ordinal. Without UUIDs (older clients) the engine's
    ordinal must be ``default`` (kvtierd's ``--cuda-device``), as before."""
    if not allocations:
        return default
    uuids = {a.device_uuid for a in allocations}
    if len(uuids) > 1 or (not next(iter(uuids)) and len({a.device for a in allocations}) > 1):
        raise EngineMemoryError("one registration's allocations are on more than one GPU: register each "
                                "GPU's KV memory with its own connector")
    uuid = next(iter(uuids))
    if not uuid:
        a = allocations[0]
        if a.device != default:
            raise EngineMemoryError(f"allocation on cuda:{a.device} (without a device UUID: an older client), "
                                    f"this daemon copies on cuda:{default}; update the client or start "
                                    f"kvtierd with --cuda-device {a.device}")
        return default
    if len(uuid) != 16:
        raise EngineMemoryError(f"a device UUID is 16 bytes, not {len(uuid)}")
    for ordinal, seen in enumerate(visible):
        if seen == uuid:
            return ordinal
    seen_text = ", ".join(uuid_text(u) for u in visible) or "none"
    raise EngineMemoryError(f"the engine's GPU {uuid_text(uuid)} is not visible to this kvtierd (it sees: "
                            f"{seen_text}); give the daemon every GPU of the node (NVIDIA_VISIBLE_DEVICES=all, "
                            f"no CUDA_VISIBLE_DEVICES)")


@dataclass
class _OpenedAllocation:
    ptr: int
    refs: int = 1


@dataclass
class _CudaPool:
    pool: PoolMapping
    ptr: int          # host address, also the device address (unified addressing)
    dev_ptr: int
    users: int = 1    # attach_pool calls not yet matched by detach_pool


@dataclass
class _CudaState:
    opened: dict[tuple[int, bytes], _OpenedAllocation] = field(default_factory=dict)  # by (device, handle)


@dataclass
class _DeviceStreams:
    offload: Any
    onboard: Any


class CudaCopyEngine(CopyEngine):
    """Copies between CUDA IPC-opened engine memory and the registered pool (module docstring).

    One engine serves every GPU of the process: each registration's copies run on the GPU its
    memory lives on (:func:`match_device`, by UUID), on that GPU's two streams (made on first
    use); ``device`` (kvtierd's ``--cuda-device``) is where the engine starts and the GPU an
    older client without UUIDs must be on. Each pool file is mapped, touched in parallel and
    ``cudaHostRegister``ed whole (portable: usable on every GPU), once, and
    stays registered until ``close``. The Transfer service marks such a pool registered in the
    host tier, which then never punches holes in it (a punched range would leave the GPU
    writing pinned pages the file no longer holds): its memory stays with its size class.
    """

    name = "cuda"
    backend = "cuda"

    def __init__(self, device: int = 0, backend: str = "auto", piece_bytes: int = 8 << 20,
                 touch_threads: int = 16) -> None:
        super().__init__(piece_bytes)
        if backend not in ("auto", "kernel", "batch"):
            raise CopyError(f"cuda backend {backend!r} is not auto, kernel or batch")
        import cupy  # noqa: PLC0415 - only a CUDA engine touches CUDA

        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self.device = device
        self.mode = backend
        self.name = f"cuda-{backend}"
        self.touch_threads = touch_threads
        self._state = _CudaState()
        self._pools: dict[str, _CudaPool] = {}
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._batch: Any = None
        self._streams: dict[int, _DeviceStreams] = {}
        self._kernel = cupy.RawKernel(_KERNEL, "kv_copy")  # (cupy loads it on each device it runs on)
        self.visible_uuids = self._visible_uuids()
        first = self._device_streams(device)
        self.offload_stream, self.onboard_stream = first.offload, first.onboard

    def _device_streams(self, device: int) -> _DeviceStreams:
        """The offload and onboard streams of ``device``, made on its first registration."""
        with self._lock:
            streams = self._streams.get(device)
            if streams is None:
                with self.cp.cuda.Device(device):
                    lo, hi = self._stream_priority_range()
                    streams = _DeviceStreams(self.cp.cuda.Stream(non_blocking=True, priority=lo),
                                             self.cp.cuda.Stream(non_blocking=True, priority=hi))
                self._streams[device] = streams
            return streams

    def _visible_uuids(self) -> list[bytes]:
        """The 16-byte UUID of each GPU this process sees, by ordinal (cupy's device properties,
        or cuda.bindings' cuDeviceGetUuid where cupy gives none)."""
        out = []
        for ordinal in range(int(self.rt.getDeviceCount())):
            try:
                # (cupy makes it with PyBytes_FromString: exactly 16 bytes only when it is whole)
                raw = self.rt.getDeviceProperties(ordinal).get("uuid")
                if not isinstance(raw, (bytes, bytearray)) or len(raw) != 16:
                    from cuda.bindings import driver  # noqa: PLC0415

                    err, dev = driver.cuDeviceGet(ordinal)
                    if err == driver.CUresult.CUDA_SUCCESS:
                        err, uuid = driver.cuDeviceGetUuid(dev)
                    if err != driver.CUresult.CUDA_SUCCESS:
                        raise CopyError(f"cuDeviceGetUuid: {err}")
                    raw = bytes(uuid.bytes)[:16]
            except Exception as e:  # noqa: BLE001 - one GPU that cannot say is not served; the others are
                log.warning("cannot read the UUID of cuda:%d (%s): engines on it are refused", ordinal, e)
                raw = b""
            out.append(bytes(raw))
        return out

    def _stream_priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority of the current device. CuPy 14 dropped
        ``runtime.deviceGetStreamPriorityRange`` (seen on the H200 machine), so cuda.bindings
        answers when CuPy cannot."""
        get = getattr(self.rt, "deviceGetStreamPriorityRange", None)
        if get is not None:
            least, greatest = get()
            return int(least), int(greatest)
        rt = self._batch_copy()
        err, least, greatest = rt.cudaDeviceGetStreamPriorityRange()
        if err != rt.cudaError_t.cudaSuccess:
            raise CopyError(f"cudaDeviceGetStreamPriorityRange failed: {err}")
        return int(least), int(greatest)

    def _batch_copy(self) -> Any:
        if self._batch is None:
            from cuda.bindings import runtime  # noqa: PLC0415

            self._batch = runtime
        return self._batch

    def attach_pool(self, path: str, size: int) -> float:
        with self._pool_lock:  # attach and detach of one pool may run on two executor threads
            known = self._pools.get(path)
            if known is not None:
                known.users += 1
                return self.pin_s_per_gib
            t0 = time.perf_counter()
            pool = PoolMapping(path, size)
            try:
                populate_mapping(pool.mm, size, self.touch_threads)
                ptr = pool.arr.ctypes.data
                with self.cp.cuda.Device(self.device):
                    self.rt.hostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
            except BaseException:
                pool.close()
                raise
            # unified addressing: the registered mapping's device address is its host address
            # (the measured limits, shared/LIMITS.md: a CuPy kernel wrote through the plain host pointer on the H200)
            self._pools[path] = _CudaPool(pool, ptr, ptr)
            self.pin_s_per_gib = (time.perf_counter() - t0) / (size / GIB)
            return self.pin_s_per_gib

    def detach_pool(self, path: str) -> None:
        """Unpin the pool when its last registration closed, so that the host tier may again
        hand its free memory to other size classes (another layout's engine)."""
        with self._pool_lock:
            p = self._pools.get(path)
            if p is None:
                return
            p.users -= 1
            if p.users > 0:
                return
            del self._pools[path]
            with self.cp.cuda.Device(self.device):
                self.rt.hostUnregister(p.ptr)
            p.pool.close()

    def open_kv(self, allocations: Sequence[AllocationRef], ring: EventRing) -> CudaKVMemory:
        device = match_device(self.visible_uuids, allocations, self.device)
        try:
            if device != self.device and not int(self.rt.deviceGetAttribute(_CAN_USE_HOST_POINTER, device)):
                raise EngineMemoryError(f"cuda:{device} cannot use the pinned pool's host address as its own "
                                        f"(cudaDevAttrCanUseHostPointerForRegisteredMem is 0): run a kvtierd "
                                        f"for that GPU (--cuda-device {device})")
            self._device_streams(device)
        except self.rt.CUDARuntimeError as e:
            raise EngineMemoryError(f"cannot use cuda:{device} for the engine's copies: {e}") from None
        mem = CudaKVMemory(allocations, ring, device=device)
        ptrs: list[int] = []
        events: list[int] = []
        try:
            with self.cp.cuda.Device(device):
                for a in allocations:
                    if len(a.ipc_handle) != 64:
                        raise EngineMemoryError("a CUDA allocation needs its 64-byte cudaIpcMemHandle_t")
                    ptrs.append(self._open_handle(device, a.ipc_handle))
                    mem.handles_open += 1
                    mapped = self._mapped_bytes(ptrs[-1])
                    if mapped is not None and a.size > mapped:  # (copies past it: a sticky illegal address)
                        raise EngineMemoryError(f"an allocation is said to be {a.size} B, but its IPC handle opens "
                                                f"{mapped} B")
                if len(ring.handles) != ring.slots:
                    raise EngineMemoryError(f"{len(ring.handles)} event handles for a ring of {ring.slots}")
                for h in ring.handles:
                    events.append(self.rt.ipcOpenEventHandle(h))
                    mem.events_open += 1
        except self.rt.CUDARuntimeError as e:
            self._release(mem, allocations[:len(ptrs)], events)
            raise EngineMemoryError(f"cannot open the engine's CUDA IPC handles: {e}") from None
        except BaseException:
            self._release(mem, allocations[:len(ptrs)], events)
            raise
        mem.ptrs = ptrs
        mem.events = events
        return mem

    def wrap_local(self, ptrs: Sequence[int], sizes: Sequence[int], slots: int) -> CudaKVMemory:
        """KV memory of this same process (CUDA IPC cannot open a handle in its exporter): for
        benchmarks and tests of the engine alone. Its events are created here."""
        mem = CudaKVMemory([AllocationRef(size) for size in sizes], EventRing(slots), local=True, device=self.device)
        with self.cp.cuda.Device(self.device):
            mem.events = [self.rt.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING) for _ in range(slots)]
        mem.ptrs = list(ptrs)
        mem.events_open = slots
        return mem

    def _mapped_bytes(self, ptr: int) -> int | None:
        """The size of the allocation an opened IPC handle maps (cuMemGetAddressRange), or None
        where the driver API cannot say (then the engine's word stands)."""
        try:
            from cuda.bindings import driver  # noqa: PLC0415

            err, _base, size = driver.cuMemGetAddressRange(ptr)
            return int(size) if err == driver.CUresult.CUDA_SUCCESS else None
        except Exception:  # noqa: BLE001 - a check that cannot be made is not a failure
            return None

    def _open_handle(self, device: int, handle: bytes) -> int:
        """Open an IPC handle on ``device`` (the current device), once per device and handle."""
        with self._lock:
            opened = self._state.opened.get((device, handle))
            if opened is not None:
                opened.refs += 1
                return opened.ptr
            ptr = self.rt.ipcOpenMemHandle(handle, CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            self._state.opened[device, handle] = _OpenedAllocation(ptr)
            return ptr

    def _release(self, mem: KVMemory, allocations: Sequence[AllocationRef], events: Sequence[int]) -> None:
        assert isinstance(mem, CudaKVMemory)
        with self.cp.cuda.Device(mem.device), self._lock:
            for a in allocations:
                opened = self._state.opened[mem.device, a.ipc_handle]
                opened.refs -= 1
                if opened.refs == 0:
                    del self._state.opened[mem.device, a.ipc_handle]
                    self.rt.ipcCloseMemHandle(opened.ptr)
            for ev in events:
                self.rt.eventDestroy(ev)
        mem.handles_open = mem.events_open = 0

    def close_kv(self, mem: KVMemory) -> None:
        assert isinstance(mem, CudaKVMemory)
        self._release(mem, [] if mem.local else mem.allocations, mem.events)

    def _choose(self, plan: ChunkPlan, src: np.ndarray, dst: np.ndarray) -> str:
        if self.mode != "auto":
            return self.mode
        aligned = not ((src | dst | plan.size) & np.uint64(15)).any()
        return "kernel" if aligned and int(plan.size.max(initial=0)) < KERNEL_MAX_CHUNK else "batch"

    def _launch(self, plan: ChunkPlan, mem: CudaKVMemory, pool: _CudaPool, direction: str, stream: Any) -> None:
        kv = np.asarray(mem.ptrs, dtype=np.uint64)[plan.alloc] + plan.kv_off
        host = np.uint64(pool.dev_ptr) + plan.pool_off
        src, dst = (kv, host) if direction == OFFLOAD else (host, kv)
        how = self._choose(plan, src, dst)
        if how == "kernel":
            if ((src | dst | plan.size) & np.uint64(15)).any():
                raise CopyError("the kernel backend needs 16-byte aligned chunks; use --cuda-backend batch")
            n = len(plan)
            with stream:  # the table upload and the launch are ordered on this stream
                table = self.cp.asarray(np.concatenate([src, dst, plan.size]))
                self._kernel((min(n, 65535),), (256,), (table[:n], table[n:2 * n], table[2 * n:], np.int32(n)))
            return
        rt = self._batch_copy()
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        dev, host_loc = rt.cudaMemLocation(), rt.cudaMemLocation()
        dev.type, dev.id = rt.cudaMemLocationType.cudaMemLocationTypeDevice, mem.device
        host_loc.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
        attr.srcLocHint, attr.dstLocHint = (dev, host_loc) if direction == OFFLOAD else (host_loc, dev)
        err = rt.cudaMemcpyBatchAsync([int(x) for x in dst], [int(x) for x in src], [int(x) for x in plan.size],
                                      len(plan), [attr], [0], 1, stream.ptr)[0]
        if err != rt.cudaError_t.cudaSuccess:
            raise CopyError(f"cudaMemcpyBatchAsync failed: {err}")

    def copy(self, mem: KVMemory, pool_path: str, plan: ChunkPlan, direction: str, slot: int, seq: int,
             wait_written: bool) -> Completion:
        assert isinstance(mem, CudaKVMemory)
        pool = _pool_for(self._pools, pool_path, mem, slot)
        ring_ev = mem.events[slot]
        streams = self._streams[mem.device]
        stream = streams.offload if direction == OFFLOAD else streams.onboard
        rt = self.rt
        device = mem.device
        with self.cp.cuda.Device(device):
            if mem.cancelled:
                raise CopyError("the engine went away: nothing was copied")
            if wait_written:
                # on the CPU first, bounded: a stream wait cannot be withdrawn, so one on a record
                # an engine never reaches (hung, or dead with work queued) would stall every copy
                # after it on this stream, this registration's close and the daemon's shutdown
                self._wait_reached(mem, ring_ev, slot, seq)
                rt.streamWaitEvent(stream.ptr, ring_ev, 0)
            if direction == OFFLOAD:
                pieces = plan.pieces(self.piece_bytes)
            else:  # an onboard is one launch; nothing to launch when every key missed
                pieces = [slice(0, len(plan))] if len(plan) else []
            marks: list[int] = []
            try:
                for s in pieces:
                    if len(marks) >= 2:  # at most two pieces queued: onboards slip in between
                        rt.eventSynchronize(marks[-2])
                    self._launch(plan.take(s), mem, pool, direction, stream)
                    ev = rt.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING | CUDA_EVENT_BLOCKING_SYNC)
                    rt.eventRecord(ev, stream.ptr)
                    marks.append(ev)
            except BaseException as e:
                # the pieces queued so far still run: let them land before the caller gives the
                # slots they write (an offload's grants) back (after a sticky error this raises
                # too: the original error is the one reported)
                with contextlib.suppress(Exception):
                    stream.synchronize()
                for ev in marks:
                    with contextlib.suppress(Exception):
                        rt.eventDestroy(ev)
                if isinstance(e, Exception) and not isinstance(e, CopyError):  # (CUDA runtime, kernel launch)
                    raise CopyError(f"{direction} copy failed: {e}") from e
                raise
            rt.eventRecord(ring_ev, stream.ptr)
            end = rt.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING | CUDA_EVENT_BLOCKING_SYNC)
            rt.eventRecord(end, stream.ptr)

        def wait() -> None:
            with self.cp.cuda.Device(device):
                rt.eventSynchronize(end)
                for ev in [*marks, end]:
                    rt.eventDestroy(ev)

        return Completion(wait)

    def _event_reached(self, ev: int) -> bool:
        """cudaEventQuery: whether the work before the event's latest record is done."""
        try:
            return int(self.rt.eventQuery(ev)) == 0
        except self.rt.CUDARuntimeError as e:  # (a CuPy that raises for "not ready" too)
            if getattr(e, "status", None) == _CUDA_ERROR_NOT_READY:
                return False
            raise

    def _wait_reached(self, mem: CudaKVMemory, ev: int, slot: int, seq: int) -> None:
        """Wait for the engine's "KV written" record on ``ev`` to be reached, at most
        ``wait_timeout_s`` (:class:`WaitTimeout`: nothing was queued), giving up as soon as
        the engine goes away (:meth:`cancel`)."""
        wait_written(lambda: self._event_reached(ev), mem, slot, seq, self.wait_timeout_s)

    def close(self) -> None:
        with self._lock:
            streams_of, opened_of = list(self._streams.items()), list(self._state.opened.items())
        for device, streams in streams_of:
            with self.cp.cuda.Device(device):
                streams.offload.synchronize()
                streams.onboard.synchronize()
        for (device, _handle), opened in opened_of:
            with self.cp.cuda.Device(device):
                self.rt.ipcCloseMemHandle(opened.ptr)
        with self.cp.cuda.Device(self.device):
            for p in self._pools.values():
                self.rt.hostUnregister(p.ptr)
                p.pool.close()
        self._pools.clear()
        self._state.opened.clear()

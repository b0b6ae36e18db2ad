"""Host tier: fixed-size slots in tmpfs files that local clients map and fill directly.

What it owns
    One pool file per size class (one class per pool group and distinct slot size: the
    daemon gives each tenant its own group, so no client maps another tenant's slots) in a
    tmpfs directory, created owner-only. Slot ``i`` of a class lies at byte ``i * slot_bytes`` of its file.
    The files are sparse; a slot's memory is allocated (``fallocate``) when it is first
    handed out, and released (hole punched) when a slot of another class needs the budget.
    ``capacity`` bounds the memory of all files together, always.

Entries and their states
    ``reserve`` hands out slots for keys (*grants*): invisible to ``lookup`` until
    ``commit``; ``abort`` gives them back. A committed entry is *visible*.
    ``pin`` (a reader holds the slot) keeps an entry from being evicted or reused; ``unpin``
    drops the pin. ``remove`` of a pinned entry hides it at once and frees the slot when the
    last pin goes. Pin counts never go negative: unpinning an entry that holds no pin raises.

Eviction
    The tier keeps no recency order: which block goes is the placement policy's decision
    (:class:`kvtier.tiers.policy.TierPolicy`). When no free slot fits the budget, ``reserve``
    takes victims from the candidates it is given, in their order (the policy's eviction
    order), skipping pinned entries and entries whose slot the new block cannot use (another
    class's memory that a GPU has pinned). Their slots are not reused yet: the caller gets them back as *victims*,
    may copy their bytes elsewhere (demotion to disk), then must call ``finish_eviction``.
    Only then are the slots reused by the new grants or punched. Until then the victims'
    bytes stay intact, so the caller must not let clients write the new grants before
    ``finish_eviction`` (the daemon replies to Allocate only after it).

Integrity
    Every slot has a *generation*, bumped each time the slot changes hands (handed out as a
    grant, freed, taken by an eviction). A grant records the generation it was given; a
    grant whose slot has changed hands since is *stale*: ``commit`` refuses it (it never
    becomes visible) and ``abort`` of it gives nothing back (the slot is someone else's).
    :meth:`HostTier.seal` takes the xxh3-64 checksum of each granted block's payload at
    commit (or records the ones the client took as it copied the payloads in, sent with its
    Commit: docs/DESIGN.md "Client checksums and the pool copy"); it is kept with the entry (:attr:`HostEntry.checksum`) so a later read can tell
    whether the bytes changed since (:meth:`HostTier.verify`; demotion to disk compares it
    too). A commit of at most ``INLINE_HASH_BYTES`` is hashed on the event loop before it is
    visible. A larger one is made visible at once and hashed right after, on the tier's
    hashing threads (up to ``HASH_THREADS`` parts, xxhash releases the GIL), so a large put
    does not wait for it (hashing 128 MiB inline cost bench/host_tier.py a fifth of its put
    throughput); whoever needs the checksum (a verified read, a demotion) awaits
    :meth:`HostTier.sealed` first. A write that lands in that short window (milliseconds)
    after such a commit goes into the checksum and is not detected, as is any write before
    the commit. A client
    maps the whole pool, so a client that keeps running after its session was reclaimed
    can still write a slot that now holds another key's block: the checksum is how such a
    write is found (the block is then dropped, never served by a verified read).

Files
    Pool files are created ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600: a file or a
    symbolic link already at a pool's path is refused (:class:`PoolFileError`), never
    truncated or followed.

Threading: not thread-safe; the daemon calls it from its event loop only. ``fallocate`` of
fresh slots is returned as work (``BackingJob``) for the caller to run in an executor; the
checksums of :meth:`HostTier.seal` and :meth:`HostTier.verify` run on the tier's hashing
threads while the caller awaits.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import ctypes.util
import errno
import mmap
import os
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import xxhash

from kvtier.tiers.idmap import new_idmap
from kvtier.tiers.vocab import FP_BYTES, fingerprint_of

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Release the memory behind a byte range of a tmpfs file (the size stays)."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def punch_slots(fd: int, slots: Iterable[int], slot_bytes: int) -> None:
    """Punch the given slots of a pool or slab file, one punch per run of consecutive slots."""
    run: list[int] = []  # [first, last] of the run being gathered
    for slot in sorted(slots):
        if run and slot == run[1] + 1:
            run[1] = slot
            continue
        if run:
            punch_hole(fd, run[0] * slot_bytes, (run[1] - run[0] + 1) * slot_bytes)
        run = [slot, slot]
    if run:
        punch_hole(fd, run[0] * slot_bytes, (run[1] - run[0] + 1) * slot_bytes)


MADV_POPULATE_WRITE = 23


class PoolMapping:
    """A process's read-write mapping of one pool file (sidecars and copy engines map the
    files the daemon names; they write a slot only under a grant, read it only under a lease).

    ``fd``: map this open descriptor of the file (closed here once mapped) instead of opening
    ``path``; a client gets it from the daemon (``Credentials.open``), since pool files are
    owner-only and the client need not be the daemon's uid."""

    def __init__(self, path: str, size: int, fd: int | None = None) -> None:
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.path = path
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self._populate = True
        self._mapped: set[int] = set()  # offsets of slots whose pages this mapping has populated

    def prepare_write(self, offset: int, length: int) -> None:
        """Map a slot's pages in one syscall instead of a fault per 4 KiB page (Linux >= 5.14),
        once per slot: later writes to the slot find its pages mapped."""
        if self._populate and offset not in self._mapped:
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, offset, length)
                self._mapped.add(offset)
            except OSError:
                self._populate = False

    def close(self) -> None:
        del self.arr
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last one


E = TypeVar("E", bound="Pinned")


class Pinned(Protocol):
    """A host or disk entry, as :class:`PinnedTier` and :func:`take_unpinned` see it."""

    bkey: bytes
    visible: bool
    pins: int
    removed: bool
    slot: int


def hide_entry(entries: dict[bytes, Any], per_fp: Counter[bytes], entry: Pinned) -> None:
    """Take a host or disk entry out of its tier's lookups (its slot is the caller's to free)."""
    del entries[entry.bkey]
    entry.visible = False
    fp = fingerprint_of(entry.bkey)
    per_fp[fp] -= 1
    if not per_fp[fp]:
        del per_fp[fp]


def take_unpinned(entries: dict[bytes, E], per_fp: Counter[bytes], order: Iterable[bytes],
                  usable: Callable[[E], bool] = lambda e: True) -> E | None:
    """Hide and return the first entry of ``order`` (the policy's victims, best first) that is
    held, unpinned and ``usable``; candidates passed over are left as they are."""
    for bkey in order:
        entry = entries.get(bkey)
        if entry is not None and entry.pins == 0 and usable(entry):
            hide_entry(entries, per_fp, entry)
            return entry
    return None


class PinnedTier(Generic[E]):
    """Lookups and pins of a tier's visible entries (host and disk alike): an entry removed
    while pinned keeps its slot until its last pin goes, then ``_reclaim`` frees the slot."""

    entries: dict[bytes, E]

    def get(self, bkey: bytes) -> E | None:
        return self.entries.get(bkey)

    def pin(self, entry: E) -> None:
        entry.pins += 1

    error: type[Exception] = RuntimeError  # what an unpin without a pin raises

    def unpin(self, entry: E) -> None:
        if entry.pins <= 0:
            raise self.error(f"unpin of an entry with no pins (slot {entry.slot})")
        entry.pins -= 1
        if entry.pins == 0 and entry.removed:
            self._reclaim(entry)

    def _reclaim(self, entry: E) -> None:
        raise NotImplementedError


class HostTierError(Exception):
    """Base of the host tier's errors."""


class CapacityError(HostTierError):
    """The capacity cannot hold even one slot of this size."""


class PoolFileError(HostTierError):
    """A pool file cannot be created: something (a file, a link) is already at its path."""


def payload_checksum(buf: memoryview | bytes) -> int:
    """The checksum of a block's payload, as the host and disk tiers keep it: xxh3-64."""
    return xxhash.xxh3_64_intdigest(buf)


#: commits of at most this many payload bytes are hashed on the event loop before they are
#: visible (about 70 us at 15 GB/s); larger ones on the hashing threads, right after
INLINE_HASH_BYTES = 1 << 20
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))  # half the cores at most: the clients copy on the others


@dataclass(eq=False)
class SizeClass:
    """The slots of one size of one pool group, in one pool file."""

    slot_bytes: int
    path: str
    fd: int
    nslots: int
    group: str = ""                                 # the pool group ("" the default one)
    hwm: int = 0                                    # slots [0, hwm) have been handed out once
    free: list[int] = field(default_factory=list)   # backed slots, ready to reuse
    holes: list[int] = field(default_factory=list)  # punched slots below hwm, unbacked
    # each slot's generation, bumped whenever it changes hands (np.zeros: pages never
    # touched take no memory); a grant holds the generation it was given
    gens: np.ndarray = field(default=None)  # type: ignore[assignment]
    # each slot's payload checksum (HostEntry.checksum; np.zeros, as gens) and the checksum
    # tasks of large commits in flight (HostEntry.sealing)
    sums: np.ndarray = field(default=None)  # type: ignore[assignment]
    sealing: dict[int, asyncio.Task] = field(default_factory=dict)  # by the entry's slot << 32 | gen
    # the state (HostEntry flags and pins) and block bytes of each slot whose entry is held in
    # the tier (committed: visible, or removed while pinned); 4 B each a slot
    states: array.array = field(default=None)  # type: ignore[assignment]
    sizes: array.array = field(default=None)   # type: ignore[assignment]
    index: int = 0                             # the class's number in its HostTier (HostTier.entries' values)
    # the policy's host recency order (HostRecency), when the tier keeps it: per slot, the
    # previous and next entries (class index << 32 | slot; -1: none) and the seen count + 1
    # (0: the slot is not in the order); the key is the one HostTier.entries keeps for the slot
    # (id_of); allocated on first use
    lprev: array.array | None = None
    lnext: array.array | None = None
    lseen: array.array | None = None
    view: memoryview | None = None          # the daemon's read-only mapping (for checksums)
    _mm: mmap.mmap | None = None

    def __post_init__(self) -> None:
        if self.gens is None:
            self.gens = np.zeros(self.nslots, dtype=np.uint32)
        if self.sums is None:
            self.sums = np.zeros(self.nslots, dtype=np.uint64)
        if self.states is None:
            self.states = array.array("I", bytes(4 * self.nslots))
        if self.sizes is None:
            self.sizes = array.array("I", bytes(4 * self.nslots))

    def recency_arrays(self) -> None:
        if self.lseen is None:
            self.lprev = array.array("q", [-1]) * self.nslots
            self.lnext = array.array("q", [-1]) * self.nslots
            self.lseen = array.array("I", bytes(4 * self.nslots))

    def bump(self, slot: int) -> int:
        """The slot changes hands: its new generation."""
        g = (int(self.gens[slot]) + 1) & 0xFFFFFFFF
        self.gens[slot] = g
        return g

    def payload(self, offset: int, length: int) -> memoryview:
        if self.view is None:
            self._mm = mmap.mmap(self.fd, self.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            self.view = memoryview(self._mm)
        return self.view[offset:offset + length]

    def unmap(self) -> None:
        try:
            if self.view is not None:
                self.view.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:
            pass  # a hash still holds a view; the mapping goes with it
        self.view = self._mm = None

    @property
    def pool_bytes(self) -> int:
        return self.nslots * self.slot_bytes

    @property
    def key(self) -> tuple[str, int]:
        """(group, slot bytes): the class's key in :attr:`HostTier.classes`."""
        return (self.group, self.slot_bytes)

    @property
    def backed_slots(self) -> int:
        return self.hwm - len(self.holes)


_VISIBLE, _REMOVED, _SUMMED, _PIN = 1, 2, 4, 8  # HostEntry._state: flags, then pins x _PIN


class HostEntry:
    """A block in the host tier (``bkey`` = layout fingerprint + key).

    Compact: the tier does not keep these objects. What it holds of a
    committed entry is one small int in :attr:`HostTier.entries` (size class number and slot),
    the state (flags and pins) and block bytes in its size class's per-slot arrays
    (:attr:`SizeClass.states`, :attr:`SizeClass.sizes`), the checksum in :attr:`SizeClass.sums`
    (valid while the ``_SUMMED`` bit is set: nobody writes a slot's checksum between its
    victim's eviction and its ``finish_eviction``) and a large commit's checksum task in
    :attr:`SizeClass.sealing`. :meth:`HostTier.get` makes an entry object on demand, a *view*
    of those arrays: views of one held entry share its pins and flags, and compare equal
    (same class, slot and generation), not identical. A grant (not committed yet) and an entry
    the tier gave up (a victim, a removed unpinned entry) keep their own state (``_st`` >= 0);
    a held one's is in the arrays (``_st`` = -1). The attributes read and write as the
    former dataclass's did."""

    __slots__ = ("bkey", "cls", "_sg", "block_bytes", "_st")

    def __init__(self, bkey: bytes, cls: SizeClass, slot: int, block_bytes: int, visible: bool = False,
                 pins: int = 0, removed: bool = False, gen: int = 0, checksum: int | None = None) -> None:
        self.bkey = bkey
        self.cls = cls
        self._sg = slot << 32 | gen
        self.block_bytes = block_bytes
        self._st = (_VISIBLE if visible else 0) | (_REMOVED if removed else 0) | pins * _PIN
        if checksum is not None:
            self.checksum = checksum

    @property
    def _state(self) -> int:
        st = self._st
        return self.cls.states[self._sg >> 32] if st < 0 else st

    @_state.setter
    def _state(self, v: int) -> None:
        if self._st < 0:
            self.cls.states[self._sg >> 32] = v
        else:
            self._st = v

    def _attach(self) -> None:
        """The tier holds this entry now: its state goes to the class's arrays."""
        slot = self._sg >> 32
        self.cls.states[slot] = self._st
        self.cls.sizes[slot] = self.block_bytes
        self._st = -1

    def _detach(self) -> None:
        """The tier gives this entry up: it keeps a copy of its state."""
        if self._st < 0:
            self._st = self.cls.states[self._sg >> 32]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostEntry) and self.cls is other.cls and self._sg == other._sg

    def __hash__(self) -> int:
        return hash((id(self.cls), self._sg))

    def __repr__(self) -> str:
        return (f"HostEntry(bkey={self.bkey!r}, slot={self.slot}, block_bytes={self.block_bytes}, "
                f"visible={self.visible}, pins={self.pins}, removed={self.removed}, gen={self.gen}, "
                f"checksum={self.checksum})")

    @property
    def slot(self) -> int:
        return self._sg >> 32

    @property
    def gen(self) -> int:
        """The slot's generation when it was granted."""
        return self._sg & 0xFFFFFFFF

    @property
    def visible(self) -> bool:
        return bool(self._state & _VISIBLE)

    @visible.setter
    def visible(self, v: bool) -> None:
        self._state = self._state | _VISIBLE if v else self._state & ~_VISIBLE

    @property
    def removed(self) -> bool:
        """Hidden while pinned; the slot is freed on the last unpin."""
        return bool(self._state & _REMOVED)

    @removed.setter
    def removed(self, v: bool) -> None:
        self._state = self._state | _REMOVED if v else self._state & ~_REMOVED

    @property
    def pins(self) -> int:
        return self._state // _PIN

    @pins.setter
    def pins(self, n: int) -> None:
        self._state = self._state % _PIN + n * _PIN

    @property
    def checksum(self) -> int | None:
        """xxh3-64 of the payload, taken at commit (None: not taken)."""
        return int(self.cls.sums[self._sg >> 32]) if self._state & _SUMMED else None

    @checksum.setter
    def checksum(self, c: int | None) -> None:
        if c is None:
            self._state &= ~_SUMMED
        else:
            self.cls.sums[self._sg >> 32] = c
            self._state |= _SUMMED

    @property
    def sealing(self) -> asyncio.Task | None:
        """The checksum being taken (large commits): await it."""
        return self.cls.sealing.get(self._sg)

    @sealing.setter
    def sealing(self, task: asyncio.Task | None) -> None:
        if task is None:
            self.cls.sealing.pop(self._sg, None)
        else:
            self.cls.sealing[self._sg] = task

    @property
    def offset(self) -> int:
        return (self._sg >> 32) * self.cls.slot_bytes

    @property
    def current(self) -> bool:
        """The slot has not changed hands since this entry got it."""
        sg = self._sg
        return int(self.cls.gens[sg >> 32]) == sg & 0xFFFFFFFF


def _view(bkey: bytes, cls: SizeClass, slot: int) -> HostEntry:
    """An entry object for a held entry (its state in the class's arrays)."""
    e = HostEntry.__new__(HostEntry)
    e.bkey = bkey
    e.cls = cls
    e._sg = slot << 32 | int(cls.gens[slot])
    e.block_bytes = cls.sizes[slot]
    e._st = -1
    return e


_SLOT = 0xFFFFFFFF


@dataclass
class BackingJob:
    """Fresh slots whose memory must be allocated before clients write them."""

    ranges: list[tuple[int, int, int]]  # (fd, offset, length)

    def run(self) -> None:
        for fd, off, length in self.ranges:
            os.posix_fallocate(fd, off, length)


@dataclass
class Reservation:
    """What ``reserve`` gives back: one entry (or None: no space) per key, and the victims."""

    entries: list[HostEntry | None]
    victims: list[HostEntry]
    backing: BackingJob


class HostTier(PinnedTier[HostEntry]):
    """Slots and pins of the host pool (see the module docstring for the contract)."""

    error = HostTierError

    def __init__(self, shm_dir: str, capacity: int, name_prefix: str) -> None:
        self.shm_dir = shm_dir
        self.capacity = capacity
        self.prefix = name_prefix
        self.classes: dict[tuple[str, int], SizeClass] = {}  # (group, slot bytes) -> class
        # visible entries: packed id -> size class index << 32 | slot (HostEntry: see get), in
        # an id map that keeps no Python object per entry (tiers/idmap.py)
        self.entries: Any = new_idmap()
        self._by_index: list[SizeClass] = []
        # with a HostRecency: entries hidden (victims, removed) whose place in the policy's
        # order is not dropped yet (the policy is told in the same loop step): key -> node
        self._recency: HostRecency | None = None
        self._gone: dict[bytes, int] = {}
        self.per_fp: Counter[bytes] = Counter()           # visible entries per layout fingerprint
        self._pending_punch: list[tuple[SizeClass, int]] = []
        self._registered: set[tuple[str, int]] = set()  # classes whose pool file a GPU has pinned
        self._hasher: ThreadPoolExecutor | None = None
        self._sealing: set[asyncio.Task] = set()
        self._late_sums: dict[tuple[int, int], int] = {}  # see _seal_later

    # -- size classes and budget ---------------------------------------------------------

    def size_class(self, slot_bytes: int, prefault: bool = False, group: str = "") -> SizeClass:
        """The size class of ``slot_bytes`` in pool ``group``, creating its pool file on first
        use (``<prefix>-<slot bytes>.pool``; ``<prefix>-<group>-<slot bytes>.pool`` for a group).
        Groups share the one byte budget.

        With ``prefault``, the first class created counts its whole file as backed and free,
        and the caller must run :meth:`prefault_job` (allocating the memory up front, so first
        writes do not pay for page allocation and a full tmpfs is found now, not later)."""
        cls = self.classes.get((group, slot_bytes))
        if cls is not None:
            return cls
        if group and not group.isalnum():
            raise ValueError(f"pool group {group!r} must be letters and digits")
        nslots = self.capacity // slot_bytes
        if nslots == 0:
            raise CapacityError(f"host capacity {self.capacity} B cannot hold one {slot_bytes} B slot; "
                                f"raise --host-capacity")
        path = os.path.join(self.shm_dir, f"{self.prefix}{'-' + group if group else ''}-{slot_bytes}.pool")
        fd = create_exclusive(path)
        try:
            os.ftruncate(fd, nslots * slot_bytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        cls = SizeClass(slot_bytes, path, fd, nslots, group, index=self.entries.add_class(nslots))
        assert cls.index == len(self._by_index)
        self._by_index.append(cls)
        if self._recency is not None:
            cls.recency_arrays()
        if prefault and not self.classes:
            cls.hwm = nslots
            cls.free = list(range(nslots - 1, -1, -1))
        self.classes[cls.key] = cls
        return cls

    def pin_shortfall(self, cls: SizeClass) -> int:
        """Bytes by which pinning ``cls``'s whole file (``cudaHostRegister`` makes every page of
        it resident) would take the tier's memory over ``capacity``, after first releasing the
        free slots of other classes that are not pinned; 0 when it fits (or it is pinned already)."""
        if cls.key in self._registered:
            return 0
        unbacked = (cls.nslots - cls.backed_slots) * cls.slot_bytes
        over = self.backed_bytes + unbacked - self.capacity
        for other in self.classes.values():
            if over <= 0:
                break
            if other is cls or other.key in self._registered or not other.free:
                continue
            n = min(len(other.free), -(-over // other.slot_bytes))
            taken = sorted(other.free[-n:])
            del other.free[-n:]
            other.holes.extend(taken)
            over -= n * other.slot_bytes
            punch_slots(other.fd, taken, other.slot_bytes)  # (free slots are in no pending punch: those are holes)
        return max(0, over)

    def mark_registered(self, cls: SizeClass) -> None:
        """The class's file is pinned for a GPU (``cudaHostRegister``): its memory must never be
        punched (the GPU would keep writing pages the file no longer holds), so it is never
        handed to another size class; its own slots are reused as usual. Pinning makes the
        whole file resident, so from now on all of it counts as backed (its unbacked slots
        become free ones): the other classes get only what is left of ``capacity``
        (:meth:`pin_shortfall` says beforehand whether it fits)."""
        if cls.key in self._registered:
            return
        self._registered.add(cls.key)
        pending = {slot for c, slot in self._pending_punch if c is cls}  # (finish_eviction frees those)
        kept = [slot for slot in cls.holes if slot in pending]
        cls.free.extend(slot for slot in cls.holes if slot not in pending)
        cls.holes = kept
        cls.free.extend(range(cls.nslots - 1, cls.hwm - 1, -1))
        cls.hwm = cls.nslots

    def unmark_registered(self, cls: SizeClass) -> None:
        """The GPU no longer pins the class's file (its last KV registration closed): its free
        memory may go to other size classes again."""
        self._registered.discard(cls.key)

    @staticmethod
    def prefault_job(cls: SizeClass) -> BackingJob:
        return BackingJob([(cls.fd, 0, cls.hwm * cls.slot_bytes)] if cls.hwm else [])

    @property
    def backed_bytes(self) -> int:
        return sum(c.backed_slots * c.slot_bytes for c in self.classes.values())

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding visible blocks or grants."""
        return sum((c.backed_slots - len(c.free)) * c.slot_bytes for c in self.classes.values())

    def close(self) -> None:
        """Close and unlink every pool file (daemon shutdown)."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        for cls in self.classes.values():
            cls.unmap()
            os.close(cls.fd)
            try:
                os.unlink(cls.path)
            except FileNotFoundError:
                pass
        self.classes.clear()

    # -- reads ---------------------------------------------------------------------------

    def get(self, bkey: bytes) -> HostEntry | None:
        """The visible entry of ``bkey`` (a view: see :class:`HostEntry`), or None."""
        v = self.entries.get(bkey)
        return None if v is None else _view(bkey, self._by_index[v >> 32], v & _SLOT)

    def unpinned_within(self, order: Iterable[bytes], window: int, most: int,
                        skip: Container[bytes]) -> list[bytes]:
        """The keys, in ``order``, of the visible entries among its first ones (at most ``most``
        entries and ``window`` bytes of slots, counted over every visible one) that are neither
        pinned nor in ``skip``. Reads the packed entries and class arrays, no views."""
        entries, by_index = self.entries, self._by_index
        out: list[bytes] = []
        seen = scanned = 0
        for bkey in order:
            v = entries.get(bkey)
            if v is None:
                continue  # hidden meanwhile (a victim not popped yet)
            cls = by_index[v >> 32]
            seen += cls.slot_bytes
            scanned += 1
            if seen > window or scanned > most:
                break
            if bkey not in skip and cls.states[v & _SLOT] < _PIN:
                out.append(bkey)
        return out

    def recency(self) -> HostRecency:
        """The placement policy's host order and seen counts, kept in this tier's per-slot
        arrays (pass it to TierPolicy as ``host_map``); one per tier."""
        if self._recency is None:
            self._recency = HostRecency(self)
            for cls in self._by_index:
                cls.recency_arrays()
        return self._recency

    def held(self) -> Iterator[HostEntry]:
        """Every visible entry (views)."""
        by_index = self._by_index
        return (_view(b, by_index[v >> 32], v & _SLOT) for b, v in self.entries.items())

    def _reclaim(self, entry: HostEntry) -> None:
        self._free_slot(entry)

    # -- writes --------------------------------------------------------------------------

    def reserve(self, cls: SizeClass, bkeys: list[bytes], block_bytes: int,
                candidates: Iterable[bytes] = ()) -> Reservation:
        """Grant one slot per key, in order (None where nothing can be freed). When a slot must
        be freed, the victim is the first of ``candidates`` (packed ids of visible entries, in
        eviction order) that is unpinned and whose slot this class can use."""
        out: list[HostEntry | None] = []
        victims: list[HostEntry] = []
        fresh: list[int] = []
        order = iter(candidates)
        for bkey in bkeys:
            slot = self._take_slot(cls, victims, fresh, order)
            out.append(None if slot is None else HostEntry(bkey, cls, slot, block_bytes, gen=cls.bump(slot)))
        ranges = [(cls.fd, s * cls.slot_bytes, cls.slot_bytes) for s in fresh]
        return Reservation(out, victims, BackingJob(ranges))

    def _take_slot(self, cls: SizeClass, victims: list[HostEntry], fresh: list[int],
                   order: Iterator[bytes]) -> int | None:
        while True:
            if cls.free:
                return cls.free.pop()
            if cls.holes or cls.hwm < cls.nslots:
                if self.backed_bytes + cls.slot_bytes > self.capacity:
                    self._release_free_slot(cls)
                if self.backed_bytes + cls.slot_bytes <= self.capacity:
                    slot = cls.holes.pop() if cls.holes else cls.hwm
                    if slot == cls.hwm:
                        cls.hwm += 1
                    fresh.append(slot)
                    return slot
            victim = self._evict_one(cls, order)
            if victim is None:
                return None
            victims.append(victim)
            if victim.cls is cls:
                return victim.slot
            # another class's slot: its memory is released in finish_eviction; count it as
            # released now so the budget admits a fresh slot of this class.
            victim.cls.bump(victim.slot)
            victim.cls.holes.append(victim.slot)
            self._pending_punch.append((victim.cls, victim.slot))

    def _release_free_slot(self, needy: SizeClass) -> None:
        """Give the budget of another class's free (backed, unused) slots to ``needy``."""
        for other in self.classes.values():
            if other.key in self._registered:
                continue
            while other is not needy and other.free and self.backed_bytes + needy.slot_bytes > self.capacity:
                slot = other.free.pop()
                other.holes.append(slot)
                self._pending_punch.append((other, slot))

    def _evict_one(self, needy: SizeClass, order: Iterator[bytes]) -> HostEntry | None:
        """The next candidate that is an unpinned visible entry whose slot ``needy`` can use: its
        own class's, or another class's whose memory may be released (not GPU-registered).
        Candidates passed over stay passed over for the rest of one ``reserve`` (nothing
        changes their pins or classes meanwhile)."""
        entries, by_index, registered = self.entries, self._by_index, self._registered
        grows = bool(needy.holes) or needy.hwm < needy.nslots  # (else another class's slot cannot help)
        for bkey in order:
            v = entries.get(bkey)
            if v is None:
                continue
            cls, slot = by_index[v >> 32], v & _SLOT
            if cls.states[slot] >= _PIN or (cls is not needy and (not grows or cls.key in registered)):
                continue
            entry = _view(bkey, cls, slot)
            entry._detach()
            hide_entry(entries, self.per_fp, entry)
            if self._recency is not None:
                self._gone[bkey] = v
            return entry
        return None

    def finish_eviction(self) -> None:
        """Release the memory of victims taken from other size classes (after demotion), but
        not of a class a GPU pinned meanwhile (:meth:`mark_registered`): its memory stays, so
        the slot is a free (backed) slot of its class again, and the tier may be over its
        capacity by it until that class's own use takes it back."""
        for cls, slot in self._pending_punch:
            if cls.key in self._registered:
                cls.holes.remove(slot)
                cls.free.append(slot)
                continue
            punch_hole(cls.fd, slot * cls.slot_bytes, cls.slot_bytes)
        self._pending_punch.clear()
        self._late_sums.clear()  # (the victims were demoted, or not, by now)

    def commit(self, entry: HostEntry) -> bool:
        """Make a granted entry visible. False (and the slot freed) if the key became visible
        meanwhile through another grant: the first commit wins, the bytes are the same block.
        False, and nothing touched, for a stale grant (its slot changed hands since: it is
        another block's now)."""
        cls, sg, bkey = entry.cls, entry._sg, entry.bkey
        slot = sg >> 32
        if cls.gens[slot] != sg & 0xFFFFFFFF or entry._st < 0:  # stale (HostEntry.current), or committed
            return False
        if bkey in self.entries:
            self._free_slot(entry)
            return False
        cls.states[slot] = entry._st | _VISIBLE  # a grant's own state, into the arrays (_attach)
        cls.sizes[slot] = entry.block_bytes
        entry._st = -1
        v = cls.index << 32 | slot
        if self._recency is not None and cls.lseen[slot]:  # type: ignore[index]
            self._recency.drop_former(v)  # the slot's former holder was never popped (not expected)
        self.entries[bkey] = v
        self.per_fp[bkey[:FP_BYTES]] += 1
        return True

    def pin(self, entry: HostEntry) -> None:
        if entry._st < 0:
            self._check_view(entry)
            entry.cls.states[entry._sg >> 32] += _PIN
        else:
            entry._st += _PIN

    def _check_view(self, entry: HostEntry) -> None:
        """A view of a held entry is only as good as its slot: once the slot changed hands its
        arrays are another block's (a view kept past its block's end must not touch them)."""
        if not entry.current:
            raise self.error(f"stale entry: slot {entry.slot} changed hands (generation {entry.gen})")

    def unpin(self, entry: HostEntry) -> None:
        if entry._st < 0:
            self._check_view(entry)
        st = entry._state
        if st < _PIN:
            raise self.error(f"unpin of an entry with no pins (slot {entry.slot})")
        st -= _PIN
        entry._state = st
        if st < _PIN and st & _REMOVED:
            self._reclaim(entry)

    def abort(self, entry: HostEntry) -> None:
        """Give back a grant that was never committed (a stale one gives nothing back)."""
        self._free_slot(entry)

    def unback(self, entries: list[HostEntry]) -> None:
        """Give back grants whose memory could not be allocated (tmpfs full): their slots
        become holes, so the budget shrinks to what the filesystem can really hold."""
        for e in entries:
            if e.current:
                e.cls.bump(e.slot)
                if e.cls.key in self._registered:  # pinned meanwhile: resident, never punched
                    e.cls.free.append(e.slot)
                    continue
                e.cls.holes.append(e.slot)
                punch_hole(e.cls.fd, e.offset, e.cls.slot_bytes)  # (what of it was allocated)

    def remove(self, bkeys: Iterable[bytes]) -> list[HostEntry]:
        """Hide these entries; free their slots now, or on the last unpin if pinned."""
        out = []
        for bkey in bkeys:
            entry = self.get(bkey)
            if entry is None:
                continue
            if self._recency is not None:
                self._gone[bkey] = self.entries[bkey]
            hide_entry(self.entries, self.per_fp, entry)
            entry.removed = True  # pinned: the views that hold its pins see it (the arrays)
            if entry.pins == 0:
                entry._detach()
                self._free_slot(entry)
            out.append(entry)
        return out

    def _free_slot(self, entry: HostEntry) -> None:
        if entry.current:  # a stale entry's slot is another block's: never freed twice
            entry.cls.bump(entry.slot)
            entry.cls.free.append(entry.slot)

    # -- integrity -----------------------------------------------------------------------

    @staticmethod
    def _checksums(entries: Sequence[HostEntry]) -> list[int]:
        return [payload_checksum(e.cls.payload(e.offset, e.block_bytes)) for e in entries]

    async def checksums(self, entries: Sequence[HostEntry]) -> list[int]:
        """The payload checksum of each entry's slot as it is now. Small batches are hashed
        inline; larger ones in up to ``HASH_THREADS`` parts on the hashing threads (xxhash
        releases the GIL), while the caller awaits. The caller keeps the slots from being
        reused meanwhile (grants not yet committed, or pinned entries)."""
        if sum(e.block_bytes for e in entries) <= INLINE_HASH_BYTES:
            return self._checksums(entries)
        for e in entries:
            e.cls.payload(0, 0).release()  # map on the loop, not on the threads
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvtier-host-hash")
        loop = asyncio.get_running_loop()
        n = min(HASH_THREADS, len(entries))
        parts = [entries[i::n] for i in range(n)]
        sums = await asyncio.gather(*(loop.run_in_executor(self._hasher, self._checksums, p) for p in parts))
        out = [0] * len(entries)
        for i in range(n):
            out[i::n] = sums[i]
        return out

    def seal(self, entries: Sequence[HostEntry], sums: Sequence[int] | None = None) -> None:
        """Take the payload checksum of granted entries, as they are committed: now if the
        batch is small, else on the hashing threads (``entry.sealing`` until it is taken).
        ``sums``: the checksums the writer took as it copied the payloads in (one per entry,
        docs/DESIGN.md "Client checksums"): recorded as they are, nothing hashed."""
        if sums is not None:
            for e, c in zip(entries, sums, strict=True):
                e.checksum = c
            return
        if sum(e.block_bytes for e in entries) <= INLINE_HASH_BYTES:
            for e, c in zip(entries, self._checksums(entries), strict=True):
                e.checksum = c
            return
        task = asyncio.ensure_future(self._seal_later(list(entries)))
        self._sealing.add(task)
        task.add_done_callback(self._sealing.discard)
        for e in entries:
            e.sealing = task

    async def _seal_later(self, entries: list[HostEntry]) -> None:
        """Record the checksums taken on the hashing threads where the tier still holds each
        block in its slot. One that left meanwhile (evicted, removed) must not write the
        slot's arrays (the slot may be another block's by then): its checksum waits in
        ``_late_sums`` for :meth:`sealed` to give it to the victim being demoted, until the
        next :meth:`finish_eviction`."""
        try:
            for e, c in zip(entries, await self.checksums(entries), strict=True):
                if e._st < 0 and e.current:
                    e.checksum = c
                else:
                    self._late_sums[(e.cls.index, e._sg)] = c
        finally:
            for e in entries:
                e.sealing = None

    async def sealed(self, entries: Iterable[HostEntry]) -> None:
        """Wait until the checksums of these entries are taken (see :meth:`seal`). A victim
        evicted while its checksum was being taken gets it here."""
        entries = list(entries)
        pending = {id(t): t for t in (e.sealing for e in entries) if t is not None}
        if pending:
            await asyncio.gather(*pending.values(), return_exceptions=True)
        late = self._late_sums
        if late:
            for e in entries:
                if e._st >= 0 and not e._st & _SUMMED:  # detached before its checksum came
                    c = late.get((e.cls.index, e._sg))
                    if c is not None:
                        e.checksum = c  # (the slot's sum is the victim's until finish_eviction)

    async def verify(self, entries: Sequence[HostEntry]) -> list[HostEntry]:
        """The entries whose payload no longer matches the checksum taken at commit (entries
        without a checksum are not judged). The caller pins them meanwhile."""
        await self.sealed(entries)
        judged = [e for e in entries if e.checksum is not None]
        return [e for e, c in zip(judged, await self.checksums(judged), strict=True) if c != e.checksum]


class HostRecency:
    """The placement policy's host map (``TierPolicy(host_map=...)``) kept in the host tier's
    per-slot arrays: an intrusive doubly linked list over the slots (least recently used
    first) and each block's seen count, found through :attr:`HostTier.entries`, which also
    keeps each slot's key (no dict of its own, no object per block). It
    behaves as the ``OrderedDict`` the policy keeps otherwise, for the operations the policy
    uses, on one condition the daemon meets: a key enters it only while the tier holds it
    visible, and a key the tier hides (a victim, a removal) is popped from it in the same loop
    step (until then it stays in the order, named by its slot's key: :attr:`HostTier._gone`)."""

    def __init__(self, host: HostTier) -> None:
        self._entries = host.entries
        self._gone = host._gone
        self._by_index = host._by_index
        self._head = -1
        self._tail = -1
        self._len = 0

    def _node(self, k: bytes) -> int:
        """The node (class index << 32 | slot) of ``k`` in the order, or -1."""
        v = self._entries.get(k)
        if v is not None:  # held: the slot's key is k; in the order if its count is set
            return v if self._by_index[v >> 32].lseen[v & _SLOT] else -1  # type: ignore[index]
        v = self._gone.get(k)
        if v is None or not self._by_index[v >> 32].lseen[v & _SLOT]:  # type: ignore[index]
            return -1
        return v if self._entries.id_of(v) == k else -1

    def __len__(self) -> int:
        return self._len

    def __contains__(self, k: object) -> bool:
        return self._node(k) >= 0  # type: ignore[arg-type]

    def get(self, k: bytes, default: int | None = None) -> int | None:
        v = self._node(k)
        return default if v < 0 else self._by_index[v >> 32].lseen[v & _SLOT] - 1  # type: ignore[index]

    def __getitem__(self, k: bytes) -> int:
        v = self._node(k)
        if v < 0:
            raise KeyError(k)
        return self._by_index[v >> 32].lseen[v & _SLOT] - 1  # type: ignore[index]

    def __setitem__(self, k: bytes, n: int) -> None:
        """Set ``k``'s count (a key in the order keeps its place; a new one goes last)."""
        by_index = self._by_index
        v = self._entries.get(k)
        if v is None:  # only a key hidden but not popped yet is in the order without being held
            g = self._node(k)
            if g >= 0:
                by_index[g >> 32].lseen[g & _SLOT] = n + 1  # type: ignore[index]
                return
            raise KeyError(f"{k!r} is not held in the host tier")
        cls, slot = by_index[v >> 32], v & _SLOT
        if cls.lseen[slot]:  # type: ignore[index]
            cls.lseen[slot] = n + 1  # type: ignore[index]
            return
        if self._gone:
            g = self._gone.pop(k, None)
            if g is not None and g != v and by_index[g >> 32].lseen[g & _SLOT] and self._entries.id_of(g) == k:  # type: ignore[index]
                self.pop_node(g)  # its former place, never popped (not expected)
        cls.lseen[slot] = n + 1  # type: ignore[index]
        self._append(v)
        self._len += 1

    def move_to_end(self, k: bytes) -> None:
        v = self._node(k)
        if v < 0:
            raise KeyError(k)
        if v != self._tail:
            self._unlink(v)
            self._append(v)

    def pop(self, k: bytes, default: int | None = None) -> int | None:
        v = self._node(k)
        if v < 0:
            return default
        self._gone.pop(k, None)
        return self.pop_node(v)

    def pop_node(self, v: int) -> int:
        cls, slot = self._by_index[v >> 32], v & _SLOT
        self._unlink(v)
        n = cls.lseen[slot] - 1  # type: ignore[index]
        cls.lseen[slot] = 0  # type: ignore[index]
        self._len -= 1
        return n

    def drop_former(self, v: int) -> None:
        """A new entry takes slot ``v`` while the slot's former key is still in the order."""
        k = self._entries.id_of(v)
        if k is not None and self._gone.get(k) == v:
            del self._gone[k]
        self.pop_node(v)

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first (entries the tier hid meanwhile included)."""
        by_index, id_of, v = self._by_index, self._entries.id_of, self._head
        while v >= 0:
            nxt = by_index[v >> 32].lnext[v & _SLOT]  # type: ignore[index]
            yield id_of(v)
            v = nxt

    def keys(self) -> Iterator[bytes]:
        return iter(self)

    def items(self) -> Iterator[tuple[bytes, int]]:
        by_index, id_of, v = self._by_index, self._entries.id_of, self._head
        while v >= 0:
            cls, slot = by_index[v >> 32], v & _SLOT
            nxt = cls.lnext[slot]  # type: ignore[index]
            yield id_of(v), cls.lseen[slot] - 1  # type: ignore[index]
            v = nxt

    def _append(self, v: int) -> None:
        cls, slot = self._by_index[v >> 32], v & _SLOT
        tail = self._tail
        cls.lprev[slot] = tail  # type: ignore[index]
        cls.lnext[slot] = -1  # type: ignore[index]
        if tail < 0:
            self._head = v
        else:
            self._by_index[tail >> 32].lnext[tail & _SLOT] = v  # type: ignore[index]
        self._tail = v

    def _unlink(self, v: int) -> None:
        by_index = self._by_index
        cls, slot = by_index[v >> 32], v & _SLOT
        p, n = cls.lprev[slot], cls.lnext[slot]  # type: ignore[index]
        if p < 0:
            self._head = n
        else:
            by_index[p >> 32].lnext[p & _SLOT] = n  # type: ignore[index]
        if n < 0:
            self._tail = p
        else:
            by_index[n >> 32].lprev[n & _SLOT] = p  # type: ignore[index]


def create_exclusive(path: str) -> int:
    """Create a new pool file, owner-only: never an existing file, never through a link."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ELOOP):
            what = "a symbolic link" if os.path.islink(path) else "a file"
            raise PoolFileError(f"pool file {path}: {what} is already there; refusing to use or follow it "
                                f"(another process planted it, or a daemon with this name is running)") from None
        raise

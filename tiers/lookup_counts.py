"""The lookup counters region: key-table lookups a client counts where the daemon reads them.

A client that answers lookups from the shared-memory key table (:mod:`kvtier.tiers.keytable`)
never calls the daemon for them, yet the daemon's lookup counters (hit rate by tier: Stats,
``/metrics``, ``kvtier report``) must include them. Reporting them in batches loses the last
batch of a client that is killed or never closes, so instead each client counts into a small
region of shared memory that the daemon reads: nothing the client counted can be lost, since
the daemon still holds the mapping after the client is gone.

The region is a memfd the client creates (:class:`CountsWriter`), sealed against shrinking
and growing (``F_SEAL_SHRINK | F_SEAL_GROW``), and hands the daemon once per credential
connection (``{"op": "lookup_counters"}`` with the descriptor, :mod:`kvtier.handshake`). The
daemon checks it (:func:`map_counts`: a sealed memfd of exactly :data:`REGION_BYTES`, with
this header), maps it read-only and folds what changed since its last read into its lookup
counters (:class:`CountsReader`).

Format: :data:`ROWS` rows of :data:`ROW_WORDS` little-endian uint64 (128 bytes each).

    row 0 (header)   [0] MAGIC  [1] VERSION  [2] SLOTS  (the rest 0)
    row 1 + s        slot s: [0] the daemon's layout id (0: free)
                             [1 + m] lookups whose tier bit set (keytable.TIER_BITS) was m,
                                     m = 0..7 (m = 0: a miss)
                             (the rest 0)

Only the client writes; each counter only grows (by a plain aligned 8-byte store, which a
reader never sees torn). A slot is claimed by writing its layout id after its counters are
zero (a fresh memfd is all zeros), and keeps that layout for the region's life. The fastest
tier of a bit set is the lowest bit: gpu (1), then host (2), then disk (4).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import numpy as np

from kvtier.tiers.layout import MAX_LAYOUTS

MAGIC = int.from_bytes(b"KVTLKC01", "little")  #: the header's first word
VERSION = 1
SLOTS = MAX_LAYOUTS          #: one per layout a daemon accepts
ROW_WORDS = 16               #: uint64 words per row (128 bytes: two cache lines, no false sharing)
ROWS = 1 + SLOTS
REGION_BYTES = ROWS * ROW_WORDS * 8
MASKS = 8                    #: tier bit sets counted per slot (3 tier bits)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class CountsError(ValueError):
    """A region that is not a lookup counters region: the message says what is wrong."""


def by_tier(c: list[int]) -> tuple[int, int, int, int]:
    """(gpu, host, disk, miss) of one slot's :data:`MASKS` counts by tier bit set."""
    return c[1] + c[3] + c[5] + c[7], c[2] + c[6], c[4], c[0]


class CountsWriter:
    """The client's side: a new region (its descriptor in :attr:`fd` until :meth:`release_fd`)
    and a :data:`MASKS`-wide counts view per claimed slot (:meth:`claim`)."""

    def __init__(self, name: str = "kvtier-lookup-counts") -> None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, REGION_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(fd, REGION_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.rows = np.frombuffer(self._map, dtype="<u8").reshape(ROWS, ROW_WORDS)
        self.rows[0, :3] = (MAGIC, VERSION, SLOTS)
        self._slots: dict[int, int] = {}  # layout id -> slot

    def claim(self, layout_id: int) -> np.ndarray | None:
        """The counts of ``layout_id`` (a writable uint64 view of :data:`MASKS`: add to
        ``view[mask]``), claiming a slot for it once; None when every slot is taken."""
        slot = self._slots.get(layout_id)
        if slot is None:
            if len(self._slots) >= SLOTS or not 0 < layout_id < 1 << 63:
                return None
            slot = self._slots[layout_id] = len(self._slots)
            self.rows[1 + slot, 0] = layout_id  # last: the counters are zero
        return self.rows[1 + slot, 1:1 + MASKS]

    def release_fd(self) -> None:
        """Close the descriptor (once the daemon has it); the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.release_fd()
        # views handed out by claim() may still be referenced (a lookup in another thread): the
        # mapping goes with the last of them, when the garbage collector frees it


def map_counts(fd: int) -> mmap.mmap:
    """Map a region a client passed, read-only, after checking it is one: a memfd sealed
    against shrinking and growing, of exactly :data:`REGION_BYTES`, with this format's header.
    Raises :class:`CountsError` saying what is wrong. The caller keeps (and closes) ``fd``."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    except OSError as e:
        raise CountsError(f"the lookup counters region is not a sealed memfd ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or seals & SEALS != SEALS:
        raise CountsError("the lookup counters region must be a memfd sealed against shrinking and growing "
                          "(F_SEAL_SHRINK | F_SEAL_GROW)")
    if st.st_size != REGION_BYTES:
        raise CountsError(f"the lookup counters region is {st.st_size} bytes; it must be {REGION_BYTES}")
    try:
        m = mmap.mmap(fd, REGION_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as e:
        raise CountsError(f"cannot map the lookup counters region: {e.strerror}") from None
    header = np.frombuffer(m, dtype="<u8", count=3)
    if tuple(int(x) for x in header) != (MAGIC, VERSION, SLOTS):
        del header
        m.close()
        raise CountsError(f"the lookup counters region's header is not (magic {MAGIC:#x}, version {VERSION}, "
                          f"{SLOTS} slots)")
    return m


class CountsReader:
    """The daemon's side of one region: :meth:`deltas` answers what each slot counted since the
    last call, bounded (a client writes the region as it likes: nothing it writes can make
    the daemon count more than ``limit`` lookups a read, or fail)."""

    def __init__(self, m: mmap.mmap, limit: int) -> None:
        self._map = m
        self._rows = np.frombuffer(m, dtype="<u8").reshape(ROWS, ROW_WORDS)
        self.limit = limit
        self._ids = np.zeros(SLOTS, dtype=np.uint64)               # each slot's layout id at the last read
        self._seen = np.zeros((SLOTS, MASKS), dtype=np.uint64)     # and its counts
        self.refused = 0  # reads that counted nothing: counters that went down or past the limit

    def deltas(self) -> list[tuple[int, tuple[int, int, int, int]]]:
        """(layout id, (gpu, host, disk, miss)) per claimed slot that counted since the last
        call. A slot whose layout id changed, or whose counters went down, counts nothing this
        time (an honest client does neither); nor does a read of more than ``limit`` lookups."""
        rows = self._rows[1:]
        ids = rows[:, 0].copy()
        used = np.flatnonzero(ids)
        if used.size == 0:
            return []
        now = rows[used, 1:1 + MASKS].copy()
        before = self._seen[used]
        same = (self._ids[used] == ids[used]) | (self._ids[used] == 0)
        grew = (now >= before).all(axis=1) & same
        self._ids[used] = ids[used]
        self._seen[used] = now
        out: list[tuple[int, tuple[int, int, int, int]]] = []
        total = 0
        for i in np.flatnonzero(grew):  # differences as Python ints (uint64 arithmetic wraps)
            delta = [int(a) - int(b) for a, b in zip(now[i], before[i], strict=True)]
            n = sum(delta)
            if n:
                total += n
                out.append((int(ids[used[i]]), by_tier(delta)))
        if total > self.limit or not grew.all():
            self.refused += 1
        return [] if total > self.limit else out

    def close(self) -> None:
        del self._rows
        self._map.close()

"""Disk tier: fixed-size slots in preallocated slab files, an LMDB index, xxh3 checksums.

What it owns
    A directory (``--disk-dir``) holding one slab file per size class (``slab-<slot_bytes>.dat``;
    one class per distinct block size), an LMDB environment (``index/``) and a lock file that
    keeps a second daemon out. Slot ``i`` of a class lies at byte ``i * slot_bytes`` of its
    file; slot sizes are multiples of 4 KiB, so every read and write is ``O_DIRECT`` from or
    into page-aligned memory (the daemon's mapping of the host pool). Slab files grow in
    preallocated (``fallocate``) chunks; ``capacity`` bounds the bytes of all of them
    together, always. When a class needs the budget held by another class, the victim's slot
    is punched out of its file.

The index
    LMDB maps ``fingerprint + key`` to (slot bytes, slot, length, xxh3-64 checksum, write
    sequence). One write transaction per batch. The tier keeps no recency order: which block
    to evict is the placement policy's decision (:class:`kvtier.tiers.policy.TierPolicy`),
    kept in memory only (a write transaction per read would cost an fsync each). After a
    restart :attr:`DiskTier.entries` lists the restored blocks in write order, oldest first,
    which is then their recency order.

Durability order (what survives a crash)
    A write batch runs on the tier's single writer thread, in this order: index entries of
    the slots it reuses are deleted (committed), their space is punched or preallocated, the
    payloads are written (``pwritev``, up to ``queue_depth`` in flight), every slab file
    touched is ``fdatasync``-ed, and only then do the new index entries commit. So a torn
    write is never indexed, and every committed entry names bytes that reached the disk.
    Removals (LRU, checksum failures, explicit evictions) are queued on the same thread, so a
    slot's old entry is gone from the index before new bytes land in it. On restart the tier
    reopens the index and serves every committed entry again (warm restart).

Integrity
    Every read recomputes the xxh3-64 of the payload; a mismatch (or a read error) is
    reported to the caller (:class:`ReadOutcome`), which must :meth:`DiskTier.remove` the entry and treat the block
    as a miss. Wrong bytes are never made visible by this tier. A write may carry the
    checksum the host tier took at commit (``plan_write``'s ``expect``): a payload that no
    longer matches it is not written, not indexed, never visible, and is reported in
    :attr:`WritePlan.mismatched` (and logged) for the caller to count and drop.

Files and ownership
    The directory must belong to the daemon's user and not be writable by group or others
    (else :class:`DiskTierError` at open): whoever can write it can replace the index or the
    slabs. The index (LMDB) and slab files are created 0600 (existing ones are made so at
    open), slab files without following links, and the directory is ``fsync``-ed on the
    writer thread after a slab file was created, before any index entry naming it commits.
    :meth:`DiskTier.flush` resolves once every removal queued before it has committed, so
    an Evict can be answered only when it survives a crash.

Entries and their states
    ``plan_write`` reserves slots (evicting, when the capacity is reached, the first unpinned
    entries among the candidates it is given, in their order: they are hidden at once and
    returned as *victims*); the planned entries are invisible until
    ``finish_write`` after the batch is durable. ``pin`` keeps an entry's slot from being
    evicted or reused while a read is in flight; ``remove`` of a pinned entry hides it and
    frees the slot on the last ``unpin``. Pin counts never go negative.

Failure
    ``ENOSPC`` (or any other ``OSError``) during a write batch, or a full LMDB map, turns the
    tier *degraded*: the batch is not made visible, one log line says why, and every later
    ``plan_write`` is refused (host-only operation); reads of committed entries go on.
    Recovery: :attr:`DiskTier.degraded` is checked again at most every
    ``recheck_s`` seconds: a tier degraded by a full filesystem takes writes again once the
    filesystem has room again (at least :data:`RECOVER_FREE_BYTES`, and four slots of its
    largest class), any other failure is retried after ``recheck_s``; a write that fails again
    degrades it again. One log line says when it recovered.

Accounting of restored slabs
    At open, every slot of a slab file that no index entry names is punched out of the file
    and kept as a hole: restored blocks count only their own slots against ``capacity``, not
    the whole preallocated (or once larger) file.

Threading
    Bookkeeping (``get``, ``plan_write``, ``finish_write``, ``remove``, pins) is not
    thread-safe: the daemon calls it from its event loop only. ``submit_write`` and
    ``submit_read`` return :class:`concurrent.futures.Future` objects whose work runs on the
    tier's own threads (the GIL is released during the syscalls and the checksum).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
import re
import stat
import struct
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field

import lmdb
import xxhash

from kvtier.tiers.host import PinnedTier, hide_entry, punch_hole, punch_slots, take_unpinned
from kvtier.tiers.layout import SLOT_ALIGN
from kvtier.tiers.vocab import fingerprint_of

log = logging.getLogger("kvtier.disk")

GROW_BYTES = 256 * 1024 * 1024          # slab files grow by preallocated chunks of up to this
INDEX_FORMAT = b"kvtier-disk-index-v1"
_VALUE = struct.Struct("<IQQQQ")        # slot_bytes, slot, length, xxh3-64, write sequence
_SLAB_NAME = re.compile(r"^slab-([0-9]+)\.dat$")
RECOVER_FREE_BYTES = 1 << 20            # a full filesystem counts as having room again above this
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskTierError(Exception):
    """The disk tier cannot be opened as configured; the message says what to change."""


class ReadOutcome(enum.Enum):
    """What reading one block from its slot found."""

    OK = "ok"                # the bytes are the ones stored (checksum matched)
    CHECKSUM = "checksum"    # the bytes differ from what was stored
    IO_ERROR = "ioerror"     # the read failed or came back short


def checksum(buf: memoryview | bytes) -> int:
    """The payload checksum the index stores: xxh3-64."""
    return xxhash.xxh3_64_intdigest(buf)


def check_directory(path: str) -> None:
    """Refuse a disk directory another user owns, or that group or others may write: they
    could replace its index or slab files (plant links, rewrite blocks with checksums)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskTierError(f"--disk-dir {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise DiskTierError(f"--disk-dir {path} is owned by uid {st.st_uid}, not by this daemon's uid "
                            f"{os.geteuid()}: give the daemon a directory of its own (chown it)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskTierError(f"--disk-dir {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may "
                            f"write it; make it 0700 (chmod 700 {path})")


def default_map_size(capacity: int) -> int:
    """LMDB map size for ``capacity`` bytes of slots: 256 B per 4 KiB slot, at least 64 MiB."""
    return max(64 * 1024 * 1024, capacity // SLOT_ALIGN * 256)


@dataclass(eq=False)
class Slab:
    """The slots of one size, in one slab file."""

    slot_bytes: int
    path: str
    fd: int
    nslots: int                                     # slots the file has room for
    free: list[int] = field(default_factory=list)   # preallocated slots, unused
    holes: list[int] = field(default_factory=list)  # slots below nslots without space (punched)

    @property
    def allocated_bytes(self) -> int:
        return (self.nslots - len(self.holes)) * self.slot_bytes


@dataclass(eq=False)
class DiskEntry:
    """A block in the disk tier (``bkey`` = layout fingerprint + key)."""

    bkey: bytes
    slab: Slab
    slot: int
    length: int
    checksum: int = 0
    seq: int = 0
    pins: int = 0
    visible: bool = False
    removed: bool = False
    expect: int | None = None   # the checksum the payload must have (the host tier's), if known

    @property
    def offset(self) -> int:
        return self.slot * self.slab.slot_bytes


@dataclass
class WritePlan:
    """What ``plan_write`` gives back: one entry (or None: no slot) per item, and the victims."""

    entries: list[DiskEntry | None]
    victims: list[DiskEntry]
    _deletes: list[bytes] = field(default_factory=list)
    _punch: list[tuple[int, int, int]] = field(default_factory=list)   # (fd, offset, length)
    _grow: list[tuple[int, int, int]] = field(default_factory=list)
    mismatched: list[DiskEntry] = field(default_factory=list)  # payloads that failed ``expect``: not written

    @property
    def planned(self) -> list[DiskEntry]:
        return [e for e in self.entries if e is not None]

    _submitted: bool = False


class DiskTier(PinnedTier[DiskEntry]):
    """Slots, index and pins of the disk tier (see the module docstring)."""

    def __init__(self, directory: str, capacity: int = 0, queue_depth: int = 8, map_size: int = 0,
                 recheck_s: float = 10.0) -> None:
        if queue_depth < 1:
            raise DiskTierError(f"disk queue depth must be at least 1, got {queue_depth}")
        self.directory = os.path.abspath(directory)
        self.queue_depth = queue_depth
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise DiskTierError(f"--disk-dir {directory}: cannot create it: {e.strerror}") from None
        check_directory(self.directory)
        self._dir_changes = 0   # slab files created (bumped on the loop) ...
        self._dir_synced = 0    # ... and how many of them the writer thread has fsynced the directory for
        self._lock_fd = self._take_lock()
        self._probe_odirect()
        self.slabs: dict[int, Slab] = {}
        self._open_slabs()
        existing = sum(os.fstat(s.fd).st_blocks * 512 for s in self.slabs.values())  # space really held
        if capacity <= 0:
            st = os.statvfs(self.directory)
            capacity = int((st.f_bavail * st.f_frsize + existing) * 0.9)
        self.capacity = capacity
        self.map_size = map_size or default_map_size(capacity)
        try:
            self.env = lmdb.open(self._index_dir(), map_size=self.map_size, subdir=True, mode=0o600,
                                 max_dbs=2, sync=True, metasync=True, readahead=False, meminit=False)
        except lmdb.Error as e:
            raise DiskTierError(f"--disk-dir {directory}: cannot open the LMDB index: {e}") from None
        self._blocks = self.env.open_db(b"blocks")
        self._meta = self.env.open_db(b"meta")
        self.entries: dict[bytes, DiskEntry] = {}              # visible (restored ones in write order)
        self.per_fp: Counter[bytes] = Counter()                 # visible blocks per fingerprint
        self._writing: set[bytes] = set()
        self._failed_deletes: list[bytes] = []  # index deletes that failed (writer thread): retried
        self._unwanted: set[bytes] = set()   # removed while being written: dropped when the write finishes
        self._seq = 0
        self._degraded = ""                  # why writes stopped; "" while healthy (see ``degraded``)
        self._space_error = False            # ... because the filesystem was full
        self._recheck_at = 0.0               # monotonic time of the next recovery check
        self.recheck_s = recheck_s
        self.recoveries = 0                  # times the tier took writes again after degrading
        # the durability barrier of a write batch; an attribute so that a test can make it fail
        # (EIO) in a real tier and see that nothing it was guarding becomes visible
        self._fdatasync = os.fdatasync
        self.restored, self.dropped_on_open = self._restore()
        self._io = ThreadPoolExecutor(queue_depth, thread_name_prefix="kvtier-disk-io")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-writer")

    # -- open and restore -----------------------------------------------------------------

    def _index_dir(self) -> str:
        """The LMDB directory, 0700, its files 0600 (an index made before they were is fixed)."""
        path = os.path.join(self.directory, "index")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise DiskTierError(f"--disk-dir {self.directory}: {path} is not a directory") from None
            os.chmod(path, 0o700)
            for name in os.listdir(path):
                f = os.path.join(path, name)
                if stat.S_ISREG(os.lstat(f).st_mode):
                    os.chmod(f, 0o600)
        return path

    def _take_lock(self) -> int:
        fd = os.open(os.path.join(self.directory, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskTierError(f"--disk-dir {self.directory} is in use by another kvtierd; give each "
                                f"daemon its own directory") from None
        return fd

    def _probe_odirect(self) -> None:
        path = os.path.join(self.directory, ".odirect-probe")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise DiskTierError(f"--disk-dir {self.directory} does not support O_DIRECT; put it on "
                                    f"a local filesystem (ext4, xfs) on the NVMe") from None
            raise DiskTierError(f"--disk-dir {self.directory}: {e.strerror}") from None
        os.close(fd)
        os.unlink(path)

    def _open_slab(self, slot_bytes: int) -> Slab:
        path = os.path.join(self.directory, f"slab-{slot_bytes}.dat")
        flags = os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            self._dir_changes += 1  # a new name in the directory: fsynced before it is indexed
        except FileExistsError:
            try:
                fd = os.open(path, flags)
            except OSError as e:
                raise DiskTierError(f"--disk-dir {self.directory}: cannot open {path}: {e.strerror} (a slab "
                                    f"file must be a regular file, not a link)") from None
            os.fchmod(fd, 0o600)
        nslots = os.fstat(fd).st_size // slot_bytes
        slab = Slab(slot_bytes, path, fd, nslots)
        self.slabs[slot_bytes] = slab
        return slab

    def _open_slabs(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            m = _SLAB_NAME.match(name)
            if m and int(m.group(1)) % SLOT_ALIGN == 0 and int(m.group(1)) > 0:
                self._open_slab(int(m.group(1)))

    def _restore(self) -> tuple[int, int]:
        """Rebuild the in-memory state from the committed index; returns (restored, dropped)."""
        with self.env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=self._meta)
            if fmt is None:
                txn.put(b"format", INDEX_FORMAT, db=self._meta)
            elif fmt != INDEX_FORMAT:
                raise DiskTierError(f"--disk-dir {self.directory} holds an index of format {fmt!r}; this "
                                    f"kvtierd writes {INDEX_FORMAT!r}: use another directory")
        found: list[DiskEntry] = []
        bad: list[bytes] = []
        used: dict[int, set[int]] = {}
        with self.env.begin(db=self._blocks) as txn:
            rows = [(bytes(k), _VALUE.unpack(v)) for k, v in txn.cursor()]
        rows.sort(key=lambda r: -r[1][4])   # newest first: of two entries naming one slot, keep the newer
        for bkey, (slot_bytes, slot, length, csum, seq) in rows:
            slab = self.slabs.get(slot_bytes)
            taken = used.setdefault(slot_bytes, set())
            if slab is None or slot >= slab.nslots or length > slot_bytes or slot in taken:
                bad.append(bkey)
                continue
            taken.add(slot)
            found.append(DiskEntry(bkey, slab, slot, length, csum, seq, visible=True))
        if bad:
            self._index_delete(bad)
            log.warning("disk index entries dropped on open: they name slots outside the slab files "
                        "or a slot a newer entry holds",
                        extra={"dropped": len(bad), "disk_dir": self.directory})
        found.sort(key=lambda e: e.seq)
        for e in found:
            self.entries[e.bkey] = e
            self.per_fp[fingerprint_of(e.bkey)] += 1
        self._seq = found[-1].seq if found else 0
        for slot_bytes, slab in self.slabs.items():
            self._release_untaken(slab, used.get(slot_bytes, set()))
        return len(found), len(bad)

    @staticmethod
    def _release_untaken(slab: Slab, taken: set[int]) -> None:
        """Punch every slot of ``slab`` no restored entry names and keep it as a hole: restored
        blocks count only their own slots (a slab file is preallocated in large chunks, and
        slots punched for another class look allocated by the file's size alone)."""
        untaken = [s for s in range(slab.nslots) if s not in taken]
        punch_slots(slab.fd, untaken, slab.slot_bytes)
        slab.free = []
        slab.holes = untaken[::-1]  # handed out lowest first

    # -- accounting -----------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes of slab files holding (or reserved for) slots."""
        return sum(s.allocated_bytes for s in self.slabs.values())

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding visible blocks or writes in flight."""
        return sum((s.nslots - len(s.holes) - len(s.free)) * s.slot_bytes for s in self.slabs.values())

    # -- reads ----------------------------------------------------------------------------

    def _reclaim(self, entry: DiskEntry) -> None:
        entry.slab.free.append(entry.slot)

    def submit_read(self, entries: Sequence[DiskEntry], dests: Sequence[memoryview]) -> list[Future[ReadOutcome]]:
        """Read each entry's slot into ``dests[i]`` (page-aligned, ``slot_bytes`` long) and verify it;
        each future yields a :class:`ReadOutcome`. Pin the entries until the futures are done."""
        return [self._io.submit(self._read_one, e, d) for e, d in zip(entries, dests, strict=True)]

    @staticmethod
    def _read_one(entry: DiskEntry, dest: memoryview) -> ReadOutcome:
        try:
            n = os.preadv(entry.slab.fd, [dest], entry.offset)
        except OSError as e:
            log.error("disk read failed", extra={"path": entry.slab.path, "offset": entry.offset,
                                                 "error": e.strerror})
            return ReadOutcome.IO_ERROR
        if n < entry.length:
            return ReadOutcome.IO_ERROR
        return ReadOutcome.OK if checksum(dest[:entry.length]) == entry.checksum else ReadOutcome.CHECKSUM

    # -- writes ---------------------------------------------------------------------------

    def plan_write(self, items: Sequence[tuple[bytes, int, int]], candidates: Iterable[bytes] = (),
                   expect: Sequence[int | None] | None = None) -> WritePlan:
        """Reserve a slot per (bkey, length, slot_bytes), in order; None where nothing can be freed,
        the key is already on disk or being written, or the tier is degraded. When a slot must
        be freed, the victim is the first unpinned entry among ``candidates`` (packed ids, in
        eviction order). Victims are hidden now. ``expect``: per item, the checksum its payload
        must have (None: not known); a payload that differs is not written (``mismatched``)."""
        plan = WritePlan([], [])
        order = iter(candidates)
        for i, (bkey, length, slot_bytes) in enumerate(items):
            if self.degraded or bkey in self.entries or bkey in self._writing:
                plan.entries.append(None)
                continue
            slab = self.slabs.get(slot_bytes)
            if slab is None:
                try:
                    slab = self._open_slab(slot_bytes)
                except (OSError, DiskTierError) as e:  # (ENOSPC, EMFILE...): as a failed write, the
                    self._degrade(e)                    # plan so far stays whole (it is submitted as usual)
                    plan.entries.append(None)
                    continue
            slot = self._take_slot(slab, plan, order)
            if slot is None:
                plan.entries.append(None)
                continue
            self._writing.add(bkey)
            plan.entries.append(DiskEntry(bkey, slab, slot, length, expect=None if expect is None else expect[i]))
        return plan

    def _take_slot(self, slab: Slab, plan: WritePlan, order: Iterator[bytes]) -> int | None:
        while True:
            if slab.free:
                return slab.free.pop()
            room = self.capacity - self.allocated_bytes
            if room >= slab.slot_bytes:
                if slab.holes:
                    slot = slab.holes.pop()
                    plan._grow.append((slab.fd, slot * slab.slot_bytes, slab.slot_bytes))
                    return slot
                n = max(1, min(room, GROW_BYTES) // slab.slot_bytes)
                first = slab.nslots
                slab.nslots += n
                plan._grow.append((slab.fd, first * slab.slot_bytes, n * slab.slot_bytes))
                slab.free.extend(range(first + n - 1, first, -1))
                return first
            victim = self._evict_one(order)
            if victim is None:
                return None
            plan.victims.append(victim)
            plan._deletes.append(victim.bkey)
            if victim.slab is slab:
                return victim.slot
            victim.slab.holes.append(victim.slot)
            plan._punch.append((victim.slab.fd, victim.offset, victim.slab.slot_bytes))

    def _evict_one(self, order: Iterator[bytes]) -> DiskEntry | None:
        """The next candidate that is an unpinned visible entry (passed-over candidates stay
        passed over for the rest of one ``plan_write``)."""
        entry = take_unpinned(self.entries, self.per_fp, order)
        if entry is not None:
            entry.removed = True
        return entry

    def _hide(self, entry: DiskEntry) -> None:
        hide_entry(self.entries, self.per_fp, entry)

    def writing(self, bkey: bytes) -> bool:
        """A write of ``bkey`` is planned and not finished (``plan_write`` skips the key meanwhile)."""
        return bkey in self._writing

    def submit_write(self, plan: WritePlan, sources: Sequence[memoryview]) -> Future[None]:
        """Run the batch on the writer thread: one source (page-aligned, ``slot_bytes`` long) per
        planned entry, in order. The future raises ``OSError`` or ``lmdb.Error`` on failure.
        The caller keeps the sources' bytes intact until the future is done."""
        planned = plan.planned
        if len(sources) != len(planned):
            raise ValueError(f"{len(sources)} sources for {len(planned)} planned entries")
        for e in planned:
            self._seq += 1
            e.seq = self._seq
        plan._submitted = True
        return self._writer.submit(self._write_batch, plan, planned, list(sources))

    def _write_batch(self, plan: WritePlan, planned: list[DiskEntry], sources: list[memoryview]) -> None:
        if plan._deletes:
            self._index_delete(plan._deletes)
        for fd, off, length in plan._punch:
            punch_hole(fd, off, length)
        for fd, off, length in plan._grow:
            self._preallocate(fd, off, length, planned)
        futs = [self._io.submit(self._write_one, e, s) for e, s in zip(planned, sources, strict=True)]
        wait_all(futs)  # all ended before any error is raised: the caller frees the sources
        ok = [f.result() for f in futs]
        written = [e for e, good in zip(planned, ok, strict=True) if good]
        plan.mismatched = [e for e, good in zip(planned, ok, strict=True) if not good]
        for fd in {e.slab.fd for e in written}:
            self._fdatasync(fd)
        changes = self._dir_changes
        if changes != self._dir_synced:  # a slab file was created: its name must survive a crash
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._dir_synced = changes
        with self.env.begin(write=True, db=self._blocks) as txn:
            for e in written:
                txn.put(e.bkey, _VALUE.pack(e.slab.slot_bytes, e.slot, e.length, e.checksum, e.seq))

    @staticmethod
    def _preallocate(fd: int, off: int, length: int, planned: list[DiskEntry]) -> None:
        """Preallocate a new chunk; if the filesystem cannot hold it all, just this batch's slots
        in it (the rest of the chunk gets its space when written, or fails then)."""
        try:
            os.posix_fallocate(fd, off, length)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            for entry in planned:
                if entry.slab.fd == fd and off <= entry.offset < off + length:
                    os.posix_fallocate(fd, entry.offset, entry.slab.slot_bytes)

    @staticmethod
    def _write_one(entry: DiskEntry, src: memoryview) -> bool:
        """Write one payload; False (nothing written) if it fails the checksum it must have."""
        entry.checksum = checksum(src[:entry.length])
        if entry.expect is not None and entry.checksum != entry.expect:
            return False
        n = os.pwritev(entry.slab.fd, [src], entry.offset)
        if n != len(src):
            raise OSError(errno.EIO, f"short write: {n} of {len(src)} bytes at {entry.offset} of {entry.slab.path}")
        return True

    def finish_write(self, plan: WritePlan, error: BaseException | None) -> list[DiskEntry]:
        """Make a finished batch visible (``error`` None), or give its slots up and degrade the
        tier (``error`` set). Returns the entries made visible."""
        planned = plan.planned
        for e in planned:
            self._writing.discard(e.bkey)
        if not plan._submitted and (plan._deletes or plan._punch):
            # never submitted (nothing to write), yet it evicted: its victims' index deletes and
            # punches must still happen, before anything reuses their slots (writer thread order)
            self._writer.submit(self._free_unsubmitted, plan._deletes, plan._punch)
        if error is not None:
            for e in planned:
                self._unwanted.discard(e.bkey)
                e.slab.holes.append(e.slot)   # its space may not exist: never hand it out again
            self._degrade(error)
            return []
        if plan.mismatched:  # never indexed: their slots are free again at once
            for e in plan.mismatched:
                self._unwanted.discard(e.bkey)
                e.removed = True
                e.slab.free.append(e.slot)
                log.warning("block not written to disk: its payload no longer matches the checksum taken "
                            "at commit (the host slot was written after the commit)",
                            extra={"key": e.bkey[-16:].hex(), "slab": e.slab.path, "slot": e.slot})
            planned = [e for e in planned if not e.removed]
        unwanted = [e for e in planned if e.bkey in self._unwanted]
        if unwanted:  # removed while written: never visible; index entries deleted before the slots are reused
            for e in unwanted:
                self._unwanted.discard(e.bkey)
                e.removed = True
                e.slab.free.append(e.slot)
            self._writer.submit(self._index_delete_logged, [e.bkey for e in unwanted])
            planned = [e for e in planned if not e.removed]
        for e in planned:
            e.visible = True
            self.entries[e.bkey] = e
            self.per_fp[fingerprint_of(e.bkey)] += 1
        return planned

    @property
    def degraded(self) -> str:
        """Why writes stopped ("" while healthy). Read while degraded, it checks at most every
        ``recheck_s`` whether the cause went away (module docstring: Failure) and recovers."""
        if self._degraded and time.monotonic() >= self._recheck_at:
            self._recheck_at = time.monotonic() + self.recheck_s
            if not self._space_error or self._free_bytes() >= self._room_needed():
                log.warning("disk tier takes writes again (it was degraded: %s)", self._degraded,
                            extra={"disk_dir": self.directory})
                self._degraded = ""
                self._space_error = False
                self.recoveries += 1
        return self._degraded

    def _free_bytes(self) -> int:
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _room_needed(self) -> int:
        return max(RECOVER_FREE_BYTES, 4 * max(self.slabs, default=0))

    def _degrade(self, error: BaseException) -> None:
        if self._degraded:
            return
        if isinstance(error, lmdb.MapFullError):
            why = f"LMDB index map is full ({self.map_size} B): raise --disk-map-size"
        elif isinstance(error, OSError) and error.errno in _SPACE_ERRNOS:
            why = f"{self.directory} is full ({os.strerror(error.errno)}): free space or lower --disk-capacity"
            self._space_error = True
        else:
            why = f"write to {self.directory} failed: {error}"
        self._degraded = why
        self._recheck_at = time.monotonic() + self.recheck_s
        log.error("disk tier degraded to host-only: %s; committed disk blocks are still served", why,
                  extra={"disk_dir": self.directory})

    # -- removal --------------------------------------------------------------------------

    def remove(self, bkeys: Iterable[bytes]) -> list[DiskEntry]:
        """Hide these entries now; their index entries are deleted on the writer thread (before any
        later batch reuses the slots); slots of pinned entries are freed on the last unpin. A key
        being written is dropped when its write finishes (it never becomes visible), and its
        index entry, which that write commits, is deleted right after it on the writer thread
        (so a :meth:`flush` queued after this covers the removal: it survives a crash)."""
        out = []
        late: list[bytes] = []
        for bkey in bkeys:
            entry = self.entries.get(bkey)
            if entry is None:
                if bkey in self._writing:  # not visible yet: it must not become visible
                    self._unwanted.add(bkey)
                    late.append(bkey)
                continue
            self._hide(entry)
            entry.removed = True
            if entry.pins == 0:
                entry.slab.free.append(entry.slot)
            out.append(entry)
        if out or late:  # (a key in flight: its write was submitted when planned, so before this)
            self._writer.submit(self._index_delete_logged, [e.bkey for e in out] + late)
        return out

    def flush(self) -> Future[None]:
        """Resolves once every removal (and write) queued before it has committed: the writer
        thread runs its work in order. Raises :class:`DiskTierError` while an index delete
        that failed still fails (it is retried here first): an Evict must not be answered
        then, since its key would come back after a restart."""
        return self._writer.submit(self._flushed)

    def _flushed(self) -> None:
        """(The writer thread.)"""
        if self._failed_deletes:
            try:
                self._index_delete(self._failed_deletes)
            except lmdb.Error as e:
                raise DiskTierError(f"disk index deletes of {len(self._failed_deletes)} keys failed ({e}): "
                                    f"evicted blocks would come back after a restart") from None
            self._failed_deletes = []

    def _index_delete(self, bkeys: Sequence[bytes]) -> None:
        with self.env.begin(write=True, db=self._blocks) as txn:
            for bkey in bkeys:
                txn.delete(bkey)

    def _free_unsubmitted(self, deletes: list[bytes], punch: list[tuple[int, int, int]]) -> None:
        """(The writer thread.) What a plan that wrote nothing freed (see finish_write)."""
        if deletes:
            self._index_delete_logged(deletes)
        for fd, off, length in punch:
            try:
                punch_hole(fd, off, length)
            except OSError as e:
                log.error("disk slot punch failed", extra={"error": str(e)})

    def _index_delete_logged(self, bkeys: list[bytes]) -> None:
        """(The writer thread.) A delete that fails is kept, retried with the next ones and by
        :meth:`flush`, which fails meanwhile."""
        try:
            self._index_delete(self._failed_deletes + bkeys)
            self._failed_deletes = []
        except lmdb.Error as e:
            self._failed_deletes = self._failed_deletes + bkeys
            log.error("disk index delete failed", extra={"error": str(e), "keys": len(bkeys)})

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, close the index and the slab files (daemon shutdown); keeps the data."""
        self._writer.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.env.close()
        for slab in self.slabs.values():
            os.close(slab.fd)
        self.slabs.clear()
        os.close(self._lock_fd)


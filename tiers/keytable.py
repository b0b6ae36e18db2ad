"""The shared-memory key table: which (layout, key) a daemon holds, and in which tiers.

The daemon is the only writer (:class:`KeyTableWriter`); engine-side clients on the same node
map the file read-only and probe it without locks or system calls (:class:`KeyTableReader`),
so "how much of this prefix do you hold?" costs microseconds instead of a gRPC round trip.

File format (little-endian; one file per daemon, in its ``--shm-dir``, mode 0400)
    Header (``HEADER_BYTES``)::

        0   8s   magic b"KVTKEYT1"
        8   u32  format version (1)
        12  u32  slot size in bytes (40)
        16  u64  number of slots (a power of two)
        24  u32  state: 1 live, 2 retired (a bigger or cleaner table replaced this file at
                 the same path: reopen it), 3 closed (the daemon stopped), 4 invalid (the
                 daemon could not keep it exact: ask the daemon instead)
        28  u32  layouts in the directory
        32  u64  daemon epoch
        40  u64  heartbeat: the writer's CLOCK_MONOTONIC in ns, refreshed every 0.1 s
        48  u64  live entries (informational)
        56  u64  tombstones (informational)
        64  u64  generation: odd while the writer is changing a batch of slots
        128      layout directory: ``MAX_LAYOUTS`` fingerprints of 16 bytes; the layout
                 with fingerprint ``directory[i]`` has tag ``i + 1``. Append-only.

    Slots (``SLOT_DTYPE``, 40 bytes each, open addressing with linear probing)::

        0   u32  seq: even when the slot is stable, odd while the writer changes it
        4   u16  tag: layout tag; 0 = never used (a probe stops here)
        6   u8   key length (8 to 32)
        7   u8   tiers: bit set of TIER_BITS; 0 = tombstone (key known, held nowhere)
        8   32s  key, zero-padded

Contract
    * One writer. Entries never move inside a file; a deleted key leaves a tombstone that
      keeps its key (a probe walks past it), so a lock-free reader never misses a key
      that stayed in the table while it probed. A tombstone is reused by a new key only
      when that key is not already present (found in a full probe first).
    * Per-slot seqlock: the writer makes ``seq`` odd, writes the fields, makes it even, each
      step a separate store; a reader reads ``seq``, the slot, ``seq`` again, and uses the
      slot only when both reads are equal and even. This relies on x86-64's store and load
      ordering (total store order): :data:`ORDERING_SAFE` is False elsewhere and clients
      then do not map the table and keep asking the daemon. The writer also wraps every
      batch of slot writes in a table-wide generation (odd while writing): a batched probe
      that sees the same even generation before and after it saw no slot change and skips
      the per-slot checks; when a write overlapped it, it probes again with them.
    * Growth and cleaning rebuild the table into a new file, rename it over the path, then
      mark the old file retired. A reader checks the state after its probe: ``live`` means
      every slot it read was current when it read it; ``retired`` means reopen and probe
      again; anything else (or a heartbeat older than ``STALE_NS``: the daemon died
      without closing) raises :class:`TableUnavailable` and the caller asks the daemon.
    * Sizing: a table starts with ``INITIAL_SLOTS`` slots; :meth:`KeyTableWriter.reserve`
      presizes it from the tier capacities over a layout's slot size (the most blocks the
      tiers can hold), up to ``PRESIZE_MAX_SLOTS``. When live entries and tombstones would
      pass ``MAX_LOAD`` of the slots, the table is rebuilt with the live entries only, at
      ``REBUILD_LOAD`` (so it doubles when full of live keys, and stays the same size when
      tombstones filled it), never below a reserved size. 40 bytes a slot: 2 to 4 slots a
      key. A rebuild is vectorised and runs in the writer's thread (about 0.3 s per million
      keys here). The whole file is allocated up front (``fallocate``), so a full tmpfs is
      an error at rebuild time, never a SIGBUS later.
    * A table only says what the daemon held when it was read: a key shown may be evicted
      before the caller acts on it. Acquire answers such a key as a miss; nothing ever
      reads a slot's bytes from this table.

A reader probes with the compiled probe (``tiers/_probe.c``, the extension
``kvtier.tiers._probe`` that ``pip install`` builds): the same hash, slots and protocol in C,
one call per batch (hash every key, prefetch its home slot, then walk each run), without
numpy's per-call overhead. Where it is absent (no compiler at install) the reader probes with
numpy, with the same answers: vectorised over the batch of keys (no Python loop per key); a
batch of one key takes a scalar path that computes the same hash in Python integers. The
writer always uses numpy. Both readers follow the same protocol: a batch is probed unchecked
between two reads of the generation, then checked when they differ; one key is probed checked.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.tiers.vocab import FP_BYTES, KEY_MAX, KEY_MIN, TIER_LABELS, TIERS, Tier

assert KEY_MAX == 32 and len(TIERS) <= 8, "the slot format holds a 32-byte key and an 8-bit tier set"

MAGIC = b"KVTKEYT1"
VERSION = 1
MAX_LAYOUTS = 1024
HEADER_BYTES = 20480  # 128 + MAX_LAYOUTS * 16, rounded up to 4 KiB
DIRECTORY_OFFSET = 128

SLOT_DTYPE = np.dtype([("seq", "<u4"), ("tag", "<u2"), ("klen", "u1"), ("tiers", "u1"), ("key", "<u8", (4,))])
SLOT_BYTES = SLOT_DTYPE.itemsize  # 40

STATE_LIVE, STATE_RETIRED, STATE_CLOSED, STATE_INVALID = 1, 2, 3, 4

#: tier label -> its bit in a slot's ``tiers`` (bit ``Tier.rank``: gpu 1, host 2, disk 4)
TIER_BITS: dict[str, int] = {t.label: 1 << t.rank for t in TIERS}
TIER_ORDER = TIER_LABELS  # fastest first
FAST_BITS = TIER_BITS[Tier.GPU.label] | TIER_BITS[Tier.HOST.label]

INITIAL_SLOTS = 1 << 16
PRESIZE_MAX_SLOTS = 1 << 22      # 160 MiB of table; beyond this the table grows on demand
MAX_LOAD = 0.7                   # (live + tombstones) / slots that triggers a rebuild
REBUILD_LOAD = 0.5               # live / slots right after a rebuild
HEARTBEAT_S = 0.1
STALE_NS = 2_000_000_000         # a heartbeat this old means the writer is gone
SPIN_LIMIT_S = 0.05              # a slot odd for this long: give up, ask the daemon
WINDOW = 8                       # slots gathered per key per vectorised probe step (8: see _probe)
SCALAR_STRAGGLERS = 4            # keys a first vectorised step leaves undecided, finished one by one

#: the seqlock protocol needs x86-64's memory ordering (see the module docstring)
ORDERING_SAFE = platform.machine().lower() in ("x86_64", "amd64")

_HASH_K = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                   dtype=np.uint64)
_HASH_K_INT = [int(k) for k in _HASH_K]
_HASH_FINAL = 0xFF51AFD7ED558CCD
_M64 = (1 << 64) - 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SLOT_BODY = struct.Struct("<HBB4Q")
_ONE, _16, _32, _56 = np.uint64(1), np.uint64(16), np.uint64(32), np.uint64(56)
_TAG_MASK, _SEVEN = np.uint64(0xFFFF), np.uint64(7)
_ID_MASK, _USED = np.uint64(0xFFFFFF), np.uint64(0xFFFF << 32)
_OFFS = np.arange(WINDOW)
_NO_SLOTS = np.empty(0, dtype=np.int64)
_KEY_WORDS = struct.Struct("<4Q")

# fastest tier of each bit set: index into TIER_ORDER, or -1
_FASTEST = np.array([-1 if m == 0 else (m & -m).bit_length() - 1 for m in range(8)], dtype=np.int8)


try:  # the compiled probe (tiers/_probe.c, built by pip install); None: probe with numpy
    from kvtier.tiers import _probe as _cprobe
except ImportError:  # pragma: no cover - an install without a C compiler
    _cprobe = None

#: whether readers probe with the compiled probe by default
COMPILED = _cprobe is not None
_SPIN_LIMIT_NS = int(SPIN_LIMIT_S * 1e9)


class KeyTableError(Exception):
    """The file is not a key table this code can read (wrong magic, version or size)."""


class TableUnavailable(Exception):
    """The table cannot answer right now (daemon stopped, gone, or gave up on it): ask the daemon."""


def fastest_tier(mask: int) -> str | None:
    """The fastest tier in a ``tiers`` bit set, or None for 0."""
    i = int(_FASTEST[mask & 7])
    return None if i < 0 else TIER_ORDER[i]


def tier_names(masks: np.ndarray) -> list[str | None]:
    """The fastest tier of each ``tiers`` bit set ("gpu", "host", "disk"), or None for 0."""
    return [None if i < 0 else TIER_ORDER[i] for i in _FASTEST[masks].tolist()]


def key_words(keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Keys as an ``(n, 4)`` uint64 array (zero-padded to 32 bytes) and their lengths (uint8).

    Raises ValueError for a key outside 8 to 32 bytes."""
    n = len(keys)
    sizes = set(map(len, keys))
    if len(sizes) == 1 and KEY_MIN <= (klen := sizes.pop()) <= KEY_MAX:
        raw = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, klen)
        if klen == KEY_MAX:
            words = raw.view("<u8").copy()
        else:
            buf = np.zeros((n, KEY_MAX), dtype=np.uint8)
            buf[:, :klen] = raw
            words = buf.view("<u8")
        return words, np.full(n, klen, dtype=np.uint8)
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    if n and (lens.min() < KEY_MIN or lens.max() > KEY_MAX):
        bad = int(np.flatnonzero((lens < KEY_MIN) | (lens > KEY_MAX))[0])
        raise ValueError(f"key {bad} is {int(lens[bad])} bytes; keys are {KEY_MIN} to {KEY_MAX} bytes")
    words = np.array(keys, dtype=f"S{KEY_MAX}").view("<u8").reshape(n, 4).copy()
    return words, lens.astype(np.uint8)


def hash_keys(tag: int, words: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """64-bit hash of (tag, key) for a batch (wrapping uint64 arithmetic)."""
    m = words * _HASH_K
    m ^= m >> np.uint64(32)
    h = m[:, 0] ^ m[:, 1] ^ m[:, 2] ^ m[:, 3]
    h ^= lens.astype(np.uint64) | np.uint64(tag << 8)
    h *= np.uint64(_HASH_FINAL)
    h ^= h >> np.uint64(33)
    return h


def hash_key(tag: int, key: bytes) -> int:
    """:func:`hash_keys` of one key, in Python integers (the scalar path; same result)."""
    w0, w1, w2, w3 = _KEY_WORDS.unpack(key.ljust(KEY_MAX, b"\0"))
    k0, k1, k2, k3 = _HASH_K_INT
    m0, m1, m2, m3 = (w0 * k0) & _M64, (w1 * k1) & _M64, (w2 * k2) & _M64, (w3 * k3) & _M64
    h = m0 ^ (m0 >> 32) ^ m1 ^ (m1 >> 32) ^ m2 ^ (m2 >> 32) ^ m3 ^ (m3 >> 32)
    h ^= len(key) | (tag << 8)
    h = (h * _HASH_FINAL) & _M64
    return h ^ (h >> 33)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _distinct(words: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop repeated keys of a batch (first occurrence kept, order kept)."""
    if len(lens) < 2:
        return words, lens
    rows = np.concatenate([words, lens[:, None].astype(np.uint64)], axis=1)
    _, first = np.unique(rows, axis=0, return_index=True)
    if len(first) == len(lens):
        return words, lens
    first.sort()
    return words[first], lens[first]


class _Mapping:
    """One mapped table file and typed views of it (shared by reader and writer)."""

    def __init__(self, mm: mmap.mmap, path: str) -> None:
        self.mm = mm
        self.path = path
        if len(mm) < HEADER_BYTES or mm[:8] != MAGIC:
            raise KeyTableError(f"{path} is not a kvtier key table")
        version, slot_bytes = struct.unpack_from("<II", mm, 8)
        self.nslots = _U64.unpack_from(mm, 16)[0]
        if version != VERSION or slot_bytes != SLOT_BYTES:
            raise KeyTableError(f"{path}: key table format {version}/{slot_bytes} B slots; this client reads "
                                f"{VERSION}/{SLOT_BYTES}: client and daemon versions differ")
        if self.nslots < 16 or self.nslots & (self.nslots - 1) or len(mm) < HEADER_BYTES + self.nslots * SLOT_BYTES:
            raise KeyTableError(f"{path}: {self.nslots} slots do not fit the file")
        self.mask = self.nslots - 1
        self.shift = 64 - (self.nslots.bit_length() - 1)
        self.slots = np.frombuffer(mm, dtype=SLOT_DTYPE, count=self.nslots, offset=HEADER_BYTES)
        self.words = np.frombuffer(mm, dtype="<u8", count=self.nslots * 5, offset=HEADER_BYTES).reshape(-1, 5)
        self.head = self.words[:, 0]
        self.seq = self.slots["seq"]
        self.tags = self.slots["tag"]
        self.tiers = self.slots["tiers"]
        self.directory = np.frombuffer(mm, dtype=np.uint8, count=MAX_LAYOUTS * 16,
                                       offset=DIRECTORY_OFFSET).reshape(MAX_LAYOUTS, 16)
        # a seam for tests: called between a batched probe's optimistic pass and its generation
        # re-check, so a test can land a write exactly there (tests/test_keytable.py)
        self.probed: Callable[[], None] | None = None

    def home(self, h: np.ndarray) -> np.ndarray:
        return (h >> np.uint64(self.shift)).astype(np.int64)

    def state(self) -> int:
        return _U32.unpack_from(self.mm, 24)[0]

    def heartbeat_ns(self) -> int:
        return _U64.unpack_from(self.mm, 40)[0]

    def layout_count(self) -> int:
        return _U32.unpack_from(self.mm, 28)[0]

    def generation(self) -> int:
        return _U64.unpack_from(self.mm, 64)[0]

    def read(self, tag: int, words: np.ndarray, lens: np.ndarray, deadline: float) -> tuple[np.ndarray, bool]:
        """Per key, its tiers (a reader's probe), and whether the per-slot checks were needed.

        Optimistic first: if the writer's batch counter is even and unchanged across a probe,
        no slot changed while it ran and the per-slot checks are skipped; otherwise probe
        again honouring each slot's seqlock. The optimistic probe takes one vectorised step;
        the few keys it leaves undecided (their run is longer than the window: about one
        key in 300 at the usual load) finish with the scalar probe when there are at most
        ``SCALAR_STRAGGLERS`` of them, else with more vectorised steps."""
        gen = self.generation()
        if not gen & 1:
            _, tiers, left = self._probe(tag, words, lens, checked=False, want_slots=False, max_steps=1)
            if 0 < left.size <= SCALAR_STRAGGLERS:
                for i in left.tolist():
                    tiers[i] = self.probe_one(tag, words[i].tobytes()[:lens[i]])
            elif left.size:
                tiers[left] = self._probe(tag, words[left], lens[left], checked=False, want_slots=False)[1]
            if self.probed is not None:
                self.probed()
            if self.generation() == gen:
                return tiers, False
        return self.probe(tag, words, lens, checked=True, want_slots=False, deadline=deadline)[1], True

    def read_compiled(self, tag: int, keys: Sequence[bytes]) -> tuple[np.ndarray, bool]:
        """:meth:`read` (and :meth:`probe_one` for one key) with the compiled probe: the same
        protocol, and the same ``probed`` seam between the optimistic probe and its re-check."""
        out = np.empty(len(keys), dtype=np.uint8)
        mm, shift = self.mm, self.shift
        if len(keys) > 1:
            gen = _cprobe.generation(mm)
            if not gen & 1:
                _cprobe.probe(mm, shift, tag, keys, out, False, 0)
                if self.probed is not None:
                    self.probed()
                if _cprobe.generation(mm) == gen:
                    return out, False
        if _cprobe.probe(mm, shift, tag, keys, out, True, _SPIN_LIMIT_NS):
            raise TableUnavailable("a key table slot stayed mid-update; the daemon may be stopped")
        return out, len(keys) > 1

    def probe_one(self, tag: int, key: bytes) -> int:
        """The tiers of one key: the scalar probe (same hash and slots, per-slot seqlock)."""
        klen = len(key)
        if not KEY_MIN <= klen <= KEY_MAX:
            raise ValueError(f"key 0 is {klen} bytes; keys are {KEY_MIN} to {KEY_MAX} bytes")
        want = _KEY_WORDS.unpack(key.ljust(KEY_MAX, b"\0"))
        i = hash_key(tag, key) >> self.shift
        mm, mask = self.mm, self.mask
        deadline = 0.0
        steps = 0
        while steps <= mask:  # (a full table, which the writer never makes: not held, as the C probe says)
            off = HEADER_BYTES + (i & mask) * SLOT_BYTES
            s1 = _U32.unpack_from(mm, off)[0]
            body = _SLOT_BODY.unpack_from(mm, off + 4)
            s2 = _U32.unpack_from(mm, off)[0]
            if s1 != s2 or s1 & 1:
                if deadline == 0.0:
                    deadline = time.monotonic() + SPIN_LIMIT_S
                elif time.monotonic() > deadline:
                    raise TableUnavailable("a key table slot stayed mid-update; the daemon may be stopped")
                continue
            if body[0] == 0:
                return 0
            if body[0] == tag and body[1] == klen and body[3:] == want:
                return body[2] & 7  # (only the tier bits: whatever else a corrupt byte holds)
            i += 1
            steps += 1
        return 0

    def probe(self, tag: int, words: np.ndarray, lens: np.ndarray, *, checked: bool, want_slots: bool = True,
              deadline: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Per key: (its slot or -1, the slot's tiers or 0). ``checked``: honour each slot's
        seqlock (see :meth:`read`); the writer reads its own table unchecked."""
        slot, tiers, _ = self._probe(tag, words, lens, checked=checked, want_slots=want_slots, deadline=deadline)
        return slot, tiers

    def _probe(self, tag: int, words: np.ndarray, lens: np.ndarray, *, checked: bool, want_slots: bool,
               deadline: float = 0.0, max_steps: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`probe`, stopping after ``max_steps`` steps (0: none) with the indices of the
        keys still undecided as a third result (empty when all were decided).

        Each step gathers a window of ``WINDOW`` slots per pending key: their heads (seq, tag,
        length, tiers as one little-endian u64), the slots, then the heads again. The first
        slot in the window that is empty, or whose tag, length and first key word match,
        decides, if it (and so every slot before it) was stable; its whole key is then
        compared (a first-word collision walks on). A key whose deciding slot was mid-update
        retries from there."""
        n = len(lens)
        slot = np.full(n, -1, dtype=np.int64) if want_slots else _NO_SLOTS
        tiers = np.zeros(n, dtype=np.uint8)
        ids: np.ndarray | None = None  # keys still probing (None: all of them)
        ident = (lens.astype(np.uint64) << _16) | np.uint64(tag)
        ps = self.home(hash_keys(tag, words, lens))
        w0 = words[:, :1]
        walked = np.zeros(n, dtype=np.int64)  # slots each key has moved past
        spins = steps = 0
        while True:
            p = (ps[:, None] + _OFFS) & self.mask
            s1 = self.head[p]
            rows = np.take(self.words, p, axis=0)
            idf = (s1 >> _32) & _ID_MASK  # tag | length << 16: tag 0 only in a never-used slot
            # deciding slot: empty, or tag, length and first key word match
            event = ((idf & _TAG_MASK) == 0) | ((idf == ident[:, None]) & (rows[:, :, 1] == w0))
            if checked:
                s2 = self.head[p]
                unstable = ((s1 ^ s2) | (s1 & _ONE)) != 0
                event |= unstable
            any_event = event.view(np.uint64)[:, 0] != 0  # the window's 8 bools read as one word
            first = event.argmax(axis=1)
            r = np.arange(len(ps))
            sf = s1[r, first]
            decided = any_event & ~unstable[r, first] if checked else any_event
            used = decided & ((sf & _USED) != 0)
            held = used & (rows[r, first, 1:] == words).all(axis=1)
            if held.any():
                dst = held if ids is None else ids[held]
                if want_slots:
                    slot[dst] = p[r, first][held]
                tiers[dst] = ((sf[held] >> _56) & _SEVEN).astype(np.uint8)  # (the tier bits only)
            collided = used & ~held
            retry = ~decided | collided
            if not retry.any():
                return slot, tiers, _NO_SLOTS
            if checked and (any_event & ~decided).any():
                spins += 1
                if spins % 64 == 0 and time.monotonic() > deadline:
                    raise TableUnavailable("a key table slot stayed mid-update; the daemon may be stopped")
            # no deciding slot in the window: move past it; blocked or collided: from there
            adv = np.where(any_event, first + collided, WINDOW)
            ps, walked = (ps + adv)[retry], (walked + adv)[retry]
            ids = np.flatnonzero(retry) if ids is None else ids[retry]
            steps += 1
            if steps == max_steps:
                return slot, tiers, ids
            words, ident = words[retry], ident[retry]
            if walked.max() > self.mask:  # past every slot: a full table (never the writer's): not held
                keep = walked <= self.mask
                if not keep.any():
                    return slot, tiers, _NO_SLOTS
                ps, walked, ids, words, ident = ps[keep], walked[keep], ids[keep], words[keep], ident[keep]
            w0 = words[:, :1]


class KeyTableReader:
    """A client's read-only view of a daemon's key table (see the module docstring)."""

    def __init__(self, path: str, stale_ns: int = STALE_NS, opener: Callable[[str], int] | None = None,
                 alive: Callable[[], bool] | None = None, compiled: bool | None = None) -> None:
        self.path = path
        # probe with the compiled probe (None: when it is built); False: with numpy
        if compiled and _cprobe is None:
            raise ImportError("the compiled key-table probe (kvtier.tiers._probe) is not built")
        self.compiled = COMPILED if compiled is None else compiled
        self.stale_ns = stale_ns
        # a heartbeat older than stale_ns means the writer is gone only if ``alive()`` (e.g. the
        # caller's session stream to that daemon is still open) says so too: a daemon whose
        # loop a busy machine did not schedule for seconds is late, not gone
        self._alive = alive
        self.stale_tolerated = 0  # probes answered from a table with a stale heartbeat, its daemon alive
        # path -> a new read-only descriptor of the table there (a client's: the daemon hands
        # it over, as the file is owner-only); used again on every reopen after a rebuild.
        # It raises OSError (or KeyTableError) when it cannot.
        self._opener = opener
        self._lock = threading.Lock()
        self._tags: dict[bytes, int] = {}
        self.rechecked = 0  # batched probes a concurrent write sent through the per-slot checks
        self._closed = False  # (set by close: a probe racing it in another thread reports TableUnavailable)
        self._map = self._open()

    def _open(self) -> _Mapping:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC) if self._opener is None else self._opener(self.path)
        try:
            size = os.fstat(fd).st_size
            # populate: map every page now, not by a fault inside the first probes that touch it
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
        finally:
            os.close(fd)
        self._tags = {}
        return _Mapping(mm, self.path)

    @property
    def nslots(self) -> int:
        return self._map.nslots

    @property
    def epoch(self) -> int:
        """The epoch of the daemon that writes the table (from its header)."""
        return int(_U64.unpack_from(self._map.mm, 32)[0])

    def close(self) -> None:
        self._closed = True
        m = self._map
        del m.slots, m.words, m.head, m.seq, m.tags, m.tiers, m.directory
        try:
            m.mm.close()
        except BufferError:
            pass  # an array a caller still holds keeps the mapping; it goes with the last one

    def _tag(self, m: _Mapping, fingerprint: bytes) -> int:
        tag = self._tags.get(fingerprint)
        if tag is None:
            count = m.layout_count()
            if count > len(self._tags):
                self._tags = {fp.tobytes(): i + 1 for i, fp in enumerate(m.directory[:count])}
            tag = self._tags.get(fingerprint, 0)
        return tag

    def _check(self, m: _Mapping) -> bool:
        """After a probe: True if its answer stands, False to reopen and probe again."""
        state = m.state()
        if state == STATE_LIVE:
            if time.monotonic_ns() - m.heartbeat_ns() > self.stale_ns:
                if self._alive is not None and self._alive():
                    self.stale_tolerated += 1
                    return True
                raise TableUnavailable(f"key table {self.path}: no heartbeat for over "
                                       f"{self.stale_ns / 1e9:.1f} s; the daemon is gone or stuck")
            return True
        if state == STATE_RETIRED:
            with self._lock:
                if self._map is m:
                    try:
                        self._map = self._open()
                    except (OSError, KeyTableError) as e:
                        raise TableUnavailable(f"key table {self.path} was replaced but cannot be "
                                               f"reopened: {e}") from None
            return False
        raise TableUnavailable(f"key table {self.path} is {'closed' if state == STATE_CLOSED else 'invalid'}")

    def masks(self, fingerprint: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """Per key, the bit set of tiers (:data:`TIER_BITS`) holding it (uint8 array).

        Raises ValueError for a key outside 8 to 32 bytes, :class:`TableUnavailable` when
        the table cannot answer."""
        if not ORDERING_SAFE:
            raise TableUnavailable(f"lock-free key table reads need x86-64 ordering; this is {platform.machine()}")
        try:
            return self._masks(fingerprint, keys)
        except (ValueError, AttributeError, BufferError, TypeError):
            if self._closed:  # closed by another thread mid-probe (the sidecar dropped the table)
                raise TableUnavailable(f"key table {self.path} was closed") from None
            raise

    def _masks(self, fingerprint: bytes, keys: Sequence[bytes]) -> np.ndarray:
        while True:
            m = self._map
            tag = self._tag(m, fingerprint)
            if tag == 0 or not keys:
                out = np.zeros(len(keys), dtype=np.uint8)
                if keys:
                    key_words(keys)  # same argument errors as a real probe
            elif self.compiled:
                out, rechecked = m.read_compiled(tag, keys)
                self.rechecked += rechecked
            elif len(keys) == 1:
                out = np.array([m.probe_one(tag, bytes(keys[0]))], dtype=np.uint8)
            else:
                words, lens = key_words(keys)
                out, rechecked = m.read(tag, words, lens, deadline=time.monotonic() + SPIN_LIMIT_S)
                self.rechecked += rechecked
            if self._check(m):
                return out

    def tiers(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier holding each key ("gpu", "host", "disk") or None."""
        return tier_names(self.masks(fingerprint, keys))

    def prefix_length(self, fingerprint: bytes, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading keys held in gpu or host, leading keys held in any tier)."""
        return prefix_lengths(self.masks(fingerprint, keys))


def prefix_lengths(masks: np.ndarray) -> tuple[int, int]:
    """From per-key tier bit sets: (leading run with a gpu or host bit, leading run with any bit)."""
    if _cprobe is not None and masks.dtype == np.uint8 and masks.flags.c_contiguous:
        return _cprobe.prefix(masks, FAST_BITS)
    fast = (masks & FAST_BITS) == 0
    anyt = masks == 0
    n = len(masks)
    return (int(fast.argmax()) if fast.any() else n, int(anyt.argmax()) if anyt.any() else n)


class KeyTableWriter:
    """The daemon's side: the only process that writes the table (see the module docstring).

    Not thread-safe: the daemon calls it from its event loop only."""

    def __init__(self, path: str, epoch: int = 0, nslots: int = INITIAL_SLOTS) -> None:
        self.path = path
        self.epoch = epoch
        self.live = 0
        self.tombstones = 0
        self.generation = 0
        self.rebuilds = 0
        self._fps: list[bytes] = []
        self._tag_by_fp: dict[bytes, int] = {}
        self.min_slots = max(_pow2_at_least(nslots), 16)
        self._map = self._create(self.min_slots)
        self._publish(self._map)

    # -- files ---------------------------------------------------------------------------

    def _create(self, nslots: int) -> _Mapping:
        self.generation += 1
        tmp = f"{self.path}.{self.generation}.tmp"
        size = HEADER_BYTES + nslots * SLOT_BYTES
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        struct.pack_into("<8sIIQIIQQ", mm, 0, MAGIC, VERSION, SLOT_BYTES, nslots, 0, 0, self.epoch,
                         time.monotonic_ns())
        m = _Mapping(mm, tmp)
        for i, fp in enumerate(self._fps):
            m.directory[i] = np.frombuffer(fp, dtype=np.uint8)
        _U32.pack_into(mm, 28, len(self._fps))
        return m

    def _publish(self, m: _Mapping) -> None:
        """Make ``m`` the table at ``self.path``: live, renamed into place."""
        _U32.pack_into(m.mm, 24, STATE_LIVE)
        os.rename(m.path, self.path)
        m.path = self.path

    @property
    def nslots(self) -> int:
        return self._map.nslots

    def heartbeat(self) -> None:
        _U64.pack_into(self._map.mm, 40, time.monotonic_ns())

    def invalidate(self) -> None:
        """Tell readers this table is no longer exact (they ask the daemon from now on)."""
        _U32.pack_into(self._map.mm, 24, STATE_INVALID)

    def close(self) -> None:
        """Mark the table closed and remove its file (daemon shutdown)."""
        m = self._map
        _U32.pack_into(m.mm, 24, STATE_CLOSED)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._release(m)

    @staticmethod
    def _release(m: _Mapping) -> None:
        del m.slots, m.words, m.head, m.seq, m.tags, m.tiers, m.directory
        m.mm.close()

    def _counts(self) -> None:
        struct.pack_into("<QQ", self._map.mm, 48, self.live, self.tombstones)

    # -- layouts -------------------------------------------------------------------------

    def tag(self, fingerprint: bytes, create: bool = True) -> int:
        """The tag of a layout fingerprint (0 if unknown and not ``create``)."""
        tag = self._tag_by_fp.get(fingerprint)
        if tag is not None or not create:
            return tag or 0
        if len(fingerprint) != FP_BYTES:
            raise ValueError(f"a layout fingerprint is {FP_BYTES} bytes")
        if len(self._fps) >= MAX_LAYOUTS:
            raise KeyTableError(f"the key table holds at most {MAX_LAYOUTS} layouts")
        self._fps.append(fingerprint)
        tag = self._tag_by_fp[fingerprint] = len(self._fps)
        self._map.directory[tag - 1] = np.frombuffer(fingerprint, dtype=np.uint8)
        _U32.pack_into(self._map.mm, 28, tag)  # after the entry: readers read the count first
        return tag

    # -- entries -------------------------------------------------------------------------

    def masks(self, fingerprint: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """The writer's own view: per key, its bit set of tiers."""
        tag = self.tag(fingerprint, create=False)
        if tag == 0 or not keys:
            return np.zeros(len(keys), dtype=np.uint8)
        words, lens = key_words(keys)
        return self._map.probe(tag, words, lens, checked=False)[1]

    def set(self, fingerprint: bytes, keys: Sequence[bytes], tier: Tier | str) -> None:
        """These keys are now held in ``tier`` (a :class:`Tier` or its label) as well as wherever
        they were."""
        if keys:
            self._update(self.tag(fingerprint), keys, TIER_BITS[str(tier)], add=True)

    def clear(self, fingerprint: bytes, keys: Sequence[bytes], tier: Tier | str) -> None:
        """These keys are no longer held in ``tier``; a key held nowhere becomes a tombstone."""
        tag = self.tag(fingerprint, create=False)
        if keys and tag:
            self._update(tag, keys, TIER_BITS[str(tier)], add=False)

    def clear_tier(self, tier: Tier | str) -> None:
        """No key is held in ``tier`` any more."""
        bit = TIER_BITS[str(tier)]
        m = self._map
        idx = np.flatnonzero(m.tiers & bit)
        if idx.size:
            new = m.tiers[idx] & np.uint8(~bit & 0xFF)
            self._write_tiers(m, idx, new)
            emptied = int((new == 0).sum())
            self.live -= emptied
            self.tombstones += emptied
            self._counts()

    @staticmethod
    def _begin(m: _Mapping) -> None:
        """A batch of slot writes starts: the generation turns odd (see _Mapping.read)."""
        _U64.pack_into(m.mm, 64, _U64.unpack_from(m.mm, 64)[0] + 1)

    _end = _begin  # ... and even again when the batch is written

    def _write_tiers(self, m: _Mapping, idx: np.ndarray, new: np.ndarray) -> None:
        self._begin(m)
        m.seq[idx] += 1
        m.tiers[idx] = new
        m.seq[idx] += 1
        self._end(m)

    def _update(self, tag: int, keys: Sequence[bytes], bit: int, add: bool) -> None:
        words, lens = _distinct(*key_words(keys))
        m = self._map
        slot, old = m.probe(tag, words, lens, checked=False)
        found = slot >= 0
        new = (old | bit) if add else (old & np.uint8(~bit & 0xFF))
        changed = found & (new != old)
        if changed.any():
            self._write_tiers(m, slot[changed], new[changed])
            revived = int(((old == 0) & changed).sum())
            emptied = int(((new == 0) & changed).sum())
            self.live += revived - emptied
            self.tombstones += emptied - revived
        if add and not found.all():
            self._insert(tag, words[~found], lens[~found], bit)
        self._counts()

    def _insert(self, tag: int, words: np.ndarray, lens: np.ndarray, bit: int) -> None:
        """Place distinct keys known to be absent."""
        n = len(lens)
        if (self.live + self.tombstones + n) > MAX_LOAD * self.nslots:
            self._rebuild(self.live + n)
        m = self._map
        pos = m.home(hash_keys(tag, words, lens))
        pending = np.arange(n)
        reused = 0
        while pending.size:
            p = pos[pending] & m.mask
            free = (m.tags[p] == 0) | (m.tiers[p] == 0)
            cand = pending[free]
            # one key per free slot this round; the others look further
            _, win = np.unique(p[free], return_index=True)
            winners = cand[win]
            ws = p[free][win]
            reused += int((m.tags[ws] != 0).sum())
            self._begin(m)
            m.seq[ws] += 1
            m.tags[ws] = tag
            m.slots["klen"][ws] = lens[winners]
            m.slots["key"][ws] = words[winners]
            m.tiers[ws] = bit
            m.seq[ws] += 1
            self._end(m)
            placed = np.zeros(n, dtype=bool)
            placed[winners] = True
            losers = pending[~placed[pending]]
            pos[losers] += 1
            pending = losers
        self.live += n
        self.tombstones -= reused

    def compact(self) -> None:
        """Rebuild now at the size the live entries need (drops tombstones)."""
        self._rebuild(self.live)

    def reserve(self, entries: int) -> None:
        """Presize for ``entries`` live keys (capped at ``PRESIZE_MAX_SLOTS``; grows beyond on demand).
        The table never shrinks below a reserved size."""
        want = min(_pow2_at_least(int(entries / REBUILD_LOAD) + 1), PRESIZE_MAX_SLOTS)
        self.min_slots = max(self.min_slots, want)
        if want > self.nslots:
            self._rebuild(self.live)

    def _rebuild(self, entries: int) -> None:
        """Copy the live entries into a new file sized for ``entries``, publish it, retire the old."""
        old = self._map
        nslots = max(_pow2_at_least(int(entries / REBUILD_LOAD) + 1), self.min_slots)
        new = self._create(nslots)
        rows = old.slots[np.flatnonzero((old.tags != 0) & (old.tiers != 0))]
        self.live = self.tombstones = 0
        for tag in np.unique(rows["tag"]).tolist():
            sub = rows[rows["tag"] == tag]
            for bits in np.unique(sub["tiers"]).tolist():
                part = sub[sub["tiers"] == bits]
                self._place_fresh(new, tag, part["key"], part["klen"], bits)
        self._map = new
        self.heartbeat()
        self._counts()
        try:
            self._publish(new)
        except OSError:  # the old file stays at the path, no longer written: its readers must not trust it
            _U32.pack_into(old.mm, 24, STATE_INVALID)
            try:
                os.unlink(new.path)
            except OSError:
                pass
            raise
        _U32.pack_into(old.mm, 24, STATE_RETIRED)
        self._release(old)
        self.rebuilds += 1

    def _place_fresh(self, m: _Mapping, tag: int, words: np.ndarray, lens: np.ndarray, bits: int) -> None:
        """Insert distinct keys into a table nobody reads yet (no tombstones there)."""
        pos = m.home(hash_keys(tag, words, lens))
        pending = np.arange(len(lens))
        while pending.size:
            p = pos[pending] & m.mask
            free = m.tags[p] == 0
            _, win = np.unique(p[free], return_index=True)
            winners = pending[free][win]
            ws = p[free][win]
            m.tags[ws] = tag
            m.slots["klen"][ws] = lens[winners]
            m.slots["key"][ws] = words[winners]
            m.tiers[ws] = bits
            placed = np.zeros(len(lens), dtype=bool)
            placed[winners] = True
            losers = pending[~placed[pending]]
            pos[losers] += 1
            pending = losers
        self.live += len(lens)

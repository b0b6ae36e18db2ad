"""The location index's key table: each distinct key (opaque bytes) has a *row*.

Built for memory and for whole requests at once, not for one key at a time:
    * keys of ``WIDTH`` (16) bytes, the block keys of kvtier (``client/engine/keys.py``), live
      packed in a ``(rows, 2)`` uint64 array at their row; an open-addressing hash table of
      int32 row numbers and 8-bit tags finds them, a request's keys at once: one gather of
      the tags of each key's two buckets of ``WINDOW`` slots, one of the rows whose tag is
      the key's, one comparison. A key is placed in the less full of its two buckets (two
      choices: random keys fill a table to 0.83-0.86 before a bucket pair overflows, from
      2^20 to 2^27 slots), the table at most ``FILL_EIGHTHS`` / 8 full (else it doubles).
      About 16 bytes per key plus 7 to 13 for the table (5 bytes a slot at 3/8 to 3/4
      fill), and no Python object per key (a ``dict[bytes, int]`` costs about 130: the
      entry, the bytes object, the int object);
    * keys of any other length in a plain dict (``odd``), sharing the row numbering.

Row numbers are given by the caller (:class:`~kvtier.client.routing.index.LocationIndex`
allocates them); a row taken by a key is ``live`` until :meth:`RowTable.drop` gives it
back. Lookups are exact: a row is returned only when its stored key equals the key.

Saved as its packed keys (:meth:`RowTable.arrays`) and restored over them as they are (no
copy of a writable array, no Python object per key: :meth:`RowTable.restore`); the slots are
then built in one compiled pass over the rows, at the size the table had. That pass places
24-50 M rows/s on the 2-core development VM (8-32 M rows), faster than a snapshot's slots and
tags (5 bytes a slot, 1.3 to 2.7 slots a key) could be read at 350-500 MB/s, so they are not
saved.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from kvtier.client.routing.compiled import load_route

# the compiled insert (client/routing/_route.c): the same rows found afterwards; None where it is not built (or built from other sources)
_croute = load_route()

WIDTH = 16
_C1 = 0x9E3779B97F4A7C15
_C2 = 0xC2B2AE3D27D4EB4F
_M64 = (1 << 64) - 1
_C1_U = np.uint64(_C1)
_C2_U = np.uint64(_C2)
_MATCH = np.uint16(0x0101)  # two equal words as a pair of bools viewed as one uint16
_KEY = np.dtype(f"V{WIDTH}")  # compared as bytes
WINDOW = 16  # slots of a bucket: a key sits in one of its two buckets (else the table grows)
FILL_EIGHTHS = 6  # a table holds at most this many eighths of its slots in keys (else it grows)
_OFFSETS = np.arange(WINDOW, dtype=np.int64)
_BUCKET = ~np.int64(WINDOW - 1)


def room(slots: int) -> int:
    """How many keys a table of ``slots`` slots holds at most."""
    return slots // 8 * FILL_EIGHTHS


class RowTable:
    """See the module docstring. Not thread-safe."""

    def __init__(self, row_capacity: int = 16) -> None:
        self.packed = np.zeros(max(16, row_capacity), dtype=_KEY)  # each row's key, 16 bytes
        self.odd: dict[bytes, int] = {}
        self.odd_key: dict[int, bytes] = {}
        self.live = np.zeros(max(16, row_capacity), dtype=np.bool_)
        self.count = 0
        self._set_slots(1 << 4)

    def _set_slots(self, size: int) -> None:
        self.slots = np.full(size, -1, dtype=np.int32)
        self.tags = np.zeros(size, dtype=np.uint8)  # per slot: 8 more bits of its key's hash, odd (0: empty)
        self._set_shifts(size)
        self._wide = 0  # packed keys in the hash table

    def _set_shifts(self, size: int) -> None:
        self._shift_i = 64 - (size.bit_length() - 1)
        self._shift = np.uint64(self._shift_i)
        self._tshift_i = self._shift_i - 8
        self._tshift = np.uint64(self._tshift_i)
        self._mask = size - 1

    # -- sizes ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.count

    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.slots.nbytes + self.tags.nbytes + self.live.nbytes)

    def reserve_rows(self, capacity: int) -> None:
        """Room for rows ``0 .. capacity - 1`` (the index grows its bit matrix alike)."""
        if capacity > len(self.packed):
            grown = np.zeros(capacity, dtype=_KEY)
            grown[:len(self.packed)] = self.packed
            self.packed = grown
            live = np.zeros(capacity, dtype=np.bool_)
            live[:len(self.live)] = self.live
            self.live = live

    # -- saved arrays ---------------------------------------------------------------------

    def arrays(self, rows: int) -> dict[str, np.ndarray]:
        """Copies of the keys of rows below ``rows`` (at least every live one), for
        :meth:`restore`: ``packed`` (uint64, two words a row: a row's 16-byte key, zeros where
        it has none or one of another length) and, where keys of other lengths are indexed,
        ``odd_rows``, ``odd_lengths`` (uint32) and ``odd_bytes`` (their keys joined)."""
        self.reserve_rows(rows)
        out = {"packed": self.packed[:rows].view(np.uint64).reshape(rows, 2).copy()}
        if self.odd_key:
            odd = sorted(self.odd_key.items())
            out["odd_rows"] = np.array([r for r, _ in odd], dtype=np.int64)
            out["odd_lengths"] = np.array([len(k) for _, k in odd], dtype=np.uint32)
            out["odd_bytes"] = np.frombuffer(b"".join(k for _, k in odd), dtype=np.uint8)
        return out

    @classmethod
    def restore(cls, packed: np.ndarray, live: np.ndarray, odd: dict[int, bytes] | None = None,
                slots: int = 0) -> RowTable:
        """A table over these arrays, taken as they are (copied only where read-only or not
        contiguous): ``packed``, one ``WIDTH``-byte key a row (``uint64`` pairs or ``V16``),
        ``live`` (bool) of the same rows, and ``odd`` the keys of other lengths by row (their
        rows live, their packed keys zero). The slots are then built in one pass over the live
        rows, ``slots`` of them (the size the table had: a power of two) or as many as the rows
        need. Raises ValueError where the arrays do not make a table."""
        if packed.dtype == np.uint64 and packed.ndim == 2 and packed.shape[1] == 2:
            packed = _own(packed).view(_KEY).reshape(len(packed))
        elif packed.dtype == _KEY and packed.ndim == 1:
            packed = _own(packed)
        else:
            raise ValueError(f"packed keys of dtype {packed.dtype} and shape {packed.shape}")
        if live.dtype != np.bool_ or live.shape != packed.shape:
            raise ValueError(f"live flags of dtype {live.dtype} and shape {live.shape} for {len(packed)} rows")
        if not 0 <= slots <= 1 << 31 or slots & (slots - 1):
            raise ValueError(f"a table of {slots} slots")
        t = cls.__new__(cls)
        t.packed, t.live = packed, _own(live)
        t.odd = {}
        t.odd_key = {}
        for r, k in (odd or {}).items():
            if not (0 <= r < len(packed) and t.live[r]) or len(k) == WIDTH:
                raise ValueError(f"a key of {len(k)} bytes at row {r} of {len(packed)}")
            t.odd[k] = r
            t.odd_key[r] = k
        t.count = int(np.count_nonzero(t.live))
        t._rehash(slots)
        return t

    # -- hashing --------------------------------------------------------------------------

    def _pos_tag(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The two buckets of packed keys (their first slots: the bucket of the home slot, the
        top bits of a multiplicative mix h of their words, and that of the top bits of a
        second mix of h) and their tags (the 8 bits below the home slot's, made odd: a tag is
        never an empty slot's 0)."""
        words = keys.view(np.uint64).reshape(len(keys), 2)
        h = words[:, 0] * _C1_U
        h ^= words[:, 1]
        h *= _C2_U
        tag = (h >> self._tshift).astype(np.uint8)
        tag |= 1
        g = h >> np.uint64(32)
        g ^= h
        g *= _C1_U
        g >>= self._shift
        h >>= self._shift
        b1 = h.astype(np.int64)
        b1 &= _BUCKET
        b2 = g.astype(np.int64)
        b2 &= _BUCKET
        return b1, b2, tag

    def _pos_tag1(self, key: bytes) -> tuple[int, int, int]:
        v = int.from_bytes(key, "little")
        h = (((v & _M64) * _C1 & _M64) ^ (v >> 64)) * _C2 & _M64
        g = ((h ^ (h >> 32)) * _C1) & _M64
        return ((h >> self._shift_i) & -WINDOW, (g >> self._shift_i) & -WINDOW,
                ((h >> self._tshift_i) & 0xFF) | 1)

    # -- lookups --------------------------------------------------------------------------

    def get(self, key: bytes, default: int | None = None) -> int | None:
        if len(key) != WIDTH:
            return self.odd.get(key, default)
        slots, tags, packed = self.slots, self.tags, self.packed
        b1, b2, tag = self._pos_tag1(key)
        for b in (b1, b2) if b2 != b1 else (b1,):
            for i in range(b, b + WINDOW):
                r = slots.item(i)
                if r < 0:
                    break
                if tags.item(i) == tag and packed[r].tobytes() == key:  # (a void scalar's bytes)
                    return r
        return default

    def __getitem__(self, key: bytes) -> int:
        r = self.get(key)
        if r is None:
            raise KeyError(key)
        return r

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def find(self, keys: list[bytes], joined: bytes | None = None) -> np.ndarray:
        """int64 rows of ``keys``, -1 where not indexed. ``joined``: ``b"".join(keys)`` when
        the caller has it and every key is ``WIDTH`` bytes."""
        n = len(keys)
        if joined is None:
            joined = b"".join(keys)
            if len(joined) != WIDTH * n or (n and min(map(len, keys)) != WIDTH):
                return np.fromiter(map(self.get, keys, [-1] * n), dtype=np.int64, count=n)
        return self._find(np.frombuffer(joined, dtype=_KEY))

    def find_packed(self, joined: bytes) -> np.ndarray:
        """:meth:`find` for keys of ``WIDTH`` bytes, joined."""
        return self._find(np.frombuffer(joined, dtype=_KEY))

    def _find(self, packed: np.ndarray) -> np.ndarray:
        """Rows of packed keys (-1: none): a key whose two buckets are empty is not indexed;
        for the others, the slots of their buckets whose tag is theirs, and the keys at those
        rows compared with theirs."""
        n = len(packed)
        out = np.full(n, -1, dtype=np.int64)
        b1, b2, tag = self._pos_tag(packed)
        slots = self.slots
        maybe = np.flatnonzero((slots.take(b1) >= 0) | (slots.take(b2) >= 0))
        if not maybe.size:
            return out
        if maybe.size < n:
            b1, b2, tag, packed = b1.take(maybe), b2.take(maybe), tag.take(maybe), packed.take(maybe)
        m = len(packed)
        win = np.empty((2 * WINDOW, m), dtype=np.int64)  # numpy's inner loops run over the keys
        np.add(_OFFSETS[:, None], b1, out=win[:WINDOW])
        np.add(_OFFSETS[:, None], b2, out=win[WINDOW:])
        hit = np.flatnonzero(self.tags.take(win) == tag)
        if not hit.size:
            return out
        cand = self.slots.take(win.ravel().take(hit))  # a slot with a tag holds a row
        key_i = hit % m
        same = self.packed.take(cand) == packed.take(key_i)
        out[maybe.take(key_i[same])] = cand[same]
        return out

    def key(self, row: int) -> bytes:
        k = self.odd_key.get(row)
        return k if k is not None else self.packed[row].tobytes()

    def keys(self, rows: Iterable[int]) -> list[bytes]:
        return [self.key(r) for r in rows]

    def joined(self, rows: np.ndarray) -> tuple[np.ndarray, bytes]:
        """(uint8 lengths, uint32 where a key is longer than 255 bytes; the keys joined) of these rows' keys, in order (whole arrays when
        every key is ``WIDTH`` bytes)."""
        if not self.odd_key:
            return np.full(len(rows), WIDTH, dtype=np.uint8), self.packed.take(rows).tobytes()
        keys = self.keys(rows.tolist())
        lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
        wide = lengths.max(initial=0) > 255  # (a key kvtier never makes; load_state takes either)
        return lengths.astype(np.uint32 if wide else np.uint8), b"".join(keys)

    def items(self) -> Iterator[tuple[bytes, int]]:
        for r in self.live.nonzero()[0].tolist():
            yield self.key(r), r

    # -- changes --------------------------------------------------------------------------

    def insert(self, keys: list[bytes], rows: np.ndarray) -> None:
        """Give these rows to these keys (distinct, none indexed yet; rows not live)."""
        n = len(keys)
        if not n:
            return
        rows = np.asarray(rows, dtype=np.int64)
        self.reserve_rows(int(rows.max()) + 1)
        if _croute is not None and self._wide + n <= room(len(self.slots)) and rows.flags.c_contiguous:
            # the same in C for keys of WIDTH bytes: stored, live, placed one by one
            placed = _croute.insert(keys, rows, self.packed, self.live, self.slots, self.tags, self._shift_i)
            if placed >= 0:
                self.count += n
                self._wide += n
                if not placed:
                    self._rehash(2 * len(self.slots))
                return
        joined = b"".join(keys)
        if len(joined) == WIDTH * n and min(map(len, keys)) == WIDTH:
            wide_rows, words = rows, np.frombuffer(joined, dtype=_KEY)
        else:
            wide = [i for i, k in enumerate(keys) if len(k) == WIDTH]
            for i, k in enumerate(keys):
                if len(k) != WIDTH:
                    self.odd[k] = r = int(rows[i])
                    self.odd_key[r] = k
            wide_rows = rows[wide]
            words = np.frombuffer(b"".join(keys[i] for i in wide), dtype=_KEY)
        self.live[rows] = True
        self.count += n
        if len(wide_rows):
            self.packed[wide_rows] = words
            self._wide += len(wide_rows)
            if self._wide > room(len(self.slots)):
                self._rehash(len(self.slots))
            elif not self._place(wide_rows, *self._pos_tag(words)):
                self._rehash(2 * len(self.slots))

    def _place(self, rows: np.ndarray, b1: np.ndarray, b2: np.ndarray, tag: np.ndarray) -> bool:
        """Put rows in the table, each in the first free slot of the less full of its two
        buckets (the first on a tie); False if both of some row's are full (the table must
        grow)."""
        slots = self.slots
        while rows.size:
            used1 = np.count_nonzero(slots.take(b1[:, None] + _OFFSETS) >= 0, axis=1)
            used2 = np.count_nonzero(slots.take(b2[:, None] + _OFFSETS) >= 0, axis=1)
            second = used2 < used1
            if np.any(np.where(second, used2, used1) >= WINDOW):
                return False
            at = np.where(second, b2 + used2, b1 + used1)
            slots[at] = rows  # several rows for one slot: one of them wins, the others try again
            won = slots.take(at) == rows
            self.tags[at[won]] = tag[won]
            lost = ~won
            rows, b1, b2, tag = rows[lost], b1[lost], b2[lost], tag[lost]
        return True

    def _rehash(self, size: int = 0) -> None:
        """Rebuild the table from the live rows: at least ``size`` slots (default: the
        current), doubled until it has room for them and every key is in one of its buckets."""
        size = max(size, 16)
        rows = self.live.nonzero()[0]
        if self.odd_key:
            rows = rows[~np.isin(rows, np.fromiter(self.odd_key, dtype=np.int64, count=len(self.odd_key)))]
        while len(rows) > room(size):
            size *= 2
        pos_words = None
        while True:
            self._set_slots(size)
            self._wide = len(rows)
            if _croute is not None:  # the same placement rule, one row at a time in C
                if _croute.place(rows, self.packed, self.slots, self.tags, self._shift_i):
                    return
            else:
                pos_words = self.packed[rows] if pos_words is None else pos_words
                if self._place(rows, *self._pos_tag(pos_words)):
                    return
            size *= 2

    def drop(self, rows: np.ndarray) -> None:
        """These live rows' keys leave the table (the rows are free again)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return
        if self.odd_key:
            for r in rows.tolist():
                k = self.odd_key.pop(r, None)
                if k is not None:
                    del self.odd[k]
        self.live[rows] = False
        self.packed[rows] = bytes(WIDTH)
        self.count -= len(rows)
        # open addressing without tombstones: rebuild the slots from the rows still live
        # (drops come in batches: compaction)
        self._rehash(len(self.slots))


def _own(a: np.ndarray) -> np.ndarray:
    """``a`` itself where it is writable and C-contiguous, else a copy."""
    return a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C")

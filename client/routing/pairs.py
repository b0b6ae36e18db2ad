"""The router index's *pairs* layout: one table of (key fingerprint, column) pairs, for fleets
whose bit matrix would not fit (``--index-layout pairs``).

The bit matrix (:class:`~kvtier.client.routing.index.LocationIndex`) gives every key a row as
wide as the fleet's columns: at 1,000 nodes about 5,000 columns, 632 bytes a row before the
key, whichever few locations hold it. :class:`PairIndex` keeps the same columns, nodes,
workers, plans and decisions, but stores each (key, column) a location holds as one pair of
an open-addressing table (``client/routing/_pairs.c``): a 64-bit fingerprint of the key and a
16-bit column, 10 bytes a pair at the table's load (at most ``LOAD_MAX``; it grows to
``GROW_TO``), so its size follows the locations held and not the fleet's width. Speculative
entries are pairs of a second, small table (they expire every few seconds: clearing them
scans that table only).

A request's keys are looked up in both tables at once into a small bit matrix of their own
(``len(keys) + 3`` rows as wide as the columns): :meth:`PairIndex.rows` answers rows of that
matrix, and :meth:`~LocationIndex.holdings`, the sparse walk, :meth:`~LocationIndex.sources`
read it as they read the bit matrix's rows (the same compiled walks), so every decision is the
bit matrix's (tests/test_pair_index.py). The rows stay valid until the next :meth:`rows`.

What differs:
    * keys are fingerprints: two keys with one fingerprint (odds near 2^-64 for two of
      kvtier's keyed-hash keys) read as one; :meth:`PairIndex.locations` returns each key as
      its fingerprint (:func:`fingerprint`), not its bytes;
    * ``len()`` counts pairs (a key held in two tiers counts twice), not keys;
    * there is no fused compiled decision (:meth:`~LocationIndex.decide` answers None: the
      router takes the steps, rows, holdings and rank, one call each);
    * a column given back (a location cleared, a node gone) is swept from the table before it
      is used again, as in the matrix, by one pass over the table;
    * at most 65,536 columns (two per worker for speculative entries, one per location);
    * it needs the compiled extension (no numpy path).

Saved as the table's two arrays, taken back as they are (no placement pass): a restart reads
10 bytes a slot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.client.routing.compiled import load_pairs
from kvtier.client.routing.index import _GPU, STATE_FORMAT, LocationIndex, Rows, _rows

_cpairs = load_pairs()

LOAD_MAX = 0.8  # a table holds at most this share of its slots in pairs (else it grows)
GROW_TO = 0.5  # the share a table is filled to right after it grows
MAX_COLUMNS = 1 << 16


def fingerprint(key: bytes) -> bytes:
    """A key as the pairs layout keeps it: its 64-bit fingerprint, 8 bytes little-endian."""
    if _cpairs is None:
        raise RuntimeError(_MISSING)
    return int(_cpairs.fingerprint(key)).to_bytes(8, "little")


_MISSING = ("the pairs index layout needs kvtier's compiled extension kvtier.client.routing._pairs, which is not "
            "built (or built from other sources): run `pip install -e .` where a C compiler and Python's headers "
            "exist, or use --index-layout matrix")


class PairTable:
    """(fingerprint, column) pairs in one open-addressing table (``_pairs.c``'s layout)."""

    def __init__(self, pairs: int = 0) -> None:
        if _cpairs is None:
            raise RuntimeError(_MISSING)
        cap = max(16, math.ceil(pairs / LOAD_MAX) + 1)
        self.fps = np.zeros(cap, dtype=np.uint64)
        self.cols = np.zeros(cap, dtype=np.uint16)
        self.pairs = 0

    @classmethod
    def adopt(cls, fps: np.ndarray, cols: np.ndarray) -> PairTable:
        """A table over saved arrays (taken as they are where writable and contiguous)."""
        if fps.dtype != np.uint64 or cols.dtype != np.uint16 or fps.ndim != 1 or fps.shape != cols.shape \
                or len(fps) < 16:
            raise ValueError(f"pairs table arrays of {fps.dtype} {fps.shape} and {cols.dtype} {cols.shape}")
        t = cls()
        t.fps = fps if fps.flags.writeable and fps.flags.c_contiguous else np.array(fps)
        t.cols = cols if cols.flags.writeable and cols.flags.c_contiguous else np.array(cols)
        t.pairs = int(np.count_nonzero(t.fps))
        if t.pairs > LOAD_MAX * len(t.fps) + 1:
            raise ValueError(f"pairs table of {t.pairs} pairs in {len(t.fps)} slots")
        return t

    def __len__(self) -> int:
        return self.pairs

    def nbytes(self) -> int:
        return int(self.fps.nbytes + self.cols.nbytes)

    def reserve(self, more: int) -> None:
        """Room for ``more`` pairs below the load limit (one rehash into a larger table)."""
        need = self.pairs + more
        if need <= LOAD_MAX * len(self.fps):
            return
        cap = max(16, math.ceil(need / GROW_TO))
        fps, cols = np.zeros(cap, dtype=np.uint64), np.zeros(cap, dtype=np.uint16)
        _cpairs.rehash(self.fps, self.cols, fps, cols)
        self.fps, self.cols = fps, cols

    def insert(self, keys: Sequence[bytes], col: int) -> int:
        self.reserve(len(keys))
        added = _cpairs.insert(self.fps, self.cols, keys, col)
        self.pairs += added
        return added

    def remove(self, keys: Sequence[bytes], col: int) -> int:
        removed = _cpairs.remove(self.fps, self.cols, keys, col)
        self.pairs -= removed
        return removed

    def clear(self, mask: np.ndarray) -> int:
        """Remove every pair of a column marked in ``mask`` (uint8, one per column)."""
        removed = _cpairs.clear(self.fps, self.cols, mask)
        self.pairs -= removed
        return removed

    def column(self, col: int) -> np.ndarray:
        """The fingerprints of the column's pairs."""
        return self.fps[(self.cols == col) & (self.fps != 0)]


class PairIndex(LocationIndex):
    """:class:`LocationIndex` over a table of pairs (see the module docstring)."""

    layout = "pairs"

    def __init__(self, speculative_ttl_s: float = 10.0, capacity: int = 0,
                 strides: dict[str, int] | None = None) -> None:
        """``capacity``: pairs to size the table for up front (it grows past them)."""
        if _cpairs is None:
            raise RuntimeError(_MISSING)
        self._capacity = capacity
        super().__init__(speculative_ttl_s, initial_rows=16, strides=strides)

    def clear(self, initial_rows: int = 16) -> None:
        super().clear(16)
        self._pairs = PairTable(self._capacity)
        self._specs = PairTable()
        self._words = 1
        self._bits = np.zeros((16, 1), dtype=np.uint64)  # the last request's rows (rows())
        self._found = np.full(2, -1, dtype=np.int64)

    def __len__(self) -> int:
        """(key, column) pairs held (not speculative)."""
        return len(self._pairs)

    def nbytes(self) -> int:
        """Bytes of the two tables."""
        return self._pairs.nbytes() + self._specs.nbytes()

    # -- columns ------------------------------------------------------------------------------

    def _reserve_columns(self, more: int) -> None:
        words = (self._ncols + more + 63) // 64
        if words * 64 > MAX_COLUMNS:
            raise RuntimeError(f"the pairs index layout holds at most {MAX_COLUMNS} columns "
                               f"({self._ncols + more} needed)")
        if words > self._words:
            self._words = words
            self._bits = np.zeros((self._bits.shape[0], words), dtype=np.uint64)

    def _clear_columns(self, cols: Iterable[int]) -> None:
        cols = list(cols)
        if not cols:
            return
        mask = np.zeros(max(cols) + 1, dtype=np.uint8)
        mask[cols] = 1
        self._specs.clear(mask)
        spec = {c for pair in self._spec_cols.values() for c in pair}
        if any(c not in spec for c in cols):  # a location's column (given back): one pass over the table
            self._pairs.clear(mask)

    def compact(self) -> int:
        """Sweep the columns given back (their pairs leave the table); no rows to reclaim."""
        if self._stale:
            self._sweep()
        self._removals = 0
        return 0

    # -- events -------------------------------------------------------------------------------

    def stored(self, node: str, tier: str, worker: str, fp: bytes, keys: Sequence[bytes],
               declare: bool = True) -> None:
        self._pairs.insert(keys, self._stored_column(node, tier, worker, fp, declare))

    def removed(self, node: str, tier: str, worker: str, fp: bytes, keys: Sequence[bytes]) -> None:
        col = self._columns.get((node, tier, worker if tier == _GPU else "", fp))
        if col is not None:
            self._removals += self._pairs.remove(keys, col)

    def _set_parts(self, keys: list[bytes], parts: list[tuple[int, int, int]]) -> None:
        self._pairs.reserve(len(keys))
        for col, start, end in parts:
            self._pairs.insert(keys[start:end], col)

    def speculate(self, worker: str, keys: Sequence[bytes], found: Rows | None = None) -> None:
        cols = self._spec_cols.get(worker)
        if cols is None:  # a worker the plan does not know (yet)
            cols = self._spec_cols[worker] = (self._new_column(), self._new_column())
            self._plan = None
        self._specs.insert(keys, cols[self._spec_gen])

    # -- a request's rows ---------------------------------------------------------------------

    def rows(self, keys: list[bytes]) -> Rows:
        """Rows of a matrix of this request's own (rows 1 to n, key i at row i + 1; -1 where
        a key has no pair) and the number of leading keys that have one; see
        :meth:`LocationIndex.rows`. Valid until the next call."""
        n = len(keys)
        bits = self._bits
        if bits.shape[0] < n + 3:
            bits = self._bits = np.zeros((max(n + 3, 2 * bits.shape[0]), self._words), dtype=np.uint64)
        else:
            bits[:n + 2] = 0  # (the last row is never written: row -1 reads as empty)
        if self.strides:
            self._query = keys
        found = np.empty(n + 2, dtype=np.int64)
        _cpairs.gather(self._pairs.fps, self._pairs.cols, keys, bits, self._words, 1, None)
        m = _cpairs.gather(self._specs.fps, self._specs.cols, keys, bits, self._words, 1, found)
        self._found = found
        return _rows(Rows, (found, m))

    def _query_rows(self, keys: list[bytes]) -> np.ndarray:
        return self._found[1:len(keys) + 1]

    def decide(self, keys: list[bytes], workers: np.ndarray, loads: np.ndarray, top_k: int, remote: bool,
               dispatch: bool, pairwise: bool = False) -> None:
        """None: the router takes the steps (rows, holdings, rank)."""
        return None

    # -- inspection and persistence -----------------------------------------------------------

    def locations(self, node_id: str | None = None,
                  speculative: bool = False) -> dict[tuple[str, str, str, bytes], set[bytes]]:
        """As :meth:`LocationIndex.locations`, each key as its :func:`fingerprint`."""
        out: dict[tuple[str, str, str, bytes], set[bytes]] = {}
        for loc, col in self._columns.items():
            if node_id is None or loc[0] == node_id:
                got = self._pairs.column(col)
                if got.size:
                    out[loc] = {int(f).to_bytes(8, "little") for f in got.tolist()}
        if speculative:
            for worker, cols in self._spec_cols.items():
                for col in cols:
                    got = self._specs.column(col)
                    if got.size:
                        out.setdefault(("", "speculative", worker, b""), set()).update(
                            int(f).to_bytes(8, "little") for f in got.tolist())
        return out

    def state(self) -> dict[str, np.ndarray]:
        """``meta`` (JSON, as the matrix's with ``layout`` "pairs") and the table's arrays
        (``pair_fps``, ``pair_cols``: copies, given-back columns' pairs left out);
        speculative entries are not saved."""
        meta = {"format": STATE_FORMAT, **self._state_meta()}
        fps, cols = self._pairs.fps.copy(), self._pairs.cols.copy()
        stale = self._stale_columns()
        if stale:
            mask = np.zeros(max(stale) + 1, dtype=np.uint8)
            mask[stale] = 1
            _cpairs.clear(fps, cols, mask)
        return {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), "pair_fps": fps, "pair_cols": cols}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace everything with a :meth:`state` of this layout (its arrays taken as they
        are where writable); ValueError (KeyError for a missing array) for one it cannot take,
        changing nothing."""
        _, _, columns, nodes, ncols = self._read_meta(arrays, self.layout)
        if ncols > MAX_COLUMNS:
            raise ValueError(f"index state of {ncols} columns (the pairs layout holds {MAX_COLUMNS})")
        table = PairTable.adopt(arrays["pair_fps"], arrays["pair_cols"])
        if table.pairs and int(table.cols.max()) >= ncols:  # (an empty slot's column is 0)
            raise ValueError("index state: a pair of a column the state does not make")
        self.clear()
        self._adopt_meta(columns, nodes, ncols)
        self._reserve_columns(0)
        self._pairs = table

"""The block-location index a router holds: the fold of the daemons' location events.

It answers one question per request, "which leading blocks of these keys does each worker
hold, in which tier" (:meth:`LocationIndex.holdings`), and knows nothing of costs or weights
(``kvtier.client.routing.scoring`` prices the answer).

Owns
    * a key table: each distinct key (opaque bytes) gets a *row*
      (:class:`~kvtier.client.routing.rowtable.RowTable`: 16-byte keys packed at their row,
      an open-addressing table of row numbers; keys of other lengths in a dict; see Rows);
    * a bit matrix ``rows x columns`` (``uint64`` words): one *column* per location, where a
      location is ``(node, tier, worker, fingerprint)``: ``host``/``disk`` of a node (worker
      empty) or ``gpu`` of one worker, per layout fingerprint; plus two *speculative*
      columns per worker (see below). A stored event sets a column's bit in the rows of its
      keys, a removed event clears it, a cleared event clears the whole column. Memory per
      key is its packed bytes, its share of the hash table and one row of the matrix (about
      60 bytes at 1M keys), independent of how many locations hold it
      (``index_bytes_per_block`` in ``bench/router.py``);
    * nodes (what each daemon published: its workers, layouts, tier bandwidths) with their
      feed position ``(epoch, seq)``, and the *workers* routed to. A worker sees its own
      ``gpu`` blocks and its node's ``host`` and ``disk`` blocks. A worker declared by its
      node (its sidecar reported device blocks) holds a block only when every layout
      fingerprint it registered (one per tensor-parallel rank) holds it; a node that
      declared no worker is routed to as one worker named after the node, which holds a
      block under any fingerprint.

The fold
    :meth:`LocationIndex.fold` applies one ``WatchLocationsReply`` of a node's feed: a
    NodeInfo (workers, bandwidths, capacities), a snapshot part (the first forgets the
    node's locations; the last sets its position) or an event batch, whose events must
    follow the position one by one (:class:`FoldError` otherwise: a gap, a duplicate,
    another epoch). Consecutive stored events of a message are folded together: one
    vectorised lookup of all their keys, new rows for the new ones in order, then each
    event's column set in its slice. A gpu event that a resume replays from before the NodeInfo that opened
    the stream does not declare a worker that NodeInfo no longer lists. Which feed serves
    which node, and reconnecting, are the feed's (``kvtier.client.routing.feed``).

Speculative entries
    :meth:`LocationIndex.speculate` marks keys as on a worker's GPU at once, before its
    engine reports them, so a session's next turn sticks to that worker (keys not indexed
    yet get rows: :meth:`_fill`, compiled; the compiled decision does it in the same call
    while the matrix and the table have room). They live in two
    generations of columns; :meth:`expire` clears the older generation every ``ttl``, so an
    unconfirmed entry disappears between ``ttl`` and ``2 * ttl`` after it was made. A
    confirmed one (the engine's gpu event arrived) stays through the real column.

Rows
    :meth:`rows` finds a request's rows without a lookup per key: keys that arrived together
    got consecutive rows, so a request is a few *runs* of rows (2.3 on average in
    ``bench/router.py``). One probe finds a run's first row; comparing the request's joined
    keys with the packed keys stored from that row (one bytes comparison; where the run
    ends early, a bisection over prefixes, each compared whole) finds how far it goes.
    Exact: a row is taken only when its stored key equals the request's key (a request
    with a key of zeros, which a free row also reads as, or a key of another length, takes
    the exact lookup of every key). After the first unknown key the rest are looked up at
    once (:meth:`RowTable.find`: a key whose two buckets are empty is absent; the others
    compare the slots of both).

Holdings
    :meth:`holdings` returns, per worker, the leading run of a request's keys held on its
    GPU (or speculatively), in GPU or host, and in any tier (``d_gpu <= d_host <= d_disk``).
    Nothing past the first unknown key can count. Consecutive keys whose rows have equal
    bits are held alike, so the walk runs over the *segments* of equal rows (about 7 per
    request), not over the keys: one row gather, one comparison of neighbours, then each
    byte of each segment's row picks a column of the plan's *byte table*
    (:meth:`_Plan.byte_table`: for a byte's position and value, the workers whose gpu /
    gpu-or-host / own-tiers / remote test one of the byte's set columns passes, as bit
    masks); their OR answers every worker and tier for the segment; ANDed over the
    segments so far a worker's bit stays set while its run lasts, and the count of set bits
    is the first failing segment. (Without a byte table, over 8 MiB for many workers and
    columns: the same walk with each worker's five columns, gpu, two speculative, host,
    disk, summed by one small matrix product.) The last row of the matrix is never given to a
    key, so row -1 (the "unknown" mark) ends every walk. Plans with tensor-parallel workers
    (an AND over ranks) or nodes that declared no worker (an OR over fingerprints) take a
    general, slower path over the keys.

Cost (1M keys, 64 workers, 128-key requests, the 2-core development VM, shared): with numpy,
about 10-20 us for the rows, 12-16 us for the holdings (a fixed number of numpy calls per
request, independent of the number of keys indexed and nearly so of the number of workers);
compiled (``client/routing/_route.c``, :meth:`decide`: rows, holdings, cost and order in one
call, the same answers), about 12-15 us for all of it, most of it reading the keys and rows.

Removal
    Lazy, so that it costs the same at 1K keys as at 1M: a location that goes away (a
    cleared event: the location stays and takes another column with no bit set; a node
    reset before a snapshot, or dropped with its workers' speculative columns) gives its
    column back with its bits still set. Nothing reads a given-back column: no location
    names it, so no plan and no byte table does. It is cleared by :meth:`_sweep` (one pass
    over the rows for all given-back columns of a word) only before it is used again
    (:meth:`_new_column`: a clean given-back column first, then, for a cleared location, a
    never-used column while the matrix's words have room, then a swept one) and at every
    :meth:`compact`; the rows it held count as removals then. A departed location's rows
    are therefore reclaimed by the compaction after its columns are swept. A removal
    changes the workers or their columns, so the next decision rebuilds the plan (about a
    millisecond at 64 workers, ``route_after_worker_removal_ms`` in ``bench/router.py``).

Sparse indexing
    With ``strides`` (the router's ``index_strides``) the host and disk tiers are indexed
    sparsely: :meth:`fold` keeps of each stored run only every k-th key and its last
    (:func:`~kvtier.client.routing.sparse.sparsify`; sequence numbers unchanged), and
    :meth:`holdings` walks a worker's host and disk runs on from its (exact) gpu run over the
    recorded keys in steps of at most k (:meth:`_sparse_walk`): a bounded estimate, never above
    the dense answer and at most k - 1 below it while holdings are prefix-closed
    (:mod:`kvtier.client.routing.sparse`). Another node's host and disk count as remote only as
    far as their recorded keys run unbroken. Compiled, the walk is part of :meth:`decide` (and
    of :meth:`holdings`): each key's row picks, through the plan's byte table, the workers
    holding it in gpu or host and anywhere of their own, then each worker's walk reads its bit
    (a few microseconds at 16 workers and 32 keys); the numpy walk, a handful of numpy calls per
    worker, is the reference and the fallback (about 140 us at 16 workers).

Rows whose keys no location holds any more are reclaimed in batches (:meth:`compact`, run
automatically once enough removals accumulate). :meth:`state` and :meth:`load_state` turn
everything but speculative entries into arrays and back (the router saves them). Not
thread-safe: the router serialises calls.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvtier.client.routing.compiled import load_route
from kvtier.client.routing.rowtable import _KEY, WIDTH, RowTable, room
from kvtier.client.routing.sparse import sparsify, walk
from kvtier.proto import locations_pb2
from kvtier.tiers.vocab import TIER_LABELS, TIERS, Tier

log = logging.getLogger("kvtier.router")

# the compiled rows, holdings and bit setting (client/routing/_route.c): same answers as numpy's; None where it is not built (or built from other sources)
_croute = load_route()

_GPU = Tier.GPU.label
_TIER_LABEL = {int(t): t.label for t in (*TIERS, Tier.REMOTE)}  # wire value -> the tier's name in columns
_REMOTE = Tier.REMOTE.label
_SHARED = frozenset((Tier.HOST.label, Tier.DISK.label, _REMOTE))  # tiers another node can fetch from
ALWAYS = 0  # column set in every live row (the neutral element of an AND over columns)
NEVER = 1   # column set in no row (the neutral element of an OR)
_FIRST_COLUMN = 2
STATE_FORMAT = 2  # LocationIndex.state()'s arrays: the matrix and the key table as they are
# rows: the tiers; columns: gpu, speculative 0, speculative 1, host, disk (see _Plan.fast)
_WORD_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # a row of w bools as one integer
_ZERO_KEY = bytes(WIDTH)
_PROBE_EACH = 512  # keys: a longer list (a fold's batch) is looked up key by key, not by runs
_TABLE_LIMIT = 8 << 20  # bytes: the largest per-plan byte table (_Plan.byte_table)
_TIER_SUMS = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=np.float32)


@dataclass
class NodeView:
    """What the index knows of one daemon."""

    node_id: str
    epoch: int = 0
    seq: int = 0                                                   # last event applied
    workers: dict[str, tuple[bytes, ...]] = field(default_factory=dict)  # declared, with fingerprints
    fingerprints: set[bytes] = field(default_factory=set)           # seen in host/disk events
    load_gbps: dict[str, float] = field(default_factory=dict)       # published, 0 = unknown
    capacity_bytes: dict[str, int] = field(default_factory=dict)
    # (epoch, head_seq, workers) of its last NodeInfo: a gpu event at or before that seq of a
    # worker it does not list is history (a resume replays events older than the NodeInfo)
    info: tuple[int, int, frozenset[str]] | None = None


@dataclass
class Worker:
    """A worker the router can send requests to."""

    name: str
    node_id: str           # "" for a worker no daemon published (a candidate named by a caller)
    index: int             # position in the per-worker arrays


class Rows(NamedTuple):
    """:meth:`LocationIndex.rows`' answer for a request's keys."""

    rows: np.ndarray  # n + 2 int64: -1, the row of each key (-1: not indexed), -1
    indexed: int      # how many leading keys are indexed


_rows = tuple.__new__  # a Rows without the Python-level constructor (rows() is on the routing path)


class FoldError(Exception):
    """A feed message that does not follow its node's position: a gap or a duplicate in the
    event sequence, or events of another epoch. The feed must start again from a snapshot."""


class LocationIndex:
    """See the module docstring."""

    layout = "matrix"  # the bit matrix (``pairs``: kvtier.client.routing.pairs.PairIndex)

    def __init__(self, speculative_ttl_s: float = 10.0, initial_rows: int = 1 << 16,
                 strides: dict[str, int] | None = None) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        # sparse deep tiers (Sparse indexing in the module docstring): tier -> stride, {}: dense
        self.strides = {t: k for t, k in (strides or {}).items() if t in ("host", "disk") and k > 1}
        self._query: list[bytes] | None = None  # the keys of the last rows() (the sparse walk reads them)
        self.clear(initial_rows)

    def clear(self, initial_rows: int = 16) -> None:
        """Forget everything: keys, locations, nodes and their positions, speculative entries."""
        self._bits = np.zeros((max(16, initial_rows), 1), dtype=np.uint64)
        self._rows = RowTable(len(self._bits))  # key -> row
        self._high = 1  # rows below this were given out; row 0 stays empty: the request padding
        self._free = np.empty(0, dtype=np.int64)  # rows given back (compact): the first _nfree, taken from the end
        self._nfree = 0
        self._ncols = _FIRST_COLUMN
        self._columns: dict[tuple[str, str, str, bytes], int] = {}
        self._free_cols: list[int] = []  # columns given back (locations gone), stale or clean
        self._stale: dict[int, int] = {}  # word -> mask of given-back columns whose bits are not cleared yet
        self._spec_cols: dict[str, tuple[int, int]] = {}  # worker -> its columns of generation 0 and 1
        self._spec_gen = 0
        self._spec_rotated_at: float | None = None
        self._removals = 0
        self.nodes: dict[str, NodeView] = {}
        self.workers: list[Worker] = []
        self._worker_by_name: dict[str, Worker] = {}
        self._external: list[str] = []
        self._clashes: set[tuple[str, str]] = set()  # (worker, node) names refused, said once
        self._plan: _Plan | None = None
        self._run: tuple[np.ndarray | None, int] = (None, 0)  # rows()' last one-run answer, its first row
        self._decide_rows = np.empty(258, dtype=np.int64)  # decide()'s rows (scratch)
        self._aux = np.zeros(4, dtype=np.int64)  # decide()'s rows made: [free rows, keys in the table, ...]
        self._aux_view = memoryview(self._aux)

    # -- sizes ----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct keys indexed (held somewhere, or speculative)."""
        return len(self._rows)

    @property
    def columns(self) -> int:
        return self._ncols

    def nbytes(self) -> int:
        """Bytes of the index's own arrays (the bit matrix and the key table's)."""
        return int(self._bits.nbytes) + self._rows.nbytes()

    # -- columns and rows -----------------------------------------------------------------

    def _column(self, node: str, tier: str, worker: str, fp: bytes) -> int:
        loc = (node, tier, worker, fp)
        col = self._columns.get(loc)
        if col is None:
            col = self._columns[loc] = self._new_column()
            if tier != _GPU and fp not in self.node(node).fingerprints:
                self.node(node).fingerprints.add(fp)
            self._plan = None
        return col

    def _new_column(self, spare: bool = False) -> int:
        """A column with no bit set: a given-back one (a clean one first; a stale one after
        :meth:`_sweep`), else a new one. ``spare``: a new one before a stale one while the
        matrix's words have room for it (no sweep and no copy: what a removal takes)."""
        free = self._free_cols
        for j in range(len(free) - 1, -1, -1):
            col = free[j]
            if not self._stale.get(col >> 6, 0) >> (col & 63) & 1:
                del free[j]
                return col
        if free and not (spare and self._ncols < self._bits.shape[1] * 64):
            self._sweep()
            return free.pop()
        col = self._ncols
        self._ncols += 1
        self._reserve_columns(0)
        return col

    def _give_back(self, cols: Iterable[int]) -> None:
        """Columns no location uses any more, for reuse: their bits are cleared lazily (see
        Removal in the module docstring)."""
        for col in cols:
            self._stale[col >> 6] = self._stale.get(col >> 6, 0) | (1 << (col & 63))
            self._free_cols.append(col)
            self._plan = None

    def _sweep(self) -> None:
        """Clear every stale column (one pass over the rows per word that has one); the rows
        that held one count as removals (for :meth:`compact`)."""
        cols, self._stale = self._stale_columns(), {}
        self._clear_columns(cols)

    def _reserve_columns(self, more: int) -> None:
        """Widen the matrix (one copy) to hold the columns made so far and ``more``."""
        words = (self._ncols + more + 63) // 64
        if words > self._bits.shape[1]:
            grown = np.zeros((self._bits.shape[0], words), dtype=np.uint64)
            grown[:, :self._bits.shape[1]] = self._bits
            self._bits = grown

    def _grow_rows(self, need: int) -> None:
        """Room in the matrix for rows below ``need`` (the last row stays empty: row -1 reads
        as "no key")."""
        if need >= self._bits.shape[0]:
            cap = self._bits.shape[0]
            while cap <= need:
                cap *= 2
            grown = np.zeros((cap, self._bits.shape[1]), dtype=np.uint64)
            grown[:self._high] = self._bits[:self._high]
            self._bits = grown
            self._rows.reserve_rows(cap)  # (a loaded snapshot's buffer is left: nothing holds it now)

    def _alloc_rows(self, keys: list[bytes]) -> np.ndarray:
        """Give rows to keys not yet indexed (distinct, absent from the table); returns them,
        in the keys' order (freed rows first, then new ones in order)."""
        n = len(keys)
        take = min(n, self._nfree)
        rows = np.empty(n, dtype=np.int64)
        if take:
            rows[:take] = self._free[self._nfree - take:self._nfree]
            self._nfree -= take
            self._bits[rows[:take], 0] |= np.uint64(1 << ALWAYS)
        if take < n:
            start = self._high
            need = start + n - take
            self._grow_rows(need)
            rows[take:] = np.arange(start, need, dtype=np.int64)
            self._high = need
            self._bits[start:need, 0] |= np.uint64(1 << ALWAYS)
        self._rows.reserve_rows(self._bits.shape[0])
        self._rows.insert(keys, rows)
        return rows

    def _rows_of(self, keys: Sequence[bytes], create: bool) -> np.ndarray:
        """The rows of ``keys``: with ``create``, one for every key (new rows for keys not
        indexed); without, only those of indexed keys."""
        if not isinstance(keys, list):
            keys = list(keys)  # once: a protobuf field makes new bytes objects on every pass
        if len(keys) > _PROBE_EACH and _croute is None:  # a fold's batch: a probe per key (C: the same walk)
            rows = self._rows.find(keys)
            indexed = 0
        else:
            rows, indexed = self.rows(keys)
            rows = rows[1:len(keys) + 1]
        if create:
            return self._fill(keys, rows, indexed, fresh=True)
        return rows[rows >= 0]

    def _fill(self, keys: list[bytes], rows: np.ndarray, indexed: int, col: int = -1,
              fresh: bool = False) -> np.ndarray:
        """``rows`` (of ``keys``, -1 where not indexed) with new rows for the keys at -1;
        ``indexed``: how many leading keys are known to be indexed. With ``col``, that column
        is then set in every key's row. ``fresh``: ``rows`` is :meth:`rows`' answer of just
        now (no key at -1 is in the table: a new key is looked up among the keys only)."""
        missing = None if indexed == len(keys) else (rows < 0).nonzero()[0]
        if missing is None or not missing.size:
            if col >= 0:
                self._set(rows, col)
            return rows
        rows = rows.copy()
        if _croute is not None and self._fill_compiled(keys, rows, missing.size, col, fresh):
            return rows
        new = keys if missing.size == len(keys) else [keys[i] for i in missing.tolist()]
        distinct = list(dict.fromkeys(new))
        given = self._alloc_rows(distinct)
        if len(distinct) == len(new):
            rows[missing] = given
        else:  # repeated keys: look them all up (compiled: the same rows)
            rows[missing] = self._rows.find(new) if _croute is None else self.rows(new).rows[1:len(new) + 1]
        if col >= 0:
            self._set(rows, col)
        return rows

    def _fill_compiled(self, keys: list[bytes], rows: np.ndarray, missing: int, col: int, fresh: bool) -> bool:
        """:meth:`_fill` in one compiled call (``missing``: how many rows are -1): room made
        first (rows in the matrix, slots in the table), then again after a call that ran out
        of either (which looks its keys up in the table: it holds the first call's new keys).
        False when a key is not 16 bytes (nothing done)."""
        t = self._rows
        while True:
            self._grow_rows(self._high + max(0, missing - self._nfree))
            size = len(t.slots)
            while t._wide + missing > room(size):  # the table's limit of keys
                size *= 2
            if size != len(t.slots):
                t._rehash(size)
            t.reserve_rows(self._bits.shape[0])
            got = _croute.fill(keys, rows, t.slots, t.tags, t.packed, t.live, self._bits, self._bits.shape[1],
                               self._free, self._nfree, self._high, t._shift_i, col, *((True,) if fresh else ()))
            fresh = False
            if got is None:
                return False
            status, made, self._high, self._nfree = got
            t.count += made
            t._wide += made
            if status == 1:
                return True
            if status == 0:  # a key found no slot near its home: the table doubles
                t._rehash(2 * len(t.slots))
            missing = int(np.count_nonzero(rows < 0))

    def _set(self, rows: np.ndarray, col: int) -> None:
        if _croute is not None and rows.dtype == np.int64:
            _croute.set_bit(self._bits, self._bits.shape[1], rows, rows.size, col)
        elif rows.size:
            self._bits[rows, col >> 6] |= np.uint64(1 << (col & 63))

    def _clear(self, rows: np.ndarray, col: int) -> None:
        if rows.size:
            self._bits[rows, col >> 6] &= np.uint64(~(1 << (col & 63)) & 0xFFFFFFFFFFFFFFFF)
            self._removals += int(rows.size)

    def _clear_columns(self, cols: Iterable[int]) -> None:
        masks: dict[int, int] = {}
        for col in cols:
            masks[col >> 6] = masks.get(col >> 6, 0) | (1 << (col & 63))
        hw = self._high
        for word, mask in masks.items():
            col = self._bits[:hw, word]
            # count only the rows that held one of these columns, so clearing speculative
            # columns every TTL does not look like a million removals and force a compaction
            self._removals += int(np.count_nonzero(col & np.uint64(mask)))
            col &= np.uint64(~mask & 0xFFFFFFFFFFFFFFFF)

    # -- nodes and events -----------------------------------------------------------------

    def node(self, node_id: str) -> NodeView:
        view = self.nodes.get(node_id)
        if view is None:
            view = self.nodes[node_id] = NodeView(node_id)
            self._plan = None
        return view

    def set_node_info(self, node_id: str, workers: dict[str, Sequence[bytes]] | None = None,
                      load_gbps: dict[str, float] | None = None,
                      capacity_bytes: dict[str, int] | None = None) -> None:
        """What a daemon published about itself (its NodeInfo)."""
        view = self.node(node_id)
        if workers is not None:
            declared = {w: tuple(sorted(fps)) for w, fps in workers.items()}
            if declared != view.workers:
                view.workers = declared
                self._plan = None
        if load_gbps is not None:  # a bandwidth that is not a positive number: unknown (the default)
            load_gbps = {t: (v if math.isfinite(v) and v > 0 else 0.0) for t, v in load_gbps.items()}
        if load_gbps is not None and load_gbps != view.load_gbps:
            view.load_gbps = load_gbps
            self._plan = None
        if capacity_bytes is not None:
            view.capacity_bytes = dict(capacity_bytes)

    def stored(self, node: str, tier: str, worker: str, fp: bytes, keys: Sequence[bytes],
               declare: bool = True) -> None:
        """Keys became visible in (node, tier) or on worker's GPU, under layout ``fp``. A gpu
        event declares its worker (and fingerprint) on the node unless ``declare`` is False
        (the event is history: the node's newer NodeInfo no longer lists that worker)."""
        self._set(self._rows_of(keys, create=True), self._stored_column(node, tier, worker, fp, declare))

    def _stored_column(self, node: str, tier: str, worker: str, fp: bytes, declare: bool) -> int:
        """The column a stored event sets (made if new); a gpu event with ``declare``
        declares its worker and fingerprint on the node."""
        col = self._column(node, tier, worker if tier == _GPU else "", fp)
        if tier == _GPU and declare:
            view = self.node(node)
            fps = view.workers.get(worker, ())
            if fp not in fps:
                view.workers[worker] = tuple(sorted((*fps, fp)))
                self._plan = None
        return col

    def removed(self, node: str, tier: str, worker: str, fp: bytes, keys: Sequence[bytes]) -> None:
        col = self._columns.get((node, tier, worker if tier == _GPU else "", fp))
        if col is None:
            return
        if _croute is not None:  # the same rows and bits in one compiled call (-1: a key not of 16 bytes)
            if not isinstance(keys, list):
                keys = list(keys)
            t = self._rows
            found = _croute.unset(keys, t.slots, t.tags, t.packed, self._high, t._shift_i, self._bits,
                                  self._bits.shape[1], col)
            if found >= 0:
                self._removals += found
                self._maybe_compact()
                return
        self._clear(self._rows_of(keys, create=False), col)
        self._maybe_compact()

    def cleared(self, node: str, tier: str, worker: str = "") -> None:
        """Everything of (node, tier) is gone (for gpu: of that worker; "" for every worker):
        each of its locations takes a column with no bit set, its old one is given back."""
        locs = [loc for loc in self._columns
                if loc[0] == node and loc[1] == tier and (tier != _GPU or not worker or loc[2] == worker)]
        old = [self._columns[loc] for loc in locs]
        for loc in locs:
            self._columns[loc] = self._new_column(spare=True)
        self._give_back(old)

    def reset_node(self, node_id: str) -> None:
        """Forget every location of a node (a snapshot follows, or the node is gone): its
        columns are given back (a location seen again takes a column with no bit set)."""
        gone = [loc for loc in self._columns if loc[0] == node_id]
        self._give_back([self._columns.pop(loc) for loc in gone])
        view = self.node(node_id)
        view.seq = 0

    def drop_node(self, node_id: str) -> None:
        """The node left (its address is gone, or its heartbeats stopped): forget it and its
        workers, and give their columns (locations and speculative entries) back for reuse:
        a worker that gets one later starts with nothing (Removal in the module docstring)."""
        self.reset_node(node_id)
        view = self.nodes.pop(node_id, None)
        others = {w for n, v in self.nodes.items() for w in (v.workers or (n,))}
        workers = [w for w in ((view.workers or (node_id,)) if view is not None else ())
                   if w not in others and w not in self._external and w in self._spec_cols]
        self._give_back([c for w in workers for c in self._spec_cols.pop(w)])

    # -- the fold of a node's feed --------------------------------------------------------

    def fold(self, node_id: str, reply: locations_pb2.WatchLocationsReply) -> None:
        """Fold one message of the feed of node ``node_id`` (for a NodeInfo: the node it
        names): its NodeInfo, a snapshot part or an event batch. Events must follow the
        node's position (:meth:`position`) exactly, else :class:`FoldError` (nothing of the
        batch after the offending event is folded)."""
        if self.strides:
            reply = sparsify(reply, self.strides)
        body = reply.WhichOneof("body")
        if body == "node":
            self._fold_info(reply.node)
        elif body == "snapshot":
            part = reply.snapshot
            view = self.node(node_id)
            if part.first:
                self.reset_node(node_id)
                view.epoch = 0  # not a valid position until the last part
            self._fold_events(view, part.entries, reply.epoch, False)
            if part.last:
                view.epoch, view.seq = reply.epoch, part.at_seq
        elif body == "events":
            view = self.node(node_id)
            if view.epoch != reply.epoch:
                raise FoldError(f"events of epoch {reply.epoch} while at epoch {view.epoch}")
            self._fold_events(view, reply.events.events, reply.epoch, True)

    def _fold_events(self, view: NodeView, events: Iterable[locations_pb2.LocationEvent], epoch: int,
                     in_order: bool) -> None:
        """Fold events in order; ``in_order``: each must follow the node's position (which
        then moves), else :class:`FoldError` once those before it are folded. Consecutive
        stored events are folded together: one lookup of all their keys' rows (new rows
        for new keys), then each event's column set in its slice of them."""
        keys: list[bytes] = []
        parts: list[tuple[int, int, int]] = []  # (column, start, end) in keys
        stored = locations_pb2.STORED
        try:
            for ev in events:
                if in_order:
                    if ev.seq != view.seq + 1:
                        raise FoldError(f"event seq {ev.seq} after {view.seq}: a gap or a duplicate")
                    view.seq = ev.seq
                tier = _TIER_LABEL.get(ev.tier)
                if tier is None:
                    continue
                if ev.kind == stored:
                    col = self._stored_column(view.node_id, tier, ev.worker_id, ev.fingerprint,
                                              self._declares(view, tier, ev, epoch))
                    start = len(keys)
                    keys.extend(ev.keys)
                    parts.append((col, start, len(keys)))
                    continue
                if parts:
                    self._set_parts(keys, parts)
                    keys, parts = [], []
                self._fold_event(view, ev, epoch)
        finally:
            if parts:
                self._set_parts(keys, parts)

    def _set_parts(self, keys: list[bytes], parts: list[tuple[int, int, int]]) -> None:
        """Set each part's column in its keys' rows: one update per column (a batch has a
        few columns and many events)."""
        rows = self._rows_of(keys, create=True)
        by_col: dict[int, list[np.ndarray]] = {}
        for col, start, end in parts:
            chunks = by_col.get(col)
            if chunks is None:
                by_col[col] = [rows[start:end]]
            else:
                chunks.append(rows[start:end])
        for col, chunks in by_col.items():
            self._set(chunks[0] if len(chunks) == 1 else np.concatenate(chunks), col)

    @staticmethod
    def _declares(view: NodeView, tier: str, ev: locations_pb2.LocationEvent, epoch: int) -> bool:
        """Whether a stored event declares its worker: not a gpu event that a resume replays
        from before the NodeInfo that no longer lists the worker."""
        if tier != _GPU or view.info is None:
            return True
        info_epoch, info_seq, listed = view.info
        return info_epoch != epoch or ev.seq > info_seq or ev.worker_id in listed

    def _fold_info(self, info: locations_pb2.NodeInfo) -> None:
        view = self.node(info.node_id)
        view.info = (info.epoch, info.head_seq, frozenset(w.worker_id for w in info.workers))
        tiers = [(_TIER_LABEL[t.tier], t) for t in info.tiers if t.tier in _TIER_LABEL]
        self.set_node_info(info.node_id, {w.worker_id: list(w.fingerprints) for w in info.workers},
                           {label: t.load_gbps for label, t in tiers},
                           {label: t.capacity_bytes for label, t in tiers})

    def _fold_event(self, view: NodeView, ev: locations_pb2.LocationEvent, epoch: int) -> None:
        tier = _TIER_LABEL.get(ev.tier)
        if tier is None:
            return
        if ev.kind == locations_pb2.STORED:
            self.stored(view.node_id, tier, ev.worker_id, ev.fingerprint, ev.keys,
                        declare=self._declares(view, tier, ev, epoch))
        elif ev.kind == locations_pb2.REMOVED:
            self.removed(view.node_id, tier, ev.worker_id, ev.fingerprint, ev.keys)
        elif ev.kind == locations_pb2.CLEARED:
            self.cleared(view.node_id, tier, ev.worker_id)

    def position(self, node_id: str) -> tuple[int, int]:
        """(epoch, seq) of the last event folded for the node; epoch 0: no valid position (a
        feed must ask for a snapshot)."""
        view = self.nodes.get(node_id)
        return (view.epoch, view.seq) if view is not None and view.epoch else (0, 0)

    def positions(self) -> dict[str, tuple[int, int]]:
        """node id -> (epoch, seq) folded, for every node (epoch 0: none valid)."""
        return {n: (v.epoch, v.seq) for n, v in self.nodes.items()}

    def invalidate(self, node_id: str) -> None:
        """The node's feed broke its contract: its position is no longer valid, so the next
        subscription starts from a snapshot (its holdings stay until that snapshot)."""
        view = self.nodes.get(node_id)
        if view is not None:
            view.epoch = 0

    # -- speculative entries --------------------------------------------------------------

    def speculate(self, worker: str, keys: Sequence[bytes], found: Rows | None = None) -> None:
        """Mark ``keys`` as on ``worker``'s GPU until confirmed or expired (see module doc).
        ``found``: :meth:`rows`' answer for ``keys``, if the caller has it (no :meth:`expire`
        or removal since: those may reclaim rows). Callers run :meth:`expire` themselves."""
        cols = self._spec_cols.get(worker)
        if cols is None:  # a worker the plan does not know (yet)
            cols = self._spec_cols[worker] = (self._new_column(), self._new_column())
            self._plan = None
        if found is None:
            if not isinstance(keys, list):
                keys = list(keys)
            found = self.rows(keys)
        rows, indexed = found
        col = cols[self._spec_gen]
        if rows is self._run[0] and indexed == len(keys):  # one run of rows: rows r, r + 1, ...
            r = self._run[1]
            self._bits[r:r + indexed, col >> 6] |= np.uint64(1 << (col & 63))
            return
        rows = rows[1:len(keys) + 1]
        if indexed == len(keys):
            self._set(rows, col)
        else:
            self._fill(keys, rows, indexed, col)

    def expire(self, now: float) -> None:
        """Drop the older generation of speculative entries once per ``speculative_ttl_s``."""
        if self._spec_rotated_at is None:
            self._spec_rotated_at = now
            return
        if now - self._spec_rotated_at < self.speculative_ttl_s:
            return
        periods = int((now - self._spec_rotated_at) // self.speculative_ttl_s)
        gens = (0, 1) if periods >= 2 else (1 - self._spec_gen,)
        self._clear_columns(cols[g] for cols in self._spec_cols.values() for g in gens)
        self._spec_gen = 1 - self._spec_gen
        self._spec_rotated_at += periods * self.speculative_ttl_s
        self._maybe_compact()

    # -- reclaiming rows ------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        if self._removals > max(65536, len(self._rows) // 2):
            self.compact()

    def compact(self) -> int:
        """Give back the rows of keys no location holds; returns how many."""
        if self._stale:
            self._sweep()
        self._removals = 0
        hw = self._high
        bits = self._bits[:hw]
        only_always = bits[:, 0] == np.uint64(1 << ALWAYS)
        for w in range(1, bits.shape[1]):
            only_always &= bits[:, w] == 0
        dead = np.flatnonzero(only_always)
        if not dead.size:
            return 0
        self._bits[dead] = 0
        self._rows.drop(dead)
        self._free = np.concatenate([self._free[:self._nfree], dead.astype(np.int64)])
        self._nfree = len(self._free)
        return int(dead.size)

    # -- workers and holdings -------------------------------------------------------------

    def add_external_worker(self, name: str) -> None:
        """A worker no daemon publishes (a caller named it): it holds nothing but can be picked."""
        if name not in self._external:
            self._external.append(name)
            self._plan = None

    def worker(self, name: str) -> Worker | None:
        self.plan()
        return self._worker_by_name.get(name)

    def plan(self) -> _Plan:
        """The per-worker column tables, rebuilt when nodes, workers or columns change."""
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> _Plan:
        names: list[tuple[str, str]] = []  # (worker, node)
        owner: dict[str, str] = {}
        for node_id in sorted(self.nodes):
            view = self.nodes[node_id]
            for w in sorted(view.workers) if view.workers else [node_id]:
                first = owner.setdefault(w, node_id)
                if first == node_id:
                    names.append((w, node_id))
                elif (w, node_id) not in self._clashes:  # a worker is one engine: the first node keeps it
                    self._clashes.add((w, node_id))
                    log.warning("a worker name is declared by two nodes: routed as the first's only",
                                extra={"worker": w, "node": first, "also_declared_by": node_id})
        seen = {w for w, _ in names}
        names.extend((w, "") for w in self._external if w not in seen)
        and_cols: dict[str, list[list[int]]] = {t: [] for t in TIER_LABELS}
        or_cols: dict[str, list[list[int]]] = {t: [] for t in TIER_LABELS}
        spec: list[list[int]] = []
        workers: list[Worker] = []
        self._reserve_columns(2 * sum(1 for name, _ in names if name not in self._spec_cols))
        for i, (name, node_id) in enumerate(names):
            view = self.nodes.get(node_id)
            workers.append(Worker(name, node_id, i))
            cols = self._spec_cols.get(name)
            if cols is None:  # made up front: a first speculation must not grow the matrix
                cols = self._spec_cols[name] = (self._new_column(), self._new_column())
            spec.append(list(cols))
            if view is None:
                for t in TIER_LABELS:
                    and_cols[t].append([NEVER])
                    or_cols[t].append([ALWAYS])
                continue
            declared = view.workers.get(name)
            if declared:
                for t in TIER_LABELS:
                    who = name if t == _GPU else ""
                    and_cols[t].append([self._column(node_id, t, who, fp) for fp in declared])
                    or_cols[t].append([ALWAYS])
            else:
                # an undeclared node worker (or a declared one with no layout yet): any fingerprint
                for t in TIER_LABELS:
                    who = name if t == _GPU else ""
                    cols = [c for (n, tt, w, _), c in self._columns.items()
                            if n == node_id and tt == t and w == who]
                    and_cols[t].append([ALWAYS])
                    or_cols[t].append(cols or [NEVER])
        self._worker_by_name = {w.name: w for w in workers}
        self.workers = workers
        rmask, groups = self._remote_groups(names)
        return _Plan(workers, {t: _pad(and_cols[t], ALWAYS) for t in TIER_LABELS},
                     {t: _pad(or_cols[t], NEVER) for t in TIER_LABELS}, np.asarray(spec, dtype=np.int64).reshape(-1, 2),
                     self._bits.shape[1] * 64, rmask=rmask, rgroups=groups, sources=self._source_matrices())

    def _source_matrices(self) -> tuple[list[str], dict[bytes | None, np.ndarray]]:
        """(sources: the nodes by name, then "store"; per fingerprint (None: any), a (columns,
        sources) 0/1 matrix: column c is one of that source's, a host or disk column of the
        node, or any node's remote column for the store)."""
        names = sorted({n for (n, t, _, _) in self._columns if t in _SHARED and t != _REMOTE}) + ["store"]
        pos = {n: i for i, n in enumerate(names)}
        ncols = self._bits.shape[1] * 64
        mats: dict[bytes | None, np.ndarray] = {None: np.zeros((ncols, len(names)), dtype=np.float32)}
        for (n, t, _, fp), c in self._columns.items():
            if t not in _SHARED:
                continue
            src = pos["store"] if t == _REMOTE else pos[n]
            if fp not in mats:
                mats[fp] = np.zeros((ncols, len(names)), dtype=np.float32)
            mats[fp][c, src] = mats[None][c, src] = 1
        return names, mats

    def _remote_groups(self, names: list[tuple[str, str]]) -> tuple[np.ndarray, list[list[int]]]:
        """The ``remote`` tier's masks and, per worker, the masks it needs (all of them).

        A block is in the remote tier for a worker when some node holds it in host or disk
        (a peer serves it; the worker's own node counts too, as its own tiers already do) or
        some daemon published it in the shared store (tier ``remote``), under a fingerprint
        the worker needs. Masks (rows of uint64 words over the columns): one per fingerprint,
        then "any fingerprint" (a node that declared no worker), then "none" (a worker no
        daemon publishes: it has no daemon to fetch with)."""
        fps = sorted({fp for (_, t, _, fp) in self._columns if t in _SHARED})
        pos = {fp: i for i, fp in enumerate(fps)}
        any_g, none_g = len(fps), len(fps) + 1
        rmask = np.zeros((len(fps) + 2, self._bits.shape[1]), dtype=np.uint64)
        for (_, t, _, fp), c in self._columns.items():
            if t in _SHARED:
                bit = np.uint64(1 << (c & 63))
                rmask[pos[fp], c >> 6] |= bit
                rmask[any_g, c >> 6] |= bit
        groups: list[list[int]] = []
        for name, node_id in names:
            view = self.nodes.get(node_id)
            declared = view.workers.get(name) if view is not None else None
            if view is None:
                groups.append([none_g])
            elif declared:
                groups.append([pos.get(fp, none_g) for fp in declared])
            else:
                groups.append([any_g])
        return rmask, groups

    def rows(self, keys: list[bytes]) -> Rows:
        """(``n + 2`` int64: -1, the row of each of the ``n`` keys or -1 where it is not
        indexed, -1; the number of leading keys that are indexed). The rows stay valid until
        the next :meth:`expire`, removal or compaction. Row -1 (the matrix's last) is always
        empty, so the -1 around the keys' rows bound a walk over them.

        See the module docstring (Rows). Exact: a row is only taken when its stored key
        equals the key."""
        n = len(keys)
        table = self._rows
        if self.strides:
            self._query = keys
        if _croute is not None:  # the same rows, one probe per key in C (-1: a key not of 16 bytes)
            buf = np.empty(n + 2, dtype=np.int64)
            m = _croute.rows(keys, table.slots, table.tags, table.packed, self._high, table._shift_i, buf)
            if m >= 0:
                return _rows(Rows, (buf, m))
        joined = b"".join(keys)
        buf = np.empty(n + 2, dtype=np.int64)
        buf[0] = buf[n + 1] = -1
        if not n or len(joined) != WIDTH * n or min(map(len, keys)) != WIDTH or _ZERO_KEY in joined:
            # keys of other lengths, or of zeros (a row of zeros may be free): key by key
            buf[1:n + 1] = table.find(keys)
            return _rows(Rows, (buf, int((buf[1:] < 0).argmax())))
        packed, high = table.packed, self._high
        i = 0
        while i < n:
            r = table.get(keys[i])
            if r is None:
                break
            # the run: how many of keys[i:] are stored at rows r, r + 1, ... (one bytes
            # comparison when all are; else the first key that differs, compared as arrays)
            span = min(n - i, high - r)
            at = WIDTH * i
            if packed[r:r + span].tobytes() == joined[at:at + WIDTH * span]:
                run = span
            else:
                mine = np.frombuffer(joined, dtype=_KEY, count=span, offset=at)
                run = int((packed[r:r + span] != mine).argmax())  # > 0: keys[i] is at row r
            if run == n:  # one run (the common case)
                out = np.arange(r - 1, r + n + 1, dtype=np.int64)
                out[0] = out[n + 1] = -1
                self._run = (out, r)  # speculate() then sets a slice of rows, not a list of them
                return _rows(Rows, (out, n))
            buf[1 + i:1 + i + run] = np.arange(r, r + run, dtype=np.int64)
            i += run
        if i < n:  # after the first unknown key: the rest at once (usually unknown too)
            buf[1 + i:n + 1] = table.find_packed(joined[WIDTH * i:])
        return _rows(Rows, (buf, i))

    def decide(self, keys: list[bytes], workers: np.ndarray, loads: np.ndarray, top_k: int, remote: bool,
               dispatch: bool, pairwise: bool = False) -> tuple[np.ndarray, int, list[int], float, bool, bool,
                                                                bytes] | None:
        """:meth:`rows`, :meth:`holdings` over every worker and the scorer's
        :meth:`~kvtier.client.routing.scoring.Scorer.rank` in one compiled call. ``workers``:
        the plan's :meth:`_Plan.decide_workers` (weights, digests, speculative columns);
        ``loads``: the (3, workers) float64 queued, active and load cost, in the plan's order;
        the tie hash's key digest of the last key is made in the same call. Returns (rows,
        indexed keys, order, the best worker's saved blocks, whether it counted remote blocks
        (fetch hints to make), whether the speculative entries were set (``dispatch``: when
        every key is indexed and no fetch hint is needed, the best worker's speculative
        column is set in the keys' rows, as :meth:`speculate` would), arrays: bytes of the (4,
        workers) cost, saved and copies of queued and active (float64), then the (4, workers)
        int64 lead). With sparse deep tiers the leads are :meth:`holdings`' (the sparse walk in
        the same call). ``rows`` (``Rows(rows, indexed)`` is :meth:`rows`' answer) is a scratch
        buffer of the index, valid until the next call. ``pairwise``: each worker's saved blocks
        summed as the scorer sums a selection of workers (:meth:`Scorer.rank`'s ``pairwise``),
        for a ranking of candidates that name every worker. None where that call does not apply
        (no extension, no byte table for this plan, a key not of 16 bytes): the caller takes
        the steps one by one."""
        if _croute is None:
            return None
        plan = self._plan
        if plan is None:
            plan = self.plan()
        tab = plan._table_rows
        if tab is None:
            tab = plan.byte_table_rows() if plan.fast is not None else None
        bits = self._bits
        if tab is None or tab.shape[0] != bits.shape[1] * 2048:
            return None
        rows = self._decide_rows
        if len(rows) < len(keys) + 2:
            rows = self._decide_rows = np.empty(2 * len(keys) + 2, dtype=np.int64)
        t = self._rows
        aux = self._aux_view
        aux[0], aux[1], aux[3] = self._nfree, t._wide, 0
        got = _croute.decide(keys, t.slots, t.tags, t.packed, self._high, t._shift_i, bits, bits.shape[1], tab,
                             remote, workers, loads, self._spec_gen if dispatch else -1, top_k, rows, t.live,
                             self._free, self._aux, *self._walk_strides(), *((True,) if pairwise else ()))
        if aux[3]:  # the call gave rows to keys not indexed (speculating)
            self._nfree, made, self._high = aux[0], aux[1], aux[2]
            t.count += made
            t._wide += made
            if aux[3] == 2:  # one is stored, not placed in the table
                t._rehash(2 * len(t.slots))
        return got

    def _walk_strides(self) -> tuple[int, int]:
        """The sparse walk's steps: (host stride, the larger of the host and disk strides);
        (0, 0) when the index is dense."""
        if not self.strides:
            return 0, 0
        kh = self.strides.get("host", 1)
        return kh, max(kh, self.strides.get("disk", 1))

    def holdings(self, found: Rows, workers: np.ndarray | None = None, remote: bool = True) -> np.ndarray:
        """:meth:`_holdings`; with sparse deep tiers, their runs walked on (:meth:`_sparse_walk`;
        compiled over the plan's byte table where it applies: :meth:`_sparse_compiled`)."""
        query = self._query
        sparse = self.strides and query is not None and len(query) + 2 == len(found[0])
        if sparse and _croute is not None:
            lead = self._sparse_compiled(found, len(query), workers, remote)
            if lead is not None:
                return lead
        lead = self._holdings(found, workers, remote)
        if sparse and lead.size:
            assert query is not None
            self._sparse_walk(query, lead, workers)
        return lead

    def _sparse_compiled(self, found: Rows, n: int, workers: np.ndarray | None, remote: bool) -> np.ndarray | None:
        """The dense holdings and the sparse walk of every worker in two compiled calls over the
        plan's byte table (the same answers as :meth:`_holdings` then :meth:`_sparse_walk`);
        None where no byte table applies."""
        plan = self.plan()
        n_w = len(plan.workers)
        tab = plan.byte_table_rows() if plan.fast is not None and n_w else None
        bits = self._bits
        if tab is None or tab.shape[0] != bits.shape[1] * 2048:
            return None
        rows, m = found
        lead = np.zeros((4, n_w), dtype=np.int64)
        if m:
            _croute.lead(rows, m, bits, bits.shape[1], tab, n_w, remote, lead)
        _croute.sparse(rows, n, bits, bits.shape[1], tab, n_w, *self._walk_strides(), lead)
        return lead if workers is None else lead[:, workers]

    def _sparse_walk(self, keys: list[bytes], lead: np.ndarray, workers: np.ndarray | None) -> None:
        """Extend ``lead`` (the dense answer, whose gpu run is exact) by the sparse walk: from
        each worker's gpu run, over the keys held in gpu or host, steps of at most the host
        stride; from there, over the keys held anywhere, steps of at most the larger stride
        (see :mod:`kvtier.client.routing.sparse` for the bound)."""
        n = len(keys)
        rows = self._query_rows(keys)
        plan = self.plan()
        kh, kany = self._walk_strides()
        if _croute is not None and plan.fast is not None:  # each worker's own columns, compiled
            found = np.empty(n + 2, dtype=np.int64)
            found[0] = found[n + 1] = -1
            found[1:n + 1] = rows
            fast = np.ascontiguousarray(plan.fast if workers is None else plan.fast[:, workers])
            out = lead if lead.flags.c_contiguous else np.ascontiguousarray(lead)
            _croute.sparse_cols(found, n, self._bits, self._bits.shape[1], fast, fast.shape[1], kh, kany, out)
            if out is not lead:
                lead[...] = out
            return
        padded = np.zeros(n + 8 - n % 8, dtype=np.int64)  # row 0: empty
        padded[:n] = np.where(rows >= 0, rows, 0)
        bits = self._bits[padded]
        ut = np.unpackbits(np.ascontiguousarray(bits.view(np.uint8).T), axis=0, bitorder="little")
        held = plan.held(ut, workers)
        for j in range(lead.shape[1]):
            d_host = max(int(lead[1, j]), walk(held[1, j, :n], kh, int(lead[0, j])))
            d_any = max(int(lead[2, j]), walk(held[2, j, :n], kany, d_host))
            lead[1, j], lead[2, j] = d_host, d_any
            lead[3, j] = max(int(lead[3, j]), d_any)

    def _query_rows(self, keys: list[bytes]) -> np.ndarray:
        """The row of each of a request's keys, -1 where it is not indexed (the sparse walk's)."""
        return self._rows.find(keys)

    def _holdings(self, found: Rows, workers: np.ndarray | None = None, remote: bool = True) -> np.ndarray:
        """Per worker (all, or the plan indices given): how many leading keys of a request
        (``found``: :meth:`rows`' answer for its keys) it holds on its GPU (or speculatively),
        in GPU or host, in any of its own tiers, and in those or the ``remote`` tier (another
        node's host or disk, or the shared store: :meth:`_remote_groups`): a (4, workers)
        int64 array, ``d_gpu <= d_host <= d_disk <= d_remote`` (see the module docstring,
        Holdings). Without ``remote`` (pulls off), ``d_remote = d_disk``."""
        rows, m = found
        plan = self.plan()
        n_w = len(plan.workers) if workers is None else len(workers)
        if m == 0 or n_w == 0:
            return np.zeros((4, n_w), dtype=np.int64)
        tab = plan.byte_table() if plan.fast is not None else None
        if tab is not None and tab.shape[1] == self._bits.shape[1] * 2048:
            if _croute is not None:  # the same walk in C
                lead = np.empty((4, len(plan.workers)), dtype=np.int64)
                _croute.lead(rows, m, self._bits, self._bits.shape[1], plan.byte_table_rows(), len(plan.workers),
                             remote, lead)
                return lead if workers is None else lead[:, workers]
            # segments of equal rows as below; then each byte of a segment's row picks a
            # column of the plan's byte table (per tier, the workers whose test one of the
            # byte's set columns passes, as bit masks): their OR answers every worker and
            # tier for the segment at once. ANDed over the segments so far, a worker's bit
            # stays set while its run lasts: the count of set bits is the failing segment
            bits = self._bits.take(rows[:m + 2], axis=0)
            ne = np.not_equal(bits[1:], bits[:-1])
            wide = _WORD_VIEW.get(ne.shape[1])
            starts = (ne.view(wide).ravel() if wide is not None else ne.any(axis=1)).nonzero()[0]
            seg = bits[1:].take(starts, axis=0).view(np.uint8)
            got = np.bitwise_or.reduce(tab.take(seg + plan.byte_offsets, axis=1), axis=2)  # (4 x words, segments)
            alive = np.bitwise_and.accumulate(got, axis=1)
            runs = np.unpackbits(alive.view(np.uint8), axis=1, bitorder="little")
            runs = np.add.reduce(runs.reshape(tab.shape[0], starts.size, 64), axis=1, dtype=np.intp).reshape(4, -1)
            lead = starts.take(runs[:, :len(plan.workers)] if workers is None else runs[:, workers])
            if not remote:
                lead[3] = lead[2]
            return lead
        if plan.fast is not None and _croute is not None and (not remote or plan.rall):
            # each worker's columns, compiled (no byte table for this plan: too many columns and workers)
            lead = np.empty((4, len(plan.workers)), dtype=np.int64)
            _croute.lead_cols(rows, m, self._bits, self._bits.shape[1], plan.fast, plan.rsel, plan.rmask, remote,
                              lead)
            return lead if workers is None else lead[:, workers]
        if plan.fast is not None:
            # consecutive keys with equal rows are held alike, so the walk runs over the
            # segments of equal rows (a few per request), not over the keys. Around the known
            # prefix, row -1 (empty): before it, so the first key starts a segment (a live
            # row has the ALWAYS bit); after it, as the last segment, where every run ends
            bits = self._bits.take(rows[:m + 2], axis=0)
            starts = np.not_equal(bits[1:], bits[:-1]).any(axis=1).nonzero()[0]
            fast = plan.fast_flat if workers is None else plan.fast[:, workers].reshape(-1)
            n_seg = starts.size
            seg_rows = bits[1:][starts]
            # per worker and segment, the bits of its gpu, speculative 0 and 1, host and disk
            # columns (5, workers x segments); summed three, four and five at a time (one
            # small matrix product) they count the set columns of "on GPU", "on GPU or
            # host", "anywhere": a run ends at the first segment where the count is 0
            seg_bits = np.unpackbits(seg_rows.view(np.uint8), axis=1, bitorder="little")
            col = seg_bits.T.take(fast, axis=0).reshape(5, n_w * n_seg)
            held = np.empty((4, n_w, n_seg), dtype=np.float32)
            np.matmul(_TIER_SUMS, col, out=held[:3].reshape(3, n_w * n_seg))
            if remote:  # "anywhere" or in a remote mask the worker needs (one per worker here)
                if plan.rsingle >= 0:  # every worker needs the same mask (one model, one rank)
                    np.add(held[2], np.bitwise_and(seg_rows, plan.rmask[plan.rsingle]).any(axis=1), out=held[3])
                else:
                    far = (seg_rows[:, None, :] & plan.rmask).any(axis=2)  # (segments, masks)
                    rsel = plan.rsel if workers is None else plan.rsel[workers]
                    np.add(held[2], far.T[rsel], out=held[3])
            else:
                held[3] = held[2]
            return starts[held.argmin(axis=2)]
        return self._holdings_general(plan, rows, m, workers, n_w, remote)

    def _holdings_general(self, plan: _Plan, rows: np.ndarray, m: int, workers: np.ndarray | None, n_w: int,
                          remote: bool) -> np.ndarray:
        """:meth:`holdings` over the keys, for plans with tensor-parallel workers or nodes
        that declared none."""
        # the known prefix, then row 0 (empty) up to a multiple of 8 keys: the first key
        # not held is then always found, and the ORs can run eight keys at a time
        padded = np.zeros(m + 8 - m % 8, dtype=np.int64)
        padded[:m] = rows[1:m + 1]
        bits = self._bits[padded]
        far = (bits[:, None, :] & plan.rmask).any(axis=2).T if remote else None  # (masks, keys)
        # only workers with a column set in the first key can hold a leading block (any
        # worker, when a remote mask is set there)
        first = np.unpackbits(bits[0].view(np.uint8), bitorder="little").view(np.bool_)
        touched = plan.col_workers[first].any(axis=0)
        if far is not None and far[:, 0].any():
            touched[:] = True
        if workers is not None:
            touched = touched[workers]
        cand = np.flatnonzero(touched)
        lead = np.zeros((4, n_w), dtype=np.int64)
        if not cand.size:
            return lead
        pick = cand if workers is None else workers[cand]
        # bytes of each key's row as columns, then bits: ut[c, i] is column c of key i
        ut = np.unpackbits(np.ascontiguousarray(bits.view(np.uint8).T), axis=0, bitorder="little")
        held = plan.held(ut, pick)
        lead[:3, cand] = held.reshape(3 * cand.size, len(padded)).argmin(axis=1).reshape(3, cand.size)
        if far is None:
            lead[3] = lead[2]
        else:
            for j, w in enumerate(pick.tolist()):
                need = far[plan.rgroups[w]].all(axis=0)
                lead[3, cand[j]] = np.argmin(held[2, j] | need)
        return lead

    def sources(self, found: Rows, worker: int, start: int, end: int) -> list[tuple[str, int, int]]:
        """Where worker ``worker`` (a plan index) can fetch keys ``start:end`` of a request
        (``found``: :meth:`rows`' answer) from: ``[(node, i, j), ...]`` in key order, each
        part the longest run from its start that one other node holds in host or disk
        (equal runs: the first node by name), or ``"store"`` when only the shared store has
        it (a ``remote`` column of any node). Stops at the first key nobody else holds."""
        plan = self.plan()
        w = plan.workers[worker]
        view = self.nodes.get(w.node_id)
        if view is None or end <= start:
            return []
        fps = view.workers.get(w.name) or (None,)  # None: any fingerprint
        rows = found.rows[1 + start:1 + end]
        ub = np.unpackbits(self._bits.take(rows, axis=0).view(np.uint8), axis=1, bitorder="little")
        names, mats = plan.sources
        held = None
        for fp in fps:  # a key is held by a source when it holds every fingerprint the worker needs
            mat = mats.get(fp)
            if mat is None:
                return []
            h = np.matmul(ub, mat) > 0  # (keys, sources)
            held = h if held is None else held & h
        assert held is not None
        if w.node_id in names:
            held[:, names.index(w.node_id)] = False
        held = np.vstack([held, np.zeros((1, len(names)), dtype=bool)])  # every run ends
        out: list[tuple[str, int, int]] = []
        i, n = 0, end - start
        while i < n:
            runs = held[i:].argmin(axis=0)  # per source, its run of held keys from i
            best = int(runs.argmax())
            run = int(runs[best])
            if not run:
                break
            out.append((names[best], start + i, start + i + run))
            i += run
        return out

    # -- inspection -----------------------------------------------------------------------

    def locations(self, node_id: str | None = None,
                  speculative: bool = False) -> dict[tuple[str, str, str, bytes], set[bytes]]:
        """{(node, tier, worker, fingerprint): keys}, with ``speculative`` also {("",
        "speculative", worker, b""): keys} (slow; for tests and tools)."""
        out: dict[tuple[str, str, str, bytes], set[bytes]] = {}
        hw = self._high
        key = self._rows.key
        for loc, col in self._columns.items():
            if node_id is not None and loc[0] != node_id:
                continue
            hit = np.flatnonzero((self._bits[:hw, col >> 6] >> np.uint64(col & 63)) & np.uint64(1))
            if hit.size:
                out[loc] = {key(r) for r in hit.tolist()}
        if speculative:
            for worker, cols in self._spec_cols.items():
                for col in cols:
                    hit = np.flatnonzero((self._bits[:hw, col >> 6] >> np.uint64(col & 63)) & np.uint64(1))
                    if hit.size:
                        out.setdefault(("", "speculative", worker, b""), set()).update(key(r) for r in hit.tolist())
        return out

    # -- persistence ----------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """Everything but speculative entries, as arrays (``numpy.savez``-able), copies:
        ``meta`` (JSON: the format, locations and their columns, nodes and their positions,
        the rows given out), ``bits`` (the matrix's rows from row 0, the padding row, past the
        last row given out by at least the empty last row and a spare of 1/32, speculative
        and given-back columns cleared), ``free_rows`` (rows given back, to give out again)
        and the keys of those rows (``table_packed`` and, for keys of other lengths,
        ``table_odd_*``: :meth:`RowTable.arrays`). :meth:`load_state` takes them back as they
        are."""
        hw = self._high
        nrows = min(self._bits.shape[0], hw + 1 + (hw >> 5))  # the matrix's last row stays empty
        meta = {"format": STATE_FORMAT, "high": hw, "table_slots": len(self._rows.slots), **self._state_meta()}
        bits = self._bits[:nrows].copy()
        spec_mask = np.zeros(bits.shape[1], dtype=np.uint64)  # and the stale columns' (given back)
        for c in self._unsaved_columns():
            spec_mask[c >> 6] |= np.uint64(1 << (c & 63))
        if spec_mask.any():
            bits &= ~spec_mask
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), "bits": bits,
                  "free_rows": self._free[:self._nfree].copy()}
        arrays.update((f"table_{k}", a) for k, a in self._rows.arrays(nrows).items())
        return arrays

    def _state_meta(self) -> dict:
        """What every layout's state holds: the columns made, each location's column, the
        nodes and their positions."""
        cols = sorted(self._columns.items(), key=lambda kv: kv[1])
        return {
            "layout": self.layout,
            "ncols": self._ncols,
            "columns": [[n, t, w, fp.hex(), c] for (n, t, w, fp), c in cols],
            "nodes": {nid: {"epoch": v.epoch, "seq": v.seq, "load_gbps": v.load_gbps,
                            "capacity_bytes": v.capacity_bytes,
                            "workers": {w: [f.hex() for f in fps] for w, fps in v.workers.items()},
                            "fingerprints": sorted(f.hex() for f in v.fingerprints)}
                      for nid, v in self.nodes.items()},
        }

    def _unsaved_columns(self) -> list[int]:
        """The columns a state leaves out: speculative ones and those given back."""
        out = [c for pair in self._spec_cols.values() for c in pair]
        out.extend(self._stale_columns())
        return out

    def _stale_columns(self) -> list[int]:
        """The columns given back whose bits (pairs) are not cleared yet."""
        return [w * 64 + b for w, m in self._stale.items() for b in range(64) if m >> b & 1]

    @staticmethod
    def _read_meta(arrays: dict[str, np.ndarray], layout: str) -> tuple[dict, int, dict[tuple[str, str, str, bytes], int],
                                                                        dict[str, NodeView], int]:
        """(meta, format, columns, nodes, columns made) of a state of ``layout``; ValueError
        for one this index cannot take."""
        try:
            meta = json.loads(bytes(arrays["meta"]).decode())
            fmt = meta.get("format", 1)
            if fmt not in (1, STATE_FORMAT):
                raise ValueError(f"index state format {fmt!r} (this router reads 1 and {STATE_FORMAT})")
            got = meta.get("layout", "matrix")
            if got != layout:
                raise ValueError(f"index state of the {got!r} layout; this router's index is of the {layout!r} "
                                 f"layout (--index-layout)")
            columns = {(n, t, w, bytes.fromhex(fp_hex)): int(c) for n, t, w, fp_hex, c in meta["columns"]}
            nodes = {nid: NodeView(nid, v["epoch"], v["seq"],
                                   {w: tuple(bytes.fromhex(f) for f in fps) for w, fps in v["workers"].items()},
                                   {bytes.fromhex(f) for f in v["fingerprints"]}, v["load_gbps"], v["capacity_bytes"])
                     for nid, v in meta["nodes"].items()}
            ncols = max([_FIRST_COLUMN, int(meta.get("ncols", 0)), *(c + 1 for c in columns.values())])
        except (TypeError, AttributeError) as e:  # JSON of another shape
            raise ValueError(f"index state metadata unreadable: {e}") from e
        if any(c < _FIRST_COLUMN for c in columns.values()):
            raise ValueError("index state names a reserved column")
        return meta, fmt, columns, nodes, ncols

    def _adopt_meta(self, columns: dict[tuple[str, str, str, bytes], int], nodes: dict[str, NodeView],
                    ncols: int) -> None:
        """Take a state's columns and nodes (after :meth:`clear`); the columns no location uses
        are free (a state holds no bit of them)."""
        self._columns = columns
        self._ncols = ncols
        used = set(columns.values())
        self._free_cols = [c for c in range(_FIRST_COLUMN, ncols) if c not in used]
        self.nodes = nodes
        self._plan = None

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace everything with a :meth:`state` (speculative entries start empty). Its matrix
        and packed keys are taken as they are where writable (a snapshot's views: no copy),
        and the key table's slots built over them in one pass (:meth:`RowTable.restore`). A
        state of the earlier format (``key_lengths``, ``key_bytes`` and the live rows' bits,
        rows numbered from 1 in that order) is copied into a new matrix and table. Raises
        ValueError (or KeyError for a missing array) for a state this index cannot take, and
        then changes nothing."""
        meta, fmt, columns, nodes, ncols = self._read_meta(arrays, self.layout)
        try:
            high = int(meta.get("high", 0))
            slots = int(meta.get("table_slots", 0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"index state metadata unreadable: {e}") from e
        bits = arrays["bits"]
        if bits.dtype != np.uint64 or bits.ndim != 2 or (fmt != 1 and bits.shape[1] * 64 < ncols):
            raise ValueError(f"index state bits of dtype {bits.dtype} and shape {bits.shape} for {ncols} columns")
        if fmt == 1:
            bits, table, high, free = self._rebuilt(arrays, bits, (ncols + 63) // 64)
        else:
            free = np.array(arrays["free_rows"], dtype=np.int64)  # (a few: a copy frees the snapshot sooner)
            if not 1 <= high < len(bits) or (free.size and (free.min() < 1 or free.max() >= high)):
                raise ValueError(f"index state rows: {high} given out of {len(bits)}, free rows outside them")
            odd: dict[int, bytes] = {}
            if "table_odd_rows" in arrays:
                odd_rows = arrays["table_odd_rows"].tolist()
                ends = np.cumsum(arrays["table_odd_lengths"].astype(np.int64)).tolist()
                blob = arrays["table_odd_bytes"].tobytes()
                if len(ends) != len(odd_rows) or (ends and ends[-1] != len(blob)):
                    raise ValueError("index state: odd keys do not match their lengths")
                odd = {r: blob[s:e] for r, s, e in zip(odd_rows, [0, *ends[:-1]], ends, strict=True)}
            if len(arrays["table_packed"]) != len(bits):
                raise ValueError(f"index state: {len(arrays['table_packed'])} keys' rows for {len(bits)} rows of bits")
            live = (bits[:, ALWAYS >> 6] & np.uint64(1 << (ALWAYS & 63))).astype(np.bool_)
            if live[high:].any() or live[0] or live[free].any():
                raise ValueError("index state: a live row outside the rows given out, or free")
            table = RowTable.restore(arrays["table_packed"], live, odd, slots)
            if not (bits.flags.writeable and bits.flags.c_contiguous):
                bits = np.array(bits, order="C")
        self.clear()
        self._adopt_meta(columns, nodes, ncols)
        self._bits, self._rows, self._high = bits, table, high
        self._free, self._nfree = free, len(free)

    @staticmethod
    def _rebuilt(arrays: dict[str, np.ndarray], bits: np.ndarray, words: int) -> tuple[np.ndarray, RowTable, int, np.ndarray]:
        """The matrix, key table, rows given out and free rows of a state of the earlier format
        (the live rows' keys, their lengths, their bits; rows numbered from 1 in that order)."""
        lengths = arrays["key_lengths"]
        blob = arrays["key_bytes"]
        n = len(lengths)
        if bits.shape[0] != n or blob.dtype != np.uint8 or blob.ndim != 1:
            raise ValueError(f"index state: {n} keys, {bits.shape[0]} rows of bits, key bytes {blob.dtype} {blob.shape}")
        cap = max(16, n + 2)  # row 0 (the padding) and the last: empty
        grown = np.zeros((cap, max(words, bits.shape[1])), dtype=np.uint64)
        grown[1:n + 1, :bits.shape[1]] = bits
        packed = np.zeros(cap, dtype=_KEY)
        live = np.zeros(cap, dtype=np.bool_)
        live[1:n + 1] = True
        odd: dict[int, bytes] = {}
        if n and bool((lengths == WIDTH).all()):
            if len(blob) != WIDTH * n:
                raise ValueError(f"index state: {len(blob)} key bytes for {n} keys of {WIDTH}")
            packed[1:n + 1] = np.ascontiguousarray(blob).view(_KEY)
        elif n:
            ends = np.cumsum(lengths.astype(np.int64)).tolist()
            if ends[-1] != len(blob):
                raise ValueError(f"index state: {len(blob)} key bytes, {ends[-1]} by their lengths")
            data = blob.tobytes()
            for r, s, e in zip(range(1, n + 1), [0, *ends[:-1]], ends, strict=True):
                if e - s == WIDTH:
                    packed[r] = np.frombuffer(data, dtype=_KEY, count=1, offset=s)[0]
                else:
                    odd[r] = data[s:e]
        return grown, RowTable.restore(packed, live, odd), n + 1, np.empty(0, dtype=np.int64)


@dataclass
class _Plan:
    """Per-worker column tables: a tier is held when all ``and_cols`` and any ``or_cols`` are set.

    ``fast`` (when every worker has one column per tier and no OR, the usual case) lists, for
    all workers at once, the columns gpu, speculative 0, speculative 1, host, disk (a
    worker holds a key in a tier when one of the tier's columns or a faster one is set).
    """

    workers: list[Worker]
    and_cols: dict[str, np.ndarray]   # tier -> (workers, F) columns, padded with ALWAYS
    or_cols: dict[str, np.ndarray]    # tier -> (workers, G) columns, padded with NEVER
    spec: np.ndarray                  # (workers, 2) speculative columns
    n_columns: int = 64               # columns of the bit matrix (a multiple of 64)
    rmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.uint64))  # remote masks
    rgroups: list[list[int]] = field(default_factory=list)  # per worker: the remote masks it needs
    sources: tuple[list[str], dict[bytes | None, np.ndarray]] = ([], {})  # LocationIndex._source_matrices
    fast: np.ndarray | None = None    # (5, workers) columns, or None
    fast_flat: np.ndarray | None = None  # ``fast.ravel()``
    col_workers: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.bool_))
    _table: np.ndarray | None = None  # byte_table(), once built (empty: none for this plan)
    _table_rows: np.ndarray | None = None  # byte_table_rows(), once built (empty: none)
    byte_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        simple = all(self.and_cols[t].shape[1] == 1 and self.or_cols[t].shape[1] == 1
                     and bool((self.or_cols[t] == ALWAYS).all()) for t in TIER_LABELS)
        if simple:
            self.fast = np.stack([self.and_cols[_GPU][:, 0], self.spec[:, 0], self.spec[:, 1],
                                  self.and_cols["host"][:, 0], self.and_cols["disk"][:, 0]])
            self.fast_flat = self.fast.ravel()
        # the remote mask each worker needs (one each on the fast path), and whether all share one
        self.rsel = np.asarray([g[0] if len(g) == 1 else -1 for g in self.rgroups], dtype=np.int64)
        self.rsingle = int(self.rsel[0]) if self.rsel.size and (self.rsel == self.rsel[0]).all() else -1
        self.rall = bool((self.rsel >= 0).all())  # every worker has its one remote mask
        # col_workers[c, w]: column c is one of worker w's (a worker whose columns are all
        # clear in a request's first key holds no leading block of it)
        n_w = len(self.workers)
        cw = np.zeros((self.n_columns, n_w), dtype=np.bool_)
        if n_w:
            cols = np.concatenate([self.spec.reshape(n_w, -1), *(self.and_cols[t].reshape(n_w, -1) for t in TIER_LABELS),
                                   *(self.or_cols[t].reshape(n_w, -1) for t in TIER_LABELS)], axis=1)
            cw[cols, np.arange(n_w)[:, None]] = True
            cw[[ALWAYS, NEVER]] = False
        self.col_workers = cw

    def byte_table(self) -> np.ndarray | None:
        """For the fast plan: ``table[256 * b + v]`` is, for byte ``b`` of a row holding the
        value ``v``, the (4, words) uint64 bit masks of the workers whose tier tests (on
        GPU, in GPU or host, anywhere of its own, or also in its remote mask) one of the
        columns set in that byte passes; stored transposed, ``(4 * words, bytes * 256)``,
        where a worker is bit ``w`` of each tier's words. None when the plan is not fast or the
        table would exceed ``_TABLE_LIMIT`` bytes (many columns and workers). Built once."""
        if self._table is None:
            rows = self.byte_table_rows()
            self._table = np.zeros((0, 0), dtype=np.uint64) if rows is None else np.ascontiguousarray(rows.T)
        return self._table if self._table.size else None

    def decide_workers(self, weights: np.ndarray, digests: np.ndarray) -> np.ndarray:
        """The per-worker arrays of :meth:`LocationIndex.decide` in one uint64 buffer of 7 x
        workers: the scorer's (4, workers) float64 ``weights``, the tie ``digests``, each
        worker's speculative column of generation 0, then of 1."""
        n_w = len(self.workers)
        out = np.empty(7 * n_w, dtype=np.uint64)
        out[:4 * n_w] = np.ascontiguousarray(weights, dtype=np.float64).reshape(-1).view(np.uint64)
        out[4 * n_w:5 * n_w] = digests
        out[5 * n_w:6 * n_w] = self.spec[:, 0]
        out[6 * n_w:] = self.spec[:, 1]
        return out

    def byte_table_rows(self) -> np.ndarray | None:
        """:meth:`byte_table` transposed, ``(bytes * 256, 4 * words)``: a byte value's masks of
        every tier side by side, one cache line for up to 64 workers (the compiled walk's
        layout). Built once."""
        if self._table_rows is None:
            self._table_rows = self._build_table()
        return self._table_rows if self._table_rows.size else None

    def _build_table(self) -> np.ndarray:
        """The byte table in :meth:`byte_table_rows`' layout (empty: none for this plan)."""
        n_w, ncols = len(self.workers), self.n_columns
        words = (n_w + 63) // 64
        if self.fast is None or ncols * 256 // 8 * 4 * max(words, 1) * 8 > _TABLE_LIMIT or not n_w:
            return np.zeros((0, 0), dtype=np.uint64)
        contrib = np.zeros((ncols, 4, words * 64), dtype=np.bool_)  # column -> (tier, worker)
        ws = np.arange(n_w)
        for k, tiers in enumerate(((0, 1, 2, 3),) * 3 + ((1, 2, 3), (2, 3))):  # gpu, spec 0, 1, host, disk
            contrib[self.fast[k][:, None], np.asarray(tiers)[None, :], ws[:, None]] = True
        # the remote mask each worker needs: its columns count for the worker's remote test
        rbits = np.unpackbits(self.rmask.view(np.uint8), axis=1, bitorder="little").view(np.bool_)  # (masks, cols)
        need = np.zeros((n_w, ncols), dtype=np.bool_)
        have = self.rsel >= 0
        need[have] = rbits[self.rsel[have], :ncols]
        contrib[:, 3, :n_w] |= need.T
        packed = np.packbits(contrib, axis=2, bitorder="little").view(np.uint64)  # (cols, 4, words)
        nbytes = ncols // 8
        packed = packed.reshape(nbytes, 8, 4 * words)
        # a value's masks: those of its lowest set bit OR those of the value without it, so
        # values 2^j .. 2^(j+1) - 1 are values 0 .. 2^j - 1 with bit j's column added
        table = np.zeros((nbytes, 256, 4 * words), dtype=np.uint64)
        for j in range(8):
            np.bitwise_or(table[:, :1 << j], packed[:, j][:, None, :], out=table[:, 1 << j:2 << j])
        self.byte_offsets = np.arange(nbytes, dtype=np.int64) * 256
        return table.reshape(nbytes * 256, 4 * words)

    def held(self, ut: np.ndarray, sel: np.ndarray | None) -> np.ndarray:
        """(3, workers, keys) bool from the request's bits ``ut`` (columns x keys, 0/1 bytes,
        keys a multiple of 8, padded with empty rows): held on GPU, in GPU or host, in any
        tier. The ORs run on the 0/1 bytes eight at a time (as uint64)."""
        m = ut.shape[1]
        if self.fast is not None:
            idx = self.fast if sel is None else self.fast[:, sel]
            w = idx.shape[1]
            g = ut[idx.ravel()].view(np.uint64).reshape(5, w, m // 8)
            gpu, s0, s1, host, disk = g
        else:
            w = len(self.workers) if sel is None else len(sel)
            gpu, host, disk = (self._tier(ut, t, sel).view(np.uint64) for t in TIER_LABELS)
            spec = self.spec if sel is None else self.spec[sel]
            s0, s1 = ut[spec[:, 0]].view(np.uint64), ut[spec[:, 1]].view(np.uint64)
        out = np.empty((3, w, m // 8), dtype=np.uint64)
        np.bitwise_or(gpu, s0, out=out[0])
        out[0] |= s1
        np.bitwise_or(out[0], host, out=out[1])
        np.bitwise_or(out[1], disk, out=out[2])
        return out.view(np.bool_).reshape(3, w, m)

    def _tier(self, ut: np.ndarray, tier: str, sel: np.ndarray | None) -> np.ndarray:
        a = self.and_cols[tier] if sel is None else self.and_cols[tier][sel]
        o = self.or_cols[tier] if sel is None else self.or_cols[tier][sel]
        m = ut.shape[1]
        held = ut[a.ravel()].view(np.bool_).reshape(*a.shape, m).all(axis=1)
        held &= ut[o.ravel()].view(np.bool_).reshape(*o.shape, m).any(axis=1)
        return held.view(np.uint8)


def _pad(lists: list[list[int]], fill: int) -> np.ndarray:
    width = max((len(x) for x in lists), default=1)
    return np.asarray([x + [fill] * (width - len(x)) for x in lists], dtype=np.int64).reshape(len(lists), width)



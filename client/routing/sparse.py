"""Sparse holdings of the deep tiers (host, disk): a bounded estimate of the leading run.

Keys are chained: a block's key names the block *and everything before it*, so a tier that
holds block ``i`` of a chain nearly always holds its prefix. The host and disk tiers hold one
to two orders of magnitude more blocks than the GPUs, so the router indexes them sparsely:
per (node, tier), of each stored event's keys (a *run*: consecutive blocks of one chain, in
chain order, as a put stores them) only the *sampled* ones are recorded, at the run's offsets
``0, k, 2k, ...`` and its last key (:func:`sample`; ``k`` is the tier's *stride*, 1 records
every key). A removed key's record goes; a cleared tier forgets its records.

The estimate (:func:`walk`)
    The leading run of a query chain held in a location is read off the recorded positions
    of the query: starting before position ``start`` (0, or where a denser tier's run ends),
    the walk steps from one recorded position to the next while the step is at most ``k``
    long; the estimate is one past the last position reached.

The bound
    Let ``L`` be the dense answer (blocks ``0 .. L-1`` of the query held, ``L`` not), ``E``
    the estimate, and let every stored event be one contiguous run of a chain.

    * ``E >= L - (k - 1)`` when holdings are prefix-closed (a tier never holds block ``j``
      of a chain without ``0 .. j-1``: no *holes*). A held block's prefix was never evicted
      since it was stored, so the run that stored position ``x < L`` still has its sample
      in ``[x - k + 1, x]`` recorded (a run's samples are ``k`` apart and start at its head,
      which the query shares): recorded positions below ``L`` start at 0, are at most ``k``
      apart, and the last is ``>= L - k``, so the walk reaches it.
    * ``E <= L`` then too, since no position ``>= L`` is held, so none is recorded.

    A hole (block ``i`` evicted while later blocks of its chain stay, as least-recently-used
    order does when a whole chain was used at once) lets the walk step over ``i`` unless
    ``i`` was recorded (its record goes, and a step across it is then longer than ``k``
    unless the records around it are close): ``E > L``. A block stored again after a hole,
    in a run that branches off the query's chain after it, can leave its window without a
    record on the query's chain: ``E < L - (k - 1)``. Both are measured, not bounded:
    ``tests/test_sparse_index.py`` (uniformly random evictions: about 13 % of queries above,
    under 0.1 % below the bound) and ``bench/fleet.py`` (the replay's own eviction on the
    three public traces).

    An event whose keys are not one contiguous run (blocks already held skipped in the middle,
    or several chains' demotions in one event) keeps ``E <= L`` as above but can leave more
    than ``k - 1`` blocks uncounted; the replay's hit-rate loss (``bench/fleet.py``) includes it.

Memory: the router's key table and bit matrix hold only recorded keys (:func:`sparsify`
drops the others from a feed message, sequence numbers unchanged, so the dense fold takes
it as it is), about ``1/k`` of a tier's blocks plus one per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvtier.proto import locations_pb2 as L
from kvtier.tiers.vocab import Tier

#: default strides per tier label (gpu is always dense); chosen from the replay's hit-rate
#: loss on the three public traces at 8 replicas (bench/fleet.py, docs/operations.md)
DEFAULT_STRIDES: dict[str, int] = {"host": 8, "disk": 16}

_SPARSE_TIERS = {int(Tier.HOST): "host", int(Tier.DISK): "disk"}


def parse_strides(text: str) -> str:
    """A router's ``index_strides`` setting: ``""`` (off: every key indexed), ``default`` (the
    measured :data:`DEFAULT_STRIDES`) or ``host=K,disk=K`` (either or both); the text, checked
    (raises ValueError)."""
    strides_of(text)
    return text.strip()


def strides_of(text: str) -> dict[str, int]:
    """The strides an ``index_strides`` setting names (see :func:`parse_strides`); {} when off."""
    text = text.strip()
    if not text or text in ("off", "1"):
        return {}
    if text == "default":
        return dict(DEFAULT_STRIDES)
    out: dict[str, int] = {}
    for part in text.split(","):
        tier, sep, k = part.strip().partition("=")
        if not sep or tier not in ("host", "disk") or not k.strip().isdigit() or int(k) < 1:
            raise ValueError(f"{part.strip()!r} is not host=K or disk=K (K >= 1); e.g. host=8,disk=16, or default")
        out[tier] = int(k)
    return {t: k for t, k in out.items() if k > 1}


def sample(keys: Sequence[bytes], stride: int) -> list[bytes]:
    """The recorded keys of one run: offsets ``0, stride, 2*stride, ...`` and the last."""
    n = len(keys)
    if stride <= 1 or n <= 2:
        return list(keys)
    out = list(keys[0:n:stride])
    if (n - 1) % stride:
        out.append(keys[n - 1])
    return out


def walk(held: np.ndarray, stride: int, start: int = 0) -> int:
    """The estimate: ``held`` (bool per query position: recorded in the location, or held
    exactly), walked from ``start - 1`` (positions before ``start`` are known held) in steps
    of at most ``stride``; one past the last position reached."""
    pos = np.flatnonzero(held[start:])
    if pos.size == 0:
        return start
    pos += start
    gaps = np.diff(pos, prepend=start - 1)
    bad = np.flatnonzero(gaps > stride)
    if bad.size == 0:
        return int(pos[-1]) + 1
    return int(pos[bad[0] - 1]) + 1 if bad[0] else start


def sparsify(reply: L.WatchLocationsReply, strides: Mapping[str, int] = DEFAULT_STRIDES) -> L.WatchLocationsReply:
    """A feed message as the sparse router folds it: each host/disk stored event (and snapshot
    entry) keeps only its sampled keys; everything else, sequence numbers included, as it is.
    The message itself is returned when nothing is dropped."""
    body = reply.WhichOneof("body")
    if body == "events":
        events = reply.events.events
    elif body == "snapshot":
        events = reply.snapshot.entries
    else:
        return reply
    if not any(ev.kind == L.STORED and strides.get(_SPARSE_TIERS.get(ev.tier, ""), 1) > 1 and len(ev.keys) > 2
               for ev in events):
        return reply
    out = L.WatchLocationsReply()
    out.CopyFrom(reply)
    for ev in (out.events.events if body == "events" else out.snapshot.entries):
        k = strides.get(_SPARSE_TIERS.get(ev.tier, ""), 1)
        if ev.kind == L.STORED and k > 1 and len(ev.keys) > 2:
            kept = sample(list(ev.keys), k)
            del ev.keys[:]
            ev.keys.extend(kept)
    return out


class SparseHoldings:
    """Recorded keys of the host and disk tiers of many nodes, and the walk over them.

    A location is (node, tier label); each gets a bit; a key's value is the OR of the bits of
    the locations that recorded it. Fed with :meth:`fold` (a node's feed messages; gpu events
    and NodeInfo are not its business) or :meth:`stored` / :meth:`removed` / :meth:`cleared`."""

    def __init__(self, strides: Mapping[str, int] = DEFAULT_STRIDES) -> None:
        self.strides = dict(strides)
        self._keys: dict[bytes, int] = {}
        self._bit: dict[tuple[str, str], int] = {}
        self.records = 0  # (key, location) pairs recorded

    def bit(self, node: str, tier: str) -> int:
        b = self._bit.get((node, tier))
        if b is None:
            b = self._bit[(node, tier)] = 1 << len(self._bit)
        return b

    def stored(self, node: str, tier: str, keys: Sequence[bytes]) -> None:
        b, table = self.bit(node, tier), self._keys
        for key in sample(keys, self.strides.get(tier, 1)):
            old = table.get(key, 0)
            if not old & b:
                table[key] = old | b
                self.records += 1

    def removed(self, node: str, tier: str, keys: Iterable[bytes]) -> None:
        b, table = self.bit(node, tier), self._keys
        for key in keys:
            old = table.get(key, 0)
            if old & b:
                self.records -= 1
                if old == b:
                    del table[key]
                else:
                    table[key] = old & ~b

    def cleared(self, node: str, tier: str) -> None:
        b, table = self.bit(node, tier), self._keys
        for key in [k for k, v in table.items() if v & b]:
            self.removed(node, tier, (key,))

    def fold(self, node: str, reply: L.WatchLocationsReply) -> None:
        """One message of ``node``'s feed: its host and disk events (a first snapshot part
        forgets the node's records)."""
        body = reply.WhichOneof("body")
        if body == "snapshot":
            if reply.snapshot.first:
                for tier in ("host", "disk"):
                    self.cleared(node, tier)
            events: Iterable[L.LocationEvent] = reply.snapshot.entries
        elif body == "events":
            events = reply.events.events
        else:
            return
        for ev in events:
            tier = _SPARSE_TIERS.get(ev.tier)
            if tier is None:
                continue
            if ev.kind == L.STORED:
                self.stored(node, tier, ev.keys)
            elif ev.kind == L.REMOVED:
                self.removed(node, tier, ev.keys)
            elif ev.kind == L.CLEARED:
                self.cleared(node, tier)

    def masks(self, keys: Sequence[bytes]) -> np.ndarray:
        """Per query position, the locations that recorded its key (bit masks: int64 for up
        to 63 locations, Python integers beyond)."""
        get = self._keys.get
        if len(self._bit) < 64:
            return np.fromiter((get(k, 0) for k in keys), dtype=np.int64, count=len(keys))
        out = np.empty(len(keys), dtype=object)
        out[:] = [get(k, 0) for k in keys]
        return out

    def lead(self, keys: Sequence[bytes], node: str, tier: str, start: int = 0,
             masks: np.ndarray | None = None) -> int:
        """The estimated leading run of ``keys`` held in (node, tier), walking from ``start``."""
        m = self.masks(keys) if masks is None else masks
        b = self._bit.get((node, tier))
        if b is None:
            return start
        return walk((m & b) != 0, self.strides.get(tier, 1), start)

    def extend(self, keys: Sequence[bytes], node: str, d_gpu: int, masks: np.ndarray | None = None) -> tuple[int, int]:
        """(held in gpu or host, held in any tier) of the node's worker whose dense gpu run is
        ``d_gpu``: the host walk from ``d_gpu``, then the walk over host and disk records from
        there (steps up to the larger stride)."""
        m = self.masks(keys) if masks is None else masks
        bh, bd = self._bit.get((node, "host"), 0), self._bit.get((node, "disk"), 0)
        kh, kd = self.strides.get("host", 1), self.strides.get("disk", 1)
        d_host = walk((m & bh) != 0, kh, d_gpu) if bh else d_gpu
        d_any = walk((m & (bh | bd)) != 0, max(kh, kd), d_host) if bh | bd else d_host
        return d_host, d_any

    def __len__(self) -> int:
        return len(self._keys)

"""The host tier's id map: packed block id -> slot ref (``class index << 32 | slot``).

:attr:`HostTier.entries` is one. Compiled (``tiers/_idmap.c``, the extension
``kvtier.tiers._idmap`` that ``pip install`` builds) it holds no Python object per id: each size
class keeps a record per slot (a length byte and the id, as long as the class's longest id) and
an open-addressing table of 8-byte entries points at the records, about 50 bytes per held
32-byte id where a dict of bytes to ints costs about 150. Without the
extension :class:`PyIdMap` is used: the same behaviour, a dict and a list of ids per class.

Contract (both):

* ``add_class(nslots) -> index``: a size class of ``nslots`` records; a ref is
  ``index << 32 | slot``, ``slot < nslots`` (``ValueError`` otherwise).
* ``m[id] = ref``: ``id`` (bytes, at most :data:`MAX_ID` bytes) is held at ``ref``. A ref holds
  one id: another id held at ``ref`` is dropped; ``id`` held at another ref moves.
* ``m[id]``, ``get``, ``in``, ``len``, ``del``, ``pop``, ``keys``/``values``/``items`` and
  iteration, as a dict's (iteration order is unspecified; any insertion or deletion during an
  iteration makes the iterator raise ``RuntimeError``).
* ``id_of(ref)``: the last id set at ``ref``, kept after it is deleted (the host order names a
  hidden entry by it until the policy pops it), None if none ever was.

Hashing is seeded per process (:func:`new_idmap`).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from typing import Any

try:  # the compiled map (tiers/_idmap.c, built by pip install); None: PyIdMap
    from kvtier.tiers import _idmap as _cidmap
except ImportError:  # pragma: no cover - exercised where no compiler is present
    _cidmap = None

COMPILED = _cidmap is not None
MAX_ID = 254
MAX_CLASSES = 0xFFFE
_SLOT = 0xFFFFFFFF
_END = object()


class PyIdMap:
    """The id map in Python (the compiled map's fallback; see the module docstring)."""

    __slots__ = ("_d", "_ids", "_version")

    def __init__(self, seed: int = 0) -> None:
        self._d: dict[bytes, int] = {}
        self._ids: list[list[bytes | None]] = []
        self._version = 0

    def add_class(self, nslots: int) -> int:
        if not 0 <= nslots <= _SLOT:
            raise ValueError(f"nslots {nslots}: 0 to 2**32 - 1")
        if len(self._ids) >= MAX_CLASSES:
            raise ValueError(f"at most {MAX_CLASSES} size classes")
        self._ids.append([None] * nslots)
        return len(self._ids) - 1

    def _ref(self, ref: int) -> tuple[list[bytes | None], int]:
        try:  # any integer (numpy's too), as the compiled map takes it
            ref = operator.index(ref)
        except TypeError:
            raise TypeError(f"refs are ints, not {type(ref).__name__}") from None
        cls, slot = ref >> 32, ref & _SLOT
        if ref < 0 or cls >= len(self._ids) or slot >= len(self._ids[cls]):
            raise ValueError(f"ref {ref} names no slot of a class of this map")
        return self._ids[cls], slot

    @staticmethod
    def _check(k: object) -> bytes:
        if not isinstance(k, bytes):
            raise TypeError(f"ids are bytes, not {type(k).__name__}")
        return k

    def __setitem__(self, k: bytes, ref: int) -> None:
        self._check(k)
        ids, slot = self._ref(ref)
        if len(k) > MAX_ID:
            raise ValueError(f"id of {len(k)} bytes; ids are at most {MAX_ID} bytes")
        d = self._d
        d.pop(k, None)  # held elsewhere: it moves
        old = ids[slot]
        if old is not None and d.get(old) == ref:
            del d[old]  # a ref holds one id
        ids[slot] = k
        d[k] = operator.index(ref)
        self._version += 1

    def __getitem__(self, k: bytes) -> int:
        return self._d[self._check(k)]

    def get(self, k: bytes, default: Any = None) -> Any:
        return self._d.get(self._check(k), default)

    def __contains__(self, k: object) -> bool:
        return self._check(k) in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __delitem__(self, k: bytes) -> None:
        del self._d[self._check(k)]
        self._version += 1

    _NONE = object()

    def pop(self, k: bytes, default: Any = _NONE) -> Any:
        d = self._d
        if self._check(k) in d:
            self._version += 1
            return d.pop(k)
        if default is PyIdMap._NONE:
            raise KeyError(k)
        return default

    def _walk(self, it: Iterator[Any]) -> Iterator[Any]:
        return self._guarded(it, self._version)  # the version now, not at the first next()

    def _guarded(self, it: Iterator[Any], v: int) -> Iterator[Any]:
        while True:
            if self._version != v:
                raise RuntimeError("IdMap changed during iteration")
            x = next(it, _END)
            if x is _END:
                return
            yield x

    def __iter__(self) -> Iterator[bytes]:
        return self._walk(iter(self._d))

    def keys(self) -> Iterator[bytes]:
        return iter(self)

    def values(self) -> Iterator[int]:
        return self._walk(iter(self._d.values()))

    def items(self) -> Iterator[tuple[bytes, int]]:
        return self._walk(iter(self._d.items()))

    def id_of(self, ref: int) -> bytes | None:
        ids, slot = self._ref(ref)
        return ids[slot]

    def nbytes(self) -> int:
        return 0  # Python objects: see tracemalloc


def new_idmap(compiled: bool | None = None) -> Any:
    """An empty id map: the compiled one when built (``compiled``: force one or the other)."""
    use_c = COMPILED if compiled is None else compiled
    seed = int.from_bytes(os.urandom(8), "little")
    if use_c:
        if _cidmap is None:
            raise RuntimeError("the compiled id map is not built (pip install the project)")
        return _cidmap.IdMap(seed)
    return PyIdMap(seed)

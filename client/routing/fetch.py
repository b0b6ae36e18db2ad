"""Fetch hints: what a routing decision asks the chosen worker to pull before its prefill.

When the router sends a request to a worker whose own tiers hold less of its prefix than
another node does (the holder is loaded, this worker is free), the cost counted the rest as
the ``remote`` tier: blocks the worker's daemon can fetch from a peer's host or disk, or from
the shared store. The decision then carries one :class:`FetchHint` per source, in key order:
the keys and the node that holds them (``"store"``: the shared store). The gateway or engine
in front of the worker applies them (:meth:`FetchHint.apply`, or :func:`apply_hints`)
before prefill, so the prefix is in the worker's host tier when the engine asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvtier.client.routing.index import LocationIndex

STORE = "store"
"""``FetchHint.from_node`` of blocks only the shared store holds."""


class _Prefetcher(Protocol):
    def prefetch(self, layout_id: int, keys: Sequence[bytes], *, from_node: str = ...) -> Any: ...


@dataclass(frozen=True)
class FetchHint:
    """Keys ``start:end`` of the request (``keys``), held by node ``from_node`` in host or
    disk (``"store"``: by the shared store), for worker ``worker`` to fetch."""

    worker: str
    from_node: str
    keys: tuple[bytes, ...]
    start: int = 0  # position of the first key in the request
    end: int = 0

    def apply(self, sidecar: _Prefetcher, layout_id: int) -> Any:
        """Ask the worker's daemon (through its sidecar) to fetch the keys into its host tier:
        ``sidecar.prefetch(layout_id, keys, from_node=...)``; returns what that returns."""
        return sidecar.prefetch(layout_id, list(self.keys), from_node=self.from_node)


def apply_hints(hints: Sequence[FetchHint], sidecar: _Prefetcher, layout_id: int) -> list[Any]:
    """Apply every hint of a decision, in key order."""
    return [h.apply(sidecar, layout_id) for h in hints]


def layout_id_of(fingerprint: bytes) -> int:
    """The layout id every kvtierd gives a layout of this fingerprint (its first 31 bits; the
    daemon's ``daemon/layouts.py`` rule, the same on every daemon and across restarts), so a
    caller that knows only the fingerprint (from the location feed) can name the layout."""
    return int.from_bytes(fingerprint[:4], "little") & 0x7FFFFFFF or 1


def hint_fingerprints(index: LocationIndex, hint: FetchHint) -> list[bytes]:
    """The layout fingerprints to fetch a hint's keys under, from what the feeds told the
    index (the caller holds the router's lock): the fingerprints the worker declared (one per
    tensor-parallel rank), else those its holder (``from_node``) publishes host or disk blocks
    under, narrowed to those the worker's own node publishes when that leaves any (for the
    store: the worker's node's, else every node's)."""
    w = index.worker(hint.worker)
    view = index.nodes.get(w.node_id) if w is not None and w.node_id else None
    if view is not None and view.workers.get(hint.worker):
        return list(view.workers[hint.worker])
    own = set(view.fingerprints) if view is not None else set()
    if hint.from_node == STORE:
        held = own or {fp for v in index.nodes.values() for fp in v.fingerprints}
    else:
        src = index.nodes.get(hint.from_node)
        held = set(src.fingerprints) if src is not None else set()
        held = (held & own) or held
    return sorted(held)


__all__ = ["STORE", "FetchHint", "apply_hints", "hint_fingerprints", "layout_id_of"]

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
from typing import Any, Protocol

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


__all__ = ["STORE", "FetchHint", "apply_hints"]

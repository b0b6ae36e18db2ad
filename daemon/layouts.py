"""The layouts registered on this daemon: one id per layout fingerprint."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.daemon.errors import Code, StoreError
from kvtier.tiers.layout import Layout


def layout_id_of(fingerprint: bytes) -> int:
    """A layout's id is its fingerprint's first 31 bits: the same on every daemon and across
    restarts, so a client that kept an id from before a restart can never reach another
    layout's blocks with it (it gets FAILED_PRECONDITION and registers again)."""
    return int.from_bytes(fingerprint[:4], "little") & 0x7FFFFFFF or 1


@dataclass(frozen=True)
class RegisteredLayout:
    layout_id: int
    layout: Layout


class Layouts:
    """Layout id -> layout, and fingerprint -> id."""

    def __init__(self) -> None:
        self._by_id: dict[int, RegisteredLayout] = {}
        self._by_fp: dict[bytes, int] = {}

    def __iter__(self) -> Iterator[RegisteredLayout]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def find(self, fingerprint: bytes) -> RegisteredLayout | None:
        lid = self._by_fp.get(fingerprint)
        return None if lid is None else self._by_id[lid]

    def add(self, layout: Layout) -> RegisteredLayout:
        """Register ``layout`` (or return its registration); refuses a fingerprint whose id is
        taken by another fingerprint."""
        fp = layout.fingerprint
        reg = self.find(fp)
        if reg is not None:
            return reg
        lid = layout_id_of(fp)
        other = self._by_id.get(lid)
        if other is not None:  # two fingerprints share 31 bits: refuse rather than mix them
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"layout id {lid} of fingerprint {fp.hex()} is taken by fingerprint "
                             f"{other.layout.fingerprint.hex()} on this daemon; restart it without one of them")
        reg = self._by_id[lid] = RegisteredLayout(lid, layout)
        self._by_fp[fp] = lid
        return reg

    def get(self, layout_id: int) -> RegisteredLayout:
        reg = self._by_id.get(layout_id)
        if reg is None:
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"layout_id {layout_id} is not registered on this daemon (it may have "
                             f"restarted): call RegisterLayout first")
        return reg

    def slot_bytes_of(self, fingerprint: bytes) -> int:
        """The slot size of the layout with this fingerprint (0 if none is registered)."""
        reg = self.find(fingerprint)
        return reg.layout.slot_bytes if reg is not None else 0

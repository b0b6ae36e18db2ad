"""Location observers: who is told of every change of what a tier holds.

The store (host and disk) and the gpu tier (:class:`~kvtier.daemon.device.DeviceTier`) report
every visibility change to :class:`Observers`, which tells each registered
:class:`LocationObserver` in turn, synchronously, on the event loop, right after the change
and before the request that caused it replies. The location log
(:mod:`kvtier.daemon.events`) and the key-table publisher (:mod:`kvtier.daemon.keytable`)
are the observers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvtier.tiers.vocab import Tier, group_by_fingerprint


class LocationObserver(Protocol):
    """Told of every visibility change, after it happens, on the event loop."""

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        """``keys`` became visible in ``tier`` (for gpu: on ``worker``)."""

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        """``keys`` are no longer in ``tier`` (for gpu: on ``worker``)."""

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        """``tier`` was emptied (for gpu: ``worker``'s blocks); ``gone`` says what it held
        (fingerprint -> keys) for observers that track keys."""

    def workers_changed(self) -> None:
        """The node's engine workers (or their layouts) changed."""


class Observers:
    """The fan-out: every call goes to each observer, in the order they were added."""

    def __init__(self) -> None:
        self._all: list[LocationObserver] = []

    def add(self, *observers: LocationObserver) -> None:
        self._all.extend(observers)

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        for obs in self._all:
            obs.stored(tier, fingerprint, keys, worker)

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        for obs in self._all:
            obs.removed(tier, fingerprint, keys, worker)

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        for obs in self._all:
            obs.cleared(tier, worker, gone)

    def workers_changed(self) -> None:
        for obs in self._all:
            obs.workers_changed()

    def stored_blocks(self, tier: Tier, packed: Iterable[bytes]) -> None:
        """:meth:`stored` once per fingerprint among packed block ids."""
        for fp, keys in group_by_fingerprint(list(packed)).items():
            self.stored(tier, fp, keys)

    def removed_blocks(self, tier: Tier, packed: Iterable[bytes]) -> None:
        """:meth:`removed` once per fingerprint among packed block ids."""
        for fp, keys in group_by_fingerprint(list(packed)).items():
            self.removed(tier, fp, keys)

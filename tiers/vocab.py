"""The words every part of kvtier shares: tiers, keys, and a block's identity.

Defined once here (``kvtier.tiers`` imports nothing of the daemon or client, so every part can
import this): the daemon (store, placement, gpu tier, services, metrics), the tiers (host,
disk, key table, placement policy) and ``kvtier report`` take their tiers, key limits and
block ids from it.

* :class:`Tier`: where a block lives, fastest first. Its values are the wire enum's
  (``kvtier.v1.Tier``: ``TIER_GPU = 1`` ...), so a conversion is ``Tier(msg.tier)``; its
  ``str()`` is the lowercase name used in metrics labels, JSON and reports.
* Keys: opaque bytes of :data:`KEY_MIN` to :data:`KEY_MAX`; :func:`key_problem` says why one
  is refused, :func:`check_keys` checks a batch.
* :class:`BlockId`: (layout fingerprint, key). A block is stored once per fingerprint (each
  tensor-parallel rank's shard is its own block); its packed form, :func:`BlockId.pack`, is the
  dictionary key the tiers use (``fingerprint + key``; the fingerprint is :data:`FP_BYTES`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

KEY_MIN, KEY_MAX = 8, 32
"""A key's length in bytes, inclusive."""

MAX_KEYS_PER_CALL = 65536
"""The most keys one request may name (lookups, puts, gets, routing)."""

FP_BYTES = 16
"""A layout fingerprint's length in bytes."""


class Tier(enum.IntEnum):
    """Where a block lives, fastest first; values are the wire enum's."""

    GPU = 1
    HOST = 2
    DISK = 3
    REMOTE = 4  # another node's daemon (a peer) or the shared store: never a daemon's own holding

    def __str__(self) -> str:
        return self.name.lower()

    @property
    def label(self) -> str:
        """The lowercase name: metric labels, JSON keys, reports."""
        return self.name.lower()

    @property
    def rank(self) -> int:
        """The position in :data:`TIERS` (0 for gpu, fastest first): an index into per-tier lists."""
        return self.value - 1

    @classmethod
    def parse(cls, name: str) -> Tier:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; tiers are {', '.join(TIER_LABELS)}") from None


TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.HOST, Tier.DISK)
"""The tiers a node holds itself (gpu, host, disk): key-table bits, per-tier columns, occupancy."""
TIER_LABELS: tuple[str, ...] = tuple(t.label for t in TIERS)
ALL_TIERS: tuple[Tier, ...] = tuple(Tier)
"""Every tier including ``remote`` (a peer or the shared store, reached over the network)."""


def key_problem(key: bytes) -> str | None:
    """Why ``key`` is not a valid key, or None."""
    if not isinstance(key, bytes | bytearray | memoryview):
        return f"a key is bytes, not {type(key).__name__}"
    if not KEY_MIN <= len(key) <= KEY_MAX:
        return f"{len(key)} bytes; keys are {KEY_MIN} to {KEY_MAX} bytes"
    return None


def check_keys(keys: list[bytes] | tuple[bytes, ...]) -> None:
    """Raise ValueError naming the first bad key (or too many keys)."""
    if len(keys) > MAX_KEYS_PER_CALL:
        raise ValueError(f"{len(keys)} keys; at most {MAX_KEYS_PER_CALL} per call")
    for i, k in enumerate(keys):
        why = key_problem(k)
        if why is not None:
            raise ValueError(f"key {i} is {why}" if why[0].isdigit() else f"key {i}: {why}")


class BlockId(NamedTuple):
    """A stored block: its layout fingerprint and its key."""

    fingerprint: bytes
    key: bytes

    def pack(self) -> bytes:
        return self.fingerprint + self.key

    @classmethod
    def unpack(cls, packed: bytes) -> BlockId:
        return cls(packed[:FP_BYTES], packed[FP_BYTES:])


def pack_block(fingerprint: bytes, key: bytes) -> bytes:
    """The packed id of (fingerprint, key): what the tiers key their entries by."""
    return fingerprint + key


def fingerprint_of(packed: bytes) -> bytes:
    return packed[:FP_BYTES]


def key_of(packed: bytes) -> bytes:
    return packed[FP_BYTES:]


def group_by_fingerprint(packed: list[bytes]) -> dict[bytes, list[bytes]]:
    """Packed ids grouped by fingerprint, keys in the order given."""
    out: dict[bytes, list[bytes]] = {}
    for b in packed:
        out.setdefault(b[:FP_BYTES], []).append(b[FP_BYTES:])
    return out


__all__ = ["BlockId", "FP_BYTES", "KEY_MAX", "KEY_MIN", "MAX_KEYS_PER_CALL", "TIERS", "TIER_LABELS", "Tier",
           "check_keys", "fingerprint_of", "group_by_fingerprint", "key_of", "key_problem", "pack_block"]

"""What the processes of ``kvtier gateway --workers N`` share: the replica each session, and (policy
``prefix``) each block key, was last sent to.

A :class:`SharedMap` is a direct-mapped table in anonymous shared memory, made before the
workers are forked: slot ``h mod slots`` of a key's 64-bit hash ``h`` holds one 64-bit word,
the hash's high 32 bits (the tag) beside a 32-bit hash of the replica's name, written and read
whole (an aligned 8-byte store), and the time it was written (seconds, for the TTL). A worker
reads what any worker wrote, so a session's requests go to one replica whichever process the
kernel hands their connections to. A key whose slot another key took since is simply not found
(a new session then, as after an expiry): the table is sized at four slots a session, so that
stays rare. Same interface as :class:`~kvtier.client.gateway.policy.LruMap`.
"""

from __future__ import annotations

import hashlib
import mmap
import time
import zlib
from collections.abc import Iterable

import numpy as np


def _hash64(key: str | bytes) -> int:
    if isinstance(key, str):
        key = key.encode(errors="surrogatepass")
    if len(key) >= 16:  # a block key: a hash already
        return int.from_bytes(key[:8], "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def name_hash(name: str) -> int:
    return zlib.crc32(name.encode()) or 1


class SharedMap:
    """key -> replica name, in memory shared with forked processes (module docstring)."""

    def __init__(self, max_items: int, ttl_s: float = 0.0, slots_per_item: int = 4) -> None:
        slots = 1
        while slots < max(1, max_items) * slots_per_item:
            slots <<= 1
        self.slots, self.ttl_s = slots, ttl_s
        self._mm = mmap.mmap(-1, slots * 12)  # anonymous and MAP_SHARED: forked workers see one table
        self._words = np.frombuffer(self._mm, dtype=np.uint64, count=slots)
        self._times = np.frombuffer(self._mm, dtype=np.uint32, count=slots, offset=slots * 8)
        self._names: dict[int, str] = {}
        self._epoch = time.time()

    def know(self, names: Iterable[str]) -> None:
        """Replica names a value may be (a value is kept as its name's hash)."""
        for n in names:
            self._names.setdefault(name_hash(n), n)

    def _slot(self, key: str | bytes) -> tuple[int, int]:
        h = _hash64(key)
        return h & (self.slots - 1), (h >> 32) | 1

    def get(self, key: str | bytes, now: float | None = None) -> str | None:
        i, tag = self._slot(key)
        word = int(self._words[i])
        if word >> 32 != tag:
            return None
        if self.ttl_s and time.time() - self._epoch - int(self._times[i]) > self.ttl_s:
            return None
        return self._names.get(word & 0xFFFFFFFF)

    def put(self, key: str | bytes, value: str, now: float | None = None) -> None:
        i, tag = self._slot(key)
        h = name_hash(value)
        self._names.setdefault(h, value)
        self._times[i] = int(time.time() - self._epoch)
        self._words[i] = (tag << 32) | h

    def __len__(self) -> int:
        return int(np.count_nonzero(self._words))

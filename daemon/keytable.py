"""The daemon's publisher of the shared-memory key table (format: ``kvtier.tiers.keytable``).

:class:`KeyTablePublisher` is a :class:`~kvtier.daemon.observers.LocationObserver`: the
store calls it synchronously, on the event loop, after every visibility change and before
the RPC that caused it replies. So a block committed by a put is in the table before the put
returns, and a block evicted from the host tier leaves the table before its slot is
handed to anyone else.

The table is node-wide: a key's gpu bit is set while some engine worker on this node holds
the block on device (:class:`~kvtier.daemon.device.DeviceTier`), and cleared when the last
one no longer does.

The table starts from what the store already holds (:meth:`BlockStore.holdings`: blocks a
disk tier restored at start), then follows the events.

Owns
    * the table file ``<shm-dir>/<name>.keys`` (mode 0400: clients map it read-only); it is
      removed on :meth:`close` (daemon shutdown) after being marked closed, so clients that
      still map it fall back to the Lookup RPC;
    * the heartbeat task, which refreshes the header every ``HEARTBEAT_S`` so a client can
      tell a live table from one whose daemon was killed;
    * sizing: when a layout's first block arrives, the table is presized for the most blocks
      of that slot size the tiers can hold (sum of tier capacities over the slot size).

Promises
    The table never shows a key in a tier that the store does not hold it in. If the
    table cannot be kept exact (no memory for a rebuild, the layout directory is full),
    it is marked invalid, readers fall back to the RPC, and the error is logged and
    counted (``key_table_errors``); the store's operation itself still succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from kvtier.daemon.counters import Count
from kvtier.daemon.store import BlockStore
from kvtier.tiers.keytable import HEARTBEAT_S, KeyTableError, KeyTableWriter
from kvtier.tiers.vocab import Tier

log = logging.getLogger("kvtier.keytable")


class KeyTablePublisher:
    """Folds the store's location events into the shared-memory key table."""

    def __init__(self, store: BlockStore, shm_dir: str, name: str, epoch: int,
                 capacity_bytes: Callable[[], int]) -> None:
        self.store = store
        self.path = os.path.join(shm_dir, f"{name}.keys")
        self.capacity_bytes = capacity_bytes
        self.writer = KeyTableWriter(self.path, epoch)
        self.valid = True
        self._heartbeat: asyncio.Task | None = None
        for tier, fingerprint, keys in store.holdings():  # e.g. blocks restored from disk
            self.stored(tier, fingerprint, keys)

    # -- LocationObserver ----------------------------------------------------------------

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if self.valid:
            self._guard(self._stored, tier, fingerprint, keys)

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if tier is Tier.GPU:  # the bit stays while another worker holds the block
            keys = [k for k in keys if not self.store.device.holds(fingerprint, k)]
        if self.valid:
            self._guard(self.writer.clear, fingerprint, keys, tier)

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        if tier is Tier.GPU:  # one worker's blocks: the others' stay
            for fp, keys in (gone or {}).items():
                self.removed(tier, fp, keys, worker)
        elif self.valid:
            self._guard(self.writer.clear_tier, tier)

    def workers_changed(self) -> None:
        pass

    def _stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        if not self.writer.tag(fingerprint, create=False):
            self._presize(fingerprint)
        self.writer.set(fingerprint, keys, tier)

    def _presize(self, fingerprint: bytes) -> None:
        slot_bytes = self.store.layouts.slot_bytes_of(fingerprint)
        if slot_bytes:
            self.writer.reserve(self.capacity_bytes() // slot_bytes)

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except (OSError, KeyTableError, ValueError) as e:
            self._give_up(e)

    def _give_up(self, err: Exception) -> None:
        self.valid = False
        self.store.counters.add(Count.KEY_TABLE_ERRORS)
        log.error("key table %s can no longer be kept exact; clients fall back to the Lookup RPC: %s",
                  self.path, err)
        with contextlib.suppress(Exception):
            self.writer.invalidate()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat (on the running event loop)."""
        self.writer.heartbeat()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            self.writer.heartbeat()
            await asyncio.sleep(HEARTBEAT_S)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        self.writer.close()

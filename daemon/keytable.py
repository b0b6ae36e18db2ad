"""The daemon's publisher of the shared-memory key table (format: ``kvtier.tiers.keytable``).

:class:`KeyTablePublisher` is a :class:`~kvtier.daemon.observers.LocationObserver`: the
store calls it synchronously, on the event loop, after every visibility change and before
the RPC that caused it replies. So a block committed by a put is in the table before the put
returns, and a block evicted from the host tier leaves the table before its slot is
handed to anyone else.

Tenants: each tenant has its own table (:class:`TenantKeyTable`), holding only the blocks
of layouts that tenant registered, under the layouts' own fingerprints;
``RegisterLayoutReply.key_table_path`` names the caller's tenant's table
(:attr:`BlockStore.key_table_paths`). :class:`KeyTablePublisher` is the default tenant's
table and hands each change to its tenant's table; another tenant's table is made when that
tenant registers its first layout.

A key's gpu bit is set while some engine worker of the tenant on this node holds the block
on device (:class:`~kvtier.daemon.device.DeviceTier`), and cleared when the last one no
longer does.

A table starts from what the store already holds under each of its tenant's layouts
(:meth:`BlockStore.holdings`: blocks a disk tier restored at start) when the layout is
registered, then follows the events.

Owns
    * the table files ``<shm-dir>/<name>.keys`` (the default tenant's) and
      ``<shm-dir>/<name>-<group>.keys`` (another tenant's, ``group`` as its pool files have
      it), mode 0400: clients map them read-only; they are removed on :meth:`close` (daemon
      shutdown) after being marked closed, so clients that still map them fall back to the
      Lookup RPC;
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

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.counters import Count
from kvtier.daemon.layouts import RegisteredLayout
from kvtier.daemon.store import BlockStore
from kvtier.tiers.keytable import HEARTBEAT_S, KeyTableError, KeyTableWriter
from kvtier.tiers.vocab import Tier

log = logging.getLogger("kvtier.keytable")


class TenantKeyTable:
    """One tenant's key table: the layouts' own fingerprints, the tenant's blocks only."""

    def __init__(self, store: BlockStore, path: str, epoch: int, capacity_bytes: Callable[[], int]) -> None:
        self.store = store
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.writer = KeyTableWriter(self.path, epoch)
        self.valid = True

    # -- the tenant's changes (reg: the registration of the layout they are under) -------

    def _on_stored(self, tier: Tier, reg: RegisteredLayout, keys: Sequence[bytes]) -> None:
        if self.valid:
            self._guard(self._stored, tier, reg, keys)

    def _on_removed(self, tier: Tier, reg: RegisteredLayout, keys: Sequence[bytes]) -> None:
        if tier is Tier.GPU:  # the bit stays while another worker holds the block
            keys = [k for k in keys if not self.store.device.holds(reg.fingerprint, k)]
        if self.valid:
            self._guard(self.writer.clear, reg.wire_fingerprint, keys, tier)

    def _on_cleared_tier(self, tier: Tier) -> None:
        if self.valid:
            self._guard(self.writer.clear_tier, tier)

    def _stored(self, tier: Tier, reg: RegisteredLayout, keys: Sequence[bytes]) -> None:
        fingerprint = reg.wire_fingerprint
        if not self.writer.tag(fingerprint, create=False):
            self.writer.reserve(self.capacity_bytes() // reg.layout.slot_bytes)
        self.writer.set(fingerprint, keys, tier)

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


class KeyTablePublisher(TenantKeyTable):
    """The default tenant's key table, and the
    :class:`~kvtier.daemon.observers.LocationObserver` that folds each change into its
    tenant's table (see the module docstring)."""

    def __init__(self, store: BlockStore, shm_dir: str, name: str, epoch: int,
                 capacity_bytes: Callable[[], int]) -> None:
        super().__init__(store, os.path.join(shm_dir, f"{name}.keys"), epoch, capacity_bytes)
        self.shm_dir = shm_dir
        self.name = name
        self.epoch = epoch
        self.tables: dict[str, TenantKeyTable] = {DEFAULT_TENANT: self}
        self._heartbeat: asyncio.Task | None = None
        store.key_table_paths[DEFAULT_TENANT] = self.path
        store.layout_hooks.append(self._layout_registered)
        for reg in store.layouts:   # registered before this publisher was made
            self._layout_registered(reg)

    def _table(self, tenant: str) -> TenantKeyTable | None:
        """The tenant's table, made on its first layout; None if it cannot be made (its
        clients then ask the daemon: the reply names no table)."""
        table = self.tables.get(tenant)
        if table is None:
            path = os.path.join(self.shm_dir, f"{self.name}-{self.store.layouts.group(tenant)}.keys")
            try:
                table = TenantKeyTable(self.store, path, self.epoch, self.capacity_bytes)
            except OSError as e:
                self.store.counters.add(Count.KEY_TABLE_ERRORS)
                log.error("cannot create a tenant's key table %s; its clients use the Lookup RPC: %s", path, e)
                return None
            self.tables[tenant] = table
            self.store.key_table_paths[tenant] = path
            if self._heartbeat is not None:
                table.writer.heartbeat()
        return table

    def _layout_registered(self, reg: RegisteredLayout) -> None:
        """A tenant registered a layout: what the tiers already hold under it (e.g. blocks
        restored from disk) enters the tenant's table now."""
        table = self._table(reg.tenant)
        if table is None:
            return
        for tier, _, keys in self.store.holdings(None, reg.fingerprint):
            if tier is not Tier.REMOTE:
                table._on_stored(tier, reg, keys)

    def _route(self, fingerprint: bytes) -> tuple[TenantKeyTable, RegisteredLayout] | None:
        reg = self.store.layouts.find(fingerprint)
        if reg is None:  # nobody registered it since the start: written when registered
            return None
        table = self.tables.get(reg.tenant)
        return None if table is None else (table, reg)

    # -- LocationObserver ----------------------------------------------------------------

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if tier is Tier.REMOTE:  # not this node's holding: the table has no bit for it
            return
        to = self._route(fingerprint)
        if to is not None:
            to[0]._on_stored(tier, to[1], keys)

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        if tier is Tier.REMOTE:
            return
        to = self._route(fingerprint)
        if to is not None:
            to[0]._on_removed(tier, to[1], keys)

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        if tier is Tier.REMOTE:
            return
        if tier is Tier.GPU:  # one worker's blocks: the others' stay
            for fp, keys in (gone or {}).items():
                self.removed(tier, fp, keys, worker)
            return
        for table in list(self.tables.values()):
            table._on_cleared_tier(tier)

    def workers_changed(self) -> None:
        pass

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat of every table (on the running event loop)."""
        for table in self.tables.values():
            table.writer.heartbeat()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            for table in list(self.tables.values()):
                table.writer.heartbeat()
            await asyncio.sleep(HEARTBEAT_S)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for table in self.tables.values():
            table.writer.close()

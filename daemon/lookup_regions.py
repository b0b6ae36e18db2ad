"""Clients' lookup counters regions, folded into the store's lookup counters.

A local client counts the lookups it answers from the key table in a region of shared memory
(:mod:`kvtier.tiers.lookup_counts`) that it hands the daemon over its credential connection
(``{"op": "lookup_counters"}``, :mod:`kvtier.daemon.credentials`), once per connection.
:class:`LookupRegions` keeps each region mapped read-only under that connection's token and
folds what it counted since the last read into the store's lookup counters, as lookups of
the caller's tenant (a slot naming a layout its tenant did not register counts nothing):

* whenever the counters are read: each Stats snapshot, so each Stats reply, ``/metrics``
  scrape and ``kvtier report`` row includes every lookup counted before it;
* every :data:`FOLD_S` seconds (:meth:`run`), so the counters keep moving between reads;
* one last time when the credential connection closes (the client closed, exited without
  closing, or was killed: the kernel closes its sockets), before the region is unmapped.

So nothing a client counted is lost. Each read of a region counts at most
:data:`MAX_FOLDED_LOOKUPS` lookups (the bound of one ReportLookups), and counters that go down
count nothing: a hostile region cannot overflow anything, nor fail a Stats reply.
"""

from __future__ import annotations

import asyncio
import logging
import os

from kvtier.daemon.auth import Principal
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.store import BlockStore
from kvtier.tiers.lookup_counts import CountsError, CountsReader, map_counts
from kvtier.tiers.vocab import Tier

log = logging.getLogger("kvtier.lookups")

FOLD_S = 1.0
MAX_FOLDED_LOOKUPS = 1 << 40
"""The most lookups one read of one region counts (as one ReportLookups may carry): no real
client comes near it between two reads, and a forged region cannot push the counters past what
the wire (uint64) carries in any time that matters."""


class LookupRegions:
    """The mapped regions, by credential token (see the module docstring)."""

    def __init__(self, store: BlockStore, limit: int = MAX_FOLDED_LOOKUPS) -> None:
        self.store = store
        self.limit = limit
        self._regions: dict[str, tuple[Principal, CountsReader]] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def attach(self, token: str, principal: Principal, fd: int) -> None:
        """Map the region ``fd`` (closed here either way) for the connection of ``token``.
        INVALID_ARGUMENT for anything but a region of the expected kind, or a second one."""
        try:
            if token in self._regions:
                raise StoreError(Code.INVALID_ARGUMENT, "this connection already handed over its lookup "
                                                        "counters region (one per credential connection)")
            try:
                m = map_counts(fd)
            except CountsError as e:
                raise StoreError(Code.INVALID_ARGUMENT, str(e)) from None
        finally:
            os.close(fd)
        self._regions[token] = (principal, CountsReader(m, self.limit))

    def detach(self, token: str) -> None:
        """The connection of ``token`` closed: fold its region one last time and unmap it."""
        entry = self._regions.pop(token, None)
        if entry is not None:
            try:
                self._fold(*entry)
            finally:
                entry[1].close()

    def fold(self) -> None:
        """Fold every region's new counts into the store's lookup counters (on the event loop)."""
        for p, reader in list(self._regions.values()):
            self._fold(p, reader)

    def _fold(self, p: Principal, reader: CountsReader) -> None:
        refused = reader.refused
        for layout_id, (gpu, host, disk, miss) in reader.deltas():
            try:
                self.store.count_table_lookups(layout_id, {Tier.GPU: gpu, Tier.HOST: host, Tier.DISK: disk},
                                               miss, p.tenant)
            except StoreError:
                pass  # a layout the caller's tenant did not register: counts nothing
        if reader.refused != refused:
            log.warning("a client's lookup counters went down or jumped by more than %d lookups: not counted",
                        self.limit, extra={"tenant": p.tenant, "caller": p.caller})

    async def run(self, every_s: float = FOLD_S) -> None:
        """Fold every ``every_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            try:
                self.fold()
            except Exception:  # never let the counters stop the daemon
                log.exception("folding lookup counters failed")

    def close(self) -> None:
        for token in list(self._regions):
            self.detach(token)

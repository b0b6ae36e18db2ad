"""What a daemon reports about itself, typed: the Stats reply, the metrics and NodeInfo read it.

:meth:`StatsSource.snapshot` takes one consistent :class:`NodeStats` on the event loop (the
counters are copied); :meth:`StatsSource.snapshot_from_thread` does so from another thread
(the Prometheus endpoint's), by running it on the loop. The service layer turns a snapshot
into a ``StatsReply``; the metrics collector (:mod:`kvtier.daemon.metrics`) reads it directly.

Node-wide figures (every tenant's counters, the tiers' use, every session) are the operator's
(:meth:`kvtier.daemon.auth.Authenticator.is_operator`); :meth:`StatsSource.tenant_snapshot`
is what any other tenant's Stats caller gets: its own counters, sessions and blocks only, so
that one tenant cannot learn how busy another is (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier import __version__
from kvtier.daemon.counters import Counters
from kvtier.daemon.store import BlockStore
from kvtier.tiers.vocab import Tier


@dataclass(frozen=True)
class TierUsage:
    """One tier the daemon holds blocks in (host, and disk when configured)."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    load_gbps: float = 0.0  # measured bandwidth of loading from this tier, 10^9 B/s (0: not measured)


@dataclass(frozen=True)
class LayoutUsage:
    layout_id: int
    fingerprint: bytes
    block_bytes: int
    blocks: dict[Tier, int] = field(default_factory=dict)  # per tier (gpu: held on some worker's device)


@dataclass(frozen=True)
class NodeStats:
    node_id: str
    epoch: int
    version: str
    uptime_s: float
    sessions: int
    tiers: list[TierUsage]
    layouts: list[LayoutUsage]
    counters: Counters
    retained_bytes: int = 0          # slot bytes retained (Retain): every tenant's, or the caller tenant's
    retention_budget_bytes: int = 0  # one tenant's retention budget (0: retention off)


def tier_usage(store: BlockStore, tenant: str | None = None) -> list[TierUsage]:
    """Host, then disk if the store has one, then remote if it has peers or a shared store
    (``BlockStore.remotes``): what this node loads from peers and the shared store, with the bandwidth its fetches measured (``Placement.remote_load_gbps``;
    0 until one was measured: routers then use their default), no capacity and no blocks of
    its own. Routers weight the remote tier with it (NodeInfo carries it). With ``tenant``,
    the disk tier's bandwidth is the one measured on that tenant's own reads (0 until one)."""
    host = store.host
    out = [TierUsage(Tier.HOST, host.capacity, host.used_bytes, len(host.entries))]
    disk = store.disk
    if disk is not None:
        if tenant is None:
            gbps = store.tiers.disk_load_gbps
        else:
            group = store.layouts.group_of(tenant)
            gbps = 0.0 if group is None else store.tiers.disk_load_gbps_of.get(group, 0.0)
        out.append(TierUsage(Tier.DISK, disk.capacity, disk.used_bytes, len(disk.entries), gbps))
    if store.remotes:  # only a node that can fetch (peers, a store) offers routers a remote tier
        out.append(TierUsage(Tier.REMOTE, 0, 0, 0, store.tiers.remote_load_gbps))
    return out


class StatsSource:
    """Snapshots of one daemon's state (see the module docstring)."""

    def __init__(self, store: BlockStore, node_id: str, epoch: int,
                 before: Callable[[], None] | None = None) -> None:
        self.store = store
        self.before = before  # run first in each snapshot (the clients' lookup counters are folded in)
        self.node_id = node_id
        self.epoch = epoch
        self.started = time.monotonic()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the daemon once it runs

    def snapshot(self, tenant: str | None = None) -> NodeStats:
        """Now, consistently: call it on the event loop. With ``tenant``, the layouts are that
        tenant's only (a Stats caller's); without, every tenant's (the operator's metrics).
        Lookups clients counted in their counters regions are folded in first."""
        if self.before is not None:
            self.before()
        store = self.store
        regs = store.layouts if tenant is None else store.layouts.of_tenant(tenant)
        layouts = [LayoutUsage(reg.layout_id, reg.wire_fingerprint, reg.layout.block_bytes,
                               store.blocks_of(reg.fingerprint)) for reg in regs]
        retention = store.retention
        retention.expire()
        return NodeStats(self.node_id, self.epoch, __version__, time.monotonic() - self.started,
                         len(store.sessions), tier_usage(store), layouts, store.counters.copy(),
                         retention.total_bytes, retention.budget)

    def tenant_snapshot(self, tenant: str) -> NodeStats:
        """:meth:`snapshot` as one tenant (not the operator) may see it: its layouts; its own
        counters (:attr:`BlockStore.tenant_counters`: hits, misses, puts, evictions it asked
        for; every other counter 0); its open sessions; per tier, the capacity and the blocks
        its layouts hold there (bytes: those blocks' slots); the bytes it retains."""
        if self.before is not None:
            self.before()
        store = self.store
        layouts = []
        held: dict[Tier, list[int]] = {}  # tier -> [blocks, bytes] of this tenant's layouts
        for reg in store.layouts.of_tenant(tenant):
            blocks = store.blocks_of(reg.fingerprint)
            layouts.append(LayoutUsage(reg.layout_id, reg.wire_fingerprint, reg.layout.block_bytes, blocks))
            for tier, n in blocks.items():
                mine = held.setdefault(tier, [0, 0])
                mine[0] += n
                mine[1] += n * reg.layout.slot_bytes
        tiers = [TierUsage(t.tier, t.capacity_bytes, held.get(t.tier, [0, 0])[1], held.get(t.tier, [0, 0])[0],
                           t.load_gbps) if t.tier != Tier.REMOTE else t for t in tier_usage(store, tenant)]
        retention = store.retention
        retention.expire()
        own = store.tenant_counters.get(tenant)
        counters = own.copy() if own is not None else Counters()
        sessions = sum(1 for sid in store.sessions.ids() if store.sessions[sid].tenant == tenant
                       and not store.sessions[sid].internal)
        return NodeStats(self.node_id, self.epoch, __version__, time.monotonic() - self.started,
                         sessions, tiers, layouts, counters, retention.bytes_of.get(tenant, 0), retention.budget)

    def snapshot_from_thread(self, timeout: float = 10.0) -> NodeStats:
        """:meth:`snapshot` from another thread: run on the event loop, waited for."""
        loop = self.loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the daemon's event loop is not running")

        async def take() -> NodeStats:
            return self.snapshot()

        return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout)

"""One placement policy: a real kvtierd and a TierPolicy run alone end up holding the same blocks.

The daemon's store asks its :class:`~kvtier.tiers.policy.TierPolicy` for every order and rule
decision (host and disk victims, the demotion filter, promotion). So a real daemon (a kvtierd
subprocess, over its unix socket, through :class:`~kvtier.client.Sidecar`) and a TierPolicy
with the same capacities in blocks, given the same random sequence of puts, gets, prefetches
and evicts past host capacity, must hold exactly the same keys in host and on disk after every
step. The daemon's holdings are read from its key table (both tier bits of every key), and
checked against its Lookup RPC (the fastest tier) and its Stats (blocks per tier). Every get
must also hit and miss the same keys, and serve the bytes that were put.

Pins matter to placement (a pinned block is never a victim). A Sidecar releases a get's pins
in the background and waits for that release before its next put or get; a prefetch is only
issued after such a settled call, so no stale pin of the test's own skews the daemon's choice.
"""

from __future__ import annotations

import glob
import os
import random
from dataclasses import dataclass

import pytest
from _demotions import demotions_over

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.keytable import TIER_BITS, KeyTableReader
from kvtier.tiers.layout import Layout
from kvtier.tiers.policy import TierPolicy
from kvtier.tiers.vocab import Tier

BLOCK = 16 * 1024            # a 4 KiB multiple: slot = block
HOST_BLOCKS = 6
DISK_BLOCKS = 10
UNIVERSE = [b"equiv-key-" + i.to_bytes(4, "big") for i in range(30)]
LAYOUT = Layout.flat(BLOCK)


def payload(k: bytes) -> bytes:
    return random.Random(k).randbytes(BLOCK)


@dataclass(frozen=True)
class Scenario:
    name: str
    disk: bool
    demote_min_seen: int = 2
    write_through: bool = False
    durable_share: float = 0.0   # of puts (needs a disk)
    steps: int = 150
    queue_blocks: int = 0        # --demote-queue-bytes in blocks (0: only seen-often victims are demoted)
    ahead_blocks: int = 0        # --demote-ahead-bytes in blocks (0: no write-ahead)


SCENARIOS = [
    Scenario("host-only", disk=False),
    Scenario("disk", disk=True, demote_min_seen=2),
    Scenario("disk-hot", disk=True, demote_min_seen=1, durable_share=0.2),
    Scenario("write-through", disk=True, demote_min_seen=3, write_through=True, steps=100),
    # disk admission: every victim while the write queue has room, seen-often ones beyond
    Scenario("disk-queue", disk=True, demote_min_seen=2, queue_blocks=2),
    # write-ahead: the host's eviction end is written to disk before it is evicted
    Scenario("disk-ahead", disk=True, demote_min_seen=2, queue_blocks=2, ahead_blocks=1),
]


class Daemon:
    """The real daemon side: a kvtierd, a sidecar using the key table, one asking by RPC."""

    def __init__(self, start_daemon, tmp_path, sc: Scenario) -> None:
        args = ["--demote-min-seen", str(sc.demote_min_seen), "--demote-queue-bytes", str(sc.queue_blocks * BLOCK),
                "--demote-ahead-bytes", str(sc.ahead_blocks * BLOCK)]
        if sc.disk:
            args += ["--disk-dir", str(tmp_path / "disk"), "--disk-capacity", str(DISK_BLOCKS * BLOCK)]
        if sc.write_through:
            args += ["--disk-write-through"]
        self.proc: DaemonProcess = start_daemon(*args, host_capacity=str(HOST_BLOCKS * BLOCK))
        self.sc = Sidecar(self.proc.socket)
        self.rpc = Sidecar(self.proc.socket, use_key_table=False)
        self.lid = self.sc.register_layout(LAYOUT)
        self.rid = self.rpc.register_layout(LAYOUT)
        tables = glob.glob(os.path.join(self.proc.shm_dir, "*.keys"))
        assert len(tables) == 1, tables
        self.table = KeyTableReader(tables[0])

    def holdings(self) -> dict[Tier, set[bytes]]:
        masks = self.table.masks(LAYOUT.fingerprint, UNIVERSE).tolist()
        return {tier: {k for k, m in zip(UNIVERSE, masks, strict=True) if m & TIER_BITS[tier.label]}
                for tier in (Tier.HOST, Tier.DISK)}

    def close(self) -> None:
        self.table.close()
        self.sc.close()
        self.rpc.close()


def _check(step: str, d: Daemon, p: TierPolicy, sc: Scenario) -> None:
    want = {tier: set(p.tiers[tier]) for tier in (Tier.HOST, Tier.DISK)}
    got = d.holdings()
    for tier in (Tier.HOST, Tier.DISK):
        assert got[tier] == want[tier], (
            f"{sc.name}, {step}: {tier} differs: daemon has {sorted(got[tier] - want[tier])} the policy does "
            f"not, lacks {sorted(want[tier] - got[tier])}")
    fastest = ["host" if k in want[Tier.HOST] else "disk" if k in want[Tier.DISK] else None for k in UNIVERSE]
    assert d.rpc.lookup(d.rid, UNIVERSE) == fastest, f"{sc.name}, {step}: Lookup"
    tiers = d.rpc.stats()["tiers"]
    assert tiers["host"]["blocks"] == len(want[Tier.HOST]), f"{sc.name}, {step}: Stats host blocks"
    if sc.disk:
        assert tiers["disk"]["blocks"] == len(want[Tier.DISK]), f"{sc.name}, {step}: Stats disk blocks"


def _step(rng: random.Random, d: Daemon, p: TierPolicy, sc: Scenario, settled: bool) -> tuple[str, bool]:
    """One random operation on both sides; returns its description and whether the sidecar
    has no release in flight afterwards."""
    r = rng.random()
    if r < 0.45:
        keys = rng.sample(UNIVERSE, rng.choice([1, 2, 3, 4, 4, HOST_BLOCKS + 2]))
        durable = sc.write_through or rng.random() < sc.durable_share
        res = d.sc.put(d.lid, keys, [payload(k) for k in keys], durable=durable)
        out = p.put(keys, durable=durable)
        assert (res.stored, res.present, sorted(res.dropped)) == (len(out.stored), len(out.present),
                                                                  sorted(out.dropped)), f"put {keys}"
        return f"put{' durable' if durable else ''} {len(keys)}", True
    if r < 0.8:
        keys = rng.sample(UNIVERSE, rng.choice([1, 2, 3, 5, HOST_BLOCKS + 2]))
        got = d.sc.get(d.lid, keys)
        want = p.get(keys)
        assert [g is not None for g in got] == [t is not None for t in want], f"get {keys}: hits differ"
        assert all(bytes(g) == payload(k) for k, g in zip(keys, got, strict=True) if g is not None), \
            "a block was served with other bytes than were put"
        return f"get {len(keys)}", False
    if r < 0.9 and settled:
        keys = rng.sample(UNIVERSE, rng.randint(1, 4))
        assert d.sc.prefetch(d.lid, keys) == p.prefetch(keys), f"prefetch {keys}"
        return f"prefetch {len(keys)}", True
    keys = rng.sample(UNIVERSE, rng.randint(1, 3))
    assert d.sc.evict(d.lid, keys) == p.evict(keys), f"evict {keys}"
    return f"evict {len(keys)}", settled


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_daemon_and_policy_hold_the_same_blocks_after_every_step(start_daemon, tmp_path, sc: Scenario) -> None:
    policy = TierPolicy(0, HOST_BLOCKS, DISK_BLOCKS if sc.disk else 0, sc.demote_min_seen)
    policy.disk_write_room = sc.queue_blocks or None  # the daemon's: nothing else is written meanwhile
    policy.write_ahead = sc.ahead_blocks
    d = Daemon(start_daemon, tmp_path, sc)
    rng = random.Random(f"equivalence-{sc.name}")
    settled = True
    try:
        for i in range(sc.steps):
            what, settled = _step(rng, d, policy, sc, settled)
            counters = demotions_over(d.rpc)  # (the policy's demotions are over when its call returns)
            _check(f"step {i} ({what})", d, policy, sc)
    finally:
        d.close()
    if sc.ahead_blocks:  # (both sides wrote ahead: the daemon's counter, the policy's disk holdings)
        assert counters["demotions_ahead"] > 0, f"{sc.name}: the daemon never wrote ahead: {counters}"
    c = policy.counts
    assert c.evictions[Tier.HOST.rank] > 0, "the sequence never went past host capacity"
    if sc.disk:  # (with write-through every block is on disk before host evicts it: nothing to demote)
        assert (c.demotions or sc.write_through) and c.promotions and c.evictions[Tier.DISK.rank], (
            f"{sc.name}: the sequence did not exercise demotion, promotion and disk eviction: {c}")

"""Placement.ingest and Placement.payloads: blocks that come from elsewhere (a peer, the shared
store) enter host only complete and verified; payloads go out verified, from host or disk."""

from __future__ import annotations

import asyncio
import os

from kvtier.daemon.counters import Count, Op
from kvtier.daemon.store import BlockStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier, payload_checksum
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 8192


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def payload(k: bytes) -> bytes:
    return (k * (BLOCK // len(k) + 1))[:BLOCK]


def test_ingest_verifies_and_payloads_round_trip(tmp_path, shm_dir):
    shm = shm_dir
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint

    async def main() -> None:
        disk = DiskTier(str(tmp_path / "disk"), capacity=8 * BLOCK)
        store = BlockStore(HostTier(shm, 4 * BLOCK, "ing"), disk=disk, demote_min_seen=1)
        lid = (await store.register_layout(layout)).layout_id
        tiers, cls = store.tiers, store.pool(layout)
        try:
            good = [(fp + key(i), payload(key(i)), payload_checksum(payload(key(i)))) for i in (1, 2)]
            flipped = bytearray(payload(key(3)))
            flipped[100] ^= 1
            bad = [(fp + key(3), bytes(flipped), payload_checksum(payload(key(3)))),   # bytes changed
                   (fp + key(4), payload(key(4))[:-1], payload_checksum(payload(key(4))))]  # short
            got = await tiers.ingest(layout, cls, good + bad)
            assert got == {fp + key(1), fp + key(2)}
            assert store.lookup(lid, [key(1), key(2), key(3), key(4)]) == [Tier.HOST, Tier.HOST, None, None]
            assert store.counters[Count.CHECKSUM_FAILURES] == 2
            out = await tiers.payloads([fp + key(1), fp + key(3)])
            assert set(out) == {fp + key(1)} and out[fp + key(1)] == (payload(key(1)), good[0][2])
            # ingesting 5, 6 and 7 evicts 1 to disk (seen once is enough here); disk serves them
            more = [(fp + key(i), payload(key(i)), payload_checksum(payload(key(i)))) for i in (5, 6, 7)]
            assert await tiers.ingest(layout, cls, more) == {fp + key(i) for i in (5, 6, 7)}
            assert store.lookup(lid, [key(1)]) == [Tier.DISK]
            out = await tiers.payloads([fp + key(1), fp + key(5)])
            assert out[fp + key(1)] == (payload(key(1)), good[0][2])
            assert out[fp + key(5)][0] == payload(key(5))
            assert await tiers.ingest(layout, cls, more) == set()  # already held: nothing to do
        finally:
            store.close()

    try:
        asyncio.run(main())
    finally:
        os.sync()


class _DictSource:
    """A source over a dict, standing in for the network (the peer and store sources have
    their own tests with real daemons and a real Redis Cluster)."""

    name = "store"

    def __init__(self, blocks: dict[bytes, bytes], read_through: bool = True) -> None:
        self.blocks, self.read_through, self.asked = blocks, read_through, []

    async def fetch(self, tenant, layout, bkeys, from_node=None):
        self.asked.append((tenant, list(bkeys)))
        return [(b, self.blocks[b], payload_checksum(self.blocks[b])) for b in bkeys if b in self.blocks]


def test_get_reads_through_remote_sources_for_local_misses(shm_dir):
    shm = shm_dir
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint

    async def main() -> None:
        store = BlockStore(HostTier(shm, 8 * BLOCK, "rt"))
        lid = (await store.register_layout(layout)).layout_id
        sid = store.open_session("test", os.getpid()).session_id
        off = _DictSource({fp + key(9): payload(key(9))}, read_through=False)
        src = _DictSource({fp + key(i): payload(key(i)) for i in (1, 2)})
        store.remotes.extend([off, src])
        try:
            out = await store.acquire(sid, lid, [key(1), key(2), key(3), key(9)])
            assert [r.found_in if r.hit else None for r in out] == [Tier.REMOTE, Tier.REMOTE, None, None]
            assert off.asked == [] and src.asked == [("default", [fp + key(i) for i in (1, 2, 3, 9)])]
            cls = store.pool(layout)
            with open(cls.path, "rb") as fh:
                fh.seek(out[0].offset)
                assert fh.read(BLOCK) == payload(key(1))
            assert store.counters.hits[Op.ACQUIRE][Tier.REMOTE].blocks == 2
            assert store.tiers.remote_load_gbps > 0
            out = await store.acquire(sid, lid, [key(1)])          # now a host hit: not asked again
            assert out[0].found_in is Tier.HOST and len(src.asked) == 1
        finally:
            store.close()

    asyncio.run(main())

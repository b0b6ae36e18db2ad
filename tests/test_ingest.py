"""Placement.ingest and Placement.payloads: blocks that come from elsewhere (a peer, the shared
store) enter host only complete and verified; payloads go out verified, from host or disk."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from kvtier.daemon.counters import Count
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


def test_ingest_verifies_and_payloads_round_trip(tmp_path):
    shm = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
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
        shutil.rmtree(shm, ignore_errors=True)
        os.sync()

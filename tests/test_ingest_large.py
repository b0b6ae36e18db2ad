"""Placement.ingest of a large batch (over ``INGEST_INLINE_BYTES``): the payloads are copied into
their slots and hashed there on the ingest threads, off the event loop; a block whose bytes do
not match the sender's checksum is still dropped and counted, never visible."""

from __future__ import annotations

import asyncio

import kvtier.daemon.placement as placement
from kvtier.client.tools.local_daemon import shm_tempdir
from kvtier.daemon.counters import Count
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier, payload_checksum
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 1024 * 1024


def test_large_ingest_copies_on_threads_and_verifies(shm_dir):
    shm = shm_dir
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint
    keys = [i.to_bytes(4, "big") * 4 for i in range(8)]
    payloads = [bytes([i]) * 7 + bytes(range(256)) * (BLOCK // 256 - 1) + bytes(249) for i in range(8)]
    assert len(keys) * BLOCK > placement.INGEST_INLINE_BYTES

    async def main() -> None:
        store = BlockStore(HostTier(shm, 10 * BLOCK, "ingl"), demote_min_seen=1)
        lid = (await store.register_layout(layout)).layout_id
        try:
            loop = asyncio.get_running_loop()
            threads: set[str] = set()
            real = placement._copy_hash

            def spy(work):  # noqa: ANN001, ANN202
                import threading

                threads.add(threading.current_thread().name)
                return real(work)

            placement._copy_hash = spy
            try:
                flipped = bytearray(payloads[3])
                flipped[BLOCK // 2] ^= 1
                blocks = [(fp + k, memoryview(p), payload_checksum(p)) for k, p in zip(keys, payloads, strict=True)]
                blocks[3] = (fp + keys[3], bytes(flipped), payload_checksum(payloads[3]))
                got = await store.tiers.ingest(layout, store.pool(layout), blocks)
            finally:
                placement._copy_hash = real
            assert threads and all(t.startswith("kvtier-ingest") for t in threads)
            assert got == {fp + k for i, k in enumerate(keys) if i != 3}
            assert store.counters[Count.CHECKSUM_FAILURES] == 1
            assert store.lookup(lid, keys) == [Tier.HOST] * 3 + [None] + [Tier.HOST] * 4
            out = await store.tiers.payloads([fp + k for k in keys])
            assert {b: p for b, (p, _) in out.items()} == {fp + k: p for i, (k, p) in
                                                            enumerate(zip(keys, payloads, strict=True)) if i != 3}
            assert loop.is_running()
        finally:
            store.close()

    asyncio.run(main())


def test_verified_ingest_copies_without_hashing_again():
    """A source that verified each payload as it arrived (the shared store) says so: the copies
    are not hashed again (the given checksum is the slot's), on threads or inline."""
    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint
    keys = [i.to_bytes(4, "big") * 4 for i in range(8)]
    payloads = [bytes([i + 1]) * BLOCK for i in range(8)]

    async def main() -> None:
        store = BlockStore(HostTier(shm, 10 * BLOCK, "ingv"), demote_min_seen=1)
        lid = (await store.register_layout(layout)).layout_id
        hashed = []
        real = placement.payload_checksum
        placement.payload_checksum = lambda b: hashed.append(1) or real(b)
        try:
            for part in (keys[:2], keys[2:]):   # inline (2 MiB), then on threads (6 MiB)
                blocks = [(fp + k, payloads[keys.index(k)], payload_checksum(payloads[keys.index(k)])) for k in part]
                assert await store.tiers.ingest(layout, store.pool(layout), blocks, verified=True) == {
                    fp + k for k in part}
            assert hashed == []
        finally:
            placement.payload_checksum = real
        try:
            assert store.lookup(lid, keys) == [Tier.HOST] * len(keys)
            out = await store.tiers.payloads([fp + k for k in keys])   # hashed here: the copies are sound
            assert [out[fp + k][0] for k in keys] == payloads
        finally:
            store.close()

    with shm_tempdir() as shm:
        asyncio.run(main())

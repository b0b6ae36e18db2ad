"""Issue 14, items 6 and 7: the failure cases 0.1 left open, each on real components.

In process (a BlockStore on a real tmpfs HostTier, the daemon's own LocationLog), or against
a real kvtierd over its socket; each test names the promise it guards.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import tracemalloc

import pytest

from kvtier.daemon.events import LocationLog, event_bytes
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"fixes-14" + i.to_bytes(24, "big")   # 32 bytes: the longest key


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_event_ring_is_bounded_in_bytes(shm) -> None:
    """One-key events weigh about 290 bytes each in the daemon's heap: a ring bounded only by
    its key count (1,048,576 by default) grew the heap by hundreds of MiB. With
    ``event_log_bytes`` the ring's heap stays under its bound, measured with tracemalloc, and
    its accounting equals the events it holds."""
    layout = Layout.flat(BLOCK)

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * layout.slot_bytes, "ring"))
        bound = 256 * 1024
        loc = LocationLog(store, "node", epoch=1, max_keys=1 << 20, max_bytes=bound)
        await store.register_layout(layout)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(6000):
                loc.stored(Tier.HOST, layout.fingerprint, [key(i)])
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        held = loc.since(loc.first_seq - 1)
        assert held is not None and loc.first_seq > 1, "nothing was dropped: the ring is not bounded in bytes"
        assert loc._ring_bytes == sum(event_bytes(ev.keys) for ev in held) <= bound
        assert grown < 1.25 * bound, f"the ring took {grown} bytes of heap for a bound of {bound}"
        assert held[-1].keys[0] == key(5999)

    asyncio.run(main())

"""Client-side leaks across daemon restarts: a real kvtierd subprocess over a real socket.

A host pool file is unlinked when its daemon stops, but its memory stays allocated for as long
as any process maps it. A sidecar that outlives a daemon restart must come back (re-register, re-open its
session) and drop its mapping of the old pool once it moved to the new one, or the old daemon's whole (prefaulted) pool stays in
the tmpfs next to the new one.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from kvtier.client import AsyncSidecar
from kvtier.client.engine.sidecar import Sidecar
from kvtier.tiers.layout import Layout

BLOCK = 64 * 1024


def keys_for(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag * 8 + i.to_bytes(8, "big") for i in range(n)]


def blocks_for(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(BLOCK) for _ in range(n)]


def mapped_pools(shm_dir: str) -> list[str]:
    """Pool files of ``shm_dir`` this process maps (an unlinked one shows as '... (deleted)')."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and shm_dir in line and ".pool" in line})


def test_sidecar_unmaps_the_old_pool_after_a_daemon_restart(start_daemon) -> None:
    d = start_daemon()
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys_for(2), blocks_for(2, 1))
        first = mapped_pools(d.shm_dir)
        assert len(first) == 1
        for round_ in range(2):
            d.stop()
            d.start()
            blocks = blocks_for(2, 2 + round_)
            assert sc.put(lid, keys_for(2), blocks).stored == 2
            assert [bytes(g) for g in sc.get(lid, keys_for(2))] == blocks
            now = mapped_pools(d.shm_dir)
            assert len(now) == 1 and "(deleted)" not in now[0], f"stale pool mappings kept: {now}"
            assert os.path.exists(now[0])
    assert mapped_pools(d.shm_dir) == []


def test_async_sidecar_survives_a_daemon_restart_and_unmaps_the_old_pool(start_daemon) -> None:
    """As the sync Sidecar (and the module docstring) promise: after a restart the next call
    re-registers and re-opens the session once; before, every call failed FAILED_PRECONDITION."""
    d = start_daemon()

    async def go() -> None:
        async with AsyncSidecar(d.socket, use_key_table=False) as sc:
            lid = await sc.register_layout(Layout.flat(BLOCK))
            await sc.put(lid, keys_for(2), blocks_for(2, 1))
            d.stop()
            d.start()
            assert await sc.lookup(lid, keys_for(2)) == [None, None]   # first call after the restart
            d.stop()
            d.start()
            assert await sc.evict(lid, keys_for(2)) == 0
            d.stop()
            d.start()
            blocks = blocks_for(2, 5)
            assert (await sc.put(lid, keys_for(2), blocks)).stored == 2
            assert [bytes(g) for g in await sc.get(lid, keys_for(2))] == blocks
            now = mapped_pools(d.shm_dir)
            assert len(now) == 1 and "(deleted)" not in now[0], f"stale pool mappings kept: {now}"

    asyncio.run(go())
    assert mapped_pools(d.shm_dir) == []

"""Heap bytes per held block in the daemon's store (tracemalloc, not timing-sensitive).

Fills a real BlockStore (host tier, key-table publisher, location log) with ``--blocks`` 4 KiB
blocks through allocate + commit, in batches, and reports the Python heap growth per block
(the pool and the key table are tmpfs files, outside the heap). Components: the store alone
(``store_bytes_per_block``), and with the key table and location log attached. The size
class's per-slot arrays (40 B a slot: states, sizes, generations, checksums, the host order's
links and seen counts) are made with the class, in the warm-up batch, and the compiled id map
(``tiers/_idmap.c``: about 33 B of record a slot and 8-16 B of table an id) is raw memory that
tracemalloc does not see, so neither is in these figures: add them. RSS per block at 1M
blocks: ``bench/lookup.py``.

    python bench/mem_per_block.py [--blocks 100000] [--batch 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import tempfile
import tracemalloc

from kvtier.daemon.events import LocationLog
from kvtier.daemon.keytable import KeyTablePublisher
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout

BLOCK = 4096


async def fill(shm: str, blocks: int, batch: int, observers: bool) -> float:
    layout = Layout.flat(BLOCK)
    store = BlockStore(HostTier(shm, blocks * layout.slot_bytes + (1 << 20), "mem"))
    extra = []
    if observers:
        loc = LocationLog(store, "node", epoch=1)
        table = KeyTablePublisher(store, shm, "mem", 1, lambda: blocks * BLOCK)
        store.observers.add(table, loc)
        extra = [loc, table]
    lid = (await store.register_layout(layout)).layout_id
    sid = store.open_session("mem", os.getpid()).session_id
    keys = [i.to_bytes(16, "little") for i in range(blocks)]
    # warm up one batch (size classes, maps), then measure the rest
    warm = min(batch, blocks // 10)
    grants = await store.allocate(sid, lid, keys[:warm])
    await store.commit(sid, [g.grant_id for g in grants], [], durable=False)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(warm, blocks, batch):
        part = keys[i:i + batch]
        grants = await store.allocate(sid, lid, part)
        await store.commit(sid, [g.grant_id for g in grants], [], durable=False)
    del grants, part
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert len(store.host.entries) == blocks
    per = (after - before) / (blocks - warm)
    top = snap.statistics("lineno")[:8]
    for s in top:
        print(f"  {s.size / (blocks - warm):7.1f} B/block  {s.traceback}")
    for o in extra:
        if hasattr(o, "close"):
            o.close()
    store.close()
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ns = ap.parse_args()
    out = {}
    for observers in (False, True):
        shm = tempfile.mkdtemp(prefix="kvtier-mem-", dir="/dev/shm")
        try:
            print("observers" if observers else "store alone")
            per = asyncio.run(fill(shm, ns.blocks, ns.batch, observers))
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        out["with_observers_bytes_per_block" if observers else "store_bytes_per_block"] = round(per, 1)
    out["blocks"] = ns.blocks
    print(json.dumps(out))


if __name__ == "__main__":
    main()

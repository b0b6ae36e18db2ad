"""The shared store's throughput against plain redis-py cluster pipelines of the same bytes.

Starts its own Redis Cluster (3 masters on loopback, tests/redis_cluster.py) and measures, in
the same run, with 2 MiB blocks:

* ``store_put_gbps``: the daemon's write-behind path end to end, in process: a BlockStore
  (host tier in /dev/shm) with a RemoteStore (``--store-write put``); blocks are committed to
  host, then the clock runs from the commits' return until the writer has written them all
  (pin, copy into a value and hash it on the store's threads, each 32 MiB batch written on
  one connection per master, all masters before any reply is read, publish). The commits themselves are not timed (they do not wait on the store).
* ``store_get_gbps``: the read-through path end to end: a second BlockStore (another
  "daemon", an empty host tier) acquires the same keys; each misses locally, is fetched from
  the store in 16 MiB batches (header and checksum verified; the next batch is read while
  this one enters host), copied into host, hashed there and leased.
* ``redis_raw_gbps``: the same bytes through plain redis-py ``RedisCluster`` pipelines (SET,
  then GET) in batches of the same size: the lower of the two (``raw_set_gbps``,
  ``raw_get_gbps`` are reported too). Both parse replies with hiredis (a dependency) and pack
  commands with redis-py's Python serializer (a large value is sent without a copy).
* ``store_ratio`` = min(put, get) / raw (goal >= 0.8).

    python bench/_store_bench.py [--blocks 48] [--block-mib 2] [--repeat 3]

Last line of stdout: one JSON object. ``store_figures(...)`` returns the same dict (bench/peer.py
merges it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_cluster import RedisCluster  # noqa: E402  (tests/redis_cluster.py)

from kvtier.daemon.counters import Count  # noqa: E402
from kvtier.daemon.remote_store import BATCH_BYTES, RedisBackend, RemoteStore, parse_nodes  # noqa: E402
from kvtier.daemon.store import BlockStore  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402
from kvtier.tiers.layout import Layout  # noqa: E402


def _raw(nodes: str, payloads: list[bytes], per_batch: int) -> tuple[float, float]:
    import redis.connection
    from redis.cluster import ClusterNode
    from redis.cluster import RedisCluster as Client

    # the baseline at its best: hiredis parses the replies (where installed), but commands are
    # packed by redis-py's Python serializer, which sends a large value without copying it
    # (hiredis's packer copies each into one string: SETs of 2 MiB values ran ~3x slower)
    had, redis.connection.HIREDIS_AVAILABLE = redis.connection.HIREDIS_AVAILABLE, False
    try:
        client = Client(startup_nodes=[ClusterNode(h, p) for h, p in parse_nodes(nodes)])
        client.ping(target_nodes=Client.ALL_NODES)  # every node's first connection made now
    finally:
        redis.connection.HIREDIS_AVAILABLE = had
    names = [f"raw:{i}" for i in range(len(payloads))]
    total = sum(map(len, payloads))
    try:
        t0 = time.perf_counter()
        for i in range(0, len(names), per_batch):
            pipe = client.pipeline()
            for j in range(i, min(i + per_batch, len(names))):
                pipe.set(names[j], payloads[j], px=600_000)
            pipe.execute()
        t1 = time.perf_counter()
        for i in range(0, len(names), per_batch):
            pipe = client.pipeline()
            for j in range(i, min(i + per_batch, len(names))):
                pipe.get(names[j])
            got = pipe.execute()
            assert all(len(g) == len(payloads[0]) for g in got)
        t2 = time.perf_counter()
        client.delete(*names[:1])
    finally:
        client.close()
    return total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9


async def _store_path(nodes: str, layout: Layout, keys: list[bytes], payloads: list[bytes]) -> tuple[float, float]:
    total = sum(map(len, payloads))
    shms = [tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm") for _ in range(2)]
    stores, remotes = [], []
    try:
        for i, shm in enumerate(shms):
            store = BlockStore(HostTier(shm, total + 4 * layout.slot_bytes, f"sb{i}"))
            remote = RemoteStore(RedisBackend(parse_nodes(nodes), 5.0), store.tiers, store.counters,
                                 store.observers, "bench", 600.0, "put", True, 30.0, total + layout.block_bytes)
            store.remotes.append(remote)
            remote.start()
            stores.append(store)
            remotes.append(remote)
        a, b = stores
        lid = (await a.register_layout(layout)).layout_id
        sid = a.open_session("bench", os.getpid()).session_id
        grants = await a.allocate(sid, lid, keys)
        with open(a.pool(layout).path, "r+b") as fh:
            for g, p in zip(grants, payloads, strict=True):
                fh.seek(g.offset)
                fh.write(p)
        await a.commit(sid, [g.grant_id for g in grants], [], False)
        t0 = time.perf_counter()
        await remotes[0].flush(120)
        put_s = time.perf_counter() - t0
        assert a.counters[Count.STORE_WRITES] == len(keys), "a block was not written behind"
        lid_b = (await b.register_layout(layout)).layout_id
        sid_b = b.open_session("bench", os.getpid()).session_id
        t0 = time.perf_counter()
        leases = await b.acquire(sid_b, lid_b, keys)
        get_s = time.perf_counter() - t0
        assert all(r.lease_id for r in leases), "a block was not read through"
        with open(b.pool(layout).path, "rb") as fh:
            fh.seek(leases[-1].offset)
            assert fh.read(layout.block_bytes) == payloads[-1]
        return total / put_s / 1e9, total / get_s / 1e9
    finally:
        for r in remotes:
            await r.close()
        for s in stores:
            s.close()
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)


def store_figures(blocks: int = 48, block_mib: int = 2, nodes: str | None = None, repeat: int = 3) -> dict:
    """The store's figures (see the module docstring), each the best of ``repeat`` runs
    (raw and store runs alternate, so a busy machine slows both alike); starts and stops its
    own Redis Cluster unless ``nodes`` names one."""
    block = block_mib * 1024 * 1024
    layout = Layout.flat(block)
    rng = np.random.default_rng(13)
    payloads = [rng.integers(0, 256, block, dtype=np.uint8).tobytes() for _ in range(blocks)]
    keys = [os.urandom(16) for _ in range(blocks)]
    cluster = None if nodes else RedisCluster(maxmemory=f"{2 * blocks * block_mib + 64}mb").start()
    try:
        where = nodes or cluster.nodes  # type: ignore[union-attr]
        raw_set = raw_get = put = get = 0.0
        for _ in range(max(1, repeat)):
            rs, rg = _raw(where, payloads, max(1, BATCH_BYTES // block))
            p, g = asyncio.run(_store_path(where, layout, keys, payloads))
            raw_set, raw_get, put, get = max(raw_set, rs), max(raw_get, rg), max(put, p), max(get, g)
    finally:
        if cluster is not None:
            cluster.stop()
    raw = min(raw_set, raw_get)
    return {"store_put_gbps": round(put, 3), "store_get_gbps": round(get, 3), "redis_raw_gbps": round(raw, 3),
            "raw_set_gbps": round(raw_set, 3), "raw_get_gbps": round(raw_get, 3),
            "store_ratio": round(min(put, get) / raw, 3), "store_blocks": blocks, "store_block_mib": block_mib,
            "store_masters": 3, "store_repeat": repeat, "store_path": "in-process BlockStore + RemoteStore (write-behind, read-through)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the best is reported")
    ap.add_argument("--redis", default="", help="startup nodes of a running cluster (default: start one)")
    args = ap.parse_args()
    print(json.dumps(store_figures(args.blocks, args.block_mib, args.redis or None, args.repeat)))


if __name__ == "__main__":
    main()

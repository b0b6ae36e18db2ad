"""Index snapshot save and load throughput against a real Redis Cluster, by size.

Starts a 3-master Redis Cluster on loopback (TLS and ACL users, as tests/test_router_snapshot.py
and ``bench/fleet.py`` start it; ``--plaintext``: without TLS), builds a router state of about
``--mb`` MB (the arrays :meth:`Router.state_arrays` returns: random 16-byte keys, ``--words``
64-bit words of location bits per row, a spare row in 32), then, at each size:

* ``save``: :func:`kvtier.client.routing.snapshot.state_bytes`'s serialisation of the arrays
  (``encode_s``) and :meth:`SnapshotStore.save` (``store_s``);
* ``load``: :meth:`SnapshotStore.load` (``fetch_s``: the manifest, the chunks, their digest),
  the arrays back from the bytes (``decode_s``) and :meth:`Router.load_arrays` (``index_s``:
  the bit matrix and the packed keys taken as they are, the key table's slots placed in one
  compiled pass);
* ``earlier_index_s``: the same index loaded from a state of the earlier format (the keys
  joined with their lengths and the live rows' bits, what a ``--state-path`` file of an
  older router holds), in memory: the matrix and the keys copied, the slots placed;

With ``--layout pairs`` the state is a pairs index's (client/routing/pairs.py: its table at the load
limit, random fingerprints), loaded as it is (``index_s``: no placement pass); and the fixed
costs apart: a fresh interpreter importing the route-server (``import_s``) and a
new cluster client's first read (``connect_s``). Prints one JSON line per size, then one with
all, last; ``load_mb_per_s`` is the snapshot's bytes over ``fetch_s + decode_s + index_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def earlier_state_of(mb: float, words: int, nodes: int = 64, seed: int = 1) -> dict[str, np.ndarray]:
    """Arrays in the earlier state format (``key_lengths``, ``key_bytes``, the live rows' bits,
    what ``LocationIndex.load_state`` rebuilds the key table from) of about ``mb`` MB:
    ``nodes`` nodes of one worker (columns gpu, host, disk each; fewer where ``words`` do not
    hold their columns), distinct random 16-byte keys, every row's ``ALWAYS`` column set."""
    from kvtier.client.routing.index import _FIRST_COLUMN, ALWAYS, NEVER  # noqa: PLC0415

    n = int(mb * 1e6 / ((16 + 8 * words) * (1 + 1 / 32)))  # the arrays Router.state_arrays() saves
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)
    keys[:, 0] = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # distinct
    fp = "ab" * 16
    cols, c = [], _FIRST_COLUMN
    node_meta = {}
    for i in range(min(nodes, (64 * words - _FIRST_COLUMN) // 3)):  # the columns fit the words
        nid = f"n{i}"
        for tier in ("gpu", "host", "disk"):
            cols.append([nid, tier, f"{nid}-w", fp, c])
            c += 1
        node_meta[nid] = {"epoch": 1, "seq": 1000 + i, "load_gbps": 0.0, "capacity_bytes": 0,
                          "workers": {f"{nid}-w": [fp]}, "fingerprints": [fp]}
    meta = {"columns": cols, "nodes": node_meta}
    bits = rng.integers(0, 2**63, size=(n, words), dtype=np.uint64)
    bits[:, 0] &= ~np.uint64((1 << ALWAYS) | (1 << NEVER))
    bits[:, 0] |= np.uint64(1 << ALWAYS)
    return {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            "key_lengths": np.full(n, 16, dtype=np.uint8), "key_bytes": keys.view(np.uint8).reshape(-1),
            "bits": bits, "router_meta": np.frombuffer(json.dumps({"targets": {}}).encode(), dtype=np.uint8)}


def state_of(mb: float, words: int, nodes: int = 64, seed: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Arrays as ``Router.state_arrays()`` returns them (the matrix and the key table as they
    are) for the index of :func:`earlier_state_of`'s keys and bits, and those arrays."""
    from kvtier.client.routing.index import LocationIndex  # noqa: PLC0415

    earlier = earlier_state_of(mb, words, nodes, seed)
    index = LocationIndex()
    index.load_state({k: a for k, a in earlier.items() if k != "router_meta"})
    return {**index.state(), "router_meta": earlier["router_meta"]}, earlier


def pairs_state_of(mb: float, nodes: int = 64, seed: int = 1) -> tuple[dict[str, np.ndarray], int]:
    """Arrays as ``Router.state_arrays()`` returns them for an index of the pairs layout of
    about ``mb`` MB: a table at its load limit (``pairs.LOAD_MAX``, an index sized up front)
    of random fingerprints, each of a random node's gpu, host or disk column; and its pairs."""
    from kvtier.client.routing import pairs  # noqa: PLC0415

    earlier = earlier_state_of(0.001, 1 + (3 * nodes) // 64, nodes, seed)  # (only its meta: columns and nodes)
    slots = int(mb * 1e6 / 10)
    n = int(slots * pairs.LOAD_MAX) - 1
    rng = np.random.default_rng(seed)
    fps = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    fps[fps == 0] = 1  # (0: an empty slot)
    ncols = len(json.loads(bytes(earlier["meta"]).decode())["columns"])
    cols = (rng.integers(0, ncols, size=n) + 2).astype(np.uint16)
    table = pairs.PairTable(n)
    pairs._cpairs.rehash(fps, cols, table.fps, table.cols)
    del fps, cols
    meta = json.loads(bytes(earlier["meta"]).decode())
    meta.update(format=2, layout="pairs", ncols=ncols + 2)
    return {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), "pair_fps": table.fps,
            "pair_cols": table.cols, "router_meta": earlier["router_meta"]}, n


def import_s(reps: int = 3) -> float:
    """A fresh interpreter importing the route-server and the Redis client (best of ``reps``)."""
    best = float("inf")
    for _ in range(reps):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import kvtier.client.routing.route_server, redis.cluster"], check=True)
        best = min(best, time.monotonic() - t)
    return best


def point(store_of, mb: float, words: int, reps: int = 1, module=None, layout: str = "matrix") -> dict:  # noqa: ANN001
    """The best of ``reps`` saves and loads of one size (``module``: the snapshot module
    measured; ``layout``: the index's; ``rows`` are pairs for the pairs layout)."""
    best: dict = {}
    if layout == "pairs":
        arrays, rows = pairs_state_of(mb)
        earlier = None
    else:
        arrays, earlier = state_of(mb, words)
        rows = len(earlier["key_lengths"])
    for _ in range(reps):
        p = _once(store_of, arrays, rows, words, module, layout)
        if earlier is not None:
            p["earlier_index_s"] = _earlier_index_s(earlier, rows)
        best = {k: min(v, best.get(k, v)) if k.endswith("_s") else v for k, v in p.items()}
    size = best["mb"]
    best.update(layout=layout, save_mb_per_s=round(size / (best["encode_s"] + best["store_s"]), 1),
                load_mb_per_s=round(size / best["load_s"], 1), fetch_mb_per_s=round(size / best["fetch_s"], 1),
                index_rows_per_s=round(best["rows"] / max(best["index_s"], 1e-6)))
    if earlier is not None:
        best["earlier_index_rows_per_s"] = round(best["rows"] / best["earlier_index_s"])
    return best


def _earlier_index_s(earlier: dict, rows: int) -> float:
    from kvtier.client.routing.router import Router  # noqa: PLC0415

    router = Router()
    t = time.monotonic()
    router.load_arrays(dict(earlier))
    took = time.monotonic() - t
    assert len(router.index) == rows, (len(router.index), rows)
    return round(took, 3)


def _once(store_of, arrays: dict, rows: int, words: int, module=None, layout: str = "matrix") -> dict:  # noqa: ANN001
    from kvtier.client.routing import snapshot  # noqa: PLC0415
    from kvtier.client.routing.router import Router, RouterConfig  # noqa: PLC0415

    S = module or snapshot  # noqa: N806

    class _State:  # what state_bytes asks of a router
        def state_arrays(self) -> dict:
            return dict(arrays)

        def positions(self) -> dict:
            return {}

        def indexed_keys(self) -> int:
            return rows

    t = time.monotonic()
    data, info = S.state_bytes(_State())
    encode = time.monotonic() - t
    store = store_of(S)
    store.manifest()  # connected
    t = time.monotonic()
    store.save(data, info)
    save = time.monotonic() - t
    size = len(data)
    del data
    store.close()
    # a replica starting: a new client (connect_s), then the load
    store = store_of(S)
    t = time.monotonic()
    store.manifest()
    connect = time.monotonic() - t
    t = time.monotonic()
    got = store.load()
    fetch = time.monotonic() - t
    assert got is not None
    data, m = got
    t = time.monotonic()
    decoded = S.decode(data) if hasattr(S, "decode") else _decode_by_numpy_load(data)
    decode = time.monotonic() - t
    del data, got
    router = Router(RouterConfig(index_layout=layout))
    t = time.monotonic()
    router.load_arrays(decoded)
    index = time.monotonic() - t
    assert len(router.index) == rows, (len(router.index), rows)
    store.close()
    del decoded, router
    return {"mb": round(size / 1e6, 1), "rows": rows, "words": words, "chunks": m["chunks"],
            "encode_s": round(encode, 3), "store_s": round(save, 3), "connect_s": round(connect, 4),
            "fetch_s": round(fetch, 3), "decode_s": round(decode, 3), "index_s": round(index, 3),
            "load_s": round(fetch + decode + index, 3)}


def _decode_by_numpy_load(data: bytes) -> dict:
    import io  # noqa: PLC0415

    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", default="50,200,1000", help="snapshot sizes, MB [%(default)s]")
    ap.add_argument("--words", type=int, default=1, help="64-bit words of location bits per row [%(default)s]")
    ap.add_argument("--reps", type=int, default=3, help="the best of this many saves and loads per size")
    ap.add_argument("--plaintext", action="store_true", help="a Redis Cluster without TLS")
    ap.add_argument("--layout", default="matrix", choices=("matrix", "pairs"),
                    help="the index layout saved and loaded (pairs: a table at its load limit) [%(default)s]")
    args = ap.parse_args(argv)
    from redis_cluster import RedisCluster  # noqa: PLC0415

    from kvtier.client.routing import snapshot  # noqa: PLC0415

    sizes = [float(x) for x in args.mb.split(",") if x]
    cluster = RedisCluster(secure=not args.plaintext, maxmemory=f"{int(2.5 * max(sizes)) + 256}mb").start()
    out = []
    try:
        def store_of(module=snapshot):  # noqa: ANN001, ANN202
            if args.plaintext:
                return module.SnapshotStore([("127.0.0.1", p) for p in cluster.ports], "bench")
            return module.SnapshotStore([("127.0.0.1", p) for p in cluster.ports], "bench",
                                        tls_ca=cluster.file("redis-ca.pem"), tls_cert=cluster.file("kvtier-client.pem"),
                                 tls_key=cluster.file("kvtier-client.key"), user=cluster.USER,
                                        password=cluster.password)

        fixed = round(import_s(), 3)
        for mb in sizes:
            p = {"tls": not args.plaintext, "import_s": fixed, **point(store_of, mb, args.words, args.reps, layout=args.layout)}
            print(json.dumps(p), flush=True)
            out.append(p)
    finally:
        cluster.stop()
    print(json.dumps({"points": out}))
    return out


if __name__ == "__main__":
    main()

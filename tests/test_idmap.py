"""The host tier's id map (tiers/idmap.py): the compiled map (tiers/_idmap.c) is built by the
install and gives the same answers as the pure-Python one on random operations (sets, moves,
a ref taken over by another id, deletes, pops, growth past many resizes, ids of every length),
raises the same errors, and keeps no Python object per id (its memory per held 32-byte id)."""

from __future__ import annotations

import gc
import os
import random
import tracemalloc

import pytest

from kvtier.tiers import idmap
from kvtier.tiers.idmap import MAX_ID, PyIdMap, new_idmap

needs_c = pytest.mark.skipif(not idmap.COMPILED, reason="the compiled id map is not built")


def test_the_install_built_the_compiled_map() -> None:
    assert idmap.COMPILED, "kvtier.tiers._idmap is missing: pip install the project with gcc and python3-dev"


def state(m) -> tuple:
    return sorted(m.items()), sorted(m), sorted(m.values()), len(m)


def one_op(rng: random.Random, c, p, sizes: list[int], k: bytes) -> None:
    """One random operation on both maps, checking that they answer alike."""
    op = rng.random()
    cls = rng.randrange(len(sizes))
    ref = cls << 32 | rng.randrange(sizes[cls])
    if op < 0.5:
        c[k] = ref
        p[k] = ref
    elif op < 0.7:
        assert (k in c) == (k in p)
        if k in p:
            del c[k]
            del p[k]
        else:
            with pytest.raises(KeyError):
                del c[k]
    elif op < 0.8:
        assert c.pop(k, -7) == p.pop(k, -7)
    else:
        assert c.get(k) == p.get(k) and c.get(k, 5) == p.get(k, 5)
        assert c.id_of(ref) == p.id_of(ref)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_python_maps_agree_on_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    c, p = new_idmap(compiled=True), new_idmap(compiled=False)
    assert type(p) is PyIdMap and type(c) is not PyIdMap
    sizes = [rng.randint(1, 3000) for _ in range(3)]
    for n in sizes:
        assert c.add_class(n) == p.add_class(n)
    # a pool of ids: mostly one length, some others (0 to MAX_ID bytes), a few sharing prefixes
    pool = [rng.randbytes(32) for _ in range(4000)] + [rng.randbytes(rng.randint(0, MAX_ID)) for _ in range(200)]
    pool += [pool[0][:k] for k in range(0, 32, 5)]
    for step in range(20000):
        one_op(rng, c, p, sizes, rng.choice(pool))
        if step % 2500 == 0:
            assert state(c) == state(p)
    assert state(c) == state(p)
    for k in pool:
        assert c.get(k) == p.get(k)
        if k in p:
            assert c[k] == p[k] and c.id_of(p[k]) == k
    for cls, n in enumerate(sizes):
        for slot in range(n):
            assert c.id_of(cls << 32 | slot) == p.id_of(cls << 32 | slot)


@pytest.mark.parametrize("compiled", [True, False])
def test_errors_and_contract(compiled: bool) -> None:
    if compiled and not idmap.COMPILED:
        pytest.skip("the compiled id map is not built")
    m = new_idmap(compiled=compiled)
    assert m.add_class(4) == 0 and m.add_class(2) == 1
    m[b"a"] = 1
    m[b"b"] = 1 << 32 | 1
    assert m[b"a"] == 1 and len(m) == 2 and m.id_of(1) == b"a" and m.id_of(2) is None
    m[b"c"] = 1                      # a ref holds one id: a is dropped
    assert b"a" not in m and m[b"c"] == 1 and m.id_of(1) == b"c"
    m[b"c"] = 3                      # an id moves
    assert m[b"c"] == 3 and len(m) == 2 and m.id_of(1) == b"c"  # the old record keeps the id
    del m[b"c"]
    assert m.id_of(3) == b"c" and b"c" not in m  # kept after del
    with pytest.raises(KeyError):
        m[b"c"]
    with pytest.raises(KeyError):
        m.pop(b"c")
    for bad in (4, 2 << 32, 1 << 32 | 2, -1):
        with pytest.raises(ValueError, match="names no slot"):
            m[b"x"] = bad
    with pytest.raises(ValueError, match="at most 254 bytes"):
        m[bytes(MAX_ID + 1)] = 0
    with pytest.raises(TypeError):
        m["str"] = 0  # type: ignore[index]
    with pytest.raises(TypeError):
        None in m  # noqa: B015
    assert len(m) == 1 and list(m) == [b"b"]
    it = iter(m)
    m[b"d"] = 0
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(it)


@needs_c
def test_the_compiled_map_keeps_no_object_per_id() -> None:
    n = 200_000
    m = new_idmap(compiled=True)
    m.add_class(n)
    ids = [random.Random(1).randbytes(32) for _ in range(1)] + [i.to_bytes(32, "little") for i in range(1, n)]
    gc.collect()
    tracemalloc.start()
    for i, k in enumerate(ids):
        m[k] = i
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # the table (8 B an entry, at most half full after growth: <= 16 B an id) and the records
    # (33 B a slot) are raw memory; no Python object is made per id
    assert traced < 1 << 20, traced
    assert m.nbytes() <= n * (33 + 8 * 4), m.nbytes()
    assert all(m[k] == i for i, k in enumerate(ids[:1000]))


@needs_c
def test_the_host_tier_keeps_no_python_object_per_held_block(tmp_path) -> None:
    """Issue 15 item 5: a held block costs the host tier no bytes object, int or dict slot (a
    dict of 32-byte ids to ints cost about 150 B a block; the id map's records and table are
    raw memory, made as the class is or as the map grows)."""
    from kvtier.tiers.host import HostTier

    n, slot = 20_000, 4096
    shm = os.path.join("/dev/shm", f"kvtier-idmap-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(shm)
    tier = HostTier(shm, n * slot, "t")
    try:
        order = tier.recency()
        cls = tier.size_class(slot)

        def put(first: int) -> None:  # ids made here, held by nobody but the tier afterwards
            res = tier.reserve(cls, [bytes(16) + i.to_bytes(16, "little") for i in range(first, first + 1000)], slot)
            for e in res.entries:
                assert e is not None and tier.commit(e)
                order[e.bkey] = 1

        put(0)  # the class's arrays, the first table sizes
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for first in range(1000, n, 1000):
            put(first)
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / (n - 1000)
        tracemalloc.stop()
        assert len(tier.entries) == n and len(order) == n
        assert list(order)[:2] == [bytes(16) + i.to_bytes(16, "little") for i in range(2)]
        assert per_block < 16, per_block
    finally:
        tier.close()
        os.rmdir(shm)

"""The host tier's id map (tiers/idmap.py): the compiled map (tiers/_idmap.c) is built by the
install and gives the same answers as the pure-Python one on random operations (sets, moves,
a ref taken over by another id, deletes, pops, growth past many resizes, ids of every length),
raises the same errors, and keeps no Python object per id (its memory per held 32-byte id)."""

from __future__ import annotations

import gc
import os
import random
import tracemalloc

import numpy as np
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
    for bad in (1.0, "1", None):
        with pytest.raises(TypeError):
            m[b"x"] = bad  # type: ignore[assignment]
    m[b"n"] = np.int64(1 << 32)  # numpy's integers are refs in both maps, and read back as ints
    assert m[b"n"] == 1 << 32 and type(m[b"n"]) is int and m.id_of(np.int64(1 << 32)) == b"n"
    del m[b"n"]
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
    """A held block costs the host tier no bytes object, int or dict slot (a
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


# -- hostile inputs ----------------------------------------------------------------------------
# Each hostile call must raise a clean exception (the fallback's), never crash: the checks run
# in a child process, so a crash fails the test instead of killing the run.

def _in_child(fn: str) -> None:
    import subprocess
    import sys

    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_idmap; test_idmap.{fn}()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _outcome(f, *args):
    try:
        return "ok", f(*args)
    except Exception as e:  # noqa: BLE001 - the type is the answer
        return type(e).__name__, None


def hostile_idmap_calls() -> None:
    """Both maps answer each hostile call alike: the same value or the same exception type."""
    maps = [new_idmap(compiled=True), new_idmap(compiled=False)]
    for m in maps:
        assert list(m) == [] and list(m.items()) == [] and len(m) == 0 and m.pop(b"a", 3) == 3
        assert m.add_class(3) == 0 and m.add_class(0) == 1
    bad_ids = ["str", bytearray(b"ab"), memoryview(b"ab"), 5, None, 1.5, bytes(MAX_ID + 1), bytes(5000)]
    bad_refs = [1.5, "1", None, b"\0", -1, 3, 1 << 32, 2 << 32, 1 << 63, 1 << 64, -(1 << 64), 1 << 200]
    calls = [(lambda m, k: m.__setitem__(k, 0), bad_ids), (lambda m, k: m[k], bad_ids),
             (lambda m, k: k in m, bad_ids), (lambda m, k: m.get(k), bad_ids), (lambda m, k: m.pop(k, 1), bad_ids),
             (lambda m, k: m.__delitem__(k), bad_ids), (lambda m, r: m.__setitem__(b"k", r), bad_refs),
             (lambda m, r: m.id_of(r), bad_refs),
             (lambda m, n: m.add_class(n), [-1, 1 << 32, 1 << 64, -(1 << 70), "3", 1.0, None]),
             (lambda m, a: m.get(*a), [(), (b"a", 1, 2)]), (lambda m, a: m.pop(*a), [(), (b"a", 1, 2)])]
    for f, values in calls:
        for v in values:
            got = [_outcome(f, m, v) for m in maps]
            assert got[0] == got[1], (v, got)
            assert got[0][0] in ("ok", "TypeError", "ValueError", "KeyError"), (v, got)
    for n in (0, 1, 7, 8, 9, MAX_ID):  # every length up to the limit is held
        for m in maps:
            m[bytes([n % 256]) * n] = 0 if n < 8 else 1
    assert sorted(maps[0].items()) == sorted(maps[1].items())
    # an iterator keeps its map alive; a change during iteration is refused, not walked over
    it = iter(maps[0])
    del maps[0][next(iter(maps[1]))]
    try:
        next(it)
        raise AssertionError("no RuntimeError")
    except RuntimeError:
        pass
    it = maps[0].items()
    del maps
    assert isinstance(list(it), list)


def reinit_keeps_a_holding_map_whole() -> None:
    """__init__ again with another seed (a map's hashing is fixed once it holds ids): refused,
    and every id is still found. (Before the fix the new seed hid every held id.)"""
    m = new_idmap(compiled=True)
    m.add_class(100)
    for i in range(100):
        m[i.to_bytes(32, "little")] = i
    try:
        m.__init__(12345)
    except RuntimeError:
        pass
    assert all(m.get(i.to_bytes(32, "little")) == i for i in range(100))
    m[b"new"] = 5
    assert len(m) == 100 and m[b"new"] == 5 and m.id_of(5) == b"new"
    fresh = type(m).__new__(type(m))  # never initialised: a working, empty map
    fresh.add_class(2)
    fresh[b"a"] = 1
    assert fresh[b"a"] == 1 and list(fresh) == [b"a"]


@needs_c
def test_hostile_calls_raise_the_fallbacks_errors_never_crash() -> None:
    _in_child("hostile_idmap_calls")


@needs_c
def test_a_second_init_cannot_hide_held_ids() -> None:
    _in_child("reinit_keeps_a_holding_map_whole")


def _colliding_ids(words: int, count: int, rng: random.Random) -> list[bytes]:
    """Ids that the old step (h = (h ^ w) * K; h ^= h >> 29) hashed alike whatever the seed:
    flipping a word's top bit and the next word's bits 63 and 34 cancels out."""
    import struct

    base = [rng.getrandbits(64) for _ in range(words)]
    out = []
    for j in range(count):
        w = list(base)
        for pair in range(words // 2):
            if j >> pair & 1:
                w[2 * pair] ^= 1 << 63
                w[2 * pair + 1] ^= (1 << 63) | (1 << 34)
        out.append(struct.pack(f"<{words}Q", *w))
    return out


@needs_c
def test_the_seeded_hash_has_no_seed_independent_collisions() -> None:
    """Hash flooding: 8192 ids built to collide under the old hash for every seed (full 64-bit
    collisions, so each insertion walked all the others: quadratic) insert about as fast as
    random ids of the same length. Before the fix they were ~100x slower."""
    import time

    rng = random.Random(7)
    n = 1 << 13
    evil, plain = _colliding_ids(26, n, rng), [rng.randbytes(208) for _ in range(n)]

    def fill(ids: list[bytes]) -> float:
        best = 1e9
        for _ in range(3):
            m = new_idmap(compiled=True)
            m.add_class(n)
            t0 = time.perf_counter()
            for i, k in enumerate(ids):
                m[k] = i
            best = min(best, time.perf_counter() - t0)
            assert len(m) == n
        return best

    t_plain, t_evil = fill(plain), fill(evil)
    assert t_evil < 8 * t_plain + 0.02, (t_evil, t_plain)

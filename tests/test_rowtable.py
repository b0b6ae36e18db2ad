"""The index's key table (client/routing/rowtable.py) against a dict, and the index's rows
for requests with keys of zeros and of other lengths (exact: a row only for an equal key)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.client.routing import rowtable
from kvtier.client.routing.index import LocationIndex
from kvtier.client.routing.rowtable import RowTable

FP = b"\x01" * 16


def _key(rng: random.Random, known: list[bytes]) -> bytes:
    c = rng.random()
    if c < 0.3 and known:
        return rng.choice(known)
    if c < 0.35:
        return rng.randbytes(rng.choice([0, 3, 15, 17, 32]))
    if c < 0.4:
        return bytes(16) if rng.random() < 0.5 else bytes(15) + b"\x01"
    if c < 0.55:
        return f"k{rng.randint(0, 5000):014d}".encode()[:16].ljust(16, b".")  # alike: one word shared
    return rng.randbytes(16)


def test_rowtable_equals_a_dict_through_inserts_drops_and_growth() -> None:
    rng = random.Random(3)
    table, ref = RowTable(), {}
    nxt, free = 1, []
    for it in range(250):
        ks = [_key(rng, list(ref)) for _ in range(rng.randint(0, 300))]
        assert table.find(ks).tolist() == [ref.get(k, -1) for k in ks], it
        assert [table.get(k, -1) for k in ks] == [ref.get(k, -1) for k in ks], it
        new = list(dict.fromkeys(k for k in ks if k not in ref))
        rows = []
        for k in new:
            if free:
                r = free.pop()
            else:
                r, nxt = nxt, nxt + 1
            ref[k] = r
            rows.append(r)
        table.insert(new, np.array(rows, dtype=np.int64))
        if rng.random() < 0.1 and ref:
            gone = rng.sample(list(ref), len(ref) // 3)
            table.drop(np.array([ref[k] for k in gone], dtype=np.int64))
            free.extend(ref.pop(k) for k in gone)
        assert len(table) == len(ref)
    assert sorted(table.items()) == sorted(ref.items())
    assert all(table.key(r) == k for k, r in ref.items())


def test_index_rows_are_exact_for_zero_keys_and_other_lengths() -> None:
    rng = random.Random(5)
    idx = LocationIndex()
    stored: list[bytes] = []
    for _ in range(40):
        batch = list(dict.fromkeys(_key(rng, stored) for _ in range(rng.randint(1, 60))))
        idx.stored("n", "host", "", FP, batch)
        stored.extend(k for k in batch if k not in stored)
    row = {k: idx._rows[k] for k in stored}
    assert len(set(row.values())) == len(row)
    for _ in range(300):
        start = rng.randrange(len(stored))
        req = stored[start:start + rng.randint(1, 40)]  # runs of stored keys, then others mixed in
        if rng.random() < 0.5:
            req = req + [_key(rng, stored) for _ in range(rng.randint(0, 8))]
        rows, m = idx.rows(req)
        want = [row.get(k, -1) for k in req]
        assert rows[1:-1].tolist() == want and rows[0] == rows[-1] == -1
        assert m == (want.index(-1) if -1 in want else len(req))


def test_a_key_of_zeros_never_takes_a_free_row_or_one_of_another_length() -> None:
    idx = LocationIndex()
    a, b = b"a" * 16, b"b" * 16
    idx.stored("n", "host", "", FP, [a, b"odd", b])  # b"odd" has a row; its packed key is zeros
    assert idx.rows([a, bytes(16)]).rows.tolist() == [-1, idx._rows[a], -1, -1]
    idx.stored("n", "host", "", FP, [bytes(16)])
    assert idx.rows([a, bytes(16)]).rows.tolist() == [-1, idx._rows[a], idx._rows[bytes(16)], -1]


def test_state_keeps_keys_of_every_length() -> None:
    idx = LocationIndex()
    ks = [b"a" * 16, b"odd", bytes(16), b"x" * 40, b"b" * 16]
    idx.stored("n", "host", "", FP, ks)
    copy = LocationIndex()
    copy.load_state(idx.state())
    assert copy.locations() == idx.locations() == {("n", "host", "", FP): set(ks)}
    assert [copy._rows.get(k) is not None for k in ks] == [True] * 5


@pytest.mark.parametrize("compiled", [True, False])
def test_random_keys_fill_a_large_table_to_its_limit_without_growing(compiled: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Random keys fill a table to ``room`` (3/4 of its slots) at its size: every key finds a
    slot in one of its two buckets (the first overflow comes at 0.83-0.86 of 2^20 to 2^27 slots),
    so the table does not double at a low fill as it grows large."""
    if compiled and rowtable._croute is None:
        pytest.skip("the compiled table is not built")
    if not compiled:
        monkeypatch.setattr(rowtable, "_croute", None)
    size = 1 << (22 if compiled else 18)
    n = rowtable.room(size)
    assert n >= 0.75 * size
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)
    t = RowTable.restore(packed, np.ones(n, dtype=np.bool_), slots=size)
    assert len(t.slots) == size and np.count_nonzero(t.slots >= 0) == n
    sample = rng.choice(n, 100_000, replace=False)
    assert t.find_packed(packed[sample].tobytes()).tolist() == sample.tolist()
    absent = rng.integers(0, 2**63, size=(1000, 2), dtype=np.uint64)
    assert (t.find_packed(absent.tobytes()) == -1).all()

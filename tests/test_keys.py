from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvtier.client.engine.keys import ROOT_KEY, Namespace, as_key, block_keys
from kvtier.tiers.vocab import KEY_MAX, KEY_MIN


def reference(tokens: list[int], block_tokens: int, ns: Namespace) -> list[bytes]:
    prev, out = ROOT_KEY, []
    for i in range(len(tokens) // block_tokens):
        blob = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_tokens:(i + 1) * block_tokens])
        prev = hashlib.blake2b(prev + blob, digest_size=16, key=ns.digest()).digest()
        out.append(prev)
    return out


def test_matches_the_specified_construction() -> None:
    ns = Namespace("meta-llama/Llama-3.1-8B", "tenant-a")
    toks = list(range(1000, 1000 + 70))
    assert block_keys(toks, 16, ns) == reference(toks, 16, ns)


def test_only_full_blocks_and_chaining() -> None:
    toks = np.arange(50, dtype=np.int64)
    keys = block_keys(toks, 16, "m")
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    # continuing from a parent gives the same chain
    assert block_keys(toks[16:48], 16, "m", parent=keys[0]) == keys[1:3]
    # a change in block 0 changes every later key (chained), a change in block 2 only key 2
    t2 = toks.copy()
    t2[3] += 1
    assert all(a != b for a, b in zip(block_keys(t2, 16, "m"), keys, strict=True))
    t3 = toks.copy()
    t3[40] += 1
    k3 = block_keys(t3, 16, "m")
    assert k3[:2] == keys[:2] and k3[2] != keys[2]


def test_namespaces_separate_key_spaces() -> None:
    toks = list(range(32))
    a = block_keys(toks, 16, Namespace("m", "tenant-a"))
    b = block_keys(toks, 16, Namespace("m", "tenant-b"))
    c = block_keys(toks, 16, Namespace("other-model"))
    assert not set(a) & set(b) and not set(a) & set(c)
    assert block_keys(toks, 16, "m") == block_keys(toks, 16, Namespace("m"))


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2, 3], 0, "m")
    with pytest.raises(ValueError):
        block_keys([-1] * 16, 16, "m")
    with pytest.raises(ValueError):
        block_keys([2**32] * 16, 16, "m")
    with pytest.raises(TypeError):
        block_keys([1] * 16, 16, b"short")


def test_engine_hashes_as_keys() -> None:
    assert as_key(5) == (5).to_bytes(8, "little")
    assert len(as_key(2**100)) == 16
    assert as_key(b"x" * 32) == b"x" * 32
    with pytest.raises(ValueError):
        as_key(b"short")
    assert as_key(b"y" * KEY_MIN) == b"y" * KEY_MIN
    with pytest.raises(ValueError, match=f"{KEY_MIN} to {KEY_MAX} bytes"):
        as_key(b"x" * (KEY_MAX + 1))

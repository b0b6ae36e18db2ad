"""The compiled decision's own tie digest (client/routing/_route.c ``digest64``, BLAKE2b with an
8-byte digest, made inside ``decide`` for the request's last key): the same number as
scoring._digest64 (hashlib) for every length a key can have there."""

from __future__ import annotations

import random

import pytest

from kvtier.client.routing import index as index_mod
from kvtier.client.routing.scoring import _digest64

needs_c = pytest.mark.skipif(index_mod._croute is None, reason="the compiled decision is not built")


@needs_c
def test_digest64_equals_hashlib_blake2b() -> None:
    digest64 = index_mod._croute.digest64
    rng = random.Random(7)
    for n in range(129):
        for data in (bytes(n), b"\xff" * n, rng.randbytes(n), rng.randbytes(n)):
            assert digest64(data) == _digest64(data), (n, data.hex())
    with pytest.raises(TypeError, match="at most 128"):
        digest64(bytes(129))
    with pytest.raises(TypeError):
        digest64("not bytes")

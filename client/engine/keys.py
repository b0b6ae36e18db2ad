"""Block keys: chained hashes that name a block and everything before it.

``key_i = blake2b(key_{i-1} || tokens_i as little-endian uint32, digest_size=16,
key=namespace_digest)``, with ``key_{-1}`` sixteen zero bytes. The namespace (model id and a
tenant salt, serialised as canonical JSON) is hashed to the 32-byte blake2b key, so two
tenants never share a key space, while tensor-parallel ranks of one model do (routers need
one key space per model). Only full blocks get keys.

Keys from elsewhere (an engine's own block hashes) are accepted by the daemon as opaque
bytes of ``KEY_MIN`` to ``KEY_MAX`` bytes (:mod:`kvtier.tiers.vocab`); :func:`as_key` turns an
engine's integer hash into such bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.tiers.vocab import key_problem

ROOT_KEY = bytes(16)
KEY_BYTES = 16
NAMESPACE_DIGEST_BYTES = 32


@dataclass(frozen=True)
class Namespace:
    """What separates key spaces: the model and a tenant salt.

    The salt is secret: a client of a local kvtierd uses the daemon's salt for its tenant
    (``Sidecar.key_salt``, :func:`daemon_key_salt`, :meth:`for_daemon`), so that no other
    tenant can compute its keys (and so probe whether its prefixes are cached). An empty salt
    makes keys anyone can compute; kvtier's own integrations never default to it."""

    model: str
    tenant_salt: str = ""

    @classmethod
    def for_daemon(cls, model: str, sidecar: Any) -> Namespace:
        """The namespace of ``model`` under the daemon's secret salt for ``sidecar``'s tenant."""
        salt = sidecar.key_salt
        if not salt:
            raise ValueError("the daemon gave no key salt (it hands it out only over its unix socket): "
                             "give tenant_salt explicitly")
        return cls(model, salt)

    def digest(self) -> bytes:
        blob = json.dumps({"model": self.model, "tenant_salt": self.tenant_salt},
                          sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=NAMESPACE_DIGEST_BYTES).digest()


def _ns_digest(namespace: Namespace | str | bytes) -> bytes:
    if isinstance(namespace, Namespace):
        return namespace.digest()
    if isinstance(namespace, str):
        return Namespace(namespace).digest()
    if isinstance(namespace, bytes) and len(namespace) == NAMESPACE_DIGEST_BYTES:
        return namespace
    raise TypeError("namespace is a Namespace, a model id string, or a 32-byte namespace digest")


def block_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, namespace: Namespace | str | bytes,
               parent: bytes | None = None) -> list[bytes]:
    """Chained keys of every full block of ``token_ids``; ``parent`` is the key of the block
    before the first token (None: the start of the sequence)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    toks = np.asarray(token_ids)
    if toks.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if toks.size and (toks.min() < 0 or toks.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    data = toks.astype("<u4", copy=False).tobytes()
    nsd = _ns_digest(namespace)
    prev = ROOT_KEY if parent is None else parent
    step = block_tokens * 4
    out = []
    for i in range(len(toks) // block_tokens):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, key=nsd)
        h.update(data[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def daemon_key_salt(socket: str | None = None, timeout: float | None = 5.0) -> str:
    """The key salt the local kvtierd (at ``socket``: as :func:`~kvtier.client.engine.transport.socket_path`)
    hands this process's tenant: one credential handshake. Raises
    :class:`~kvtier.client.engine.transport.KvtierError` (``Unavailable`` with no daemon there)."""
    from kvtier.client.engine.transport import handshake_error, socket_path
    from kvtier.handshake import Credentials, HandshakeError

    creds = Credentials(socket_path(socket), "key-salt", timeout)
    try:
        creds.connect()
    except HandshakeError as e:
        raise handshake_error(e) from None
    try:
        return creds.key_salt
    finally:
        creds.close()


def as_key(engine_hash: int | bytes) -> bytes:
    """An engine's own block hash as a daemon key: ints become 8 (or 16) little-endian bytes."""
    if isinstance(engine_hash, bytes):
        why = key_problem(engine_hash)
        if why is not None:
            raise ValueError(f"not a key: {why}")
        return engine_hash
    v = int(engine_hash) & ((1 << 128) - 1)
    return v.to_bytes(8 if v < (1 << 64) else 16, "little")

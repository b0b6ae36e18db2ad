"""The block keys of a request, as the replicas' kvtierds publish them.

Two schemes (``--keys``):

``vllm`` (default): the keys kvtier's vLLM offloading spec (:mod:`kvtier.client.vllm`) stores.
    vLLM hashes each full block of ``block_tokens`` tokens, chained: ``h_i = sha256(pickle((h_{i-1},
    tuple(tokens_i), None)))`` (its default ``prefix_caching_hash_algo`` ``sha256``, pickle
    protocol 5), with ``h_{-1} = sha256(pickle(seed))``, the seed being the engine's
    ``PYTHONHASHSEED`` when it sets one, else ``"vllm-none-hash"``. Its offloading connector
    keys a chunk of ``chunk_blocks`` blocks by the hash of the chunk's last block and the
    KV-cache group (``h || group as u32 big-endian``); kvtier's spec gives each block of the
    chunk ``blake2b(chunk_key || i as u32 LE, digest_size=16, key=Namespace(model, salt).digest())``.
    This module recomputes all of that without importing vLLM (``tests/test_gateway.py``
    checks it against vLLM's own functions). Requests that carry extra hash keys in vLLM
    (LoRA, multimodal inputs, ``cache_salt``) get other engine hashes: the gateway does not
    route those by prefix (:func:`has_extra_keys`).
``tokens``: kvtier's own chained keys (:func:`kvtier.client.engine.keys.block_keys`), what
    engines that key by token ids publish and what ``route-server --vllm-events`` indexes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from kvtier.client.engine.keys import Namespace, block_keys

VLLM_DEFAULT_SEED = "vllm-none-hash"
SCHEMES = ("vllm", "tokens")


class KeyScheme:
    """Request token ids -> the kvtier keys its blocks are published under."""

    def __init__(self, scheme: str, block_tokens: int, namespace: Namespace, chunk_blocks: int = 1,
                 vllm_seed: str = VLLM_DEFAULT_SEED, group: int = 0) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"key scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
        if block_tokens <= 0 or chunk_blocks <= 0:
            raise ValueError("block_tokens and chunk_blocks must be positive")
        self.scheme, self.block_tokens, self.chunk_blocks = scheme, block_tokens, chunk_blocks
        self.namespace = namespace
        self._digest = namespace.digest()
        self._root = hashlib.sha256(pickle.dumps(vllm_seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        self._group = group.to_bytes(4, "big", signed=False)
        # as the vLLM spec's KeyMap: a block's distance from its chunk's last block
        self._suffix = [(chunk_blocks - 1 - i).to_bytes(4, "little") for i in range(chunk_blocks)]

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        if self.scheme == "tokens":
            return block_keys(token_ids, self.block_tokens, self._digest)
        return self.vllm_keys(token_ids)

    def chain(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """The chained value of every full block of ``token_ids`` (vLLM's block hashes, or the
        ``tokens`` keys), chained on ``parent`` (the value of the block before the first token;
        None: the start of the prompt)."""
        if self.scheme == "tokens":
            return block_keys(token_ids, self.block_tokens, self._digest, parent)
        return self.vllm_block_hashes(token_ids, parent)

    def keys_kept(self, blocks: int) -> int:
        """How many keys the first ``blocks`` blocks fully determine."""
        return blocks if self.scheme == "tokens" else blocks - blocks % self.chunk_blocks

    def keys_of_chain(self, chain: Sequence[bytes], start: int = 0) -> list[bytes]:
        """The keys of blocks ``start`` on (a :meth:`keys_kept` count), given every block's chained value."""
        if self.scheme == "tokens":
            return list(chain[start:])
        c, out, blake, digest = self.chunk_blocks, [], hashlib.blake2b, self._digest
        for end in range(start + c - 1, len(chain), c):  # only whole chunks are offloaded
            chunk = chain[end] + self._group
            out.extend(blake(chunk + s, digest_size=16, key=digest).digest() for s in self._suffix)
        return out

    def vllm_block_hashes(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """vLLM's block hashes (sha256) of every full block (chained on ``parent``, else the root)."""
        bt, out = self.block_tokens, []
        parent = self._root if parent is None else parent
        dumps, sha = pickle.dumps, hashlib.sha256
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        for start in range(0, len(ids) - bt + 1, bt):
            parent = sha(dumps((parent, tuple(ids[start:start + bt]), None), protocol=5)).digest()
            out.append(parent)
        return out

    def vllm_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.keys_of_chain(self.vllm_block_hashes(token_ids))


def has_extra_keys(body: dict[str, Any]) -> bool:
    """Whether vLLM hashes this request's blocks with extra keys (a cache salt, LoRA adapters
    named as the model, multimodal parts): its keys are then not the ones computed here."""
    if body.get("cache_salt"):
        return True
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") not in (None, "text")
                                             for p in content):
            return True
    return False

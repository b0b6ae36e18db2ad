"""Incremental prompts: a conversation's next turn costs what is new in it, not its whole history.

The gateway keeps, per conversation, what it computed for the conversation's last request: the
rendered prompt text, its token ids with their character offsets, the block hashes and the
block keys (:class:`PromptCache`, bounded by ``--prompt-cache-bytes``, least recently used
conversations dropped first). A conversation is named by its opening (every message up to
and including the first ``user`` one) together with the request's ``prompt_cache_key`` or
session, scoped to the client (``--api-keys-file``): one entry a conversation, replaced turn
after turn, except by a request whose text the stored one extends (an earlier turn arriving
after a later one, as turns sent at once do, or a repeated one): that request is computed from
the stored entry and leaves it in place for the turns after it.

A request whose conversation has an entry:

1. renders its chat template in full (the template alone decides the text: it may render an
   earlier message differently once a later one exists, so no part of the text is taken on
   trust) and finds how far the text agrees with the stored one (``D`` characters);
2. re-tokenizes from a restart point at or before ``D``: the start of the last special (added)
   token that ends well before ``D`` (the tokenizer splits added tokens out before anything
   else, so the text after one is tokenized on its own), else the start of a token at least
   ``RESTART_MARGIN`` characters before ``D`` that abuts the token before it. The stored tokens
   before the restart point are kept; the fresh tokens must reproduce the stored ones that end
   well before ``D`` (ids and offsets), else the restart point is not a clean cut for this
   tokenizer and the prompt is tokenized from scratch;
3. keeps the stored block hashes and keys of every block whose tokens are unchanged and hashes
   the rest, chained on the last kept block.

A conversation without an entry of its own starts from the latest other conversation of the
same client (any of its sessions; the client is its id under ``--api-keys-file``) whose
rendered text opened alike (its first ``OPENING_CHARS`` characters): a shared system prompt
and tools are tokenized and hashed once, then found by each new conversation that opens with
them, through the same steps (the text compared, the restart checked), so nothing of the other
conversation is taken on trust either.

A conversation without an entry (nor one that opened alike), a prompt with special tokens
added by the tokenizer (``add_special_tokens``), a slow (pure Python) tokenizer and
``--prompt-cache-bytes 0`` are computed from scratch; the keys are the same either way
(``tests/test_gateway_incremental.py`` compares both paths on every turn).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.gateway.tokenize import PromptTokenizer

RESTART_MARGIN = 64
"""Characters before the first changed one that a restart point without a special token keeps."""
MIN_SLACK = 8
"""Stored tokens ending within this many characters (or the longest added token's length, if
more) of the first changed one are not compared: the text after them differs."""
RESTART_TRIES = 3
_INT32 = array.array("i").itemsize == 4  # (token ids into numpy through a C int array: twice as fast)
OPENING_CHARS = 1024
"""A conversation without a stored turn starts from the latest other conversation (of the same
client) whose rendered text opened with the same this many characters: a shared system
prompt and tools are tokenized and hashed once, not once a conversation."""
MAX_OPENINGS = 4096


class _Entry:
    __slots__ = ("text", "ids", "offs", "special", "chain", "keys", "nbytes")

    def __init__(self, text: str, ids: np.ndarray, offs: np.ndarray, special: np.ndarray, chain: list[bytes],
                 keys: list[bytes]) -> None:
        self.text, self.ids, self.offs, self.special, self.chain, self.keys = text, ids, offs, special, chain, keys
        self.nbytes = (sys.getsizeof(text) + ids.nbytes + offs.nbytes + special.nbytes
                       + 80 * (len(chain) + len(keys)) + 512)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (C-speed comparisons, O(n) copying)."""
    n = min(len(a), len(b))
    if a.startswith(b[:n]) if len(b) <= len(a) else b.startswith(a):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


class PromptCache:
    """Chat prompts' token counts and block keys, incremental per conversation (module docstring)."""

    def __init__(self, tokenizer: PromptTokenizer, scheme: KeyScheme, max_bytes: int) -> None:
        self.tokenizer, self.scheme, self.max_bytes = tokenizer, scheme, max_bytes
        rt = getattr(tokenizer.tok, "_tokenizer", None)  # the Rust tokenizer of a fast one
        self.fast = rt if rt is not None and hasattr(rt, "encode") else None
        added: dict = {}
        if self.fast is not None and hasattr(self.fast, "get_added_tokens_decoder"):
            added = self.fast.get_added_tokens_decoder()
        # a restart at an added token is clean only where the tokenizer splits them out
        split = not getattr(self.fast, "encode_special_tokens", False)
        self.added = np.array(sorted(added) if split else [], dtype=np.int64)
        vocab = 0
        if self.added.size and hasattr(self.fast, "get_vocab_size"):
            vocab = int(self.fast.get_vocab_size(with_added_tokens=True))
        # token id -> whether it is an added token (over the whole vocabulary: looked up directly)
        self._is_added = np.zeros(max(int(self.added.max()) + 1, vocab) if self.added.size else 0, dtype=bool)
        self._is_added[self.added] = True
        self.slack = max([MIN_SLACK, *(len(getattr(t, "content", str(t))) + 1 for t in added.values())])
        self._lock = threading.Lock()
        self._d: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes = 0
        # the opening's name -> the latest conversation that opened so (least recent dropped first)
        self._openings: OrderedDict[bytes, bytes] = OrderedDict()
        self.counts = {"hit": 0, "shared": 0, "miss": 0, "resync": 0, "scratch": 0}

    def __len__(self) -> int:
        return len(self._d)

    # -- the entry's name -----------------------------------------------------------------------

    @staticmethod
    def conversation_key(body: Mapping[str, Any], scope: str) -> bytes:
        """The conversation a chat request continues: its opening messages (up to and including
        the first user one), its ``prompt_cache_key`` and session scope (``scope``)."""
        h = hashlib.sha256()  # (a key in this process's memory only: the fastest strong hash here)
        pck = body.get("prompt_cache_key")
        h.update(f"{scope}\0{pck if isinstance(pck, str) else ''}\0".encode(errors="surrogatepass"))
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                break
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True, default=str)
            h.update(f"{m.get('role')}\0{len(content)}\0".encode(errors="surrogatepass"))
            h.update(content.encode(errors="surrogatepass"))
            if m.get("role") == "user":
                break
        return h.digest()[:16]

    def _get(self, key: bytes) -> _Entry | None:
        with self._lock:
            e = self._d.get(key)
            if e is not None:
                self._d.move_to_end(key)
            return e

    def _put(self, key: bytes, e: _Entry) -> None:
        if e.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._d[key] = e
            self.bytes += e.nbytes
            while self.bytes > self.max_bytes:
                _, dropped = self._d.popitem(last=False)
                self.bytes -= dropped.nbytes

    # -- computing --------------------------------------------------------------------------------

    def chat(self, body: dict[str, Any], scope: str = "", with_keys: bool = True,
             client: str = "") -> tuple[list[bytes], int]:
        """(block keys, prompt tokens) of a chat request (``with_keys`` false: no keys, []).
        ``scope``: the conversation's session (or client) scope; ``client``: the client whose
        other conversations a new one may start from (its id under ``--api-keys-file``, else "")."""
        keys, n, _, _ = self.chat_prompt(body, scope, with_keys, client)
        return keys, n

    def chat_prompt(self, body: dict[str, Any], scope: str = "", with_keys: bool = True,
                    client: str = "") -> tuple[list[bytes], int, str, np.ndarray | None]:
        """As :meth:`chat`, with the rendered text and each token's end offset in it (None when
        the prompt was tokenized without offsets)."""
        text, add_special = self.tokenizer.chat_text(body)
        if self.fast is None or add_special or self.max_bytes <= 0 or not with_keys:
            ids = self.tokenizer.encode(text, add_special)
            return (self.scheme.keys(ids) if with_keys else []), len(ids), text, None
        key = self.conversation_key(body, scope)
        prev = self._get(key)
        entry = None
        if prev is not None:
            entry = self._extend(prev, text)
        elif len(text) >= OPENING_CHARS:  # a new conversation: from another that opened alike, if any
            like = self._opened_alike(text, client, key)
            if like is not None:
                entry = self._extend(like, text, "shared")
        if entry is None:
            entry = self._scratch(text)
        if not (prev is not None and len(prev.text) > len(text) and prev.text.startswith(text)):
            self._put(key, entry)  # (else the stored text extends this one: it stays, for the turns after it)
        return entry.keys, len(entry.ids), text, entry.offs[:, 1]

    def _opened_alike(self, text: str, client: str, key: bytes) -> _Entry | None:
        """The latest other conversation of ``client`` whose text opened as ``text`` does (its
        first OPENING_CHARS characters), if still stored; conversation ``key`` becomes the latest."""
        h = hashlib.blake2b(client.encode(errors="surrogatepass"), digest_size=16)
        h.update(b"\0")
        h.update(text[:OPENING_CHARS].encode(errors="surrogatepass"))
        opening = h.digest()
        with self._lock:
            other = self._openings.get(opening)
            self._openings[opening] = key
            self._openings.move_to_end(opening)
            if len(self._openings) > MAX_OPENINGS:
                self._openings.popitem(last=False)
        return self._get(other) if other is not None else None

    def _encode(self, text: str, at: int = 0) -> tuple[np.ndarray, np.ndarray]:
        # (encode_batch: the same encoding as encode, with the GIL released while the Rust
        # tokenizer works, so a decision in the gateway's thread pool runs beside the event loop)
        enc = self.fast.encode_batch([text[at:] if at else text], add_special_tokens=False)[0]  # type: ignore[union-attr]
        ids = enc.ids
        ids = np.frombuffer(array.array("i", ids), dtype=np.int32) if _INT32 else np.array(ids, dtype=np.int32)
        offs = np.fromiter(itertools.chain.from_iterable(enc.offsets), dtype=np.int32, count=2 * len(ids))
        offs = offs.reshape(-1, 2)
        if at:
            offs += at
        return ids, offs

    def _special(self, ids: np.ndarray) -> np.ndarray:
        if not self.added.size or not ids.size:
            return np.empty(0, dtype=np.int64)
        table = self._is_added
        try:
            return np.flatnonzero(table[ids])
        except IndexError:  # (an id past the vocabulary: not an added token)
            return np.flatnonzero(table[np.minimum(ids, len(table) - 1)] & (ids < len(table)))

    def _scratch(self, text: str) -> _Entry:
        with self._lock:
            self.counts["scratch"] += 1
        ids, offs = self._encode(text)
        chain = self.scheme.chain(ids.tolist())  # (Python ints: vLLM pickles them)
        return _Entry(text, ids, offs, self._special(ids), chain, self.scheme.keys_of_chain(chain))

    def _restarts(self, prev: _Entry, d: int):
        """Candidate restart points (token index, character), latest first (module docstring,
        step 2). A restart re-tokenizes from the end of the token before it, so text between
        tokens (whitespace a pre-tokenizer dropped or an offset trimmed) is read again."""
        offs, tries = prev.offs, 0
        for i in prev.special[::-1]:  # the last added token that ends well before the first change
            if offs[i, 1] <= d - self.slack:
                if i > 0 and offs[i - 1, 1] <= offs[i, 0]:
                    yield int(i), int(offs[i - 1, 1])
                    tries += 1
                break
        r = int(np.searchsorted(offs[:, 0], d - RESTART_MARGIN, side="right")) - 1
        while r > 0 and tries < RESTART_TRIES:
            if offs[r - 1, 1] <= offs[r, 0] and (r + 1 >= len(offs) or offs[r + 1, 0] >= offs[r, 1]):
                yield r, int(offs[r - 1, 1])
                tries += 1
            r -= 1

    def _extend(self, prev: _Entry, text: str, outcome: str = "hit") -> _Entry | None:
        """The new text's entry from the stored one, or None (tokenize from scratch).
        ``outcome``: what a success counts as ("hit": the conversation's own stored turn;
        "shared": another conversation's, whose failures are not counted)."""
        d = common_prefix_len(prev.text, text)
        if d <= self.slack:
            if outcome == "hit":
                with self._lock:
                    self.counts["miss"] += 1
            return None
        for r, at in self._restarts(prev, d):
            new_ids, new_offs = self._encode(text, at)
            # the stored tokens from the restart that end well before the change must come back
            m = int(np.searchsorted(prev.offs[r:, 1], d - self.slack, side="right"))
            # (equal lengths: m counts stored tokens from r)
            if m < 1 or len(new_ids) < m or not ((new_ids[:m] == prev.ids[r:r + m]).all()
                                                 and (new_offs[:m] == prev.offs[r:r + m]).all()):
                continue
            return self._join(prev, r, new_ids, new_offs, text, outcome)
        if outcome == "hit":
            with self._lock:
                self.counts["resync"] += 1
        return None

    def _join(self, prev: _Entry, r: int, new_ids: np.ndarray, new_offs: np.ndarray, text: str,
              outcome: str = "hit") -> _Entry:
        ids = np.concatenate((prev.ids[:r], new_ids))
        offs = np.concatenate((prev.offs[:r], new_offs))
        n = min(len(new_ids), len(prev.ids) - r)
        diff = np.flatnonzero(new_ids[:n] != prev.ids[r:r + n])
        same = r + (int(diff[0]) if diff.size else n)  # tokens equal to the stored ones
        bt = self.scheme.block_tokens
        kept = min(same // bt, len(prev.chain))
        chain = prev.chain[:kept] + self.scheme.chain(ids[kept * bt:].tolist(), prev.chain[kept - 1] if kept else None)
        kept_keys = self.scheme.keys_kept(kept)
        keys = prev.keys[:kept_keys] + self.scheme.keys_of_chain(chain, kept_keys)
        sp = prev.special[prev.special < r]
        with self._lock:
            self.counts[outcome] += 1
        return _Entry(text, ids, offs, np.concatenate((sp, r + self._special(new_ids))), chain, keys)

"""kvtier's host and disk holdings as a vLLM-format KV event stream, for other routers.

``kvtierd --kv-events-endpoint tcp://*:5557`` publishes every change of what the host and disk
tiers hold exactly as vLLM's ``ZmqEventPublisher`` publishes an engine's KV cache events, so
a router that already reads vLLM's stream and places tokenless stores by hash (llm-d's KV
indexer, llm-d-kv-cache v0.9.0 or later: older ones decode only array-encoded events) counts
kvtier's tiers too: ``BlockStored`` / ``BlockRemoved`` with medium ``CPU`` (host) or
``STORAGE`` (disk). Blocks an engine described (below, "Block descriptions") go out as
vLLM's full events, chained by parent hash and carrying their token ids, which is what
Dynamo's KV indexer needs (it hashes the tokens; it drops stores without them) and what
llm-d indexes without having seen the engine's GPU event. One stream has one topic: every
block is credited to the pod and model it names (one engine per kvtierd). docs/vllm.md
("KV events for Dynamo and llm-d") and docs/integrations.md ("kvtier's tiers in Dynamo and
llm-d") say how to set it up.

Owns
    :class:`KvEventsPublisher`, a :class:`~kvtier.daemon.observers.LocationObserver` of the
    store; its ZMQ sockets: a PUB socket (an XPUB, which also hears subscriptions), bound or connected by vLLM's rule (a wildcard host,
    ``tcp://*:5557``, or ``ipc://``: bind, so readers connect to kvtierd, as Dynamo's relay
    does; any other host: connect, to a reader that binds, as llm-d's central indexer does),
    and a ROUTER for replay, always bound, when ``--kv-events-replay-endpoint`` is set; and the
    publisher thread, the only user of the sockets. A bind that fails (the port is taken) is a
    one-line startup error.

Wire format (as vLLM 0.32's ``vllm/distributed/kv_events.py``)
    Each message is three frames: the topic (UTF-8), the sequence number (8 bytes, big-endian,
    0 for the first batch, +1 per batch) and a msgspec msgpack ``KVEventBatch``: the array
    ``[ts, events, data_parallel_rank]`` (rank 0). Events are tagged structs, encoded as maps
    with a ``"type"`` key (``{"type": "BlockStored", "block_hashes": [...], ...}``), fields
    with their default value omitted, exactly as vLLM's classes encode (a test compares the
    bytes). The first batch (seq 0) is ``AllBlocksCleared``; blocks a disk tier restored
    follow once their layout is registered (below). ZMQ loses what is published before a
    reader's subscription takes effect, so each subscription to the topic is answered with a
    snapshot (``subscriptions`` in :attr:`KvEventsPublisher.stats`): the first one, and in
    connect mode every one, gets ``AllBlocksCleared`` and every held block; later ones on a
    bound endpoint every held block only (``BlockStored``), so attached readers are not cleared. Replay (vLLM's protocol): a DEALER sends
    ``[b"", start]``, the starting sequence number as 8 big-endian bytes; the ROUTER answers
    with every buffered batch from there as ``[b"", topic, seq, payload]`` and ends with
    ``[b"", b"", -1 (8 bytes, signed), b""]``. The last :data:`REPLAY_BATCHES` batches (at
    most :data:`REPLAY_BYTES`) are kept. The ROUTER has no send high-water mark, so an answer
    of more than ZMQ's default 1000 messages is not cut short (vLLM's own replay socket is).

Events
    * ``BlockStored(block_hashes, parent_block_hash=None, token_ids=[], block_size=<the
      layout's block_tokens>, lora_id=None, medium, lora_name=None, locality="LOCAL")``:
      kvtier does not know the tokens a block holds, nor its parent (keys are opaque), so these
      are the tokenless "placeholder" events vLLM itself emits for offloaded chunks it has no
      metadata for. Routers must already know the hash (from the engine's own GPU events,
      which carry the tokens) to place it: llm-d resolves a tokenless store through the engine
      key it learned from the GPU event and adds the medium. Described blocks are published
      with their ``parent_block_hash``, ``token_ids`` and ``lora_name`` instead (below).
      ``group_idx`` is left unset
      (unspecified): llm-d skips a store that names a group without a prefix-indexable
      ``kv_cache_spec_kind``, which kvtier does not know.
    * ``BlockRemoved(block_hashes, medium, locality="LOCAL")``.
    * ``AllBlocksCleared`` at start (so readers drop what a previous kvtierd announced), and
      before a resync (below). Readers clear everything they hold for the sender's identity:
      llm-d clears the pod across every medium, the engine's own GPU entries included when
      kvtierd publishes under the engine's pod (which it must, to be counted for it); vLLM
      re-announces GPU blocks as requests reuse them. (kvtierd means "forget my CPU/STORAGE";
      Dynamo clears the worker's device tier, and kvtier's own vLLM-events ingest its gpu
      tier, so neither should read this stream.)
    A demotion is ``BlockRemoved`` CPU then ``BlockStored`` STORAGE; a promotion is
    ``BlockStored`` CPU (the disk copy stays). gpu-tier changes are not published: engines
    publish their own device blocks.

Block hashes
    A key is the engine's block hash when the engine keys blocks with its own hashes
    (:func:`kvtier.client.engine.keys.as_key`): an 8-byte key is an int (little-endian,
    unsigned, the inverse of ``as_key``), which is what vLLM emits by default
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the hash's low 64 bits as an int). Only those
    are published by default: keys kvtier derives itself (the 16-byte keys of
    ``kvtier.client.vllm`` and ``kvtier.client.sglang``) are not an engine's hashes, no
    router can match them, and Dynamo's decoder (block hashes are ``i64``/``u64``) rejects
    a whole batch that holds one bytes hash, its int hashes and ``AllBlocksCleared`` with it
    (and llm-d-router clears the pod on a batch it cannot decode). Skipped keys are counted
    (``skipped_keys`` in :attr:`KvEventsPublisher.stats`, logged once). With
    ``all_keys=True`` every other key is sent as its bytes, as vLLM does with that variable
    off (msgpack has no integers wider than 64 bits, so a 16-byte key cannot be an int), for
    a reader that hashes requests the same way and decodes bytes hashes.

Block descriptions
    :meth:`KvEventsPublisher.describe` hands the publisher what a key does not say: the
    block before it and the tokens it holds (consecutive blocks of one sequence, as
    :func:`~kvtier.client.engine.keys.block_keys` chains them), and the LoRA adapter. A
    store of described keys is published as vLLM publishes a request's blocks: runs of
    blocks each the parent of the next, one ``BlockStored`` per run with the run's
    ``parent_block_hash`` (None at the start of a sequence) and the concatenated
    ``token_ids``, parents before children (a branch is a run of its own after its parent).
    A described key of any length is published as :func:`hash64` (its first 8 bytes as an
    unsigned little-endian int: an 8-byte key's int as above; kvtier's own 16-byte keys are
    uniform hashes, so 64 of their bits name them), and so is its parent and, later, its
    ``BlockRemoved``. Readers then index the blocks as a vLLM engine's: Dynamo's relay
    hashes each block's tokens (``compute_block_hash_for_seq``) and links it under its
    parent; a request matches as far as the tokens and the chain agree, which is exactly the
    leading blocks kvtier's router finds (tests/test_dynamo_indexer.py). Dynamo drops the
    store of a block whose parent it does not hold for that worker, so stores go out
    parents first. The newest
    :data:`MAX_DESCRIBED_KEYS` descriptions are kept (``described_keys``,
    ``forgotten_descriptions`` in :attr:`KvEventsPublisher.stats`); a key whose description
    was forgotten is published as undescribed.

Tensor parallelism
    Each TP rank's shard of a block is its own kvtier block (its own layout fingerprint). A
    block is published as stored in a tier when every rank's shard is there (what an engine
    needs to load it) and as removed when the first leaves: for layouts with ``tp_size`` > 1
    the publisher thread keeps a rank bitmask per (tier, layout, key). Ranks are grouped by
    their layout with ``tp_rank`` set to 0, so all ranks must register the same tensors.

Promises
    Never slows the store: the observer calls (on the event loop) only look up the layout
    and the keys' descriptions and append to a bounded outbox (at most :data:`MAX_QUEUED_KEYS` keys queued); everything else
    (hashes, encoding, sending, replay) runs on the publisher thread. When the outbox is full
    the change is dropped and counted (``dropped_events`` / ``dropped_keys`` in
    :attr:`KvEventsPublisher.stats`, logged); once it has room again the publisher resyncs:
    ``AllBlocksCleared``, then everything the tiers hold, so readers converge to the truth.
    Changes queued together go out as one batch (at most :data:`MAX_BATCH_HASHES` hashes a
    batch; bigger ones are split). Blocks restored from disk whose layout no engine has
    registered yet are announced once it is (no engine can load them before).

Threading: the observer methods, :meth:`~KvEventsPublisher.start` and
:meth:`~KvEventsPublisher.close` run on the event loop; the sockets belong to the publisher
thread after :meth:`~KvEventsPublisher.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any, Protocol

from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

log = logging.getLogger("kvtier.kv_events")

EXTRA = "kvtier[events]"
"""The pip extra that brings pyzmq and msgspec."""

MEDIUM: dict[Tier, str] = {Tier.HOST: "CPU", Tier.DISK: "STORAGE"}
"""vLLM's medium of each published tier (``MEDIUM_CPU``, ``MEDIUM_STORAGE``)."""

LOCALITY = "LOCAL"
DATA_PARALLEL_RANK = 0
DEFAULT_TOPIC = "kv@{node_id}@kvtier"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENGINE_KEY_BYTES = 8          # as_key of an engine's int block hash; other keys are skipped by default

MAX_QUEUED_KEYS = 1 << 20     # keys waiting for the publisher thread before changes are dropped
MAX_DESCRIBED_KEYS = 1 << 20  # block descriptions kept (the oldest go first)
MAX_BATCH_HASHES = 4096       # block hashes in one batch message
REPLAY_BATCHES = 10_000       # vLLM's default buffer_steps
REPLAY_BYTES = 64 << 20
TICK_S = 1.0                  # how often pending resyncs and newly registered layouts are checked
POLL_S = 0.05                 # the publisher thread's longest wait (replay requests wait this long)
LINGER_MS = 500               # how long close() lets the last batches go out
DROP_LOG_S = 10.0

STORED, REMOVED, RESET = "stored", "removed", "reset"
ANNOUNCE = "announce"         # a held block re-announced to a new subscriber (BlockStored; TP: complete blocks)


class KvEventsError(Exception):
    """The stream cannot be started; the one-line message names the setting and the fix."""


class _Store(Protocol):
    """What the publisher reads of the store (on the event loop)."""

    @property
    def layouts(self) -> Any: ...   # .find(fingerprint) -> RegisteredLayout | None

    def holdings(self) -> list[tuple[Tier, bytes, list[bytes]]]: ...


def block_hash(key: bytes) -> int | bytes:
    """The block hash a key is published as: 8-byte keys as the unsigned little-endian int
    ``as_key`` made them from, any other key as its bytes (module docstring)."""
    return int.from_bytes(key, "little") if len(key) == 8 else bytes(key)


def hash64(key: bytes) -> int:
    """The 64-bit int a described key is published as: its first 8 bytes, little-endian,
    unsigned (for an 8-byte key, :func:`block_hash`'s int)."""
    return int.from_bytes(bytes(key[:8]), "little")


@dataclass(frozen=True, slots=True)
class Described:
    """What a block's key does not say: the key of the block before it (None: the first
    block of a sequence), the tokens it holds, and the LoRA adapter its hash covers."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None


def resolve_topic(topic: str, node_id: str) -> str:
    return topic.replace("{node_id}", node_id)


@dataclass(frozen=True)
class Shard:
    """What the events of one layout need: its block tokens and, for tp_size > 1, which
    rank of which group (the layout with tp_rank 0) it is."""

    block_size: int
    group: bytes | None = None   # None: tp_size 1
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, layout: Layout) -> Shard:
        if layout.tp_size == 1:
            return cls(layout.block_tokens)
        group = dataclasses.replace(layout, tp_rank=0).fingerprint
        return cls(layout.block_tokens, group, layout.tp_rank, layout.tp_size)


# -- the optional dependencies -------------------------------------------------------------------

def _import_extra() -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise KvEventsError(f"--kv-events-endpoint needs pyzmq and msgspec, which are not installed ({e}); "
                            f"install them with: pip install '{EXTRA}'") from None
    return zmq, msgspec


@cache
def wire() -> SimpleNamespace:
    """vLLM's event classes, declared the same way (names, field order, options), so they
    encode to the same bytes without importing vLLM."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list
        parent_block_hash: Any
        token_ids: list
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, encoder=msgspec.msgpack.Encoder)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard (``*``, ``::``) and ipc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def _attach(zmq: Any, sock: Any, endpoint: str, flag: str, bind: bool) -> str:
    """Bind or connect ``sock``; the endpoint it got (a bound port 0 becomes the real one)."""
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise KvEventsError(f"{flag} {endpoint!r} is not tcp://HOST:PORT (HOST may be *) or ipc://PATH")
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise KvEventsError(f"{flag} {endpoint}: the address is already in use; pick another port") from None
        raise KvEventsError(f"cannot {'bind' if bind else 'connect'} {flag} {endpoint}: {e.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# -- the outbox: event loop -> publisher thread --------------------------------------------------

class _Outbox:
    """A queue bounded by the keys it holds; never blocks the producer."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        self.keys = 0
        self._items: deque[tuple] = deque()
        self._cv = threading.Condition()
        self.closed = False

    def offer(self, item: tuple, nkeys: int) -> bool:
        with self._cv:
            if self._items and self.keys + nkeys > self.max_keys:
                return False
            self._items.append(item)
            self.keys += nkeys
            self._cv.notify()
            return True

    def force(self, items: Iterable[tuple]) -> None:
        """Queue ``items`` whatever the bound (a resync must go out whole)."""
        with self._cv:
            for item in items:
                self._items.append(item)
                self.keys += len(item[3]) if item[0] != RESET else 0
            self._cv.notify()

    def has_room(self) -> bool:
        return self.keys <= self.max_keys // 2

    def take(self, timeout: float) -> list[tuple] | None:
        """Everything queued (waiting up to ``timeout`` for something); None once closed and empty."""
        with self._cv:
            if not self._items and not self.closed:
                self._cv.wait(timeout)
            if not self._items:
                return None if self.closed else []
            out = list(self._items)
            self._items.clear()
            self.keys = 0
            return out

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify()


# -- the publisher thread's half: items -> events -> batches --------------------------------------

class _Translator:
    """Turns outbox items into vLLM events; keeps the tensor-parallel rank bitmasks. Keys
    that are not 8 bytes are left out unless described or ``all_keys`` (module docstring,
    "Block hashes"); ``skipped`` counts them. An item is ``(op, medium, shard, keys)`` or
    ``(op, medium, shard, keys, descriptions)``: the :class:`Described` of those keys that
    have one, which go out as chains (``parent_block_hash``, ``token_ids``)."""

    def __init__(self, all_keys: bool = False) -> None:
        self.w = wire()
        self.masks: dict[tuple[str, bytes, bytes], int] = {}
        self.all_keys = all_keys
        self.skipped = 0
        # (medium, key) of the keys that are not 8 bytes but were published (described) as
        # their hash64, so their removal is published the same way
        self.named: set[tuple[str, bytes]] = set()

    def events(self, items: Iterable[tuple]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if item[0] == RESET:
                self.masks.clear()
                self.named.clear()
                out.append(self.w.AllBlocksCleared())
                continue
            op, medium, shard, keys = item[:4]
            keys = self._described(op, medium, shard, keys, item[4] if len(item) > 4 else {}, out)
            if not self.all_keys:
                engine = [k for k in keys if len(k) == ENGINE_KEY_BYTES]
                if len(engine) != len(keys):
                    if op != ANNOUNCE:  # counted when first published
                        self._skip(len(keys) - len(engine))
                    keys = engine
            if op == ANNOUNCE:  # blocks published as stored already: once (rank 0), complete ones only
                if shard.group is not None:
                    full = (1 << shard.size) - 1
                    keys = [] if shard.rank else [k for k in keys
                                                  if self.masks.get((medium, shard.group, bytes(k))) == full]
                op = STORED
            elif shard.group is not None:
                keys = self._complete(op, medium, shard, keys)
            for i in range(0, len(keys), MAX_BATCH_HASHES):
                hashes = [block_hash(k) for k in keys[i:i + MAX_BATCH_HASHES]]
                if op == STORED:
                    out.append(self.w.BlockStored(hashes, None, [], shard.block_size, None, medium, None,
                                                  locality=LOCALITY))
                else:
                    out.append(self.w.BlockRemoved(hashes, medium, locality=LOCALITY))
        return out

    def _described(self, op: str, medium: str, shard: Shard, keys: Sequence[bytes],
                   descs: Mapping[bytes, Described], out: list[Any]) -> Sequence[bytes]:
        """Publish what concerns described keys (stores as chains, removals as hash64); the rest."""
        if op == REMOVED:
            return self._unname(medium, keys, out) if self.named else keys
        return self._chains(op, medium, shard, keys, descs, out) if descs else keys

    def _unname(self, medium: str, keys: Sequence[bytes], out: list[Any]) -> list[bytes]:
        """Publish the removal of keys published as their hash64 (described); the rest."""
        gone, rest = [], []
        for k in keys:
            ident = (medium, bytes(k))
            if len(k) != ENGINE_KEY_BYTES and ident in self.named:
                self.named.discard(ident)
                gone.append(k)
            else:
                rest.append(k)
        for i in range(0, len(gone), MAX_BATCH_HASHES):
            out.append(self.w.BlockRemoved([hash64(k) for k in gone[i:i + MAX_BATCH_HASHES]], medium,
                                           locality=LOCALITY))
        return rest

    def _chains(self, op: str, medium: str, shard: Shard, keys: Sequence[bytes],
                descs: Mapping[bytes, Described], out: list[Any]) -> list[bytes]:
        """Publish the described keys as chains, parents first (one ``BlockStored`` per run of
        blocks each the parent of the next, as vLLM publishes a request's blocks); the rest."""
        rest: list[bytes] = []
        mine: dict[bytes, Described] = {}
        for k in keys:
            d = descs.get(bytes(k))
            if d is None:
                rest.append(k)
            else:
                mine[bytes(k)] = d
        if not mine:
            return rest
        if op == ANNOUNCE:   # published already: once (rank 0), complete blocks only
            if shard.group is not None:
                full = (1 << shard.size) - 1
                mine = {} if shard.rank else {k: d for k, d in mine.items()
                                              if self.masks.get((medium, shard.group, k)) == full}
        elif shard.group is not None:
            complete = set(self._complete(op, medium, shard, list(mine)))
            mine = {k: d for k, d in mine.items() if k in complete}
        children: dict[bytes | None, list[bytes]] = {}
        for k, d in mine.items():
            children.setdefault(d.parent if d.parent in mine else None, []).append(k)
        stack = [[k] for k in reversed(children.get(None, []))]
        while stack:
            run = stack.pop()
            while True:   # follow a child of the same adapter; the others start runs of their own (later)
                kids = children.get(run[-1], [])
                same = next((k for k in kids if mine[k].lora_name == mine[run[0]].lora_name), None)
                stack.extend([k] for k in reversed(kids) if k is not same)
                if same is None:
                    break
                run.append(same)
            for i in range(0, len(run), MAX_BATCH_HASHES):
                part = run[i:i + MAX_BATCH_HASHES]
                first = mine[part[0]]
                tokens = [t for k in part for t in mine[k].token_ids]
                parent = None if first.parent is None else hash64(first.parent)
                out.append(self.w.BlockStored([hash64(k) for k in part], parent, tokens, shard.block_size, None,
                                              medium, first.lora_name, locality=LOCALITY))
            self.named.update((medium, k) for k in run if len(k) != ENGINE_KEY_BYTES)
        return rest

    def _skip(self, n: int) -> None:
        if not self.skipped:
            log.warning("kv events: keys that are not 8 bytes are not published (no engine hash: a router "
                        "cannot match them, and Dynamo cannot decode a batch holding one)",
                        extra={"kv_events_skipped_keys": n})
        self.skipped += n

    def _complete(self, op: str, medium: str, shard: Shard, keys: Sequence[bytes]) -> list[bytes]:
        """The keys whose block this change makes complete (stored) or incomplete (removed)."""
        full, bit, masks = (1 << shard.size) - 1, 1 << shard.rank, self.masks
        out = []
        for k in keys:
            ident = (medium, shard.group, bytes(k))
            old = masks.get(ident, 0)
            new = old | bit if op == STORED else old & ~bit
            if new:
                masks[ident] = new
            else:
                masks.pop(ident, None)
            if (new == full) != (old == full):
                out.append(k)
        return out


def batches(events: list[Any]) -> list[list[Any]]:
    """Events split into batches of at most MAX_BATCH_HASHES hashes (each event has at most that)."""
    out: list[list[Any]] = [[]]
    n = 0
    for ev in events:
        size = len(getattr(ev, "block_hashes", ()))
        if out[-1] and n + size > MAX_BATCH_HASHES:
            out.append([])
            n = 0
        out[-1].append(ev)
        n += size
    return out if out[-1] else []


# -- the observer ----------------------------------------------------------------------------------

class KvEventsPublisher:
    """See the module docstring. Construction binds the sockets (a :class:`KvEventsError` says
    why it could not); :meth:`start` on the event loop starts publishing."""

    def __init__(self, store: _Store, node_id: str, endpoint: str, replay_endpoint: str = "",
                 topic: str = DEFAULT_TOPIC, max_queued_keys: int = MAX_QUEUED_KEYS, all_keys: bool = False,
                 max_described_keys: int = MAX_DESCRIBED_KEYS) -> None:
        if not endpoint:
            raise KvEventsError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        zmq, _ = _import_extra()
        self._zmq = zmq
        self.store = store
        self.all_keys = all_keys
        self.topic = resolve_topic(topic, node_id)
        self._topic_bytes = self.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            # XPUB: a PUB that also hears each subscription arrive (XPUB_VERBOSE: every one, not
            # only the first of a topic), so a reader that joins late is sent the holdings
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._pub.set_hwm(100_000)
            self.connects = not binds(endpoint)
            self.endpoint = _attach(zmq, self._pub, endpoint, "--kv-events-endpoint", not self.connects)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # a replay is up to REPLAY_BATCHES messages in one burst: at the default SNDHWM
                # (1000) a ROUTER drops the rest silently, END marker included. No HWM (the
                # answer is bounded by the buffer, REPLAY_BYTES), and a reader that went away
                # is an error (EHOSTUNREACH) instead of a silent drop.
                self._replay.setsockopt(zmq.SNDHWM, 0)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay_endpoint = _attach(zmq, self._replay, replay_endpoint, "--kv-events-replay-endpoint",
                                               True)
        except BaseException:
            self._close_sockets(0)
            raise
        self._outbox = _Outbox(max_queued_keys)
        self._described: dict[bytes, Described] = {}   # key -> its description (insertion order: oldest first)
        self.max_described_keys = max_described_keys
        self._shards: dict[bytes, Shard] = {}
        self._deferred: set[bytes] = set()   # layouts restored from disk, not registered yet
        self._resync_wanted = False
        self._closed = False
        self._last_drop_log = 0.0
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_bytes = 0
        self._seq = 0
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._subscribed = False      # a reader's subscription was answered with a snapshot
        self.stats = dict.fromkeys(("batches", "events", "hashes", "dropped_events", "dropped_keys", "resyncs",
                                    "replays", "send_errors", "skipped_keys", "subscriptions",
                                    "described_keys", "forgotten_descriptions"), 0)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._tick: asyncio.Task | None = None

    # -- lifecycle (event loop) ------------------------------------------------------------------

    def start(self) -> None:
        """Publish ``AllBlocksCleared`` and the current holdings, then follow the changes."""
        self._loop_ref = asyncio.get_running_loop()
        self._thread.start()
        self._resync(initial=True)
        self._tick = asyncio.get_running_loop().create_task(self._ticker())
        log.info("kv events publishing", extra={"kv_events_endpoint": self.endpoint, "topic": self.topic,
                                                "mode": "connect" if self.connects else "bind",
                                                "kv_events_replay_endpoint": self.replay_endpoint or None})

    def close(self) -> None:
        """Send what is queued (for up to a second or two), then close the sockets. The
        publisher thread closes its own sockets as it ends (ZMQ sockets are not thread-safe);
        if it does not end in time they are left to it, and the context is not terminated."""
        if self._closed:
            return
        self._closed = True
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._outbox.close()
        if self._thread.ident is None:        # never started: the sockets are still this thread's
            self._close_sockets(LINGER_MS)
        else:
            self._thread.join(timeout=2.0)
            if self._thread.is_alive():
                log.warning("kv events: the publisher thread did not stop in time; its sockets are left to it")
            else:
                with contextlib.suppress(Exception):
                    self._ctx.term()
        log.info("kv events stopped", extra={f"kv_events_{k}": v for k, v in self.stats.items()})

    def _close_sockets(self, linger_ms: int, term: bool = True) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(linger=linger_ms)
        if term:
            with contextlib.suppress(Exception):
                self._ctx.term()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        """Resync if one is due and the outbox has room; announce newly registered layouts."""
        if self._resync_wanted:
            if self._outbox.has_room():
                self._resync()
            return
        for fp in list(self._deferred):
            if self._shard(fp) is not None:
                self._undefer(fp)

    def _on_subscription(self) -> None:
        """A reader subscribed to the topic (event loop): it missed what went before, so it is
        sent the holdings. The first reader, and in connect mode every one (one reader, which
        may have missed changes while the connection was down), gets ``AllBlocksCleared``
        first, so what a previous kvtierd announced goes; later readers of a bound endpoint
        get ``BlockStored`` of every held block only, so the readers already there are not
        cleared (they recover missed batches by replay)."""
        if self._closed:
            return
        self.stats["subscriptions"] += 1
        if not self._subscribed or self.connects or self._resync_wanted:
            self._subscribed = True
            self._resync(initial=True)
        else:
            self._outbox.force([(ANNOUNCE, *item[1:]) for item in self._holdings_items()])

    # -- block descriptions ----------------------------------------------------------------------

    def describe(self, keys: Sequence[bytes], token_ids: Sequence[int], block_tokens: int,
                 parent: bytes | None = None, lora_name: str | None = None) -> None:
        """Say what ``keys`` hold (event loop): consecutive full blocks of one sequence, block
        ``i`` holding ``token_ids[i * block_tokens:(i + 1) * block_tokens]``, the first one
        after the block ``parent`` (None: the start of the sequence), each later one after the
        one before it; the arguments of :func:`kvtier.client.engine.keys.block_keys`.
        Stores of described keys that follow are published as chains with their parent hash
        and token ids, every key as its :func:`hash64` (module docstring, "Block
        descriptions"). At most ``max_described_keys`` descriptions are kept, the oldest
        forgotten first (``forgotten_descriptions``)."""
        if block_tokens <= 0 or len(token_ids) != len(keys) * block_tokens:
            raise ValueError(f"{len(token_ids)} token ids for {len(keys)} blocks of {block_tokens} tokens")
        table = self._described
        prev = None if parent is None else bytes(parent)
        for i, k in enumerate(keys):
            k = bytes(k)
            table.pop(k, None)  # re-described: now the newest
            table[k] = Described(prev, tuple(int(t) for t in token_ids[i * block_tokens:(i + 1) * block_tokens]),
                                 lora_name)
            prev = k
        self.stats["described_keys"] += len(keys)
        over = len(table) - self.max_described_keys
        if over > 0:
            for k in list(itertools.islice(table, over)):
                del table[k]
            self.stats["forgotten_descriptions"] += over

    def _descriptions(self, keys: Sequence[bytes]) -> dict[bytes, Described]:
        table = self._described
        if not table:
            return {}
        return {bytes(k): d for k in keys if (d := table.get(bytes(k))) is not None}

    # -- LocationObserver ------------------------------------------------------------------------

    def stored(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        medium = MEDIUM.get(tier)
        if medium is not None and keys:
            self._change(STORED, medium, fingerprint, keys)

    def removed(self, tier: Tier, fingerprint: bytes, keys: Sequence[bytes], worker: str = "") -> None:
        medium = MEDIUM.get(tier)
        if medium is not None and keys:
            self._change(REMOVED, medium, fingerprint, keys)

    def cleared(self, tier: Tier, worker: str = "", gone: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        if tier not in MEDIUM:
            return
        if gone is None:  # what was there is unknown: start over
            self._want_resync()
            return
        for fp, keys in gone.items():
            self.removed(tier, fp, keys)

    def workers_changed(self) -> None:
        pass

    # -- the loop's half -------------------------------------------------------------------------

    def _change(self, op: str, medium: str, fp: bytes, keys: Sequence[bytes]) -> None:
        """One change, after the store made it (so holdings() already include it)."""
        if self._closed:
            return
        if self._resync_wanted:           # a resync will cover this change
            if self._outbox.has_room():
                self._resync()
            else:
                self._count_drop(len(keys))
            return
        if fp in self._deferred:
            if self._shard(fp) is not None:
                self._undefer(fp)         # its holdings include this change
            return                        # still unknown: nothing of it was published
        shard = self._shard(fp)
        if shard is None:
            self._deferred.add(fp)
        elif not self._outbox.offer((op, medium, shard, keys, self._descriptions(keys) if op == STORED else {}),
                                    len(keys)):
            self._count_drop(len(keys))
            self._want_resync()

    def _shard(self, fp: bytes) -> Shard | None:
        shard = self._shards.get(fp)
        if shard is None:
            reg = self.store.layouts.find(fp)
            if reg is None:
                return None
            shard = self._shards[fp] = Shard.of(reg.layout)
        return shard

    def _holdings_items(self, only: bytes | None = None) -> list[tuple]:
        items = []
        for tier, fp, keys in self.store.holdings():
            if tier not in MEDIUM or (only is not None and fp != only):
                continue
            shard = self._shard(fp)
            if shard is None:
                self._deferred.add(fp)
            elif keys:
                items.append((STORED, MEDIUM[tier], shard, keys, self._descriptions(keys)))
        return items

    def _resync(self, initial: bool = False) -> None:
        self._resync_wanted = False
        self._deferred.clear()
        self._outbox.force([(RESET,), *self._holdings_items()])
        if not initial:
            self.stats["resyncs"] += 1
            log.warning("kv events resynced after dropped changes: AllBlocksCleared, then all holdings",
                        extra={"kv_events_dropped_keys": self.stats["dropped_keys"]})

    def _undefer(self, fp: bytes) -> None:
        self._deferred.discard(fp)
        self._outbox.force(self._holdings_items(only=fp))

    def _want_resync(self) -> None:
        self._resync_wanted = True

    def _count_drop(self, nkeys: int) -> None:
        self.stats["dropped_events"] += 1
        self.stats["dropped_keys"] += nkeys
        now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_S:
            self._last_drop_log = now
            log.warning("kv events queue full: changes dropped (a resync follows once it drains)",
                        extra={"kv_events_dropped_events": self.stats["dropped_events"],
                               "kv_events_dropped_keys": self.stats["dropped_keys"]})

    # -- the publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the sockets are this thread's: it closes them (close() terminates the context)
            self._close_sockets(LINGER_MS, term=False)

    def _loop(self) -> None:
        translator = _Translator(self.all_keys)
        encoder = translator.w.encoder()
        while True:
            items = self._outbox.take(POLL_S)
            if self._replay is not None:
                self._serve_replays()
            self._subscriptions()
            if items is None:
                return
            if items:
                try:
                    self._publish(translator, encoder, items)
                except Exception:  # a bug must not end the stream silently: log, keep going
                    self.stats["send_errors"] += 1
                    log.exception("kv events: publishing a batch failed")

    def _publish(self, translator: _Translator, encoder: Any, items: list[tuple]) -> None:
        events = translator.events(items)
        self.stats["skipped_keys"] = translator.skipped
        for evs in batches(events):
            payload = encoder.encode(translator.w.KVEventBatch(time.time(), evs, DATA_PARALLEL_RANK))
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
            self._remember(seq, payload)
            self.stats["batches"] += 1
            self.stats["events"] += len(evs)
            self.stats["hashes"] += sum(len(getattr(e, "block_hashes", ())) for e in evs)

    def _subscriptions(self) -> None:
        """Read the XPUB's subscription messages; one for this topic asks the loop for a snapshot."""
        zmq, sock = self._zmq, self._pub
        wanted = False
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                log.exception("kv events: reading a subscription failed")
                break
            if msg[:1] == b"\x01" and self._topic_bytes.startswith(msg[1:]):
                wanted = True
        if wanted and self._loop_ref is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: kvtierd is stopping
                self._loop_ref.call_soon_threadsafe(self._on_subscription)

    def _remember(self, seq: int, payload: bytes) -> None:
        buf = self._buffer
        buf.append((seq, payload))
        self._buffer_bytes += len(payload)
        while len(buf) > REPLAY_BATCHES or (self._buffer_bytes > REPLAY_BYTES and len(buf) > 1):
            self._buffer_bytes -= len(buf.popleft()[1])

    def _serve_replays(self) -> None:
        zmq, sock = self._zmq, self._replay
        while sock.poll(0):
            try:
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    log.warning("kv events: replay request of %d frames ignored (want 3)", len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        sock.send_multipart((client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
                sock.send_multipart((client, b"", b"", END_SEQ, b""))
                self.stats["replays"] += 1
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    log.exception("kv events: serving a replay request failed")
                else:
                    log.info("kv events: a replay reader went away before its answer was sent")
            except Exception:
                log.exception("kv events: serving a replay request failed")

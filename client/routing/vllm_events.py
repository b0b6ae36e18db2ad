"""vLLM engines as a location source: their KV cache events folded into the router's index.

A vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", ...}'`` publishes every block it caches or evicts on a ZMQ PUB socket
(``vllm.distributed.kv_events.ZmqEventPublisher``). :class:`VllmEvents` subscribes to such
publishers and folds their events into the same
:class:`~kvtier.client.routing.index.LocationIndex` the kvtier daemons' feeds fill, so a vLLM
fleet without any kvtier sidecar is ranked by kvtier's scorer (``kvtier route-server
--vllm-events ENDPOINT``, or ``RouterConfig(vllm_events=...)`` /
:meth:`~kvtier.client.routing.router.Router.add_vllm_events`). docs/integrations.md has the
user's view.

The wire (as vLLM 0.32 sends it)
    A message is three frames: the topic (the publisher's ``topic`` setting; llm-d names
    engines ``kv@<pod>@<model>``), the sequence number (8 bytes, big-endian, from 0 per
    publisher) and a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]``.
    Events are msgspec *tagged* structs: in vLLM 0.32 maps with ``"type"`` naming the kind
    (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and fields by name, defaulted
    fields omitted; in older vLLM arrays, the tag first and the fields in declaration order,
    later fields missing (llm-d-kv-cache before v0.9.0 decodes only this form). Both are accepted. Block hashes
    are bytes (sha256) or 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); both are
    used as given. The replay socket (ROUTER) answers ``["", start_seq (8 bytes)]`` with
    ``["", topic, seq, payload]`` for every buffered batch from ``start_seq`` on, then
    ``["", "", -1 (8 bytes, signed), ""]``; older vLLM versions (and SGLang) answer without
    the topic frame, ``["", seq, payload]`` then ``["", -1, ""]``, which is accepted too (the
    batches are then the requested stream's).

From engine hashes to kvtier keys
    Per stream (one publisher: a source and a topic) a map *engine hash -> [kvtier key,
    where it is held]*. A ``BlockStored`` carries the parent's engine hash and the new
    blocks' token ids, so the kvtier key of a new block is :func:`block_keys` over its
    tokens, chained from the parent's key (looked up in the map; the root key when there is
    no parent), under ``Namespace(model, tenant_salt)``: the keys a caller gets from the same
    token ids (``RouteRequest.token_ids``, ``block_tokens`` = the engine's block size). A
    hash already in the map keeps its key (a re-report of a cached block, or an offloaded
    copy with no tokens). A block whose key cannot be known is skipped, and with it every
    later block of its chain: its parent is unknown (stored before the router listened, or
    skipped itself), the event has no usable tokens, or the block's hash covers more than
    tokens (a LoRA adapter, multimodal inputs, a cache salt: ``lora_id``/``lora_name``/
    ``extra_keys``). An entry lives while some (tier, KV cache group) holds it, so an
    engine's removals bound the map; ``max_blocks`` caps it (blocks past the cap are skipped).

Tiers, groups, workers and nodes
    Mediums map to tiers, in any case: ``GPU`` (and none) -> gpu, ``CPU`` -> host,
    ``STORAGE`` -> disk; events of any other medium are ignored and counted
    (``unknown_mediums``, logged once per stream).
    A stream is one worker, named by the source's ``worker=``, else the topic's pod (with
    ``/dp<rank>`` for a data-parallel rank above 0), else the endpoint; its node is
    ``vllm:<worker>``, a node of its own with this one worker, whose host and disk tiers are
    what the engine's offloading connector reports. Only KV cache groups of full attention
    (or of unknown kind) are indexed; each is a layout fingerprint of the worker (``vllm-g<i>``),
    so with several such groups a block counts as held only where every group holds it.
    ``AllBlocksCleared`` (vLLM's prefix-cache reset) clears the worker's gpu tier.

Sequence numbers
    Each stream applies batches in sequence. The first batch heard (and the first after the
    publisher restarted, seen as a sequence number that does not grow) asks the replay
    socket for the history from 0, and starts from the longest unbroken run it gets. A gap
    asks the replay socket for the missing batches; if they cannot be had (no replay socket,
    no answer within ``replay_timeout``, the buffer has moved past them, an undecodable
    batch), the worker's holdings and map are cleared (``gaps_lost``; logged), because a
    missed removal would otherwise stay forever, and the stream goes on from what it has.
    When the connection to a publisher drops (a connected endpoint), its streams are
    cleared the same way and start again, with a replay, when it comes back.
    A bound endpoint hears no disconnects, so there a stream with no message for
    ``idle_timeout`` seconds (default 0: never) is dropped: its worker's holdings, its node
    and its map are forgotten (``VllmEvents.expired_streams``), and the topic, if heard again,
    is a new stream. It is off by default because an engine that is merely idle longer than
    that would lose its entries too (vLLM publishes nothing while nothing is cached or
    evicted); set it where pods come and go behind one bound endpoint.

Caps
    Per source at most ``max_streams`` streams (default 1024) and ``max_refused`` refused
    topics remembered (default 1024; a refused topic's status says why). A topic heard when
    the streams are full is refused; one refused when the refused list is full is not
    remembered and each of its messages is counted (``VllmEvents.refused_unlisted``).
    Refused topics of a bound endpoint are forgotten after ``idle_timeout`` of silence too.
    A replay answer is read for at most :data:`REPLAY_MAX_S` seconds and
    :data:`REPLAY_MAX_BYTES` bytes; one that ends without its END marker keeps what arrived.
    A batch that cannot be folded (it should have been refused as undecodable) resets the
    worker like an undecodable one, and the stream moves past it. Frames over
    :data:`MAX_MESSAGE_BYTES` disconnect the peer.

Threading: one thread polls every source's SUB socket (:meth:`VllmEvents.start`); each batch
is folded under the lock given, which the router also routes under. Needs ``pyzmq`` and
``msgspec`` (both come with vLLM); they are imported only when a source is used.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.routing.index import LocationIndex

log = logging.getLogger("kvtier.router.vllm")

__all__ = ["Batch", "BlockRemoved", "BlockStored", "AllBlocksCleared", "EventError", "VllmEvents", "VllmSource",
           "VllmStreamStatus", "decode_batch", "parse_topic", "parse_vllm_events"]

MEDIUM_TIERS: dict[str | None, str] = {None: "gpu", "GPU": "gpu", "CPU": "host", "STORAGE": "disk"}
"""vLLM's mediums (``vllm.distributed.kv_events.MEDIUM_*``) -> kvtier tiers (matched without
regard to case, as llm-d does; any other medium is counted in ``unknown_mediums``)."""


def _tier(medium: str | None) -> str | None:
    return MEDIUM_TIERS.get(medium.upper() if medium is not None else None)

PREFIX_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention", "unknown"})
"""KV cache group kinds whose blocks make a reusable prefix (the others, sliding window,
mamba..., are not indexed)."""

NODE_PREFIX = "vllm:"
END_SEQ = -1
_RECV_HWM = 100_000  # as vLLM's publisher: a slow router must not drop batches at 1000
_TOKEN_LIMIT = 1 << 32  # block_keys hashes token ids as uint32
MAX_MESSAGE_BYTES = 64 << 20
"""Largest frame taken from a publisher or replay socket (ZMQ_MAXMSGSIZE; a peer that sends a
bigger one is disconnected). vLLM's batches are far smaller (a 128k-token prefill is < 1 MiB)."""
REPLAY_MAX_S = 30.0
"""Longest one replay answer may take in all (``replay_timeout`` bounds each wait between frames)."""
REPLAY_MAX_BYTES = 512 << 20
"""Most payload bytes one replay answer may bring (vLLM buffers 10k batches)."""

# field order of vLLM's structs (0.33: 0.32's and lookahead_token_ids); older vLLM sends a prefix of
# these as arrays
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                 "ownership", "session_id", "lookahead_token_ids")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}


# -- where to subscribe ------------------------------------------------------------------------

@dataclass(frozen=True)
class VllmSource:
    """One ``--vllm-events`` entry: ``ENDPOINT[,OPTION=VALUE...]``.

    ``endpoint`` is a ZMQ address (``tcp://host:5557``, ``ipc:///path``): the router connects
    to it, except ``tcp://*:PORT``, which it binds, for engines that connect to the router
    (llm-d's central mode; then one source hears many engines, told apart by topic).
    Options: ``replay=`` the engine's replay endpoint; ``worker=`` the worker name (default:
    the topic's pod, else the endpoint); ``model=`` the model for keys when the topic names
    none; ``salt=`` the tenant salt of the keys; ``block_tokens=`` accept only events of this
    block size (0: any); ``max_blocks=`` most blocks mapped per stream; ``topic=`` subscribe
    to topics with this prefix only; ``replay_timeout=`` seconds to wait for a replay;
    ``idle_timeout=`` seconds of silence after which a stream of a bound endpoint is dropped
    (0: never); ``max_streams=`` most streams (topics) of this source; ``max_refused=`` most
    refused topics of this source remembered (see the module doc).
    """

    endpoint: str
    replay: str = ""
    worker: str = ""
    model: str = ""
    salt: str = ""
    block_tokens: int = 0
    max_blocks: int = 1 << 21
    topic: str = ""
    replay_timeout: float = 2.0
    idle_timeout: float = 0.0
    max_streams: int = 1024
    max_refused: int = 1024

    @classmethod
    def parse(cls, entry: str) -> VllmSource:
        """An entry as written (raises ValueError naming what is wrong)."""
        parts = [p.strip() for p in entry.split(",") if p.strip()]
        if not parts:
            raise ValueError("an empty --vllm-events entry")
        kw: dict[str, Any] = {"endpoint": _endpoint(parts[0], "endpoint")}
        types = {f.name: f.type for f in fields(cls)}
        for part in parts[1:]:
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or name not in types or name == "endpoint":
                raise ValueError(f"{entry!r}: unknown option {part!r} (known: "
                                 f"{', '.join(n for n in types if n != 'endpoint')})")
            kw[name] = _option(name, types[name], value.strip())
        return cls(**kw)

    def spec(self) -> str:
        """The entry written back (defaults left out)."""
        opts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                if f.name != "endpoint" and getattr(self, f.name) != f.default]
        return ",".join([self.endpoint, *opts])

    @property
    def bind(self) -> bool:
        return self.endpoint.startswith("tcp://*:")

    @property
    def name(self) -> str:
        """The endpoint without its scheme: a worker name when nothing else names one."""
        return self.endpoint.partition("://")[2]


def _endpoint(text: str, what: str) -> str:
    if not re.fullmatch(r"(tcp|ipc|inproc)://\S+", text):
        raise ValueError(f"{what} {text!r} is not a ZMQ address (tcp://HOST:PORT, ipc://PATH)")
    return text


def _option(name: str, kind: str, value: str) -> Any:
    if name == "replay":
        return _endpoint(value, "replay endpoint")
    try:
        parsed: Any = int(value) if kind == "int" else float(value) if kind == "float" else value
    except ValueError:
        raise ValueError(f"option {name}: {value!r} is not a number") from None
    if kind != "str" and parsed < 0:
        raise ValueError(f"option {name}: {value!r} is negative")
    return parsed


def parse_vllm_events(value: str | Sequence[str]) -> tuple[str, ...]:
    """The ``--vllm-events`` setting: entries from repeated flags, a TOML array or one string
    with commas (the variable). An item ``NAME=VALUE`` belongs to the endpoint before it, so
    ``tcp://a:5557,replay=tcp://a:5558,tcp://b:5557`` is two entries. Each is checked."""
    items = [value] if isinstance(value, str) else [str(v) for v in value]
    entries: list[list[str]] = []
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            if re.match(r"[A-Za-z_]+=", part):
                if not entries:
                    raise ValueError(f"option {part!r} before any endpoint")
                entries[-1].append(part)
            else:
                entries.append([part])
    return tuple(VllmSource.parse(",".join(e)).spec() for e in entries)


def parse_topic(topic: str) -> tuple[str, str]:
    """(pod, model) of an llm-d topic ``kv@<pod>@<model>``; ("", "") for any other topic."""
    kind, sep, rest = topic.partition("@")
    pod, sep2, model = rest.partition("@")
    if kind != "kv" or not sep or not sep2 or not pod:
        return "", ""
    return pod, model


# -- the events ----------------------------------------------------------------------------------

class EventError(ValueError):
    """A message that is not a vLLM KV event batch."""


class BlockStored(NamedTuple):
    hashes: list[bytes | int]
    parent: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora: bool                       # a LoRA adapter's blocks (lora_id or lora_name set)
    medium: str | None
    extra_keys: list[Any] | None     # per block: what else the block hash covers (None: nothing)
    group: int
    kind: str | None
    ownership: str | None


class BlockRemoved(NamedTuple):
    hashes: list[bytes | int]
    medium: str | None
    group: int
    ownership: str | None


class AllBlocksCleared(NamedTuple):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(NamedTuple):
    ts: float
    events: list[Event]
    dp_rank: int | None
    unknown: int = 0  # events of a kind this module does not know (ignored)


def _hashes(v: Any, what: str) -> list[bytes | int]:
    if not isinstance(v, list) or not all(isinstance(h, bytes | int) and not isinstance(h, bool) for h in v):
        raise EventError(f"{what}: not a list of block hashes")
    return v


def _opt(v: Any, kind: type, what: str) -> Any:
    if v is not None and not isinstance(v, kind):
        raise EventError(f"{what}: {type(v).__name__}, not {kind.__name__}")
    return v


def _stored(f: dict[str, Any]) -> BlockStored:
    tokens = f.get("token_ids") or []
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < _TOKEN_LIMIT for t in tokens):
        raise EventError("BlockStored.token_ids: not a list of token ids (ints in 0 .. 2**32-1)")
    parent = f.get("parent_block_hash")
    if parent is not None and (not isinstance(parent, bytes | int) or isinstance(parent, bool)):
        raise EventError("BlockStored.parent_block_hash: not a block hash")
    extra = _opt(f.get("extra_keys"), list, "BlockStored.extra_keys")
    return BlockStored(_hashes(f.get("block_hashes"), "BlockStored.block_hashes"), parent, tokens,
                       _opt(f.get("block_size"), int, "BlockStored.block_size") or 0,
                       f.get("lora_id") is not None or f.get("lora_name") is not None,
                       _opt(f.get("medium"), str, "BlockStored.medium"), extra,
                       _opt(f.get("group_idx"), int, "BlockStored.group_idx") or 0,
                       _opt(f.get("kv_cache_spec_kind"), str, "BlockStored.kv_cache_spec_kind"),
                       _opt(f.get("ownership"), str, "BlockStored.ownership"))


def _removed(f: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(_hashes(f.get("block_hashes"), "BlockRemoved.block_hashes"),
                        _opt(f.get("medium"), str, "BlockRemoved.medium"),
                        _opt(f.get("group_idx"), int, "BlockRemoved.group_idx") or 0,
                        _opt(f.get("ownership"), str, "BlockRemoved.ownership"))


def decode_event(raw: Any) -> Event | None:
    """One event, a tagged map or a positional array; None for a kind not known here."""
    if isinstance(raw, dict):
        tag, f = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]  # fields past those this module knows (a newer vLLM) are ignored
        f = dict(zip(_FIELDS.get(tag, ()), raw[1:], strict=False))
    else:
        raise EventError(f"an event that is neither a tagged map nor a tagged array: {type(raw).__name__}")
    if tag == "BlockStored":
        return _stored(f)
    if tag == "BlockRemoved":
        return _removed(f)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> Batch:
    """A message's payload: msgpack ``[ts, events, data_parallel_rank]`` (raises EventError)."""
    try:
        import msgspec
    except ImportError as e:  # pragma: no cover - comes with vLLM
        raise RuntimeError("vLLM events need msgspec (pip install msgspec, or kvtier[vllm])") from e
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventError(f"not msgpack: {e}") from None
    except RecursionError:  # nested deeper than Python's stack: no batch is
        raise EventError("not a batch: msgpack nested too deeply") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventError("a batch is an array [ts, events, data_parallel_rank]")
    if not isinstance(events, list):
        raise EventError("a batch's events are not a list")
    out = [decode_event(e) for e in events]
    known = [e for e in out if e is not None]
    return Batch(float(ts) if isinstance(ts, int | float) else 0.0, known,
                 rank if isinstance(rank, int) and not isinstance(rank, bool) else None, len(out) - len(known))


# -- one publisher ----------------------------------------------------------------------------

@dataclass
class VllmStreamStatus:
    """Where one publisher's stream stands (tools, tests, ``route-server``'s Status)."""

    source: str                # the --vllm-events entry
    topic: str
    worker: str
    node_id: str
    model: str
    connected: bool = True
    seq: int = -1              # last batch applied (-1: none)
    batches: int = 0
    blocks: int = 0            # engine hashes mapped now
    skipped_blocks: int = 0    # stored blocks whose key could not be known (see the module doc)
    gaps_recovered: int = 0    # gaps filled from the replay socket
    gaps_lost: int = 0         # gaps (or undecodable or unfoldable batches) that cleared the worker
    restarts: int = 0          # publisher restarts and disconnects (each cleared the worker)
    unknown_events: int = 0
    unknown_mediums: int = 0   # events of a medium other than GPU, CPU, STORAGE (any case): ignored
    last_error: str = ""


def _fp(group: int) -> bytes:
    return b"vllm-g%d" % group


class _Stream:
    """One publisher's fold into the index: the hash map and the sequence (see module doc)."""

    def __init__(self, index: LocationIndex, i: int, source: VllmSource, topic: bytes,
                 status: VllmStreamStatus) -> None:
        self.index, self.i, self.source, self.topic, self.st = index, i, source, topic, status
        self.worker, self.node = status.worker, status.node_id
        self.ns = Namespace(status.model, source.salt).digest()
        self.map: dict[bytes | int, list] = {}           # engine hash -> [kvtier key, location bits]
        self.bits: dict[tuple[str, int, str | None], int] = {}  # (tier, group, ownership) -> bit
        self.column_bits: dict[tuple[str, int], int] = {}  # (tier, group) -> its locations' bits
        self.groups: set[int] = set()
        self.last: int | None = None   # last seq applied
        self.heard = time.monotonic()  # when its last message came
        self.sub_last = -1             # last seq received on the SUB socket

    # -- the fold -------------------------------------------------------------------------

    def apply(self, batch: Batch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            else:
                self._cleared_gpu()
        self.st.batches += 1
        self.st.unknown_events += batch.unknown
        self.st.blocks = len(self.map)

    def reset(self) -> None:
        """Forget every holding (the index's and the map)."""
        if self.groups:
            self.index.reset_node(self.node)
        self.map.clear()
        self.st.blocks = 0

    def _bit(self, tier: str, group: int, ownership: str | None) -> int:
        loc = (tier, group, ownership)
        bit = self.bits.get(loc)
        if bit is None:
            bit = self.bits[loc] = 1 << len(self.bits)
            self.column_bits[tier, group] = self.column_bits.get((tier, group), 0) | bit
        if group not in self.groups:  # a new layout of the worker: declare it (see module doc)
            self.groups.add(group)
            self.index.set_node_info(self.node, {self.worker: [_fp(g) for g in sorted(self.groups)]})
        return bit

    def _unknown_medium(self, medium: str | None) -> None:
        if not self.st.unknown_mediums:
            log.warning("vLLM KV events of an unknown medium are ignored (known: GPU, CPU, STORAGE)",
                        extra={"worker": self.worker, "medium": medium})
        self.st.unknown_mediums += 1

    def _stored(self, ev: BlockStored) -> None:
        tier = _tier(ev.medium)
        if tier is None:
            self._unknown_medium(ev.medium)
            return
        if ev.kind not in PREFIX_KINDS or not ev.hashes:
            return
        bit = self._bit(tier, ev.group, ev.ownership)
        keys = self._keys(ev)
        mapped: list[bytes] = []
        for h, k in zip(ev.hashes, keys, strict=True):
            entry = self.map.get(h)
            if entry is None:
                if k is None or len(self.map) >= self.source.max_blocks:
                    self.st.skipped_blocks += 1
                    continue
                entry = self.map[h] = [k, 0]
            entry[1] |= bit
            mapped.append(entry[0])
        if mapped:
            self.index.stored(self.node, tier, self.worker, _fp(ev.group), mapped)

    def _keys(self, ev: BlockStored) -> list[bytes | None]:
        """The kvtier key of each block of a stored event (None: not knowable)."""
        known = [self.map.get(h) for h in ev.hashes]
        out: list[bytes | None] = [e[0] if e is not None else None for e in known]
        n, bs = len(ev.hashes), ev.block_size
        if all(k is not None for k in out) or bs <= 0 or len(ev.token_ids) != n * bs \
                or self.source.block_tokens not in (0, bs):
            return out
        # blocks up to the first whose hash covers more than its tokens
        usable = 0 if ev.lora else n
        if ev.extra_keys is not None:
            usable = min(usable, next((i for i, x in enumerate(ev.extra_keys) if x), n))
        if ev.parent is None:
            parent = None
        else:
            entry = self.map.get(ev.parent)
            if entry is None:
                return out  # an orphan: its chain is unknown
            parent = entry[0]
        if usable:
            fresh = block_keys(ev.token_ids[:usable * bs], bs, self.ns, parent=parent)
            out[:usable] = [k if k is not None else f for k, f in zip(out[:usable], fresh, strict=True)]
        return out

    def _removed(self, ev: BlockRemoved) -> None:
        tier = _tier(ev.medium)
        if tier is None:
            self._unknown_medium(ev.medium)
            return
        bit = self.bits.get((tier, ev.group, ev.ownership))
        if bit is None:
            return  # nothing was ever stored there
        column = self.column_bits[tier, ev.group]
        gone: list[bytes] = []
        for h in ev.hashes:
            entry = self.map.get(h)
            if entry is None or not entry[1] & bit:
                continue
            entry[1] &= ~bit
            if not entry[1] & column:  # no owner of this (tier, group) holds it any more
                gone.append(entry[0])
            if not entry[1]:
                del self.map[h]
        if gone:
            self.index.removed(self.node, tier, self.worker, _fp(ev.group), gone)

    def _cleared_gpu(self) -> None:
        gpu = 0
        for (tier, _), b in self.column_bits.items():
            if tier == "gpu":
                gpu |= b
        if not gpu:
            return
        self.index.cleared(self.node, "gpu", self.worker)
        for h in [h for h, e in self.map.items() if e[1] & gpu]:
            entry = self.map[h]
            entry[1] &= ~gpu
            if not entry[1]:
                del self.map[h]


# -- every source -----------------------------------------------------------------------------

class VllmEvents:
    """The vLLM event sources of one index (see the module docstring).

    ``lock`` serialises every change of ``index`` (the router's lock); ``protect``, if given,
    gets the node id of every stream (the router's feeds then never forget those nodes).
    ``expired_streams`` counts streams of bound endpoints dropped after ``idle_timeout``;
    ``refused_unlisted`` the messages of topics refused while the source's refused list was
    full (so not remembered).
    """

    def __init__(self, index: LocationIndex, lock: threading.RLock, sources: Iterable[VllmSource | str] = (), *,
                 protect: set[str] | None = None) -> None:
        self.index, self._lock = index, lock
        self.protect = protect if protect is not None else set()
        self.sources: list[VllmSource] = []
        self._streams: dict[tuple[int, bytes], _Stream] = {}
        self._refused: dict[tuple[int, bytes], VllmStreamStatus] = {}
        self._owner: dict[str, tuple[int, bytes]] = {}   # worker -> its stream
        self._refused_heard: dict[tuple[int, bytes], float] = {}  # refused topic -> its last message
        self._counts: dict[tuple[int, bool], int] = {}   # (source, refused?) -> streams or refused topics
        self._capped: set[int] = set()                    # sources whose refused list was full (logged)
        self.expired_streams = 0
        self.refused_unlisted = 0
        self._next_expiry = 0.0
        self._handling = threading.Lock()                 # one message at a time (thread or feed())
        self._ctx: Any = None
        self._replay_socks: dict[int, Any] = {}
        self._opened = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for s in sources:
            self.add(s)

    def add(self, source: VllmSource | str) -> VllmSource:
        """Another source (an entry as ``--vllm-events`` takes it); a running thread opens it."""
        src = source if isinstance(source, VllmSource) else VllmSource.parse(source)
        with self._lock:
            self.sources.append(src)
        return src

    # -- status -----------------------------------------------------------------------------

    def status(self) -> list[VllmStreamStatus]:
        with self._lock:
            out = [VllmStreamStatus(**vars(s.st)) for s in self._streams.values()]
            return out + [VllmStreamStatus(**vars(st)) for st in self._refused.values()]

    @property
    def running(self) -> bool:
        return self._thread is not None

    # -- one message ------------------------------------------------------------------------

    def feed(self, frames: Sequence[bytes], source: int = 0) -> None:
        """Handle one multipart message ``[topic, seq, payload]`` as if ``sources[source]``'s
        socket had received it (its replay endpoint, if any, is asked for gaps)."""
        with self._handling:
            self._handle(source, list(frames))

    def _handle(self, i: int, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("not a vLLM KV event message (want [topic, 8-byte seq, payload])",
                        extra={"source": self.sources[i].endpoint, "frames": len(frames)})
            return
        topic, seq = frames[0], int.from_bytes(frames[1], "big", signed=True)
        key = (i, topic)
        if key in self._refused:
            self._refused_heard[key] = time.monotonic()
            return
        batch = self._decode(i, topic, frames[2])
        st = self._streams.get(key)
        if st is None:
            if batch is None:
                return
            st = self._claim(i, topic, batch)
            if st is None:
                return
        st.heard = time.monotonic()
        self._sequence(st, seq, batch)

    def _refuse(self, i: int, topic_b: bytes, st: VllmStreamStatus, why: str) -> None:
        """Remember ``topic_b`` of source ``i`` as refused (``why``), if its list has room."""
        src = self.sources[i]
        st.last_error, st.connected = why, False
        if self._counts.get((i, True), 0) >= src.max_refused:
            self.refused_unlisted += 1
            if i not in self._capped:
                self._capped.add(i)
                log.error("too many refused vLLM topics; more are refused without being remembered",
                          extra={"source": src.endpoint, "max_refused": src.max_refused, "topic": st.topic,
                                 "error": why})
            return
        self._refused[i, topic_b] = st
        self._refused_heard[i, topic_b] = time.monotonic()
        self._counts[i, True] = self._counts.get((i, True), 0) + 1
        log.error("vLLM publisher ignored", extra={"source": src.endpoint, "topic": st.topic, "error": why})

    def _decode(self, i: int, topic: bytes, payload: bytes) -> Batch | None:
        try:
            return decode_batch(payload)
        except EventError as e:
            log.warning("undecodable vLLM KV event batch", extra={"source": self.sources[i].endpoint,
                                                                  "topic": topic.decode(errors="replace"),
                                                                  "error": str(e)})
            st = self._streams.get((i, topic))
            if st is not None:
                with self._lock:
                    st.st.last_error = str(e)
            return None

    def _claim(self, i: int, topic_b: bytes, batch: Batch) -> _Stream | None:
        """The stream of a publisher heard for the first time: its worker and node."""
        src = self.sources[i]
        topic = topic_b.decode(errors="replace")
        pod, model = parse_topic(topic)
        model = model or src.model
        if src.worker:
            worker = src.worker
        elif pod:
            worker = pod if not batch.dp_rank else f"{pod}/dp{batch.dp_rank}"
        else:
            worker = src.name
        st = VllmStreamStatus(src.spec(), topic, worker, NODE_PREFIX + worker, model)
        why = ""
        if not model:
            why = "no model: the topic names none (kv@<pod>@<model>) and the entry has no model="
        elif worker in self._owner:
            why = f"worker {worker!r} is already fed by another vLLM publisher (give worker= per entry)"
        elif self._counts.get((i, False), 0) >= src.max_streams:
            why = f"too many streams on this source (max_streams={src.max_streams})"
        with self._lock:
            if why:
                self._refuse(i, topic_b, st, why)
                return None
            stream = self._streams[i, topic_b] = _Stream(self.index, i, src, topic_b, st)
            self._counts[i, False] = self._counts.get((i, False), 0) + 1
            self._owner[worker] = (i, topic_b)
            self.protect.add(st.node_id)
            if st.node_id in self.index.nodes:  # saved by an earlier run: its map is gone
                self.index.drop_node(st.node_id)
            clash = [n for n, v in self.index.nodes.items() if worker in v.workers and n != st.node_id]
        if clash:
            log.warning("a vLLM worker has the name of a daemon's worker; name it with worker=",
                        extra={"worker": worker, "nodes": clash})
        log.info("vLLM publisher heard", extra={"source": src.endpoint, "topic": topic, "worker": worker,
                                                "model": model})
        return stream

    # -- sequence numbers -------------------------------------------------------------------

    def _sequence(self, s: _Stream, seq: int, batch: Batch | None) -> None:
        if s.last is not None and seq <= s.sub_last:  # the counter went back: a new publisher
            log.info("vLLM publisher restarted; its worker's holdings are cleared",
                     extra={"worker": s.worker, "seq": seq, "last": s.last})
            self._clear(s, restart=True)
        if s.last is None:
            frames = self._replay(s, 0) if seq > 0 else {}
            frames[seq] = batch
            self._start_from(s, frames)
        elif seq == s.last + 1:
            self._apply(s, seq, batch)
        elif seq > s.last + 1:
            self._gap(s, seq, batch)
        # else: applied already, from the replay socket
        s.sub_last = seq

    def _gap(self, s: _Stream, seq: int, batch: Batch | None) -> None:
        assert s.last is not None
        first = s.last + 1
        frames = {k: v for k, v in self._replay(s, first).items() if k >= first}
        frames[seq] = batch
        top = max(frames)
        if all(k in frames for k in range(first, top + 1)):
            for k in range(first, top + 1):
                self._apply(s, k, frames[k])
            with self._lock:
                s.st.gaps_recovered += 1
            log.info("vLLM event gap filled from the replay socket",
                     extra={"worker": s.worker, "from_seq": first, "to_seq": seq - 1})
            return
        log.warning("vLLM event gap not recoverable; the worker's holdings are cleared",
                    extra={"worker": s.worker, "from_seq": first, "to_seq": seq - 1,
                           "replay": s.source.replay or None})
        self._clear(s)
        self._start_from(s, frames)

    def _start_from(self, s: _Stream, frames: dict[int, Batch | None]) -> None:
        """Apply the longest unbroken run of ``frames`` that ends at the newest one."""
        top = max(frames)
        lo = top
        while lo - 1 in frames:
            lo -= 1
        for k in range(lo, top + 1):
            self._apply(s, k, frames[k])

    def _apply(self, s: _Stream, seq: int, batch: Batch | None) -> None:
        """Fold batch ``seq`` into ``s``; the stream moves past it whatever happens (a batch
        that cannot be folded resets the worker, as an undecodable one does), so one bad
        batch never makes every later message a gap that replays it again."""
        with self._lock:
            try:
                if batch is None:  # undecodable: what it changed is unknown
                    s.reset()
                    s.st.gaps_lost += 1
                else:
                    s.apply(batch)
            except Exception as e:  # half applied: what the worker holds is unknown
                log.exception("folding a vLLM KV event batch failed; the worker's holdings are cleared",
                              extra={"worker": s.worker, "seq": seq})
                s.st.last_error = f"batch {seq}: {type(e).__name__}: {e}"
                s.st.gaps_lost += 1
                with contextlib.suppress(Exception):
                    s.reset()
            s.last = s.st.seq = seq
            s.st.connected = True

    def _clear(self, s: _Stream, restart: bool = False) -> None:
        with self._lock:
            s.reset()
            s.last = None
            s.sub_last = -1
            if restart:
                s.st.restarts += 1
                s.st.connected = False
            else:
                s.st.gaps_lost += 1

    def expire(self, now: float | None = None) -> int:
        """Drop the streams (and forget the refused topics) of bound endpoints silent for their
        source's ``idle_timeout``: a stream's worker, node and map go, as if it disconnected
        for good. The polling thread calls this about once a second; the number dropped."""
        now = time.monotonic() if now is None else now
        dropped = 0
        with self._handling:
            for key, s in list(self._streams.items()):
                src = self.sources[key[0]]
                if src.bind and src.idle_timeout > 0 and now - s.heard > src.idle_timeout:
                    log.info("vLLM publisher silent; its stream is dropped and its worker forgotten",
                             extra={"worker": s.worker, "source": src.endpoint, "idle_s": round(now - s.heard, 1)})
                    with self._lock:
                        del self._streams[key]
                        self._counts[key[0], False] -= 1
                        if self._owner.get(s.worker) == key:
                            del self._owner[s.worker]
                        s.reset()
                        self.index.drop_node(s.node)
                        self.protect.discard(s.node)
                        self.expired_streams += 1
                    dropped += 1
            for key, heard in list(self._refused_heard.items()):
                src = self.sources[key[0]]
                if src.bind and src.idle_timeout > 0 and now - heard > src.idle_timeout:
                    with self._lock:
                        del self._refused_heard[key]
                        self._refused.pop(key, None)
                        self._counts[key[0], True] -= 1
                        self._capped.discard(key[0])
        return dropped

    # -- the replay socket ------------------------------------------------------------------

    def _replay(self, s: _Stream, from_seq: int) -> dict[int, Batch | None]:
        """Every batch of ``s``'s topic the replay socket has from ``from_seq`` on ({} when
        there is no replay socket; what arrived when the answer does not end in time)."""
        i, src = s.i, s.source
        if not src.replay:
            return {}
        import zmq

        sock = self._replay_socks.get(i)
        if sock is None:
            sock = self._replay_socks[i] = self._context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # an answer is up to buffer_steps (10k) batches in one burst
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(src.replay)
        out: dict[int, Batch | None] = {}
        deadline, size = time.monotonic() + REPLAY_MAX_S, 0
        try:
            sock.send_multipart([b"", from_seq.to_bytes(8, "big")], zmq.NOBLOCK)
            while sock.poll(int(src.replay_timeout * 1000)):
                if time.monotonic() > deadline or size > REPLAY_MAX_BYTES:
                    log.warning("vLLM replay answer too long or too big; cut short",
                                extra={"replay": src.replay, "batches": len(out), "bytes": size})
                    break
                frames = sock.recv_multipart()
                size += sum(len(f) for f in frames)
                if len(frames) == 4 and len(frames[2]) == 8:    # ["", topic, seq, payload] (vLLM 0.32)
                    topic, seq_b, body = frames[1:]
                elif len(frames) == 3 and len(frames[1]) == 8:  # ["", seq, payload] (older vLLM, SGLang)
                    topic, seq_b, body = s.topic, frames[1], frames[2]
                else:
                    continue
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return out
                if topic == s.topic:
                    out[seq] = self._decode(i, topic, body)
        except zmq.ZMQError as e:
            log.warning("vLLM replay request failed", extra={"replay": src.replay, "error": str(e)})
        # no (complete) answer in time: a late rest must not be taken for the next request's.
        # What did arrive is kept: the callers use only unbroken runs of it (a publisher's
        # ROUTER at ZMQ's default high-water mark drops the end of a long answer, END included)
        sock.close(0)
        del self._replay_socks[i]
        log.warning("vLLM replay socket did not answer in time", extra={"replay": src.replay,
                                                                         "timeout_s": src.replay_timeout,
                                                                         "batches": len(out)})
        return out

    def _context(self) -> Any:
        if self._ctx is None:
            try:
                import zmq
            except ImportError as e:
                raise RuntimeError("vLLM events need pyzmq (pip install pyzmq, or kvtier[vllm])") from e
            self._ctx = zmq.Context()
        return self._ctx

    # -- the thread -------------------------------------------------------------------------

    def start(self) -> VllmEvents:
        """Subscribe to every source (and those added later) on a background thread."""
        if self._thread is None:
            self._context()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvtier-router-vllm", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(10)
        with self._handling:
            for sock in self._replay_socks.values():
                sock.close(0)
            self._replay_socks.clear()
        if self._ctx is not None and not self.running:
            self._ctx.term()
            self._ctx = None

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        subs: dict[Any, int] = {}
        monitors: dict[Any, int] = {}
        try:
            while not self._stop.is_set():
                while self._opened < len(self.sources):
                    self._open(self._opened, poller, subs, monitors)
                    self._opened += 1
                for sock, _ in poller.poll(100):
                    if sock in monitors:
                        self._monitor_event(monitors[sock], sock)
                    else:
                        self._drain(subs[sock], sock)
                if time.monotonic() >= self._next_expiry:
                    self._next_expiry = time.monotonic() + 1.0
                    try:
                        self.expire()
                    except Exception:  # a bug must not stop every stream
                        log.exception("expiring silent vLLM streams failed")
        finally:
            for sock in [*subs, *monitors]:
                sock.close(0)
            self._opened = 0

    def _open(self, i: int, poller: Any, subs: dict[Any, int], monitors: dict[Any, int]) -> None:
        import zmq

        src = self.sources[i]
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)      # a publisher that vanished is noticed
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        try:
            if src.bind:
                sock.bind(src.endpoint)
            else:
                mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                monitors[mon] = i
                poller.register(mon, zmq.POLLIN)
                sock.connect(src.endpoint)
        except zmq.ZMQError as e:
            log.error("cannot subscribe to a vLLM publisher", extra={"source": src.endpoint, "error": str(e)})
            sock.close(0)
            return
        subs[sock] = i
        poller.register(sock, zmq.POLLIN)
        log.info("subscribed to vLLM KV events", extra={"source": src.spec()})

    def _drain(self, i: int, sock: Any) -> None:
        import zmq

        for _ in range(1024):  # then the other sockets get their turn
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.feed(frames, i)
            except Exception:  # a bug must not stop every stream
                log.exception("folding a vLLM KV event batch failed", extra={"source": self.sources[i].endpoint})

    def _monitor_event(self, i: int, mon: Any) -> None:
        """The connection to source ``i``'s publisher dropped: its streams start again."""
        from zmq.utils.monitor import recv_monitor_message

        with contextlib.suppress(Exception):
            recv_monitor_message(mon)
        with self._handling:
            for (j, _), s in self._streams.items():
                if j == i and s.last is not None:
                    log.info("vLLM publisher disconnected; its worker's holdings are cleared",
                             extra={"worker": s.worker, "source": self.sources[i].endpoint})
                    self._clear(s, restart=True)

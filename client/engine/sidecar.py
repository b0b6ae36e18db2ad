"""The engine-side client of a node's kvtierd: :class:`Sidecar` (blocking) and :class:`AsyncSidecar`.

Bytes move through the host pool files the daemon names, which the sidecar maps read-write;
gRPC carries only slot grants, commits, leases and releases, one call per batch. A local
daemon hands the sidecar its tenant's pool files and key table as file descriptors over the
credential connection (:meth:`kvtier.handshake.Credentials.open`): they are the daemon's
uid's alone, and the sidecar never opens them by path, whatever uid it runs as.

* ``put``: Allocate (slots for the keys not yet held) -> write each block into its slot ->
  Commit. A block is visible to lookups once ``put`` returns. Blocks that found no slot
  (every slot pinned or granted) are reported in :class:`PutResult`, not raised.
* ``get``: Acquire (pins the slots of the keys held; disk blocks are promoted first) -> copy
  each block out into the caller's buffer (or a new one) -> Release. The pin guarantees the
  slot is not reused while it is copied; the returned buffers are the caller's. The Release
  is sent in the background: ``get`` returns once the bytes are copied, and the sidecar's
  next ``put`` or ``get`` (or ``close``) first waits for it, and raises its error if it
  failed, so a client's pins never outlive its next request.

``lookup`` and ``prefix_length`` read the daemon's shared-memory key table
(:mod:`kvtier.tiers.keytable`, mapped read-only) without calling the daemon: a few
microseconds instead of a gRPC round trip. The Lookup RPC stays the fallback: for remote
clients (``target`` over TCP, where the table's path is not on this machine), when the table
is unavailable (daemon stopped, killed, or gave up on it) or when ``use_key_table=False``. A
key the table shows may be evicted before it is used: ``get`` then returns None for it.
Table lookups are counted where nothing can lose them: in a lookup counters region
(:mod:`kvtier.tiers.lookup_counts`, a sealed memfd) that a local sidecar hands the daemon
once per credential connection, and that the daemon reads whenever its counters are read
(Stats, metrics), every second, and one last time when the connection closes: on ``close()``,
at exit without ``close()``, and after a kill -9 alike. Where the daemon takes no region
(over TCP, an older daemon) they are reported with ReportLookups in the background, at most
every ``REPORT_S``, and on close.

The table is read only while this sidecar's session stream is open on the daemon that writes
it (the epoch in the table's header is the session's; the first lookup opens the session if
no put or get has: one round trip, once). A killed daemon leaves its table behind, still answering until its
heartbeat goes stale (seconds), but its session stream ends at once: the first lookup after
that stops reading the table: it asks the daemon instead (and is refused at once, below, while
there is none). A restarted daemon's table is read once a session on it is open; another
daemon's table never is.

Each sidecar holds one session (a gRPC stream, :mod:`kvtier.client.engine.transport`) for as
long as it is open. If the process exits or is killed the stream ends and the daemon reclaims
every grant and pin it held. Layout ids handed out by ``register_layout`` are the sidecar's
own: if the daemon restarts, the sidecar re-registers the layouts (mapping the new pools) and
opens a new session on the next call, once.

When the daemon is away (a wrong socket, not started yet, stopped, killed, restarting), no call
waits for it: every call that needs it, ``lookup`` and ``prefix_length`` included once the key
table is no longer vouched for, raises :class:`Unavailable` at once (a unix socket that is
missing or refuses connections is known without a timeout; well under a millisecond), naming
the socket and how to start a daemon there. Only a daemon that is there but does not answer
is waited for, up to ``timeout`` (:class:`DeadlineExceeded`). Lookups raise rather than answer
all-miss so that a caller can tell "not held" from "nobody to ask" (an engine's KV event feed
must not report blocks removed because the daemon is briefly away). What an engine does:

* treat it as a miss: catch ``Unavailable`` (or any :class:`KvtierError`) and carry on as if
  nothing were held: ``lookup`` all None, ``get`` recompute, ``put`` skip the offload;
* reconnect in the background, never in the serving path: once a layout is registered the
  sidecar reconnects by itself, the first call that finds the daemon back re-registers the
  layouts and opens a new session (one round trip); an engine that would rather not try on
  every call bypasses the sidecar for a few seconds after a failure and retries from a
  background thread (a ``stats()`` or ``register_layout`` that succeeds means it is back).
  An engine that starts before its daemon retries ``register_layout`` the same way and serves
  without the cache until it succeeds.

Both sidecars are one client: every operation is written once here (:class:`_SidecarCore`,
as coroutines calling the transport's typed methods, ``transport.allocate`` for Allocate and
so on); :class:`Sidecar` runs them with blocking calls (they never suspend there),
:class:`AsyncSidecar` awaits them.

Errors: every failure is a :class:`KvtierError` carrying a gRPC status code and the daemon's
message; a malformed argument, found before any call (wrong block size, keys and blocks of
different lengths) or by the daemon, is :class:`InvalidArgument` (also a ``ValueError``); no
daemon at the target is :class:`Unavailable`.
"""

from __future__ import annotations

import errno
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from kvtier.client.engine.copyin import get_blocks, put_blocks
from kvtier.client.engine.transport import (
    RESTART_CODES,
    AsyncTransport,
    ClientTls,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    Pending,
    Transport,
    Unavailable,
)
from kvtier.proto import locations_pb2, node_pb2
from kvtier.tiers.host import PoolMapping
from kvtier.tiers.keytable import (
    ORDERING_SAFE,
    TIER_BITS,
    KeyTableError,
    KeyTableReader,
    TableUnavailable,
    prefix_lengths,
    tier_names,
)
from kvtier.tiers.keytable import _cprobe as _cprobe
from kvtier.tiers.layout import Layout, layout_to_proto
from kvtier.tiers.lookup_counts import MASKS, CountsWriter, by_tier
from kvtier.tiers.vocab import TIERS

__all__ = ["AsyncSidecar", "InvalidArgument", "KvtierError", "PutResult", "RetainResult", "Sidecar", "Unavailable",
           "stats_dict"]

TABLE_RETRY_S = 1.0  # after losing the key table, ask the daemon for a new one at most this often
REPORT_S = 1.0       # without a counters region: table lookups are reported at most this often, and on close
REPORT_TIMEOUT_S = 5.0  # for a lookup report: counts only, never worth a long wait

T = TypeVar("T")

_TIER_LABEL: dict[int, str] = {int(t): t.label for t in TIERS}  # wire value -> "gpu" | "host" | "disk"


@dataclass(frozen=True)
class RetainResult:
    """What ``retain`` did (the daemon's RetainReply)."""

    retained: int        # distinct keys retained, new or renewed
    held: int            # of them, held in host or on disk now (the others are kept once stored)
    released: int        # this tenant's other retentions released to make room in its budget
    retained_bytes: int  # this tenant's retained slot bytes now
    budget_bytes: int    # this tenant's retention budget (kvtierd --retention-budget)


@dataclass
class PutResult:
    stored: int = 0                                     # newly written and committed
    present: int = 0                                    # already held: nothing written
    dropped: list[bytes] = field(default_factory=list)  # found no slot (all pinned or granted)
    durable: int = 0                                    # stored or present, and on disk and indexed (durable puts)


def stats_dict(reply: node_pb2.StatsReply) -> dict:
    """A Stats reply as the dict ``stats()`` returns (tiers keyed by their label)."""
    return {
        "node_id": reply.node_id, "epoch": reply.epoch, "uptime_s": reply.uptime_s, "version": reply.version,
        "sessions": reply.sessions,
        "tiers": {_TIER_LABEL.get(t.tier, "none"): {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                                                    "blocks": t.blocks, "load_gbps": t.load_gbps} for t in reply.tiers},
        "layouts": [{"layout_id": lay.layout_id, "fingerprint": lay.fingerprint.hex(), "block_bytes": lay.block_bytes,
                     "host_blocks": lay.host_blocks, "disk_blocks": lay.disk_blocks} for lay in reply.layouts],
        "counters": dict(reply.counters),
        "retained_bytes": reply.retained_bytes, "retention_budget_bytes": reply.retention_budget_bytes,
    }


def _as_bytes(block: Any, block_bytes: int, index: int) -> np.ndarray:
    """A block (bytes-like or CPU torch tensor) as a flat uint8 array of ``block_bytes``."""
    if type(block).__module__.startswith("torch"):
        torch = sys.modules["torch"]
        if block.device.type != "cpu":
            raise InvalidArgument(f"block {index} is on {block.device}; put takes CPU tensors "
                                  f"(GPU blocks go through offload)")
        arr = block.contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        try:
            arr = np.frombuffer(block, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as e:
            raise InvalidArgument(f"block {index} is not bytes-like ({type(block).__name__}): {e}") from None
    if arr.size != block_bytes:
        raise InvalidArgument(f"block {index} is {arr.size} bytes; this layout's blocks are {block_bytes} bytes")
    return arr


_tally = None if _cprobe is None else _cprobe.tally  # counts[m] += 1 per mask, in C
# A put (get) of at least PIPELINE_MIN_BYTES goes as a pipeline of pieces of at least
# PIPELINE_PIECE_BYTES each. Each piece costs its own calls (about 0.3-0.6 ms of the client's
# thread to send one, and daemon CPU beside the copy threads), so a piece must copy for much
# longer than that: with the copy on several threads and the checksums taken by the client
# (no daemon hashing left to overlap), pieces of 8 MiB made 32 and 128 MiB puts slower, not
# faster (docs/DESIGN.md "Client checksums and the pool copy").
PIPELINE_MIN_BYTES = 256 << 20
PIPELINE_PIECE_BYTES = 64 << 20
PIPELINE_MAX_PIECES = 4


def _pieces(n: int, nbytes: int) -> list[tuple[int, int]]:
    """A put of ``n`` blocks (``nbytes`` in all) as pieces ``[lo, hi)``: one below
    ``PIPELINE_MIN_BYTES``, else up to ``PIPELINE_MAX_PIECES`` of ``PIPELINE_PIECE_BYTES`` or more."""
    k = 1 if nbytes < PIPELINE_MIN_BYTES else max(1, min(PIPELINE_MAX_PIECES, n, nbytes // PIPELINE_PIECE_BYTES))
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _check_distinct(keys: list[bytes], pieces: list[tuple[int, int]]) -> None:
    """A batch sent as several pieces is refused, before any call, for a repeated key, as the
    daemon refuses one sent whole (each piece alone would not show it)."""
    if len(pieces) > 1 and len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise InvalidArgument(f"key {dup.hex()} appears more than once in one batch; send each key once")


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as a list of bytes (their lengths are the daemon's, or the key table's, to check)."""
    if all(type(k) is bytes for k in keys):  # the common case, on the lookup hot path
        return list(keys)
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"key {i} is {type(k).__name__}; keys are bytes")
        out.append(bytes(k))
    return out


def _table_epoch(table: KeyTableReader) -> int:
    """The daemon epoch a key table's header carries; 0 if it cannot be read (never trusted:
    no session has epoch 0). Read from the mapping, as the format documents it: a table's
    epoch never changes, and the file at a table's path always belongs to the same daemon."""
    try:
        return table.epoch
    except (ValueError, struct.error):
        return 0


def _tiers(reply: node_pb2.LookupReply) -> list[str | None]:
    return [_TIER_LABEL.get(t) for t in reply.tiers]


def _tier_masks(tiers: list[str | None]) -> np.ndarray:
    return np.array([TIER_BITS[t] if t else 0 for t in tiers], dtype=np.uint8)


@dataclass
class _LayoutInfo:
    layout: Layout
    daemon_id: int = 0
    block_bytes: int = 0
    pool: PoolMapping | None = None
    table: KeyTableReader | None = None
    table_retry_at: float = 0.0
    epoch: int = 0  # of the daemon whose RegisterLayout reply (pool, offsets) this holds
    # table lookups by the tier bit set found (index 0: misses): this layout's slot of the lookup
    # counters region the daemon reads (shared), else those not yet reported (ReportLookups)
    table_counts: np.ndarray = field(default_factory=lambda: np.zeros(MASKS, dtype=np.uint64))
    shared: bool = False


class _SidecarCore:
    """Every sidecar operation, once, as a coroutine of the transport's typed calls (module
    docstring of :mod:`kvtier.client.engine.transport`): layouts, pools, the key table, byte
    movement and restart recovery. :class:`Sidecar` runs them blocking
    (:meth:`~kvtier.client.engine.transport.Transport.run`), :class:`AsyncSidecar` awaits them."""

    def __init__(self, transport: Transport | AsyncTransport, use_key_table: bool) -> None:
        self._transport = transport
        self.use_key_table = use_key_table
        self._channel = transport.channel  # (tests speak the raw protocol on it)
        self._layouts: dict[int, _LayoutInfo] = {}
        self._pools: dict[str, PoolMapping] = {}
        self._tables: dict[str, KeyTableReader] = {}
        self._table_epochs: dict[str, int] = {}  # path -> the daemon epoch in the table's header
        self._had_table = False
        self.table_fallbacks = 0  # lookups the key table could not answer (then asked by RPC)
        self._report_at = 0.0  # inf while every layout counts in the region the daemon reads
        self._counts: CountsWriter | None = None  # that region
        self._counts_conn = -1  # the credential connection it went on (-1: none; 0: none to be had)
        self._pending: list[tuple[int, np.ndarray]] = []  # private counts left to report
        self._share_lock = threading.Lock()
        transport.on_connect(self._new_connection)
        self._generation = 0  # bumped by each restart recovery

    @property
    def target(self) -> str:
        return self._transport.target

    @property
    def tenant(self) -> str:
        """The tenant the daemon knows this client as (from the credential handshake on the unix
        socket; "" over TCP, where the client certificate says)."""
        return self._transport.tenant

    @property
    def key_salt(self) -> str:
        """The daemon's secret key salt for this client's tenant: what a
        :class:`~kvtier.client.engine.keys.Namespace` built for this daemon uses by default
        ("" over TCP)."""
        return self._transport.key_salt

    def pass_fds(self, fds: Sequence[int]) -> list[str]:
        """Hand the daemon file descriptors (``SCM_RIGHTS`` over the credential connection; each
        stays open here too); their handles, in order, usable by this client only, until the
        daemon takes them or this client closes. Local daemons (unix socket) only."""
        return self._transport.pass_fds(fds)

    @property
    def timeout(self) -> float:
        return self._transport.timeout

    @property
    def client_name(self) -> str:
        return self._transport.client_name

    @property
    def session_id(self) -> int:
        """The open session's id; 0 before the first call that needs one."""
        return self._transport.session.session_id

    @property
    def node_id(self) -> str:
        return self._transport.session.node_id

    @property
    def epoch(self) -> int:
        """The epoch of the daemon the session was opened on (a restart changes it)."""
        return self._transport.session.epoch

    def _info(self, layout_id: int) -> _LayoutInfo:
        info = self._layouts.get(layout_id)
        if info is None:
            raise FailedPrecondition(f"layout_id {layout_id} was not registered through this sidecar: call "
                                     f"register_layout(layout) first (it returns the same id as the daemon's "
                                     f"stats and KVConnector.register for the same layout)")
        return info

    # -- operations ------------------------------------------------------------------------

    async def _register_layout(self, layout: Layout) -> int:
        for lid, info in self._layouts.items():
            if info.layout.fingerprint == layout.fingerprint:
                return lid
        info = _LayoutInfo(layout)
        self._adopt(info, await self._transport.register_layout(self._register_request(info), wait_for_ready=True))
        lid = info.daemon_id  # one id everywhere: the daemon's, derived from the fingerprint
        self._layouts[lid] = info
        if self._counts is not None and self._counts_conn > 0:
            self._count_in(self._counts, [info])
        return lid

    async def _put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any], durable: bool) -> PutResult:
        info = self._info(layout_id)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks; give one block per key")
        arrs = [_as_bytes(b, info.block_bytes or info.layout.block_bytes, i) for i, b in enumerate(blocks)]
        keys = _check_keys(keys)
        if not keys:
            return PutResult()
        return await self._recovering(lambda: self._put_once(info, keys, arrs, durable))

    async def _put_once(self, info: _LayoutInfo, keys: list[bytes], arrs: list[np.ndarray],
                        durable: bool) -> PutResult:
        """Allocate, write, commit; a big put as a pipeline of pieces (:func:`_pieces`): the
        Allocate of piece i+1 is in flight while piece i is copied, and the Commit of piece i
        (the daemon checksums it) while piece i+1 is copied. Returns once every piece is
        committed; a piece's refusal or error is its keys' alone (dropped), a failed call raises."""
        transport = self._transport
        result = PutResult()
        await transport.settle()
        sid = await self._bound_session()
        pieces = _pieces(len(keys), len(keys) * (info.block_bytes or info.layout.block_bytes))
        _check_distinct(keys, pieces)

        def allocation(lo: int, hi: int) -> node_pb2.AllocateRequest:
            return node_pb2.AllocateRequest(session_id=sid, layout_id=info.daemon_id, keys=keys[lo:hi],
                                            durable=durable)

        commits: list[Pending[node_pb2.CommitReply]] = []  # the Commits in flight
        nxt: Pending[node_pb2.AllocateReply] | None = None  # the next piece's Allocate in flight
        reply: node_pb2.AllocateReply | None = None
        try:
            reply = await transport.allocate(allocation(*pieces[0]))
            for i, (lo, hi) in enumerate(pieces):
                if i + 1 < len(pieces):
                    nxt = transport.start_allocate(allocation(*pieces[i + 1]))
                gids, sums = self._write(info, reply, keys[lo:hi], arrs[lo:hi], result)
                reply = None  # written: its grants are the Commit's now
                if gids:
                    commit = node_pb2.CommitRequest(session_id=sid, grant_ids=gids, durable=durable, checksums=sums)
                    if len(pieces) == 1:  # nothing to overlap it with: a plain call
                        result.durable += (await transport.commit(commit)).durable
                    else:
                        commits.append(transport.start_commit(commit))
                    result.stored += len(gids)
                if nxt is not None:
                    reply, nxt = await transport.reply(nxt), None
            while commits:
                result.durable += (await transport.reply(commits.pop(0))).durable
        except BaseException:
            await self._abandon(sid, reply, nxt, commits)
            raise
        return result

    async def _abandon(self, sid: int, reply: node_pb2.AllocateReply | None,
                       nxt: Pending[node_pb2.AllocateReply] | None, commits: list[Pending[node_pb2.CommitReply]]) -> None:
        """A put failed: wait for the calls in flight (their outcome no longer matters) and
        abort the grants not committed: the piece being written and the next piece's."""
        for pending in commits:
            try:
                await self._transport.reply(pending)
            except KvtierError:
                pass
        if nxt is not None:
            try:
                got = await self._transport.reply(nxt)
            except KvtierError:
                got = None
            if got is not None:
                await self._abort(sid, got)
        if reply is not None:
            await self._abort(sid, reply)

    async def _abort(self, sid: int, reply: node_pb2.AllocateReply) -> None:
        aborts = [g.grant_id for g in reply.grants if g.status == node_pb2.GRANTED]
        if aborts:
            try:
                await self._transport.commit(node_pb2.CommitRequest(session_id=sid, abort_grant_ids=aborts))
            except KvtierError:
                pass  # the session is gone with its grants, or the daemon reclaims them at its end

    async def _get(self, layout_id: int, keys: Sequence[bytes], out: Sequence[Any] | None,
                   verify: bool = False) -> list[memoryview | None]:
        info, keys = self._info(layout_id), _check_keys(keys)
        return await self._recovering(lambda: self._get_once(info, keys, out, verify))

    async def _get_once(self, info: _LayoutInfo, keys: list[bytes], out: Sequence[Any] | None,
                        verify: bool = False) -> list[memoryview | None]:
        """Acquire, copy out, release; a big get as a pipeline of pieces (:func:`_pieces`): the
        Acquire of piece i+1 is in flight while piece i is copied out."""
        if out is not None and len(out) != len(keys):
            raise InvalidArgument(f"{len(out)} output buffers for {len(keys)} keys")
        transport = self._transport
        await transport.settle()
        sid = await self._bound_session()
        pieces = _pieces(len(keys), len(keys) * (info.block_bytes or info.layout.block_bytes))
        _check_distinct(keys, pieces)

        def acquisition(lo: int, hi: int) -> node_pb2.AcquireRequest:
            return node_pb2.AcquireRequest(session_id=sid, layout_id=info.daemon_id, keys=keys[lo:hi], verify=verify)

        got: list[memoryview | None] = []
        nxt: Pending[node_pb2.AcquireReply] | None = None  # the next piece's Acquire in flight
        reply = await transport.acquire(acquisition(*pieces[0]))
        try:
            for i, (lo, hi) in enumerate(pieces):
                if i + 1 < len(pieces):
                    nxt = transport.start_acquire(acquisition(*pieces[i + 1]))
                try:
                    got += self._read(info, reply, None if out is None else out[lo:hi])
                finally:
                    self._release(sid, reply)  # copied out (or failed): in the background
                if nxt is not None:
                    reply, nxt = await transport.reply(nxt), None
        except BaseException:
            if nxt is not None:  # its pins go too
                try:
                    self._release(sid, await transport.reply(nxt))
                except KvtierError:
                    pass
            raise
        return got

    def _release(self, sid: int, reply: node_pb2.AcquireReply) -> None:
        """Release an Acquire's leases in the background (module docstring)."""
        held = [lease.lease_id for lease in reply.leases if lease.lease_id]
        if held:
            self._transport.release_later(node_pb2.ReleaseRequest(session_id=sid, lease_ids=held))

    async def _lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        info, keys = self._info(layout_id), _check_keys(keys)
        return tier_names(await self._held(info, keys))

    async def _prefix_length(self, layout_id: int, keys: Sequence[bytes]) -> tuple[int, int]:
        info, keys = self._info(layout_id), _check_keys(keys)
        return prefix_lengths(await self._held(info, keys))

    async def _held(self, info: _LayoutInfo, keys: list[bytes]) -> np.ndarray:
        """Per key, the tier bit set holding it: from the key table, else the Lookup RPC."""
        masks = await self._masks(info, keys)
        if masks is None:
            masks = _tier_masks(await self._lookup_rpc(info, keys))
        return masks

    async def _lookup_rpc(self, info: _LayoutInfo, keys: list[bytes]) -> list[str | None]:
        request = node_pb2.LookupRequest(layout_id=info.daemon_id, keys=keys)
        return _tiers(await self._recovering(lambda: self._transport.lookup(request)))

    async def _evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        info, keys = self._info(layout_id), _check_keys(keys)
        request = node_pb2.EvictRequest(layout_id=info.daemon_id, keys=keys)
        return (await self._recovering(lambda: self._transport.evict(request))).evicted

    async def _prefetch(self, layout_id: int, keys: Sequence[bytes], from_node: str = "") -> int:
        info, keys = self._info(layout_id), _check_keys(keys)
        request = node_pb2.PrefetchRequest(layout_id=info.daemon_id, keys=keys, from_node=from_node or "")
        return (await self._recovering(lambda: self._transport.prefetch(request))).promoted

    async def _retain(self, layout_id: int, keys: Sequence[bytes], ttl_s: float, priority: int) -> RetainResult:
        info, keys = self._info(layout_id), _check_keys(keys)
        if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s > 0):
            raise InvalidArgument(f"ttl_s is {ttl_s!r}: a retention lasts a positive number of seconds")
        if not (isinstance(priority, int) and -(2**31) <= priority < 2**31):
            raise InvalidArgument(f"priority is {priority!r}: an int32")
        request = node_pb2.RetainRequest(layout_id=info.daemon_id, keys=keys, ttl_s=float(ttl_s), priority=priority)
        r = await self._recovering(lambda: self._transport.retain(request))
        return RetainResult(r.retained, r.held, r.released, r.retained_bytes, r.budget_bytes)

    async def _report_device_blocks(self, layout_id: int, stored: Sequence[bytes], removed: Sequence[bytes],
                                    worker_id: str | None, clear: bool) -> int:
        info = self._info(layout_id)
        stored, removed = _check_keys(stored), _check_keys(removed)

        async def once() -> int:
            req = locations_pb2.ReportDeviceBlocksRequest(
                worker_id=worker_id or self.client_name, layout_id=info.daemon_id, stored=stored,
                removed=removed, clear=clear, session_id=await self._transport.open_session())
            return (await self._transport.report_device_blocks(req)).seq

        return await self._recovering(once)

    async def _stats(self) -> dict:
        return stats_dict(await self._transport.stats(wait_for_ready=True))

    async def _close(self) -> None:
        """Report the last table lookups not in the counters region and settle the last release
        (a daemon that is gone needs neither), end the session, unmap the pools and tables (the
        daemon reads the counters region one last time when the credential connection closes)."""
        req = self._report_due(force=True)
        if req is not None:
            try:
                await self._transport.report_lookups(req, timeout=self._report_timeout())
            except KvtierError:
                pass
        try:
            await self._transport.settle()
        except KvtierError:
            pass
        self._transport.session.close()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        for table in self._tables.values():
            table.close()
        self._tables.clear()
        self._table_epochs.clear()
        for info in self._layouts.values():
            info.table = None

    # -- restart recovery --------------------------------------------------------------------

    async def _recovering(self, once: Callable[[], Awaitable[T]]) -> T:
        """Run ``once()`` (the calls of one operation); if the daemon it talks to restarted,
        re-register every layout and open a new session, once, then run it again. A
        FAILED_PRECONDITION from the daemon the session lives on re-registers and retries once,
        keeping the session (the daemon may lack the layouts if it restarted while this
        sidecar had no session)."""
        generation = self._generation
        try:
            return await once()
        except KvtierError as e:
            if e.code not in RESTART_CODES:
                raise
            first = e
        gone = await self._transport.restarted(first)
        async with self._transport.locked():
            await self._recover(generation, gone, first)
        return await once()

    async def _bound_session(self) -> int:
        """The session's id, opening it if needed; when its daemon is not the one the layouts
        (and so the pool mappings and slot offsets) were registered with, every layout is
        registered again first. Without this, a sidecar whose recovery failed while the daemon
        was down would read a restarted daemon's lease offsets in the old daemon's pool file:
        another block's bytes."""
        sid = await self._transport.open_session()
        epoch = self._transport.session.epoch
        if any(info.epoch != epoch for info in self._layouts.values()):
            await self._register_all(wait_for_ready=True)
        return sid

    async def _recover(self, generation: int, gone: bool, first: KvtierError) -> None:
        """Under the transport's lock (it must not open the session)."""
        if generation != self._generation:
            return  # a concurrent call recovered already
        if gone:
            self._transport.session.close()
        try:
            await self._register_all(wait_for_ready=True)
        except KvtierError:
            raise first from None
        self._generation += 1

    @staticmethod
    def _register_request(info: _LayoutInfo) -> node_pb2.RegisterLayoutRequest:
        return node_pb2.RegisterLayoutRequest(layout=layout_to_proto(info.layout, node_pb2.LayoutSpec))

    async def _register_all(self, wait_for_ready: bool) -> None:
        """Register every layout again, in registration order, and adopt the replies."""
        for info in self._layouts.values():
            self._adopt(info, await self._transport.register_layout(self._register_request(info),
                                                                    wait_for_ready=wait_for_ready))

    def _adopt(self, info: _LayoutInfo, reply: node_pb2.RegisterLayoutReply) -> None:
        if reply.fingerprint != info.layout.fingerprint:
            raise KvtierError(grpc.StatusCode.INTERNAL, "daemon computed another layout fingerprint; "
                                                        "client and daemon versions differ")
        pool = self._pools.get(reply.pool_path)
        if pool is None:
            pool = self._pools[reply.pool_path] = self._map_pool(reply.pool_path, reply.pool_bytes)
        info.daemon_id, info.block_bytes, info.pool, info.epoch = reply.layout_id, reply.block_bytes, pool, reply.epoch
        # forget pools no layout uses any more (a restarted daemon's old, unlinked pool): the
        # mapping goes with its last user, so its memory is freed instead of kept by this process
        used = {id(i.pool) for i in self._layouts.values()} | {id(pool)}
        for path in [p for p, m in self._pools.items() if id(m) not in used]:
            del self._pools[path]
        info.table = self._open_table(reply.key_table_path) if self.use_key_table else None
        # and tables no layout reads any more (a restarted daemon's old one): unmapped, not kept
        tables = {id(i.table) for i in self._layouts.values()} | {id(info.table)}
        for table in [t for t in self._tables.values() if id(t) not in tables]:
            self._drop_table(table)

    def _map_pool(self, path: str, size: int) -> PoolMapping:
        """Map a pool file the daemon named: a local daemon hands it over as a descriptor (the
        file is the daemon's uid's alone), so this client never opens it by its path; over TCP
        (a daemon on this machine, same uid) the path is opened."""
        if not self._transport.local:
            return PoolMapping(path, size)
        fd = self._transport.open_file(path)
        try:
            return PoolMapping(path, size, fd=fd)
        except BaseException:
            os.close(fd)
            raise

    def _table_opener(self, path: str) -> int:
        """A key table's descriptor from the daemon (each open, reopens after a rebuild included)."""
        try:
            return self._transport.open_file(path)
        except KvtierError as e:
            raise OSError(errno.EACCES, f"the daemon did not hand over key table {path}: {e}") from None

    def open_file(self, path: str) -> int:
        """A descriptor of one of this client's tenant's files, as a RegisterLayout reply names
        them (its pool file, read-write; its key table, read-only), handed over by the local
        daemon; the caller closes it. :class:`PermissionDenied` for any other path (another
        tenant's files included)."""
        return self._transport.open_file(path)

    # -- key table -----------------------------------------------------------------------

    async def _masks(self, info: _LayoutInfo, keys: list[bytes]) -> np.ndarray | None:
        """Tier bit sets from the key table (asking the daemon for a new table once it was
        lost, at most every TABLE_RETRY_S); None: use the Lookup RPC. The table is read only
        while it is vouched for (:meth:`_confirm_table`). Table lookups are counted in the
        counters region the daemon reads (:meth:`_share_counts`), else reported to the daemon's
        counters in the background, at most every REPORT_S."""
        if info.table is None and self._want_table(info):
            try:
                await self._register_all(wait_for_ready=False)
            except KvtierError:
                return None
        if info.table is not None and not self._vouched(info):
            await self._confirm_table(info)
        if info.table is not None and self._counts_conn < 0:
            self._share_counts()
        masks = self._table_masks(info, keys)
        if masks is not None:
            req = self._report_due()
            if req is not None:  # without waiting: the answer is for the daemon's counters only
                self._transport.report_lookups_later(req, timeout=self._report_timeout())
        return masks

    def _table_fast(self, layout_id: int, keys: Sequence[bytes]) -> np.ndarray | None:
        """The hot path of a blocking lookup, without running an operation: the tier bit sets
        from a table already vouched for, when no report is due (never, while the lookups are
        counted in the region the daemon reads); None when anything else must happen first (then
        the whole operation runs)."""
        info = self._layouts.get(layout_id)
        if info is None or info.table is None or time.monotonic() >= self._report_at or not self._vouched(info):
            return None
        if info.table.compiled:  # it checks each key's type itself: no pass over the keys here
            try:
                return self._table_masks(info, keys)
            except (TypeError, BufferError):
                pass  # not bytes: _check_keys names the key
        return self._table_masks(info, _check_keys(keys))

    def _vouched(self, info: _LayoutInfo) -> bool:
        """The table may be read: this sidecar's session stream is open on the daemon that
        writes it (the epoch in the table's header is the session's)."""
        session, table = self._transport.session, info.table
        return table is not None and session.alive and self._table_epochs.get(table.path) == session.epoch

    async def _confirm_table(self, info: _LayoutInfo) -> None:
        """Make the table vouched for, or drop it. A table's answers are only as current as its
        daemon: one killed leaves its table behind, unclosed and answering, until its heartbeat
        goes stale (seconds). Its session stream ends at once, though (the kernel closes a dead
        process's connections): an ended stream drops every table of its epoch, and the
        session, in the first lookup that sees it. A table is trusted only with a session open
        on the same epoch (opened here if there is none), so a table of another daemon is
        never read."""
        session = self._transport.session
        if session.ended:
            dead = session.epoch
            for table in [t for t in self._tables.values() if self._table_epochs.get(t.path) == dead]:
                self._drop_table(table)
            session.drop_if_ended()
            if info.table is None:
                return
        if not session.alive:
            await self._transport.open_session()  # Unavailable at once when no daemon is there
        if info.table is not None and not self._vouched(info):
            self._drop_table(info.table)

    def _open_table(self, path: str) -> KeyTableReader | None:
        """The reader of the table at ``path``, or None where it cannot be mapped (a remote
        daemon, or one that publishes none)."""
        if not path or not ORDERING_SAFE:
            return None
        table = self._tables.get(path)
        if table is None:
            try:
                session = self._transport.session  # late heartbeats are tolerated while its stream is open
                table = self._tables[path] = KeyTableReader(
                    path, opener=self._table_opener if self._transport.local else None,
                    alive=lambda: session.alive and session.epoch == self._table_epochs.get(path))
            except (OSError, KeyTableError):
                return None
            self._table_epochs[path] = _table_epoch(table)
            self._had_table = True
        return table

    def _table_masks(self, info: _LayoutInfo, keys: list[bytes]) -> np.ndarray | None:
        """Per key, its tier bit set from the key table; None: ask the daemon instead."""
        table = info.table
        if table is None:
            return None
        try:
            masks = table.masks(info.layout.fingerprint, keys)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        except TableUnavailable:
            self.table_fallbacks += 1  # every lookup the table could not answer
            self._drop_table(table)
            return None
        if len(masks) == 1:
            info.table_counts[masks[0]] += 1
        elif _tally is not None:
            _tally(masks, info.table_counts)
        else:
            info.table_counts += np.bincount(masks, minlength=MASKS).view(np.uint64)
        return masks

    # -- lookup counters -------------------------------------------------------------------

    def _new_connection(self) -> None:
        """A new credential connection (the daemon restarted, or closed the old one): the next
        table lookup hands the daemon a new counters region (the old one is no longer read)."""
        self._counts, self._counts_conn = None, -1
        for info in self._layouts.values():  # counted privately until then
            if info.shared:
                info.table_counts, info.shared = np.zeros(MASKS, dtype=np.uint64), False
        self._report_at = 0.0  # out of the fast path once: the next lookup runs _masks

    def _share_counts(self) -> None:
        """Count table lookups in a new counters region handed to the daemon on the current
        credential connection; where it takes none (TCP, an older daemon), keep reporting them."""
        if not self._transport.local:
            self._counts_conn = 0
            return
        with self._share_lock:
            if self._counts_conn >= 0:
                return  # another thread did
            writer = CountsWriter(f"kvtier-lookups-{os.getpid()}")
            try:
                conn = self._transport.lookup_counters(writer.fd)
            except KvtierError:
                self._counts_conn = 0  # until the next connection: reported instead
                writer.close()
                return
            finally:
                writer.release_fd()
            self._counts, self._counts_conn = writer, conn
            self._count_in(writer, list(self._layouts.values()))

    def _count_in(self, writer: CountsWriter, infos: list[_LayoutInfo]) -> None:
        """Move these layouts' counting into ``writer``'s slots (counts not yet reported stay
        private and go with the next report)."""
        for info in infos:
            view = writer.claim(info.daemon_id)
            if view is None:
                continue
            if not info.shared and info.table_counts.any():
                self._pending.append((info.daemon_id, info.table_counts))
            info.table_counts, info.shared = view, True
        everywhere = all(i.shared for i in self._layouts.values())
        self._report_at = math.inf if everywhere and not self._pending else time.monotonic()

    def _report_due(self, force: bool = False) -> node_pb2.ReportLookupsRequest | None:
        """The table lookups to report to the daemon's counters, if it is time (every REPORT_S,
        or ``force``), as counts by the fastest tier found; None if nothing is due."""
        now = time.monotonic()
        if not force and now < self._report_at:
            return None
        private = [(i.daemon_id, i.table_counts) for i in self._layouts.values() if not i.shared]
        self._report_at = now + REPORT_S if private else math.inf
        req = node_pb2.ReportLookupsRequest()
        for layout_id, c in [*self._pending, *private]:
            if c.any():
                gpu, host, disk, miss = by_tier([int(x) for x in c])
                req.layouts.add(layout_id=layout_id, hit_gpu=gpu, hit_host=host, hit_disk=disk, miss=miss)
                c[:] = 0
        self._pending.clear()
        return req if req.layouts else None

    def _report_timeout(self) -> float:
        return min(self.timeout, REPORT_TIMEOUT_S)

    def _drop_table(self, table: KeyTableReader) -> None:
        # the retry time stays: a table lost long ago is asked for again at once, but one that
        # was just handed out again and is still unusable (invalid, stale) waits TABLE_RETRY_S
        for info in self._layouts.values():
            if info.table is table:
                info.table = None
        if self._tables.pop(table.path, None) is table:  # closed once: two threads may drop it
            self._table_epochs.pop(table.path, None)
            table.close()

    def _want_table(self, info: _LayoutInfo) -> bool:
        """True when the table was lost and it is time to ask the daemon for its current one
        (at once after losing it, then at most every TABLE_RETRY_S)."""
        if info.table is not None or not (self.use_key_table and self._had_table):
            return False
        if time.monotonic() < info.table_retry_at:
            return False
        info.table_retry_at = time.monotonic() + TABLE_RETRY_S
        return True

    # -- bytes ---------------------------------------------------------------------------

    @staticmethod
    def _write(info: _LayoutInfo, reply: node_pb2.AllocateReply, keys: list[bytes], arrs: list[np.ndarray],
               result: PutResult) -> tuple[list[int], list[int]]:
        """Write each granted block into its slot; the grant ids to commit and the blocks'
        checksums as written (:mod:`~kvtier.client.engine.copyin`)."""
        pool, n = info.pool, info.block_bytes
        assert pool is not None
        gids, offsets, todo = [], [], []
        for key, arr, g in zip(keys, arrs, reply.grants, strict=True):
            if g.status == node_pb2.GRANTED:
                pool.prepare_write(g.offset, n)
                gids.append(g.grant_id)
                offsets.append(g.offset)
                todo.append(arr)
            elif g.status == node_pb2.PRESENT:
                result.present += 1
                result.durable += g.durable
            else:
                result.dropped.append(key)
        return gids, put_blocks(pool.arr, offsets, todo)

    @staticmethod
    def _read(info: _LayoutInfo, reply: node_pb2.AcquireReply, out: Sequence[Any] | None) -> list[memoryview | None]:
        """Copy each leased block out of its slot (into ``out[i]`` if given); None per miss."""
        pool, n = info.pool, info.block_bytes
        assert pool is not None
        if out is not None and len(out) != len(reply.leases):
            raise InvalidArgument(f"{len(out)} output buffers for {len(reply.leases)} keys")
        result: list[memoryview | None] = []
        offsets, dsts = [], []
        for i, lease in enumerate(reply.leases):
            if lease.lease_id == 0:
                result.append(None)
                continue
            buf = bytearray(n) if out is None else out[i]
            try:
                dst = np.frombuffer(buf, dtype=np.uint8)
            except (TypeError, ValueError, BufferError) as e:
                raise InvalidArgument(f"output buffer {i} is not a contiguous buffer ({type(buf).__name__}): {e}") from None
            if dst.size != n:
                raise InvalidArgument(f"output buffer {i} is {dst.size} bytes; blocks are {n} bytes")
            if not dst.flags.writeable:
                raise InvalidArgument(f"output buffer {i} is read-only ({type(buf).__name__})")
            offsets.append(lease.offset)
            dsts.append(dst)
            result.append(memoryview(buf))
        get_blocks(pool.arr, offsets, dsts)
        return result


class Sidecar(_SidecarCore):
    """Blocking client of the local kvtierd (see the module docstring); thread-safe.

    ``socket_path`` / ``target``: where the daemon is (:func:`~kvtier.client.engine.transport.resolve_target`:
    default ``$KVTIER_SOCKET``, else the daemon's default socket). Nothing is called until
    the first operation: a socket with no daemon behind it is :class:`Unavailable` there, at
    once (see "When the daemon is away" in the module docstring). ``timeout``: the longest
    wait for a daemon that is there to answer."""

    def __init__(self, socket_path: str | None = None, *, target: str | None = None,
                 client_name: str | None = None, timeout: float = 60.0, use_key_table: bool = True,
                 tls: ClientTls | None = None) -> None:
        self._transport: Transport = Transport(socket_path, target=target, client_name=client_name, timeout=timeout,
                                               tls=tls)
        super().__init__(self._transport, use_key_table)
        self._stub = self._transport.node  # (tests speak the raw protocol on it)

    def _ensure_session(self) -> int:
        return self._transport.session.open()

    def register_layout(self, layout: Layout) -> int:
        """Register ``layout`` with the daemon; returns its layout id: the daemon's (from the layout's fingerprint), the same in ``stats()``, in ``KVConnector.register`` and across daemon restarts."""
        return self._transport.run(self._register_layout(layout))

    def put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any], durable: bool = False) -> PutResult:
        """Store ``blocks`` under ``keys`` (one RPC to allocate, one to commit). ``durable``: reply
        once the blocks are on disk and indexed (needs the disk tier)."""
        return self._transport.run(self._put(layout_id, keys, blocks, durable))

    def get(self, layout_id: int, keys: Sequence[bytes], out: Sequence[Any] | None = None, *,
            verify: bool = False) -> list[memoryview | None]:
        """Copy the blocks held under ``keys`` out (into ``out`` buffers if given); None per miss.
        ``verify``: the daemon checks each block against the checksum taken at its commit first
        (a block changed since is dropped: a miss)."""
        return self._transport.run(self._get(layout_id, keys, out, verify))

    def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier holding each key ("gpu", "host", "disk"), or None.

        Read from the key table when it is mapped, else asked with the Lookup RPC;
        :class:`Unavailable` at once while the daemon is away (module docstring)."""
        masks = self._table_fast(layout_id, keys)
        if masks is not None:
            return tier_names(masks)
        return self._transport.run(self._lookup(layout_id, keys))

    def prefix_length(self, layout_id: int, keys: Sequence[bytes]) -> tuple[int, int]:
        """How many leading blocks of ``keys`` (a request's chained keys, in order) are held:
        ``(n_gpu_or_host, n_any)``. The first is the length of the leading run of keys each
        held in the gpu or host tier; the second the length of the leading run each held in
        any tier (gpu, host or disk), so ``n_gpu_or_host <= n_any``. A key held only on disk
        ends the first run but not the second."""
        masks = self._table_fast(layout_id, keys)
        if masks is not None:
            return prefix_lengths(masks)
        return self._transport.run(self._prefix_length(layout_id, keys))

    def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """Drop these keys from every tier; returns how many were held."""
        return self._transport.run(self._evict(layout_id, keys))

    def prefetch(self, layout_id: int, keys: Sequence[bytes], from_node: str | None = None) -> int:
        """These keys will be used, or were just used without a get (an engine recomputed blocks
        kvtier holds after a gap in its prefix): those in host become its most recent, those
        only on disk are warmed into host; with ``from_node`` (a peer daemon's node id) also
        fetch the keys held in no local tier from that peer. Returns blocks brought to host."""
        return self._transport.run(self._prefetch(layout_id, keys, from_node or ""))

    def retain(self, layout_id: int, keys: Sequence[bytes], ttl_s: float, priority: int = 0) -> RetainResult:
        """Keep the blocks of ``keys`` (a prefix's keys) in the host tier through eviction pressure
        for ``ttl_s`` seconds (more than 0, at most 86400): a retained block is evicted only
        when nothing unretained is left. Keys not held yet are kept once stored within the TTL;
        keys retained again are renewed (the later expiry, the higher ``priority``). Within this
        tenant's retention budget (kvtierd ``--retention-budget``): room is made by releasing
        its retentions of no higher priority, lowest priority and least recently retained
        first; else :class:`ResourceExhausted`, and nothing changes (so too where retention is
        off: ``--retention-budget 0``). docs/eviction.md, "Retained prefixes"."""
        return self._transport.run(self._retain(layout_id, keys, ttl_s, priority))

    def report_device_blocks(self, layout_id: int, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (),
                             worker_id: str | None = None, clear: bool = False) -> int:
        """Tell the daemon (and through its location feed, the routers) which blocks the engine
        itself now holds in GPU memory for this worker: ``stored`` arrived, ``removed`` left;
        ``clear`` first forgets everything reported under this layout. The report is bound to
        this sidecar's session: when the session ends the worker's device blocks are cleared.
        ``worker_id`` defaults to the client name. Returns the daemon's seq of the last event."""
        return self._transport.run(self._report_device_blocks(layout_id, stored, removed, worker_id, clear))

    def stats(self) -> dict:
        """The daemon's state: node, epoch, sessions, tiers, layouts, counters."""
        return self._transport.run(self._stats())

    def close(self) -> None:
        """End the session (the daemon reclaims what it held) and close the channel."""
        self._transport.run(self._close())
        self._transport.close()

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSidecar(_SidecarCore):
    """asyncio client of the local kvtierd: the calls of :class:`Sidecar`, awaited, with the same
    behaviour (the same operations run on an asyncio transport). Use it from one event loop.

    The end of its session stream (a killed daemon) is seen while that loop runs: a loop
    blocked across a daemon's death reads the dead table until it next runs (at most until
    the table's heartbeat goes stale)."""

    def __init__(self, socket_path: str | None = None, *, target: str | None = None,
                 client_name: str | None = None, timeout: float = 60.0, use_key_table: bool = True,
                 tls: ClientTls | None = None) -> None:
        self._transport: AsyncTransport = AsyncTransport(socket_path, target=target, client_name=client_name,
                                                         timeout=timeout, tls=tls)
        super().__init__(self._transport, use_key_table)

    async def register_layout(self, layout: Layout) -> int:
        """As :meth:`Sidecar.register_layout`."""
        return await self._register_layout(layout)

    async def put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any],
                  durable: bool = False) -> PutResult:
        """As :meth:`Sidecar.put`."""
        return await self._put(layout_id, keys, blocks, durable)

    async def get(self, layout_id: int, keys: Sequence[bytes],
                  out: Sequence[Any] | None = None, *, verify: bool = False) -> list[memoryview | None]:
        """As :meth:`Sidecar.get` (the release goes in the background there too)."""
        return await self._get(layout_id, keys, out, verify)

    async def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        """As :meth:`Sidecar.lookup`; a key table read never waits."""
        return await self._lookup(layout_id, keys)

    async def prefix_length(self, layout_id: int, keys: Sequence[bytes]) -> tuple[int, int]:
        """As :meth:`Sidecar.prefix_length`: ``(n_gpu_or_host, n_any)`` leading blocks held."""
        return await self._prefix_length(layout_id, keys)

    async def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """As :meth:`Sidecar.evict`."""
        return await self._evict(layout_id, keys)

    async def prefetch(self, layout_id: int, keys: Sequence[bytes], from_node: str | None = None) -> int:
        """As :meth:`Sidecar.prefetch`."""
        return await self._prefetch(layout_id, keys, from_node or "")

    async def retain(self, layout_id: int, keys: Sequence[bytes], ttl_s: float, priority: int = 0) -> RetainResult:
        """As :meth:`Sidecar.retain`."""
        return await self._retain(layout_id, keys, ttl_s, priority)

    async def report_device_blocks(self, layout_id: int, stored: Sequence[bytes] = (),
                                   removed: Sequence[bytes] = (), worker_id: str | None = None,
                                   clear: bool = False) -> int:
        """As :meth:`Sidecar.report_device_blocks`."""
        return await self._report_device_blocks(layout_id, stored, removed, worker_id, clear)

    async def stats(self) -> dict:
        """As :meth:`Sidecar.stats`."""
        return await self._stats()

    async def close(self) -> None:
        """As :meth:`Sidecar.close`."""
        await self._close()
        await self._transport.close()

    async def __aenter__(self) -> AsyncSidecar:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""The engine-side client of a node's kvtierd: :class:`Sidecar` (blocking) and :class:`AsyncSidecar`.

Bytes move through the host pool files the daemon names, which the sidecar maps read-write;
gRPC carries only slot grants, commits, leases and releases, one call per batch:

* ``put``: Allocate (slots for the keys not yet held) -> write each block into its slot ->
  Commit. A block is visible to lookups once ``put`` returns. Blocks that found no slot
  (every slot pinned or granted) are reported in :class:`PutResult`, not raised.
* ``get``: Acquire (pins the slots of the keys held; disk blocks are promoted first) -> copy
  each block out into the caller's buffer (or a new one) -> Release. The pin guarantees the
  slot is not reused while it is copied; the returned buffers are the caller's.

``lookup`` and ``prefix_length`` read the daemon's shared-memory key table
(:mod:`kvtier.tiers.keytable`, mapped read-only) without calling the daemon: a few
microseconds instead of a gRPC round trip. The Lookup RPC stays the fallback: for remote
clients (``target`` over TCP, where the table's path is not on this machine), when the table
is unavailable (daemon stopped, killed, or gave up on it) or when ``use_key_table=False``. A
key the table shows may be evicted before it is used: ``get`` then returns None for it.

Each sidecar holds one session (a gRPC stream) for as long as it is open. If the process
exits or is killed the stream ends and the daemon reclaims every grant and pin it held.
Layout ids handed out by ``register_layout`` are the sidecar's own: if the daemon restarts,
the sidecar re-registers the layout and opens a new session on the next call, once.

Errors: every failure is a :class:`KvtierError` carrying a gRPC status code and the daemon's
message; a malformed argument found before any call (wrong block size, keys and blocks of
different lengths) is :class:`InvalidArgument` (also a ``ValueError``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvtier.paths import default_socket_path
from kvtier.proto import TIER_NAMES, locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc
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
from kvtier.tiers.layout import Layout, layout_to_proto

TABLE_RETRY_S = 1.0  # after losing the key table, ask the daemon for a new one at most this often
REPORT_S = 1.0       # table lookups are reported to the daemon's counters at most this often, and on close
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class KvtierError(Exception):
    """A call the daemon (or the sidecar, before calling) refused; ``code`` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class InvalidArgument(KvtierError, ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class PutResult:
    stored: int = 0                                     # newly written and committed
    present: int = 0                                    # already held: nothing written
    dropped: list[bytes] = field(default_factory=list)  # found no slot (all pinned or granted)
    durable: int = 0                                    # stored or present, and on disk and indexed (durable puts)


def _target(socket_path: str | None, target: str | None) -> str:
    if target:
        return target
    return f"unix:{socket_path or os.environ.get('KVTIER_SOCKET') or default_socket_path()}"


def _error(e: grpc.RpcError) -> KvtierError:
    return KvtierError(e.code(), e.details() or "")


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


@dataclass
class _LayoutInfo:
    layout: Layout
    daemon_id: int = 0
    block_bytes: int = 0
    pool: PoolMapping | None = None
    table: KeyTableReader | None = None
    table_retry_at: float = 0.0
    # table lookups not yet reported, by the tier bit set found (index 0: misses)
    table_counts: np.ndarray = field(default_factory=lambda: np.zeros(8, dtype=np.int64))


class _SidecarCore:
    """What the blocking and asyncio sidecars share: layouts, pools, the key table and byte movement."""

    def __init__(self, client_name: str | None, use_key_table: bool = True) -> None:
        self.client_name = client_name or f"{os.path.basename(sys.argv[0] or 'python')}:{os.getpid()}"
        self.use_key_table = use_key_table
        self._layouts: dict[int, _LayoutInfo] = {}
        self._pools: dict[str, PoolMapping] = {}
        self._tables: dict[str, KeyTableReader] = {}
        self._had_table = False
        self._report_at = 0.0
        self.session_id = 0
        self.node_id = ""
        self.epoch = 0

    def _hello(self) -> node_pb2.SessionClientMessage:
        return node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=self.client_name,
                                                                         pid=os.getpid()))

    def _opened(self, msg: node_pb2.SessionServerMessage) -> None:
        self.session_id = msg.opened.session_id
        self.node_id = msg.opened.node_id
        self.epoch = msg.opened.epoch

    def _info(self, layout_id: int) -> _LayoutInfo:
        info = self._layouts.get(layout_id)
        if info is None:
            raise KvtierError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"layout_id {layout_id} was not registered through this sidecar")
        return info

    def _adopt(self, info: _LayoutInfo, reply: node_pb2.RegisterLayoutReply) -> None:
        if reply.fingerprint != info.layout.fingerprint:
            raise KvtierError(grpc.StatusCode.INTERNAL, "daemon computed another layout fingerprint; "
                                                        "client and daemon versions differ")
        pool = self._pools.get(reply.pool_path)
        if pool is None:
            pool = self._pools[reply.pool_path] = PoolMapping(reply.pool_path, reply.pool_bytes)
        info.daemon_id, info.block_bytes, info.pool = reply.layout_id, reply.block_bytes, pool
        # forget pools no layout uses any more (a restarted daemon's old, unlinked pool): the
        # mapping goes with its last user, so its memory is freed instead of kept by this process
        used = {id(i.pool) for i in self._layouts.values()} | {id(pool)}
        for path in [p for p, m in self._pools.items() if id(m) not in used]:
            del self._pools[path]
        info.table = self._open_table(reply.key_table_path) if self.use_key_table else None

    # -- key table -----------------------------------------------------------------------

    def _open_table(self, path: str) -> KeyTableReader | None:
        """The reader of the table at ``path``, or None where it cannot be mapped (a remote
        daemon, or one that publishes none)."""
        if not path or not ORDERING_SAFE:
            return None
        table = self._tables.get(path)
        if table is None:
            try:
                table = self._tables[path] = KeyTableReader(path)
            except (OSError, KeyTableError):
                return None
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
            self._drop_table(table)
            return None
        if len(masks) == 1:
            info.table_counts[masks[0]] += 1
        else:
            info.table_counts += np.bincount(masks, minlength=8)
        return masks

    def _report_due(self, force: bool = False) -> node_pb2.ReportLookupsRequest | None:
        """The table lookups to report to the daemon's counters, if it is time (every REPORT_S,
        or ``force``), as counts by the fastest tier found; None if nothing is due."""
        now = time.monotonic()
        if not force and now < self._report_at:
            return None
        self._report_at = now + REPORT_S
        req = node_pb2.ReportLookupsRequest()
        for info in self._layouts.values():
            c = info.table_counts
            if c.any():
                req.layouts.add(layout_id=info.daemon_id, hit_gpu=int(c[1::2].sum()), hit_host=int(c[2] + c[6]),
                                hit_disk=int(c[4]), miss=int(c[0]))
                c[:] = 0
        return req if req.layouts else None

    def _drop_table(self, table: KeyTableReader) -> None:
        # the retry time stays: a table lost long ago is asked for again at once, but one that
        # was just handed out again and is still unusable (invalid, stale) waits TABLE_RETRY_S
        self._tables.pop(table.path, None)
        for info in self._layouts.values():
            if info.table is table:
                info.table = None
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

    def _register_request(self, info: _LayoutInfo) -> node_pb2.RegisterLayoutRequest:
        return node_pb2.RegisterLayoutRequest(layout=layout_to_proto(info.layout, node_pb2.LayoutSpec))

    @staticmethod
    def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
        if all(type(k) is bytes for k in keys):  # the common case, on the lookup hot path
            return list(keys)
        out = []
        for i, k in enumerate(keys):
            if not isinstance(k, (bytes, bytearray, memoryview)):
                raise InvalidArgument(f"key {i} is {type(k).__name__}; keys are bytes")
            out.append(bytes(k))
        return out

    def _prepare_put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any]) -> tuple[_LayoutInfo, list[bytes], list[np.ndarray]]:
        info = self._info(layout_id)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks; give one block per key")
        arrs = [_as_bytes(b, info.block_bytes or info.layout.block_bytes, i) for i, b in enumerate(blocks)]
        return info, self._check_keys(keys), arrs

    @staticmethod
    def _write(info: _LayoutInfo, reply: node_pb2.AllocateReply, keys: list[bytes], arrs: list[np.ndarray],
               result: PutResult) -> list[int]:
        pool, n = info.pool, info.block_bytes
        assert pool is not None
        gids = []
        for key, arr, g in zip(keys, arrs, reply.grants, strict=True):
            if g.status == node_pb2.GRANTED:
                pool.prepare_write(g.offset, n)
                pool.arr[g.offset:g.offset + n] = arr
                gids.append(g.grant_id)
            elif g.status == node_pb2.PRESENT:
                result.present += 1
                result.durable += g.durable
            else:
                result.dropped.append(key)
        return gids

    @staticmethod
    def _read(info: _LayoutInfo, reply: node_pb2.AcquireReply, out: Sequence[Any] | None) -> tuple[list[memoryview | None], list[int]]:
        pool, n = info.pool, info.block_bytes
        assert pool is not None
        if out is not None and len(out) != len(reply.leases):
            raise InvalidArgument(f"{len(out)} output buffers for {len(reply.leases)} keys")
        result: list[memoryview | None] = []
        lids = []
        for i, lease in enumerate(reply.leases):
            if lease.lease_id == 0:
                result.append(None)
                continue
            lids.append(lease.lease_id)
            buf = bytearray(n) if out is None else out[i]
            dst = np.frombuffer(buf, dtype=np.uint8)
            if dst.size != n:
                raise InvalidArgument(f"output buffer {i} is {dst.size} bytes; blocks are {n} bytes")
            dst[:] = pool.arr[lease.offset:lease.offset + n]
            result.append(memoryview(buf))
        return result, lids

    def _close_pools(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        for table in self._tables.values():
            table.close()
        self._tables.clear()
        for info in self._layouts.values():
            info.table = None


def _tiers(reply: node_pb2.LookupReply) -> list[str | None]:
    return [TIER_NAMES.get(t) for t in reply.tiers]


def _tier_masks(tiers: list[str | None]) -> np.ndarray:
    return np.array([TIER_BITS[t] if t else 0 for t in tiers], dtype=np.uint8)


def _stats_dict(reply: node_pb2.StatsReply) -> dict:
    return {
        "node_id": reply.node_id, "epoch": reply.epoch, "uptime_s": reply.uptime_s, "version": reply.version,
        "sessions": reply.sessions,
        "tiers": {TIER_NAMES.get(t.tier, "none"): {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                                                   "blocks": t.blocks, "load_gbps": t.load_gbps} for t in reply.tiers},
        "layouts": [{"layout_id": lay.layout_id, "fingerprint": lay.fingerprint.hex(), "block_bytes": lay.block_bytes,
                     "host_blocks": lay.host_blocks, "disk_blocks": lay.disk_blocks} for lay in reply.layouts],
        "counters": dict(reply.counters),
    }


_RESTART_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)


class Sidecar(_SidecarCore):
    """Blocking client of the local kvtierd (see the module docstring)."""

    def __init__(self, socket_path: str | None = None, *, target: str | None = None,
                 client_name: str | None = None, timeout: float = 60.0, use_key_table: bool = True) -> None:
        super().__init__(client_name, use_key_table)
        self.target = _target(socket_path, target)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = node_pb2_grpc.NodeStub(self._channel)
        self._locations = locations_pb2_grpc.LocationsStub(self._channel)
        self._session_q: queue.Queue | None = None
        self._session_call: Any = None
        self._lock = threading.RLock()
        self._pending_release: Any = None
        self._pending_report: Any = None

    # -- session and layouts -------------------------------------------------------------

    def _ensure_session(self) -> int:
        if self._session_call is not None:
            return self.session_id
        with self._lock:
            if self._session_call is not None:
                return self.session_id
            return self._open_session()

    def _open_session(self) -> int:
        q: queue.Queue = queue.Queue()
        hello = self._hello()

        def requests() -> Any:
            yield hello
            while q.get() is not None:
                pass

        call = self._stub.Session(requests(), wait_for_ready=True, timeout=None)
        try:
            self._opened(next(call))
        except grpc.RpcError as e:
            q.put(None)
            raise _error(e) from None
        self._session_q, self._session_call = q, call
        return self.session_id

    def _drop_session(self) -> None:
        if self._session_q is not None:
            self._session_q.put(None)
        if self._session_call is not None:
            self._session_call.cancel()
        self._session_q = self._session_call = None
        self.session_id = 0

    def register_layout(self, layout: Layout) -> int:
        """Register ``layout`` with the daemon; returns this sidecar's id for it."""
        for lid, info in self._layouts.items():
            if info.layout.fingerprint == layout.fingerprint:
                return lid
        info = _LayoutInfo(layout)
        self._register(info)
        lid = len(self._layouts) + 1
        self._layouts[lid] = info
        return lid

    def _register(self, info: _LayoutInfo) -> None:
        try:
            reply = self._stub.RegisterLayout(self._register_request(info), timeout=self.timeout,
                                              wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(e) from None
        self._adopt(info, reply)

    def _masks(self, info: _LayoutInfo, keys: list[bytes]) -> np.ndarray | None:
        """Tier bit sets from the key table (asking the daemon for a new table once it was
        lost, at most every TABLE_RETRY_S); None: use the Lookup RPC. Table lookups are
        reported to the daemon's counters in the background, at most every REPORT_S."""
        masks = self._table_masks(info, keys)
        if masks is not None:
            req = self._report_due()
            if req is not None:  # without waiting: the answer is for the daemon's counters only
                self._pending_report = self._stub.ReportLookups.future(req, timeout=self.timeout)
            return masks
        if masks is None and self._want_table(info):
            try:  # every layout, in registration order, as a restart recovery does
                for each in self._layouts.values():
                    self._adopt(each, self._stub.RegisterLayout(self._register_request(each), timeout=self.timeout))
            except grpc.RpcError:
                return None
            masks = self._table_masks(info, keys)
        return masks

    def _call(self, fn: Any) -> Any:
        """Run ``fn()`` (one RPC); after a daemon restart re-register and re-open once, then retry
        (a FAILED_PRECONDITION from the daemon the session lives on re-registers and retries
        once, keeping the session)."""
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() not in _RESTART_CODES:
                raise _error(e) from None
            first = e
        restarted = self._restarted(first)
        with self._lock:
            if restarted:
                self._drop_session()
            try:
                for info in self._layouts.values():
                    self._register(info)
            except KvtierError:
                raise _error(first) from None
        try:
            return fn()
        except grpc.RpcError as e:
            raise _error(e) from None

    def _restarted(self, e: grpc.RpcError) -> bool:
        """Whether an UNAVAILABLE or FAILED_PRECONDITION answer means the daemon our session
        lives on is gone (a new epoch). If not, the session is kept: dropping it would take the
        grants and pins of this sidecar's other threads with it, mid-put and mid-copy; the
        layouts are still registered again (harmless: the daemon may lack them if it restarted
        while this sidecar had no session)."""
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not self.epoch:
            return True
        try:
            return self._stub.Stats(node_pb2.StatsRequest(), timeout=self.timeout).epoch != self.epoch
        except grpc.RpcError:
            return True

    # -- block operations ----------------------------------------------------------------

    def put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any], durable: bool = False) -> PutResult:
        """Store ``blocks`` under ``keys`` (one RPC to allocate, one to commit)."""
        info, keys, arrs = self._prepare_put(layout_id, keys, blocks)
        result = PutResult()
        if not keys:
            return result

        def run() -> None:
            self._settle_release()
            sid = self._ensure_session()
            reply = self._stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=info.daemon_id,
                                                                 keys=keys, durable=durable), timeout=self.timeout)
            try:
                gids = self._write(info, reply, keys, arrs, result)
            except BaseException:
                aborts = [g.grant_id for g in reply.grants if g.status == node_pb2.GRANTED]
                self._stub.Commit(node_pb2.CommitRequest(session_id=sid, abort_grant_ids=aborts),
                                  timeout=self.timeout)
                raise
            if gids:
                reply = self._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=gids, durable=durable),
                                          timeout=self.timeout)
                result.durable += reply.durable
            result.stored = len(gids)

        self._call(run)
        return result

    def get(self, layout_id: int, keys: Sequence[bytes], out: Sequence[Any] | None = None) -> list[memoryview | None]:
        """Copy the blocks held under ``keys`` out (into ``out`` buffers if given); None per miss."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)

        def run() -> list[memoryview | None]:
            self._settle_release()
            sid = self._ensure_session()
            reply = self._stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=info.daemon_id,
                                                               keys=keys), timeout=self.timeout)
            try:
                result, lids = self._read(info, reply, out)
            finally:
                held = [lease.lease_id for lease in reply.leases if lease.lease_id]
                if held:
                    self._release_async(node_pb2.ReleaseRequest(session_id=sid, lease_ids=held))
            return result

        return self._call(run)

    def _release_async(self, req: node_pb2.ReleaseRequest) -> None:
        """Send a release without waiting for its reply: the bytes are already copied out, so
        the caller goes on at once. The next put or get waits for it (usually long done), so
        this client's own pins never outlive its next request."""
        self._settle_release()
        self._pending_release = self._stub.Release.future(req, timeout=self.timeout)

    def _settle_release(self) -> None:
        fut, self._pending_release = self._pending_release, None
        if fut is None:
            return
        try:
            fut.result()
        except grpc.RpcError as e:
            # a lost session took its pins with it; CANCELLED: the daemon stopped (its shutdown
            # cancels calls in flight) and its sessions with it
            if e.code() not in (*_RESTART_CODES, grpc.StatusCode.CANCELLED):
                raise _error(e) from None

    def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier holding each key ("gpu", "host", "disk"), or None.

        Read from the key table when it is mapped, else asked with the Lookup RPC."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        masks = self._masks(info, keys)
        if masks is not None:
            return tier_names(masks)
        return self._call(lambda: _tiers(self._stub.Lookup(
            node_pb2.LookupRequest(layout_id=info.daemon_id, keys=keys), timeout=self.timeout)))

    def prefix_length(self, layout_id: int, keys: Sequence[bytes]) -> tuple[int, int]:
        """How many leading blocks of ``keys`` (a request's chained keys, in order) are held:
        ``(n_gpu_or_host, n_any)``. The first is the length of the leading run of keys each
        held in the gpu or host tier; the second the length of the leading run each held in
        any tier (gpu, host or disk), so ``n_gpu_or_host <= n_any``. A key held only on disk
        ends the first run but not the second."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        masks = self._masks(info, keys)
        if masks is None:
            masks = _tier_masks(self._call(lambda: _tiers(self._stub.Lookup(
                node_pb2.LookupRequest(layout_id=info.daemon_id, keys=keys), timeout=self.timeout))))
        return prefix_lengths(masks)

    def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        return self._call(lambda: self._stub.Evict(
            node_pb2.EvictRequest(layout_id=info.daemon_id, keys=keys), timeout=self.timeout).evicted)

    def prefetch(self, layout_id: int, keys: Sequence[bytes]) -> int:
        """Warm the host tier from disk for these keys; returns blocks promoted."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        return self._call(lambda: self._stub.Prefetch(
            node_pb2.PrefetchRequest(layout_id=info.daemon_id, keys=keys), timeout=self.timeout).promoted)

    def report_device_blocks(self, layout_id: int, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (),
                             worker_id: str | None = None, clear: bool = False) -> int:
        """Tell the daemon (and through its location feed, the routers) which blocks the engine
        itself now holds in GPU memory for this worker: ``stored`` arrived, ``removed`` left;
        ``clear`` first forgets everything reported under this layout. The report is bound to
        this sidecar's session: when the session ends the worker's device blocks are cleared.
        ``worker_id`` defaults to the client name. Returns the daemon's seq of the last event."""
        info = self._info(layout_id)
        stored, removed = self._check_keys(stored), self._check_keys(removed)

        def run() -> int:
            req = locations_pb2.ReportDeviceBlocksRequest(
                worker_id=worker_id or self.client_name, layout_id=info.daemon_id, stored=stored,
                removed=removed, clear=clear, session_id=self._ensure_session())
            return self._locations.ReportDeviceBlocks(req, timeout=self.timeout).seq

        return self._call(run)

    def stats(self) -> dict:
        try:
            return _stats_dict(self._stub.Stats(node_pb2.StatsRequest(), timeout=self.timeout, wait_for_ready=True))
        except grpc.RpcError as e:
            raise _error(e) from None

    def close(self) -> None:
        req = self._report_due(force=True)
        if req is not None:
            try:
                self._stub.ReportLookups(req, timeout=min(self.timeout, 5.0))
            except grpc.RpcError:
                pass  # counts only: a daemon that is gone does not need them
        try:
            self._settle_release()
        except KvtierError:
            pass  # the session ends below, and its pins with it
        self._drop_session()
        self._close_pools()
        self._channel.close()

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSidecar(_SidecarCore):
    """asyncio client of the local kvtierd; the same calls as :class:`Sidecar`, awaited."""

    def __init__(self, socket_path: str | None = None, *, target: str | None = None,
                 client_name: str | None = None, timeout: float = 60.0, use_key_table: bool = True) -> None:
        super().__init__(client_name, use_key_table)
        self.target = _target(socket_path, target)
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = node_pb2_grpc.NodeStub(self._channel)
        self._locations = locations_pb2_grpc.LocationsStub(self._channel)
        self._session_call: Any = None
        self._reports: set[asyncio.Task] = set()
        self._session_lock: asyncio.Lock | None = None
        self._generation = 0  # bumped by each restart recovery

    def _lock(self) -> asyncio.Lock:
        if self._session_lock is None:  # made on first use, inside the caller's loop
            self._session_lock = asyncio.Lock()
        return self._session_lock

    async def _ensure_session(self) -> int:
        if self._session_call is not None:
            return self.session_id
        async with self._lock():  # concurrent first calls share one session
            if self._session_call is not None:
                return self.session_id
            call = self._stub.Session(wait_for_ready=True)
            try:
                await call.write(self._hello())
                self._opened(await call.read())
            except grpc.RpcError as e:
                call.cancel()
                raise _error(e) from None
            self._session_call = call
            return self.session_id

    def _drop_session(self) -> None:
        if self._session_call is not None:
            self._session_call.cancel()
        self._session_call = None
        self.session_id = 0

    async def _restarted(self, e: grpc.RpcError) -> bool:
        """As :meth:`Sidecar._restarted`."""
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not self.epoch:
            return True
        try:
            return (await self._stub.Stats(node_pb2.StatsRequest(), timeout=self.timeout)).epoch != self.epoch
        except grpc.RpcError:
            return True

    async def _call(self, fn: Any) -> Any:
        """Await ``fn()`` (the RPCs of one operation); after a daemon restart re-register and
        re-open once, then retry, as :meth:`Sidecar._call` does."""
        generation = self._generation
        try:
            return await fn()
        except grpc.RpcError as e:
            if e.code() not in _RESTART_CODES:
                raise _error(e) from None
            first = e
        restarted = await self._restarted(first)
        async with self._lock():
            if generation == self._generation:  # not recovered yet by a concurrent call
                if restarted:
                    self._drop_session()
                try:
                    for info in self._layouts.values():
                        self._adopt(info, await self._stub.RegisterLayout(
                            self._register_request(info), timeout=self.timeout, wait_for_ready=True))
                except grpc.RpcError:
                    raise _error(first) from None
                self._generation += 1
        try:
            return await fn()
        except grpc.RpcError as e:
            raise _error(e) from None

    async def register_layout(self, layout: Layout) -> int:
        for lid, info in self._layouts.items():
            if info.layout.fingerprint == layout.fingerprint:
                return lid
        info = _LayoutInfo(layout)
        try:
            reply = await self._stub.RegisterLayout(self._register_request(info), timeout=self.timeout,
                                                    wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(e) from None
        self._adopt(info, reply)
        lid = len(self._layouts) + 1
        self._layouts[lid] = info
        return lid

    async def put(self, layout_id: int, keys: Sequence[bytes], blocks: Sequence[Any], durable: bool = False) -> PutResult:
        info, keys, arrs = self._prepare_put(layout_id, keys, blocks)
        if not keys:
            return PutResult()

        async def run() -> PutResult:
            result = PutResult()
            sid = await self._ensure_session()
            reply = await self._stub.Allocate(node_pb2.AllocateRequest(
                session_id=sid, layout_id=info.daemon_id, keys=keys, durable=durable), timeout=self.timeout)
            try:
                gids = self._write(info, reply, keys, arrs, result)
            except BaseException:
                aborts = [g.grant_id for g in reply.grants if g.status == node_pb2.GRANTED]
                await self._stub.Commit(node_pb2.CommitRequest(session_id=sid, abort_grant_ids=aborts),
                                        timeout=self.timeout)
                raise
            if gids:
                committed = await self._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=gids,
                                                                           durable=durable), timeout=self.timeout)
                result.durable += committed.durable
            result.stored = len(gids)
            return result

        return await self._call(run)

    async def get(self, layout_id: int, keys: Sequence[bytes], out: Sequence[Any] | None = None) -> list[memoryview | None]:
        info = self._info(layout_id)
        keys = self._check_keys(keys)

        async def run() -> list[memoryview | None]:
            sid = await self._ensure_session()
            reply = await self._stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=info.daemon_id,
                                                                     keys=keys), timeout=self.timeout)
            try:
                result, _ = self._read(info, reply, out)
            finally:
                held = [lease.lease_id for lease in reply.leases if lease.lease_id]
                if held:
                    await self._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=held),
                                             timeout=self.timeout)
            return result

        return await self._call(run)

    async def _masks(self, info: _LayoutInfo, keys: list[bytes]) -> np.ndarray | None:
        """As :meth:`Sidecar._masks`; the table read itself never waits."""
        masks = self._table_masks(info, keys)
        if masks is not None:
            req = self._report_due()
            if req is not None:  # in the background: the answer is for the daemon's counters only
                task = asyncio.get_running_loop().create_task(self._report(req))
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)
            return masks
        if self._want_table(info):
            try:
                for each in self._layouts.values():
                    self._adopt(each, await self._stub.RegisterLayout(self._register_request(each),
                                                                      timeout=self.timeout))
            except grpc.RpcError:
                return None
            masks = self._table_masks(info, keys)
        return masks

    async def _rpc_tiers(self, info: _LayoutInfo, keys: list[bytes]) -> list[str | None]:
        async def run() -> list[str | None]:
            return _tiers(await self._stub.Lookup(node_pb2.LookupRequest(layout_id=info.daemon_id, keys=keys),
                                                  timeout=self.timeout))
        return await self._call(run)

    async def lookup(self, layout_id: int, keys: Sequence[bytes]) -> list[str | None]:
        """As :meth:`Sidecar.lookup`."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        masks = await self._masks(info, keys)
        if masks is not None:
            return tier_names(masks)
        return await self._rpc_tiers(info, keys)

    async def prefix_length(self, layout_id: int, keys: Sequence[bytes]) -> tuple[int, int]:
        """As :meth:`Sidecar.prefix_length`: ``(n_gpu_or_host, n_any)`` leading blocks held."""
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        masks = await self._masks(info, keys)
        if masks is None:
            masks = _tier_masks(await self._rpc_tiers(info, keys))
        return prefix_lengths(masks)

    async def evict(self, layout_id: int, keys: Sequence[bytes]) -> int:
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        async def run() -> int:
            return (await self._stub.Evict(node_pb2.EvictRequest(layout_id=info.daemon_id, keys=keys),
                                           timeout=self.timeout)).evicted
        return await self._call(run)

    async def prefetch(self, layout_id: int, keys: Sequence[bytes]) -> int:
        info = self._info(layout_id)
        keys = self._check_keys(keys)
        async def run() -> int:
            return (await self._stub.Prefetch(node_pb2.PrefetchRequest(layout_id=info.daemon_id, keys=keys),
                                              timeout=self.timeout)).promoted
        return await self._call(run)

    async def report_device_blocks(self, layout_id: int, stored: Sequence[bytes] = (),
                                   removed: Sequence[bytes] = (), worker_id: str | None = None,
                                   clear: bool = False) -> int:
        """As :meth:`Sidecar.report_device_blocks`."""
        info = self._info(layout_id)
        stored, removed = self._check_keys(stored), self._check_keys(removed)

        async def run() -> int:
            req = locations_pb2.ReportDeviceBlocksRequest(
                worker_id=worker_id or self.client_name, layout_id=info.daemon_id, stored=stored,
                removed=removed, clear=clear, session_id=await self._ensure_session())
            return (await self._locations.ReportDeviceBlocks(req, timeout=self.timeout)).seq
        return await self._call(run)

    async def stats(self) -> dict:
        try:
            return _stats_dict(await self._stub.Stats(node_pb2.StatsRequest(), timeout=self.timeout,
                                                      wait_for_ready=True))
        except grpc.RpcError as e:
            raise _error(e) from None

    async def _report(self, req: node_pb2.ReportLookupsRequest) -> None:
        try:
            await self._stub.ReportLookups(req, timeout=min(self.timeout, 5.0))
        except grpc.RpcError:
            pass  # counts only: a daemon that is gone does not need them

    async def close(self) -> None:
        req = self._report_due(force=True)
        if req is not None:
            await self._report(req)
        if self._session_call is not None:
            self._session_call.cancel()
            self._session_call = None
        self._close_pools()
        await self._channel.close()

    async def __aenter__(self) -> AsyncSidecar:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""The shared store: host blocks written behind to a Redis Cluster and read through on a miss.

One part of the ``remote`` tier (the other is peer daemons): daemons that never met
share blocks through a store they all reach. :class:`RemoteStore` is a
:class:`~kvtier.daemon.remote.RemoteSource` (read-through on a get's miss, prefetch) and the
placement's write-behind hook (:class:`~kvtier.daemon.placement.WriteBehind`); the bytes go
through a :class:`Backend` (:class:`RedisBackend`: redis-py's cluster client).

Keys and values
    A block lives under ``kvtier:<namespace>:<tenant fingerprint hex>:<key hex>``. The tenant
    fingerprint is the one the tiers store the block under (a keyed hash of tenant and
    layout), so two tenants' blocks never share a key: a tenant's get builds only its own
    tenant's names. No hash tag: each block hashes to its own slot, so a batch spreads over
    every master and the cluster pipeline sends one batch per master. The value is a 32-byte
    header (``KVTB``, version 1, payload length, xxh3-64 of the payload, xxh3-64 of the packed
    block id) and the payload. A value whose header, length, block id or checksum does not
    match is a miss (``store_corrupt``), never served; what is served is verified again as
    it enters host (:meth:`Placement.ingest`). Every write sets a TTL (``--store-ttl-s``).

Write-behind (``--store-write``)
    ``put``: each commit queues its blocks (no copy in the commit); the writer task pins each
    one still in host, copies it into a value buffer and hashes the copy on a store thread
    (a block whose bytes no longer match its commit checksum is skipped), then writes a batch
    with one cluster pipeline. ``demotion``: host victims are copied (on a store thread)
    before their slots are reused, then queued. Both: the queue is bounded in bytes
    (``--store-queue-bytes``); a block that does not fit is dropped and counted
    (``store_writes_dropped``), so a put or an eviction never waits on the store.

The location feed
    Blocks this daemon wrote are published as tier ``remote`` once the write succeeded, and
    removed when their TTL lapses as far as this daemon knows (``store_expired``); another
    daemon's write, an eviction inside Redis or a dead store node are not seen (a fetch
    then misses). At most ``MAX_PUBLISHED`` blocks are published; past it the oldest leave
    the feed first.

Failures
    Every store call runs on the store's threads with socket timeouts (``--store-timeout-s``),
    and a get waits at most that long for the store: the event loop never blocks. A node that
    is down, refuses or times out makes its keys misses (``store_read_errors``) or unwritten
    (``store_write_errors``); after a call where every key failed the store is skipped for
    ``BACKOFF_S``. Nothing a store does raises into a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from kvtier.daemon.config import STORE_NAMESPACE, STORE_QUEUE_BYTES, STORE_TIMEOUT_S, STORE_TTL_S
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.observers import Observers
from kvtier.daemon.remote import Fetched, StreamedSource
from kvtier.rediscluster import parse_nodes, redis_kwargs
from kvtier.tiers.host import HostEntry
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier, fingerprint_of, key_of

log = logging.getLogger("kvtier.store")

MAGIC = b"KVTB"
VERSION = 1
HEADER = struct.Struct("<4sB3xQQQ")  # magic, version, payload length, xxh3 payload, xxh3 block id
HEADER_BYTES = HEADER.size  # 32
BATCH_BYTES = 32 * 1024**2  # most payload bytes in one pipeline
THREADS = 4
STREAM_BYTES = 16 * 1024**2  # a get's payload bytes per batch read while the last one enters host
COPY_THREADS = 2  # a large write-behind batch is copied into values in this many parts
BACKOFF_S = 1.0
MAX_PUBLISHED = 1 << 20  # blocks this daemon's feed shows in remote at most
REMOTE = Tier.REMOTE


def redis_key(namespace: str, bkey: bytes) -> str:
    """The store's name of a packed block id (tenant fingerprint + key)."""
    return f"kvtier:{namespace}:{fingerprint_of(bkey).hex()}:{key_of(bkey).hex()}"


def encode_into(buf: bytearray | memoryview, bkey: bytes, payload_len: int, checksum: int) -> None:
    """Write the header of a value whose payload (already at ``buf[HEADER_BYTES:]``) is this."""
    HEADER.pack_into(buf, 0, MAGIC, VERSION, payload_len, checksum, xxhash.xxh3_64_intdigest(bkey))


def encode(bkey: bytes, payload: bytes | memoryview, checksum: int) -> bytearray:
    """One value: header and payload."""
    buf = bytearray(HEADER_BYTES + len(payload))
    buf[HEADER_BYTES:] = payload
    encode_into(buf, bkey, len(payload), checksum)
    return buf


def decode(bkey: bytes, value: bytes | memoryview, block_bytes: int) -> tuple[memoryview, int] | None:
    """The payload and its checksum, if ``value`` is a sound value of ``bkey`` with a payload of
    ``block_bytes``; None otherwise (a wrong header, length, block id or checksum)."""
    if len(value) != HEADER_BYTES + block_bytes:
        return None
    magic, version, length, checksum, idsum = HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION or length != block_bytes or idsum != xxhash.xxh3_64_intdigest(bkey):
        return None
    payload = memoryview(value)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload, checksum


class Backend(Protocol):
    """Where the store's bytes go: blocking calls, made on the store's threads only."""

    name: str

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], ttl_s: float) -> list[bool]:
        """Write each (name, value) with this TTL; whether each write succeeded."""
        ...

    def get_many(self, names: Sequence[str], value_bytes: int = 0) -> list[bytes | memoryview | None | Exception]:
        """Each name's value, None where absent, the error where its node failed;
        ``value_bytes``: the size each value should have (0: unknown)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """How the daemon reaches Redis: TLS when ``ca`` is set (the server's certificate checked
    against it, ``cert``/``key`` the client's for mutual TLS), ACL ``user`` and ``password``."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    def redis_kwargs(self) -> dict:
        return redis_kwargs(self.ca, self.cert, self.key, self.user, self.password)


def _tls_files(cfg) -> tuple[str, str, str]:  # noqa: ANN001
    """(ca, cert, key) of the store: its own files, else the daemon's --tls-* (like the peers)."""
    if cfg.store_plaintext:
        return "", "", ""
    return (cfg.store_tls_ca or cfg.tls_ca, cfg.store_tls_cert or cfg.tls_cert, cfg.store_tls_key or cfg.tls_key)


def check_settings(cfg) -> None:  # noqa: ANN001
    """The --store-* transport and backend settings (raises ConfigError, naming the flag)."""
    from kvtier.daemon.config import ConfigError

    if cfg.store_backend not in ("redis", "mooncake"):
        raise ConfigError(f"--store-backend: {cfg.store_backend!r} is not redis or mooncake")
    if cfg.store_plaintext and (cfg.store_tls_ca or cfg.store_tls_cert or cfg.store_tls_key):
        raise ConfigError("--store-plaintext and --store-tls-* contradict each other: pick one")
    if bool(cfg.store_tls_cert) != bool(cfg.store_tls_key):
        raise ConfigError("--store-tls-cert and --store-tls-key go together")
    if cfg.store_backend == "mooncake":
        _check_mooncake(cfg, ConfigError)
        return
    ca, cert, _ = _tls_files(cfg)
    if cfg.store_redis and not ca and not cfg.store_plaintext:
        raise ConfigError("--store-redis needs TLS to the store: --store-tls-ca (the CA of the Redis nodes' "
                          "certificates; or --tls-ca), with --store-tls-cert and --store-tls-key for Redis's "
                          "tls-auth-clients (or --tls-cert, --tls-key); only with --store-plaintext is "
                          "the store reached in plaintext")
    if cert and not ca:
        raise ConfigError("--store-tls-cert needs --store-tls-ca (the CA that signs the Redis nodes' certificates)")
    if cfg.store_user and not cfg.store_password_file:
        raise ConfigError("--store-user needs --store-password-file")


def _check_mooncake(cfg, ConfigError) -> None:  # noqa: ANN001, N803
    if cfg.store_redis or cfg.store_user or cfg.store_password_file:
        raise ConfigError("--store-redis, --store-user and --store-password-file are for --store-backend redis")
    if not cfg.store_mooncake_master or not cfg.store_mooncake_metadata:
        raise ConfigError("--store-backend mooncake needs --store-mooncake-master HOST:PORT and "
                          "--store-mooncake-metadata (http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE)")
    host, _, port = cfg.store_mooncake_master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--store-mooncake-master: {cfg.store_mooncake_master!r} is not HOST:PORT")
    if cfg.store_mooncake_protocol not in ("tcp", "rdma"):
        raise ConfigError(f"--store-mooncake-protocol: {cfg.store_mooncake_protocol!r} is not tcp or rdma")
    if not cfg.store_plaintext:
        raise ConfigError("--store-backend mooncake: the Mooncake transfer engine has no TLS or client "
                          "authentication; run it on a trusted network and pass --store-plaintext")
    if cfg.store_mooncake_segment_bytes <= 0 or cfg.store_mooncake_buffer_bytes < 4 * 1024**2:
        raise ConfigError("--store-mooncake-segment-bytes must be positive and --store-mooncake-buffer-bytes at "
                          "least 4MiB")


def read_password(path: str) -> str:
    """The password in ``path`` (first line); a file group or others may read is refused."""
    from kvtier.daemon.server import StartupError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise StartupError(f"cannot open --store-password-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077:
            raise StartupError(f"--store-password-file {path} is mode {stat.S_IMODE(st.st_mode):04o}: group or "
                               f"others may read it; make it a regular file of mode 0600 (chmod 600)")
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    password = data.decode("utf-8", "replace").splitlines()[0].strip() if data.strip() else ""
    if not password:
        raise StartupError(f"--store-password-file {path} is empty")
    return password


class RedisBackend:
    """A Redis Cluster through redis-py's (blocking) cluster client, made on first use so a
    daemon starts while the store is down; thread-safe.

    A batch is split by the master serving each name's slot (the client's slot map); each
    master's commands are written on one of its connections, all masters' before any reply is
    read (the masters work in parallel, without threads contending for the GIL), then the
    replies are read master by master: a master that is down or slow fails its own names only. A connection error, a redirect (``MOVED``: the slots moved) or
    an uncovered slot makes the next call learn the topology again (at most once a second)."""

    name = "redis"

    def __init__(self, nodes: Sequence[tuple[str, int]], timeout_s: float, transport: Transport | None = None) -> None:
        self.nodes = list(nodes)
        self.timeout_s = timeout_s
        self.transport = transport or Transport()
        self._client = None
        self._lock = threading.Lock()
        self._stale = False
        self._refreshed = 0.0

    def client(self):  # noqa: ANN201 (redis.cluster.RedisCluster)
        with self._lock:
            if self._client is not None and self._stale and time.monotonic() - self._refreshed > 1.0:
                self._refreshed = time.monotonic()
                self._stale = False
                try:
                    self._client.nodes_manager.initialize()
                except Exception:  # every startup node down: keep the old map, try again later
                    self._stale = True
            if self._client is None:
                from redis.backoff import NoBackoff
                from redis.cluster import ClusterNode, RedisCluster
                from redis.retry import Retry

                self._refreshed = time.monotonic()
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], require_full_coverage=False,
                    socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0), **self.transport.redis_kwargs())
            return self._client

    def _run(self, names: Sequence[str], fill) -> list:  # noqa: ANN001
        """``fill(cmds, i)`` adds the command of ``names[i]``; each name's reply or error."""
        out: list = [None] * len(names)
        try:
            client = self.client()
            groups: dict[str, tuple[object, list[int]]] = {}
            for i, name in enumerate(names):
                node = client.get_node_from_key(name)
                groups.setdefault(node.name, (node, []))[1].append(i)
        except Exception as e:  # no cluster reachable, a slot not covered
            self._stale = True
            return [e] * len(names)

        jobs = list(groups.values())
        results = _interleaved(jobs, names, fill)
        for (_, idxs), replies in zip(jobs, results, strict=True):
            for i, r in zip(idxs, replies, strict=True):
                if isinstance(r, Exception):
                    self._stale = True
                out[i] = r
        return out

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], ttl_s: float) -> list[bool]:
        ms = max(1, int(ttl_s * 1000))
        replies = self._run([n for n, _ in items], lambda cmds, i: cmds.set(items[i][0], memoryview(items[i][1]), px=ms))
        return [r is True or r == b"OK" for r in replies]

    def get_many(self, names: Sequence[str], value_bytes: int = 0) -> list[bytes | memoryview | None | Exception]:
        return [r if r is None or isinstance(r, bytes | Exception) else TypeError(type(r).__name__)
                for r in self._run(names, lambda cmds, i: cmds.get(names[i]))]

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


class _Cmds:
    """Collects a pipeline's commands (``fill`` calls ``set``/``get`` on it)."""

    def __init__(self) -> None:
        self.args: list[tuple] = []

    def set(self, name, value, px: int):  # noqa: ANN001, ANN201
        self.args.append(("SET", name, value, "PX", px))

    def get(self, name):  # noqa: ANN001, ANN201
        self.args.append(("GET", name))


_CUTOFF = 6000
_packer = None


def _pack_commands(commands: Sequence[tuple]) -> list:
    """redis-py's pack_commands with its Python serializer, whether or not hiredis is there:
    a large value goes out as its own buffer, never copied (hiredis's packer copies each value
    into one string: a SET of 2 MiB values ran at a third of the speed), small pieces joined."""
    global _packer  # noqa: PLW0603
    if _packer is None:
        from redis.connection import Encoder, PythonRespSerializer

        _packer = PythonRespSerializer(_CUTOFF, Encoder("utf-8", "strict", False).encode)
    output: list = []
    pieces: list = []
    size = 0
    for cmd in commands:
        for chunk in _packer.pack(*cmd):
            n = len(chunk)
            big = n > _CUTOFF or isinstance(chunk, memoryview)
            if size > _CUTOFF or big:
                if pieces:
                    output.append(b"".join(pieces))
                size, pieces = 0, []
            if big:
                output.append(chunk)
            else:
                pieces.append(chunk)
                size += n
    if pieces:
        output.append(b"".join(pieces))
    return output


def _interleaved(jobs, names, fill) -> list[list]:  # noqa: ANN001
    """Each master's commands sent on one connection of it, all masters' before any reply is
    read (they work in parallel without threads), then the replies read master by master."""
    sent = []
    for node, idxs in jobs:
        cmds = _Cmds()
        for i in idxs:
            fill(cmds, i)
        pool = node.redis_connection.connection_pool
        conn, err = None, None
        try:
            conn = pool.get_connection()
            conn.send_packed_command(_pack_commands(cmds.args))
        except Exception as e:
            err = e
        sent.append((pool, conn, cmds, err))
    out = []
    for pool, conn, cmds, err in sent:
        replies: list = []
        try:
            if err is None:
                for _ in cmds.args:
                    try:
                        replies.append(conn.read_response())
                    except Exception as e:  # noqa: PERF203
                        from redis.exceptions import ResponseError

                        if not isinstance(e, ResponseError):
                            raise
                        replies.append(e)
        except Exception as e:  # the master is down, refused or timed out
            err = e
            if conn is not None:
                conn.disconnect()
        finally:
            if conn is not None:
                pool.release(conn)
        out.append(replies if err is None else [err] * len(cmds.args))
    return out


@dataclass
class _Job:
    """One block waiting to be written: a host entry to copy (put) or a copied value (demotion)."""

    bkey: bytes
    nbytes: int
    entry: HostEntry | None = None
    value: bytearray | None = None


@dataclass
class _ReadTally:
    found: list[Fetched] = field(default_factory=list)
    misses: int = 0
    corrupt: int = 0
    errors: int = 0


class RemoteStore(StreamedSource):
    """See the module docstring. ``placement`` is the node's
    :class:`~kvtier.daemon.placement.Placement` (host slots, the hooks); call :meth:`start` on
    the event loop and :meth:`close` at the end."""

    name = "store"
    verified = True  # each payload is hashed against its value's header on arrival (decode)

    def __init__(self, backend: Backend, placement, counters: Counters, observers: Observers,  # noqa: ANN001
                 namespace: str = STORE_NAMESPACE, ttl_s: float = STORE_TTL_S, write: str = "put",
                 read_through: bool = True, timeout_s: float = STORE_TIMEOUT_S,
                 queue_bytes: int = STORE_QUEUE_BYTES) -> None:
        self.backend = backend
        self.placement = placement
        self.counters = counters
        self.observers = observers
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.write = write
        self.read_through = read_through
        self.timeout_s = timeout_s
        self.queue_bytes = queue_bytes
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvtier-store")
        self.published: OrderedDict[bytes, float] = OrderedDict()  # written by us: bkey -> expiry (monotonic)
        self._fetched: OrderedDict[bytes, None] = OrderedDict()  # in host from a peer or the store (see fetched)
        self._queue: deque[_Job] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._skip_until = 0.0
        self._tasks: list[asyncio.Task] = []
        if write != "off":
            placement.write_behind = self

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._writer()), asyncio.ensure_future(self._sweeper())]

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until the write-behind queue is empty and its last batch written (tests, benches)."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if getattr(self.placement, "write_behind", None) is self:
            self.placement.write_behind = None
        await asyncio.get_running_loop().run_in_executor(self.pool, self.backend.close)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- what the placement tells us (write-behind) -----------------------------------------

    @property
    def held(self) -> Iterable[bytes]:
        """The blocks this daemon wrote whose TTL has not lapsed (its feed's remote tier)."""
        return self.published.keys()

    def committed(self, entries: Sequence[HostEntry]) -> None:
        """Blocks committed to host by a client: queued for writing (``--store-write put``)."""
        if self._fetched:
            for e in entries:
                self._fetched.pop(e.bkey, None)
        if self.write == "put":
            self._enqueue([_Job(e.bkey, e.block_bytes, entry=e) for e in entries])

    def fetched(self, entries: Sequence[HostEntry]) -> None:
        """Blocks that came into host from a peer or the store: never written back when host
        evicts them (``--store-write demotion``; the design's rule: the store holds what its
        writers put, and a read-through block cycling through host must not renew its TTL nor
        be published as this node's write)."""
        if self.write != "demotion":
            return
        fetched = self._fetched
        for e in entries:
            fetched[e.bkey] = None
            fetched.move_to_end(e.bkey)
        while len(fetched) > MAX_PUBLISHED:  # (keys evicted by an Evict never come back here)
            fetched.popitem(last=False)

    async def evicted(self, victims: Sequence[HostEntry]) -> None:
        """Host victims whose slots are intact until this returns: copied and queued
        (``--store-write demotion``). Those that do not fit the queue are dropped."""
        if self.write != "demotion":
            return
        todo, room = [], self.queue_bytes - self._queued_bytes
        for v in victims:
            if v.bkey in self.published or self._fetched.pop(v.bkey, False) is None:
                continue
            if v.block_bytes > room:
                self.counters.add(Count.STORE_WRITES_DROPPED)
                continue
            room -= v.block_bytes
            todo.append(v)
        if not todo:
            return
        await self.placement.host.sealed(todo)
        values = await self._copy(todo)
        self._enqueue([_Job(e.bkey, e.block_bytes, value=v) for e, v in zip(todo, values, strict=True) if v])
        self.counters.add(Count.STORE_WRITES_SKIPPED, sum(1 for v in values if v is None))

    def _enqueue(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if self._queued_bytes + job.nbytes > self.queue_bytes:
                self.counters.add(Count.STORE_WRITES_DROPPED)
                continue
            self._queue.append(job)
            self._queued_bytes += job.nbytes
        if self._queue:
            self._idle.clear()
            self._wake.set()

    async def _copy(self, entries: Sequence[HostEntry]) -> list[bytearray | None]:
        """Each entry's slot copied into a value (header filled in), on the store's threads,
        verified against its commit checksum (None where it differs). The caller keeps the
        slots intact (pinned, or victims before finish_eviction)."""
        views = [self.placement._slot_view(e.cls, e.offset) for e in entries]
        items = [(e.bkey, e.block_bytes, e.checksum) for e in entries]
        n = min(COPY_THREADS, len(entries)) if sum(e.block_bytes for e in entries) > 4 * 1024**2 else 1
        loop = asyncio.get_running_loop()
        try:
            parts = await asyncio.gather(*(loop.run_in_executor(self.pool, _copy_values, items[i::n], views[i::n])
                                           for i in range(n)))
        finally:
            for v in views:
                v.release()
        out: list[bytearray | None] = [None] * len(entries)
        for i in range(n):
            out[i::n] = parts[i]
        return out

    # -- the writer --------------------------------------------------------------------------

    async def _writer(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, nbytes = [], 0
            while self._queue and (not batch or nbytes + self._queue[0].nbytes <= BATCH_BYTES):
                job = self._queue.popleft()
                nbytes += job.nbytes
                batch.append(job)
            try:
                await self._write_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one batch end the writer
                log.exception("store write-behind batch failed")
                self.counters.add(Count.STORE_WRITE_ERRORS, len(batch))
            finally:
                self._queued_bytes -= nbytes

    async def _write_batch(self, batch: list[_Job]) -> None:
        await self._materialize(batch)
        ready = [j for j in batch if j.value is not None]
        if not ready:
            return
        if time.monotonic() < self._skip_until:
            self.counters.add(Count.STORE_WRITE_ERRORS, len(ready))
            return
        items = [(redis_key(self.namespace, j.bkey), j.value) for j in ready]
        loop = asyncio.get_running_loop()
        try:
            ok = await asyncio.wait_for(loop.run_in_executor(self.pool, self.backend.put_many, items, self.ttl_s),
                                        self.timeout_s * 2)
        except asyncio.TimeoutError:
            ok = [False] * len(ready)
        done = [j for j, good in zip(ready, ok, strict=True) if good]
        failed = len(ready) - len(done)
        if failed:
            self.counters.add(Count.STORE_WRITE_ERRORS, failed)
            if not done:
                self._skip_until = time.monotonic() + BACKOFF_S
        self.counters.add(Count.STORE_WRITES, len(done))
        self.counters.add(Count.STORE_WRITE_BYTES, sum(j.nbytes for j in done))
        self._published([j.bkey for j in done])

    async def _materialize(self, batch: list[_Job]) -> None:
        """Copy the blocks of put jobs still in host (the same entry) into values."""
        host = self.placement.host
        live = [j for j in batch if j.entry is not None and host.get(j.bkey) == j.entry]
        self.counters.add(Count.STORE_WRITES_SKIPPED, sum(1 for j in batch if j.entry is not None) - len(live))
        if not live:
            return
        entries = [j.entry for j in live]
        for e in entries:
            host.pin(e)
        try:
            await host.sealed(entries)
            values = await self._copy(entries)
        finally:
            for e in entries:
                host.unpin(e)
        for j, v in zip(live, values, strict=True):
            j.value, j.entry = v, None
        self.counters.add(Count.STORE_WRITES_SKIPPED, sum(1 for v in values if v is None))

    def _published(self, bkeys: list[bytes]) -> None:
        expiry = time.monotonic() + self.ttl_s
        new = []
        for b in bkeys:
            if self.published.pop(b, None) is None:
                new.append(b)
            self.published[b] = expiry
        gone = []
        while len(self.published) > MAX_PUBLISHED:
            gone.append(self.published.popitem(last=False)[0])
        if gone:
            self.observers.removed_blocks(REMOTE, gone)
        if new:
            self.observers.stored_blocks(REMOTE, new)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.ttl_s / 4))
            self.expire()

    def expire(self, now: float | None = None) -> int:
        """Drop the blocks whose TTL lapsed from the feed; returns how many."""
        now = time.monotonic() if now is None else now
        gone = []
        while self.published:
            bkey, expiry = next(iter(self.published.items()))
            if expiry > now:
                break
            self.published.popitem(last=False)
            gone.append(bkey)
        if gone:
            self.counters.add(Count.STORE_EXPIRED, len(gone))
            self.observers.removed_blocks(REMOTE, gone)
        return len(gone)

    # -- read-through (RemoteSource) ---------------------------------------------------------


    async def stream(self, tenant: str, layout: Layout, bkeys: Sequence[bytes],
                     from_node: str | None = None) -> AsyncIterator[list[Fetched]]:
        """The blocks of ``bkeys`` the store holds, verified (see the module docstring), in
        batches of ``STREAM_BYTES`` (``fetch`` gathers them); ``from_node`` names a peer, never
        the store: nothing is fetched then. The next batch is read from the store
        (on a store thread) while the caller puts this one into host. The whole call waits at
        most ``timeout_s``; what is not read by then is a counted read error."""
        if from_node is not None or not bkeys:
            return
        if time.monotonic() < self._skip_until:
            self.counters.add(Count.STORE_READ_ERRORS, len(bkeys))
            return
        loop = asyncio.get_running_loop()
        per = max(1, STREAM_BYTES // max(1, layout.block_bytes))
        chunks = [list(bkeys[i:i + per]) for i in range(0, len(bkeys), per)]
        deadline = loop.time() + self.timeout_s
        pending = loop.run_in_executor(self.pool, self._read, chunks[0], layout.block_bytes)
        errors = 0
        for i in range(len(chunks)):
            try:
                tally = await asyncio.wait_for(asyncio.shield(pending), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self.counters.add(Count.STORE_READ_ERRORS, sum(len(c) for c in chunks[i:]))
                self._skip_until = time.monotonic() + BACKOFF_S
                return
            if i + 1 < len(chunks):
                pending = loop.run_in_executor(self.pool, self._read, chunks[i + 1], layout.block_bytes)
            errors += tally.errors
            self._count(tally)
            if tally.found:
                yield tally.found
        if errors == len(bkeys):
            self._skip_until = time.monotonic() + BACKOFF_S

    def _count(self, tally: _ReadTally) -> None:
        self.counters.add(Count.STORE_READS, len(tally.found))
        self.counters.add(Count.STORE_READ_BYTES, sum(len(p) for _, p, _ in tally.found))
        self.counters.add(Count.STORE_MISSES, tally.misses)
        self.counters.add(Count.STORE_CORRUPT, tally.corrupt)
        self.counters.add(Count.STORE_READ_ERRORS, tally.errors)
        if tally.corrupt:
            log.warning("store values dropped: bad header or checksum", extra={"blocks": tally.corrupt})

    def _read(self, bkeys: list[bytes], block_bytes: int) -> _ReadTally:
        """(A store thread.) Get the values in batches of at most BATCH_BYTES and verify them."""
        tally = _ReadTally()
        per = max(1, BATCH_BYTES // max(1, block_bytes))
        for i in range(0, len(bkeys), per):
            chunk = bkeys[i:i + per]
            try:
                values = self.backend.get_many([redis_key(self.namespace, b) for b in chunk], HEADER_BYTES + block_bytes)
                if len(values) != len(chunk):
                    raise ValueError(f"the store answered {len(values)} values for {len(chunk)} names")
            except Exception as e:  # noqa: BLE001 (whatever a backend raises: these names are read errors)
                log.warning("store read failed", extra={"error": repr(e), "blocks": len(chunk)})
                tally.errors += len(chunk)
                continue
            for bkey, value in zip(chunk, values, strict=True):
                if value is None:
                    tally.misses += 1
                elif isinstance(value, Exception):
                    tally.errors += 1
                elif (got := decode(bkey, value, block_bytes)) is None:
                    tally.corrupt += 1
                else:
                    tally.found.append((bkey, got[0], got[1]))
        return tally


def _copy_values(items: Sequence[tuple[bytes, int, int | None]], views: Sequence[memoryview]
                 ) -> list[bytearray | None]:
    """(A store thread.) Each slot's payload copied into a fresh value and hashed there; None
    where the copy's checksum is not the commit's."""
    out: list[bytearray | None] = []
    for (bkey, nbytes, checksum), view in zip(items, views, strict=True):
        buf = bytearray(HEADER_BYTES + nbytes)
        mv = memoryview(buf)
        np.copyto(np.frombuffer(mv, np.uint8)[HEADER_BYTES:], np.frombuffer(view, np.uint8, nbytes))  # GIL released
        got = xxhash.xxh3_64_intdigest(mv[HEADER_BYTES:])
        mv.release()
        if checksum is not None and got != checksum:
            out.append(None)
            continue
        encode_into(buf, bkey, nbytes, got)
        out.append(buf)
    return out


def build(cfg, placement, counters: Counters, observers: Observers) -> RemoteStore | None:  # noqa: ANN001
    """The store kvtierd's settings ask for (``--store-redis`` or ``--store-backend mooncake``), or None."""
    backend: Backend
    if cfg.store_backend == "mooncake":
        from kvtier.daemon.mooncake_store import MooncakeBackend

        backend = MooncakeBackend.from_config(cfg)
    else:
        nodes = parse_nodes(cfg.store_redis)
        if not nodes:
            return None
        ca, cert, key = _tls_files(cfg)
        password = read_password(cfg.store_password_file) if cfg.store_password_file else ""
        backend = RedisBackend(nodes, cfg.store_timeout_s, Transport(ca, cert, key, cfg.store_user, password))
    return RemoteStore(backend, placement, counters, observers, cfg.store_namespace, cfg.store_ttl_s,
                       cfg.store_write, cfg.store_read_through, cfg.store_timeout_s, cfg.store_queue_bytes)

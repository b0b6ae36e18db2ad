"""Index snapshots of router replicas in a Redis Cluster, so that a replica starts fast.

A router replica (``kvtier route-server --index-snapshot redis://...``) saves its state every
``--snapshot-interval-s`` (and on stop) to the Redis Cluster kvtier already uses for the shared
store: the index, every node's feed position ``(epoch, seq)`` and which target served which
node (:meth:`~kvtier.client.routing.router.Router.state_arrays`, the same arrays as
``--state-path`` writes to a file). A replica that starts loads the latest snapshot before its
feeds start, so every feed resumes from the snapshot's position: the daemon answers with the
events after it (or a snapshot of its own when its ring no longer reaches that far back), and
the replica routes from the loaded index at once while it catches up (its ``Status`` shows each
feed's ``seq`` below its ``head_seq`` meanwhile; the ``kvtier_router_catching_up`` metric is 1).

Layout in Redis (the keys start with ``kvtier:``, which the store's ACL user may write; ``NAME``:
``--snapshot-name``, default the router's ``--name``):

* ``kvtier:router:{NAME}:gen``: a counter, one generation per save;
* ``kvtier:router:{NAME:GEN:I}``: chunk ``I`` of the snapshot's bytes, :data:`CHUNK_BYTES` each
  (the last the rest). Each chunk has a hash slot of its own, so the chunks of one snapshot
  spread over the cluster's masters (their memory, and the reads and writes, which go to every
  master at once: up to :data:`IO_THREADS` masters in parallel);
* ``kvtier:router:{NAME}:latest``: the manifest (JSON: generation, chunks, chunk and total
  bytes, the XXH3-128 digest of the whole, when, what it holds), written last, atomically
  replacing the previous one; the chunks of the manifest it replaced are deleted then. A reader
  that finds a chunk gone or of the wrong length, or the digest wrong (a save replaced it
  meanwhile), reads the manifest again.

The bytes are ``numpy.savez``'s format (an uncompressed zip of ``.npy`` members, which
``numpy.load`` reads), written with every array's data at a 64-byte aligned offset (a zip extra
field pads each member's header), so that a replica that loads it takes its arrays as views of
the bytes it read (:func:`decode`), not copies.

Replicas of one fleet (same ``--snapshot-name``) share the snapshot: each saves a whole,
consistent state, and whichever saved last is the one the next replica loads.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import struct
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvtier.rediscluster import redis_kwargs
from kvtier.settings import parse_float, setting

log = logging.getLogger("kvtier.router")

CHUNK_BYTES = 8 << 20
"""Bytes of one snapshot chunk (a Redis string each)."""

IO_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Masters a snapshot is read from and written to at once (a thread and a connection each)."""

_ALIGN = 64  # every array's data starts at a multiple of this in the snapshot's bytes
_PAD_ID = 0xD935  # the zip extra field that pads a member's header (as zipalign's)
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # a zip member's local header

_READ_TRIES = 3


@dataclass(frozen=True)
class SnapshotConfig:
    """The route-server's index snapshot settings (a group of ``RouteServerConfig``)."""

    index_snapshot: str = setting("", "Redis Cluster to save the router's index snapshot to and load it from at "
                                      "start: redis://HOST:PORT[,HOST:PORT...] (rediss://: TLS, with "
                                      "--snapshot-tls-ca); a starting router loads the latest snapshot and "
                                      "resumes every feed from its positions; empty: none",
                                  metavar="URL")
    snapshot_interval_s: float = setting(30.0, "seconds between index snapshots to --index-snapshot (and one on "
                                               "stop)", parse_float, "S")
    snapshot_name: str = setting("", "the snapshot's name in Redis (keys kvtier:router:{NAME}:...): replicas of "
                                     "one fleet share it (default: --name)", metavar="NAME")
    snapshot_tls_ca: str = setting("", "PEM CA that signs the Redis nodes' certificates (rediss://)",
                                   metavar="FILE")
    snapshot_tls_cert: str = setting("", "client certificate for Redis over TLS (mutual TLS)", metavar="FILE")
    snapshot_tls_key: str = setting("", "PEM private key of --snapshot-tls-cert", metavar="FILE")
    snapshot_user: str = setting("", "Redis ACL user (its keys: kvtier:*)", metavar="USER")
    snapshot_password_file: str = setting("", "file holding the Redis ACL user's password", metavar="FILE")
    snapshot_timeout_s: float = setting(10.0, "Redis socket timeout for snapshot reads and writes (seconds)",
                                        parse_float, "S")

    def check(self) -> str | None:
        """What is wrong with these settings, or None."""
        if not self.index_snapshot:
            return None
        try:
            tls, nodes = parse_url(self.index_snapshot)
        except ValueError as e:
            return f"--index-snapshot: {e}"
        if tls and not self.snapshot_tls_ca:
            return "--index-snapshot rediss://... needs --snapshot-tls-ca (the CA of the Redis nodes' certificates)"
        if not tls and (self.snapshot_tls_ca or self.snapshot_tls_cert):
            return "--snapshot-tls-ca and --snapshot-tls-cert are for rediss:// (TLS)"
        if bool(self.snapshot_tls_cert) != bool(self.snapshot_tls_key):
            return "--snapshot-tls-cert and --snapshot-tls-key go together"
        if self.snapshot_interval_s <= 0:
            return "--snapshot-interval-s must be > 0"
        return None


def parse_url(url: str) -> tuple[bool, list[tuple[str, int]]]:
    """(TLS, nodes) of ``redis://HOST:PORT[,HOST:PORT...]`` (``rediss://``: TLS); raises ValueError."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise ValueError(f"{url!r} is not redis://HOST:PORT[,HOST:PORT...] or rediss://...")
    nodes = []
    for part in rest.strip("/").split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{part!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    return scheme == "rediss", nodes


class SnapshotError(Exception):
    """The snapshot store could not be read or written (Redis down, a chunk missing)."""


class SnapshotStore:
    """One snapshot name in a Redis Cluster (see the module docstring); thread-safe."""

    def __init__(self, nodes: Sequence[tuple[str, int]], name: str, *, tls_ca: str = "", tls_cert: str = "",
                 tls_key: str = "", user: str = "", password: str = "", timeout_s: float = 10.0,
                 chunk_bytes: int = CHUNK_BYTES, io_threads: int = IO_THREADS) -> None:
        self.nodes, self.name, self.timeout_s, self.chunk_bytes = list(nodes), name, timeout_s, chunk_bytes
        self.io_threads = max(1, io_threads)
        self._kw = redis_kwargs(tls_ca, tls_cert, tls_key, user, password)
        self._client: Any = None
        self._lock = threading.Lock()
        tag = "{" + name + "}"
        self.latest_key = f"kvtier:router:{tag}:latest"
        self.gen_key = f"kvtier:router:{tag}:gen"

    @classmethod
    def from_config(cls, cfg: SnapshotConfig, default_name: str) -> SnapshotStore:
        tls, nodes = parse_url(cfg.index_snapshot)
        password = ""
        if cfg.snapshot_password_file:
            with open(cfg.snapshot_password_file) as fh:
                password = fh.read().strip()
        return cls(nodes, cfg.snapshot_name or default_name, tls_ca=cfg.snapshot_tls_ca if tls else "",
                   tls_cert=cfg.snapshot_tls_cert, tls_key=cfg.snapshot_tls_key, user=cfg.snapshot_user,
                   password=password, timeout_s=cfg.snapshot_timeout_s)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from redis.cluster import ClusterNode, RedisCluster  # noqa: PLC0415

                self._client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
                                            require_full_coverage=False, socket_timeout=self.timeout_s,
                                            socket_connect_timeout=self.timeout_s, **self._kw)
            return self._client

    def chunk_key(self, gen: int, i: int) -> str:
        """The key of chunk ``i`` of generation ``gen`` (a hash slot of its own)."""
        return f"kvtier:router:{{{self.name}:{gen}:{i}}}"

    def _each(self, keys: list[str], do: Callable[[int], None]) -> None:
        """``do(i)`` for every key, the keys of each master in turn, up to ``io_threads``
        masters at once; the first error raised is raised here."""
        c = self.client()
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(c.get_node_from_key(k).name, []).append(i)
        runs = list(groups.values())
        if self.io_threads == 1 or len(runs) == 1:
            for run in runs:
                for i in run:
                    do(i)
            return
        with ThreadPoolExecutor(min(self.io_threads, len(runs)), thread_name_prefix="kvtier-snapshot") as ex:
            for _ in ex.map(lambda run: [do(i) for i in run], runs):
                pass

    def save(self, data: bytes | bytearray | memoryview, info: dict | None = None) -> int:
        """Store ``data`` as the latest snapshot; its generation. Raises :class:`SnapshotError`."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        try:
            c = self.client()
            gen = int(c.incr(self.gen_key))
            step = self.chunk_bytes
            view = memoryview(data).cast("B")
            n = max(1, -(-len(view) // step))
            keys = [self.chunk_key(gen, i) for i in range(n)]
            self._each(keys, lambda i: c.set(keys[i], view[i * step:(i + 1) * step]))
            manifest = {"gen": gen, "chunks": n, "chunk_bytes": step, "bytes": len(view),
                        "xxh3_128": xxhash.xxh3_128_hexdigest(view), "saved_at": time.time(),
                        "by": socket.gethostname(), **(info or {})}
            old = c.set(self.latest_key, json.dumps(manifest), get=True)
            if old:
                prev = json.loads(old)
                if prev.get("gen") != gen:
                    c.delete(*[self.chunk_key(prev["gen"], i) for i in range(int(prev.get("chunks", 0)))])
            return gen
        except (RedisError, OSError, ValueError, KeyError) as e:
            raise SnapshotError(f"saving the index snapshot to {self.name!r} failed: {e}") from e

    def manifest(self) -> dict | None:
        """The latest snapshot's manifest, or None when there is none."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        try:
            raw = self.client().get(self.latest_key)
        except (RedisError, OSError) as e:
            raise SnapshotError(f"reading the index snapshot {self.name!r} failed: {e}") from e
        return json.loads(raw) if raw else None

    def load(self) -> tuple[bytearray, dict] | None:
        """(bytes, manifest) of the latest snapshot, or None when there is none. A snapshot
        replaced while it was read is read again (the new one). Raises :class:`SnapshotError`."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        why = ""
        for _ in range(_READ_TRIES):
            m = self.manifest()
            if m is None:
                return None
            try:
                got = self._read(m)
            except (RedisError, OSError, KeyError, ValueError, TypeError) as e:
                raise SnapshotError(f"reading the index snapshot {self.name!r} failed: {e}") from e
            if isinstance(got, str):
                why = got
                continue
            return got, m
        raise SnapshotError(f"the index snapshot {self.name!r} could not be read whole: {why}")

    def _read(self, m: dict) -> bytearray | str:
        """The bytes of the snapshot of manifest ``m``, each chunk read into its place; or why not."""
        if "xxh3_128" not in m:
            return "its manifest has no xxh3_128 digest (saved in another layout)"
        size, n, step = int(m["bytes"]), int(m["chunks"]), int(m["chunk_bytes"])
        if n != max(1, -(-size // step)):
            return "its manifest's chunks do not add up to its bytes"
        buf = bytearray(size)
        keys = [self.chunk_key(m["gen"], i) for i in range(n)]
        c = self.client()
        gone: list[int] = []

        view = memoryview(buf)

        def get(i: int) -> None:
            if gone:
                return  # another chunk is gone already: the manifest is read again
            out = view[i * step:min(size, (i + 1) * step)]
            got = _get_into(c, keys[i], out)
            if got is None:  # not a plain reply: through the client (redirections, errors)
                part = c.get(keys[i])
                got = part is not None and len(part) == len(out)
                if got:
                    out[:] = part
            if not got:
                gone.append(i)

        self._each(keys, get)
        if gone:
            return "a chunk is gone (replaced by a newer save)"
        if xxhash.xxh3_128_hexdigest(buf) != m["xxh3_128"]:
            return "its digest does not match its manifest"
        return buf

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _get_into(c: Any, key: str, out: memoryview) -> bool | None:
    """``GET key`` on a connection of the master that serves ``key``, its value read from the
    socket straight into ``out`` (no parser, no copy): True; False when the key is gone or its
    value is not ``len(out)`` bytes; None when the reply is not a value (a redirection, an
    error: the caller asks again through the client)."""
    pool = c.get_node_from_key(key).redis_connection.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command("GET", key)
        sock = conn._sock  # noqa: SLF001
        head = bytearray()
        while not head.endswith(b"\r\n"):  # "$LENGTH\r\n", "$-1\r\n" or "-ERROR ...\r\n"
            b = sock.recv(1)
            if not b:
                raise ConnectionError("the Redis node closed the connection")
            head += b
        if head[:1] != b"$":
            return None
        n = int(head[1:-2])
        if n != len(out):
            if n >= 0:
                conn.disconnect()  # its value is still on the wire
            return False
        got = 0
        while got < n:
            k = sock.recv_into(out[got:], n - got)
            if not k:
                raise ConnectionError("the Redis node closed the connection")
            got += k
        tail = b""
        while len(tail) < 2:
            b = sock.recv(2 - len(tail))
            if not b:
                raise ConnectionError("the Redis node closed the connection")
            tail += b
        return True
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class _Reader:
    """A read-only file over a buffer (what ``zipfile`` and ``numpy.lib.format`` read headers from)."""

    def __init__(self, view: memoryview, at: int = 0) -> None:
        self.view, self.at = view, at

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.at + n)
        out = bytes(self.view[self.at:end])
        self.at = max(self.at, end)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = offset if whence == 0 else self.at + offset if whence == 1 else len(self.view) + offset
        return self.at

    def tell(self) -> int:
        return self.at

    def seekable(self) -> bool:
        return True


def encode(arrays: Mapping[str, np.ndarray]) -> memoryview:
    """``numpy.savez`` bytes of these arrays (``numpy.load`` reads them), each array's data at an
    offset that is a multiple of 64 (see the module docstring)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, a in arrays.items():
            a = np.asanyarray(a)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            # the local header: 30 bytes, the name, this extra field, zip64's (20 bytes); the npy
            # header after it is a multiple of 64 bytes long (numpy pads it so)
            head = out.tell() + _LOCAL.size + len(info.filename.encode()) + 20
            pad = -head % _ALIGN
            if pad and pad < 4:
                pad += _ALIGN
            if pad:
                info.extra = struct.pack("<HH", _PAD_ID, pad - 4) + bytes(pad - 4)
            with zf.open(info, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, a, allow_pickle=False)
    return out.getbuffer()


def decode(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The arrays of ``numpy.savez`` bytes (uncompressed), as views of ``data`` where each one's
    data is aligned (as :func:`encode` writes them), else copies. Raises ValueError."""
    view = memoryview(data).cast("B")
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(_Reader(view)) as zf:
            members = zf.infolist()
    except zipfile.BadZipFile as e:
        raise ValueError(f"not a numpy.savez snapshot: {e}") from e
    for info in members:
        if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
            raise ValueError(f"{info.filename!r} is not a stored .npy member")
        sig, *_, n_name, n_extra = _LOCAL.unpack_from(view, info.header_offset)
        if sig != 0x04034B50:
            raise ValueError(f"{info.filename!r}: no local header at {info.header_offset}")
        start = info.header_offset + _LOCAL.size + n_name + n_extra
        fh = _Reader(view[start:start + info.file_size])
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        if dtype.hasobject:
            raise ValueError(f"{info.filename!r} holds Python objects")
        count = int(np.prod(shape, dtype=np.int64))
        if fh.tell() + count * dtype.itemsize > info.file_size:
            raise ValueError(f"{info.filename!r} is shorter than its header says")
        a = np.frombuffer(view, dtype=dtype, count=count, offset=start + fh.tell())
        a = a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
        out[info.filename[:-4]] = a if a.flags.aligned else a.copy()
    return out


def state_bytes(router: Any) -> tuple[memoryview, dict]:
    """The router's state (:meth:`Router.state_arrays`) as ``numpy.savez`` bytes (:func:`encode`),
    and a summary for the manifest (keys, nodes, positions)."""
    data = encode(router.state_arrays())
    positions = router.positions()
    return data, {"keys": router.indexed_keys(), "nodes": len(positions),
                  "positions": {n: list(p) for n, p in positions.items()}}


def load_into(router: Any, data: bytes | bytearray | memoryview) -> None:
    """Replace the router's state (before it starts) with a snapshot's bytes."""
    router.load_arrays(decode(data))


class Snapshots:
    """A route-server's snapshots: :meth:`restore` once before the router starts, then
    :meth:`run` (a coroutine) saves every ``interval_s`` until cancelled, and :meth:`final`
    once on stop. ``saves``, ``failures``, ``last_gen``, ``last_saved`` (monotonic),
    ``restored`` (the manifest loaded at start, or None) for metrics."""

    def __init__(self, store: SnapshotStore, router: Any, interval_s: float) -> None:
        self.store, self.router, self.interval_s = store, router, interval_s
        self.saves = self.failures = 0
        self.last_gen = 0
        self.last_saved: float | None = None
        self.last_bytes = 0
        self.restored: dict | None = None
        self._save_lock = threading.Lock()

    def restore(self) -> dict | None:
        """Load the latest snapshot into the router; its manifest, or None (none, or unreadable:
        the feeds then start from their daemons' snapshots)."""
        t0 = time.monotonic()
        try:
            got = self.store.load()
            if got is None:
                log.info("no index snapshot yet; starting from the daemons' snapshots",
                         extra={"snapshot": self.store.name})
                return None
            data, manifest = got
            load_into(self.router, data)
        except (SnapshotError, OSError, ValueError, KeyError) as e:
            log.warning(f"index snapshot {self.store.name!r} not loaded ({e}); starting from the daemons' snapshots",
                        extra={"snapshot": self.store.name, "error": str(e)})
            return None
        age = time.time() - manifest.get("saved_at", time.time())
        log.info(f"index snapshot {self.store.name!r} loaded: {manifest.get('keys', 0)} keys of "
                 f"{manifest.get('nodes', 0)} nodes, saved {age:.1f} s ago, in {time.monotonic() - t0:.2f} s; "
                 "the feeds resume from its positions", extra={"snapshot": self.store.name, "gen": manifest["gen"]})
        self.restored = manifest
        return manifest

    def save(self) -> int:
        """One snapshot now (blocking); its generation. Raises :class:`SnapshotError`."""
        with self._save_lock:
            data, info = state_bytes(self.router)
            try:
                gen = self.store.save(data, info)
            except SnapshotError:
                self.failures += 1
                raise
            self.saves += 1
            self.last_gen, self.last_saved, self.last_bytes = gen, time.monotonic(), len(data)
            return gen

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await loop.run_in_executor(None, self.save)
            except SnapshotError as e:
                log.warning(str(e), extra={"snapshot": self.store.name})

    def final(self) -> None:
        try:
            self.save()
        except SnapshotError as e:
            log.warning(str(e), extra={"snapshot": self.store.name})

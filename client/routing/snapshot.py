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

Layout in Redis (every key in one hash slot, ``{NAME}``: ``--snapshot-name``, default the
router's ``--name``; the keys start with ``kvtier:``, which the store's ACL user may write):

* ``kvtier:router:{NAME}:gen``: a counter, one generation per save;
* ``kvtier:router:{NAME}:GEN:I``: the snapshot's bytes (``numpy.savez``), in chunks of
  :data:`CHUNK_BYTES`;
* ``kvtier:router:{NAME}:latest``: the manifest (JSON: generation, chunks, bytes, SHA-256,
  when, what it holds), written last, atomically replacing the previous one; the chunks of the
  manifest it replaced are deleted then. A reader that finds a chunk gone or the digest wrong
  (a save replaced it meanwhile) reads the manifest again.

Replicas of one fleet (same ``--snapshot-name``) share the snapshot: each saves a whole,
consistent state, and whichever saved last is the one the next replica loads.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.settings import parse_float, setting

log = logging.getLogger("kvtier.router")

CHUNK_BYTES = 8 << 20
"""Bytes of one snapshot chunk (a Redis string each)."""

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
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.nodes, self.name, self.timeout_s, self.chunk_bytes = list(nodes), name, timeout_s, chunk_bytes
        kw: dict[str, Any] = {}
        if tls_ca:
            kw.update(ssl=True, ssl_ca_certs=tls_ca, ssl_cert_reqs="required", ssl_certfile=tls_cert or None,
                      ssl_keyfile=tls_key or None)
        if user:
            kw["username"] = user
        if password:
            kw["password"] = password
        self._kw = kw
        self._client: Any = None
        self._lock = threading.Lock()
        tag = "{" + name + "}"
        self.latest_key = f"kvtier:router:{tag}:latest"
        self.gen_key = f"kvtier:router:{tag}:gen"
        self._chunk_prefix = f"kvtier:router:{tag}:"

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

    def _chunk_key(self, gen: int, i: int) -> str:
        return f"{self._chunk_prefix}{gen}:{i}"

    def save(self, data: bytes, info: dict | None = None) -> int:
        """Store ``data`` as the latest snapshot; its generation. Raises :class:`SnapshotError`."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        try:
            c = self.client()
            gen = int(c.incr(self.gen_key))
            step = self.chunk_bytes
            view = memoryview(data)
            n = max(1, -(-len(data) // step))
            for i in range(n):
                c.set(self._chunk_key(gen, i), bytes(view[i * step:(i + 1) * step]))
            manifest = {"gen": gen, "chunks": n, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "saved_at": time.time(), "by": socket.gethostname(), **(info or {})}
            old = c.set(self.latest_key, json.dumps(manifest), get=True)
            if old:
                prev = json.loads(old)
                if prev.get("gen") != gen:
                    c.delete(*[self._chunk_key(prev["gen"], i) for i in range(int(prev.get("chunks", 0)))])
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

    def load(self) -> tuple[bytes, dict] | None:
        """(bytes, manifest) of the latest snapshot, or None when there is none. A snapshot
        replaced while it was read is read again (the new one). Raises :class:`SnapshotError`."""
        from redis.exceptions import RedisError  # noqa: PLC0415

        why = ""
        for _ in range(_READ_TRIES):
            m = self.manifest()
            if m is None:
                return None
            try:
                keys = [self._chunk_key(m["gen"], i) for i in range(int(m["chunks"]))]
                parts = self.client().mget(keys)
            except (RedisError, OSError, KeyError, ValueError) as e:
                raise SnapshotError(f"reading the index snapshot {self.name!r} failed: {e}") from e
            if any(p is None for p in parts):
                why = "a chunk is gone (replaced by a newer save)"
                continue
            data = b"".join(parts)
            if len(data) != m.get("bytes") or hashlib.sha256(data).hexdigest() != m.get("sha256"):
                why = "its digest does not match its manifest"
                continue
            return data, m
        raise SnapshotError(f"the index snapshot {self.name!r} could not be read whole: {why}")

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def state_bytes(router: Any) -> tuple[bytes, dict]:
    """The router's state (:meth:`Router.state_arrays`) as ``numpy.savez`` bytes, and a
    summary for the manifest (keys, nodes, positions)."""
    arrays = router.state_arrays()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    positions = router.positions()
    return buf.getvalue(), {"keys": router.indexed_keys(), "nodes": len(positions),
                            "positions": {n: list(p) for n, p in positions.items()}}


def load_into(router: Any, data: bytes) -> None:
    """Replace the router's state (before it starts) with a snapshot's bytes."""
    with np.load(io.BytesIO(data)) as z:
        router.load_arrays({k: z[k] for k in z.files})


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

"""The shared store's second backend: the Mooncake Store (``--store-backend mooncake``).

The same :class:`~kvtier.daemon.remote_store.Backend` as Redis: the names, the ``KVTB`` values
(header, checksum, block id) and everything above the backend are :mod:`remote_store`'s. The
bytes go through Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``, from the
``mooncake-transfer-engine-non-cuda`` wheel: ``pip install -e '.[mooncake]' in a kvtier checkout``; it needs
``libibverbs1`` and ``libnuma1`` from apt even for TCP). Every daemon is a Mooncake client that
mounts ``--store-mooncake-segment-bytes`` of its own memory into the store's pool (Mooncake's
model: the pool is the clients' memory; the ``mooncake_master`` places each object in some
client's segment and serves the metadata), and moves bytes with the transfer engine over
``--store-mooncake-protocol`` (tcp or rdma).

TTL
    Mooncake has no per-object expiry (its master evicts under memory pressure). Each value is
    stored behind an 8-byte prefix, its expiry in Unix milliseconds; a value whose expiry has
    passed is a miss on every daemon (clocks are assumed roughly in step), and is left to
    Mooncake's eviction. A write is an upsert: writing a block again replaces it and its expiry.

Security
    Mooncake's transfer engine and master RPC have neither TLS nor client authentication, so
    this backend is refused unless ``--store-plaintext`` says the network is trusted.

Failures
    The client is made on first use and again at most once a second after a failed setup (a
    daemon starts while the master is down). A batch whose upsert fails is unwritten as a whole
    (``store_write_errors``); a get that raises fails its names (``store_read_errors``); an
    absent or evicted object is a miss. A block held in a segment of a daemon that exited is
    gone with it (a miss).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from kvtier.daemon.config import MOONCAKE_BUFFER_BYTES, MOONCAKE_SEGMENT_BYTES

log = logging.getLogger("kvtier.store")

EXPIRY = struct.Struct("<Q")  # expiry, Unix milliseconds
PREFIX_BYTES = EXPIRY.size
MISSING = ("the Mooncake Store backend needs the mooncake-transfer-engine-non-cuda wheel "
           "(pip install -e '.[mooncake]' in a kvtier checkout) and libibverbs1 and libnuma1 (apt)")


def load_client():  # noqa: ANN201 (mooncake.store.MooncakeDistributedStore)
    """Mooncake's store client class; ImportError (with what to install) where it does not load."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: warnings and info off
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"{MISSING}: {e}") from e
    return MooncakeDistributedStore


class MooncakeBackend:
    """See the module docstring; thread-safe (Mooncake's client is; its setup is guarded)."""

    name = "mooncake"

    def __init__(self, master: str, metadata: str, protocol: str = "tcp", local_host: str = "127.0.0.1",
                 device: str = "", segment_bytes: int = MOONCAKE_SEGMENT_BYTES,
                 buffer_bytes: int = MOONCAKE_BUFFER_BYTES) -> None:
        self.master = master
        self.metadata = metadata
        self.protocol = protocol
        self.local_host = local_host
        self.device = device
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self._store = None
        self._lock = threading.Lock()
        self._tried = 0.0
        self._closed = False
        load_client()  # refuse at startup where the wheel is missing
        # the transfer engine binds to this address (not every interface)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)

    @classmethod
    def from_config(cls, cfg) -> MooncakeBackend:  # noqa: ANN001
        from kvtier.daemon.server import StartupError

        try:
            return cls(cfg.store_mooncake_master, cfg.store_mooncake_metadata, cfg.store_mooncake_protocol,
                       cfg.store_mooncake_local, cfg.store_mooncake_device, cfg.store_mooncake_segment_bytes,
                       cfg.store_mooncake_buffer_bytes)
        except ImportError as e:
            raise StartupError(f"--store-backend mooncake: {e}") from None

    def client(self):  # noqa: ANN201
        with self._lock:
            if self._closed:
                raise ConnectionError("the store is closed")
            if self._store is not None:
                return self._store
            if time.monotonic() - self._tried < 1.0:
                raise ConnectionError(f"the Mooncake master {self.master} was not reachable a moment ago")
            self._tried = time.monotonic()
            host, _, port = self.master.rpartition(":")
            try:  # Mooncake's setup retries a dead master for ~90 s: ask the port first
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            except OSError as e:
                raise ConnectionError(f"the Mooncake master {self.master} is not reachable: {e}") from None
            store = load_client()()
            rc = store.setup(self.local_host, self.metadata, self.segment_bytes, self.buffer_bytes, self.protocol,
                             self.device, self.master)
            if rc != 0:
                with contextlib.suppress(Exception):
                    store.close()
                raise ConnectionError(f"Mooncake setup with master {self.master} failed (rc {rc})")
            self._store = store
            return store

    def _chunks(self, sizes: Sequence[int]) -> list[range]:
        """Index ranges whose values fit half the transfer buffer (a batch larger than the
        buffer fails whole in Mooncake)."""
        out, start, total, cap = [], 0, 0, max(1, self.buffer_bytes // 2)
        for i, n in enumerate(sizes):
            if i > start and total + n > cap:
                out.append(range(start, i))
                start, total = i, 0
            total += n
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], ttl_s: float) -> list[bool]:
        try:
            store = self.client()
        except Exception:
            return [False] * len(items)
        prefix = EXPIRY.pack(int((time.time() + ttl_s) * 1000))
        ok = [False] * len(items)
        for rng in self._chunks([PREFIX_BYTES + len(v) for _, v in items]):
            names = [items[i][0] for i in rng]
            values = [b"".join((prefix, items[i][1])) for i in rng]
            try:
                rc = store.upsert_batch(names, values)
            except Exception as e:  # the master or a segment's node is gone
                log.debug("mooncake upsert_batch failed: %s", e)
                continue
            if rc == 0:
                for i in rng:
                    ok[i] = True
        return ok

    def get_many(self, names: Sequence[str], value_bytes: int = 0) -> list[bytes | memoryview | None | Exception]:
        try:
            store = self.client()
        except Exception as e:
            return [e] * len(names)
        now_ms = int(time.time() * 1000)
        out: list[bytes | memoryview | None | Exception] = []
        # a get batch must fit the transfer buffer too (past it Mooncake fails the rest)
        per = max(1, (self.buffer_bytes // 2) // (PREFIX_BYTES + value_bytes)) if value_bytes else 16
        for i in range(0, len(names), per):
            chunk = list(names[i:i + per])
            try:
                values = store.get_batch(chunk)
            except Exception as e:
                out.extend([e] * len(chunk))
                continue
            empty = [j for j, v in enumerate(values) if not v]
            if empty:  # absent, or the master / the segment's node failed: ask which
                try:
                    there = store.batch_is_exist([chunk[j] for j in empty])
                except Exception as e:
                    there = [e] * len(empty)
                failed = {j: (r if isinstance(r, Exception) else ConnectionError(f"Mooncake error {r}"))
                          for j, r in zip(empty, there, strict=True) if isinstance(r, Exception) or r != 0}
            for j, v in enumerate(values):
                if not v:
                    out.append(failed.get(j))
                elif len(v) < PREFIX_BYTES:
                    out.append(None)
                elif EXPIRY.unpack_from(v, 0)[0] <= now_ms:
                    out.append(None)  # expired: a miss (Mooncake evicts it in time)
                else:
                    out.append(memoryview(v)[PREFIX_BYTES:])
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:  # Mooncake's close waits ~10 s on a dead master: not on us
            t = threading.Thread(target=_close, args=(store,), name="kvtier-mooncake-close", daemon=True)
            t.start()
            t.join(3.0)


def _close(store) -> None:  # noqa: ANN001
    with contextlib.suppress(Exception):
        store.close()

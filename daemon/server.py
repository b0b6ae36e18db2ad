"""The kvtierd process: builds the store from a :class:`Config` and serves it over gRPC.

Wiring only: the parts are built here and the servicers of :mod:`kvtier.daemon.services` (the
service layer, the only daemon code that touches the wire format) are registered.

Listeners: a unix socket (mode 0600, in a directory made 0700) and optionally TCP. gRPC turns
``SO_REUSEPORT`` on by default, which would let a second daemon bind a taken port silently;
it is turned off here and the port is probed first, so a taken port is a clear error.
SIGTERM and SIGINT stop the server gracefully (in-flight calls get a grace period), then the
pool files and the key table are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time

import grpc

from kvtier.daemon.config import Config
from kvtier.daemon.device import watch_sessions
from kvtier.daemon.events import LocationLog
from kvtier.daemon.gpu import EngineUnavailable, Transfers, build_engines
from kvtier.daemon.keytable import KeyTablePublisher
from kvtier.daemon.kv_events import KvEventsError, KvEventsPublisher
from kvtier.daemon.metrics import OpLatency, start_metrics_server
from kvtier.daemon.services import LocationsService, NodeService, TransferService, add_services, set_serving
from kvtier.daemon.stats import StatsSource, tier_usage
from kvtier.daemon.store import BlockStore
from kvtier.tiers.disk import DiskTier, DiskTierError
from kvtier.tiers.host import HostTier

log = logging.getLogger("kvtier.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRACE_S = 5.0


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""


def _prepare_unix_socket(path: str) -> None:
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale socket of a daemon that is gone
        return
    finally:
        probe.close()
    raise StartupError(f"another process is serving on {path}; stop it or pass --socket")


def _probe_tcp(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise StartupError(f"--tcp {hostport!r} is not HOST:PORT")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(f"TCP port {hostport} is already in use; pick another --tcp") from None
            raise StartupError(f"cannot bind --tcp {hostport}: {e.strerror}") from None
    return host, int(port)


class Daemon:
    """A running kvtierd: the store, its gRPC server and listeners."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_id = cfg.resolved_node_id()
        self.epoch = time.time_ns()
        self.socket_path = cfg.resolved_socket()
        if not os.path.isdir(cfg.shm_dir):
            raise StartupError(f"--shm-dir {cfg.shm_dir} is not a directory (mount a tmpfs there)")
        disk = None
        if cfg.disk_dir:
            try:
                disk = DiskTier(cfg.disk_dir, cfg.disk_capacity, cfg.disk_queue_depth, cfg.disk_map_size)
            except DiskTierError as e:
                raise StartupError(str(e)) from None
            log.info("disk tier opened", extra={
                "disk_dir": disk.directory, "disk_capacity": disk.capacity, "blocks_restored": disk.restored,
                "entries_dropped": disk.dropped_on_open, "queue_depth": disk.queue_depth})
        name = f"kvtier-{os.getpid()}-{self.epoch}"
        host = HostTier(cfg.shm_dir, cfg.host_capacity, name)
        self.store = BlockStore(host, cfg.max_batch_keys, disk, cfg.demote_min_seen, cfg.disk_write_through,
                                prefault=cfg.host_prefault)
        try:
            self.key_table = KeyTablePublisher(self.store, cfg.shm_dir, name, self.epoch, self._tier_capacity)
        except OSError as e:
            raise StartupError(f"cannot create the key table in --shm-dir {cfg.shm_dir}: {e.strerror}") from None
        self.locations = LocationLog(self.store, self.node_id, self.epoch, cfg.event_log_keys)
        self.store.observers.add(self.key_table, self.locations)
        self.stats = StatsSource(self.store, self.node_id, self.epoch)
        self.latency = OpLatency()  # every handler's time, by op (exported as kvtier_op_latency_seconds)
        self._session_watch: asyncio.Task | None = None
        try:
            engines = build_engines(cfg)
        except EngineUnavailable as e:
            self.store.close()
            raise StartupError(str(e)) from None
        self.transfers = Transfers(self.store, engines)
        self.server: grpc.aio.Server | None = None
        self.kv_events: KvEventsPublisher | None = None  # --kv-events-endpoint
        self._stopped = asyncio.Event()
        self.metrics_port = 0

    def _tier_capacity(self) -> int:
        """Bytes all tiers can hold: what the key table is presized from."""
        return sum(t.capacity_bytes for t in tier_usage(self.store))

    async def start(self) -> None:
        _prepare_unix_socket(self.socket_path)
        self.key_table.start()
        tcp = _probe_tcp(self.cfg.tcp) if self.cfg.tcp else None
        self.kv_events = self._open_kv_events()
        opts = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000)]
        server = grpc.aio.server(options=opts)
        health_servicer = add_services(
            server, NodeService(self.store, self.stats, self.latency, key_table_path=self.key_table.path),
            LocationsService(self.locations, self.latency), TransferService(self.transfers, self.latency))
        old_umask = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(old_umask)
        if tcp:
            host, port = tcp
            addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if server.add_insecure_port(addr) == 0:
                raise StartupError(f"cannot listen on --tcp {self.cfg.tcp}")
        await server.start()
        os.chmod(self.socket_path, 0o600)
        self.stats.loop = asyncio.get_running_loop()
        self._session_watch = self.stats.loop.create_task(watch_sessions(self.store.device))
        await set_serving(health_servicer)
        self.server = server
        if self.cfg.metrics_port:
            self.metrics_port = start_metrics_server(self.node_id, self.stats.snapshot_from_thread, self.latency,
                                                     self.cfg.metrics_host, self.cfg.metrics_port)
        log.info("kvtierd serving", extra={
            "socket": self.socket_path, "tcp": self.cfg.tcp or None, "node_id": self.node_id,
            "epoch": self.epoch, "host_capacity": self.cfg.host_capacity, "shm_dir": self.cfg.shm_dir,
            "metrics_port": self.metrics_port or None, "pid": os.getpid(),
            "copy_engines": sorted(e.name for e in self.transfers.engines.values())})

    def _open_kv_events(self) -> KvEventsPublisher | None:
        """The vLLM-format KV event stream of the host and disk tiers, when configured."""
        cfg = self.cfg
        if not (cfg.kv_events_endpoint or cfg.kv_events_replay_endpoint):
            return None
        try:
            pub = KvEventsPublisher(self.store, self.node_id, cfg.kv_events_endpoint,
                                    cfg.kv_events_replay_endpoint, cfg.kv_events_topic)
        except KvEventsError as e:
            raise StartupError(str(e)) from None
        self.store.observers.add(pub)
        pub.start()
        return pub

    async def stop(self) -> None:
        if self._session_watch is not None:
            self._session_watch.cancel()
            self._session_watch = None
        self.locations.close()
        if self.server is not None:
            log.info("shutting down", extra={"grace_s": GRACE_S})
            await self.server.stop(GRACE_S)
            self.server = None
        await self.transfers.close()
        await self.store.drain()  # requests cut off by the grace period finish their disk and slot work
        if self.kv_events is not None:
            self.kv_events.close()  # after the last change: its batch goes out
        self.key_table.close()
        self.store.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._stopped.set()

    async def run_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        await stop.wait()
        await self.stop()


def run(cfg: Config) -> None:
    """Run kvtierd until SIGTERM/SIGINT, on uvloop."""
    import uvloop

    async def main() -> None:
        await Daemon(cfg).run_until_signal()

    uvloop.run(main())

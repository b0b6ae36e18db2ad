"""The kvtierd process: builds the store from a :class:`Config` and serves it over gRPC.

Wiring only: the parts are built here and the servicers of :mod:`kvtier.daemon.services` (the
service layer, the only daemon code that touches the wire format) are registered.

Listeners: a unix socket (mode 0600, in a directory made 0700) and optionally TCP. gRPC turns
``SO_REUSEPORT`` on by default, which would let a second daemon bind a taken port silently;
it is turned off here and the port is probed first, so a taken port is a clear error.
SIGTERM and SIGINT stop the server gracefully (in-flight calls get a grace period), then the
pool files and the key table are removed.

Starting is ordered so that a refused start leaves nothing behind: first every check that can
refuse it (the directories, the socket, the TCP and metrics ports), then the listeners, the
copy engines and the disk tier (its directory is its lasting state), and only then the files
in ``--shm-dir`` (the key table; the pool files come with the first layout). Whatever fails on
the way removes what was made (:meth:`Daemon.start`). Before making its own files the daemon
removes those that killed daemons left in its ``--shm-dir`` (:func:`sweep_dead_daemons`).

The files go in a directory only the daemon's uid can write (:func:`private_shm_dir`): the
``--shm-dir`` itself when it is this uid's and no one else may write it, else (``/dev/shm``,
mode 1777) its subdirectory ``kvtier-<uid>``, made 0700 and checked like the socket's
directory. Their names carry 64 random bits (``kvtier-<pid>-<epoch>-r<16 hex>...``), so no
one can name a file the daemon will make before it makes it, and they are created
``O_EXCL|O_NOFOLLOW``.

gRPC connections on the unix socket with no call in flight for ``--grpc-idle-s`` (one that
only sent the HTTP/2 preface included) are closed by gRPC itself
(``grpc.max_connection_idle_ms``), and one that does not finish its HTTP/2 handshake within
that window too (``grpc.server_handshake_timeout_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import inspect
import logging
import os
import re
import secrets
import signal
import socket
import stat
import time

import grpc

from kvtier.daemon.auth import AccessPolicy, FdBudgets, PeerAuthenticator, Principal, TokenInterceptor
from kvtier.daemon.config import Config
from kvtier.daemon.credentials import CredentialServer
from kvtier.daemon.device import watch_sessions
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.events import LocationLog
from kvtier.daemon.gpu import EngineUnavailable, Transfers, build_engines
from kvtier.daemon.keytable import KeyTablePublisher
from kvtier.daemon.kv_events import KvEventsError, KvEventsPublisher
from kvtier.daemon.lookup_regions import LookupRegions
from kvtier.daemon.metrics import MetricsServer, OpLatency, start_metrics_server
from kvtier.daemon.peers import Peers
from kvtier.daemon.remote_store import RemoteStore
from kvtier.daemon.remote_store import build as build_remote_store
from kvtier.daemon.services import LocationsService, NodeService, TransferService, add_services, set_serving
from kvtier.daemon.services.peer import PeerClient, PeerService
from kvtier.daemon.services.tcp import add_tcp_services
from kvtier.daemon.stats import StatsSource, tier_usage
from kvtier.daemon.store import BlockStore
from kvtier.handshake import auth_socket_path
from kvtier.tiers.copy_engine import CopyEngine
from kvtier.tiers.disk import DiskTier, DiskTierError
from kvtier.tiers.host import HostTier

log = logging.getLogger("kvtier.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRACE_S = 5.0


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""


def _check_socket_dir(d: str, shared: bool) -> None:
    """Refuse a socket directory another user could have made or can write into: not this
    user's, a symlink, not a directory, or with group/other bits beyond 0700 (``shared``: beyond
    0711, which lets other admitted users reach the sockets but not list or change the
    directory). A missing one is created so."""
    want = 0o711 if shared else 0o700
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        try:
            os.makedirs(d, mode=0o700)
            os.chmod(d, want)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        except OSError as e:
            raise StartupError(f"cannot create the directory of --socket, {d}: {e.strerror}; pass a --socket "
                               f"in a directory this user can write") from None
        st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise StartupError(f"the directory of --socket, {d}, is a symlink: refused (another user could point it "
                           f"anywhere); use a real directory owned by this user, mode 0700")
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"the directory of --socket, {d}, is not a directory")
    if st.st_uid != os.geteuid():
        raise StartupError(f"the directory of --socket, {d}, is owned by uid {st.st_uid}, not by this daemon's "
                           f"uid {os.geteuid()}: another user could have made it to catch clients; remove it "
                           f"or pass a --socket in a directory of this user (mode 0700)")
    extra = stat.S_IMODE(st.st_mode) & 0o077 & ~(want & 0o077)
    if extra:
        raise StartupError(f"the directory of --socket, {d}, is mode {stat.S_IMODE(st.st_mode):04o}: group or "
                           f"other users may {'write or list' if extra & 0o066 else 'enter'} it; make it "
                           f"{want:04o} (chmod {want:o} {d})" + ("" if shared else " or, to admit other users, "
                                                                  "set --allowed-uids/--allowed-gids"))


def _prepare_unix_socket(path: str, shared: bool = False) -> None:
    d = os.path.dirname(path) or "."
    _check_socket_dir(d, shared)
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


def _read_pem(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise StartupError(f"cannot read {flag} {path}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise StartupError(f"{flag} {path} is not PEM (no -----BEGIN line)")
    return data


def tls_server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """Mutual TLS: the server's certificate and key, and the CA every client certificate must chain to."""
    return grpc.ssl_server_credentials([(_read_pem("--tls-key", key), _read_pem("--tls-cert", cert))],
                                       root_certificates=_read_pem("--tls-ca", ca), require_client_auth=True)


def peer_channel_credentials(cfg: Config) -> dict[str, grpc.ChannelCredentials] | None:
    """The client certificates for calls to --peers: tenant -> credentials, "" the
    default (--peer-tls-cert, else --tls-cert); None: plaintext (--insecure-tcp, no certificate)."""
    cert, key = (cfg.peer_tls_cert, cfg.peer_tls_key) if cfg.peer_tls_cert else (cfg.tls_cert, cfg.tls_key)
    if not cert:
        return None
    ca_path = cfg.peer_tls_ca or cfg.tls_ca
    ca = _read_pem("--peer-tls-ca", ca_path) if ca_path else None
    out = {"": grpc.ssl_channel_credentials(ca, _read_pem("--peer-tls-key", key), _read_pem("--peer-tls-cert", cert))}
    for entry in cfg.peer_tenant_certs:
        tenant, _, files = entry.partition("=")
        tcert, _, tkey = files.partition(":")
        out[tenant] = grpc.ssl_channel_credentials(ca, _read_pem("--peer-tenant-certs", tkey),
                                                   _read_pem("--peer-tenant-certs", tcert))
    return out


SECRET_BYTES = 32


def load_key_secret(path: str) -> bytes:
    """The deployment's key secret at ``path``, created (0600, exclusively, never through a
    symlink) when missing; refused if it is not this user's regular 0600 file of 32 bytes."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise StartupError(f"cannot create the key secret {path}: {e.strerror}") from None
    else:
        try:
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("created the key secret", extra={"key_secret_file": path})
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StartupError(f"cannot open the key secret {path}: {e.strerror} (a symlink is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise StartupError(f"the key secret {path} must be a regular file of this user (uid {os.geteuid()}), "
                               f"mode 0600; it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise StartupError(f"the key secret {path} holds {len(data)} bytes, not {SECRET_BYTES}: remove it to "
                           f"make a new one (every tenant's keys then change)")
    return data


def key_secret_path(cfg: Config) -> str:
    """--key-secret-file, else key.secret in --disk-dir, else in --state-dir; "" for none."""
    if cfg.key_secret_file:
        return cfg.key_secret_file
    base = cfg.disk_dir or cfg.state_dir
    return os.path.join(base, "key.secret") if base else ""


def _probe_port(host: str, port: int, flag: str, shown: str) -> None:
    """Bind ``host:port`` as its listener will (``SO_REUSEADDR``, so connections of a previous
    daemon in TIME_WAIT do not count) and let go: a taken port is a :class:`StartupError`."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise StartupError(f"cannot bind {flag} {shown}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(f"{flag} {shown}: the port is already in use; pick another {flag}") from None
            raise StartupError(f"cannot bind {flag} {shown}: {e.strerror}") from None


def _probe_tcp(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise StartupError(f"--tcp {hostport!r} is not HOST:PORT")
    host = host.strip("[]")
    _probe_port(host, int(port), "--tcp", hostport)
    return host, int(port)


#: statfs f_type of the filesystems that are memory
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def _memory_fs(path: str) -> str:
    """"tmpfs" or "ramfs" when ``path`` (or, before it exists, its nearest existing parent) is
    on one; "" otherwise or when it cannot be told."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    buf = ctypes.create_string_buffer(512)  # struct statfs; f_type is its first word
    if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(path), buf) != 0:
        return ""
    return _MEMORY_FS.get(ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF, "")


def shm_huge_pages(path: str, mounts: str | None = None, shmem_enabled: str | None = None) -> str:
    """Whether the tmpfs at ``path`` gives its files huge pages: the ``huge=`` option of the
    mount it is on (the longest mount point above it in ``mounts``, /proc/mounts' text), else
    the kernel's default for tmpfs mounts without one (``shmem_enabled``, the bracketed word of
    /sys/kernel/mm/transparent_hugepage/shmem_enabled); "" when it cannot be told. "never"
    means 4 KiB pages: puts and lookups then cost more (docs/operations.md, "Huge pages")."""
    try:
        if mounts is None:
            with open("/proc/mounts") as fh:
                mounts = fh.read()
        if shmem_enabled is None:
            with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as fh:
                shmem_enabled = fh.read()
    except OSError:
        return ""
    path = os.path.abspath(path)
    best, opts = "", ""
    for line in mounts.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "tmpfs":
            mp = f[1].replace("\\040", " ")
            if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
                best, opts = mp, f[3]
    if not best:
        return ""
    for o in opts.split(","):
        if o.startswith("huge="):
            return o[5:]
    m = re.search(r"\[(\w+)\]", shmem_enabled)
    return {"force": "always", "deny": "never"}.get(m.group(1), m.group(1)) if m else ""


def private_shm_dir(shm_dir: str) -> str:
    """Where the daemon makes its pool and key-table files: ``shm_dir`` when it is a real
    directory of this uid that group and others cannot write; else its subdirectory
    ``kvtier-<uid>``, created 0700 when missing, and refused unless it is a real directory of
    this uid, mode 0700 (another uid could have planted it, or could plant files in it)."""
    try:
        st = os.lstat(shm_dir)
    except OSError as e:
        raise StartupError(f"--shm-dir {shm_dir}: {e.strerror} (mount a tmpfs there)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"--shm-dir {shm_dir} is not a directory (mount a tmpfs there)")
    if st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022:
        return shm_dir
    own = os.path.join(shm_dir, f"kvtier-{os.geteuid()}")
    try:
        os.mkdir(own, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StartupError(f"--shm-dir {shm_dir} may be written by other users, and the daemon cannot make its "
                           f"own directory {own} in it: {e.strerror}") from None
    st = os.lstat(own)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"{own} (this daemon's directory in --shm-dir) is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}: "
                           f"refused (another user could have planted it); remove it")
    if st.st_uid != os.geteuid():
        raise StartupError(f"{own} (this daemon's directory in --shm-dir) is owned by uid {st.st_uid}, not by this "
                           f"daemon's uid {os.geteuid()}: another user could have made it to plant files; remove it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise StartupError(f"{own} (this daemon's directory in --shm-dir) is mode {stat.S_IMODE(st.st_mode):04o}: "
                           f"group or other users may reach it; make it 0700 (chmod 700 {own})")
    return own


def _check_dirs(cfg: Config) -> None:
    if not os.path.isdir(cfg.shm_dir):
        raise StartupError(f"--shm-dir {cfg.shm_dir} is not a directory (mount a tmpfs there)")
    fs = _memory_fs(cfg.disk_dir) if cfg.disk_dir else ""
    if fs and not cfg.disk_allow_tmpfs:
        raise StartupError(f"--disk-dir {cfg.disk_dir} is on a {fs} (memory, not disk): its blocks would "
                           f"take RAM beside the host pool and be lost at reboot; put it on a local disk, or "
                           f"pass --disk-allow-tmpfs to use memory anyway")
    if fs:
        log.warning("--disk-dir is on a %s: the disk tier is memory (--disk-allow-tmpfs)", fs,
                    extra={"disk_dir": cfg.disk_dir})


# -- files of killed daemons ---------------------------------------------------------------------

#: the files a kvtierd makes in --shm-dir: its key table (and a rebuild's temporary file), its pools
_OWN_FILE = re.compile(r"kvtier-(\d+)-(\d+(?:-r[0-9a-f]{16})?)(?:-t\d+)?(?:\.keys(?:\.\d+\.tmp)?|-\d+\.pool)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_if_unused(path: str) -> bool:
    """Unlink ``path`` if no process has it open for writing (a live daemon maps its key table and
    holds its pool files read-write): a read lease is granted only then. This holds across pid
    namespaces, where a live daemon's pid means nothing. False when it is in use, or when leases
    cannot tell (not supported, not permitted)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        os.unlink(path)  # under the lease; closing releases it
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


SWEEP_S = 2.0
"""How often a running daemon sweeps its --shm-dir again for dead daemons' files."""


def sweep_dead_daemons(shm_dir: str) -> tuple[int, int]:
    """Remove from ``shm_dir`` the files killed kvtierds left there; returns (files, bytes).

    A file goes only if all hold: its name is one kvtierd gives its files
    (``kvtier-<pid>-<epoch>.keys``, with ``.<n>.tmp`` during a rebuild, or
    ``kvtier-<pid>-<epoch>-<slot bytes>.pool``; a tenant's with ``-t<n>`` after the epoch),
    it is a regular file of this user, no process with that pid is alive, and either no process
    has it open for writing, or it is a pool file whose daemon has no key table left (a live
    daemon holds its key tables open from before its first pool file until it exits, so they
    are never removed under it; a dead one's go at the first sweep). Such a pool file may still
    be mapped by that daemon's former clients until they move to its successor: unlinked, its
    memory is freed with their last mapping instead of staying in the tmpfs for good."""
    files = nbytes = 0
    uid = os.geteuid()
    orphans: list[tuple[os.DirEntry, os.stat_result, str]] = []
    for entry in os.scandir(shm_dir):
        m = _OWN_FILE.fullmatch(entry.name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == uid):
            continue
        if _remove_if_unused(entry.path):
            files += 1
            nbytes += st.st_blocks * 512
        elif entry.name.endswith(".pool"):
            orphans.append((entry, st, f"kvtier-{m.group(1)}-{m.group(2)}"))
    if orphans:
        tables = {f"kvtier-{m.group(1)}-{m.group(2)}" for m in
                  (_OWN_FILE.fullmatch(n) for n in os.listdir(shm_dir) if ".keys" in n) if m is not None}
        for entry, st, daemon in orphans:
            if daemon not in tables:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    files += 1
                    nbytes += st.st_blocks * 512
    return files, nbytes


def _timed_ops(*servicers: object) -> list[str]:
    """The ``op`` label of each unary RPC the servicers time: their methods wrapped by
    ``handled`` (coroutines with ``__wrapped__``), by name in lower case."""
    return sorted(name.lower() for svc in servicers
                  for name, fn in inspect.getmembers(type(svc), inspect.iscoroutinefunction)
                  if hasattr(fn, "__wrapped__"))


class Daemon:
    """A running kvtierd: the store, its gRPC server and listeners.

    Nothing is made until :meth:`start`; a start that fails removes what it made."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_id = cfg.resolved_node_id()
        self.epoch = time.time_ns()
        self.socket_path = cfg.resolved_socket()
        self.server: grpc.aio.Server | None = None
        self.tcp_server: grpc.aio.Server | None = None  # --tcp: its own server, serving --tcp-services only
        self.policy = AccessPolicy.of(cfg.allowed_uids, cfg.allowed_gids, cfg.tenants)
        self.auth = PeerAuthenticator(self.policy, b"", cfg.insecure_tcp,  # its secret: _load_secret
                                      FdBudgets(cfg.max_passed_fds_per_connection, cfg.max_passed_fds_per_uid,
                                                cfg.max_passed_fds_per_tenant))
        self.shm_dir = cfg.shm_dir  # where its files go: private_shm_dir, at start
        self.credentials: CredentialServer | None = None
        self.disk: DiskTier | None = None
        self.engines: dict[str, CopyEngine] = {}
        self.store: BlockStore | None = None
        self.key_table: KeyTablePublisher | None = None
        self.locations: LocationLog | None = None
        self.transfers: Transfers | None = None
        self.stats: StatsSource | None = None
        self.lookups: LookupRegions | None = None  # clients' lookup counters regions
        self.latency = OpLatency()  # every handler's time, by op (exported as kvtier_op_latency_seconds)
        self.metrics: MetricsServer | None = None
        self.kv_events: KvEventsPublisher | None = None  # --kv-events-endpoint
        self.peers: Peers | None = None  # --peers
        self.remote_store: RemoteStore | None = None  # --store-redis
        self.metrics_port = 0
        self._socket_made = False
        self._session_watch: asyncio.Task | None = None
        self._lookup_folds: asyncio.Task | None = None
        self._sweeps: asyncio.Task | None = None  # dead daemons' files, again while clients let go of them
        self._stopped = asyncio.Event()

    def _tier_capacity(self) -> int:
        """Bytes all tiers can hold: what the key table is presized from."""
        assert self.store is not None
        return sum(t.capacity_bytes for t in tier_usage(self.store))

    async def start(self) -> None:
        """Check, listen, build, serve (see the module docstring); on any failure undo it all."""
        try:
            tcp = self._check()
            server = self._listen(tcp)
            self._build_engines()
            self._open_disk()
            self._load_secret()
            self._sweep()
            self._build_store()
            self.kv_events = self._open_kv_events()
            await self._serve(server)
        except BaseException:
            await self._undo()
            raise
        log.info("kvtierd serving", extra={
            "socket": self.socket_path, "tcp": self.cfg.tcp or None, "node_id": self.node_id,
            "epoch": self.epoch, "host_capacity": self.cfg.host_capacity, "shm_dir": self.shm_dir,
            "metrics_port": self.metrics_port or None, "pid": os.getpid(),
            "tcp_tls": bool(self.cfg.tls_cert) if self.cfg.tcp else None,
            "allowed_uids": sorted(self.policy.allowed_uids), "allowed_gids": sorted(self.policy.allowed_gids),
            "copy_engines": sorted(e.name for e in self.engines.values()),
            "shm_huge_pages": shm_huge_pages(self.shm_dir) or None})

    def _check(self) -> tuple[str, int] | None:
        """Every check that can refuse the start, before anything is made."""
        _check_dirs(self.cfg)
        self.shm_dir = private_shm_dir(self.cfg.shm_dir)
        _prepare_unix_socket(self.socket_path, self.policy.shared)
        if self.cfg.tcp and not self.cfg.tls_cert and not self.cfg.insecure_tcp:
            raise StartupError(f"--tcp {self.cfg.tcp} without TLS would serve anyone who reaches the port: give "
                               f"--tls-cert, --tls-key and --tls-ca, or pass --insecure-tcp")
        tcp = _probe_tcp(self.cfg.tcp) if self.cfg.tcp else None
        if self.cfg.metrics_port:
            _probe_port(self.cfg.metrics_host, self.cfg.metrics_port, "--metrics-port",
                        f"{self.cfg.metrics_host}:{self.cfg.metrics_port}")
        return tcp

    def _listen(self, tcp: tuple[str, int] | None) -> grpc.aio.Server:
        opts = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000)]
        idle_ms = max(1, round(self.cfg.grpc_idle_s * 1000))
        unix_opts = [*opts, ("grpc.max_connection_idle_ms", idle_ms), ("grpc.server_handshake_timeout_ms", idle_ms)]
        self.server = server = grpc.aio.server(options=unix_opts, interceptors=[TokenInterceptor(self.auth)],
                                               maximum_concurrent_rpcs=self.cfg.max_concurrent_rpcs or None)
        old_umask = os.umask(0o177)
        try:
            bound = server.add_insecure_port(f"unix:{self.socket_path}")
        except RuntimeError:
            bound = 0
        finally:
            os.umask(old_umask)
        if not bound:
            raise StartupError(f"cannot listen on --socket {self.socket_path}")
        self._socket_made = True
        self.credentials = CredentialServer(self.auth, auth_socket_path(self.socket_path), self._socket_mode,
                                            files=self._tenant_file,  # lookups: set once the store is built
                                            hello_timeout_s=self.cfg.credential_hello_timeout_s,
                                            max_pending_per_uid=self.cfg.max_pending_handshakes_per_uid,
                                            fd_reserve=self.cfg.fd_reserve)
        try:
            self.credentials.listen()
        except OSError as e:
            raise StartupError(f"cannot listen on the credential socket {self.credentials.path}: {e.strerror}") from None
        if tcp:
            self.tcp_server = self._listen_tcp(tcp, opts)
        return server

    @property
    def _socket_mode(self) -> int:
        return 0o666 if self.policy.shared else 0o600

    def _listen_tcp(self, tcp: tuple[str, int], opts: list) -> grpc.aio.Server:
        """The --tcp listener: its own server, so that it serves only --tcp-services."""
        cfg = self.cfg
        host, port = tcp
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tcp_server = grpc.aio.server(options=opts, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs or None)
        try:
            if cfg.tls_cert:
                bound = tcp_server.add_secure_port(addr, tls_server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
            else:
                bound = tcp_server.add_insecure_port(addr)
        except RuntimeError:
            bound = 0
        if not bound:
            raise StartupError(f"cannot listen on --tcp {cfg.tcp}")
        if not cfg.tls_cert:
            log.warning("INSECURE: --tcp %s serves in plaintext without authentication (--insecure-tcp): anyone "
                        "who reaches the port is served as tenant 'default'; give --tls-cert, --tls-key and "
                        "--tls-ca instead", cfg.tcp, extra={"tcp": cfg.tcp, "tcp_services": cfg.tcp_services})
        return tcp_server

    def _load_secret(self) -> None:
        path = key_secret_path(self.cfg)
        if not path:
            self.auth.secret = secrets.token_bytes(SECRET_BYTES)
            log.warning("no --key-secret-file, --disk-dir or --state-dir: the tenants' key salts come from a new "
                        "random secret this run, so every block key changes at each restart (set "
                        "--key-secret-file to keep them)")
            return
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            try:
                os.makedirs(parent, mode=0o700)
            except OSError as e:
                raise StartupError(f"cannot create the directory of the key secret {path}: {e.strerror}") from None
        self.auth.secret = load_key_secret(path)

    def _open_disk(self) -> None:
        cfg = self.cfg
        if not cfg.disk_dir:
            return
        try:
            self.disk = disk = DiskTier(cfg.disk_dir, cfg.disk_capacity, cfg.disk_queue_depth, cfg.disk_map_size,
                                        cfg.disk_recheck_s)
        except DiskTierError as e:
            raise StartupError(str(e)) from None
        log.info("disk tier opened", extra={
            "disk_dir": disk.directory, "disk_capacity": disk.capacity, "blocks_restored": disk.restored,
            "entries_dropped": disk.dropped_on_open, "queue_depth": disk.queue_depth})

    def _build_engines(self) -> None:
        try:
            self.engines = build_engines(self.cfg)
        except EngineUnavailable as e:
            raise StartupError(str(e)) from None

    def _sweep(self) -> None:
        files, nbytes = sweep_dead_daemons(self.shm_dir)
        if files:
            log.info("removed the files of daemons that are gone", extra={
                "shm_dir": self.shm_dir, "files": files, "bytes": nbytes})

    def _build_store(self) -> None:
        """The host tier, the store and what follows it: the first files in --shm-dir."""
        cfg = self.cfg
        name = f"kvtier-{os.getpid()}-{self.epoch}-r{secrets.token_hex(8)}"  # not to be named ahead
        host = HostTier(self.shm_dir, cfg.host_capacity, name)
        self.store = store = BlockStore(host, cfg.max_batch_keys, self.disk, cfg.demote_min_seen,
                                        cfg.disk_write_through, prefault=cfg.host_prefault, limits=cfg)
        self.disk = None  # the store owns it now
        store.tiers.demote_queue_bytes = cfg.demote_queue_bytes  # disk admission
        store.tiers.demote_ahead_bytes = cfg.demote_ahead_bytes
        try:
            self.key_table = KeyTablePublisher(store, self.shm_dir, name, self.epoch, self._tier_capacity)
        except OSError as e:
            raise StartupError(f"cannot create the key table in {self.shm_dir}: {e.strerror}") from None
        self.locations = LocationLog(store, self.node_id, self.epoch, cfg.event_log_keys, cfg.event_log_bytes)
        store.observers.add(self.key_table, self.locations)
        self.lookups = LookupRegions(store)
        self.stats = StatsSource(store, self.node_id, self.epoch, before=self.lookups.fold)
        if self.credentials is not None:
            self.credentials.lookups = self.lookups
            self.credentials.counters = store.counters
        self.transfers = Transfers(store, self.engines)
        self.remote_store = build_remote_store(cfg, store.tiers, store.counters, store.observers)
        if self.remote_store is not None:
            store.remotes.append(self.remote_store)
        if cfg.peers:
            wire = PeerClient(peer_channel_credentials(cfg), cfg.peer_timeout_s, cfg.peer_chunk_bytes)
            self.peers = Peers(cfg.peers, wire, store.counters, read_through=cfg.peer_read_through,
                               timeout_s=cfg.peer_timeout_s, resolve_s=cfg.peer_resolve_s,
                               backoff_max_s=cfg.peer_backoff_max_s, window_bytes=cfg.peer_window_bytes,
                               own_node_id=self.node_id)
            store.remotes.append(self.peers)

    def _tenant_file(self, caller: Principal, path: str) -> int:
        """The credential socket's ``open``: a descriptor of one of the caller's tenant's files."""
        if self.store is None:
            raise StoreError(Code.FAILED_PRECONDITION, "the daemon is still starting")
        return self.store.open_tenant_file(caller.tenant, path)

    async def _serve(self, server: grpc.aio.Server) -> None:
        assert self.store is not None and self.key_table is not None and self.locations is not None
        assert self.transfers is not None and self.stats is not None
        auth = self.auth
        servicers = (NodeService(self.store, self.stats, self.latency, key_table_path=self.key_table.path, auth=auth),
                     LocationsService(self.locations, self.latency, max_subscribers=self.cfg.max_feed_subscribers,
                                      auth=auth, max_tenant_subscribers=self.cfg.tenant_share(
                                          "max_feed_subscribers_per_tenant", self.cfg.max_feed_subscribers)),
                     TransferService(self.transfers, self.latency, auth=auth))
        self.latency.expect(_timed_ops(*servicers))
        health_servicer = add_services(server, *servicers)
        if self.tcp_server is not None:
            peer = PeerService(self.store, self.node_id, self.epoch, self.latency, auth,
                               self.cfg.peer_window_bytes, self.cfg.peer_serve_delay_s) if self.cfg.peer_serve else None
            if peer is not None:
                self.latency.expect(_timed_ops(peer))
            add_tcp_services(self.tcp_server, self.cfg.tcp_services, health_servicer, *servicers, peer=peer)
        self.key_table.start()
        if self.remote_store is not None:
            self.remote_store.start()
        await server.start()
        os.chmod(self.socket_path, self._socket_mode)
        assert self.credentials is not None
        self.credentials.start()
        if self.tcp_server is not None:
            await self.tcp_server.start()
        self.stats.loop = asyncio.get_running_loop()
        self._session_watch = self.stats.loop.create_task(watch_sessions(self.store.device))
        assert self.lookups is not None
        self._lookup_folds = self.stats.loop.create_task(self.lookups.run())
        self._sweeps = self.stats.loop.create_task(self._sweep_again())
        await set_serving(health_servicer)
        if self.peers is not None:
            self.peers.start()
        if self.cfg.metrics_port:
            try:
                self.metrics = start_metrics_server(self.node_id, self.stats.snapshot_from_thread, self.latency,
                                                    self.cfg.metrics_host, self.cfg.metrics_port)
            except OSError as e:   # taken since it was probed
                raise StartupError(f"cannot serve --metrics-port {self.cfg.metrics_host}:"
                                   f"{self.cfg.metrics_port}: {e.strerror}") from None
            self.metrics_port = self.metrics.port

    def _open_kv_events(self) -> KvEventsPublisher | None:
        """The vLLM-format KV event stream of the host and disk tiers, when configured."""
        cfg = self.cfg
        if not (cfg.kv_events_endpoint or cfg.kv_events_replay_endpoint):
            return None
        assert self.store is not None
        try:
            pub = KvEventsPublisher(self.store, self.node_id, cfg.kv_events_endpoint,
                                    cfg.kv_events_replay_endpoint, cfg.kv_events_topic)
        except KvEventsError as e:
            raise StartupError(str(e)) from None
        self.store.observers.add(pub)
        pub.start()
        return pub

    def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()  # after the last change: its batch goes out
            self.kv_events = None

    def _cancel_tasks(self) -> None:
        for task in (self._session_watch, self._lookup_folds, self._sweeps):
            if task is not None:
                task.cancel()
        self._session_watch = self._lookup_folds = self._sweeps = None

    async def _sweep_again(self) -> None:
        """Sweep the shm dir every SWEEP_S: a killed daemon's pool files stay while its clients
        still map them (a file open for writing is never removed), and go once they let go."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await loop.run_in_executor(None, self._sweep)
            except OSError as e:
                log.warning("sweeping the shm dir failed", extra={"shm_dir": self.shm_dir, "error": str(e)})

    async def _close_peers(self) -> None:
        if self.peers is not None:
            await self.peers.close()
            self.peers = None

    async def _close_remote_store(self) -> None:
        if self.remote_store is not None:
            await self.remote_store.close()
            self.remote_store = None

    async def _undo(self) -> None:
        """Remove what a failed start made."""
        await self._close_peers()
        await self._close_remote_store()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self._cancel_tasks()
        if self.locations is not None:
            self.locations.close()
        if self.tcp_server is not None:
            await self.tcp_server.stop(None)
            self.tcp_server = None
        if self.server is not None:
            await self.server.stop(None)
            self.server = None
        if self.credentials is not None:
            await self.credentials.close()
            self.credentials = None
        if self.lookups is not None:
            self.lookups.close()
        if self.transfers is not None:
            await self.transfers.close()
        else:
            for engine in self.engines.values():
                engine.close()
        self._close_kv_events()
        if self.key_table is not None:
            self.key_table.close()
        if self.store is not None:
            self.store.close()
        elif self.disk is not None:
            self.disk.close()
        self._remove_socket()

    def _remove_socket(self) -> None:
        if self._socket_made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    async def stop(self) -> None:
        assert self.store is not None and self.key_table is not None and self.locations is not None
        assert self.transfers is not None
        self._cancel_tasks()
        await self._close_peers()
        self.locations.close()
        if self.server is not None:
            log.info("shutting down", extra={"grace_s": GRACE_S})
            stops = [self.server.stop(GRACE_S)]
            if self.tcp_server is not None:
                stops.append(self.tcp_server.stop(GRACE_S))
            await asyncio.gather(*stops)
            self.server = self.tcp_server = None
        if self.credentials is not None:
            await self.credentials.close()  # each connection's lookup counters folded a last time
            self.credentials = None
        if self.lookups is not None:
            self.lookups.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        await self.transfers.close()
        await self._close_remote_store()
        await self.store.drain()  # requests cut off by the grace period finish their disk and slot work
        self._close_kv_events()
        self.key_table.close()
        self.store.close()
        self._remove_socket()
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

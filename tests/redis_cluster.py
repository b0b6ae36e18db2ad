"""A real Redis Cluster on loopback for tests and benchmarks: 3 masters, no replicas.

``RedisCluster(secure=True)``: TLS only (``port 0``, ``tls-port``, ``tls-cluster yes``,
``tls-replication yes``, ``tls-auth-clients yes``: a client needs a certificate signed by the
test CA) and Redis ACLs (the ``default`` user is off; ``admin`` for the tests' tooling and
``kvtier``, limited to ``kvtier:*`` keys, for the daemons); certificates from tests/pki.py in
the cluster's directory. :meth:`RedisCluster.daemon_args` are the kvtierd flags that reach it.

:class:`RedisCluster` starts ``redis-server`` processes in cluster mode on free loopback
ports (each in its own directory, no persistence), joins them with
``redis-cli --cluster create ... --cluster-yes`` and waits for ``cluster_state:ok``.
``cluster-require-full-coverage no``: when one master dies, the others keep serving their
slots (what the store's failure tests rely on). ``redis_cluster`` is a module-scoped pytest
fixture; it skips only where ``redis-server`` is missing (.ci/run installs it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MISSING = ("redis-server and redis-cli are not installed (apt-get install -y redis-server; .ci/run does); "
           "the shared-store tests need a real Redis Cluster")


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        ports.append(port)
    return ports


class NodeExited(RuntimeError):
    """A redis-server exited while starting (its port was taken, most often)."""


class RedisCluster:
    """See the module docstring. ``nodes`` is the startup list (``127.0.0.1:PORT,...``)."""

    USER = "kvtier"
    ADMIN = "admin"

    def __init__(self, masters: int = 3, maxmemory: str = "512mb", secure: bool = False) -> None:
        assert REDIS_SERVER and REDIS_CLI, MISSING
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.ports = free_ports(masters)
        self.maxmemory = maxmemory
        self.secure = secure
        self.procs: dict[int, subprocess.Popen] = {}
        self.pki = Path(self.dir) / "pki"
        self.password = secrets.token_hex(16) if secure else ""
        self.admin_password = secrets.token_hex(16) if secure else ""
        if secure:
            self._make_pki()

    def _make_pki(self) -> None:
        from pki import make_ca, make_cert

        self.pki.mkdir()
        make_ca(self.pki, "redis-ca")
        make_cert(self.pki, "redis-server", "redis-ca", "redis", "IP:127.0.0.1,DNS:localhost")
        make_cert(self.pki, "kvtier-client", "redis-ca", "kvtierd")
        make_ca(self.pki, "other-ca")  # a CA Redis does not trust
        make_cert(self.pki, "stranger", "other-ca", "kvtierd")
        pw = self.pki / "store-password"
        pw.write_text(self.password + "\n")
        pw.chmod(0o600)

    def file(self, name: str) -> str:
        return str(self.pki / name)

    def daemon_args(self, client: str | None = "kvtier-client", password: str | None = None) -> tuple[str, ...]:
        """kvtierd flags that reach this cluster: over mutual TLS with ``client``'s certificate
        (None: none) as the ACL user ``kvtier`` (``password``: a password file holding this
        instead); plaintext for a cluster that is not secure."""
        if not self.secure:
            return ("--store-redis", self.nodes, "--store-plaintext")
        args = ["--store-redis", self.nodes, "--store-tls-ca", self.file("redis-ca.pem"),
                "--store-user", self.USER, "--store-password-file", self.file("store-password")]
        if client is not None:
            args += ["--store-tls-cert", self.file(f"{client}.pem"), "--store-tls-key", self.file(f"{client}.key")]
        if password is not None:
            other = self.pki / f"password-{secrets.token_hex(4)}"
            other.write_text(password + "\n")
            other.chmod(0o600)
            args[args.index("--store-password-file") + 1] = str(other)
        return tuple(args)

    def client_kwargs(self, admin: bool = True) -> dict:
        """redis-py keyword arguments that reach this cluster (the admin user: any key)."""
        if not self.secure:
            return {}
        return {"ssl": True, "ssl_ca_certs": self.file("redis-ca.pem"), "ssl_certfile": self.file("kvtier-client.pem"),
                "ssl_keyfile": self.file("kvtier-client.key"), "username": self.ADMIN if admin else self.USER,
                "password": self.admin_password if admin else self.password}

    def client(self):  # noqa: ANN201
        """A redis-py cluster client (the admin user); close it after use."""
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as Client

        return Client(startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports], **self.client_kwargs())

    def cli_args(self) -> list[str]:
        """redis-cli and its TLS and AUTH options (the admin user)."""
        assert REDIS_CLI is not None
        if not self.secure:
            return [REDIS_CLI]
        return [REDIS_CLI, "--tls", "--cacert", self.file("redis-ca.pem"), "--cert", self.file("kvtier-client.pem"),
                "--key", self.file("kvtier-client.key"), "--user", self.ADMIN, "--pass", self.admin_password,
                "--no-auth-warning"]

    @property
    def nodes(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 20.0) -> RedisCluster:
        try:
            for attempt in range(3):  # a port taken between free_ports and the bind: new ports
                for port in self.ports:
                    self._start_node(port)
                try:
                    for port in self.ports:
                        self._wait_ping(port, timeout)
                    break
                except NodeExited:
                    if attempt == 2:
                        raise
                    self._stop_nodes()
                    self.procs = {}
                    self.ports = free_ports(len(self.ports))
            out = subprocess.run([*self.cli_args(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                                  "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, port: int) -> None:
        d = os.path.join(self.dir, str(port))
        os.makedirs(d, exist_ok=True)
        conf = os.path.join(d, "redis.conf")
        with open(conf, "w") as fh:
            if self.secure:
                fh.write(f"port 0\ntls-port {port}\ntls-cluster yes\ntls-replication yes\n"
                         f"tls-auth-clients yes\ntls-cert-file {self.file('redis-server.pem')}\n"
                         f"tls-key-file {self.file('redis-server.key')}\n"
                         f"tls-ca-cert-file {self.file('redis-ca.pem')}\n"
                         f"user default off\n"
                         f"user {self.ADMIN} on >{self.admin_password} ~* &* +@all\n"
                         f"user {self.USER} on >{self.password} ~kvtier:* resetchannels -@all +@read +@write "
                         f"+@connection -@dangerous +cluster|slots +cluster|shards +cluster|nodes +cluster|info "
                         f"+cluster|keyslot +command +info\n")
            else:
                fh.write(f"port {port}\n")
        os.chmod(conf, 0o600)
        args = [REDIS_SERVER, conf, "--bind", "127.0.0.1", "--dir", d,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--logfile", os.path.join(d, "redis.log")]
        assert REDIS_SERVER is not None
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        assert REDIS_CLI is not None
        out = subprocess.run([*self.cli_args(), "-h", "127.0.0.1", "-p", str(port), *args],
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout.strip()

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[port]
            if proc.poll() is not None:
                log = os.path.join(self.dir, str(port), "redis.log")
                tail = open(log, errors="replace").read()[-400:] if os.path.exists(log) else ""
                raise NodeExited(f"redis-server on port {port} exited with {proc.returncode}: {tail}")
            try:
                if self.cli(port, "ping", timeout=2) == "PONG":
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {port} did not answer PING within {timeout}s")

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in self.ports):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the Redis Cluster on ports {self.ports} did not reach cluster_state:ok in {timeout}s")

    def port_of(self, key: bytes | str) -> int:
        """The port of the master that serves ``key``'s slot."""
        k = key.decode() if isinstance(key, bytes) else key
        slot = int(self.cli(self.ports[0], "cluster", "keyslot", k))
        for line in self.cli(self.ports[0], "cluster", "nodes").splitlines():
            parts = line.split()
            addr = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for rng in parts[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return addr
        raise LookupError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one master (its slots become unreachable; the others keep serving)."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def flush(self) -> None:
        for port, proc in self.procs.items():
            if proc.poll() is None:
                self.cli(port, "flushall")

    def stop(self) -> None:
        self._stop_nodes()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_nodes(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cluster_fixture(secure: bool = True) -> Iterator[RedisCluster]:
    """The body of a module-scoped fixture: a started cluster (TLS and ACLs unless ``secure``
    is False), stopped after the module."""
    import pytest

    if not (REDIS_SERVER and REDIS_CLI):
        pytest.skip(MISSING)
    cluster = RedisCluster(secure=secure).start()
    try:
        yield cluster
    finally:
        cluster.stop()

"""A real Redis Cluster on loopback for tests and benchmarks: 3 masters, no replicas.

:class:`RedisCluster` starts ``redis-server`` processes in cluster mode on free loopback
ports (each in its own directory, no persistence), joins them with
``redis-cli --cluster create ... --cluster-yes`` and waits for ``cluster_state:ok``.
``cluster-require-full-coverage no``: when one master dies, the others keep serving their
slots (what the store's failure tests rely on). ``redis_cluster`` is a module-scoped pytest
fixture; it skips only where ``redis-server`` is missing (.ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

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


class RedisCluster:
    """See the module docstring. ``nodes`` is the startup list (``127.0.0.1:PORT,...``)."""

    def __init__(self, masters: int = 3, maxmemory: str = "512mb") -> None:
        assert REDIS_SERVER and REDIS_CLI, MISSING
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.ports = free_ports(masters)
        self.maxmemory = maxmemory
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def nodes(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 20.0) -> RedisCluster:
        try:
            for port in self.ports:
                self._start_node(port)
            for port in self.ports:
                self._wait_ping(port, timeout)
            out = subprocess.run([REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
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
        args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", d,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--logfile", os.path.join(d, "redis.log")]
        assert REDIS_SERVER is not None
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        assert REDIS_CLI is not None
        out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout.strip()

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[port]
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
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
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster_fixture() -> Iterator[RedisCluster]:
    """The body of a module-scoped fixture: a started cluster, stopped after the module."""
    import pytest

    if not (REDIS_SERVER and REDIS_CLI):
        pytest.skip(MISSING)
    cluster = RedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()

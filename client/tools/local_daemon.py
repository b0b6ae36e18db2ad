"""Start a real kvtierd subprocess on a private socket and tmpfs directory.

Used by `kvtier demo`, the benchmarks and the integration tests (a real daemon, no mocks), with
the measurements they take of it (:func:`rss_bytes`, :func:`tmpfs_bytes`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@contextlib.contextmanager
def shm_tempdir() -> Iterator[str]:
    """A fresh directory in /dev/shm (tmpfs, as a host tier's pool and key table need), removed
    on the way out, whatever happens in between."""
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class DaemonProcess:
    """A kvtierd subprocess on a private unix socket and a private tmpfs directory."""

    def __init__(self, workdir: str, *args: str, env: dict[str, str] | None = None, shm_dir: str | None = None,
                 host_capacity: str = "256MiB", name: str = "kvtierd") -> None:
        self.workdir = workdir
        self.socket = os.path.join(workdir, f"{name}.sock")
        self._own_shm = shm_dir is None
        self.shm_dir = shm_dir or tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.args = ["--socket", self.socket, "--shm-dir", self.shm_dir, "--host-capacity", host_capacity,
                     "--log-format", "json", *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon.main", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        wait_healthy(f"unix:{self.socket}", timeout, self.proc, self.log_path)
        return self

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def logs(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def cleanup(self) -> None:
        self.kill()
        if self._own_shm:
            shutil.rmtree(self.shm_dir, ignore_errors=True)


def wait_healthy(target: str, timeout: float, proc: subprocess.Popen | None = None, log_path: str = "") -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc is not None and proc.poll() is not None:
                out = open(log_path).read() if log_path else ""
                raise RuntimeError(f"kvtierd exited with {proc.returncode} during start:\n{out}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtierd at {target} not healthy after {timeout} s")
            time.sleep(0.05)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory from /proc/PID/status: ``VmRSS`` (all of it, pages of shared
    tmpfs files it has touched included), or ``RssAnon`` (its private memory only)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def tmpfs_bytes(paths: Sequence[str]) -> int:
    """Memory actually allocated to these tmpfs files (st_blocks), not their sparse size."""
    return sum(os.stat(p).st_blocks * 512 for p in paths)

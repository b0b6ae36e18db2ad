"""A real Mooncake Store on loopback for tests and benchmarks: one ``mooncake_master``.

:class:`MooncakeMaster` starts the ``mooncake_master`` binary of the
``mooncake-transfer-engine-non-cuda`` wheel on free loopback ports (its RPC port, its metrics
port and its HTTP metadata server), waits for the RPC port and stops it at the end. Clients
(the daemons, :meth:`MooncakeMaster.client`) bring the memory: each mounts a segment.
``mooncake_fixture`` is the body of a module-scoped pytest fixture; it skips, saying why,
where the wheel (or the libibverbs1 / libnuma1 it loads) is missing.
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


def _missing() -> str:
    """Why the Mooncake Store cannot run here ("" where it can)."""
    try:
        from kvtier.daemon.mooncake_store import load_client

        load_client()
    except ImportError as e:
        return str(e)
    return ""


def master_binary() -> str:
    import mooncake

    return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """See the module docstring. ``master`` and ``metadata`` are what clients are given."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtier-mooncake-")
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self._clients: list = []

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        log = open(os.path.join(self.dir, "master.log"), "wb")
        self.proc = subprocess.Popen(
            [master_binary(), f"-port={self.port}", "-rpc_address=127.0.0.1", "-metrics_host=127.0.0.1",
             f"-metrics_port={self.metrics_port}", "-enable_http_metadata_server=true",
             "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={self.http_port}"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        for port in (self.port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.logs()}")
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"mooncake_master did not listen on {port} within {timeout}s") from None
                    time.sleep(0.05)
        return self

    def logs(self) -> str:
        with open(os.path.join(self.dir, "master.log"), errors="replace") as fh:
            return fh.read()

    def daemon_args(self, segment: str = "64MiB", buffer: str = "32MiB") -> tuple[str, ...]:
        """kvtierd flags that make this store its shared store."""
        return ("--store-backend", "mooncake", "--store-mooncake-master", self.master,
                "--store-mooncake-metadata", self.metadata, "--store-plaintext",
                "--store-mooncake-segment-bytes", segment, "--store-mooncake-buffer-bytes", buffer)

    def client(self):  # noqa: ANN201 (mooncake.store.MooncakeDistributedStore)
        """A plain Mooncake client (no segment of its own), closed at :meth:`stop`."""
        from kvtier.daemon.mooncake_store import load_client

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        c = load_client()()
        rc = c.setup("127.0.0.1", self.metadata, 0, 16 * 1024**2, "tcp", "", self.master)
        assert rc == 0, f"Mooncake client setup failed: {rc}"
        self._clients.append(c)
        return c

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self._clients = []
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def mooncake_fixture() -> Iterator[MooncakeMaster]:
    """The body of a module-scoped fixture: a started master, stopped after the module."""
    import pytest

    why = _missing()
    if why:
        pytest.skip(f"no Mooncake Store here: {why}")
    master = MooncakeMaster().start()
    try:
        yield master
    finally:
        master.stop()

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from kvtier.client.tools.local_daemon import DaemonProcess, shm_tempdir


@pytest.fixture
def start_daemon(tmp_path) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory: ``start_daemon("--disk-dir", d, host_capacity="64MiB")`` -> a running kvtierd."""
    started: list[DaemonProcess] = []

    def start(*args: str, name: str = "kvtierd", **kw) -> DaemonProcess:
        d = DaemonProcess(str(tmp_path), *args, name=name, **kw)
        started.append(d)  # cleaned up even when it fails to start
        return d.start()

    yield start
    for d in started:
        d.cleanup()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory in /dev/shm (tmpfs, as a host tier's pool and key table need), removed
    after the test."""
    with shm_tempdir() as d:
        yield d


@pytest.fixture
def shm(shm_dir) -> str:
    return shm_dir


@pytest.fixture
def shared_dir():
    """A socket directory other users can reach (0711 under /tmp: pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="kvtier-sec-", dir="/tmp")
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)

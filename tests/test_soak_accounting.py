"""The soak's capacity accounting (bench/soak.py ``Harness.full_check``) against a real kvtierd
whose background disk writes are held in flight.

The daemon writes host blocks to disk in the background (victims within its write queue's
room, the write-ahead window); a disk slot is in use (Stats' ``used_bytes``) from the moment
such a write is planned, before its block counts in ``blocks``. Here the disk tier lives on the
soak's own small ext4 filesystem, frozen (``fsfreeze``) while host victims are demoted, so
their writes wait with their slots in use: exactly what a check met when its own sweep had just
started some. The check must read the accounting once those writes are over (the filesystem
is thawed right after the check's first Stats reading), and must report writes that never end.
Needs root (a loop mount, fsfreeze): skipped without."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _wait import wait_for

ROOT = Path(__file__).resolve().parent.parent
HOST_SLOTS = 128  # --host-mib 2 of 16 KiB blocks


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_bench_soak", ROOT / "bench" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _freeze(path: str, on: bool) -> bool:
    return subprocess.run(["fsfreeze", "--freeze" if on else "--unfreeze", path], capture_output=True,
                          timeout=60).returncode == 0


def _in_flight(st: dict) -> int:
    c = st["counters"]
    return c.get("demotions_staged", 0) - c.get("demotions_staged_over", 0)


class _ThawAfterStats:
    """The harness's Sidecar (delegated to), but its first Stats reading thaws the disk after
    it is taken: the reading sees the writes in flight, the ones after may not."""

    def __init__(self, sc: Any, thaw: Any) -> None:
        self._sc, self._thaw = sc, thaw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sc, name)

    def stats(self) -> dict:
        st = self._sc.stats()
        self._thaw()
        return st


@pytest.fixture
def frozen() -> Iterator[tuple[Any, Any]]:
    """A soak harness with a running daemon, its disk filesystem frozen while host victims are
    being written to it (their writes in flight); thawed and torn down afterwards."""
    soak = _soak()
    ns = soak.parse_args(["--clients", "1", "--subscribers", "0", "--transfer-clients", "0", "--host-mib", "2",
                          "--disk-mib", "16", "--disk-fs-mib", "64", "--shared-keys", "512",
                          "--durable-per-client", "4"])
    h = soak.Harness(ns)
    thawed = [False]

    def thaw() -> None:
        if not thawed[0]:
            thawed[0] = True
            _freeze(h.disk.dir, False)

    try:
        if not h.disk.mounted or h.disk.tmpfs:
            pytest.skip(f"the disk tier needs its own ext4 filesystem to freeze: {h.disk.how}")
        h.start_daemon()
        sc = h.sidecar()
        lid, block = h.lid, h.block
        first = soak.durable_key(0, 0)  # the disk's slab file is made now, not while frozen
        assert sc.put(lid, [first], [soak.derive(first, block)], durable=True).durable == 1
        keys = [soak.shared_key(i) for i in range(HOST_SLOTS + 64)]
        for i in range(0, HOST_SLOTS, 8):  # host full
            sc.put(lid, keys[i:i + 8], [soak.derive(k, block) for k in keys[i:i + 8]])
        wait_for(lambda: _in_flight(sc.stats()) == 0, 60, "the write-ahead of a full host to end")
        if not _freeze(h.disk.dir, True):
            pytest.skip("fsfreeze of the soak's disk filesystem failed")
        for i in range(HOST_SLOTS, len(keys), 8):  # victims: demoted in the background, held by the freeze
            sc.put(lid, keys[i:i + 8], [soak.derive(k, block) for k in keys[i:i + 8]])

        def held() -> dict | None:
            st = sc.stats()
            disk = st["tiers"]["disk"]
            return st if _in_flight(st) and disk["used_bytes"] > disk["blocks"] * block else None

        wait_for(held, 60, "disk writes held in flight, their slots in use")
        yield h, thaw
    finally:
        thaw()
        h.close()


def test_the_accounting_is_read_once_the_disk_writes_in_flight_are_over(frozen) -> None:
    h, thaw = frozen
    h.sc = _ThawAfterStats(h.sc, thaw)
    h.full_check(final=True)
    assert h.report["checks"] == 1
    assert h.report["accounting_errors"] == 0, h.report["findings"]


def test_disk_writes_that_never_end_are_an_accounting_error(frozen) -> None:
    h, _thaw = frozen
    h.settle_s = 1.0  # the filesystem stays frozen: the writes stay in flight
    h.full_check(final=True)
    assert h.report["accounting_errors"] == 1, h.report["findings"]
    assert "still in flight" in h.report["findings"][0], h.report["findings"]

"""A short soak in CI: bench/soak.py for about 20 s with 2 kill -9 of the daemon, a full and a
slow disk, clients killed and stopped, a subscriber that stops reading; its JSON must show
no lost durable block, no corrupt byte served, exact accounting, no leaked fd or file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def soak() -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "10", "--transfer-clients", "1",
           "--subscribers", "2", "--duration", "20", "--kills", "2", "--check-s", "7", "--grant-ttl-s", "1.5",
           "--seed", os.environ.get("KVTIER_SOAK_SEED", "3")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_short_soak_loses_and_corrupts_nothing(soak: dict) -> None:
    assert soak["kills"] == 2
    assert soak["ops"] > 1000 and soak["blocks_verified"] > 1000, soak
    assert soak["durable_checked"] > 0, soak
    zeros = {k: soak[k] for k in ("lost_durable", "corrupt_served", "accounting_errors", "fd_growth")}
    assert zeros == dict.fromkeys(zeros, 0), (zeros, soak["findings"])
    assert soak["faults"]["disk_fill"].startswith("filled"), soak["faults"]  # mounted: the disk did fill
    assert soak["late_commit_accepted"] == 0, soak["findings"]


@pytest.mark.xfail(reason="issue 14 item 6: a killed daemon's pool file stays in the shm dir until the "
                          "fixes branch removes it at restart", strict=False)
def test_the_short_soak_leaves_no_file_of_a_dead_daemon(soak: dict) -> None:
    assert soak["leaked_files"] == 0, soak["findings"]

"""A short soak in CI: bench/soak.py for about 20 s with 2 kill -9 of the daemon, a full and a
slow disk, clients killed, a subscriber that stops reading; its JSON must show no lost
durable block, no corrupt byte served, exact accounting, no leaked fd or file. On a busy
machine the run's clock starts once every client runs, and the run goes on until the clients
did 1001 operations (``--min-ops``): a slower run, not a smaller one.

A client is stopped past its grants' expiry (``--client-stops 1``) and resumed: its late writes
must land nowhere (an expired grant's slot is withheld until the client names it again or its
session ends; test_stale_grant_writes_land_nowhere below checks it deterministically).

The same soak with hostile clients beside the normal ones (``--attackers 2``: descriptor
hoarding, silent connections on both sockets, RegisterKV spam, planted shm names, oversized
and deeply nested credential messages; bench/soak_attackers.py): the normal clients see no error
beyond those the soak's own faults answer, and the zeros hold in its quiet phase and its
attacked phase. Its latency against the quiet phase is the benchmark's to print, not a test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _wait import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def soak() -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "10", "--transfer-clients", "1",
           "--subscribers", "2", "--duration", "20", "--kills", "2", "--check-s", "7", "--grant-ttl-s", "1.5",
           "--client-stops", "1", "--min-ops", "1001", "--seed", os.environ.get("KVTIER_SOAK_SEED", "3")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_short_soak_loses_and_corrupts_nothing(soak: dict) -> None:
    assert soak["kills"] == 2
    assert soak["ops"] > 1000 and soak["blocks_verified"] > 1000, soak
    assert soak["durable_checked"] > 0, soak
    zeros = {k: soak[k] for k in ("lost_durable", "corrupt_served", "accounting_errors", "fd_growth")}
    assert zeros == dict.fromkeys(zeros, 0), (zeros, soak["findings"])
    if os.geteuid() != 0 and not soak["faults"]["disk_fill"].startswith("filled"):
        pytest.xfail(f"the full-disk fault needs root to mount a small filesystem: {soak['faults']['disk_fill']}")
    assert soak["faults"]["disk_fill"].startswith("filled"), soak["faults"]  # mounted: the disk did fill
    assert soak["late_commit_accepted"] == 0, soak["findings"]


def test_the_short_soak_leaves_no_file_of_a_dead_daemon(soak: dict) -> None:
    assert soak["leaked_files"] == 0, soak["findings"]


ZEROS = ("lost_durable", "corrupt_served", "accounting_errors", "leaked_files", "fd_growth")


def test_the_short_soak_under_attack_keeps_its_clients_whole() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "10", "--transfer-clients", "1",
           "--subscribers", "2", "--duration", "10", "--kills", "1", "--check-s", "7", "--grant-ttl-s", "1.5",
           "--client-stops", "1", "--min-ops", "501", "--attackers", "2",
           "--seed", os.environ.get("KVTIER_SOAK_SEED", "3")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    soak = json.loads(out.stdout.strip().splitlines()[-1])
    quiet = soak["quiet_phase"]
    assert soak["kills"] == 1 and quiet["kills"] == 1, soak["faults"]
    assert soak["ops"] > 500 and quiet["ops"] > 500, soak
    assert soak["attacker_ops"] > 0, soak["attacker_errors"]
    answers = soak["attacker_answers"]
    assert any(k.endswith(":INVALID_ARGUMENT") for k in answers), answers  # an attack got to its refusal
    assert soak["victim_errors"] == 0, (soak["errors"], soak["findings"])
    zeros = {k: soak[k] for k in ZEROS}
    assert zeros == dict.fromkeys(ZEROS, 0), (zeros, soak["findings"])
    zeros = {k: quiet[k] for k in ZEROS}
    assert zeros == dict.fromkeys(ZEROS, 0), (zeros, quiet["findings"])
    assert soak["late_commit_accepted"] == 0, soak["findings"]


def test_stale_grant_writes_land_nowhere(start_daemon) -> None:
    """A client granted a slot stops (SIGSTOP, a long GC pause) past --grant-ttl-s; its grant
    expires (waited for: the daemon counts it in grants_withheld) and its slot is withheld.
    Another client puts a block. The first client resumes, writes its bytes into the slot it
    was granted and commits (refused): the other client's committed block must not change."""
    import numpy as np

    from kvtier.client import Sidecar
    from kvtier.proto import node_pb2
    from kvtier.tiers.layout import Layout

    daemon = start_daemon("--grant-ttl-s", "1")
    layout = Layout.flat(4096)
    with Sidecar(daemon.socket) as late, Sidecar(daemon.socket) as other:
        lid = late.register_layout(layout)
        other.register_layout(layout)
        sid = late._ensure_session()
        grant = late._stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=lid, keys=[b"L" * 16]),
                                    timeout=10).grants[0]
        assert grant.status == node_pb2.GRANTED
        wait_for(lambda: other.stats()["counters"]["grants_withheld"] >= 1, 60,
                 "the grant to expire (--grant-ttl-s, 1 s here) and its slot to be withheld")
        other.put(lid, [b"O" * 16], [np.full(4096, 7, np.uint8)])
        pool = late._info(lid).pool
        pool.arr[grant.offset:grant.offset + 4096] = 9  # the late write, through the slot it was granted
        try:
            late._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=[grant.grant_id]), timeout=10)
        except Exception as e:  # refused: DEADLINE_EXCEEDED
            assert "expired" in str(e)
        got = other.get(lid, [b"O" * 16])[0]
        assert got is not None and bytes(got) == bytes([7]) * 4096, "a stale grant's write changed another block"

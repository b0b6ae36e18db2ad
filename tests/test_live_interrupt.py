"""Ctrl-C quits ``kvtier report`` and ``kvtier measure`` live mode even when it lands inside a
poll's RPC. A KeyboardInterrupt raised inside a blocking gRPC call leaves the call in flight,
and closing the channel then could hang (grpc/grpc#19973; both live-mode tests timed out once
in CI under load). The daemon here is a real kvtierd stopped with SIGSTOP, so every poll's RPC
is in flight for its whole ``--timeout`` when SIGINT arrives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvtier.client.tools.local_daemon import DaemonProcess


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    d = DaemonProcess(str(tmp_path_factory.mktemp("frozen")), host_capacity=str(16 << 20), name="frozen").start()
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        yield d
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.cleanup()


@pytest.mark.parametrize("tool", ["report", "measure"])
def test_ctrl_c_inside_an_rpc_quits_within_one_poll(frozen, tool) -> None:
    p = subprocess.Popen([sys.executable, "-m", "kvtier.client.tools.cli", tool, "--daemons", frozen.socket,
                          "--interval", "0.2", "--timeout", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(6)  # started (imports), and inside a poll's 4 s RPC (the first one, or the second)
        for _ in range(3):  # Ctrl-C pressed three times, as an impatient user does
            p.send_signal(signal.SIGINT)
            time.sleep(0.3)
        out, err = p.communicate(timeout=15)  # one poll (4 s) at most, then the channel closes
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err.decode(errors="replace")[-2000:]
    assert f"kvtier {tool}".encode() in out
    assert b"Traceback" not in err, err.decode(errors="replace")[-2000:]

"""The key table's liveness check under scheduling delays, on a real kvtierd.

A daemon that is not scheduled for longer than the table's stale limit (a busy machine; here a
SIGSTOP) is late, not gone: its session streams stay open, so the sidecar keeps answering from
its table (the table cannot change while its writer does not run). Only once the daemon is
really gone (killed: the kernel closes its streams) does the sidecar stop trusting the table,
and every lookup the table could not answer is counted."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from kvtier.client import Sidecar
from kvtier.client.engine.transport import KvtierError
from kvtier.tiers.keytable import STALE_NS
from kvtier.tiers.layout import Layout


def test_a_stalled_daemon_keeps_its_table_and_a_dead_one_loses_it(daemon) -> None:
    layout = Layout.flat(4096)
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    with Sidecar(daemon.socket, timeout=1.0) as sc:
        lid = sc.register_layout(layout)
        sc.put(lid, keys, [np.full(4096, i, np.uint8) for i in range(8)])
        assert sc.lookup(lid, keys) == ["host"] * 8
        table = sc._info(lid).table
        assert table is not None
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(STALE_NS / 1e9 + 0.5)  # the heartbeat is now stale
            # the daemon cannot answer an RPC now: only the table can, and it must
            assert sc.lookup(lid, keys) == ["host"] * 8
            assert sc.prefix_length(lid, keys) == (8, 8)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert sc._info(lid).table is table
        assert getattr(table, "stale_tolerated", 0) >= 1
        assert getattr(sc, "table_fallbacks", 0) == 0
        daemon.kill()  # really gone: the session stream ends, the table is no longer read
        deadline = time.monotonic() + 10
        while not sc._transport.session.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            sc.lookup(lid, keys)
            raise AssertionError("a dead daemon's table answered")
        except KvtierError as e:
            assert e.code.name == "UNAVAILABLE", e
        assert sc._info(lid).table is None

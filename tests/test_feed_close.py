"""Closing a router whose feeds are streaming fast: its streams end before its loop closes, so
no late gRPC completion is handed to the closed loop (which the next loop that polls gRPC would
report as "Event loop is closed"). A real flooding Locations server (tests/flood_feed.py, its
own process) feeds routers that are started and closed one after another in this process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from _wait import wait_for
from redis_cluster import free_ports

from kvtier.client.routing.router import Router, RouterConfig

HERE = os.path.dirname(__file__)


FEEDS = 4


@pytest.fixture
def flood():
    ports = free_ports(FEEDS)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "flood_feed.py"), str(port), f"F{i}"],
                              stdout=subprocess.PIPE, text=True) for i, port in enumerate(ports)]
    try:
        for proc in procs:
            assert proc.stdout.readline().startswith("listening"), "flood feed did not start"
        yield tuple(f"127.0.0.1:{port}" for port in ports)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_closing_a_router_mid_stream_leaves_no_completion_for_its_closed_loop(flood, caplog) -> None:
    cfg = RouterConfig(daemons=flood, reconnect_min_s=0.05, reconnect_max_s=0.3)
    caplog.set_level(logging.ERROR, logger="asyncio")
    for _ in range(6):  # each router's loop polls gRPC while the one before it has closed
        r = Router(cfg).start()
        try:
            wait_for(lambda r=r: len(st := r.status()) == FEEDS and all(s.connected and s.seq for s in st), timeout=30,
                     what="the floods streaming")
        finally:
            r.close()
    late = [rec.getMessage() + str(rec.exc_info) for rec in caplog.records if rec.name == "asyncio"]
    assert not late, late[:3]

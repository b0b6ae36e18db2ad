"""The router's first hour: what a new user of ``Router`` and
``kvtier route-server`` runs into, against real kvtierd subprocesses and the route-server as a
real subprocess.

* ``Router(...).start()`` then ``route`` right away has no workers yet: ``start(wait_s=...)``
  waits for the feeds, and says which feed did not catch up and why;
* a ``--daemon`` given as a plain path is a unix socket (gRPC took it for a DNS name);
* an unreachable daemon is one clear log line naming it and the reason;
* with neither ``--daemon`` nor ``--dns`` the route-server follows this node's kvtierd, and
  ``kvtier report`` without ``--daemons`` reports it;
* ``--help`` is plain text and says how dispatch defaults and where the stubs are;
* candidates naming workers the router does not know are refused (INVALID_ARGUMENT naming
  them) and never ranked or remembered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.routing.feed import feed_target
from kvtier.client.routing.router import Router, RouterConfig, RouterError, UnknownCandidates
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import router_pb2, router_pb2_grpc
from kvtier.tiers.layout import Layout

LAYOUT = Layout.flat(4096, 16)
KEYS = block_keys(list(range(16 * 6)), 16, Namespace("first-hour"))


def wait_for(pred: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


def put_keys(d: DaemonProcess, keys: list[bytes]) -> None:
    with Sidecar(d.socket) as sc:
        assert not sc.put(sc.register_layout(LAYOUT), keys, [bytes(4096)] * len(keys)).dropped


class RouteServer:
    """``kvtier route-server`` as a subprocess on a unix socket in ``tmp_path``."""

    def __init__(self, tmp_path, *args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.sock = str(tmp_path / "router.sock")
        self.log_path = tmp_path / "router.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"unix:{self.sock}",
                 "--reconnect-max-s", "0.3", *args],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
        wait_for(lambda: os.path.exists(self.sock) or self.proc.poll() is not None, what="route-server socket")
        assert self.proc.poll() is None, self.log()
        self.channel = grpc.insecure_channel(f"unix:{self.sock}")
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text()

    def status(self) -> router_pb2.RouterStatusReply:
        return self.stub.Status(router_pb2.RouterStatusRequest(), timeout=5)

    def synced(self) -> bool:
        feeds = self.status().feeds
        return bool(feeds) and all(f.connected and f.seq >= f.head_seq and f.epoch for f in feeds)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(20) == 0, self.log()


@pytest.fixture
def route_server(tmp_path):
    started: list[RouteServer] = []

    def start(*args: str, **kw) -> RouteServer:
        rs = RouteServer(tmp_path, *args, **kw)
        started.append(rs)
        return rs

    yield start
    for rs in started:
        rs.close()


# -- Router.start(wait_s=...) ------------------------------------------------------------------

def test_start_can_wait_until_the_feeds_caught_up(daemon) -> None:
    """The README's ``Router(...).start()`` then ``route(keys)`` raised "no workers to route
    to": nothing had been heard yet. ``start(wait_s=...)`` returns a router that routes."""
    put_keys(daemon, KEYS)
    with Router(RouterConfig(daemons=(daemon.socket,))).start(wait_s=15) as r:
        d = r.route(KEYS)
        assert d.worker and d.ranked[0].overlap.host == len(KEYS)
        assert r.finish(d.decision_id)


def test_start_names_the_feed_that_did_not_catch_up_and_why(tmp_path) -> None:
    missing = str(tmp_path / "no-daemon.sock")
    t0 = time.monotonic()
    with pytest.raises(RouterError) as e:
        Router(RouterConfig(daemons=(missing,), reconnect_max_s=0.2)).start(wait_s=1.0)
    assert time.monotonic() - t0 < 10
    assert f"unix:{missing}" in str(e.value) and "No such file" in str(e.value), str(e.value)


# -- plain socket paths ------------------------------------------------------------------------

def test_feed_target_takes_plain_paths_as_unix_sockets(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.sock").touch()
    assert feed_target("/run/kvtier/kvtierd.sock") == "unix:/run/kvtier/kvtierd.sock"
    assert feed_target("./a.sock") == f"unix:{tmp_path}/a.sock"
    assert feed_target("here.sock") == f"unix:{tmp_path}/here.sock"      # an existing file
    assert feed_target("~/k.sock") == f"unix:{os.path.expanduser('~')}/k.sock"
    for kept in ("unix:/x.sock", "node7:7070", "10.0.0.7:7070", "[::1]:7070", "dns:///kvtierd.svc:7070"):
        assert feed_target(kept) == kept


def test_route_server_takes_a_plain_socket_path(start_daemon, route_server, tmp_path) -> None:
    """``--daemon /path.sock`` (no ``unix:``) was resolved as a DNS name and only logged
    "feed dropped; reconnecting"; ``./relative.sock`` too."""
    a = start_daemon("--node-id", "A", name="A")
    b = start_daemon("--node-id", "B", name="B")
    put_keys(a, KEYS)
    rs = route_server("--daemon", a.socket, "--daemon", "./B.sock", cwd=str(tmp_path))
    wait_for(rs.synced, what="both feeds connected")
    assert sorted(f.target for f in rs.status().feeds) == [f"unix:{a.socket}", f"unix:{b.socket}"]
    reply = rs.stub.Route(router_pb2.RouteRequest(keys=KEYS), timeout=5)
    assert reply.ranked[0].node_id == "A" and reply.ranked[0].overlap.host == len(KEYS)


def test_an_unreachable_daemon_is_one_clear_log_line(route_server, tmp_path) -> None:
    """The log said only "feed dropped; reconnecting": no target, no reason (those were in
    fields the route-server's log format does not show, and in the Status RPC)."""
    missing = str(tmp_path / "nothing-here.sock")
    rs = route_server("--daemon", f"unix:{missing}", "--daemon", "no-such-host.invalid:7070")
    wait_for(lambda: all(f.last_error for f in rs.status().feeds), what="both feeds to fail")
    time.sleep(1.0)  # several retries: still one line per feed
    # one warning per feed; counted by its text, not by line: the server's stdout ("listening
    # on ..., following <targets>") shares the log file and can land glued to a warning line
    log = rs.log()
    unix_lines = [ln for ln in log.split("WARNING")[1:] if f"cannot reach kvtierd at unix:{missing}" in ln]
    dns_lines = [ln for ln in log.split("WARNING")[1:] if "cannot reach kvtierd at no-such-host.invalid:7070" in ln]
    assert len(unix_lines) == 1 and "cannot reach kvtierd" in unix_lines[0], log
    assert "No such file or directory" in unix_lines[0] and "is kvtierd running" in unix_lines[0]
    assert len(dns_lines) == 1 and "cannot reach kvtierd" in dns_lines[0], log


def test_a_taken_listen_port_is_a_clear_error_not_a_traceback(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "kvtier.client.routing.route_server", "--listen",
                            f"127.0.0.1:{port}", "--daemon", str(tmp_path / "k.sock")],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"kvtier route-server: cannot listen on 127.0.0.1:{port} (port taken?" in p.stderr


# -- the local daemon by default ----------------------------------------------------------------

def test_route_server_follows_the_local_daemon_by_default(daemon, route_server) -> None:
    """With neither --daemon nor --dns it follows the local daemon (``KVTIER_SOCKET``)."""
    put_keys(daemon, KEYS)
    rs = route_server(env={"KVTIER_SOCKET": daemon.socket})
    wait_for(rs.synced, what="the local daemon's feed")
    assert [f.target for f in rs.status().feeds] == [f"unix:{daemon.socket}"]
    assert f"following unix:{daemon.socket}" in rs.log()


def test_report_reports_the_local_daemon_by_default(daemon) -> None:
    """``kvtier report`` required --daemons."""
    p = subprocess.run([sys.executable, "-m", "kvtier.client.tools.cli", "report", "--once", "--json"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "KVTIER_SOCKET": daemon.socket})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert [n["target"] for n in out["nodes"]] == [daemon.socket] and out["nodes"][0]["reachable"]


# -- --help ------------------------------------------------------------------------------------

def test_route_server_help_is_plain_text_and_says_what_a_gateway_needs() -> None:
    p = subprocess.run([sys.executable, "-m", "kvtier.client.routing.route_server", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    text = p.stdout
    for markup in ("``", ":class:", ":meth:", ":func:", ":data:"):
        assert markup not in text, f"--help shows {markup}"
    flat = " ".join(text.split())
    assert "from kvtier.proto import router_pb2, router_pb2_grpc" in flat
    assert "dispatch is a proto3 bool and so FALSE unless set" in flat
    assert "Router.route(keys) dispatches by default" in flat
    assert "$KVTIER_SOCKET" in flat


# -- candidates --------------------------------------------------------------------------------

def test_unknown_candidates_are_refused_and_not_remembered(start_daemon, route_server) -> None:
    """A typo in ``candidates`` was ranked (as a worker holding nothing) and stayed in
    ``Status().workers`` for good."""
    a = start_daemon("--node-id", "A", name="A")
    b = start_daemon("--node-id", "B", name="B")
    put_keys(b, KEYS)
    rs = route_server("--daemon", f"unix:{a.socket}", "--daemon", f"unix:{b.socket}")
    wait_for(rs.synced, what="both feeds")
    wait_for(lambda: len(rs.status().workers) == 2, what="both workers")
    for cands in (["A", "Bee"], ["Bee", "Cee"]):
        with pytest.raises(grpc.RpcError) as e:
            rs.stub.Route(router_pb2.RouteRequest(keys=KEYS, candidates=cands, dispatch=True), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'Bee'" in e.value.details() and "known workers: A, B" in e.value.details()
    assert sorted(rs.status().workers) == ["A", "B"]
    ok = rs.stub.Route(router_pb2.RouteRequest(keys=KEYS, candidates=["A", "B"]), timeout=5)
    assert [x.worker_id for x in ok.ranked] == ["B", "A"]
    assert rs.stub.Route(router_pb2.RouteRequest(keys=KEYS), timeout=5).ranked[0].active_requests == 0


def test_router_refuses_unknown_candidates_in_python(daemon) -> None:
    with Router(RouterConfig(daemons=(f"unix:{daemon.socket}",))).start() as r:
        assert r.wait_synced(15)
        (worker, _), = r.workers()
        with pytest.raises(UnknownCandidates) as e:
            r.route(KEYS, candidates=[worker, "typo"])
        assert e.value.names == ["typo"] and isinstance(e.value, ValueError)
        assert r.workers() == [(worker, worker)]
        assert r.load(worker).active_requests == 0  # nothing was dispatched
        assert r.route(KEYS, candidates=[worker]).worker == worker

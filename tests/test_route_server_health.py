"""``kvtier route-server``: the gRPC health service its probes ask (``kvtier health``), and TLS to
daemons it finds by DNS (the certificate is checked against the name, not the address dialled).

One real kvtierd on 127.0.0.1 over mutual TLS with a certificate that names only
``DNS:localhost``; the route-server follows ``--dns localhost:PORT``, so it dials 127.0.0.1
and must check the daemon's certificate against ``localhost``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import grpc
import pytest
from _wait import wait_for
from pki import make_ca, make_cert

from kvtier.client.routing.health import ROUTER_SERVICE
from kvtier.client.tools.health import check
from kvtier.proto import router_pb2, router_pb2_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(target: str) -> router_pb2.RouterStatusReply:
    with grpc.insecure_channel(target) as ch:
        return router_pb2_grpc.RouterStub(ch).Status(router_pb2.RouterStatusRequest(), timeout=5)


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    make_ca(d, "ca")
    make_cert(d, "daemon", "ca", "node-x", "DNS:localhost")  # no IP SAN: 127.0.0.1 is not its name
    make_cert(d, "router", "ca", "router")
    return d


def test_health_turns_serving_once_a_daemon_found_by_dns_is_followed_over_tls(tmp_path, pki) -> None:
    from kvtier.client.tools.local_daemon import DaemonProcess

    dport, listen, hport = _free_port(), _free_port(), _free_port()
    log = open(tmp_path / "router.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"127.0.0.1:{listen}",
         "--health-listen", f"127.0.0.1:{hport}", "--dns", f"localhost:{dport}", "--resolve-interval-s", "0.5",
         "--reconnect-max-s", "0.3", "--daemon-tls-cert", str(pki / "router.pem"),
         "--daemon-tls-key", str(pki / "router.key"), "--daemon-tls-ca", str(pki / "ca.pem")],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    daemon = None
    try:
        probe = f"127.0.0.1:{hport}"
        wait_for(lambda: check(probe) is None or proc.poll() is not None, what="the probe listener")
        assert proc.poll() is None, (tmp_path / "router.log").read_text()
        # alive, but not ready: no daemon yet, so Route could only refuse
        assert "NOT_SERVING" in (check(probe, ROUTER_SERVICE) or "")
        assert "NOT_SERVING" in (check(f"127.0.0.1:{listen}", ROUTER_SERVICE) or "")
        daemon = DaemonProcess(str(tmp_path), "--node-id", "node-x", "--tcp", f"127.0.0.1:{dport}",
                               "--tls-cert", str(pki / "daemon.pem"), "--tls-key", str(pki / "daemon.key"),
                               "--tls-ca", str(pki / "ca.pem"), name="x", host_capacity="8MiB").start()
        wait_for(lambda: check(probe, ROUTER_SERVICE) is None, timeout=20, what="the router ready")
        feeds = [f for f in _status(f"127.0.0.1:{listen}").feeds if f.connected]
        assert [(f.target, f.node_id) for f in feeds] == [(f"127.0.0.1:{dport}", "node-x")]
        assert check(f"127.0.0.1:{listen}", ROUTER_SERVICE) is None  # the main listener serves it too
        cli = subprocess.run([sys.executable, "-m", "kvtier.client.tools.cli", "health", probe, "--service",
                              ROUTER_SERVICE], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "SERVING" in cli.stdout, cli.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        if daemon is not None:
            daemon.cleanup()


def test_health_listen_beyond_loopback_is_refused() -> None:
    p = subprocess.run([sys.executable, "-m", "kvtier.client.routing.route_server", "--health-listen",
                        "0.0.0.0:7072", "--daemon", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--health-listen 0.0.0.0:7072 is plaintext" in p.stderr

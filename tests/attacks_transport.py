"""Transports, who a caller is, and the tenant key salt: attacks on real daemons.

Each test is one attack, refused: a gRPC call without (or with a stale) token; a second uid on
the unix socket (the client runs as ``nobody``); a socket directory another user made, or one
anyone may write, or a symlink; ``--tcp`` without TLS; a TCP client without a client
certificate, or with one from another CA; the Node service over TCP. And what is granted:
an admitted second uid gets its mapped tenant; descriptors passed over the credential socket
are the daemon's until their connection closes; each tenant's key salt is secret and stable.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from pki import make_ca, make_cert, tls_channel

from kvtier.client import Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.tools.local_daemon import DaemonProcess, shm_tempdir
from kvtier.daemon.auth import AccessPolicy, PeerAuthenticator
from kvtier.daemon.errors import Code, StoreError
from kvtier.handshake import TOKEN_HEADER, Credentials, auth_socket_path
from kvtier.proto import locations_pb2, locations_pb2_grpc, node_pb2, node_pb2_grpc

NOBODY = 65534


def kvtierd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run kvtierd expecting it to refuse to start (it exits)."""
    return subprocess.run([sys.executable, "-m", "kvtier.daemon.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def refused_start(tmp_path, sock: str, *extra: str) -> subprocess.CompletedProcess:
    with shm_tempdir() as shm:
        return kvtierd("--socket", sock, "--shm-dir", shm, "--host-capacity", "16MiB", *extra)


def stats(channel: grpc.Channel, metadata: tuple = ()) -> node_pb2.StatsReply:
    return node_pb2_grpc.NodeStub(channel).Stats(node_pb2.StatsRequest(), timeout=10, metadata=metadata)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the unix socket: who may call ----------------------------------------------------------------

def test_grpc_call_without_a_token_is_refused(daemon) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        for md in ((), ((TOKEN_HEADER, "0" * 32),)):
            with pytest.raises(grpc.RpcError) as e:
                stats(ch, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "credential socket" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a stream too
            next(iter(locations_pb2_grpc.LocationsStub(ch).WatchLocations(locations_pb2.WatchLocationsRequest(),
                                                                           timeout=10)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with open_channel(f"unix:{daemon.socket}") as ch:  # the handshake's token is accepted
        assert stats(ch).node_id


def test_a_token_dies_with_its_credential_connection(daemon) -> None:
    creds = Credentials(daemon.socket, "t").connect()
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        md = creds.metadata
        assert stats(ch, md).node_id
        creds.close()
        deadline = time.monotonic() + 10
        while True:  # the daemon sees the close on its loop: at once, give or take a scheduling
            try:
                stats(ch, md)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                break
            assert time.monotonic() < deadline, "the token outlived its credential connection"
            time.sleep(0.02)


_AS_NOBODY = textwrap.dedent("""
    import json, os, sys
    import grpc, grpc._channel, grpc._common, grpc._utilities  # loaded while /root is readable
    from kvtier.handshake import Credentials, HandshakeError
    from kvtier.proto import node_pb2, node_pb2_grpc
    sock = sys.argv[1]
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
    out = {"uid": os.getuid()}
    md = ()
    try:
        c = Credentials(sock, "as-nobody").connect()
        out.update(handshake="OK", tenant=c.tenant, salt=c.key_salt)
        md = c.metadata
    except HandshakeError as e:
        out.update(handshake=e.code, handshake_error=e.details)
    ch = grpc.insecure_channel("unix:" + sock)
    try:
        node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=10, metadata=md)
        out["call"] = "OK"
    except grpc.RpcError as e:
        out.update(call=e.code().name, call_error=e.details())
    print(json.dumps(out))
""")


def as_user(sock: str, uid: int = NOBODY) -> dict:
    """Hand-shake and call Stats from a process running as ``uid`` (forked as root, then setuid)."""
    p = subprocess.run([sys.executable, "-c", _AS_NOBODY, sock, str(uid)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])



def test_a_second_uid_on_the_unix_socket_is_refused(shared_dir) -> None:
    # other users may connect (uid 4242 is admitted, so the sockets are 0666), but nobody is not admitted
    d = DaemonProcess(shared_dir, "--allowed-uids", f"{os.geteuid()},4242").start()
    try:
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o666
        assert stat.S_IMODE(os.stat(auth_socket_path(d.socket)).st_mode) == 0o666
        out = as_user(d.socket)
        assert out["uid"] == NOBODY
        assert out["handshake"] == "PERMISSION_DENIED" and f"uid {NOBODY}" in out["handshake_error"], out
        assert out["call"] == "UNAUTHENTICATED", out
        assert "refused a peer" in d.logs()
    finally:
        d.cleanup()


def test_an_admitted_second_uid_gets_its_mapped_tenant(shared_dir) -> None:
    d = DaemonProcess(shared_dir, "--allowed-uids", f"{os.geteuid()},{NOBODY}", "--tenants", f"{NOBODY}=bob").start()
    try:
        out = as_user(d.socket)
        assert out["handshake"] == "OK" and out["tenant"] == "bob" and out["call"] == "OK", out
        with Sidecar(d.socket) as sc:  # root is unmapped: the default tenant, another salt
            assert sc.tenant == "default" and len(sc.key_salt) == 64 and sc.key_salt != out["salt"]
    finally:
        d.cleanup()


# -- the socket directory ---------------------------------------------------------------------------

def test_socket_directory_owned_by_another_uid_is_refused(tmp_path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)  # another user made /tmp/kvtier-$UID first
    p = refused_start(tmp_path, str(d / "kvtierd.sock"))
    assert p.returncode == 1 and f"owned by uid {NOBODY}" in p.stderr, p.stderr
    assert os.listdir(d) == []


def test_socket_directory_mode_0777_is_refused(tmp_path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    p = refused_start(tmp_path, str(d / "kvtierd.sock"))
    assert p.returncode == 1 and "mode 0777" in p.stderr and "chmod 700" in p.stderr, p.stderr
    assert os.listdir(d) == []
    os.chmod(d, 0o755)  # readable by others is refused too
    assert "mode 0755" in refused_start(tmp_path, str(d / "kvtierd.sock")).stderr
    # admitting other users allows 0711 at most: 0777 stays refused
    os.chmod(d, 0o777)
    p = refused_start(tmp_path, str(d / "kvtierd.sock"), "--allowed-uids", f"{os.geteuid()},4242")
    assert p.returncode == 1 and "mode 0777" in p.stderr and "chmod 711" in p.stderr, p.stderr


def test_symlinked_socket_directory_is_refused(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    p = refused_start(tmp_path, str(tmp_path / "link" / "kvtierd.sock"))
    assert p.returncode == 1 and "is a symlink" in p.stderr, p.stderr
    assert os.listdir(real) == []


def test_a_missing_socket_directory_is_created_0700(tmp_path) -> None:
    d = DaemonProcess(str(tmp_path))
    d.socket = d.args[1] = str(tmp_path / "made" / "kvtierd.sock")
    try:
        d.start()
        assert stat.S_IMODE(os.stat(tmp_path / "made").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(auth_socket_path(d.socket)).st_mode) == 0o600
        assert d.stop() == 0
        assert not os.path.exists(auth_socket_path(d.socket))  # removed at stop
    finally:
        d.cleanup()


# -- file descriptors over the credential socket --------------------------------------------------

def _daemon_fds_to(pid: int, name: str) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += name in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def test_passed_fds_are_held_under_handles_and_closed_with_their_connection(daemon) -> None:
    fds = [os.memfd_create(f"kvtier-pass-{i}") for i in range(3)]
    try:
        creds = Credentials(daemon.socket, "fds").connect()
        handles = creds.pass_fds(fds)
        assert len(set(handles)) == 3 and all(len(h) == 32 for h in handles)
        assert _daemon_fds_to(daemon.pid, "memfd:kvtier-pass-") == 3
        creds.close()  # never taken: the daemon closes them
        deadline = time.monotonic() + 10
        while _daemon_fds_to(daemon.pid, "memfd:kvtier-pass-"):
            assert time.monotonic() < deadline, "the daemon kept fds of a closed credential connection"
            time.sleep(0.02)
        with Sidecar(daemon.socket) as sc:  # the sidecar passes them too
            assert len(sc.pass_fds(fds[:1])) == 1
    finally:
        for fd in fds:
            os.close(fd)


def test_another_callers_fd_handle_is_refused() -> None:
    auth = PeerAuthenticator(AccessPolicy.of(), b"s" * 32)
    tok_a, a = auth.admit(os.geteuid(), os.getegid())
    tok_b, b = auth.admit(os.geteuid(), os.getegid())
    fd = os.memfd_create("kvtier-take")
    (handle,) = auth.keep_fds(tok_a, [fd])
    with pytest.raises(StoreError) as e:
        auth.take_fd(b, handle)
    assert e.value.code == Code.PERMISSION_DENIED
    assert auth.take_fd(a, handle) == fd
    with pytest.raises(StoreError) as e:
        auth.take_fd(a, handle)  # once
    assert e.value.code == Code.NOT_FOUND
    os.close(fd)
    with pytest.raises(StoreError) as e:
        auth.admit(NOBODY, NOBODY)
    assert e.value.code == Code.PERMISSION_DENIED


# -- TCP ------------------------------------------------------------------------------------------

def test_tcp_without_tls_refuses_to_start_unless_insecure(tmp_path) -> None:
    port = free_port()
    p = refused_start(tmp_path, str(tmp_path / "a.sock"), "--tcp", f"127.0.0.1:{port}")
    assert p.returncode == 2 and "--insecure-tcp" in p.stderr and "--tls-cert" in p.stderr, p.stderr
    d = DaemonProcess(str(tmp_path), "--tcp", f"127.0.0.1:{port}", "--insecure-tcp").start()
    try:
        assert "INSECURE" in d.logs()
    finally:
        d.cleanup()


_ca, _cert = make_ca, make_cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _cert(d, "server", "ca", "localhost", "IP:127.0.0.1,DNS:localhost")
    _cert(d, "alice", "ca", "alice")
    _cert(d, "mallory", "other-ca", "alice")  # the right name, the wrong CA
    return d


_tls_channel = tls_channel


def _node_info(ch: grpc.Channel) -> locations_pb2.NodeInfo:
    return locations_pb2_grpc.LocationsStub(ch).GetNodeInfo(locations_pb2.NodeInfoRequest(), timeout=10)


def test_tcp_client_without_a_valid_client_certificate_is_refused(start_daemon, pki) -> None:
    port = free_port()
    start_daemon("--node-id", "tls-node", "--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.pem"),
                 "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"))
    for client in (None, "mallory"):  # no certificate; a certificate of another CA
        with _tls_channel(pki, port, client) as ch, pytest.raises(grpc.RpcError) as e:
            _node_info(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (client, e.value)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as e:  # plaintext
        _node_info(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with _tls_channel(pki, port, "alice") as ch:
        assert _node_info(ch).node_id == "tls-node"


def test_node_service_is_not_served_on_tcp_by_default(start_daemon, pki) -> None:
    port = free_port()
    start_daemon("--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.pem"),
                 "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"))
    with _tls_channel(pki, port, "alice") as ch:
        with pytest.raises(grpc.RpcError) as e:
            stats(ch)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert _node_info(ch).node_id  # Locations is


def test_tcp_principal_is_the_certificate_common_name_or_its_mapping() -> None:
    policy = AccessPolicy.of(tenants=["cn:router-1=alice", "1000=bob"])
    assert policy.tenant_of_cn("router-1") == "alice" and policy.tenant_of_cn("carol") == "cn:carol"
    assert policy.tenant_of_uid(1000) == "bob" and policy.tenant_of_uid(1001) == "default"



def test_an_unmapped_certificate_name_is_a_tenant_of_its_own_and_two_names_are_refused(start_daemon, pki) -> None:
    from kvtier.tiers.layout import Layout, layout_to_proto

    _cert(pki, "router-1", "ca", "router-1")
    _cert(pki, "two-names", "ca", "alice/CN=router-1")   # subject CN=alice, CN=router-1
    _cert(pki, "default", "ca", "default")
    port = free_port()
    d = start_daemon("--tcp", f"127.0.0.1:{port}", "--tcp-services", "all", "--tls-cert", str(pki / "server.pem"),
                     "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"),
                     "--tenants", f"{os.geteuid()}=alice,cn:router-1=alice")
    layout = Layout.flat(4096, name="alices")
    keys = [i.to_bytes(16, "big") for i in range(1, 4)]
    with Sidecar(d.socket) as sc:   # this uid is tenant alice
        assert sc.tenant == "alice"
        lid = sc.register_layout(layout)
        assert sc.put(lid, keys, [np.full(4096, i, dtype=np.uint8) for i in range(3)]).stored == 3
    spec = node_pb2.RegisterLayoutRequest(layout=layout_to_proto(layout, node_pb2.LayoutSpec))
    # a certificate named alice, or default, is not tenant alice (nor default): it sees none of alice's
    for client in ("alice", "default"):
        with _tls_channel(pki, port, client) as ch:
            node = node_pb2_grpc.NodeStub(ch)
            assert not stats(ch).layouts, client
            reg = node.RegisterLayout(spec, timeout=10)
            assert list(node.Lookup(node_pb2.LookupRequest(layout_id=reg.layout_id, keys=keys), timeout=10).tiers) \
                == [node_pb2.TIER_NONE] * 3, client
            assert stats(ch).counters["commits"] == 0, client   # nor alice's activity
    # a certificate whose CN a --tenants entry maps to alice is alice
    with _tls_channel(pki, port, "router-1") as ch:
        node = node_pb2_grpc.NodeStub(ch)
        reg = node.RegisterLayout(spec, timeout=10)
        assert list(node.Lookup(node_pb2.LookupRequest(layout_id=reg.layout_id, keys=keys), timeout=10).tiers) \
            == [node_pb2.TIER_HOST] * 3
    # a certificate with two common names is refused, saying why
    with _tls_channel(pki, port, "two-names") as ch:
        for call in (lambda: stats(ch), lambda: _node_info(ch)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "2 common names" in (e.value.details() or ""), e.value.details()

# -- the tenant key salt --------------------------------------------------------------------------

def test_key_salt_is_secret_per_tenant_and_kept_across_restarts(start_daemon, tmp_path) -> None:
    state = tmp_path / "state"
    d = start_daemon("--state-dir", str(state))
    with Sidecar(d.socket) as sc:
        salt = sc.key_salt
    assert len(salt) == 64 and salt != ""
    secret = state / "key.secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600 and os.path.getsize(secret) == 32
    d.stop()
    d.start()
    with Sidecar(d.socket) as sc:
        assert sc.key_salt == salt
    d.stop()
    os.chmod(secret, 0o644)  # readable by others: refused
    with pytest.raises(RuntimeError, match="mode 0600"):
        d.start()


def test_route_server_over_tls_refuses_clients_without_a_certificate_and_follows_a_tls_daemon(
        start_daemon, pki, tmp_path) -> None:
    from kvtier.proto import router_pb2, router_pb2_grpc

    port = free_port()
    start_daemon("--node-id", "tls-node", "--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.pem"),
                 "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"))
    rs_port = free_port()
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem")]
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.client.routing.route_server", "--listen",
                             f"127.0.0.1:{rs_port}", *tls, "--daemon", f"127.0.0.1:{port}",
                             "--daemon-tls-cert", str(pki / "alice.pem"), "--daemon-tls-key", str(pki / "alice.key"),
                             "--daemon-tls-ca", str(pki / "ca.pem")],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "rs.log", "wb"), text=True)
    try:
        assert "listening on" in proc.stdout.readline(), (tmp_path / "rs.log").read_text()  # type: ignore[union-attr]
        req = router_pb2.RouterStatusRequest()
        for client in (None, "mallory"):
            with _tls_channel(pki, rs_port, client) as ch, pytest.raises(grpc.RpcError) as e:
                router_pb2_grpc.RouterStub(ch).Status(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with _tls_channel(pki, rs_port, "alice") as ch:
            deadline = time.monotonic() + 20
            while not any(f.connected and f.node_id == "tls-node"
                          for f in router_pb2_grpc.RouterStub(ch).Status(req, timeout=10).feeds):
                assert time.monotonic() < deadline, (tmp_path / "rs.log").read_text()
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(20)
    p = subprocess.run([sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--insecure-tcp" in p.stderr, p.stderr


def test_sidecar_over_tcp_needs_a_client_certificate(start_daemon, pki) -> None:
    from kvtier.client.engine.transport import ClientTls, KvtierError

    port = free_port()
    start_daemon("--tcp", f"127.0.0.1:{port}", "--tcp-services", "all", "--tls-cert", str(pki / "server.pem"),
                 "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"))
    with Sidecar(target=f"127.0.0.1:{port}", timeout=5) as sc, pytest.raises(KvtierError):
        sc.stats()  # plaintext to a TLS port
    alice = ClientTls(str(pki / "alice.pem"), str(pki / "alice.key"), str(pki / "ca.pem"))
    with Sidecar(target=f"127.0.0.1:{port}", timeout=10, tls=alice) as sc:
        assert sc.stats()["tiers"]["host"]["capacity_bytes"] > 0

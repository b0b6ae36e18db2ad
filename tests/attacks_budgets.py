"""Denial of service: budgets that keep one caller from taking what the others need, against
real daemons over their unix sockets.

Each test is one attack, refused: an admitted caller passes descriptors on its credential
connection again and again (per connection, per uid, per tenant, and against the process's
reserve of descriptors); a uid that is not admitted (``nobody``) fills the credential socket
with connections that never say hello; an admitted uid opens more than its share of such
connections; a gRPC connection sends the HTTP/2 preface and no call; a session registers KV
memory again and again; a hello nested 60,000 arrays deep. And the daemon's host files: they
go in a directory only its uid can write, under names no one can predict.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import grpc
import pytest

from kvtier.client import Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.handshake import Credentials, HandshakeError, auth_socket_path, frame
from kvtier.proto import node_pb2, node_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from kvtier.tiers.copy_engine import sealed_memfd
from kvtier.tiers.layout import Layout, layout_to_proto

NOBODY = 65534
BLOCK = 64 * 1024


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def counters(sock: str) -> dict:
    with Sidecar(sock) as sc:
        return sc.stats()["counters"]


def serves(sock: str) -> bool:
    """A new client hand-shakes, registers a layout and puts and gets a block."""
    with Sidecar(sock) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, [b"k" * 16], [b"v" * BLOCK])
        return sc.get(lid, [b"k" * 16]) == [b"v" * BLOCK]


def pipes(n: int) -> list[int]:
    fds: list[int] = []
    for _ in range(n // 2):
        fds.extend(os.pipe())
    return fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- passed descriptors ---------------------------------------------------------------------------

def test_passed_fds_over_the_connection_budget_are_refused_and_closed(daemon) -> None:
    """64 descriptors a pass, again and again on one connection: past --max-passed-fds-per-connection
    (256) the pass is refused RESOURCE_EXHAUSTED naming it, the daemon keeps none of its
    descriptors, the connection (and its token) stays, and other clients are served."""
    fds = pipes(64)
    creds = Credentials(daemon.socket, "hoarder").connect()
    try:
        for _ in range(4):
            assert len(creds.pass_fds(fds)) == 64
        before = daemon_fds(daemon.pid)
        for _ in range(3):
            with pytest.raises(HandshakeError) as e:
                creds.pass_fds(fds)
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-passed-fds-per-connection" in e.value.details
        assert daemon_fds(daemon.pid) <= before
        assert creds.alive  # the connection stays: its handles are still good
        assert serves(daemon.socket)
        assert counters(daemon.socket)["passed_fds_refused"] == 3 * 64
    finally:
        creds.close()
        close_all(fds)


@pytest.mark.parametrize("flag", ["--max-passed-fds-per-uid", "--max-passed-fds-per-tenant"])
def test_passed_fds_over_the_uid_or_tenant_budget_are_refused(start_daemon, flag) -> None:
    """Many connections of one uid (one tenant), each under its own budget: together they may
    keep no more than the uid's (tenant's) budget; a connection closing gives its share back."""
    d = start_daemon(flag, "128")
    fds = pipes(64)
    conns = [Credentials(d.socket, f"c{i}").connect() for i in range(3)]
    try:
        conns[0].pass_fds(fds)
        conns[1].pass_fds(fds)
        with pytest.raises(HandshakeError) as e:
            conns[2].pass_fds(fds)
        assert e.value.code == "RESOURCE_EXHAUSTED" and flag in e.value.details
        conns[0].close()
        deadline = time.monotonic() + 60
        while True:  # the daemon sees the close on its loop
            try:
                assert len(conns[2].pass_fds(fds)) == 64
                break
            except HandshakeError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        for c in conns:
            c.close()
        close_all(fds)


def test_passed_fds_cannot_take_the_daemons_reserve(daemon) -> None:
    """Connections that each stay under every budget pass descriptors until the daemon nears its
    RLIMIT_NOFILE: the passes are refused RESOURCE_EXHAUSTED naming --fd-reserve, and new
    clients still connect, hand-shake, call, and the host tier still makes its files."""
    limit = daemon_fds(daemon.pid) + 600
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (limit, limit))
    fds = pipes(64)
    conns: list[Credentials] = []
    refusal = None
    try:
        for i in range(40):  # at most 40 * 3 * 64 descriptors: far past the limit
            c = Credentials(daemon.socket, f"c{i}").connect()
            conns.append(c)
            try:
                for _ in range(3):  # 192: under the connection's budget of 256
                    c.pass_fds(fds)
            except HandshakeError as e:
                refusal = e
                break
        assert refusal is not None and refusal.code == "RESOURCE_EXHAUSTED", refusal
        assert "--fd-reserve" in refusal.details
        assert daemon_fds(daemon.pid) <= limit - 200
        assert serves(daemon.socket)
        with open_channel(f"unix:{daemon.socket}") as ch:
            assert node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=10).node_id
    finally:
        for c in conns:
            c.close()
        close_all(fds)


# -- connections that never authenticate -----------------------------------------------------------

_FLOOD_AS = textwrap.dedent("""
    import json, os, socket, sys, time
    path, uid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        conns.append(s)
    print("flooding", flush=True)
    sys.stdin.readline()          # hold them until told
    closed = answers = 0
    for s in conns:
        s.settimeout(5)
        try:
            data = s.recv(65536)
            answers += b"PERMISSION_DENIED" in data
            closed += data == b"" or s.recv(1) == b""
        except OSError:
            pass
    print(json.dumps({"closed": closed, "answers": answers}), flush=True)
""")


def test_a_uid_not_admitted_cannot_fill_the_credential_socket(shared_dir, tmp_path) -> None:
    """``nobody`` (not admitted) opens 4,200 credential connections and never says hello: each
    is answered PERMISSION_DENIED and closed at accept, none counts against the 4,096
    connections, and an admitted client hand-shakes and calls meanwhile."""
    d = DaemonProcess(shared_dir, "--allowed-uids", f"{os.getuid()},4242", host_capacity="16MiB").start()
    try:
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD_AS, auth_socket_path(d.socket), str(NOBODY), "4200"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout.readline().strip() == "flooding"
            creds = Credentials(d.socket, "admitted", timeout=5).connect()
            with open_channel(f"unix:{d.socket}") as ch:
                assert node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=10).node_id
            creds.close()
            flood.stdin.write("\n")
            flood.stdin.flush()
            out = json.loads(flood.stdout.readline())
        finally:
            flood.kill()
            flood.wait()
        assert out == {"closed": 4200, "answers": 4200}, out
        assert counters(d.socket)["credential_connections_refused"] >= 4200
    finally:
        d.cleanup()


def test_an_admitted_uid_has_a_bounded_share_of_connections_before_hello(start_daemon) -> None:
    """An admitted uid opens connections and says nothing: past --max-pending-handshakes-per-uid
    (16) one more is answered RESOURCE_EXHAUSTED naming it at once; those waiting are closed
    after --credential-hello-timeout-s, and then the uid hand-shakes again."""
    daemon = start_daemon("--credential-hello-timeout-s", "5")
    path = auth_socket_path(daemon.socket)
    silent = []
    for _ in range(16):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        silent.append(s)
    try:
        # accepted in order: the 17th is refused whatever the daemon got to first
        with pytest.raises(HandshakeError) as e:
            Credentials(daemon.socket, "one-more", timeout=30).connect()
        assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-pending-handshakes-per-uid" in e.value.details
        for s in silent:
            s.settimeout(60)  # a bound for a busy machine; the daemon closes them after 5 s
            reply = s.recv(65536)
            assert b"--credential-hello-timeout-s" in reply, reply
        Credentials(daemon.socket, "later", timeout=30).connect().close()
    finally:
        for s in silent:
            s.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)


def test_a_grpc_connection_that_makes_no_call_is_closed(start_daemon) -> None:
    """A connection to the gRPC socket sends the HTTP/2 preface and settings, and no call: the
    daemon closes it after --grpc-idle-s."""
    daemon = start_daemon("--grpc-idle-s", "2")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket)
    try:
        s.sendall(PREFACE)
        s.settimeout(1)
        t0 = time.monotonic()
        while True:
            assert time.monotonic() - t0 < 60, "the daemon kept a connection that made no call"
            try:
                if s.recv(65536) == b"":
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                break
    finally:
        s.close()


# -- KV registrations ---------------------------------------------------------------------------

def test_kv_registrations_over_the_session_limit_are_refused(daemon) -> None:
    """One session registers the same KV memory again and again: past
    --max-kv-registrations-per-session (16) RegisterKV is refused RESOURCE_EXHAUSTED naming it;
    after an UnregisterKV the session registers again."""
    layout = Layout.flat(BLOCK, num_blocks=4)
    kv, ring = sealed_memfd("kvtier-test-kv", 4 * BLOCK), sealed_memfd("kvtier-test-ring", 64)
    sc = Sidecar(daemon.socket)
    try:
        sid = sc._ensure_session()
        stub = transfer_pb2_grpc.TransferStub(sc._channel)

        def register() -> transfer_pb2.RegisterKVReply:
            kv_handle, ring_handle = sc.pass_fds([kv, ring])
            return stub.RegisterKV(transfer_pb2.RegisterKVRequest(
                session_id=sid, layout=layout_to_proto(layout, node_pb2.LayoutSpec), backend="host",
                allocations=[transfer_pb2.KVAllocation(size=4 * BLOCK, fd_handle=kv_handle)],
                tensors=[transfer_pb2.KVTensorRef(allocation=0, offset=0)],
                event_ring_fd_handle=ring_handle, ring_slots=8), timeout=30)

        regs = [register().registration_id for _ in range(16)]
        with pytest.raises(grpc.RpcError) as e:
            register()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-kv-registrations-per-session" in e.value.details()
        assert sc.stats()["counters"]["kv_registrations_refused"] == 1
        stub.UnregisterKV(transfer_pb2.UnregisterKVRequest(session_id=sid, registration_id=regs[0]), timeout=30)
        assert register().registration_id
    finally:
        sc.close()
        os.close(kv)
        os.close(ring)


# -- the credential socket's decoder ----------------------------------------------------------------

def test_a_hello_nested_60000_deep_is_refused(daemon) -> None:
    """A hello of 60,000 nested ``[``: answered INVALID_ARGUMENT naming the depth bound (the
    documented refusal), and the daemon serves on."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(auth_socket_path(daemon.socket))
    try:
        body = b"[" * 60000
        s.sendall(struct.pack(">I", len(body)) + body)
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data, "no answer"
        reply = json.loads(data[4:])
        assert reply["ok"] is False and reply["code"] == "INVALID_ARGUMENT" and "deep" in reply["error"]
    finally:
        s.close()
    assert frame({"op": "hello"})  # (the client's encoder is the same module)
    Credentials(daemon.socket, "after").connect().close()


# -- the daemon's host files ------------------------------------------------------------------------

def own_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("kvtier-") and not os.path.isdir(os.path.join(d, n)))


def test_a_shm_dir_anyone_may_write_gets_a_private_subdirectory_and_unpredictable_names(tmp_path) -> None:
    """--shm-dir mode 1777 (as /dev/shm is): the daemon makes its files in its own 0700
    subdirectory ``kvtier-<uid>``, none in the shared directory, and their names carry 64
    random bits past its pid and epoch."""
    shared = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    os.chmod(shared, 0o1777)
    d = DaemonProcess(str(tmp_path), shm_dir=shared, host_capacity="16MiB").start()
    try:
        with Sidecar(d.socket) as sc:
            sc.register_layout(Layout.flat(BLOCK))
            epoch = sc.stats()["epoch"]
        own = os.path.join(shared, f"kvtier-{os.geteuid()}")
        st = os.lstat(own)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert own_files(shared) == []
        files = own_files(own)
        assert any(n.endswith(".pool") for n in files) and any(n.endswith(".keys") for n in files), files
        named = re.compile(rf"kvtier-{d.pid}-{epoch}-r[0-9a-f]{{16}}(-t\d+)?(\.keys|-\d+\.pool)")
        assert all(named.fullmatch(n) for n in files), files
    finally:
        d.cleanup()
        subprocess.run(["rm", "-rf", shared], check=False)


@pytest.mark.parametrize("planted", ["symlink", "other uid", "mode 0755"])
def test_a_planted_private_subdirectory_is_refused(tmp_path, planted) -> None:
    """In a --shm-dir anyone may write, ``kvtier-<uid>`` made by someone else (a symlink, a
    directory of another uid, one others may enter) refuses the start, and nothing is made."""
    shared = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    os.chmod(shared, 0o1777)
    own = os.path.join(shared, f"kvtier-{os.geteuid()}")
    elsewhere = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    try:
        if planted == "symlink":
            os.symlink(elsewhere, own)
        else:
            os.mkdir(own, 0o700)
            if planted == "other uid":
                os.chown(own, NOBODY, NOBODY)
            else:
                os.chmod(own, 0o755)
        p = subprocess.run([sys.executable, "-m", "kvtier.daemon.main", "--socket", str(tmp_path / "d.sock"),
                            "--shm-dir", shared, "--host-capacity", "16MiB"], capture_output=True, text=True,
                           timeout=30)
        assert p.returncode != 0
        assert f"kvtier-{os.geteuid()}" in p.stderr, p.stderr
        assert os.listdir(elsewhere) == [] and sorted(os.listdir(shared)) == [f"kvtier-{os.geteuid()}"]
    finally:
        subprocess.run(["rm", "-rf", shared, elsewhere], check=False)

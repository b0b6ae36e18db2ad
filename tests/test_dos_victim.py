"""Denial of service, seen from the victim: while an attack runs, a client of another tenant is
served in time.

Each test starts a real kvtierd (this process, root, is tenant alice), starts one attack in a
child process running as ``nobody`` (uid 65534: forked as root, then setgid/setuid; admitted as
tenant bob, or not admitted at all while a second uid is, so both sockets are world-connectable),
waits until the attack is at its steady state (what the attacker sees, or the daemon's
descriptors: never a fixed sleep), and then, with the attack still going, runs alice's client
three times: a new client hand-shakes on the credential socket, registers a layout, puts and
gets a block. Each of those rounds must succeed within :data:`SERVED_WITHIN_S` (2 s), and the
attacker must have kept attacking through them (its operations counted before and after).

The attacks: descriptors passed on credential connections again and again (64 copies of one
memfd a pass); connections to the credential socket that never say hello; gRPC connections
that send the HTTP/2 preface and make no call; RegisterKV of the same memory again and again
from session after session; pool and key-table file names planted in a ``--shm-dir`` anyone
may write (mode 1777, as /dev/shm is), named after the attacker's own pool file.

Run as a script (``python test_dos_victim.py ATTACK SOCKET UID [ARG]``), this file is the
attacker: it prints one JSON line when its attack is at its steady state, attacks until its
stdin closes, then prints its final counts.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc._channel  # noqa: F401  (loaded while the attacker can still read the interpreter's files)
import grpc._common  # noqa: F401
import grpc._utilities  # noqa: F401
import pytest
from _wait import wait_for
from attacks_budgets import PREFACE

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.handshake import Credentials, HandshakeError, auth_socket_path
from kvtier.proto import node_pb2, node_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from kvtier.tiers.copy_engine import sealed_memfd
from kvtier.tiers.layout import Layout, layout_to_proto

NOBODY = 65534
OTHER_UID = 4242  # admitted, and no process runs as it: with it, nobody need not be admitted for 0666 sockets
BLOCK = 64 * 1024
SERVED_WITHIN_S = 2.0
ROUNDS = 3
STEADY_WITHIN_S = 120.0  # a bound for the attack to reach its steady state on a busy machine


# -- the attacker (a child running as nobody) --------------------------------------------------

class _Attack:
    """Counts, the steady-state line, and the stop flag (set when stdin closes)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.ops = 0
        self.counts: dict[str, int] = {}
        self._said = False
        threading.Thread(target=self._watch_stdin, daemon=True).start()

    def _watch_stdin(self) -> None:
        for line in sys.stdin:  # "?": how far it got
            if line.strip() == "?":
                self.say()
        self.stop.set()

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def steady(self, why: str) -> None:
        if not self._said:
            self._said = True
            self.say(steady=why)

    def say(self, **extra: Any) -> None:
        print(json.dumps({"ops": self.ops, "counts": dict(self.counts), **extra}), flush=True)


def hoard_fds(a: _Attack, sock: str) -> None:
    """Pass 64 copies of one memfd on a credential connection, then on a new connection, and so
    on (up to 512 open: then one that keeps nothing is replaced by a new one, or the open ones
    are tried in turn); after a refusal, half as many (down to 1) a tenth of a second later, so
    that the last descriptors the daemon has are taken too. Steady: a pass of one is refused."""
    memfd = os.memfd_create("kvtier-hoard")
    fds = [memfd] + [os.dup(memfd) for _ in range(63)]
    conns: list[Credentials] = []
    keeps: set[int] = set()  # id() of the connections the daemon kept a pass of
    n = len(fds)
    while not a.stop.is_set():
        conns = [x for x in conns if x.alive]
        if len(conns) >= 512 and (empty := [x for x in conns if id(x) not in keeps]):
            empty[0].close()
            conns.remove(empty[0])
        if len(conns) < 512:
            try:
                c = Credentials(sock, f"hoard-{len(conns)}", timeout=5).connect()
            except HandshakeError as e:
                a.count(f"hello:{e.code}")
                a.steady(f"a handshake failed: {e.code}")
                continue
            conns.append(c)
        else:
            c = conns[a.ops % len(conns)]
        a.ops += 1
        try:
            c.pass_fds(fds[:n])
            keeps.add(id(c))
            a.count("passed", n)
        except HandshakeError as e:
            a.count(f"refused:{e.code}")
            if n == 1:
                a.steady(f"a pass of one descriptor was refused: {e.code}: {e.details}")
            n = max(1, n // 2)
            a.stop.wait(0.1)  # holding what it has, it tries again ten times a second


def silent_credential_connections(a: _Attack, sock: str, n: str) -> None:
    """``n`` connections to the credential socket that never say hello, each one the daemon
    closes replaced at once by a new one."""
    path, target = auth_socket_path(sock), int(n)
    held: dict[int, socket.socket] = {}
    poller = select.poll()
    made = 0
    while not a.stop.is_set():
        while len(held) < target and not a.stop.is_set():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(path)
            except OSError as e:
                s.close()
                a.count(f"connect:{type(e).__name__}")
                break
            s.setblocking(False)
            held[s.fileno()] = s
            poller.register(s, select.POLLIN)
            made += 1
            a.ops += 1
            if made % 64 == 0:
                _reap(a, held, poller, 0)
        if made >= target:
            a.steady(f"{made} connections made, {len(held)} held")
        _reap(a, held, poller, 50 if len(held) >= target else 0)


def _reap(a: _Attack, held: dict[int, socket.socket], poller: select.poll, wait_ms: int) -> None:
    """Close the connections the daemon answered (a refusal) or closed (counted as closed by it)."""
    for fd, _ in poller.poll(wait_ms):
        s = held.pop(fd)
        poller.unregister(fd)
        s.close()
        a.count("closed by the daemon")


def silent_grpc_connections(a: _Attack, sock: str, per_s: str) -> None:
    """``per_s`` new connections a second to the gRPC socket, each sending the HTTP/2 preface
    and settings and never a call, every one held until the daemon closes it."""
    rate = float(per_s)
    held: dict[int, socket.socket] = {}
    poller = select.poll()
    t0 = time.monotonic()
    while not a.stop.is_set():
        due = int((time.monotonic() - t0) * rate) - a.ops
        for _ in range(max(0, due)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            a.ops += 1
            try:
                s.connect(sock)
                s.sendall(PREFACE)
            except OSError as e:
                s.close()
                a.count(f"connect:{type(e).__name__}")
                continue
            s.setblocking(False)
            held[s.fileno()] = s
            poller.register(s, select.POLLIN)
        for fd, _ in poller.poll(5):
            s = held[fd]
            try:
                if s.recv(65536):
                    continue  # the server's settings, pings
            except BlockingIOError:
                continue
            except OSError:
                pass
            del held[fd]
            poller.unregister(fd)
            s.close()
            a.count("closed by the daemon")
            a.steady(f"the daemon closes them: {len(held)} held")
        a.counts["held"] = len(held)


def register_kv_spam(a: _Attack, sock: str) -> None:
    """One session registers the same KV memory again and again; once every session it has is
    refused, another session is opened (up to 24), and every session goes on registering."""
    layout = Layout.flat(BLOCK, num_blocks=4)
    kv, ring = sealed_memfd("kvtier-spam-kv", 4 * BLOCK), sealed_memfd("kvtier-spam-ring", 64)
    sessions: list[list[Any]] = []  # [sidecar, stub, session id, refused]
    i = 0
    while not a.stop.is_set():
        if len(sessions) < 24 and all(s[3] for s in sessions):
            try:
                sc = Sidecar(sock, client_name=f"spam-{len(sessions)}", timeout=10)
                sessions.append([sc, transfer_pb2_grpc.TransferStub(sc._channel), sc._ensure_session(), False])
            except Exception as e:
                a.count(f"session:{type(e).__name__}")
                a.steady(f"a session failed: {e}")
        if not sessions:
            continue
        s = sessions[i % len(sessions)]
        i += 1
        a.ops += 1
        try:
            kv_handle, ring_handle = s[0].pass_fds([kv, ring])
            s[1].RegisterKV(transfer_pb2.RegisterKVRequest(
                session_id=s[2], layout=layout_to_proto(layout, node_pb2.LayoutSpec), backend="host",
                allocations=[transfer_pb2.KVAllocation(size=4 * BLOCK, fd_handle=kv_handle)],
                tensors=[transfer_pb2.KVTensorRef(allocation=0, offset=0)],
                event_ring_fd_handle=ring_handle, ring_slots=8), timeout=10)
            a.count("registered")
        except grpc.RpcError as e:
            s[3] = True
            a.count(f"refused:{e.code().name}")
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "-per-tenant" in (e.details() or ""):
                a.steady(f"RegisterKV refused: {e.code().name}: {e.details()}")
        except Exception as e:  # the descriptors' pass refused, or the credential connection gone
            s[3] = True
            a.count(f"pass:{type(e).__name__}")
            a.steady(f"passing the memory failed: {e}")


def idle_credentials(a: _Attack, sock: str, n: str) -> None:
    """``n`` credential connections that hand-shake and then say nothing more, each one the
    daemon closes or refuses replaced by a new one; after a refusal, again a tenth of a second
    later. Steady: a connection was refused, or ``n`` are open."""
    target = int(n)
    conns: list[Credentials] = []
    while not a.stop.is_set():
        conns = [c for c in conns if c.alive]
        if len(conns) >= target:
            a.steady(f"{len(conns)} connections open")
            a.stop.wait(0.1)
            continue
        a.ops += 1
        try:
            conns.append(Credentials(sock, f"idle-{len(conns)}", timeout=5).connect())
            a.count("open")
        except HandshakeError as e:
            a.count(f"refused:{e.code}")
            a.steady(f"refused with {len(conns)} open: {e.code}: {e.details}")
            a.stop.wait(0.1)


POOL_NAME = re.compile(r"(kvtier-\d+-\d+(?:-r[0-9a-f]+)?)(?:-t\d+)?-\d+\.pool")
PLANTED_SIZES = sorted({1 << p for p in range(12, 27)} | {4096 * k for k in range(1, 65)})


def plant_shm_names(a: _Attack, sock: str, shm_root: str) -> None:
    """Register a layout, read the daemon's naming from its pool file's name, and create every
    pool and key-table name the daemon could make next (tenants 0 to 15, the slot sizes of
    :data:`PLANTED_SIZES`) beside that file and in ``shm_root``; again and again, so that
    what is removed is planted again."""
    with Sidecar(sock, client_name="planter", timeout=10) as sc:
        reply = node_pb2_grpc.NodeStub(sc._channel).RegisterLayout(node_pb2.RegisterLayoutRequest(
            layout=layout_to_proto(Layout.flat(4096, name="planter"), node_pb2.LayoutSpec)), timeout=10)
        m = POOL_NAME.fullmatch(os.path.basename(reply.pool_path))
        assert m is not None, reply.pool_path
        prefix = m.group(1)
        names = [f"{prefix}-{size}.pool" for size in PLANTED_SIZES] + [f"{prefix}.keys"]
        for t in range(16):
            names += [f"{prefix}-t{t}-{size}.pool" for size in PLANTED_SIZES] + [f"{prefix}-t{t}.keys"]
        dirs = sorted({os.path.dirname(reply.pool_path), shm_root})
        while not a.stop.is_set():
            for d in dirs:
                for name in names:
                    a.ops += 1
                    try:
                        os.close(os.open(os.path.join(d, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                        a.count("planted")
                    except FileExistsError:
                        a.count("there")
                    except OSError as e:
                        a.count(f"refused:{type(e).__name__}")
            a.steady(f"{len(names)} names in {dirs}")
            a.stop.wait(0.05)


ATTACKS: dict[str, Callable[..., None]] = {
    "hoard_fds": hoard_fds,
    "silent_credential_connections": silent_credential_connections,
    "silent_grpc_connections": silent_grpc_connections,
    "register_kv_spam": register_kv_spam,
    "idle_credentials": idle_credentials,
    "plant_shm_names": plant_shm_names,
}


def attack_as(name: str, sock: str, uid: int, *args: str) -> None:
    """The child: become ``uid``, attack until stdin closes, print the final counts."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    a = _Attack()
    try:
        ATTACKS[name](a, sock, *args)
    except BaseException as e:
        a.say(done=True, error=repr(e))
        raise
    a.say(done=True)


# -- the test's side -----------------------------------------------------------------------------

class Attacker:
    """One attack in a child process running as ``uid``."""

    def __init__(self, name: str, sock: str, *args: str, uid: int = NOBODY) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), name, sock, str(uid), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.steady: dict[str, Any] = {}

    def wait_steady(self, also: Callable[[], object] = lambda: False, timeout: float = STEADY_WITHIN_S) -> dict:
        """The attacker's steady-state line (or, when ``also()`` says the daemon is there first,
        {"steady": what it said}); fails if the attacker ends or ``timeout`` passes first."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.05)
            if ready:
                line = self.proc.stdout.readline()
                assert line, f"the attacker ended (rc {self.proc.wait()}) before its steady state"
                self.steady = json.loads(line)
                return self.steady
            if (seen := also()):
                self.steady = {"ops": 0, "steady": seen}
                return self.steady
            assert time.monotonic() < deadline, "the attack did not reach its steady state"

    def progress(self) -> dict[str, Any]:
        """The attacker's counts now (it goes on attacking)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the attacker ended (rc {self.proc.wait()})"
        return json.loads(line)

    def stop(self) -> dict[str, Any]:
        """Stop the attack; its final counts."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            last = self.proc.stdout.readline()
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        assert last, f"the attacker ended without its counts (rc {self.proc.returncode})"
        return json.loads(last)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def victim_round(sock: str, n: int) -> dict[str, float]:
    """Alice's new client: hand-shake, RegisterLayout, put, get; seconds from the start to the
    end of each step."""
    key, block = b"victim-%08d" % n, bytes([n % 251]) * BLOCK
    at: dict[str, float] = {}
    t0 = time.monotonic()
    with Sidecar(sock, client_name=f"victim-{n}", timeout=10) as sc:
        assert sc.tenant == "alice"
        at["handshake"] = time.monotonic() - t0
        lid = sc.register_layout(Layout.flat(BLOCK))
        at["register_layout"] = time.monotonic() - t0
        assert sc.put(lid, [key], [block]).stored == 1
        at["put"] = time.monotonic() - t0
        assert sc.get(lid, [key]) == [block]
        at["get"] = time.monotonic() - t0
    return at


def victim_is_served(sock: str, attacker: Attacker) -> list[dict[str, float]]:
    """:data:`ROUNDS` victim rounds while ``attacker`` attacks, each within
    :data:`SERVED_WITHIN_S`; the attacker kept attacking through them. The rounds' timings."""
    rounds = []
    for n in range(ROUNDS):
        try:
            at = victim_round(sock, n)
        except Exception as e:
            raise AssertionError(f"round {n}: the victim failed ({e!r}) while {attacker.steady}") from e
        rounds.append(at)
        assert at["get"] <= SERVED_WITHIN_S, (f"round {n}: the victim was served in {at} s, not "
                                              f"{SERVED_WITHIN_S} s, while {attacker.steady}")
    # the attack went on through the rounds: it still runs, and goes on counting
    now = wait_for(lambda: (p := attacker.progress())["ops"] > attacker.steady["ops"] and p, timeout=30,
                   what="the attacker to go on attacking")
    final = attacker.stop()
    assert "error" not in final, final
    print(f"victim rounds (s, cumulative): {rounds}; attacker at steady state: {attacker.steady}; "
          f"after the rounds: {now}; at the end: {final}")
    return rounds


@pytest.fixture
def two_tenants(shared_dir) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory: a kvtierd on which this process's uid is tenant alice and ``nobody`` is tenant
    bob (``admitted``) or not admitted at all (another uid is: the sockets are 0666)."""
    started: list[DaemonProcess] = []

    def start(admitted: bool, *args: str, **kw: Any) -> DaemonProcess:
        me = os.geteuid()
        other = NOBODY if admitted else OTHER_UID
        d = DaemonProcess(shared_dir, "--allowed-uids", f"{me},{other}", "--tenants",
                          f"{me}=alice,{other}={'bob' if admitted else 'carol'}", *args, **kw)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.cleanup()


@pytest.fixture
def attackers() -> Iterator[list[Attacker]]:
    started: list[Attacker] = []
    yield started
    for a in started:
        a.kill()


# -- the attacks, each with the victim served meanwhile -------------------------------------------

def test_victim_is_served_while_another_tenant_hoards_passed_descriptors(two_tenants, attackers) -> None:
    """Bob passes 64 copies of one memfd on each of up to 64 credential connections, again and
    again: once his passes are refused (his budgets), alice's new clients are served in time."""
    d = two_tenants(True, host_capacity="64MiB")
    a = Attacker("hoard_fds", d.socket)
    attackers.append(a)
    a.wait_steady()
    victim_is_served(d.socket, a)


@pytest.mark.parametrize("admitted", [False, True], ids=["not-admitted", "admitted"])
def test_victim_is_served_while_silent_credential_connections_flood(two_tenants, attackers, admitted) -> None:
    """``nobody`` keeps 4,200 connections to the credential socket open that never say hello
    (more than the 4,096 the daemon serves at once), replacing each one the daemon closes:
    alice's new clients are served in time."""
    d = two_tenants(admitted, host_capacity="64MiB")
    a = Attacker("silent_credential_connections", d.socket, "4200")
    attackers.append(a)
    a.wait_steady()
    victim_is_served(d.socket, a)


def test_victim_is_served_while_another_tenant_holds_idle_credential_connections(two_tenants, attackers) -> None:
    """Bob hand-shakes on 4,200 credential connections (more than the 4,096 the daemon serves at
    once) and keeps them open without another word: alice's new clients are served in time."""
    d = two_tenants(True, host_capacity="64MiB")
    a = Attacker("idle_credentials", d.socket, "4200")
    attackers.append(a)
    a.wait_steady()
    victim_is_served(d.socket, a)


@pytest.mark.parametrize("admitted", [False, True], ids=["not-admitted", "admitted"])
def test_victim_is_served_while_silent_grpc_connections_pile_up(two_tenants, attackers, admitted) -> None:
    """``nobody`` opens 100 gRPC connections a second, each sending the HTTP/2 preface and no
    call, and holds every one. The daemon's RLIMIT_NOFILE is set to 2,500 descriptors above
    what it has open, so connections held without bound would take them all within 25 s; the
    steady state is the daemon closing them (or its descriptors all taken). Meanwhile alice's
    new clients are served in time."""
    d = two_tenants(admitted, host_capacity="64MiB")
    limit = daemon_fds(d.pid) + 2500
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, limit))
    a = Attacker("silent_grpc_connections", d.socket, "100")
    attackers.append(a)
    a.wait_steady(also=lambda: daemon_fds(d.pid) >= limit - 2 and f"the daemon holds {daemon_fds(d.pid)} "
                                                                   f"of its {limit} descriptors")
    victim_is_served(d.socket, a)


def test_victim_is_served_while_another_tenant_spams_register_kv(two_tenants, attackers) -> None:
    """Bob registers the same KV memory again and again, from session after session: once his
    registrations are refused for his tenant's budget, alice's new clients are served in time."""
    d = two_tenants(True, host_capacity="64MiB")
    a = Attacker("register_kv_spam", d.socket)
    attackers.append(a)
    a.wait_steady()
    victim_is_served(d.socket, a)


def test_victim_is_served_while_another_tenant_plants_shm_names(two_tenants, attackers) -> None:
    """With a ``--shm-dir`` anyone may write (1777, as /dev/shm is), bob creates every pool and
    key-table name the daemon could make next, named after his own pool file, again and again:
    alice's new clients (whose slot size is among those planted) are served in time."""
    shared = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    os.chmod(shared, 0o1777)
    try:
        d = two_tenants(True, shm_dir=shared, host_capacity="64MiB")
        a = Attacker("plant_shm_names", d.socket, shared)
        attackers.append(a)
        a.wait_steady()
        victim_is_served(d.socket, a)
    finally:
        subprocess.run(["rm", "-rf", shared], check=False)


if __name__ == "__main__":
    attack_as(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])

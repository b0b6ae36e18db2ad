"""Hostile clients of the soak (``bench/soak.py --attackers N``): each process cycles through
the attacks the daemon's budgets refuse (docs/SECURITY.md, "budgets"; tests/attacks_budgets.py
shows each one alone), beside the normal clients, across daemon kills:

* ``hoard_fds``: an admitted tenant passes 64 descriptors at a time on its credential
  connection until a pass is refused;
* ``silent_credential``: an admitted tenant opens one more credential connection than its
  share of connections waiting for their hello, and says nothing;
* ``silent_credential_unadmitted``: a uid that is not admitted opens credential connections;
* ``silent_grpc`` (admitted and not): gRPC connections that send the HTTP/2 preface and no call;
* ``register_kv``: a session registers KV memory until RegisterKV is refused;
* ``plant_shm``: files and a symlink named as the daemon names its host files, made in its shm
  directory ahead of it;
* ``oversized_message`` and ``nested_message``: a credential message past 64 KiB, and a hello
  nested 60,000 arrays deep.

The admitted tenant is ``nobody`` (``ADMITTED_UID``; the harness admits it with
``--allowed-uids`` and maps it to its own tenant with ``--tenants``); the uid not admitted is
``UNADMITTED_UID``. An attack runs under its uid (effective uid and gid, switched for the attack
only: the credential socket sees them at connect), so it needs root; without root only the
attacks that take nothing from the normal clients' uid run (``uid_attacks`` False).

Every attempt counts as an operation (``ops``) and every answer, ``attack:code``, in ``refusals``
(``OK``: accepted, under the budget; ``WAITING``: a silent connection not answered yet;
``HELD``, ``PLANTED``: a silent gRPC connection made, a name planted), in a
tally flushed to ``attacker-<idx>-<gen>.json``; anything else (a daemon killed under it) is
counted in ``errors`` by ``attack:exception`` and the attacker goes on. Held resources are released when the harness
pauses the clients for a check, and planted names are logged to ``planted-<idx>.log`` first.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

ADMITTED_UID = 65534    # nobody: admitted, its own tenant
UNADMITTED_UID = 65533  # admitted by no flag
ATTACKER_TENANT = "attacker"
HOLD_S = 1.0            # how long an attack holds what it took (less when the harness pauses)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)


def daemon_args() -> list[str]:
    """What the daemon needs to admit the attackers' tenant."""
    return ["--allowed-uids", f"{os.geteuid()},{ADMITTED_UID}", "--tenants", f"{ADMITTED_UID}={ATTACKER_TENANT}"]


@contextlib.contextmanager
def as_uid(uid: int | None) -> Iterator[None]:
    """Effective uid and gid ``uid`` for the block (None: unchanged)."""
    if uid is None:
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def _reply(s: socket.socket) -> str:
    """The code of the daemon's framed answer on a credential connection ('CLOSED': none)."""
    s.settimeout(5)
    data = b""
    with contextlib.suppress(OSError):
        while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if len(data) < 4:
        return "CLOSED"
    try:
        reply = json.loads(data[4:4 + struct.unpack(">I", data[:4])[0]])
    except ValueError:
        return "UNREADABLE"
    return "OK" if reply.get("ok") else str(reply.get("code", "UNKNOWN"))


class Attacker:
    def __init__(self, idx: int, slot: int, gen: int, cfg: dict, ctl: Any) -> None:
        self.idx, self.slot, self.cfg, self.ctl = idx, slot, cfg, ctl
        self.rng = random.Random(idx * 31337 + gen)
        self.path = os.path.join(cfg["work"], f"attacker-{idx}-{gen}.json")
        self.ops = 0
        self.refusals: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.flushed = 0.0
        self.uid_attacks = os.geteuid() == 0
        from kvtier.handshake import auth_socket_path

        self.auth = auth_socket_path(cfg["socket"])
        self.current = ""
        self.held: list[Callable[[], None]] = []  # releases of what the current attack holds
        self.pipes: list[int] = []
        for _ in range(32):
            self.pipes.extend(os.pipe())
        attacks = ["silent_grpc", "plant_shm", "oversized_message", "nested_message"]
        if self.uid_attacks:
            attacks += ["hoard_fds", "silent_credential", "silent_credential_unadmitted",
                        "silent_grpc_unadmitted", "register_kv"]
        self.attacks = attacks[idx % len(attacks):] + attacks[:idx % len(attacks)]

    # -- bookkeeping --------------------------------------------------------------------------

    def refused(self, code: str) -> None:
        key = f"{self.current}:{code}"
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.flushed < 1.0:
            return
        self.flushed = now
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ops": self.ops, "refusals": self.refusals, "errors": self.errors}, fh)
        os.replace(tmp, self.path)

    def hold(self) -> None:
        """Keep what the attack took for ``HOLD_S``, or until the harness pauses or stops."""
        end = time.monotonic() + HOLD_S
        while time.monotonic() < end and self.ctl.pause.value <= 0 and not self.ctl.stop.is_set():
            time.sleep(0.02)

    def release(self) -> None:
        while self.held:
            with contextlib.suppress(Exception):
                self.held.pop()()

    def connect(self, path: str) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.held.append(s.close)
        s.settimeout(5)
        s.connect(path)
        return s

    # -- the attacks --------------------------------------------------------------------------

    def hoard_fds(self) -> None:
        from kvtier.handshake import Credentials, HandshakeError

        with as_uid(ADMITTED_UID):
            creds = Credentials(self.cfg["socket"], f"hoarder-{self.idx}", timeout=5).connect()
        self.held.append(creds.close)
        for _ in range(24):  # 24 x 64: past the connection's and the uid's budgets
            self.ops += 1
            try:
                creds.pass_fds(self.pipes)
                self.refused("OK")
            except HandshakeError as e:
                self.refused(e.code)
                if e.code != "RESOURCE_EXHAUSTED":
                    raise
                break
        self.hold()

    def silent_credential(self) -> None:
        with as_uid(ADMITTED_UID):
            conns = [self.connect(self.auth) for _ in range(17)]
        self.ops += len(conns)
        self.hold()
        for s in conns:  # the one past the share is answered at once; the others wait for their hello
            s.setblocking(False)
            try:
                data = s.recv(65536)
                self.refused("CLOSED" if not data else "RESOURCE_EXHAUSTED" if b"RESOURCE_EXHAUSTED" in data
                             else "ANSWERED")
            except BlockingIOError:
                self.refused("WAITING")

    def silent_credential_unadmitted(self) -> None:
        with as_uid(UNADMITTED_UID):
            conns = [self.connect(self.auth) for _ in range(32)]
        self.ops += len(conns)
        for s in conns:
            self.refused(_reply(s))

    def _silent_grpc(self, uid: int | None) -> None:
        with as_uid(uid):
            conns = [self.connect(self.cfg["socket"]) for _ in range(8)]
        for s in conns:
            s.sendall(PREFACE)
            self.refused("HELD")
        self.ops += len(conns)
        self.hold()

    def silent_grpc(self) -> None:
        self._silent_grpc(ADMITTED_UID if self.uid_attacks else None)

    def silent_grpc_unadmitted(self) -> None:
        self._silent_grpc(UNADMITTED_UID)

    def register_kv(self) -> None:
        import grpc

        from kvtier.client import Sidecar
        from kvtier.proto import node_pb2, transfer_pb2, transfer_pb2_grpc
        from kvtier.tiers.copy_engine import sealed_memfd
        from kvtier.tiers.layout import Layout, layout_to_proto

        block = 64 * 1024
        layout = Layout.flat(block, num_blocks=4)
        kv, ring = sealed_memfd("kvtier-attack-kv", 4 * block), sealed_memfd("kvtier-attack-ring", 64)
        self.held += [lambda: os.close(kv), lambda: os.close(ring)]
        with as_uid(ADMITTED_UID):
            sc = Sidecar(self.cfg["socket"], timeout=5, client_name=f"registrar-{self.idx}", use_key_table=False)
            self.held.append(sc.close)
            sid = sc._ensure_session()
        stub = transfer_pb2_grpc.TransferStub(sc._channel)
        for _ in range(20):  # past --max-kv-registrations-per-session (16)
            self.ops += 1
            kv_handle, ring_handle = sc.pass_fds([kv, ring])
            try:
                stub.RegisterKV(transfer_pb2.RegisterKVRequest(
                    session_id=sid, layout=layout_to_proto(layout, node_pb2.LayoutSpec), backend="host",
                    allocations=[transfer_pb2.KVAllocation(size=4 * block, fd_handle=kv_handle)],
                    tensors=[transfer_pb2.KVTensorRef(allocation=0, offset=0)],
                    event_ring_fd_handle=ring_handle, ring_slots=8), timeout=5)
                self.refused("OK")
            except grpc.RpcError as e:
                self.refused(e.code().name)
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                break
        self.hold()

    def plant_shm(self) -> None:
        shm, pid = self.cfg["shm"], self.ctl.daemon_pid.value
        names = []
        for _ in range(16):
            base = f"kvtier-{pid}-{self.rng.randrange(4)}-r{secrets.token_hex(8)}"
            names += [base + ".keys", base + "-0.pool"]
        with open(os.path.join(self.cfg["work"], f"planted-{self.idx}.log"), "a") as fh:
            fh.write("".join(n + "\n" for n in names))
        for n in names:
            p = os.path.join(shm, n)
            self.held.append(lambda p=p: os.unlink(p))
            self.ops += 1
            if n.endswith(".keys") and self.rng.random() < 0.25:
                os.symlink("/etc/passwd", p)
            else:
                with open(p, "wb") as f:
                    f.write(b"\0" * 4096)
            self.refused("PLANTED")
        self.hold()

    def _message(self, body: bytes, length: int | None = None) -> None:
        with as_uid(ADMITTED_UID if self.uid_attacks else None):
            s = self.connect(self.auth)
        self.ops += 1
        with contextlib.suppress(OSError):
            s.sendall(struct.pack(">I", len(body) if length is None else length) + body)
        self.refused(_reply(s))

    def oversized_message(self) -> None:
        self._message(b'{"op": "hello", "client": "' + b"x" * 70000 + b'"}')

    def nested_message(self) -> None:
        self._message(b"[" * 60000)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        import grpc

        from kvtier.handshake import HandshakeError

        n = 0
        while not self.ctl.stop.is_set():
            r = self.ctl.pause.value
            if r > 0:
                self.ctl.idle[self.slot] = r
                while self.ctl.pause.value == r and not self.ctl.stop.is_set():
                    time.sleep(0.01)
                continue
            attack = self.attacks[n % len(self.attacks)]
            n += 1
            self.current = attack
            try:
                getattr(self, attack)()
            except HandshakeError as e:  # refused before the attack got going (another one holds the share)
                self.refused(e.code)
            except grpc.RpcError as e:
                self.refused(e.code().name)
            except Exception as e:  # a daemon killed under the attack: go on
                key = f"{attack}:{type(e).__name__}"
                self.errors[key] = self.errors.get(key, 0) + 1
                time.sleep(0.05)
            finally:
                self.release()
            self.flush()
        self.flush(force=True)


def attacker_main(idx: int, slot: int, gen: int, cfg: dict, ctl: Any) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Attacker(idx, slot, gen, cfg, ctl).run()

"""The daemon's credential socket: who a unix-socket client is.

Serves the handshake of :mod:`kvtier.handshake` on ``<socket>.auth``, on the daemon's event
loop: each connection's peer credentials (``SO_PEERCRED``: uid, gid, pid) are read from the
kernel and checked by the :class:`~kvtier.daemon.auth.PeerAuthenticator`, which issues the
token; the token is revoked when the connection closes. File descriptors the client passes
(``SCM_RIGHTS``) are kept under handles bound to the token (``PeerAuthenticator.take_fd``).
The ``open`` operation hands the caller one of its tenant's files (a pool file or key table
the daemon named to it) as a descriptor (``files``: the daemon's
:meth:`~kvtier.daemon.store.BlockStore.open_tenant_file`); a refused ``open`` is answered and
the connection stays. The ``lookup_counters`` operation takes the client's lookup counters
region (one descriptor sent with it, :mod:`kvtier.tiers.lookup_counts`) for ``lookups`` (a
:class:`~kvtier.daemon.lookup_regions.LookupRegions`), which folds it one last time when the
connection closes; a refused region is answered and the connection stays.

Bounds. A peer's uid and gid are checked at accept (``SO_PEERCRED``): a peer the policy does
not admit is answered PERMISSION_DENIED and closed at once, never counted against anything.
Each admitted uid may have at most ``max_pending_per_uid`` connections waiting for their
hello (``--max-pending-handshakes-per-uid``; one more is answered RESOURCE_EXHAUSTED and
closed at accept), and a hello must come within ``hello_timeout_s``
(``--credential-hello-timeout-s``); at most :data:`MAX_CONNECTIONS` credential connections are
open at once (one more is refused RESOURCE_EXHAUSTED at accept). A frame is at most
:data:`kvtier.handshake.MAX_FRAME` bytes nested at most :data:`kvtier.handshake.MAX_DEPTH`
deep, and a pass at most :data:`kvtier.handshake.MAX_FDS` descriptors. Passed descriptors kept
are bounded per connection, uid and tenant (:class:`~kvtier.daemon.auth.FdBudgets`: a pass
over one is answered RESOURCE_EXHAUSTED, its descriptors closed, and the connection stays),
and descriptors arriving while fewer than ``fd_reserve`` of the process's ``RLIMIT_NOFILE``
are free (``--fd-reserve``) are closed at once and their connection refused
RESOURCE_EXHAUSTED: the reserve stays for accepting clients, their handshakes and calls, and
disk I/O. Refusals of both kinds are counted (``credential_connections_refused``,
``passed_fds_refused``).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from kvtier.daemon.auth import PeerAuthenticator, Principal
from kvtier.daemon.config import FD_RESERVE, HELLO_TIMEOUT_S, MAX_PENDING_PER_UID
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.lookup_regions import LookupRegions
from kvtier.handshake import MAX_FDS, MAX_FRAME, fds_of, frame, unframe

log = logging.getLogger("kvtier.credentials")

MAX_CONNECTIONS = 4096
MAX_CONNECTIONS_PER_UID = MAX_CONNECTIONS // 4
"""Credential connections one uid may hold open at once when other uids are admitted too
(``PeerAuthenticator.policy.shared``): a quarter, so that no admitted uid takes them all."""
LOG_EVERY_S = 10.0  # a refused uid's refusals are logged at most this often
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, from the kernel."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def free_fds() -> int:
    """Descriptors this process may still open: its ``RLIMIT_NOFILE`` (soft) less those open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft - (len(os.listdir("/proc/self/fd")) - 1)  # (less the listing's own)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _until_ready(conn: socket.socket, writable: bool) -> None:
    """Wait until the loop says ``conn`` can be written (or read) without blocking."""
    loop = asyncio.get_running_loop()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    ready = loop.create_future()
    add(conn.fileno(), _wake, ready)
    try:
        await ready
    finally:
        remove(conn.fileno())


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CredentialServer:
    """The credential socket at ``path``, served on the running loop (see the module docstring)."""

    def __init__(self, auth: PeerAuthenticator, path: str, mode: int,
                 files: Callable[[Principal, str], int] | None = None,
                 lookups: LookupRegions | None = None, hello_timeout_s: float = HELLO_TIMEOUT_S,
                 max_pending_per_uid: int = MAX_PENDING_PER_UID, fd_reserve: int = FD_RESERVE) -> None:
        self.auth = auth
        self.path = path
        self.mode = mode
        self.hello_timeout_s = hello_timeout_s
        self.max_pending_per_uid = max_pending_per_uid
        self.fd_reserve = fd_reserve
        #: where refusals are counted (the store's counters, once it is built)
        self.counters: Counters | None = None
        self._pending: dict[int, int] = {}  # uid -> its connections waiting for their hello
        self._open_conns: dict[int, int] = {}  # uid -> its connections open (waiting for a hello or not)
        self._warned: dict[int, float] = {}  # uid refused -> when its refusal was last logged
        #: (caller, path) -> a new descriptor of that caller's tenant's file; raises StoreError
        self.files = files
        #: the clients' lookup counters regions (None: the operation is refused)
        self.lookups = lookups
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self.made = False

    def listen(self) -> None:
        """Bind and listen (mode ``mode``); serving starts with :meth:`start`. Raises OSError."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale one: the gRPC socket's check found no daemon serving
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        self.made = True
        os.chmod(self.path, self.mode)
        s.listen(socket.SOMAXCONN)  # a burst of refused peers does not fill the queue for the others
        self._sock = s

    def start(self) -> None:
        assert self._sock is not None
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.made = False

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # EMFILE and the like: keep serving the others
                log.warning("credential socket: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            try:
                creds = peer_credentials(conn)
                refusal = self._refusal(*creds)
            except OSError:
                conn.close()
                continue
            if refusal is not None:  # never counted, never served: answered and closed at once
                self._count(Count.CREDENTIAL_CONNECTIONS_REFUSED)
                with contextlib.suppress(OSError):
                    conn.send(frame({"ok": False, "code": refusal.code, "error": str(refusal)}))
                conn.close()
                continue
            uid = creds[1]
            self._pending[uid] = self._pending.get(uid, 0) + 1
            self._open_conns[uid] = self._open_conns.get(uid, 0) + 1
            task = loop.create_task(self._serve(conn, *creds))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
            task.add_done_callback(lambda _t, uid=uid: self._closed_conn(uid))

    def _refusal(self, pid: int, uid: int, gid: int) -> _Refused | None:
        """Why a peer just accepted is refused at once (None: it may hand-shake)."""
        why = self.auth.policy.refusal(uid, gid)
        if why is not None:
            now = time.monotonic()
            if now - self._warned.get(uid, -LOG_EVERY_S) >= LOG_EVERY_S:  # a flood logs a line per uid a while
                if len(self._warned) > 1024:
                    self._warned.clear()
                self._warned[uid] = now
                log.warning("credential socket: refused a peer", extra={"peer_pid": pid, "peer_uid": uid,
                                                                       "peer_gid": gid, "reason": why})
            return _Refused("PERMISSION_DENIED", why)
        if len(self._conns) >= MAX_CONNECTIONS:
            return _Refused("RESOURCE_EXHAUSTED", f"{MAX_CONNECTIONS} credential connections are open; close "
                                                  f"some clients")
        if self.auth.policy.shared and self._open_conns.get(uid, 0) >= MAX_CONNECTIONS_PER_UID:
            return _Refused("RESOURCE_EXHAUSTED", f"uid {uid} has {MAX_CONNECTIONS_PER_UID} credential connections "
                                                  f"open, its share of the daemon's {MAX_CONNECTIONS}; close some "
                                                  f"clients")
        if self._pending.get(uid, 0) >= self.max_pending_per_uid:
            return _Refused("RESOURCE_EXHAUSTED", f"uid {uid} has {self.max_pending_per_uid} credential connections "
                                                  f"waiting for their hello (--max-pending-handshakes-per-uid); "
                                                  f"send the hello at once after connecting")
        return None

    def _count(self, count: Count, n: int = 1) -> None:
        if self.counters is not None:
            self.counters.add(count, n)

    def _closed_conn(self, uid: int) -> None:
        left = self._open_conns.get(uid, 0) - 1
        if left > 0:
            self._open_conns[uid] = left
        else:
            self._open_conns.pop(uid, None)

    def _hello_done(self, uid: int) -> None:
        left = self._pending.get(uid, 0) - 1
        if left > 0:
            self._pending[uid] = left
        else:
            self._pending.pop(uid, None)

    async def _serve(self, conn: socket.socket, pid: int, uid: int, gid: int) -> None:
        token = ""
        fds: list[int] = []  # received, not yet claimed by a pass_fds message
        pending = True
        try:
            buf = bytearray()
            try:
                hello = await asyncio.wait_for(self._message(conn, buf, fds), self.hello_timeout_s)
            finally:
                pending = False
                self._hello_done(uid)
            if hello is None:
                return
            if hello.get("op") != "hello":
                raise _Refused("INVALID_ARGUMENT", "the first credential message must be a hello")
            try:
                token, p = self.auth.admit(uid, gid)
            except StoreError as e:
                log.warning("credential socket: refused a peer", extra={"peer_pid": pid, "peer_uid": uid,
                                                                       "peer_gid": gid, "reason": str(e)})
                raise _Refused(e.code.name, str(e)) from None
            log.debug("credential socket: admitted", extra={"peer_pid": pid, "peer_uid": uid,
                                                            "tenant": p.tenant, "client": str(hello.get("client"))})
            await self._send(conn, {"ok": True, "token": token, "tenant": p.tenant, "key_salt": self.auth.salt(p.tenant),
                                    "uid": uid, "caller": p.caller,
                                    "lookup_counters": self.lookups is not None})
            while (msg := await self._message(conn, buf, fds)) is not None:
                await self._op(conn, token, msg, fds)
        except _Refused as e:
            with contextlib.suppress(OSError):
                await self._send(conn, {"ok": False, "code": e.code, "error": str(e)})
        except (ValueError, TimeoutError, asyncio.TimeoutError) as e:
            with contextlib.suppress(OSError):
                await self._send(conn, {"ok": False, "code": "INVALID_ARGUMENT", "error": str(e) or
                                        f"no hello within {self.hello_timeout_s:g} s (--credential-hello-timeout-s)"})
        except OSError:
            pass
        finally:
            if pending:
                self._hello_done(uid)
            if token:
                self._closed(token)
            for fd in fds:
                os.close(fd)
            conn.close()

    def _closed(self, token: str) -> None:
        """The connection of ``token`` closed: its lookup counters are folded a last time, then
        the token is revoked."""
        try:
            if self.lookups is not None:
                self.lookups.detach(token)
        except Exception:  # the token is revoked whatever happened to the counters
            log.exception("credential socket: folding a closed connection's lookup counters failed")
        finally:
            self.auth.revoke(token)

    async def _op(self, conn: socket.socket, token: str, msg: dict[str, Any], fds: list[int]) -> None:
        if msg.get("op") == "open":
            await self._open(conn, token, msg)
            return
        if msg.get("op") == "lookup_counters":
            await self._lookup_counters(conn, token, fds)
            return
        if msg.get("op") != "pass_fds":
            raise _Refused("INVALID_ARGUMENT", f"unknown credential operation {msg.get('op')!r}")
        count = msg.get("count")
        if not isinstance(count, int) or not 0 < count <= MAX_FDS or count > len(fds):
            raise _Refused("INVALID_ARGUMENT", f"pass_fds: count {count!r} does not match the {len(fds)} "
                                               f"descriptors sent with it (1 to {MAX_FDS})")
        mine = fds[:count]
        del fds[:count]
        try:
            handles = self.auth.keep_fds(token, mine)
        except StoreError as e:  # over a budget: nothing kept, the connection stays
            for fd in mine:
                os.close(fd)
            self._count(Count.PASSED_FDS_REFUSED, count)
            log.warning("credential socket: refused passed descriptors", extra={
                "tenant": p.tenant if (p := self.auth.of_token(token)) else None,
                "peer_uid": p.uid if p else None, "fds": count, "reason": str(e)})
            await self._send(conn, {"ok": False, "code": e.code.name, "error": str(e)})
            return
        await self._send(conn, {"ok": True, "handles": handles})

    async def _open(self, conn: socket.socket, token: str, msg: dict[str, Any]) -> None:
        """Send the caller a descriptor of one of its tenant's files, or say why not (the
        connection stays either way)."""
        path = msg.get("path")
        p = self.auth.of_token(token)
        try:
            if p is None or self.files is None:
                raise StoreError(Code.FAILED_PRECONDITION, "this daemon hands out no files")
            if not isinstance(path, str) or not path:
                raise StoreError(Code.INVALID_ARGUMENT, "open needs a path (a pool_path or key_table_path the "
                                                        "daemon named)")
            fd = self.files(p, path)
        except StoreError as e:
            await self._send(conn, {"ok": False, "code": e.code.name, "error": str(e)})
            return
        try:
            await self._send_fd(conn, {"ok": True, "fds": 1}, fd)
        finally:
            os.close(fd)

    async def _lookup_counters(self, conn: socket.socket, token: str, fds: list[int]) -> None:
        """Take the client's lookup counters region (the one descriptor sent with the message),
        or say why not (the connection stays either way)."""
        p = self.auth.of_token(token)
        if not fds:
            raise _Refused("INVALID_ARGUMENT", "lookup_counters: send the region's descriptor with the message")
        fd = fds.pop(0)
        try:
            if p is None or self.lookups is None:
                os.close(fd)
                raise StoreError(Code.FAILED_PRECONDITION, "this daemon takes no lookup counters")
            self.lookups.attach(token, p, fd)  # closes fd
        except StoreError as e:
            await self._send(conn, {"ok": False, "code": e.code.name, "error": str(e)})
            return
        await self._send(conn, {"ok": True})

    @staticmethod
    async def _send_fd(conn: socket.socket, obj: dict[str, Any], fd: int) -> None:
        data = frame(obj)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        loop = asyncio.get_running_loop()
        while True:
            try:
                sent = conn.sendmsg([data], anc)
                break
            except (BlockingIOError, InterruptedError):
                await _until_ready(conn, writable=True)
        if sent < len(data):  # the descriptor went with the first byte
            await loop.sock_sendall(conn, data[sent:])

    async def _message(self, conn: socket.socket, buf: bytearray, fds: list[int]) -> dict[str, Any] | None:
        """The next message (descriptors that came with it appended to ``fds``); None at EOF."""
        while (msg := unframe(buf)) is None:
            data = await self._recv(conn, fds)
            if not data:
                return None
            buf += data
            if len(fds) > MAX_FDS:
                raise _Refused("INVALID_ARGUMENT", f"more than {MAX_FDS} descriptors sent at once")
        return msg

    async def _recv(self, conn: socket.socket, fds: list[int]) -> bytes:
        while True:
            try:
                data, anc, flags, _ = conn.recvmsg(MAX_FRAME + 4, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                await _until_ready(conn, writable=False)
                continue
            got = fds_of(anc)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise _Refused("INVALID_ARGUMENT", f"more than {MAX_FDS} descriptors sent at once")
            if got and (free := free_fds()) < self.fd_reserve:
                for fd in got:  # closed at once: the reserve is for accepting, handshakes and disk I/O
                    fds.remove(fd)
                    os.close(fd)
                self._count(Count.PASSED_FDS_REFUSED, len(got))
                log.warning("credential socket: refused passed descriptors: the process is at its reserve",
                            extra={"fds": len(got), "free_fds": free, "fd_reserve": self.fd_reserve})
                raise _Refused("RESOURCE_EXHAUSTED", f"the daemon has {free} file descriptors left of its "
                                                     f"RLIMIT_NOFILE, under its reserve of {self.fd_reserve} "
                                                     f"(--fd-reserve): passed descriptors are refused")
            return data

    @staticmethod
    async def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
        await asyncio.get_running_loop().sock_sendall(conn, frame(obj))

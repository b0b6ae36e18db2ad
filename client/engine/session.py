"""The session: one ``Node.Session`` stream per client, opened on first need and held until the client closes it.

Its lifetime is the session's: once the stream ends (close, exit, kill, a daemon restart) the
daemon has reclaimed every grant, pin, KV registration and device block report made under it.
The daemon's epoch comes with it, so that a daemon restart (new epoch, or the stream ended)
can be told from a refusal by the same daemon
(:meth:`kvtier.client.engine.transport.Transport.restarted`). The stream is also how a client
learns at once that its daemon died (:attr:`_Session.ended`): the kernel closes a killed
daemon's connections. Opening waits for the daemon at most the transport's timeout.

:class:`SessionStream` serves the blocking transport, :class:`AsyncSessionStream` the asyncio one.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from typing import Any

import grpc

from kvtier.client.engine.auth import Identity
from kvtier.client.engine.endpoint import Endpoint
from kvtier.client.engine.errors import DeadlineExceeded, KvtierError, Unavailable, rpc_error
from kvtier.proto import node_pb2


class _Session:
    """What both session streams hold: the stream, and what the daemon said when it opened.

    ``endpoint``: checked before opening, and names the daemon in errors; ``timeout``: the
    longest wait for the daemon to open the stream (None: no limit)."""

    def __init__(self, node: Any, client_name: str, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        self._node = node
        self.identity: Identity | None = None  # set by the transport: the token the stream carries
        self.client_name = client_name
        self._endpoint = endpoint
        self._timeout = timeout
        self._call: Any = None
        self._done = [True]  # [the stream has ended]: set by its done callback (cheaper than call.done())
        self.session_id = 0
        self.node_id = ""
        self.epoch = 0  # kept when the session is dropped: a later answer is compared with it

    @property
    def alive(self) -> bool:
        """Open, and its stream has not ended (the session of an ended stream is gone)."""
        return self._call is not None and not self._done[0]

    @property
    def ended(self) -> bool:
        """Opened, and its stream has ended since without :meth:`close`: the daemon closed it,
        died (the kernel closes a killed process's connections) or restarted. Everything held
        under it is gone, and so is anything else the daemon it lived on published. (An asyncio
        client sees it once its event loop has run.)"""
        return self._call is not None and self._done[0]

    def _check(self) -> None:
        if self._endpoint is not None:
            self._endpoint.check()
        if self.identity is not None:
            self.identity.refresh()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self.identity.metadata() if self.identity is not None else ()

    def _error(self, e: grpc.RpcError) -> KvtierError:
        return self._endpoint.error(e) if self._endpoint is not None else rpc_error(e)

    def _expired(self) -> KvtierError:
        if self._endpoint is not None:
            return self._endpoint.expired(self._timeout, "open a session")
        return DeadlineExceeded(f"the daemon did not open a session within {self._timeout:g} s")

    def _hello(self) -> node_pb2.SessionClientMessage:
        return node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name=self.client_name,
                                                                         pid=os.getpid()))

    def _opened(self, call: Any, msg: Any) -> int:
        if not isinstance(msg, node_pb2.SessionServerMessage) or not msg.HasField("opened"):
            call.cancel()
            target = f" at {self._endpoint.target}" if self._endpoint is not None else ""
            raise Unavailable(f"kvtierd{target} ended the session stream before opening it")
        done = self._done = [False]
        call.add_done_callback(lambda _call: done.__setitem__(0, True))  # at once if it has ended
        self._call = call
        self.session_id = msg.opened.session_id
        self.node_id = msg.opened.node_id
        self.epoch = msg.opened.epoch
        return self.session_id


class SessionStream(_Session):
    """The blocking client's session: the stream's requests are a generator that waits (on a
    gRPC thread) until :meth:`close`."""

    def __init__(self, node: Any, client_name: str, lock: threading.RLock, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(node, client_name, endpoint, timeout)
        self._lock = lock
        self._queue: queue.Queue | None = None

    def open(self) -> int:
        """The session id, opening the stream first if none is open (one for concurrent callers).

        Raises :class:`Unavailable` at once when no daemon is at the socket; waits for the
        daemon to open it at most the timeout."""
        if self._call is not None:
            return self.session_id
        with self._lock:
            if self._call is not None:
                return self.session_id
            self._check()
            q: queue.Queue = queue.Queue()
            hello = self._hello()

            def requests() -> Any:
                yield hello
                while q.get() is not None:
                    pass

            call = self._node.Session(requests(), wait_for_ready=True, timeout=None, metadata=self._metadata())
            expired = threading.Event()
            timer = None
            if self._timeout is not None:  # the stream has no deadline: only its opening is bounded

                def expire() -> None:
                    expired.set()
                    call.cancel()

                timer = threading.Timer(self._timeout, expire)
                timer.daemon = True
                timer.start()
            try:
                msg = next(call, None)
            except grpc.RpcError as e:
                q.put(None)
                raise (self._expired() if expired.is_set() else self._error(e)) from None
            finally:
                if timer is not None:
                    timer.cancel()
            if expired.is_set():  # it fired just as the daemon answered: the stream is cancelled
                q.put(None)
                raise self._expired()
            if msg is None:  # ended without a message or an error: _opened says so
                q.put(None)
            else:
                self._queue = q
            return self._opened(call, msg)

    def drop_if_ended(self) -> bool:
        """:meth:`close` the session if its stream has ended (nothing is lost: the daemon already
        reclaimed what it held), so that the next :meth:`open` opens a new one; True if it
        did. Skipped while another thread holds the lock (it is opening or recovering)."""
        if not self.ended or not self._lock.acquire(blocking=False):
            return False
        try:
            if not self.ended:
                return False
            self.close()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the stream: the daemon reclaims everything held under the session."""
        if self._queue is not None:
            self._queue.put(None)
        if self._call is not None:
            self._call.cancel()
        self._queue = self._call = None
        self.session_id = 0


class AsyncSessionStream(_Session):
    """The asyncio client's session."""

    def __init__(self, node: Any, client_name: str, lock: asyncio.Lock, endpoint: Endpoint | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(node, client_name, endpoint, timeout)
        self._lock = lock

    async def open(self) -> int:
        """As :meth:`SessionStream.open`."""
        if self._call is not None:
            return self.session_id
        async with self._lock:
            if self._call is not None:
                return self.session_id
            self._check()
            call = self._node.Session(wait_for_ready=True)  # the channel's interceptor adds the token

            async def first() -> Any:
                await call.write(self._hello())
                return await call.read()

            try:
                msg = await asyncio.wait_for(first(), self._timeout)
            except asyncio.TimeoutError:
                call.cancel()
                raise self._expired() from None
            except grpc.RpcError as e:
                call.cancel()
                raise self._error(e) from None
            return self._opened(call, msg)

    def drop_if_ended(self) -> bool:
        """As :meth:`SessionStream.drop_if_ended` (one event loop: no other opener can interleave)."""
        if not self.ended:
            return False
        self.close()
        return True

    def close(self) -> None:
        """As :meth:`SessionStream.close`."""
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self.session_id = 0

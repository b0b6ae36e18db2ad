"""The gateway's client to its replicas: keep-alive HTTP/1.1 on asyncio protocols.

Per replica address a pool of connections kept open between requests (most recently used
first; one idle past ``keepalive_s`` is closed when next looked at). A request is written in
one write, head and body together; the answer is parsed by httptools (llhttp, the parser of
Node.js) and handed over as it arrives: :meth:`Answer.readany` returns what came since the
last call (a chunked answer's data without its chunk framing, as any HTTP client hands it
over), b"" at its end. Reading pauses while more than ``buffer_bytes`` wait unread (a client
slow to take its answer slows the replica's socket, not the gateway's memory).

A connection taken from the pool that the replica closes before any byte of the answer (it
dropped the idle connection as the request went out) is not the replica refusing: the
request is sent again on a new connection, once. Otherwise, a connection refused, reset or
closed, or an answer HTTP cannot parse, raises :class:`UpstreamError`; no connection within
``connect_timeout_s``, or no byte of the answer for ``read_timeout_s``, raises
``asyncio.TimeoutError``. An answer not read to its end when released closes its connection
(the replica sees its client go).

``https://`` replicas, and URLs with credentials, go through aiohttp's client instead
(:class:`AiohttpUpstream`, the same interface): TLS and basic auth are its.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = ["Answer", "Replica", "Upstream", "UpstreamError"]

_HOST = b"Host"


class UpstreamError(ConnectionError):
    """The replica refused, reset or closed the connection, or sent what HTTP cannot parse."""


class _Stale(Exception):
    """A reused connection closed before any byte of its answer."""


class Replica:
    """A replica's base URL, split once: where to connect, its Host header, its path prefix."""

    __slots__ = ("base", "host", "port", "netloc", "prefix", "plain")

    def __init__(self, base: str) -> None:
        u = urlsplit(base)
        self.base = base
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.netloc = u.netloc.rpartition("@")[2].encode("idna")
        self.prefix = u.path.rstrip("/").encode()
        self.plain = u.scheme == "http" and "@" not in u.netloc  # (else: aiohttp's client)


class Answer:
    """A replica's answer: status, headers, and its body as it arrives."""

    __slots__ = ("status", "reason", "raw_headers", "content_length", "_conn", "_chunks", "_buffered", "_done",
                 "_error", "_waiter", "_read_timeout", "_released", "_framed")

    def __init__(self, conn: _Conn, status: int, reason: str, raw_headers: list[tuple[bytes, bytes]],
                 content_length: int | None, framed: bool, read_timeout: float) -> None:
        self.status, self.reason, self.raw_headers = status, reason, raw_headers
        self.content_length = content_length
        self._framed = framed  # (a length or chunked: its end is known; else it ends when the connection does)
        self._conn: _Conn | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._read_timeout = read_timeout
        self._released = False

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The headers as (name, value) strings (UTF-8, undecodable bytes kept as surrogates)."""
        return [(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                for k, v in self.raw_headers]

    def header(self, name: str, default: str = "") -> str:
        """The first header of that name (any case), else ``default``."""
        low = name.lower().encode()
        for k, v in self.raw_headers:
            if k.lower() == low:
                return v.decode("utf-8", "surrogateescape")
        return default

    # -- fed by the connection ------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        conn = self._conn
        if conn is not None and self._buffered > conn.buffer_bytes:
            conn.pause()
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        if error is not None and not self._done:
            self._error = error
        self._done = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- read by the gateway --------------------------------------------------------------

    async def readany(self) -> bytes:
        """What arrived since the last call (waiting for some); b"" at the answer's end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        if len(self._chunks) == 1:
            data = self._chunks.popleft()
        else:
            data = b"".join(self._chunks)
            self._chunks.clear()
        self._buffered = 0
        if self._conn is not None:
            self._conn.resume()
        return data

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (waiting for some); b"" at the answer's end."""
        data = await self.readany()
        if len(data) > n:
            self._chunks.appendleft(data[n:])
            self._buffered = len(data) - n
            data = data[:n]
        return data

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(self._read_timeout, _time_out, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the answer was read to
        its end and the replica keeps it open, else it is closed."""
        if self._released:
            return
        self._released = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._error is None and not self._chunks and conn.reusable():
            conn.idle()
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection now (the replica sees its client go)."""
        conn, self._conn = self._conn, None
        self._released = True
        if conn is not None:
            conn.close()


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class _Conn(asyncio.Protocol):
    """One kept-alive connection to a replica and the answer it is reading."""

    def __init__(self, pool: Upstream, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.buffer_bytes = pool.buffer_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.waiter: asyncio.Future | None = None  # the head of the answer, awaited by request()
        self.got_bytes = False
        self.lost = False
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._reason = ""
        self._headers: list[tuple[bytes, bytes]] = []
        self._length: int | None = None
        self._chunked = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover
                pass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.waiter is None and self.answer is None:  # (bytes nobody asked for: the connection is unusable)
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed answer: {e}"))
            self.close()

    def eof_received(self) -> bool:
        a = self.answer
        if a is not None and not a._done and not a._framed:  # its body ends with the connection
            self.complete = True
            a._end()
        return False  # (the transport closes: connection_lost follows)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.transport = None
        self.pool._forget(self)
        if self.waiter is not None and not self.waiter.done():
            if not self.got_bytes:
                self.waiter.set_exception(_Stale())
            else:
                self.waiter.set_exception(UpstreamError(f"connection closed mid-head: {exc or 'EOF'}"))
        a = self.answer
        if a is not None and not a._done:
            if not a._framed:
                a._end()
            else:
                a._end(UpstreamError(f"the replica closed the connection mid-answer: {exc or 'EOF'}"))

    # -- httptools callbacks --------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        low = name.lower()
        if low == b"content-length":
            try:
                self._length = int(value)
            except ValueError:
                self._length = None
        elif low == b"transfer-encoding" and b"chunked" in value.lower():
            self._chunked = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._reason, self._headers, self._length, self._chunked = "", [], None, False
            return
        framed = self._chunked or self._length is not None or status in (204, 304)
        a = Answer(self, status, self._reason, self._headers, None if self._chunked else self._length, framed,
                   self.pool.read_timeout_s)
        self.answer = a
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(a)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._feed(body)

    def on_message_complete(self) -> None:
        a = self.answer
        if a is None:  # (the end of an interim answer)
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        a._end()

    # -- the pool's side ------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)
        if self.answer is not None:
            self.answer._end(error)

    def send(self, data: bytes) -> asyncio.Future:
        """Write a request; the future its answer's head resolves."""
        self.waiter = asyncio.get_running_loop().create_future()
        self.got_bytes = self.complete = self.keep_alive = False
        self.answer = None
        self._reason, self._headers, self._length, self._chunked = "", [], None, False
        self.transport.write(data)  # type: ignore[union-attr]
        return self.waiter

    def reusable(self) -> bool:
        return (not self.lost and self.complete and self.keep_alive and self.transport is not None
                and not self.transport.is_closing())

    def idle(self) -> None:
        self.answer = None
        self.resume()
        self.idle_since = time.monotonic()
        self.pool._idle(self)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.answer = None
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.abort()  # (no lingering: the replica sees the close at once)
            self.transport = None


class Upstream:
    """Keep-alive pools of HTTP/1.1 connections to the replicas."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 60.0,
                 max_idle_per_replica: int = 256, buffer_bytes: int = 1 << 18) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.keepalive_s, self.max_idle = keepalive_s, max_idle_per_replica
        self.buffer_bytes = buffer_bytes
        self._pools: dict[tuple[str, int], list[_Conn]] = {}
        self._closed = False
        self.connects = 0  # connections opened (tests read it: kept-alive ones are reused)

    async def post(self, replica: Replica, target: bytes, headers: bytes, body: bytes,
                   timeout: float | None = None) -> Answer:
        """POST ``body`` to ``target`` (the path and query, after the replica's prefix) with
        ``headers`` (``Name: value\\r\\n`` lines, no Host nor Content-Length: those are added);
        the answer once its head arrived. ``timeout``: the longest wait for the head from now,
        connecting included (asyncio.TimeoutError)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + (self.read_timeout_s if timeout is None else timeout)
        data = b"".join((b"POST ", replica.prefix, target, b" HTTP/1.1\r\nHost: ", replica.netloc, b"\r\n", headers,
                         b"Content-Length: %d\r\n\r\n" % len(body), body))
        key = (replica.host, replica.port)
        while True:
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key, due)
            try:
                head = conn.send(data)
                return await _within(head, min(self.read_timeout_s, due - loop.time()))
            except _Stale:
                conn.close()
                if reused:
                    continue  # the replica had dropped the idle connection: a new one
                raise UpstreamError("the replica closed the connection before answering") from None
            except BaseException:
                conn.close()
                raise

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._pools.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if (conn.transport is not None and not conn.lost and not conn.transport.is_closing()
                    and now - conn.idle_since < self.keepalive_s):
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], due: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await _within(loop.create_connection(lambda: _Conn(self, key), key[0], key[1]),
                                    min(self.connect_timeout_s, due - loop.time()))
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"no connection to {key[0]}:{key[1]} within {self.connect_timeout_s:g} s") \
                from None
        except OSError as e:  # (refused, unreachable, no such host)
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {e.strerror or e}") from None
        self.connects += 1
        return conn

    def _idle(self, conn: _Conn) -> None:
        if self._closed:
            conn.close()
            return
        idle = self._pools.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            idle.pop(0).close()
        idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        idle = self._pools.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self, replica: Replica) -> int:
        return len(self._pools.get((replica.host, replica.port), ()))

    async def close(self) -> None:
        self._closed = True
        for idle in list(self._pools.values()):
            for conn in list(idle):
                conn.close()
        self._pools.clear()


_deadline = getattr(asyncio, "timeout", None)


async def _within(aw: Any, timeout: float) -> Any:
    if _deadline is None:  # pragma: no cover (Python 3.10)
        return await asyncio.wait_for(aw, timeout)
    async with _deadline(timeout):
        return await aw


class _AiohttpAnswer:
    """An aiohttp ClientResponse as an :class:`Answer`."""

    __slots__ = ("_up", "status", "reason", "raw_headers", "content_length")

    def __init__(self, up: Any) -> None:
        self._up = up
        self.status, self.reason, self.raw_headers = up.status, up.reason, list(up.raw_headers)
        self.content_length = up.content_length

    headers = Answer.headers
    header = Answer.header

    async def readany(self) -> bytes:
        return await _aiohttp_call(self._up.content.readany())

    async def read(self, n: int) -> bytes:
        return await _aiohttp_call(self._up.content.read(n))

    def release(self) -> None:
        self._up.release()

    def close(self) -> None:
        self._up.close()


async def _aiohttp_call(aw: Any) -> Any:
    import aiohttp  # noqa: PLC0415

    try:
        return await aw
    except asyncio.TimeoutError:
        raise
    except aiohttp.ClientError as e:
        raise UpstreamError(f"{type(e).__name__}: {e}") from None


class AiohttpUpstream:
    """aiohttp's client, for the replicas :class:`Upstream` does not serve (TLS, credentials)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 60.0) -> None:
        import aiohttp  # noqa: PLC0415

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s), auto_decompress=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s))

    async def post(self, replica: Replica, target: bytes, headers: bytes, body: bytes,
                   timeout: float | None = None) -> _AiohttpAnswer:
        from multidict import CIMultiDict  # noqa: PLC0415

        h: CIMultiDict = CIMultiDict()
        for line in headers.split(b"\r\n"):
            if line:
                k, _, v = line.partition(b":")
                h.add(k.decode("utf-8", "surrogateescape"), v.strip().decode("utf-8", "surrogateescape"))
        url = replica.base + target.decode("utf-8", "surrogateescape")
        from yarl import URL  # noqa: PLC0415

        call = _aiohttp_call(self.session.post(URL(url, encoded=True), data=body, headers=h))
        up = await (call if timeout is None else _within(call, timeout))
        return _AiohttpAnswer(up)

    async def close(self) -> None:
        await self.session.close()

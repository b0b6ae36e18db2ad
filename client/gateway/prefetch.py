"""The gateway applies the router's fetch hints before it forwards a request.

When the ``kvtier`` policy's router sends a request to a replica that holds less of its prefix
than another node (the holder is loaded, this one is free), the dispatch decision carries
:class:`~kvtier.client.routing.fetch.FetchHint`\\ s: which keys, from which node. Before the
request goes to the replica, :meth:`Prefetcher.apply` asks the replica's kvtierd
(``Node.Prefetch`` with ``from_node``) to fetch those keys from the holder into its host tier,
so the engine's connector finds them there at prefill.

* **Where**: the replica's node is the one the feeds report for its worker id; the call goes
  over the daemon address the gateway's feed for that node uses (a unix socket locally; TCP
  with ``--daemon-tls-*`` mutual TLS to a daemon started with ``--tcp-services all``, which
  serves Node over TCP; the daemon maps the gateway's certificate CN to the tenant it acts
  for, ``--tenants cn:GATEWAY=TENANT``). One channel per address, kept. A channel is opened
  off the event loop: over a unix socket :func:`~kvtier.client.engine.transport.open_channel`
  hand-shakes on the daemon's credential socket with blocking calls (up to 2 s each against a
  daemon that is stopped or stuck), and so does the re-handshake after a daemon restart, which
  is done here in a thread before the channel is used again; requests that need the same
  address meanwhile wait for that one handshake, and every wait is within the request's
  ``--prefetch-timeout-s``.
* **Which layout**: ``Node.Prefetch`` names a layout id; a layout's id is its fingerprint's
  first 31 bits on every daemon (:func:`~kvtier.client.routing.fetch.layout_id_of`), and the
  fingerprints come from the feeds (:func:`~kvtier.client.routing.fetch.hint_fingerprints`).
  The replica's engine must have registered the layout on its daemon (it has, once it stored
  a block); otherwise the daemon refuses (counted ``error``).
* **Bounded**: all hints of a request are asked at once and waited for at most
  ``--prefetch-timeout-s``; what has not answered by then is abandoned (counted ``timeout``)
  and the request goes on: the engine recomputes what is missing. (The daemon finishes a
  prefetch it started even when the caller gives up, so the blocks still land for later
  turns.)
* **The store**: a hint whose keys only the shared store holds (``from_node`` ``"store"``) is
  not sent (``Node.Prefetch`` fetches from peers only); the replica's kvtierd reads them
  through from the store on the engine's get (``--store-read-through``). Counted ``store``.
* **Counted**: ``kvtier_gateway_prefetches_total{outcome}`` (``done``, ``timeout``, ``error``,
  ``no_layout``, ``no_daemon``, ``store``), ``kvtier_gateway_prefetched_blocks_total``,
  ``kvtier_gateway_prefetch_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvtier.client.engine.transport import (
    ClientTls,
    KvtierError,
    async_token_interceptors,
    handshake_error,
    open_channel,
    unix_socket,
)
from kvtier.client.routing.feed import channel_options
from kvtier.client.routing.fetch import STORE, FetchHint, layout_id_of
from kvtier.handshake import Credentials, HandshakeError
from kvtier.proto import node_pb2, node_pb2_grpc

log = logging.getLogger("kvtier.gateway")

CLIENT_NAME = "kvtier-gateway"


def _handshake(creds: Credentials) -> Credentials:
    """In a thread: ``creds`` connected to its daemon (re-connected if the daemon closed it)."""
    try:
        creds.ensure()
    except HandshakeError as e:
        raise handshake_error(e) from None
    return creds


class Prefetcher:
    """Applies fetch hints through the replicas' kvtierds (module docstring)."""

    def __init__(self, router: Any, tls: ClientTls | None, timeout_s: float, metrics: Any) -> None:
        self.router, self.tls, self.timeout_s, self.metrics = router, tls, timeout_s, metrics
        self._channels: dict[str, Any] = {}
        self._opening: dict[str, asyncio.Future] = {}  # target -> the handshake in a thread
        self._warned: dict[str, float] = {}

    async def apply(self, hints: Sequence[FetchHint]) -> None:
        """Prefetch every hint at once; returns after they answered or ``timeout_s``."""
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(self._one(h)) for h in hints]
        try:
            _, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        for t in pending:
            t.cancel()
            self.metrics.prefetches.labels("timeout").inc()
        self.metrics.prefetch_seconds.observe(time.perf_counter() - t0)

    def _address(self, worker: str) -> tuple[str, str] | None:
        """(target, DNS name) of the feed that serves the worker's node, when one is connected."""
        node = dict(self.router.workers()).get(worker)
        if not node:
            return None
        for st in self.router.status():
            if st.node_id == node and st.connected:
                return st.target, st.name
        return None

    async def _channel(self, target: str, name: str) -> Any:
        """The channel to ``target``. Over a unix socket, hand-shaken (and hand-shaken again
        once the daemon closed its credential connection) in a thread, never on the event loop;
        callers meanwhile share that one handshake."""
        path = unix_socket(target)
        if path is None:  # TCP: nothing blocking (TLS is gRPC's own, on its loop)
            ch = self._channels.get(target)
            if ch is None:
                ch = self._channels[target] = open_channel(target, aio=True, tls=self.tls, client_name=CLIENT_NAME,
                                                           options=channel_options(self.tls, name), timeout=2.0)
            return ch
        opening = self._opening.get(target)
        if opening is None:
            ch = self._channels.get(target)
            if ch is not None and ch.kvtier_credentials.alive:  # (one non-blocking peek; no handshake runs)
                return ch
            creds = ch.kvtier_credentials if ch is not None else Credentials(path, CLIENT_NAME, 2.0)
            opening = self._opening[target] = asyncio.get_running_loop().run_in_executor(None, _handshake, creds)
            opening.add_done_callback(lambda f: self._handshaken(target, f))
        creds = await asyncio.shield(opening)  # (a caller that gives up leaves the handshake to the others)
        ch = self._channels.get(target)
        if ch is None or ch.kvtier_credentials is not creds:
            # the token as the handshake left it: the calls never hand-shake on the loop themselves
            ch = grpc.aio.insecure_channel(target, options=channel_options(self.tls, name),
                                           interceptors=async_token_interceptors(lambda: creds.metadata))
            ch.kvtier_credentials = creds
            self._channels[target] = ch
        return ch

    def _handshaken(self, target: str, f: asyncio.Future) -> None:
        self._opening.pop(target, None)
        if not f.cancelled():
            f.exception()  # (its waiters may all have given up: retrieved here, reported by them)

    async def _one(self, hint: FetchHint) -> None:
        m = self.metrics
        if hint.from_node == STORE:  # Prefetch fetches from peers only; the daemon reads the store
            m.prefetches.labels("store").inc()  # through on the engine's get (--store-read-through)
            return
        addr = self._address(hint.worker)
        if addr is None:
            m.prefetches.labels("no_daemon").inc()
            return
        fps = self.router.hint_fingerprints(hint)
        if not fps:
            m.prefetches.labels("no_layout").inc()
            return
        try:
            stub = node_pb2_grpc.NodeStub(await self._channel(*addr))
            replies = await asyncio.gather(*(stub.Prefetch(node_pb2.PrefetchRequest(
                layout_id=layout_id_of(fp), keys=list(hint.keys), from_node=hint.from_node)) for fp in fps))
        except (grpc.RpcError, KvtierError, OSError) as e:
            m.prefetches.labels("error").inc()
            self._warn(addr[0], hint, e)
            if isinstance(e, KvtierError | OSError):  # the handshake failed: try a fresh channel next time
                self._channels.pop(addr[0], None)
            return
        m.prefetches.labels("done").inc()
        m.prefetched_blocks.inc(sum(r.promoted for r in replies))

    async def retain(self, worker: str, keys: Sequence[bytes], retains: Sequence[tuple[int, float]], priority: int,
                     timeout_s: float) -> None:
        """Ask ``worker``'s kvtierd to retain ``keys[:n]`` for ``ttl`` seconds, for each
        (n, ttl) of ``retains``, under every layout the worker's node publishes (or the worker
        declared); waits at most ``timeout_s``. Never raises: the outcome is counted
        (``kvtier_gateway_retains_total``), once a request."""
        m = self.metrics
        addr = self._address(worker)
        if addr is None:
            m.retains.labels("no_daemon").inc()
            return
        node = dict(self.router.workers()).get(worker, "")
        fps = self.router.hint_fingerprints(FetchHint(worker, node, ()))
        if not fps:
            m.retains.labels("no_layout").inc()
            return
        try:
            async with asyncio.timeout(timeout_s):
                stub = node_pb2_grpc.NodeStub(await self._channel(*addr))
                replies = await asyncio.gather(*(stub.Retain(node_pb2.RetainRequest(
                    layout_id=layout_id_of(fp), keys=list(keys[:n]), ttl_s=ttl, priority=priority))
                    for fp in fps for n, ttl in retains), return_exceptions=True)
        except TimeoutError:
            m.retains.labels("timeout").inc()
            return
        except (KvtierError, OSError) as e:  # the handshake failed: a fresh channel next time
            self._channels.pop(addr[0], None)
            replies = [e]
        failed = [r for r in replies if isinstance(r, BaseException)]
        refused = [r for r in failed if isinstance(r, grpc.aio.AioRpcError)
                   and r.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)]
        m.retains.labels("refused" if refused else "error" if failed else "retained").inc()
        m.retained_blocks.inc(sum(r.retained for r in replies if not isinstance(r, BaseException)))
        if failed:
            self._warn(addr[0], f"retain of {len(keys)} blocks on {worker}'s kvtierd", failed[0])

    def _warn(self, target: str, what: FetchHint | str, e: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned.get(target, -60.0) >= 10.0:  # at most every 10 s per daemon
            self._warned[target] = now
            msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            if isinstance(what, str):
                log.warning(f"{what} ({target}) failed: {msg}")
                return
            log.warning(f"prefetch of {len(what.keys)} blocks from {what.from_node} on {what.worker}'s kvtierd "
                        f"({target}) failed: {msg}")

    async def close(self) -> None:
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
            creds = getattr(ch, "kvtier_credentials", None)
            if creds is not None:
                creds.close()
        self._channels.clear()

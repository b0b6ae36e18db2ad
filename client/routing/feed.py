"""The location feeds a router follows: one ``WatchLocations`` stream per daemon.

Owns
    * the targets: static ones (a socket path, ``unix:/path`` or ``host:port``; a path is
      anything that starts with ``/``, ``.`` or ``~`` or names an existing file, see
      :func:`feed_target`) and the addresses DNS names
      resolve to (resolved again every ``resolve_interval_s``; an address that disappears
      takes its node out of the index);
    * per target, a stream that starts from its node's position in the index and reconnects
      with backoff (``reconnect_min_s`` doubling up to ``reconnect_max_s``); the daemon
      answers with the events after that position or a snapshot, so the index never has a
      gap or a duplicate. A feed that breaks the contract loses its position and starts
      again from a snapshot;
    * which target serves which node (a node that a second, connected feed already serves is
      refused on the second), and each node's last epoch: a new epoch (the daemon restarted)
      is counted, logged and passed to ``on_epoch_change``; its snapshot replaces the node's
      state;
    * a :class:`FeedStatus` per target;
    * silence: a daemon sends a heartbeat every 5 s on an idle stream, so a feed that hears
      nothing for ``node_timeout_s`` (a daemon stopped, hung, or cut off without a reset)
      drops its node from the index at once (its columns are given back: see
      :meth:`~kvtier.client.routing.index.LocationIndex.drop_node`) and reconnects; the node
      comes back from a snapshot when the daemon answers again (a new epoch if it restarted).

Folding a message into the index is the index's
(:meth:`~kvtier.client.routing.index.LocationIndex.fold`); this module decides which node a
message belongs to and keeps the streams going. Nodes of a loaded state that no feed of this
run serves (a static target dropped, an address gone from DNS) are forgotten once the static
feeds are started and every DNS name has resolved once.

Backpressure and fairness
    Each stream's reader only queues what it reads: its feed's *inbox*, bounded at
    ``queue_keys`` keys. One folder task folds the inboxes in turns, one *piece* of a message
    (at most ``fold_keys`` keys: an event batch or a snapshot part split between events,
    :func:`pieces`) per feed per turn, taking the lock for that piece only, so a flooding
    daemon gets one turn as every other feed does, and a decision waits at most for one
    piece's fold. An event batch that does not fit the inbox *overflows* it: what it held is
    dropped (``FeedStatus.dropped_events``, ``overflows``), the node's position is given up and
    the feed subscribes again, from a snapshot of its daemon, as after a broken contract. A
    snapshot part or a NodeInfo that does not fit waits for room instead (the daemon's flow
    control then holds the stream back; the daemon drops a subscriber that falls behind its
    ring, and the feed resumes or takes a snapshot). A new subscription starts with an empty
    inbox (what the old stream left is sent again after the position).

Threading: the streams run on a private asyncio loop in a background thread
(:meth:`Feeds.start`); every piece is folded under the lock given, which the router also
routes under.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvtier.client.engine.transport import ClientTls, KvtierError, open_channel
from kvtier.client.routing.index import FoldError, LocationIndex
from kvtier.proto import locations_pb2, locations_pb2_grpc

log = logging.getLogger("kvtier.router")

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.keepalive_time_ms", 10000),
                    ("grpc.keepalive_timeout_ms", 5000)]

Resolve = Callable[[str, int], Awaitable[list[str]]]

_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def feed_target(target: str) -> str:
    """A daemon target as gRPC takes it: a plain socket path (starting with ``/``, ``.`` or
    ``~``, or naming an existing file) becomes ``unix:`` and its absolute path; a target with
    a scheme (``unix:PATH``, ``dns:...``) and ``HOST:PORT`` stay as they are."""
    t = target.strip()
    if t.startswith(_SCHEMES):
        return t
    if t.startswith(("/", ".", "~")) or os.path.exists(t):
        return "unix:" + os.path.abspath(os.path.expanduser(t))
    return t


@dataclass
class FeedStatus:
    """Where one feed stands (for tools and tests)."""

    target: str
    node_id: str = ""
    connected: bool = False
    epoch: int = 0           # the daemon run this feed follows
    seq: int = 0             # the last event folded
    head_seq: int = 0        # the daemon's newest event, as last told
    snapshots: int = 0       # how often a snapshot was folded instead of resuming
    resumes: int = 0         # how often the stream resumed after its last event
    epoch_changes: int = 0   # daemon restarts seen
    last_error: str = ""
    name: str = ""           # the DNS name this address was resolved from ("": a static target)
    queued_keys: int = 0     # keys of messages read, waiting to be folded
    dropped_events: int = 0  # events dropped by inbox overflows
    overflows: int = 0       # inbox overflows (each followed by a snapshot)

    @property
    def synced(self) -> bool:
        return self.connected and self.epoch != 0 and self.seq >= self.head_seq


def _hint(target: str, msg: str) -> str:
    """What to check, for the usual reasons a feed cannot connect."""
    if target.startswith("unix:") and "No such file" in msg:
        return f" (is kvtierd running with --socket {target[5:]}?)"
    if target.startswith("unix:") and "ermission denied" in msg:
        return " (the socket is owner-only: run as the daemon's user)"
    if "resolv" in msg or "Domain name not found" in msg:
        return " (not a resolvable HOST:PORT; a unix socket is a path or unix:PATH)"
    return ""


def channel_options(tls: ClientTls | None, name: str = "", base: Sequence[tuple[str, object]] = ()) -> list:
    """gRPC channel options for a daemon address: ``base``, and over TLS to an address a DNS
    ``name`` resolved to, ``grpc.ssl_target_name_override`` = the name, so the daemon's
    certificate is checked against the name (a Kubernetes pod's certificate names its Service,
    not the pod IP the feed dials). A name that is itself an IP address needs none."""
    opts = list(base)
    if tls is not None and name and not _is_ip(name):
        opts.append(("grpc.ssl_target_name_override", name))
    return opts


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


class FeedError(Exception):
    """A feed broke the protocol: locations before its NodeInfo."""


class _Overflow(Exception):
    """The feed's inbox overflowed: what it held was dropped; subscribe again from a snapshot."""


QUEUE_KEYS = 262144
"""Default bound of a feed's inbox, in keys (eight of a daemon's largest event batches)."""
FOLD_KEYS = 2048
"""Default largest piece folded under the lock at once, in keys."""
_END_S = 2.0  # seconds a stopping router waits for its streams to end before cancelling them


def _keys(reply: locations_pb2.WatchLocationsReply) -> int:
    body = reply.WhichOneof("body")
    if body == "events":
        return sum(len(ev.keys) for ev in reply.events.events) or 1
    if body == "snapshot":
        return sum(len(ev.keys) for ev in reply.snapshot.entries) or 1
    return 1


def _chunks(events: Sequence[locations_pb2.LocationEvent], max_keys: int) -> list[list]:
    out: list[list] = [[]]
    n = 0
    for ev in events:
        k = len(ev.keys)
        if out[-1] and n + k > max_keys:
            out.append([])
            n = 0
        out[-1].append(ev)
        n += k
    return out


def pieces(reply: locations_pb2.WatchLocationsReply, max_keys: int) -> list[locations_pb2.WatchLocationsReply]:
    """``reply`` as messages of at most ``max_keys`` keys each (split between events; one
    event larger than that stays whole) that fold as the message does: an event batch's
    pieces keep its epoch and head_seq, a snapshot part's keep its at_seq, the first piece
    alone is ``first`` and the last alone is ``last``. A NodeInfo, or a message within the
    bound, is itself."""
    body = reply.WhichOneof("body")
    if body not in ("events", "snapshot") or max_keys <= 0 or _keys(reply) <= max_keys:
        return [reply]
    if body == "events":
        head = reply.events.head_seq
        return [locations_pb2.WatchLocationsReply(epoch=reply.epoch, events=locations_pb2.EventBatch(
            events=chunk, head_seq=head)) for chunk in _chunks(reply.events.events, max_keys)]
    part = reply.snapshot
    chunks = _chunks(part.entries, max_keys)
    return [locations_pb2.WatchLocationsReply(epoch=reply.epoch, snapshot=locations_pb2.SnapshotPart(
        at_seq=part.at_seq, entries=chunk, first=part.first and i == 0, last=part.last and i == len(chunks) - 1))
        for i, chunk in enumerate(chunks)]


@dataclass
class _Inbox:
    """One feed's messages read and not folded yet: (generation, piece, keys, events, whether
    a snapshot piece)."""

    items: deque = field(default_factory=deque)
    keys: int = 0
    gen: int = 0            # bumped when the inbox is cleared: older pieces are not folded
    snapshot_parts: int = 0  # of the items: snapshot pieces (the feed is taking a snapshot)
    error: Exception | None = None  # the fold failed: the reader ends the stream with it
    call: object = None     # the stream being read (cancelled on a fold error)
    reading: bool = False   # its reader awaits the stream's next message
    room: asyncio.Event | None = None

    def clear(self) -> int:
        """Drop every item; the events dropped."""
        dropped = sum(item[3] for item in self.items)
        self.items.clear()
        self.keys = self.snapshot_parts = 0
        self.gen += 1
        if self.room is not None:
            self.room.set()
        return dropped


class _StreamEnded(Exception):
    """The daemon closed the stream cleanly; reconnect from the position held."""


class _DuplicateNode(Exception):
    """Two feeds claim the same node id."""


class _Silent(Exception):
    """The daemon sent nothing (not even a heartbeat) for ``node_timeout_s``."""


async def system_resolve(host: str, port: int) -> list[str]:
    """The system resolver's addresses for ``host``."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({ai[4][0] for ai in infos})


class Feeds:
    """See the module docstring. ``subscriber``: the name daemons log for these streams."""

    def __init__(self, index: LocationIndex, lock: threading.RLock, *, daemons: Sequence[str] = (),
                 dns: Sequence[str] = (), resolve_interval_s: float = 10.0, reconnect_min_s: float = 0.1,
                 reconnect_max_s: float = 5.0, subscriber: str = "kvtier-router",
                 resolve: Resolve | None = None, tls: ClientTls | None = None, node_timeout_s: float = 0.0,
                 queue_keys: int = QUEUE_KEYS, fold_keys: int = FOLD_KEYS) -> None:
        self.index = index
        self.queue_keys, self.fold_keys = queue_keys, fold_keys  # see "Backpressure and fairness"
        self._inboxes: dict[str, _Inbox] = {}
        self._work: asyncio.Event | None = None
        self.node_timeout_s = node_timeout_s  # 0: never time a node out
        self.tls = tls  # client certificate for daemons over TCP (their --tcp with --tls-ca)
        self._lock = lock
        self.daemons = tuple(dict.fromkeys(feed_target(t) for t in daemons))
        self.dns = tuple(dns)
        self.resolve_interval_s = resolve_interval_s
        self.reconnect_min_s, self.reconnect_max_s = reconnect_min_s, reconnect_max_s
        self.subscriber = subscriber
        self._resolve = resolve or system_resolve
        self.status: dict[str, FeedStatus] = {}
        self.targets: dict[str, str] = {}       # target -> node id it served last (saved with the index)
        self._node_owner: dict[str, str] = {}   # node id -> target of the feed that serves it
        self._node_epoch: dict[str, int] = {}   # node id -> epoch of its last NodeInfo
        self._unresolved: set[str] = set()      # DNS names not yet resolved in this run
        self.foreign: set[str] = set()          # nodes another source fills (vLLM events): never forgotten here
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ending = False  # the streams are being ended (stop): a dropped one does not reconnect
        self._synced = threading.Condition(lock)
        self.on_epoch_change: Callable[[str, int, int], None] | None = None

    # -- folding --------------------------------------------------------------------------

    def apply(self, target: str, reply: locations_pb2.WatchLocationsReply) -> None:
        """Fold one message of ``target``'s feed into the index (the caller holds the lock)."""
        st = self.status.setdefault(target, FeedStatus(target))
        body = reply.WhichOneof("body")
        if body == "node":
            self._claim(target, st, reply.node)
            self.index.fold(reply.node.node_id, reply)
            return
        node = st.node_id
        if not node:
            raise FeedError("feed sent locations before its NodeInfo")
        if body == "snapshot" and reply.snapshot.first:
            st.snapshots += 1
        self.index.fold(node, reply)
        epoch, seq = self.index.position(node)
        if body == "snapshot" and reply.snapshot.last:
            st.epoch, st.seq = epoch, seq
            st.head_seq = max(st.head_seq, reply.snapshot.at_seq)
        elif body == "events":
            st.epoch, st.seq = epoch, seq
            st.head_seq = max(reply.events.head_seq, seq)
        if st.synced:
            self._synced.notify_all()

    def _claim(self, target: str, st: FeedStatus, info: locations_pb2.NodeInfo) -> None:
        """``target`` serves ``info.node_id`` from now on; notice a new epoch."""
        old = self.targets.get(target)
        if old and old != info.node_id:
            log.warning("feed now serves another node; forgetting the old one",
                        extra={"target": target, "old_node": old, "node": info.node_id})
            self.index.drop_node(old)
            self._node_owner.pop(old, None)
        owner = self._node_owner.get(info.node_id)
        if owner is not None and owner != target and self.status.get(owner, FeedStatus(owner)).connected:
            raise _DuplicateNode(f"node {info.node_id!r} is already served by feed {owner}")
        self._node_owner[info.node_id] = target
        self.targets[target] = info.node_id
        st.node_id = info.node_id
        st.head_seq = info.head_seq
        epoch, seq = self.index.position(info.node_id)
        known = self._node_epoch.get(info.node_id) or epoch
        if known and known != info.epoch:
            st.epoch_changes += 1
            log.info("daemon restarted (new epoch)", extra={"node": info.node_id, "old_epoch": known,
                                                            "epoch": info.epoch})
            if self.on_epoch_change:
                self.on_epoch_change(info.node_id, known, info.epoch)
        self._node_epoch[info.node_id] = info.epoch
        if epoch and epoch == info.epoch:  # resuming: the position stands
            st.epoch, st.seq = epoch, seq

    # -- the streams ----------------------------------------------------------------------

    def start(self, *extra: Callable[[], Awaitable[None]]) -> None:
        """Start every feed (and the coroutines ``extra``) on a background thread's loop."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._stopping = asyncio.Event()
            self._ending = False
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_until_complete(self._run(extra))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="kvtier-router-feeds", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> bool:
        """Stop every feed and the thread; False if they were not running."""
        loop, thread, stopping = self._loop, self._thread, self._stopping
        if loop is None or thread is None or stopping is None:
            return False
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stopping.set)
        thread.join(10)
        self._loop = self._thread = None
        return True

    async def _run(self, extra: Sequence[Callable[[], Awaitable[None]]]) -> None:
        self._work = asyncio.Event()
        folder = asyncio.ensure_future(self._fold_loop())
        for target in self.daemons:
            self._start_feed(target)
        self._unresolved = set(self.dns)
        if not self._unresolved:
            self._forget_unserved()
        tasks = [asyncio.ensure_future(self._resolve_loop(name)) for name in self.dns]
        tasks += [asyncio.ensure_future(job()) for job in extra]
        tasks.append(folder)
        assert self._stopping is not None
        await self._stopping.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._end_streams()

    async def _end_streams(self) -> None:
        """End every stream before the loop closes: each call is cancelled and its reader left to
        see it end, then grpc's own tasks of the calls are awaited, so no completion of a call
        arrives for this loop once it is closed (grpc hands a completion to the loop its call
        was made on; a closed one raises "Event loop is closed" in whichever loop polls)."""
        self._ending = True
        for target, task in self._tasks.items():
            inbox = self._inboxes.get(target)
            if inbox is not None and inbox.reading and inbox.call is not None:
                inbox.call.cancel()  # type: ignore[attr-defined]
            else:  # not reading (connecting, reconnecting, or waiting for room in its inbox)
                task.cancel()
        feeds = list(self._tasks.values())
        if feeds:
            _, late = await asyncio.wait(feeds, timeout=_END_S)
            for t in late:  # a reader that took one more message and waits for room
                t.cancel()
            await asyncio.gather(*feeds, return_exceptions=True)
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        if rest:
            _, late = await asyncio.wait(rest, timeout=_END_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

    def _start_feed(self, target: str, name: str = "") -> None:
        if target not in self._tasks:
            with self._lock:
                self.status.setdefault(target, FeedStatus(target)).name = name
            self._tasks[target] = asyncio.ensure_future(self._feed(target))

    async def _stop_feed(self, target: str) -> None:
        task = self._tasks.pop(target, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        with self._lock:
            inbox = self._inboxes.pop(target, None)
            if inbox is not None:
                inbox.clear()
            self.status.pop(target, None)
            node = self.targets.pop(target, None)
            if node and self._node_owner.get(node) == target:
                del self._node_owner[node]
                self.index.drop_node(node)
                log.info("node left (its address is gone)", extra={"target": target, "node": node})

    async def _feed(self, target: str) -> None:
        delay = self.reconnect_min_s
        while True:
            received = [0]
            try:
                await self._stream(target, received)
            except asyncio.CancelledError:
                raise
            except (grpc.RpcError, KvtierError, FeedError, FoldError, _StreamEnded, _DuplicateNode, _Silent,
                    _Overflow) as e:
                if self._ending:  # the router is closing: its call was cancelled
                    return
                if received[0]:  # it was up: retry soon
                    delay = self.reconnect_min_s
                self._dropped(target, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)

    async def _stream(self, target: str, received: list[int]) -> None:
        """One subscription, from the node's position, until it breaks (raises); counts the
        messages in ``received[0]``."""
        # a unix socket: the credential handshake first (the token goes with the stream); TCP:
        # TLS with this router's client certificate when it has one
        st = self.status.get(target)
        options = channel_options(self.tls, st.name if st is not None else "", _CHANNEL_OPTIONS)
        channel = open_channel(target, aio=True, tls=self.tls, client_name=self.subscriber, options=options,
                               timeout=2.0)
        try:
            await self._subscribe(channel, target, received)
        finally:
            await channel.close()
            creds = getattr(channel, "kvtier_credentials", None)
            if creds is not None:
                creds.close()

    async def _subscribe(self, channel: grpc.aio.Channel, target: str, received: list[int]) -> None:
        stub = locations_pb2_grpc.LocationsStub(channel)
        inbox = self._inboxes.get(target)
        if inbox is None:
            inbox = self._inboxes[target] = _Inbox(room=asyncio.Event())
        with self._lock:
            inbox.clear()  # what an old stream left is sent again after the position
            inbox.error = None
            self.status[target].queued_keys = 0
            node = self.targets.get(target, "")
            epoch, seq = self.index.position(node) if node else (0, 0)
        call = inbox.call = stub.WatchLocations(locations_pb2.WatchLocationsRequest(
            epoch=epoch, from_seq=seq, subscriber=self.subscriber), wait_for_ready=False)
        timeout = self.node_timeout_s or None
        try:
            while True:
                inbox.reading = True
                try:
                    reply = await asyncio.wait_for(call.read(), timeout)
                except asyncio.TimeoutError:
                    call.cancel()
                    self._silent(target)
                    raise _Silent(f"nothing from the daemon for {self.node_timeout_s:g} s (--node-timeout-s): "
                                  f"its node left the index until it answers again") from None
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if inbox.error is not None and not (task is not None and task.cancelling()):
                        raise inbox.error from None  # the folder cancelled the call: its fold failed
                    raise
                finally:
                    inbox.reading = False
                if inbox.error is not None:
                    raise inbox.error
                if reply is grpc.aio.EOF:
                    break
                with self._lock:
                    st = self.status[target]
                    if received[0] == 0:
                        st.connected = True
                    elif received[0] == 1 and epoch and reply.WhichOneof("body") == "events":
                        st.resumes += 1
                await self._queue(target, inbox, reply)
                received[0] += 1
        finally:
            inbox.call = None
        raise _StreamEnded("the daemon ended the stream (stopping?)")

    async def _queue(self, target: str, inbox: _Inbox, reply: locations_pb2.WatchLocationsReply) -> None:
        """Put a message's pieces in the feed's inbox (see "Backpressure and fairness")."""
        n = _keys(reply)
        body = reply.WhichOneof("body")
        assert inbox.room is not None and self._work is not None
        while inbox.items and inbox.keys + n > self.queue_keys:
            if body == "events" and not inbox.snapshot_parts:
                self._overflow(target, inbox, len(reply.events.events))
            inbox.room.clear()
            await inbox.room.wait()
            if inbox.error is not None:
                raise inbox.error
        gen, snap = inbox.gen, body == "snapshot"
        for piece in pieces(reply, self.fold_keys):
            events = len(piece.events.events) if body == "events" else 0
            inbox.items.append((gen, piece, _keys(piece), events, snap))
            inbox.snapshot_parts += snap
        inbox.keys += n
        st = self.status.get(target)
        if st is not None:
            st.queued_keys = inbox.keys
        self._work.set()

    def _overflow(self, target: str, inbox: _Inbox, events: int) -> None:
        """The inbox is full and an event batch came: drop it and what the inbox held, give the
        node's position up (the next subscription takes a snapshot); raises :class:`_Overflow`."""
        with self._lock:
            dropped = inbox.clear() + events
            st = self.status.get(target)
            node = self.targets.get(target)
            if node:
                self.index.invalidate(node)
            if st is not None:
                st.dropped_events += dropped
                st.overflows += 1
                st.queued_keys = 0
                st.epoch = st.seq = 0
        raise _Overflow(f"inbox overflow ({self.queue_keys} keys, --feed-queue-keys): {dropped} events dropped; "
                        "resubscribing from a snapshot")

    async def _fold_loop(self) -> None:
        """Fold the inboxes in turns: one piece per feed per turn, the lock taken per piece."""
        assert self._work is not None
        while True:
            await self._work.wait()
            self._work.clear()
            while True:
                busy = [(t, i) for t, i in self._inboxes.items() if i.items]
                if not busy:
                    break
                for target, inbox in busy:
                    if inbox.items:
                        self._fold_one(target, inbox)
                        await asyncio.sleep(0)  # the readers read; a decision waiting on the lock takes it

    def _fold_one(self, target: str, inbox: _Inbox) -> None:
        gen, piece, n, _events, snap = inbox.items.popleft()
        with self._lock:
            inbox.keys -= n
            inbox.snapshot_parts -= snap
            st = self.status.get(target)
            if st is not None:
                st.queued_keys = inbox.keys
            if gen == inbox.gen and inbox.error is None:
                try:
                    self.apply(target, piece)
                except (FeedError, FoldError, _DuplicateNode) as e:  # the reader ends the stream with it
                    inbox.clear()
                    inbox.error = e
                    if inbox.call is not None:
                        inbox.call.cancel()
        if inbox.room is not None and inbox.keys < self.queue_keys:
            inbox.room.set()

    def _silent(self, target: str) -> None:
        """The target's daemon went quiet: its node leaves the index (the next subscription
        starts from a snapshot)."""
        with self._lock:
            node = self.targets.get(target)
            st = self.status.get(target)
            inbox = self._inboxes.get(target)
            if inbox is not None:
                inbox.clear()
            if st is not None:
                st.epoch = st.seq = 0
            if node and self._node_owner.get(node) == target:
                self.index.drop_node(node)
                log.warning(f"feed {target} (node {node}) silent for {self.node_timeout_s:g} s: node dropped from "
                            "the index until it answers again", extra={"target": target, "node": node})

    def _dropped(self, target: str, e: Exception, retry_s: float) -> None:
        msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
        with self._lock:
            st = self.status.get(target)
            if st is not None:
                # the message says it all: the target, what failed, what happens next (the
                # route-server's log format shows no extra fields)
                extra = {"target": target, "error": msg, "retry_s": retry_s}
                if st.connected:
                    log.warning(f"feed {target} (node {st.node_id or '?'}) dropped: {msg}; reconnecting",
                                extra=extra)
                elif st.last_error != msg:
                    log.warning(f"cannot reach kvtierd at {target}: {msg}{_hint(target, msg)}; retrying "
                                f"(every {self.reconnect_max_s:g} s at most; logged again if the error changes)",
                                extra=extra)
                st.connected, st.last_error = False, msg
            if isinstance(e, FeedError | FoldError):  # broke the contract: start from a snapshot
                node = self.targets.get(target)
                if node:
                    self.index.invalidate(node)

    def _forget_unserved(self) -> None:
        """Forget the nodes of a loaded state that no feed of this run serves: their daemon
        left the static list, or its address left DNS while the router was down. (Nodes a
        feed drops while running are forgotten by :meth:`_stop_feed`.)"""
        with self._lock:
            for target in [t for t in self.targets if t not in self._tasks]:
                del self.targets[target]
            served = set(self.targets.values()) | self.foreign
            for node in [n for n in self.index.nodes if n not in served]:
                log.info("saved node not served by any feed now; forgotten", extra={"node": node})
                self.index.drop_node(node)
                self._node_owner.pop(node, None)
                self._node_epoch.pop(node, None)

    async def _resolve_loop(self, name: str) -> None:
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            log.error("DNS feed name is not HOST:PORT; ignored", extra={"name": name})
            return
        mine: set[str] = set()
        while True:
            try:
                found = {f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in await self._resolve(host, int(port))}
            except OSError as e:
                log.warning("DNS resolution failed; keeping the feeds we have",
                            extra={"name": name, "error": str(e)})
                found = mine
            for target in sorted(found - mine):
                self._start_feed(target, host)
            for target in sorted(mine - found):
                await self._stop_feed(target)
            mine = found
            if name in self._unresolved and mine:
                self._unresolved.discard(name)
                if not self._unresolved:  # every name answered once: the feeds are all known
                    self._forget_unserved()
            await asyncio.sleep(self.resolve_interval_s)

    # -- waiting --------------------------------------------------------------------------

    def wait_synced(self, timeout: float = 10.0, nodes: int | None = None) -> bool:
        """Wait until every feed (at least ``nodes`` of them) applied its daemon's newest event
        known at its last message; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._synced:
            while True:
                sts = list(self.status.values())
                if sts and all(st.synced for st in sts) and (nodes is None or len(sts) >= nodes):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._synced.wait(min(left, 0.05))

"""Peer daemons as a source of blocks: membership, and fetches into host.

:class:`Peers` is a :class:`~kvtier.daemon.remote.RemoteSource` (``name = "peer"``). It knows
the other daemons of ``--peers`` and fetches blocks from them over the authenticated TCP
transport (their ``kvtier.v1.Peer`` service, served with ``--peer-serve``); what arrives goes
into host through :meth:`Placement.ingest <kvtier.daemon.placement.Placement.ingest>`
(verified against the sender's xxh3, visible only when complete).

Membership
    Each ``--peers`` entry is HOST:PORT; HOST is resolved to every A/AAAA record (an IP
    literal is itself; a Kubernetes headless Service's name is every ready pod), again every
    ``--peer-resolve-s``: an address that appears is a new peer, one that disappears is
    dropped. A peer's node id and epoch are learned from it (``GetNodeInfo`` of its location
    service) when it first answers. A peer whose call fails (unreachable, reset, no reply
    within ``--peer-timeout-s``) is marked down and asked again after a backoff (0.5 s,
    doubling to ``--peer-backoff-max-s``); one that comes back with another epoch (it
    restarted) is a new peer: counted, and known by its new epoch from then on.

Fetches
    ``from_node`` (a prefetch that names a peer): that peer's keys are streamed from it.
    Read-through (``--peer-read-through``, a get's miss in every local tier): every live peer
    is asked at once which of the keys it holds (``Holds``: keys only, one round trip), then
    each key is fetched from one peer that holds it (host before disk). Asking at the miss
    rather than following every peer's location feed keeps nothing in memory between misses
    and needs no feed per (peer, tenant): a peer serves only the tenant its caller's
    certificate names, so holdings are per tenant anyway.

Failure
    Nothing raises to the caller: a peer that dies, stalls or refuses ends its stream; the
    blocks that arrived complete and verified are kept, a block cut mid-way is dropped (never
    visible), the rest are misses; every failure is counted (``kvtier_peer_*_total``). Every
    call is awaited with a timeout per reply, so a slow peer never stalls the event loop.

The wire (protobuf, gRPC channels) is :mod:`kvtier.daemon.services.peer`'s
:class:`~kvtier.daemon.services.peer.PeerClient`; this module sees only its typed results.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.daemon.config import PEER_BACKOFF_MAX_S, PEER_RESOLVE_S, PEER_TIMEOUT_S, PEER_WINDOW_BYTES
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.remote import Fetched, StreamedSource
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import key_of

log = logging.getLogger("kvtier.peers")

BACKOFF_MIN_S = 0.5


class PeerError(Exception):
    """A call to a peer failed; ``partial``: a block was cut mid-way."""

    count = Count.PEER_STREAM_ERRORS
    down = True     # the peer is marked down

    def __init__(self, message: str, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class PeerUnavailable(PeerError):
    """Unreachable, reset, or it died mid-stream."""


class PeerTimeout(PeerError):
    """No reply within --peer-timeout-s."""

    count = Count.PEER_TIMEOUTS


class PeerRefused(PeerError):
    """The peer refused the call (another tenant's certificate, a bad request): it is up."""

    count = Count.PEER_REFUSED
    down = False


class PeerProtocolError(PeerError):
    """The peer's replies broke the protocol (chunks out of order, a block of the wrong size)."""

    count = Count.PEER_PROTOCOL_ERRORS


@dataclass
class Hello:
    node_id: str
    epoch: int
    tenant: str


@dataclass
class Block:
    index: int          # which key of the request
    payload: bytes | bytearray
    xxh3: int


@dataclass
class Missing:
    indexes: list[int]


class PeerWire(Protocol):
    """The calls :class:`Peers` makes (:class:`kvtier.daemon.services.peer.PeerClient`)."""

    async def node_info(self, peer: PeerState) -> tuple[str, int]:
        """(node id, epoch) of the peer."""
        ...

    async def holds(self, peer: PeerState, tenant: str, fingerprint: bytes, keys: Sequence[bytes]) -> list[int]:
        """The tier number each key is held in on the peer (0: not held)."""
        ...

    def fetch(self, peer: PeerState, tenant: str, fingerprint: bytes, block_bytes: int,
              keys: Sequence[bytes]) -> AsyncIterator[Hello | Block | Missing]:
        """The peer's hello, then complete blocks and missing indexes; raises :class:`PeerError`."""
        ...

    async def drop(self, peer: PeerState) -> None:
        """Close the peer's channels."""
        ...

    async def close(self) -> None:
        ...


@dataclass(eq=False)
class PeerState:
    """One peer address and what is known of it."""

    address: str          # "IP:PORT" ("[IPv6]:PORT") connected to
    server_name: str      # the name its TLS certificate must carry ("": the address's IP)
    entry: str            # the --peers entry it came from
    node_id: str = ""
    epoch: int = 0
    down_until: float = 0.0
    failures: int = 0
    probing: asyncio.Task | None = field(default=None, repr=False)

    @property
    def known(self) -> bool:
        return bool(self.node_id)

    def live(self, now: float) -> bool:
        return self.known and now >= self.down_until


Resolve = Callable[[str, int], Awaitable[list[str]]]


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({ai[4][0] for ai in infos})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Peers(StreamedSource):
    """See the module docstring."""

    name = "peer"

    def __init__(self, entries: Sequence[str], wire: PeerWire, counters: Counters, *, read_through: bool = False,
                 timeout_s: float = PEER_TIMEOUT_S, resolve_s: float = PEER_RESOLVE_S,
                 backoff_max_s: float = PEER_BACKOFF_MAX_S, window_bytes: int = PEER_WINDOW_BYTES, own_node_id: str = "", resolve: Resolve | None = None) -> None:
        self.entries = tuple(entries)
        self.wire = wire
        self.counters = counters
        self.read_through = read_through
        self.timeout_s = timeout_s
        self.resolve_s = resolve_s
        self.backoff_max_s = backoff_max_s
        self.window_bytes = window_bytes
        self.own_node_id = own_node_id
        self._resolve = resolve or system_resolve
        self.peers: dict[str, PeerState] = {}       # address -> peer
        self._task: asyncio.Task | None = None
        self._resolved = asyncio.Event()

    # -- membership -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for p in self.peers.values():
            if p.probing is not None:
                p.probing.cancel()
        await self.wire.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let membership die; the next round tries again
                log.exception("peer membership refresh failed")
            self._resolved.set()
            await asyncio.sleep(self.resolve_s)

    async def refresh(self, node_id: str = "") -> None:
        """Resolve every entry (an address that went away is dropped) and probe the peers whose
        node id is not known yet or whose backoff has run out; waits for those probes. With
        ``node_id`` (a fetch names it), also the peers that may be it, backoff or not: those
        not known yet and those known as it."""
        wanted: dict[str, tuple[str, str]] = {}
        for entry in self.entries:
            host, _, port = entry.rpartition(":")
            host = host.strip("[]")
            if _is_ip(host):
                wanted[_hostport(host, int(port))] = ("", entry)
                continue
            try:
                ips = await asyncio.wait_for(self._resolve(host, int(port)), self.timeout_s)
            except (OSError, asyncio.TimeoutError) as e:
                self.counters.add(Count.PEER_RESOLVE_ERRORS)
                log.warning("peer name did not resolve", extra={"entry": entry, "error": str(e)})
                # keep what it resolved to before: DNS trouble is not the peers' death
                wanted.update({a: (p.server_name, entry) for a, p in self.peers.items() if p.entry == entry})
                continue
            for ip in ips:
                wanted[_hostport(ip, int(port))] = (host, entry)
        for addr in [a for a in self.peers if a not in wanted]:
            gone = self.peers.pop(addr)
            log.info("peer gone from --peers", extra={"address": addr, "node_id": gone.node_id or None})
            await self.wire.drop(gone)
        for addr, (server_name, entry) in wanted.items():
            if addr not in self.peers:
                self.peers[addr] = PeerState(addr, server_name, entry)
        now = time.monotonic()
        due = [p for p in self.peers.values()
               if (not p.known or p.down_until) and (now >= p.down_until or (node_id and p.node_id in ("", node_id)))]
        if due:
            await asyncio.gather(*(self._probe(p) for p in due))

    async def _probe(self, peer: PeerState) -> None:
        try:
            node_id, epoch = await self.wire.node_info(peer)
        except PeerError as e:
            self._failed(peer, e)
            return
        self._seen(peer, node_id, epoch)

    def _seen(self, peer: PeerState, node_id: str, epoch: int) -> None:
        """The peer answered as (node_id, epoch): up again; a new epoch is a new peer."""
        if peer.known and (peer.node_id, peer.epoch) != (node_id, epoch):
            self.counters.add(Count.PEER_NEW_EPOCHS)
            log.info("peer is back as a new epoch", extra={"address": peer.address, "node_id": node_id,
                                                           "old_node_id": peer.node_id, "epoch": epoch,
                                                           "old_epoch": peer.epoch})
        elif not peer.known:
            log.info("peer found", extra={"address": peer.address, "node_id": node_id, "epoch": epoch})
        elif peer.down_until:
            log.info("peer answers again", extra={"address": peer.address, "node_id": node_id})
        peer.node_id, peer.epoch = node_id, epoch
        peer.down_until = 0.0
        peer.failures = 0

    def _failed(self, peer: PeerState, e: PeerError) -> None:
        self.counters.add(e.count)
        if not e.down:
            log.warning("peer refused a call", extra={"address": peer.address, "node_id": peer.node_id or None,
                                                      "error": str(e)})
            return
        if not peer.down_until:
            self.counters.add(Count.PEER_MARKED_DOWN)
        backoff = min(self.backoff_max_s, BACKOFF_MIN_S * 2 ** min(peer.failures, 16))
        peer.failures += 1
        peer.down_until = time.monotonic() + backoff
        log.warning("peer marked down", extra={"address": peer.address, "node_id": peer.node_id or None,
                                               "retry_in_s": backoff, "error": str(e)})

    def live(self) -> list[PeerState]:
        """The peers known and not down, in address order."""
        now = time.monotonic()
        return sorted((p for p in self.peers.values() if p.live(now) and p.node_id != self.own_node_id),
                      key=lambda p: p.address)

    async def _by_node(self, node_id: str) -> PeerState | None:
        """The live peer of this node id; peers not known yet (or due again) are probed first."""
        for p in self.live():
            if p.node_id == node_id:
                return p
        if self._task is not None and not self._resolved.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._resolved.wait()), self.timeout_s)
        await self.refresh(node_id)
        return next((p for p in self.live() if p.node_id == node_id), None)

    # -- fetches ----------------------------------------------------------------------------


    async def stream(self, tenant: str, layout: Layout, bkeys: Sequence[bytes],
                     from_node: str | None = None) -> AsyncIterator[list[Fetched]]:
        """The blocks of ``bkeys`` the peers have, in batches of about ``window_bytes``, each
        complete and carrying the sender's xxh3 (the caller ingests a batch before the next
        is read, so memory stays bounded)."""
        if from_node:
            peer = await self._by_node(from_node)
            if peer is None:
                self.counters.add(Count.PEER_UNKNOWN_NODE)
                self.counters.add(Count.PEER_BLOCKS_MISSED, len(bkeys))
                log.warning("prefetch names a node no live peer is", extra={"from_node": from_node})
                return
            plan = [(peer, list(bkeys))]
        else:
            plan = await self._holders(tenant, layout, bkeys)
        for peer, keys in plan:
            async for batch in self._fetch_from(peer, tenant, layout, keys):
                yield batch

    async def _holders(self, tenant: str, layout: Layout, bkeys: Sequence[bytes]
                       ) -> list[tuple[PeerState, list[bytes]]]:
        """Ask every live peer at once which keys it holds; each key goes to one holder (host
        before disk, then address order)."""
        peers = self.live()
        if not peers or not bkeys:
            return []
        fp = _wire_fingerprint(layout)
        keys = [key_of(b) for b in bkeys]
        self.counters.add(Count.PEER_HOLDS_ASKED, len(peers))
        answers = await asyncio.gather(*(self._holds(p, tenant, fp, keys) for p in peers))
        best: dict[int, tuple[int, int]] = {}   # key index -> (rank, peer index)
        for pi, tiers in enumerate(answers):
            for i, tier in enumerate(tiers or ()):
                if tier and (i not in best or (tier, pi) < best[i]):
                    best[i] = (tier, pi)
        plan: dict[int, list[bytes]] = {}
        for i in sorted(best):
            plan.setdefault(best[i][1], []).append(bkeys[i])
        return [(peers[pi], ks) for pi, ks in sorted(plan.items())]

    async def _holds(self, peer: PeerState, tenant: str, fp: bytes, keys: list[bytes]) -> list[int] | None:
        try:
            tiers = await self.wire.holds(peer, tenant, fp, keys)
        except PeerError as e:
            self._failed(peer, e)
            return None
        return tiers if len(tiers) == len(keys) else None

    async def _fetch_from(self, peer: PeerState, tenant: str, layout: Layout, bkeys: list[bytes]
                          ) -> AsyncIterator[list[Fetched]]:
        """One FetchBlocks stream from ``peer``: batches of complete blocks of half a window
        each, read while the previous batch is put into host (so at most a window is held);
        a failure ends it (counted; the blocks not yet complete are misses)."""
        queue: asyncio.Queue[list[Fetched] | None] = asyncio.Queue(maxsize=1)
        reader = asyncio.ensure_future(self._read_stream(peer, tenant, layout, bkeys, queue))
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            if not reader.done():
                reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_stream(self, peer: PeerState, tenant: str, layout: Layout, bkeys: list[bytes],
                           queue: asyncio.Queue[list[Fetched] | None]) -> None:
        self.counters.add(Count.PEER_FETCHES)
        block_bytes = layout.block_bytes
        window = max(1, self.window_bytes // 2 // max(1, block_bytes))
        pending: list[Fetched] = []
        done: set[int] = set()
        order = _StreamOrder(len(bkeys))
        try:
            async for msg in self.wire.fetch(peer, tenant, _wire_fingerprint(layout), block_bytes,
                                             [key_of(b) for b in bkeys]):
                order.check(msg)
                if isinstance(msg, Hello):
                    self._hello(peer, msg, tenant)
                elif isinstance(msg, Block):
                    if not 0 <= msg.index < len(bkeys) or msg.index in done or len(msg.payload) != block_bytes:
                        raise PeerProtocolError(f"block {msg.index} of {len(msg.payload)} B is not one asked for "
                                                f"({len(bkeys)} keys of {block_bytes} B)")
                    done.add(msg.index)
                    pending.append((bkeys[msg.index], msg.payload, msg.xxh3))
                    self.counters.add(Count.PEER_BLOCKS_FETCHED)
                    self.counters.add(Count.PEER_BYTES_FETCHED, block_bytes)
                    if len(pending) >= window:
                        batch, pending = pending, []
                        await queue.put(batch)
        except PeerError as e:
            if e.partial:
                self.counters.add(Count.PEER_PARTIAL_BLOCKS)
            self._failed(peer, e)
        except Exception:  # anything else ends this fetch too (logged, counted), never the daemon
            log.exception("peer fetch failed", extra={"address": peer.address, "node_id": peer.node_id or None})
            self.counters.add(Count.PEER_STREAM_ERRORS)
        finally:
            self.counters.add(Count.PEER_BLOCKS_MISSED, len(bkeys) - len(done))
        if pending:
            await queue.put(pending)
        await queue.put(None)

    def _hello(self, peer: PeerState, hello: Hello, tenant: str) -> None:
        if hello.tenant != tenant:  # never ingest another tenant's blocks as this one's
            raise PeerRefused(f"the peer serves tenant {hello.tenant!r}, not {tenant!r}")
        self._seen(peer, hello.node_id, hello.epoch)


class _StreamOrder:
    """What one FetchBlocks stream may send: its hello first (it says whose blocks follow:
    nothing is taken before it), once; then blocks, and lists of missing keys, at most one a
    key asked for (a legitimate peer sends at most one a window). A stream that never ends,
    each reply in time, would otherwise hold the fetch, and the pins it took, for good."""

    def __init__(self, keys: int) -> None:
        self.greeted = False
        self.lists = keys

    def check(self, msg: Hello | Block | Missing) -> None:
        if isinstance(msg, Hello):
            if self.greeted:
                raise PeerProtocolError("a second hello in one FetchBlocks stream")
            self.greeted = True
        elif not self.greeted:
            raise PeerProtocolError(f"a FetchBlocks reply before the peer's hello ({type(msg).__name__})")
        elif isinstance(msg, Missing):
            self.lists -= 1
            if self.lists < 0:
                raise PeerProtocolError("more lists of missing keys than keys asked for")


def _wire_fingerprint(layout: Layout) -> bytes:
    """The layout's own fingerprint (what peers know it by; a tenant's layout is stored here
    under its tenant fingerprint)."""
    return getattr(layout, "wire_fingerprint", layout.fingerprint)

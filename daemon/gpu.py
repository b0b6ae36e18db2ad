"""Engine KV registrations and the copies between them and the host tier (the domain of the
``kvtier.v1.Transfer`` service, which :mod:`kvtier.daemon.services.transfer` serves).

Owns
    * the copy engines: a :class:`HostCopyEngine` always (CPU stand-in registrations), and a
      :class:`CudaCopyEngine` when ``--copy-engine`` is ``cuda`` (or ``auto`` on a GPU node);
      cupy is imported only then;
    * registrations (:class:`Transfers`): per engine session, its layout, its opened
      allocations and event ring (each allocation opened once per registration; the CUDA
      engine also shares one open handle between registrations of the same allocation), and
      an internal store session that holds the grants and leases of its copies in flight.

Promises
    * Offload commits a block only after its bytes are in the host slot, then replies.
      Onboard pins each hit (a lease; disk hits are promoted to host first) from before its
      copy until the copy has completed, replies once the completion record is issued, and
      copies nothing for a key not held (:attr:`TransferStatus.MISSING`: that engine page is
      untouched).
    * A copy runs in a task of its own: a cancelled RPC (the engine killed mid-transfer, a
      deadline) stops waiting for it, never stops it halfway.
    * When the engine's Node session ends (exit or kill), or on unregister, the
      registration stops taking requests, cancels copies still waiting for "KV written",
      waits for its copies in flight, aborts the grants of unfinished offloads (their bytes
      cannot be vouched for), releases its leases and closes every handle and event it
      opened. Counters ``kv_registrations_opened/closed``, ``kv_handles_opened/closed`` and
      ``kv_events_opened/closed`` show that nothing stays open; ``kv_inflight_at_close``,
      ``kv_transfers_cancelled`` and ``kv_offloads_aborted`` count what was cut short.
    * A bad request is refused (INVALID_ARGUMENT / FAILED_PRECONDITION / NOT_FOUND) and
      changes nothing.
    * Registration ids are random (as session ids, :mod:`kvtier.daemon.sessions`) and bound
      to the registering session, which is bound to its caller: a request naming another
      session's registration is refused PERMISSION_DENIED. The host copy engine maps engine
      memory only from sealed memfds the engine passed (never a path the caller names: the
      Transfer service refuses one); see :mod:`kvtier.tiers.copy_engine`.
    * A session holds at most ``--max-kv-registrations-per-session`` registrations and the
      sessions of one tenant at most ``--max-kv-registrations-per-tenant`` (default: the
      tenant's share of ``--max-sessions``), registrations being opened included; one more
      is refused RESOURCE_EXHAUSTED naming the limit (counted: ``kv_registrations_refused``).
    * Every wait for an engine's "KV written" record is bounded (``--transfer-wait-s``): an
      offload whose record does not come is refused DEADLINE_EXCEEDED and gives back its slots.
    * A ring slot belongs to its newest sequence number. An engine that gave up on
      a transfer (its deadline passed) may reuse the slot while the daemon's copy still runs,
      so: a request whose ``seq`` is not newer than the last one its slot carried is refused
      FAILED_PRECONDITION (stale: a late or replayed request) and changes nothing; a newer
      request on a slot supersedes the transfer still in flight there, whose copy is then not
      issued if it has not been, and whose offload is never committed (the engine may have
      reused those pages); the newer copy is issued only once the older one has ended. An
      offload whose RPC was cancelled (the engine's deadline, or the engine gone) is never
      committed either: the engine was told it failed. ``kv_transfers_superseded`` counts them.

Threading: requests run on the event loop; copies and their waits run in dedicated executors
(onboards in one of their own, so offloads waiting for "KV written" never hold them up) so the
loop never blocks.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import importlib.util
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.daemon.auth import Principal
from kvtier.daemon.config import Config
from kvtier.daemon.counters import Count, Flow
from kvtier.daemon.errors import Code, StoreError
from kvtier.daemon.results import GrantStatus, LeaseResult
from kvtier.daemon.sessions import random_ids
from kvtier.daemon.store import BlockStore
from kvtier.tiers.copy_engine import (
    GIB,
    OFFLOAD,
    ONBOARD,
    AllocationRef,
    CopyEngine,
    CopyError,
    EventRing,
    HostCopyEngine,
    KVMemory,
    TensorRef,
    WaitTimeout,
    check_engine_ids,
    plan_chunks,
    tensor_geometry,
)
from kvtier.tiers.layout import Layout

log = logging.getLogger("kvtier.transfer")

IDLE_PIN_S = 600.0
"""How long a CUDA-pinned host pool stays pinned with no registration using it (pinning again
takes about 0.085 s/GiB: an engine restarting, or retrying a registration whose deadline the pin
outlasted, takes the pin over; after this, or at once when another pool's pin needs the memory,
it is undone)."""

MAX_RING_SLOTS = 4096


class EngineUnavailable(RuntimeError):
    """``--copy-engine cuda`` was asked for and cannot be built; the message says why."""


def build_engines(cfg: Config) -> dict[str, CopyEngine]:
    """The copy engines ``cfg`` asks for, keyed by the engine memory kind they open."""
    engines: dict[str, CopyEngine] = {"host": HostCopyEngine(cfg.copy_threads, cfg.offload_piece_bytes)}
    if cfg.copy_engine == "host":
        return engines
    if cfg.copy_engine == "auto" and importlib.util.find_spec("cupy") is None:
        return engines
    try:
        from kvtier.tiers.copy_engine import CudaCopyEngine  # noqa: PLC0415

        engines["cuda"] = CudaCopyEngine(cfg.cuda_device, cfg.cuda_backend, cfg.offload_piece_bytes,
                                         cfg.copy_threads)
    except Exception as e:  # cupy missing, no driver, no device: all say the same to the operator
        if cfg.copy_engine == "cuda":
            raise EngineUnavailable(f"--copy-engine cuda: cannot start the CUDA copy engine on "
                                    f"cuda:{cfg.cuda_device}: {e}") from None
        log.info("no CUDA copy engine; serving host-memory engines only", extra={"reason": str(e)})
    return engines


class TransferStatus(enum.Enum):
    """What a transfer did with one key."""

    COPIED = enum.auto()    # the block's bytes were copied
    PRESENT = enum.auto()   # offload: already held (host or disk), nothing copied
    NO_SPACE = enum.auto()  # offload: every host slot is pinned or granted; retry later
    MISSING = enum.auto()   # onboard: not held (or no longer); the engine page was not touched


_OFFLOADED = {GrantStatus.GRANTED: TransferStatus.COPIED, GrantStatus.PRESENT: TransferStatus.PRESENT,
              GrantStatus.NO_SPACE: TransferStatus.NO_SPACE}


@dataclass(frozen=True)
class KVRegistration:
    """What an engine registers: its KV layout, memory and event ring."""

    session_id: int                      # the engine's open Node session
    layout: Layout
    backend: str                         # "cuda" or "host": the kind of memory the engine has
    allocations: list[AllocationRef]
    tensors: list[TensorRef]             # one per layout tensor, in layout order
    ring_slots: int
    event_handles: tuple[bytes, ...] = ()
    event_ring_path: str = ""            # refused for the host engine: see event_ring_fd
    event_ring_fd: int = -1              # host engine: a sealed memfd the engine passed (SCM_RIGHTS)


@dataclass(frozen=True)
class Registered:
    registration_id: int
    layout_id: int
    copy_engine: str
    block_bytes: int


@dataclass(frozen=True)
class TransferOrder:
    """One offload or onboard: keys and the engine blocks (or token rows) they go to or from."""

    session_id: int
    registration_id: int
    keys: list[bytes]
    engine_ids: np.ndarray
    event_slot: int
    seq: int
    wait_written: bool = False


@dataclass(frozen=True)
class TransferResult:
    status: list[TransferStatus]   # one per key, in order
    nbytes: int                    # bytes copied


@dataclass(eq=False)
class Registration:
    reg_id: int
    session_id: int          # the engine's Node session
    store_session: int       # internal session holding this registration's grants and leases
    layout_id: int
    layout: Layout
    engine: CopyEngine
    memory: KVMemory
    tensors: list[TensorRef]
    pool_path: str
    tenant: str = ""         # the registering session's tenant (its registrations are counted)
    inflight: int = 0
    closing: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    newest: dict[int, int] = field(default_factory=dict)          # slot -> newest seq it carried
    running: dict[int, _InFlight] = field(default_factory=dict)   # slot -> its transfer in flight


@dataclass(eq=False)
class _InFlight:
    """One transfer holding its ring slot (see "A ring slot belongs to its newest sequence number")."""

    seq: int
    abandoned: str = ""                  # why it must not commit (superseded, cancelled); "" while wanted
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class Transfers:
    """See the module docstring."""

    def __init__(self, store: BlockStore, engines: dict[str, CopyEngine], threads: int = 8,
                 idle_pin_s: float = IDLE_PIN_S) -> None:
        self.store = store
        self.counters = store.counters
        self.engines = engines
        self.registrations: dict[int, Registration] = {}
        for engine in engines.values():  # every wait for "KV written" is bounded (--transfer-wait-s)
            engine.wait_timeout_s = store.limits.transfer_wait_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-transfer")
        # onboards on threads of their own: offloads hold a thread through their wait for "KV
        # written" (up to a forward pass of the engine), and a request waits on its onboard
        self._onboard_executor = ThreadPoolExecutor(max(2, threads // 2), thread_name_prefix="kvtier-onboard")
        self._tasks: set[asyncio.Task] = set()
        self._attached: set[tuple[str, str]] = set()
        # (engine name, pool path) -> registrations that attached it, opening ones included; a
        # CUDA pool is pinned (never punched) while this is above zero
        self._pool_users: dict[tuple[str, str], int] = {}
        # CUDA pools still pinned with no registration using them: pinning a large pool takes
        # minutes (0.085 s/GiB measured), so the pin outlives its last registration (an engine
        # restarting, or retrying a RegisterKV whose deadline the pin outlasted, finds it done);
        # undone when another pool's pin needs the memory (_make_room_to_pin), after idle_pin_s, or at close
        self._idle_pins: dict[tuple[str, str], CopyEngine] = {}
        self._idle_timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.idle_pin_s = idle_pin_s  # an idle pin is undone after this long unused (host clients may want the memory)
        self._attaching: dict[tuple[str, str], asyncio.Future] = {}  # pins in progress
        self._closing = False
        self._detaching: dict[str, int] = {}  # pool path -> detaches of it in flight
        # registrations held (open or being opened): per Node session, per tenant
        self._held: dict[tuple[str, object], int] = {}
        store.sessions.end_hooks.append(self._session_ended)

    # -- registration ----------------------------------------------------------------------

    def check_memory(self, want: KVRegistration) -> CopyEngine:
        """The copy engine of ``want``'s backend; refuses (INVALID_ARGUMENT) a host-memory
        registration naming a file path: the daemon never opens a path a caller names."""
        engine = self.engines.get(want.backend)
        if engine is None:
            known = ", ".join(sorted(self.engines))
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"this kvtierd has no {want.backend!r} copy engine (it serves: {known}); "
                             f"start it with --copy-engine cuda on a GPU node for CUDA KV memory")
        if engine.backend == "host" and (want.event_ring_path or any(a.path for a in want.allocations)):
            raise StoreError(Code.INVALID_ARGUMENT,
                             "RegisterKV names a file path: the daemon does not open paths a caller names; pass "
                             "each allocation and the event ring as a file descriptor over the unix socket "
                             "(a memfd sealed with F_SEAL_SHRINK, in fd_handle and event_ring_fd_handle)")
        return engine

    async def register(self, want: KVRegistration, principal: Principal | None = None) -> Registered:
        """Open an engine's KV memory for copies; bound to its Node session (which must be
        ``principal``'s own when given)."""
        sess = self.store.session(want.session_id, principal)
        engine = self.check_memory(want)
        layout = want.layout
        self._check_tensors(layout, want.allocations, want.tensors)
        if not 0 < want.ring_slots <= MAX_RING_SLOTS:
            raise StoreError(Code.INVALID_ARGUMENT, f"ring_slots {want.ring_slots} is not in [1, {MAX_RING_SLOTS}]")
        ring = EventRing(want.ring_slots, tuple(want.event_handles), want.event_ring_path, want.event_ring_fd)
        self._hold(sess.session_id, sess.tenant)
        try:
            reg_layout = await self.store.register_layout(layout, sess.tenant)
            cls = self.store.pool(reg_layout.layout)  # the tenant's pool
            memory = await self._open(engine, cls, want.allocations, ring)
        except BaseException:
            self._let_go(sess.session_id, sess.tenant)
            raise
        internal = self.store.open_session(f"transfer:{sess.client_name}", sess.pid,
                                           Principal(tenant=sess.tenant, caller=sess.owner), internal=True)
        reg_id = random_ids(1, lambda s: not self.registrations.keys().isdisjoint(s))[0]
        reg = Registration(reg_id, sess.session_id, internal.session_id, reg_layout.layout_id, layout,
                           engine, memory, want.tensors, cls.path, sess.tenant)
        self.registrations[reg.reg_id] = reg
        c = self.counters
        c.add(Count.KV_REGISTRATIONS_OPENED)
        c.add(Count.KV_HANDLES_OPENED, memory.handles_open)
        c.add(Count.KV_EVENTS_OPENED, memory.events_open)
        if sess.session_id not in self.store.sessions:  # the engine went away while we opened
            self._close(reg)
            raise StoreError(Code.CANCELLED, "session closed during RegisterKV")
        log.info("kv registered", extra={"registration_id": reg.reg_id, "session_id": sess.session_id,
                                         "engine": engine.name, "allocations": len(want.allocations),
                                         "layout_id": reg.layout_id})
        return Registered(reg.reg_id, reg.layout_id, engine.name, layout.block_bytes)

    def _hold(self, session_id: int, tenant: str) -> None:
        """Count one more registration of ``session_id`` and ``tenant``, or refuse it
        RESOURCE_EXHAUSTED naming the limit it would pass."""
        lim = self.store.limits
        for key, most, flag, who in ((("session", session_id), lim.kv_registrations_per_session,
                                      "--max-kv-registrations-per-session", f"session {session_id}"),
                                     (("tenant", tenant), lim.kv_registrations_per_tenant,
                                      "--max-kv-registrations-per-tenant", "this tenant's sessions")):
            if most and self._held.get(key, 0) >= most:
                self.counters.add(Count.KV_REGISTRATIONS_REFUSED)
                raise StoreError(Code.RESOURCE_EXHAUSTED,
                                 f"{who} already hold{'s' if key[0] == 'session' else ''} {most} KV registrations, "
                                 f"the most allowed ({flag}); UnregisterKV one first")
        for key in (("session", session_id), ("tenant", tenant)):
            self._held[key] = self._held.get(key, 0) + 1

    def _let_go(self, session_id: int, tenant: str) -> None:
        for key in (("session", session_id), ("tenant", tenant)):
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    async def _open(self, engine: CopyEngine, cls: Any, allocations: list[AllocationRef], ring: EventRing) -> KVMemory:
        """Attach the host pool to the engine (once per engine and pool) and open the KV memory."""
        if engine.backend == "cuda":
            await self._make_room_to_pin(cls)
        key = (engine.name, cls.path)
        self._use_pool(engine, cls)
        loop = asyncio.get_running_loop()
        attached = orphaned = False
        try:
            earlier = self._attaching.get(key)
            if earlier is not None:  # (a retry while an earlier try still pins: no second thread waiting on it)
                await asyncio.wait([earlier])  # (its outcome is not ours; our own cancellation still raises)
            if self._take_idle(key) is not None:  # pinned already: this registration takes that pin over
                attaching = loop.create_future()
                attaching.set_result(engine.pin_s_per_gib)
            else:
                attaching = loop.run_in_executor(self._executor, engine.attach_pool, cls.path, cls.pool_bytes)
                self._attaching[key] = attaching
                attaching.add_done_callback(functools.partial(self._attach_ended, key))
            try:
                s_per_gib = await asyncio.shield(attaching)
            except asyncio.CancelledError:
                # the engine went away mid-attach, but the thread pins on: the pool stays marked
                # (never punched) until that attach has ended and been undone
                orphaned = True
                attaching.add_done_callback(functools.partial(self._attach_orphan, engine, cls.path))
                raise
            attached = True
            opening = loop.run_in_executor(self._executor, engine.open_kv, allocations, ring)
            try:
                memory = await asyncio.shield(opening)
            except asyncio.CancelledError:  # the engine went away: close what the thread opens
                opening.add_done_callback(functools.partial(self._close_orphan, engine))
                raise
        except CopyError as e:
            self._leave_pool(engine, cls.path, attached)
            raise StoreError(Code.FAILED_PRECONDITION, str(e)) from None
        except BaseException:
            if not orphaned:
                self._leave_pool(engine, cls.path, attached)
            raise
        if (engine.name, cls.path) not in self._attached:
            self._attached.add((engine.name, cls.path))
            log.info("host pool attached to the copy engine", extra={
                "engine": engine.name, "pool_bytes": cls.pool_bytes,
                "pin_s_per_gib": round(s_per_gib, 4) if engine.backend == "cuda" else None})
        return memory

    async def _make_room_to_pin(self, cls: Any) -> None:
        """Make sure pinning ``cls``'s whole pool stays within ``--host-capacity`` (undoing idle
        pins of other pools if that makes the room), else refuse with FAILED_PRECONDITION."""
        host = self.store.host
        short = host.pin_shortfall(cls)
        if short and await self._unpin_idle(cls.path, short):
            short = host.pin_shortfall(cls)
        if short:
            others = host.backed_bytes - cls.backed_slots * cls.slot_bytes
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"the GPU needs this layout's whole host pool pinned ({cls.pool_bytes / GIB:.2f} GiB "
                             f"of {cls.slot_bytes} B slots: pinning makes all of it resident), but other block "
                             f"sizes or tenants hold {others / GIB:.2f} GiB of the host tier: that would be "
                             f"{short / GIB:.2f} GiB over --host-capacity. A CUDA kvtierd pins one pool in full; "
                             f"serve the other block sizes from another kvtierd, or let their blocks go "
                             f"(Evict) first")

    def _attach_ended(self, key: tuple[str, str], attaching: asyncio.Future) -> None:
        if self._attaching.get(key) is attaching:
            del self._attaching[key]

    def _class_of(self, path: str) -> Any:
        """The host tier's size class whose pool file is ``path`` (None once it is gone)."""
        return next((c for c in self.store.host.classes.values() if c.path == path), None)

    def _use_pool(self, engine: CopyEngine, cls: Any) -> None:
        key = (engine.name, cls.path)
        self._pool_users[key] = self._pool_users.get(key, 0) + 1
        if engine.backend == "cuda":
            self.store.host.mark_registered(cls)  # never punch memory the GPU has pinned

    def _leave_pool(self, engine: CopyEngine, path: str, attached: bool) -> None:
        """A registration of the pool closed (or failed to open). When it was the last, a CUDA
        pool stays pinned, idle (pinning again would take minutes for a large pool), until
        another pool needs its memory (:meth:`_unpin_idle`: without that, a second layout on the
        same daemon found no memory once the first had taken the budget, seen on the H200) or
        the daemon closes; other engines detach at once (on an executor thread)."""
        key = (engine.name, path)
        self._pool_users[key] -= 1
        if self._pool_users[key] == 0:
            del self._pool_users[key]
            self._attached.discard(key)
        if not attached:
            self._unpinned(engine, path, None)
            return
        if engine.backend == "cuda" and key not in self._idle_pins and not self._closing:
            # kept pinned (and marked) until its memory is wanted; a registration that is still
            # to attach (a retry) takes this pin over rather than pinning anew
            self._idle_pins[key] = engine
            self._idle_timers[key] = asyncio.get_running_loop().call_later(self.idle_pin_s, self._idle_expired, key)
            return
        self._detach(engine, path)

    def _detach(self, engine: CopyEngine, path: str) -> asyncio.Future:
        """Detach the pool on an executor thread; :meth:`_unpinned` runs when it has ended (the
        pool is unmarked only once no detach of it is still in flight)."""
        self._detaching[path] = self._detaching.get(path, 0) + 1
        detach = asyncio.get_running_loop().run_in_executor(self._executor, engine.detach_pool, path)
        detach.add_done_callback(functools.partial(self._unpinned, engine, path))
        return detach

    def _take_idle(self, key: tuple[str, str]) -> CopyEngine | None:
        """Take ``key``'s idle pin out of the idle set (its timer stopped): its engine, or None."""
        timer = self._idle_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        return self._idle_pins.pop(key, None)

    def _idle_expired(self, key: tuple[str, str]) -> None:
        """An idle pin unused for ``idle_pin_s``: undone, so that its free memory may go to other
        size classes again (host-memory clients of another block size get none while it stays)."""
        self._idle_timers.pop(key, None)
        engine = self._idle_pins.pop(key, None)
        if engine is not None:
            self._detach(engine, key[1])

    async def _unpin_idle(self, exclude: str, short: int) -> bool:
        """Unpin the idle CUDA pools but ``exclude`` when their free memory covers ``short``
        bytes (another pool's pin needs it; else the warm pins are kept and that pin is refused):
        True if any was unpinned. The detaches go on (and unmark their pools when they end) even
        if the caller is cancelled meanwhile."""
        idle = [(key, engine) for key, engine in self._idle_pins.items() if key[1] != exclude]
        free = sum(len(c.free) * c.slot_bytes for key, _ in idle if (c := self._class_of(key[1])) is not None)
        if not idle or free < short:
            return False
        detaches = []
        for key, engine in idle:
            if self._take_idle(key) is engine:
                detaches.append(self._detach(engine, key[1]))
        if detaches:
            await asyncio.wait(detaches)  # (cancelling this wait leaves the detaches running)
        return any(not d.cancelled() and d.exception() is None for d in detaches)

    def _unpinned(self, engine: CopyEngine, path: str, detach: asyncio.Future | None) -> None:
        if detach is not None:
            self._detaching[path] -= 1
            if not self._detaching[path]:
                del self._detaching[path]
        if detach is not None and (detach.cancelled() or detach.exception() is not None):
            log.error("detaching the host pool %s from %s failed: %s", path, engine.name,
                      "cancelled" if detach.cancelled() else detach.exception())
            self.counters.add(Count.KV_CLOSE_ERRORS)
            return  # still pinned for all we know: keep it out of other classes' reach
        if (engine.backend != "cuda" or path in self._detaching
                or any(k[1] == path for k in (*self._pool_users, *self._idle_pins))):
            return  # a registration (re)attached meanwhile, or the pool was never pinned
        cls = self._class_of(path)
        if cls is not None:
            self.store.host.unmark_registered(cls)

    def _attach_orphan(self, engine: CopyEngine, path: str, attaching: asyncio.Future) -> None:
        """Leave the pool of a registration cancelled during its attach, once the attach ended
        (pinned: unpinned again before the host tier may punch it)."""
        self._leave_pool(engine, path, attached=not attaching.cancelled() and attaching.exception() is None)

    def _close_orphan(self, engine: CopyEngine, opening: asyncio.Future) -> None:
        """Close KV memory opened for a registration whose caller was cancelled meanwhile."""
        if opening.cancelled() or opening.exception() is not None:
            return
        try:
            engine.close_kv(opening.result())
        except Exception:
            log.exception("closing the KV memory of a cancelled RegisterKV failed")
            self.counters.add(Count.KV_CLOSE_ERRORS)

    @staticmethod
    def _check_tensors(layout: Layout, allocations: list[AllocationRef], tensors: list[TensorRef]) -> None:
        if len(tensors) != len(layout.tensors):
            raise StoreError(Code.INVALID_ARGUMENT,
                             f"{len(tensors)} tensor refs for a layout of {len(layout.tensors)} tensors")
        for spec, ref, (outer, extent, inner, _) in zip(layout.tensors, tensors, tensor_geometry(layout), strict=True):
            if ref.allocation >= len(allocations):
                raise StoreError(Code.INVALID_ARGUMENT,
                                 f"tensor {spec.name!r} names allocation {ref.allocation}; there are {len(allocations)}")
            end = ref.offset + outer * extent * inner
            if end > allocations[ref.allocation].size:
                raise StoreError(Code.INVALID_ARGUMENT,
                                 f"tensor {spec.name!r} ends at byte {end}, past its allocation of "
                                 f"{allocations[ref.allocation].size} bytes")

    async def unregister(self, session_id: int, reg_id: int) -> None:
        """Close a registration once its copies in flight are done."""
        reg = self._registration(session_id, reg_id)
        self._begin_close(reg)
        await reg.closed.wait()

    def _registration(self, session_id: int, reg_id: int) -> Registration:
        self.store.session(session_id)
        reg = self.registrations.get(reg_id)
        if reg is None or reg.closing:
            raise StoreError(Code.NOT_FOUND,
                             f"KV registration {reg_id} is not open (unregistered, or its session ended): "
                             f"call RegisterKV again")
        if reg.session_id != session_id:
            raise StoreError(Code.PERMISSION_DENIED,
                             f"KV registration {reg_id} was made by another session: a session may use only "
                             f"the registrations it made")
        return reg

    def _session_ended(self, session_id: int) -> None:
        for reg in [r for r in self.registrations.values() if r.session_id == session_id]:
            self._begin_close(reg)

    def _begin_close(self, reg: Registration) -> None:
        if reg.closing:
            return
        reg.closing = True
        self.counters.add(Count.KV_INFLIGHT_AT_CLOSE, reg.inflight)  # copies the close waits for
        reg.engine.cancel(reg.memory)
        if reg.inflight == 0:
            self._close(reg)

    def _close(self, reg: Registration) -> None:
        """Close the handles and give back the slots of a registration with nothing in flight."""
        reg.closing = True
        if self.registrations.pop(reg.reg_id, None) is not None:
            self._let_go(reg.session_id, reg.tenant)
        c = self.counters
        c.add(Count.KV_HANDLES_CLOSED, reg.memory.handles_open)
        c.add(Count.KV_EVENTS_CLOSED, reg.memory.events_open)
        try:
            reg.engine.close_kv(reg.memory)
        except Exception:
            log.exception("closing KV registration %d failed", reg.reg_id)
            c.add(Count.KV_CLOSE_ERRORS)
        self.store.close_session(reg.store_session)
        self._leave_pool(reg.engine, reg.pool_path, attached=True)
        c.add(Count.KV_REGISTRATIONS_CLOSED)
        reg.closed.set()
        log.info("kv registration closed", extra={"registration_id": reg.reg_id})

    def _done(self, reg: Registration) -> None:
        reg.inflight -= 1
        if reg.closing and reg.inflight == 0:
            self._close(reg)

    # -- transfers -------------------------------------------------------------------------

    def _validate(self, order: TransferOrder) -> tuple[Registration, np.ndarray]:
        reg = self._registration(order.session_id, order.registration_id)
        self.store.check_keys(order.keys, unique=True)
        try:
            ids = check_engine_ids(reg.layout, np.asarray(order.engine_ids, dtype=np.int64), len(order.keys))
        except CopyError as e:
            raise StoreError(Code.INVALID_ARGUMENT, str(e)) from None
        if order.event_slot >= reg.memory.ring.slots:
            raise StoreError(Code.INVALID_ARGUMENT,
                             f"event_slot {order.event_slot} is outside the ring of {reg.memory.ring.slots}")
        if np.unique(ids).size != ids.size:
            raise StoreError(Code.INVALID_ARGUMENT, "an engine block id (or token index) appears twice in one request")
        newest = reg.newest.get(order.event_slot, -1)
        if order.seq <= newest:
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"stale request: sequence number {order.seq} in event slot {order.event_slot}, which "
                             f"already carried {newest}; each request must use a sequence number newer than the "
                             f"last one of its slot (a late or replayed request is refused)")
        return reg, ids

    def _claim(self, reg: Registration, order: TransferOrder) -> tuple[_InFlight, _InFlight | None]:
        """Make ``order`` its slot's newest transfer (after :meth:`_validate`, in the same loop
        step); returns it and the older transfer it supersedes, if one is still in flight."""
        reg.newest[order.event_slot] = order.seq
        older = reg.running.get(order.event_slot)
        if older is not None:
            older.abandoned = older.abandoned or (f"superseded by request {order.seq} in event slot "
                                                  f"{order.event_slot}: the engine gave up on request {older.seq}")
            self.counters.add(Count.KV_TRANSFERS_SUPERSEDED)
        mine = reg.running[order.event_slot] = _InFlight(order.seq)
        return mine, older

    def _release_slot(self, reg: Registration, slot: int, mine: _InFlight) -> None:
        mine.ended.set()
        if reg.running.get(slot) is mine:
            del reg.running[slot]

    async def _after(self, older: _InFlight | None) -> None:
        """Wait until the transfer this one superseded has ended (its copy is bounded)."""
        if older is not None:
            await older.ended.wait()

    async def _copy(self, reg: Registration, plan: Any, direction: str, order: TransferOrder, wait_done: bool) -> Any:
        loop = asyncio.get_running_loop()

        def run() -> Any:
            done = reg.engine.copy(reg.memory, reg.pool_path, plan, direction, order.event_slot, order.seq,
                                   order.wait_written)
            if wait_done:
                done.wait_done()
            return done

        return await loop.run_in_executor(self._onboard_executor if direction == ONBOARD else self._executor, run)

    def _detached(self, reg: Registration, work: Any, slot: int = -1, mine: _InFlight | None = None) -> asyncio.Task:
        """Run ``work`` as a task of its own that holds one in-flight count on ``reg`` (and
        ``slot`` for ``mine``): a cancelled RPC (engine killed, deadline) stops waiting for it,
        but the copy, the commit or abort and the release still run to the end before the
        registration may close."""
        reg.inflight += 1

        async def run() -> Any:
            try:
                return await work
            finally:
                if mine is not None:
                    self._release_slot(reg, slot, mine)
                self._done(reg)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._reap_task)
        return task

    def _reap_task(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), StoreError):
            log.error("transfer failed", exc_info=task.exception())

    async def offload(self, order: TransferOrder) -> TransferResult:
        """Copy engine blocks into fresh host slots and commit them; replies once committed."""
        reg, ids = self._validate(order)
        mine, older = self._claim(reg, order)
        task = self._detached(reg, self._offload(reg, ids, order, mine, older), order.event_slot, mine)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.counters.add(Count.KV_TRANSFERS_CANCELLED)  # the engine went away (or gave up) mid-copy
            mine.abandoned = mine.abandoned or "the engine cancelled the offload (its deadline passed, or it is gone)"
            raise

    async def _offload(self, reg: Registration, ids: np.ndarray, order: TransferOrder, mine: _InFlight,
                       older: _InFlight | None) -> TransferResult:
        await self._after(older)
        if mine.abandoned:  # given up on before its copy was issued: nothing to copy or commit
            raise StoreError(Code.CANCELLED, f"offload not run: {mine.abandoned}")
        grants = await self.store.allocate(reg.store_session, reg.layout_id, order.keys)
        granted = [i for i, g in enumerate(grants) if g.granted]
        gids = [grants[i].grant_id for i in granted]
        if reg.closing or mine.abandoned:  # (during the allocate) never touch a gone engine's memory
            await self._abort(reg, gids)
            raise StoreError(Code.CANCELLED, f"offload not run: {mine.abandoned or 'the engine session ended'}")
        offsets = np.array([grants[i].offset for i in granted], dtype=np.int64)
        plan = plan_chunks(reg.layout, reg.tensors, ids[granted], offsets)
        try:
            await self._copy(reg, plan, OFFLOAD, order, wait_done=True)
        except CopyError as e:
            await self._abort(reg, gids)
            if isinstance(e, WaitTimeout):  # the engine never said its KV was written: nothing copied
                raise StoreError(Code.DEADLINE_EXCEEDED, str(e)) from None
            if mine.abandoned:
                self.counters.add(Count.KV_OFFLOADS_ABORTED)
                raise StoreError(Code.CANCELLED, f"offload not committed: {mine.abandoned}") from None
            if reg.closing:
                self.counters.add(Count.KV_OFFLOADS_ABORTED)
                raise StoreError(Code.CANCELLED, f"the engine's session ended during the offload: {e}") from None
            raise
        except BaseException:
            await self._abort(reg, gids)
            raise
        if reg.closing or mine.abandoned:  # the engine went away, or gave up: its KV cannot be vouched for
            await self._abort(reg, gids)
            self.counters.add(Count.KV_OFFLOADS_ABORTED)
            raise StoreError(Code.CANCELLED, f"offload not committed: {mine.abandoned}" if mine.abandoned else
                             "the engine's session ended during the offload")
        if gids:
            await self.store.commit(reg.store_session, gids, [], False)
        self.counters.add(Count.KV_OFFLOAD_BLOCKS, len(gids))
        self.counters.move(Flow.GPU_TO_HOST, plan.nbytes)
        return TransferResult([_OFFLOADED[g.status] for g in grants], plan.nbytes)

    async def _abort(self, reg: Registration, gids: list[int]) -> None:
        if gids and reg.store_session in self.store.sessions:
            await self.store.commit(reg.store_session, [], gids, False)

    async def onboard(self, order: TransferOrder) -> TransferResult:
        """Copy held blocks (pinned meanwhile) into engine blocks; replies once the completion
        record is issued (the engine's stream can wait on it)."""
        reg, ids = self._validate(order)
        mine, older = self._claim(reg, order)
        recorded = asyncio.get_running_loop().create_future()
        self._detached(reg, self._onboard(reg, ids, order, recorded, mine, older), order.event_slot, mine)
        try:
            leases, nbytes = await asyncio.shield(recorded)  # the completion record is issued: reply
        except asyncio.CancelledError:
            self.counters.add(Count.KV_TRANSFERS_CANCELLED)
            mine.abandoned = mine.abandoned or "the engine cancelled the onboard (its deadline passed, or it is gone)"
            raise
        hits = sum(1 for lease in leases if lease.hit)
        c = self.counters
        c.add(Count.KV_ONBOARD_BLOCKS, hits)
        c.add(Count.KV_ONBOARD_MISSING, len(order.keys) - hits)
        c.move(Flow.HOST_TO_GPU, nbytes)
        return TransferResult([TransferStatus.COPIED if lease.hit else TransferStatus.MISSING for lease in leases],
                              nbytes)

    async def _onboard(self, reg: Registration, ids: np.ndarray, order: TransferOrder,
                       recorded: asyncio.Future, mine: _InFlight, older: _InFlight | None) -> None:
        """Pin the hits (disk hits are promoted first), copy, hand the caller its answer once
        the completion record is issued, keep the pins until the bytes have landed, release.
        A superseded or cancelled onboard whose copy was not issued yet never writes the
        engine's pages (they may hold other blocks by now)."""
        lids: list[int] = []
        try:
            try:
                await self._after(older)
                leases: list[LeaseResult] = await self.store.acquire(reg.store_session, reg.layout_id, order.keys)
                hits = [i for i, lease in enumerate(leases) if lease.hit]
                lids = [leases[i].lease_id for i in hits]
                offsets = np.array([leases[i].offset for i in hits], dtype=np.int64)
                plan = plan_chunks(reg.layout, reg.tensors, ids[hits], offsets)
                if reg.closing or mine.abandoned:  # never touch a gone engine's memory
                    raise StoreError(Code.CANCELLED,
                                     f"onboard not run: {mine.abandoned or 'the engine session ended'}")
                done = await self._copy(reg, plan, ONBOARD, order, wait_done=False)
            except BaseException as e:
                if not recorded.done():
                    recorded.set_exception(e)
                    recorded.exception()  # retrieved here too: the handler may be gone
                return
            recorded.set_result((leases, plan.nbytes))
            try:
                await asyncio.get_running_loop().run_in_executor(self._onboard_executor, done.wait_done)
            except Exception:
                log.exception("onboard copy failed after its reply (registration %d)", reg.reg_id)
                self.counters.add(Count.KV_ONBOARD_ERRORS)
        finally:
            self._release(reg, lids)

    def _release(self, reg: Registration, lids: list[int]) -> None:
        if lids and reg.store_session in self.store.sessions:
            self.store.release(reg.store_session, lids)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close every registration (after its copies in flight) and the copy engines (which
        unpin every pool, idle ones too)."""
        self._closing = True
        for timer in self._idle_timers.values():
            timer.cancel()
        for reg in list(self.registrations.values()):
            self._begin_close(reg)
            await reg.closed.wait()
        self._executor.shutdown(wait=True)
        self._onboard_executor.shutdown(wait=True)
        for engine in self.engines.values():
            engine.close()


__all__ = ["EngineUnavailable", "KVRegistration", "Registered", "TransferOrder", "TransferResult", "TransferStatus",
           "Transfers", "build_engines"]

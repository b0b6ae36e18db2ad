"""The gpu tier: the blocks engine workers on this node hold in their own GPU memory.

The daemon never holds these blocks: each engine's sidecar reports what its engine holds
(``ReportDeviceBlocks``: per worker and layout fingerprint, keys stored and removed), and
:class:`DeviceTier` is the one place that keeps it. Everything that names the gpu tier reads
it from here:

* the location feed: every change is reported to the store's observers as a gpu event of
  its worker, so routers see each worker's device blocks;
* Lookup and the key table: a block some worker on this node holds (under the layout
  asked about) is answered ``gpu``, the fastest tier; so are the lookup counters with
  ``tier="gpu"``, and the sidecars' reports of key-table lookups. Acquire never finds a
  block in gpu: the daemon serves blocks from host (and disk, promoted); those counters
  stay at zero;
* NodeInfo's workers and their layout fingerprints.

Tenants: a report names a layout id of the reporting tenant, so its blocks are kept under
that tenant's fingerprint (:mod:`kvtier.daemon.layouts`), and its worker under a name of
that tenant (:func:`~kvtier.daemon.layouts.worker_key`): one tenant's reports never touch,
clear or show another tenant's workers or blocks, even under the same worker id.

Limits: at most ``MAX_WORKERS`` workers report at once on the daemon, at most
``workers_per_tenant`` of one tenant (``--max-workers-per-tenant``), so no tenant takes every
worker place; and one worker holds at most ``blocks_per_worker`` blocks, all its layouts
together (``--max-device-blocks-per-worker``), so reports cannot grow the daemon's memory
without end. A report over either is refused RESOURCE_EXHAUSTED and changes nothing.

A report is bound to the reporting sidecar's session. When that session ends (the engine
exited or was killed), what it reported is cleared at once: the whole worker when no other
open session reports for it, else that rank's fingerprint only (a tensor-parallel worker
missing a rank holds nothing, but still lists the rank).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.counters import Count, Counters
from kvtier.daemon.errors import Code, StoreError, check_keys
from kvtier.daemon.layouts import Layouts, split_worker, worker_key
from kvtier.daemon.observers import Observers
from kvtier.daemon.sessions import Sessions
from kvtier.tiers.vocab import Tier, pack_block

log = logging.getLogger("kvtier.device")

MAX_WORKER_ID = 256
MAX_WORKERS = 1024  # distinct worker ids with device blocks (each a NodeInfo entry)
SESSION_CHECK_S = 1.0  # how often device blocks of ended sessions are looked for (see watch_sessions)
GPU = Tier.GPU


@dataclass(eq=False)
class DeviceTier:
    """See the module docstring."""

    layouts: Layouts
    sessions: Sessions
    observers: Observers
    counters: Counters
    max_keys: int
    # workers are named by worker_key(tenant, worker id); fingerprints are tenant fingerprints
    held: dict[str, dict[bytes, set[bytes]]] = field(default_factory=dict)  # worker -> fingerprint -> keys
    bound: dict[str, dict[bytes, int]] = field(default_factory=dict)  # worker -> fingerprint -> reporting session
    _holders: Counter[bytes] = field(default_factory=Counter)  # packed block id -> workers holding it
    _per_fp: Counter[bytes] = field(default_factory=Counter)   # fingerprint -> blocks some worker holds
    version: int = 0                                            # bumped when workers or their layouts change
    versions: Counter[str] = field(default_factory=Counter)    # the same, per tenant
    # no tenant takes every worker, no worker takes unbounded memory (0: no cap of its own)
    workers_per_tenant: int = 0
    blocks_per_worker: int = 0
    tenant_workers: Counter[str] = field(default_factory=Counter)  # tenant -> its workers in ``held``
    worker_blocks: Counter[str] = field(default_factory=Counter)   # worker -> keys it holds, all fingerprints

    def __post_init__(self) -> None:
        # cleared the moment the session closes: a successor engine reporting under the same
        # worker id right after must not inherit the dead engine's blocks
        self.sessions.end_hooks.append(self._session_ended)

    def _changed(self, tenant: str) -> None:
        self.version += 1
        self.versions[tenant] += 1

    # -- reads -----------------------------------------------------------------------------

    def holds(self, fingerprint: bytes, key: bytes) -> bool:
        """Whether some worker on this node holds this block on device."""
        return pack_block(fingerprint, key) in self._holders

    def holdings(self) -> list[tuple[str, bytes, list[bytes]]]:
        """Every device block as (worker, fingerprint, keys)."""
        return [(w, fp, list(keys)) for w, per_fp in self.held.items() for fp, keys in per_fp.items() if keys]

    def workers(self, tenant: str | None = None) -> list[tuple[str, list[bytes]]]:
        """Each worker and the layout fingerprints its ranks reported, sorted. With ``tenant``:
        that tenant's workers only, by their own ids, with the layouts' own fingerprints."""
        if tenant is None:
            return [(w, sorted(self.held[w])) for w in sorted(self.held)]
        out = []
        for wkey, per_fp in self.held.items():
            t, worker = split_worker(wkey)
            if t == tenant:
                regs = [self.layouts.find(fp) for fp in per_fp]
                out.append((worker, sorted(r.wire_fingerprint for r in regs if r is not None)))
        return sorted(out)

    def blocks_of(self, fingerprint: bytes) -> int:
        """Distinct blocks of this layout held on some worker's device."""
        return self._per_fp.get(fingerprint, 0)

    # -- reports ---------------------------------------------------------------------------

    def report(self, worker: str, layout_id: int, stored: Sequence[bytes], removed: Sequence[bytes],
               clear: bool, session_id: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        """Apply one worker's report: with ``clear`` it first forgets what it held under this
        layout; then ``stored`` arrived and ``removed`` left. Raises StoreError (and changes
        nothing) for a bad report."""
        if not worker or len(worker) > MAX_WORKER_ID or "\x00" in worker:
            raise StoreError(Code.INVALID_ARGUMENT,
                             f"worker_id must be 1 to {MAX_WORKER_ID} characters, no NUL (e.g. the engine's address)")
        fp = self.layouts.get(layout_id, tenant).layout.fingerprint
        check_keys(stored, self.max_keys, unique=False)
        check_keys(removed, self.max_keys, unique=False)
        if not session_id:  # unbound holdings would never be cleared
            raise StoreError(Code.INVALID_ARGUMENT, "session_id 0: report with the sidecar's open session, "
                                                    "whose end clears what it reported")
        if session_id not in self.sessions:
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"session {session_id} is not open on this daemon: report with the sidecar's "
                             f"current session")
        version = self.version
        worker = worker_key(tenant, worker)
        per_fp = self.held.get(worker)
        held = per_fp.get(fp) if per_fp is not None else None
        kept = set() if clear or held is None else held   # what stays before this report's keys
        new = list(dict.fromkeys(k for k in stored if k not in kept))
        self._check_room(worker, tenant, per_fp is None, new, removed, kept, len(held) if clear and held else 0)
        if per_fp is None:
            per_fp = self.held[worker] = {}
            self.tenant_workers[tenant] += 1
            self._changed(tenant)
        if held is None:
            held = per_fp[fp] = set()
            self._changed(tenant)
        self.bound.setdefault(worker, {})[fp] = session_id
        if clear and held:
            self._drop(worker, fp, list(held))
        if new:
            held.update(new)
            self.worker_blocks[worker] += len(new)
            self._hold(fp, new)
            self.observers.stored(GPU, fp, new, worker)
        gone = list(dict.fromkeys(k for k in removed if k in held))
        if gone:
            self._drop(worker, fp, gone)
        self.counters.add(Count.DEVICE_REPORTS)
        if self.version != version:
            self.observers.workers_changed()

    def _check_room(self, worker: str, tenant: str, new_worker: bool, new: list[bytes], removed: Sequence[bytes],
                    kept: set[bytes], cleared: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a report that would add a worker beyond the daemon's
        limit or its tenant's share, or leave the worker holding more than
        ``blocks_per_worker`` blocks (``new`` keys come, ``cleared`` go first, then the
        ``removed`` ones among ``kept`` and ``new``)."""
        if new_worker and len(self.held) >= MAX_WORKERS:
            raise StoreError(Code.RESOURCE_EXHAUSTED, f"{len(self.held)} workers report device blocks; the limit "
                                                      f"is {MAX_WORKERS} workers per daemon")
        share = self.workers_per_tenant
        if new_worker and share and self.tenant_workers[tenant] >= share:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"{self.tenant_workers[tenant]} workers of this tenant report device blocks; the "
                             f"limit is {share} workers per tenant (--max-workers-per-tenant)")
        cap = self.blocks_per_worker
        if not cap or not new:
            return
        gone = len(set(removed).intersection(new)) + len(kept.intersection(removed)) if removed else 0
        after = self.worker_blocks[worker] - cleared + len(new) - gone
        if after > cap:
            raise StoreError(Code.RESOURCE_EXHAUSTED,
                             f"worker {split_worker(worker)[1]!r} would hold {after} device blocks; the limit is "
                             f"{cap} per worker, all its layouts together (--max-device-blocks-per-worker): "
                             f"report removed blocks")

    def _drop(self, worker: str, fp: bytes, keys: list[bytes]) -> None:
        """These keys left the worker's device (reported as removed)."""
        self.held[worker][fp].difference_update(keys)
        self._uncount(worker, len(keys))
        self._unhold(fp, keys)
        self.observers.removed(GPU, fp, keys, worker)

    def _hold(self, fp: bytes, keys: Sequence[bytes]) -> None:
        holders = self._holders
        for k in keys:
            b = pack_block(fp, k)
            holders[b] += 1
            if holders[b] == 1:
                self._per_fp[fp] += 1

    def _unhold(self, fp: bytes, keys: Sequence[bytes]) -> None:
        holders = self._holders
        for k in keys:
            b = pack_block(fp, k)
            holders[b] -= 1
            if holders[b] <= 0:
                del holders[b]
                self._per_fp[fp] -= 1
                if not self._per_fp[fp]:
                    del self._per_fp[fp]

    # -- sessions --------------------------------------------------------------------------

    def _session_ended(self, session_id: int) -> None:
        self._release(lambda sid: sid == session_id)

    def drop_ended_sessions(self) -> int:
        """Clear the device blocks reported through sessions that ended; returns how many
        workers lost some. (Sessions the store closes are cleared at once through its
        session-end hook; this catches any other way a session could disappear.)"""
        return self._release(lambda sid: sid not in self.sessions)

    def _release(self, ended: Callable[[int], bool]) -> int:
        """Clear what ended sessions reported (see the module docstring)."""
        hit = 0
        for worker in list(self.bound):
            bound = self.bound[worker]
            gone = [fp for fp, sid in bound.items() if ended(sid)]
            if not gone:
                continue
            hit += 1
            for fp in gone:
                del bound[fp]
            if not bound:
                self._clear_worker(worker)
                continue
            per_fp = self.held.get(worker, {})
            for fp in gone:
                if per_fp.get(fp):
                    self._drop(worker, fp, list(per_fp[fp]))
            log.info("device blocks of a rank cleared: its session ended",
                     extra={"worker_id": worker, "fingerprints": [fp.hex() for fp in gone]})
        return hit

    def _uncount(self, worker: str, n: int) -> None:
        left = self.worker_blocks[worker] - n
        if left > 0:
            self.worker_blocks[worker] = left
        else:
            self.worker_blocks.pop(worker, None)

    def _clear_worker(self, worker: str) -> None:
        del self.bound[worker]
        per_fp = self.held.pop(worker, None)
        if per_fp is None:
            per_fp = {}
        else:
            tenant = split_worker(worker)[0]
            self.tenant_workers[tenant] -= 1
            if self.tenant_workers[tenant] <= 0:
                del self.tenant_workers[tenant]
        self.worker_blocks.pop(worker, None)
        gone = {fp: list(keys) for fp, keys in per_fp.items() if keys}
        for fp, keys in gone.items():
            self._unhold(fp, keys)
        self._changed(split_worker(worker)[0])
        self.observers.cleared(GPU, worker, gone)
        self.observers.workers_changed()
        log.info("device blocks cleared: the worker's session ended", extra={"worker_id": worker})


async def watch_sessions(device: DeviceTier, period_s: float = SESSION_CHECK_S) -> None:
    """Run forever: clear the device blocks of workers whose sidecar session ended."""
    while True:
        await asyncio.sleep(period_s)
        try:
            device.drop_ended_sessions()
        except Exception:
            log.exception("clearing device blocks of ended sessions failed")

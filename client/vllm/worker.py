"""vLLM's worker side: :class:`KvtierOffloadingWorker` moves pages between vLLM's KV tensors and
kvtier, through the daemon's copy engine or in this process (the package docstring)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.client.engine.adapter import Breaker, daemon_answers
from kvtier.client.engine.connector import KVConnector, KVConnectorError
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.engine.transport import KvtierError
from kvtier.client.vllm.config import KvtierSettings
from kvtier.client.vllm.keys import KeyMap, KvtierLoadSpec, KvtierStoreSpec, group_block_keys
from kvtier.client.vllm.metrics import M_LOAD_FAILED, M_LOADED, M_STORE, Counts
from kvtier.tiers.layout import DTYPE_BYTES, Layout, TensorSpec

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: its handler, format and level


@dataclass
class LoadFaults:
    """Faults injected into this process's loads: set only by a test engine (the test support's
    vLLM runner sets :data:`FAULTS` before vLLM builds the spec); no setting reaches them.

    ``corrupt``: zero every page after loading it (a negative control that must change
    outputs); ``fail``: treat every load as failed (exercises vLLM's recompute path; counted
    with reason ``test``)."""

    corrupt: bool = False
    fail: bool = False


FAULTS = LoadFaults()
"""What each worker made in this process from now on injects (read when the worker is made)."""


@dataclass
class _Group:
    """One offloaded KV-cache group's pages in this worker: its layout (and the daemon's id of
    it, once registered), vLLM's distinct page tensors of the group and their page bytes."""

    layout: Layout
    tensors: list[Any]
    pages: list[int]
    lid: int = 0

    @property
    def block_bytes(self) -> int:
        return sum(self.pages)


@dataclass
class _Job:
    job_id: int
    load: bool
    keys: list[bytes]
    block_ids: np.ndarray
    parts: list[tuple[int, slice]] | None = None  # (group, its slice of keys and block_ids); None: group 0, all
    start: float = field(default_factory=time.perf_counter)
    failed: np.ndarray | None = None   # block ids whose load failed
    nbytes: int = 0
    transfer: Any = None               # daemon copy in flight (KVConnector Transfer)
    done: bool = False


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: moves pages between vLLM's KV tensors and kvtier (the package docstring)."""

    def __init__(self, settings: KvtierSettings, keymap: KeyMap, layouts: Layout | list[Layout],
                 kv_caches: CanonicalKVCaches, client_name: str) -> None:
        """``layouts``: the layout of each offloaded KV-cache group's pages, in vLLM's order
        (:func:`~kvtier.client.vllm.keys.group_layouts`; one layout: one group)."""
        self.settings = settings
        self.keymap = keymap
        layouts = [layouts] if isinstance(layouts, Layout) else list(layouts)
        if len(layouts) != len(kv_caches.group_data_refs):
            raise ValueError(f"kvtier: {len(layouts)} layouts for vLLM's {len(kv_caches.group_data_refs)} "
                             f"offloaded KV-cache groups")
        self.groups = [_Group(lay, *self._tensors(kv_caches, g, lay)) for g, lay in enumerate(layouts)]
        # group 0's, by the names the single-group paths (and the daemon's copy engine) use
        self.layout, self.tensors, self.pages = layouts[0], self.groups[0].tensors, self.groups[0].pages
        self.block_bytes = self.groups[0].block_bytes
        self.client_name = client_name
        self.counts = Counts()
        self._cv = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[_Job] = []
        self._failed_blocks: set[int] = set()
        self._failed_jobs: set[int] = set()
        self.breaker = Breaker(settings.retry_s, log)  # after a failed call: bypass kvtier for retry_s
        self.faults = FAULTS
        if self.faults.corrupt or self.faults.fail:
            log.warning("kvtier: test-only fault injection is on (%s): never in production",
                        "corrupt loads" if self.faults.corrupt else "fail loads")
        self.conn: KVConnector | None = None
        self._stale = False               # the daemon copy registration must be made (again)
        self.sc: Sidecar | None = None
        self.mode = self._open(settings.copy)
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._thread: threading.Thread | None = None
        if self.mode == "process":
            self._thread = threading.Thread(target=self._run, name="kvtier-copy", daemon=True)
            self._thread.start()

    @property
    def lid(self) -> int:
        """The daemon's id of group 0's layout (0: not registered)."""
        return self.groups[0].lid

    @property
    def multi_group(self) -> bool:
        return len(self.groups) > 1

    @staticmethod
    def _tensors(kv_caches: CanonicalKVCaches, group: int, layout: Layout) -> tuple[list[Any], list[int]]:
        """vLLM's distinct page tensors of one group, checked against the group's layout."""
        seen: list[int] = []
        for ref in kv_caches.group_data_refs[group]:
            if ref.tensor_idx not in seen:
                seen.append(ref.tensor_idx)
        tensors = [kv_caches.tensors[i].tensor for i in seen]
        pages = [t.shape[1] * t.element_size() for t in tensors]
        want = [t.shape[1] * DTYPE_BYTES[t.dtype] for t in layout.tensors]
        if pages != want:
            raise ValueError(f"kvtier: vLLM's KV pages of KV-cache group {group} are {pages} bytes per tensor, but "
                             f"its offloading config implies {want}; this KV cache layout is not supported")
        return tensors, pages

    # -- connection ---------------------------------------------------------------------------

    def _open(self, mode: str) -> str:
        """Pick how pages move (``kvtier_copy``) and connect. Never blocks past the timeout:
        a daemon that is not there yet is connected to later."""
        if self.multi_group:
            if mode == "daemon":
                raise ValueError("kvtier: kvtier_copy 'daemon' moves one KV-cache group's pages; this model has "
                                 f"{len(self.groups)} groups, whose pages the worker copies itself: use "
                                 "kvtier_copy 'auto' or 'process'")
            mode = "process"
        if mode != "process":
            if not self._daemon_up():
                if mode == "daemon" or self.tensors[0].device.type == "cuda":
                    self._stale = True  # registered once the daemon answers
                    self._down(KVConnectorError(grpc.StatusCode.UNAVAILABLE, "daemon not reachable"))
                    return "daemon"
            else:
                try:
                    self._open_daemon(self.settings.register_timeout_s)
                    return "daemon"
                except KVConnectorError as e:
                    if mode == "daemon":
                        raise
                    log.info("kvtier: KV tensors not registrable with the daemon (%s); copying in this process",
                             e.details.split(";")[0])
        s = self.settings
        self.sc = Sidecar(s.socket, client_name=self.client_name, timeout=s.timeout_s)
        try:
            self._register_groups(self.sc)
        except KvtierError as e:
            log.warning("kvtier: daemon not reachable (%s); loads miss until it is", e)
        return "process"

    def _register_groups(self, sc: Sidecar) -> None:
        """Register every group's layout that is not yet (ids of 0 until this succeeds)."""
        for grp in self.groups:
            if not grp.lid:
                grp.lid = sc.register_layout(grp.layout)

    def _daemon_up(self) -> bool:
        """Whether the daemon answers within the timeout (registration itself waits for it forever)."""
        return daemon_answers(self.settings.socket, self.client_name, self.settings.timeout_s)

    def _open_daemon(self, timeout: float | None = None) -> None:
        """Register the KV tensors with the daemon (``timeout``: the registration's deadline,
        else ``kvtier_timeout_s``)."""
        torch = _torch()
        num_blocks = self.tensors[0].shape[0]
        layout = Layout(tuple(TensorSpec(t.name, t.dtype, (num_blocks, t.shape[1]), 0) for t in self.layout.tensors),
                        self.layout.block_tokens, self.layout.tp_rank, self.layout.tp_size)
        views = [t.view(getattr(torch, spec.dtype)) for t, spec in zip(self.tensors, layout.tensors, strict=True)]
        conn = KVConnector(self.settings.socket, client_name=self.client_name, timeout=self.settings.timeout_s,
                           settle_s=self.settings.settle_s)
        try:
            conn.register(layout, views, timeout=timeout)
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self._stale = False
        self.breaker.ok()

    def _reopen_daemon(self) -> bool:
        """After the daemon failed (or restarted: registrations do not survive it), register
        again, once the copies in flight have ended."""
        for job in list(self._jobs.values()):
            if job.transfer is not None:
                self._end_daemon_copy(job)
        old, self.conn = self.conn, None
        if old is not None:
            try:
                old.close()
            except (KVConnectorError, grpc.RpcError):
                pass  # the daemon is gone, and the registration with it
        if not self._daemon_up():
            self._down(KVConnectorError(grpc.StatusCode.UNAVAILABLE, "daemon not reachable"))
            return False
        try:
            self._open_daemon()
        except KVConnectorError as e:
            self._down(e)
            return False
        log.info("kvtier: registered the KV tensors with the daemon again")
        return True

    def _sidecar(self) -> Sidecar | None:
        """The sidecar with the layout registered, or None while kvtier is bypassed."""
        if self.sc is None or self.breaker.bypassed():
            return None
        if not all(grp.lid for grp in self.groups):
            try:
                self._register_groups(self.sc)
            except KvtierError as e:
                self._down(e)
                return None
        return self.sc

    def _down(self, err: Exception) -> None:
        self.breaker.failed(err)

    # -- OffloadingWorker ---------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierStoreSpec)
        keys, parts = self._keys(dst_spec.chunks, src_spec)
        self._submit(_Job(job_id, False, keys, np.asarray(src_spec.block_ids, dtype=np.int64), parts))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """``expedited`` (vLLM 0.33, with synchronous loads: waited on within the step): kvtier's
        loads run before its stores whatever it says, since a request waits on each; submitting
        never blocks."""
        assert isinstance(src_spec, KvtierLoadSpec)
        ids = np.asarray(dst_spec.block_ids, dtype=np.int64)
        try:
            keys, parts = self._keys(src_spec.chunks, dst_spec)
        except ValueError as e:  # never a wrong page: a load that cannot be mapped is recomputed
            log.error("kvtier: load %d not understood (%s); recomputing it", job_id, e)
            job = _Job(job_id, True, [], ids, failed=ids)
            self.counts.add(M_LOAD_FAILED, len(ids), "error")
            self._finish(job)
            return True
        self._submit(_Job(job_id, True, keys, ids, parts))
        return True

    def _keys(self, chunks: list[tuple[bytes, ...]],
              spec: GPULoadStoreSpec) -> tuple[list[bytes], list[tuple[int, slice]]]:
        """A transfer's kvtier keys (one per engine block, in ``spec.block_ids`` order) and its
        parts, group by group."""
        parts = group_block_keys(chunks, spec, self.keymap.blocks_per_chunk)
        if any(g >= len(self.groups) for g, _, _ in parts):
            raise ValueError(f"a transfer of {len(spec.group_sizes)} groups; this worker has {len(self.groups)}")
        keys = [k for _, ks, _ in parts for k in ks]
        return keys, [(g, sl) for g, _, sl in parts]

    def _submit(self, job: _Job) -> None:
        with self._cv:
            self._jobs[job.job_id] = job
        if self.mode == "daemon":
            self._start_daemon_copy(job)
        else:
            self._q.put((0 if job.load else 1, job.job_id, job))  # loads first: a request waits on them

    def get_finished(self) -> list[TransferResult]:
        if self.mode == "daemon":
            self._poll_daemon()
        with self._cv:
            done, self._finished = self._finished, []
            for job in done:
                if job.failed is not None and len(job.failed) and self.multi_group:
                    self._failed_jobs.add(job.job_id)  # vLLM recomputes such a request whole
        return [TransferResult(job_id=j.job_id, success=True, transfer_size=j.nbytes,
                               transfer_time=time.perf_counter() - j.start) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        if self.mode == "daemon":
            for jid in job_ids:
                job = self._jobs.get(jid)
                if job is not None and job.transfer is not None:
                    self._end_daemon_copy(job)
            return
        with self._cv:
            while any(jid in self._jobs for jid in job_ids):
                self._cv.wait()

    def take_failed_block_ids(self) -> set[int]:
        """Engine block ids whose load failed since the last call (vLLM recomputes them). Only
        with one KV-cache group: block ids name a block only within a group, and vLLM
        recomputes by block only with one."""
        with self._cv:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_failed_jobs(self) -> set[int]:
        """With several KV-cache groups: the load jobs, returned by :meth:`get_finished` since
        the last call, of which some block failed. vLLM recomputes their requests whole (the
        connector reports them as failed receives)."""
        with self._cv:
            out, self._failed_jobs = self._failed_jobs, set()
        return out

    def shutdown(self) -> None:
        self.breaker.close()
        if self._thread is not None:
            self._q.put((-1, -1, None))
            self._thread.join(timeout=30)
            self._thread = None
        for job in list(self._jobs.values()):  # the connector closes once its copies have ended
            if job.transfer is not None:
                self._end_daemon_copy(job)
        if self.conn is not None:
            try:
                self.conn.close()
            except (KVConnectorError, grpc.RpcError):
                pass  # the daemon is gone, and the registration with it
            self.conn = None
        if self.sc is not None:
            self.sc.close()
            self.sc = None

    def _finish(self, job: _Job) -> None:
        job.done = True
        with self._cv:
            # a single group's failed blocks are known from the moment the job ends: a
            # synchronous load (vLLM 0.33, waited on within the step) reports them at once
            if job.failed is not None and len(job.failed) and not self.multi_group:
                self._failed_blocks.update(int(b) for b in job.failed)
            self._jobs.pop(job.job_id, None)
            self._finished.append(job)
            self._cv.notify_all()

    # -- in-process copies (background thread) ------------------------------------------------

    def _run(self) -> None:
        while True:
            _, _, job = self._q.get()
            if job is None:
                return
            try:
                if job.load:
                    self._load(job)
                else:
                    self._store(job)
            except Exception as e:  # noqa: BLE001 - a failed copy must not kill the engine
                log.exception("kvtier: %s %d failed", "load" if job.load else "store", job.job_id)
                self._down(e)
                self._count_failed(job)
            self._finish(job)

    def _count_failed(self, job: _Job) -> None:
        """A job none of whose blocks moved: a load's blocks are all reported failed (vLLM
        recomputes them), a store's keys counted as failed."""
        if job.load:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, len(job.block_ids), "error")
        else:
            self.counts.add(M_STORE, len(job.keys), "failed")

    def _parts(self, job: _Job) -> list[tuple[_Group, slice]]:
        if job.parts is None:
            return [(self.groups[0], slice(0, len(job.keys)))]
        return [(self.groups[g], sl) for g, sl in job.parts]

    def _store(self, job: _Job) -> None:
        sc = self._sidecar()
        if sc is None:
            self.counts.add(M_STORE, len(job.keys), "failed")
            return
        torch = _torch()
        for grp, sl in self._parts(job):
            ids = torch.as_tensor(job.block_ids[sl], device=grp.tensors[0].device)
            staged = torch.cat([t.index_select(0, ids) for t in grp.tensors], dim=1).cpu()
            rows = staged.numpy().view(np.uint8)
            try:
                res = sc.put(grp.lid, job.keys[sl], list(rows))
            except KvtierError as e:
                self._down(e)
                self.counts.add(M_STORE, len(job.keys[sl]), "failed")
                return
            self.breaker.ok()
            job.nbytes += res.stored * grp.block_bytes
            self.counts.add(M_STORE, res.stored, "stored")
            self.counts.add(M_STORE, res.present, "present")
            self.counts.add(M_STORE, len(res.dropped), "dropped")

    def _load(self, job: _Job) -> None:
        n = len(job.keys)
        sc = None if self.faults.fail else self._sidecar()
        if sc is None:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, n, "test" if self.faults.fail else "error")
            return
        bad = np.zeros(n, dtype=bool)
        for grp, sl in self._parts(job):
            buf = np.empty((sl.stop - sl.start, grp.block_bytes), dtype=np.uint8)
            try:
                got = sc.get(grp.lid, job.keys[sl], out=list(buf))
            except KvtierError as e:
                self._down(e)
                bad[sl] = True
                self.counts.add(M_LOAD_FAILED, sl.stop - sl.start, "error")
                continue
            self.breaker.ok()
            ok = np.array([g is not None for g in got], dtype=bool)
            bad[sl] = ~ok
            self.counts.add(M_LOAD_FAILED, int((~ok).sum()), "missing")
            if ok.any():
                self._scatter(grp, job.block_ids[sl][ok], buf[ok])
                job.nbytes += int(ok.sum()) * grp.block_bytes
                self.counts.add(M_LOADED, int(ok.sum()))
        job.failed = job.block_ids[bad]

    def _scatter(self, grp: _Group, block_ids: np.ndarray, rows: np.ndarray) -> None:
        torch = _torch()
        dev = grp.tensors[0].device
        ids = torch.as_tensor(block_ids, device=dev)
        staged = torch.from_numpy(rows).view(torch.int8).to(dev)
        off = 0
        for t, page in zip(grp.tensors, grp.pages, strict=True):
            t.index_copy_(0, ids, staged[:, off:off + page])
            if self.faults.corrupt:
                t.index_fill_(0, ids, 0)
            off += page

    # -- daemon copies (KVConnector) ----------------------------------------------------------

    def _start_daemon_copy(self, job: _Job) -> None:
        if job.load and self.faults.fail:
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, len(job.block_ids), "test")
            self._finish(job)
            return
        if self.breaker.bypassed() or (self._stale and not self._reopen_daemon()):
            self._daemon_copy_failed(job, None)
            return
        assert self.conn is not None
        try:
            job.transfer = (self.conn.onboard(job.keys, job.block_ids) if job.load
                            else self.conn.offload(job.keys, job.block_ids))
        except (KVConnectorError, grpc.RpcError) as e:
            self._daemon_copy_failed(job, e)

    def _poll_daemon(self) -> None:
        for job in list(self._jobs.values()):
            if job.transfer is not None and job.transfer.done():
                self._end_daemon_copy(job)

    def _end_daemon_copy(self, job: _Job) -> None:
        try:
            # (no deadline of its own: the call's deadline bounds the reply, and a failed load is
            # reported only once the daemon has ended it, or else vLLM would recompute into pages
            # a late copy may still write; KVConnector.settle_s bounds that)
            statuses = job.transfer.wait(None)
        except (KVConnectorError, TimeoutError) as e:
            self._daemon_copy_failed(job, e)
            return
        job.transfer = None
        st = np.array(statuses)
        if job.load:
            bad = st != "copied"
            job.failed = job.block_ids[bad]
            self.counts.add(M_LOAD_FAILED, int(bad.sum()), "missing")
            self.counts.add(M_LOADED, int((~bad).sum()))
            job.nbytes = int((~bad).sum()) * self.block_bytes
            if self.faults.corrupt and (~bad).any():
                self._zero(job.block_ids[~bad])
        else:
            for name, label in (("copied", "stored"), ("present", "present"), ("no_space", "dropped")):
                self.counts.add(M_STORE, int((st == name).sum()), label)
            job.nbytes = int((st == "copied").sum()) * self.block_bytes
        self._finish(job)

    def _daemon_copy_failed(self, job: _Job, err: Exception | None) -> None:
        if err is not None:
            self._down(err)
            self._stale = True
        job.transfer = None
        self._count_failed(job)
        self._finish(job)

    def _zero(self, block_ids: np.ndarray) -> None:
        torch = _torch()
        ids = torch.as_tensor(block_ids, device=self.tensors[0].device)
        for t in self.tensors:
            t.index_fill_(0, ids, 0)


def _torch() -> Any:
    import torch  # noqa: PLC0415 - vLLM brings it

    return torch



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
from kvtier.client.vllm.keys import KeyMap, KvtierLoadSpec, KvtierStoreSpec, block_keys_for
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
class _Job:
    job_id: int
    load: bool
    keys: list[bytes]
    block_ids: np.ndarray
    start: float = field(default_factory=time.perf_counter)
    failed: np.ndarray | None = None   # block ids whose load failed
    nbytes: int = 0
    transfer: Any = None               # daemon copy in flight (KVConnector Transfer)
    done: bool = False


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: moves pages between vLLM's KV tensors and kvtier (the package docstring)."""

    def __init__(self, settings: KvtierSettings, keymap: KeyMap, layout: Layout, kv_caches: CanonicalKVCaches,
                 client_name: str) -> None:
        self.settings = settings
        self.keymap = keymap
        self.layout = layout
        self.client_name = client_name
        self.tensors, self.pages = self._tensors(kv_caches, layout)
        self.block_bytes = sum(self.pages)
        self.counts = Counts()
        self._cv = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[_Job] = []
        self._failed_blocks: set[int] = set()
        self.breaker = Breaker(settings.retry_s, log)  # after a failed call: bypass kvtier for retry_s
        self.faults = FAULTS
        if self.faults.corrupt or self.faults.fail:
            log.warning("kvtier: test-only fault injection is on (%s): never in production",
                        "corrupt loads" if self.faults.corrupt else "fail loads")
        self.conn: KVConnector | None = None
        self._stale = False               # the daemon copy registration must be made (again)
        self.sc: Sidecar | None = None
        self.lid = 0
        self.mode = self._open(settings.copy)
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._thread: threading.Thread | None = None
        if self.mode == "process":
            self._thread = threading.Thread(target=self._run, name="kvtier-copy", daemon=True)
            self._thread.start()

    @staticmethod
    def _tensors(kv_caches: CanonicalKVCaches, layout: Layout) -> tuple[list[Any], list[int]]:
        """vLLM's distinct page tensors of the group, checked against the layout."""
        seen: list[int] = []
        for ref in kv_caches.group_data_refs[0]:
            if ref.tensor_idx not in seen:
                seen.append(ref.tensor_idx)
        tensors = [kv_caches.tensors[i].tensor for i in seen]
        pages = [t.shape[1] * t.element_size() for t in tensors]
        want = [t.shape[1] * DTYPE_BYTES[t.dtype] for t in layout.tensors]
        if pages != want:
            raise ValueError(f"kvtier: vLLM's KV pages are {pages} bytes per tensor, but its offloading config "
                             f"implies {want}; this KV cache layout is not supported")
        return tensors, pages

    # -- connection ---------------------------------------------------------------------------

    def _open(self, mode: str) -> str:
        """Pick how pages move (``kvtier_copy``) and connect. Never blocks past the timeout:
        a daemon that is not there yet is connected to later."""
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
            self.lid = self.sc.register_layout(self.layout)
        except KvtierError as e:
            log.warning("kvtier: daemon not reachable (%s); loads miss until it is", e)
            self.lid = 0
        return "process"

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
        if not self.lid:
            try:
                self.lid = self.sc.register_layout(self.layout)
            except KvtierError as e:
                self._down(e)
                return None
        return self.sc

    def _down(self, err: Exception) -> None:
        self.breaker.failed(err)

    # -- OffloadingWorker ---------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierStoreSpec)
        keys = block_keys_for(dst_spec.chunks, src_spec, self.keymap.blocks_per_chunk)
        self._submit(_Job(job_id, False, keys, np.asarray(src_spec.block_ids, dtype=np.int64)))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvtierLoadSpec)
        ids = np.asarray(dst_spec.block_ids, dtype=np.int64)
        try:
            keys = block_keys_for(src_spec.chunks, dst_spec, self.keymap.blocks_per_chunk)
        except ValueError as e:  # never a wrong page: a load that cannot be mapped is recomputed
            log.error("kvtier: load %d not understood (%s); recomputing it", job_id, e)
            job = _Job(job_id, True, [], ids, failed=ids)
            self.counts.add(M_LOAD_FAILED, len(ids), "error")
            self._finish(job)
            return True
        self._submit(_Job(job_id, True, keys, ids))
        return True

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
                if job.failed is not None and len(job.failed):
                    self._failed_blocks.update(int(b) for b in job.failed)
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
        """Engine block ids whose load failed since the last call (vLLM recomputes them)."""
        with self._cv:
            out, self._failed_blocks = self._failed_blocks, set()
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

    def _store(self, job: _Job) -> None:
        sc = self._sidecar()
        if sc is None:
            self.counts.add(M_STORE, len(job.keys), "failed")
            return
        torch = _torch()
        ids = torch.as_tensor(job.block_ids, device=self.tensors[0].device)
        staged = torch.cat([t.index_select(0, ids) for t in self.tensors], dim=1).cpu()
        rows = staged.numpy().view(np.uint8)
        try:
            res = sc.put(self.lid, job.keys, list(rows))
        except KvtierError as e:
            self._down(e)
            self.counts.add(M_STORE, len(job.keys), "failed")
            return
        self.breaker.ok()
        job.nbytes = res.stored * self.block_bytes
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
        buf = np.empty((n, self.block_bytes), dtype=np.uint8)
        try:
            got = sc.get(self.lid, job.keys, out=list(buf))
        except KvtierError as e:
            self._down(e)
            job.failed = job.block_ids
            self.counts.add(M_LOAD_FAILED, n, "error")
            return
        self.breaker.ok()
        ok = np.array([g is not None for g in got], dtype=bool)
        job.failed = job.block_ids[~ok]
        self.counts.add(M_LOAD_FAILED, int((~ok).sum()), "missing")
        if ok.any():
            self._scatter(job.block_ids[ok], buf[ok])
            job.nbytes = int(ok.sum()) * self.block_bytes
            self.counts.add(M_LOADED, int(ok.sum()))

    def _scatter(self, block_ids: np.ndarray, rows: np.ndarray) -> None:
        torch = _torch()
        dev = self.tensors[0].device
        ids = torch.as_tensor(block_ids, device=dev)
        staged = torch.from_numpy(rows).view(torch.int8).to(dev)
        off = 0
        for t, page in zip(self.tensors, self.pages, strict=True):
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



"""Engine-side connector of the ``kvtier.v1.Transfer`` service: :class:`KVConnector`.

An inference engine registers its paged KV tensors once and then asks the daemon to copy
blocks between them and the node's host tier; no KV byte passes through this process or
through gRPC. Supported tensors, given in the layout's order:

* vLLM per-layer tensors ``[2, num_blocks, block_tokens, heads, dim]`` or
  ``[num_blocks, 2, ...]`` (``Layout.vllm``): engine ids are block ids, one per key;
* SGLang per-layer K and V buffers indexed by token (``Layout.sglang``, page size 1):
  engine ids are ``block_tokens`` token indices per key.

Memory kinds
    CUDA tensors are exported with CUDA IPC (``torch``'s storage IPC handle; the daemon opens
    each allocation once). Memory CUDA IPC cannot export (virtual-memory-managed allocations:
    PyTorch's ``expandable_segments:True``, vLLM's sleep-mode allocator) is refused with
    :class:`ExportError` naming the cause. The CPU stand-in takes CPU tensors backed by a memfd
    sealed against shrinking (:class:`SharedKVArena` makes them): its descriptor is passed to
    the daemon over the unix socket (SCM_RIGHTS), never a path, and the seal keeps the region
    from shrinking under the daemon's mapping. The event ring is such a memfd too.

Completion, per request, through a ring of interprocess events exchanged at registration
(CUDA: ``torch.cuda.Event(interprocess=True)``; stand-in: a shared file of sequence numbers,
``2*seq`` once the engine's KV is written, ``2*seq + 1`` once the daemon's copy is complete):

* ``offload`` records "KV written" on the engine's stream before asking; the daemon's stream
  waits for it. Don't reuse those pages until ``Transfer.done()`` (or ``wait()``).
* ``onboard`` (CUDA: after recording on the engine's stream the point its copy must follow)
  returns at once; ``Transfer.wait_on(stream)`` makes the engine's stream wait for
  the copy without blocking the CPU thread once the reply is in; ``done()`` polls;
  ``wait()`` blocks. A key the daemon does not hold comes back ``"missing"`` and its engine
  page is not touched.

Ring slots and sequence numbers: every request carries a sequence number newer than any
before it (one counter per connector), and a slot is handed out again in the order slots were
freed (the least recently used first). A transfer whose deadline passes frees its slot once
settled (below); the daemon keeps a reused slot safe too (:mod:`kvtier.daemon.gpu`: a slot
belongs to its newest sequence number): a newer request in the slot supersedes the old transfer, which is then never
committed nor copied if its copy was not issued yet, an offload whose call was cancelled is
never committed, and a request older than its slot's newest is refused FAILED_PRECONDITION.
A copy already issued cannot be withdrawn, though (nor, on CUDA, a completion record already
queued on the slot's event), so a transfer that fails without the daemon's answer (its
deadline, a cancel, a broken connection) is settled before its error is raised (``wait``) or
it counts as done (``done``), and before its slot is handed out again: an empty onboard on its
slot, with a newer number, is answered only once the daemon has ended the failed one
(``settle_s`` bounds the asking; :meth:`Transfer._settled`). Its engine pages may be reused then.

The connector holds a Node session (:mod:`kvtier.client.engine.transport`, as the sidecars do)
for as long as it is open: if the process dies, the daemon closes the registration, its
handles and its slots. No daemon at the socket (a wrong path, a stopped or killed daemon) is
:class:`~kvtier.client.engine.transport.Unavailable` at once, naming the socket, as for the
sidecars. Errors are the sidecars' :class:`KvtierError` (``KVConnectorError`` is
the same class); memory that cannot be shared with the daemon is :class:`ExportError`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvtier.client.engine.transport import (
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    Transport,
    Unavailable,
    default_client_name,
)
from kvtier.proto import node_pb2, transfer_pb2
from kvtier.tiers.copy_engine import sealed_memfd
from kvtier.tiers.layout import DTYPE_BYTES, Layout, layout_to_proto

log = logging.getLogger("kvtier.connector")

_STATUS = {transfer_pb2.TRANSFER_COPIED: "copied", transfer_pb2.TRANSFER_PRESENT: "present",
           transfer_pb2.TRANSFER_NO_SPACE: "no_space", transfer_pb2.TRANSFER_MISSING: "missing"}


KVConnectorError = KvtierError  # the connector's errors are the engine library's one error type


class ExportError(FailedPrecondition):
    """KV memory this process cannot share with the daemon; the message says why and what to change."""


def _torch() -> Any:
    import torch  # noqa: PLC0415 - engine side only

    return torch


class SharedKVArena:
    """CPU stand-in KV memory: one memfd sealed against shrinking and growing, carved into a
    layout's tensors. It has no name in any directory (``directory`` is accepted and ignored);
    :attr:`fd` is what the connector passes to the daemon. Lives until :meth:`close` (and
    while the daemon has it mapped)."""

    def __init__(self, layout: Layout, directory: str = "/dev/shm", name: str | None = None) -> None:
        torch = _torch()
        self.layout = layout
        sizes = [int(np.prod(t.shape)) * DTYPE_BYTES[t.dtype] for t in layout.tensors]
        self.size = max(mmap.PAGESIZE, sum(-(-s // 4096) * 4096 for s in sizes))
        self.fd = sealed_memfd(name or f"kvtier-kv-{os.getpid()}-{id(self):x}", self.size)
        self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.tensors: list[Any] = []
        self.offsets: list[int] = []  # byte offset of each tensor in the file
        off = 0
        for t, n in zip(layout.tensors, sizes, strict=True):
            dtype = getattr(torch, t.dtype)
            self.tensors.append(self._buf[off:off + n].view(dtype).view(t.shape))
            self.offsets.append(off)
            off += -(-n // 4096) * 4096

    def close(self) -> None:
        self.tensors.clear()
        self._buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor view is still alive somewhere; the mapping goes with it


def _maps() -> list[tuple[int, int, int, int, str]]:
    """(lo, hi, file offset, inode, path) of each mapping of this process."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16), int(parts[4]), parts[5].rstrip("\n")))
    return out


def _memfds() -> dict[int, int]:
    """inode -> an open descriptor of this process for each memfd it holds open."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                out.setdefault(os.stat(f"/proc/self/fd/{name}").st_ino, int(name))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, for one)
    return out


def _host_allocations(names: Sequence[str], tensors: Sequence[Any]) -> tuple[list[transfer_pb2.KVAllocation],
                                                                               list[transfer_pb2.KVTensorRef], list[int]]:
    """Find the memfd behind each CPU tensor (``/proc/self/maps``, then this process's open
    descriptors); returns the allocations, the tensor refs and each allocation's descriptor
    (this process's, to pass to the daemon)."""
    maps, memfds = _maps(), _memfds()
    allocs: dict[int, int] = {}
    out_allocs: list[transfer_pb2.KVAllocation] = []
    fds: list[int] = []
    refs = []
    for name, t in zip(names, tensors, strict=True):
        ptr = t.data_ptr()
        hit = next(((lo, off, ino, path) for lo, hi, off, ino, path in maps if lo <= ptr < hi), None)
        if hit is None or not hit[3].startswith("/memfd:") or hit[2] not in memfds:
            raise ExportError(f"tensor {name}: CPU KV memory must be a memfd sealed against shrinking, held open "
                              f"by this process, which is passed to the daemon (this one is "
                              f"{hit[3] if hit else 'unmapped'!r}); allocate it with kvtier.client.engine.SharedKVArena")
        lo, off, ino, _ = hit
        if ino not in allocs:
            allocs[ino] = len(out_allocs)
            fd = memfds[ino]
            fds.append(fd)
            out_allocs.append(transfer_pb2.KVAllocation(size=os.fstat(fd).st_size))
        refs.append(transfer_pb2.KVTensorRef(allocation=allocs[ino], offset=off + ptr - lo))
    return out_allocs, refs, fds


def _check_ipc_capable(ptr: int, name: str) -> None:
    """Refuse virtual-memory-managed allocations, which cudaIpcGetMemHandle cannot export."""
    try:
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError:
        return  # torch's own export below still fails on such memory, with a less precise message
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    err, capable = driver.cuPointerGetAttribute(attr, ptr)
    if err == driver.CUresult.CUDA_SUCCESS and not capable:
        raise ExportError(_VMM_MESSAGE.format(name=name))


_VMM_MESSAGE = ("tensor {name}: its memory cannot be exported with CUDA IPC: it is a virtual-memory-managed "
                "allocation (cuMemCreate), as made by PyTorch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "or vLLM's sleep-mode allocator (--enable-sleep-mode). Allocate the KV cache without them.")


_CUDA_IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


def raw_ipc_handle(handle: object, name: str) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside what ``UntypedStorage._share_cuda_()`` returned.

    Older PyTorch returns the raw handle; newer PyTorch (seen: 2.11 on the H200 machine) returns
    a versioned one: a version byte, a type byte (``'c'`` for a cudaMalloc block, ``'e'`` for an
    expandable segment), then for ``'c'`` the raw handle. Only ``'c'`` memory can be opened with
    cudaIpcOpenMemHandle; anything else is refused with the cause named.
    """
    if not isinstance(handle, bytes):
        raise ExportError(f"tensor {name}: torch returned a {type(handle).__name__} CUDA IPC handle, not bytes")
    if len(handle) == _CUDA_IPC_HANDLE_SIZE:
        return handle
    if len(handle) == _CUDA_IPC_HANDLE_SIZE + 2 and handle[1] == ord("c"):
        return handle[2:]
    if len(handle) >= 2 and handle[1] == ord("e"):
        raise ExportError(_VMM_MESSAGE.format(name=name))
    raise ExportError(f"tensor {name}: torch returned a CUDA IPC handle of {len(handle)} bytes in a format "
                      f"kvtier does not know (version byte {handle[:1].hex() or 'none'})")


def uuid_bytes(uuid: Any) -> bytes:
    """The 16 bytes of a GPU UUID as torch gives it (``get_device_properties(d).uuid``: a
    ``_CUuuid`` with ``bytes``, or its text, ``[GPU-]xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``)."""
    raw = getattr(uuid, "bytes", None)
    if raw is not None and len(raw) == 16:
        return bytes(bytearray(raw))
    text = str(uuid).strip().lower().removeprefix("gpu-").replace("-", "")
    try:
        out = bytes.fromhex(text)
    except ValueError:
        out = b""
    if len(out) != 16:
        raise ExportError(f"torch gave the GPU UUID {str(uuid)!r}, not 16 bytes kvtier can read")
    return out


def _cuda_allocations(names: Sequence[str], tensors: Sequence[Any]) -> tuple[list[transfer_pb2.KVAllocation],
                                                                               list[transfer_pb2.KVTensorRef]]:
    """Export each CUDA tensor's allocation once (CUDA IPC handle of its caching-allocator block),
    with its GPU's UUID: the daemon may see the node's GPUs under other ordinals."""
    torch = _torch()
    uuids: dict[int, bytes] = {}
    allocs: dict[bytes, int] = {}
    out_allocs: list[transfer_pb2.KVAllocation] = []
    refs = []
    for name, t in zip(names, tensors, strict=True):
        _check_ipc_capable(t.data_ptr(), name)
        storage = t.untyped_storage()
        try:
            device, handle, size, base_off = storage._share_cuda_()[:4]
        except RuntimeError as e:
            raise ExportError(f"{_VMM_MESSAGE.format(name=name)} (torch said: {e})") from None
        handle = raw_ipc_handle(handle, name)
        if handle not in allocs:
            allocs[handle] = len(out_allocs)
            device = int(device)
            if device not in uuids:  # (a torch without it: none sent, the daemon compares ordinals)
                uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
                uuids[device] = b"" if uuid is None else uuid_bytes(uuid)
            out_allocs.append(transfer_pb2.KVAllocation(ipc_handle=handle, size=0, device=device,
                                                        device_uuid=uuids[device]))
        a = out_allocs[allocs[handle]]
        a.size = max(a.size, base_off + size)
        refs.append(transfer_pb2.KVTensorRef(allocation=allocs[handle],
                                             offset=base_off + t.storage_offset() * t.element_size()))
    return out_allocs, refs


def _check_tensors(layout: Layout, tensors: Sequence[Any]) -> None:
    """Refuse tensors that do not match the layout (count, shape, dtype) or are not contiguous."""
    if len(tensors) != len(layout.tensors):
        raise InvalidArgument(f"{len(tensors)} tensors for a layout of {len(layout.tensors)}")
    for spec, t in zip(layout.tensors, tensors, strict=True):
        if tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise InvalidArgument(f"tensor {spec.name}: {str(t.dtype)} {list(t.shape)} does not match the "
                                  f"layout's {spec.dtype} {list(spec.shape)}")
        if not t.is_contiguous():
            raise InvalidArgument(f"tensor {spec.name} is not contiguous")


# A transfer that failed with one of these was refused before the daemon took it up (nothing of
# it was, or will be, copied or recorded); any other failure (a deadline, a cancel, a broken
# connection) leaves the daemon's copy possibly still to come, and the transfer is settled first
# (Transfer._settled).
_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.UNAUTHENTICATED})


class Transfer:
    """One offload or onboard in flight (see the module docstring)."""

    def __init__(self, conn: KVConnector, future: Any, slot: int, seq: int, nkeys: int,
                 registration_id: int = 0) -> None:
        self._conn = conn
        self._future = future
        self.slot = slot
        self.seq = seq
        self.nkeys = nkeys
        self.registration_id = registration_id
        self._released = False
        self._statuses: list[str] | None = None
        self._fence: tuple[Any, int] | None = None  # (future, seq) of the settling request in flight
        self._settle_by = 0.0                        # when settling gives up (0: not begun)
        self._fence_after = 0.0                      # no new settling request before this (after a failed one)
        self._fence_pause = 0.02
        self._gen = conn._gen                        # the registration its slot belongs to

    def _reply(self, timeout: float | None = None) -> transfer_pb2.TransferReply:
        try:
            return self._future.result(timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"no reply for transfer {self.seq} within {timeout} s") from None
        except grpc.RpcError as e:
            while not self._settled():  # bounded: KVConnector.settle_s
                time.sleep(0.002)
            raise self._conn._transport.error(e) from None

    def _complete(self) -> bool:
        return self._conn._slot_complete(self.slot, self.seq)

    def _settled(self) -> bool:
        """After a failed RPC, whether this transfer's engine pages and event slot may be used
        again; frees its slot once they may. A refused transfer is settled at once. One that
        failed otherwise (its deadline passed, the call was cancelled or its connection broke)
        may still be running at the daemon: an onboard's copy may still write pages the engine
        would reuse, and (CUDA) the daemon's completion record may still land on the slot's
        event after the engine's next "KV written" record there, which the next transfer in
        the slot would then take for its own. So an empty onboard is sent on the same slot
        with a newer sequence number, and the daemon answers it only once this transfer has
        ended there (a newer request on a slot supersedes the one in it, which then copies
        nothing unless its copy was issued, and waits for it). Its answer settles this one; a
        failed one is sent again, until the daemon or the registration is gone (its copies
        went with it) or ``settle_s`` has passed (logged: a page or the slot's event may then
        still be written late). Never blocks."""
        with self._conn._lock:  # (a submit in another thread may poll this transfer too)
            return self._settle_step()

    def _settle_step(self) -> bool:
        if self._released:
            return True
        conn = self._conn
        err = self._future.exception()
        if isinstance(err, grpc.Call) and err.code() in _REFUSED or self._gen != conn._gen:
            self._release()  # (refused; or the registration it belonged to is gone, closed after its copies)
            return True
        now = time.monotonic()
        if not self._settle_by:
            self._settle_by = now + conn.settle_s
        elif now > self._settle_by:
            log.error("kvtier: could not confirm that transfer %d (event slot %d) ended at the daemon within "
                      "%.0f s; its engine pages and slot are given back now and may still be written late",
                      self.seq, self.slot, conn.settle_s)
            self._release()
            return True
        if self._fence is None:
            if now < self._fence_after:
                return False
            seq = next(conn._seq)
            req = transfer_pb2.TransferRequest(session_id=conn.session_id, registration_id=self.registration_id,
                                               keys=[], engine_ids=[], event_slot=self.slot, seq=seq,
                                               wait_written=False)
            self._fence = (conn._transport.onboard_future(req), seq)
            return False
        fence, seq = self._fence
        if not fence.done():
            return False
        ferr = fence.exception()
        if ferr is None:
            if not conn._slot_complete(self.slot, seq):
                return False
        elif isinstance(ferr, grpc.Call) and ferr.code() in (grpc.StatusCode.UNAVAILABLE, *_REFUSED):
            # the daemon is gone, or the session or registration is (closed once its copies
            # ended, or closing): asking again cannot be answered otherwise
            log.warning("kvtier: transfer %d failed and the daemon could not be asked whether it ended (%s); "
                        "taking its engine pages and slot back", self.seq, ferr.details())
        else:
            # (a deadline: the daemon is slow) ask again, with a newer number, after a pause
            self._fence = None
            self._fence_after = time.monotonic() + self._fence_pause
            self._fence_pause = min(2 * self._fence_pause, 1.0)
            return False
        conn.counts_settled += 1
        self._release()
        return True

    def done(self) -> bool:
        """Non-blocking: the reply is in and the completion has been recorded and reached (a
        failed transfer: and settled, see :meth:`_settled`)."""
        if self._released:
            return True
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return self._settled()
        if self._complete():
            self._release()
            return True
        return False

    def wait(self, timeout: float | None = None) -> list[str]:
        """Block until the copy is complete; per key ``copied | present | no_space | missing``.
        ``timeout`` bounds the wait for the reply (TimeoutError); a failed transfer raises only
        once it is settled (its pages may be reused then), which ``settle_s`` bounds."""
        reply = self._reply(timeout)
        if not self._released:  # (released: its completion was reached, and the slot may be another's now)
            self._conn._slot_wait(self.slot, self.seq)
            self._release()
        return [_STATUS[s] for s in reply.status]

    def wait_on(self, stream: Any = None) -> list[str]:
        """CUDA: make ``stream`` (default: the current one) wait for the copy; the CPU thread waits
        only for the reply. The stand-in has no streams and waits for the copy."""
        reply = self._reply()
        if self._released:  # its completion was reached already (a submit polled it)
            return [_STATUS[s] for s in reply.status]
        if self._conn.backend == "cuda":
            torch = _torch()
            (stream or torch.cuda.current_stream()).wait_event(self._conn._events[self.slot])
            self._conn._defer_release(self)
        else:
            self._conn._slot_wait(self.slot, self.seq)
            self._release()
        return [_STATUS[s] for s in reply.status]

    @property
    def statuses(self) -> list[str]:
        return [_STATUS[s] for s in self._reply().status]

    def _release(self) -> None:
        with self._conn._lock:  # (another thread's submit may poll this transfer: free the slot once)
            if not self._released:
                self._released = True
                if self._gen == self._conn._gen:  # (else the slot is a later registration's)
                    self._conn._free_slot(self.slot)


@dataclass
class _Registration:
    registration_id: int
    layout_id: int
    copy_engine: str
    layout: Layout


class KVConnector:
    """Registers one engine's KV tensors with the local kvtierd and moves blocks (module docstring)."""

    def __init__(self, socket_path: str | None = None, *, target: str | None = None,
                 client_name: str | None = None, ring_slots: int = 64, timeout: float = 60.0,
                 ring_dir: str = "/dev/shm", settle_s: float = 60.0) -> None:
        self._transport = Transport(socket_path, target=target,
                                    client_name=client_name or default_client_name("engine"), timeout=timeout)
        self.target = self._transport.target
        self.client_name = self._transport.client_name
        self.timeout = timeout
        self.settle_s = settle_s  # most seconds a failed transfer is settled for (Transfer._settled)
        self.counts_settled = 0   # failed transfers settled by asking the daemon (or finding it gone)
        self.ring_slots = ring_slots
        self.ring_dir = ring_dir
        self._stub = self._transport.transfer  # (tests speak the raw protocol on it)
        self.backend = ""
        self.reg: _Registration | None = None
        self._events: list[Any] = []
        self._ring: np.ndarray | None = None
        self._ring_map: mmap.mmap | None = None
        self._seq = itertools.count(1)
        self._gen = 0  # registrations made so far: a transfer's slot is its registration's
        self._lock = threading.Condition()
        self._free: collections.deque[int] = collections.deque()
        self._deferred: collections.deque[Transfer] = collections.deque()
        # transfers holding a slot, by slot: a submit that finds no free slot polls them (their
        # owner may poll only after it has submitted a whole step's transfers)
        self._live: dict[int, Transfer] = {}
        self._tensors: list[Any] = []

    # -- session ---------------------------------------------------------------------------

    @property
    def session_id(self) -> int:
        """The session the registration lives in; 0 before ``register``."""
        return self._transport.session.session_id

    def _open_session(self) -> int:
        return self._transport.session.open()

    # -- registration ----------------------------------------------------------------------

    def register(self, layout: Layout, tensors: Sequence[Any], timeout: float | None = None) -> int:
        """Register ``tensors`` (one per layout tensor, in order; all CUDA or all CPU) and the
        event ring. Returns the layout's Node id (for Lookup and Evict through a Sidecar).
        ``timeout``: this call's deadline (default: the connector's); on a GPU the daemon pins
        its host pool during the first registration, about 0.085 s per GiB."""
        if self.reg is not None:
            raise FailedPrecondition("this connector already holds a registration: unregister() first")
        _check_tensors(layout, tensors)
        names = [t.name for t in layout.tensors]
        kinds = {t.device.type for t in tensors}
        if kinds == {"cuda"}:
            self.backend = "cuda"
            allocations, refs = _cuda_allocations(names, tensors)
            torch = _torch()
            with torch.cuda.device(tensors[0].device):
                self._events = [torch.cuda.Event(enable_timing=False, interprocess=True)
                                for _ in range(self.ring_slots)]
                handles = [ev.ipc_handle() for ev in self._events]
            ring = {"event_handles": handles}
        elif kinds == {"cpu"}:
            self.backend = "host"
            allocations, refs, fds = _host_allocations(names, tensors)
            fds.append(self._host_ring())  # passed last; closed here once passed (the daemon gets its own)
            ring = {}
        else:
            raise InvalidArgument(f"KV tensors must be all CUDA or all CPU tensors, not {sorted(kinds)}")
        try:
            sid = self._open_session()  # (no daemon: Unavailable at once, or a deadline; nothing left behind)
            if self.backend == "host":
                ring = {"event_ring_fd_handle": self._pass_fds(fds, allocations)}
            req = transfer_pb2.RegisterKVRequest(session_id=sid,
                                                 layout=layout_to_proto(layout, node_pb2.LayoutSpec),
                                                 backend=self.backend, allocations=allocations, tensors=refs,
                                                 ring_slots=self.ring_slots, **ring)
            reply = self._transport.run(self._transport.register_kv(req, timeout=timeout or self.timeout,
                                                                    wait_for_ready=True))
        except BaseException:
            self._drop_ring()
            raise
        finally:
            if self.backend == "host":
                os.close(fds[-1])  # the ring's: the daemon holds its own, the mapping keeps it here
        self.reg = _Registration(reply.registration_id, reply.layout_id, reply.copy_engine, layout)
        with self._lock:  # a new registration's slots: transfers of an earlier one never free them
            self._gen += 1
            self._free = collections.deque(range(self.ring_slots))
            self._live.clear()
            self._deferred.clear()
        self._tensors = list(tensors)  # keep the memory alive while the daemon has it open
        return reply.layout_id

    @property
    def copy_engine(self) -> str:
        return self.reg.copy_engine if self.reg else ""

    def unregister(self) -> None:
        """Wait for every transfer in flight, then close the registration in the daemon."""
        if self.reg is None:
            return
        deadline = time.monotonic() + self.timeout + 5.0  # (each transfer's RPC ends by its own deadline)
        with self._lock:
            while len(self._free) + len(self._deferred) < self.ring_slots:
                self._lock.wait(0.05)
                self._reap()
                self._poll_live()
                if time.monotonic() > deadline:
                    log.warning("kvtier: unregistering with %d transfers still unanswered",
                                self.ring_slots - len(self._free) - len(self._deferred))
                    break
        for t in list(self._deferred):
            self._slot_wait(t.slot, t.seq)
        try:
            self._transport.run(self._transport.unregister_kv(transfer_pb2.UnregisterKVRequest(
                session_id=self.session_id, registration_id=self.reg.registration_id)))
        finally:
            self.reg = None
            self._tensors = []
            self._drop_ring()

    def _host_ring(self) -> int:
        """The stand-in's event ring: a sealed memfd, mapped here; returns its descriptor."""
        ring_fd = sealed_memfd(f"kvtier-ring-{os.getpid()}-{id(self):x}", self.ring_slots * 8)
        try:
            self._ring_map = mmap.mmap(ring_fd, self.ring_slots * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(ring_fd)
            raise
        self._ring = np.frombuffer(self._ring_map, dtype=np.uint64)
        return ring_fd

    def _pass_fds(self, fds: list[int], allocations: list[transfer_pb2.KVAllocation]) -> str:
        """Pass the allocations' descriptors and the ring's (last) to the daemon over the unix
        socket; sets each allocation's handle and returns the ring's."""
        pass_fds = getattr(self._transport, "pass_fds", None)
        if pass_fds is None:
            raise FailedPrecondition("this kvtier client cannot pass file descriptors to the daemon, which maps "
                                     "CPU KV memory only from passed descriptors")
        handles = pass_fds(fds)
        for a, h in zip(allocations, handles, strict=False):
            a.fd_handle = h
        return handles[-1]

    def _drop_ring(self) -> None:
        self._events = []
        self._ring = None
        if self._ring_map is not None:
            try:
                self._ring_map.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._ring_map = None

    # -- transfers -------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[bytes], from_node: str | None = None) -> int:
        """Bring these blocks of the registered layout into the host tier ahead of an
        ``onboard``: from this node's disk, or with ``from_node`` from that peer daemon (a
        router's fetch hint); returns how many were brought. Blocking, bounded by
        the connector's timeout; the engine recomputes what did not arrive."""
        reg = self.reg
        if reg is None:
            raise FailedPrecondition("register() the KV tensors first")
        req = node_pb2.PrefetchRequest(layout_id=reg.layout_id, keys=[bytes(k) for k in keys],
                                       from_node=from_node or "")
        return int(self._transport.run(self._transport.prefetch(req)).promoted)

    def offload(self, keys: Sequence[bytes], engine_ids: Sequence[int] | np.ndarray, stream: Any = None) -> Transfer:
        """Copy these engine pages to the host tier under ``keys``. On CUDA, first records
        "KV written" on ``stream`` (default: current), which the daemon's copy waits for."""
        return self._request(self._transport.offload_future, keys, engine_ids, stream, wait_written=True)

    def onboard(self, keys: Sequence[bytes], engine_ids: Sequence[int] | np.ndarray, stream: Any = None) -> Transfer:
        """Copy the host tier's blocks ``keys`` into these engine pages. On CUDA, first records
        on ``stream`` (default: current) the point the copy must come after: work the engine
        queued before on those pages (a former owner's kernels) is not raced by the copy. The
        stand-in's engine writes are done when they return: nothing to wait for."""
        return self._request(self._transport.onboard_future, keys, engine_ids, stream,
                             wait_written=self.backend == "cuda")

    def _request(self, send: Callable[[transfer_pb2.TransferRequest], grpc.Future], keys: Sequence[bytes],
                 engine_ids: Any, stream: Any, wait_written: bool) -> Transfer:
        """Send an Offload or Onboard (``send``: the transport's ``offload_future`` or
        ``onboard_future``) on a free ring slot; its :class:`Transfer`."""
        reg = self.reg
        if reg is None:
            raise FailedPrecondition("register() the KV tensors first")
        ids = np.asarray(engine_ids, dtype=np.int64).ravel()
        slot = self._take_slot()
        seq = next(self._seq)
        if wait_written:  # "KV written": everything queued (CUDA) or done (CPU) before this point
            if self.backend == "cuda":
                self._events[slot].record(stream or _torch().cuda.current_stream())
            else:
                assert self._ring is not None
                self._ring[slot] = 2 * seq
        req = transfer_pb2.TransferRequest(session_id=self.session_id, registration_id=reg.registration_id,
                                           keys=[bytes(k) for k in keys], engine_ids=ids.tolist(),
                                           event_slot=slot, seq=seq, wait_written=wait_written)
        future = send(req)
        t = Transfer(self, future, slot, seq, len(keys), registration_id=reg.registration_id)
        with self._lock:
            self._live[slot] = t
        return t

    def _take_slot(self) -> int:
        with self._lock:
            while not self._free:
                self._reap()
                if not self._free:
                    self._poll_live()
                if not self._free:
                    self._lock.wait(0.01)
            return self._free.popleft()

    def _poll_live(self) -> None:
        """Free the slots of transfers that are over (replied and completed, or failed), which
        nobody polled yet: all slots taken by one step's submits would otherwise wait forever."""
        for t in list(self._live.values()):
            t.done()

    def _free_slot(self, slot: int) -> None:
        with self._lock:
            self._live.pop(slot, None)
            self._free.append(slot)
            self._lock.notify()

    def _defer_release(self, t: Transfer) -> None:
        """A CUDA onboard whose wait was put on a stream: free its slot once its event is reached."""
        t._released = True
        with self._lock:
            self._deferred.append(t)

    def _reap(self) -> None:
        while self._deferred and self._slot_complete(self._deferred[0].slot, self._deferred[0].seq):
            self._free.append(self._deferred.popleft().slot)

    def _slot_complete(self, slot: int, seq: int) -> bool:
        if self.reg is None:  # unregistered: the daemon closed the registration once its copies ended
            return True
        if self.backend == "cuda":
            return bool(self._events[slot].query())
        assert self._ring is not None
        return int(self._ring[slot]) == 2 * seq + 1

    def _slot_wait(self, slot: int, seq: int) -> None:
        if self.backend == "cuda":
            self._events[slot].synchronize()
            return
        if not self._slot_complete(slot, seq):
            raise KvtierError(grpc.StatusCode.INTERNAL,
                              f"the daemon replied but event slot {slot} does not hold sequence {seq}")

    def close(self) -> None:
        """Unregister (after the transfers in flight) and end the session. A daemon that is gone
        (Unavailable) is no error here: the registration went with its session."""
        try:
            self.unregister()
        except Unavailable:
            pass
        finally:
            self._transport.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

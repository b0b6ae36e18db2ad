"""Which GPU a registration's copies run on.

An engine pod given one GPU sees it as cuda:0 while the node's kvtierd (the chart's DaemonSet,
NVIDIA_VISIBLE_DEVICES=all) sees all eight: ordinals name different GPUs in the two processes,
so the daemon matches the engine's GPU by its UUID. These are the rules of that match and of
the UUID's way from torch to the daemon; the copies themselves need a GPU (scripts/gpu-check.sh).
"""

from __future__ import annotations

import pytest

from kvtier.client.engine.connector import ExportError, uuid_bytes
from kvtier.daemon.services.convert import kv_registration
from kvtier.proto.kvtier.v1 import node_pb2, transfer_pb2
from kvtier.tiers.copy_engine import AllocationRef, EngineMemoryError, match_device, uuid_text
from kvtier.tiers.layout import Layout, layout_to_proto

NODE = [bytes([0x10 + i]) * 16 for i in range(8)]  # the node's eight GPUs, as kvtierd sees them


def alloc(device: int = 0, uuid: bytes = b"") -> AllocationRef:
    return AllocationRef(1 << 20, bytes(64), device=device, device_uuid=uuid)


def test_an_engine_pod_s_cuda_0_is_matched_to_the_node_gpu_with_its_uuid() -> None:
    # the engine on the node's GPU 5 calls it cuda:0; the daemon started on cuda:0
    assert match_device(NODE, [alloc(0, NODE[5]), alloc(0, NODE[5])], default=0) == 5
    assert match_device(NODE, [alloc(3, NODE[0])], default=0) == 0


def test_a_gpu_the_daemon_cannot_see_is_refused_with_both_sides_named() -> None:
    stranger = bytes(range(16))
    with pytest.raises(EngineMemoryError) as e:
        match_device(NODE[:2], [alloc(0, stranger)], default=0)
    msg = str(e.value)
    assert uuid_text(stranger) in msg and uuid_text(NODE[0]) in msg and "NVIDIA_VISIBLE_DEVICES=all" in msg


def test_one_registration_on_two_gpus_is_refused() -> None:
    with pytest.raises(EngineMemoryError, match="more than one GPU"):
        match_device(NODE, [alloc(0, NODE[0]), alloc(1, NODE[1])], default=0)
    with pytest.raises(EngineMemoryError, match="more than one GPU"):
        match_device(NODE, [alloc(0), alloc(1)], default=0)
    with pytest.raises(EngineMemoryError, match="more than one GPU"):  # one with a UUID, one without
        match_device(NODE, [alloc(0, NODE[0]), alloc(0)], default=0)


def test_a_client_without_uuids_must_be_on_the_daemon_s_device() -> None:
    assert match_device(NODE, [alloc(2)], default=2) == 2
    with pytest.raises(EngineMemoryError, match="--cuda-device 1"):
        match_device(NODE, [alloc(1)], default=2)
    with pytest.raises(EngineMemoryError, match="16 bytes"):
        match_device(NODE, [alloc(0, b"short")], default=0)


def test_uuid_text_is_nvidia_smi_s_form() -> None:
    assert uuid_text(bytes.fromhex("0123456789abcdef0123456789abcdef")) == "GPU-01234567-89ab-cdef-0123-456789abcdef"


class _CUuuid:  # the shape of torch's torch._C._CUuuid: 16 ints in .bytes, the text from str()
    def __init__(self, raw: bytes) -> None:
        self.bytes = list(raw)

    def __str__(self) -> str:
        h = bytes(self.bytes).hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def test_torch_s_uuid_forms_all_give_the_16_bytes() -> None:
    raw = bytes.fromhex("0123456789abcdef0123456789abcdef")
    assert uuid_bytes(_CUuuid(raw)) == raw
    assert uuid_bytes(str(_CUuuid(raw))) == raw            # a torch that gives the text
    assert uuid_bytes(uuid_text(raw)) == raw               # with nvidia-smi's GPU- prefix
    assert uuid_bytes(uuid_text(raw).upper()) == raw
    for bad in ("", "GPU-0123", "not-a-uuid-at-all-zzzzzzzzzzzzzzzz"):
        with pytest.raises(ExportError, match="16 bytes"):
            uuid_bytes(bad)


def test_the_uuid_travels_from_the_wire_to_the_copy_engine() -> None:
    req = transfer_pb2.RegisterKVRequest(session_id=7, backend="cuda", ring_slots=1,
                                         layout=layout_to_proto(Layout.flat(4096), node_pb2.LayoutSpec))
    req.allocations.add(ipc_handle=bytes(64), size=4096, device=0, device_uuid=NODE[6])
    allocs = kv_registration(req).allocations
    assert allocs[0].device_uuid == NODE[6]
    assert match_device(NODE, allocs, default=0) == 6

from __future__ import annotations

import pytest

from kvtier.proto import node_pb2
from kvtier.tiers.layout import Layout, LayoutError, TensorSpec, layout_from_proto, layout_to_proto


def test_vllm_block_bytes_and_offsets() -> None:
    lay = Layout.vllm(num_layers=4, num_blocks=100, block_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16")
    per_layer = 2 * 16 * 8 * 128 * 2
    assert lay.block_bytes == 4 * per_layer
    assert lay.tensor_offsets() == [i * per_layer for i in range(4)]
    assert lay.slot_bytes % 4096 == 0 and lay.slot_bytes >= lay.block_bytes


def test_sglang_token_indexed() -> None:
    lay = Layout.sglang(num_layers=2, num_tokens=4096, block_tokens=32, kv_heads=4, head_dim=64, dtype="float16")
    assert len(lay.tensors) == 4 and all(t.token_indexed for t in lay.tensors)
    assert lay.block_bytes == 4 * 32 * 4 * 64 * 2


def test_fingerprint_ignores_number_of_blocks_only() -> None:
    a = Layout.vllm(2, 100, 16, 8, 128)
    b = Layout.vllm(2, 5000, 16, 8, 128)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != Layout.vllm(2, 100, 16, 8, 128, dtype="float16").fingerprint
    assert a.fingerprint != Layout.vllm(2, 100, 16, 8, 128, kv_first=False).fingerprint
    assert a.fingerprint != Layout.vllm(2, 100, 16, 8, 128, tp_rank=1, tp_size=2).fingerprint


def test_proto_round_trip() -> None:
    lay = Layout.sglang(3, 1000, 16, 2, 64)
    back = layout_from_proto(layout_to_proto(lay, node_pb2.LayoutSpec))
    assert back == lay and back.fingerprint == lay.fingerprint


@pytest.mark.parametrize("bad", [
    lambda: Layout((), 16),
    lambda: Layout((TensorSpec("a", "float16", (4, 4), 0),), 0),
    lambda: Layout((TensorSpec("a", "complex7", (4, 4), 0),), 16),
    lambda: Layout((TensorSpec("a", "float16", (4, 4), 2),), 16),
    lambda: Layout((TensorSpec("a", "float16", (4, 0), 0),), 16),
    lambda: Layout((TensorSpec("a", "float16", (4, 4), 0), TensorSpec("a", "float16", (4, 4), 0)), 16),
    lambda: Layout((TensorSpec("a", "float16", (4, 4), 0),), 16, tp_rank=2, tp_size=2),
    # bounded: each limit, one past it
    lambda: Layout(tuple(TensorSpec(f"t{i}", "uint8", (1, 1), 0) for i in range(4097)), 16),
    lambda: Layout((TensorSpec("a", "uint8", (1,) * 9, 0),), 16),
    lambda: Layout((TensorSpec("a", "uint8", (1, (1 << 40) + 1), 0),), 16),
    lambda: Layout((TensorSpec("a" * 129, "uint8", (1, 1), 0),), 16),
    lambda: Layout((TensorSpec("a", "uint8", (1, 1), 0),), (1 << 16) + 1),
    lambda: Layout((TensorSpec("a", "uint8", (1, 1), 0),), 16, tp_size=4097),
    lambda: Layout((TensorSpec("a", "uint8", (1, (1 << 30) + 1), 0),), 16),
])
def test_bad_layouts_say_what_is_wrong(bad) -> None:
    with pytest.raises(LayoutError):
        bad()


def test_layout_limit_messages_name_the_limit_and_stay_short() -> None:
    with pytest.raises(LayoutError, match="limit is 128 characters") as e:
        Layout((TensorSpec("n" * 1_000_000, "uint8", (1, 1), 0),), 16)
    assert len(str(e.value)) < 300
    with pytest.raises(LayoutError, match="unknown dtype") as e:
        Layout((TensorSpec("a", "d" * 1_000_000, (1, 1), 0),), 16)
    assert len(str(e.value)) < 600
    spec = layout_to_proto(Layout.flat(4096), node_pb2.LayoutSpec)
    for i in range(5000):
        spec.tensors.add(name=f"x{i}", dtype="uint8", shape=[1, 1], block_dim=0)
    with pytest.raises(LayoutError, match="limit is 4096 tensors"):
        layout_from_proto(spec)

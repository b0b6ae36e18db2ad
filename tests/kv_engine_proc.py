"""A stand-alone engine process for tests/test_gpu_path.py (started with subprocess, never forked).

    python tests/kv_engine_proc.py SOCKET BACKEND SHM_DIR [loop|stall]

Registers a vLLM-style KV cache (CPU shared memory for ``host``, CUDA for ``cuda``), then
``loop`` (default): forever offload every block under the keys of round r and onboard them
back, printing ``round r`` after each round, so the test can kill it anywhere and knows
which keys may exist; ``stall``: one round, then an offload whose "KV written" record never
comes (an engine dying while its forward pass still writes the KV), printing ``stalled``
once it is sent: the daemon's copy is then in flight, waiting, until the process dies (or
the daemon's --transfer-wait-s passes). The CPU stand-in's KV and event ring are sealed
memfds (SharedKVArena), passed to the daemon over the unix socket.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from kvtier.client.engine import KVConnector, SharedKVArena
from kvtier.proto import transfer_pb2
from kvtier.tiers.layout import Layout

LAYOUT = Layout.vllm(num_layers=8, num_blocks=192, block_tokens=16, kv_heads=8, head_dim=64, dtype="float16")
BLOCKS = 96


def round_keys(r: int) -> list[bytes]:
    return [hashlib.blake2b(f"{r}:{i}".encode(), digest_size=16).digest() for i in range(BLOCKS)]


def main() -> None:
    socket, backend, shm_dir = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "loop"
    if backend == "cuda":
        tensors = [torch.randn(t.shape, dtype=torch.float16, device="cuda") for t in LAYOUT.tensors]
    else:
        arena = SharedKVArena(LAYOUT, shm_dir)
        tensors = arena.tensors
        for t in tensors:
            t.copy_(torch.randn(t.shape, dtype=torch.float16))
    conn = KVConnector(socket, ring_dir=shm_dir, ring_slots=8)
    conn.register(LAYOUT, tensors)
    src = list(range(BLOCKS))
    dst = list(range(BLOCKS, 2 * BLOCKS))
    if mode == "stall":
        conn.offload(round_keys(0), src).wait()
        print("round 0", flush=True)
        assert conn.reg is not None
        req = transfer_pb2.TransferRequest(session_id=conn.session_id, registration_id=conn.reg.registration_id,
                                           keys=round_keys(1), engine_ids=src, event_slot=0, seq=1 << 40,
                                           wait_written=True)
        pending = conn._stub.Offload.future(req)  # no "KV written" mark for this seq: the daemon waits
        print("stalled", flush=True)
        pending.result(timeout=3600)  # (dropping the future would cancel the call)
    r = 0
    while True:
        conn.offload(round_keys(r), src).wait()
        conn.onboard(round_keys(r), dst).wait()
        print(f"round {r}", flush=True)
        r += 1


if __name__ == "__main__":
    main()

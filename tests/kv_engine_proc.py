"""A stand-alone engine process for tests/test_gpu_path.py (started with subprocess, never forked).

    python tests/kv_engine_proc.py SOCKET BACKEND SHM_DIR

Registers a vLLM-style KV cache (CPU shared memory for ``host``, CUDA for ``cuda``), then
loops forever: offload every block under the keys of round r, onboard them back. After each
round it prints ``round r`` and flushes, so the test knows which keys may exist and can kill
it while a transfer is in flight.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from kvtier.client.engine import KVConnector, SharedKVArena
from kvtier.tiers.layout import Layout

LAYOUT = Layout.vllm(num_layers=8, num_blocks=128, block_tokens=16, kv_heads=4, head_dim=64, dtype="float16")
BLOCKS = 64


def round_keys(r: int) -> list[bytes]:
    return [hashlib.blake2b(f"{r}:{i}".encode(), digest_size=16).digest() for i in range(BLOCKS)]


def main() -> None:
    socket, backend, shm_dir = sys.argv[1:4]
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
    r = 0
    while True:
        conn.offload(round_keys(r), src).wait()
        conn.onboard(round_keys(r), dst).wait()
        print(f"round {r}", flush=True)
        r += 1


if __name__ == "__main__":
    main()

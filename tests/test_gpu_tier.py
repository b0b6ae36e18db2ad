"""The gpu tier, owned by the daemon's DeviceTier and fed by engines' device reports, against a real
kvtierd over its socket: Lookup (RPC and key table) answers gpu for a block some worker on the
node holds, the lookup counters count it, Stats shows it per layout; a get never serves it from
gpu (the daemon serves host and disk); it goes when the last worker holding it drops it or its
sidecar's session ends."""

from __future__ import annotations

import glob
import os
import time

from kvtier.client import Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.keytable import TIER_BITS, KeyTableReader
from kvtier.tiers.layout import Layout

BLOCK = 4096
LAYOUT = Layout.flat(BLOCK)


def keys(n: int) -> list[bytes]:
    return [b"gpu-tier-" + i.to_bytes(4, "big") for i in range(n)]


def typed_stats(sock: str) -> node_pb2.StatsReply:
    with open_channel(f"unix:{sock}") as ch:
        return node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=10)


def hits(reply: node_pb2.StatsReply, op: int) -> dict[int, int]:
    """{tier: blocks} of one op (TIER_NONE: misses)."""
    return {h.tier: h.blocks for h in reply.hits if h.op == op}


def wait_for(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


def test_device_blocks_are_the_gpu_tier_of_lookup_the_key_table_and_the_counters(daemon) -> None:
    ks = keys(6)
    blocks = [bytes([i]) * BLOCK for i in range(4)]
    LOOKUP, ACQUIRE = node_pb2.COUNTED_OP_LOOKUP, node_pb2.COUNTED_OP_ACQUIRE
    GPU, HOST, NONE = node_pb2.TIER_GPU, node_pb2.TIER_HOST, node_pb2.TIER_NONE
    with Sidecar(daemon.socket, use_key_table=False) as rpc, Sidecar(daemon.socket) as other:
        rid, oid = rpc.register_layout(LAYOUT), other.register_layout(LAYOUT)
        engine = Sidecar(daemon.socket, client_name="engine-0")
        lid = engine.register_layout(LAYOUT)
        assert engine.put(lid, ks[:4], blocks).stored == 4                   # 0..3 in host
        engine.report_device_blocks(lid, stored=ks[2:6], worker_id="w0")     # 2..5 on w0's GPU
        want = ["host", "host", "gpu", "gpu", "gpu", "gpu"]

        # the Lookup RPC, counted by the fastest tier
        assert rpc.lookup(rid, ks) == want
        lookups = hits(typed_stats(daemon.socket), LOOKUP)
        assert (lookups[GPU], lookups[HOST], lookups[NONE]) == (4, 2, 0)
        # the key table: node-wide, gpu and host bits side by side
        assert engine.lookup(lid, ks) == want and other.lookup(oid, ks) == want
        table = KeyTableReader(glob.glob(os.path.join(daemon.shm_dir, "*.keys"))[0])
        g, h = TIER_BITS["gpu"], TIER_BITS["host"]
        assert table.masks(LAYOUT.fingerprint, ks).tolist() == [h, h, g | h, g | h, g, g]
        table.close()
        assert engine.prefix_length(lid, ks) == rpc.prefix_length(rid, ks) == (6, 6)
        stats = typed_stats(daemon.socket)
        assert [(x.host_blocks, x.gpu_blocks) for x in stats.layouts] == [(4, 4)]

        # a get is served from host only: gpu-only blocks are misses, never gpu hits
        got = rpc.get(rid, ks)
        assert [bytes(x) if x is not None else None for x in got] == [*blocks, None, None]
        acquires = hits(typed_stats(daemon.socket), ACQUIRE)
        assert (acquires[GPU], acquires[HOST], acquires[NONE]) == (0, 4, 2)

        # another worker holds 2 as well: w0 dropping it leaves it in gpu
        other.report_device_blocks(oid, stored=[ks[2]], worker_id="w1")
        engine.report_device_blocks(lid, removed=[ks[2], ks[3]], worker_id="w0")
        assert rpc.lookup(rid, ks[2:4]) == other.lookup(oid, ks[2:4]) == ["gpu", "host"]

        # w0's engine exits: its device blocks go at once (w1's stay); its table lookups were reported
        engine.close()
        wait_for(lambda: rpc.lookup(rid, ks) == ["host", "host", "gpu", "host", None, None], "w0's blocks to go")
        assert other.lookup(oid, ks) == ["host", "host", "gpu", "host", None, None]
        assert hits(typed_stats(daemon.socket), LOOKUP)[GPU] >= 4 + 4 * 2
        other.report_device_blocks(oid, clear=True, worker_id="w1")
        assert rpc.lookup(rid, ks[2:3]) == other.lookup(oid, ks[2:3]) == ["host"]
        assert [x.gpu_blocks for x in typed_stats(daemon.socket).layouts] == [0]

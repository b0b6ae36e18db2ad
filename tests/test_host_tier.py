"""The foundation against a real kvtierd over a real unix socket: round trips, LRU eviction and
the memory bound, session reclaim after a client is killed, and malformed input."""

from __future__ import annotations

import glob
import os
import socket
import stat
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest

from kvtier.client import InvalidArgument, KvtierError, Sidecar
from kvtier.client.engine.transport import open_channel
from kvtier.client.tools.local_daemon import DaemonProcess, rss_bytes, tmpfs_bytes
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.layout import Layout, layout_to_proto

MiB = 1 << 20
# Stated bound: the daemon's resident memory (Python, gRPC, indexes) beyond the pool.
DAEMON_OVERHEAD_BYTES = 200 * MiB


def rand_blocks(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def keys_for(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(8, "little") + bytes(7) for i in range(n)]


def test_64_random_2mib_blocks_round_trip_byte_exact(daemon: DaemonProcess) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(2 * MiB))
        keys, blocks = keys_for(64), rand_blocks(64, 2 * MiB, 1)
        res = sc.put(lid, keys, blocks)
        assert (res.stored, res.present, res.dropped) == (64, 0, [])
        assert sc.lookup(lid, keys) == ["host"] * 64
        got = sc.get(lid, keys)
        assert all(g is not None and bytes(g) == b for g, b in zip(got, blocks, strict=True))
        # into caller buffers
        out = [bytearray(2 * MiB) for _ in keys]
        sc.get(lid, keys, out=out)
        assert all(bytes(o) == b for o, b in zip(out, blocks, strict=True))
        # a second put of the same keys writes nothing
        assert sc.put(lid, keys, blocks).present == 64


def test_uncommitted_grants_are_invisible(daemon: DaemonProcess) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(64 * 1024))
        keys = keys_for(4)
        sid = sc._ensure_session()
        stub = node_pb2_grpc.NodeStub(sc._channel)
        reply = stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=sc._info(lid).daemon_id, keys=keys))
        assert all(g.status == node_pb2.GRANTED for g in reply.grants)
        assert sc.lookup(lid, keys) == [None] * 4
        assert sc.get(lid, keys) == [None] * 4
        stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=[g.grant_id for g in reply.grants[:2]],
                                           abort_grant_ids=[g.grant_id for g in reply.grants[2:]]))
        assert sc.lookup(lid, keys) == ["host", "host", None, None]


def test_lru_eviction_and_memory_bound(start_daemon) -> None:
    cap = 64 * MiB
    d = start_daemon(host_capacity=str(cap))
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(2 * MiB))
        nslots = cap // (2 * MiB)
        blocks = rand_blocks(8, 2 * MiB, 2)
        first = keys_for(nslots, b"a")
        for i in range(0, nslots, 8):
            assert sc.put(lid, first[i:i + 8], blocks).stored == 8
        # touch the oldest 4 so they become most recently used
        hot = first[:4]
        assert all(g is not None for g in sc.get(lid, hot))
        more = keys_for(8, b"b")
        assert sc.put(lid, more, blocks).stored == 8
        tiers = sc.lookup(lid, first)
        # the 8 least recently used (first[4:12]) were evicted; the touched ones stayed
        assert tiers[:4] == ["host"] * 4
        assert tiers[4:12] == [None] * 8
        assert tiers[12:] == ["host"] * (nslots - 12)
        assert sc.lookup(lid, more) == ["host"] * 8
        got = sc.get(lid, hot)
        assert [bytes(g) for g in got] == blocks[:4]
        # keep writing 4x the capacity: memory stays bounded
        for r in range(4 * nslots // 8):
            sc.put(lid, keys_for(8, b"c" + bytes([r])), blocks)
        pools = glob.glob(os.path.join(d.shm_dir, "*.pool"))
        assert tmpfs_bytes(pools) <= cap
        assert rss_bytes(d.pid) <= cap + DAEMON_OVERHEAD_BYTES, "daemon RSS beyond pool + stated overhead"
        st = sc.stats()
        assert st["tiers"]["host"]["used_bytes"] <= cap
        assert st["counters"]["evictions_host"] >= 8


def test_two_layouts_never_mix(daemon: DaemonProcess) -> None:
    with Sidecar(daemon.socket) as sc:
        a = sc.register_layout(Layout.flat(64 * 1024, name="a"))
        b = sc.register_layout(Layout.flat(128 * 1024, name="b"))
        c = sc.register_layout(Layout.flat(64 * 1024, name="c"))  # same size class as a
        k = keys_for(3)
        ba, bb, bc = rand_blocks(3, 64 * 1024, 3), rand_blocks(3, 128 * 1024, 4), rand_blocks(3, 64 * 1024, 5)
        sc.put(a, k, ba)
        assert sc.lookup(b, k) == [None] * 3 and sc.lookup(c, k) == [None] * 3
        sc.put(b, k, bb)
        sc.put(c, k, bc)
        assert [bytes(x) for x in sc.get(a, k)] == ba
        assert [bytes(x) for x in sc.get(b, k)] == bb
        assert [bytes(x) for x in sc.get(c, k)] == bc
        assert sc.evict(a, k) == 3
        assert sc.lookup(a, k) == [None] * 3 and sc.lookup(c, k) == ["host"] * 3


HOLDER = textwrap.dedent("""
    import sys, time
    from kvtier.client import Sidecar
    from kvtier.proto import node_pb2, node_pb2_grpc
    from kvtier.tiers.layout import Layout
    sc = Sidecar(sys.argv[1])
    lid = sc.register_layout(Layout.flat(2 << 20))
    sid = sc._ensure_session()
    stub = node_pb2_grpc.NodeStub(sc._channel)
    dlid = sc._info(lid).daemon_id
    held = [bytes([1]) * 16, bytes([2]) * 16]
    pinned = stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=dlid, keys=held))
    assert all(l.lease_id for l in pinned.leases)
    keys = [bytes([9, i]) * 8 for i in range(int(sys.argv[2]))]
    grants = stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=dlid, keys=keys))
    print(sum(g.status == node_pb2.GRANTED for g in grants.grants), flush=True)
    time.sleep(600)
""")


def test_killed_client_leaks_no_grants_or_pins(start_daemon) -> None:
    cap = 32 * MiB
    d = start_daemon("--session-quota", str(cap), host_capacity=str(cap))  # one session may hold the pool
    nslots = cap // (2 * MiB)
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(2 * MiB))
        held = [bytes([1]) * 16, bytes([2]) * 16]
        sc.put(lid, held, rand_blocks(2, 2 * MiB, 6))
        child = subprocess.Popen([sys.executable, "-c", HOLDER, d.socket, str(nslots - 2)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert int(child.stdout.readline()) == nslots - 2
            # the pool is full of grants and the two blocks are pinned: nothing fits
            assert sc.put(lid, keys_for(1, b"x"), rand_blocks(1, 2 * MiB, 7)).dropped == keys_for(1, b"x")
            assert sc.stats()["sessions"] == 2
        finally:
            child.kill()
            child.wait()
        import time
        deadline = time.monotonic() + 5.0  # the daemon promises 1 s; allow for a loaded machine
        while sc.stats()["sessions"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = sc.stats()
        assert st["sessions"] == 1
        assert st["counters"]["grants_reclaimed"] == nslots - 2
        assert st["counters"]["leases_reclaimed"] == 2
        # every slot is usable again, and the pins are gone: a full pool's worth of new blocks
        # evicts the two held blocks too
        fresh = keys_for(nslots, b"y")
        blocks = rand_blocks(nslots, 2 * MiB, 8)
        assert sc.put(lid, fresh, blocks).stored == nslots
        assert sc.lookup(lid, held) == [None, None]
        assert [bytes(g) for g in sc.get(lid, fresh)] == blocks


def _raw(daemon: DaemonProcess) -> tuple[grpc.Channel, node_pb2_grpc.NodeStub]:
    ch = open_channel(f"unix:{daemon.socket}")
    return ch, node_pb2_grpc.NodeStub(ch)


def test_malformed_input_gets_clear_errors_and_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    good = Sidecar(daemon.socket)
    glid = good.register_layout(Layout.flat(64 * 1024))
    good.put(glid, keys_for(2), rand_blocks(2, 64 * 1024, 9))
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(64 * 1024))
        with pytest.raises(InvalidArgument, match="65536 bytes"):
            sc.put(lid, keys_for(1), [b"short"])
        with pytest.raises(InvalidArgument, match="2 keys but 1 blocks"):
            sc.put(lid, keys_for(2), [bytes(64 * 1024)])
        with pytest.raises(KvtierError) as e:
            sc.put(lid, [b""], [bytes(64 * 1024)])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "8 to 32 bytes" in e.value.details
        with pytest.raises(KvtierError) as e:
            sc.lookup(lid, [b"x" * 33])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(KvtierError) as e:
            sc.put(lid, [b"d" * 16, b"d" * 16], [bytes(64 * 1024)] * 2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in e.value.details
        with pytest.raises(KvtierError) as e:
            sc.put(lid, keys_for(1, b"z"), [bytes(64 * 1024)], durable=True)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--disk-dir" in e.value.details

    ch, stub = _raw(daemon)
    with ch:
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(node_pb2.LookupRequest(layout_id=99, keys=[b"k" * 16]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "RegisterLayout" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=node_pb2.LayoutSpec(
                block_tokens=16, tensors=[node_pb2.TensorSpec(name="a", dtype="float16", shape=[4, 4], block_dim=5)])))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_dim" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Allocate(node_pb2.AllocateRequest(session_id=12345, layout_id=1, keys=[b"k" * 16]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "session" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Commit(node_pb2.CommitRequest(session_id=good._ensure_session(), grant_ids=[424242]))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # another caller's session
        with pytest.raises(grpc.RpcError) as e:
            good._stub.Commit(node_pb2.CommitRequest(session_id=good._ensure_session(), grant_ids=[424242]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # garbage bytes straight onto the socket
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.sendall(payload)
        s.close()
    # the first client's blocks and session are intact, and the daemon serves
    assert good.lookup(glid, keys_for(2)) == ["host", "host"]
    assert good.get(glid, keys_for(2))[0] is not None
    assert daemon.proc.poll() is None
    good.close()


def test_socket_is_owner_only_and_shutdown_is_clean(start_daemon) -> None:
    d = start_daemon()
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    with Sidecar(d.socket) as sc:
        sc.register_layout(Layout.flat(64 * 1024))
        pools = glob.glob(os.path.join(d.shm_dir, "*.pool"))
        assert pools and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in pools)
    assert d.stop() == 0
    assert not glob.glob(os.path.join(d.shm_dir, "*.pool")) and not os.path.exists(d.socket)
    assert '"shutting down"' in d.logs()


def test_taken_tcp_port_refuses_to_start(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = DaemonProcess(str(tmp_path), "--tcp", f"127.0.0.1:{port}", "--insecure-tcp")
        try:
            with pytest.raises(RuntimeError, match="already in use"):
                d.start(timeout=20)
        finally:
            d.cleanup()


def test_tcp_listener_serves(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProcess(str(tmp_path), "--tcp", f"127.0.0.1:{port}", "--insecure-tcp",
                      "--tcp-services", "all").start()
    try:
        with Sidecar(target=f"127.0.0.1:{port}") as sc:
            assert sc.stats()["tiers"]["host"]["capacity_bytes"] == 256 * MiB
    finally:
        d.cleanup()


def test_sidecar_survives_a_daemon_restart(start_daemon, tmp_path) -> None:
    d = start_daemon()
    sc = Sidecar(d.socket)
    lid = sc.register_layout(Layout.flat(64 * 1024))
    sc.put(lid, keys_for(2), rand_blocks(2, 64 * 1024, 10))
    epoch = sc.epoch
    d.stop()
    d.start()
    # the host tier is memory: the blocks are gone, but the layout id and session come back
    assert sc.lookup(lid, keys_for(2)) == [None, None]
    blocks = rand_blocks(2, 64 * 1024, 11)
    assert sc.put(lid, keys_for(2), blocks).stored == 2
    assert sc.epoch != epoch
    assert [bytes(g) for g in sc.get(lid, keys_for(2))] == blocks
    sc.close()


def test_async_sidecar_round_trip(daemon: DaemonProcess) -> None:
    import asyncio

    from kvtier.client import AsyncSidecar

    async def go() -> None:
        async with AsyncSidecar(daemon.socket) as sc:
            lid = await sc.register_layout(Layout.flat(128 * 1024))
            keys, blocks = keys_for(8), rand_blocks(8, 128 * 1024, 12)
            assert (await sc.put(lid, keys, blocks)).stored == 8
            assert await sc.lookup(lid, keys + [b"m" * 16]) == ["host"] * 8 + [None]
            got = await sc.get(lid, keys + [b"m" * 16])
            assert [bytes(g) for g in got[:8]] == blocks and got[8] is None
            assert await sc.evict(lid, keys[:3]) == 3
            assert (await sc.stats())["tiers"]["host"]["blocks"] == 5
            with pytest.raises(InvalidArgument):
                await sc.put(lid, keys[:1], [b"x"])

    asyncio.run(go())


def test_concurrent_clients_share_blocks(daemon: DaemonProcess) -> None:
    """Several threads put through one sidecar; another client reads their blocks byte-exact."""
    from concurrent.futures import ThreadPoolExecutor

    with Sidecar(daemon.socket) as a, Sidecar(daemon.socket) as b:
        la, lb = a.register_layout(Layout.flat(1 * MiB)), b.register_layout(Layout.flat(1 * MiB))
        blocks = rand_blocks(16, MiB, 13)

        def writer(i: int) -> int:
            return b.put(lb, keys_for(16, bytes([i])), blocks).stored

        with ThreadPoolExecutor(4) as ex:
            assert sum(ex.map(writer, range(8))) == 128
        # what b wrote, a sees (same layout fingerprint), byte-exact
        assert [bytes(g) for g in a.get(la, keys_for(16, bytes([7])))] == blocks


def test_put_takes_cpu_torch_tensors(daemon: DaemonProcess) -> None:
    torch = pytest.importorskip("torch")
    layout = Layout.vllm(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16")
    kv = torch.randn(4, 2, 2, 16, 2, 64).to(torch.bfloat16)  # 4 blocks, each [layers, K/V, tokens, heads, dim]
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(layout)
        keys = keys_for(4)
        assert sc.put(lid, keys, list(kv)).stored == 4
        got = sc.get(lid, keys)
        back = torch.stack([torch.frombuffer(bytearray(g), dtype=torch.bfloat16).view(2, 2, 16, 2, 64) for g in got])
        assert torch.equal(back, kv)
        with pytest.raises(InvalidArgument, match="bytes"):
            sc.put(lid, keys_for(1, b"t"), [kv[0, 0]])  # half a block


def test_a_layout_id_kept_across_a_restart_never_reaches_another_layout(start_daemon) -> None:
    """Tensor-parallel ranks share keys; a stale layout id must not serve the other rank's bytes."""
    rank0 = Layout.vllm(2, 8, 16, 2, 64, tp_rank=0, tp_size=2)
    rank1 = Layout.vllm(2, 8, 16, 2, 64, tp_rank=1, tp_size=2)
    d = start_daemon()
    ch, stub = _raw(d)
    with ch:
        id0 = stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=layout_to_proto(rank0, node_pb2.LayoutSpec))).layout_id
        d.stop()
        d.start()
        with Sidecar(d.socket) as other:  # after the restart, rank 1 registers first
            lid1 = other.register_layout(rank1)
            other.put(lid1, keys_for(1), rand_blocks(1, rank1.block_bytes, 14))
            assert other._info(lid1).daemon_id != id0
        ch.close()  # its token died with the daemon that issued it: the client keeps only the id
        ch, stub = _raw(d)
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(node_pb2.LookupRequest(layout_id=id0, keys=keys_for(1)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        again = stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=layout_to_proto(rank0, node_pb2.LayoutSpec)))
        assert again.layout_id == id0
        assert list(stub.Lookup(node_pb2.LookupRequest(layout_id=id0, keys=keys_for(1))).tiers) == [node_pb2.TIER_NONE]

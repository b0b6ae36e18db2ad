"""Disk tier: the DiskTier on real files, and a real kvtierd with --disk-dir over a real socket.

Acceptance: blocks beyond host capacity land on disk and come back byte-exact; a
kill -9 in the middle of a burst of durable puts loses no acknowledged block and serves
nothing corrupt after a warm restart; a flipped byte in a slab file is a miss that
``checksum_failures`` counts; a disk smaller than the burst, or a filesystem that fills
(ENOSPC), never crashes the daemon and host keeps serving.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from _demotions import demotions_over

from kvtier.client.engine.sidecar import KvtierError, Sidecar
from kvtier.daemon.counters import Count
from kvtier.tiers.disk import DiskTier, DiskTierError, ReadOutcome
from kvtier.tiers.layout import Layout
from kvtier.tiers.policy import TierPolicy
from kvtier.tiers.vocab import Tier

BLOCK = 256 * 1024
MiB = 1024 * 1024


def key(i: int) -> bytes:
    return b"disktest" + i.to_bytes(8, "big")


def payload(k: bytes, n: int = BLOCK) -> bytes:
    """Deterministic bytes of a key, so any process can check what a key must hold."""
    return np.random.default_rng(int.from_bytes(k, "big")).bytes(n)


def aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)


# -- DiskTier on real files (no daemon) -------------------------------------------------------


def _open(directory: str, **kw) -> DiskTier:
    """A DiskTier with the placement policy the store pairs it with (disk bounded by the tier
    in bytes), seeded as the store seeds it: restored blocks, oldest write first."""
    tier = DiskTier(directory, **kw)
    tier.policy = TierPolicy(0, 0, None)
    tier.policy.on_write(list(tier.entries))
    return tier


def _write(tier: DiskTier, bkeys: list[bytes], slot_bytes: int = BLOCK) -> list:
    """A disk write as the store runs it: victims in the policy's order, reported to it."""
    plan = tier.plan_write([(b, slot_bytes, slot_bytes) for b in bkeys], tier.policy.victims(Tier.DISK))
    tier.policy.on_evict(Tier.DISK, [v.bkey for v in plan.victims])
    bufs = []
    for b in bkeys:
        m = aligned(slot_bytes)
        m[:] = payload(b, slot_bytes)
        bufs.append(m)
    srcs = [memoryview(m) for m, e in zip(bufs, plan.entries, strict=True) if e is not None]
    err = None
    try:
        tier.submit_write(plan, srcs).result()
    except OSError as e:
        err = e
    visible = tier.finish_write(plan, err)
    tier.policy.on_write(e.bkey for e in visible)
    for v in srcs:
        v.release()
    return visible if err is None else [err]


def _read(tier: DiskTier, bkey: bytes) -> tuple[ReadOutcome, bytes]:
    e = tier.get(bkey)
    assert e is not None
    m = aligned(e.slab.slot_bytes)
    v = memoryview(m)
    tier.pin(e)
    status = tier.submit_read([e], [v])[0].result()
    tier.unpin(e)
    data = bytes(v[:e.length])
    v.release()
    return status, data


def test_tier_roundtrip_reopen_and_lru(tmp_path):
    d = str(tmp_path / "disk")
    bkeys = [bytes(16) + key(i) for i in range(6)]
    tier = _open(d, capacity=4 * BLOCK, queue_depth=4)
    assert len(_write(tier, bkeys[:4])) == 4
    tier.policy.on_promote([bkeys[0]])         # a hit: 0 becomes most recent; 1 is the LRU one
    plan_victims = _write(tier, bkeys[4:5])
    assert len(plan_victims) == 1
    assert tier.get(bkeys[1]) is None and tier.get(bkeys[0]) is not None
    assert _read(tier, bkeys[4]) == (ReadOutcome.OK, payload(bkeys[4]))
    tier.close()

    again = _open(d, capacity=4 * BLOCK, queue_depth=4)
    assert again.restored == 4
    assert list(again.entries) == [bkeys[0], bkeys[2], bkeys[3], bkeys[4]]   # in write order
    for b in again.entries:
        assert _read(again, b) == (ReadOutcome.OK, payload(b))
    # after a restart the LRU order is the write order: 0 (written first) goes next
    _write(again, bkeys[5:6])
    assert again.get(bkeys[0]) is None and again.get(bkeys[5]) is not None
    again.close()


def test_tier_reopen_drops_stale_index_entries(tmp_path):
    """An index entry naming a slot a newer entry holds, or a slot past the slab file, is dropped
    on open, and the newer entry is served."""
    import lmdb

    from kvtier.tiers.disk import _VALUE

    d = str(tmp_path / "disk")
    tier = _open(d, capacity=4 * BLOCK)
    new = bytes(16) + key(1)
    _write(tier, [new])
    e = tier.get(new)
    tier.close()
    env = lmdb.open(os.path.join(d, "index"), max_dbs=2)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        txn.put(bytes(16) + key(2), _VALUE.pack(BLOCK, e.slot, BLOCK, 12345, 0))        # older, same slot
        txn.put(bytes(16) + key(3), _VALUE.pack(BLOCK, 10**6, BLOCK, 12345, e.seq + 1))  # past the file
    env.close()
    again = _open(d, capacity=4 * BLOCK)
    assert (again.restored, again.dropped_on_open) == (1, 2)
    assert _read(again, new) == (ReadOutcome.OK, payload(new))
    again.close()
    third = DiskTier(d, capacity=4 * BLOCK)
    assert third.dropped_on_open == 0 and third.restored == 1   # the drops were committed
    third.close()


def test_tier_pinned_entries_are_not_evicted_and_dir_is_locked(tmp_path):
    d = str(tmp_path / "disk")
    tier = _open(d, capacity=2 * BLOCK)
    with pytest.raises(DiskTierError, match="in use by another kvtierd"):
        DiskTier(d, capacity=2 * BLOCK)
    a, b, c = (bytes(16) + key(i) for i in range(3))
    _write(tier, [a, b])
    tier.pin(tier.get(a))
    tier.pin(tier.get(b))
    plan = tier.plan_write([(c, BLOCK, BLOCK)], tier.policy.victims(Tier.DISK))
    assert plan.entries == [None] and plan.victims == []
    tier.finish_write(plan, None)
    tier.unpin(tier.get(a))
    assert len(_write(tier, [c])) == 1
    assert tier.get(a) is None and tier.get(b) is not None
    with pytest.raises(RuntimeError):
        tier.unpin(tier.get(c))
    tier.close()


def test_tier_detects_corruption(tmp_path):
    d = str(tmp_path / "disk")
    tier = _open(d, capacity=4 * BLOCK)
    b = bytes(16) + key(7)
    _write(tier, [b])
    e = tier.get(b)
    with open(e.slab.path, "r+b") as fh:
        fh.seek(e.offset + 1234)
        byte = fh.read(1)
        fh.seek(e.offset + 1234)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert _read(tier, b)[0] is ReadOutcome.CHECKSUM
    tier.close()


# -- a real daemon ------------------------------------------------------------------------


def _disk_args(disk_dir: str, capacity: str = "64MiB", *extra: str) -> list[str]:
    return ["--disk-dir", disk_dir, "--disk-capacity", capacity, *extra]


def test_blocks_beyond_host_capacity_land_on_disk_and_come_back(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    # (no write-ahead: a block pinned while written ahead is passed over by the next eviction,
    # which then takes a more recent one, so the exact LRU sets below would depend on timing;
    # the write-ahead has its own tests in test_demotion_background.py)
    d = start_daemon(*_disk_args(disk_dir, "64MiB", "--demote-ahead-bytes", "0"), host_capacity="2MiB")
    keys = [key(i) for i in range(32)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        for i in range(0, 32, 4):
            batch = keys[i:i + 4]
            assert sc.put(lid, batch, [payload(k) for k in batch]).stored == 4
            assert all(g is not None for g in sc.get(lid, batch))   # seen twice: worth demoting
        demotions_over(sc)  # (victims are written in the background: a get meanwhile would miss)
        assert sc.lookup(lid, keys) == ["disk"] * 24 + ["host"] * 8
        got = sc.get(lid, keys[:8])                                # promoted back through host
        assert [bytes(g) for g in got] == [payload(k) for k in keys[:8]]
        # promotion evicted the last 8 from host (demoted); promoted blocks keep their disk copy
        demotions_over(sc)
        assert sc.lookup(lid, keys) == ["host"] * 8 + ["disk"] * 24
        st = sc.stats()
        c = st["counters"]
        assert c["demotions"] == 32 and c["promotions"] == 8
        assert c["acquire_hit_blocks:disk"] == 8 and c["bytes_disk_to_host"] == 8 * BLOCK
        assert c["bytes_host_to_disk"] == 32 * BLOCK
        assert st["tiers"]["disk"]["blocks"] == 32 and st["tiers"]["disk"]["used_bytes"] == 32 * BLOCK
        assert st["layouts"][0]["disk_blocks"] == 32 and st["layouts"][0]["host_blocks"] == 8
        # prefetch warms host from disk; the rest of the calls see host
        cold = [k for k, t in zip(keys, sc.lookup(lid, keys), strict=True) if t == "disk"][:4]
        assert sc.prefetch(lid, cold) == 4
        assert sc.lookup(lid, cold) == ["host"] * 4
        assert [bytes(g) for g in sc.get(lid, cold)] == [payload(k) for k in cold]
        # an explicit evict removes a block from every tier
        assert sc.evict(lid, cold[:1]) >= 1
        assert sc.lookup(lid, cold[:1]) == [None] and sc.get(lid, cold[:1]) == [None]


def test_cold_blocks_are_not_demoted_below_threshold(start_daemon, tmp_path):
    # --demote-queue-bytes 0: the seen-often filter always (else every victim goes while the
    # disk's write queue has room: test_cold_blocks_are_demoted_while_the_write_queue_has_room)
    d = start_daemon(*_disk_args(str(tmp_path / "disk"), "64MiB", "--demote-queue-bytes", "0"), host_capacity="1MiB")
    keys = [key(100 + i) for i in range(8)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys[:4], [payload(k) for k in keys[:4]])     # seen once: cold
        sc.put(lid, keys[4:], [payload(k) for k in keys[4:]])
        assert sc.lookup(lid, keys) == [None] * 4 + ["host"] * 4
        c = sc.stats()["counters"]
        assert c["demotions_skipped_cold"] == 4 and c.get("demotions", 0) == 0


def test_cold_blocks_are_demoted_while_the_write_queue_has_room(start_daemon, tmp_path):
    """Disk admission: with the default --demote-queue-bytes every host victim goes to
    disk (the next turn of a conversation needs the blocks its latest turn put once)."""
    d = start_daemon(*_disk_args(str(tmp_path / "disk")), host_capacity="1MiB")  # 4 blocks
    keys = [key(200 + i) for i in range(8)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys[:4], [payload(k) for k in keys[:4]])     # seen once
        sc.put(lid, keys[4:], [payload(k) for k in keys[4:]])
        c = demotions_over(sc)  # (written in the background: the put did not wait for them)
        assert sc.lookup(lid, keys) == ["disk"] * 4 + ["host"] * 4
        assert c["demotions"] == 4 and c.get("demotions_skipped_cold", 0) == 0
        assert c["demotions_staged"] == 4
        assert [bytes(g) for g in sc.get(lid, keys[:2])] == [payload(k) for k in keys[:2]]


_BURST_CLIENT = textwrap.dedent("""
    import sys
    import numpy as np
    from kvtier.client.engine.sidecar import Sidecar
    from kvtier.tiers.layout import Layout
    sock, block = sys.argv[1], int(sys.argv[2])
    sc = Sidecar(sock, timeout=10)
    lid = sc.register_layout(Layout.flat(block))
    for i in range(0, 100000, 2):
        keys = [b"disktest" + j.to_bytes(8, "big") for j in (i, i + 1)]
        blocks = [np.random.default_rng(int.from_bytes(k, "big")).bytes(block) for k in keys]
        r = sc.put(lid, keys, blocks, durable=True)
        assert r.stored == r.durable == 2, r
        print(" ".join(k.hex() for k in keys), flush=True)
""")


def test_kill9_during_durable_burst_then_warm_restart(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    d = start_daemon(*_disk_args(disk_dir, "256MiB"), host_capacity="4MiB")
    client = subprocess.Popen([sys.executable, "-c", _BURST_CLIENT, d.socket, str(BLOCK)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    acked: list[bytes] = []
    try:
        assert client.stdout is not None
        while len(acked) < 40:
            line = client.stdout.readline()
            assert line, "the burst client stopped before the kill"
            acked += [bytes.fromhex(h) for h in line.split()]
        os.kill(d.pid, signal.SIGKILL)            # mid-burst: the client has a put in flight
        d.proc.wait()
        time.sleep(0.3)
    finally:
        client.kill()
        out, _ = client.communicate()
    acked += [bytes.fromhex(h) for line in out.splitlines() for h in line.split()]
    attempted = [key(i) for i in range(len(acked) + 16)]

    d2 = start_daemon(*_disk_args(disk_dir, "256MiB"), host_capacity="4MiB", name="restarted")
    assert "blocks_restored" in d2.logs()
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert set(sc.lookup(lid, acked)) == {"disk"}
        for i in range(0, len(attempted), 8):
            batch = attempted[i:i + 8]
            for k, got in zip(batch, sc.get(lid, batch), strict=True):
                if k in acked:
                    assert got is not None, f"acknowledged durable block {k.hex()} lost"
                if got is not None:
                    assert bytes(got) == payload(k), f"block {k.hex()} served with wrong bytes"
        assert sc.stats()["counters"].get("checksum_failures", 0) == 0


def test_flipped_byte_on_disk_is_a_counted_miss(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    keys = [key(200 + i) for i in range(8)]
    d = start_daemon(*_disk_args(disk_dir), host_capacity="8MiB")
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys, [payload(k) for k in keys], durable=True)
    assert d.stop() == 0                      # SIGTERM: the disk tier closes cleanly
    slab = os.path.join(disk_dir, f"slab-{BLOCK}.dat")
    with open(slab, "r+b") as fh:             # slot 3, somewhere inside the payload
        fh.seek(3 * BLOCK + 4321)
        b = fh.read(1)
        fh.seek(3 * BLOCK + 4321)
        fh.write(bytes([b[0] ^ 0x01]))
    d2 = start_daemon(*_disk_args(disk_dir), host_capacity="8MiB", name="restarted")
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.lookup(lid, keys) == ["disk"] * 8
        got = sc.get(lid, keys)
        misses = [k for k, g in zip(keys, got, strict=True) if g is None]
        assert len(misses) == 1
        for k, g in zip(keys, got, strict=True):
            if g is not None:
                assert bytes(g) == payload(k)
        st = sc.stats()
        assert st["counters"]["checksum_failures"] == 1
        assert sc.lookup(lid, misses) == [None]
        assert st["tiers"]["disk"]["blocks"] == 7
        # the dropped entry is gone from the index too: it stays gone after another restart
    d2.stop()
    d3 = start_daemon(*_disk_args(disk_dir), host_capacity="8MiB", name="third")
    with Sidecar(d3.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.lookup(lid, misses) == [None]
        assert sc.lookup(lid, [k for k in keys if k not in misses]) == ["disk"] * 7


def test_disk_smaller_than_burst_evicts_lru_and_keeps_serving(start_daemon, tmp_path):
    d = start_daemon(*_disk_args(str(tmp_path / "disk"), "2MiB", "--demote-min-seen", "1"),
                     host_capacity="1MiB")
    keys = [key(300 + i) for i in range(40)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        for i in range(0, 40, 4):
            r = sc.put(lid, keys[i:i + 4], [payload(k) for k in keys[i:i + 4]], durable=True)
            assert r.stored == r.durable == 4
        st = sc.stats()
        assert st["tiers"]["disk"]["blocks"] == 8 and st["tiers"]["disk"]["used_bytes"] <= 2 * MiB
        assert st["counters"]["evictions_disk"] >= 24
        where = sc.lookup(lid, keys)
        # disk keeps the 8 latest durable blocks; the 4 latest are also in host, the fastest tier
        assert where == [None] * 32 + ["disk"] * 4 + ["host"] * 4
        got = sc.get(lid, keys[-8:-4]) + sc.get(lid, keys[-4:])
        assert [bytes(g) for g in got] == [payload(k) for k in keys[-8:]]
        # a request larger than host: its host hits stay pinned, the rest finds no host slot
        got = sc.get(lid, keys[-8:])
        assert sum(g is not None for g in got) == 4
        assert all(bytes(g) == payload(k) for k, g in zip(keys[-8:], got, strict=True) if g is not None)
    assert d.proc.poll() is None


@contextlib.contextmanager
def _small_tmpfs(path: str, size: str):
    os.makedirs(path)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:  # reported, never a silent skip: as root this must work
        why = f"cannot mount a small tmpfs at {path} ({r.stderr.strip() or r.returncode}); the full-disk path needs one"
        if os.geteuid() == 0:
            pytest.fail(f"{why}: running as root, mount must work (a container without CAP_SYS_ADMIN?)")
        pytest.xfail(f"{why}: not root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def test_full_filesystem_degrades_to_host_only(start_daemon, tmp_path):
    with _small_tmpfs(str(tmp_path / "small"), "3m") as small:
        # a small tmpfs is the filesystem that fills: allowed for this test (refused by default)
        d = start_daemon(*_disk_args(small, "64MiB", "--demote-min-seen", "1", "--disk-allow-tmpfs"),
                         host_capacity="2MiB")
        keys = [key(400 + i) for i in range(40)]
        with Sidecar(d.socket) as sc:
            lid = sc.register_layout(Layout.flat(BLOCK))
            durable = []
            for i in range(0, 40, 4):
                batch = keys[i:i + 4]
                r = sc.put(lid, batch, [payload(k) for k in batch], durable=True)
                assert r.stored == 4
                durable.append(r.durable)
            assert durable[0] == 4 and durable[-1] == 0   # the reply says which puts reached disk
            c = sc.stats()["counters"]
            assert c["disk_degraded"] == 1
            assert d.logs().count("disk tier degraded to host-only") == 1
            # host keeps serving, and what reached disk before it filled is still served
            where = sc.lookup(lid, keys)
            assert where[-8:] == ["host"] * 8
            on_disk = [k for k, t in zip(keys, where, strict=True) if t == "disk"]
            assert on_disk, "some blocks fit before the filesystem filled"
            assert [bytes(g) for g in sc.get(lid, keys[-8:])] == [payload(k) for k in keys[-8:]]
            assert [bytes(g) for g in sc.get(lid, on_disk[:2])] == [payload(k) for k in on_disk[:2]]
        assert d.proc.poll() is None
        d.stop()


def test_durable_without_disk_is_refused(daemon):
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        with pytest.raises(KvtierError) as ei:
            sc.put(lid, [key(1)], [payload(key(1))], durable=True)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--disk-dir" in ei.value.details


def test_disk_dir_in_use_fails_to_start(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    start_daemon(*_disk_args(disk_dir))
    with pytest.raises(RuntimeError, match="in use by another kvtierd"):
        start_daemon(*_disk_args(disk_dir), name="second")


def test_write_through_makes_every_put_durable(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    keys = [key(500 + i) for i in range(4)]
    d = start_daemon(*_disk_args(disk_dir, "16MiB", "--disk-write-through"))
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        r = sc.put(lid, keys, [payload(k) for k in keys])
        assert r.stored == r.durable == 4
    d.kill()
    d2 = start_daemon(*_disk_args(disk_dir, "16MiB"), name="restarted")
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert [bytes(g) for g in sc.get(lid, keys)] == [payload(k) for k in keys]


class _Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []

    def stored(self, tier: Tier, fingerprint: bytes, keys, worker: str = "") -> None:
        self.log.append(("stored", tier.label, len(keys)))

    def removed(self, tier: Tier, fingerprint: bytes, keys, worker: str = "") -> None:
        self.log.append(("removed", tier.label, len(keys)))

    def cleared(self, tier: Tier, worker: str = "", gone=None) -> None:
        self.log.append(("cleared", tier.label, 0))

    def workers_changed(self) -> None:
        pass


def test_store_reports_every_disk_visibility_change(tmp_path):
    """In-process BlockStore on a real HostTier (tmpfs) and DiskTier: demotion, promotion,
    disk LRU eviction and a checksum drop each reach the location observers."""
    import asyncio

    from kvtier.client.tools.local_daemon import shm_tempdir
    from kvtier.daemon.store import BlockStore
    from kvtier.tiers.host import HostTier

    layout = Layout.flat(BLOCK)
    fp = layout.fingerprint

    async def put(store: BlockStore, sid: int, lid: int, keys: list[bytes]) -> None:
        grants = await store.allocate(sid, lid, keys)
        cls = store.host.size_class(layout.slot_bytes)
        with open(cls.path, "r+b") as fh:
            for k, g in zip(keys, grants, strict=True):
                fh.seek(g.offset)
                fh.write(payload(k))
        await store.commit(sid, [g.grant_id for g in grants], [], durable=False)

    async def main() -> None:
        disk = DiskTier(str(tmp_path / "disk"), capacity=4 * BLOCK)
        store = BlockStore(HostTier(shm, 2 * BLOCK, "obs"), disk=disk, demote_min_seen=1)
        ev = _Events()
        store.observers.add(ev)
        lid = (await store.register_layout(layout)).layout_id
        sid = store.open_session("test", os.getpid()).session_id
        try:
            await put(store, sid, lid, [key(1), key(2)])
            ev.log.clear()
            await put(store, sid, lid, [key(3), key(4)])       # 1, 2 demoted
            assert ev.log == [("removed", "host", 2), ("stored", "disk", 2), ("stored", "host", 2)]
            ev.log.clear()
            await put(store, sid, lid, [key(5), key(6)])       # 3, 4 demoted
            await put(store, sid, lid, [key(7)])                # 5 demoted: disk full, 1 evicted
            assert ("removed", "disk", 1) in ev.log and store.lookup(lid, [key(1)]) == [None]
            ev.log.clear()
            e = disk.get(fp + key(2))
            with open(e.slab.path, "r+b") as fh:               # corrupt 2 on disk
                fh.seek(e.offset + 10)
                fh.write(b"\x00" if payload(key(2))[10] else b"\x01")
            out = await store.acquire(sid, lid, [key(2), key(3)])
            assert not out[0].hit and out[1].found_in is Tier.DISK
            assert ("removed", "disk", 1) in ev.log and ("stored", "host", 1) in ev.log
            assert store.counters[Count.CHECKSUM_FAILURES] == 1
            assert store.lookup(lid, [key(2)]) == [None]
        finally:
            store.close()

    with shm_tempdir() as shm:
        asyncio.run(main())


def test_durable_put_of_blocks_already_in_host_writes_them_to_disk(start_daemon, tmp_path):
    disk_dir = str(tmp_path / "disk")
    keys = [key(500 + i) for i in range(6)]
    d = start_daemon(*_disk_args(disk_dir), host_capacity="8MiB")
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        r = sc.put(lid, keys[:4], [payload(k) for k in keys[:4]])          # memory only
        assert (r.stored, r.durable) == (4, 0)
        r = sc.put(lid, keys, [payload(k) for k in keys], durable=True)    # 4 present + 2 new
        assert (r.stored, r.present, r.durable) == (2, 4, 6)
    d.kill()                                                                # no clean shutdown
    d2 = start_daemon(*_disk_args(disk_dir), host_capacity="8MiB", name="after-kill")
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert [bytes(g) for g in sc.get(lid, keys)] == [payload(k) for k in keys]


# -- failures the kill -9 test cannot see, and recovery ---------------------------------------

SMALL = 64 * 1024


def _failing_sync(calls: list[int]):
    def fdatasync(fd: int) -> None:
        calls.append(fd)
        raise OSError(5, "Input/output error (injected)")
    return fdatasync


def test_a_failed_fdatasync_leaves_the_batch_invisible_and_unrestored(tmp_path):
    """The data barrier of a write batch fails (EIO, injected at the tier's fdatasync): no
    entry of the batch becomes visible, the tier degrades, and none is restored after reopening
    (so the index entry was not committed before the barrier)."""
    d = str(tmp_path / "disk")
    bkeys = [bytes(16) + key(900 + i) for i in range(3)]
    tier = _open(d, capacity=8 * SMALL)
    calls: list[int] = []
    tier._fdatasync = _failing_sync(calls)
    out = _write(tier, bkeys, SMALL)
    assert calls, "the write batch never called fdatasync: nothing makes its bytes durable before the index"
    assert len(out) == 1 and isinstance(out[0], OSError)
    assert all(tier.get(b) is None for b in bkeys) and tier.degraded
    tier.close()
    again = _open(d, capacity=8 * SMALL)
    assert again.restored == 0 and all(again.get(b) is None for b in bkeys), \
        "an entry whose fdatasync failed was committed to the index"
    again.close()


def test_restored_blocks_count_only_their_own_slots(tmp_path):
    """A slab file grows in large preallocated chunks: after a reopen only the slots that hold
    restored blocks count against the capacity (and hold space); another class fits beside them."""
    d = str(tmp_path / "disk")
    a = [bytes(16) + key(910 + i) for i in range(2)]
    tier = _open(d, capacity=8 * SMALL)
    assert len(_write(tier, a, SMALL)) == 2
    assert tier.allocated_bytes == 8 * SMALL   # the first grow took the whole capacity
    tier.close()
    again = _open(d, capacity=8 * SMALL)
    assert again.restored == 2
    assert again.allocated_bytes == again.used_bytes == 2 * SMALL
    assert os.stat(os.path.join(d, f"slab-{SMALL}.dat")).st_blocks * 512 <= 2 * SMALL + 4096
    b = [bytes(16) + key(920 + i) for i in range(3)]
    got = _write(again, b, 2 * SMALL)           # 3 x 128 KiB fit in the 384 KiB left: no victim
    assert len(got) == 3 and all(again.get(k) is not None for k in a)
    assert all(_read(again, k) == (ReadOutcome.OK, payload(k, SMALL)) for k in a)
    again.close()


def test_a_degraded_tier_retries_after_recheck(tmp_path):
    """A write failure other than a full filesystem (EIO) degrades the tier; the next check
    (``recheck_s``; 0 here) lets it try again, and a good write makes it serve writes again."""
    d = str(tmp_path / "disk")
    tier = _open(d, capacity=8 * SMALL, recheck_s=3600)
    tier._fdatasync = _failing_sync([])
    _write(tier, [bytes(16) + key(930)], SMALL)
    assert tier.degraded and "failed" in tier.degraded
    assert tier.plan_write([(bytes(16) + key(931), SMALL, SMALL)]).entries == [None]  # refused while degraded
    tier._fdatasync = os.fdatasync
    tier.recheck_s, tier._recheck_at = 0.0, 0.0   # the recheck is due
    k = bytes(16) + key(932)
    assert _write(tier, [k], SMALL)[0].bkey == k
    assert tier.recoveries == 1 and not tier.degraded
    tier.close()


def test_a_full_filesystem_recovers_when_space_returns(tmp_path):
    """The filesystem fills (another file takes the space): the tier degrades and stays so while
    it is full; once the space is back the next write goes to disk again."""
    with _small_tmpfs(str(tmp_path / "small"), "4m") as small:
        balloon = os.path.join(small, "balloon")
        with open(balloon, "wb") as fh:
            fh.write(b"\0" * (4 * MiB - 96 * 1024))
        tier = _open(os.path.join(small, "disk"), capacity=16 * SMALL, recheck_s=0)
        out = _write(tier, [bytes(16) + key(940 + i) for i in range(4)], SMALL)
        assert isinstance(out[0], OSError) and "full" in tier.degraded
        assert tier.plan_write([(bytes(16) + key(945), SMALL, SMALL)]).entries == [None]  # still full
        assert tier.recoveries == 0
        os.unlink(balloon)
        k = bytes(16) + key(946)
        got = _write(tier, [k], SMALL)
        assert tier.recoveries == 1 and got[0].bkey == k
        assert _read(tier, k) == (ReadOutcome.OK, payload(k, SMALL))
        tier.close()


def test_a_plan_that_evicted_but_wrote_nothing_still_deletes_its_victims_index_entries(tmp_path) -> None:
    """A write of a larger class evicts a block of a smaller one, then finds nothing more to
    free (the other is pinned): it writes nothing, so the daemon never submits it. Its
    victim's index delete was only in the plan and was lost: the evicted block came back
    after a restart (and its slot, handed out again, was still named by the stale entry)."""
    d = str(tmp_path / "disk")
    tier = _open(d, capacity=2 * BLOCK)
    a1, a2, big = (bytes(16) + key(i) for i in range(1, 4))
    _write(tier, [a1, a2])
    tier.pin(tier.get(a2))                                           # being read
    plan = tier.plan_write([(big, 2 * BLOCK, 2 * BLOCK)], [a1, a2])
    assert plan.entries == [None] and [v.bkey for v in plan.victims] == [a1]
    tier.finish_write(plan, None)                                    # nothing to write: never submitted
    tier.flush().result()
    tier.unpin(tier.get(a2))
    tier.close()
    assert _held_after_restart(d, 2 * BLOCK, [a1, a2]) == [False, True]


def test_a_failed_index_delete_fails_the_flush_until_it_is_retried(tmp_path) -> None:
    """An index delete that fails (a full LMDB map, injected) was only logged, so an Evict's
    flush answered and the evicted block came back after a restart. The flush now fails
    while the delete does; the delete is retried and, once it succeeds, the flush answers."""
    import lmdb

    d = str(tmp_path / "disk")
    tier = _open(d, capacity=4 * BLOCK)
    a, b = (bytes(16) + key(i) for i in range(2))
    _write(tier, [a, b])
    real = tier._index_delete

    def full(bkeys):
        raise lmdb.MapFullError("injected")
    tier._index_delete = full
    assert [e.bkey for e in tier.remove([a])] == [a]
    with pytest.raises(DiskTierError, match="would come back after a restart"):
        tier.flush().result()
    tier._index_delete = real
    tier.flush().result()                                            # retried: done
    tier.close()
    assert _held_after_restart(d, 4 * BLOCK, [a, b]) == [False, True]


def _held_after_restart(directory: str, capacity: int, bkeys: list[bytes]) -> list[bool]:
    """Whether each key is restored when the tier's directory is opened again."""
    again = _open(directory, capacity=capacity)
    try:
        return [again.get(b) is not None for b in bkeys]
    finally:
        again.close()

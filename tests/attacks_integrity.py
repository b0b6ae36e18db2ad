"""Host-tier integrity, files and crashes, against real kvtierd processes.

One test per attack: a reclaimed client's late write (and late commit); a host block changed
after its commit reaching disk; a killed daemon's files left in --shm-dir; an Evict lost to a
kill -9; a planted pool path; world-readable index and slab files; a disk directory others
may write.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
from _demotions import demotions_over

from kvtier.client import Sidecar
from kvtier.proto import node_pb2, node_pb2_grpc
from kvtier.tiers.host import PoolMapping
from kvtier.tiers.layout import Layout, layout_to_proto

BLOCK = 64 * 1024
MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


def block(seed: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def _disk_args(disk_dir: str, capacity: str = "64MiB", *extra: str) -> list[str]:
    return ["--disk-dir", disk_dir, "--disk-capacity", capacity, *extra]


def test_reclaimed_clients_late_write_is_never_visible_in_another_keys_get(start_daemon) -> None:
    """Client A holds a grant, its session is reclaimed (stream cut) but A keeps running: its
    slot goes to client B's key, then A writes into it and commits. A's commit is refused;
    B's verified get finds the change and answers a miss (the block is dropped), never A's bytes."""
    d = start_daemon(host_capacity=str(BLOCK))   # one slot: B's key gets A's old slot
    layout = Layout.flat(BLOCK)
    with Sidecar(d.socket) as a, Sidecar(d.socket) as b:
        lid_b = b.register_layout(layout)
        stub = node_pb2_grpc.NodeStub(a._channel)
        reg = stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=layout_to_proto(layout, node_pb2.LayoutSpec)))
        pool = PoolMapping(reg.pool_path, reg.pool_bytes)          # A's own mapping of the pool
        try:
            sid_a = a._ensure_session()
            grant = stub.Allocate(node_pb2.AllocateRequest(session_id=sid_a, layout_id=reg.layout_id,
                                                           keys=[key(1)])).grants[0]
            assert grant.status == node_pb2.GRANTED
            a._transport.session.close()                            # A's stream is cut: reclaimed
            wait_for(lambda: b.stats()["counters"].get("grants_reclaimed", 0) == 1)

            mine = block(2)
            assert b.put(lid_b, [key(2)], [mine]).stored == 1      # B's block, in A's old slot
            assert bytes(b.get(lid_b, [key(2)], verify=True)[0]) == mine

            pool.arr[grant.offset:grant.offset + BLOCK] = 0xAB       # A's late write
            with pytest.raises(grpc.RpcError) as late:               # A's late commit
                stub.Commit(node_pb2.CommitRequest(session_id=sid_a, grant_ids=[grant.grant_id]))
            assert late.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)

            assert b.get(lid_b, [key(2)], verify=True) == [None]    # found changed: a miss
            assert b.get(lid_b, [key(2)]) == [None]                  # and dropped
            assert b.lookup(lid_b, [key(1), key(2)]) == [None, None]  # A's key never visible
            assert b.stats()["counters"]["checksum_failures"] == 1
        finally:
            pool.close()


def test_host_block_changed_after_commit_is_not_demoted(start_daemon, tmp_path) -> None:
    """A late write into a committed host block is found when the block is demoted: it is
    neither written to disk nor kept in host."""
    d = start_daemon(*_disk_args(str(tmp_path / "disk"), "16MiB", "--demote-min-seen", "1"),
                     host_capacity=str(BLOCK))
    layout = Layout.flat(BLOCK)
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(layout)
        stub = node_pb2_grpc.NodeStub(sc._channel)
        reg = stub.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=layout_to_proto(layout, node_pb2.LayoutSpec)))
        sc.put(lid, [key(1)], [block(1)])
        pool = PoolMapping(reg.pool_path, reg.pool_bytes)
        try:
            pool.arr[:BLOCK] = 0xCD                                   # the one slot, key 1's
        finally:
            pool.close()
        sc.put(lid, [key(2)], [block(2)])                            # evicts key 1: demotion checks it
        demotions_over(sc)                                           # (written in the background)
        assert sc.lookup(lid, [key(1), key(2)]) == [None, "host"]
        assert sc.stats()["counters"]["checksum_failures"] == 1


def _shm_files(shm: str) -> list[str]:
    return sorted(os.listdir(shm))


def test_kill9_then_restart_leaves_only_the_new_daemons_files(start_daemon) -> None:
    shm = tempfile.mkdtemp(prefix="kvtier-sec-", dir="/dev/shm")
    try:
        d1 = start_daemon(shm_dir=shm, name="first", host_capacity="8MiB")
        with Sidecar(d1.socket) as sc:
            lid = sc.register_layout(Layout.flat(BLOCK))
            sc.put(lid, [key(1)], [block(1)])                        # tenant data in the pool
        old = _shm_files(shm)
        assert any(f.endswith(".pool") for f in old) and any(f.endswith(".keys") for f in old)
        d1.kill()                                                    # SIGKILL: nothing cleaned up
        assert _shm_files(shm) == old
        d2 = start_daemon(shm_dir=shm, name="second", host_capacity="8MiB")
        with Sidecar(d2.socket) as sc:
            sc.register_layout(Layout.flat(BLOCK))
        files = _shm_files(shm)
        assert files and all(f.startswith(f"kvtier-{d2.pid}-") for f in files), files
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_evict_kill9_restart_the_key_stays_gone(start_daemon, tmp_path) -> None:
    """The Evict reply comes only after the disk index delete committed, even when the disk's
    writer thread is busy with other writes: a kill -9 right after the reply cannot bring
    the key back."""
    disk_dir = str(tmp_path / "disk")
    big = 2 * MiB
    # The busy writes stop at 1 GiB, well inside the disk's 2 GiB: the disk never has to evict
    # the victims to make room, so the Evict must find all 8 there (their host copies may be gone).
    d = start_daemon(*_disk_args(disk_dir, "2GiB"), host_capacity="256MiB")
    layout, busy_layout = Layout.flat(BLOCK), Layout.flat(big)
    with Sidecar(d.socket) as sc, Sidecar(d.socket) as busy:
        lid = sc.register_layout(layout)
        blid = busy.register_layout(busy_layout)
        victims = [key(i) for i in range(8)]
        assert sc.put(lid, victims, [block(i) for i in range(8)], durable=True).durable == 8
        payload = [block(99, big)] * 32
        stop = threading.Event()

        def keep_disk_busy() -> None:  # durable writes queue on the writer thread ahead of the delete
            i = 1000
            while not stop.is_set() and i < 1000 + 512:              # 512 x 2 MiB = 1 GiB at most
                try:
                    busy.put(blid, [key(i + j) for j in range(32)], payload, durable=True)
                except Exception:
                    return
                i += 32

        t = threading.Thread(target=keep_disk_busy, daemon=True)
        t.start()
        time.sleep(0.3)
        assert sc.evict(lid, victims) >= 8                           # (their host copies may be gone)
        d.kill()
        stop.set()
        t.join(10)
    d2 = start_daemon(*_disk_args(disk_dir, "2GiB"), host_capacity="256MiB", name="restarted")
    with Sidecar(d2.socket) as sc:
        lid = sc.register_layout(layout)
        assert sc.lookup(lid, victims) == [None] * 8
        assert sc.get(lid, victims) == [None] * 8


def _file_prefix(d, sc: Sidecar) -> str:
    """What the daemon's file names start with: ``kvtier-<pid>-<epoch>-r<random>``, read from its
    key table's name (only the daemon's own uid can list its directory; the random part keeps
    anyone else from naming a file before the daemon makes it)."""
    epoch = sc.stats()["epoch"]
    tables = [n for n in os.listdir(d.shm_dir) if n.startswith(f"kvtier-{d.pid}-{epoch}-r") and n.endswith(".keys")]
    assert len(tables) == 1, tables
    return tables[0][:-len(".keys")]


def test_preplanted_symlink_at_the_pool_path_is_refused(start_daemon, tmp_path) -> None:
    d = start_daemon(host_capacity="8MiB")
    layout = Layout.flat(BLOCK)
    victim = tmp_path / "precious"
    victim.write_bytes(b"do not truncate me")
    with Sidecar(d.socket) as sc:
        path = os.path.join(d.shm_dir, f"{_file_prefix(d, sc)}-{layout.slot_bytes}.pool")
        os.symlink(victim, path)                                     # planted before the first layout
        with pytest.raises(Exception) as refused:
            sc.register_layout(layout)
        assert "symbolic link" in str(refused.value)
    assert victim.read_bytes() == b"do not truncate me"
    assert os.path.islink(path)


def test_preplanted_file_at_the_pool_path_is_refused(start_daemon) -> None:
    d = start_daemon(host_capacity="8MiB")
    layout = Layout.flat(BLOCK)
    with Sidecar(d.socket) as sc:
        path = os.path.join(d.shm_dir, f"{_file_prefix(d, sc)}-{layout.slot_bytes}.pool")
        with open(path, "wb") as fh:                                 # another's file, readable by them
            fh.write(b"x")
        os.chmod(path, 0o644)
        with pytest.raises(Exception) as refused:
            sc.register_layout(layout)
        assert "already there" in str(refused.value)
    assert os.stat(path).st_size == 1


def test_lmdb_and_slab_files_are_owner_only(start_daemon, tmp_path) -> None:
    disk_dir = str(tmp_path / "disk")
    old = os.umask(0o022)
    try:
        d = start_daemon(*_disk_args(disk_dir))
    finally:
        os.umask(old)
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, [key(1)], [block(1)], durable=True).durable == 1
    index = os.path.join(disk_dir, "index")
    assert stat.S_IMODE(os.stat(index).st_mode) == 0o700
    files = [os.path.join(index, f) for f in os.listdir(index)]
    files += [os.path.join(disk_dir, f) for f in os.listdir(disk_dir) if f.startswith("slab-")]
    assert any(f.endswith("data.mdb") for f in files) and any("slab-" in f for f in files)
    assert {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {f: "0o600" for f in files}


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_disk_dir_writable_by_others_is_refused(start_daemon, tmp_path, mode) -> None:
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    os.chmod(disk_dir, mode)
    with pytest.raises(RuntimeError) as refused:
        start_daemon(*_disk_args(str(disk_dir)))
    assert f"has mode {mode:04o}" in str(refused.value)
    assert os.listdir(disk_dir) == []                                # nothing made in it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another uid")
def test_disk_dir_of_another_uid_is_refused(start_daemon, tmp_path) -> None:
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir(mode=0o700)
    os.chown(disk_dir, 65534, 65534)                                 # nobody
    with pytest.raises(RuntimeError) as refused:
        start_daemon(*_disk_args(str(disk_dir)))
    assert "is owned by uid 65534" in str(refused.value)

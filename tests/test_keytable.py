"""The shared-memory key table: format and probe logic (unit), a reader racing a writer in
another process, and the table against a real kvtierd's own answers (integration).

The integration property test compares, after every operation of a random mix (put, evict,
get, eviction by capacity, prefetch, restart), what the table says with what the daemon's
Lookup RPC says, for every key ever used. With a disk tier (``kvtier.tiers.disk`` present,
``--disk-dir``) evictions demote and gets/prefetches promote, and the same comparison covers
those moves.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _demotions import demotions_over

from kvtier.client import InvalidArgument, KvtierError, Sidecar
from kvtier.client.engine.sidecar import AsyncSidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.keytable import (
    COMPILED,
    SPIN_LIMIT_S,
    TIER_BITS,
    KeyTableReader,
    KeyTableWriter,
    TableUnavailable,
    fastest_tier,
    hash_key,
    hash_keys,
    key_words,
    prefix_lengths,
)
from kvtier.tiers.layout import Layout

FP_A = bytes(range(16))
FP_B = bytes(15) + b"\x01"
FP_ZERO_TAIL = b"\x07" + bytes(15)  # a fingerprint ending in zero bytes
HAVE_DISK = importlib.util.find_spec("kvtier.tiers.disk") is not None


def rand_keys(rng: random.Random, n: int, lengths: tuple[int, ...] = (16,)) -> list[bytes]:
    return [rng.randbytes(rng.choice(lengths)) for _ in range(n)]


def first_word_twins(n: int) -> list[bytes]:
    """Keys of one length that share their first 8 bytes (the probe's quick compare)."""
    return [b"samefirst" + i.to_bytes(7, "little") for i in range(n)]


@pytest.fixture
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[KeyTableWriter, KeyTableReader]:
    d = tmp_path_factory.mktemp("kt", numbered=True)
    shm = os.path.join("/dev/shm", f"kvtier-kt-test-{os.getpid()}-{d.name}")
    os.makedirs(shm)
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    r = KeyTableReader(w.path)
    yield w, r
    r.close()
    w.close()
    os.rmdir(shm)


# -- unit: hashing and the probe ---------------------------------------------------------


def test_scalar_and_vector_hash_agree() -> None:
    rng = random.Random(3)
    keys = rand_keys(rng, 500, (8, 9, 16, 20, 31, 32)) + first_word_twins(10)
    words, lens = key_words(keys)
    vec = hash_keys(5, words, lens)
    assert [int(h) for h in vec] == [hash_key(5, k) for k in keys]
    sixteen = [k for k in keys if len(k) == 16]
    uniform, _ = key_words(sixteen)  # all one length: the join-and-pad path
    mixed, _ = key_words([*sixteen, bytes(8)])  # the general path
    assert (uniform == mixed[:-1]).all()


def test_bad_key_lengths_are_refused(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    w, r = table
    w.set(FP_A, [bytes(16)], "host")
    for bad in ([b"short"], [bytes(33)], [bytes(16), b"x"]):
        with pytest.raises(ValueError, match="keys are 8 to 32 bytes"):
            r.masks(FP_A, bad)


def test_table_matches_a_model_through_growth_and_tombstones(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    w, r = table
    rng = random.Random(11)
    universe = (rand_keys(rng, 1500, (8, 16, 16, 20, 32)) + first_word_twins(64)
                + [i.to_bytes(8, "little") for i in range(500)])
    fps = (FP_A, FP_B, FP_ZERO_TAIL)
    model: dict[tuple[bytes, bytes], int] = {}
    for step in range(600):
        fp, tier = rng.choice(fps), rng.choice(("gpu", "host", "disk"))
        batch = rng.sample(universe, rng.randint(1, 60))
        if rng.random() < 0.02:
            w.clear_tier(tier)
            model = {k: v & ~TIER_BITS[tier] for k, v in model.items()}
        elif rng.random() < 0.55:
            w.set(fp, batch + batch[:3], tier)  # repeats within a batch collapse
            for k in batch:
                model[fp, k] = model.get((fp, k), 0) | TIER_BITS[tier]
        else:
            w.clear(fp, batch, tier)
            for k in batch:
                model[fp, k] = model.get((fp, k), 0) & ~TIER_BITS[tier]
        w.heartbeat()
        fp = rng.choice(fps)
        query = rng.sample(universe, 100)
        want = np.array([model.get((fp, k), 0) for k in query], dtype=np.uint8)
        assert (r.masks(fp, query) == want).all(), step
        assert (w.masks(fp, query) == want).all(), step
        k = rng.choice(query)
        assert r.masks(fp, [k])[0] == model.get((fp, k), 0)  # the scalar path
    live = sum(1 for v in model.values() if v)
    assert w.live == live
    assert w.rebuilds >= 3, "the table never grew: the test did not exercise rebuilds"
    assert w.tombstones > 0


def test_fastest_tier_and_prefix_lengths() -> None:
    g, h, d = TIER_BITS["gpu"], TIER_BITS["host"], TIER_BITS["disk"]
    assert [fastest_tier(m) for m in (0, g, h, d, g | d, h | d)] == [None, "gpu", "host", "disk", "gpu", "host"]
    m = np.array([g, h | d, h, d, g, 0, h], dtype=np.uint8)
    assert prefix_lengths(m) == (3, 5)
    assert prefix_lengths(np.array([d, h], dtype=np.uint8)) == (0, 2)
    assert prefix_lengths(np.array([g, h], dtype=np.uint8)) == (2, 2)
    assert prefix_lengths(np.array([], dtype=np.uint8)) == (0, 0)


def test_prefix_length_through_the_reader(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    w, r = table
    keys = rand_keys(random.Random(5), 10)
    w.set(FP_A, keys[:3], "gpu")
    w.set(FP_A, keys[3:6], "host")
    w.set(FP_A, keys[6:8], "disk")
    assert r.prefix_length(FP_A, keys) == (6, 8)
    assert r.tiers(FP_A, keys) == ["gpu"] * 3 + ["host"] * 3 + ["disk"] * 2 + [None] * 2
    assert r.prefix_length(FP_B, keys) == (0, 0)  # another layout holds nothing


def test_reader_never_uses_a_slot_mid_update(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    """A slot whose seq is odd (the writer is inside it) is never acted on: the reader waits,
    then gives up (the caller asks the daemon) rather than read it."""
    w, r = table
    keys = rand_keys(random.Random(8), 20)
    w.set(FP_A, keys, "host")
    slot = int(w._map.probe(w.tag(FP_A), *key_words(keys[:1]), checked=False)[0][0])
    w._begin(w._map)  # as if the writer stopped halfway through a batch, inside this slot:
    w._map.seq[slot] += 1  # the table's generation and the slot's seq are both odd
    w.heartbeat()
    for batch in (keys[:1], keys):
        t0 = time.monotonic()
        with pytest.raises(TableUnavailable, match="mid-update"):
            r.masks(FP_A, batch)
        assert time.monotonic() - t0 >= SPIN_LIMIT_S * 0.9
    w._map.seq[slot] += 1
    assert (r.masks(FP_A, keys) == TIER_BITS["host"]).all()  # the per-slot checks pass again
    w._end(w._map)
    assert (r.masks(FP_A, keys) == TIER_BITS["host"]).all()


def test_closed_stale_and_invalid_tables_are_unavailable(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    w, r = table
    keys = rand_keys(random.Random(9), 4)
    w.set(FP_A, keys, "host")
    stale = KeyTableReader(w.path, stale_ns=50_000_000)
    time.sleep(0.1)  # no heartbeat: as if the daemon were killed
    with pytest.raises(TableUnavailable, match="heartbeat"):
        stale.masks(FP_A, keys)
    stale.close()
    w.heartbeat()
    w.invalidate()
    with pytest.raises(TableUnavailable, match="invalid"):
        r.masks(FP_A, keys)


def test_reader_follows_a_rebuild_to_the_new_file(table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    w, r = table
    keys = rand_keys(random.Random(10), 2000)
    w.set(FP_A, keys[:5], "host")
    assert (r.masks(FP_A, keys[:5]) == TIER_BITS["host"]).all()
    first = r.nslots
    w.set(FP_A, keys, "disk")  # grows: a new file renamed over the path, the old one retired
    w.heartbeat()
    got = r.masks(FP_A, keys)
    assert r.nslots > first
    assert (got[:5] == TIER_BITS["host"] | TIER_BITS["disk"]).all() and (got[5:] == TIER_BITS["disk"]).all()


# -- a reader racing a writer in another process -----------------------------------------

_RACE_WRITER = textwrap.dedent("""
    import random, sys, time
    from kvtier.tiers.keytable import KeyTableWriter
    path, seconds = sys.argv[1], float(sys.argv[2])
    fp = bytes(range(16))
    rng = random.Random(1)
    stable = [b"stable" + i.to_bytes(10, "little") for i in range(64)]
    gpu_only = [b"gpu-only" + i.to_bytes(8, "little") for i in range(300)]
    disk_only = [b"disk-only" + i.to_bytes(7, "little") for i in range(300)]
    w = KeyTableWriter(path, nslots=16)
    w.set(fp, stable, "host")
    print("ready", flush=True)
    ops, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        w.heartbeat()
        # stable keys: always in host; their slots are rewritten (disk bit on and off)
        w.set(fp, rng.sample(stable, 16), "disk")
        w.clear(fp, rng.sample(stable, 16), "disk")
        # churn: the two groups take each other's tombstones; never in the other's tier
        w.set(fp, rng.sample(gpu_only, 40), "gpu")
        w.clear(fp, rng.sample(gpu_only, 40), "gpu")
        w.set(fp, rng.sample(disk_only, 40), "disk")
        w.clear(fp, rng.sample(disk_only, 40), "disk")
        ops += 6
        if ops % 120 == 0:
            w.compact()  # a new file renamed over the path while the reader reads
    print("ops", ops, "rebuilds", w.rebuilds, flush=True)
    w.close()
""")


@pytest.mark.parametrize("compiled", [pytest.param(True, marks=pytest.mark.skipif(
    not COMPILED, reason="the compiled probe is not built")), False], ids=["compiled", "numpy"])
def test_reader_racing_a_writer_process_never_sees_a_wrong_tier_or_torn_key(tmp_path, compiled) -> None:
    shm = os.path.join("/dev/shm", f"kvtier-kt-race-{os.getpid()}")
    os.makedirs(shm, exist_ok=True)
    path = os.path.join(shm, "race.keys")
    proc = subprocess.Popen([sys.executable, "-c", _RACE_WRITER, path, "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        r = KeyTableReader(path, compiled=compiled)
        fp = bytes(range(16))
        stable = [b"stable" + i.to_bytes(10, "little") for i in range(64)]
        gpu_only = [b"gpu-only" + i.to_bytes(8, "little") for i in range(300)]
        disk_only = [b"disk-only" + i.to_bytes(7, "little") for i in range(300)]
        host, gpu, disk = TIER_BITS["host"], TIER_BITS["gpu"], TIER_BITS["disk"]
        rng = random.Random(2)
        reads = seen_gpu = seen_disk = 0
        while proc.poll() is None:
            batch = rng.sample(stable, 8) + rng.sample(gpu_only, 30) + rng.sample(disk_only, 30)
            try:
                m = r.masks(fp, batch)
                one = r.masks(fp, [rng.choice(stable)])[0]
            except TableUnavailable:
                break  # the writer closed the table at its end
            reads += 1
            assert ((m[:8] == host) | (m[:8] == host | disk)).all(), m[:8]  # never missing, never torn
            assert one in (host, host | disk)
            assert np.isin(m[8:38], (0, gpu)).all(), m[8:38]
            assert np.isin(m[38:], (0, disk)).all(), m[38:]
            seen_gpu += int((m[8:38] == gpu).sum())
            seen_disk += int((m[38:] == disk).sum())
        out, _ = proc.communicate(timeout=30)
        rechecked = r.rechecked
        r.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
        os.rmdir(shm)
    assert proc.returncode == 0
    ops = int(out.split()[1])
    assert ops > 300 and reads > 300, f"too little overlap to mean anything: {ops} writes, {reads} reads"
    assert seen_gpu and seen_disk
    assert int(out.split()[3]) >= 1, "the writer never rebuilt while the reader read"
    assert rechecked > 0, "no batched probe ever overlapped a write: the per-slot checks went untested"


# -- against a real daemon ---------------------------------------------------------------


def _table_path(sc: Sidecar, lid: int) -> str:
    table = sc._info(lid).table
    assert table is not None, "the sidecar did not map the daemon's key table"
    return table.path


def test_put_is_in_the_table_before_it_returns(daemon: DaemonProcess) -> None:
    layout = Layout.flat(4096)
    rng = random.Random(4)
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(layout)
        reader = KeyTableReader(_table_path(sc, lid))  # an independent mapping of the file
        for _ in range(50):
            keys = rand_keys(rng, 20)
            sc.put(lid, keys, [bytes(4096)] * 20)
            assert (reader.masks(layout.fingerprint, keys) == TIER_BITS["host"]).all()
        reader.close()


def test_a_key_evicted_after_lookup_gets_none_never_other_bytes(daemon: DaemonProcess) -> None:
    layout = Layout.flat(4096)
    with Sidecar(daemon.socket) as a, Sidecar(daemon.socket) as b:
        la, lb = a.register_layout(layout), b.register_layout(layout)
        keys = rand_keys(random.Random(6), 8)
        a.put(la, keys, [bytes([i]) * 4096 for i in range(8)])
        assert a.lookup(la, keys) == ["host"] * 8
        assert b.evict(lb, keys[:4]) == 4  # another client evicts between lookup and get
        others = rand_keys(random.Random(7), 8)
        b.put(lb, others, [b"\xee" * 4096] * 8)  # and the freed slots are reused
        got = a.get(la, keys)
        assert got[:4] == [None] * 4
        assert [bytes(g) for g in got[4:]] == [bytes([i]) * 4096 for i in range(4, 8)]
        assert a.lookup(la, keys) == [None] * 4 + ["host"] * 4


def test_table_path_agrees_with_rpc_and_refuses_bad_keys_alike(daemon: DaemonProcess) -> None:
    layout = Layout.flat(4096)
    with Sidecar(daemon.socket) as sc, Sidecar(daemon.socket, use_key_table=False) as rpc:
        lid, rid = sc.register_layout(layout), rpc.register_layout(layout)
        assert sc._info(lid).table is not None and rpc._info(rid).table is None
        keys = rand_keys(random.Random(12), 64)
        sc.put(lid, keys[::2], [bytes(4096)] * 32)
        assert sc.lookup(lid, keys) == rpc.lookup(rid, keys) == ["host", None] * 32
        assert sc.prefix_length(lid, keys) == rpc.prefix_length(rid, keys) == (1, 1)
        assert sc.prefix_length(lid, keys[::2]) == rpc.prefix_length(rid, keys[::2]) == (32, 32)
        for client, layout_id in ((sc, lid), (rpc, rid)):
            with pytest.raises(KvtierError) as e:
                client.lookup(layout_id, [b"short"])
            assert e.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(InvalidArgument):
            sc.prefix_length(lid, [bytes(40)])


def test_async_sidecar_reads_the_table(daemon: DaemonProcess) -> None:
    layout = Layout.flat(4096)
    keys = rand_keys(random.Random(13), 16)

    async def main() -> tuple[list, tuple, bool]:
        async with AsyncSidecar(daemon.socket) as sc:
            lid = await sc.register_layout(layout)
            await sc.put(lid, keys[:10], [bytes(4096)] * 10)
            return await sc.lookup(lid, keys), await sc.prefix_length(lid, keys), sc._info(lid).table is not None

    tiers, prefix, mapped = asyncio.run(main())
    assert mapped
    assert tiers == ["host"] * 10 + [None] * 6
    assert prefix == (10, 10)


_WRITE_THROUGH_CLIENT_MAPPING = textwrap.dedent("""
    import ctypes, sys
    from kvtier.client import Sidecar
    from kvtier.tiers.layout import Layout
    with Sidecar(sys.argv[1]) as sc:
        lid = sc.register_layout(Layout.flat(4096))
        table = sc._info(lid).table
        arr = table._map.words
        assert not arr.flags.writeable
        print("mapped", flush=True)
        ctypes.memset(arr.ctypes.data, 0xFF, 4096)  # the mapping is PROT_READ: SIGSEGV
        print("wrote", flush=True)
""")


def test_a_client_cannot_write_the_table(daemon: DaemonProcess) -> None:
    layout = Layout.flat(4096)
    with Sidecar(daemon.socket) as sc, Sidecar(daemon.socket, use_key_table=False) as rpc:
        lid, rid = sc.register_layout(layout), rpc.register_layout(layout)
        keys = rand_keys(random.Random(14), 200)
        sc.put(lid, keys, [bytes(4096)] * 200)
        path = _table_path(sc, lid)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o400, oct(mode)  # owner-only, and read-only even for the owner
        if os.geteuid() != 0:  # root ignores file modes
            with pytest.raises(PermissionError):
                os.open(path, os.O_RDWR)
        with pytest.raises(ValueError, match="read-only"):
            sc._info(lid).table._map.head[0] = 1
        proc = subprocess.run([sys.executable, "-c", _WRITE_THROUGH_CLIENT_MAPPING, daemon.socket],
                              capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "mapped" and proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
        assert sc.lookup(lid, keys) == rpc.lookup(rid, keys) == ["host"] * 200


def test_killed_daemon_table_is_not_trusted_after_restart(tmp_path) -> None:
    """SIGKILL leaves the table file behind, unclosed; its heartbeat stops, so the sidecar
    stops reading it and follows the restarted daemon's new table."""
    layout = Layout.flat(4096)
    first = DaemonProcess(str(tmp_path), host_capacity="16MiB").start()
    second = None
    try:
        with Sidecar(first.socket, timeout=20) as sc:
            lid = sc.register_layout(layout)
            keys = rand_keys(random.Random(15), 32)
            sc.put(lid, keys, [bytes(4096)] * 32)
            old_path = _table_path(sc, lid)
            assert sc.lookup(lid, keys) == ["host"] * 32
            first.kill()
            second = DaemonProcess(str(tmp_path), host_capacity="16MiB", shm_dir=first.shm_dir).start()
            time.sleep(2.5)  # past the staleness bound of the old table's heartbeat
            assert sc.lookup(lid, keys) == [None] * 32
            sc.put(lid, keys[:5], [bytes(4096)] * 5)
            assert sc.lookup(lid, keys) == ["host"] * 5 + [None] * 27
            assert _table_path(sc, lid) != old_path
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()


@pytest.mark.parametrize("disk", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAVE_DISK, reason="needs the disk tier (kvtier.tiers.disk)"))])
def test_table_agrees_with_the_daemon_through_random_operations(tmp_path, disk: bool) -> None:
    """900 random operations with three restarts; after each, the table and the daemon's Lookup RPC agree
    on every key ever used. Capacity is small, so puts evict (or demote, with a disk tier)."""
    args = ("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "8MiB") if disk else ()
    make = lambda shm=None: DaemonProcess(str(tmp_path), *args, host_capacity="1MiB", shm_dir=shm)  # noqa: E731
    d = make().start()
    shm_dir = d.shm_dir  # the first daemon's; the restarted ones reuse it
    rng = random.Random(20)
    layouts = [Layout.flat(4096, name="a"), Layout.flat(8192, name="b")]
    universe = rand_keys(rng, 400, (8, 16, 32)) + first_word_twins(40)
    ops = restarts = 0
    try:
        with Sidecar(d.socket, timeout=30) as sc, Sidecar(d.socket, use_key_table=False, timeout=30) as rpc:
            lids = [sc.register_layout(lay) for lay in layouts]
            rids = [rpc.register_layout(lay) for lay in layouts]
            for step in range(900):
                i = rng.randrange(2)
                lid, rid, lay = lids[i], rids[i], layouts[i]
                batch = rng.sample(universe, rng.randint(1, 24))
                op = rng.random()
                if step % 300 == 150:  # three restarts over the run
                    d.stop()
                    d = make(d.shm_dir).start()
                    restarts += 1
                elif op < 0.45:
                    sc.put(lid, batch, [bytes([step % 251]) * lay.block_bytes] * len(batch))
                elif op < 0.65:
                    rpc.evict(rid, batch)
                elif op < 0.85:
                    got = sc.get(lid, batch)
                    assert all(g is None or len(g) == lay.block_bytes for g in got)
                else:
                    sc.prefetch(lid, batch)
                if disk:  # a put's victims, and a prefetch's (what its promotions evict from host), are
                    # written in the background: table and RPC would race them
                    demotions_over(rpc)
                ops += 1
                query = universe if step % 10 == 0 else rng.sample(universe, 48)
                table = sc.lookup(lid, query)
                assert sc._info(lid).table is not None, "the sidecar fell back to RPC: nothing compared"
                assert table == rpc.lookup(rid, query), f"step {step}"
                assert sc.prefix_length(lid, query) == rpc.prefix_length(rid, query)
    finally:
        d.stop()
        d.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert ops == 900 and restarts == 3


def test_table_lookups_reach_the_daemons_counters(daemon: DaemonProcess) -> None:
    """Lookups answered from the table are reported (in batches, and on close) to the daemon's
    lookup counters, by the fastest tier found: hit rates stay visible in Stats and metrics."""
    layout = Layout.flat(4096)
    keys = rand_keys(random.Random(16), 6)
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(layout)
        sc.put(lid, keys[:4], [bytes(4096)] * 4)
        for _ in range(3):
            assert sc.lookup(lid, keys) == ["host"] * 4 + [None] * 2
        assert sc.lookup(lid, keys[:1]) == ["host"]
        assert sc.prefix_length(lid, keys) == (4, 4)
    with Sidecar(daemon.socket, use_key_table=False) as rpc:
        counters = rpc.stats()["counters"]
    assert counters.get("lookup_hit_blocks:host") == 3 * 4 + 1 + 4
    assert counters.get("lookup_miss_blocks") == 3 * 2 + 2
    assert counters.get("lookup_hit_tokens:host") == (3 * 4 + 1 + 4) * layout.block_tokens


def test_a_write_between_a_batched_probe_and_its_check_forces_the_checked_probe(
        table: tuple[KeyTableWriter, KeyTableReader]) -> None:
    """The batched probe reads slots without their seqlocks, then re-reads the table's
    generation: a write batch that landed in between (put there through the mapping's seam, so
    the interleaving is exact, not a race to win) must send it through the per-slot checks, and
    the answer is the table after the write. Without the re-check it returned what the unchecked
    pass read (torn, had the write overlapped a slot)."""
    w, r = table
    keys = rand_keys(random.Random(14), 6)
    w.set(FP_A, keys, "host")
    m = r._map
    landed: list[int] = []

    def write_now() -> None:
        if not landed:
            landed.append(m.generation())
            w.clear(FP_A, keys[2:4], "host")
            w.set(FP_A, keys[2:4], "disk")

    m.probed = write_now
    try:
        got = r.masks(FP_A, keys)
    finally:
        m.probed = None
    assert landed, "the batched probe never reached its generation check"
    assert m.generation() != landed[0] and not m.generation() & 1
    assert r.rechecked == 1, "a write between the probe and its check did not force the checked probe"
    assert got.tolist() == [TIER_BITS["host"]] * 2 + [TIER_BITS["disk"]] * 2 + [TIER_BITS["host"]] * 2
    assert r.rechecked == 1 and (r.masks(FP_A, keys) == got).all() and r.rechecked == 1  # no write: no re-check

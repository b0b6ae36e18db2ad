"""The compiled key-table probe (tiers/_probe.c) against the numpy probe it replaces: built by the
install, the same answers on random tables (tags, key lengths, tombstones, first-word twins, long
runs), the same protocol (a write between a batched probe and its generation re-check forces the
checked probe; a slot left mid-update gives up after the spin limit), and the same errors.
(The reader racing a writer process runs for both probes in tests/test_keytable.py.)"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from kvtier.tiers import keytable
from kvtier.tiers.keytable import (
    FAST_BITS,
    TIER_BITS,
    KeyTableReader,
    KeyTableWriter,
    TableUnavailable,
    prefix_lengths,
)

FP_A, FP_B = bytes(range(16)), bytes(15) + b"\x01"
needs_c = pytest.mark.skipif(keytable._cprobe is None, reason="the compiled probe is not built")


@pytest.fixture
def shm(tmp_path):
    d = os.path.join("/dev/shm", f"kvtier-probe-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def test_the_install_built_the_compiled_probe() -> None:
    """pip install (editable too) compiles tiers/_probe.c; CI installs the headers it needs (.ci/run).
    Readers use it by default."""
    assert keytable._cprobe is not None, "kvtier.tiers._probe is missing: the install did not build tiers/_probe.c"
    assert keytable.COMPILED


def _readers(path: str) -> tuple[KeyTableReader, KeyTableReader]:
    return KeyTableReader(path, compiled=True), KeyTableReader(path, compiled=False)


@needs_c
def test_compiled_and_numpy_probes_agree_on_random_tables(shm) -> None:
    rng = random.Random(15)
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    cr, nr = _readers(w.path)
    try:
        lengths = (8, 9, 16, 20, 31, 32)
        universe = [rng.randbytes(rng.choice(lengths)) for _ in range(3000)]
        universe += [b"samefirst" + i.to_bytes(rng.choice((7, 12)), "little") for i in range(200)]  # first-word twins
        # keys alike but for their last word (24 and 32 bytes), and for their length alone (zero padding)
        universe += [b"t" * 24 + i.to_bytes(8, "little") for i in range(400)] + [b"u" * 16 + bytes([i]) for i in range(200)]
        universe += [b"v" * 8 + bytes(n) for n in range(0, 25)]
        tiers = list(TIER_BITS)
        for step in range(40):  # sets and clears make tombstones; growth and compaction rebuild
            fp = FP_A if step % 3 else FP_B
            w.set(fp, rng.sample(universe, 300), rng.choice(tiers))
            w.clear(fp, rng.sample(universe, 200), rng.choice(tiers))
            if step == 25:
                w.compact()
            for fp in (FP_A, FP_B, bytes(16)):  # bytes(16): a layout the table does not know
                batch = rng.sample(universe, rng.choice((1, 2, 7, 128, 700)))
                want = w.masks(fp, batch)
                assert (cr.masks(fp, batch) == want).all() and (nr.masks(fp, batch) == want).all()
                assert cr.prefix_length(fp, batch) == nr.prefix_length(fp, batch)
        assert w.tombstones > 0 and w.rebuilds > 0
        assert int((w.masks(FP_A, universe) != 0).sum()) > 300  # a real mix of held and not
    finally:
        cr.close()
        nr.close()
        w.close()


def test_compiled_prefix_lengths_match_numpy() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        masks = rng.choice(np.array([0, 1, 2, 3, 4, 6], dtype=np.uint8), size=int(rng.integers(0, 12)),
                           p=[0.1, 0.2, 0.3, 0.1, 0.2, 0.1])
        fast, anyt = (masks & FAST_BITS) == 0, masks == 0
        n = len(masks)
        want = (int(fast.argmax()) if fast.any() else n, int(anyt.argmax()) if anyt.any() else n)
        assert prefix_lengths(masks) == want, masks


@needs_c
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_a_write_between_the_batched_probe_and_its_recheck_forces_the_checked_probe(shm, compiled) -> None:
    """The seam ``_Mapping.probed`` runs between the optimistic probe and the generation re-check
    on both paths: a write landed there sends the batch through the per-slot checks."""
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    r = KeyTableReader(w.path, compiled=compiled)
    try:
        rng = random.Random(4)
        keys = [rng.randbytes(16) for _ in range(6)]
        w.set(FP_A, keys, "host")
        m, landed = r._map, []

        def write_now() -> None:
            if not landed:
                landed.append(m.generation())
                w.clear(FP_A, keys[2:4], "host")
                w.set(FP_A, keys[2:4], "disk")

        m.probed = write_now
        got = r.masks(FP_A, keys)
        m.probed = None
        assert landed and r.rechecked == 1
        host, disk = TIER_BITS["host"], TIER_BITS["disk"]
        assert got.tolist() == [host, host, disk, disk, host, host]
        assert (r.masks(FP_A, keys) == got).all() and r.rechecked == 1  # no write: no re-check
    finally:
        r.close()
        w.close()


@needs_c
@pytest.mark.parametrize("batch", [1, 5], ids=["one-key", "batch"])
def test_a_slot_left_mid_update_gives_up_after_the_spin_limit(shm, batch) -> None:
    """A writer stopped between its seq stores (odd seq, odd generation): the compiled probe
    spins on that slot for SPIN_LIMIT_S, then the table is unavailable (the caller asks the daemon)."""
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    r = KeyTableReader(w.path, compiled=True)
    try:
        keys = [bytes([i]) * 16 for i in range(batch)]
        w.set(FP_A, keys, "host")
        slot = w._map.probe(w.tag(FP_A), *keytable.key_words(keys[:1]), checked=False)[0][0]
        w._begin(w._map)
        w._map.seq[slot] += 1  # mid-update, and stays so
        t = time.monotonic()
        with pytest.raises(TableUnavailable, match="mid-update"):
            r.masks(FP_A, keys)
        assert keytable.SPIN_LIMIT_S <= time.monotonic() - t < 5
        w._map.seq[slot] += 1
        w._end(w._map)
        assert r.masks(FP_A, keys).tolist() == [TIER_BITS["host"]] * batch
    finally:
        r.close()
        w.close()


@needs_c
def test_compiled_probe_refuses_what_the_numpy_probe_refuses(shm) -> None:
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    cr, nr = _readers(w.path)
    try:
        w.set(FP_A, [b"k" * 16], "host")
        for bad in ([b"short"], [b"k" * 16, b"x" * 33]):
            for r in (cr, nr):
                with pytest.raises(ValueError, match=r"key \d+ is \d+ bytes; keys are 8 to 32 bytes"):
                    r.masks(FP_A, bad)
        with pytest.raises(TypeError):
            cr.masks(FP_A, [b"k" * 16, "a str key of 16b"])
        assert cr.masks(FP_A, [bytearray(b"k" * 16), memoryview(b"k" * 16)]).tolist() == [TIER_BITS["host"]] * 2
    finally:
        cr.close()
        nr.close()
        w.close()


# -- hostile inputs ----------------------------------------------------------------------------
# Each hostile call must raise a clean exception, never crash: the checks run in a child
# process, so a crash fails the test instead of killing the run.

def _in_child(fn: str) -> None:
    import subprocess
    import sys

    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_probe; test_probe.{fn}()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _raises(f, *args, errors=(TypeError, ValueError, BufferError)) -> None:
    try:
        f(*args)
    except errors:
        return
    raise AssertionError(f"no error for {args!r:.200}")


def hostile_probe_calls() -> None:
    from kvtier.tiers import _probe

    hdr, nslots = keytable.HEADER_BYTES, 16
    table = bytearray(hdr + nslots * keytable.SLOT_BYTES)
    keys = [bytes([i]) * 16 for i in range(3)]
    out = np.zeros(3, dtype=np.uint8)
    good = (table, 60, 1, keys, out, False, 0)
    assert _probe.probe(*good) == 0 and not out.any()

    def probe(**kw):
        a = dict(zip(("table", "shift", "tag", "keys", "out", "checked", "spin"), good, strict=True))
        a.update(kw)
        return _probe.probe(*a.values())

    # a shift whose slots the buffer does not hold (1 to 5: 2**59 and more slots of 40 bytes,
    # a size that wraps to 0 and, unchecked, would let the probe read anywhere)
    for shift in (-1, 0, 1, 2, 3, 4, 5, 6, 59, 64, 65, 1000):
        _raises(lambda s=shift: probe(shift=s))
    for tag in (0, -1, 1 << 16):
        _raises(lambda t=tag: probe(tag=t))
    for bad in (5, None, ["k" * 16], [b"k" * 7], [b"k" * 33], [b"k" * 16, 3], [np.zeros(32, np.uint8)[::2]]):
        _raises(lambda k=bad: probe(keys=k))
    for bad in (np.zeros(2, np.uint8), b"\0" * 3, np.zeros(6, np.uint8)[::2], None):
        _raises(lambda o=bad: probe(out=o))
    for bad in (b"", bytearray(hdr - 1), bytearray(hdr + 40 * 15), "table", None):
        _raises(lambda t=bad: probe(table=t))
        if len(bad or "") < hdr:
            _raises(lambda t=bad: _probe.generation(t))
    assert probe(keys=[bytearray(b"k" * 8), memoryview(b"k" * 32), np.zeros(12, np.uint8)], out=out) == 0
    assert probe(keys=[], out=np.zeros(0, np.uint8)) == 0 and probe(keys=()) == 0
    # a table whose every slot is used by other keys, and one whose every seq stays odd
    full = bytearray(table)
    for s in range(nslots):
        o = hdr + s * 40
        full[o + 4:o + 8] = bytes([1, 0, 16, 2])
        full[o + 8:o + 24] = b"z" * 16
    assert probe(table=full, checked=True, spin=10**6) == 0 and not out.any()
    odd = bytearray(full)
    for s in range(nslots):
        odd[hdr + s * 40] = 1
    assert probe(table=odd, checked=True, spin=10**6) == 1
    assert probe(table=odd, checked=True, spin=2**64 - 1) == 1  # a deadline past 2**64 ns wraps: gives up
    # tally refuses a mask beyond its counters and then counts nothing
    counts = np.zeros(4, dtype=np.uint64)
    _raises(lambda: _probe.tally(np.array([1, 2, 9], np.uint8), counts))
    assert not counts.any(), counts
    _probe.tally(np.array([1, 1, 3], np.uint8), counts)
    assert counts.tolist() == [0, 2, 0, 1]
    _raises(lambda: _probe.tally(b"\1", b"\0" * 16))  # counters not writable
    assert _probe.prefix(b"", 3) == (0, 0) and _probe.prefix(b"\1\4\0", 3) == (1, 2)


@needs_c
def test_hostile_probe_calls_raise_never_crash() -> None:
    _in_child("hostile_probe_calls")


# -- a corrupt table: both probes answer alike and always end ------------------------------------

def _slot_offset(w: KeyTableWriter, key: bytes) -> int:
    slot, _ = w._map.probe(w.tag(FP_A, create=False), *keytable.key_words([key]), checked=False)
    return keytable.HEADER_BYTES + int(slot[0]) * keytable.SLOT_BYTES


@needs_c
@pytest.mark.parametrize("batch", [1, 3])
def test_a_corrupt_table_gives_tier_bits_only_and_every_probe_ends(shm, batch) -> None:
    """A tiers byte with bits beyond the three tiers is read as its tier bits only (it broke
    tier_names and the lookup counters); a table whose every slot is taken (never the
    writer's) answers "not held" from both probes (the numpy probes looped forever); a slot
    with tag 0 is empty to both probes, whatever its length byte says."""
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    keys = [b"key-%04d" % i for i in range(3)]
    w.set(FP_A, keys, "host")
    cr, nr = _readers(w.path)
    try:
        fd = os.open(w.path, os.O_RDWR)
        try:
            off = _slot_offset(w, keys[0])
            os.pwrite(fd, bytes([0x80 | TIER_BITS["host"]]), off + 7)
            for r in (cr, nr):
                got = r.masks(FP_A, keys[:batch])
                assert got.tolist() == [TIER_BITS["host"]] * batch
                assert r.tiers(FP_A, keys[:batch]) == ["host"] * batch
            junk = b"\x00\x00\x00\x00" + b"\xff\xff" + bytes([8, 1]) + b"j" * 32  # seq 0, tag 0xffff, never a match
            for i in range(16):
                os.pwrite(fd, junk, keytable.HEADER_BYTES + i * keytable.SLOT_BYTES)
            probe = [b"absent-%d" % i for i in range(batch)]
            for r in (cr, nr):
                assert r.masks(FP_A, probe).tolist() == [0] * batch
            empty_ish = b"\x00\x00\x00\x00" + b"\x00\x00" + bytes([8, 1]) + b"j" * 32  # tag 0, a length
            for i in range(16):
                os.pwrite(fd, empty_ish, keytable.HEADER_BYTES + i * keytable.SLOT_BYTES)
            assert cr.masks(FP_A, probe).tolist() == nr.masks(FP_A, probe).tolist() == [0] * batch
        finally:
            os.close(fd)
    finally:
        cr.close()
        nr.close()
        w.close()


def test_a_reader_closed_under_a_probe_reports_the_table_unavailable(shm) -> None:
    """The sidecar drops a table (closes its reader) while another thread may be probing it:
    that probe must raise TableUnavailable (the sidecar then asks the daemon), not a
    ValueError (reported as the caller's bad keys) or an AttributeError."""
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    w.set(FP_A, [b"key-0001"], "host")
    try:
        for compiled in ([True, False] if keytable._cprobe is not None else [False]):
            r = KeyTableReader(w.path, compiled=compiled)
            r.close()
            for keys in ([b"key-0001"], [b"key-0001", b"key-0002"]):
                with pytest.raises(TableUnavailable, match="closed"):
                    r.masks(FP_A, keys)
    finally:
        w.close()


def test_a_rebuild_that_cannot_publish_leaves_no_trusted_table(shm, monkeypatch) -> None:
    """The writer grows its table into a new file and renames it into place; when the rename
    fails, the old file stays at the path, never written again: its readers must be told not
    to trust it (they ask the daemon), and the new file must not be left behind."""
    w = KeyTableWriter(os.path.join(shm, "t.keys"), nslots=16)
    w.set(FP_A, [b"key-%04d" % i for i in range(4)], "host")
    r = KeyTableReader(w.path, compiled=False)
    assert r.tiers(FP_A, [b"key-0001"]) == ["host"]

    def no_rename(src, dst):
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(keytable.os, "rename", no_rename)
    with pytest.raises(OSError, match="injected"):
        w.set(FP_A, [b"key-%04d" % i for i in range(4, 64)], "host")    # grows: a rebuild
    monkeypatch.undo()
    with pytest.raises(TableUnavailable):
        r.masks(FP_A, [b"key-0001"])
    assert sorted(os.listdir(shm)) == ["t.keys"]
    r.close()

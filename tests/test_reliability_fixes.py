"""Issue 14, items 6 and 7: the failure cases 0.1 left open, each on real components.

In process (a BlockStore on a real tmpfs HostTier, the daemon's own LocationLog), or against
a real kvtierd over its socket; each test names the promise it guards.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import tracemalloc

import pytest

from kvtier.client.engine.sidecar import Sidecar
from kvtier.daemon.events import LocationLog, event_bytes
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"fixes-14" + i.to_bytes(24, "big")   # 32 bytes: the longest key


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_event_ring_is_bounded_in_bytes(shm) -> None:
    """One-key events weigh about 290 bytes each in the daemon's heap: a ring bounded only by
    its key count (1,048,576 by default) grew the heap by hundreds of MiB. With
    ``event_log_bytes`` the ring's heap stays under its bound, measured with tracemalloc, and
    its accounting equals the events it holds."""
    layout = Layout.flat(BLOCK)

    async def main() -> None:
        store = BlockStore(HostTier(shm, 4 * layout.slot_bytes, "ring"))
        bound = 256 * 1024
        loc = LocationLog(store, "node", epoch=1, max_keys=1 << 20, max_bytes=bound)
        await store.register_layout(layout)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(6000):
                loc.stored(Tier.HOST, layout.fingerprint, [key(i)])
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        held = loc.since(loc.first_seq - 1)
        assert held is not None and loc.first_seq > 1, "nothing was dropped: the ring is not bounded in bytes"
        assert loc._ring_bytes == sum(event_bytes(ev.keys) for ev in held) <= bound
        assert grown < 1.25 * bound, f"the ring took {grown} bytes of heap for a bound of {bound}"
        assert held[-1].keys[0] == key(5999)

    asyncio.run(main())


# -- the sidecar across daemon restarts (real kvtierd subprocesses) ------------------------------

def _mapped(shm_dir: str, suffix: str) -> list[str]:
    """Files of ``shm_dir`` ending in ``suffix`` this process maps ('... (deleted)' once unlinked)."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and shm_dir in line and suffix in line})


def test_a_put_retried_after_a_restart_counts_each_key_once(start_daemon, tmp_path) -> None:
    """The daemon is killed and restarted between a durable put's Allocate and its Commit (a
    real kill -9 at that exact step, through the transport's call seam): the transparent retry
    runs the put again, and its PutResult counts each key once (0.1's sync sidecar counted the
    first attempt's present keys again, so ``durable == len(keys)`` could pass with fewer)."""
    disk = str(tmp_path / "disk")
    d = start_daemon("--disk-dir", disk, "--disk-capacity", "64MiB")
    old, new = [key(i) for i in range(2)], [key(10 + i) for i in range(2)]
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        assert sc.put(lid, old, [bytes([i]) * BLOCK for i in range(2)], durable=True).durable == 2
        transport, seen = sc._transport, []
        unary = transport._unary

        async def kill_before_the_commit(call):
            if call.method == "Commit" and not seen:
                seen.append(call)
                d.kill()        # SIGKILL: its durable blocks survive on disk, nothing else does
                d.start()
            return await unary(call)

        transport._unary = kill_before_the_commit
        r = sc.put(lid, old + new, [bytes([i]) * BLOCK for i in range(4)], durable=True)
        assert seen, "the put never reached its Commit"
        assert (r.stored, r.present, r.dropped, r.durable) == (2, 2, [], 4), r
        assert None not in sc.lookup(lid, old + new)


def test_a_sidecar_maps_one_key_table_across_daemon_kills(start_daemon) -> None:
    """Each kill -9 and restart of the daemon: the sidecar moves to the new daemon's key table
    and unmaps the dead one's (0.1 kept one more mapping per restart)."""
    d = start_daemon()
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, [key(0)], [bytes(BLOCK)])
        assert sc.lookup(lid, [key(0)]) == ["host"]
        assert len(_mapped(d.shm_dir, ".keys")) == 1
        for _ in range(3):
            d.kill()
            d.start()
            assert sc.lookup(lid, [key(0)]) == [None]   # the restarted daemon holds nothing (not durable)
            sc.put(lid, [key(1)], [bytes(BLOCK)])
            assert sc.lookup(lid, [key(1)]) == ["host"]
            now = _mapped(d.shm_dir, ".keys")
            assert len(now) == 1 and "(deleted)" not in now[0], f"dead daemons' key tables still mapped: {now}"

"""The sidecar across kill -9 and restarts of a real kvtierd: a durable put interrupted between
its Allocate and its Commit is retried and counts each key once, and the sidecar keeps one key
table mapped, the live daemon's.
"""

from __future__ import annotations

from kvtier.client.engine.sidecar import Sidecar
from kvtier.tiers.layout import Layout

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return b"restarts" + i.to_bytes(24, "big")   # 32 bytes: the longest key


def _mapped(shm_dir: str, suffix: str) -> list[str]:
    """Files of ``shm_dir`` ending in ``suffix`` this process maps ('... (deleted)' once unlinked)."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and shm_dir in line and suffix in line})


def test_a_put_retried_after_a_restart_counts_each_key_once(start_daemon, tmp_path) -> None:
    """The daemon is killed and restarted between a durable put's Allocate and its Commit (a
    real kill -9 at that exact step, through the transport's call seam): the transparent retry
    runs the put again, and its PutResult counts each key once (counting the first attempt's
    present keys again would let ``durable == len(keys)`` pass with fewer)."""
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
    and unmaps the dead one's: one mapping, however many restarts."""
    d = start_daemon()
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, [key(0)], [bytes(BLOCK)])
        assert sc.lookup(lid, [key(0)]) == ["host"]
        assert len(_mapped(d.shm_dir, ".keys")) == 1
        for _ in range(2):   # two restarts: a mapping kept per restart would show
            d.kill()
            d.start()
            assert sc.lookup(lid, [key(0)]) == [None]   # the restarted daemon holds nothing (not durable)
            sc.put(lid, [key(1)], [bytes(BLOCK)])
            assert sc.lookup(lid, [key(1)]) == ["host"]
            now = _mapped(d.shm_dir, ".keys")
            assert len(now) == 1 and "(deleted)" not in now[0], f"dead daemons' key tables still mapped: {now}"

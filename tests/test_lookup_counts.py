"""Key-table lookups are counted where nothing can lose them: a script of lookups that never
closes, and a killed engine's last second, still show in ``kvtier report``. A local sidecar
counts them in a lookup counters region (a sealed memfd, :mod:`kvtier.tiers.lookup_counts`)
handed to the daemon on its credential connection; the daemon reads it on every Stats, every
second and when the connection closes (exit, kill -9). Each test runs a real kvtierd over its real sockets.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from kvtier.client import Sidecar
from kvtier.handshake import Credentials, HandshakeError
from kvtier.tiers.layout import MAX_BLOCK_TOKENS, Layout

BLOCK = 4096
LAYOUT = Layout.flat(BLOCK)
NOBODY = 65534
U64 = (1 << 64) - 1


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


HELD = [key(i) for i in range(4)]


def counters(sock: str) -> dict[str, int]:
    """The daemon's counters, read through the Stats RPC by a client that reads no table."""
    with Sidecar(sock, use_key_table=False) as rpc:
        return rpc.stats()["counters"]


def looked_up(c: dict[str, int]) -> tuple[int, int]:
    """(host hits, misses) counted for op lookup."""
    return c.get("lookup_hit_blocks:host", 0), c.get("lookup_miss_blocks", 0)


def put_held(sock: str) -> int:
    with Sidecar(sock) as sc:
        lid = sc.register_layout(LAYOUT)
        sc.put(lid, HELD, [bytes(BLOCK)] * len(HELD))
    return lid


# the client scripts: a plain engine process doing N table lookups of one held and one missing key
CLIENT = textwrap.dedent("""
    import os, sys, time
    from kvtier.client import Sidecar
    from kvtier.tiers.layout import Layout
    sock, n, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sc = Sidecar(sock)
    lid = sc.register_layout(Layout.flat(4096))
    held, missing = (0).to_bytes(16, "big"), (99).to_bytes(16, "big")
    for _ in range(n):
        assert sc.lookup(lid, [held, missing]) == ["host", None]
    assert sc._info(lid).table is not None, "the lookups did not read the key table"
    print("done", flush=True)
    if end == "wait":
        time.sleep(600)
    # "exit": no close(), as the README's first example did
""")


def run_client(sock: str, n: int, end: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, sock, str(n), end], stdout=subprocess.PIPE, text=True)


def test_a_script_that_never_closes_has_every_table_lookup_counted(daemon) -> None:
    """12 lookups, no close(), exit: all 12 in Stats and in ``kvtier report`` right away."""
    put_held(daemon.socket)
    before = looked_up(counters(daemon.socket))
    p = run_client(daemon.socket, 12, "exit")
    assert p.communicate(timeout=60)[0].strip() == "done" and p.returncode == 0
    hits, misses = looked_up(counters(daemon.socket))
    assert (hits - before[0], misses - before[1]) == (12, 12)
    out = subprocess.run([sys.executable, "-m", "kvtier.client.tools.report", "--daemons", daemon.socket,
                          "--once", "--json"], capture_output=True, text=True, timeout=60)
    node = json.loads(out.stdout)["nodes"][0]
    assert node["asked_blocks"] == before[0] + before[1] + 24


def test_a_running_clients_lookups_show_in_stats_at_once(daemon) -> None:
    """No waiting for a report: a Stats read folds in what every live client counted."""
    lid = put_held(daemon.socket)
    with Sidecar(daemon.socket) as sc:
        assert sc.register_layout(LAYOUT) == lid
        for i in range(1, 8):
            assert sc.lookup(lid, HELD[:1]) == ["host"]
            assert looked_up(counters(daemon.socket))[0] == i


@pytest.mark.parametrize("n", [1, 37])
def test_a_client_killed_right_after_its_lookups_loses_none(daemon, n: int) -> None:
    put_held(daemon.socket)
    before = looked_up(counters(daemon.socket))
    p = run_client(daemon.socket, n, "wait")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "done"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        hits, misses = looked_up(counters(daemon.socket))
        assert (hits - before[0], misses - before[1]) == (n, n)
        assert looked_up(counters(daemon.socket)) == (hits, misses)  # and counted once
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_close_counts_each_lookup_once(daemon) -> None:
    lid = put_held(daemon.socket)
    with Sidecar(daemon.socket) as sc:
        sc.register_layout(LAYOUT)
        for _ in range(5):
            sc.lookup(lid, HELD + [key(50)])
        assert sc.prefix_length(lid, HELD) == (4, 4)
    assert looked_up(counters(daemon.socket)) == (5 * 4 + 4, 5)  # put_held's sidecar looked up nothing


# -- the region: what the daemon accepts -----------------------------------------------------------

def refusal(creds: Credentials, fd: int) -> str:
    with pytest.raises(HandshakeError) as e:
        creds.lookup_counters(fd)
    assert e.value.code == "INVALID_ARGUMENT"
    return e.value.details


def test_a_region_that_is_not_a_sealed_memfd_of_the_right_size_is_refused(daemon) -> None:
    from kvtier.tiers.lookup_counts import REGION_BYTES, SEALS, CountsWriter

    creds = Credentials(daemon.socket, "probe").connect()
    try:
        assert creds.takes_lookup_counters
        with tempfile.TemporaryFile(dir="/dev/shm") as f:  # a tmpfs file: not a memfd, no seals
            f.truncate(REGION_BYTES)
            assert "sealed" in refusal(creds, f.fileno())
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, REGION_BYTES)
        assert "sealed" in refusal(creds, unsealed)
        fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # can still grow
        assert "sealed" in refusal(creds, unsealed)
        os.close(unsealed)
        small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(small, REGION_BYTES - 8)
        fcntl.fcntl(small, fcntl.F_ADD_SEALS, SEALS)
        assert f"must be {REGION_BYTES}" in refusal(creds, small)
        os.close(small)
        r, w = os.pipe()
        assert "sealed" in refusal(creds, r)
        os.close(r)
        os.close(w)
        headless = CountsWriter()
        headless.rows[0, 0] = 0
        assert "header" in refusal(creds, headless.fd)
        headless.close()
        good = CountsWriter()
        assert creds.lookup_counters(good.fd) == creds.connects  # the connection survived every refusal
        assert "already" in refusal(creds, good.fd)  # one per connection
        good.close()
        assert creds.alive
    finally:
        creds.close()


def test_a_hostile_region_cannot_break_or_overflow_the_counters(daemon) -> None:
    """Values near 2^64, and counters going down, count nothing; Stats keeps answering."""
    from kvtier.tiers.lookup_counts import CountsWriter

    big = Layout.flat(BLOCK, block_tokens=MAX_BLOCK_TOKENS)  # each read may add 2^40 * 2^16 tokens
    with Sidecar(daemon.socket, use_key_table=False) as sc:
        lid = sc.register_layout(big)
        creds = sc._transport.identity.credentials
        w = CountsWriter()
        creds.lookup_counters(w.fd)
        slot = w.claim(lid)
        slot[0] = U64  # misses
        slot[2] = 1 << 63  # host hits
        assert looked_up(sc.stats()["counters"]) == (0, 0)
        slot[2] = 5  # down: nothing
        assert looked_up(sc.stats()["counters"]) == (0, 0)
        slot[2] = 8  # up by 3 from what was last read
        assert looked_up(sc.stats()["counters"]) == (3, 0)
        slot[2] = 8 + (1 << 40)  # the most one read counts
        assert looked_up(sc.stats()["counters"]) == (3 + (1 << 40), 0)
        for i in range(2, 300):  # past 2^64 tokens: Stats saturates instead of failing
            slot[2] = 8 + i * (1 << 40)
            c = sc.stats()["counters"]
        assert c["lookup_hit_blocks:host"] == 3 + (299 << 40)
        assert c["lookup_hit_tokens:host"] == U64  # saturated, not wrapped or failing
        other = w.claim(lid ^ 0x5A5A5A)  # a layout nobody registered: counts nothing
        other[2] = 7
        assert sc.stats()["counters"]["lookup_hit_blocks:host"] == 3 + (299 << 40)
        w.close()


# -- tenants -------------------------------------------------------------------------------------

BOB = textwrap.dedent("""
    import os, sys
    import grpc._channel, grpc._common, grpc._utilities  # loaded while the files are readable
    from kvtier.client import Sidecar
    from kvtier.tiers.layout import Layout
    from kvtier.tiers.lookup_counts import CountsWriter
    sock, alice_lid = sys.argv[1], int(sys.argv[2])
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    sc = Sidecar(sock, use_key_table=False)
    own = sc.register_layout(Layout.flat(4096, name="bob"))
    assert sc.tenant == "bob"
    w = CountsWriter()
    sc._transport.identity.credentials.lookup_counters(w.fd)
    w.claim(own)[2] = 5        # host hits of bob's own layout: counted
    w.claim(alice_lid)[2] = 7  # under a layout only alice registered: counted nowhere
    print(own, flush=True)
    # exits without close(): the daemon reads the region as the connection closes
""")


def test_counts_land_in_the_callers_tenant_only(shared_dir) -> None:
    from kvtier.client.tools.local_daemon import DaemonProcess

    me = os.geteuid()
    if me == NOBODY:
        pytest.skip("needs a uid other than nobody")
    d = DaemonProcess(shared_dir, "--allowed-uids", f"{me},{NOBODY}", "--tenants", f"{me}=alice,{NOBODY}=bob",
                      host_capacity="16MiB")
    try:
        d.start()
        with Sidecar(d.socket) as alice:
            alice_lid = alice.register_layout(Layout.flat(4096, name="alice-only"))
            assert alice.tenant == "alice"
            p = subprocess.run([sys.executable, "-c", BOB, d.socket, str(alice_lid)], capture_output=True,
                               text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            c = alice.stats()["counters"]
            assert c.get("lookup_hit_blocks:host", 0) == 5  # bob's 5; alice's layout got none of bob's 7
    finally:
        d.cleanup()


def test_over_tcp_table_lookups_are_still_reported(start_daemon) -> None:
    """A daemon that takes no region from this client (TCP: no credential connection): the
    sidecar reports its table lookups with ReportLookups, every second and on close."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon("--tcp", f"127.0.0.1:{port}", "--insecure-tcp", "--tcp-services", "all")
    lid = put_held(d.socket)
    with Sidecar(target=f"127.0.0.1:{port}") as sc:
        assert sc.register_layout(LAYOUT) == lid
        for _ in range(6):
            assert sc.lookup(lid, HELD[:2]) == ["host", "host"]
        assert sc._info(lid).table is not None and not sc._info(lid).shared
    assert looked_up(counters(d.socket)) == (12, 0)

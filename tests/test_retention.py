"""Retained prefixes (``Node.Retain``, ``Sidecar.retain``, ``--retention-budget``) against a real
kvtierd over its unix socket: a retained prefix stays in the host tier through pressure that
evicts an unretained prefix of the same size, until its TTL; a key retained before it is stored
is kept once stored; a tenant over its budget releases its least recently retained retentions
of no higher priority, else is refused naming the flag; a tenant retains only its own blocks;
a bad layout or TTL is a clear error. The metrics and Stats show each. docs/eviction.md,
"Retained prefixes"."""

from __future__ import annotations

import math
import os
import time
import urllib.request

import grpc
import numpy as np
import pytest
from _wait import wait_for
from attacks_tenants import NOBODY, NobodyTenant, RemoteRpcError
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Sidecar
from kvtier.client.engine.transport import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import node_pb2
from kvtier.tiers.layout import Layout

KiB = 1024
BLOCK = 128 * KiB        # a whole number of 4 KiB pages: slot bytes == block bytes
HOST = 64 * BLOCK        # the host tier holds 64 blocks
LAYOUT = Layout.flat(BLOCK, name="retention")
TTL_S = 3.0


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(8, "little") + bytes(16 - len(tag) - 8) for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def press(sc: Sidecar, lid: int, tag: bytes, n: int = 80) -> None:
    """Put ``n`` new blocks, 8 a call: more than the whole host tier, so under plain LRU every
    block held before is evicted."""
    data = blocks(8, 1)
    for i in range(0, n, 8):
        assert sc.put(lid, keys_for(8, tag + i.to_bytes(1, "little")), data).stored == 8


def counter(sc: Sidecar, name: str) -> int:
    return sc.stats()["counters"].get(name, 0)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the rule: retained blocks are evicted after every unretained one, until the TTL ------------

def test_a_retained_prefix_stays_in_host_through_pressure_until_its_ttl(start_daemon) -> None:
    d = start_daemon(host_capacity=str(HOST))
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        kept, plain = keys_for(8, b"kept"), keys_for(8, b"plain")
        sc.put(lid, kept, blocks(8, 2))
        sc.put(lid, plain, blocks(8, 3))  # the retained prefix is the older one: LRU evicts it first
        start = time.monotonic()
        r = sc.retain(lid, kept, TTL_S)
        assert (r.retained, r.held, r.released, r.retained_bytes) == (8, 8, 0, 8 * BLOCK)
        assert r.budget_bytes == HOST // 4  # the default: 25 % of --host-capacity
        press(sc, lid, b"p")
        assert sc.lookup(lid, plain) == [None] * 8, "the unretained prefix of the same size was not evicted"
        assert sc.lookup(lid, kept) == ["host"] * 8, "the retained prefix was evicted"
        press(sc, lid, b"q")  # and again: it stays through any amount of pressure within the TTL
        assert sc.lookup(lid, kept) == ["host"] * 8
        assert time.monotonic() - start < TTL_S, "the pressure took longer than the TTL: nothing was shown"
        stats = sc.stats()
        assert stats["retained_bytes"] == 8 * BLOCK and stats["retention_budget_bytes"] == HOST // 4
        assert stats["counters"]["retained_keys"] == 8 and stats["counters"]["retained_evictions"] == 0
        # at its TTL the retention ends (the Stats read takes it) ...
        wait_for(lambda: counter(sc, "retentions_expired") == 8, TTL_S + 10, "the retention to expire")
        assert time.monotonic() - start >= TTL_S
        assert sc.stats()["retained_bytes"] == 0
        assert sc.lookup(lid, kept) == ["host"] * 8  # (expiry evicts nothing by itself)
        # ... and the blocks are ordinary ones again: pressure evicts them
        press(sc, lid, b"s")
        assert sc.lookup(lid, kept) == [None] * 8


def test_a_key_retained_before_it_is_stored_is_kept_once_stored(start_daemon) -> None:
    d = start_daemon(host_capacity=str(HOST))
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        kept, plain = keys_for(8, b"kept"), keys_for(8, b"plain")
        r = sc.retain(lid, kept, 60)  # as a gateway does: the hint comes with the request, before its KV
        assert (r.retained, r.held, r.retained_bytes) == (8, 0, 8 * BLOCK)
        sc.put(lid, kept, blocks(8, 2))
        sc.put(lid, plain, blocks(8, 3))
        press(sc, lid, b"p")
        assert sc.lookup(lid, plain) == [None] * 8
        assert sc.lookup(lid, kept) == ["host"] * 8
        # an Evict removes the block, not the retention: stored again, it is kept again
        assert sc.evict(lid, kept) == 8
        sc.put(lid, kept, blocks(8, 2))
        press(sc, lid, b"q")
        assert sc.lookup(lid, kept) == ["host"] * 8


# -- the budget -------------------------------------------------------------------------------

def test_over_the_budget_the_least_recently_retained_go_first_else_refused(start_daemon) -> None:
    port = free_port()
    d = start_daemon("--retention-budget", str(8 * BLOCK), "--metrics-port", str(port), host_capacity=str(HOST))
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        a, b, c, e = (keys_for(4, t) for t in (b"a", b"b", b"c", b"e"))
        for i, ks in enumerate((a, b, c, e)):
            sc.put(lid, ks, blocks(4, i))
        assert sc.retain(lid, a, 60).released == 0
        r = sc.retain(lid, b, 60)
        assert (r.released, r.retained_bytes, r.budget_bytes) == (0, 8 * BLOCK, 8 * BLOCK)
        # the budget is full: c releases a, the least recently retained
        r = sc.retain(lid, c, 60)
        assert (r.released, r.retained_bytes) == (4, 8 * BLOCK)
        assert counter(sc, "retentions_released") == 4
        # retaining b again renews it (no room needed), so c is now the least recently retained
        assert sc.retain(lid, b, 60).released == 0
        # a retain of lower priority than every retention it would have to release is refused,
        # naming the flag, and changes nothing
        with pytest.raises(ResourceExhausted, match="--retention-budget"):
            sc.retain(lid, e, 60, priority=-1)
        # so is one larger than the whole budget
        with pytest.raises(ResourceExhausted, match="--retention-budget"):
            sc.retain(lid, keys_for(9, b"big"), 60)
        assert sc.stats()["retained_bytes"] == 8 * BLOCK
        assert counter(sc, "retains_refused") == 2
        # pressure: a (released) is evicted, b and c are kept
        press(sc, lid, b"p")
        assert sc.lookup(lid, a) == [None] * 4
        assert sc.lookup(lid, b) == ["host"] * 4 and sc.lookup(lid, c) == ["host"] * 4
        # a higher priority releases the lowest priority, least recently retained first: c
        sc.put(lid, e, blocks(4, 5))
        r = sc.retain(lid, e, 60, priority=5)
        assert (r.released, r.retained_bytes) == (4, 8 * BLOCK)
        press(sc, lid, b"q")
        assert sc.lookup(lid, c) == [None] * 4
        assert sc.lookup(lid, b) == ["host"] * 4 and sc.lookup(lid, e) == ["host"] * 4
        metrics = scrape(port)
        assert metrics["kvtier_retained_bytes"] == 8 * BLOCK
        assert metrics["kvtier_retentions_released_total"] == 8
        assert metrics["kvtier_retains_refused_total"] == 2
        assert metrics["kvtier_retained_keys_total"] == 20  # a, b, c, b again, e


def test_retention_budget_0_turns_retention_off(start_daemon) -> None:
    d = start_daemon("--retention-budget", "0", host_capacity=str(HOST))
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        with pytest.raises(ResourceExhausted, match="--retention-budget 0"):
            sc.retain(lid, keys_for(1, b"a"), 60)
        assert sc.stats()["retention_budget_bytes"] == 0
        assert counter(sc, "retains_refused") == 1


# -- tenants ----------------------------------------------------------------------------------

def test_a_tenant_retains_only_its_own_blocks(shared_dir) -> None:
    """bob (a child running as nobody) names alice's layout id and keys: without his own layout
    the id is unknown to him; with it, his retention is of his own blocks, and alice's are
    evicted by her pressure as if he had retained nothing."""
    me = os.geteuid()
    d = DaemonProcess(shared_dir, "--allowed-uids", f"{me},{NOBODY}", "--tenants", f"{me}=alice,{NOBODY}=bob",
                      host_capacity=str(HOST)).start()
    bob = None
    try:
        with Sidecar(d.socket, use_key_table=False) as alice:
            lid = alice.register_layout(LAYOUT)
            hers = keys_for(8, b"hers")
            alice.put(lid, hers, blocks(8, 2))
            bob = NobodyTenant(d.socket)
            ask = node_pb2.RetainRequest(layout_id=lid, keys=hers, ttl_s=60)
            with pytest.raises(RemoteRpcError) as e:
                bob.rpc("node", "Retain", ask)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not registered" in e.value.details()
            assert bob.register(LAYOUT).layout_id == lid  # the same layout: the same id, his own blocks
            reply = bob.rpc("node", "Retain", ask)
            assert (reply.retained, reply.held, reply.retained_bytes) == (8, 0, 8 * BLOCK)
            assert bob.rpc("node", "Stats", node_pb2.StatsRequest()).retained_bytes == 8 * BLOCK  # his own
            press(alice, lid, b"p")
            assert alice.lookup(lid, hers) == [None] * 8, "bob's retain kept alice's blocks"
            # alice's own retain does keep hers
            alice.put(lid, hers, blocks(8, 2))
            assert alice.retain(lid, hers, 60).held == 8
            press(alice, lid, b"q")
            assert alice.lookup(lid, hers) == ["host"] * 8
    finally:
        if bob is not None:
            bob.close()
        d.cleanup()


# -- bad requests -----------------------------------------------------------------------------

def test_an_unknown_layout_or_a_bad_ttl_is_a_clear_error(daemon) -> None:
    with Sidecar(daemon.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        key = keys_for(1, b"a")
        with pytest.raises(grpc.RpcError) as e:
            sc._stub.Retain(node_pb2.RetainRequest(layout_id=lid ^ 1, keys=key, ttl_s=60))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is not registered on this daemon" in e.value.details()
        for ttl in (0.0, -1.0, math.nan, math.inf, 86400.5):
            with pytest.raises(grpc.RpcError) as e:
                sc._stub.Retain(node_pb2.RetainRequest(layout_id=lid, keys=key, ttl_s=ttl))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ttl
            assert "ttl_s" in e.value.details() and "86400" in e.value.details(), e.value.details()
        with pytest.raises(InvalidArgument, match="ttl_s"):
            sc.retain(lid, key, 0)
        with pytest.raises(FailedPrecondition, match="register_layout"):
            sc.retain(lid ^ 1, key, 60)
        assert sc.stats()["retained_bytes"] == 0  # nothing of it was retained
        assert sc.retain(lid, key, 86400).retained == 1


# -- the rules, in process (a clock of our own) -------------------------------------------------

def test_the_rules_of_retention_in_process() -> None:
    from collections import OrderedDict

    from kvtier.daemon.errors import StoreError
    from kvtier.daemon.retention import Retention

    now = [0.0]
    counted: list[tuple[str, str, int]] = []
    r = Retention(400, lambda tenant, what, n: counted.append((tenant, what.value, n)), clock=lambda: now[0])
    k = [bytes([i]) * 16 for i in range(6)]
    x, y = b"x" * 16, b"y" * 16
    assert r.retain("a", k[:2], 100, 10) == (0, 200)
    assert r.retain("a", k[2:4], 100, 5, priority=1) == (0, 400)
    assert r.retain("a", k[:1], 100, 1) == (0, 400)  # renewed: the later expiry stands
    assert r.keys[k[0]].expires == 10
    # the eviction order: every unretained key first, then the retained ones, lowest priority
    # first, then the soonest to expire (ties: in the tier's order); those passed over move to
    # the recent end after
    order = OrderedDict.fromkeys([k[3], k[0], x, k[1], k[2], y])
    last = r.victims(iter(order))
    assert last is not None
    assert list(last) == [x, y, k[0], k[1], k[3], k[2]]
    last.settle(order, {x, y, k[0], k[1], k[2], k[3]})
    assert list(order) == [x, y, k[3], k[0], k[1], k[2]]
    # full budget: a retain of priority 0 releases the least recently retained of priority 0
    # (k[1]: k[0] was renewed after it), never those of priority 1
    assert r.retain("a", k[4:5], 100, 10) == (1, 400)
    assert k[1] not in r.keys and ("a", "retentions_released", 1) in counted
    # another tenant has a budget of its own
    assert r.retain("b", k[5:6], 100, 10) == (0, 100)
    # nothing of priority <= -1 to release: refused, nothing changed
    with pytest.raises(StoreError, match="--retention-budget"):
        r.retain("a", [x], 100, 10, priority=-1)
    assert x not in r.keys and r.bytes_of == {"a": 400, "b": 100}
    # expiry, counted per tenant; the gauge follows
    now[0] = 5.0
    assert r.expire() == 2 and ("a", "retentions_expired", 2) in counted
    assert r.bytes_of == {"a": 200, "b": 100}
    now[0] = 10.0
    assert r.expire() == 3 and not r.keys and r.total_bytes == 0
    assert r.victims(iter(order)) is None  # nothing retained: the tier's order as it is

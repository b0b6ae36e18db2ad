"""Bad input to a real kvtierd (subprocess, unix socket): a clear status, nothing changed, the
daemon keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvtier.client.engine.sidecar import KvtierError, Sidecar
from kvtier.proto import node_pb2
from kvtier.tiers.layout import Layout

BLOCK = 64 * 1024


def test_release_naming_a_lease_twice_is_refused_and_releases_nothing(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        key = b"dupleasekey00001"
        block = np.random.default_rng(1).bytes(BLOCK)
        sc.put(lid, [key], [block])
        sid = sc._ensure_session()
        daemon_lid = sc._layouts[lid].daemon_id
        lease = sc._stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=daemon_lid, keys=[key])).leases[0]
        assert lease.lease_id
        with pytest.raises(grpc.RpcError) as e:
            sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=[lease.lease_id, lease.lease_id]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in e.value.details()
        # nothing was released: the lease is still held, and releasing it once works
        sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=[lease.lease_id]))
        with pytest.raises(grpc.RpcError) as e:
            sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=[lease.lease_id]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [bytes(g) for g in sc.get(lid, [key])] == [block]
        assert "errors:INTERNAL" not in sc.stats()["counters"]
    assert daemon.proc.poll() is None


def test_a_refused_request_does_not_end_the_session_other_threads_use(daemon) -> None:
    """One thread's put is refused FAILED_PRECONDITION (durable without a disk tier) while
    another thread of the same Sidecar holds a grant (mid-put) and a lease (mid-copy): the
    refusal must not be taken for a daemon restart, which drops the session and with it
    the other thread's grant and pin (its slot could then be reused under its copy)."""
    with Sidecar(daemon.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        held, pending = b"heldkey000000001", b"pendingkey000001"
        block = np.random.default_rng(2).bytes(BLOCK)
        sc.put(lid, [held], [block])
        sid = sc._ensure_session()
        dlid = sc._layouts[lid].daemon_id
        # "another thread": a lease being copied out, and a grant being written
        lease = sc._stub.Acquire(node_pb2.AcquireRequest(session_id=sid, layout_id=dlid, keys=[held])).leases[0]
        grant = sc._stub.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=dlid, keys=[pending])).grants[0]
        assert lease.lease_id and grant.grant_id
        with pytest.raises(KvtierError) as e:
            sc.put(lid, [b"refusedkey000001"], [block], durable=True)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--disk-dir" in e.value.details
        assert sc.session_id == sid
        counters = sc.stats()["counters"]
        assert counters.get("leases_reclaimed", 0) == 0 and counters.get("grants_reclaimed", 0) == 0
        # the other thread finishes its work in the same session
        sc._layouts[lid].pool.arr[grant.offset:grant.offset + BLOCK] = np.frombuffer(block, np.uint8)
        assert sc._stub.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=[grant.grant_id])).committed == 1
        sc._stub.Release(node_pb2.ReleaseRequest(session_id=sid, lease_ids=[lease.lease_id]))
        assert [bytes(g) for g in sc.get(lid, [held, pending])] == [block, block]

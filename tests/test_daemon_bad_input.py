"""Bad input to a real kvtierd (subprocess, unix socket): a clear status, nothing changed, the
daemon keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvtier.client.sidecar import Sidecar
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

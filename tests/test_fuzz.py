"""Fuzzing every RPC of Node, Transfer and Locations, and the raw sockets.

Property-based (hypothesis), against one real kvtierd per module: sequences of calls from two
callers (two credential handshakes), each call a method of the three services with a message
whose fields are drawn from the descriptor: random or extreme values, and ids the daemon
handed out earlier (sessions, grants, leases, layouts, registrations), so valid ids are used
out of order, after release and across sessions and callers. Also garbage frames on the raw
gRPC unix socket and on the credential socket.

Properties: the daemon never dies; every error is a proper status code (never UNKNOWN,
INTERNAL, UNIMPLEMENTED or UNAVAILABLE); afterwards it answers health checks and its
accounting is exact (each tier's used bytes equal its blocks times the slot size once every
fuzzing session is closed).

``KVTIER_FUZZ_CASES`` sets the number of cases in all (a third to each property; CI default
120, about 10 s); a full run is ``KVTIER_FUZZ_CASES=10000``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.client.engine.transport import open_channel
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.proto import (
    locations_pb2,
    locations_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

CASES = int(os.environ.get("KVTIER_FUZZ_CASES", "120"))  # in all, shared by the three properties below
PER_PROPERTY = max(1, -(-CASES // 3))
PROPER = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DEADLINE_EXCEEDED,
          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS,
          grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
SERVICES = [(node_pb2, node_pb2_grpc.NodeStub), (transfer_pb2, transfer_pb2_grpc.TransferStub),
            (locations_pb2, locations_pb2_grpc.LocationsStub)]
METHODS = [(mod, stub, m) for mod, stub in SERVICES for s in mod.DESCRIPTOR.services_by_name.values()
           for m in s.methods]
INT_RANGES = {F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
              F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
              F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1),
              F.TYPE_SFIXED64: (-(2**63), 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1)}
SETTINGS = settings(max_examples=PER_PROPERTY, deadline=None, derandomize=False, database=None,
                    suppress_health_check=list(HealthCheck))


class Fuzzed:
    """The daemon under fuzz, two callers' channels, and the ids it has handed out."""

    def __init__(self) -> None:
        self.work = tempfile.mkdtemp(prefix="kvtier-fuzz-")
        self.daemon = DaemonProcess(self.work, "--transfer-wait-s", "1", "--grant-ttl-s", "5", "--lease-ttl-s", "5",
                                    "--max-batch-keys", "64", host_capacity="16MiB").start()
        self.channels = [open_channel(f"unix:{self.daemon.socket}", client_name=f"fuzz-{i}") for i in range(2)]
        self.ids: list[int] = [1, 2]
        self.keys: list[bytes] = [b"k" * 16, b"\x00" * 8, b"\xff" * 32]
        self.calls = 0
        self.codes: dict[str, int] = {}

    def learn(self, msg: Any) -> None:
        """Remember every id and key of a reply (used again in later calls)."""
        for fd, value in msg.ListFields():
            if fd.type == F.TYPE_MESSAGE:
                if fd.message_type.GetOptions().map_entry:
                    continue
                for v in (value if fd.is_repeated else [value]):
                    self.learn(v)
            elif fd.name.endswith("_id") and fd.type in INT_RANGES:
                for v in (value if fd.is_repeated else [value]):
                    if v and v not in self.ids:
                        self.ids.append(v)
        del self.ids[:-64]

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
            ch.kvtier_credentials.close()
        self.daemon.cleanup()
        shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture(scope="module")
def fz() -> Iterator[Fuzzed]:
    f = Fuzzed()
    yield f
    f.close()


def field_value(data: st.DataObject, fd: Any, fz: Fuzzed, depth: int) -> Any:
    t = fd.type
    if t in INT_RANGES:
        lo, hi = INT_RANGES[t]
        extremes = [v for v in (0, 1, -1, 2, 255, 256, 4096, 65536, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, -(2**63))
                    if lo <= v <= hi]
        how, i = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 63))  # draws never depend on the pool
        pool = [v for v in fz.ids if lo <= v <= hi] or extremes
        if how == 0:
            return pool[i % len(pool)]
        return extremes[i % len(extremes)] if how == 1 else data.draw(st.integers(lo, hi))
    if t == F.TYPE_BOOL:
        return data.draw(st.booleans())
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32 if t == F.TYPE_FLOAT else 64))
    if t == F.TYPE_STRING:
        return data.draw(st.one_of(st.text(max_size=40), st.sampled_from(["", "/etc/passwd", "../x", "a" * 300,
                                                                          "kvtier", "\x00"])))
    if t == F.TYPE_BYTES:
        i = data.draw(st.integers(0, 63))
        return fz.keys[i % len(fz.keys)] if data.draw(st.booleans()) else data.draw(st.binary(max_size=48))
    if t == F.TYPE_ENUM:
        return data.draw(st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), st.integers(-3, 40)))
    raise AssertionError(t)


def fill(data: st.DataObject, msg: Any, fz: Fuzzed, depth: int = 0) -> Any:
    """Set a random subset of ``msg``'s fields to drawn values (nested messages to depth 3)."""
    for fd in msg.DESCRIPTOR.fields:
        if not data.draw(st.booleans()):
            continue
        if fd.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            if fd.is_repeated:
                if fd.message_type.GetOptions().map_entry:
                    continue
                for _ in range(data.draw(st.integers(0, 3))):
                    fill(data, getattr(msg, fd.name).add(), fz, depth + 1)
            else:
                fill(data, getattr(msg, fd.name), fz, depth + 1)
                getattr(msg, fd.name).SetInParent()
        elif fd.is_repeated:
            n = data.draw(st.integers(0, 5))
            getattr(msg, fd.name).extend(field_value(data, fd, fz, depth) for _ in range(n))
        else:
            setattr(msg, fd.name, field_value(data, fd, fz, depth))
    return msg


def proper(fz: Fuzzed, e: grpc.RpcError, what: str) -> None:
    code = e.code()
    fz.codes[code.name] = fz.codes.get(code.name, 0) + 1
    assert code in PROPER, f"{what}: {code.name}: {e.details()}"
    assert fz.daemon.proc is not None and fz.daemon.proc.poll() is None, f"the daemon died on {what}"


def call(fz: Fuzzed, data: st.DataObject) -> None:
    mod, stub_cls, m = data.draw(st.sampled_from(METHODS))
    ch = fz.channels[data.draw(st.integers(0, 1))]
    req_cls = getattr(mod, m.input_type.name, None) or _message_class(m.input_type)
    req = fill(data, req_cls(), fz)
    rpc = getattr(stub_cls(ch), m.name)
    fz.calls += 1
    try:
        if m.client_streaming:
            msgs = [fill(data, req_cls(), fz) for _ in range(data.draw(st.integers(0, 2)))]
            stream = rpc(iter([req, *msgs]), timeout=1)
            _read(fz, stream, 1)
        elif m.server_streaming:  # NodeInfo and a snapshot (or the first events) come at once
            _read(fz, rpc(req, timeout=1), data.draw(st.integers(1, 2)))
        else:
            fz.learn(rpc(req, timeout=3))
    except grpc.RpcError as e:
        proper(fz, e, f"{m.full_name}({req})")


def _read(fz: Fuzzed, stream: Any, n: int) -> None:
    try:
        for i, reply in enumerate(stream):
            fz.learn(reply)
            if i + 1 >= n:
                break
    finally:
        stream.cancel()


def _message_class(desc: Any) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


@SETTINGS
@given(data=st.data())
def test_random_calls_get_proper_status_codes(fz: Fuzzed, data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 6))):
        call(fz, data)


@SETTINGS
@given(data=st.data())
def test_a_valid_put_then_random_calls_on_its_ids(fz: Fuzzed, data: st.DataObject) -> None:
    """A session, a layout, a grant and a lease made the proper way; then random calls that
    reuse them (out of order, after commit or release, from the other caller)."""
    ch = fz.channels[data.draw(st.integers(0, 1))]
    node = node_pb2_grpc.NodeStub(ch)
    hello = node_pb2.SessionClientMessage(hello=node_pb2.SessionHello(client_name="fuzz"))
    done = threading.Event()

    def requests() -> Iterator[Any]:
        yield hello
        done.wait(10)

    session = node.Session(requests(), timeout=30)
    try:
        sid = next(session).opened.session_id
        spec = node_pb2.LayoutSpec(block_tokens=16)
        spec.tensors.add(name="kv", dtype="uint8", shape=[1, 4096], block_dim=0)
        lid = node.RegisterLayout(node_pb2.RegisterLayoutRequest(layout=spec), timeout=5).layout_id
        key = fz.keys[0] if data.draw(st.booleans()) else os.urandom(16)
        fz.keys.append(key)
        del fz.keys[3:-16]
        grants = node.Allocate(node_pb2.AllocateRequest(session_id=sid, layout_id=lid, keys=[key]), timeout=5)
        fz.learn(grants)
        ids = [g.grant_id for g in grants.grants if g.grant_id]
        if data.draw(st.booleans()) and ids:
            node.Commit(node_pb2.CommitRequest(session_id=sid, grant_ids=ids), timeout=5)
        fz.ids.extend([sid, lid])
        for _ in range(data.draw(st.integers(1, 5))):
            call(fz, data)
    except grpc.RpcError as e:
        proper(fz, e, "the valid sequence")
    finally:
        done.set()
        session.cancel()


@SETTINGS
@given(garbage=st.binary(max_size=512), preface=st.booleans(), target=st.sampled_from(["grpc", "auth"]))
def test_garbage_frames_on_the_raw_sockets(fz: Fuzzed, garbage: bytes, preface: bool, target: str) -> None:
    path = fz.daemon.socket if target == "grpc" else fz.daemon.socket + ".auth"
    if preface and target == "grpc":
        garbage = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + garbage
    elif preface:
        garbage = json.dumps({"op": "open", "path": garbage.decode("latin-1")}).encode() + b"\n" + garbage
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(path)
        try:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the daemon closed it: fine
    assert fz.daemon.proc is not None and fz.daemon.proc.poll() is None


def test_zz_the_daemon_is_healthy_and_its_accounting_exact_afterwards(fz: Fuzzed) -> None:
    from kvtier.client import Sidecar

    with grpc.insecure_channel(f"unix:{fz.daemon.socket}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 15
    with Sidecar(fz.daemon.socket) as sc:
        while True:  # fuzzing sessions are closed; what they held is given back
            st_ = sc.stats()
            host = st_["tiers"]["host"]
            slot = {lay["block_bytes"] for lay in st_["layouts"] if lay["host_blocks"]}
            used = sum(-(-b // 4096) * 4096 * lay["host_blocks"] for lay in st_["layouts"]
                       for b in [lay["block_bytes"]])
            if host["used_bytes"] == used and st_["sessions"] <= 1:
                break
            assert time.monotonic() < deadline, (host, st_["layouts"], st_["sessions"], slot)
            time.sleep(0.2)
    assert fz.daemon.proc.poll() is None
    print(f"fuzz: {3 * PER_PROPERTY} cases, {fz.calls} calls, codes {fz.codes}")

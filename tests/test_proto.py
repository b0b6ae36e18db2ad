"""The committed stubs are what the pinned grpcio-tools generates from the .proto files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs the dev extra (grpcio-tools)")
def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True)
    fresh = sorted((tmp_path / "kvtier" / "v1").glob("*_pb2*.py*"))
    assert fresh, "gen_proto.py wrote nothing"
    committed_dir = ROOT / "proto" / "kvtier" / "v1"
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is not committed: run python scripts/gen_proto.py"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale: run python scripts/gen_proto.py"
    names = {p.name for p in fresh}
    extra = [p.name for p in committed_dir.glob("*_pb2*.py*") if p.name not in names]
    assert not extra, f"stubs without a .proto: {extra}"


def test_services_import() -> None:
    from kvtier.proto import node_pb2, node_pb2_grpc

    assert node_pb2.DESCRIPTOR.services_by_name["Node"].full_name == "kvtier.v1.Node"
    assert hasattr(node_pb2_grpc, "NodeStub")

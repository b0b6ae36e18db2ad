"""Generate the Python stubs for every .proto under proto/kvtier/v1.

    python scripts/gen_proto.py            # write the stubs next to the .proto files
    python scripts/gen_proto.py --out DIR  # write them under DIR instead (the staleness test)

protoc writes ``from kvtier.v1 import x_pb2``; the stubs live in the package
``kvtier.proto.kvtier.v1``, so those imports are rewritten. Use the pinned
grpcio-tools (pyproject's dev extra) so the output is reproducible.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "kvtier" / "v1"


def generate(out_root: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # dev extra

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted((out_root / "kvtier" / "v1").glob("*_pb2*.py*"))
    for path in written:
        text = path.read_text()
        text = re.sub(r"^from kvtier\.v1 import", "from kvtier.proto.kvtier.v1 import", text, flags=re.M)
        path.write_text(text)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: proto/)")
    ns = ap.parse_args()
    for path in generate(ns.out):
        print(path.relative_to(ns.out) if path.is_relative_to(ns.out) else path, file=sys.stderr)


if __name__ == "__main__":
    main()

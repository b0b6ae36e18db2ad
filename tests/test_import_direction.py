"""The direction of imports between kvtier's parts (docs/DESIGN.md, "Parts"):

* ``kvtier.tiers`` imports neither ``kvtier.daemon`` nor ``kvtier.client``;
* ``kvtier.daemon`` never imports ``kvtier.client``;
* among daemon modules only the service layer (``daemon/services/``) imports ``kvtier.proto``:
  the domain (store, placement, location log, key table, metrics) never sees the wire format.

Read from the source with ``ast``, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"tiers": "kvtier.tiers", "daemon": "kvtier.daemon", "client": "kvtier.client", "kvtier": "kvtier"}
SERVICE_LAYER = "kvtier.daemon.services"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    pkg = PARTS[rel.parts[0]]
    rest = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([pkg, *rest])


def imports_of(path: Path) -> set[str]:
    """Every absolute module a file imports (``from a.b import c`` gives a.b and a.b.c)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def sources(part: str) -> list[Path]:
    return sorted((ROOT / part).rglob("*.py"))


def violations(part: str, allowed: callable) -> list[str]:
    bad = []
    for path in sources(part):
        mod = module_name(path)
        for imp in sorted(imports_of(path)):
            why = allowed(mod, imp)
            if why:
                bad.append(f"{path.relative_to(ROOT)}: imports {imp} ({why})")
    return bad


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def tiers_rule(mod: str, imp: str) -> str | None:
    for other in ("kvtier.daemon", "kvtier.client"):
        if _under(imp, other):
            return f"tiers must not import {other}"
    return None


def daemon_rule(mod: str, imp: str) -> str | None:
    if _under(imp, "kvtier.client"):
        return "daemon must not import kvtier.client"
    if _under(imp, "kvtier.proto") and not _under(mod, SERVICE_LAYER):
        return f"only the service layer ({SERVICE_LAYER}) converts to and from protobuf"
    return None


@pytest.mark.parametrize("part, rule", [("tiers", tiers_rule), ("daemon", daemon_rule)])
def test_imports_point_one_way(part: str, rule) -> None:
    assert sources(part), f"no sources found under {part}/"
    assert violations(part, rule) == []


def test_the_rules_catch_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself fails on each kind of wrong import (so a green run means something)."""
    cases = {
        "from kvtier.daemon.store import BlockStore\n": tiers_rule,
        "import kvtier.client.engine.sidecar\n": tiers_rule,
        "def f():\n    from kvtier.client import Sidecar\n": daemon_rule,
        "from kvtier.proto import node_pb2\n": daemon_rule,
    }
    for src, rule in cases.items():
        f = tmp_path / "m.py"
        f.write_text(src)
        imps = imports_of(f)
        assert any(rule("kvtier.daemon.store", imp) for imp in imps), src
    # and the service layer may import the wire format
    assert daemon_rule(f"{SERVICE_LAYER}.node", "kvtier.proto") is None

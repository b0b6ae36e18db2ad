"""Who may import what, as the daemon's layering promises: tiers/ imports neither daemon nor
client, daemon/ never imports client, and among daemon modules only the service layer
(``daemon/services/``: the servicers, the wire conversions and their registration) imports
``kvtier.proto``; the domain (store, placement, gpu tier, event log, key table, transfers,
metrics, stats, wiring) never deals with the wire format."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def offenders(folder: str, forbidden: tuple[str, ...], skip: str | None = None) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if skip and rel.startswith(skip):
            continue
        bad = sorted(m for m in imports(path) if m.startswith(forbidden))
        if bad:
            found.append(f"{rel}: {', '.join(bad)}")
    return found


def test_tiers_import_neither_daemon_nor_client() -> None:
    assert offenders("tiers", ("kvtier.daemon", "kvtier.client")) == []


def test_daemon_never_imports_client() -> None:
    assert offenders("daemon", ("kvtier.client",)) == []


def test_only_the_service_layer_imports_the_wire_format() -> None:
    assert offenders("daemon", ("kvtier.proto",), skip="daemon/services/") == []
    assert offenders("daemon/services", ("kvtier.proto",)), "the service layer is where the wire format lives"

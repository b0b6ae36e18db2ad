"""README.md's code blocks work as written.

Python blocks (```python) run in README order in one namespace, as a reader pasting them into
one session would, against a real kvtierd (:class:`DaemonProcess`; ``KVTIER_SOCKET`` points at
it, so ``Sidecar()``, ``KVConnector()`` and ``socket_path()`` find it) and a real ``kvtier
route-server`` following it. Each top-level statement runs on its own; just before one uses a
name that nothing defined, the PREAMBLE supplies it:

    token_ids        64 token ids: 4 blocks of 16
    payloads         a zero block of ``layout.block_bytes`` for each key after the first two
                     (the README puts ``keys[2:]``)
    kv_tensors       CPU stand-in KV tensors (``SharedKVArena``) for ``layout`` cut to 16 blocks,
                     and ``layout`` rebound to that cut: the README's layout is 8 GiB of KV. The
                     fingerprint is the same (the number of blocks is not part of it).
    block_ids        the first ``len(keys)`` engine blocks; other_block_ids: the next ``len(keys)``
    stream           None (the CPU stand-in has no streams; ``wait_on`` waits for the copy)

The socket path the README's examples name, ``/run/kvtier/kvtierd.sock``, is replaced by the
test daemon's, and the route-server's default address, ``127.0.0.1:7071``, by the test
server's (it listens on a free port). Python blocks that import vLLM or SGLang (or kvtier's
integrations of them) are skipped: they need those engines (tests/test_vllm_engine.py runs
vLLM's).

Shell blocks: every ``kvtier ...`` and ``kvtierd ...`` command in them is parsed by the
command's own parser (a typo'd flag or a bad value fails here); ``kvtier stats`` runs against
the test daemon (its socket for the README's); ``kvtier replay``'s trace must exist.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.proto import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# blocks that import vLLM or SGLang, or kvtier's integrations of them (Layout.vllm is not one)
SKIP = re.compile(r"^\s*(?:from|import)\s+(?:vllm|sglang|openai)\b|kvtier\.client\.(?:vllm|sglang)|^\s*(?:vllm|python -m sglang)",
                  re.MULTILINE)
ROUTER_DEFAULT = "127.0.0.1:7071"
README_SOCKET = "/run/kvtier/kvtierd.sock"


def blocks(kind: str) -> list[tuple[int, str]]:
    """(first line number, text) of README's fenced blocks: ``python``, or ``shell`` (no
    language, sh, bash, shell, console)."""
    out, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m[1].lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        text = "\n".join(lines[start:i])
        i += 1
        if (kind == "python" and lang == "python") or (kind == "shell" and lang in ("", "sh", "bash", "shell",
                                                                                   "console")):
            out.append((start + 1, text))
    return out


# -- the preamble --------------------------------------------------------------------------------

def _shrunk(layout: Any, blocks: int = 16) -> Any:
    from kvtier.tiers.layout import Layout

    tensors = tuple(dataclasses.replace(t, shape=(*t.shape[:t.block_dim], blocks, *t.shape[t.block_dim + 1:]))
                    for t in layout.tensors)
    return Layout(tensors, layout.block_tokens, layout.tp_rank, layout.tp_size)


class _LazyBlocks(Sequence):
    """``payloads``: made on first use, from the ``layout`` and ``keys`` defined by then (a
    block may define them in the same ``with`` statement that uses ``payloads``)."""

    def __init__(self, ns: dict) -> None:
        self.ns = ns

    def _blocks(self) -> list[bytes]:
        return [bytes(self.ns["layout"].block_bytes)] * len(self.ns["keys"][2:])

    def __len__(self) -> int:
        return len(self._blocks())

    def __getitem__(self, i):  # type: ignore[override]
        return self._blocks()[i]


class Preamble:
    """The names README blocks assume (module docstring); what it made, closed at the end."""

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir
        self.arenas: list[Any] = []
        self.make: dict[str, Callable[[dict], Any]] = {
            "token_ids": lambda ns: list(range(4 * 16)),
            "payloads": lambda ns: _LazyBlocks(ns),
            "kv_tensors": self._kv_tensors,
            "block_ids": lambda ns: list(range(len(ns["keys"]))),
            "other_block_ids": lambda ns: list(range(len(ns["keys"]), 2 * len(ns["keys"]))),
            "stream": lambda ns: None,
        }

    def _kv_tensors(self, ns: dict) -> list[Any]:
        pytest.importorskip("torch")
        from kvtier.client.engine import SharedKVArena

        ns["layout"] = small = _shrunk(ns["layout"])
        arena = SharedKVArena(small, self.shm_dir)
        self.arenas.append(arena)
        return arena.tensors

    def close(self) -> None:
        for a in self.arenas:
            a.close()


def used_names(stmt: ast.stmt) -> set[str]:
    """Names ``stmt`` reads without binding them anywhere in itself."""
    loads, stores = set(), set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
        elif isinstance(node, ast.arg):
            stores.add(node.arg)
    return loads - stores


def run_block(where: str, text: str, ns: dict, pre: Preamble, router_address: str, socket: str) -> None:
    tree = ast.parse(text.replace(ROUTER_DEFAULT, router_address).replace(README_SOCKET, socket), filename=where)
    for stmt in tree.body:
        for name in sorted(used_names(stmt)):
            if name in ns or hasattr(builtins, name):
                continue
            if name not in pre.make:
                raise AssertionError(f"{where}, line {stmt.lineno}: uses {name!r}, which no earlier block "
                                     f"defines; define it in the README or add it to this test's preamble")
            ns[name] = pre.make[name](ns)
        code = compile(ast.Module([stmt], type_ignores=[]), f"{where}:{stmt.lineno}", "exec")
        exec(code, ns)  # noqa: S102 - the README's own code, the point of this test


# -- the environment: a daemon and a route-server --------------------------------------------

@pytest.fixture
def env(start_daemon, monkeypatch, tmp_path) -> Iterator[tuple[Any, str]]:
    d = start_daemon(host_capacity="256MiB")
    monkeypatch.setenv("KVTIER_SOCKET", d.socket)
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "router.log", "wb"), text=True,
                            env={**os.environ, "KVTIER_SOCKET": d.socket})
    try:
        first = proc.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"listening on (\S+),", first)
        assert m, first + (tmp_path / "router.log").read_text()
        address = m[1]
        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            deadline = time.monotonic() + 20
            while not any(f.connected and f.epoch for f in stub.Status(router_pb2.RouterStatusRequest(),
                                                                        timeout=5).feeds):
                assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.05)
        yield d, address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_the_readme_python_blocks_run(env, tmp_path) -> None:
    daemon, router_address = env
    todo = [(line, text) for line, text in blocks("python") if not SKIP.search(text)]
    assert len(todo) >= 3, "README's engine, GPU and router examples"
    pre = Preamble(daemon.shm_dir)
    ns: dict[str, Any] = {"__name__": "readme"}
    try:
        for line, text in todo:
            run_block(f"README.md:{line}", text, ns, pre, router_address, daemon.socket)
    finally:
        for obj in list(ns.values()):
            close = getattr(obj, "close", None)
            if callable(close) and not isinstance(obj, type) and type(obj).__module__.startswith(("kvtier", "grpc")):
                close()
        pre.close()
    assert ns["d"].worker and ns["reply"].ranked, "the router examples routed"


# -- shell blocks: kvtier and kvtierd commands ---------------------------------------------------

def commands() -> list[tuple[int, list[str]]]:
    """(line, argv) of every kvtier / kvtierd command in README's shell blocks."""
    out = []
    for start, text in blocks("shell"):
        for n, line in enumerate(text.replace("\\\n", " ").splitlines()):
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            try:
                tokens = list(lex)
            except ValueError:
                continue  # not a command line (a formula, a tree)
            cmd: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in ("&&", "||", "|", ";", "&"):
                    if cmd and os.path.basename(cmd[0]) in ("kvtier", "kvtierd"):
                        out.append((start + n, [os.path.basename(cmd[0]), *cmd[1:]]))
                    cmd = []
                else:
                    cmd.append(tok)
    return out


def _parse_kvtier(argv: list[str], daemon_socket: str) -> None:
    sub, args = argv[0], argv[1:]
    if sub == "route-server":
        from kvtier.client.routing.route_server import load_settings

        load_settings(args, {})
    elif sub == "report":
        from kvtier.client.tools.report import build_parser

        build_parser().parse_args(args)
    elif sub == "replay":
        from kvtier.client.tools.replay import build_parser

        ns = build_parser().parse_args(args)
        assert (ROOT / ns.trace).exists(), f"kvtier replay: no trace {ns.trace}"
    elif sub in ("measure", "trace"):
        import importlib

        importlib.import_module(f"kvtier.client.tools.{sub}").build_parser().parse_args(args)
    elif sub == "demo":
        from kvtier.client.tools.demo import build_parser

        build_parser().parse_args(args)
    elif sub == "gateway":  # needs replicas to run: parsed and checked only (tests/test_gateway.py runs it)
        from kvtier.client.gateway.server import SETTINGS, check_settings

        check_settings(SETTINGS.load(args, {}))
    elif sub == "stats":
        args = [daemon_socket if a == README_SOCKET else a for a in args]
        p = subprocess.run([sys.executable, "-m", "kvtier.client.tools.cli", "stats", *args], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "KVTIER_SOCKET": daemon_socket})
        assert p.returncode == 0, p.stderr
    else:
        raise AssertionError(f"kvtier {sub}: no such command")


def test_the_readme_commands_parse(daemon) -> None:
    from kvtier.daemon.config import load_config

    found = commands()
    assert {a[0] for _, a in found} == {"kvtier", "kvtierd"} and len(found) >= 5, found
    for line, argv in found:
        try:
            if argv[0] == "kvtierd":
                load_config(argv[1:], env={})
            else:
                _parse_kvtier(argv[1:], daemon.socket)
        except SystemExit as e:  # argparse refused it
            raise AssertionError(f"README.md:{line}: {shlex.join(argv)}: exit {e.code}") from None
        except Exception as e:
            raise AssertionError(f"README.md:{line}: {shlex.join(argv)}: {e}") from e

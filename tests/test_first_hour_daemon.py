"""The first hour with kvtierd, on real daemons over real sockets.

* A refused start (socket served by another daemon, a taken ``--tcp`` or ``--metrics-port``)
  says why in one line and leaves nothing behind: no key table or pool file in ``--shm-dir``,
  no socket file.
* The files a killed daemon left in ``--shm-dir`` are removed by the next start there; files
  of live daemons and files that are not kvtier's are not.
* ``--disk-dir`` on a tmpfs is refused unless ``--disk-allow-tmpfs``.
* ``kvtierd --help`` shows sizes with units and names TOML keys.
* ``kvtier stats`` keeps its columns apart; ``kvtier report`` writes no screen codes into a
  pipe and counts a daemon named twice (socket and TCP or metrics URL) once.
* docs/metrics.md: every family and label it names is in a fresh daemon's first scrape.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kvtierd(d: DaemonProcess, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``d``'s command line in the foreground (a start that is expected to be refused)."""
    return subprocess.run([sys.executable, "-m", "kvtier.daemon.main", *d.args], capture_output=True, text=True,
                          env=d.env, timeout=timeout)


def kvtier(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.client.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _assert_refused_cleanly(res: subprocess.CompletedProcess, *words: str) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Traceback" not in out, out
    said = [line for line in out.splitlines() if line.startswith("kvtierd: cannot start:")]
    assert len(said) == 1 and all(w in said[0] for w in words), out
    assert len(out.strip().splitlines()) <= 2, out   # that line (and the same as one log record)


# -- a refused start leaves nothing -------------------------------------------------------------

def test_socket_served_by_another_daemon_leaves_nothing_in_shm(start_daemon, tmp_path, shm_dir) -> None:
    first = start_daemon(shm_dir=shm_dir)
    before = sorted(os.listdir(shm_dir))
    second = DaemonProcess(str(tmp_path), shm_dir=shm_dir)   # the same socket path
    _assert_refused_cleanly(run_kvtierd(second), "another process is serving", first.socket)
    assert sorted(os.listdir(shm_dir)) == before
    with Sidecar(first.socket) as sc:   # the first one is untouched
        assert sc.stats()["tiers"]["host"]["capacity_bytes"] == 256 << 20


@pytest.mark.parametrize("flag", ["--tcp", "--metrics-port"])
def test_taken_port_is_one_line_and_leaves_nothing(tmp_path, shm_dir, flag) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = f"127.0.0.1:{port}" if flag == "--tcp" else str(port)
        extra = ("--insecure-tcp",) if flag == "--tcp" else ()
        d = DaemonProcess(str(tmp_path), flag, value, *extra, shm_dir=shm_dir)
        _assert_refused_cleanly(run_kvtierd(d), flag, str(port), "in use")
    assert os.listdir(shm_dir) == []
    assert not os.path.exists(d.socket)


# -- files a killed daemon left are swept by the next start -------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_start_sweeps_a_killed_daemons_files_only(start_daemon, shm_dir) -> None:
    killed = start_daemon(shm_dir=shm_dir, host_capacity="4MiB", name="killed")
    with Sidecar(killed.socket) as sc:
        sc.register_layout(Layout.flat(BLOCK))     # creates its pool file
    killed.kill()                                  # SIGKILL: nothing is cleaned up
    left = sorted(os.listdir(shm_dir))
    assert any(n.endswith(".pool") for n in left) and any(n.endswith(".keys") for n in left), left

    dead = _dead_pid()
    keep = {
        "not-kvtier.keys": None,                         # not kvtier's name
        f"kvtier-{os.getpid()}-1.keys": None,            # its pid is alive (this test)
        f"kvtier-{dead}-2-65536.pool": "held",           # dead pid, but a process has it open for writing
        f"kvtier-{dead}-2.keys": "held",                 # and so its key table (a daemon elsewhere, alive)
    }
    gone = {f"kvtier-{dead}-3.keys.1.tmp", f"kvtier-{dead}-3-4096.pool"}
    # a dead daemon's pool its former client still maps (open for writing), its key table gone:
    # unlinked (the client's mapping keeps its memory until it lets go)
    mapped = f"kvtier-{dead}-4-4096.pool"
    held = []
    for name, how in {**keep, mapped: "held"}.items():
        fd = os.open(os.path.join(shm_dir, name), os.O_RDWR | os.O_CREAT, 0o600)
        (held.append(fd) if how == "held" else os.close(fd))
    for name in gone:
        Path(shm_dir, name).write_bytes(b"x")
    try:
        start_daemon(shm_dir=shm_dir, host_capacity="4MiB", name="next")
        now = set(os.listdir(shm_dir))
    finally:
        for fd in held:
            os.close(fd)
    assert not (set(left) | gone | {mapped}) & now, now
    assert set(keep) <= now, now
    # the new daemon's, the live pid's and the daemon elsewhere's
    assert len([n for n in now if n.startswith("kvtier-") and n.endswith(".keys")]) == 3


# -- --disk-dir on a tmpfs ----------------------------------------------------------------------

def test_disk_dir_on_tmpfs_is_refused_unless_allowed(start_daemon, tmp_path, shm_dir) -> None:
    disk = os.path.join(shm_dir, "disk")
    d = DaemonProcess(str(tmp_path), "--disk-dir", disk, "--disk-capacity", "16MiB", shm_dir=shm_dir)
    _assert_refused_cleanly(run_kvtierd(d), "--disk-dir", "tmpfs", "--disk-allow-tmpfs")
    assert not os.path.exists(disk) and not os.path.exists(d.socket)
    assert os.listdir(shm_dir) == []
    ok = start_daemon("--disk-dir", disk, "--disk-capacity", "16MiB", "--disk-allow-tmpfs",
                      shm_dir=shm_dir, name="allowed")
    with Sidecar(ok.socket) as sc:
        assert sc.stats()["tiers"]["disk"]["capacity_bytes"] == 16 << 20
    assert "tmpfs" in ok.logs()   # a warning says what it is


# -- --help -------------------------------------------------------------------------------------

def test_help_shows_sizes_with_units_and_toml_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.daemon.main", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}, timeout=60).stdout
    assert "TOML column" not in out and "TOML key" in out
    assert "default 8GiB]" in out and "default 8MiB]" in out      # --host-capacity, --offload-piece-bytes
    assert "8589934592" not in out and "8388608" not in out
    assert "--disk-allow-tmpfs" in out


# -- kvtier stats and kvtier report -------------------------------------------------------------

def test_stats_keeps_layout_id_and_fingerprint_apart(daemon) -> None:
    with Sidecar(daemon.socket) as sc:
        sc.register_layout(Layout.flat(BLOCK))
        lay = sc.stats()["layouts"][0]
    out = kvtier("stats", "--socket", daemon.socket).stdout
    rows = [line.split() for line in out.splitlines() if lay["fingerprint"] in line]
    assert rows and rows[0][:2] == [str(lay["layout_id"]), lay["fingerprint"]], out
    for line in out.splitlines():   # counters: name and value apart too
        if line.startswith("  "):
            assert len(line.split()) == 2, line


def test_live_report_into_a_pipe_has_no_screen_codes(daemon) -> None:
    p = subprocess.Popen([sys.executable, "-m", "kvtier.client.tools.cli", "report", "--daemons", daemon.socket,
                          "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(60, p.kill)  # a report that never prints must not hang the test
    watchdog.start()
    first = b""
    try:
        while b"(fleet)" not in first:  # Ctrl-C only once a refresh is out (not during the imports)
            line = p.stdout.readline()
            if not line:
                break
            first += line
    finally:
        watchdog.cancel()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    out = first + out
    assert b"kvtier report" in out and b"(fleet)" in out
    assert b"\x1b" not in out


def test_report_counts_a_daemon_named_twice_once(start_daemon) -> None:
    tcp, metrics = free_port(), free_port()
    d = start_daemon("--tcp", f"127.0.0.1:{tcp}", "--insecure-tcp", "--tcp-services", "all", "--metrics-port", str(metrics), "--node-id", "twice")
    with Sidecar(d.socket, use_key_table=False) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, [b"k" * 16], [b"x" * BLOCK])
        sc.lookup(lid, [b"k" * 16, b"m" * 16])
    for other in (f"127.0.0.1:{tcp}", f"http://127.0.0.1:{metrics}"):
        res = kvtier("report", "--once", "--json", "--daemons", f"{d.socket},{other}")
        assert res.returncode == 0, res.stderr
        rep = json.loads(res.stdout)
        assert [n["node_id"] for n in rep["nodes"]] == ["twice"], rep
        assert rep["fleet"]["asked_blocks"] == 2, rep
        assert rep["nodes"][0]["also"] == [other]
        table = kvtier("report", "--once", "--daemons", f"{d.socket},{other}").stdout
        assert table.count("twice") == 1, table


# -- docs/metrics.md matches a fresh daemon's first scrape --------------------------------------

def documented_families() -> list[tuple[list[str], dict[str, list[str] | None]]]:
    """Each row of docs/metrics.md's table: (family names, {label: listed values or None})."""
    rows = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `kvtier_"):
            continue
        names_cell, labels_cell = line.split("|")[1:3]
        names = re.findall(r"`(kvtier_\w+)`", names_cell)   # not `kvtier_<name>_total`
        labels: dict[str, list[str] | None] = {}
        for label, listed in re.findall(r"`(\w+)`(?:\s*\(([^)]*)\))?", labels_cell):
            items = [x.strip() for x in listed.split(",")] if listed else []
            enumerated = items and all(re.fullmatch(r"[\w>-]+", x) for x in items)
            labels[label] = items if enumerated else None
        rows.append((names, labels))
    return rows


def test_every_documented_family_and_label_is_in_the_first_scrape(start_daemon) -> None:
    port = free_port()
    start_daemon("--metrics-port", str(port), "--node-id", "doc-node")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("kvtier_"):
            families[fam.name + ("_total" if fam.type == "counter" else "")] = fam
    rows = documented_families()
    assert len(rows) >= 12
    named: set[str] = set()
    for names, labels in rows:
        for name in names:
            named.add(name)
            assert name in families, f"{name} is documented but not exported"
            fam = families[name]
            assert fam.samples, f"{name} has no series at the first scrape"
            seen: dict[str, set[str]] = {}
            for s in fam.samples:
                got = {k: v for k, v in s.labels.items() if k != "le"}
                assert got.get("node") == "doc-node", (name, s)
                assert set(got) == {"node", *labels}, (name, s)
                for k, v in got.items():
                    seen.setdefault(k, set()).add(v)
            for label, values in labels.items():
                if values is not None:
                    assert set(values) <= seen[label], (name, label, seen[label])
    # what the table does not name is a plain counter of the `kvtier_<name>_total` row
    for name, fam in families.items():
        if name not in named:
            assert fam.type == "counter" and all(set(s.labels) == {"node"} for s in fam.samples), name

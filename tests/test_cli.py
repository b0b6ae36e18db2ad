"""The command-line tools, run as a user would: `kvtier demo`, `kvtier stats`, `kvtierd --help`,
`kvtierd`'s switches."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.daemon.config import Config
from kvtier.settings import settings_of

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_demo_prints_hit_rate_by_tier() -> None:
    p = run("-m", "kvtier.client.tools.cli", "demo", "--sessions", "4", "--turns", "3", "--no-disk")
    assert p.returncode == 0, p.stderr
    assert "served from" in p.stdout and "prefix reuse" in p.stdout
    reuse = next(line for line in p.stdout.splitlines() if line.startswith("prefix reuse"))
    assert float(reuse.split()[-1].rstrip("%")) > 30.0  # shared system prompt + history
    assert "checked byte-exact" in p.stdout


def test_stats_of_a_running_daemon(daemon: DaemonProcess) -> None:
    p = run("-m", "kvtier.client.tools.cli", "stats", "--socket", daemon.socket, "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout.strip().splitlines()[-1])
    assert st["tiers"]["host"]["capacity_bytes"] == 256 << 20
    p = run("-m", "kvtier.client.tools.cli", "stats", "--socket", daemon.socket)
    assert p.returncode == 0 and "capacity" in p.stdout


def test_stats_without_a_daemon_says_so(tmp_path) -> None:
    p = run("-m", "kvtier.client.tools.cli", "stats", "--socket", str(tmp_path / "none.sock"))
    assert p.returncode == 1 and "no daemon socket" in p.stderr


def test_every_setting_is_in_help_and_readme() -> None:
    help_text = run("-m", "kvtier.daemon.main", "--help").stdout
    readme = (ROOT / "README.md").read_text()
    for s in settings_of(Config):
        assert s.flag in help_text, s.name
        assert f"`{s.flag}`" in readme, f"README's configuration reference lacks {s.flag}"


def test_every_route_server_setting_is_in_help_and_readme() -> None:
    from kvtier.client.routing.route_server import SETTINGS

    help_text = " ".join(run("-m", "kvtier.client.routing.route_server", "--help").stdout.split())
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### `kvtier route-server`"):]
    for s in SETTINGS.settings:
        assert s.flag in help_text and f"env KVTIER_ROUTER_{s.name.upper()}" in help_text, s.name
        assert f"`{s.flag}`" in section, f"README's route-server reference lacks {s.flag}"
    assert {"--daemon", "--dns", "--state-path", "--queued-weight", "--disk-load-gbps"} <= \
        {s.flag for s in SETTINGS.settings}


def test_route_server_refuses_bad_settings_clearly() -> None:
    # (with no --daemon nor --dns it follows the local daemon: tests/test_router_first_hour.py)
    p = run("-m", "kvtier.client.routing.route_server", "--listen", "127.0.0.1:0", "--log-level", "loud")
    assert p.returncode == 2 and "--log-level: 'loud' is not debug, info, warning or error" in p.stderr


def test_bad_setting_is_a_clear_error() -> None:
    p = run("-m", "kvtier.daemon.main", "--host-capacity", "lots")
    assert p.returncode == 2 and "--host-capacity" in p.stderr and "not a size" in p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvtierd_insecure_tcp_is_a_switch(start_daemon) -> None:
    """``kvtierd --tcp 127.0.0.1:PORT --insecure-tcp`` serves health over TCP, without a warning."""
    port = _free_port()
    d = start_daemon("--tcp", f"127.0.0.1:{port}", "--insecure-tcp")
    p = run("-m", "kvtier.client.tools.cli", "health", f"127.0.0.1:{port}")
    assert p.returncode == 0, p.stderr
    assert "deprecated" not in d.logs()


def test_kvtierd_old_boolean_form_warns_and_the_no_form_clears() -> None:
    p = run("-m", "kvtier.daemon.main", "--tcp", "127.0.0.1:7", "--insecure-tcp", "true", "--tls-cert", "c.pem",
            "--tls-key", "k.pem", "--tls-ca", "ca.pem")
    assert p.returncode == 2, p.stderr
    assert "kvtierd: warning: '--insecure-tcp true' is deprecated" in p.stderr and "use --insecure-tcp" in p.stderr
    assert "--insecure-tcp and --tls-cert contradict each other" in p.stderr  # it was taken as set
    p = run("-m", "kvtier.daemon.main", "--tcp", "127.0.0.1:7", "--no-insecure-tcp")
    assert p.returncode == 2 and "without TLS would serve anyone" in p.stderr and "deprecated" not in p.stderr

"""deploy/kvtierd.example.toml: every kvtierd setting, commented out, loads as the defaults;
each line uncommented loads too, and shows the default unless it is one of the examples."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvtier.daemon.config import Config, load_config
from kvtier.settings import CONFIG, settings_of

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "kvtierd.example.toml"
SETTING_LINE = re.compile(r"^# ([a-z_]+) = (.+)$")
# keys whose line shows an example value rather than the default (an empty path, a port of 0)
EXAMPLES = {"socket", "tcp", "node_id", "disk_dir", "disk_capacity", "metrics_port", "allowed_uids", "tenants",
            "tls_cert", "tls_key", "tls_ca", "key_secret_file"}


def test_the_example_loads_as_the_defaults() -> None:
    assert load_config(["--config", str(EXAMPLE)], env={}) == Config(config=str(EXAMPLE))


def test_every_setting_is_in_the_example_once_and_each_line_loads(tmp_path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    keys = [m[1] for line in lines if (m := SETTING_LINE.match(line))]
    names = [s.name for s in settings_of(Config) if s.name != CONFIG]
    assert sorted(keys) == sorted(names), set(keys) ^ set(names)
    uncommented = tmp_path / "all.toml"
    uncommented.write_text("\n".join(line[2:] if SETTING_LINE.match(line) else line for line in lines) + "\n")
    cfg = load_config(["--config", str(uncommented)], env={})
    default = Config()
    for f in dataclasses.fields(Config):
        if f.name in EXAMPLES:
            assert getattr(cfg, f.name) != getattr(default, f.name), f.name
        elif f.name != CONFIG:
            assert getattr(cfg, f.name) == getattr(default, f.name), f"{f.name}: the example shows a non-default"

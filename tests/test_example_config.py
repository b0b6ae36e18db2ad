"""deploy/kvtierd.example.toml: every kvtierd setting, commented out, loads as the defaults;
each line uncommented loads too, and shows the default unless it is one of the examples. Its
sections are the settings' groups, in the order ``kvtierd --help`` lists them."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.daemon.config import Config, load_config
from kvtier.settings import CONFIG, settings_of

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "kvtierd.example.toml"
SETTING_LINE = re.compile(r"^# ([a-z_]+) = (.+)$")
SECTION_LINE = re.compile(r"^# -- (.+?) -+$")
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
    for s in settings_of(Config):
        if s.name in EXAMPLES:
            assert getattr(cfg, s.name) != getattr(default, s.name), s.name
        elif s.name != CONFIG:
            assert getattr(cfg, s.name) == getattr(default, s.name), f"{s.name}: the example shows a non-default"


def test_the_example_follows_the_groups_of_the_settings() -> None:
    """Each group's keys under a section named by its title, groups and keys in the settings' order."""
    want = [(s.section, s.name) for s in settings_of(Config) if s.name != CONFIG]
    have, section = [], None
    for line in EXAMPLE.read_text().splitlines():
        if m := SECTION_LINE.match(line):
            section = m[1]
        elif m := SETTING_LINE.match(line):
            have.append((section, m[1]))
    titles = {title for title, _ in want}
    have = [(next((t for t in titles if here and here.startswith(t)), here), key) for here, key in have]
    assert have == want

from __future__ import annotations

import pytest

from kvtier.daemon.config import ConfigError, build_parser, load_config, parse_size


def test_sizes() -> None:
    assert parse_size("64GiB") == 64 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("4096") == 4096
    assert parse_size("1.5KiB") == 1536
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_flag_beats_env_beats_file(tmp_path) -> None:
    cfg_file = tmp_path / "kvtier.toml"
    cfg_file.write_text('host_capacity = "1GiB"\nnode_id = "from-file"\nmetrics_port = 9100\n')
    env = {"KVTIER_CONFIG": str(cfg_file), "KVTIER_HOST_CAPACITY": "2GiB"}
    cfg = load_config(["--host-capacity", "3GiB"], env)
    assert cfg.host_capacity == 3 * 2**30
    cfg = load_config([], env)
    assert cfg.host_capacity == 2 * 2**30 and cfg.node_id == "from-file" and cfg.metrics_port == 9100
    cfg = load_config([], {"KVTIER_CONFIG": str(cfg_file)})
    assert cfg.host_capacity == 2**30


def test_errors_name_the_setting(tmp_path) -> None:
    with pytest.raises(ConfigError, match="KVTIER_HOST_CAPACITY"):
        load_config([], {"KVTIER_HOST_CAPACITY": "huge"})
    bad = tmp_path / "bad.toml"
    bad.write_text("hots_capacity = 5\n")
    with pytest.raises(ConfigError, match="unknown key 'hots_capacity'"):
        load_config(["--config", str(bad)], {})


def test_every_setting_is_documented() -> None:
    text = build_parser().format_help()
    for action in build_parser()._actions:
        if action.dest != "help":
            assert action.help and "env KVTIER_" in action.help, action.dest
    assert "--host-capacity" in text

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


# -- kvtier route-server: the same mechanism over RouterConfig and ScorerConfig -----------------

def test_route_server_settings_flag_beats_env_beats_file(tmp_path) -> None:
    from kvtier.client.routing.route_server import load_settings

    toml = tmp_path / "router.toml"
    toml.write_text('daemon = ["unix:/a.sock", "unix:/b.sock"]\nqueued_weight = 0.5\nresolve_interval_s = 3\n'
                    'top_k = 4\n')
    env = {"KVTIER_ROUTER_CONFIG": str(toml), "KVTIER_ROUTER_QUEUED_WEIGHT": "0.75",
           "KVTIER_ROUTER_DNS": "kvtierd.svc:7070,other.svc:7070"}
    cfg = load_settings(["--queued-weight", "1.5", "--daemon", "unix:/c.sock"], env)
    assert cfg.router.scorer.queued_weight == 1.5                       # flag
    assert cfg.router.daemons == ("unix:/c.sock",)                       # a flag list replaces the file's
    assert cfg.router.dns == ("kvtierd.svc:7070", "other.svc:7070")     # env, comma-separated
    cfg = load_settings([], env)
    assert cfg.router.scorer.queued_weight == 0.75                      # env beats the file
    assert cfg.router.daemons == ("unix:/a.sock", "unix:/b.sock")       # the file's array
    assert cfg.router.resolve_interval_s == 3.0 and cfg.router.top_k == 4
    assert cfg.router.scorer.active_weight == 0.1 and cfg.listen == "127.0.0.1:7071"  # defaults
    cfg = load_settings(["--daemon", "a:1", "--daemon", "b:2", "--state-path", "/s", "--disk-load-gbps", "3"], {})
    assert cfg.router.daemons == ("a:1", "b:2") and cfg.router.state_path == "/s"
    assert cfg.router.scorer.disk_load_gbps == 3.0


def test_route_server_settings_errors_name_the_setting(tmp_path) -> None:
    from kvtier.client.routing.route_server import load_settings

    # neither --daemon nor --dns: the local daemon ($KVTIER_SOCKET, else the default socket)
    assert load_settings([], {"KVTIER_SOCKET": "/x/k.sock"}).router.daemons == ("unix:/x/k.sock",)
    with pytest.raises(ConfigError, match="KVTIER_ROUTER_TOP_K: not an integer"):
        load_settings(["--daemon", "a:1"], {"KVTIER_ROUTER_TOP_K": "many"})
    with pytest.raises(ConfigError, match="--queued-weight: not a number"):
        load_settings(["--daemon", "a:1", "--queued-weight", "lots"], {})
    bad = tmp_path / "bad.toml"
    bad.write_text('daemons = ["a:1"]\n')  # the flag's name is the key: daemon
    with pytest.raises(ConfigError, match="unknown key 'daemons'"):
        load_settings(["--config", str(bad)], {})


def test_one_default_per_knob() -> None:
    """The replay, the router and route-server take their scorer defaults from ScorerConfig."""
    from kvtier.client.routing.route_server import load_settings
    from kvtier.client.routing.router import RouterConfig
    from kvtier.client.routing.scoring import ScorerConfig
    from kvtier.client.tools.replay import ReplayConfig

    scorer, replay = ScorerConfig(), ReplayConfig()
    assert RouterConfig().scorer == scorer == load_settings(["--daemon", "a:1"], {}).router.scorer
    assert replay.scorer_config() == scorer
    assert scorer.disk_load_gbps == replay.disk_load_gbps == 2.0


def test_tenants_flag_takes_comma_separated_entries(tmp_path) -> None:
    """``--tenants 1000=alice,1001=bob`` (as its help shows) is two entries, like the variable."""
    cfg = load_config(["--tenants", "1000=alice,1001=bob", "--tenants", "cn:r1=carol"], {})
    assert cfg.tenants == ("1000=alice", "1001=bob", "cn:r1=carol")
    assert load_config([], {"KVTIER_TENANTS": "1000=alice,1001=bob"}).tenants == ("1000=alice", "1001=bob")
    with pytest.raises(ConfigError, match="tenant entry"):
        load_config(["--tenants", "1000=alice=bob"], {})

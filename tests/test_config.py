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


# -- groups: settings by subsystem, with the flat names they always had ----------------------------

KVTIERD_NAMES = """
allowed_gids allowed_uids config copy_engine copy_threads cuda_backend cuda_device demote_ahead_bytes
demote_min_seen demote_queue_bytes disk_allow_tmpfs disk_capacity disk_dir disk_map_size disk_queue_depth
disk_recheck_s disk_write_through event_log_bytes event_log_keys grant_ttl_s host_capacity host_prefault
insecure_tcp key_secret_file kv_events_endpoint kv_events_replay_endpoint kv_events_topic lease_ttl_s
log_format log_level max_batch_keys max_concurrent_rpcs max_device_blocks_per_worker max_feed_subscribers
max_feed_subscribers_per_tenant max_layouts_per_tenant max_sessions max_sessions_per_tenant
max_slot_sizes_per_tenant max_workers_per_tenant metrics_host metrics_port node_id offload_piece_bytes
peer_backoff_max_s peer_chunk_bytes peer_read_through peer_resolve_s peer_serve peer_serve_delay_s
peer_tenant_certs peer_timeout_s peer_tls_ca peer_tls_cert peer_tls_key peer_window_bytes peers session_quota
shm_dir socket state_dir store_backend store_mooncake_buffer_bytes store_mooncake_device store_mooncake_local
store_mooncake_master store_mooncake_metadata store_mooncake_protocol store_mooncake_segment_bytes
store_namespace store_password_file store_plaintext store_queue_bytes store_read_through store_redis
store_timeout_s store_tls_ca store_tls_cert store_tls_key store_ttl_s store_user store_write tcp tcp_services
tenant_quota tenants tls_ca tls_cert tls_key transfer_wait_s retention_budget
credential_hello_timeout_s max_pending_handshakes_per_uid grpc_idle_s max_kv_registrations_per_session
max_kv_registrations_per_tenant max_passed_fds_per_connection max_passed_fds_per_uid max_passed_fds_per_tenant
fd_reserve
""".split()


def test_groups_keep_every_flat_name() -> None:
    """Grouping by subsystem changes no flag, variable, TOML key or Python attribute."""
    from kvtier.daemon.config import SETTINGS, Config
    from kvtier.settings import settings_of

    settings = settings_of(Config)
    assert sorted(s.name for s in settings) == sorted(KVTIERD_NAMES)
    assert all(len(s.path) == 2 and s.section for s in settings if s.name != "config")
    assert {SETTINGS.env_name(n) for n in KVTIERD_NAMES} == {f"KVTIER_{n.upper()}" for n in KVTIERD_NAMES}
    cfg = load_config(["--disk-dir", "/d", "--host-capacity", "1GiB"], {"KVTIER_PEER_TIMEOUT_S": "3"})
    assert cfg.disk_dir == cfg.disk.disk_dir == "/d" and cfg.host.host_capacity == cfg.host_capacity == 2**30
    assert cfg.peer_timeout_s == cfg.peering.peer_timeout_s == 3.0
    cfg.max_sessions = 7  # written through to its group
    assert cfg.limits.max_sessions == 7


def test_one_default_for_demotion_admission() -> None:
    """kvtierd, the tier policy and the replay share --demote-min-seen's and --demote-ahead-bytes' defaults."""
    import inspect

    from kvtier.client.tools.replay import ReplayConfig, build_parser
    from kvtier.daemon.config import Config
    from kvtier.tiers.policy import DEMOTE_AHEAD_BYTES, DEMOTE_MIN_SEEN, TierPolicy

    replay = ReplayConfig()
    assert Config().demote_min_seen == replay.demote_min_seen == DEMOTE_MIN_SEEN
    assert inspect.signature(TierPolicy).parameters["demote_min_seen"].default == DEMOTE_MIN_SEEN
    assert Config().demote_ahead_bytes == replay.demote_ahead_bytes == DEMOTE_AHEAD_BYTES
    ns = build_parser().parse_args(["t.jsonl"])
    assert ns.demote_min_seen == DEMOTE_MIN_SEEN and ns.demote_ahead_bytes == DEMOTE_AHEAD_BYTES


# -- boolean settings are switches ---------------------------------------------------------------

def _switches():
    from kvtier.client.gateway.server import SETTINGS as gateway
    from kvtier.client.routing.route_server import SETTINGS as route_server
    from kvtier.daemon.config import SETTINGS as kvtierd

    return [(settings, s) for settings in (kvtierd, route_server, gateway) for s in settings.settings if s.switch]


def test_every_boolean_setting_is_a_switch(capsys) -> None:
    """--NAME sets it, --no-NAME clears it, whatever the variable says; neither warns."""
    switches = _switches()
    names = {(settings.prog, s.name) for settings, s in switches}
    assert {("kvtierd", "insecure_tcp"), ("kvtierd", "store_plaintext"), ("kvtier route-server", "pulls"),
            ("kvtier gateway", "prefetch"), ("kvtier gateway", "session_user")} <= names
    for settings, s in switches:
        env = settings.env_name(s.name)
        assert settings.parser().parse_args([s.flag]).__dict__[s.name] is True, s.flag
        assert settings.parser().parse_args([f"--no-{s.flag[2:]}"]).__dict__[s.name] is False, s.flag
        assert settings.parser().parse_args([]).__dict__[s.name] is None, s.flag  # not given: the env var's
        help_text = settings.parser().format_help()
        assert s.flag in help_text and f"--no-{s.flag[2:]}" in help_text and f"{env}=true|false" in help_text
    assert capsys.readouterr().err == ""


def test_kvtierd_switches_and_their_variables(tmp_path) -> None:
    assert load_config(["--tcp", "127.0.0.1:7070", "--insecure-tcp"], {}).insecure_tcp is True
    assert load_config(["--no-host-prefault"], {"KVTIER_HOST_PREFAULT": "true"}).host_prefault is False
    assert load_config(["--host-prefault"], {"KVTIER_HOST_PREFAULT": "false"}).host_prefault is True
    assert load_config([], {"KVTIER_HOST_PREFAULT": "off"}).host_prefault is False  # variables keep values
    toml = tmp_path / "k.toml"
    toml.write_text("store_read_through = false\npeer_read_through = true\n")
    cfg = load_config(["--config", str(toml)], {})
    assert cfg.store_read_through is False and cfg.peer_read_through is True  # and TOML keys
    assert load_config(["--config", str(toml), "--store-read-through"], {}).store_read_through is True
    with pytest.raises(ConfigError, match="--tcp 127.0.0.1:7070 without TLS"):
        load_config(["--tcp", "127.0.0.1:7070", "--insecure-tcp", "--no-insecure-tcp"], {})  # the last wins


def test_the_old_boolean_form_works_with_a_warning(capsys) -> None:
    """``--insecure-tcp true|false`` and ``--NAME=VALUE`` mean the switch, warning on stderr naming it."""
    from kvtier.client.gateway.server import SETTINGS as gateway
    from kvtier.client.routing.route_server import load_settings

    assert load_config(["--tcp", "127.0.0.1:7070", "--insecure-tcp", "true"], {}).insecure_tcp is True
    err = capsys.readouterr().err
    assert "'--insecure-tcp true' is deprecated" in err and "use --insecure-tcp" in err
    assert load_config(["--host-prefault", "false", "--disk-write-through=no", "--disk-dir", "/d"],
                       {}).host_prefault is False
    err = capsys.readouterr().err
    assert "'--host-prefault false' is deprecated" in err and "use --no-host-prefault" in err
    assert "'--disk-write-through=no' is deprecated" in err and "use --no-disk-write-through" in err
    assert load_settings(["--daemon", "a:1", "--pulls", "false"], {}).router.pulls is False
    assert "use --no-pulls" in capsys.readouterr().err
    assert gateway.load(["--prefetch", "off", "--session-user", "1"], {}).prefetch is False
    err = capsys.readouterr().err
    assert "use --no-prefetch\n" in err and "use --session-user\n" in err
    with pytest.raises(SystemExit) as e:
        load_config(["--insecure-tcp=maybe"], {})
    assert e.value.code == 2 and "argument --insecure-tcp: not a boolean: 'maybe'" in capsys.readouterr().err


def test_a_switch_takes_only_a_boolean_word_after_it() -> None:
    """A switch followed by a positional argument or another option does not swallow it."""
    from kvtier.settings import Parser

    ap = Parser(prog="t")
    ap.add_switch("--pulls", dest="pulls", default=None)
    ap.add_argument("trace")
    ap.add_argument("--seed")
    assert vars(ap.parse_args(["--pulls", "t.jsonl"])) == {"pulls": True, "trace": "t.jsonl", "seed": None}
    assert vars(ap.parse_args(["--no-pulls", "--seed", "1", "t"])) == {"pulls": False, "trace": "t", "seed": "1"}
    assert vars(ap.parse_args(["--pulls", "--", "true"])) == {"pulls": True, "trace": "true", "seed": None}
    assert vars(ap.parse_args(["--pul", "t"]))["pulls"] is True  # an abbreviation, as argparse takes them

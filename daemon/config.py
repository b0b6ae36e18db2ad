"""kvtierd configuration: one typed dataclass, every field a flag, an env var and a TOML key.

Each field has one name: ``host_capacity`` is ``--host-capacity`` on the command line,
``KVTIER_HOST_CAPACITY`` in the environment and ``host_capacity`` in the TOML file given by
``--config`` (or ``KVTIER_CONFIG``). A flag beats an env var beats the file beats the default.
Sizes accept units (``64GiB``, ``512MB``, ``4096``); durations are seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tomllib

from kvtier.paths import default_socket_path

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """``"64GiB"`` -> 68719476736; plain integers are bytes. Raises ValueError with the input."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 8GiB, 512MiB, 100MB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _opt(default: Any, help: str, parse: Callable[[Any], Any] = str, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar})


@dataclass
class Config:
    """Every kvtierd setting. See the module docstring for names and precedence."""

    socket: str = _opt("", "unix socket to serve on (default $XDG_RUNTIME_DIR/kvtier/kvtierd.sock, "
                           "else /tmp/kvtier-$UID/kvtierd.sock); created mode 0600", metavar="PATH")
    tcp: str = _opt("", "also listen on HOST:PORT (TCP, for remote routers); refuses to start if the "
                        "port is taken; empty: no TCP listener", metavar="HOST:PORT")
    node_id: str = _opt("", "this node's name in events, metrics and routing (default: hostname)")
    shm_dir: str = _opt("/dev/shm", "tmpfs directory for the host pool and key table files; in a "
                                    "container mount a tmpfs this large", metavar="DIR")
    host_capacity: int = _opt(8 * 1024**3, "bytes of host memory for KV blocks (e.g. 64GiB)", parse_size,
                              "SIZE")
    host_prefault: bool = _opt(True, "allocate the host pool's memory when the first layout registers, so "
                                     "writes never pay for page allocation and a too-small tmpfs is "
                                     "found at once", parse_bool, "BOOL")
    state_dir: str = _opt("", "directory for daemon state (default $XDG_STATE_HOME/kvtier, "
                              "else ~/.local/state/kvtier)", metavar="DIR")
    disk_dir: str = _opt("", "directory for the disk tier's slab files and index; empty: no disk tier",
                         metavar="DIR")
    disk_capacity: int = _opt(0, "bytes of disk for KV blocks (e.g. 1TiB); 0 with --disk-dir set: "
                                 "90% of the free space", parse_size, "SIZE")
    disk_queue_depth: int = _opt(8, "disk I/Os in flight at once (O_DIRECT reads and writes)", int, "N")
    disk_map_size: int = _opt(0, "LMDB map size of the disk index (its most bytes); 0: 256 B per 4 KiB "
                                 "of --disk-capacity, at least 64MiB", parse_size, "SIZE")
    demote_min_seen: int = _opt(2, "demote a block evicted from host to disk only if it was put or hit "
                                   "at least this many times (1: every evicted block)", int, "N")
    disk_write_through: bool = _opt(False, "write every committed block to disk before acknowledging it "
                                           "(as if every put were durable); needs --disk-dir", parse_bool,
                                    "BOOL")
    metrics_port: int = _opt(0, "serve Prometheus metrics on this TCP port (0: off)", int, "PORT")
    metrics_host: str = _opt("127.0.0.1", "address for the metrics listener", metavar="HOST")
    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("json", "json (one object a line) or text")
    max_batch_keys: int = _opt(65536, "most keys accepted in one request", int, "N")
    copy_engine: str = _opt("auto", "engine KV copies (Transfer service): cuda (needs cupy and a GPU; "
                                    "refuse to start without), host (CPU stand-in only), or auto (cuda "
                                    "when cupy is installed and a GPU is visible); host-memory engines "
                                    "are always served")
    cuda_device: int = _opt(0, "CUDA device ordinal the copy engine drives (one kvtierd per GPU)", int, "N")
    cuda_backend: str = _opt("auto", "GPU copy method: kernel (gather/scatter kernel over the pinned "
                                     "pool), batch (cudaMemcpyBatchAsync), or auto (chosen per batch)")
    copy_threads: int = _opt(4, "memcpy threads of the host copy engine; also the threads touching the "
                                "pool before cudaHostRegister", int, "N")
    offload_piece_bytes: int = _opt(8 * 1024**2, "offloads are copied in pieces of at most this many "
                                                  "bytes so onboards never wait behind a whole offload",
                                    parse_size, "SIZE")
    event_log_keys: int = _opt(1 << 20, "keys of location events kept for routers to resume from; a "
                                        "router further behind gets a snapshot instead", int, "N")
    config: str = _opt("", "TOML file with any of these settings (keys as in the TOML column)",
                       metavar="FILE")

    def resolved_socket(self) -> str:
        return self.socket or default_socket_path()

    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    def resolved_state_dir(self) -> str:
        if self.state_dir:
            return self.state_dir
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return os.path.join(base, "kvtier")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "KVTIER_" + name.upper()


def build_parser(prog: str = "kvtierd") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvtierd: per-node KV-cache tier daemon (GPU HBM -> pinned host -> NVMe).",
        epilog="Every flag is also an env var (--host-capacity: KVTIER_HOST_CAPACITY) and a key of the "
               "--config TOML file (host_capacity). Precedence: flag > env > file > default.",
    )
    for f in _fields():
        default = f.default
        shown = default if default != "" else "unset"
        ap.add_argument(flag_name(f.name), dest=f.name, default=None, metavar=f.metadata["metavar"],
                        help=f"{f.metadata['help'].replace('%', '%%')} [env {env_name(f.name)}; default {shown}]")
    return ap


def _coerce(f: dataclasses.Field, raw: Any, origin: str) -> Any:
    try:
        return f.metadata["parse"](raw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{origin}: {e}") from None


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Parse flags, env and the TOML file into a :class:`Config` (flag > env > file > default)."""
    env = os.environ if env is None else env
    ns = build_parser().parse_args(argv)
    by_name = {f.name: f for f in _fields()}
    values: dict[str, Any] = {}
    cfg_path = ns.config or env.get(env_name("config"), "")
    if cfg_path:
        try:
            with open(cfg_path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {cfg_path}: {e}") from None
        for key, raw in data.items():
            if key not in by_name or key == "config":
                raise ConfigError(f"config file {cfg_path}: unknown key {key!r}; known: "
                                  f"{', '.join(sorted(n for n in by_name if n != 'config'))}")
            values[key] = _coerce(by_name[key], raw, f"{cfg_path}: {key}")
    for name, f in by_name.items():
        if env_name(name) in env:
            values[name] = _coerce(f, env[env_name(name)], env_name(name))
    for name, f in by_name.items():
        raw = getattr(ns, name)
        if raw is not None:
            values[name] = _coerce(f, raw, flag_name(name))
    values["config"] = cfg_path
    cfg = Config(**values)
    if cfg.log_format not in ("json", "text"):
        raise ConfigError(f"--log-format: {cfg.log_format!r} is not json or text")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level: {cfg.log_level!r} is not debug, info, warning or error")
    if cfg.host_capacity <= 0:
        raise ConfigError("--host-capacity must be positive")
    if cfg.copy_engine not in ("auto", "host", "cuda"):
        raise ConfigError(f"--copy-engine: {cfg.copy_engine!r} is not auto, host or cuda")
    if cfg.cuda_backend not in ("auto", "kernel", "batch"):
        raise ConfigError(f"--cuda-backend: {cfg.cuda_backend!r} is not auto, kernel or batch")
    if cfg.copy_threads <= 0 or cfg.offload_piece_bytes <= 0:
        raise ConfigError("--copy-threads and --offload-piece-bytes must be positive")
    if cfg.disk_queue_depth < 1:
        raise ConfigError(f"--disk-queue-depth must be at least 1, got {cfg.disk_queue_depth}")
    if cfg.demote_min_seen < 1:
        raise ConfigError(f"--demote-min-seen must be at least 1, got {cfg.demote_min_seen}")
    if cfg.disk_write_through and not cfg.disk_dir:
        raise ConfigError("--disk-write-through needs a disk tier: set --disk-dir")
    if cfg.event_log_keys <= 0:
        raise ConfigError("--event-log-keys must be positive")
    return cfg

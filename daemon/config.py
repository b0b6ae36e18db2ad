"""kvtierd configuration: one typed dataclass, every setting a flag, an env var and a TOML key.

Each setting has one name: ``host_capacity`` is ``--host-capacity`` on the command line,
``KVTIER_HOST_CAPACITY`` in the environment and ``host_capacity`` in the TOML file given by
``--config`` (or ``KVTIER_CONFIG``). A flag beats an env var beats the file beats the default.
Sizes accept units (``64GiB``, ``512MB``, ``4096``); durations are seconds; a boolean setting
is a switch (``--insecure-tcp``, ``--no-insecure-tcp``). The mechanism (fields with help,
parser and metavar; flags, variables and the file) is :mod:`kvtier.settings`, shared with
``kvtier route-server`` and ``kvtier gateway``.

The settings are grouped by subsystem, one nested dataclass each (:class:`Config` lists them);
grouping changes no name: the flag, the variable and the TOML key stay flat, and so does the
Python attribute (``cfg.host_capacity`` reads ``cfg.host.host_capacity``). Each group's checks
are beside it at the end of the module (:func:`load_config` runs them all).
"""

from __future__ import annotations

import argparse
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.paths import default_socket_path
from kvtier.settings import (
    Settings,
    SettingsError,
    flag_name,
    flat_access,
    group,
    parse_bool,
    parse_float,
    parse_int,
    parse_list,
    parse_size,
)
from kvtier.settings import setting as _opt
from kvtier.tiers.policy import DEMOTE_AHEAD_BYTES, DEMOTE_MIN_SEEN

__all__ = ["SETTINGS", "Config", "ConfigError", "build_parser", "flag_name", "load_config", "parse_bool", "parse_size"]

ConfigError = SettingsError
"""A setting that cannot be used; the message names it and where it came from."""

# Defaults that modules' constructors share with their settings (each knob's default, once)
EVENT_LOG_KEYS = 1 << 20
EVENT_LOG_BYTES = 64 << 20
PEER_TIMEOUT_S = 5.0
PEER_RESOLVE_S = 10.0
PEER_BACKOFF_MAX_S = 30.0
PEER_CHUNK_BYTES = 1024**2
PEER_WINDOW_BYTES = 32 * 1024**2
STORE_NAMESPACE = "default"
STORE_TTL_S = 3600.0
STORE_TIMEOUT_S = 2.0
STORE_QUEUE_BYTES = 256 * 1024**2
MOONCAKE_SEGMENT_BYTES = 512 * 1024**2
MOONCAKE_BUFFER_BYTES = 128 * 1024**2
HELLO_TIMEOUT_S = 10.0
"""Seconds a credential-socket connection has to send its hello."""
MAX_PENDING_PER_UID = 16
"""Credential-socket connections of one admitted uid waiting for their hello at once."""
FD_RESERVE = 256
"""File descriptors kept free for accepting clients, handshakes and disk I/O."""

TENANT_SHARE_DIVISOR = 4
"""By default, on a daemon with several tenants, one tenant may take a quarter of each
per-daemon limit (sessions, feed subscribers, layouts, slot sizes, reporting workers)."""


def parse_ids(value: str | Sequence[str] | Sequence[int]) -> tuple[int, ...]:
    """Numeric uids or gids: ``"1000,1001"`` (a variable), a list (TOML, repeated flags)."""
    items = [value] if isinstance(value, int) else parse_list(value) if isinstance(value, str) else value
    out = []
    for item in items:
        for part in parse_list(item) if isinstance(item, str) else [item]:
            try:
                n = int(part)
            except (TypeError, ValueError):
                raise ValueError(f"not a numeric id: {part!r}") from None
            if n < 0:
                raise ValueError(f"not a numeric id: {part!r}")
            out.append(n)
    return tuple(out)


def parse_share(value: str | int) -> str:
    """A size (``4GiB``, a byte count) or a percentage of the whole (``25%``), kept as written
    (:func:`share_bytes` reads it). Raises ValueError naming the input."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"not a size: {value!r}")
        return str(value)
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = math.nan
        if not 0 <= pct <= 100:
            raise ValueError(f"not a percentage from 0% to 100%: {value!r}")
        return text
    parse_size(text)
    return text


def share_bytes(share: str, whole: int) -> int:
    """Bytes of a :func:`parse_share` value: its size, or its percentage of ``whole``."""
    if share.endswith("%"):
        return int(whole * float(share[:-1]) / 100)
    return parse_size(share)


def parse_entries(value: str | Sequence[str]) -> tuple[str, ...]:
    """Comma-separated entries, from a variable, a list (TOML) or repeated flags, each of which
    may itself list several: ``--tenants 1000=alice,1001=bob`` is two entries."""
    items = [value] if isinstance(value, str) else value
    return tuple(part for item in items for part in parse_list(str(item)))


# -- the groups ----------------------------------------------------------------------------------

@dataclass
class TransportSettings:
    """Where the daemon listens, who it serves as which tenant, and the secret keys derive from."""

    socket: str = _opt("", "unix socket to serve on (default $XDG_RUNTIME_DIR/kvtier/kvtierd.sock, "
                           "else /tmp/kvtier-$UID/kvtierd.sock); created mode 0600 (0666 when "
                           "--allowed-uids/--allowed-gids admit other users), with the credential socket "
                           "PATH.auth beside it. Its directory must be this user's, not a symlink, and "
                           "mode 0700 (0711 at most when other users are admitted): any other is refused; "
                           "a missing one is created so", metavar="PATH")
    tcp: str = _opt("", "also listen on HOST:PORT (TCP, for remote routers), with TLS and client "
                        "certificates (--tls-cert, --tls-key, --tls-ca; refused without them unless "
                        "--insecure-tcp); refuses to start if the port is taken; empty: no TCP listener",
                    metavar="HOST:PORT")
    tcp_services: str = _opt("locations", "what --tcp serves: locations (the location feed and health: "
                                          "what remote routers need) or all (adds Node and Transfer, for "
                                          "remote engines); the unix socket always serves all")
    tls_cert: str = _opt("", "PEM certificate (chain) of the --tcp listener", metavar="FILE")
    tls_key: str = _opt("", "PEM private key of --tls-cert", metavar="FILE")
    tls_ca: str = _opt("", "PEM CA certificate(s) that sign the clients' certificates: --tcp requires every "
                           "client to present one (mutual TLS)", metavar="FILE")
    insecure_tcp: bool = _opt(False, "serve --tcp without TLS: anyone who reaches the port is served, as "
                                     "tenant 'default', and the daemon warns so at start; refused "
                                     "without this when --tcp has no --tls-cert", parse_bool, "BOOL")
    allowed_uids: tuple[int, ...] = _opt((), "uids admitted on the unix socket (each client's uid is read from "
                                             "the kernel on the credential socket); none given: this "
                                             "daemon's own uid only. Admitting another uid makes the socket "
                                             "files 0666 and lets the socket directory be 0711",
                                         parse_ids, "UID", repeat=True)
    allowed_gids: tuple[int, ...] = _opt((), "gids admitted on the unix socket (a client whose primary gid is "
                                             "listed); none given: none", parse_ids, "GID", repeat=True)
    tenants: tuple[str, ...] = _opt((), "who is which tenant: UID=TENANT for unix-socket clients (unmapped "
                                        "admitted uids are tenant 'default'), cn:NAME=TENANT for TCP "
                                        "clients whose certificate's common name is NAME (unmapped: the "
                                        "tenant 'cn:NAME', apart from every other tenant; a certificate "
                                        "with more than one common name is refused); e.g. "
                                        "1000=alice,1001=bob,cn:router-1=alice", parse_entries, "ENTRY",
                                    repeat=True)
    credential_hello_timeout_s: float = _opt(HELLO_TIMEOUT_S, "a credential-socket connection that sends no hello within this "
                                                  "many seconds is refused and closed", parse_float, "SECONDS")
    max_pending_handshakes_per_uid: int = _opt(MAX_PENDING_PER_UID, "most credential-socket connections of one admitted uid "
                                                   "waiting for their hello at once; one more is refused "
                                                   "RESOURCE_EXHAUSTED and closed at accept (a uid not admitted "
                                                   "is closed at accept, never counted)", parse_int, "N")
    grpc_idle_s: float = _opt(10.0, "a unix-socket gRPC connection with no call in flight for this many seconds "
                                    "(one that never makes a call included) is closed; clients reconnect at "
                                    "their next call", parse_float, "SECONDS")
    node_id: str = _opt("", "this node's name in events, metrics and routing (default: hostname)")
    key_secret_file: str = _opt("", "the deployment's secret (32 random bytes, created 0600 on first use) "
                                    "each tenant's key salt is derived from (HMAC of the tenant name), "
                                    "handed to local clients in the credential handshake; default: "
                                    "key.secret in --disk-dir, else in --state-dir; with neither, a new "
                                    "secret each run (keys then change at every restart; warned at "
                                    "start)", metavar="FILE")
    state_dir: str = _opt("", "where the key secret (--key-secret-file) is kept when there is no "
                              "--disk-dir; kvtierd keeps no other state outside --shm-dir (host pool, "
                              "key table) and --disk-dir (disk tier)", metavar="DIR")


@dataclass
class HostTierSettings:
    """The host tier: the pool of KV blocks in shared memory."""

    shm_dir: str = _opt("/dev/shm", "tmpfs directory for the host pool and key table files; in a "
                                    "container mount a tmpfs this large", metavar="DIR")
    host_capacity: int = _opt(8 * 1024**3, "bytes of host memory for KV blocks, all slot sizes together (e.g. 64GiB)",
                              parse_size,
                              "SIZE")
    host_prefault: bool = _opt(True, "allocate the host pool's memory when the first layout registers (about 0.25 s/GiB), so "
                                     "writes never pay for page allocation and a too-small tmpfs is "
                                     "found at once", parse_bool, "BOOL")
    retention_budget: str = _opt("25%", "slot bytes of retained blocks (Retain: a prompt cache's TTL hints) one "
                                        "tenant may hold at once, a size or a percentage of --host-capacity; a "
                                        "retained block is evicted only when nothing unretained is left to "
                                        "evict, until its TTL. A retain over the budget releases the tenant's "
                                        "retentions of no higher priority, lowest priority and least recently "
                                        "retained first, or is refused RESOURCE_EXHAUSTED when they cannot make "
                                        "room; 0: retention off (every Retain refused RESOURCE_EXHAUSTED)",
                                 parse_share, "SIZE|PCT%")


@dataclass
class DiskTierSettings:
    """The disk tier, and which host victims are written to it."""

    disk_dir: str = _opt("", "directory for the disk tier's O_DIRECT slab files and LMDB index, one daemon per "
                              "directory (locked); empty: no disk tier",
                         metavar="DIR")
    disk_capacity: int = _opt(0, "bytes of disk for KV blocks (e.g. 1TiB); 0 with --disk-dir set: "
                                 "90% of the free space", parse_size, "SIZE")
    disk_queue_depth: int = _opt(8, "disk I/Os in flight at once (O_DIRECT reads and writes)", parse_int, "N")
    disk_map_size: int = _opt(0, "LMDB map size of the disk index (its most bytes); 0: 256 B per 4 KiB "
                                 "of --disk-capacity, at least 64MiB", parse_size, "SIZE")
    demote_min_seen: int = _opt(DEMOTE_MIN_SEEN, "when the disk's write queue is full (--demote-queue-bytes), demote a "
                                   "block evicted from host to disk only if it was put or hit at least this "
                                   "many times (1: every evicted block)", parse_int, "N")
    demote_queue_bytes: int = _opt(64 * 1024**2, "every host victim is demoted to disk while the disk's "
                                                 "write queue (demotions being written) holds less than this "
                                                 "many bytes; beyond it only blocks seen --demote-min-seen "
                                                 "times are (0: always only those)", parse_size, "SIZE")
    demote_ahead_bytes: int = _opt(DEMOTE_AHEAD_BYTES, "write the host's least recently used blocks within this many "
                                                  "bytes of eviction to disk before they are evicted, while the "
                                                  "write queue (--demote-queue-bytes) has room: their eviction then "
                                                  "frees the slot at once, without a copy or a wait (at most a "
                                                  "quarter of --host-capacity and 256 blocks; 0: off)", parse_size, "SIZE")
    disk_write_through: bool = _opt(False, "write every committed block to disk before acknowledging it "
                                           "(as if every put were durable); needs --disk-dir", parse_bool,
                                    "BOOL")
    disk_allow_tmpfs: bool = _opt(False, "let --disk-dir be on a tmpfs or ramfs: the disk tier is then "
                                         "memory beside the host pool, lost at reboot, and without "
                                         "--disk-capacity sized at 90% of that memory; refused "
                                         "without this", parse_bool, "BOOL")
    disk_recheck_s: float = _opt(10.0, "how often a degraded disk tier checks whether it can take writes again: a "
                                       "full filesystem once it has room again, any other failure by retrying",
                                 parse_float, "SECONDS")


@dataclass
class GpuSettings:
    """The copy engine: KV copies between the engines' memory and the host pool."""

    copy_engine: str = _opt("auto", "engine KV copies (Transfer service): cuda (needs cupy and a GPU; "
                                    "refuse to start without), host (CPU stand-in only), or auto (cuda "
                                    "when cupy is installed and a GPU is visible); host-memory engines "
                                    "are always served")
    cuda_device: int = _opt(0, "CUDA device ordinal the copy engine starts on; each engine's copies run on "
                               "the GPU its KV memory is on (matched by UUID: one kvtierd serves every GPU it "
                               "sees); clients that send no UUID must be on this one", parse_int, "N")
    cuda_backend: str = _opt("auto", "GPU copy method: kernel (gather/scatter kernel over the pinned "
                                     "pool), batch (cudaMemcpyBatchAsync), or auto (chosen per batch: kernel for 16-byte "
                                     "aligned chunks under 1 MiB, else batch)")
    copy_threads: int = _opt(4, "memcpy threads of the host copy engine; also the threads touching the "
                                "pool before cudaHostRegister", parse_int, "N")
    offload_piece_bytes: int = _opt(8 * 1024**2, "offloads are copied in pieces of at most this many "
                                                  "bytes so onboards never wait behind a whole offload",
                                    parse_size, "SIZE")


@dataclass
class FeedSettings:
    """The location feed routers follow, and the vLLM-format KV event stream."""

    event_log_keys: int = _opt(EVENT_LOG_KEYS, "keys of location events kept for routers to resume from; a "
                                        "router further behind gets a snapshot instead", parse_int, "N")
    event_log_bytes: int = _opt(EVENT_LOG_BYTES, "most bytes of daemon memory each tenant's location-event ring may take "
                                          "(its keys and about 256 bytes per event), beside --event-log-keys; older "
                                          "events are dropped first (a subscriber that fell behind them gets a "
                                          "snapshot)", parse_size, "SIZE")
    max_feed_subscribers: int = _opt(64, "most WatchLocations subscribers (routers) served at once; one more is "
                                         "refused RESOURCE_EXHAUSTED. A subscriber that falls further behind than "
                                         "--event-log-keys keys of events is dropped (RESOURCE_EXHAUSTED) and "
                                         "resubscribes", parse_int, "N")
    kv_events_endpoint: str = _opt("", "publish the host and disk tiers' holdings as a vLLM-format KV event "
                                       "stream (ZMQ PUB: BlockStored and BlockRemoved, medium CPU for host and STORAGE for "
                                       "disk) for llm-d's KV indexer and other readers of vLLM's events (not "
                                       "Dynamo's KV router: docs/integrations.md); as "
                                       "vLLM's endpoint: tcp://*:PORT or ipc://PATH is bound (refuses to "
                                       "start if taken), tcp://HOST:PORT is connected to a reader that binds; "
                                       "needs pip install -e '.[events]' in a kvtier checkout; empty: off", metavar="ENDPOINT")
    kv_events_replay_endpoint: str = _opt("", "also answer vLLM's replay requests for the last 10000 batches (at most 64MiB) on this "
                                              "ZMQ ROUTER endpoint (bound); empty: no replay",
                                          metavar="ENDPOINT")
    kv_events_topic: str = _opt("kv@{node_id}@kvtier", "topic of every KV event message; {node_id} becomes "
                                                       "--node-id; llm-d reads kv@POD@MODEL, so put the "
                                                       "served model name last", metavar="TOPIC")


@dataclass
class PeerSettings:
    """Blocks fetched from other daemons' host and disk tiers, and served to them."""

    peer_serve: bool = _opt(False, "serve the Peer service on --tcp: other daemons fetch this node's host and "
                                   "disk blocks, each only of the tenant its client certificate names "
                                   "(--tenants cn:NAME=TENANT); needs --tcp", parse_bool, "BOOL")
    peers: tuple[str, ...] = _opt((), "other daemons to fetch blocks from: the HOST:PORT of their --tcp "
                                      "listeners (which need --peer-serve); a DNS name stands for every A/AAAA "
                                      "record it resolves to (a Kubernetes headless Service), re-resolved every "
                                      "--peer-resolve-s; each peer's node id is learned from it (GetNodeInfo). "
                                      "e.g. 10.0.0.2:7070,kvtier.ns.svc.cluster.local:7070",
                                  parse_entries, "HOST:PORT", repeat=True)
    peer_read_through: bool = _opt(False, "a get of a block no local tier holds asks every live --peers whether it "
                                          "holds it (one Holds call each, at once) and fetches it from one of "
                                          "them into host; off: only Prefetch with from_node fetches from peers",
                                   parse_bool, "BOOL")
    peer_tls_cert: str = _opt("", "client certificate (PEM) for calls to --peers; default --tls-cert. The peers "
                                  "serve the tenant its common name maps to (their --tenants); a fetch for "
                                  "another tenant is refused", metavar="FILE")
    peer_tls_key: str = _opt("", "PEM private key of --peer-tls-cert; default --tls-key", metavar="FILE")
    peer_tls_ca: str = _opt("", "PEM CA certificate(s) that sign the peers' server certificates; default "
                                "--tls-ca", metavar="FILE")
    peer_tenant_certs: tuple[str, ...] = _opt((), "a client certificate per tenant for calls to --peers, "
                                                  "TENANT=CERT:KEY (PEM files): this daemon fetches a "
                                                  "tenant's blocks with its own certificate, whose common "
                                                  "name the peers map to TENANT (their --tenants "
                                                  "cn:NAME=TENANT); tenants not listed use "
                                                  "--peer-tls-cert", parse_entries, "ENTRY",
                                              repeat=True)
    peer_timeout_s: float = _opt(PEER_TIMEOUT_S, "most seconds a call to a peer waits for its next reply (its node info, a "
                                      "Holds answer, the next chunk of a fetch); past it the call is cut, the "
                                      "keys not yet complete are misses and the peer is marked down",
                                 parse_float, "SECONDS")
    peer_resolve_s: float = _opt(PEER_RESOLVE_S, "re-resolve the --peers names and ask new peers their node id this often",
                                 parse_float, "SECONDS")
    peer_backoff_max_s: float = _opt(PEER_BACKOFF_MAX_S, "a peer that stops answering is marked down and tried again after "
                                           "0.5 s, doubling up to this", parse_float, "SECONDS")
    peer_chunk_bytes: int = _opt(PEER_CHUNK_BYTES, "payload bytes per message of a peer fetch (64KiB to 4MiB)",
                                 parse_size, "SIZE")
    peer_window_bytes: int = _opt(PEER_WINDOW_BYTES, "payload bytes of a peer fetch held in memory at once on each "
                                                "side: the serving daemon reads this many blocks' bytes at a "
                                                "time, the fetching one puts arrived blocks into host once it "
                                                "holds this many", parse_size, "SIZE")
    peer_serve_delay_s: float = _opt(0.0, "for tests and demos only: the Peer service pauses this long after "
                                          "each chunk it sends (a slow link); 0: no pause", parse_float, "SECONDS")


@dataclass
class StoreSettings:
    """The shared store (Redis Cluster or Mooncake Store): the remote tier daemons write
    behind to and read through."""

    store_redis: str = _opt("", "the shared store: startup nodes of a Redis Cluster, HOST:PORT,... (the "
                                "remote tier other daemons read through); empty: no store", metavar="HOST:PORT,...")
    store_backend: str = _opt("redis", "what the shared store runs on: redis (a Redis Cluster, --store-redis) or "
                                       "mooncake (a Mooncake Store, --store-mooncake-master; needs pip install -e '.[mooncake]' "
                                       "in a kvtier checkout, and libibverbs1, libnuma1 and libcurl4)",
                              metavar="redis|mooncake")
    store_namespace: str = _opt(STORE_NAMESPACE, "keys in the store are kvtier:<namespace>:<tenant fingerprint>:<key>; "
                                           "daemons share blocks only within one namespace", metavar="NAME")
    store_ttl_s: float = _opt(STORE_TTL_S, "each block written to the store expires this many seconds after its "
                                      "write (Redis PX); the feed drops it from remote then", parse_float, "SECONDS")
    store_write: str = _opt("put", "when host blocks are written behind to the store: put (after each commit, "
                                   "so other nodes can read them at once), demotion (when host evicts them) "
                                   "or off (read only)", metavar="put|demotion|off")
    store_read_through: bool = _opt(True, "a get whose keys no local tier holds asks the store for them",
                                    parse_bool, "BOOL")
    store_timeout_s: float = _opt(STORE_TIMEOUT_S, "most seconds one store call may take (socket connect and read); a get "
                                       "waits at most this long on the store, then answers misses",
                                    parse_float, "SECONDS")
    store_queue_bytes: int = _opt(STORE_QUEUE_BYTES, "most payload bytes waiting to be written behind; blocks "
                                                 "beyond it are not written (store_writes_dropped)",
                                  parse_size, "SIZE")
    store_tls_cert: str = _opt("", "client certificate (PEM) for mutual TLS to the store (Redis tls-auth-clients); "
                                   "default --tls-cert", metavar="FILE")
    store_tls_key: str = _opt("", "PEM private key of --store-tls-cert; default --tls-key", metavar="FILE")
    store_tls_ca: str = _opt("", "PEM CA certificate(s) that sign the store nodes' server certificates; default "
                                 "--tls-ca. With a CA the store is reached over TLS only", metavar="FILE")
    store_plaintext: bool = _opt(False, "reach the store without TLS (a trusted network only); without it a store "
                                        "needs --store-tls-ca (or --tls-ca). Mooncake has no TLS: "
                                        "--store-backend mooncake needs this", parse_bool, "BOOL")
    store_user: str = _opt("", "Redis ACL user the daemon authenticates as (AUTH user password); empty: the "
                               "default user", metavar="NAME")
    store_password_file: str = _opt("", "file holding the Redis password (one line; mode 0600, a file group or "
                                        "others can read is refused at startup); empty: no AUTH",
                                    metavar="FILE")
    store_mooncake_master: str = _opt("", "the Mooncake master's RPC address, HOST:PORT (--store-backend "
                                          "mooncake)", metavar="HOST:PORT")
    store_mooncake_metadata: str = _opt("", "the Mooncake metadata server: http://HOST:PORT/metadata (the "
                                            "master's -enable_http_metadata_server), etcd://HOST:PORT, or "
                                            "P2PHANDSHAKE", metavar="URL")
    store_mooncake_protocol: str = _opt("tcp", "the Mooncake transfer engine's protocol: tcp or rdma",
                                        metavar="tcp|rdma")
    store_mooncake_local: str = _opt("127.0.0.1", "this node's address as other Mooncake clients reach it "
                                                  "(its segment is served from here)", metavar="HOST")
    store_mooncake_device: str = _opt("", "RDMA device names for --store-mooncake-protocol rdma; empty: auto",
                                      metavar="NAMES")
    store_mooncake_segment_bytes: int = _opt(MOONCAKE_SEGMENT_BYTES, "memory this node gives the Mooncake Store's pool "
                                                            "(its global segment)", parse_size, "SIZE")
    store_mooncake_buffer_bytes: int = _opt(MOONCAKE_BUFFER_BYTES, "this node's Mooncake transfer buffer (the most "
                                                           "bytes of one batch's puts or gets in flight)",
                                            parse_size, "SIZE")


@dataclass
class LimitSettings:
    """What one request, session, tenant and worker may take, so no caller takes the daemon."""

    max_batch_keys: int = _opt(65536, "most keys accepted in one request", parse_int, "N")
    max_concurrent_rpcs: int = _opt(4096, "most RPCs in flight at once, streams included (each client Session and "
                                          "each WatchLocations stream counts for its whole life); one more is "
                                          "refused RESOURCE_EXHAUSTED; 0: no limit", parse_int, "N")
    max_sessions: int = _opt(1024, "most Session streams open at once (each client holds one); more are refused "
                                   "RESOURCE_EXHAUSTED", parse_int, "N")
    session_quota: int = _opt(0, "most bytes of host slots one session may hold at once in grants (allocated, "
                                 "not committed) and leases (acquired, not released); over it a request is "
                                 "refused RESOURCE_EXHAUSTED; 0: half of --host-capacity (at least 64MiB, or all of "
                                 "a smaller pool)", parse_size, "SIZE")
    tenant_quota: int = _opt(0, "most bytes of host slots the sessions of one tenant may hold at once in grants "
                                "and leases; 0: all of --host-capacity", parse_size, "SIZE")
    grant_ttl_s: float = _opt(60.0, "a grant not committed within this many seconds is aborted (its slot given "
                                    "back); a later Commit of it is refused DEADLINE_EXCEEDED", parse_float, "SECONDS")
    lease_ttl_s: float = _opt(60.0, "a lease not released within this many seconds is unpinned; a later Release "
                                    "of it is refused DEADLINE_EXCEEDED", parse_float, "SECONDS")
    transfer_wait_s: float = _opt(30.0, "most seconds an offload waits for the engine's \"KV written\" record; "
                                        "past it the request is refused DEADLINE_EXCEEDED and gives back its "
                                        "slots", parse_float, "SECONDS")
    # tenant shares: no tenant may take a whole per-daemon limit (docs/SECURITY.md)
    max_sessions_per_tenant: int = _opt(0, "most Session streams the callers of one tenant may hold open at once; "
                                           "more are refused RESOURCE_EXHAUSTED while other tenants still open "
                                           "theirs; 0: --max-sessions on a single-tenant daemon (see "
                                           "--max-layouts-per-tenant), else a quarter of it", parse_int, "N")
    max_feed_subscribers_per_tenant: int = _opt(0, "most WatchLocations subscribers of one tenant at once; one more "
                                                   "is refused RESOURCE_EXHAUSTED; 0: --max-feed-subscribers when no "
                                                   "--tenants entry names a tenant other than 'default' and there is "
                                                   "no TLS listener (any --tcp-services), else a quarter of it",
                                                parse_int, "N")
    max_layouts_per_tenant: int = _opt(0, "most layouts one tenant may register (the daemon takes 256 in all); one "
                                          "more is refused RESOURCE_EXHAUSTED. 0: all 256 on a single-tenant daemon "
                                          "(no --tenants entry names a tenant other than 'default', and no TLS "
                                          "listener with --tcp-services all, whose client certificates' common "
                                          "names are tenants), else 64, a quarter", parse_int, "N")
    max_slot_sizes_per_tenant: int = _opt(0, "most distinct slot sizes (host pool files) one tenant's layouts may "
                                             "use (the daemon takes 16 in all); a layout needing one more is refused "
                                             "RESOURCE_EXHAUSTED; 0: all 16 on a single-tenant daemon, else 4",
                                          parse_int, "N")
    max_workers_per_tenant: int = _opt(0, "most engine workers (worker ids) of one tenant reporting device blocks "
                                          "(ReportDeviceBlocks; the daemon takes 1024 in all); a new one more is "
                                          "refused RESOURCE_EXHAUSTED; 0: all 1024 on a single-tenant daemon, "
                                          "else 256", parse_int, "N")
    max_device_blocks_per_worker: int = _opt(1 << 21, "most device blocks one worker may report held, all its "
                                                      "ranks' layouts together (each costs the daemon about 250 "
                                                      "bytes); a report that would hold more is refused "
                                                      "RESOURCE_EXHAUSTED and changes nothing", parse_int, "N")
    max_kv_registrations_per_session: int = _opt(16, "most KV registrations (RegisterKV) one session may hold "
                                                     "open; one more is refused RESOURCE_EXHAUSTED", parse_int, "N")
    max_kv_registrations_per_tenant: int = _opt(0, "most KV registrations the sessions of one tenant may hold "
                                                   "open; one more is refused RESOURCE_EXHAUSTED; 0: the tenant's "
                                                   "share of --max-sessions (--max-sessions-per-tenant)",
                                                parse_int, "N")
    # descriptors passed over the credential socket and kept until a call uses them
    max_passed_fds_per_connection: int = _opt(256, "most passed file descriptors one credential connection may "
                                                   "have kept, not yet used (64 a pass); a pass over it is "
                                                   "refused RESOURCE_EXHAUSTED and its descriptors closed",
                                              parse_int, "N")
    max_passed_fds_per_uid: int = _opt(1024, "most passed file descriptors the credential connections of one uid "
                                             "may have kept, not yet used", parse_int, "N")
    max_passed_fds_per_tenant: int = _opt(2048, "most passed file descriptors the credential connections of one "
                                                "tenant may have kept, not yet used", parse_int, "N")
    fd_reserve: int = _opt(FD_RESERVE, "file descriptors of the daemon's RLIMIT_NOFILE kept free for accepting clients, "
                                "their handshakes and calls, and disk I/O: descriptors passed while fewer are free "
                                "are closed at once and their connection refused RESOURCE_EXHAUSTED",
                           parse_int, "N")


@dataclass
class TelemetrySettings:
    """Logs and Prometheus metrics."""

    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("json", "json (one object a line) or text")
    metrics_port: int = _opt(0, "serve Prometheus metrics (kvtier_*) on this TCP port (0: off)", parse_int, "PORT")
    metrics_host: str = _opt("127.0.0.1", "address for the metrics listener", metavar="HOST")


@flat_access
@dataclass
class Config:
    """Every kvtierd setting, grouped by subsystem; each also an attribute of its own name
    (``cfg.disk_dir``). See the module docstring for names and precedence."""

    transport: TransportSettings = group(TransportSettings, "Transport and security")
    host: HostTierSettings = group(HostTierSettings, "Host tier")
    disk: DiskTierSettings = group(DiskTierSettings, "Disk tier")
    gpu: GpuSettings = group(GpuSettings, "GPU copies")
    feed: FeedSettings = group(FeedSettings, "Location feed and KV events")
    peering: PeerSettings = group(PeerSettings, "Peers")
    store: StoreSettings = group(StoreSettings, "Shared store")
    limits: LimitSettings = group(LimitSettings, "Limits: requests, sessions, quotas and tenant shares")
    telemetry: TelemetrySettings = group(TelemetrySettings, "Logging and metrics")
    config: str = _opt("", "TOML file with any of these settings, each under its TOML key: the flag's "
                           "name without -- and with _ for - (host_capacity = \"64GiB\")", metavar="FILE")

    def resolved_socket(self) -> str:
        return self.socket or default_socket_path()

    def retention_budget_bytes(self) -> int:
        """--retention-budget in bytes (a percentage of --host-capacity resolved)."""
        return share_bytes(self.retention_budget, self.host_capacity)

    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    def single_tenant(self, service: str = "node") -> bool:
        """Whether every caller that can use ``service`` is the one tenant ``default``: no
        ``--tenants`` entry names another tenant, and no TLS listener serves it (its clients
        are the tenants their certificates' common names map to, or tenants of their own). ``service``:
        "node" (sessions, layouts and device reports, which need a session: served on TCP only
        with ``--tcp-services all``) or "locations" (the feed: served on every TCP listener)."""
        named = {entry.partition("=")[2].strip() for entry in self.tenants}
        tls = bool(self.tcp and self.tls_cert) and (service == "locations" or self.tcp_services == "all")
        return named <= {"default"} and not tls

    def tenant_share(self, name: str, limit: int) -> int:
        """One tenant's share of the per-daemon ``limit``: the ``*_per_tenant`` setting ``name``
        when set, else (0) the whole of it on a single-tenant daemon, a quarter (at least 1)
        on any other (see :meth:`single_tenant`); never more than ``limit``."""
        value = getattr(self, name)
        if not value:
            one = self.single_tenant("locations" if name == "max_feed_subscribers_per_tenant" else "node")
            value = limit if one else max(1, limit // TENANT_SHARE_DIVISOR)
        return min(value, limit)


SETTINGS = Settings(
    Config, "KVTIER_", "kvtierd",
    description="kvtierd: per-node KV-cache tier daemon (GPU HBM -> pinned host -> NVMe).",
    epilog="Every flag is also an env var (--host-capacity: KVTIER_HOST_CAPACITY) and a key of the "
           "--config TOML file (host_capacity). Precedence: flag > env > file > default. A boolean "
           "setting is a switch (--insecure-tcp, --no-insecure-tcp); its env var and key take true or false.")


def build_parser(prog: str = "kvtierd") -> argparse.ArgumentParser:
    ap = SETTINGS.parser()
    ap.prog = prog
    return ap


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Parse flags, env and the TOML file into a :class:`Config` (flag > env > file > default)."""
    cfg: Config = SETTINGS.load(argv, env)
    _check(cfg)
    return cfg


def _check(cfg: Config) -> None:
    """Refuse values no part of the daemon can use, naming the flag: each group's checks."""
    _check_choices(cfg)
    _check_host_and_gpu(cfg)
    _check_disk(cfg)
    _check_feed(cfg)
    _check_sessions(cfg)
    _check_tenant_shares(cfg)
    _check_transport(cfg)
    _check_peers(cfg)
    _check_store(cfg)


def _check_choices(cfg: Config) -> None:
    """The settings that name one of a few choices."""
    choices = (("log_format", ("json", "text")), ("log_level", ("debug", "info", "warning", "error")),
               ("copy_engine", ("auto", "host", "cuda")), ("cuda_backend", ("auto", "kernel", "batch")))
    for name, allowed in choices:
        value = getattr(cfg, name)
        if (value.lower() if name == "log_level" else value) not in allowed:
            raise ConfigError(f"{flag_name(name)}: {value!r} is not {', '.join(allowed[:-1])} or {allowed[-1]}")


def _check_host_and_gpu(cfg: Config) -> None:
    """The host pool's size and the copy engine's threads and pieces."""
    if cfg.host_capacity <= 0:
        raise ConfigError("--host-capacity must be positive")
    if cfg.copy_threads <= 0 or cfg.offload_piece_bytes <= 0:
        raise ConfigError("--copy-threads and --offload-piece-bytes must be positive")


def _check_disk(cfg: Config) -> None:
    """The disk tier's queue, its admission and its recheck of a degraded disk."""
    for name in ("disk_queue_depth", "demote_min_seen"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{flag_name(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.disk_write_through and not cfg.disk_dir:
        raise ConfigError("--disk-write-through needs a disk tier: set --disk-dir")
    if cfg.disk_recheck_s < 0:
        raise ConfigError("--disk-recheck-s must be at least 0")


def _check_feed(cfg: Config) -> None:
    """The location event log's bounds and the feed's and the RPCs' limits."""
    if cfg.event_log_keys <= 0:
        raise ConfigError("--event-log-keys must be positive")
    if cfg.event_log_bytes <= 0:
        raise ConfigError("--event-log-bytes must be positive")
    if cfg.max_feed_subscribers < 1 or cfg.max_concurrent_rpcs < 0:
        raise ConfigError("--max-feed-subscribers must be at least 1 and --max-concurrent-rpcs at least 0")


def _check_sessions(cfg: Config) -> None:
    """The sessions' quotas (0: the default) and their deadlines and number (positive)."""
    for name in ("session_quota", "tenant_quota", "grant_ttl_s", "lease_ttl_s", "max_sessions", "transfer_wait_s"):
        if not getattr(cfg, name) >= (0 if name.endswith("quota") else 1e-9):
            raise ConfigError(f"{flag_name(name)} must be {'at least 0' if name.endswith('quota') else 'positive'}")


def _check_tenant_shares(cfg: Config) -> None:
    """The per-tenant shares: 0 (the default share) or at most their per-daemon limit."""
    from kvtier.daemon.device import MAX_WORKERS
    from kvtier.tiers.layout import MAX_LAYOUTS, MAX_SLOT_SIZES

    whole = {"max_sessions_per_tenant": ("--max-sessions", cfg.max_sessions),
             "max_feed_subscribers_per_tenant": ("--max-feed-subscribers", cfg.max_feed_subscribers),
             "max_layouts_per_tenant": ("the daemon's 256 layouts", MAX_LAYOUTS),
             "max_slot_sizes_per_tenant": ("the daemon's 16 slot sizes", MAX_SLOT_SIZES),
             "max_workers_per_tenant": ("the daemon's 1024 workers", MAX_WORKERS)}
    for name, (what, limit) in whole.items():
        value = getattr(cfg, name)
        if not 0 <= value <= limit:
            raise ConfigError(f"{flag_name(name)} must be between 0 (the default share) and {what} ({limit}), "
                              f"got {value}")
    if cfg.max_device_blocks_per_worker < 1:
        raise ConfigError("--max-device-blocks-per-worker must be at least 1")
    for name in ("max_kv_registrations_per_session", "max_passed_fds_per_connection", "max_passed_fds_per_uid",
                 "max_passed_fds_per_tenant", "max_pending_handshakes_per_uid"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{flag_name(name)} must be at least 1")
    for name in ("max_kv_registrations_per_tenant", "fd_reserve"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{flag_name(name)} must be at least 0")
    for name in ("credential_hello_timeout_s", "grpc_idle_s"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{flag_name(name)} must be positive")


def _check_transport(cfg: Config) -> None:
    """The tenants' map, what TCP serves, and TLS: all three files, or plaintext when asked for."""
    from kvtier.daemon.auth import parse_tenants

    try:
        parse_tenants(cfg.tenants)
    except ValueError as e:
        raise ConfigError(f"--tenants: {e}") from None
    if cfg.tcp_services not in ("locations", "all"):
        raise ConfigError(f"--tcp-services: {cfg.tcp_services!r} is not locations or all")
    tls = [name for name in ("tls_cert", "tls_key", "tls_ca") if getattr(cfg, name)]
    if tls and len(tls) != 3:
        missing = [flag_name(n) for n in ("tls_cert", "tls_key", "tls_ca") if not getattr(cfg, n)]
        raise ConfigError(f"TLS needs --tls-cert, --tls-key and --tls-ca together (client certificates are "
                          f"required); missing {', '.join(missing)}")
    if tls and cfg.insecure_tcp:
        raise ConfigError("--insecure-tcp and --tls-cert contradict each other: pick one")
    if cfg.tcp and not tls and not cfg.insecure_tcp:
        raise ConfigError(f"--tcp {cfg.tcp} without TLS would serve anyone who reaches the port: give "
                          f"--tls-cert, --tls-key and --tls-ca (clients then need a certificate signed by "
                          f"--tls-ca), or pass --insecure-tcp to serve it in plaintext anyway")


def _check_peers(cfg: Config) -> None:
    """The --peer-* settings: a listener to serve on, addresses, certificates and numbers."""
    if cfg.peer_serve and not cfg.tcp:
        raise ConfigError("--peer-serve needs --tcp: peers fetch over the TCP listener")
    for entry in cfg.peers:
        host, _, port = entry.rpartition(":")
        if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--peers: {entry!r} is not HOST:PORT")
    for entry in cfg.peer_tenant_certs:
        tenant, sep, files = entry.partition("=")
        cert, sep2, key = files.partition(":")
        if not (tenant and sep and cert and sep2 and key):
            raise ConfigError(f"--peer-tenant-certs: {entry!r} is not TENANT=CERT:KEY")
    _check_peer_numbers(cfg)
    tls = cfg.peer_tls_cert or cfg.tls_cert
    if cfg.peers and not tls and not cfg.insecure_tcp:
        raise ConfigError("--peers needs a client certificate for the peers' mutual TLS: --peer-tls-cert, "
                          "--peer-tls-key and --peer-tls-ca (or --tls-cert, --tls-key, --tls-ca); only with "
                          "--insecure-tcp are peers called in plaintext")
    if bool(cfg.peer_tls_cert) != bool(cfg.peer_tls_key):
        raise ConfigError("--peer-tls-cert and --peer-tls-key go together")


def _check_peer_numbers(cfg: Config) -> None:
    if not 64 * 1024 <= cfg.peer_chunk_bytes <= 4 * 1024**2:
        raise ConfigError(f"--peer-chunk-bytes {cfg.peer_chunk_bytes} is not between 64KiB and 4MiB")
    if cfg.peer_window_bytes < cfg.peer_chunk_bytes:
        raise ConfigError("--peer-window-bytes must be at least --peer-chunk-bytes")
    for name in ("peer_timeout_s", "peer_resolve_s", "peer_backoff_max_s"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{flag_name(name)} must be positive")
    if cfg.peer_serve_delay_s < 0:
        raise ConfigError("--peer-serve-delay-s must be at least 0")


def _check_store(cfg: Config) -> None:
    """The shared store's settings: what is written and how long it lives here, the transport
    and the backend in :func:`kvtier.daemon.remote_store.check_settings`."""
    if cfg.store_write not in ("put", "demotion", "off"):
        raise ConfigError(f"--store-write: {cfg.store_write!r} is not put, demotion or off")
    if not cfg.store_ttl_s > 0 or not cfg.store_timeout_s > 0:
        raise ConfigError("--store-ttl-s and --store-timeout-s must be positive")
    if cfg.store_queue_bytes < 0:
        raise ConfigError("--store-queue-bytes must be at least 0")
    if not cfg.store_namespace or ":" in cfg.store_namespace:
        raise ConfigError(f"--store-namespace: {cfg.store_namespace!r} must be non-empty and without ':'")
    for node in parse_list(cfg.store_redis):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--store-redis: {node!r} is not HOST:PORT")
    from kvtier.daemon.remote_store import check_settings

    check_settings(cfg)

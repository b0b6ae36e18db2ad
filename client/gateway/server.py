"""``kvtier gateway``: an OpenAI-compatible front door that sends each request to the replica
holding its prefix.

Serves ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not),
``GET /v1/models`` and ``GET /health`` (``GET /metrics`` only on ``--metrics-port``). Per request: read the JSON body,
check the model, tokenize the prompt as the replicas do (:mod:`.tokenize`), compute the block
keys the replicas' kvtierds publish (:mod:`.keys`), order the healthy replicas by the policy
(:mod:`.policy`; ``kvtier`` asks the in-process :class:`~kvtier.client.routing.router.Router`,
fed by the daemons' location feeds as ``route-server`` is), dispatch to the first (the
router is charged the request's prefill and marks its keys as on that replica), forward the
body unchanged and stream the answer back byte for byte, then tell the router the prefill
ended (first byte) and the request ended (last byte). A replica that refuses before any byte
was sent to the client (connection refused or reset, a timeout before the status line, a 5xx
status) is skipped for ``--down-s`` seconds and the next replica is tried, up to
``--retries`` more. A client that disconnects ends its replica's request at once; one that
takes nothing for ``--write-timeout-s`` is dropped; a body is read only once
``--max-body-bytes-in-flight`` has room for it; a replica's 5xx body is relayed up to
MAX_ERROR_BODY bytes. Replicas are ``--replica NAME=URL``; NAME is the worker id the router
knows the replica by: the ``--node-id`` of the replica's kvtierd when its engine declares no
worker (vLLM's offloading spec does not), else the engine's worker id. With
``--replica-url-template`` every worker the feeds report and no ``--replica`` names is a
replica too, at that URL (``{worker}`` and ``{node}`` replaced).

Clients: with ``--api-keys-file`` every ``/v1`` request names its client by ``Authorization:
Bearer KEY`` (else 401), and a session (the session header, else the body's ``user``) is that
client's own: the affinity key is (client id, session), so one client's session id steers
nothing of another's. Without it the gateway does not know who is asking and a session id is
advisory: whoever sends it shares its stickiness. Connections: a request head must arrive
within ``--header-timeout-s`` of connecting, an idle kept-alive connection is closed after
``--idle-timeout-s``, and one client address holds at most ``--max-connections-per-client``
connections (past it: 429 and close). Forwarded requests carry no hop-by-hop header (nor one
``Connection`` names), no ``x-kvtier-*`` header, not the session header, not the client's
``Authorization`` (the replicas get ``Authorization: Bearer`` the key of
``--replica-api-key-file`` when it is set) and ``X-Forwarded-For`` set to the client's address.
Answers name their replica (``X-Kvtier-Replica``) only with ``--replica-header``.

Libraries: aiohttp serves the clients (chunked streaming, keep-alive); the replicas are
reached by :mod:`.upstream` on the same event loop (keep-alive pools per replica, each request
one write, answers parsed by httptools and relayed chunk by chunk; https replicas through
aiohttp's client); uvloop under both, prometheus_client for the metrics, transformers for the
tokenizer and chat template.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.client.engine.keys import Namespace
from kvtier.client.engine.transport import ClientTls
from kvtier.client.gateway.hints import Hints, breakpoint_tokens, read_hints, retains
from kvtier.client.gateway.incremental import PromptCache
from kvtier.client.gateway.keys import SCHEMES, VLLM_DEFAULT_SEED, KeyScheme, has_extra_keys
from kvtier.client.gateway.policy import POLICIES, Policy
from kvtier.client.gateway.prefetch import Prefetcher
from kvtier.client.gateway.shared import SharedMap
from kvtier.client.gateway.tokenize import PromptError, PromptTokenizer
from kvtier.client.gateway.upstream import AiohttpUpstream, Replica, Upstream, UpstreamError
from kvtier.client.gateway.usage import NULL_COUNTER, OutputCounter
from kvtier.client.routing.recorder import RecordConfig, open_recorder
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.settings import (
    Settings,
    SettingsError,
    group,
    parse_bool,
    parse_float,
    parse_int,
    parse_list,
    setting,
)
from kvtier.tiers.vocab import MAX_KEYS_PER_CALL

log = logging.getLogger("kvtier.gateway")

# headers never forwarded either way (hop-by-hop, or set by the sending side itself)
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "server", "date"})
# request headers the replicas never get from the client: its credentials for the gateway and
# addresses it claims (X-Forwarded-For is set to the client's own address)
_CLIENT_ONLY = frozenset({"authorization", "cookie", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
                          "x-real-ip", "forwarded"})
INTERNAL_PREFIX = "x-kvtier-"  # kvtier's own headers: never taken from a client
_INTERNAL_RAW = INTERNAL_PREFIX.encode()
CLIENT_ID = re.compile(r"[A-Za-z0-9._@-]{1,64}")  # an --api-keys-file client id (no ":": it prefixes sessions)


INLINE_BODY_BYTES = 16384
"""Bodies up to this size are tokenized on the event loop (well under a millisecond on an idle
core); larger ones in a thread pool."""
MAX_SESSION_ID = 256  # characters of a session id kept as they are; longer ones are kept as a digest

MAX_ERROR_BODY = 64 << 10
"""A replica's 5xx answer body is relayed up to this many bytes; a longer one is not read on
(the connection is dropped) and the client gets the status with the gateway's own error body."""

REPLICA_HEADER = "X-Kvtier-Replica"
"""Response header naming the replica that answered (the body is the replica's, unchanged);
sent only with ``--replica-header``."""


@dataclass(frozen=True)
class GatewayConfig:
    """Every ``kvtier gateway`` setting (flag, ``KVTIER_GATEWAY_<NAME>``, TOML key)."""

    listen: str = setting("127.0.0.1:8000", "HOST:PORT to serve the OpenAI API on (port 0: any free port)",
                          metavar="HOST:PORT")
    replicas: tuple[str, ...] = setting((), "an engine replica: NAME=URL (NAME: the worker id the router knows it "
                                            "by, its kvtierd's --node-id for vLLM; URL: its OpenAI server, "
                                            "e.g. http://10.0.0.5:8000); repeat for several", parse_list,
                                        "NAME=URL", name="replica", repeat=True)
    replica_url_template: str = setting("", "discovery: every worker the location feeds report that no --replica "
                                            "names is a replica at this URL ({worker}, {node} replaced; e.g. "
                                            "http://{worker}.vllm.default.svc:8000)", metavar="URL")
    model: str = setting("", "the model name clients ask for (the body's \"model\"; others get 404)", metavar="NAME")
    tokenizer: str = setting("", "local directory with the model's tokenizer and chat template", metavar="DIR")
    policy: str = setting("kvtier", f"routing policy: {', '.join(POLICIES)}", metavar="POLICY")
    keys: str = setting("vllm", "key scheme of the replicas' kvtierds: vllm (kvtier's vLLM offloading spec) or "
                                "tokens (kvtier's block_keys over token ids)", metavar="SCHEME")
    block_tokens: int = setting(16, "tokens per engine block (vLLM's --block-size)", parse_int, "N")
    chunk_blocks: int = setting(1, "engine blocks per offloaded chunk (the spec's blocks_per_chunk)", parse_int, "N")
    key_group: int = setting(0, "the vLLM KV-cache group the vllm key scheme names: a model with several groups "
                                "(sliding-window or linear-attention layers beside full attention: Gemma-3, "
                                "gpt-oss, Qwen3-Next) stores each group's blocks under keys of its own; name a "
                                "full-attention group so that a prefix counts once (0: the first group, the only "
                                "one of a full-attention model; docs/gateway.md)", parse_int, "N")
    key_model: str = setting("", "model id of the keys (the engines' kvtier_model; default --model)", metavar="ID")
    tenant_salt: str = setting("", "tenant salt of the keys (the engines' kvtier_tenant)", metavar="SALT")
    vllm_hash_seed: str = setting(VLLM_DEFAULT_SEED, "the engines' PYTHONHASHSEED if they set one (vLLM's "
                                                     "root block hash)", metavar="SEED")
    session_header: str = setting("x-session-id", "request header naming a session (stickiness); empty: none",
                                  metavar="NAME")
    session_user: bool = setting(True, "without the header, the body's \"user\" names the session", parse_bool,
                                 "BOOL")
    session_ttl_s: float = setting(3600.0, "a session not seen for this long is forgotten (seconds)",
                                   parse_float, "S")
    max_concurrency: int = setting(256, "requests forwarded at once; more wait up to --queue-timeout-s",
                                   parse_int, "N")
    queue_timeout_s: float = setting(10.0, "longest wait for a forwarding slot before 503 (seconds)",
                                     parse_float, "S")
    connect_timeout_s: float = setting(2.0, "connecting to a replica (seconds); past it the next is tried",
                                       parse_float, "S")
    first_byte_timeout_s: float = setting(300.0, "a replica's status line (seconds); past it the next is tried",
                                          parse_float, "S")
    read_timeout_s: float = setting(300.0, "longest silence of a replica while streaming (seconds)",
                                    parse_float, "S")
    retries: int = setting(2, "other replicas tried when one refuses before answering", parse_int, "N")
    workers: int = setting(1, "gateway processes serving --listen together (SO_REUSEPORT: the kernel spreads "
                              "connections over them); sessions and prefixes stay on one replica whichever "
                              "process gets them (a table in memory they share)", parse_int, "N")
    prompt_cache_bytes: int = setting(128 << 20, "memory per process for the last turn of each conversation "
                                                 "(rendered text, token ids, block keys): a later turn renders, "
                                                 "tokenizes and hashes only what is new; least recently used "
                                                 "conversations are dropped first (0: every prompt from scratch; "
                                                 "bytes)", parse_int, "BYTES")
    down_s: float = setting(5.0, "a replica that refused is skipped this long (seconds)", parse_float, "S")
    max_body_bytes: int = setting(64 << 20, "largest request body (bytes)", parse_int, "BYTES")
    max_body_bytes_in_flight: int = setting(256 << 20, "request body bytes held at once: a request waits (up to "
                                                       "--queue-timeout-s, then 503) for room for its body before "
                                                       "reading it (bytes)", parse_int, "BYTES")
    body_timeout_s: float = setting(30.0, "longest time a client may take to send its request body once there is "
                                          "room for it in --max-body-bytes-in-flight (seconds); past it 408 and the "
                                          "room is given back", parse_float, "S")
    write_timeout_s: float = setting(60.0, "longest wait for a client to take more of an answer (seconds); past "
                                           "it the client is dropped and the replica's request ended",
                                     parse_float, "S")
    metrics_port: int = setting(-1, "serve /metrics on this port, on --listen's host (0: any free port; -1: no "
                                    "metrics); never on --listen's port", parse_int, "PORT")
    api_keys_file: str = setting("", "client API keys, one \"ID KEY\" a line (# comments): every /v1 request "
                                     "then needs \"Authorization: Bearer KEY\" (else 401) and its session is "
                                     "scoped to ID; unset: no authentication, session ids advisory",
                                 metavar="FILE")
    replica_api_key_file: str = setting("", "file holding the replicas' API key (vLLM's --api-key): sent to them "
                                            "as \"Authorization: Bearer KEY\"; unset: no Authorization is "
                                            "forwarded (a client's never is)", metavar="FILE")
    replica_header: bool = setting(False, f"name the replica that answered in a {REPLICA_HEADER} response header "
                                          "(tells clients where prompts are cached)", parse_bool, "BOOL")
    header_timeout_s: float = setting(10.0, "longest time from connecting to a complete request head (seconds); "
                                            "past it the connection is closed", parse_float, "S")
    idle_timeout_s: float = setting(60.0, "a kept-alive connection with no request (or a request head still "
                                          "arriving) this long after its last answer is closed (seconds)",
                                    parse_float, "S")
    max_connections_per_client: int = setting(64, "open connections one client address may hold; past it 429 and "
                                                  "close (0: no cap; behind a proxy every client shares its address)",
                                              parse_int, "N")
    daemon_tls_cert: str = setting("", "client certificate for kvtierds over TCP (their --tls-ca signs it)",
                                   metavar="FILE")
    daemon_tls_key: str = setting("", "PEM private key of --daemon-tls-cert", metavar="FILE")
    daemon_tls_ca: str = setting("", "PEM CA that signs the kvtierds' --tls-cert", metavar="FILE")
    prefetch: bool = setting(True, "apply the router's fetch hints (policy kvtier, --pulls): ask the chosen "
                                   "replica's kvtierd to fetch the hinted blocks from the peer that holds them "
                                   "before forwarding the request", parse_bool, "BOOL")
    prefetch_timeout_s: float = setting(0.5, "longest wait for a fetch hint's prefetch (seconds); past it the "
                                             "request goes on and the engine recomputes what is missing",
                                        parse_float, "S")
    cache_hints: bool = setting(True, "send clients' cache hints (OpenAI prompt_cache_retention 24h, cache_control "
                                      "breakpoints on messages, Dynamo nvext.cache_control and agent_hints.priority) "
                                      "to the chosen replica's kvtierd as a retention of the prompt's blocks before "
                                      "forwarding (best effort; docs/gateway.md, Cache hints)", parse_bool, "BOOL")
    retain_timeout_s: float = setting(0.5, "longest wait for a cache hint's retain (seconds); past it the request "
                                           "goes on", parse_float, "S")
    router: RouterConfig = group(RouterConfig, "Router")
    record: RecordConfig = group(RecordConfig, "Trace recording")  # client/routing/recorder.py
    log_level: str = setting("info", "debug, info, warning or error")
    config: str = setting("", "TOML file with any of these settings", metavar="FILE")


HELP = """\
An OpenAI-compatible HTTP front door (/v1/chat/completions, /v1/completions, /v1/models,
streaming or not) that sends each request to the engine replica holding the longest part of
its prompt's KV cache, as kvtier's router ranks them from the kvtierds' location feeds
(--daemon, --dns; as route-server). Replicas: --replica NAME=URL, NAME being the worker id
the router knows (the replica's kvtierd --node-id for vLLM with kvtier's offloading spec).
Keys: the gateway tokenizes each prompt with --tokenizer and computes the keys the engines'
kvtier integration stores, so --block-tokens, --key-model (the engines' kvtier_model) and
--tenant-salt (their kvtier_tenant) must match the engines'.
Example:
  kvtier gateway --listen 0.0.0.0:8000 --model llama --tokenizer /models/llama \\
    --block-tokens 16 --tenant-salt team-a \\
    --replica node-a=http://10.0.0.5:8000 --daemon 10.0.0.5:7070 \\
    --replica node-b=http://10.0.0.6:8000 --daemon 10.0.0.6:7070
"""

SETTINGS = Settings(GatewayConfig, "KVTIER_GATEWAY_", "kvtier gateway", description=HELP)


def parse_replicas(entries: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in entries:
        name, sep, url = e.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SettingsError(f"--replica {e!r}: expected NAME=http://HOST:PORT")
        if name in out:
            raise SettingsError(f"--replica {name!r} given twice")
        out[name] = url
    return out


def check_settings(cfg: GatewayConfig) -> None:
    parse_replicas(cfg.replicas)
    if not cfg.replicas and not cfg.replica_url_template:
        raise SettingsError("give at least one --replica NAME=URL (or --replica-url-template with --daemon)")
    if cfg.replica_url_template and not (cfg.router.daemons or cfg.router.dns):
        raise SettingsError("--replica-url-template discovers workers from the location feeds: give --daemon or --dns")
    if not cfg.model:
        raise SettingsError("--model: the model name clients ask for is required")
    if not cfg.tokenizer:
        raise SettingsError("--tokenizer DIR is required (the model's tokenizer files, local)")
    if cfg.policy not in POLICIES:
        raise SettingsError(f"--policy {cfg.policy!r}: one of {', '.join(POLICIES)}")
    if cfg.keys not in SCHEMES:
        raise SettingsError(f"--keys {cfg.keys!r}: one of {', '.join(SCHEMES)}")
    for name in ("block_tokens", "chunk_blocks", "max_concurrency", "max_body_bytes_in_flight", "workers"):
        if getattr(cfg, name) <= 0:
            raise SettingsError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= cfg.key_group < 1 << 32:
        raise SettingsError(f"--key-group {cfg.key_group}: a KV-cache group index, 0 to 2^32 - 1")
    tls = [n for n in ("daemon_tls_cert", "daemon_tls_key", "daemon_tls_ca") if getattr(cfg, n)]
    if tls and len(tls) != 3:
        raise SettingsError("--daemon-tls-cert, --daemon-tls-key and --daemon-tls-ca go together")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise SettingsError(f"--log-level {cfg.log_level!r}: debug, info, warning or error")
    _check_prefetch_and_record(cfg)


def _check_prefetch_and_record(cfg: GatewayConfig) -> None:
    if cfg.prefetch_timeout_s <= 0:
        raise SettingsError("--prefetch-timeout-s must be positive")
    if cfg.retain_timeout_s <= 0:
        raise SettingsError("--retain-timeout-s must be positive")
    for name in ("write_timeout_s", "body_timeout_s", "header_timeout_s", "idle_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise SettingsError(f"--{name.replace('_', '-')} must be positive")
    if cfg.record.check():
        raise SettingsError(str(cfg.record.check()))
    if cfg.prompt_cache_bytes < 0:
        raise SettingsError("--prompt-cache-bytes must be 0 (off) or positive")
    if cfg.max_connections_per_client < 0:
        raise SettingsError("--max-connections-per-client must be 0 (no cap) or positive")
    if cfg.api_keys_file:
        read_api_keys(cfg.api_keys_file)
    if cfg.replica_api_key_file:
        read_replica_key(cfg.replica_api_key_file)


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"{flag} {path}: {e}") from None


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_api_keys(path: str) -> dict[bytes, str]:
    """``--api-keys-file``: sha256(KEY) -> client id (looked up by digest: no key compared
    byte by byte against a client's guess)."""
    out: dict[bytes, str] = {}
    for n, line in enumerate(_read("--api-keys-file", path).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not CLIENT_ID.fullmatch(parts[0]) or len(parts[1]) < 16:
            raise SettingsError(f"--api-keys-file {path}:{n}: expected \"ID KEY\" (ID: letters, digits, ._@-; "
                                "KEY: at least 16 characters)")
        d = _key_digest(parts[1])
        if d in out:
            raise SettingsError(f"--api-keys-file {path}:{n}: a key given twice")
        out[d] = parts[0]
    if not out:
        raise SettingsError(f"--api-keys-file {path}: no keys")
    return out


def read_replica_key(path: str) -> str:
    key = _read("--replica-api-key-file", path).strip()
    if not key or any(c in key for c in "\r\n"):
        raise SettingsError(f"--replica-api-key-file {path}: one key on one line expected")
    return key


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """An OpenAI-style error (as vLLM's server answers them)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


class _Metrics:
    """kvtier_gateway_* on a private registry."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: PLC0415

        self.registry = r = CollectorRegistry()
        self._children: dict[tuple, Any] = {}
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
        self.requests = Counter("kvtier_gateway_requests", "requests answered, by replica (none: refused by the "
                                "gateway), endpoint and HTTP status", ["replica", "endpoint", "status"], registry=r)
        self.errors = Counter("kvtier_gateway_errors", "failures by reason: bad_request, unknown_model, overloaded, "
                              "replica_refused (then retried), unreachable (every replica refused), "
                              "upstream_broken (the replica broke off mid-answer), client_gone (the client "
                              "left before its answer ended; the replica's request is ended with it), "
                              "client_stalled (the client took no more of its answer for --write-timeout-s: "
                              "dropped), body_timeout (the client took over --body-timeout-s to send its "
                              "body: 408), unauthorized (no or an unknown API key: 401), header_timeout (no "
                              "request head within --header-timeout-s: closed), too_many_connections (past "
                              "--max-connections-per-client: 429)", ["reason"], registry=r)
        self.decisions = Counter("kvtier_gateway_decisions", "requests dispatched, by chosen replica and policy",
                                 ["replica", "policy"], registry=r)
        self.retries = Counter("kvtier_gateway_retries", "requests sent on to another replica", registry=r)
        self.ttft = Histogram("kvtier_gateway_ttft_seconds", "request arrival to the first body byte sent back",
                              ["replica"], buckets=buckets, registry=r)
        self.latency = Histogram("kvtier_gateway_latency_seconds", "request arrival to the last byte sent back",
                                 ["replica"], buckets=buckets, registry=r)
        self.overhead = Histogram("kvtier_gateway_decide_seconds", "parse, tokenize, key and rank a request",
                                  buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .1), registry=r)
        self.overlap = Counter("kvtier_gateway_overlap_blocks", "leading prompt blocks the chosen replica held "
                               "when chosen, by tier (gpu: the engine's or speculative; host; disk), as the "
                               "router saw them", ["tier"], registry=r)
        self.prompt_blocks = Counter("kvtier_gateway_prompt_blocks", "full blocks of the prompts routed", registry=r)
        self.in_flight = Gauge("kvtier_gateway_in_flight", "requests being forwarded", ["replica"], registry=r)
        self.prefetches = Counter("kvtier_gateway_prefetches", "fetch hints applied before forwarding, by outcome: "
                                  "done (the replica's kvtierd answered), timeout (abandoned after "
                                  "--prefetch-timeout-s), error (refused or unreachable), no_layout (no layout "
                                  "fingerprint known for the hint), no_daemon (no feed serves the replica's node), "
                                  "store (only the shared store holds the keys: left to the daemon's read-through)",
                                  ["outcome"], registry=r)
        self.prefetched_blocks = Counter("kvtier_gateway_prefetched_blocks", "blocks the replicas' kvtierds reported "
                                         "brought to host by the gateway's prefetches", registry=r)
        self.prefetch_seconds = Histogram("kvtier_gateway_prefetch_seconds", "time a request waited for its "
                                          "prefetches", buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2),
                                          registry=r)
        self.retains = Counter("kvtier_gateway_retains", "requests with a cache hint, by the outcome of their "
                               "retain on the chosen replica's kvtierd: retained (every retain answered), refused "
                               "(the daemon refused one: over the retention budget, or the layout not registered), "
                               "error (unreachable or failed), timeout (abandoned after --retain-timeout-s), "
                               "no_layout (no layout fingerprint known for the replica), no_daemon (no feed serves "
                               "the replica's node)", ["outcome"], registry=r)
        self.retained_blocks = Counter("kvtier_gateway_retained_blocks", "block keys the replicas' kvtierds "
                                       "reported retained (new or renewed) for cache hints", registry=r)
        self.recorded = Counter("kvtier_gateway_recorded", "requests handed to --record-trace (dropped ones "
                                "included: see kvtier_gateway_record_dropped)", registry=r)
        self.record_dropped = Gauge("kvtier_gateway_record_dropped", "--record-trace records dropped (writer "
                                    "behind, queue full)", registry=r)
        for o in ("done", "timeout", "error", "no_layout", "no_daemon", "store"):
            self.prefetches.labels(o)
        for o in ("retained", "refused", "error", "timeout", "no_layout", "no_daemon"):
            self.retains.labels(o)
        for t in ("gpu", "host", "disk"):
            self.overlap.labels(t)

    def of(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once (labels() takes a lock and builds a key)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def watch_prompts(self, prompts: PromptCache) -> None:
        """kvtier_gateway_prompt_cache_*: read from the cache when scraped (nothing per request)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        class Collector:
            def collect(self):  # noqa: ANN202
                c = CounterMetricFamily("kvtier_gateway_prompt_cache", "chat prompts by how they were computed: "
                                        "hit (a stored turn of the conversation reused), shared (a new "
                                        "conversation from another's stored turn that opened alike: a shared "
                                        "system prompt), scratch (tokenized "
                                        "from scratch: no stored turn, or one of the next two), miss (the "
                                        "stored turn's text shares too little), resync (no clean restart "
                                        "point)", labels=["outcome"])
                for k, v in prompts.counts.items():
                    c.add_metric([k], v)
                yield c
                yield GaugeMetricFamily("kvtier_gateway_prompt_cache_bytes", "memory the stored turns take "
                                        "(--prompt-cache-bytes bounds it)", value=prompts.bytes)
                yield GaugeMetricFamily("kvtier_gateway_prompt_cache_conversations", "conversations with a "
                                        "stored turn", value=len(prompts))

        self.registry.register(Collector())

    def render(self) -> bytes:
        from prometheus_client import generate_latest  # noqa: PLC0415

        return generate_latest(self.registry)


def _loads(raw: bytes) -> Any:
    """A request body, parsed exactly as ``json.loads`` parses it: its numbers reach the decision
    as the client sent them (a faster parser such as orjson reads integers beyond 64 bits as
    floats; tests/test_gateway_hardening.py holds every body to json's result)."""
    return json.loads(raw)


_deadline = getattr(asyncio, "timeout", None)  # (Python 3.11: no task per write, as wait_for makes)


async def _within(aw: Any, timeout: float) -> Any:
    """``await aw``, raising asyncio.TimeoutError after ``timeout`` seconds (a timer, not a task)."""
    if _deadline is None:  # pragma: no cover (Python 3.10)
        return await asyncio.wait_for(aw, timeout)
    async with _deadline(timeout):
        return await aw


class _ClientGone(Exception):
    """The client left (``client_gone``) or took nothing for ``--write-timeout-s`` (``client_stalled``)."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


class _BodyBudget:
    """Request-body bytes held at once (``--max-body-bytes-in-flight``), granted in arrival order.

    A request takes room for its body before reading it and gives it back when it ends, so the
    bodies the gateway holds (read, waiting for a slot, being tokenized or forwarded) never add
    up past the budget however many clients send at once; one body larger than the whole budget
    waits until it is alone."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self._waiters: collections.deque = collections.deque()

    def try_acquire(self, n: int) -> int:
        """Room for ``n`` bytes (at most the whole budget) if it is free now and nobody waits; what
        it took, else 0."""
        n = min(n, self.cap)
        if not self._waiters and self.used + n <= self.cap:
            self.used += n
            return n
        return 0

    async def acquire(self, n: int) -> int:
        """Room for ``n`` bytes (at most the whole budget), waiting for its turn; what it took."""
        n = min(n, self.cap)
        if not self._waiters and self.used + n <= self.cap:
            self.used += n
            return n
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted as it was cancelled: give it back
                self.release(n)
            else:
                self._waiters.remove(entry)
                self._wake()  # (it may have held back smaller ones behind it)
            raise
        return n

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if not fut.done() and self.used + n > self.cap:
                return
            self._waiters.popleft()
            if not fut.done():
                self.used += n
                fut.set_result(None)


class _Refused(Exception):
    """A replica refused before any byte reached the client; ``body``/``status`` if it answered."""

    def __init__(self, why: str, status: int = 0, body: bytes = b"", headers: Any = None) -> None:
        super().__init__(why)
        self.status, self.body, self.headers = status, body, headers


def _guarded_runner(gw: Gateway, app: Any, **kwargs: Any) -> Any:
    """An aiohttp runner whose connections are bounded per client: a request head within
    ``--header-timeout-s`` of connecting (an idle kept-alive connection is aiohttp's
    ``keepalive_timeout``, ``--idle-timeout-s``: it also closes one whose next head is still
    arriving then), at most ``--max-connections-per-client`` open per client address."""
    from aiohttp import web  # noqa: PLC0415
    from aiohttp.web_server import Server  # noqa: PLC0415

    cfg, metrics = gw.cfg, gw.metrics
    too_many = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n")

    class GuardedServer(Server):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.per_client: dict[str, int] = {}
            self.client_of: dict[Any, tuple[str, Any]] = {}  # handler -> (client address, head deadline)

        def connection_made(self, handler: Any, transport: Any) -> None:
            super().connection_made(handler, transport)
            peer = transport.get_extra_info("peername")
            addr = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            n = self.per_client[addr] = self.per_client.get(addr, 0) + 1
            due = self._loop.call_later(cfg.header_timeout_s, self._head_due, handler)
            self.client_of[handler] = (addr, due)
            if cfg.max_connections_per_client and n > cfg.max_connections_per_client:
                metrics.errors.labels("too_many_connections").inc()
                body = error_body(429, f"more than --max-connections-per-client {cfg.max_connections_per_client} "
                                  "connections from this address", "RateLimitError")
                transport.write(too_many % len(body) + body)  # (close() sends what is buffered first)
                handler.force_close()

        def _head_due(self, handler: Any) -> None:
            if handler.transport is not None and not handler._request_count:
                metrics.errors.labels("header_timeout").inc()
                handler.force_close()

        def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
            super().connection_lost(handler, exc)
            addr, due = self.client_of.pop(handler, ("", None))
            if due is not None:
                due.cancel()
                left = self.per_client.get(addr, 1) - 1
                if left:
                    self.per_client[addr] = left
                else:
                    self.per_client.pop(addr, None)

    class GuardedRunner(web.AppRunner):
        async def _make_server(self) -> Any:
            s = await super()._make_server()
            return GuardedServer(s.request_handler, request_factory=s.request_factory,
                                 handler_cancellation=s.handler_cancellation, loop=s._loop, **s._kwargs)

    return GuardedRunner(app, **kwargs)


class Gateway:
    """The gateway's state and handlers; :meth:`app` is the aiohttp application."""

    def __init__(self, cfg: GatewayConfig, tokenizer: PromptTokenizer | None = None,
                 router: Router | None = None, shared: tuple[SharedMap, SharedMap] | None = None) -> None:
        """``shared``: the session and prefix maps of ``--workers`` (:func:`shared_maps`)."""
        self.cfg = cfg
        self.static = parse_replicas(cfg.replicas)
        self.tokenizer = tokenizer or PromptTokenizer(cfg.tokenizer)
        self.keys = KeyScheme(cfg.keys, cfg.block_tokens, Namespace(cfg.key_model or cfg.model, cfg.tenant_salt),
                              cfg.chunk_blocks, cfg.vllm_hash_seed, cfg.key_group)
        use_router = cfg.policy == "kvtier" or cfg.router.daemons or cfg.router.dns
        tls = ClientTls(cfg.daemon_tls_cert, cfg.daemon_tls_key, cfg.daemon_tls_ca) if cfg.daemon_tls_cert else None
        self.router = router if router is not None else (Router(cfg.router, tls=tls) if use_router else None)
        sessions, prefixes = shared if shared is not None else (None, None)
        self.policy = Policy(cfg.policy, self.router, session_ttl_s=cfg.session_ttl_s, sessions=sessions,
                             prefixes=prefixes)
        self.metrics = _Metrics()
        self.api_keys = read_api_keys(cfg.api_keys_file) if cfg.api_keys_file else None
        self._replica_auth = f"Bearer {read_replica_key(cfg.replica_api_key_file)}" if cfg.replica_api_key_file else ""
        self._replica_auth_line = f"Authorization: {self._replica_auth}\r\n".encode()
        self.down_until: dict[str, float] = {}
        self._discovered: dict[str, str] = {}
        self._discovered_at = -1.0
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._bodies = _BodyBudget(cfg.max_body_bytes_in_flight)
        self._counted: set[int] = set()  # id() of the requests in flight whose outcome is counted already
        self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="kvtier-gw-tok")
        self._upstream: Upstream | None = None
        self._tls_upstream: AiohttpUpstream | None = None  # (https replicas: aiohttp's client, made when needed)
        self._replicas: dict[str, Replica] = {}
        # request headers never forwarded, whatever the request's Connection header names
        self._dropped = frozenset(_HOP | _CLIENT_ONLY | ({cfg.session_header.lower()} if cfg.session_header else set()))
        self._dropped_raw = frozenset(h.encode() for h in self._dropped)
        self.started = time.time()
        if self.router is not None:
            for name in self.static:  # replicas no daemon publishes (yet) can still be picked
                self.router.add_worker(name)
        self.recorder = open_recorder(cfg.record)
        self._record_ids = itertools.count(1)
        self.prompts = PromptCache(self.tokenizer, self.keys, cfg.prompt_cache_bytes)
        self.metrics.watch_prompts(self.prompts)
        # round-robin and session order replicas without keys: their requests are checked, not
        # tokenized (unless a router charges replicas or a trace records them)
        self.need_keys = (cfg.policy in ("kvtier", "prefix") or self.router is not None
                          or self.recorder is not None)
        # the replicas' kvtierds (one channel each): fetch hints' prefetches and cache hints' retains
        self.daemons = (Prefetcher(self.router, tls, cfg.prefetch_timeout_s, self.metrics)
                        if self.router is not None else None)
        self.prefetcher = self.daemons if cfg.prefetch and cfg.policy == "kvtier" else None

    # -- lifecycle ------------------------------------------------------------------------

    def runner(self) -> Any:
        """The aiohttp runner :func:`serve` starts. A handler is cancelled when its client
        disconnects (aiohttp's ``handler_cancellation``; off by default): the replica's request
        is then closed and its slot, load and body budget given back at once, not when the
        replica finally answers."""
        return _guarded_runner(self, self.app(), access_log=None, handler_cancellation=True,
                               keepalive_timeout=self.cfg.idle_timeout_s)

    def app(self) -> Any:
        from aiohttp import web  # noqa: PLC0415

        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)  # (/metrics: on --metrics-port only, see serve)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: Any) -> None:
        self._upstream = Upstream(self.cfg.connect_timeout_s, self.cfg.read_timeout_s)
        if self.router is not None and not self.router._started:
            self.router.start()

    async def _cleanup(self, app: Any) -> None:
        if self._upstream is not None:
            await self._upstream.close()
        if self._tls_upstream is not None:
            await self._tls_upstream.close()
        if self.daemons is not None:
            await self.daemons.close()
        if self.recorder is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.recorder.close)
        self._pool.shutdown(wait=False)
        if self.router is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.router.close)

    # -- replicas -------------------------------------------------------------------------

    def replicas(self) -> dict[str, str]:
        """name -> base URL: the static ones, and (with a template) the workers the feeds report."""
        tpl = self.cfg.replica_url_template
        if not tpl or self.router is None:
            return self.static
        now = time.monotonic()
        if now - self._discovered_at > 1.0:
            self._discovered_at = now
            found = {w: tpl.format(worker=w, node=n).rstrip("/") for w, n in self.router.workers() if n}
            self._discovered = {**found, **self.static}
        return self._discovered

    def healthy(self, names: Sequence[str]) -> list[str]:
        now = time.monotonic()
        up = [n for n in names if self.down_until.get(n, 0.0) <= now]
        return up or list(names)  # all refused lately: try them anyway

    # -- handlers -------------------------------------------------------------------------

    def _json(self, status: int, body: bytes) -> Any:
        from aiohttp import web  # noqa: PLC0415

        return web.Response(status=status, body=body, content_type="application/json")

    def _fail(self, endpoint: str, status: int, reason: str, message: str, kind: str,
              param: str | None = None) -> Any:
        self.metrics.errors.labels(reason).inc()
        self.metrics.requests.labels("none", endpoint, str(status)).inc()
        return self._json(status, error_body(status, message, kind, param))

    def _identity(self, request: Any) -> str | None:
        """The client id of the request's API key (``--api-keys-file``); None when unknown."""
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.api_keys.get(_key_digest(key.strip()))  # type: ignore[union-attr]

    def _unauthorized(self, endpoint: str) -> Any:
        resp = self._fail(endpoint, 401, "unauthorized", "missing or unknown API key (Authorization: Bearer KEY)",
                          "AuthenticationError")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    async def models(self, request: Any) -> Any:
        if self.api_keys is not None and self._identity(request) is None:
            return self._unauthorized("models")
        return self._json(200, json.dumps({"object": "list", "data": [
            {"id": self.cfg.model, "object": "model", "created": int(self.started), "owned_by": "kvtier-gateway",
             "root": self.cfg.model}]}).encode())

    async def health(self, request: Any) -> Any:
        return self._json(200, b"{}")

    async def metrics_handler(self, request: Any) -> Any:
        from aiohttp import web  # noqa: PLC0415

        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def chat(self, request: Any) -> Any:
        return await self._forward(request, "chat")

    async def completions(self, request: Any) -> Any:
        return await self._forward(request, "completions")

    def _session_of(self, request: Any, body: Mapping[str, Any], client: str | None = None) -> str | None:
        """The session's affinity key: the session header, else the body's ``prompt_cache_key``,
        else its ``user``; prefixed with the client id (``CLIENT:SESSION``) when the client is
        known (``--api-keys-file``)."""
        h = self.cfg.session_header
        sid = request.headers.get(h) if h else None
        if not sid and isinstance(body.get("prompt_cache_key"), str):
            sid = body["prompt_cache_key"]
        if not sid and self.cfg.session_user and isinstance(body.get("user"), str):
            sid = body["user"]
        if sid and len(sid) > MAX_SESSION_ID:  # (kept per session: a long one is kept as its digest)
            sid = "blake2b:" + hashlib.blake2b(sid.encode(errors="replace"), digest_size=16).hexdigest()
        if sid and client is not None:
            return f"{client}:{sid}"
        return sid or None

    def _decide(self, endpoint: str, raw: bytes, request: Any,
                client: str | None = None) -> tuple[Any, list[bytes], str | None, int]:
        """Parse, check, tokenize and key a request: (error response or None, keys, session, tokens)."""
        return self._decide_hinted(endpoint, raw, request, client)[:4]

    def _decide_hinted(self, endpoint: str, raw: bytes, request: Any,
                       client: str | None = None) -> tuple[Any, list[bytes], str | None, int, Any]:
        """As :meth:`_decide`, and the retains its cache hints ask for: ([(leading keys, TTL)],
        priority) or None."""
        try:
            body = _loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except (ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
            return (self._fail(endpoint, 400, "bad_request", f"invalid JSON body: {e}", "BadRequestError"), [], None,
                    0, None)
        model = body.get("model")
        if model != self.cfg.model:
            return self._fail(endpoint, 404, "unknown_model",
                              f"The model `{model}` does not exist: this gateway serves `{self.cfg.model}`.",
                              "NotFoundError", "model"), [], None, 0, None
        session = self._session_of(request, body, client)
        hints = read_hints(body) if self.cfg.cache_hints else None
        try:
            keys, n_tokens, retain = self._prompt(endpoint, body, session or client or "", hints, client or "")
        except (PromptError, TypeError, ValueError, OverflowError) as e:  # (a field of the wrong type or range)
            return (self._fail(endpoint, 400, "bad_request", str(e) or type(e).__name__, "BadRequestError"), [], None,
                    0, None)
        return None, keys[:MAX_KEYS_PER_CALL], session, n_tokens, retain

    def _prompt(self, endpoint: str, body: dict[str, Any], scope: str,
                hints: Hints | None = None, client: str = "") -> tuple[list[bytes], int, Any]:
        """(block keys, prompt tokens, retains of the cache hints or None) of a request; ([], 0,
        None) once checked when no keys are needed. ``scope``: the conversation's (session, else
        client); ``client``: the client id (``--api-keys-file``) whose conversations a new one
        may start from."""
        with_keys = not (self.cfg.keys == "vllm" and has_extra_keys(body))
        if endpoint == "chat":
            if not self.need_keys:
                PromptTokenizer.check_chat(body)
                return [], 0, None
            keys, n, text, ends = self.prompts.chat_prompt(body, scope, with_keys, client)
            if hints is None or not keys:
                return keys, n, None
            bt, n_keys = self.keys.block_tokens, min(len(keys), MAX_KEYS_PER_CALL)
            upto = [self.keys.keys_kept(breakpoint_tokens(self.tokenizer, body, text, ends, i) // bt)
                    for i, _ in hints.breakpoints]
            return keys, n, (retains(hints, n_keys, upto), hints.priority)
        if not self.need_keys:
            PromptTokenizer.check_completion(body)
            return [], 0, None
        ids = self.tokenizer.completion(body)
        keys = self.keys.keys(ids) if with_keys else []
        if hints is None or not keys:
            return keys, len(ids), None
        return keys, len(ids), (retains(Hints(hints.whole_ttl, (), hints.priority),
                                        min(len(keys), MAX_KEYS_PER_CALL), []), hints.priority)

    async def _forward(self, request: Any, endpoint: str) -> Any:
        t0 = time.perf_counter()
        client = None
        if self.api_keys is not None:  # (before any room is taken or a byte of the body read)
            client = self._identity(request)
            if client is None:
                resp = self._unauthorized(endpoint)
                resp.force_close()  # (the body is not read: the connection cannot carry another request)
                return resp
        held = 0
        try:
            # room for the body before reading it: bodies read at once stay within the budget
            want = request.content_length
            if want is None:  # (chunked: room for the largest, given back once its size is known)
                want = self.cfg.max_body_bytes if request.body_exists else 0
            if want > 0:
                want = min(want, self.cfg.max_body_bytes)
                try:
                    held = self._bodies.try_acquire(want) or await _within(self._bodies.acquire(want),
                                                                           self.cfg.queue_timeout_s)
                except asyncio.TimeoutError:
                    return self._fail(endpoint, 503, "overloaded", f"the gateway holds --max-body-bytes-in-flight "
                                      f"{self.cfg.max_body_bytes_in_flight} bytes of request bodies and no room "
                                      f"for this one freed within {self.cfg.queue_timeout_s:g} s",
                                      "ServiceUnavailableError")
            try:  # (a client may not sit on the room it was given; a body already here needs no timer)
                content = request.content
                if content.is_eof():
                    raw = await request.read()
                else:
                    raw = await _within(request.read(), self.cfg.body_timeout_s)
            except asyncio.TimeoutError:
                resp = self._fail(endpoint, 408, "body_timeout", f"the request body did not arrive within "
                                  f"--body-timeout-s {self.cfg.body_timeout_s:g} s", "RequestTimeoutError")
                resp.force_close()
                return resp
            if held > len(raw):
                self._bodies.release(held - len(raw))
                held = len(raw)
            return await self._forward_body(request, endpoint, raw, t0, client)
        except asyncio.CancelledError:  # the client disconnected (the runner's handler_cancellation)
            self._left(request, endpoint, "none")
            raise
        finally:
            self._counted.discard(id(request))
            if held:
                self._bodies.release(held)

    async def _forward_body(self, request: Any, endpoint: str, raw: bytes, t0: float,
                            client: str | None = None) -> Any:
        if len(raw) > INLINE_BODY_BYTES:  # tokenizing a long prompt would hold the event loop (tokenizers
            # releases the GIL while it encodes, so these threads use every core)
            err, keys, session, n_tokens, retain = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._decide_hinted, endpoint, raw, request, client)
        else:
            err, keys, session, n_tokens, retain = self._decide_hinted(endpoint, raw, request, client)
        if err is not None:
            return err
        try:
            if self._slots.locked():
                await _within(self._slots.acquire(), self.cfg.queue_timeout_s)
            else:
                await self._slots.acquire()  # (free: returns at once)
        except asyncio.TimeoutError:
            return self._fail(endpoint, 503, "overloaded", f"the gateway is at --max-concurrency "
                              f"{self.cfg.max_concurrency} and no slot freed within {self.cfg.queue_timeout_s:g} s",
                              "ServiceUnavailableError")
        rec = self._record(keys, n_tokens, session)
        counter = OutputCounter() if rec else None
        try:
            return await self._route_and_send(request, endpoint, raw, keys, session, t0, counter, retain)
        finally:
            self._slots.release()
            if rec:
                self.recorder.finish(rec, counter.tokens())  # type: ignore[union-attr]

    def _left(self, request: Any, endpoint: str, replica: str) -> None:
        """Count a client that disconnected before its answer ended (once a request)."""
        if id(request) in self._counted:
            return
        self._counted.add(id(request))
        self.metrics.errors.labels("client_gone").inc()
        self.metrics.requests.labels(replica, endpoint, "client_gone").inc()
        log.info("client went away before %s answered", replica)

    def _record(self, keys: list[bytes], n_tokens: int, session: str | None) -> int:
        """Hand the request to --record-trace (never waits); its record id, 0 when not recording."""
        if self.recorder is None:
            return 0
        rid = next(self._record_ids)
        self.recorder.record(keys, n_tokens, session, rid)
        self.metrics.recorded.inc()
        self.metrics.record_dropped.set(self.recorder.dropped)
        return rid

    async def _route_and_send(self, request: Any, endpoint: str, raw: bytes, keys: list[bytes],
                              session: str | None, t0: float, counter: OutputCounter | None = None,
                              retain: Any = None) -> Any:
        m, replicas = self.metrics, self.replicas()
        choice = self.policy.choose(self.healthy(sorted(replicas)), keys, session, dispatch=True)
        m.overhead.observe(time.perf_counter() - t0)
        m.prompt_blocks.inc(choice.n_blocks)
        g, h, d = choice.overlap
        m.of(m.overlap, "gpu").inc(g)
        m.of(m.overlap, "host").inc(h - g)
        m.of(m.overlap, "disk").inc(d - h)
        last: _Refused | None = None
        for attempt, name in enumerate(choice.order[:1 + self.cfg.retries]):
            if attempt:
                m.retries.inc()
            try:
                return await self._send(request, endpoint, raw, keys, session, name, replicas[name], t0, counter,
                                        choice.ranking, retain, choice.dispatched and not attempt)
            except _Refused as e:
                last = e
                m.errors.labels("replica_refused").inc()
                self.down_until[name] = time.monotonic() + self.cfg.down_s
                log.warning("replica %s refused: %s", name, e)
        assert last is not None
        if last.status:  # every replica answered 5xx: the last answer, as it was
            m.requests.labels("none", endpoint, str(last.status)).inc()
            m.errors.labels("unreachable").inc()
            return self._upstream_error(last)
        tried = ", ".join(choice.order[:1 + self.cfg.retries])
        return self._fail(endpoint, 502, "unreachable", f"no replica answered (tried {tried}): {last}",
                          "BadGatewayError")

    def _upstream_error(self, e: _Refused) -> Any:
        from aiohttp import web  # noqa: PLC0415
        from multidict import CIMultiDict  # noqa: PLC0415 - (aiohttp's)

        headers = CIMultiDict((k, v) for k, v in (e.headers or ())
                              if k.lower() not in _HOP and not k.lower().startswith(INTERNAL_PREFIX))
        return web.Response(status=e.status, body=e.body, headers=headers)

    def _dispatch(self, name: str, keys: list[bytes], session: str | None, ranking: Any = None,
                  dispatched: bool = False) -> tuple[int, list]:
        """Charge the chosen replica: (the router's decision id, its fetch hints). ``ranking``:
        the router's ranking of the replicas for this request (the policy's), dispatched on
        without ranking again (``dispatched``: the ranking was dispatched on this replica, its
        first, when it was made); without one, the router ranks the replica alone."""
        self.policy.dispatched(name, keys, session)
        self.metrics.of(self.metrics.decisions, name, self.cfg.policy).inc()
        self.metrics.of(self.metrics.in_flight, name).inc()
        if self.router is None:
            return 0, []
        if dispatched:
            return ranking.decision_id, ranking.fetch
        if ranking is not None:
            d = self.router.dispatch(ranking, name, keys)
        else:
            d = self.router.route(keys, [name], dispatch=True, top_k=1)
        return d.decision_id, d.fetch

    def _ended(self, name: str, decision: int) -> None:
        self.policy.ended(name)
        self.metrics.of(self.metrics.in_flight, name).dec()
        if decision:
            self.router.finish(decision)

    async def _send(self, request: Any, endpoint: str, raw: bytes, keys: list[bytes], session: str | None,
                    name: str, base: str, t0: float, counter: OutputCounter | None = None,
                    ranking: Any = None, retain: Any = None, dispatched: bool = False) -> Any:
        """Forward to replica ``name``: its fetch hints' prefetches and the cache hints' retains
        (``retain``: ([(leading keys, TTL)], priority)) on its kvtierd first (bounded), then the
        body, unchanged."""
        headers = self._upstream_head(request)
        decision, hints = self._dispatch(name, keys, session, ranking, dispatched)
        try:  # (the replica's load ends whatever way this does: a cancelled handler included)
            first = []  # the prefix into the replica's host tier, and kept there, first (bounded)
            if hints and self.prefetcher is not None:
                first.append(self.prefetcher.apply(hints))
            if retain and retain[0]:
                if self.daemons is None:
                    self.metrics.retains.labels("no_daemon").inc()
                else:
                    first.append(self.daemons.retain(name, keys, retain[0], retain[1], self.cfg.retain_timeout_s))
            if len(first) == 1:
                await first[0]
            elif first:
                await asyncio.gather(*first)
            replica = self._replica(base)
            client = self._upstream if replica.plain else self._tls_client()
            try:
                up = await client.post(replica, request.raw_path.encode("utf-8", "surrogateescape"),  # type: ignore[union-attr]
                                       headers, raw, self.cfg.first_byte_timeout_s)
            except (OSError, asyncio.TimeoutError) as e:  # (UpstreamError included)
                raise _Refused(f"{type(e).__name__}: {e}") from None
            try:
                if up.status >= 500:
                    body, up_headers = await self._error_body(up, name)
                    raise _Refused(f"HTTP {up.status}", up.status, body, up_headers)
                return await self._stream(request, endpoint, up, name, decision, t0, counter)
            except (UpstreamError, asyncio.TimeoutError) as e:
                raise _Refused(f"{type(e).__name__}: {e}") from None
            finally:
                up.release()  # (closes the connection when the answer was not read to its end)
        except asyncio.CancelledError:  # the client disconnected: the replica's request is closed with it
            self._left(request, endpoint, name)
            raise
        finally:
            self._ended(name, decision)

    def _replica(self, base: str) -> Replica:
        """The replica at ``base``, its URL split once."""
        r = self._replicas.get(base)
        if r is None:
            r = Replica(base)
            if len(self._replicas) < 4096:
                self._replicas[base] = r
        return r

    def _tls_client(self) -> AiohttpUpstream:
        if self._tls_upstream is None:
            self._tls_upstream = AiohttpUpstream(self.cfg.connect_timeout_s, self.cfg.read_timeout_s)
        return self._tls_upstream

    def _upstream_head(self, request: Any) -> bytes:
        """The client's request headers as a replica gets them (``Name: value\\r\\n`` lines, as
        the client sent them): without hop-by-hop ones (and those its ``Connection`` names),
        ``x-kvtier-*``, the session header, the client's credentials and claimed addresses;
        ``X-Forwarded-For`` is the client's address, ``Authorization`` the replicas' key when
        ``--replica-api-key-file`` is set."""
        drop = self._dropped_raw
        raw = request.raw_headers
        for k, v in raw:
            if k.lower() == b"connection":
                if drop is self._dropped_raw:
                    drop = set(drop)
                drop.update(t.strip().lower() for t in v.split(b","))
        prefix = _INTERNAL_RAW
        lines = [k + b": " + v + b"\r\n" for k, v in raw
                 if (low := k.lower()) not in drop and not low.startswith(prefix)]
        if request.remote:
            lines.append(b"X-Forwarded-For: " + request.remote.encode() + b"\r\n")
        if self._replica_auth:
            lines.append(self._replica_auth_line)
        return b"".join(lines)

    async def _error_body(self, up: Any, name: str) -> tuple[bytes, Any]:
        """A 5xx answer's body and headers, read up to MAX_ERROR_BODY bytes; past that, the
        connection is dropped and the body is the gateway's own error."""
        body = bytearray()
        while len(body) <= MAX_ERROR_BODY:
            chunk = await up.read(MAX_ERROR_BODY + 1 - len(body))
            if not chunk:
                return bytes(body), up.headers
            body += chunk
        up.close()
        log.warning("replica %s answered HTTP %d with an error body over %d bytes", name, up.status, MAX_ERROR_BODY)
        return (error_body(up.status, f"replica {name} answered HTTP {up.status} with an error body over "
                           f"{MAX_ERROR_BODY} bytes (not relayed)", "InternalServerError"),
                [("Content-Type", "application/json")])

    async def _to_client(self, aw: Any) -> None:
        """Await a write to the client, bounded by --write-timeout-s; a client that left or
        stalled raises :class:`_ClientGone`."""
        try:
            if _deadline is not None:
                async with _deadline(self.cfg.write_timeout_s):
                    await aw
            else:  # pragma: no cover (Python 3.10)
                await asyncio.wait_for(aw, self.cfg.write_timeout_s)
        except asyncio.TimeoutError:
            raise _ClientGone("client_stalled", f"took nothing for {self.cfg.write_timeout_s:g} s") from None
        except ConnectionError as e:  # (aiohttp's ClientConnectionResetError included)
            raise _ClientGone("client_gone", str(e) or type(e).__name__) from None

    async def _stream(self, request: Any, endpoint: str, up: Any, name: str, decision: int, t0: float,
                      counter: OutputCounter | None = None) -> Any:
        m = self.metrics
        # the first chunk before the client's response starts: a replica that fails here is retried
        first = await up.readany()
        resp = self._response_of(up, name, self.cfg.replica_header)
        status = str(up.status)
        counter = counter or NULL_COUNTER
        counter.start(up.header("Content-Type"), up.status)
        counter.feed(first)
        try:
            if first and hasattr(resp, "_send_headers_immediately"):
                # the head is held back and goes out with the first chunk, in one write (so preparing
                # writes nothing and cannot wait on the client)
                resp._send_headers_immediately = False
                await resp.prepare(request)
            else:
                await self._to_client(resp.prepare(request))
            if first and up.content_length is not None and len(first) >= up.content_length:
                await self._to_client(resp.write_eof(first))  # the whole answer: one write, with its head
                m.of(m.ttft, name).observe(time.perf_counter() - t0)
                if decision:
                    self.router.finish(decision, prefill_only=True)
                return resp
            if first:
                await self._to_client(resp.write(first))
                m.of(m.ttft, name).observe(time.perf_counter() - t0)
                if decision:
                    self.router.finish(decision, prefill_only=True)
            status = await self._relay(request, resp, up, name, counter) or status
        except _ClientGone as e:
            m.errors.labels(e.reason).inc()
            log.info("client %s while %s answered: %s", "went away" if e.reason == "client_gone" else "stalled",
                     name, e)
            status = e.reason
            up.close()  # the replica sees its client go (vLLM aborts the request)
            if request.transport is not None:  # (abort: a stalled client's unsent bytes are dropped, not flushed)
                request.transport.abort()
        except asyncio.CancelledError:  # the client disconnected (the runner's handler_cancellation)
            m.errors.labels("client_gone").inc()
            log.info("client went away while %s answered", name)
            status = "client_gone"
            up.close()
            raise
        finally:
            self._counted.add(id(request))
            m.of(m.requests, name, endpoint, status).inc()
            m.of(m.latency, name).observe(time.perf_counter() - t0)
        return resp

    @staticmethod
    def _response_of(up: Any, name: str, replica_header: bool = False) -> Any:
        """The client's response to the replica's answer: its status and headers (and, with
        ``--replica-header``, the replica's name)."""
        from aiohttp import web  # noqa: PLC0415

        resp = web.StreamResponse(status=up.status, reason=up.reason)
        add = resp.headers.add
        for k, v in up.headers:
            low = k.lower()
            if low not in _HOP and not low.startswith(INTERNAL_PREFIX):
                add(k, v)
        if replica_header:
            resp.headers[REPLICA_HEADER] = name
        if up.content_length is not None:
            resp.content_length = up.content_length
        return resp

    async def _relay(self, request: Any, resp: Any, up: Any, name: str, counter: Any) -> str | None:
        """The rest of the answer, chunk by chunk, to its end; "broken" when the replica broke off."""
        while True:
            try:
                chunk = await up.readany()
            except (UpstreamError, asyncio.TimeoutError) as e:
                self.metrics.errors.labels("upstream_broken").inc()
                log.warning("replica %s broke off mid-answer: %s", name, e)
                if request.transport is not None:  # the client sees the answer cut off, not complete
                    request.transport.close()
                return "broken"
            if not chunk:
                break
            counter.feed(chunk)
            await self._to_client(resp.write(chunk))
        await self._to_client(resp.write_eof())
        return None


def shared_maps(cfg: GatewayConfig) -> tuple[SharedMap, SharedMap]:
    """The session and (policy prefix) prefix maps every ``--workers`` process shares."""
    return (SharedMap(100_000, cfg.session_ttl_s),
            SharedMap(1 << 20 if cfg.policy == "prefix" else 1, slots_per_item=2))


async def serve(cfg: GatewayConfig, ready: Any = None, worker: int = 0,
                shared: tuple[SharedMap, SharedMap] | None = None) -> None:
    """Serve until SIGTERM or SIGINT. One of ``--workers`` (``worker`` its index, ``ready`` the
    pipe it reports its ports on) listens with SO_REUSEPORT beside the others."""
    from aiohttp import web  # noqa: PLC0415

    gw = Gateway(cfg, shared=shared)
    runner = gw.runner()
    await runner.setup()
    host, _, port = cfg.listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port), backlog=1024, reuse_port=cfg.workers > 1 or None)
    try:
        await site.start()
    except OSError as e:
        raise SystemExit(f"kvtier gateway: cannot listen on {cfg.listen}: {e.strerror}") from None
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    mport = None
    if cfg.metrics_port >= 0:
        mapp = web.Application()
        mapp.router.add_get("/metrics", gw.metrics_handler)
        mrunner = web.AppRunner(mapp, access_log=None, keepalive_timeout=cfg.idle_timeout_s)
        await mrunner.setup()
        msite = web.TCPSite(mrunner, host or "127.0.0.1", cfg.metrics_port + worker if cfg.metrics_port else 0)
        await msite.start()
        mport = msite._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if ready is not None:
        os.write(ready, f"{bound} {mport if mport is not None else -1}\n".encode())
        os.close(ready)
    else:
        print(f"kvtier gateway listening on http://{host or '127.0.0.1'}:{bound}"
              + (f", metrics on port {mport}" if mport is not None else "")
              + f"; policy {cfg.policy}; replicas {', '.join(f'{k}={v}' for k, v in gw.static.items()) or 'discovered'}",
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal  # noqa: PLC0415

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def _run(cfg: GatewayConfig, **kw: Any) -> int:
    try:
        import uvloop  # noqa: PLC0415

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(serve(cfg, **kw))
    except RuntimeError as e:
        print(f"kvtier gateway: {e}", file=sys.stderr)
        return 1
    return 0


def _reserve_port(cfg: GatewayConfig) -> tuple[GatewayConfig, Any]:
    """--listen with its port chosen (port 0: a free one, held by a bound SO_REUSEPORT socket
    that never listens, so the workers can all bind it), and that socket."""
    import dataclasses  # noqa: PLC0415
    import socket  # noqa: PLC0415

    host, _, port = cfg.listen.rpartition(":")
    host = host or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), int(port)))
    except OSError as e:
        sock.close()
        raise SystemExit(f"kvtier gateway: cannot listen on {cfg.listen}: {e.strerror}") from None
    return dataclasses.replace(cfg, listen=f"{host}:{sock.getsockname()[1]}"), sock


def run_workers(cfg: GatewayConfig) -> int:
    """``--workers N``: N forked processes serve one port (SO_REUSEPORT), sharing the session
    and prefix maps (:mod:`.shared`); each has its own router, feed subscriptions, connection
    pools and prompt cache, and its own /metrics port (``--metrics-port P``: P, P+1, ...; 0: a
    free one each). SIGTERM or SIGINT stops them all; one that exits stops the others."""
    import signal  # noqa: PLC0415

    cfg, held = _reserve_port(cfg)
    pids, ports = _fork_workers(cfg, held)
    if not ports:
        return 1
    host, _, _ = cfg.listen.rpartition(":")
    mports = [m for _, m in ports if m != "-1"]
    print(f"kvtier gateway listening on http://{host}:{ports[0][0]}"
          + (f", metrics on ports {', '.join(mports)}" if mports else "")
          + f"; policy {cfg.policy}; workers {cfg.workers}; replicas "
          + (", ".join(cfg.replicas) or "discovered"), flush=True)
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in pids:
            _kill(pid)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    alive = set(pids)
    while alive:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        alive.discard(pid)
        if not stopping:
            code = 1
            log.error("gateway worker %d exited (status %d): stopping the others", pid, status)
            stop()
    return code


def _fork_workers(cfg: GatewayConfig, held: Any) -> tuple[list[int], list[list[str]]]:
    """Fork the workers; their pids and (port, metrics port) each once all listen ([] when one
    failed to start: the others are stopped)."""
    import signal  # noqa: PLC0415

    shared = shared_maps(cfg)
    pids, reads = [], []
    for i in range(cfg.workers):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker
            os.close(r)
            held.close()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 1
            try:
                code = _run(cfg, ready=w, worker=i, shared=shared)
            finally:
                os._exit(code)
        os.close(w)
        pids.append(pid)
        reads.append(r)
    ports = []
    for r in reads:
        with os.fdopen(r) as f:
            line = f.readline().split()
        if len(line) != 2:
            for pid in pids:
                _kill(pid)
            held.close()
            return pids, []
        ports.append(line)
    held.close()
    return pids, ports


def _kill(pid: int) -> None:
    import signal  # noqa: PLC0415

    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    cfg: GatewayConfig = SETTINGS.load_or_exit(argv, check=check_settings)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if cfg.workers > 1:
        return run_workers(cfg)
    return _run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvtier route-server``: the :class:`~kvtier.client.routing.router.Router` as a gRPC service.

Serves ``kvtier.v1.Router`` (``Route``, ``Finish``, ``Status``; see router.proto) on a unix
socket or TCP address, for external routers and gateways; the Python API is the same
``Router``. Every setting (:class:`RouteServerConfig`: the server's own, then every
``RouterConfig`` and ``ScorerConfig`` field) is a flag, an environment variable
``KVTIER_ROUTER_<NAME>`` (``--state-path`` is ``KVTIER_ROUTER_STATE_PATH``) and a key of the
TOML file named by ``--config``; a flag beats the variable beats the file beats the default.
Lists (``--daemon``, ``--dns``, ``--vllm-events``) repeat the flag or, in the variable, are
separated by commas. ``--vllm-events`` subscribes to vLLM engines' own KV event publishers
(docs/integrations.md); their streams appear in ``Status`` as feeds named ``vllm+ENDPOINT#TOPIC``
(``seq``: the last batch applied; ``resumes``: gaps filled by replay; ``snapshots``: gaps that
cleared the worker; ``epoch_changes``: publisher restarts and disconnects).
On SIGTERM or SIGINT the server stops, and with ``--state-path`` the index and its positions
are saved, so the next start resumes where this one stopped.

With neither ``--daemon`` nor ``--dns`` it follows this node's kvtierd
(:func:`kvtier.client.engine.transport.socket_path`: ``$KVTIER_SOCKET``, else the default
socket path). A ``--daemon`` that is a plain path is a unix socket (:func:`feed_target`).
Candidates a Route request names must be workers the router knows (INVALID_ARGUMENT naming
the others). A Route request's ``dispatch`` is a proto3 bool: false unless set, so a plain
``Route`` only ranks, where Python's ``Router.route`` dispatches by default.

``Route`` runs in a worker thread, so a feed folding a large snapshot (which holds the
router's lock) never stalls the event loop; routing itself takes tens of microseconds.

``--help`` shows :data:`HELP` (plain text), not this docstring.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.transport import SOCKET_ENV, ClientTls, socket_path
from kvtier.client.routing.feed import feed_target
from kvtier.client.routing.health import RouterHealth
from kvtier.client.routing.recorder import RecordConfig, Recorder, on_finish, on_route, open_recorder
from kvtier.client.routing.router import (
    Decision,
    FeedStatus,
    Router,
    RouterConfig,
    RouterError,
    UnknownCandidates,
)
from kvtier.client.routing.snapshot import SnapshotConfig, Snapshots, SnapshotStore
from kvtier.paths import default_socket_path
from kvtier.proto import router_pb2, router_pb2_grpc
from kvtier.settings import Settings, SettingsError, group, parse_bool, parse_int, setting
from kvtier.tiers.vocab import MAX_KEYS_PER_CALL, check_keys

log = logging.getLogger("kvtier.route_server")

MAX_KEYS = MAX_KEYS_PER_CALL
"""The most keys (or blocks of token ids) one Route request may name."""

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class RouteServerConfig:
    """Every ``kvtier route-server`` setting: where it listens, the router's and scorer's."""

    listen: str = setting("127.0.0.1:7071", "address to serve on: HOST:PORT or unix:PATH (port 0: any free port); "
                                            "a unix socket is created 0600; TCP beyond loopback needs --tls-cert, "
                                            "--tls-key and --tls-ca (or --insecure-tcp)", metavar="ADDRESS")
    tls_cert: str = setting("", "PEM certificate of the --listen TCP listener (mutual TLS with --tls-key and "
                                "--tls-ca)", metavar="FILE")
    tls_key: str = setting("", "PEM private key of --tls-cert", metavar="FILE")
    tls_ca: str = setting("", "PEM CA that signs the clients' certificates: with --tls-cert every client must "
                              "present one", metavar="FILE")
    insecure_tcp: bool = setting(False, "serve a --listen TCP address that is not loopback in plaintext, "
                                        "unauthenticated (warned at start); refused without this unless "
                                        "TLS is set", parse_bool, "BOOL")
    health_listen: str = setting("", "also serve the gRPC health service alone, in plaintext, on this HOST:PORT "
                                     "(for probes: kvtier health HOST:PORT; loopback unless --insecure-tcp); the "
                                     "--listen address serves it too", metavar="HOST:PORT")
    daemon_tls_cert: str = setting("", "client certificate this router presents to kvtierds over TCP (their "
                                       "--tls-ca must sign it; its CN is the tenant whose feed it gets)",
                                   metavar="FILE")
    daemon_tls_key: str = setting("", "PEM private key of --daemon-tls-cert", metavar="FILE")
    daemon_tls_ca: str = setting("", "PEM CA that signs the kvtierds' --tls-cert", metavar="FILE")
    metrics_port: int = setting(0, "serve Prometheus metrics (kvtier_router_*: feeds' lag and drops, catching "
                                   "up, index snapshots) on this TCP port (0: off)", parse_int, "PORT")
    metrics_host: str = setting("127.0.0.1", "address for the metrics listener", metavar="HOST")
    router: RouterConfig = group(RouterConfig, "Router")
    record: RecordConfig = group(RecordConfig, "Trace recording")  # client/routing/recorder.py
    snapshot: SnapshotConfig = group(SnapshotConfig, "Index snapshots")  # client/routing/snapshot.py
    log_level: str = setting("info", "debug, info, warning or error")
    config: str = setting("", "TOML file with any of these settings (keys: the flag names with _ for -)",
                          metavar="FILE")


HELP = """\
Serve cache-aware routing decisions over gRPC: service kvtier.v1.Router (Route, Finish,
Status), for gateways and external routers. It follows the location feeds of the kvtierds
given by --daemon and --dns and ranks workers for each request by the prefill each would
still need.

Daemons: a --daemon is a socket path (/..., ./...), unix:PATH or HOST:PORT. With neither
--daemon nor --dns it follows this node's kvtierd: $KVTIER_SOCKET, else the default socket
($XDG_RUNTIME_DIR/kvtier/kvtierd.sock, else /tmp/kvtier-$UID/kvtierd.sock).

Dispatch: RouteRequest.dispatch is a proto3 bool and so FALSE unless set: a plain Route only
ranks (a dry run). Set dispatch=true to record the decision (the chosen worker's load and
speculative entries, so the session's next turn sticks) and call Finish(decision_id) when
the request ends. Python's Router.route(keys) dispatches by default (dispatch=True).

Fetch hints: with --pulls (the default; --no-pulls: none) a worker may be ranked first for
blocks it can fetch from another node's host or disk or the shared store (TierOverlap.remote);
then RouteReply.fetch names those keys and the node holding them ("store": the shared store).
Apply them before the prefill: Sidecar.prefetch(layout_id, keys, from_node=from_node).
The route-server only returns them: the caller (a gateway) applies them, as kvtier gateway
does with its in-process router.

Health: grpc.health.v1 on --listen (and alone, in plaintext, on --health-listen for probes):
the server ("") is SERVING once it listens; kvtier.v1.Router is SERVING while the router
knows at least one worker (a daemon's feed answered), NOT_SERVING before. Probe with
kvtier health 127.0.0.1:PORT [--service kvtier.v1.Router].

Candidates: RouteRequest.candidates must name workers the router knows (see Status); any
other name is refused with INVALID_ARGUMENT naming it.

Client stubs: from kvtier.proto import router_pb2, router_pb2_grpc
(the service definition: kvtier/proto/kvtier/v1/router.proto in the installed package).

Recording: --record-trace FILE writes every dispatched request as a trace kvtier replay reads
(hash ids numbered per file; no key leaves the router). Route call metadata
x-kvtier-session-id gives its session_id, Finish call metadata x-kvtier-output-tokens its
output_length. Status counts recorded_requests and record_dropped.

Index snapshots: with --index-snapshot redis://HOST:PORT[,...] (the Redis Cluster of the
shared store; rediss:// with --snapshot-tls-ca for TLS) the router saves its index and every
feed's position there every --snapshot-interval-s and on stop, under --snapshot-name (default
--name: replicas of one fleet share it). A router that starts loads the latest snapshot and
resumes each feed from its position (a --state-path file, when present, is loaded instead).

Catching up: the router answers Route as soon as it listens, from what it holds (a loaded
snapshot or state file included), while its feeds catch up. Status shows it: a feed not yet
connected, or whose seq is below its head_seq (lag: head_seq - seq events), is catching up.
With --metrics-port, kvtier_router_catching_up is 1 until every feed has caught up, and
kvtier_router_feed_lag_events{target} is each feed's lag.

Backpressure: each feed's messages wait in a queue of at most --feed-queue-keys keys, and the
feeds' messages are folded in turns, a piece of at most --fold-keys keys at a time, so a flooding
daemon neither delays the others' events nor holds routing up. A feed whose queue overflows
drops what it queued (counted: kvtier_router_feed_dropped_events_total) and resubscribes from
a snapshot of its daemon.

Settings: every option is also a variable KVTIER_ROUTER_<NAME> (--state-path:
KVTIER_ROUTER_STATE_PATH) and a key of the --config TOML file (state_path); a flag beats the
variable beats the file beats the default. Lists repeat the flag (--daemon A --daemon B); in
a variable they are comma-separated. SIGTERM or SIGINT stops the server (saving
--state-path, so the next start resumes).
"""

SETTINGS = Settings(RouteServerConfig, "KVTIER_ROUTER_", "kvtier route-server", description=HELP)


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouteServerConfig:
    """Flags, variables (``env``, default ``os.environ``) and the TOML file, with the local
    daemon as the default feed (:func:`with_local_daemon`); raises
    :class:`~kvtier.settings.SettingsError` for a value that cannot be used."""
    cfg: RouteServerConfig = SETTINGS.load(argv, env)
    check_settings(cfg)
    return with_local_daemon(cfg, env)


def with_local_daemon(cfg: RouteServerConfig, env: Mapping[str, str] | None = None) -> RouteServerConfig:
    """``cfg``, following this node's kvtierd when it names no daemon, DNS name or vLLM event
    source: ``$KVTIER_SOCKET`` of ``env`` (default ``os.environ``), else the default socket path."""
    if cfg.router.daemons or cfg.router.dns or cfg.router.vllm_events:
        return cfg
    env = os.environ if env is None else env
    local = f"unix:{socket_path(env.get(SOCKET_ENV) or default_socket_path())}"
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, daemons=(local,)))


def check_settings(cfg: RouteServerConfig) -> None:
    """Refuse an unknown log level, half a TLS setting, and plaintext TCP beyond loopback."""
    if cfg.log_level.lower() not in LOG_LEVELS:
        raise SettingsError(f"--log-level: {cfg.log_level!r} is not debug, info, warning or error")
    for group_ in (("tls_cert", "tls_key", "tls_ca"), ("daemon_tls_cert", "daemon_tls_key", "daemon_tls_ca")):
        given = [n for n in group_ if getattr(cfg, n)]
        if given and len(given) != 3:
            raise SettingsError(f"{', '.join('--' + n.replace('_', '-') for n in group_)} go together; missing "
                                f"{', '.join('--' + n.replace('_', '-') for n in group_ if n not in given)}")
    tcp = not cfg.listen.startswith("unix:")
    if tcp and not cfg.tls_cert and not cfg.insecure_tcp and not _loopback(cfg.listen):
        raise SettingsError(f"--listen {cfg.listen} without TLS would serve anyone who reaches the port: give "
                            f"--tls-cert, --tls-key and --tls-ca, or pass --insecure-tcp")
    if cfg.health_listen and not cfg.insecure_tcp and not _loopback(cfg.health_listen):
        raise SettingsError(f"--health-listen {cfg.health_listen} is plaintext: give a loopback address (a probe "
                            f"runs in the pod), or pass --insecure-tcp")
    if cfg.record.check():
        raise SettingsError(str(cfg.record.check()))
    if cfg.snapshot.check():
        raise SettingsError(str(cfg.snapshot.check()))


def _loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def daemon_tls(cfg: RouteServerConfig) -> ClientTls | None:
    """The client certificate for daemons over TCP, when configured."""
    if not cfg.daemon_tls_cert:
        return None
    return ClientTls(cfg.daemon_tls_cert, cfg.daemon_tls_key, cfg.daemon_tls_ca)


def request_keys(req: router_pb2.RouteRequest) -> list[bytes]:
    """The request's block keys; raises ValueError with a message for the caller."""
    if req.keys and req.token_ids:
        raise ValueError("give keys or token_ids, not both")
    if req.token_ids:
        if not req.HasField("namespace") or not req.namespace.model:
            raise ValueError("token_ids need a namespace with a model")
        if req.block_tokens <= 0:
            raise ValueError("token_ids need block_tokens > 0 (the engine's block size)")
        if len(req.token_ids) // req.block_tokens > MAX_KEYS:
            raise ValueError(f"{len(req.token_ids)} token ids make {len(req.token_ids) // req.block_tokens} "
                             f"blocks of {req.block_tokens}; at most {MAX_KEYS} blocks")
        return block_keys(list(req.token_ids), req.block_tokens,
                          Namespace(req.namespace.model, req.namespace.tenant_salt))
    keys = list(req.keys)
    check_keys(keys)
    return keys


def request_candidates(req: router_pb2.RouteRequest) -> list[str] | None:
    """The request's candidate workers (None: every worker); raises ValueError for an empty name."""
    for i, c in enumerate(req.candidates):
        if not c:
            raise ValueError(f"candidate {i} is an empty worker name")
    return list(req.candidates) or None


class _BadRequest(Exception):
    """A Route request that cannot be ranked as given (answered INVALID_ARGUMENT)."""


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, recorder: Recorder | None = None) -> None:
        self.router = router
        self.recorder = recorder
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-route")

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteReply:
        metadata = context.invocation_metadata() if self.recorder is not None else None

        def route() -> Decision:  # hashing token ids is work too: off the event loop
            try:
                keys, candidates = request_keys(request), request_candidates(request)
            except ValueError as e:
                raise _BadRequest(str(e)) from None
            d = self.router.route(keys, candidates, dispatch=request.dispatch,
                                  top_k=request.top_k or self.router.config.top_k)
            on_route(self.recorder, request, metadata, keys, d.decision_id)
            return d

        try:
            d = await asyncio.get_running_loop().run_in_executor(self._pool, route)
        except (_BadRequest, UnknownCandidates) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        reply = router_pb2.RouteReply(n_blocks=d.n_blocks, decision_id=d.decision_id)
        for r, node in zip(d.ranked, d.nodes, strict=True):
            reply.ranked.add(worker_id=r.worker, node_id=node, cost=r.cost, saved_blocks=r.saved_blocks,
                             overlap=router_pb2.TierOverlap(gpu=r.overlap.gpu, host=r.overlap.host,
                                                            disk=r.overlap.disk, remote=r.overlap.remote),
                             queued_blocks=r.load.queued_blocks, active_requests=r.load.active_requests)
        for h in d.fetch:
            reply.fetch.add(worker_id=h.worker, from_node=h.from_node, keys=h.keys, start=h.start, end=h.end)
        return reply

    async def Finish(self, request: router_pb2.FinishRequest, context: Any) -> router_pb2.FinishReply:
        on_finish(self.recorder, request, context.invocation_metadata())
        return router_pb2.FinishReply(found=self.router.finish(request.decision_id, request.prefill_only))

    async def Status(self, request: router_pb2.RouterStatusRequest, context: Any) -> router_pb2.RouterStatusReply:
        reply = router_pb2.RouterStatusReply(indexed_keys=self.router.indexed_keys(),
                                             workers=[w for w, _ in self.router.workers()])
        if self.recorder is not None:
            c = self.recorder.counts()
            reply.recorded_requests, reply.record_dropped = c["recorded"], c["dropped"]
        for st in self.router.status():
            reply.feeds.add(target=st.target, node_id=st.node_id, connected=st.connected, epoch=st.epoch,
                            seq=st.seq, head_seq=st.head_seq, snapshots=st.snapshots, resumes=st.resumes,
                            epoch_changes=st.epoch_changes, last_error=st.last_error,
                            dropped_events=st.dropped_events, overflows=st.overflows)
        reply.catching_up = catching_up(self.router.status())
        for v in self.router.vllm_status():
            reply.feeds.add(target=f"vllm+{v.source.split(',')[0]}#{v.topic}", node_id=v.node_id,
                            connected=v.connected, seq=max(v.seq, 0), head_seq=max(v.seq, 0),
                            snapshots=v.gaps_lost, resumes=v.gaps_recovered, epoch_changes=v.restarts,
                            last_error=v.last_error)
        return reply


def catching_up(feeds: Sequence[FeedStatus]) -> bool:
    """Whether a router with these feeds is still catching up: none yet, or one not connected
    or behind its daemon's newest event."""
    return not feeds or not all(st.synced for st in feeds)


async def _log_caught_up(router: Router, started: float) -> None:
    """Log once when every feed has caught up (the time since the router started)."""
    while catching_up(router.status()):
        await asyncio.sleep(0.05)
    log.info(f"every feed caught up {time.monotonic() - started:.2f} s after start",
             extra={"caught_up_s": round(time.monotonic() - started, 3)})


def start_metrics(router: Router, snapshots: Snapshots | None, host: str, port: int) -> Any:
    """Serve ``/metrics`` (Prometheus) on host:port in a thread: the feeds' lag, drops and
    connections, whether the router is catching up, its index size and its snapshots. Returns
    the HTTP server (``shutdown()`` and ``server_close()`` stop it). Raises OSError."""
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

    class Collector:
        def collect(self):  # noqa: ANN202
            feeds = router.status()
            yield GaugeMetricFamily("kvtier_router_catching_up", "1 while a feed is not connected yet or behind "
                                    "its daemon's newest event (the router answers meanwhile from what it "
                                    "holds), else 0", value=int(catching_up(feeds)))
            yield GaugeMetricFamily("kvtier_router_indexed_keys", "keys in the router's index ((key, location) "
                                    "pairs with --index-layout pairs)", value=router.indexed_keys())
            yield GaugeMetricFamily("kvtier_router_index_bytes", "bytes of the router's index arrays",
                                    value=router.index_bytes())
            lag = GaugeMetricFamily("kvtier_router_feed_lag_events", "events the feed is behind its daemon's "
                                    "newest as last told (head_seq - seq)", labels=["target", "node"])
            up = GaugeMetricFamily("kvtier_router_feed_connected", "1 while the feed's stream is up",
                                   labels=["target", "node"])
            queued = GaugeMetricFamily("kvtier_router_feed_queued_keys", "keys of the feed's messages waiting "
                                       "to be folded (at most --feed-queue-keys)", labels=["target", "node"])
            dropped = CounterMetricFamily("kvtier_router_feed_dropped_events", "events a feed dropped when its "
                                          "queue overflowed (the feed then resubscribed from a snapshot)",
                                          labels=["target", "node"])
            overflows = CounterMetricFamily("kvtier_router_feed_overflows", "times a feed's queue overflowed",
                                            labels=["target", "node"])
            for st in feeds:
                labels = [st.target, st.node_id]
                lag.add_metric(labels, max(st.head_seq - st.seq, 0))
                up.add_metric(labels, int(st.connected))
                queued.add_metric(labels, getattr(st, "queued_keys", 0))
                dropped.add_metric(labels, getattr(st, "dropped_events", 0))
                overflows.add_metric(labels, getattr(st, "overflows", 0))
            yield from (lag, up, queued, dropped, overflows)
            if snapshots is not None:
                saves = CounterMetricFamily("kvtier_router_index_snapshots", "index snapshots written by this "
                                            "router, by outcome (saved, failed)", labels=["outcome"])
                saves.add_metric(["saved"], snapshots.saves)
                saves.add_metric(["failed"], snapshots.failures)
                yield saves
                yield GaugeMetricFamily("kvtier_router_index_snapshot_restored", "1 when this router started "
                                        "from an index snapshot", value=int(snapshots.restored is not None))
                yield GaugeMetricFamily("kvtier_router_index_snapshot_bytes", "bytes of the last snapshot "
                                        "this router wrote", value=snapshots.last_bytes)
                if snapshots.last_saved is not None:
                    yield GaugeMetricFamily("kvtier_router_index_snapshot_age_seconds", "seconds since this "
                                            "router last wrote a snapshot",
                                            value=time.monotonic() - snapshots.last_saved)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def _server_credentials(cfg: RouteServerConfig) -> grpc.ServerCredentials:
    def read(flag: str, path: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as e:
            raise SystemExit(f"kvtier route-server: cannot read {flag} {path}: {e.strerror}") from None
    return grpc.ssl_server_credentials([(read("--tls-key", cfg.tls_key), read("--tls-cert", cfg.tls_cert))],
                                       root_certificates=read("--tls-ca", cfg.tls_ca), require_client_auth=True)


async def _restore(router: Router, cfg: RouterConfig, server_cfg: RouteServerConfig) -> Snapshots | None:
    """With --index-snapshot: the snapshots, the latest loaded into ``router`` (unless a
    --state-path file is there: the router loads that)."""
    if not server_cfg.snapshot.index_snapshot:
        return None
    try:
        store = SnapshotStore.from_config(server_cfg.snapshot, cfg.name)
    except OSError as e:
        raise SystemExit(f"kvtier route-server: cannot read --snapshot-password-file: {e.strerror}") from None
    snapshots = Snapshots(store, router, server_cfg.snapshot.snapshot_interval_s)
    if not (cfg.state_path and os.path.exists(cfg.state_path)):
        await asyncio.get_running_loop().run_in_executor(None, snapshots.restore)
    return snapshots


def _metrics(router: Router, snapshots: Snapshots | None, server_cfg: RouteServerConfig) -> Any:
    if not server_cfg.metrics_port:
        return None
    try:
        return start_metrics(router, snapshots, server_cfg.metrics_host, server_cfg.metrics_port)
    except OSError as e:
        raise SystemExit(f"kvtier route-server: cannot listen on --metrics-port {server_cfg.metrics_port}: "
                         f"{e.strerror}") from None


async def _stop_extras(snapshots: Snapshots | None, metrics: Any) -> None:
    """The last snapshot (after the feeds stopped), then the metrics listener."""
    if snapshots is not None:
        await asyncio.get_running_loop().run_in_executor(None, snapshots.final)
        snapshots.store.close()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()


def _bind(server: grpc.aio.Server, listen: str, server_cfg: RouteServerConfig) -> int:
    """Add the --listen port to ``server``; the port bound (0 for a unix socket that failed)."""
    old_umask = os.umask(0o177)  # a unix socket: owner only
    try:  # grpcio returns 0 or raises RuntimeError, by version, for an address it cannot bind
        if server_cfg.tls_cert and not listen.startswith("unix:"):
            port = server.add_secure_port(listen, _server_credentials(server_cfg))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    finally:
        os.umask(old_umask)
    if port == 0 and not listen.startswith("unix:"):
        raise SystemExit(f"kvtier route-server: cannot listen on {listen} (port taken? --listen HOST:0 takes "
                         "any free port)")
    if not listen.startswith("unix:") and not server_cfg.tls_cert:
        log.warning(f"route-server serves {listen} in plaintext without authentication: every user who reaches "
                    f"it can route and read Status; give --tls-cert, --tls-key and --tls-ca for mutual TLS")
    return port


async def serve(cfg: RouterConfig, listen: str, server_cfg: RouteServerConfig | None = None) -> None:
    server_cfg = server_cfg or RouteServerConfig(listen=listen)
    server = grpc.aio.server()
    port = _bind(server, listen, server_cfg)
    router = Router(cfg, tls=daemon_tls(server_cfg))
    snapshots = await _restore(router, cfg, server_cfg)
    started = time.monotonic()
    router.start()
    metrics = _metrics(router, snapshots, server_cfg)
    recorder = open_recorder(server_cfg.record)
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(router, recorder), server)
    health = RouterHealth(router)
    health.add_to(server)
    probe_server = None
    if server_cfg.health_listen:
        probe_server = grpc.aio.server()
        health.add_to(probe_server)
        try:
            ok = probe_server.add_insecure_port(server_cfg.health_listen)
        except RuntimeError:
            ok = 0
        if not ok:
            raise SystemExit(f"kvtier route-server: cannot listen on --health-listen {server_cfg.health_listen}")
        await probe_server.start()
    await server.start()
    await health.start()
    shown = listen if listen.startswith("unix:") else f"{listen.rpartition(':')[0]}:{port}"
    follows = ([feed_target(t) for t in cfg.daemons] + [f"dns:{n}" for n in cfg.dns]
               + [f"vllm:{e}" for e in cfg.vllm_events])
    print(f"kvtier route-server listening on {shown}, following {', '.join(follows)}", flush=True)
    log.info(f"route-server listening on {shown}; following {', '.join(follows)}",
             extra={"listen": shown, "daemons": list(cfg.daemons), "dns": list(cfg.dns),
                    "vllm_events": list(cfg.vllm_events)})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    jobs = asyncio.gather(_log_caught_up(router, started), *([snapshots.run()] if snapshots is not None else []))
    await stop.wait()
    jobs.cancel()
    await asyncio.gather(jobs, return_exceptions=True)
    await health.stop()
    if probe_server is not None:
        await probe_server.stop(0.5)
    await server.stop(1.0)
    await loop.run_in_executor(None, router.close)
    await _stop_extras(snapshots, metrics)
    if recorder is not None:
        recorder.close()


def main(argv: Sequence[str] | None = None) -> None:
    cfg: RouteServerConfig = with_local_daemon(SETTINGS.load_or_exit(argv, check=check_settings))
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(cfg.router, cfg.listen, cfg))


if __name__ == "__main__":
    main()

"""``kvtier route-server``: the :class:`~kvtier.client.routing.router.Router` as a gRPC service.

Serves ``kvtier.v1.Router`` (``Route``, ``Finish``, ``Status``; see router.proto) on a unix
socket or TCP address, for external routers and gateways; the Python API is the same
``Router``. Every setting is a flag and an environment variable ``KVTIER_ROUTER_<NAME>``
(``--state-path`` is ``KVTIER_ROUTER_STATE_PATH``); a flag beats the variable beats the
default. Lists (``--daemon``, ``--dns``) repeat the flag or, in the variable, are separated by
commas. On SIGTERM or SIGINT the server stops, and with ``--state-path`` the index and its
positions are saved, so the next start resumes where this one stopped.

``Route`` runs in a worker thread, so a feed folding a large snapshot (which holds the
router's lock) never stalls the event loop; routing itself takes tens of microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.routing.router import Decision, Router, RouterConfig, RouterError
from kvtier.client.routing.scoring import ScorerConfig
from kvtier.proto import router_pb2, router_pb2_grpc

log = logging.getLogger("kvtier.route_server")

KEY_MIN, KEY_MAX = 8, 32
MAX_KEYS = 65536
DEFAULT_TOP_K = 8

# (flag name, type, default, help); router settings first, then scorer settings
_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("listen", str, "127.0.0.1:7071", "address to serve on: HOST:PORT or unix:PATH (port 0: any free port)"),
    ("daemon", list, [], "a kvtierd to subscribe to (unix:PATH or HOST:PORT); repeat for several"),
    ("dns", list, [], "HOST:PORT whose DNS name resolves to several kvtierds; repeat for several"),
    ("resolve_interval_s", float, 10.0, "seconds between DNS resolutions"),
    ("speculative_ttl_s", float, 10.0, "unconfirmed speculative entries expire after this to twice this"),
    ("load_ttl_s", float, 600.0, "a dispatched request never finished stops counting as load after this"),
    ("state_path", str, "", "file for the saved index and positions (empty: start from snapshots)"),
    ("save_interval_s", float, 30.0, "seconds between saves of --state-path"),
    ("top_k", int, DEFAULT_TOP_K, "ranked workers returned when a request asks for 0"),
    ("prefill_tokens_per_s", float, ScorerConfig.prefill_tokens_per_s, "recompute rate of one worker (tokens/s)"),
    ("bytes_per_token", float, ScorerConfig.bytes_per_token, "KV bytes per token of the model shard, all layers"),
    ("host_load_gbps", float, ScorerConfig.host_load_gbps,
     "host->GPU load bandwidth when a daemon publishes none (10^9 B/s)"),
    ("disk_load_gbps", float, ScorerConfig.disk_load_gbps,
     "disk->GPU load bandwidth when a daemon publishes none (10^9 B/s)"),
    ("queued_weight", float, ScorerConfig.queued_weight, "cost per queued prefill block (a)"),
    ("active_weight", float, ScorerConfig.active_weight, "cost per running request (b)"),
    ("log_level", str, "info", "debug, info, warning or error"),
]


def _env(name: str) -> str:
    return "KVTIER_ROUTER_" + name.upper()


def parse_args(argv: Sequence[str] | None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = dict(os.environ) if env is None else env
    ap = argparse.ArgumentParser(prog="kvtier route-server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, typ, default, help_ in _SETTINGS:
        flag = "--" + name.replace("_", "-")
        raw = env.get(_env(name))
        if typ is list:
            dflt = [x for x in raw.split(",") if x] if raw else list(default)
            ap.add_argument(flag, dest=name, action="append", default=None,
                            help=f"{help_} [env {_env(name)}, comma-separated]")
            ap.set_defaults(**{f"_default_{name}": dflt})
        else:
            try:
                dflt = typ(raw) if raw is not None else default
            except ValueError:
                ap.error(f"{_env(name)}={raw!r} is not a {typ.__name__}")
            ap.add_argument(flag, dest=name, type=typ, default=dflt,
                            help=f"{help_} [env {_env(name)}; default {default!r}]")
    ns = ap.parse_args(argv)
    for name, typ, _, _ in _SETTINGS:
        if typ is list and getattr(ns, name) is None:
            setattr(ns, name, getattr(ns, f"_default_{name}"))
    if not ns.daemon and not ns.dns:
        ap.error("give at least one --daemon or --dns to subscribe to")
    return ns


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    scorer = ScorerConfig(prefill_tokens_per_s=ns.prefill_tokens_per_s, bytes_per_token=ns.bytes_per_token,
                          host_load_gbps=ns.host_load_gbps, disk_load_gbps=ns.disk_load_gbps,
                          queued_weight=ns.queued_weight, active_weight=ns.active_weight)
    return RouterConfig(daemons=tuple(ns.daemon), dns=tuple(ns.dns), resolve_interval_s=ns.resolve_interval_s,
                        speculative_ttl_s=ns.speculative_ttl_s, load_ttl_s=ns.load_ttl_s,
                        state_path=ns.state_path, save_interval_s=ns.save_interval_s, top_k=ns.top_k,
                        scorer=scorer)


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
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys; at most {MAX_KEYS}")
    for i, k in enumerate(keys):
        if not KEY_MIN <= len(k) <= KEY_MAX:
            raise ValueError(f"key {i} is {len(k)} bytes; keys are {KEY_MIN} to {KEY_MAX} bytes")
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
    def __init__(self, router: Router) -> None:
        self.router = router
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-route")

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteReply:
        def route() -> Decision:  # hashing token ids is work too: off the event loop
            try:
                keys, candidates = request_keys(request), request_candidates(request)
            except ValueError as e:
                raise _BadRequest(str(e)) from None
            return self.router.route(keys, candidates, dispatch=request.dispatch,
                                     top_k=request.top_k or self.router.config.top_k)

        try:
            d = await asyncio.get_running_loop().run_in_executor(self._pool, route)
        except _BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        reply = router_pb2.RouteReply(n_blocks=d.n_blocks, decision_id=d.decision_id)
        for r, node in zip(d.ranked, d.nodes, strict=True):
            reply.ranked.add(worker_id=r.worker, node_id=node, cost=r.cost, saved_blocks=r.saved_blocks,
                             overlap=router_pb2.TierOverlap(gpu=r.overlap.gpu, host=r.overlap.host,
                                                            disk=r.overlap.disk),
                             queued_blocks=r.load.queued_blocks, active_requests=r.load.active_requests)
        return reply

    async def Finish(self, request: router_pb2.FinishRequest, context: Any) -> router_pb2.FinishReply:
        return router_pb2.FinishReply(found=self.router.finish(request.decision_id, request.prefill_only))

    async def Status(self, request: router_pb2.RouterStatusRequest, context: Any) -> router_pb2.RouterStatusReply:
        reply = router_pb2.RouterStatusReply(indexed_keys=self.router.indexed_keys(),
                                             workers=[w for w, _ in self.router.workers()])
        for st in self.router.status():
            reply.feeds.add(target=st.target, node_id=st.node_id, connected=st.connected, epoch=st.epoch,
                            seq=st.seq, head_seq=st.head_seq, snapshots=st.snapshots, resumes=st.resumes,
                            epoch_changes=st.epoch_changes, last_error=st.last_error)
        return reply


async def serve(cfg: RouterConfig, listen: str) -> None:
    router = Router(cfg).start()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        router.close()
        raise SystemExit(f"kvtier route-server: cannot listen on {listen}")
    await server.start()
    shown = listen if listen.startswith("unix:") else f"{listen.rpartition(':')[0]}:{port}"
    print(f"kvtier route-server listening on {shown}", flush=True)
    log.info("route-server listening", extra={"listen": shown, "daemons": list(cfg.daemons),
                                              "dns": list(cfg.dns)})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await loop.run_in_executor(None, router.close)


def main(argv: Sequence[str] | None = None) -> None:
    ns = parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(config_from_args(ns), ns.listen))


if __name__ == "__main__":
    main()

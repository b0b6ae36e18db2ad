"""The route-server's gRPC health service (``grpc.health.v1.Health``), for probes (``kvtier health``).

* the whole server (service ``""``): SERVING as soon as it listens (a liveness probe: the
  process answers);
* ``kvtier.v1.Router``: SERVING while the router knows at least one worker (a feed's daemon
  has sent its NodeInfo, a vLLM event source has named one, or a loaded ``--state-path``
  held some), NOT_SERVING otherwise: what ``Route`` needs to answer rather than refuse with
  FAILED_PRECONDITION (a readiness probe). Re-read every :data:`POLL_S`.

Served on ``--listen`` (with its TLS) and, with ``--health-listen``, alone on a plaintext
address for probes inside the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtier.proto import router_pb2

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
POLL_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RouterHealth:
    """One health servicer, added to every server that serves it; :meth:`start` keeps it current."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task | None = None
        self.ready: bool | None = None

    def add_to(self, server: Any) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        await self.servicer.set("", _SERVING)
        await self._update()
        self._task = asyncio.ensure_future(self._poll())

    async def _update(self) -> None:
        ready = bool(self.router.workers())
        if ready != self.ready:
            self.ready = ready
            await self.servicer.set(ROUTER_SERVICE, _SERVING if ready else _NOT_SERVING)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self._update()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.servicer.enter_graceful_shutdown()

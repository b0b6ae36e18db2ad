"""What every gRPC handler of the daemon shares: errors answered with a status, and timing.

:func:`handled` wraps a unary handler, :func:`handled_stream` a server-streaming one (an async
generator), :func:`handled_writer` one that writes its replies itself. A
refused request (:class:`~kvtier.daemon.errors.StoreError`) is answered with its code's gRPC
status and its message; a bad layout with INVALID_ARGUMENT; an unexpected exception is logged
with its traceback and answered INTERNAL, and the daemon keeps serving. Each refusal is
counted by code (``kvtier_errors_total{code}``). A unary handler's time (errors included)
goes into the :class:`~kvtier.daemon.metrics.OpLatency` histograms, exported as
``kvtier_op_latency_seconds{op}`` (op: the RPC's name in lower case); a stream is not timed
(its length is its subscriber's).

A servicer using them has ``latency`` (an ``OpLatency``) and ``counters`` (the store's
:class:`~kvtier.daemon.counters.Counters`) attributes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvtier.daemon.errors import Code, StoreError
from kvtier.tiers.layout import LayoutError

log = logging.getLogger("kvtier.service")

T = TypeVar("T")


def status_of(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def _refusal(name: str, exc: BaseException) -> tuple[Code, str]:
    if isinstance(exc, StoreError):
        return exc.code, str(exc)
    if isinstance(exc, LayoutError):
        return Code.INVALID_ARGUMENT, f"bad layout: {exc}"
    log.error("internal error in %s", name, exc_info=exc)
    return Code.INTERNAL, f"internal error in {name}; see the daemon log"


async def _abort(servicer: Any, context: grpc.aio.ServicerContext, code: Code, message: str) -> None:
    # counted before the abort: the client sees the status as soon as abort sends it
    servicer.counters.refused(code)
    await context.abort(status_of(code), message)


def handled(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap a unary handler (see the module docstring)."""
    op = fn.__name__.lower()

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        try:
            reply = await fn(self, request, context)
        except grpc.aio.AbortError:
            self.latency.observe(op, time.perf_counter() - started)
            raise
        except Exception as e:
            code, message = _refusal(fn.__name__, e)
        else:
            self.latency.observe(op, time.perf_counter() - started)
            return reply
        self.latency.observe(op, time.perf_counter() - started)
        await _abort(self, context, code, message)
        raise AssertionError("unreachable")
    return wrapper


def handled_writer(fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Wrap a server-streaming handler that writes its replies itself (``context.write``):
    errors as :func:`handled`, not timed (so not listed among the timed ops either)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, message = _refusal(fn.__name__, e)
            await _abort(self, context, code, message)
    del wrapper.__wrapped__  # type: ignore[attr-defined]  # the daemon times the handlers that have it
    return wrapper


def handled_stream(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Wrap a server-streaming handler (an async generator): errors as :func:`handled`, not timed."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for reply in fn(self, request, context):
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, message = _refusal(fn.__name__, e)
            await _abort(self, context, code, message)
    return wrapper

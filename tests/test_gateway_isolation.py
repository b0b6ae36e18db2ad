# ruff: noqa: F811  (the fixtures imported from test_gateway are arguments here)
"""``kvtier gateway`` between clients: what one client can steer or learn of another's.

Each test runs the gateway as ``kvtier gateway`` serves it (its runner on a loopback socket, or
the ``kvtier gateway`` process) in front of small aiohttp replicas written here (stand-ins for
engine servers, no part of kvtier), driven by the official ``openai`` client or raw sockets:
sessions scoped to the API key's client, no replica name in answers by default, metrics only
on the metrics port, bounded slow and idle connections and connections per client, and the
headers a replica gets.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_gateway import (  # noqa: F401 (fixtures)
    PLAIN,
    REPLICA_HEADER,
    backend,
    chat,
    gateway,
    loop,
    post,
    tokenizer_dir,
)

openai = pytest.importorskip("openai")

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef00"


@pytest.fixture
def keys_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text(f"# id key\nalice {ALICE}\nbob {BOB}\n")
    return str(path)


def test_a_session_id_steers_only_its_own_clients_requests(loop, gateway, keys_file) -> None:
    """With --api-keys-file, bob sending alice's session id (as x-session-id, or as the body's
    ``user``) gets his own session: not pinned to alice's replica; no key, or an unknown one,
    is 401 and reaches no replica."""
    seen: list = []
    urls = {n: f"http://127.0.0.1:{loop.serve(backend(n, seen))}" for n in ("a", "b")}
    url, gw = gateway(urls, policy="session", api_keys_file=keys_file, replica_header=False)
    alice = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
    bob = openai.OpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0)
    msgs = [{"role": "user", "content": "tok3 tok4 tok5 tok6 tok7"}]
    for how in ({"extra_headers": {"x-session-id": "alice-s1"}}, {"user": "alice-id"}):
        alice.chat.completions.create(model="tiny", messages=msgs, **how)
        hers = seen[-1][0]
        n = len(seen)
        for _ in range(12):
            bob.chat.completions.create(model="tiny", messages=msgs, **how)
        bobs = [s[0] for s in seen[n:]]
        assert hers not in bobs, (how, hers, bobs)
        assert len(set(bobs)) == 1  # bob's own session still sticks
    n = len(seen)
    for key in ("none", "x" * 24):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).chat.completions.create(
                model="tiny", messages=msgs)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).models.list()
    assert len(seen) == n
    assert [m.id for m in alice.models.list().data] == ["tiny"]


def test_a_new_session_starts_only_from_its_own_clients_conversations(loop, gateway, keys_file) -> None:
    """A new session whose prompt opens as one of its client's other sessions did starts from
    that one's stored turn (``shared``: the opening tokenized once); another client's new
    session with the same opening is tokenized from scratch, never from alice's."""
    seen: list = []
    url, gw = gateway({"a": f"http://127.0.0.1:{loop.serve(backend('a', seen))}"}, policy="kvtier",
                      api_keys_file=keys_file, replica_header=False)
    system = " ".join(f"tok{3 + i % 900}" for i in range(400))

    def send(key: str, session: str) -> None:
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).chat.completions.create(
            model="tiny", extra_headers={"x-session-id": session},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"tok{len(session)} tok9"}])

    send(ALICE, "s1")
    send(ALICE, "s22")
    assert (gw.prompts.counts["scratch"], gw.prompts.counts["shared"]) == (1, 1)
    send(BOB, "s333")
    assert (gw.prompts.counts["scratch"], gw.prompts.counts["shared"]) == (2, 1)
    send(BOB, "s4444")
    assert (gw.prompts.counts["scratch"], gw.prompts.counts["shared"]) == (2, 2)
    assert len(seen) == 4


def test_answers_do_not_name_their_replica_unless_asked(loop, gateway) -> None:
    """X-Kvtier-Replica is off by default (a client would learn where its prompt is cached);
    --replica-header turns it on. A replica's own x-kvtier-* headers do not pass either."""
    from aiohttp import web

    async def leaky(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=PLAIN, content_type="application/json", headers={"X-Kvtier-Replica": "inner"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", leaky)
    replica = f"http://127.0.0.1:{loop.serve(app)}"
    for on in (False, True):
        url, _ = gateway({"a": replica}, replica_header=on)
        raw = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions \
            .with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "tok3"}])
        assert raw.headers.get(REPLICA_HEADER) == ("a" if on else None)


def test_metrics_are_served_on_the_metrics_port_only(tokenizer_dir, loop) -> None:
    """The ``kvtier gateway`` process: /metrics (with the per-tier overlap a client could read
    around its own request) is 404 on the API port and served on --metrics-port."""
    replica = f"http://127.0.0.1:{loop.serve(backend('a', []))}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.client.tools.cli", "gateway", "--listen", "127.0.0.1:0",
                             "--metrics-port", "0", "--model", "tiny", "--tokenizer", tokenizer_dir,
                             "--block-tokens", "4", "--replica", f"a={replica}", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+?), metrics on port (\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        url, mport = m.group(1), int(m.group(2))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tok3 tok4 tok5 tok6"}])
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/metrics", timeout=10)
        assert e.value.code == 404
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'kvtier_gateway_overlap_blocks_total{tier="host"}' in text
        assert re.search(r'kvtier_gateway_requests_total\{endpoint="chat",replica="a",status="200"\} 1', text)
    finally:
        proc.terminate()
        proc.wait(20)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the gateway closes ``s`` within ``seconds`` (what it sent before is skipped)."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slow_heads_idle_connections_and_connections_per_client_are_bounded(loop, gateway) -> None:
    """A client sending its request head slowly is closed after --header-timeout-s; a kept-alive
    connection idle after its answer after --idle-timeout-s; a client address holding
    --max-connections-per-client connections gets 429 on the next, and can connect again once
    one closes."""
    url, gw = gateway({"a": f"http://127.0.0.1:{loop.serve(backend('a', []))}"}, header_timeout_s=0.5,
                      idle_timeout_s=0.5, max_connections_per_client=3)
    slow = _connect(url)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
    for _ in range(3):  # a header line now and then, never the end of the head
        time.sleep(0.2)
        try:
            slow.sendall(b"X-Slow: 1\r\n")
        except OSError:
            break
    assert _closed_within(slow, 3.0), "a connection still sending its head was kept"
    slow.close()
    idle = _connect(url)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert idle.recv(1024).startswith(b"HTTP/1.1 200")
    assert _closed_within(idle, 3.0), "an idle kept-alive connection was kept"
    idle.close()
    held = [_connect(url) for _ in range(3)]
    extra = _connect(url)
    extra.settimeout(5)
    assert extra.recv(4096).startswith(b"HTTP/1.1 429")
    extra.close()
    held.pop().close()
    time.sleep(0.2)
    status, _, _ = post(url + "/v1/chat/completions", chat(5))
    assert status == 200
    for s in held:
        s.close()
    text = gw.metrics.render().decode()
    assert re.search(r'kvtier_gateway_errors_total\{reason="header_timeout"\} [1-9]', text)
    assert re.search(r'kvtier_gateway_errors_total\{reason="too_many_connections"\} 1', text)


def test_replicas_get_no_hop_by_hop_internal_or_client_credential_headers(loop, gateway, tmp_path) -> None:
    """Forwarded requests: hop-by-hop headers (and those Connection names), x-kvtier-*, the
    session header, the client's Authorization and claimed X-Forwarded-For are not passed;
    X-Forwarded-For is the client's address; Authorization is the replicas' key only with
    --replica-api-key-file; other headers pass unchanged."""
    seen: list = []
    replica = f"http://127.0.0.1:{loop.serve(backend('a', seen))}"
    sent = {"Authorization": "Bearer client-secret", "X-Forwarded-For": "10.9.9.9", "x-session-id": "s1",
            "X-Kvtier-Replica": "b", "X-Kvtier-Tenant": "other", "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "1", "Keep-Alive": "timeout=5", "TE": "trailers", "Upgrade": "h2c",
            "Proxy-Authorization": "Basic eA==", "Trailer": "X-T", "X-Custom": "kept"}
    url, _ = gateway({"a": replica})

    def send() -> int:  # (http.client sends the headers as given; urllib would replace Connection)
        c = http.client.HTTPConnection(url.removeprefix("http://"), timeout=20)
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(chat(5)),
                      {**sent, "Content-Type": "application/json"})
            return c.getresponse().status
        finally:
            c.close()

    assert send() == 200
    got = {k.lower(): v for k, v in seen[-1][3].items()}
    for name in ("authorization", "x-session-id", "x-kvtier-replica", "x-kvtier-tenant", "x-drop-me", "keep-alive",
                 "te", "upgrade", "proxy-authorization", "trailer"):
        assert name not in got, (name, got)
    assert got["x-forwarded-for"] == "127.0.0.1" and got["x-custom"] == "kept"
    assert got.get("connection", "keep-alive").lower() == "keep-alive"  # (the gateway's own pool's)
    key = tmp_path / "replica-key"
    key.write_text("replica-secret\n")
    url, _ = gateway({"a": replica}, replica_api_key_file=str(key))
    assert send() == 200
    assert seen[-1][3]["Authorization"] == "Bearer replica-secret"

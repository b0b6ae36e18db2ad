"""Record traces where requests are routed, turn chat logs into traces, measure live.

* A multi-turn workload routed through a real ``kvtier route-server --record-trace`` over two
  real kvtierds (each request looked up and stored on the daemon the router chose, as an
  engine with kvtier would): the replay of the recorded trace under the policy used live (the
  route-server's, ``kvtier``) gives the hit rate the daemons counted.
* A chat log built here (sessions with growing histories, shared system prompts, tools),
  converted with a tokenizer built here: the trace's ideal prefix hit rate equals the one
  computed from the token ids directly.
* The recorder alone: rotation by size, dropped records counted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from _wait import wait_for

from kvtier.client.engine.keys import Namespace, block_keys
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.routing.recorder import OUTPUT_HEADER, SESSION_HEADER, RecordConfig, Recorder
from kvtier.client.tools import measure, replay
from kvtier.client.tools.trace import ideal_hit_rate
from kvtier.proto import router_pb2, router_pb2_grpc
from kvtier.tiers.layout import Layout

BT = 16
LAYOUT = Layout.flat(1024, BT)
NS = Namespace("measure-model", "salt")
TOLERANCE = 0.02
"""Replay against live hit rate (share of blocks): the two routers decide on the same holdings,
but the live one sees host blocks and real timing, the replay its simulated gpu tier and
service times, so a tie among equally loaded workers may go the other way."""


def _workload(sessions: int, turns: int, seed: int = 1) -> list[tuple[str, list[int]]]:
    """(session, prompt token ids) turn-major: two shared system prompts of 2 and 3 blocks, then
    each turn appends a user message and the previous answer."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(2 * BT + 5)], [rng.randrange(1000) for _ in range(3 * BT)]]
    hist = {s: list(systems[s % 2]) for s in range(sessions)}
    out = []
    for t in range(turns):
        for s in range(sessions):
            if t:
                hist[s] += [rng.randrange(1000) for _ in range(8)]  # the previous answer
            hist[s] += [rng.randrange(1000) for _ in range(rng.randrange(10, 40))]
            out.append((f"s{s}", list(hist[s])))
    return out


def _serve(stub, sidecars: dict[str, Sidecar], lids: dict[str, int], work: list[tuple[str, list[int]]]) -> None:
    """Route each request (dispatching, its session in the metadata), then do what an engine with
    kvtier does on the chosen node: look its blocks up, store the missing ones; then Finish."""
    for session, tokens in work:
        req = router_pb2.RouteRequest(token_ids=tokens, namespace=router_pb2.NamespaceSpec(
            model=NS.model, tenant_salt=NS.tenant_salt), block_tokens=BT, dispatch=True)
        reply = stub.Route(req, timeout=5, metadata=[(SESSION_HEADER, session)])
        node = reply.ranked[0].node_id
        keys = block_keys(tokens, BT, NS)
        sc = sidecars[node]
        held = sc.lookup(lids[node], keys)   # counted by that daemon
        new = [k for k, t in zip(keys, held, strict=True) if t is None]
        if new:
            assert not sc.put(lids[node], new, [bytes(1024)] * len(new)).dropped
        stub.Finish(router_pb2.FinishRequest(decision_id=reply.decision_id), timeout=5,
                    metadata=[(OUTPUT_HEADER, "8")])


def _measure_json(argv: list[str], out) -> dict:
    """``kvtier measure ARGV`` in this process; its JSON output."""
    with open(out, "w") as fh:
        old, sys.stdout = sys.stdout, fh
        try:
            rc = measure.main(argv)
        finally:
            sys.stdout = old
    assert rc == 0, out.read_text()
    return json.loads(out.read_text())


def test_recorded_trace_replays_to_the_live_hit_rate(start_daemon, tmp_path) -> None:
    daemons = {n: start_daemon("--node-id", n, name=n, host_capacity="64MiB") for n in "AB"}
    trace = tmp_path / "routed.jsonl"
    sock = str(tmp_path / "router.sock")
    args = [sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"unix:{sock}",
            "--reconnect-max-s", "0.3", "--record-trace", str(trace), "--record-trace-hold-s", "5"]
    for d in daemons.values():
        args += ["--daemon", d.socket]
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    sidecars = {n: Sidecar(d.socket) for n, d in daemons.items()}
    try:
        lids = {n: sc.register_layout(LAYOUT) for n, sc in sidecars.items()}
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, what="route-server socket")
        channel = grpc.insecure_channel(f"unix:{sock}")
        stub = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: len(feeds := stub.Status(router_pb2.RouterStatusRequest(), timeout=5).feeds) == 2
                 and all(f.connected and f.epoch for f in feeds), what="route-server feeds")
        work = _workload(sessions=7, turns=4)  # odd: round-robin moves sessions
        _serve(stub, sidecars, lids, work)
        status = wait_for(lambda: (st := stub.Status(router_pb2.RouterStatusRequest(), timeout=5)).recorded_requests
                          == len(work) and st, what="every request recorded (each has had its Finish)")
        channel.close()
    finally:
        for sc in sidecars.values():
            sc.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "router.log").read_text()

    # the live figure, through `kvtier measure --daemons` (and its --trace prediction)
    m = _measure_json(["--daemons", ",".join(d.socket for d in daemons.values()), "--trace", str(trace),
                       "--gpu-tokens", "1M", "--host-tokens", "10M", "--disk-tokens", "0", "--once", "--json"],
                      tmp_path / "measure.json")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == len(work) and status.record_dropped == 0
    for rec, (session, tokens) in zip(records, work, strict=True):
        assert rec["session_id"] == session and rec["input_length"] == len(tokens) and rec["output_length"] == 8
        assert len(rec["hash_ids"]) == len(tokens) // BT
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    all_ids = {h for r in records for h in r["hash_ids"]}
    assert all_ids == set(range(len(all_ids)))   # small integers, first seen first: no key leaves

    live_rate = m["daemon_total"]["hit_rate"]
    asked = m["daemon_total"]["asked_blocks"]
    assert asked == sum(len(r["hash_ids"]) for r in records)
    reqs = replay.load_trace(str(trace))
    cfg = replay.ReplayConfig(block_tokens=BT, gpu_tokens=10**6, host_tokens=10**7, disk_tokens=0)
    replayed = replay.replay(reqs, cfg, "kvtier", 2).hit_rate
    ideal = ideal_hit_rate(r.keys for r in reqs)[0]
    rr = replay.replay(reqs, cfg, "round-robin", 2).hit_rate
    print(f"live {live_rate:.4f} replay kvtier {replayed:.4f} round-robin {rr:.4f} ideal {ideal:.4f}")
    assert abs(replayed - live_rate) <= TOLERANCE, (replayed, live_rate)
    assert rr < live_rate - 0.1   # the comparison tells policies apart
    pred = m["trace"]
    assert pred["block_tokens"] == BT and pred["ideal_prefix_hit_rate"] == ideal
    by = {(r["policy"], r["replicas"]): r["hit_rate"] for r in pred["predicted"]}
    assert set(by) == {(p, n) for p in replay.POLICIES for n in (2, 4, 8)}
    assert by[("kvtier", 2)] == replayed and by[("round-robin", 2)] == rr


def test_the_recorder_rotates_by_size_and_counts_drops(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"old": 1}\n')   # a file from an earlier run is rotated first
    rec = Recorder(RecordConfig(record_trace=str(path), record_trace_max_bytes=4096, record_trace_keep=2,
                                record_trace_hold_s=0))
    keys = [bytes([i]) * 16 for i in range(20)]
    for i in range(200):
        rec.record(keys[: 1 + i % 20], 16 * (1 + i % 20), f"s{i % 3}")
    rec.close()
    assert rec.counts()["recorded"] + rec.counts()["dropped"] == 200
    files = sorted(os.listdir(tmp_path))
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"], files
    for f in files:
        text = (tmp_path / f).read_text()
        assert len(text) <= 4096 and '"old"' not in text
        lines = [json.loads(x) for x in text.splitlines()]
        assert lines[0]["timestamp"] == 0 and lines[0]["hash_ids"][0] == 0   # each file its own trace

    small = Recorder(RecordConfig(record_trace=str(tmp_path / "q.jsonl"), record_trace_queue=1,
                                  record_trace_hold_s=60))
    sent = [small.record(keys, 320, None, decision_id=i + 1) for i in range(2000)]
    small.close()
    c = small.counts()
    assert c["dropped"] == sent.count(False) > 0 and c["recorded"] == sent.count(True)
    with pytest.raises(ValueError, match="record-trace-max-bytes"):
        Recorder(RecordConfig(record_trace=str(tmp_path / "x"), record_trace_max_bytes=10))
    assert time.monotonic() > 0


# -- chat logs -> a trace ------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% if tools %}<|tools|> {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<unk>", "<|tools|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _tokenizer(path: str) -> dict[str, int]:
    """A WordLevel tokenizer with a chat template, saved as a Hugging Face tokenizer directory."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + [f"w{i}" for i in range(400)] + ["get_weather", "search"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return vocab


def _chat_log(sessions: int, turns: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(400)}" for _ in range(n))
    # system prompts of whole blocks (with their role token), and every first turn opens with the
    # same task text: equal blocks after different prefixes, which only chained ids tell apart
    systems, task = [words(2 * BT - 1), words(3 * BT - 1)], words(2 * BT)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
             {"type": "function", "function": {"name": "search", "parameters": {}}}]
    hist = {s: [{"role": "system", "content": systems[s % 2]}] for s in range(sessions)}
    out, t = [], 1_700_000_000_000
    for turn in range(turns):
        for s in range(sessions):
            if turn:
                hist[s].append({"role": "assistant", "content": words(rng.randrange(3, 12))})
            hist[s].append({"role": "user", "content": (task + " " if not turn else "") + words(rng.randrange(5, 30))})
            t += rng.randrange(10, 2000)
            rec: dict = {"messages": [dict(m) for m in hist[s]], "session_id": f"c{s}",
                         "timestamp": t if s % 2 else time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t // 1000))
                         + f".{t % 1000:03d}Z", "usage": {"completion_tokens": 7}}
            if s % 3 == 2:
                rec["tools"] = tools
            out.append({"request": rec} if s == 1 else rec)
    return out


def _tokens_by_hand(rec: dict, vocab: dict[str, int]) -> list[int]:
    """What the template renders, tokenized word by word: independent of the tool's tokenizer."""
    body = rec.get("request", rec)
    words = []
    if body.get("tools"):
        words += ["<|tools|>", *(t["function"]["name"] for t in body["tools"])]
    for m in body["messages"]:
        words += [f"<|{m['role']}|>", *m["content"].split()]
    words.append("<|assistant|>")
    return [vocab[w] for w in words]


def test_chat_log_to_trace_keeps_the_ideal_prefix_hit_rate(tmp_path, capsys) -> None:
    from kvtier.client.tools import trace as trace_tool

    tok_dir = str(tmp_path / "tok")
    vocab = _tokenizer(tok_dir)
    log = _chat_log(sessions=5, turns=4)
    log_path, out = tmp_path / "chat.jsonl", tmp_path / "trace.jsonl"
    log_path.write_text("".join(json.dumps(r) + "\n" for r in log))
    assert trace_tool.main(["from-chat", str(log_path), "--tokenizer", tok_dir, "--block-tokens", str(BT),
                            "-o", str(out)]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == len(log)

    # directly from the token ids: a block is a hit when an earlier request had the same tokens
    # up to its end
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for rec, trace_rec in zip(log, records, strict=True):   # the log is in time order already
        toks = _tokens_by_hand(rec, vocab)
        assert trace_rec["input_length"] == len(toks) and trace_rec["output_length"] == 7
        assert trace_rec["session_id"] == rec.get("request", rec)["session_id"]
        prefixes = [tuple(toks[:(i + 1) * BT]) for i in range(len(toks) // BT)]
        assert len(trace_rec["hash_ids"]) == len(prefixes)
        total += len(prefixes)
        hits += sum(p in seen for p in prefixes)
        seen.update(prefixes)
    direct = hits / total
    capsys.readouterr()
    assert trace_tool.main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    print(f"ideal prefix hit rate: trace {stats['ideal_prefix_hit_rate']:.4f}, tokens {direct:.4f}")
    assert stats["ideal_prefix_hit_rate"] == pytest.approx(direct, abs=1e-12) and 0.3 < direct < 0.95
    assert stats["blocks"] == total and stats["distinct_blocks"] == len(seen) and stats["sessions"] == 5
    # the renderer without transformers (tokenizers and jinja2) makes the same trace
    light = trace_tool.chat_to_trace(log_path.read_text().splitlines(),
                                     trace_tool.ChatTokenizer(tok_dir, use_transformers=False), BT)
    assert light == records
    ts = [r["timestamp"] for r in records]
    assert ts[0] == 0 and ts == sorted(ts)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [], "timestamp": 1}\n')
    assert trace_tool.main(["from-chat", str(bad), "--tokenizer", tok_dir, "--block-tokens", "16"]) == 2
    assert "bad.jsonl:1: no messages" in capsys.readouterr().err


def test_measure_reads_sglang_names() -> None:
    """SGLang's names as its docs show them (no SGLang here to scrape): cached tokens by source,
    device as the engine's own cache, host and storage as external; the gauge alone gives a rate."""
    text = ('# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total{model_name="m"} 1000\n'
            '# TYPE sglang:cached_tokens_total counter\n'
            'sglang:cached_tokens_total{model_name="m",cache_source="device"} 300\n'
            'sglang:cached_tokens_total{model_name="m",cache_source="host"} 150\n'
            'sglang:cached_tokens_total{model_name="m",cache_source="storage_kvtier"} 50\n')
    e = measure.from_engine_metrics("http://s:30000", text)
    assert (e.kind, e.prompt_tokens, e.cache_hits, e.external_hits, e.external_queries) == \
        ("sglang", 1000, 300, 200, 700)
    assert e.prefix_share() == 0.5 and e.engine_hit_rate() == 0.3
    g = measure.from_engine_metrics("http://s:30000", "# TYPE sglang:cache_hit_rate gauge\n"
                                                      'sglang:cache_hit_rate{model_name="m"} 0.25\n')
    assert g.engine_hit_rate() == 0.25 and g.prefix_share() is None
    assert measure.from_engine_metrics("http://x", "# TYPE up gauge\nup 1\n").error


def test_measure_live_mode_refreshes(daemon) -> None:
    """Without --once it prints a fresh table every --interval until interrupted."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.client.tools.cli", "measure", "--daemons", daemon.socket,
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: sum(x.startswith("kvtier measure  ") for x in list(lines)) >= 2, timeout=60,
                 what="two refreshes")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        reader.join(5)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "kvtier daemons (lookups: hit rate by tier)" in out, out

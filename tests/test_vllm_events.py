"""vLLM engines' KV events as a location source of the router (kvtier.client.routing.vllm_events).

Every frame is made by vLLM's own code: ``vllm.distributed.kv_events`` (``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) encoded with msgspec as vLLM does, and,
where a socket matters, a real ``ZmqEventPublisher`` (PUB and replay ROUTER on ipc sockets).
Positional arrays (older vLLM; llm-d-kv-cache before v0.9.0 decodes only these) are vLLM's structs re-declared
``array_like`` (same fields, same order), and one hand-written pre-``medium`` layout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

kv = pytest.importorskip("vllm.distributed.kv_events",
                         reason="vllm is not importable (pip install -e '.[vllm]'): these tests encode with "
                                "vLLM's own kv_events classes")
import grpc  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402
from _wait import wait_for  # noqa: E402

from kvtier.client.engine.keys import Namespace, block_keys  # noqa: E402
from kvtier.client.routing import vllm_events as ve  # noqa: E402
from kvtier.client.routing.route_server import request_keys  # noqa: E402
from kvtier.client.routing.router import Router, RouterConfig  # noqa: E402
from kvtier.proto import router_pb2, router_pb2_grpc  # noqa: E402

BS = 4  # the engine's block size (tokens)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NS = Namespace(MODEL)


class PositionalStored(kv.BlockStored, array_like=True, tag="BlockStored"):
    """vLLM's BlockStored as older vLLM encodes it: an array, the tag first."""


class PositionalRemoved(kv.BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class PositionalCleared(kv.AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


def tokens(prompt: int, blocks: int) -> list[int]:
    return [(prompt * 7919 + i * 31) % 50_000 for i in range(blocks * BS)]


def h(prompt: int, i: int) -> bytes:
    """An engine block hash (vLLM's are sha256 bytes; their value does not matter here)."""
    return prompt.to_bytes(4, "big") + i.to_bytes(4, "big") + bytes(24)


def stored(prompt: int, first: int, n: int, *, medium: str | None = "GPU", parent: object = "chain",
           cls: type = kv.BlockStored, **kw) -> kv.BlockStored:
    """BlockStored of blocks ``first .. first+n-1`` of a prompt (the parent: block first-1)."""
    toks = tokens(prompt, first + n)[first * BS:]
    par = (h(prompt, first - 1) if first else None) if parent == "chain" else parent
    fields = {"token_ids": toks, "block_size": BS, "lora_id": None, "lora_name": None, "group_idx": 0, **kw}
    return cls(block_hashes=[h(prompt, i) for i in range(first, first + n)], parent_block_hash=par,
               medium=medium, **fields)


def removed(prompt: int, blocks: list[int], medium: str | None = "GPU", cls: type = kv.BlockRemoved,
            **kw) -> kv.BlockRemoved:
    return cls(block_hashes=[h(prompt, i) for i in blocks], medium=medium, **kw)


def payload(*events: object, dp: int | None = None) -> bytes:
    return msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=time.time(), events=list(events),
                                                            data_parallel_rank=dp))


def frames(topic: str, seq: int, body: bytes) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), body]


def keys_of(prompt: int, blocks: int, ns: Namespace = NS) -> list[bytes]:
    return block_keys(tokens(prompt, blocks), BS, ns)


def overlap(r: Router, worker: str, prompt: int, blocks: int, ns: Namespace = NS) -> tuple[int, int, int]:
    d = r.route(keys_of(prompt, blocks, ns), dispatch=False, top_k=64)
    for x in d.ranked:
        if x.worker == worker:
            return x.overlap.gpu, x.overlap.host, x.overlap.disk
    raise AssertionError(f"{worker} is not a routing candidate: {d.workers}")


def offline_router(*entries: str) -> Router:
    """A router that is not started: tests hand it frames (``r.vllm.feed``)."""
    return Router(RouterConfig(vllm_events=entries or ("ipc:///nonexistent/pub",)))


@pytest.fixture
def d() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvt-ve-", dir="/tmp")  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Engine:
    """vLLM's own ZmqEventPublisher on ipc sockets, plus a SUB that hears it, so a test has the
    exact frames of every batch (and the publisher's replay socket answers for real)."""

    def __init__(self, d: str, name: str, topic: str, *, buffer_steps: int = 10_000, replay: bool = True) -> None:
        self.pub_ep = f"ipc://{d}/{name}.pub"
        self.replay_ep = f"ipc://{d}/{name}.rep" if replay else None
        self.topic = topic
        self.pub = kv.ZmqEventPublisher(0, endpoint=self.pub_ep, replay_endpoint=self.replay_ep,
                                        buffer_steps=buffer_steps, topic=topic)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(self.pub_ep)
        self.published = 0
        deadline = time.monotonic() + 10  # PUB/SUB joins late: publish empty batches until one is heard
        while not self.sub.poll(50):
            assert time.monotonic() < deadline, "the test subscriber never heard the publisher"
            self._send()
        self._until(self.published - 1)

    def _send(self, *events: object) -> None:
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=list(events)))
        self.published += 1

    def _until(self, seq: int) -> list[bytes]:
        while True:
            assert self.sub.poll(5000), f"batch {seq} never arrived"
            got = self.sub.recv_multipart()
            if int.from_bytes(got[1], "big") == seq:
                return got

    def publish(self, *events: object) -> list[bytes]:
        """Publish one batch; its frames as a subscriber receives them."""
        self._send(*events)
        return self._until(self.published - 1)

    def source(self, **opts: object) -> str:
        extra = "".join(f",{k}={v}" for k, v in opts.items())
        return f"{self.pub_ep}{f',replay={self.replay_ep}' if self.replay_ep else ''}{extra}"

    def close(self) -> None:
        self.pub.shutdown()
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def engines(d: str) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(name: str, topic: str | None = None, **kw) -> Engine:
        e = Engine(d, name, topic if topic is not None else f"kv@{name}@{MODEL}", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


# -- the wire -------------------------------------------------------------------------------------

def test_the_decoder_knows_vllms_field_order_and_encodings() -> None:
    """The positional decoder's field lists are vLLM's own declaration order; vLLM 0.32 sends
    events as tagged maps inside an array batch."""
    theirs = tuple(f.name for f in msgspec.structs.fields(kv.BlockStored))
    assert theirs == ve.STORED_FIELDS[:len(theirs)]  # this vLLM's fields: ours, or a prefix of them
    assert tuple(f.name for f in msgspec.structs.fields(kv.BlockRemoved)) == ve.REMOVED_FIELDS
    raw = msgspec.msgpack.decode(payload(stored(1, 0, 1), removed(1, [0]), kv.AllBlocksCleared(), dp=3))
    assert isinstance(raw, list) and raw[2] == 3
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    batch = ve.decode_batch(payload(stored(1, 0, 2, medium="CPU", group_idx=1), removed(1, [0], medium=None),
                                    kv.AllBlocksCleared(), dp=3))
    s, r, c = batch.events
    assert batch.dp_rank == 3 and isinstance(c, ve.AllBlocksCleared)
    assert s.hashes == [h(1, 0), h(1, 1)] and s.parent is None and s.token_ids == tokens(1, 2)
    assert (s.block_size, s.medium, s.group, s.lora) == (BS, "CPU", 1, False)
    assert r.hashes == [h(1, 0)] and r.medium is None
    with pytest.raises(ve.EventError):
        ve.decode_batch(b"\x93\x01")  # truncated msgpack
    with pytest.raises(ve.EventError):
        ve.decode_batch(msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": "x"}], None]))


@pytest.mark.parametrize("encoding", ["tagged", "positional", "positional-before-medium"])
def test_tagged_maps_and_positional_arrays_index_the_same_blocks(encoding: str) -> None:
    if encoding == "tagged":
        body = payload(stored(1, 0, 3), stored(1, 3, 2), removed(1, [4]))
    elif encoding == "positional":
        body = payload(stored(1, 0, 3, cls=PositionalStored), stored(1, 3, 2, cls=PositionalStored),
                       removed(1, [4], cls=PositionalRemoved))
        assert isinstance(msgspec.msgpack.decode(body)[1][0], list)  # really arrays
    else:  # vLLM before `medium` (and lora_name...): [tag, hashes, parent, tokens, block_size, lora_id]
        ev = [["BlockStored", [h(1, i) for i in range(3)], None, tokens(1, 3), BS, None],
              ["BlockStored", [h(1, 3), h(1, 4)], h(1, 2), tokens(1, 5)[3 * BS:], BS, None],
              ["BlockRemoved", [h(1, 4)]]]
        body = msgspec.msgpack.encode([time.time(), ev, None])
    r = offline_router()
    r.vllm.feed(frames(f"kv@pod-a@{MODEL}", 0, body))
    assert overlap(r, "pod-a", 1, 5) == (4, 4, 4)
    assert r.vllm_status()[0].blocks == 4


# -- events, mediums, tiers -------------------------------------------------------------------------

def test_all_event_kinds_and_mediums_map_to_tiers() -> None:
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    seq = iter(range(100))

    def send(*events: object) -> None:
        r.vllm.feed(frames(topic, next(seq), payload(*events)))

    send(stored(1, 0, 4, medium=None), stored(1, 0, 6, medium="CPU"), stored(1, 0, 8, medium="STORAGE"))
    assert overlap(r, "pod-a", 1, 8) == (4, 6, 8)
    assert r.workers() == [("pod-a", "vllm:pod-a")]
    tiers = {(n, t, w) for n, t, w, _ in r.holdings()}
    assert tiers == {("vllm:pod-a", "gpu", "pod-a"), ("vllm:pod-a", "host", ""), ("vllm:pod-a", "disk", "")}
    send(removed(1, [3], medium="GPU"))          # the GPU copy of block 3 is evicted
    assert overlap(r, "pod-a", 1, 8) == (3, 6, 8)
    send(removed(1, [5], medium="CPU"), removed(1, [7], medium="STORAGE"))
    assert overlap(r, "pod-a", 1, 8) == (3, 5, 7)
    send(stored(1, 3, 1, medium="GPU"))          # back on the GPU: its key is still known
    assert overlap(r, "pod-a", 1, 8) == (4, 5, 7)
    send(kv.AllBlocksCleared())                  # vLLM's prefix-cache reset: the GPU only
    assert overlap(r, "pod-a", 1, 8) == (0, 5, 7)
    send(removed(1, list(range(8)), medium="CPU"), removed(1, list(range(8)), medium="STORAGE"))
    assert overlap(r, "pod-a", 1, 8) == (0, 0, 0)
    assert r.vllm_status()[0].blocks == 0       # every entry of the map is gone with its last holder


def test_mediums_match_in_any_case_and_unknown_ones_are_counted() -> None:
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    r.vllm.feed(frames(topic, 0, payload(stored(1, 0, 4, medium="gpu"), stored(1, 0, 6, medium="cpu"),
                                         stored(1, 0, 8, medium="Storage"), stored(2, 0, 2, medium="CPU_PINNED"))))
    assert overlap(r, "pod-a", 1, 8) == (4, 6, 8) and overlap(r, "pod-a", 2, 2) == (0, 0, 0)
    r.vllm.feed(frames(topic, 1, payload(removed(1, [7], medium="storage"), removed(1, [0], medium="OBJ"))))
    assert overlap(r, "pod-a", 1, 8) == (4, 6, 7)
    assert r.vllm_status()[0].unknown_mediums == 2


def test_several_full_attention_groups_must_all_hold_a_block_and_others_are_ignored() -> None:
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    r.vllm.feed(frames(topic, 0, payload(
        stored(1, 0, 4, group_idx=0, kv_cache_spec_kind="full_attention"),
        stored(1, 0, 2, group_idx=1, kv_cache_spec_kind="full_attention"),
        stored(1, 0, 4, group_idx=2, kv_cache_spec_kind="sliding_window"))))
    assert overlap(r, "pod-a", 1, 4) == (2, 2, 2)   # group 1 holds only two
    r.vllm.feed(frames(topic, 1, payload(stored(1, 2, 2, group_idx=1, kv_cache_spec_kind="full_attention"))))
    assert overlap(r, "pod-a", 1, 4) == (4, 4, 4)
    r.vllm.feed(frames(topic, 2, payload(removed(1, [1], group_idx=0))))
    assert overlap(r, "pod-a", 1, 4) == (1, 1, 1)


# -- topics, workers, sources ---------------------------------------------------------------------

def test_topics_sources_and_worker_names() -> None:
    assert ve.parse_topic("kv@pod-7@meta-llama/Llama-3.1-8B") == ("pod-7", "meta-llama/Llama-3.1-8B")
    assert ve.parse_topic("kv@pod-7@") == ("pod-7", "")
    for other in ("", "kv", "kv@pod", "events@pod@m", "kv@@m"):
        assert ve.parse_topic(other) == ("", ""), other
    assert ve.parse_vllm_events("tcp://a:5557,replay=tcp://a:5558,model=m,tcp://*:6000,topic=kv@") == \
        ("tcp://a:5557,replay=tcp://a:5558,model=m", "tcp://*:6000,topic=kv@")
    assert ve.parse_vllm_events(["ipc:///x,salt=t1", "tcp://b:1,replay_timeout=0.5"]) == \
        ("ipc:///x,salt=t1", "tcp://b:1,replay_timeout=0.5")
    src = ve.VllmSource.parse("tcp://*:6000,worker=w,block_tokens=16,max_blocks=10")
    assert src.bind and (src.worker, src.block_tokens, src.max_blocks) == ("w", 16, 10)
    assert (src.idle_timeout, src.max_streams, src.max_refused) == (0.0, 1024, 1024)
    for bad in ("replay=tcp://a:1", "http://a:1", "tcp://a:1,nope=1", "tcp://a:1,max_blocks=x",
                "tcp://a:1,replay=a:1"):
        with pytest.raises(ValueError):
            ve.parse_vllm_events(bad)

    r = offline_router("ipc:///x/a", "ipc:///x/b,worker=gpu-node-3,model=other", "ipc:///x/c,model=" + MODEL,
                       "ipc:///x/d")
    body = payload(stored(1, 0, 2))
    r.vllm.feed(frames(f"kv@pod-a@{MODEL}", 0, body), 0)
    r.vllm.feed(frames(f"kv@pod-a@{MODEL}", 0, payload(stored(1, 0, 2), dp=2)), 3)  # a DP rank's own port
    r.vllm.feed(frames("kv@pod-b@other", 0, body), 1)        # worker= names it
    r.vllm.feed(frames("", 0, body), 2)                      # no topic: the endpoint names it, model=
    r.vllm.feed(frames("anything", 0, body), 3)              # no model anywhere: refused, said why
    st = {s.worker: s for s in r.vllm_status()}
    assert set(st) == {"pod-a", "pod-a/dp2", "gpu-node-3", "/x/c", "/x/d"}
    assert st["/x/d"].last_error.startswith("no model") and not st["/x/d"].connected
    assert st["gpu-node-3"].model == "other" and st["/x/c"].model == MODEL
    assert {w for w, _ in r.workers()} == {"pod-a", "pod-a/dp2", "gpu-node-3", "/x/c"}
    assert overlap(r, "pod-a", 1, 2) == overlap(r, "pod-a/dp2", 1, 2) == overlap(r, "/x/c", 1, 2) == (2, 2, 2)
    assert overlap(r, "gpu-node-3", 1, 2) == (0, 0, 0)     # its keys are in model "other"'s key space
    assert overlap(r, "gpu-node-3", 1, 2, Namespace("other")) == (2, 2, 2)


# -- chained keys ----------------------------------------------------------------------------------

def test_chained_keys_from_the_events_route_to_the_engine_that_holds_them() -> None:
    r = offline_router("ipc:///x/a", "ipc:///x/b")
    a, b = f"kv@pod-a@{MODEL}", f"kv@pod-b@{MODEL}"
    # pod-a caches prompt 1 in three steps (each new step's parent: the last block of the one before)
    for seq, (first, n) in enumerate([(0, 2), (2, 3), (5, 1)]):
        r.vllm.feed(frames(a, seq, payload(stored(1, first, n))), 0)
    r.vllm.feed(frames(b, 0, payload(stored(2, 0, 6), stored(1, 0, 1))), 1)
    assert r.vllm.status()[0].blocks == 6
    want = keys_of(1, 6)
    assert r.holdings("vllm:pod-a") == {("vllm:pod-a", "gpu", "pod-a", b"vllm-g0"): set(want)}
    d = r.route(want, dispatch=False)
    assert d.workers[0] == "pod-a" and d.ranked[0].overlap.gpu == 6 and d.nodes[0] == "vllm:pod-a"
    assert d.ranked[1].overlap.gpu == 1
    assert r.route(keys_of(2, 6), dispatch=False).workers[0] == "pod-b"
    # as route-server computes them from a RouteRequest's token ids
    req = router_pb2.RouteRequest(token_ids=tokens(1, 6), block_tokens=BS,
                                  namespace=router_pb2.NamespaceSpec(model=MODEL))
    assert request_keys(req) == want


def test_blocks_whose_key_cannot_be_known_are_skipped_with_their_descendants() -> None:
    r = offline_router("ipc:///x/a,salt=tenant-1,max_blocks=12")
    topic = f"kv@pod-a@{MODEL}"
    t1 = Namespace(MODEL, "tenant-1")
    seq = iter(range(100))

    def send(*events: object) -> None:
        r.vllm.feed(frames(topic, next(seq), payload(*events)))

    send(stored(1, 0, 2))
    send(stored(1, 3, 2))                                     # parent (block 2) never heard: an orphan
    send(stored(2, 0, 3, lora_id=1, lora_name="sql"))         # a LoRA adapter's blocks
    send(stored(3, 0, 3, extra_keys=[None, ("mm-hash", 0), None]))  # an image from block 1 on
    send(stored(4, 0, 3, medium="CPU", token_ids=[], block_size=0))  # an offload with no tokens
    st = r.vllm_status()[0]
    assert st.skipped_blocks == 2 + 3 + 2 + 3 and st.blocks == 2 + 1
    assert overlap(r, "pod-a", 1, 5, t1) == (2, 2, 2)
    assert overlap(r, "pod-a", 3, 3, t1) == (1, 1, 1)
    assert overlap(r, "pod-a", 1, 2) == (0, 0, 0)             # the tenant salt is part of the key
    send(stored(3, 0, 1, medium="CPU", token_ids=[], block_size=0))  # a known hash needs no tokens
    assert overlap(r, "pod-a", 3, 3, t1) == (1, 1, 1) and r.holdings()[("vllm:pod-a", "host", "", b"vllm-g0")]
    # the map is bounded: past max_blocks new blocks are skipped; removals make room again
    send(stored(5, 0, 12))
    assert r.vllm_status()[0].blocks == 12 and overlap(r, "pod-a", 5, 12, t1)[0] == 9
    send(removed(5, list(range(9))), removed(1, [0, 1]), removed(3, [0]), removed(3, [0], medium="CPU"))
    assert r.vllm_status()[0].blocks == 0


# -- sequence numbers ------------------------------------------------------------------------------

def test_a_gap_is_filled_from_vllms_replay_socket(engines) -> None:
    e = engines("pod-a")
    r = offline_router(e.source())
    got = [e.publish(stored(1, 0, 2))]
    first = int.from_bytes(got[0][1], "big")
    assert first > 0                                   # the engine's warm-up batches came first
    r.vllm.feed(got[0])
    got += [e.publish(stored(1, 2, 2)), e.publish(removed(1, [3]), stored(1, 3, 1)), e.publish(stored(1, 4, 2)),
            e.publish(removed(1, [5]))]
    for i in (1, 3, 4):                                # batch 2 is lost on the way
        r.vllm.feed(got[i])
    st = r.vllm_status()[0]
    assert st.gaps_recovered == 1 and st.gaps_lost == 0 and st.seq == first + 4
    assert overlap(r, "pod-a", 1, 6) == (5, 5, 5)       # block 3 came from the replayed batch


def test_a_gap_the_replay_cannot_fill_clears_the_worker(engines) -> None:
    e = engines("pod-a", buffer_steps=2)
    r = offline_router(e.source(), "ipc:///x/norep", e.source(replay_timeout=0.2).replace(e.replay_ep, "ipc:///x/none"))
    got = [e.publish(stored(1, 0, 4))]
    r.vllm.feed(got[0])                                # prompt 1 stored...
    got += [e.publish(removed(1, [0, 1, 2, 3])), e.publish(stored(2, 0, 1)), e.publish(stored(2, 1, 1)),
            e.publish(stored(3, 0, 2))]
    r.vllm.feed(got[4])                                # ...its removal lost; the buffer keeps 2 batches
    st = r.vllm_status()[0]
    assert st.gaps_lost == 1 and st.gaps_recovered == 0
    assert overlap(r, "pod-a", 1, 4) == (0, 0, 0)       # nothing stale stays
    assert overlap(r, "pod-a", 2, 2) == (0, 0, 0)       # (its first block's batch is gone from the buffer)
    assert overlap(r, "pod-a", 3, 2) == (2, 2, 2)       # what the replay still had, in one run to the newest
    # without a replay socket, and with one that never answers
    for i, name in ((1, "norep"), (2, "none")):
        topic = f"kv@{name}@{MODEL}"
        r.vllm.feed(frames(topic, 0, payload(stored(1, 0, 4))), i)
        t0 = time.monotonic()
        r.vllm.feed(frames(topic, 2, payload(stored(3, 0, 2))), i)
        assert time.monotonic() - t0 < 5
        st = next(s for s in r.vllm_status() if s.worker == name)
        assert st.gaps_lost == 1 and st.seq == 2
        assert overlap(r, name, 1, 4) == (0, 0, 0) and overlap(r, name, 3, 2) == (2, 2, 2)


def test_a_router_that_joins_late_replays_the_history(engines) -> None:
    e = engines("pod-a")
    got = [e.publish(stored(1, 0, 3)), e.publish(stored(1, 3, 3)), e.publish(removed(1, [5]))]
    r = offline_router(e.source())
    r.vllm.feed(got[2])                                # the first batch heard: the rest is asked for
    assert overlap(r, "pod-a", 1, 6) == (5, 5, 5) and r.vllm_status()[0].gaps_lost == 0


class OldReplay:
    """A replay socket that answers as vLLM before the topic frame was added (and SGLang) do:
    ``[id, "", seq, payload]`` per batch, then ``[id, "", -1, ""]``; a real ROUTER on a thread."""

    def __init__(self, d: str, batches: dict[int, bytes], end: bool = True, trickle_s: float = 0) -> None:
        import threading
        self.ep, self.batches, self.end, self.trickle_s = f"ipc://{d}/old.rep", batches, end, trickle_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.ep)
        self.requests: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            cid, _, start = self.sock.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            for seq, body in sorted(self.batches.items()):
                if seq >= first:
                    self.sock.send_multipart([cid, b"", seq.to_bytes(8, "big"), body])
            until = time.monotonic() + self.trickle_s   # a peer that never ends: old batches again
            while time.monotonic() < until and not self.stop.is_set():
                self.sock.send_multipart([cid, b"", (0).to_bytes(8, "big"), self.batches[0]])
                time.sleep(0.05)
            if self.end:
                self.sock.send_multipart([cid, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_a_replay_socket_that_answers_without_the_topic_frame_is_understood(d) -> None:
    topic = f"kv@pod-a@{MODEL}"
    sent = {0: payload(stored(1, 0, 2)), 1: payload(stored(1, 2, 2)), 2: payload(removed(1, [3])),
            3: payload(stored(2, 0, 2))}
    rep = OldReplay(d, sent)
    try:
        r = offline_router(f"ipc://{d}/none.pub,replay={rep.ep},replay_timeout=3")
        t0 = time.monotonic()
        r.vllm.feed(frames(topic, 3, sent[3]))         # the first batch heard: 0..2 are asked for
        sent[4] = payload(stored(2, 2, 1))
        r.vllm.feed(frames(topic, 5, payload(stored(3, 0, 1))))  # seq 4 lost: the replay has it
        assert time.monotonic() - t0 < 3               # END was understood: no wait for the timeout
        assert rep.requests == [0, 4]
        assert r.vllm._replay_socks[0].getsockopt(zmq.MAXMSGSIZE) == ve.MAX_MESSAGE_BYTES
        st = r.vllm_status()[0]
        assert st.gaps_lost == 0 and st.gaps_recovered == 1 and st.seq == 5
        assert overlap(r, "pod-a", 1, 4) == (3, 3, 3) and overlap(r, "pod-a", 2, 3) == (3, 3, 3)
    finally:
        rep.close()


def test_what_a_replay_answer_without_its_end_marker_brought_is_kept(d) -> None:
    """A replay answer cut short (a publisher ROUTER at ZMQ's default high-water mark drops the
    end of a long answer, END marker included) still fills what it can."""
    topic = f"kv@pod-a@{MODEL}"
    sent = {0: payload(stored(1, 0, 2)), 1: payload(stored(1, 2, 2)), 2: payload(removed(1, [3]))}
    rep = OldReplay(d, sent, end=False)
    try:
        r = offline_router(f"ipc://{d}/none.pub,replay={rep.ep},replay_timeout=0.5")
        r.vllm.feed(frames(topic, 3, payload(stored(2, 0, 2))))   # the first heard: 0..2 arrive, END never
        st = r.vllm_status()[0]
        assert st.seq == 3 and st.gaps_lost == 0
        assert overlap(r, "pod-a", 1, 4) == (3, 3, 3) and overlap(r, "pod-a", 2, 2) == (2, 2, 2)
    finally:
        rep.close()


def test_a_replay_answer_that_never_ends_is_cut_short(d, monkeypatch) -> None:
    monkeypatch.setattr(ve, "REPLAY_MAX_S", 1.0, raising=False)
    topic = f"kv@pod-a@{MODEL}"
    sent = {0: payload(stored(1, 0, 2)), 1: payload(stored(1, 2, 2))}
    rep = OldReplay(d, sent, end=False, trickle_s=8)
    try:
        r = offline_router(f"ipc://{d}/none.pub,replay={rep.ep},replay_timeout=1")
        t0 = time.monotonic()
        r.vllm.feed(frames(topic, 2, payload(stored(2, 0, 2))))
        assert time.monotonic() - t0 < 4
        assert r.vllm_status()[0].seq == 2 and overlap(r, "pod-a", 1, 4) == (4, 4, 4)
    finally:
        rep.close()


def test_hostile_payloads_are_undecodable_batches() -> None:
    with pytest.raises(ve.EventError):
        ve.decode_batch(b"\x91" * 200_000 + b"\xc0")   # nested deeper than Python's stack
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    r.vllm.feed(frames(topic, 0, payload(stored(1, 0, 2))))
    r.vllm.feed(frames(topic, 1, b"\x91" * 200_000 + b"\xc0"))
    st = r.vllm_status()[0]
    assert st.seq == 1 and st.gaps_lost == 1 and "nested" in st.last_error
    assert overlap(r, "pod-a", 1, 2) == (0, 0, 0)


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_a_batch_with_impossible_token_ids_clears_the_worker_once_and_the_stream_goes_on(engines, bad) -> None:
    """Token ids outside uint32 make the batch undecodable: the worker is cleared once and later
    batches apply in sequence (none raises, none asks the replay socket again)."""
    e = engines("pod-a")
    r = offline_router(e.source())
    r.vllm.feed(e.publish(stored(1, 0, 2)))
    r.vllm.feed(e.publish(stored(2, 0, 1, token_ids=[bad] * BS)))
    for got in (e.publish(stored(3, 0, 1)), e.publish(stored(3, 1, 1)), e.publish(removed(3, [1]))):
        r.vllm.feed(got)
    st = r.vllm_status()[0]
    assert st.seq == e.published - 1 and st.gaps_lost == 1 and st.gaps_recovered == 0
    assert "token_ids" in st.last_error
    assert overlap(r, "pod-a", 1, 2) == (0, 0, 0) and overlap(r, "pod-a", 3, 2) == (1, 1, 1)


def test_a_batch_that_fails_to_fold_resets_the_worker_and_the_stream_moves_past_it(monkeypatch) -> None:
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    r.vllm.feed(frames(topic, 0, payload(stored(1, 0, 2))))

    def broken(*a, **kw):
        raise RuntimeError("injected")
    with monkeypatch.context() as m:
        m.setattr(ve, "block_keys", broken)         # a fault while folding batch 1
        r.vllm.feed(frames(topic, 1, payload(stored(2, 0, 2))))
    r.vllm.feed(frames(topic, 2, payload(stored(3, 0, 2))))
    st = r.vllm_status()[0]
    assert st.seq == 2 and st.gaps_lost == 1 and "batch 1: RuntimeError" in st.last_error
    assert overlap(r, "pod-a", 1, 2) == (0, 0, 0) and overlap(r, "pod-a", 3, 2) == (2, 2, 2)


def test_a_publisher_restart_clears_its_worker() -> None:
    r = offline_router()
    topic = f"kv@pod-a@{MODEL}"
    for seq in range(3):
        r.vllm.feed(frames(topic, seq, payload(stored(seq + 1, 0, 2))))
    r.vllm.feed(frames(topic, 0, payload(stored(9, 0, 2))))  # seq 0 again: a new engine
    st = r.vllm_status()[0]
    assert st.restarts == 1 and st.seq == 0
    assert overlap(r, "pod-a", 1, 2) == (0, 0, 0) and overlap(r, "pod-a", 9, 2) == (2, 2, 2)


def test_subscribed_over_zmq_and_cleared_when_the_engine_goes_away(engines) -> None:
    e = engines("pod-a")
    r = Router(RouterConfig()).start()
    try:
        r.add_vllm_events(e.source())
        # keep publishing until the router's own subscriber hears (it joins late, then replays)
        wait_for(lambda: e.publish(stored(1, 0, 3)) and r.vllm_status(), what="the router to hear pod-a")
        e.publish(stored(1, 3, 1))
        wait_for(lambda: r.vllm_status()[0].seq == e.published - 1, what="the last batch")
        assert overlap(r, "pod-a", 1, 4) == (4, 4, 4)
        e.pub.shutdown()                                # the engine stops: its blocks are gone
        wait_for(lambda: r.vllm_status()[0].restarts == 1, what="the disconnect")
        assert overlap(r, "pod-a", 1, 4) == (0, 0, 0) and not r.vllm_status()[0].connected
    finally:
        r.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bound_endpoint_caps_its_topics_and_drops_streams_that_go_silent() -> None:
    """Engines connecting to a bound endpoint (llm-d's central mode) under many topics: past
    max_streams a topic is refused, past max_refused it is not even remembered (counted); a
    stream silent for idle_timeout is dropped, its worker forgotten, and its slot freed."""
    port = free_port()
    r = Router(RouterConfig()).start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        r.add_vllm_events(f"tcp://*:{port},idle_timeout=1.5,max_streams=3,max_refused=2")
        pub.connect(f"tcp://127.0.0.1:{port}")
        seqs = [0] * 10

        def send(pods: range) -> None:
            for p in pods:
                pub.send_multipart(frames(f"kv@pod-{p}@{MODEL}", seqs[p], payload(stored(p + 1, 0, 2))))
                seqs[p] += 1

        def heard() -> bool:  # the PUB joins late: send under every topic until the caps are reached
            send(range(10))
            return len(r.vllm_status()) == 5 and r.vllm.refused_unlisted > 0
        wait_for(heard, what="the router to hear the topics")
        st = r.vllm_status()
        live = {s.worker for s in st if s.connected}
        refused = [s for s in st if not s.connected]
        assert len(live) == 3 and len(refused) == 2
        assert all("max_streams=3" in s.last_error for s in refused)
        for w in live:
            p = int(w.split("-")[1])
            assert overlap(r, w, p + 1, 2)[0] == 2 and f"vllm:{w}" in r.vllm.protect
        # the live topics go silent, but one: after idle_timeout they are dropped, worker and all
        keep = min(int(w.split("-")[1]) for w in live)
        gone = live - {f"pod-{keep}"}
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            send(range(keep, keep + 1))
            time.sleep(0.1)
        assert r.vllm.expired_streams == 2
        workers = {w for w, _ in r.workers()}
        assert f"pod-{keep}" in workers and not gone & workers
        assert not {f"vllm:{w}" for w in gone} & (set(r.index.nodes) | r.vllm.protect)
        assert {s.worker for s in r.vllm_status()} == {f"pod-{keep}"}  # the refused topics expired too
        # the freed slots take new topics
        new = [p for p in range(10) if f"pod-{p}" not in live][:2]
        wait_for(lambda: send(range(new[0], new[0] + 1)) or send(range(new[1], new[1] + 1)) or
                 {s.worker for s in r.vllm_status() if s.connected} == {f"pod-{keep}", *(f"pod-{p}" for p in new)},
                 what="new topics to take the freed slots")
    finally:
        pub.close(0)
        ctx.term()
        r.close()


def test_the_daemon_feeds_never_forget_a_vllm_node() -> None:
    """Nodes a saved state names but no feed serves are forgotten once every DNS name has
    resolved; a vLLM publisher's node is served, by its stream."""
    import asyncio
    import threading

    release = threading.Event()

    async def resolve(host: str, port: int) -> list[str]:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return ["127.0.0.1"]

    r = Router(RouterConfig(dns=("kvtierd.test:1",), vllm_events=("ipc:///nonexistent/pub",), reconnect_min_s=1.0),
               resolve=resolve).start()
    try:
        r.vllm.feed(frames(f"kv@pod-a@{MODEL}", 0, payload(stored(1, 0, 2))))
        assert overlap(r, "pod-a", 1, 2) == (2, 2, 2)
        release.set()
        wait_for(lambda: not r._feeds._unresolved, what="the DNS name to resolve")
        assert ("pod-a", "vllm:pod-a") in r.workers() and overlap(r, "pod-a", 1, 2) == (2, 2, 2)
    finally:
        release.set()
        r.close()


# -- route-server ----------------------------------------------------------------------------------

def test_route_server_with_vllm_events_routes_by_token_ids(engines, d) -> None:
    a, b = engines("pod-a"), engines("pod-b")
    sock = f"{d}/router.sock"
    log = open(f"{d}/router.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.client.routing.route_server", "--listen", f"unix:{sock}",
                             "--vllm-events", a.source(), "--vllm-events", b.source()],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, what="route-server socket")
        assert proc.poll() is None, open(f"{d}/router.log").read()
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def heard() -> bool:
                a.publish(stored(1, 0, 6))  # repeated: a re-report of cached blocks changes nothing
                b.publish(stored(2, 0, 6))
                st = stub.Status(router_pb2.RouterStatusRequest(), timeout=5)
                return {"pod-a", "pod-b"} <= set(st.workers)

            wait_for(heard, what="route-server to hear both engines")
            a.publish(removed(1, [5]))
            wait_for(lambda: {f.node_id: f.seq for f in stub.Status(router_pb2.RouterStatusRequest(),
                                                                     timeout=5).feeds}.get("vllm:pod-a")
                     == a.published - 1, what="pod-a's last batch")
            feeds = {f.node_id: f for f in stub.Status(router_pb2.RouterStatusRequest(), timeout=5).feeds}
            assert feeds["vllm:pod-a"].target == f"vllm+{a.pub_ep}#{a.topic}" and feeds["vllm:pod-a"].connected
            ns = router_pb2.NamespaceSpec(model=MODEL)
            for prompt, worker, gpu in ((1, "pod-a", 5), (2, "pod-b", 6)):
                rep = stub.Route(router_pb2.RouteRequest(token_ids=tokens(prompt, 6), block_tokens=BS,
                                                         namespace=ns), timeout=5)
                assert rep.ranked[0].worker_id == worker and rep.ranked[0].node_id == f"vllm:{worker}"
                assert rep.ranked[0].overlap.gpu == gpu and rep.ranked[1].overlap.gpu == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

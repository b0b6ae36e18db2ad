"""Soak: many client processes against one real kvtierd for minutes, while things break.

    python bench/soak.py [--clients 64] [--duration 120] [--kills 20] [--out FILE.json]

``--clients`` processes (forked from a forkserver that preloaded the client library) mix put,
durable put, get, lookup, prefix_length, prefetch and evict through :class:`Sidecar`; some of
them (``--transfer-clients``) offload and onboard through :class:`KVConnector` and the CPU
stand-in copy engine; some (``--subscribers``) follow the location feed. Every block's bytes
are derived from its key (a PRNG seeded by the key), so every byte served (get, onboard) is
compared with what it must be.

Faults, spread over the run:

* ``--kills N``: kill -9 of the daemon at random points (between 10 % and 60 % of the run, so
  the last incarnation runs long enough to measure its memory), restarted by the harness with
  the same disk directory;
* a disk that fills: the disk tier lives on a small filesystem the harness mounts (a loop ext4
  image; a tmpfs if loop mounts fail); for ``--fill-s`` seconds a ballast file takes all its
  free space. If no mount works the JSON says so in ``faults.disk_fill`` (never skipped
  silently);
* a slow disk: for ``--slow-s`` seconds a noisy neighbour writes the same filesystem with
  O_DIRECT|O_DSYNC as fast as it can (dm-delay and FUSE are not available here; a contended
  device is the slowness a real node sees);
* clients SIGKILLed mid-operation (and started again);
* clients stopped (SIGSTOP) between their Allocate and their writes, until their grants
  expired (``--grant-ttl-s``; the daemon withholds their slots), then resumed: their late
  writes and commits must change nothing; the sweep that follows reads every held block back;
* a subscriber that stops reading for ``--stuck-s`` seconds.

Checks: after each daemon restart (clients running): every durable put acknowledged before the
kill is held and byte-exact; no file of a dead daemon left in the shm directory and no stray
file in the disk directory. Every ``--check-s`` seconds and at the end, with every client
paused between operations: a sweep of the whole key space (every held block read and
compared), capacity accounting (each tier's used bytes equal its blocks times the slot size,
from Stats), files, the daemon's open fds (compared with the first check of its incarnation).
Durable keys are never evicted by the clients and fit on the disk tier. Host victims beyond the
daemon's write queue's room are not demoted (``--demote-min-seen``), but those within it and
the write-ahead window are written to disk in the background, so the disk also holds copies of
shared keys (should they fill it, its capacity evictions may take durable blocks too). A disk
slot is in use from the moment such a write is planned, before its block counts: the capacity
accounting reads Stats once the daemon reports no background write in flight
(``demotions_staged == demotions_staged_over``; a check's own sweep starts some), and one still
in flight after ``SETTLE_S`` is an accounting error.

The harness waits for conditions, not times, so that a busy machine makes a slower run, not a
different one: the run's clock (and its faults) starts once every client's first operation
went through; a stopped client is resumed once the daemon counts its expired grants as
withheld (``grants_withheld``); ``--min-ops`` keeps the clients going past ``--duration``
until they did that many operations.

``--attackers N``: N hostile processes (bench/soak_attackers.py) beside the clients, from the
moment they all run, across the daemon's kills: descriptor hoarding, silent connections on the
credential and gRPC sockets (from an admitted tenant of its own, ``nobody``, and from a uid not
admitted, when the harness runs as root), RegisterKV spam, names planted in the shm directory,
oversized and deeply nested credential messages. The soak then runs twice, each
``--duration``: quiet first (the daemon admitting the attackers' tenant all the same), then
attacked. The JSON adds ``attacker_ops`` (hostile operations attempted) and their answers,
``victim_errors`` (errors of the normal clients beyond the codes the soak's own faults answer
them, ``TOLERATED``, plus every refusal naming a budget, ``BUDGET_FLAGS``, plus client crashes),
``victim_p99_ms`` and ``victim_p99_ms_quiet`` (the normal clients' p99 over all their ops,
attacked and quiet) and ``quiet_phase`` (the quiet run's zeros). The goal (victim_errors 0,
victim_p99_ms at most twice the quiet one, the zeros of both runs) is printed to stderr, not
asserted. With ``--attackers 0`` (the default) none of this runs and the JSON is as below.

Last line of stdout: one JSON object: ops, blocks_verified, kills, lost_durable, corrupt_served,
accounting_errors, leaked_files, rss_growth (heap, RssAnon, of the last incarnation after its
warm-up), fd_growth, p50_ms and p99_ms per op, errors by code, the faults injected and the
parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BOUNDS = np.geomspace(1e-5, 100.0, 241)  # latency histogram bucket bounds, seconds
OPS = ("put", "put_durable", "get", "lookup", "prefix_length", "prefetch", "evict")
WEIGHTS = (20, 4, 30, 20, 12, 4, 3)
TOKENS = 16
MAX_BATCH = 8
SETTLE_S = 30.0  # longest wait for the daemon's background disk writes before the accounting reads Stats
READY_S = 120.0  # longest wait for every client's first operation before the run's clock starts
STOP_S = 30.0    # longest wait, past the grant TTL, for a stopped client's grants to be withheld
STRETCH = 4      # --min-ops: the run goes on at most this many times --duration past it


# -- keys and their bytes ---------------------------------------------------------------------

def shared_key(i: int) -> bytes:
    return hashlib.blake2b(b"s:%d" % i, digest_size=16).digest()


def durable_key(client: int, j: int) -> bytes:
    return hashlib.blake2b(b"d:%d:%d" % (client, j), digest_size=16).digest()


def xfer_key(i: int) -> bytes:
    return hashlib.blake2b(b"x:%d" % i, digest_size=16).digest()


def derive(key: bytes, n: int, salt: int = 0) -> np.ndarray:
    """The bytes a block under ``key`` must hold (``salt``: a tensor's slice of it)."""
    seed = int.from_bytes(key[:8], "little") ^ salt
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


# -- capacity accounting ---------------------------------------------------------------------

def disk_writes_in_flight(st: dict) -> int:
    """Host blocks a Stats reply says the daemon has queued for, or is writing to, disk in the
    background (victims copied out, the write-ahead window): each holds a disk slot counted in
    the disk's ``used_bytes`` before its block counts in ``blocks``."""
    c = st["counters"]
    return c.get("demotions_staged", 0) - c.get("demotions_staged_over", 0)


def accounting_errors(st: dict, block: int) -> list[str]:
    """What a Stats reply taken with no background disk write in flight shows wrong: each tier's
    used bytes are its blocks times the slot (every layout here has ``block``-byte blocks, a
    multiple of 4 KiB: slot == block), and the layouts' host blocks add up to the tier's."""
    errors = [f"{name}: used_bytes {t['used_bytes']} != {t['blocks']} blocks x {block}"
              for name, t in st["tiers"].items()
              if name in ("host", "disk") and t["used_bytes"] != t["blocks"] * block]
    by_layout = sum(lay["host_blocks"] for lay in st["layouts"])
    if by_layout != st["tiers"]["host"]["blocks"]:
        errors.append(f"host blocks by layout {by_layout} != tier blocks {st['tiers']['host']['blocks']}")
    return errors


def settled_stats(stats: Callable[[], dict], timeout: float = SETTLE_S) -> dict:
    """A Stats reply (``stats()``) taken once the daemon's background disk writes are over, or
    the last one taken when ``timeout`` seconds pass first (it still shows them in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        st = stats()
        if disk_writes_in_flight(st) == 0 or time.monotonic() >= deadline:
            return st
        time.sleep(0.02)


# -- per-client tallies -----------------------------------------------------------------------

class Tally:
    """What one client process did, flushed to a JSON file every second (a client SIGKILLed
    loses at most that second)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.hist: dict[str, np.ndarray] = {}
        self.errors: dict[str, int] = {}
        self.counts: dict[str, int] = {"blocks_verified": 0, "corrupt_served": 0, "late_commit_refused": 0,
                                       "late_commit_accepted": 0, "feed_replies": 0, "feed_resubscribes": 0,
                                       "budget_refused": 0}
        self.flushed = time.monotonic()

    def op(self, name: str, seconds: float) -> None:
        h = self.hist.get(name)
        if h is None:
            h = self.hist[name] = np.zeros(len(BOUNDS) + 1, dtype=np.int64)
        h[np.searchsorted(BOUNDS, seconds)] += 1

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.flushed < 1.0:
            return
        self.flushed = now
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"hist": {k: v.tolist() for k, v in self.hist.items()}, "errors": self.errors,
                       "counts": self.counts}, fh)
        os.replace(tmp, self.path)


class Control:
    """Shared between the harness and its clients (made before the forkserver starts them)."""

    def __init__(self, ctx: Any, n: int) -> None:
        self.stop = ctx.Event()
        self.pause = ctx.Value("i", 0)         # > 0: pause round; clients answer in idle[]
        self.idle = ctx.Array("i", n)          # the pause round each client is idle in
        self.stall = ctx.Array("i", n)         # 1: stop yourself inside your next put; 2: stopped
        self.stall_grants = ctx.Array("i", n)  # the slots the stopped put was granted
        self.ready = ctx.Array("i", n)         # 1: the client's first operation went through
        self.epoch_gen = ctx.Value("i", 0)     # daemon restarts (clients log errors across them)
        self.daemon_pid = ctx.Value("i", 0)    # the live daemon's pid (attackers plant names with it)


def _wait_pause(ctl: Control, idx: int) -> bool:
    """Idle while the harness pauses everyone; True if it did."""
    r = ctl.pause.value
    if r <= 0:
        return False
    ctl.idle[idx] = r
    while ctl.pause.value == r and not ctl.stop.is_set():
        time.sleep(0.01)
    return True


#: flags of the budgets the attackers press on (docs/SECURITY.md): a normal client refused naming one
BUDGET_FLAGS = ("--max-passed-fds", "--fd-reserve", "--max-pending-handshakes", "--credential-hello-timeout-s",
                "--max-kv-registrations", "--max-sessions", "--max-concurrent-rpcs", "may not use this kvtierd")
#: the codes the soak's own faults (kills, a full or slow disk, stopped clients) answer normal clients
TOLERATED = ("UNAVAILABLE", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED")


def _budget_named(details: str) -> bool:
    return any(f in (details or "") for f in BUDGET_FLAGS)


def _code(e: BaseException) -> str:
    code = getattr(e, "code", None)
    return getattr(code, "name", None) or type(e).__name__


# -- the clients ------------------------------------------------------------------------------

class SidecarClient:
    """One engine-like process on the Sidecar API: a random op at a time, every byte it gets
    compared with its key's bytes; durable puts it was told succeeded are logged (acks file)."""

    def __init__(self, idx: int, gen: int, cfg: dict, ctl: Control) -> None:
        from kvtier.client.engine.sidecar import Sidecar, _SidecarCore
        from kvtier.proto import node_pb2
        from kvtier.tiers.layout import Layout

        self.idx, self.cfg, self.ctl = idx, cfg, ctl
        self.rng = random.Random(idx * 7919 + gen)
        self.tally = Tally(os.path.join(cfg["work"], f"client-{idx}-{gen}.json"))
        self.block = cfg["block_bytes"]
        self.layout = Layout.flat(self.block, TOKENS)
        self.acks = open(os.path.join(cfg["work"], f"durable-{idx}.acks"), "a")
        self.nshared, self.ndur = cfg["shared_keys"], cfg["durable_per_client"]
        with open(self.acks.name) as fh:
            self.dur_next = sum(1 for _ in fh)
        original_write = _SidecarCore._write

        def stalling_write(info, reply, keys, arrs, result):  # type: ignore[no-untyped-def]
            if ctl.stall[idx] == 1:  # the scheduler stops this engine between Allocate and its writes
                ctl.stall_grants[idx] = sum(1 for g in reply.grants if g.status == node_pb2.GRANTED)
                ctl.stall[idx] = 2
                os.kill(os.getpid(), signal.SIGSTOP)
                if ctl.stall[idx] == 2:
                    ctl.stall[idx] = 3  # resumed: the writes below land after the grants expired
            return original_write(info, reply, keys, arrs, result)

        _SidecarCore._write = staticmethod(stalling_write)
        self.sc = Sidecar(cfg["socket"], timeout=20, client_name=f"soak-{idx}")
        self.lid: int | None = None

    def log(self, name: str, line: str) -> None:
        with open(os.path.join(self.cfg["work"], name), "a") as fh:
            fh.write(f"client {self.idx}: {line}\n")

    def durable_keys(self, n: int) -> list[bytes]:
        top = min(self.dur_next, self.ndur)
        return list(dict.fromkeys(durable_key(self.idx, self.rng.randrange(top)) for _ in range(n)))

    def op_put(self, keys: list[bytes]) -> None:
        res = self.sc.put(self.lid, keys, [derive(k, self.block) for k in keys])
        if self.ctl.stall[self.idx] == 3 and res.stored:  # (keys all present: nothing was granted)
            self.tally.counts["late_commit_accepted"] += 1
            self.log("stall.log", f"the late put was accepted: {res}")

    def op_put_durable(self, keys: list[bytes]) -> None:
        j = self.dur_next % self.ndur
        dk = [durable_key(self.idx, j)]
        res = self.sc.put(self.lid, dk, [derive(dk[0], self.block)], durable=True)
        if res.durable >= 1 and not res.dropped:
            if self.dur_next < self.ndur:
                self.acks.write(dk[0].hex() + "\n")
                self.acks.flush()
            self.dur_next += 1

    def op_get(self, keys: list[bytes]) -> None:
        if self.dur_next and self.rng.random() < 0.2:
            keys = self.durable_keys(len(keys))
        out = self.sc.get(self.lid, keys, verify=self.rng.random() < 0.2)
        for k, view in zip(keys, out, strict=True):
            if view is None:
                continue
            if np.array_equal(np.frombuffer(view, dtype=np.uint8), derive(k, self.block)):
                self.tally.counts["blocks_verified"] += 1
            else:
                self.tally.counts["corrupt_served"] += 1
                self.log("corrupt.log", f"get {k.hex()}")

    def op_lookup(self, keys: list[bytes]) -> None:
        self.sc.lookup(self.lid, keys)

    def op_prefix_length(self, keys: list[bytes]) -> None:
        self.sc.prefix_length(self.lid, keys)

    def op_prefetch(self, keys: list[bytes]) -> None:
        self.sc.prefetch(self.lid, self.durable_keys(len(keys)) if self.dur_next else keys)

    def op_evict(self, keys: list[bytes]) -> None:
        self.sc.evict(self.lid, keys)  # shared keys only: durable keys are never evicted

    def step(self) -> None:
        from kvtier.client.engine.transport import KvtierError

        stalled = self.ctl.stall[self.idx] == 1
        op = "put" if stalled else self.rng.choices(OPS, WEIGHTS)[0]
        n, start = self.rng.randint(1, MAX_BATCH), self.rng.randrange(self.nshared)
        keys = [shared_key((start + i) % self.nshared) for i in range(n)]
        t0 = time.perf_counter()
        try:
            if self.lid is None:
                self.lid = self.sc.register_layout(self.layout)
            getattr(self, "op_" + op)(keys)
            self.tally.op(op, time.perf_counter() - t0)
            self.ctl.ready[self.idx] = 1
        except KvtierError as e:
            late = self.ctl.stall[self.idx] == 3
            if late:
                self.log("stall.log", f"the late put was refused {e.code.name}: {e.details}")
            if late and e.code.name == "DEADLINE_EXCEEDED":
                self.tally.counts["late_commit_refused"] += 1
            else:
                self.tally.error(e.code.name)
            if _budget_named(e.details):
                self.tally.counts["budget_refused"] += 1
            if e.code.name == "FAILED_PRECONDITION":
                self.lid = None  # a restarted daemon: register again
            time.sleep(0.02)
        if self.ctl.stall[self.idx] in (3, 4):
            self.ctl.stall[self.idx] = 0

    def run(self) -> None:
        while not self.ctl.stop.is_set():
            if not _wait_pause(self.ctl, self.idx):
                self.step()
            self.tally.flush()
        self.tally.flush(force=True)
        with contextlib.suppress(Exception):
            self.sc.close()


def sidecar_client(idx: int, gen: int, cfg: dict, ctl: Control) -> None:
    SidecarClient(idx, gen, cfg, ctl).run()


class TransferClient:
    """An engine on the Transfer service with CPU stand-in KV memory: offloads blocks it fills
    with their keys' bytes, onboards blocks (its own or another engine's) and compares them."""

    NBLOCKS = 32

    def __init__(self, idx: int, gen: int, cfg: dict, ctl: Control) -> None:
        import torch

        from kvtier.client.engine import SharedKVArena
        from kvtier.tiers.layout import Layout

        torch.set_num_threads(1)
        self.torch = torch
        self.idx, self.cfg, self.ctl = idx, cfg, ctl
        self.rng = random.Random(idx * 104729 + gen)
        self.tally = Tally(os.path.join(cfg["work"], f"client-{idx}-{gen}.json"))
        self.layout = Layout.vllm(num_layers=2, num_blocks=self.NBLOCKS, block_tokens=TOKENS, kv_heads=2,
                                  head_dim=64, dtype="float16")
        self.arena = SharedKVArena(self.layout, cfg["shm"])
        self.u8 = [t.view(torch.uint8) for t in self.arena.tensors]  # [2, nblocks, ...] as bytes
        self.conn: Any = None
        self.nkeys = cfg["shared_keys"] // 4

    def fill(self, b: int, key: bytes) -> None:
        for ti, t in enumerate(self.u8):
            sl = t[:, b]
            sl.copy_(self.torch.from_numpy(derive(key, sl.numel(), ti).copy()).view(sl.shape))

    def holds(self, b: int, key: bytes) -> bool:
        return all(np.array_equal(t[:, b].contiguous().numpy().ravel(), derive(key, t[:, b].numel(), ti))
                   for ti, t in enumerate(self.u8))

    def offload(self, keys: list[bytes]) -> None:
        src = self.rng.sample(range(self.NBLOCKS // 2), len(keys))
        for b, k in zip(src, keys, strict=True):
            self.fill(b, k)
        t0 = time.perf_counter()
        self.conn.offload(keys, src).wait(30)
        self.tally.op("offload", time.perf_counter() - t0)

    def onboard(self, keys: list[bytes]) -> None:
        dst = self.rng.sample(range(self.NBLOCKS // 2, self.NBLOCKS), len(keys))
        t0 = time.perf_counter()
        statuses = self.conn.onboard(keys, dst).wait(30)
        self.tally.op("onboard", time.perf_counter() - t0)
        for b, k, s in zip(dst, keys, statuses, strict=True):
            if s != "copied":
                continue
            if self.holds(b, k):
                self.tally.counts["blocks_verified"] += 1
            else:
                self.tally.counts["corrupt_served"] += 1
                with open(os.path.join(self.cfg["work"], "corrupt.log"), "a") as fh:
                    fh.write(f"client {self.idx} onboard {k.hex()}\n")

    def step(self) -> None:
        from kvtier.client.engine import KVConnector
        from kvtier.client.engine.transport import KvtierError

        try:
            if self.conn is None:
                self.conn = KVConnector(self.cfg["socket"], ring_dir=self.cfg["shm"], ring_slots=4, timeout=20)
                self.conn.register(self.layout, self.arena.tensors)
            keys = list(dict.fromkeys(xfer_key(self.rng.randrange(self.nkeys)) for _ in range(self.rng.randint(1, 8))))
            (self.offload if self.rng.random() < 0.5 else self.onboard)(keys)
            self.ctl.ready[self.idx] = 1
        except Exception as e:  # refused, a transfer that timed out, a ring that went away
            self.tally.error(e.code.name if isinstance(e, KvtierError) else type(e).__name__)
            if _budget_named(str(getattr(e, "details", "")) or str(e)):
                self.tally.counts["budget_refused"] += 1
            self.close()
            time.sleep(0.1)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.conn is not None:
                self.conn.close()
        self.conn = None

    def run(self) -> None:
        while not self.ctl.stop.is_set():
            if not _wait_pause(self.ctl, self.idx):
                self.step()
            self.tally.flush()
        self.tally.flush(force=True)
        self.close()


def transfer_client(idx: int, gen: int, cfg: dict, ctl: Control) -> None:
    TransferClient(idx, gen, cfg, ctl).run()


def _follow(stream: Any, tally: Tally, ctl: Control, stuck_at: list[float], stuck_s: float) -> None:
    """Read a feed stream until a pause or the end; once past ``stuck_at[0]``, stop reading for
    ``stuck_s`` (a subscriber that stops reading), then go on (once: it becomes infinity)."""
    for _reply in stream:
        tally.counts["feed_replies"] += 1
        tally.flush()
        if time.monotonic() > stuck_at[0]:
            end, stuck_at[0] = time.monotonic() + stuck_s, math.inf
            while time.monotonic() < end and not ctl.stop.is_set() and ctl.pause.value <= 0:
                time.sleep(0.1)
        if ctl.stop.is_set() or ctl.pause.value > 0:
            return


def subscriber(idx: int, gen: int, cfg: dict, ctl: Control) -> None:
    import grpc

    from kvtier.client.engine.transport import KvtierError, open_channel
    from kvtier.proto import locations_pb2, locations_pb2_grpc

    tally = Tally(os.path.join(cfg["work"], f"client-{idx}-{gen}.json"))
    stuck_at = [time.monotonic() + cfg["stuck_after_s"] if cfg["stuck_subscriber"] == idx else math.inf]
    while not ctl.stop.is_set():
        if _wait_pause(ctl, idx):  # streams closed while the harness counts the daemon's fds
            continue
        try:
            ch = open_channel(f"unix:{cfg['socket']}", client_name=f"soak-sub-{idx}")
        except KvtierError as e:
            tally.error(e.code.name)
            time.sleep(0.2)
            continue
        ctl.ready[idx] = 1
        stream = locations_pb2_grpc.LocationsStub(ch).WatchLocations(
            locations_pb2.WatchLocationsRequest(subscriber=f"soak-{idx}"))
        done = threading.Event()

        def watch(stream: Any = stream, done: threading.Event = done) -> None:
            while not done.wait(0.05):  # a pause or the end: close the stream now, not at its next reply
                if ctl.pause.value > 0 or ctl.stop.is_set():
                    stream.cancel()
                    return

        threading.Thread(target=watch, daemon=True).start()
        try:
            _follow(stream, tally, ctl, stuck_at, cfg["stuck_s"])
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                tally.error(e.code().name)
                tally.counts["feed_resubscribes"] += 1
                if _budget_named(e.details() or ""):
                    tally.counts["budget_refused"] += 1
        finally:
            done.set()
            stream.cancel()
            ch.close()
            with contextlib.suppress(Exception):
                ch.kvtier_credentials.close()
        time.sleep(0.1)
    tally.flush(force=True)


ROLES: dict[str, Callable[[int, int, dict, Control], None]] = {
    "sidecar": sidecar_client, "transfer": transfer_client, "subscriber": subscriber}


def client_main(role: str, idx: int, gen: int, cfg: dict, ctl: Control) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ROLES[role](idx, gen, cfg, ctl)
    except Exception as e:  # a crash of a client is a finding too: logged, counted
        with open(os.path.join(cfg["work"], "client-crash.log"), "a") as fh:
            fh.write(f"client {idx} ({role}) crashed: {type(e).__name__}: {e}\n")
        raise


# -- the harness ------------------------------------------------------------------------------

def proc_status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class DiskMount:
    """The disk tier's small filesystem: a loop ext4 image, else a tmpfs, else a plain
    directory (``how`` says which, and why)."""

    def __init__(self, base: str, size_mib: int) -> None:
        self.dir = os.path.join(base, "disk")
        os.makedirs(self.dir)
        self.image = os.path.join(base, "disk.img")
        self.mounted = False
        self.tmpfs = False
        self.how = ""
        errors = []
        try:
            with open(self.image, "wb") as fh:
                fh.truncate(size_mib << 20)
            subprocess.run(["mkfs.ext4", "-q", "-F", self.image], check=True, capture_output=True, timeout=60)
            subprocess.run(["mount", "-o", "loop", self.image, self.dir], check=True, capture_output=True, timeout=60)
            self.mounted, self.how = True, f"loop ext4 {size_mib} MiB"
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"loop ext4: {_why(e)}")
            with contextlib.suppress(OSError):
                os.unlink(self.image)
            try:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", self.dir], check=True,
                               capture_output=True, timeout=60)
                self.mounted, self.tmpfs, self.how = True, True, f"tmpfs {size_mib} MiB ({errors[0]})"
            except (OSError, subprocess.SubprocessError) as e2:
                errors.append(f"tmpfs: {_why(e2)}")
                self.how = "mount failed: " + "; ".join(errors) + " (plain directory: the disk never fills)"
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(os.path.join(self.dir, "lost+found"))

    def fill(self) -> str:
        """Take every free byte of the filesystem (a ballast file); returns what happened."""
        if not self.mounted:
            return "skipped: " + self.how
        path = os.path.join(self.dir, "..ballast")
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(4096, free - 4096))
            except OSError:
                pass  # took what there was
            finally:
                os.close(fd)
        except OSError as e:
            return f"ballast failed: {e}"
        return f"filled {free >> 20} MiB"

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, "..ballast"))

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.dir], capture_output=True, timeout=60)
        with contextlib.suppress(OSError):
            os.unlink(self.image)


def _why(e: BaseException) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        return (e.stderr or b"").decode(errors="replace").strip() or str(e)
    return str(e)


class NoisyNeighbour:
    """A slow disk: O_DIRECT|O_DSYNC writes of 1 MiB to the same filesystem, back to back."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "..noisy")
        self.stop = threading.Event()
        self.written = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import mmap

        buf = mmap.mmap(-1, 1 << 20)
        buf.write(os.urandom(1 << 20))
        flags = os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0) | getattr(os, "O_DSYNC", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError:
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_DSYNC, 0o600)
        try:
            off = 0
            while not self.stop.is_set():
                try:
                    os.pwrite(fd, buf, off)
                    self.written += 1 << 20
                    off = (off + (1 << 20)) % (8 << 20)
                except OSError:
                    time.sleep(0.05)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def close(self) -> int:
        self.stop.set()
        self.thread.join(10)
        return self.written


class Harness:
    """One soak. ``hostile``: the daemon admits the attackers' tenant (``--attackers``; the quiet
    phase that measures the same soak without them admits it too) and ``ns.attackers`` hostile
    processes run beside the clients once they all run."""

    def __init__(self, ns: argparse.Namespace, hostile: bool = False) -> None:
        from kvtier.client.tools.local_daemon import DaemonProcess

        self.ns = ns
        self.rng = random.Random(ns.seed)
        self.base = tempfile.mkdtemp(prefix="kvtier-soak-")
        self.work = os.path.join(self.base, "work")
        os.makedirs(self.work)
        self.shm = tempfile.mkdtemp(prefix="kvtier-soak-", dir="/dev/shm")
        self.disk = DiskMount(self.base, ns.disk_fs_mib)
        block = ns.block_kib * 1024
        args = ["--disk-dir", self.disk.dir, "--disk-capacity", f"{ns.disk_mib}MiB",
                "--grant-ttl-s", str(ns.grant_ttl_s), "--lease-ttl-s", str(ns.grant_ttl_s * 2),
                "--demote-min-seen", str(ns.demote_min_seen), "--event-log-keys", str(ns.event_log_keys),
                "--copy-engine", "host", "--copy-threads", "2", "--state-dir", self.work]
        if self.disk.tmpfs:
            args += ["--disk-allow-tmpfs", "true"]
        if hostile and os.geteuid() == 0:
            from soak_attackers import daemon_args

            args += daemon_args()
            os.chmod(self.base, 0o711)  # other uids reach the sockets (the work and disk dirs stay 0700)
        self.daemon = DaemonProcess(self.base, *args, shm_dir=self.shm, host_capacity=f"{ns.host_mib}MiB")
        self.block = block
        self.cfg = {"socket": self.daemon.socket, "work": self.work, "shm": self.shm, "block_bytes": block,
                    "shared_keys": ns.shared_keys, "durable_per_client": ns.durable_per_client,
                    "stuck_subscriber": -1, "stuck_after_s": ns.duration * 0.2, "stuck_s": ns.stuck_s}
        self.roles: list[str] = []
        for i in range(ns.clients):
            if i < ns.subscribers:
                self.roles.append("subscriber")
            elif i < ns.subscribers + ns.transfer_clients:
                self.roles.append("transfer")
            else:
                self.roles.append("sidecar")
        if ns.subscribers:
            self.cfg["stuck_subscriber"] = 0
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["numpy", "grpc", "kvtier.client.engine.sidecar"])
        self.ctl = Control(self.ctx, ns.clients + ns.attackers)
        self.procs: list[Any] = [None] * ns.clients
        self.attackers: list[Any] = [None] * ns.attackers
        self.attacker_gens = [0] * ns.attackers
        self.gens = [0] * ns.clients
        self.sc: Any = None
        self.lid = 0
        self.report: dict[str, Any] = {"lost_durable": 0, "corrupt_served_sweep": 0, "accounting_errors": 0,
                                       "leaked_files": 0, "fd_growth": 0, "checks": 0, "durable_checked": 0,
                                       "sweep_verified": 0, "findings": []}
        self.faults: dict[str, Any] = {"kills": 0, "client_kills": 0, "client_stops": 0, "disk_fill": "",
                                       "slow_disk": "", "stuck_subscriber": ns.subscribers > 0}
        self.incarnation_fds: dict[str, int] | None = None
        self.noisy: NoisyNeighbour | None = None
        self.samples: list[tuple[float, int, int, int]] = []  # (t, RssAnon, VmRSS, fds)
        self.settle_s = SETTLE_S
        self.stops: dict[int, dict[str, Any]] = {}  # stopped clients (stop_client), by index
        self.tallied_at = -math.inf  # when short_of_ops last read the tallies (run time)
        self.last_start = 0.0

    # -- processes ------------------------------------------------------------------------

    def start_client(self, i: int) -> None:
        p = self.ctx.Process(target=client_main, args=(self.roles[i], i, self.gens[i], self.cfg, self.ctl),
                             daemon=True)
        p.start()
        self.procs[i] = p

    def start_attacker(self, j: int) -> None:
        from soak_attackers import attacker_main

        p = self.ctx.Process(target=attacker_main, args=(j, self.ns.clients + j, self.attacker_gens[j], self.cfg,
                                                         self.ctl), daemon=True)
        p.start()
        self.attackers[j] = p

    def start_daemon(self) -> None:
        self.daemon.start(timeout=60)
        self.ctl.daemon_pid.value = self.daemon.pid
        self.last_start = time.monotonic()
        self.incarnation_fds = None

    def sidecar(self) -> Any:
        from kvtier.client.engine.sidecar import Sidecar
        from kvtier.tiers.layout import Layout

        if self.sc is None:
            self.sc = Sidecar(self.daemon.socket, timeout=30, client_name="soak-harness", use_key_table=False)
        self.lid = self.sc.register_layout(Layout.flat(self.block, TOKENS))
        return self.sc

    def finding(self, text: str) -> None:
        if len(self.report["findings"]) < 50:
            self.report["findings"].append(text)

    # -- checks ---------------------------------------------------------------------------

    def acked(self) -> list[bytes]:
        out = []
        for path in glob.glob(os.path.join(self.work, "durable-*.acks")):
            with open(path) as fh:
                out += [bytes.fromhex(line.strip()) for line in fh if len(line.strip()) == 32]
        return out

    def check_durable(self, keys: list[bytes]) -> None:
        sc = self.sidecar()
        lost = 0
        for i in range(0, len(keys), 256):
            batch = keys[i:i + 256]
            got = sc.get(self.lid, batch)
            for k, view in zip(batch, got, strict=True):
                if view is None:
                    lost += 1
                    self.finding(f"durable key {k.hex()} acknowledged before kill {self.faults['kills']} is gone")
                elif not np.array_equal(np.frombuffer(view, dtype=np.uint8), derive(k, self.block)):
                    self.report["corrupt_served_sweep"] += 1
                    self.finding(f"durable key {k.hex()} served corrupt")
        self.report["lost_durable"] += lost
        self.report["durable_checked"] += len(keys)

    def stray_files(self) -> list[str]:
        """Files in the shm and disk directories that no live daemon owns."""
        pid = self.daemon.pid if self.daemon.proc is not None else -1
        stray = [n for n in os.listdir(self.shm)
                 if n.startswith("kvtier-") and f"-{pid}-" not in n and not n.startswith("kvtier-kv-")
                 and not n.startswith("kvtier-ring-")]
        disk_ok = ("index", "slab", "..ballast", "..noisy", "key.secret", "lost+found", "LOCK")
        stray += [f"disk/{n}" for n in os.listdir(self.disk.dir) if not n.startswith(disk_ok)]
        if self.ns.attackers:  # the attackers' planted names are theirs, not a dead daemon's
            planted: set[str] = set()
            for path in glob.glob(os.path.join(self.work, "planted-*.log")):
                with open(path) as fh:
                    planted.update(line.strip() for line in fh)
            stray = [n for n in stray if n not in planted]
        return stray

    def check_files(self) -> None:
        stray = self.stray_files()
        if stray:
            self.report["leaked_files"] = max(self.report["leaked_files"], len(stray))
            self.finding(f"after kill {self.faults['kills']}: files no live daemon owns: {sorted(stray)[:6]}")

    def pause(self) -> bool:
        r = self.ctl.pause.value = abs(self.ctl.pause.value) + 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [i for i, p in enumerate(self.procs + self.attackers) if p is not None and p.is_alive()
                    and self.ctl.idle[i] != r and (i >= self.ns.clients or self.ctl.stall[i] != 2)]
            if not busy:
                return True
            time.sleep(0.02)
        self.finding(f"clients {busy[:8]} did not pause within 60 s")
        return False

    def resume(self) -> None:
        self.ctl.pause.value = -abs(self.ctl.pause.value)

    def sweep(self, sc: Any) -> None:
        """Read every held block of the shared key space back and compare it."""
        keys = [shared_key(i) for i in range(self.ns.shared_keys)]
        for i in range(0, len(keys), 256):
            batch = keys[i:i + 256]
            for k, view in zip(batch, sc.get(self.lid, batch), strict=True):
                if view is None:
                    continue
                if np.array_equal(np.frombuffer(view, dtype=np.uint8), derive(k, self.block)):
                    self.report["sweep_verified"] += 1
                else:
                    self.report["corrupt_served_sweep"] += 1
                    self.finding(f"sweep: key {k.hex()} holds bytes that are not its own")

    def check_accounting(self, st: dict) -> None:
        """:func:`accounting_errors` of ``st``, a Stats reply taken with no background disk
        write in flight (:func:`settled_stats`); one still in flight is an error of its own."""
        if any(self.ctl.stall[i] == 2 for i in range(self.ns.clients)):
            return  # a stopped client's grants hold slots: checked at the next pause
        writing = disk_writes_in_flight(st)
        if writing:
            errors = [f"disk: {writing} background writes (demotions_staged - demotions_staged_over) still in "
                      f"flight after {self.settle_s:g} s"]
        else:
            errors = accounting_errors(st, self.block)
        self.report["accounting_errors"] += len(errors)
        for e in errors:
            self.finding(e)

    def fd_kinds(self) -> dict[str, int]:
        """The daemon's open fds by kind: per-client ones (a connection's socket, a client's
        lookup counters region, an engine's KV memory and event ring) apart from the rest."""
        pid = self.daemon.pid
        kinds: dict[str, int] = {}
        for n in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{n}")
            except OSError:
                continue
            kind = target.split(":")[0] if ":" in target and not target.startswith("/memfd:") else target
            for prefix in ("/memfd:kvtier-lookups", "/memfd:kvtier-kv", "/memfd:kvtier-ring"):
                if target.startswith(prefix):
                    kind = prefix
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    def check_fds(self, final: bool) -> None:
        """Leaked fds: per-client kinds above what the clients can hold (one each: lookup regions
        per sidecar, KV memory and ring per engine; two sockets per client), every other kind
        above the first check of this daemon's incarnation. With attackers (paused, what they
        held closed): waits, at most ``SETTLE_S``, for the daemon to see their connections close."""
        excess = self.fd_excess(final)
        deadline = time.monotonic() + (SETTLE_S if self.ns.attackers else 0.0)
        while excess and time.monotonic() < deadline:
            time.sleep(0.05)
            excess = self.fd_excess(final)
        if excess:
            self.report["fd_growth"] = max(self.report["fd_growth"], sum(excess.values()))
            self.finding(f"daemon fds beyond what its clients hold: {excess}{' (final)' if final else ''}")

    def fd_excess(self, final: bool) -> dict[str, int]:
        kinds = self.fd_kinds()
        if self.ns.keep:
            with open(os.path.join(self.work, f"fds-{self.report['checks']}.json"), "w") as fh:
                json.dump(kinds, fh)
        n_side = self.roles.count("sidecar") + 1  # and the harness's own
        n_xfer = self.roles.count("transfer")
        limits = {"/memfd:kvtier-lookups": n_side, "/memfd:kvtier-kv": n_xfer, "/memfd:kvtier-ring": n_xfer,
                  "socket": 2 * (len(self.roles) + 1) + 8}
        if self.incarnation_fds is None:
            self.incarnation_fds = {k: v for k, v in kinds.items() if k not in limits}
        excess = {k: v - limits.get(k, self.incarnation_fds.get(k, 0)) for k, v in kinds.items()}
        return {k: v for k, v in excess.items() if v > 0}

    def full_check(self, final: bool = False) -> None:
        """With every client paused between operations: sweep, accounting, files, fds."""
        try:
            if not self.pause():
                return
            time.sleep(0.2)  # replies of the last ops settle
            sc = self.sidecar()
            self.report["checks"] += 1
            self.sweep(sc)
            self.check_accounting(settled_stats(sc.stats, self.settle_s))
            self.check_files()
            self.check_fds(final)
        finally:
            self.resume()

    # -- faults ---------------------------------------------------------------------------

    def kill_daemon(self) -> None:
        acked = self.acked()  # everything acknowledged before the kill
        self.daemon.kill()
        self.faults["kills"] += 1
        if self.sc is not None:
            with contextlib.suppress(Exception):
                self.sc.close()
            self.sc = None
        self.start_daemon()
        self.check_durable(acked)
        self.check_files()

    def kill_client(self) -> None:
        cands = [i for i, r in enumerate(self.roles) if r != "subscriber" and self.ctl.stall[i] == 0]
        if not cands:
            return
        i = self.rng.choice(cands)
        p = self.procs[i]
        if p is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        self.faults["client_kills"] += 1
        self.gens[i] += 1
        self.ctl.idle[i] = 0
        self.start_client(i)

    def grants_withheld(self) -> tuple[int, int]:
        """The daemon's epoch and its count of expired grants whose slots it withheld."""
        st = self.sidecar().stats()
        return st["epoch"], st["counters"].get("grants_withheld", 0)

    def stop_client(self) -> None:
        """Ask a sidecar client to stop itself inside its next put (between its Allocate and its
        writes); :meth:`tend_stops` resumes it once the daemon has withheld its expired grants."""
        cands = [i for i, r in enumerate(self.roles) if r == "sidecar" and self.ctl.stall[i] == 0]
        if not cands:
            return
        i = self.rng.choice(cands)
        epoch, withheld = self.grants_withheld()  # before its Allocate: its grants' expiry adds to it
        self.stops[i] = {"asked": time.monotonic(), "stopped": None, "kills": self.faults["kills"], "epoch": epoch,
                         "withheld": withheld, "polled": 0.0}
        self.ctl.stall_grants[i] = 0
        self.ctl.stall[i] = 1
        self.faults["client_stops"] += 1

    def tend_stops(self) -> None:
        """Resume each stopped client whose grants the daemon has withheld (expired: counted in
        ``grants_withheld``, grants expire between the TTL and 1.25 TTL after the Allocate, later
        on a busy daemon), or whose daemon was killed meanwhile; a client that never reached a
        put within ``STOP_S`` is let go, and one whose grants were not withheld ``STOP_S`` past
        the TTL is resumed and reported."""
        now = time.monotonic()
        for i, s in list(self.stops.items()):
            if s["stopped"] is None:
                if self.ctl.stall[i] == 2:
                    s["stopped"] = now
                elif now - s["asked"] > STOP_S:
                    self.ctl.stall[i] = 0
                    del self.stops[i]
                continue
            if self.faults["kills"] != s["kills"]:  # its put is retried on the new daemon: nothing late to see
                self.faults["client_stops_across_kill"] = self.faults.get("client_stops_across_kill", 0) + 1
                self.ctl.stall[i] = 4
            elif now - s["stopped"] < self.ns.grant_ttl_s or now - s["polled"] < 0.1:
                continue
            elif now - s["stopped"] > self.ns.grant_ttl_s + STOP_S:
                self.finding(f"client {i}'s {self.ctl.stall_grants[i]} grants were not withheld "
                             f"{self.ns.grant_ttl_s + STOP_S:g} s after it stopped")
            else:
                s["polled"] = now
                epoch, withheld = self.grants_withheld()
                if epoch == s["epoch"] and withheld < s["withheld"] + self.ctl.stall_grants[i]:
                    continue
            del self.stops[i]
            p = self.procs[i]
            if p is not None and p.is_alive():
                os.kill(p.pid, signal.SIGCONT)

    def stopped(self) -> list[int]:
        """The clients stopped inside a put (resumed ones until they run again)."""
        return [i for i, p in enumerate(self.procs) if p is not None and p.is_alive() and self.ctl.stall[i] == 2]

    def wait_ready(self) -> None:
        """Until every client's first operation went through (on a busy machine clients start
        slowly; the run's clock and its faults start once they all run), at most ``READY_S``."""
        deadline = time.monotonic() + READY_S
        while True:
            late = [i for i in range(self.ns.clients) if not self.ctl.ready[i]]
            if not late or time.monotonic() >= deadline:
                break
            self.restart_exited()
            time.sleep(0.05)
        if late:
            self.finding(f"clients {late[:8]} had run no operation {READY_S:g} s after they started")

    def short_of_ops(self, now: float) -> bool:
        """Past ``--duration``: whether the clients' tallies (flushed every second) still show
        fewer than ``--min-ops`` ops or blocks verified, for at most ``STRETCH`` x ``--duration``
        more."""
        ns = self.ns
        if not ns.min_ops or now >= ns.duration * (1 + STRETCH):
            return False
        if now < self.tallied_at + 1.0:
            return True
        self.tallied_at = now
        hist, _, counts = self.merged()
        ops = sum(int(h.sum()) for h in hist.values())
        return ops < ns.min_ops or counts.get("blocks_verified", 0) < ns.min_ops

    def sample(self) -> None:
        if self.daemon.proc is None:
            return
        pid = self.daemon.pid
        self.samples.append((time.monotonic(), proc_status(pid, "RssAnon"), proc_status(pid, "VmRSS"), fd_count(pid)))

    # -- the run --------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        d, ns = self.ns.duration, self.ns
        ev = [(self.rng.uniform(0.1, 0.6) * d, "kill") for _ in range(ns.kills)]
        ev += [(0.25 * d, "fill"), (0.25 * d + ns.fill_s, "unfill")]
        ev += [(0.45 * d, "slow"), (0.45 * d + ns.slow_s, "unslow")]
        nck = max(1, int(d / 10))
        ev += [(self.rng.uniform(0.05, 0.9) * d, "kill_client") for _ in range(nck)]
        stops = max(1, int(d / 40)) if ns.client_stops < 0 else ns.client_stops
        ev += [(self.rng.uniform(0.1, 0.8) * d, "stop_client") for _ in range(stops)]
        t = ns.check_s
        while t < d:
            ev.append((t, "check"))
            t += ns.check_s
        return sorted(ev)

    def fill(self) -> None:
        self.faults["disk_fill"] = self.disk.fill()

    def slow(self) -> None:
        self.noisy = NoisyNeighbour(self.disk.dir)

    def unslow(self) -> None:
        if self.noisy is not None:
            mib = self.noisy.close() >> 20
            self.faults["slow_disk"] = f"noisy neighbour wrote {mib} MiB with O_DIRECT|O_DSYNC in {self.ns.slow_s} s"
            self.noisy = None

    def restart_exited(self) -> None:
        """A client that died by itself is started again (and counted)."""
        for i, p in enumerate(self.procs):
            if p is not None and not p.is_alive() and self.ctl.stall[i] != 2:
                self.gens[i] += 1
                self.faults["client_exits"] = self.faults.get("client_exits", 0) + 1
                self.start_client(i)
        for j, p in enumerate(self.attackers):
            if p is not None and not p.is_alive() and not self.ctl.stop.is_set():
                self.attacker_gens[j] += 1
                self.faults["attacker_exits"] = self.faults.get("attacker_exits", 0) + 1
                self.start_attacker(j)

    def stop_all(self) -> None:
        self.ctl.stop.set()
        for i, p in enumerate(self.procs):
            if p is not None and self.ctl.stall[i] == 2:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
        for p in self.procs + self.attackers:
            if p is not None:
                p.join(15)
                if p.is_alive():
                    p.kill()
                    p.join(5)

    def run(self) -> dict:
        ns = self.ns
        self.start_daemon()
        for i in range(ns.clients):
            self.start_client(i)
        self.wait_ready()
        for j in range(ns.attackers):
            self.start_attacker(j)
        t0 = time.monotonic()
        actions: dict[str, Callable[[], None]] = {
            "kill": self.kill_daemon, "fill": self.fill, "unfill": self.disk.unfill, "slow": self.slow,
            "unslow": self.unslow, "kill_client": self.kill_client, "stop_client": self.stop_client,
            "check": self.full_check}
        events = self.schedule()
        next_sample = 0.0
        try:
            while (now := time.monotonic() - t0) < ns.duration or self.short_of_ops(now):
                if now >= next_sample:
                    self.sample()
                    next_sample = now + 1.0
                while events and events[0][0] <= now:
                    actions[events.pop(0)[1]]()
                self.tend_stops()
                self.restart_exited()
                time.sleep(0.05)
            self.disk.unfill()
            self.unslow()
            deadline = time.monotonic() + ns.grant_ttl_s + 2 * STOP_S
            while (self.stops or self.stopped()) and time.monotonic() < deadline:
                self.tend_stops()  # the final check sees no client stopped (its accounting is not skipped)
                time.sleep(0.05)
            self.full_check(final=True)
            self.sample()
        finally:
            self.stop_all()
        return self.summarise(time.monotonic() - t0)

    def merged(self) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, int]]:
        """Every client's tallies added up: latency histograms, errors by code, counts."""
        hist: dict[str, np.ndarray] = {}
        errors: dict[str, int] = {}
        counts: dict[str, int] = {}
        for path in glob.glob(os.path.join(self.work, "client-*.json")):
            with open(path) as fh:
                t = json.load(fh)
            for k, v in t["hist"].items():
                hist[k] = hist.get(k, 0) + np.array(v)
            for k, v in t["errors"].items():
                errors[k] = errors.get(k, 0) + v
            for k, v in t["counts"].items():
                counts[k] = counts.get(k, 0) + v
        return hist, errors, counts

    def logged_findings(self) -> None:
        for name, prefix in (("corrupt.log", "served corrupt: "), ("stall.log", "stopped "),
                             ("client-crash.log", "")):
            path = os.path.join(self.work, name)
            if os.path.exists(path):
                with open(path) as fh:
                    for line in fh.readlines()[:5]:
                        self.finding(prefix + line.strip())

    def summarise(self, elapsed: float) -> dict:
        ns = self.ns
        hist, errors, counts = self.merged()
        p50, p99, ops_by = {}, {}, {}
        upper = np.append(BOUNDS, BOUNDS[-1])
        for op, h in sorted(hist.items()):
            n = int(h.sum())
            ops_by[op] = n
            cum = np.cumsum(h)
            p50[op] = round(float(upper[np.searchsorted(cum, 0.5 * n)]) * 1e3, 3)
            p99[op] = round(float(upper[np.searchsorted(cum, 0.99 * n)]) * 1e3, 3)
        # memory of the last incarnation, after its warm-up (a quarter of its life)
        last = [s for s in self.samples if s[0] >= self.last_start]
        rss_growth = None
        if len(last) >= 4:
            warm = last[len(last) // 4]
            rss_growth = round((last[-1][1] - warm[1]) / max(1, warm[1]), 4)
        self.logged_findings()
        r = self.report
        result = {
            "ops": int(sum(ops_by.values())), "ops_by": ops_by,
            "blocks_verified": counts.get("blocks_verified", 0) + r.get("sweep_verified", 0),
            "kills": self.faults["kills"], "lost_durable": r["lost_durable"],
            "durable_acked": len(self.acked()), "durable_checked": r["durable_checked"],
            "corrupt_served": counts.get("corrupt_served", 0) + r["corrupt_served_sweep"],
            "accounting_errors": r["accounting_errors"], "leaked_files": r["leaked_files"],
            "rss_growth": rss_growth, "fd_growth": r["fd_growth"],
            "rss_anon_mib": [round(s[1] / 2**20, 1) for s in self.samples[:: max(1, len(self.samples) // 24)]],
            "fds": [s[3] for s in self.samples[:: max(1, len(self.samples) // 24)]],
            "p50_ms": p50, "p99_ms": p99, "errors": errors,
            "late_commit_refused": counts.get("late_commit_refused", 0),
            "late_commit_accepted": counts.get("late_commit_accepted", 0),
            "feed_replies": counts.get("feed_replies", 0), "feed_resubscribes": counts.get("feed_resubscribes", 0),
            "faults": self.faults, "disk_mount": self.disk.how, "checks": r["checks"], "findings": r["findings"],
            "elapsed_s": round(elapsed, 1),
            "params": {"clients": ns.clients, "duration_s": ns.duration, "block_kib": ns.block_kib,
                       "host_mib": ns.host_mib, "disk_mib": ns.disk_mib, "shared_keys": ns.shared_keys,
                       "transfer_clients": ns.transfer_clients, "subscribers": ns.subscribers, "seed": ns.seed},
        }
        if ns.attackers:
            result.update(self.hostile_summary(hist, errors, counts))
        return result

    def victim_p99_ms(self, hist: dict[str, np.ndarray]) -> float:
        """The normal clients' p99 latency over all their ops, ms."""
        total = sum(hist.values()) if hist else np.zeros(len(BOUNDS) + 1, dtype=np.int64)
        cum = np.cumsum(total)
        return round(float(np.append(BOUNDS, BOUNDS[-1])[np.searchsorted(cum, 0.99 * cum[-1])]) * 1e3, 3)

    def hostile_summary(self, hist: dict[str, np.ndarray], errors: dict[str, int], counts: dict[str, int]) -> dict:
        """The attackers' tallies, and what the normal clients saw beyond what the soak's own
        faults answer them (:data:`TOLERATED`): other codes, refusals naming a budget
        (:data:`BUDGET_FLAGS`), clients that crashed."""
        ops, refusals, attacker_errors = 0, {}, {}
        for path in glob.glob(os.path.join(self.work, "attacker-*.json")):
            with open(path) as fh:
                t = json.load(fh)
            ops += t["ops"]
            for k, v in t["refusals"].items():
                refusals[k] = refusals.get(k, 0) + v
            for k, v in t["errors"].items():
                attacker_errors[k] = attacker_errors.get(k, 0) + v
        crashes = 0
        with contextlib.suppress(FileNotFoundError), open(os.path.join(self.work, "client-crash.log")) as fh:
            crashes = sum(1 for _ in fh)
        victim_errors = sum(v for k, v in errors.items() if k not in TOLERATED) + counts.get("budget_refused", 0)
        return {"attackers": self.ns.attackers, "attacker_ops": ops, "attacker_answers": refusals,
                "attacker_errors": attacker_errors, "attacker_uids": os.geteuid() == 0,
                "victim_errors": victim_errors + crashes, "victim_p99_ms": self.victim_p99_ms(hist)}

    def close(self) -> None:
        if self.sc is not None:
            with contextlib.suppress(Exception):
                self.sc.close()
        self.daemon.cleanup()
        self.disk.close()
        shutil.rmtree(self.shm, ignore_errors=True)
        if not self.ns.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, help="client processes in all (default 64)")
    ap.add_argument("--transfer-clients", type=int, default=4, help="of them, offload/onboard engines (torch)")
    ap.add_argument("--subscribers", type=int, default=4, help="of them, feed subscribers (one stops reading)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds (default 120)")
    ap.add_argument("--kills", type=int, default=0, help="kill -9 of the daemon, at random points")
    ap.add_argument("--block-kib", type=int, default=16, help="block size, KiB (a multiple of 4)")
    ap.add_argument("--host-mib", type=int, default=48)
    ap.add_argument("--disk-mib", type=int, default=64, help="--disk-capacity of the daemon")
    ap.add_argument("--disk-fs-mib", type=int, default=160, help="size of the filesystem the disk tier lives on")
    ap.add_argument("--shared-keys", type=int, default=4096, help="key space of the plain puts and gets")
    ap.add_argument("--durable-per-client", type=int, default=40, help="durable keys per client (fit on disk)")
    ap.add_argument("--grant-ttl-s", type=float, default=2.0)
    ap.add_argument("--min-ops", type=int, default=0,
                    help="go on past --duration until the clients did this many ops and verified this many "
                         f"blocks (a busy machine makes a slower run, not a smaller one), at most {STRETCH} x "
                         "--duration more (default 0: stop at --duration)")
    ap.add_argument("--client-stops", type=int, default=-1,
                    help="clients stopped inside a put until their grants expire (default: one per 40 s)")
    ap.add_argument("--demote-min-seen", type=int, default=1_000_000,
                    help="host victims seen this often are demoted beyond the write queue's room (default: none)")
    ap.add_argument("--event-log-keys", type=int, default=65536)
    ap.add_argument("--check-s", type=float, default=15.0, help="a full check (clients paused) this often")
    ap.add_argument("--fill-s", type=float, default=8.0, help="seconds the disk stays full")
    ap.add_argument("--slow-s", type=float, default=8.0, help="seconds the disk stays slow")
    ap.add_argument("--stuck-s", type=float, default=15.0, help="seconds a subscriber stops reading")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--attackers", type=int, default=0,
                    help="hostile client processes beside the normal ones (bench/soak_attackers.py); > 0 runs "
                         "the soak twice, each --duration: quiet first (victim_p99_ms_quiet), then attacked")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print it")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ns = ap.parse_args(argv)
    if ns.block_kib % 4:
        ap.error("--block-kib must be a multiple of 4")
    if ns.subscribers + ns.transfer_clients >= ns.clients:
        ap.error("--clients must exceed --subscribers + --transfer-clients")
    if ns.clients * ns.durable_per_client * ns.block_kib > ns.disk_mib * 1024 * 0.8:
        ap.error("durable keys would not fit in 80 % of --disk-mib: lower --durable-per-client")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    sys.path.insert(0, HERE)
    from _report import emit

    quiet: dict | None = None
    if ns.attackers:
        h = Harness(argparse.Namespace(**{**vars(ns), "attackers": 0}), hostile=True)
        try:
            quiet = h.run()
            quiet["victim_p99_ms"] = h.victim_p99_ms(h.merged()[0])
        finally:
            h.close()
    h = Harness(ns, hostile=bool(ns.attackers))
    try:
        result = h.run()
    finally:
        h.close()
    if quiet is not None:
        result["victim_p99_ms_quiet"] = quiet["victim_p99_ms"]
        result["quiet_phase"] = {k: quiet[k] for k in ("ops", "kills", "lost_durable", "corrupt_served",
                                                       "accounting_errors", "leaked_files", "fd_growth", "errors",
                                                       "findings")}
        goal = {"victim_errors == 0": result["victim_errors"] == 0,
                "victim_p99_ms <= 2 x quiet": result["victim_p99_ms"] <= 2 * quiet["victim_p99_ms"],
                "zeros": all(result[k] == 0 and quiet[k] == 0 for k in
                             ("lost_durable", "corrupt_served", "accounting_errors", "leaked_files", "fd_growth"))}
        print("goal: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goal.items()), file=sys.stderr)
    if ns.keep:
        result["work_dir"] = h.base
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

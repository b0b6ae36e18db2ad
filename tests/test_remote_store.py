"""The shared store (a real Redis Cluster over mutual TLS with ACLs, and a
real Mooncake Store; real daemons). The sharing, tenant, corruption and in-process tests run
over both backends (``shared``, a module fixture per backend); the Mooncake ones skip, saying
why, where its wheel is not installed (``pip install 'kvtier[mooncake]'``).

Two daemons that share only the Redis Cluster serve each other's blocks byte-exact (A puts,
A writes them behind, B's get reads them through); another tenant cannot read them; a value
corrupted in Redis is a counted miss; a Redis master killed mid-run gives misses and counters,
no crash, and the daemons keep serving host. In-process: the feed's remote tier (published on
write, removed when the TTL lapses), write-behind on demotion, a full queue dropping writes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest
from mooncake_master import MooncakeMaster, mooncake_fixture
from redis_cluster import REDIS_CLI, RedisCluster, cluster_fixture

from kvtier.client.engine.sidecar import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess, shm_tempdir
from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.counters import Count
from kvtier.daemon.layouts import tenant_fingerprint
from kvtier.daemon.mooncake_store import EXPIRY, PREFIX_BYTES, MooncakeBackend
from kvtier.daemon.remote_store import RedisBackend, RemoteStore, Transport, parse_nodes, redis_key
from kvtier.daemon.store import BlockStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import Tier

BLOCK = 64 * 1024
LAYOUT = Layout.flat(BLOCK)
FP = LAYOUT.fingerprint
NS = "t13"


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode().ljust(16, b".") for i in range(n)]


def payload(k: bytes) -> bytes:
    return (k * (BLOCK // len(k) + 1))[:BLOCK]


def counters(sc: Sidecar) -> dict[str, int]:
    return {k: v for k, v in sc.stats()["counters"].items() if k.startswith("store_")}


def wait_for(cond, timeout: float = 10.0, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shared:
    """The store under test: a Redis Cluster (TLS only, ACLs) or a Mooncake master, and a raw
    client of it (not kvtier's) for the tests' own reads and writes."""

    def __init__(self, kind: str, cluster: RedisCluster | None = None, master: MooncakeMaster | None = None) -> None:
        self.kind, self.cluster, self.master = kind, cluster, master
        self._raw = None

    def daemon_args(self) -> tuple[str, ...]:
        return self.cluster.daemon_args() if self.cluster else self.master.daemon_args()

    def backend(self):  # noqa: ANN201
        if self.cluster:
            return backend_of(self.cluster)
        m = self.master
        return MooncakeBackend(m.master, m.metadata, segment_bytes=64 * 1024**2, buffer_bytes=32 * 1024**2)

    def raw(self):  # noqa: ANN201
        if self._raw is None:
            self._raw = self.cluster.client() if self.cluster else self.master.client()
        return self._raw

    def raw_get(self, name: str) -> bytes:
        """The value (header and payload) kvtier stored under ``name``."""
        v = self.raw().get(name)
        return v if self.cluster else v[PREFIX_BYTES:]

    def raw_set(self, name: str, value: bytes) -> None:
        if self.cluster:
            corrupt(self.cluster, name, value)   # with redis-cli
        else:
            assert self.raw().upsert(name, EXPIRY.pack(int(time.time() * 1000) + 60_000) + value) == 0

    def ttl_ms(self, name: str) -> int:
        if self.cluster:
            return self.raw().pttl(name)
        return EXPIRY.unpack_from(self.raw().get(name), 0)[0] - int(time.time() * 1000)

    def close(self) -> None:
        if self._raw is not None and self.cluster:
            self._raw.close()


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def shared(request) -> Iterator[Shared]:  # noqa: ANN001
    if request.param == "redis":
        for cluster in cluster_fixture():
            s = Shared("redis", cluster=cluster)
            yield s
            s.close()
    else:
        for master in mooncake_fixture():
            yield Shared("mooncake", master=master)


@pytest.fixture(scope="module")
def daemons(shared) -> Iterator[tuple[DaemonProcess, DaemonProcess, DaemonProcess]]:
    """A and B: the default tenant; C: this user is tenant "bob". They share only the store."""
    work = tempfile.mkdtemp(prefix="kvtier-store-")
    store = (*shared.daemon_args(), "--store-namespace", NS)
    me = os.getuid()
    procs = [DaemonProcess(work, *store, "--metrics-port", str(free_port()), name="a"),
             DaemonProcess(work, *store, name="b"),
             DaemonProcess(work, *store, "--allowed-uids", str(me), "--tenants", f"{me}=bob", name="c")]
    try:
        for p in procs:
            p.start()
        yield procs[0], procs[1], procs[2]
    finally:
        for p in procs:
            p.stop()
            p.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def put_written(sc: Sidecar, lid: int, keys: list[bytes]) -> None:
    """Put on a daemon and wait until its writer has written them behind."""
    before = counters(sc)["store_writes"]
    assert sc.put(lid, keys, [payload(k) for k in keys]).stored == len(keys)
    wait_for(lambda: counters(sc)["store_writes"] >= before + len(keys), what="the write-behind")


def test_two_daemons_share_blocks_through_the_store(daemons, shared):
    a, b, _ = daemons
    keys = keys_of("share", 8)
    with Sidecar(a.socket) as sa, Sidecar(b.socket) as sb:
        la, lb = sa.register_layout(LAYOUT), sb.register_layout(LAYOUT)
        put_written(sa, la, keys)
        assert sb.lookup(lb, keys) == [None] * len(keys)   # B never met A: nothing local
        got = sb.get(lb, keys)
        assert [bytes(g) if g is not None else None for g in got] == [payload(k) for k in keys]
        cb = counters(sb)
        assert cb["store_reads"] == len(keys) and cb["store_read_bytes"] == len(keys) * BLOCK
        assert sb.lookup(lb, keys) == ["host"] * len(keys)  # read through into B's host tier
        hits = sb.stats()["counters"]
        assert hits.get("acquire_hits_remote", len(keys)) == len(keys)
        # a key nobody put: a miss, asked of the store
        assert sb.get(lb, keys_of("nobody", 1)) == [None]
        assert counters(sb)["store_misses"] == 1
    # in the store under the tenant-scoped name, with its TTL
    name = redis_key(NS, FP + keys[0])
    assert name == f"kvtier:{NS}:{FP.hex()}:{keys[0].hex()}"
    assert shared.raw_get(name)[32:] == payload(keys[0])
    assert 0 < shared.ttl_ms(name) <= 3600 * 1000
    # every store counter reaches /metrics
    port = int(a.args[a.args.index("--metrics-port") + 1])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for c in Count:
        if c.value.startswith("store_"):
            assert f"kvtier_{c.value}_total" in text, c
    assert any(line.startswith("kvtier_store_writes_total") and float(line.split()[-1]) >= len(keys)
               for line in text.splitlines())


def test_tenant_b_cannot_read_tenant_a_blocks_through_the_store(daemons):
    a, _, c = daemons
    keys = keys_of("tenant", 4)
    with Sidecar(a.socket) as sa, Sidecar(c.socket) as sc:
        la, lc = sa.register_layout(LAYOUT), sc.register_layout(LAYOUT)
        put_written(sa, la, keys)
        assert sc.get(lc, keys) == [None] * len(keys)
        cc = counters(sc)
        assert cc["store_reads"] == 0 and cc["store_misses"] == len(keys)  # another tenant's names
        # bob's own blocks do go through the store: the same keys, bob's tenant fingerprint
        put_written(sc, lc, keys)
    assert tenant_fingerprint("bob", FP) != FP


def corrupt(cluster: RedisCluster, name: str, value: bytes) -> None:
    """Overwrite a value in Redis with redis-cli (-c follows the slot's redirect)."""
    assert REDIS_CLI is not None
    out = subprocess.run([*cluster.cli_args(), "-c", "-p", str(cluster.port_of(name)), "-x", "set", name],
                         input=value, capture_output=True, timeout=10)
    assert out.stdout.strip() == b"OK", out


def test_corrupted_value_in_the_store_is_a_counted_miss(daemons, shared):
    a, b, _ = daemons
    keys = keys_of("corrupt", 3)
    with Sidecar(a.socket) as sa, Sidecar(b.socket) as sb:
        la, lb = sa.register_layout(LAYOUT), sb.register_layout(LAYOUT)
        put_written(sa, la, keys)
        good = [shared.raw_get(redis_key(NS, FP + k)) for k in keys]
        flipped = bytearray(good[0])
        flipped[-100] ^= 0x40
        shared.raw_set(redis_key(NS, FP + keys[0]), bytes(flipped))  # payload changed
        shared.raw_set(redis_key(NS, FP + keys[1]), good[2])          # another block's value
        before = counters(sb)
        got = sb.get(lb, keys)
        assert got[0] is None and got[1] is None and bytes(got[2]) == payload(keys[2])
        after = counters(sb)
        assert after["store_corrupt"] - before["store_corrupt"] == 2
        assert after["store_reads"] - before["store_reads"] == 1
        assert sb.lookup(lb, keys[:2]) == [None, None]   # never visible


def test_redis_node_killed_mid_run_gives_misses_and_counters(tmp_path):
    """Its own cluster (plaintext: --store-plaintext): one master is killed while both daemons serve."""
    if not REDIS_CLI:
        pytest.skip("redis-server is not installed")
    cluster = RedisCluster().start()
    work = str(tmp_path)
    # the dead master refuses at once; the deadline (the whole read's) only has to outlast the
    # client's remap of the cluster on a busy machine
    store = (*cluster.daemon_args(), "--store-namespace", NS, "--store-timeout-s", "5")
    a = DaemonProcess(work, *store, name="ka")
    b = DaemonProcess(work, *store, name="kb")
    try:
        a.start()
        b.start()
        keys = keys_of("killed", 24)
        with Sidecar(a.socket) as sa, Sidecar(b.socket) as sb:
            la, lb = sa.register_layout(LAYOUT), sb.register_layout(LAYOUT)
            put_written(sa, la, keys)
            dead = cluster.port_of(redis_key(NS, FP + keys[0]))
            on_dead = {k for k in keys if cluster.port_of(redis_key(NS, FP + k)) == dead}
            assert 0 < len(on_dead) < len(keys)
            cluster.kill(dead)
            got = sb.get(lb, keys)
            for k, g in zip(keys, got, strict=True):
                if k in on_dead:
                    assert g is None
                else:
                    assert g is not None and bytes(g) == payload(k)
            cb = counters(sb)
            assert cb["store_read_errors"] >= len(on_dead) and cb["store_reads"] == len(keys) - len(on_dead)
            # A keeps its host copies and keeps taking puts; writes to the dead node are counted
            assert [bytes(g) for g in sa.get(la, keys)] == [payload(k) for k in keys]
            more = keys_of("after", 24)
            assert sa.put(la, more, [payload(k) for k in more]).stored == len(more)
            wait_for(lambda: counters(sa)["store_write_errors"] > 0, what="a counted write error")
            assert [bytes(g) for g in sa.get(la, more)] == [payload(k) for k in more]
            # B serves its own host blocks, and asks the store again once its back-off passed
            own = keys_of("own", 4)
            assert sb.put(lb, own, [payload(k) for k in own]).stored == len(own)
            assert [bytes(g) for g in sb.get(lb, own)] == [payload(k) for k in own]
        assert a.stop() == 0 and b.stop() == 0
    finally:
        a.cleanup()
        b.cleanup()
        cluster.stop()


# -- in process: the feed's remote tier, demotion, a full queue ---------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Tier, bytes, list[bytes]]] = []

    def stored(self, tier, fingerprint, keys, worker=""):  # noqa: ANN001
        self.events.append(("stored", tier, fingerprint, list(keys)))

    def removed(self, tier, fingerprint, keys, worker=""):  # noqa: ANN001
        self.events.append(("removed", tier, fingerprint, list(keys)))

    def cleared(self, tier, worker="", gone=None):  # noqa: ANN001
        pass

    def workers_changed(self):
        pass

    def remote(self, kind: str) -> set[bytes]:
        return {k for e, t, _, ks in self.events if e == kind and t is Tier.REMOTE for k in ks}


def backend_of(cluster: RedisCluster) -> RedisBackend:
    kw = cluster.client_kwargs(admin=False)
    transport = Transport(kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"], kw["username"],
                          kw["password"]) if kw else Transport()
    return RedisBackend(parse_nodes(cluster.nodes), 2.0, transport)


def in_process(shared: Shared, body, *, write: str = "put", host_blocks: int = 8,  # noqa: ANN001
               queue_bytes: int = 64 * BLOCK, ttl_s: float = 60.0) -> None:

    async def main() -> None:
        store = BlockStore(HostTier(shm, host_blocks * BLOCK, "rs"), demote_min_seen=1)
        rec = Recorder()
        store.observers.add(rec)
        remote = RemoteStore(shared.backend(), store.tiers, store.counters,
                             store.observers, NS + write, ttl_s, write, True, 2.0, queue_bytes)
        store.remotes.append(remote)
        remote.start()
        try:
            lid = (await store.register_layout(LAYOUT)).layout_id
            sid = store.open_session("test", os.getpid()).session_id

            async def put(keys: list[bytes]) -> None:
                grants = await store.allocate(sid, lid, keys)
                cls = store.pool(LAYOUT)
                with open(cls.path, "r+b") as fh:
                    for k, g in zip(keys, grants, strict=True):
                        fh.seek(g.offset)
                        fh.write(payload(k))
                await store.commit(sid, [g.grant_id for g in grants], [], False)

            await body(store, remote, rec, put)
        finally:
            await remote.close()
            store.close()

    with shm_tempdir() as shm:
        asyncio.run(main())


def test_feed_shows_written_blocks_in_remote_until_their_ttl_lapses(shared):
    async def body(store, remote, rec, put):  # noqa: ANN001
        keys = keys_of("feed", 4)
        await put(keys)
        assert rec.remote("stored") == set()   # not before the write succeeded
        await remote.flush()
        assert rec.remote("stored") == set(keys)
        assert {(t, tuple(ks)) for t, _, ks in store.holdings() if t is Tier.REMOTE} == {(Tier.REMOTE, tuple(keys))}
        assert remote.expire(time.monotonic() + 61) == len(keys)
        assert rec.remote("removed") == set(keys) and store.counters[Count.STORE_EXPIRED] == len(keys)
        assert not [h for h in store.holdings() if h[0] is Tier.REMOTE]

    in_process(shared, body)


def test_demotion_mode_writes_host_victims_only(shared):
    async def body(store, remote, rec, put):  # noqa: ANN001
        keys = keys_of("demote", 6)
        await put(keys[:4])
        await remote.flush()
        assert store.counters[Count.STORE_WRITES] == 0    # a put alone writes nothing
        await put(keys[4:])                                 # host holds 4: two victims leave it
        await remote.flush()
        assert store.counters[Count.STORE_WRITES] == 2
        victims = rec.remote("stored")
        assert len(victims) == 2 and not any(store.tiers.in_host(FP + k) for k in victims)
        # a get reads them back through the store
        layout = next(iter(store.layouts)).layout
        found = await remote.fetch(DEFAULT_TENANT, layout, [FP + k for k in sorted(victims)])
        assert [bytes(p) for _, p, _ in found] == [payload(k) for k in sorted(victims)]

    in_process(shared, body, write="demotion", host_blocks=4)


def test_full_write_behind_queue_drops_and_counts(shared):
    async def body(store, remote, rec, put):  # noqa: ANN001
        keys = keys_of("full", 6)
        await put(keys)        # one commit: the queue takes two blocks, the rest are dropped
        await remote.flush()
        assert store.counters[Count.STORE_WRITES_DROPPED] == 4 and store.counters[Count.STORE_WRITES] == 2

    in_process(shared, body, queue_bytes=2 * BLOCK)


# -- the authenticated transport: mutual TLS and ACLs ----------------------------------------


def test_daemon_without_the_client_certificate_or_password_gets_no_blocks(daemons, shared, tmp_path):
    """The cluster asks for a client certificate signed by its CA and an ACL password: a daemon
    with no certificate reads nothing (clean, counted misses) and keeps serving its own blocks;
    a store with a certificate of another CA or a wrong password reads nothing either."""
    if shared.cluster is None:
        pytest.skip("Redis's TLS and ACLs (Mooncake has neither: --store-plaintext)")
    redis_cluster = shared.cluster
    a = daemons[0]
    keys = keys_of("authn", 4)
    with Sidecar(a.socket) as sa:
        put_written(sa, sa.register_layout(LAYOUT), keys)
    d = DaemonProcess(str(tmp_path), *redis_cluster.daemon_args(client=None), "--store-namespace", NS,
                      "--store-timeout-s", "1", name="nocert")
    try:
        d.start()
        with Sidecar(d.socket) as sd:
            lid = sd.register_layout(LAYOUT)
            assert sd.get(lid, keys) == [None] * len(keys)
            c = counters(sd)
            assert c["store_reads"] == 0 and c["store_read_errors"] == len(keys), c
            assert sd.put(lid, keys[:1], [payload(keys[0])]).stored == 1   # its own host still works
            assert bytes(sd.get(lid, keys[:1])[0]) == payload(keys[0])
        assert d.stop() == 0
    finally:
        d.cleanup()
    kw = redis_cluster.client_kwargs(admin=False)
    good = Transport(kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"], kw["username"], kw["password"])
    stranger = Transport(good.ca, redis_cluster.file("stranger.pem"), redis_cluster.file("stranger.key"),
                         good.user, good.password)
    names = [redis_key(NS, FP + k) for k in keys]
    for transport, ok in ((good, True), (stranger, False), (replace(good, password="wrong"), False),
                          (replace(good, user="default"), False)):
        backend = RedisBackend(parse_nodes(redis_cluster.nodes), 1.0, transport)
        try:
            got = backend.get_many(names)
        finally:
            backend.close()
        if ok:
            assert all(isinstance(g, bytes) for g in got)
        else:
            assert all(isinstance(g, Exception) for g in got), (transport, got)


def test_password_file_group_or_others_can_read_is_refused(shared, tmp_path):
    if shared.cluster is None:
        pytest.skip("Redis's ACL password")
    redis_cluster = shared.cluster
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    pw.chmod(0o640)
    args = [*redis_cluster.daemon_args(), "--store-password-file", str(pw)]
    d = DaemonProcess(str(tmp_path), *args, name="pwmode")
    try:
        with pytest.raises(RuntimeError, match=r"store-password-file .* mode 0640"):
            d.start()
    finally:
        d.cleanup()


def test_store_settings_refuse_plaintext_unless_asked(tmp_path):
    from kvtier.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="--store-redis needs TLS"):
        load_config(["--store-redis", "127.0.0.1:7000"], env={})
    assert load_config(["--store-redis", "127.0.0.1:7000", "--store-plaintext"], env={}).store_plaintext
    with pytest.raises(ConfigError, match="contradict"):
        load_config(["--store-redis", "127.0.0.1:7000", "--store-plaintext", "--store-tls-ca", "x"], env={})
    with pytest.raises(ConfigError, match="--store-tls-cert and --store-tls-key go together"):
        load_config(["--store-redis", "127.0.0.1:7000", "--store-tls-ca", "ca", "--store-tls-cert", "c"], env={})
    with pytest.raises(ConfigError, match="--store-user needs --store-password-file"):
        load_config(["--store-redis", "127.0.0.1:7000", "--store-tls-ca", "ca", "--store-user", "u"], env={})
    with pytest.raises(ConfigError, match="no TLS"):
        load_config(["--store-backend", "mooncake", "--store-mooncake-master", "127.0.0.1:1",
                     "--store-mooncake-metadata", "P2PHANDSHAKE"], env={})


def test_mooncake_master_killed_gives_counted_errors_and_no_crash():
    """Its own master: killed after a write, a fetch answers misses counted as read errors
    and a write is a counted write error; nothing raises."""
    fixture = mooncake_fixture()
    master = next(fixture)  # skips where Mooncake is not installed
    try:
        async def body(store, remote, rec, put):  # noqa: ANN001
            keys = keys_of("mcdead", 4)
            await put(keys)
            await remote.flush()
            assert store.counters[Count.STORE_WRITES] == len(keys)
            layout = next(iter(store.layouts)).layout
            found = await remote.fetch(DEFAULT_TENANT, layout, [FP + k for k in keys])
            assert [bytes(p) for _, p, _ in found] == [payload(k) for k in keys]
            master.kill()
            assert await remote.fetch(DEFAULT_TENANT, layout, [FP + k for k in keys]) == []
            assert store.counters[Count.STORE_READ_ERRORS] == len(keys) and store.counters[Count.STORE_READS] == 4
            remote._skip_until = 0.0   # past the back-off: the writer tries, and fails cleanly
            await put(keys_of("mcdead2", 2))
            await remote.flush()
            assert store.counters[Count.STORE_WRITE_ERRORS] == 2

        in_process(Shared("mooncake", master=master), body, ttl_s=60.0)
    finally:
        fixture.close()   # stops the master


def test_a_value_past_its_ttl_is_a_miss(shared):
    """Redis expires it (PX); Mooncake's values carry their expiry, checked on every get."""
    async def body(store, remote, rec, put):  # noqa: ANN001
        keys = keys_of("ttl", 2)
        await put(keys)
        await remote.flush()
        assert store.counters[Count.STORE_WRITES] == len(keys)
        await asyncio.sleep(0.4)
        layout = next(iter(store.layouts)).layout
        assert await remote.fetch(DEFAULT_TENANT, layout, [FP + k for k in keys]) == []
        assert store.counters[Count.STORE_MISSES] == len(keys) and store.counters[Count.STORE_READ_ERRORS] == 0

    in_process(shared, body, ttl_s=0.3)


class _BrokenBackend:
    """A store client that fails as a buggy or broken one can: a short answer, or an error
    of its own (not a connection error)."""

    name = "broken"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def put_many(self, items, ttl_s):
        return [False] * len(items)

    def get_many(self, names, value_bytes=0):
        if self.mode == "short":
            return [None] * (len(names) - 1)
        raise RuntimeError("the client library failed (injected)")

    def close(self):
        pass


@pytest.mark.parametrize("mode", ["short", "raises"])
def test_a_store_read_that_fails_oddly_gives_counted_misses(mode) -> None:
    """Whatever the store's client does on a read (answers fewer values than names, raises
    something of its own), a get misses those blocks and counts read errors; it never fails."""
    from kvtier.daemon.remote_store import RemoteStore
    from kvtier.daemon.store import BlockStore
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.layout import Layout

    async def body(shm: str) -> None:
        store = BlockStore(HostTier(shm, 4 * 8192, "rs"))
        rs = RemoteStore(_BrokenBackend(mode), store.tiers, store.counters, store.observers, "ns", 60, "off",
                         True, 2.0)
        store.remotes.append(rs)
        lid = (await store.register_layout(Layout.flat(8192))).layout_id
        sid = store.open_session("t", os.getpid()).session_id
        leases = await store.acquire(sid, lid, [bytes(16), b"\1" * 16])
        assert not any(x.hit for x in leases)
        assert store.counters[Count.STORE_READ_ERRORS] == 2
        await rs.close()
        store.close()

    with shm_tempdir() as shm:
        asyncio.run(body(shm))


class _DictBackend:
    """An in-memory store client (the store's contract: names to values, a TTL ignored)."""

    name = "dict"

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.puts: list[str] = []

    def put_many(self, items, ttl_s):
        for n, v in items:
            self.values[n] = bytes(v)
            self.puts.append(n)
        return [True] * len(items)

    def get_many(self, names, value_bytes=0):
        return [self.values.get(n) for n in names]

    def close(self):
        pass


def test_blocks_read_through_from_the_store_are_not_written_back_when_host_evicts_them() -> None:
    """--store-write demotion writes host victims to the store; a block that came from the
    store (or a peer) is not this daemon's write: evicting it must not write it back (its
    TTL renewed for as long as it cycles, published as this node's)."""
    from kvtier.daemon.remote_store import RemoteStore, encode, redis_key
    from kvtier.daemon.store import BlockStore
    from kvtier.tiers.host import HostTier, payload_checksum
    from kvtier.tiers.layout import Layout

    block, layout = 8192, Layout.flat(8192)

    def k(i: int) -> bytes:
        return i.to_bytes(4, "big") * 4

    async def body(shm: str) -> None:
        store = BlockStore(HostTier(shm, 4 * block, "wb"), demote_min_seen=1)
        be = _DictBackend()
        rs = RemoteStore(be, store.tiers, store.counters, store.observers, "ns", 60, "demotion", True, 2.0,
                         64 * block)
        store.remotes.append(rs)
        rs.start()
        lid = (await store.register_layout(layout)).layout_id
        sid = store.open_session("t", os.getpid()).session_id
        for i in range(1, 9):  # another daemon wrote these
            p = bytes([i]) * block
            be.values[redis_key("ns", layout.fingerprint + k(i))] = bytes(
                encode(layout.fingerprint + k(i), p, payload_checksum(p)))
        for first in (1, 5):  # read through 4, then 4 more, which evict the first 4
            leases = await store.acquire(sid, lid, [k(i) for i in range(first, first + 4)])
            assert all(x.hit for x in leases)
            store.release(sid, [x.lease_id for x in leases])
        await rs.flush()
        assert be.puts == [] and store.counters[Count.STORE_WRITES] == 0
        await rs.close()
        store.close()

    with shm_tempdir() as shm:
        asyncio.run(body(shm))

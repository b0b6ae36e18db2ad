"""Peer fetch throughput against a raw socket stream of the same bytes, same run.

Starts two real kvtierds on loopback with mutual TLS (one test CA, made with openssl): ``A``
serves peers (``--peer-serve``), ``C`` fetches from it (``--peers``). Puts ``--blocks`` blocks
of ``--block-mib`` MiB on A, then times ``Sidecar.prefetch(keys, from_node=A)`` on C: A reads
the payloads from its host tier (verified), streams them in chunks over TLS, C reassembles
them, checks each block's xxh3 and puts it into its host tier. Each round evicts them from C
first; the best of ``--rounds`` is kept.

The limit, in the same run: the same bytes sent over one loopback TCP connection from another
process into a receiving buffer, with TLS (the same certificates and OpenSSL, so like is
compared with like: ``tcp_gbps``, and ``ratio`` = peer/tcp) and without (``tcp_plain_gbps``,
``ratio_plain``).

The store half (``store_*``, ``redis_raw_gbps``, ``store_ratio``) comes from
bench/_store_bench.py's ``store_figures()`` when that file is present.

    python bench/peer.py [--blocks 64] [--block-mib 2] [--rounds 3] [--out FILE.json]

Last line of stdout: one JSON object.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import emit  # bench/_report.py (scripts run from bench/)

from kvtier.client import Sidecar
from kvtier.client.tools.local_daemon import DaemonProcess
from kvtier.tiers.layout import Layout


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> None:
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=bench-ca")
    for name in ("node-a", "node-c"):
        _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the raw stream: a sender process, this one receives -------------------------------------------

def _sender(port: int, total: int, chunk: int, pki: str | None, ready) -> None:
    payload = os.urandom(chunk)
    srv = socket.create_server(("127.0.0.1", port))
    ready.set()
    conn, _ = srv.accept()
    if pki:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{pki}/node-a.pem", f"{pki}/node-a.key")
        ctx.load_verify_locations(f"{pki}/ca.pem")
        ctx.verify_mode = ssl.CERT_REQUIRED
        conn = ctx.wrap_socket(conn, server_side=True)
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        conn.sendall(payload[:n])
        sent += n
    conn.recv(1)  # the receiver's "done"
    conn.close()
    srv.close()


def raw_stream_gbps(total: int, chunk: int, pki: str | None) -> float:
    """``total`` bytes over one loopback TCP connection from another process (TLS with the
    bench's certificates when ``pki``), received into a buffer; 10^9 B/s."""
    port = free_port()
    ctx_mp = mp.get_context("spawn")
    ready = ctx_mp.Event()
    p = ctx_mp.Process(target=_sender, args=(port, total, chunk, pki, ready))
    p.start()
    ready.wait(30)
    sock = socket.create_connection(("127.0.0.1", port))
    if pki:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(f"{pki}/ca.pem")
        ctx.load_cert_chain(f"{pki}/node-c.pem", f"{pki}/node-c.key")
        sock = ctx.wrap_socket(sock, server_hostname="localhost")
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    while got < total:
        n = sock.recv_into(view, min(chunk, total - got))
        if not n:
            raise RuntimeError("the sender closed early")
        got += n
    dt = time.perf_counter() - t0
    sock.sendall(b"x")
    sock.close()
    p.join(30)
    return total / dt / 1e9


# -- the peer fetch --------------------------------------------------------------------------------

def peer_gbps(work: str, pki: Path, blocks: int, block: int, rounds: int, chunk: int) -> tuple[float, list[float]]:
    pa, pc = free_port(), free_port()
    cap = f"{blocks * block + 64 * 1024**2}"

    def tls(name: str) -> list[str]:
        return ["--tls-cert", str(pki / f"{name}.pem"), "--tls-key", str(pki / f"{name}.key"),
                "--tls-ca", str(pki / "ca.pem")]

    a = DaemonProcess(work, "--node-id", "bench-a", "--tcp", f"127.0.0.1:{pa}", *tls("node-a"), "--peer-serve",
                      "--tenants", "cn:node-c=default", "--log-level", "warning", host_capacity=cap, name="a")
    c = DaemonProcess(work, "--node-id", "bench-c", "--tcp", f"127.0.0.1:{pc}", *tls("node-c"),
                      "--peers", f"127.0.0.1:{pa}", "--peer-chunk-bytes", str(chunk), "--log-level", "warning",
                      host_capacity=cap, name="c")
    layout = Layout.flat(block)
    base = os.urandom(block)
    keys = [b"bench-peer" + i.to_bytes(6, "big") for i in range(blocks)]
    try:
        a.start()
        c.start()
        with Sidecar(a.socket) as sa, Sidecar(c.socket) as sc:
            lid = sa.register_layout(layout)
            for i in range(0, blocks, 16):
                ks = keys[i:i + 16]
                sa.put(lid, ks, [k + base[len(k):] for k in ks])
            sc.register_layout(layout)
            figures = []
            for _ in range(rounds):
                sc.evict(lid, keys)
                t0 = time.perf_counter()
                n = sc.prefetch(lid, keys, from_node="bench-a")
                dt = time.perf_counter() - t0
                if n != blocks:
                    raise RuntimeError(f"the peer fetch brought {n} of {blocks} blocks; see {c.log_path}")
                figures.append(blocks * block / dt / 1e9)
            got = sc.get(lid, keys[:1], verify=True)[0]
            assert got is not None and bytes(got) == keys[0] + base[len(keys[0]):]
    finally:
        c.cleanup()
        a.cleanup()
    return max(figures), figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="--peer-chunk-bytes of the fetching daemon")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    block = int(args.block_mib * 1024**2)
    chunk = args.chunk_kib * 1024
    total = args.blocks * block
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-peer-") as work:
        pki = Path(work) / "pki"
        pki.mkdir()
        make_pki(pki)
        peer, rounds = peer_gbps(work, pki, args.blocks, block, args.rounds, chunk)
        tcp_tls = max(raw_stream_gbps(total, chunk, str(pki)) for _ in range(args.rounds))
        tcp_plain = max(raw_stream_gbps(total, chunk, None) for _ in range(args.rounds))
    result = {"peer_gbps": round(peer, 3), "tcp_gbps": round(tcp_tls, 3), "ratio": round(peer / tcp_tls, 3),
              "tcp_plain_gbps": round(tcp_plain, 3), "ratio_plain": round(peer / tcp_plain, 3),
              "tcp_kind": "TLS 1.3 over loopback, same certificates, sender in another process",
              "peer_rounds_gbps": [round(x, 3) for x in rounds], "blocks": args.blocks, "block_bytes": block,
              "chunk_bytes": chunk, "bytes": total, "cpus": os.cpu_count()}
    try:
        from _store_bench import store_figures  # the store engineer's half (bench/_store_bench.py)
    except ImportError:
        result["store"] = "bench/_store_bench.py not present in this tree"
    else:
        result.update(store_figures())
    emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""``kvtier health [TARGET]``: ask a kvtierd's gRPC health service whether it serves; the probe of
the container image, the Helm chart and the systemd unit (deploy/).

    kvtier health                                  this node's daemon ($KVTIER_SOCKET, else the default socket)
    kvtier health unix:/run/kvtier/kvtierd.sock    a socket (a bare path works too)
    kvtier health node7:7070 --tls-cert c.pem --tls-key c.key --tls-ca ca.pem   over TCP (mutual TLS)

Exit status 0 when ``grpc.health.v1.Health/Check`` answers SERVING (for ``--service``, default the
whole server), 1 otherwise, with the reason on stderr. Health checks need no credential handshake
(docs/SECURITY.md), so the probe works as any uid that can reach the socket.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client.engine.transport import ClientTls, probe_socket, socket_path, unix_socket


def target_of(arg: str | None) -> str:
    """``unix:PATH`` for a socket path (or none: the default socket), else the target as given."""
    if not arg:
        return f"unix:{socket_path(None)}"
    if unix_socket(arg) is not None:
        return f"unix:{unix_socket(arg)}"
    if arg.startswith("/") or arg.startswith("."):
        return f"unix:{arg}"
    return arg


def check(target: str, service: str = "", timeout: float = 3.0, tls: ClientTls | None = None) -> str | None:
    """None when ``target`` answers SERVING for ``service``; else why not, in words."""
    path = unix_socket(target)
    if path is not None and (problem := probe_socket(path)):
        return problem
    channel = (grpc.secure_channel(target, tls.channel_credentials()) if tls and path is None
               else grpc.insecure_channel(target))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
    except grpc.RpcError as e:
        return f"{target}: health check failed: {e.code().name}: {e.details()}"
    finally:
        channel.close()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{target}: {service or 'the server'} is {name}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier health", description="Exit 0 when a kvtierd's gRPC health "
                                 "service answers SERVING, 1 otherwise (a container or systemd probe).")
    ap.add_argument("target", nargs="?", help="socket path, unix:PATH or HOST:PORT (default: $KVTIER_SOCKET, "
                                              "else the default socket)")
    ap.add_argument("--service", default="", help="service to ask about, e.g. kvtier.v1.Node (default: the "
                                                  "whole server)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    ap.add_argument("--tls-cert", help="over TCP: client certificate (default $KVTIER_TLS_CERT)")
    ap.add_argument("--tls-key", help="over TCP: its key (default $KVTIER_TLS_KEY)")
    ap.add_argument("--tls-ca", help="over TCP: CA of the daemon's certificate (default $KVTIER_TLS_CA)")
    ap.add_argument("--quiet", "-q", action="store_true", help="print nothing when it serves")
    ns = ap.parse_args(argv)
    tls = (ClientTls(ns.tls_cert, ns.tls_key, ns.tls_ca) if ns.tls_cert and ns.tls_key and ns.tls_ca
           else ClientTls.from_env())
    target = target_of(ns.target)
    problem = check(target, ns.service, ns.timeout, tls)
    if problem:
        print(f"kvtier health: {problem}", file=sys.stderr)
        return 1
    if not ns.quiet:
        print(f"{target}: SERVING")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

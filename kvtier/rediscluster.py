"""Reaching a Redis Cluster: what the daemon's shared store (``daemon/remote_store.py``) and the
router's index snapshots (``client/routing/snapshot.py``) both need. No redis import here:
these build the arguments of ``redis.cluster.RedisCluster``."""

from __future__ import annotations

from typing import Any


def parse_nodes(spec: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` as (host, port) pairs (an IPv6 host may be bracketed)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if part:
            host, _, port = part.rpartition(":")
            out.append((host.strip("[]"), int(port)))
    return out


def redis_kwargs(ca: str = "", cert: str = "", key: str = "", user: str = "", password: str = "") -> dict[str, Any]:
    """The connection arguments: TLS when ``ca`` is set (the server's certificate checked against
    it; ``cert``/``key`` the client's, for mutual TLS), ACL ``user`` and ``password``."""
    kw: dict[str, Any] = {}
    if ca:
        kw.update(ssl=True, ssl_ca_certs=ca, ssl_cert_reqs="required", ssl_certfile=cert or None,
                  ssl_keyfile=key or None)
    if user:
        kw["username"] = user
    if password:
        kw["password"] = password
    return kw

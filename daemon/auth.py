"""Who is calling: the authenticated principal of each request.

Every handler of the daemon's services asks its :class:`Authenticator` for the
:class:`Principal` of the call (``self.auth.principal(context)``) before it touches the store.
A principal names:

* ``tenant``: whose blocks the caller may see and use. Blocks, layouts, pools, the feed and
  the key table are per tenant; one tenant never sees another's.
* ``caller``: an unguessable id of the authenticated client (one per credential handshake on
  the unix socket; the certificate's subject on TCP). Sessions, grants, leases and KV
  registrations are bound to the caller that created them; any other caller is refused
  PERMISSION_DENIED.

How callers are authenticated (peer credentials on the unix socket, client certificates on
TCP) is the authenticator's business; the rest of the daemon only sees principals.

:class:`PeerAuthenticator` is the daemon's:

* **Unix socket.** A client first hand-shakes on the credential socket beside the gRPC socket
  (:mod:`kvtier.handshake`, served by :mod:`kvtier.daemon.credentials`): the daemon reads the
  peer's uid and gid from the kernel (``SO_PEERCRED``), refuses those its
  :class:`AccessPolicy` does not allow, and hands out a token (128 random bits) that the
  client sends in the ``kvtier-token`` metadata of every call. The token is valid while that
  credential connection is open. ``caller`` is a hash of the token (never the token itself);
  ``tenant`` comes from the uid -> tenant map (:data:`DEFAULT_TENANT` when unmapped).
  :class:`TokenInterceptor` refuses every call of the Node, Locations and Transfer services
  that carries no valid token (UNAUTHENTICATED), so no handler runs for an unknown caller.
* **TCP with TLS** (mutual: the daemon requires a client certificate signed by ``--tls-ca``).
  ``tenant`` is what a ``cn:NAME=TENANT`` entry of the tenant map maps the certificate's
  common name to; an unmapped common name NAME is the tenant ``cn:NAME``, a namespace of its
  own (a certificate whose CN is ``alice`` or ``default`` is never tenant ``alice`` or
  ``default`` unless an entry says so). A certificate whose subject names more than one
  common name is refused (UNAUTHENTICATED): which of them is the identity would be the TLS
  library's choice. ``caller`` is a hash of the certificate.
* **TCP with --insecure-tcp**: nobody is authenticated; every caller is the default tenant
  (the operator asked for it; the daemon says so loudly at start).

File descriptors passed on a credential connection (``SCM_RIGHTS``) are kept under handles
bound to its token: :meth:`PeerAuthenticator.take_fd`. How many a connection, a uid and a
tenant may have kept at once (not yet taken) is bounded (:class:`FdBudgets`): a pass over a
budget is refused RESOURCE_EXHAUSTED naming it, and keeps nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvtier.daemon.errors import Code, StoreError
from kvtier.handshake import TOKEN_HEADER

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller (see the module docstring)."""

    tenant: str = DEFAULT_TENANT
    caller: str = ""          # unguessable id of the authenticated client ("" only in-process)
    uid: int | None = None    # the peer's uid (unix socket)
    transport: str = "unix"   # "unix" or "tcp"


#: the principal of in-process use (tests of the store, tools running inside the daemon)
LOCAL = Principal()


class Authenticator:
    """Resolves the principal of a gRPC call. This base accepts every call as :data:`LOCAL`,
    the operator."""

    def principal(self, context: Any) -> Principal:
        return LOCAL

    def is_operator(self, p: Principal) -> bool:
        """Whether ``p`` may read node-wide figures (every tenant's counters and usage)."""
        return True


# -- authenticated transports -------------------------------------------------------------------

CN_PREFIX = "cn:"
UNAUTHENTICATED_MESSAGE = (f"no valid credential: a local client connects to the daemon's credential socket "
                           f"(<socket>.auth) first and sends the token it gets in the '{TOKEN_HEADER}' metadata "
                           f"of every call (the kvtier client library does both); a token dies with its "
                           f"credential connection (and with the daemon that issued it)")
#: RPC prefixes served without a credential: health checks and reflection tell nothing about blocks
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def parse_tenants(entries: Iterable[str]) -> tuple[dict[int, str], dict[str, str]]:
    """``UID=TENANT`` and ``cn:NAME=TENANT`` entries -> (uid -> tenant, certificate CN -> tenant).
    Raises ValueError naming a malformed entry."""
    by_uid: dict[int, str] = {}
    by_cn: dict[str, str] = {}
    for entry in entries:
        who, sep, tenant = entry.partition("=")
        who, tenant = who.strip(), tenant.strip()
        if not sep or not who or not tenant or "=" in tenant or "," in tenant:
            raise ValueError(f"tenant entry {entry!r} is not UID=TENANT or cn:NAME=TENANT")
        if who.startswith(CN_PREFIX) and len(who) > len(CN_PREFIX):
            by_cn[who[len(CN_PREFIX):]] = tenant
        elif who.isdigit():
            by_uid[int(who)] = tenant
        else:
            raise ValueError(f"tenant entry {entry!r}: {who!r} is neither a numeric uid nor cn:NAME")
    return by_uid, by_cn


_CN_OID = bytes([0x06, 0x03, 0x55, 0x04, 0x03])  # DER of the OID 2.5.4.3 (commonName)


def _der(buf: bytes, pos: int) -> tuple[int, int, int]:
    """The DER element at ``pos``: (tag, start of its content, end of its content)."""
    tag = buf[pos]
    n = buf[pos + 1]
    pos += 2
    if n & 0x80:
        k = n & 0x7F
        if not 0 < k <= 4:
            raise ValueError("unsupported DER length")
        n = int.from_bytes(buf[pos:pos + k], "big")
        pos += k
    if pos + n > len(buf):
        raise ValueError("truncated DER")
    return tag, pos, pos + n


def subject_common_names(pem: bytes) -> list[str]:
    """Every common name (CN) in the subject of the first certificate of ``pem``, in order;
    ValueError when it is not a certificate."""
    m = re.search(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", pem, re.S)
    if m is None:
        raise ValueError("no PEM certificate")
    der = base64.b64decode(b"".join(m.group(1).split()))
    _, start, _ = _der(der, 0)               # Certificate
    _, pos, _ = _der(der, start)             # TBSCertificate
    if der[pos] == 0xA0:                     # [0] version
        pos = _der(der, pos)[2]
    for _ in range(4):                       # serialNumber, signature, issuer, validity
        pos = _der(der, pos)[2]
    tag, pos, end = _der(der, pos)           # subject: SEQUENCE OF SET OF AttributeTypeAndValue
    if tag != 0x30:
        raise ValueError("no certificate subject")
    names = []
    while pos < end:
        _, rdn, rdn_end = _der(der, pos)     # a RelativeDistinguishedName (SET)
        pos = rdn_end
        while rdn < rdn_end:
            _, atv, atv_end = _der(der, rdn)  # AttributeTypeAndValue (SEQUENCE)
            rdn = atv_end
            if der[atv:atv + len(_CN_OID)] == _CN_OID:
                _, v, v_end = _der(der, atv + len(_CN_OID))
                names.append(der[v:v_end].decode(errors="replace"))
    return names


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call on the unix socket, and which tenant each caller is.

    A peer is admitted when its uid is in ``allowed_uids`` (empty: the daemon's own uid only)
    or its primary gid (as the kernel reports it) is in ``allowed_gids``. ``uid_tenants``:
    uid -> tenant (unmapped: :data:`DEFAULT_TENANT`); ``cn_tenants``: TLS client certificate
    common name -> tenant (unmapped NAME: the tenant ``cn:NAME``, apart from every configured
    tenant name)."""

    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    uid_tenants: Mapping[int, str] = field(default_factory=dict)
    cn_tenants: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, allowed_uids: Iterable[int] = (), allowed_gids: Iterable[int] = (),
           tenants: Iterable[str] = ()) -> AccessPolicy:
        by_uid, by_cn = parse_tenants(tenants)
        return cls(frozenset(allowed_uids) or frozenset({os.geteuid()}), frozenset(allowed_gids), by_uid, by_cn)

    @property
    def shared(self) -> bool:
        """Whether callers other than the daemon's own uid are allowed (the socket directory and
        files must then be reachable by them)."""
        return bool(self.allowed_gids) or any(uid != os.geteuid() for uid in self.allowed_uids)

    def refusal(self, uid: int, gid: int) -> str | None:
        """Why a peer of ``uid``/``gid`` is refused; None when it is admitted."""
        if uid in self.allowed_uids or gid in self.allowed_gids:
            return None
        return (f"uid {uid} (gid {gid}) may not use this kvtierd: allowed uids "
                f"{sorted(self.allowed_uids)}, gids {sorted(self.allowed_gids) or 'none'} "
                f"(--allowed-uids, --allowed-gids)")

    def tenant_of_uid(self, uid: int) -> str:
        return self.uid_tenants.get(uid, DEFAULT_TENANT)

    def tenant_of_cn(self, cn: str) -> str:
        mapped = self.cn_tenants.get(cn)
        return mapped if mapped is not None else CN_PREFIX + cn

    def is_operator(self, p: Principal) -> bool:
        """Whether ``p`` may read node-wide figures (every tenant's activity): the daemon's own
        uid, or a caller of the tenant the daemon's own uid is (the operator's tenant). In-process
        callers (:data:`LOCAL`) are the operator when the daemon's uid is the default tenant."""
        return p.uid == os.geteuid() or p.tenant == self.tenant_of_uid(os.geteuid())


@dataclass(frozen=True)
class FdBudgets:
    """The most passed descriptors kept (passed, not yet taken) at once: per credential
    connection, per peer uid and per tenant (``--max-passed-fds-per-*``)."""

    per_connection: int = 256
    per_uid: int = 1024
    per_tenant: int = 2048

    def flags(self) -> tuple[tuple[str, str, int], ...]:
        """(what, its flag, its budget), checked in this order."""
        return (("this credential connection", "--max-passed-fds-per-connection", self.per_connection),
                ("this uid's connections", "--max-passed-fds-per-uid", self.per_uid),
                ("this tenant's connections", "--max-passed-fds-per-tenant", self.per_tenant))


def key_salt(secret: bytes, tenant: str) -> str:
    """A tenant's key salt: HMAC-SHA256 of the tenant's name under the deployment's secret, hex."""
    return hmac.new(secret, b"kvtier tenant key salt\0" + tenant.encode(), hashlib.sha256).hexdigest()


def _caller_of(token: str) -> str:
    return "tok:" + hashlib.blake2b(token.encode(), digest_size=16).hexdigest()


class PeerAuthenticator(Authenticator):
    """The daemon's authenticator (see the module docstring)."""

    def __init__(self, policy: AccessPolicy, secret: bytes, insecure_tcp: bool = False,
                 fd_budgets: FdBudgets = FdBudgets()) -> None:
        self.policy = policy
        self.secret = secret
        self.insecure_tcp = insecure_tcp
        self.fd_budgets = fd_budgets
        self._tokens: dict[str, Principal] = {}          # token -> principal, while its connection is open
        self._fds: dict[str, tuple[str, int]] = {}       # fd handle -> (owning token, fd)
        self._kept: dict[tuple[str, object], int] = {}    # (connection|uid|tenant, which) -> fds kept
        self._certs: dict[bytes, Principal | StoreError] = {}  # client certificate (PEM) -> its principal

    # -- the credential socket's side (kvtier.daemon.credentials) --

    def admit(self, uid: int, gid: int) -> tuple[str, Principal]:
        """A new token and its principal for a peer of ``uid``/``gid``; PERMISSION_DENIED for one
        the policy does not allow."""
        why = self.policy.refusal(uid, gid)
        if why is not None:
            raise StoreError(Code.PERMISSION_DENIED, why)
        token = secrets.token_hex(16)
        p = Principal(self.policy.tenant_of_uid(uid), _caller_of(token), uid, "unix")
        self._tokens[token] = p
        return token, p

    def revoke(self, token: str) -> None:
        """The token's connection closed: the token is no longer valid; its untaken fds close."""
        p = self._tokens.get(token)
        for handle in [h for h, (t, _) in self._fds.items() if t == token]:
            _, fd = self._fds.pop(handle)
            if p is not None:
                self._count(token, p, -1)
            os.close(fd)
        self._tokens.pop(token, None)

    def of_token(self, token: str) -> Principal | None:
        """The principal of a live token (None once its connection closed)."""
        return self._tokens.get(token)

    def salt(self, tenant: str) -> str:
        return key_salt(self.secret, tenant)

    def is_operator(self, p: Principal) -> bool:
        return self.policy.is_operator(p)

    @staticmethod
    def _budget_keys(token: str, p: Principal) -> tuple[tuple[str, object], ...]:
        return (("connection", token), ("uid", p.uid), ("tenant", p.tenant))

    def _count(self, token: str, p: Principal, n: int) -> None:
        for key in self._budget_keys(token, p):
            left = self._kept.get(key, 0) + n
            if left:
                self._kept[key] = left
            else:
                self._kept.pop(key, None)

    def kept_fds(self, token: str) -> int:
        """Passed descriptors kept (not yet taken) under ``token``'s connection."""
        return self._kept.get(("connection", token), 0)

    def keep_fds(self, token: str, fds: list[int]) -> list[str]:
        """Keep ``fds`` (now the daemon's) under new handles bound to ``token``. Over a budget
        (:class:`FdBudgets`) RESOURCE_EXHAUSTED naming it; nothing is kept then (the caller
        still owns ``fds``)."""
        p = self._tokens.get(token)
        if p is None:
            raise StoreError(Code.UNAUTHENTICATED, "this credential connection's token is no longer valid")
        for (what, flag, budget), key in zip(self.fd_budgets.flags(), self._budget_keys(token, p), strict=True):
            held = self._kept.get(key, 0)
            if held + len(fds) > budget:
                raise StoreError(Code.RESOURCE_EXHAUSTED,
                                 f"{what} already holds {held} passed file descriptors not yet used; {len(fds)} "
                                 f"more would be over its budget of {budget} ({flag}): use (RegisterKV) or close "
                                 f"the connections holding them first")
        handles = []
        for fd in fds:
            handle = secrets.token_hex(16)
            self._fds[handle] = (token, fd)
            handles.append(handle)
        self._count(token, p, len(fds))
        return handles

    def take_fd(self, principal: Principal, handle: str) -> int:
        """The fd passed under ``handle``, now the caller's to close; NOT_FOUND for an unknown (or
        already taken) handle, PERMISSION_DENIED for another caller's."""
        entry = self._fds.get(handle)
        if entry is None:
            raise StoreError(Code.NOT_FOUND, "no file descriptor was passed under this handle (or it was "
                                             "already used, or its credential connection closed)")
        token, fd = entry
        owner = self._tokens.get(token)
        if owner is None or owner.caller != principal.caller:
            raise StoreError(Code.PERMISSION_DENIED, "this file descriptor handle belongs to another caller")
        del self._fds[handle]
        self._count(token, owner, -1)
        return fd

    @property
    def open_fds(self) -> int:
        return len(self._fds)

    # -- gRPC calls --

    def valid(self, token: str) -> bool:
        return token in self._tokens

    def principal(self, context: Any) -> Principal:
        """The principal of a call: from its token on the unix socket, from the client
        certificate on TCP. UNAUTHENTICATED when it has none."""
        if context.peer().startswith("unix:"):
            for key, value in context.invocation_metadata() or ():
                if key == TOKEN_HEADER:
                    p = self._tokens.get(value)
                    if p is not None:
                        return p
                    break
            raise StoreError(Code.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return self.tcp_principal(context)

    def _cert_principal(self, pem: bytes, cn: str) -> Principal | StoreError:
        """The principal of a verified client certificate, or why it is refused."""
        try:
            names = subject_common_names(pem)
        except (ValueError, IndexError) as e:
            return StoreError(Code.UNAUTHENTICATED, f"the client certificate's subject could not be read ({e}): "
                                                    f"the daemon takes the tenant from its common name (CN)")
        if len(names) > 1:
            return StoreError(Code.UNAUTHENTICATED, f"the client certificate's subject names {len(names)} common "
                                                    f"names (CN) {names!r}: the daemon takes the tenant from the "
                                                    f"CN and accepts only a certificate with exactly one")
        if not cn:
            return StoreError(Code.UNAUTHENTICATED, "the client certificate has no common name (CN): the "
                                                    "daemon takes the tenant from it")
        caller = "cert:" + hashlib.sha256(pem).hexdigest()[:32]
        return Principal(self.policy.tenant_of_cn(cn), caller, None, "tcp")

    def tcp_principal(self, context: Any) -> Principal:
        ac = context.auth_context()
        if ac.get("transport_security_type") == [b"ssl"]:
            pem = b"".join(ac.get("x509_pem_cert") or ())
            known = self._certs.get(pem)
            if known is None:
                cn = b"".join(ac.get("x509_common_name") or ()).decode(errors="replace")
                known = self._certs[pem] = self._cert_principal(pem, cn)
                if len(self._certs) > 4096:
                    self._certs.clear()
            if isinstance(known, StoreError):
                raise StoreError(known.code, str(known))
            return known
        if self.insecure_tcp:
            return Principal(DEFAULT_TENANT, "insecure-tcp:" + context.peer(), None, "tcp")
        raise StoreError(Code.UNAUTHENTICATED, "no client certificate: this listener needs TLS with a client "
                                               "certificate signed by the daemon's --tls-ca")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """On the unix-socket server: refuses (UNAUTHENTICATED) every call without a valid token,
    before any handler runs; health checks and reflection (:data:`OPEN_METHODS`) pass."""

    def __init__(self, auth: PeerAuthenticator) -> None:
        self._tokens = auth._tokens  # one dict lookup a call

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                if value in self._tokens:
                    return handler
                break
        if details.method.startswith(OPEN_METHODS):
            return handler
        return _DENY[(handler.request_streaming, handler.response_streaming)]


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # an async generator, as a streaming handler is


_DENY = {(False, False): grpc.unary_unary_rpc_method_handler(_deny_unary),
         (False, True): grpc.unary_stream_rpc_method_handler(_deny_stream),
         (True, False): grpc.stream_unary_rpc_method_handler(_deny_unary),
         (True, True): grpc.stream_stream_rpc_method_handler(_deny_stream)}

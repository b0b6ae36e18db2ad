"""The layouts registered on this daemon, per tenant: one id per (tenant, layout fingerprint).

Tenants cannot see each other: a layout is registered *by a tenant*, and the
blocks a tenant stores under it are kept under a **tenant fingerprint**
(:func:`tenant_fingerprint`), a keyed hash of (tenant, the layout's own fingerprint). Every
tier (host, disk, the policy, the gpu tier) keys its blocks by (tenant fingerprint, key), so
two tenants storing the same key under the same layout hold two different blocks, and
nothing one tenant names (a layout id, a key) ever reaches another tenant's block: a layout
id is looked up among the caller's tenant's registrations only, and a tenant cannot choose
a layout whose tenant fingerprint equals another tenant's.

The default tenant's tenant fingerprint is the layout's own fingerprint, so a daemon without
tenants stores, indexes on disk and publishes exactly what it did before.

What clients see is always the layout's own fingerprint (the *wire* fingerprint): replies,
the feed, the key table and stats translate (:class:`RegisteredLayout`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.daemon.auth import DEFAULT_TENANT
from kvtier.daemon.errors import Code, StoreError
from kvtier.tiers.layout import Layout
from kvtier.tiers.vocab import FP_BYTES

#: separates a tenant from its worker id in the gpu tier's internal worker names
_WORKER_SEP = "\x00"


def layout_id_of(fingerprint: bytes) -> int:
    """A layout's id is its fingerprint's first 31 bits: the same on every daemon and across
    restarts, so a client that kept an id from before a restart can never reach another
    layout's blocks with it (it gets FAILED_PRECONDITION and registers again). Ids are
    resolved among the caller's tenant's layouts only."""
    return int.from_bytes(fingerprint[:4], "little") & 0x7FFFFFFF or 1


def tenant_fingerprint(tenant: str, fingerprint: bytes) -> bytes:
    """The fingerprint a tenant's blocks of this layout are stored under.

    Stable across restarts (the disk tier's index outlives the daemon): a keyed BLAKE2b of the
    layout's fingerprint, keyed by a hash of the tenant's name. It is not secret, and need not
    be: client requests name layout ids, which resolve within the caller's tenant; a peer's
    request names a layout's own fingerprint and is served only for a layout the caller's
    tenant registered (daemon/services/peer.py); and finding a layout whose tenant fingerprint
    equals another tenant's is a second-preimage search on 128 bits."""
    if tenant == DEFAULT_TENANT:
        return fingerprint
    key = hashlib.blake2b(b"kvtier tenant fingerprint\x00" + tenant.encode(), digest_size=32).digest()
    return hashlib.blake2b(fingerprint, digest_size=FP_BYTES, key=key).digest()


def worker_key(tenant: str, worker: str) -> str:
    """The gpu tier's name of a tenant's worker (tenants' worker ids never meet)."""
    return worker if tenant == DEFAULT_TENANT else tenant + _WORKER_SEP + worker


def split_worker(key: str) -> tuple[str, str]:
    """(tenant, worker id) of a :func:`worker_key`."""
    tenant, sep, worker = key.partition(_WORKER_SEP)
    return (tenant, worker) if sep else (DEFAULT_TENANT, key)


@dataclass(frozen=True)
class TenantLayout(Layout):
    """A layout as one tenant registered it: the same tensors, but ``fingerprint`` is the
    tenant fingerprint the tenant's blocks are stored under; ``wire_fingerprint`` is the
    layout's own (what clients compute and see)."""

    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_wire", self._fingerprint)
        object.__setattr__(self, "_fingerprint", tenant_fingerprint(self.tenant, self._fingerprint))

    @property
    def wire_fingerprint(self) -> bytes:
        return self._wire  # type: ignore[attr-defined]

    @classmethod
    def of(cls, layout: Layout, tenant: str) -> TenantLayout:
        return cls(layout.tensors, layout.block_tokens, layout.tp_rank, layout.tp_size, tenant)


@dataclass(frozen=True)
class RegisteredLayout:
    layout_id: int
    layout: TenantLayout   # fingerprint: the tenant fingerprint (what the tiers key blocks by)
    wire: Layout           # the layout as the client sent it (its own fingerprint)

    @property
    def tenant(self) -> str:
        return self.layout.tenant

    @property
    def fingerprint(self) -> bytes:
        """The tenant fingerprint."""
        return self.layout.fingerprint

    @property
    def wire_fingerprint(self) -> bytes:
        return self.wire.fingerprint


class Layouts:
    """(tenant, layout id) -> layout, and tenant fingerprint -> layout; tenants' pool groups."""

    def __init__(self) -> None:
        self._by_id: dict[tuple[str, int], RegisteredLayout] = {}
        self._by_fp: dict[bytes, RegisteredLayout] = {}   # tenant fingerprint -> registration
        self._groups: dict[str, str] = {DEFAULT_TENANT: ""}
        self._per_tenant: dict[str, int] = {}   # tenant -> layouts it registered

    def __iter__(self) -> Iterator[RegisteredLayout]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def of_tenant(self, tenant: str) -> list[RegisteredLayout]:
        return [reg for (t, _), reg in self._by_id.items() if t == tenant]

    def count_of(self, tenant: str) -> int:
        """How many layouts ``tenant`` registered."""
        return self._per_tenant.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._groups)

    def group(self, tenant: str) -> str:
        """The tenant's pool group: part of its pool and key table file names ("" for the
        default tenant; ``t1``, ``t2``, ... in order of first use, never the tenant's name)."""
        g = self._groups.get(tenant)
        if g is None:
            g = self._groups[tenant] = f"t{len(self._groups)}"
        return g

    def group_of(self, tenant: str) -> str | None:
        """The tenant's pool group, None if it has none yet (unlike :meth:`group`, never makes one)."""
        return self._groups.get(tenant)

    def find(self, fingerprint: bytes) -> RegisteredLayout | None:
        """The registration whose *tenant* fingerprint this is."""
        return self._by_fp.get(fingerprint)

    def find_for(self, tenant: str, layout: Layout) -> RegisteredLayout | None:
        """The tenant's registration of ``layout``."""
        return self._by_fp.get(tenant_fingerprint(tenant, layout.fingerprint))

    def add(self, layout: Layout, tenant: str = DEFAULT_TENANT) -> RegisteredLayout:
        """Register ``layout`` for ``tenant`` (or return its registration); refuses a
        fingerprint whose id is taken by another fingerprint of the same tenant."""
        reg = self.find_for(tenant, layout)
        if reg is not None:
            return reg
        fp = layout.fingerprint
        lid = layout_id_of(fp)
        other = self._by_id.get((tenant, lid))
        if other is not None:  # two fingerprints share 31 bits: refuse rather than mix them
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"layout id {lid} of fingerprint {fp.hex()} is taken by fingerprint "
                             f"{other.wire_fingerprint.hex()} on this daemon; restart it without one of them")
        tl = TenantLayout.of(layout, tenant)
        wire = layout if type(layout) is Layout else Layout(layout.tensors, layout.block_tokens, layout.tp_rank,
                                                             layout.tp_size)
        reg = self._by_id[(tenant, lid)] = RegisteredLayout(lid, tl, wire)
        self._by_fp[tl.fingerprint] = reg
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self.group(tenant)
        return reg

    def get(self, layout_id: int, tenant: str = DEFAULT_TENANT) -> RegisteredLayout:
        """The tenant's layout of this id. Another tenant's id is answered as an unknown one
        (the reply does not tell whether it exists)."""
        reg = self._by_id.get((tenant, layout_id))
        if reg is None:
            raise StoreError(Code.FAILED_PRECONDITION,
                             f"layout_id {layout_id} is not registered on this daemon (it may have "
                             f"restarted): call RegisterLayout first")
        return reg

    def slot_bytes_of(self, fingerprint: bytes) -> int:
        """The slot size of the layout with this tenant fingerprint (0 if none is registered)."""
        reg = self.find(fingerprint)
        return reg.layout.slot_bytes if reg is not None else 0

"""Sources of blocks beyond this node: peer daemons and the shared store (the ``remote`` tier).

A :class:`RemoteSource` answers "fetch these blocks of this tenant" with verified-by-checksum
payloads; :class:`~kvtier.daemon.store.BlockStore` consults its sources, in order, for keys a get
found in no local tier (read-through, when the source says so) and for prefetches that name a
source. What a source returns goes through :meth:`Placement.ingest
<kvtier.daemon.placement.Placement.ingest>`: copied into host, hashed there, visible only if the
hash matches the sender's. A source never raises for an unreachable peer or store node: it
returns what it got (the rest are misses) and counts the failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from kvtier.tiers.layout import Layout

Fetched = tuple[bytes, bytes | memoryview, int]
"""One fetched block: (packed block id, payload, xxh3-64 the sender took)."""


class RemoteSource(Protocol):
    """A place blocks can be fetched from: a peer daemon (``peer``) or the shared store (``store``)."""

    name: str
    """The source's kind, a metrics label: ``peer`` or ``store``."""

    read_through: bool
    """Whether a get's miss in every local tier asks this source."""

    async def fetch(self, tenant: str, layout: Layout, bkeys: Sequence[bytes],
                    from_node: str | None = None) -> list[Fetched]:
        """The blocks of ``bkeys`` (the tenant's, packed under the tenant fingerprint of
        ``layout``) this source could get, complete; ``from_node`` names one peer (None: any)."""
        ...


class StreamedSource:
    """A source whose :meth:`fetch` is its ``stream`` (batches of fetched blocks, each complete,
    the next read while the caller ingests this one) gathered: the peers and the store both
    stream, and :meth:`BlockStore.fetch_remote <kvtier.daemon.store.BlockStore.fetch_remote>`
    ingests batch by batch where a source streams."""

    def stream(self, tenant: str, layout: Layout, bkeys: Sequence[bytes],
               from_node: str | None = None) -> AsyncIterator[list[Fetched]]:
        raise NotImplementedError

    async def fetch(self, tenant: str, layout: Layout, bkeys: Sequence[bytes],
                    from_node: str | None = None) -> list[Fetched]:
        """Every block :meth:`stream` gets, at once (the :class:`RemoteSource` call)."""
        out: list[Fetched] = []
        async for batch in self.stream(tenant, layout, bkeys, from_node):
            out.extend(batch)
        return out

"""The daemon's counters, with typed keys.

Every counter is named by a member of an enum, never by a string to parse:

* hits and misses per operation (:class:`Op`) and tier, in blocks and tokens
  (:meth:`Counters.looked_up`): ``kvtier_hit_blocks_total{op, tier}`` ...;
* payload bytes per :class:`Flow` (source -> destination): ``kvtier_bytes_total{direction}``;
* capacity evictions per tier: ``kvtier_evictions_total{tier}``;
* refusals per :class:`~kvtier.daemon.errors.Code`: ``kvtier_errors_total{code}``;
* every other count, a :class:`Count` member whose value is its exported name:
  ``kvtier_<name>_total``.

The hot path only adds to plain dictionaries whose keys all exist from the start (so a reader
on another thread never sees one grow). The Stats reply, the Prometheus endpoint and ``kvtier
report`` read a :meth:`Counters.copy`.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.daemon.errors import Code
from kvtier.tiers.vocab import ALL_TIERS, Tier


class Op(enum.Enum):
    """An operation whose hits and misses are counted."""

    LOOKUP = "lookup"    # what engines and routers asked (Lookup, and key-table lookups reported)
    ACQUIRE = "acquire"  # what clients read (Acquire, onboards)


class Place(enum.Enum):
    """Where payload bytes move from or to."""

    GPU = Tier.GPU.label
    HOST = Tier.HOST.label
    DISK = Tier.DISK.label
    CLIENT = "client"  # a client process on this node, through the host pool


class Flow(enum.Enum):
    """A direction payload bytes move in."""

    GPU_TO_HOST = (Place.GPU, Place.HOST)
    HOST_TO_GPU = (Place.HOST, Place.GPU)
    HOST_TO_DISK = (Place.HOST, Place.DISK)
    DISK_TO_HOST = (Place.DISK, Place.HOST)
    CLIENT_TO_HOST = (Place.CLIENT, Place.HOST)
    HOST_TO_CLIENT = (Place.HOST, Place.CLIENT)

    @property
    def source(self) -> Place:
        return self.value[0]

    @property
    def destination(self) -> Place:
        return self.value[1]

    @property
    def label(self) -> str:
        """``"gpu->host"``: the ``direction`` label."""
        return f"{self.source.value}->{self.destination.value}"


class Count(enum.Enum):
    """Every other counter; the value is its name (``kvtier_<name>_total``)."""

    SESSIONS_OPENED = "sessions_opened"
    GRANTS = "grants"                                  # slots handed out by Allocate
    NO_SPACE = "no_space"                              # keys Allocate found no slot for
    COMMITS = "commits"                                # blocks made visible by Commit
    DURABLE_COMMITS = "durable_commits"                # blocks of durable puts on disk and indexed
    GRANTS_RECLAIMED = "grants_reclaimed"              # aborted: their session ended or they expired
    GRANTS_WITHHELD = "grants_withheld"                # expired grants whose slots were withheld from reuse
    LEASES_RECLAIMED = "leases_reclaimed"              # released: their session ended or they expired
    HOST_BACKING_FAILURES = "host_backing_failures"    # fresh slots the tmpfs could not back
    EVICTED_BY_REQUEST = "evicted_by_request"          # entries removed by Evict
    DEMOTIONS = "demotions"                            # host victims written to disk
    DEMOTIONS_STAGED = "demotions_staged"              # host blocks queued for a background disk write
                                                       # (victims copied out, write-ahead)
    DEMOTIONS_STAGED_OVER = "demotions_staged_over"    # of those, writes over (written, dropped or failed)
    DEMOTIONS_AHEAD = "demotions_ahead"                # host blocks near eviction written to disk ahead of it
    DEMOTIONS_SKIPPED_COLD = "demotions_skipped_cold"  # host victims seen too rarely to keep
    DEMOTIONS_SKIPPED_DEGRADED = "demotions_skipped_degraded"
    DISK_NO_SPACE = "disk_no_space"                    # disk writes that found no slot
    DISK_DEGRADED = "disk_degraded"                    # times the disk tier stopped taking writes
    PROMOTIONS = "promotions"                          # disk -> host on a get or prefetch
    PROMOTIONS_NO_SPACE = "promotions_no_space"        # disk hits that found no host slot
    PREFETCH_PROMOTIONS = "prefetch_promotions"
    # retained blocks (Retain, --retention-budget; kvtier.daemon.retention)
    RETAINED_KEYS = "retained_keys"                    # keys Retain calls retained (new or renewed)
    RETENTIONS_EXPIRED = "retentions_expired"          # retentions that reached their TTL
    RETENTIONS_RELEASED = "retentions_released"        # retentions released early to make room in a budget
    RETAINS_REFUSED = "retains_refused"                # Retain calls refused: over the budget, or retention off
    RETAINED_EVICTIONS = "retained_evictions"          # retained blocks evicted: nothing unretained was left
    CHECKSUM_FAILURES = "checksum_failures"            # disk reads whose bytes differed (served as misses)
    DISK_READ_ERRORS = "disk_read_errors"
    DEVICE_REPORTS = "device_reports"                  # ReportDeviceBlocks calls applied
    LOCATION_EVENTS = "location_events"
    LOCATION_SNAPSHOTS = "location_snapshots"
    LOCATION_RESUMES = "location_resumes"
    LOCATION_SUBSCRIBERS_BEHIND = "location_subscribers_behind"
    KEY_TABLE_ERRORS = "key_table_errors"
    KV_REGISTRATIONS_OPENED = "kv_registrations_opened"
    KV_REGISTRATIONS_CLOSED = "kv_registrations_closed"
    KV_HANDLES_OPENED = "kv_handles_opened"
    KV_HANDLES_CLOSED = "kv_handles_closed"
    KV_EVENTS_OPENED = "kv_events_opened"
    KV_EVENTS_CLOSED = "kv_events_closed"
    KV_CLOSE_ERRORS = "kv_close_errors"
    KV_INFLIGHT_AT_CLOSE = "kv_inflight_at_close"
    KV_TRANSFERS_CANCELLED = "kv_transfers_cancelled"
    KV_TRANSFERS_SUPERSEDED = "kv_transfers_superseded"  # an engine reused a ring slot whose transfer still ran
    KV_OFFLOADS_ABORTED = "kv_offloads_aborted"
    KV_OFFLOAD_BLOCKS = "kv_offload_blocks"
    KV_ONBOARD_BLOCKS = "kv_onboard_blocks"
    KV_ONBOARD_MISSING = "kv_onboard_missing"
    KV_ONBOARD_ERRORS = "kv_onboard_errors"
    KV_REGISTRATIONS_REFUSED = "kv_registrations_refused"  # RegisterKV over a session's or tenant's limit
    # the credential socket's budgets (docs/SECURITY.md)
    CREDENTIAL_CONNECTIONS_REFUSED = "credential_connections_refused"  # closed at accept: uid not admitted,
                                                                       # too many handshakes pending or open
    PASSED_FDS_REFUSED = "passed_fds_refused"          # passed descriptors closed: over a budget or the reserve
    # peers: fetches from other daemons and blocks served to them
    PEER_FETCHES = "peer_fetches"                      # FetchBlocks streams this daemon opened
    PEER_BLOCKS_FETCHED = "peer_blocks_fetched"        # blocks that arrived complete and verified
    PEER_BYTES_FETCHED = "peer_bytes_fetched"
    PEER_BLOCKS_MISSED = "peer_blocks_missed"          # asked of a peer and not had (held nowhere, cut off)
    PEER_PARTIAL_BLOCKS = "peer_partial_blocks"        # blocks a broken stream cut mid-way (dropped)
    PEER_STREAM_ERRORS = "peer_stream_errors"          # peer calls that failed (unreachable, reset, died)
    PEER_TIMEOUTS = "peer_timeouts"                    # peer calls cut after --peer-timeout-s without a reply
    PEER_REFUSED = "peer_refused"                      # peer calls refused (another tenant's certificate, bad input)
    PEER_PROTOCOL_ERRORS = "peer_protocol_errors"      # replies out of order or of the wrong size (stream dropped)
    PEER_MARKED_DOWN = "peer_marked_down"              # times a peer was marked down (retried with backoff)
    PEER_NEW_EPOCHS = "peer_new_epochs"                # peers seen again with a new epoch (a restart)
    PEER_UNKNOWN_NODE = "peer_unknown_node"            # fetches naming a node id no live peer has
    PEER_RESOLVE_ERRORS = "peer_resolve_errors"        # --peers names that did not resolve
    PEER_HOLDS_ASKED = "peer_holds_asked"              # Holds calls made by read-through
    PEER_BLOCKS_SERVED = "peer_blocks_served"          # blocks this daemon sent to peers
    PEER_BYTES_SERVED = "peer_bytes_served"
    PEER_SERVE_ABORTED = "peer_serve_aborted"          # FetchBlocks streams whose caller went away mid-way
    # the shared store: written behind, read through
    STORE_WRITES = "store_writes"                      # blocks written behind to the store
    STORE_WRITE_BYTES = "store_write_bytes"            # their payload bytes
    STORE_WRITES_DROPPED = "store_writes_dropped"      # not written: the write-behind queue was full
    STORE_WRITES_SKIPPED = "store_writes_skipped"      # not written: gone from host, or changed, before the write
    STORE_WRITE_ERRORS = "store_write_errors"          # not written: a store node failed or timed out
    STORE_READS = "store_reads"                        # blocks read through from the store, verified
    STORE_READ_BYTES = "store_read_bytes"              # their payload bytes
    STORE_MISSES = "store_misses"                      # blocks asked of the store that it did not hold
    STORE_READ_ERRORS = "store_read_errors"            # blocks not read: a store node failed or timed out
    STORE_CORRUPT = "store_corrupt"                    # values failing header or checksum (misses, never served)
    STORE_EXPIRED = "store_expired"                    # blocks this daemon wrote whose TTL lapsed (left the feed)


#: the tiers evictions are counted in (the gpu tier is the engines': they evict their own)
EVICTING_TIERS: tuple[Tier, ...] = (Tier.HOST, Tier.DISK)


@dataclass
class Tally:
    """Blocks, and the tokens they hold."""

    blocks: int = 0
    tokens: int = 0


class Counters:
    """See the module docstring. Every field's keys exist from the start."""

    def __init__(self) -> None:
        self.hits: dict[Op, dict[Tier, Tally]] = {op: {t: Tally() for t in ALL_TIERS} for op in Op}
        self.misses: dict[Op, Tally] = {op: Tally() for op in Op}
        self.moved: dict[Flow, int] = dict.fromkeys(Flow, 0)
        self.evictions: dict[Tier, int] = dict.fromkeys(EVICTING_TIERS, 0)
        self.errors: dict[Code, int] = dict.fromkeys(Code, 0)
        self.counts: dict[Count, int] = dict.fromkeys(Count, 0)

    def __getitem__(self, count: Count) -> int:
        return self.counts[count]

    def add(self, count: Count, n: int = 1) -> None:
        self.counts[count] += n

    def move(self, flow: Flow, nbytes: int) -> None:
        self.moved[flow] += nbytes

    def evicted(self, tier: Tier, n: int) -> None:
        self.evictions[tier] += n

    def refused(self, code: Code) -> None:
        self.errors[code] += 1

    def looked_up(self, op: Op, block_tokens: int, hits: Mapping[Tier, int], misses: int) -> None:
        """One batch of ``op``: ``hits`` blocks found per fastest tier, ``misses`` found nowhere."""
        per_tier = self.hits[op]
        for tier, n in hits.items():
            if n:
                t = per_tier[tier]
                t.blocks += n
                t.tokens += n * block_tokens
        m = self.misses[op]
        m.blocks += misses
        m.tokens += misses * block_tokens

    def asked(self, op: Op) -> Tally:
        """Blocks and tokens asked for by ``op``: hits in every tier plus misses."""
        tallies = [*self.hits[op].values(), self.misses[op]]
        return Tally(sum(t.blocks for t in tallies), sum(t.tokens for t in tallies))

    def copy(self) -> Counters:
        """A consistent copy (take it on the event loop), for readers on other threads."""
        return copy.deepcopy(self)


class TenantCounters(Counters):
    """One tenant's own counters (what Stats answers that tenant with); what is counted here is
    counted in the node's counters too."""

    def __init__(self, node: Counters) -> None:
        super().__init__()
        self.node = node

    def add(self, count: Count, n: int = 1) -> None:
        self.counts[count] += n
        self.node.counts[count] += n

    def move(self, flow: Flow, nbytes: int) -> None:
        self.moved[flow] += nbytes
        self.node.moved[flow] += nbytes

    def looked_up(self, op: Op, block_tokens: int, hits: Mapping[Tier, int], misses: int) -> None:
        super().looked_up(op, block_tokens, hits, misses)
        self.node.looked_up(op, block_tokens, hits, misses)

    def copy(self) -> Counters:
        """The tenant's own figures alone, as plain :class:`Counters`."""
        out = Counters()
        out.hits, out.misses = copy.deepcopy(self.hits), copy.deepcopy(self.misses)
        out.moved, out.evictions = dict(self.moved), dict(self.evictions)
        out.errors, out.counts = dict(self.errors), dict(self.counts)
        return out

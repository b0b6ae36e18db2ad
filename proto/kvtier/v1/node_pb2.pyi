from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_NONE: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class GrantStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRANT_STATUS_UNSPECIFIED: _ClassVar[GrantStatus]
    GRANTED: _ClassVar[GrantStatus]
    PRESENT: _ClassVar[GrantStatus]
    NO_SPACE: _ClassVar[GrantStatus]

class CountedOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COUNTED_OP_UNSPECIFIED: _ClassVar[CountedOp]
    COUNTED_OP_LOOKUP: _ClassVar[CountedOp]
    COUNTED_OP_ACQUIRE: _ClassVar[CountedOp]

class Endpoint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENDPOINT_UNSPECIFIED: _ClassVar[Endpoint]
    ENDPOINT_GPU: _ClassVar[Endpoint]
    ENDPOINT_HOST: _ClassVar[Endpoint]
    ENDPOINT_DISK: _ClassVar[Endpoint]
    ENDPOINT_CLIENT: _ClassVar[Endpoint]
TIER_NONE: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
GRANT_STATUS_UNSPECIFIED: GrantStatus
GRANTED: GrantStatus
PRESENT: GrantStatus
NO_SPACE: GrantStatus
COUNTED_OP_UNSPECIFIED: CountedOp
COUNTED_OP_LOOKUP: CountedOp
COUNTED_OP_ACQUIRE: CountedOp
ENDPOINT_UNSPECIFIED: Endpoint
ENDPOINT_GPU: Endpoint
ENDPOINT_HOST: Endpoint
ENDPOINT_DISK: Endpoint
ENDPOINT_CLIENT: Endpoint

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "block_dim", "token_indexed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDEXED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    block_dim: int
    token_indexed: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., block_dim: _Optional[int] = ..., token_indexed: _Optional[bool] = ...) -> None: ...

class LayoutSpec(_message.Message):
    __slots__ = ("tensors", "block_tokens", "tp_rank", "tp_size")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    block_tokens: int
    tp_rank: int
    tp_size: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., block_tokens: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: LayoutSpec
    def __init__(self, layout: _Optional[_Union[LayoutSpec, _Mapping]] = ...) -> None: ...

class RegisterLayoutReply(_message.Message):
    __slots__ = ("layout_id", "fingerprint", "block_bytes", "slot_bytes", "pool_path", "pool_bytes", "key_table_path", "epoch")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_TABLE_PATH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    fingerprint: bytes
    block_bytes: int
    slot_bytes: int
    pool_path: str
    pool_bytes: int
    key_table_path: str
    epoch: int
    def __init__(self, layout_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., pool_path: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., key_table_path: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("client_name", "pid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "node_id", "epoch", "reclaim_deadline_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    node_id: str
    epoch: int
    reclaim_deadline_s: float
    def __init__(self, session_id: _Optional[int] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reclaim_deadline_s: _Optional[float] = ...) -> None: ...

class SessionClientMessage(_message.Message):
    __slots__ = ("hello",)
    HELLO_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ...) -> None: ...

class SessionServerMessage(_message.Message):
    __slots__ = ("opened",)
    OPENED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "layout_id", "keys", "durable")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    durable: bool
    def __init__(self, session_id: _Optional[int] = ..., layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., durable: _Optional[bool] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("status", "grant_id", "offset", "durable")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    status: GrantStatus
    grant_id: int
    offset: int
    durable: bool
    def __init__(self, status: _Optional[_Union[GrantStatus, str]] = ..., grant_id: _Optional[int] = ..., offset: _Optional[int] = ..., durable: _Optional[bool] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[Grant]
    def __init__(self, grants: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "grant_ids", "abort_grant_ids", "durable", "checksums")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    grant_ids: _containers.RepeatedScalarFieldContainer[int]
    abort_grant_ids: _containers.RepeatedScalarFieldContainer[int]
    durable: bool
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[int] = ..., grant_ids: _Optional[_Iterable[int]] = ..., abort_grant_ids: _Optional[_Iterable[int]] = ..., durable: _Optional[bool] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("committed", "durable")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    committed: int
    durable: int
    def __init__(self, committed: _Optional[int] = ..., durable: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "layout_id", "keys", "verify")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    verify: bool
    def __init__(self, session_id: _Optional[int] = ..., layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., verify: _Optional[bool] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "offset", "found_in")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOUND_IN_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offset: int
    found_in: Tier
    def __init__(self, lease_id: _Optional[int] = ..., offset: _Optional[int] = ..., found_in: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[int] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class LookupCounts(_message.Message):
    __slots__ = ("layout_id", "hit_gpu", "hit_host", "hit_disk", "miss")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_GPU_FIELD_NUMBER: _ClassVar[int]
    HIT_HOST_FIELD_NUMBER: _ClassVar[int]
    HIT_DISK_FIELD_NUMBER: _ClassVar[int]
    MISS_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    hit_gpu: int
    hit_host: int
    hit_disk: int
    miss: int
    def __init__(self, layout_id: _Optional[int] = ..., hit_gpu: _Optional[int] = ..., hit_host: _Optional[int] = ..., hit_disk: _Optional[int] = ..., miss: _Optional[int] = ...) -> None: ...

class ReportLookupsRequest(_message.Message):
    __slots__ = ("layouts",)
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedCompositeFieldContainer[LookupCounts]
    def __init__(self, layouts: _Optional[_Iterable[_Union[LookupCounts, _Mapping]]] = ...) -> None: ...

class ReportLookupsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("layout_id", "keys", "from_node")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    from_node: str
    def __init__(self, layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., from_node: _Optional[str] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("promoted",)
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    promoted: int
    def __init__(self, promoted: _Optional[int] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("layout_id", "keys", "ttl_s", "priority")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    priority: int
    def __init__(self, layout_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class RetainReply(_message.Message):
    __slots__ = ("retained", "held", "released", "retained_bytes", "budget_bytes")
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    retained: int
    held: int
    released: int
    retained_bytes: int
    budget_bytes: int
    def __init__(self, retained: _Optional[int] = ..., held: _Optional[int] = ..., released: _Optional[int] = ..., retained_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "load_gbps")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    load_gbps: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., load_gbps: _Optional[float] = ...) -> None: ...

class LayoutStats(_message.Message):
    __slots__ = ("layout_id", "fingerprint", "block_bytes", "host_blocks", "disk_blocks", "gpu_blocks")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    fingerprint: bytes
    block_bytes: int
    host_blocks: int
    disk_blocks: int
    gpu_blocks: int
    def __init__(self, layout_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., gpu_blocks: _Optional[int] = ...) -> None: ...

class HitCount(_message.Message):
    __slots__ = ("op", "tier", "blocks", "tokens")
    OP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    op: CountedOp
    tier: Tier
    blocks: int
    tokens: int
    def __init__(self, op: _Optional[_Union[CountedOp, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class BytesMoved(_message.Message):
    __slots__ = ("source", "destination", "bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    source: Endpoint
    destination: Endpoint
    bytes: int
    def __init__(self, source: _Optional[_Union[Endpoint, str]] = ..., destination: _Optional[_Union[Endpoint, str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class EvictionCount(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ...) -> None: ...

class ErrorCount(_message.Message):
    __slots__ = ("code", "count")
    CODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    code: str
    count: int
    def __init__(self, code: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("node_id", "epoch", "uptime_s", "tiers", "layouts", "sessions", "counters", "version", "hits", "bytes_moved", "evictions", "errors", "totals", "retained_bytes", "retention_budget_bytes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TotalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutStats]
    sessions: int
    counters: _containers.ScalarMap[str, int]
    version: str
    hits: _containers.RepeatedCompositeFieldContainer[HitCount]
    bytes_moved: _containers.RepeatedCompositeFieldContainer[BytesMoved]
    evictions: _containers.RepeatedCompositeFieldContainer[EvictionCount]
    errors: _containers.RepeatedCompositeFieldContainer[ErrorCount]
    totals: _containers.ScalarMap[str, int]
    retained_bytes: int
    retention_budget_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[LayoutStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., version: _Optional[str] = ..., hits: _Optional[_Iterable[_Union[HitCount, _Mapping]]] = ..., bytes_moved: _Optional[_Iterable[_Union[BytesMoved, _Mapping]]] = ..., evictions: _Optional[_Iterable[_Union[EvictionCount, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[ErrorCount, _Mapping]]] = ..., totals: _Optional[_Mapping[str, int]] = ..., retained_bytes: _Optional[int] = ..., retention_budget_bytes: _Optional[int] = ...) -> None: ...

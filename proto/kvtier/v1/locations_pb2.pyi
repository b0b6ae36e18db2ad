from kvtier.proto.kvtier.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LocationEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCATION_EVENT_KIND_UNSPECIFIED: _ClassVar[LocationEventKind]
    STORED: _ClassVar[LocationEventKind]
    REMOVED: _ClassVar[LocationEventKind]
    CLEARED: _ClassVar[LocationEventKind]
LOCATION_EVENT_KIND_UNSPECIFIED: LocationEventKind
STORED: LocationEventKind
REMOVED: LocationEventKind
CLEARED: LocationEventKind

class LocationEvent(_message.Message):
    __slots__ = ("seq", "kind", "tier", "worker_id", "fingerprint", "keys")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: LocationEventKind
    tier: _node_pb2.Tier
    worker_id: str
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[LocationEventKind, str]] = ..., tier: _Optional[_Union[_node_pb2.Tier, str]] = ..., worker_id: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "fingerprints")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fingerprints: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., fingerprints: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TierInfo(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "load_gbps")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    tier: _node_pb2.Tier
    capacity_bytes: int
    load_gbps: float
    def __init__(self, tier: _Optional[_Union[_node_pb2.Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., load_gbps: _Optional[float] = ...) -> None: ...

class LayoutInfo(_message.Message):
    __slots__ = ("fingerprint", "block_bytes", "block_tokens", "tp_rank", "tp_size")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    block_bytes: int
    block_tokens: int
    tp_rank: int
    tp_size: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "epoch", "workers", "tiers", "layouts", "head_seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    tiers: _containers.RepeatedCompositeFieldContainer[TierInfo]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutInfo]
    head_seq: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierInfo, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[LayoutInfo, _Mapping]]] = ..., head_seq: _Optional[int] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("at_seq", "first", "last", "entries")
    AT_SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    at_seq: int
    first: bool
    last: bool
    entries: _containers.RepeatedCompositeFieldContainer[LocationEvent]
    def __init__(self, at_seq: _Optional[int] = ..., first: _Optional[bool] = ..., last: _Optional[bool] = ..., entries: _Optional[_Iterable[_Union[LocationEvent, _Mapping]]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events", "head_seq")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LocationEvent]
    head_seq: int
    def __init__(self, events: _Optional[_Iterable[_Union[LocationEvent, _Mapping]]] = ..., head_seq: _Optional[int] = ...) -> None: ...

class WatchLocationsRequest(_message.Message):
    __slots__ = ("epoch", "from_seq", "subscriber")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    from_seq: int
    subscriber: str
    def __init__(self, epoch: _Optional[int] = ..., from_seq: _Optional[int] = ..., subscriber: _Optional[str] = ...) -> None: ...

class WatchLocationsReply(_message.Message):
    __slots__ = ("epoch", "node", "snapshot", "events")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    node: NodeInfo
    snapshot: SnapshotPart
    events: EventBatch
    def __init__(self, epoch: _Optional[int] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotPart, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ...) -> None: ...

class ReportDeviceBlocksRequest(_message.Message):
    __slots__ = ("worker_id", "layout_id", "stored", "removed", "clear", "session_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    layout_id: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    clear: bool
    session_id: int
    def __init__(self, worker_id: _Optional[str] = ..., layout_id: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., clear: _Optional[bool] = ..., session_id: _Optional[int] = ...) -> None: ...

class ReportDeviceBlocksReply(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

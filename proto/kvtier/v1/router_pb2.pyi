from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "tenant_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant_salt: str
    def __init__(self, model: _Optional[str] = ..., tenant_salt: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("keys", "token_ids", "namespace", "block_tokens", "candidates", "dispatch", "top_k")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: NamespaceSpec
    block_tokens: int
    candidates: _containers.RepeatedScalarFieldContainer[str]
    dispatch: bool
    top_k: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., block_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[str]] = ..., dispatch: _Optional[bool] = ..., top_k: _Optional[int] = ...) -> None: ...

class TierOverlap(_message.Message):
    __slots__ = ("gpu", "host", "disk", "remote")
    GPU_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    host: int
    disk: int
    remote: int
    def __init__(self, gpu: _Optional[int] = ..., host: _Optional[int] = ..., disk: _Optional[int] = ..., remote: _Optional[int] = ...) -> None: ...

class RankedWorker(_message.Message):
    __slots__ = ("worker_id", "node_id", "cost", "saved_blocks", "overlap", "queued_blocks", "active_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node_id: str
    cost: float
    saved_blocks: float
    overlap: TierOverlap
    queued_blocks: float
    active_requests: float
    def __init__(self, worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., cost: _Optional[float] = ..., saved_blocks: _Optional[float] = ..., overlap: _Optional[_Union[TierOverlap, _Mapping]] = ..., queued_blocks: _Optional[float] = ..., active_requests: _Optional[float] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("ranked", "n_blocks", "decision_id", "fetch")
    RANKED_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    ranked: _containers.RepeatedCompositeFieldContainer[RankedWorker]
    n_blocks: int
    decision_id: int
    fetch: _containers.RepeatedCompositeFieldContainer[FetchHint]
    def __init__(self, ranked: _Optional[_Iterable[_Union[RankedWorker, _Mapping]]] = ..., n_blocks: _Optional[int] = ..., decision_id: _Optional[int] = ..., fetch: _Optional[_Iterable[_Union[FetchHint, _Mapping]]] = ...) -> None: ...

class FetchHint(_message.Message):
    __slots__ = ("worker_id", "from_node", "keys", "start", "end")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_node: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    start: int
    end: int
    def __init__(self, worker_id: _Optional[str] = ..., from_node: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("decision_id", "prefill_only")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    decision_id: int
    prefill_only: bool
    def __init__(self, decision_id: _Optional[int] = ..., prefill_only: _Optional[bool] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedState(_message.Message):
    __slots__ = ("target", "node_id", "connected", "epoch", "seq", "head_seq", "snapshots", "resumes", "epoch_changes", "last_error", "dropped_events", "overflows")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_CHANGES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    target: str
    node_id: str
    connected: bool
    epoch: int
    seq: int
    head_seq: int
    snapshots: int
    resumes: int
    epoch_changes: int
    last_error: str
    dropped_events: int
    overflows: int
    def __init__(self, target: _Optional[str] = ..., node_id: _Optional[str] = ..., connected: _Optional[bool] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., head_seq: _Optional[int] = ..., snapshots: _Optional[int] = ..., resumes: _Optional[int] = ..., epoch_changes: _Optional[int] = ..., last_error: _Optional[str] = ..., dropped_events: _Optional[int] = ..., overflows: _Optional[int] = ...) -> None: ...

class RouterStatusReply(_message.Message):
    __slots__ = ("feeds", "indexed_keys", "workers", "catching_up", "recorded_requests", "record_dropped")
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_KEYS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CATCHING_UP_FIELD_NUMBER: _ClassVar[int]
    RECORDED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RECORD_DROPPED_FIELD_NUMBER: _ClassVar[int]
    feeds: _containers.RepeatedCompositeFieldContainer[FeedState]
    indexed_keys: int
    workers: _containers.RepeatedScalarFieldContainer[str]
    catching_up: bool
    recorded_requests: int
    record_dropped: int
    def __init__(self, feeds: _Optional[_Iterable[_Union[FeedState, _Mapping]]] = ..., indexed_keys: _Optional[int] = ..., workers: _Optional[_Iterable[str]] = ..., catching_up: _Optional[bool] = ..., recorded_requests: _Optional[int] = ..., record_dropped: _Optional[int] = ...) -> None: ...

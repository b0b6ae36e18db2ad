from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "tenant_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant_salt: str
    def __init__(self, model: str | None = ..., tenant_salt: str | None = ...) -> None: ...

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
    def __init__(self, keys: _Iterable[bytes] | None = ..., token_ids: _Iterable[int] | None = ..., namespace: NamespaceSpec | _Mapping | None = ..., block_tokens: int | None = ..., candidates: _Iterable[str] | None = ..., dispatch: bool | None = ..., top_k: int | None = ...) -> None: ...

class TierOverlap(_message.Message):
    __slots__ = ("gpu", "host", "disk")
    GPU_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    host: int
    disk: int
    def __init__(self, gpu: int | None = ..., host: int | None = ..., disk: int | None = ...) -> None: ...

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
    def __init__(self, worker_id: str | None = ..., node_id: str | None = ..., cost: float | None = ..., saved_blocks: float | None = ..., overlap: TierOverlap | _Mapping | None = ..., queued_blocks: float | None = ..., active_requests: float | None = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("ranked", "n_blocks", "decision_id")
    RANKED_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    ranked: _containers.RepeatedCompositeFieldContainer[RankedWorker]
    n_blocks: int
    decision_id: int
    def __init__(self, ranked: _Iterable[RankedWorker | _Mapping] | None = ..., n_blocks: int | None = ..., decision_id: int | None = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("decision_id", "prefill_only")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    decision_id: int
    prefill_only: bool
    def __init__(self, decision_id: int | None = ..., prefill_only: bool | None = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool | None = ...) -> None: ...

class RouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedState(_message.Message):
    __slots__ = ("target", "node_id", "connected", "epoch", "seq", "head_seq", "snapshots", "resumes", "epoch_changes", "last_error")
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
    def __init__(self, target: str | None = ..., node_id: str | None = ..., connected: bool | None = ..., epoch: int | None = ..., seq: int | None = ..., head_seq: int | None = ..., snapshots: int | None = ..., resumes: int | None = ..., epoch_changes: int | None = ..., last_error: str | None = ...) -> None: ...

class RouterStatusReply(_message.Message):
    __slots__ = ("feeds", "indexed_keys", "workers")
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_KEYS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    feeds: _containers.RepeatedCompositeFieldContainer[FeedState]
    indexed_keys: int
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, feeds: _Iterable[FeedState | _Mapping] | None = ..., indexed_keys: int | None = ..., workers: _Iterable[str] | None = ...) -> None: ...

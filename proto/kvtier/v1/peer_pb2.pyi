from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HoldsRequest(_message.Message):
    __slots__ = ("fingerprint", "keys", "tenant")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ...) -> None: ...

class HoldsReply(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tiers: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("fingerprint", "block_bytes", "keys", "tenant", "chunk_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    block_bytes: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    chunk_bytes: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PeerHello(_message.Message):
    __slots__ = ("node_id", "epoch", "tenant")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    tenant: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "xxh3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    xxh3: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class Missing(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchBlocksReply(_message.Message):
    __slots__ = ("hello", "chunk", "missing")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    hello: PeerHello
    chunk: BlockChunk
    missing: Missing
    def __init__(self, hello: _Optional[_Union[PeerHello, _Mapping]] = ..., chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., missing: _Optional[_Union[Missing, _Mapping]] = ...) -> None: ...

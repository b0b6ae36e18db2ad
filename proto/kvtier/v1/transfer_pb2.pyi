from kvtier.proto.kvtier.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATUS_UNSPECIFIED: _ClassVar[TransferStatus]
    TRANSFER_COPIED: _ClassVar[TransferStatus]
    TRANSFER_PRESENT: _ClassVar[TransferStatus]
    TRANSFER_NO_SPACE: _ClassVar[TransferStatus]
    TRANSFER_MISSING: _ClassVar[TransferStatus]
TRANSFER_STATUS_UNSPECIFIED: TransferStatus
TRANSFER_COPIED: TransferStatus
TRANSFER_PRESENT: TransferStatus
TRANSFER_NO_SPACE: TransferStatus
TRANSFER_MISSING: TransferStatus

class KVAllocation(_message.Message):
    __slots__ = ("ipc_handle", "path", "size", "device", "device_uuid", "fd_handle")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    FD_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    path: str
    size: int
    device: int
    device_uuid: bytes
    fd_handle: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., device: _Optional[int] = ..., device_uuid: _Optional[bytes] = ..., fd_handle: _Optional[str] = ...) -> None: ...

class KVTensorRef(_message.Message):
    __slots__ = ("allocation", "offset")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    allocation: int
    offset: int
    def __init__(self, allocation: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterKVRequest(_message.Message):
    __slots__ = ("session_id", "layout", "backend", "allocations", "tensors", "event_handles", "event_ring_path", "ring_slots", "event_ring_fd_handle")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    EVENT_RING_PATH_FIELD_NUMBER: _ClassVar[int]
    RING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_RING_FD_HANDLE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    layout: _node_pb2.LayoutSpec
    backend: str
    allocations: _containers.RepeatedCompositeFieldContainer[KVAllocation]
    tensors: _containers.RepeatedCompositeFieldContainer[KVTensorRef]
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    event_ring_path: str
    ring_slots: int
    event_ring_fd_handle: str
    def __init__(self, session_id: _Optional[int] = ..., layout: _Optional[_Union[_node_pb2.LayoutSpec, _Mapping]] = ..., backend: _Optional[str] = ..., allocations: _Optional[_Iterable[_Union[KVAllocation, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[KVTensorRef, _Mapping]]] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., event_ring_path: _Optional[str] = ..., ring_slots: _Optional[int] = ..., event_ring_fd_handle: _Optional[str] = ...) -> None: ...

class RegisterKVReply(_message.Message):
    __slots__ = ("registration_id", "layout_id", "copy_engine", "block_bytes")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    COPY_ENGINE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    layout_id: int
    copy_engine: str
    block_bytes: int
    def __init__(self, registration_id: _Optional[int] = ..., layout_id: _Optional[int] = ..., copy_engine: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class UnregisterKVRequest(_message.Message):
    __slots__ = ("session_id", "registration_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    registration_id: int
    def __init__(self, session_id: _Optional[int] = ..., registration_id: _Optional[int] = ...) -> None: ...

class UnregisterKVReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "registration_id", "keys", "engine_ids", "event_slot", "seq", "wait_written")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    registration_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    engine_ids: _containers.RepeatedScalarFieldContainer[int]
    event_slot: int
    seq: int
    wait_written: bool
    def __init__(self, session_id: _Optional[int] = ..., registration_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., engine_ids: _Optional[_Iterable[int]] = ..., event_slot: _Optional[int] = ..., seq: _Optional[int] = ..., wait_written: _Optional[bool] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("status", "bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[TransferStatus]
    bytes: int
    def __init__(self, status: _Optional[_Iterable[_Union[TransferStatus, str]]] = ..., bytes: _Optional[int] = ...) -> None: ...

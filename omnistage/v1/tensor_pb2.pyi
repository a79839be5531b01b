from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmRef(_message.Message):
    __slots__ = ("arena_id", "offset", "nbytes", "lease_id", "generation", "producer_address")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    offset: int
    nbytes: int
    lease_id: str
    generation: int
    producer_address: str
    def __init__(self, arena_id: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., lease_id: _Optional[str] = ..., generation: _Optional[int] = ..., producer_address: _Optional[str] = ...) -> None: ...

class CudaIpcRef(_message.Message):
    __slots__ = ("gpu_uuid", "ipc_handle", "offset", "nbytes", "lease_id", "event_handle", "producer_address")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    ipc_handle: bytes
    offset: int
    nbytes: int
    lease_id: str
    event_handle: bytes
    producer_address: str
    def __init__(self, gpu_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., lease_id: _Optional[str] = ..., event_handle: _Optional[bytes] = ..., producer_address: _Optional[str] = ...) -> None: ...

class RemoteRef(_message.Message):
    __slots__ = ("producer_address", "lease_id")
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    producer_address: str
    lease_id: str
    def __init__(self, producer_address: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "inline_data", "shm", "cuda_ipc", "remote")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    inline_data: bytes
    shm: ShmRef
    cuda_ipc: CudaIpcRef
    remote: RemoteRef
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcRef, _Mapping]] = ..., remote: _Optional[_Union[RemoteRef, _Mapping]] = ...) -> None: ...

class StageState(_message.Message):
    __slots__ = ("tensors", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRef]
    meta: _containers.ScalarMap[str, str]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorRef, _Mapping]]] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("lease_id", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "request_id")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

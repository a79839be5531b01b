from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationParams(_message.Message):
    __slots__ = ("model", "prompt", "negative_prompt", "width", "height", "num_inference_steps", "true_cfg_scale", "seed", "max_sequence_length", "options", "loras", "messages")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_inference_steps: int
    true_cfg_scale: float
    seed: int
    max_sequence_length: int
    options: _containers.ScalarMap[str, str]
    loras: _containers.RepeatedCompositeFieldContainer[LoraRef]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., true_cfg_scale: _Optional[float] = ..., seed: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ..., loras: _Optional[_Iterable[_Union[LoraRef, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    parts: _containers.RepeatedCompositeFieldContainer[ChatPart]
    def __init__(self, role: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ChatPart, _Mapping]]] = ...) -> None: ...

class ChatPart(_message.Message):
    __slots__ = ("text", "audio", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    audio: int
    image: int
    video: int
    def __init__(self, text: _Optional[str] = ..., audio: _Optional[int] = ..., image: _Optional[int] = ..., video: _Optional[int] = ...) -> None: ...

class LoraRef(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("request_id", "params", "input", "consumer_host_id", "progress_every", "outputs", "preview_every", "checkpoint_every", "resume", "consumer_gpu_uuid", "consumer_ipc_namespace", "role", "streaming", "followers", "export_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_IPC_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: GenerationParams
    input: _tensor_pb2.StageState
    consumer_host_id: str
    progress_every: int
    outputs: _containers.RepeatedScalarFieldContainer[str]
    preview_every: int
    checkpoint_every: int
    resume: _tensor_pb2.StageState
    consumer_gpu_uuid: str
    consumer_ipc_namespace: int
    role: str
    streaming: bool
    followers: int
    export_prefix: bool
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[GenerationParams, _Mapping]] = ..., input: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ..., consumer_host_id: _Optional[str] = ..., progress_every: _Optional[int] = ..., outputs: _Optional[_Iterable[str]] = ..., preview_every: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., resume: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ..., consumer_gpu_uuid: _Optional[str] = ..., consumer_ipc_namespace: _Optional[int] = ..., role: _Optional[str] = ..., streaming: _Optional[bool] = ..., followers: _Optional[int] = ..., export_prefix: _Optional[bool] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("step", "total", "step_ms", "preview_png", "checkpoint", "partial")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_PNG_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    step_ms: float
    preview_png: bytes
    checkpoint: _tensor_pb2.StageState
    partial: _tensor_pb2.StageState
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., step_ms: _Optional[float] = ..., preview_png: _Optional[bytes] = ..., checkpoint: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ..., partial: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("step", "result")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    step: StepProgress
    result: StageResult
    def __init__(self, step: _Optional[_Union[StepProgress, _Mapping]] = ..., result: _Optional[_Union[StageResult, _Mapping]] = ...) -> None: ...

class StageResult(_message.Message):
    __slots__ = ("output", "compute_ms")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.StageState
    compute_ms: float
    def __init__(self, output: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class FeedRequest(_message.Message):
    __slots__ = ("request_id", "role", "index", "chunk", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    role: str
    index: int
    chunk: _tensor_pb2.StageState
    end: bool
    def __init__(self, request_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., chunk: _Optional[_Union[_tensor_pb2.StageState, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class FeedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("stage", "model", "family", "host_id", "device", "dtype", "address", "queue_depth", "load", "gpu_uuid", "ipc_namespace", "asleep", "weight_bytes", "device_memory_bytes", "roles", "loras", "model_defaults", "option_defaults", "draining")
    class ModelDefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class OptionDefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    OPTION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    stage: str
    model: str
    family: str
    host_id: str
    device: str
    dtype: str
    address: str
    queue_depth: int
    load: int
    gpu_uuid: str
    ipc_namespace: int
    asleep: bool
    weight_bytes: int
    device_memory_bytes: int
    roles: _containers.RepeatedScalarFieldContainer[str]
    loras: _containers.RepeatedScalarFieldContainer[str]
    model_defaults: _containers.ScalarMap[str, float]
    option_defaults: _containers.ScalarMap[str, str]
    draining: bool
    def __init__(self, stage: _Optional[str] = ..., model: _Optional[str] = ..., family: _Optional[str] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., address: _Optional[str] = ..., queue_depth: _Optional[int] = ..., load: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., ipc_namespace: _Optional[int] = ..., asleep: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., roles: _Optional[_Iterable[str]] = ..., loras: _Optional[_Iterable[str]] = ..., model_defaults: _Optional[_Mapping[str, float]] = ..., option_defaults: _Optional[_Mapping[str, str]] = ..., draining: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class WakeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryTransition(_message.Message):
    __slots__ = ("level", "bytes", "seconds", "awake")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AWAKE_FIELD_NUMBER: _ClassVar[int]
    level: int
    bytes: int
    seconds: float
    awake: bool
    def __init__(self, level: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., awake: _Optional[bool] = ...) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("name", "path", "scale", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    scale: float
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., scale: _Optional[float] = ..., pinned: _Optional[bool] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PinLoraRequest(_message.Message):
    __slots__ = ("name", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraInfo(_message.Message):
    __slots__ = ("name", "source", "scale", "rank", "modules", "bytes", "pinned", "users")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    scale: float
    rank: int
    modules: int
    bytes: int
    pinned: bool
    users: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., scale: _Optional[float] = ..., rank: _Optional[int] = ..., modules: _Optional[int] = ..., bytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., users: _Optional[int] = ...) -> None: ...

class LoraList(_message.Message):
    __slots__ = ("loras", "bytes", "max_bytes")
    LORAS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.RepeatedCompositeFieldContainer[LoraInfo]
    bytes: int
    max_bytes: int
    def __init__(self, loras: _Optional[_Iterable[_Union[LoraInfo, _Mapping]]] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadWeightsReply(_message.Message):
    __slots__ = ("tensors", "bytes", "seconds")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    bytes: int
    seconds: float
    def __init__(self, tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("path", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    seconds: float
    def __init__(self, path: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

from omnistage.v1 import stage_pb2 as _stage_pb2
from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_PCM16: _ClassVar[AudioFormat]
    AUDIO_FORMAT_FLOAT32: _ClassVar[AudioFormat]

class AudioInputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_INPUT_FORMAT_WAV: _ClassVar[AudioInputFormat]
    AUDIO_INPUT_FORMAT_FLAC: _ClassVar[AudioInputFormat]
    AUDIO_INPUT_FORMAT_PCM16: _ClassVar[AudioInputFormat]
    AUDIO_INPUT_FORMAT_FLOAT32: _ClassVar[AudioInputFormat]
    AUDIO_INPUT_FORMAT_MP3: _ClassVar[AudioInputFormat]

class ImageFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_FORMAT_PNG: _ClassVar[ImageFormat]
    IMAGE_FORMAT_RGB8: _ClassVar[ImageFormat]
AUDIO_FORMAT_PCM16: AudioFormat
AUDIO_FORMAT_FLOAT32: AudioFormat
AUDIO_INPUT_FORMAT_WAV: AudioInputFormat
AUDIO_INPUT_FORMAT_FLAC: AudioInputFormat
AUDIO_INPUT_FORMAT_PCM16: AudioInputFormat
AUDIO_INPUT_FORMAT_FLOAT32: AudioInputFormat
AUDIO_INPUT_FORMAT_MP3: AudioInputFormat
IMAGE_FORMAT_PNG: ImageFormat
IMAGE_FORMAT_RGB8: ImageFormat

class GenerateRequest(_message.Message):
    __slots__ = ("params", "request_id", "return_tensor", "progress_every", "image_format", "preview_every", "inputs", "audio_format")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_TENSOR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_EVERY_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    params: _stage_pb2.GenerationParams
    request_id: str
    return_tensor: bool
    progress_every: int
    image_format: ImageFormat
    preview_every: int
    inputs: _containers.RepeatedCompositeFieldContainer[InputMedia]
    audio_format: AudioFormat
    def __init__(self, params: _Optional[_Union[_stage_pb2.GenerationParams, _Mapping]] = ..., request_id: _Optional[str] = ..., return_tensor: _Optional[bool] = ..., progress_every: _Optional[int] = ..., image_format: _Optional[_Union[ImageFormat, str]] = ..., preview_every: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[InputMedia, _Mapping]]] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ...) -> None: ...

class InputMedia(_message.Message):
    __slots__ = ("image", "audio", "video")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    audio: InputAudio
    video: InputVideo
    def __init__(self, image: _Optional[bytes] = ..., audio: _Optional[_Union[InputAudio, _Mapping]] = ..., video: _Optional[_Union[InputVideo, _Mapping]] = ...) -> None: ...

class InputVideo(_message.Message):
    __slots__ = ("frames", "fps")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ...) -> None: ...

class InputAudio(_message.Message):
    __slots__ = ("data", "format", "sample_rate")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: AudioInputFormat
    sample_rate: int
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[_Union[AudioInputFormat, str]] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class StageStarted(_message.Message):
    __slots__ = ("stage", "replica", "step", "role")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    replica: str
    step: str
    role: str
    def __init__(self, stage: _Optional[str] = ..., replica: _Optional[str] = ..., step: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class StageFinished(_message.Message):
    __slots__ = ("stage", "wall_ms", "compute_ms", "step", "cached")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    stage: str
    wall_ms: float
    compute_ms: float
    step: str
    cached: bool
    def __init__(self, stage: _Optional[str] = ..., wall_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., step: _Optional[str] = ..., cached: _Optional[bool] = ...) -> None: ...

class TokenProgress(_message.Message):
    __slots__ = ("step", "tokens", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: str
    tokens: int
    total: int
    def __init__(self, step: _Optional[str] = ..., tokens: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class DenoiseStep(_message.Message):
    __slots__ = ("step", "total", "preview_png")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_PNG_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    preview_png: bytes
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., preview_png: _Optional[bytes] = ...) -> None: ...

class RawChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("image", "width", "height", "tensor", "total_ms", "image_format", "kind", "text", "sample_rate", "audio_samples")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    width: int
    height: int
    tensor: _tensor_pb2.TensorRef
    total_ms: float
    image_format: ImageFormat
    kind: str
    text: str
    sample_rate: int
    audio_samples: int
    def __init__(self, image: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., total_ms: _Optional[float] = ..., image_format: _Optional[_Union[ImageFormat, str]] = ..., kind: _Optional[str] = ..., text: _Optional[str] = ..., sample_rate: _Optional[int] = ..., audio_samples: _Optional[int] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("step", "text")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    step: str
    text: str
    def __init__(self, step: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("index", "sample_rate", "format", "data", "offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    index: int
    sample_rate: int
    format: AudioFormat
    data: bytes
    offset: int
    def __init__(self, index: _Optional[int] = ..., sample_rate: _Optional[int] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("accepted", "stage_started", "stage_finished", "step", "raw_chunk", "result", "error", "tokens", "text", "audio", "waiting")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STAGE_STARTED_FIELD_NUMBER: _ClassVar[int]
    STAGE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RAW_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    stage_started: StageStarted
    stage_finished: StageFinished
    step: DenoiseStep
    raw_chunk: RawChunk
    result: Result
    error: Error
    tokens: TokenProgress
    text: TextDelta
    audio: AudioChunk
    waiting: WaitingForReplica
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., stage_started: _Optional[_Union[StageStarted, _Mapping]] = ..., stage_finished: _Optional[_Union[StageFinished, _Mapping]] = ..., step: _Optional[_Union[DenoiseStep, _Mapping]] = ..., raw_chunk: _Optional[_Union[RawChunk, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., tokens: _Optional[_Union[TokenProgress, _Mapping]] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., waiting: _Optional[_Union[WaitingForReplica, _Mapping]] = ...) -> None: ...

class WaitingForReplica(_message.Message):
    __slots__ = ("stage", "role", "step", "max_wait_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    role: str
    step: str
    max_wait_ms: int
    def __init__(self, stage: _Optional[str] = ..., role: _Optional[str] = ..., step: _Optional[str] = ..., max_wait_ms: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelOption(_message.Message):
    __slots__ = ("name", "type", "default_value", "minimum", "maximum", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default_value: str
    minimum: float
    maximum: float
    description: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_value: _Optional[str] = ..., minimum: _Optional[float] = ..., maximum: _Optional[float] = ..., description: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "family", "replicas", "inputs", "max_images", "outputs", "options", "roles", "ready", "defaults", "size_multiple", "takes_loras", "loras")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RolesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LorasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    TAKES_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: str
    replicas: _containers.ScalarMap[str, int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    max_images: int
    outputs: _containers.RepeatedScalarFieldContainer[str]
    options: _containers.RepeatedCompositeFieldContainer[ModelOption]
    roles: _containers.ScalarMap[str, int]
    ready: bool
    defaults: _containers.ScalarMap[str, float]
    size_multiple: int
    takes_loras: bool
    loras: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., family: _Optional[str] = ..., replicas: _Optional[_Mapping[str, int]] = ..., inputs: _Optional[_Iterable[str]] = ..., max_images: _Optional[int] = ..., outputs: _Optional[_Iterable[str]] = ..., options: _Optional[_Iterable[_Union[ModelOption, _Mapping]]] = ..., roles: _Optional[_Mapping[str, int]] = ..., ready: _Optional[bool] = ..., defaults: _Optional[_Mapping[str, float]] = ..., size_multiple: _Optional[int] = ..., takes_loras: _Optional[bool] = ..., loras: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

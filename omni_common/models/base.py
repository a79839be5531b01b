"""The contract between omnistage and a model family.

A family (a folder under omni_common/models/, registered in `registry.py`) declares:
- its **roles**: the model calls it offers (an encoder forward, an autoregressive generator,
  a denoising loop, a VAE decode...), each served by one of the three stage types;
- its **plan** for a request: the role calls, in dependency order, with the named tensors each
  consumes and produces. The coordinator executes any plan; it never names a family;
- per stage type, a **stage model**: what one replica loads (weights, shared by the roles that
  use them) and a runner per role. Runners come in three kinds, which the stage's worker drives:
  `BatchRunner` (one call per request, micro-batched), `StepRunner` (step-wise, continuously
  batched between steps: denoising loops, token generation) and `AsyncRunner` (manages its own
  concurrency, e.g. a vLLM engine).

`family.py` of a family must stay light (no torch model imports at module level): the
coordinator imports it for validation and plans.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from omni_common.errors import Unimplemented
from omni_common.input_media import INPUT_PREFIX, AudioInput, ImageInput, VideoInput
from omni_common.models.module_layout import ModuleDeclaration, SequenceParallelPlan
from omni_common.stages import MAX_BATCH, MAX_QUEUE, STAGES

RunnerKind = Literal["batch", "steps", "async"]


@dataclass(frozen=True)
class ChatTurn:
    """One message of a conversation: its role and its parts in order, each ("text", the text),
    ("audio", index), ("image", index) or ("video", index) (indices among the request's inputs
    of that kind)."""

    role: str
    parts: tuple[tuple[str, str | int], ...]


@dataclass(frozen=True)
class GenerationRequest:
    """One request, already validated (sizes, ranges, finiteness)."""

    prompt: str
    negative_prompt: str = ""
    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    # The family's guidance scale: Qwen-Image's true CFG scale, GLM-Image's CFG scale.
    true_cfg_scale: float = 4.0
    seed: int = 0
    max_sequence_length: int = 512
    # The request's input images, in order (their bytes travel as `input_image_name(i)` tensors).
    images: tuple[ImageInput, ...] = ()
    # The request's input audio clips, in order (as `input_audio_name(i)` tensors).
    audios: tuple[AudioInput, ...] = ()
    # The request's input videos, in order (as `input_video_name(i)` tensors).
    videos: tuple[VideoInput, ...] = ()
    # A conversation (chat families); empty: one user turn of the inputs, then `prompt`.
    messages: tuple[ChatTurn, ...] = ()
    # Family options (GenerationParams.options), checked by the family's `validate`.
    options: tuple[tuple[str, str], ...] = ()
    # LoRA adapters of the DiT by name, in order, each with its scale (None: the scale the
    # adapter was added with); families whose card says `loras` take them.
    loras: tuple[tuple[str, float | None], ...] = ()

    @property
    def do_true_cfg(self) -> bool:
        """diffusers' rule for true CFG: a scale above 1 and a negative prompt."""
        return self.true_cfg_scale > 1 and self.negative_prompt != ""

    def option(self, name: str, default: str = "") -> str:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class DenoiserOptions:
    """How a denoiser runs its transformer on its device (the DiT stage's flags)."""

    # Replay each forward as a CUDA graph, captured once per bucket of shapes (CUDA only).
    cuda_graphs: bool = False
    # (width, height) sizes whose graphs are captured at load, for every batch up to max_batch.
    capture_sizes: tuple[tuple[int, int], ...] = ()
    max_batch: int = MAX_BATCH
    # A diffusers attention backend ("_native_cudnn", "_native_flash", ...); "" keeps the default.
    attention_backend: str = ""
    # torch.compile the transformer's repeated blocks.
    compile: bool = False
    # LoRA adapters (omni_common/models/lora.py): memory for unpinned ones in bytes, the
    # directory requests may load adapters from by name ("" = none), and how requests with
    # different adapters batch: "mixed" (one forward, each row its own adapters) or "grouped"
    # (one forward per adapter set).
    lora_bytes: int = 1 << 30
    lora_dir: str = ""
    lora_batching: str = "mixed"
    # Devices one forward is spread over (a replica with --devices); above 1 rules out what
    # cannot split (step caching, which runs the blocks outside the DiT's forward).
    devices: int = 1
    # At a warm start (a warm compile cache), serve once one request at each capture size runs
    # compiled, and load the rest of the warm-up while idle (warmup.py): only where a
    # scheduler calls the runner's idle_work (a one-device replica).
    defer_warm_up: bool = False
    # "fp8": the DiT's block products in float8_e4m3fn, per-row activation and per-channel
    # weight scales (qwenimage/fp8.py); "bf16": a float32 DiT in bfloat16 (qwen_omni/token2wav.py);
    # "none": the model dtype. Families that offer it list it in ModelCard.quantizations.
    quantization: str = "none"


@dataclass(frozen=True)
class StageContext:
    """What a stage replica hands a family's loader besides the model directory."""

    device: torch.device
    dtype: torch.dtype
    # The roles to load (a replica may serve a subset of its stage's roles); empty = all.
    roles: tuple[str, ...] = ()
    denoiser: DenoiserOptions = field(default_factory=DenoiserOptions)
    # ar-encoder: "torch" or "vllm", for the roles that offer a vLLM backend.
    backend: str = "torch"
    vllm_memory_fraction: float = 0.1
    # Async runners that batch by themselves: the batch window, sizes and queue bound.
    batch_window_s: float = 0.0
    max_batch: int = MAX_BATCH
    max_queue: int = MAX_QUEUE
    # Output caches of roles that keep one (e.g. prompt embeddings), in bytes; 0 = off.
    cache_bytes: int = 0
    cache_bypass: bool = False
    # Generators that chunk long prompts' prefills: tokens a step (--prefill-chunk-tokens); 0 = off.
    prefill_chunk_tokens: int = 0
    # How generators decode (--ar-decode: auto, eager or graphs).
    ar_decode: str = "auto"
    # torch.compile the stage's model where its family supports it (ar-encoder: the text
    # encoder's layers; vae-decode: the decode at `capture_sizes`; the DiT's execution flags
    # are `denoiser`).
    compile: bool = False
    # Replay forwards as CUDA graphs where the family's stage model has them (ar-encoder: a
    # lone prompt's; vae-decode: a vocoder window's; the DiT's execution flags are `denoiser`).
    cuda_graphs: bool = False
    # (width, height) sizes the stage compiles ahead (--capture-sizes).
    capture_sizes: tuple[tuple[int, int], ...] = ()
    # vae-decode over several devices: the devices a large image's decode is split over (the
    # first is `device`), from images of `split_decode_pixels` on; () = one device.
    decode_devices: tuple[torch.device, ...] = ()
    split_decode_pixels: int = 0
    # Runs model work on the replica's compute thread (one forward at a time per device).
    compute: Callable[..., Awaitable[Any]] | None = None

    def wants(self, role: str) -> bool:
        return not self.roles or role in self.roles


@dataclass
class StageState:
    """What one role call hands the next: named CPU or device tensors plus string metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RoleCall:
    """One request to a batch or async runner: the request and its input tensors."""

    request: GenerationRequest
    inputs: StageState
    # The caller's deadline (time.monotonic()), for runners that queue; None = none.
    deadline: float | None = None
    label: str = ""  # the request id, for logs


@dataclass
class StepState:
    """Per-request state of a step-wise runner; families subclass it with their fields."""

    request: GenerationRequest
    step_index: int
    total_steps: int
    extra: dict[str, Any] = field(default_factory=dict)


class BatchRunner(Protocol):
    """One call per request; the worker hands it whatever is queued as one batch."""

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        """One output per call, in order. Raise omni_common.errors for a call's own fault."""
        ...

    def cost(self, call: RoleCall) -> int:
        """What the call weighs against the stage's batch budget (pixels, tokens, or 1)."""
        ...


class LateFlag:
    """A step's NaN flag that comes after `step` returned: a replica over several devices sends
    the step to its device workers and reads their answers later (group_runner.GroupRunner).
    `read()` waits for it; the step scheduler reads it on the compute thread, once it has
    launched the next step, so the devices never wait for the server between steps."""

    def __init__(self, read: Callable[[], bool]) -> None:
        self.read = read

    def __bool__(self) -> bool:  # a truth test waits for the flag, never mistakes it for True
        return self.read()


class StepRunner(Protocol):
    """Step-wise work, so a scheduler can interleave requests between steps: a denoising
    loop (one transformer forward + scheduler step) or token generation (one token). What a
    step runner may do beyond this (stream, work while idle, take adapters...) is named in
    capabilities.py."""

    def prepare(self, request: GenerationRequest, inputs: StageState) -> StepState:
        """Everything before the first step (noise and timesteps; a prefill)."""
        ...

    def batch_key(self, state: StepState) -> Hashable:
        """States with equal keys may share one step's forward."""
        ...

    def step_cost(self, state: StepState) -> int:
        """Compute units of one step of `state` (image tokens x CFG passes; 1 for a token)."""
        ...

    def step(self, states: Sequence[StepState]) -> None:
        """Advance every state by one step, in place."""
        ...

    def is_done(self, state: StepState) -> bool: ...

    def is_finite(self, state: StepState) -> bool | torch.Tensor | LateFlag:
        """False when the state holds NaN or Inf (the request must fail alone); may be a 0-d
        bool tensor left on the device, which the scheduler reads once the step has ended
        (a host read here would wait for the step), or a LateFlag, for a step that runs
        elsewhere and answers later."""
        ...

    def preview(self, state: StepState) -> np.ndarray | None:
        """A small uint8 [h, w, 3] picture of the state, cheap; None when there is none."""
        ...

    def checkpoint(self, state: StepState) -> StageState | None:
        """What another replica needs to continue `state` (with the same request); None when
        the runner does not resume (the step then restarts from the beginning), or has nothing
        new since its latest checkpoint (which then holds, e.g. token2wav between windows)."""
        ...

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        """Move a freshly prepared `state` to where `checkpoint` was taken."""
        ...

    def finish(self, state: StepState) -> StageState:
        """The request's output; frees what the state held (as `release` does)."""
        ...

    def release(self, state: StepState) -> None:
        """Free what a state holds on the runner (a KV-cache slot) when it leaves unfinished:
        cancelled, expired or failed. Idempotent; nothing to do for most runners."""
        ...


class AsyncRunner(Protocol):
    """A runner that batches and queues by itself (a vLLM engine, a cache in front of a model)."""

    async def run(self, call: RoleCall) -> StageState: ...

    def load(self) -> int:
        """Work waiting or running (the stage's load signal)."""
        ...

    def close(self) -> None: ...


Runner = BatchRunner | StepRunner | AsyncRunner


class StageModel(Protocol):
    """What one replica of a stage type loads: the weights, and a runner per role it serves.
    Module declarations (sleep, offload) resolve against this object."""

    @property
    def runners(self) -> Mapping[str, Runner]: ...


@dataclass(frozen=True)
class RoleSpec:
    """A model role: a kind of call a family's stage model can serve."""

    name: str  # e.g. "text-encoder", "prior", "denoise", "vae-decode"
    stage: str  # the stage type that serves it (omni_common/stages.py)
    kind: RunnerKind
    description: str = ""


@dataclass(frozen=True)
class PrefixKeys:
    """A chat call's conversation keys (conversation_keys.py): those of the earlier requests'
    conversations its prompt starts with, longest first, and its own conversation's key, which
    the next turn's `reuses` will hold."""

    reuses: tuple[str, ...]
    leaves: str


@dataclass(frozen=True)
class PlanStep:
    """One role call of a request.

    `consumes` names tensors produced by earlier steps or request inputs (INPUT_PREFIX);
    `produces` names what the step's output must hold. `progress` is what its progress events
    count: "steps" (denoising steps), "tokens" (generated tokens) or "" (none). A `resumable`
    step sends checkpoints and resumes on another replica from the latest one. A step with a
    `cache_key` has outputs that depend only on what the key says: a request with the same key
    reuses them (content-addressed, e.g. by input image digests).
    """

    name: str
    stage: str
    role: str
    consumes: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    progress: Literal["", "steps", "tokens"] = ""
    resumable: bool = False
    cache_key: str = ""
    # Consumed tensors that arrive as a stream of chunks (partial outputs of their producer,
    # a capabilities.StreamingRunner): the step starts with the first chunk, not the whole output.
    streamed: tuple[str, ...] = ()
    # A generator that keeps its prompts' prefix KV (prefix_cache.py): the conversation keys
    # the coordinator routes the call by, to the replica that keeps an earlier turn's KV.
    prefixes: PrefixKeys | None = None


@dataclass(frozen=True)
class Plan:
    """The steps of one request, each after the steps it consumes from; the last is the result."""

    steps: tuple[PlanStep, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a plan needs at least one step")
        produced: set[str] = set()
        names: set[str] = set()
        for step in self.steps:
            if step.stage not in STAGES:
                raise ValueError(f"plan step {step.name!r}: unknown stage {step.stage!r}")
            if step.name in names:
                raise ValueError(f"plan step {step.name!r} appears twice")
            missing = [t for t in step.consumes if t not in produced and not t.startswith(INPUT_PREFIX)]
            if any(t not in step.consumes or t.startswith(INPUT_PREFIX) for t in step.streamed):
                raise ValueError(f"plan step {step.name!r} streams inputs it does not consume from a step")
            if len({self.producer(t) for t in step.streamed} - {None}) > 1:
                raise ValueError(f"plan step {step.name!r} streams inputs of more than one step")
            if missing:
                raise ValueError(
                    f"plan step {step.name!r} consumes {missing}, which no earlier step produces"
                )
            overlap = produced & set(step.produces)
            if overlap:
                raise ValueError(f"plan step {step.name!r} produces {sorted(overlap)} again")
            names.add(step.name)
            produced.update(step.produces)

    @property
    def result(self) -> PlanStep:
        return self.steps[-1]

    def producer(self, tensor: str) -> PlanStep | None:
        """The step that produces `tensor`; None for a request input."""
        return next((step for step in self.steps if tensor in step.produces), None)

    def consumers(self, step: PlanStep) -> list[PlanStep]:
        """The steps that consume any output of `step`."""
        return [s for s in self.steps if set(s.consumes) & set(step.produces)]


@dataclass(frozen=True)
class OptionSpec:
    """A family option (GenerationParams.options[name]): its type, default and range."""

    name: str
    type: Literal["float", "int", "str"]
    default: str
    minimum: float  # ranges of "float" and "int"; a "str" is a name the stages check
    maximum: float
    description: str


@dataclass(frozen=True)
class ModelCard:
    """What a family's models take and give (ListModels says it to clients)."""

    inputs: tuple[str, ...] = ("text",)  # "text", "image"
    max_images: int = 0
    outputs: tuple[str, ...] = ("image",)  # "image", or "text" and "audio"
    options: tuple[OptionSpec, ...] = ()
    # Defaults of the optional GenerationParams fields that differ from omnistage's own.
    defaults: Mapping[str, float] = field(default_factory=dict)
    # Output sizes must be multiples of this.
    size_multiple: int = 16
    # Whether requests may name LoRA adapters of the model's DiT (GenerationParams.loras).
    loras: bool = False
    # The --quantization modes its DiT offers (DenoiserOptions.quantization), e.g. ("fp8",).
    quantizations: tuple[str, ...] = ()
    # Whether its DiT replays CUDA graphs (DenoiserOptions.cuda_graphs); without, `auto` is off.
    dit_cuda_graphs: bool = False

    def check_quantization(self, family: str, mode: str) -> None:
        """UNIMPLEMENTED for a --quantization mode this family's DiT does not offer."""
        if mode != "none" and mode not in self.quantizations:
            offered = ", ".join(self.quantizations) or "none"
            raise Unimplemented(f"{family} offers no --quantization {mode} (offered: {offered})")


class ModelFamily(Protocol):
    """A family of models served by omnistage, e.g. "qwenimage", "glm-image"."""

    @property
    def name(self) -> str: ...

    @property
    def card(self) -> ModelCard: ...

    @property
    def roles(self) -> tuple[RoleSpec, ...]: ...

    @property
    def modules(self) -> ModuleDeclaration | None:
        """What sleep/wake and offload move; None makes workers scan the stage model's attributes."""
        ...

    @property
    def parallel(self) -> SequenceParallelPlan | None:
        """How its DiT splits over several devices of one replica; None: it does not."""
        ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise omni_common.errors.InvalidArgument for requests the family cannot serve."""
        ...

    def plan(self, request: GenerationRequest) -> Plan:
        """The role calls that serve `request` (validated)."""
        ...

    def load(self, stage: str, model_dir: Path, context: StageContext) -> StageModel:
        """The stage model of `stage` for the roles `context` asks for."""
        ...


def roles_of(family: ModelFamily, stage: str) -> tuple[str, ...]:
    """The names of the roles a family serves on `stage`."""
    return tuple(role.name for role in family.roles if role.stage == stage)

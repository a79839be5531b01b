"""Validation of user-facing generation parameters, shared by the coordinator and every stage.

Each check names the field and the accepted range, so the caller can fix the request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from omni_common.errors import InvalidArgument, ResourceExhausted
from omni_common.input_media import ImageInput
from omni_common.limits import (  # noqa: F401  (re-exported: callers import them from here)
    MAX_CFG,
    MAX_LORA_SCALE,
    MAX_LORAS,
    MAX_OPTION_CHARS,
    MAX_OPTIONS,
    MAX_PIXELS,
    MAX_PROMPT_CHARS,
    MAX_SEQUENCE_LENGTH,
    MAX_SIDE,
    MAX_STEPS,
)
from omni_common.models.base import ChatTurn, GenerationRequest, ModelCard, OptionSpec
from omni_common.models.lora_files import NAME_PATTERN as LORA_NAME
from omni_common.models.lora_files import check_scale
from omnistage.v1 import stage_pb2

MAX_MESSAGES = 256
CHAT_ROLES = ("system", "user", "assistant")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

DEFAULT_SIDE = 1024
DEFAULT_STEPS = 50
DEFAULT_CFG = 4.0
DEFAULT_SEQUENCE_LENGTH = 512


def check_multiple(side: str, value: int, multiple: int) -> None:
    """An output side (`side` names it: "width", "height") that is a multiple of `multiple`:
    16 for every model, more for a family whose grid is coarser (its card's size_multiple)."""
    if value % multiple:
        raise InvalidArgument(f"{side} is {value}; it must be a multiple of {multiple}")


def check_request_id(request_id: str) -> str:
    if not REQUEST_ID.match(request_id):
        raise InvalidArgument("request_id must be 1-128 characters of letters, digits, '.', '_', '-'")
    return request_id


DEFAULTS: dict[str, float] = {
    "width": DEFAULT_SIDE,
    "height": DEFAULT_SIDE,
    "num_inference_steps": DEFAULT_STEPS,
    "true_cfg_scale": DEFAULT_CFG,
    "max_sequence_length": DEFAULT_SEQUENCE_LENGTH,
}


def defaults_for(card: ModelCard | None = None, model: Mapping[str, float] | None = None) -> dict[str, float]:
    """The defaults of the optional fields for a model: omnistage's, then its family's, then
    the model directory's own (omni_common.models.model_defaults), each overriding the last."""
    return {**DEFAULTS, **(card.defaults if card is not None else {}), **(model or {})}


def option_defaults_for(card: ModelCard, model: Mapping[str, str] | None = None) -> dict[str, str]:
    """The value each family option takes when a request does not give it: the model's own
    default, else the family's."""
    return {spec.name: (model or {}).get(spec.name, spec.default) for spec in card.options}


def with_defaults(
    params: stage_pb2.GenerationParams,
    defaults: Mapping[str, float] = DEFAULTS,
    options: Mapping[str, str] | None = None,
) -> stage_pb2.GenerationParams:
    """Fill unset optional fields with `defaults`, and family options the request does not give
    with `options` (a copy; the input is unchanged)."""
    out = stage_pb2.GenerationParams()
    out.CopyFrom(params)
    for name, value in defaults.items():
        if not params.HasField(name):
            setattr(out, name, type(getattr(out, name))(value))
    for name, text in (options or {}).items():
        out.options.setdefault(name, text)
    return out


def check_options(options: Mapping[str, str], specs: tuple[OptionSpec, ...], family: str) -> None:
    """Family options: known names, numbers of the right type, in their documented ranges."""
    known = {spec.name: spec for spec in specs}
    for name, text in options.items():
        spec = known.get(name)
        if spec is None:
            names = ", ".join(known) or "none"
            raise InvalidArgument(f"{family} has no option {name[:MAX_OPTION_CHARS]!r}; its options: {names}")
        shown = text[:MAX_OPTION_CHARS]
        if spec.type == "str":
            if len(text) > MAX_OPTION_CHARS or not text.replace("_", "").replace("-", "").isalnum():
                raise InvalidArgument(f"option {name} is {shown!r}; it must be a name of letters and digits")
            continue
        try:
            value = float(text) if spec.type == "float" else int(text)
        except ValueError:
            raise InvalidArgument(f"option {name} is {shown!r}; it must be a {spec.type}") from None
        if not math.isfinite(value) or not spec.minimum <= value <= spec.maximum:
            raise InvalidArgument(
                f"option {name} is {shown}; it must be in [{spec.minimum:g}, {spec.maximum:g}]"
            )


def to_request(
    params: stage_pb2.GenerationParams,
    *,
    max_pixels: int = MAX_PIXELS,
    images: tuple[ImageInput, ...] = (),
) -> GenerationRequest:
    """Check every field of fully specified params and return the runner-side request (the
    family checks what is its own: its options, its sizes, its images)."""
    if len(params.prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt has {len(params.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    if len(params.negative_prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(
            f"negative_prompt has {len(params.negative_prompt)} characters; the limit is {MAX_PROMPT_CHARS}"
        )
    for name in ("width", "height"):
        value = getattr(params, name)
        if value < 16 or value > MAX_SIDE:
            raise InvalidArgument(f"{name} is {value}; it must be in [16, {MAX_SIDE}]")
        check_multiple(name, value, 16)
    pixels = params.width * params.height
    if pixels > max_pixels:
        raise ResourceExhausted(
            f"{params.width}x{params.height} is {pixels} pixels; this server allows at most {max_pixels}"
        )
    steps = params.num_inference_steps
    if steps < 1 or steps > MAX_STEPS:
        raise InvalidArgument(f"num_inference_steps is {steps}; it must be in [1, {MAX_STEPS}]")
    cfg = params.true_cfg_scale
    if not math.isfinite(cfg) or cfg < 0 or cfg > MAX_CFG:
        raise InvalidArgument(f"true_cfg_scale is {cfg}; it must be a finite number in [0, {MAX_CFG:g}]")
    seq = params.max_sequence_length
    if seq < 1 or seq > MAX_SEQUENCE_LENGTH:
        raise InvalidArgument(f"max_sequence_length is {seq}; it must be in [1, {MAX_SEQUENCE_LENGTH}]")
    if len(params.options) > MAX_OPTIONS:
        raise InvalidArgument(f"{len(params.options)} options given; the limit is {MAX_OPTIONS}")
    for name, value in params.options.items():
        if len(name) > MAX_OPTION_CHARS or len(value) > MAX_OPTION_CHARS:
            raise InvalidArgument(f"option names and values are at most {MAX_OPTION_CHARS} characters")
    loras = check_loras(params.loras)
    messages = chat_turns(params.messages)
    if messages and params.prompt:
        raise InvalidArgument("give the prompt or messages, not both (the prompt is a one-turn conversation)")
    return GenerationRequest(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        width=params.width,
        height=params.height,
        num_inference_steps=steps,
        true_cfg_scale=cfg,
        seed=params.seed,
        max_sequence_length=seq,
        images=images,
        options=tuple(sorted(params.options.items())),
        loras=loras,
        messages=messages,
    )


def chat_turns(messages: Sequence[stage_pb2.ChatMessage]) -> tuple[ChatTurn, ...]:
    """The conversation, checked: known roles, at least one part a message, bounded text (which
    media an index may name is the family's check: `check_media_parts`)."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"{len(messages)} messages given; the limit is {MAX_MESSAGES}")
    turns = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"message {i} has role {message.role[:20]!r}; roles are {', '.join(CHAT_ROLES)}"
            )
        if not message.parts:
            raise InvalidArgument(f"message {i} has no content")
        parts: list[tuple[str, str | int]] = []
        for part in message.parts:
            kind = part.WhichOneof("part")
            if kind is None:
                raise InvalidArgument(f"message {i} has an empty part")
            parts.append((kind, getattr(part, kind)))
        text = sum(len(value) for kind, value in parts if isinstance(value, str))
        if text > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"message {i} has {text} characters; the limit is {MAX_PROMPT_CHARS}")
        turns.append(ChatTurn(message.role, tuple(parts)))
    return tuple(turns)


def check_media_parts(request: GenerationRequest) -> None:
    """With messages, each input audio clip, image and video is shown by exactly one part."""
    if not request.messages:
        return
    counts = {"audio": len(request.audios), "image": len(request.images), "video": len(request.videos)}
    shown: dict[str, list[int]] = {kind: [] for kind in counts}
    for turn in request.messages:
        for kind, value in turn.parts:
            if kind in shown:
                assert isinstance(value, int)
                if value >= counts[kind]:
                    raise InvalidArgument(f"a message shows {kind} {value}; the request has {counts[kind]}")
                shown[kind].append(value)
    for kind, indices in shown.items():
        if sorted(indices) != list(range(counts[kind])):
            raise InvalidArgument(f"the messages must show each input {kind} exactly once (shown: {indices})")


def check_loras(loras: Sequence[stage_pb2.LoraRef]) -> tuple[tuple[str, float | None], ...]:
    """The request's adapters: at most MAX_LORAS, valid names, each once, finite scales."""
    if len(loras) > MAX_LORAS:
        raise InvalidArgument(f"{len(loras)} LoRA adapters named; the limit is {MAX_LORAS}")
    out: list[tuple[str, float | None]] = []
    for ref in loras:
        if not LORA_NAME.fullmatch(ref.name):
            raise InvalidArgument(
                f"LoRA name {ref.name[:80]!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
            )
        if any(name == ref.name for name, _ in out):
            raise InvalidArgument(f"LoRA adapter {ref.name!r} is named twice")
        scale = ref.scale if ref.HasField("scale") else None
        if scale is not None:
            check_scale(scale, f"LoRA scale of {ref.name!r}")
        out.append((ref.name, scale))
    return tuple(out)


def check_takes_loras(request: GenerationRequest, card: ModelCard, family: str) -> None:
    """INVALID_ARGUMENT when a request names adapters its model's family does not take."""
    if request.loras and not card.loras:
        raise InvalidArgument(f"{family} models take no LoRA adapters")

"""OpenAI's image API in omnistage's terms: a JSON body becomes GenerateRequests, a gRPC
status becomes an HTTP status with OpenAI's error body, events become SSE payloads.

What `POST /v1/images/generations` accepts (vllm-omni's fields, which extend OpenAI's):
- `prompt` (required), `model` ("" or absent: the only model served), `n` (1 to the
  gateway's --max-images; image i gets seed + i), `size` ("WxH"; absent or "auto": the
  model's default), `response_format` ("b64_json", the only one: no image is stored to serve
  a URL from), `output_format` ("png");
- `seed` (absent: a random one, as OpenAI's API draws), `num_inference_steps`,
  `negative_prompt`, `guidance_scale` or `true_cfg_scale` (the model's guidance scale);
- `stream` (server-sent events: steps, previews, then each image), `partial_images` (OpenAI:
  how many previews, 0-3) or `preview_every` (a preview every k steps).
Other OpenAI fields (quality, style, user, background, moderation, ...) are accepted and
have no effect. A wrong type or value is 400 with the field named in `param`.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

import grpc

from omni_common.client import generate_request
from omni_common.errors import InvalidArgument, OmniError
from omnistage.v1 import coordinator_pb2 as cpb

MAX_SEED = (1 << 64) - 1
# A request that is not streamed needs no step events: the last step's only (the most steps
# a request may have), which spares every hop an event per step.
LAST_STEP_ONLY = 1000
MAX_BODY_BYTES = 1 << 20  # prompts are at most 10,000 characters each
# An edit's form, images included: what one GenerateRequest may carry (coordinator.proto).
MAX_UPLOAD_BYTES = 48 << 20

# gRPC status -> (HTTP status, OpenAI error type).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


@dataclass(frozen=True)
class ImageJob:
    """A validated POST /v1/images/generations: one GenerateRequest per image asked for."""

    requests: list[cpb.GenerateRequest]
    stream: bool


class BadField(InvalidArgument):
    """A request field of the wrong type or value (OpenAI's error names it in `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class FieldError(OmniError):
    """A coordinator's refusal of one field, with the HTTP field that caused it in `param`."""

    def __init__(self, param: str, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message, code)
        self.param = param


# Which HTTP field a coordinator's message is about, for the routes that send images: its
# messages name GenerationParams' fields (omni_common.models.validation), the first match wins
# ("negative prompt" before "prompt").
IMAGE_FIELDS: tuple[tuple[str, str], ...] = (
    ("unknown model", "model"),
    ("negative prompt", "negative_prompt"),
    ("negative_prompt", "negative_prompt"),
    ("prompt", "prompt"),
    ("width", "size"),
    ("height", "size"),
    ("num_inference_steps", "num_inference_steps"),
    ("true_cfg_scale", "guidance_scale"),
    ("input image", "image"),
    ("max_sequence_length", "max_sequence_length"),
    ("LoRA", "loras"),
    ("option", "extra_body"),
)
# Refusals that are about a field of the request (the others, e.g. 401 or 429, are not).
_FIELD_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
)


def blame(err: OmniError, fields: tuple[tuple[str, str], ...]) -> OmniError:
    """`err` with `param` naming the HTTP field its message is about (`fields`: message text ->
    field, first match wins); an error that names one already, or is not about a field, as is."""
    if getattr(err, "param", None) or err.code not in _FIELD_CODES:
        return err
    for needle, param in fields:
        if needle in err.message:
            return FieldError(param, err.message, err.code)
    return err


def error_body(err: OmniError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, OpenAI's error object and headers (Retry-After on 429) for `err`."""
    status, kind = HTTP_STATUS.get(err.code, (500, "server_error"))
    if getattr(err, "http_status", None) == 408:  # a client too slow to send its body
        status, kind = 408, "invalid_request_error"
    headers = {}
    retry_after_ms = getattr(err, "retry_after_ms", None)
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil((retry_after_ms or 1000) / 1000)))
    body = {
        "error": {
            "message": err.message,
            "type": kind,
            "param": getattr(err, "param", None),
            "code": err.code.name.lower(),
        }
    }
    return status, body, headers


def parse_json(body: bytes) -> dict[str, Any]:
    """The request's JSON object, or 400."""
    if len(body) > MAX_BODY_BYTES:
        raise InvalidArgument(f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("the request body is not valid JSON") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise InvalidArgument("the request body nests arrays or objects too deep") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return doc


def shown(value: object) -> str:
    """A short, safe rendering of a JSON value for an error message (a container is named,
    not printed: it may nest deep)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return json.dumps(value)[:40]


def text_field(name: str, value: str) -> str:
    """`value`, or 400 when it is not text UTF-8 can carry (JSON's "\\ud800" escapes decode to
    lone surrogates, which protobuf and every stage would refuse)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadField(name, f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return value


def typed(doc: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`doc[name]` if absent, null or of `kind`, else 400 naming the field."""
    value = doc.get(name)
    # bool is an int in Python, not in JSON: `"n": true` is a mistake.
    if value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return text_field(name, value) if isinstance(value, str) else value
    raise BadField(name, f"{name} must be {what}, not {shown(value)}")


def number(doc: dict[str, Any], name: str) -> float | None:
    """A finite number field (a JSON integer too large for a float is not one)."""
    value = typed(doc, name, (int, float), "a number")
    if value is None:
        return None
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise BadField(name, f"{name} must be finite")
    return result


def integer(doc: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """An integer field in [low, high], or 400 naming it."""
    value = typed(doc, name, int, "an integer")
    if value is not None and not low <= value <= high:
        raise BadField(name, f"{name} must be in [{low}, {high}], not {value}")
    return value


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """ "512x256" -> (512, 256); None or "auto" -> the model's default."""
    if size is None or size == "auto":
        return None, None
    width, sep, height = size.lower().partition("x")
    # isascii too: "²" and other Unicode digits pass isdigit() but not int().
    digits = width.isascii() and height.isascii() and width.isdigit() and height.isdigit()
    if not sep or not digits or len(size) > 16:
        raise BadField("size", f"size must be WIDTHxHEIGHT (e.g. 512x512) or auto, not {size[:40]!r}")
    return int(width), int(height)


def image_job(doc: dict[str, Any], max_images: int, images: tuple[bytes, ...] = ()) -> ImageJob:
    """Validate a POST /v1/images/generations body (see the module's docstring); `images`: an
    edit's input images (POST /v1/images/edits), which every image of the job is given."""
    prompt = typed(doc, "prompt", str, "a string")
    if not prompt:
        raise BadField("prompt", "prompt is required")
    model = typed(doc, "model", str, "a string") or ""
    n = integer(doc, "n", 1, max_images) or 1
    width, height = parse_size(typed(doc, "size", str, "a string"))
    response_format = typed(doc, "response_format", str, "a string") or "b64_json"
    if response_format != "b64_json":
        raise BadField(
            "response_format",
            f"response_format must be b64_json (images are not stored), not {response_format!r}",
        )
    output_format = typed(doc, "output_format", str, "a string") or "png"
    if output_format != "png":
        raise BadField("output_format", f"output_format must be png, not {output_format!r}")
    seed = integer(doc, "seed", 0, MAX_SEED - max_images)
    steps = integer(doc, "num_inference_steps", 1, 1000)
    negative = typed(doc, "negative_prompt", str, "a string") or ""
    guidance = None
    for name in ("true_cfg_scale", "guidance_scale"):
        value = number(doc, name)
        if value is not None:
            guidance = value if guidance is None else guidance
    stream = typed(doc, "stream", bool, "true or false") or False
    preview_every = integer(doc, "preview_every", 0, 1000) or 0
    partial_images = integer(doc, "partial_images", 0, 3) or 0
    if partial_images and not preview_every:
        # OpenAI's "how many previews": spread over the steps (the model's default when unset).
        preview_every = max(1, (steps or 50) // (partial_images + 1))
    first_seed = secrets.randbits(32) if seed is None else seed
    requests = []
    for i in range(n):
        request = generate_request(
            prompt,
            negative_prompt=negative,
            guidance=guidance,
            seed=first_seed + i,
            model=model,
            image_format="png",
            preview_every=preview_every if stream else 0,
            progress_every=1 if stream else LAST_STEP_ONLY,
            images=images,
        )
        params = request.params
        # Unset fields take the model's defaults at the coordinator.
        params.ClearField("width")
        params.ClearField("height")
        params.ClearField("num_inference_steps")
        params.ClearField("max_sequence_length")
        if width is not None and height is not None:
            params.width, params.height = width, height
        if steps is not None:
            params.num_inference_steps = steps
        requests.append(request)
    return ImageJob(requests, bool(stream))


def image_item(result: cpb.Result, seed: int, timings: dict[str, float]) -> dict[str, Any]:
    """One entry of the response's `data`: OpenAI's fields, then omnistage's (seed, size,
    per-step wall times in ms)."""
    return {
        "b64_json": base64.b64encode(result.image).decode(),
        "revised_prompt": None,
        "seed": seed,
        "size": f"{result.width}x{result.height}",
        "timings_ms": {**timings, "total": round(result.total_ms, 3)},
    }


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event; its `event` is the payload's `type`, as OpenAI's streams send."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def model_entry(info: cpb.ModelInfo) -> dict[str, Any]:
    """GET /v1/models' entry for a served model: OpenAI's fields, then omnistage's."""
    return {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "omnistage",
        "family": info.family,
        "ready": info.ready,
        "inputs": list(info.inputs),
        "outputs": list(info.outputs),
        "max_images": info.max_images,
        "endpoints": endpoints(info),
        "options": [
            {
                "name": o.name,
                "type": o.type,
                "default": o.default_value,
                "minimum": o.minimum,
                "maximum": o.maximum,
                "description": o.description,
            }
            for o in info.options
        ],
        "size_multiple": info.size_multiple,
        "defaults": dict(info.defaults),
    }


def endpoints(info: cpb.ModelInfo) -> list[str]:
    """The routes that serve a model, from what its card says it takes and returns."""
    routes = []
    if "image" in info.outputs:
        routes.append("/v1/images/generations")
        if info.max_images:
            routes.append("/v1/images/edits")
    if "text" in info.outputs:
        routes.append("/v1/chat/completions")
    if "audio" in info.outputs:
        routes.append("/v1/audio/speech")
    return routes

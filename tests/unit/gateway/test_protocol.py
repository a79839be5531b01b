"""The gateway's translation, without a cluster: gRPC status -> HTTP status and OpenAI's
error body, a JSON body -> GenerateRequests; and the gateway needs no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from omni_common.errors import OmniError, ResourceExhausted
from services.gateway.protocol import BadField, error_body, image_job, parse_size

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 401, "authentication_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.DATA_LOSS, 500, "server_error"),
    ],
)
def test_each_status_has_its_http_status_and_openai_error(code, status, kind) -> None:
    got, body, headers = error_body(OmniError("what went wrong", code))
    assert got == status
    assert body == {
        "error": {"message": "what went wrong", "type": kind, "param": None, "code": code.name.lower()}
    }
    assert ("Retry-After" in headers) == (status == 429)


@pytest.mark.parametrize(
    ("hint_ms", "seconds"), [(None, "1"), (1, "1"), (1000, "1"), (1001, "2"), (2500, "3")]
)
def test_retry_after_is_the_coordinators_hint_in_whole_seconds_rounded_up(hint_ms, seconds) -> None:
    _, _, headers = error_body(ResourceExhausted("busy", retry_after_ms=hint_ms))
    assert headers == {"Retry-After": seconds}


def test_sizes() -> None:
    assert parse_size("512x256") == (512, 256)
    assert parse_size(None) == parse_size("auto") == (None, None)
    for bad in ("512", "x512", "512x", "-5x5", "axb", "1" * 20 + "x1"):
        with pytest.raises(BadField):
            parse_size(bad)


def test_n_images_get_consecutive_seeds_and_unset_fields_stay_unset() -> None:
    job = image_job({"prompt": "a cat", "n": 3, "seed": 40}, max_images=10)
    assert [r.params.seed for r in job.requests] == [40, 41, 42]
    params = job.requests[0].params
    # The coordinator fills in the model's defaults.
    for name in ("width", "height", "num_inference_steps", "true_cfg_scale", "max_sequence_length"):
        assert not params.HasField(name), name
    assert not job.stream and job.requests[0].preview_every == 0


def test_extras_and_streaming_options() -> None:
    doc = {
        "prompt": "a cat",
        "size": "64x32",
        "num_inference_steps": 12,
        "negative_prompt": "blurry",
        "guidance_scale": 3,
        "stream": True,
        "partial_images": 2,
        "quality": "hd",  # OpenAI's fields without an effect here are accepted
        "user": "someone",
    }
    (request,) = image_job(doc, max_images=10).requests
    params = request.params
    assert (params.width, params.height, params.num_inference_steps) == (64, 32, 12)
    assert params.negative_prompt == "blurry" and params.true_cfg_scale == 3.0
    assert request.progress_every == 1 and request.preview_every == 4  # 12 steps / (2 + 1)
    # A seed is drawn when none is given (OpenAI's API draws one per request).
    seeds = {image_job({"prompt": "a cat"}, max_images=1).requests[0].params.seed for _ in range(5)}
    assert len(seeds) > 1


def test_n_is_bounded_by_the_gateways_limit() -> None:
    with pytest.raises(BadField) as err:
        image_job({"prompt": "a cat", "n": 5}, max_images=4)
    assert err.value.param == "n"


def test_the_gateway_and_the_sdk_import_no_torch() -> None:
    code = "import sys, services.gateway.server, omni_common.client; print('torch' in sys.modules)"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"

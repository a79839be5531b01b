"""The HTTP gateway on a real in-process cluster (API keys on): OpenAI's own Python client
gets the SDK's pixels, every error class has its HTTP status and OpenAI's error body, the
SSE stream parses with a real HTTP client, and a client that goes away frees its slot."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from omni_common.client import Client
from omni_common.cluster import free_port

from .conftest import InProcessCluster, InProcessGateway

KEY = "gateway-test-key"
MODEL = "qwen-image-tiny"
# Two requests in flight at most: a third one is refused with 429 (test_busy_...).
MAX_IN_FLIGHT = 2
# The coordinator's metrics say how many requests ended CANCELLED.
CANCELLED = ("omnistage_coordinator_requests_failed_total", frozenset({("code", "CANCELLED")}))


def cancelled(cluster: InProcessCluster) -> float:
    return cluster.metrics("coordinator").get(CANCELLED, 0.0)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[InProcessCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISTAGE_API_KEYS", KEY)
        options = {"max_in_flight": MAX_IN_FLIGHT, "metrics_port": free_port()}
        running = InProcessCluster(tiny_model, coordinator_options=options)
        running.start()
        yield running
        running.stop()


@pytest.fixture(scope="module")
def gateway(cluster: InProcessCluster) -> Iterator[InProcessGateway]:
    running = InProcessGateway(cluster.loop, cluster.coordinator)
    yield running
    running.stop()


def openai_client(gateway: InProcessGateway, key: str = KEY) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test as it was sent.
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def pixels(data: bytes | Image.Image) -> np.ndarray:
    image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    return np.asarray(image.convert("RGB"))


def test_openai_client_gets_the_sdks_pixels_for_the_same_seeds(cluster, gateway) -> None:
    response = openai_client(gateway).images.generate(
        model=MODEL,
        prompt="a red fox in snow",
        n=2,
        size="32x32",
        response_format="b64_json",
        extra_body={"seed": 7, "num_inference_steps": 4, "negative_prompt": "blurry", "guidance_scale": 2.5},
    )
    assert len(response.data) == 2
    with Client(cluster.coordinator, api_key=KEY) as sdk:
        for i, item in enumerate(response.data):
            assert item.b64_json is not None
            expected = sdk.generate(
                "a red fox in snow",
                negative_prompt="blurry",
                guidance=2.5,
                width=32,
                height=32,
                steps=4,
                seed=7 + i,
            )
            got = pixels(base64.b64decode(item.b64_json))
            assert got.shape == (32, 32, 3)
            np.testing.assert_array_equal(got, pixels(expected))
    # The two seeds gave two different images (the seed reached the model).
    first, second = (pixels(base64.b64decode(item.b64_json or "")) for item in response.data)
    assert not np.array_equal(first, second)


def test_models_are_listed_and_an_unknown_one_is_404(gateway) -> None:
    client = openai_client(gateway)
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "omnistage"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


def post(url: str, body: object, key: str | None = KEY, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/images/generations", content=content, headers=headers, timeout=timeout)


SMALL = {"prompt": "a cat", "size": "16x16", "num_inference_steps": 2, "seed": 1}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({**SMALL, "size": "33x33"}, "size", "invalid_argument"),  # refused by the coordinator, field named
        ({**SMALL, "size": "big"}, "size", "invalid_argument"),
        ({**SMALL, "n": 0}, "n", "invalid_argument"),
        ({**SMALL, "n": True}, "n", "invalid_argument"),
        ({**SMALL, "response_format": "url"}, "response_format", "invalid_argument"),
        ({**SMALL, "num_inference_steps": "ten"}, "num_inference_steps", "invalid_argument"),
        ({"size": "16x16"}, "prompt", "invalid_argument"),
        (b"{not json", None, "invalid_argument"),
        (b"[1, 2]", None, "invalid_argument"),
        (b'{"prompt": "' + b"x" * (2 << 20) + b'"}', None, "invalid_argument"),  # over 1 MiB
    ],
)
def test_bad_requests_are_400_with_the_field_named(gateway, body, param, code) -> None:
    response = post(gateway.url, body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param


def test_the_openai_client_raises_its_own_error_classes(gateway) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client(gateway).images.generate(prompt="a cat", size="33x33")
    assert "multiple of 16" in str(bad.value) or "16" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        openai_client(gateway).images.generate(model="no-such-model", prompt="a cat", size="256x256")
    with pytest.raises(openai.AuthenticationError):
        openai_client(gateway, key="wrong-key").images.generate(prompt="a cat", size="256x256")


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_api_key_is_401_from_the_coordinators_check(gateway, key) -> None:
    response = post(gateway.url, SMALL, key=key)
    assert response.status_code == 401
    assert error_of(response)["type"] == "authentication_error"
    assert httpx.get(f"{gateway.url}/v1/models", timeout=10).status_code == 401
    # x-api-key works as well as a Bearer token.
    ok = httpx.get(f"{gateway.url}/v1/models", headers={"x-api-key": KEY}, timeout=10)
    assert ok.status_code == 200


def test_an_unknown_model_is_404(gateway) -> None:
    response = post(gateway.url, {**SMALL, "model": "no-such-model"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The data of each server-sent event, parsed as the SSE format says (blank line ends an
    event; `event:` names it; `data:` lines are joined); [DONE] ends the stream."""
    name, data = "", []
    for line in response.iter_lines():
        if line == "":
            if data:
                text = "\n".join(data)
                if text == "[DONE]":
                    yield {"type": "[DONE]"}
                    return
                event = json.loads(text)
                assert event["type"] == name
                yield event
            name, data = "", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def test_busy_is_429_with_retry_after_and_a_client_that_leaves_frees_its_slot(cluster, gateway) -> None:
    before = cancelled(cluster)
    # Two long streamed requests fill the coordinator (max_in_flight 2) ...
    long = {**SMALL, "n": MAX_IN_FLIGHT, "num_inference_steps": 1000, "stream": True}
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/images/generations",
        json=long,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as held:
        assert held.status_code == 200, held.read()
        events = sse_events(held)
        assert next(e for e in events if e["type"] == "image_generation.step")["total"] == 1000
        # ... so a third is refused with the coordinator's retry hint.
        busy = post(gateway.url, SMALL)
        assert busy.status_code == 429
        assert error_of(busy)["type"] == "rate_limit_error"
        assert int(busy.headers["Retry-After"]) >= 1
    # Leaving the stream cancels both requests in the cluster, and a new one is served.
    deadline = time.monotonic() + 10
    while cancelled(cluster) < before + MAX_IN_FLIGHT:
        assert time.monotonic() < deadline, "closing the stream did not cancel its requests"
        time.sleep(0.05)
    assert post(gateway.url, SMALL).status_code == 200


def test_past_the_gateways_deadline_is_504(cluster) -> None:
    hurried = InProcessGateway(cluster.loop, cluster.coordinator, request_timeout_s=0.3)
    try:
        response = post(hurried.url, {**SMALL, "num_inference_steps": 1000})
        assert response.status_code == 504
        assert error_of(response)["type"] == "timeout_error"
    finally:
        hurried.stop()


def test_no_coordinator_is_503(cluster) -> None:
    orphan = InProcessGateway(cluster.loop, f"127.0.0.1:{free_port()}", request_timeout_s=5)
    try:
        response = post(orphan.url, SMALL)
        assert response.status_code == 503
        assert error_of(response)["type"] == "service_unavailable_error"
        assert httpx.get(f"{orphan.url}/health", timeout=10).status_code == 200  # the gateway itself is up
    finally:
        orphan.stop()


def test_the_stream_has_steps_previews_stage_timings_then_the_image(gateway) -> None:
    body = {
        **SMALL,
        "size": "32x32",
        "num_inference_steps": 4,
        "seed": 11,
        "stream": True,
        "preview_every": 2,
    }
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/images/generations",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "[DONE]" and kinds[-2] == "image_generation.completed"
    assert [e["step"] for e in events if e["type"] == "image_generation.step"] == [1, 2, 3, 4]
    previews = [e for e in events if e["type"] == "image_generation.partial_image"]
    assert [e["step"] for e in previews] == [2, 4] and [e["partial_image_index"] for e in previews] == [0, 1]
    assert Image.open(io.BytesIO(base64.b64decode(previews[0]["b64_json"]))).format == "PNG"
    finished = {e["step"]: e for e in events if e["type"] == "image_generation.stage_finished"}
    assert set(finished) == {"encode", "denoise", "decode"}
    assert all(e["wall_ms"] > 0 for e in finished.values())
    completed = events[-2]
    assert completed["seed"] == 11 and completed["size"] == "32x32"
    assert set(completed["timings_ms"]) == {"encode", "denoise", "decode", "total"}
    # The streamed image is the one the plain request gives.
    plain = post(gateway.url, {k: v for k, v in body.items() if k not in ("stream", "preview_every")})
    assert plain.status_code == 200
    np.testing.assert_array_equal(
        pixels(base64.b64decode(completed["b64_json"])),
        pixels(base64.b64decode(plain.json()["data"][0]["b64_json"])),
    )


def test_a_failure_after_the_stream_began_is_an_error_event(cluster) -> None:
    hurried = InProcessGateway(cluster.loop, cluster.coordinator, request_timeout_s=0.3)
    try:
        body = {**SMALL, "num_inference_steps": 1000, "stream": True}
        with httpx.stream(
            "POST",
            f"{hurried.url}/v1/images/generations",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ) as response:
            assert response.status_code == 200  # accepted; the deadline passes later
            events = list(sse_events(response))
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["code"] == "deadline_exceeded"
    finally:
        hurried.stop()


def test_health_and_the_page(gateway) -> None:
    assert httpx.get(f"{gateway.url}/health", timeout=10).json() == {"status": "ok"}
    page = httpx.get(f"{gateway.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "v1/images/generations" in page.text


def test_draining_gateway_says_503_on_health(cluster) -> None:
    leaving = InProcessGateway(cluster.loop, cluster.coordinator)
    url = leaving.url
    stopper = threading.Thread(target=leaving.stop)
    # A request in flight keeps the drain waiting; meanwhile health says 503.
    body = {**SMALL, "num_inference_steps": 300}
    with httpx.Client(timeout=60) as http:
        result: dict[str, int] = {}
        worker = threading.Thread(target=lambda: result.setdefault("status", post(url, body).status_code))
        worker.start()
        time.sleep(0.5)
        stopper.start()
        deadline = time.monotonic() + 10
        while http.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        worker.join(60)
        stopper.join(60)
    assert result["status"] == 200  # the request in flight finished during the drain


def test_the_openai_clients_own_stream_gets_previews_then_the_image(cluster, gateway) -> None:
    stream = openai_client(gateway).images.generate(
        model=MODEL,
        prompt="a red fox in snow",
        size="32x32",
        stream=True,
        partial_images=2,
        extra_body={"seed": 5, "num_inference_steps": 6},
    )
    events = list(stream)
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    completed = [e for e in events if e.type == "image_generation.completed"]
    # partial_images=2 over 6 steps: a preview every 2 steps (2, 4, 6).
    assert [e.partial_image_index for e in partial] == [0, 1, 2]
    (done,) = completed
    with Client(cluster.coordinator, api_key=KEY) as sdk:
        expected = sdk.generate("a red fox in snow", width=32, height=32, steps=6, seed=5)
    np.testing.assert_array_equal(pixels(base64.b64decode(done.b64_json)), pixels(expected))


def test_a_refused_image_cancels_the_others_of_its_request(cluster, gateway) -> None:
    before = cancelled(cluster)
    # Three long images where two fit: the third is refused, so the request is 429 ...
    response = post(gateway.url, {**SMALL, "n": MAX_IN_FLIGHT + 1, "num_inference_steps": 1000})
    assert response.status_code == 429
    # ... and the two accepted ones were cancelled with it, not left running.
    deadline = time.monotonic() + 10
    while cancelled(cluster) < before + MAX_IN_FLIGHT:
        assert time.monotonic() < deadline, "the accepted images of a refused request kept running"
        time.sleep(0.05)
    assert post(gateway.url, SMALL).status_code == 200


def test_a_client_that_stops_waiting_cancels_its_request(cluster, gateway) -> None:
    before = cancelled(cluster)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        post(gateway.url, {**SMALL, "num_inference_steps": 1000}, timeout=0.5)
    deadline = time.monotonic() + 10
    while cancelled(cluster) < before + 1:
        assert time.monotonic() < deadline, "the request of a client that left kept running"
        time.sleep(0.05)


def gateway_metrics(gateway: InProcessGateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_gateway_counts_its_answers_by_status(gateway) -> None:
    route = ("route", "/v1/images/generations")

    def answered(status: int) -> float:
        key = ("omnistage_gateway_requests_total", frozenset({route, ("status", str(status))}))
        return gateway_metrics(gateway).get(key, 0.0)

    ok, bad = answered(200), answered(400)
    assert post(gateway.url, SMALL).status_code == 200
    assert post(gateway.url, {**SMALL, "size": "big"}).status_code == 400
    assert (answered(200), answered(400)) == (ok + 1, bad + 1)
    samples = gateway_metrics(gateway)
    assert samples[("omnistage_gateway_requests_in_flight", frozenset())] == 0
    count = samples[("omnistage_gateway_request_seconds_count", frozenset({route}))]
    assert count >= ok + bad + 2

"""The gateway's JSON, property-based: hypothesis builds bodies for every POST route (the
routes' own field names with any JSON value: Unicode digits, lone surrogates, huge numbers,
deep nesting, wrong types) and bytes that are barely JSON; each answer must be a status below
500 in OpenAI's error shape when it is an error, and the gateway stays up. Over a real gRPC
coordinator that replies from a script (test_gateway_speech.py): the point is the edge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_gateway_speech import Scripted

ROUTES = {
    "/v1/images/generations": ("prompt", "model", "n", "size", "response_format", "output_format", "seed",
                               "num_inference_steps", "negative_prompt", "guidance_scale", "true_cfg_scale",
                               "stream", "preview_every", "partial_images"),
    "/v1/audio/speech": ("input", "model", "voice", "response_format", "speed", "instructions",
                         "stream_format", "seed", "options"),
    "/v1/chat/completions": ("messages", "model", "modalities", "audio", "stream", "n", "max_tokens",
                             "max_completion_tokens", "seed", "options"),
}  # fmt: skip
TRICKY_TEXT = st.sampled_from(
    ["", " ", "²x²", "16x16", "\ud800", "a\udfffb", "wav", "pcm", "sse", "mp3", "Chelsie", "user", "text",
     "audio", "9" * 40, "\x00", "1e999", "auto", "b64_json", "png"]
)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | TRICKY_TEXT
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(TRICKY_TEXT | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Bodies that are hardly JSON: deep nesting, NaN, a BOM, numbers past float range.
RAW = st.sampled_from(
    [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"n": NaN}',
     b'\xef\xbb\xbf{"prompt": "x"}', b'{"speed": 1e400}', b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}",
     b"\xff\xfe", b"", b"null"]
)  # fmt: skip


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    running = Scripted()
    yield running
    running.stop()


def body_for(route: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(ROUTES[route]), VALUES, max_size=6)


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzzed_json_never_makes_a_500(scripted: Scripted, route: str) -> None:
    with httpx.Client(base_url=scripted.gateway.url, timeout=30) as http:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=body_for(route))
        def one(body: dict[str, Any]) -> None:
            # ensure_ascii: lone surrogates travel as JSON escapes, as a hostile client sends them.
            check(http.post(route, content=json.dumps(body).encode()))

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        @given(raw=RAW)
        def raw(raw: bytes) -> None:
            check(http.post(route, content=raw))

        one()
        raw()
        assert http.get("/health").status_code == 200

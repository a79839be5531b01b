"""The gateway's HTTP edge against hostile clients, on real sockets: a request framed two ways
(Content-Length and Transfer-Encoding) is refused and its connection closed, so the request
smuggled behind it is never served; slow headers and slow bodies are cut off (a request whose
headers came is not cut by the header timeout); connections past the cap get 503; an
unexpected fault is OpenAI's 500 with a request id and no traceback; the six image requests
that were once 500s (a size in unicode digits, a lone surrogate in three fields, JSON nested
100,000 deep, as a document and inside a field) are 400s, with a key and without."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from omni_common.cluster import free_port
from omni_common.runtime.config import GatewayConfig
from services.gateway import image_routes, serving
from services.gateway.server import serve_gateway


class Edge:
    """A gateway (its coordinator unreachable: these requests never get that far) on a loop in
    a thread, with short limits."""

    def __init__(self, **limits: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop_event = asyncio.Event()
        started = threading.Event()
        self.url = ""

        def ready(url: str) -> None:
            self.url = url
            started.set()

        config = GatewayConfig(coordinator=f"127.0.0.1:{free_port()}", port=0, request_timeout_s=5)
        self.task = asyncio.run_coroutine_threadsafe(
            serve_gateway(config, ready=ready, stop=self.stop_event, grace_s=1.0, **limits),  # type: ignore[arg-type]
            self.loop,
        )
        assert started.wait(30)
        self.port = int(self.url.rsplit(":", 1)[1])

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.task.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def edge() -> Iterator[Edge]:
    running = Edge(header_timeout_s=1.0, max_connections=64)
    yield running
    running.stop()


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_request_framed_two_ways_is_refused_and_nothing_smuggled_is_served(edge: Edge) -> None:
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (
        b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled
    )
    with edge.connect() as sock:
        sock.sendall(request)
        answer = read_all(sock)  # returns: the server closed the connection
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1") == 1
    assert b"connection: close" in answer.lower() and b'"status":"ok"' not in answer


def test_fifty_slow_header_connections_are_closed(edge: Edge) -> None:
    sockets = [edge.connect() for _ in range(50)]
    try:
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        for sock in sockets:
            assert read_all(sock) == b""  # closed by the server (the socket's own timeout is 30 s)
        assert httpx.get(f"{edge.url}/health", timeout=10).status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def test_a_request_whose_headers_came_is_not_cut_by_the_header_timeout(edge: Edge) -> None:
    with edge.connect() as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
        time.sleep(1.5)  # past the header timeout (1 s): the body's own timeout (30 s) applies now
        sock.sendall(b"{}")
        answer = b""
        while not answer.endswith(b"}}") and (chunk := sock.recv(65536)):  # the JSON error's end
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ") and b'"param":"input"' in answer


def test_a_slow_body_is_408(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "BODY_TIMEOUT_S", 0.5)
    with edge.connect() as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_connections_past_the_cap_get_503() -> None:
    capped = Edge(header_timeout_s=30.0, max_connections=4)
    idle = [capped.connect() for _ in range(4)]
    try:
        with capped.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in idle:
            sock.close()
        capped.stop()


def test_an_unexpected_fault_is_openais_500_with_a_request_id(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("/secret/path/in/a/traceback")

    monkeypatch.setattr(image_routes, "image_job", broken)
    response = httpx.post(f"{edge.url}/v1/images/generations", json={"prompt": "a cat"}, timeout=10)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and response.headers["x-request-id"] in error["message"]
    assert "secret" not in response.text and "Traceback" not in response.text


ONCE_500S = {
    "a size in unicode digits": json.dumps({"prompt": "a cat", "size": "\u00b2x\u00b2"}).encode(),
    "a lone surrogate in prompt": b'{"prompt": "x\\ud800y"}',
    "a lone surrogate in negative_prompt": b'{"prompt": "a", "negative_prompt": "\\udfff"}',
    "a lone surrogate in model": b'{"prompt": "a", "model": "\\ud800"}',
    "a document nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "a field nested 100,000 deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


def test_the_inputs_that_were_500s_are_400s_with_a_key_and_without(edge: Edge) -> None:
    for name, body in ONCE_500S.items():
        for headers in ({}, {"Authorization": "Bearer some-key"}):
            response = httpx.post(
                f"{edge.url}/v1/images/generations",
                content=body,
                headers={"Content-Type": "application/json", **headers},
                timeout=30,
            )
            assert response.status_code == 400, (name, headers, response.text[:200])
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], name
            assert "Traceback" not in response.text, name

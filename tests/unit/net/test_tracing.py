"""Tracing is off unless OTEL_EXPORTER_OTLP_ENDPOINT is set, and off costs nothing: no
interceptor on servers or channels, do-nothing spans, the SDK not even imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_common.net import tracing

REPO = Path(__file__).resolve().parents[3]


def test_off_by_default_nothing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    tracing.setup("test")
    assert not tracing.enabled()
    assert tracing.server_interceptors() == () and not tracing.enabled()
    with tracing.span("anything") as span:
        assert span is tracing.NO_SPAN
    assert tracing.start("anything") is tracing.NO_SPAN


def test_off_the_services_never_import_the_sdk() -> None:
    code = (
        "import sys, omni_common.runtime.serve, omni_common.execution.batching, services.gateway.app, "
        "services.coordinator.flow; print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_endpoint_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"
    )  # nothing listens: spans are dropped
    tracing.setup("test")
    try:
        assert tracing.enabled()
        assert len(tracing.server_interceptors()) == 1 and tracing.enabled()
        # (not ended: an ended span would be exported, and the exporter retry for seconds)
        assert tracing.start("a").is_recording()
    finally:
        tracing.uninstall()
    assert not tracing.enabled()

"""The choice of a device tensor's way to its consumer: CUDA IPC only where it can work,
and each reason for not using it logged once per process."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_common.transport import route
from omni_common.transport.route import Consumer, allocator_refusal, ipc_refusal, use_cuda_ipc

HOST = "host-a"
GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
CUDA0 = torch.device("cuda", 0)  # a descriptor only: nothing here touches CUDA


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omnistage.transport"]


@pytest.fixture(autouse=True)
def one_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process on GPU `GPU` in IPC namespace 7, with nothing said yet."""
    monkeypatch.setattr(route, "gpu_uuid", lambda device: GPU if device.type == "cuda" else "")
    monkeypatch.setattr(route, "ipc_namespace", lambda: 7)
    monkeypatch.setattr(route, "_said", set())
    for var in route.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("consumer", "reason"),
    [
        (Consumer(HOST, 7, GPU), None),
        (Consumer("", 0, GPU), None),  # same host implied, namespace unknown
        (Consumer("host-b", 7, GPU), "the consumer is on another host"),
        (Consumer(HOST, 7, ""), "the consumer has no GPU"),
        (Consumer(HOST, 8, GPU), "the consumer is in another IPC namespace"),
        (Consumer(HOST, 7, "GPU-bbbbbbbb"), "the consumer is on another GPU"),
    ],
)
def test_ipc_only_for_a_consumer_on_the_same_gpu(consumer: Consumer, reason: str | None) -> None:
    assert ipc_refusal(consumer, HOST, CUDA0) == reason


@pytest.mark.parametrize(
    ("var", "conf", "refused"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128, expandable_segments : true", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", True),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", False),
    ],
)
def test_allocator_settings_that_rule_out_ipc(
    monkeypatch: pytest.MonkeyPatch, var: str, conf: str, refused: bool
) -> None:
    monkeypatch.setenv(var, conf)
    reason = allocator_refusal()
    assert (reason is not None) == refused
    if refused:
        assert reason is not None and reason.startswith(var)


def test_a_cpu_tensor_never_goes_by_ipc_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "omnistage.transport"):
        assert not use_cuda_ipc(Consumer(HOST, 7, GPU), HOST, torch.device("cpu"))
    assert ours(caplog) == []


def test_expandable_segments_fall_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = Consumer(HOST, 7, GPU)
    assert use_cuda_ipc(consumer, HOST, CUDA0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.INFO, "omnistage.transport"):
        assert not any(use_cuda_ipc(consumer, HOST, CUDA0) for _ in range(5))
    [record] = ours(caplog)
    assert record.levelno == logging.WARNING and "expandable_segments" in record.getMessage()


def test_each_topology_reason_is_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "omnistage.transport"):
        for _ in range(3):
            use_cuda_ipc(Consumer(HOST, 7, ""), HOST, CUDA0)
            use_cuda_ipc(Consumer(HOST, 7, "GPU-other"), HOST, CUDA0)
    messages = [r.getMessage() for r in ours(caplog)]
    assert len(messages) == 2 and all(r.levelno == logging.INFO for r in ours(caplog))
    assert "has no GPU" in messages[0] and "another GPU" in messages[1]

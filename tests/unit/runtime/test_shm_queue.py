"""ShmQueue: messages with raw tensors through a ring in shared memory (one process here; the
device group tests cross processes)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from omni_common.runtime.shm_queue import ShmQueue
from omni_common.transport import sweep_stale_segments


@dataclass(frozen=True)
class Note:
    index: int
    text: str


@pytest.fixture
def queue() -> Iterator[ShmQueue]:
    made = ShmQueue(multiprocessing.get_context("spawn"), 4096)
    yield made
    made.close()
    assert not made.path.exists()


def test_header_and_tensors_of_every_dtype_arrive_equal(queue: ShmQueue) -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6)[:, ::2],  # not contiguous: sent as its values
    }
    queue.put(Note(1, "hello"), tensors)
    got = queue.get(timeout=1.0)
    assert got is not None
    header, received = got
    assert header == Note(1, "hello")
    assert received.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


def test_an_empty_queue_times_out(queue: ShmQueue) -> None:
    started = time.monotonic()
    assert queue.get(timeout=0.05) is None
    assert time.monotonic() - started >= 0.04


def test_messages_wrap_around_the_ring_in_order(queue: ShmQueue) -> None:
    # 4 KiB ring, messages of 0.2 to 1 KiB, two at a time: the ring wraps many times.
    sent = 0
    for round_ in range(60):
        batch = [torch.full((1 + (round_ * 7 + k * 13) % 200,), float(sent + k)) for k in range(2)]
        for k, tensor in enumerate(batch):
            queue.put(Note(sent + k, ""), {"x": tensor})
        for k, tensor in enumerate(batch):
            got = queue.get(timeout=1.0)
            assert got is not None
            assert got[0].index == sent + k and torch.equal(got[1]["x"], tensor)
        sent += len(batch)


def test_a_full_queue_waits_for_the_reader(queue: ShmQueue) -> None:
    payload = {"x": torch.zeros(400)}  # 1.6 KiB: the third does not fit before a read
    queue.put(Note(0, ""), payload)
    queue.put(Note(1, ""), payload)
    done = threading.Event()

    def third() -> None:
        queue.put(Note(2, ""), payload)
        done.set()

    writer = threading.Thread(target=third)
    writer.start()
    assert not done.wait(0.2), "the writer overwrote a message nobody read"
    first = queue.get(timeout=1.0)
    assert first is not None and first[0].index == 0
    assert done.wait(2.0)
    writer.join()
    assert [queue.get(timeout=1.0)[0].index for _ in range(2)] == [1, 2]  # type: ignore[index]


def test_a_full_queue_with_its_reader_gone_raises(queue: ShmQueue) -> None:
    payload = {"x": torch.zeros(400)}
    queue.put(Note(0, ""), payload)
    queue.put(Note(1, ""), payload)
    with pytest.raises(BrokenPipeError):
        queue.put(Note(2, ""), payload, alive=lambda: False)


def test_a_message_larger_than_half_the_ring_is_refused(queue: ShmQueue) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        queue.put(Note(0, ""), {"x": torch.zeros(1024)})


OWNER = """
import multiprocessing, sys, time
from omni_common.runtime.shm_queue import ShmQueue
queue = ShmQueue(multiprocessing.get_context("spawn"), 4096, sys.argv[1])
print(queue.path, flush=True)
time.sleep(60)
"""


def test_the_queue_of_a_killed_owner_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    # The window this covers: a replica's server killed after making its queues, before its
    # workers mapped them (it unlinks them then).
    mine = ShmQueue(multiprocessing.get_context("spawn"), 4096, str(tmp_path))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        theirs = Path(owner.stdout.readline().strip())
        assert theirs.exists()
        assert sweep_stale_segments(tmp_path) == 0  # both owners live
        owner.kill()
        owner.wait(10)
        assert sweep_stale_segments(tmp_path) == 1
        assert not theirs.exists() and mine.path.exists()
    finally:
        owner.kill()
        owner.wait(10)
        mine.close()
    assert list(tmp_path.iterdir()) == []

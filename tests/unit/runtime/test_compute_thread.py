"""The compute thread: tasks run one at a time in order; a task that renews the thread ends it
after that task and a fresh thread runs the rest, in order; what torch's profiler recorded on
the old thread is dropped with it (nothing stays enabled), and a forked child can still write
it; shutdown cancels what is queued and refuses new work."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from omni_common.runtime.compute_thread import ComputeThread
from omni_common.runtime.profiler import StageProfiler


def test_tasks_run_in_order_and_a_renewed_thread_goes_on_with_the_queue() -> None:
    compute = ComputeThread("test-compute")
    seen: list[tuple[int, int]] = []
    gate = threading.Event()
    compute.submit(gate.wait)  # holds the queue until everything below is queued

    def task(i: int) -> None:
        seen.append((i, threading.get_ident()))
        if i == 2:
            compute.renew()

    futures = [compute.submit(task, i) for i in range(5)]
    gate.set()
    for future in futures:
        future.result(30)
    compute.shutdown()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    threads = [ident for _, ident in seen]
    assert len(set(threads[:3])) == 1 and len(set(threads[3:])) == 1 and threads[2] != threads[3]


def test_renew_is_only_for_the_compute_threads_own_tasks() -> None:
    compute = ComputeThread("test-compute")
    with pytest.raises(RuntimeError, match="from a task on the compute thread"):
        compute.renew()
    compute.shutdown()


def test_shutdown_cancels_queued_work_and_refuses_more() -> None:
    compute = ComputeThread("test-compute")
    started, gate, dropped = threading.Event(), threading.Event(), threading.Event()
    running = compute.submit(lambda: started.set() or gate.wait(30))
    queued = compute.submit(lambda: "never")
    queued.add_done_callback(lambda _: dropped.set())
    assert started.wait(30)
    stopper = threading.Thread(target=compute.shutdown, kwargs={"cancel_futures": True})
    stopper.start()
    assert dropped.wait(30)  # cancelled while the running task still holds the thread
    gate.set()
    stopper.join(30)
    assert running.result(30) is True and queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        compute.submit(print)


def test_a_recording_goes_to_a_forked_writer_and_leaves_with_the_thread(tmp_path: Path) -> None:
    compute = ComputeThread("test-compute")
    profiler = StageProfiler("test", torch.device("cpu"), str(tmp_path / "root"), renew_thread=compute.renew)
    ones = torch.ones(4)
    for _ in range(2):  # a second session starts cleanly on the renewed thread
        compute.submit(profiler.start, "").result(30)
        compute.submit(lambda: [ones.add(1) for _ in range(100)]).result(30)
        recording = compute.submit(profiler.stop).result(30)[0].result(60)
        names = {event.get("name") for event in json.loads(recording.read_text())["traceEvents"]}
        assert "aten::add" in names
        assert not compute.submit(torch._C._autograd._profiler_enabled).result(30)
    profiler.close()
    compute.shutdown()

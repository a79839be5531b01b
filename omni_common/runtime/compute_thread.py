"""The replica's compute thread: one thread runs every task of the model, in order.

An Executor (asyncio's run_in_executor takes it) with one extra: `renew()`, called by a task,
makes its thread end once that task is done and a fresh thread take up the queue, so tasks
still run one at a time and in order. Why: torch's profiler keeps a recording's state in the
thread-local storage of the thread that started it. Processing that state (`_disable_profiler`)
holds the GIL for seconds, stalling every thread of the process; a thread that exits instead
drops it with its thread-locals, without Python (runtime/profiler.py hands the processing to a
forked child first).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class ComputeThread(Executor):
    """One thread at a time runs the submitted tasks in order (see the module's docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._renewing = threading.local()
        self._generation = 0
        self._thread = self._start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            future: Future[T] = Future()
            self._queue.put((future, fn, args, kwargs))
            return future

    def renew(self) -> None:
        """From a task on this thread: the thread ends after this task; a fresh one goes on."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("renew() is called from a task on the compute thread")
        self._renewing.flag = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._queue.put(None)
        while wait and (thread := self._thread).is_alive():
            thread.join()  # a task that renews hands the queue to a successor: join that one too

    def _start(self) -> threading.Thread:
        self._generation += 1
        thread = threading.Thread(target=self._run, name=f"{self.name}-{self._generation}", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)
            if getattr(self._renewing, "flag", False):
                self._start()  # the successor takes the queue; this thread's locals go with it
                return

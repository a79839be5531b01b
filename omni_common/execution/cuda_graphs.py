"""CUDA graphs: a forward captured once per static shape, then replayed.

At small image sizes a DiT forward is launch-bound: Python launches hundreds of small
kernels per block, and the GPU waits for them (Qwen-Image at 512x512 on an H100: 97-125 ms
a forward eager, 56 ms replayed as a graph). A replay launches the whole forward at once.

A graph replays fixed kernels on fixed memory, so the caller pads its inputs to a few
buckets of shapes and names each bucket by a key; this cache captures the function the
first time it sees a key and replays it after. That first call's output is the eager run's
before the capture, so a new key costs the capture's recording, not extra forwards. All
graphs share one memory pool: replays never overlap (one compute thread per device) and each
output is copied out before the next replay, so the pool holds about the activations of the
largest graph, not their sum.

Where the GPU is busy anyway (large batches, large images) a replay saves only the launch
gaps inside a compiled forward (measured on an H100, Qwen-Image: 134.9 ms replayed vs 139.6
ms eager at 1024x1024, 225.9 vs 233.5 ms for 8 at 512x512). So a graph is kept if its replay
beats the eager run of the same inputs, timed at capture, by KEEP_IF_FASTER; otherwise that
key runs eagerly. The measured speed-up (eager / replay) is kept with the graph, so a caller
can tell whether a replay still pays for inputs it must pad (`speedup`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from omni_common.execution.compile_cache import KeepDecisions

log = logging.getLogger("omnistage.cuda_graphs")

Inputs = dict[str, torch.Tensor]
KEEP_IF_FASTER = 0.98  # a replay must take at most this share of the eager time


def _pays(speedup: float) -> bool:
    return speedup * KEEP_IF_FASTER >= 1.0


@dataclass(eq=False)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Inputs  # static buffers the graph reads
    output: torch.Tensor  # the static buffer it writes
    speedup: float  # eager time / replay time, measured at capture


class CudaGraphCache:
    """Captured forwards by key, least recently used dropped beyond `max_graphs`."""

    def __init__(
        self,
        device: torch.device,
        max_graphs: int = 64,
        warmup_runs: int = 2,
        decisions: KeepDecisions | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device = device
        self.decisions = decisions
        self.max_graphs = max_graphs
        self.warmup_runs = warmup_runs
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._eager: set[Hashable] = set()  # decision keys that cannot be captured or gain nothing
        self._speedups: dict[Hashable, float] = {}  # decision keys timed in this process
        # Warm-up and capture share one side stream: libraries (cuBLAS, cuDNN) set up
        # per-stream workspaces on first use, which must not happen inside a capture.
        self._stream = torch.cuda.Stream(device)
        self._pool = self._new_pool()

    def __len__(self) -> int:
        return len(self._graphs)

    def speedup(self, key: Hashable) -> float | None:
        """How much faster the key's replay ran than its eager forward; None without a graph."""
        captured = self._graphs.get(key)
        return None if captured is None else captured.speedup

    def decided(self, decision_key: Hashable) -> bool:
        """Whether a replay's gain for `decision_key` is known (timed in this process or in
        the decisions file): its keys are captured without timing runs, or run eagerly."""
        if decision_key in self._eager or decision_key in self._speedups:
            return True
        return self.decisions is not None and self.decisions.get(decision_key) is not None

    def pays(self, decision_key: Hashable) -> bool:
        """Whether a replay is known to beat the eager run for `decision_key`."""
        if decision_key in self._eager:
            return False
        speedup = self._speedups.get(decision_key)
        if speedup is None and self.decisions is not None:
            speedup = self.decisions.get(decision_key)
        return speedup is not None and _pays(speedup)

    def clear(self) -> None:
        """Drop every graph and give their memory back (the weights are about to move)."""
        self._graphs.clear()
        self._eager.clear()
        self._speedups.clear()
        self._pool = self._new_pool()  # the old pool and its anchor go: freed with the cache
        torch.cuda.empty_cache()

    def _new_pool(self) -> Any:  # torch.cuda's opaque pool handle
        """A memory pool for graphs, held by an anchor graph of one node. PyTorch counts a
        pool's users by the graphs captured into it: once the last is gone, the next capture
        into the pool fails an internal assertion (seen on an H200 with PyTorch 2.11: the
        first graph timed and not kept, then every later capture failed and ran eagerly). The
        anchor lives as long as the pool is this cache's."""
        pool = torch.cuda.graph_pool_handle()
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
            torch.zeros(1, device=self.device)  # one node: PyTorch warns of an empty graph
            self._anchor.capture_end()
        return pool

    def run(
        self,
        key: Hashable,
        inputs: Inputs,
        fn: Callable[[Inputs], torch.Tensor],
        decision_key: Hashable | None = None,
        lockstep: bool = False,
    ) -> torch.Tensor | None:
        """`fn(inputs)` by replaying the graph of `key` (captured now if new); None when
        `fn` cannot be captured or its replay is no faster: the caller runs it eagerly.
        Every call of one key must pass inputs of the same shapes and dtypes; `fn` must read
        nothing but `inputs` and state that stays put (weights). Keys of one `decision_key`
        (default: the key itself) share whether a replay pays, timed once.

        `lockstep`: `fn` holds collectives, and every rank of its group makes this same call.
        The graph is then kept untimed: each rank runs `fn` the same number of times (a
        timing could keep the graph on one rank and drop it on another, and a rank that
        timed a replay more would wait in a collective its peers never join)."""
        captured = self._graphs.get(key)
        if captured is None:
            decision_key = key if decision_key is None else decision_key
            if decision_key in self._eager:
                return None
            return self._capture(key, decision_key, inputs, fn, lockstep)
        self._graphs.move_to_end(key)
        for name, value in inputs.items():
            captured.inputs[name].copy_(value)
        captured.graph.replay()
        return captured.output.clone()

    def _capture(
        self,
        key: Hashable,
        decision_key: Hashable,
        inputs: Inputs,
        fn: Callable[[Inputs], torch.Tensor],
        lockstep: bool = False,
    ) -> torch.Tensor | None:
        """Capture the graph of `key`; returns this call's output, from the eager run that
        precedes a capture (None when even that failed, or the decision is known to be no).
        `lockstep`: one eager run, then the capture, kept untimed (`run`)."""
        known = None if lockstep else self._speedups.get(decision_key)
        if known is None and self.decisions is not None and not lockstep:
            known = self.decisions.get(decision_key)
        if known is not None and not _pays(known):  # timed before: no gain
            self._eager.add(decision_key)
            return None
        static = {name: value.clone() for name, value in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        output: torch.Tensor | None = None
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            self._stream.wait_stream(current)
            try:
                with torch.cuda.stream(self._stream):
                    # Lazy initialisation, caches, compilation. With the decision known (a new
                    # prompt length of a timed bucket) one run, whose output is this call's;
                    # otherwise the last run is the eager time.
                    if known or lockstep:
                        output = fn(static)
                    else:
                        for _ in range(self.warmup_runs - 1):
                            fn(static)
                        torch.cuda.synchronize(self.device)
                        started = time.perf_counter()
                        output = fn(static)
                        torch.cuda.synchronize(self.device)
                        eager_s = time.perf_counter() - started
                current.wait_stream(self._stream)
                output.record_stream(current)  # made on the side stream, used on this one
                static_output = self._record(graph, lambda: fn(static))
            except RuntimeError as err:
                # Something in `fn` is not capturable (a host sync, a host-to-device copy):
                # this shape runs eagerly from now on, which is slower but correct.
                self._eager.add(decision_key)
                log.warning("cannot capture a CUDA graph for %s; running it eagerly: %s", key, err)
                return output
            if known is not None or lockstep:  # paid when first timed, or never timed
                self._keep(key, _Captured(graph, static, static_output, 1.0 if known is None else known))
                return output
            replay_s = min(self._timed(graph.replay) for _ in range(2))
        speedup = eager_s / replay_s
        self._speedups[decision_key] = speedup
        if self.decisions is not None:
            self.decisions.put(decision_key, speedup)
        if not _pays(speedup):
            self._eager.add(decision_key)
            log.info(
                "no CUDA graph for %s: a replay takes %.1f ms, eager %.1f ms",
                key,
                replay_s * 1e3,
                eager_s * 1e3,
            )
            return output
        log.info("CUDA graph for %s: %.1f ms a replay, %.1f ms eager", key, replay_s * 1e3, eager_s * 1e3)
        self._keep(key, _Captured(graph, static, static_output, speedup))
        return output

    def _record(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Capture `fn` into `graph` on the side stream. torch.cuda.graph would first wait for
        the device and empty the allocator's cache, which a serving replica would pay at each
        new key (the next forwards allocate from the driver again); the capture needs neither.
        Thread-local: the stage's event loop thread may open or export tensors (CUDA IPC,
        copies) meanwhile; only this thread must keep from syncing. No other thread may draw
        from the default CUDA generator during a capture (PyTorch refuses: the graph owns its
        offset); the stages draw noise on the CPU."""
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                return fn()
            finally:
                graph.capture_end()

    def _keep(self, key: Hashable, captured: _Captured) -> None:
        self._graphs[key] = captured
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        log.info(
            "captured a CUDA graph for %s, %.3fx eager (%d graphs)", key, captured.speedup, len(self._graphs)
        )

    def _timed(self, fn: Callable[[], object]) -> float:
        """Seconds of `fn` with the device idle before and after it."""
        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

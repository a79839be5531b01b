"""A torch.profiler trace of a stage replica (StageControl.StartProfile / StopProfile).

The profiler starts and stops on the replica's compute thread, where every forward runs, and
records CPU operators (and CUDA kernels on a GPU) until stopped; the trace is written as Chrome
trace JSON, which chrome://tracing and Perfetto (ui.perfetto.dev) open.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omni_common.errors import FailedPrecondition


class StageProfiler:
    """At most one trace at a time; start and stop must run on the compute thread."""

    def __init__(self, stage: str, device: torch.device) -> None:
        self.stage = stage
        self.device = device
        self._profile: profile | None = None
        self._directory: Path | None = None
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> Path:
        """Start recording; the trace will go to `directory` (a new temporary one when empty)."""
        if self._profile is not None:
            raise FailedPrecondition(f"a profile of this {self.stage} is already running; stop it first")
        path = (
            Path(directory)
            if directory
            else Path(tempfile.mkdtemp(prefix=f"omnistage-profile-{self.stage}-"))
        )
        path.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._directory, self._started = path, time.monotonic()
        return path

    def stop(self) -> tuple[Path, float]:
        """Stop recording and write the trace: (its file, seconds recorded)."""
        if self._profile is None or self._directory is None:
            raise FailedPrecondition(f"no profile of this {self.stage} is running")
        prof, self._profile = self._profile, None
        prof.stop()
        seconds = time.monotonic() - self._started
        trace = self._directory / f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}-{id(prof):x}.json"
        prof.export_chrome_trace(str(trace))
        return trace, seconds

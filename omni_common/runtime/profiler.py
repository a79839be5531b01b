"""A torch.profiler trace of a stage replica (StageControl.StartProfile / StopProfile).

Traces go under the replica's profile directory (--profile-dir, by default
omnistage-profiles in the system's temporary directory), each call's in a subdirectory it
names or a new one: a call never chooses where on the machine a file is written. The profiler
starts and stops on the replica's compute thread, where every forward runs, and records CPU
operators (and CUDA kernels on a GPU) until stopped; the trace is written as Chrome trace JSON,
which chrome://tracing and Perfetto (ui.perfetto.dev) open.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omni_common.errors import FailedPrecondition, InvalidArgument

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


class StageProfiler:
    """At most one trace at a time; start and stop must run on the compute thread."""

    def __init__(self, stage: str, device: torch.device, root: str = "") -> None:
        self.stage = stage
        self.device = device
        self.root = Path(root) if root else Path(tempfile.gettempdir()) / "omnistage-profiles"
        self._profile: profile | None = None
        self._directory: Path | None = None
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, name: str) -> Path:
        """Start recording; the trace will go to the subdirectory `name` of the profile
        directory (a new one when empty)."""
        if self._profile is not None:
            raise FailedPrecondition(f"a profile of this {self.stage} is already running; stop it first")
        if name and not NAME.fullmatch(name):
            raise InvalidArgument(
                "a profile name is 1-64 letters, digits, '.', '_' or '-', not starting with '.'"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        if name:
            path = self.root / name
            path.mkdir(exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix=f"{self.stage}-", dir=self.root))
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

"""Worker base: the infrastructure of one device, shared by every stage.

It picks the device and dtype, sets the thread count, owns the single compute thread (one
model forward at a time per device, so the event loop stays free for RPCs) and loads the
model family. Stage workers (services/<stage>/worker.py) add their runner on top.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from omni_common.models.base import GenerationRequest, ModelFamily, StageState
from omni_common.models.registry import family_for_model_dir, model_name_for_dir
from omni_common.runtime.config import StageConfig

T = TypeVar("T")
log = logging.getLogger("omnistage.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """`auto` takes the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {name} was asked for but CUDA is not available")
    return device


class Worker:
    """One stage on one device. Subclasses load a runner in `__init__`."""

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.stage = config.stage
        self.device = pick_device(config.device)
        self.dtype = DTYPES[config.dtype]
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.family: ModelFamily = family_for_model_dir(config.model_dir)
        self.model_name = config.model_name or model_name_for_dir(config.model_dir)
        self.in_flight = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage}-compute")
        log.info(
            "%s: model %s (%s) on %s in %s, %d threads",
            self.stage,
            self.model_name,
            self.family.name,
            self.device,
            config.dtype,
            torch.get_num_threads(),
        )

    def load(self) -> int:
        """The stage's load signal for routing; stages refine it."""
        return self.in_flight

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """Run model work on the device's compute thread without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


@dataclass
class Progress:
    """A step of a stage's work, as its worker reports it (the server turns it into a
    StepProgress event, exporting the checkpoint's tensors)."""

    step: int
    total: int
    step_ms: float = 0.0
    preview_png: bytes = b""
    checkpoint: StageState | None = None


@dataclass(frozen=True)
class StageCall:
    """One validated request to a stage, as its worker sees it."""

    request_id: str
    request: GenerationRequest
    inputs: StageState
    outputs: frozenset[str] = frozenset()
    progress_every: int = 1
    preview_every: int = 0
    # time.monotonic() after which the caller no longer wants the result; None = no deadline.
    deadline: float | None = None
    checkpoint_every: int = 0
    resume: StageState | None = None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

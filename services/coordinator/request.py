"""What the coordinator keeps of one request while its plan runs, and a step's output handles."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from omni_common.errors import DeadlineExceeded
from omni_common.models.base import Plan, PlanStep
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.leases import Leases
from services.coordinator.output_cache import CachedOutput
from services.coordinator.step_streams import Stream

Emit = Callable[[cpb.GenerateEvent], Awaitable[None]]


@dataclass
class FlowRequest:
    """What every step call of one request shares."""

    request_id: str
    params: stage_pb2.GenerationParams
    options: cpb.GenerateRequest
    deadline: float | None  # time.monotonic()
    emit: Emit
    leases: Leases
    media: dict[str, bytes]  # the request's own inputs by tensor name ("input.image.0")
    plan: Plan  # the request's stage calls, as its family planned them
    # Per resumable step: its latest checkpoint and the replica that holds it.
    checkpoints: dict[str, tuple[str, tensor_pb2.StageState]] = field(default_factory=dict)
    failovers: list[str] = field(default_factory=list)
    # Per streaming step: the chunks it sent so far.
    streams: dict[str, Stream] = field(default_factory=dict)
    text: list[str] = field(default_factory=list)  # the reply's text, as TextDelta events sent it
    audio_samples: int = 0  # samples sent in AudioChunk events
    audio_chunks: int = 0

    @property
    def shape(self) -> tuple[object, ...]:
        """What requests share to run in one batch of a step-wise stage, as far as the
        coordinator can tell: the model, the size, the steps and whether CFG doubles them."""
        p = self.params
        return (p.model, p.width, p.height, p.num_inference_steps, p.true_cfg_scale > 1)

    def stream(self, step: str) -> Stream:
        return self.streams.setdefault(step, Stream())

    def timeout(self, stage_timeout_s: float) -> float:
        """The stage call's timeout: the client's remaining time, capped by the stage limit."""
        if self.deadline is None:
            return stage_timeout_s
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"request {self.request_id}: the deadline passed")
        return min(stage_timeout_s, remaining)


@dataclass(eq=False)
class StepOutput:
    """A finished step's output handles and where they live."""

    step: PlanStep
    producer: str  # replica address that holds the memory
    state: tensor_pb2.StageState
    cached: CachedOutput | None = None  # owned by the step cache (not released by the request)
    released: bool = False

"""The messages between a stage's server and its worker: a validated call in, progress out."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from omni_common.models.base import GenerationRequest, RoleCall, StageState
from omni_common.runtime.feeds import Inbox

# A step-wise stage's output meta: how many other requests its step finished too. They head
# for the same next stage within moments; the coordinator passes the count on as that call's
# followers, so a batching stage (vae-decode) waits for them (batching.FOLLOWERS_WAIT_S).
FINISHED_WITH = "omnistage.finished_with"


@dataclass
class Progress:
    """A step of a stage's work, as its worker reports it (the server turns it into a
    StepProgress event, exporting the checkpoint's tensors)."""

    step: int
    total: int
    step_ms: float = 0.0
    preview_png: bytes = b""
    checkpoint: StageState | None = None
    # A chunk of the call's streamed output (StreamingRunner.take_partial).
    partial: StageState | None = None


@dataclass(frozen=True)
class StageCall:
    """One validated request to a stage, as its worker sees it."""

    request_id: str
    request: GenerationRequest
    inputs: StageState
    # The model role to run; "" = the stage's first role.
    role: str = ""
    outputs: frozenset[str] = frozenset()
    progress_every: int = 1
    preview_every: int = 0
    # time.monotonic() after which the caller no longer wants the result; None = no deadline.
    deadline: float | None = None
    checkpoint_every: int = 0
    resume: StageState | None = None
    # A streaming call's later input chunks (`inputs` holds chunk 0); None when not streaming.
    inbox: Inbox | None = None
    # Requests like this one on their way to this stage (StageRequest.followers).
    followers: int = 0
    # Return the role's kept prefix KV instead of running it (StageRequest.export_prefix).
    export_prefix: bool = False

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def role_call(self) -> RoleCall:
        """What a batch or async runner sees of this call."""
        return RoleCall(self.request, self.inputs, self.deadline, self.request_id)


def finished_with(meta: Mapping[str, str]) -> int:
    """Requests whose step-wise stage finished them in the same step as the output of this
    `meta` (its FINISHED_WITH): on their way to the same next stage."""
    try:
        return max(0, int(meta.get(FINISHED_WITH, "0")))
    except ValueError:
        return 0

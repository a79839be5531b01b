"""The step scheduler's choices, as pure functions of plain values: which requests leave before
the next step (their caller went away, their deadline passed), which of the rest step next in
one forward, and how long a batch of new requests waits for company first. No runner, clock
or event loop here: the StepScheduler (step_scheduler.py) describes each request it holds as
a `Queued` and does what `plan_step` says, and tests drive the choice with plain values.

The choice: the oldest ready request and, in arrival order, the other ready ones with its
batch key (e.g. same resolution, CFG, dtype), up to `max_batch` requests and `max_tokens`
compute units per step (the runner's `step_cost`: image tokens x CFG passes for a DiT, 1 for
a token). Serving the oldest request's group first keeps it first come, first served: a
request waits at most for the requests that arrived before it, never for a stream of later
ones. For a streaming runner, the request that stepped longest ago goes first instead (a
stream's latency is per chunk: a long stream must not starve a new one's start).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from omni_common.stages import MAX_BATCH

# A batch of requests that have not stepped yet waits at most this long (from the first one's
# admission) for requests still being admitted: joining a step later, each would make every
# request ahead of it pay one more forward (4 requests sent together: 3 forwards for 3 steps,
# not 4). Requests that reach the stage in waves are gathered by their calls' followers
# (below) or by --batch-window-ms.
ADMIT_WAIT_S = 0.05
# A batch of requests that have not stepped yet, whose calls say more like them are on their
# way (StageCall.followers: a burst the encoder takes in waves), waits for them at most this
# long from the first one's admission: every wave that joins a step later makes the requests
# ahead of it pay one more forward. Followers routed to another replica cost this wait once.
FOLLOWERS_WAIT_S = 0.2


@dataclass(frozen=True)
class StepLimits:
    """A step scheduler's bounds and waits."""

    max_batch: int = MAX_BATCH  # requests per step
    max_tokens: int = 65536  # compute units per step (the runner's step_cost)
    # --batch-window-ms: a batch of new requests waits this long for company even when none is
    # being admitted (requests that reach the stage in waves: throughput for latency).
    batch_window_s: float = 0.0
    admit_wait_s: float = ADMIT_WAIT_S
    followers_wait_s: float = FOLLOWERS_WAIT_S


@dataclass(frozen=True)
class Queued:
    """One request at a step scheduler, as its choices see it."""

    key: Hashable  # its batch key: requests with equal keys may share a forward
    cost: int  # compute units of one of its steps
    admitted: float = 0.0  # time.monotonic() at its admission
    ready: bool = True  # it may step now (its input is there; no launched step finished it)
    step_index: int = 0  # steps done (above 0 before any step here when it resumed)
    last_step: float = 0.0  # time.monotonic() of its last step; 0 before the first
    followers: int = 0  # requests like it its call says are on their way
    deadline: float | None = None  # time.monotonic(); None: none
    gone: bool = False  # its caller stopped listening


@dataclass(frozen=True)
class StepPlan:
    """What to do before and at the next step: indices into the requests `plan_step` got."""

    gone: tuple[int, ...] = ()  # leave quietly
    expired: tuple[int, ...] = ()  # leave with DEADLINE_EXCEEDED
    batch: tuple[int, ...] = ()  # step together next, in this order; empty: none is ready
    wait_s: float = 0.0  # wait this long for company first (where no step is in flight)


def plan_step(
    queued: Sequence[Queued],
    limits: StepLimits,
    *,
    now: float,
    admitting: int = 0,
    streaming: bool = False,
) -> StepPlan:
    """The requests that leave, the next batch among the rest, and its wait for company.
    `admitting`: requests being prepared, about to join; `streaming`: the runner streams."""
    gone = tuple(i for i, q in enumerate(queued) if q.gone)
    expired = tuple(
        i for i, q in enumerate(queued) if not q.gone and q.deadline is not None and now >= q.deadline
    )
    leaving = set(gone) | set(expired)
    ready = [i for i, q in enumerate(queued) if q.ready and i not in leaving]
    batch = next_batch(queued, ready, limits, streaming=streaming)
    wait_s = 0.0
    if not streaming:
        wait_s = company_wait_s([queued[i] for i in batch], limits, now=now, admitting=admitting)
    return StepPlan(gone=gone, expired=expired, batch=batch, wait_s=wait_s)


def next_batch(
    queued: Sequence[Queued], ready: Sequence[int], limits: StepLimits, *, streaming: bool = False
) -> tuple[int, ...]:
    """The requests (indices among `ready`, which is in arrival order) that step next together:
    the first one's batch key group within the limits; empty when none is ready."""
    if not ready:
        return ()
    if streaming:  # the one that stepped longest ago first (sorted is stable: arrival order)
        ready = sorted(ready, key=lambda i: queued[i].last_step)
    first = queued[ready[0]]
    batch, cost = [ready[0]], first.cost
    for i in ready[1:]:
        if len(batch) >= limits.max_batch:
            break
        if queued[i].key == first.key and cost + queued[i].cost <= limits.max_tokens:
            batch.append(i)
            cost += queued[i].cost
    return tuple(batch)


def company_wait_s(batch: Sequence[Queued], limits: StepLimits, *, now: float, admitting: int = 0) -> float:
    """How long `batch` waits before its first step for requests that would join it: while
    others are being admitted (up to `admit_wait_s`), while followers its calls announced have
    not come (up to `followers_wait_s`) or within the batch window, each counted from its first
    request's admission. 0 for a full batch or one that has stepped (or resumes mid-way)."""
    if not batch or len(batch) >= limits.max_batch or any(q.step_index for q in batch):
        return 0.0
    window = max(limits.batch_window_s, limits.admit_wait_s if admitting else 0.0)
    expected = max(i + 1 + q.followers for i, q in enumerate(batch))
    if len(batch) < min(expected, limits.max_batch):
        window = max(window, limits.followers_wait_s)
    return max(window - (now - min(q.admitted for q in batch)), 0.0)

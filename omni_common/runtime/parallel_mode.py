"""How a replica over several devices runs a new request: the mode, chosen per request from the
batch in flight and the request's shape by a pure function (`choose_mode`), logged when it
changes.

- one-device: the request lives on one rank and steps there alone, as on a one-device replica
  (no collective); the other ranks are free for other requests.
- data-parallel: the same, with several requests in flight: each on the rank with the fewest
  states, so the ranks step different requests at once (independent replicas inside one).
- cfg-parallel: with true CFG, the two halves of the ranks run one branch each.
- sequence-parallel: every rank holds the request and runs a share of its image tokens (Ulysses).

The thresholds come from measurements in the replica: 2 H100s of one host, Qwen-Image at real
size, 20 steps, 2 GPUs / 1 GPU (docs/benchmarks.md, 2026-11-27, the spread attention
overlapping its all-to-alls). A lone request at 1024x1024: 0.614 spread, 0.518 with CFG. At
512x512: 0.533 with CFG (CFG parallel; 1.011 on one rank), 0.764 spread without CFG (1.003 on
one rank). Hence, in image tokens of one step with CFG counted twice (Qwen-Image: (W/16)(H/16),
1024 at 512x512): CFG parallel from 2048 (512x512 with CFG), sequence parallel from 1024
(512x512), below them one rank per request (smaller images were not timed spread).

Spreading costs GPU time under load: a forward spread at 512x512 keeps both GPUs busy for 0.76
of one GPU's time, 1.5x the GPU time (CFG parallel costs none: each rank runs one branch, one
gather of the prediction a step). So the batch counts the requests known to be arriving as well
as those in flight: a second request goes to another rank whatever its size (two requests on two
devices at once beat two requests split over both, one after the other, by the collectives'
whole cost), and a burst's first request, whose call announces the others (the coordinator's
followers), starts on one rank too. Before the followers counted, 8 requests at once at 512x512
made 1.475x the images/s of one GPU with a lone request spread, against 1.869x with each on one
rank: the burst's first request had arrived alone and spread. Counting them, 1.856x, and a lone
512x512 request spread at 0.777 (the same replica, 2026-11-27 evening).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("omnistage.parallel_mode")

ONE_DEVICE = "one-device"
DATA_PARALLEL = "data-parallel"
CFG_PARALLEL = "cfg-parallel"
SEQUENCE_PARALLEL = "sequence-parallel"
COLLECTIVE = (CFG_PARALLEL, SEQUENCE_PARALLEL)  # the modes whose states live on every rank
# --parallel-mode: auto chooses per request; the others force where requests live.
POLICIES = ("auto", SEQUENCE_PARALLEL, DATA_PARALLEL)
# auto's thresholds, in image tokens of one step (CFG counted twice): 512x512 with CFG, 512x512.
CFG_PARALLEL_TOKENS = 2048
SEQUENCE_PARALLEL_TOKENS = 1024


class PolicySettings(Protocol):
    """The stage settings a policy reads (StageConfig's --parallel-mode and thresholds)."""

    @property
    def parallel_mode(self) -> str: ...

    @property
    def cfg_parallel_tokens(self) -> int: ...

    @property
    def sequence_parallel_tokens(self) -> int: ...


@dataclass(frozen=True)
class ParallelPolicy:
    """The replica's settings for choose_mode (--parallel-mode and its thresholds)."""

    # auto; sequence-parallel: every request on every rank (CFG parallel where it applies);
    # data-parallel: every request on one rank.
    mode: str = "auto"
    # Image tokens of one step (CFG counted twice) from which a lone request is split.
    cfg_parallel_tokens: int = CFG_PARALLEL_TOKENS
    sequence_parallel_tokens: int = SEQUENCE_PARALLEL_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"parallel mode {self.mode!r}; it is one of {', '.join(POLICIES)}")

    @classmethod
    def of(cls, config: PolicySettings) -> ParallelPolicy:
        """The policy a stage's settings name."""
        return cls(config.parallel_mode, config.cfg_parallel_tokens, config.sequence_parallel_tokens)


def choose_mode(batch: int, tokens: int, cfg: bool, world: int, policy: ParallelPolicy) -> str:
    """The mode of a new request: `batch` states in flight counting it and the requests known to
    be arriving, `tokens` image tokens of its step (CFG counted twice), true CFG or not, over
    `world` ranks."""
    if world < 2:
        return ONE_DEVICE
    cfg_splits = cfg and world % 2 == 0
    if policy.mode == SEQUENCE_PARALLEL:
        return CFG_PARALLEL if cfg_splits else SEQUENCE_PARALLEL
    local = ONE_DEVICE if batch <= 1 else DATA_PARALLEL
    if policy.mode == DATA_PARALLEL or batch >= world:
        return local
    if cfg_splits and tokens >= policy.cfg_parallel_tokens:
        return CFG_PARALLEL
    if tokens >= policy.sequence_parallel_tokens:
        return SEQUENCE_PARALLEL
    return local


def spreads(rows: int, image_tokens: int, world: int, policy: ParallelPolicy) -> bool:
    """Whether a forward of `rows` requests, each an image of `image_tokens` tokens, can run
    spread over several of `world` ranks under `policy`, for requests with or without CFG: the
    forwards a replica compiles spread before it serves. Such a forward holds the requests
    split together, each admitted while fewer than `world` were in flight. A CFG branch runs on
    a half of the ranks wherever their number is even, so it spreads only over halves of two
    ranks or more."""
    for cfg in (False, True):
        mode = choose_mode(rows, image_tokens * (2 if cfg else 1), cfg, world, policy)
        over = world // 2 if cfg and world % 2 == 0 else world
        if mode in COLLECTIVE and over > 1:
            return True
    return False


class ModeLog:
    """Logs the chosen mode when it differs from the last one logged."""

    def __init__(self) -> None:
        self.last = ""

    def chose(self, mode: str, batch: int, tokens: int, cfg: bool) -> None:
        if mode != self.last:
            log.info(
                "parallel mode %s (requests in flight or arriving %d, step tokens %d, cfg %s)",
                *(mode, batch, tokens, cfg),
            )
            self.last = mode

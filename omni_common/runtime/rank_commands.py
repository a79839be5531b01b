"""The commands a replica's server process (worker_group.py) sends its device worker processes
(rank.py), and their answers: each a frozen dataclass of plain values, pickled into the ring's
header; its tensors travel beside it, as raw bytes (shm_queue.py)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from omni_common.models.base import GenerationRequest


@dataclass(frozen=True)
class Prepare:
    """A new request: its inputs come as tensors; `sid` names its state from now on."""

    sid: int
    request: GenerationRequest
    meta: dict[str, str]


@dataclass(frozen=True)
class Restore:
    """Move a prepared state to a checkpoint (the checkpoint's tensors come beside it)."""

    sid: int
    meta: dict[str, str]


@dataclass(frozen=True)
class Step:
    """One step of these states (they share a batch key): collective, every rank holds them all
    and they run in one forward spread over the ranks; otherwise each rank steps those it holds,
    in one forward of its own, with no collective."""

    sids: tuple[int, ...]
    collective: bool = True


@dataclass(frozen=True)
class Read:
    """Rank 0 only: a state's checkpoint or preview."""

    sid: int
    what: str  # "checkpoint" or "preview"


@dataclass(frozen=True)
class Finish:
    """A finished state's output (each rank that held it answers with it, and drops it)."""

    sid: int


@dataclass(frozen=True)
class Release:
    """An unfinished state leaves (cancelled, expired, failed)."""

    sid: int


@dataclass(frozen=True)
class StartProfile:
    """Record this rank's commands (profiler.StageProfiler, bounded by the stage's profile
    settings) into `directory`/rank-N: `directory` is the replica's own profile session's,
    made owner-only by the server process."""

    directory: str


@dataclass(frozen=True)
class StopProfile:
    """End this rank's recording. The answer is the directory its trace goes to: a process of
    the rank's own joins the segments there while the rank runs no command (profiler.py), so
    a stop never holds the replica's steps."""


@dataclass(frozen=True)
class Stop:
    """Exit."""


@dataclass(frozen=True)
class RankReply:
    """A rank's answer to one command: `value` (plain values; tensors beside it), or the
    status code name and message of the error it raised."""

    rank: int
    value: object = None
    code: str = ""
    error: str = ""


@dataclass(frozen=True)
class Prepared:
    """What the server's scheduler needs of a new state."""

    key: Hashable
    cost: int
    total_steps: int


@dataclass(frozen=True)
class Stepped:
    """After a step: the states this rank stepped, each one's step index and whether its latents
    are finite."""

    sids: tuple[int, ...]
    steps: tuple[int, ...]
    finite: tuple[bool, ...]


@dataclass(frozen=True)
class Mapped:
    """The rank has both its queues mapped (its first answer, before it loads anything)."""


@dataclass(frozen=True)
class Ready:
    """The rank has its model loaded and joined the group."""

    device: str
    weight_bytes: int

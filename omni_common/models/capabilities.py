"""What a runner can do beyond its kind's contract (the runner protocols in base.py), by name.

The worker and the step scheduler ask `isinstance(runner, TakesLoras)`, never whether an
attribute of some name is there (`hasattr`): a capability is declared once, here, with what it promises.
Each is runtime-checkable, so isinstance checks that its members exist (their types are mypy's
to check); a runner has a capability by having its members, without naming the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

import torch

from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState, StepState
from omni_common.models.lora import LoraLayers

Branch = Callable[[], torch.Tensor]


@runtime_checkable
class StreamingRunner(Protocol):
    """A StepRunner whose requests stream: outputs leave in chunks while the request runs
    (`take_partial`), and, for a plan step with `streamed` inputs, inputs arrive in chunks
    (`feed`); a state steps only when `ready` (it has the input its next step needs).
    The first input chunk comes with `prepare`."""

    def feed(self, state: StepState, chunk: StageState, end: bool) -> None:
        """Add the next input chunk (in order); `end`: no more will come."""
        ...

    def ready(self, state: StepState) -> bool:
        """Whether the next step of `state` has its input."""
        ...

    def take_partial(self, state: StepState) -> StageState | None:
        """The output made since the last call, as the next chunk; None when there is none.
        Called after every step; a finished state's last chunk is taken before `finish`."""
        ...


@runtime_checkable
class HasIdleWork(Protocol):
    """A StepRunner with work to do ahead while no request is here (e.g. a CUDA graph of a
    common shape, a deferred warm-up): its scheduler calls it between requests."""

    def idle_work(self) -> bool:
        """One short unit of the work; False when nothing is left (or it cannot be done now)."""
        ...

    def idle_work_left(self) -> int:
        """How many units remain (the stage's metrics)."""
        ...


@runtime_checkable
class TakesLoras(Protocol):
    """A runner whose model takes LoRA adapters (the stage's StageControl adds, removes and
    pins them; requests name them in GenerationParams.loras)."""

    loras: LoraLayers


@runtime_checkable
class CachesFromWeights(Protocol):
    """A runner that keeps values computed from its weights (a packed modulation table, a
    prompt-prefix KV cache): LoadWeights changes the weights in place, then calls it."""

    def weights_changed(self) -> None:
        """Drop what was computed from the old values, before any later step runs."""
        ...


@runtime_checkable
class HoldsCudaGraphs(Protocol):
    """A runner that may capture CUDA graphs: they hold the weights' device addresses, which a
    sleep frees."""

    def forget_cuda_graphs(self) -> None:
        """Drop the captured graphs (later calls capture them again); nothing to do without."""
        ...


@runtime_checkable
class SupportsPrefixCache(Protocol):
    """A generator that keeps its prompts' prefix KV for later prompts (prefix_cache.py);
    the stage's metrics read its counters."""

    def prefix_stats(self) -> Any:
        """A prefix_cache.PrefixStats."""
        ...


@runtime_checkable
class ExportsPrefixes(Protocol):
    """A generator whose kept prefix KV another replica can install (StageRequest.export_prefix,
    prefix_transfer.py): a conversation's next turn then runs there without its earlier turns'
    prefill."""

    def export_prefix(self, request: GenerationRequest, inputs: StageState) -> StageState:
        """The KV of the longest kept prefix of `request`'s prompt (empty when none)."""
        ...


@runtime_checkable
class PlacesRequests(Protocol):
    """A StepRunner that places each request it prepares (a replica over several devices: on
    one device or spread over all), better knowing how many more are on their way: the
    scheduler prepares through `prepare_among`, with the requests its call announced behind it
    (StageCall.followers: a burst the earlier stage takes in waves) and those being admitted
    beside it."""

    def prepare_among(self, request: GenerationRequest, inputs: StageState, arriving: int) -> StepState:
        """`prepare`, with `arriving` more requests expected within moments."""
        ...


@runtime_checkable
class PrefillsInChunks(Protocol):
    """A generator that prefills a long prompt a chunk per step, between the decode steps of
    the requests already running (chunked prefill); the stage's metrics count its chunks."""

    def prefill_chunks(self) -> int:
        """Prefill chunks run by steps so far."""
        ...

    def is_prefilling(self, state: StepState) -> bool:
        """Whether `state`'s prompt is still being prefilled (its steps pick no token yet)."""
        ...


@runtime_checkable
class ConfiguresExecution(Protocol):
    """A denoiser whose execution (attention backend, torch.compile, CUDA graphs) is set after
    it loads, e.g. once a replica over several devices has put its hooks in."""

    def configure(self, options: DenoiserOptions) -> None: ...


@runtime_checkable
class SpreadsForwards(Protocol):
    """A denoiser whose forwards a replica over several devices may spread over them (sequence
    or CFG parallel) as well as run on one device. While `spread` is set (None: this device
    alone), it names the group the next forward spreads over, the same on every rank of it
    (empty: none, the forward runs here alone); a spread forward replays only the graphs every
    rank of its group captured together (the collectives inside, no timing that could keep a
    graph on one rank and drop it on another). `rehearse` runs again, without graphs, those of
    its warm-up's forwards that `spreads(rows, image tokens)` says the replica may spread, so
    that it compiles the spread shapes before a request meets them."""

    spread: Callable[[], Hashable] | None

    def rehearse(self, spreads: Callable[[int, int], bool]) -> None: ...


@runtime_checkable
class SplitsCfgBranches(Protocol):
    """A denoiser whose two CFG branches (conditional, unconditional) may run elsewhere: a
    replica over several devices sets `cfg_branches` to run them on different ones (None: both
    here, the conditional first)."""

    cfg_branches: Callable[[Branch, Branch], tuple[torch.Tensor, torch.Tensor]] | None

"""What the talker's and token2wav's checkpoints share: a request's random generator as bytes,
and checked reads of a checkpoint's counters.

A checkpoint comes back from the coordinator, which stores it for the replica that takes over;
every field is checked as an input: INVALID_ARGUMENT for one that does not fit the request."""

from __future__ import annotations

import torch

from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.base import StageState

GENERATOR = "generator"  # the checkpoint tensor holding the request's generator state


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """`generator`'s state (uint8 [n]; a CPU generator's is ~5 KB, a CUDA one's 16 bytes)."""
    return generator.get_state().clone()


def restore_generator(generator: torch.Generator, checkpoint: StageState) -> None:
    """Set `generator` to the checkpoint's state. NOT_FOUND when the state is of another kind of
    generator (a checkpoint taken on another device type): the step then starts again from the
    seed here, as it would without a checkpoint."""
    state = checkpoint.tensors.get(GENERATOR)
    if state is None or state.dtype != torch.uint8 or state.dim() != 1:
        raise InvalidArgument("the checkpoint has no generator state (uint8 [n])")
    if state.numel() != generator.get_state().numel():
        raise NotFound("the checkpoint's generator is of another device type than this replica's")
    generator.set_state(state.cpu().contiguous())


def meta_int(checkpoint: StageState, name: str, low: int, high: int) -> int:
    """The checkpoint's integer `name`, in [low, high]."""
    try:
        value = int(checkpoint.meta.get(name, ""))
    except ValueError:
        raise InvalidArgument(f"the checkpoint has no valid {name}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"the checkpoint's {name} {value} is outside [{low}, {high}]")
    return value

"""Where a family's torch modules are, by dotted path from its stage model: what sleep/wake and
offload move (ModuleDeclaration), and how its DiT splits over the devices of one replica
(SequenceParallelPlan). A family declares them; the runtime reads them (omni_common/runtime/memory.py,
sequence_parallel.py), so a new family adds declarations, not runtime code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Module roles: what sleep/wake and offload move (ModuleDeclaration), not model roles.
MODULE_ROLES = ("dit", "encoder", "vae", "resident")


@dataclass(frozen=True)
class ModuleDeclaration:
    """A family's torch modules by module role, as dotted paths relative to a stage model (e.g.
    "transformer.img_in"). Sleep moves every declared module's weights except those of
    `resident` modules (small ones that must stay on the device); `layers` name module lists
    (transformer blocks) that layerwise offload streams through the device one at a time."""

    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.roles) - set(MODULE_ROLES)
        if unknown:
            raise ValueError(f"unknown module roles {sorted(unknown)}; roles are {MODULE_ROLES}")


@dataclass(frozen=True)
class SequenceParallelPlan:
    """How a family's DiT splits across the devices of one replica (Ulysses sequence parallel,
    omni_common/runtime/sequence_parallel.py): the image tokens are split across the ranks, the
    text tokens are replicated, and attention exchanges heads for tokens around its core.

    Every name is declarative, so the next family adds a plan, not a fork of the runtime: the
    DiT module, the forward keyword arguments that hold its image tokens [B, N, C] (split on
    dim 1; its output, element 0 of the returned tuple, is gathered on dim 1) and its text tokens
    [B, L, C] (replicated), the submodule whose output element `rotary_output` holds per-image-token
    rotary embeddings (split on dim 0), the attention function its attention processors call
    with joint query/key/value [B, S, H, D] (text tokens first, then image tokens) as
    "module:function", and the config key of its head count.

    Optionally, `overlapped` names ("module:function") what installs the family's own spread
    attention, one that projects by destination rank so the all-to-all moves while the rest is
    projected: called as function(dit, spread) with the runtime's execution.spread.Spread, it
    returns whether it installed; where it did not, the attention function's wrapper spreads."""

    module: str
    tokens: str
    text: str
    rotary: str
    rotary_output: int
    attention: str
    heads: str
    overlapped: str = ""

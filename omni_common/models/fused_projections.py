"""Sibling projections of a decoder layer (an attention's q/k/v, an MLP's gate/up) computed as
one matrix product: at decode, each product reads its weights once for a few rows, and three
small products (k and v are 1/7 of q at 7 B) run well under the bandwidth one product of their
joint weights reaches (H100, the thinker: q 11.8 us, k and v 5.2 us + a 2 us reduction each).

The joint weight is one buffer; each projection's weight and bias become views of it, so the
model holds no second copy and anything else that reads them (a prefill, a LoRA) sees the same
values. The first projection of a group computes the joint product and keeps it with its input;
the others return their slice of it when called with that same input (the order transformers'
layers call them in), and compute alone otherwise. The last one's call lets both go: a long
prefill's joint products (a 2,000-token prompt's: ~4 GiB over the 7 B thinker's 28 layers)
would otherwise stay until the next forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Joint:
    """The joint product of one group, kept between its projections' calls."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        self.weight = weight
        self.bias = bias
        self.sizes = list(sizes)
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()


class FusedProjection(nn.Module):
    """Projection `index` of a fused group (its weight and bias views of the joint ones)."""

    def __init__(self, linear: nn.Linear, joint: _Joint, index: int) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.joint = joint
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joint = self.joint
        if self.index == 0:
            joint.input = x
            joint.parts = torch.nn.functional.linear(x, joint.weight, joint.bias).split(joint.sizes, dim=-1)
            return joint.parts[0]
        if joint.input is x:
            part = joint.parts[self.index]
            if self.index == len(joint.sizes) - 1:
                joint.input, joint.parts = None, ()
            return part
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _fuse(module: nn.Module, names: Sequence[str]) -> None:
    linears: list[Any] = [getattr(module, name) for name in names]
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        biased = all(linear.bias is not None for linear in linears)
        bias = torch.cat([linear.bias for linear in linears]) if biased else None
    sizes = [linear.out_features for linear in linears]
    joint = _Joint(weight, bias, sizes)
    offset = 0
    for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
        span = slice(offset, offset + sizes[index])
        linear.weight = nn.Parameter(weight[span], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[span], requires_grad=False)
        setattr(module, name, FusedProjection(linear, joint, index))
        offset += sizes[index]


def fuse_projections(decoder: nn.Module) -> int:
    """Fuse every group of GROUPS found in `decoder`'s modules (all of a group's projections
    plain Linears on one device and dtype, biased alike); returns how many were fused."""
    fused = 0
    for module in list(decoder.modules()):
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            if len({(lin.weight.dtype, lin.weight.device, lin.bias is None) for lin in linears}) != 1:  # type: ignore[union-attr]
                continue
            _fuse(module, names)
            fused += 1
    return fused

"""Qwen-Image's feed-forward GELU in its matrix multiply's epilogue, for the compiled forward.

diffusers' FeedForward ("gelu-approximate") runs its first linear layer, then the tanh GELU as
a kernel of its own, which reads and writes the [tokens, 12288] hidden activations once more:
6.4 ms of a 1024x1024 step on an H200, 8.5 ms of a step of 8 at 512x512
(benchmarks/dit_profile.py). cuBLASLt applies the GELU in the GEMM's epilogue instead
(`torch._addmm_activation`, which inductor calls as it is): one linear layer of the image
stream then costs 3% more than without the GELU, not 13%. The math is the same, rounded once
where diffusers rounds twice (the biased product is not rounded to bf16 before the GELU), so
the outputs agree to float rounding, not bit for bit: only traced code on a GPU takes it, and
eager calls (the CPU's parity path, LoRA steps) stay diffusers' own.
"""

from __future__ import annotations

import torch
from diffusers.models.activations import GELU
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from omni_common.models.qwenimage.modulation import swap_class


class EpilogueGELU(GELU):
    """diffusers' GELU layer (Linear, then GELU); traced on a GPU with the tanh approximation,
    one cuBLASLt call with the GELU in its epilogue."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        fused = (
            torch.compiler.is_compiling()
            and hidden_states.is_cuda
            and self.approximate == "tanh"
            and proj.bias is not None
            and proj.weight.dtype == hidden_states.dtype  # an FP8 layer (fp8.py) runs its own product
            and not (proj._forward_hooks or proj._forward_pre_hooks)  # adapters' hooks run eagerly
        )
        if not fused:
            return super().forward(hidden_states)
        rows = hidden_states.flatten(0, -2)
        out = torch._addmm_activation(proj.bias, rows, proj.weight.t(), use_gelu=True)
        return out.unflatten(0, hidden_states.shape[:-1])


def fuse_gelu_epilogue(transformer: QwenImageTransformer2DModel) -> None:
    """Let the image stream's feed-forward layers of `transformer` apply their GELU in the
    epilogue of their first linear layer when compiled (idempotent). The text stream keeps
    diffusers' layers: its few tokens make that product read-bound, where the epilogue gains
    nothing."""
    blocks: torch.nn.ModuleList = transformer.transformer_blocks
    for block in blocks:
        swap_class(block.img_mlp.net[0], GELU, EpilogueGELU)  # type: ignore[index, union-attr, arg-type]

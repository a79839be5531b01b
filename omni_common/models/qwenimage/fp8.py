"""Qwen-Image's DiT with FP8 products (--quantization fp8; omni_common/execution/fp8.py).

Which layers: every linear layer inside the transformer blocks, the attention's projections
(image and text q/k/v and outputs) and both streams' feed-forward layers, which hold ~99% of
the DiT's products. What stays in the model dtype: the blocks' modulation layers (img_mod,
txt_mod: one row per request, read-bound, and their outputs scale every activation, where an
FP8 error would spread), the norms, the embeddings of the timestep, text and image, and
proj_out (it writes the prediction itself).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from omni_common.errors import FailedPrecondition, InvalidArgument
from omni_common.execution.fp8 import float8_unsupported, to_float8

KEPT = ("img_mod", "txt_mod")  # block modules whose linear layers keep the model dtype


def quantize_blocks(transformer: QwenImageTransformer2DModel, device: torch.device, mode: str = "fp8") -> int:
    """Make the blocks' attention and feed-forward layers FP8 (idempotent); returns how many
    layers are FP8. INVALID_ARGUMENT for a mode other than "fp8", FAILED_PRECONDITION where
    `device` has no FP8 products."""
    if mode != "fp8":
        raise InvalidArgument(f"quantization {mode!r} is not offered for Qwen-Image; it takes fp8")
    why = float8_unsupported(device)
    if why:
        raise FailedPrecondition(f"--quantization fp8 cannot run here: {why}")
    layers = [
        module
        for block in transformer.transformer_blocks
        for name, module in block.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[0] not in KEPT and _aligned(module)
    ]
    for layer in layers:
        to_float8(layer)
    return len(layers)


def _aligned(layer: torch.nn.Linear) -> bool:
    """Whether cuBLASLt's FP8 product takes the layer: both of its sides a multiple of 16
    (Qwen-Image's 3072 and 12288 are; a layer that is not keeps the model dtype)."""
    return layer.in_features % 16 == 0 and layer.out_features % 16 == 0

"""The feed-forward GELU in its GEMM's epilogue (epilogue.py): only traced code on a GPU takes
it; everywhere else the layer and the transformer are diffusers' own, bit for bit. (The GPU
side, compiled against eager: tests/gpu/test_gelu_epilogue.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.models.activations import GELU

from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.epilogue import EpilogueGELU, fuse_gelu_epilogue
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.modulation import swap_class

from ..conftest import CPU
from .test_graphs import inputs


def test_a_transformer_with_the_epilogue_gelu_computes_as_diffusers_on_the_cpu(tiny_model: Path) -> None:
    denoiser = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    plain, img_shapes = inputs(denoiser, 2, [5, 9])
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    fuse_gelu_epilogue(denoiser.transformer)
    fuse_gelu_epilogue(denoiser.transformer)  # idempotent
    layers = [block.img_mlp.net[0] for block in denoiser.transformer.transformer_blocks]
    assert all(type(layer) is EpilogueGELU for layer in layers)
    assert all(type(block.txt_mlp.net[0]) is GELU for block in denoiser.transformer.transformer_blocks)
    assert torch.equal(transformer_forward(denoiser.transformer, plain, img_shapes), expected)
    traced = torch.compile(layers[0], fullgraph=True, backend="eager")  # traced, but on the CPU
    x = torch.randn((2, 3, layers[0].proj.in_features))
    assert torch.equal(traced(x), GELU.forward(layers[0], x))


def test_only_a_gelu_layer_takes_the_epilogue_class() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="expected a GELU"):
        swap_class(module, GELU, EpilogueGELU)

"""Layerwise offload runs the DiT with its blocks streamed from host memory: same latents,
blocks absent from the device between forwards, every block copied once per forward."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.runtime.layerwise_offload import LayerwiseOffload
from tests.unit.runtime.test_memory import CPU, run_denoiser


def test_layerwise_offload_gives_bitwise_the_same_latents(tiny_model: Path) -> None:
    denoiser = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    resident = run_denoiser(tiny_model, denoiser)
    blocks = denoiser.transformer.transformer_blocks
    block_bytes = sum(t.numel() * t.element_size() for t in [*blocks.parameters(), *blocks.buffers()])

    offload = LayerwiseOffload(blocks, CPU)
    assert all(p.numel() == 0 for p in blocks.parameters())  # off the device before any forward
    streamed = run_denoiser(tiny_model, denoiser)
    assert torch.equal(streamed, resident)
    # 3 steps, each forward brings every block in once; block 0 is fetched ahead for the next.
    assert offload.bytes_moved == 3 * block_bytes + offload.block_bytes
    assert sum(p.numel() for p in blocks[1].parameters()) == 0  # dropped after its forward

    offload.close()
    assert all(p.numel() > 0 for p in blocks.parameters())
    assert torch.equal(run_denoiser(tiny_model, denoiser), resident)


class Scaled(nn.Linear):
    """A block with a buffer besides its parameters."""

    def __init__(self) -> None:
        super().__init__(8, 8, bias=False)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Chain(nn.Module):
    """Blocks of different sizes, an odd number of them, run twice per forward (wrap-around)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), Scaled(), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = torch.tanh(block(x))
        return x


def test_an_odd_number_of_blocks_of_different_sizes_streams_correctly() -> None:
    chain = Chain()
    x = torch.randn(4, 8)
    want = chain(x)
    offload = LayerwiseOffload(chain.blocks, CPU)
    assert torch.equal(chain(x), want) and torch.equal(chain(x), want)
    assert offload.block_bytes == 8 * 8 * 4 + 8 * 4
    offload.close()
    assert torch.equal(chain(x), want)

"""Layerwise offload runs the DiT with its blocks streamed from host memory: same latents,
blocks absent from the device between forwards, every block copied once per forward."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_common.models.qwenimage import QwenImageFamily
from omni_common.runtime.offload import LayerwiseOffload
from tests.unit.runtime.test_memory import CPU, run_denoiser


def test_layerwise_offload_gives_bitwise_the_same_latents(tiny_model: Path) -> None:
    family = QwenImageFamily()
    denoiser = family.load_denoiser(tiny_model, CPU, torch.float32)
    resident = run_denoiser(family, tiny_model, denoiser)
    blocks = denoiser.transformer.transformer_blocks
    block_bytes = sum(t.numel() * t.element_size() for t in [*blocks.parameters(), *blocks.buffers()])

    offload = LayerwiseOffload(blocks, CPU)
    assert all(p.numel() == 0 for p in blocks.parameters())  # off the device before any forward
    streamed = run_denoiser(family, tiny_model, denoiser)
    assert torch.equal(streamed, resident)
    # 3 steps, each forward brings every block in once; block 0 is fetched ahead for the next.
    assert offload.bytes_moved == 3 * block_bytes + offload.block_bytes
    assert sum(p.numel() for p in blocks[1].parameters()) == 0  # dropped after its forward

    offload.close()
    assert all(p.numel() > 0 for p in blocks.parameters())
    assert torch.equal(run_denoiser(family, tiny_model, denoiser), resident)

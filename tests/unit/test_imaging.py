"""Output pixels: to_rgb8 quantises exactly as diffusers' numpy_to_pil, which the CPU parity
tests against the monolithic pipeline rely on."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor

from omni_common.imaging import to_rgb8


def test_rgb8_pixels_are_diffusers_pixels_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    image = torch.rand((3, 32, 48), generator=generator)
    # Values on and next to each rounding boundary (k + 0.5) / 255, where an order of
    # operations other than diffusers' would round the other way.
    halves = (torch.arange(256.0) + 0.5) / 255
    edges = torch.cat(
        [halves, torch.nextafter(halves, torch.zeros(())), torch.nextafter(halves, torch.ones(()))]
    )
    image.view(-1)[: edges.numel()] = edges.clamp(0, 1)
    pil = VaeImageProcessor.numpy_to_pil(image.permute(1, 2, 0).numpy()[None])[0]
    assert np.array_equal(to_rgb8(image), np.asarray(pil))

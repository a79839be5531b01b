"""vae-decode over several devices (here two CPU "devices"): a large image decoded in bands, a
device each, is bit for bit diffusers' decode with tiling on, one tile a band (an image no band
would cut, 96 rows, decodes whole there and here); a small one decodes whole, as on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from omni_common.models.base import StageState
from omni_common.models.qwenimage.decode import QwenImageDecoder, band_tiling
from omni_common.models.weights import load_component

CPU = torch.device("cpu")


def latents_of(decoder: QwenImageDecoder, width: int, height: int, seed: int) -> StageState:
    patch = decoder.vae_scale_factor * 2
    channels = decoder.vae.config["z_dim"] * 4
    packed = torch.randn(
        1, (height // patch) * (width // patch), channels, generator=torch.Generator().manual_seed(seed)
    )
    return StageState({"latents": packed}, {"height": str(height), "width": str(width)})


@pytest.fixture(scope="module")
def split(tiny_model: Path) -> QwenImageDecoder:
    decoder = QwenImageDecoder.load(tiny_model, CPU, torch.float32)
    decoder.split_over([CPU, CPU], pixels=2 * 64 * 64)
    yield decoder
    decoder.close()


@pytest.mark.parametrize(("width", "height"), [(64, 160), (48, 224), (80, 144), (128, 96)])
def test_a_large_image_in_bands_is_diffusers_tiled_decode(
    split: QwenImageDecoder, tiny_model: Path, width: int, height: int
) -> None:
    state = latents_of(split, width, height, seed=width + height)
    (ours,) = split.decode([state])
    vae = load_component(AutoencoderKLQwenImage, tiny_model / "vae", CPU, torch.float32)
    vae.enable_tiling(**band_tiling(height, width, bands=2, scale=split.vae_scale_factor))
    z = QwenImagePipeline._unpack_latents(state.tensors["latents"], height, width, split.vae_scale_factor)
    config = vae.config
    mean = torch.tensor(config["latents_mean"]).view(1, config["z_dim"], 1, 1, 1)
    std = 1.0 / torch.tensor(config["latents_std"]).view(1, config["z_dim"], 1, 1, 1)
    with torch.inference_mode():
        frames = vae.decode(z / std + mean, return_dict=False)[0]
    want = split.image_processor.postprocess(frames[:, :, 0], output_type="pt")[0]
    assert ours.shape == (3, height, width)
    assert torch.equal(ours, want)
    vae.disable_tiling()
    whole = QwenImageDecoder(vae, CPU).decode([state])[0]  # blended bands differ (but at 96 rows)
    print(f"{width}x{height}: bands vs whole, max difference {float((ours - whole).abs().max()):.3g}")


def test_a_small_image_decodes_whole(split: QwenImageDecoder, tiny_model: Path) -> None:
    state = latents_of(split, 64, 64, seed=1)
    one = QwenImageDecoder.load(tiny_model, CPU, torch.float32)
    assert torch.equal(split.decode([state])[0], one.decode([state])[0])

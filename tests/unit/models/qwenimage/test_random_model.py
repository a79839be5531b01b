"""Random-weights model directories: seeded weights built in place, the same in every
process, at the real Qwen-Image sizes when asked, and served like any other model."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.pipeline import monolithic_pipeline
from omni_common.models.qwenimage.random_model import write_random_model
from omni_common.models.weights import random_weights_seed

CPU = torch.device("cpu")
DIGEST = """
import hashlib, sys, torch
from pathlib import Path
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
runner = QwenImageDenoiser.load(Path(sys.argv[1]), torch.device("cpu"), torch.bfloat16)
digest = hashlib.sha256()
for name, tensor in sorted(runner.transformer.state_dict().items()):
    digest.update(name.encode() + tensor.view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


@pytest.fixture(scope="module")
def random_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "qwen-image-random"
    return write_random_model(out, full_size=False, seed=3)


def test_the_directory_holds_no_weights_and_names_its_seed(random_tiny: Path) -> None:
    assert not list(random_tiny.rglob("*.safetensors"))
    assert random_weights_seed(random_tiny) == 3


def test_every_process_builds_the_same_weights(random_tiny: Path) -> None:
    def digest() -> str:
        run = subprocess.run([sys.executable, "-c", DIGEST, str(random_tiny)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip()

    first = digest()
    assert first == digest()
    other_seed = write_random_model(random_tiny.parent / "other", full_size=False, seed=4)
    runner = QwenImageDenoiser.load(other_seed, CPU, torch.bfloat16)
    ours = hashlib.sha256()
    for name, tensor in sorted(runner.transformer.state_dict().items()):
        ours.update(name.encode() + tensor.view(torch.uint8).numpy().tobytes())
    assert ours.hexdigest() != first


def test_full_size_is_qwen_image_at_its_real_size(tmp_path: Path) -> None:
    model = write_random_model(tmp_path / "qwen-image-full", full_size=True)
    meta = torch.device("meta")  # built without memory
    dit = QwenImageDenoiser.load(model, meta, torch.bfloat16).transformer
    encoder = QwenImageEncoder.load(model, meta, torch.bfloat16).text_encoder
    vae = QwenImageDecoder.load(model, meta, torch.bfloat16).vae
    billions = {
        name: round(sum(p.numel() for p in module.parameters()) / 1e9, 2)
        for name, module in (("dit", dit), ("lm", encoder.model.language_model), ("vae", vae))
    }
    assert billions == {"dit": 20.43, "lm": 7.07, "vae": 0.13}
    assert next(dit.parameters()).dtype == torch.bfloat16


def test_split_runners_equal_diffusers_on_the_same_random_weights(random_tiny: Path) -> None:
    encoder = QwenImageEncoder.load(random_tiny, CPU, torch.float32)
    denoiser = QwenImageDenoiser.load(random_tiny, CPU, torch.float32)
    decoder = QwenImageDecoder.load(random_tiny, CPU, torch.float32)
    request = GenerationRequest(prompt="a cat", width=32, height=32, num_inference_steps=3, seed=1)
    state = denoiser.prepare(request, encoder.encode([request])[0])
    while not denoiser.is_done(state):
        denoiser.step([state])
    image = decoder.decode([denoiser.finish(state)])[0]

    pipe = monolithic_pipeline(random_tiny, CPU, torch.float32)
    reference = pipe(
        "a cat",
        width=32,
        height=32,
        num_inference_steps=3,
        true_cfg_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(1),
        output_type="pt",
    ).images[0]
    assert torch.equal(image, reference)

"""A DiT compiled as the stage compiles it (execution.compile_blocks: inductor's multi_kernel)
restarts from a warm compile cache, in a new process, and computes what the first process did.

The tiny fixture's reductions are too small for inductor to generate multi-kernels, so this
one is 2048 channels wide (16 heads of 128): its LayerNorms and q/k RMSNorms are. PyTorch
2.11's file cache of multi-kernel picks failed on kernels loaded from the compile cache, and a
warm start crashed (an H200, docs/benchmarks.md); compile_blocks turns that cache off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled on CUDA only)"),
]

ROOT = Path(__file__).resolve().parents[2]
FORWARD = """
import json, sys
from pathlib import Path
import torch
from omni_common.models.base import DenoiserOptions
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward

device = torch.device("cuda", 0)
denoiser = QwenImageDenoiser.load(Path(sys.argv[1]), device, torch.bfloat16, DenoiserOptions(compile=True))
config = denoiser.transformer.config
img_shape = denoiser.img_shape(128, 128)
generator = torch.Generator(device).manual_seed(0)
tokens = img_shape[1] * img_shape[2]
inputs = {
    "latents": torch.randn((1, tokens, config["in_channels"]), generator=generator, device=device),
    "timestep": torch.full((1,), 500.0, device=device),
    "embeds": torch.randn((1, 7, config["joint_attention_dim"]), generator=generator, device=device),
}
inputs = {name: value.to(torch.bfloat16) for name, value in inputs.items()}
with torch.inference_mode():
    output = transformer_forward(denoiser.transformer, inputs, [[img_shape]])
print(json.dumps(output.float().flatten()[:256].tolist()))
"""


@pytest.fixture
def wide_model(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny fixture with a one-block DiT of 2048 channels, weights seeded on the device."""
    from omni_common.models.weights import RANDOM_WEIGHTS_FILE

    model = tmp_path / "wide"
    shutil.copytree(tiny_model, model)
    for weights in model.glob("*/*.safetensors"):
        weights.unlink()
    (model / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 0}))
    config_path = model / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_layers=1, num_attention_heads=16, attention_head_dim=128, axes_dims_rope=[16, 56, 56])
    config_path.write_text(json.dumps(config))
    return model


def forward_in_new_process(model: Path, cache: Path) -> list[float]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    command = [sys.executable, "-c", FORWARD, str(model)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_compiled_dit_restarts_from_a_warm_cache(wide_model: Path, tmp_path: Path) -> None:
    cold = forward_in_new_process(wide_model, tmp_path / "cache")
    code = [path.read_text() for path in (tmp_path / "cache" / "inductor").rglob("*.py")]
    assert any("multi_kernel(" in text for text in code)  # what the warm start loads
    warm = forward_in_new_process(wide_model, tmp_path / "cache")
    # Each process picks its multi-kernels by timing them: the picks may differ, and with them
    # the float rounding of the reductions.
    torch.testing.assert_close(torch.tensor(warm), torch.tensor(cold), atol=5e-2, rtol=0)

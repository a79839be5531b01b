"""The Qwen-Image VAE decode compiled (the vae-decode stage's `--compile` on a GPU) on the tiny
fixture: where it is kept its images equal the eager decoder's up to float rounding, a batch
of that size decodes image by image through it (each image what it is alone), and another
size runs eagerly, compiling nothing mid-request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.base import StageState
from omni_common.models.qwenimage import decode
from omni_common.models.qwenimage.decode import QwenImageDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled on CUDA only)"),
]

DEVICE = torch.device("cuda", 0)


def states(decoder: QwenImageDecoder, size: int, count: int) -> list[StageState]:
    """`count` packed latents of `size` x `size` images (2x2 patches of the VAE's channels)."""
    generator = torch.Generator().manual_seed(size + count)
    shape = (1, (size // (decoder.vae_scale_factor * 2)) ** 2, decoder.vae.config["z_dim"] * 4)
    return [
        StageState(
            {"latents": torch.randn(shape, generator=generator)},
            {"height": str(size), "width": str(size)},
        )
        for _ in range(count)
    ]


def test_a_compiled_decode_gives_the_eager_images_and_other_shapes_stay_eager(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    eager = QwenImageDecoder.load(tiny_model, DEVICE, torch.float32)
    monkeypatch.setattr(decode, "KEEP_IF_FASTER", float("inf"))  # keep it, however fast it runs
    compiled = QwenImageDecoder.load(tiny_model, DEVICE, torch.float32, compile_sizes=[(64, 64)])
    side = 64 // eager.vae_scale_factor
    assert compiled._compiled_shapes == {(1, eager.vae.config["z_dim"], 1, side, side)}
    graphs_after_load = counters["stats"]["unique_graphs"]
    for size, count in ((64, 1), (64, 2), (32, 1)):
        inputs = states(eager, size, count)
        for got, want in zip(compiled.decode(inputs), eager.decode(inputs), strict=True):
            # Compiled convolutions take other kernels: ~4e-4 on images in [0, 1], a tenth of
            # one 8-bit level.
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    batch = states(eager, 64, 3)
    alone = [compiled.decode([state])[0] for state in batch]
    for got, want in zip(compiled.decode(batch), alone, strict=True):
        assert torch.equal(got, want)  # not what it was batched with
    assert counters["stats"]["unique_graphs"] == graphs_after_load


def test_a_restart_reuses_the_first_starts_decisions_and_times_nothing(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a compile cache, where compiling paid is remembered: a restarted stage compiles
    the sizes that paid in the background while it serves eagerly, leaves the others eager,
    and times neither."""
    from omni_common.execution import compile_cache

    monkeypatch.setattr(compile_cache, "_directory", tmp_path)
    first = QwenImageDecoder.load(tiny_model, DEVICE, torch.float32, compile_sizes=[(64, 64), (32, 32)])
    decisions = compile_cache.decisions_for("vae-compile", DEVICE, dict(first.vae.config))
    assert decisions is not None
    speedups = {size: decisions.get(size) for size in ((64, 64), (32, 32))}
    assert all(speedup is not None and speedup > 0 for speedup in speedups.values())
    decisions.put((64, 64), 2.0)  # as if compiling paid at 64 and not at 32
    decisions.put((32, 32), 0.5)
    timed = []
    real_decode_ms = decode._decode_ms
    monkeypatch.setattr(
        decode, "_decode_ms", lambda *a, **k: timed.append(k.get("runs", 5)) or real_decode_ms(*a, **k)
    )
    restarted = QwenImageDecoder.load(tiny_model, DEVICE, torch.float32, compile_sizes=[(64, 64), (32, 32)])
    # It serves at once, eagerly, while the kept size loads in the background.
    assert restarted._loading is not None  # compile() returned with the load handed to a thread
    eager_image = restarted.decode(states(restarted, 64, 1))[0]
    restarted.wait_compiled()
    side = 64 // restarted.vae_scale_factor
    assert restarted._compiled_shapes == {(1, restarted.vae.config["z_dim"], 1, side, side)}
    assert timed == [0]  # the kept size compiled (loaded) once, untimed; the other not at all
    compiled_image = restarted.decode(states(restarted, 64, 1))[0]
    torch.testing.assert_close(compiled_image, eager_image, atol=1e-3, rtol=0)

"""Step caching (the "step_cache" option, a first-block cache) on a trained model: how many
steps it reuses, how much denoise time it saves and how far the image moves, per threshold.

    python benchmarks/step_cache.py [--model models/qwen-image-digits] [--steps 20]

Random weights (benchmarks/gpu_headline.py, real size) say what a reused step saves; only a
trained model says what it costs in quality. The competitor is the same request uncached
(threshold 0): the images are compared by PSNR on [0, 1], the denoise loop by wall time.
Prints one JSON line per threshold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPTS = [f"a handwritten digit {word}" for word in DIGITS]
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(torch.mean((a.double() - b.double()) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/qwen-image-digits"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    encoder = QwenImageEncoder.load(args.model, cpu, torch.float32)
    denoiser = QwenImageDenoiser.load(args.model, cpu, torch.float32)
    decoder = QwenImageDecoder.load(args.model, cpu, torch.float32)
    requests = {
        threshold: [
            GenerationRequest(
                prompt=prompt,
                width=args.size,
                height=args.size,
                num_inference_steps=args.steps,
                true_cfg_scale=1.0,
                seed=seed,
                options=(("step_cache", str(threshold)),) if threshold else (),
            )
            for prompt in PROMPTS
            for seed in range(args.seeds)
        ]
        for threshold in THRESHOLDS
    }
    embeds = encoder.encode(requests[0.0])
    exact: list[torch.Tensor] = []
    exact_s = 0.0
    for threshold, batch in requests.items():
        images, reused, wall = [], 0, 0.0
        for request, inputs in zip(batch, embeds, strict=True):
            state = denoiser.prepare(request, inputs)
            started = time.perf_counter()
            while not denoiser.is_done(state):
                denoiser.step([state])
            wall += time.perf_counter() - started
            reused += state.step_cache.cached_steps if state.step_cache is not None else 0  # type: ignore[attr-defined]
            (image,) = decoder.decode([denoiser.finish(state)])
            images.append(image)
        if threshold == 0.0:
            exact, exact_s = images, wall
        scores = [psnr(a, b) for a, b in zip(images, exact, strict=True)]
        finite = [s for s in scores if math.isfinite(s)]
        row = {
            "threshold": threshold,
            "requests": len(batch),
            "reused_steps": round(reused / (len(batch) * args.steps), 3),
            "denoise_speedup": round(exact_s / wall, 3),
            "psnr_db_mean": round(sum(finite) / len(finite), 1) if finite else math.inf,
            "psnr_db_min": round(min(scores), 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""The DiT step in FP8 (--quantization fp8) against bf16, Qwen-Image at real size (random bf16
weights), compiled the same way as the dit-denoise stage compiles it: step time, and how far the
FP8 latents end from the bf16 ones.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/fp8.py --model /tmp/qwen-image-full [--size 1024] [--steps 20] [--blocks 60]

One denoiser runs a request of `--steps` steps in bf16, then its blocks are quantised in place
(the same weights, now FP8; qwenimage/fp8.py) and compiled again, and the same request runs
again. Each run is preceded by a 2-step warm-up request (it compiles). Prints one JSON line per
dtype (p50 step ms, compile s), then the comparison: the FP8 / bf16 step ratio (issue 35's
target: <= 0.75 at 1024x1024), the largest |latent difference| after the last step, and the
PSNR of the FP8 latents against the bf16 ones as an image (unpacked [C, H/8, W/8], peak = the
bf16 latents' range). `--blocks N` keeps the first N of the 60 blocks (said in the output) where
the whole model would not fit the time. On the CPU (`--device cpu`, the tiny fixture, no
compile) it checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState
from omni_common.models.qwenimage.denoise import QwenImageDenoiser, QwenImageDenoiseState

PROMPT_TOKENS = 20  # a short prompt once the template's prefix is dropped
WARM_UP_STEPS = 2


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request(args: argparse.Namespace, steps: int, denoiser: QwenImageDenoiser) -> QwenImageDenoiseState:
    """The same request every time: seeded noise and seeded random prompt embeddings."""
    width = denoiser.transformer.config["joint_attention_dim"]
    generator = torch.Generator().manual_seed(args.seed)
    embeds = torch.randn((1, PROMPT_TOKENS, width), generator=generator).to(denoiser.dtype)
    asked = GenerationRequest(
        prompt="fp8", width=args.size, height=args.size, num_inference_steps=steps, seed=args.seed
    )
    return denoiser.prepare(asked, StageState({"prompt_embeds": embeds}))


def run(
    args: argparse.Namespace, denoiser: QwenImageDenoiser, label: str
) -> tuple[dict[str, float], torch.Tensor]:
    """Warm up (compiles), then time each step of one request: (its row, the final latents)."""
    started = time.perf_counter()
    warm = request(args, WARM_UP_STEPS, denoiser)
    while not denoiser.is_done(warm):
        denoiser.step([warm])
    synchronize(denoiser.device)
    warm_up_s = time.perf_counter() - started
    state = request(args, args.steps, denoiser)
    samples = []
    while not denoiser.is_done(state):
        synchronize(denoiser.device)
        began = time.perf_counter()
        denoiser.step([state])
        synchronize(denoiser.device)
        samples.append((time.perf_counter() - began) * 1e3)
    row = {
        "step_ms_p50": round(statistics.median(samples), 2),
        "step_ms_min": round(min(samples), 2),
        "warm_up_s": round(warm_up_s, 1),
    }
    emit({"dtype": label, "size": args.size, "steps": args.steps, **row})
    return row, state.latents.float().cpu()


def latent_psnr(got: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR of `got` against `reference`, the peak being the reference's range."""
    mse = float((got - reference).pow(2).mean())
    peak = float(reference.max() - reference.min())
    return math.inf if mse == 0 else round(10 * math.log10(peak**2 / mse), 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=0, help="keep the first N blocks (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--no-compile", action="store_true", help="eager (the CPU's default)")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay steps as CUDA graphs too")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_blocks = device.type == "cuda" and not args.no_compile
    options = DenoiserOptions(compile=compile_blocks, cuda_graphs=args.cuda_graphs)
    started = time.perf_counter()
    denoiser = QwenImageDenoiser.load(args.model, device, dtype)
    blocks = denoiser.transformer.transformer_blocks
    if 0 < args.blocks < len(blocks):
        print(f"# a subset: the first {args.blocks} of {len(blocks)} blocks", flush=True)
        denoiser.transformer.transformer_blocks = blocks[: args.blocks]
    denoiser.configure(options)
    emit({"loaded_s": round(time.perf_counter() - started, 1), "device": str(device), "dtype": str(dtype)})

    plain, plain_latents = run(args, denoiser, str(dtype).removeprefix("torch."))
    torch._dynamo.reset()  # the FP8 blocks compile afresh, as a replica started with the flag does
    denoiser.graphed = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    denoiser.configure(replace(options, quantization="fp8"))
    fp8, fp8_latents = run(args, denoiser, "fp8")
    ratio = fp8["step_ms_p50"] / plain["step_ms_p50"]
    emit(
        {
            "fp8_over_bf16_step": round(ratio, 3),
            "target": 0.75,
            "max_abs_latent_diff": float((fp8_latents - plain_latents).abs().max()),
            "latent_psnr_db": latent_psnr(fp8_latents, plain_latents),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "blocks": f"{len(denoiser.transformer.transformer_blocks)} of {len(blocks)}",
            "total_s": round(time.perf_counter() - started, 1),
        }
    )


if __name__ == "__main__":
    main()

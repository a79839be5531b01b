"""Device memory policies on the real-size model: peak GPU memory and seconds per image for
everything resident, `swap` (whole stages sleep and wake around their phase) and
`layerwise` (the DiT streams its blocks), each next to its bound.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/offload.py --model /tmp/qwen-image-full [--size 1024] [--steps 20]

Runs in one process on one GPU with omnistage's own runners, WeightSleeper and
LayerwiseOffload (the code the stage workers run). Bounds use the host-to-device
bandwidth measured here with pinned memory:
- resident: its own time (the reference);
- swap: resident time + bytes moved / bandwidth;
- layerwise (DiT): max(DiT compute time, bytes streamed / bandwidth).
Prints one JSON line per mode and a summary with the issue's targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.family import MODULES
from omni_common.runtime.layerwise_offload import LayerwiseOffload
from omni_common.runtime.memory import WeightSleeper, discover_modules

GIB = 1024**3


def h2d_bandwidth(device: torch.device, nbytes: int = 2 * GIB) -> float:
    """Pinned host -> device copy speed in bytes/s (best of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def timed(device: torch.device, fn: Callable[[], object]) -> tuple[object, float]:
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(device)
    return out, time.perf_counter() - started


class Stages:
    """The three runners on one GPU, with a sleeper each (the stage workers' objects)."""

    def __init__(self, model: Path, device: torch.device) -> None:
        self.device = device
        self.encoder = QwenImageEncoder.load(model, device, torch.bfloat16)
        self.denoiser = QwenImageDenoiser.load(model, device, torch.bfloat16)
        self.decoder = QwenImageDecoder.load(model, device, torch.bfloat16)
        runners = {"encoder": self.encoder, "dit": self.denoiser, "vae": self.decoder}
        self.modules = {role: discover_modules(r, MODULES, role) for role, r in runners.items()}
        self.sleepers = {role: WeightSleeper(m, device) for role, m in self.modules.items()}

    def encode(self, request: GenerationRequest) -> StageState:
        return self.encoder.encode([request])[0]

    def denoise(self, request: GenerationRequest, embeds: StageState) -> StageState:
        state = self.denoiser.prepare(request, embeds)
        while not self.denoiser.is_done(state):
            self.denoiser.step([state])
        return self.denoiser.finish(state)

    def decode(self, latents: StageState) -> torch.Tensor:
        return self.decoder.decode([latents])[0]

    def phases(self, request: GenerationRequest) -> tuple[torch.Tensor, dict[str, float]]:
        """The image and the seconds of each phase, everything resident."""
        embeds, encode_s = timed(self.device, lambda: self.encode(request))
        latents, denoise_s = timed(self.device, lambda: self.denoise(request, embeds))  # type: ignore[arg-type]
        image, decode_s = timed(self.device, lambda: self.decode(latents))  # type: ignore[arg-type]
        return image, {"encoder": encode_s, "dit": denoise_s, "vae": decode_s}  # type: ignore[return-value]

    def swapped(self, request: GenerationRequest) -> tuple[torch.Tensor, float, int]:
        """One image with one stage awake at a time (what `--offload swap` does with a budget
        that fits one stage): the image, seconds and bytes moved."""
        moved = 0
        started = time.perf_counter()
        embeds = latents = image = None
        for role in ("encoder", "dit", "vae"):
            moved += self.sleepers[role].wake().copied
            if role == "encoder":
                embeds = self.encode(request)
            elif role == "dit":
                latents = self.denoise(request, embeds)  # type: ignore[arg-type]
            else:
                image = self.decode(latents)  # type: ignore[arg-type]
            moved += self.sleepers[role].sleep(1).copied  # 0: the host copy is kept
        torch.cuda.synchronize(self.device)
        assert image is not None
        return image, time.perf_counter() - started, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a (random-weights) Qwen-Image directory")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/offload.py measures GPU memory: it needs a CUDA device")
    device = torch.device("cuda:0")
    request = GenerationRequest(
        prompt="a lighthouse at dusk, watercolor",
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        true_cfg_scale=1.0,
        seed=0,
    )
    bandwidth = h2d_bandwidth(device)
    print(json.dumps({"h2d_GBps": round(bandwidth / 1e9, 1)}), flush=True)

    stages, load_s = timed(device, lambda: Stages(args.model, device))
    assert isinstance(stages, Stages)
    weights = {role: m.weight_bytes() for role, m in stages.modules.items()}
    print(
        json.dumps(
            {"load_s": round(load_s, 1), "weight_GB": {k: round(v / 1e9, 2) for k, v in weights.items()}}
        )
    )

    warmup = dataclasses.replace(request, num_inference_steps=2)
    stages.phases(warmup)
    torch.cuda.reset_peak_memory_stats(device)
    resident_image, phases = stages.phases(request)
    resident_s = sum(phases.values())
    resident_peak = torch.cuda.max_memory_allocated(device)
    row = {"mode": "resident", "s_per_image": round(resident_s, 3), "peak_GiB": round(resident_peak / GIB, 2)}
    print(json.dumps({**row, "phases_s": {k: round(v, 3) for k, v in phases.items()}}), flush=True)

    # swap: every stage starts asleep; each wakes for its phase and sleeps after it.
    for sleeper in stages.sleepers.values():
        sleeper.sleep(1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    swap_image, swap_s, swap_bytes = stages.swapped(request)
    swap_peak = torch.cuda.max_memory_allocated(device)
    swap_bound = resident_s + swap_bytes / bandwidth
    print(
        json.dumps(
            {
                "mode": "swap",
                "s_per_image": round(swap_s, 3),
                "peak_GiB": round(swap_peak / GIB, 2),
                "bytes_moved_GB": round(swap_bytes / 1e9, 1),
                "bound_s": round(swap_bound, 3),
                "added_s": round(swap_s - resident_s, 3),
                "move_cost_s": round(swap_bytes / bandwidth, 3),
                "image_equal_to_resident": bool(torch.equal(swap_image, resident_image)),
            }
        ),
        flush=True,
    )

    # layerwise: the DiT alone on the device (as in its own process), resident then streamed.
    stages.sleepers["dit"].wake()
    stages.sleepers["encoder"].wake()
    embeds = stages.encode(request)
    stages.sleepers["encoder"].sleep(1)
    stages.sleepers["dit"].drop_host_copy()  # layerwise packs its own: both would not fit in RAM
    if hasattr(torch._C, "_host_emptyCache"):  # PyTorch caches freed pinned memory: give it back
        torch._C._host_emptyCache()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident_latents, dit_s = timed(device, lambda: stages.denoise(request, embeds))
    dit_peak = torch.cuda.max_memory_allocated(device)
    offload = LayerwiseOffload(stages.denoiser.transformer.transformer_blocks, device)
    torch.cuda.empty_cache()
    stages.denoise(warmup, embeds)
    offload.bytes_moved = 0
    torch.cuda.reset_peak_memory_stats(device)
    streamed_latents, layerwise_s = timed(device, lambda: stages.denoise(request, embeds))
    layerwise_peak = torch.cuda.max_memory_allocated(device)
    streamed = offload.bytes_moved
    layerwise_bound = max(dit_s, streamed / bandwidth)
    print(
        json.dumps(
            {
                "mode": "layerwise",
                "dit_s_per_image": round(layerwise_s, 3),
                "dit_peak_GiB": round(layerwise_peak / GIB, 2),
                "dit_resident_s": round(dit_s, 3),
                "dit_resident_peak_GiB": round(dit_peak / GIB, 2),
                "bytes_streamed_GB": round(streamed / 1e9, 1),
                "bound_s": round(layerwise_bound, 3),
                "latents_equal_to_resident": bool(
                    torch.equal(streamed_latents.tensors["latents"], resident_latents.tensors["latents"])  # type: ignore[attr-defined]
                ),
            }
        ),
        flush=True,
    )
    summary = {
        "size": args.size,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(device),
        "layerwise_peak_vs_resident": round(layerwise_peak / dit_peak, 3),
        "layerwise_time_vs_bound": round(layerwise_s / layerwise_bound, 3),
        "swap_added_vs_move_cost": round((swap_s - resident_s) / (swap_bytes / bandwidth), 3),
        "targets": {
            "layerwise_peak_vs_resident": "<= 0.40",
            "layerwise_time_vs_bound": "<= 1.15",
            "swap_added_vs_move_cost": "<= 1.0",
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

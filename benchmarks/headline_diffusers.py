"""diffusers' side of benchmarks/gpu_headline.py: QwenImagePipeline in one process, compiled
each way of --diffusers-modes (diffusers_best.py), p50 per size and one batch per mode, the
faster mode per size; and its VAE decode eager, channels-last and compiled."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import diffusers_best
import torch
from headline_common import NEGATIVE, Side, emit, p50, prompt


def run_diffusers(args: argparse.Namespace) -> Side:
    """diffusers compiled each way of --diffusers-modes, one pipeline after the other: at each
    size the faster p50 (and its image), the better batch throughput; both printed."""
    device = torch.device(args.device)
    out = Side()
    by_size: dict[int, dict[str, float]] = {size: {} for size in args.sizes}
    for mode in args.diffusers_modes:
        started = time.perf_counter()
        pipe = diffusers_best.load(
            args.model,
            device,
            getattr(torch, args.dtype),
            mode,
            backend=args.diffusers_backend,
            cluster_options=args.diffusers_options == "cluster",
        )
        side = time_diffusers(args, pipe, mode)
        emit({"side": "diffusers", "mode": mode, "total_s": round(time.perf_counter() - started, 1)})
        for size, ms in side.p50_ms.items():
            by_size[size][mode] = ms
            if size not in out.p50_ms or ms < out.p50_ms[size]:
                out.p50_ms[size], out.images[size] = ms, side.images[size]
        out.img_per_s = max(out.img_per_s, side.img_per_s)
        if mode == args.diffusers_modes[0]:
            vae_rows(pipe, args.sizes, device, args.diffusers_backend)  # the VAE is eager in every mode
        del pipe  # before the next mode loads: release() frees only what nothing names
        diffusers_best.release()
    for size, rows in by_size.items():
        mode, ms = diffusers_best.best(rows)
        emit({"side": "diffusers", "size": size, "best_mode": mode, "p50_ms": ms, "by_mode": rows})
    return out


def time_diffusers(args: argparse.Namespace, pipe: Any, mode: str) -> Side:
    """One compiled pipeline: p50 per size (after warm-up runs that compile it), and one batch
    of --concurrency at the last size."""
    device = torch.device(args.device)
    out = Side()

    def generate(size: int, seed: int, batch: int = 1, number: int = 0) -> torch.Tensor:
        return pipe(
            [prompt(number and number + i) for i in range(batch)],
            width=size,
            height=size,
            num_inference_steps=args.steps,
            negative_prompt=[NEGATIVE] * batch if args.guidance > 1 else None,
            true_cfg_scale=args.guidance,
            generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(batch)],
            output_type="pt",
        ).images

    def synced() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for size in args.sizes:
        t0 = time.perf_counter()
        for run in range(args.runs):  # compiles this size at each timed prompt's length
            generate(size, 99, number=run and run + 100 * size)
        warm_s = round(time.perf_counter() - t0, 1)
        walls = []
        for run in range(args.runs):
            synced()
            t0 = time.perf_counter()
            image = generate(size, run, number=run and run + 100 * size)[0]
            synced()
            walls.append((time.perf_counter() - t0) * 1e3)
            if run == 0:
                out.images[size] = image.float().cpu().numpy()
        out.p50_ms[size] = p50(walls)
        emit(
            {"side": "diffusers", "mode": mode, "size": size, "p50_ms": out.p50_ms[size], "warm_up_s": warm_s}
        )
    size, batch = args.sizes[-1], args.concurrency
    generate(size, 99, batch, number=10_000)  # compiles the batch's shapes (its prompts, its mask)
    synced()
    t0 = time.perf_counter()
    generate(size, 0, batch, number=10_000)
    synced()
    out.img_per_s = round(batch / (time.perf_counter() - t0), 3)
    emit({"side": "diffusers", "mode": mode, "size": size, "one_batch_of": batch, "img_per_s": out.img_per_s})
    return out


def vae_rows(pipe: Any, sizes: list[int], device: torch.device, backend: str = "inductor") -> None:
    """The VAE decode of one image per size: eager, channels-last, compiled (what pays?)."""
    vae = pipe.vae
    latent_channels = vae.config.z_dim

    def timed(fn: Any, latents: torch.Tensor) -> float:
        for _ in range(2):
            fn(latents)
        walls = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn(latents)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            walls.append((time.perf_counter() - t0) * 1e3)
        return p50(walls)

    compiled = torch.compile(vae.decode, backend=backend)
    for size in sizes:
        shape = (1, latent_channels, 1, size // 8, size // 8)
        latents = torch.randn(shape, device=device, dtype=vae.dtype)
        with torch.inference_mode():
            eager_ms = timed(vae.decode, latents)
            compiled_ms = timed(compiled, latents)
            with channels_last(vae):
                channels_last_ms = timed(vae.decode, latents.contiguous(memory_format=torch.channels_last_3d))
        emit(
            {
                "side": "vae",
                "size": size,
                "eager_ms": eager_ms,
                "channels_last_ms": channels_last_ms,
                "compiled_ms": compiled_ms,
            }
        )


@contextlib.contextmanager
def channels_last(module: torch.nn.Module) -> Iterator[None]:
    """The module's 3-d convolution weights in channels-last layout, for the block's duration."""
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv3d)]
    for conv in convs:
        conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    try:
        yield
    finally:
        for conv in convs:
            conv.weight.data = conv.weight.data.contiguous()

"""diffusers' side of benchmarks/glm_image_gpu.py: GlmImagePipeline in one process, the AR's
prior sampled once per request (static cache, else the default), the transformer compiled
each way of --diffusers-modes, the DiT and the VAE timed per mode from those priors."""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers_best
import torch
from glm_image_common import MAX_SEQUENCE_LENGTH, Record, failure, p50, picture, prompt, warm_up_number
from PIL import Image

from omni_common.models.base import GenerationRequest


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    synced(device)
    t0 = time.perf_counter()
    out = fn()
    synced(device)
    return out, (time.perf_counter() - t0) * 1e3


def diffusers_request(args: argparse.Namespace, task: str, size: int, number: int) -> tuple[Any, list[Any]]:
    """The GenerationRequest and PIL condition images of request `number`, as the cluster gets them."""
    request = GenerationRequest(
        prompt=prompt(number),
        width=size,
        height=size,
        num_inference_steps=args.steps,
        true_cfg_scale=args.guidance,
        seed=number,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    images = [Image.open(io.BytesIO(picture(number, size))).convert("RGB")] if task == "edit" else []
    return request, images


def sample_prior(pipe: Any, device: torch.device, request: Any, images: list[Any], emit: Record) -> Any:
    """(the request's prior, its ms); a static cache that fails is reported, then the default
    cache samples it."""
    from omni_common.models.glm_image.reference import reference_prior

    try:
        return timed_ms(device, lambda: reference_prior(pipe, request, images))
    except Exception as err:
        config = pipe.vision_language_encoder.generation_config
        if config.cache_implementation != "static":
            raise
        emit({"side": "diffusers", "ar_cache": "static", "failed": failure(err), "then": "dynamic"})
        config.cache_implementation = None
        return timed_ms(device, lambda: reference_prior(pipe, request, images))


Priors = dict[tuple[str, int], list[tuple[Any, list[Any], Any, float]]]


def time_diffusers(
    args: argparse.Namespace, pipe: Any, mode: str, task: str, size: int, priors: Priors, emit: Record
) -> None:
    """The warm-up request, then `--runs` timed ones: the AR's prior once per request (with
    the first mode), the DiT and the VAE in every mode."""
    from omni_common.models.glm_image.reference import reference_image

    device = torch.device(args.device)
    key = (task, size)
    if key not in priors:
        priors[key] = []
        for number in [warm_up_number(size), *(1000 * size + run for run in range(args.runs))]:
            request, images = diffusers_request(args, task, size, number)
            prior, ms = sample_prior(pipe, device, request, images, emit)
            priors[key].append((request, images, prior, ms))
        emit(
            {
                "side": "diffusers",
                "task": task,
                "size": size,
                "ar_cache": pipe.vision_language_encoder.generation_config.cache_implementation or "dynamic",
                "ar_warm_up_ms": round(priors[key][0][3]),
                "ar_ms": [round(entry[3], 1) for entry in priors[key][1:]],
            }
        )
    totals, dits = [], []
    for i, (request, images, prior, ar_ms) in enumerate(priors[key]):
        _, ms = timed_ms(device, lambda: reference_image(pipe, request, images, prior))  # noqa: B023
        if i == 0:
            emit(
                {
                    "side": "diffusers",
                    "mode": mode,
                    "task": task,
                    "size": size,
                    "dit_vae_warm_up_ms": round(ms),
                }
            )
            continue
        dits.append(ms)
        totals.append(ar_ms + ms)
        emit(
            {
                "side": "diffusers",
                "mode": mode,
                "task": task,
                "size": size,
                "run": i - 1,
                "wall_ms": round(totals[-1], 1),
            }
        )
    emit(
        {
            "side": "diffusers",
            "mode": mode,
            "task": task,
            "size": size,
            "p50_ms": p50(totals),
            "ar_p50_ms": p50([entry[3] for entry in priors[key][1:]]),
            "dit_vae_p50_ms": p50(dits),
        }
    )


def run_diffusers(args: argparse.Namespace, model: Path, emit: Record) -> None:
    """Each mode of --diffusers-modes in turn, one pipeline on the device at a time (each freed
    before the next loads)."""
    priors: Priors = {}
    for mode in args.diffusers_modes:
        started = time.perf_counter()
        time_mode(args, model, mode, priors, emit)
        diffusers_best.release()
        emit({"side": "diffusers", "mode": mode, "total_s": round(time.perf_counter() - started, 1)})


def time_mode(args: argparse.Namespace, model: Path, mode: str, priors: Priors, emit: Record) -> None:
    """One pipeline compiled `mode`'s way at every size and task; a mode that fails (to
    compile, or at a size or task) is reported and the rest still run."""
    from omni_common.models.glm_image.reference import monolithic_pipeline

    pipe = monolithic_pipeline(model, torch.device(args.device), getattr(torch, args.dtype))
    if args.ar_cache == "static":  # generate compiles its decode step with a static cache
        pipe.vision_language_encoder.generation_config.cache_implementation = "static"
    try:
        diffusers_best.compile_transformer(pipe.transformer, mode, args.diffusers_backend)
    except Exception as err:
        emit({"side": "diffusers", "mode": mode, "failed": failure(err)})
        return
    for size in args.sizes:
        for task in args.tasks:
            try:
                time_diffusers(args, pipe, mode, task, size, priors, emit)
            except Exception as err:
                emit({"side": "diffusers", "mode": mode, "task": task, "size": size, "failed": failure(err)})

"""The headline: the split cluster on one GPU against diffusers' QwenImagePipeline in one
process, Qwen-Image at real size (random bf16 weights), same weights, seed and steps.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/gpu_headline.py --model /tmp/qwen-image-full [--sizes 1024 512]

Both sides do not fit on one GPU at once, so they run one after the other in this run:
first the cluster (coordinator and three stage processes, real gRPC on loopback), then
diffusers. Prints one JSON line per measurement, then the ratios against the targets:
- p50 latency, 20 steps, no CFG, one request at a time;
- images/s with `--concurrency` requests at once at the last size, against diffusers called
  one request at a time;
- the split's own cost (client wall time minus the stages' model time) per request;
- the images of the two sides compared (max abs difference, PSNR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan

PROMPT = "a watercolor lighthouse at dusk"


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


@dataclass
class Side:
    """One side's measurements: p50 latency and first image per size, throughput."""

    p50_ms: dict[int, float] = field(default_factory=dict)
    images: dict[int, np.ndarray] = field(default_factory=dict)
    img_per_s: float = 0.0


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def run_cluster(args: argparse.Namespace, log_dir: Path) -> Side:
    env = {
        "OMNISTAGE_DEVICE": "cuda:0",
        "OMNISTAGE_MAX_BATCH": str(args.concurrency),
        # The DiT compiles and captures the batch sizes it will serve before it reports ready.
        "OMNISTAGE_CAPTURE_SIZES": ",".join(f"{size}x{size}" for size in args.sizes),
    }
    plan = loopback_plan(args.model, dtype="bfloat16", extra_env=env)
    out = Side()
    started = time.perf_counter()
    # Compiling and capturing a 20 B DiT before it reports ready takes a minute or two.
    with LocalCluster(plan, log_dir, start_timeout_s=600) as cluster, Client(cluster.coordinator) as client:
        emit({"side": "cluster", "start_s": round(time.perf_counter() - started, 1)})
        for size in args.sizes:
            options = {"width": size, "height": size, "steps": args.steps, "guidance": 1.0}
            client.generate_result(PROMPT, seed=99, **options)  # warm-up
            walls, splits = [], []
            for run in range(args.runs):
                t0 = time.perf_counter()
                result = client.generate_result(PROMPT, seed=run, return_tensor=run == 0, **options)
                walls.append((time.perf_counter() - t0) * 1e3)
                splits.append(walls[-1] - sum(result.compute_ms.values()))
                if run == 0 and result.tensor is not None:
                    out.images[size] = result.tensor
            out.p50_ms[size] = p50(walls)
            emit(
                {
                    "side": "cluster",
                    "size": size,
                    "p50_ms": p50(walls),
                    "split_cost_p50_ms": p50(splits),
                    "stage_compute_ms": {k: round(v, 1) for k, v in result.compute_ms.items()},
                }
            )
        size = args.sizes[-1]
        options = {"width": size, "height": size, "steps": args.steps, "guidance": 1.0}
        errors: list[BaseException] = []

        def one(seed: int) -> None:
            try:
                with Client(cluster.coordinator) as own:
                    own.generate_result(PROMPT, seed=seed, **options)
            except BaseException as err:  # reported below; a failed request must not look fast
                errors.append(err)

        threads = [threading.Thread(target=one, args=(s,)) for s in range(args.concurrency)]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"{len(errors)} concurrent requests failed: {errors[0]}")
        out.img_per_s = args.concurrency / (time.perf_counter() - t0)
        emit(
            {
                "side": "cluster",
                "size": size,
                "concurrency": args.concurrency,
                "img_per_s": round(out.img_per_s, 3),
            }
        )
    return out


def run_diffusers(args: argparse.Namespace) -> Side:
    from omni_common.models.qwenimage.pipeline import monolithic_pipeline

    device = torch.device("cuda:0")
    pipe: Any = monolithic_pipeline(args.model, device, torch.bfloat16)
    out = Side()

    def generate(size: int, seed: int) -> torch.Tensor:
        return pipe(
            PROMPT,
            width=size,
            height=size,
            num_inference_steps=args.steps,
            true_cfg_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pt",
        ).images[0]

    for size in args.sizes:
        generate(size, 99)
        walls = []
        for run in range(args.runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            image = generate(size, run)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            if run == 0:
                out.images[size] = image.float().cpu().numpy()
        out.p50_ms[size] = p50(walls)
        emit({"side": "diffusers", "size": size, "p50_ms": p50(walls)})
    size = args.sizes[-1]
    t0 = time.perf_counter()
    for seed in range(args.concurrency):
        generate(size, seed)
    out.img_per_s = args.concurrency / (time.perf_counter() - t0)
    emit(
        {
            "side": "diffusers",
            "size": size,
            "one_at_a_time": args.concurrency,
            "img_per_s": round(out.img_per_s, 3),
        }
    )
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--logs", type=Path, help="keep the services' logs here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_headline.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = run_cluster(args, args.logs or Path(tmp))
    diffusers = run_diffusers(args)
    summary: dict[str, object] = {"device": torch.cuda.get_device_name(0), "steps": args.steps}
    for size in args.sizes:
        summary[f"latency_ratio_{size}"] = round(cluster.p50_ms[size] / diffusers.p50_ms[size], 3)
        a, b = cluster.images[size], diffusers.images[size]
        summary[f"image_max_abs_{size}"] = round(float(np.abs(a - b).max()), 5)
        summary[f"image_psnr_db_{size}"] = round(psnr(a, b), 1)
    summary["throughput_ratio"] = round(cluster.img_per_s / diffusers.img_per_s, 3)
    summary["targets"] = {
        "latency_ratio_1024": "<= 1.0",
        "latency_ratio_512": "<= 0.6",
        "throughput_ratio": ">= 2.5",
    }
    emit(summary)


if __name__ == "__main__":
    main()

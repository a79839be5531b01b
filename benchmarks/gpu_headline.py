"""The headline: the split cluster on one GPU against diffusers' QwenImagePipeline in one
process at its best setting (transformer.compile_repeated_blocks(fullgraph=True), warmed up),
Qwen-Image at real size (random bf16 weights), same weights, prompt, seed and steps (no CFG
unless `--guidance` is above 1).

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/gpu_headline.py --model /tmp/qwen-image-full [--sizes 1024 512] [--guidance 4]

Both sides do not fit on one GPU at once, so they run one after the other in this run:
1. the cluster, cold (coordinator and three stage processes, real gRPC on loopback, an empty
   compile cache): start-up time, p50 latency per size once the DiT's idle work is done
   (graphs of common prompt lengths; a prompt of a length never seen pays its capture), the
   DiT's step breakdown (device time inside a step, device idle time between steps, from its
   metrics), images/s with
   `--concurrency` requests at once at the last size, and step caching (the "step_cache"
   option) per threshold: speed-up and PSNR against the uncached image;
2. the cluster again on the same compile cache: the warm start-up time;
3. diffusers (headline_diffusers.py) compiled each way of `--diffusers-modes`
   (diffusers_best.py: regional compile, and the whole transformer as CUDA graphs with
   `mode="reduce-overhead"`; `max-autotune` on request, its compile time reported as warm-up):
   p50 per size and one batch of `--concurrency` at the last size per mode, the faster mode per
   size (the competitor), and its VAE decode eager, channels-last and compiled.
Prints one JSON line per measurement, then the ratios against the targets (issue 14).
`--diffusers-options cluster` compiles diffusers with the inductor options of the cluster's DiT
(execution.compile_blocks), which its user could set as well; `--only-diffusers` times that
side alone.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bursts
import diffusers_best
import numpy as np
import torch
from headline_common import NEGATIVE, Side, emit, p50, prompt
from headline_diffusers import run_diffusers

from omni_common.client import Client
from omni_common.cluster import LocalCluster, free_port, loopback_plan

WARM_UP = -1  # the prompt number of warm-up requests, never timed
# Real Qwen-Image weights are tuned at about 0.05-0.2; random weights' first-block residuals
# change more between steps, so larger thresholds show what reuse gains in speed (their PSNR
# says nothing about a trained model's quality: docs/benchmarks.md has that on the digits model).
STEP_CACHE_THRESHOLDS = (0.1, 0.5, 1.0)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else round(10 * math.log10(1.0 / mse), 1)


class StepMeter:
    """The DiT's step totals from its /metrics: mean device and idle ms a step between reads."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.last = self.read()

    def read(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for line in urllib.request.urlopen(self.url, timeout=5).read().decode().splitlines():
            for name in (
                "omnistage_steps",
                "omnistage_step_device_seconds",
                "omnistage_step_idle_seconds",
                "omnistage_idle_work_left",
            ):
                if line.startswith(name + "{"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def wait_idle_work(self) -> float:
        """Wait until the DiT has done its idle work (graphs of common prompt lengths, captured
        while no request is there); the seconds waited."""
        return bursts.wait_idle_work(self.url, limit_s=300.0)

    def since_last(self) -> dict[str, float]:
        now = self.read()
        delta = {k: now.get(k, 0.0) - self.last.get(k, 0.0) for k in now}
        self.last = now
        steps = max(delta.get("omnistage_steps", 0.0), 1.0)
        return {
            "steps": delta.get("omnistage_steps", 0.0),
            "device_ms_per_step": round(delta.get("omnistage_step_device_seconds", 0.0) / steps * 1e3, 2),
            "idle_ms_per_step": round(delta.get("omnistage_step_idle_seconds", 0.0) / steps * 1e3, 2),
        }


def cluster_plan(args: argparse.Namespace, cache: Path) -> tuple[list[Any], int]:
    env = {
        "OMNISTAGE_DEVICE": args.device,
        "OMNISTAGE_MAX_BATCH": str(args.concurrency),
        # The DiT compiles and captures the batch sizes it will serve before it reports ready.
        "OMNISTAGE_CAPTURE_SIZES": ",".join(f"{size}x{size}" for size in args.sizes),
        "OMNISTAGE_COMPILE_CACHE": str(cache),
        # Every stage waits this long for company before a forward (0: none).
        "OMNISTAGE_BATCH_WINDOW_MS": str(args.batch_window_ms),
    }
    plan = loopback_plan(args.model, dtype=args.dtype, extra_env=env)
    metrics_port = free_port()
    for proc in plan:
        if proc.name == "dit-denoise":
            proc.environment["OMNISTAGE_METRICS_PORT"] = str(metrics_port)
    return plan, metrics_port


def options_for(args: argparse.Namespace, size: int) -> dict[str, Any]:
    options = {"width": size, "height": size, "steps": args.steps, "guidance": args.guidance}
    return {**options, "negative_prompt": NEGATIVE} if args.guidance > 1 else options


def run_cluster(args: argparse.Namespace, log_dir: Path, cache: Path) -> Side:
    out = Side()
    plan, metrics_port = cluster_plan(args, cache)
    started = time.perf_counter()
    # A cold start compiles and captures a 20 B DiT before it reports ready: minutes.
    with (
        LocalCluster(plan, log_dir / "cold", start_timeout_s=900) as cluster,
        Client(cluster.coordinator) as client,
    ):
        out.start_s = round(time.perf_counter() - started, 1)
        emit({"side": "cluster", "start": "cold", "start_s": out.start_s})
        meter = StepMeter(metrics_port)
        for size in args.sizes:
            client.generate_result(prompt(WARM_UP), seed=99, **options_for(args, size))
            if size == args.sizes[0]:
                # A served cluster is timed as diffusers is: in its steady state (diffusers has
                # run each timed prompt's length before it is timed; the DiT captures graphs of
                # common prompt lengths while idle, its first request having started that).
                emit({"side": "cluster", "idle_work_wait_s": meter.wait_idle_work()})
            meter.since_last()
            walls, splits = [], []
            for run in range(args.runs):
                t0 = time.perf_counter()
                result = client.generate_result(
                    prompt(run and run + 100 * size),
                    seed=run,
                    return_tensor=run == 0,
                    **options_for(args, size),
                )
                walls.append((time.perf_counter() - t0) * 1e3)
                splits.append(walls[-1] - sum(result.compute_ms.values()))
                emit(
                    {
                        "side": "cluster",
                        "size": size,
                        "run": run,
                        "wall_ms": round(walls[-1], 1),
                        "stage_compute_ms": {k: round(v, 1) for k, v in result.compute_ms.items()},
                    }
                )
                if run == 0 and result.tensor is not None:
                    out.images[size] = result.tensor
            out.p50_ms[size] = p50(walls)
            out.step[size] = meter.since_last()
            emit(
                {
                    "side": "cluster",
                    "size": size,
                    "p50_ms": out.p50_ms[size],
                    "split_cost_p50_ms": p50(splits),
                    "stage_compute_ms": {k: round(v, 1) for k, v in result.compute_ms.items()},
                    "dit_step": out.step[size],
                }
            )
        # A first round at full concurrency compiles what only batches bring (the encoder's and
        # the VAE's batch shapes, masked DiT rows), as diffusers' side warms up its batch of 8.
        concurrent_img_per_s(args, cluster.coordinator, first_prompt=20_000)
        meter.since_last()
        out.img_per_s, breakdown = concurrent_img_per_s(args, cluster.coordinator, first_prompt=10_000)
        emit(
            {
                "side": "cluster",
                "size": args.sizes[-1],
                "concurrency": args.concurrency,
                "img_per_s": out.img_per_s,
                "dit_step": meter.since_last(),
                "burst": breakdown,
            }
        )
        for size in args.sizes:
            step_cache_rows(args, client, size, out.images[size], out.p50_ms[size])
    started = time.perf_counter()
    plan, metrics_port = cluster_plan(args, cache)
    with (
        LocalCluster(plan, log_dir / "warm", start_timeout_s=900) as cluster,
        Client(cluster.coordinator) as client,
    ):
        out.warm_start_s = round(time.perf_counter() - started, 1)
        size = args.sizes[0]
        t0 = time.perf_counter()
        client.generate_result(prompt(1), seed=0, **options_for(args, size))
        first_ms = round((time.perf_counter() - t0) * 1e3, 1)
        # The DiT serves before its whole warm-up has loaded (warmup.py): the rest loads while
        # idle, and with it the graphs of common prompt lengths.
        StepMeter(metrics_port).wait_idle_work()
        emit(
            {
                "side": "cluster",
                "start": "warm",
                "start_s": out.warm_start_s,
                f"first_request_{size}_ms": first_ms,
                "idle_work_done_s": round(time.perf_counter() - started, 1),
            }
        )
    return out


def concurrent_img_per_s(
    args: argparse.Namespace, coordinator: str, first_prompt: int
) -> tuple[float, dict[str, object]]:
    """Images/s of `--concurrency` requests sent at once (prompts from `first_prompt` on;
    bursts.py), and where the burst's wall time went: each stage's slowest compute and wall
    time, and when the first result arrived."""
    options = options_for(args, args.sizes[-1])
    done = bursts.burst(
        coordinator,
        [(prompt(first_prompt + seed), {"seed": seed, **options}) for seed in range(args.concurrency)],
    )
    results = done.results
    stages = {name for result in results for name in result.compute_ms}
    breakdown: dict[str, object] = {
        "wall_ms": round(done.wall_s * 1e3, 1),
        "first_done_ms": round(min(done.done_ms), 1),
        "stage_compute_max_ms": {k: round(max(r.compute_ms.get(k, 0.0) for r in results), 1) for k in stages},
        "stage_wall_max_ms": {k: round(max(r.stage_ms.get(k, 0.0) for r in results), 1) for k in stages},
    }
    return done.img_per_s, breakdown


def step_cache_rows(
    args: argparse.Namespace, client: Client, size: int, exact: np.ndarray, exact_ms: float
) -> None:
    """The same request (seed 0) with the first-block cache at each threshold."""
    for threshold in args.step_cache:
        options = {**options_for(args, size), "options": {"step_cache": str(threshold)}}
        client.generate_result(prompt(WARM_UP), seed=99, **options)  # compiles the cached path's shapes
        walls, image = [], None
        for run in range(2):
            t0 = time.perf_counter()
            result = client.generate_result(prompt(0), seed=0, return_tensor=run == 0, **options)
            walls.append((time.perf_counter() - t0) * 1e3)
            image = result.tensor if run == 0 else image
        assert image is not None
        emit(
            {
                "side": "cluster",
                "size": size,
                "step_cache": threshold,
                "p50_ms": p50(walls),
                "speedup": round(exact_ms / p50(walls), 3),
                "psnr_vs_uncached_db": psnr(image, exact),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="true CFG scale of both sides; above 1 both take a negative prompt (two forwards a step)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--device", default="cuda:0", help="cpu only to try the script on a tiny model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--diffusers-compile", type=int, default=1, help="0: diffusers eager only (not its best setting)"
    )
    diffusers_best.add_args(parser)
    parser.add_argument(
        "--diffusers-options",
        choices=("default", "cluster"),
        default="default",
        help="inductor options of diffusers' compile: its defaults, or the cluster DiT's",
    )
    parser.add_argument("--only-diffusers", action="store_true", help="time diffusers' side alone")
    parser.add_argument("--logs", type=Path, help="keep the services' logs here")
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
        help="the stages' --batch-window-ms: requests that arrive apart share forwards, each lone "
        "request waits that long at each stage",
    )
    parser.add_argument(
        "--step-cache", type=float, nargs="*", default=list(STEP_CACHE_THRESHOLDS), help="thresholds to time"
    )
    args = parser.parse_args()
    if not args.diffusers_compile:
        args.diffusers_modes = ["eager"]
    if not args.diffusers_modes:
        raise SystemExit("--diffusers-modes: name at least one; the headline compares with diffusers")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_headline.py needs a CUDA device")
    if args.only_diffusers:
        run_diffusers(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cluster = run_cluster(args, args.logs or Path(tmp), Path(tmp) / "compile-cache")
    diffusers = run_diffusers(args)
    summary: dict[str, object] = {
        "device": device_name(args.device),
        "steps": args.steps,
        "guidance": args.guidance,
        "batch_window_ms": args.batch_window_ms,
    }
    for size in args.sizes:
        summary[f"latency_ratio_{size}"] = round(cluster.p50_ms[size] / diffusers.p50_ms[size], 3)
        summary[f"image_psnr_db_{size}"] = psnr(cluster.images[size], diffusers.images[size])
    summary["throughput_ratio"] = round(cluster.img_per_s / diffusers.img_per_s, 3)
    summary["start_s"] = {"cold": cluster.start_s, "warm": cluster.warm_start_s}
    summary["dit_step_ms"] = cluster.step
    summary["targets"] = {
        f"latency_ratio_{args.sizes[0]}": "<= 0.95 (1024)",
        f"latency_ratio_{args.sizes[-1]}": "<= 0.5 (512)",
        "throughput_ratio": ">= 1.05",
        "warm start_s": "<= 30",
    }
    emit(summary)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


if __name__ == "__main__":
    main()

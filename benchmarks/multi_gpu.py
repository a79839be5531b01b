"""One dit-denoise replica over 2 GPUs (sequence parallel; CFG parallel with a negative prompt)
against the same replica on 1 GPU, Qwen-Image at real size (random bf16 weights), one run.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/multi_gpu.py --model /tmp/qwen-image-full [--sizes 1024 512] [--gpus 1 2]

For each GPU count, a cluster of real processes (coordinator, encoder, DiT, VAE; the encoder and
the VAE on cuda:0, the DiT on cuda:0 alone or spread with --gpus N) serves, per size, a warm-up
request, then `--runs` timed requests without CFG and `--runs` with a negative prompt (true
CFG, guidance 4). Every process builds the same seeded weights on its device, so the images
compare: PSNR of each N-GPU image against the 1-GPU one. One JSON line per measurement, then
the ratios against issue 18's targets (2 GPUs / 1 GPU <= 0.55 at 1024x1024, CFG too).

The competitor at its best: diffusers on one GPU, its transformer compiled each way of
`--diffusers-modes` (diffusers_best.py: regional compile, and the whole transformer as CUDA
graphs), the faster per size and CFG setting; each replica's p50 over it is printed too.
A replica over several GPUs picks its mode per request (--parallel-mode auto, logged in its
log; runtime/parallel_mode.py).

Then `--concurrent` requests at once at the smallest size: images/s of each cluster (a replica
over several GPUs spreads them over its ranks, data parallel).

Both replicas run at their best setting (torch.compile and CUDA graphs, `auto`); a replica over
several GPUs replays its graphs for the requests that live on one rank, and for spread ones a
graph its ranks captured together (the all-to-alls inside). `--one-gpu-eager` adds a 1-GPU row
without either; `--parallel-mode` forces where the multi-GPU replica's requests run.

`--profile DIR`: after each size's timed requests, the multi-GPU replica profiles one more
(StartProfile / StopProfile: the server's trace and each rank's under DIR) and prints where
each rank's steps go (benchmarks/rank_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bursts
import diffusers_best
import numpy as np
import rank_profile
import torch

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.errors import OmniError
from omni_common.net.auth import cluster_metadata
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc

PROMPT = "a watercolor lighthouse at dusk"
NEGATIVE = "blurry, low quality"


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else round(10 * math.log10(1.0 / mse), 1)


def plan_for(args: argparse.Namespace, gpus: int, eager: bool) -> list[Any]:
    env = {
        "OMNISTAGE_DEVICE": "cpu" if args.cpu else "cuda:0",
        "OMNISTAGE_CAPTURE_SIZES": ",".join(f"{s}x{s}" for s in args.sizes),
    }
    plan = loopback_plan(args.model, dtype=args.dtype, extra_env=env)
    for proc in plan:
        if proc.name != "dit-denoise":
            continue
        if gpus > 1 and args.cpu:
            proc.environment["OMNISTAGE_DEVICES"] = ",".join(["cpu"] * gpus)
        elif gpus > 1:
            proc.environment["OMNISTAGE_GPUS"] = str(gpus)
        if gpus > 1:
            proc.environment["OMNISTAGE_PARALLEL_MODE"] = args.parallel_mode
        if gpus > 1 and args.profile:
            proc.environment["OMNISTAGE_PROFILE_DIR"] = str(args.profile / f"gpus-{gpus}")
        if eager:
            proc.environment["OMNISTAGE_COMPILE"] = "off"
            proc.environment["OMNISTAGE_CUDA_GRAPHS"] = "off"
    return plan


@contextlib.contextmanager
def logs_on_failure(cluster: LocalCluster) -> Iterator[None]:
    """A request that fails prints its services' last log lines first: without --logs their
    folder is gone once the run ends (a 2-GPU run's "internal error" went unexplained so)."""
    try:
        yield
    except OmniError:
        print(cluster.log_tails(80), file=sys.stderr, flush=True)
        raise


def measure(args: argparse.Namespace, gpus: int, eager: bool, log_dir: Path) -> dict[tuple[int, bool], Any]:
    """{(size, cfg): (p50 ms, first image)} of one cluster."""
    label = f"{gpus} GPU" + (" eager" if eager and gpus == 1 else "")
    out: dict[tuple[int, bool], Any] = {}
    started = time.perf_counter()
    plan, metrics = bursts.with_metrics(plan_for(args, gpus, eager), "dit-denoise")
    with (
        LocalCluster(plan, log_dir, start_timeout_s=1800) as cluster,
        Client(cluster.coordinator) as client,
        logs_on_failure(cluster),
    ):
        start_s = round(time.perf_counter() - started, 1)
        out[("start", False)] = start_s
        emit({"dit": label, "start_s": start_s})
        # The graphs of --sizes are recorded while idle after start: time none of that.
        emit({"dit": label, "idle_work_wait_s": bursts.wait_idle_work(metrics)})
        for size in args.sizes:
            for cfg in (False, True):
                guidance = {"negative_prompt": NEGATIVE, "guidance": 4.0} if cfg else {"guidance": 1.0}
                params = {"width": size, "height": size, "steps": args.steps, **guidance}
                client.generate_result(f"{PROMPT}, warm-up", seed=99, **params)  # type: ignore[arg-type]
                walls, image = [], None
                for run in range(args.runs):
                    t0 = time.perf_counter()
                    result = client.generate_result(PROMPT, seed=run, return_tensor=run == 0, **params)  # type: ignore[arg-type]
                    walls.append((time.perf_counter() - t0) * 1e3)
                    image = result.tensor if run == 0 else image
                    dit_ms = result.compute_ms.get("denoise", 0.0)
                out[(size, cfg)] = (p50(walls), image)
                if gpus > 1 and args.profile:
                    profiled(
                        cluster, gpus, functools.partial(client.generate_result, PROMPT, seed=0, **params)
                    )
                emit(
                    {
                        "dit": label,
                        "size": size,
                        "cfg": cfg,
                        "p50_ms": p50(walls),
                        "dit_compute_ms": round(dit_ms, 1),
                    }
                )
        if args.concurrent:
            size = min(args.sizes)
            params = {"width": size, "height": size, "steps": args.steps, "guidance": 1.0}
            burst(cluster.coordinator, args.concurrent, params)  # compiles what batches bring
            out[("burst", size)] = burst(cluster.coordinator, args.concurrent, params)
            emit(
                {"dit": label, "size": size, "concurrent": args.concurrent, "img_per_s": out[("burst", size)]}
            )
    return out


def profiled(cluster: LocalCluster, gpus: int, request: Callable[[], object]) -> None:
    """`request` with the DiT replica profiled; prints each rank's summary."""
    if cluster.token_file is not None:  # StageControl is internal: it takes the cluster token
        os.environ["OMNISTAGE_CLUSTER_TOKEN_FILE"] = str(cluster.token_file)
    address = next(proc.health_address for proc in cluster.plan if proc.name == "dit-denoise")
    with sync_channel(address, metadata=cluster_metadata()) as channel:
        control = stage_pb2_grpc.StageControlStub(channel)
        control.StartProfile(stage_pb2.StartProfileRequest(), timeout=60)
        try:
            request()
        finally:
            reply = control.StopProfile(stage_pb2.StopProfileRequest(), timeout=600)
    for rank, trace in enumerate(rank_profile.rank_traces(Path(reply.path).parent, gpus)):
        emit({"dit": f"{gpus} GPU", "profile_rank": rank, **rank_profile.summarize(trace)})


def burst(coordinator: str, count: int, params: dict[str, Any]) -> float:
    """Images/s of `count` requests sent at once (bursts.py)."""
    requests = [(f"{PROMPT} {i}", {"seed": i, **params}) for i in range(count)]
    return bursts.burst(coordinator, requests).img_per_s


def measure_diffusers(args: argparse.Namespace) -> dict[tuple[int, bool], dict[str, float]]:
    """{(size, cfg): {mode: p50 ms}} of diffusers in this process on the first device, its
    transformer compiled each way of --diffusers-modes (diffusers_best.py)."""
    device = torch.device("cpu" if args.cpu else "cuda:0")
    dtype = getattr(torch, args.dtype)
    out: dict[tuple[int, bool], dict[str, float]] = {}
    for mode in args.diffusers_modes:
        started = time.perf_counter()
        pipe = diffusers_best.load(args.model, device, dtype, mode, backend=args.diffusers_backend)
        for size in args.sizes:
            for cfg in (False, True):
                guidance = {"negative_prompt": NEGATIVE, "true_cfg_scale": 4.0} if cfg else {}
                params = {"width": size, "height": size, "num_inference_steps": args.steps, **guidance}
                walls = []
                for run in range(-1, args.runs):  # -1: the warm-up, which compiles
                    generator = torch.Generator("cpu").manual_seed(max(run, 0))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    pipe(PROMPT, generator=generator, output_type="pt", **params)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    walls.append((time.perf_counter() - t0) * 1e3)
                ms = p50(walls[1:])
                out.setdefault((size, cfg), {})[mode] = ms
                emit(
                    {"diffusers": mode, "size": size, "cfg": cfg, "p50_ms": ms, "warm_up_ms": round(walls[0])}
                )
        emit({"diffusers": mode, "total_s": round(time.perf_counter() - started, 1)})
        del pipe  # before the next mode loads: release() frees only what nothing names
        diffusers_best.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    parser.add_argument(
        "--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts; the first is the baseline"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--one-gpu-eager", type=int, default=1, help="1: also the 1-GPU DiT without compile/graphs"
    )
    parser.add_argument("--logs", type=Path, help="keep the services' logs here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="profile one request a size on the multi-GPU replica, into this directory",
    )
    parser.add_argument(
        "--parallel-mode", default="auto", help="the multi-GPU replica's --parallel-mode (auto: per request)"
    )
    parser.add_argument(
        "--concurrent", type=int, default=8, help="requests at once at the smallest size; 0: none"
    )
    diffusers_best.add_args(parser)
    parser.add_argument(
        "--cpu", action="store_true", help="gloo workers on the CPU: to try the script on a tiny model"
    )
    args = parser.parse_args()
    if not args.cpu and torch.cuda.device_count() < max(args.gpus):
        raise SystemExit(
            f"benchmarks/multi_gpu.py needs {max(args.gpus)} CUDA devices; {torch.cuda.device_count()} here"
        )
    runs: dict[str, dict[tuple[int, bool], Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.logs or Path(tmp)
        for gpus in args.gpus:
            runs[f"{gpus}"] = measure(args, gpus, False, logs / f"gpus-{gpus}")
        if args.one_gpu_eager:
            runs["1-eager"] = measure(args, 1, True, logs / "gpus-1-eager")
    competitor = measure_diffusers(args) if args.diffusers_modes else {}
    base = runs[str(args.gpus[0])]
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    summary: dict[str, object] = {"device": device, "steps": args.steps}
    for gpus in args.gpus[1:]:
        for (size, cfg), value in runs[str(gpus)].items():
            if size == "burst":  # ("burst", size): images/s
                key = f"{gpus}gpu_over_{args.gpus[0]}gpu_img_per_s_{cfg}x{args.concurrent}"
                summary[key] = round(value / base[(size, cfg)], 3)
                continue
            if size == "start":  # ("start", False): seconds until the cluster served
                summary[f"{gpus}gpu_over_{args.gpus[0]}gpu_start"] = round(value / base[(size, cfg)], 3)
                continue
            ms, image = value
            key = f"{gpus}gpu_over_{args.gpus[0]}gpu_{size}{'_cfg' if cfg else ''}"
            summary[key] = round(ms / base[(size, cfg)][0], 3)
            if "1-eager" in runs:
                summary[key + "_vs_eager"] = round(ms / runs["1-eager"][(size, cfg)][0], 3)
            if image is not None and base[(size, cfg)][1] is not None:
                summary[f"psnr_db_{gpus}gpu_{size}{'_cfg' if cfg else ''}"] = psnr(
                    image, base[(size, cfg)][1]
                )
    for (size, cfg), modes in competitor.items():
        mode, ms = diffusers_best.best(modes)
        suffix = f"{size}{'_cfg' if cfg else ''}"
        summary[f"diffusers_best_{suffix}"] = {"mode": mode, "p50_ms": ms, "by_mode": modes}
        for gpus in args.gpus:
            summary[f"{gpus}gpu_over_diffusers_{suffix}"] = round(runs[str(gpus)][(size, cfg)][0] / ms, 3)
    summary["targets"] = {
        "2gpu_over_1gpu_1024": "<= 0.60",
        "2gpu_over_1gpu_1024_cfg": "<= 0.53",
        "2gpu_over_1gpu_512": "<= 1.0",
        "2gpu_over_1gpu_img_per_s_512x8": ">= 1.9",
        "2gpu_over_1gpu_start": "<= 1.2",
        "1gpu_over_diffusers_1024": "<= 0.90",
        "1gpu_over_diffusers_512": "<= 0.6",
    }
    emit(summary)


if __name__ == "__main__":
    main()

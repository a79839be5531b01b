"""Continuous batching: images/s and latency of the cluster at several concurrencies, next
to diffusers in one process called one request at a time (what a user does) and called
once with all prompts in one batch (the upper bound), in the same run.

    python benchmarks/batching.py [--sizes 64 256] [--concurrency 1 4 8 16] [--steps 20]

Each concurrency level runs `rounds` closed-loop requests per client. Its throughput is
the steady state: requests finished between the moment every client has its first image
(all clients start at once, in lock-step: the first round only fills the pipeline) and the
moment the first client is done (after that fewer clients remain), over that time;
`images_per_s_whole_run` counts everything. Latencies are of the requests after each
client's first. Diffusers' sides are the median of `--repeats` runs. One JSON line per
(size, side, concurrency), then a summary per size with the ratios at concurrency 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from diffusers import QwenImagePipeline

from omni_common.client import AsyncClient
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.qwenimage.fixture import build_tiny_fixture

PROMPTS = [
    f"a small {c} {t}" for c in ("red", "blue", "green", "gold") for t in ("cup", "boat", "tree", "kite")
]


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def emit(**row: object) -> None:
    print(json.dumps({"bench": "batching", **row}), flush=True)


def diffusers_sides(pipe: QwenImagePipeline, size: int, steps: int, n: int, repeats: int) -> dict[str, float]:
    """images/s of n single calls and of one call with n prompts (medians of `repeats`)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    one_at_a_time, one_batch = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            pipe(
                prompt,
                width=size,
                height=size,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(i),
            )
        one_at_a_time.append(n / (time.perf_counter() - started))
        started = time.perf_counter()
        pipe(
            prompts,
            width=size,
            height=size,
            num_inference_steps=steps,
            generator=[torch.Generator().manual_seed(i) for i in range(n)],
        )
        one_batch.append(n / (time.perf_counter() - started))
    return {"one_at_a_time": statistics.median(one_at_a_time), "one_batch": statistics.median(one_batch)}


async def cluster_side(
    address: str, size: int, steps: int, concurrency: int, rounds: int
) -> dict[str, float]:
    async with AsyncClient(address) as client:
        await client.generate_result(PROMPTS[0], width=size, height=size, steps=steps)  # warm-up

        return await generate_loop(client, PROMPTS, size, steps, concurrency, rounds)


async def generate_loop(
    client: AsyncClient,
    prompts: list[str],
    size: int,
    steps: int,
    clients: int,
    rounds: int,
    options: Callable[[int], dict[str, Any]] = lambda worker: {},
) -> dict[str, float]:
    """closed_loop of generate requests: client w's round r sends prompts[(w + r) % n] with
    seed w * 100 + r and the client's own `options(w)`."""

    async def request(worker: int, r: int) -> None:
        await client.generate_result(
            prompts[(worker + r) % len(prompts)],
            width=size,
            height=size,
            steps=steps,
            seed=worker * 100 + r,
            progress_every=steps,
            **options(worker),
        )

    return await closed_loop(clients, rounds, request)


async def closed_loop(
    clients: int, rounds: int, request: Callable[[int, int], Awaitable[None]]
) -> dict[str, float]:
    """`clients` loops, each awaiting `request(client, round)` `rounds` times one after the
    other, all at once; their steady_state numbers."""
    finished: list[tuple[float, float, int]] = []  # (time done, latency ms, round)
    firsts: list[float] = []
    lasts: list[float] = []

    async def client_loop(worker: int) -> None:
        done = time.perf_counter()
        for r in range(rounds):
            started = time.perf_counter()
            await request(worker, r)
            done = time.perf_counter()
            finished.append((done, (done - started) * 1e3, r))
            if r == 0:
                firsts.append(done)
        lasts.append(done)

    started = time.perf_counter()
    await asyncio.gather(*(client_loop(w) for w in range(clients)))
    return steady_state(finished, firsts, lasts, time.perf_counter() - started)


def steady_state(
    finished: list[tuple[float, float, int]], firsts: list[float], lasts: list[float], wall: float
) -> dict[str, float]:
    """A closed loop's numbers: images/s between the moment every client has its first image
    and the moment the first client is done (the whole run's too), and the latency of every
    request but each client's first. `finished` holds (time done, ms, round) per request."""
    window_start, window_end = max(firsts), min(lasts)
    steady = sum(window_start < done <= window_end for done, _, _ in finished)
    latencies = [ms for _, ms, r in finished if r > 0]
    whole_run = len(finished) / wall
    return {
        "images_per_s": steady / (window_end - window_start) if steady else whole_run,
        "images_per_s_whole_run": whole_run,
        "p50_ms": statistics.median(latencies),
        "p95_ms": p95(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8, help="requests per client per level (>= 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each diffusers side")
    parser.add_argument("--stage-env", nargs="*", default=[], metavar="KEY=VALUE", help="extra stage env")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument(
        "--replicas", nargs="*", default=[], metavar="STAGE=N", help="stage replicas, e.g. vae-decode=2"
    )
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the first round fills the pipeline")

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_fixture(Path(tmp) / "qwen-image-tiny")
        pipe = QwenImagePipeline.from_pretrained(model, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        extra = dict(item.split("=", 1) for item in args.stage_env)
        replicas = {stage: int(n) for stage, n in (item.split("=", 1) for item in args.replicas)}
        plan = loopback_plan(model, extra_env={"OMNISTAGE_MAX_BATCH": "16", **extra}, replicas=replicas)
        with LocalCluster(plan, log_dir=Path(tmp) / "logs") as cluster:
            address = cluster.coordinator
            for size in args.sizes:
                base = {"one_at_a_time": float("nan"), "one_batch": float("nan")}
                if not args.skip_diffusers:
                    base = diffusers_sides(pipe, size, args.steps, n=8, repeats=args.repeats)
                for side, ips in base.items():
                    emit(size=size, side=f"diffusers_{side}", batch=8, images_per_s=round(ips, 3))
                at8 = None
                for concurrency in args.concurrency:
                    row = asyncio.run(cluster_side(address, size, args.steps, concurrency, args.rounds))
                    emit(
                        size=size,
                        side="cluster",
                        concurrency=concurrency,
                        **{k: round(v, 3) for k, v in row.items()},
                    )
                    if concurrency == 8:
                        at8 = row["images_per_s"]
                if at8 is not None:
                    emit(
                        size=size,
                        summary="concurrency 8",
                        vs_one_batch=round(at8 / base["one_batch"], 3),
                        vs_one_at_a_time=round(at8 / base["one_at_a_time"], 3),
                    )


if __name__ == "__main__":
    main()

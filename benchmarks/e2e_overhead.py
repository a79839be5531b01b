"""What the split costs: p50/p95 latency of the cluster (real processes on loopback) next to
diffusers' QwenImagePipeline in one process, same fixture, seed and steps, in one run.

    python benchmarks/e2e_overhead.py [--sizes 256 512] [--steps 20] [--runs 10]

Prints one JSON line per (size, side) and one with the ratio and the added milliseconds.
Wall-clock differences of two runs of ~1 s on a 2-core machine are noisy (tens of ms), so
the summary also gives the split's own cost measured inside each cluster run: client wall
time minus the time the three stages spent in model code (RPCs, handles, PNG, events).
Both sides return a PIL image to the caller; they alternate run by run, never at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from diffusers import QwenImagePipeline

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.qwenimage.fixture import build_tiny_fixture

PROMPT = "a watercolor lighthouse at dusk"


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered), 2), "p95_ms": round(p95, 2)}


def measure(calls: dict[str, Callable[[int], object]], runs: int, warmup: int) -> dict[str, list[float]]:
    """Alternate the sides run by run, so drift of this shared machine hits both alike."""
    for i in range(warmup):
        for call in calls.values():
            call(i)
    times: dict[str, list[float]] = {side: [] for side in calls}
    for i in range(runs):
        for side, call in calls.items():
            started = time.perf_counter()
            call(i)
            times[side].append((time.perf_counter() - started) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_fixture(Path(tmp) / "qwen-image-tiny")
        pipe = QwenImagePipeline.from_pretrained(model, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        # One request at a time runs one stage at a time: give each stage every core, as a
        # latency-minded deployment would (the launcher's default splits the cores).
        plan = loopback_plan(model, extra_env={"OMNISTAGE_THREADS": str(torch.get_num_threads())})
        with LocalCluster(plan, log_dir=Path(tmp) / "logs") as cluster, Client(cluster.coordinator) as client:
            for size in args.sizes:

                def in_process(seed: int, size: int = size) -> object:
                    return pipe(
                        PROMPT,
                        width=size,
                        height=size,
                        num_inference_steps=args.steps,
                        generator=torch.Generator().manual_seed(seed),
                    ).images[0]

                inside: list[float] = []

                def cluster(seed: int, size: int = size, inside: list[float] = inside) -> object:
                    started = time.perf_counter()
                    result = client.generate_result(
                        PROMPT, width=size, height=size, steps=args.steps, seed=seed
                    )
                    wall_ms = (time.perf_counter() - started) * 1e3
                    inside.append(wall_ms - sum(result.compute_ms.values()))
                    return result.image

                rows = {}
                samples = measure({"diffusers": in_process, "cluster": cluster}, args.runs, args.warmup)
                for side, times in samples.items():
                    stats = rows[side] = percentiles(times)
                    print(
                        json.dumps(
                            {
                                "bench": "e2e_overhead",
                                "size": size,
                                "steps": args.steps,
                                "side": side,
                                "runs": args.runs,
                                **stats,
                            }
                        ),
                        flush=True,
                    )
                split_cost = percentiles(inside[args.warmup :])
                print(
                    json.dumps(
                        {
                            "bench": "e2e_overhead",
                            "size": size,
                            "steps": args.steps,
                            "split_cost_p50_ms": split_cost["p50_ms"],
                            "split_cost_p95_ms": split_cost["p95_ms"],
                            "ratio_p50": round(rows["cluster"]["p50_ms"] / rows["diffusers"]["p50_ms"], 4),
                            "added_p50_ms": round(rows["cluster"]["p50_ms"] - rows["diffusers"]["p50_ms"], 2),
                            "added_p95_ms": round(rows["cluster"]["p95_ms"] - rows["diffusers"]["p95_ms"], 2),
                            "threads": torch.get_num_threads(),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()

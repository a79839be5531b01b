"""LoRA adapters under load: images/s of the cluster at 8 concurrent requests with no adapter,
and with 1, 2 and 8 different adapters (client i takes adapter i mod k), for both ways the DiT
batches them (--lora-batching mixed: one forward, each row its own adapters; grouped: one
forward per adapter set), next to diffusers in one process in the same run: one request at a
time, switching adapters with `set_adapters` before each (what a user of one pipeline does with
requests for different adapters), and its one batch of 8 without adapters (the upper bound).

    python benchmarks/lora.py [--size 64] [--steps 20] [--rounds 4] [--rank 8]

The DiT alone, in this process: the time of one step that advances 8 requests with k different
adapters, as one mixed forward and as one forward per adapter (grouped), at 64x64 and 256x256
(what --lora-batching decides, without the other stages' share of the CPU).

Throughput is the steady state of a closed loop (benchmarks/batching.py's rule: requests
finished between the moment every client has its first image and the moment the first client
is done). One JSON line per (side, adapters), then the ratios against no adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from batching import generate_loop
from diffusers import QwenImagePipeline

from omni_common.client import AsyncClient
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.lora_files import save_random_lora
from omni_common.models.qwenimage.fixture import build_tiny_fixture

CONCURRENCY = 8
ADAPTER_COUNTS = (0, 1, 2, 8)
PROMPTS = [f"a small {c} {t}" for c in ("red", "blue", "green", "gold") for t in ("cup", "boat")]


def emit(**row: object) -> None:
    print(json.dumps({"bench": "lora", **row}), flush=True)


def loras_of(worker: int, adapters: int) -> list[tuple[str, float]]:
    return [(f"style{worker % adapters}", 0.8)] if adapters else []


async def cluster_side(address: str, size: int, steps: int, adapters: int, rounds: int) -> dict[str, float]:
    async with AsyncClient(address) as client:
        # Warm-up: every adapter loads (from the adapter directory) before the clock starts.
        await asyncio.gather(
            *(
                client.generate_result(
                    PROMPTS[0], width=size, height=size, steps=2, loras=loras_of(w, adapters)
                )
                for w in range(max(adapters, 1))
            )
        )

        return await generate_loop(
            client,
            PROMPTS,
            size,
            steps,
            CONCURRENCY,
            rounds,
            options=lambda worker: {"loras": loras_of(worker, adapters)},
        )


def diffusers_side(pipe: QwenImagePipeline, size: int, steps: int, adapters: int, repeats: int) -> float:
    """images/s of 8 requests one at a time, each after set_adapters for its adapter (median
    of `repeats` after one untimed run)."""
    runs = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for worker in range(CONCURRENCY):
            loras = loras_of(worker, adapters)
            if loras:
                pipe.enable_lora()
                pipe.set_adapters([name for name, _ in loras], [scale for _, scale in loras])
            else:
                pipe.disable_lora()
            pipe(
                PROMPTS[worker % len(PROMPTS)],
                width=size,
                height=size,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(worker),
            )
        runs.append(CONCURRENCY / (time.perf_counter() - started))
    return statistics.median(runs[1:])


def diffusers_one_batch(pipe: QwenImagePipeline, size: int, steps: int, repeats: int) -> float:
    """images/s of one call with 8 prompts and no adapter: the upper bound (median of
    `repeats` after one untimed run)."""
    pipe.disable_lora()
    runs = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        pipe(
            PROMPTS[:CONCURRENCY],
            width=size,
            height=size,
            num_inference_steps=steps,
            generator=[torch.Generator().manual_seed(i) for i in range(CONCURRENCY)],
        )
        runs.append(CONCURRENCY / (time.perf_counter() - started))
    return statistics.median(runs[1:])


def dit_steps(model: Path, paths: list[Path], size: int, repeats: int) -> dict[tuple[int, str], float]:
    """ms of one step advancing 8 requests, by (adapters k, batching): the lowest of `repeats`
    steps, each configuration's steps interleaved with the others' so that a busy CPU weighs
    on all of them alike."""
    from omni_common.models.base import GenerationRequest
    from omni_common.models.qwenimage.denoise import QwenImageDenoiser
    from omni_common.models.qwenimage.encode import QwenImageEncoder

    cpu = torch.device("cpu")
    encoder = QwenImageEncoder.load(model, cpu, torch.float32)
    denoiser = QwenImageDenoiser.load(model, cpu, torch.float32)
    for i, path in enumerate(paths):
        denoiser.loras.add(f"style{i}", path)
    configs: dict[tuple[int, str], list[list[object]]] = {}
    for adapters in ADAPTER_COUNTS:
        requests = [
            GenerationRequest(
                prompt=PROMPTS[w],
                width=size,
                height=size,
                num_inference_steps=1000,
                seed=w,
                loras=tuple(loras_of(w, adapters)),
            )
            for w in range(CONCURRENCY)
        ]
        states = [denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)]
        for batching in ("mixed", "grouped") if adapters else ("mixed",):
            groups: dict[object, list[object]] = {}
            for state in states:
                groups.setdefault(state.request.loras if batching == "grouped" else (), []).append(state)
            configs[adapters, batching] = list(groups.values())
    times: dict[tuple[int, str], list[float]] = {key: [] for key in configs}
    for _ in range(repeats + 1):  # the first round untimed
        for key, groups_of in configs.items():
            started = time.perf_counter()
            for group in groups_of:
                denoiser.step(group)  # type: ignore[arg-type]
            times[key].append((time.perf_counter() - started) * 1e3)
    return {key: min(samples[1:]) for key, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="requests per client per level (>= 3)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each diffusers side")
    parser.add_argument("--batching", nargs="+", default=["mixed", "grouped"], choices=("mixed", "grouped"))
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument(
        "--dit-sizes", type=int, nargs="*", default=[64, 256], help="DiT step rows (none: skip)"
    )
    parser.add_argument("--dit-repeats", type=int, default=20, help="timed steps per DiT configuration")
    parser.add_argument("--skip-cluster", action="store_true")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the first round fills the pipeline")

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_fixture(Path(tmp) / "qwen-image-tiny")
        pipe = QwenImagePipeline.from_pretrained(model, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        adapter_dir = Path(tmp) / "adapters"
        paths = [  # written before PEFT wraps the pipeline's layers
            save_random_lora(adapter_dir / f"style{i}.safetensors", pipe.transformer, rank=args.rank, seed=i)
            for i in range(max(ADAPTER_COUNTS))
        ]
        if not args.skip_diffusers:
            for i, path in enumerate(paths):
                pipe.load_lora_weights(str(path), adapter_name=f"style{i}")

        for size in args.dit_sizes:
            ms = dit_steps(model, paths, size, args.dit_repeats)
            plain = ms[0, "mixed"]
            emit(side="dit_step", size=size, adapters=0, ms=round(plain, 2))
            for (adapters, batching), value in ms.items():
                if adapters:
                    emit(
                        side=f"dit_step_{batching}",
                        size=size,
                        adapters=adapters,
                        ms=round(value, 2),
                        vs_no_adapter=round(value / plain, 3),
                    )
        base: dict[int, float] = {}
        if not args.skip_diffusers:
            emit(
                side="diffusers_one_batch",
                adapters=0,
                images_per_s=round(diffusers_one_batch(pipe, args.size, args.steps, args.repeats), 3),
            )
            for adapters in ADAPTER_COUNTS:
                base[adapters] = diffusers_side(pipe, args.size, args.steps, adapters, args.repeats)
                emit(side="diffusers_one_at_a_time", adapters=adapters, images_per_s=round(base[adapters], 3))
        for batching in [] if args.skip_cluster else args.batching:
            env = {
                "OMNISTAGE_MAX_BATCH": "16",
                "OMNISTAGE_LORA_DIR": str(adapter_dir),
                "OMNISTAGE_LORA_BATCHING": batching,
            }
            plan = loopback_plan(model, extra_env=env)
            with LocalCluster(plan, log_dir=Path(tmp) / f"logs-{batching}") as cluster:
                rows = {}
                for adapters in ADAPTER_COUNTS:
                    rows[adapters] = asyncio.run(
                        cluster_side(cluster.coordinator, args.size, args.steps, adapters, args.rounds)
                    )
                    emit(
                        side=f"cluster_{batching}",
                        adapters=adapters,
                        concurrency=CONCURRENCY,
                        **{k: round(v, 3) for k, v in rows[adapters].items()},
                    )
            for adapters in ADAPTER_COUNTS[1:]:
                ratio = rows[adapters]["images_per_s"] / rows[0]["images_per_s"]
                summary = {"vs_no_adapter": round(ratio, 3)}
                if adapters in base:
                    summary["vs_diffusers_one_at_a_time"] = round(
                        rows[adapters]["images_per_s"] / base[adapters], 3
                    )
                emit(summary=f"cluster_{batching}", adapters=adapters, **summary)


if __name__ == "__main__":
    main()

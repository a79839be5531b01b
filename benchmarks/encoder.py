"""ar-encoder backends side by side: prompts/s and p50 latency of the torch and vLLM
backends at several concurrencies on the tiny fixture (head_dim 32, which vLLM's CPU
attention needs), with the prompt cache off, then the latency of a cache hit.

    python benchmarks/encoder.py [--concurrency 1 8 32] [--requests 64] [--backends torch vllm]

Both backends run behind the service's own runner (services/ar_encoder/runner.py) in this
process; vLLM's engine core runs in its own process, as in the service. One JSON line per
(backend, concurrency), one for the cache hit, and a summary with vllm/torch ratios.
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

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.fixture import build_tiny_fixture
from omni_common.models.qwenimage.prompt_cache import EmbeddingCache
from omni_common.models.qwenimage.prompt_encoder import PromptEncoder, TextBackend, TorchBackend, VllmBackend

PROMPTS = [
    f"a small {c} {t} on a {s} table"
    for c in ("red", "blue", "green", "gold")
    for t in ("cup", "boat", "tree", "kite")
    for s in ("wooden", "glass")
]


def emit(**row: object) -> None:
    print(json.dumps({"bench": "encoder", **row}), flush=True)


def make_backend(name: str, model: Path) -> TextBackend:
    if name == "vllm":
        from omni_common.models.qwenimage.vllm_encoder import VllmTextEncoder

        return VllmBackend(VllmTextEncoder(model, torch.float32), max_queue=1024)
    encoder = QwenImageEncoder.load(model, torch.device("cpu"), torch.float32)
    # As in the service: one forward at a time on a compute thread, concurrent requests batched.
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)

    async def compute(fn: Callable[..., Any], *args: object) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    return TorchBackend(encoder, compute, window_s=0.0, max_batch=32, max_queue=1024)


async def closed_loop(
    encode: Callable[[GenerationRequest], Awaitable[object]], concurrency: int, total: int
) -> tuple[float, float]:
    """(prompts/s, p50 latency ms) of `total` requests from `concurrency` clients."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def client() -> None:
        for i in counter:
            request = GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)] + f" #{i}", true_cfg_scale=1.0)
            started = time.perf_counter()
            await encode(request)
            latencies.append((time.perf_counter() - started) * 1e3)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return total / (time.perf_counter() - started), statistics.median(latencies)


async def bench_backend(name: str, model: Path, levels: list[int], total: int) -> dict[int, float]:
    started = time.perf_counter()
    backend = make_backend(name, model)
    emit(backend=name, event="start", start_s=round(time.perf_counter() - started, 2))
    rates: dict[int, float] = {}
    try:
        runner = PromptEncoder(backend, EmbeddingCache(0), f"tiny:{name}")
        await closed_loop(runner.encode, 4, 8)  # warm-up
        for concurrency in levels:
            rate, p50 = await closed_loop(runner.encode, concurrency, max(total, concurrency))
            rates[concurrency] = rate
            emit(backend=name, concurrency=concurrency, prompts_per_s=round(rate, 1), p50_ms=round(p50, 2))
        cached = PromptEncoder(backend, EmbeddingCache(256 << 20), f"tiny:{name}")
        request = GenerationRequest(prompt=PROMPTS[0], negative_prompt=" ", true_cfg_scale=4.0)
        miss_started = time.perf_counter()
        await cached.encode(request)
        miss_ms = (time.perf_counter() - miss_started) * 1e3
        hits = []
        for _ in range(200):
            hit_started = time.perf_counter()
            await cached.encode(request)
            hits.append((time.perf_counter() - hit_started) * 1e3)
        emit(
            backend=name,
            event="cache",
            miss_ms=round(miss_ms, 3),
            hit_p50_ms=round(statistics.median(hits), 4),
            texts_per_request=2,
        )
    finally:
        backend.close()
    return rates


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_fixture(Path(tmp) / "qwen-image-tiny-hd32", head_dim=32)
        results = {
            name: await bench_backend(name, model, args.concurrency, args.requests) for name in args.backends
        }
    if {"torch", "vllm"} <= results.keys():
        emit(
            summary="vllm/torch prompts_per_s",
            **{f"c{c}": round(results["vllm"][c] / results["torch"][c], 3) for c in args.concurrency},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--backends", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this module
    main()

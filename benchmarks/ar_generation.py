"""GLM-Image's AR stage, the one that generates: prior tokens/s at several concurrencies, next
to transformers' `generate` called one request at a time (what GlmImagePipeline does) and once
with all prompts in one static batch (the upper bound of batching without continuous
admission), each eager and with the AR forward compiled (torch.compile), in the same run;
then edit-mode latency through a cluster of real processes with the condition KV cold (a new
image) and warm (an image the step cache holds). Our side runs eager.

    python benchmarks/ar_generation.py [--concurrency 1 8 32] [--size 64] [--edits 6]
    python benchmarks/ar_generation.py --device cuda ...   # real size on a GPU: ar_decode_gpu.py

Tokens/s: our side runs the prior role under the stage's own StepScheduler (continuous
batching: a request joins the running batch at the next token and leaves when it ends), each
of `concurrency` clients sending `rounds` requests back to back; it counts the tokens each
request sampled over the wall time. `generate` one at a time is the pipeline's own recipe per
request (`reference_prior`); the static batch is one `generate` of `concurrency` prompts, left
padded, counting every row's new tokens. The same prompts, sizes and seeds on every side.
One JSON line per result, then a summary with the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image

from omni_common.client import AsyncClient
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.glm_image.fixture import build_tiny_fixture
from omni_common.models.glm_image.prior import GlmImagePrior
from omni_common.models.glm_image.reference import load_pipeline, reference_prior
from omni_common.runtime.calls import StageCall
from omni_common.runtime.step_scheduler import StepScheduler

PROMPTS = [
    f"a {c} {t} with a sign that says '{t}'"
    for c in ("red", "blue", "gold", "green")
    for t in ("cafe", "boat", "kite", "tree")
]


def emit(**row: object) -> None:
    print(json.dumps({"bench": "ar_generation", **row}), flush=True)


def request(i: int, size: int) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], width=size, height=size, seed=i)


async def ours(prior: GlmImagePrior, concurrency: int, rounds: int, size: int) -> tuple[int, float]:
    """(tokens sampled, seconds) of `concurrency` closed-loop clients through the StepScheduler."""

    async def inline(fn: Any, *args: object) -> Any:  # one process, one compute thread: this one
        return fn(*args)

    scheduler = StepScheduler(
        prior, inline, max_batch=concurrency, max_queue=concurrency, max_tokens=1 << 30, name="prior"
    )
    tokens = 0

    async def client(c: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            i = c * rounds + r
            call = StageCall(f"bench-{i}", request(i, size), StageState({}), role="prior")
            async for event in scheduler.run(call):
                if isinstance(event, StageState):
                    tokens += int(event.meta["tokens"])

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    seconds = time.perf_counter() - started
    scheduler.close()
    return tokens, seconds


def one_at_a_time(pipe: Any, n: int, size: int) -> tuple[int, float]:
    started = time.perf_counter()
    tokens = sum(len(reference_prior(pipe, request(i, size)).sampled) for i in range(n))
    return tokens, time.perf_counter() - started


@torch.no_grad()
def static_batch(pipe: Any, n: int, size: int) -> tuple[int, float]:
    """One `generate` over n prompts (left padded), as many new tokens as one request needs."""
    processor, model = pipe.processor, pipe.vision_language_encoder
    processor.tokenizer.padding_side = "left"
    messages = [
        [{"role": "user", "content": [{"type": "text", "text": request(i, size).prompt}]}] for i in range(n)
    ]
    started = time.perf_counter()
    batch = processor.apply_chat_template(
        messages,
        tokenize=True,
        padding=True,
        target_h=size,
        target_w=size,
        return_dict=True,
        return_tensors="pt",
    )
    total, _, _, _ = type(pipe)._compute_generation_params(batch["image_grid_thw"][:2], is_text_to_image=True)
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=total, do_sample=True)
    return n * (out.shape[1] - batch["input_ids"].shape[1]), time.perf_counter() - started


def png(seed: int, size: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


async def edit_latencies(address: str, edits: int, size: int) -> dict[str, list[float]]:
    """Per edit request: its latency (ms) and its condition-kv step's wall time, cold (a new
    image each) then warm (the first image again, its KV in the step cache)."""
    found: dict[str, list[float]] = {"cold_ms": [], "warm_ms": [], "cold_kv_ms": [], "warm_kv_ms": []}
    async with AsyncClient(address) as client:
        for kind, images in (
            ("cold", [png(100 + i, size) for i in range(edits)]),
            ("warm", [png(100, size)] * edits),
        ):
            for i, image in enumerate(images):
                started = time.perf_counter()
                kv_ms = 0.0
                async for event in client.events(
                    "add a sign saying 'open'", images=[image], width=size, height=size, steps=4, seed=i
                ):
                    if event.HasField("stage_finished") and event.stage_finished.step in (
                        "condition-kv",
                        "vae-encode",
                    ):
                        kv_ms += event.stage_finished.wall_ms
                found[f"{kind}_ms"].append((time.perf_counter() - started) * 1e3)
                found[f"{kind}_kv_ms"].append(kv_ms)
    return found


def main() -> None:
    if "--device" in sys.argv:  # the real-size GPU measurement: its own script and flags
        from ar_decode_gpu import main as gpu_main

        gpu_main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="requests per client on our side")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--edits", type=int, default=6, help="edit requests per cold/warm side")
    args = parser.parse_args()
    model = build_tiny_fixture(Path(tempfile.gettempdir()) / "omnistage-bench-glm-image")
    pipe = load_pipeline(model)
    prior = GlmImagePrior.load(model, torch.device("cpu"), torch.float32, max_slots=max(args.concurrency))
    emit(machine=f"{os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} torch threads")

    one_at_a_time(pipe, 1, args.size)  # warm up both sides
    asyncio.run(ours(prior, 1, 1, args.size))
    rates: dict[tuple[str, int], float] = {}

    def record(side: str, concurrency: int, tokens: int, seconds: float) -> None:
        rates[side, concurrency] = tokens / seconds
        emit(side=side, concurrency=concurrency, tokens=tokens, tokens_per_s=round(tokens / seconds, 1))

    for concurrency in args.concurrency:
        record("omnistage", concurrency, *asyncio.run(ours(prior, concurrency, args.rounds, args.size)))
        requests = min(concurrency * args.rounds, 8)  # the rate does not depend on the count
        record("generate one at a time", concurrency, *one_at_a_time(pipe, requests, args.size))
        record("generate static batch", concurrency, *static_batch(pipe, concurrency, args.size))
    # The competitor at its best: the AR forward compiled. Each side runs its requests once
    # untimed first, so compiling (and recompiling for new shapes) is left out of the timings.
    model_ar = pipe.vision_language_encoder
    model_ar.forward = torch.compile(model_ar.forward, dynamic=True)
    for concurrency in args.concurrency:
        requests = min(concurrency * args.rounds, 8)
        one_at_a_time(pipe, requests, args.size)
        static_batch(pipe, concurrency, args.size)
        record("compiled generate one at a time", concurrency, *one_at_a_time(pipe, requests, args.size))
        record("compiled generate static batch", concurrency, *static_batch(pipe, concurrency, args.size))
    summary = {}
    for concurrency in args.concurrency:
        ours_rate = rates["omnistage", concurrency]
        summary[concurrency] = {
            f"vs_{side.replace(' ', '_')}": round(ours_rate / rates[side, concurrency], 2)
            for side in (
                "generate one at a time",
                "compiled generate one at a time",
                "generate static batch",
                "compiled generate static batch",
            )
        }
    emit(summary="tokens/s ratios, omnistage / transformers", ratios=summary)

    with (
        tempfile.TemporaryDirectory() as logs,
        LocalCluster(loopback_plan(model), log_dir=Path(logs)) as cluster,
    ):
        found = asyncio.run(edit_latencies(cluster.coordinator, args.edits, args.size))
    # The first cold request also pays for warming the stages: it is left out.
    medians = {
        name: round(statistics.median(values[1:] if name.startswith("cold") else values), 1)
        for name, values in found.items()
    }
    emit(
        side="edit through a cluster",
        size=args.size,
        **medians,
        warm_over_cold=round(medians["warm_ms"] / medians["cold_ms"], 2),
    )


if __name__ == "__main__":
    main()

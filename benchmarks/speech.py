"""Spoken replies (Qwen2.5-Omni): time to the first audio and real-time factor through a cluster
of real processes (thinker and talker on the ar-encoder, token2wav on the dit-denoise stage,
the vocoder on vae-decode, each streaming into the next), next to transformers' one-shot
`Qwen2_5OmniForConditionalGeneration.generate(return_audio=True)` in one process, which returns
audio only once the whole reply is spoken. Same checkpoint, prompt, token caps and seeds.

    python benchmarks/speech.py [--model DIR] [--codes 240] [--tokens 32] [--rounds 3]
        [--feed-tokens 1 8] [--no-reference]

Concurrency 1: each side serves one request at a time. Concurrency 8: our side takes 8 requests
at once (continuous batching in every stage); transformers gets the 8 as one batched `generate`
(its best setting for throughput; the same prompt 8 times, so no padding; a batch in which a
random talker ends a reply before its first code, which transformers cannot vocode, is drawn
again with the next seed). First audio: ours is
the first AudioChunk at the client; transformers' is the whole waveform. Real-time factor: wall
time over seconds of audio made (below 1 is faster than real time). One JSON line per result,
then the ratios. Without --model, the tiny random fixture (a random talker never ends by itself:
`--codes` caps its speech; 240 codes = 4.8 s). `--feed-tokens` runs our side once per value of
the option feed_tokens (thinker tokens per Feed to the talker; 1 is a Feed per token) and counts
the talker's Feed RPCs per reply (the ar-encoder's omnistage_stage_feeds metric);
`--no-reference` leaves transformers out (to compare our own settings on a busy machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.chat import SpeechChunk
from omni_common.client import AsyncClient
from omni_common.cluster import LOOPBACK, LocalCluster, LocalProcess, free_port, loopback_plan
from omni_common.models.qwen_omni.checkpoint import chat_input_ids
from omni_common.models.qwen_omni.fixture import build_tiny_fixture
from omni_common.models.qwen_omni.reference import load_model

PROMPT = "Tell me about the sea, in a few sentences."
SAMPLE_RATE = 24_000


def emit(**row: object) -> None:
    print(json.dumps({"bench": "speech", **row}), flush=True)


def transformers_side(
    model_dir: Path, concurrency: int, tokens: int, codes: int, rounds: int
) -> dict[str, float]:
    """One-shot generate: ms to the (whole) waveform per request, and the real-time factor."""
    from transformers import AutoTokenizer

    model = load_model(model_dir)
    ids = chat_input_ids(AutoTokenizer.from_pretrained(model_dir), PROMPT).repeat(concurrency, 1)
    latencies, audio_s, wall = [], 0.0, 0.0
    seed, done = 0, 0
    while done <= rounds:  # the first round warms up
        seed += 1
        torch.manual_seed(seed)
        started = time.perf_counter()
        try:
            _, waves = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_mode="audio",
                thinker_max_new_tokens=tokens,
                talker_max_new_tokens=codes,
            )
        except RuntimeError:  # a random talker's reply without codes: transformers cannot vocode it
            continue
        seconds = time.perf_counter() - started
        if done:
            waves = [waves] if concurrency == 1 else waves
            latencies += [seconds * 1e3] * concurrency
            audio_s += sum(len(w) for w in waves) / SAMPLE_RATE
            wall += seconds
        done += 1
    return {
        "first_audio_ms": statistics.median(latencies),
        "done_ms": statistics.median(latencies),
        "rtf": wall / audio_s,
    }


async def our_side(
    address: str, concurrency: int, tokens: int, codes: int, rounds: int, feed_tokens: int
) -> dict[str, float]:
    """Streamed replies through the cluster: ms to the first AudioChunk and to the end."""
    options = {"max_new_tokens": tokens, "talker_max_new_tokens": codes, "feed_tokens": feed_tokens}
    firsts, dones, audio_s, wall = [], [], 0.0, 0.0

    async def reply(client: AsyncClient, seed: int) -> tuple[float, float, float]:
        started = time.perf_counter()
        first, samples = None, 0
        async for piece in client.chat(PROMPT, seed=seed, options=options):
            if isinstance(piece, SpeechChunk):
                first = first or time.perf_counter() - started
                samples += len(piece.samples)
        done = time.perf_counter() - started
        return (first or done) * 1e3, done * 1e3, samples / SAMPLE_RATE

    async with AsyncClient(address) as client:
        for round_ in range(rounds + 1):
            started = time.perf_counter()
            results = await asyncio.gather(*(reply(client, round_ * 100 + i) for i in range(concurrency)))
            if round_:
                wall += time.perf_counter() - started
                firsts += [r[0] for r in results]
                dones += [r[1] for r in results]
                audio_s += sum(r[2] for r in results)
    return {
        "first_audio_ms": statistics.median(firsts),
        "done_ms": statistics.median(dones),
        "rtf": wall / audio_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--codes", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--feed-tokens", type=int, nargs="+", default=[8])
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_tiny_fixture(Path(scratch) / "qwen-omni-tiny")
        found: dict[tuple[str, int], dict[str, float]] = {}
        for c in [] if args.no_reference else args.concurrency:
            found["transformers", c] = transformers_side(model, c, args.tokens, args.codes, args.rounds)
            emit(side="transformers one-shot generate", concurrency=c, **_rounded(found["transformers", c]))
        plan, metrics = with_metrics(loopback_plan(model), "ar-encoder")
        with LocalCluster(plan, log_dir=Path(scratch)) as cluster:
            for c in args.concurrency:
                for k in args.feed_tokens:
                    fed = talker_feeds(metrics)
                    ours = asyncio.run(
                        our_side(cluster.coordinator, c, args.tokens, args.codes, args.rounds, k)
                    )
                    ours["feeds_per_reply"] = (talker_feeds(metrics) - fed) / (c * (args.rounds + 1))
                    found[f"ours k={k}", c] = ours
                    emit(side="omnistage streamed", concurrency=c, feed_tokens=k, **_rounded(ours))
    if args.no_reference:
        return
    emit(
        summary="omnistage / transformers",
        ratios={
            f"c{c} feed_tokens={k} {key}": round(
                found[f"ours k={k}", c][key] / found["transformers", c][key], 3
            )
            for c in args.concurrency
            for k in args.feed_tokens
            for key in ("first_audio_ms", "done_ms", "rtf")
        },
    )


def with_metrics(plan: list[LocalProcess], name: str) -> tuple[list[LocalProcess], str]:
    """`plan` with process `name` serving its metrics on a free port; their URL."""
    port = free_port()
    index = next(i for i, proc in enumerate(plan) if proc.name == name)
    proc = plan[index]
    plan[index] = replace(proc, environment={**proc.environment, "OMNISTAGE_METRICS_PORT": str(port)})
    return plan, f"http://{LOOPBACK}:{port}/metrics"


def talker_feeds(url: str) -> float:
    """The Feed calls the talker has taken so far."""
    with urllib.request.urlopen(url, timeout=10) as response:  # (our own loopback URL)
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("omnistage_stage_feeds_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'role="talker"' in line)


def _rounded(row: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 3 if key == "rtf" else 1) for key, value in row.items()}


if __name__ == "__main__":
    main()

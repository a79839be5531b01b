"""Chunked prefill: how long a running reply waits between two of its tokens while a long prompt
joins, with the joining prompt prefilled whole (chunk 0: its prefill runs between two steps)
and a chunk per step, on the tiny Qwen2.5-Omni thinker (or a checkpoint given by --model).

    python benchmarks/chunked_prefill.py [--words 120] [--chunks 0 512 128] [--device cpu]
        [--burst 8]

Each round: a reply decodes a few tokens, then the long prompt is admitted (`prepare`) and both
step until the prompt's prefill is done; the round's gap is the longest wall time between two
of the running reply's tokens (prepare + step for chunk 0). One JSON line per chunk size: the
median gap over the rounds and a lone decode step's time. With `--burst N`, the joining prompt
is N short ones admitted at once (as the stage's compute thread runs a burst's admissions back
to back), each within one chunk: with chunking off they are prefilled when admitted, with it the
steps prefill one each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwen_omni.fixture import build_tiny_fixture
from omni_common.models.qwen_omni.thinker import Thinker


def request(prompt: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, seed=1, options=(("audio", "1"), ("max_new_tokens", str(tokens))))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rounds(thinker: Thinker, prompts: list[str], count: int) -> dict[str, float]:
    """The running reply's longest gap (ms) per round while `prompts` join at once, a lone
    step's time, the joining prompts' length (the longest)."""
    gaps, lone, length = [], [], 0
    for _ in range(count):
        running = thinker.prepare(request("Tell me a short story.", 400), StageState({}))
        for _ in range(3):
            thinker.step([running])
        sync(thinker.device)
        started = time.perf_counter()
        joining = [thinker.prepare(request(prompt, 4), StageState({})) for prompt in prompts]
        thinker.step([running, *joining])
        sync(thinker.device)
        worst = time.perf_counter() - started
        while any(state.prefill is not None for state in joining):
            started = time.perf_counter()
            thinker.step([running, *joining])
            sync(thinker.device)
            worst = max(worst, time.perf_counter() - started)
        started = time.perf_counter()
        thinker.step([running])
        sync(thinker.device)
        lone.append(time.perf_counter() - started)
        gaps.append(worst)
        length = max(state.prompt_length for state in joining)
        for state in (running, *joining):
            thinker.release(state)
    return {
        "prompt_tokens": length,
        "longest_gap_ms": round(statistics.median(gaps) * 1e3, 2),
        "lone_step_ms": round(statistics.median(lone) * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a Qwen2.5-Omni checkpoint (default: the tiny fixture)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--words", type=int, default=120, help="sentences in the joining prompt")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--burst", type=int, default=0, help="N short prompts join instead of the long one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    prompts = [
        " ".join(f"Sentence {i} of a long prompt about boats, rivers and the sea." for i in range(args.words))
    ]
    if args.burst:
        prompts = [f"Say something about boat number {i}." for i in range(args.burst)]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_tiny_fixture(Path(scratch) / "qwen-omni-tiny")
        for chunk in args.chunks:
            thinker = Thinker.load(
                model,
                device,
                torch.float32,
                max_slots=1 + len(prompts),
                decode="eager",
                prefix_bytes=0,
                prefill_chunk_tokens=chunk,
            )
            result = rounds(thinker, prompts, args.rounds)
            row = {"bench": "chunked_prefill", "device": str(device), "chunk": chunk, "joining": len(prompts)}
            print(json.dumps({**row, **result}))


if __name__ == "__main__":
    main()

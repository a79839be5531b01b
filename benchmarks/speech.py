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
`--no-reference` leaves transformers out (to compare our own settings on a busy machine). After
our side, per role, the medians of the stages' own lines for its requests (`stage_lines`).

On a GPU (`--device cuda`, issue 34), Qwen2.5-Omni at real size with random bf16 weights:

    omnistage fixture --family qwen2.5-omni /tmp/qwen-omni-full --random-weights full
    python benchmarks/speech.py --device cuda --model /tmp/qwen-omni-full --prompt-tokens 64

concurrency 1, 8 and 32 by default; first text token too (ours: the first TextDelta at the
client; transformers': the thinker's first sampled token, seen by a streamer, though its caller
gets nothing before the waveform); transformers' side built with the cluster's seeded weights
(`load_model_on`), its thinker's and talker's `generate` with a static cache (transformers
compiles their decode step; `--reference-cache static dynamic` times both, a static cache that
fails is reported and the default cache timed instead), freed before the cluster starts.
`--prompt-tokens 64` makes the prompt 64 tokens long (chat template included); the last line
holds issue 34's targets (c=1: first audio <= 300 ms, RTF <= 0.1; c=32: first audio p50 <= 1 s,
RTF <= 0.5). `--reference-only` / `--no-reference` split the run over two calls.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bursts
import torch
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from omni_common.chat import SpeechChunk, TextDelta
from omni_common.client import AsyncClient
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.qwen_omni.checkpoint import chat_input_ids
from omni_common.models.qwen_omni.fixture import build_tiny_fixture
from omni_common.models.qwen_omni.reference import load_model_on
from omni_common.stages import MAX_BATCH

PROMPT = "Tell me about the sea, in a few sentences."
SAMPLE_RATE = 24_000
MAX_REDRAWS = 8  # seeds transformers' side may draw again (a reply without codes) before it gives up


def emit(**row: object) -> None:
    print(json.dumps({"bench": "speech", **row}), flush=True)


class FirstToken(BaseStreamer):
    """A thinker streamer that notes when the first generated token came (its first `put` is
    the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


# The parts whose `generate` gets a static cache, tried in turn until one runs: "static" is
# transformers' best setting where it works (the talker's forward rejected it in 5.24: its
# attention mask arrives as a dict), then the thinker alone.
CACHE_TRIES: dict[str, list[tuple[str, ...]]] = {
    "static": [("thinker", "talker"), ("thinker",), ()],
    "dynamic": [()],
}


def reference_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model on `device`, each part's `generate` with its default cache."""
    return load_model_on(model_dir, device, dtype)


def use_static_cache(model: Any, parts: tuple[str, ...]) -> str:
    """A static cache for `parts` (transformers then compiles their decode step on CUDA), the
    default cache for the others; the setting's name."""
    for part in ("thinker", "talker"):
        model.get_submodule(part).generation_config.cache_implementation = "static" if part in parts else None
    return f"static: {'+'.join(parts)}" if parts else "dynamic"


def transformers_side(
    model: Any, ids: torch.Tensor, concurrency: int, tokens: int, codes: int, rounds: int
) -> dict[str, float]:
    """One-shot generate of `concurrency` rows as one batch: ms to the first text token and to
    the (whole) waveform per request, and the real-time factor."""
    ids = ids.repeat(concurrency, 1).to(model.device)
    firsts, latencies, audio_s, wall = [], [], 0.0, 0.0
    seed, done, misses = 0, 0, 0
    while done <= rounds:  # the first round warms up
        seed += 1
        torch.manual_seed(seed)
        streamer = FirstToken()
        synced(model.device)
        started = time.perf_counter()
        try:
            _, waves = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_mode="audio",
                thinker_max_new_tokens=tokens,
                thinker_streamer=streamer,
                talker_max_new_tokens=codes,
            )
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # a random talker's reply without codes: transformers cannot vocode it
            misses += 1
            if misses > MAX_REDRAWS:  # not that: a failure every seed meets
                raise
            continue
        synced(model.device)
        seconds = time.perf_counter() - started
        if done:
            waves = [waves] if concurrency == 1 else waves
            firsts += [((streamer.at or started) - started) * 1e3] * concurrency
            latencies += [seconds * 1e3] * concurrency
            audio_s += sum(len(w) for w in waves) / SAMPLE_RATE
            wall += seconds
        done += 1
    return {
        "first_text_ms": statistics.median(firsts),
        "first_audio_ms": statistics.median(latencies),
        "done_ms": statistics.median(latencies),
        "rtf": wall / audio_s,
    }


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def our_side(
    address: str,
    prompt: str,
    concurrency: int,
    tokens: int,
    codes: int,
    rounds: int,
    feed_tokens: int,
    settle: Callable[[], float],
) -> dict[str, float | None]:
    """Streamed replies through the cluster: ms to the first text, to the first AudioChunk and
    to the end. A warm-up round first, then `settle` (what the warm-up set off: the graphs of a
    sampling setting met for the first time, recorded while idle) before the timed rounds."""
    options = {"max_new_tokens": tokens, "talker_max_new_tokens": codes, "feed_tokens": feed_tokens}
    firsts, texts, dones, audio_s, wall, settled_s = [], [], [], 0.0, 0.0, 0.0

    async def reply(client: AsyncClient, seed: int) -> tuple[float, float, float, float | None]:
        started = time.perf_counter()
        first, text, samples = None, None, 0
        async for piece in client.chat(prompt, seed=seed, options=options):
            if isinstance(piece, SpeechChunk):
                first = first or time.perf_counter() - started
                samples += len(piece.samples)
            elif isinstance(piece, TextDelta):
                text = text or time.perf_counter() - started
        done = time.perf_counter() - started
        # No text: the real-size fixture's 384-entry tokenizer decodes its random ids to nothing.
        return (first or done) * 1e3, done * 1e3, samples / SAMPLE_RATE, None if text is None else text * 1e3

    async with AsyncClient(address) as client:
        for round_ in range(rounds + 1):
            started = time.perf_counter()
            results = await asyncio.gather(*(reply(client, round_ * 100 + i) for i in range(concurrency)))
            if not round_:
                settled_s = settle()
            else:
                wall += time.perf_counter() - started
                firsts += [r[0] for r in results]
                dones += [r[1] for r in results]
                audio_s += sum(r[2] for r in results)
                texts += [r[3] for r in results if r[3] is not None]
    return {
        "first_text_ms": statistics.median(texts) if texts else None,
        "first_audio_ms": statistics.median(firsts),
        "done_ms": statistics.median(dones),
        "rtf": wall / audio_s,
        "idle_work_after_warm_up_s": settled_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--codes", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", help="default: 1 8 (cpu), 1 8 32 (cuda)")
    parser.add_argument("--feed-tokens", type=int, nargs="+", default=[8])
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' side")
    parser.add_argument("--reference-only", action="store_true", help="transformers' side alone")
    parser.add_argument("--device", default="cpu", help="cuda: the real-size run (a --model is needed)")
    parser.add_argument("--logs", type=Path, default=None, help="keep the services' logs here")
    parser.add_argument(
        "--ar-decode",
        default="auto",
        help="the ar-encoder's --ar-decode (auto: the thinker and the talker graphed on a GPU)",
    )
    parser.add_argument("--dtype", help="default: float32 (cpu), bfloat16 (cuda)")
    parser.add_argument(
        "--float32-matmul-precision",
        default="auto",
        choices=("auto", "highest", "high"),
        help="the stages' --float32-matmul-precision (high: token2wav in TF32; auto: high on CUDA)",
    )
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("none", "bf16"),
        help="dit-denoise's --quantization (bf16: token2wav's DiT in bfloat16)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="a prompt of this many tokens (chat template included)"
    )
    parser.add_argument(
        "--reference-cache",
        nargs="+",
        choices=("static", "dynamic"),
        help="transformers' KV cache, each timed in turn (static: its decode compiled on CUDA; one "
        "that fails is reported, then dynamic); default: dynamic (cpu), static (cuda)",
    )
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and (args.model is None or not torch.cuda.is_available()):
        raise SystemExit(
            "--device cuda needs a CUDA device and --model (omnistage fixture --family qwen2.5-omni)"
        )
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.concurrency = args.concurrency or ([1, 8, 32] if cuda else [1, 8])
    args.reference_cache = args.reference_cache or (["static"] if cuda else ["dynamic"])
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_tiny_fixture(Path(scratch) / "qwen-omni-tiny")
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompt = prompt_of(tokenizer, args.prompt_tokens)
        ids = chat_input_ids(tokenizer, prompt)
        emit(
            device=device_name(args.device),
            dtype=args.dtype,
            float32_matmul_precision=args.float32_matmul_precision,
            quantization=args.quantization,
            prompt_tokens=ids.shape[1],
        )
        found: dict[tuple[str, int], dict[str, float]] = {}
        if not args.no_reference:
            found.update(reference_rows(args, model, ids))
        if not args.reference_only:
            found.update(cluster_rows(args, model, prompt, args.logs or Path(scratch)))
    if not args.no_reference and not args.reference_only:
        emit(summary="omnistage / transformers", ratios=ratios(args, found))
    if cuda and not args.reference_only:
        emit(summary="issue 34 targets", prompt_tokens=ids.shape[1], targets=targets(args, found))


def reference_rows(
    args: argparse.Namespace, model_dir: Path, ids: torch.Tensor
) -> dict[Any, dict[str, float]]:
    """transformers' side per cache setting and concurrency, the one with the lower real-time
    factor per concurrency also as ("transformers", c). A static cache that fails is reported
    and the next of CACHE_TRIES runs."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    found: dict[Any, dict[str, float]] = {}
    for cache in args.reference_cache:
        model = reference_model(model_dir, device, dtype)
        tries = list(CACHE_TRIES[cache])
        setting = use_static_cache(model, tries.pop(0))
        for c in args.concurrency:
            while True:
                try:
                    row = transformers_side(model, ids, c, args.tokens, args.codes, args.rounds)
                    break
                except Exception as err:
                    if not tries:
                        raise
                    emit(
                        side="transformers",
                        cache=setting,
                        concurrency=c,
                        failed=f"{type(err).__name__}: {err}"[:600],
                    )
                    setting = use_static_cache(model, tries.pop(0))
            found[setting, c] = row
            emit(side="transformers one-shot generate", cache=setting, concurrency=c, **_rounded(row))
            best = found.get(("transformers", c))
            if best is None or row["rtf"] < best["rtf"]:
                found["transformers", c] = row
        del model
        free(device)
    return found


def cluster_rows(
    args: argparse.Namespace, model: Path, prompt: str, scratch: Path
) -> dict[Any, dict[str, float]]:
    """Our side per concurrency and feed_tokens, as (f"ours k={k}", c)."""
    found: dict[Any, dict[str, float]] = {}
    if args.device == "cpu":
        plan, timeout_s = loopback_plan(model), 180.0
    else:  # the thinker steps up to the largest concurrency's rows together
        # The queue bound is the slots' count, whose batch buckets idle time records after start
        # (about a minute each at real size): room for the thinker's and the talker's requests
        # of the largest concurrency, and no more.
        env = {
            "OMNISTAGE_DEVICE": args.device,
            "OMNISTAGE_MAX_BATCH": str(max(args.concurrency)),
            "OMNISTAGE_MAX_QUEUE": str(2 * max(args.concurrency)),
            "OMNISTAGE_AR_DECODE": args.ar_decode,
            "OMNISTAGE_FLOAT32_MATMUL_PRECISION": args.float32_matmul_precision,
            "OMNISTAGE_QUANTIZATION": args.quantization,
        }
        plan, timeout_s = loopback_plan(model, args.dtype, env), 1200.0
        # That bound is for the thinker's and the talker's batch buckets. The other stages keep at
        # least the default: token2wav's forwards hold an utterance's windows as rows too.
        for proc in plan:
            if proc.name != "ar-encoder":
                proc.environment["OMNISTAGE_MAX_BATCH"] = str(max(MAX_BATCH, *args.concurrency))
    plan, metrics = bursts.with_metrics(plan, "ar-encoder")
    with LocalCluster(plan, log_dir=scratch, start_timeout_s=timeout_s) as cluster:
        # The thinker's and the talker's decode steps recorded at every batch bucket first.
        emit(side="omnistage streamed", idle_work_wait_s=bursts.wait_idle_work(metrics))
        for c in args.concurrency:
            for k in args.feed_tokens:
                fed = talker_feeds(metrics)
                ours = asyncio.run(
                    our_side(
                        cluster.coordinator,
                        prompt,
                        c,
                        args.tokens,
                        args.codes,
                        args.rounds,
                        k,
                        settle=lambda: bursts.wait_idle_work(metrics),
                    )
                )
                ours["feeds_per_reply"] = (talker_feeds(metrics) - fed) / (c * (args.rounds + 1))
                found[f"ours k={k}", c] = ours
                emit(side="omnistage streamed", concurrency=c, feed_tokens=k, **_rounded(ours))
    for role, medians in stage_lines(scratch).items():  # the processes have exited: logs complete
        emit(side="omnistage stage lines, medians", role=role, **medians)
    return found


# A stage's line for a finished request (omni_common/runtime/step_jobs.py, log_steps).
STEPS_LINE = re.compile(
    r"request \S+: (?P<steps>\d+) steps on (?P<role>\S+) in (?P<ms>\d+) ms: first [\d.]+ ms, "
    r"median (?P<median>[\d.]+) ms; batches [^;]*(?:; prepared (?P<prepared>\d+) ms after its call"
    r"(?:, first chunk at (?P<first_chunk>\d+) ms)?)?$"
)


def stage_lines(log_dir: Path) -> dict[str, dict[str, float]]:
    """Per role, the medians of the stages' lines for their finished requests (the warm-up
    round's included): steps, their ms, the median step, and ms from the stage's call to its
    prepare done and to its first chunk: where a reply's time to first audio goes."""
    found: dict[str, dict[str, list[float]]] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = STEPS_LINE.search(line)
            if match is None:
                continue
            row = found.setdefault(match["role"], {})
            for key in ("steps", "ms", "median", "prepared", "first_chunk"):
                if match[key] is not None:
                    row.setdefault(key, []).append(float(match[key]))
    return {role: {k: statistics.median(v) for k, v in row.items()} for role, row in found.items()}


def ratios(args: argparse.Namespace, found: dict[Any, dict[str, float]]) -> dict[str, float]:
    return {
        f"c{c} feed_tokens={k} {key}": round(found[f"ours k={k}", c][key] / found["transformers", c][key], 3)
        for c in args.concurrency
        for k in args.feed_tokens
        for key in ("first_text_ms", "first_audio_ms", "done_ms", "rtf")
        if found[f"ours k={k}", c][key] is not None  # no text where the tokenizer decodes none
    }


def targets(args: argparse.Namespace, found: dict[Any, dict[str, float]]) -> dict[str, object]:
    """Issue 34's speech targets (meant for a 64-token prompt) with this run's values, per
    feed_tokens setting."""
    bounds = {1: (300.0, 0.1), 32: (1000.0, 0.5)}
    out: dict[str, object] = {}
    for k in args.feed_tokens:
        for c, (first_ms, rtf) in bounds.items():
            row = found.get((f"ours k={k}", c))
            if row is None:
                out[f"c{c} feed_tokens={k}"] = "not measured"
                continue
            out[f"c{c} feed_tokens={k} first_audio_ms <= {first_ms:.0f}"] = {
                "value": round(row["first_audio_ms"], 1),
                "met": row["first_audio_ms"] <= first_ms,
            }
            out[f"c{c} feed_tokens={k} rtf <= {rtf}"] = {
                "value": round(row["rtf"], 3),
                "met": row["rtf"] <= rtf,
            }
    return out


def prompt_of(tokenizer: Any, tokens: int) -> str:
    """PROMPT, or (tokens > 0) a prompt whose chat-template ids are about `tokens` long (the
    first line printed gives the exact length)."""
    if tokens <= 0:
        return PROMPT
    overhead = chat_input_ids(tokenizer, "").shape[1]
    text_ids = tokenizer(" ".join([PROMPT] * tokens), add_special_tokens=False)["input_ids"]
    return str(tokenizer.decode(text_ids[: max(tokens - overhead, 1)]))


def free(device: torch.device) -> None:
    """Give the device's memory back before the next side loads (the two never share it)."""
    gc.collect()
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


def talker_feeds(url: str) -> float:
    """The Feed calls the talker has taken so far."""
    return bursts.metric_total(url, "omnistage_stage_feeds_total", 'role="talker"')


def _rounded(row: dict[str, float | None]) -> dict[str, float | None]:
    """`row` rounded for printing; a figure with no value (no text came) stays None."""
    return {k: None if v is None else round(v, 3 if k == "rtf" else 1) for k, v in row.items()}


if __name__ == "__main__":
    main()

"""Qwen2.5-Omni's token2wav role alone (no cluster): how long one RK4 interval takes, eager and
replayed as a CUDA graph, in float32 and with TF32 products, for one utterance and for several
stepped together, and how far each setting's mel is from eager float32's.

    omnistage fixture --family qwen2.5-omni /tmp/qwen-omni-full --random-weights full
    python benchmarks/token2wav_gpu.py --model /tmp/qwen-omni-full [--codes 240] [--batch 1 8] \
        [--modes eager graphs compiled graphs:tf32 compiled:tf32 graphs:bf16] [--max-open 1] [--profile 20]

Each utterance is `--codes` random codec tokens (240 = 4.8 s of audio), streamed: the windows
the stage solves as the codes arrive, all codes here at once. A mode is eager, graphs (each
interval a CUDA graph) or compiled (the same with the DiT's forward compiled: the stage's
defaults on a GPU), with `:tf32` for the stage's --float32-matmul-precision high, `:bf16` for the
DiT's weights and forwards in bfloat16 (the solver in float32). Per mode and
batch size: the median device time of a step (CUDA events around `Token2Wav.step`, as the step
scheduler logs it), the median host time inside `step` (launching it), the wall time of the
batch over the seconds of audio its utterances make (the real-time factor of token2wav alone;
the first pass, which captures the graphs, is a warm-up and not timed), and the first
utterance's mel against the first mode's (relative L2 error and the largest difference). One
JSON line each. With `--profile N`, then the N kernels that took the most device time over the
batch's steps (the profiler's CUDA activity), each per step: where an interval's time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwen_omni.token2wav import MAX_OPEN, Token2Wav, Token2WavState

SAMPLE_RATE, HOP = 24000, 240  # the vocoder's output rate and mel frames' hop
MODES = (
    "eager",
    "graphs",
    "compiled",
    "eager:tf32",
    "graphs:tf32",
    "compiled:tf32",
    "graphs:bf16",
    "compiled:bf16",
)


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def utterances(role: Token2Wav, batch: int, codes: int) -> list[Token2WavState]:
    states = []
    for seed in range(batch):
        request = GenerationRequest(
            prompt="", seed=seed, num_inference_steps=10, true_cfg_scale=0.5, options=(("stream_audio", "1"),)
        )
        tokens = torch.randint(0, role.codes_limit, (codes,), generator=torch.Generator().manual_seed(seed))
        state = role.prepare(request, StageState({"codes": tokens}))
        role.feed(state, StageState({}), True)
        states.append(state)
    return states


def solve(role: Token2Wav, batch: int, codes: int) -> tuple[dict[str, float], torch.Tensor]:
    """Every window of `batch` utterances, stepped together as the scheduler batches them; the
    timings and the first utterance's mel [mel_dim, frames]."""
    states = utterances(role, batch, codes)
    mels: list[torch.Tensor] = []
    cuda = role.device.type == "cuda"
    device_ms, host_ms = [], []
    sync(role.device)
    started = time.perf_counter()
    while not all(role.is_done(s) for s in states):
        ready = [s for s in states if not role.is_done(s) and role.ready(s)]
        key = role.batch_key(ready[0])
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        if events:
            events[0].record()
        t0 = time.perf_counter()
        role.step([s for s in ready if role.batch_key(s) == key])
        host_ms.append((time.perf_counter() - t0) * 1e3)
        if events:
            events[1].record()
        for state in states:
            chunk = role.take_partial(state)
            if chunk is not None and state is states[0]:
                mels.append(chunk.tensors["mel"].float().cpu())
        if events:
            events[1].synchronize()
        device_ms.append(events[0].elapsed_time(events[1]) if events else host_ms[-1])
    sync(role.device)
    wall_s = time.perf_counter() - started
    audio_s = batch * codes * role.repeats * HOP / SAMPLE_RATE  # every utterance's audio
    return {
        "steps": len(device_ms),
        "step_device_ms_p50": round(statistics.median(device_ms), 2),
        "step_host_ms_p50": round(statistics.median(host_ms), 2),
        "wall_ms": round(wall_s * 1e3, 1),
        "rtf": round(wall_s / audio_s, 4),
    }, torch.cat(mels, dim=1)


def kernels(role: Token2Wav, batch: int, codes: int, top: int) -> list[dict[str, object]]:
    """The `top` kernels by device time over one more solve of `batch` utterances, per step."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        timings, _ = solve(role, batch, codes)
    steps = int(timings["steps"])
    rows = [e for e in profile.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in rows)
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    out: list[dict[str, object]] = [{"kernels_ms_per_step": round(total / 1e3 / steps, 3)}]
    for e in rows[:top]:
        out.append(
            {
                "kernel": e.key[:90],
                "calls_per_step": round(e.count / steps, 1),
                "ms_per_step": round(e.device_time_total / 1e3 / steps, 3),
                "share": round(e.device_time_total / total, 3),
            }
        )
    return out


def difference(mel: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """How far `mel` is from `reference`: relative L2 error, largest absolute difference."""
    error = (mel - reference).norm() / reference.norm()
    return {"mel_rel_l2": float(f"{error:.3g}"), "mel_max_abs": float(f"{(mel - reference).abs().max():.3g}")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--codes", type=int, default=240)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cuda", help="cpu: to try the script on the tiny fixture")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=MODES, help="the first is the mels' reference"
    )
    parser.add_argument(
        "--max-open",
        type=int,
        default=MAX_OPEN,
        help="windows of one utterance solved together (1: one at a time)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="the kernels taking most time to print; 0: none"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit({"bench": "token2wav_gpu", "device": name, "codes": args.codes})
    modes = args.modes if device.type == "cuda" else ["eager"]
    references: dict[int, torch.Tensor] = {}  # batch -> the first mode's mel of utterance 0
    for mode in modes:
        execution, _, precision = mode.partition(":")
        torch.set_float32_matmul_precision("highest" if precision == "" else "high")
        graphs, compiled = execution != "eager", execution == "compiled"
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        role = Token2Wav.load(
            args.model, device, cuda_graphs=graphs, compile=compiled, max_open=args.max_open, dtype=dtype
        )
        started = time.perf_counter()
        while role.idle_work():  # what the stage does while idle: the compile, common graphs
            pass
        emit({"mode": mode, "idle_work_s": round(time.perf_counter() - started, 1)})
        for batch in args.batch:
            solve(role, batch, args.codes)  # warm-up: kernels chosen, graphs captured
            timings, mel = solve(role, batch, args.codes)
            reference = references.setdefault(batch, mel)
            emit({"mode": mode, "batch": batch, **timings, **difference(mel, reference)})
            if args.profile and device.type == "cuda":
                for row in kernels(role, batch, args.codes, args.profile):
                    emit({"mode": mode, "batch": batch, **row})
        del role
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

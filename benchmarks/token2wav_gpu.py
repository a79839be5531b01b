"""Qwen2.5-Omni's token2wav role alone (no cluster): how long one RK4 interval takes, eager and
replayed as a CUDA graph, in float32 and with TF32 products, for one utterance and for several
stepped together, and how far each setting's mel is from eager float32's.

    omnistage fixture --family qwen2.5-omni /tmp/qwen-omni-full --random-weights full
    python benchmarks/token2wav_gpu.py --model /tmp/qwen-omni-full [--codes 240] [--batch 1 8] \
        [--modes eager graphs compiled graphs:tf32 compiled:tf32]

Each utterance is `--codes` random codec tokens (240 = 4.8 s of audio), streamed: the windows
the stage solves as the codes arrive, all codes here at once. A mode is eager, graphs (each
interval a CUDA graph) or compiled (the same with the DiT's forward compiled: the stage's
defaults on a GPU), with `:tf32` for the stage's --float32-matmul-precision high. Per mode and
batch size: the median device time of a step (CUDA events around `Token2Wav.step`, as the step
scheduler logs it), the median host time inside `step` (launching it), the wall time of the
batch over the seconds of audio its utterances make (the real-time factor of token2wav alone;
the first pass, which captures the graphs, is a warm-up and not timed), and the first
utterance's mel against the first mode's (relative L2 error and the largest difference). One
JSON line each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwen_omni.token2wav import Token2Wav, Token2WavState

SAMPLE_RATE, HOP = 24000, 240  # the vocoder's output rate and mel frames' hop
MODES = ("eager", "graphs", "compiled", "graphs:tf32", "compiled:tf32")


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
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit({"bench": "token2wav_gpu", "device": name, "codes": args.codes})
    modes = args.modes if device.type == "cuda" else ["eager"]
    references: dict[int, torch.Tensor] = {}  # batch -> the first mode's mel of utterance 0
    for mode in modes:
        execution, _, matmul = mode.partition(":")
        torch.set_float32_matmul_precision("high" if matmul == "tf32" else "highest")
        graphs, compiled = execution != "eager", execution == "compiled"
        role = Token2Wav.load(args.model, device, cuda_graphs=graphs, compile=compiled)
        started = time.perf_counter()
        while role.idle_work():  # what the stage does while idle: the compile, common graphs
            pass
        emit({"mode": mode, "idle_work_s": round(time.perf_counter() - started, 1)})
        for batch in args.batch:
            solve(role, batch, args.codes)  # warm-up: kernels chosen, graphs captured
            timings, mel = solve(role, batch, args.codes)
            reference = references.setdefault(batch, mel)
            emit({"mode": mode, "batch": batch, **timings, **difference(mel, reference)})
        del role
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

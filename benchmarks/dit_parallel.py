"""Where a DiT forward's time goes once it is spread over the GPUs of one host: Qwen-Image at
real size (random bf16 weights), one process per GPU as a replica's device workers run it
(rank.py: the stage's compiled blocks, its rewrites, the Ulysses hooks of sequence_parallel.py).

For each size, every rank times the same forward three ways:
- "one GPU": the forward on its own GPU, no collective (a one-device or data-parallel request);
- "sequence parallel": spread over every rank (each holds a share of the image tokens and
  trades heads for tokens around attention with two all-to-alls a block);
- the same two replayed as CUDA graphs, the all-to-alls captured inside (NCCL in a graph);
then profiles one spread forward and sums each rank's kernels by class (NCCL, matrix products,
attention, inductor's Triton kernels, the rest) against the forward's wall time: what the
device did not cover is host time (launches, Python).

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/dit_parallel.py --model /tmp/qwen-image-full [--sizes 1024 512 2048]

One JSON line per rank and row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dit_forward import PROMPT_TOKENS
from dit_profile import kernel_class

from omni_common.models.base import DenoiserOptions
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import forward_inputs, transformer_forward
from omni_common.models.qwenimage.family import PARALLEL
from omni_common.models.weights import load_component
from omni_common.runtime.sequence_parallel import SequenceParallel

Forward = Callable[[], torch.Tensor]


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def timed_ms(forward: Forward, runs: int) -> float:
    """Median wall time of `forward`, every rank starting together."""
    samples = []
    for _ in range(runs):
        torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def graphed(forward: Forward) -> Forward:
    """`forward` captured as one CUDA graph (every rank captures together: the collectives
    inside are captured too); replaying it returns the captured output."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # a warm run on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(graph):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def device_classes(forward: Forward) -> dict[str, float]:
    """One forward's kernel time by class (ms), and its wall time."""
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) * 1e3
    classes: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.lower()
            kind = "nccl" if "nccl" in name else kernel_class(event.name)
            classes[kind] += event.device_time_total / 1e3
    busy = sum(classes.values())
    return {**{k: round(v, 2) for k, v in classes.items()}, "busy": round(busy, 2), "wall": round(wall, 2)}


def rank_main(rank: int, world: int, args: argparse.Namespace, rendezvous: str) -> None:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    started = time.perf_counter()
    directory = args.model / "transformer"
    transformer = load_component(QwenImageTransformer2DModel, directory, device, torch.bfloat16)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(args.model / "scheduler")
    denoiser = QwenImageDenoiser(transformer, scheduler, device, torch.bfloat16)
    sp = SequenceParallel(SimpleNamespace(transformer=transformer), PARALLEL, world)
    denoiser.configure(DenoiserOptions(compile=not args.eager))  # the one-GPU stage's rewrites
    emit({"rank": rank, "build_s": round(time.perf_counter() - started, 1)})
    for size in args.sizes:
        for name, forward in forwards(denoiser, sp, size).items():
            started = time.perf_counter()
            for _ in range(3):
                forward()
            torch.cuda.synchronize()
            row: dict[str, object] = {"rank": rank, "size": size, "path": name}
            row["first_s"] = round(time.perf_counter() - started, 1)
            row["ms"] = round(timed_ms(forward, args.runs), 2)
            try:
                replay = graphed(forward)
                row["graph_ms"] = round(timed_ms(replay, args.runs), 2)
            except Exception as err:  # reported: whether NCCL captures here is what this asks
                row["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            row["profile"] = device_classes(forward)
            emit(row)
    # The group's teardown hung once NCCL calls had been captured in graphs (2 H200s, torch
    # 2.11: every row printed, the run then killed by its timeout): each rank leaves at once.
    torch.cuda.synchronize()
    dist.barrier()
    os._exit(0)


def forwards(denoiser: QwenImageDenoiser, sp: SequenceParallel, size: int) -> dict[str, Forward]:
    """One request's forward at `size` x `size` on this GPU alone, and spread over every rank."""
    transformer, device = denoiser.transformer, denoiser.device
    config = transformer.config
    generator = torch.Generator(device).manual_seed(0)
    img_shapes = [[denoiser.img_shape(size, size)]]
    tokens = img_shapes[0][0][1] * img_shapes[0][0][2]
    latents = torch.randn((1, tokens, config["in_channels"]), generator=generator, device=device)
    text = (1, PROMPT_TOKENS, config["joint_attention_dim"])
    embeds = torch.randn(text, generator=generator, device=device)
    timestep = torch.full((1,), 500.0, device=device)
    plain = forward_inputs(latents.bfloat16(), timestep.bfloat16(), embeds.bfloat16(), None)
    inputs = denoiser._with_modulation(plain)

    def alone() -> torch.Tensor:
        with torch.inference_mode():
            return transformer_forward(transformer, inputs, img_shapes)

    def spread() -> torch.Tensor:
        with sp.use(sp.full), torch.inference_mode():
            return transformer_forward(transformer, inputs, img_shapes)

    return {"one GPU": alone, "sequence parallel": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the blocks")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(rank_main, args=(args.gpus, args, os.path.join(directory, "rendezvous")), nprocs=args.gpus)


if __name__ == "__main__":
    main()

"""The competitor at its best: diffusers' QwenImagePipeline in one process, its transformer
compiled each way a user would, so a benchmark takes the faster per size and prints both
(issue 35: regional compile is launch-bound at 512x512, where whole-model CUDA graphs took
855 ms against its 2209).

- eager: diffusers as it comes (not its best; a reference);
- regional: `transformer.compile_repeated_blocks(fullgraph=True)`, diffusers' documented recipe
  (no CUDA graphs: each block's kernels are launched one by one);
- whole: `torch.compile(transformer, mode="reduce-overhead", fullgraph=True)`, the whole
  transformer as CUDA graphs;
- max-autotune: the same with `mode="max-autotune"` (inductor times GEMM and kernel variants
  too: long compiles, reported as warm-up time).

The pipeline calls its transformer twice a step with CFG and reads both predictions after the
second call; a CUDA-graph replay overwrites its outputs, so the compiled modes clone them, as a
user of reduce-overhead must (a copy of the [B, tokens, 64] prediction: microseconds).

Imported by gpu_headline.py, multi_gpu.py and glm_image_gpu.py (`compile_transformer`; run from
benchmarks/ or with it on sys.path).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_common.models.qwenimage.execution import compile_blocks

MODES = ("eager", "regional", "whole", "max-autotune")
DEFAULT_MODES = ("regional", "whole")


def load(
    model: Path,
    device: torch.device,
    dtype: torch.dtype,
    mode: str,
    *,
    backend: str = "inductor",
    cluster_options: bool = False,
) -> Any:
    """A fresh pipeline with its transformer compiled `mode`'s way (`backend` other than inductor
    only to try the script on a CPU: aot_eager traces the same graphs without generating code)."""
    from omni_common.models.qwenimage.pipeline import monolithic_pipeline

    if mode not in MODES:
        raise SystemExit(f"diffusers mode {mode!r}; it is one of {', '.join(MODES)}")
    pipe: Any = monolithic_pipeline(model, device, dtype)
    if mode == "regional" and cluster_options and backend == "inductor":
        torch._dynamo.config.recompile_limit = 64
        compile_blocks(pipe.transformer)  # the inductor options of the cluster's DiT
    else:
        compile_transformer(pipe.transformer, mode, backend)
    return pipe


def compile_transformer(transformer: Any, mode: str, backend: str = "inductor") -> None:
    """Compile a diffusers transformer in place `mode`'s way (eager: leave it as it is)."""
    if mode not in MODES:
        raise SystemExit(f"diffusers mode {mode!r}; it is one of {', '.join(MODES)}")
    # Two sizes, prompts of several lengths, batches: more variants than Dynamo's default 8.
    torch._dynamo.config.recompile_limit = 64
    if mode == "regional":
        transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
    elif mode in ("whole", "max-autotune"):
        compiled = torch.compile(
            transformer.forward,
            mode="reduce-overhead" if mode == "whole" else "max-autotune",
            fullgraph=True,
            backend=backend,
        )
        transformer.forward = _cloning(compiled)


def add_args(parser: argparse.ArgumentParser) -> None:
    """--diffusers-modes and --diffusers-backend, as both benchmarks take them."""
    parser.add_argument(
        "--diffusers-modes",
        nargs="*",
        choices=MODES,
        default=list(DEFAULT_MODES),
        help="how diffusers' transformer is compiled, each timed in turn (none: skip diffusers); "
        "the faster counts at each size (add max-autotune for inductor's autotuning: long compiles)",
    )
    parser.add_argument(
        "--diffusers-backend",
        default="inductor",
        help="torch.compile backend of diffusers' side; aot_eager only to try the script on a CPU",
    )


def _cloning(forward: Callable[..., Any]) -> Callable[..., Any]:
    def cloned(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out

    return cloned


def release() -> None:
    """Free compiled code, CUDA graphs and cached device memory of pipelines no longer referenced
    (the caller drops its own reference first: `del pipe`, then this, before the next mode loads;
    a pipeline still named by the caller stays, as one did beside the next mode's on an H100
    and ran it out of memory)."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def best(rows: dict[str, float]) -> tuple[str, float]:
    """The fastest (mode, ms) of {mode: p50 ms}."""
    mode = min(rows, key=lambda name: rows[name])
    return mode, rows[mode]

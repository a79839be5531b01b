"""One DiT forward of Qwen-Image at real size (random bf16 weights) by execution option:
eager diffusers as the pipeline runs it, attention backends, CUDA graphs, torch.compile.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/dit_forward.py --model /tmp/qwen-image-full [--shapes 512:1 512:8 1024:1]

The reference is the first row of each shape: diffusers' own call, eager, default attention
(PyTorch SDPA, which takes flash attention for an unmasked prompt). Every other row is the
same forward with one option changed, on the same inputs, and says its speed-up over the
reference and its largest difference from the reference's output. Prints one JSON line
per (shape, option), then the fastest option per shape. The dit-denoise stage's defaults
(--cuda-graphs, --attention-backend, --compile) follow from these numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.graphs import TEXT_BUCKETS, GraphedTransformer, bucket, padded_inputs

PROMPT_TOKENS = 20  # a short prompt once the template's prefix is dropped


def timed_ms(fn: Callable[[], torch.Tensor], runs: int, warmup: int = 3) -> tuple[float, torch.Tensor]:
    """Median wall time of `fn` in ms (the GPU synchronised around each run) and its output."""
    for _ in range(warmup):
        out = fn()
    samples = []
    for _ in range(runs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples), out


class Shape:
    """One measured shape: its inputs, plain and padded to the graphs' bucket, and the
    reference (eager, default attention) once measured."""

    def __init__(self, denoiser: QwenImageDenoiser, size: int, batch: int, seed: int = 0) -> None:
        config = denoiser.transformer.config
        device, dtype = denoiser.device, denoiser.dtype
        generator = torch.Generator(device).manual_seed(seed)
        self.size, self.batch = size, batch
        img_shape = denoiser.img_shape(size, size)
        self.img_shapes = [[img_shape]] * batch
        tokens = img_shape[1] * img_shape[2]
        self.latents = torch.randn(
            (batch, tokens, config["in_channels"]), generator=generator, device=device, dtype=dtype
        )
        self.timestep = torch.full((batch,), 500.0, device=device, dtype=dtype)
        self.embeds = torch.randn(
            (batch, PROMPT_TOKENS, config["joint_attention_dim"]),
            generator=generator,
            device=device,
            dtype=dtype,
        )
        self.plain = {"latents": self.latents, "timestep": self.timestep, "embeds": self.embeds}
        text = bucket(PROMPT_TOKENS, TEXT_BUCKETS)
        assert text is not None
        self.padded = padded_inputs(self.latents, self.timestep, self.embeds, None, batch, text)
        self.reference_ms = 0.0
        self.reference: torch.Tensor | None = None

    def row(self, option: str, fn: Callable[[], torch.Tensor], runs: int) -> dict[str, object]:
        """Measure `fn`; the first option measured is the reference."""
        row: dict[str, object] = {"size": self.size, "batch": self.batch, "option": option}
        try:
            ms, out = timed_ms(fn, runs)
        except Exception as err:  # an option this GPU or build cannot run is reported, not fatal
            return {**row, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        if self.reference is None:
            self.reference_ms, self.reference = ms, out
        diff = float((out.float() - self.reference.float()).abs().max())
        return {**row, "ms": round(ms, 2), "speedup": round(self.reference_ms / ms, 3), "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument(
        "--shapes", nargs="+", default=["512:1", "512:4", "512:8", "1024:1"], help="SIZE:BATCH"
    )
    parser.add_argument(
        "--backends",
        nargs="*",
        default=["_native_cudnn", "_native_efficient", "_native_flash"],
        help="attention backends to compare with the default (none: skip)",
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dit_forward.py measures a GPU forward: it needs a CUDA device")
    device = torch.device("cuda:0")
    denoiser = QwenImageDenoiser.load(args.model, device, torch.bfloat16)
    transformer = denoiser.transformer
    shapes = [Shape(denoiser, *(int(part) for part in spec.split(":"))) for spec in args.shapes]
    rows: list[dict[str, object]] = []

    def emit(row: dict[str, object]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    def eager(inputs: dict[str, torch.Tensor], shape: Shape) -> torch.Tensor:
        with torch.inference_mode():
            return transformer_forward(transformer, inputs, shape.img_shapes)

    def staged(shape: Shape) -> torch.Tensor:  # what the dit-denoise stage calls
        with torch.inference_mode():
            return denoiser._forward(shape.latents, shape.timestep, shape.embeds, None, shape.img_shapes)

    for shape in shapes:
        options: list[tuple[str, str, Callable[[], torch.Tensor]]] = [
            ("eager", "", lambda shape=shape: eager(shape.plain, shape)),
            ("eager, prompt padded + masked", "", lambda shape=shape: eager(shape.padded, shape)),
        ]
        for backend in args.backends:
            options.append((f"eager, {backend}", backend, lambda shape=shape: eager(shape.plain, shape)))
            if backend != "_native_flash":  # flash attention takes no mask
                options.append(
                    (
                        f"eager, {backend}, padded + masked",
                        backend,
                        lambda shape=shape: eager(shape.padded, shape),
                    )
                )
        options.append(("cuda graphs", "", lambda shape=shape: staged(shape)))
        if "_native_cudnn" in args.backends:
            options.append(("cuda graphs, _native_cudnn", "_native_cudnn", lambda shape=shape: staged(shape)))
        for name, backend, fn in options:
            transformer.set_attention_backend(backend or "native")
            graphs = name.startswith("cuda graphs")
            denoiser.graphed = (
                GraphedTransformer(transformer, transformer_forward, device) if graphs else None
            )
            row = shape.row(name, fn, args.runs)
            emit({**row, "graph_kept": len(denoiser.graphed.cache) > 0} if denoiser.graphed else row)
        denoiser.graphed = None
        transformer.set_attention_backend("native")
        torch.cuda.empty_cache()

    if not args.no_compile:
        transformer.compile_repeated_blocks(fullgraph=True)
        for shape in shapes:
            started = time.perf_counter()
            row = shape.row("torch.compile", lambda shape=shape: eager(shape.plain, shape), args.runs)
            emit({**row, "with_compile_s": round(time.perf_counter() - started, 1)})
            # What the stage runs by default on a GPU; the cache keeps a graph only if it wins.
            denoiser.graphed = GraphedTransformer(transformer, transformer_forward, device)
            row = shape.row("torch.compile + cuda graphs", lambda shape=shape: staged(shape), args.runs)
            emit({**row, "graph_kept": len(denoiser.graphed.cache) > 0})
            denoiser.graphed = None

    fastest: dict[str, dict[str, object]] = {}
    for row in rows:
        key = f"{row['size']}:{row['batch']}"
        if "ms" in row and (key not in fastest or row["ms"] < fastest[key]["ms"]):  # type: ignore[operator]
            fastest[key] = {"option": row["option"], "ms": row["ms"], "speedup": row["speedup"]}
    print(json.dumps({"device": torch.cuda.get_device_name(device), "fastest": fastest}), flush=True)


if __name__ == "__main__":
    main()

"""Where a DiT forward's device time goes: Qwen-Image at real size (random bf16 weights), one
forward per shape and execution path, its CUDA kernels summed by class (matrix multiplies,
attention, inductor's fused Triton kernels, the rest), and the largest kernels by name.

    omnistage fixture /tmp/qwen-image-full --random-weights full
    python benchmarks/dit_profile.py --model /tmp/qwen-image-full [--shapes 1024:1 512:1 512:8]

Paths, on the same inputs:
- "stage, real shapes": the dit-denoise stage's forward without a graph (compiled repeated
  blocks, dynamic prompt length and batch, no mask);
- "stage, padded + mask": what a CUDA graph bucket runs (prompt padded to 32 tokens, masked);
- "static compile": the same blocks compiled for each shape alone, as a diffusers user's
  `compile_repeated_blocks(fullgraph=True)` does for one shape.
Also times the parts: building the weights, the modulation layers of one step (120 matrix-vector
products over 6.8 B parameters that depend on the timestep only), and joint attention by kernel
(SDPA's backends, and flex_attention compiled).
Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from dit_forward import Shape, timed_ms
from torch.profiler import ProfilerActivity, profile

from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.weights import load_component

ATTENTION = ("flash", "fmha", "attention", "sdpa", "attn")
MATMUL = ("gemm", "gemv", "xmma", "nvjet", "cutlass", "matmul", "splitk")


def kernel_class(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ATTENTION):
        return "attention"
    if any(word in lowered for word in MATMUL):
        return "matmul"
    if lowered.startswith("triton"):
        return "triton"
    return "other"


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


def profiled(fn: Callable[[], torch.Tensor]) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Device ms of one call of `fn` by kernel class, and the 8 largest kernels."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    classes: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        device_us = float(getattr(event, "self_device_time_total", 0.0))
        if device_us <= 0:
            continue
        classes[kernel_class(event.key)] += device_us / 1e3
        kernels.append((event.key[:90], round(device_us / 1e3, 2), int(event.count)))
    kernels.sort(key=lambda k: -k[1])
    return {k: round(v, 2) for k, v in classes.items()}, kernels[:8]


def modulation_ms(transformer: QwenImageTransformer2DModel, batch: int) -> float:
    """One step's modulation layers (img_mod and txt_mod of every block) on `batch` rows."""
    dim = transformer.config["num_attention_heads"] * transformer.config["attention_head_dim"]
    temb = torch.randn((batch, dim), device="cuda", dtype=torch.bfloat16)
    layers = [m for block in transformer.transformer_blocks for m in (block.img_mod, block.txt_mod)]

    def run() -> torch.Tensor:
        for layer in layers:
            out = layer(temb)
        return out

    with torch.inference_mode():
        return timed_ms(run, 10)[0]


def attention_rows(size: int, batch: int, heads: int, head_dim: int) -> None:
    """Joint attention of one block: SDPA by backend, unmasked and with a padded prompt."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens = (size // 16) ** 2 + 32
    q, k, v = (
        torch.randn((batch, heads, tokens, head_dim), device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    mask = torch.ones((batch, 1, 1, tokens), device="cuda", dtype=torch.bool)
    mask[..., 20:32] = False
    flops = 4 * batch * heads * tokens * tokens * head_dim
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for masked in (False, True):
        for name, backend in backends.items():
            if masked and name == "flash":
                continue

            def run(backend: SDPBackend | None = backend, masked: bool = masked) -> torch.Tensor:
                attn_mask = mask if masked else None
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

            row: dict[str, object] = {"attention": name, "masked": masked, "size": size, "batch": batch}
            attention_row(row, run, flops)
    # Inductor's own attention kernel (Triton), unmasked: the one other kernel the image has.
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    row = {"attention": "flex, compiled", "masked": False, "size": size, "batch": batch}
    attention_row(row, lambda: flex(q, k, v), flops)


def attention_row(row: dict[str, object], run: Callable[[], torch.Tensor], flops: int) -> None:
    try:
        ms = timed_ms(run, 20)[0]
        emit({**row, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
    except RuntimeError as err:
        emit({**row, "error": str(err)[:200]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["1024:1", "512:1", "512:8"], help="SIZE:BATCH")
    parser.add_argument("--no-static", action="store_true", help="skip the static compile rows")
    args = parser.parse_args()
    device = torch.device("cuda:0")
    torch.cuda.init()

    started = time.perf_counter()
    with torch.device("meta"):
        QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(args.model / "transformer")
        )
    meta_s = time.perf_counter() - started
    started = time.perf_counter()
    transformer = load_component(
        QwenImageTransformer2DModel, args.model / "transformer", device, torch.bfloat16
    )
    torch.cuda.synchronize()
    emit({"build_weights_s": round(time.perf_counter() - started, 2), "build_on_meta_s": round(meta_s, 2)})

    config = transformer.config
    for batch in (1, 8):
        emit({"modulation_ms": round(modulation_ms(transformer, batch), 2), "batch": batch})
    for spec in args.shapes:
        size, batch = (int(p) for p in spec.split(":"))
        attention_rows(size, batch, config["num_attention_heads"], config["attention_head_dim"])

    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(args.model / "scheduler")
    denoiser = QwenImageDenoiser(transformer, scheduler, device, torch.bfloat16)
    shapes = [Shape(denoiser, *(int(p) for p in spec.split(":"))) for spec in args.shapes]

    def forward(inputs: dict[str, torch.Tensor], shape: Shape) -> torch.Tensor:
        with torch.inference_mode():
            return transformer_forward(transformer, inputs, shape.img_shapes)

    def rows(path: str) -> None:
        for shape in shapes:
            for variant, inputs in (("real shapes", shape.plain), ("padded + mask", shape.padded)):
                if path == "static compile" and variant != "real shapes":
                    continue
                started = time.perf_counter()
                ms = timed_ms(lambda inputs=inputs, shape=shape: forward(inputs, shape), 5)[0]
                first_s = time.perf_counter() - started
                classes, top = profiled(lambda inputs=inputs, shape=shape: forward(inputs, shape))
                emit(
                    {
                        "path": f"{path}, {variant}",
                        "size": shape.size,
                        "batch": shape.batch,
                        "ms": round(ms, 2),
                        "first_s": round(first_s, 1),
                        "device_ms": classes,
                        "top": top,
                    }
                )

    torch._dynamo.config.recompile_limit = 64
    transformer.compile_repeated_blocks(fullgraph=True)
    # As the stage's warm-up does: two prompt lengths and two batches make them dynamic.
    for shape in shapes:
        for length in (17, 23):
            embeds = shape.embeds[:, :length]
            forward({**shape.plain, "embeds": embeds}, shape)
    rows("stage")

    if not args.no_static:
        torch._dynamo.reset()
        transformer.compile_repeated_blocks(fullgraph=True, dynamic=False)
        rows("static compile")


if __name__ == "__main__":
    main()

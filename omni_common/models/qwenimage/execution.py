"""How the Qwen-Image DiT runs on its device, apart from the step maths (denoise.py): the
attention backend, torch.compile of its blocks, CUDA graphs (captured ahead, at the warm-up,
and while idle), and the transformer call itself, eager or replayed. `TransformerExecution`
is the half of QwenImageDenoiser that holds them; `configure` sets them up."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from omni_common.errors import InvalidArgument
from omni_common.execution.compile_cache import compile_cache_is_warm
from omni_common.execution.cuda_graphs import Inputs
from omni_common.models.base import DenoiserOptions
from omni_common.models.lora import LoraLayers
from omni_common.models.qwenimage.epilogue import fuse_gelu_epilogue
from omni_common.models.qwenimage.fp8 import quantize_blocks
from omni_common.models.qwenimage.graphs import GraphedTransformer, ImgShapes
from omni_common.models.qwenimage.modulation import ModulationCache
from omni_common.models.qwenimage.rotary import use_real_rotary
from omni_common.models.qwenimage.warmup import IDLE_CAPTURE_TOKENS, WarmUp, warm_up

# Inductor's options for the compiled blocks. multi_kernel: each reduction is generated both
# persistent and looped, and the faster one, timed at its first run (the warm-up's, never a
# graph capture's), is kept. Inductor's own choice loops twice over the inputs of the blocks'
# LayerNorm over 3072 channels and of the q/k RMSNorm: with the pick, 6 real-width blocks on an
# H200 spent 2.82 ms in memory-bound kernels for 8 requests at 512x512 against 3.57 ms (1.26
# against 1.44 at 1024x1024, 0.38 against 0.47 at 512x512), and compiled as fast
# (docs/benchmarks.md). Coordinate-descent tuning saved about as much and tripled the compile
# time.
INDUCTOR_OPTIONS = {"triton.multi_kernel": 1}


def compile_blocks(transformer: QwenImageTransformer2DModel) -> None:
    """torch.compile each of the transformer's blocks, with INDUCTOR_OPTIONS."""
    # Each process times its multi-kernel picks once, at their first run: PyTorch 2.11's file
    # cache of them keys a kernel by a Triton attribute that kernels loaded from the compile
    # cache lack (a warm start failed on an H200).
    os.environ.setdefault("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "1")
    transformer.compile_repeated_blocks(fullgraph=True, options=INDUCTOR_OPTIONS)


@dataclass(frozen=True)
class BatchInputs:
    """One batched forward's inputs (CFG doubles the rows) and each state's timestep."""

    latents: torch.Tensor
    timestep: torch.Tensor
    embeds: torch.Tensor
    mask: torch.Tensor | None
    img_shapes: ImgShapes
    ts: list[torch.Tensor]
    modulation: torch.Tensor | None = None  # packed modulation rows, when the denoiser keeps them


class TransformerExecution:
    """How the denoiser's transformer runs: `configure` sets the backend, compiles, captures
    ahead; `_forward` runs one forward (a graph replayed where one fits); a sleep, a weight push
    and idle time reach what they hold here. The denoiser sets the attributes."""

    transformer: QwenImageTransformer2DModel
    device: torch.device
    dtype: torch.dtype
    vae_scale_factor: int
    loras: LoraLayers
    lora_grouped: bool
    devices: int  # devices one forward is spread over (DenoiserOptions.devices)
    # Set by a replica over several devices around the forwards it spreads over them (sequence
    # or CFG parallel, SpreadsForwards): the group the next forward spreads over.
    spread: Callable[[], Hashable] | None
    graphed: GraphedTransformer | None
    compiled: bool
    modulation: ModulationCache | None
    warm_up: WarmUp | None  # what configure() compiled ahead, and what is left
    _warm_up: Callable[..., WarmUp] | None  # warm_up() with this configuration's shapes

    def configure(self, options: DenoiserOptions) -> None:
        """Attention backend, compilation and CUDA graphs, compiled and captured ahead for the
        sizes asked (warmup.py)."""
        self.loras.max_bytes = options.lora_bytes
        self.loras.directory = Path(options.lora_dir) if options.lora_dir else None
        if options.lora_batching not in ("mixed", "grouped"):
            raise InvalidArgument(f"LoRA batching is {options.lora_batching!r}; it is mixed or grouped")
        self.lora_grouped = options.lora_batching == "grouped"
        self.devices = options.devices
        if options.attention_backend:
            self.transformer.set_attention_backend(options.attention_backend)
        if options.quantization != "none":  # before compiling: the compiled blocks take the FP8 layers
            quantize_blocks(self.transformer, self.device, options.quantization)
        if options.compile:
            # The rewrites of the forward that compiling pays for (same math, other rounding:
            # the CPU's eager path stays diffusers' bit for bit). A spread forward takes them
            # too: they act per token or per request row, never across the image tokens.
            use_real_rotary()  # complex products would stay eager kernels inside compiled blocks
            fuse_gelu_epilogue(self.transformer)  # the feed-forward's GELU in its GEMM's epilogue
            self.modulation = ModulationCache(self.transformer)
        if options.compile:
            # Each graph bucket and real-shape variant compiles once (warmup.py); the default
            # limit of 8 would leave later ones eager, silently.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # Automatic dynamic shapes, not dynamic=True: the 9 variants this compiles for two
            # sizes each load from a warm cache in 1-3 s, where dynamic=True's 4 took ~8 s each
            # (an H200, PyTorch 2.11), with the same kernel times.
            compile_blocks(self.transformer)
            self.compiled = True
        if options.cuda_graphs:
            if self.device.type != "cuda":
                raise InvalidArgument(f"CUDA graphs need a CUDA device; this denoiser runs on {self.device}")
            self.graphed = GraphedTransformer(
                self.transformer,
                transformer_forward,
                self.device,
                modulation_width=self.modulation.width if self.modulation is not None else None,
            )
        if options.compile or options.cuda_graphs:
            config = self.transformer.config
            self._warm_up = functools.partial(
                warm_up,
                lambda inputs, img_shapes: transformer_forward(
                    self.transformer, self._with_modulation(inputs), img_shapes
                ),
                img_shapes=[self.img_shape(width, height) for width, height in options.capture_sizes],
                max_batch=options.max_batch,
                channels=config["in_channels"],
                text_dim=config["joint_attention_dim"],
                dtype=self.dtype,
                device=self.device,
            )
            defer = options.defer_warm_up and options.compile and compile_cache_is_warm()
            self.warm_up = self._warm_up(graphed=self.graphed, defer=defer)
        if self.graphed is not None:
            sizes = [self.img_shape(width, height) for width, height in options.capture_sizes]
            self.graphed.plan_idle_captures(sizes, IDLE_CAPTURE_TOKENS, self.dtype)

    def rehearse(self, spreads: Callable[[int, int], bool]) -> None:
        """The warm-up's forwards that `spreads(rows, image tokens)` again, without graphs: a
        replica over several devices runs them spread (SpreadsForwards), so the compiler meets
        those shapes before a request."""
        if self._warm_up is not None:
            self._warm_up(graphed=None, defer=False, only=lambda rows, shape: spreads(rows, math.prod(shape)))

    def _with_modulation(self, inputs: Inputs) -> Inputs:
        """Warm-up inputs with packed modulation rows (zeros) when the forward takes them."""
        if self.modulation is None:
            return inputs
        rows = inputs["latents"].shape[0]
        zeros = torch.zeros((rows, self.modulation.width), dtype=self.dtype, device=self.device)
        return {**inputs, "modulation": zeros}

    def weights_changed(self) -> None:
        """The weights' values changed in place (LoadWeights): drop what was computed from them."""
        if self.modulation is not None:
            self.modulation.clear()

    def img_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(frames, patch rows, patch columns) of an image of `width` x `height` pixels."""
        return (1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2)

    @contextlib.contextmanager
    def _eager_with_adapters(self) -> Iterator[None]:
        """A step with adapters runs the transformer eagerly: CUDA graphs and compiled blocks
        were made without the adapters' hooks (a graph would replay without them)."""
        if self.loras.active and self.compiled:
            with torch.compiler.set_stance("force_eager"):
                yield
        else:
            yield

    def _forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        img_shapes: ImgShapes,
        modulation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeds = embeds.to(self.dtype)
        if self.loras.active:
            modulation = None  # adapters may change the modulation layers: computed in the forward
        if self.graphed is not None and not self.loras.active:
            group = self.spread() if self.spread is not None else None
            replayed = self.graphed(
                latents, timestep, embeds, mask, img_shapes, modulation, spread=group or None
            )
            if replayed is not None:
                return replayed
        return transformer_forward(
            self.transformer, forward_inputs(latents, timestep, embeds, mask, modulation), img_shapes
        )

    def _forward_batch(self, batch: BatchInputs) -> torch.Tensor:
        return self._forward(
            batch.latents, batch.timestep, batch.embeds, batch.mask, batch.img_shapes, batch.modulation
        )

    def idle_work(self) -> bool:
        """While no request is here: load the next forward of a deferred warm-up (a warm
        start's), else capture one more graph of a common prompt length
        (GraphedTransformer.capture_idle); False when there is nothing left to do (or it
        cannot be done now: adapters active, or the weights asleep off the device)."""
        if self.loras.active or next(self.transformer.parameters()).device != self.device:
            return False
        if self.warm_up is not None and self.warm_up.run_next():
            return True
        if self.graphed is None:
            return False
        with torch.inference_mode():
            return self.graphed.capture_idle()

    def idle_work_left(self) -> int:
        warm_up_left = 0 if self.warm_up is None else self.warm_up.left
        return warm_up_left + (0 if self.graphed is None else self.graphed.idle_captures_left)

    def forget_cuda_graphs(self) -> None:
        if self.graphed is not None:
            self.graphed.clear()
        if self.modulation is not None:  # device memory a sleep gives back too; rebuilt on use
            self.modulation.clear()


def forward_inputs(
    latents: torch.Tensor,
    timestep: torch.Tensor,
    embeds: torch.Tensor,
    mask: torch.Tensor | None,
    modulation: torch.Tensor | None = None,
) -> Inputs:
    """transformer_forward's named inputs; no "mask" for an unpadded prompt, no
    "modulation" where the forward computes it from the timestep."""
    inputs = {"latents": latents, "timestep": timestep, "embeds": embeds}
    if mask is not None:
        inputs["mask"] = mask
    if modulation is not None:
        inputs["modulation"] = modulation
    return inputs


def transformer_forward(
    transformer: QwenImageTransformer2DModel, inputs: Inputs, img_shapes: ImgShapes
) -> torch.Tensor:
    """The transformer call of QwenImagePipeline's loop; the timestep is scaled to [0, 1]
    here, as the pipeline does, and "mask" may be absent (no padded prompt). With packed
    modulation rows ("modulation", modulation.py) the transformer takes those in its place."""
    return transformer(
        hidden_states=inputs["latents"],
        timestep=inputs["modulation"] if "modulation" in inputs else inputs["timestep"] / 1000,
        guidance=None,
        encoder_hidden_states_mask=inputs.get("mask"),
        encoder_hidden_states=inputs["embeds"],
        img_shapes=img_shapes,
        attention_kwargs={},
        return_dict=False,
    )[0]

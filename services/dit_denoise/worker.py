"""dit-denoise worker: the step-wise roles of a family's DiT (denoising, continuously batched
between steps) and its one-shot roles (e.g. GLM-Image's condition KV), with the DiT's
execution flags (CUDA graphs, torch.compile, attention backend).

Requests join and leave the running batch between any two steps (StepScheduler), so a
cancelled or expired request stops at the next step boundary.
"""

from __future__ import annotations

from dataclasses import replace

from omni_common.errors import Unimplemented
from omni_common.models.base import DenoiserOptions, StageContext
from omni_common.runtime.worker import Worker


class DenoiseWorker(Worker):
    def stage_context(self) -> StageContext:
        return replace(super().stage_context(), denoiser=self.denoiser_options())

    def denoiser_options(self) -> DenoiserOptions:
        """The execution flags. `auto` turns CUDA graphs (where the family's DiT replays them) and
        torch.compile on for a CUDA device (measured on Qwen-Image at 512x512: a forward 1.7x
        faster replayed, 1.3x compiled; docs/benchmarks.md), except under layerwise offload,
        whose per-block copies neither a graph nor a compiled block may bake in."""
        config, card = self.config, self.family.card
        try:
            card.check_quantization(self.family.name, config.quantization)
        except Unimplemented as err:
            raise SystemExit(f"{self.stage}: {err.message}") from None
        if config.cuda_graphs == "on" and not card.dit_cuda_graphs:
            name = self.family.name
            raise SystemExit(f"{self.stage}: {name}'s DiT replays no CUDA graphs; drop --cuda-graphs on")
        return DenoiserOptions(
            cuda_graphs=card.dit_cuda_graphs and self.execution_flag("--cuda-graphs", config.cuda_graphs),
            capture_sizes=config.capture_sizes,
            max_batch=config.max_batch,
            attention_backend=config.attention_backend,
            compile=self.execution_flag("--compile", config.compile),
            lora_bytes=config.lora_bytes,
            lora_dir=config.lora_dir,
            lora_batching=config.lora_batching,
            defer_warm_up=True,  # this replica's StepScheduler runs the idle work
            quantization=config.quantization,
        )

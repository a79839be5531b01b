"""dit-denoise worker: embeddings -> latents, with continuous step-level batching.

Requests join and leave the running batch between any two steps (StepScheduler), so a
cancelled or expired request stops at the next step boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Progress, StageCall, Worker
from services.dit_denoise.scheduler import StepScheduler


class DenoiseWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_denoiser(config.model_dir, self.device, self.dtype)
        self.manage_memory(
            self.runner, reload=lambda: self.family.load_denoiser(config.model_dir, self.device, self.dtype)
        )
        self.scheduler = StepScheduler(
            self.runner,
            self.compute,
            max_batch=config.max_batch,
            max_tokens=config.max_tokens,
            max_queue=config.max_queue,
        )

    def load(self) -> int:
        """Remaining denoise steps times image tokens, over every request here."""
        return self.scheduler.queued_work()

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        if "prompt_embeds" not in call.inputs.tensors:
            raise InvalidArgument("dit-denoise needs a 'prompt_embeds' input tensor")
        async for event in self.scheduler.run(call):
            yield event

    def close(self) -> None:
        self.scheduler.close()
        super().close()

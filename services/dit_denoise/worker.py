"""dit-denoise worker: embeddings -> latents, one step at a time.

Steps run one by one on the compute thread, so a cancelled request stops at the next
step boundary and progress is reported per step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Worker
from omnistage.v1 import stage_pb2


class DenoiseWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_denoiser(config.model_dir, self.device, self.dtype)

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def run(
        self, request: GenerationRequest, inputs: StageState, progress_every: int, outputs: frozenset[str]
    ) -> AsyncIterator[stage_pb2.StepProgress | StageState]:
        if "prompt_embeds" not in inputs.tensors:
            raise InvalidArgument("dit-denoise needs a 'prompt_embeds' input tensor")
        state = await self.compute(self.runner.prepare, request, inputs)
        every = max(progress_every, 1)
        while not self.runner.is_done(state):
            started = time.perf_counter()
            await self.compute(self.runner.step, [state])
            done = state.step_index
            if done % every == 0 or done == state.total_steps:
                yield stage_pb2.StepProgress(
                    step=done, total=state.total_steps, step_ms=(time.perf_counter() - started) * 1e3
                )
        yield await self.compute(self.runner.finish, state)

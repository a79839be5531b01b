"""ar-encoder worker: prompt text -> prompt embeddings (and negative ones with CFG)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Worker
from omnistage.v1 import stage_pb2


class EncoderWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_encoder(config.model_dir, self.device, self.dtype)

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def run(
        self, request: GenerationRequest, inputs: StageState, progress_every: int, outputs: frozenset[str]
    ) -> AsyncIterator[stage_pb2.StepProgress | StageState]:
        (state,) = await self.compute(self.runner.encode, [request])
        yield state

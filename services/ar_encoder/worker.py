"""ar-encoder worker: prompt text -> prompt embeddings (and negative ones with CFG).

Concurrent requests are micro-batched into one encoder forward.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.batching import MicroBatcher
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import StageCall, Worker
from omnistage.v1 import stage_pb2


class EncoderWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_encoder(config.model_dir, self.device, self.dtype)
        self.batcher: MicroBatcher[GenerationRequest, StageState] = MicroBatcher(
            self._encode,
            name=self.stage,
            window_s=config.batch_window_ms / 1e3,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
        )

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def _encode(self, requests: list[GenerationRequest]) -> list[StageState]:
        return await self.compute(self.runner.encode, requests)

    async def run(self, call: StageCall) -> AsyncIterator[stage_pb2.StepProgress | StageState]:
        yield await self.batcher.submit(call.request, deadline=call.deadline, label=call.request_id)

    def close(self) -> None:
        self.batcher.close()
        super().close()

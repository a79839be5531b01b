"""ar-encoder worker: prompt text -> prompt embeddings (and negative ones with CFG).

The backend (`--backend torch|vllm`) is chosen and started once, here, before the service
reports healthy; a backend that cannot start stops the service with a clear error. The
prompt-embedding cache (`--cache-bytes`, `--cache-bypass`) sits in front of either backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Progress, StageCall, Worker
from services.ar_encoder.cache import CacheStats, EmbeddingCache
from services.ar_encoder.runner import BACKENDS, PromptEncoder, TextBackend, TorchBackend, VllmBackend

# A caller of Stage.Run may set this input meta key to "1" to skip the cache for one request
# (no proto field yet; the coordinator does not set it).
BYPASS_META_KEY = "omnistage.bypass_cache"


class EncoderWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        if config.backend not in BACKENDS:
            raise SystemExit(f"ar-encoder: unknown backend {config.backend!r}; choose one of {BACKENDS}")
        if self.family.name != "qwenimage":
            raise SystemExit(f"ar-encoder: no encoder backends for model family {self.family.name!r}")
        backend: TextBackend
        if config.backend == "vllm":
            backend = self._start_vllm(config)
        else:
            runner = self.family.load_encoder(config.model_dir, self.device, self.dtype)
            assert isinstance(runner, QwenImageEncoder)
            self.manage_memory(
                runner, reload=lambda: self.family.load_encoder(config.model_dir, self.device, self.dtype)
            )
            backend = TorchBackend(
                runner,
                self.compute,
                window_s=config.batch_window_ms / 1e3,
                max_batch=config.max_batch,
                max_queue=config.max_queue,
            )
        model_key = f"{self.model_name}:{config.dtype}:{config.backend}"
        self.encoder = PromptEncoder(backend, EmbeddingCache(config.cache_bytes), model_key)

    def _start_vllm(self, config: StageConfig) -> VllmBackend:
        from services.ar_encoder.vllm_backend import EngineStartError, VllmTextEncoder, vllm_available

        if not vllm_available():
            raise SystemExit(
                "ar-encoder: --backend vllm needs vLLM: OMNISTAGE_VLLM=1 bash scripts/setup.sh "
                "(CPU) or `pip install vllm` (CUDA); see README"
            )
        try:
            encoder = VllmTextEncoder(
                config.model_dir, self.dtype, memory_fraction=config.vllm_memory_fraction
            )
        except EngineStartError as exc:
            raise SystemExit(f"ar-encoder: {exc}") from exc
        return VllmBackend(encoder, max_queue=config.max_queue)

    @property
    def cache_stats(self) -> CacheStats:
        return self.encoder.cache.stats()

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        bypass = self.config.cache_bypass or call.inputs.meta.get(BYPASS_META_KEY) == "1"
        yield await self.encoder.encode(
            call.request, bypass_cache=bypass, deadline=call.deadline, label=call.request_id
        )

    def close(self) -> None:
        self.encoder.close()
        super().close()

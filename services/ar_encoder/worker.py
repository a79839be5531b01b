"""ar-encoder worker: a family's encoder and autoregressive roles (Qwen-Image's text encoder,
GLM-Image's prior generator and glyph encoder).

The backend (`--backend torch|vllm`) is chosen here and started by the family's loader before
the service reports healthy; a role without a vLLM backend, or a backend that cannot start,
stops the service with a clear error. Roles that keep an output cache (Qwen-Image's prompt
embeddings) get `--cache-bytes` / `--cache-bypass`; generators that chunk long prompts' prefills
get `--prefill-chunk-tokens`.
"""

from __future__ import annotations

from dataclasses import replace

from omni_common.models.base import StageContext
from omni_common.runtime.worker import Worker

BACKENDS = ("torch", "vllm")


class EncoderWorker(Worker):
    def stage_context(self) -> StageContext:
        config = self.config
        if config.backend not in BACKENDS:
            raise SystemExit(f"ar-encoder: unknown backend {config.backend!r}; choose one of {BACKENDS}")
        return replace(
            super().stage_context(),
            backend=config.backend,
            vllm_memory_fraction=config.vllm_memory_fraction,
            cache_bytes=config.cache_bytes,
            cache_bypass=config.cache_bypass,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            ar_decode=config.ar_decode,
            # --compile on compiles the text encoder's layers; auto leaves them eager: a lone
            # prompt's graph replay beats them (QwenImageEncoder.use_cuda_graphs).
            compile=self.compile_flag() and config.compile == "on",
            cuda_graphs=self.execution_flag("--cuda-graphs", config.cuda_graphs),
        )

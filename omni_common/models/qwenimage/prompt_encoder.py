"""Qwen-Image's text-encoder role: the prompt-embedding cache in front of one encoder backend.

Per request: look up each of its texts (prompt and, with true CFG, negative prompt) in the
cache, encode the missing ones with the backend, store them, and assemble the stage output
with the family's code. Backends:
- `torch`: the family's in-process encoder on the worker's compute thread; concurrent
  requests' missing texts are micro-batched into one forward (a lone request keeps diffusers'
  one-text-per-forward path, bitwise the pipeline's).
- `vllm`: vLLM's engine in pooling mode; every text is an engine request and the engine
  batches concurrent ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from omni_common.errors import ResourceExhausted
from omni_common.execution.batching import MicroBatcher
from omni_common.models.base import GenerationRequest, RoleCall, StageContext, StageState
from omni_common.models.qwenimage.encode import (
    PROMPT_TEMPLATE,
    QwenImageEncoder,
    state_from_embeddings,
    texts_of,
)
from omni_common.models.qwenimage.prompt_cache import CacheKey, EmbeddingCache

log = logging.getLogger("omnistage.ar_encoder")
LOG_STATS_EVERY = 100  # requests between two cache-statistics log lines
# A caller of Stage.Run may set this input meta key to "1" to skip the cache for one request
# (no proto field yet; the coordinator does not set it).
BYPASS_META_KEY = "omnistage.bypass_cache"


class TextBackend(Protocol):
    """Per-text prompt hidden states [L_i, D] (prefix dropped, not yet cut to a length)."""

    name: str

    async def embed(self, texts: list[str], *, deadline: float | None, label: str) -> list[torch.Tensor]: ...

    def forget_cuda_graphs(self) -> None: ...

    def close(self) -> None: ...


class TorchBackend:
    """The family's transformers encoder, one forward at a time on the compute thread."""

    name = "torch"

    def __init__(
        self,
        encoder: QwenImageEncoder,
        compute: Callable[..., Awaitable[list[list[torch.Tensor]]]],
        *,
        window_s: float,
        max_batch: int,
        max_queue: int,
    ) -> None:
        self.encoder = encoder
        self.compute = compute
        self.batcher: MicroBatcher[list[str], list[torch.Tensor]] = MicroBatcher(
            self._run_batch, name="ar-encoder", window_s=window_s, max_batch=max_batch, max_queue=max_queue
        )

    def _forward(self, batch: list[list[str]]) -> list[list[torch.Tensor]]:
        texts = [text for item in batch for text in item]
        per_text = self.encoder.embed_texts(texts, alone=len(batch) == 1)
        out = []
        for item in batch:
            out.append(per_text[: len(item)])
            del per_text[: len(item)]
        return out

    async def _run_batch(self, batch: list[list[str]]) -> list[list[torch.Tensor]]:
        return await self.compute(self._forward, batch)

    async def embed(self, texts: list[str], *, deadline: float | None, label: str) -> list[torch.Tensor]:
        return await self.batcher.submit(texts, deadline=deadline, label=label)

    def forget_cuda_graphs(self) -> None:
        self.encoder.forget_cuda_graphs()

    def close(self) -> None:
        self.batcher.close()


class VllmBackend:
    """vLLM's engine; bounded by `max_queue` texts in flight (more: RESOURCE_EXHAUSTED)."""

    name = "vllm"

    def __init__(self, encoder: object, *, max_queue: int) -> None:
        from omni_common.models.qwenimage.vllm_encoder import VllmTextEncoder

        assert isinstance(encoder, VllmTextEncoder)
        self.encoder = encoder
        self.max_queue = max_queue
        self.in_flight = 0

    async def embed(self, texts: list[str], *, deadline: float | None, label: str) -> list[torch.Tensor]:
        if self.in_flight + len(texts) > self.max_queue:
            raise ResourceExhausted(
                f"ar-encoder is at capacity ({self.in_flight} texts in flight); retry shortly",
                retry_after_ms=100,
            )
        self.in_flight += len(texts)
        try:
            if deadline is None:
                return await self.encoder.embed_texts(texts)
            timeout = max(deadline - time.monotonic(), 0.0)
            return await asyncio.wait_for(self.encoder.embed_texts(texts), timeout)
        finally:
            self.in_flight -= len(texts)

    def forget_cuda_graphs(self) -> None:
        pass  # the engine keeps its own graphs, with its weights

    def close(self) -> None:
        self.encoder.close()


class PromptEncoder:
    """The text-encoder role (an AsyncRunner): the cache in front of a backend; one StageState
    per request."""

    def __init__(
        self, backend: TextBackend, cache: EmbeddingCache, model_key: str, *, bypass: bool = False
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.model_key = model_key
        self.bypass = bypass  # --cache-bypass: neither read nor fill the cache
        self.in_flight = 0
        self._requests = 0

    async def run(self, call: RoleCall) -> StageState:
        bypass = self.bypass or call.inputs.meta.get(BYPASS_META_KEY) == "1"
        self.in_flight += 1
        try:
            return await self.encode(
                call.request, bypass_cache=bypass, deadline=call.deadline, label=call.label
            )
        finally:
            self.in_flight -= 1

    def load(self) -> int:
        """Prompts waiting or being encoded."""
        return self.in_flight

    def forget_cuda_graphs(self) -> None:
        """The text encoder's weights are about to move (sleep, offload)."""
        self.backend.forget_cuda_graphs()

    def key(self, text: str, request: GenerationRequest) -> CacheKey:
        return CacheKey(self.model_key, text, PROMPT_TEMPLATE, request.max_sequence_length)

    async def encode(
        self,
        request: GenerationRequest,
        *,
        bypass_cache: bool = False,
        deadline: float | None = None,
        label: str = "",
    ) -> StageState:
        texts = texts_of(request)
        keys = [self.key(text, request) for text in texts]
        found: dict[str, torch.Tensor] = {}
        for text, key in zip(texts, keys, strict=True):
            if text not in found and (hit := self.cache.get(key, bypass=bypass_cache)) is not None:
                found[text] = hit
        missing = [text for text in dict.fromkeys(texts) if text not in found]
        if missing:
            computed = await self.backend.embed(missing, deadline=deadline, label=label)
            for text, embeds in zip(missing, computed, strict=True):
                embeds = embeds[: request.max_sequence_length]
                self.cache.put(self.key(text, request), embeds, bypass=bypass_cache)
                found[text] = embeds
        self._requests += 1
        if self._requests % LOG_STATS_EVERY == 0:
            self.cache.log_stats()
        return state_from_embeddings(request, [found[text] for text in texts])

    def close(self) -> None:
        self.cache.log_stats()
        self.backend.close()


class PromptStage:
    """The ar-encoder's stage model: the text encoder (torch backend; None with vLLM, whose
    engine holds the weights) and the text-encoder role."""

    def __init__(self, text_encoder: nn.Module | None, runner: PromptEncoder) -> None:
        self.text_encoder = text_encoder  # what sleep/wake move (MODULES: "text_encoder")
        self.runners = {"text-encoder": runner}


def load_prompt_stage(model_dir: Path, context: StageContext) -> PromptStage:
    """The encoder with the backend the stage asked for, behind the prompt cache."""
    backend: TextBackend
    text_encoder = None
    if context.backend == "vllm":
        backend = _start_vllm(model_dir, context)
    else:
        assert context.compute is not None, "the torch backend runs on the stage's compute thread"
        encoder = QwenImageEncoder.load(model_dir, context.device, context.dtype)
        if context.compile:
            encoder.compile()
        if context.cuda_graphs:
            encoder.use_cuda_graphs()
        text_encoder = encoder.text_encoder
        backend = TorchBackend(
            encoder,
            context.compute,
            window_s=context.batch_window_s,
            max_batch=context.max_batch,
            max_queue=context.max_queue,
        )
    dtype = str(context.dtype).removeprefix("torch.")
    model_key = f"{Path(model_dir).resolve().name}:{dtype}:{context.backend}"
    cache = EmbeddingCache(context.cache_bytes)
    return PromptStage(text_encoder, PromptEncoder(backend, cache, model_key, bypass=context.cache_bypass))


def _start_vllm(model_dir: Path, context: StageContext) -> VllmBackend:
    from omni_common.models.qwenimage.vllm_encoder import EngineStartError, VllmTextEncoder, vllm_available

    if not vllm_available():
        raise SystemExit(
            "ar-encoder: --backend vllm needs vLLM: OMNISTAGE_VLLM=1 bash scripts/setup.sh "
            "(CPU) or `pip install vllm` (CUDA); see README"
        )
    try:
        encoder = VllmTextEncoder(model_dir, context.dtype, memory_fraction=context.vllm_memory_fraction)
    except EngineStartError as exc:
        raise SystemExit(f"ar-encoder: {exc}") from exc
    return VllmBackend(encoder, max_queue=context.max_queue)

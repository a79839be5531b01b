"""ar-encoder runner: the prompt-embedding cache in front of one encoder backend.

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
from typing import Protocol

import torch

from omni_common.errors import ResourceExhausted
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwenimage.encode import (
    PROMPT_TEMPLATE,
    QwenImageEncoder,
    state_from_embeddings,
    texts_of,
)
from omni_common.runtime.batching import MicroBatcher
from services.ar_encoder.cache import CacheKey, EmbeddingCache

log = logging.getLogger("omnistage.ar_encoder")
BACKENDS = ("torch", "vllm")
LOG_STATS_EVERY = 100  # requests between two cache-statistics log lines


class TextBackend(Protocol):
    """Per-text prompt hidden states [L_i, D] (prefix dropped, not yet cut to a length)."""

    name: str

    async def embed(self, texts: list[str], *, deadline: float | None, label: str) -> list[torch.Tensor]: ...

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

    def close(self) -> None:
        self.batcher.close()


class VllmBackend:
    """vLLM's engine; bounded by `max_queue` texts in flight (more: RESOURCE_EXHAUSTED)."""

    name = "vllm"

    def __init__(self, encoder: object, *, max_queue: int) -> None:
        from services.ar_encoder.vllm_backend import VllmTextEncoder

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

    def close(self) -> None:
        self.encoder.close()


class PromptEncoder:
    """The cache in front of a backend; one StageState per request."""

    def __init__(self, backend: TextBackend, cache: EmbeddingCache, model_key: str) -> None:
        self.backend = backend
        self.cache = cache
        self.model_key = model_key
        self._requests = 0

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

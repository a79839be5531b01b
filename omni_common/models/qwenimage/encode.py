"""Qwen-Image encode stage: prompt text -> Qwen2.5-VL last hidden states.

Reads like `QwenImagePipeline.encode_prompt` / `_get_qwen_prompt_embeds` in diffusers 0.42:
the prompt goes into a chat template, the 34-token system prefix is dropped from the
outputs, the last hidden state (after the final norm) is the conditioning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from omni_common.execution.compile_cache import decisions_for
from omni_common.execution.cuda_graphs import CudaGraphCache, Inputs
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwenimage.prompt_template import (
    PROMPT_TEMPLATE,
    PROMPT_TEMPLATE_DROP,
    TOKENIZER_MAX_LENGTH,
)
from omni_common.models.weights import load_component

# A lone prompt's CUDA graph (use_cuda_graphs) takes its tokens padded to a multiple of this;
# prompts of more tokens than GRAPHED_TOKENS run eagerly.
GRAPH_BUCKET_TOKENS = 16
GRAPHED_TOKENS = 256
# Captured at load: a prompt of 10 to 90 words once in the template.
WARM_GRAPH_TOKENS = (48, 64, 80, 96, 112, 128)


class QwenImageEncoder:
    """The text encoder stage; only Qwen2.5-VL's language model runs (text-only input)."""

    def __init__(
        self,
        text_encoder: Qwen2_5_VLForConditionalGeneration,
        tokenizer: Qwen2Tokenizer,
        device: torch.device,
    ) -> None:
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.device = device
        self.graphs: CudaGraphCache | None = None  # use_cuda_graphs()

    @classmethod
    def load(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImageEncoder:
        """Load text_encoder/ and tokenizer/ of a diffusers Qwen-Image directory."""
        text_encoder = load_component(
            Qwen2_5_VLForConditionalGeneration, model_dir / "text_encoder", device, dtype
        )
        tokenizer = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer")
        return cls(text_encoder, tokenizer, device)

    @torch.inference_mode()
    def _encode_each(self, texts: Sequence[str]) -> list[torch.Tensor]:
        """One forward for all `texts` (padded to the longest); per text its valid hidden
        states [L_i, D] without the system prefix."""
        drop = PROMPT_TEMPLATE_DROP
        tokens = template_tokens(self.tokenizer, texts, padding=True, return_tensors="pt").to(self.device)
        if len(texts) == 1 and (hidden := self._graphed(tokens.input_ids)) is not None:
            return [hidden[drop:]]
        # `.model` skips the LM head: the hidden states are the same, the logits are not needed.
        # The last hidden state is the pipeline's `hidden_states[-1]` (after the final norm); one
        # forward needs no KV cache.
        with self._attention():
            outputs = self.text_encoder.model(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, use_cache=False
            )
        hidden = outputs.last_hidden_state
        mask = tokens.attention_mask.bool()
        return [h[m][drop:] for h, m in zip(hidden, mask, strict=True)]

    def _attention(self) -> contextlib.AbstractContextManager[None]:
        """The attention kernels a prompt's forward may take. On a GPU, not cuDNN's (PyTorch's
        first choice on an H200), which builds a plan per new sequence length, ~2.5 ms a layer
        the first time: a prompt of a new length took 60-110 ms to encode, one of a seen length
        15-26 ms. Prompts are short, so flash and memory-efficient attention cost nothing."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def use_cuda_graphs(self) -> None:
        """Replay a lone prompt's forward as a CUDA graph, one per GRAPH_BUCKET_TOKENS bucket
        of its length (WARM_GRAPH_TOKENS captured now, others at their first prompt).

        On a GPU a prompt's forward is launch-bound: on an H200 with Qwen2.5-VL-7B, 77 tokens
        took 17.9 ms eager and 27.3 ms with compile()'s layers (their compiled code's host
        work), against 7.6 ms replayed, of which 5 ms are kernels. The prompt is padded at
        its end: causal attention keeps its tokens from seeing the padding, so their states
        are the unpadded forward's up to the rounding of matrix products of another size."""
        decisions = decisions_for("encoder-graphs", self.device, self.text_encoder.config.to_dict())
        self.graphs = CudaGraphCache(self.device, decisions=decisions)
        pad = self.tokenizer.pad_token_id or 0
        for tokens in WARM_GRAPH_TOKENS:
            self._graphed(torch.full((1, tokens), pad, dtype=torch.long, device=self.device))

    def forget_cuda_graphs(self) -> None:
        """Drop the graphs (the weights are about to move); prompts capture them again."""
        if self.graphs is not None:
            self.graphs.clear()

    @torch.inference_mode()
    def _graphed(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """A lone prompt's last hidden states [L, D] from its bucket's graph; None where it
        runs eagerly (no graphs, a long prompt, a graph that cannot be captured or does not
        pay)."""
        length = input_ids.shape[1]
        bucket = -(-length // GRAPH_BUCKET_TOKENS) * GRAPH_BUCKET_TOKENS
        if self.graphs is None or bucket > GRAPHED_TOKENS:
            return None
        padded = input_ids.new_full((1, bucket), self.tokenizer.pad_token_id or 0)
        padded[:, :length] = input_ids
        # Lengths share whether a replay pays: timed once, at the first bucket captured.
        hidden = self.graphs.run(("prompt", bucket), {"input_ids": padded}, self._last_hidden, "prompt")
        return None if hidden is None else hidden[0, :length].clone()

    def _last_hidden(self, inputs: Inputs) -> torch.Tensor:
        """The language model's last hidden states of unmasked `input_ids` (a lone text): what
        the full model's forward gives for text alone (positions 0..L-1 on all three rotary
        axes), without its host work, which no graph may hold."""
        with self._attention():
            outputs = self.text_encoder.model.language_model(input_ids=inputs["input_ids"], use_cache=False)
        return outputs.last_hidden_state

    def compile(self) -> None:
        """torch.compile the language model's decoder layers (one compiled block serves all of
        them) and run them at the shapes requests bring, so none waits for a compilation.

        On a GPU a prompt's forward is launch-bound: ~50 tokens through a 7 B model read its
        15 GB of weights in ~3 ms, but eager PyTorch launches ~15 kernels a layer from Python
        (~60 ms a prompt on an H100, docs/benchmarks.md). Compiled, the results agree with the
        eager ones to float rounding, not bit for bit, so the CPU stays eager."""
        for layer in self.text_encoder.model.language_model.layers:
            # dynamic=True: batch and length are symbolic from the first compilation (automatic
            # dynamic re-specialized the length once the batch changed: measured on an H200,
            # a new length at batch 3 compiled a fifth graph after this warm-up).
            layer.compile(fullgraph=True, dynamic=True)
        # A lone text (batch 1, which PyTorch specializes, no mask) and padded batches of two
        # and three texts (the mask): the graphs every later request reuses.
        short, long = "warm-up", "a longer warm-up prompt that takes more tokens"
        for texts in ([short], [long], [short, long], [long, short, short]):
            self._encode_each(texts)

    def encode_texts(
        self, texts: Sequence[str], max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings [B, L, D] padded with zeros to the longest text, and their int64 mask
        [B, L] (None when it is all ones, as diffusers returns it)."""
        return pad_with_mask(self._encode_each(texts), max_sequence_length)

    def embed_texts(self, texts: Sequence[str], *, alone: bool) -> list[torch.Tensor]:
        """Per text its hidden states [L_i, D] without the system prefix (not yet cut to a
        max_sequence_length). `alone`: each text in a forward of its own (diffusers' path,
        bitwise the pipeline's); otherwise one padded forward for all of them."""
        if alone:
            return [self.encode_texts([text], TOKENIZER_MAX_LENGTH)[0][0] for text in texts]
        return self._encode_each(texts)

    def encode(self, requests: Sequence[GenerationRequest]) -> list[StageState]:
        """Per request: "prompt_embeds" [1, L, D] and, with true CFG, "negative_prompt_embeds"
        [1, L', D], each trimmed to its own text's length, so no mask is needed.

        A lone request takes diffusers' path: each of its texts in a forward of its own, so its
        embeddings are bitwise the pipeline's. Several requests share one padded forward for all
        their texts (prompts and negative prompts); a text's valid states then equal its states
        encoded alone up to float rounding (padded tokens are masked out as keys).
        """
        if not requests:
            return []
        texts = [text for request in requests for text in texts_of(request)]
        per_text = self.embed_texts(texts, alone=len(requests) == 1)
        states = []
        for request in requests:
            n = len(texts_of(request))
            states.append(state_from_embeddings(request, per_text[:n]))
            del per_text[:n]
        return states


# The pieces below are the family's encode recipe around the model forward; every encoder
# backend (in-process torch above, vLLM in services/ar_encoder) shares them.


def texts_of(request: GenerationRequest) -> list[str]:
    """The texts a request needs encoded: its prompt and, with true CFG, its negative prompt."""
    return [request.prompt, request.negative_prompt] if request.do_true_cfg else [request.prompt]


def template_tokens(tokenizer: Qwen2Tokenizer, texts: Sequence[str], **kwargs: Any) -> Any:
    """`texts` put into the chat template and tokenized as the pipeline does (truncated to
    TOKENIZER_MAX_LENGTH tokens after the system prefix); kwargs go to the tokenizer."""
    return tokenizer(
        [PROMPT_TEMPLATE.format(text) for text in texts],
        max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP,
        truncation=True,
        **kwargs,
    )


def pad_with_mask(
    per_text: Sequence[torch.Tensor], max_sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-text states [L_i, D] as embeddings [B, L, D] padded with zeros to the longest, and
    their int64 mask [B, L] (None when it is all ones, as diffusers returns it)."""
    length = max(e.size(0) for e in per_text)
    embeds = torch.stack([torch.cat([e, e.new_zeros(length - e.size(0), e.size(1))]) for e in per_text])
    embeds_mask = torch.stack(
        [
            torch.cat(
                [
                    torch.ones(e.size(0), dtype=torch.long, device=e.device),
                    torch.zeros(length - e.size(0), dtype=torch.long, device=e.device),
                ]
            )
            for e in per_text
        ]
    )
    embeds = embeds[:, :max_sequence_length]
    embeds_mask = embeds_mask[:, :max_sequence_length]
    return embeds, (None if embeds_mask.all() else embeds_mask)


def state_from_embeddings(request: GenerationRequest, per_text: Sequence[torch.Tensor]) -> StageState:
    """The stage output of one request from its texts' states (in `texts_of` order), each cut
    to the request's max_sequence_length: "prompt_embeds" [1, L, D] and, with true CFG,
    "negative_prompt_embeds" [1, L', D]."""
    names = ("prompt", "negative_prompt")[: len(per_text)]
    return StageState(
        tensors={
            f"{name}_embeds": embeds[: request.max_sequence_length].unsqueeze(0)
            for name, embeds in zip(names, per_text, strict=True)
        }
    )

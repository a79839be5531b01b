"""GLM-Image glyph encoder: the quoted text of a prompt -> ByT5 (T5 encoder) hidden states.

Reads like `GlmImagePipeline.encode_prompt` / `_get_glyph_embeds` in diffusers 0.42.1: the
DiT is conditioned not on the whole prompt but on the text the image should spell (the
spans in quotes), each span tokenized byte by byte, all spans of a prompt in one T5 forward,
their valid hidden states joined into one sequence. A prompt without quotes encodes "".

Each request is encoded alone, in the pipeline's own per-prompt forward, so its embeddings
equal the pipeline's bit for bit; padding several prompts into one forward would change the
bits (and the encoder is small next to the DiT).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import ByT5Tokenizer, T5EncoderModel

from omni_common.errors import InvalidArgument
from omni_common.models.base import BatchRunner, RoleCall, StageState
from omni_common.models.weights import load_component

# The quote pairs the pipeline looks for, in the order it concatenates their matches: all
# '...' spans first, then “...”, then "...", then 「...」 (not the order they appear in).
GLYPH_PATTERNS = (
    re.compile(r"'([^']*)'"),
    re.compile("\u201c([^\u201c\u201d]*)\u201d"),
    re.compile(r'"([^"]*)"'),
    re.compile("「([^「」]*)」"),
)


def glyph_texts(prompt: str) -> list[str]:
    """The texts the image should show: the quoted spans of `prompt`, or [""] when none."""
    texts = [text for pattern in GLYPH_PATTERNS for text in pattern.findall(prompt)]
    return texts or [""]


class GlmImageGlyphEncoder:
    """Role "glyph" (BatchRunner): "prompt_embeds" [1, L, D] and, with CFG (a guidance scale
    above 1), "negative_prompt_embeds": the embeddings of the empty prompt, as the pipeline
    uses them."""

    def __init__(
        self, tokenizer: ByT5Tokenizer, text_encoder: T5EncoderModel, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.device = device
        self.dtype = dtype
        # The empty prompt's embeddings depend only on the length limit: computed once per limit.
        self._negative: dict[int, torch.Tensor] = {}
        self.runners: dict[str, BatchRunner] = {"glyph": self}

    @classmethod
    def load(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> GlmImageGlyphEncoder:
        """Load tokenizer/ (ByT5) and text_encoder/ (T5 encoder) of a diffusers GLM-Image directory."""
        tokenizer = ByT5Tokenizer.from_pretrained(model_dir / "tokenizer")
        text_encoder = load_component(T5EncoderModel, model_dir / "text_encoder", device, dtype)
        return cls(tokenizer, text_encoder, device, dtype)

    def cost(self, call: RoleCall) -> int:
        return 1

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        """One output per call; each prompt in its own forward (see the module docstring)."""
        outputs = []
        for call in calls:
            request = call.request
            if request.max_sequence_length < 1:
                raise InvalidArgument("max_sequence_length must be at least 1")
            tensors = {"prompt_embeds": self.encode(request.prompt, request.max_sequence_length)}
            if request.true_cfg_scale > 1:
                tensors["negative_prompt_embeds"] = self.negative(request.max_sequence_length).clone()
            outputs.append(StageState(tensors))
        return outputs

    def negative(self, max_sequence_length: int) -> torch.Tensor:
        """The glyph embeddings of "", the pipeline's CFG negative, cached per length limit."""
        if max_sequence_length not in self._negative:
            self._negative[max_sequence_length] = self.encode("", max_sequence_length)
        return self._negative[max_sequence_length]

    @torch.inference_mode()
    def encode(self, prompt: str, max_sequence_length: int) -> torch.Tensor:
        """[1, L, D]: the valid hidden states of every glyph text of `prompt`, joined in order."""
        pad = self.tokenizer.pad_token_id
        ids = self.tokenizer(glyph_texts(prompt), max_length=max_sequence_length, truncation=True).input_ids
        if len(ids) % 2 == 0:
            # The pipeline prepends one pad token to every text when the number of texts (not
            # of tokens) is even; the pad is unmasked, so it is part of the embeddings.
            ids = [[pad, *one] for one in ids]
        longest = max(len(one) for one in ids)
        input_ids = torch.tensor([one + [pad] * (longest - len(one)) for one in ids], device=self.device)
        mask = torch.tensor([[1] * len(one) + [0] * (longest - len(one)) for one in ids], device=self.device)
        hidden = self.text_encoder(input_ids, attention_mask=mask).last_hidden_state
        return hidden[mask.bool()].unsqueeze(0).to(device=self.device, dtype=self.dtype)

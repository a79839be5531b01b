"""Qwen-Image encode stage: prompt text -> Qwen2.5-VL last hidden states.

Reads like `QwenImagePipeline.encode_prompt` / `_get_qwen_prompt_embeds` in diffusers 0.42:
the prompt goes into a chat template, the 34-token system prefix is dropped from the
outputs, the last hidden state (after the final norm) is the conditioning.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from omni_common.models.base import GenerationRequest, StageState

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34  # tokens of the system prefix, dropped from the embeddings
TOKENIZER_MAX_LENGTH = 1024


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

    @classmethod
    def load(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImageEncoder:
        """Load text_encoder/ and tokenizer/ of a diffusers Qwen-Image directory."""
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir / "text_encoder", dtype=dtype
        )
        tokenizer = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer")
        module: torch.nn.Module = text_encoder  # transformers' typed `.to` confuses mypy
        module.to(device).eval()
        return cls(text_encoder, tokenizer, device)

    @torch.inference_mode()
    def encode_texts(
        self, texts: Sequence[str], max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings [B, L, D] padded with zeros to the longest text, and their int64 mask
        [B, L] (None when it is all ones, as diffusers returns it)."""
        drop = PROMPT_TEMPLATE_DROP
        tokens = self.tokenizer(
            [PROMPT_TEMPLATE.format(text) for text in texts],
            max_length=TOKENIZER_MAX_LENGTH + drop,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        # `.model` skips the LM head: the hidden states are the same, the logits are not needed.
        outputs = self.text_encoder.model(
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            output_hidden_states=True,
        )
        hidden = outputs.hidden_states[-1]
        mask = tokens.attention_mask.bool()
        per_text = [h[m][drop:] for h, m in zip(hidden, mask, strict=True)]
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

    def encode(self, requests: Sequence[GenerationRequest]) -> list[StageState]:
        """Per request: "prompt_embeds" [1, L, D] (+ "prompt_embeds_mask" [1, L] int64 when
        it has zeros) and, with true CFG, "negative_prompt_embeds" (+ its mask).

        Prompt and negative prompt are encoded in separate forwards, as diffusers does, so the
        results are bitwise those of the pipeline.
        """
        states = []
        for request in requests:
            tensors: dict[str, torch.Tensor] = {}
            texts = {"prompt": request.prompt}
            if request.do_true_cfg:
                texts["negative_prompt"] = request.negative_prompt
            for name, text in texts.items():
                embeds, mask = self.encode_texts([text], request.max_sequence_length)
                tensors[f"{name}_embeds"] = embeds
                if mask is not None:
                    tensors[f"{name}_embeds_mask"] = mask
            states.append(StageState(tensors=tensors))
        return states

"""What the thinker reads of a request: its conversation rendered by the chat template, and its
audio clips and images turned into model inputs by transformers' own `Qwen2_5OmniProcessor`
(Whisper's feature extractor, the Qwen2-VL image processor), exactly as a transformers user
runs it before `generate`.

Built offline from configs: the checkpoint's preprocessor_config.json (one file holding both
parts' settings, as the published checkpoint has it) and its tokenizer; nothing downloads.
Two choices, both so that every machine computes the same inputs:
- the image processor is the PIL backend (`Qwen2VLImageProcessorPil`) whether or not torchvision
  is installed (transformers picks the torchvision one when it is, which resizes differently);
- no video processor: omnistage takes no video, and transformers' video processor class needs
  torchvision. `NoVideo` stands in its place: it has the sizes that transformers' processor reads
  of it even for a call without video (5.19 reads `merge_size` on every call), and refuses
  frames; `NoVideoProcessor` lets it pass the processor's class check.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, BatchFeature, Qwen2_5OmniProcessor, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omni_common.audio_input import audio_file_bytes, decode_audio_file
from omni_common.errors import InvalidArgument
from omni_common.imaging import decode_image
from omni_common.input_media import input_audio_name, input_image_name
from omni_common.models.base import GenerationRequest
from omni_common.models.conversation_keys import turns_of
from omni_common.models.prefix_cache import prefix_key

# The tokenizer's named media tokens (tokenizer_config.json's extra_special_tokens), which the
# processor expands into one placeholder per audio frame group or image patch group.
MEDIA_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}
# Qwen2.5-Omni's published preprocessor settings, for checkpoints built here (the fixture, the
# random real-size build); `chunk_length` is the longest clip the thinker hears, in seconds.
FEATURE_EXTRACTOR: dict[str, Any] = {
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 300,
    "n_fft": 400,
    "padding_value": 0.0,
    "return_attention_mask": True,
}
IMAGE_PROCESSOR: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# The model inputs the processor makes besides the ids, as the thinker's forward names them.
MEDIA_INPUTS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")


class NoVideo:
    """The video part's stand-in (see the module docstring): the image processor's patch sizes,
    no model inputs, and a clear refusal of frames."""

    def __init__(self, images: Qwen2VLImageProcessorPil) -> None:
        self.model_input_names: list[str] = []
        self.merge_size = images.merge_size
        self.temporal_patch_size = images.temporal_patch_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgument("Qwen2.5-Omni in omnistage takes audio and images, not video")


class NoVideoProcessor(Qwen2_5OmniProcessor):
    """transformers' processor with `NoVideo` as its video part (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if isinstance(argument, NoVideo):
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def to_dict(self) -> dict[str, Any]:
        """transformers' serialisation (for printing and saving) without the stand-in."""
        settings = super().to_dict()
        settings.pop("video_processor", None)
        return settings


def preprocessor_config(chunk_length: int = 300) -> dict[str, Any]:
    """preprocessor_config.json for a checkpoint built here: both parts' settings in one file."""
    extractor = WhisperFeatureExtractor(**{**FEATURE_EXTRACTOR, "chunk_length": chunk_length})
    images = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    return {**extractor.to_dict(), **images.to_dict(), "processor_class": "Qwen2_5OmniProcessor"}


def load_processor(model_dir: Path) -> NoVideoProcessor:
    """The checkpoint's processor (its tokenizer with the media tokens named); a checkpoint
    without preprocessor_config.json (built before it was written) gets the published settings."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, extra_special_tokens=MEDIA_TOKENS)
    if (Path(model_dir) / "preprocessor_config.json").exists():
        images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
    else:
        images, extractor = (
            Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR),
            WhisperFeatureExtractor(**FEATURE_EXTRACTOR),
        )
    return NoVideoProcessor(
        image_processor=images,
        video_processor=NoVideo(images),
        feature_extractor=extractor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def conversation(request: GenerationRequest) -> list[dict[str, Any]]:
    """The request as chat-template messages: its own, else one user turn of its media (audio
    clips, then images) and its prompt. A text-only turn keeps a plain string content, which
    every template renders as it always did."""
    turns = turns_of(request)
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if all(kind == "text" for kind, _ in turn.parts):
            messages.append({"role": turn.role, "content": "".join(str(text) for _, text in turn.parts)})
        else:
            content = [
                {"type": "text", "text": v} if k == "text" else {"type": k, k: v} for k, v in turn.parts
            ]
            messages.append({"role": turn.role, "content": content})
    return messages


def media_order(messages: Sequence[Mapping[str, Any]], kind: str) -> list[int]:
    """The input indices of `kind` in the order the rendered text shows them (the order the
    processor pairs placeholders with inputs)."""
    return [
        part[kind]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == kind
    ]


def process(
    processor: NoVideoProcessor, request: GenerationRequest, tensors: Mapping[str, torch.Tensor]
) -> BatchFeature:
    """The thinker's inputs for `request` (input ids [1, L], attention mask and, with media,
    `MEDIA_INPUTS`), from its media tensors (`input.audio.i`, `input.image.i`)."""
    messages = conversation(request)
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    shown = [input_audio_name(i) for i in media_order(messages, "audio")]
    shown += [input_image_name(i) for i in media_order(messages, "image")]
    missing = [name for name in shown if name not in tensors]
    if missing:  # the coordinator checks this; a stage called directly may be sent anything
        raise InvalidArgument(f"the messages show {missing[0]}, which the call does not carry")
    audios = [_audio(processor, tensors, i) for i in media_order(messages, "audio")]
    images = [decode_image(tensors[input_image_name(i)], index=i) for i in media_order(messages, "image")]
    return processor(
        text=[text], audio=audios or None, images=images or None, return_tensors="pt", padding=True
    )


def _audio(processor: NoVideoProcessor, tensors: Mapping[str, torch.Tensor], index: int) -> np.ndarray:
    samples, _ = decode_audio_file(audio_file_bytes(tensors[input_audio_name(index)]), index=index)
    extractor: Any = processor.feature_extractor
    if len(samples) > extractor.n_samples:
        raise InvalidArgument(
            f"input audio {index} lasts {len(samples) / extractor.sampling_rate:.1f} s; this model hears at "
            f"most {extractor.chunk_length} s (its feature extractor's window)"
        )
    return samples


def reference_inputs(
    processor: NoVideoProcessor,
    messages: list[dict[str, Any]],
    audios: Sequence[bytes] = (),
    images: Sequence[bytes] = (),
) -> BatchFeature:
    """What a transformers user passes to `generate`: `messages` (content parts name their input
    by index, as `conversation` makes them) with the clips (WAV files) and images (image files)."""
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    clips = [decode_audio_file(audios[i], index=i)[0] for i in media_order(messages, "audio")]
    pictures = [Image.open(io.BytesIO(images[i])).convert("RGB") for i in media_order(messages, "image")]
    return processor(
        text=[text], audio=clips or None, images=pictures or None, return_tensors="pt", padding=True
    )


@dataclass(frozen=True, eq=False)
class ThinkerPrompt:
    """One request's prompt as the thinker's prefill reads it: its ids [1, L], its positions
    [4, 1, L] (a text row, then the mrope rows of `get_rope_index`, as `generate` builds them),
    the offset of decode positions past it (negative after images: a picture's tokens take
    fewer positions than tokens), its media inputs and, in the order the text shows them, its
    media's content addresses (the prefix cache's keys name the media a prefix holds)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    media: dict[str, torch.Tensor]
    audio_digests: tuple[str, ...]
    image_digests: tuple[str, ...]
    markers: tuple[int, int]  # the ids that open an audio clip's and an image's placeholders
    ids_on_host: torch.Tensor  # input_ids[0] on the CPU, for keys
    # Each clip's and image's span of tokens, (its opening marker, its closing marker), in order.
    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(
        cls,
        processor: NoVideoProcessor,
        model: Any,
        request: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> ThinkerPrompt:
        messages = conversation(request)
        batch = process(processor, request, tensors)
        input_ids = batch["input_ids"].to(device)
        media = {name: batch[name].to(device) for name in MEDIA_INPUTS if name in batch}
        mask = torch.ones_like(input_ids)
        audio_mask = media.get("feature_attention_mask")
        rope, deltas = model.get_rope_index(
            input_ids,
            media.get("image_grid_thw"),
            None,
            mask,
            False,
            None if audio_mask is None else audio_mask.sum(-1),
            None,
        )
        text = torch.arange(input_ids.shape[1], device=device).view(1, 1, -1)
        tokenizer: Any = processor.tokenizer
        ids_on_host = input_ids[0].cpu()
        return cls(
            input_ids=input_ids,
            positions=torch.cat([text, rope.to(device)]),
            rope_delta=int(deltas.view(-1)[0]),
            media=media,
            audio_digests=tuple(request.audios[i].digest for i in media_order(messages, "audio")),
            image_digests=tuple(request.images[i].digest for i in media_order(messages, "image")),
            markers=(tokenizer.audio_bos_token_id, tokenizer.vision_bos_token_id),
            ids_on_host=ids_on_host,
            spans=media_spans(
                ids_on_host,
                [
                    (tokenizer.audio_bos_token_id, tokenizer.audio_eos_token_id),
                    (tokenizer.vision_bos_token_id, tokenizer.vision_eos_token_id),
                ],
            ),
        )

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def _media_before(self, length: int) -> tuple[int, int]:
        """How many audio clips and images open in the first `length` tokens."""
        head = self.ids_on_host[:length]
        return int((head == self.markers[0]).sum()), int((head == self.markers[1]).sum())

    def key(self, length: int) -> str:
        """The content address of the first `length` tokens and the media in them."""
        audios, images = self._media_before(length)
        return prefix_key(
            self.ids_on_host[:length], (*self.audio_digests[:audios], *self.image_digests[:images])
        )

    def chunk_end(self, start: int, size: int) -> int:
        """Where a prefill chunk of `size` tokens from `start` ends: at most the prompt's end,
        and past the span of a clip or image it would split (the model takes a medium's
        features whole, with all its placeholders), so such a chunk is longer than `size`."""
        end = min(start + size, self.length)
        for opens, closes in self.spans:
            if opens < end <= closes:
                end = closes + 1
        return end

    def media_between(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """The media inputs of the clips and images that open in tokens [start, end) (those
        before `start` are in a reused prefix's or an earlier chunk's cache already)."""
        audios, images = self._media_before(start)
        audios_end, images_end = self._media_before(end)
        media = dict(self.media)
        if "input_features" in media:
            if audios >= audios_end:
                del media["input_features"], media["feature_attention_mask"]
            else:
                media["input_features"] = media["input_features"][audios:audios_end]
                media["feature_attention_mask"] = media["feature_attention_mask"][audios:audios_end]
        if "pixel_values" in media:
            grids = media["image_grid_thw"]
            if images >= images_end:
                del media["pixel_values"], media["image_grid_thw"]
            else:
                skipped = int(grids[:images].prod(dim=-1).sum())
                taken = int(grids[images:images_end].prod(dim=-1).sum())
                media["pixel_values"] = media["pixel_values"][skipped : skipped + taken]
                media["image_grid_thw"] = grids[images:images_end]
        return media


def media_spans(ids: torch.Tensor, markers: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The (opening, closing) token indices of every span that `markers`' pairs of ids open and
    close in `ids` [L], in order."""
    spans = []
    for opens, closes in markers:
        starts = (ids == opens).nonzero().view(-1).tolist()
        ends = (ids == closes).nonzero().view(-1).tolist()
        spans += list(zip(starts, ends, strict=False))
    return tuple(sorted(spans))

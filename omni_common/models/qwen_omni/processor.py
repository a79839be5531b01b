"""What the thinker reads of a request: its conversation rendered by the chat template, and its
audio clips, images and videos turned into model inputs by transformers' own
`Qwen2_5OmniProcessor` (Whisper's feature extractor, the Qwen2-VL image processor, and the
Qwen2-VL video recipe), exactly as a transformers user runs it before `generate`.

Built offline from configs: the checkpoint's preprocessor_config.json (one file holding every
part's settings, as the published checkpoint has it) and its tokenizer; nothing downloads.
Two choices, both so that every machine computes the same inputs:
- the image processor is the PIL backend (`Qwen2VLImageProcessorPil`) whether or not torchvision
  is installed (transformers picks the torchvision one when it is, which resizes differently);
- the video processor is `FrameProcessor` (video_processor.py): the Qwen2-VL video processor's
  recipe on the PIL image processor's operations, as transformers' own needs torchvision;
  `OmniProcessor` lets it pass the processor's class check. A video is the frames a client
  sent and their rate (no container decoding): the rate sets `video_second_per_grid`, one per
  video (transformers' processor takes one rate a call).
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
from omni_common.input_media import input_audio_name, input_image_name, input_video_name
from omni_common.models.base import GenerationRequest
from omni_common.models.conversation_keys import turns_of
from omni_common.models.prefix_cache import prefix_key
from omni_common.models.qwen_omni.chat_tokens import ChatTokens
from omni_common.models.qwen_omni.video_processor import FrameProcessor
from omni_common.video_input import decode_video, video_bytes

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
MEDIA_INPUTS = (
    "input_features",
    "feature_attention_mask",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)


class OmniProcessor(Qwen2_5OmniProcessor):
    """transformers' processor with `FrameProcessor` as its video part (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if isinstance(argument, FrameProcessor):
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def to_dict(self) -> dict[str, Any]:
        """transformers' serialisation (for printing and saving); the video part's settings are
        the image part's."""
        settings = super().to_dict()
        settings.pop("video_processor", None)
        return settings


def preprocessor_config(chunk_length: int = 300) -> dict[str, Any]:
    """preprocessor_config.json for a checkpoint built here: both parts' settings in one file."""
    extractor = WhisperFeatureExtractor(**{**FEATURE_EXTRACTOR, "chunk_length": chunk_length})
    images = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    return {**extractor.to_dict(), **images.to_dict(), "processor_class": "Qwen2_5OmniProcessor"}


def load_processor(model_dir: Path) -> OmniProcessor:
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
    return OmniProcessor(
        image_processor=images,
        video_processor=FrameProcessor(images),
        feature_extractor=extractor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def conversation(request: GenerationRequest) -> list[dict[str, Any]]:
    """The request as chat-template messages: its own, else one user turn of its media (audio
    clips, images, then videos) and its prompt. A text-only turn keeps a plain string content, which
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


def mrope_positions(model: Any, batch: BatchFeature) -> tuple[torch.Tensor | None, int]:
    """The prompt's mrope positions [3, 1, L] from the processor's host tensors, and their
    offset from the token count; None (and 0) where transformers' `get_rope_index` counts the
    tokens in every row: no image and no video (its own branch, on the host). On a GPU,
    get_rope_index's small copies and reads would each wait for the device; integer
    arithmetic, so the same positions either way."""
    if batch.get("image_grid_thw") is None and batch.get("video_grid_thw") is None:
        return None, 0
    audio_mask = batch.get("feature_attention_mask")
    rope, deltas = model.get_rope_index(
        batch["input_ids"],
        batch.get("image_grid_thw"),
        batch.get("video_grid_thw"),
        torch.ones_like(batch["input_ids"]),
        False,
        None if audio_mask is None else audio_mask.sum(-1),
        batch.get("video_second_per_grid"),
    )
    return rope, int(deltas.view(-1)[0])


def process(
    processor: OmniProcessor,
    request: GenerationRequest,
    tensors: Mapping[str, torch.Tensor],
    tokens: ChatTokens | None = None,
) -> BatchFeature:
    """The thinker's inputs for `request` (input ids [1, L], attention mask and, with media,
    `MEDIA_INPUTS` and `video_second_per_grid`), from its media tensors (`input.audio.i`,
    `input.image.i`, `input.video.i`). A text-only chat's ids come from `tokens` when given (the
    same ids, its earlier messages' kept)."""
    messages = conversation(request)
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if tokens is not None and not any(marker in text for marker in MEDIA_TOKENS.values()):
        ids = torch.from_numpy(np.frombuffer(tokens.ids(text), dtype=np.int64)).view(1, -1)
        return BatchFeature({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    shown = [input_audio_name(i) for i in media_order(messages, "audio")]
    shown += [input_image_name(i) for i in media_order(messages, "image")]
    shown += [input_video_name(i) for i in media_order(messages, "video")]
    missing = [name for name in shown if name not in tensors]
    if missing:  # the coordinator checks this; a stage called directly may be sent anything
        raise InvalidArgument(f"the messages show {missing[0]}, which the call does not carry")
    audios = [_audio(processor, tensors, i) for i in media_order(messages, "audio")]
    images = [decode_image(tensors[input_image_name(i)], index=i) for i in media_order(messages, "image")]
    videos = [
        decode_video(video_bytes(tensors[input_video_name(i)]), index=i)
        for i in media_order(messages, "video")
    ]
    return _with_rates(
        processor(
            text=[text],
            audio=audios or None,
            images=images or None,
            videos=[frames for frames, _ in videos] or None,
            return_tensors="pt",
            padding=True,
        ),
        processor,
        [fps for _, fps in videos],
    )


def _with_rates(batch: BatchFeature, processor: OmniProcessor, rates: Sequence[float]) -> BatchFeature:
    """`batch` with each video's seconds per temporal patch from its own rate, as transformers'
    processor computes it from a call's one `fps` (float32, temporal_patch_size / fps)."""
    if rates:
        patch = processor.video_processor.temporal_patch_size
        batch["video_second_per_grid"] = torch.tensor([patch / fps for fps in rates])
    return batch


def _audio(processor: OmniProcessor, tensors: Mapping[str, torch.Tensor], index: int) -> np.ndarray:
    samples, _ = decode_audio_file(audio_file_bytes(tensors[input_audio_name(index)]), index=index)
    extractor: Any = processor.feature_extractor
    if len(samples) > extractor.n_samples:
        raise InvalidArgument(
            f"input audio {index} lasts {len(samples) / extractor.sampling_rate:.1f} s; this model hears at "
            f"most {extractor.chunk_length} s (its feature extractor's window)"
        )
    return samples


def reference_inputs(
    processor: OmniProcessor,
    messages: list[dict[str, Any]],
    audios: Sequence[bytes] = (),
    images: Sequence[bytes] = (),
    videos: Sequence[tuple[Sequence[bytes], float]] = (),
) -> BatchFeature:
    """What a transformers user passes to `generate`: `messages` (content parts name their input
    by index, as `conversation` makes them) with the clips (WAV files), images (image files) and
    videos (each its frames' image files and its fps; one fps for all, as the processor takes)."""
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    clips = [decode_audio_file(audios[i], index=i)[0] for i in media_order(messages, "audio")]
    pictures = [Image.open(io.BytesIO(images[i])).convert("RGB") for i in media_order(messages, "image")]
    shown = [videos[i] for i in media_order(messages, "video")]
    clips_of_frames = [
        [Image.open(io.BytesIO(frame)).convert("RGB") for frame in frames] for frames, _ in shown
    ]
    rates = {fps for _, fps in shown}
    if len(rates) > 1:
        raise ValueError("transformers' processor takes one fps a call; these videos have several")
    return processor(
        text=[text],
        audio=clips or None,
        images=pictures or None,
        videos=clips_of_frames or None,
        videos_kwargs={"fps": rates.pop()} if rates else {},
        return_tensors="pt",
        padding=True,
    )


@dataclass(frozen=True, eq=False)
class ThinkerPrompt:
    """One request's prompt as the thinker's prefill reads it: its ids [1, L], its positions
    [4, 1, L] (a text row, then the mrope rows of `get_rope_index`, as `generate` builds them),
    the offset of decode positions past it (negative after images and videos: their tokens take
    fewer positions than tokens), its media inputs and, per kind in the order the text shows
    them, its media's content addresses (the prefix cache's keys name the media a prefix holds)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    media: dict[str, torch.Tensor]
    digests: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # audio clips, images, videos
    # The ids that open an audio clip's and a picture's placeholders, then an image's and a
    # video's placeholder (a picture's second token says which it is).
    markers: tuple[int, int, int, int]
    ids_on_host: torch.Tensor  # input_ids[0] on the CPU, for keys
    # Each clip's and picture's span of tokens, (its opening marker, its closing marker), in order.
    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(
        cls,
        processor: OmniProcessor,
        model: Any,
        request: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device,
        tokens: ChatTokens | None = None,
    ) -> ThinkerPrompt:
        messages = conversation(request)
        batch = process(processor, request, tensors, tokens)
        rope, delta = mrope_positions(model, batch)
        input_ids = batch["input_ids"].to(device)
        media = {name: batch[name].to(device) for name in MEDIA_INPUTS if name in batch}
        text = torch.arange(input_ids.shape[1], device=device).view(1, 1, -1)
        positions = text.repeat(4, 1, 1) if rope is None else torch.cat([text, rope.to(device)])
        tokenizer: Any = processor.tokenizer
        ids_on_host = batch["input_ids"][0]  # the processor's own, on the host
        kinds = (("audio", request.audios), ("image", request.images), ("video", request.videos))
        audio, image, video = (
            tuple(inputs[i].digest for i in media_order(messages, kind)) for kind, inputs in kinds
        )
        return cls(
            input_ids=input_ids,
            positions=positions,
            rope_delta=delta,
            media=media,
            digests=(audio, image, video),
            markers=(
                tokenizer.audio_bos_token_id,
                tokenizer.vision_bos_token_id,
                tokenizer.image_token_id,
                tokenizer.video_token_id,
            ),
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

    @property
    def media_digests(self) -> tuple[str, ...]:
        """Every medium's content address: the audio clips', then the images', then the videos'."""
        return tuple(digest for kind in self.digests for digest in kind)

    def _media_before(self, length: int) -> tuple[int, int, int]:
        """How many audio clips, images and videos open in the first `length` tokens."""
        audio_bos, vision_bos, image, video = self.markers
        head = self.ids_on_host[:length]
        opened = (head == vision_bos).nonzero().view(-1) + 1  # a picture's first placeholder
        pictures = self.ids_on_host[opened]
        return int((head == audio_bos).sum()), int((pictures == image).sum()), int((pictures == video).sum())

    def key(self, length: int) -> str:
        """The content address of the first `length` tokens and the media in them."""
        counts = self._media_before(length)
        return prefix_key(
            self.ids_on_host[:length],
            tuple(d for kind, n in zip(self.digests, counts, strict=True) for d in kind[:n]),
        )

    def chunk_end(self, start: int, size: int) -> int:
        """Where a prefill chunk of `size` tokens from `start` ends: at most the prompt's end,
        and past the span of a clip or picture it would split (the model takes a medium's
        features whole, with all its placeholders), so such a chunk is longer than `size`."""
        end = min(start + size, self.length)
        for opens, closes in self.spans:
            if opens < end <= closes:
                end = closes + 1
        return end

    def media_between(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """The media inputs of the clips, images and videos that open in tokens [start, end)
        (those before `start` are in a reused prefix's or an earlier chunk's cache already)."""
        (audios, images, videos), (audios_end, images_end, videos_end) = (
            self._media_before(start),
            self._media_before(end),
        )
        media = dict(self.media)
        if "input_features" in media:
            if audios >= audios_end:
                del media["input_features"], media["feature_attention_mask"]
            else:
                media["input_features"] = media["input_features"][audios:audios_end]
                media["feature_attention_mask"] = media["feature_attention_mask"][audios:audios_end]
        for pixels, grid, skip, last in (
            ("pixel_values", "image_grid_thw", images, images_end),
            ("pixel_values_videos", "video_grid_thw", videos, videos_end),
        ):
            if pixels in media:
                grids = media[grid]
                if skip >= last:
                    del media[pixels], media[grid]
                else:
                    skipped = int(grids[:skip].prod(dim=-1).sum())
                    taken = int(grids[skip:last].prod(dim=-1).sum())
                    media[pixels] = media[pixels][skipped : skipped + taken]
                    media[grid] = grids[skip:last]
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

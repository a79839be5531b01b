"""transformers' Qwen2.5-Omni run in one process, as a user would run it: the reference the split
stages (thinker, talker, token2wav) are compared with in tests, and the competitor they are
measured against in benchmarks. Nothing here serves requests.

`reference_generate` is one `Qwen2_5OmniForConditionalGeneration.generate(..., generation_mode=
"audio")` call, unmodified but for one adaptation: omnistage gives each sub-model its own RNG
seeded with the request's seed (thinker sampling, talker sampling, token2wav's initial noise),
while transformers draws all three from the one global RNG in sequence. So the reference
re-seeds the global RNG with `torch.manual_seed(seed)` as each sub-model call starts, through
instance-level wrappers of `thinker.generate`, `talker.generate` and `token2wav.forward` that call
the originals (on CPU a `torch.Generator().manual_seed(seed)` draws the same stream as the global
RNG after `torch.manual_seed(seed)`). The talker wrapper also records the codes it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
)

from omni_common.models.qwen_omni.checkpoint import SPEAKERS_FILE, build_random, load_config
from omni_common.models.qwen_omni.processor import load_processor, reference_inputs
from omni_common.models.weights import random_weights_seed

# What `generate` stops the talker at (its talker_eos_token_id default): codec pad and end.
TALKER_EOS_IDS = (8292, 8294)


@dataclass(frozen=True)
class ReferenceResult:
    """One request's outputs: the thinker's generated ids (prompt excluded, eos kept if it came),
    the talker's codes (its prompt and everything from the first eos excluded), the waveform
    (float32 [samples], 24 kHz) and the decoded text (special tokens skipped)."""

    text_ids: torch.Tensor
    codes: torch.Tensor
    waveform: torch.Tensor
    text: str


def _reseeded(call: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """`call` with the global RNG re-seeded first, as a sub-model with its own RNG would see it."""

    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(seed)
        return call(*args, **kwargs)

    return wrapper


def _first_codes(result: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Row 0's generated codes, cut at the first eos, as `generate` cuts them for token2wav."""
    codes = result[0, prompt_length:]
    is_eos = torch.isin(codes, torch.tensor(TALKER_EOS_IDS, device=codes.device))
    end = int(is_eos.nonzero()[0, 0]) if bool(is_eos.any()) else codes.shape[0]
    return codes[:end].cpu()


def load_model(
    model_dir: Path | str, dtype: torch.dtype = torch.float32
) -> Qwen2_5OmniForConditionalGeneration:
    """The checkpoint with its speakers (spk_dict.pt), in eval mode."""
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()


def load_model_on(
    model_dir: Path, device: torch.device, dtype: torch.dtype
) -> Qwen2_5OmniForConditionalGeneration:
    """The checkpoint on `device` (token2wav in float32, as transformers keeps it). A
    random-weights directory gets each part built as the stages build it (the same seeded
    weights), so a benchmark's transformers side computes with the cluster's weights."""
    if random_weights_seed(Path(model_dir)) is None:
        model: Any = load_model(model_dir, dtype)
        return model.to(device)
    config = load_config(model_dir)
    config.enable_audio_output = False  # the parts are built below, on the device
    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(config)
    parts = (
        ("thinker", Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config, dtype),
        ("talker", Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config, dtype),
        ("token2wav", Qwen2_5OmniToken2WavModel, config.token2wav_config, torch.float32),
    )
    for name, cls, part_config, part_dtype in parts:
        setattr(model, name, build_random(cls, part_config, Path(model_dir), name, device, part_dtype))
    model.has_talker = True
    model.config.enable_audio_output = True
    model.load_speakers(Path(model_dir) / SPEAKERS_FILE)
    return model.eval()


def one_turn(prompt: str, audios: int = 0, images: int = 0, videos: int = 0) -> list[dict[str, Any]]:
    """A user turn of `audios` clips, `images` images, `videos` videos, then `prompt` (a plain
    string without media), as chat-template messages whose media parts name their input by index."""
    if not audios and not images and not videos:
        return [{"role": "user", "content": prompt}]
    parts: list[dict[str, Any]] = [{"type": "audio", "audio": i} for i in range(audios)]
    parts += [{"type": "image", "image": i} for i in range(images)]
    parts += [{"type": "video", "video": i} for i in range(videos)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


@torch.no_grad()
def reference_generate(
    model_dir: Path | str,
    prompt: str = "",
    *,
    messages: list[dict[str, Any]] | None = None,
    audios: Sequence[bytes] = (),
    images: Sequence[bytes] = (),
    videos: Sequence[tuple[Sequence[bytes], float]] = (),
    speaker: str = "Chelsie",
    seed: int = 0,
    thinker_do_sample: bool = False,
    talker_do_sample: bool = True,
    thinker_max_new_tokens: int = 1024,
    talker_max_new_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
) -> ReferenceResult:
    """Text and speech for `prompt` (one user turn after its `audios` (WAV files), `images`
    (image files) and `videos` (frames' image files, fps)) or for the conversation `messages`,
    from transformers' processor and one-shot `generate`, each sub-model seeded with `seed`. The
    token caps default to `generate`'s own; a random checkpoint (the test fixture) needs
    `talker_max_new_tokens` set, its talker rarely emitting an eos."""
    processor = load_processor(Path(model_dir))
    tokenizer: Any = processor.tokenizer
    model: Any = load_model(model_dir, dtype)  # Any: its methods are replaced below
    turns = messages if messages is not None else one_turn(prompt, len(audios), len(images), len(videos))
    inputs = reference_inputs(processor, turns, audios, images, videos).to(model.device)
    input_ids = inputs["input_ids"]

    talker_codes: list[torch.Tensor] = []
    talker_generate = model.talker.generate

    def recording_talker_generate(*args: Any, **kwargs: Any) -> Any:
        result = talker_generate(*args, **kwargs)
        talker_codes.append(_first_codes(result, kwargs["input_ids"].shape[1]))
        return result

    # Instance attributes shadow the class's methods for this model object only.
    model.thinker.generate = _reseeded(model.thinker.generate, seed)
    model.talker.generate = _reseeded(recording_talker_generate, seed)
    model.token2wav.forward = _reseeded(model.token2wav.forward, seed)

    # Image and video pixels go to the thinker only: unprefixed, generate passes them to the talker too,
    # whose generate refuses them (transformers 5.24); the grid stays shared (both use it).
    model_inputs = dict(inputs)
    for pixels in ("pixel_values", "pixel_values_videos"):
        if pixels in model_inputs:
            model_inputs[f"thinker_{pixels}"] = model_inputs.pop(pixels)
    sequences, waveform = model.generate(
        **model_inputs,
        generation_mode="audio",
        speaker=speaker,
        thinker_do_sample=thinker_do_sample,
        talker_do_sample=talker_do_sample,
        thinker_max_new_tokens=thinker_max_new_tokens,
        talker_max_new_tokens=talker_max_new_tokens,
    )
    text_ids = sequences[0, input_ids.shape[1] :].cpu()
    text = tokenizer.decode(text_ids.tolist(), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence in, one string out
    return ReferenceResult(
        text_ids=text_ids, codes=talker_codes[0], waveform=waveform.reshape(-1).float().cpu(), text=text
    )

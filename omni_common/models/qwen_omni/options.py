"""Qwen2.5-Omni's request options and audio constants: what the family card declares and the
runners read. Its own module so that runners and the family import it, not each other."""

from __future__ import annotations

from omni_common.models.base import GenerationRequest, OptionSpec

SAMPLE_RATE = 24_000
DEFAULT_SPEAKER = "Chelsie"

OPTIONS = (
    OptionSpec("speaker", "str", DEFAULT_SPEAKER, 0, 0, "the voice: a name in the model's spk_dict.pt"),
    OptionSpec("audio", "int", "1", 0, 1, "1: speak the reply; 0: write it only"),
    OptionSpec(
        "stream_audio",
        "int",
        "1",
        0,
        1,
        "1: audio in chunks as the talker speaks (windows of 3 DiT blocks); "
        "0: one chunk at the end, equal to transformers' generate",
    ),
    OptionSpec("max_new_tokens", "int", "1024", 1, 8192, "the most tokens the thinker writes"),
    OptionSpec("talker_max_new_tokens", "int", "4096", 1, 8192, "the most codec tokens the talker says"),
    OptionSpec("thinker_do_sample", "int", "0", 0, 1, "1: the thinker samples (seeded); 0: greedy"),
    OptionSpec("talker_do_sample", "int", "1", 0, 1, "1: the talker samples (seeded), as generate does"),
    OptionSpec(
        "feed_tokens",
        "int",
        "8",
        1,
        256,
        "thinker tokens per chunk of hidden states to the talker (the first goes alone, at once)",
    ),
)


def option_int(request: GenerationRequest, name: str) -> int:
    spec = next(spec for spec in OPTIONS if spec.name == name)
    return int(request.option(name, spec.default))


def speaker_of(request: GenerationRequest) -> str:
    return request.option("speaker", DEFAULT_SPEAKER)

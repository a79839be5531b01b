"""Reading a Qwen2.5-Omni checkpoint (transformers' layout: config.json, model*.safetensors with
thinker./talker./token2wav. keys, the tokenizer, spk_dict.pt) part by part: each stage loads
only the sub-model its roles run, never the whole model."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2_5OmniConfig

from omni_common.errors import InvalidArgument
from omni_common.models.weights import for_inference, random_weights_seed, seeded_build

SPEAKERS_FILE = "spk_dict.pt"


def load_config(model_dir: Path) -> Qwen2_5OmniConfig:
    return Qwen2_5OmniConfig.from_pretrained(model_dir)


def load_part(
    cls: Any, config: Any, model_dir: Path, prefix: str, device: torch.device, dtype: torch.dtype
) -> Any:
    """Sub-model `cls` built from `config` with the checkpoint's `prefix.` weights, in `dtype` on
    `device`, eval mode, SDPA attention. A random-weights directory (random_model.py) gets
    seeded weights built in place on `device` (the same in every process).

    transformers' own loading reads them: `key_mapping` drops the part's prefix, and its own
    per-release renames apply after (5.21 moved the thinker's audio tower under `.model`), so a
    checkpoint in the published layout loads whatever the installed release's module layout is.
    The other parts' weights are left unread. Strict all the same: a weight of this part that the
    model lacks, or one the model needs that the checkpoint lacks, is an error."""
    if random_weights_seed(model_dir) is not None:
        return build_random(cls, config, model_dir, prefix, device, dtype)
    with _quiet_transformers():
        model, info = cls.from_pretrained(
            model_dir,
            config=config,
            dtype=dtype,
            attn_implementation="sdpa",
            key_mapping={rf"^{prefix}\.": ""},
            output_loading_info=True,
        )
    missing = sorted(info["missing_keys"])
    # Keys of the other parts are expected here; a key of this part that found no home is not.
    unexpected = sorted(key for key in info["unexpected_keys"] if not _other_part(key, prefix))
    mismatched = sorted(str(key) for key in info.get("mismatched_keys") or ())
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{model_dir.name}: the checkpoint's {prefix} weights do not fit its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, mismatched {mismatched[:3]})"
        )
    module: torch.nn.Module = model
    return for_inference(module.to(device=device, dtype=dtype))


def build_random(
    cls: Any, config: Any, model_dir: Path, prefix: str, device: torch.device, dtype: torch.dtype
) -> Any:
    """`cls` with seeded random weights (per `prefix`), built on `device` in `dtype`."""
    seed = random_weights_seed(model_dir)
    assert seed is not None
    with seeded_build(seed, prefix, device, dtype):
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return for_inference(model)


PARTS = ("thinker", "talker", "token2wav")


def _other_part(key: str, prefix: str) -> bool:
    """Whether checkpoint key `key` (as reported, prefix kept or not) belongs to another part."""
    return any(key.startswith(part + ".") for part in PARTS if part != prefix)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' load report lists every weight of the other parts as UNEXPECTED (a screenful
    per stage start); `load_part` checks the keys itself, so the report is held back."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_speakers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """spk_dict.pt: per speaker, its `cond` vector, `ref_mel` and the thinker's `bos_token`."""
    speakers: dict[str, dict[str, Any]] = torch.load(model_dir / SPEAKERS_FILE, weights_only=True)
    return speakers


def speaker(speakers: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The speaker called `name`; INVALID_ARGUMENT for one the model does not have."""
    found = speakers.get(name)
    if found is None:
        raise InvalidArgument(f"unknown speaker {name[:50]!r}; this model has {', '.join(sorted(speakers))}")
    return found


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def chat_input_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.Tensor:
    """`prompt` as one user turn of the tokenizer's chat template, with the assistant's generation
    prompt: LongTensor [1, L]."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return torch.tensor([list(ids)], dtype=torch.long)

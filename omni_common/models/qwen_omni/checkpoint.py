"""Reading a Qwen2.5-Omni checkpoint (transformers' layout: config.json, model*.safetensors with
thinker./talker./token2wav. keys, the tokenizer, spk_dict.pt) part by part: each stage loads
only the sub-model its roles run, never the whole model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2_5OmniConfig

from omni_common.errors import InvalidArgument
from omni_common.models.weights import random_weights_seed, seeded_build

SPEAKERS_FILE = "spk_dict.pt"


def load_config(model_dir: Path) -> Qwen2_5OmniConfig:
    return Qwen2_5OmniConfig.from_pretrained(model_dir)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    return [model_dir / "model.safetensors"]


def load_part(
    cls: Any, config: Any, model_dir: Path, prefix: str, device: torch.device, dtype: torch.dtype
) -> Any:
    """Sub-model `cls` built from `config` with the checkpoint's `prefix.` weights, in `dtype` on
    `device`, eval mode, SDPA attention. A random-weights directory (random_model.py) gets
    seeded weights built in place on `device` (the same in every process)."""
    if random_weights_seed(model_dir) is not None:
        return build_random(cls, config, model_dir, prefix, device, dtype)
    model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.startswith(prefix + "."):
                    state[key[len(prefix) + 1 :]] = weights.get_tensor(key)
    state = _renamed(state, set(model.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir.name}: the checkpoint's {prefix} weights do not fit its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    module: torch.nn.Module = model
    return module.to(device=device, dtype=dtype).eval()


def _renamed(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """`state` with each key the model does not have renamed to the one it has under a
    sub-module prefix: transformers 5.21 moved the thinker's towers and text model under
    `.model` (checkpoints keep `audio_tower.*` and `model.layers.*`, the module wants
    `model.audio_tower.*` and `model.language_model.layers.*`)."""
    renamed = {}
    for key, tensor in state.items():
        if key not in expected:
            inner = key.removeprefix("model.")
            candidates = [f"model.{key}", f"model.language_model.{inner}"]
            key = next((name for name in candidates if name in expected), key)
        renamed[key] = tensor
    return renamed


def build_random(
    cls: Any, config: Any, model_dir: Path, prefix: str, device: torch.device, dtype: torch.dtype
) -> Any:
    """`cls` with seeded random weights (per `prefix`), built on `device` in `dtype`."""
    seed = random_weights_seed(model_dir)
    assert seed is not None
    with seeded_build(seed, prefix, device, dtype):
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


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

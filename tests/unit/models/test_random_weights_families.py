"""`omnistage fixture --family glm-image|qwen2.5-omni --random-weights tiny|full`: directories of
configs (no weights) whose loaders build the same seeded weights in every process, at the real
sizes with `full`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen2_5OmniForConditionalGeneration

from omni_common.models.glm_image.prior import GlmImagePrior
from omni_common.models.glm_image.random_model import write_random_model as write_glm
from omni_common.models.qwen_omni.random_model import write_random_model as write_omni
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.models.weights import random_weights_seed

CPU = torch.device("cpu")


def digest(module: torch.nn.Module) -> str:
    found = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        found.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def test_full_size_directories_hold_the_real_configs_and_no_weights(tmp_path: Path) -> None:
    glm = write_glm(tmp_path / "glm", full_size=True, seed=5)
    omni = write_omni(tmp_path / "omni", full_size=True, seed=5)
    for model_dir in (glm, omni):
        assert random_weights_seed(model_dir) == 5
        assert not list(model_dir.rglob("*.safetensors"))
    text = json.loads((glm / "vision_language_encoder" / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (4096, 40, 168064)
    transformer = json.loads((glm / "transformer" / "config.json").read_text())
    assert transformer["num_layers"] == 30
    # The AR's head samples exactly the codes the DiT's prior embedding takes.
    assert text["vision_vocab_size"] == transformer["prior_vq_quantizer_codebook_size"] == 16384
    omni_config = json.loads((omni / "config.json").read_text())
    thinker = omni_config["thinker_config"]["text_config"]
    # token2wav embeds every code the random talker can draw
    assert (
        omni_config["token2wav_config"]["dit_config"]["num_embeds"]
        == omni_config["talker_config"]["vocab_size"]
    )
    assert (thinker["hidden_size"], thinker["num_hidden_layers"], thinker["vocab_size"]) == (3584, 28, 152064)


def test_the_full_size_omni_has_qwen2_5_omni_7b_parts(tmp_path: Path) -> None:
    """The published sizes (10.7 B in all), built on the meta device: transformers' defaults
    alone make the talker 6.6 B and the vision tower 3.1 B."""
    config = AutoConfig.from_pretrained(write_omni(tmp_path / "omni", full_size=True))
    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(config)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def billions(module: torch.nn.Module) -> float:
        return round(count(module) / 1e9, 2)

    thinker = model.thinker  # its towers sit under .model from transformers 5.21, beside it before
    towers = {name.rsplit(".", 1)[-1]: part for name, part in thinker.named_modules()}
    audio, visual = towers["audio_tower"], towers["visual"]
    language = count(thinker) - count(audio) - count(visual) - count(thinker.lm_head)
    assert round(language / 1e9, 2) == 7.07
    assert (billions(audio), billions(visual)) == (0.64, 0.68)
    assert (billions(model.talker), billions(model.token2wav)) == (1.35, 0.45)
    assert billions(model) == 10.73


@pytest.mark.parametrize("family", ["glm-image", "qwen2.5-omni"])
def test_tiny_random_directories_load_the_same_seeded_weights_each_time(tmp_path: Path, family: str) -> None:
    if family == "glm-image":
        model_dir = write_glm(tmp_path / "glm", full_size=False, seed=1)

        def load() -> torch.nn.Module:
            return GlmImagePrior.load(model_dir, CPU, torch.float32, max_slots=2).model
    else:
        model_dir = write_omni(tmp_path / "omni", full_size=False, seed=1)

        def load() -> torch.nn.Module:
            return Thinker.load(model_dir, CPU, torch.float32, max_slots=2).model

    assert not list(model_dir.rglob("*.safetensors"))
    assert digest(load()) == digest(load())

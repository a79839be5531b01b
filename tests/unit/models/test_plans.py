"""A family's plan is checked when it is made, and each family's plan reads as its pipeline."""

from __future__ import annotations

import pytest

from omni_common.input_media import ImageInput
from omni_common.models.base import GenerationRequest, Plan, PlanStep
from omni_common.models.glm_image import GlmImageFamily
from omni_common.models.qwenimage import QwenImageFamily

IMAGE = ImageInput(64, 64, "PNG", "ab" * 32)


def test_a_plan_must_consume_only_what_earlier_steps_or_the_request_give() -> None:
    with pytest.raises(ValueError, match="no earlier step produces"):
        Plan((PlanStep("denoise", "dit-denoise", "denoise", consumes=("prompt_embeds",)),))
    with pytest.raises(ValueError, match="unknown stage"):
        Plan((PlanStep("x", "gpu-stage", "x"),))
    with pytest.raises(ValueError, match="twice"):
        Plan((PlanStep("a", "ar-encoder", "r", produces=("t",)), PlanStep("a", "ar-encoder", "r")))
    with pytest.raises(ValueError, match="again"):
        Plan(
            (
                PlanStep("a", "ar-encoder", "r", produces=("t",)),
                PlanStep("b", "ar-encoder", "r", produces=("t",)),
            )
        )
    plan = Plan((PlanStep("a", "vae-decode", "vae-encode", consumes=("input.image.0",), produces=("z",)),))
    assert (
        plan.result.name == "a"
        and plan.producer("z") is plan.steps[0]
        and plan.producer("input.image.0") is None
    )


def test_qwen_image_plan_is_encode_denoise_decode_with_the_negative_prompt_only_under_true_cfg() -> None:
    family = QwenImageFamily()
    plain = family.plan(GenerationRequest(prompt="a cat", true_cfg_scale=4.0))
    assert [(s.name, s.stage, s.role) for s in plain.steps] == [
        ("encode", "ar-encoder", "text-encoder"),
        ("denoise", "dit-denoise", "denoise"),
        ("decode", "vae-decode", "vae-decode"),
    ]
    assert plain.steps[1].consumes == ("prompt_embeds",) and plain.steps[1].resumable
    cfg = family.plan(GenerationRequest(prompt="a cat", negative_prompt="blurry", true_cfg_scale=4.0))
    assert cfg.steps[1].consumes == ("prompt_embeds", "negative_prompt_embeds")


def test_glm_image_edit_plan_adds_vae_encode_and_a_condition_kv_keyed_by_the_images() -> None:
    family = GlmImageFamily()
    t2i = family.plan(GenerationRequest(prompt="a cat", width=64, height=64, true_cfg_scale=1.5))
    assert [s.name for s in t2i.steps] == ["prior", "glyph", "denoise", "decode"]
    assert t2i.steps[0].progress == "tokens" and not t2i.steps[0].consumes
    edit = family.plan(GenerationRequest(prompt="make it red", width=64, height=64, images=(IMAGE, IMAGE)))
    assert [s.name for s in edit.steps] == [
        "prior",
        "glyph",
        "vae-encode",
        "condition-kv",
        "denoise",
        "decode",
    ]
    kv = edit.steps[3]
    assert kv.cache_key == f"{IMAGE.digest},{IMAGE.digest}"
    assert set(kv.consumes) == {
        "condition_latents.0",
        "condition_latents.1",
        "prior_token_image_ids",
        "source_image_grid_thw",
    }
    assert {"condition_kv.k", "condition_kv.v"} <= set(edit.steps[4].consumes)
    assert edit.steps[0].consumes == ("input.image.0", "input.image.1")
    assert [s.name for s in edit.consumers(kv)] == ["denoise"]

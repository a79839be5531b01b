"""Parameter validation: defaults, ranges, and messages a person can act on."""

from __future__ import annotations

import math
import re

import pytest

from omni_common.errors import InvalidArgument, ResourceExhausted
from omni_common.models.validation import check_request_id, check_takes_loras, to_request, with_defaults
from omnistage.v1 import stage_pb2


def params(**fields: object) -> stage_pb2.GenerationParams:
    return with_defaults(stage_pb2.GenerationParams(prompt="p", **fields))  # type: ignore[arg-type]


def test_unset_fields_take_documented_defaults() -> None:
    request = to_request(params())
    assert (request.width, request.height, request.num_inference_steps) == (1024, 1024, 50)
    assert request.true_cfg_scale == 4.0 and request.max_sequence_length == 512


def test_explicit_zero_is_not_a_default() -> None:
    with pytest.raises(InvalidArgument, match="num_inference_steps is 0"):
        to_request(params(num_inference_steps=0))
    assert to_request(params(true_cfg_scale=0.0)).true_cfg_scale == 0.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"width": 72}, "width is 72; it must be a multiple of 16"),
        ({"height": 8}, "height is 8; it must be in [16, 4096]"),
        ({"num_inference_steps": 1001}, "num_inference_steps is 1001"),
        ({"true_cfg_scale": math.nan}, "true_cfg_scale is nan"),
        ({"true_cfg_scale": -1.0}, "true_cfg_scale is -1.0"),
        ({"max_sequence_length": 5000}, "max_sequence_length is 5000"),
        ({"prompt": "x" * 10_001}, "prompt has 10001 characters"),
        ({"negative_prompt": "x" * 10_001}, "negative_prompt has 10001 characters"),
    ],
)
def test_out_of_range_fields_name_the_field_and_range(fields: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        to_request(with_defaults(stage_pb2.GenerationParams(**{"prompt": "p", **fields})))
    assert message in caught.value.message


def test_too_many_pixels_is_resource_exhausted() -> None:
    with pytest.raises(ResourceExhausted, match="4096x4096"):
        to_request(params(width=4096, height=4096))
    assert to_request(params(width=4096, height=4096), max_pixels=4096 * 4096).width == 4096


def test_cfg_needs_scale_and_negative_prompt() -> None:
    assert not to_request(params(true_cfg_scale=4.0)).do_true_cfg
    assert to_request(params(true_cfg_scale=4.0, negative_prompt=" ")).do_true_cfg
    assert not to_request(params(true_cfg_scale=1.0, negative_prompt="x")).do_true_cfg


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 129, "id with space", "../etc"])
def test_request_ids_are_restricted(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_request_id(bad)


def test_loras_keep_their_order_and_unset_scales() -> None:
    refs = [stage_pb2.LoraRef(name="ink", scale=0.5), stage_pb2.LoraRef(name="water.color-2")]
    assert to_request(params(loras=refs)).loras == (("ink", 0.5), ("water.color-2", None))


@pytest.mark.parametrize(
    ("refs", "message"),
    [
        ([stage_pb2.LoraRef(name=f"a{i}") for i in range(9)], "9 LoRA adapters named; the limit is 8"),
        ([stage_pb2.LoraRef(name="../x")], "LoRA name '../x' is invalid"),
        ([stage_pb2.LoraRef(name="")], "LoRA name '' is invalid"),
        ([stage_pb2.LoraRef(name="a"), stage_pb2.LoraRef(name="a")], "'a' is named twice"),
        ([stage_pb2.LoraRef(name="a", scale=math.inf)], "LoRA scale of 'a' is inf"),
        ([stage_pb2.LoraRef(name="a", scale=101.0)], "LoRA scale of 'a' is 101.0"),
    ],
)
def test_bad_loras_are_refused(refs: list[stage_pb2.LoraRef], message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        to_request(params(loras=refs))


def test_loras_for_a_family_without_them_are_refused() -> None:
    from omni_common.models.glm_image.family import GlmImageFamily
    from omni_common.models.qwenimage.family import QwenImageFamily

    request = to_request(params(loras=[stage_pb2.LoraRef(name="a")]))
    check_takes_loras(request, QwenImageFamily.card, "qwenimage")
    with pytest.raises(InvalidArgument, match="glm-image models take no LoRA adapters"):
        check_takes_loras(request, GlmImageFamily.card, "glm-image")

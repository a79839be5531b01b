"""A model directory's own defaults (omnistage.json): read, checked, and laid over its family's."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_common.errors import InvalidArgument
from omni_common.models.model_defaults import (
    DEFAULTS_FILE,
    ModelDefaults,
    read_model_defaults,
    write_model_defaults,
)
from omni_common.models.qwen_omni.family import QwenOmniFamily
from omni_common.models.qwenimage.family import QwenImageFamily
from omni_common.models.validation import defaults_for, option_defaults_for, with_defaults
from omnistage.v1 import stage_pb2

REPO = Path(__file__).resolve().parents[3]
OMNI = QwenOmniFamily()
QWEN = QwenImageFamily()


def test_a_directory_without_the_file_has_no_defaults_of_its_own(tmp_path: Path) -> None:
    assert read_model_defaults(tmp_path, QWEN.card, QWEN.name) == ModelDefaults()


def test_the_digits_model_carries_its_own_size_steps_and_guidance() -> None:
    own = read_model_defaults(REPO / "models" / "qwen-image-digits", QWEN.card, QWEN.name)
    assert dict(own.fields) == {"width": 32, "height": 32, "num_inference_steps": 20, "true_cfg_scale": 1}
    merged = defaults_for(QWEN.card, own.fields)
    assert merged["width"] == 32 and merged["max_sequence_length"] == 512  # the rest: omnistage's


def test_written_defaults_read_back_and_options_override_the_familys(tmp_path: Path) -> None:
    write_model_defaults(tmp_path, ModelDefaults({"num_inference_steps": 4}, {"max_new_tokens": "16"}))
    own = read_model_defaults(tmp_path, OMNI.card, OMNI.name)
    assert own == ModelDefaults({"num_inference_steps": 4.0}, {"max_new_tokens": "16"})
    options = option_defaults_for(OMNI.card, own.options)
    assert options["max_new_tokens"] == "16" and options["talker_max_new_tokens"] == "4096"


def test_unset_fields_and_options_take_the_models_defaults_and_given_ones_stay() -> None:
    params = stage_pb2.GenerationParams(prompt="p", width=64, options={"audio": "0"})
    filled = with_defaults(
        params, defaults_for(QWEN.card, {"width": 32, "height": 32}), {"audio": "1", "x": "2"}
    )
    assert (filled.width, filled.height, filled.num_inference_steps) == (64, 32, 50)
    assert dict(filled.options) == {"audio": "0", "x": "2"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "an object"),
        ('{"defaults": {"wdth": 32}}', "'wdth' is no request field"),
        ('{"defaults": {"width": "32"}}', "defaults.width must be a finite number"),
        ('{"defaults": {"width": true}}', "defaults.width must be a finite number"),
        ('{"options": {"max_new_tokens": 0}}', "max_new_tokens is 0; it must be in [1, 8192]"),
        ('{"options": {"volume": "3"}}', "has no option 'volume'"),
        ('{"extra": 1}', "'defaults' and 'options' only"),
    ],
)
def test_a_bad_file_is_refused_with_a_message_that_names_the_field(
    tmp_path: Path, doc: str, message: str
) -> None:
    (tmp_path / DEFAULTS_FILE).write_text(doc)
    with pytest.raises(InvalidArgument) as err:
        read_model_defaults(tmp_path, OMNI.card, OMNI.name)
    assert message in err.value.message


def test_the_fixtures_defaults_pass_their_familys_checks(tmp_path: Path) -> None:
    from omni_common.models.glm_image.family import GlmImageFamily
    from omni_common.models.glm_image.fixture import FIXTURE_DEFAULTS as GLM_FIXTURE
    from omni_common.models.qwen_omni.fixture import FIXTURE_DEFAULTS as OMNI_FIXTURE

    glm = GlmImageFamily()
    for family, defaults in ((glm, GLM_FIXTURE), (OMNI, OMNI_FIXTURE)):
        directory = tmp_path / family.name
        directory.mkdir()
        write_model_defaults(directory, defaults)
        assert read_model_defaults(directory, family.card, family.name) == defaults
    assert GLM_FIXTURE.fields["width"] % glm.card.size_multiple == 0

"""Model families are found by name and by a diffusers directory's pipeline class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.base import GenerationRequest
from omni_common.models.registry import (
    FAMILIES_ENV,
    family_for_model_dir,
    family_names,
    fixture_maker,
    get_family,
    model_name_for_dir,
)
from omnistage_cli.main import main


def test_get_family_by_name() -> None:
    assert get_family("qwenimage").name == "qwenimage"
    with pytest.raises(NotFound, match="unknown model family"):
        get_family("nope")


def test_family_for_a_qwen_image_directory(tiny_model: Path) -> None:
    assert family_for_model_dir(tiny_model).name == "qwenimage"
    assert model_name_for_dir(tiny_model) == "qwen-image-tiny"


def test_unknown_or_missing_pipeline_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"model_index\.json"):
        family_for_model_dir(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(NotFound, match="FluxPipeline"):
        family_for_model_dir(tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(InvalidArgument):
        family_for_model_dir(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [{"width": 72}, {"height": 40}, {"max_sequence_length": 1025}],
)
def test_validate_rejects_what_the_patch_grid_and_tokenizer_cannot_take(fields: dict) -> None:
    with pytest.raises(InvalidArgument):
        get_family("qwenimage").validate(GenerationRequest(prompt="x", **fields))


def test_validate_accepts_a_plain_request() -> None:
    get_family("qwenimage").validate(GenerationRequest(prompt="x", width=64, height=48))


def test_a_family_outside_omnistage_is_registered_by_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.families.chime.model import build_tiny_fixture

    assert "chime" not in family_names()
    monkeypatch.setenv(FAMILIES_ENV, "tests.families.chime:ENTRY")
    assert get_family("chime").name == "chime"
    assert family_for_model_dir(build_tiny_fixture(tmp_path / "chime-tiny")).name == "chime"
    assert family_names() == sorted(["qwenimage", "glm-image", "qwen2.5-omni", "chime"])


def test_omnistage_fixture_builds_any_registered_family_from_its_registry_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FAMILIES_ENV, "tests.families.chime:ENTRY")
    assert main(["fixture", "--family", "chime", str(tmp_path / "chime-tiny"), "--seed", "2"]) == 0
    assert family_for_model_dir(tmp_path / "chime-tiny").name == "chime"
    assert main(["fixture", "--family", "glm-image", "--head-dim", "32", str(tmp_path / "glm")]) == 2
    assert "--head-dim does not apply to glm-image" in capsys.readouterr().err
    assert not (tmp_path / "glm").exists()
    monkeypatch.delenv(FAMILIES_ENV)
    with pytest.raises(NotFound, match="no offline fixture for model family 'chime'"):
        fixture_maker("chime")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("tests.families.nope:ENTRY", "cannot be imported"),
        ("tests.families.chime.options:OPTIONS", "not a FamilyEntry"),
        ("tests.families.chime:ENTRY,tests.families.chime:ENTRY", "chime registered twice"),
    ],
)
def test_a_bad_registration_says_what_is_wrong(
    monkeypatch: pytest.MonkeyPatch, value: str, error: str
) -> None:
    monkeypatch.setenv(FAMILIES_ENV, value)
    with pytest.raises(ValueError, match=error):
        get_family("chime")

"""Model families by name, and which family serves a diffusers model directory. Importing a
family imports only its family.py (light: roles, plan, validation); runners load with a stage."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.base import ModelFamily


def _qwenimage() -> ModelFamily:
    from omni_common.models.qwenimage.family import QwenImageFamily

    return QwenImageFamily()


def _glm_image() -> ModelFamily:
    from omni_common.models.glm_image.family import GlmImageFamily

    return GlmImageFamily()


def _qwen_omni() -> ModelFamily:
    from omni_common.models.qwen_omni.family import QwenOmniFamily

    return QwenOmniFamily()


# name -> factory; imports stay lazy so a service only imports the family it serves.
_FAMILIES: dict[str, Callable[[], ModelFamily]] = {
    "qwenimage": _qwenimage,
    "glm-image": _glm_image,
    "qwen2.5-omni": _qwen_omni,
}
# diffusers pipeline class (model_index.json "_class_name") -> family name
_PIPELINE_CLASSES = {"QwenImagePipeline": "qwenimage", "GlmImagePipeline": "glm-image"}
# transformers model type (config.json "model_type") of a directory without model_index.json
_MODEL_TYPES = {"qwen2_5_omni": "qwen2.5-omni"}


def family_names() -> list[str]:
    """The registered family names, sorted."""
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family registered under `name`; NotFound for an unknown name."""
    family = find_family(name)
    if family is None:
        raise NotFound(f"unknown model family {name[:50]!r}; known: {', '.join(family_names())}")
    return family


@functools.cache
def find_family(name: str) -> ModelFamily | None:
    """The family registered under `name` (one instance per process), None for an unknown name."""
    factory = _FAMILIES.get(name)
    return factory() if factory is not None else None


def family_for_model_dir(model_dir: Path) -> ModelFamily:
    """The family of a model directory: a diffusers pipeline's model_index.json `_class_name`, or
    a transformers model's config.json `model_type`."""
    index = Path(model_dir) / "model_index.json"
    config = Path(model_dir) / "config.json"
    if not index.is_file() and config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (ValueError, AttributeError) as exc:
            raise InvalidArgument(
                f"model {model_name_for_dir(model_dir)!r}: config.json is not valid"
            ) from exc
        if model_type in _MODEL_TYPES:
            return get_family(_MODEL_TYPES[model_type])
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except FileNotFoundError as exc:
        raise NotFound(
            f"model {model_name_for_dir(model_dir)!r} has no model_index.json: "
            "expected a diffusers pipeline directory"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            f"model {model_name_for_dir(model_dir)!r}: model_index.json lacks a valid _class_name"
        ) from exc
    name = _PIPELINE_CLASSES.get(class_name)
    if name is None:
        raise NotFound(
            f"model {model_name_for_dir(model_dir)!r} is a {class_name}, which no model family "
            f"serves; supported: {', '.join(sorted(_PIPELINE_CLASSES))}"
        )
    return get_family(name)


def model_name_for_dir(model_dir: Path) -> str:
    """The name a model is served under: its directory's basename."""
    return Path(model_dir).resolve().name

"""Model families by name, and which family serves a model directory.

One table, `FAMILIES`, holds a line per family: its name, where its family class lives (imported
when a process first asks for it, so a service imports only the family it serves, and then only
its light family.py; runners load with a stage) and the model directories it serves. A family
outside omnistage (a plugin's, a test's) is registered with the same line in a module of its own,
named by the `OMNISTAGE_FAMILIES` environment variable: every process of a cluster inherits it."""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.base import ModelFamily


@dataclass(frozen=True)
class FamilyEntry:
    """One registered family: its name, its family class as "module:Class", the model
    directories it serves (diffusers pipeline classes, model_index.json `_class_name`, and
    transformers model types, config.json `model_type`, read where there is no
    model_index.json) and, as "module:function", how `omnistage fixture` builds one offline:
    `make(out, *, random_weights, seed, **options) -> Path`, random_weights None (a tiny model
    with its weights), "tiny" or "full" (configs only, seeded weights built where it loads)."""

    name: str
    family: str
    pipeline_classes: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    fixture: str = ""


FAMILIES = (
    FamilyEntry(
        "qwenimage",
        "omni_common.models.qwenimage.family:QwenImageFamily",
        ("QwenImagePipeline",),
        fixture="omni_common.models.qwenimage.random_model:make_fixture",
    ),
    FamilyEntry(
        "glm-image",
        "omni_common.models.glm_image.family:GlmImageFamily",
        ("GlmImagePipeline",),
        fixture="omni_common.models.glm_image.random_model:make_fixture",
    ),
    FamilyEntry(
        "qwen2.5-omni",
        "omni_common.models.qwen_omni.family:QwenOmniFamily",
        model_types=("qwen2_5_omni",),
        fixture="omni_common.models.qwen_omni.random_model:make_fixture",
    ),
)
# Families registered from outside: comma-separated "module:attribute" references, each to a
# FamilyEntry, e.g. OMNISTAGE_FAMILIES=my_plugin.family:ENTRY.
FAMILIES_ENV = "OMNISTAGE_FAMILIES"


def registered() -> tuple[FamilyEntry, ...]:
    """The built-in families, then those OMNISTAGE_FAMILIES names (read on each call)."""
    return _entries(os.environ.get(FAMILIES_ENV, ""))


@functools.cache
def _entries(extra: str) -> tuple[FamilyEntry, ...]:
    entries = FAMILIES + tuple(_entry(ref.strip()) for ref in extra.split(",") if ref.strip())
    # A name, pipeline class or model type claimed twice would make the choice depend on order.
    for claims in (
        [entry.name for entry in entries],
        [c for entry in entries for c in entry.pipeline_classes],
        [t for entry in entries for t in entry.model_types],
    ):
        twice = sorted({claim for claim in claims if claims.count(claim) > 1})
        if twice:
            raise ValueError(f"{FAMILIES_ENV}: {', '.join(twice)} registered twice")
    return entries


def _resolve(ref: str) -> object:
    """The object a "module:attribute" reference names."""
    module, _, attribute = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"model family {ref!r} cannot be imported: {exc}") from exc


def _entry(ref: str) -> FamilyEntry:
    entry = _resolve(ref)
    if not isinstance(entry, FamilyEntry):
        raise ValueError(f"{FAMILIES_ENV}: {ref!r} is not a FamilyEntry")
    return entry


def family_names() -> list[str]:
    """The registered family names, sorted."""
    return sorted(entry.name for entry in registered())


def get_family(name: str) -> ModelFamily:
    """The family registered under `name`; NotFound for an unknown name."""
    family = find_family(name)
    if family is None:
        raise NotFound(f"unknown model family {name[:50]!r}; known: {', '.join(family_names())}")
    return family


def find_family(name: str) -> ModelFamily | None:
    """The family registered under `name` (one instance per process), None for an unknown name."""
    entry = next((entry for entry in registered() if entry.name == name), None)
    return _instance(entry) if entry is not None else None


def fixture_maker(name: str) -> Callable[..., Path]:
    """How the family registered under `name` builds a model directory offline (FamilyEntry.
    fixture); NotFound for an unknown family or one that registered none."""
    entry = next((entry for entry in registered() if entry.name == name), None)
    if entry is None or not entry.fixture:
        known = ", ".join(e.name for e in registered() if e.fixture)
        raise NotFound(f"no offline fixture for model family {name[:50]!r}; families with one: {known}")
    make = _resolve(entry.fixture)
    if not callable(make):
        raise ValueError(f"fixture {entry.fixture!r} of model family {name!r} is not a function")
    return make


@functools.cache
def _instance(entry: FamilyEntry) -> ModelFamily:
    factory = _resolve(entry.family)
    if not callable(factory):
        raise ValueError(f"model family {entry.family!r} is not a class")
    family: ModelFamily = factory()
    if family.name != entry.name:
        raise ValueError(
            f"model family {entry.family!r} is named {family.name!r}, registered as {entry.name!r}"
        )
    return family


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
        entry = next((entry for entry in registered() if model_type in entry.model_types), None)
        if entry is not None:
            return _instance(entry)
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
    entry = next((entry for entry in registered() if class_name in entry.pipeline_classes), None)
    if entry is None:
        supported = sorted(c for entry in registered() for c in entry.pipeline_classes)
        raise NotFound(
            f"model {model_name_for_dir(model_dir)!r} is a {class_name}, which no model family "
            f"serves; supported: {', '.join(supported)}"
        )
    return _instance(entry)


def model_name_for_dir(model_dir: Path) -> str:
    """The name a model is served under: its directory's basename."""
    return Path(model_dir).resolve().name

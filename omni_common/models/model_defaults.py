"""A model directory's own defaults: `omnistage.json` beside its weights.

A family's card says what its models take; a model of it may want other defaults (the 32x32
digits model answers 1024x1024 with noise; a random tiny Omni fixture talks until its token
limits, a minute of audio). The file carries them:

    {"defaults": {"width": 32, "height": 32, "num_inference_steps": 20, "true_cfg_scale": 1},
     "options": {"max_new_tokens": "16"}}

Each stage reads it at start (a bad file stops the stage with a message that names the
field) and sends it in its StageInfo; the coordinator fills a request's unset fields with
it before the family's defaults, and ListModels shows the result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omni_common.errors import InvalidArgument
from omni_common.models.base import ModelCard
from omni_common.models.validation import DEFAULTS, check_options

DEFAULTS_FILE = "omnistage.json"


@dataclass(frozen=True)
class ModelDefaults:
    """Defaults of optional GenerationParams fields and of family options, for one model."""

    fields: Mapping[str, float] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)


def read_model_defaults(model_dir: Path, card: ModelCard, family: str) -> ModelDefaults:
    """The defaults in `model_dir/omnistage.json` (none without the file), checked against
    omnistage's field names and the family's options; InvalidArgument names what is wrong."""
    path = Path(model_dir) / DEFAULTS_FILE
    if not path.is_file():
        return ModelDefaults()
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidArgument(f"{DEFAULTS_FILE} of the model is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"defaults", "options"}:
        raise InvalidArgument(f"{DEFAULTS_FILE} takes an object with 'defaults' and 'options' only")
    fields = doc.get("defaults") or {}
    options = doc.get("options") or {}
    if not isinstance(fields, dict) or not isinstance(options, dict):
        raise InvalidArgument(f"{DEFAULTS_FILE}: 'defaults' and 'options' must be objects")
    for name, value in fields.items():
        if name not in DEFAULTS:
            raise InvalidArgument(
                f"{DEFAULTS_FILE}: {name!r} is no request field with a default; known: {', '.join(DEFAULTS)}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidArgument(f"{DEFAULTS_FILE}: defaults.{name} must be a finite number")
    texts = {name: value if isinstance(value, str) else json.dumps(value) for name, value in options.items()}
    check_options(texts, card.options, family)
    return ModelDefaults({k: float(v) for k, v in fields.items()}, texts)


def write_model_defaults(model_dir: Path, defaults: ModelDefaults) -> Path:
    """Write `defaults` as `model_dir/omnistage.json` (the fixtures' builders use it)."""
    path = Path(model_dir) / DEFAULTS_FILE
    doc = {"defaults": dict(defaults.fields), "options": dict(defaults.options)}
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path

"""omni_common/stages.py is the one table of stage types and batching defaults: no other
source file spells the list of stages or the default batch size again."""

from __future__ import annotations

import re
from pathlib import Path

from omni_common.models.module_layout import MODULE_ROLES
from omni_common.stages import STAGE_MODULE_ROLES, STAGES

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("omni_common", "services", "omnistage", "benchmarks")
STAGE_LIST = re.compile(r'"ar-encoder",\s*"dit-denoise",\s*"vae-decode"')
BATCH_DEFAULT = re.compile(r"max_batch(: int)?\s*=\s*8\b")


def test_no_source_file_but_the_table_spells_the_stages_or_the_batch_default() -> None:
    found = []
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if path == REPO / "omni_common" / "stages.py" or "v1" in path.relative_to(REPO).parts:
                continue
            text = path.read_text()
            found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in STAGE_LIST.finditer(text)]
            found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in BATCH_DEFAULT.finditer(text)]
    assert not found, found


def test_each_stage_holds_a_module_role_the_models_know() -> None:
    assert set(STAGE_MODULE_ROLES) == set(STAGES)
    assert set(STAGE_MODULE_ROLES.values()) <= set(MODULE_ROLES)

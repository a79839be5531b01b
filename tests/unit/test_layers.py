"""The floors of the code base: `omni_common` (runtime, transport, models, client SDK) is below
`services`, and the `omnistage` command composes both. A lower floor never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_omni_common_never_imports_services_or_the_command() -> None:
    upward = {
        f"{path.relative_to(REPO)}: {module}"
        for path in sorted((REPO / "omni_common").rglob("*.py"))
        for module in imported_modules(path)
        if module.split(".")[0] == "services" or module.startswith("omnistage.cli")
    }
    assert not upward, sorted(upward)


def test_the_check_sees_a_lazy_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def main():\n    from services.coordinator.server import main\n    main()\n")
    assert "services.coordinator.server" in imported_modules(module)

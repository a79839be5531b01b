"""The floors of the code base, bottom-up: the generated wire code (`omnistage`, only `v1`),
`omni_common` (runtime, transport, models, client SDK), `services`, and at the top the
`omnistage` command (`omnistage_cli`), which composes them. A lower floor never imports a
higher one; inside `omni_common`, the same holds for its ground, its layers and the modules
above them."""

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


# The packages, bottom-up; each imports only itself and those listed before it.
FLOORS = ("omnistage", "omni_common", "services", "omnistage_cli")


def test_each_package_imports_only_the_packages_beneath_it() -> None:
    upward = {
        f"{path.relative_to(REPO)}: {module}"
        for floor in FLOORS
        for path in sorted((REPO / floor).rglob("*.py"))
        for module in imported_modules(path)
        if module.split(".")[0] in FLOORS[FLOORS.index(floor) + 1 :]
    }
    assert not upward, sorted(upward)


def test_the_wire_package_holds_only_the_generated_code() -> None:
    ours = {path.relative_to(REPO / "omnistage").parts[0] for path in (REPO / "omnistage").rglob("*.py")}
    assert ours == {"__init__.py", "v1"}


def test_the_check_sees_a_lazy_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def main():\n    from services.coordinator.server import main\n    main()\n")
    assert "services.coordinator.server" in imported_modules(module)


# Inside omni_common, bottom-up: a layer imports only the layers listed before it (and the
# ground: the modules of GROUND and the generated wire code).
LAYERS = ("net", "transport", "execution", "models", "runtime")
# The top-level modules of omni_common, by floor. The ground imports no layer and nothing of
# omni_common but the ground: every layer may import it (the families decode their input media
# with imaging and audio_input). Those above the layers serve a caller or a cluster of processes.
GROUND = (
    "audio",
    "audio_input",
    "checked_files",
    "compose",
    "errors",
    "imaging",
    "input_media",
    "limits",
    "media",
    "protogen",
    "stages",
    "video_input",
)
ABOVE_THE_LAYERS = ("certs", "chat", "client", "cluster", "health")


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "omni_common" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def test_each_layer_of_omni_common_imports_only_the_layers_beneath_it() -> None:
    upward = set()
    for layer in LAYERS:
        allowed = set(LAYERS[: LAYERS.index(layer) + 1])
        for path in sorted((REPO / "omni_common" / layer).rglob("*.py")):
            for module in imported_modules(path):
                target = _layer_of(module)
                if target is not None and target not in allowed:
                    upward.add(f"{path.relative_to(REPO)}: {module}")
    assert not upward, sorted(upward)


def _top_level(module: str) -> str | None:
    """The top-level module of omni_common that `module` names (`omni_common.errors` ->
    "errors"), or None for a layer, a package's face or anything outside omni_common."""
    parts = module.split(".")
    if parts[0] != "omni_common" or len(parts) < 2 or parts[1] in LAYERS:
        return None
    return parts[1]


def test_each_top_level_module_of_omni_common_has_its_floor() -> None:
    modules = {path.stem for path in (REPO / "omni_common").glob("*.py") if path.stem != "__init__"}
    assert modules == set(GROUND) | set(ABOVE_THE_LAYERS)


def test_the_ground_of_omni_common_imports_only_the_ground() -> None:
    upward = {
        f"omni_common/{name}.py: {module}"
        for name in GROUND
        for module in imported_modules(REPO / "omni_common" / f"{name}.py")
        if module.startswith("omni_common.") and _top_level(module) not in GROUND
    }
    assert not upward, sorted(upward)


def test_the_layers_import_of_the_top_level_only_the_ground() -> None:
    """What a layer needs of a top-level module sits on the ground, or in the layer itself
    (the request's checks are models/validation.py: the families are their lowest users)."""
    upward = {
        f"{path.relative_to(REPO)}: {module}"
        for layer in LAYERS
        for path in sorted((REPO / "omni_common" / layer).rglob("*.py"))
        for module in imported_modules(path)
        if _top_level(module) is not None and _top_level(module) not in GROUND
    }
    assert not upward, sorted(upward)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_two_modules_import_each_other_even_lazily() -> None:
    """No import cycle between modules of any floor (lazy imports inside functions count: they
    tie the modules as much as top-level ones)."""
    sources = [
        path
        for top in FLOORS
        for path in (REPO / top).rglob("*.py")
        if "v1" not in path.relative_to(REPO).parts
    ]
    names = {_module_name(path) for path in sources}
    graph = {
        _module_name(path): {m for m in imported_modules(path) if m in names and m != _module_name(path)}
        for path in sources
    }
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, cycles

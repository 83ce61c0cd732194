"""The package's imports point one way, as the README's layer picture says, and no module imports itself back.

__main__ -> integrations -> estimator -> patches -> parallel -> runtime / minseq -> planner / profiler ->
config / units / data / lazy_names. Every import in a module counts, also one inside a function (a call-time import
is still a dependency). The package's own ``__init__`` (the public surface) may import anything; nothing inside the
package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_memo

PACKAGE = Path(hf_memo.__file__).parent
LAYERS = {
    "config": 0,
    "units": 0,
    "data": 0,  # the packaged sample data's paths
    "lazy_names": 0,  # the packages' lazily imported public names
    "planner": 1,
    "profiler": 1,
    "runtime": 2,
    "minseq": 2,
    "parallel": 3,
    "patches": 4,
    "estimator": 5,  # hf_memo.estimate and its fits
    "integrations": 6,
    "__main__": 7,  # python -m hf_memo: the command line
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every ``hf_memo`` module ``path`` imports, anywhere in it (``from package import submodule`` imports the
    submodule, not the package's ``__init__``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hf_memo")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hf_memo":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in _graph() if m != "hf_memo" and _layer(m) is None)
    assert not unplaced, f"modules outside the layers {sorted(LAYERS)}: {unplaced}"


def test_imports_point_down_the_layers_and_never_to_the_package_root():
    back_edges = []
    for module, imported in _graph().items():
        if module == "hf_memo":
            continue
        for target in imported:
            if target == "hf_memo" or _layer(target) is None or _layer(target) > _layer(module):
                back_edges.append(f"{module} -> {target}")
    assert not back_edges, "imports against the layer order: " + ", ".join(sorted(back_edges))


def test_no_module_imports_itself_back():
    graph = {module: {t for t in targets if t != module} for module, targets in _graph().items()}
    graph = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state and module != "hf_memo":
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"

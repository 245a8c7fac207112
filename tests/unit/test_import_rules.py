"""The package's areas (a subpackage or a top-level module) in layers: an area imports itself and lower layers only,
never a sibling of its layer or anything above. Every import counts, in functions and under `if TYPE_CHECKING:` too
(read with `ast`). No module imports another's `_private` names; no import cycles."""

from __future__ import annotations

import ast
import graphlib
from functools import cache
from pathlib import Path

PKG = "hf_dynamic_ckpt"
ROOT = Path(__file__).resolve().parents[2] / PKG
LAYERS = [
    {"constants", "errors", "jsonutil", "sysmem"},  # leaves: no package import
    {"store"},  # checkpoints on disk
    {"config"},
    {"signals", "state"},  # one step's measurements; live objects <-> checkpoint state
    {"policy", "distributed", "engine", "export", "sharded"},  # decisions; collectives; save engine; export; ZeRO
    {"run"},  # one run's orchestration
    {"integrations"},  # Trainer, Accelerate
    {"cli", "__init__"},  # the command line, the package root (lazy public names)
]
LAYER = {area: n for n, areas in enumerate(LAYERS) for area in areas}


@cache
def _trees() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        out[".".join([PKG, *parts])] = path, ast.parse(path.read_text(encoding="utf-8"))
    return out


def _graph() -> dict[str, list[tuple[ast.AST, str, str, str]]]:
    """Module -> (node, imported package module, the module named after `from`, the name) of each package import."""
    trees, graph = _trees(), {}
    for module, (path, tree) in trees.items():
        base = module.split(".")[: None if path.name == "__init__.py" else -1]
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])]) \
                    if node.level else node.module or ""
                found += [(node, f"{source}.{a.name}" if f"{source}.{a.name}" in trees else source, source, a.name)
                          for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(node, a.name, a.name, "") for a in node.names]
        graph[module] = [f for f in found if f[1] in trees and f[1] != module]
    return graph


def _area(module: str) -> str:
    return module.removeprefix(PKG).lstrip(".").split(".")[0] or "__init__"


def test_each_area_imports_only_itself_and_lower_layers() -> None:
    bad = sorted({f"{m} -> {dep}" for m, imports in _graph().items() for _, dep, _, _ in imports
                  if _area(dep) != _area(m) and LAYER[_area(dep)] >= LAYER[_area(m)]})
    assert bad == [], "imports against the layers (LAYERS):\n" + "\n".join(bad)


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [f"{m}: from {source} import {name}" for m, imports in _graph().items() for _, _, source, name in imports
           if name.startswith("_") and not name.startswith("__") and source != m]
    assert bad == [], "private names imported from another module:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graphlib.TopologicalSorter({m: {dep for _, dep, _, _ in imports} for m, imports in _graph().items()}).prepare()

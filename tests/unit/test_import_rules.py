"""The package's layering: no import cycles, arrows point down, integrations use the public seams.

Read from the source with `ast` (nothing is imported): every `import` / `from ... import` of a
module, at any depth, except under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = "hf_dynamic_ckpt"
ROOT = Path(__file__).resolve().parents[2] / PKG

# area -> modules (prefixes) it may import from the package. An area is a module or a folder.
ALLOWED: dict[str, tuple[str, ...]] = {
    "store": ("store", "constants", "errors", "jsonutil", "_version"),
    "state": ("state", "constants", "errors", "jsonutil", "store.types", "store.spec"),
    "signals": ("signals", "config", "constants", "distributed", "errors", "jsonutil", "sysmem"),
    "policy": ("policy", "signals.frame", "signals.stats", "config", "constants", "errors", "jsonutil", "store.types"),
    "engine": ("engine", "store", "state", "config", "constants", "errors", "jsonutil", "sysmem"),
    "integrations": ("integrations", "run.checkpointer", "run.savelog", "state", "config", "constants", "errors",
                     "distributed", "jsonutil", "store.types", "store.spec", "policy.decision", "export"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([PKG, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]

    def visit(node: ast.AST) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (x for stmt in child.orelse for x in visit_stmt(stmt))
                continue
            yield from visit_stmt(child)

    def visit_stmt(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                module = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
            submodules = [n for n in names if n in known]  # `from . import distributed` imports a module
            yield from submodules
            if len(submodules) < len(names):
                yield module
        yield from visit(node)

    yield from visit(tree)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = {m for m in _imports(name, path, set(mods)) if m in mods and m != name}
        graph[name] = deps
    return graph


def _area(module: str) -> str:
    return module.removeprefix(PKG + ".").split(".")[0]


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_no_module_imports_the_package_root() -> None:
    offenders = sorted(m for m, deps in _graph().items() if PKG in deps and m != PKG)
    assert offenders == [], f"modules importing the package root (an arrow running up): {offenders}"


def test_areas_import_only_what_their_layer_allows() -> None:
    problems = []
    for module, deps in _graph().items():
        area = _area(module)
        allowed = ALLOWED.get(area)
        if allowed is None:
            continue
        for dep in sorted(deps):
            rel = dep.removeprefix(PKG + ".")
            if dep == PKG or not any(rel == a or rel.startswith(a + ".") for a in allowed):
                problems.append(f"{module} -> {dep}")
    assert problems == [], "imports across layers:\n" + "\n".join(problems)

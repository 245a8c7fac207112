"""The package's shape: dependencies point one way, and no module reaches into another's private names.

Read from the source with `ast` (nothing is imported): every `import` / `from ... import` of a
module, at any depth, those under `if TYPE_CHECKING:` included (a type imported only for
annotations is still a reference back). Rules:

- no import cycles, and no module imports the package root;
- each area imports only what its layer allows (`ALLOWED`): the stores, state, signals, policy and
  engine never know the run's orchestration (`run/`), and the integrations use its public surface;
- the core (every module outside `extras/`) never imports `extras/` (the demo, toy models, plot, the
  learned double-check), except at the sites of `EXTRAS_SITES`, each a lazy import inside the one
  function that needs it;
- no module imports another module's `_private` name, and no code reads `obj._name` of an object
  of this package other than `self` / `cls` (third-party internals the library must touch are
  listed in `THIRD_PARTY_PRIVATE`).
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
    "state": ("state", "constants", "errors", "jsonutil", "store"),
    "signals": ("signals", "config", "constants", "errors", "jsonutil", "sysmem"),
    "policy": ("policy", "signals.frame", "signals.stats", "config", "constants", "errors", "jsonutil", "store"),
    "engine": ("engine", "store", "state", "config", "constants", "errors", "jsonutil", "sysmem"),
    "run": ("run", "store", "state", "signals", "policy", "engine", "config", "constants", "errors", "jsonutil",
            "distributed", "export", "sysmem"),
    "integrations": ("integrations", "run.orchestrator", "run.savelog", "run.rollback", "run.elastic", "state",
                     "config", "constants", "errors", "distributed", "jsonutil", "store",
                     "policy.decision", "export"),
}

# The only places the core imports `extras/`: (core module, extras module) -> why. Each import sits inside the
# one function that needs it, so importing the core never loads an extra.
EXTRAS_SITES: dict[tuple[str, str], str] = {
    # `hf-dynamic-ckpt plot ROOT` is a documented command; the figure code is an extra (matplotlib).
    ("hf_dynamic_ckpt.cli", "hf_dynamic_ckpt.extras.plot"): "the `plot` command",
    # The documented `learned_model` key names a model file only the learned double-check reads; the policy
    # takes that check as a `policy.rules.DoubleCheck` (a protocol), so this import is the one tie.
    ("hf_dynamic_ckpt.policy.rules", "hf_dynamic_ckpt.extras.learned"): "the `learned_model` key",
}

# Private attributes of other libraries' objects the library must read or call (there is no public API).
THIRD_PARTY_PRIVATE = {
    "_foreach_copy_", "_foreach_norm", "_new_shared", "_C", "_version",  # torch
    "_modules", "_parameters", "_buffers",  # torch.nn.Module's slot tables (CachedWeights checks them cheaply)
    "_step_count",  # torch LR schedulers
    "_optimizers", "_schedulers", "_models",  # accelerate.Accelerator's prepared objects
    "_train_batch_size",  # transformers.Trainer
    "_load_from_checkpoint",  # Trainer's weight load, skipped once after a resume read the weights into the model
    "_load_optimizer_and_scheduler",  # Trainer's scheduler.pt load under DeepSpeed, skipped once (the store has it)
    "_globalstep_last_logged", "_initial_global_step",  # Trainer's logging counters a rollback must move back
    "_getframe", "_SubParsersAction",  # the standard library
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


def _is_extra(module: str) -> bool:
    return module == f"{PKG}.extras" or module.startswith(f"{PKG}.extras.")


def test_the_core_does_not_import_the_extras() -> None:
    found = {(m, dep) for m, deps in _graph().items() if not _is_extra(m) for dep in deps if _is_extra(dep)}
    assert sorted(found - set(EXTRAS_SITES)) == [], "core modules importing extras/ (move the code, or the import)"
    assert sorted(set(EXTRAS_SITES) - found) == [], "EXTRAS_SITES names an import that is gone: drop it"


def test_areas_import_only_what_their_layer_allows() -> None:
    problems = []
    for module, deps in _graph().items():
        area = _area(module)
        allowed = ALLOWED.get(area)
        if allowed is None:
            continue
        for dep in sorted(deps):
            if (module, dep) in EXTRAS_SITES:  # checked by test_the_core_does_not_import_the_extras
                continue
            rel = dep.removeprefix(PKG + ".")
            if dep == PKG or not any(rel == a or rel.startswith(a + ".") for a in allowed):
                problems.append(f"{module} -> {dep}")
    assert problems == [], "imports across layers:\n" + "\n".join(problems)


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _modules().items()}


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if not node.level:
        return node.module or ""
    anchor = base[: len(base) - (node.level - 1)]
    return ".".join([*anchor, *(node.module.split(".") if node.module else [])])


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_the_extras_sites_import_inside_a_function() -> None:
    mods = _modules()
    problems = []
    for module in sorted({m for m, _ in EXTRAS_SITES}):
        tree = ast.parse(mods[module].read_text(encoding="utf-8"))
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in inside:
                continue
            if (isinstance(node, ast.ImportFrom) and _is_extra(_absolute(module, mods[module], node))) or \
                    (isinstance(node, ast.Import) and any(_is_extra(a.name) for a in node.names)):
                problems.append(f"{module}:{node.lineno}")
    assert problems == [], "extras imported at module level (importing the core would load them):\n" + \
        "\n".join(problems)


def test_no_module_imports_another_modules_private_names() -> None:
    mods = _modules()
    problems = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(name, mods[name], node)
                if module.startswith(PKG) and module != name:
                    problems += [f"{name}:{node.lineno}: from {module} import {a.name}" for a in node.names
                                 if _private(a.name)]
    assert problems == [], "private names imported from another module:\n" + "\n".join(problems)


def test_no_code_reads_another_objects_private_attributes() -> None:
    trees = _trees()
    defined: set[str] = set()  # private names the package itself defines (methods, attributes, module globals)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _private(node.name):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                defined.add(node.id)
    problems = []

    def visit(node: ast.AST, name: str, classes: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (*classes, child.name) if isinstance(child, ast.ClassDef) else classes
            if isinstance(child, ast.Attribute) and _private(child.attr):
                owner = child.value
                own = isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in classes)
                own = own or (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                              and owner.func.id == "super")
                third_party = child.attr in THIRD_PARTY_PRIVATE and child.attr not in defined - THIRD_PARTY_PRIVATE
                if not own and not third_party:
                    problems.append(f"{name}:{child.lineno}: {ast.unparse(child)}")
            visit(child, name, inner)

    for name, tree in trees.items():
        visit(tree, name, ())
    assert problems == [], "private attributes of another object read or written:\n" + "\n".join(problems)

"""The docs (README.md, docs/*.md, recipes/**/*.md) name public code that exists, read with `ast` (nothing imported):
`hf_dynamic_ckpt.a.b[.C[.attr]]` (in backticks or a code block); `Name` / `Name.attr` of a public `__all__`; repository
paths (`scripts/...`, `tests/...`, `examples/...`, `recipes/...`, `docs/...`, `hf_dynamic_ckpt/...`); the command of
`hf-dynamic-ckpt CMD`. Bare private module and function names are prose and not checked."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = "hf_dynamic_ckpt"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "recipes").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.$-])((?:scripts|tests|examples|recipes|docs|hf_dynamic_ckpt)/[\w./*-]*)")
QUALIFIED = re.compile(rf"(?<![\w.]){PKG}(?:\.\w+)+(?![\w-])")
CLI = re.compile(r"\bhf-dynamic-ckpt[ \t]+([a-z][\w-]*)")


def _file(module: str) -> Path | None:
    return next((p for p in (REPO / f"{module.replace('.', '/')}.py", REPO / module.replace(".", "/") / "__init__.py")
                 if p.is_file()), None)


@cache
def _scope(module: str) -> dict[str, ast.AST | str]:
    """Top-level names of `module`: its definitions, or `"source.name"` for what it imports from elsewhere."""
    path = _file(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(encoding="utf-8"))
    base = module.split(".")[: None if path.stem == "__init__" else -1]  # what `from .` means here
    out: dict[str, ast.AST | str] = {}
    for node in [*tree.body, *(n for top in tree.body if isinstance(top, ast.If | ast.Try) for n in top.body)]:
        if isinstance(node, ast.ImportFrom):
            source = ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            out.update({a.asname or a.name: f"{source}.{a.name}" for a in node.names})
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            out.update({t.id: node for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        if isinstance(t, ast.Name)})
    return out


def _find(module: str, name: str) -> tuple[str, ast.AST | str | None]:
    """(module, node) defining `name` of `module`, following imports inside the package: a submodule's node is its
    dotted name, another library's name the string it is imported as, an undefined name `None`."""
    if _file(sub := f"{module}.{name}"):
        return sub, sub
    if isinstance(target := _scope(module).get(name), str) and target.startswith(PKG + "."):
        return _find(*target.rsplit(".", 1))
    return module, target


def _attrs(module: str, cls: ast.ClassDef) -> set[str]:
    """A class's methods, class-level names, `self.x` attributes, and those of its bases in the package."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    names |= {t.id for n in cls.body for t in (n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", 0)])
              if isinstance(t, ast.Name)}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for base in cls.bases:
        where, node = _find(module, ast.unparse(base).split(".")[-1])
        names |= _attrs(where, node) if isinstance(node, ast.ClassDef) else set()
    return names


def _member(module: str, rest: list[str]) -> str | None:
    """What is wrong with `module.rest[0][.rest[1]]` (a deeper attribute is not checked), or `None`."""
    where, node = _find(module, rest[0])
    if node is None:
        return f"{where} has no {rest[0]!r}"
    if node == where:  # a module
        return _member(where, rest[1:]) if rest[1:] else None
    if isinstance(node, ast.ClassDef) and rest[1:] and rest[1] not in _attrs(where, node):
        return f"class {rest[0]} ({where}) has no {rest[1]!r}"
    return None


@cache
def _public() -> dict[str, str]:
    """Every name of a public `__all__` (the package's and its subpackages') -> the module exporting it."""
    inits = [".".join(p.parent.relative_to(REPO).parts) for p in sorted((REPO / PKG).rglob("__init__.py"))]
    return {name: m for m in inits if isinstance(node := _scope(m).get("__all__"), ast.Assign)
            for name in ast.literal_eval(node.value)}


@cache
def _commands() -> set[str]:
    """The commands `build_parser` of the CLI adds: the names its `add("name", ...)` calls give."""
    node = _scope(f"{PKG}.cli")["build_parser"]
    return {c.args[0].value for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            and c.func.id == "add" and c.args and isinstance(c.args[0], ast.Constant)}


def _problems(doc: str, text: str) -> list[str]:
    """One line per bad name of `text` (a doc named `doc`): ``doc: `name`: what is wrong``."""
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    found: list[tuple[str, str | None]] = []
    for span in [*inline, *blocks]:
        found += [(m, _member(PKG, m.split(".")[1:])) for m in QUALIFIED.findall(span)]
        found += [(p, None if (any(REPO.glob(p)) if "*" in p else (REPO / p).exists()) else "no such file")
                  for p in (m.rstrip(".") for m in PATH.findall(span))]
        found += [(f"hf-dynamic-ckpt {c}", None if c in _commands() else "no such command") for c in CLI.findall(span)]
    for token in inline:
        name = re.sub(r"\(.*\)$", "", token.strip())
        if re.fullmatch(r"\w+(\.\w+)?", name) and name.split(".")[0] in _public():
            found.append((token, _member(_public()[name.split(".")[0]], name.split("."))))
    return sorted({f"{doc}: `{name}`: {problem}" for name, problem in found if problem})


def test_every_name_in_the_docs_exists() -> None:
    problems = [p for doc in DOCS for p in _problems(str(doc.relative_to(REPO)), doc.read_text(encoding="utf-8"))]
    assert problems == [], "docs name code that does not exist:\n" + "\n".join(problems)


def test_the_check_catches_removed_names() -> None:
    bad = ("`hf_dynamic_ckpt.store.blobs`, `scripts/bench_store.py`, `CheckpointStore.no_such(1)`,\n"
           "```\nhf-dynamic-ckpt frobnicate ROOT\npython -c 'import hf_dynamic_ckpt.state.flat'\n```")
    assert [p.split(": ")[1] for p in _problems("x.md", bad)] == [
        "`CheckpointStore.no_such(1)`", "`hf-dynamic-ckpt frobnicate`", "`hf_dynamic_ckpt.state.flat`",
        "`hf_dynamic_ckpt.store.blobs`", "`scripts/bench_store.py`"]
    good = ("`hf_dynamic_ckpt.store.CheckpointStore.save`, `SmartCkptConfig.from_yaml`, `Tier.WEIGHTS`, "
            "`scripts/bench_real_width.py`, `tests/unit/`, `hf-dynamic-ckpt ls ROOT`, `hf_dynamic_ckpt.errors.fault`")
    assert _problems("x.md", good) == []


def test_no_process_history_in_the_docs_and_the_code() -> None:
    """Docs and comments describe the code as it is: no "round 2", "issue 12", "eighth pass" (history is in git)."""
    pattern = re.compile(r"\b(round[ -][0-9]|issues? \d+|(third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) pass)\b",
                         re.I)
    files = [*DOCS, *(REPO / PKG).rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "recipes").rglob("*.py"),
             *(p for p in (REPO / "tests").rglob("*.py") if p != Path(__file__))]
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}" for path in files
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if pattern.search(line)]
    assert hits == [], "process history in docs or code:\n" + "\n".join(hits)

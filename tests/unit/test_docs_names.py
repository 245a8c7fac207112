"""The docs describe today's code: every module, class, function and file they name in backticks exists.

Read from the sources with `ast` (nothing is imported). What counts as a name of the code:

- `hf_dynamic_ckpt.a.b` and `a.b` where `a` is one of the package's modules (`resume.plan_resume`,
  `state.flat`): the module, and the attribute in it;
- `ClassName` and `ClassName.attr`: a class of the package and one of its methods or attributes, unless it
  is one of the other libraries' names the docs discuss (`EXTERNAL`);
- `function_name()` / `function_name(...)`: a function or method somewhere in the package (or `EXTERNAL`);
- paths `dir/file.py`, `tests/...`, `scripts/x.py`: files of the repository.

Config keys, YAML values, CLI flags and shell lines are not names of the code and are left alone.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = "hf_dynamic_ckpt"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", *sorted((REPO / "recipes").rglob("*.md"))]

# Names of other libraries (and of Python itself) that the docs discuss.
EXTERNAL = {
    # transformers / accelerate / peft / datasets / safetensors / torch / zstd / DCP
    "Trainer", "TrainerState", "TrainerControl", "TrainerCallback", "TrainingArguments", "HfArgumentParser",
    "PreTrainedModel", "PreTrainedTokenizerFast", "AutoModelForCausalLM", "Qwen2Config", "LlamaConfig",
    "Qwen2ForCausalLM", "LlamaForCausalLM", "PeftModel", "LoraConfig", "Accelerator", "DataLoader", "DeepSpeedPlugin",
    "PartialState",
    "DataLoaderShard", "BatchSamplerShard", "SeedableRandomSampler", "RandomSampler", "GradScaler", "DTensor",
    "DeviceMesh", "FileSystemWriter", "DefaultLoadPlanner", "StorageReader", "StateDictOptions",
    "ChunkStorageMetadata", "ReduceLROnPlateau", "CheckpointException", "ExportableState", "Dataset",
    "AdamW", "Adafactor", "Optimizer", "Module", "Tensor", "Generator", "Event", "Stream", "JitCheckpoint",
    "ZstdCompressor", "ZstdDecompressor", "S3FileSystem", "Path", "PrinterCallback",
    "EarlyStoppingCallback", "DistributedType", "ProjectConfiguration", "IterableDataset",
    "ThreadPoolExecutor", "Future", "RuntimeError", "ValueError", "PermissionError", "FileNotFoundError",
    "MemoryError", "OSError", "KeyError", "TypeError", "RecursionError", "SystemExit", "NaN", "Infinity",
    "DDP", "FSDP", "FSDP1", "FSDP2", "HSDP", "LoRA", "MTBF", "OOM", "NVML", "GPU", "CPU", "RSS", "JSON", "YAML",
    "SQLite", "WAL", "TODO", "AcceleratedOptimizer", "FullyShardedDataParallelPlugin", "FullyShardedDataParallel",
    "DeprecationWarning", "UserWarning", "MemAvailable", "MemTotal", "SwapTotal",
}
# Attributes of other libraries' objects (Trainer's state, tensors, ...) the docs name on a variable.
EXTERNAL_ATTRS = {"global_step", "epoch", "log_history", "total_flos", "best_metric",
                  "best_global_step", "best_model_checkpoint", "max_steps", "grad", "data",
                  "param_groups", "is_main_process", "sync_gradients", "current_flos", "process_index"}
FILE_SUFFIXES = (".json", ".jsonl", ".safetensors", ".db", ".pt", ".pth", ".bin", ".zst", ".md", ".png", ".yaml",
                 ".yml", ".txt", ".lock", ".gz", ".cfg", ".toml", ".sh", ".log")
CGROUP_FILES = {"memory.high", "memory.max", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes",
                "memory.current", "memory.stat", "memory.usage_in_bytes", "memory.events"}
EXTERNAL_FUNCTIONS = {
    "train", "save_state", "load_state", "prepare", "backward", "clip_grad_norm_", "save_file", "load_file",
    "safe_open", "get_peft_model", "get_peft_model_state_dict", "set_peft_model_state_dict", "from_pretrained",
    "save_pretrained", "state_dict", "load_state_dict", "zero_grad", "step", "fully_shard", "get_state_dict",
    "set_state_dict", "get_model_state_dict", "set_model_state_dict", "skip_first_batches", "set_epoch",
    "register_save_state_pre_hook", "register_load_state_pre_hook", "torch.load", "torch.save", "fsync",
    "sync_file_range", "madvise", "flock", "fcntl", "lockf", "getrusage", "gc.collect", "set_verbosity_info",
    "from_yaml", "from_dict", "set_seed", "all_reduce", "broadcast", "barrier", "all_gather_object",
    "init_process_group", "store_flos", "compute_steps", "get_last_lr", "mark_step", "wait_event",
    "empty_cache", "pin_memory", "record_stream", "get_rng_state", "set_rng_state", "manual_seed", "fork",
    "unshare", "sched_getaffinity", "pread", "pwrite", "rename", "replace", "unlink", "open", "iter", "next",
    "posix_fadvise", "share_memory_", "full_tensor", "to_local", "redistribute", "clone", "copy_", "contiguous",
}


@cache
def _index() -> dict[str, dict[str, set[str]]]:
    """module name -> {"names": top-level names, "classes:<C>": attributes of class C}."""
    out: dict[str, dict[str, set[str]]] = {}
    for path in sorted((REPO / PKG).rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        entry: dict[str, set[str]] = {"names": set()}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                entry["names"].add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        entry["names"].add(target.id)
            elif isinstance(node, ast.ImportFrom):
                entry["names"].update(a.asname or a.name for a in node.names)
            if isinstance(node, ast.ClassDef):
                attrs = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                attrs |= {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Attribute)}
                attrs |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target,
                                                                                                       ast.Name)}
                attrs |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                          if isinstance(t, ast.Name)}
                entry[f"class:{node.name}"] = attrs
        out[".".join(parts)] = entry
    return out


@cache
def _bases() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted((REPO / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
    return out


@cache
def _classes() -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for entry in _index().values():
        for key, attrs in entry.items():
            if key.startswith("class:"):
                merged.setdefault(key[6:], set()).update(attrs)
    bases = _bases()

    def inherited(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        attrs = set(merged.get(name, set()))
        for base in bases.get(name, set()) - seen:
            attrs |= inherited(base, seen | {name})
        return attrs

    return {name: inherited(name) for name in merged}


def _functions() -> set[str]:
    out: set[str] = set()
    for entry in _index().values():
        out |= entry["names"]
        for key, attrs in entry.items():
            if key.startswith("class:"):
                out |= attrs
    return out


def _module(name: str) -> str | None:
    """The package module `name` denotes: a full dotted path, or a unique suffix of one (`run.resume`, `flat`)."""
    index = _index()
    if name in index:
        return name
    full = f"{PKG}.{name}"
    if full in index:
        return full
    matches = [m for m in index if m.endswith("." + name)]
    return matches[0] if len(matches) == 1 else None


def _problem(token: str) -> str | None:
    token = token.strip()
    if token.endswith(FILE_SUFFIXES) or token in CGROUP_FILES:
        return None  # a data file's name, not code
    if token.endswith(".py") or ("/" in token and re.fullmatch(r"[\w./-]+", token)):
        path = token.split("::")[0].split(":")[0]
        if path.startswith(("hf_dynamic_ckpt/", "scripts/", "tests/", "recipes/", "docs/")) or path.endswith(".py"):
            candidates = [REPO / path, REPO / PKG / path, REPO / "tests" / path, REPO / "scripts" / path]
            found = any(c.exists() for c in candidates) or any(
                hit for hit in REPO.rglob(Path(path).name) if not {".venv", ".git"} & set(hit.relative_to(REPO).parts))
            return None if found else f"file {path} does not exist"
        return None
    call = re.fullmatch(r"([A-Za-z_][\w.]*)\((.*)\)", token)
    if call:
        token = call.group(1)
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", token):
        return None  # an expression, a flag, a value: not a name
    parts = token.split(".")
    if parts[0] == PKG or (_module(parts[0]) is not None and len(parts) > 1):
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
            module = _module(".".join(parts[:cut])) if parts[0] != PKG else (".".join(parts[:cut])
                                                                              if ".".join(parts[:cut]) in _index()
                                                                              else None)
            if module is None:
                continue
            rest = parts[cut:]
            if not rest:
                return None
            names = _index()[module]["names"]
            if rest[0] not in names and _module(f"{module}.{rest[0]}".removeprefix(PKG + ".")) is None:
                if parts[0] != PKG and len(rest) == 1 and (rest[0] in _functions() or rest[0] in EXTERNAL_FUNCTIONS
                                                           or rest[0] in EXTERNAL_ATTRS):
                    return None  # a variable named like the module (`store.fork`, `trainer.train()`)
                return f"{token}: {module} has no {rest[0]!r}"
            if len(rest) > 1 and f"class:{rest[0]}" in _index()[module] and rest[1] not in _classes()[rest[0]]:
                return f"{token}: class {rest[0]} has no {rest[1]!r}"
            return None
        return None
    if re.fullmatch(r"[A-Z][a-z0-9]+[A-Z]\w*|[A-Z][a-z]+[A-Z]?\w*Error", parts[0]):  # CamelCase: a class
        if parts[0] in EXTERNAL:
            return None
        classes = _classes()
        if parts[0] not in classes:
            return f"class {parts[0]} does not exist in {PKG} (or add it to EXTERNAL if it is another library's)"
        if len(parts) > 1 and parts[1] not in classes[parts[0]]:
            return f"{token}: class {parts[0]} has no {parts[1]!r}"
        return None
    if (call and len(parts) == 1 and "_" in parts[0] and parts[0] not in EXTERNAL_FUNCTIONS
            and parts[0] not in _functions()):
        return f"function {parts[0]}() does not exist in {PKG}"
    return None


def test_every_name_in_the_docs_exists() -> None:
    problems = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: examples, shell lines, outputs
        for line in text.splitlines():
            for token in re.findall(r"`([^`\n]+)`", line):
                problem = _problem(token)
                if problem:
                    problems.append(f"{doc.relative_to(REPO)}: `{token}`: {problem}")
    assert problems == [], "docs name code that does not exist:\n" + "\n".join(sorted(set(problems)))


def test_no_process_history_in_the_docs_and_the_code() -> None:
    """Docs and comments describe the code as it is: no "round 2", "issue 12", "eighth pass" (history is in git)."""
    pattern = re.compile(r"\b(round[ -][0-9]|issues? \d+|(third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) pass)\b",
                         re.I)
    files = [*DOCS, *(REPO / PKG).rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "recipes").rglob("*.py"),
             *(p for p in (REPO / "tests").rglob("*.py") if p != Path(__file__))]
    hits = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:100]}")
    assert hits == [], "process history in docs or code:\n" + "\n".join(hits)

"""Getting a model out of a checkpoint: `describe_model`, `load_checkpoint`, `export_checkpoint` (docs/trainer.md,
"Notes"). Reading writes nothing in the store; an export is written beside `out`, `EXPORT_MARKER` last, and renamed
into place; a failed one leaves a previous export as it was."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import secrets
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .constants import ALL_TIERS, DEFAULT_TASK_ID, KEY_SHARDED, VERSION, Tier
from .errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, fault
from .state import adapter_names, apply_weights, split_adapters
from .store import CheckpointInfo, CheckpointStore, LoadedCheckpoint, find_root

logger = logging.getLogger(__name__)

KEY_MODEL = "model"
"""Key of the model description (`describe_model`) in the manifest's `extra`."""
EXPORT_MARKER = "hf_dynamic_ckpt_export.json"
"""Written last into every export: ``export_version`` 1, store, task, step, format, ref, files."""
_RANK = {"auto": lambda i: (-i.step,), "best": lambda i: (float("inf") if i.loss is None else i.loss, -i.step),
         "fastest": lambda i: (float("inf") if i.recovery_cost_ms is None else i.recovery_cost_ms, -i.step)}
"""A named ref's order of the checkpoints, lowest first (as `CheckpointStore.resolve`'s)."""


def _json_default(obj: Any) -> Any:
    """Config values as PEFT / transformers write them: sets as sorted lists, enums by value, dtypes by name."""
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=str)
    return obj.value if isinstance(obj, enum.Enum) else str(obj).removeprefix("torch.")


def describe_model(model: nn.Module, *, tokenizer: Any | None = None) -> dict[str, Any]:
    """What rebuilding `model` (transformers, PEFT over it, or any module) needs, as JSON: kind ("peft", "transformers",
    "module"), config, adapters (their PEFT configs), active_adapter, base_model, revision, dtype, tokenizer."""
    peft: Any = model  # a PEFT model when it has adapters
    names = adapter_names(model)
    base: Any = peft.get_base_model() if names else model
    adapters: dict[str, Any] = {name: peft.peft_config[name].to_dict() for name in names}
    config = base.config.to_dict() if hasattr(getattr(base, "config", None), "to_dict") else None
    first, adapter = next(iter(model.parameters()), None), next(iter(adapters.values()), dict[str, Any]())
    return json.loads(json.dumps({
        "kind": "peft" if names else "module" if config is None else "transformers", "config": config,
        "adapters": adapters, "active_adapter": names[0] if names else None,
        "base_model": adapter.get("base_model_name_or_path") or (config or {}).get("_name_or_path") or None,
        "revision": adapter.get("revision"), "dtype": first.dtype if first is not None else None,
        "tokenizer": getattr(tokenizer, "name_or_path", None) or None}, default=_json_default))


def _open(root: str | os.PathLike[str], task_id: str | None) -> CheckpointStore:
    """The store opened to read (a URL's into the local cache only)."""
    url = "://" in os.fspath(root)
    return CheckpointStore(root if url else find_root(root), task_id=task_id or DEFAULT_TASK_ID, cleanup=False,
                           read_only=not url)


def _why_hidden(store: CheckpointStore, info: CheckpointInfo) -> str:
    """Why `resolve` passes over `info` (flagged missing, corrupt or unhealthy), in words."""
    if info.status == "missing":
        return "its directory or manifest is gone (status missing)"
    if info.status != "ok":
        try:
            problems = store.verify(info)
        except CheckpointNotFoundError:
            return "it was deleted meanwhile"
        return ("failed verification: " + "; ".join(problems)) if problems else f"marked {info.status}"
    return (f"saved as unhealthy ({info.reason or 'no reason recorded'}); auto, best and fastest never choose one: "
            f"pass step:{info.step} to take it")


def _load(store: CheckpointStore, ref: str | int, tiers: Collection[Tier], *,
          log: bool = True) -> tuple[LoadedCheckpoint, list[str]]:
    """`store.load(ref)`, a sharded checkpoint's weights gathered whole; a named ref moves past one that fails
    verification, and each one it ranks before the chosen one gets a note (first in `warnings`; logged with `log`)."""
    rank = None if isinstance(ref, int) else _RANK.get(os.fspath(ref))
    failed: dict[int, str] = {}
    while True:
        try:
            loaded = store.load(info := store.resolve(ref), tiers=tiers, mmap=False)
            break
        except CorruptCheckpointError as e:  # the load flagged it corrupt: the next resolve passes over it
            if rank is None or info.step in failed:
                raise
            failed[info.step] = str(e)
        except CheckpointNotFoundError as e:
            if not failed:
                raise
            raise CheckpointNotFoundError(f"{e} Passed over: " + "; ".join(
                f"step {step}: {why}" for step, why in sorted(failed.items(), reverse=True))) from e
    store.gather_weights(loaded)  # a sharded (FSDP2 / ZeRO) checkpoint's whole tensors from every rank's files
    notes = [] if rank is None else [
        f"skipped step {i.step}: {_why_hidden(store, i)}" for i in store.list(include_unhealthy=True)
        if i.step != loaded.info.step and Tier.WEIGHTS in i.tiers and rank(i) < rank(loaded.info)]
    loaded.warnings[:0] = notes
    for note in notes if log else []:
        logger.warning("%s (%r chose step %d)", note, ref, loaded.info.step)
    return loaded, notes


def load_checkpoint(root: str | os.PathLike[str], ref: str | int = "auto", *, model: nn.Module | None = None,
                    task_id: str | None = None, tiers: Collection[Tier] = ALL_TIERS) -> LoadedCheckpoint:
    """Read a checkpoint, verified, writing nothing; with `model`, put its weights into it (names and shapes checked).
    `root`: the store, the training output_dir holding it, or a URL; `ref`: auto, best, fastest, step:N or a path.
    Raises `CheckpointNotFoundError`, `ConfigError` or `CorruptCheckpointError` (`ref` names one that fails)."""
    with _open(root, task_id) as store:
        loaded = _load(store, ref, tiers)[0]
    if model is not None:
        if loaded.weights is None:
            raise ConfigError(f"step {loaded.info.step} holds no weights tier; choose another checkpoint.")
        apply_weights(model, loaded.weights)
    return loaded


def export_checkpoint(root: str | os.PathLike[str], ref: str | int, out: str | os.PathLike[str], *,
                      format: str = "peft", base: str | os.PathLike[str] | None = None,
                      task_id: str | None = None, overwrite: bool = False) -> Path:
    """Write a checkpoint as a folder that PEFT / transformers load; returns `out`. `format`: ``peft`` (the adapters),
    ``hf`` (the full model) or ``merged`` (`base`, default the recorded base model, with the active adapter merged).
    `overwrite` replaces only an empty folder or a previous export holding nothing else. Raises `ConfigError` or
    `CheckpointNotFoundError`."""
    return export_step(root, ref, out, format=format, base=base, task_id=task_id, overwrite=overwrite, log=True)[0]


def export_step(root: str | os.PathLike[str], ref: str | int, out: str | os.PathLike[str], *, format: str = "peft",
                base: str | os.PathLike[str] | None = None, task_id: str | None = None, overwrite: bool = False,
                log: bool = False) -> tuple[Path, int, list[str]]:
    """`export_checkpoint`, returning also the step and a ``skipped step N: why`` line per checkpoint passed over."""
    if format not in _WRITERS:
        raise ConfigError(f"format={format!r} is invalid: expected one of {', '.join(_WRITERS)}.")
    target = Path(out)
    with _open(root, task_id) as store:
        store_root = None if "://" in os.fspath(root) else store.root
        replaces = _check_target(target, overwrite=overwrite, store_root=store_root)
        loaded, skipped = _load(store, ref, {Tier.WEIGHTS}, log=log)
    step, desc = loaded.info.step, loaded.extra.get(KEY_MODEL)
    if loaded.weights is None:
        raise ConfigError(f"step {step} holds no weights tier ({'; '.join(loaded.warnings)}): export another "
                          "checkpoint (auto, best and fastest choose only ones with weights).")
    if not isinstance(desc, dict):
        raise ConfigError(f"step {step} records no model description (written before hf_dynamic_ckpt 0.2): rebuild "
                          "the model in a script and use load_checkpoint(root, ref, model=model) + "
                          "model.save_pretrained(out).")
    if (format == "hf") == (desc.get("kind") == "peft"):
        raise ConfigError(f"format='hf' writes a full model; step {step} holds LoRA adapters only: use format='peft', "
                          "or format='merged' with the base weights." if format == "hf" else f"format={format!r} "
                          f"needs a PEFT checkpoint; step {step} holds a full model: use format='hf'.")
    target.parent.mkdir(parents=True, exist_ok=True)
    (tmp := target.parent / f".{target.name}.export-tmp-{secrets.token_hex(4)}").mkdir()
    try:
        _WRITERS[format](loaded, desc, tmp, base)
        _write_marker(tmp, {"store": os.fspath(store_root or root), "task": loaded.info.task_id, "step": step,
                            "format": format, "ref": ref if isinstance(ref, int) else os.fspath(ref)})
        _move_into_place(tmp, target, replaces=replaces)
    finally:
        if tmp.exists():  # the export failed before its rename: only this call's own folder goes
            shutil.rmtree(tmp)
    return target, step, skipped


def _not_an_export(folder: Path) -> str | None:
    """Why `folder` is not a previous export holding only what its marker lists (`None`: it is)."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")

    marker = folder / EXPORT_MARKER
    entries = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))  # links are listed, not followed
    if not marker.is_file() or marker.is_symlink():
        return f"it is not a previous export (no {EXPORT_MARKER}; it holds {some(entries)})"
    try:
        files = [str(f) for f in json.loads(marker.read_text(encoding="utf-8"))["files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {EXPORT_MARKER} cannot be read ({e})"
    expected = {EXPORT_MARKER, *files, *(p.as_posix() for f in files for p in Path(f).parents if p != Path("."))}
    extra = [e for e in entries if e not in expected]
    return f"it holds files the export did not write ({some(extra)})" if extra else None


def _check_target(target: Path, *, overwrite: bool, store_root: Path | None) -> bool:
    """Refuse an `out` an export must not write or replace; returns whether `out` is replaced."""
    if target.is_symlink():
        raise ConfigError(f"out={os.fspath(target)!r} is a symbolic link; an export never writes through links: pass "
                          "the real folder, or a new one.")
    resolved, store = target.resolve(), (store_root or target).resolve()
    if store_root is not None and (where := "is the store" if resolved == store else "holds the store" if resolved
                                   in store.parents else "is inside the store" if store in resolved.parents else None):
        raise ConfigError(f"out={os.fspath(target)!r} {where} {store_root}: an export never writes into or replaces a "
                          f"store; pass a folder outside it, e.g. {store_root.parent / 'export'}.")
    if not target.exists():
        return False
    if not overwrite:
        raise ConfigError(f"{target} exists: choose a new folder or pass overwrite=True (--overwrite).")
    refuse = f"overwrite=True refuses to replace out={os.fspath(target)!r}:"
    if resolved == (cwd := Path.cwd().resolve()) or resolved in cwd.parents:
        what = "the current directory" if resolved == cwd else f"a folder holding the current directory ({cwd})"
        raise ConfigError(f"{refuse} it is {what}; nothing was deleted. Pass a new folder for the export, e.g. "
                          f"{os.path.join(target, 'export')}.")
    if not target.is_dir():
        raise ConfigError(f"{refuse} it is a file, not a previous export; nothing was deleted. Pass a new folder, or "
                          "remove the file yourself.")
    if any(target.iterdir()) and (why := _not_an_export(target)) is not None:
        raise ConfigError(f"{refuse} {why}; nothing was deleted. overwrite replaces only a previous export (a "
                          f"folder holding {EXPORT_MARKER} and the files it lists): pass a new folder, or empty this "
                          "one yourself.")
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a file or a directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, record: dict[str, Any]) -> None:
    """Fsync what the export wrote, then write `EXPORT_MARKER` listing it (`errors.fault` ``export`` before each)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in [*files, EXPORT_MARKER]:
        fault("export", name=name)
        _fsync(folder / name) if name != EXPORT_MARKER else None
    body = {"export_version": 1, **record, "files": files, "library_version": VERSION}
    (folder / EXPORT_MARKER).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in [folder / EXPORT_MARKER, *(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _fsync(path)


def _move_into_place(tmp: Path, target: Path, *, replaces: bool) -> None:
    """Rename `tmp` to `target`; a previous export there is moved aside, then removed (put back if the rename fails,
    kept if something wrote into it meanwhile)."""
    old = target.parent / f".{target.name}.export-old-{secrets.token_hex(4)}"
    if replaces and any(target.iterdir()):  # onto nothing or an empty folder, a POSIX rename replaces it
        os.rename(target, old)
    try:
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(old, target)
        raise
    _fsync(target.parent)
    if old.exists() and (why := _not_an_export(old)) is not None:
        logger.warning("the previous export %s was moved to %s and kept: %s", target, old, why)
    elif old.exists():
        shutil.rmtree(old)


def _adapters(loaded: LoadedCheckpoint, desc: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """`{adapter: {PEFT key: tensor}}` (a sharded save's keys, the parameters' names, hold the adapter's)."""
    names, weights = list(desc["adapters"]), loaded.weights or {}
    if KEY_SHARDED not in loaded.extra:
        return split_adapters(weights, names)
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, tensor in weights.items():
        owner = next((n for n in names if f".{n}." in key or key.endswith(f".{n}")), names[0])
        out[owner][key.replace(f".{owner}", "")] = tensor
    return out


def _peft_config(desc: dict[str, Any], name: str, **kw: Any) -> Any:
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**{k: v for k, v in desc["adapters"][name].items() if k != "auto_mapping"} | kw)


def _write_peft(loaded: LoadedCheckpoint, desc: dict[str, Any], folder: Path, base: Any) -> None:
    """PEFT's folder, as `save_pretrained` writes it: the active (or only) adapter at the top, others in sub-folders."""
    from safetensors.torch import save_file

    adapters = _adapters(loaded, desc)
    for name, weights in adapters.items():
        where = folder if name == desc.get("active_adapter") or len(adapters) == 1 else folder / name
        _peft_config(desc, name, inference_mode=True).save_pretrained(os.fspath(where))
        save_file({k: t.contiguous() for k, t in weights.items()}, where / "adapter_model.safetensors",
                  metadata={"format": "pt"})


def _write_hf(loaded: LoadedCheckpoint, desc: dict[str, Any], folder: Path, base: Any) -> None:
    """transformers' `save_pretrained` of the recorded config's model, built on the meta device, given the tensors."""
    import transformers

    step, fix = loaded.info.step, "use load_checkpoint(root, ref, model=model) in a script instead."
    if not isinstance(desc.get("config"), dict):
        raise ConfigError(f"step {step} holds a plain torch module (no transformers config): {fix}")
    try:
        config = transformers.AutoConfig.for_model(**desc["config"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"step {step}: transformers cannot build the recorded config ({e}): rebuild the model in a "
                          "script and use load_checkpoint(root, ref, model=model) + model.save_pretrained(out).") from e
    arch = getattr(transformers, (config.architectures or [""])[0], None)
    with torch.device("meta"):  # no memory: the checkpoint's tensors are assigned below
        model = arch(config) if arch is not None else transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.weights or {}, strict=False, assign=True)
    model.tie_weights()
    if missing := [k for k, t in model.state_dict().items() if t.is_meta]:
        raise ConfigError(f"step {step} lacks weights of the model its config describes ({', '.join(missing[:5])}): "
                          f"{fix}")
    model.save_pretrained(folder)


def _write_merged(loaded: LoadedCheckpoint, desc: dict[str, Any], folder: Path,
                  base: str | os.PathLike[str] | None) -> None:
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    adapters = _adapters(loaded, desc)
    if not (source := base or desc.get("base_model")):
        raise ConfigError("format='merged' needs the base weights: pass base=PATH (--base) to a local model folder.")
    model = AutoModelForCausalLM.from_pretrained(os.fspath(source), revision=desc.get("revision"))
    active = desc.get("active_adapter") or next(iter(adapters))
    peft_model = get_peft_model(model, _peft_config(desc, active), adapter_name=active)
    set_peft_model_state_dict(peft_model, adapters[active], adapter_name=active)
    peft_model.merge_and_unload().save_pretrained(folder)


_WRITERS = {"peft": _write_peft, "hf": _write_hf, "merged": _write_merged}

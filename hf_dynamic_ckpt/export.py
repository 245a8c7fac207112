"""Getting a model out of a checkpoint: `describe_model`, `export_checkpoint`, `load_checkpoint`.

Every checkpoint's manifest records, under ``extra["model"]``, what rebuilding a loadable model
needs (`describe_model`): the model's ``config.json`` content, the PEFT config of every adapter,
the base model's name and revision when known, the dtype and, when the run had one, the
tokenizer's name. `export_checkpoint` turns a checkpoint into a folder Hugging Face loads:

==========  =====================================================  ==========================================
format      what is written                                        load it with
==========  =====================================================  ==========================================
``peft``    ``adapter_config.json`` + ``adapter_model.safetensors`` ``PeftModel.from_pretrained(base, OUT)``
            per adapter (others in sub-folders, as PEFT does)
``hf``      ``config.json`` + ``model.safetensors`` (full FT)       ``AutoModelForCausalLM.from_pretrained(OUT)``
``merged``  the base model with the adapter merged in (needs the    ``AutoModelForCausalLM.from_pretrained(OUT)``
            base weights: ``base=``)
==========  =====================================================  ==========================================

`root` is the store directory or the training ``output_dir`` holding ``smart_ckpt/``
(`store.store.find_root`, as for the command line); reading opens the store so that nothing
is created or changed there (``read_only=True``). ``auto``, ``best`` and ``fastest``
pass over a checkpoint that fails verification to the next one; every checkpoint they passed
over is named, with the reason, in `LoadedCheckpoint.warnings` (and logged).

An export is written into a temporary folder next to `out` and renamed into place, with
`EXPORT_MARKER` (the store, task, step and format, and the files it wrote) written last.
``overwrite=True`` replaces only a folder that marker shows to be a previous export and that
holds nothing else, never the store, a folder holding it, or the current directory; the old
export is removed only once the new one is in place.

`load_checkpoint` is the plain-script counterpart of resuming: verified weights (and the
other tiers) of a checkpoint, optionally put straight into a model.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import secrets
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ._version import VERSION
from .constants import ADAPTER_KEY_SEP, ALL_TIERS, DEFAULT_TASK_ID, WEIGHTS_NAME, Tier
from .errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from .state.model import adapter_names, apply_weights, split_adapters
from .store import (
    NAMED_REFS,
    STATUS_MISSING,
    STATUS_OK,
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    find_root,
    is_url,
)
from .store.shard_files import is_sharded

logger = logging.getLogger(__name__)

KEY_MODEL = "model"
"""Key of the model description in the manifest's `extra`."""

FORMATS = ("peft", "hf", "merged")
EXPORT_MARKER = "hf_dynamic_ckpt_export.json"
"""Written last into every export folder: what it holds (store, task, step, format, files). ``overwrite=True``
replaces only a folder with this marker whose files are the ones it lists."""
EXPORT_MARKER_VERSION = 1
"""Version of the `EXPORT_MARKER` content (its ``"export_version"`` key)."""
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _jsonable(obj: Any) -> Any:
    """Config values as strict JSON the way PEFT / transformers write them (sets -> sorted lists)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, set | frozenset):
        return sorted(_jsonable(v) for v in obj)
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def describe_model(model: nn.Module, *, tokenizer: Any | None = None) -> dict[str, Any]:
    """What rebuilding `model` needs, as JSON (stored in every manifest's ``extra["model"]``).

    Args:
        model (`nn.Module`): a transformers model, a PEFT model over one, or any module.
        tokenizer (*optional*): the run's tokenizer / processor; its ``name_or_path`` is recorded.

    Returns:
        `dict`: ``{"kind": "peft"|"transformers"|"module", "config": {...} | None, "adapters":
        {name: peft config}, "active_adapter", "base_model", "revision", "dtype", "tokenizer"}``.
    """
    base = model
    adapters: dict[str, Any] = {}
    names = adapter_names(model)
    if names:
        base = model.get_base_model()  # type: ignore[operator]
        peft_configs: Any = model.peft_config
        adapters = {name: _jsonable(peft_configs[name].to_dict()) for name in names}
    config: Any = getattr(base, "config", None)
    config_dict = _jsonable(config.to_dict()) if config is not None and hasattr(config, "to_dict") else None
    first = next(iter(model.parameters()), None)
    base_name = (config_dict or {}).get("_name_or_path") or None
    revision = None
    if adapters:
        first_cfg = next(iter(adapters.values()))
        base_name = first_cfg.get("base_model_name_or_path") or base_name
        revision = first_cfg.get("revision")
    return {
        "kind": "peft" if adapters else ("transformers" if config_dict is not None else "module"),
        "config": config_dict,
        "adapters": adapters,
        "active_adapter": names[0] if names else None,
        "base_model": base_name,
        "revision": revision,
        "dtype": _jsonable(first.dtype) if first is not None else None,
        "tokenizer": getattr(tokenizer, "name_or_path", None) or None,
    }


def _open(root: str | os.PathLike[str], task_id: str | None) -> CheckpointStore:
    """A store opened to read: a local root through `find_root`, ``read_only`` (nothing created or changed)."""
    task = task_id or DEFAULT_TASK_ID
    if is_url(os.fspath(root)):  # the object store is read into a local cache; the bucket is not written
        return CheckpointStore(root, task_id=task, cleanup=False)
    return CheckpointStore(find_root(root), task_id=task, read_only=True)


def _ahead(ref: str, info: CheckpointInfo, chosen: CheckpointInfo) -> bool:
    """Whether `ref` (auto, best, fastest) ranks `info` before `chosen` (the order of `CheckpointStore.resolve`)."""
    if ref == "best":
        return info.loss is not None and chosen.loss is not None and (info.loss, -info.step) < (chosen.loss,
                                                                                               -chosen.step)
    if ref == "fastest":
        def cost(i: CheckpointInfo) -> tuple[float, int]:
            return (float("inf") if i.recovery_cost_ms is None else i.recovery_cost_ms, -i.step)

        return cost(info) < cost(chosen)
    return info.step > chosen.step


def _why_hidden(store: CheckpointStore, info: CheckpointInfo) -> str:
    """Why `resolve` passes over `info` (flagged missing, corrupt or unhealthy), in words."""
    if info.status == STATUS_MISSING:
        return "its directory or manifest is gone (status missing)"
    if info.status != STATUS_OK:
        try:
            problems = store.verify(info)
        except CheckpointNotFoundError:
            return "it was deleted meanwhile"
        return ("failed verification: " + "; ".join(problems)) if problems else f"marked {info.status}"
    return (f"saved as unhealthy ({info.reason or 'no reason recorded'}); auto, best and fastest never choose one: "
            f"pass step:{info.step} to take it")


def _load(store: CheckpointStore, ref: str | int, tiers: Collection[Tier]) -> tuple[LoadedCheckpoint, list[str]]:
    """`store.load(ref)` (a sharded checkpoint's weights gathered whole), and what `ref` passed over: a named ref
    moves past a checkpoint that fails verification;
    each checkpoint it ranked before the chosen one but passed over gets a note (also first in `warnings`)."""
    if isinstance(ref, int) or os.fspath(ref) not in NAMED_REFS:
        loaded = store.load(ref, tiers=tiers, mmap=False)
        store.gather_weights(loaded)  # a sharded (FSDP2 / ZeRO) checkpoint's whole tensors from every rank's files
        return loaded, []
    ref = os.fspath(ref)
    failed: dict[int, str] = {}
    while True:
        try:
            info = store.resolve(ref)
        except CheckpointNotFoundError as e:
            if not failed:
                raise
            raise CheckpointNotFoundError(f"{e} Passed over: " + "; ".join(
                f"step {step}: {why}" for step, why in sorted(failed.items(), reverse=True))) from e
        try:
            loaded = store.load(info, tiers=tiers, mmap=False)
            break
        except CorruptCheckpointError as e:  # the load marked it corrupt: the next resolve passes over it
            if info.step in failed:
                raise
            failed[info.step] = str(e)
    store.gather_weights(loaded)
    chosen = loaded.info
    notes = [f"skipped step {i.step}: {_why_hidden(store, i)}" for i in store.list(include_unhealthy=True)
             if i.step != chosen.step and Tier.WEIGHTS in i.tiers and _ahead(ref, i, chosen)]
    loaded.warnings[:0] = notes
    return loaded, notes


def _log_skipped(notes: list[str], ref: str | int, step: int) -> None:
    for note in notes:
        logger.warning("%s (%r chose step %d)", note, ref, step)


def load_checkpoint(root: str | os.PathLike[str], ref: str | int = "auto", *, model: nn.Module | None = None,
                    task_id: str | None = None, tiers: Collection[Tier] = ALL_TIERS) -> LoadedCheckpoint:
    """Read a checkpoint (verified) for a plain script; with `model`, put its weights into it.

    Reading changes nothing under `root`: no catalog, lock or folder is created (``read_only=True``).

    Args:
        root (`str`): the store directory (e.g. ``out/smart_ckpt``) or the training output_dir holding
            ``smart_ckpt/`` (e.g. ``out``), or a URL root.
        ref (`str` or `int`, *optional*, defaults to `"auto"`): `auto`, `best`, `fastest`, `step:N`, a path.
            `auto`, `best` and `fastest` pass over a checkpoint that fails verification to the next one;
            `warnings` names every checkpoint passed over and why.
        model (`nn.Module`, *optional*): receives the weights (names and shapes checked).
        task_id (`str`, *optional*): the run's task (default ``"default"``).
        tiers (*optional*): what to read (default: every tier).

    Returns:
        `LoadedCheckpoint`: weights, optimizer / scheduler state, RNG, data position, manifest, warnings.

    Raises:
        `CheckpointNotFoundError`: `root` does not exist or holds no store, or `ref` names no loadable checkpoint.
        `ConfigError`: `root` is a file or a task / checkpoint folder (the message names the store to pass), or
            the checkpoint holds no weights while `model` is given.
        `CorruptCheckpointError`: `ref` names one checkpoint (`step:N`, a path) that fails verification.

    Example:
        ```python
        >>> model = AutoModelForCausalLM.from_config(config)
        >>> load_checkpoint("out/smart_ckpt", "best", model=model)
        ```
    """
    store = _open(root, task_id)
    try:
        loaded, skipped = _load(store, ref, tiers)
    finally:
        store.close()
    _log_skipped(skipped, ref, loaded.info.step)
    if model is not None:
        if loaded.weights is None:
            raise ConfigError(f"step {loaded.info.step} holds no weights tier; choose another checkpoint.")
        apply_weights(model, loaded.weights)
    return loaded


def export_checkpoint(root: str | os.PathLike[str], ref: str | int, out: str | os.PathLike[str], *,
                      format: str = "peft", base: str | os.PathLike[str] | None = None,
                      task_id: str | None = None, overwrite: bool = False) -> Path:
    """Write a checkpoint as a folder that PEFT / transformers load (see the module docstring).

    Args:
        root (`str`): the store directory or the training output_dir holding ``smart_ckpt/``.
        ref (`str` or `int`): `auto`, `best`, `fastest`, `step:N` or a path.
        out (`str`): the folder to create (must not exist unless `overwrite`).
        format (`str`, *optional*, defaults to `"peft"`): `peft`, `hf` or `merged`.
        base (`str`, *optional*): a local model folder with the base weights (`merged` only;
            defaults to the recorded base model name, which must then be loadable offline).
        task_id (`str`, *optional*): the run's task.
        overwrite (`bool`, *optional*, defaults to `False`): replace `out` when it is a previous export
            (it holds `EXPORT_MARKER` and only the files that marker lists) or an empty folder.

    Returns:
        `Path`: `out`.

    Raises:
        `ConfigError`: an unknown format, a format that does not fit the checkpoint (e.g. `peft`
            for a full fine-tune), `out` exists (without `overwrite`), `out` cannot be replaced (it is not a
            previous export, holds other files, is the store, holds or is inside it, or is the current
            directory: nothing is deleted), or the manifest records no model description (checkpoints
            written by versions that did not record it).
        `CheckpointNotFoundError`: `root` holds no store, or `ref` names no loadable checkpoint.

    Example:
        ```python
        >>> export_checkpoint("out", "auto", "adapter", format="peft", overwrite=True)
        PosixPath('adapter')
        ```
    """
    exported = export_step(root, ref, out, format=format, base=base, task_id=task_id, overwrite=overwrite)
    _log_skipped(exported.skipped, ref, exported.step)
    return exported.path


class Exported(NamedTuple):
    """What `export_step` wrote."""

    path: Path
    step: int
    skipped: list[str]
    """One line per checkpoint `ref` ranked before `step` but passed over, with the reason (``skipped step N: ...``);
    the caller reports them (`export_checkpoint` logs them, the command line prints them)."""


def export_step(root: str | os.PathLike[str], ref: str | int, out: str | os.PathLike[str], *, format: str = "peft",
                base: str | os.PathLike[str] | None = None, task_id: str | None = None,
                overwrite: bool = False) -> Exported:
    """`export_checkpoint`, also returning the step that was exported and what `ref` passed over (not logged)."""
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} is invalid: expected one of {', '.join(FORMATS)}.")
    target = Path(out)
    store_root = None if is_url(os.fspath(root)) else find_root(root)
    replaces = _check_target(target, overwrite=overwrite, store_root=store_root)
    task = task_id or DEFAULT_TASK_ID
    store = _open(root, task_id) if store_root is None else CheckpointStore(store_root, task_id=task, read_only=True)
    try:
        loaded, skipped = _load(store, ref, {Tier.WEIGHTS})
    finally:
        store.close()
    if loaded.weights is None:
        raise ConfigError(f"step {loaded.info.step} holds no weights tier ({'; '.join(loaded.warnings)}): export "
                          "another checkpoint (auto, best and fastest choose only ones with weights).")
    desc = loaded.extra.get(KEY_MODEL)
    if not isinstance(desc, dict):
        raise ConfigError(
            f"step {loaded.info.step} records no model description (written before hf_dynamic_ckpt 0.2): rebuild the "
            "model in a script and use load_checkpoint(root, ref, model=model) + model.save_pretrained(out)."
        )
    peft = desc.get("kind") == "peft"
    if format in ("peft", "merged") and not peft:
        raise ConfigError(f"format={format!r} needs a PEFT checkpoint; step {loaded.info.step} holds a full model: "
                          "use format='hf'.")
    if format == "hf" and peft:
        raise ConfigError(f"format='hf' writes a full model; step {loaded.info.step} holds LoRA adapters only: use "
                          "format='peft', or format='merged' with the base weights.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.export-tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if format == "peft":
            _write_peft(loaded, desc, tmp)
        elif format == "hf":
            _write_hf(loaded, desc, tmp)
        else:
            _write_merged(loaded, desc, tmp, base)
        _write_marker(tmp, {"store": os.fspath(root if store_root is None else store_root.absolute()),
                            "task": loaded.info.task_id,
                            "step": loaded.info.step, "ref": os.fspath(ref) if not isinstance(ref, int) else ref,
                            "format": format})
        _move_into_place(tmp, target, replaces=replaces)
    finally:
        if tmp.exists():  # the export failed before its rename: only this call's own folder goes
            shutil.rmtree(tmp)
    logger.debug("exported step %d of %s as %s to %s", loaded.info.step, root, format, target)
    return Exported(target, loaded.info.step, skipped)


# -- the export folder: checked before anything is read, written aside, renamed into place -----------------
def _entries(folder: Path) -> set[str]:
    """Every file, folder and link under `folder` (links not followed), as relative POSIX paths."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            out.add((Path(dirpath) / name).relative_to(folder).as_posix())
    return out


def _expected_entries(files: list[str]) -> set[str]:
    """The recorded files and the folders that hold them."""
    out = set(files)
    for f in files:
        out.update(p.as_posix() for p in Path(f).parents if p != Path("."))
    return out


def _not_an_export(folder: Path) -> str | None:
    """Why `folder` is not a previous export holding only what its marker lists (None: it is one)."""
    marker = folder / EXPORT_MARKER
    entries = _entries(folder)
    if not marker.is_file() or marker.is_symlink():
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        return f"it is not a previous export (no {EXPORT_MARKER}; it holds {shown})"
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        files = [str(f) for f in record["files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {EXPORT_MARKER} cannot be read ({e})"
    extra = sorted(entries - _expected_entries(files) - {EXPORT_MARKER})
    if extra:
        return f"it holds files the export did not write ({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})"
    return None


def _check_target(target: Path, *, overwrite: bool, store_root: Path | None) -> bool:
    """Refuse an `out` that an export must not write or replace; returns whether `out` exists and is replaced."""
    if target.is_symlink():
        raise ConfigError(f"out={os.fspath(target)!r} is a symbolic link; an export never writes through links: pass "
                          "the real folder, or a new one.")
    resolved = target.resolve()
    if store_root is not None:
        store = store_root.resolve()
        where = ("is the store" if resolved == store else "holds the store" if resolved in store.parents
                 else "is inside the store" if store in resolved.parents else None)
        if where is not None:
            raise ConfigError(f"out={os.fspath(target)!r} {where} {store_root}: an export never writes into or "
                              f"replaces a store; pass a folder outside it, e.g. {store_root.parent / 'export'}.")
    if not target.exists():
        return False
    if not overwrite:
        raise ConfigError(f"{target} exists: choose a new folder or pass overwrite=True (--overwrite).")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        what = "the current directory" if resolved == cwd else f"a folder holding the current directory ({cwd})"
        raise ConfigError(f"overwrite=True refuses to replace out={os.fspath(target)!r}: it is {what}; nothing was "
                          f"deleted. Pass a new folder for the export, e.g. {os.path.join(target, 'export')}.")
    if not target.is_dir():
        raise ConfigError(f"overwrite=True refuses to replace out={os.fspath(target)!r}: it is a file, not a previous "
                          "export; nothing was deleted. Pass a new folder, or remove the file yourself.")
    why = None if not any(target.iterdir()) else _not_an_export(target)
    if why is not None:
        raise ConfigError(f"overwrite=True refuses to replace out={os.fspath(target)!r}: {why}; nothing was deleted. "
                          f"overwrite replaces only a previous export (a folder holding {EXPORT_MARKER} and the files "
                          "it lists): pass a new folder, or empty this one yourself.")
    return True


def _fsync(path: Path) -> None:
    """Make a written file, or the entries of a directory, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, record: dict[str, Any]) -> None:
    """Fsync what the export wrote, then write `EXPORT_MARKER` (listing it) last."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in files:
        _fsync(folder / name)
    body = {"export_version": EXPORT_MARKER_VERSION, **record, "files": files, "library_version": VERSION}
    with open(folder / EXPORT_MARKER, "w", encoding="utf-8") as f:
        f.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(folder / name).parent for name in files} | {folder}, reverse=True):
        _fsync(sub)


def _move_into_place(tmp: Path, target: Path, *, replaces: bool) -> None:
    """Rename the complete export `tmp` to `target`; a previous export there is moved aside first and removed
    only once the new one is in place (put back if the rename fails)."""
    if not replaces or not any(target.iterdir()):
        os.replace(tmp, target)  # onto nothing, or onto an empty folder (POSIX rename replaces it)
        _fsync(target.parent)
        return
    old = target.parent / f".{target.name}.export-old-{secrets.token_hex(4)}"
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(old, target)
        raise
    _fsync(target.parent)
    why = _not_an_export(old)
    if why is not None:  # something wrote into it between the check and the rename: keep it
        logger.warning("the previous export %s was moved to %s and kept: %s", target, old, why)
        return
    shutil.rmtree(old)


def _save(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():  # aliased (tied) tensors are written once per name
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        out[key] = t.detach().clone().contiguous() if ptr is not None and ptr in seen else t.detach().contiguous()
        if ptr is not None:
            seen.add(ptr)
    save_file(out, str(path), metadata=metadata)


def _write_peft(loaded: LoadedCheckpoint, desc: dict[str, Any], target: Path) -> None:
    adapters: dict[str, Any] = desc.get("adapters") or {}
    names = list(adapters)
    sharded = is_sharded(loaded.manifest)
    saved = _peft_keys(loaded.weights or {}, names) if sharded else loaded.weights or {}
    for name, weights in split_adapters(saved, names).items():
        folder = target if name == desc.get("active_adapter") or len(names) == 1 else target / name
        folder.mkdir(exist_ok=True)
        config = dict(adapters[name])
        config["inference_mode"] = True
        (folder / _ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        source = Path(loaded.info.path) / WEIGHTS_NAME
        if len(names) == 1 and not loaded.manifest.get("blobs") and not sharded:
            shutil.copyfile(source, folder / _ADAPTER_WEIGHTS)  # byte-identical to PEFT's own file
        else:
            _save(weights, folder / _ADAPTER_WEIGHTS, {"format": "pt"})


def _peft_keys(weights: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """A sharded save names adapter weights as the model's parameters (``...lora_A.default.weight``); PEFT's files
    (and `split_adapters`) name them without the adapter (``...lora_A.weight``), prefixed ``<adapter>::`` when there
    are several."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        owner = next((n for n in names if f".{n}." in key or key.endswith(f".{n}")), None)
        if owner is None:
            out[key] = tensor
            continue
        plain = key.replace(f".{owner}", "")
        out[plain if len(names) <= 1 else f"{owner}{ADAPTER_KEY_SEP}{plain}"] = tensor
    return out


def _write_hf(loaded: LoadedCheckpoint, desc: dict[str, Any], target: Path) -> None:
    config = desc.get("config")
    if not isinstance(config, dict):
        raise ConfigError(f"step {loaded.info.step} holds a plain torch module (no transformers config): use "
                          "load_checkpoint(root, ref, model=model) in a script instead.")
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _save(loaded.weights or {}, target / "model.safetensors", {"format": "pt"})


def _write_merged(loaded: LoadedCheckpoint, desc: dict[str, Any], target: Path,
                  base: str | os.PathLike[str] | None) -> None:
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    source = base or desc.get("base_model")
    if not source:
        raise ConfigError("format='merged' needs the base weights: pass base=PATH (--base) to a local model folder.")
    model = AutoModelForCausalLM.from_pretrained(os.fspath(source), revision=desc.get("revision"))
    adapters: dict[str, Any] = desc.get("adapters") or {}
    active = desc.get("active_adapter") or next(iter(adapters))
    config = PeftConfig.from_peft_type(**{k: v for k, v in adapters[active].items() if k != "auto_mapping"})
    peft_model = get_peft_model(model, config, adapter_name=active)
    weights = split_adapters(loaded.weights or {}, list(adapters))[active]
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(peft_model, weights, adapter_name=active)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(target)

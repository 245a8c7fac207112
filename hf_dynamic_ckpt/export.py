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
(`store.locate.find_root`, as for the command line); reading opens the store so that nothing
is created or changed there (`store.locate.open_reader`).

`load_checkpoint` is the plain-script counterpart of resuming: verified weights (and the
other tiers) of a checkpoint, optionally put straight into a model.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .constants import ALL_TIERS, DEFAULT_TASK_ID, WEIGHTS_NAME, Tier
from .errors import ConfigError
from .state.model import adapter_names, apply_weights, split_adapters
from .store.locate import find_root, open_reader
from .store.remote import is_url
from .store.store import CheckpointStore
from .store.types import LoadedCheckpoint

logger = logging.getLogger(__name__)

KEY_MODEL = "model"
"""Key of the model description in the manifest's `extra`."""

FORMATS = ("peft", "hf", "merged")
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
    """A store opened to read: a local root through `find_root` / `open_reader` (nothing created or changed)."""
    task = task_id or DEFAULT_TASK_ID
    if is_url(os.fspath(root)):  # the object store is read into a local cache; the bucket is not written
        return CheckpointStore(root, task_id=task, cleanup=False)
    return open_reader(find_root(root), task)


def load_checkpoint(root: str | os.PathLike[str], ref: str | int = "auto", *, model: nn.Module | None = None,
                    task_id: str | None = None, tiers: Collection[Tier] = ALL_TIERS) -> LoadedCheckpoint:
    """Read a checkpoint (verified) for a plain script; with `model`, put its weights into it.

    Reading changes nothing under `root`: no catalog, lock or folder is created (`store.locate.open_reader`).

    Args:
        root (`str`): the store directory (e.g. ``out/smart_ckpt``) or the training output_dir holding
            ``smart_ckpt/`` (e.g. ``out``), or a URL root.
        ref (`str` or `int`, *optional*, defaults to `"auto"`): `auto`, `best`, `fastest`, `step:N`, a path.
        model (`nn.Module`, *optional*): receives the weights (names and shapes checked).
        task_id (`str`, *optional*): the run's task (default ``"default"``).
        tiers (*optional*): what to read (default: every tier).

    Returns:
        `LoadedCheckpoint`: weights, optimizer / scheduler state, RNG, data position, manifest.

    Raises:
        `CheckpointNotFoundError`: `root` does not exist or holds no store, or `ref` names no committed checkpoint.
        `ConfigError`: `root` is a file or a task / checkpoint folder (the message names the store to pass), or
            the checkpoint holds no weights while `model` is given.

    Example:
        ```python
        >>> model = AutoModelForCausalLM.from_config(config)
        >>> load_checkpoint("out/smart_ckpt", "best", model=model)
        ```
    """
    store = _open(root, task_id)
    try:
        loaded = store.load(ref, tiers=tiers, mmap=False)
    finally:
        store.close()
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
            ref: `auto`, `best`, `fastest`, `step:N` or a path.
        out (`str`): the folder to create (must not exist unless `overwrite`).
        format (`str`, *optional*, defaults to `"peft"`): `peft`, `hf` or `merged`.
        base (`str`, *optional*): a local model folder with the base weights (`merged` only;
            defaults to the recorded base model name, which must then be loadable offline).
        task_id (`str`, *optional*): the run's task. overwrite (`bool`): replace `out`.

    Returns:
        `Path`: `out`.

    Raises:
        `ConfigError`: an unknown format, a format that does not fit the checkpoint (e.g. `peft`
            for a full fine-tune), `out` exists, or the manifest records no model description
            (checkpoints written by versions that did not record it).
    """
    return export_step(root, ref, out, format=format, base=base, task_id=task_id, overwrite=overwrite)[0]


def export_step(root: str | os.PathLike[str], ref: str | int, out: str | os.PathLike[str], *, format: str = "peft",
                base: str | os.PathLike[str] | None = None, task_id: str | None = None,
                overwrite: bool = False) -> tuple[Path, int]:
    """`export_checkpoint`, also returning the step that was exported."""
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} is invalid: expected one of {', '.join(FORMATS)}.")
    target = Path(out)
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} exists: choose a new folder or pass overwrite=True (--overwrite).")
    loaded = load_checkpoint(root, ref, task_id=task_id, tiers={Tier.WEIGHTS})
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
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    assert loaded.weights is not None
    if format == "peft":
        _write_peft(loaded, desc, target)
    elif format == "hf":
        _write_hf(loaded, desc, target)
    else:
        _write_merged(loaded, desc, target, base)
    logger.debug("exported step %d of %s as %s to %s", loaded.info.step, root, format, target)
    return target, loaded.info.step


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
    for name, weights in split_adapters(loaded.weights or {}, names).items():
        folder = target if name == desc.get("active_adapter") or len(names) == 1 else target / name
        folder.mkdir(exist_ok=True)
        config = dict(adapters[name])
        config["inference_mode"] = True
        (folder / _ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        source = Path(loaded.info.path) / WEIGHTS_NAME
        if len(names) == 1 and not loaded.manifest.get("blobs"):
            shutil.copyfile(source, folder / _ADAPTER_WEIGHTS)  # byte-identical to PEFT's own file
        else:
            _save(weights, folder / _ADAPTER_WEIGHTS, {"format": "pt"})


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

"""The minimal folder `Trainer.train(resume_from_checkpoint=...)` reads, made from a store checkpoint.

``<root>/.resume/<task>-step-<N>/`` holds `trainer_state.json` (the stored `TrainerState`) and the
weights as a hard link of the stored safetensors file (or, for several PEFT adapters, one
file per adapter: the ``default`` adapter at the top, the others in sub-folders named after
them, which is how Trainer finds them). The callback has copied the verified weights into the model already
(`load_once`): Trainer's own load of this folder is skipped, so the weights are read once; the file is there for a
Trainer that loads anyway. No `optimizer.pt` / `scheduler.pt`: the callback loads
L1 from the store straight into Trainer's optimizer. No `rng_state[_R].pth` either: the callback
restores each rank's RNG itself, once the first resumed step has fetched its batches.

The folder's location comes from this run's store (its root and task), never from a manifest,
and only entries under ``<root>/.resume`` that are real directories are ever removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState

from .. import distributed as dist
from ..constants import (
    KEY_EPOCH,
    KEY_TRAINER_STATE,
    RESUME_DIR,
    TRAINER_ADAPTER_WEIGHTS_NAME,
    TRAINER_STATE_NAME,
    TRAINER_WEIGHTS_NAME,
    WEIGHTS_NAME,
)
from ..errors import ConfigError
from ..state import adapter_names, apply_weights, is_peft_model, own_weights, split_adapters
from ..store import LoadedCheckpoint

logger = logging.getLogger(__name__)


def resume_folder(root: Path, task_id: str, step: int) -> Path:
    """``<root>/.resume/<task>-step-<N>`` (from this run's store, never from a manifest)."""
    return Path(root).absolute() / RESUME_DIR / f"{task_id}-step-{int(step)}"


def remove_resume_folders(root: Path, task_id: str, step: int | None = None) -> None:
    """Remove this task's resume folders (only the one of `step`, when given): real directories directly under
    ``<root>/.resume`` only."""
    base = Path(root).absolute() / RESUME_DIR
    if not base.is_dir() or base.is_symlink():
        return
    prefix = f"{task_id}-step-"
    for entry in base.iterdir():
        if (entry.name == f"{prefix}{step}" if step is not None else entry.name.startswith(prefix)) \
                and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.rmdir()  # only when empty: other tasks' folders stay


KEY_DATA_STEPS = "data_steps"
"""Key of the Trainer data position in a checkpoint's sampler state: optimizer-step windows consumed."""


def materialise_trainer_folder(loaded: LoadedCheckpoint, trainer: Any, root: Path, task_id: str) -> Path:
    """Write the folder for `loaded` (rank 0; every rank waits for it); returns it. Under DeepSpeed it holds the
    Trainer state only: the callback reads the ZeRO state into the engine at train begin (`skip_deepspeed_load`)."""
    folder = resume_folder(root, task_id, loaded.info.step)
    if dist.is_main():
        remove_resume_folders(root, task_id)
        folder.mkdir(parents=True)
        _write_trainer_state(folder, loaded, trainer)
        if not getattr(trainer, "is_deepspeed_enabled", False):
            _write_weights(folder, loaded, trainer.model)
    dist.barrier()
    return folder


_DEEPSPEED_SKIPS: set[str] = set()
"""Resume folders whose DeepSpeed load Trainer skips (`skip_deepspeed_load`)."""
_WRAPPERS: list[Any] = []
"""The wrapper `skip_deepspeed_load` put in place of ``transformers.trainer.deepspeed_load_checkpoint`` (once)."""


def skip_deepspeed_load(trainer: Any, folder: Path) -> None:
    """Make `Trainer.train(resume_from_checkpoint=folder)` under DeepSpeed leave the engine's state to the callback.

    Trainer resumes a DeepSpeed run with ``deepspeed_load_checkpoint(engine, folder)`` (DeepSpeed's own pickled
    ``global_step*`` files, which the folder does not have: it raises) and then loads ``folder/scheduler.pt``
    (``Trainer._load_optimizer_and_scheduler``). The first is a name of ``transformers.trainer``, wrapped once per
    process: the wrapper skips the folders registered here and calls DeepSpeed's load for any other path; the second
    is this instance's method, wrapped once for `folder`. The callback then reads the weights, master weights and
    moments into the engine's partitions, and the scheduler, at ``on_train_begin`` (the engine exists by then).
    """
    import transformers.trainer as trainer_module

    target = os.path.abspath(folder)
    _DEEPSPEED_SKIPS.add(target)
    current = trainer_module.deepspeed_load_checkpoint
    if current not in _WRAPPERS:
        def deepspeed_load_checkpoint(engine: Any, checkpoint_path: str, *args: Any, **kwargs: Any) -> Any:
            if os.path.abspath(checkpoint_path) in _DEEPSPEED_SKIPS:
                logger.debug("%s: the ZeRO state is read by SmartCkptCallback at train begin", checkpoint_path)
                return None
            return current(engine, checkpoint_path, *args, **kwargs)

        _WRAPPERS.append(deepspeed_load_checkpoint)
        trainer_module.deepspeed_load_checkpoint = deepspeed_load_checkpoint  # type: ignore[assignment]
    original = trainer._load_optimizer_and_scheduler
    own = vars(trainer).get("_load_optimizer_and_scheduler")

    def _load_optimizer_and_scheduler(checkpoint: str | None) -> None:
        if checkpoint is not None and os.path.abspath(checkpoint) == target:
            if own is None:
                del trainer._load_optimizer_and_scheduler
            else:
                trainer._load_optimizer_and_scheduler = own
            return None
        return original(checkpoint)

    trainer._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def forget_deepspeed_skip(folder: Path) -> None:
    """The folder was used (or removed): a later DeepSpeed load of the same path is DeepSpeed's again."""
    _DEEPSPEED_SKIPS.discard(os.path.abspath(folder))


def _write_trainer_state(folder: Path, loaded: LoadedCheckpoint, trainer: Any) -> None:
    state = loaded.extra.get(KEY_TRAINER_STATE)
    if state is None:  # saved by another integration: the step and epoch are enough to resume
        args = trainer.args
        ts = TrainerState(global_step=loaded.info.step, epoch=float(loaded.manifest.get(KEY_EPOCH) or 0.0),
                          train_batch_size=trainer._train_batch_size, logging_steps=args.logging_steps,
                          eval_steps=args.eval_steps, save_steps=args.save_steps)
        state = dataclasses.asdict(ts)
    else:
        state = dict(state)
    # Trainer derives the data to skip from global_step. After a rollback the run has consumed more batches than
    # it applied updates (the rolled-back ones), so the folder names the data position; `SmartCkptCallback` puts
    # the true step back at train begin.
    state["global_step"] = data_steps(loaded)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def data_steps(loaded: LoadedCheckpoint) -> int:
    """Optimizer-step windows of data the run had consumed at `loaded` (its step, unless a rollback skipped some)."""
    sampler = loaded.sampler or {}
    value = sampler.get(KEY_DATA_STEPS) if sampler.get("kind") == "trainer" else None
    return value if isinstance(value, int) and value >= loaded.info.step else loaded.info.step


def _write_weights(folder: Path, loaded: LoadedCheckpoint, model: Any) -> None:
    if loaded.weights is None:
        raise ConfigError(f"checkpoint {loaded.info.path} has no weights tier; resume needs one (choose another step).")
    names = adapter_names(model)
    if len(names) > 1:
        # Trainer loads the top-level adapter file into "default" and every sub-folder into the adapter
        # named after it (the adapters exist already, so no adapter_config.json is needed).
        for adapter, tensors in split_adapters(loaded.weights, names).items():
            target = folder if adapter == "default" else folder / adapter
            target.mkdir(exist_ok=True)
            _save_tensors(tensors, target / TRAINER_ADAPTER_WEIGHTS_NAME)
        return
    target = folder / (TRAINER_ADAPTER_WEIGHTS_NAME if is_peft_model(model) else TRAINER_WEIGHTS_NAME)
    source = Path(loaded.info.path) / WEIGHTS_NAME
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        same_keys = set(f.keys()) == set(loaded.weights)
    if same_keys:
        try:
            os.link(source, target)
            return
        except OSError as e:  # another filesystem: copying the weights is the price
            logger.debug("hard link of %s failed (%s); copying", source, e)
            shutil.copyfile(source, target)
            return
    _save_tensors(loaded.weights, target)  # deduplicated or aliased tensors live outside the file


def _save_tensors(weights: dict[str, torch.Tensor], target: Path) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for key, t in weights.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        tensors[key] = t.clone().contiguous() if ptr is not None and ptr in seen else t.contiguous()
        if ptr is not None:
            seen.add(ptr)
    save_file(tensors, str(target))


def read_targets(trainer: Any) -> dict[str, Any] | None:
    """The tensors a resume reads the weights file into for `load_once` (`state.own_weights`), or `None` where
    `load_once` leaves the weights to Trainer or to PEFT's setter."""
    return (own_weights(trainer.model) or None) if _loads_once(trainer) else None


def _loads_once(trainer: Any) -> bool:
    return not (getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
                or not callable(getattr(trainer, "_load_from_checkpoint", None)))


def load_once(trainer: Any, loaded: LoadedCheckpoint, folder: Path, store: Any) -> None:
    """Put the verified weights of `loaded` into `trainer.model` now and make `Trainer.train` skip its second load of
    `folder` (a read of the whole file into new tensors, then a copy, the model and those tensors in memory at once).

    A full model's parameters and buffers are read straight from the stored file into their own memory (no
    mapping, no tensor in between), normally by the resume itself as it verifies the file (`read_targets`: one
    pass, `loaded.weights` then names the model's tensors); what cannot be (a blob-stored frozen weight, another
    dtype or device) is copied from `loaded.weights`, which then names the model's tensors; a PEFT model's adapters
    go through PEFT's setter.

    Trainer's only hook for it is ``Trainer._load_from_checkpoint``: this instance's is wrapped, and the wrapper
    skips the load only for `folder`, once, into the model the weights went to; anything else (another path, a
    ``model_init`` that built a new model, a sharded model passed explicitly) goes to Trainer's own. A Trainer that
    loads by another route reads the hard-linked file of the folder and gets the same weights.

    A DeepSpeed or FSDP Trainer loads the weights itself: nothing is done for it.
    """
    if loaded.weights is None or not _loads_once(trainer):
        return
    model = trainer.model
    if adapter_names(model):  # adapters are small: PEFT's own setter, which knows their key names
        apply_weights(model, loaded.weights)
    else:
        _read_into_model(model, loaded, store)
    original = trainer._load_from_checkpoint
    own = vars(trainer).get("_load_from_checkpoint")  # an override of this instance's, put back as it was
    target = os.path.abspath(folder)

    def _load_from_checkpoint(resume_from_checkpoint: str, model_arg: Any = None) -> None:
        if model_arg is None and trainer.model is model and os.path.abspath(resume_from_checkpoint) == target:
            if own is None:  # once: the wrapper takes itself off
                del trainer._load_from_checkpoint
            else:
                trainer._load_from_checkpoint = own
            logger.debug("weights of %s are in the model already: Trainer's load skipped", folder)
            return None
        return original(resume_from_checkpoint, model_arg)

    trainer._load_from_checkpoint = _load_from_checkpoint


def _read_into_model(model: Any, loaded: LoadedCheckpoint, store: Any) -> None:
    """`load_once` for a model without adapters (the weights already checked against it by the resume)."""
    assert loaded.weights is not None
    live = model.state_dict()
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    # Read by the resume already: the key's loaded tensor is the model's own.
    done = {k for k, v in loaded.weights.items()
            if k in live and live[k].numel() and v.data_ptr() == live[k].data_ptr()}
    targets = {k: live[k] for k in loaded.weights
               if k not in done and k in live and live[k].data_ptr() in own}
    if targets:
        done |= store.read_weights_into(loaded, targets)
    written = {live[k].data_ptr() for k in done if live[k].numel()}
    rest = {k: v for k, v in loaded.weights.items()
            if k not in done and not (k in live and live[k].numel() and live[k].data_ptr() in written)}
    if rest:  # a tied alias whose tensor was read is skipped above; the rest is copied as Trainer would
        model.load_state_dict(rest, strict=False)
    loaded.weights = {k: live.get(k, v) for k, v in loaded.weights.items()}  # the file's mapping can go

"""Hugging Face `Trainer` integration: `SmartCkptCallback` and `resume_checkpoint`.

A thin adapter over `hf_dynamic_ckpt.checkpointer.Checkpointer`:

- `on_train_begin`: installs the probes (loss hook, gradient norms, memory, SIGTERM flag,
  the pre-clip norm recorder on `trainer.accelerator.clip_grad_norm_`) and, after a
  `resume_checkpoint`, loads the optimizer and scheduler state straight from the store
  into the optimizer and scheduler Trainer has just created (Trainer has already loaded
  everything it will load by then, so nothing overwrites it).
- `on_pre_optimizer_step`: pre-update capture; `on_step_end`: the decision and the save;
  `on_log`: `smart_ckpt/*` metrics; `on_train_end`: waits for the last write.

Resume: `resume_checkpoint(trainer, spec)` chooses and verifies the restore point (rank 0
decides, every rank checks its own files) and materialises a *minimal* Trainer checkpoint
folder under `<root>/.resume/`: `trainer_state.json`, the weights as a hard link of the
stored safetensors file, and `rng_state[_R].pth`. It holds no `optimizer.pt` /
`scheduler.pt`, so Trainer skips its own optimizer loading and the optimizer state is
never rewritten into another format. Trainer then does what it does for its own
checkpoints: loads the weights, restores `global_step`, skips the batches already seen
and restores the RNG after fetching the first batch, which is what makes the resumed run
bit-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .. import distributed as dist
from ..checkpointer import Checkpointer
from ..config import SmartCkptConfig
from ..constants import KEY_EPOCH, RESUME_DIR, WEIGHTS_NAME
from ..errors import ConfigError
from ..state import apply_optimizer_state, frozen_weight_keys, is_peft_model, trainable_state_dict
from ..state.rng import restore_rng_state
from ..store.types import LoadedCheckpoint

logger = logging.getLogger(__name__)

KEY_TRAINER_STATE = "trainer_state"
TRAINER_STATE_NAME = "trainer_state.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
ADAPTER_SAFE_WEIGHTS_NAME = "adapter_model.safetensors"


class SmartCkptCallback(TrainerCallback):
    """Signal-driven, tiered, non-blocking checkpoints for `transformers.Trainer`.

    Args:
        config (`SmartCkptConfig`, *optional*): the knobs; `SmartCkptConfig()` stores under
            `<output_dir>/smart_ckpt`.
        trainer (`transformers.Trainer`, *optional*): the trainer, for the pre-clip gradient
            norm and the AMP scaler. Found automatically when the callback is passed to
            `Trainer(callbacks=[...])`; `resume_checkpoint` also sets it.

    Example:
        ```python
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
        ...                   callbacks=[SmartCkptCallback(SmartCkptConfig())])
        >>> trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, "auto"))
        ```
    """

    def __init__(self, config: SmartCkptConfig | None = None, *, trainer: Any | None = None) -> None:
        self.config = config or SmartCkptConfig()
        self.checkpointer: Checkpointer | None = None
        self.trainer = trainer
        self.resumed_from: LoadedCheckpoint | None = None
        self._pending: LoadedCheckpoint | None = None
        self._resume_dir: Path | None = None
        self._state: TrainerState | None = None
        self._lr: float | None = None

    # ------------------------------------------------------------------ wiring
    def set_trainer(self, trainer: Any) -> None:
        """Give the callback its trainer (as Trainer does for its JIT checkpoint callback)."""
        self.trainer = trainer

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.trainer is None:
            self.trainer = _calling_trainer()

    def get_checkpointer(self, args: TrainingArguments) -> Checkpointer:
        """The run's `Checkpointer` (created on first use; its store under `config.resolve_root`)."""
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.config, root=self.config.resolve_root(args.output_dir))
        return self.checkpointer

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        ck = self.get_checkpointer(args)
        self._state = state
        self._move_first()
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        accelerator = getattr(self.trainer, "accelerator", None)
        assert model is not None, "Trainer passes the model to callbacks"
        # No `weights=`: attach's default is the cached `trainable_state_dict(model)` (no module walk per save).
        ck.attach(model, optimizer=optimizer, scheduler=lr_scheduler, scaler=scaler,
                  frozen_keys=frozen_weight_keys(model),
                  extra=self._extra, sampler=self._sampler, clip_owner=accelerator)
        if self._pending is not None:
            loaded, self._pending = self._pending, None
            if loaded.info.step != state.global_step:
                raise ConfigError(
                    f"resume_checkpoint prepared step {loaded.info.step} but Trainer resumed at global_step "
                    f"{state.global_step}: pass the path resume_checkpoint returned to trainer.train(resume_from_checkpoint=...)."
                )
            ck.complete_resume(loaded)
            apply_optimizer_state(loaded, optimizer=optimizer, scheduler=lr_scheduler, scaler=scaler)
            ck.load_policy_state(loaded)
            logger.info("resumed from %s (step %d)", loaded.info.path, loaded.info.step)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.pre_update(state.global_step, epoch=state.epoch)

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          optimizer: Any = None, **kwargs: Any) -> None:
        # The learning rate this update used (the scheduler steps right after this event).
        self._lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        ck.step_end(state.global_step, state.epoch or 0.0, lr=self._lr)
        if ck.preempted:
            control.should_training_stop = True
        if self._resume_dir is not None:
            # Every rank has read its rng_state file by now (the first step's all-reduce ordered it).
            if dist.is_main():
                shutil.rmtree(self._resume_dir, ignore_errors=True)
                with contextlib.suppress(OSError):  # not empty: another task's resume folder
                    self._resume_dir.parent.rmdir()
            self._resume_dir = None

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.checkpointer is None or logs is None or not self.config.report_to_trainer:
            return
        metrics = self.checkpointer.metrics()
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        try:
            saved = [e.step for e in ck.events if e.error is None]
            if not ck.preempted and state.global_step > 0 and (not saved or saved[-1] < state.global_step):
                # The final state is the most valuable restore point; the write overlaps nothing.
                ck.save_now(state.global_step, state.epoch or 0.0, reason="train_end", blocking=False)
            ck.finish()
        finally:
            ck.detach()

    # ------------------------------------------------------------------ state for saves
    def _extra(self) -> dict[str, Any]:
        assert self.checkpointer is not None
        out = self.checkpointer.extra_state()
        if self._state is not None:
            out[KEY_TRAINER_STATE] = dataclasses.asdict(self._state)
        return out

    def _sampler(self) -> dict[str, Any]:
        state = self._state
        return {"kind": "trainer", "global_step": state.global_step if state else None,
                "epoch": state.epoch if state else None}

    def _move_first(self) -> None:
        """Run before the reporting callbacks, so the `smart_ckpt/*` metrics reach them in `on_log`."""
        handler = getattr(self.trainer, "callback_handler", None)
        if handler is None or self not in handler.callbacks or handler.callbacks[0] is self:
            return
        handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)


def _calling_trainer() -> Any | None:
    """The `Trainer` whose `__init__` is running (callbacks get no reference to it otherwise)."""
    from transformers import Trainer

    frame: Any = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _find_callback(trainer: Any) -> SmartCkptCallback:
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, SmartCkptCallback):
            return cb
    raise ConfigError(
        "resume_checkpoint(trainer, ...) found no SmartCkptCallback in trainer.callback_handler.callbacks: "
        "create the Trainer with callbacks=[SmartCkptCallback(SmartCkptConfig())]."
    )


def resume_checkpoint(trainer: Any, spec: str | os.PathLike[str] | None = "auto") -> str | None:
    """The `resume_from_checkpoint` argument for `trainer.train`, from the smart checkpoint store.

    Chooses and verifies the restore point (rank 0 decides, every rank checks its own RNG
    file; a broken checkpoint falls back to an older one, a broken optimizer tier resumes
    with a fresh optimizer, each with a warning), then prepares a minimal Trainer checkpoint
    folder for it. The optimizer and scheduler state are loaded by the callback at train
    begin, directly from the store.

    Args:
        trainer (`transformers.Trainer`): a trainer created with a `SmartCkptCallback`.
        spec (`str`, *optional*, defaults to `"auto"`): `auto` (newest healthy checkpoint;
            a fresh start when the store is empty), `best`, `fastest`, `step:N`, a checkpoint
            path, or `None` (fresh start).

    Returns:
        `str | None`: the folder to pass to `trainer.train(resume_from_checkpoint=...)`, or
        `None` to start fresh.

    Raises:
        `ConfigError`: the trainer has no `SmartCkptCallback`.
        `CheckpointNotFoundError`: an explicit spec names nothing loadable.
        `IncompatibleStateError`: the saved weights do not fit the model.

    Example:
        ```python
        >>> trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, "auto"))
        ```
    """
    cb = _find_callback(trainer)
    cb.set_trainer(trainer)
    if spec is None:
        return None
    ck = cb.get_checkpointer(trainer.args)
    # The optimizer tier is read in the background while Trainer builds and prepares the
    # optimizer; the callback waits for it in on_train_begin.
    loaded = ck.resume(os.fspath(spec), background_optimizer=True)
    if loaded is None:
        logger.info("resume_checkpoint(%r): the store at %s is empty; starting fresh", spec, ck.root)
        return None
    folder = materialise_trainer_folder(loaded, trainer, ck.root)
    cb._pending = loaded
    cb._resume_dir = folder
    cb.resumed_from = loaded
    return str(folder)


# ---------------------------------------------------------------------- the resume folder
def materialise_trainer_folder(loaded: LoadedCheckpoint, trainer: Any, root: Path) -> Path:
    """Write the minimal folder `Trainer.train(resume_from_checkpoint=...)` needs for `loaded`.

    Rank 0 writes `trainer_state.json` and the weights (a hard link of the stored file when
    it holds exactly the model's keys, else a safetensors file of `loaded.weights`); every
    rank writes its own `rng_state[_R].pth`. No optimizer or scheduler file: the callback
    loads those from the store.
    """
    from ..state.model import check_weights

    model = trainer.model
    peft = is_peft_model(model)
    folder = Path(root) / RESUME_DIR / f"{loaded.info.task_id}-step-{loaded.info.step}"
    if dist.is_main():
        if loaded.weights is not None:
            check_weights(loaded.weights, trainable_state_dict(model))
        shutil.rmtree(folder.parent, ignore_errors=True)
        folder.mkdir(parents=True)
        _write_trainer_state(folder, loaded, trainer)
        _write_weights(folder, loaded, peft)
    dist.barrier()
    _write_rng(folder, loaded, trainer.args)
    dist.barrier()
    return folder


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
        state["global_step"] = loaded.info.step
    (folder / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(folder: Path, loaded: LoadedCheckpoint, peft: bool) -> None:
    if loaded.weights is None:
        raise ConfigError(f"checkpoint {loaded.info.path} has no weights tier; resume needs one (choose another step).")
    target = folder / (ADAPTER_SAFE_WEIGHTS_NAME if peft else SAFE_WEIGHTS_NAME)
    source = Path(loaded.info.path) / WEIGHTS_NAME
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        same_keys = set(f.keys()) == set(loaded.weights)
    if same_keys:
        try:
            os.link(source, target)
            return
        except OSError as e:  # another filesystem: copying the weights is the price
            logger.info("hard link of %s failed (%s); copying", source, e)
            shutil.copyfile(source, target)
            return
    # Deduplicated or aliased tensors live outside the file: write the resolved weights.
    from safetensors.torch import save_file

    seen: dict[int, str] = {}
    tensors = {}
    for key, t in loaded.weights.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        tensors[key] = t.clone().contiguous() if ptr is not None and ptr in seen else t.contiguous()
        if ptr is not None:
            seen.setdefault(ptr, key)
    save_file(tensors, str(target))


def _write_rng(folder: Path, loaded: LoadedCheckpoint, args: TrainingArguments) -> None:
    if loaded.rng is None:
        logger.warning("resume from step %d: no RNG state for rank %d; random streams (dropout, shuffling) "
                       "will differ from the interrupted run", loaded.info.step, dist.rank())
        return
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    # Convert the stored JSON to the generators' native objects through the generators themselves.
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_saved = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        restore_rng_state(loaded.rng)
        native: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                  "cpu": torch.get_rng_state()}
        if loaded.rng.get("cuda") and torch.cuda.is_available():
            states = torch.cuda.get_rng_state_all()
            native["cuda"] = states[torch.cuda.current_device()] if args.world_size > 1 else states
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda_saved is not None:
            torch.cuda.set_rng_state_all(cuda_saved)
    torch.save(native, folder / name)

"""Hugging Face `Trainer` integration: `SmartCkptCallback` and `resume_checkpoint` (docs/trainer.md).

A thin adapter over `run.orchestrator.RunOrchestrator`. Invariants:

- A save holds its step's tensors but is written at the next `on_step_begin` (or `on_train_end`), after Trainer has
  logged, evaluated and updated `best_*` and the flos: its `TrainerState` is the one Trainer would have saved.
- After `resume_checkpoint` the optimizer tier decodes in the background and is loaded at the first
  `on_pre_optimizer_step` (at `on_train_begin` with an AMP scaler: the first backward needs the loss scale).
- A save's RNG is taken at the next step's `on_step_begin` and restored at the resumed run's first one (an RNG of a
  step's end: before a new epoch's iterator is created, else after the first fetch). The resume is bit-exact.
- The resume folder ``<root>/.resume/<task>-step-<N>/`` holds `trainer_state.json` and the weights (a hard link), no
  optimizer, scheduler or RNG files, and Trainer's own weight load of it is skipped (`load_once`). Its location comes
  from this run's store, never from a manifest; only real directories under ``<root>/.resume`` are ever removed.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import glob
import itertools
import json
import logging
import os
import shutil
import sys
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import has_length

from .. import distributed as dist
from ..config import OnAnomaly, SmartCkptConfig
from ..constants import (
    KEY_EPOCH,
    KEY_RNG_AT,
    KEY_TRAINER_STATE,
    RESUME_DIR,
    RNG_AT_STEP_BEGIN,
    TRAINER_ADAPTER_WEIGHTS_NAME,
    TRAINER_STATE_NAME,
    TRAINER_WEIGHTS_NAME,
    WEIGHTS_NAME,
)
from ..errors import ConfigError
from ..export import describe_model
from ..run.orchestrator import Rollback, RunOrchestrator
from ..sharded import zero_expected
from ..signals import Decision, DecisionKind
from ..state import (
    adapter_names,
    apply_optimizer_state,
    apply_weights,
    check_accelerator,
    check_training_args,
    expected_weights,
    frozen_weight_keys,
    is_peft_model,
    own_weights,
    restore_rng_state,
    split_adapters,
)
from ..store import LoadedCheckpoint
from .position import (
    KEY_BATCH,
    KEY_DRAWS_RANDOM,
    KEY_LOADERS,
    BatchGeometry,
    LoaderSeeds,
    StepRandomness,
    rank_rngs,
    restore_rank_rng,
    resume_batch,
)

logger = logging.getLogger(__name__)


class SmartCkptCallback(TrainerCallback):
    """Signal-driven, tiered, non-blocking checkpoints for `transformers.Trainer` (docs/trainer.md).

    Args:
        config (`SmartCkptConfig`, *optional*): the knobs; `SmartCkptConfig()` stores under `<output_dir>/smart_ckpt`.
        trainer (`transformers.Trainer`, *optional*): for the pre-clip gradient norm, the AMP scaler and the flos.
            Found when the callback is passed to `Trainer(callbacks=[...])`; `resume_checkpoint` also sets it.
    """

    def __init__(self, config: SmartCkptConfig | None = None, *, trainer: Any | None = None) -> None:
        self.config = config or SmartCkptConfig()
        if self.config.on_anomaly == OnAnomaly.ROLLBACK and self.config.policy.rollback_skip_batches:
            raise ConfigError(
                f"policy.rollback_skip_batches={self.config.policy.rollback_skip_batches} is not applied by the "
                "Trainer integration: Trainer's loop fetches its batches itself. A rollback there skips the batches "
                "the anomaly consumed; set rollback_skip_batches=0 (or skip more in a custom loop with "
                "SmartCheckpointer).")
        self.run: RunOrchestrator | None = None
        self.trainer = trainer
        self.resumed_from: LoadedCheckpoint | None = None
        self.last_rollback: Rollback | None = None
        self.data_steps = 0  # optimizer-step windows of data consumed: the step count plus those rollbacks skipped
        self._skipped_through = 0  # data position up to which rollbacks left the batches out
        self._epoch: tuple[int, int] | None = None  # loader without a length: (epoch index, data_steps at its start)
        self._pending: LoadedCheckpoint | None = None  # applied at every train begin of this train() (retries)
        self._unapplied: tuple[LoadedCheckpoint, Any, Any] | None = None  # (loaded, optimizer, scheduler)
        self._lr: float | None = None
        self._flos_at_begin = 0.0
        self._in_train = False
        self._resumed_rng: dict[str, Any] | None = None  # restored once the first resumed step's batches are in
        self._rng_before_iterator = False  # ... or, at an epoch boundary, before the epoch's iterator is created
        self._epoch_rng: dict[str, Any] | None = None  # every rank's RNG at the running epoch's begin (`KEY_EPOCH_RNG`)
        self._resumed_epoch_rng: dict[str, Any] | None = None  # ... the checkpoint's, restored at its epoch's begin
        self._seeds = LoaderSeeds()  # the uninterrupted run's persistent loader iterators (`integrations.position`)
        self._eval_watch: Callable[[], None] | None = None  # takes the `get_eval_dataloader` wrapper off
        self._randomness = StepRandomness()

    @property
    def trainer(self) -> Any | None:
        """Held weakly: a `trainer -> callback -> trainer` cycle freed by the garbage collector frees its persistent
        data-loader workers in arbitrary order (their shutdown then waits 5 s per worker)."""
        return self._trainer()

    @trainer.setter
    def trainer(self, trainer: Any | None) -> None:
        self._trainer: Callable[[], Any] = (lambda: None) if trainer is None else weakref.ref(trainer)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.trainer is None:  # the `Trainer` whose `__init__` runs this (callbacks get no reference to it)
            from transformers import Trainer

            frames = itertools.islice(traceback.walk_stack(sys._getframe()), 12)
            self.trainer = next((f.f_locals["self"] for f, _ in frames if isinstance(f.f_locals.get("self"), Trainer)),
                                None)

    def get_run(self, args: TrainingArguments) -> RunOrchestrator:
        """The run's `RunOrchestrator` (a new one after a finished `train()`; its store under `config.resolve_root`)."""
        if self.run is None or self.run.closed:
            # The save and resume lines follow Trainer's verbosity (--log_level, set_verbosity_info()).
            self.run = RunOrchestrator(self.config, root=self.config.resolve_root(args.output_dir),
                                       announce=logging.getLogger("transformers.integrations.smart_ckpt"))
        return self.run

    def prepare_resume(self, trainer: Any, ref: str | os.PathLike[str] | None) -> str | None:
        """`resume_checkpoint` on this callback: plan the resume, keep the checkpoint's global batch on this world size
        (`resume_batch`: Trainer's accumulation set before `train()` counts its steps), materialise Trainer's folder."""
        self.trainer = trainer
        if ref is None:
            return None
        ck, args = self.get_run(trainer.args), trainer.args
        zero = bool(getattr(trainer, "is_deepspeed_enabled", False))  # ZeRO: read into the engine at train begin
        into = (own_weights(trainer.model) or None) if _loads_once(trainer) else None  # read here for `load_once`
        loaded = ck.resume(os.fspath(ref), background_optimizer=True, into=into,
                           expected=zero_expected(trainer.model) if zero else expected_weights(trainer.model))
        if loaded is None:
            ck.announce.info("smart_ckpt: the store at %s holds no checkpoint; starting fresh", ck.root)
            return None
        now = _geometry(trainer)
        plan = resume_batch(loaded, now, world=now.world_size, keep=self.config.runtime.keep_global_batch,
                            say=ck.announce if ck.rank == 0 else None, read_into=bool(into))
        if plan is not None:
            if plan.accumulation != now.accumulation and zero:
                _deepspeed_accumulation(trainer, now, plan.accumulation)
            args.gradient_accumulation_steps = plan.accumulation
        folder = materialise_trainer_folder(loaded, trainer, Path(ck.root), ck.store.task_id)
        if zero:
            skip_deepspeed_load(trainer, folder)
        else:
            load_once(trainer, loaded, folder)
        if dist.is_main():  # `on_train_end` removes it; a process that resumes and never trains, when it ends
            # (not when this callback goes: a later Trainer of the process may have prepared the same folder again).
            atexit.register(remove_resume_folders, Path(ck.root), ck.store.task_id, loaded.info.step)
        self._pending = self.resumed_from = loaded
        return str(folder)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        trainer: Any = self.trainer
        accelerator = getattr(trainer, "accelerator", None)
        scaler = getattr(accelerator, "scaler", None)
        check_training_args(args)  # DeepSpeed / FSDP1: refused before the first step, never a wrong save
        check_accelerator(accelerator, deepspeed=True)
        ck = self.get_run(args)
        retry, self._in_train = self._in_train, True
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
        if self in callbacks:  # first, so that the reporting callbacks see the `smart_ckpt/*` metrics in `on_log`
            callbacks.remove(self)
            callbacks.insert(0, self)
        assert model is not None, "Trainer passes the model to callbacks"
        ck.attach(model, optimizer=optimizer, scheduler=lr_scheduler, scaler=scaler, clip_owner=accelerator,
                  frozen_keys=frozen_weight_keys(model), extra=functools.partial(self._save_extra, state, control),
                  sampler=functools.partial(self._sampler, state), hold_saves=True,
                  model_info=describe_model(model, tokenizer=getattr(trainer, "processing_class", None)),
                  position=lambda: (state.global_step, state.epoch))
        if retry:  # auto_find_batch_size restarted the loop: the failed attempt's saves are another timeline.
            ck.restart_timeline(state.global_step)
        loaded, self._epoch = self._pending, None
        self.data_steps, sampler = state.global_step, (loaded.sampler or {}) if loaded is not None else {}
        if loaded is not None:
            if state.global_step == folder_step(loaded, args.max_steps) != loaded.info.step:
                # The folder named the data position (a rollback skipped data, or a loader without a length): the
                # true step goes back now, with the two counters Trainer set from it before this event (its last
                # logged step, its start step).
                state.global_step = trainer._globalstep_last_logged = trainer._initial_global_step = loaded.info.step
            self.data_steps = data_steps(loaded)
            if loaded.info.step != state.global_step:
                raise ConfigError(
                    f"resume_checkpoint prepared step {loaded.info.step} but Trainer resumed at global_step "
                    f"{state.global_step}: pass the path resume_checkpoint returned to "
                    "trainer.train(resume_from_checkpoint=...).")
            if ck.zero or scaler is not None:  # ZeRO: the engine exists now, its partitions are read before the
                # first forward; AMP: the first backward needs the loss scale
                ck.read_sharded(loaded) if ck.zero else ck.complete_resume(loaded)
                apply_optimizer_state(loaded, optimizer=optimizer, scheduler=lr_scheduler, scaler=scaler)
            else:  # L1 is applied right before the first update: it decodes during the forward/backward
                self._unapplied = (loaded, optimizer, lr_scheduler)
            if ck.zero:
                _DEEPSPEED_SKIPS.discard(os.path.abspath(resume_folder(ck.root, ck.store.task_id, loaded.info.step)))
            # What the uninterrupted run's callbacks counted (EarlyStoppingCallback's patience), whatever
            # `restore_callback_states_from_checkpoint` says: the resumed run stops where that run would have. Set on
            # the callbacks of the same classes, in order (the `TrainerControl` is Trainer's to restore).
            stored: dict[str, Any] = state.stateful_callbacks if isinstance(state.stateful_callbacks, dict) else {}
            restored = set()
            for name, states in stored.items():
                mine = [cb for cb in callbacks if isinstance(cb, ExportableState) and type(cb).__name__ == name]
                for cb, saved in zip(mine, states if isinstance(states, list) else [states]):
                    for key, value in ((saved.get("attributes") if isinstance(saved, dict) else None) or {}).items():
                        setattr(cb, key, value)
                    restored.add(name)
            if restored and ck.rank == 0:
                ck.announce.info("smart_ckpt: restored the state of %s from the checkpoint",
                                 ", ".join(sorted(restored)))
            # The eval loaders whose persistent iterator the uninterrupted run held: met when Trainer asks for them.
            self._seeds.arm(sampler.get(KEY_LOADERS))
            if self._eval_watch is None:
                self._eval_watch = _watch_eval_loaders(trainer, self._seeds)
        # The state training starts from can be captured before the first update (step-1 anomalies).
        self._resumed_rng, self._resumed_epoch_rng = loaded.rng if loaded is not None else None, \
            sampler.get(KEY_EPOCH_RNG)
        ck.note_boundary(state.global_step, rng=self._resumed_rng)
        # An RNG taken at the end of its step (a save at train end or on preemption, or by an earlier version) is what
        # the uninterrupted run had before a new epoch's iterator drew from it: restored before that iterator at an
        # epoch boundary (`on_epoch_begin`), else once the first batches are fetched, as Trainer does.
        self._rng_before_iterator = loaded is not None and sampler.get(KEY_RNG_AT) != RNG_AT_STEP_BEGIN and \
            (float(state.epoch or 0.0).is_integer() or _epoch_windows(sampler) is not None)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        epoch, resumed = float(state.epoch or 0.0), None
        if train_dataloader is not None and not has_length(train_dataloader):
            # Trainer counts such a loader's epochs as it runs out: the position is (epoch, windows into it). An
            # RNG taken at a step's end goes back at the next epoch's begin if the resumed epoch runs out first.
            at = _epoch_windows(self._pending.sampler or {}) if self._epoch is None and self._pending else None
            resumed = (at[0], self.data_steps - at[1]) if at is not None else None  # this train()'s first epoch
            self._epoch = resumed or (self._epoch[0] + 1 if self._epoch else 0, self.data_steps)
            epoch = self._epoch[0]
        if self._resumed_rng is not None and self._rng_before_iterator and resumed is None:
            restore_rng_state(self._resumed_rng)
            self._resumed_rng = None
        # A sampler may draw the epoch's order from the global generator when the iterator is created (Trainer's
        # `LengthGroupedSampler`), after the previous steps drew from it: a resumed run entering the epoch of its
        # checkpoint starts it from this rank's generator as the uninterrupted run began it.
        started, self._resumed_epoch_rng = self._resumed_epoch_rng, None
        if isinstance(started, dict) and started.get("epoch") == int(epoch) and started.get("ranks"):
            restore_rank_rng(started["ranks"])
        self._epoch_rng = {"epoch": int(epoch), "ranks": rank_rngs()}
        if train_dataloader is not None and epoch >= 1:
            # The uninterrupted run created its iterator in the first epoch and only resets it now; a resumed run
            # that creates it must not draw the workers' seed from the main generator (`integrations.position`).
            self._seeds.lend(train_dataloader)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._seeds.settle()  # the iterators created since (the epoch's, an evaluation's) give their seed back
        if self._resumed_rng is not None:
            # The first step of a resumed run has fetched its batches: from here on its random streams are those of
            # the interrupted run at the same point (the RNG stored with a save is taken at this moment).
            restore_rng_state(self._resumed_rng)
            self._resumed_rng = None
        if self.run is not None:
            if self.run.rollback_due:
                self._roll_back(state)
            self._flos_at_begin = float(getattr(self.trainer, "current_flos", 0.0) or 0.0)
            self.run.step_begin()  # the previous step's logging and evaluation are done: write its save
        self._randomness.begin()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        self._randomness.end()  # the step's forward and backward ran
        if self.run is not None:
            self._apply_resumed_optimizer()
            self.run.pre_update(state.global_step, epoch=state.epoch)

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          optimizer: Any = None, **kwargs: Any) -> None:
        # The learning rate this update used (the scheduler steps right after this event).
        self._lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if (ck := self.run) is not None:
            self.data_steps += 1
            if ck.step_end(state.global_step, state.epoch or 0.0, lr=self._lr).kind == DecisionKind.ROLLBACK:
                control.should_log = True  # the abandoned steps' loss is logged now, before the step count goes back
            if ck.preempted:
                control.should_training_stop = True

    def _roll_back(self, state: TrainerState) -> None:
        """At the start of the step after a confirmed anomaly (its batches are fetched, as a resume's first ones
        are): restore the run in place and put Trainer's step counter back (`docs/rollback.md`)."""
        trainer: Any = self.trainer
        assert self.run is not None and trainer is not None, "a rollback needs the Trainer (SmartCkptCallback.trainer)"
        done = self.run.rollback()
        if done is None:
            return
        ga = max(1, int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1))
        # The batches this rollback leaves out: those read since the restore point, less any an earlier rollback
        # to it already left out.
        first = max(data_steps(done.loaded), self._skipped_through) * ga + 1
        last = self.data_steps * ga
        self._skipped_through = self.data_steps
        state.global_step = done.to_step
        # What Trainer's state said at the restore point about the best model and the flos: a resume from it would
        # load those too (the log history keeps what happened; callbacks' own state, e.g. early stopping, goes on).
        saved = done.loaded.extra.get(KEY_TRAINER_STATE) or {}
        for name in ("best_metric", "best_global_step", "best_model_checkpoint", "total_flos"):
            if name in saved:
                setattr(state, name, saved[name])
        # The loss Trainer logs divides by the steps since its last log; that log was at a step now undone.
        trainer._globalstep_last_logged = done.to_step
        self.last_rollback = done
        if self.run.rank == 0:  # one line for the run (every rank took the same, agreed rollback)
            self.run.announce.warning("smart_ckpt: rolled back from step %d to step %d (%s); skipped batches %d..%d",
                                      done.from_step, done.to_step, done.reason, first, last)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.run is not None and logs is not None and self.config.runtime.report_to_trainer:
            logs.update(metrics := self.run.metrics())
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        ck = self.run
        self._in_train = False
        if ck is None or ck.closed:
            return
        try:
            self._apply_resumed_optimizer()  # no update ran: the final save holds the resumed state
            if ck.rollback_due:  # confirmed at the last step: the final state is the restore point's, not N-1's
                self._roll_back(state)
            ck.release()
            last = ck.log.find()
            if not ck.preempted and state.global_step > 0 and (last is None or last.step < state.global_step):
                # The final state is the most valuable restore point; the write overlaps nothing.
                ck.save_now(state.global_step, state.epoch or 0.0, reason="train_end", blocking=False)
        finally:
            self._pending = self._unapplied = self._resumed_rng = None
            self._seeds.give_back()
            if self._eval_watch is not None:
                self._eval_watch()
                self._eval_watch = None
            try:
                ck.close()  # waits for the last write; the writer process ends with the training
            finally:
                if dist.is_main():
                    remove_resume_folders(ck.root, ck.store.task_id)
        ck.exit_if_preempted()  # 128 + signal: the scheduler requeues the job (preemption_exit_code)

    def _apply_resumed_optimizer(self) -> None:
        """Wait for the resumed optimizer tier (agreed across ranks) and load it into Trainer's optimizer and scheduler,
        at the first update (its forward and backward overlap the decode) or at `on_train_end` when none ran."""
        unapplied, self._unapplied = self._unapplied, None
        if unapplied is not None and self.run is not None:
            loaded, optimizer, scheduler = unapplied
            self.run.complete_resume(loaded)
            apply_optimizer_state(loaded, optimizer=optimizer, scheduler=scheduler, scaler=None)

    def _save_extra(self, train_state: TrainerState, control: TrainerControl, decision: Decision) -> dict[str, Any]:
        """Every rank, right before each save: the `TrainerState` Trainer would have stored for the saved step, with
        the flos it would have counted by then (summed over ranks: a collective, which every rank runs since every
        rank takes the same saves) and the state of the callbacks and the control now, in `TrainerState`'s own form
        (one entry per class, a list for several of one class)."""
        current = self._flos_at_begin if decision.kind == DecisionKind.CAPTURE else \
            float(getattr(self.trainer, "current_flos", 0.0) or 0.0)
        state = dataclasses.asdict(train_state)
        state["total_flos"] = float(train_state.total_flos) + dist.all_reduce_sum(current)
        callbacks = [*getattr(getattr(self.trainer, "callback_handler", None), "callbacks", []), control]
        exportable: Any = [cb for cb in callbacks if isinstance(cb, ExportableState)]
        state["stateful_callbacks"] = TrainerState(stateful_callbacks=exportable).stateful_callbacks
        return {KEY_TRAINER_STATE: state}

    def _sampler(self, state: TrainerState) -> dict[str, Any]:
        # Taken when the save is written (the next step's begin): after the step's evaluation, as the resumed run
        # continues from there.
        trainer = self.trainer
        batch = _geometry(trainer).to_json() if trainer is not None else None
        eval_loaders = getattr(trainer, "_eval_dataloaders", None) or {}  # Trainer keeps persistent ones by name
        out: dict[str, Any] = {
            "kind": "trainer", "global_step": state.global_step, KEY_DATA_STEPS: self.data_steps,
            "epoch": state.epoch, KEY_BATCH: batch, KEY_DRAWS_RANDOM: self._randomness.seen,
            KEY_LOADERS: self._seeds.record(eval_loaders)}
        if self._epoch is not None:
            out[KEY_EPOCH_WINDOWS] = [self._epoch[0], self.data_steps - self._epoch[1]]
        if self._epoch_rng is not None:
            out[KEY_EPOCH_RNG] = self._epoch_rng
        return out


def _geometry(trainer: Any) -> BatchGeometry:
    args = trainer.args
    return BatchGeometry(int(trainer._train_batch_size), dist.world_size(), int(args.gradient_accumulation_steps))


def _deepspeed_accumulation(trainer: Any, now: BatchGeometry, accumulation: int) -> None:
    """Under DeepSpeed the accumulation is also in the engine's config, filled from the arguments when they were
    made (``"auto"``): set it there too, with the global batch it gives (``train_batch_size``)."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    candidates = (getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None),
                  getattr(getattr(plugin, "hf_ds_config", None), "config", None),
                  getattr(plugin, "deepspeed_config", None))
    for config in {id(c): c for c in candidates if isinstance(c, dict)}.values():
        current = config.get("gradient_accumulation_steps")
        if current not in (None, "auto", now.accumulation):  # set by hand to another value than the run's
            raise ConfigError(
                f"the DeepSpeed config sets gradient_accumulation_steps={current}, and keeping the checkpoint's global "
                f"batch on {now.world_size} process(es) needs {accumulation}: set it to \"auto\" (Trainer fills it "
                "in) or pass runtime.keep_global_batch=false to train with another global batch.")
        config["gradient_accumulation_steps"] = accumulation
        if config.get("train_batch_size") not in (None, "auto"):
            config["train_batch_size"] = now.per_device * now.world_size * accumulation


def _watch_eval_loaders(trainer: Any, seeds: LoaderSeeds) -> Callable[[], None]:
    """Show `seeds` every eval loader `trainer.get_eval_dataloader` hands out (named as Trainer keys them) before it
    is iterated; returns what takes the wrapper off. Holds the trainer weakly."""
    ref, own, method = weakref.ref(trainer), vars(trainer).get("get_eval_dataloader"), type(trainer).get_eval_dataloader

    def get_eval_dataloader(eval_dataset: Any = None) -> Any:
        loader = own(eval_dataset) if own is not None else method(ref(), eval_dataset)
        seeds.resume(eval_dataset if isinstance(eval_dataset, str) else "eval", loader)
        return loader

    def take_off() -> None:
        current = ref()
        if current is not None and vars(current).get("get_eval_dataloader") is get_eval_dataloader:
            delattr(current, "get_eval_dataloader") if own is None else setattr(current, "get_eval_dataloader", own)

    trainer.get_eval_dataloader = get_eval_dataloader
    return take_off


def resume_checkpoint(trainer: Any, ref: str | os.PathLike[str] | None = "auto") -> str | None:
    """The `resume_from_checkpoint` argument for `trainer.train`, from the store of the trainer's `SmartCkptCallback`.

    Chooses and verifies the restore point (one agreed outcome on every rank; a broken checkpoint falls back to an
    older one, a broken optimizer tier resumes with a fresh optimizer, each with a warning; the weights must fit the
    model) and prepares a minimal Trainer checkpoint folder for it (docs/trainer.md). `ref`: `auto` (newest healthy
    checkpoint; a fresh start when the store is empty), `best`, `fastest`, `step:N`, a checkpoint path, or `None`
    (fresh start). Returns the folder for `trainer.train(resume_from_checkpoint=...)`, or `None` to start fresh.
    Raises `ConfigError` (the trainer has no `SmartCkptCallback`), `CheckpointNotFoundError` (an explicit ref names
    nothing loadable), `IncompatibleStateError` (the saved weights do not fit the model).
    """
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, SmartCkptCallback):
            return cb.prepare_resume(trainer, ref)
    raise ConfigError("resume_checkpoint(trainer, ...) found no SmartCkptCallback in trainer.callback_handler."
                      "callbacks: create the Trainer with callbacks=[SmartCkptCallback(SmartCkptConfig())].")


# ---------------------------------------------------------------------------- the resume folder
def resume_folder(root: Path, task_id: str, step: int) -> Path:
    return Path(root).absolute() / RESUME_DIR / f"{task_id}-step-{int(step)}"


def remove_resume_folders(root: Path, task_id: str, step: int | None = None) -> None:
    """Remove this task's resume folders (only the one of `step`, when given): real directories directly under
    ``<root>/.resume`` only."""
    base, prefix = Path(root).absolute() / RESUME_DIR, f"{task_id}-step-"
    for entry in [] if base.is_symlink() else base.glob(f"{glob.escape(prefix)}{'*' if step is None else step}"):
        # `<task>-step-<N>` exactly: task `a`'s folders are not those of a task `a-step-3`
        if entry.name.removeprefix(prefix).isdigit() and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.rmdir()  # only when empty: other tasks' folders stay


KEY_DATA_STEPS = "data_steps"  # the Trainer data position in a sampler state: optimizer-step windows consumed
KEY_EPOCH_WINDOWS = "epoch_windows"  # ... with a training loader without a length: [epoch, windows consumed in it]
KEY_EPOCH_RNG = "epoch_rng"  # ... {"epoch": E, "ranks": [every rank's RNG at epoch E's begin]} (the next step's epoch)


def materialise_trainer_folder(loaded: LoadedCheckpoint, trainer: Any, root: Path, task_id: str) -> Path:
    """Write the folder for `loaded` (rank 0; every rank waits for it); returns it. Under DeepSpeed it holds the
    Trainer state only: the callback reads the ZeRO state into the engine at train begin (`skip_deepspeed_load`)."""
    folder, args = resume_folder(root, task_id, loaded.info.step), trainer.args
    if dist.is_main():
        remove_resume_folders(root, task_id)
        folder.mkdir(parents=True)
        state = loaded.extra.get(KEY_TRAINER_STATE)
        if state is None:  # saved by another integration: the step and epoch are enough to resume
            state = dataclasses.asdict(TrainerState(
                global_step=loaded.info.step, epoch=float(loaded.manifest.get(KEY_EPOCH) or 0.0),
                train_batch_size=trainer._train_batch_size, logging_steps=args.logging_steps,
                eval_steps=args.eval_steps, save_steps=args.save_steps))
        # Trainer derives the data to skip from global_step. After a rollback the run has consumed more batches than
        # it applied updates (the rolled-back ones), so the folder names the data position; `SmartCkptCallback` puts
        # the true step back at train begin.
        state = {**state, "global_step": folder_step(loaded, args.max_steps)}
        (folder / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if not getattr(trainer, "is_deepspeed_enabled", False):
            _write_weights(folder, loaded, trainer.model, read=not _loads_once(trainer))
    dist.barrier()
    return folder


_DEEPSPEED_SKIPS: set[str] = set()  # resume folders whose DeepSpeed load Trainer skips (`skip_deepspeed_load`)


def skip_deepspeed_load(trainer: Any, folder: Path) -> None:
    """Make `Trainer.train(resume_from_checkpoint=folder)` under DeepSpeed leave the engine's state to the callback:
    transformers' ``deepspeed_load_checkpoint`` skips the registered folders (wrapped once per process), this
    instance's ``_load_optimizer_and_scheduler`` skips `folder` once."""
    import transformers.trainer as trainer_module

    _DEEPSPEED_SKIPS.add(os.path.abspath(folder))
    current = trainer_module.deepspeed_load_checkpoint
    if getattr(current, "__module__", None) != __name__:  # not wrapped yet
        def deepspeed_load_checkpoint(engine: Any, checkpoint_path: str, *args: Any, **kwargs: Any) -> Any:
            if os.path.abspath(checkpoint_path) in _DEEPSPEED_SKIPS:
                logger.debug("%s: the ZeRO state is read by SmartCkptCallback at train begin", checkpoint_path)
                return None
            return current(engine, checkpoint_path, *args, **kwargs)

        trainer_module.deepspeed_load_checkpoint = deepspeed_load_checkpoint  # type: ignore[assignment]
    _skip_once(trainer, "_load_optimizer_and_scheduler", folder)


def _skip_once(trainer: Any, name: str, folder: Path, applies: Callable[..., bool] | None = None) -> None:
    """The first call of this instance's ``trainer.<name>(checkpoint, ...)`` for `folder` (that `applies` to) does
    nothing and takes the wrapper off."""
    original, own, target = getattr(trainer, name), vars(trainer).get(name), os.path.abspath(folder)

    def wrapper(checkpoint: str | None, *args: Any) -> Any:
        if checkpoint is not None and os.path.abspath(checkpoint) == target and (applies is None or applies(*args)):
            delattr(trainer, name) if own is None else setattr(trainer, name, own)  # an override of its own goes back
            logger.debug("%s: Trainer's %s skipped, the callback did it", folder, name)
            return None
        return original(checkpoint, *args)

    setattr(trainer, name, wrapper)


def data_steps(loaded: LoadedCheckpoint) -> int:
    """Optimizer-step windows of data consumed at `loaded` (its step, unless a rollback skipped some)."""
    sampler = loaded.sampler or {}
    value = sampler.get(KEY_DATA_STEPS) if sampler.get("kind") == "trainer" else None
    return value if isinstance(value, int) and value >= loaded.info.step else loaded.info.step


def _epoch_windows(sampler: dict[str, Any]) -> tuple[int, int] | None:
    value: Any = sampler.get(KEY_EPOCH_WINDOWS)
    ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)
    return (value[0], value[1]) if ok else None


def folder_step(loaded: LoadedCheckpoint, max_steps: int) -> int:
    """The `global_step` the resume folder names, from which Trainer derives the data to skip: for a loader without
    a length Trainer takes ``max_steps`` windows per epoch, although such a loader's epochs end when its data runs
    out, so the folder names ``epoch * max_steps + windows`` (the true step goes back at train begin)."""
    at = _epoch_windows(loaded.sampler or {})
    return at[0] * max_steps + at[1] if at is not None and at[1] < max_steps else data_steps(loaded)


def _write_weights(folder: Path, loaded: LoadedCheckpoint, model: Any, *, read: bool = True) -> None:
    """The weights file of `folder`: a hard link to the checkpoint's; on another file system (a memory slot) a copy
    when Trainer will `read` it, else a symbolic link (a copy cost 0.8 s per GiB at restart, docs/benchmarks.md)."""
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
        keys = set(f.keys())
    if keys != set(loaded.weights):  # deduplicated or aliased tensors live outside the file
        return _save_tensors(loaded.weights, target)
    try:
        os.link(source, target)
    except OSError as e:  # another file system
        logger.debug("hard link of %s failed (%s); %s", source, e, "copying" if read else "linking")
        if read:
            shutil.copyfile(source, target)
        else:
            target.symlink_to(source.absolute())


def _save_tensors(weights: dict[str, torch.Tensor], target: Path) -> None:
    from safetensors.torch import save_file

    seen: set[int | None] = set()  # storages already in the file: a tensor sharing one is written as a copy
    tensors = {}
    for key, t in weights.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        tensors[key] = t.clone().contiguous() if ptr in seen else t.contiguous()
        seen.add(ptr)
    save_file(tensors, str(target))


def _loads_once(trainer: Any) -> bool:
    return not (getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
                or not callable(getattr(trainer, "_load_from_checkpoint", None)))


def load_once(trainer: Any, loaded: LoadedCheckpoint, folder: Path) -> None:
    """Put the verified weights of `loaded` into `trainer.model` now (a full model's read from the stored file by the
    resume itself into `own_weights`, where it could; adapters through PEFT's setter) and make `Trainer.train` skip
    its second load of `folder`, once, into that model. DeepSpeed and FSDP Trainers load the weights themselves."""
    if loaded.weights is None or not _loads_once(trainer):
        return
    model = trainer.model
    if adapter_names(model):  # adapters are small: PEFT's own setter, which knows their key names
        apply_weights(model, loaded.weights)
    else:  # the weights were checked against the model by the resume already
        live = model.state_dict()
        # Read by the resume already (every CPU tensor of the stored dtype): the key's loaded tensor is the model's own.
        written = {v.data_ptr() for k, v in loaded.weights.items()
                   if k in live and live[k].numel() and v.data_ptr() == live[k].data_ptr()}
        rest = {k: v for k, v in loaded.weights.items()
                if not (k in live and live[k].numel() and live[k].data_ptr() in written)}
        if rest:  # a tied alias whose tensor was read is skipped above; the rest is copied as Trainer would
            model.load_state_dict(rest, strict=False)
        loaded.weights = {k: live.get(k, v) for k, v in loaded.weights.items()}  # the file's mapping can go
    _skip_once(trainer, "_load_from_checkpoint", folder,
               lambda model_arg=None: model_arg is None and trainer.model is model)

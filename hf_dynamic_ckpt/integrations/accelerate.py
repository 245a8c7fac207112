"""Accelerate integration: the state-hook pair and `SmartCheckpointer` for custom loops.

Both are thin adapters over `run.orchestrator.RunOrchestrator`, the orchestrator the Trainer
callback uses too (probes -> policy -> snapshot/writer -> store; resume with fallback).

- `SmartStateHooks` registers on an `Accelerator` so that `accelerator.save_state(dir)`
  commits a checkpoint to the tiered store and `accelerator.load_state(dir)` restores it.
- `SmartCheckpointer` adds the signal-driven decisions to a custom loop: two calls per
  step and one resume call at the start.

What `save_state` still writes itself: Accelerate's hook API can only suppress the model
files (by emptying the `weights` list it passes to the hook). Its optimizer, scheduler,
sampler and RNG files are written to `dir` regardless; the weights, for a PEFT model only
the adapter, live in the store. `dir` receives a small pointer file (`smart_ckpt.json`)
naming the committed checkpoint; `load_state(dir)` follows it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..errors import ConfigError, weights_overwritten
from ..policy.decision import Decision, DecisionKind
from ..run.elastic import StepRandomness
from ..run.orchestrator import SaveEvent
from ..run.rollback import Rollback
from ..state.flat import FlatKeeper
from ..state.support import check_accelerator
from ..store import LoadedCheckpoint
from ._accelerate_elastic import apply_elastic, deepspeed_engine
from ._accelerate_hooks import POINTER_NAME, SmartStateHooks, attach_state, make_orchestrator, store_root
from ._accelerate_state import KEY_ACCELERATE, AccelerateState
from ._position import ResumableLoader

logger = logging.getLogger(__name__)

__all__ = ["POINTER_NAME", "ResumableLoader", "SmartCheckpointer", "SmartStateHooks"]


class SmartCheckpointer:
    """Signal-driven, tiered, non-blocking checkpoints for a custom Accelerate loop.

    One object, two calls per step and one resume call: the same orchestrator, policy,
    engine and store as `SmartCkptCallback`. It also registers `SmartStateHooks`, so
    `accelerator.save_state()` / `load_state()` go to the same store (not under DeepSpeed, where
    Accelerate runs DeepSpeed's own save there). Under DeepSpeed ZeRO the engine steps inside
    `accelerator.backward`; the same loop works (docs/deepspeed.md).

    Args:
        accelerator (`accelerate.Accelerator`): after `prepare(...)`.
        model (`torch.nn.Module`): the prepared model (PEFT models save the adapter only).
        optimizer (`torch.optim.Optimizer`): the prepared optimizer.
        scheduler (*optional*): the prepared LR scheduler.
        dataloader (`torch.utils.data.DataLoader`, *optional*): the prepared training dataloader;
            iterate `ckpt.loader` (one epoch per `iter()`) for an exact data position.
        config (`SmartCkptConfig`, *optional*): defaults to `SmartCkptConfig()`.
        output_dir (`str`, *optional*): store at `<output_dir>/smart_ckpt` when `config.root` is unset.
        consolidate (`bool`, *optional*): keep the trainable parameters and their optimizer state
            in one flat buffer per device and dtype, so a snapshot is one copy (`state.flat`);
            `None` (default): only for many small trainable tensors (LoRA), `True` / `False`: always / never.

    Example:
        ```python
        >>> ckpt = SmartCheckpointer(accelerator, model, optimizer, scheduler, train_dataloader,
        ...                          config=SmartCkptConfig(), output_dir="out")
        >>> ckpt.resume("auto")                          # None: fresh start
        >>> while ckpt.step < max_steps and not ckpt.should_stop:
        ...     for batch in ckpt.loader:
        ...         with accelerator.accumulate(model):
        ...             accelerator.backward(model(**batch).loss)
        ...             if accelerator.sync_gradients:
        ...                 accelerator.clip_grad_norm_(model.parameters(), 1.0)
        ...             ckpt.before_update()             # signals + pre-anomaly capture
        ...             optimizer.step(); scheduler.step(); optimizer.zero_grad()
        ...         ckpt.after_update()                  # the save decision
        ...         if ckpt.step >= max_steps or ckpt.should_stop:
        ...             break
        >>> ckpt.close()
        ```
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any | None = None,
        dataloader: Any | None = None,
        *,
        config: SmartCkptConfig | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        consolidate: bool | None = None,
    ) -> None:
        check_accelerator(accelerator, deepspeed=True)  # DeepSpeed without ZeRO / FSDP1: refused before anything
        self.accelerator = accelerator
        self._deepspeed = deepspeed_engine(accelerator) is not None
        self.config = config or SmartCkptConfig()
        if optimizer not in accelerator._optimizers:
            raise ConfigError("optimizer is not the accelerator's prepared optimizer: pass the object "
                              "returned by accelerator.prepare(...).")
        if scheduler is not None and scheduler not in accelerator._schedulers:
            raise ConfigError("scheduler is not the accelerator's prepared scheduler: pass the object "
                              "returned by accelerator.prepare(...).")
        loader = ResumableLoader(accelerator, dataloader) if dataloader is not None else None
        # Whether a step's forward and backward draw random numbers (dropout): from the step's first batch (once
        # the loader's iterator exists, whose creation draws too) to `before_update`; recorded with every save.
        self._randomness = StepRandomness()
        if loader is not None:
            loader.on_batch = self._randomness.begin
        self.state = AccelerateState(accelerator, models=[model], loader=loader)
        self.run = make_orchestrator(self.config, accelerator, store_root(self.config, accelerator, output_dir))
        attach_state(self.run, self.state, boundary=True, clip_owner=accelerator, consolidate=consolidate,
                     draws_random=lambda: self._randomness.seen,
                     position=lambda: (self.step, self.state.epoch(boundary=True)))
        self.hooks: SmartStateHooks | None = None
        """The `save_state` / `load_state` hook pair on the same store; `None` under DeepSpeed, where `save_state`
        runs DeepSpeed's own `save_checkpoint` whatever a hook does (`SmartStateHooks`)."""
        if not self._deepspeed:
            self.hooks = SmartStateHooks(accelerator, run=self.run, state=self.state)
            self.hooks.register()
        self.last_decision: Decision | None = None
        self.last_rollback: Rollback | None = None
        """The last rollback (`on_anomaly: rollback`): `after_update` returned a decision of kind `rollback`."""
        self._skipped_through = (-1, 0)  # (epoch, batch) up to which rollbacks left the data out
        self.loaded: LoadedCheckpoint | None = None
        self._lr: float | None = None
        if loader is not None:
            loader.mark_boundary()
        self.run.note_boundary(self.step)  # the starting state can be captured before the first update

    # -- properties ------------------------------------------------------------------------
    @property
    def flat(self) -> FlatKeeper | None:
        """The consolidated trainable state's keeper (`state.flat`)."""
        return self.run.flat

    @property
    def step(self) -> int:
        """Optimizer updates completed (restored by `resume`)."""
        return self.state.optimizer_steps

    @property
    def loader(self) -> ResumableLoader:
        """Iterate this instead of the dataloader: one epoch per `iter()`, resumed exactly."""
        if self.state.loader is None:
            raise ConfigError("SmartCheckpointer was created without a dataloader: pass dataloader=... to track "
                              "the data position.")
        return self.state.loader

    @property
    def epoch(self) -> int:
        """Index of the epoch the loader is in (or starts next)."""
        return self.state.loader.epoch if self.state.loader is not None else 0

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: the accelerator's, which `resume` sets to keep the checkpoint's global
        batch on another number of processes (`docs/elastic.md`). A loop that counts micro-batches itself reads it
        after `resume`."""
        return int(self.accelerator.gradient_accumulation_steps)

    @property
    def should_stop(self) -> bool:
        """A preemption signal arrived and the final checkpoint is committed: stop training."""
        return self.run.preempted

    @property
    def store(self) -> Any:
        return self.run.store

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run: `range(resumed epoch, num_epochs)`, stopping on preemption."""
        while self.epoch < num_epochs and not self.should_stop:
            yield self.epoch

    # -- the loop --------------------------------------------------------------------------
    def before_update(self) -> Decision | None:
        """Call after `backward` (and clipping), before `optimizer.step()`.

        Reads the step's signals (loss, pre-clip gradient norm, LoRA layers, memory) and
        lets the policy snapshot and pin the still-healthy state when the gradients surge.
        A no-op (returns `None`) on gradient-accumulation micro-steps.

        Returns:
            `Decision | None`: with `skip_update`, the gradients were dropped.
        """
        if not self.accelerator.sync_gradients:
            return None
        self._randomness.end()  # the step's forward and backward ran
        opt = self.state.optimizer
        self._lr = float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None
        return self.run.pre_update(self.step, epoch=self.state.epoch(boundary=True))

    def after_update(self) -> Decision | None:
        """Call after `optimizer.step()` / `scheduler.step()`: the save decision of this step.

        Saves in the background when the policy says so; on a preemption signal commits a
        checkpoint synchronously and sets `should_stop`. With `on_anomaly: rollback`, a confirmed
        anomaly rolls the run back here (decision kind `rollback`, `last_rollback`): `step` is the
        restore point's again, the model, optimizer, scheduler and RNG are its, and `loader` goes on
        with the next batches (skipping `rollback_skip_batches` more). A no-op on accumulation micro-steps.
        """
        if not self.accelerator.sync_gradients:
            return None
        if self._deepspeed:  # the engine stepped inside `accelerator.backward`; no torch optimizer step to count
            self.state.optimizer_steps += 1
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        decision = self.run.step_end(self.step, self.state.epoch(boundary=True), lr=self._lr)
        if decision.kind == DecisionKind.ROLLBACK:
            self._roll_back()
        self.last_decision = decision
        if self.state.loader is None:
            self._randomness.begin()  # else at the next batch
        return decision

    def _roll_back(self) -> None:
        """Restore the run in place; the data goes on from where it is (plus `rollback_skip_batches`)."""
        loader = self.state.loader
        seen_before = (loader.epoch, loader.batches_seen) if loader is not None else None
        done = self.run.rollback(restore_rng=loader is None)  # with a loader: after its next batch is fetched
        if done is None:
            return
        self.state.optimizer_steps = done.to_step
        skipped = ""
        if loader is not None and seen_before is not None:
            loader.after_rollback(rng=done.rng, skip=self.config.policy.rollback_skip_batches)
            loader.mark_boundary()
            start = done.loaded.sampler or {}
            first = int(start.get("batches_seen", 0)) + 1 if start.get("epoch") == seen_before[0] else 1
            if self._skipped_through[0] == seen_before[0]:  # an earlier rollback to it left some out already
                first = max(first, self._skipped_through[1] + 1)
            last = seen_before[1] + self.config.policy.rollback_skip_batches
            self._skipped_through = (seen_before[0], last)
            skipped = f"; skipped batches {first}..{last} of epoch {seen_before[0]}"
        self.last_rollback = done
        if self.run.rank == 0:  # one line for the run (every rank took the same, agreed rollback)
            self.run.announce.warning("smart_ckpt: rolled back from step %d to step %d (%s)%s", done.from_step,
                                       done.to_step, done.reason, skipped)

    def save_now(self, *, reason: str = "manual", blocking: bool = True) -> SaveEvent:
        """Save the state of the last completed step outside the policy (e.g. at the end)."""
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        return self.run.save_now(self.step, self.state.epoch(boundary=True), reason=reason, blocking=blocking)

    def resume(self, ref: str | None = "auto") -> LoadedCheckpoint | None:
        """Restore a checkpoint on every rank before the loop (rank 0 chooses).

        On another number of processes than the checkpoint's, the run continues the same run (`docs/elastic.md`):
        the accelerator's gradient accumulation is set to keep the checkpoint's global batch
        (`gradient_accumulation_steps`; `runtime.keep_global_batch`), the data position is kept in samples of the
        epoch's order, Accelerate's prepared scheduler keeps the pace of the run it continues, and a rank the
        checkpoint had not continues rank 0's random streams.

        Args:
            ref (`str`, *optional*, defaults to `"auto"`): `auto` (newest healthy), `best`
                (lowest loss), `fastest` (lowest recovery cost), `step:N`, or a path; `None`
                starts fresh. `auto` on an empty store starts fresh.

        Returns:
            `LoadedCheckpoint | None`: what was restored (`None`: fresh start).

        Raises:
            `CheckpointNotFoundError`: an explicit `ref` names nothing loadable.
            `IncompatibleStateError`: the checkpoint does not fit the model.
            `GlobalBatchError`: on another number of processes, no gradient accumulation keeps the checkpoint's
                global batch with this per-device batch (the message names settings that would).
        """
        into = None if self.run.sharded else self.state.read_targets()
        loaded = self.run.resume(ref, expected=self.state.weights(), into=into)
        if loaded is None:
            logger.info("resume(%r): nothing to resume, starting fresh", ref)
            return None
        try:
            apply_elastic(loaded, saved_extra=loaded.extra.get(KEY_ACCELERATE) or {}, state=self.state,
                          run=self.run, accelerator=self.accelerator)
        except ConfigError as e:  # GlobalBatchError: the weights are in the model already
            if not into:
                raise
            raise type(e)(f"{e}{weights_overwritten(f'the weights of step {loaded.info.step}')}") from None
        self.state.apply(loaded)
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        self.run.note_boundary(self.step, rng=loaded.rng)
        dist.barrier()
        self.loaded = loaded
        if self.state.loader is None:
            self._randomness.begin()
        return loaded

    def metrics(self) -> dict[str, float]:
        """`smart_ckpt/*` numbers for `accelerator.log(...)`."""
        return self.run.metrics()

    def close(self, *, exit_if_preempted: bool = True) -> None:
        """Wait for the last write, remove hooks and probes, close the store (idempotent).

        After a preemption save the process then exits with `preemption_exit_code` (128 + the
        signal by default) so the scheduler requeues the job; `exit_if_preempted=False` returns.
        """
        if self.hooks is not None:
            self.hooks.remove()
        self.run.close()
        self.state.close()
        if exit_if_preempted:
            self.run.exit_if_preempted()

    def __enter__(self) -> SmartCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

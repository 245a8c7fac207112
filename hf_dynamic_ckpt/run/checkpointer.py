"""The one orchestrator both integrations call: probes -> policy -> snapshot/writer -> store.

`Checkpointer` is framework-free: it knows torch modules, optimizers and schedulers, never
`Trainer` or `Accelerator`. An integration calls, per optimizer step:

```
pre_update(step)                      # gradients complete, weights not yet updated
    -> Decision (skip_update: this step's gradients were dropped)
step_end(step, epoch)                 # after optimizer.step / scheduler.step / zero_grad
    -> Decision (kind PREEMPTION: a checkpoint is committed, the run should stop)
release()                             # only with hold_saves: the step's logging is done, write now
```

and `resume(spec)` to come back (`restore.plan_resume`: one agreed outcome on every rank).
Under DDP every rank calls the same methods in the same order: the signals are reduced in one
collective per step, the policy reads nothing else, and the reduction also compares a fingerprint
of the decisions so far: ranks that would diverge raise the same `DistributedError`, not wait.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..constants import ALL_TIERS, Tier
from ..errors import ConfigError, DistributedError
from ..export import KEY_MODEL, describe_model
from ..policy.decision import Decision, DecisionKind
from ..policy.rules import RulePolicy
from ..signals.frame import SignalFrame
from ..signals.probes import PreemptionFlag
from ..state import RngState, StateSources, capture_raw_rng_state
from ..state.shards import ShardedState
from ..state.support import check_model
from ..store.remote import is_url
from ..store.spec import Lineage, new_session_id
from ..store.types import CheckpointInfo, LoadedCheckpoint
from .fsdp import resume_sharded, sources_for
from .resume import ResumeState
from .savelog import SaveEvent
from .saver import HeldSave, Saver, exit_after_preemption, open_store_and_engine
from .sensing import Sensors
from .steplog import RunTimeline

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "SaveEvent"]


class Checkpointer:
    """Signal-driven, tiered, non-blocking checkpointing of one training run.

    Args:
        config (`SmartCkptConfig`): the knobs; `config.root` or `root` names the store.
        root (`str` or `Path`, *optional*): store directory (overrides `config.root`).
        rank, world_size (`int`, *optional*): this process's rank and the number of ranks; default: the process group's.

    Example:
        ```python
        >>> ckpt = Checkpointer(SmartCkptConfig(base_interval=50), root="out/smart_ckpt")
        >>> ckpt.attach(model, optimizer=opt, scheduler=sched)
        >>> for step, batch in enumerate(loader, start=1):
        ...     model(**batch).loss.backward()
        ...     ckpt.pre_update(step - 1)
        ...     opt.step(); sched.step(); opt.zero_grad()
        ...     if ckpt.step_end(step, epoch=0.0).kind == DecisionKind.PREEMPTION:
        ...         break
        >>> ckpt.close()
        ```
    """

    def __init__(self, config: SmartCkptConfig, *, root: str | Path | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.config = config
        self.rank = dist.rank() if rank is None else rank
        self.world_size = dist.world_size() if world_size is None else world_size
        root = root if root is not None else config.root
        if root is None:
            raise ConfigError("root=None is invalid: pass Checkpointer(config, root=...) or SmartCkptConfig(root=...).")
        session = new_session_id() if self.rank == 0 else None
        self.session_id: str = dist.broadcast_object(session) if self.world_size > 1 else session  # type: ignore[assignment]

        self.store, self.engine = open_store_and_engine(config, root, rank=self.rank, world_size=self.world_size,
                                                        session_id=self.session_id)
        self.root = Path(self.store.root) if is_url(root) else Path(root)  # URL root: its local cache (timeline)
        self.policy = RulePolicy(config)
        self.saver = Saver(config, self.store, self.engine, rank=self.rank)
        self.saver.on_first_save = self._first_save
        self.last_frame: SignalFrame | None = None
        self.last_decision: Decision | None = None
        self.preempted = False
        self.preempt_signal: int | None = None
        self.hold_saves = False  # step_end's save waits for release() (Trainer: the step's logs/eval first)
        self.lineage = Lineage(session=self.session_id, timeline=new_session_id())
        self._resume = ResumeState(self)
        self._fork_pending = True  # a fresh timeline abandons other timelines' checkpoints at its first save
        self._held: HeldSave | None = None
        self._sources: StateSources | None = None
        self._user_extra: Callable[[], dict[str, Any]] | None = None
        self._model_info: dict[str, Any] | None = None
        self._model: nn.Module | None = None
        self._optimizer: Any | None = None
        self._sharded: ShardedState | None = None
        self.sensors: Sensors | None = None
        self._frame: SignalFrame | None = None  # reduced frame of the step in progress
        self._boundary_rng: RngState | None = None  # RNG at the end of the previous step
        self._boundary_step: int | None = None
        self.timeline = RunTimeline(self.store.task_dir, rank=self.rank)
        self._closed = False
        self.store.on_handover(self._handed_over)

    # ------------------------------------------------------------------ wiring
    log = property(lambda self: self.saver.log, doc="The run's saves and their counters (`SaveLog`).")
    events = property(lambda self: self.saver.log.events, doc="Every save of this run, in order.")

    def attach(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        scaler: Any | None = None,
        weights: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        frozen_keys: Iterable[str] = (),
        extra: Callable[[], dict[str, Any]] | None = None,
        sampler: Callable[[], dict[str, Any]] | None = None,
        clip_owner: Any | None = None,
        loss_model: nn.Module | None = None,
        before_save: Callable[[Decision], None] | None = None,
        model_info: dict[str, Any] | None = None,
    ) -> None:
        """Install the probes and remember what a save reads.

        Args:
            model (`nn.Module`): the trained model (gradients and LoRA layers are read from it).
            optimizer, scheduler, scaler (*optional*): L1 sources.
            weights (`Callable`, *optional*): returns the L0 tensors (default: the trainable weights, cached).
            frozen_keys (`Iterable[str]`, *optional*): weight names that never change (stored once).
            extra (`Callable`, *optional*): JSON-able data for the manifest's `extra` (plus the policy's state).
            sampler (`Callable`, *optional*): JSON-able data position (L2).
            clip_owner (*optional*): object whose `clip_grad_norm_` returns the pre-clip norm
                (an `accelerate.Accelerator`); wrapped so the policy sees the pre-clip norm.
            loss_model (`nn.Module`, *optional*): module whose forward output carries `loss`.
            before_save (`Callable[[Decision], None]`, *optional*): called on every rank right
                before each save (every rank takes the same saves, so it may run collectives).
            model_info (`dict`, *optional*): what export needs to rebuild the model (`export.describe_model`,
                the default); stored in every manifest's ``extra["model"]``.
        """
        check_model(model)  # DeepSpeed / FSDP1 wrappers: refused (state.support)
        self.detach()
        self._model = model
        self._optimizer = optimizer
        self._user_extra = extra
        self._model_info = model_info if model_info is not None else describe_model(model)
        self.saver.before_save = before_save
        self._sharded, self._sources, own = sources_for(  # FSDP2: every rank saves its own shards
            model, rank=self.rank, weights=weights, frozen_keys=frozen_keys, optimizer=optimizer, scheduler=scheduler,
            scaler=scaler, sampler=sampler, extra=self._extra)
        self.saver.own_tiers = own
        self.sensors = Sensors(self.config, model, loss_model=loss_model, clip_owner=clip_owner)
        self.prepare_buffers()
        self.timeline.open()
        self._resume.apply_policy_state()

    def prepare_buffers(self) -> None:
        """Prepare the snapshot buffers and copy plans in the background now, not in the first save (at attach, and
        after the trainable state moved: `state.flat`); once a resume's optimizer-tier read is done."""
        if self._sources is not None:  # else not attached: nothing to prepare yet
            self._resume.after_read(functools.partial(self.engine.prepare, self._sources, self.saver.own_tiers))

    def detach(self) -> None:
        """Remove the probes and signal handlers (idempotent). Pending writes keep going."""
        if self.sensors is not None:
            self.sensors.remove()
            self.sensors = None
        self.timeline.close()

    @property
    def preemption_flag(self) -> PreemptionFlag | None:
        """The installed preemption flag (tests and schedulers may `set()` it)."""
        return self.sensors.flag if self.sensors is not None else None

    def _extra(self) -> dict[str, Any]:
        out = dict(self._user_extra()) if self._user_extra is not None else {}
        out.update(self.extra_state())
        out[KEY_MODEL] = self._model_info
        return out

    def extra_state(self) -> dict[str, Any]:
        """Policy and probe statistics and the run's save counters as stored in the manifest's `extra` (`policy`,
        `save_log`, `grad_probe`)."""
        out: dict[str, Any] = {"policy": self.policy.state_dict(), "save_log": self.log.counts_for_save()}
        if self.sensors is not None:
            out["grad_probe"] = self.sensors.grad.state_dict()
        return out

    # ------------------------------------------------------------------ per step
    def step_begin(self) -> None:
        """Start of an optimizer step: writes a save held since the previous `step_end` (`release`)."""
        self.release()

    def note_boundary(self, step: int, rng: RngState | None = None) -> None:
        """Record the RNG state at the end of `step` (what a later pre-update capture or held save stores). Call it
        once when training starts (with the restored RNG after a resume) so the first step's update can be captured."""
        if self.config.pre_anomaly_capture or self.hold_saves:
            self._boundary_rng = rng if rng is not None else capture_raw_rng_state()  # JSON made by the writer
            self._boundary_step = step

    def _measure(self, step: int) -> SignalFrame:
        if self.sensors is None:
            return SignalFrame(step=step, save_blocking_s=self.log.take_blocking_s())
        try:
            return self.sensors.measure(step, save_blocking_s=self.log.take_blocking_s(),
                                        fingerprint=float(len(self.log.events)))
        except DistributedError:
            self._abort("a rank failed or diverged")
            raise

    def pre_update(self, step: int, *, epoch: float | None = None) -> Decision:
        """Gradients are complete, the update not applied: measure, and capture if the policy says so.

        `step` counts the updates completed *before* this one (Trainer's `global_step`); `epoch` is
        that state's fractional epoch. With `skip_update` in the returned decision the gradients
        were dropped (`param.grad = None`), so the optimizer skips the update.
        """
        self.release()
        frame = self._measure(step + 1)
        groups = getattr(self._optimizer, "param_groups", None)
        if groups:
            frame.lr = float(groups[0]["lr"])  # the rate this update will use (the LR-surge trigger reads it)
        self._frame = frame
        decision = self.policy.pre_update(frame)
        if decision.save and not self.saver.pin_existing(step, decision):  # else: a checkpoint of `step` exists
            if self._boundary_step == step and self._boundary_rng is not None:
                self._save(decision, step=step, epoch=epoch if epoch is not None else 0.0, at_step=step + 1,
                           rng=self._boundary_rng)
            else:
                logger.debug("step %d: pre-update capture (%s) not taken: no RNG state recorded at the end of step %d",
                            step + 1, decision.reason, step)
        if decision.skip_update and self._model is not None:
            logger.warning("step %d: skipping the optimizer update (%s)", step + 1, decision.reason or "bad update")
            for p in self._model.parameters():
                p.grad = None
        return decision

    def step_end(self, step: int, epoch: float, *, lr: float | None = None) -> Decision:
        """After the update of step `step` (updates completed): decide, and save or stop on preemption.

        `lr` (the rate this step used) only fills the frame when `pre_update` could not read it.
        With `kind == DecisionKind.PREEMPTION` a checkpoint has been committed synchronously and
        `self.preempted` is set: the caller should stop. Raises the `SaveError` of an earlier
        failed save when `on_save_error="raise"`.
        """
        self.release()
        self.saver.raise_pending()
        frame = self._frame if self._frame is not None and self._frame.step == step else self._measure(step)
        self._frame = None
        if frame.lr is None:
            frame.lr = lr
        decision = self.policy.decide(frame)
        self.last_frame, self.last_decision = frame, decision
        self.saver.collect_finished()
        self.note_boundary(step)
        if decision.save and decision.kind == DecisionKind.PREEMPTION:
            assert self._sources is not None, "attach() first"
            flag = self.preemption_flag
            self.preempt_signal = flag.signum if flag is not None else None
            self.saver.emergency(self._sources, decision, step=step, epoch=epoch, signum=self.preempt_signal,
                                 frame=frame, debug_info=self.policy.debug_info(), lineage=self.lineage)
            self.preempted = True
        elif decision.save and self.hold_saves:
            sampler = self._sources.sampler() if self._sources is not None and self._sources.sampler else None
            self._held = HeldSave(decision, step, epoch, self._boundary_rng, sampler, frame)
            return decision  # the timeline row is written with the save, at release()
        elif decision.save:
            self._save(decision, step=step, epoch=epoch, at_step=step)
        self._write_timeline(frame, decision)
        return decision

    def release(self) -> SaveEvent | None:
        """Write the save held since `step_end` (no-op when none is held). Call on every rank alike."""
        held, self._held = self._held, None
        if held is None:
            return None
        event = self._save(held.decision, step=held.step, epoch=held.epoch, at_step=held.step, rng=held.rng,
                           sampler=held.sampler)
        self._write_timeline(held.frame, held.decision)
        return event

    def restart_timeline(self, step: int) -> None:
        """The loop restarted at `step` (e.g. Trainer's `auto_find_batch_size` retry): a new timeline
        whose first save abandons the failed attempt's; the policy restarts from the restored statistics."""
        self._held = None
        self._resume.restart(step)

    def save_now(self, step: int, epoch: float, *, reason: str = "manual", tiers: Iterable[Tier] = ALL_TIERS,
                 pin: bool = False, blocking: bool = True) -> SaveEvent:
        """Save the current state of `step` outside the policy (e.g. the end of training)."""
        self.release()
        kind = DecisionKind.TRAIN_END if reason == "train_end" else DecisionKind.MANUAL
        decision = Decision(save=True, tiers=frozenset(tiers), reason=reason, pin=pin, step=step, kind=kind)
        return self._save(decision, step=step, epoch=epoch, at_step=step, blocking=blocking)

    # ------------------------------------------------------------------ saving
    def _save(self, decision: Decision, *, step: int, epoch: float, at_step: int, rng: RngState | None = None,
              sampler: dict[str, Any] | None = None, blocking: bool = False) -> SaveEvent:
        assert self._sources is not None, "attach() first"
        return self.saver.save(self._sources, decision, step=step, epoch=epoch, at_step=at_step, frame=self.last_frame,
                               debug_info=self.policy.debug_info(), lineage=self.lineage, rng=rng, sampler=sampler,
                               blocking=blocking)

    def _first_save(self) -> None:
        """The first save of a fresh timeline: rank 0 sets other timelines' newer checkpoints aside."""
        if self._fork_pending and self.rank == 0:
            self._resume.fork(after_step=self.lineage.parent_step)
        self._fork_pending = False

    def _write_timeline(self, frame: SignalFrame, decision: Decision) -> None:
        self.timeline.step(frame, decision, self.log.events)

    def log_event(self, kind: str, **data: Any) -> None:
        """Append a non-step event (e.g. a resume) to the timeline (rank 0)."""
        self.timeline.event(kind, **data)

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, float]:
        """`smart_ckpt/*` numbers for the training logs (saves, failed saves, last save step, stall, risk)."""
        self.saver.collect_finished()
        last = self.last_decision
        held = self._held.step if self._held is not None else None  # decided, written once the step's logging ends
        return self.log.metrics(risk=last.risk if last is not None else None,
                                interval=last.interval if last is not None else None, held_step=held)

    # ------------------------------------------------------------------ shutdown
    def finish(self) -> CheckpointInfo | None:
        """Write a held save, wait for the last background write and settle every save.

        Raises:
            `SaveError`: a save failed and `on_save_error="raise"` (with `"warn"`, failures are
                counted and warned about, the same for the last save as for any other).
        """
        self.release()
        return self.saver.finish()

    def close(self) -> None:
        """Wait for pending writes, remove the probes, close the engine and the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.finish()
        finally:
            self.detach()
            self._resume.close()
            self.engine.close()
            self.store.close()

    def _handed_over(self) -> None:
        """A later attach of this process takes the task (a notebook re-run, another Trainer): the writes in
        flight commit, a save decided but not written yet is dropped (its step's logging never came, and
        writing it could run a collective on this rank alone), and this run closes."""
        self._held = None
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def exit_if_preempted(self) -> None:
        """After a preemption save, end the process with `preemption_exit_code` (128 + signal by default), so a
        scheduler requeues the job instead of reading it as finished. Call it once training stopped and closed."""
        if self.preempted:
            exit_after_preemption(self.config, self.preempt_signal)

    def _abort(self, why: str) -> None:
        """A fatal error (a rank died or diverged): a commit waiting for other ranks gives up now."""
        self.store.abort(why)
        self.engine.abort(why)

    # ------------------------------------------------------------------ resume
    def resume(self, spec: str | None, *, background_optimizer: bool = False,
               expected: Mapping[str, Any] | None = None) -> LoadedCheckpoint | None:
        """Choose, verify and load a restore point: one agreed outcome on every rank.

        The restore point is planned by `restore.plan_resume`; once it is verified and fits the
        model (`expected`: the live L0 mapping), rank 0 starts a new timeline from it: checkpoints
        of the run that went past it become *abandoned* (kept, restorable by `step:N`, never
        chosen by `auto`), never deleted. `background_optimizer`: read L1 in a thread, then
        `complete_resume(loaded)`. Details: `_resume.ResumeState.resume`.

        Returns:
            `LoadedCheckpoint | None`: this rank's view, or `None` for a fresh start (`auto`, empty store).
        """
        if self._sharded is not None:  # FSDP2: DCP reads the shards after the agreed plan (a collective)
            return resume_sharded(self, self._sharded, spec)
        return self._resume.resume(spec, background_optimizer=background_optimizer, expected=expected)

    def complete_resume(self, loaded: LoadedCheckpoint) -> None:
        """Wait for a background optimizer-tier read and fill it in (agreed: lost on one rank, lost on all)."""
        self._resume.complete(loaded)


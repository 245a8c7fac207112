"""The one orchestrator both integrations drive: probes -> policy -> snapshot/writer -> store, and the resume.

`RunOrchestrator` is framework-free (never `Trainer` or `Accelerator`); it owns the run's collaborators and applies
what they return (none calls back into it). Under DDP every rank calls the same methods in the same order: the signals
are reduced in one collective per step, which also compares a fingerprint of the decisions so far (ranks that would
diverge raise the same `DistributedError`). A rollback is the resume of a healthy restore point applied to the live
run (`rollback`); the integration finishes the `Rollback` with what only it knows (Trainer's step counter, a custom
loop's data position).
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import distributed as dist
from ..config import FallbackStrategy, OnSaveError, RollbacksExhausted, SmartCkptConfig
from ..constants import ALL_TIERS, KEY_RANK_CHUNKS, KEY_RNG_AT, RNG_AT_STEP_BEGIN, Tier
from ..engine import SaveEngine
from ..errors import ConfigError, DistributedError, DynamicCkptError, RollbackError, SaveError
from ..export import KEY_MODEL, describe_model
from ..jsonutil import json_safe
from ..policy.retention import plan_retention, tier_retention_from_config
from ..policy.rules import RollbackRule, RollbackVerdict, RulePolicy, Verdict
from ..sharded import ShardedState, ZeroGradSquares, ZeroState, ZeroUpdateSeam, sources_for
from ..signals import Decision, DecisionKind, SignalFrame
from ..state import (
    RngState,
    StateSources,
    apply_optimizer_state,
    apply_weights,
    capture_raw_rng_state,
    check_model,
    expected_weights,
    restore_rng_state,
    zero_optimizer,
)
from ..store import CheckpointInfo, CheckpointStore, Lineage, LoadedCheckpoint, SaveRequest, is_url, new_session_id
from .record import METRIC_PREFIX, SaveEvent, SaveLog, StepLog, human_size
from .resume import (
    KEY_GRAD_PROBE,
    KEY_POLICY,
    KEY_ROLLBACKS,
    KEY_SAVE_LOG,
    Resumption,
    plan_resume,
)
from .saver import HeldSave, MemoryTier, open_run_store
from .sensing import PreemptionFlag, Sensors

logger = logging.getLogger(__name__)

__all__ = ["RunOrchestrator", "SaveEvent"]

SaveExtra = Callable[[Decision], dict[str, Any]]  # an integration's part of a save's manifest `extra`

@dataclass
class _OpenRun:
    """An open run as `_RUNS` keeps it: the run weakly (a dropped Trainer must not stay alive for it), its engine,
    memory tier and store strongly (a run collected without `close()` still holds the task's writer lock: the next run
    closes them)."""

    run: weakref.ref[RunOrchestrator]
    session_id: str
    store: Any
    memory: Any
    engine: Any = None

    def close_parts(self) -> None:
        """Close the engine (its writes in flight commit), the memory tier (clean: its slots go) and the store."""
        if self.engine is not None:
            self.engine.close()
        self.memory.close(clean=True)
        self.store.close()


_RUNS: dict[str, _OpenRun] = {}
"""The open runs of this process, by task and rank: a new run closes the earlier one first."""


class RunOrchestrator:
    """Signal-driven, tiered, non-blocking checkpointing of one training run. `root` overrides `config.root`; `rank`
    and `world_size` default to the process group's; `announce` gets the INFO line per save and the resume line.

    Example:
        ```python
        >>> run = RunOrchestrator(SmartCkptConfig(base_interval=50), root="out/smart_ckpt")
        >>> run.attach(model, optimizer=opt, scheduler=sched)
        >>> for step, batch in enumerate(loader, start=1):
        ...     model(**batch).loss.backward()
        ...     run.pre_update(step - 1)
        ...     opt.step(); sched.step(); opt.zero_grad()
        ...     if run.step_end(step, epoch=0.0).kind == DecisionKind.PREEMPTION:
        ...         break
        >>> run.close()
        ```
    """

    def __init__(self, config: SmartCkptConfig, *, root: str | Path | None = None, rank: int | None = None,
                 world_size: int | None = None, announce: logging.Logger | None = None) -> None:
        self.config = config
        self.rank = dist.rank() if rank is None else rank
        self.world_size = dist.world_size() if world_size is None else world_size
        root = root if root is not None else config.root
        if root is None:
            raise ConfigError("root=None is invalid: pass RunOrchestrator(config, root=...) or "
                              "SmartCkptConfig(root=...).")
        session = new_session_id() if self.rank == 0 else None
        self.session_id: str = dist.broadcast_object(session) if self.world_size > 1 else session  # type: ignore[assignment]
        self.announce = announce if announce is not None else logger
        self._key = f"{root if is_url(root) else os.path.abspath(root)}#{config.task_id}#{self.rank}"
        earlier = _RUNS.pop(self._key, None)
        if earlier is not None:  # a notebook cell re-run after an exception, another Trainer
            logger.info("task %r under %s: this process already runs on it (session %s); that run is closed first "
                        "(its writes in flight commit) and session %s takes over", config.task_id, root,
                        earlier.session_id, self.session_id)
            run = earlier.run()
            if run is not None:  # the writes in flight commit; a held save (writing it could run a collective on
                run._held = run._rollback = None  # this rank alone) and a pending rollback are dropped
                run.close()
            else:  # dropped without close(): what still holds the task
                earlier.close_parts()
        # `recovery`: a killed run's memory slots newer than the disk store (`SlotRecovery`), or `None`.
        self.store, self.recovery = open_run_store(config, root, rank=self.rank, world_size=self.world_size,
                                                   session_id=self.session_id)
        # the newest state in host shared memory, persisted if the process dies; before the engine (its writer writes
        # the slots)
        self.memory = MemoryTier(config, self.store, world_size=self.world_size)
        self.memory.recovery = self.recovery
        self._engine: SaveEngine | None = None
        self.log = SaveLog()  # the run's saves and their counters
        # The tiers this rank writes (`attach` sets them: FSDP2 ranks write their shards too).
        self.own_tiers: frozenset[Tier] = frozenset(ALL_TIERS) if self.rank == 0 else frozenset({Tier.STATE})
        self._raise_next: SaveError | None = None
        self._memory_handle: Any = None
        self._open = _RUNS[self._key] = _OpenRun(weakref.ref(self), self.session_id, self.store, self.memory)
        self.root = Path(self.store.root) if is_url(root) else Path(root)  # URL root: its local cache (step log)
        self.policy = RulePolicy(config)
        self.rollbacks = RollbackRule()  # the rollbacks taken (`on_anomaly: rollback`), restored by a resume
        self.last_frame: SignalFrame | None = None
        self.last_decision: Decision | None = None
        self.preempted = False
        self.preempt_signal: int | None = None
        self.hold_saves = False  # `step_end`'s save waits for `release()` (Trainer: the step's logging first)
        self.lineage = Lineage(session=self.session_id, timeline=new_session_id())
        self.resumed: Resumption | None = None  # the last resumption applied (`apply`)
        self.sensors: Sensors | None = None
        self.steplog = StepLog(self.store.task_dir, rank=self.rank)
        self._fork_pending = True  # a fresh timeline sets other timelines' checkpoints aside at its first save
        self._from_memory = False  # the last resume restored a killed run's memory slot (`SlotRecovery`)
        self._resume_event: dict[str, Any] | None = None  # the step log's resume entry, written by `_start_timeline`
        self._held: HeldSave | None = None
        self._sources: StateSources | None = None
        self._integration_extra: SaveExtra | None = None
        self._model_info: dict[str, Any] | None = None
        self._model: nn.Module | None = None
        self._optimizer: Any | None = None
        self._scheduler: Any | None = None
        self._scaler: Any | None = None
        self._sharded: ShardedState | ZeroState | None = None
        self._zero_grads: ZeroGradSquares | None = None
        self._warned_zero_capture = False
        self._zero_seam: ZeroUpdateSeam | None = None
        self._position: Callable[[], tuple[int, float | None]] | None = None
        self._early: tuple[int, Decision] | None = None  # a decision taken inside the ZeRO engine's step
        self._probe_state: dict[str, Any] | None = None  # restored once the probes are attached
        self._stepped = False  # the first step_end starts the save side (`start_writer`)
        self._started = False
        self._frame: SignalFrame | None = None  # reduced frame of the step in progress
        self._rollback: tuple[RollbackVerdict, int] | None = None  # confirmed at pre_update for the step whose
        # update was dropped, taken by rollback()
        self._boundary_rng: RngState | None = None  # RNG at the end of the previous step (or the next one's start)
        self._boundary_step: int | None = None
        self._boundary_at_begin = False  # `_boundary_rng` was taken at a `step_begin`
        self._closed = False

    # ------------------------------------------------------------------ wiring
    events = property(lambda self: self.log.events, doc="Every save of this run, in order.")

    @property
    def engine(self) -> SaveEngine:
        """The save engine (snapshot buffers, writer process), created at its first use."""
        if self._engine is None:
            self._engine = SaveEngine(self.store, mode=self.config.engine,
                                      memory_margin=self.config.runtime.memory_margin,
                                      overlap=self.config.runtime.overlap_snapshot, slots=self.memory.slots)
            self._open.engine = self._engine
        return self._engine

    @property
    def started(self) -> bool:
        """Whether the engine was started (a run that only resumed, or never saved, has none)."""
        return self._engine is not None

    def attach(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None,
               scaler: Any | None = None, weights: Callable[[], Mapping[str, torch.Tensor]] | None = None,
               frozen_keys: Iterable[str] = (), extra: SaveExtra | None = None,
               sampler: Callable[[], dict[str, Any]] | None = None, clip_owner: Any | None = None,
               loss_model: nn.Module | None = None, model_info: dict[str, Any] | None = None, hold_saves: bool = False,
               position: Callable[[], tuple[int, float | None]] | None = None) -> None:
        """Install the probes and remember what a save reads.

        `weights`: the L0 tensors (default: the trainable weights); `frozen_keys`: never change (stored once);
        `extra`: the integration's JSON-able part of a manifest's `extra`, called on every rank right before each
        save (it may run a collective); `sampler`: the data position (L2); `clip_owner`: its `clip_grad_norm_` is
        wrapped so the policy sees the pre-clip norm; `loss_model`: its output carries `loss`; `model_info`: what
        export needs (``extra["model"]``, default `export.describe_model`); `hold_saves`: a save decided at
        `step_end` is written at the next `release()` or `step_begin`; `position`: the `(step, epoch)` `pre_update`
        would be given, readable while the step runs: under DeepSpeed ZeRO (the update is applied inside
        `backward`) `pre_update` then runs inside the engine's step (`sharded.ZeroUpdateSeam`).
        """
        check_model(model)  # DeepSpeed / FSDP1 wrappers: refused (`state.check_model`)
        if self.config.policy.skip_bad_update and zero_optimizer(optimizer) is not None:
            raise ConfigError("policy.skip_bad_update is not supported under DeepSpeed ZeRO: the engine applies the "
                              "update inside backward, and skipping it would mean dropping its partitions' gradients "
                              "inside DeepSpeed's step. Set skip_bad_update=False (the default), or "
                              "on_anomaly='rollback' to undo a bad update.")
        self.detach()
        # Every rank's live objects, for a rollback (rank 0 alone saves the optimizer tier).
        self._model, self._optimizer, self._scheduler, self._scaler = model, optimizer, scheduler, scaler
        self._integration_extra = extra
        self._model_info = model_info if model_info is not None else describe_model(model)
        self.hold_saves = hold_saves
        self._sharded, self._sources, own = sources_for(  # FSDP2: every rank saves its own shards
            model, rank=self.rank, weights=weights, frozen_keys=frozen_keys, optimizer=optimizer, scheduler=scheduler,
            scaler=scaler, sampler=sampler)
        self.own_tiers = own
        self.sensors = Sensors(self.config, model, loss_model=loss_model, clip_owner=clip_owner)
        if isinstance(self._sharded, ZeroState) and self.sensors.grad.layer_names:  # gradients only in partitions
            grad = self.sensors.grad
            self._zero_grads = ZeroGradSquares(self._sharded, grad.bucket, len(grad.layer_names) + 1)
            grad.partition_squares = self._zero_grads.pop
        self._position = position
        if isinstance(self._sharded, ZeroState) and position is not None \
                and (not self.sensors.grad.layer_names or self._sharded.trained_partitions() == 1):
            # The per-layer norms are whole at the first partition's step only when there is one (LoRA usually).
            self._zero_seam = ZeroUpdateSeam(self._sharded, self._pre_update_in_engine)
        self.start_writer()
        self.steplog.open()
        self._restore_probe_state()

    def start_writer(self) -> None:
        """Start the save engine's writer process in the background, ready before the first save (a save that finds
        it still starting writes synchronously): once the run's first step has ended (a resume only reads, and the
        first step runs alone), and after a resume's background optimizer-tier read, once it is in."""
        if self._started or self._sources is None or not self._stepped \
                or (self.resumed is not None and self.resumed.pending is not None):
            return  # not attached, before the first step, or an L1 read on its way (`complete_resume` starts it)
        self._started = True
        self.engine.start()

    def detach(self) -> None:
        """Remove the probes and signal handlers (idempotent). Pending writes keep going."""
        for name in ("sensors", "_zero_grads", "_zero_seam"):
            if (probe := getattr(self, name)) is not None:
                probe.remove()
                setattr(self, name, None)
        self._early = None
        self.steplog.close()

    @property
    def preemption_flag(self) -> PreemptionFlag | None:
        """The installed preemption flag (tests and schedulers may `set()` it)."""
        return self.sensors.flag if self.sensors is not None else None

    @property
    def pending_save(self) -> Decision | None:
        """The save decided at the last `step_end` and held until `release()` (`hold_saves`), if any."""
        return self._held.decision if self._held is not None and not self._held.memory else None

    def _extra(self, decision: Decision) -> dict[str, Any]:
        """A save's manifest `extra` (this rank's): the integration's part, the run's own state, the model, a sharded
        run's chunk table."""
        out = dict(self._integration_extra(decision)) if self._integration_extra is not None else {}
        out.update({KEY_POLICY: self.policy.state_dict(), KEY_SAVE_LOG: self.log.counts_for_save(),
                    KEY_ROLLBACKS: self.rollbacks.state_dict(), KEY_MODEL: self._model_info})
        if self.sensors is not None:
            out[KEY_GRAD_PROBE] = self.sensors.grad.state_dict()
        if self._sharded is not None:
            out[KEY_RANK_CHUNKS] = self._sharded.chunks()
        return out

    # ------------------------------------------------------------------ per step
    def step_begin(self) -> None:
        """Start of an optimizer step whose batches are fetched (Trainer's `on_step_begin`, with `hold_saves`). The
        RNG now is what the step's forward starts from (a resume restores it once it has fetched the same batches): a
        held save stores it and is written now, and so does a capture before this step's update (an epoch's new
        iterator, an evaluation or a collator may have drawn since `step_end`)."""
        if self._held is not None or self._boundary_step is not None:
            rng = capture_raw_rng_state()
            if self._held is not None:
                self._held.rng, self._held.rng_at_step_begin = rng, True
            if self._boundary_step is not None:
                self._boundary_rng, self._boundary_at_begin = rng, True
        self.release()

    def note_boundary(self, step: int, rng: RngState | None = None) -> None:
        """Record the RNG state at the end of `step` (what a later pre-update capture or held save stores). Call it
        once when training starts (with the restored RNG after a resume) so the first step's update can be captured."""
        if self.config.policy.pre_anomaly_capture or self.hold_saves:
            self._boundary_rng = rng if rng is not None else capture_raw_rng_state()  # JSON made by the writer
            self._boundary_step, self._boundary_at_begin = step, False

    def _measure(self, step: int, pre_clip_norm: float | None = None, clip_norm: float | None = None) -> SignalFrame:
        """The step's frame (reduced across ranks), and what the memory tier agreed with it: the policy decides on it
        knowing whether the slots cover a process's death (its interval then follows `policy.node_mtbf_hours`)."""
        if self.sensors is None:
            frame = SignalFrame(step=step, save_blocking_s=self.log.take_blocking_s())
        else:
            try:
                frame = self.sensors.measure(step, save_blocking_s=self.log.take_blocking_s(),
                                             fingerprint=float(len(self.log.events)), pre_clip_norm=pre_clip_norm,
                                             clip_norm=clip_norm, slot=self._slot_plan(step))
            except DistributedError:  # a commit waiting for other ranks gives up now
                for part in (self.store, self._engine):
                    if part is not None:
                        part.abort("a rank failed or diverged")
                raise
            self.memory.agree(frame)
        self.policy.memory_tier = self.memory.agreed_on
        return frame

    def pre_update(self, step: int, *, epoch: float | None = None) -> Decision:
        """Gradients are complete, the update not applied: measure, and capture if the policy says so. `step`
        counts the updates completed before this one (Trainer's `global_step`). With `skip_update` the gradients
        were dropped (`param.grad = None`), so the optimizer skips the update."""
        early, self._early = self._early, None
        if early is not None and early[0] == step:  # taken inside the ZeRO engine's step (`ZeroUpdateSeam`)
            return early[1]
        late = isinstance(self._sharded, ZeroState) and not self._sharded.skipped_update  # updated in backward
        return self._pre_update(step, epoch=epoch, late=late)

    def _pre_update_in_engine(self) -> None:
        """`pre_update` inside the ZeRO engine's step, before any partition is updated; a capture's copy is complete
        before the update starts."""
        assert self._position is not None and self._zero_seam is not None
        step, epoch = self._position()
        decision = self._pre_update(step, epoch=epoch, pre_clip_norm=self._zero_seam.norm,
                                    clip_norm=self._zero_seam.clip)
        self._early = (step, decision)
        if decision.save:
            self.wait_snapshot()

    def _pre_update(self, step: int, *, epoch: float | None, late: bool = False, pre_clip_norm: float | None = None,
                    clip_norm: float | None = None) -> Decision:
        """`pre_update`'s work; `late`: the update is applied already (ZeRO, outside the engine's step)."""
        self.release()
        if self.resumed is not None:
            self._start_timeline()  # a resumed run trains: its timeline is the task's from now on
        frame = self._measure(step + 1, pre_clip_norm, clip_norm)
        groups = getattr(self._optimizer, "param_groups", None)
        if groups:
            frame.lr = float(groups[0]["lr"])  # the rate this update will use (the LR-surge trigger reads it)
        self._frame = frame
        decision = self.policy.pre_update(frame)
        if decision.save and not self._pin_existing(step, decision):  # else: a checkpoint of `step` exists
            if late:  # ZeRO outside the engine's step: the update is applied, a capture would file it under `step`
                if not self._warned_zero_capture and self.rank == 0:
                    self.announce.warning(
                        "smart_ckpt: step %d: %s, but the DeepSpeed engine applied the update before the step's "
                        "signals were read here: the state before it cannot be captured (not captured; the newest "
                        "checkpoint before it stays the restore point; said once per run)", step + 1, decision.reason)
                self._warned_zero_capture = True
                decision = replace(decision, save=False, pin=False)
            elif self._boundary_step == step and self._boundary_rng is not None:
                self._save(decision, step=step, epoch=epoch if epoch is not None else 0.0, at_step=step + 1,
                           rng=self._boundary_rng, rng_at_step_begin=self._boundary_at_begin)
            else:
                logger.debug("step %d: pre-update capture (%s) not taken: no RNG state recorded at the end of step %d",
                             step + 1, decision.reason, step)
        # After the capture: the capture stores the rule's state from before this step, as a resume replays it.
        verdict = self.rollbacks.observe(frame.step, self.policy.last_bad_update, self.config)
        if verdict.verdict == Verdict.EXHAUSTED and \
                self.config.policy.on_rollbacks_exhausted == RollbacksExhausted.STOP:
            raise RollbackError(
                f"step {frame.step}: an anomaly ({verdict.reason}) and no rollback left; the run keeps failing here. "
                f"Rollbacks were taken at steps {', '.join(map(str, self.rollbacks.taken))}. Lower the learning rate, "
                "look at the data of the failing steps, raise policy.max_rollbacks, or set "
                "policy.on_rollbacks_exhausted='continue' to train through it (the pre-anomaly captures stay pinned).")
        if verdict.verdict == Verdict.EXHAUSTED:
            logger.warning("step %d: an anomaly (%s) and no rollback left (on_rollbacks_exhausted=continue): training "
                           "through it", frame.step, verdict.reason)
        elif verdict.verdict == Verdict.ROLLBACK:
            # The update is not applied: the next `rollback()` returns to a state from before the anomaly.
            self._rollback = verdict, frame.step
            decision = Decision(save=False, skip_update=True, reason=f"rollback: {verdict.reason}", risk=decision.risk,
                                step=frame.step, healthy=False, kind=DecisionKind.ROLLBACK)
        if decision.skip_update and self._model is not None:
            if decision.kind != DecisionKind.ROLLBACK:
                logger.warning("step %d: skipping the optimizer update (%s)", step + 1, decision.reason or "bad update")
            for p in self._model.parameters():
                p.grad = None
        return decision

    def step_end(self, step: int, epoch: float, *, lr: float | None = None) -> Decision:
        """After the update of step `step`: decide, and save (`lr`, this step's rate, fills the frame when
        `pre_update` could not read it). With kind `PREEMPTION` a checkpoint is committed and `preempted` set: stop.
        Raises an earlier failed save's `SaveError` with `on_save_error="raise"`."""
        self.release()
        if self.resumed is not None:
            self._start_timeline()
        if self._from_memory and self.recovery is not None:
            # The slot restored from goes to disk now, not beside the first step: on 2 cores the copy of a 2.6 GiB
            # slot made that step 1.5-2x slower (docs/benchmarks.md). Until it is on disk the tier writes no slot,
            # and a crash meanwhile leaves the slot to the next restart (it belongs to this timeline's parent).
            self.recovery.persist(background=True)
        self._stepped = True
        self._early = None
        if self._zero_seam is not None:
            self._zero_seam.arm()  # the next step's decision is taken inside the engine's step again
        if isinstance(self._sharded, ZeroState):
            self._sharded.note_boundary()
        self.start_writer()
        self._raise_pending()
        frame = self._frame if self._frame is not None and self._frame.step == step else self._measure(step)
        self._frame = None
        if frame.lr is None:
            frame.lr = lr
        if self._rollback is not None and self._rollback[1] == step:
            # No save and no statistics of a step about to be undone; `rollback()` comes next (should it find no
            # restore point, training goes on from this step's boundary, noted below).
            decision = Decision(save=False, reason=f"rollback: {self._rollback[0].reason}", step=step,
                                risk=self.policy.risk, healthy=False, kind=DecisionKind.ROLLBACK)
        else:
            decision = self.policy.decide(frame)
        self.last_frame, self.last_decision = frame, decision
        self._collect_finished()
        if self.hold_saves:  # the RNG the next step starts from is taken at its `step_begin`
            self._boundary_step, self._boundary_rng, self._boundary_at_begin = step, None, False
        else:
            self.note_boundary(step)
        memory = not decision.save and self.memory.agreed_on and not self.preempted  # no disk save: a memory slot
        if decision.save and decision.kind == DecisionKind.PREEMPTION:
            flag = self.preemption_flag
            self.preempt_signal = flag.signum if flag is not None else None
            self._save(decision, step=step, epoch=epoch, at_step=step)
            self.preempted = True
        elif (decision.save or memory) and self.hold_saves:
            # The data position is taken when the save is written, after the step's evaluation.
            self._held = HeldSave(decision, step, epoch, self._boundary_rng, frame, memory=memory)
            return decision  # the step log's row is written with the save, at release()
        elif decision.save or memory:
            self._save(decision, step=step, epoch=epoch, at_step=step, memory=memory)
        self.steplog.step(frame, decision, self.log.events, beta=self.policy.last_beta)
        return decision

    def release(self) -> SaveEvent | None:
        """Write the save held since `step_end` (no-op when none is held). Call on every rank alike."""
        held, self._held = self._held, None
        if held is None:
            return None
        event = self._save(held.decision, step=held.step, epoch=held.epoch, at_step=held.step, rng=held.rng,
                           rng_at_step_begin=held.rng_at_step_begin, memory=held.memory)
        self.steplog.step(held.frame, held.decision, self.log.events, beta=self.policy.last_beta)
        return event

    def restart_timeline(self, step: int) -> None:
        """The loop restarted at `step` (e.g. Trainer's `auto_find_batch_size` retry): a new timeline
        whose first save sets the failed attempt's aside; the policy restarts from the restored statistics."""
        self._held = None
        resumed = self.resumed
        parent = resumed.step if resumed is not None and resumed.step == step else None
        self.lineage = Lineage(session=self.session_id, timeline=new_session_id(), parent_step=parent,
                               parent_timeline=self.lineage.parent_timeline if parent is not None else None)
        self._fork_pending = True
        self.log.restart()
        self.policy = RulePolicy(self.config)
        if resumed is not None:
            self._restore_statistics(resumed)
        logger.debug("training restarted at step %d: new timeline %s", step, self.lineage.timeline)

    @property
    def rollback_due(self) -> bool:
        """A rollback was confirmed at the last `pre_update` and is not taken yet (`rollback()`)."""
        return self._rollback is not None

    def rollback(self, *, restore_rng: bool = True) -> Rollback | None:
        """Take the rollback the last `pre_update` confirmed (no-op without one). Call on every rank alike.

        Waits for the writes in flight (the onset's capture among them), returns to the newest healthy checkpoint
        before the onset and at most `rollback_window` steps back, reads and verifies it like a resume, puts it back
        into the live objects (the RNG too with `restore_rng`, else it is left in `Rollback.rng`) and applies it: the
        steps past it become an abandoned timeline; the save counters and rollback history go on. `None`: nothing to
        do, or no restore point (the anomaly is trained through, with a warning).
        """
        if self._rollback is None:
            return None
        (verdict, at), self._rollback = self._rollback, None
        assert self._model is not None and verdict.onset is not None, "attach() first"
        self.wait_snapshot()  # restore_live writes the tensors a snapshot may still be copying
        self._settle()  # the capture must be committed before it is read back
        # The newest healthy, committed, not abandoned checkpoint with all tiers (a rollback restores them all) in
        # [earliest, onset): rank 0 reads its store, every rank gets its answer.
        target = max((i.step for i in self.store.list() if verdict.earliest <= i.step < verdict.onset
                      and i.tiers >= ALL_TIERS), default=None) if self.rank == 0 else None
        target = dist.broadcast_object(target) if self.world_size > 1 else target
        resumption, why = None, f"no complete healthy checkpoint lies between step {verdict.earliest} and it"
        if target is not None:
            try:
                resumption = self._plan(f"step:{target}", expected=expected_weights(self._model))
            except DynamicCkptError as e:  # the same on every rank (agreed): none of them rolls back
                why = f"the restore point step {target} cannot be read ({e})"
        if resumption is None or resumption.step < verdict.earliest or resumption.degraded:
            logger.warning("step %d: an anomaly (%s) is confirmed since step %d but %s (rollback_window=%d): training "
                           "through it", at, verdict.reason, verdict.onset, why, self.config.policy.rollback_window)
            self.rollbacks.reset()
            return None
        loaded = resumption.loaded
        restore_live(loaded, model=self._model, optimizer=self._optimizer, scheduler=self._scheduler,
                     scaler=self._scaler, rng=restore_rng, weights_applied=self._sharded is not None)
        self.rollbacks.taken_at(at)
        self.log.restart()  # the saves past the restore point belong to the abandoned timeline
        self.apply(resumption, rollback=True)
        self.note_boundary(resumption.step, rng=loaded.rng)
        done = Rollback(from_step=at, to_step=resumption.step, reason=verdict.reason,
                        rng=None if restore_rng else loaded.rng, loaded=loaded)
        self.steplog.event("rollback", from_step=at, to_step=done.to_step, reason=done.reason)
        return done

    def wait_snapshot(self) -> None:
        """Wait until the last save's snapshot no longer reads the live parameters and optimizer state (an
        overlapped snapshot copies them beside the next step). Code that edits them in place between a save and the
        next optimizer step calls this first; otherwise that save fails with a `SaveError` (nothing committed)."""
        if self._engine is not None:
            self._engine.wait_snapshot()

    def save_now(self, step: int, epoch: float, *, reason: str = "manual", tiers: Iterable[Tier] = ALL_TIERS,
                 pin: bool = False, blocking: bool = True) -> SaveEvent:
        """Save the current state of `step` outside the policy (e.g. the end of training). A save of `step` with
        these tiers taken already is the one returned (pinned with `pin`, waited for with `blocking`): a second one
        would race its commit."""
        self.release()
        kind = DecisionKind.TRAIN_END if reason == "train_end" else DecisionKind.MANUAL
        decision = Decision(save=True, tiers=frozenset(tiers), reason=reason, pin=pin, step=step, kind=kind)
        existing = self.log.find(step)
        if existing is not None and decision.tiers <= existing.tiers:
            if pin:
                self._pin_existing(step, decision)
            if blocking and existing.handle is not None:
                self._settle()
            return existing
        event = self._save(decision, step=step, epoch=epoch, at_step=step, blocking=blocking)
        assert event is not None
        return event

    # ------------------------------------------------------------------ saving
    def _start_timeline(self) -> None:
        """The run's timeline starts (a fresh run's at its first save, a resumed run's when it first trains or
        saves; a resume that never trains changes nothing in the store): rank 0 makes it the task's current one,
        setting other timelines' checkpoints past the restore point (every one, for a fresh start) aside as
        abandoned (kept, never chosen by `auto`; one WARNING), and a resume is written to the step log."""
        if not self._fork_pending:
            return
        self._fork_pending = False
        if self.recovery is not None:  # before the timeline moves past the killed run's slots; when the run restored
            # from them (its timeline continues theirs), in the background once its first step has ended (`step_end`)
            self.recovery.offered = True
            if not self._from_memory:
                self.recovery.persist()
        lineage, after = self.lineage, self.lineage.parent_step
        abandoned = self.store.fork(timeline=lineage.timeline, after_step=after, session=lineage.session,
                                    parent=lineage if after is not None else None) if self.rank == 0 else []
        if abandoned:
            what = (f"checkpoints {', '.join(map(str, abandoned))} belong" if len(abandoned) > 1
                    else f"checkpoint {abandoned[0]} belongs")
            msg = (f"{what} to a run that went past "
                   f"{'the restore point' if after is not None else 'this fresh start'} (step {after or 0}); "
                   "they are kept but abandoned: `auto`, `best` and `fastest` never choose them, "
                   "`hf-dynamic-ckpt ls --all` lists them, `step:N` restores them, and retention removes them once "
                   "this run has saved past them")
            logger.warning(msg)
            warnings.warn(msg, stacklevel=3)
        event, self._resume_event = self._resume_event, None
        if event is not None:
            self.steplog.event("resume", **event)

    def _save(self, decision: Decision, *, step: int, epoch: float, at_step: int, rng: RngState | None = None,
              sampler: dict[str, Any] | None = None, blocking: bool = False, rng_at_step_begin: bool = False,
              memory: bool = False) -> SaveEvent | None:
        assert self._sources is not None, "attach() first"
        self._start_timeline()  # on every rank before any save
        if rng_at_step_begin:  # the data position says so: a resume restores it once the next step's batches are in
            if sampler is None and self._sources.sampler is not None:
                sampler = self._sources.sampler()
            if sampler is not None:
                sampler = {**sampler, KEY_RNG_AT: RNG_AT_STEP_BEGIN}
        if memory:  # the slot's `extra` runs a collective under Trainer: only where due (agreed on every rank)
            if self.memory.due(step):
                self._save_memory(decision, step=step, epoch=epoch, rng=rng, sampler=sampler,
                                  extra=self._extra(decision))
            return None
        frame, debug_info, extra = self.last_frame, self.policy.debug_info(), self._extra(decision)
        start = time.perf_counter()
        if preempted := decision.kind == DecisionKind.PREEMPTION:  # synchronous, within `preemption_grace_s`, most
            # valuable tiers first (the engine's reason is "emergency: ...")
            name, signum = "preemption", self.preempt_signal
            if signum is not None:
                try:
                    name = f"preemption: {_signal.Signals(signum).name}"
                except ValueError:
                    name = f"preemption: signal {signum}"
            decision = Decision(save=True, tiers=decision.tiers, reason=name, kind=DecisionKind.PREEMPTION, step=step)
        try:  # after rank 0 recreated a root deleted mid-run
            self.store.ensure_root()
        except DynamicCkptError as e:
            logger.warning("the store root cannot be recreated (%s); this save will fail", e)
        # Rank 0 writes weights and optimizer; every rank its own RNG file (FSDP2: and its shards).
        request = SaveRequest(step=step, epoch=float(epoch), reason=decision.reason, kind=decision.kind.value,
                              tiers=frozenset(decision.tiers or ALL_TIERS) & self.own_tiers, pinned=decision.pin,
                              healthy=decision.healthy, debug_info=tuple(debug_info), lineage=self.lineage,
                              signals=json_safe(frame.to_dict()) if frame is not None else None)
        if preempted:
            info = self.engine.emergency_save(self._sources, request,
                                              deadline_s=self.config.runtime.preemption_grace_s, extra=extra)
            blocking_ms = (time.perf_counter() - start) * 1e3
            event = self.log.add(SaveEvent(step=step, at_step=step, reason=f"emergency: {decision.reason}",
                                           tiers=info.tiers if info else request.tiers, pinned=False,
                                           blocking_ms=blocking_ms, kind=DecisionKind.PREEMPTION,
                                           bytes=info.bytes if info else None, path=info.path if info else None,
                                           staging="sync"))
            dist.barrier()
            logger.warning("preemption: committed step %d in %.0f ms; stopping training", step, blocking_ms)
            return event
        handle = self.engine.save(self._sources, request, rng=rng, sampler=sampler, extra=extra, blocking=blocking)
        event = self.log.add(SaveEvent(step=step, at_step=at_step, reason=decision.reason,
                                       tiers=frozenset(decision.tiers or request.tiers), pinned=decision.pin,
                                       blocking_ms=handle.blocking_ms, kind=decision.kind, handle=handle,
                                       staging=handle.staging, error=handle.skipped or None))
        logger.debug("save step %d (%s): blocked %.1f ms, staging %s", step, decision.reason, handle.blocking_ms,
                     handle.staging)
        if handle.done():
            self._collect(event)
        return event

    def _save_memory(self, decision: Decision, *, step: int, epoch: float, rng: RngState | None,
                     sampler: dict[str, Any] | None, extra: dict[str, Any]) -> None:
        """The state of `step`, due (`MemoryTier.due`), into a memory slot, in the background (see `MemoryTier`). A slot
        of a step the policy found unhealthy says so: persisted, it is no `auto` restore point."""
        assert self._sources is not None
        tier = self.memory
        early = not self.engine.writer_ready  # not up yet (its first seconds; `start_writer` starts it)
        if early and not tier.write_early():
            return
        previous, self._memory_handle = self._memory_handle, None
        if previous is not None:
            tier.wait_for(previous)
            tier.settle(previous)
            if tier.slots is None:
                return
        request = SaveRequest(step=step, epoch=float(epoch), tiers=self.own_tiers, reason="memory tier",
                              kind="memory_tier", lineage=self.lineage, healthy=decision.healthy)
        self._memory_handle = self.engine.save(self._sources, request, rng=rng, sampler=sampler, extra=extra,
                                               memory=True, blocking=early)
        if early:
            tier.settle(self._memory_handle)
            self._memory_handle = None

    def _slot_plan(self, step: int) -> tuple[float, float] | None:
        """Several ranks (one rank: `None`): this rank's (cadence, blocked) for step `step`'s frame, after the bounded
        wait for its previous slot's write: blocked 2 when the tier is off, 1 when a slot cannot be taken now (the
        writer not up, a write in flight, a killed run's slot being persisted), else 0."""
        tier, engine = self.memory, self._engine
        if tier.world_size == 1:
            return None
        handle = self._memory_handle
        if handle is not None and not handle.done() and tier.step_s and step % tier.cadence == 0:
            tier.wait_for(handle)
        if tier.slots is None:
            return float(tier.every), 2.0
        busy = engine is None or not engine.writer_ready or engine.busy or (handle is not None and not handle.done())
        return float(tier.every), 1.0 if busy or not tier.ready() else 0.0

    def _pin_existing(self, step: int, decision: Decision) -> bool:
        """A pre-update capture of `step` when a save of `step` exists already: pin that one, no second copy."""
        saved = self.log.find(step)
        if saved is None:
            return False
        logger.debug("step %d: %s -> pinning the checkpoint of step %d", step + 1, decision.reason, step)
        saved.pinned = True
        if saved.handle is None and saved.path is not None and self.rank == 0:
            self.store.pin(f"step:{step}")
        return True

    def _collect(self, event: SaveEvent) -> None:
        """Settle a finished save: record bytes and path, pin, apply retention; or count and warn a failure."""
        handle = event.handle
        if handle is None or not handle.done():
            return
        event.handle = None
        exc = handle.exception()
        if exc is not None:
            event.error = f"{type(exc).__name__}: {exc}"
            self.log.failed += 1
            # The engine has logged the one WARNING of this failure (with its cause); count it here.
            logger.debug("save of step %d failed (on_save_error=%s; failed saves so far: %d): %s", event.step,
                         self.config.on_save_error.value, self.log.failed, exc)
            if self.config.on_save_error == OnSaveError.RAISE and self._raise_next is None:
                self._raise_next = exc if isinstance(exc, SaveError) else SaveError(str(exc))
            return
        info = handle.wait()
        event.write_ms = handle.write_ms
        if info is not None:
            event.bytes, event.path = info.bytes, info.path
            streamed = ", streamed: no memory for snapshot buffers" if event.staging == "streaming" else ""
            self.announce.info("smart_ckpt: saved step %d (%s%s): %s, training blocked %.0f ms%s", event.step,
                               event.reason, ", pinned" if event.pinned else "", human_size(info.bytes),
                               event.blocking_ms, streamed)
            if event.pinned and not info.pinned:
                self.store.pin(info)
            self._prune()

    def _collect_finished(self) -> None:
        for event in self.log.events[-4:]:
            self._collect(event)

    def _raise_pending(self) -> None:
        """Raise the first failed save's error once (`on_save_error="raise"`)."""
        error, self._raise_next = self._raise_next, None
        if error is not None:
            raise error

    def _settle(self) -> CheckpointInfo | None:
        """Wait for the write in flight and settle every save (errors per `on_save_error`)."""
        try:
            info = self._engine.wait() if self._engine is not None else None
        except SaveError:  # settled (warned about, or raised per on_save_error) below
            info = None
        for event in self.log.events:
            self._collect(event)
        self._raise_pending()
        return info

    def _prune(self) -> None:
        """Apply retention (rank 0, between saves): keep pinned, the last N, log-spaced history."""
        if self.rank != 0 or (self._engine is not None and self._engine.busy):
            return
        c = self.config
        try:
            plan = plan_retention(self.store.list(include_unhealthy=True, include_abandoned=True),
                                  keep_last=c.keep_last, log_spaced=c.policy.keep_log_spaced,
                                  tier_retention=tier_retention_from_config(c), now=time.time())
            report = self.store.prune(plan)  # re-reads each entry from disk; abandoned ones once passed
        except Exception as e:  # retention must never stop training
            logger.warning("retention: skipped this time (%s)", e)
            return
        if report.removed or report.trimmed:
            logger.debug("retention removed steps %s, trimmed %s, freed %s", report.removed, report.trimmed,
                         human_size(report.bytes_freed))

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, float]:
        """`smart_ckpt/*` numbers for the training logs (saves, failed saves, last save step, stall, risk; with the
        memory tier the slots written and skipped)."""
        self._collect_finished()
        last = self.last_decision
        held = self._held.step if self._held is not None and not self._held.memory else None  # decided, written
        # once the step's logging ends (a memory slot is no disk save)
        out = self.log.metrics(risk=last.risk if last is not None else None,
                               interval=last.interval if last is not None else None, held_step=held)
        if self.rollbacks.taken:
            out[f"{METRIC_PREFIX}rollbacks"] = float(len(self.rollbacks.taken))
        if (tier := self.memory).off_reason is None or tier.saves or tier.skipped:
            # a slot skipped (its writer busy) widens what a crash loses; a tier that never ran has no numbers
            out[f"{METRIC_PREFIX}memory_slots"] = float(tier.saves)
            out[f"{METRIC_PREFIX}memory_slots_skipped"] = float(tier.skipped)
        return out

    # ------------------------------------------------------------------ shutdown
    def finish(self) -> CheckpointInfo | None:
        """Write a held save, wait for the last background write and settle every save (a failed one raises its
        `SaveError` with `on_save_error="raise"`; with `"warn"` it is counted and warned about)."""
        if self._held is not None and self._held.memory:  # a slot of a step whose logging never came: not needed
            self._held = None
        self.release()
        return self._settle()

    def close(self) -> None:
        """Wait for pending writes, remove the probes, close the engine and the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if _RUNS.get(self._key) is self._open:
            del _RUNS[self._key]
        try:
            self.finish()
        finally:
            self.detach()
            if self.resumed is not None and self.resumed.pending is not None:
                self.resumed.pending.close()
            if self.recovery is not None:
                self.recovery.close(remove=not self.memory.on)
            self._open.close_parts()

    @property
    def closed(self) -> bool:
        return self._closed

    def exit_if_preempted(self) -> None:
        """After a preemption save, end the process with `preemption_exit_code` (128 + the signal by default, 143 for
        SIGTERM; nothing for 0), so a scheduler requeues the job. Call it once training stopped and closed."""
        code = self.config.runtime.preemption_exit_code
        if code is None:
            code = 128 + int(self.preempt_signal) if self.preempt_signal is not None else 143
        if self.preempted and code:
            logger.warning("preempted: training state committed; exiting with status %d so the job is requeued", code)
            raise SystemExit(code)

    # ------------------------------------------------------------------ resume
    def resume(self, ref: str | None, *, background_optimizer: bool = False,
               expected: Mapping[str, Any] | None = None,
               into: Mapping[str, Any] | None = None) -> LoadedCheckpoint | None:
        """Choose, verify and load a restore point (one agreed outcome on every rank) and `apply` it; `None` starts
        fresh (so does `auto` on an empty store). Checkpoints that went past the restore point become abandoned
        (kept, restorable by `step:N`, never chosen by `auto`). A sharded (FSDP2, ZeRO) model reads its shards right
        after the plan. `background_optimizer`: read L1 in a thread, then `complete_resume(loaded)`; `expected`: the
        model's L0 mapping, which the saved weights must fit on every rank; `into`: see `plan_resume` (not sharded).

        Raises:
            The same error on every rank: `CheckpointNotFoundError`, `IncompatibleStateError`,
            `FormatVersionError`, `DistributedError`.
        """
        if ref is None:
            return None
        self.wait_snapshot()  # the caller loads into the tensors a snapshot of this run may still be copying
        resumption = self._plan(ref, expected=expected, background_optimizer=background_optimizer, into=into)
        if resumption is None:
            return None
        self.apply(resumption)
        return resumption.loaded

    def _plan(self, ref: str, *, expected: Mapping[str, Any] | None,
              background_optimizer: bool = False, into: Mapping[str, Any] | None = None) -> Resumption | None:
        """`plan_resume` for this run; a sharded (FSDP2, ZeRO) model's shards are then read into the live objects."""
        sharded = self._sharded
        fallback = self.config.runtime.fallback_strategy
        if self._sources is not None and self._optimizer is None and self._scheduler is None and self._scaler is None:
            fallback = FallbackStrategy.LEVEL_0_ONLY  # attached without an optimizer: no optimizer tier to miss
        def plan(store: CheckpointStore, ref: str) -> Resumption | None:
            return plan_resume(
                store, ref, session_id=self.session_id, rank=self.rank, world_size=self.world_size,
                fallback=fallback, expected=sharded.expected() if sharded is not None else expected,
                background_optimizer=background_optimizer and sharded is None, into=into if sharded is None else None)

        resumption, recovery, self._from_memory = None, self.recovery, False
        if recovery is not None and not recovery.offered and str(ref) == "auto":  # a killed run's slot: from memory
            recovery.offered = True
            try:
                planned = plan(recovery.slots, f"step:{recovery.step}")
                assert planned is not None, "a step is never a fresh start"
                resumption, self._from_memory = replace(planned, ref="auto"), True
            except DynamicCkptError as e:
                logger.warning("memory tier: the slot of step %d cannot be restored (%s); resuming from the disk "
                               "store", recovery.step, e)
        if resumption is None:
            if recovery is not None:  # first on disk: the choice among its checkpoints counts it
                recovery.persist()
            resumption = plan(self.store, ref)
        if resumption is not None and sharded is not None:
            sharded.load(resumption.loaded)
        return resumption

    def apply(self, resumption: Resumption, *, rollback: bool = False) -> None:
        """Make a resumption the run's state: its timeline continues from the restore point (`_start_timeline`), the
        policy and probes (and, unless a `rollback`, the save counters and rollback history) continue from their
        stored state, and the resume is announced once the optimizer tier is in. The live objects are the caller's."""
        info = resumption.loaded.info
        self.lineage = resumption.lineage
        self.resumed = resumption
        self._restore_statistics(resumption, counters=not rollback)
        self._fork_pending = True
        if rollback:  # the live run goes on from the restore point now
            self._start_timeline()
            return
        # Recorded once the resumed run trains or saves (`_start_timeline`): a resume that only looks changes nothing.
        self._resume_event = {"step": info.step, "ref": resumption.ref,
                              "warnings": list(resumption.loaded.warnings),
                              "tiers": sorted(t.value for t in resumption.loaded.tiers)}
        if resumption.pending is None:
            self._announce(resumption)
        if resumption.elapsed_ms > self.config.runtime.recovery_timeout_ms:
            logger.warning("resume of step %d took %.0f ms, above recovery_timeout_ms=%d (the restore point's "
                           "estimate was %s ms); `fastest` picks the cheapest checkpoint to restore", info.step,
                           resumption.elapsed_ms, self.config.runtime.recovery_timeout_ms, info.recovery_cost_ms)

    @property
    def sharded(self) -> bool:
        """Whether the attached model's state is saved and read as shards (FSDP2, ZeRO; `resume`'s `into` unused)."""
        return self._sharded is not None

    @property
    def zero(self) -> bool:
        """Whether the attached model trains under DeepSpeed ZeRO."""
        return isinstance(self._sharded, ZeroState)

    def read_sharded(self, loaded: LoadedCheckpoint) -> None:
        """Read a sharded checkpoint that was planned before `attach` (Trainer's `resume_checkpoint` runs before the
        DeepSpeed engine exists) into the attached model and optimizer, once its optimizer tier is in."""
        assert self._sharded is not None, "attach() a sharded model first"
        self.complete_resume(loaded)
        self._sharded.load(loaded)

    def complete_resume(self, loaded: LoadedCheckpoint) -> None:
        """Wait for a background optimizer-tier read and fill it in (agreed: lost on one rank, lost on all)."""
        resumption = self.resumed
        if resumption is None or resumption.pending is None or resumption.loaded is not loaded:
            return
        try:
            resumption.complete(self.world_size)
        finally:
            self.start_writer()
        self._announce(resumption)

    def _restore_statistics(self, resumption: Resumption, *, counters: bool = True) -> None:
        """The policy's statistics (with `counters` the save counts and rollback history too) now; the gradient
        probe's once it is attached."""
        state = resumption.state
        if counters and (counts := state.get(KEY_SAVE_LOG)) is not None:
            self.log.continue_counts(counts)
        for key, target in ((KEY_ROLLBACKS, self.rollbacks if counters else None), (KEY_POLICY, self.policy)):
            _load_state(key, target, state.get(key))
        self._probe_state = state.get(KEY_GRAD_PROBE)
        self._restore_probe_state()

    def _restore_probe_state(self) -> None:
        if self.sensors is not None and self._probe_state is not None:
            _load_state(KEY_GRAD_PROBE, self.sensors.grad, self._probe_state)
            self._probe_state = None

    def _announce(self, resumption: Resumption) -> None:
        """The one `resumed from` line (WARNING, rank 0): step, reason, tiers, degraded or not."""
        if self.rank == 0:
            loaded = resumption.loaded
            self.announce.warning(
                "smart_ckpt: resumed from step %d (%s; tiers %s%s)", loaded.info.step, loaded.info.reason,
                ",".join(sorted(t.value for t in loaded.tiers)),
                "; degraded: fresh optimizer" if resumption.degraded else "")


_NOT_RESTORED = {KEY_ROLLBACKS: "rollback history not restored (%s); it restarts empty",
                 KEY_POLICY: "policy statistics not restored (%s); they restart from scratch",
                 KEY_GRAD_PROBE: "gradient-probe statistics not restored (%s); they restart from scratch"}


def _load_state(key: str, target: Any, state: dict[str, Any] | None) -> None:
    """`target.load_state_dict(state)` (no target or state: nothing); one that fails restarts empty, with a warning."""
    if target is not None and state is not None:
        try:
            target.load_state_dict(state)
        except Exception as e:
            logger.warning("resume: " + _NOT_RESTORED[key], e)


@dataclass(frozen=True)
class Rollback:
    """What a rollback did: `from_step`, the step the run had reached (its last update not applied); `to_step`, the
    restore point; `reason`, the anomaly confirmed; `rng`, the restore point's RNG state when the integration applies
    it itself (after the next batch is fetched, as a resume does), else `None`; `loaded`, the restore point as read."""

    from_step: int
    to_step: int
    reason: str
    rng: dict[str, Any] | None
    loaded: LoadedCheckpoint


def restore_live(loaded: LoadedCheckpoint, *, model: Any, optimizer: Any | None, scheduler: Any | None,
                 scaler: Any | None, rng: bool, weights_applied: bool = False) -> None:
    """Put a restore point back into the live objects, in place: weights (unless `weights_applied`, e.g. read
    by DCP already), optimizer, scheduler, scaler, and the RNG when `rng`."""
    if not weights_applied and loaded.weights is not None:
        apply_weights(model, loaded.weights)
    apply_optimizer_state(loaded, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    if rng and loaded.rng is not None:
        restore_rng_state(loaded.rng)

"""The one orchestrator both integrations call: probes -> policy -> snapshot/writer -> store.

`Checkpointer` is framework-free: it knows torch modules, optimizers and schedulers, never
`Trainer` or `Accelerator`. An integration calls, per optimizer step:

```
step_begin()                          # start of the step (timing)
pre_update(step)                      # gradients complete, weights not yet updated
    -> Decision (skip_update: drop this step's gradients)
step_end(step, epoch)                 # after optimizer.step / scheduler.step / zero_grad
    -> Decision (preempt: the run should stop now; a committed checkpoint exists)
```

and `resume(spec)` + `apply_optimizer_state` / `apply_weights` / `restore_rng_state` to
come back. Under DDP every rank calls the same methods: the signals are reduced in one
collective per step so every rank takes the same decision, each rank writes its own RNG
file and rank 0 commits once all ranks wrote (see `CheckpointStore.save`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed as dist
from .config import EngineMode, FallbackStrategy, SmartCkptConfig
from .constants import ALL_TIERS, TIMELINE_NAME, Tier
from .engine import SaveEngine, SaveHandle
from .errors import CheckpointNotFoundError, CorruptCheckpointError, DistributedError
from .jsonutil import safe_float as _num
from .policy.decision import Decision, DecisionKind
from .policy.retention import level_retention_from_config, plan_retention
from .policy.rules import RulePolicy
from .signals.frame import SignalFrame
from .signals.probes import ClipNormRecorder, GradProbe, LossProbe, MemoryProbe, PreemptionFlag
from .state import CachedWeights, StateSources, capture_rng_state, trainable_state_dict
from .store.store import CheckpointStore
from .store.types import CheckpointInfo, LoadedCheckpoint

logger = logging.getLogger(__name__)

METRIC_PREFIX = "smart_ckpt/"


@dataclass
class SaveEvent:
    """One save as the training loop saw it (the catalog holds the committed facts).

    Args:
        step (`int`): step of the saved state.
        at_step (`int`): step during which the save was taken (`step + 1` for a pre-update capture).
        reason (`str`): the policy's reason.
        tiers (`frozenset[Tier]`): what was saved.
        pinned (`bool`): protected from retention.
        blocking_ms (`float`): time training was stopped by the save.
        bytes (`int`, *optional*): bytes on disk once committed (rank 0).
        write_ms (`float`, *optional*): background write time once committed.
        error (`str`, *optional*): why the save failed.
    """

    step: int
    at_step: int
    reason: str
    tiers: frozenset[Tier]
    pinned: bool
    blocking_ms: float
    bytes: int | None = None
    write_ms: float | None = None
    path: str | None = None
    error: str | None = None
    handle: SaveHandle | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "at_step": self.at_step, "reason": self.reason,
                "tiers": sorted(t.value for t in self.tiers), "pinned": self.pinned,
                "blocking_ms": round(self.blocking_ms, 3), "bytes": self.bytes,
                "write_ms": None if self.write_ms is None else round(self.write_ms, 3),
                "path": self.path, "error": self.error}


class Checkpointer:
    """Signal-driven, tiered, non-blocking checkpointing of one training run.

    Args:
        config (`SmartCkptConfig`): the knobs; `config.root` or `root` names the store.
        root (`str` or `Path`, *optional*): store directory (overrides `config.root`).
        rank (`int`, *optional*): this process's rank; defaults to the process group's.
        world_size (`int`, *optional*): number of ranks; defaults to the process group's.

    Example:
        ```python
        >>> ckpt = Checkpointer(SmartCkptConfig(base_interval=50), root="out/smart_ckpt")
        >>> ckpt.attach(model, optimizer=opt, scheduler=sched)
        >>> for step, batch in enumerate(loader, start=1):
        ...     ckpt.step_begin()
        ...     model(**batch).loss.backward()
        ...     ckpt.pre_update(step - 1)
        ...     opt.step(); sched.step(); opt.zero_grad()
        ...     if ckpt.step_end(step, epoch=0.0).reason == "preemption":
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
            from .errors import ConfigError

            raise ConfigError("root=None is invalid: pass Checkpointer(config, root=...) or SmartCkptConfig(root=...).")
        self.root = Path(root)
        session = uuid.uuid4().hex[:12] if self.rank == 0 else None
        session = dist.broadcast_object(session) if self.world_size > 1 else session
        def open_store() -> CheckpointStore:
            return CheckpointStore(self.root, task_id=config.task_id, rank=self.rank, world_size=self.world_size,
                                   session_id=session, compression_level=config.compression_level,
                                   compression=config.storage_levels.level_1.compression.value)

        if self.world_size > 1:
            # Rank 0 creates the catalog (and switches it to WAL) alone: ranks opening a fresh
            # SQLite file at the same instant fail with "database is locked".
            store = open_store() if self.rank == 0 else None
            dist.barrier()
            self.store = store if store is not None else open_store()
        else:
            self.store = open_store()
        mode = config.engine if config.async_save else EngineMode.SYNC
        self.engine = SaveEngine(self.store, mode=mode, memory_margin=config.memory_margin)
        self.policy = RulePolicy(config)
        self.events: list[SaveEvent] = []
        self.last_frame: SignalFrame | None = None
        self.last_decision: Decision | None = None
        self.preempted = False
        self._sources: StateSources | None = None
        self._model: nn.Module | None = None
        self._optimizer: Any | None = None
        self._stale_steps: set[int] = set()  # steps of an abandoned timeline that could not be deleted
        self._loss: LossProbe | None = None
        self._grad: GradProbe | None = None
        self._mem: MemoryProbe | None = None
        self._flag: PreemptionFlag | None = None
        self._clip: ClipNormRecorder | None = None
        self._frame: SignalFrame | None = None  # reduced frame of the step in progress
        self._boundary_rng: dict[str, Any] | None = None  # RNG at the end of the previous step
        self._boundary_step: int | None = None
        self._last_pre_t: float | None = None
        self._stall_ms_since_log = 0.0
        self._timeline: Any = None
        self._timeline_seen = 0  # len(self.events) when the last timeline row was written
        self._l1: Future[Any] | None = None  # background optimizer-tier read of a resume
        self._closed = False

    # ------------------------------------------------------------------ wiring
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
    ) -> None:
        """Install the probes and remember what a save reads.

        Args:
            model (`nn.Module`): the trained model (gradients and LoRA layers are read from it).
            optimizer, scheduler, scaler (*optional*): L1 sources.
            weights (`Callable`, *optional*): returns the L0 tensors; defaults to `trainable_state_dict(model)`
                behind a `CachedWeights` (built once, rebuilt when a parameter is replaced).
            frozen_keys (`Iterable[str]`, *optional*): weight names that never change (stored once).
            extra (`Callable`, *optional*): JSON-able data for the manifest's `extra`.
            sampler (`Callable`, *optional*): JSON-able data position (L2).
            clip_owner (*optional*): object whose `clip_grad_norm_` returns the pre-clip norm
                (an `accelerate.Accelerator`); wrapped so the policy sees the pre-clip norm.
            loss_model (`nn.Module`, *optional*): module whose forward output carries `loss`
                (defaults to `model`).
        """
        self.detach()
        self._model = model
        self._optimizer = optimizer
        if weights is None:
            weights = CachedWeights(model, lambda: trainable_state_dict(model))
        main = self.rank == 0
        self._sources = StateSources(
            weights=weights if main else None, frozen_keys=frozenset(frozen_keys),
            optimizer=optimizer if main else None, scheduler=scheduler if main else None,
            scaler=scaler if main else None, sampler=sampler, extra=extra,
        )
        self._loss = LossProbe(loss_model if loss_model is not None else model)
        self._grad = GradProbe(model)
        self._mem = MemoryProbe(self.config.memory_sample_every)
        self._flag = PreemptionFlag(self.config.preemption_signals)
        self._flag.install()
        self._clip = ClipNormRecorder(clip_owner) if clip_owner is not None else None
        self._last_pre_t = None
        if main:
            self.store.task_dir.mkdir(parents=True, exist_ok=True)
            path = self.store.task_dir / TIMELINE_NAME
            self._timeline = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in detach

    def detach(self) -> None:
        """Remove the probes and signal handlers (idempotent). Pending writes keep going."""
        for probe in (self._loss, self._clip):
            if probe is not None:
                probe.remove()
        if self._flag is not None:
            self._flag.uninstall()
        self._loss = self._clip = self._flag = None
        self._grad = self._mem = None
        if self._timeline is not None:
            self._timeline.close()
            self._timeline = None

    @property
    def preemption_flag(self) -> PreemptionFlag | None:
        """The installed preemption flag (tests and schedulers may `set()` it)."""
        return self._flag

    # ------------------------------------------------------------------ per step
    def step_begin(self) -> None:
        """Mark the start of an optimizer step (reserved: timing is taken between `pre_update` calls)."""

    def note_boundary(self, step: int) -> None:
        """Record the RNG state at the end of `step` (what a later pre-update capture saves).

        Weights, optimizer and `extra` are still those of `step` when the next step's
        `pre_update` runs; only the RNG has moved on (dropout of the next step's forward).
        """
        if self.config.pre_anomaly_capture:
            self._boundary_rng = capture_rng_state()
            self._boundary_step = step

    def _measure(self, step: int) -> SignalFrame:
        loss_t = self._loss.pop() if self._loss is not None else None
        pre_clip = self._clip.pop() if self._clip is not None else None
        fields: dict[str, Any] = {}
        if self._grad is not None:
            fields = self._grad.frame_fields(pre_clip)
        device_mem = host_mem = None
        if self._mem is not None:
            device_mem, host_mem = self._mem.sample(step)
        now = time.perf_counter()
        step_time = None if self._last_pre_t is None else now - self._last_pre_t
        self._last_pre_t = now
        frame = SignalFrame(
            step=step, loss=None if loss_t is None else float(loss_t), device_mem_frac=device_mem,
            host_mem_frac=host_mem, step_time_s=step_time,
            preempt=bool(self._flag is not None and self._flag.is_set), **fields,
        )
        names = self._grad.layer_names if self._grad is not None else ()
        return dist.reduce_frame(frame, layer_names=names)

    def pre_update(self, step: int, *, epoch: float | None = None) -> Decision:
        """Gradients are complete, the update not applied: measure, and capture if the policy says so.

        Args:
            step (`int`): optimizer steps completed *before* this update (Trainer's `global_step`).
            epoch (`float`, *optional*): fractional epoch of the state of `step`.

        Returns:
            `Decision`: the policy's pre-update answer. With `skip_update`, the gradients
            have been dropped (`param.grad = None`): the optimizer skips the update.
        """
        frame = self._measure(step + 1)
        groups = getattr(self._optimizer, "param_groups", None)
        if groups:
            frame.lr = float(groups[0]["lr"])  # the rate this update will use (the LR-surge trigger reads it)
        self._frame = frame
        decision = self.policy.pre_update(frame)
        # Searched only when a capture is wanted: a per-step scan of every past save is waste.
        saved = (next((e for e in reversed(self.events) if e.step == step and e.error is None), None)
                 if decision.save else None)
        if saved is not None:
            # The pre-update state is a checkpoint already taken at the end of `step`: pin it, no second copy.
            logger.info("step %d: %s -> pinning the checkpoint of step %d", step + 1, decision.reason, step)
            saved.pinned = True
            if saved.handle is None and saved.path is not None and self.rank == 0:
                self.store.pin(f"step:{step}")
        elif decision.save:
            if self._boundary_step == step and self._boundary_rng is not None:
                self._save(decision, step=step, epoch=epoch if epoch is not None else 0.0, at_step=step + 1,
                           rng=self._boundary_rng)
            else:
                logger.info("step %d: pre-update capture (%s) not taken: no RNG state recorded at the end of step %d",
                            step + 1, decision.reason, step)
        if decision.skip_update and self._model is not None:
            logger.warning("step %d: skipping the optimizer update (%s)", step + 1, decision.reason or "bad update")
            for p in self._model.parameters():
                p.grad = None
        return decision

    def step_end(self, step: int, epoch: float, *, lr: float | None = None) -> Decision:
        """After the update of step `step`: decide, and save (or stop on preemption).

        Args:
            step (`int`): optimizer steps completed (Trainer's `global_step` after the increment).
            epoch (`float`): fractional epoch.
            lr (`float`, *optional*): learning rate used by this step; ignored when `pre_update`
                read it from the attached optimizer just before the update.

        Returns:
            `Decision`. When `reason == "preemption"` a checkpoint has been committed
            synchronously and `self.preempted` is set: the caller should stop training.
        """
        frame = self._frame if self._frame is not None and self._frame.step == step else self._measure(step)
        self._frame = None
        if frame.lr is None:
            frame.lr = lr
        decision = self.policy.decide(frame)
        self.last_frame, self.last_decision = frame, decision
        self._collect_finished()
        if decision.save:
            if decision.kind == DecisionKind.PREEMPTION:
                self._preempt_save(step, epoch, frame)
            else:
                self._save(decision, step=step, epoch=epoch, at_step=step)
        self._write_timeline(frame, decision)
        self.note_boundary(step)
        return decision

    def save_now(self, step: int, epoch: float, *, reason: str = "manual", tiers: Iterable[Tier] = ALL_TIERS,
                 pin: bool = False, blocking: bool = True) -> SaveEvent:
        """Save the current state of `step` outside the policy (e.g. the end of training)."""
        kind = DecisionKind.TRAIN_END if reason == "train_end" else DecisionKind.MANUAL
        decision = Decision(save=True, tiers=frozenset(tiers), reason=reason, pin=pin, step=step, kind=kind)
        return self._save(decision, step=step, epoch=epoch, at_step=step, blocking=blocking)

    # ------------------------------------------------------------------ saving
    def _save(self, decision: Decision, *, step: int, epoch: float, at_step: int, rng: dict[str, Any] | None = None,
              blocking: bool = False) -> SaveEvent:
        assert self._sources is not None, "attach() first"
        sources = self._sources
        tiers = frozenset(decision.tiers or ALL_TIERS)
        if self.rank != 0:
            tiers = frozenset({Tier.STATE})  # rank 0 writes weights and optimizer; every rank its RNG
        signals = self.last_frame.to_dict() if self.last_frame is not None else None
        handle = self.engine.save(sources, step=step, epoch=epoch, tiers=tiers, reason=decision.reason,
                                  pinned=decision.pin, healthy=decision.healthy, signals=signals,
                                  debug_info=self.policy.debug_info(), rng=rng, blocking=blocking,
                                  replace=step in self._stale_steps)
        self._stale_steps.discard(step)
        event = SaveEvent(step=step, at_step=at_step, reason=decision.reason, tiers=frozenset(decision.tiers or tiers),
                          pinned=decision.pin, blocking_ms=handle.blocking_ms, handle=handle)
        if handle.skipped:
            event.error = handle.skipped
        self.events.append(event)
        self._stall_ms_since_log += handle.blocking_ms
        self.policy.record_save(step, handle.blocking_ms / 1e3, tiers)
        logger.info("save step %d (%s): blocked %.1f ms", step, decision.reason, handle.blocking_ms)
        if handle.done():
            self._collect(event)
        return event

    def _preempt_save(self, step: int, epoch: float, frame: SignalFrame) -> None:
        assert self._sources is not None, "attach() first"
        start = time.perf_counter()
        signum = self._flag.signum if self._flag is not None else None
        name = f"preemption: signal {signum}" if signum is not None else "preemption"
        try:
            import signal as _signal

            name = f"preemption: {_signal.Signals(signum).name}" if signum is not None else name
        except ValueError:
            pass
        sources = self._sources
        info = self.engine.emergency_save(sources, step=step, epoch=epoch, reason=name,
                                          deadline_s=self.config.preemption_grace_s, signals=frame.to_dict(),
                                          debug_info=self.policy.debug_info(), replace=step in self._stale_steps)
        self._stale_steps.discard(step)
        blocking_ms = (time.perf_counter() - start) * 1e3
        event = SaveEvent(step=step, at_step=step, reason=f"emergency: {name}", tiers=info.tiers if info else ALL_TIERS,
                          pinned=False, blocking_ms=blocking_ms, bytes=info.bytes if info else None,
                          path=info.path if info else None)
        self.events.append(event)
        self._stall_ms_since_log += blocking_ms
        self.preempted = True
        dist.barrier()
        logger.warning("preemption: committed step %d in %.0f ms; stopping training", step, blocking_ms)

    def _collect(self, event: SaveEvent) -> None:
        handle = event.handle
        if handle is None or not handle.done():
            return
        event.handle = None
        exc = handle.exception()
        if exc is not None:
            event.error = f"{type(exc).__name__}: {exc}"
            logger.error("save of step %d (%s) failed: %s; the previous checkpoint stays the restore point",
                         event.step, event.reason, event.error)
            return
        info = handle.wait()
        event.write_ms = handle.write_ms
        if info is not None:
            event.bytes, event.path = info.bytes, info.path
            if event.pinned and not info.pinned:
                self.store.pin(info)
            self._prune()

    def _prune(self) -> None:
        """Apply retention (rank 0, between saves): keep pinned, the last N, log-spaced history."""
        if self.rank != 0 or self.engine.busy:
            return
        c = self.config
        plan = plan_retention(self.store.list(include_unhealthy=True), keep_last=c.keep_last,
                              log_spaced=c.keep_log_spaced, level_retention=level_retention_from_config(c),
                              now=time.time())
        for info, tiers in plan:
            try:
                self.store.delete(info, tiers=None if Tier.WEIGHTS in tiers else tiers)
            except Exception as e:  # retention must never stop training
                logger.warning("retention: could not delete step %d (%s)", info.step, e)

    def _collect_finished(self) -> None:
        for event in self.events[-4:]:
            if event.handle is not None:
                self._collect(event)

    def _write_timeline(self, frame: SignalFrame, decision: Decision) -> None:
        if self._timeline is None:
            return
        row: dict[str, Any] = {"step": frame.step, "loss": _num(frame.loss), "grad_norm": _num(frame.grad_norm),
               "lora_max_ratio": _num(frame.lora_max_ratio), "lr": _num(frame.lr), "risk": round(decision.risk, 6),
               "mem": _num(frame.mem_frac), "step_time_s": _num(frame.step_time_s), "time": time.time()}
        # Only saves appended since the previous row can belong to this one (no scan of the whole history).
        saves = [e for e in self.events[self._timeline_seen:] if e.at_step == frame.step]
        self._timeline_seen = len(self.events)
        if saves:
            row["saves"] = [{"step": e.step, "reason": e.reason, "pinned": e.pinned,
                             "blocking_ms": round(e.blocking_ms, 3)} for e in saves]
        self._timeline.write(json.dumps(row) + "\n")

    def log_event(self, kind: str, **data: Any) -> None:
        """Append a non-step event (e.g. a resume) to the timeline (rank 0)."""
        if self._timeline is None and self.rank == 0:
            self.store.task_dir.mkdir(parents=True, exist_ok=True)
            with open(self.store.task_dir / TIMELINE_NAME, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": kind, "time": time.time(), **data}) + "\n")
        elif self._timeline is not None:
            self._timeline.write(json.dumps({"event": kind, "time": time.time(), **data}) + "\n")

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, float]:
        """`smart_ckpt/*` numbers for the training logs (saves, last save step, stall, risk)."""
        self._collect_finished()
        done = [e for e in self.events if e.error is None]
        out: dict[str, float] = {
            f"{METRIC_PREFIX}saves": float(len(done)),
            f"{METRIC_PREFIX}stall_ms": round(self._stall_ms_since_log, 3),
            f"{METRIC_PREFIX}risk": round(self.last_decision.risk, 6) if self.last_decision is not None else 0.0,
        }
        if done:
            out[f"{METRIC_PREFIX}last_save_step"] = float(done[-1].step)
        if self.last_decision is not None and self.last_decision.interval:
            out[f"{METRIC_PREFIX}interval"] = round(self.last_decision.interval, 3)
        self._stall_ms_since_log = 0.0
        return out

    # ------------------------------------------------------------------ shutdown
    def finish(self) -> CheckpointInfo | None:
        """Wait for the last background write (re-raising its error) and collect its result."""
        try:
            return self.engine.wait()
        finally:
            for event in self.events:
                self._collect(event)

    def close(self) -> None:
        """Wait for pending writes, remove the probes, close the engine and store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.finish()
        finally:
            self.detach()
            self.engine.close()
            self.store.close()

    # ------------------------------------------------------------------ resume
    def resume(self, spec: str | None, *, background_optimizer: bool = False) -> LoadedCheckpoint | None:
        """Choose, verify and load a restore point on every rank (rank 0 decides).

        Rank 0 resolves `spec` with `restore.load_for_resume` (a broken L0 falls back to the
        next older checkpoint, a broken L1 resumes with a fresh optimizer, both with a
        warning). Every rank then checks its own RNG file for that checkpoint; if any rank
        cannot, all fall back to the newest checkpoint that is complete on every rank.

        Args:
            spec (`str`, *optional*): `auto`, `best`, `fastest`, `step:N` or a path; `None`
                means a fresh start.
            background_optimizer (`bool`, *optional*, defaults to `False`): with the `full`
                fallback strategy, read the optimizer tier (L1) in a background thread so it
                overlaps the caller's start-up; `complete_resume(loaded)` waits for it.

        Returns:
            `LoadedCheckpoint | None`: this rank's view (its own RNG), or `None` for a fresh
            start (`auto` on an empty store).

        Raises:
            `CheckpointNotFoundError`: an explicit spec names nothing loadable.
            `DistributedError`: no checkpoint is complete on every rank.
        """
        from .restore import load_for_resume

        if spec is None:
            return None
        deferred = background_optimizer and self.config.fallback_strategy == FallbackStrategy.FULL
        fallback = FallbackStrategy.LEVEL_0_ONLY if deferred else self.config.fallback_strategy
        chosen: dict[str, Any] | None = None
        loaded: LoadedCheckpoint | None = None
        if self.rank == 0:
            try:
                loaded = load_for_resume(self.store, spec, rank=0, fallback=fallback)
                older = [i.step for i in self.store.list() if i.step < loaded.info.step and Tier.WEIGHTS in i.tiers]
                chosen = {"candidates": [loaded.info.step, *older], "error": None}
            except CheckpointNotFoundError as e:
                if spec == "auto" and not self.store.list(include_unhealthy=True):
                    chosen = None
                else:
                    chosen = {"candidates": [], "error": str(e)}
        if self.world_size > 1:
            chosen = dist.broadcast_object(chosen)
        if chosen is None:
            return None
        if chosen["error"] is not None:
            raise CheckpointNotFoundError(chosen["error"])
        candidates: list[int] = chosen["candidates"]
        step = candidates[0]
        if self.world_size > 1:
            step = self._agree_on_step(candidates)
            if self.rank == 0 and loaded is not None and step != loaded.info.step:
                msg = (f"resume: step {loaded.info.step} is not complete on every rank (a rank's RNG file is "
                       f"missing or corrupt); falling back to step {step}, the newest checkpoint complete on all ranks")
                logger.warning(msg)
                warnings.warn(msg, stacklevel=2)
                loaded = load_for_resume(self.store, f"step:{step}", rank=0, fallback=fallback)
            # Rank 0's tier outcome (e.g. a broken L1) is what every rank applies.
            tiers = dist.broadcast_object(sorted(t.value for t in loaded.tiers) if loaded is not None else None)
            if self.rank != 0:
                loaded = self.store.load(f"step:{step}", tiers=[Tier(t) for t in tiers], rank=self.rank)
                if not deferred and Tier.OPTIMIZER not in {Tier(t) for t in tiers}:
                    loaded.scheduler = self.store.load_scheduler_only(f"step:{step}")
            dist.barrier()
        assert loaded is not None
        stale = self._drop_abandoned_timeline(loaded.info) if self.rank == 0 else []
        if self.world_size > 1:
            stale = dist.broadcast_object(stale)  # every rank passes replace=True for these steps
        self._stale_steps = set(stale)
        for w in loaded.warnings:
            logger.warning("resume: %s", w)
        self.log_event("resume", step=loaded.info.step, spec=str(spec), warnings=list(loaded.warnings))
        if deferred:
            info = loaded.info
            self._l1 = ThreadPoolExecutor(1, thread_name_prefix="smart-ckpt-l1").submit(self._load_optimizer_tier, info)
        return loaded

    def _drop_abandoned_timeline(self, resumed: CheckpointInfo) -> list[int]:
        """Delete this task's checkpoints newer than the resumed one (rank 0).

        Resuming from an older checkpoint (`step:N`, `best`, an L0 fallback) abandons the
        run that wrote the newer ones: left in place, `auto` would pick them after the next
        crash, and a save reaching one of their steps would return the stale checkpoint.
        Pinned and unhealthy ones go too (they describe the abandoned run).

        Returns:
            `list[int]`: steps that could not be deleted; saves for them re-commit them
            (`replace=True`).
        """
        if resumed.task_id != self.store.task_id or Path(resumed.path).resolve().parent != self.store.task_dir.resolve():
            return []  # resumed from a checkpoint outside this task: its timeline is not ours to prune
        newer = sorted(i.step for i in self.store.list(include_unhealthy=True) if i.step > resumed.step)
        if not newer:
            return []
        msg = (f"resume: step {resumed.step} is older than the newest checkpoint; deleting steps "
               f"{', '.join(map(str, newer))} of the abandoned run so that `auto` never returns to it")
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)
        left = []
        for step in newer:
            try:
                self.store.delete(f"step:{step}", force=True)
            except Exception as e:  # never fail a resume over cleanup; the next save of the step replaces it
                logger.warning("resume: could not delete step %d of the abandoned run (%s); a save of that step "
                               "will replace it", step, e)
                left.append(step)
        return left

    def _load_optimizer_tier(self, info: CheckpointInfo) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                                     dict[str, Any] | None, str | None]:
        """(optimizer, scheduler, scaler, why-lost) of one checkpoint; runs in a background thread."""
        if Tier.OPTIMIZER not in info.tiers:
            return None, None, None, "the checkpoint was saved without it"
        try:
            opt = self.store.load(info, tiers={Tier.OPTIMIZER}, rank=self.rank)
        except CorruptCheckpointError as e:
            return None, self.store.load_scheduler_only(info), None, str(e)
        return opt.optimizer, opt.scheduler, opt.scaler, None

    def complete_resume(self, loaded: LoadedCheckpoint) -> None:
        """Wait for a background optimizer-tier read (`resume(background_optimizer=True)`) and fill it in.

        A broken optimizer tier leaves `loaded.optimizer` `None` (fresh optimizer) and adds the warning.
        """
        future, self._l1 = self._l1, None
        if future is None:
            return
        optimizer, scheduler, scaler, lost = future.result()
        loaded.optimizer, loaded.scheduler, loaded.scaler = optimizer, scheduler, scaler
        if lost is not None:
            step = loaded.info.step
            msg = (f"resuming from weights only: optimizer state of step {step} is lost ({lost}); "
                   f"the learning-rate schedule continues at step {step}")
            loaded.warnings.append(msg)
            logger.warning(msg)
            warnings.warn(msg, stacklevel=2)

    def _agree_on_step(self, candidates: list[int]) -> int:
        """The newest candidate whose files of every rank verify (one all-reduce)."""
        ok = []
        for step in candidates:
            try:
                self.store.load(f"step:{step}", tiers=[Tier.STATE], rank=self.rank)
                ok.append(1)
            except Exception as e:  # any unreadable own file rules the candidate out
                logger.warning("resume: rank %d cannot use step %d: %s", self.rank, step, e)
                ok.append(0)
        flags = torch.tensor(ok, dtype=torch.int64)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        for step, good in zip(candidates, flags.tolist()):
            if good:
                return step
        raise DistributedError(
            f"resume: none of the checkpoints {candidates} is complete on all {self.world_size} ranks; "
            "start fresh (no resume) or restore the missing rng-rank<R>.json files."
        )

    def load_policy_state(self, loaded: LoadedCheckpoint) -> None:
        """Restore the policy's running statistics saved in the checkpoint (when present)."""
        state = loaded.extra.get("policy")
        if state:
            try:
                self.policy.load_state_dict(state)
            except Exception as e:  # the policy restarts its statistics; training is unaffected
                logger.warning("resume: policy statistics not restored (%s); they restart from scratch", e)
        probe = loaded.extra.get("grad_probe")
        if probe and self._grad is not None:
            self._grad.load_state_dict(probe)

    def extra_state(self) -> dict[str, Any]:
        """Policy and probe statistics, for `StateSources.extra` (so a resumed run decides the same)."""
        out: dict[str, Any] = {"policy": self.policy.state_dict()}
        if self._grad is not None:
            out["grad_probe"] = self._grad.state_dict()
        return out



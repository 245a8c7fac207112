"""An Accelerate loop resumed on another number of processes: the batch plan and the scheduler's pace.

`plan_elastic` reads what the checkpoint recorded (the data position's batch geometry, whether the loader deals
its batches to the ranks, whether the steps drew random numbers, the scheduler's pace) and returns what the resumed
run sets: the gradient accumulation that keeps the global batch (`run.elastic.plan_batch`), the pace, and the lines
that say so. `apply_elastic` sets it, before the state goes in (`SmartCheckpointer.resume`, and
`accelerator.load_state` through `SmartStateHooks`).

The pace: Accelerate's prepared scheduler (`AcceleratedScheduler`, stepping with the optimizer, batches not split)
steps the wrapped scheduler once per process at every optimizer step, so its position after N steps on W processes
is N x W. A run continued on another number of processes keeps the pace of the run it continues (`keep_pace`), so
the learning rate of every step is the uninterrupted run's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..run.elastic import KEY_BATCH, KEY_DRAWS_RANDOM, BatchGeometry, plan_batch, world_change_note
from ..store import LoadedCheckpoint
from ._position import KEY_DEALT, ResumableLoader

KEY_SCHEDULER_PACE = "scheduler_pace"
"""Key, in the integration's manifest entry, of the wrapped scheduler's steps per optimizer step."""


@dataclass(frozen=True)
class ElasticPlan:
    """What a resume sets: the accumulation (`None`: as it is), the scheduler's pace (`None`: as it is), and the
    lines rank 0 logs (`(level, message)`)."""

    accumulation: int | None = None
    pace: int | None = None
    lines: list[tuple[int, str]] = field(default_factory=list)


def natural_pace(scheduler: Any, num_processes: int) -> int | None:
    """Steps of the wrapped scheduler per optimizer step that `scheduler.step()` takes as Accelerate prepared it;
    `None` for a scheduler that is not Accelerate's, steps at every call (`step_scheduler_with_optimizer=False`), or
    that a DeepSpeed engine steps itself (`DeepSpeedSchedulerWrapper.step` does nothing)."""
    from accelerate.scheduler import AcceleratedScheduler

    if not isinstance(scheduler, AcceleratedScheduler) or not scheduler.step_with_optimizer:
        return None
    if type(scheduler).__name__ == "DeepSpeedSchedulerWrapper":  # the engine steps it, once per update
        return None
    return 1 if scheduler.split_batches else int(num_processes)


def keep_pace(scheduler: Any, pace: int) -> None:
    """Make `scheduler.step()` (an `AcceleratedScheduler`) step the wrapped scheduler `pace` times per optimizer
    step, whatever the number of processes; accumulation micro-steps and skipped updates go as Accelerate has them."""
    from accelerate.scheduler import AcceleratedScheduler

    def step(*args: Any, **kwargs: Any) -> None:
        if not scheduler.gradient_state.sync_gradients or any(opt.step_was_skipped for opt in scheduler.optimizers):
            AcceleratedScheduler.step(scheduler, *args, **kwargs)
            return
        inner = scheduler.scheduler
        for _ in range(pace):
            # As Accelerate does: a OneCycle schedule without drop_last stops at its total.
            if not hasattr(inner, "total_steps") or inner._step_count <= inner.total_steps:
                inner.step(*args, **kwargs)

    scheduler.step = step


def deepspeed_engine(accelerator: Any) -> Any | None:
    """The DeepSpeed engine an `Accelerator` prepared (`None` without DeepSpeed, or before `prepare`)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return getattr(wrapped, "engine", None)


def plan_elastic(loaded: LoadedCheckpoint, *, loader: ResumableLoader | None, world_size: int, keep: bool,
                 saved_pace: int | None, pace: int | None) -> ElasticPlan:
    """The plan of a resume of `loaded` with this run's `loader`, `world_size` and scheduler `pace`.

    Raises:
        `GlobalBatchError`: `keep` and no accumulation keeps the saved global batch (`run.elastic.plan_batch`).
    """
    sampler = loaded.sampler or {}
    saved_world, step = loaded.info.world_size, loaded.info.step
    lines: list[tuple[int, str]] = []
    accumulation = None
    saved = BatchGeometry.from_json(sampler.get(KEY_BATCH))
    now = loader.geometry() if loader is not None else None
    dealt = bool(sampler.get(KEY_DEALT, True))
    if saved is not None and now is not None:
        if not dealt:  # every rank reads every batch: a step's samples do not depend on the number of processes
            saved, now = BatchGeometry(saved.per_device, 1, saved.accumulation), \
                BatchGeometry(now.per_device, 1, now.accumulation)
        plan = plan_batch(saved, now, keep=keep, step=step, position_in="samples")
        accumulation = plan.accumulation
        if plan.warning is not None:
            lines.append((logging.WARNING, plan.warning))
        elif plan.note is not None:
            lines.append((logging.INFO, plan.note))
    elif saved_world != world_size and loader is not None:
        lines.append((logging.WARNING, f"step {step} was saved by {saved_world} process(es) and is resumed by "
                                       f"{world_size}, and it does not record its global batch: keep the per-device "
                                       "batch x processes x gradient_accumulation_steps as it was"))
    if dealt:  # with every rank reading every batch, a rank that continues rank 0's stream draws rank 0's masks
        note = world_change_note(saved_world, world_size, sampler.get(KEY_DRAWS_RANDOM))
        if note is not None:
            lines.append((logging.WARNING, f"step {step} was {note}"))
    keep_at = None
    if saved_pace is not None and pace is not None and saved_pace != pace:
        keep_at = saved_pace
        lines.append((logging.INFO, f"step {step}: the learning-rate scheduler keeps the pace of the run it continues, "
                                    f"{saved_pace} scheduler step(s) per optimizer step (accelerate's prepared "
                                    f"scheduler steps once per process: {pace} on {world_size})"))
    return ElasticPlan(accumulation=accumulation, pace=keep_at, lines=lines)


def apply_elastic(loaded: LoadedCheckpoint, *, saved_extra: dict[str, Any], state: Any, run: Any,
                  accelerator: Any) -> None:
    """Plan the resume of `loaded` on this run (`plan_elastic`), set the accumulation on the accelerator and the pace
    on the prepared scheduler, and log the plan's lines on rank 0.

    Args:
        saved_extra (`dict`): the integration's manifest entry of `loaded` (its scheduler pace).
        state (`AccelerateState`): the live objects (loader, scheduler and its pace).
        run (`RunOrchestrator`): world size, rank, config (`runtime.keep_global_batch`) and the announce logger.
    """
    pace = state.scheduler_pace
    saved_pace = saved_extra.get(KEY_SCHEDULER_PACE) if KEY_SCHEDULER_PACE in saved_extra else \
        (loaded.info.world_size if pace is not None and pace == run.world_size else None)
    plan = plan_elastic(loaded, loader=state.loader, world_size=run.world_size,
                        keep=run.config.runtime.keep_global_batch,
                        saved_pace=saved_pace if isinstance(saved_pace, int) else None, pace=pace)
    if plan.accumulation is not None:
        accelerator.gradient_accumulation_steps = plan.accumulation
        engine = deepspeed_engine(accelerator)
        if engine is not None:  # the engine scales the loss and reduces by its own accumulation: the same one
            engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size *
                                        plan.accumulation)
    if plan.pace is not None:
        keep_pace(state.scheduler, plan.pace)
        state.scheduler_pace = plan.pace
    if run.rank == 0:
        for level, line in plan.lines:
            run.announce.log(level, "smart_ckpt: %s", line)

"""Accelerate integration (docs/accelerate.md, docs/elastic.md): `SmartStateHooks`, the `save_state` / `load_state`
hook pair, and `SmartCheckpointer` for custom loops; both thin adapters over `run.orchestrator.RunOrchestrator`."""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.scheduler import AcceleratedScheduler

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..constants import MANIFEST_NAME
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, SaveError
from ..run.orchestrator import Rollback, RunOrchestrator, SaveEvent
from ..signals import Decision, DecisionKind
from ..state import (
    apply_optimizer_state,
    apply_weights,
    check_accelerator,
    frozen_weight_keys,
    own_weights,
    restore_rng_state,
    trainable_state_dict,
)
from ..store import LoadedCheckpoint
from .position import KEY_DRAWS_RANDOM, ResumableLoader, StepRandomness, resume_batch

logger = logging.getLogger(__name__)

__all__ = ["POINTER_NAME", "ResumableLoader", "SmartCheckpointer", "SmartStateHooks"]

POINTER_NAME = "smart_ckpt.json"  # what `save_state` leaves in its folder: which store checkpoint holds the state
_POINTER_KEYS = ("root", "task_id", "step", "path")
KEY_ACCELERATE = "accelerate"  # this integration's entry in the manifest's `extra`
KEY_SCHEDULER_PACE = "scheduler_pace"  # in that entry: the wrapped scheduler's steps per optimizer step
_MODEL_PREFIX = "model_{}."


# ------------------------------------------------------------------------------------------ the live objects
class AccelerateState:
    """The live objects of an `Accelerator` run: L0 the trainable weights of every prepared model (the second one's
    keys prefixed ``model_1.``), L1 optimizer, scheduler and scaler, L2 a `ResumableLoader`'s position. Counts
    optimizer updates (not micro-steps): the step a checkpoint is filed under."""

    def __init__(self, accelerator: Any, *, models: list[torch.nn.Module] | None = None,
                 loader: ResumableLoader | None = None) -> None:
        self.accelerator, self._models, self.loader = accelerator, models, loader
        for kind in ("_optimizers", "_schedulers"):
            objs = getattr(accelerator, kind, [])
            if len(objs) > 1:
                raise ConfigError(f"accelerator prepared {len(objs)} {kind[1:]}: hf_dynamic_ckpt stores one optimizer "
                                  "and one scheduler per checkpoint; prepare a single one (parameter groups work).")
        self.scheduler_pace = natural_pace(self.scheduler, int(accelerator.num_processes))
        self.optimizer_steps = 0
        self._step_hook: Any = None
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            # Adam-family optimizers keep a per-parameter step: hooks created mid-run file checkpoints right.
            steps = [int(st["step"]) for st in inner.state.values() if isinstance(st, dict) and "step" in st]
            self.optimizer_steps = max(steps, default=0)
            self._step_hook = inner.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.optimizer_steps += 1

    def close(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def models(self) -> list[torch.nn.Module]:
        models = self._models if self._models is not None else list(self.accelerator._models)
        if not models:
            raise ConfigError("the accelerator has no prepared model: call accelerator.prepare(model, ...) first.")
        return [self.accelerator.unwrap_model(m) for m in models]

    @property
    def optimizer(self) -> Any | None:
        return next(iter(getattr(self.accelerator, "_optimizers", [])), None)

    @property
    def scheduler(self) -> Any | None:
        return next(iter(getattr(self.accelerator, "_schedulers", [])), None)

    def _of_every_model(self, tensors: Callable[[torch.nn.Module], dict[str, Any]]) -> dict[str, Any]:
        return {(_MODEL_PREFIX.format(i) if i else "") + k: v for i, model in enumerate(self.models())
                for k, v in tensors(model).items()}

    def weights(self) -> dict[str, torch.Tensor]:
        return self._of_every_model(trainable_state_dict)

    def read_targets(self) -> dict[str, torch.Tensor]:
        return self._of_every_model(own_weights)

    def frozen_keys(self) -> frozenset[str]:
        return frozenset(self._of_every_model(lambda m: dict.fromkeys(frozen_weight_keys(m))))

    def epoch(self, *, boundary: bool = False) -> float:
        """Fractional epoch of the data position (0.0 without a loader; whole epochs when it has no length)."""
        if self.loader is None:
            return 0.0
        pos, length = self.loader.boundary_position() if boundary else self.loader.position(), self.loader.length()
        return float(pos["epoch"]) if length is None else pos["epoch"] + pos["batches_seen"] / max(length, 1)

    def extra(self) -> dict[str, Any]:
        return {KEY_ACCELERATE: {"optimizer_steps": self.optimizer_steps,
                                 "num_processes": int(self.accelerator.num_processes),
                                 KEY_SCHEDULER_PACE: self.scheduler_pace}}

    def apply(self, loaded: LoadedCheckpoint) -> None:
        """Load weights, optimizer, scheduler and scaler; arm the loader's exact resume (or put the RNG back now)."""
        if loaded.weights is not None:
            models = self.models()
            per_model: list[dict[str, torch.Tensor]] = [{} for _ in models]
            for key, tensor in loaded.weights.items():
                index = next((i for i in range(1, len(models)) if key.startswith(_MODEL_PREFIX.format(i))), 0)
                per_model[index][key[len(_MODEL_PREFIX.format(index)):] if index else key] = tensor
            for model, weights in zip(models, per_model):
                apply_weights(model, weights)
        apply_optimizer_state(loaded, optimizer=self.optimizer, scheduler=self.scheduler,
                              scaler=getattr(self.accelerator, "scaler", None))
        self.optimizer_steps = loaded.info.step
        if self.loader is not None and loaded.sampler is not None:
            self.loader.resume_from(loaded.sampler, rng=loaded.rng)
        elif loaded.rng is not None:
            restore_rng_state(loaded.rng)


# ------------------------------------------------------------------------------------------ another world size
def natural_pace(scheduler: Any, num_processes: int) -> int | None:
    """Steps of the wrapped scheduler per optimizer step as Accelerate prepared it; `None` for a scheduler that is
    not Accelerate's, steps at every call, or that a DeepSpeed engine steps itself."""
    if not isinstance(scheduler, AcceleratedScheduler) or not scheduler.step_with_optimizer \
            or type(scheduler).__name__ == "DeepSpeedSchedulerWrapper":  # the engine steps it, once per update
        return None
    return 1 if scheduler.split_batches else int(num_processes)


def keep_pace(scheduler: Any, pace: int) -> None:
    """Make `scheduler.step()` (an `AcceleratedScheduler`) step the wrapped scheduler `pace` times per optimizer
    step, whatever the number of processes."""
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
    return getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)


def apply_elastic(loaded: LoadedCheckpoint, *, state: AccelerateState, run: RunOrchestrator,
                  accelerator: Any, read_into: bool = False) -> None:
    """Continue `loaded` on this run's number of processes: the accumulation that keeps its global batch (also a
    DeepSpeed engine's), the scheduler's pace, and rank 0's lines saying what changes."""
    saved_extra, saved_world, world, step = loaded.extra.get(KEY_ACCELERATE) or {}, loaded.info.world_size, \
        run.world_size, loaded.info.step
    say = run.announce if run.rank == 0 else None
    plan = resume_batch(loaded, state.loader.geometry() if state.loader is not None else None, world=world,
                        keep=run.config.runtime.keep_global_batch, say=say, read_into=read_into,
                        position_in="samples", data=state.loader is not None)
    if plan is not None:
        accelerator.gradient_accumulation_steps = plan.accumulation
        engine = deepspeed_engine(accelerator)
        if engine is not None:  # the engine scales the loss and reduces by its own accumulation: the same one
            engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size *
                                        plan.accumulation)
    pace = state.scheduler_pace
    saved_pace = saved_extra.get(KEY_SCHEDULER_PACE) if KEY_SCHEDULER_PACE in saved_extra else \
        (saved_world if pace is not None and pace == world else None)
    if isinstance(saved_pace, int) and pace is not None and saved_pace != pace:
        keep_pace(state.scheduler, saved_pace)
        state.scheduler_pace = saved_pace
        if say is not None:
            say.info("smart_ckpt: step %d: the learning-rate scheduler keeps the pace of the run it continues, %d "
                     "scheduler step(s) per optimizer step (accelerate's prepared scheduler steps once per process: "
                     "%s on %d)", step, saved_pace, pace, world)


# ------------------------------------------------------------------------------------------ wiring
def make_run(config: SmartCkptConfig, accelerator: Any, output_dir: str | os.PathLike[str] | None,
             state: AccelerateState, *, boundary: bool, draws_random: Callable[[], bool] | None = None,
             **attach: Any) -> RunOrchestrator:
    """The run's orchestrator on the accelerator's rank and processes, attached to its live objects."""
    world = int(accelerator.num_processes)
    if world == 1 and dist.world_size() > 1:
        raise ConfigError(
            f"the accelerator counts 1 process but the process group has {dist.world_size()}: every process would "
            "checkpoint as rank 0 of a one-process run. Accelerate does this for DeepSpeed on a machine without "
            "GPUs: create `PartialState(backend='gloo')` before the `Accelerator`, so that it counts them.")
    root = config.resolve_root(output_dir if output_dir is not None else getattr(accelerator, "project_dir", None))
    run = RunOrchestrator(config, root=root, rank=int(accelerator.process_index), world_size=world)
    sampler: Callable[[], dict[str, Any]] | None = None
    if (loader := state.loader) is not None:
        where = loader.boundary_position if boundary else loader.position
        sampler = where if draws_random is None else (lambda: {**where(), KEY_DRAWS_RANDOM: draws_random()})
    run.attach(state.models()[0], optimizer=state.optimizer, scheduler=state.scheduler,
               scaler=getattr(accelerator, "scaler", None), weights=state.weights, frozen_keys=state.frozen_keys(),
               extra=lambda decision: state.extra(), sampler=sampler, **attach)
    return run


def total_limit(accelerator: Any) -> int | None:
    """`ProjectConfiguration.total_limit` when Accelerate names and rotates its checkpoint folders itself."""
    project = getattr(accelerator, "project_configuration", None)
    limit = getattr(project, "total_limit", None) if getattr(project, "automatic_checkpoint_naming", False) else None
    return int(limit) if isinstance(limit, int) and limit > 0 else None


_REGISTER = ("register_save_state_pre_hook", "register_load_state_pre_hook")


def keep_last(accelerator: Any, handles: list[Any]) -> None:
    """Keep the pre-hooks of `handles` behind every other save / load pre-hook of `accelerator`, now and whenever
    another is registered (`[]`: stop), with an instance-level wrapper of its `register_*_pre_hook` methods."""
    for name in _REGISTER:
        if name in vars(accelerator):
            delattr(accelerator, name)
    if not handles:
        return
    owner, refs = weakref.ref(accelerator), [weakref.ref(h) for h in handles]

    def to_end() -> None:
        for handle in filter(None, (ref() for ref in refs)):
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                hooks[handle.id] = hooks.pop(handle.id)

    for name in _REGISTER:
        def register(hook: Any, _name: str = name) -> Any:
            acc = owner()
            assert acc is not None, "the accelerator is gone"
            handle = getattr(type(acc), _name)(acc, hook)
            to_end()
            return handle

        setattr(accelerator, name, register)
    to_end()


# ------------------------------------------------------------------------------------------ the hook pair
class SmartStateHooks:
    """`accelerator.save_state()` / `load_state()` through the tiered store (docs/accelerate.md): `save_state`
    commits `step-<N>` (pinned) and leaves `smart_ckpt.json` instead of model files, `load_state` follows it (or
    takes a store checkpoint path) and arms `loader`. The store goes to `<output_dir>/smart_ckpt` when `config.root`
    is unset (`output_dir` defaults to the accelerator's `project_dir`)."""

    def __init__(self, accelerator: Any, dataloader: Any | None = None, *, config: SmartCkptConfig | None = None,
                 output_dir: str | os.PathLike[str] | None = None, run: RunOrchestrator | None = None,
                 state: AccelerateState | None = None) -> None:
        check_accelerator(accelerator)  # DeepSpeed / FSDP1: refused before anything is opened
        self.accelerator = accelerator
        config = config or SmartCkptConfig()
        self.state = state or AccelerateState(
            accelerator, loader=ResumableLoader(accelerator, dataloader) if dataloader is not None else None)
        self._owns_run = run is None
        if run is None:
            limit = total_limit(accelerator)
            if limit is not None:  # the user's bound on saved states holds in the store too
                config = config.replace(keep_last=limit if config.keep_last is None else min(config.keep_last, limit),
                                        policy={"keep_log_spaced": False})
            # The hooks only save when asked: no preemption handlers (nobody would act on them).
            run = make_run(config.replace(runtime={"preemption_signals": ()}), accelerator, output_dir, self.state,
                           boundary=False)
        self.run = run
        self.handles: list[Any] = []
        self.last_loaded: LoadedCheckpoint | None = None
        self._pinned: set[int] = set()  # steps this object's save_state pinned

    @property
    def loader(self) -> ResumableLoader | None:
        """The position-tracking view of the dataloader (iterate it: one epoch per `iter()`)."""
        return self.state.loader

    @property
    def store(self) -> Any:
        return self.run.store

    def register(self) -> tuple[Any, Any]:
        """Install the pair behind the accelerator's other pre-hooks (also later ones); returns both handles."""
        self.handles = [self.accelerator.register_save_state_pre_hook(self._save_hook),
                        self.accelerator.register_load_state_pre_hook(self._load_hook)]
        keep_last(self.accelerator, self.handles)
        return self.handles[0], self.handles[1]

    def remove(self) -> None:
        """Remove both hooks (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        keep_last(self.accelerator, [])

    def close(self) -> None:
        """Remove the hooks and, when this object created it, close the orchestrator."""
        self.remove()
        if self._owns_run:
            self.run.close()
            self.state.close()

    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]],
                   output_dir: str) -> None:
        step = self.state.optimizer_steps
        if self.run.rank == 0 and total_limit(self.accelerator) is not None:
            # Accelerate has rotated its folders before this hook: their checkpoints are ordinary ones now.
            self._unpin_rotated(Path(output_dir).parent)
        # Pinned: a state the user asked for by name must outlive automatic retention.
        event = self.run.save_now(step, self.state.epoch(), reason="save_state", pin=True, blocking=True)
        if event.handle is not None:
            event.handle.wait()  # re-raises the write error
        if event.error is not None:
            raise SaveError(f"save_state: the store did not commit step {event.step}: {event.error}")
        weights.clear()  # Accelerate writes one model file per entry: the weights are in the store instead
        if self.run.rank == 0:
            pointer = {"root": str(self.run.store.root), "task_id": self.run.store.task_id, "step": step,
                       "path": event.path}
            tmp = Path(output_dir) / f".{POINTER_NAME}.tmp"
            tmp.write_text(json.dumps(pointer, indent=1), encoding="utf-8")
            os.replace(tmp, Path(output_dir) / POINTER_NAME)
        self._pinned.add(step)
        logger.info("save_state: step %d committed to %s", step, event.path or self.run.store.root)

    def _unpin_rotated(self, folders: Path) -> None:
        """Unpin the checkpoints `save_state` pinned for folders under `folders` that no longer exist."""
        store = self.run.store
        kept: set[int] = set()
        for pointer_file in folders.glob(f"*/{POINTER_NAME}"):
            try:
                pointer = json.loads(pointer_file.read_text(encoding="utf-8"))
                if pointer.get("task_id") == store.task_id:
                    kept.add(int(pointer["step"]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                # Which checkpoint it names cannot be told: every one stays pinned until it can.
                logger.warning("save_state: %s cannot be read (%s); no checkpoint is unpinned this time", pointer_file,
                               e)
                return
        for info in store.list(include_unhealthy=True, include_abandoned=True):
            if info.pinned and info.step not in kept and (info.reason == "save_state" or info.step in self._pinned):
                store.unpin(info)
                self._pinned.discard(info.step)
                logger.info("save_state: step %d is no longer pinned (its folder under %s was rotated away by "
                            "total_limit); retention keeps or removes it like any other checkpoint", info.step, folders)

    def _load_hook(self, models: list[torch.nn.Module], input_dir: str) -> None:
        ref = self._ref_for(Path(input_dir))
        if ref is None:
            logger.info("load_state(%s): no %s and not a store checkpoint (a folder saved without the store's hooks): "
                        "Accelerate loads it as it would without them; the store %s is not involved", input_dir,
                        POINTER_NAME, self.run.store.root)
            return
        loaded = self.run.resume(ref, expected=self.state.weights())
        if loaded is None:  # pragma: no cover - resume returns None only for "auto" on an empty store
            raise CheckpointNotFoundError(f"load_state({input_dir!r}): the store {self.run.store.root} is empty.")
        apply_elastic(loaded, state=self.state, run=self.run, accelerator=self.accelerator)
        self.state.apply(loaded)
        models.clear()  # the weights are restored from the store: Accelerate must not look for model files
        self.last_loaded = loaded

    def _ref_for(self, input_dir: Path) -> str | None:
        """What `input_dir`'s pointer names, `input_dir` itself when it is a store checkpoint, else `None`."""
        pointer_file = input_dir / POINTER_NAME
        if not pointer_file.is_file():
            return str(input_dir) if (input_dir / MANIFEST_NAME).is_file() else None
        try:
            pointer = json.loads(pointer_file.read_text(encoding="utf-8"))
            missing = [k for k in _POINTER_KEYS if k not in pointer]
            if missing:
                raise KeyError(", ".join(missing))
        except (ValueError, KeyError) as e:
            raise CorruptCheckpointError(
                f"{pointer_file} is not a valid pointer ({type(e).__name__}: {e}); it should name the store "
                f"checkpoint written by save_state. Pass the store checkpoint directory to load_state instead."
            ) from e
        if Path(pointer["root"]).resolve() != Path(self.run.store.root).resolve():
            logger.warning("load_state: %s points into store %s, but this run's store is %s; loading by path",
                           pointer_file, pointer["root"], self.run.store.root)
        return str(pointer["path"]) if pointer["path"] else f"step:{int(pointer['step'])}"


# ------------------------------------------------------------------------------------------ the custom loop
class SmartCheckpointer:
    """Signal-driven, tiered, non-blocking checkpoints for a custom Accelerate loop (docs/accelerate.md): pass the
    prepared objects; iterate `ckpt.loader` for an exact data position. It also registers `SmartStateHooks` on the
    same store (not under DeepSpeed, where Accelerate runs DeepSpeed's own `save_state`; docs/deepspeed.md)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any | None = None,
                 dataloader: Any | None = None, *, config: SmartCkptConfig | None = None,
                 output_dir: str | os.PathLike[str] | None = None) -> None:
        check_accelerator(accelerator, deepspeed=True)  # DeepSpeed without ZeRO / FSDP1: refused before anything
        self.accelerator = accelerator
        self._deepspeed = deepspeed_engine(accelerator) is not None
        self.config = config or SmartCkptConfig()
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
            if (obj is not None or name == "optimizer") and obj not in getattr(accelerator, f"_{name}s"):
                raise ConfigError(f"{name} is not the accelerator's prepared {name}: pass the object returned by "
                                  "accelerator.prepare(...).")
        loader = ResumableLoader(accelerator, dataloader) if dataloader is not None else None
        self._randomness = StepRandomness()  # from a step's first batch to `before_update`; recorded with every save
        if loader is not None:
            loader.on_batch = self._randomness.begin
        self.state = AccelerateState(accelerator, models=[model], loader=loader)
        self.run = make_run(self.config, accelerator, output_dir, self.state, boundary=True, clip_owner=accelerator,
                            draws_random=lambda: self._randomness.seen,
                            position=lambda: (self.step, self.state.epoch(boundary=True)))
        self.hooks: SmartStateHooks | None = None  # `None` under DeepSpeed
        if not self._deepspeed:
            self.hooks = SmartStateHooks(accelerator, run=self.run, state=self.state)
            self.hooks.register()
        self.last_decision: Decision | None = None
        self.last_rollback: Rollback | None = None  # `on_anomaly: rollback`: the last one
        self._skipped_through = (-1, 0)  # (epoch, batch) up to which rollbacks left the data out
        self.loaded: LoadedCheckpoint | None = None
        self._lr: float | None = None
        self._mark()
        self.run.note_boundary(self.step)  # the starting state can be captured before the first update

    @property
    def step(self) -> int:
        """Optimizer updates completed."""
        return self.state.optimizer_steps

    @property
    def loader(self) -> ResumableLoader:
        if self.state.loader is None:
            raise ConfigError("SmartCheckpointer was created without a dataloader: pass dataloader=... to track "
                              "the data position.")
        return self.state.loader

    @property
    def epoch(self) -> int:
        return self.state.loader.epoch if self.state.loader is not None else 0

    @property
    def gradient_accumulation_steps(self) -> int:
        """The accelerator's, which `resume` sets to keep the checkpoint's global batch (docs/elastic.md)."""
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

    def _mark(self) -> None:
        if self.state.loader is not None:
            self.state.loader.mark_boundary()

    def before_update(self) -> Decision | None:
        """Call after `backward` (and clipping), before `optimizer.step()`: the step's signals and pre-anomaly
        capture; with `skip_update` the gradients were dropped. A no-op (`None`) on accumulation micro-steps."""
        if not self.accelerator.sync_gradients:
            return None
        self._randomness.end()  # the step's forward and backward ran
        opt = self.state.optimizer
        self._lr = float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None
        return self.run.pre_update(self.step, epoch=self.state.epoch(boundary=True))

    def after_update(self) -> Decision | None:
        """Call after `optimizer.step()` / `scheduler.step()`: this step's save decision, or a rollback (kind
        `rollback`, `last_rollback`; `loader` goes on with the next batches). A no-op on micro-steps."""
        if not self.accelerator.sync_gradients:
            return None
        if self._deepspeed:  # the engine stepped inside `accelerator.backward`; no torch optimizer step to count
            self.state.optimizer_steps += 1
        self._mark()
        decision = self.run.step_end(self.step, self.state.epoch(boundary=True), lr=self._lr)
        if decision.kind == DecisionKind.ROLLBACK:
            self._roll_back()
        self.last_decision = decision
        if self.state.loader is None:
            self._randomness.begin()  # else at the next batch
        return decision

    def _roll_back(self) -> None:
        loader, skipped = self.state.loader, ""
        done = self.run.rollback(restore_rng=loader is None)  # with a loader: after its next batch is fetched
        if done is None:
            return
        self.state.optimizer_steps = done.to_step
        if loader is not None:  # the data is not rewound: the loader is where the anomaly left it
            epoch, skip = loader.epoch, self.config.policy.rollback_skip_batches
            last = loader.batches_seen + skip
            loader.after_rollback(rng=done.rng, skip=skip)
            loader.mark_boundary()
            start = done.loaded.sampler or {}
            first = int(start.get("batches_seen", 0)) + 1 if start.get("epoch") == epoch else 1
            if self._skipped_through[0] == epoch:  # an earlier rollback to it left some out already
                first = max(first, self._skipped_through[1] + 1)
            self._skipped_through = (epoch, last)
            skipped = f"; skipped batches {first}..{last} of epoch {epoch}"
        self.last_rollback = done
        if self.run.rank == 0:  # one line for the run (every rank took the same, agreed rollback)
            self.run.announce.warning("smart_ckpt: rolled back from step %d to step %d (%s)%s", done.from_step,
                                      done.to_step, done.reason, skipped)

    def save_now(self, *, reason: str = "manual", blocking: bool = True) -> SaveEvent:
        """Save the state of the last completed step outside the policy (e.g. at the end)."""
        self._mark()
        return self.run.save_now(self.step, self.state.epoch(boundary=True), reason=reason, blocking=blocking)

    def resume(self, ref: str | None = "auto") -> LoadedCheckpoint | None:
        """Restore `ref` (`auto`, `best`, `fastest`, `step:N`, a path; `None`: fresh) on every rank before the loop;
        on another number of processes the run continues the same run (docs/elastic.md). `None`: fresh start."""
        into = None if self.run.sharded else self.state.read_targets()
        loaded = self.run.resume(ref, expected=self.state.weights(), into=into)
        if loaded is None:
            logger.info("resume(%r): nothing to resume, starting fresh", ref)
            return None
        apply_elastic(loaded, state=self.state, run=self.run, accelerator=self.accelerator, read_into=bool(into))
        self.state.apply(loaded)
        self._mark()
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
        """Wait for the last write, remove hooks and probes, close the store (idempotent); after a preemption save
        exit with `preemption_exit_code` unless not `exit_if_preempted`."""
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

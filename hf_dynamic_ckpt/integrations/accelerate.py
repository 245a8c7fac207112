"""Accelerate integration: the state-hook pair and `SmartCheckpointer` for custom loops.

Both are thin adapters over `checkpointer.Checkpointer`, the orchestrator the Trainer
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

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import distributed as dist
from ..checkpointer import Checkpointer, SaveEvent
from ..config import SmartCkptConfig
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..policy.decision import Decision
from ..store.types import LoadedCheckpoint
from ._accelerate_state import AccelerateState
from ._position import ResumableLoader

logger = logging.getLogger(__name__)

POINTER_NAME = "smart_ckpt.json"
"""File `save_state` leaves in its output directory: which store checkpoint holds the state."""
_POINTER_KEYS = ("root", "task_id", "step", "path")

__all__ = ["POINTER_NAME", "ResumableLoader", "SmartCheckpointer", "SmartStateHooks"]


def _store_root(config: SmartCkptConfig, accelerator: Any, output_dir: str | os.PathLike[str] | None) -> str:
    if config.root is None and output_dir is None:
        output_dir = getattr(accelerator, "project_dir", None)
    return config.resolve_root(output_dir)


def _make_core(config: SmartCkptConfig, accelerator: Any, root: str) -> Checkpointer:
    return Checkpointer(config, root=root, rank=int(accelerator.process_index),
                        world_size=int(accelerator.num_processes))


class SmartStateHooks:
    """`accelerator.save_state()` / `load_state()` through the tiered store.

    Registering installs a save pre-hook and a load pre-hook on the accelerator:

    - save: commits the current state as store checkpoint `step-<N>` (N = optimizer updates
      so far, pinned against retention) through the commit protocol and the catalog,
      synchronously, on every rank
      (each rank its RNG file); the data position of `loader` goes with it. The hook then
      empties Accelerate's `weights` list, so no model file is written to the directory,
      and rank 0 leaves `smart_ckpt.json` there.
    - load: follows `smart_ckpt.json` (or takes the directory as a store checkpoint path),
      verifies and loads the checkpoint (fallback per `config.fallback_strategy`), puts the
      weights, optimizer, scheduler and scaler back, empties Accelerate's `models` list so
      it does not look for model files, and arms `loader` to skip the batches already seen
      and to re-apply the saved RNG once the first batch is fetched.

    Args:
        accelerator (`accelerate.Accelerator`): after `prepare(...)`.
        dataloader (`torch.utils.data.DataLoader`, *optional*): the prepared training
            dataloader; iterate `hooks.loader` instead of it for an exact data position.
        config (`SmartCkptConfig`, *optional*): `root` and `task_id` name the store.
        output_dir (`str`, *optional*): store goes to `<output_dir>/smart_ckpt` when
            `config.root` is unset (defaults to the accelerator's `project_dir`).
        checkpointer (`Checkpointer`, *optional*): share an existing orchestrator (what
            `SmartCheckpointer` does); by default one is created without signal handlers.

    Example:
        ```python
        >>> hooks = SmartStateHooks(accelerator, train_dataloader, output_dir="out")
        >>> save_handle, load_handle = hooks.register()
        >>> for batch in hooks.loader:               # one epoch, exact position
        ...     ...
        >>> accelerator.save_state("out/state")      # -> out/smart_ckpt/default/step-<N>/
        >>> accelerator.load_state("out/state")      # restores it
        >>> hooks.remove()
        ```
    """

    def __init__(
        self,
        accelerator: Any,
        dataloader: Any | None = None,
        *,
        config: SmartCkptConfig | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        checkpointer: Checkpointer | None = None,
        state: AccelerateState | None = None,
    ) -> None:
        self.accelerator = accelerator
        config = config or SmartCkptConfig()
        if state is None:
            loader = ResumableLoader(accelerator, dataloader) if dataloader is not None else None
            state = AccelerateState(accelerator, loader=loader)
        self.state = state
        self._owns_core = checkpointer is None
        if checkpointer is None:
            # The hooks only save when asked: no preemption handlers (nobody would act on them).
            checkpointer = _make_core(config.replace(preemption_signals=()), accelerator,
                                      _store_root(config, accelerator, output_dir))
            _attach(checkpointer, state, boundary=False)
        self.core = checkpointer
        self.handles: list[Any] = []
        self.last_loaded: LoadedCheckpoint | None = None

    @property
    def loader(self) -> ResumableLoader | None:
        """The position-tracking view of the dataloader (iterate it: one epoch per `iter()`)."""
        return self.state.loader

    @property
    def store(self) -> Any:
        return self.core.store

    def register(self) -> tuple[Any, Any]:
        """Install the pair on the accelerator.

        Returns:
            `tuple`: the `torch.utils.hooks.RemovableHandle`s of the save and load pre-hooks.
        """
        save = self.accelerator.register_save_state_pre_hook(self._save_hook)
        load = self.accelerator.register_load_state_pre_hook(self._load_hook)
        self.handles = [save, load]
        return save, load

    def remove(self) -> None:
        """Remove both hooks (idempotent); `save_state` / `load_state` behave as without them."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def close(self) -> None:
        """Remove the hooks and, when this object created it, close the orchestrator."""
        self.remove()
        if self._owns_core:
            self.core.close()
            self.state.close()

    # -- the hooks -------------------------------------------------------------------------
    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        step = self.state.optimizer_steps
        # Pinned: a state the user asked for by name must outlive automatic retention.
        event = self.core.save_now(step, self.state.epoch(), reason="save_state", pin=True, blocking=True)
        self._raise_if_failed(event)
        # Accelerate writes one model file per entry: the weights are in the store instead.
        weights.clear()
        if self.core.rank == 0:
            pointer = {"root": str(self.core.store.root), "task_id": self.core.store.task_id, "step": step,
                       "path": event.path}
            tmp = Path(output_dir) / f".{POINTER_NAME}.tmp"
            tmp.write_text(json.dumps(pointer, indent=1), encoding="utf-8")
            os.replace(tmp, Path(output_dir) / POINTER_NAME)
        logger.info("save_state: step %d committed to %s", step, event.path or self.core.store.root)

    @staticmethod
    def _raise_if_failed(event: SaveEvent) -> None:
        if event.handle is not None:
            event.handle.wait()  # re-raises the write error
        if event.error is not None:
            from ..errors import SaveError

            raise SaveError(f"save_state: the store did not commit step {event.step}: {event.error}")

    def _load_hook(self, models: list[torch.nn.Module], input_dir: str) -> None:
        spec = self._spec_for(Path(input_dir))
        loaded = self.core.resume(spec, expected=self.state.weights())
        if loaded is None:  # pragma: no cover - resume returns None only for "auto" on an empty store
            raise CheckpointNotFoundError(f"load_state({input_dir!r}): the store {self.core.store.root} is empty.")
        self.state.apply(loaded)
        # The weights are restored from the store: Accelerate must not look for model files.
        models.clear()
        self.last_loaded = loaded

    def _spec_for(self, input_dir: Path) -> str:
        pointer_file = input_dir / POINTER_NAME
        if not pointer_file.is_file():
            return str(input_dir)  # a store checkpoint directory itself
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
        if Path(pointer["root"]).resolve() != Path(self.core.store.root).resolve():
            logger.warning("load_state: %s points into store %s, but this run's store is %s; loading by path",
                           pointer_file, pointer["root"], self.core.store.root)
        return str(pointer["path"]) if pointer["path"] else f"step:{int(pointer['step'])}"


def _attach(core: Checkpointer, state: AccelerateState, *, boundary: bool, clip_owner: Any | None = None) -> None:
    models = state.models()
    loader = state.loader
    sampler = None
    if loader is not None:
        sampler = loader.boundary_position if boundary else loader.position
    core.attach(
        models[0],
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        scaler=state.scaler,
        weights=state.weights,
        frozen_keys=state.frozen_keys(),
        extra=state.extra,
        sampler=sampler,
        clip_owner=clip_owner,
    )


class SmartCheckpointer:
    """Signal-driven, tiered, non-blocking checkpoints for a custom Accelerate loop.

    One object, two calls per step and one resume call: the same orchestrator, policy,
    engine and store as `SmartCkptCallback`. It also registers `SmartStateHooks`, so
    `accelerator.save_state()` / `load_state()` go to the same store.

    Args:
        accelerator (`accelerate.Accelerator`): after `prepare(...)`.
        model (`torch.nn.Module`): the prepared model (PEFT models save the adapter only).
        optimizer (`torch.optim.Optimizer`): the prepared optimizer.
        scheduler (*optional*): the prepared LR scheduler.
        dataloader (`torch.utils.data.DataLoader`, *optional*): the prepared training dataloader;
            iterate `ckpt.loader` (one epoch per `iter()`) for an exact data position.
        config (`SmartCkptConfig`, *optional*): defaults to `SmartCkptConfig()`.
        output_dir (`str`, *optional*): store at `<output_dir>/smart_ckpt` when `config.root` is unset.

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
    ) -> None:
        self.accelerator = accelerator
        self.config = config or SmartCkptConfig()
        if optimizer not in accelerator._optimizers:
            raise ConfigError("optimizer is not the accelerator's prepared optimizer: pass the object "
                              "returned by accelerator.prepare(...).")
        if scheduler is not None and scheduler not in accelerator._schedulers:
            raise ConfigError("scheduler is not the accelerator's prepared scheduler: pass the object "
                              "returned by accelerator.prepare(...).")
        loader = ResumableLoader(accelerator, dataloader) if dataloader is not None else None
        self.state = AccelerateState(accelerator, models=[model], loader=loader)
        self.core = _make_core(self.config, accelerator, _store_root(self.config, accelerator, output_dir))
        _attach(self.core, self.state, boundary=True, clip_owner=accelerator)
        self.hooks = SmartStateHooks(accelerator, checkpointer=self.core, state=self.state)
        self.hooks.register()
        self.last_decision: Decision | None = None
        self.loaded: LoadedCheckpoint | None = None
        self._lr: float | None = None
        if loader is not None:
            loader.mark_boundary()

    # -- properties ------------------------------------------------------------------------
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
    def should_stop(self) -> bool:
        """A preemption signal arrived and the final checkpoint is committed: stop training."""
        return self.core.preempted

    @property
    def store(self) -> Any:
        return self.core.store

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
        opt = self.state.optimizer
        self._lr = float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None
        return self.core.pre_update(self.step, epoch=self.state.epoch(boundary=True))

    def after_update(self) -> Decision | None:
        """Call after `optimizer.step()` / `scheduler.step()`: the save decision of this step.

        Saves in the background when the policy says so; on a preemption signal commits a
        checkpoint synchronously and sets `should_stop`. A no-op on accumulation micro-steps.
        """
        if not self.accelerator.sync_gradients:
            return None
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        decision = self.core.step_end(self.step, self.state.epoch(boundary=True), lr=self._lr)
        self.last_decision = decision
        return decision

    def save_now(self, *, reason: str = "manual", blocking: bool = True) -> SaveEvent:
        """Save the state of the last completed step outside the policy (e.g. at the end)."""
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        return self.core.save_now(self.step, self.state.epoch(boundary=True), reason=reason, blocking=blocking)

    def resume(self, spec: str | None = "auto") -> LoadedCheckpoint | None:
        """Restore a checkpoint on every rank before the loop (rank 0 chooses).

        Args:
            spec (`str`, *optional*, defaults to `"auto"`): `auto` (newest healthy), `best`
                (lowest loss), `fastest` (lowest recovery cost), `step:N`, or a path; `None`
                starts fresh. `auto` on an empty store starts fresh.

        Returns:
            `LoadedCheckpoint | None`: what was restored (`None`: fresh start).

        Raises:
            `CheckpointNotFoundError`: an explicit `spec` names nothing loadable.
            `IncompatibleStateError`: the checkpoint does not fit the model.
        """
        loaded = self.core.resume(spec, expected=self.state.weights())
        if loaded is None:
            logger.info("resume(%r): nothing to resume, starting fresh", spec)
            return None
        self.state.apply(loaded)
        if self.state.loader is not None:
            self.state.loader.mark_boundary()
        dist.barrier()
        self.loaded = loaded
        return loaded

    def metrics(self) -> dict[str, float]:
        """`smart_ckpt/*` numbers for `accelerator.log(...)`."""
        return self.core.metrics()

    def close(self) -> None:
        """Wait for the last write, remove hooks and probes, close the store (idempotent)."""
        self.hooks.remove()
        self.core.close()
        self.state.close()

    def __enter__(self) -> SmartCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

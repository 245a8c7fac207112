"""`SmartStateHooks`: `accelerator.save_state()` / `load_state()` through the tiered store.

The save/load pre-hook pair (and the helpers `SmartCheckpointer` shares with it). See
`integrations.accelerate` for the overview.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..constants import MANIFEST_NAME
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..run.elastic import KEY_DRAWS_RANDOM
from ..run.orchestrator import RunOrchestrator, SaveEvent
from ..state.support import check_accelerator
from ..store import LoadedCheckpoint
from ._accelerate_elastic import apply_elastic
from ._accelerate_state import KEY_ACCELERATE, AccelerateState
from ._position import ResumableLoader

logger = logging.getLogger(__name__)

POINTER_NAME = "smart_ckpt.json"
"""File `save_state` leaves in its output directory: which store checkpoint holds the state."""
_POINTER_KEYS = ("root", "task_id", "step", "path")


def store_root(config: SmartCkptConfig, accelerator: Any, output_dir: str | os.PathLike[str] | None) -> str:
    if config.root is None and output_dir is None:
        output_dir = getattr(accelerator, "project_dir", None)
    return config.resolve_root(output_dir)


def accelerate_total_limit(accelerator: Any) -> int | None:
    """`ProjectConfiguration.total_limit` when Accelerate names and rotates its checkpoint folders itself."""
    project = getattr(accelerator, "project_configuration", None)
    limit = getattr(project, "total_limit", None) if getattr(project, "automatic_checkpoint_naming", False) else None
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def make_orchestrator(config: SmartCkptConfig, accelerator: Any, root: str) -> RunOrchestrator:
    """The run's orchestrator on the accelerator's rank and number of processes.

    Raises:
        `ConfigError`: the process group has more processes than the accelerator counts (every process would
            act as rank 0 of a one-process run).
    """
    world = int(accelerator.num_processes)
    if world == 1 and dist.world_size() > 1:
        raise ConfigError(
            f"the accelerator counts 1 process but the process group has {dist.world_size()}: every process would "
            "checkpoint as rank 0 of a one-process run. Accelerate does this for DeepSpeed on a machine without "
            "GPUs: create `PartialState(backend='gloo')` before the `Accelerator`, so that it counts them.")
    return RunOrchestrator(config, root=root, rank=int(accelerator.process_index),
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
      verifies and loads the checkpoint (fallback per `config.runtime.fallback_strategy`), puts the
      weights, optimizer, scheduler and scaler back, empties Accelerate's `models` list so
      it does not look for model files, and arms `loader` to skip the batches already seen
      and to re-apply the saved RNG once the first batch is fetched. A folder written
      without the hooks (no `smart_ckpt.json`, not a store checkpoint) is left to
      Accelerate, with one INFO line: the store is not involved.

    The pair always runs after every other save / load pre-hook of the accelerator, registered
    before or after it: those see Accelerate's full `models` and `weights` lists. With
    `ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`, the store keeps at most N
    checkpoints besides pinned captures (hooks that own their run retain with `keep_last=N`, no
    log-spaced history): a checkpoint pinned for a folder Accelerate rotated away is unpinned, and
    retention removes it.

    Args:
        accelerator (`accelerate.Accelerator`): after `prepare(...)`.
        dataloader (`torch.utils.data.DataLoader`, *optional*): the prepared training
            dataloader; iterate `hooks.loader` instead of it for an exact data position.
        config (`SmartCkptConfig`, *optional*): `root` and `task_id` name the store.
        output_dir (`str`, *optional*): store goes to `<output_dir>/smart_ckpt` when
            `config.root` is unset (defaults to the accelerator's `project_dir`).
        run (`RunOrchestrator`, *optional*): share an existing orchestrator (what
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
        run: RunOrchestrator | None = None,
        state: AccelerateState | None = None,
    ) -> None:
        check_accelerator(accelerator)  # DeepSpeed / FSDP1: refused before anything is opened
        self.accelerator = accelerator
        config = config or SmartCkptConfig()
        if state is None:
            loader = ResumableLoader(accelerator, dataloader) if dataloader is not None else None
            state = AccelerateState(accelerator, loader=loader)
        self.state = state
        self._owns_run = run is None
        if run is None:
            limit = accelerate_total_limit(accelerator)
            if limit is not None:  # the user's bound on saved states holds in the store too
                keep = limit if config.keep_last is None else min(config.keep_last, limit)
                config = config.replace(keep_last=keep, policy={"keep_log_spaced": False})
            # The hooks only save when asked: no preemption handlers (nobody would act on them).
            run = make_orchestrator(config.replace(runtime={"preemption_signals": ()}), accelerator,
                                    store_root(config, accelerator, output_dir))
            attach_state(run, state, boundary=False)
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
        """Install the pair on the accelerator, behind its other save / load pre-hooks (also those registered later).

        Returns:
            `tuple`: the `torch.utils.hooks.RemovableHandle`s of the save and load pre-hooks.
        """
        save = self.accelerator.register_save_state_pre_hook(self._save_hook)
        load = self.accelerator.register_load_state_pre_hook(self._load_hook)
        self.handles = [save, load]
        keep_last(self.accelerator, self.handles)
        return save, load

    def remove(self) -> None:
        """Remove both hooks (idempotent); `save_state` / `load_state` behave as without them."""
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

    # -- the hooks -------------------------------------------------------------------------
    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]],
                   output_dir: str) -> None:
        step = self.state.optimizer_steps
        if self.run.rank == 0 and accelerate_total_limit(self.accelerator) is not None:
            # Accelerate has rotated its folders before this hook: their checkpoints are ordinary ones now.
            self._unpin_rotated(Path(output_dir).parent)
        # Pinned: a state the user asked for by name must outlive automatic retention.
        event = self.run.save_now(step, self.state.epoch(), reason="save_state", pin=True, blocking=True)
        self._raise_if_failed(event)
        # Accelerate writes one model file per entry: the weights are in the store instead.
        weights.clear()
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
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not ours to judge: its checkpoint stays pinned
        for info in store.list(include_unhealthy=True, include_abandoned=True):
            if info.pinned and info.step not in kept and (info.reason == "save_state" or info.step in self._pinned):
                store.unpin(info)
                self._pinned.discard(info.step)
                logger.info("save_state: step %d is no longer pinned (its folder under %s was rotated away by "
                            "total_limit); retention keeps or removes it like any other checkpoint", info.step, folders)

    @staticmethod
    def _raise_if_failed(event: SaveEvent) -> None:
        if event.handle is not None:
            event.handle.wait()  # re-raises the write error
        if event.error is not None:
            from ..errors import SaveError

            raise SaveError(f"save_state: the store did not commit step {event.step}: {event.error}")

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
        # Another number of processes: the accumulation and the scheduler's pace that continue the same run.
        apply_elastic(loaded, saved_extra=loaded.extra.get(KEY_ACCELERATE) or {}, state=self.state, run=self.run,
                      accelerator=self.accelerator)
        self.state.apply(loaded)
        # The weights are restored from the store: Accelerate must not look for model files.
        models.clear()
        self.last_loaded = loaded

    def _ref_for(self, input_dir: Path) -> str | None:
        """What to resume for `input_dir`: the checkpoint its pointer names, the directory itself when it is a store
        checkpoint, else `None` (a plain Accelerate folder)."""
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


_REGISTER = ("register_save_state_pre_hook", "register_load_state_pre_hook")


def keep_last(accelerator: Any, handles: list[Any]) -> None:
    """Keep the pre-hooks of `handles` behind every other save / load pre-hook of `accelerator`, now and whenever
    another is registered (`[]`: stop). Ours empty Accelerate's `models` / `weights` lists; a hook that ran after
    them would find the lists empty.

    The accelerator's two `register_*_pre_hook` methods get an instance-level wrapper that registers, then moves
    ours to the end; it holds the accelerator and the handles weakly, so it keeps nothing alive."""
    for name in _REGISTER:
        if name in vars(accelerator):
            delattr(accelerator, name)
    if not handles:
        return
    owner, refs = weakref.ref(accelerator), [weakref.ref(h) for h in handles]

    def to_end() -> None:
        for ref in refs:
            handle = ref()
            if handle is None:
                continue
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


def attach_state(run: RunOrchestrator, state: AccelerateState, *, boundary: bool, clip_owner: Any | None = None,
                 consolidate: bool | None = False, draws_random: Callable[[], bool] | None = None,
                 position: Callable[[], tuple[int, float | None]] | None = None) -> None:
    """Attach `run` to the accelerator's live objects (`boundary`: the data position of the last completed step,
    for a custom loop; else the current one, for `save_state`; `draws_random`: whether the steps drew random
    numbers, recorded with the data position; `position`: `RunOrchestrator.attach`'s)."""
    models = state.models()
    loader = state.loader
    sampler: Callable[[], dict[str, Any]] | None = None
    if loader is not None:
        where = loader.boundary_position if boundary else loader.position
        sampler = where if draws_random is None else (lambda: {**where(), KEY_DRAWS_RANDOM: draws_random()})
    run.attach(
        models[0],
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        scaler=state.scaler,
        weights=state.weights,
        frozen_keys=state.frozen_keys(),
        extra=lambda decision: state.extra(),
        sampler=sampler,
        clip_owner=clip_owner,
        consolidate=consolidate,
        position=position,
    )



"""Choose a restore point, verify it, and load it tier by tier with fallback.

Outcomes per broken tier (see `config.FallbackStrategy`):

==================  ===========================================  ==============================
broken tier         ``full`` (default)                           ``level_0_1``
==================  ===========================================  ==============================
L0 weights          next older checkpoint, warning naming both   same
L1 optimizer        weights only: optimizer/scaler `None`,        next older checkpoint whose
                    scheduler salvaged from ``optimizer.json``    L0 and L1 are intact
                    when intact; warning
L2 state            RNG/sampler `None`, warning                  same
==================  ===========================================  ==============================

With ``level_0_only`` the optimizer tier is not read at all. Every warning is also logged
(``logging.WARNING``) and kept in `LoadedCheckpoint.warnings`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .config import FallbackStrategy
from .constants import Tier
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
)
from .store.types import CheckpointInfo, LoadedCheckpoint

if TYPE_CHECKING:

    from .store.store import CheckpointStore

logger = logging.getLogger(__name__)

def _warn(loaded: LoadedCheckpoint, message: str) -> None:
    loaded.warnings.append(message)  # logged once, in order, by load_for_resume


def _older_candidates(store: CheckpointStore, info: CheckpointInfo) -> list[CheckpointInfo]:
    """Healthy committed checkpoints with weights older than `info`, newest first."""
    if info.task_id != store.task_id:
        return []
    return [i for i in store.list() if i.step < info.step and Tier.WEIGHTS in i.tiers]


def load_for_resume(
    store: CheckpointStore,
    spec: str | int | os.PathLike[str] | CheckpointInfo,
    *,
    rank: int = 0,
    fallback: FallbackStrategy | str = FallbackStrategy.FULL,
    mmap: bool = True,
) -> LoadedCheckpoint:
    """Load the state to resume from, falling back when a tier is broken.

    Args:
        store (`CheckpointStore`): the run's store.
        spec (`str`, `int`, `os.PathLike` or `CheckpointInfo`): ``"auto"``, ``"best"``,
            ``"fastest"``, ``"step:N"`` or a path (see `CheckpointStore.resolve`).
        rank (`int`, *optional*, defaults to `0`): whose RNG state to load.
        fallback (`FallbackStrategy` or `str`, *optional*, defaults to `"full"`): what to do
            when a tier cannot be loaded (module docstring).
        mmap (`bool`, *optional*, defaults to `True`): memory-map the weights.

    Returns:
        `LoadedCheckpoint`: `info` is the checkpoint actually used; `warnings` says what was
        lost on the way (each also logged).

    Raises:
        `CheckpointNotFoundError`: `spec` names nothing, or no checkpoint at or below it
            has loadable weights (and, with ``level_0_1``, optimizer state).
        `FormatVersionError`: the chosen checkpoint needs a newer library.

    Example:
        ```python
        >>> loaded = load_for_resume(store, "auto")
        >>> model.load_state_dict(loaded.weights, strict=False)
        >>> if loaded.optimizer is not None:
        ...     optimizer.load_state_dict(loaded.optimizer)
        ```
    """
    fallback = FallbackStrategy(fallback)
    first = store.resolve(spec)
    candidates = [first, *_older_candidates(store, first)]
    notes: list[str] = []
    for info in candidates:
        loaded = _try_checkpoint(store, info, rank=rank, fallback=fallback, mmap=mmap, notes=notes)
        if loaded is not None:
            loaded.warnings[:0] = notes
            for message in loaded.warnings:
                logger.warning(message)
            return loaded
    tried = ", ".join(str(i.step) for i in candidates)
    raise CheckpointNotFoundError(
        f"no loadable checkpoint at or below step {first.step} of task {first.task_id!r} (tried steps {tried}): "
        + "; ".join(notes)
        + ". Run `hf-dynamic-ckpt verify` on the store, or start fresh."
    )


def _try_checkpoint(store: CheckpointStore, info: CheckpointInfo, *, rank: int, fallback: FallbackStrategy,
                    mmap: bool, notes: list[str]) -> LoadedCheckpoint | None:
    """Load one checkpoint per `fallback`; `None` (with a note) when it cannot serve."""
    try:
        loaded = store.load(info, tiers={Tier.WEIGHTS}, rank=rank, mmap=mmap)
    except FormatVersionError:
        raise
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:
        notes.append(f"weights of step {info.step} cannot be loaded ({e}); falling back to the next older checkpoint")
        return None
    if loaded.weights is None:
        notes.append(f"step {info.step} holds no weights; falling back to the next older checkpoint")
        return None
    if notes:  # the requested checkpoint was skipped: say which one replaces it
        notes[-1] += f": using step {info.step} instead"

    if fallback != FallbackStrategy.LEVEL_0_ONLY:
        reason = _load_optimizer(store, info, loaded, rank=rank)
        if reason is not None:
            if fallback == FallbackStrategy.LEVEL_0_1:
                notes.append(f"optimizer state of step {info.step} cannot be loaded ({reason}); fallback_strategy="
                             "level_0_1 requires it, falling back to the next older checkpoint")
                return None
            _warn(loaded, f"resuming from weights only: optimizer state of step {info.step} is lost ({reason}); "
                          f"the learning-rate schedule continues at step {info.step}")
    try:
        state = store.load(info, tiers={Tier.STATE}, rank=rank, mmap=mmap)
    except CorruptCheckpointError as e:
        _warn(loaded, f"RNG and data-loader state of step {info.step} cannot be loaded ({e}); "
                      "random streams and the data order start fresh")
    else:
        loaded.rng, loaded.sampler = state.rng, state.sampler
        loaded.warnings.extend(w for w in state.warnings if w not in loaded.warnings)
    return loaded


def _load_optimizer(store: CheckpointStore, info: CheckpointInfo, loaded: LoadedCheckpoint, *, rank: int) -> str | None:
    """Fill the optimizer tier into `loaded`; return why it failed, or `None`."""
    if Tier.OPTIMIZER not in info.tiers:
        return "the checkpoint was saved without it"
    try:
        opt = store.load(info, tiers={Tier.OPTIMIZER}, rank=rank)
    except CorruptCheckpointError as e:
        loaded.scheduler = store.load_scheduler_only(info)
        return str(e)
    loaded.optimizer, loaded.scheduler, loaded.scaler = opt.optimizer, opt.scheduler, opt.scaler
    return None



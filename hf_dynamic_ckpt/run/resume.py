"""A resume as a value: the restore point read, verified and planned into a `Resumption`, which the run applies.

`plan_resumption` chooses and loads the restore point (`restore.plan_resume`: one agreed outcome
on every rank, checked against the model), names the timeline that starts from it, and gathers
what a run restores besides its live objects: the policy's and the probes' statistics and the
save counters. It changes nothing: `RunOrchestrator.apply` makes the value the run's state (rank
0 sets the newer checkpoints of other timelines aside with `start_timeline`), and an in-process
rollback applies a value built the same way to the live run.

The optimizer tier may be read in a background thread while the caller builds its optimizer
(`PendingOptimizerRead`); `RunOrchestrator.complete_resume` collects it, with one outcome agreed
across ranks (lost on one rank: lost on all).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import distributed as dist
from ..config import FallbackStrategy
from ..state.optimizer import state_numel_bound
from ..store.spec import Lineage, new_session_id
from ..store.store import CheckpointStore
from ..store.types import CheckpointInfo, LoadedCheckpoint
from .restore import OptimizerOutcome, agreed_loss, optimizer_lost_message, plan_resume, read_optimizer_tier

logger = logging.getLogger(__name__)

KEY_POLICY = "policy"
KEY_GRAD_PROBE = "grad_probe"
KEY_SAVE_LOG = "save_log"
KEY_ROLLBACKS = "rollbacks"
"""Keys of a manifest's `extra` that hold the run's own state (the policy, the gradient probe, the save counts,
the rollbacks taken)."""


class PendingOptimizerRead:
    """The optimizer tier of a checkpoint, read in a background thread until `collect`.

    Args:
        store (`CheckpointStore`): where to read.
        info (`CheckpointInfo`): the chosen restore point.
        rank (`int`): this rank (whose files to read).
        max_numel (`int`, *optional*): the largest optimizer-state tensor the model can have.
    """

    def __init__(self, store: CheckpointStore, info: CheckpointInfo, *, rank: int, max_numel: int | None) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="smart-ckpt-l1")
        self._future: Future[OptimizerOutcome] = self._pool.submit(read_optimizer_tier, store, info, rank, max_numel)

    def collect(self, world_size: int) -> OptimizerOutcome:
        """Wait for the read; a loss on any rank is a loss on every rank (one all-gather when `world_size > 1`)."""
        try:
            mine = self._future.result()
        finally:
            self.close()
        report = {"lost": mine.lost, "scheduler": mine.scheduler is not None}
        reports = dist.all_gather_json(report) if world_size > 1 else [report]
        lost_on = [(r, o["lost"]) for r, o in enumerate(reports) if o["lost"] is not None]
        if not lost_on:
            return mine
        scheduler = mine.scheduler if all(o["scheduler"] for o in reports) else None
        return OptimizerOutcome(None, scheduler, None, lost=agreed_loss(lost_on, world_size))

    def close(self) -> None:
        """Wait for the thread and release it (idempotent)."""
        self._pool.shutdown(wait=True)


@dataclass
class Resumption:
    """What a resume hands the run: read and verified, nothing applied yet.

    Attributes:
        loaded (`LoadedCheckpoint`): this rank's view of the restore point (its own RNG); with a
            `pending` read, the optimizer tier is filled in by `RunOrchestrator.complete_resume`.
        spec (`str`): what was asked for (`auto`, `step:N`, a path, ...).
        lineage (`Lineage`): the timeline the run continues on (its parent: the restore point).
        degraded (`bool`): the optimizer state is not restored (a weights-only resume).
        policy_state, probe_state, save_counts, rollback_state (`dict`, *optional*): the run's own state
            at the restore point (the manifest's `extra`).
        pending (`PendingOptimizerRead`, *optional*): the optimizer tier, still being read.
        elapsed_ms (`float`): how long planning took.
    """

    loaded: LoadedCheckpoint
    spec: str
    lineage: Lineage
    degraded: bool = False
    policy_state: dict[str, Any] | None = None
    probe_state: dict[str, Any] | None = None
    save_counts: dict[str, Any] | None = None
    rollback_state: dict[str, Any] | None = None
    pending: PendingOptimizerRead | None = field(default=None, repr=False)
    elapsed_ms: float = 0.0

    @property
    def step(self) -> int:
        """The step of the restore point."""
        return self.loaded.info.step


def run_state(loaded: LoadedCheckpoint, key: str) -> dict[str, Any] | None:
    """One part of the run's own state stored in a checkpoint's `extra` (`KEY_POLICY`, ...; absent: `None`)."""
    value = loaded.extra.get(key)
    return value if isinstance(value, dict) and value else None


def plan_resumption(store: CheckpointStore, spec: str, *, session_id: str, rank: int = 0, world_size: int = 1,
                    fallback: FallbackStrategy = FallbackStrategy.FULL, expected: Mapping[str, Any] | None = None,
                    background_optimizer: bool = False) -> Resumption | None:
    """Choose, verify and load a restore point on every rank (one agreed outcome) into a `Resumption`.

    Args:
        store (`CheckpointStore`): this rank's store.
        spec (`str`): `auto`, `best`, `fastest`, `step:N` or a checkpoint path (another store's too).
        session_id (`str`): this run's session (the new lineage's).
        rank, world_size (`int`): this rank and the number of ranks (a collective when > 1).
        fallback (`FallbackStrategy`): what a broken tier does (`restore`).
        expected (`Mapping[str, Tensor]`, *optional*): the model's L0 mapping: the saved weights
            must fit it on every rank, and it bounds the optimizer tier's tensors.
        background_optimizer (`bool`): with the `full` strategy, read the optimizer tier in a
            background thread (`Resumption.pending`).

    Returns:
        `Resumption | None`: `None` for a fresh start (`auto` on an empty store).

    Raises:
        The same error on every rank: `CheckpointNotFoundError`, `IncompatibleStateError`,
        `FormatVersionError`, `DistributedError`.
    """
    start = time.perf_counter()
    deferred = background_optimizer and fallback == FallbackStrategy.FULL
    plan = plan_resume(store, spec, rank=rank, world_size=world_size,
                       fallback=FallbackStrategy.LEVEL_0_ONLY if deferred else fallback, expected=expected)
    if plan is None:
        return None
    loaded = plan.loaded
    parent = loaded.info.lineage
    lineage = Lineage(session=session_id, timeline=new_session_id(), parent_step=loaded.info.step,
                      parent_timeline=parent.timeline if parent is not None else None)
    pending = None
    if deferred:
        # Only once the plan chose the restore point: a read racing `plan_resume` could record the
        # checkpoint's corrupt L1 in the catalog first and turn a weights-only resume into a fallback.
        bound = state_numel_bound(expected.values()) if expected is not None else None
        pending = PendingOptimizerRead(store, loaded.info, rank=rank, max_numel=bound)
    return Resumption(loaded=loaded, spec=str(spec), lineage=lineage, degraded=plan.degraded and not deferred,
                      policy_state=run_state(loaded, KEY_POLICY), probe_state=run_state(loaded, KEY_GRAD_PROBE),
                      save_counts=run_state(loaded, KEY_SAVE_LOG), rollback_state=run_state(loaded, KEY_ROLLBACKS),
                      pending=pending, elapsed_ms=(time.perf_counter() - start) * 1e3)


def fill_optimizer(resumption: Resumption, outcome: OptimizerOutcome) -> None:
    """Put a collected optimizer tier into the resumption's checkpoint (or record why it is lost)."""
    loaded = resumption.loaded
    resumption.pending = None
    if outcome.lost is None:
        loaded.optimizer, loaded.scheduler, loaded.scaler = outcome.optimizer, outcome.scheduler, outcome.scaler
        return
    loaded.optimizer = loaded.scaler = None
    loaded.scheduler = outcome.scheduler
    resumption.degraded = True
    msg = optimizer_lost_message(loaded.info.step, outcome.lost)
    loaded.warnings.append(msg)
    logger.warning(msg)
    warnings.warn(msg, stacklevel=3)


def start_timeline(store: CheckpointStore, lineage: Lineage, *, after_step: int | None) -> list[int]:
    """Rank 0: make `lineage` the task's current timeline; checkpoints of other timelines past `after_step`
    (every one, for a fresh start) are set aside as abandoned: kept, never chosen by `auto`.

    Returns:
        `list[int]`: the steps newly abandoned (also named in one WARNING).
    """
    parent = lineage if lineage.parent_step is not None else None
    abandoned = store.fork(timeline=lineage.timeline, after_step=after_step, session=lineage.session, parent=parent)
    if abandoned:
        where = "the restore point" if after_step is not None else "this fresh start"
        what = (f"checkpoints {', '.join(map(str, abandoned))} belong" if len(abandoned) > 1
                else f"checkpoint {abandoned[0]} belongs")
        msg = (f"{what} to a run that went past {where} (step {after_step if after_step is not None else 0}); "
               "they are kept but abandoned: `auto`, `best` and `fastest` never choose them, "
               "`hf-dynamic-ckpt ls --all` lists them, `step:N` restores them, and retention removes them once "
               "this run has saved past them")
        logger.warning(msg)
        warnings.warn(msg, stacklevel=4)
    return abandoned

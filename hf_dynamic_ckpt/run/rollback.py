"""A rollback: the resume of a healthy restore point, applied to the live run instead of a new process.

`policy.rules.RollbackRule` confirms an anomaly; the orchestrator then picks the restore point
(`choose_restore_point`: rank 0's choice, broadcast, so every rank returns to the same step),
reads and verifies it like any resume (`resume.plan_resume`, agreed across ranks), puts the
weights, optimizer, scheduler, scaler and RNG back into the live objects (`restore_live`), and
applies the `Resumption` (the new timeline, the policy's statistics). What it did is a
`Rollback`, which the integration finishes with what only it knows: Trainer's step counter and
logging bookkeeping, a custom loop's data position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import distributed as dist
from ..constants import Tier
from ..state import apply_optimizer_state, apply_weights, restore_rng_state
from ..store import CheckpointStore, LoadedCheckpoint

NEEDED_TIERS = frozenset({Tier.WEIGHTS, Tier.OPTIMIZER, Tier.STATE})
"""A rollback restores all of them: a restore point missing one is not a candidate."""


@dataclass(frozen=True)
class Rollback:
    """What a rollback did.

    Attributes:
        from_step (`int`): the step the run had reached (its last update was not applied).
        to_step (`int`): the restore point: the run continues from its state.
        reason (`str`): the anomaly that was confirmed.
        rng (`dict`, *optional*): the restore point's RNG state, when the integration applies it itself
            (after the next batch is fetched, as a resume does); `None` when it was applied already.
        loaded (`LoadedCheckpoint`): the restore point as read.
    """

    from_step: int
    to_step: int
    reason: str
    rng: dict[str, Any] | None
    loaded: LoadedCheckpoint


def choose_restore_point(store: CheckpointStore, *, rank: int, world_size: int, before: int, earliest: int
                         ) -> int | None:
    """The newest healthy, committed, not abandoned checkpoint of the task with all tiers and a step in
    ``[earliest, before)``: rank 0 reads its store, every rank gets its answer (`None`: there is none)."""
    choice = None
    if rank == 0:
        candidates = [i.step for i in store.list() if earliest <= i.step < before and i.tiers >= NEEDED_TIERS]
        choice = max(candidates, default=None)
    return dist.broadcast_object(choice) if world_size > 1 else choice


def restore_live(loaded: LoadedCheckpoint, *, model: Any, optimizer: Any | None, scheduler: Any | None,
                 scaler: Any | None, rng: bool, weights_applied: bool = False) -> None:
    """Put a restore point back into the live objects, in place: weights (unless `weights_applied`, e.g. read
    by DCP already), optimizer, scheduler, scaler, and the RNG when `rng`."""
    if not weights_applied and loaded.weights is not None:
        apply_weights(model, loaded.weights)
    apply_optimizer_state(loaded, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    if rng and loaded.rng is not None:
        restore_rng_state(loaded.rng)

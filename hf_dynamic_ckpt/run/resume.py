"""A resume: choose a restore point, verify it, load it tier by tier with fallback, and plan it into a `Resumption`
(read, nothing applied: `RunOrchestrator.apply` makes it the run's state; a rollback applies one to the live run).

A broken tier falls back per `config.FallbackStrategy` (docs/policy.md, `fallback_strategy`): broken weights: the next
older checkpoint; a broken optimizer tier: weights only with ``full`` (the scheduler salvaged when it can be), the next
older checkpoint with ``level_0_1``; broken RNG / data-loader state: fresh streams in one process, not usable under
several ranks. Every warning is logged and kept in `LoadedCheckpoint.warnings`. The optimizer tier may be read in a
background thread (`PendingOptimizerRead`) until `RunOrchestrator.complete_resume`.

Under several ranks every outcome is one agreed value: each rank evaluates the candidates itself, the findings are
exchanged in one JSON all-gather, and every rank applies the same rule to the same table (the newest candidate usable
on every rank; the optimizer tier only if every rank read it; an error on any rank raised, with the same message, on
every rank). No rank can continue while another raises or waits.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import distributed as dist
from ..config import FallbackStrategy
from ..constants import Tier
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    DynamicCkptError,
    FormatVersionError,
    IncompatibleStateError,
    fault,
    weights_overwritten,
)
from ..sharded import check_sharding
from ..state import check_weights, state_numel_bound
from ..store import STATUS_CORRUPT, STATUS_OK, CheckpointInfo, Lineage, LoadedCheckpoint, check_frozen, new_session_id
from ..store.manifest import is_sharded
from ..store.shard_files import sharded_table

if TYPE_CHECKING:
    from ..store import CheckpointStore

logger = logging.getLogger(__name__)

KEY_POLICY = "policy"
KEY_GRAD_PROBE = "grad_probe"
KEY_SAVE_LOG = "save_log"
KEY_ROLLBACKS = "rollbacks"
RUN_STATE = (KEY_POLICY, KEY_GRAD_PROBE, KEY_SAVE_LOG, KEY_ROLLBACKS)  # keys of a manifest's `extra`: the run's state

Ref = str | int | os.PathLike[str] | CheckpointInfo

_ERRORS: dict[str, type[DynamicCkptError]] = {
    cls.__name__: cls for cls in (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError,
                                  IncompatibleStateError, DistributedError, DynamicCkptError)
}


# ---------------------------------------------------------------------- one candidate, one rank
@dataclass
class _Outcome:
    """What one rank found when it tried one checkpoint (JSON-able through `to_dict`)."""

    step: int
    usable: bool
    reason: str | None = None  # why not usable
    optimizer_lost: str | None = None  # why L1 is lost (weights-only resume), None: loaded or not asked
    scheduler_salvaged: bool = False
    loaded: LoadedCheckpoint | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "loaded"}


@dataclass
class _Into:
    """The model's own tensors a resume reads the weights file into, hashing as it reads (one pass)."""

    targets: Mapping[str, Any]
    step: int | None = None  # whose verified weights the targets hold
    touched: bool = False  # some read wrote into them

    def read(self, store: CheckpointStore, loaded: LoadedCheckpoint) -> None:
        """Read `loaded`'s weights file into the targets, verified; `loaded.weights` then names them (a
        `CorruptCheckpointError` leaves `step` `None` if a byte was written)."""
        assert loaded.weights is not None

        def writing() -> None:
            self.step, self.touched = None, True

        keys = store.read_weights_into(loaded, self.targets, verify=True, on_write=writing)
        self.step = loaded.info.step
        loaded.weights.update((key, self.targets[key]) for key in keys)


def _evaluate(store: CheckpointStore, info: CheckpointInfo, *, rank: int, world_size: int,
              fallback: FallbackStrategy, mmap: bool, expected: Mapping[str, Any] | None,
              into: _Into | None = None) -> _Outcome:
    """Try one checkpoint on this rank: weights (+ model check; with `into`, read into the model as they are
    verified), optimizer per `fallback`, own L2."""
    step = info.step
    try:  # a FormatVersionError propagates, and so does an IncompatibleStateError: not a reason to fall back
        loaded = store.load(info, tiers={Tier.WEIGHTS}, rank=rank, mmap=mmap, weights_checksum=into is None)
        if loaded.weights is None:
            return _Outcome(step, False, f"step {step} holds no weights")
        table = sharded_table(loaded.manifest) if is_sharded(loaded.manifest) else None
        if expected is not None:  # FSDP2 / ZeRO <-> unsharded: refused before any fork
            check_sharding(step, loaded.manifest, expected)
            check_frozen(loaded, expected)  # weights not written: the model's own, checked against their records
            try:
                check_weights(loaded.weights, expected)
            except IncompatibleStateError:
                if into is None or table is not None:
                    raise
                # The names and shapes came from a header not yet hashed: a damaged one is a corrupt checkpoint (a
                # fallback), not a model that does not fit. Its checksum, on this path only, decides which.
                store.load(info, tiers={Tier.WEIGHTS}, rank=rank, mmap=True)
                raise
        if into is not None and table is None:  # the file's checksum: only now, as it is read into the model
            into.read(store, loaded)
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:
        return _Outcome(step, False, f"weights of step {step} cannot be loaded ({e})")
    outcome = _Outcome(step, True, loaded=loaded)
    if fallback != FallbackStrategy.LEVEL_0_ONLY:
        bound = state_numel_bound(expected.values()) if expected is not None else None
        opt = read_optimizer_tier(store, info, rank, bound, mmap=True)
        loaded.optimizer, loaded.scheduler, loaded.scaler = opt.optimizer, opt.scheduler, opt.scaler
        if opt.lost is not None:
            if fallback == FallbackStrategy.LEVEL_0_1:
                return _Outcome(step, False, f"optimizer state of step {step} cannot be loaded ({opt.lost}); "
                                             "fallback_strategy=level_0_1 requires it,")
            outcome.optimizer_lost = opt.lost
            outcome.scheduler_salvaged = opt.scheduler is not None
    # A rank the checkpoint had not (a resume on more processes) continues rank 0's random streams and data
    # position: ranks seeded alike hold the same streams, as those of an uninterrupted run on this many would.
    own = rank if rank < info.world_size else 0
    try:
        state = store.load(info, tiers={Tier.STATE}, rank=own, mmap=mmap)
    except CorruptCheckpointError as e:
        if world_size > 1:  # every rank must continue its own random streams, or none is exact
            return _Outcome(step, False, f"rank {rank}'s RNG / data-loader state of step {step} cannot be "
                                         f"loaded ({e})")
        loaded.warnings.append(f"RNG and data-loader state of step {step} cannot be loaded ({e}); "
                               "random streams and the data order start fresh")
    else:
        loaded.rng, loaded.sampler = state.rng, state.sampler
        loaded.warnings.extend(w for w in state.warnings if w not in loaded.warnings)
    return outcome


@dataclass(frozen=True)
class OptimizerOutcome:
    """The optimizer tier of a checkpoint once read: the state dicts, or why they are lost."""

    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    lost: str | None = None


def read_optimizer_tier(store: CheckpointStore, info: CheckpointInfo, rank: int, max_numel: int | None, *,
                        mmap: bool = False) -> OptimizerOutcome:
    """The optimizer tier of `info` on this rank (`CheckpointStore.load` retries a failed read once); never raises
    for a damaged or foreign tier (`lost` says why; the scheduler is salvaged when it can be). A tensor above
    `max_numel` (`state.state_numel_bound`) is refused before it is allocated. `mmap=False` copies an uncompressed
    tier now (the background read: mapped, the first update would fault per page on the training thread)."""
    if Tier.OPTIMIZER not in info.tiers:
        return OptimizerOutcome(None, None, None, lost="the checkpoint was saved without it")
    try:
        opt = store.load(info, tiers={Tier.OPTIMIZER}, rank=rank, mmap=mmap, l1_max_numel=max_numel)
    except (CorruptCheckpointError, IncompatibleStateError) as e:  # damaged, or larger than the model allows
        lost = str(e)  # the message only: the exception's frames may hold what the failed read decoded
    else:
        return OptimizerOutcome(opt.optimizer, opt.scheduler, opt.scaler)
    return OptimizerOutcome(None, store.load_scheduler_only(info), None, lost=lost)


def _lose_optimizer(loaded: LoadedCheckpoint, lost_on: list[tuple[int, str]], world_size: int, *,
                    scheduler: bool) -> str:
    """Drop `loaded`'s optimizer state, lost on the ranks of `lost_on` (rank, why), its scheduler too unless every
    rank salvaged it (`scheduler`); returns the warning of a weights-only resume."""
    loaded.optimizer = loaded.scaler = None
    loaded.scheduler = loaded.scheduler if scheduler else None
    (rank, why), step = lost_on[0], loaded.info.step
    why += "" if world_size == 1 else f" (rank {rank})" if len(lost_on) < world_size else " (every rank)"
    return (f"resuming from weights only: optimizer state of step {step} is lost ({why}); "
            f"the learning-rate schedule continues at step {step}")


def _candidates(store: CheckpointStore, ref: Ref) -> list[CheckpointInfo]:
    """The resolved checkpoint, then every older usable one of the task (newest first). For ``auto``, newer ones
    whose manifest cannot be read come first, so the resume says why it fell back (and a newer format stops it)."""
    first = store.resolve(ref)
    newer: list[CheckpointInfo] = []
    older: list[CheckpointInfo] = []
    if first.task_id == store.task_id:
        listed = store.list(include_unhealthy=True)
        older = [i for i in listed if i.step < first.step and i.healthy and i.status == STATUS_OK
                 and Tier.WEIGHTS in i.tiers]
        if ref == "auto":
            newer = [i for i in listed if i.step > first.step and i.status == STATUS_CORRUPT and not i.tiers]
    return [*sorted(newer, key=lambda i: i.step, reverse=True), first, *older]


# ---------------------------------------------------------------------- every rank, agreed
class PendingOptimizerRead:
    """The optimizer tier of `info` (this rank's files), read in a background thread until `Resumption.complete`."""

    def __init__(self, store: CheckpointStore, info: CheckpointInfo, *, rank: int, max_numel: int | None) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="smart-ckpt-l1")
        self.future: Future[OptimizerOutcome] = self._pool.submit(read_optimizer_tier, store, info, rank, max_numel)

    def close(self) -> None:
        """Wait for the thread and release it (idempotent)."""
        self._pool.shutdown(wait=True)


@dataclass
class Resumption:
    """What a resume hands the run: read and verified, nothing applied yet. `loaded`: this rank's view of the
    restore point; `lineage`: the timeline the run continues on; `degraded`: the optimizer state is not restored;
    `state`: the run's own state at the restore point by `RUN_STATE` key (the manifest's `extra`; `None`: not
    saved); `pending`: the optimizer tier, still being read."""

    loaded: LoadedCheckpoint
    ref: str
    lineage: Lineage
    degraded: bool = False
    state: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    pending: PendingOptimizerRead | None = field(default=None, repr=False)
    elapsed_ms: float = 0.0

    @property
    def step(self) -> int:
        """The step of the restore point."""
        return self.loaded.info.step

    def complete(self, world_size: int) -> None:
        """Wait for the `pending` optimizer-tier read and put it into `loaded`: a loss on any rank is a loss on every
        rank (one all-gather when `world_size > 1`), recorded, warned about, and the resumption `degraded`."""
        assert self.pending is not None
        try:
            mine = self.pending.future.result()
        finally:
            self.pending.close()
        report = {"lost": mine.lost, "scheduler": mine.scheduler is not None}
        reports = dist.all_gather_json(report) if world_size > 1 else [report]
        lost_on = [(r, o["lost"]) for r, o in enumerate(reports) if o["lost"] is not None]
        loaded, self.pending = self.loaded, None
        loaded.optimizer, loaded.scheduler, loaded.scaler = mine.optimizer, mine.scheduler, mine.scaler
        if not lost_on:
            return
        self.degraded = True
        msg = _lose_optimizer(loaded, lost_on, world_size, scheduler=all(o["scheduler"] for o in reports))
        loaded.warnings.append(msg)
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)


def plan_resume(
    store: CheckpointStore,
    ref: Ref,
    *,
    session_id: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    fallback: FallbackStrategy | str = FallbackStrategy.FULL,
    expected: Mapping[str, Any] | None = None,
    mmap: bool = True,
    background_optimizer: bool = False,
    into: Mapping[str, Any] | None = None,
) -> Resumption | None:
    """Choose, verify and load the restore point on every rank (a collective: every rank passes the same `ref`:
    ``auto``, ``best``, ``fastest``, ``step:N`` or a checkpoint path) into a `Resumption`; `None` when `ref` is
    ``auto`` and the store holds no checkpoint (a fresh start, decided by rank 0). Errors are raised alike on every
    rank. `expected`: the model's L0 mapping, which the saved weights must fit (it bounds the optimizer tier's
    tensors); `background_optimizer` (``full`` only): `Resumption.pending`; `into`: the model's own tensors by
    weight name, read into and hashed in one pass (a candidate failing its checksum leaves its bytes there until an
    older one is read over them, and an error then says the model's weights were overwritten).
    """
    start = time.perf_counter()
    fallback = FallbackStrategy(fallback)
    deferred = background_optimizer and fallback == FallbackStrategy.FULL
    target = _Into(into) if into else None
    try:
        agreed = _agree(store, ref, rank=rank, world_size=world_size,
                        fallback=FallbackStrategy.LEVEL_0_ONLY if deferred else fallback, expected=expected, mmap=mmap,
                        into=target)
    except DynamicCkptError as e:
        if target is None or not target.touched:
            raise
        held = "the bytes of a checkpoint that failed its checksum" if target.step is None \
            else f"the weights of step {target.step}"
        raise type(e)(f"{e}{weights_overwritten(held)}") from None
    if agreed is None:
        return None
    loaded, degraded = agreed
    parent = loaded.info.lineage
    lineage = Lineage(session=session_id or new_session_id(), timeline=new_session_id(),
                      parent_step=loaded.info.step, parent_timeline=parent.timeline if parent is not None else None)
    pending = None
    if deferred:
        # Only once the restore point is chosen: a read racing the choice could record the checkpoint's corrupt
        # L1 in the catalog first and turn a weights-only resume into a fallback.
        bound = state_numel_bound(expected.values()) if expected is not None else None
        pending = PendingOptimizerRead(store, loaded.info, rank=rank, max_numel=bound)
    state = {k: v if isinstance(v, dict) and v else None for k, v in ((k, loaded.extra.get(k)) for k in RUN_STATE)}
    return Resumption(loaded=loaded, ref=str(ref), lineage=lineage, degraded=degraded and not deferred, state=state,
                      pending=pending, elapsed_ms=(time.perf_counter() - start) * 1e3)


def _agree(store: CheckpointStore, ref: Ref, *, rank: int, world_size: int, fallback: FallbackStrategy,
           expected: Mapping[str, Any] | None, mmap: bool,
           into: _Into | None = None) -> tuple[LoadedCheckpoint, bool] | None:
    """The agreed restore point: (this rank's loaded state, degraded), or `None` for a fresh start. Each
    rank tries the candidates (`_evaluate`), one JSON all-gather shares the findings, every rank picks the newest
    candidate usable on all ranks; one a rank has not tried yet (it stopped at an older one) takes another round."""
    evaluated: dict[int, _Outcome] = {}
    infos: dict[int, CheckpointInfo] = {}
    reference: list[int] | None = None  # the candidates as rank 0 listed them, once shared
    pending: int | None = None
    while True:
        report: dict[str, Any] = {"fresh": False, "candidates": reference or [], "error": None, "results": []}
        todo: list[CheckpointInfo] = []
        for listing in (True, False):
            if not listing and reference is None and world_size > 1:
                # Every rank lists before any evaluates: a failed read records the checkpoint as corrupt in the
                # catalog, and rank 0's list (the reference) must not depend on how far another rank got.
                dist.barrier()
            try:
                if not listing:
                    _evaluate_until_usable(store, todo, evaluated, rank=rank, world_size=world_size,
                                           fallback=fallback, mmap=mmap, expected=expected, into=into)
                elif reference is None:
                    fault("resume", rank=rank)
                    todo = _candidates(store, ref)
                    infos = {i.step: i for i in todo}
                    report["candidates"] = [i.step for i in todo]
                else:  # some rank has not tried `pending` yet: everyone evaluates from there on (a rare second round)
                    todo = [infos.get(s) or store.resolve(f"step:{s}")
                            for s in reference[reference.index(pending or 0):]]
            except DynamicCkptError as e:
                if reference is None and isinstance(e, CheckpointNotFoundError) and ref == "auto" \
                        and not store.list(include_unhealthy=True):
                    report["fresh"] = True
                else:
                    name = type(e).__name__ if type(e).__name__ in _ERRORS else DynamicCkptError.__name__
                    report["error"] = {"type": name, "message": str(e)}
        report["results"] = [o.to_dict() for o in evaluated.values()]
        reports = dist.all_gather_json(report) if world_size > 1 else [report]
        if reports[0]["fresh"]:
            return None
        for r, err in ((r, o["error"]) for r, o in enumerate(reports) if o.get("error")):  # any rank's, on every rank
            raise _ERRORS.get(err["type"], DynamicCkptError)(("" if r == 0 else f"rank {r}: ") + err["message"])
        reference = reports[0]["candidates"]
        results = [{int(o["step"]): o for o in r["results"]} for r in reports]
        chosen, pending, skipped = _choose(reference, results)
        if chosen is not None:
            break
        if pending is None:
            raise _none_usable(reference, results, store)
    loaded = evaluated[chosen].loaded
    assert loaded is not None
    # Every rank ends a round holding the weights of the last candidate it found usable (`_evaluate_until_usable`),
    # and the choice is one of them.
    assert into is None or not into.touched or into.step == chosen or is_sharded(loaded.manifest)
    row = [r[chosen] for r in results]
    lost = [(i, o["optimizer_lost"]) for i, o in enumerate(row) if o["optimizer_lost"] is not None]
    # Weights only: degraded when the checkpoint held an optimizer state that is not restored.
    degraded = bool(lost) or (fallback == FallbackStrategy.LEVEL_0_ONLY and Tier.OPTIMIZER in loaded.info.tiers)
    if lost:
        loaded.warnings.insert(0, _lose_optimizer(loaded, lost, world_size,
                                                  scheduler=all(o["scheduler_salvaged"] for o in row)))
    notes = [f"{r}{' ' if r.endswith(',') else '; '}falling back to the next older checkpoint"
             for r in (_skip_reason(results, s) for s in skipped)]
    if notes:
        notes[-1] += f": using step {chosen} instead"
        loaded.warnings[:0] = notes
    for message in loaded.warnings:
        logger.warning("resume: %s", message)
    return loaded, degraded


def _evaluate_until_usable(store: CheckpointStore, candidates: list[CheckpointInfo], evaluated: dict[int, _Outcome],
                           **kwargs: Any) -> None:
    """Try `candidates` in order (reusing earlier results) until one is usable on this rank. With `into`, the
    targets then hold its weights (an earlier result is read again if a newer candidate was read over them)."""
    into: _Into | None = kwargs.get("into")
    for info in candidates:
        outcome = evaluated.get(info.step)
        if outcome is None:
            outcome = evaluated[info.step] = _evaluate(store, info, **kwargs)
        elif outcome.usable and into is not None and into.touched and into.step != info.step \
                and outcome.loaded is not None and not is_sharded(outcome.loaded.manifest):
            try:
                into.read(store, outcome.loaded)
            except CorruptCheckpointError as e:
                outcome = evaluated[info.step] = _Outcome(info.step, False,
                                                          f"weights of step {info.step} cannot be loaded ({e})")
        if outcome.usable:
            return


def _choose(reference: list[int], results: list[dict[int, dict[str, Any]]]) -> tuple[int | None, int | None, list[int]]:
    """(chosen step, step some rank still has to try, steps skipped) from the ranks' result tables."""
    skipped: list[int] = []
    for step in reference:
        row = [r.get(step) for r in results]
        if any(o is None for o in row):
            return None, step, skipped
        if all(o["usable"] for o in row):  # type: ignore[index]
            return step, None, skipped
        skipped.append(step)
    return None, None, skipped


def _skip_reason(results: list[dict[int, dict[str, Any]]], step: int) -> str:
    for rank, r in enumerate(results):
        o = r.get(step)
        if o is not None and not o["usable"]:
            if len(results) == 1:
                return str(o["reason"])
            return f"step {step} is not complete on every rank: rank {rank}: {o['reason']}"
    return f"step {step} is not usable"


def _none_usable(reference: list[int], results: list[dict[int, dict[str, Any]]],
                 store: CheckpointStore) -> DynamicCkptError:
    reasons = "; ".join(_skip_reason(results, s) for s in reference)
    tried = ", ".join(map(str, reference))
    if len(results) > 1:
        return DistributedError(
            f"resume: none of the checkpoints {reference} is usable on all {len(results)} ranks ({reasons}); "
            "start fresh (no resume) or restore the missing rng-rank<R>.json files."
        )
    return CheckpointNotFoundError(
        f"no loadable checkpoint at or below step {reference[0]} of task {store.task_id!r} (tried steps {tried}): "
        f"{reasons}. Run `hf-dynamic-ckpt verify` on the store, or start fresh."
    )

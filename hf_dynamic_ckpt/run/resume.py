"""The checkpointer's side of a resume: plan, new timeline, restored statistics, background L1.

`restore.plan_resume` chooses and loads the restore point (agreed on every rank). This module
does what follows, for `Checkpointer.resume`: it starts the run's new timeline from that point
(rank 0 records it with `CheckpointStore.fork`: checkpoints of the run that went past it become
abandoned, never deleted), restores the policy's and probes' statistics so the resumed run
decides as the interrupted one would have, and optionally reads the optimizer tier in a
background thread while the caller builds its optimizer (`complete`, agreed across ranks).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .. import distributed as dist
from ..config import FallbackStrategy
from ..constants import Tier
from ..errors import CorruptCheckpointError, IncompatibleStateError
from ..state.optimizer import state_numel_bound
from ..store.spec import Lineage, new_session_id
from ..store.types import CheckpointInfo, LoadedCheckpoint
from .restore import plan_resume

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

logger = logging.getLogger(__name__)

_L1 = tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None, str | None]


class ResumeState:
    """Resume bookkeeping of one `Checkpointer` (see the module docstring)."""

    def __init__(self, ck: Checkpointer) -> None:
        self.ck = ck
        self.resumed: LoadedCheckpoint | None = None
        self.resume_ms: float | None = None
        self._policy: dict[str, Any] | None = None
        self._probe: dict[str, Any] | None = None
        self._counts: dict[str, Any] | None = None
        self._l1: Future[_L1] | None = None
        self._l1_bound: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._after_read: list[Callable[[], Any]] = []

    @property
    def reading(self) -> bool:
        """Whether an optimizer-tier read runs in the background (until `complete`)."""
        return self._l1 is not None

    def after_read(self, fn: Callable[[], Any]) -> None:
        """Run `fn` once the background optimizer-tier read is collected by `complete` (at once if none runs).

        For work that would compete with the read for the CPU on the way to the first resumed
        step (the save engine's buffer preparation), not for work the resume needs.
        """
        if self._l1 is None:
            fn()
        else:
            self._after_read.append(fn)

    # ------------------------------------------------------------------ resume
    def resume(self, spec: str | None, *, background_optimizer: bool, expected: Mapping[str, Any] | None
               ) -> LoadedCheckpoint | None:
        """`Checkpointer.resume`.

        Args:
            spec (`str`, *optional*): `auto`, `best`, `fastest`, `step:N` or a path; `None`
                means a fresh start.
            background_optimizer (`bool`): with the `full` fallback strategy, read the optimizer
                tier (L1) in a background thread; `complete(loaded)` waits for it (agreed across ranks).
            expected (`Mapping[str, Tensor]`, *optional*): the model's L0 mapping; the saved weights
                must fit it (names and shapes) on every rank.

        Returns:
            `LoadedCheckpoint | None`: this rank's view (its own RNG), or `None` for a fresh
            start (`auto` on an empty store).

        Raises:
            The same error on every rank: `CheckpointNotFoundError`, `IncompatibleStateError`,
            `FormatVersionError`, `DistributedError`.
        """
        ck = self.ck
        if spec is None:
            return None
        start = time.perf_counter()
        deferred = background_optimizer and ck.config.fallback_strategy == FallbackStrategy.FULL
        fallback = FallbackStrategy.LEVEL_0_ONLY if deferred else ck.config.fallback_strategy
        plan = plan_resume(ck.store, spec, rank=ck.rank, world_size=ck.world_size, fallback=fallback,
                           expected=expected)
        if plan is None:
            return None
        loaded = plan.loaded
        info = loaded.info
        parent = info.lineage
        ck.lineage = Lineage(session=ck.session_id, timeline=new_session_id(), parent_step=info.step,
                             parent_timeline=parent.timeline if parent is not None else None)
        # Verified and checked against the model on every rank: now the newer checkpoints may be set aside.
        ck._fork_pending = False
        if ck.rank == 0:
            self.fork(after_step=info.step)
        self.remember_policy_state(loaded)
        self.apply_policy_state()
        ck.log_event("resume", step=info.step, spec=str(spec), warnings=list(loaded.warnings),
                     tiers=sorted(t.value for t in loaded.tiers))
        if deferred:
            self._l1_bound = state_numel_bound(expected.values()) if expected is not None else None
            # Only once the plan chose the restore point: a read racing `plan_resume` could record the
            # checkpoint's corrupt L1 in the catalog first and turn a weights-only resume into a fallback.
            self._l1 = self._submit_read(info)
        self.resumed = loaded
        self.resume_ms = (time.perf_counter() - start) * 1e3
        if not deferred:  # else once the optimizer tier is read (complete)
            self._announce(loaded, degraded=plan.degraded)
        if self.resume_ms > ck.config.recovery_timeout_ms:
            logger.warning("resume of step %d took %.0f ms, above recovery_timeout_ms=%d (the restore point's "
                           "estimate was %s ms); `fastest` picks the cheapest checkpoint to restore", info.step,
                           self.resume_ms, ck.config.recovery_timeout_ms, info.recovery_cost_ms)
        return loaded

    def restart(self, step: int) -> None:
        """`Checkpointer.restart_timeline`: a new timeline from `step`, the policy from the restored statistics."""
        from ..policy.rules import RulePolicy

        ck = self.ck
        resumed = self.resumed
        parent = resumed.info.step if resumed is not None and resumed.info.step == step else None
        ck.lineage = Lineage(session=ck.session_id, timeline=new_session_id(), parent_step=parent,
                             parent_timeline=ck.lineage.parent_timeline if parent is not None else None)
        ck._fork_pending = True
        ck.saver.log.restart()
        ck.policy = RulePolicy(ck.config)
        self.apply_policy_state(again=True)
        logger.debug("training restarted at step %d: new timeline %s", step, ck.lineage.timeline)

    def _announce(self, loaded: LoadedCheckpoint, *, degraded: bool) -> None:
        """The one `resumed from` line (WARNING, rank 0): step, reason, tiers, degraded or not."""
        if self.ck.rank == 0:
            self.ck.saver.announce.warning(
                "smart_ckpt: resumed from step %d (%s; tiers %s%s)", loaded.info.step, loaded.info.reason,
                ",".join(sorted(t.value for t in loaded.tiers)), "; degraded: fresh optimizer" if degraded else "")

    def fork(self, *, after_step: int | None) -> list[int]:
        """Rank 0: start this run's timeline; checkpoints of other timelines past `after_step` are abandoned."""
        ck = self.ck
        fork = getattr(ck.store, "fork", None)
        if fork is None:  # TODO(merge): the store branch adds CheckpointStore.fork
            return []
        parent = None
        if ck.lineage.parent_step is not None:
            parent = ck.lineage
        abandoned: list[int] = fork(timeline=ck.lineage.timeline, after_step=after_step, session=ck.session_id,
                                    parent=parent)
        if abandoned:
            where = "the restore point" if after_step is not None else "this fresh start"
            what = (f"checkpoints {', '.join(map(str, abandoned))} belong" if len(abandoned) > 1
                    else f"checkpoint {abandoned[0]} belongs")
            msg = (f"{what} to a run that went past {where} "
                   f"(step {after_step if after_step is not None else 0}); they are kept but abandoned: `auto`, "
                   "`best` and `fastest` never choose them, `hf-dynamic-ckpt ls --all` lists them, `step:N` restores "
                   "them, and retention removes them once this run has saved past them")
            logger.warning(msg)
            warnings.warn(msg, stacklevel=4)
        return abandoned

    # ------------------------------------------------------------------ statistics
    def remember_policy_state(self, loaded: LoadedCheckpoint) -> None:
        self._policy = loaded.extra.get("policy") or None
        self._probe = loaded.extra.get("grad_probe") or None
        counts = loaded.extra.get("save_log")
        self._counts = counts if isinstance(counts, dict) else None

    def apply_policy_state(self, *, again: bool = False) -> None:
        """Load the remembered statistics: the policy at once, the gradient probe once attached.

        `again`: after a restart of the loop, load the resumed checkpoint's statistics once more.
        """
        ck = self.ck
        if again and self.resumed is not None:
            self.remember_policy_state(self.resumed)
        if self._counts is not None:
            ck.saver.log.continue_counts(self._counts)
            self._counts = None
        if self._policy is not None:
            state, self._policy = self._policy, None
            try:
                ck.policy.load_state_dict(state)
            except Exception as e:
                logger.warning("resume: policy statistics not restored (%s); they restart from scratch", e)
        grad = ck.sensors.grad if ck.sensors is not None else None
        if self._probe is not None and grad is not None:
            probe, self._probe = self._probe, None
            try:
                grad.load_state_dict(probe)
            except Exception as e:
                logger.warning("resume: gradient-probe statistics not restored (%s); they restart from scratch", e)

    # ------------------------------------------------------------------ background L1
    def _submit_read(self, info: CheckpointInfo) -> Future[_L1]:
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="smart-ckpt-l1")
        return self._pool.submit(self._read_l1, info)

    def _read_l1(self, info: CheckpointInfo) -> _L1:
        """(optimizer, scheduler, scaler, why-lost) of one checkpoint; runs in a background thread."""
        store = self.ck.store
        if Tier.OPTIMIZER not in info.tiers:
            return None, None, None, "the checkpoint was saved without it"
        # mmap=False: an uncompressed tier is copied here, off the training thread; mapped, the
        # first update would take a copy-on-write fault per page of the moments it writes.
        bound = self._l1_bound
        try:
            opt = store.load(info, tiers={Tier.OPTIMIZER}, rank=self.ck.rank, mmap=False, l1_max_numel=bound)
        except IncompatibleStateError as e:  # declared larger than the model allows: nothing was allocated
            return None, store.load_scheduler_only(info), None, str(e)
        except CorruptCheckpointError as first:
            try:  # a transient read error
                opt = store.load(info, tiers={Tier.OPTIMIZER}, rank=self.ck.rank, mmap=False, l1_max_numel=bound)
            except (CorruptCheckpointError, IncompatibleStateError):
                return None, store.load_scheduler_only(info), None, str(first)
        return opt.optimizer, opt.scheduler, opt.scaler, None

    def complete(self, loaded: LoadedCheckpoint) -> None:
        """Fill in the background L1 read; the outcome is agreed (a loss on any rank is a loss on all)."""
        future, self._l1 = self._l1, None
        if future is None:
            return
        try:
            optimizer, scheduler, scaler, lost = future.result()
        finally:
            deferred, self._after_read = self._after_read, []
            for fn in deferred:
                try:
                    fn()
                except Exception as e:  # only a speed-up is lost: the first save allocates its buffers
                    logger.warning("resume: deferred work after the optimizer-tier read failed: %s", e)
        ck = self.ck
        outcomes = dist.all_gather_json({"lost": lost, "scheduler": scheduler is not None}) \
            if ck.world_size > 1 else [{"lost": lost, "scheduler": scheduler is not None}]
        lost_on = [(r, o["lost"]) for r, o in enumerate(outcomes) if o["lost"] is not None]
        if not lost_on:
            loaded.optimizer, loaded.scheduler, loaded.scaler = optimizer, scheduler, scaler
            self._announce(loaded, degraded=False)
            return
        rank, why = lost_on[0]
        loaded.optimizer = loaded.scaler = None
        loaded.scheduler = scheduler if all(o["scheduler"] for o in outcomes) else None
        where = "" if ck.world_size == 1 else (f" (rank {rank})" if len(lost_on) < ck.world_size else " (every rank)")
        step = loaded.info.step
        msg = (f"resuming from weights only: optimizer state of step {step} is lost ({why}{where}); "
               f"the learning-rate schedule continues at step {step}")
        loaded.warnings.append(msg)
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)
        self._announce(loaded, degraded=True)

    def close(self) -> None:
        self._after_read = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

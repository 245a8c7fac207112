"""The save side's parts that `RunOrchestrator` (which owns the save path) keeps: the held save (`HeldSave`), the
run's store (`open_run_store`), the memory tier (`MemoryTier`) and a killed run's slots (`SlotRecovery`).
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..errors import DistributedError, DynamicCkptError
from ..signals import Decision, SignalFrame
from ..state import RawRngState
from ..store import CheckpointStore
from ..store import slots as slot_store

logger = logging.getLogger(__name__)


@dataclass
class HeldSave:
    """A save decided at `step_end` whose write waits for `RunOrchestrator.release()` (the step's logging)."""

    decision: Decision
    step: int
    epoch: float
    rng: dict[str, Any] | RawRngState | None
    frame: SignalFrame
    rng_at_step_begin: bool = False
    memory: bool = False  # into a memory slot (no disk save this step)


class SlotRecovery:
    """A killed run's memory slots newer than the disk store (found by rank 0 when a restart opens its store): `auto`'s
    restore point (`RunOrchestrator._plan`), persisted to disk (`persist`, never twice) before the tier's next slot
    could replace them or the task's timeline move past them."""

    def __init__(self, disk: CheckpointStore, slots: CheckpointStore, step: int, *, persists: bool = True) -> None:
        self.disk, self.slots, self.step = disk, slots, step
        self._thread: threading.Thread | None = None
        # `persisted`: tried (the memory tier writes no slot until then); rank 0 persists every rank's parts
        self.persisted, self._persists = not persists, persists
        self.offered = False  # offered to a resume, or the timeline moved on: `auto` reads the disk (every rank)

    @classmethod
    def find(cls, disk: CheckpointStore) -> SlotRecovery | None:
        """The recovery of `disk`'s task, or `None` (no slot newer than the disk store; nothing is written)."""
        try:
            slots = slot_store.open_slots(disk, read_only=True)
        except (OSError, DynamicCkptError) as e:
            logger.warning("memory tier: the slots of task %r cannot be read (%s); resuming from the disk store",
                           disk.task_id, e)
            return None
        if slots is not None:
            newer = slot_store.restore_point(slots, disk)
            if newer is not None and newer.world_size == disk.world_size:
                return cls(disk, slots, newer.step)
            if newer is not None:  # another world size: persisted now, resumed from disk (the elastic path)
                cls(disk, slots, newer.step).close()
            slots.close()
        return None

    def persist(self, *, background: bool = False) -> None:
        """Persist the slots newer than the disk store, in a thread with `background`, else now (waiting for a
        thread already started). Never raises: a slot that cannot be persisted is logged."""
        if self.persisted:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._persist, name="smart-ckpt-slot-persist", daemon=True)
            self._thread.start()
        if not background:
            self._thread.join()

    def _persist(self) -> None:
        try:
            step = slot_store.persist_newest(self.slots, self.disk)
            if step is not None:
                logger.info("memory tier: step %d, newer than the disk store, was persisted from host memory", step)
        except (OSError, DynamicCkptError) as e:
            logger.warning("memory tier: the newest slot could not be persisted (%s); it stays in host memory", e)
        finally:
            self.persisted = True

    def close(self, *, remove: bool = False) -> None:
        """Persist what is not yet (waiting for it), release the slots' reader; `remove` them (the tier is off)."""
        self.persist()
        self.slots.close()
        if remove and self._persists:
            slot_store.remove_slots(self.disk.root, self.disk.task_id)


def open_run_store(config: SmartCkptConfig, root: str | Path, *, rank: int, world_size: int,
                   session_id: str) -> tuple[CheckpointStore, SlotRecovery | None]:
    """This rank's store, and a killed run's slots to restore from. Under DDP rank 0 opens first (the catalog, the
    task's writer lock, the slots); its outcome, an error included, is what every rank acts on. No engine is started
    (`RunOrchestrator.engine`, at its first use): a resume only reads. A URL root (read-only here) has no slots."""

    def open_store() -> CheckpointStore:
        return CheckpointStore(root, task_id=config.task_id, rank=rank, world_size=world_size, session_id=session_id,
                               compression_level=config.storage_levels.level_1.compression_level,
                               compression=config.storage_levels.level_1.compression.value,
                               storage_options=config.remote.storage_options,
                               cache_dir=(Path(config.remote.cache_dir) / f"rank-{rank}"
                                          if config.remote.cache_dir else None),
                               retries=config.remote.retries, backoff_s=config.remote.backoff_s,
                               lock_wait_s=config.runtime.lock_wait_s)

    if world_size == 1:
        alone = open_store()
        return alone, SlotRecovery.find(alone) if not alone.read_only else None
    store, recovery, error = None, None, None
    if rank == 0:
        try:
            store = open_store()
            recovery = SlotRecovery.find(store) if not store.read_only else None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    error, step = dist.broadcast_object((error, recovery.step if recovery is not None else None))
    if error is not None:
        raise DistributedError(f"rank 0 could not open the store {root}: {error}")
    if store is None:
        store = open_store()
        if step is not None:  # every rank reads its part of the slot (one slot store per node)
            slots = slot_store.open_slots(store, read_only=True)
            if slots is None:
                raise DistributedError(f"rank {rank} does not see the memory slots rank 0 found under "
                                       f"{slot_store.SHM_DIR}: are the ranks on one node?")
            recovery = SlotRecovery(store, slots, step, persists=False)
    return store, recovery


# A slot's write still running when the next is due is waited for up to half a step (at most 1 s); a longer one (or
# a disk save in flight) skips that step's slot (`MemoryTier.skipped`).
MEMORY_WAIT_S, MEMORY_WAIT_SHARE = 1.0, 0.5
EARLY_BURST_S = 60.0  # early slots (before the writer is up) may spend this many seconds of overhead budget at once


def slot_cadence(blocking_ms: float, write_ms: float, step_ms: float, budget: float) -> int:
    """Every how many steps a slot is taken: the fewest whose training-thread time (`blocking_ms`: the snapshot and
    any wait for the previous slot's write) fits in `budget` of their time and whose write (`write_ms`, the writer
    process's) ends within two thirds of them, so the next slot rarely waits for it."""
    return max(1, math.ceil(max(blocking_ms / (max(budget, 1e-3) * step_ms), 1.5 * write_ms / step_ms)))


class MemoryTier:
    """The run's memory tier (`store/slots.py`, docs/memory_tier.md): on every rank or none (one slot store per node,
    the ranks agree on each slot in the step's frame), off with one INFO line where it cannot be. Every `every` steps
    (`slot_cadence`, or `runtime.memory_every`) a step's state goes to a slot (skipped, and counted, while the writer
    is busy); before the writer is up, small slots are written on the training thread (`write_early`)."""

    def __init__(self, config: SmartCkptConfig, store: CheckpointStore, *, world_size: int) -> None:
        self.config, self.store = config, store
        self.every = config.runtime.memory_every or 1
        self.saves = self.skipped = 0
        self.wait_ms = 0.0  # the training thread's wait for the previous slot's write (averaged)
        self.credit_ms = config.policy.overhead_budget * EARLY_BURST_S * 1e3  # time left for early slots
        self._credited: float | None = None
        self.bytes: int | None = None  # the size of the last slot written
        self.slots: CheckpointStore | None = None
        self.off_reason: str | None = None
        self.step_s: float | None = None  # seconds per step, measured between the steps it is asked about
        self._last_call: tuple[int, float] | None = None
        self.recovery: SlotRecovery | None = None  # a killed run's slots: no slot is written until they are persisted
        self._cleared = False
        if not config.runtime.memory_tier:
            self.off_reason = "runtime.memory_tier=false"
        elif str(getattr(config.engine, "value", config.engine)) != "process":
            self.off_reason = "engine='sync' writes on the training thread"
        elif slot_store.shm_room()[1] == 0:
            self.off_reason = f"no {slot_store.SHM_DIR}"
        if self.off_reason is None:
            try:
                self.slots = slot_store.open_slots(store, read_only=False)
            except Exception as e:
                self.off_reason = f"its slots cannot be created ({e})"
        self.world_size = world_size
        self._agreed: tuple[int, int, float] | None = None  # several ranks: the last frame's (step, cadence, blocked)
        if world_size > 1:  # on for every rank or for none; one slot store per node holds every rank's part
            views = dist.all_gather_json({"host": socket.gethostname(), "off": self.off_reason})
            hosts = {v["host"] for v in views}
            why = next((f"rank {r}: {v['off']}" for r, v in enumerate(views) if v["off"]), None)
            if why is None and len(hosts) > 1:
                why = (f"the {world_size} ranks run on {len(hosts)} nodes (this version keeps the slots of the ranks "
                       "of one node; docs/memory_tier.md)")
            if why is not None and self.off_reason is None:
                self.off_reason = why
                self.close(clean=False)
        if self.off_reason is not None and config.runtime.memory_tier:  # the sync engine: the user's own choice
            logger.log(logging.DEBUG if self.off_reason.startswith("engine=") else logging.INFO,
                       "memory tier off: %s; restore points are on disk only", self.off_reason)

    @property
    def on(self) -> bool:
        return self.slots is not None

    def agree(self, frame: SignalFrame) -> None:
        """Several ranks: take the reduced frame's cadence and verdict, so every rank writes its part of the same slots
        and the policy sees the same tier on every rank."""
        if self.world_size > 1 and frame.slot_every is not None and frame.slot_blocked is not None:
            self._agreed = (frame.step, max(1, int(frame.slot_every)), frame.slot_blocked)

    @property
    def cadence(self) -> int:
        """Every how many steps a slot is taken (several ranks: as last agreed)."""
        return self._agreed[1] if self._agreed is not None else self.every

    @property
    def agreed_on(self) -> bool:
        """Whether the tier is on (several ranks: on every rank, as the last frame says)."""
        if self.world_size == 1:
            return self.on
        return self.on and self._agreed is not None and self._agreed[2] < 2

    def due(self, step: int) -> bool:
        """Whether step `step`'s state goes to a slot (measures the step time as it goes). Several ranks: what they
        agreed in the step's frame, the same on every rank even where this rank's tier turned off since (it then
        writes nothing: `RunOrchestrator._save`)."""
        now = time.perf_counter()
        if self._last_call is not None and step > self._last_call[0]:
            per = (now - self._last_call[1]) / (step - self._last_call[0])
            self.step_s = per if self.step_s is None else 0.8 * self.step_s + 0.2 * per
        self._last_call = (step, now)
        if self.world_size > 1:
            return self._agreed is not None and self._agreed[0] == step and self._agreed[2] == 0 and \
                step % self._agreed[1] == 0
        return self.slots is not None and step % self.every == 0 and self.ready()

    def wait_for(self, handle: Any) -> None:
        """The bounded wait for the previous slot's write (`MEMORY_WAIT_S`), averaged into `wait_ms`."""
        waited = time.perf_counter()
        if not handle.done() and self.step_s:
            handle.join(min(MEMORY_WAIT_S, MEMORY_WAIT_SHARE * self.step_s))
        self.wait_ms = 0.5 * self.wait_ms + 0.5 * (time.perf_counter() - waited) * 1e3

    def ready(self) -> bool:
        """No killed run's slot is still to be persisted; the first time, the slots that are not this run's are
        removed (rank 0; persisted already, or of another run): a new slot must never be ranked below them."""
        if self.recovery is not None and not self.recovery.persisted:
            return False
        if not self._cleared:
            self._cleared = True
            if self.slots is not None and self.store.rank == 0:
                slot_store.keep_newest(self.slots, keep=0)
        return True

    def write_early(self) -> bool:
        """Before the writer process is up: whether this step's slot is written on the training thread (a slot of at
        most `EARLY_SLOT_MAX_BYTES`, the engine checks) while the budget's credit lasts (spent by `settle`, refilled
        here as time passes, never above `EARLY_BURST_S` of budget)."""
        budget, now = self.config.policy.overhead_budget, time.perf_counter()
        if self._credited is not None:
            self.credit_ms = min(budget * EARLY_BURST_S * 1e3, self.credit_ms + budget * (now - self._credited) * 1e3)
        self._credited = now
        return (self.bytes is None or self.bytes <= slot_store.EARLY_SLOT_MAX_BYTES) and self.credit_ms > 0

    def settle(self, handle: Any) -> None:
        """Learn from a finished slot write: its size fits or the tier goes off; its cost sets `every`."""
        if self.slots is None or not handle.done():
            return
        if handle.skipped:
            self.skipped += 1
            logger.debug("%s", handle.skipped)
            return
        error = handle.exception()
        if error is not None:  # no more slots: one line (WARNING if a write failed); the committed slots stay for a
            # restart unless they do not fit: checked before the first slot of a size was written (`room_problem`)
            fit = "do not fit" not in str(error)
            full = "No space left" in str(error) or getattr(error.__cause__, "errno", None) == errno.ENOSPC
            self.off_reason = f"writing a slot failed ({error})" if fit else str(error).split("SaveError: ", 1)[-1]
            logger.log(logging.WARNING if fit else logging.INFO, "memory tier off: %s; restore points are on disk "
                       "only%s", self.off_reason, f"; {slot_store.SHM_DIR} is too small: give the container more "
                       "(docker run --shm-size=..., or a Kubernetes emptyDir with medium: Memory mounted there)"
                       if full and fit else "")
            self.close(clean=full or not fit)
            return
        info = handle.wait(0)
        self.saves += 1
        if info is None:
            return
        self.bytes = info.bytes
        if handle.staging == "sync":  # written on the training thread: paid from the budget's credit
            self.credit_ms -= handle.blocking_ms
        if self.config.runtime.memory_every is None and handle.staging != "sync" and self.step_s:
            self.every = slot_cadence(handle.blocking_ms + self.wait_ms, handle.write_ms or 0.0, self.step_s * 1e3,
                                      self.config.policy.overhead_budget)

    def close(self, *, clean: bool) -> None:
        """Close the slots; a clean end (the final state on disk) removes them (rank 0: one store per node)."""
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.close()
        if clean and self.config.runtime.memory_tier and self.store.rank == 0:
            slot_store.remove_slots(self.store.root, self.store.task_id)

"""SaveEngine: snapshot on the training thread, write in the background.

Invariants:
- At most one save is in flight, so one set of snapshot buffers suffices: a snapshot only overwrites them after
  the previous write finished. A save that comes while one is writing follows `on_busy`: `"wait"` (default; the
  wait counts as blocking time, so the policy's overhead budget sees it) or `"skip"` (logged with its reason).
- Background errors never propagate into the training loop: they are logged, stored on the `SaveHandle`
  (`wait()` re-raises them as `SaveError`), and the previous committed checkpoint stays the restore point.
- The writer never runs collectives (the store's `save` runs none) and never calls back into the engine: the
  engine learns what a finished job taught (restore point, write throughput) on the training thread.
- Nothing of the save side runs before `start()` or the first save (a resume constructs none of it). A save that
  finds no writer process ready (starting, dead, none under a tight memory limit) writes synchronously.
- `close()` flushes and is idempotent; it also runs at interpreter exit, so an exception that ends the run still
  lets the last save finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .. import sysmem
from ..constants import Tier
from ..errors import ConfigError, SaveError, fault
from ..state import RawRngState, StateSources
from ..store import CheckpointInfo, CheckpointState, SaveRequest
from ..store.slots import EARLY_SLOT_MAX_BYTES, keep_newest, removed, room_problem, same_dir, tensor_bytes
from .snapshot import (
    Allocator,
    NoBufferError,
    Overlap,
    PendingCopy,
    Snapshotter,
    collect,
    direct,
    scopes,
    shared_storage,
)
from .writer import PROCESS_WRITER_MIN_BUDGET, Job, OnBusy, ProcessWriter, SaveHandle, run_job

logger = logging.getLogger(__name__)

MODES = ("process", "sync")
DEFAULT_THROUGHPUT = 100e6
"""Bytes/s assumed for the emergency-save estimate before any save was measured."""
MEMORY_ROOM_TTL_S = 1.0
"""A memory slot into buffers already held reuses a headroom read this recent (reading it costs ~0.7 ms)."""


def _skip(handle: SaveHandle, why: str, start: float) -> SaveHandle:
    handle.skipped, handle.blocking_ms = why, (time.perf_counter() - start) * 1e3
    handle.settle(None)
    return handle


class SaveEngine:
    """Takes snapshots on the training thread and writes them in the background.

    Args:
        store (`CheckpointStore`): where checkpoints are committed.
        mode (`str`, *optional*, defaults to `"process"`): `"process"` (a writer process) or `"sync"` (write on
            the calling thread, no snapshot copy).
        memory_margin (`float`, *optional*, defaults to `0.15`): fraction of the memory limit a save must leave
            free; otherwise it streams synchronously from the live tensors (`sysmem.plan_staging`).
        on_busy (`str`, *optional*, defaults to `"wait"`): while the previous save is still writing, `"wait"` for
            it, or `"skip"` (logged; single process only, since ranks could disagree).
        headroom (`Callable[[], sysmem.Headroom]`, *optional*): replaces the memory probe (`sysmem.headroom` of
            this process's cgroup, or of `$HF_DYNAMIC_CKPT_CGROUP_DIR`).
        writer_nice (`int`, *optional*, defaults to `10`): nice increment of the writer process (`0`: none).
        overlap (`bool`, *optional*, defaults to `False`): copy the optimizer's parameters and state beside the
            next forward and backward (`Overlap`); `None`: only for CUDA parameters with at least 32 MiB.
        allocate (`Allocator`, *optional*, defaults to `snapshot.shared_storage`): where the snapshot buffers
            live; shared memory the writer process can map (a named shared-memory slot can be one).
        slots (`CheckpointStore`, *optional*): the memory tier's slots (`store.slots`), written by `save(memory=True)`
            through the writer process, which persists the newest one when the training process dies.

    """

    def __init__(self, store: Any, *, mode: str = "process", memory_margin: float = 0.15,
                 on_busy: OnBusy | str = OnBusy.WAIT, headroom: Callable[[], sysmem.Headroom] | None = None,
                 writer_nice: int = 10, overlap: bool | None = False, allocate: Allocator = shared_storage,
                 slots: Any = None) -> None:
        mode = str(getattr(mode, "value", mode))
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r} is invalid: expected 'process' (a background writer process, the "
                              "default) or 'sync' (writes on the training thread).")
        self.on_busy = OnBusy.parse(on_busy, getattr(store, "world_size", 1))
        if not 0.0 <= memory_margin < 1.0:
            raise ConfigError(f"memory_margin={memory_margin!r} is invalid: expected 0 <= value < 1.")
        self.store, self.mode, self.memory_margin, self.writer_nice = store, mode, memory_margin, int(writer_nice)
        # The cgroup is found once: parsing mountinfo per save would cost ~1 ms of blocking.
        self._headroom = headroom or functools.partial(sysmem.headroom, sysmem.find_memory_cgroup())
        self._room: tuple[float, sysmem.Headroom] | None = None  # (when, what): reused by memory slots for a second
        self._slot_fits = -1  # the size of the slots written on this thread whose room was checked
        self.slots = slots
        self._slots_opened: os.stat_result | None = None  # `same_dir`: a removed slots' directory is not made again
        if slots is not None:
            with contextlib.suppress(FileNotFoundError):
                self._slots_opened = os.lstat(slots.root)
        self.last_plan: sysmem.StagingPlan | None = None
        """The staging decision of the last background save (buffered or streaming, and why)."""
        self._snapshotter = Snapshotter(allocate)
        self._frozen: dict[tuple[Any, ...], Any] = {}  # frozen weights' records, hashed once per tensor version
        self._overlap = Overlap(overlap)
        self._writer: ProcessWriter | None = None
        self._no_writer = False  # none may be started (memory) or it died: background saves write synchronously
        self._job: Job | None = None  # the last background job
        self._sync_job: Job | None = None  # a synchronous job running
        self._last_committed: CheckpointInfo | None = None
        self._throughput = DEFAULT_THROUGHPUT
        self._streamed = False
        self._closed = False
        self._finalizer = weakref.finalize(self, SaveEngine._shutdown, self.__dict__)  # close() at exit

    @property
    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self._job is not None and not self._job.handle.done()

    @property
    def buffer_bytes(self) -> int:
        """Host memory held by the reusable snapshot buffers."""
        return self._snapshotter.nbytes

    @property
    def writer_ready(self) -> bool:
        """Whether the writer process takes saves now (never starts it)."""
        return self._writer is not None and self._writer.ready

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id, once started."""
        return self._writer.pid if self._writer is not None else None

    def start(self, *, wait_s: float = 0.0) -> bool:
        """Start the writer process (idempotent; none under a cgroup limit leaving less than
        `PROCESS_WRITER_MIN_BUDGET`) and wait up to `wait_s` s until it takes saves; returns whether it does."""
        self._check_open()
        if self.mode == "process" and self._writer is None and not self._no_writer:
            room = self._headroom()
            if room.source == "cgroup" and room.budget(self.memory_margin) < PROCESS_WRITER_MIN_BUDGET:
                logger.info("memory limit (%s, %.1f MiB available, %.0f%% margin): no writer process; saves are "
                            "written synchronously", room.detail, room.available_bytes / 2**20,
                            self.memory_margin * 100)
                self._no_writer = True
            else:
                self._writer = ProcessWriter(self.store, nice=self.writer_nice, slots=self.slots,
                                             margin=self.memory_margin)
        deadline, writer = time.monotonic() + wait_s, self._writer
        while writer is not None and not writer.ready and not writer.failed and time.monotonic() < deadline:
            time.sleep(0.02)
        return writer is not None and writer.ready

    def save(self, sources: StateSources, request: SaveRequest, *, rng: dict[str, Any] | RawRngState | None = None,
             sampler: dict[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
             blocking: bool = False, memory: bool = False) -> SaveHandle:
        """Snapshot the requested tiers and write them, in the background unless `blocking`. Returns once the state
        is copied (the next optimizer step may run at once); write errors surface through `SaveHandle.wait()`.

        `rng` and `sampler` replace what is captured now, `extra` goes to the manifest. `memory`: into the memory
        tier's slots; in the background skipped (`handle.skipped`) while the writer is not up or busy, or memory is
        short. Raises `SaveError` when the sources cannot provide the tiers, or the engine is closed."""
        self._check_open()
        start = time.perf_counter()
        self._overlap.wait()  # a copy still running beside the previous step reads the buffers this save fills
        handle = SaveHandle(request.step, request.reason, memory=memory)
        previous = self._job
        busy = previous.handle.step if previous is not None and not previous.handle.done() else None
        if memory:
            why = ("no slots" if self.slots is None else f"the writer process is still writing step {busy}"
                   if busy is not None else "the writer process is not up"
                   if not blocking and self._ready_writer() is None else None)
            if why is not None:
                return _skip(handle, f"memory slot of step {request.step} skipped: {why}", start)
        if previous is not None and busy is not None:
            if self.on_busy == OnBusy.SKIP and not blocking:
                logger.info(why := f"save of step {request.step} ({request.reason}) skipped: step "
                                   f"{previous.handle.step} is still writing (on_busy='skip')")
                return _skip(handle, why, start)
            previous.handle.join()  # its error, if any, is reported through its own handle
        self._settle(previous)
        fault("snapshot", step=request.step, rank=getattr(self.store, "rank", 0))
        live = collect(sources, step=request.step, epoch=request.epoch, tiers=request.tiers, rng=rng,
                       sampler=sampler, extra=extra, frozen=self._frozen)
        writer = self._ready_writer() if not blocking else None
        if writer is None:
            handle.staging = "sync"
            state = direct(live)
            if memory:  # before the writer is up: a small slot, on this thread, where two fit
                nbytes = tensor_bytes([state.weights, state.optimizer])
                if nbytes > EARLY_SLOT_MAX_BYTES:
                    return _skip(handle, f"memory slot of step {request.step} skipped: {nbytes / 2**20:.0f} MiB is "
                                 "too large to write on the training thread (the writer process, once up, does)", start)
                if nbytes != self._slot_fits:
                    if problem := room_problem(nbytes, self.slots, self.memory_margin):  # type: ignore[arg-type]
                        handle.settle(None, SaveError(problem))
                        return handle
                    self._slot_fits = nbytes
            return self._write_now(state, request, handle, start, slots=memory)
        parts = scopes(live)
        needed, held = self._snapshotter.needed_bytes(parts), self._snapshotter.nbytes
        room = self._room
        if not memory or needed or room is None or time.monotonic() - room[0] > MEMORY_ROOM_TTL_S:
            room = self._room = (time.monotonic(), self._headroom())
        plan = self.last_plan = sysmem.plan_staging(needed, margin=self.memory_margin, headroom=room[1],
                                                    held_bytes=held)
        defer = None
        if plan.mode == "buffered":
            defer = self._overlap.deferral(sources.optimizer, live, lambda: tensor_bytes([p.sources for p in parts]))
            try:
                state, waits, later = self._snapshotter.take(live, parts, defer)
            except NoBufferError as e:  # /dev/shm too small (anything else is a bug: it propagates)
                plan = self.last_plan = sysmem.StagingPlan("streaming", f"{e}; enlarge /dev/shm, e.g. "
                                                           "`docker run --shm-size`")
        if plan.mode == "streaming":
            if memory:
                return _skip(handle, f"memory slot of step {request.step} skipped: {plan.reason}", start)
            # Short of memory: the first such save of the run at WARNING, later ones at DEBUG.
            logger.log(logging.DEBUG if self._streamed else logging.WARNING,
                       "save of step %d streams synchronously: %s", request.step, plan.reason)
            self._streamed = True
            if self._snapshotter.release():
                writer.unmap()
            handle.staging = "streaming"
            return self._write_now(direct(live), request, handle, start)
        if defer is not None:
            # The CUDA part is queued now, the current stream not ordered after it; the gate orders the next step.
            handle.deferred = self._overlap.pending = PendingCopy(request.step, later,
                                                                  later.issue_cuda(self._snapshotter.streams))
            waits.append(handle.deferred)
        del live
        handle.blocking_ms = (time.perf_counter() - start) * 1e3
        handle.writer = "process"
        self._job = self._new_job(state, waits, request, handle)
        writer.submit(self._job, list(self._snapshotter.layouts.values()))
        return handle

    def emergency_save(self, sources: StateSources, request: SaveRequest, *, deadline_s: float,
                       rng: dict[str, Any] | RawRngState | None = None, sampler: dict[str, Any] | None = None,
                       extra: Mapping[str, Any] | None = None) -> CheckpointInfo | None:
        """Save synchronously from the live tensors within `deadline_s`; returns the `CheckpointInfo` (`None` on ranks
        > 0) or raises `SaveError`. L2 and L0 always, L1 if the measured throughput says it fits in 80 % of the time
        left; a save still writing gets at most half the deadline. The reason is prefixed with `"emergency: "`."""
        self._check_open()
        start = time.monotonic()
        self._overlap.wait()
        previous = self._job
        if previous is not None and not previous.handle.done() and not previous.handle.join(deadline_s / 2):
            logger.warning("emergency save of step %d: background save of step %d still writing after %.1f s; "
                           "not waiting longer", request.step, previous.handle.step, deadline_s / 2)
        else:
            self._settle(previous)
        tiers = {Tier.STATE} | ({Tier.WEIGHTS} if sources.weights is not None else set())
        if sources.optimizer is not None or sources.scheduler is not None or sources.scaler is not None:
            tiers.add(Tier.OPTIMIZER)
        live = collect(sources, step=request.step, epoch=request.epoch, tiers=tiers, rng=rng, sampler=sampler,
                       extra=extra, frozen=self._frozen)
        left_s = deadline_s - (time.monotonic() - start)
        l0, l1 = tensor_bytes(live.weights or {}), tensor_bytes(live.optimizer or {})
        if Tier.OPTIMIZER in tiers and (l0 + l1) / self._throughput > 0.8 * left_s:  # L0 + L1 would not be written
            logger.warning("emergency save of step %d: dropping the optimizer tier (%.1f MiB); weights + state need "
                           "~%.1f s of the %.1f s left at %.0f MB/s", request.step, l1 / 2**20,
                           l0 / self._throughput, left_s, self._throughput / 1e6)
            live.optimizer = live.scheduler = live.scaler = None
            tiers.discard(Tier.OPTIMIZER)
        request = dataclasses.replace(request, tiers=frozenset(tiers), reason=f"emergency: {request.reason}")
        handle = SaveHandle(request.step, request.reason)
        handle.staging = "sync"
        self._write_now(direct(live), request, handle, time.perf_counter())
        elapsed = time.monotonic() - start
        if elapsed > deadline_s:
            logger.warning("emergency save of step %d took %.1f s, past its %.1f s deadline", request.step, elapsed,
                           deadline_s)
        return handle.wait()

    def abort(self, reason: str) -> None:
        """Make the save in progress give up (commit nothing, its handle fails naming `reason`) instead of waiting for
        ranks that died; later saves are unaffected. Safe from any thread."""
        for job in (self._job, self._sync_job):
            if job is not None and not job.handle.done() and job.aborted is None:
                job.aborted = reason
                logger.warning("aborting the save of step %d: %s", job.handle.step, reason)

    def wait_snapshot(self) -> float:
        """Wait until the last snapshot no longer reads the live tensors (`overlap`): before changing parameters or
        optimizer state in place ahead of the next `optimizer.step()`. Returns the milliseconds waited."""
        return self._overlap.wait()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight, if any; re-raises its error like `SaveHandle.wait`."""
        job = self._job
        if job is None:
            return None
        self._overlap.wait()
        info = job.handle.wait(timeout)
        self._settle(job)
        return info

    def close(self) -> None:
        """Flush the save in flight, stop the writer and free the buffers. Idempotent; errors are not raised."""
        self._finalizer()

    def __enter__(self) -> SaveEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------------------------
    def _ready_writer(self) -> ProcessWriter | None:
        """The writer process if it takes saves now (started if needed); `None`: write this save synchronously."""
        if self.mode == "process" and self.start():
            return self._writer
        if self._writer is not None and self._writer.failed:
            logger.warning("the writer process %s exited; saves are written synchronously", self._writer.pid)
            self._writer.stop()
            self._writer, self._no_writer = None, True
            self._snapshotter.release()
        return None

    def _new_job(self, state: CheckpointState, waits: list[Any], request: SaveRequest, handle: SaveHandle) -> Job:
        last = self._last_committed
        return Job(state, waits, request, handle, f"step {last.step}" if last else "none written by this engine")

    def _write_now(self, state: CheckpointState, request: SaveRequest, handle: SaveHandle, start: float, *,
                   slots: bool = False) -> SaveHandle:
        """Write on the calling thread (abortable) through the store's `save`, looked up now (a wrapper set later
        applies); with `slots`, into the memory tier's."""
        target = self.slots if slots else self.store
        if slots and not same_dir(target.root, self._slots_opened):  # a store would make it again, not private
            handle.settle(None, SaveError(f"memory slot of step {request.step} failed: {removed(target.root)}"))
            return handle
        job = self._sync_job = self._new_job(state, [], request, handle)
        try:
            if slots:
                keep_newest(target)
            run_job(job, lambda *args, **kwargs: target.save(*args, **kwargs))
        finally:
            self._sync_job = None
        self._settle(job)
        handle.blocking_ms = (time.perf_counter() - start) * 1e3
        return handle

    def _settle(self, job: Job | None) -> None:
        """Learn from a finished job once, on the training thread: the restore point, the write throughput."""
        if job is None or job.settled or not job.handle.done():
            return
        job.settled = True
        # A slot is no disk restore point, and tmpfs is no measure of the disk's speed.
        info = job.handle.wait(0) if job.handle.exception() is None and not job.handle.memory else None
        if info is None:
            return
        self._last_committed = info
        if info.bytes > 0 and job.handle.write_ms:
            rate = info.bytes / (job.handle.write_ms / 1e3)
            self._throughput = rate if self._throughput == DEFAULT_THROUGHPUT else 0.5 * (self._throughput + rate)

    @staticmethod
    def _shutdown(state: dict[str, Any]) -> None:
        # Runs close() on the engine's __dict__: a weakref.finalize callback must not reference the engine.
        state["_closed"] = True
        state["_overlap"].close()  # before the writer stops: its IPC thread runs the deferred host copies
        writer, state["_writer"] = state["_writer"], None
        if writer is not None:
            writer.stop()
        state["_snapshotter"].release()

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError("SaveEngine is closed: create a new SaveEngine to save again.")

"""SaveEngine: snapshot on the training thread, write in the background.

`SaveEngine.save` blocks only for the snapshot (`snapshot.py`); the serialisation, L1 compression, checksums,
fsyncs and the commit run in the store's `save` on a writer (`writer.Writer`), both running `jobs.run_job`: a
thread (`EngineMode.THREAD`, this class's default) or a process reading shared-memory buffers (`EngineMode.PROCESS`,
`SmartCkptConfig.engine`'s default: `docs/engine.md` has the measurements; `dispatch.py` how a save never waits
for the writer process to start).

Invariants:
- At most one save is in flight, so one set of snapshot buffers suffices: a snapshot
  only overwrites them after the previous write finished. A save that comes while one
  is writing follows `on_busy`: `"wait"` (default; the wait counts as blocking time, so
  the policy's overhead budget sees it) or `"skip"` (logged with its reason).
- Background errors never propagate into the training loop: they are logged, stored on the `SaveHandle`
  (`wait()` re-raises them as `SaveError`), and the previous committed checkpoint stays the restore point.
- The writer never runs collectives (the store's `save` runs none) and never calls back into the engine: the
  engine learns what a finished job taught (restore point, write throughput, frozen blobs now stored, from
  `CheckpointInfo.blobs`) on the training thread, before its next save.
- `close()` flushes and is idempotent; it also runs at interpreter exit (a `weakref.finalize` callback; the
  running writer keeps the engine alive until then), so an exception that ends the run still lets the last save
  finish. Call `close()` (or use `with SaveEngine(...)`) to release the writer and the buffers earlier.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from ..config import EngineMode
from ..constants import ALL_TIERS, Tier
from ..errors import ConfigError, SaveError
from ..state import RawRngState, StateSources
from ..store import BlobRef, CheckpointInfo, CheckpointState, SaveRequest
from .dispatch import Dispatcher, beside_training
from .jobs import Job, Jobs, OnBusy, SaveHandle
from .live import available_tiers, fit_to_deadline
from .overlap import Overlap
from .prepare import Preparer
from .snapshot import Snapshotter
from .staging import Stager, StagingMode, StagingPlan, default_headroom

logger = logging.getLogger(__name__)


class SaveEngine:
    """Takes snapshots on the training thread and writes them in the background.

    Args:
        store (`CheckpointStore`): where checkpoints are committed.
        mode (`EngineMode` or `str`, *optional*, defaults to `"thread"`): `"thread"` (writer
            thread), `"process"` (writer process, shared-memory buffers) or `"sync"`
            (write on the calling thread, no snapshot copy).
        memory_margin (`float`, *optional*, defaults to `0.15`): fraction of the memory limit a save
            must leave free; otherwise it streams synchronously from the live tensors (`staging.py`).
        on_busy (`str`, *optional*, defaults to `"wait"`): what a save does while the previous
            one is still writing: `"wait"` for it, or `"skip"` (logged; single process only,
            since ranks could disagree on what to skip).
        cgroup_dir (`str` or `Path`, *optional*): cgroup (v1 or v2) directory to read the memory limit
            from; defaults to `$HF_DYNAMIC_CKPT_CGROUP_DIR`, else the process's own memory cgroup.
        headroom (`Callable[[], Headroom]`, *optional*): replaces the memory probe entirely.
        writer_nice (`int`, *optional*, defaults to `10`): nice increment of the writer thread or
            process, so that under CPU contention the scheduler favours training (Linux; see
            docs/engine.md for the measured effect). `0` keeps the training's priority.
        overlap (`bool`, *optional*, defaults to `False`): copy the optimizer's parameters and state beside the
            next step's forward and backward; its `optimizer.step()` waits for the copy (`overlap.py`). `None`:
            only for CUDA parameters with at least 32 MiB of them. Call `wait_snapshot()` before changing them in
            place between steps.

    Example:
        ```python
        >>> engine = SaveEngine(CheckpointStore("ckpt"))
        >>> sources = StateSources(weights=model.state_dict, optimizer=optimizer)
        >>> handle = engine.save(sources, SaveRequest(step=100, epoch=0.3, reason="interval"))
        >>> optimizer.step()        # safe: the snapshot is already taken
        >>> handle.wait().step
        100
        >>> engine.close()
        ```
    """

    def __init__(
        self,
        store: Any,
        *,
        mode: EngineMode | str = EngineMode.THREAD,
        memory_margin: float = 0.15,
        on_busy: OnBusy | str = OnBusy.WAIT,
        cgroup_dir: str | Path | None = None,
        headroom: Callable[[], Any] | None = None,
        writer_nice: int = 10,
        overlap: bool | None = False,
    ) -> None:
        try:
            mode = EngineMode(mode)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in EngineMode)
            raise ConfigError(f"mode={mode!r} is invalid: expected one of {allowed}.") from None
        self.on_busy = OnBusy.parse(on_busy, getattr(store, "world_size", 1))
        if not 0.0 <= memory_margin < 1.0:
            raise ConfigError(f"memory_margin={memory_margin!r} is invalid: expected 0 <= value < 1.")
        self.store = store
        self.memory_margin = memory_margin
        self.writer_nice = int(writer_nice)
        self._stager = Stager(memory_margin, headroom if headroom is not None else default_headroom(cgroup_dir))
        if mode == EngineMode.PROCESS and not self._stager.writer_process_fits():
            mode = EngineMode.THREAD  # under a tight memory limit: no second interpreter
        self._snapshotter = self._new_snapshotter(shared=mode == EngineMode.PROCESS)
        self._dispatch = Dispatcher(mode, self._store_save, spec=lambda: beside_training(store.spec),
                                    store_cls=type(store), pool=self._snapshotter.pool, nice=self.writer_nice,
                                    name=f"{id(self):x}")
        self._jobs = Jobs()
        self._preparer = Preparer(nice=self.writer_nice)
        self._overlap = Overlap(overlap)
        self._closed = False
        # Runs close() at interpreter exit (flushes) unless close() ran before.
        self._finalizer = weakref.finalize(self, SaveEngine._shutdown, self.__dict__)

    # -- public API ------------------------------------------------------------------------
    @property
    def mode(self) -> EngineMode:
        """The engine's mode; process mode turns into thread mode when the writer process cannot be used."""
        return self._dispatch.mode

    @property
    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self._jobs.busy

    @property
    def last_plan(self) -> StagingPlan | None:
        """The staging decision of the last save (buffered or streaming, and why)."""
        return self._stager.last_plan

    @property
    def buffer_bytes(self) -> int:
        """Host memory held by the reusable snapshot buffers."""
        return self._snapshotter.pool.nbytes

    def save(
        self,
        sources: StateSources,
        request: SaveRequest,
        *,
        rng: dict[str, Any] | RawRngState | None = None,
        sampler: dict[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = False,
    ) -> SaveHandle:
        """Snapshot the requested tiers and write them, in the background unless told otherwise.

        Returns once the state is copied: the caller may run the next optimizer step at
        once. Write errors never raise here; they surface through `SaveHandle.wait()`.

        Args:
            sources (`StateSources`): live objects to copy from.
            request (`SaveRequest`): step, epoch, tiers, reason and the rest of the save's
                metadata; handed to the store unchanged.
            rng (`dict`, *optional*): RNG state to store instead of capturing it now.
            sampler (`dict`, *optional*): data position instead of `sources.sampler()`.
            extra (`Mapping`, *optional*): JSON-able data for the manifest's `extra`.
            blocking (`bool`, *optional*, defaults to `False`): write before returning.

        Returns:
            `SaveHandle`: `wait()` returns the committed `CheckpointInfo`.

        Raises:
            `SaveError`: the sources cannot provide the requested tiers (nothing was saved),
                or the engine is closed.
        """
        self._check_open()
        start = time.perf_counter()
        self._overlap.wait()  # a copy still running beside the previous step reads the buffers this save fills
        handle = SaveHandle(request.step, request.reason)
        previous = self._jobs.inflight
        if previous is not None and not previous.handle.done():
            if self.on_busy == OnBusy.SKIP and not blocking:
                handle.skipped = (f"save of step {request.step} ({request.reason}) skipped: step "
                                  f"{previous.handle.step} is still writing (on_busy='skip')")
                logger.info(handle.skipped)
                handle.blocking_ms = (time.perf_counter() - start) * 1e3
                handle.settle(None)
                return handle
            previous.handle.join()  # its error, if any, is reported through its own handle
        self._settle(previous)
        self._preparer.finish(self._snapshotter)  # normally long done: buffers prepared after the first step
        what: dict[str, Any] = {"step": request.step, "epoch": request.epoch, "tiers": request.tiers, "rng": rng,
                                "sampler": sampler, "extra": extra}
        live = self._snapshotter.collect(sources, **what)
        synchronous = blocking or self.mode == EngineMode.SYNC
        snapshot = defer = None
        if not synchronous:
            defer = self._overlap.deferral(sources.optimizer, partial(self._snapshotter.scope_bytes, live))
            needed = self._snapshotter.extra_bytes_needed(live)
            if (self.mode == EngineMode.PROCESS and needed
                    and not self._dispatch.shared_memory_fits(needed, self.memory_margin)):
                # Decided before anything is copied: this save and the next are thread-mode saves.
                self._use_threads()
                live = self._snapshotter.collect(sources, **what)  # planned for the private buffers
                needed = self._snapshotter.extra_bytes_needed(live)
            plan, snapshot = self._stager.plan_copying(needed, self._snapshotter.pool.nbytes,
                                                       partial(self._snapshotter.take, live, defer=defer))
            if plan.mode == StagingMode.STREAMING:  # memory says stream: a copy into held buffers is dropped
                if snapshot is not None:
                    snapshot.wait_copies()  # not written: its buffers are released below, once its copies are done
                    snapshot = None
                if self.mode == EngineMode.PROCESS:
                    self._use_threads()  # the writer process's memory is needed too
                self._stager.stream(request.step, plan)  # logs it
                self._snapshotter.release()  # a streaming save uses no buffer
                synchronous = True
                handle.staging = StagingMode.STREAMING.value
        else:
            handle.staging = "sync"
        if synchronous:
            self._run_sync(self._jobs.new(self._snapshotter.take(live, copy=False), request, handle))
            handle.blocking_ms = (time.perf_counter() - start) * 1e3
            return handle
        job = self._jobs.new(snapshot if snapshot is not None else self._snapshotter.take(live, defer=defer), request,
                             handle)
        handle.deferred = job.snapshot.deferred
        del live, snapshot
        handle.blocking_ms = (time.perf_counter() - start) * 1e3
        self._jobs.inflight = job
        self._dispatch.pick(handle).submit(job)
        return handle

    def emergency_save(
        self,
        sources: StateSources,
        request: SaveRequest,
        *,
        deadline_s: float,
        rng: dict[str, Any] | RawRngState | None = None,
        sampler: dict[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo | None:
        """Save synchronously within a deadline (preemption grace period), most valuable tiers first.

        L2 (RNG, data position) and L0 (weights) are always written; L1 (optimizer state)
        is added only if the measured write throughput says it fits in the time left. A
        background save still writing gets at most half the deadline to finish first.

        Args:
            sources (`StateSources`): live objects (written directly, no copy).
            request (`SaveRequest`): the save's metadata; `tiers` is replaced by what is
                written and `reason` is prefixed with `"emergency: "`.
            deadline_s (`float`): seconds available from now.
            rng, sampler, extra: as in `save`.

        Returns:
            `CheckpointInfo | None`: the committed checkpoint (`None` on ranks > 0).

        Raises:
            `SaveError`: the save failed (the previous checkpoint stays the restore point).
        """
        self._check_open()
        start = time.monotonic()
        self._overlap.wait()
        step = request.step
        previous = self._jobs.inflight
        if previous is not None and not previous.handle.done() and not previous.handle.join(deadline_s / 2):
            logger.warning("emergency save of step %d: background save of step %d still writing after %.1f s; "
                           "not waiting longer", step, previous.handle.step, deadline_s / 2)
        else:
            self._settle(previous)
        self._preparer.finish(self._snapshotter)
        tiers = available_tiers(sources)
        live = self._snapshotter.collect(sources, step=step, epoch=request.epoch, tiers=tiers, rng=rng, sampler=sampler,
                                         extra=extra)
        if fit_to_deadline(live, throughput=self._jobs.throughput, left_s=deadline_s - (time.monotonic() - start),
                           step=step):
            tiers.discard(Tier.OPTIMIZER)
        request = dataclasses.replace(request, tiers=frozenset(tiers), reason=f"emergency: {request.reason}")
        handle = SaveHandle(step, request.reason)
        handle.staging = "sync"
        self._run_sync(self._jobs.new(self._snapshotter.take(live, copy=False), request, handle))
        handle.blocking_ms = (time.monotonic() - start) * 1e3
        elapsed = time.monotonic() - start
        if elapsed > deadline_s:
            logger.warning("emergency save of step %d took %.1f s, past its %.1f s deadline", step, elapsed, deadline_s)
        return handle.wait()

    def prepare(self, sources: StateSources, tiers: Iterable[Tier] = ALL_TIERS, *, wait: bool = False) -> int:
        """Allocate and pre-fault the snapshot buffers of `sources` in the background, ahead of the first save.

        Call it once the sources exist (right after attaching to the model and optimizer):
        the first save then copies into warm buffers at memcpy speed instead of paying a page
        fault per page. Nothing is prepared when the buffers would not fit in the memory budget
        (such a save streams anyway) or in sync mode. An optimizer whose state is still empty gets
        its buffers prepared right after its first step; under a memory limit every tier waits for it.

        Args:
            sources (`StateSources`): the live objects later saves copy from.
            tiers (`Iterable[Tier]`, *optional*, defaults to all tiers): the tiers saves will take.
            wait (`bool`, *optional*, defaults to `False`): return once the buffers are ready (else
                the next save adopts them, waiting if needed).

        Returns:
            `int`: bytes being prepared in the background now.
        """
        self._check_open()
        if self.mode == EngineMode.SYNC:
            return 0
        self._overlap.wait()
        self._dispatch.ensure()  # the writer (thread or process) starts now, not at the first save
        started, pending = self._preparer.start(self._snapshotter, sources, tiers, admit=self._admit,
                                                wait_for_step=self._stager.limited() is not None)
        if wait:
            self._preparer.finish(self._snapshotter)
        if pending:  # those tiers once the optimizer has stepped; weakly: the hook must not keep the engine
            self._preparer.after_first_step(sources, weakref.WeakMethod(self.prepare), pending)
        return started

    def abort(self, reason: str) -> None:
        """Make the save in progress give up instead of waiting for other ranks.

        For a fatal error under DDP: rank 0's writer may be waiting (up to `rank_timeout_s`)
        for the files of a rank that died. After `abort` that wait ends at once, the save
        commits nothing and its handle fails with a `SaveError` naming `reason`; a save not
        yet started is not started. Saves begun after `abort` are unaffected. Safe from any
        thread; does nothing when no save is in progress.

        Args:
            reason (`str`): why (e.g. `"rank 1 failed: CUDA error"`), for the error message.
        """
        self._jobs.abort(reason)

    def wait_writer_ready(self, timeout: float | None = None) -> bool:
        """Process mode: wait up to `timeout` s until the writer process takes saves (`False` if it did
        not or died); `True` in the other modes. For benchmarks and tests: saves never wait for it."""
        self._check_open()
        return self._dispatch.wait_ready(timeout)

    def wait_snapshot(self) -> float:
        """Wait until the last save's snapshot no longer reads the live tensors (`overlap`): call it before changing
        parameters or optimizer state in place between a save and the next `optimizer.step()`, which waits by itself.
        Returns the milliseconds waited (0 without a copy in progress)."""
        return self._overlap.wait()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight, if any; re-raises its error like `SaveHandle.wait`."""
        job = self._jobs.inflight
        if job is None:
            return None
        self._overlap.wait()
        info = job.handle.wait(timeout)
        self._settle(job)
        return info

    def close(self) -> None:
        """Flush the save in flight and stop the writer. Idempotent; errors are logged, not raised."""
        self._finalizer()

    def __enter__(self) -> SaveEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _new_snapshotter(self, *, shared: bool) -> Snapshotter:
        return Snapshotter(shared=shared, blob_exists=self._blob_exists)

    def _use_threads(self) -> None:
        """Thread mode for good: the writer process stops, snapshots go to private buffers."""
        self._dispatch.use_threads()
        self._snapshotter = self._new_snapshotter(shared=False)

    def _store_save(self, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any],
                    cancel: Callable[[], bool]) -> CheckpointInfo | None:
        """`self.store.save`, looked up per call: a wrapper set on the store after the engine exists applies."""
        return self.store.save(state, request, timings=timings, cancel=cancel)

    def _blob_exists(self, ref: BlobRef) -> bool:  # still stored: a later save may refer to it instead of writing it
        return bool(self.store.blobs.exists(ref.digest))

    def _run_sync(self, job: Job) -> None:
        self._jobs.run_sync(job, self._store_save)
        self._settle(job)

    def _settle(self, job: Job | None) -> None:
        """Learn from a finished job, on the training thread; frozen blobs it stored are referred to from now on."""
        info = self._jobs.record(job)
        if info is not None and job is not None and job.snapshot.pending_blobs and info.blobs:
            self._snapshotter.mark_blobs_stored(job.snapshot.pending_blobs, info.blobs)  # empty blobs: unknown

    @staticmethod
    def _shutdown(state: dict[str, Any]) -> None:
        # Must not reference the engine itself (weakref.finalize): works on its __dict__.
        state["_closed"] = True
        job = state["_jobs"].inflight
        handle = job.handle if job is not None else None
        if handle is not None and not handle.done():
            logger.debug("flushing the save of step %d before shutdown", handle.step)
        state["_overlap"].close()  # before the writer stops: it waits for the copy
        state["_preparer"].close()
        state["_stager"].close()
        state["_dispatch"].stop()
        if handle is not None and handle.exception() is not None:
            logger.debug("the last background save (step %d) failed: %s", handle.step, handle.exception())
        snapshotter = state.get("_snapshotter")
        if snapshotter is not None:
            snapshotter.pool.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError("SaveEngine is closed: create a new SaveEngine to save again.")

    def _admit(self, needed: int) -> bool:
        """Whether `needed` more bytes of buffers may be prepared now (memory headroom, /dev/shm)."""
        if self.mode == EngineMode.PROCESS and not self._dispatch.shared_memory_fits(needed, self.memory_margin):
            return False
        return self._stager.plan(needed, self._snapshotter.pool.nbytes).mode == StagingMode.BUFFERED

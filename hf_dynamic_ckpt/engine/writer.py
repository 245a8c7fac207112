"""SaveEngine: snapshot on the training thread, write in the background.

`SaveEngine.save` blocks only for the snapshot (`snapshot.py`); the serialisation, L1
compression, checksums, fsyncs and the commit run in `CheckpointStore.save` on a writer:
a thread (`EngineMode.THREAD`, default) or a separate process reading shared-memory
buffers (`EngineMode.PROCESS`). `docs/engine.md` has the measurements behind the default.

In process mode the writer process is started when the engine is created and a save never
waits for it to come up (a spawned interpreter needs about a second to import torch): until
it reports ready, saves are written by a thread (`SaveHandle.writer == "thread (process
starting)"`), so start-up time never shows up as a save's blocking time or write time.

Invariants:
- At most one save is in flight, so one set of snapshot buffers suffices: a snapshot
  only overwrites them after the previous write finished. A save that comes while one
  is writing follows `on_busy`: `"wait"` (default; the wait counts as blocking time, so
  the policy's overhead budget sees it) or `"skip"` (logged with its reason).
- Background errors never propagate into the training loop: they are logged, stored on
  the `SaveHandle` (`wait()` re-raises them as `SaveError`), and the previous committed
  checkpoint stays the restore point (the store commits atomically).
- The writer never runs collectives (`CheckpointStore.save` runs none).
- `close()` flushes and is idempotent; it also runs at interpreter exit (a
  `weakref.finalize` callback; the running writer keeps the engine alive until then), so
  an exception that ends the run still lets the last save finish. Call `close()` (or use
  `with SaveEngine(...)`) to release the writer and the buffers earlier.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import EngineMode
from ..constants import ALL_TIERS, KEY_BLOBS, Tier
from ..errors import ConfigError, DynamicCkptError, SaveError
from ..store.types import BlobRef, CheckpointInfo
from .snapshot import Snapshot, Snapshotter, StateSources, state_dict_tensor_bytes
from .staging import StagingMode, StagingPlan, env_cgroup_dir, host_headroom, plan_staging

logger = logging.getLogger(__name__)

_DEFAULT_THROUGHPUT = 100e6
"""Bytes/s assumed for the emergency-save estimate before any save was measured."""


class OnBusy(enum.StrEnum):
    WAIT = "wait"
    SKIP = "skip"


class SaveHandle:
    """A save in progress: `done()`, `wait()` (re-raises the background error).

    Attributes:
        step (`int`): step of the save.
        reason (`str`): why it was taken.
        blocking_ms (`float`): time the training thread was blocked by `SaveEngine.save`
            (waiting for a previous save, plus the snapshot, plus the write when synchronous).
        staging (`str`): `"buffered"`, `"streaming"` or `"sync"`.
        skipped (`str | None`): why the save was skipped (`on_busy="skip"`), else `None`.
        write_ms (`float | None`): time the writer spent, once done.
        writer (`str`): who writes it: `"thread"`, `"process"`, `"thread (process starting)"`
            (process mode before the writer process is ready) or `"sync"` (the caller's thread).
    """

    def __init__(self, step: int, reason: str) -> None:
        self.step = step
        self.reason = reason
        self.blocking_ms = 0.0
        self.staging = StagingMode.BUFFERED.value
        self.skipped: str | None = None
        self.write_ms: float | None = None
        self.writer = "sync"
        self._event = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("failed" if self._error else ("done" if self.done() else "writing"))
        return f"SaveHandle(step={self.step}, {state}, blocking_ms={self.blocking_ms:.1f})"

    def done(self) -> bool:
        """Whether the save finished (committed, failed or skipped)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save and return its `CheckpointInfo` (`None` on ranks > 0 or if skipped).

        Args:
            timeout (`float`, *optional*): seconds to wait; `None` waits as long as it takes.

        Raises:
            `TimeoutError`: the save is still writing after `timeout` seconds.
            `SaveError`: the background write failed (the cause is chained).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still writing after {timeout} s; call wait() again.")
        if self._error is not None:
            raise self._error
        return self._info

    def exception(self) -> BaseException | None:
        """The error of a finished, failed save (without raising it); `None` otherwise."""
        return self._error if self._event.is_set() else None

    def _finish(self, info: CheckpointInfo | None = None, error: BaseException | None = None) -> None:
        self._info, self._error = info, error
        self._event.set()


@dataclass
class _Job:
    snapshot: Snapshot
    handle: SaveHandle
    kwargs: dict[str, Any]


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux: per thread); best effort.

    Threads the writer starts (zstd workers) inherit it. Lowering priority needs no privilege.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, current + nice))
    except OSError as e:
        logger.debug("could not lower the writer's priority: %s", e)


class _ThreadWriter:
    """One persistent writer thread fed through a one-slot queue."""

    def __init__(self, run: Callable[[_Job], None], name: str, *, nice: int = 0) -> None:
        self._run = run
        self._nice = nice
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        lower_priority(self._nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)  # after any queued job: flushes first
            self._thread.join()


_STORE_ARGS = ("root", "task_id", "rank", "world_size", "session_id", "compression_level", "compression_threads",
               "compression", "rank_timeout_s")


def _store_spec(store: Any) -> dict[str, Any]:
    """Constructor arguments that rebuild `store` in a writer process (same session, no cleanup)."""
    spec = {name: getattr(store, name) for name in _STORE_ARGS if hasattr(store, name)}
    spec["cleanup"] = False  # the parent's store already cleaned up; the child only writes
    return spec


class SaveEngine:
    """Takes snapshots on the training thread and writes them in the background.

    Args:
        store (`CheckpointStore`): where checkpoints are committed.
        mode (`EngineMode` or `str`, *optional*, defaults to `"thread"`): `"thread"` (writer
            thread), `"process"` (writer process, shared-memory buffers) or `"sync"`
            (write on the calling thread, no snapshot copy).
        memory_margin (`float`, *optional*, defaults to `0.15`): fraction of the host (or
            cgroup) memory limit a snapshot must leave free; otherwise the save streams
            synchronously from the live tensors.
        on_busy (`str`, *optional*, defaults to `"wait"`): what a save does while the previous
            one is still writing: `"wait"` for it, or `"skip"` (logged; single process only,
            since ranks could disagree on what to skip).
        cgroup_dir (`str` or `Path`, *optional*): cgroup v2 directory to read the memory limit
            from; defaults to `$HF_DYNAMIC_CKPT_CGROUP_DIR`, else the process's own cgroup.
        headroom (`Callable[[], Headroom]`, *optional*): replaces the memory probe entirely.
        writer_nice (`int`, *optional*, defaults to `10`): nice increment of the writer thread or
            process, so that under CPU contention the scheduler favours training (Linux; see
            docs/engine.md for the measured effect). `0` keeps the training's priority.

    Example:
        ```python
        >>> engine = SaveEngine(CheckpointStore("ckpt"))
        >>> sources = StateSources(weights=model.state_dict, optimizer=optimizer)
        >>> handle = engine.save(sources, step=100, epoch=0.3, tiers=ALL_TIERS, reason="interval")
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
    ) -> None:
        try:
            self.mode = EngineMode(mode)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in EngineMode)
            raise ConfigError(f"mode={mode!r} is invalid: expected one of {allowed}.") from None
        try:
            self.on_busy = OnBusy(on_busy)
        except ValueError:
            raise ConfigError(f"on_busy={on_busy!r} is invalid: expected 'wait' or 'skip'.") from None
        if not 0.0 <= memory_margin < 1.0:
            raise ConfigError(f"memory_margin={memory_margin!r} is invalid: expected 0 <= value < 1.")
        if self.on_busy == OnBusy.SKIP and getattr(store, "world_size", 1) > 1:
            # Ranks finish writing at different times: one rank skipping a step the others
            # write would leave rank 0 waiting for files that never come.
            raise ConfigError(
                f"on_busy='skip' is invalid with world_size={store.world_size}: ranks could disagree on which "
                "saves to skip; use on_busy='wait'."
            )
        self.store = store
        self.memory_margin = memory_margin
        self.writer_nice = int(writer_nice)
        cg = Path(cgroup_dir) if cgroup_dir is not None else env_cgroup_dir()
        self._headroom = headroom if headroom is not None else (lambda: host_headroom(cg))
        self._snapshotter = Snapshotter(shared=self.mode == EngineMode.PROCESS, blob_exists=self._blob_exists)
        self._inflight: SaveHandle | None = None
        self._last_committed: CheckpointInfo | None = None
        self._throughput = _DEFAULT_THROUGHPUT
        self._writer: Any = None
        self._startup_writer: _ThreadWriter | None = None  # process mode, until the process is ready
        self._closed = False
        self._lock = threading.Lock()
        self._shm_dir = "/dev/shm"
        self.last_plan: StagingPlan | None = None
        # Runs close() at interpreter exit (flushes) unless close() ran before.
        self._finalizer = weakref.finalize(self, SaveEngine._shutdown, self.__dict__)
        if self.mode == EngineMode.PROCESS:
            self._ensure_writer()  # start-up (~1 s) overlaps training; saves never wait for it

    # -- public API ------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self._inflight is not None and not self._inflight.done()

    @property
    def buffer_bytes(self) -> int:
        """Host memory held by the reusable snapshot buffers."""
        return self._snapshotter.pool.nbytes

    def save(
        self,
        sources: StateSources,
        *,
        step: int,
        epoch: float = 0.0,
        tiers: Iterable[Tier] = ALL_TIERS,
        reason: str,
        pinned: bool = False,
        healthy: bool = True,
        signals: dict[str, Any] | None = None,
        debug_info: list[dict[str, Any]] | None = None,
        rng: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
        blocking: bool = False,
        replace: bool = False,
    ) -> SaveHandle:
        """Snapshot the chosen tiers and write them, in the background unless told otherwise.

        Returns once the state is copied: the caller may run the next optimizer step at
        once. Write errors never raise here; they surface through `SaveHandle.wait()`.

        Args:
            sources (`StateSources`): live objects to copy from.
            step (`int`): optimizer steps completed.
            epoch (`float`, *optional*, defaults to `0.0`): fractional epoch.
            tiers (`Iterable[Tier]`, *optional*, defaults to all tiers): what to save.
            reason (`str`): why (goes into the manifest and the catalog).
            pinned (`bool`, *optional*, defaults to `False`): protect from retention.
            healthy (`bool`, *optional*, defaults to `True`): a valid restore point.
            signals (`dict`, *optional*): signals at save time, for the manifest.
            debug_info (`list[dict]`, *optional*): last steps' signals, for the manifest.
            rng (`dict`, *optional*): RNG state to store instead of capturing it now.
            sampler (`dict`, *optional*): data position instead of `sources.sampler()`.
            blocking (`bool`, *optional*, defaults to `False`): write before returning.
            replace (`bool`, *optional*, defaults to `False`): re-commit `step` if it is already
                committed (`CheckpointStore.save(replace=True)`); pass the same on every rank.

        Returns:
            `SaveHandle`: `wait()` returns the committed `CheckpointInfo`.

        Raises:
            `SaveError`: the sources cannot provide the requested tiers (nothing was saved),
                or the engine is closed.
        """
        self._check_open()
        start = time.perf_counter()
        handle = SaveHandle(step, reason)
        previous = self._inflight
        if previous is not None and not previous.done():
            if self.on_busy == OnBusy.SKIP and not blocking:
                handle.skipped = (
                    f"save of step {step} ({reason}) skipped: step {previous.step} is still writing (on_busy='skip')"
                )
                logger.info(handle.skipped)
                handle.blocking_ms = (time.perf_counter() - start) * 1e3
                handle._finish(None)
                return handle
            previous._event.wait()  # its error, if any, is reported through its own handle

        live = self._snapshotter.collect(sources, step=step, epoch=epoch, tiers=tiers, rng=rng, sampler=sampler)
        synchronous = blocking or self.mode == EngineMode.SYNC
        if not synchronous:
            needed = self._snapshotter.extra_bytes_needed(live)
            if needed and self.mode == EngineMode.PROCESS:
                self._check_shared_memory(needed)
            plan = self._plan(needed)
            if plan.mode == StagingMode.STREAMING:
                logger.warning("save of step %d streams synchronously: %s", step, plan.reason)
                synchronous = True
                handle.staging = StagingMode.STREAMING.value
        else:
            handle.staging = "sync"
        kwargs = {"reason": reason, "pinned": pinned, "healthy": healthy, "signals": signals,
                  "debug_info": debug_info, "replace": replace}
        if synchronous:
            snapshot = self._snapshotter.take(live, copy=False)
            del live
            self._write(_Job(snapshot, handle, kwargs))
            handle.blocking_ms = (time.perf_counter() - start) * 1e3
            return handle
        snapshot = self._snapshotter.take(live, copy=True)
        del live
        handle.blocking_ms = (time.perf_counter() - start) * 1e3
        self._inflight = handle
        self._pick_writer(handle).submit(_Job(snapshot, handle, kwargs))
        return handle

    def emergency_save(
        self,
        sources: StateSources,
        *,
        step: int,
        epoch: float = 0.0,
        reason: str,
        deadline_s: float,
        rng: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
        signals: dict[str, Any] | None = None,
        debug_info: list[dict[str, Any]] | None = None,
        replace: bool = False,
    ) -> CheckpointInfo | None:
        """Save synchronously within a deadline (preemption grace period), most valuable tiers first.

        L2 (RNG, data position) and L0 (weights) are always written; L1 (optimizer state)
        is added only if the measured write throughput says it fits in the time left. A
        background save still writing gets at most half the deadline to finish first.

        Args:
            sources (`StateSources`): live objects (written directly, no copy).
            step (`int`): optimizer steps completed.
            epoch (`float`, *optional*): fractional epoch.
            reason (`str`): why (e.g. `"preemption: SIGTERM"`).
            deadline_s (`float`): seconds available from now.
            rng, sampler, signals, debug_info, replace: as in `save`.

        Returns:
            `CheckpointInfo | None`: the committed checkpoint (`None` on ranks > 0).

        Raises:
            `SaveError`: the save failed (the previous checkpoint stays the restore point).
        """
        self._check_open()
        start = time.monotonic()
        previous = self._inflight
        if previous is not None and not previous.done() and not previous._event.wait(deadline_s / 2):
            logger.warning("emergency save of step %d: background save of step %d still writing after %.1f s; "
                           "not waiting longer", step, previous.step, deadline_s / 2)
        tiers = {Tier.STATE}
        if sources.weights is not None:
            tiers.add(Tier.WEIGHTS)
        has_l1 = sources.optimizer is not None or sources.scheduler is not None or sources.scaler is not None
        if has_l1:
            tiers.add(Tier.OPTIMIZER)
        live = self._snapshotter.collect(sources, step=step, epoch=epoch, tiers=tiers, rng=rng, sampler=sampler)
        l0_bytes = sum(v.numel() * v.element_size() for v in (live.weights or {}).values() if not isinstance(v, BlobRef))
        l1_bytes = state_dict_tensor_bytes(live.optimizer) if live.optimizer is not None else 0
        left = deadline_s - (time.monotonic() - start)
        estimate = (l0_bytes + l1_bytes) / self._throughput
        if has_l1 and estimate > 0.8 * left:
            logger.warning(
                "emergency save of step %d: dropping the optimizer tier (%.1f MiB); weights + state need ~%.1f s "
                "of the %.1f s left at %.0f MB/s", step, l1_bytes / 2**20, l0_bytes / self._throughput, left,
                self._throughput / 1e6,
            )
            live.optimizer = live.scheduler = live.scaler = None
            live.__dict__.pop("_copy_items", None)
        handle = SaveHandle(step, f"emergency: {reason}")
        handle.staging = "sync"
        snapshot = self._snapshotter.take(live, copy=False)
        del live
        self._write(_Job(snapshot, handle, {"reason": handle.reason, "pinned": False, "healthy": True,
                                            "signals": signals, "debug_info": debug_info, "replace": replace}))
        handle.blocking_ms = (time.monotonic() - start) * 1e3
        elapsed = time.monotonic() - start
        if elapsed > deadline_s:
            logger.warning("emergency save of step %d took %.1f s, past its %.1f s deadline", step, elapsed, deadline_s)
        return handle.wait()

    def wait_writer_ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer process can take saves (process mode); `True` in the other modes.

        Saves never need this (they use a thread meanwhile); it is for benchmarks and tests
        that measure the process writer itself.

        Args:
            timeout (`float`, *optional*): seconds to wait; `None` waits as long as it takes.

        Returns:
            `bool`: whether the process writer is ready (`False` after a timeout or if it died).
        """
        self._check_open()
        if self.mode != EngineMode.PROCESS:
            return True
        return bool(self._ensure_writer().wait_ready(timeout))

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save in flight, if any; re-raises its error like `SaveHandle.wait`."""
        handle = self._inflight
        if handle is None:
            return None
        return handle.wait(timeout)

    def close(self) -> None:
        """Flush the save in flight and stop the writer. Idempotent; errors are logged, not raised."""
        self._finalizer()

    def __enter__(self) -> SaveEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _shutdown(state: dict[str, Any]) -> None:
        # Must not reference the engine itself (weakref.finalize): works on its __dict__.
        state["_closed"] = True
        handle = state.get("_inflight")
        if handle is not None and not handle.done():
            logger.info("flushing the save of step %d before shutdown", handle.step)
        for name in ("_startup_writer", "_writer"):  # at most one of them holds a job
            w = state.get(name)
            if w is not None:
                w.stop()
                state[name] = None
        if handle is not None and handle.exception() is not None:
            logger.error("the last background save (step %d) failed: %s", handle.step, handle.exception())
        snapshotter = state.get("_snapshotter")
        if snapshotter is not None:
            snapshotter.pool.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError("SaveEngine is closed: create a new SaveEngine to save again.")

    def _check_shared_memory(self, needed: int) -> None:
        """Fall back to the thread writer when `/dev/shm` cannot hold the process mode's buffers.

        Docker gives containers 64 MiB of `/dev/shm` by default; a shared buffer that does not
        fit there would fail with SIGBUS on first touch instead of a clean error.
        """
        free = self._shm_free()
        if free is None or needed <= free * (1.0 - self.memory_margin):
            return
        mib = 1 << 20
        logger.warning(
            "the process writer needs %.1f MiB more shared memory but %s has %.1f MiB free: using the thread "
            "writer instead (enlarge /dev/shm, e.g. `docker run --shm-size`, to use mode='process')",
            needed / mib, self._shm_dir, free / mib,
        )
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        self.mode = EngineMode.THREAD
        self._snapshotter = Snapshotter(shared=False, blob_exists=self._blob_exists)

    def _shm_free(self) -> int | None:
        try:
            return int(shutil.disk_usage(self._shm_dir).free)
        except OSError:
            return None

    def _plan(self, needed: int) -> StagingPlan:
        if needed == 0:
            plan = StagingPlan(StagingMode.BUFFERED, "snapshot buffers already allocated", 0, None)
        else:
            plan = plan_staging(needed, margin=self.memory_margin, headroom=self._headroom())
            logger.debug("staging: %s", plan.reason)
        self.last_plan = plan
        return plan

    def _pick_writer(self, handle: SaveHandle) -> Any:
        """The writer for a background save; in process mode a thread until the process is ready."""
        writer = self._ensure_writer()
        if self.mode != EngineMode.PROCESS:
            handle.writer = "thread"
            return writer
        if writer.ready:
            handle.writer = "process"
            if self._startup_writer is not None:  # idle: the save before this one has finished
                self._startup_writer.stop()
                self._startup_writer = None
            return writer
        if writer.failed:
            logger.warning("the writer process %s exited before it was ready; writing on a thread instead", writer.pid)
            writer.stop()
            self._writer = None
            self.mode = EngineMode.THREAD
            handle.writer = "thread"
            return self._ensure_writer()
        handle.writer = "thread (process starting)"
        logger.debug("save of step %d written by a thread: the writer process is still starting", handle.step)
        if self._startup_writer is None:
            self._startup_writer = _ThreadWriter(self._write, name=f"hf-dynamic-ckpt-startup-writer-{id(self):x}",
                                                 nice=self.writer_nice)
        return self._startup_writer

    def _ensure_writer(self) -> Any:
        with self._lock:
            if self._writer is None:
                if self.mode == EngineMode.PROCESS:
                    from .process import ProcessWriter

                    self._writer = ProcessWriter(_store_spec(self.store), type(self.store), self._write,
                                                 self._snapshotter.pool, nice=self.writer_nice)
                else:
                    self._writer = _ThreadWriter(self._write, name=f"hf-dynamic-ckpt-writer-{id(self):x}",
                                                 nice=self.writer_nice)
            return self._writer

    def _write(self, job: _Job, *, remote: Callable[..., CheckpointInfo | None] | None = None) -> None:
        """Run one save to completion and settle its handle; never raises."""
        snapshot, handle = job.snapshot, job.handle
        start = time.perf_counter()
        try:
            snapshot.wait_copies()
            timings = {"snapshot_ms": round(snapshot.blocking_s * 1e3, 3)}
            if remote is not None:
                info = remote(snapshot.state, timings=timings, **job.kwargs)
            else:
                info = self.store.save(snapshot.state, timings=timings, **job.kwargs)
        except BaseException as e:
            handle.write_ms = (time.perf_counter() - start) * 1e3
            restore = (f"step {self._last_committed.step}" if self._last_committed is not None
                       else "none written by this engine")
            detail = str(e).rstrip(".") if isinstance(e, DynamicCkptError) else f"{type(e).__name__}: {e}"
            error = SaveError(
                f"save of step {handle.step} ({handle.reason}) failed: {detail}. Nothing of it was committed; the "
                f"previous checkpoint ({restore}) stays the restore point. Free disk space or fix the store "
                "directory's permissions; training continues."
            )
            error.__cause__ = e
            logger.error("%s", error)
            handle._finish(None, error)
            return
        finally:
            snapshot.state = None  # type: ignore[assignment]  # drop references to buffers / live tensors
        handle.write_ms = (time.perf_counter() - start) * 1e3
        if info is not None:
            self._last_committed = info
            if info.bytes > 0 and handle.write_ms > 0:
                rate = info.bytes / (handle.write_ms / 1e3)
                self._throughput = rate if self._throughput == _DEFAULT_THROUGHPUT else 0.5 * (self._throughput + rate)
            if snapshot.pending_blobs:
                self._record_blobs(info, snapshot.pending_blobs)
        logger.info("committed step %d (%s): blocking %.1f ms, write %.1f ms", handle.step, handle.reason,
                    handle.blocking_ms, handle.write_ms)
        handle._finish(info)

    def _record_blobs(self, info: CheckpointInfo, pending: dict[str, tuple[Any, ...]]) -> None:
        from ..store.manifest import read_manifest

        try:
            blobs = read_manifest(Path(info.path)).get(KEY_BLOBS, {})
        except Exception as e:  # the checkpoint is committed; only the dedup shortcut is lost
            logger.warning("could not read blob table of step %d (%s): frozen weights will be written again",
                           info.step, e)
            return
        self._snapshotter.mark_blobs_stored(pending, blobs)

    def _blob_exists(self, ref: BlobRef) -> bool:
        blobs_dir = getattr(self.store, "blobs_dir", None)
        if blobs_dir is None:
            return True
        from ..store.weights import blob_path

        return blob_path(Path(blobs_dir), ref.digest).exists()

"""One save as a unit of work: `Job`, the caller's `SaveHandle`, and `run_job`.

`run_job` is the only code that turns a snapshot into a committed checkpoint and settles
the handle; every writer (the caller's thread, `writer.ThreadWriter`, the IPC thread of
`writer.ProcessWriter`) runs jobs through it and differs only in the `StoreSave` it passes
(the store itself, or a proxy to the store in the writer process). `run_job` never calls
back into the engine: what the engine learns from a finished job (restore point, write
throughput, stored blobs) it reads from the job afterwards, on the training thread.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import ConfigError, DynamicCkptError, SaveError
from ..state.rng import RawRngState
from ..store import CheckpointInfo, CheckpointState, SaveRequest
from .overlap import PendingCopy
from .snapshot import Snapshot
from .staging import StagingMode

logger = logging.getLogger(__name__)


class StoreSave(Protocol):
    """What a writer calls to write one rank's part of a checkpoint (`CheckpointStore.save`'s shape).

    `cancel` returns `True` once the save should give up (`SaveEngine.abort`): a rank-0 store
    waiting for the other ranks' files stops waiting and commits nothing.
    """

    def __call__(self, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any],
                 cancel: Callable[[], bool]) -> CheckpointInfo | None: ...


class OnBusy(enum.StrEnum):
    """What a save does while the previous one is still writing (`SaveEngine(on_busy=...)`)."""

    WAIT = "wait"
    SKIP = "skip"

    @classmethod
    def parse(cls, value: OnBusy | str, world_size: int) -> OnBusy:
        """`value` as an `OnBusy`, checked against the number of ranks writing.

        Raises:
            `ConfigError`: an unknown value, or `"skip"` with `world_size > 1`: ranks finish writing at different
                times, and one rank skipping a step the others write would leave rank 0 waiting for files that
                never come.
        """
        try:
            on_busy = cls(value)
        except ValueError:
            raise ConfigError(f"on_busy={value!r} is invalid: expected 'wait' or 'skip'.") from None
        if on_busy == cls.SKIP and world_size > 1:
            raise ConfigError(
                f"on_busy='skip' is invalid with world_size={world_size}: ranks could disagree on which "
                "saves to skip; use on_busy='wait'."
            )
        return on_busy


class AbortFlag:
    """Set once by `SaveEngine.abort`, with the reason; read by the store's wait loop (`is_set`)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


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
        deferred (`PendingCopy | None`): with overlap, the copies that ran beside the next step; its
            `wait_ms` is how long the training thread waited for them at the next optimizer step (or
            another wait point: `SaveEngine.wait_snapshot`), `copy_ms` how long they took.
    """

    def __init__(self, step: int, reason: str) -> None:
        self.step = step
        self.reason = reason
        self.blocking_ms = 0.0
        self.staging = StagingMode.BUFFERED.value
        self.skipped: str | None = None
        self.write_ms: float | None = None
        self.writer = "sync"
        self.deferred: PendingCopy | None = None
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

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s for the save to finish without raising its error; returns `done()`."""
        return self._event.wait(timeout)

    def settle(self, info: CheckpointInfo | None = None, error: BaseException | None = None) -> None:
        """Record the save's outcome and wake its waiters: called once, by `run_job` (or by the engine for a
        skipped save), never by the handle's owner."""
        self._info, self._error = info, error
        self._event.set()


@dataclass
class Job:
    """One save handed to a writer.

    Attributes:
        snapshot (`Snapshot`): the state to write (its `state` is dropped once written).
        request (`SaveRequest`): what the save is, passed to the store unchanged.
        handle (`SaveHandle`): settled by `run_job`.
        restore_point (`str`): the checkpoint that stays the restore point if this save
            fails (`"step 12"`), for the error message.
        abort (`AbortFlag`): set by `SaveEngine.abort`.
        settled (`bool`): the engine has read what it learns from this finished job.
    """

    snapshot: Snapshot
    request: SaveRequest
    handle: SaveHandle
    restore_point: str
    abort: AbortFlag = field(default_factory=AbortFlag)
    settled: bool = False


DEFAULT_THROUGHPUT = 100e6
"""Bytes/s assumed for the emergency-save estimate before any save was measured."""


class Jobs:
    """The jobs of one engine: the last background one, a synchronous one running, and what
    the finished ones taught (restore point, write throughput).

    Used on the training thread, except `abort` (any thread).
    """

    def __init__(self) -> None:
        self.inflight: Job | None = None
        self.running_sync: Job | None = None
        self.last_committed: CheckpointInfo | None = None
        self.throughput = DEFAULT_THROUGHPUT

    @property
    def busy(self) -> bool:
        """Whether the last background job is still writing."""
        return self.inflight is not None and not self.inflight.handle.done()

    @property
    def restore_point(self) -> str:
        """The checkpoint that stays the restore point if the next save fails, for messages."""
        return f"step {self.last_committed.step}" if self.last_committed is not None else "none written by this engine"

    def new(self, snapshot: Snapshot, request: SaveRequest, handle: SaveHandle) -> Job:
        return Job(snapshot=snapshot, request=request, handle=handle, restore_point=self.restore_point)

    def run_sync(self, job: Job, save: StoreSave) -> None:
        """Write `job` on the calling thread (abortable from another thread meanwhile)."""
        self.running_sync = job
        try:
            run_job(job, save)
        finally:
            self.running_sync = None

    def abort(self, reason: str) -> None:
        """Set the abort flag of every job not finished yet (see `SaveEngine.abort`)."""
        for job in (self.inflight, self.running_sync):
            if job is not None and not job.handle.done() and not job.abort.is_set():
                job.abort.set(reason)
                logger.warning("aborting the save of step %d: %s", job.handle.step, reason)

    def record(self, job: Job | None) -> CheckpointInfo | None:
        """Learn from `job` once it is done; returns its `CheckpointInfo` if it committed (only the first time)."""
        if job is None or job.settled or not job.handle.done():
            return None
        job.settled = True
        handle = job.handle
        if handle.exception() is not None:
            return None
        info = handle.wait(0)  # done: returns at once
        if info is None:
            return None
        self.last_committed = info
        if info.bytes > 0 and handle.write_ms:
            rate = info.bytes / (handle.write_ms / 1e3)
            self.throughput = rate if self.throughput == DEFAULT_THROUGHPUT else 0.5 * (self.throughput + rate)
        return info


def run_job(job: Job, save: StoreSave) -> None:
    """Write one job through `save` and settle its handle; never raises.

    Errors become a `SaveError` on the handle (logged once) that says what failed, that
    nothing of the save was committed, and which checkpoint stays the restore point.
    """
    snapshot, handle = job.snapshot, job.handle
    start = time.perf_counter()
    info: CheckpointInfo | None = None
    try:
        if job.abort.is_set():
            raise SaveError(f"aborted before it started: {job.abort.reason}")
        snapshot.wait_copies()
        if snapshot.deferred is not None and snapshot.deferred.error is not None:
            raise snapshot.deferred.error  # a deferred copy failed, or its tensors changed before it was complete
        if isinstance(snapshot.state.rng, RawRngState):  # captured raw in the snapshot; converted here, off its path
            snapshot.state = dataclasses.replace(snapshot.state, rng=snapshot.state.rng.to_json())
        timings = {"snapshot_ms": round(snapshot.blocking_s * 1e3, 3), "staging": handle.staging}
        info = save(snapshot.state, job.request, timings=timings, cancel=job.abort.is_set)
    except BaseException as e:
        handle.write_ms = (time.perf_counter() - start) * 1e3
        handle.settle(None, _save_error(job, e))
        return
    finally:
        snapshot.state = None  # type: ignore[assignment]  # drop references to buffers / live tensors
    handle.write_ms = (time.perf_counter() - start) * 1e3
    logger.debug("committed step %d (%s): blocking %.1f ms, write %.1f ms", handle.step, handle.reason,
                handle.blocking_ms, handle.write_ms)
    handle.settle(info)


def _save_error(job: Job, cause: BaseException) -> SaveError:
    handle = job.handle
    detail = str(cause).rstrip(".") if isinstance(cause, DynamicCkptError) else f"{type(cause).__name__}: {cause}"
    if job.abort.is_set():
        what, advice = f"save of step {handle.step} ({handle.reason}) aborted ({job.abort.reason}): {detail}", ""
    else:
        what = f"save of step {handle.step} ({handle.reason}) failed: {detail}"
        advice = " Free disk space or fix the store directory's permissions; training continues."
    error = SaveError(f"{what}. Nothing of it was committed; the previous checkpoint ({job.restore_point}) stays the "
                      f"restore point.{advice}")
    error.__cause__ = cause
    logger.warning("%s", error)  # once per failed save; the handle carries the same error to its owner
    return error

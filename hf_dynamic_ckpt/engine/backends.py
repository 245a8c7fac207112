"""Who writes a job in the background: the `Writer` protocol, `ThreadWriter`, and writer priority.

A writer accepts at most one job at a time from `SaveEngine` (the engine waits for the
previous save before it submits the next) and runs it with `jobs.run_job`. `ThreadWriter`
runs it on a persistent thread; `process.ProcessWriter` runs it against a store opened in
a separate process. Both lower their priority with `writer_priority`/`set_priority`, the
one copy of that code.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Protocol

from .jobs import Job, StoreSave, run_job

logger = logging.getLogger(__name__)


class Writer(Protocol):
    """A background writer of save jobs."""

    label: str
    """What `SaveHandle.writer` reports for jobs it writes (`"thread"`, `"process"`)."""

    def submit(self, job: Job) -> None:
        """Queue `job`; returns at once. `run_job` settles the job's handle."""

    def stop(self) -> None:
        """Finish the queued job, then release the writer. Idempotent."""


def writer_priority(nice: int) -> int | None:
    """The nice value `nice` steps below the calling thread's (capped at 19); `None` if unchanged."""
    if nice <= 0 or not hasattr(os, "getpriority"):
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError:
        return None


def set_priority(pid: int, target: int | None) -> None:
    """Raise the nice value of `pid` to `target` (best effort; never lowers it).

    `pid=0` is the calling thread (Linux: `setpriority(PRIO_PROCESS, 0)` acts on one thread);
    threads it starts later (zstd workers) inherit the value. Needs no privilege.
    """
    if target is None:
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < target:
            os.setpriority(os.PRIO_PROCESS, pid, target)
    except OSError as e:
        logger.debug("could not lower the writer's priority: %s", e)


class ThreadWriter:
    """One persistent writer thread fed through a one-slot queue.

    Args:
        save (`StoreSave`): writes a job's state (e.g. `CheckpointStore.save`).
        name (`str`): the thread's name.
        nice (`int`, *optional*, defaults to `0`): nice increment of the thread.
        label (`str`, *optional*, defaults to `"thread"`): `Writer.label`.
    """

    def __init__(self, save: StoreSave, name: str, *, nice: int = 0, label: str = "thread") -> None:
        self.label = label
        self._save = save
        self._priority = writer_priority(nice)  # relative to the creating (training) thread
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        set_priority(0, self._priority)
        while True:
            job = self._queue.get()
            if job is None:
                return
            run_job(job, self._save)

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)  # after any queued job: flushes first
            self._thread.join()

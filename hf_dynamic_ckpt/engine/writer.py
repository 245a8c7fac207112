"""One save as a unit of work (`Job`, `SaveHandle`, `run_job`) and the writer process that writes it.

`run_job` turns a snapshot into a committed checkpoint and settles the handle; it never calls back into the engine,
and a failure becomes a `SaveError` on the handle, never an exception in the training loop. The writer process is
spawned (not forked: threads, CUDA), opens its own store, runs niced and maps the shared buffers once per layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DynamicCkptError, SaveError, StoreLockedError
from ..state import RawRngState
from ..store import CheckpointInfo, CheckpointState, SaveRequest
from ..store.slots import keep_newest, persist_newest, removed, room_problem, same_dir, secure, tensor_bytes
from .snapshot import Layout, PendingCopy

logger = logging.getLogger(__name__)

StoreSave = Callable[..., "CheckpointInfo | None"]
"""`CheckpointStore.save(state, request, *, timings, cancel)`; `cancel()` is `True` once the save should give up."""

PROCESS_WRITER_MIN_BUDGET = 4 << 30
"""Under a cgroup limit, the budget below which no writer process (a second interpreter) starts."""


class OnBusy(enum.StrEnum):
    """What a save does while the previous one is still writing (`SaveEngine(on_busy=...)`)."""

    WAIT = "wait"
    SKIP = "skip"

    @classmethod
    def parse(cls, value: OnBusy | str, world_size: int) -> OnBusy:
        """`value` as an `OnBusy`, checked against the number of ranks."""
        try:
            on_busy = cls(value)
        except ValueError:
            raise ConfigError(f"on_busy={value!r} is invalid: expected 'wait' or 'skip'.") from None
        if on_busy == cls.SKIP and world_size > 1:  # a rank skipping a step the others write: rank 0 waits forever
            raise ConfigError(f"on_busy='skip' is invalid with world_size={world_size}: ranks could disagree on "
                              "which saves to skip; use on_busy='wait'.")
        return on_busy


class SaveHandle:
    """A save in progress: `done()`, `wait()` (re-raises the background error). `blocking_ms`: the training thread's
    time in `SaveEngine.save`; `staging`: `"buffered"`, `"streaming"` or `"sync"`; `skipped`: why; `write_ms`;
    `writer`: `"process"` or `"sync"`; `deferred`: the overlap's `PendingCopy`."""

    def __init__(self, step: int, reason: str, *, memory: bool = False) -> None:
        self.step, self.reason = step, reason
        self.blocking_ms = 0.0
        self.staging = "buffered"
        self.skipped: str | None = None
        self.write_ms: float | None = None
        self.writer = "sync"
        self.memory = memory
        """A save into the memory tier's slots (`SaveEngine.save(memory=True)`), not the disk store."""
        self.deferred: PendingCopy | None = None
        self._event = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save finished (committed, failed or skipped)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save and return its `CheckpointInfo` (`None` on ranks > 0 or if skipped). Raises
        `TimeoutError` when it still writes after `timeout` s, its `SaveError` when it failed (the cause chained)."""
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
        """Record the outcome and wake the waiters (`run_job`, or the engine for a skipped save)."""
        self._info, self._error = info, error
        self._event.set()


@dataclass
class Job:
    """One save: its `state` (dropped once written), what to wait for before reading it (`waits`), the `request`,
    the `handle`, the checkpoint that stays the restore point if it fails, and the reason of an `abort`."""

    state: CheckpointState
    waits: list[Any]
    request: SaveRequest
    handle: SaveHandle
    restore_point: str
    aborted: str | None = None
    settled: bool = False


def run_job(job: Job, save: StoreSave) -> None:
    """Write one job through `save` and settle its handle; never raises."""
    handle, start = job.handle, time.perf_counter()
    info: CheckpointInfo | None = None
    error: SaveError | None = None
    try:
        for wait in job.waits:  # first, even for an aborted job: the next optimizer step waits for its copies
            wait.synchronize()  # (a deferred copy's error is raised here)
        if job.aborted is not None:
            raise SaveError(f"aborted before it started: {job.aborted}")
        state = job.state
        if isinstance(state.rng, RawRngState):  # captured raw at the save; converted here, off the training thread
            state = dataclasses.replace(state, rng=state.rng.to_json())
        timings = {"snapshot_ms": round(handle.blocking_ms, 3), "staging": handle.staging}
        info = save(state, job.request, timings=timings, cancel=lambda: job.aborted is not None)
    except BaseException as e:
        error = _save_error(job, e)
    finally:
        del job.state, job.waits  # the buffers or live tensors are not referred to any longer
        handle.write_ms = (time.perf_counter() - start) * 1e3
    handle.settle(info, error)


def _save_error(job: Job, cause: BaseException) -> SaveError:
    handle = job.handle
    detail = str(cause).rstrip(".") if isinstance(cause, DynamicCkptError) else f"{type(cause).__name__}: {cause}"
    if handle.memory:  # the memory tier reports it, with what it does next (`MemoryTier.settle`)
        error = SaveError(f"memory slot of step {handle.step} failed: {detail}")
        error.__cause__ = cause
        return error
    if job.aborted is not None:
        what, advice = f"save of step {handle.step} ({handle.reason}) aborted ({job.aborted}): {detail}", ""
    else:
        what = f"save of step {handle.step} ({handle.reason}) failed: {detail}"
        advice = " Free disk space or fix the store directory's permissions; training continues."
    error = SaveError(f"{what}. Nothing of it was committed; the previous checkpoint ({job.restore_point}) stays the "
                      f"restore point.{advice}")
    error.__cause__ = cause
    logger.warning("%s", error)  # once per failed save; the handle carries the same error to its owner
    return error


def writer_threads(training_threads: int | None = None, local_world_size: int | None = None) -> int:
    """zstd threads for the writer process: this rank's share of the CPUs less training's threads, at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    training = torch.get_num_threads() if training_threads is None else training_threads
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if local_world_size is None else local_world_size
    return max(1, cpus // max(1, ranks) - training)


def beside_training(spec: Any) -> Any:
    """The store's spec for the writer process: `writer_threads()` where it asks for every CPU (`0`)."""
    if getattr(spec, "compression_threads", None) == 0:
        return dataclasses.replace(spec, compression_threads=writer_threads())
    return spec


def _dumps(obj: Any, refs: dict[int, tuple[int, int]]) -> bytes:
    """`obj` pickled with each snapshot buffer (a view `refs` maps by `id`; alive, so no other object has its id) as
    its `(layout key, view)`, which the writer process resolves to its own mapping of the view (`persistent_load`)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda o: refs.get(id(o))  # type: ignore[method-assign]
    pickler.dump(obj)
    return buf.getvalue()


PERSIST_LOCK_WAIT_S = 60.0
"""How long a watcher waits for the disk store's writer lock (the training process's emergency save holds it)."""


def _open_slots(store_cls: Any, spec: Any) -> Any:
    """The memory tier's slots, or `None` (then memory jobs fail): a removed directory is not made again here."""
    if spec is None:
        return None
    try:
        return store_cls.from_spec(spec, cleanup=False) if secure(Path(spec.root), create=False) else None
    except (OSError, DynamicCkptError) as e:
        logger.warning("memory tier: the slots at %s cannot be opened (%s); this writer writes none", spec.root, e)
        return None


def _persist(store_cls: Any, spec: Any, slots: Any, opened: os.stat_result) -> None:
    """The training process ended without stopping this writer: persist the newest slot if newer than the disk
    store, under its writer lock (waited for, never broken), unless a restart already took the slots over."""
    deadline = time.monotonic() + PERSIST_LOCK_WAIT_S
    while True:
        try:
            disk = store_cls.from_spec(spec, cleanup=True)
            break
        except StoreLockedError:
            if time.monotonic() > deadline:
                logger.warning("memory tier: the disk store's writer lock stayed held; the slot was not persisted "
                               "(a restart persists it)")
                return
            time.sleep(0.2)
    try:
        if not same_dir(slots.root, opened):
            logger.info("memory tier: a restart took over the slots (it persisted them); nothing to do")
            return
        step = persist_newest(slots, disk)
        if step is not None:
            logger.warning("memory tier: the training process ended; step %d persisted from host memory", step)
    except Exception as e:  # a restart persists it
        logger.warning("memory tier: persisting the newest slot failed (%s); a restart persists it", e)
    finally:
        disk.close()


def _child_main(store_cls: Any, spec: Any, conn: Any, ready: Any, cancel: Any, nice: int | None,
                slots_spec: Any = None, margin: float = 0.15) -> None:
    """The writer process: map the layouts and write the saves it is sent until told to stop; if the training
    process goes without a stop, the newest slot is persisted."""
    torch.set_num_threads(1)
    # multiprocessing terminates daemonic children at an unclean exit: leave through `finally` (persist a slot)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    store = store_cls.from_spec(spec, cleanup=False)
    slots = _open_slots(type(store), slots_spec)
    opened = os.lstat(slots.root) if slots is not None else None
    # Niced once up, not during its start-up: a niced import of torch beside a training process that keeps every
    # core busy took seconds, and until then the memory tier's slots are written on the training thread. Best effort,
    # never lowered.
    with contextlib.suppress(OSError):
        if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    ready.set()
    views: dict[tuple[int, int], torch.Tensor] = {}
    stopped, fits = False, -1  # the slot size whose room was checked
    try:
        while (msg := conn.recv())[0] != "stop":  # EOFError: the training process ended (or was killed)
            if msg[0] == "layouts":  # the views of the layouts the parent holds, by (layout key, view)
                views = {r: v for r, v in views.items() if r[0] in msg[2]}
                for k, (flat, s) in msg[1].items():
                    views.update(((k, i), v) for i, v in enumerate(Layout(s, flat.untyped_storage()).views))
                continue
            unpickler = pickle.Unpickler(io.BytesIO(msg[1]))
            unpickler.persistent_load = views.__getitem__  # type: ignore[method-assign]
            state, request, timings, memory = unpickler.load()
            target = slots if memory and slots is not None else store
            if memory and (slots is None or not same_dir(slots.root, opened)):  # the run ended, or another process
                conn.send(("error", f"SaveError: {removed(slots.root if slots is not None else slots_spec.root)}"))
                continue
            try:
                if target is slots:
                    if slots.rank == 0:  # one rank deletes
                        keep_newest(slots)  # two slots: the newest whole one and this one
                    nbytes = tensor_bytes([state.weights, state.optimizer])
                    if nbytes != fits and (problem := room_problem(nbytes, slots, margin)):
                        raise SaveError(problem)
                    fits = nbytes
                reply: tuple[str, Any] = ("ok", target.save(state, request, timings=timings, cancel=cancel.is_set))
            except Exception as e:
                reply = ("error", f"{type(e).__name__}: {e}")
            del state
            conn.send(reply)
        stopped = True
    except (EOFError, OSError, KeyboardInterrupt, SystemExit):
        pass
    finally:
        store.close()
        conn.close()
        if slots is not None:
            if not stopped and spec.rank == 0:
                _persist(type(store), spec, slots, opened)  # type: ignore[arg-type]
            slots.close()


class ProcessWriter:
    """Writes jobs through `type(store).from_spec(store.spec)` in a spawned process, `nice` steps below training,
    once `ready`. Its IPC thread runs a job's deferred copies, ships it, waits and forwards an abort."""

    def __init__(self, store: Any, *, nice: int = 0, slots: Any = None, margin: float = 0.15) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._ready, self._cancel = ctx.Event(), ctx.Event()
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice) if nice > 0 else None
        self._proc = ctx.Process(target=_child_main, daemon=True, name="hf-dynamic-ckpt-writer", args=(
            type(store), beside_training(store.spec), child, self._ready, self._cancel, target,
            slots.spec if slots is not None else None, margin))
        main = sys.modules.get("__main__")  # spawn re-runs `__main__` in the child, which re-runs a training script
        sys.modules["__main__"] = types.ModuleType("__main__")  # without a `__main__` guard; the writer needs none
        try:
            self._proc.start()
        finally:
            if main is not None:
                sys.modules["__main__"] = main
        self.pid = self._proc.pid
        child.close()
        self._mapped: set[int] = set()  # layout keys the child maps
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name="hf-dynamic-ckpt-ipc", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Whether the process has started and opened its store, and is alive (never blocks)."""
        return self._ready.is_set() and self._proc.is_alive()

    failed = property(lambda self: not self._proc.is_alive(), doc="Whether the process has exited.")

    def submit(self, job: Job, layouts: Sequence[Layout]) -> None:
        """Queue `job`, whose buffers are views of `layouts`; returns at once (one job at a time)."""
        self._queue.put(lambda: run_job(job, lambda state, request, *, timings, cancel: self._remote_save(
            state, request, timings=timings, cancel=cancel, layouts=layouts, memory=job.handle.memory)))

    def unmap(self) -> None:
        """Let the child unmap every buffer (the engine released them): their memory is freed then."""
        self._queue.put(lambda: self._send_layouts(()))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            item()

    def _send_layouts(self, layouts: Sequence[Layout]) -> None:
        keys = {layout.key for layout in layouts}
        if keys != self._mapped:
            new = {lay.key: (lay.flat, lay.spec) for lay in layouts if lay.key not in self._mapped}
            self._conn.send(("layouts", new, keys))
            self._mapped = keys

    def _remote_save(self, state: Any, request: SaveRequest, *, timings: Any, cancel: Callable[[], bool],
                     layouts: Sequence[Layout], memory: bool = False) -> CheckpointInfo | None:
        if not self._proc.is_alive():
            raise SaveError(f"the writer process {self._proc.pid} exited with code {self._proc.exitcode}")
        self._send_layouts(layouts)
        refs = {id(v): (lay.key, i) for lay in layouts for i, v in enumerate(lay.views)}
        self._cancel.clear()  # one job at a time: an abort of an earlier job is spent
        self._conn.send(("save", _dumps((state, request, dict(timings), memory), refs)))
        try:
            while not self._conn.poll(0.05):  # polls, so that an abort reaches the child while it waits for ranks
                if cancel() and not self._cancel.is_set():
                    self._cancel.set()
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            raise SaveError(f"the writer process {self._proc.pid} died during the save") from e
        if kind == "ok":
            return payload  # type: ignore[no-any-return]
        raise SaveError(payload)

    def stop(self) -> None:
        """Finish the queued job, then stop the process (idempotent); one still starting holds nothing."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._proc.is_alive() and self._ready.is_set():
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
            self._proc.join(60)
            if self._proc.is_alive():
                logger.warning("writer process %s did not stop in 60 s; terminating it", self._proc.pid)
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._conn.close()

"""The background writers: what writes a snapshot to the store beside training, a thread or a process.

A writer accepts at most one job at a time from `SaveEngine` (the engine waits for the
previous save before it submits the next) and runs it with `jobs.run_job`. `ThreadWriter`
runs it on a persistent thread (`EngineMode.THREAD`); `ProcessWriter` (`EngineMode.PROCESS`)
runs it against a store opened in a separate process. Both lower their priority with
`writer_priority`/`set_priority`, the one copy of that code.

The writer process: the snapshot buffers live in shared memory (`BufferPool(shared=True)`),
are sent to the writer process once per (re)allocation and then referred to by name, so a
save ships only a small message. The child opens its own store (a SQLite connection must not
cross processes) from the parent store's `StoreSpec`, unchanged, with `cleanup=False`. A
parent-side `ThreadWriter` runs each job with `run_job` against `ProcessWriter._remote_save`,
which sends the state and the `SaveRequest` and waits for the reply; it only blocks on a
pipe, so it takes no CPU from training. `SaveEngine.abort` reaches the child's store
through a shared event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..store import CheckpointInfo, CheckpointState, SaveRequest, StoreSpec
from .buffers import BufferPool
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


_STOP_TIMEOUT_S = 60.0
_ABORT_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class _BufRef:
    name: str


def _map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with `fn` applied to every leaf of its dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_leaves(v, fn) for v in obj)
    return fn(obj)


def _externalize(obj: Any, names: Mapping[int, str]) -> Any:
    """Shared-memory buffers in `obj` replaced by `_BufRef`s (other tensors are sent as they are)."""

    def leaf(v: Any) -> Any:
        name = names.get(id(v)) if isinstance(v, torch.Tensor) else None
        return _BufRef(name) if name is not None else v

    return _map_leaves(obj, leaf)


def _internalize(obj: Any, buffers: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of `_externalize`, against the child's mapped buffers."""
    return _map_leaves(obj, lambda v: buffers[v.name] if isinstance(v, _BufRef) else v)


_TENSOR_FIELDS = ("weights", "optimizer", "scheduler", "scaler")


def _map_state(state: CheckpointState, fn: Callable[[Any], Any]) -> CheckpointState:
    return dataclasses.replace(state, **{f: fn(getattr(state, f)) for f in _TENSOR_FIELDS})


def _views(layouts: list[tuple[dict[torch.dtype, torch.Tensor], list[tuple[str, tuple[int, ...], torch.dtype, int]]]],
           ) -> dict[str, torch.Tensor]:
    """The named buffers of the parent's pool, as views of the shared regions it sent."""
    out: dict[str, torch.Tensor] = {}
    for regions, items in layouts:
        for name, shape, dtype, offset in items:
            out[name] = regions[dtype][offset:offset + math.prod(shape)].view(shape)
    return out


def _warm_up() -> None:
    """Import what a save needs and read the library versions (manifest) once, before the
    process reports ready, so its first save costs what later ones do; best effort."""
    try:
        import zstandard  # noqa: F401

        from ..store import manifest, optpack, store  # noqa: F401

        manifest.library_versions()
    except Exception as e:  # the save itself reports real problems
        logger.debug("writer process warm-up: %s", e)


def _worker_main(store_cls: Any, spec: StoreSpec, conn: Any, priority: int | None = None, ready: Any = None,
                 cancel: Any = None) -> None:
    """Entry point of the writer process: receive buffers and save requests until told to stop.

    `ready` (a `multiprocessing.Event`) is set once the interpreter has imported torch and
    opened the store: until then the parent writes its saves on a thread instead. `cancel`
    (a `multiprocessing.Event`) is set by the parent to abort the save in progress.
    """
    set_priority(0, priority)  # the parent already did, right after the start; this covers a race
    torch.set_num_threads(1)
    store = store_cls.from_spec(spec, cleanup=False)
    _warm_up()
    if ready is not None:
        ready.set()
    cancelled: Callable[[], bool] = cancel.is_set if cancel is not None else (lambda: False)
    buffers: dict[str, torch.Tensor] = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, ConnectionResetError):  # the training process ended (or was killed): so do we
                return
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "buffers":
                buffers = _views(msg[1])
                continue
            _, shipped, request, timings = msg
            state = _map_state(shipped, functools.partial(_internalize, buffers=buffers))
            try:
                info = store.save(state, request, timings=timings, cancel=cancelled)
            except BaseException as e:
                reply: tuple[Any, ...] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
            else:
                reply = ("ok", info, None)
            del state, shipped
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError):  # nobody waits for the answer any more
                return
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
        conn.close()


def _start_without_main(proc: Any) -> None:
    """Start a spawn-context process without re-running the caller's `__main__` in the child.

    Spawn normally re-imports the main script in the child, which re-runs a training
    script that lacks an `if __name__ == "__main__":` guard. The writer needs nothing from
    `__main__` (its target lives in this module), so a bare stand-in is shown while the
    preparation data is taken.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        proc.start()
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class WriterProcessError(RuntimeError):
    """The writer process reported an error (its message and traceback are in the text)."""


class ProcessWriter:
    """Writes jobs with a store opened in a spawned process, over shared-memory buffers.

    The process is started by the constructor and becomes usable only once it reports
    `ready` (a spawned interpreter takes about a second to import torch and open the store);
    `SaveEngine` never waits for that: it writes on a thread until `ready` is true.

    Args:
        spec (`StoreSpec`): the parent store's spec; the child opens `store_cls.from_spec(spec, cleanup=False)`.
        store_cls (`type`): the store class (importable in the child).
        pool (`BufferPool`): the engine's shared-memory buffer pool.
        nice (`int`, *optional*, defaults to `0`): nice increment of the process.
    """

    label = "process"

    def __init__(self, spec: StoreSpec, store_cls: type, pool: BufferPool, *, nice: int = 0) -> None:
        ctx = mp.get_context("spawn")  # fork would copy the training process's threads and CUDA state
        self._conn, child = ctx.Pipe()
        self._ready_event = ctx.Event()
        self._cancel = ctx.Event()
        self._ready = False
        priority = writer_priority(nice)
        self._proc = ctx.Process(target=_worker_main,
                                 args=(store_cls, spec, child, priority, self._ready_event, self._cancel),
                                 daemon=True, name="hf-dynamic-ckpt-writer")
        _start_without_main(self._proc)
        if self._proc.pid is not None:
            # At once, so the interpreter start-up (importing torch, ~1 s of CPU) already runs at
            # the writer's lower priority instead of competing with the training steps.
            set_priority(self._proc.pid, priority)
        child.close()
        self._pool = pool
        self._sent_generation = -1
        self._ipc = ThreadWriter(self._remote_save, name="hf-dynamic-ckpt-ipc")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def ready(self) -> bool:
        """Whether the process has started and opened its store (never blocks)."""
        if not self._ready:
            self._ready = self._ready_event.is_set()
        return self._ready

    @property
    def failed(self) -> bool:
        """Whether the process exited before it became ready (e.g. it could not open the store)."""
        return not self.ready and not self._proc.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the process is ready or has died; returns `ready`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready and self._proc.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._ready_event.wait(0.1 if left is None else min(0.1, left))
        return self.ready

    def submit(self, job: Job) -> None:
        self._ipc.submit(job)

    def _remote_save(self, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any],
                     cancel: Callable[[], bool]) -> CheckpointInfo | None:
        """`StoreSave` for the IPC thread: ship the job to the child and wait for its reply."""
        if not self._proc.is_alive():
            raise WriterProcessError(f"writer process {self._proc.pid} exited with code {self._proc.exitcode}")
        buffers = self._pool.buffers
        if self._pool.generation != self._sent_generation:
            # A few shared regions per layout, not one message entry per tensor: the child
            # rebuilds the named views from the offsets.
            self._conn.send(("buffers", [(dict(layout.regions), [(name, shape, dtype, layout.offsets[name])
                                                                 for name, shape, dtype in layout.spec])
                                         for layout in self._pool.layouts.values()]))
            self._sent_generation = self._pool.generation
        names = {id(t): name for name, t in buffers.items()}
        self._cancel.clear()  # one job at a time: an abort of an earlier job is spent
        self._conn.send(("save", _map_state(state, lambda v: _externalize(v, names)), request, dict(timings)))
        try:
            # Poll so that an abort reaches the child while it waits (for other ranks' files).
            while not self._conn.poll(_ABORT_POLL_S):
                if cancel() and not self._cancel.is_set():
                    self._cancel.set()
            kind, payload, tb = self._conn.recv()
        except EOFError as e:
            raise WriterProcessError(f"writer process {self._proc.pid} died during the save") from e
        if kind == "ok":
            return payload  # type: ignore[no-any-return]
        logger.debug("writer process traceback:\n%s", tb)
        raise WriterProcessError(payload)

    def stop(self) -> None:
        self._ipc.stop()
        if not self.ready and self._proc.is_alive():
            # Still importing: it holds no job and wrote nothing, so there is nothing to flush.
            self._proc.terminate()
            self._proc.join()
        elif self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
            self._proc.join(_STOP_TIMEOUT_S)
            if self._proc.is_alive():
                logger.warning("writer process %s did not stop in %.0f s; terminating it", self._proc.pid,
                               _STOP_TIMEOUT_S)
                self._proc.terminate()
                self._proc.join()
        self._conn.close()
        self._proc.close()

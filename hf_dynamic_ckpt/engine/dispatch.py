"""Which writer takes a background job: `Dispatcher`.

Thread mode has one `ThreadWriter`. Process mode starts a `ProcessWriter` when it is first
needed (`ensure`: `SaveEngine.prepare`, which a run calls once it is attached and, after a
resume, once the optimizer tier is read; or the first save), not when the engine is created:
the interpreter start-up (~1 s of CPU) must not compete with a resume on its way to the
first step. Until that process reports ready, jobs go to a stand-in `ThreadWriter` (so no
save waits for the start-up); a process that dies before it is ready, or a `/dev/shm` too
small for its shared buffers, switches the dispatcher to thread mode for good. The writer
process compresses on the CPUs training leaves (`beside_training`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

from ..config import EngineMode
from ..store import StoreSpec, usable_cpus
from .buffers import SHM_DIR, BufferPool
from .jobs import SaveHandle, StoreSave
from .writer import ProcessWriter, ThreadWriter, Writer

logger = logging.getLogger(__name__)

STARTING_LABEL = "thread (process starting)"


def writer_threads(training_threads: int | None = None, local_world_size: int | None = None) -> int:
    """zstd threads for a writer that runs beside training (the writer process's, `beside_training`).

    This rank's share of the CPUs it may use (`LOCAL_WORLD_SIZE` ranks on the node, as
    torchrun sets it) less the training's intra-op threads (`torch.get_num_threads()`), at
    least 1. Every CPU (the store's own default) made steps that ran while a write was in
    flight slower: on 2 cores, one training thread, a 42M full fine-tune, +6.5 to +19 % with
    2 threads, +6 to +14 % with 1 (docs/benchmarks.md, "Overhead in a Trainer run").
    """
    if training_threads is None:
        import torch

        training_threads = torch.get_num_threads()
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, usable_cpus() // max(1, local_world_size) - training_threads)


def beside_training(spec: StoreSpec) -> StoreSpec:
    """`spec` for a writer process: `writer_threads()` where it asks for every CPU (`0`), else as given.

    A synchronous or emergency save, which training waits for, keeps every CPU (the store's own).
    """
    return dataclasses.replace(spec, compression_threads=writer_threads()) if spec.compression_threads == 0 else spec


class Dispatcher:
    """Owns an engine's background writers and picks the one for each job.

    Args:
        mode (`EngineMode`): `THREAD` or `PROCESS` (`SYNC` never dispatches).
        save (`StoreSave`): what thread writers call (the store's `save`, looked up per call).
        spec (`Callable[[], StoreSpec]`): the store's spec, for the writer process.
        store_cls (`type`): the store class the writer process opens.
        pool (`BufferPool`): the snapshot buffers (shared memory in process mode).
        nice (`int`): nice increment of the writers.
        name (`str`): suffix of the writer threads' names.
    """

    def __init__(self, mode: EngineMode, save: StoreSave, *, spec: Callable[[], StoreSpec], store_cls: type,
                 pool: BufferPool, nice: int, name: str) -> None:
        self.mode = mode
        self._save = save
        self._spec = spec
        self._store_cls = store_cls
        self._pool = pool
        self._nice = nice
        self._name = name
        self._lock = threading.Lock()
        self.writer: Any = None
        self.startup_writer: ThreadWriter | None = None  # process mode, until the process is ready
        self.shm_dir = SHM_DIR  # where the shared buffers are allocated

    def ensure(self) -> Any:
        """The main writer of the current mode, started if needed (a writer process: in the background)."""
        with self._lock:
            if self.writer is None:
                if self.mode == EngineMode.PROCESS:
                    self.writer = ProcessWriter(self._spec(), self._store_cls, self._pool, nice=self._nice)
                else:
                    self.writer = ThreadWriter(self._save, name=f"hf-dynamic-ckpt-writer-{self._name}", nice=self._nice)
            return self.writer

    def pick(self, handle: SaveHandle) -> Writer:
        """The writer for the job of `handle` (sets `handle.writer`)."""
        writer = self.ensure()
        if self.mode != EngineMode.PROCESS:
            handle.writer = writer.label
            return writer  # type: ignore[no-any-return]
        if writer.ready:
            handle.writer = writer.label
            if self.startup_writer is not None:  # idle: the save before this one has finished
                self.startup_writer.stop()
                self.startup_writer = None
            return writer  # type: ignore[no-any-return]
        if writer.failed:
            logger.warning("the writer process %s exited before it was ready; writing on a thread instead", writer.pid)
            self.use_threads()
            fallback = self.ensure()
            handle.writer = fallback.label
            return fallback  # type: ignore[no-any-return]
        handle.writer = STARTING_LABEL
        logger.debug("save of step %d written by a thread: the writer process is still starting", handle.step)
        if self.startup_writer is None:
            self.startup_writer = ThreadWriter(self._save, name=f"hf-dynamic-ckpt-startup-writer-{self._name}",
                                               nice=self._nice)
        return self.startup_writer

    def shared_memory_fits(self, needed: int, margin: float) -> bool:
        """Whether `/dev/shm` can hold `needed` more bytes of shared buffers, keeping `margin` of it free.

        Docker gives containers 64 MiB of `/dev/shm` by default; a shared buffer that does not
        fit there would fail with SIGBUS on first touch instead of a clean error.
        """
        free = self.shm_free()
        if free is None or needed <= free * (1.0 - margin):
            return True
        mib = 1 << 20
        logger.warning(
            "the process writer needs %.1f MiB more shared memory but %s has %.1f MiB free: using the thread "
            "writer instead (enlarge /dev/shm, e.g. `docker run --shm-size`, to use mode='process')",
            needed / mib, self.shm_dir, free / mib,
        )
        return False

    def shm_free(self) -> int | None:
        try:
            return int(shutil.disk_usage(self.shm_dir).free)
        except OSError:
            return None

    def use_threads(self) -> None:
        """Switch to thread mode for good (stops a writer process)."""
        if self.writer is not None and self.mode == EngineMode.PROCESS:
            self.writer.stop()
            self.writer = None
        self.mode = EngineMode.THREAD

    def wait_ready(self, timeout: float | None) -> bool:
        """Process mode: wait for the writer process (see `ProcessWriter.wait_ready`); `True` otherwise."""
        if self.mode != EngineMode.PROCESS:
            return True
        return bool(self.ensure().wait_ready(timeout))

    def stop(self) -> None:
        """Flush and stop every writer (at most one of them holds a job). Idempotent."""
        for name in ("startup_writer", "writer"):
            w = getattr(self, name)
            if w is not None:
                w.stop()
                setattr(self, name, None)

"""Bounded parallel map for the L1 container: frames (de)compressed on a few threads, in order."""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import SaveError
from .spec import StoreSpec


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    return max(1, _usable_cpus() // max(1, local_world_size) - training_threads)


def beside_training(spec: StoreSpec) -> StoreSpec:
    """`spec` for a writer process: `writer_threads()` where it asks for every CPU (`0`), else as given.

    A synchronous or emergency save, which training waits for, keeps every CPU (the store's own).
    """
    return dataclasses.replace(spec, compression_threads=writer_threads()) if spec.compression_threads == 0 else spec


def resolve_threads(threads: int) -> int:
    """Maps the user-facing thread count to zstandard's (`0`/`-1`: all usable CPUs)."""
    if threads in (0, -1):
        n = _usable_cpus()
        return n if n > 1 else 0
    if threads < -1:
        raise SaveError(f"threads={threads} is invalid; use 0 or -1 (auto), 1 (no workers) or N > 1.")
    return 0 if threads == 1 else threads



def ordered_map(fn: Any, items: Iterable[Any], workers: int) -> Iterator[Any]:
    """`map(fn, items)` in order, on `workers` threads (0: inline) with at most 2x`workers` results pending."""
    if workers <= 0:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="tensorpack") as pool:
        pending: deque[Future[Any]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()

"""Bounded parallel map for the L1 container: frames (de)compressed on a few threads, in order."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import SaveError


def resolve_threads(threads: int) -> int:
    """Maps the user-facing thread count to zstandard's (`0`/`-1`: all usable CPUs)."""
    if threads in (0, -1):
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            n = os.cpu_count() or 1
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

"""What every `hf-dynamic-ckpt` command shares: finding the store, opening it safely, printing.

ROOT may be the store directory (holding ``catalog.db`` and one folder per task) or the
training ``output_dir`` (its ``smart_ckpt/`` is used). Commands that only look open the store
so that they write nothing: the catalog is an in-memory copy of ``catalog.db`` synced with the
manifests (``CheckpointStore(..., read_only=True)``), and only `verify` records the statuses it found; a folder
that holds no store is an error (exit 2), never a place where a catalog gets created.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from .. import store as stores
from ..constants import BLOBS_DIR, DEFAULT_TASK_ID
from ..store import CheckpointInfo


def human_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_number(v: Any) -> str:
    """Floats to 4 significant digits (``0.1234567`` -> ``0.1235``); other values as they are."""
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


class UsageError(Exception):
    """A command was pointed at something it cannot use (exit code 2, message on stderr)."""


def usage_error(message: str) -> int:
    print(f"hf-dynamic-ckpt: error: {message}", file=sys.stderr)
    return 2


OPTIONS_ENV = "HF_DYNAMIC_CKPT_STORAGE_OPTIONS"
"""JSON object of fsspec storage options for a URL ROOT (e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``)."""


def storage_options() -> dict[str, Any]:
    """The storage options a command passes for a URL ROOT (``$HF_DYNAMIC_CKPT_STORAGE_OPTIONS``)."""
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise UsageError(f"{OPTIONS_ENV} is not valid JSON ({e}); expected an object such as "
                         '{"endpoint_url": "http://127.0.0.1:9000"}.') from None
    if not isinstance(value, dict):
        raise UsageError(f"{OPTIONS_ENV} must be a JSON object, not {type(value).__name__}.")
    return value


def url_store(url: str, task: str, *, cache: str, **kwargs: Any) -> Any:
    from ..store import CheckpointStore, default_cache_dir

    base = default_cache_dir(url, 0)
    cache_dir = base if cache == "writer" else base.parent / "cli"
    return CheckpointStore(url, task_id=task, storage_options=storage_options(), cache_dir=cache_dir, **kwargs)


def find_root(path: str | os.PathLike[str]) -> Any:
    """The store directory for a user-given path (the store itself or a training output_dir), or a URL.

    Raises:
        `UsageError`: a URL that cannot be used.
        `DynamicCkptError`: a local path that holds no store (`store.store.find_root`: the message says what to pass).
    """
    from ..store import check_url, is_url

    if is_url(os.fspath(path)):
        try:
            check_url(os.fspath(path))
        except Exception as e:
            raise UsageError(str(e)) from None
        return os.fspath(path)
    return stores.find_root(path)


def root_of(args: argparse.Namespace) -> Path:
    return find_root(args.root)


def tasks(root: Any, task: str | None) -> list[str]:
    """Tasks to look at: the one asked for, else every folder under ROOT that holds checkpoints."""
    if task is not None:
        return [task]
    if isinstance(root, str):  # a URL: the task prefixes under it
        from ..store import Remote, RemoteSpec

        names = Remote(RemoteSpec(root, storage_options()), DEFAULT_TASK_ID).tasks()
        return [n for n in names if not n.startswith(".") and n != BLOBS_DIR] or [DEFAULT_TASK_ID]
    return [p.name for p in stores.task_dirs(root)] or [DEFAULT_TASK_ID]


def single_task(root: Path, task: str | None) -> str:
    if task is not None:
        return task
    found = tasks(root, None)
    if len(found) > 1:
        raise UsageError(f"{root} holds several tasks ({', '.join(found)}); choose one with --task.")
    return found[0]


def open_reader(root: Path, task: str) -> Any:
    """A store that writes nothing new (``read_only``); a URL's manifests go into the commands' cache."""
    if isinstance(root, str):  # a URL: the manifests are pulled into a cache of the commands' own
        return url_store(root, task, cache="cli", cleanup=False, read_only=True)
    return stores.CheckpointStore(root, task_id=task, read_only=True)


def open_writer(root: Path, task: str, *, cleanup: bool = True) -> Any:
    """A store for commands that change it (pin, rm): takes the task's writer lock, so a command
    never races a training run that is saving (`StoreLockedError` names the holder). `gc` opens
    with `cleanup=False` and takes the lock itself, so that its report lists the leftovers."""
    from ..store import CheckpointStore

    if isinstance(root, str):  # a URL: the lock is advisory there (docs/storage.md)
        return url_store(root, task, cache="cli", cleanup=cleanup)
    if not (root / task).is_dir():
        raise UsageError(f"task {task!r} has no folder under {root}; available: {', '.join(tasks(root, None))}.")
    # A command refuses at once (no wait) when another host holds the lock: the message names it.
    return CheckpointStore(root, task_id=task, cleanup=cleanup, lock_wait_s=0.0)


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def info_json(i: CheckpointInfo) -> dict[str, Any]:
    return {"task": i.task_id, "step": i.step, "reason": i.reason, "tiers": sorted(t.value for t in i.tiers),
            "bytes": i.bytes, "loss": i.loss, "healthy": i.healthy, "pinned": i.pinned, "abandoned": i.abandoned,
            "status": i.status, "saved_at": i.save_time, "recovery_cost_ms": i.recovery_cost_ms, "path": i.path,
            "world_size": i.world_size}


def dump_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, allow_nan=False, default=str)
    sys.stdout.write("\n")


class Progress:
    """A counter on stderr: redrawn in place on a terminal, one line per item otherwise."""

    def __init__(self, total: int, stream: TextIO, label: str = "verify") -> None:
        self.total, self.stream, self.n, self.label = total, stream, 0, label
        self.tty = stream.isatty()

    def step(self, item: str) -> None:
        self.n += 1
        width = 24
        done = int(width * self.n / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        text = f"{self.label} [{bar}] {self.n}/{self.total} {item}"
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:100])
            if self.n == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

"""Finding a store from a path a user gives, and opening it to read without writing anything.

A user names a store by its directory (the one holding ``catalog.db`` and one folder per
task) or by the training ``output_dir`` (its ``smart_ckpt/`` is the store, as
`SmartCkptConfig.resolve_root` puts it). `find_root` turns either into the store directory;
a path that holds no store is an error that says what to pass, never a place where a catalog
gets created. `open_reader` opens a found store so that reading changes nothing: a read never
writes, so the catalog is an in-memory copy of the file synced with the manifests
(``read_only=True``, `Catalog.snapshot`); the file stays byte for byte as the writer left it.

`load_checkpoint`, `export_checkpoint` and the read commands of `hf-dynamic-ckpt` use both.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path

from ..constants import BLOBS_DIR, CATALOG_NAME, MANIFEST_NAME, STEP_DIR_PREFIX, TIMELINES_NAME
from ..errors import CheckpointNotFoundError, ConfigError
from .catalog import Catalog
from .store import CheckpointStore

logger = logging.getLogger(__name__)

STORE_DIR = "smart_ckpt"
"""The store's folder under a training `output_dir` (`SmartCkptConfig.resolve_root`)."""

_WHAT_TO_PASS = f"pass the store directory (the one holding {CATALOG_NAME}) or the training output_dir that holds " \
                f"{STORE_DIR}/"


def task_dirs(root: Path) -> list[Path]:
    """The task folders of a store directory: real folders (no links) that hold checkpoints or a timelines record."""
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name != BLOBS_DIR:
            try:
                if any(c.name.startswith(STEP_DIR_PREFIX) or c.name == TIMELINES_NAME for c in p.iterdir()):
                    out.append(p)
            except OSError:
                continue
    return out


def is_store(root: Path) -> bool:
    """Whether `root` is a store directory (a catalog, or at least one task folder)."""
    return root.is_dir() and ((root / CATALOG_NAME).is_file() or bool(task_dirs(root)))


def find_root(path: str | os.PathLike[str]) -> Path:
    """The store directory of a local path: the store itself, or a training output_dir holding ``smart_ckpt/``.

    Args:
        path (`str` or `os.PathLike`): what the user passed as the store.

    Returns:
        `Path`: the store directory (`path`, or `path/smart_ckpt`).

    Raises:
        `CheckpointNotFoundError`: `path` does not exist or holds no store.
        `ConfigError`: `path` is a file, or a task or checkpoint directory inside a store (the message names the
            store directory to pass instead).

    Example:
        ```python
        >>> find_root("out")  # a training output_dir
        PosixPath('out/smart_ckpt')
        ```
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointNotFoundError(f"root {root} does not exist; {_WHAT_TO_PASS}.")
    if not root.is_dir():
        raise ConfigError(f"root {root} is a file, not a directory; {_WHAT_TO_PASS}.")
    if (root / MANIFEST_NAME).exists() or any(p.name.startswith(STEP_DIR_PREFIX) for p in root.iterdir()):
        store_root = root.parent.parent if (root / MANIFEST_NAME).exists() else root.parent
        raise ConfigError(f"root {root} is a checkpoint or task directory, not a store root; pass {store_root} (the "
                          f"directory holding {CATALOG_NAME}) and name the checkpoint by its reference and task.")
    if is_store(root):
        return root
    if is_store(root / STORE_DIR):
        return root / STORE_DIR
    raise CheckpointNotFoundError(f"no hf_dynamic_ckpt store under {root}: {_WHAT_TO_PASS}.")


def open_reader(root: Path, task_id: str) -> CheckpointStore:
    """Open the store directory `root` (see `find_root`) to read task `task_id`, creating and changing nothing.

    The store is opened ``read_only``: its catalog is an in-memory copy of the file, synced with
    the manifests; a finding of the reader (a corrupt checkpoint) stays in that copy. No writer
    lock is taken and no leftover is removed.
    """
    return CheckpointStore(root, task_id=task_id, cleanup=False, read_only=True)


def record_findings(root: Path, task_id: str, statuses: Mapping[int, str]) -> None:
    """Record what `hf-dynamic-ckpt verify` found (``{step: "ok" | "corrupt"}``) in the catalog file of `root`,
    so that a later `ls` shows it; best effort (a read-only or locked catalog keeps its rows, the manifests stay
    the truth). Only rows whose status differs are written."""
    try:
        Catalog.record_statuses(root / CATALOG_NAME, task_id, statuses)
    except sqlite3.Error as e:
        logger.debug("catalog %s not updated with the verify findings (%s)", root / CATALOG_NAME, e)

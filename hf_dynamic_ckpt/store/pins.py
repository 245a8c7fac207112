"""Pin markers: `pin` and `unpin` of one committed checkpoint of a `Task`, mirrored to the object store for URL roots.

A pinned checkpoint has a `PINNED` marker next to its manifest, or was saved with ``pinned`` in its
manifest; retention and `gc` never delete it. The caller holds the store's lock and passes the
checkpoint as its directory describes it now (`CheckpointStore` re-reads it before either call).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..constants import KEY_MANIFEST_CHECKSUM, KEY_PINNED, MANIFEST_NAME, PINNED_MARKER
from . import manifest as mf
from . import remote_sync as rs
from .task import Task
from .types import CheckpointInfo


def pin(task: Task, info: CheckpointInfo) -> CheckpointInfo:
    """Write the `PINNED` marker of `info` (fsynced), mirror it, record it; returns the pinned info."""
    marker = Path(info.path) / PINNED_MARKER
    with task.fs.create(marker) as f:
        os.fsync(f.fileno())
    task.fs.fsync_dir(marker.parent)
    if task.remote is not None:
        rs.mirror_step(task, task.remote, info.step)
    info = dataclasses.replace(info, pinned=True)
    task.record(info)
    return info


def unpin(task: Task, info: CheckpointInfo) -> CheckpointInfo:
    """Remove the marker of `info` and a pin requested at save time (the manifest is rewritten atomically)."""
    path = Path(info.path)
    manifest = task.read_manifest(info.step)
    if manifest.get(KEY_PINNED):
        new = {k: v for k, v in manifest.items() if k != KEY_MANIFEST_CHECKSUM}
        new[KEY_PINNED] = False
        new[KEY_MANIFEST_CHECKSUM] = mf.compute_manifest_checksum(new)
        mf.write_manifest(path, new, name=MANIFEST_NAME + ".new")
        task.fs.replace(path / (MANIFEST_NAME + ".new"), path / MANIFEST_NAME)
    task.fs.unlink(path / PINNED_MARKER)
    task.fs.fsync_dir(path)
    if task.remote is not None:
        rs.mirror_step(task, task.remote, info.step)
    info = task.scan(info.step) or info
    task.record(info)
    return info

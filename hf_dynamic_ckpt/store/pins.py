"""Pin markers of `CheckpointStore` (a mixin): `pin` and `unpin`, mirrored to the object store for URL roots."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import KEY_PINNED, MANIFEST_NAME, PINNED_MARKER
from . import manifest as mf
from . import remote_sync as rs
from .fs import LocalFS
from .types import CheckpointInfo

if TYPE_CHECKING:
    from collections.abc import Callable

    from .task import Task

Ref = str | int | os.PathLike[str] | CheckpointInfo


class Pins:
    """`pin` / `unpin` over `self.task`, `self.fs`; `self._own` finds the checkpoint on disk."""

    task: Task
    fs: LocalFS
    _lock: threading.RLock

    if TYPE_CHECKING:
        def _own(self, ref: Ref, what: str) -> CheckpointInfo: ...
        def _check_writable(self, what: str) -> None: ...
        def _remote(self, fn: Callable[..., Any], *args: Any) -> None: ...

    def pin(self, ref: Ref) -> CheckpointInfo:
        """Protect a checkpoint from retention and gc (writes a `PINNED` marker next to the manifest)."""
        self._check_writable("pin")
        with self._lock:
            info = self._own(ref, "pin")
            marker = Path(info.path) / PINNED_MARKER
            with self.fs.create(marker) as f:
                os.fsync(f.fileno())
            self.fs.fsync_dir(marker.parent)
            self._remote(rs.mirror_step, info.step)
            info = dataclasses.replace(info, pinned=True)
            self.task.record(info)
            return info

    def unpin(self, ref: Ref) -> CheckpointInfo:
        """Undo `pin` (and a pin requested at save time: the manifest is rewritten atomically)."""
        self._check_writable("unpin")
        with self._lock:
            info = self._own(ref, "unpin")
            path = Path(info.path)
            manifest = self.task.read_manifest(info.step)
            if manifest.get(KEY_PINNED):
                new = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
                new[KEY_PINNED] = False
                new["manifest_checksum"] = mf.compute_manifest_checksum(new)
                mf.write_manifest(path, new, name=MANIFEST_NAME + ".new")
                self.fs.replace(path / (MANIFEST_NAME + ".new"), path / MANIFEST_NAME)
            self.fs.unlink(path / PINNED_MARKER)
            self.fs.fsync_dir(path)
            self._remote(rs.mirror_step, info.step)
            info = self.task.scan(info.step) or info
            self.task.record(info)
            return info


"""Timelines: which run a checkpoint belongs to, and which checkpoints a later run abandoned.

Resuming from a checkpoint older than the newest one (or starting fresh on a task that
has checkpoints) forks a new timeline. Checkpoints of other timelines newer than the fork
point become *abandoned*: never chosen by ``auto``/``best``/``fastest``, still listed
(``include_abandoned``) and restorable by ``step:N`` or path, removed only by retention or
``gc`` once the current timeline has committed a step greater than theirs, never while
pinned. Nothing is deleted when a timeline forks.

The truth is one small file per task, ``<task>/timelines.json``, replaced atomically
(temp + fsync + rename), so a SIGKILL leaves either the old record or the new one, never
half a fork. A checkpoint is identified by ``(step, created_at)`` from its manifest, which
survives tier deletion and tells a replaced step apart from the checkpoint that was
abandoned. Layout::

    {"format": 1,
     "current": {"timeline", "session", "after_step", "parent_step", "parent_timeline", "since"} | null,
     "abandoned": [{"step", "created_at", "timeline", "session", "by", "at"}, ...],
     "forks": [{"timeline", "session", "after_step", "at"}, ...]}       # the last 100
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..constants import TIMELINES_NAME
from ..jsonutil import loads_bounded
from .fs import LocalFS
from .spec import Lineage
from .types import CheckpointInfo

logger = logging.getLogger(__name__)

RECORD_FORMAT = 1
_MAX_BYTES = 16 << 20
_KEEP_FORKS = 100

Key = tuple[int, float]
"""Identity of one checkpoint: (step, manifest created_at)."""


def key_of(info: CheckpointInfo) -> Key:
    return int(info.step), float(info.save_time)


def empty_record() -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "current": None, "abandoned": [], "forks": []}


def _valid(record: Any) -> bool:
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        return False
    current, abandoned = record.get("current"), record.get("abandoned")
    if current is not None and not (isinstance(current, dict) and isinstance(current.get("timeline"), str)):
        return False
    return isinstance(abandoned, list) and all(
        isinstance(e, dict) and isinstance(e.get("step"), int) and isinstance(e.get("created_at"), int | float)
        for e in abandoned)


def fork_record(record: dict[str, Any], infos: Iterable[CheckpointInfo], *, timeline: str, after_step: int | None,
                session: str, parent: Lineage | None) -> tuple[dict[str, Any], list[int]]:
    """The record after forking `timeline` (pure).

    Every checkpoint in `infos` of another timeline (or of none) with ``step > after_step``
    (every one when `after_step` is `None`) is added to the abandoned set; the checkpoint
    the new timeline resumes from (`parent.parent_step` of `parent.parent_timeline`) is
    taken out of it, since the new timeline continues it.

    Returns:
        `tuple[dict, list[int]]`: the new record and the steps newly abandoned.
    """
    now = time.time()
    infos = list(infos)
    present = {key_of(i) for i in infos}
    entries = {(e["step"], float(e["created_at"])): e for e in record.get("abandoned", [])
               if (e["step"], float(e["created_at"])) in present}  # forget checkpoints that are gone
    newly = []
    for info in infos:
        own = info.lineage.timeline if info.lineage is not None else None
        if own == timeline or (after_step is not None and info.step <= after_step) or key_of(info) in entries:
            continue
        entries[key_of(info)] = {"step": info.step, "created_at": info.save_time, "timeline": own,
                                 "session": info.lineage.session if info.lineage is not None else None,
                                 "by": timeline, "at": now}
        newly.append(info.step)
    if parent is not None and parent.parent_step is not None:
        for info in infos:
            own = info.lineage.timeline if info.lineage is not None else None
            if info.step == parent.parent_step and (parent.parent_timeline is None or own == parent.parent_timeline):
                entries.pop(key_of(info), None)
    current = {"timeline": timeline, "session": session, "after_step": after_step,
               "parent_step": parent.parent_step if parent else None,
               "parent_timeline": parent.parent_timeline if parent else None, "since": now}
    forks = [*record.get("forks", []), {"timeline": timeline, "session": session, "after_step": after_step, "at": now}]
    new = {"format": RECORD_FORMAT, "current": current,
           "abandoned": sorted(entries.values(), key=lambda e: (e["step"], e["created_at"])),
           "forks": forks[-_KEEP_FORKS:]}
    return new, sorted(newly)


class Timelines:
    """The timelines record of one task (read cached by file identity; written atomically).

    Args:
        task_dir (`Path`): the task directory.
        fs (`LocalFS`): the storage seam.
    """

    def __init__(self, task_dir: Path, fs: LocalFS) -> None:
        self.path = Path(task_dir) / TIMELINES_NAME
        self.fs = fs
        self._cache: tuple[Any, dict[str, Any]] | None = None

    def read(self) -> dict[str, Any]:
        """The record; an empty one when there is none. An unreadable record is logged and read as empty."""
        st = self.fs.lstat(self.path)
        if st is None:
            return empty_record()
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._cache is not None and self._cache[0] == sig:
            return self._cache[1]
        try:
            record = loads_bounded(self.fs.read_bytes(self.path, limit=_MAX_BYTES))
        except (OSError, ValueError) as e:
            record = e
        if not _valid(record):
            logger.error("%s is unreadable or malformed (%s); treating no checkpoint as abandoned. Retention will not "
                         "remove abandoned checkpoints until a new fork rewrites it.", self.path,
                         record if isinstance(record, Exception) else "unexpected content")
            record = {**empty_record(), "unreadable": True}
        self._cache = (sig, record)
        return record

    def abandoned(self) -> set[Key]:
        return {(e["step"], float(e["created_at"])) for e in self.read()["abandoned"]}

    def current(self) -> dict[str, Any] | None:
        return self.read().get("current")

    def write(self, record: dict[str, Any], *, tag: str) -> None:
        data = json.dumps(record, indent=1, sort_keys=True).encode() + b"\n"
        self.fs.write_atomic(self.path, data, tmp_tag=tag)
        self._cache = None

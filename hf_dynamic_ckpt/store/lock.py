"""One writer per task: an advisory lock on ``<task>/.writer.lock`` that names its holder.

The committing process of a run (rank 0, opened with ``cleanup=True``) takes an exclusive
`flock` on the lock file and writes who it is into it (pid, host, session, since when,
the process start time). The kernel releases the lock when that process dies, so a
crashed run never blocks the next one. A second live writer is refused with
`StoreLockedError` naming the holder: two writers on one task interleave their
checkpoints, and each would report the other's files as its own saves.

`takeover=True` is for the one case the kernel cannot settle: the recorded holder is gone
but the lock is still held, because a process it forked (a data-loader worker) inherited
the open file. The lock file is then replaced by a new one (a new inode, locked before it
is renamed into place); the orphan keeps a lock on the old inode, which nobody opens any
more. A holder that is still running is never taken over.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, BinaryIO

from ..constants import WRITER_LOCK_NAME
from ..errors import StoreLockedError
from ..jsonutil import loads_bounded
from .fs import LocalFS

logger = logging.getLogger(__name__)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux), which tells a reused pid from the original."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool | None:
    """Whether the holder still runs: `True`/`False` on this host, `None` when it cannot be told."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = holder.get("start")
    return started is None or _start_time(pid) in (None, started)


def describe(holder: dict[str, Any] | None) -> str:
    """Who holds the lock, in words."""
    if not holder:
        return "a process that did not record itself"
    since = holder.get("since")
    when = ""
    if isinstance(since, int | float):
        stamp = _dt.datetime.fromtimestamp(since, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        when = f", since {stamp} ({time.time() - since:.0f} s ago)"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, session {holder.get('session')}{when}"


class WriterLock:
    """The writer lock of one task.

    Args:
        task_dir (`Path`): the task directory (created if missing).
        fs (`LocalFS`): the storage seam.
        session (`str`): this run's session id (recorded for whoever is refused).
    """

    def __init__(self, task_dir: Path, fs: LocalFS, *, session: str) -> None:
        self.path = Path(task_dir) / WRITER_LOCK_NAME
        self.fs = fs
        self.session = session
        self._file: BinaryIO | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def _me(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "session": self.session, "since": time.time(),
                "start": _start_time(os.getpid())}

    def _record(self, f: BinaryIO) -> None:
        f.seek(0)
        f.truncate()
        f.write(json.dumps(self._me(), sort_keys=True).encode())
        f.flush()

    @staticmethod
    def _holder(f: BinaryIO) -> dict[str, Any] | None:
        try:
            f.seek(0)
            value = loads_bounded(f.read(4096))
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def acquire(self, *, takeover: bool = False, what: str = "task") -> None:
        """Take the lock, or raise `StoreLockedError` naming the live holder.

        Args:
            takeover (`bool`, *optional*, defaults to `False`): replace a lock whose recorded
                holder is no longer running (see the module docstring).
            what (`str`): how the task is named in messages.
        """
        if self._file is not None:
            return
        self.fs.mkdir(self.path.parent)
        f = self.fs.open_lock(self.path)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._holder(f)
            f.close()
            alive = _alive(holder or {})
            if takeover and alive is not True:
                self._take_over(holder, what)
                return
            gone = " (that process is no longer running: a process it started still holds the lock)" if alive is False else ""
            advice = ("stop it first; takeover=True never replaces a running holder" if alive
                      else "pass takeover=True once it is gone")
            raise StoreLockedError(
                f"{what} is being written by another session: {describe(holder)}{gone}. Two writers on one task "
                f"interleave their checkpoints and report each other's saves as their own; give this run its own "
                f"task_id, wait for that run to end, or {advice}."
            ) from None
        self._record(f)
        self._file = f

    def _take_over(self, holder: dict[str, Any] | None, what: str) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{self.session}")
        g = self.fs.open_lock(tmp)
        try:
            fcntl.flock(g.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._record(g)
            self.fs.replace(tmp, self.path)
            self.fs.fsync_dir(self.path.parent)
            st = self.fs.lstat(self.path)
            if st is None or st.st_ino != os.fstat(g.fileno()).st_ino:  # another taker renamed after us
                raise StoreLockedError(f"{what}: another session took the writer lock over at the same time; retry.")
        except BaseException:
            g.close()
            raise
        logger.warning("%s: took the writer lock over from %s, which is no longer running (takeover=True)",
                       what, describe(holder))
        self._file = g

    def release(self) -> None:
        """Release the lock (idempotent); the holder record stays as the last writer's trace."""
        if self._file is not None:
            self._file.close()  # closing the file releases the flock
            self._file = None

"""One writer per task: a POSIX record lock (`fcntl.lockf`, not `flock`, which a forked child keeps) on
``<task>/.writer.lock`` holding a holder record (docs/reliability.md, section 4). A held lock of a holder proven gone is
replaced by a new locked file renamed over it. Closing any descriptor of the file drops the lock, and locking twice
succeeds: hence one registry per process (`_HELD`)."""

from __future__ import annotations

import atexit
import contextlib
import enum
import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from ..constants import WRITER_LOCK_NAME
from ..errors import StoreLockedError
from ..jsonutil import loads_bounded

logger = logging.getLogger(__name__)
DEFAULT_WAIT_S = 120.0
_HELD: dict[str, tuple[BinaryIO, weakref.ref[WriterLock]]] = {}
_HELD_LOCK = threading.RLock()  # one check-lock-register step per process
os.register_at_fork(after_in_child=_HELD.clear)  # a child holds none of its parent's record locks


class HolderState(enum.Enum):
    ALIVE, GONE, UNKNOWN = "alive on this host", "gone", "cannot be told from this host"


def _proc(path: str, read: Callable[[str], str] = lambda p: Path(p).read_text().strip()) -> str | None:
    with contextlib.suppress(OSError):
        return read(path) or None
    return None


def _start(pid: int) -> str | None:  # the kernel's start time of `pid`: tells a reused pid from the original
    text = _proc(f"/proc/{pid}/stat") or ""
    return text.rsplit(")", 1)[1].split()[19] if ")" in text else None


def this_host() -> dict[str, Any]:
    return {"host": socket.gethostname(), "boot": _proc("/proc/sys/kernel/random/boot_id"),
            "pidns": _proc("/proc/self/ns/pid", os.readlink)}


def judge(holder: dict[str, Any] | None, here: dict[str, Any] | None = None) -> HolderState:
    """Whether the holder a record names still runs, as far as this host (`here`, default `this_host()`) can tell."""
    here, pid = here or this_host(), (holder or {}).get("pid")
    if not holder or type(pid) is not int or pid <= 0 or holder.get("host") != here["host"]:
        return HolderState.UNKNOWN
    if holder.get("boot") and here.get("boot") and holder["boot"] != here["boot"]:
        return HolderState.GONE  # recorded before this machine last booted
    if holder.get("pidns") and here.get("pidns") and holder["pidns"] != here["pidns"]:
        return HolderState.UNKNOWN  # another container: its pids are not ours
    if not psutil.pid_exists(pid):  # (a process of another user exists)
        return HolderState.GONE
    now = _start(pid)  # another start time: the pid was reused
    return HolderState.GONE if None not in (now, holder.get("start")) and now != holder["start"] else HolderState.ALIVE


def describe(holder: dict[str, Any] | None) -> str:
    since = (holder or {}).get("since")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(since))} UTC ({time.time() - since:.0f} s ago)" \
        if isinstance(since, int | float) else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}, session {holder.get('session')}{when}" if holder \
        else "a process that did not record itself"


def _record(f: BinaryIO, new: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Write `new` as the file's record, or read it (`None`: none)."""
    if new is not None:
        os.pwrite(f.fileno(), data := json.dumps(new, sort_keys=True).encode(), 0)
        os.ftruncate(f.fileno(), len(data))
    try:
        value = new or loads_bounded(os.pread(f.fileno(), 4096, 0))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _locked(path: Path) -> tuple[BinaryIO, bool]:
    f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "r+b")
    try:
        fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN, EACCES: held by another process
        return f, False
    except BaseException:
        f.close()
        raise
    return f, True


def read_holder(task_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The holder record of a task's lock (read through the held descriptor when this process holds it)."""
    path = str(Path(task_dir).absolute() / WRITER_LOCK_NAME)
    with _HELD_LOCK:
        if path in _HELD:
            return _record(_HELD[path][0])
    with contextlib.suppress(OSError), os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return _record(f)
    return None


class WriterLock:
    """The writer lock of `task_dir`, recorded for `session`."""

    def __init__(self, task_dir: Path, *, session: str) -> None:
        self.path, self.session = Path(task_dir).absolute() / WRITER_LOCK_NAME, session
        self._file: BinaryIO | None = None

    @property
    def held(self) -> bool:
        return self._file is not None and _HELD.get(str(self.path), (None, lambda: None))[1]() is self

    def _register(self, f: BinaryIO) -> None:
        with _HELD_LOCK:
            _HELD[str(self.path)], self._file = (f, weakref.ref(self)), f
        _record(f, {"pid": os.getpid(), **this_host(), "session": self.session, "since": time.time(),
                    "start": _start(os.getpid())})

    def acquire(self, *, takeover: bool = False, what: str = "task", wait_s: float = 0.0) -> None:
        """Take the lock, or raise `StoreLockedError` naming the holder and the fix."""
        deadline, since, note = time.monotonic() + max(0.0, wait_s), 0.0, 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self.held:
            with _HELD_LOCK:
                entry = _HELD.get(str(self.path))
                owner = entry[1]() if entry else None
                if owner is not None and owner is not self and owner.held:
                    raise StoreLockedError(
                        f"{what} is being written by this process already (session {owner.session}); close that "
                        "writer first (RunOrchestrator.close(), or the end of its training run). A new Trainer "
                        "callback or SmartCheckpointer of this process closes an earlier run on the task itself.")
                if entry is not None:  # its writer was dropped without release(): the lock is this one's now
                    return self._register(entry[0])
                f, locked = _locked(self.path)
                holder, inode = _record(f), os.fstat(f.fileno()).st_ino
                if locked:
                    if holder and not holder.get("released") and holder.get("session") != self.session:
                        logger.warning("%s: took the writer lock over from %s, which ended without releasing it "
                                       "(killed or crashed)", what, describe(holder))
                    return self._register(f)
                f.close()  # not ours: closing it drops nothing
            state, now = judge(holder), time.monotonic()
            if state is HolderState.ALIVE:
                raise StoreLockedError(
                    f"{what} is being written by another session: {describe(holder)}, which is running. Two writers "
                    "on one task interleave their checkpoints and report each other's saves as their own; give this "
                    "run its own task_id, wait for that run to end, or "
                    f"{'takeover=True never replaces a running holder' if takeover else 'stop it first'}.")
            if state is HolderState.GONE or takeover:  # a new locked file renamed over the held one
                g, locked = _locked(tmp := self.path.with_name(f"{self.path.name}.tmp-{self.session}"))
                try:
                    if locked and os.lstat(self.path).st_ino == inode:
                        os.replace(tmp, self.path)
                    if not locked or os.lstat(self.path).st_ino != os.fstat(g.fileno()).st_ino:  # a taker was first
                        raise StoreLockedError(f"{what}: another session is taking the writer lock over; retry.")
                except BaseException:
                    g.close()
                    raise
                logger.warning("%s: took the writer lock over from %s, which is no longer running (its lock was still "
                               "held: an NFS server that has not yet expired it)" if state is HolderState.GONE else
                               "%s: replaced the writer lock of %s (takeover=True)", what, describe(holder))
                return self._register(g)
            if now >= deadline:
                raise StoreLockedError(
                    f"{what} is being written by another session: {describe(holder)}, which this host cannot see "
                    "(another host or container); its lock was still held after waiting"
                    f"{f' for {now - since:.0f} s' if since else ''}. If that run is still going, give this run its "
                    "own task_id or wait for it to end; if it is gone (its host or pod died), its lock expires with "
                    "its NFS lease (retry, or raise runtime.lock_wait_s), or pass takeover=True (CheckpointStore) "
                    "to replace it now.")
            if now >= note:
                logger.warning("%s: the writer lock is held by %s, which this host cannot see; waiting up to %g s for "
                               "it to end or for its lock to expire (runtime.lock_wait_s)", what, describe(holder),
                               wait_s)
                since, note = since or now, now + 15.0
            time.sleep(min(0.5, max(0.0, deadline - now)))

    def moved(self) -> bool:
        """Whether the held lock file is no longer the one at its path (the task directory was deleted)."""
        try:
            return self.held and os.lstat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino  # type: ignore[union-attr]
        except FileNotFoundError:
            return True

    def release(self) -> None:
        """Release the lock (idempotent); the record stays, marked released (a courtesy: the close drops the lock)."""
        f, self._file = self._file, None
        with _HELD_LOCK:
            if f is None or _HELD.get(str(self.path), (None,))[0] is not f:
                return  # taken over by another writer of this process: the file stays open for it
            del _HELD[str(self.path)]
        _released(f)


def _released(f: BinaryIO) -> None:
    with contextlib.suppress(OSError):
        _record(f, {**(_record(f) or {}), "released": time.time()})
    f.close()


@atexit.register
def _release_at_exit() -> None:
    """A normal exit is no crash: the records of the locks still held say released (a killed process cannot)."""
    with _HELD_LOCK:
        files = [f for f, _ in _HELD.values()]
        _HELD.clear()
    for f in files:
        _released(f)

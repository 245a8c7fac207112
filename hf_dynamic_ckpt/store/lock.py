"""One writer per task: a POSIX record lock on ``<task>/.writer.lock`` that names its holder.

The committing process of a run (rank 0, a store opened with ``cleanup=True``) locks the file
and writes who it is into it (pid, host, boot and pid-namespace ids, process start time,
session, since when). Who holds the lock decides what an attach does:

- **this process** (an earlier Trainer, callback or `resume_checkpoint` of the same process: a
  notebook cell re-run after an exception): the earlier writer is closed (its pending writes
  finish and commit first, its probes are removed) and the lock passes to the new one, with one
  INFO line. Never an error.
- **nobody**: the holder ended or was killed, and the kernel dropped its lock. A record left by
  a holder that did not release it (a crash) is named in one WARNING.
- **a process proven gone on this host** (its pid does not run, or runs with another start
  time, or the machine rebooted) while the lock is still held (an NFS server that has not yet
  expired the dead client's lock): taken over at once, one WARNING. The lock file is replaced
  by a new one (a new inode, locked before it is renamed into place).
- **a holder on another host, or one whose state cannot be told** (another pid namespace, no
  record): waited for, up to `wait_s` (`SmartCkptConfig.lock_wait_s`, two minutes by default:
  long enough for an elastic or scheduler restart and an NFS lease to expire), with a progress
  line, then `StoreLockedError` naming the holder and the fix.
- **a live process on this host**: refused at once; `takeover=True` (the operator's lever)
  never replaces a running holder.

Why POSIX record locks (`fcntl(F_SETLK)` through `fcntl.lockf`) and not `flock`: a flock
belongs to the open file description, which `fork()` shares, so a data-loader worker forked by
the training process kept the lock after the training process was killed, and the restart
was refused. A record lock belongs to the process: a child never inherits it and the kernel
drops it when the process ends; NFS implements record locks (NLM, NFSv4), where flock is
emulated by them anyway; `F_GETLK` names the pid that holds it. Their trap: closing *any*
descriptor of the file in the holding process drops the lock, and a second lock by the same
process always succeeds. Hence one registry per process of the lock files it holds (`_HELD`):
an attach asks it first, and nothing else in the process opens a held file (`read_holder`
reads through the held descriptor).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO

from ..constants import WRITER_LOCK_NAME
from ..errors import StoreLockedError
from ..jsonutil import loads_bounded
from .fs import LocalFS

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 120.0
"""How long an attach waits for a holder whose state cannot be told (another host)."""
_POLL_S = 0.5
_PROGRESS_S = 15.0
_RECORD_MAX = 4096


class HolderState(Enum):
    """What is known about the recorded holder of a lock."""

    ALIVE = "alive on this host"
    GONE = "gone"
    UNKNOWN = "cannot be told from this host"


@dataclass
class _Held:
    """A lock this process holds: its open file (the lock lives as long as it is open) and its owner, weakly (a
    writer dropped without `release()` must not keep its store alive, nor the lock from the next writer)."""

    file: BinaryIO
    owner: weakref.ref[WriterLock]


_HELD: dict[str, _Held] = {}
_HELD_LOCK = threading.RLock()  # also makes one acquire's check, lock and registration one step per process
os.register_at_fork(after_in_child=_HELD.clear)  # a child holds none of its parent's record locks


def _release_at_exit() -> None:
    """A normal interpreter exit is no crash: the locks this process still holds are released and their records say
    so, so the next start has nothing to warn about (a killed process runs no exit handler: its record stays)."""
    with _HELD_LOCK:
        entries = list(_HELD.values())
    for held in entries:
        owner = held.owner()
        if owner is not None:
            owner.release()
            continue
        with _HELD_LOCK:  # its writer was dropped without release(): the open file still holds the lock
            for key, value in list(_HELD.items()):
                if value is held:
                    del _HELD[key]
        try:
            record = _read_record(held.file)
            if record is not None:
                _write_record(held.file, {**record, "released": time.time()})
        except OSError:
            pass
        held.file.close()


atexit.register(_release_at_exit)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux), which tells a reused pid from the original."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_host() -> dict[str, Any]:
    """What identifies this machine and pid namespace in a holder record."""
    return {"host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
            "pidns": _pid_namespace()}


def judge(holder: dict[str, Any] | None, here: dict[str, Any] | None = None) -> HolderState:
    """Whether the holder a record names still runs, as far as this host can tell.

    Args:
        holder (`dict`, *optional*): the record (`pid`, `host`, `boot`, `pidns`, `start`).
        here (`dict`, *optional*): this host's identity (`this_host()`; tests pass another).
    """
    here = this_host() if here is None else here
    pid = (holder or {}).get("pid")
    if not holder or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return HolderState.UNKNOWN
    if holder.get("host") != here["host"]:
        return HolderState.UNKNOWN
    if holder.get("boot") and here.get("boot") and holder["boot"] != here["boot"]:
        return HolderState.GONE  # recorded before this machine last booted
    if holder.get("pidns") and here.get("pidns") and holder["pidns"] != here["pidns"]:
        return HolderState.UNKNOWN  # another container: its pids are not ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return HolderState.GONE
    except PermissionError:
        pass  # runs, as another user
    started = holder.get("start")
    if started is not None and _start_time(pid) not in (None, started):
        return HolderState.GONE  # the pid was reused by another process
    return HolderState.ALIVE


def describe(holder: dict[str, Any] | None) -> str:
    """Who holds (or held) the lock, in words."""
    if not holder:
        return "a process that did not record itself"
    since = holder.get("since")
    when = ""
    if isinstance(since, int | float):
        stamp = _dt.datetime.fromtimestamp(since, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        when = f", since {stamp} ({time.time() - since:.0f} s ago)"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, session {holder.get('session')}{when}"


def _lock_owner(f: BinaryIO) -> int | None:
    """The pid `F_GETLK` reports for a conflicting lock (`None`: no conflict, or a holder it cannot name)."""
    arg = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    try:
        res = fcntl.fcntl(f.fileno(), fcntl.F_GETLK, arg)
    except OSError:
        return None
    l_type, _, _, _, l_pid = struct.unpack("hhqqi4x", res)
    return l_pid if l_type != fcntl.F_UNLCK and l_pid > 0 else None


def _try_lock(f: BinaryIO) -> bool:
    try:
        fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def _write_record(f: BinaryIO, record: dict[str, Any]) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    os.pwrite(f.fileno(), data, 0)
    os.ftruncate(f.fileno(), len(data))


def _read_record(f: BinaryIO) -> dict[str, Any] | None:
    try:
        value = loads_bounded(os.pread(f.fileno(), _RECORD_MAX, 0))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_holder(task_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The holder record of a task's lock file (`None` when there is none or it does not parse).

    Reads through the held descriptor when this process holds the lock: opening and closing
    the file again would drop a POSIX record lock (see the module docstring).
    """
    path = str(Path(task_dir).absolute() / WRITER_LOCK_NAME)
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is not None:
            return _read_record(held.file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return _read_record(f)


class WriterLock:
    """The writer lock of one task (see the module docstring for what each holder gets).

    Args:
        task_dir (`Path`): the task directory (created if missing).
        fs (`LocalFS`): the storage seam.
        session (`str`): this run's session id (recorded for whoever is refused).
    """

    def __init__(self, task_dir: Path, fs: LocalFS, *, session: str) -> None:
        self.path = Path(task_dir).absolute() / WRITER_LOCK_NAME
        self.fs = fs
        self.session = session
        self._file: BinaryIO | None = None

    @property
    def held(self) -> bool:
        """Whether this writer holds the lock."""
        with _HELD_LOCK:
            held = _HELD.get(str(self.path))
        return self._file is not None and held is not None and held.owner() is self

    def _me(self) -> dict[str, Any]:
        return {"pid": os.getpid(), **this_host(), "session": self.session, "since": time.time(),
                "start": _start_time(os.getpid())}

    @staticmethod
    def _write(f: BinaryIO, record: dict[str, Any]) -> None:
        _write_record(f, record)

    # -- taking it ------------------------------------------------------------------------------
    def acquire(self, *, takeover: bool = False, what: str = "task", wait_s: float = 0.0) -> None:
        """Take the lock (see the module docstring for each kind of holder).

        Args:
            takeover (`bool`, *optional*, defaults to `False`): also replace a lock whose holder
                cannot be told (another host) at once, without waiting. Never a running holder on this host.
            what (`str`): how the task is named in messages.
            wait_s (`float`, *optional*, defaults to `0`): how long to wait for a holder whose
                state cannot be told (another host) before giving up.

        Raises:
            `StoreLockedError`: a live holder on this host, or one of another host that kept the
                lock for `wait_s`; the message names it and the fix.
        """
        if self.held:
            return
        deadline = time.monotonic() + max(0.0, wait_s)
        waited_since: float | None = None
        next_note = 0.0
        self.fs.mkdir(self.path.parent)
        while True:
            with _HELD_LOCK:  # one check-lock-register step per process (a second lock of it would "succeed")
                if self._in_process(what):
                    return
                f = self.fs.open_lock(self.path)
                try:
                    if _try_lock(f):
                        self._won(f, what)
                        return
                    holder, owner_pid, inode = _read_record(f), _lock_owner(f), os.fstat(f.fileno()).st_ino
                except BaseException:
                    f.close()
                    raise
                f.close()  # not ours: closing it drops nothing
            if owner_pid is not None and owner_pid != (holder or {}).get("pid"):
                # The lock's real holder, which has not written its record yet (or wrote another's).
                holder = {**(holder or {}), "pid": owner_pid, **this_host(), "start": None, "session": "?"}
            state = judge(holder)
            if state is HolderState.ALIVE:
                advice = "takeover=True never replaces a running holder" if takeover else "stop it first"
                raise StoreLockedError(
                    f"{what} is being written by another session: {describe(holder)}, which is running. Two "
                    "writers on one task interleave their checkpoints and report each other's saves as their own; "
                    f"give this run its own task_id, wait for that run to end, or {advice}."
                )
            if state is HolderState.GONE or takeover:
                self._take_over(holder, what, forced=state is not HolderState.GONE, judged_inode=inode)
                return
            now = time.monotonic()
            if now >= deadline:
                waited = f" for {now - waited_since:.0f} s" if waited_since is not None else ""
                raise StoreLockedError(
                    f"{what} is being written by another session: {describe(holder)}, which this host cannot see "
                    f"(another host or container); its lock was still held after waiting{waited}. If that run is "
                    "still going, give this run its own task_id or wait for it to end; if it is gone (its host or "
                    "pod died), its lock expires with its NFS lease (retry, or raise runtime.lock_wait_s), or pass "
                    "takeover=True (CheckpointStore) to replace it now."
                )
            if waited_since is None:
                waited_since = now
                logger.warning("%s: the writer lock is held by %s, which this host cannot see; waiting up to %g s "
                               "for it to end or for its lock to expire (runtime.lock_wait_s)", what, describe(holder),
                               wait_s)
                next_note = now + _PROGRESS_S
            elif now >= next_note:
                logger.warning("%s: still waiting for the writer lock (%.0f s of %g s)", what, now - waited_since,
                               wait_s)
                next_note = now + _PROGRESS_S
            time.sleep(min(_POLL_S, max(0.0, deadline - now)))

    def _won(self, f: BinaryIO, what: str) -> None:
        """The lock is ours: name an unreleased previous holder, record ourselves, register."""
        previous = _read_record(f)
        if previous and not previous.get("released") and previous.get("session") != self.session:
            logger.warning("%s: took the writer lock over from %s, which ended without releasing it (killed or "
                           "crashed)", what, describe(previous))
        self._write(f, self._me())
        self._register(f)

    def _register(self, f: BinaryIO) -> None:
        with _HELD_LOCK:
            _HELD[str(self.path)] = _Held(file=f, owner=weakref.ref(self))
        self._file = f

    def _in_process(self, what: str) -> bool:
        """This process holds the lock already: refuse if its writer is open; take it over if it was dropped."""
        held = _HELD.get(str(self.path))
        if held is None:
            return False
        owner = held.owner()
        if owner is not None and owner is not self and owner.held:
            raise StoreLockedError(
                f"{what} is being written by this process already (session {owner.session}); close that writer "
                "first (RunOrchestrator.close(), or the end of its training run). A new Trainer callback or "
                "SmartCheckpointer of this process closes an earlier run on the task itself."
            )
        self._register(held.file)  # its writer was dropped without release(): the lock is this one's now
        self._write(held.file, self._me())
        logger.debug("%s: took over the writer lock of a writer of this process that was never closed", what)
        return True

    def _take_over(self, holder: dict[str, Any] | None, what: str, *, forced: bool, judged_inode: int) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{self.session}")
        g = self.fs.open_lock(tmp)
        try:
            current = self.fs.lstat(self.path)
            if not _try_lock(g) or current is None or current.st_ino != judged_inode:
                raise StoreLockedError(f"{what}: another session is taking the writer lock over at the same time; "
                                       "retry.")
            self._write(g, self._me())
            self.fs.replace(tmp, self.path)
            self.fs.fsync_dir(self.path.parent)
            st = self.fs.lstat(self.path)
            if st is None or st.st_ino != os.fstat(g.fileno()).st_ino:  # another taker renamed after us
                raise StoreLockedError(f"{what}: another session took the writer lock over at the same time; retry.")
        except BaseException:
            g.close()
            raise
        if forced:
            logger.warning("%s: replaced the writer lock of %s (takeover=True)", what, describe(holder))
        else:
            logger.warning("%s: took the writer lock over from %s, which is no longer running (its lock was still "
                           "held: an NFS server that has not yet expired it)", what, describe(holder))
        self._register(g)

    def moved(self) -> bool:
        """Whether the lock file this writer holds is no longer the one at its path (deleted or replaced)."""
        if not self.held or self._file is None:
            return False
        st = self.fs.lstat(self.path)
        return st is None or st.st_ino != os.fstat(self._file.fileno()).st_ino

    def refresh(self, what: str = "task") -> bool:
        """After the task directory was deleted and recreated: lock the new lock file (the old inode is gone).

        Returns:
            `bool`: whether a new lock file was taken (`False`: the held one is still in place).

        Raises:
            `StoreLockedError`: another session locked the new file first.
        """
        if not self.moved():
            return False
        self.fs.mkdir(self.path.parent)
        f = self.fs.open_lock(self.path)
        if not _try_lock(f):
            holder = _read_record(f)
            f.close()
            raise StoreLockedError(f"{what}: the task directory was recreated and another session locked it first: "
                                   f"{describe(holder)}.")
        old = self._file
        self._write(f, self._me())
        self._register(f)
        if old is not None:
            old.close()  # another inode: closing it drops only the lock on the deleted file
        return True

    # -- giving it back -------------------------------------------------------------------------
    def release(self) -> None:
        """Release the lock (idempotent); the record stays as the last writer's trace, marked released."""
        f, self._file = self._file, None
        if f is None:
            return
        with _HELD_LOCK:
            held = _HELD.get(str(self.path))
            if held is None or held.owner() is not self:
                return  # taken over by another writer of this process: the file stays open for it
            del _HELD[str(self.path)]
        try:
            record = _read_record(f) or self._me()
            self._write(f, {**record, "released": time.time()})
        except OSError:
            pass  # the record is a courtesy; the lock goes with the close below
        f.close()

"""Small kernel files that the memory probe reads inside every save, read with one system call each.

The probe (`engine.staging.default_headroom`) reads cgroup limits, usage and `memory.stat`,
`/proc/meminfo` and `/proc/self/statm`: about nine files. Opening, stat-ing, reading and
closing each cost more than the kernel takes to generate its text. `read_kernel_file` keeps
one descriptor per path and reads it with `pread` at offset 0: procfs and cgroupfs generate
the text anew on each read from the start, so the value is as fresh as after an `open`.

Only paths under `/proc/` and `/sys/` are kept open (generated files; a regular file, such as a
test's fake cgroup, could be replaced by a rename, which a kept descriptor would not see). A
descriptor that fails (its cgroup was removed) is closed and the path opened again once. A
forked child starts with no descriptors (`/proc/self/...` opened by the parent names the
parent). At most `MAX_KEPT` are kept; files of `CHUNK` bytes or more are read whole with `open`.
"""

from __future__ import annotations

import os
import threading

CHUNK = 1 << 16
"""Bytes read per `pread`; a file this large or larger is read again with `open`."""

MAX_KEPT = 64
"""Most descriptors kept at once (a probe uses about nine); past it, all are closed and opened again as needed."""
KEPT_UNDER = ("/proc/", "/sys/")

_lock = threading.Lock()
_fds: dict[str, int] = {}
_pid = os.getpid()


def read_kernel_file(path: str | os.PathLike[str]) -> str:
    """The text of a small kernel file, from a descriptor kept open across calls.

    Raises:
        `OSError`: the file cannot be opened or read.
        `UnicodeDecodeError`: it is not text.
    """
    global _pid
    key = os.fspath(path)
    if not key.startswith(KEPT_UNDER):
        with open(key, "rb", buffering=0) as f:
            return f.readall().decode()
    with _lock:
        if os.getpid() != _pid:
            _fds.clear()  # inherited from the parent: its /proc/self files
            _pid = os.getpid()
        for attempt in (0, 1):
            fd = _fds.get(key)
            if fd is None:
                if len(_fds) >= MAX_KEPT:
                    _close_all()
                fd = _fds[key] = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, CHUNK, 0)
                break
            except OSError:
                del _fds[key]
                os.close(fd)
                if attempt:
                    raise
    if len(data) >= CHUNK:
        with open(key, "rb", buffering=0) as f:
            data = f.readall()
    return data.decode()


def meminfo() -> tuple[int, int] | None:
    """`(MemTotal, MemAvailable)` in bytes from `/proc/meminfo`; `None` where it lacks either (not Linux,
    kernel < 3.14)."""
    try:
        text = read_kernel_file("/proc/meminfo")
    except (OSError, UnicodeDecodeError):
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            found[key] = int(rest.split()[0]) * 1024  # kB
            if len(found) == 2:
                return found["MemTotal"], found["MemAvailable"]
    return None


def kept() -> list[str]:
    """The paths whose descriptors are kept open now."""
    with _lock:
        return list(_fds)


def close_all() -> None:
    """Close every kept descriptor (the next read opens again)."""
    with _lock:
        _close_all()


def _close_all() -> None:
    for fd in _fds.values():
        os.close(fd)
    _fds.clear()

"""The storage seam: the few filesystem operations the store uses, each one contained.

Every operation that changes something (`create`, `mkdir`, `rename`, `replace`, `unlink`,
`rmtree`, `write_atomic`) first proves that the path it acts on stays inside the store
root: the parent directory, resolved with `os.path.realpath`, must be the root or below it,
and the last component must be a plain name. Symbolic links are refused rather than
followed: files are opened with ``O_NOFOLLOW``, directories are tested with `os.lstat`, and
`rmtree` uses the fd-based `shutil.rmtree`, which never descends through a link. So no
name read from a manifest, and no link planted in the store, can make the store delete or
overwrite a file outside it.

Reads (`open_read`, `read_bytes`, `read_exact`, `lstat`, `listdir`) may look at a checkpoint the
user names by path outside the root, but never through a link in its last component. `fsync_file`
and `fsync_dir` make what was written durable.

`LocalFS` is the only implementation today; an object-storage implementation (fsspec)
provides the same methods.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..errors import CorruptCheckpointError, UnsafePathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class SyncableFile(Protocol):
    """An open file object `fsync_file` can flush and sync (a file, or a `HashingWriter` around one)."""

    def flush(self) -> None: ...

    def fileno(self) -> int: ...


def _open_no_link(path: str | os.PathLike[str], flags: int, does: str) -> int:
    """`os.open` that refuses a symbolic link at `path` (`UnsafePathError`); new files get mode 0644."""
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; the store never {does} through links.") from e
        raise


def fsync_file(f: SyncableFile | str | os.PathLike[str]) -> None:
    """Flushes and fsyncs an open file object, or opens `path` and fsyncs it."""
    if isinstance(f, (str, os.PathLike)):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Fsyncs a directory so that entries created or renamed in it are durable."""
    fd = os.open(Path(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_exact(f: Any, view: memoryview, error: str) -> None:
    """Fills `view` from `f.readinto`, raising `CorruptCheckpointError(error)` on a short read."""
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError(error)
        got += n


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    """Open an existing file for binary reading, refusing a symbolic link (`UnsafePathError`).

    Raises:
        `FileNotFoundError`: no such file.
        `UnsafePathError`: `path` is a symbolic link.
    """
    return os.fdopen(_open_no_link(path, os.O_RDONLY, "reads"), "rb")


def create(path: str | os.PathLike[str]) -> BinaryIO:
    """Create (or truncate) a file for binary writing, refusing a symbolic link at `path`."""
    return os.fdopen(_open_no_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "writes"), "wb")


def lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    """`os.lstat(path)`, or `None` when nothing is there (links are not followed)."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a real directory (a link to one is not)."""
    st = lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def is_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file (a link to one is not)."""
    st = lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def is_link(path: str | os.PathLike[str]) -> bool:
    st = lstat(path)
    return st is not None and stat.S_ISLNK(st.st_mode)


def listdir(path: str | os.PathLike[str]) -> list[str]:
    """Names in a real directory (sorted); `[]` when it is missing or a link."""
    if not is_dir(path):
        return []
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_bytes(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """The bytes of a file of at most `limit` bytes (never through a link).

    Raises:
        `FileNotFoundError`: no such file.
        `UnsafePathError`: `path` is a link.
        `CorruptCheckpointError`: the file is larger than `limit` (nothing is read).
    """
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{path} has {size} bytes, more than the {limit} a file of this kind may "
                                         "have; the checkpoint is damaged or was not written by hf_dynamic_ckpt.")
        return f.read(limit + 1)


class LocalFS:
    """Local-disk implementation of the storage seam, rooted at the store directory.

    Args:
        root (`str` or `os.PathLike`): the store root; every change stays inside it.

    Example:
        ```python
        >>> fs = LocalFS("out/smart_ckpt")
        >>> fs.unlink("out/smart_ckpt/run/step-3/../../../etc/passwd")  # UnsafePathError, nothing removed
        ```
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.realpath(root))

    # -- containment ----------------------------------------------------------------------
    def contained(self, path: str | os.PathLike[str]) -> Path:
        """`path` with its parent resolved, after proving it lies inside the root.

        Raises:
            `UnsafePathError`: the parent resolves outside the root, or the last component
                is empty, ``.`` or ``..``.
        """
        path = Path(path)
        if path.name in ("", ".", ".."):
            raise UnsafePathError(f"{path} does not end in a plain name; the store only changes named entries.")
        parent = os.path.realpath(path.parent)
        root = str(self.root)
        if parent != root and not parent.startswith(root + os.sep):
            raise UnsafePathError(
                f"{path} resolves to {parent}{os.sep}{path.name}, outside the store root {root}; refused "
                "(a symbolic link or a '..' in a name would make the store touch files that are not its own)."
            )
        return Path(parent) / path.name

    def _real(self, path: str | os.PathLike[str], what: str) -> Path:
        p = self.contained(path)
        if is_link(p):
            raise UnsafePathError(f"{p} is a symbolic link; the store never {what} through links.")
        return p

    # -- changes --------------------------------------------------------------------------
    def create(self, path: str | os.PathLike[str]) -> BinaryIO:
        """`create` after the containment check."""
        return create(self.contained(path))

    def open_lock(self, path: str | os.PathLike[str]) -> BinaryIO:
        """Open (creating it) a lock file for reading and writing, without truncating it."""
        p = self.contained(path)
        return os.fdopen(_open_no_link(p, os.O_RDWR | os.O_CREAT, "writes"), "r+b")

    def append_line(self, path: str | os.PathLike[str], line: str) -> None:
        """Append one line to a file of the store (created if missing; a link is refused)."""
        p = self.contained(path)
        with os.fdopen(_open_no_link(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "writes"), "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")

    def mkdir(self, path: str | os.PathLike[str], *, exist_ok: bool = True) -> None:
        """Create a directory (its parent must exist); an existing link is refused."""
        p = self.contained(path)
        try:
            os.mkdir(p)
        except FileExistsError:
            if not exist_ok or not is_dir(p):
                raise
        if p != self.root and is_link(p):  # pragma: no cover - raced with os.mkdir
            raise UnsafePathError(f"{p} is a symbolic link; refused.")

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Atomic rename; fails if `dst` is a non-empty directory. Links are refused."""
        os.rename(self._real(src, "renames"), self._real(dst, "renames onto"))

    def replace(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Atomic rename over an existing file (`os.replace`)."""
        os.replace(self._real(src, "renames"), self._real(dst, "renames onto"))

    def unlink(self, path: str | os.PathLike[str], *, missing_ok: bool = True) -> None:
        """Remove one file (a link planted in the store is removed itself, never its target)."""
        p = self.contained(path)
        try:
            if is_dir(p):
                raise IsADirectoryError(errno.EISDIR, "is a directory; use rmtree", str(p))
            os.unlink(p)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self, path: str | os.PathLike[str]) -> None:
        """Remove a real directory and everything in it (never the root; links are refused)."""
        p = self._real(path, "removes")
        if p == self.root:
            raise UnsafePathError(f"refusing to remove the store root {p}.")
        if lstat(p) is None:
            return
        if not is_dir(p):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(p))
        shutil.rmtree(p)  # fd-based on Linux: never follows a link inside the tree

    def write_atomic(self, path: str | os.PathLike[str], data: bytes, *, tmp_tag: str) -> None:
        """Write `data` to `path` all-or-nothing: temp file, fsync, rename over, fsync the directory."""
        p = self.contained(path)
        tmp = p.with_name(f".{p.name}.tmp-{tmp_tag}")
        try:
            with create(tmp) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(p.parent)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        fsync_dir(path)

    # -- reads ----------------------------------------------------------------------------
    open_read = staticmethod(open_read)
    read_bytes = staticmethod(read_bytes)
    lstat = staticmethod(lstat)
    is_dir = staticmethod(is_dir)
    is_file = staticmethod(is_file)
    is_link = staticmethod(is_link)
    listdir = staticmethod(listdir)

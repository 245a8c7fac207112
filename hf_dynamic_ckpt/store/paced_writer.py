"""`HashingWriter`: a file writer that checksums what it writes, asks the kernel to write it back as it goes,
and can pace itself to the disk.

Every `WRITEBACK_BYTES` written, the kernel is asked to start writing them to disk (`start_writeback`,
libc's `sync_file_range`), so the final fsync waits for the tail, not the whole file, and the dirty page
cache (which a memory cgroup charges to the job) stays small. A paced writer (`HashingWriter(paced=True)`,
the L1 tier's default on a local root) also waits until the bytes `PACE_WINDOW` behind its end are on
disk (`wait_written`), so it goes no faster than the disk, and tells from those waits who sets the pace
(`disk_bound`, `pace_verdict`): `tensorpack.encode_parts` stores slowly compressing parts raw while the disk waits.
Where `sync_file_range` is missing or fails, nothing is requested and nothing is paced.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, BinaryIO

from .hashing import format_checksum, new_hasher

WRITEBACK_BYTES = 8 << 20
"""A `HashingWriter` asks the kernel to start writing its file back every this many bytes."""

_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4  # <linux/fs.h>
_sync_file_range: Any = None  # resolved on first use: the libc function, or False where there is none

PACE_WINDOW = 32 << 20
"""A paced `HashingWriter` keeps at most about this many bytes between what is written and what is on disk."""
DISK_BOUND_SHARE = 0.5
"""A paced writer is disk-bound while more than this share of its recent time went into waiting for the disk
(an average halved at each wait: one slow flush among fast ones does not flip it)."""
BLOCKED_S = 0.0002
"""A paced wait shorter than this did not block (the call on bytes already on disk takes ~10 us)."""


def _range_sync(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """libc's `sync_file_range` (Python's `os` has none); `False` where it does not exist or fails."""
    if not range_sync_available() or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, flags) == 0


def range_sync_available() -> bool:
    """Whether libc has `sync_file_range` (Linux): writeback requests and paced writes are possible."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes releases the GIL while it waits
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (AttributeError, OSError):  # not Linux / not glibc or musl
            pass
    return bool(_sync_file_range)


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing `nbytes` of `fd` at `offset` to disk, without waiting (Linux).

    The final `fsync` then waits only for what is still dirty instead of the whole file: the disk
    writes while the caller compresses or copies the next bytes, and the dirty page cache (which a
    memory cgroup charges to the job) stays small.

    Returns:
        `bool`: whether the request was made (`False` where the call does not exist or fails; the
        later `fsync` is what makes the file durable either way).
    """
    return _range_sync(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def wait_written(fd: int, offset: int, nbytes: int) -> bool:
    """Write `nbytes` of `fd` at `offset` to disk and wait until they are there (Linux).

    Neither the file's metadata nor the device's cache is flushed: that is the final `fsync`'s
    job. A paced writer calls this on the range `PACE_WINDOW` behind what it wrote, so that it
    goes no faster than the disk and can tell whether the disk was waiting for it.

    Returns:
        `bool`: whether the call was made (`False` where it does not exist or fails).
    """
    return _range_sync(fd, offset, nbytes,
                       _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)


class HashingWriter:
    """A write-only binary file wrapper that checksums every byte it writes.

    Saves a second pass over the file to compute its checksum. Only `write`, `tell`,
    `flush` and `fileno` are provided (what serialisers and zstd stream writers need).

    Args:
        raw (`BinaryIO`): the underlying file, opened for binary writing at position 0.
        defer (`bool`, *optional*, defaults to `False`): keep references to the written
            buffers and hash them in `fsync_and_checksum`, while the kernel flushes the
            file, which hides the hashing time behind the fsync. Only for buffers that do
            not change until then (e.g. tensor snapshots); transient buffers need `False`.
        paced (`bool`, *optional*, defaults to `False`): after each writeback request, wait
            until the bytes `PACE_WINDOW` behind the end are on disk (`wait_written`), so the
            writer goes at the disk's speed, and record in `disk_bound` whether the writer has
            lately spent most of its time waiting (the disk sets the pace) or not (the disk
            waits for the writer).

    Every `WRITEBACK_BYTES` written, the kernel is asked to start writing them to disk
    (`start_writeback`), so the final fsync waits for the tail, not the whole file.
    """

    def __init__(self, raw: BinaryIO, *, defer: bool = False, paced: bool = False) -> None:
        self._raw = raw
        self._hasher = new_hasher()
        self._size = 0
        self._pending: list[memoryview] | None = [] if defer else None
        self._written_back = 0  # bytes before this offset were handed to start_writeback
        self._paced = paced and range_sync_available()
        self._on_disk = 0  # paced: bytes before this offset are known to be on disk
        self._waiting_share = 0.0  # paced: recent share of time spent waiting for the disk
        self._waits = 0  # paced: waits for the disk made so far
        self._since = self._start = time.perf_counter()
        self.disk_wait_s = 0.0
        """Seconds spent in paced waits."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._pending is None:
            self._hasher.update(view)
        else:
            self._pending.append(view)
        self._raw.write(view)
        self._size += view.nbytes
        if self._size - self._written_back >= WRITEBACK_BYTES:
            self._write_back()
        return view.nbytes

    def _write_back(self) -> None:
        try:
            self._raw.flush()
            fd = self._raw.fileno()
            started = start_writeback(fd, self._written_back, self._size - self._written_back)
        except (OSError, ValueError):  # no descriptor (an in-memory file): nothing to write back
            started = False
        self._written_back = self._size if started else 1 << 62  # unsupported here: stop asking
        self._paced = self._paced and started  # without writeback requests nothing tells who sets the pace
        if self._paced and self._size - self._on_disk > PACE_WINDOW:
            upto = self._size - PACE_WINDOW
            start = time.perf_counter()
            if not wait_written(fd, self._on_disk, upto - self._on_disk):
                self._paced = False  # as above: behave as unpaced
                return
            end = time.perf_counter()
            self._on_disk = upto
            self.disk_wait_s += end - start
            share = (end - start) / (end - self._since) if end - start > BLOCKED_S else 0.0  # since the last wait
            self._waiting_share = 0.5 * self._waiting_share + 0.5 * share
            self._waits += 1
            self._since = end

    @property
    def disk_bound(self) -> bool:
        """Whether the disk sets the pace (see `paced`): `False` until a wait shows it (the first `PACE_WINDOW` go
        as fast as the writer can); `True` unpaced and where pacing is not possible."""
        return not self._paced or self._waiting_share > DISK_BOUND_SHARE

    @property
    def pace_verdict(self) -> bool | None:
        """Whether the disk held this write up so far: more than `DISK_BOUND_SHARE` of its time went into waiting
        for the disk, or pacing stopped working (or never could); `None` for a paced write too short to tell (under
        two waits: less than about `PACE_WINDOW` plus two writeback requests written)."""
        if not self._paced:
            return True
        if self._waits < 2:
            return None
        return self.disk_wait_s > DISK_BOUND_SHARE * (time.perf_counter() - self._start)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def _drain(self) -> None:
        if self._pending:
            for view in self._pending:
                self._hasher.update(view)
            self._pending.clear()

    def checksum(self) -> str:
        """`"<algo>:<hex>"` of everything written so far."""
        self._drain()
        return format_checksum(self._hasher.copy())

    def fsync_and_checksum(self) -> str:
        """Flushes and fsyncs the file while hashing deferred buffers; returns the checksum.

        Raises:
            `OSError`: the fsync failed (e.g. ENOSPC or EIO surfacing at flush time).
        """
        self.flush()
        if not self._pending:
            os.fsync(self.fileno())
            return self.checksum()
        error: list[BaseException] = []

        def sync() -> None:
            try:
                os.fsync(self.fileno())
            except BaseException as e:  # re-raised in the caller's thread
                error.append(e)

        worker = threading.Thread(target=sync, name="hf_dynamic_ckpt-fsync", daemon=True)
        worker.start()  # fsync releases the GIL: hashing below runs while the disk writes
        try:
            self._drain()
        finally:
            worker.join()
        if error:
            raise error[0]
        return self.checksum()

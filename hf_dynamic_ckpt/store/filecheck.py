"""A whole-file checksum verified on its own thread while the caller decodes the same memory map."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from ..errors import CorruptCheckpointError
from .hashing import HASH_CHUNK, Hasher, checksum_algo, file_checksum, format_checksum, new_hasher


class WholeFileCheck:
    """Verifies a file's checksum on its own thread while the caller reads the same map (one pass, not two).

    A reader that checks every part it decodes (the L1 container's frames) still needs the
    manifest's whole-file checksum; hashing the map it decodes from, as it decodes, reads the
    file once instead of in a separate pass before (from disk once when cold; the hash overlaps
    the decoding when warm). `result()` waits and raises `CorruptCheckpointError` on a mismatch;
    `cancel()` stops early; either must come before the map is released.
    """

    def __init__(self, view: memoryview, expected: str, what: str,
                 release: Callable[[int, int], None] | None = None) -> None:
        self._view, self._expected, self._what, self._release = view, expected, what, release
        self._hasher = _hasher_for(expected, what)
        self._stop = False
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="hf-dynamic-ckpt-file-check", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, view: memoryview, expected: str | None, what: str,
              release: Callable[[int, int], None] | None = None) -> WholeFileCheck | None:
        """A running check of `view` against `expected`, or `None` when there is nothing to check.

        `release(start, end)`: called after each chunk is hashed, so that the mapped pages it read do
        not stay counted in the process's memory (`MappedFile.release`)."""
        return None if expected is None else cls(view, expected, what, release)

    @staticmethod
    def check_algorithm(expected: str | None, what: str) -> None:
        """Raise `CorruptCheckpointError` now if `expected` names an algorithm this library cannot compute."""
        if expected is not None:
            _hasher_for(expected, what)

    @staticmethod
    def small(path: str | os.PathLike[str], expected: str | None, what: str) -> None:
        """The same check, at once, for a file read without a map (raises on a mismatch)."""
        if expected is not None:
            _hasher_for(expected, what)
            _compare(file_checksum(path, algo=checksum_algo(expected)), expected, what)

    def _run(self) -> None:
        try:
            for start in range(0, self._view.nbytes, HASH_CHUNK):
                if self._stop:
                    return
                self._hasher.update(self._view[start : start + HASH_CHUNK])
                if self._release is not None:
                    self._release(start, start + HASH_CHUNK)
        except BaseException as e:  # reported by result(), as text: the exception would hold this frame and self
            self._error = str(e)

    def cancel(self) -> None:
        self._stop = True
        self._thread.join()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise CorruptCheckpointError(f"{self._what}: reading it for its checksum failed ({self._error}).")
        _compare(format_checksum(self._hasher), self._expected, self._what)


class MappedFile:
    """A read-only memory map of a file whose pages are handed back once read (`release`).

    Decoding a mapped file into new tensors would otherwise hold both at the end: the file's
    pages stay mapped (counted in the process's resident memory) until the map closes. Released
    pages are dropped from this process only; the page cache keeps them, and a later read of
    the same range (the whole-file hash behind the decoders, or the other way round) maps them
    again at the cost of a minor fault.
    """

    def __init__(self, fileno: int, *, private: bool = False) -> None:
        import mmap

        self._mm = mmap.mmap(fileno, 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
        self._page = mmap.PAGESIZE
        self._dontneed = getattr(mmap, "MADV_DONTNEED", None)

    @property
    def mm(self) -> object:
        """The `mmap.mmap` object (for views and `torch.frombuffer`)."""
        return self._mm

    def release(self, start: int, end: int) -> None:
        """Drop the whole pages inside ``[start, end)`` from this process (a no-op where unsupported)."""
        lo = -(-start // self._page) * self._page
        hi = min(end, len(self._mm)) // self._page * self._page
        if self._dontneed is not None and hi > lo:
            # The map may be closing, or the platform may refuse: only memory is at stake.
            with contextlib.suppress(OSError, ValueError):
                self._mm.madvise(self._dontneed, lo, hi - lo)

    def close(self) -> None:
        self._mm.close()


def _hasher_for(expected: str, what: str) -> Hasher:
    try:
        return new_hasher(checksum_algo(expected))
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: {e}") from None


def _compare(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise CorruptCheckpointError(f"{what}: checksum mismatch ({actual} != {expected}), the file is corrupt.")

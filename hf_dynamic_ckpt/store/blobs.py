"""`BlobStore`: the content-addressed tensors of one task (``<task>/blobs/``).

Tensors that do not change between checkpoints (frozen base weights, untouched
embeddings) are stored once, as ``<digest>.safetensors`` holding one tensor named
``"tensor"``, where the digest is the SHA-256 of the tensor's dtype, shape and bytes
(`tensor_digest`). A checkpoint's manifest records ``{key: {"digest", "dtype", "shape",
"size"}}`` for them. This module is the only code that touches the blob directory.

Invariants:

- A digest is 64 lowercase hex digits (checked before it becomes a path), so a manifest
  can never name a file outside the blob directory; a blob directory that is a symbolic
  link is refused for every operation.
- A blob is written with temp + fsync + rename, so it is either complete or absent.
- Collection (`collect`) runs only under the exclusive blob lock, which a rank-0 save holds
  shared when it writes or references blobs (`CheckpointState.has_blobs`) or may replace a
  committed copy of its step: a blob written or referenced by a save that has not committed yet,
  or by the copy it replaces, is never collected (collection is skipped and happens at the next
  opportunity). Any other save gives collection nothing to take.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..constants import BLOBS_LOCK_NAME, TMP_MARKER
from ..errors import CorruptCheckpointError, SaveError
from .fs import LocalFS
from .hashing import new_hasher
from .safetensors_io import (
    check_tensor,
    dtype_name,
    open_tensors,
    raw_bytes,
    serialized_size,
    write_safetensors,
)

logger = logging.getLogger(__name__)

BLOB_SUFFIX = ".safetensors"
BLOB_TENSOR_NAME = "tensor"
DIGEST_ALGO = "sha256"  # content addresses: collision resistance matters (see hashing.py)
_BASE_METADATA = {"format": "pt"}
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def tensor_digest(t: torch.Tensor) -> str:
    """Content hash of a tensor: SHA-256 over its dtype, shape and raw bytes (hex).

    Two tensors get the same digest exactly when they would be stored as the same bytes
    with the same dtype and shape, so the digest names a deduplicated blob file.

    Args:
        t (`torch.Tensor`): a strided tensor of a safetensors dtype (any device).

    Returns:
        `str`: 64 hexadecimal characters.
    """
    t = check_tensor("<tensor>", t)
    hasher = new_hasher(DIGEST_ALGO)
    hasher.update(f"{dtype_name(t.dtype)}:{list(t.shape)}\n".encode())
    hasher.update(raw_bytes(t))
    return hasher.hexdigest()


def is_digest(value: Any) -> bool:
    """Whether `value` is a well-formed content address (64 lowercase hex digits)."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


class BlobStore:
    """The blob directory of one task.

    Args:
        directory (`str` or `os.PathLike`): ``<task>/blobs``.
        fs (`LocalFS`, *optional*): the store's storage seam (its root bounds every change);
            defaults to one rooted at the task directory.

    Example:
        ```python
        >>> blobs = BlobStore(task_dir / "blobs")
        >>> digest = tensor_digest(frozen)
        >>> size = blobs.write(digest, frozen)      # written once; a second call writes nothing
        >>> blobs.verify({"digest": digest, "size": size})
        []
        ```
    """

    def __init__(self, directory: str | os.PathLike[str], fs: LocalFS | None = None) -> None:
        self.dir = Path(directory)
        self.fs = fs if fs is not None else LocalFS(self.dir.parent)

    digest = staticmethod(tensor_digest)

    def path(self, digest: str) -> Path:
        """Where the blob `digest` lives.

        Raises:
            `CorruptCheckpointError`: `digest` is not 64 hex digits (e.g. a manifest naming ``../x``).
        """
        if not is_digest(digest):
            raise CorruptCheckpointError(
                f"blob digest {str(digest)[:80]!r} is not 64 hex digits; the manifest is damaged or hostile."
            )
        return self.dir / f"{digest}{BLOB_SUFFIX}"

    def _usable(self) -> bool:
        if self.fs.is_link(self.dir):
            logger.warning("%s is a symbolic link: the store refuses to read, write or collect blobs through it",
                           self.dir)
            return False
        return True

    def exists(self, digest: str) -> bool:
        """Whether the blob is there (a regular file in a real blob directory)."""
        return is_digest(digest) and self._usable() and self.fs.is_file(self.path(digest))

    def size(self, digest: str) -> int | None:
        st = self.fs.lstat(self.path(digest)) if self.exists(digest) else None
        return None if st is None else st.st_size

    def write(self, digest: str, t: torch.Tensor) -> int:
        """Store tensor `t` under `digest` (temp + fsync + rename) unless it is there already.

        Returns:
            `int`: the blob's size in bytes.
        """
        tensors = {BLOB_TENSOR_NAME: t}
        size = serialized_size(tensors, _BASE_METADATA)
        final = self.path(digest)
        if not self._usable():
            raise SaveError(f"cannot store blob {digest[:12]}...: {self.dir} is a symbolic link; remove it.")
        if self.size(digest) == size:
            return size
        if not self.fs.is_dir(self.dir):
            self.fs.mkdir(self.dir)
        tmp = final.with_name(f"{final.name}{TMP_MARKER}{uuid.uuid4().hex}")
        try:
            write_safetensors(tensors, self.fs.contained(tmp), _BASE_METADATA)
            self.fs.replace(tmp, final)  # atomic; a reader holding the old file keeps its own inode
        finally:
            self.fs.unlink(tmp)
        self.fs.fsync_dir(self.dir)
        return size

    def open(self, digest: str, *, mmap: bool = True, what: str = "Blob") -> torch.Tensor | None:
        """The blob's tensor (`None` when the file holds no ``"tensor"``).

        Raises:
            `CorruptCheckpointError`: missing, unreadable, in a linked directory, or invalid.
        """
        path = self.path(digest)
        if not self._usable():
            raise CorruptCheckpointError(f"{what} {path} cannot be read: {self.dir} is a symbolic link.")
        tensors, _ = open_tensors(path, mmap=mmap, what=what)
        return tensors.get(BLOB_TENSOR_NAME)

    def verify(self, rec: Mapping[str, Any]) -> list[str]:
        """Check one blob record against its file: present, size, and content digest.

        Returns:
            `list[str]`: problems found (empty when the blob is good).
        """
        digest = rec.get("digest")
        try:
            path = self.path(str(digest))
        except CorruptCheckpointError as e:
            return [str(e)]
        if not self._usable():
            return [f"blob {path} is in a linked directory ({self.dir} is a symbolic link); refused"]
        st = self.fs.lstat(path)
        if st is None or not self.fs.is_file(path):
            return [f"blob {path} is missing"]
        if "size" in rec and st.st_size != rec["size"]:
            return [f"blob {path} has {st.st_size} bytes, expected {rec['size']}"]
        try:
            t = self.open(str(digest))
        except CorruptCheckpointError as e:
            return [f"blob {path} is unreadable: {e}"]
        if t is None or tensor_digest(t) != digest:
            return [f"blob {path} content does not match its digest (corrupt)"]
        return []

    @contextlib.contextmanager
    def lock(self, *, shared: bool) -> Iterator[bool]:
        """Cross-process lock between saves (shared, waits) and collection (exclusive, never waits).

        Yields whether the lock was obtained (always `True` when shared).
        """
        import fcntl

        task_dir = self.dir.parent
        if not self.fs.is_dir(task_dir):
            self.fs.mkdir(task_dir)
        with self.fs.open_lock(task_dir / BLOBS_LOCK_NAME) as f:  # closing the file releases the lock
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield True

    def collect(self, used: Collection[str], *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Remove the blobs no committed checkpoint references (and stray temp files).

        Args:
            used (`Collection[str]`): digests referenced by every committed checkpoint.
            dry_run (`bool`, *optional*, defaults to `False`): only report.

        Returns:
            `list[tuple[str, int]]`: (file name, bytes) of what was (or would be) removed;
            empty when a save is in flight (collection is skipped) or the directory is a link.
        """
        if not self.fs.is_dir(self.dir) or not self._usable():
            return []
        with self.lock(shared=False) if not dry_run else contextlib.nullcontext(True) as locked:
            if not locked:
                logger.debug("blob collection of %s skipped: a save is in progress", self.dir)
                return []
            removed = []
            for name in self.fs.listdir(self.dir):
                digest = name.split(".")[0]
                if TMP_MARKER in name or digest in used:
                    continue
                st = self.fs.lstat(self.dir / name)
                removed.append((name, st.st_size if st is not None else 0))
                if not dry_run:
                    self.fs.unlink(self.dir / name)
            return removed

    def remove_temps(self) -> None:
        """Delete temp files of interrupted blob writes (the caller holds the task's writer lock)."""
        if self.fs.is_dir(self.dir) and self._usable():
            for name in self.fs.listdir(self.dir):
                if TMP_MARKER in name:
                    self.fs.unlink(self.dir / name)

"""`CheckpointStore`: tiered checkpoints of one task under a store root, committed atomically.

Layout::

    <root>/catalog.db                        the index (SQLite, WAL): derived from the manifests, rebuildable
    <root>/<task>/step-<N>/                  one committed checkpoint: its files, manifest.json written last
    <root>/<task>/step-<N>.tmp-<session>     a save in progress (or interrupted); ``.replaced``: the copy a
                                             replace-commit set aside; ``.deleted-<hex8>``: a checkpoint being deleted
    <root>/<task>/timelines.json             the current timeline and the abandoned checkpoints (one atomic record)
    <root>/<task>/removed.jsonl              what retention removed, by which rule
    <root>/<task>/.writer.lock               the one writer of the task (`lock`)
    <root>/<task>/blobs/                     frozen weights of checkpoints written by earlier versions (read only)

Invariants:

- A directory is a checkpoint only once it is named ``step-<N>`` and holds a manifest whose checksum matches and whose
  step and task are the directory's. A save writes every rank's files into the temporary directory and fsyncs them;
  each rank then publishes ``done-rank<R>.json`` (write, fsync, rename); rank 0 waits for all of them (no collective),
  writes the manifest, fsyncs, and renames the directory to ``step-<N>`` (the commit point), then writes the catalog
  row. A step committed by another timeline or session is replaced: the old copy is renamed aside, the new one in,
  the old one removed; a crash between the two renames is undone at the next open, so every instant keeps one
  committed copy. A crash at any instant leaves every committed checkpoint intact.
- No tensor leaves `load` before the size and checksum of its file matched the manifest; a failed check or read is
  retried once (a transient I/O error must not cost a checkpoint), then the checkpoint is marked ``"corrupt"`` and
  `CorruptCheckpointError` lets the caller fall back. Every parse error is `CorruptCheckpointError`.
- Nothing outside the root is changed: every path comes from the step and an allowlist of names, every change goes
  through `_Disk`, which proves the path stays inside the root and refuses symbolic links (``O_NOFOLLOW``); a link
  named like a checkpoint is ignored. The catalog never decides alone: a flag that would hide a checkpoint is re-read
  from its manifest first, and every path is derived from the step.
- Nothing is deleted on resume: `fork` marks other timelines' newer checkpoints abandoned; `prune` and `gc` remove them
  once the current timeline has committed past them, never pinned ones.
- Opened with ``read_only=True`` the store changes nothing (its catalog is an in-memory copy synced with the manifests).

A URL root (``s3://...``) is a local cache with this layout plus its object-store copy (`remote`).

Test hook (`errors.fault`) points: ``write`` (each checkpoint file written: `step`, `rank`, `name`), ``commit`` (before
the final rename: `step`), ``fs`` (each change on disk: `op` mkdir | rename | replace | unlink | rmtree | fsync,
`path`), ``read`` (each checkpoint file read or verified: `name`, `step`) and ``remote`` (`remote.Remote.call`).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import struct
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .. import constants as C
from ..constants import ALL_TIERS, Tier
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    DynamicCkptError,
    FormatVersionError,
    SaveError,
    StoreNotWritableError,
    UnsafePathError,
    fault,
)
from ..jsonutil import json_safe, loads_bounded
from .catalog import Catalog
from .lock import DEFAULT_WAIT_S, WriterLock
from .manifest import (
    HASH_CHUNK,
    STATUS_CORRUPT,
    STATUS_MISSING,
    STATUS_OK,
    BlobRef,
    CheckpointInfo,
    CheckpointState,
    Codec,
    FileEntry,
    GcReport,
    Lineage,
    LoadedCheckpoint,
    Removal,
    SaveRequest,
    StoreSpec,
    broken_info,
    build_manifest,
    entry_of,
    file_checksum,
    frozen_record,
    info_from_manifest,
    is_kind,
    json_bytes,
    listdir,
    lstat,
    manifest_bytes,
    new_hasher,
    new_session_id,
    open_read,
    read_json,
    read_manifest,
    tiers_of,
    with_changes,
    without_tiers,
)
from .optpack import flatten_state, read_tensors, unflatten_state, write_tensors
from .remote import Remote, split_root
from .shard_files import is_sharded, placeholders, sharded_table, write_shards

logger = logging.getLogger(__name__)
Ref = str | int | os.PathLike[str] | CheckpointInfo
STORE_DIR = "smart_ckpt"
"""The store's folder under a training `output_dir` (`SmartCkptConfig.resolve_root`)."""
NAMED_REFS = ("auto", "best", "fastest")
ALIASES_KEY = "hf_dynamic_ckpt.aliases"
"""safetensors metadata entry of tied weights: ``{alias: stored key}`` as JSON; on load the alias is the same tensor."""
_WHAT_TO_PASS = f"pass the store directory (the one holding {C.CATALOG_NAME}) or the training output_dir that holds " \
                f"{STORE_DIR}/"


def step_dir_name(step: int) -> str:
    return f"{C.STEP_DIR_PREFIX}{int(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed directory name (``step-12`` -> 12), else `None`."""
    m = re.fullmatch(rf"{C.STEP_DIR_PREFIX}(0|[1-9][0-9]*)", name)
    return int(m.group(1)) if m else None


def task_dirs(root: Path) -> list[Path]:
    """The task folders of a store directory: real folders holding checkpoints or a timelines record."""
    return [root / n for n in listdir(root) if not n.startswith(".") and n != C.BLOBS_DIR and any(
        c.startswith(C.STEP_DIR_PREFIX) or c == C.TIMELINES_NAME for c in listdir(root / n))]


def find_root(path: str | os.PathLike[str]) -> Path:
    """The store directory of a local path: the store itself, or a training output_dir holding ``smart_ckpt/``.

    Raises:
        `CheckpointNotFoundError`: `path` does not exist or holds no store.
        `ConfigError`: `path` is a file, or a task or checkpoint directory inside a store (the message names the store
            directory to pass instead).

    Example:
        ```python
        >>> find_root("out")  # a training output_dir
        PosixPath('out/smart_ckpt')
        ```
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointNotFoundError(f"root {root} does not exist; {_WHAT_TO_PASS}.")
    if not root.is_dir():
        raise ConfigError(f"root {root} is a file, not a directory; {_WHAT_TO_PASS}.")
    if (root / C.MANIFEST_NAME).exists() or any(n.startswith(C.STEP_DIR_PREFIX) for n in os.listdir(root)):
        store_root = root.parent.parent if (root / C.MANIFEST_NAME).exists() else root.parent
        raise ConfigError(f"root {root} is a checkpoint or task directory, not a store root; pass {store_root} (the "
                          f"directory holding {C.CATALOG_NAME}) and name the checkpoint by its reference and task.")
    for candidate in (root, root / STORE_DIR):
        if candidate.is_dir() and ((candidate / C.CATALOG_NAME).is_file() or task_dirs(candidate)):
            return candidate
    raise CheckpointNotFoundError(f"no hf_dynamic_ckpt store under {root}: {_WHAT_TO_PASS}.")


class _Disk:
    """Every change the store makes on disk: the path must stay inside the root (its parent resolved), the last
    component is never followed when it is a link, and each change is a ``fs`` fault point."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))

    def contained(self, path: str | os.PathLike[str], op: str = "", *, link_ok: bool = False) -> Path:
        path = Path(path)
        parent = os.path.realpath(path.parent)
        if path.name in ("", ".", "..") or (parent != str(self.root) and not parent.startswith(f"{self.root}{os.sep}")):
            raise UnsafePathError(f"{path} resolves to {parent}{os.sep}{path.name}, outside the store root "
                                  f"{self.root}; "
                                  "refused (a symbolic link or a '..' in a name would make the store touch files that "
                                  "are not its own).")
        real = Path(parent) / path.name
        if not link_ok and is_kind(real, "link"):
            raise UnsafePathError(f"{real} is a symbolic link; the store never changes anything through links.")
        if op:
            fault("fs", op=op, path=str(real))
        return real

    def mkdir(self, path: Path) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.contained(path, "mkdir"))

    def rename(self, src: Path, dst: Path, *, replace: bool = False) -> None:
        (os.replace if replace else os.rename)(self.contained(src, "replace" if replace else "rename"),
                                               self.contained(dst))

    def unlink(self, path: Path) -> None:
        """Remove one file (a link planted in the store is removed itself, never its target); missing is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.contained(path, "unlink", link_ok=True))

    def rmtree(self, path: Path) -> None:
        """Remove a real directory (never the root; the fd-based `shutil.rmtree` never descends through a link)."""
        real = self.contained(path)
        if real == self.root:
            raise UnsafePathError(f"refusing to remove the store root {real}.")
        if is_kind(real, "dir"):
            fault("fs", op="rmtree", path=str(real))
            shutil.rmtree(real)

    def remove(self, path: Path) -> None:
        self.rmtree(path) if is_kind(path, "dir") else self.unlink(path)

    def fsync(self, path: Path) -> None:
        real = self.root if os.path.realpath(path) == str(self.root) else self.contained(path)
        fault("fs", op="fsync", path=str(real))
        fd = os.open(real, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def create(self, path: Path) -> BinaryIO:
        return os.fdopen(os.open(self.contained(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644),
                         "wb")

    def write(self, path: Path, data: bytes) -> None:
        """Create `path` holding `data`, fsynced."""
        with self.create(path) as f:
            f.write(data)
        self.fsync(path)

    def write_atomic(self, path: Path, data: bytes, *, tag: str) -> None:
        """All or nothing: a temporary file next to `path`, fsynced, renamed over it, the directory fsynced."""
        tmp = path.with_name(f".{path.name}{C.TMP_MARKER}{tag}")
        try:
            self.write(tmp, data)
            self.rename(tmp, path, replace=True)
        finally:
            self.unlink(tmp)
        self.fsync(path.parent)

    def append_line(self, path: Path, line: str) -> None:
        fd = os.open(self.contained(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _safetensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file as views of a private map (`safe_open`: its header fully validated), and its
    metadata; never through a link; any fault is `CorruptCheckpointError` naming the file."""
    from safetensors import safe_open

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{what} file {path} is missing.") from e
    except OSError as e:
        why = "it is a symbolic link; the store never reads through links" if e.errno == errno.ELOOP else str(e)
        raise CorruptCheckpointError(f"{what} file {path} cannot be read ({why}).") from e
    try:  # through the descriptor opened without following a link
        with safe_open(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.offset_keys()}, dict(f.metadata() or {})
    except Exception as e:  # SafetensorError, OSError, ...: whatever the parser's complaint
        raise CorruptCheckpointError(f"{what} file {path} is not a valid safetensors file ({e}); the checkpoint is "
                                     "corrupt, restore an older one.") from e
    finally:
        os.close(fd)


def _blob_digest(t: torch.Tensor) -> str:
    """Content address of a blob of an earlier version: SHA-256 of ``"<dtype>:<shape>\\n"`` and the bytes."""
    from .manifest import raw_view

    hasher = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}\n".encode())
    hasher.update(raw_view(t))
    return hasher.hexdigest()


class CheckpointStore:
    """Tiered checkpoints of one task under a store root, committed atomically.

    Args:
        root (`str` or `os.PathLike`): store directory (holds `catalog.db` and one folder per task), or a URL.
        task_id (`str`, *optional*, defaults to `"default"`): the run's folder under `root`.
        rank (`int`, *optional*, defaults to `0`): this process's rank; rank 0 commits.
        world_size (`int`, *optional*, defaults to `1`): ranks that write each save.
        session_id (`str`, *optional*): names this run's temporary directories; the same on every rank (broadcast
            it). Generated when `world_size == 1`.
        compression_level (`int`, *optional*, defaults to `1`): zstd level of the optimizer tier.
        compression_threads (`int`, *optional*, defaults to `0`): threads that (de)compress it (0: every CPU).
        compression (`str` or `Codec`, *optional*, defaults to `"zstd"`): codec of the optimizer tier, or `"none"`.
        rank_timeout_s (`float`, *optional*, defaults to `600.0`): how long rank 0 waits for the other ranks' files.
        cleanup (`bool`, *optional*, defaults to `True`): on rank 0, take the task's writer lock, finish or remove
            what interrupted saves left and sync the catalog. Readers (a writer process, tools) pass `False`.
        read_only (`bool`, *optional*, defaults to `False`): change nothing on disk (for read-only media,
            concurrent readers and every command that only reads).
        takeover (`bool`, *optional*, defaults to `False`): replace the lock of a holder this host cannot see
            (another host) at once instead of waiting; never a running holder of this host.
        lock_wait_s (`float`, *optional*, defaults to `120.0`): how long to wait for the lock of such a holder.
        storage_options (`Mapping`, *optional*): fsspec options of a URL root (never logged).
        cache_dir (`str` or `os.PathLike`, *optional*): a URL root's local cache (default `remote.default_cache_dir`).
        retries (`int`, *optional*, defaults to `5`) / backoff_s (`float`, *optional*, defaults to `0.5`): retries of
            each object-store call and the first backoff.

    Example:
        ```python
        >>> store = CheckpointStore("out/smart_ckpt", task_id="run1")
        >>> store.save(CheckpointState(step=10, weights=model.state_dict()), SaveRequest(step=10, reason="interval"))
        >>> store.load("auto").weights["lm_head.weight"].shape
        ```
    """

    def __init__(self, root: str | os.PathLike[str], *, task_id: str = C.DEFAULT_TASK_ID, rank: int = 0,
                 world_size: int = 1, session_id: str | None = None, compression_level: int = 1,
                 compression_threads: int = 0, compression: Codec | str = Codec.ZSTD, rank_timeout_s: float = 600.0,
                 cleanup: bool = True, read_only: bool = False, takeover: bool = False,
                 lock_wait_s: float = DEFAULT_WAIT_S, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, retries: int = 5, backoff_s: float = 0.5) -> None:
        local, remote = split_root(root, rank=rank, storage_options=storage_options, cache_dir=cache_dir,
                                   retries=retries, backoff_s=backoff_s)
        if session_id is None and world_size > 1:
            raise ConfigError("session_id=None is invalid with world_size > 1: every rank must use the same id; "
                              "create one on rank 0 and broadcast it (distributed.broadcast_object).")
        spec = StoreSpec(root=str(Path(local).absolute()), task_id=task_id, rank=rank, world_size=world_size,
                         session_id=session_id or new_session_id(), codec=compression,
                         compression_level=compression_level, compression_threads=compression_threads,
                         rank_timeout_s=float(rank_timeout_s), remote=remote)
        self._open(spec, cleanup=cleanup, read_only=read_only, takeover=takeover, pull=True, lock_wait_s=lock_wait_s)

    @classmethod
    def from_spec(cls, spec: StoreSpec, *, cleanup: bool = True, read_only: bool = False,
                  takeover: bool = False) -> CheckpointStore:
        """Open the store `spec` describes (a writer process: ``from_spec(store.spec, cleanup=False)``)."""
        store = cls.__new__(cls)
        store._open(spec, cleanup=cleanup, read_only=read_only, takeover=takeover, pull=cleanup)
        return store

    def _open(self, spec: StoreSpec, *, cleanup: bool, read_only: bool, takeover: bool, pull: bool,
              lock_wait_s: float = 0.0) -> None:
        self.spec, self.root, self.read_only = spec, Path(spec.root).absolute(), read_only
        self.task_dir, self._lock = self.root / spec.task_id, threading.RLock()
        self.abort_reason: str | None = None
        self.remote = Remote(spec.remote, spec.task_id) if spec.remote is not None else None
        self.url = spec.remote.shown if spec.remote is not None else str(self.root)
        self._rechecked: set[tuple[int, float]] = set()
        self._timelines_cache: tuple[Any, dict[str, Any]] | None = None
        writer = spec.rank == 0 and cleanup and not read_only
        if self.remote is None and self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"root={str(self.root)!r} is invalid: it is a file, not a directory; pass the store's "
                              "directory (new or existing), e.g. the folder next to it.")
        if not read_only or self.remote is not None:
            try:  # readers never create anything (a URL root's cache is not the store)
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise self._not_writable(str(e)) from e
        if writer and self.remote is None and not os.access(self.root, os.W_OK | os.X_OK):
            raise self._not_writable("a read-only file system, or no write permission")
        self._disk = _Disk(self.root)
        if is_kind(self.task_dir, "link"):
            raise ConfigError(f"{self.task_dir} is a symbolic link; the store refuses to work through links (point "
                              "root at the real directory instead).")
        self._memory = read_only
        if not read_only:
            try:
                self.catalog = Catalog(self.root / C.CATALOG_NAME)
            except sqlite3.OperationalError as e:
                if writer:
                    raise self._not_writable(f"its catalog {self.root / C.CATALOG_NAME} cannot be opened: {e}") from e
                logger.warning("catalog %s cannot be opened (%s); reading the manifests instead",
                               self.root / C.CATALOG_NAME, e)
                self._memory = True
        if self._memory:
            self.catalog = Catalog.snapshot(self.root / C.CATALOG_NAME)
        self._writer = WriterLock(self.task_dir, session=spec.session_id)
        if writer:
            self._writer.acquire(takeover=takeover, what=f"task {spec.task_id!r} under {self.url}", wait_s=lock_wait_s)
        if self.remote is not None and (pull or writer):
            self._remote_open(writer=writer)
        if writer:
            self._remove_leftovers()
        if writer and self.catalog.rebuilt:
            self.reindex()
        elif writer or self._memory or (self.remote is not None and pull):
            self.sync_catalog()

    task_id = property(lambda self: self.spec.task_id)
    rank = property(lambda self: self.spec.rank)
    world_size = property(lambda self: self.spec.world_size)
    session_id = property(lambda self: self.spec.session_id)
    compression_level = property(lambda self: self.spec.compression_level)
    compression_threads = property(lambda self: self.spec.compression_threads)
    compression = property(lambda self: self.spec.codec.value)
    rank_timeout_s = property(lambda self: self.spec.rank_timeout_s)

    def _not_writable(self, why: str) -> StoreNotWritableError:
        return StoreNotWritableError(
            f"the store root {self.root} is not writable ({why}): this run could not save a checkpoint there. Make it "
            "writable, or save to another root (SmartCkptConfig(root=...), --smart_ckpt_root) and resume from this "
            f"store by path (resume_checkpoint(trainer, '{self.root / self.spec.task_id}/step-<N>')); to only read "
            "it, open CheckpointStore(..., read_only=True) or use the hf-dynamic-ckpt read commands.")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise DynamicCkptError(f"{what} is refused: the store {self.root} was opened with read_only=True.")

    # -- housekeeping ---------------------------------------------------------------------------------------------
    def ensure_root(self) -> bool:
        """Rank 0: recreate the root, the task folder, the catalog and the writer lock when something deleted them
        under a running writer (a cleanup script's ``rm -rf``); the catalog is rebuilt from the manifests left. The
        lock holder logs one WARNING. Cheap (a few `stat`s). Returns whether anything was recreated."""
        if self.read_only or self.rank != 0 or self.remote is not None:
            return False
        if is_kind(self.task_dir, "dir") and not self.catalog.replaced() and not self._writer.moved():
            return False
        with self._lock:
            if is_kind(self.task_dir, "dir") and not self.catalog.replaced() and not self._writer.moved():
                return False  # another thread of this process recreated it meanwhile
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._disk.mkdir(self.task_dir)
                self._disk.fsync(self.root)
                if self.catalog.replaced():
                    self.catalog.reopen()
                self._writer.refresh(what=f"task {self.task_id!r} under {self.url}")
                self._rebuild(all_tasks=True)
            except OSError as e:
                raise SaveError(f"the store root {self.root} was deleted and cannot be recreated: {e}") from e
        if self._writer.held:
            logger.warning("the store %s (task %r) was deleted while this run was writing it; recreated it, and the "
                           "catalog from the manifests left on disk: saves continue, checkpoints deleted with it are "
                           "gone", self.root, self.task_id)
        return True

    def close(self) -> None:
        """Close the catalog and release the writer lock (idempotent)."""
        self.catalog.close()
        self._writer.release()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abort(self, reason: str) -> None:
        """Make a save waiting for other ranks' files (rank 0) give up now, and every later one, with
        `DistributedError` naming `reason` (a rank died); nothing is committed. `clear_abort` undoes it."""
        self.abort_reason = str(reason) or "aborted"

    def clear_abort(self) -> None:
        self.abort_reason = None

    def _catalog(self, work: Callable[[], Any]) -> None:
        """A catalog change: best effort where the manifests stay the truth anyway (other ranks, read-only files)."""
        try:
            work()
        except sqlite3.OperationalError as e:
            if self.rank == 0 and not self._memory and "readonly" not in str(e).replace(" ", ""):
                raise
            logger.debug("catalog %s not updated (%s); the manifests stay the truth", self.catalog.path, e)

    def _record(self, info: CheckpointInfo) -> None:
        self._catalog(lambda: self.catalog.upsert(info, root=self.root))

    def _set_status(self, info: CheckpointInfo, status: str) -> None:
        if self._owns(info.path) is not None:
            self._catalog(lambda: self.catalog.set_status(self.task_id, info.step, status))

    def sync_catalog(self, *, recheck_hidden: bool = False, drop_missing: bool = False) -> None:
        """Make this task's catalog rows agree with its directories and manifests (`Catalog.sync`)."""
        with self._lock:
            self._catalog(lambda: self.catalog.sync(
                self.task_id, root=self.root, committed=self._committed(), scan=self._scan,
                abandoned=self._abandoned(), recheck_hidden=recheck_hidden, drop_missing=drop_missing))

    def reindex(self) -> int:
        """Rebuild the catalog from the manifests (every task under `root`; only this one when read-only or a URL);
        returns the rows written (a damaged manifest gets a ``"corrupt"`` row)."""
        with self._lock:
            if self.remote is not None:
                self._pull()
            return self._rebuild(all_tasks=not self._memory and self.remote is None)

    def _rebuild(self, *, all_tasks: bool) -> int:
        if not all_tasks:
            return self.catalog.rebuild(self._scan_all(self.task_dir), root=self.root, task_id=self.task_id)
        infos = [i for name in listdir(self.root) if not name.startswith(".") and name != C.BLOBS_DIR
                 for i in self._scan_all(self.root / name)]
        return self.catalog.rebuild(infos, root=self.root)

    # -- finding --------------------------------------------------------------------------------------------------
    def _owns(self, path: str | os.PathLike[str]) -> int | None:
        """The step when `path` is a checkpoint directory of this task, else `None`."""
        path = Path(path).absolute()
        same = path.parent == self.task_dir or os.path.realpath(path.parent) == os.path.realpath(self.task_dir)
        return parse_step_dir(path.name) if same else None

    def _committed(self, task_dir: Path | None = None) -> dict[int, Path]:
        """Real ``step-<N>`` directories of a task (a link named like one is ignored, with a warning)."""
        out, task_dir = {}, task_dir or self.task_dir
        for name in listdir(task_dir):
            if (step := parse_step_dir(name)) is not None and is_kind(task_dir / name, "dir"):
                out[step] = task_dir / name
            elif step is not None and is_kind(task_dir / name, "link"):
                logger.warning("%s is a symbolic link, not a checkpoint: the store ignores it and never follows it",
                               task_dir / name)
        return out

    def _read_manifest(self, step: int, path: Path | None = None) -> dict[str, Any]:
        """The manifest of `step` (read once more after a read error, a transient fault's usual shape)."""
        path = path or self.task_dir / step_dir_name(step)
        for attempt in (1, 2):
            try:
                fault("read", name=C.MANIFEST_NAME, step=step, op="read")
                return read_manifest(path, step=step, task_id=path.parent.name)
            except CorruptCheckpointError as e:
                if attempt == 2 or not isinstance(e.__cause__, OSError):
                    raise
            except CheckpointNotFoundError:
                raise
            except OSError as e:  # the test hook's
                if attempt == 2:
                    raise CorruptCheckpointError(f"{path / C.MANIFEST_NAME}: the manifest cannot be read ({e}).") \
                        from e
        raise AssertionError("unreachable")

    def _info(self, manifest: Mapping[str, Any], path: Path) -> CheckpointInfo:
        info = info_from_manifest(manifest, path)
        return dataclasses.replace(info, abandoned=True) if (info.step, info.save_time) in self._abandoned() else info

    def _scan(self, step: int, path: Path) -> CheckpointInfo | None:
        """The checkpoint a directory's manifest describes; `None` without one; a ``"corrupt"`` row when unusable."""
        try:
            return self._info(self._read_manifest(step, path), path)
        except CheckpointNotFoundError:
            return None
        except (CorruptCheckpointError, FormatVersionError) as e:
            logger.info("checkpoint %s has an unusable manifest: %s", path, e)
            return broken_info(path.parent.name, step, path, STATUS_CORRUPT)

    def _scan_all(self, task_dir: Path) -> list[CheckpointInfo]:
        return [i for step, path in sorted(self._committed(task_dir).items()) if (i := self._scan(step, path))]

    def list(self, include_unhealthy: bool = False, include_abandoned: bool = False) -> builtins.list[CheckpointInfo]:
        """Checkpoints of this task, newest first.

        Args:
            include_unhealthy (`bool`, *optional*, defaults to `False`): also unhealthy checkpoints and rows whose
                status is ``"missing"`` or ``"corrupt"``.
            include_abandoned (`bool`, *optional*, defaults to `False`): also checkpoints of timelines a later run
                forked away from.
        """
        self.sync_catalog(recheck_hidden=not include_unhealthy)  # a flag that hides a checkpoint is re-read first
        abandoned = self._abandoned()
        infos = [Catalog.to_info(r, root=self.root, abandoned=(int(r["step"]), float(r["save_time"])) in abandoned)
                 for r in self.catalog.rows(self.task_id)]
        return [i for i in infos if (include_unhealthy or (i.healthy and i.status == STATUS_OK))
                and (include_abandoned or not i.abandoned)]

    def resolve(self, ref: Ref) -> CheckpointInfo:
        """The checkpoint a restore-point ref names.

        Args:
            ref (`str`, `int`, `os.PathLike` or `CheckpointInfo`): ``"auto"`` (newest healthy checkpoint with
                weights), ``"best"`` (lowest recorded loss), ``"fastest"`` (lowest estimated recovery cost),
                ``"step:N"`` or ``N`` (that step, whatever its health or timeline), or a checkpoint directory.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        if isinstance(ref, CheckpointInfo):
            return ref
        if isinstance(ref, int):
            return self._by_step(ref)
        text = os.fspath(ref)
        if text in NAMED_REFS:
            for row in self.catalog.rows(self.task_id):  # a corrupt flag is re-verified once before it excludes
                key = (int(row["step"]), float(row["save_time"]))
                if row["status"] == STATUS_CORRUPT and row["healthy"] and key not in self._rechecked:
                    self._rechecked.add(key)
                    with contextlib.suppress(CheckpointNotFoundError):
                        self.verify(key[0])
            candidates = [i for i in self.list() if Tier.WEIGHTS in i.tiers]
            if text == "best":
                candidates = [i for i in candidates if i.loss is not None]
            if not candidates:
                raise CheckpointNotFoundError(
                    "resolve('best'): no healthy checkpoint records a loss; " if text == "best" else
                    f"resolve({text!r}): no healthy committed checkpoint with weights; " + f"{self._available()}.")
            if text == "best":
                return min(candidates, key=lambda i: (i.loss, -i.step))
            if text == "fastest":
                return min(candidates, key=lambda i: (float("inf") if i.recovery_cost_ms is None else
                                                      i.recovery_cost_ms, -i.step))
            return candidates[0]
        if text.startswith("step:") or text.isdigit():
            try:
                return self._by_step(int(text.removeprefix("step:")))
            except ValueError as e:
                raise CheckpointNotFoundError(f"ref {text!r} is invalid: expected step:N with an integer N.") from e
        return self._by_path(Path(text).absolute())

    def _available(self) -> str:
        infos = self.list(include_unhealthy=True, include_abandoned=True)
        if not infos:
            return f"the store has no checkpoints of task {self.task_id!r} under {self.root}"

        def note(i: CheckpointInfo) -> str:
            flags = ([] if i.status == STATUS_OK else [i.status]) + (["unhealthy"] if not i.healthy and
                                                                      i.status == STATUS_OK else [])
            flags += ["abandoned"] if i.abandoned else []
            return f"{i.step}" + (f" ({', '.join(flags)})" if flags else "")

        steps = ", ".join(note(i) for i in sorted(infos, key=lambda i: i.step))
        return f"available steps of task {self.task_id!r}: {steps}"

    def _by_step(self, step: int) -> CheckpointInfo:
        self.sync_catalog()
        row = self.catalog.get(self.task_id, step)
        if row is not None and row["status"] != STATUS_MISSING:
            return Catalog.to_info(row, root=self.root, abandoned=(step, float(row["save_time"])) in self._abandoned())
        removed = self.removed().get(step)
        why = f" (retention removed it: {removed.get('rule')}; keep_last: null and null retention_days keep every " \
              "checkpoint, or pin one)" if removed and Tier.WEIGHTS.value in (removed.get("tiers") or ()) else ""
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {self.task_dir}{why}; "
                                      f"{self._available()}.")

    def _by_path(self, path: Path) -> CheckpointInfo:
        if (step := self._owns(path)) is not None:
            return self._by_step(step)
        if is_kind(path, "link"):
            raise CheckpointNotFoundError(f"{path} is a symbolic link; the store never follows links. Pass the real "
                                          f"directory; {self._available()}.")
        if not is_kind(path, "dir"):
            raise CheckpointNotFoundError(f"{path} is neither 'auto', 'best', 'fastest', 'step:N' nor an existing "
                                          f"checkpoint directory; {self._available()}.")
        if C.TMP_MARKER in path.name:
            raise CheckpointNotFoundError(f"{path} is an unfinished save (temporary directory), not a checkpoint; "
                                          f"{self._available()}.")
        if not is_kind(path / C.MANIFEST_NAME, "file"):
            if is_kind(path / C.TRAINER_STATE_NAME, "file"):
                native = "DeepSpeed's and Trainer's" if any(n.startswith("global_step") for n in listdir(path)) \
                    else "Trainer's"
                raise CheckpointNotFoundError(
                    f"{path} is {native} own checkpoint folder, not one of this store: pass it to "
                    "trainer.train(resume_from_checkpoint=...) directly (Trainer loads it itself; SmartCkptCallback "
                    f"saves into the store from there on); {self._available()}.")
            raise CheckpointNotFoundError(f"{path} is not a checkpoint directory (no {C.MANIFEST_NAME}); pass a "
                                          f"step-<N> directory of a store; {self._available()}.")
        return info_from_manifest(read_manifest(path, step=parse_step_dir(path.name)), path)

    # -- reading --------------------------------------------------------------------------------------------------
    def _manifest_of(self, info: CheckpointInfo) -> dict[str, Any]:
        """The verified manifest of `info`, its files downloaded first under a URL root; a missing or damaged one is
        recorded in the catalog."""
        directory = Path(info.path)
        own = self._owns(directory) is not None
        if self.remote is not None and own and is_kind(directory, "dir"):
            try:
                self._materialize(info.step)
            except OSError as e:
                raise CorruptCheckpointError(f"step {info.step} could not be downloaded from {self.url}: {e}") from e
        try:
            return self._read_manifest(info.step) if own else read_manifest(directory, step=parse_step_dir(
                directory.name))
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            self._set_status(info, STATUS_MISSING if isinstance(e, CheckpointNotFoundError) else STATUS_CORRUPT)
            raise

    def _blobs_dir(self, directory: Path) -> Path:
        return (self.task_dir if self._owns(directory) is not None else directory.parent) / C.BLOBS_DIR

    def _problems(self, directory: Path, manifest: Mapping[str, Any], names: Iterable[str], *,
                  hashed: Collection[str] = ()) -> builtins.list[str]:
        """What is wrong with the listed files (missing, a link, size, checksum with the entry's own algorithm); the
        files of `hashed` are checksummed as they are read, so only their presence and size are checked here."""
        problems = []
        for name in names:
            entry, path = manifest[C.KEY_FILES][name], directory / name
            rank = entry.get(C.KEY_RANK)
            where = f"{name} (tier {entry.get(C.KEY_TIER)}" + (f", rank {rank})" if rank is not None else ")")
            st = lstat(path)
            if st is None or not is_kind(path, "file"):
                problems.append(f"{where}: file is missing" if st is None else
                                f"{where}: not a regular file (a symbolic link or directory is refused)")
            elif st.st_size != entry[C.KEY_SIZE]:
                problems.append(f"{where}: size {st.st_size} bytes, manifest says {entry[C.KEY_SIZE]} (truncated or "
                                "overwritten)")
            elif name not in hashed:
                expected = entry[C.KEY_CHECKSUM]
                try:
                    fault("read", name=name, step=manifest[C.KEY_STEP], op="check")
                    actual = file_checksum(path, algo=expected.partition(":")[0])
                except FileNotFoundError:
                    actual = "missing"
                    problems.append(f"{where}: file is missing")
                except (ValueError, OSError) as e:
                    actual = "unreadable"
                    problems.append(f"{where}: {e}")
                if actual not in ("missing", "unreadable", expected):
                    problems.append(f"{where}: checksum mismatch ({actual} != {expected}), the file is corrupt")
        return problems

    def _blob_problems(self, directory: Path, records: Mapping[str, Mapping[str, Any]]) -> builtins.list[str]:
        """What is wrong with the blobs of a checkpoint of an earlier version (present, size, content digest)."""
        problems, seen, blobs = [], set(), self._blobs_dir(directory)
        for key, rec in sorted(records.items()):
            if rec["digest"] in seen:
                continue
            seen.add(rec["digest"])
            path = blobs / f"{rec['digest']}.safetensors"
            st = lstat(path) if not is_kind(blobs, "link") else None
            if is_kind(blobs, "link"):
                problem = f"blob {path} is in a linked directory ({blobs} is a symbolic link); refused"
            elif st is None or not is_kind(path, "file"):
                problem = f"blob {path} is missing"
            elif "size" in rec and st.st_size != rec["size"]:
                problem = f"blob {path} has {st.st_size} bytes, expected {rec['size']}"
            else:
                try:
                    fault("read", name=path.name, step=parse_step_dir(directory.name), op="check")
                    tensor = _safetensors(path, "Blob")[0].get("tensor")
                    problem = "" if tensor is not None and _blob_digest(tensor) == rec["digest"] else \
                        f"blob {path} content does not match its digest (corrupt)"
                except (CorruptCheckpointError, OSError) as e:
                    problem = f"blob {path} is unreadable: {e}"
            if problem:
                problems.append(f"{problem} (weight {key!r}, tier weights)")
        return problems

    def load(self, ref: Ref, *, tiers: Collection[Tier] = ALL_TIERS, rank: int | None = None, mmap: bool = True,
             l1_max_numel: int | None = None, weights_checksum: bool = True) -> LoadedCheckpoint:
        """Verify, then read the requested tiers of a checkpoint.

        Every file read is checked (size, checksum) before any tensor is returned; a failed check or read is retried
        once. A tier the checkpoint does not hold is left `None` with a note in `warnings`.

        Args:
            ref: anything `resolve` accepts.
            tiers (`Collection[Tier]`, *optional*, defaults to all tiers): what to read.
            rank (`int`, *optional*): whose RNG file to read; defaults to this store's rank.
            mmap (`bool`, *optional*, defaults to `True`): weights as views of a private map of the file (no copy);
                `False` reads them into memory.
            l1_max_numel (`int`, *optional*): the most elements an optimizer-tier tensor may declare
                (`state.optimizer.state_numel_bound`); checked before anything is allocated.
            weights_checksum (`bool`, *optional*, defaults to `True`): `False` checks the weights file's size and
                header only and leaves its checksum to `read_weights_into(..., verify=True)`, which must run before any
                weight is used.

        Raises:
            `CheckpointNotFoundError`: `ref` names no committed checkpoint.
            `CorruptCheckpointError`: a needed file is missing, truncated, altered or does not parse (the message
                lists each problem), or the manifest is damaged.
            `FormatVersionError`: written by a newer format.
            `IncompatibleStateError`: an optimizer-tier tensor is larger than `l1_max_numel` allows.
        """
        info = self.resolve(ref)
        directory, manifest = Path(info.path), self._manifest_of(info)
        rank = self.rank if rank is None else rank
        held, wanted = tiers_of(manifest), {Tier(t) for t in tiers}
        loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(C.KEY_EXTRA) or {}))
        for tier in sorted(wanted - held):
            loaded.warnings.append(f"step {info.step} has no {tier.value} tier (saved tiers: "
                                   f"{', '.join(sorted(t.value for t in held)) or 'none'})")
        wanted &= held
        own_rng = C.RNG_NAME_TEMPLATE.format(rank=rank)
        names = [n for n, e in sorted(manifest[C.KEY_FILES].items()) if e.get(C.KEY_TIER) in {t.value for t in wanted}
                 and (not n.startswith("rng-rank") or n == own_rng)]
        if Tier.STATE in wanted and own_rng not in names and any(n.startswith("rng-rank") for n in
                                                                 manifest[C.KEY_FILES]):
            loaded.warnings.append(f"step {info.step} has no RNG state for rank {rank} (saved with world_size="
                                   f"{manifest.get(C.KEY_WORLD_SIZE)}); this rank's random streams start fresh")
        hashed = {C.OPTIMIZER_NAME} | (set() if weights_checksum else {C.WEIGHTS_NAME})
        for attempt in (1, 2):
            found = self._problems(directory, manifest, names, hashed=hashed)
            if Tier.WEIGHTS in wanted and not is_sharded(manifest):
                if C.WEIGHTS_NAME not in manifest[C.KEY_FILES]:
                    found.append(f"tier weights is recorded but {C.WEIGHTS_NAME} is not listed")
                found += self._blob_problems(directory, manifest.get(C.KEY_BLOBS) or {})
            if not found:
                try:
                    self._read_tiers(directory, manifest, wanted, names, loaded, mmap=mmap, l1_max_numel=l1_max_numel)
                    return loaded
                except (CorruptCheckpointError, OSError) as e:
                    found = [str(e)]
                    loaded.weights = loaded.optimizer = loaded.scheduler = loaded.scaler = None  # not this attempt's
                    loaded.rng = loaded.sampler = None
            if attempt == 1:
                logger.debug("step %d: %s; reading it once more before giving up", info.step, "; ".join(found))
        self._set_status(info, STATUS_CORRUPT)
        raise CorruptCheckpointError(f"checkpoint {directory} failed verification, nothing was loaded: "
                                     + "; ".join(p.rstrip(".") for p in found)
                                     + ". Restore another checkpoint (a resume falls back automatically).")

    def _read_tiers(self, directory: Path, manifest: Mapping[str, Any], wanted: set[Tier], names: builtins.list[str],
                    loaded: LoadedCheckpoint, *, mmap: bool, l1_max_numel: int | None) -> None:
        step = manifest[C.KEY_STEP]
        if Tier.WEIGHTS in wanted:
            table = sharded_table(manifest)  # FSDP2 / ZeRO: names and global shapes; the shards are read later
            loaded.weights = placeholders(table) if table is not None else self._read_weights(directory, manifest,
                                                                                               mmap)
            loaded.frozen = dict(manifest.get(C.KEY_FROZEN) or {})
        if Tier.OPTIMIZER in wanted:
            structure = read_json(directory / C.OPTIMIZER_META_NAME)
            if not isinstance(structure, dict):
                raise CorruptCheckpointError(f"{directory / C.OPTIMIZER_META_NAME} is not a JSON object.")
            tensors: dict[str, torch.Tensor] = {}
            if C.OPTIMIZER_NAME in names:
                fault("read", name=C.OPTIMIZER_NAME, step=step, op="read")
                with open_read(directory / C.OPTIMIZER_NAME) as f:
                    tensors = read_tensors(directory / C.OPTIMIZER_NAME, f, max_numel=l1_max_numel,
                                           checksum=manifest[C.KEY_FILES][C.OPTIMIZER_NAME][C.KEY_CHECKSUM],
                                           threads=self.compression_threads)
            state = unflatten_state(structure, tensors)
            loaded.optimizer, loaded.scheduler, loaded.scaler = (state.get(p) for p in C.L1_PARTS)
        if Tier.STATE in wanted:
            for name in names:
                if name == C.SAMPLER_NAME or name.startswith("rng-rank"):
                    value = read_json(directory / name)
                    if not isinstance(value, dict):
                        raise CorruptCheckpointError(f"{directory / name} is not a JSON object; the checkpoint is "
                                                     "damaged.")
                    loaded.sampler, loaded.rng = (value, loaded.rng) if name == C.SAMPLER_NAME else (loaded.sampler,
                                                                                                      value)

    def _read_weights(self, directory: Path, manifest: Mapping[str, Any], mmap: bool) -> dict[str, torch.Tensor]:
        path = directory / C.WEIGHTS_NAME
        out, metadata = _safetensors(path, "Weights")
        for key, rec in (manifest.get(C.KEY_BLOBS) or {}).items():  # frozen weights of an earlier version
            blob = self._blobs_dir(directory) / f"{rec['digest']}.safetensors"
            t = _safetensors(blob, f"Blob of weight {key!r}")[0].get("tensor")
            if t is None or str(t.dtype).removeprefix("torch.") != rec["dtype"] or list(t.shape) != rec["shape"]:
                raise CorruptCheckpointError(f"Blob {blob} of weight {key!r} does not hold the manifest's "
                                             f"{rec['dtype']}{rec['shape']}; the blob is corrupt.")
            out[key] = t
        if not mmap:
            out = {k: t.clone() for k, t in out.items()}
        raw = metadata.get(ALIASES_KEY)
        if raw:
            try:
                aliases = loads_bounded(raw)
            except ValueError as e:
                raise CorruptCheckpointError(f"Alias map in {path} is not JSON: {raw[:80]!r}.") from e
            if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
                raise CorruptCheckpointError(f"Alias map in {path} is not a JSON object of key names: {raw[:80]!r}.")
            for alias, target in aliases.items():
                if target not in out:
                    raise CorruptCheckpointError(f"Weight {alias!r} aliases {target!r}, which {path} does not hold.")
                out[alias] = out[target]
        return out

    def read_weights_into(self, loaded: LoadedCheckpoint, targets: Mapping[str, torch.Tensor], *,
                          verify: bool = False, on_write: Callable[[], None] | None = None) -> set[str]:
        """Read the weights file of `loaded` straight into `targets` (a model's own tensors: no map of the file, no
        tensor in between); returns the keys read. A key is read where its target is a contiguous CPU tensor of the
        stored dtype and shape; the rest is the caller's.

        Args:
            loaded (`LoadedCheckpoint`): what `load` returned for the checkpoint.
            targets (`Mapping[str, Tensor]`): where each weight goes.
            verify (`bool`, *optional*, defaults to `False`): hash every byte of the file as it is read and compare
                the manifest's checksum (one pass, after a `load(..., weights_checksum=False)`).
            on_write (`Callable[[], None]`, *optional*): called once, right before the first byte goes into a target.

        Raises:
            `CorruptCheckpointError`: the file cannot be read, does not parse or (with `verify`) fails its checksum
                twice, which records the checkpoint as corrupt; the targets then hold what was read.
        """
        path, step = Path(loaded.info.path) / C.WEIGHTS_NAME, loaded.info.step
        expected = str(loaded.manifest[C.KEY_FILES][C.WEIGHTS_NAME][C.KEY_CHECKSUM]) if verify else None
        for attempt in (1, 2):
            try:
                return self._read_into(path, targets, expected, step, on_write)
            except CorruptCheckpointError as e:
                if expected is None:
                    raise
                if attempt == 2:
                    self._set_status(loaded.info, STATUS_CORRUPT)
                    raise CorruptCheckpointError(f"checkpoint {loaded.info.path} failed verification: "
                                                 f"{str(e).rstrip('.')}. Restore another checkpoint (a resume falls "
                                                 "back automatically).") from None
                logger.debug("step %d: %s; reading it once more before giving up", step, e)
        raise AssertionError("unreachable")

    @staticmethod
    def _read_into(path: Path, targets: Mapping[str, torch.Tensor], expected: str | None, step: int,
                   on_write: Callable[[], None] | None) -> set[str]:
        entries = [(k, t.dtype, list(t.shape), t.nbytes) for k, t in _safetensors(path, "Weights")[0].items()]
        try:
            hasher, done, scratch = (new_hasher(expected.partition(":")[0]) if expected else None), set(), None
        except ValueError as e:  # before any byte lands in a target
            raise CorruptCheckpointError(f"Weights file {path}: {e}") from None
        try:
            fault("read", name=C.WEIGHTS_NAME, step=step, op="read")
            with open_read(path) as f:
                head = f.read(8)
                head += f.read(struct.unpack("<Q", head)[0])  # the header `_safetensors` validated
                if hasher is not None:
                    hasher.update(head)
                for key, dtype, shape, nbytes in entries:  # in file order: one sequential pass
                    t = targets.get(key)
                    fits = t is not None and t.device.type == "cpu" and t.dtype == dtype and list(t.shape) == shape \
                        and t.is_contiguous()
                    if fits:
                        done.add(key)
                    if not fits and hasher is None:
                        f.seek(nbytes, os.SEEK_CUR)
                        continue
                    view = t.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B") \
                        if t is not None and fits and nbytes else None
                    if view is not None and on_write is not None:
                        on_write()
                        on_write = None
                    for lo in range(0, nbytes, HASH_CHUNK):
                        n = min(HASH_CHUNK, nbytes - lo)
                        scratch = scratch if view is not None or scratch is not None else \
                            memoryview(bytearray(HASH_CHUNK))
                        part = view[lo : lo + n] if view is not None else scratch[:n]  # type: ignore[index]
                        if f.readinto(part) != n:
                            raise CorruptCheckpointError(f"Weights file {path} is truncated inside tensor {key!r}.")
                        if hasher is not None:
                            hasher.update(part)  # the chunk just read: still in the CPU's caches
                if hasher is not None:
                    hasher.update(f.read())
        except OSError as e:
            raise CorruptCheckpointError(f"Weights file {path} cannot be read ({e}).") from e
        if hasher is not None and f"{expected.partition(':')[0]}:{hasher.hexdigest()}" != expected:  # type: ignore
            raise CorruptCheckpointError(f"Weights file {path}: checksum mismatch, the file is corrupt.")
        return done

    def gather_weights(self, loaded: LoadedCheckpoint) -> None:
        """Replace the placeholders of a sharded checkpoint's weights (FSDP2, ZeRO) with the whole tensors,
        assembled from every rank's verified shard files; a checkpoint that is not sharded is left as it is."""
        from .shard_files import gather_weights

        table = sharded_table(loaded.manifest)
        if table is not None and loaded.weights is not None:
            loaded.weights = gather_weights(Path(loaded.info.path), table)

    def load_scheduler_only(self, ref: Ref) -> dict[str, Any] | None:
        """The LR-scheduler state from a verified `optimizer.json` (it holds no tensors), for when the optimizer
        tensors are lost; `None`, never an error, when that file is missing, altered or refers to tensors."""
        try:
            info = self.resolve(ref)
            directory, manifest = Path(info.path), self._manifest_of(info)
            if C.OPTIMIZER_META_NAME not in manifest[C.KEY_FILES] or \
                    self._problems(directory, manifest, [C.OPTIMIZER_META_NAME]):
                return None
            structure = read_json(directory / C.OPTIMIZER_META_NAME)
            sched = unflatten_state(structure.get("scheduler"), {}) if isinstance(structure, dict) else None
        except (DynamicCkptError, OSError):
            return None
        return sched if isinstance(sched, dict) else None

    def verify(self, ref: Ref) -> builtins.list[str]:
        """Check a checkpoint completely (manifest, every file's size and checksum, blobs of earlier versions) and
        record the outcome in the catalog (in memory for a ``read_only`` store).

        Returns:
            `list[str]`: one line per problem; empty when the checkpoint is intact.

        Raises:
            `CheckpointNotFoundError`: `ref` names nothing, or the checkpoint was deleted before or while it was
                verified (retention or gc ran meanwhile): a note, not a problem of the checkpoint.
        """
        try:
            info = self.resolve(ref)
        except (CorruptCheckpointError, ValueError) as e:  # a path whose manifest is unusable
            return [f"{C.MANIFEST_NAME}: {e}"]
        directory = Path(info.path)
        gone = CheckpointNotFoundError(f"step {info.step} ({directory}) was deleted before or while it was verified "
                                       "(retention or gc removed it); nothing to verify.")
        try:
            manifest = self._manifest_of(info)
        except CheckpointNotFoundError as e:
            if lstat(directory) is None:
                raise gone from e
            return [f"{C.MANIFEST_NAME}: missing ({e})"]
        except (CorruptCheckpointError, ValueError) as e:
            return [f"{C.MANIFEST_NAME}: {e}"]
        for _ in (1, 2):
            found = self._structure_problems(manifest) + self._problems(directory, manifest, manifest[C.KEY_FILES]) \
                + self._blob_problems(directory, manifest.get(C.KEY_BLOBS) or {})
            if found and lstat(directory / C.MANIFEST_NAME) is None:
                self._set_status(info, STATUS_MISSING)
                raise gone
            if not found:
                break
        self._set_status(info, STATUS_CORRUPT if found else STATUS_OK)
        return found

    @staticmethod
    def _structure_problems(manifest: Mapping[str, Any]) -> builtins.list[str]:
        """Files the manifest should list but does not (per tier and per rank)."""
        files, tiers, problems = manifest[C.KEY_FILES], tiers_of(manifest), []
        if Tier.WEIGHTS in tiers and is_sharded(manifest) and not any(n.startswith("weights-rank") for n in files):
            problems.append("tier weights is recorded but no weights-rank<R>.safetensors file is listed")
        elif Tier.WEIGHTS in tiers and not is_sharded(manifest) and C.WEIGHTS_NAME not in files:
            problems.append(f"tier weights is recorded but {C.WEIGHTS_NAME} is not listed")
        if Tier.OPTIMIZER in tiers and C.OPTIMIZER_META_NAME not in files:
            problems.append(f"tier optimizer is recorded but {C.OPTIMIZER_META_NAME} is not listed")
        ranks = {e.get(C.KEY_RANK) for n, e in files.items() if n.startswith("rng-rank")}
        return problems + [f"{C.RNG_NAME_TEMPLATE.format(rank=r)} (tier state, rank {r}): rank file is not listed"
                           for r in range(int(manifest.get(C.KEY_WORLD_SIZE, 1))) if ranks and r not in ranks]

    # -- saving ---------------------------------------------------------------------------------------------------
    def save(self, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any] | None = None,
             replace: bool = False, cancel: Callable[[], bool] | None = None) -> CheckpointInfo | None:
        """Write this rank's part of a checkpoint; on rank 0, commit it once every rank's files are durable.

        Rank 0 writes weights (L0), optimizer/scheduler/scaler (L1) and the sampler state; every rank its own
        ``rng-rank<R>.json``. Thread-safe; runs no collectives. A step committed by the same timeline is not rewritten
        (its info is returned); one of another timeline, another session, or abandoned is replaced atomically.

        Args:
            state (`CheckpointState`): CPU tensors and JSON-able state of this rank.
            request (`SaveRequest`): what the save is and why; it reaches the manifest as given.
            timings (`dict`, *optional*): the caller's timings in ms (e.g. the snapshot's).
            replace (`bool`, *optional*, defaults to `False`): replace a committed copy of the step whatever its
                timeline (the same on every rank).
            cancel (`Callable[[], bool]`, *optional*): polled while rank 0 waits for the other ranks' files; `True`
                gives up like `abort`.

        Returns:
            `CheckpointInfo` on rank 0 (also when the step was committed before), `None` on other ranks.

        Raises:
            `DistributedError`: rank 0 waited `rank_timeout_s` for other ranks, or was aborted; nothing is committed.
            `SaveError`: writing failed, or `request.step` is not the state's; the previous checkpoints are untouched.
        """
        step = int(state.step)
        if step < 0:
            raise SaveError(f"step={step} is invalid: a checkpoint step must be >= 0.")
        if request.step != step:
            raise SaveError(f"SaveRequest.step={request.step} differs from the state's step {step}; pass the same "
                            "step.")
        self._check_writable("save")
        self.ensure_root()
        with self._lock:
            info, replaced = self._save(state, request, timings, replace, cancel)
            if replaced:  # blobs of an earlier version only the replaced copy used can go
                self._collect_blobs(GcReport())
            return info

    def _existing(self, request: SaveRequest, replace: bool) -> CheckpointInfo | bool | None:
        """What is committed at the request's step, read from disk (the same answer on every rank): `None`, the info
        to return ("already committed"), or `True` (replace it)."""
        path = self.task_dir / step_dir_name(request.step)
        if lstat(path) is None:
            return None
        try:
            manifest = self._read_manifest(request.step)
        except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError):
            return True  # a directory without a usable manifest never blocks a save
        info = info_from_manifest(manifest, path)
        if replace or (info.step, info.save_time) in self._abandoned():
            return True
        if request.lineage is not None and info.lineage is not None:
            return True if info.lineage.timeline != request.lineage.timeline else info
        return True if manifest.get(C.KEY_SESSION_ID) != self.session_id else info

    def _save(self, state: CheckpointState, request: SaveRequest, timings: Mapping[str, Any] | None, replace: bool,
              cancel: Callable[[], bool] | None) -> tuple[CheckpointInfo | None, bool]:
        step, rank, disk = request.step, self.rank, self._disk
        if self.remote is not None and rank != 0:  # this rank's cache has not seen rank 0's recent commits
            try:
                self._refresh_step(step)
            except OSError as e:
                raise SaveError(f"saving step {step} on rank {rank}: reading the bucket failed: {e}; nothing was "
                                "written and the previous checkpoints are untouched.") from e
        found = self._existing(request, replace)
        if isinstance(found, CheckpointInfo):
            if rank == 0:
                logger.debug("step %d is already committed at %s by this timeline; not rewritten", step, found.path)
                self._record(found)
            return (found if rank == 0 else None), False
        if not is_kind(self.task_dir, "dir"):  # a new task
            disk.mkdir(self.task_dir)
            disk.fsync(self.root)
        tmp, t0 = self.task_dir / f"{step_dir_name(step)}{C.TMP_MARKER}{self.session_id}", time.perf_counter()
        try:
            disk.mkdir(tmp)
            plain, shard_files, shards = write_shards(state, tmp, rank=rank)  # FSDP2 / ZeRO: this rank's shards
            files, frozen = self._write_rank_files(plain, tmp, step)
            files.update(shard_files)
            disk.fsync(tmp)
            done = tmp / C.RANK_DONE_TEMPLATE.format(rank=rank)
            record = {"rank": rank, "session_id": self.session_id, "files": files, "frozen": frozen,
                      "tiers": sorted(t.value for t in state.tiers) if rank == 0 else
                      ([Tier.STATE.value] if files else []), **({"sharded": shards} if shards is not None else {})}
            disk.write(done.with_name(done.name + ".part"), json_bytes(record))
            disk.rename(done.with_name(done.name + ".part"), done, replace=True)
            disk.fsync(tmp)
            if self.remote is not None and rank != 0:  # no shared directory: rank 0 reads the object store
                for name in [*files, done.name]:
                    self.remote.put(tmp / name, *((step_dir_name(step), name) if name != done.name else
                                                  (tmp.name, name)))
                disk.rmtree(tmp)
        except Exception as e:
            if rank == 0:
                self._discard(tmp)
            if isinstance(e, SaveError):
                raise
            raise SaveError(f"saving step {step} of task {self.task_id!r} to {tmp} failed on rank {rank}: {e}; the "
                            "previous checkpoints are untouched.") from e
        if rank != 0:
            return None, False
        written = time.perf_counter()
        parts = self._wait_for_ranks(tmp, step, cancel)
        timings = {**dict(timings or {}), "write_ms": round(1000 * (written - t0), 2),
                   "wait_ranks_ms": round(1000 * (time.perf_counter() - written), 2)}
        try:
            return self._commit(tmp, state, request, parts, timings)
        except OSError as e:
            self._discard(tmp)
            raise SaveError(f"committing step {step} to {self.task_dir / step_dir_name(step)} failed: {e}; the "
                            "previous checkpoints are untouched.") from e

    def _write_rank_files(self, state: CheckpointState, tmp: Path, step: int
                          ) -> tuple[dict[str, FileEntry], dict[str, Any]]:
        """This rank's files (rank 0: L0, L1, sampler; every rank: its RNG) and the frozen records of its weights."""
        rank, files, frozen = self.rank, {}, {k: dict(v) for k, v in state.frozen.items()}

        def small(name: str, obj: Any, tier: Tier, owner: int | None) -> None:
            fault("write", step=step, rank=rank, name=name)
            data = json_bytes(obj)
            self._disk.write(tmp / name, data)
            files[name] = entry_of(data, tier=tier, rank=owner)

        if rank == 0 and state.weights is not None:
            weights = dict(state.weights)
            frozen.update({k: frozen_record(weights.pop(k)) for k in sorted(state.dedup_keys & set(weights))})
            files[C.WEIGHTS_NAME] = self._write_weights(weights, tmp / C.WEIGHTS_NAME, step)
        parts = {p: getattr(state, p) for p in C.L1_PARTS}
        if rank == 0 and any(v is not None for v in parts.values()):
            structure, tensors = flatten_state(parts)
            fault("write", step=step, rank=rank, name=C.OPTIMIZER_NAME)
            with self._disk.create(tmp / C.OPTIMIZER_NAME) as f:
                size, checksum = write_tensors(tensors, f, codec=self.spec.codec, level=self.compression_level,
                                               threads=self.compression_threads)
            self._disk.fsync(tmp / C.OPTIMIZER_NAME)
            files[C.OPTIMIZER_NAME] = {C.KEY_SIZE: size, C.KEY_CHECKSUM: checksum, C.KEY_TIER: Tier.OPTIMIZER.value,
                                       C.KEY_RANK: None}
            small(C.OPTIMIZER_META_NAME, structure, Tier.OPTIMIZER, None)
        if rank == 0 and state.sampler is not None:
            small(C.SAMPLER_NAME, json_safe(state.sampler), Tier.STATE, None)
        if state.rng is not None:
            rng = state.rng.to_json() if hasattr(state.rng, "to_json") else state.rng  # a snapshot's raw capture
            small(C.RNG_NAME_TEMPLATE.format(rank=rank), rng, Tier.STATE, rank)
        return files, frozen

    def _write_weights(self, weights: Mapping[str, Any], path: Path, step: int) -> FileEntry:
        """L0 with the `safetensors` package (metadata ``{"format": "pt"}``, so an adapter's file is a drop-in
        ``adapter_model.safetensors``); tied weights stored once, their aliases in the metadata."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[Any, str] = {}
        storages: dict[Any, str] = {}
        for key, value in weights.items():
            if isinstance(value, BlobRef) or not isinstance(value, torch.Tensor):
                raise SaveError(f"Weight {key!r} is a {type(value).__name__}, expected a torch.Tensor; pass the "
                                "model's state_dict() (or the PEFT adapter dict).")
            if value.layout != torch.strided:
                raise SaveError(f"Weight {key!r} has layout {value.layout}; convert it with `.to_dense()` first.")
            ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                     value.dtype) if value.numel() else None
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
            t = value.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            tensors[key] = t.clone() if ptr in storages else t  # views of one storage that differ: stored apart
            storages[ptr] = key
        fault("write", step=step, rank=self.rank, name=C.WEIGHTS_NAME)
        self._disk.create(path).close()  # a new regular file: never through a link
        try:
            save_file(tensors, path, {"format": "pt", **({ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
                                                         if aliases else {})})
        except (ValueError, TypeError, RuntimeError, KeyError) as e:  # KeyError: a dtype safetensors lacks
            raise SaveError(f"the weights cannot be written as safetensors ({type(e).__name__}: {e}); cast them to a "
                            "dtype it stores (float, int, bool, complex64).") from e
        self._disk.fsync(path)
        return {C.KEY_SIZE: path.stat().st_size, C.KEY_CHECKSUM: file_checksum(path), C.KEY_TIER: Tier.WEIGHTS.value,
                C.KEY_RANK: None}

    def _wait_for_ranks(self, tmp: Path, step: int, cancel: Callable[[], bool] | None) -> builtins.list[dict]:
        """Rank 0: every rank's done record, once all are there (polled: no collective)."""
        deadline, world = time.monotonic() + self.rank_timeout_s, self.world_size
        names = [tmp / C.RANK_DONE_TEMPLATE.format(rank=r) for r in range(world)]
        while True:
            present = [r for r, p in enumerate(names) if is_kind(p, "file") or self._fetch_done(tmp, p)]
            missing = sorted(set(range(world)) - set(present))
            if not missing:
                break
            if self.abort_reason is not None or (cancel is not None and cancel()):
                self._discard(tmp)
                raise DistributedError(f"step {step}: gave up waiting for rank(s) {missing} of {world}: "
                                       f"{self.abort_reason or 'the save was aborted'} (CheckpointStore.abort); "
                                       "nothing "
                                       "was committed and the previous checkpoint stays the restore point.")
            if time.monotonic() >= deadline:
                self._discard(tmp)
                raise DistributedError(
                    f"step {step}: rank(s) {missing} of {world} did not finish writing within "
                    f"{self.rank_timeout_s:g} s "
                    "(rank_timeout_s); nothing was committed and the previous checkpoint stays the restore point. "
                    "Check those ranks' logs, or raise rank_timeout_s for slow storage.")
            time.sleep(0.02 if self.remote is None or world == 1 else 0.25)
        parts = []
        for r, done in enumerate(names):
            try:
                part = read_json(done)
                ok = isinstance(part, dict) and part.get("rank") == r and isinstance(part.get("files"), dict) and \
                    isinstance(part.get("tiers"), list) and isinstance(part.get("frozen", {}), dict)
            except CorruptCheckpointError as e:
                part, ok = {"error": str(e)}, False
            if not ok:
                raise DistributedError(f"{done} is malformed ({str(part)[:120]}); nothing was committed.")
            if part.get("session_id") != self.session_id:
                raise DistributedError(f"{done} belongs to session {part.get('session_id')!r}, not "
                                       f"{self.session_id!r}; every rank must use the session_id broadcast by rank 0.")
            parts.append(part)
        return parts

    def _discard(self, path: Path) -> None:
        try:
            self._disk.rmtree(path)
        except OSError as e:  # a file in the way, a link: left for the next open's cleanup
            logger.warning("could not remove %s: %s", path, e)

    def _commit(self, tmp: Path, state: CheckpointState, request: SaveRequest, parts: builtins.list[dict],
                timings: dict[str, Any]) -> tuple[CheckpointInfo, bool]:
        disk, step = self._disk, request.step
        files: dict[str, Any] = {}
        frozen: dict[str, Any] = {}
        tiers: set[Tier] = set()
        chunks: dict[str, Any] = {}
        for part in parts:
            files.update(part["files"])
            frozen.update(part.get("frozen") or {})
            tiers.update(Tier(t) for t in part["tiers"])
            if isinstance(part.get("sharded"), dict):
                chunks[str(part["rank"])] = part["sharded"]
            disk.unlink(tmp / C.RANK_DONE_TEMPLATE.format(rank=int(part["rank"])))
        extra = {k: v for k, v in state.extra.items() if k != C.KEY_RANK_CHUNKS}
        if chunks:  # every rank's chunk table, read back by `shard_files.sharded_table`
            extra[C.KEY_SHARDED] = {"format": C.SHARDED_FORMAT, "world_size": self.world_size, "ranks": chunks}
        manifest = build_manifest(
            task_id=self.task_id, step=step, epoch=state.epoch, reason=request.reason, kind=request.kind, tiers=tiers,
            pinned=request.pinned, healthy=request.healthy, world_size=self.world_size, files=files, frozen=frozen,
            session_id=self.session_id, lineage=request.lineage, signals=request.signals,
            debug_info=request.debug_info, extra=extra, timings=timings)
        fault("write", step=step, rank=0, name=C.MANIFEST_NAME)
        disk.write(tmp / C.MANIFEST_NAME, manifest_bytes(manifest))
        disk.fsync(tmp)
        if self.remote is not None:  # the object store's commit point (manifest uploaded last) comes first
            self._publish(tmp, step, files)
        final = self.task_dir / step_dir_name(step)
        aside = None
        if lstat(final) is not None:  # another timeline's copy, or a directory without a manifest
            aside = final.with_name(f"{tmp.name}{C.ASIDE_SUFFIX}")
            disk.rename(final, aside)
            disk.fsync(self.task_dir)
        fault("commit", step=step)
        disk.rename(tmp, final)  # the commit point
        disk.fsync(self.task_dir)
        if aside is not None:
            self._discard(aside)
        info = self._info(manifest, final)
        self._record(info)
        logger.debug("committed %s step %d (%s; tiers %s; %d bytes)", self.task_id, step, request.reason,
                     ",".join(manifest[C.KEY_TIERS]), info.bytes)
        return info, aside is not None

    # -- timelines ------------------------------------------------------------------------------------------------
    def _timelines(self) -> dict[str, Any]:
        """The task's timelines record (``{"format": 1, "current", "abandoned", "forks"}``), cached by file identity;
        an unreadable one is logged and read as empty (then nothing counts as abandoned)."""
        path = self.task_dir / C.TIMELINES_NAME
        st = lstat(path)
        empty: dict[str, Any] = {"format": 1, "current": None, "abandoned": [], "forks": []}
        if st is None:
            return empty
        if self._timelines_cache is not None and self._timelines_cache[0] == (st.st_ino, st.st_size, st.st_mtime_ns):
            return self._timelines_cache[1]
        try:
            record = read_json(path)
            ok = record.get("format") == 1 and all(isinstance(e["step"], int) and isinstance(e["created_at"], int |
                                                                                            float)
                                                   for e in record["abandoned"])
        except (CorruptCheckpointError, AttributeError, KeyError, TypeError) as e:
            record, ok = e, False
        if not ok:
            logger.error("%s is unreadable or malformed (%s); treating no checkpoint as abandoned. Retention will not "
                         "remove abandoned checkpoints until a new fork rewrites it.", path, record)
            record = {**empty, "unreadable": True}
        self._timelines_cache = ((st.st_ino, st.st_size, st.st_mtime_ns), record)
        return record

    def _abandoned(self) -> set[tuple[int, float]]:
        return {(e["step"], float(e["created_at"])) for e in self._timelines()["abandoned"]}

    def fork(self, *, timeline: str, after_step: int | None, session: str,
             parent: Lineage | None = None) -> builtins.list[int]:
        """Start timeline `timeline` (rank 0): every committed checkpoint of another timeline with
        ``step > after_step`` (all of them for `None`, a fresh start) is recorded abandoned, in one atomic write of
        ``<task>/timelines.json``; the checkpoint `parent` resumes from stays usable. Nothing is deleted.

        Returns:
            `list[int]`: the steps newly abandoned.
        """
        self._check_writable("fork")
        if self.rank != 0:
            raise DynamicCkptError(f"fork() runs on rank 0 only (this store is rank {self.rank}); broadcast its "
                                   "result.")
        with self._lock:
            infos, now, record = self._scan_all(self.task_dir), time.time(), self._timelines()
            present = {(i.step, i.save_time) for i in infos}
            entries = {(e["step"], float(e["created_at"])): e for e in record["abandoned"]
                       if (e["step"], float(e["created_at"])) in present}  # checkpoints that are gone are forgotten
            newly = []
            for i in infos:
                own = i.lineage.timeline if i.lineage is not None else None
                revived = parent is not None and parent.parent_step == i.step and \
                    parent.parent_timeline in (None, own)
                if revived:  # the checkpoint the new timeline continues is usable again
                    entries.pop((i.step, i.save_time), None)
                elif own != timeline and (after_step is None or i.step > after_step) and \
                        (i.step, i.save_time) not in entries:
                    entries[(i.step, i.save_time)] = {"step": i.step, "created_at": i.save_time, "timeline": own,
                                                      "session": i.lineage.session if i.lineage else None,
                                                      "by": timeline, "at": now}
                    newly.append(i.step)
            new = {"format": 1, "current": {"timeline": timeline, "session": session, "after_step": after_step,
                                            "parent_step": parent.parent_step if parent else None,
                                            "parent_timeline": parent.parent_timeline if parent else None,
                                            "since": now},
                   "abandoned": sorted(entries.values(), key=lambda e: (e["step"], e["created_at"])),
                   "forks": [*record.get("forks", []), {"timeline": timeline, "session": session,
                                                        "after_step": after_step, "at": now}][-100:]}
            self._disk.write_atomic(self.task_dir / C.TIMELINES_NAME, json_bytes(new), tag=self.session_id)
            if self.remote is not None:
                self.remote.put(self.task_dir / C.TIMELINES_NAME, C.TIMELINES_NAME)
            self.sync_catalog()
            return sorted(newly)

    # -- changing committed checkpoints ---------------------------------------------------------------------------
    def _own(self, ref: Ref, what: str) -> CheckpointInfo:
        info = self.resolve(ref)
        if self._owns(info.path) is None:
            raise DynamicCkptError(f"{what} {info.path}: not a checkpoint of task {self.task_id!r} under {self.root}; "
                                   "open a store on its own root and task.")
        fresh = self._scan(info.step, self.task_dir / step_dir_name(info.step))
        if fresh is None:
            raise CheckpointNotFoundError(f"step {info.step} has no committed checkpoint in {self.task_dir}.")
        return fresh

    def _rewrite_manifest(self, path: Path, manifest: dict[str, Any]) -> None:
        """Replace the manifest of the checkpoint at `path` atomically (written next to it, renamed over it)."""
        self._disk.write(path / f"{C.MANIFEST_NAME}.new", manifest_bytes(manifest))
        self._disk.rename(path / f"{C.MANIFEST_NAME}.new", path / C.MANIFEST_NAME, replace=True)
        self._disk.fsync(path)

    def pin(self, ref: Ref) -> CheckpointInfo:
        """Protect a checkpoint from retention and gc (a ``PINNED`` marker next to its manifest)."""
        self._check_writable("pin")
        with self._lock:
            info = self._own(ref, "pin")
            self._disk.write(Path(info.path) / C.PINNED_MARKER, b"")
            self._disk.fsync(Path(info.path))
            self._mirror(info.step)
            info = dataclasses.replace(info, pinned=True)
            self._record(info)
            return info

    def unpin(self, ref: Ref) -> CheckpointInfo:
        """Undo `pin`, and a pin requested at save time (the manifest is rewritten atomically)."""
        self._check_writable("unpin")
        with self._lock:
            info = self._own(ref, "unpin")
            path, manifest = Path(info.path), self._read_manifest(info.step)
            if manifest.get(C.KEY_PINNED):
                self._rewrite_manifest(path, with_changes(manifest, {C.KEY_PINNED: False}))
            self._disk.unlink(path / C.PINNED_MARKER)
            self._disk.fsync(path)
            self._mirror(info.step)
            info = self._scan(info.step, path) or info
            self._record(info)
            return info

    def delete(self, ref: Ref, *, tiers: Collection[Tier] | None = None, force: bool = False) -> None:
        """Delete a checkpoint of this task, or only some of its tiers.

        Raises:
            `DynamicCkptError`: the checkpoint is pinned (read from disk) and `force` is not set.
        """
        self._check_writable("delete")
        with self._lock:
            info = self._own(ref, "delete")
            if info.pinned and not force:
                raise DynamicCkptError(f"step {info.step} ({info.path}) is pinned; pass force=True to delete it "
                                       "anyway.")
            self._delete(info, None if tiers is None else {Tier(t) for t in tiers})
            self._collect_blobs(GcReport())

    def _delete(self, info: CheckpointInfo, tiers: set[Tier] | None = None) -> int:
        """Delete a checkpoint (renamed to a temporary name first: never half of one that looks committed), or some
        of its tiers (the manifest rewritten before the files go); returns the bytes freed."""
        path = self.task_dir / step_dir_name(info.step)
        if tiers is not None and tiers != set(ALL_TIERS) and set(info.tiers) - tiers:
            new, drop = without_tiers(self._read_manifest(info.step), tiers)
            self._rewrite_manifest(path, new)
            freed = sum(st.st_size for n in drop if (st := lstat(path / n)) is not None)
            for name in drop:  # allowlisted single names (manifest validation)
                self._disk.unlink(path / name)
            self._record(self._info(new, path))
            self._mirror(info.step)
            return freed
        if self.remote is not None:  # the object store first: its manifest goes, so no reader counts it any more
            self.remote.remove(step_dir_name(info.step), C.MANIFEST_NAME)
            self.remote.remove(step_dir_name(info.step))
        trash = path.with_name(f"{path.name}{C.TMP_MARKER}{self.session_id}{C.TRASH_INFIX}{uuid.uuid4().hex[:8]}")
        self._disk.rename(path, trash)
        self._disk.fsync(self.task_dir)
        self._catalog(lambda: self.catalog.remove(self.task_id, info.step))
        freed = _tree_bytes(trash)
        self._disk.rmtree(trash)
        return freed

    def removed(self) -> dict[int, dict[str, Any]]:
        """What retention removed from this task, by step: the latest record of each (``step``, ``tiers``, ``rule``
        in words, ``time``), oldest first."""
        out: dict[int, dict[str, Any]] = {}
        try:
            text = (self.task_dir / C.REMOVED_LOG_NAME).read_text(encoding="utf-8") \
                if is_kind(self.task_dir / C.REMOVED_LOG_NAME, "file") else ""
        except OSError:
            return out
        for line in text.splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a crash
                row = loads_bounded(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    out[row["step"]] = row
        return dict(sorted(out.items()))

    def _note_removed(self, step: int, tiers: Iterable[Tier], rule: str) -> None:
        """Record a removal by retention (best effort: the record only explains a missing step)."""
        line = json.dumps({"step": int(step), "tiers": sorted(Tier(t).value for t in tiers), "rule": rule,
                           "time": time.time()}, sort_keys=True)
        try:
            self._disk.append_line(self.task_dir / C.REMOVED_LOG_NAME, line)
        except OSError as e:
            logger.debug("could not record the removal of step %d (%s)", step, e)

    def prune(self, plan: Iterable[Removal]) -> GcReport:
        """Apply a retention plan (`policy.retention.plan_retention`), then the abandoned-timeline rule.

        Each planned entry is re-read from disk first and kept when it is pinned there, was replaced, is abandoned,
        or its health differs from what the plan read. Abandoned checkpoints the current timeline has passed go too
        (never pinned ones). Every removal is recorded with its rule (`removed`).
        """
        self._check_writable("prune")
        report = GcReport()
        with self._lock:
            for planned, tiers, rule in plan:
                fresh = self._scan(planned.step, self.task_dir / step_dir_name(planned.step))
                why = "is gone" if fresh is None else "was replaced since the plan was made" if \
                    fresh.save_time != planned.save_time else "is pinned on disk" if fresh.pinned else \
                    "is abandoned (removed by the abandoned-timeline rule)" if fresh.abandoned else \
                    f"is {'healthy' if fresh.healthy else 'unhealthy'} on disk, unlike the catalog the plan read" \
                    if fresh.healthy != planned.healthy else None
                if why is not None or fresh is None:
                    report.kept.append(f"step {planned.step} kept: it {why}")
                    if fresh is not None:
                        self._record(fresh)
                    continue
                whole = Tier.WEIGHTS in tiers or not set(fresh.tiers) - set(tiers)
                report.bytes_freed += self._delete(fresh, None if whole else set(tiers))
                if whole:
                    report.removed.append(fresh.step)
                else:
                    report.trimmed[fresh.step] = sorted(Tier(t).value for t in tiers)
                self._note_removed(fresh.step, fresh.tiers if whole else tiers, rule)
            if self._timelines()["abandoned"]:
                self._remove_abandoned(report)
            if report.removed:
                self._collect_blobs(report)
        return report

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove what nothing needs: passed abandoned checkpoints, leftovers of interrupted saves, unused blobs of
        earlier versions. `dry_run` only reports what would go (read-only stores too).

        Raises:
            `StoreLockedError`: another live session writes the task (gc needs the writer lock).
        """
        report = GcReport(dry_run=dry_run)
        if not dry_run:
            self._check_writable("gc")
        with self._lock:
            took = not dry_run and not self._writer.held
            if took:
                self._writer.acquire(what=f"task {self.task_id!r} under {self.url}")
            try:
                for name, size in self._remove_leftovers(dry_run=dry_run):
                    report.temp_dirs.append(name)
                    report.bytes_freed += size
                if self.remote is not None:
                    report.temp_dirs += self._remote_leftovers(dry_run=dry_run, at_open=False, kept=report.kept)
                self._remove_abandoned(report)
                self._collect_blobs(report)
                if not dry_run:
                    self.sync_catalog(drop_missing=True)
            finally:
                if took:
                    self._writer.release()
        return report

    def _remove_abandoned(self, report: GcReport) -> None:
        infos, current = self._scan_all(self.task_dir), self._timelines()["current"]
        top = max((i.step for i in infos if current and not i.abandoned and i.lineage is not None
                   and i.lineage.timeline == current["timeline"]), default=None)
        for i in infos:
            if i.abandoned and not i.pinned and top is not None and i.step < top:
                report.bytes_freed += _tree_bytes(Path(i.path)) if report.dry_run else self._delete(i)
                report.removed.append(i.step)
                report.abandoned.append(i.step)
                if not report.dry_run:
                    self._note_removed(i.step, i.tiers, "abandoned timeline: the run went back before it and has "
                                                        "saved past it since")
            elif i.abandoned:
                report.kept.append(f"step {i.step} kept: abandoned but pinned" if i.pinned else
                                   f"step {i.step} kept: abandoned, the current timeline has not passed it yet")

    def _remove_leftovers(self, *, dry_run: bool = False) -> builtins.list[tuple[str, int]]:
        """Finish what interrupted saves, replace-commits and deletes left (the writer only): a copy set aside by a
        replace-commit whose step has no committed directory is renamed back; then every temporary entry of other
        sessions goes (this session's own ``step-<N>.tmp-<session>`` stays: other ranks may be writing into it)."""
        for name in [] if dry_run else listdir(self.task_dir):
            step = parse_step_dir(name.split(C.TMP_MARKER)[0])
            if step is not None and C.TMP_MARKER in name and name.endswith(C.ASIDE_SUFFIX) and \
                    lstat(self.task_dir / step_dir_name(step)) is None:
                try:
                    self._read_manifest(step, self.task_dir / name)
                except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError) as e:
                    logger.error("step %s: the copy set aside by an interrupted replace (%s) is unusable (%s); left "
                                 "in place", step, name, e)
                    continue
                self._disk.rename(self.task_dir / name, self.task_dir / step_dir_name(step))
                self._disk.fsync(self.task_dir)
                logger.warning("step %d: a replace-commit was interrupted between its renames; the previous copy is "
                               "restored (%s -> %s)", step, name, step_dir_name(step))
        removed, own = [], f"{C.TMP_MARKER}{self.session_id}"
        for name in listdir(self.task_dir):
            path = self.task_dir / name
            kept_aside = name.endswith(C.ASIDE_SUFFIX) and lstat(self.task_dir / name.split(C.TMP_MARKER)[0]) is None
            if kept_aside or not ((name.startswith(C.STEP_DIR_PREFIX) and C.TMP_MARKER in name and
                                   not name.endswith(own)) or name.startswith(f".{C.TIMELINES_NAME}{C.TMP_MARKER}")):
                continue
            removed.append((name, _tree_bytes(path)))
            if not dry_run:
                try:
                    self._disk.remove(path)  # a planted link goes, never its target
                except OSError as e:
                    logger.warning("could not remove leftover %s: %s", path, e)
        blobs = self.task_dir / C.BLOBS_DIR
        for name in [] if dry_run or is_kind(blobs, "link") else listdir(blobs):
            if C.TMP_MARKER in name:
                self._disk.unlink(blobs / name)
        return removed

    def _collect_blobs(self, report: GcReport) -> None:
        """Remove the blobs of earlier versions that no committed checkpoint (nor a copy set aside) references."""
        blobs, used = self.task_dir / C.BLOBS_DIR, set()
        if is_kind(blobs, "dir"):
            dirs = [*self._committed().items(), *((parse_step_dir(n.split(C.TMP_MARKER)[0]), self.task_dir / n)
                                                  for n in listdir(self.task_dir) if n.endswith(C.ASIDE_SUFFIX))]
            for step, path in dirs:
                try:
                    used |= {b["digest"] for b in (self._read_manifest(step or 0, path).get(C.KEY_BLOBS) or {})
                             .values()}
                except CheckpointNotFoundError:
                    continue
                except (CorruptCheckpointError, FormatVersionError):
                    report.kept.append("blobs: not collected, a manifest of this task is unreadable")
                    return
            for name in listdir(blobs):
                if C.TMP_MARKER not in name and name.split(".")[0] not in used:
                    report.blobs.append(name)
                    report.bytes_freed += _tree_bytes(blobs / name)
                    if not report.dry_run:
                        self._disk.unlink(blobs / name)
        if self.remote is not None:
            self._remote_collect_blobs(report)

    # -- a URL root: the cache and the object store ----------------------------------------------------------------
    def _download(self, path: Path, *names: str) -> None:
        """Download an object to `path`, all or nothing (a temporary name renamed into place)."""
        assert self.remote is not None
        part = path.with_name(f".{path.name}{C.TMP_MARKER}{uuid.uuid4().hex[:8]}")
        self._disk.contained(part)
        try:
            self.remote.get(part, *names)
            self._disk.rename(part, path, replace=True)
        finally:
            self._disk.unlink(part)

    def _cache_manifest(self, name: str, data: bytes) -> None:
        """Put a bucket's manifest into the cache as ``<name>/manifest.json`` (when it differs)."""
        local = self.task_dir / name
        if is_kind(local / C.MANIFEST_NAME, "file") and (local / C.MANIFEST_NAME).read_bytes() == data:
            return
        tmp = local.with_name(f"{name}{C.TMP_MARKER}{self.session_id}.pull")
        self._disk.rmtree(tmp)
        self._disk.mkdir(tmp)
        self._disk.write(tmp / C.MANIFEST_NAME, data)
        self._disk.rmtree(local)
        self._disk.rename(tmp, local)

    def _pull(self) -> None:
        """Make the cache hold exactly the bucket's manifests, pin markers and timelines (files come on demand)."""
        assert self.remote is not None
        self._disk.mkdir(self.task_dir)
        timelines = self.remote.read(C.TIMELINES_NAME)
        if timelines is not None:
            self._disk.write_atomic(self.task_dir / C.TIMELINES_NAME, timelines, tag=self.session_id)
        manifests = self.remote.manifests()
        for name, data in sorted(manifests.items()):
            self._cache_manifest(name, data)
            pinned = self.remote.size(name, C.PINNED_MARKER) is not None
            if pinned != is_kind(self.task_dir / name / C.PINNED_MARKER, "file"):
                (self._disk.write if pinned else lambda p, *_: self._disk.unlink(p))(
                    self.task_dir / name / C.PINNED_MARKER, b"")
        for path in self._committed().values():
            if path.name not in manifests:
                self._disk.rmtree(path)

    def _remote_open(self, *, writer: bool) -> None:
        """The writer removes interrupted uploads and notes itself (object stores offer no lock: the note only makes
        a second writer visible); then the cache is made to hold the bucket's manifests."""
        assert self.remote is not None
        if writer:
            self._remote_leftovers(dry_run=False, at_open=True)
            with contextlib.suppress(ValueError, OSError):
                old = loads_bounded(self.remote.read(C.WRITER_LOCK_NAME, limit=4096) or b"null")
                if isinstance(old, dict) and old.get("session") != self.session_id:
                    logger.warning("%s/%s: session %s on %s (pid %s) wrote here last, since %s; object stores have "
                                   "no lock, so make sure it has stopped: two writers on one task interleave their "
                                   "checkpoints", self.url, self.task_id, old.get("session"), old.get("host"),
                                   old.get("pid"), old.get("since"))
            self.remote.put(json.dumps({"session": self.session_id, "host": os.uname().nodename, "pid": os.getpid(),
                                        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(),
                            C.WRITER_LOCK_NAME)
        self._pull()

    def _remote_leftovers(self, *, dry_run: bool, at_open: bool,
                          kept: builtins.list[str] | None = None) -> builtins.list[str]:
        """Other sessions' ``step-<N>.tmp-*`` prefixes, and ``step-<N>/`` prefixes without a manifest (partial
        uploads): all of them at the writer's open, else only those at or below the newest committed step."""
        assert self.remote is not None
        self.remote.invalidate()
        names, committed = self.remote.names(), {parse_step_dir(n) for n in self.remote.manifests()}
        top, removed = max((s for s in committed if s is not None), default=-1), []
        for n in names:
            step = parse_step_dir(n)
            partial = step is not None and step not in committed and (at_open or step <= top)
            if step is not None and step not in committed and not partial and kept is not None:
                kept.append(f"remote:{n} kept: an upload without a manifest above the newest checkpoint (a save may "
                            "be in flight); the writer's next open removes it if it was interrupted")
            if partial or (C.TMP_MARKER in n and parse_step_dir(n.split(C.TMP_MARKER)[0]) is not None and
                           f"{C.TMP_MARKER}{self.session_id}" not in n):
                removed.append(f"remote:{n}")
                if not dry_run:
                    self.remote.remove(n)
        return removed

    def _remote_collect_blobs(self, report: GcReport) -> None:
        assert self.remote is not None
        used = set()
        for name, data in self.remote.manifests().items():
            try:
                used |= {str(b.get("digest")) for b in (loads_bounded(data).get(C.KEY_BLOBS) or {}).values()}
            except (ValueError, AttributeError):
                report.kept.append(f"remote blobs: not collected, the manifest of {name} is unreadable")
                return
        for n in self.remote.names(C.BLOBS_DIR):
            if n.split(".")[0] not in used:
                report.blobs.append(f"remote:{n}")
                report.bytes_freed += self.remote.size(C.BLOBS_DIR, n) or 0
                if not report.dry_run:
                    self.remote.remove(C.BLOBS_DIR, n)

    def _materialize(self, step: int) -> None:
        """Download the files (and blobs of earlier versions) of a cached checkpoint that the cache lacks."""
        path, name = self.task_dir / step_dir_name(step), step_dir_name(step)
        manifest = self._read_manifest(step)
        for fname, entry in manifest[C.KEY_FILES].items():
            if (st := lstat(path / fname)) is None or st.st_size != entry[C.KEY_SIZE]:
                self._download(path / fname, name, fname)
        for rec in (manifest.get(C.KEY_BLOBS) or {}).values():
            blob = self.task_dir / C.BLOBS_DIR / f"{rec['digest']}.safetensors"
            if not is_kind(blob, "file"):
                self._disk.mkdir(blob.parent)
                self._download(blob, C.BLOBS_DIR, blob.name)

    def _refresh_step(self, step: int) -> None:
        """Ranks > 0 before a save: the bucket's manifest of `step` and timelines into the cache, so that this rank
        decides "already committed / replace / new" from the same files as rank 0."""
        assert self.remote is not None
        self.remote.invalidate()
        timelines = self.remote.read(C.TIMELINES_NAME)
        if timelines is not None:
            self._disk.mkdir(self.task_dir)
            self._disk.write_atomic(self.task_dir / C.TIMELINES_NAME, timelines, tag=self.session_id)
        data = self.remote.read(step_dir_name(step), C.MANIFEST_NAME)
        if data is not None:
            self._disk.mkdir(self.task_dir)
            self._cache_manifest(step_dir_name(step), data)
        else:
            self._disk.rmtree(self.task_dir / step_dir_name(step))

    def _fetch_done(self, tmp: Path, done: Path) -> bool:
        """Rank 0 under a URL root: copy another rank's done note from the bucket when it is there."""
        if self.remote is None or self.world_size == 1:
            return False
        self.remote.invalidate()
        if self.remote.size(tmp.name, done.name) is None:
            return False
        self._download(done, tmp.name, done.name)
        return True

    def _publish(self, tmp: Path, step: int, files: Mapping[str, Any]) -> None:
        """Rank 0, before the local rename: the other ranks' files into the cache, then every file to the bucket and
        the manifest last; a failed upload is removed where the endpoint allows (else by the next open or `gc`)."""
        assert self.remote is not None
        name = step_dir_name(step)
        for fname in files:
            if not is_kind(tmp / fname, "file"):
                self._download(tmp / fname, name, fname)
        self.remote.invalidate()
        try:
            self.remote.publish(tmp, name, sorted(files), replacing=self.remote.size(name, C.MANIFEST_NAME) is not None)
            if self.world_size > 1:
                self.remote.remove(tmp.name)  # the other ranks' done notes
        except BaseException:
            with contextlib.suppress(Exception):
                self.remote.remove(name)
            raise

    def _mirror(self, step: int) -> None:
        """After a tier delete, pin or unpin: the bucket's copy of `step` follows the cache."""
        if self.remote is None:
            return
        local, name = self.task_dir / step_dir_name(step), step_dir_name(step)
        files = self._read_manifest(step)[C.KEY_FILES]
        self.remote.put(local / C.MANIFEST_NAME, name, C.MANIFEST_NAME)
        if is_kind(local / C.PINNED_MARKER, "file"):
            self.remote.put(b"", name, C.PINNED_MARKER)
        for stale in set(self.remote.names(name)) - {*files, C.MANIFEST_NAME} - (
                {C.PINNED_MARKER} if is_kind(local / C.PINNED_MARKER, "file") else set()):
            self.remote.remove(name, stale)


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (links not followed)."""
    if not is_kind(path, "dir"):
        return st.st_size if (st := lstat(path)) is not None and is_kind(path, "file") else 0
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(path) for n in names)

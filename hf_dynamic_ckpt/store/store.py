"""`CheckpointStore`: tiered checkpoints of one task under a store root, committed atomically.

The commit protocol and its invariants are docs/internals.md's ("The commit protocol"): a checkpoint is a ``step-<N>``
directory whose manifest verifies; every change goes through `_Disk` (inside the root, no link followed); no tensor
leaves `load` before its file's size and checksum matched (a failed check or read is retried once, then the
checkpoint is marked ``"corrupt"``); resume deletes nothing; ``read_only=True`` changes nothing on disk. A URL root is
a local cache with this layout plus its object-store copy (`remote`). Fault points: ``write`` (`step`, `rank`,
`name`), ``commit`` (`step`), ``fs`` (`op`, `path`), ``read`` (`name`, `step`, `op`: read or check), ``remote``.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
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
from ..errors import CheckpointNotFoundError as NotFound
from ..errors import (
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
from . import manifest as mf
from .catalog import Catalog
from .lock import DEFAULT_WAIT_S, WriterLock
from .manifest import CheckpointInfo, CheckpointState, GcReport, LoadedCheckpoint, SaveRequest, is_kind
from .optpack import flatten_state, read_tensors, unflatten_state, write_tensors
from .remote import Remote, split_root
from .shard_files import gather_weights, placeholders, sharded_table, write_shards

logger = logging.getLogger(__name__)
Ref = str | int | os.PathLike[str] | CheckpointInfo
STORE_DIR = "smart_ckpt"
"""The store's folder under a training `output_dir` (`SmartCkptConfig.resolve_root`)."""
NAMED_REFS = ("auto", "best", "fastest")
ALIASES_KEY = "hf_dynamic_ckpt.aliases"
"""safetensors metadata of tied weights: ``{alias: stored key}`` as JSON; on load the alias is the same tensor."""
_PASS = f"pass the store directory (the one holding {C.CATALOG_NAME}) or the training output_dir that holds " \
        f"{STORE_DIR}/"


def task_dirs(root: Path) -> list[Path]:
    """The task folders of a store directory: real folders holding checkpoints or a timelines record."""
    return [root / n for n in mf.listdir(root) if not n.startswith(".") and n != C.BLOBS_DIR and any(
        c.startswith(C.STEP_DIR_PREFIX) or c == C.TIMELINES_NAME for c in mf.listdir(root / n))]


def find_root(path: str | os.PathLike[str]) -> Path:
    """The store directory of a local path: the store itself, or a training output_dir holding ``smart_ckpt/``.

    Raises:
        `CheckpointNotFoundError`: `path` does not exist or holds no store.
        `ConfigError`: `path` is a file, or a task or checkpoint directory (the message names the store to pass).
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"root {root} is a file, not a directory; {_PASS}.") if root.exists() else \
            NotFound(f"root {root} does not exist; {_PASS}.")
    if (root / C.MANIFEST_NAME).exists() or any(n.startswith(C.STEP_DIR_PREFIX) for n in os.listdir(root)):
        store_root = root.parent.parent if (root / C.MANIFEST_NAME).exists() else root.parent
        raise ConfigError(f"root {root} is a checkpoint or task directory, not a store root; pass {store_root} (the "
                          f"directory holding {C.CATALOG_NAME}) and name the checkpoint by its reference and task.")
    for candidate in (root, root / STORE_DIR):
        if candidate.is_dir() and ((candidate / C.CATALOG_NAME).is_file() or task_dirs(candidate)):
            return candidate
    raise NotFound(f"no hf_dynamic_ckpt store under {root}: {_PASS}.")


class _Disk:
    """Every change on disk: inside the root (the parent resolved), never through a link, a ``fs`` fault point."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))

    def contained(self, path: str | os.PathLike[str], op: str = "", *, link_ok: bool = False) -> Path:
        path, parent = Path(path), Path(os.path.realpath(Path(path).parent))
        if path.name in ("", ".", "..") or not parent.is_relative_to(self.root):
            raise UnsafePathError(f"{path} resolves to {parent / path.name}, outside the store root {self.root}; "
                                  "refused (a symbolic link or a '..' in a name would make the store touch files that "
                                  "are not its own).")
        if not link_ok and is_kind(parent / path.name, "link"):
            raise UnsafePathError(f"{parent / path.name} is a symbolic link; the store never changes anything through "
                                  "links.")
        fault("fs", op=op, path=str(parent / path.name)) if op else None
        return parent / path.name

    def mkdir(self, path: Path) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.contained(path, "mkdir"))

    def rename(self, src: Path, dst: Path, *, replace: bool = False, sync: bool = False) -> None:
        """`sync`: the directory is fsynced after."""
        (os.replace if replace else os.rename)(self.contained(src, "replace" if replace else "rename"),
                                               self.contained(dst))
        self.fsync(dst.parent) if sync else None

    def remove(self, path: Path) -> None:
        """Remove a file, or a real directory with the fd-based `shutil.rmtree` (never through a link; a link itself
        goes, never its target; never the root); missing is fine."""
        if is_kind(path, "dir"):
            if (real := self.contained(path, "rmtree")) == self.root:
                raise UnsafePathError(f"refusing to remove the store root {real}.")
            shutil.rmtree(real)
        elif mf.lstat(path) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.contained(path, "unlink", link_ok=True))

    def fsync(self, path: Path) -> None:
        fault("fs", op="fsync", path=str(path))
        fd = os.open(self.root if os.path.realpath(path) == str(self.root) else self.contained(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def create(self, path: Path, flags: int = os.O_TRUNC) -> BinaryIO:
        return os.fdopen(os.open(self.contained(path), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | flags, 0o644), "ab")

    def write(self, path: Path, data: bytes, *, atomic: str = "") -> None:
        """`data` as `path`, fsynced; `atomic` (a tag): all or nothing, through a temporary file renamed over it."""
        target, path = path, path.with_name(f".{path.name}{C.TMP_MARKER}{atomic}") if atomic else path
        try:
            with self.create(path) as f:
                f.write(data)
            self.fsync(path)
            self.rename(path, target, replace=True, sync=True) if atomic else None
        finally:
            self.remove(path) if atomic else None


def _safetensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (views of a private map) and metadata of a safetensors file, its header validated by `safe_open`;
    never through a link; any fault is `CorruptCheckpointError` naming the file."""
    from safetensors import safe_open

    try:
        fd = mf.open_read(path)
    except OSError as e:
        why = "symbolic link: the store never reads through links" if isinstance(e, UnsafePathError) else e.strerror
        raise CorruptCheckpointError(f"{what} file {path} is missing." if isinstance(e, FileNotFoundError) else
                                     f"{what} file {path} cannot be read ({why}).") from e
    try:  # opened through the descriptor: no link followed
        with fd, safe_open(f"/proc/self/fd/{fd.fileno()}" if os.path.isdir("/proc/self/fd") else path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.offset_keys()}, dict(f.metadata() or {})
    except Exception as e:  # SafetensorError, OSError, ...: whatever the parser's complaint
        raise CorruptCheckpointError(f"{what} file {path} is not a valid safetensors file ({e}); the checkpoint is "
                                     "corrupt, restore an older one.") from e


def _tree_bytes(path: Path) -> int:
    if not is_kind(path, "dir"):
        return st.st_size if (st := mf.lstat(path)) is not None and is_kind(path, "file") else 0
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(path) for n in names)


class CheckpointStore:
    """Tiered checkpoints of one task under a store root, committed atomically.

    Args:
        root (`str` or `os.PathLike`): store directory (holds `catalog.db` and one folder per task), or a URL.
        task_id (`str`, *optional*, defaults to `"default"`): the run's folder under `root`.
        rank (`int`, *optional*, defaults to `0`) / world_size (`int`, *optional*, defaults to `1`): this process's
            rank (rank 0 commits) and the ranks that write each save.
        session_id (`str`, *optional*): names this run's temporary directories; the same on every rank (broadcast
            it). Generated when `world_size == 1`.
        compression_level (`int`, *optional*, defaults to `1`) / compression_threads (`int`, *optional*, defaults
            to `0`: every CPU) / compression (`str`, *optional*, defaults to `"zstd"`, or `"none"`): the optimizer tier.
        rank_timeout_s (`float`, *optional*, defaults to `600.0`): how long rank 0 waits for the other ranks' files.
        cleanup (`bool`, *optional*, defaults to `True`): on rank 0, take the task's writer lock, finish or remove
            what interrupted saves left and sync the catalog. Readers (a writer process, tools) pass `False`.
        read_only (`bool`, *optional*, defaults to `False`): change nothing on disk (read-only media, tools).
        takeover (`bool`, *optional*, defaults to `False`): replace the lock of a holder this host cannot see at
            once; never a running holder of this host. `lock_wait_s` (defaults to `120.0`): how long to wait for one.
        storage_options (`Mapping`, *optional*) / cache_dir / retries (defaults to `5`) / backoff_s (defaults to
            `0.5`): a URL root's fsspec options (never logged), local cache and retries of each call.

    Example:
        ```python
        >>> store = CheckpointStore("out/smart_ckpt", task_id="run1")
        >>> store.save(CheckpointState(step=10, weights=model.state_dict()), SaveRequest(step=10, reason="interval"))
        >>> store.load("auto").weights["lm_head.weight"].shape
        ```
    """

    def __init__(self, root: str | os.PathLike[str], *, task_id: str = C.DEFAULT_TASK_ID, rank: int = 0,
                 world_size: int = 1, session_id: str | None = None, compression_level: int = 1,
                 compression_threads: int = 0, compression: mf.Codec | str = mf.Codec.ZSTD,
                 rank_timeout_s: float = 600.0, cleanup: bool = True, read_only: bool = False, takeover: bool = False,
                 lock_wait_s: float = DEFAULT_WAIT_S, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, retries: int = 5, backoff_s: float = 0.5,
                 last_commits: bool = False) -> None:
        if not mf.is_url(root) and storage_options:
            raise ConfigError(f"storage_options are for URL roots (s3://...); root={root!r} is a local directory.")
        local, remote = split_root(root, rank=rank, storage_options=storage_options, cache_dir=cache_dir,
                                   retries=retries, backoff_s=backoff_s) if mf.is_url(root) else (root, None)
        if session_id is None and world_size > 1:
            raise ConfigError("session_id=None is invalid with world_size > 1: every rank must use the same id; "
                              "create one on rank 0 and broadcast it (distributed.broadcast_object).")
        self._open(mf.StoreSpec(root=str(Path(local).absolute()), task_id=task_id, rank=rank, world_size=world_size,
                                session_id=session_id or mf.new_session_id(), codec=compression,
                                compression_level=compression_level, compression_threads=compression_threads,
                                rank_timeout_s=float(rank_timeout_s), remote=remote, last_commits=last_commits),
                   cleanup=cleanup, read_only=read_only, takeover=takeover, pull=True, lock_wait_s=lock_wait_s)

    @classmethod
    def from_spec(cls, spec: mf.StoreSpec, *, cleanup: bool = True, read_only: bool = False) -> CheckpointStore:
        """Open the store `spec` describes (a writer process: ``from_spec(store.spec, cleanup=False)``)."""
        store = cls.__new__(cls)
        cls._open(store, spec, cleanup=cleanup, read_only=read_only, takeover=False, pull=cleanup)
        return store

    def _open(self, spec: mf.StoreSpec, *, cleanup: bool, read_only: bool, takeover: bool, pull: bool,
              lock_wait_s: float = 0.0) -> None:
        self.spec, self.root, self.read_only = spec, Path(spec.root).absolute(), read_only
        self.task_dir, self._lock = self.root / spec.task_id, threading.RLock()
        self.abort_reason: str | None = None
        self.remote = Remote(spec.remote, spec.task_id) if spec.remote is not None else None
        self.url = spec.remote.shown if spec.remote is not None else str(self.root)
        self._rechecked: set[tuple[int, float]] = set()
        self._timelines_cache: tuple[Any, dict[str, Any]] | None = None
        writer, self._memory = spec.rank == 0 and cleanup and not read_only, read_only
        if self.remote is None and self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"root={str(self.root)!r} is invalid: it is a file, not a directory; pass the store's "
                              "directory (new or existing), e.g. the folder next to it.")
        try:  # readers never create anything (a URL root's cache is not the store)
            if not read_only or self.remote is not None:
                self.root.mkdir(parents=True, exist_ok=True)
            if writer and self.remote is None and not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError("a read-only file system, or no write permission")
            self.catalog = Catalog(None if read_only else self.root / C.CATALOG_NAME)
        except sqlite3.OperationalError as e:
            if writer:
                raise self._not_writable(f"its catalog {self.root / C.CATALOG_NAME} cannot be opened: {e}") from e
            logger.warning("catalog %s cannot be opened (%s); reading the manifests instead", self.root, e)
            self._memory = True
        except OSError as e:
            raise self._not_writable(str(e)) from e
        if self._memory:
            self.catalog = Catalog.snapshot(self.root / C.CATALOG_NAME)
        self._disk = _Disk(self.root)
        if is_kind(self.task_dir, "link"):
            raise ConfigError(f"{self.task_dir} is a symbolic link; the store refuses to work through links (point "
                              "root at the real directory instead).")
        self._writer = WriterLock(self.task_dir, session=spec.session_id)
        if writer:
            self._writer.acquire(takeover=takeover, what=f"task {spec.task_id!r} under {self.url}", wait_s=lock_wait_s)
        if self.remote is not None and writer:  # interrupted uploads go; object stores have no lock: a note
            self.remote.leftovers(self.session_id, dry_run=False, at_open=True)
            self.remote.note_writer(self.session_id)
        if self.remote is not None and (pull or writer):
            self._pull()
        if writer:
            self._remove_leftovers(GcReport())
        if writer and self.catalog.rebuilt:
            self.reindex()
        elif writer or self._memory or (self.remote is not None and pull):
            self.sync_catalog()

    task_id = property(lambda self: self.spec.task_id)
    rank = property(lambda self: self.spec.rank)
    world_size = property(lambda self: self.spec.world_size)
    session_id = property(lambda self: self.spec.session_id)
    compression_threads = property(lambda self: self.spec.compression_threads)

    def _not_writable(self, why: str) -> StoreNotWritableError:
        return StoreNotWritableError(
            f"the store root {self.root} is not writable ({why}): this run could not save a checkpoint there. Make it "
            "writable, or save to another root (SmartCkptConfig(root=...), --smart_ckpt_root) and resume from this "
            f"store by path (resume_checkpoint(trainer, '{self.root / self.spec.task_id}/step-<N>')); to only read "
            "it, open CheckpointStore(..., read_only=True) or use the hf-dynamic-ckpt read commands.")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise DynamicCkptError(f"{what} is refused: the store {self.root} was opened with read_only=True.")

    def ensure_root(self) -> bool:
        """Rank 0: recreate the root, task folder, catalog and writer lock when something deleted them under a
        running writer (a cleanup script's ``rm -rf``), the catalog rebuilt from the manifests left; one WARNING.
        Cheap (a few `stat`s). Returns whether anything was recreated."""
        def intact() -> bool:
            return is_kind(self.task_dir, "dir") and not self.catalog.replaced() and not self._writer.moved()

        if self.read_only or self.rank != 0 or self.remote is not None or intact():
            return False
        with self._lock:
            if intact():  # another thread of this process recreated it meanwhile
                return False
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._disk.mkdir(self.task_dir)
                self._disk.fsync(self.root)
                if self.catalog.replaced():
                    self.catalog.reopen()
                if self._writer.moved():  # the held lock file is gone: lock the new one
                    self._writer.release()
                    self._writer.acquire(what=f"task {self.task_id!r} under {self.url}")
                self._rebuild(all_tasks=True)
            except OSError as e:
                raise SaveError(f"the store root {self.root} was deleted and cannot be recreated: {e}") from e
        logger.warning("the store %s (task %r) was deleted while this run was writing it; recreated it, and the "
                       "catalog from the manifests left on disk: saves continue, checkpoints deleted with it are gone",
                       self.root, self.task_id)
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
        `DistributedError` naming `reason` (a rank died); `clear_abort` undoes it."""
        self.abort_reason = str(reason) or "aborted"

    def clear_abort(self) -> None:
        self.abort_reason = None

    # -- the catalog ----------------------------------------------------------------------------------------------
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

    def timeline_record(self) -> dict[str, Any]:
        """The task's timelines record: ``current`` (the timeline that started last: ``timeline``, ``session``,
        ``after_step``), ``abandoned`` and ``forks``; empty ones when none was written."""
        return dict(self._timelines())

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
        tasks = task_dirs(self.root) if all_tasks else [self.task_dir]
        return self.catalog.rebuild([i for t in tasks for i in self._scan_all(t)], root=self.root,
                                    task_id=None if all_tasks else self.task_id)

    # -- finding --------------------------------------------------------------------------------------------------
    def _owns(self, path: str | os.PathLike[str]) -> int | None:
        """The step when `path` is a checkpoint directory of this task, else `None`."""
        path = Path(path).absolute()
        same = path.parent == self.task_dir or os.path.realpath(path.parent) == os.path.realpath(self.task_dir)
        return mf.parse_step_dir(path.name) if same else None

    def _committed(self, task_dir: Path | None = None) -> dict[int, Path]:
        """Real ``step-<N>`` directories of a task (a link named like one is ignored, with a warning)."""
        out, task_dir = {}, task_dir or self.task_dir
        for name in mf.listdir(task_dir):
            if (step := mf.parse_step_dir(name)) is not None and is_kind(task_dir / name, "dir"):
                out[step] = task_dir / name
            elif step is not None and is_kind(task_dir / name, "link"):
                logger.warning("%s is a symbolic link, not a checkpoint: the store ignores it and never follows it",
                               task_dir / name)
        return out

    def _read_manifest(self, step: int, path: Path | None = None) -> dict[str, Any]:
        """The manifest of `step`, read once more after a read error (a transient fault's usual shape)."""
        path = path or self.task_dir / mf.step_dir_name(step)
        try:
            return mf.read_manifest(path, step=step, task_id=path.parent.name)
        except CorruptCheckpointError as e:
            if not isinstance(e.__cause__, OSError):
                raise
        return mf.read_manifest(path, step=step, task_id=path.parent.name)

    def _info(self, manifest: Mapping[str, Any], path: Path) -> CheckpointInfo:
        info = mf.info_from_manifest(manifest, path)
        return dataclasses.replace(info, abandoned=True) if (info.step, info.save_time) in self._abandoned() else info

    def _scan(self, step: int, path: Path) -> CheckpointInfo | None:
        """The checkpoint a directory's manifest describes; `None` without one; a ``"corrupt"`` row when unusable."""
        try:
            return self._info(self._read_manifest(step, path), path)
        except NotFound:
            return None
        except (CorruptCheckpointError, FormatVersionError) as e:
            logger.info("checkpoint %s has an unusable manifest: %s", path, e)
            return CheckpointInfo(  # the catalog row of a directory whose manifest cannot be trusted
                task_id=path.parent.name, step=step, path=str(path), reason="", tiers=frozenset(), bytes=0, loss=None,
                gpu_mem_percent=None, save_time=st.st_mtime if (st := mf.lstat(path)) else 0.0, recovery_cost_ms=None,
                healthy=False, pinned=is_kind(path / C.PINNED_MARKER, "file"), status=mf.STATUS_CORRUPT)

    def _scan_all(self, task_dir: Path) -> list[CheckpointInfo]:
        return [i for step, path in sorted(self._committed(task_dir).items()) if (i := self._scan(step, path))]

    def list(self, include_unhealthy: bool = False, include_abandoned: bool = False) -> builtins.list[CheckpointInfo]:
        """Checkpoints of this task, newest first; `include_unhealthy` adds unhealthy ones and rows whose status is
        ``"missing"`` or ``"corrupt"``, `include_abandoned` those of timelines a later run forked away from."""
        self.sync_catalog(recheck_hidden=not include_unhealthy)  # a flag that hides a checkpoint is re-read first
        abandoned = self._abandoned()
        infos = [Catalog.to_info(r, root=self.root, abandoned=(int(r["step"]), float(r["save_time"])) in abandoned)
                 for r in self.catalog.rows(self.task_id)]
        return [i for i in infos if (include_unhealthy or (i.healthy and i.status == mf.STATUS_OK))
                and (include_abandoned or not i.abandoned)]

    def resolve(self, ref: Ref) -> CheckpointInfo:
        """The checkpoint a restore-point ref names: ``"auto"`` (the newest healthy one with weights), ``"best"``
        (lowest recorded loss), ``"fastest"`` (lowest estimated recovery cost), ``"step:N"`` or ``N`` (that step,
        whatever its health or timeline), a checkpoint directory, or a `CheckpointInfo`.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        text = ref if isinstance(ref, CheckpointInfo | int) else os.fspath(ref)
        if isinstance(text, CheckpointInfo):
            return text
        if isinstance(text, int) or text.isdigit() or text.startswith("step:"):
            try:
                return self._by_step(int(text.removeprefix("step:") if isinstance(text, str) else text))
            except ValueError as e:
                raise NotFound(f"ref {text!r} is invalid: expected step:N with an integer N.") from e
        if text not in NAMED_REFS:
            return self._by_path(Path(text).absolute())
        for row in self.catalog.rows(self.task_id):  # a corrupt flag is re-verified once before it excludes
            key = (int(row["step"]), float(row["save_time"]))
            if row["status"] == mf.STATUS_CORRUPT and row["healthy"] and key not in self._rechecked:
                self._rechecked.add(key)
                with contextlib.suppress(NotFound):
                    self.verify(key[0])
        found = [i for i in self.list() if Tier.WEIGHTS in i.tiers and (text != "best" or i.loss is not None)]
        if not found:
            raise NotFound(("resolve('best'): no healthy checkpoint records a loss; " if text == "best" else
                            f"resolve({text!r}): no healthy committed checkpoint with weights; ")
                           + f"{self._available()}.")
        rank = {"auto": lambda i: (-i.step,), "best": lambda i: (i.loss, -i.step), "fastest": lambda i: (
            float("inf") if i.recovery_cost_ms is None else i.recovery_cost_ms, -i.step)}[text]
        return min(found, key=rank)  # type: ignore[arg-type]

    def _available(self) -> str:
        infos = sorted(self.list(include_unhealthy=True, include_abandoned=True), key=lambda i: i.step)
        if not infos:
            return f"the store has no checkpoints of task {self.task_id!r} under {self.root}"
        flags = [[i.status] * (i.status != mf.STATUS_OK) + ["unhealthy"] * (not i.healthy and i.status == mf.STATUS_OK)
                 + ["abandoned"] * i.abandoned for i in infos]
        steps = ", ".join(f"{i.step}" + (f" ({', '.join(f)})" if f else "") for i, f in zip(infos, flags))
        return f"available steps of task {self.task_id!r}: {steps}"

    def _by_step(self, step: int) -> CheckpointInfo:
        infos = self.list(include_unhealthy=True, include_abandoned=True)
        if info := next((i for i in infos if i.step == step and i.status != mf.STATUS_MISSING), None):
            return info
        removed = self.removed().get(step)
        why = f" (retention removed it: {removed.get('rule')}; keep_last: null and null retention_days keep every " \
              "checkpoint, or pin one)" if removed and Tier.WEIGHTS.value in (removed.get("tiers") or ()) else ""
        raise NotFound(f"step {step} has no committed checkpoint in {self.task_dir}{why}; {self._available()}.")

    def _by_path(self, path: Path) -> CheckpointInfo:
        if (step := self._owns(path)) is not None:
            return self._by_step(step)
        if is_kind(path, "link"):
            why = "is a symbolic link; the store never follows links. Pass the real directory"
        elif not is_kind(path, "dir"):
            why = "is neither 'auto', 'best', 'fastest', 'step:N' nor an existing checkpoint directory"
        elif C.TMP_MARKER in path.name:
            why = "is an unfinished save (temporary directory), not a checkpoint"
        elif is_kind(path / C.MANIFEST_NAME, "file"):
            return mf.info_from_manifest(mf.read_manifest(path, step=mf.parse_step_dir(path.name)), path)
        elif is_kind(path / C.TRAINER_STATE_NAME, "file"):
            native = "DeepSpeed's and Trainer's" if any(n.startswith("global_step") for n in mf.listdir(path)) else \
                "Trainer's"
            why = (f"is {native} own checkpoint folder, not one of this store: pass it to trainer.train("
                   "resume_from_checkpoint=...) directly (Trainer loads it itself; SmartCkptCallback saves into the "
                   "store from there on)")
        else:
            why = f"is not a checkpoint directory (no {C.MANIFEST_NAME}); pass a step-<N> directory of a store"
        raise NotFound(f"{path} {why}; {self._available()}.")

    # -- reading --------------------------------------------------------------------------------------------------
    def _manifest_of(self, info: CheckpointInfo) -> dict[str, Any]:
        """The verified manifest of `info` (its files downloaded first under a URL root); a missing or damaged one is
        recorded in the catalog."""
        directory, own = Path(info.path), self._owns(info.path) is not None
        try:
            if self.remote is not None and own and is_kind(directory, "dir"):
                self._materialize(info.step)
        except OSError as e:
            raise CorruptCheckpointError(f"step {info.step} could not be downloaded from {self.url}: {e}") from e
        try:
            return self._read_manifest(info.step) if own else mf.read_manifest(directory, step=mf.parse_step_dir(
                directory.name))
        except (NotFound, CorruptCheckpointError) as e:
            self._set_status(info, mf.STATUS_MISSING if isinstance(e, NotFound) else mf.STATUS_CORRUPT)
            raise

    def _blob(self, directory: Path, digest: str) -> Path:
        return (self.task_dir if self._owns(directory) is not None else directory.parent) / C.BLOBS_DIR / \
            f"{digest}.safetensors"

    def _problems(self, directory: Path, manifest: Mapping[str, Any], names: Iterable[str], *, tiers: Collection[Tier]
                  = (), hashed: Collection[str] = (), blobs: bool = False) -> builtins.list[str]:
        """What is wrong with the listed files: missing, a link, size, checksum (with the entry's own algorithm;
        `hashed`: checksummed as they are read, so size only here); a tier of `tiers` whose file is not listed;
        `blobs`: also the blobs of an earlier version."""
        needs = {Tier.WEIGHTS: "weights-rank<R>.safetensors" if mf.is_sharded(manifest) else C.WEIGHTS_NAME,
                 Tier.OPTIMIZER: C.OPTIMIZER_META_NAME}
        problems = [f"tier {t.value} is recorded but {n} is not listed" for t, n in needs.items() if t in tiers
                    and not any(f.startswith(n.split("<")[0]) for f in manifest[C.KEY_FILES])]
        for name in names:
            entry, path = manifest[C.KEY_FILES][name], directory / name
            where = f"{name} (tier {entry.get(C.KEY_TIER)}" + (f", rank {entry[C.KEY_RANK]})" if
                                                               entry.get(C.KEY_RANK) is not None else ")")
            if (st := mf.lstat(path)) is None or not is_kind(path, "file"):
                problems.append(f"{where}: " + ("file is missing" if st is None else
                                                "not a regular file (a symbolic link or directory is refused)"))
            elif st.st_size != entry[C.KEY_SIZE]:
                problems.append(f"{where}: size {st.st_size} bytes, manifest says {entry[C.KEY_SIZE]} (truncated or "
                                "overwritten)")
            elif name not in hashed:
                try:
                    fault("read", name=name, step=manifest[C.KEY_STEP], op="check")
                    actual = mf.file_checksum(path, algo=entry[C.KEY_CHECKSUM].partition(":")[0])
                    if actual != entry[C.KEY_CHECKSUM]:
                        problems.append(f"{where}: checksum mismatch ({actual} != {entry[C.KEY_CHECKSUM]}), the file "
                                        "is corrupt")
                except (ValueError, OSError) as e:
                    problems.append(f"{where}: " + ("file is missing" if isinstance(e, FileNotFoundError) else str(e)))
        paths = {self._blob(directory, rec["digest"]): key for key, rec in sorted(
            (manifest.get(C.KEY_BLOBS) or {}).items(), reverse=True)} if blobs else {}
        for path, key in sorted(paths.items(), key=lambda p: p[1]):  # one check per blob, named by its first weight
            try:
                fault("read", name=path.name, step=manifest[C.KEY_STEP], op="check")
                t = _safetensors(path, "Blob")[0].get("tensor") if mf.lstat(path) is not None else None
                digest = t is not None and hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}\n"
                                                          .encode() + bytes(mf.raw_view(t))).hexdigest()
                problem = f"blob {path} is missing" if mf.lstat(path) is None else "" if digest == path.stem else \
                    f"blob {path} content does not match its digest (corrupt)"
            except (CorruptCheckpointError, OSError) as e:
                problem = f"blob {path} is unreadable: {e}"
            problems += [f"{problem} (weight {key!r}, tier weights)"] if problem else []
        return problems

    def load(self, ref: Ref, *, tiers: Collection[Tier] = ALL_TIERS, rank: int | None = None, mmap: bool = True,
             l1_max_numel: int | None = None, weights_checksum: bool = True) -> LoadedCheckpoint:
        """Verify, then read the requested tiers of a checkpoint (a failed check or read is retried once; a tier the
        checkpoint does not hold is left `None` with a note in `warnings`). `ref`: anything `resolve` accepts; `rank`:
        whose RNG file (default: this store's); `mmap`: weights as views of a private map of the file (no copy);
        `l1_max_numel`: the most elements an optimizer-tier tensor may declare (`state.state_numel_bound`), checked
        before anything is allocated; `weights_checksum=False` checks the weights file's size and header only,
        leaving its checksum to `read_weights_into(..., verify=True)` before any weight is used.

        Raises:
            `CheckpointNotFoundError`: `ref` names no committed checkpoint.
            `CorruptCheckpointError`: a needed file is missing, truncated, altered or does not parse (the message
                lists each problem), or the manifest is damaged.
            `FormatVersionError`: written by a newer format. `IncompatibleStateError`: beyond `l1_max_numel`.
        """
        info = self.resolve(ref)
        directory, manifest, rank = Path(info.path), self._manifest_of(info), self.rank if rank is None else rank
        held, wanted = mf.tiers_of(manifest), {Tier(t) for t in tiers}
        loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(C.KEY_EXTRA) or {}))
        loaded.warnings += [f"step {info.step} has no {t.value} tier (saved tiers: "
                            f"{', '.join(sorted(h.value for h in held)) or 'none'})" for t in sorted(wanted - held)]
        wanted &= held
        rng, files = C.RNG_NAME_TEMPLATE.format(rank=rank), manifest[C.KEY_FILES]
        names = [n for n, e in sorted(files.items()) if e.get(C.KEY_TIER) in {t.value for t in wanted}
                 and (not n.startswith("rng-rank") or n == rng)]
        if Tier.STATE in wanted and rng not in names and any(n.startswith("rng-rank") for n in files):
            loaded.warnings.append(f"step {info.step} has no RNG state for rank {rank} (saved with world_size="
                                   f"{manifest.get(C.KEY_WORLD_SIZE)}); this rank's random streams start fresh")
        for attempt in (1, 2):
            found = self._problems(directory, manifest, names, tiers=wanted, blobs=Tier.WEIGHTS in wanted, hashed={
                C.OPTIMIZER_NAME} | (set() if weights_checksum else {C.WEIGHTS_NAME}))
            if not found:
                try:  # each attempt fills a fresh copy
                    self._read_tiers(directory, manifest, wanted, names, out := dataclasses.replace(loaded), mmap,
                                     l1_max_numel)
                    return out
                except (CorruptCheckpointError, OSError) as e:
                    found = [str(e)]
            if attempt == 1:
                logger.debug("step %d: %s; reading it once more before giving up", info.step, "; ".join(found))
        self._set_status(info, mf.STATUS_CORRUPT)
        raise CorruptCheckpointError(f"checkpoint {directory} failed verification, nothing was loaded: "
                                     + "; ".join(p.rstrip(".") for p in found)
                                     + ". Restore another checkpoint (a resume falls back automatically).")

    def _read_tiers(self, directory: Path, manifest: Mapping[str, Any], wanted: set[Tier], names: builtins.list[str],
                    loaded: LoadedCheckpoint, mmap: bool, l1_max_numel: int | None) -> None:
        if Tier.WEIGHTS in wanted:  # FSDP2 / ZeRO: names and global shapes; the shards are read later
            table = sharded_table(manifest) if mf.is_sharded(manifest) else None
            loaded.weights = self._read_weights(directory, manifest, mmap) if table is None else placeholders(table)
            loaded.frozen = dict(manifest.get(C.KEY_FROZEN) or {})
        if Tier.OPTIMIZER in wanted:
            structure, tensors = mf.read_json(directory / C.OPTIMIZER_META_NAME), {}
            if not isinstance(structure, dict):
                raise CorruptCheckpointError(f"{directory / C.OPTIMIZER_META_NAME} is not a JSON object.")
            if C.OPTIMIZER_NAME in names:
                fault("read", name=C.OPTIMIZER_NAME, step=manifest[C.KEY_STEP], op="read")
                with mf.open_read(directory / C.OPTIMIZER_NAME) as f:
                    tensors = read_tensors(directory / C.OPTIMIZER_NAME, f, max_numel=l1_max_numel,
                                           checksum=manifest[C.KEY_FILES][C.OPTIMIZER_NAME][C.KEY_CHECKSUM],
                                           threads=self.compression_threads)
            state = unflatten_state(structure, tensors)
            loaded.optimizer, loaded.scheduler, loaded.scaler = (state.get(p) for p in C.L1_PARTS)
        for name in (n for n in names if n == C.SAMPLER_NAME or n.startswith("rng-rank")) if Tier.STATE in wanted \
                else ():
            if not isinstance(value := mf.read_json(directory / name), dict):
                raise CorruptCheckpointError(f"{directory / name} is not a JSON object; the checkpoint is damaged.")
            setattr(loaded, "sampler" if name == C.SAMPLER_NAME else "rng", value)

    def _read_weights(self, directory: Path, manifest: Mapping[str, Any], mmap: bool) -> dict[str, torch.Tensor]:
        path = directory / C.WEIGHTS_NAME
        out, metadata = _safetensors(path, "Weights")
        for key, rec in (manifest.get(C.KEY_BLOBS) or {}).items():  # frozen weights of an earlier version
            t = _safetensors(blob := self._blob(directory, rec["digest"]), f"Blob of weight {key!r}")[0].get("tensor")
            if t is None or str(t.dtype).removeprefix("torch.") != rec["dtype"] or list(t.shape) != rec["shape"]:
                raise CorruptCheckpointError(f"Blob {blob} of weight {key!r} does not hold the manifest's "
                                             f"{rec['dtype']}{rec['shape']}; the blob is corrupt.")
            out[key] = t
        out = out if mmap else {k: t.clone() for k, t in out.items()}
        try:
            if not isinstance(aliases := loads_bounded(metadata.get(ALIASES_KEY) or "{}"), dict) or \
                    not all(isinstance(v, str) for v in aliases.values()):
                raise ValueError("another type")
        except ValueError as e:
            raise CorruptCheckpointError(f"Alias map in {path} is not a JSON object of key names ({e}): "
                                         f"{metadata[ALIASES_KEY][:80]!r}.") from e
        for alias, target in aliases.items():
            if target not in out:
                raise CorruptCheckpointError(f"Weight {alias!r} aliases {target!r}, which {path} does not hold.")
            out[alias] = out[target]
        return out

    def read_weights_into(self, loaded: LoadedCheckpoint, targets: Mapping[str, torch.Tensor], *,
                          verify: bool = False, on_write: Callable[[], None] | None = None) -> set[str]:
        """Read the weights file of `loaded` straight into `targets` (a model's own tensors: no map of the file, no
        tensor in between); returns the keys read: those whose target is a contiguous CPU tensor of the stored dtype
        and shape. `verify` hashes every byte as it is read and compares the manifest's checksum (one pass, after a
        ``load(..., weights_checksum=False)``); `on_write` is called once, right before the first byte lands.

        Raises:
            `CorruptCheckpointError`: the file cannot be read or does not parse, or (with `verify`) fails its checksum
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
                    self._set_status(loaded.info, mf.STATUS_CORRUPT)
                    raise CorruptCheckpointError(f"checkpoint {loaded.info.path} failed verification: "
                                                 f"{str(e).rstrip('.')}. Restore another checkpoint (a resume falls "
                                                 "back automatically).") from None
                logger.debug("step %d: %s; reading it once more before giving up", step, e)
        raise AssertionError("unreachable")

    @staticmethod
    def _read_into(path: Path, targets: Mapping[str, torch.Tensor], expected: str | None, step: int,
                   on_write: Callable[[], None] | None) -> set[str]:
        entries = [(k, t.dtype, list(t.shape), t.nbytes) for k, t in _safetensors(path, "Weights")[0].items()]
        done, scratch = set(), memoryview(bytearray(mf.HASH_CHUNK)) if expected else None
        try:
            hasher = mf.new_hasher(expected.partition(":")[0]) if expected else None
            fault("read", name=C.WEIGHTS_NAME, step=step, op="read")
            with mf.open_read(path) as f:
                head = f.read(8)
                head += f.read(struct.unpack("<Q", head)[0])  # the header `_safetensors` validated
                hasher.update(head) if hasher else None
                for key, dtype, shape, nbytes in entries:  # in file order: one sequential pass
                    t = targets.get(key)
                    if t is not None and t.device.type == "cpu" and t.dtype == dtype and list(t.shape) == shape \
                            and t.is_contiguous():
                        done.add(key)
                        view = t.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B") if nbytes else None
                        if view is not None and on_write is not None:
                            on_write()
                            on_write = None
                    elif scratch is None:
                        f.seek(nbytes, os.SEEK_CUR)
                        continue
                    else:
                        view = None
                    for lo in range(0, nbytes, mf.HASH_CHUNK):
                        n = min(mf.HASH_CHUNK, nbytes - lo)
                        part = view[lo : lo + n] if view is not None else scratch[:n]  # type: ignore[index]
                        if f.readinto(part) != n:
                            raise CorruptCheckpointError(f"Weights file {path} is truncated inside tensor {key!r}.")
                        hasher.update(part) if hasher else None  # the chunk just read: still in the CPU's caches
                hasher.update(f.read()) if hasher else None
        except (OSError, ValueError) as e:  # ValueError: a checksum algorithm this library lacks
            raise CorruptCheckpointError(f"Weights file {path}: {e}" if isinstance(e, ValueError) else
                                         f"Weights file {path} cannot be read ({e}).") from e
        if hasher is not None and f"{expected.partition(':')[0]}:{hasher.hexdigest()}" != expected:  # type: ignore
            raise CorruptCheckpointError(f"Weights file {path}: checksum mismatch, the file is corrupt.")
        return done

    def gather_weights(self, loaded: LoadedCheckpoint) -> None:
        """Replace the placeholders of a sharded checkpoint's weights (FSDP2, ZeRO) with the whole tensors,
        assembled from every rank's verified shard files; a checkpoint that is not sharded stays as it is."""
        if mf.is_sharded(loaded.manifest) and (table := sharded_table(loaded.manifest)) is not None and \
                loaded.weights is not None:
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
            structure = mf.read_json(directory / C.OPTIMIZER_META_NAME)
            sched = unflatten_state(structure.get("scheduler"), {}) if isinstance(structure, dict) else None
        except (DynamicCkptError, OSError):
            return None
        return sched if isinstance(sched, dict) else None

    def verify(self, ref: Ref) -> builtins.list[str]:
        """Check a checkpoint completely (manifest, every file's size and checksum, blobs of earlier versions) and
        record the outcome in the catalog (in memory for a ``read_only`` store). Returns one line per problem.

        Raises:
            `CheckpointNotFoundError`: `ref` names nothing, or the checkpoint was deleted before or while it was
                verified (retention or gc ran meanwhile): a note, not a problem of the checkpoint.
        """
        try:
            info = self.resolve(ref)
        except (CorruptCheckpointError, ValueError) as e:  # a path whose manifest is unusable
            return [f"{C.MANIFEST_NAME}: {e}"]
        directory = Path(info.path)
        gone = NotFound(f"step {info.step} ({directory}) was deleted before or while it was verified (retention or gc "
                        "removed it); nothing to verify.")
        try:
            manifest = self._manifest_of(info)
        except NotFound as e:
            if mf.lstat(directory) is None:
                raise gone from e
            return [f"{C.MANIFEST_NAME}: missing ({e})"]
        except (CorruptCheckpointError, ValueError) as e:
            return [f"{C.MANIFEST_NAME}: {e}"]
        files = manifest[C.KEY_FILES]
        ranks = {e.get(C.KEY_RANK) for n, e in files.items() if n.startswith("rng-rank")}
        listed = [f"{C.RNG_NAME_TEMPLATE.format(rank=r)} (tier state, rank {r}): rank file is not listed"
                  for r in range(int(manifest.get(C.KEY_WORLD_SIZE, 1))) if ranks and r not in ranks]
        for _ in (1, 2):
            found = listed + self._problems(directory, manifest, files, tiers=mf.tiers_of(manifest), blobs=True)
            if found and mf.lstat(directory / C.MANIFEST_NAME) is None:
                self._set_status(info, mf.STATUS_MISSING)
                raise gone
            if not found:
                break
        self._set_status(info, mf.STATUS_CORRUPT if found else mf.STATUS_OK)
        return found

    # -- saving ---------------------------------------------------------------------------------------------------
    def save(self, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any] | None = None,
             replace: bool = False, cancel: Callable[[], bool] | None = None) -> CheckpointInfo | None:
        """Write this rank's part of a checkpoint (rank 0: weights, optimizer tier, sampler; every rank: its
        ``rng-rank<R>.json``); rank 0 commits it once every rank's files are durable. Thread-safe, no collectives. A
        step this timeline committed is not rewritten (its info is returned); one of another timeline or session, or
        abandoned, is replaced atomically (`replace`: whatever its timeline). `timings`: the caller's, in ms; `cancel`:
        polled while rank 0 waits for other ranks, `True` gives up. Returns the `CheckpointInfo` on rank 0 (also when
        the step was committed before), `None` on other ranks.

        Raises:
            `DistributedError`: rank 0 waited `rank_timeout_s` for other ranks, or was aborted; nothing is committed.
            `SaveError`: writing failed, or `request.step` is not the state's; the previous checkpoints are untouched.
        """
        if (step := int(state.step)) < 0 or request.step != step:
            raise SaveError(f"step={step} is invalid: a checkpoint step must be >= 0." if step < 0 else
                            f"SaveRequest.step={request.step} differs from the state's step {step}; pass the same "
                            "step.")
        self._check_writable("save")
        self.ensure_root()
        with self._lock:
            return self._save(state, request, timings, replace, cancel)

    def _existing(self, request: SaveRequest, replace: bool) -> CheckpointInfo | bool:
        """What is committed at the step, read from disk (the same answer on every rank): `False` (nothing), the info
        to return (already committed by this timeline), or `True` (replace it)."""
        if mf.lstat(path := self.task_dir / mf.step_dir_name(request.step)) is None:
            return False
        try:
            manifest = self._read_manifest(request.step)
        except (NotFound, CorruptCheckpointError, FormatVersionError):
            return True  # a directory without a usable manifest never blocks a save
        info = mf.info_from_manifest(manifest, path)
        same = info.lineage.timeline == request.lineage.timeline if request.lineage and info.lineage else \
            manifest.get(C.KEY_SESSION_ID) == self.session_id
        return True if replace or not same or (info.step, info.save_time) in self._abandoned() else info

    def _save(self, state: CheckpointState, request: SaveRequest, timings: Mapping[str, Any] | None, replace: bool,
              cancel: Callable[[], bool] | None) -> CheckpointInfo | None:
        step, rank, disk = request.step, self.rank, self._disk
        try:  # under a URL root, this rank's cache has not seen rank 0's recent commits
            self._pull(step) if self.remote is not None and rank != 0 else None
        except OSError as e:
            raise SaveError(f"saving step {step} on rank {rank}: reading the bucket failed: {e}; nothing was written "
                            "and the previous checkpoints are untouched.") from e
        if isinstance(found := self._existing(request, replace), CheckpointInfo):
            logger.debug("step %d is already committed at %s by this timeline; not rewritten", step, found.path)
            self._record(found) if rank == 0 else None
            return found if rank == 0 else None
        if not is_kind(self.task_dir, "dir"):  # a new task
            disk.mkdir(self.task_dir)
            disk.fsync(self.root)
        tmp, t0 = self.task_dir / f"{mf.step_dir_name(step)}{C.TMP_MARKER}{self.session_id}", time.perf_counter()
        try:
            disk.mkdir(tmp)
            plain, shard_files, shards = write_shards(state, tmp, rank=rank) if isinstance(
                state.extra.get(C.KEY_RANK_CHUNKS), dict) else (state, {}, None)  # FSDP2 / ZeRO: this rank's shards
            files, frozen = self._write_rank_files(plain, tmp, step)
            files.update(shard_files)
            disk.fsync(tmp)
            done = tmp / C.RANK_DONE_TEMPLATE.format(rank=rank)
            tiers = sorted(t.value for t in state.tiers) if rank == 0 else [Tier.STATE.value] * bool(files)
            record = {"rank": rank, "session_id": self.session_id, "files": files, "tiers": tiers, "frozen": frozen}
            if self.spec.last_commits and rank == 0:  # what the manifest needs, for whichever rank commits
                record["commit"] = {"epoch": float(state.epoch), "extra": json_safe(dict(state.extra)), "timings":
                                    json_safe(dict(timings or {})), "request": json_safe({**dataclasses.asdict(
                                        request), "tiers": sorted(t.value for t in request.tiers)})}
            disk.write(done, mf.json_bytes({**record, **({"sharded": shards} if shards else {})}), atomic="part")
            if self.remote is not None and rank != 0:  # no shared directory: rank 0 reads the object store
                for name in files:
                    self.remote.put(tmp / name, mf.step_dir_name(step), name)
                self.remote.put(done, tmp.name, done.name)
                disk.remove(tmp)
        except Exception as e:
            self._discard(tmp) if rank == 0 else None
            raise e if isinstance(e, SaveError) else SaveError(
                f"saving step {step} of task {self.task_id!r} to {tmp} failed on rank {rank}: {e}; the previous "
                "checkpoints are untouched.") from e
        if self.spec.last_commits and self.world_size > 1:
            return self._commit_if_last(tmp, step)
        if rank != 0:
            return None
        written = time.perf_counter()
        parts = self._wait_for_ranks(tmp, step, cancel)
        timings = {**dict(timings or {}), "write_ms": round(1000 * (written - t0), 2),
                   "wait_ranks_ms": round(1000 * (time.perf_counter() - written), 2)}
        try:
            return self._commit(tmp, state, request, parts, timings)
        except OSError as e:
            self._discard(tmp)
            raise SaveError(f"committing step {step} to {self.task_dir / mf.step_dir_name(step)} failed: {e}; the "
                            "previous checkpoints are untouched.") from e

    def _commit_if_last(self, tmp: Path, step: int) -> CheckpointInfo | None:
        """`last_commits`: the rank that finds every rank's part written commits (a claim file created exclusively
        decides between two that find it at once); the others return `None` at once: no rank waits for another, and
        a step some rank did not write never commits (`slots.keep_newest` removes it)."""
        if not all(is_kind(tmp / C.RANK_DONE_TEMPLATE.format(rank=r), "file") for r in range(self.world_size)):
            return None
        try:
            self._disk.create(claim := tmp.with_name(f"{tmp.name}.claim"), os.O_EXCL).close()
        except FileExistsError:
            return None
        try:
            parts = self._wait_for_ranks(tmp, step, None)
            own = parts[0].pop("commit", None)
            if not isinstance(own, dict) or not isinstance(own.get("request"), dict):
                raise DistributedError(f"step {step}: rank 0's part has no commit record; nothing was committed.")
            fields = {**own["request"], "step": step, "lineage": mf.Lineage.from_dict(lineage) if (
                lineage := own["request"].get("lineage")) else None}
            state = CheckpointState(step=step, epoch=float(own["epoch"]), extra=dict(own.get("extra") or {}))
            return self._commit(tmp, state, SaveRequest(**fields), parts, dict(own.get("timings") or {}))
        except OSError as e:
            self._discard(tmp)
            raise SaveError(f"committing step {step} to {self.task_dir / mf.step_dir_name(step)} failed: {e}") from e
        finally:
            self._discard(claim)

    def _write_rank_files(self, state: CheckpointState, tmp: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's files (rank 0: L0, L1, sampler; every rank: its RNG) and the frozen records of its weights."""
        rank, files, frozen = self.rank, {}, {k: dict(v) for k, v in state.frozen.items()}

        def small(name: str, obj: Any, tier: Tier, owner: int | None) -> None:
            fault("write", step=step, rank=rank, name=name)
            self._disk.write(tmp / name, data := mf.json_bytes(obj))
            (h := mf.new_hasher()).update(data)
            files[name] = {C.KEY_SIZE: len(data), C.KEY_CHECKSUM: f"{mf.FILE_CHECKSUM_ALGO}:{h.hexdigest()}",
                           C.KEY_TIER: tier.value, C.KEY_RANK: owner}

        if rank == 0 and state.weights is not None:
            weights = dict(state.weights)
            frozen.update({k: mf.frozen_record(weights.pop(k)) for k in sorted(state.dedup_keys & set(weights))})
            files[C.WEIGHTS_NAME] = self._write_weights(weights, tmp / C.WEIGHTS_NAME, step)
        if rank == 0 and any(getattr(state, p) is not None for p in C.L1_PARTS):
            structure, tensors = flatten_state({p: getattr(state, p) for p in C.L1_PARTS})
            fault("write", step=step, rank=rank, name=C.OPTIMIZER_NAME)
            with self._disk.create(tmp / C.OPTIMIZER_NAME) as f:
                size, checksum = write_tensors(tensors, f, codec=self.spec.codec, level=self.spec.compression_level,
                                               threads=self.compression_threads)
            self._disk.fsync(tmp / C.OPTIMIZER_NAME)
            files[C.OPTIMIZER_NAME] = {C.KEY_SIZE: size, C.KEY_CHECKSUM: checksum, C.KEY_TIER: Tier.OPTIMIZER.value,
                                       C.KEY_RANK: None}
            small(C.OPTIMIZER_META_NAME, structure, Tier.OPTIMIZER, None)
        if rank == 0 and state.sampler is not None:
            small(C.SAMPLER_NAME, json_safe(state.sampler), Tier.STATE, None)
        if state.rng is not None:  # a snapshot's raw capture converts itself
            small(C.RNG_NAME_TEMPLATE.format(rank=rank), getattr(state.rng, "to_json", lambda: state.rng)(), Tier.STATE,
                  rank)
        return files, frozen

    def _write_weights(self, weights: Mapping[str, Any], path: Path, step: int) -> dict[str, Any]:
        """L0 with the `safetensors` package (metadata ``{"format": "pt"}``: an adapter's file is a drop-in
        ``adapter_model.safetensors``); tied weights stored once, their aliases in the metadata."""
        from safetensors.torch import save_file

        tensors, aliases, seen = dict[str, torch.Tensor](), dict[str, str](), dict[Any, str]()
        for key, value in weights.items():
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                raise SaveError(f"Weight {key!r} has layout {value.layout}; convert it with `.to_dense()` first." if
                                isinstance(value, torch.Tensor) else f"Weight {key!r} is a {type(value).__name__}, "
                                "expected a torch.Tensor; pass the model's state_dict() (or the PEFT adapter dict).")
            ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                     value.dtype) if value.numel() else key
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident], t = key, value.detach().cpu().contiguous()
            storage = t.untyped_storage().data_ptr() if t.numel() else key
            tensors[key] = t.clone() if storage in seen else t  # views of one storage that differ: stored apart
            seen[storage] = key
        fault("write", step=step, rank=self.rank, name=C.WEIGHTS_NAME)
        self._disk.create(path).close()  # a new regular file: never through a link
        try:
            save_file(tensors, path, {"format": "pt", **({ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
                                                         if aliases else {})})
        except (ValueError, TypeError, RuntimeError, KeyError) as e:  # KeyError: a dtype safetensors lacks
            raise SaveError(f"the weights cannot be written as safetensors ({type(e).__name__}: {e}); cast them to a "
                            "dtype it stores (float, int, bool, complex64).") from e
        self._disk.fsync(path)
        return {C.KEY_SIZE: path.stat().st_size, C.KEY_CHECKSUM: mf.file_checksum(path),
                C.KEY_TIER: Tier.WEIGHTS.value, C.KEY_RANK: None}

    def _wait_for_ranks(self, tmp: Path, step: int, cancel: Callable[[], bool] | None) -> builtins.list[dict]:
        """Rank 0: every rank's done record, once all are there (polled: no collective)."""
        deadline, world = time.monotonic() + self.spec.rank_timeout_s, self.world_size
        names = [tmp / C.RANK_DONE_TEMPLATE.format(rank=r) for r in range(world)]
        while missing := [r for r, p in enumerate(names) if not is_kind(p, "file") and not self._fetch_done(p)]:
            given_up = self.abort_reason is not None or (cancel is not None and cancel())
            if given_up or time.monotonic() >= deadline:
                self._discard(tmp)
                raise DistributedError(
                    f"step {step}: gave up waiting for rank(s) {missing} of {world}: "
                    f"{self.abort_reason or 'the save was aborted'} (CheckpointStore.abort); nothing was committed and "
                    "the previous checkpoint stays the restore point." if given_up else
                    f"step {step}: rank(s) {missing} of {world} did not finish writing within "
                    f"{self.spec.rank_timeout_s:g} s (rank_timeout_s); nothing was committed and the previous "
                    "checkpoint stays the restore point. Check those ranks' logs, or raise rank_timeout_s for slow "
                    "storage.")
            time.sleep(0.02 if self.remote is None or world == 1 else 0.25)
        parts = []
        for r, done in enumerate(names):
            try:
                part = mf.read_json(done)
            except CorruptCheckpointError as e:
                part = {"error": str(e)}
            if not (isinstance(part, dict) and part.get("rank") == r and isinstance(part.get("files"), dict) and
                    isinstance(part.get("tiers"), list) and isinstance(part.get("frozen", {}), dict)):
                raise DistributedError(f"{done} is malformed ({str(part)[:120]}); nothing was committed.")
            if part.get("session_id") != self.session_id:
                raise DistributedError(f"{done} belongs to session {part.get('session_id')!r}, not "
                                       f"{self.session_id!r}; every rank must use the session_id broadcast by rank 0.")
            parts.append(part)
        return parts

    def _discard(self, path: Path) -> None:
        try:
            self._disk.remove(path)
        except OSError as e:  # a file in the way, a link: left for the next open's cleanup
            logger.warning("could not remove %s: %s", path, e)

    def _commit(self, tmp: Path, state: CheckpointState, request: SaveRequest, parts: builtins.list[dict],
                timings: dict[str, Any]) -> CheckpointInfo:
        step, files, frozen, chunks, tiers = request.step, dict[str, Any](), dict[str, Any](), {}, set[Tier]()
        for part in parts:
            files.update(part["files"])
            frozen.update(part.get("frozen") or {})
            tiers.update(Tier(t) for t in part["tiers"])
            chunks.update({str(part["rank"]): part["sharded"]} if isinstance(part.get("sharded"), dict) else {})
            self._disk.remove(tmp / C.RANK_DONE_TEMPLATE.format(rank=int(part["rank"])))
        extra = {k: v for k, v in state.extra.items() if k != C.KEY_RANK_CHUNKS}
        if chunks:  # every rank's chunk table, read back by `shard_files.sharded_table`
            extra[C.KEY_SHARDED] = {"format": C.SHARDED_FORMAT, "world_size": self.world_size, "ranks": chunks}
        manifest = {  # only the last DEBUG_INFO_STEPS debug records; format 2 when it records frozen weights
            C.KEY_FORMAT_VERSION: C.FORMAT_VERSION if frozen else 1, C.KEY_TASK_ID: self.task_id, C.KEY_STEP: step,
            C.KEY_EPOCH: float(state.epoch), C.KEY_REASON: request.reason, C.KEY_TIERS: sorted(t.value for t in tiers),
            C.KEY_PINNED: bool(request.pinned), C.KEY_HEALTHY: bool(request.healthy), C.KEY_WORLD_SIZE: self.world_size,
            C.KEY_CREATED_AT: time.time(), C.KEY_SESSION_ID: self.session_id, C.KEY_FILES: dict(sorted(files.items())),
            C.KEY_BLOBS: {}, C.KEY_BYTES: sum(int(e[C.KEY_SIZE]) for e in files.values()),
            C.KEY_RECOVERY_COST: mf.recovery_cost_ms(files, {}), C.KEY_SIGNALS: dict(request.signals or {}),
            C.KEY_DEBUG_INFO: list(request.debug_info)[-C.DEBUG_INFO_STEPS:], C.KEY_EXTRA: extra,
            C.KEY_VERSIONS: dict(mf.library_versions()), C.KEY_TIMINGS: timings, C.KEY_KIND: str(request.kind),
            **({C.KEY_FROZEN: dict(sorted(frozen.items()))} if frozen else {}),
            **({C.KEY_LINEAGE: request.lineage.to_dict()} if request.lineage is not None else {})}
        manifest = mf.with_changes(json_safe(manifest), {})
        fault("write", step=step, rank=0, name=C.MANIFEST_NAME)
        self._disk.write(tmp / C.MANIFEST_NAME, mf.manifest_bytes(manifest))
        info = self._rename_in(tmp, manifest)
        logger.debug("committed %s step %d (%s; %d bytes)", self.task_id, step, request.reason, info.bytes)
        return info

    def _rename_in(self, tmp: Path, manifest: dict[str, Any]) -> CheckpointInfo:
        """Commit a complete temporary directory: fsync, the object store's commit point (manifest uploaded last), a
        copy in the way set aside, the rename (the commit point), the aside copy removed, then the catalog row."""
        step = manifest[C.KEY_STEP]
        self._disk.fsync(tmp)
        if self.remote is not None:
            self._publish(tmp, step, manifest[C.KEY_FILES])
        final, aside = self.task_dir / mf.step_dir_name(step), None
        if mf.lstat(final) is not None:  # another timeline's copy, or a directory without a manifest
            self._disk.rename(final, aside := final.with_name(f"{tmp.name}{C.ASIDE_SUFFIX}"), sync=True)
        fault("commit", step=step)
        self._disk.rename(tmp, final, sync=True)  # the commit point
        if aside is not None:
            self._discard(aside)
        self._record(info := self._info(manifest, final))
        self._collect_blobs(GcReport()) if aside is not None else None  # blobs only the replaced copy used go
        return info

    # -- timelines ------------------------------------------------------------------------------------------------
    def _timelines(self) -> dict[str, Any]:
        """The timelines record (``{"format": 1, "current", "abandoned", "forks"}``), cached by file identity; an
        unreadable one is logged and read as empty (nothing counts as abandoned until a fork rewrites it)."""
        path = self.task_dir / C.TIMELINES_NAME
        empty: dict[str, Any] = {"format": 1, "current": None, "abandoned": [], "forks": []}
        if (st := mf.lstat(path)) is None:
            return empty
        if self._timelines_cache is not None and self._timelines_cache[0] == (st.st_ino, st.st_size, st.st_mtime_ns):
            return self._timelines_cache[1]
        try:
            record = mf.read_json(path)
            ts = [(e["step"], e["created_at"]) for e in record["abandoned"]]
            if record.get("format") != 1 or not all(isinstance(s, int) and isinstance(t, int | float) for s, t in ts):
                raise ValueError("unexpected content")
        except (CorruptCheckpointError, AttributeError, KeyError, TypeError, ValueError) as e:
            logger.error("%s is unreadable or malformed (%s); treating no checkpoint as abandoned. Retention will not "
                         "remove abandoned checkpoints until a new fork rewrites it.", path, e)
            record = {**empty, "unreadable": True}
        self._timelines_cache = ((st.st_ino, st.st_size, st.st_mtime_ns), record)
        return record

    def _abandoned(self) -> set[tuple[int, float]]:
        return {(e["step"], float(e["created_at"])) for e in self._timelines()["abandoned"]}

    def adopt(self, source: CheckpointStore, step: int) -> CheckpointInfo:
        """Copy checkpoint `step` of `source` (another store of this task: the memory tier's slots) into this store
        unchanged: its files, manifest, checksums and timeline. It is verified first (`source.verify`) and committed
        as a save is (temporary directory, fsync, rename, catalog row). Raises `CorruptCheckpointError` when it does
        not verify, `DynamicCkptError` when this store holds a checkpoint of `step` already."""
        self._check_writable("adopt")
        if source.task_id != self.task_id:
            raise DynamicCkptError(f"adopt: task {source.task_id!r} is not this store's task {self.task_id!r}.")
        if problems := source.verify(f"step:{step}"):
            raise CorruptCheckpointError(f"step {step} of {source.root} does not verify: {'; '.join(problems)}")
        src, final = source.task_dir / mf.step_dir_name(step), self.task_dir / mf.step_dir_name(step)
        with self._lock:
            if mf.lstat(final) is not None:
                raise DynamicCkptError(f"adopt: {final} exists already; nothing was copied.")
            self._disk.mkdir(self.task_dir)
            tmp = self.task_dir / f"{mf.step_dir_name(step)}{C.TMP_MARKER}{self.session_id}"
            self._disk.remove(tmp)
            self._disk.mkdir(tmp)
            try:
                for name in sorted(mf.listdir(src), key=lambda n: n == C.MANIFEST_NAME):  # the manifest last
                    if not is_kind(src / name, "file"):
                        raise UnsafePathError(f"{src / name} is not a regular file; a checkpoint holds only files.")
                    shutil.copyfile(src / name, self._disk.contained(tmp / name))
                    self._disk.fsync(tmp / name)
                info = self._rename_in(tmp, self._read_manifest(step, tmp))
            except BaseException:
                self._discard(tmp)
                raise
        logger.debug("adopted step %d of %s into %s", step, source.root, self.task_dir)
        return info

    def fork(self, *, timeline: str, after_step: int | None, session: str,
             parent: mf.Lineage | None = None) -> builtins.list[int]:
        """Start timeline `timeline` (rank 0): every committed checkpoint of another timeline with
        ``step > after_step`` (all of them for `None`, a fresh start) is recorded abandoned in one atomic write of
        ``timelines.json``; the checkpoint `parent` resumes from stays usable. Returns the steps newly abandoned."""
        self._check_writable("fork")
        if self.rank != 0:
            raise DynamicCkptError(f"fork() runs on rank 0 only (this store is rank {self.rank}); broadcast its "
                                   "result.")
        with self._lock:
            infos, now, record = self._scan_all(self.task_dir), time.time(), self._timelines()
            keys = {(i.step, i.save_time) for i in infos}
            entries = {k: e for e in record["abandoned"] if (k := (e["step"], float(e["created_at"]))) in keys}
            newly = []
            for i in infos:
                own, key = i.lineage.timeline if i.lineage else None, (i.step, i.save_time)
                if parent is not None and parent.parent_step == i.step and parent.parent_timeline in (None, own):
                    entries.pop(key, None)  # the checkpoint the new timeline continues is usable again
                elif own != timeline and (after_step is None or i.step > after_step) and key not in entries:
                    entries[key] = {"step": i.step, "created_at": i.save_time, "timeline": own, "by": timeline,
                                    "session": i.lineage.session if i.lineage else None, "at": now}
                    newly.append(i.step)
            current = {"timeline": timeline, "session": session, "after_step": after_step, "since": now,
                       **{k: getattr(parent, k, None) for k in ("parent_step", "parent_timeline")}}
            forks = [*record["forks"], {"timeline": timeline, "session": session, "after_step": after_step, "at": now}]
            self._disk.write(self.task_dir / C.TIMELINES_NAME, mf.json_bytes({
                "format": 1, "current": current, "abandoned": [entries[k] for k in sorted(entries)],
                "forks": forks[-100:]}), atomic=self.session_id)
            if self.remote is not None:
                self.remote.put(self.task_dir / C.TIMELINES_NAME, C.TIMELINES_NAME)
            self.sync_catalog()
            return sorted(newly)

    # -- changing committed checkpoints ---------------------------------------------------------------------------
    def _own(self, ref: Ref, what: str) -> CheckpointInfo:
        """The checkpoint `ref` names as its directory describes it now; only one of this task."""
        info = self.resolve(ref)
        if self._owns(info.path) is None:
            raise DynamicCkptError(f"{what} {info.path}: not a checkpoint of task {self.task_id!r} under {self.root}; "
                                   "open a store on its own root and task.")
        if (fresh := self._scan(info.step, self.task_dir / mf.step_dir_name(info.step))) is None:
            raise NotFound(f"step {info.step} has no committed checkpoint in {self.task_dir}.")
        return fresh

    def _rewrite_manifest(self, path: Path, manifest: dict[str, Any]) -> None:
        self._disk.write(path / C.MANIFEST_NAME, mf.manifest_bytes(manifest), atomic="new")
        self._record(self._info(manifest, path))

    def unpin(self, ref: Ref) -> CheckpointInfo:
        """Undo `pin`, and a pin requested at save time (the manifest is rewritten atomically)."""
        return self.pin(ref, pinned=False)

    def pin(self, ref: Ref, *, pinned: bool = True) -> CheckpointInfo:
        """Protect a checkpoint from retention and gc (a ``PINNED`` marker next to its manifest); `pinned=False`:
        `unpin`."""
        self._check_writable("pin" if pinned else "unpin")
        with self._lock:
            path = Path((info := self._own(ref, "pin" if pinned else "unpin")).path)
            if not pinned and (manifest := self._read_manifest(info.step)).get(C.KEY_PINNED):
                self._rewrite_manifest(path, mf.with_changes(manifest, {C.KEY_PINNED: False}))
            self._disk.write(path / C.PINNED_MARKER, b"") if pinned else self._disk.remove(path / C.PINNED_MARKER)
            self._disk.fsync(path)
            if self.remote is not None:  # the bucket's copy follows
                self.remote.mirror(path, self._read_manifest(info.step)[C.KEY_FILES])
            self._record(info := self._scan(info.step, path) or info)
            return info

    def delete(self, ref: Ref, *, tiers: Collection[Tier] | None = None, force: bool = False) -> None:
        """Delete a checkpoint of this task, or only some of its tiers; `DynamicCkptError` when it is pinned (read
        from disk) and `force` is not set."""
        self._check_writable("delete")
        with self._lock:
            if (info := self._own(ref, "delete")).pinned and not force:
                raise DynamicCkptError(f"step {info.step} ({info.path}) is pinned; pass force=True to delete it "
                                       "anyway.")
            self._delete(info, None if tiers is None else {Tier(t) for t in tiers})
            self._collect_blobs(GcReport())

    def _delete(self, info: CheckpointInfo, tiers: set[Tier] | None = None) -> int:
        """Delete a checkpoint (renamed to a temporary name first: never half of one that looks committed), or some of
        its tiers (the manifest rewritten before the files go); returns the bytes freed."""
        path = self.task_dir / mf.step_dir_name(info.step)
        if tiers is not None and tiers != set(ALL_TIERS) and set(info.tiers) - tiers:
            new, drop = mf.without_tiers(self._read_manifest(info.step), tiers)
            self._rewrite_manifest(path, new)
            freed = sum(_tree_bytes(path / n) for n in drop)
            for name in drop:  # allowlisted single names (manifest validation)
                self._disk.remove(path / name)
            self.remote.mirror(path, new[C.KEY_FILES]) if self.remote is not None else None
            return freed
        if self.remote is not None:  # the object store first: its manifest goes, so no reader counts it any more
            self.remote.remove(mf.step_dir_name(info.step), C.MANIFEST_NAME)
            self.remote.remove(mf.step_dir_name(info.step))
        trash = path.with_name(f"{path.name}{C.TMP_MARKER}{self.session_id}{C.TRASH_INFIX}{uuid.uuid4().hex[:8]}")
        self._disk.rename(path, trash, sync=True)
        self._catalog(lambda: self.catalog.remove(self.task_id, info.step))
        freed = _tree_bytes(trash)
        self._disk.remove(trash)
        return freed

    def removed(self) -> dict[int, dict[str, Any]]:
        """What retention removed from this task, by step: the latest record of each (``step``, ``tiers``, ``rule``
        in words, ``time``), oldest first."""
        out: dict[int, dict[str, Any]] = {}
        with contextlib.suppress(OSError):
            for line in mf.read_bytes(self.task_dir / C.REMOVED_LOG_NAME, limit=C.MAX_JSON_BYTES).splitlines():
                with contextlib.suppress(ValueError):  # a line cut by a crash
                    if isinstance(row := loads_bounded(line), dict) and isinstance(row.get("step"), int):
                        out[row["step"]] = row
        return dict(sorted(out.items()))

    def _note_removed(self, step: int, tiers: Iterable[Tier], rule: str) -> None:
        """Record a removal by retention, with its rule (best effort: it only explains a missing step)."""
        line = json.dumps({"step": int(step), "tiers": sorted(Tier(t).value for t in tiers), "rule": rule,
                           "time": time.time()}, sort_keys=True)
        try:
            with self._disk.create(self.task_dir / C.REMOVED_LOG_NAME, os.O_APPEND) as f:
                f.write(f"{line}\n".encode())
        except OSError as e:
            logger.debug("could not record the removal of step %d (%s)", step, e)

    def prune(self, plan: Iterable[mf.Removal]) -> GcReport:
        """Apply a retention plan (`policy.retention.plan_retention`), then the abandoned-timeline rule. Each entry is
        re-read from disk first and kept when it is pinned there, was replaced, is abandoned, or its health differs
        from what the plan read; every removal is recorded with its rule (`removed`)."""
        self._check_writable("prune")
        report = GcReport()
        with self._lock:
            for planned, tiers, rule in plan:
                fresh = self._scan(planned.step, self.task_dir / mf.step_dir_name(planned.step))
                why = "is gone" if fresh is None else "was replaced since the plan was made" if \
                    fresh.save_time != planned.save_time else "is pinned on disk" if fresh.pinned else \
                    "is abandoned (removed by the abandoned-timeline rule)" if fresh.abandoned else \
                    f"is {'healthy' if fresh.healthy else 'unhealthy'} on disk, unlike the catalog the plan read" \
                    if fresh.healthy != planned.healthy else None
                if why is not None or fresh is None:
                    report.kept.append(f"step {planned.step} kept: it {why}")
                    self._record(fresh) if fresh is not None else None
                    continue
                whole = Tier.WEIGHTS in tiers or not set(fresh.tiers) - set(tiers)
                report.bytes_freed += self._delete(fresh, None if whole else set(tiers))
                report.removed += [fresh.step] if whole else []
                report.trimmed.update({} if whole else {fresh.step: sorted(Tier(t).value for t in tiers)})
                self._note_removed(fresh.step, fresh.tiers if whole else tiers, rule)
            if self._timelines()["abandoned"]:
                self._remove_abandoned(report)
            if report.removed:
                self._collect_blobs(report)
        return report

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove what nothing needs: passed abandoned checkpoints, leftovers of interrupted saves, unused blobs of
        earlier versions (`dry_run`: only report, read-only stores too). `StoreLockedError` when another live
        session writes the task."""
        self._check_writable("gc") if not dry_run else None
        report = GcReport(dry_run=dry_run)
        with self._lock:
            if took := not dry_run and not self._writer.held:
                self._writer.acquire(what=f"task {self.task_id!r} under {self.url}")
            try:
                self._remove_leftovers(report)
                if self.remote is not None:
                    report.temp_dirs += self.remote.leftovers(self.session_id, dry_run=dry_run, at_open=False,
                                                              kept=report.kept)
                self._remove_abandoned(report)
                self._collect_blobs(report)
                self.sync_catalog(drop_missing=True) if not dry_run else None
            finally:
                self._writer.release() if took else None
        return report

    def _remove_abandoned(self, report: GcReport) -> None:
        infos, current = self._scan_all(self.task_dir), self._timelines()["current"]
        top = max((i.step for i in infos if current and not i.abandoned and i.lineage is not None
                   and i.lineage.timeline == current["timeline"]), default=None)
        for i in (i for i in infos if i.abandoned):
            if i.pinned or top is None or i.step >= top:
                report.kept.append(f"step {i.step} kept: abandoned but pinned" if i.pinned else
                                   f"step {i.step} kept: abandoned, the current timeline has not passed it yet")
                continue
            report.bytes_freed += _tree_bytes(Path(i.path)) if report.dry_run else self._delete(i)
            report.removed.append(i.step)
            report.abandoned.append(i.step)
            self._note_removed(i.step, i.tiers, "abandoned timeline: the run went back before it and has saved past "
                                                "it since") if not report.dry_run else None

    def _remove_leftovers(self, report: GcReport) -> None:
        """Finish what interrupted saves, replace-commits and deletes left (the writer only): a copy set aside by a
        replace-commit whose step has no committed directory is renamed back; then every temporary entry of other
        sessions goes (this session's own ``step-<N>.tmp-<session>`` stays: other ranks may be writing into it)."""
        own, dry_run = f"{C.TMP_MARKER}{self.session_id}", report.dry_run
        for name in mf.listdir(self.task_dir):
            final = self.task_dir / name.split(C.TMP_MARKER)[0]
            if name.endswith(C.ASIDE_SUFFIX) and mf.lstat(final) is None:  # restored, or (unusable) left in place
                if not dry_run and (step := mf.parse_step_dir(final.name)) is not None:
                    try:
                        self._read_manifest(step, self.task_dir / name)
                        self._disk.rename(self.task_dir / name, final, sync=True)
                        logger.warning("step %d: a replace-commit was interrupted between its renames; the previous "
                                       "copy is restored (%s -> %s)", step, name, final.name)
                    except (NotFound, CorruptCheckpointError, FormatVersionError) as e:
                        logger.error("step %s: the copy set aside by an interrupted replace (%s) is unusable (%s); "
                                     "left in place", step, name, e)
                continue
            if (name.startswith(C.STEP_DIR_PREFIX) and C.TMP_MARKER in name and not name.endswith(own)) or \
                    name.startswith(f".{C.TIMELINES_NAME}{C.TMP_MARKER}"):
                report.temp_dirs.append(name)
                report.bytes_freed += _tree_bytes(self.task_dir / name)
                self._discard(self.task_dir / name) if not dry_run else None  # a link goes, never its target
        blobs = self.task_dir / C.BLOBS_DIR
        for name in mf.listdir(blobs) if not dry_run else ():  # a linked blobs/ lists nothing
            self._disk.remove(blobs / name) if C.TMP_MARKER in name else None

    def _collect_blobs(self, report: GcReport) -> None:
        """Remove the blobs of earlier versions no committed checkpoint (nor a copy set aside) references."""
        used, blobs = set(), self.task_dir / C.BLOBS_DIR
        dirs = [*self._committed().items(), *((mf.parse_step_dir(n.split(C.TMP_MARKER)[0]) or 0, self.task_dir / n)
                                              for n in mf.listdir(self.task_dir) if n.endswith(C.ASIDE_SUFFIX))]
        for step, path in dirs if is_kind(blobs, "dir") else ():
            try:
                used |= {b["digest"] for b in (self._read_manifest(step, path).get(C.KEY_BLOBS) or {}).values()}
            except NotFound:
                continue
            except (CorruptCheckpointError, FormatVersionError):
                return report.kept.append("blobs: not collected, a manifest of this task is unreadable")
        for name in mf.listdir(blobs):
            if C.TMP_MARKER not in name and name.split(".")[0] not in used:
                report.blobs.append(name)
                report.bytes_freed += _tree_bytes(blobs / name)
                self._disk.remove(blobs / name) if not report.dry_run else None
        if self.remote is not None:
            self.remote.collect_blobs(report)

    # -- a URL root: the cache and the object store ----------------------------------------------------------------
    def _download(self, path: Path, *names: str) -> None:
        """An object downloaded to `path`, all or nothing (under a temporary name renamed into place)."""
        assert self.remote is not None
        part = self._disk.contained(path.with_name(f".{path.name}{C.TMP_MARKER}{uuid.uuid4().hex[:8]}"))
        try:
            self.remote.get(part, *names)
            self._disk.rename(part, path, replace=True)
        finally:
            self._disk.remove(part)

    def _cache_manifest(self, name: str, data: bytes) -> None:
        """A bucket's manifest into the cache as ``<name>/manifest.json``, when it differs."""
        local = self.task_dir / name
        if not is_kind(local / C.MANIFEST_NAME, "file") or (local / C.MANIFEST_NAME).read_bytes() != data:
            tmp = local.with_name(f"{name}{C.TMP_MARKER}{self.session_id}.pull")
            self._disk.remove(tmp)
            self._disk.mkdir(tmp)
            self._disk.write(tmp / C.MANIFEST_NAME, data)
            self._disk.remove(local)
            self._disk.rename(tmp, local)

    def _pull(self, step: int | None = None) -> None:
        """The cache holds exactly the bucket's manifests, pin markers and timelines (files come on demand); `step`
        (ranks > 0 before a save): the timelines and that step's manifest only, so that this rank decides "already
        committed / replace / new" from the same files as rank 0."""
        assert self.remote is not None
        self.remote.invalidate()
        self._disk.mkdir(self.task_dir)
        if (timelines := self.remote.read(C.TIMELINES_NAME)) is not None:
            self._disk.write(self.task_dir / C.TIMELINES_NAME, timelines, atomic=self.session_id)
        if step is not None:
            if (data := self.remote.read(name := mf.step_dir_name(step), C.MANIFEST_NAME)) is not None:
                return self._cache_manifest(name, data)
            return self._disk.remove(self.task_dir / name)
        for name, data in sorted((manifests := self.remote.manifests()).items()):
            self._cache_manifest(name, data)
            if (self.remote.size(name, C.PINNED_MARKER) is not None) != is_kind(marker := self.task_dir / name /
                                                                                 C.PINNED_MARKER, "file"):
                self._disk.write(marker, b"") if mf.lstat(marker) is None else self._disk.remove(marker)
        for path in self._committed().values():
            self._disk.remove(path) if path.name not in manifests else None

    def _materialize(self, step: int) -> None:
        """Download what a cached checkpoint's manifest lists (blobs of an earlier version too) and the cache lacks."""
        path, name, manifest = self.task_dir / mf.step_dir_name(step), mf.step_dir_name(step), self._read_manifest(step)
        for fname, entry in manifest[C.KEY_FILES].items():
            if (st := mf.lstat(path / fname)) is None or st.st_size != entry[C.KEY_SIZE]:
                self._download(path / fname, name, fname)
        for rec in (manifest.get(C.KEY_BLOBS) or {}).values():
            if not is_kind(blob := self._blob(path, rec["digest"]), "file"):
                self._disk.mkdir(blob.parent)
                self._download(blob, C.BLOBS_DIR, blob.name)

    def _fetch_done(self, done: Path) -> bool:
        """Rank 0 under a URL root: another rank's done note copied from the bucket, when it is there."""
        if self.remote is None or self.world_size == 1:
            return False
        self.remote.invalidate()
        if self.remote.size(done.parent.name, done.name) is None:
            return False
        self._download(done, done.parent.name, done.name)
        return True

    def _publish(self, tmp: Path, step: int, files: Mapping[str, Any]) -> None:
        """Rank 0, before the local rename: other ranks' files into the cache, then every file to the bucket and the
        manifest last; a failed upload is removed where the endpoint allows (else by the next open or `gc`)."""
        assert self.remote is not None
        name = mf.step_dir_name(step)
        for fname in files:
            self._download(tmp / fname, name, fname) if not is_kind(tmp / fname, "file") else None
        self.remote.invalidate()
        try:
            self.remote.publish(tmp, name, sorted(files), replacing=self.remote.size(name, C.MANIFEST_NAME) is not None)
            self.remote.remove(tmp.name) if self.world_size > 1 else None  # the other ranks' done notes
        except BaseException:
            with contextlib.suppress(Exception):
                self.remote.remove(name)
            raise

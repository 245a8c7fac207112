"""`CheckpointStore`: the store's public face, a facade over collaborators that do not know it.

Who owns what (each takes the `Task` and nothing of the store):

- `task.Task`: one task directory: paths derived from the step, manifests checked against their
  directory, catalog rows, the timelines record, the blob store, the object-store copy; `checkpoints`
  and `resolve` over the synced catalog (the store re-verifies corrupt flags before it resolves a
  named ref).
- `catalog.Catalog`: the SQLite index and its one reconciliation with the manifests (`sync`, `rebuild`).
- `reader`: `load`, `load_scheduler_only` and `verify` of a resolved checkpoint.
- `commit`: the whole commit sequence of `save`.
- `maintenance`: leftovers, `delete`, `prune`, `gc`, blob collection, `pin` and `unpin` markers.
- `timelines`: the pure `fork` record; `lock.WriterLock`: one writer per task; `remote_sync`: the
  object-store copy of a URL root.

The store itself resolves references, checks that a change is allowed (read-only stores, rank 0,
the task's own checkpoints), serialises changes under one lock and holds the writer lock.

Layout::

    <root>/catalog.db                       index (SQLite, WAL), rebuildable by `reindex`
    <root>/<task_id>/step-<N>/              one committed checkpoint, manifest.json last
    <root>/<task_id>/step-<N>.tmp-<sid>*    a save, replace or delete in progress (or interrupted)
    <root>/<task_id>/blobs/                 content-addressed tensors shared by checkpoints
    <root>/<task_id>/timelines.json         current timeline and abandoned checkpoints
    <root>/<task_id>/.writer.lock           the one writer of the task (pid, host, session, since)

Invariants:

- A directory is a checkpoint only once it is named ``step-<N>`` and holds a manifest
  whose checksum matches and whose step and task are the directory's; both happen at the
  atomic rename, after every file of every rank was fsynced. A crash at any instant leaves
  each committed checkpoint intact (a replace-commit cut between its renames is undone at
  the next open).
- No tensor leaves `load` before the size and checksum of its file (and the content
  digest of each blob) matched the manifest. Every parse error is `CorruptCheckpointError`.
- Nothing outside the root is ever changed: names come from an allowlist, paths from the
  step, and every change goes through `fs.LocalFS`, which refuses links and escapes.
- Nothing is deleted on resume: `fork` marks newer checkpoints of other timelines abandoned.
- `save` runs no collectives: ranks meet through ``done-rank<R>.json`` files.

A URL root (``s3://...``) is a local cache with this layout plus its object-store copy, which
the writer uploads before the local rename, manifest last (`remote_sync`, docs/storage.md).

A user names a store by its directory (the one holding ``catalog.db`` and one folder per task)
or by the training ``output_dir`` (its ``smart_ckpt/`` is the store, as
`SmartCkptConfig.resolve_root` puts it). `find_root` turns either into the store directory; a
path that holds no store is an error that says what to pass, never a place where a catalog gets
created. Opened with ``read_only=True`` (what `load_checkpoint`, `export_checkpoint` and the read
commands of `hf-dynamic-ckpt` do), a store changes nothing: its catalog is an in-memory copy of
the file synced with the manifests, and the file stays byte for byte as the writer left it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..constants import (
    ALL_TIERS,
    BLOBS_DIR,
    CATALOG_NAME,
    DEFAULT_TASK_ID,
    MANIFEST_NAME,
    STEP_DIR_PREFIX,
    TIMELINES_NAME,
    Tier,
)
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DynamicCkptError,
    SaveError,
    StoreNotWritableError,
)
from . import maintenance as mt
from . import reader
from . import remote_sync as rs
from .catalog import Catalog
from .commit import commit_save
from .fs import LocalFS
from .lock import DEFAULT_WAIT_S, WriterLock
from .remote import Remote, split_root
from .shard_files import gather_weights, sharded_table
from .spec import Codec, Lineage, SaveRequest, StoreSpec, new_session_id
from .task import NAMED_REFS, Task, parse_step_dir, step_dir_name
from .timelines import fork_record
from .types import CheckpointInfo, CheckpointState, GcReport, LoadedCheckpoint, Removal

logger = logging.getLogger(__name__)

__all__ = ["CheckpointStore", "find_root", "parse_step_dir", "step_dir_name"]

Ref = str | int | os.PathLike[str] | CheckpointInfo


# -- finding a store from a path a user gives ----------------------------------------------------------------------
STORE_DIR = "smart_ckpt"
"""The store's folder under a training `output_dir` (`SmartCkptConfig.resolve_root`)."""

_WHAT_TO_PASS = f"pass the store directory (the one holding {CATALOG_NAME}) or the training output_dir that holds " \
                f"{STORE_DIR}/"


def task_dirs(root: Path) -> list[Path]:
    """The task folders of a store directory: real folders (no links) that hold checkpoints or a timelines record."""
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name != BLOBS_DIR:
            try:
                if any(c.name.startswith(STEP_DIR_PREFIX) or c.name == TIMELINES_NAME for c in p.iterdir()):
                    out.append(p)
            except OSError:
                continue
    return out


def is_store(root: Path) -> bool:
    """Whether `root` is a store directory (a catalog, or at least one task folder)."""
    return root.is_dir() and ((root / CATALOG_NAME).is_file() or bool(task_dirs(root)))


def find_root(path: str | os.PathLike[str]) -> Path:
    """The store directory of a local path: the store itself, or a training output_dir holding ``smart_ckpt/``.

    Args:
        path (`str` or `os.PathLike`): what the user passed as the store.

    Returns:
        `Path`: the store directory (`path`, or `path/smart_ckpt`).

    Raises:
        `CheckpointNotFoundError`: `path` does not exist or holds no store.
        `ConfigError`: `path` is a file, or a task or checkpoint directory inside a store (the message names the
            store directory to pass instead).

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
    if (root / MANIFEST_NAME).exists() or any(p.name.startswith(STEP_DIR_PREFIX) for p in root.iterdir()):
        store_root = root.parent.parent if (root / MANIFEST_NAME).exists() else root.parent
        raise ConfigError(f"root {root} is a checkpoint or task directory, not a store root; pass {store_root} (the "
                          f"directory holding {CATALOG_NAME}) and name the checkpoint by its reference and task.")
    if is_store(root):
        return root
    if is_store(root / STORE_DIR):
        return root / STORE_DIR
    raise CheckpointNotFoundError(f"no hf_dynamic_ckpt store under {root}: {_WHAT_TO_PASS}.")


class CheckpointStore:
    """Tiered checkpoints of one task under a store root, committed atomically.

    Args:
        root (`str` or `os.PathLike`): store directory; holds `catalog.db` and one folder per task.
        task_id (`str`, *optional*, defaults to `"default"`): the run's folder under `root`.
        rank (`int`, *optional*, defaults to `0`): this process's rank; rank 0 commits.
        world_size (`int`, *optional*, defaults to `1`): number of ranks that write each save.
        session_id (`str`, *optional*): names this run's temporary directories; must be the same
            on every rank (broadcast it). Generated when `world_size == 1`.
        compression_level (`int`, *optional*, defaults to `1`): zstd level of the optimizer tier.
        compression_threads (`int`, *optional*, defaults to `0`): zstd threads (0: all CPUs).
        pace_to_disk (`bool`, *optional*, defaults to `True`): see `StoreSpec`.
        compression (`str` or `Codec`, *optional*, defaults to `"zstd"`): codec of the optimizer
            tier, `"zstd"` or `"none"` (larger file, memory-mapped on load).
        rank_timeout_s (`float`, *optional*, defaults to `600.0`): how long rank 0 waits for the
            other ranks' files before giving up on a save (`DistributedError`).
        cleanup (`bool`, *optional*, defaults to `True`): on rank 0, take the task's writer lock
            (`StoreLockedError` if another live session holds it), finish or remove what
            interrupted saves left, and sync the catalog with the directories. Readers (the
            writer process, tools) pass `False`.
        read_only (`bool`, *optional*, defaults to `False`): never write anything: the catalog is an
            in-memory copy of the file (`Catalog.snapshot`) synced with the manifests; for read-only
            media, concurrent readers and every command that only reads.
        takeover (`bool`, *optional*, defaults to `False`): replace the writer lock of a holder
            this host cannot see (another host) at once instead of waiting for it; never a running
            holder of this host (see `lock`).
        lock_wait_s (`float`, *optional*, defaults to `120.0`): how long to wait for the writer
            lock of a holder this host cannot see (another host or container) before
            `StoreLockedError`; a live holder of this host is refused at once, a dead one taken
            over at once, and an earlier writer of this same process closed and replaced.
        storage_options (`Mapping`, *optional*): fsspec options when `root` is a URL (``s3://...``;
            never logged). `cache_dir` (default `remote.default_cache_dir`) is its local cache;
            `retries` / `backoff_s` bound the retries of each object-store call (docs/storage.md).

    Example:
        ```python
        >>> store = CheckpointStore("out/smart_ckpt", task_id="run1")
        >>> state = CheckpointState(step=10, weights=model.state_dict())
        >>> info = store.save(state, SaveRequest(step=10, reason="interval"))
        >>> store.load("auto").weights["lm_head.weight"].shape
        ```
    """

    def __init__(self, root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID, rank: int = 0,
                 world_size: int = 1, session_id: str | None = None, compression_level: int = 1,
                 compression_threads: int = 0, compression: Codec | str = Codec.ZSTD, pace_to_disk: bool = True,
                 rank_timeout_s: float = 600.0, cleanup: bool = True, read_only: bool = False, takeover: bool = False,
                 lock_wait_s: float = DEFAULT_WAIT_S, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, retries: int = 5, backoff_s: float = 0.5) -> None:
        root, remote = split_root(root, rank=rank, storage_options=storage_options, cache_dir=cache_dir,
                                  retries=retries, backoff_s=backoff_s)
        if session_id is None:
            if world_size > 1:
                raise ConfigError("session_id=None is invalid with world_size > 1: every rank must use the same id; "
                                  "create one on rank 0 and broadcast it (distributed.broadcast_object).")
            session_id = new_session_id()
        try:
            codec = Codec.parse(compression, field="compression")
        except ConfigError:
            raise ConfigError(f"compression={compression!r} is invalid for the optimizer tier: expected 'zstd' or "
                              "'none'.") from None
        spec = StoreSpec(root=str(Path(root).absolute()), task_id=task_id, rank=rank, world_size=world_size,
                         session_id=session_id, codec=codec, compression_level=compression_level,
                         compression_threads=compression_threads, pace_to_disk=bool(pace_to_disk),
                         rank_timeout_s=float(rank_timeout_s), remote=remote)
        self._open(spec, cleanup=cleanup, read_only=read_only, takeover=takeover, pull=True, lock_wait_s=lock_wait_s)

    @classmethod
    def from_spec(cls, spec: StoreSpec, *, cleanup: bool = True, read_only: bool = False,
                  takeover: bool = False) -> CheckpointStore:
        """Open the store `spec` describes (e.g. in a writer process: ``from_spec(store.spec, cleanup=False)``)."""
        store = cls.__new__(cls)  # the alternate constructor: `_open` is what __init__ runs after building the spec
        cls._open(store, spec, cleanup=cleanup, read_only=read_only, takeover=takeover, pull=cleanup)
        return store

    def _open(self, spec: StoreSpec, *, cleanup: bool, read_only: bool, takeover: bool, pull: bool = False,
              lock_wait_s: float = 0.0) -> None:
        self.spec = spec
        self.root = Path(spec.root).absolute()
        self.read_only = read_only
        self._lock = threading.RLock()
        self.remote = Remote(spec.remote, spec.task_id) if spec.remote is not None else None
        self.url = spec.remote.shown if spec.remote is not None else str(self.root)
        writer = spec.rank == 0 and cleanup and not read_only
        if self.remote is None and self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"root={str(self.root)!r} is invalid: it is a file, not a directory; pass the store's "
                              "directory (new or existing), e.g. the folder next to it.")
        if not read_only or self.remote is not None:
            try:  # readers never create the task folder (a cache is not the store)
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise self._not_writable(str(e)) from e
        if writer and self.remote is None and not os.access(self.root, os.W_OK | os.X_OK):
            raise self._not_writable("a read-only file system, or no write permission")
        self.fs = LocalFS(self.root)
        if self.fs.is_link(self.root / spec.task_id):
            raise ConfigError(f"{self.root / spec.task_id} is a symbolic link; the store refuses to work through links "
                              "(point root at the real directory instead).")
        memory = read_only
        if not read_only:
            try:
                catalog = Catalog(self.root / CATALOG_NAME)
            except sqlite3.OperationalError as e:
                if writer:
                    raise self._not_writable(f"its catalog {self.root / CATALOG_NAME} cannot be opened: {e}") from e
                logger.warning("catalog %s cannot be opened (%s); reading the manifests instead",
                               self.root / CATALOG_NAME, e)
                memory = True
        self.catalog = Catalog.snapshot(self.root / CATALOG_NAME) if memory else catalog
        self.task = Task(spec, self.fs, self.catalog, read_only=memory, remote=self.remote)
        self._writer = WriterLock(self.task.dir, self.fs, session=spec.session_id)
        if memory:
            if self.remote is not None and pull:
                rs.open_task(self.task, self.remote, writer=False)
            self.task.sync()
        elif writer:
            self._writer.acquire(takeover=takeover, what=f"task {spec.task_id!r} under {self.url}", wait_s=lock_wait_s)
            if self.remote is not None:
                rs.open_task(self.task, self.remote, writer=True)
            mt.remove_leftovers(self.task)
            if self.catalog.rebuilt:
                self.reindex()
            else:
                self.sync_catalog()
        elif self.remote is not None and pull:  # other ranks and tools: their own cache of the manifests
            rs.open_task(self.task, self.remote, writer=False)
            self.sync_catalog()

    # -- properties the rest of the library reads ----------------------------------------------
    task_id = property(lambda self: self.spec.task_id)
    rank = property(lambda self: self.spec.rank)
    world_size = property(lambda self: self.spec.world_size)
    session_id = property(lambda self: self.spec.session_id)
    compression_level = property(lambda self: self.spec.compression_level)
    compression_threads = property(lambda self: self.spec.compression_threads)
    compression = property(lambda self: self.spec.codec.value)
    rank_timeout_s = property(lambda self: self.spec.rank_timeout_s)
    task_dir = property(lambda self: self.task.dir)
    blobs = property(lambda self: self.task.blobs, doc="The task's `BlobStore` (the only code that touches blobs/).")
    blobs_dir = property(lambda self: self.task.blobs.dir)

    def _not_writable(self, why: str) -> StoreNotWritableError:
        return StoreNotWritableError(
            f"the store root {self.root} is not writable ({why}): this run could not save a checkpoint there. "
            "Make it writable, or save to another root (SmartCkptConfig(root=...), --smart_ckpt_root) and resume "
            f"from this store by path (resume_checkpoint(trainer, '{self.root / self.spec.task_id}/step-<N>')); "
            "to only read it, open CheckpointStore(..., read_only=True) or use the hf-dynamic-ckpt read commands."
        )

    # -- housekeeping ---------------------------------------------------------------------------
    def ensure_root(self) -> bool:
        """Rank 0: recreate the root, the task folder, the catalog and the writer lock when something deleted
        them under a running writer (a cleanup script's ``rm -rf``); the catalog is rebuilt from the manifests
        still on disk. The lock holder logs one WARNING; a save is then written as usual. Cheap (a few `stat`s).

        Returns:
            `bool`: whether anything was recreated.
        """
        if self.read_only or self.rank != 0 or self.remote is not None:
            return False
        # Checked without the store's lock: a save in flight holds it for its whole write.
        task_gone = not self.fs.is_dir(self.task.dir)
        catalog_gone = self.catalog.replaced()
        lock_gone = self._writer.held and self._writer.moved()
        if not (task_gone or catalog_gone or lock_gone):
            return False
        with self._lock:
            if self.fs.is_dir(self.task.dir) and not self.catalog.replaced() and not self._writer.moved():
                return False  # another thread of this process recreated it meanwhile
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.fs.mkdir(self.task.dir)
                self.fs.fsync_dir(self.root)
                if self.catalog.replaced():
                    self.catalog.reopen()
                self._writer.refresh(what=f"task {self.task_id!r} under {self.url}")
                self.task.rebuild(all_tasks=True)
            except OSError as e:
                raise SaveError(f"the store root {self.root} was deleted and cannot be recreated: {e}") from e
        if self._writer.held:
            logger.warning("the store %s (task %r) was deleted while this run was writing it; recreated it, and "
                           "the catalog from the manifests left on disk: saves continue, checkpoints deleted with it "
                           "are gone", self.root, self.task_id)
        return True

    def close(self) -> None:
        """Close the catalog connection and release the writer lock (idempotent)."""
        self.catalog.close()
        self._writer.release()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync_catalog(self) -> None:
        """Make this task's catalog rows agree with its directories (see `Catalog.sync`)."""
        with self._lock:
            self.task.sync()

    def reindex(self) -> int:
        """Rebuild the catalog from the manifests (every task under `root`; only this one when read-only).

        Returns:
            `int`: number of rows written. Directories with a damaged manifest get a row with
            status ``"corrupt"``.
        """
        with self._lock:
            if self.remote is not None:  # the object store is the truth: the cache first, then the catalog
                rs.pull(self.task, self.remote)
            n = self.task.rebuild(all_tasks=not self.task.read_only and self.remote is None)
            logger.debug("reindexed %s: %d checkpoints", self.root, n)
            return n

    def abort(self, reason: str) -> None:
        """Make a save that waits for other ranks' files (rank 0) give up now, and every later one.

        For the orchestrator's fatal-error path (a rank died): the waiting save raises
        `DistributedError` naming `reason` within one poll interval instead of after
        `rank_timeout_s`; nothing is committed. Thread-safe; `clear_abort` undoes it.
        """
        self.task.abort_reason = str(reason) or "aborted"

    def clear_abort(self) -> None:
        """Let saves wait for other ranks again after `abort`."""
        self.task.abort_reason = None

    def _remote(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.remote is not None:  # a URL root: the object store follows the cache
            fn(self.task, self.remote, *args)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise DynamicCkptError(f"{what} is refused: the store {self.root} was opened with read_only=True.")

    # -- finding and reading --------------------------------------------------------------------
    def list(self, include_unhealthy: bool = False, include_abandoned: bool = False) -> builtins.list[CheckpointInfo]:
        """Checkpoints of this task, newest first.

        Args:
            include_unhealthy (`bool`, *optional*, defaults to `False`): also list unhealthy
                checkpoints and rows whose status is ``"missing"`` or ``"corrupt"``.
            include_abandoned (`bool`, *optional*, defaults to `False`): also list checkpoints
                of timelines a later run forked away from.
        """
        return self.task.checkpoints(include_unhealthy=include_unhealthy, include_abandoned=include_abandoned)

    def resolve(self, ref: Ref) -> CheckpointInfo:
        """Turn a restore-point ref into a checkpoint.

        Args:
            ref (`str`, `int`, `os.PathLike` or `CheckpointInfo`): ``"auto"`` (newest healthy
                checkpoint with weights), ``"best"`` (lowest recorded loss), ``"fastest"``
                (lowest estimated recovery cost), ``"step:N"`` or ``N`` (that step, whatever
                its health or timeline), or the path of a checkpoint directory.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        if not isinstance(ref, CheckpointInfo | int) and os.fspath(ref) in NAMED_REFS:
            for step in self.task.to_recheck():  # a corrupt flag is re-verified once before it excludes
                with contextlib.suppress(CheckpointNotFoundError):
                    self.verify(step)
        return self.task.resolve(ref)

    def load(self, ref: Ref, *, tiers: Collection[Tier] = ALL_TIERS, rank: int | None = None,
             mmap: bool = True, l1_max_numel: int | None = None, weights_checksum: bool = True) -> LoadedCheckpoint:
        """Verify, then read the requested tiers of a checkpoint.

        Every file read is checked (size, checksum; blobs by content digest) before any
        tensor is returned; a failed check or read is retried once (a transient I/O error
        must not cost a checkpoint). A tier the checkpoint does not hold is left `None`
        with a note in `warnings`.

        Args:
            ref: anything `resolve` accepts (``"auto"``, ``"step:N"``, a path, ...).
            tiers (`Collection[Tier]`, *optional*, defaults to all tiers): what to read.
            rank (`int`, *optional*): whose RNG file to read; defaults to this store's rank.
            mmap (`bool`, *optional*, defaults to `True`): weights backed by a read-only
                memory map (no copy), and an uncompressed optimizer tier by a private one;
                `False` reads both into memory.
            l1_max_numel (`int`, *optional*): the most elements an optimizer-tier tensor may declare
                (`state.optimizer.state_numel_bound` of the model); checked before anything is allocated.
            weights_checksum (`bool`, *optional*, defaults to `True`): `False` checks the weights file's size and
                header only, and leaves its checksum to `read_weights_into(..., verify=True)`, which must run before
                any weight is used (a resume that reads the file into the model once, hashing as it reads).

        Returns:
            `LoadedCheckpoint`.

        Raises:
            `CheckpointNotFoundError`: `ref` names no committed checkpoint.
            `CorruptCheckpointError`: a needed file is missing, truncated, altered or does not
                parse (the message lists each problem), or the manifest is damaged.
            `FormatVersionError`: the checkpoint was written by a newer format.
            `IncompatibleStateError`: an optimizer-tier tensor is larger than `l1_max_numel` allows.
        """
        info = self.resolve(ref)
        return reader.load(self.task, info, tiers=tiers, rank=self.rank if rank is None else rank, mmap=mmap,
                           l1_max_numel=l1_max_numel, weights_checksum=weights_checksum)

    def read_weights_into(self, loaded: LoadedCheckpoint, targets: Mapping[str, torch.Tensor], *,
                          verify: bool = False, on_write: Callable[[], None] | None = None) -> set[str]:
        """Read the weights file of `loaded` straight into `targets` (a model's own tensors: no mapping of the file,
        no tensor in between); returns the keys read. A key is read where its target is a contiguous CPU tensor of
        the stored dtype and shape, the rest is the caller's.

        Args:
            loaded (`LoadedCheckpoint`): what `load` returned for the checkpoint.
            targets (`Mapping[str, Tensor]`): where each weight goes.
            verify (`bool`, *optional*, defaults to `False`): hash the whole file as it is read and compare the
                manifest's checksum (one pass, for a `load(..., weights_checksum=False)`); without it `load` has
                verified the file.
            on_write (`Callable[[], None]`, *optional*): called once, right before the first byte goes into a target.

        Raises:
            `CorruptCheckpointError`: the file cannot be read, does not parse or (with `verify`) fails its checksum
                twice, which records the checkpoint as corrupt. The targets then hold what was read of the file:
                they are not restored.
        """
        return reader.read_weights_into(self.task, loaded, targets, verify=verify, on_write=on_write)

    def gather_weights(self, loaded: LoadedCheckpoint) -> None:
        """Replace the placeholders of a sharded checkpoint's weights (FSDP2, DeepSpeed ZeRO; `load` reads names and
        shapes only) with the whole tensors, assembled from every rank's shard files (verified by `load`). A
        checkpoint that is not sharded is left as it is.

        Raises:
            `CorruptCheckpointError`: a shard lacks a tensor, or the shards leave part of one uncovered.
        """
        table = sharded_table(loaded.manifest)
        if table is not None and loaded.weights is not None:
            loaded.weights = gather_weights(Path(loaded.info.path), table)

    def load_scheduler_only(self, ref: Ref) -> dict[str, Any] | None:
        """Salvage the LR-scheduler state when the optimizer tensor file is broken.

        The scheduler state holds no tensors, so it lives entirely in the verified
        `optimizer.json`. Never raises for a damaged checkpoint: returns `None` when that
        file is missing, altered, not JSON, or refers to tensors.
        """
        try:
            info = self.resolve(ref)
        except (DynamicCkptError, OSError):
            return None
        return reader.load_scheduler_only(self.task, info)

    def verify(self, ref: Ref) -> builtins.list[str]:
        """Check a checkpoint completely: manifest, every file's size and checksum, blobs.

        Records the outcome in the catalog (status ``"ok"``, ``"corrupt"`` or ``"missing"``): the file of a
        writable store, the in-memory copy of a ``read_only`` one.
        Only files the manifest may name (an allowlist) in the checkpoint's own directory
        are looked at.

        Args:
            ref: anything `resolve` accepts.

        Returns:
            `list[str]`: one line per problem; empty when the checkpoint is intact.

        Raises:
            `CheckpointNotFoundError`: `ref` names nothing, or the checkpoint was deleted
                before or while it was verified (retention or gc ran meanwhile): a note, not a
                problem of the checkpoint.
        """
        try:
            info = self.resolve(ref)
        except (CorruptCheckpointError, ValueError) as e:  # a path whose manifest is unusable
            return [f"{MANIFEST_NAME}: {e}"]
        return reader.verify(self.task, info)

    # -- save -----------------------------------------------------------------------------------
    def save(self, state: CheckpointState, request: SaveRequest, *, timings: dict[str, Any] | None = None,
             replace: bool = False, cancel: Callable[[], bool] | None = None) -> CheckpointInfo | None:
        """Write this rank's part of a checkpoint; on rank 0, commit it once all ranks are done.

        Rank 0 writes weights (L0), optimizer/scheduler/scaler (L1) and the sampler state;
        every rank writes its own `rng-rank<R>.json`. Thread-safe; runs no collectives. A
        step committed by the same timeline is not rewritten (its info is returned); one
        committed by another timeline, another session or abandoned is replaced atomically.

        Args:
            state (`CheckpointState`): CPU tensors and JSON-able state of this rank.
            request (`SaveRequest`): what the save is and why (reason, kind, pin, health,
                signals, debug info, lineage); it reaches the manifest as given.
            timings (`dict`, *optional*): caller's timings in ms (e.g. snapshot time).
            replace (`bool`, *optional*, defaults to `False`): replace a committed copy of the
                step whatever its timeline (pass the same on every rank).
            cancel (`Callable[[], bool]`, *optional*): polled while rank 0 waits for the other
                ranks' files; `True` gives up like `abort` (the engine's `SaveEngine.abort`).

        Returns:
            `CheckpointInfo` on rank 0 (also when the step was committed before), `None`
            on other ranks once their files are durable.

        Raises:
            `DistributedError`: rank 0 waited `rank_timeout_s` for other ranks; nothing is committed.
            `SaveError`: writing failed, or `request.step` is not the state's step; the previous
                checkpoints are untouched.
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
            # The blob lock keeps collection away from the blobs this save writes or names and from those of a
            # committed copy of the step it may replace (until the new copy is in); a save with neither gives
            # collection nothing to take.
            guard = self.rank == 0 and (state.has_blobs or self.fs.lstat(self.task.step_dir(step)) is not None)
            with self.blobs.lock(shared=True) if guard else contextlib.nullcontext(True):
                info, replaced = commit_save(self.task, state, request, timings=timings, replace=replace, cancel=cancel)
            if replaced:  # blobs only the replaced copy used can go, now that the save released its lock
                mt.collect_blobs(self.task, GcReport())
            return info

    # -- management -----------------------------------------------------------------------------
    def _own(self, ref: Ref, what: str) -> CheckpointInfo:
        info = self.resolve(ref)
        if self.task.owns(info.path) is None:
            raise DynamicCkptError(f"{what} {info.path}: not a checkpoint of task {self.task_id!r} under {self.root}; "
                                   "open a store on its own root and task.")
        fresh = self.task.scan(info.step)
        if fresh is None:
            raise CheckpointNotFoundError(f"step {info.step} has no committed checkpoint in {self.task_dir}.")
        return fresh

    def pin(self, ref: Ref) -> CheckpointInfo:
        """Protect a checkpoint from retention and gc (writes a `PINNED` marker next to the manifest)."""
        self._check_writable("pin")
        with self._lock:
            return mt.pin(self.task, self._own(ref, "pin"))

    def unpin(self, ref: Ref) -> CheckpointInfo:
        """Undo `pin` (and a pin requested at save time: the manifest is rewritten atomically)."""
        self._check_writable("unpin")
        with self._lock:
            return mt.unpin(self.task, self._own(ref, "unpin"))

    def delete(self, ref: Ref, *, tiers: Collection[Tier] | None = None, force: bool = False) -> None:
        """Delete a checkpoint of this task, or only some of its tiers (blobs nobody uses go too).

        Args:
            ref: anything `resolve` accepts (the checkpoint must belong to this task).
            tiers (`Collection[Tier]`, *optional*): only these tiers (e.g. `{Tier.OPTIMIZER}`).
            force (`bool`, *optional*, defaults to `False`): also delete a pinned checkpoint.

        Raises:
            `DynamicCkptError`: the checkpoint is pinned (read from disk) and `force` is not set.
        """
        self._check_writable("delete")
        with self._lock:
            info = self._own(ref, "delete")
            if info.pinned and not force:
                raise DynamicCkptError(f"step {info.step} ({info.path}) is pinned; pass force=True to delete it "
                                       "anyway.")
            mt.delete_checkpoint(self.task, info, None if tiers is None else {Tier(t) for t in tiers})
            mt.collect_blobs(self.task, GcReport())

    def fork(self, *, timeline: str, after_step: int | None, session: str,
             parent: Lineage | None = None) -> builtins.list[int]:
        """Start timeline `timeline`: newer checkpoints of other timelines become abandoned (rank 0).

        Every committed checkpoint of another timeline with ``step > after_step`` (all of them
        when `after_step` is `None`, a fresh start) is recorded as abandoned in one atomic
        write of ``<task>/timelines.json``; the checkpoint `parent` resumes from stays
        usable. Nothing is deleted: `prune`/`gc` remove abandoned checkpoints once this
        timeline has committed a greater step, never pinned ones.

        Returns:
            `list[int]`: the steps newly abandoned.
        """
        self._check_writable("fork")
        if self.rank != 0:
            raise DynamicCkptError(f"fork() runs on rank 0 only (this store is rank {self.rank}); broadcast its "
                                   "result.")
        with self._lock:
            infos = self.task.scan_all()
            record, newly = fork_record(self.task.timelines.read(), infos, timeline=timeline, after_step=after_step,
                                        session=session, parent=parent)
            self.task.timelines.write(record, tag=self.session_id)
            self._remote(rs.push_timelines)
            self.task.sync()
            if newly:
                logger.debug("timeline %s starts after step %s: steps %s of other timelines are abandoned (kept, "
                               "restorable by step:N; removed once this timeline passes them)", timeline, after_step,
                               ", ".join(map(str, newly)))
            return newly

    def removed(self) -> dict[int, dict[str, Any]]:
        """What retention removed from this task, by step: the latest record of each (``step``, ``tiers``,
        ``rule`` in words, ``time``), oldest first."""
        return dict(sorted(self.task.removed().items()))

    def prune(self, plan: Iterable[Removal]) -> GcReport:
        """Apply a retention plan (`policy.retention.plan_retention`), then the abandoned-timeline rule.

        Each planned entry is re-read from disk first and kept when it is pinned there, was
        replaced, or its health differs from what the plan read. Abandoned checkpoints the
        current timeline has passed go too (never pinned ones), then unused blobs. It runs on the
        training thread between saves, so it reads every manifest only when that can matter: when
        the timelines record lists abandoned checkpoints, and for blobs only after a checkpoint
        was removed (blobs lose users only then; `gc` collects those a failed save left).
        """
        self._check_writable("prune")
        report = GcReport()
        with self._lock:
            mt.apply_plan(self.task, plan, report)
            if self.task.timelines.abandoned():
                mt.remove_abandoned(self.task, report)
            if report.removed:
                mt.collect_blobs(self.task, report)
        return report

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove what nothing needs: passed abandoned checkpoints, leftovers, unused blobs.

        `dry_run` only reports what would go and the bytes it would free (read-only stores too).

        Raises:
            `StoreLockedError`: another live session writes the task (gc needs the writer lock).
        """
        report = GcReport(dry_run=dry_run)
        if not dry_run:
            self._check_writable("gc")
        with self._lock:
            took = not dry_run and not self._writer.held
            if took:
                self._writer.acquire(what=f"task {self.task_id!r} under {self.root}")
            try:
                for name, size in mt.remove_leftovers(self.task, dry_run=dry_run):
                    report.temp_dirs.append(name)
                    report.bytes_freed += size
                if self.remote is not None:
                    report.temp_dirs.extend(n for n, _ in rs.remove_leftovers(self.task, self.remote, dry_run=dry_run,
                                                                              at_open=False, kept=report.kept))
                mt.remove_abandoned(self.task, report)
                mt.collect_blobs(self.task, report)
                if not dry_run:
                    self.task.sync(drop_missing=True)
            finally:
                if took:
                    self._writer.release()
        return report

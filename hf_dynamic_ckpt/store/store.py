"""`CheckpointStore`: atomic multi-rank commit, verified loads, and the catalog.

Layout (see docs/internals.md)::

    <root>/catalog.db                       index (SQLite, WAL), rebuildable by `reindex`
    <root>/<task_id>/step-<N>/              one committed checkpoint, manifest.json last
    <root>/<task_id>/step-<N>.tmp-<sid>/    a save in progress (or an interrupted one)
    <root>/<task_id>/blobs/                 content-addressed tensors shared by checkpoints

Invariants:

- A directory is a checkpoint only once it is named ``step-<N>`` and holds a manifest
  whose checksum matches; both happen at the atomic rename, after every file of every
  rank was fsynced. A crash at any instant therefore leaves each committed checkpoint
  intact and at most a ``.tmp-`` directory behind, which the next open removes.
- No tensor leaves `load` before the size and checksum of its file (and the content
  digest of each blob) matched the manifest.
- `save` runs no collectives: ranks meet through ``done-rank<R>.json`` files in the
  temporary directory, so it can run in a background thread of every rank.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ..constants import (
    ALL_TIERS,
    BLOBS_DIR,
    CATALOG_NAME,
    DEFAULT_TASK_ID,
    KEY_BLOBS,
    KEY_EXTRA,
    KEY_FILES,
    MANIFEST_NAME,
    OPTIMIZER_META_NAME,
    PINNED_MARKER,
    STEP_DIR_PREFIX,
    TMP_MARKER,
    WEIGHTS_NAME,
    Tier,
)
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DynamicCkptError,
    FormatVersionError,
    SaveError,
)
from . import manifest as mf
from .catalog import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK, Catalog
from .checksum import fsync_dir, fsync_file
from .commit import merge_rank_parts, wait_for_ranks, write_done, write_rank_files
from .layout import (
    blob_problems,
    broken_info,
    file_problems,
    files_for,
    info_from_manifest,
    read_json,
    read_tiers,
    structure_problems,
)
from .types import CheckpointInfo, CheckpointState, LoadedCheckpoint

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(rf"^{re.escape(STEP_DIR_PREFIX)}(\d+)$")
_NAMED_SPECS = ("auto", "best", "fastest")
_WRITER_LOCK = ".writer.lock"
_BLOBS_LOCK = ".blobs.lock"


def step_dir_name(step: int) -> str:
    """``step-<N>``, the directory name of the committed checkpoint of `step`."""
    return f"{STEP_DIR_PREFIX}{int(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed directory name (``step-12`` -> 12), else `None`."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class CheckpointStore:
    """Tiered checkpoints of one task under a store root, committed atomically.

    Args:
        root (`str` or `os.PathLike`): store directory; holds `catalog.db` and one folder per task.
        task_id (`str`, *optional*, defaults to `"default"`): the run's folder under `root`.
        rank (`int`, *optional*, defaults to `0`): this process's rank; rank 0 commits.
        world_size (`int`, *optional*, defaults to `1`): number of ranks that write each save.
        session_id (`str`, *optional*): names the temporary directories of this run; must be
            the same on every rank (broadcast it). Generated when `world_size == 1`.
        compression_level (`int`, *optional*, defaults to `3`): zstd level of the optimizer tier.
        compression_threads (`int`, *optional*, defaults to `0`): zstd threads (0: all CPUs).
        compression (`str`, *optional*, defaults to `"zstd"`): codec of the optimizer tier:
            `"zstd"`, or `"none"` (larger file, memory-mapped on load; `storage_levels.level_1.compression`).
        rank_timeout_s (`float`, *optional*, defaults to `600.0`): how long rank 0 waits for the
            other ranks' files before giving up on a save (`DistributedError`).
        cleanup (`bool`, *optional*, defaults to `True`): on rank 0, remove temporary
            directories left by other sessions and sync the catalog with the directories.
            Tools that only look (the CLI) pass `False`.

    Example:
        ```python
        >>> store = CheckpointStore("out/smart_ckpt", task_id="run1")
        >>> info = store.save(CheckpointState(step=10, weights=model.state_dict()), reason="interval")
        >>> store.load("auto").weights["lm_head.weight"].shape
        ```
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        task_id: str = DEFAULT_TASK_ID,
        rank: int = 0,
        world_size: int = 1,
        session_id: str | None = None,
        compression_level: int = 3,
        compression_threads: int = 0,
        compression: str = "zstd",
        rank_timeout_s: float = 600.0,
        cleanup: bool = True,
    ) -> None:
        if not task_id or "/" in task_id or task_id.startswith(".") or task_id == BLOBS_DIR:
            raise ConfigError(f"task_id={task_id!r} is invalid: expected a non-empty name without '/' that does not start with '.'.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank}, world_size={world_size} is invalid: expected 0 <= rank < world_size.")
        if session_id is None:
            if world_size > 1:
                raise ConfigError(
                    "session_id=None is invalid with world_size > 1: every rank must use the same id; "
                    "create one on rank 0 and broadcast it (distributed.broadcast_object)."
                )
            session_id = uuid.uuid4().hex[:12]
        if not re.fullmatch(r"[A-Za-z0-9_-]+", session_id):
            raise ConfigError(f"session_id={session_id!r} is invalid: use letters, digits, '_' or '-' only.")
        if rank_timeout_s <= 0:
            raise ConfigError(f"rank_timeout_s={rank_timeout_s!r} is invalid: expected a positive number of seconds.")
        self.root = Path(root).absolute()
        self.task_id = task_id
        self.rank = rank
        self.world_size = world_size
        self.session_id = session_id
        self.compression_level = compression_level
        self.compression_threads = compression_threads
        self.compression = str(getattr(compression, "value", compression))
        if self.compression not in ("zstd", "none"):
            raise ConfigError(f"compression={compression!r} is invalid for the optimizer tier: expected 'zstd' or 'none'.")
        self.rank_timeout_s = float(rank_timeout_s)
        self.task_dir = self.root / task_id
        self.blobs_dir = self.task_dir / BLOBS_DIR
        self._lock = threading.RLock()
        self.root.mkdir(parents=True, exist_ok=True)  # read-only openers never create the task folder
        self.catalog = Catalog(self.root / CATALOG_NAME)
        self._lock_file: BinaryIO | None = None
        self._gc_pending = False
        if rank == 0 and cleanup:
            if self._acquire_writer_lock():
                self._remove_leftovers()
            else:
                logger.warning(
                    "task %r under %s is held by another live session (%s); its temporary directories are left "
                    "alone. Two writers on one task interleave their checkpoints: give each run its own task_id.",
                    task_id, self.root, self.task_dir / _WRITER_LOCK,
                )
            if self.catalog.rebuilt:
                self.reindex()
            else:
                self.sync_catalog()

    # -- housekeeping ---------------------------------------------------------------------
    def close(self) -> None:
        """Close the catalog connection and release the writer lock (idempotent)."""
        self.catalog.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _acquire_writer_lock(self) -> bool:
        """Take the task's advisory writer lock (released by `close` or process death).

        Cleanup deletes temporary directories of *other* sessions; the lock makes sure none
        of them is still alive (e.g. a replacement job started before the old one died).
        """
        import fcntl

        self.task_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.task_dir / _WRITER_LOCK, "ab")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._lock_file = f
        return True

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _remove_leftovers(self) -> None:
        """Delete temporary directories of other sessions (interrupted saves and deletes)."""
        own = f"{TMP_MARKER}{self.session_id}"
        if not self.task_dir.is_dir():
            return
        for entry in self.task_dir.iterdir():
            if TMP_MARKER in entry.name and entry.name.startswith(STEP_DIR_PREFIX) and not entry.name.endswith(own):
                logger.info("removing leftover temporary directory %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
        if self.blobs_dir.is_dir():
            for entry in self.blobs_dir.iterdir():
                if TMP_MARKER in entry.name:
                    entry.unlink(missing_ok=True)

    def _committed_dirs(self, task_dir: Path | None = None) -> dict[int, Path]:
        task_dir = task_dir or self.task_dir
        out: dict[int, Path] = {}
        if task_dir.is_dir():
            for entry in task_dir.iterdir():
                step = parse_step_dir(entry.name)
                if step is not None and entry.is_dir():
                    out[step] = entry
        return out

    def _scan_task(self, task_id: str, task_dir: Path) -> list[CheckpointInfo]:
        infos = []
        for step, path in sorted(self._committed_dirs(task_dir).items()):
            try:
                infos.append(info_from_manifest(mf.read_manifest(path), path))
            except CheckpointNotFoundError:
                continue  # no manifest: not a checkpoint
            except (CorruptCheckpointError, FormatVersionError) as e:
                logger.warning("checkpoint %s has an unusable manifest: %s", path, e)
                infos.append(broken_info(task_id, step, path, STATUS_CORRUPT))
        return infos

    def sync_catalog(self) -> None:
        """Make this task's catalog rows agree with its directories.

        Adds rows for committed directories the catalog lacks (a crash between the rename
        and the catalog row) and marks rows whose directory is gone as ``"missing"``.
        Manifests of known rows are not re-read; `verify` checks content.
        """
        with self._lock:
            dirs = self._committed_dirs()
            rows = {r["step"]: r for r in self.catalog.rows(self.task_id)}
            for step, path in dirs.items():
                if step not in rows and (path / MANIFEST_NAME).exists():
                    self.catalog.upsert(self._scan_one(step, path), root=self.root)
            for step, row in rows.items():
                present = step in dirs and (dirs[step] / MANIFEST_NAME).exists()
                if not present and row["status"] != STATUS_MISSING:
                    self.catalog.set_status(self.task_id, step, STATUS_MISSING)
                elif present and row["status"] == STATUS_MISSING:
                    self.catalog.upsert(self._scan_one(step, dirs[step]), root=self.root)

    def _scan_one(self, step: int, path: Path) -> CheckpointInfo:
        try:
            return info_from_manifest(mf.read_manifest(path), path)
        except (CorruptCheckpointError, FormatVersionError):
            return broken_info(self.task_id, step, path, STATUS_CORRUPT)

    def reindex(self) -> int:
        """Rebuild the whole catalog (every task under `root`) from the manifests.

        Returns:
            `int`: number of rows written. Directories with a damaged manifest get a row
            with status ``"corrupt"``.
        """
        with self._lock:
            infos: list[CheckpointInfo] = []
            for task_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
                infos.extend(self._scan_task(task_dir.name, task_dir))
            n = self.catalog.replace_all(infos, root=self.root)
            logger.info("reindexed %s: %d checkpoints", self.root, n)
            return n

    # -- save -----------------------------------------------------------------------------
    def save(
        self,
        state: CheckpointState,
        *,
        reason: str,
        pinned: bool = False,
        healthy: bool = True,
        signals: Mapping[str, Any] | None = None,
        debug_info: list[Mapping[str, Any]] | None = None,
        timings: Mapping[str, Any] | None = None,
        replace: bool = False,
    ) -> CheckpointInfo | None:
        """Write this rank's part of a checkpoint; on rank 0, commit it once all ranks are done.

        Rank 0 writes weights (L0), optimizer/scheduler/scaler (L1) and the sampler state;
        every rank writes its own `rng-rank<R>.json`. Thread-safe; runs no collectives.

        Args:
            state (`CheckpointState`): CPU tensors and JSON-able state of this rank.
            reason (`str`): why this save happened (recorded in the manifest and catalog).
            pinned (`bool`, *optional*, defaults to `False`): retention never deletes it.
            healthy (`bool`, *optional*, defaults to `True`): `False` for states taken after
                an anomaly; `resolve("auto")` skips them.
            signals (`dict`, *optional*): signals at save time (`loss`, `grad_norm`, ...).
            debug_info (`list[dict]`, *optional*): recent steps; the last 10 are kept.
            timings (`dict`, *optional*): caller's timings in ms (e.g. snapshot time).
            replace (`bool`, *optional*, defaults to `False`): when `step` is already
                committed, replace it (e.g. the same step reached again after resuming from
                an older checkpoint) instead of returning the existing one. Pass the same
                value on every rank.

        Returns:
            `CheckpointInfo` on rank 0 (also when the step was committed before), `None`
            on other ranks once their files are durable.

        Raises:
            `DistributedError`: rank 0 waited `rank_timeout_s` for other ranks; nothing is committed.
            `SaveError`: writing failed; the previous checkpoints are untouched.
        """
        step = int(state.step)
        if step < 0:
            raise SaveError(f"step={step} is invalid: a checkpoint step must be >= 0.")
        with self._lock:
            final = self.task_dir / step_dir_name(step)
            if (final / MANIFEST_NAME).exists() and not replace:
                if self.rank != 0:
                    return None
                logger.info("step %d is already committed at %s; not rewritten", step, final)
                return self._existing_info(step, final)
            if not self.task_dir.is_dir():
                self.task_dir.mkdir(parents=True, exist_ok=True)
                fsync_dir(self.root)  # the task folder's own entry must survive a power loss too
            # Shared blob lock: blob collection (e.g. a delete in another process) is skipped meanwhile.
            with self._blob_lock(shared=True) if self.rank == 0 else contextlib.nullcontext(True):
                info = self._save_locked(state, step, final, reason=reason, pinned=pinned, healthy=healthy,
                                         signals=signals, debug_info=debug_info, timings=timings)
            if self._gc_pending:
                self._gc_pending = False
                self._gc_blobs()
            return info

    def _save_locked(self, state: CheckpointState, step: int, final: Path, *, reason: str, pinned: bool,
                     healthy: bool, signals: Mapping[str, Any] | None, debug_info: list[Mapping[str, Any]] | None,
                     timings: Mapping[str, Any] | None) -> CheckpointInfo | None:
        tmp = self.task_dir / f"{step_dir_name(step)}{TMP_MARKER}{self.session_id}"
        t0 = time.perf_counter()
        try:
            tmp.mkdir(exist_ok=True)
            files, blobs = write_rank_files(state, tmp, rank=self.rank, blobs_dir=self.blobs_dir,
                                            level=self.compression_level, threads=self.compression_threads,
                                            compression=self.compression)
            write_done(tmp, rank=self.rank, session_id=self.session_id, files=files, blobs=blobs, tiers=state.tiers)
        except Exception as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, SaveError):
                raise
            raise SaveError(
                f"saving step {step} of task {self.task_id!r} to {tmp} failed on rank {self.rank}: {e}; "
                "the previous checkpoints are untouched."
            ) from e
        if self.rank != 0:
            return None
        t_written = time.perf_counter()
        parts = wait_for_ranks(tmp, step=step, world_size=self.world_size, session_id=self.session_id,
                               timeout_s=self.rank_timeout_s)
        t_ranks = time.perf_counter()
        try:
            return self._commit(tmp, final, step, state, parts, reason=reason, pinned=pinned, healthy=healthy,
                                signals=signals, debug_info=debug_info,
                                timings={**dict(timings or {}),
                                         "write_ms": round(1000 * (t_written - t0), 2),
                                         "wait_ranks_ms": round(1000 * (t_ranks - t_written), 2)})
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SaveError(f"committing step {step} to {final} failed: {e}; the previous checkpoints are untouched.") from e

    def _existing_info(self, step: int, final: Path) -> CheckpointInfo:
        row = self.catalog.get(self.task_id, step)
        if row is not None:
            return Catalog.to_info(row, root=self.root)
        info = self._scan_one(step, final)
        self.catalog.upsert(info, root=self.root)
        return info

    def _commit(self, tmp: Path, final: Path, step: int, state: CheckpointState, parts: list[dict[str, Any]], *,
                reason: str, pinned: bool, healthy: bool, signals: Mapping[str, Any] | None,
                debug_info: list[Mapping[str, Any]] | None, timings: dict[str, Any]) -> CheckpointInfo:
        files, blobs, tiers = merge_rank_parts(tmp, parts)
        t0 = time.perf_counter()
        manifest = mf.build_manifest(
            task_id=self.task_id, step=step, epoch=state.epoch, reason=reason, tiers=tiers, pinned=pinned,
            healthy=healthy, world_size=self.world_size, files=files, blobs=blobs, session_id=self.session_id,
            signals=signals, debug_info=list(debug_info or []), extra=state.extra, timings=timings,
        )
        mf.write_manifest(tmp, manifest)
        fsync_dir(tmp)
        replaced = None
        if final.exists():  # replace=True, or a step-<N> dir left without a manifest: move it aside
            replaced = final.with_name(f"{final.name}{TMP_MARKER}replaced-{uuid.uuid4().hex[:8]}")
            os.rename(final, replaced)
        os.rename(tmp, final)  # the commit point
        fsync_dir(self.task_dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
            self._gc_pending = True  # its blobs are collected once this save released the blob lock
        info = info_from_manifest(manifest, final)
        self.catalog.upsert(info, root=self.root)
        logger.info("committed %s step %d (%s; tiers %s; %d bytes; commit %.1f ms)", self.task_id, step, reason,
                    ",".join(manifest["tiers"]), info.bytes, 1000 * (time.perf_counter() - t0))
        return info

    # -- lookup ---------------------------------------------------------------------------
    def list(self, include_unhealthy: bool = False) -> list[CheckpointInfo]:
        """Checkpoints of this task, newest first.

        Args:
            include_unhealthy (`bool`, *optional*, defaults to `False`): also list unhealthy
                checkpoints and rows whose status is ``"missing"`` or ``"corrupt"``.
        """
        out = []
        for row in self.catalog.rows(self.task_id):
            info = Catalog.to_info(row, root=self.root)
            if info.status == STATUS_OK and not (Path(info.path) / MANIFEST_NAME).exists():
                self.catalog.set_status(self.task_id, info.step, STATUS_MISSING)
                info = Catalog.to_info({**row, "status": STATUS_MISSING}, root=self.root)
            if include_unhealthy or (info.healthy and info.status == STATUS_OK):
                out.append(info)
        return out

    def _available_text(self) -> str:
        infos = self.list(include_unhealthy=True)
        if not infos:
            return f"the store has no checkpoints of task {self.task_id!r} under {self.root}"
        steps = ", ".join(f"{i.step}" + ("" if i.status == STATUS_OK and i.healthy else f" ({i.status if i.status != STATUS_OK else 'unhealthy'})")
                          for i in sorted(infos, key=lambda i: i.step))
        return f"available steps of task {self.task_id!r}: {steps}"

    def resolve(self, spec: str | int | os.PathLike[str] | CheckpointInfo) -> CheckpointInfo:
        """Turn a restore-point spec into a checkpoint.

        Args:
            spec (`str`, `int`, `os.PathLike` or `CheckpointInfo`): ``"auto"`` (newest healthy
                checkpoint with weights), ``"best"`` (lowest recorded loss), ``"fastest"``
                (lowest estimated recovery cost), ``"step:N"`` or ``N`` (that step, whatever
                its health), or the path of a checkpoint directory.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        if isinstance(spec, CheckpointInfo):
            return spec
        if isinstance(spec, int):
            return self._by_step(int(spec))
        text = os.fspath(spec)
        if text in _NAMED_SPECS:
            candidates = [i for i in self.list() if Tier.WEIGHTS in i.tiers]
            if text == "best":
                candidates = [i for i in candidates if i.loss is not None]
                if not candidates:
                    raise CheckpointNotFoundError(f"resolve('best'): no healthy checkpoint records a loss; {self._available_text()}.")
                return min(candidates, key=lambda i: (i.loss, -i.step))
            if not candidates:
                raise CheckpointNotFoundError(f"resolve({text!r}): no healthy committed checkpoint with weights; {self._available_text()}.")
            if text == "fastest":
                return min(candidates, key=lambda i: (i.recovery_cost_ms if i.recovery_cost_ms is not None else float("inf"), -i.step))
            return candidates[0]
        if text.startswith("step:") or text.isdigit():
            raw = text.removeprefix("step:")
            try:
                return self._by_step(int(raw))
            except ValueError as e:
                raise CheckpointNotFoundError(f"spec {text!r} is invalid: expected step:N with an integer N.") from e
        return self._by_path(Path(text))

    def _by_step(self, step: int) -> CheckpointInfo:
        row = self.catalog.get(self.task_id, step)
        path = self.task_dir / step_dir_name(step)
        if row is not None and (path / MANIFEST_NAME).exists():
            return Catalog.to_info(row, root=self.root)
        if (path / MANIFEST_NAME).exists():  # committed, catalog row not written yet
            info = self._scan_one(step, path)
            self.catalog.upsert(info, root=self.root)
            return info
        if row is not None:
            self.catalog.set_status(self.task_id, step, STATUS_MISSING)
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {self.task_dir}; {self._available_text()}.")

    def _by_path(self, path: Path) -> CheckpointInfo:
        path = path.absolute()
        if path.parent == self.task_dir and (step := parse_step_dir(path.name)) is not None:
            return self._by_step(step)
        if not path.is_dir():
            raise CheckpointNotFoundError(
                f"{path} is neither 'auto', 'best', 'fastest', 'step:N' nor an existing checkpoint directory; "
                f"{self._available_text()}."
            )
        if TMP_MARKER in path.name:
            raise CheckpointNotFoundError(f"{path} is an unfinished save (temporary directory), not a checkpoint; {self._available_text()}.")
        if not (path / MANIFEST_NAME).exists():
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint directory (no {MANIFEST_NAME}); pass a step-<N> directory of a store; "
                f"{self._available_text()}."
            )
        return info_from_manifest(mf.read_manifest(path), path)

    # -- verification ---------------------------------------------------------------------
    def _blobs_dir_of(self, info: CheckpointInfo) -> Path:
        return Path(info.path).parent / BLOBS_DIR

    def verify(self, ref: str | int | os.PathLike[str] | CheckpointInfo) -> builtins.list[str]:
        """Check a checkpoint completely: manifest, every file's size and checksum, blobs.

        Also records the outcome in the catalog (status ``"ok"``, ``"corrupt"`` or ``"missing"``).

        Args:
            ref: anything `resolve` accepts.

        Returns:
            `list[str]`: one line per problem; empty when the checkpoint is intact.
        """
        try:
            info = self.resolve(ref)
        except (CorruptCheckpointError, FormatVersionError) as e:  # a path whose manifest is unusable
            return [f"{MANIFEST_NAME}: {e}"]
        directory = Path(info.path)
        try:
            manifest = mf.read_manifest(directory)
        except CheckpointNotFoundError as e:
            self._set_status(info, STATUS_MISSING)
            return [f"{MANIFEST_NAME}: missing ({e})"]
        except (CorruptCheckpointError, FormatVersionError) as e:
            self._set_status(info, STATUS_CORRUPT)
            return [f"{MANIFEST_NAME}: {e}"]
        problems = structure_problems(manifest)
        problems += file_problems(directory, manifest, sorted(manifest[KEY_FILES]))
        problems += blob_problems(self._blobs_dir_of(info), manifest.get(KEY_BLOBS) or {})
        self._set_status(info, STATUS_CORRUPT if problems else STATUS_OK)
        return problems

    def _set_status(self, info: CheckpointInfo, status: str) -> None:
        if Path(info.path).parent == self.task_dir and info.task_id == self.task_id:
            self.catalog.set_status(self.task_id, info.step, status)

    # -- load -----------------------------------------------------------------------------
    def load(
        self,
        ref: str | int | os.PathLike[str] | CheckpointInfo,
        *,
        tiers: Collection[Tier] = ALL_TIERS,
        rank: int | None = None,
        mmap: bool = True,
    ) -> LoadedCheckpoint:
        """Verify, then read the requested tiers of a checkpoint.

        Every file read is checked (size, checksum; blobs by content digest) before any
        tensor is returned. A tier the checkpoint does not hold is left `None` with a
        note in `warnings`.

        Args:
            ref: anything `resolve` accepts (``"auto"``, ``"step:N"``, a path, ...).
            tiers (`Collection[Tier]`, *optional*, defaults to all tiers): what to read.
            rank (`int`, *optional*): whose RNG file to read; defaults to this store's rank.
            mmap (`bool`, *optional*, defaults to `True`): weights backed by a read-only
                memory map (no copy); `False` reads them into memory.

        Returns:
            `LoadedCheckpoint`.

        Raises:
            `CheckpointNotFoundError`: `ref` names no committed checkpoint.
            `CorruptCheckpointError`: a needed file is missing, truncated or altered (the
                message lists each problem), or the manifest is damaged.
            `FormatVersionError`: the checkpoint was written by a newer format.
        """
        info = self.resolve(ref)
        rank = self.rank if rank is None else rank
        directory = Path(info.path)
        try:
            manifest = mf.read_manifest(directory)
        except CheckpointNotFoundError:
            self._set_status(info, STATUS_MISSING)
            raise
        except CorruptCheckpointError:
            self._set_status(info, STATUS_CORRUPT)
            raise
        wanted = {Tier(t) for t in tiers}
        held = mf.tiers_of(manifest)
        loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(KEY_EXTRA) or {}))
        for tier in sorted(wanted - held):
            loaded.warnings.append(f"step {info.step} has no {tier.value} tier (saved tiers: {', '.join(sorted(t.value for t in held)) or 'none'})")
        wanted &= held
        names = files_for(manifest, wanted, rank, loaded.warnings, step=info.step)
        problems = file_problems(directory, manifest, names)
        if Tier.WEIGHTS in wanted:
            if WEIGHTS_NAME not in manifest[KEY_FILES]:
                problems.append(f"tier weights is recorded but {WEIGHTS_NAME} is not listed")
            problems += blob_problems(self._blobs_dir_of(info), manifest.get(KEY_BLOBS) or {})
        if problems:
            self._set_status(info, STATUS_CORRUPT)
            raise CorruptCheckpointError(
                f"checkpoint {directory} failed verification, nothing was loaded: " + "; ".join(problems)
                + ". Restore another checkpoint (restore.load_for_resume falls back automatically)."
            )
        read_tiers(directory, manifest, wanted, names, loaded, rank=rank, mmap=mmap, blobs_dir=self._blobs_dir_of(info))
        return loaded

    def load_scheduler_only(self, ref: str | int | os.PathLike[str] | CheckpointInfo) -> dict[str, Any] | None:
        """Salvage the LR-scheduler state when the optimizer tensor file is broken.

        The scheduler state holds no tensors, so it lives entirely in the verified
        `optimizer.json`; returns `None` when that file is broken too or holds tensors refs.
        """
        from .tensorpack import unflatten_state

        info = self.resolve(ref)
        directory = Path(info.path)
        manifest = mf.read_manifest(directory)
        if OPTIMIZER_META_NAME not in manifest[KEY_FILES] or file_problems(directory, manifest, [OPTIMIZER_META_NAME]):
            return None
        structure = read_json(directory / OPTIMIZER_META_NAME)
        try:
            sched = unflatten_state(structure.get("scheduler"), {})
        except (CorruptCheckpointError, AttributeError):
            return None
        return sched if isinstance(sched, dict) else None

    # -- management -----------------------------------------------------------------------
    def pin(self, ref: str | int | os.PathLike[str] | CheckpointInfo) -> CheckpointInfo:
        """Protect a checkpoint from retention (writes a `PINNED` marker next to the manifest)."""
        with self._lock:
            info = self.resolve(ref)
            marker = Path(info.path) / PINNED_MARKER
            with open(marker, "wb") as f:
                fsync_file(f)
            fsync_dir(marker.parent)
            self._set_pinned(info)
            row = self._row_of(info)
            return Catalog.to_info({**row, "pinned": 1}, root=self.root) if row is not None else info

    def _row_of(self, info: CheckpointInfo) -> dict[str, Any] | None:
        return self.catalog.get(info.task_id, info.step) if Path(info.path).parent == self.task_dir else None

    def _set_pinned(self, info: CheckpointInfo) -> None:
        if Path(info.path).parent == self.task_dir:
            self.catalog.set_pinned(self.task_id, info.step, True)

    def delete(self, ref: str | int | os.PathLike[str] | CheckpointInfo, *, tiers: Collection[Tier] | None = None,
               force: bool = False) -> None:
        """Delete a checkpoint, or only some of its tiers.

        A whole checkpoint is first renamed to a temporary name (one atomic step, so a crash
        never leaves half a checkpoint that looks committed), then removed; blobs no other
        checkpoint references are removed too. Deleting tiers rewrites the manifest
        atomically before the files go.

        Args:
            ref: anything `resolve` accepts.
            tiers (`Collection[Tier]`, *optional*): only these tiers (e.g. `{Tier.OPTIMIZER}`).
            force (`bool`, *optional*, defaults to `False`): also delete a pinned checkpoint.

        Raises:
            `DynamicCkptError`: the checkpoint is pinned and `force` is not set.
        """
        with self._lock:
            info = self.resolve(ref)
            if info.pinned and not force:
                raise DynamicCkptError(f"step {info.step} ({info.path}) is pinned; pass force=True to delete it anyway.")
            path = Path(info.path)
            if tiers is not None and set(tiers) != set(ALL_TIERS) and set(info.tiers) - set(tiers):
                self._delete_tiers(info, {Tier(t) for t in tiers})
                return
            trash = path.with_name(f"{path.name}{TMP_MARKER}deleted-{uuid.uuid4().hex[:8]}")
            os.rename(path, trash)
            fsync_dir(path.parent)
            if path.parent == self.task_dir:
                self.catalog.remove(self.task_id, info.step)
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("deleted %s step %d", info.task_id, info.step)
            self._gc_blobs()

    def _delete_tiers(self, info: CheckpointInfo, tiers: set[Tier]) -> None:
        path = Path(info.path)
        new, drop = mf.without_tiers(mf.read_manifest(path), tiers)
        mf.write_manifest(path, new, name=MANIFEST_NAME + ".new")
        os.replace(path / (MANIFEST_NAME + ".new"), path / MANIFEST_NAME)
        fsync_dir(path)
        for name in drop:
            (path / name).unlink(missing_ok=True)
        if path.parent == self.task_dir:
            self.catalog.upsert(info_from_manifest(new, path), root=self.root)
        logger.info("deleted tiers %s of %s step %d", sorted(t.value for t in tiers), info.task_id, info.step)
        self._gc_blobs()

    @contextlib.contextmanager
    def _blob_lock(self, *, shared: bool) -> Iterator[bool]:
        """Cross-process lock between saves (shared, waits) and blob collection (exclusive, never waits).

        A save writes or references blobs before its manifest exists; without the lock a
        `delete` in another process (e.g. the process-mode writer) could collect them in
        between. Yields whether the lock was obtained (always `True` when shared).
        """
        import fcntl

        self.task_dir.mkdir(parents=True, exist_ok=True)
        with open(self.task_dir / _BLOBS_LOCK, "ab") as f:  # closing the file releases the lock
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield True

    def _gc_blobs(self) -> None:
        """Remove blobs no committed checkpoint of this task references (skipped while a save runs)."""
        if not self.blobs_dir.is_dir():
            return
        with self._blob_lock(shared=False) as locked:
            if not locked:
                logger.debug("blob collection of %s skipped: a save is in progress", self.task_dir)
                return
            self._gc_blobs_locked()

    def _gc_blobs_locked(self) -> None:
        used: set[str] = set()
        for path in self._committed_dirs().values():
            try:
                manifest = mf.read_manifest(path)
            except CheckpointNotFoundError:
                continue
            except (CorruptCheckpointError, FormatVersionError):
                logger.warning("not collecting blobs: %s has an unreadable manifest", path)
                return
            used.update(str(b.get("digest")) for b in (manifest.get(KEY_BLOBS) or {}).values())
        for entry in self.blobs_dir.iterdir():
            digest = entry.name.split(".")[0]
            if TMP_MARKER not in entry.name and digest not in used:
                entry.unlink(missing_ok=True)

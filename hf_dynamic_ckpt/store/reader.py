"""Reading checkpoints back: `load`, `load_scheduler_only` and `verify` of a resolved checkpoint of a `Task`.

Nothing is handed out before it is verified: the manifest (its checksum, its step and task
against the directory, an allowlist of file names), every file's size and checksum, every
blob's content digest. A failed check or read is retried once, so a transient I/O error
does not cost a checkpoint; after that the checkpoint is marked ``"corrupt"`` in the
catalog and `CorruptCheckpointError` lets the caller fall back to another one.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..constants import (
    ALL_TIERS,
    BLOBS_DIR,
    KEY_EXTRA,
    KEY_FILES,
    MANIFEST_NAME,
    OPTIMIZER_META_NAME,
    WEIGHTS_NAME,
    Tier,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, DynamicCkptError
from . import manifest as mf
from .blobs import BlobStore
from .catalog import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK
from .fs import LocalFS
from .layout import (
    HASHED_ON_READ,
    blob_problems,
    file_problems,
    files_for,
    read_json,
    read_tiers,
    structure_problems,
)
from .shard_files import is_sharded
from .task import Task, parse_step_dir
from .types import CheckpointInfo, LoadedCheckpoint

logger = logging.getLogger(__name__)


def _blobs_of(task: Task, directory: Path) -> BlobStore:
    if task.owns(directory) is not None:
        return task.blobs
    return BlobStore(directory.parent / BLOBS_DIR, LocalFS(directory.parent))


def _manifest(task: Task, info: CheckpointInfo) -> dict[str, Any]:
    directory = Path(info.path)
    remote = task.remote
    if remote is not None and task.owns(directory) is not None and task.fs.is_dir(directory):
        from .remote_sync import materialize

        try:  # files of a checkpoint saved elsewhere come into the cache before they are verified
            materialize(task, remote, info.step)
        except OSError as e:
            raise CorruptCheckpointError(f"step {info.step} could not be downloaded from {remote.spec.shown}: "
                                         f"{e}") from e
    try:
        if task.owns(directory) is not None:
            return task.read_manifest(info.step)
        return mf.read_manifest(directory, step=parse_step_dir(directory.name))
    except CheckpointNotFoundError:
        _set_status(task, info, STATUS_MISSING)
        raise
    except CorruptCheckpointError:
        _set_status(task, info, STATUS_CORRUPT)
        raise


def _set_status(task: Task, info: CheckpointInfo, status: str) -> None:
    if task.owns(info.path) is not None:
        task.set_status(info.step, status)


def load(task: Task, info: CheckpointInfo, *, tiers: Collection[Tier] = ALL_TIERS, rank: int,
         mmap: bool = True, l1_max_numel: int | None = None) -> LoadedCheckpoint:
    """Verify, then read the requested tiers of `info` (`CheckpointStore.load` documents the arguments)."""
    directory = Path(info.path)
    manifest = _manifest(task, info)
    wanted = {Tier(t) for t in tiers}
    held = mf.tiers_of(manifest)
    loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(KEY_EXTRA) or {}))
    for tier in sorted(wanted - held):
        saved = ", ".join(sorted(t.value for t in held)) or "none"
        loaded.warnings.append(f"step {info.step} has no {tier.value} tier (saved tiers: {saved})")
    wanted &= held
    names = files_for(manifest, wanted, rank, loaded.warnings, step=info.step)
    blobs = _blobs_of(task, directory)

    def problems() -> list[str]:
        found = file_problems(directory, manifest, names, hashed_on_read=HASHED_ON_READ)
        if Tier.WEIGHTS in wanted and not is_sharded(manifest):  # a sharded one: weights-rank<R> files
            if WEIGHTS_NAME not in manifest[KEY_FILES]:
                found.append(f"tier weights is recorded but {WEIGHTS_NAME} is not listed")
            found += blob_problems(blobs, manifest.get("blobs") or {})
        return found

    for attempt in (1, 2):
        found = problems()
        if not found:
            try:
                read_tiers(directory, manifest, wanted, names, loaded, rank=rank, mmap=mmap, blobs=blobs,
                           l1_max_numel=l1_max_numel)
                return loaded
            except (CorruptCheckpointError, OSError) as e:
                found = [str(e)]
                _forget_tiers(loaded)  # the retry (or the caller's fallback) must not hold this attempt's tensors
        if attempt == 1:
            logger.debug("step %d: %s; reading it once more before giving up", info.step, "; ".join(found))
    _set_status(task, info, STATUS_CORRUPT)
    raise CorruptCheckpointError(
        f"checkpoint {directory} failed verification, nothing was loaded: " + "; ".join(p.rstrip(".") for p in found)
        + ". Restore another checkpoint (a resume falls back automatically)."
    )


def _forget_tiers(loaded: LoadedCheckpoint) -> None:
    """Drop whatever tiers a failed read already put into `loaded`."""
    loaded.weights = loaded.optimizer = loaded.scheduler = loaded.scaler = loaded.rng = loaded.sampler = None


def load_scheduler_only(task: Task, info: CheckpointInfo) -> dict[str, Any] | None:
    """The LR-scheduler state of `info` from its verified `optimizer.json`, or `None` (never raises for damage)."""
    from .statetree import unflatten_state

    try:
        directory = Path(info.path)
        manifest = _manifest(task, info)
        if OPTIMIZER_META_NAME not in manifest[KEY_FILES] or file_problems(directory, manifest, [OPTIMIZER_META_NAME]):
            return None
        structure = read_json(directory / OPTIMIZER_META_NAME)
        sched = unflatten_state(structure.get("scheduler"), {}) if isinstance(structure, dict) else None
    except (DynamicCkptError, OSError):
        return None
    return sched if isinstance(sched, dict) else None


def verify(task: Task, info: CheckpointInfo) -> list[str]:
    """Every problem of `info` (manifest, files, blobs), recorded in the catalog (`CheckpointStore.verify`).

    Raises:
        `CheckpointNotFoundError`: the checkpoint was deleted before or while it was verified.
    """
    directory = Path(info.path)
    gone = CheckpointNotFoundError(f"step {info.step} ({directory}) was deleted before or while it was verified "
                                   "(retention or gc removed it); nothing to verify.")
    try:
        manifest = _manifest(task, info)
    except CheckpointNotFoundError as e:
        if task.fs.lstat(directory) is None:
            raise gone from e
        return [f"{MANIFEST_NAME}: missing ({e})"]
    except (CorruptCheckpointError, ValueError) as e:
        return [f"{MANIFEST_NAME}: {e}"]
    blobs = _blobs_of(task, directory)
    for attempt in (1, 2):
        found = structure_problems(manifest) + file_problems(directory, manifest, sorted(manifest[KEY_FILES]))
        found += blob_problems(blobs, manifest.get("blobs") or {})
        if found and task.fs.lstat(directory / MANIFEST_NAME) is None:
            _set_status(task, info, STATUS_MISSING)
            raise gone
        if not found or attempt == 2:
            break
    _set_status(task, info, STATUS_CORRUPT if found else STATUS_OK)
    return found

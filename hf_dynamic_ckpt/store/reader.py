"""Reading checkpoints back: `load`, `load_scheduler_only` and `verify` of `CheckpointStore` (a mixin).

Nothing is handed out before it is verified: the manifest (its checksum, its step and task
against the directory, an allowlist of file names), every file's size and checksum, every
blob's content digest. A failed check or read is retried once, so a transient I/O error
does not cost a checkpoint; after that the checkpoint is marked ``"corrupt"`` in the
catalog and `CorruptCheckpointError` lets the caller fall back to another one.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from .task import parse_step_dir
from .types import CheckpointInfo, LoadedCheckpoint

if TYPE_CHECKING:
    from .task import Task

logger = logging.getLogger(__name__)

Ref = str | int | os.PathLike[str] | CheckpointInfo


class Reader:
    """`load` / `verify` over `self.task`, `self.fs`, `self.blobs`; `self.resolve` finds the checkpoint."""

    task: Task
    fs: LocalFS
    blobs: BlobStore
    rank: int

    if TYPE_CHECKING:
        def resolve(self, spec: Any) -> CheckpointInfo: ...  # provided by `lookup.Lookup`

    # -- load -----------------------------------------------------------------------------------
    def _blobs_of(self, directory: Path) -> BlobStore:
        if self.task.owns(directory) is not None:
            return self.blobs
        return BlobStore(directory.parent / BLOBS_DIR, LocalFS(directory.parent))

    def _manifest(self, info: CheckpointInfo) -> dict[str, Any]:
        directory = Path(info.path)
        remote = getattr(self.task, "remote", None)
        if remote is not None and self.task.owns(directory) is not None and self.fs.is_dir(directory):
            from .remote_sync import materialize

            try:  # files of a checkpoint saved elsewhere come into the cache before they are verified
                materialize(self.task, remote, info.step)
            except OSError as e:
                raise CorruptCheckpointError(f"step {info.step} could not be downloaded from {remote.spec.shown}: "
                                             f"{e}") from e
        try:
            if self.task.owns(directory) is not None:
                return self.task.read_manifest(info.step)
            return mf.read_manifest(directory, step=parse_step_dir(directory.name))
        except CheckpointNotFoundError:
            self._set_status(info, STATUS_MISSING)
            raise
        except CorruptCheckpointError:
            self._set_status(info, STATUS_CORRUPT)
            raise

    def _set_status(self, info: CheckpointInfo, status: str) -> None:
        if self.task.owns(info.path) is not None:
            self.task.set_status(info.step, status)

    def load(self, ref: Ref, *, tiers: Collection[Tier] = ALL_TIERS, rank: int | None = None,
             mmap: bool = True, l1_max_numel: int | None = None) -> LoadedCheckpoint:
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
        rank = self.rank if rank is None else rank
        directory = Path(info.path)
        manifest = self._manifest(info)
        wanted = {Tier(t) for t in tiers}
        held = mf.tiers_of(manifest)
        loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(KEY_EXTRA) or {}))
        for tier in sorted(wanted - held):
            loaded.warnings.append(f"step {info.step} has no {tier.value} tier (saved tiers: {', '.join(sorted(t.value for t in held)) or 'none'})")
        wanted &= held
        names = files_for(manifest, wanted, rank, loaded.warnings, step=info.step)
        blobs = self._blobs_of(directory)

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
            if attempt == 1:
                logger.debug("step %d: %s; reading it once more before giving up", info.step, "; ".join(found))
        self._set_status(info, STATUS_CORRUPT)
        raise CorruptCheckpointError(
            f"checkpoint {directory} failed verification, nothing was loaded: " + "; ".join(p.rstrip(".") for p in found)
            + ". Restore another checkpoint (restore.load_for_resume falls back automatically)."
        )

    def load_scheduler_only(self, ref: Ref) -> dict[str, Any] | None:
        """Salvage the LR-scheduler state when the optimizer tensor file is broken.

        The scheduler state holds no tensors, so it lives entirely in the verified
        `optimizer.json`. Never raises for a damaged checkpoint: returns `None` when that
        file is missing, altered, not JSON, or refers to tensors.
        """
        from .statetree import unflatten_state

        try:
            info = self.resolve(ref)
            directory = Path(info.path)
            manifest = self._manifest(info)
            if OPTIMIZER_META_NAME not in manifest[KEY_FILES] or file_problems(directory, manifest, [OPTIMIZER_META_NAME]):
                return None
            structure = read_json(directory / OPTIMIZER_META_NAME)
            sched = unflatten_state(structure.get("scheduler"), {}) if isinstance(structure, dict) else None
        except (DynamicCkptError, OSError):
            return None
        return sched if isinstance(sched, dict) else None

    # -- verification ---------------------------------------------------------------------------
    def verify(self, ref: Ref) -> builtins.list[str]:
        """Check a checkpoint completely: manifest, every file's size and checksum, blobs.

        Records the outcome in the catalog (status ``"ok"``, ``"corrupt"`` or ``"missing"``).
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
        directory = Path(info.path)
        gone = CheckpointNotFoundError(f"step {info.step} ({directory}) was deleted before or while it was verified "
                                       "(retention or gc removed it); nothing to verify.")
        try:
            manifest = self._manifest(info)
        except CheckpointNotFoundError as e:
            if self.fs.lstat(directory) is None:
                raise gone from e
            return [f"{MANIFEST_NAME}: missing ({e})"]
        except (CorruptCheckpointError, ValueError) as e:
            return [f"{MANIFEST_NAME}: {e}"]
        blobs = self._blobs_of(directory)
        for attempt in (1, 2):
            found = structure_problems(manifest) + file_problems(directory, manifest, sorted(manifest[KEY_FILES]))
            found += blob_problems(blobs, manifest.get("blobs") or {})
            if found and self.fs.lstat(directory / MANIFEST_NAME) is None:
                self._set_status(info, STATUS_MISSING)
                raise gone
            if not found or attempt == 2:
                break
        self._set_status(info, STATUS_CORRUPT if found else STATUS_OK)
        return found

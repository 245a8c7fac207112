"""Keeping a task tidy: leftovers and replace recovery, deletion, retention application
(`prune`), abandoned timelines and blob collection (`gc`), and the pins that keep a checkpoint
from all of them (`pin`, `unpin`). The catalog's reconciliation with the manifests is
`Catalog.sync` (through `Task.sync`), not here.

A pinned checkpoint has a `PINNED` marker next to its manifest, or was saved with ``pinned`` in
its manifest; retention and `gc` never delete it. For URL roots the marker is mirrored to the
object store.

Rules every function here follows:

- Decisions are taken from disk, not from the catalog: a checkpoint is re-read (manifest,
  `PINNED` marker, timelines record) right before it is deleted, and kept when what is on
  disk no longer matches what the caller planned with.
- Every change goes through the storage seam (`fs.LocalFS`), which refuses paths outside
  the store root and symbolic links.
- Temporary directories of other sessions and leftovers are removed only by the task's
  writer (the caller holds the writer lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from ..constants import (
    ALL_TIERS,
    ASIDE_SUFFIX,
    KEY_PINNED,
    MANIFEST_NAME,
    PINNED_MARKER,
    STEP_DIR_PREFIX,
    TIMELINES_NAME,
    TMP_MARKER,
    Tier,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from . import manifest as mf
from .task import Task, parse_step_dir
from .types import CheckpointInfo, GcReport, Removal

logger = logging.getLogger(__name__)


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (links are not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size
    return total


# -- leftovers --------------------------------------------------------------------------------
def _restore_replaced(task: Task, name: str) -> None:
    """Undo a replace-commit cut between its two renames: put the set-aside copy back."""
    step = parse_step_dir(name.split(TMP_MARKER)[0])
    final = task.step_dir(step) if step is not None else None
    if final is None or task.fs.lstat(final) is not None:
        return
    aside = task.dir / name
    try:
        task.read_manifest(step, aside)  # type: ignore[arg-type]
    except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError) as e:
        logger.error("step %s: the copy set aside by an interrupted replace (%s) is unusable (%s); left in place",
                     step, aside, e)
        return
    task.fs.rename(aside, final)
    task.fs.fsync_dir(task.dir)
    logger.warning("step %d: a replace-commit was interrupted between its renames; the previous copy is restored "
                   "(%s -> %s)", step, aside.name, final.name)


def remove_leftovers(task: Task, *, dry_run: bool = False) -> list[tuple[str, int]]:
    """Finish what interrupted saves, replace-commits and deletes left behind (the writer only).

    A copy set aside by a replace-commit whose step has no committed directory is renamed
    back (the interrupted save never completed); then every temporary entry of other
    sessions is removed (this session's own ``step-<N>.tmp-<session>`` is kept: other ranks
    may be writing into it), and stray blob and record temp files.

    Returns:
        `list[tuple[str, int]]`: (name, bytes) of each temporary entry removed (or that would be).
    """
    fs = task.fs
    names = fs.listdir(task.dir)
    if not dry_run:
        for name in names:
            if name.startswith(STEP_DIR_PREFIX) and TMP_MARKER in name and name.endswith(ASIDE_SUFFIX):
                _restore_replaced(task, name)
        names = fs.listdir(task.dir)
    own = f"{TMP_MARKER}{task.spec.session_id}"
    removed = []
    for name in names:
        path = task.dir / name
        kept_aside = name.endswith(ASIDE_SUFFIX) and fs.lstat(task.dir / name.split(TMP_MARKER)[0]) is None
        leftover = (name.startswith(STEP_DIR_PREFIX) and TMP_MARKER in name and not name.endswith(own)) or \
            name.startswith(f".{TIMELINES_NAME}{TMP_MARKER}")
        if not leftover or kept_aside:
            continue
        removed.append((name, tree_bytes(path) if fs.is_dir(path) else 0))
        if dry_run:
            continue
        logger.debug("removing leftover temporary entry %s", path)
        try:
            fs.rmtree(path) if fs.is_dir(path) else fs.unlink(path)  # a planted link goes, never its target
        except OSError as e:
            logger.warning("could not remove leftover %s: %s", path, e)
    if not dry_run:
        task.blobs.remove_temps()
    return removed


# -- deletion ---------------------------------------------------------------------------------
def delete_checkpoint(task: Task, info: CheckpointInfo, tiers: Collection[Tier] | None = None) -> int:
    """Delete a checkpoint of this task (or some tiers of it); returns the bytes freed.

    A whole checkpoint is first renamed to a temporary name (one atomic step, so a crash
    never leaves half a checkpoint that looks committed), then removed. Deleting tiers
    rewrites the manifest atomically before the files go. Blobs are not collected here.
    """
    path = task.step_dir(info.step)
    if tiers is not None and set(tiers) != set(ALL_TIERS) and set(info.tiers) - set(tiers):
        new, drop = mf.without_tiers(task.read_manifest(info.step), tiers)
        _replace_manifest(task, path, new)
        task.fs.fsync_dir(path)
        freed = 0
        for name in drop:  # allowlisted single names (manifest validation)
            st = task.fs.lstat(path / name)
            freed += st.st_size if st is not None else 0
            task.fs.unlink(path / name)
        task.record(task.info_of(new, path))
        if task.remote is not None:
            from .remote_sync import mirror_step

            mirror_step(task, task.remote, info.step)
        logger.debug("deleted tiers %s of %s step %d", sorted(Tier(t).value for t in tiers), task.task_id, info.step)
        return freed
    if task.remote is not None:  # the object store first: its manifest goes, so no reader counts it any more
        from .remote_sync import remove_step

        remove_step(task.remote, info.step)
    trash = task.trash_dir(info.step)
    task.fs.rename(path, trash)
    task.fs.fsync_dir(task.dir)
    task.forget(info.step)
    freed = tree_bytes(trash)
    task.fs.rmtree(trash)
    logger.debug("deleted %s step %d", task.task_id, info.step)
    return freed


def _replace_manifest(task: Task, path: Path, manifest: dict[str, Any]) -> None:
    """Rewrite the manifest of the checkpoint at `path` atomically (written next to it, renamed over it)."""
    mf.write_manifest(path, manifest, name=MANIFEST_NAME + ".new")
    task.fs.replace(path / (MANIFEST_NAME + ".new"), path / MANIFEST_NAME)


def used_digests(task: Task) -> set[str] | None:
    """Digests every committed checkpoint (and any copy set aside) references; `None` if a manifest is unreadable."""
    used: set[str] = set()
    dirs = list(task.committed().items())
    for name in task.fs.listdir(task.dir):
        if name.endswith(ASIDE_SUFFIX) and (step := parse_step_dir(name.split(TMP_MARKER)[0])) is not None:
            dirs.append((step, task.dir / name))
    for step, path in dirs:
        try:
            manifest = task.read_manifest(step, path)
        except CheckpointNotFoundError:
            continue
        except (CorruptCheckpointError, FormatVersionError):
            logger.warning("not collecting blobs: %s has an unreadable manifest", path)
            return None
        used.update(str(b.get("digest")) for b in (manifest.get("blobs") or {}).values())
    return used


def collect_blobs(task: Task, report: GcReport) -> None:
    used = used_digests(task)
    if used is None:
        report.kept.append("blobs: not collected, a manifest of this task is unreadable")
        return
    for name, size in task.blobs.collect(used, dry_run=report.dry_run):
        report.blobs.append(name)
        report.bytes_freed += size
    if task.remote is not None:
        from .remote_sync import collect_blobs as collect_remote

        with task.blobs.lock(shared=False) if not report.dry_run else contextlib.nullcontext(True) as locked:
            if locked:  # not while a save (which uploads its blobs before its manifest) is in flight
                collect_remote(task, task.remote, report)


# -- retention and gc -------------------------------------------------------------------------
def removable_abandoned(task: Task, infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """Abandoned, unpinned checkpoints the current timeline has committed past."""
    current = task.timelines.current()
    infos = list(infos)
    if current is None:
        return []
    ours = [i.step for i in infos
            if not i.abandoned and i.lineage is not None and i.lineage.timeline == current["timeline"]]
    top = max(ours, default=None)
    return [i for i in infos if i.abandoned and not i.pinned and top is not None and i.step < top]


def apply_plan(task: Task, plan: Iterable[Removal], report: GcReport) -> None:
    """Delete what a retention plan names, each entry re-verified from disk first; each removal is recorded with
    its rule (`Task.note_removed`)."""
    for planned, tiers, rule in plan:
        fresh = task.scan(planned.step)
        why = None
        if fresh is None:
            why = "is gone"
        elif fresh.save_time != planned.save_time:
            why = "was replaced since the plan was made"
        elif fresh.pinned:
            why = "is pinned on disk"
        elif fresh.abandoned:
            why = "is abandoned (removed by the abandoned-timeline rule)"
        elif fresh.healthy != planned.healthy:
            why = f"is {'healthy' if fresh.healthy else 'unhealthy'} on disk, unlike the catalog the plan read"
        if why is not None:
            report.kept.append(f"step {planned.step} kept: it {why}")
            if fresh is not None:
                task.record(fresh)
            continue
        assert fresh is not None
        whole = Tier.WEIGHTS in tiers or not set(fresh.tiers) - set(tiers)
        if not report.dry_run:
            report.bytes_freed += delete_checkpoint(task, fresh, None if whole else tiers)
        else:
            report.bytes_freed += tree_bytes(task.step_dir(fresh.step))
        if whole:
            report.removed.append(fresh.step)
        else:
            report.trimmed[fresh.step] = sorted(Tier(t).value for t in tiers)
        if not report.dry_run:
            task.note_removed(fresh.step, fresh.tiers if whole else tiers, rule)


def remove_abandoned(task: Task, report: GcReport) -> None:
    infos = task.scan_all()
    for info in removable_abandoned(task, infos):
        report.bytes_freed += tree_bytes(task.step_dir(info.step)) if report.dry_run else delete_checkpoint(task, info)
        report.removed.append(info.step)
        report.abandoned.append(info.step)
        if not report.dry_run:
            task.note_removed(info.step, info.tiers, "abandoned timeline: the run went back before it and has "
                                                     "saved past it since")
    for info in infos:
        if info.abandoned and info.pinned:
            report.kept.append(f"step {info.step} kept: abandoned but pinned")
        elif info.abandoned and info.step not in report.abandoned:
            report.kept.append(f"step {info.step} kept: abandoned, the current timeline has not passed it yet")


# -- pins -------------------------------------------------------------------------------------
def pin(task: Task, info: CheckpointInfo) -> CheckpointInfo:
    """Write the `PINNED` marker of `info` (fsynced), mirror it, record it; returns the pinned info.

    The caller holds the store's lock and passes the checkpoint as its directory describes it now
    (`CheckpointStore` re-reads it before `pin` and `unpin`)."""
    marker = Path(info.path) / PINNED_MARKER
    with task.fs.create(marker) as f:
        os.fsync(f.fileno())
    task.fs.fsync_dir(marker.parent)
    if task.remote is not None:
        from .remote_sync import mirror_step

        mirror_step(task, task.remote, info.step)
    info = dataclasses.replace(info, pinned=True)
    task.record(info)
    return info


def unpin(task: Task, info: CheckpointInfo) -> CheckpointInfo:
    """Remove the marker of `info` and a pin requested at save time (the manifest is rewritten atomically)."""
    path = Path(info.path)
    manifest = task.read_manifest(info.step)
    if manifest.get(KEY_PINNED):
        _replace_manifest(task, path, mf.with_changes(manifest, {KEY_PINNED: False}))
    task.fs.unlink(path / PINNED_MARKER)
    task.fs.fsync_dir(path)
    if task.remote is not None:
        from .remote_sync import mirror_step

        mirror_step(task, task.remote, info.step)
    info = task.scan(info.step) or info
    task.record(info)
    return info

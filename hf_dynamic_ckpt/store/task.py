"""`Task`: one task directory of a store, and how its checkpoints are named, found and read back.

Every path is derived from a step (``<root>/<task>/step-<N>``), never read from the
catalog or a manifest; a directory counts only if it is a real directory (a symbolic link
named like a checkpoint is ignored with a warning); its manifest must name the same step
and task as the directory. Temporary names all contain ``TMP_MARKER`` so readers skip them:

    step-<N>.tmp-<session>                      a save in progress (or an interrupted one)
    step-<N>.tmp-<session>.replaced             the old copy, set aside during a replace-commit
    step-<N>.tmp-<session>.deleted-<random>     a checkpoint being deleted

Finding (`Task.checkpoints`, `Task.resolve`): the catalog makes listing cheap, but it never
decides alone. Each lookup first syncs the catalog with the manifests (`Task.sync`): a row whose
directory lost its manifest is marked ``"missing"``, and a flag that would hide a checkpoint
(unhealthy, corrupt, missing) is re-read from disk before the checkpoint is left out. Abandoned
checkpoints (the timelines record) are never chosen by ``auto``/``best``/``fastest`` but are
listed with ``include_abandoned`` and found by ``step:N`` or path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..constants import (
    ASIDE_SUFFIX,
    BLOBS_DIR,
    MANIFEST_NAME,
    REMOVED_LOG_NAME,
    STEP_DIR_PREFIX,
    TMP_MARKER,
    TRASH_INFIX,
    Tier,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from ..jsonutil import loads_bounded
from . import manifest as mf
from .blobs import BlobStore
from .catalog import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK, Catalog
from .fs import LocalFS, listdir
from .remote import Remote
from .spec import StoreSpec
from .tensorpack import PaceMemory
from .timelines import Timelines, key_of
from .types import CheckpointInfo

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(rf"^{re.escape(STEP_DIR_PREFIX)}(0|[1-9][0-9]*)$")

NAMED_REFS = ("auto", "best", "fastest")
"""Specs `Task.resolve` answers by ranking the healthy checkpoints (the others name one checkpoint)."""


def step_dir_name(step: int) -> str:
    """``step-<N>``, the directory name of the committed checkpoint of `step`."""
    return f"{STEP_DIR_PREFIX}{int(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed directory name (``step-12`` -> 12), else `None`."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class Task:
    """The checkpoints of one task: paths, manifests, catalog rows, timelines, blobs.

    Args:
        spec (`StoreSpec`): the store's spec (root, task, rank, session, ...).
        fs (`LocalFS`): the storage seam rooted at the store root.
        catalog (`Catalog`): the index (a file, or in memory for read-only stores).
        read_only (`bool`): never write to the catalog file either.
        remote (`Remote`, *optional*): the object-store copy of the task when the root is a URL.
    """

    def __init__(self, spec: StoreSpec, fs: LocalFS, catalog: Catalog, *, read_only: bool,
                 remote: Remote | None = None) -> None:
        self.spec = spec
        self.fs = fs
        self.catalog = catalog
        self.read_only = read_only
        self.root = Path(spec.root)
        self.task_id = spec.task_id
        self.dir = self.root / spec.task_id
        self.blobs = BlobStore(self.dir / BLOBS_DIR, fs)
        self.timelines = Timelines(self.dir, fs)
        self.abort_reason: str | None = None
        """Set by `CheckpointStore.abort`: rank 0 stops waiting for other ranks' files."""
        self.remote = remote
        """The object-store copy of the task when the root is a URL (`remote_sync` keeps them in step)."""
        self.l1_pace = PaceMemory()
        """What the last paced L1 writes learnt about this disk (`write_tensor_file(pace=...)`)."""
        self._rechecked: set[tuple[int, float]] = set()  # corrupt flags `to_recheck` named already

    # -- names ----------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.dir / step_dir_name(step)

    def tmp_dir(self, step: int) -> Path:
        return self.dir / f"{step_dir_name(step)}{TMP_MARKER}{self.spec.session_id}"

    def aside_dir(self, step: int) -> Path:
        return self.dir / f"{step_dir_name(step)}{TMP_MARKER}{self.spec.session_id}{ASIDE_SUFFIX}"

    def trash_dir(self, step: int) -> Path:
        return self.dir / f"{step_dir_name(step)}{TMP_MARKER}{self.spec.session_id}{TRASH_INFIX}{uuid.uuid4().hex[:8]}"

    def owns(self, path: str | Path) -> int | None:
        """The step when `path` is a checkpoint directory of this task, else `None`."""
        path = Path(path).absolute()
        if path.parent != self.dir and os.path.realpath(path.parent) != os.path.realpath(self.dir):
            return None
        return parse_step_dir(path.name)

    def committed(self) -> dict[int, Path]:
        """Real ``step-<N>`` directories of this task (links are ignored, with a warning)."""
        out: dict[int, Path] = {}
        for name in self.fs.listdir(self.dir):
            step = parse_step_dir(name)
            if step is None:
                continue
            path = self.dir / name
            if self.fs.is_dir(path):
                out[step] = path
            elif self.fs.is_link(path):
                logger.warning("%s is a symbolic link, not a checkpoint: the store ignores it and never follows it",
                               path)
        return out

    # -- reading --------------------------------------------------------------------------
    def read_manifest(self, step: int, path: Path | None = None) -> dict[str, Any]:
        """The manifest of `step` (retried once after a read error, a transient fault's usual shape)."""
        path = path if path is not None else self.step_dir(step)
        try:
            return mf.read_manifest(path, step=step, task_id=path.parent.name)
        except CorruptCheckpointError as first:
            if not isinstance(first.__cause__, OSError):
                raise
            logger.debug("reading %s failed (%s); retrying once", path / MANIFEST_NAME, first)
            return mf.read_manifest(path, step=step, task_id=path.parent.name)

    def info_of(self, manifest: dict[str, Any], path: Path) -> CheckpointInfo:
        info = mf.info_from_manifest(manifest, path)
        if key_of(info) in self.timelines.abandoned():
            info = mf.info_from_manifest(manifest, path, abandoned=True)
        return info

    def scan(self, step: int, path: Path | None = None) -> CheckpointInfo | None:
        """The checkpoint of `step` as its directory describes it; `None` when it has no manifest."""
        path = path if path is not None else self.step_dir(step)
        try:
            return self.info_of(self.read_manifest(step, path), path)
        except CheckpointNotFoundError:
            return None
        except (CorruptCheckpointError, FormatVersionError) as e:
            # INFO, not a warning: the index marks it corrupt (`ls` shows it) and a resume that passes over it says
            # why in its own warning; every sync that re-reads the manifest would repeat this line.
            logger.info("checkpoint %s has an unusable manifest: %s", path, e)
            return mf.broken_info(path.parent.name, step, path, STATUS_CORRUPT)

    def row_info(self, row: dict[str, Any], abandoned: set[tuple[int, float]] | None = None) -> CheckpointInfo:
        """A catalog row as an info: the path derived from the step, the abandoned flag from the record."""
        abandoned = self.timelines.abandoned() if abandoned is None else abandoned
        return Catalog.to_info(row, root=self.root, abandoned=(int(row["step"]), float(row["save_time"])) in abandoned)

    def scan_all(self) -> list[CheckpointInfo]:
        """Every committed checkpoint of the task, read from its manifest (no catalog)."""
        return [i for step, path in sorted(self.committed().items()) if (i := self.scan(step, path)) is not None]

    # -- finding: the checkpoints a listing shows and the one a ref names ---------------------
    def checkpoints(self, include_unhealthy: bool = False, include_abandoned: bool = False) -> list[CheckpointInfo]:
        """Checkpoints of the task, newest first (`CheckpointStore.list` documents the arguments)."""
        self.sync(recheck_hidden=not include_unhealthy)  # a flag that hides a checkpoint is re-read first
        out = []
        abandoned = self.timelines.abandoned()
        for row in self.catalog.rows(self.task_id):
            info = self.row_info(row, abandoned)
            if not include_unhealthy and not (info.healthy and info.status == STATUS_OK):
                continue
            if info.abandoned and not include_abandoned:
                continue
            out.append(info)
        return out

    def _available_text(self) -> str:
        infos = self.checkpoints(include_unhealthy=True, include_abandoned=True)
        if not infos:
            return f"the store has no checkpoints of task {self.task_id!r} under {self.root}"

        def note(i: CheckpointInfo) -> str:
            flags = [] if i.status == STATUS_OK else [i.status]
            flags += [] if i.healthy or i.status != STATUS_OK else ["unhealthy"]
            flags += ["abandoned"] if i.abandoned else []
            return f"{i.step}" + (f" ({', '.join(flags)})" if flags else "")

        steps = ", ".join(note(i) for i in sorted(infos, key=lambda i: i.step))
        return f"available steps of task {self.task_id!r}: {steps}"

    def to_recheck(self) -> list[int]:
        """Steps a `corrupt` flag would keep from auto/best/fastest that were not re-verified yet; each is returned
        once per `Task` (the caller verifies them before a named ref is resolved)."""
        steps = []
        for row in self.catalog.rows(self.task_id):
            key = (int(row["step"]), float(row["save_time"]))
            if row["status"] == STATUS_CORRUPT and row["healthy"] and key not in self._rechecked:
                self._rechecked.add(key)
                steps.append(int(row["step"]))
        return steps

    def resolve(self, ref: str | int | os.PathLike[str] | CheckpointInfo) -> CheckpointInfo:
        """The checkpoint `ref` names (`CheckpointStore.resolve` documents the refs).

        A named ref ranks the catalog as it is: the caller re-verifies `to_recheck` first.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        if isinstance(ref, CheckpointInfo):
            return ref
        if isinstance(ref, int):
            return self._by_step(int(ref))
        text = os.fspath(ref)
        if text in NAMED_REFS:
            candidates = [i for i in self.checkpoints() if Tier.WEIGHTS in i.tiers]
            if text == "best":
                candidates = [i for i in candidates if i.loss is not None]
                if not candidates:
                    raise CheckpointNotFoundError(f"resolve('best'): no healthy checkpoint records a loss; "
                                                  f"{self._available_text()}.")
                return min(candidates, key=lambda i: (i.loss, -i.step))
            if not candidates:
                raise CheckpointNotFoundError(f"resolve({text!r}): no healthy committed checkpoint with weights; "
                                              f"{self._available_text()}.")
            if text == "fastest":
                def cost(i: CheckpointInfo) -> tuple[float, int]:
                    return (float("inf") if i.recovery_cost_ms is None else i.recovery_cost_ms, -i.step)

                return min(candidates, key=cost)
            return candidates[0]
        if text.startswith("step:") or text.isdigit():
            raw = text.removeprefix("step:")
            try:
                return self._by_step(int(raw))
            except ValueError as e:
                raise CheckpointNotFoundError(f"ref {text!r} is invalid: expected step:N with an integer N.") from e
        return self._by_path(Path(text))

    def _by_step(self, step: int) -> CheckpointInfo:
        self.sync()  # a committed step whose row is not written yet gets one; a vanished one is missing
        row = self.catalog.get(self.task_id, step)
        if row is not None and row["status"] != STATUS_MISSING:
            return self.row_info(row)
        removed = self.removed().get(step)
        why = ""
        if removed is not None and set(removed.get("tiers") or ()) >= {Tier.WEIGHTS.value}:
            why = (f" (retention removed it: {removed.get('rule')}; keep_last: null and null retention_days keep "
                   "every checkpoint, or pin one)")
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {self.dir}{why}; "
                                      f"{self._available_text()}.")

    def _by_path(self, path: Path) -> CheckpointInfo:
        path = path.absolute()
        if (step := self.owns(path)) is not None:
            return self._by_step(step)
        if self.fs.is_link(path):
            raise CheckpointNotFoundError(f"{path} is a symbolic link; the store never follows links. Pass the real "
                                          f"directory; {self._available_text()}.")
        if not self.fs.is_dir(path):
            raise CheckpointNotFoundError(
                f"{path} is neither 'auto', 'best', 'fastest', 'step:N' nor an existing checkpoint directory; "
                f"{self._available_text()}."
            )
        if TMP_MARKER in path.name:
            raise CheckpointNotFoundError(f"{path} is an unfinished save (temporary directory), not a checkpoint; "
                                          f"{self._available_text()}.")
        if not self.fs.is_file(path / MANIFEST_NAME) and self.fs.is_file(path / "trainer_state.json"):
            native = "DeepSpeed's and Trainer's" if any(n.startswith("global_step") for n in listdir(path)) \
                else "Trainer's"
            raise CheckpointNotFoundError(
                f"{path} is {native} own checkpoint folder, not one of this store: pass it to "
                "trainer.train(resume_from_checkpoint=...) directly (Trainer loads it itself; SmartCkptCallback "
                f"saves into the store from there on); {self._available_text()}.")
        if not self.fs.is_file(path / MANIFEST_NAME):
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint directory (no {MANIFEST_NAME}); pass a step-<N> directory of a store; "
                f"{self._available_text()}."
            )
        return mf.info_from_manifest(mf.read_manifest(path, step=parse_step_dir(path.name)), path)

    # -- what retention removed -------------------------------------------------------------
    def note_removed(self, step: int, tiers: Iterable[Tier], rule: str) -> None:
        """Record that retention removed checkpoint `step` (or only `tiers` of it), and by which rule (rank 0).

        Best effort: the record only explains a missing step (`ls`, the resume error); a failed
        write never stops a prune."""
        line = json.dumps({"step": int(step), "tiers": sorted(Tier(t).value for t in tiers), "rule": rule,
                           "time": time.time()}, sort_keys=True)
        try:
            self.fs.append_line(self.dir / REMOVED_LOG_NAME, line)
        except OSError as e:
            logger.debug("could not record the removal of step %d (%s)", step, e)

    def removed(self) -> dict[int, dict[str, Any]]:
        """The latest removal record of each step retention removed (whole or some tiers), by step."""
        path = self.dir / REMOVED_LOG_NAME
        out: dict[int, dict[str, Any]] = {}
        try:
            text = path.read_text(encoding="utf-8") if not self.fs.is_link(path) else ""
        except OSError:
            return out
        for line in text.splitlines():
            try:
                row = loads_bounded(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                out[row["step"]] = row
        return out

    # -- catalog (best effort for other ranks: the manifests are the truth) ------------------
    def sync(self, *, recheck_hidden: bool = False, drop_missing: bool = False) -> None:
        """Bring the task's catalog rows in line with its manifests (`Catalog.sync` documents the arguments)."""
        self._write(lambda: self.catalog.sync(self.task_id, root=self.root, committed=self.committed(), scan=self.scan,
                                              abandoned=self.timelines.abandoned(), recheck_hidden=recheck_hidden,
                                              drop_missing=drop_missing))

    def rebuild(self, *, all_tasks: bool) -> int:
        """Rebuild the catalog from the manifests: every task under the root, or only this one (`Catalog.rebuild`)."""
        if not all_tasks:
            return self.catalog.rebuild(self.scan_all(), root=self.root, task_id=self.task_id)
        infos: list[CheckpointInfo] = []
        for name in self.fs.listdir(self.root):
            if name.startswith(".") or name == BLOBS_DIR or not self.fs.is_dir(self.root / name):
                continue
            try:
                other = Task(dataclasses.replace(self.spec, task_id=name, rank=0, world_size=1), self.fs, self.catalog,
                             read_only=self.read_only)
            except ValueError:  # not a valid task name: not ours
                continue
            infos.extend(other.scan_all())
        return self.catalog.rebuild(infos, root=self.root)

    def record(self, info: CheckpointInfo) -> None:
        self._write(lambda: self.catalog.upsert(info, root=self.root))

    def set_status(self, step: int, status: str) -> None:
        self._write(lambda: self.catalog.set_status(self.task_id, step, status))

    def forget(self, step: int) -> None:
        self._write(lambda: self.catalog.remove(self.task_id, step))

    def _write(self, work: Any) -> None:
        try:
            work()
        except sqlite3.OperationalError as e:
            if self.spec.rank == 0 and not self.read_only and "readonly" not in str(e).replace(" ", ""):
                raise
            logger.debug("catalog %s not updated (%s); the manifests stay the truth", self.catalog.path, e)

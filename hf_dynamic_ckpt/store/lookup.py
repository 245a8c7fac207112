"""`Lookup`: finding the checkpoints of one task (`list`, `resolve`), for `CheckpointStore`.

The catalog makes listing cheap, but it never decides alone: every path is derived from
the step, and each lookup first syncs the catalog with the manifests (`Task.sync`): a row
whose directory lost its manifest is marked ``"missing"``, and a flag that would hide a
checkpoint (unhealthy, corrupt, missing) is re-read from disk before the checkpoint is left
out. Abandoned checkpoints (the timelines record) are never chosen by ``auto``/``best``/
``fastest`` but are listed with ``include_abandoned`` and found by ``step:N`` or path.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path

from ..constants import MANIFEST_NAME, TMP_MARKER, Tier
from ..errors import CheckpointNotFoundError
from . import manifest as mf
from .catalog import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK
from .task import Task, parse_step_dir
from .types import CheckpointInfo

NAMED_SPECS = ("auto", "best", "fastest")
"""Specs `resolve` answers by ranking the healthy checkpoints (the others name one checkpoint)."""


class Lookup:
    """`list` and `resolve` over one `Task` (and which corrupt flags were re-verified already).

    Args:
        task (`Task`): the task whose checkpoints are looked up.
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.fs = task.fs
        self._rechecked: set[tuple[int, float]] = set()

    def list(self, include_unhealthy: bool = False, include_abandoned: bool = False) -> builtins.list[CheckpointInfo]:
        """Checkpoints of the task, newest first (`CheckpointStore.list` documents the arguments)."""
        self.task.sync(recheck_hidden=not include_unhealthy)  # a flag that hides a checkpoint is re-read first
        out = []
        abandoned = self.task.timelines.abandoned()
        for row in self.task.catalog.rows(self.task.task_id):
            info = self.task.row_info(row, abandoned)
            if not include_unhealthy and not (info.healthy and info.status == STATUS_OK):
                continue
            if info.abandoned and not include_abandoned:
                continue
            out.append(info)
        return out

    def _available_text(self) -> str:
        infos = self.list(include_unhealthy=True, include_abandoned=True)
        if not infos:
            return f"the store has no checkpoints of task {self.task.task_id!r} under {self.task.root}"

        def note(i: CheckpointInfo) -> str:
            flags = [] if i.status == STATUS_OK else [i.status]
            flags += [] if i.healthy or i.status != STATUS_OK else ["unhealthy"]
            flags += ["abandoned"] if i.abandoned else []
            return f"{i.step}" + (f" ({', '.join(flags)})" if flags else "")

        steps = ", ".join(note(i) for i in sorted(infos, key=lambda i: i.step))
        return f"available steps of task {self.task.task_id!r}: {steps}"

    def to_recheck(self) -> builtins.list[int]:
        """Steps a `corrupt` flag would keep from auto/best/fastest that were not re-verified yet; each is returned
        once per `Lookup` (the caller verifies them before a named spec is resolved)."""
        steps = []
        for row in self.task.catalog.rows(self.task.task_id):
            key = (int(row["step"]), float(row["save_time"]))
            if row["status"] == STATUS_CORRUPT and row["healthy"] and key not in self._rechecked:
                self._rechecked.add(key)
                steps.append(int(row["step"]))
        return steps

    def resolve(self, spec: str | int | os.PathLike[str] | CheckpointInfo) -> CheckpointInfo:
        """The checkpoint `spec` names (`CheckpointStore.resolve` documents the specs).

        A named spec ranks the catalog as it is: the caller re-verifies `to_recheck` first.

        Raises:
            `CheckpointNotFoundError`: nothing matches; the message lists the available steps.
        """
        if isinstance(spec, CheckpointInfo):
            return spec
        if isinstance(spec, int):
            return self._by_step(int(spec))
        text = os.fspath(spec)
        if text in NAMED_SPECS:
            candidates = [i for i in self.list() if Tier.WEIGHTS in i.tiers]
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
                raise CheckpointNotFoundError(f"spec {text!r} is invalid: expected step:N with an integer N.") from e
        return self._by_path(Path(text))

    def _by_step(self, step: int) -> CheckpointInfo:
        self.task.sync()  # a committed step whose row is not written yet gets one; a vanished one is missing
        row = self.task.catalog.get(self.task.task_id, step)
        if row is not None and row["status"] != STATUS_MISSING:
            return self.task.row_info(row)
        removed = self.task.removed().get(step)
        why = ""
        if removed is not None and set(removed.get("tiers") or ()) >= {Tier.WEIGHTS.value}:
            why = (f" (retention removed it: {removed.get('rule')}; keep_last: null and null retention_days keep "
                   "every checkpoint, or pin one)")
        raise CheckpointNotFoundError(f"step {step} has no committed checkpoint in {self.task.dir}{why}; "
                                      f"{self._available_text()}.")

    def _by_path(self, path: Path) -> CheckpointInfo:
        path = path.absolute()
        if (step := self.task.owns(path)) is not None:
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
        if not self.fs.is_file(path / MANIFEST_NAME):
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint directory (no {MANIFEST_NAME}); pass a step-<N> directory of a store; "
                f"{self._available_text()}."
            )
        return mf.info_from_manifest(mf.read_manifest(path, step=parse_step_dir(path.name)), path)

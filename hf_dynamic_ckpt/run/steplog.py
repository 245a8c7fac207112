"""The run's step log: one JSON line per optimizer step, plus events (resume, rollback).

``<root>/<task>/timeline.jsonl`` is written by rank 0 of the `RunOrchestrator` (`StepLog`)
and read by `extras.plot` and the demo (`read_step_log`). Each step row holds the reduced signals,
the smoothed risk (`risk`), the step's raw risk (`beta`) and the saves taken during the step
(with their `kind`); a resume adds an ``{"event": "resume", ...}`` line, which starts a new
segment when read back. Numbers are
strict JSON (`jsonutil.safe_float`), so ``jq`` reads the file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..constants import DEFAULT_TASK_ID, TIMELINE_NAME
from ..errors import CheckpointNotFoundError
from ..jsonutil import safe_float
from ..policy.decision import Decision
from ..signals.frame import SignalFrame
from .savelog import SaveEvent


class StepLog:
    """The run's step log, ``<task_dir>/timeline.jsonl``: written by rank 0 only (line-buffered).

    Rows are written while attached (`open`); events may come before (a resume) and are appended to the file
    directly then.

    Args:
        task_dir (`Path`): the task's folder in the store (created when the file is first opened).
        rank (`int`): this rank; other ranks write nothing.
    """

    def __init__(self, task_dir: Path, *, rank: int) -> None:
        self.task_dir = task_dir
        self.rank = rank
        self._file: Any = None
        self._seen = 0

    def open(self) -> None:
        if self.rank == 0 and self._file is None:
            self.task_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.task_dir / TIMELINE_NAME, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def step(self, frame: SignalFrame, decision: Decision, events: list[SaveEvent], *, beta: float | None = None
             ) -> None:
        """One row for the step `frame.step`, with the saves of `events` taken during it; `beta` is the step's raw
        risk (the smoothed one, `risk`, discounts a single step's and is what the interval follows).

        `events` is the run's whole save log; only entries appended since the previous row are
        looked at (no scan of the history per step).
        """
        if self._file is None:
            return
        saves = [e for e in events[self._seen:] if e.at_step == frame.step]
        self._seen = len(events)
        row: dict[str, Any] = {
            "step": frame.step, "loss": safe_float(frame.loss), "grad_norm": safe_float(frame.grad_norm),
            "lora_max_ratio": safe_float(frame.lora_max_ratio), "lr": safe_float(frame.lr),
            "risk": round(decision.risk, 6), "beta": None if beta is None else round(beta, 6),
            "mem": safe_float(frame.mem_frac),
            "step_time_s": safe_float(frame.step_time_s), "time": time.time(),
        }
        saved = [{"step": e.step, "reason": e.reason, "kind": e.kind.value, "pinned": e.pinned,
                  "blocking_ms": round(e.blocking_ms, 3)} for e in saves]
        if saved:
            row["saves"] = saved
        self._file.write(json.dumps(row) + "\n")

    def event(self, kind: str, **data: Any) -> None:
        """A non-step line (rank 0), e.g. ``event("resume", step=56, ref="auto")``; opens the file for it when
        not attached."""
        if self.rank != 0:
            return
        attached = self._file is not None
        self.open()
        self._file.write(json.dumps({"event": kind, "time": time.time(), **data}) + "\n")
        if not attached:
            self.close()


def read_step_log(root: str | os.PathLike[str], task_id: str = DEFAULT_TASK_ID) -> list[list[dict[str, Any]]]:
    """The step log as segments: one list of step rows per stretch of training, split where the run restarted
    from an earlier step (a `resume` event: a new process; a `rollback` event: the same process went back).

    A segment after a resume starts with ``{"resume_from": step}``, after a rollback with
    ``{"rollback_to": step, "rollback_from": step, "reason": ...}``.

    Raises:
        `CheckpointNotFoundError`: the task has no step log.
    """
    path = Path(root) / task_id / TIMELINE_NAME
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} does not exist: ROOT must be a store written by SmartCkptCallback / "
                                      "SmartCheckpointer (pass the directory holding catalog.db, and --task if not "
                                      "'default').")
    segments: list[list[dict[str, Any]]] = [[]]
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            continue
        if row.get("event") == "resume":
            segments.append([{"resume_from": row.get("step")}])
        elif row.get("event") == "rollback":
            segments.append([{"rollback_to": row.get("to_step"), "rollback_from": row.get("from_step"),
                              "reason": row.get("reason")}])
        elif "step" in row:
            segments[-1].append(row)
    return [s for s in segments if any("step" in r for r in s)]


def read_rollbacks(root: str | os.PathLike[str], task_id: str = DEFAULT_TASK_ID) -> list[dict[str, Any]]:
    """The rollbacks the step log records, oldest first: ``{"from_step", "to_step", "reason", "time"}`` each
    (none when the task has no step log)."""
    path = Path(root) / task_id / TIMELINE_NAME
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("event") == "rollback":
            out.append({k: row.get(k) for k in ("from_step", "to_step", "reason", "time")})
    return out

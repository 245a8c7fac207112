"""What the training loop saw of its saves: `SaveEvent`s and the `smart_ckpt/*` metrics.

The catalog and the manifests hold the committed facts; this is the run's own log (step,
reason, blocking time, bytes once committed, or the error), which the timeline, the
metrics and the demo report read.

The run's step log: one JSON line per optimizer step, plus events (resume, rollback).

``<root>/<task>/timeline.jsonl`` is written by rank 0 of the `RunOrchestrator` (`StepLog`)
and read by `extras.plot` and the demo (`read_step_log`). Each step row holds the reduced signals,
the smoothed risk (`risk`), the step's raw risk (`beta`) and the saves taken during the step
(with their `kind`); a resume adds an ``{"event": "resume", ...}`` line, which starts a new
segment when read back. Numbers are
strict JSON (`jsonutil.safe_float`), so ``jq`` reads the file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import DEFAULT_TASK_ID, TIMELINE_NAME, Tier
from ..errors import CheckpointNotFoundError
from ..jsonutil import safe_float
from ..policy.decision import Decision, DecisionKind
from ..signals import SignalFrame

if TYPE_CHECKING:
    from ..engine import SaveHandle

logger = logging.getLogger(__name__)

METRIC_PREFIX = "smart_ckpt/"


@dataclass
class SaveEvent:
    """One save as the training loop saw it (the catalog holds the committed facts).

    Args:
        step (`int`): step of the saved state.
        at_step (`int`): step during which the save was taken (`step + 1` for a pre-update capture).
        reason (`str`): the policy's reason (human text).
        tiers (`frozenset[Tier]`): what was saved.
        pinned (`bool`): protected from retention.
        blocking_ms (`float`): time training was stopped by the save.
        kind (`DecisionKind`): machine-readable reason.
        bytes (`int`, *optional*): bytes on disk once committed (rank 0).
        write_ms (`float`, *optional*): background write time once committed.
        path (`str`, *optional*): the committed directory (rank 0).
        error (`str`, *optional*): why the save failed or was skipped.
        staging (`str`, *optional*): how the state was staged: `"buffered"` (copied, written in
            the background), `"streaming"` (written synchronously from the live tensors: memory
            was short) or `"sync"` (a blocking save).
    """

    step: int
    at_step: int
    reason: str
    tiers: frozenset[Tier]
    pinned: bool
    blocking_ms: float
    kind: DecisionKind = DecisionKind.MANUAL
    bytes: int | None = None
    write_ms: float | None = None
    path: str | None = None
    error: str | None = None
    handle: SaveHandle | None = field(default=None, repr=False)
    staging: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "at_step": self.at_step, "reason": self.reason, "kind": self.kind.value,
                "tiers": sorted(t.value for t in self.tiers), "pinned": self.pinned,
                "blocking_ms": round(self.blocking_ms, 3), "bytes": self.bytes,
                "write_ms": None if self.write_ms is None else round(self.write_ms, 3),
                "path": self.path, "error": self.error, "staging": self.staging}


class SaveLog:
    """The run's `SaveEvent`s, with the counters behind the `smart_ckpt/*` metrics.

    The blocking time of saves accumulates twice: until `metrics()` reports it (`stall_ms`), and until
    the next signal frame carries it to the policy (`take_blocking_s`). An overlapped snapshot's copy
    (`handle.deferred`) blocks later, where the next optimizer step waits for it: that wait counts once it
    happened, at the next `take_blocking_s`.
    """

    def __init__(self) -> None:
        self.events: list[SaveEvent] = []
        self.failed = 0
        self.earlier_saves = 0
        """Saves of the run before this process (restored from the resumed checkpoint: `continue_counts`)."""
        self.earlier_failed = 0
        self._start = 0  # index of the first event of the current timeline
        self._stall_ms = 0.0
        self._blocking_s = 0.0
        self._overlapped: list[Any] = []  # `PendingCopy`s whose wait at the optimizer step is not counted yet

    def add(self, event: SaveEvent) -> SaveEvent:
        self.events.append(event)
        self._stall_ms += event.blocking_ms
        self._blocking_s += event.blocking_ms / 1e3
        deferred = getattr(event.handle, "deferred", None)
        if deferred is not None:
            self._overlapped.append(deferred)
        return event

    def take_blocking_s(self) -> float | None:
        """Blocking seconds since the previous call (`None` when no save blocked in between): the saves' own, and
        the time the training thread waited for an overlapped copy (`PendingCopy.wait_ms`) once it did."""
        waited_ms = sum(c.wait_ms for c in self._overlapped if c.wait_ms is not None)
        self._overlapped = [c for c in self._overlapped if c.wait_ms is None]
        self._stall_ms += waited_ms
        value, self._blocking_s = self._blocking_s + waited_ms / 1e3, 0.0
        return value if value > 0 else None

    def last_ok(self) -> SaveEvent | None:
        """The newest successful (or still writing) save of the current timeline."""
        return next((e for e in reversed(self.events[self._start:]) if e.error is None), None)

    def find(self, step: int) -> SaveEvent | None:
        """The newest successful (or still writing) save of `step` in the current timeline."""
        return next((e for e in reversed(self.events[self._start:]) if e.step == step and e.error is None), None)

    def counts_for_save(self) -> dict[str, int]:
        """The run's save counters as a save being taken now stores them (itself included)."""
        done = sum(e.error is None for e in self.events)
        return {"saves": self.earlier_saves + done + 1, "failed_saves": self.earlier_failed + self.failed}

    def continue_counts(self, counts: dict[str, Any]) -> None:
        """Continue the run's counters from a resumed checkpoint's (`counts_for_save`), so that the
        `smart_ckpt/saves` curve of a run does not drop at every restart."""
        saves, failed = counts.get("saves"), counts.get("failed_saves")
        if isinstance(saves, int) and saves >= 0:
            self.earlier_saves = saves
        if isinstance(failed, int) and failed >= 0:
            self.earlier_failed = failed

    def restart(self) -> None:
        """The run restarted from an earlier step (a retry, a rollback): earlier saves belong to another timeline.
        They still count in `smart_ckpt/saves` (they were taken); `find`, `last_ok` and `last_save_step` see only
        the current timeline's."""
        self._start = len(self.events)

    def metrics(self, *, risk: float | None, interval: float | None, held_step: int | None = None) -> dict[str, float]:
        """`smart_ckpt/saves`, `failed_saves` (of the run: a resumed run continues the counts), `streamed_saves`,
        `last_save_step`, `stall_ms` (since the last call), `risk`, `interval`.

        `held_step`: a save decided for that step whose write starts after the step's logging; it
        counts as taken.
        """
        done = [e.step for e in self.events if e.error is None]
        current = [e.step for e in self.events[self._start:] if e.error is None]
        if held_step is not None:
            done.append(held_step)
            current.append(held_step)
        out: dict[str, float] = {
            f"{METRIC_PREFIX}saves": float(self.earlier_saves + len(done)),
            f"{METRIC_PREFIX}failed_saves": float(self.earlier_failed + self.failed),
            # saves written synchronously from the live tensors because snapshot buffers did not fit
            f"{METRIC_PREFIX}streamed_saves": float(sum(e.staging == "streaming" for e in self.events
                                                        if e.error is None)),
            f"{METRIC_PREFIX}stall_ms": round(self._stall_ms, 3),
            f"{METRIC_PREFIX}risk": round(risk, 6) if risk is not None else 0.0,
        }
        if current:
            out[f"{METRIC_PREFIX}last_save_step"] = float(current[-1])
        if interval:
            out[f"{METRIC_PREFIX}interval"] = round(interval, 3)
        self._stall_ms = 0.0
        return out


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

"""What the training loop saw of its saves: `SaveEvent`s and the `smart_ckpt/*` metrics.

The catalog and the manifests hold the committed facts; this is the run's own log (step,
reason, blocking time, bytes once committed, or the error), which the timeline, the
metrics and the demo report read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..constants import Tier
from ..policy.decision import DecisionKind

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

"""When an anomaly is confirmed, roll back: the rule that turns anomalous steps into rollbacks.

Pure, like the rest of the policy: it sees, for each optimizer step, whether the update about to
be applied is bad (`capture.capture_rule` fired: non-finite values, a gradient or LoRA-layer
surge, a learning-rate jump, a confirmed loss spike) and answers with a `RollbackVerdict`. An
anomaly starts at its first bad step (its *onset*, whose pre-update state the policy captured
and pinned); `rollback_patience` bad steps in a row confirm it. A confirmed anomaly asks for a
rollback to a healthy restore point before the onset, at most `rollback_window` steps back; past
`max_rollbacks` rollbacks within `rollback_window` steps the run stops (`on_rollbacks_exhausted:
stop`) or trains through (`continue`).

Its state is the run's history of rollbacks, so it is *not* restored from the restore point a
rollback returns to (the policy's statistics are): a run never forgets that it rolled back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..config import OnAnomaly, SmartCkptConfig


class Verdict(enum.StrEnum):
    """What the rule answers for one step."""

    NONE = "none"  # nothing to do (calm, or an anomaly not yet confirmed)
    ROLLBACK = "rollback"  # confirmed: roll back to a restore point before `onset`
    EXHAUSTED = "exhausted"  # confirmed, but max_rollbacks were taken within the window


@dataclass(frozen=True)
class RollbackVerdict:
    """The rule's answer: `verdict`, the anomaly's first bad step (`onset`), and why (`reason`)."""

    verdict: Verdict = Verdict.NONE
    onset: int | None = None
    reason: str = ""
    earliest: int = 0
    """The oldest step a restore point may have (`step - rollback_window`)."""


NO_ROLLBACK = RollbackVerdict()


@dataclass
class RollbackRule:
    """Counts bad steps in a row and remembers the run's rollbacks (see the module docstring).

    Attributes:
        streak (`int`): bad steps in a row so far.
        onset (`int`, *optional*): the first bad step of the current run of them.
        first_reason (`str`): the capture rule that fired at the onset.
        taken (`list[int]`): the steps at which rollbacks were taken.
    """

    streak: int = 0
    onset: int | None = None
    first_reason: str = ""
    taken: list[int] = field(default_factory=list)

    def observe(self, step: int, rule: str | None, config: SmartCkptConfig) -> RollbackVerdict:
        """One optimizer step: `rule` is why its update is bad (`None`: it is not)."""
        if config.on_anomaly != OnAnomaly.ROLLBACK:
            return NO_ROLLBACK
        if rule is None:
            self.reset()
            return NO_ROLLBACK
        if self.streak == 0:
            self.onset, self.first_reason = step, rule
        self.streak += 1
        if self.streak < config.policy.rollback_patience:
            return NO_ROLLBACK
        onset = self.onset if self.onset is not None else step
        reason = self.first_reason if self.streak == 1 else f"{self.first_reason}; {self.streak} bad steps in a row"
        earliest = max(0, step - config.policy.rollback_window)
        recent = [s for s in self.taken if s >= earliest]
        if len(recent) >= config.policy.max_rollbacks:
            return RollbackVerdict(Verdict.EXHAUSTED, onset, (
                f"{reason}; {len(recent)} rollbacks within the last {config.policy.rollback_window} steps "
                f"(max_rollbacks={config.policy.max_rollbacks})"), earliest)
        return RollbackVerdict(Verdict.ROLLBACK, onset, reason, earliest)

    def taken_at(self, step: int) -> None:
        """A rollback was taken at `step`: the anomaly is over (its bad steps are gone with the restore)."""
        self.taken.append(step)
        self.reset()

    def reset(self) -> None:
        """No anomaly in progress (a calm step, a rollback taken, or one that found no restore point)."""
        self.streak, self.onset, self.first_reason = 0, None, ""

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "onset": self.onset, "first_reason": self.first_reason,
                "taken": list(self.taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak") or 0)
        onset = state.get("onset")
        self.onset = int(onset) if isinstance(onset, int) else None
        self.first_reason = str(state.get("first_reason") or "")
        self.taken = [int(s) for s in state.get("taken") or [] if isinstance(s, int)]

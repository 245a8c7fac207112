"""`Decision`: what the policy answers for one step (when to save, what, and why)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..constants import Tier


class DecisionKind(enum.StrEnum):
    """Why a save happens, as a value code can branch on (`Decision.reason` stays human text)."""

    NONE = "none"  # no save
    INTERVAL = "interval"  # the regular (possibly risk-shortened) interval elapsed
    RISK_EDGE = "risk_edge"  # smoothed risk rose past risk_threshold
    MEMORY = "memory"  # memory predicted to cross memory_threshold (minimal tiers)
    CAPTURE = "capture"  # pre-update capture of the still-healthy state (pinned)
    PREEMPTION = "preemption"  # SIGTERM/SIGUSR1: one synchronous save, then stop
    TRAIN_END = "train_end"  # the final state when training ends
    MANUAL = "manual"  # asked for outside the policy (save_now, accelerate save_state)
    LEARNED = "learned"  # asked for by the learned double-check model
    ROLLBACK = "rollback"  # no save: a confirmed anomaly, the run returns to a restore point before it


MINIMAL_TIERS: frozenset[Tier] = frozenset({Tier.WEIGHTS, Tier.STATE})
"""Smallest consistent restore point: weights plus RNG / data position / step (no optimizer).

A resume from it continues exactly where the data and RNG were, with a fresh optimizer
(the `level_0_only` fallback). It is what a save under memory pressure writes first.
"""


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one step.

    Args:
        save (`bool`): take a checkpoint now.
        tiers (`frozenset[Tier]`, *optional*): what the checkpoint holds; empty when not saving.
        reason (`str`, *optional*): why (logged, and stored in the manifest and catalog).
        pin (`bool`, *optional*, defaults to `False`): retention must never delete it.
        pre_update (`bool`, *optional*, defaults to `False`): from `RulePolicy.pre_update`:
            save the state as it is *before* this step's optimizer update, i.e. the state
            of step `frame.step - 1` (with the RNG states and data position of the end of
            that step).
        skip_update (`bool`, *optional*, defaults to `False`): the caller should skip this
            step's optimizer update (and zero the gradients); only with `skip_bad_update`.
        risk (`float`, *optional*, defaults to `0.0`): smoothed risk beta in [0, 1].
        step (`int`, *optional*): the step count of the state to save (`frame.step`, or
            `frame.step - 1` for a pre-update capture).
        healthy (`bool`, *optional*, defaults to `True`): the state to save is believed sane
            (no non-finite update has been applied to it); restore points must be healthy.
        interval (`float`, *optional*, defaults to `0.0`): the current regular interval in steps.
        kind (`DecisionKind`, *optional*): machine-readable reason; `NONE` when not saving.
    """

    save: bool
    tiers: frozenset[Tier] = frozenset()
    reason: str = ""
    pin: bool = False
    pre_update: bool = False
    skip_update: bool = False
    risk: float = 0.0
    step: int | None = None
    healthy: bool = True
    interval: float = 0.0
    kind: DecisionKind = DecisionKind.NONE

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tiers sorted) for logs, the manifest and the decision history."""
        return {
            "save": self.save,
            "tiers": sorted(t.value for t in self.tiers),
            "reason": self.reason,
            "pin": self.pin,
            "pre_update": self.pre_update,
            "skip_update": self.skip_update,
            "risk": round(self.risk, 6),
            "step": self.step,
            "healthy": self.healthy,
            "interval": round(self.interval, 3),
            "kind": self.kind.value,
        }


NO_SAVE = Decision(save=False)

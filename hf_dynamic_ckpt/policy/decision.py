"""`Decision`: what the policy answers for one step (when to save, what, and why)."""

from __future__ import annotations

import dataclasses
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
"""Smallest consistent restore point: weights plus RNG / data position / step, no optimizer. A resume from it continues
exactly where the data and RNG were with a fresh optimizer (the `level_0_only` fallback); a save under memory pressure
writes it first."""


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one step; integrations and the orchestrator act on it.

    Args:
        save (`bool`): take a checkpoint now.
        tiers (`frozenset[Tier]`, *optional*): what the checkpoint holds; empty when not saving.
        reason (`str`, *optional*): why, in words (logged, stored in the manifest and catalog).
        pin (`bool`, *optional*, defaults to `False`): retention must never delete it.
        pre_update (`bool`, *optional*, defaults to `False`): from `RulePolicy.pre_update`: save the state *before*
            this step's optimizer update, the state of step `frame.step - 1` (with that step's RNG and data position).
        skip_update (`bool`, *optional*, defaults to `False`): the caller skips this step's optimizer update (and zeroes
            the gradients); only with `skip_bad_update`.
        risk (`float`, *optional*, defaults to `0.0`): smoothed risk beta in [0, 1].
        step (`int`, *optional*): the step of the state to save (`frame.step`, or `frame.step - 1` for a capture).
        healthy (`bool`, *optional*, defaults to `True`): the state is believed sane (no non-finite update applied, no
            bad update, training risk below the threshold); restore points must be healthy.
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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "tiers": sorted(t.value for t in self.tiers), "risk": round(self.risk, 6),
            "interval": round(self.interval, 3), "kind": self.kind.value}


NO_SAVE = Decision(save=False)

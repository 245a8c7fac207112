"""The post-update triggers and the state they keep, one small object each.

Each object owns its state (`state_dict()` / `load_state_dict()`) and answers one question
for `RulePolicy.decide`: is there a preemption to save for, a rising risk edge, a memory
ramp, is the state healthy. The pre-update capture lives in `capture.py`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..config import PolicyParams
from ..signals.frame import SignalFrame
from .baselines import Assessment
from .stateful import Stateful


@dataclass
class PreemptionTrigger(Stateful):
    """One full save at the first frame carrying the preemption flag, never a second one."""

    done: bool = False

    def fire(self, frame: SignalFrame) -> bool:
        if not frame.preempt or self.done:
            return False
        self.done = True
        return True


@dataclass
class RiskEdgeTrigger(Stateful):
    """Fires once when the smoothed risk reaches `risk_threshold`; re-armed below `risk_release`."""

    armed: bool = True

    def fire(self, beta: float, config: PolicyParams) -> bool:
        if beta < config.risk_release:
            self.armed = True
        if self.armed and beta >= config.risk_threshold:
            self.armed = False
            return True
        return False


@dataclass
class MemoryRampTrigger(Stateful):
    """Fires once when memory is predicted to cross `memory_threshold` within `memory_lookahead` steps;
    re-armed once the forecast falls 5 points below the threshold (jitter around a plateau saves once)."""

    armed: bool = True

    def fire(self, forecast: tuple[float, float] | None, config: PolicyParams) -> str | None:
        """The save reason when it fires, else `None`."""
        if forecast is None:
            return None
        current, predicted = forecast
        if self.armed and current < config.memory_threshold <= predicted:
            self.armed = False
            return f"memory_ramp {current:.1%} -> {predicted:.1%} within {config.memory_lookahead} steps"
        if not self.armed and predicted < config.memory_threshold - 0.05:
            self.armed = True
        return None


@dataclass
class Health(Stateful):
    """Whether the weights are sane. A non-finite update that went through poisons them (saves pause,
    decisions carry `healthy=False`) until the signals, computed from the weights, are finite again."""

    poisoned: bool = False

    def before_update(self, nonfinite: bool, skipped: bool) -> None:
        if nonfinite and not skipped:
            self.poisoned = True  # the NaN/inf update is about to be applied

    def after_update(self, frame: SignalFrame, *, seen_before_update: bool) -> None:
        if frame.any_nonfinite:
            if not seen_before_update:
                self.poisoned = True  # no pre_update call saw it: the bad update went through
        elif frame.loss is not None or frame.grad_norm is not None:
            self.poisoned = False  # finite signals computed from the current weights: they are sane


class RiskSmoother:
    """The smoothed risk beta: mean over `risk_smoothing` steps of the debounced raw beta (`min` of
    this and the previous step's), so one-step blips do not count. Kept twice: over every
    component (`risk`, which shortens the interval) and over the finite anomalies only, without
    memory and non-finite values (`training_risk`: whether the weights themselves are at risk; a
    checkpoint taken while it is high is unhealthy; a non-finite update is tracked by `Health`).

    Args:
        smoothing (`int`): steps in the moving average (`risk_smoothing`).
    """

    def __init__(self, smoothing: int) -> None:
        self.beta: deque[float] = deque(maxlen=smoothing)
        self.training: deque[float] = deque(maxlen=smoothing)
        self.prev_beta = 0.0
        self.prev_training = 0.0

    def add(self, a: Assessment) -> None:
        beta, training = a.beta, a.training_beta
        self.beta.append(min(beta, self.prev_beta))
        self.training.append(min(training, self.prev_training))
        self.prev_beta, self.prev_training = beta, training

    @property
    def risk(self) -> float:
        return sum(self.beta) / len(self.beta) if self.beta else 0.0

    @property
    def training_risk(self) -> float:
        return sum(self.training) / len(self.training) if self.training else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"beta": list(self.beta), "training": list(self.training), "prev_beta": self.prev_beta,
                "prev_training": self.prev_training}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = self.beta.maxlen
        self.beta = deque((float(v) for v in state["beta"]), maxlen=n)
        self.training = deque((float(v) for v in state["training"]), maxlen=n)
        self.prev_beta = float(state["prev_beta"])
        self.prev_training = float(state["prev_training"])

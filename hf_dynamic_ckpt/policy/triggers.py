"""What fires: the policy's triggers, each a small object that keeps its own state.

- `Stateful`: `state_dict()` / `load_state_dict()` over a dataclass's own fields (JSON scalars), so a
  part's state dict is its fields: a field added to a part is saved and restored without touching
  `RulePolicy`.
- The post-update triggers: a preemption to save for, a rising risk edge, a memory ramp, health.
- The pre-update capture: `capture_rule` (pure: the frame against the baselines) says the update
  about to happen is bad; `CaptureTrigger` turns a rule into at most one capture per episode
  (cooldown, runs of non-finite steps).
- `RollbackRule`: when an anomaly is confirmed, roll back.

## The pre-update capture
From the first optimizer step: while a statistic has fewer than `MIN_HISTORY` values the
regular rules (robust z-scores, spread-discounted ratios) have nothing to stand on, so
*early rules* take over. They need no history and no unit: a value many times the median
of the values seen so far (the bars double below `EARLY_FLOOR` values, a baseline of one or
two samples being itself noisy), a learning rate far above the highest seen, and on the
very first step a gradient norm orders of magnitude above the clip norm. Calibrated on
calm first steps (`tests/data/traces/early/`: both tiny models, full and LoRA fine-tunes,
with and without warm-up): loss <= 1.02x, grad norm <= 6.1x their running medians in the
first 20 steps, learning rate <= 2x (linear warm-up), grad norm <= 0.84x the clip norm at step 1.

## The rollback rule
Pure, like the rest of the policy: it sees, for each optimizer step, whether the update about to
be applied is bad (`capture_rule` fired: non-finite values, a gradient or LoRA-layer
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

import dataclasses
import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import OnAnomaly, PolicyParams, SmartCkptConfig
from ..errors import ConfigError
from ..signals.frame import SignalFrame
from ..signals.stats import RollingWindow
from .baselines import MIN_HISTORY, Assessment, Baselines

# Field annotations (strings: `from __future__ import annotations`) -> JSON types accepted.
_ACCEPT: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
}


class Stateful:
    """Mixin for dataclasses whose fields are the whole state (JSON scalars only)."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every field from `state`; raises `ConfigError` naming a missing or mistyped field."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name not in state:
                raise ConfigError(f"policy state of {type(self).__name__} has no {f.name!r}: it was not written by "
                                  "this version's state_dict(); start without it (the policy warms up again).")
            value: Any = state[f.name]
            accepted = _ACCEPT[str(f.type)]
            if not isinstance(value, accepted) or (bool not in accepted and type(value) is bool):
                raise ConfigError(f"policy state of {type(self).__name__}: {f.name}={value!r} is invalid: expected "
                                  f"{f.type}.")
            values[f.name] = float(state[f.name]) if str(f.type) == "float" else value  # JSON may spell 1.0 as 1
        for name, value in values.items():  # all or nothing
            setattr(self, name, value)


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


CAPTURE_WARMUP = 20  # grad-norm / loss values before an ordinary (not extreme) surge may trigger a capture
LOSS_JUMP_RATIO = 2.0  # a loss spike alone (no gradient evidence) captures only at >= 2x the loss baseline
GRAD_CONFIRM_RATIO = 2.0  # ... or when the global / LoRA gradient ratio confirms it
EARLY_FLOOR = 3  # below this many values the early bars double
EARLY_LOSS_RATIO = 4.0  # early: loss >= 4x the median of the losses seen so far
EARLY_GRAD_RATIO = 20.0  # early: grad norm >= 20x the median of the norms seen so far
FIRST_STEP_CLIP_RATIO = 100.0  # first step: pre-clip grad norm >= 100x the clip norm


def capture_rule(frame: SignalFrame, a: Assessment, baselines: Baselines, config: PolicyParams) -> str | None:
    """The rule by which this step's update is bad, as reason text (`"grad_surge x10.0"`), or `None`.

    Pure: reads the frame, its assessment and the baselines (not yet updated with the frame).
    In order: non-finite values; the global grad norm (first step, early, or a surge of
    `>= grad_surge_ratio` x the running median that also clears the run's spread, `r**2`
    before `CAPTURE_WARMUP` values); a LoRA layer surge; the learning rate (early, or `>
    lr_surge_ratio` x the recent maximum); the loss (early, or a confirmed robust z-score).
    """
    c = config
    if frame.any_nonfinite:
        return "nonfinite"
    r = c.grad_surge_ratio
    rule = _first_step(frame, baselines) or _early("early_grad", baselines.grad, frame.grad_norm, EARLY_GRAD_RATIO)
    if rule:
        return rule
    grad_bar = r if len(baselines.grad) >= CAPTURE_WARMUP else r * r
    if a.grad_ratio is not None and a.grad_excess is not None and a.grad_excess >= grad_bar:
        return f"grad_surge x{a.grad_ratio:.1f}"
    if a.lora_ratio is not None and a.lora_ratio >= r:
        return f"lora_surge x{a.lora_ratio:.1f} in {frame.lora_max_layer}"
    rule = _early_lr(frame, baselines, c)
    if rule:
        return rule
    if a.lr_ratio is not None and a.lr_ratio > c.lr_surge_ratio:
        return f"lr_surge x{a.lr_ratio:.1f}"
    rule = _early("early_loss", baselines.loss, frame.loss, EARLY_LOSS_RATIO)
    if rule:
        return rule
    if a.loss_z is not None and a.loss_z >= c.loss_spike_z and _loss_confirmed(frame, a, baselines):
        return f"loss_spike z={a.loss_z:.1f}"
    return None


def _early(name: str, window: RollingWindow, value: float | None, bar: float) -> str | None:
    """`value` >= `bar` x the median of the `n` values seen so far (1 <= n < MIN_HISTORY; 2x bar below EARLY_FLOOR)."""
    n = len(window)
    if value is None or not math.isfinite(value) or not 1 <= n < MIN_HISTORY:
        return None
    baseline = window.median()
    if baseline is None or baseline <= 0.0:
        return None  # a ratio to a non-positive baseline means nothing
    ratio = value / baseline
    if ratio < (bar if n >= EARLY_FLOOR else 2.0 * bar):
        return None
    return f"{name} x{ratio:.1f} (median of {n} step{'s' if n > 1 else ''})"


def _early_lr(frame: SignalFrame, baselines: Baselines, c: PolicyParams) -> str | None:
    """Before `MIN_HISTORY` rates: `lr > lr_surge_ratio**2` x the highest rate seen (warm-up at most doubles it)."""
    n, lr = len(baselines.lr), frame.lr
    if lr is None or not math.isfinite(lr) or not 1 <= n < MIN_HISTORY:
        return None
    ref = max(baselines.lr)
    if ref <= 0.0 or lr <= c.lr_surge_ratio**2 * ref:
        return None
    return f"early_lr x{lr / ref:.1f}"


def _first_step(frame: SignalFrame, baselines: Baselines) -> str | None:
    """No gradient seen yet: a pre-clip norm `>= FIRST_STEP_CLIP_RATIO` x the clip norm."""
    g, clip = frame.grad_norm, frame.clip_norm
    if len(baselines.grad) or g is None or clip is None or not math.isfinite(g) or not clip > 0.0:
        return None
    if g < FIRST_STEP_CLIP_RATIO * clip:
        return None
    return f"first_step grad_norm {g:.4g} = x{g / clip:.0f} the clip norm {clip:g}"


def _loss_confirmed(frame: SignalFrame, a: Assessment, baselines: Baselines) -> bool:
    """A loss spike is worth a pinned capture when it is large (>= `LOSS_JUMP_RATIO` x the
    baseline), or the gradients confirm it (global or LoRA ratio >= `GRAD_CONFIRM_RATIO`),
    or no gradient signal exists. One-step loss jumps with ordinary gradients (a hard
    batch) do not move the weights much and are only noise for the interval."""
    if a.loss_ratio is not None and a.loss_ratio >= LOSS_JUMP_RATIO:
        return True
    if len(baselines.loss) < CAPTURE_WARMUP:
        return False  # early: only a doubled loss counts
    if frame.grad_norm is None and frame.lora_max_ratio is None:
        return True
    return any(v is not None and v >= GRAD_CONFIRM_RATIO for v in (a.grad_ratio, a.lora_ratio))


@dataclass
class CaptureTrigger(Stateful):
    """Turns rules into captures: one per episode for finite triggers (`capture_cooldown` steps),
    the first of a run of non-finite steps, never once the state is poisoned."""

    last_step: int | None = None
    prev_nonfinite: bool = False

    def observe(self, nonfinite: bool) -> bool:
        """Record whether this step is non-finite; returns whether the previous one was."""
        was, self.prev_nonfinite = self.prev_nonfinite, nonfinite
        return was

    def suppression(self, step: int, *, nonfinite: bool, was_nonfinite: bool, healthy: bool,
                    cooldown: int) -> str | None:
        """Why a capture at `step` is not taken, or `None` (then the capture is recorded at `step`)."""
        if not healthy:
            return "state already unhealthy (a non-finite update was applied)"
        if nonfinite and was_nonfinite:
            return "non-finite run already captured"
        if not nonfinite and self.last_step is not None and step - self.last_step < cooldown:
            return (f"capture cooldown ({step - self.last_step} of {cooldown} steps "
                    f"since the capture at step {self.last_step})")
        self.last_step = step
        return None


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

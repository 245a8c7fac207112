"""The rule policy and the rollback rule (docs/policy.md). Pure: frames and its own state in, `Decision`s out (no
I/O, clock or torch), so under DDP every rank decides the same on the same reduced frame."""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import OnAnomaly, PolicyParams, SmartCkptConfig
from ..constants import ALL_TIERS, DEBUG_INFO_STEPS, Tier
from ..errors import ConfigError
from ..jsonutil import safe_float as _j
from ..signals import (
    MAD_TO_STD,
    MINIMAL_TIERS,
    NO_SAVE,
    Decision,
    DecisionKind,
    Ema,
    RollingWindow,
    SignalFrame,
    Windows,
    linear_fit,
)
from .learned import LearnedCheck, load_model

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # of `RulePolicy.state_dict()`; 1: an older release's flat layout, loaded as a fresh warm-up
HISTORY_STEPS = 100  # steps kept in `RulePolicy.history`
DECISION_HISTORY = 1000  # save decisions kept in `RulePolicy.decisions`
MIN_HISTORY = 8  # values a statistic needs before it may raise risk (the early rules cover the steps before)
GRAD_BASELINE_WINDOW = 50  # grad-norm steps whose median is the running baseline
GRAD_SPREAD_K = 3.0  # a grad surge must also clear exp(k * relative spread) x the baseline (noisy runs need more)
MEM_POINTS = 6  # memory samples in the trend fit
LOSS_REL_FLOOR = 0.01  # a loss z-score never uses a scale below 1 % of the loss baseline
MIN_ALPHA = 0.2  # the article's 1 - 0.8: stability can shorten the interval 5x at most
CAPTURE_WARMUP = 20  # grad-norm / loss values before an ordinary (not extreme) surge may trigger a capture
LOSS_JUMP_RATIO = 2.0  # a loss spike alone (no gradient evidence) captures only at >= 2x the loss baseline
GRAD_CONFIRM_RATIO = 2.0  # ... or when the global / LoRA gradient ratio confirms it
EARLY_FLOOR = 3  # below this many values the early bars double
EARLY_LOSS_RATIO = 4.0  # early: loss >= 4x the median of the losses seen so far
EARLY_GRAD_RATIO = 20.0  # early: grad norm >= 20x the median of the norms seen so far
FIRST_STEP_CLIP_RATIO = 100.0  # first step: pre-clip grad norm >= 100x the clip norm
BUDGET_WARN_AFTER = 2  # measured saves before an explicit interval is reported over budget (the first may be slow)
MEMORY, NONFINITE = "memory", "nonfinite"  # risk components that say nothing about the weights' health
FROM_USER, FROM_YOUNG_DALY = "from base_interval", "from Young/Daly"
FROM_BOOTSTRAP = "from stability_window until a save cost is measured"


def ramp(value: float, lo: float, hi: float) -> float:
    """0 at or below `lo`, 1 at or above `hi`, linear in between (`hi > lo`)."""
    return 0.0 if value <= lo else 1.0 if value >= hi else (value - lo) / (hi - lo)


@dataclass
class Assessment:
    """Risk components of one frame (each in [0, 1]) and the statistics behind them."""
    loss_z: float | None = None
    loss_ratio: float | None = None
    grad_ratio: float | None = None
    grad_excess: float | None = None
    lora_ratio: float | None = None
    lr_ratio: float | None = None
    components: dict[str, float] = field(default_factory=dict)

    @property
    def beta(self) -> float:
        return max(self.components.values(), default=0.0)

    @property
    def training_beta(self) -> float:
        """`beta` of the finite anomalies (no memory, no non-finite): the risk that the weights go bad."""
        return max((v for k, v in self.components.items() if k not in (MEMORY, NONFINITE)), default=0.0)


class Baselines(Windows):
    """The windows a frame is judged against (`assess` before `fold`, so a spike is measured against the past)."""

    def __init__(self, config: PolicyParams) -> None:
        super().__init__(loss=config.stability_window, grad=min(config.stability_window, GRAD_BASELINE_WINDOW),
                         lr=config.stability_window, mem=MEM_POINTS)
        self.config = config

    def assess(self, frame: SignalFrame) -> Assessment:
        """Risk components of `frame` against the baselines (which it does not change)."""
        c, a = self.config, Assessment()
        if frame.any_nonfinite:
            a.components[NONFINITE] = 1.0
        if frame.loss is not None and math.isfinite(frame.loss) and len(self.loss) >= MIN_HISTORY:
            a.loss_z, baseline = self.loss.robust_z(frame.loss, rel_floor=LOSS_REL_FLOOR), self.loss.median()
            if baseline:
                a.loss_ratio = frame.loss / abs(baseline)
            if a.loss_z is not None:
                a.components["loss_spike"] = ramp(a.loss_z, c.loss_spike_z / 2, c.loss_spike_z)
        if frame.grad_norm is not None and math.isfinite(frame.grad_norm) and len(self.grad) >= MIN_HISTORY:
            baseline = max(self.grad.median() or 0.0, 1e-12)
            a.grad_ratio = frame.grad_norm / baseline
            spread = MAD_TO_STD * (self.grad.mad() or 0.0) / baseline  # ~ sd of log(grad norm)
            a.grad_excess = a.grad_ratio / math.exp(GRAD_SPREAD_K * spread)
            a.components["grad_surge"] = ramp(a.grad_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        if frame.lora_max_ratio is not None and math.isfinite(frame.lora_max_ratio):
            a.lora_ratio = frame.lora_max_ratio
            a.components["lora_surge"] = ramp(a.lora_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        lr_ref = max(self.lr, default=0.0)
        if frame.lr is not None and math.isfinite(frame.lr) and len(self.lr) >= MIN_HISTORY and lr_ref > 0:
            a.lr_ratio = frame.lr / lr_ref
            a.components["lr_surge"] = ramp(a.lr_ratio, (1.0 + c.lr_surge_ratio) / 2.0, c.lr_surge_ratio)
        mem = frame.mem_frac if frame.mem_frac is not None or not self.mem else self.mem[-1][1]  # the last sample
        if mem is not None and math.isfinite(mem):
            a.components[MEMORY] = ramp(mem, c.memory_threshold - 0.1, c.memory_threshold)
        return a

    def memory_forecast(self) -> tuple[float, float] | None:
        """`(current, predicted in memory_lookahead steps)` from a line through the recent samples."""
        fit = linear_fit(list(self.mem)) if len(self.mem) >= 3 else None
        if fit is None:
            return None
        (step, current), (slope, intercept) = self.mem[-1], fit
        return current, (slope * (step + self.config.memory_lookahead) + intercept if slope > 0 else current)


def capture_rule(frame: SignalFrame, a: Assessment, baselines: Baselines, c: PolicyParams) -> str | None:
    """The rule by which this step's update is bad, as reason text (`"grad_surge x10.0"`), or `None`; pure, against
    the baselines not yet folded with the frame (docs/policy.md, "Pre-anomaly capture")."""
    if frame.any_nonfinite:
        return "nonfinite"
    r = c.grad_surge_ratio
    if rule := _first_step(frame, baselines) or _early("early_grad", baselines.grad, frame.grad_norm, EARLY_GRAD_RATIO):
        return rule
    if a.grad_excess is not None and a.grad_excess >= (r if len(baselines.grad) >= CAPTURE_WARMUP else r * r):
        return f"grad_surge x{a.grad_ratio:.1f}"
    if a.lora_ratio is not None and a.lora_ratio >= r:
        return f"lora_surge x{a.lora_ratio:.1f} in {frame.lora_max_layer}"
    if rule := _early_lr(frame, baselines, c):
        return rule
    if a.lr_ratio is not None and a.lr_ratio > c.lr_surge_ratio:
        return f"lr_surge x{a.lr_ratio:.1f}"
    if rule := _early("early_loss", baselines.loss, frame.loss, EARLY_LOSS_RATIO):
        return rule
    if a.loss_z is not None and a.loss_z >= c.loss_spike_z and _loss_confirmed(frame, a, baselines):
        return f"loss_spike z={a.loss_z:.1f}"
    return None


def _early(name: str, window: RollingWindow, value: float | None, bar: float) -> str | None:
    """`value` >= `bar` x the median of the `n` values seen so far (1 <= n < MIN_HISTORY; 2x bar below EARLY_FLOOR)."""
    n = len(window)
    if value is None or not math.isfinite(value) or not 1 <= n < MIN_HISTORY:
        return None
    if (baseline := window.median() or 0.0) <= 0.0:
        return None  # a ratio to a non-positive baseline means nothing
    ratio = value / baseline
    return None if ratio < (bar if n >= EARLY_FLOOR else 2.0 * bar) else \
        f"{name} x{ratio:.1f} (median of {n} step{'s' if n > 1 else ''})"


def _early_lr(frame: SignalFrame, baselines: Baselines, c: PolicyParams) -> str | None:
    """Before `MIN_HISTORY` rates: `lr > lr_surge_ratio**2` x the highest rate seen (warm-up at most doubles it)."""
    n, lr = len(baselines.lr), frame.lr
    if lr is None or not math.isfinite(lr) or not 1 <= n < MIN_HISTORY:
        return None
    ref = max(baselines.lr)
    return None if ref <= 0.0 or lr <= c.lr_surge_ratio**2 * ref else f"early_lr x{lr / ref:.1f}"


def _first_step(frame: SignalFrame, baselines: Baselines) -> str | None:
    """No gradient seen yet: a pre-clip norm `>= FIRST_STEP_CLIP_RATIO` x the clip norm."""
    g, clip = frame.grad_norm, frame.clip_norm
    if len(baselines.grad) or g is None or clip is None or not math.isfinite(g) or not clip > 0.0:
        return None
    return None if g < FIRST_STEP_CLIP_RATIO * clip else f"first_step grad_norm {g:.4g} = x{g / clip:.0f} the clip " \
                                                          f"norm {clip:g}"


def _loss_confirmed(frame: SignalFrame, a: Assessment, baselines: Baselines) -> bool:
    """A loss spike captures when large, confirmed by the gradients, or without a gradient signal (a hard batch with
    ordinary gradients barely moves the weights)."""
    if a.loss_ratio is not None and a.loss_ratio >= LOSS_JUMP_RATIO:
        return True
    if len(baselines.loss) < CAPTURE_WARMUP:
        return False  # early: only a doubled loss counts
    if frame.grad_norm is None and frame.lora_max_ratio is None:
        return True
    return any(v is not None and v >= GRAD_CONFIRM_RATIO for v in (a.grad_ratio, a.lora_ratio))


@dataclass(frozen=True)
class Interval:
    """The regular interval (a save once `round(steps)` steps passed), its base, and the `reason` of a save at it."""
    steps: float
    base: float
    reason: str


# The policy state's plain values in their JSON order: (part, key) -> (attribute, how a saved value is read: converted
# by a function, or, for the triggers' flags, checked against the JSON types it may have).
_PLAIN: dict[tuple[str, str], tuple[str, Callable[[Any], Any] | tuple[type, ...]]] = {
    ("cadence", "train_time_s"): ("train_time_s", float), ("cadence", "blocking_s"): ("blocking_s", float),
    ("cadence", "last_save_step"): ("last_save_step", lambda v: None if v is None else int(v)),
    ("cadence", "saves"): ("saves", int), ("cadence", "budget_warned"): ("budget_warned", bool),
    ("smoother", "prev_beta"): ("prev_beta", float), ("smoother", "prev_training"): ("prev_training_beta", float),
    ("capture", "last_step"): ("last_capture", (int, type(None))),
    ("capture", "prev_nonfinite"): ("prev_nonfinite", (bool,)),
    ("preemption", "done"): ("preempted", (bool,)), ("edge", "armed"): ("edge_armed", (bool,)),
    ("memory", "armed"): ("memory_armed", (bool,)), ("health", "poisoned"): ("poisoned", (bool,)),
}


def _read(value: Any, read: Callable[[Any], Any] | tuple[type, ...], where: str) -> Any:
    """A saved plain value, converted or type-checked (see `_PLAIN`)."""
    if not isinstance(read, tuple):
        return read(value)
    if not isinstance(value, read) or (bool not in read and isinstance(value, bool)):
        raise ConfigError(f"policy state: {where}={value!r} is invalid: expected "
                          f"{' or '.join('null' if t is type(None) else t.__name__ for t in read)}.")
    return value


class RulePolicy:
    """When to save and what (docs/policy.md section 2): the regular interval, the risk's rising edge, a memory
    ramp, preemption, the pre-update capture; with `policy.learned_model`, a `LearnedCheck` (`learned`) beside them."""

    def __init__(self, config: SmartCkptConfig | None = None) -> None:
        self.config = config or SmartCkptConfig()
        c = self.config.policy
        self.cooldown = c.capture_cooldown if c.capture_cooldown is not None else c.stability_window
        self._model = load_model(c.learned_model) if c.learned_model is not None else None  # errors now
        self.memory_tier = False  # the newest state is kept in host memory too: the interval follows node_mtbf_hours
        self._reset()
        self._pre_step: int | None = None  # step whose pre_update ran (transient: within one step)
        self._skip_step: int | None = None  # step whose update pre_update asked to skip
        self.last_bad_update: str | None = None  # the capture rule that fired in the last pre_update, or None
        self.last_beta = 0.0  # the raw (unsmoothed) risk of the step judged last, for the step log

    def _reset(self) -> None:
        """A fresh state: empty statistics, every trigger armed, nothing saved."""
        self.baselines = Baselines(self.config.policy)
        self.step_time, self.save_cost = Ema(0.9), Ema(0.5)
        self.train_time_s = self.blocking_s = 0.0
        self.last_save_step: int | None = None
        self.saves, self.budget_warned = 0, False
        n = self.config.policy.risk_smoothing
        self.betas: deque[float] = deque(maxlen=n)  # debounced raw betas, all components
        self.training_betas: deque[float] = deque(maxlen=n)  # ... without memory and non-finite
        self.prev_beta = self.prev_training_beta = 0.0
        self.last_capture: int | None = None
        self.prev_nonfinite = self.preempted = self.poisoned = False
        self.edge_armed = self.memory_armed = True
        self.learned = LearnedCheck(self._model) if self._model is not None else None
        self.suppressed: set[str] = set()  # triggers whose suppression was logged (once per episode)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)  # loss, grad norm, lr, risk, the decision
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISION_HISTORY)  # to_dict() and the step taken at

    @property
    def alpha(self) -> float:
        """Stability factor in [0.2, 1]: `stability_cv / cv`, cv = loss noise / loss baseline (scale-free)."""
        loss = self.baselines.loss
        noise, baseline = loss.diff_noise(), loss.median()
        if len(loss) < MIN_HISTORY or not noise or not baseline:
            return 1.0
        return min(1.0, max(MIN_ALPHA, self.config.policy.stability_cv / (noise / abs(baseline))))

    @property
    def risk(self) -> float:
        """Smoothed risk beta: mean over `risk_smoothing` steps of the debounced raw beta."""
        return sum(self.betas) / len(self.betas) if self.betas else 0.0

    @property
    def training_risk(self) -> float:
        """`risk` without memory and non-finite values: whether the weights themselves are at risk."""
        return sum(self.training_betas) / len(self.training_betas) if self.training_betas else 0.0

    def current_interval(self) -> Interval:
        """The base, shortened by stability and risk, widened by the budget if derived, clamped."""
        c, cost, step = self.config.policy, self.save_cost.value, self.step_time.value
        if self.config.base_interval is not None:
            base, source = float(self.config.base_interval), FROM_USER
        elif cost is None or not step:  # the first save measures the cost
            base, source = float(c.stability_window), FROM_BOOTSTRAP
        else:  # with the memory tier its slots cover the process failures: the disk covers the node's
            mtbf = c.node_mtbf_hours if self.memory_tier else c.mtbf_hours
            base, source = math.sqrt(2.0 * cost * mtbf * 3600.0) / step, FROM_YOUNG_DALY
        base, alpha, risk = self._clamp(base), self.alpha, self.risk
        t = base * alpha / (1.0 + c.risk_gain * risk)
        steps = self._clamp(t)
        why = ", shortened by risk" if round(steps) < round(base) else ""
        if source != FROM_USER:  # an interval the user set is never widened (the budget warning says so once)
            wide = self._clamp(max(t, cost / (c.overhead_budget * step) if cost is not None and step else 0.0))
            why += f", widened by overhead_budget {c.overhead_budget:.1%}" if round(wide) > round(steps) else ""
            steps = wide
        return Interval(steps, base, f"interval {round(steps)} (base {base:.0f} {source}{why}, alpha {alpha:.2f}, "
                                     f"beta {risk:.2f})")

    def _clamp(self, t: float) -> float:
        return min(float(self.config.policy.max_interval), max(float(self.config.policy.min_interval), t))

    def pre_update(self, frame: SignalFrame) -> Decision:
        """Before `optimizer.step()` (weights of `frame.step - 1`): a `capture_rule` saves that state, pinned (finite
        rules once per `capture_cooldown`, non-finite on the first of a run); `skip_update`: `skip_bad_update`."""
        c = self.config.policy
        self._pre_step = frame.step
        rule, early = self._judge(frame)[1], None
        if self.learned is not None:  # may veto a soft rule's capture, or ask for one the rules do not take
            rule, early, veto = self.learned.review(frame, rule, self.baselines.loss.median())
            if veto:
                logger.debug("step %d: %s", frame.step, veto)
        self.last_bad_update, nonfinite = rule, frame.any_nonfinite
        skip = c.skip_bad_update and rule is not None
        self._skip_step = frame.step if skip else None
        was_nonfinite, self.prev_nonfinite = self.prev_nonfinite, nonfinite
        healthy = not self.poisoned
        self.poisoned = self.poisoned or (nonfinite and not skip)  # the NaN/inf update is about to be applied
        if rule is None or not c.pre_anomaly_capture:
            if early is not None and c.pre_anomaly_capture and healthy and self.learned is not None and (
                    learned := self.learned.capture(frame, early, self.risk, self.current_interval().steps,
                                                    self.cooldown)):
                return self._record(learned, frame.step)
            return Decision(save=False, skip_update=skip, risk=self.risk, healthy=healthy) if skip else NO_SAVE
        why = ("state already unhealthy (a non-finite update was applied)" if not healthy else
               "non-finite run already captured" if nonfinite and was_nonfinite else None)
        if why is None and not nonfinite and self.last_capture is not None and (
                since := frame.step - self.last_capture) < self.cooldown:
            why = f"capture cooldown ({since} of {self.cooldown} steps since the capture at step {self.last_capture})"
        if why:
            self._suppress("capture", frame.step, f"pre-update capture ({rule}) suppressed: {why}")
            return Decision(save=False, skip_update=skip, reason=f"suppressed: {rule}", risk=self.risk, healthy=healthy)
        self.last_capture = frame.step
        self.suppressed.discard("capture")
        return self._record(Decision(save=True, tiers=ALL_TIERS, reason=f"pre_update {rule}", pin=True, pre_update=True,
                                     skip_update=skip, risk=self.risk, step=frame.step - 1, healthy=True,
                                     interval=self.current_interval().steps, kind=DecisionKind.CAPTURE), frame.step)

    def decide(self, frame: SignalFrame) -> Decision:
        """Whether to save step `frame.step` after its update (preemption, risk edge, memory ramp, interval, in that
        order). Once per optimizer step: it folds the frame into the statistics."""
        step, c = frame.step, self.config.policy
        if self.last_save_step is None:
            self.last_save_step = step - 1  # the state training started from counts as saved
        t, b = frame.step_time_s, frame.save_blocking_s  # b: the saves since the previous frame (None or 0: none)
        if t is not None and math.isfinite(t) and t > 0:
            self.step_time.add(t)
            self.train_time_s += t
        if b is not None and math.isfinite(b) and b > 0:
            self.save_cost.add(b)
            self.blocking_s += b
        if warning := self._over_budget():
            logger.warning("step %d: %s", step, warning)
        a, rule = self._judge(frame)
        beta, training = a.beta, a.training_beta  # debounced: a risk counts once seen on two steps in a row
        self.betas.append(min(beta, self.prev_beta))
        self.training_betas.append(min(training, self.prev_training_beta))
        self.prev_beta, self.prev_training_beta = beta, training
        if frame.any_nonfinite:
            self.poisoned = self.poisoned or self._pre_step != step  # no pre_update saw it: the update went through
        elif frame.loss is not None or frame.grad_norm is not None:
            self.poisoned = False  # finite signals computed from the current weights: they are sane
        if frame.mem_frac is not None and math.isfinite(frame.mem_frac):
            self.baselines.mem.append((step, frame.mem_frac))  # new samples only: the trend is fitted on real points
        why = ""  # why the state after this step's update is no sane restore point
        if self.poisoned:
            why = "a non-finite update was applied"
        elif rule is not None and self._skip_step != step:  # a skipped update left the weights as they were
            why = f"this step's update was bad: {rule}"
        elif self.training_risk >= c.risk_threshold:
            why = f"training risk {self.training_risk:.2f} >= risk_threshold {c.risk_threshold}"
        decision = self._choose(frame, a, healthy=not why)
        if self.learned is not None:  # a cheaper tier set, or an early save under memory pressure
            may_save = not why and step - self.last_save_step >= c.min_interval  # healthy, past min_interval
            decision = self.learned.after_update(frame, decision, may_save=may_save, cooldown=self.cooldown)
        if decision.save and why:
            logger.debug("step %d: the checkpoint of step %d is marked unhealthy (%s)", step, step, why)
        self.baselines.fold(frame)  # after judging the frame, so a spike is measured against the past
        self.history.append({"step": step, "loss": _j(frame.loss), "grad_norm": _j(frame.grad_norm), "lr": _j(frame.lr),
                             "risk": round(self.risk, 6), "interval": round(decision.interval, 3),
                             "save": decision.save, "reason": decision.reason})
        return self._record(decision, step) if decision.save else decision

    def _judge(self, frame: SignalFrame) -> tuple[Assessment, str | None]:
        """The frame's assessment and capture rule (pure: the baselines only change at the end of `decide`, so
        `pre_update` and `decide` judge a frame alike)."""
        a = self.baselines.assess(frame)
        self.last_beta = a.beta
        return a, capture_rule(frame, a, self.baselines, self.config.policy)

    def _choose(self, frame: SignalFrame, a: Assessment, *, healthy: bool) -> Decision:
        c, step = self.config.policy, frame.step
        assert self.last_save_step is not None
        beta, interval, since = self.risk, self.current_interval(), step - self.last_save_step

        def save(reason: str, kind: DecisionKind, tiers: frozenset[Tier] = ALL_TIERS) -> Decision:
            return Decision(save=True, tiers=tiers, reason=reason, risk=beta, step=step, healthy=healthy,
                            interval=interval.steps, kind=kind)

        if frame.preempt and not self.preempted:
            self.preempted = True
            return save("preemption", DecisionKind.PREEMPTION)
        if frame.preempt:
            self._suppress("preempt", step, "preemption flag still set: final save already taken")
        if self.poisoned:  # writing NaN weights would only push healthy restore points out of retention
            self._suppress("poisoned", step, "saves paused: a non-finite update was applied (state unhealthy)")
            return Decision(save=False, risk=beta, interval=interval.steps, healthy=False)
        self.suppressed.discard("poisoned")
        self.edge_armed = self.edge_armed or beta < c.risk_release  # hysteresis: re-armed below risk_release
        if self.edge_armed and beta < c.risk_threshold:
            self.suppressed.discard("edge")
        elif self.edge_armed:
            self.edge_armed = False
            detail = ", ".join(f"{k}={v:.2f}" for k, v in sorted(a.components.items()) if v > 0)
            reason = f"risk_edge beta={beta:.2f} ({detail or 'smoothed'})"
            if since < c.min_interval:
                self._suppress("edge", step, f"{reason} suppressed: {since} < min_interval {c.min_interval}")
            elif (cost := self.save_cost.value) is not None and self.train_time_s > 0.0 and (
                    self.blocking_s + cost) > c.overhead_budget * self.train_time_s:
                self._suppress("edge", step, f"{reason} suppressed: over overhead_budget {c.overhead_budget:.1%}")
            else:
                memory = a.beta > 0.0 and max(a.components, key=a.components.__getitem__) == MEMORY  # the driver
                return save(reason, DecisionKind.RISK_EDGE, MINIMAL_TIERS if memory else ALL_TIERS)
        forecast = self.baselines.memory_forecast()
        if forecast is not None:  # fires once; re-armed once the forecast falls 5 points below (a plateau saves once)
            current, predicted = forecast
            if self.memory_armed and current < c.memory_threshold <= predicted:
                self.memory_armed = False
                reason = f"memory_ramp {current:.1%} -> {predicted:.1%} within {c.memory_lookahead} steps"
                if since >= c.min_interval:
                    return save(reason, DecisionKind.MEMORY, MINIMAL_TIERS)
                self._suppress("memory", step, f"{reason} suppressed: {since} < min_interval {c.min_interval}")
            elif not self.memory_armed and predicted < c.memory_threshold - 0.05:
                self.memory_armed = True
        if self.memory_armed:
            self.suppressed.discard("memory")
        if since >= round(interval.steps):
            return save(interval.reason, DecisionKind.INTERVAL)
        return Decision(save=False, risk=beta, interval=interval.steps, healthy=healthy)

    def _over_budget(self) -> str | None:
        """Once per run: the message for an explicit `base_interval` whose saves cost more than `overhead_budget`."""
        c, cost, step = self.config, self.save_cost.value, self.step_time.value
        if c.base_interval is None or self.budget_warned or self.save_cost.count < BUDGET_WARN_AFTER or not step:
            return None
        assert cost is not None
        overhead, budget = cost / (c.base_interval * step), c.policy.overhead_budget
        if overhead <= budget:
            return None
        self.budget_warned = True
        return (f"base_interval={c.base_interval}: a save blocks training {cost:.3f} s every {c.base_interval} steps "
                f"of {step:.3f} s, {overhead:.1%} of training time, above overhead_budget={budget:.1%}. The interval "
                f"you set is kept; base_interval={math.ceil(cost / (budget * step))} would stay within the budget "
                "(or raise policy.overhead_budget, or leave base_interval unset to let the library choose).")

    def _suppress(self, key: str, step: int, message: str) -> None:
        if key not in self.suppressed:
            self.suppressed.add(key)
            logger.debug("step %d: %s", step, message)

    def _record(self, decision: Decision, step: int) -> Decision:
        assert decision.step is not None
        self.last_save_step = decision.step if self.last_save_step is None else max(self.last_save_step, decision.step)
        self.saves += 1
        entry = {"at_step": step, **decision.to_dict()}
        self.decisions.append(entry)
        logger.debug("step %d: save step %d (%s) tiers=%s%s%s", step, decision.step, decision.reason,
                     ",".join(entry["tiers"]), " pinned" if decision.pin else "",
                     "" if decision.healthy else " unhealthy")
        return decision

    def debug_info(self) -> list[dict[str, Any]]:
        """The last `DEBUG_INFO_STEPS` steps' loss, grad norm and learning rate (for the manifest)."""
        return [{k: h[k] for k in ("step", "loss", "grad_norm", "lr")} for h in list(self.history)[-DEBUG_INFO_STEPS:]]

    def state_dict(self) -> dict[str, Any]:
        """The whole state as strict JSON (docs/policy.md section 4), so a resumed run decides exactly the same."""
        state: dict[str, Any] = {"version": STATE_VERSION, "levels": self.baselines.state_dict(),
                                 "cadence": {"step_time": self.step_time.state_dict(),
                                             "save_cost": self.save_cost.state_dict()},
                                 "smoother": {"beta": list(self.betas), "training": list(self.training_betas)}}
        for (part, key), (attr, _) in _PLAIN.items():
            state.setdefault(part, {})[key] = getattr(self, attr)
        if self.learned is not None:
            state["learned"] = self.learned.state_dict()
        return state | {"suppressed": sorted(self.suppressed), "history": list(self.history),
                        "decisions": list(self.decisions)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`, all or nothing (`ConfigError`: unknown version or malformed); version 1 warms up
        again, with a warning."""
        version = state.get("version")
        if version == 1:
            logger.warning("policy state version 1 (an older release) is not restored: the statistics warm up "
                           "again from the next step (early rules guard the first steps).")
            return self._reset()
        if version != STATE_VERSION:
            raise ConfigError(f"policy state version={version!r} is not supported: expected {STATE_VERSION} (or 1, "
                              "which restarts the statistics).")
        fresh = copy.copy(self)
        fresh._reset()  # filled from `state`, then taken over whole
        try:
            fresh.baselines.load_state_dict(state["levels"])
            for key in ("step_time", "save_cost"):
                getattr(fresh, key).load_state_dict(state["cadence"][key])
            for (part, key), (attr, read) in _PLAIN.items():
                setattr(fresh, attr, _read(state[part][key], read, f"{part}.{key}"))
            if fresh.learned is not None and "learned" in state:  # saved without the model: the model starts afresh
                fresh.learned.load_state_dict(state["learned"])
            fresh.betas.extend(float(v) for v in state["smoother"]["beta"])
            fresh.training_betas.extend(float(v) for v in state["smoother"]["training"])
            fresh.suppressed = {str(k) for k in state["suppressed"]}
            fresh.history.extend(state["history"])
            fresh.decisions.extend(state["decisions"])
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"policy state is malformed ({type(e).__name__}: {e}); it was not written by "
                              "RulePolicy.state_dict() of this version: start without it.") from e
        vars(self).update(vars(fresh))


Verdict = enum.StrEnum("Verdict", {"NONE": "none", "ROLLBACK": "rollback", "EXHAUSTED": "exhausted"})


@dataclass(frozen=True)
class RollbackVerdict:
    """The rule's answer: the anomaly's first bad step (`onset`) and the oldest step a restore point may have."""
    verdict: Verdict = Verdict.NONE
    onset: int | None = None
    reason: str = ""
    earliest: int = 0


NO_ROLLBACK = RollbackVerdict()


@dataclass
class RollbackRule:
    """When a confirmed anomaly rolls back (docs/rollback.md): `rollback_patience` bad updates in a row from the
    onset, unless `max_rollbacks` were taken within `rollback_window`. Its state is the run's history: *not* restored
    from the restore point a rollback returns to (a run never forgets that it rolled back)."""
    streak: int = 0
    onset: int | None = None
    first_reason: str = ""
    taken: list[int] = field(default_factory=list)

    def observe(self, step: int, rule: str | None, config: SmartCkptConfig) -> RollbackVerdict:
        """One optimizer step: `rule` is why its update is bad (`None`: it is not)."""
        c = config.policy
        if config.on_anomaly != OnAnomaly.ROLLBACK:
            return NO_ROLLBACK
        if rule is None:
            self.reset()
            return NO_ROLLBACK
        if self.streak == 0:
            self.onset, self.first_reason = step, rule
        self.streak += 1
        if self.streak < c.rollback_patience:
            return NO_ROLLBACK
        onset = self.onset if self.onset is not None else step
        reason = self.first_reason if self.streak == 1 else f"{self.first_reason}; {self.streak} bad steps in a row"
        earliest = max(0, step - c.rollback_window)
        recent = [s for s in self.taken if s >= earliest]
        if len(recent) >= c.max_rollbacks:
            return RollbackVerdict(Verdict.EXHAUSTED, onset, f"{reason}; {len(recent)} rollbacks within the last "
                                   f"{c.rollback_window} steps (max_rollbacks={c.max_rollbacks})", earliest)
        return RollbackVerdict(Verdict.ROLLBACK, onset, reason, earliest)

    def taken_at(self, step: int) -> None:
        """A rollback was taken at `step`: the anomaly is over (its bad steps are gone with the restore)."""
        self.taken.append(step)
        self.reset()

    def reset(self) -> None:
        """No anomaly in progress (a calm step, a rollback taken, or one that found no restore point)."""
        self.streak, self.onset, self.first_reason = 0, None, ""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak, onset = int(state.get("streak") or 0), state.get("onset")
        self.onset = int(onset) if isinstance(onset, int) else None
        self.first_reason = str(state.get("first_reason") or "")
        self.taken = [int(s) for s in state.get("taken") or [] if isinstance(s, int)]

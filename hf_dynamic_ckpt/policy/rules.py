"""The rule policy: a dynamic save interval, risk-triggered saves and pre-anomaly capture.

Pure: input `SignalFrame`s (and save-cost feedback), output `Decision`s. No I/O, no
clock, no torch, so every behaviour is a unit test on a list of numbers. See
`docs/policy.md` for the formulas and every knob.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import SmartCkptConfig
from ..constants import ALL_TIERS, DEBUG_INFO_STEPS, Tier
from ..jsonutil import safe_float as _j
from ..signals.frame import SignalFrame
from ..signals.stats import MAD_TO_STD, Ema, RollingWindow, linear_fit, ramp
from .decision import MINIMAL_TIERS, NO_SAVE, Decision, DecisionKind

logger = logging.getLogger(__name__)

STATE_VERSION = 1
GRAD_LEVEL_WINDOW = 50  # grad-norm steps whose median is the running level
MIN_HISTORY = 8  # values a statistic needs before it may raise risk
CAPTURE_WARMUP = 20  # grad-norm / loss values before an ordinary (not extreme) surge may trigger a capture
GRAD_SPREAD_K = 3.0  # a grad surge must also clear exp(k * relative spread) x the level (noisy runs need more)
LOSS_JUMP_RATIO = 2.0  # a loss spike alone (no gradient evidence) captures only at >= 2x the loss level
GRAD_CONFIRM_RATIO = 2.0  # ... or when the global / LoRA gradient ratio confirms it
MEM_POINTS = 6  # memory samples in the trend fit
LOSS_REL_FLOOR = 0.01  # a loss z-score never uses a scale below 1 % of the loss level
MIN_ALPHA = 0.2  # the article's 1 - 0.8: stability can shorten the interval 5x at most
HISTORY_STEPS = 100
DECISION_HISTORY = 1000


@dataclass
class Assessment:
    """Risk components of one frame (each in [0, 1]) and the raw statistics behind them."""

    loss_z: float | None = None
    grad_ratio: float | None = None
    grad_excess: float | None = None
    loss_ratio: float | None = None
    lora_ratio: float | None = None
    lr_ratio: float | None = None
    mem: float | None = None
    components: dict[str, float] = field(default_factory=dict)

    @property
    def beta(self) -> float:
        return max(self.components.values(), default=0.0)

    @property
    def driver(self) -> str | None:
        if not self.components or self.beta <= 0.0:
            return None
        return max(self.components, key=lambda k: self.components[k])


class RulePolicy:
    """Decides when to save and what, from per-step signals.

    - Regular saves every `T = T_base * alpha / (1 + risk_gain * beta)` steps, where
      `T_base` is `config.base_interval` or Young/Daly `sqrt(2 * C * MTBF)` (C = measured
      blocking save cost, converted to steps with the measured step time), `alpha` in
      [0.2, 1] shrinks it when the loss is noisy (scale-free), `beta` is the smoothed risk;
      clamped to `[min_interval, max_interval]` and widened to keep blocking time within
      `overhead_budget`.
    - An immediate save on the rising edge of the smoothed risk past `risk_threshold`
      (re-armed below `risk_release`); a minimal save (weights + state) when memory is
      predicted to cross `memory_threshold` within `memory_lookahead` steps.
    - `pre_update()`: a surge or non-finite gradient seen before the optimizer step asks
      for a pinned save of the still-healthy state (`pre_update=True`).
    - A preemption flag asks for one full save, once.

    Args:
        config (`SmartCkptConfig`, *optional*): knobs; defaults to `SmartCkptConfig()`.

    Example:
        ```python
        >>> policy = RulePolicy(SmartCkptConfig(base_interval=4))
        >>> [policy.decide(SignalFrame(step=s, loss=2.0)).save for s in range(1, 9)]
        [False, False, False, True, False, False, False, True]
        ```
    """

    def __init__(self, config: SmartCkptConfig | None = None) -> None:
        self.config = config or SmartCkptConfig()
        c = self.config
        self.cooldown = c.capture_cooldown if c.capture_cooldown is not None else c.stability_window
        self._loss = RollingWindow(c.stability_window)
        self._grad = RollingWindow(min(c.stability_window, GRAD_LEVEL_WINDOW))
        self._risk: deque[float] = deque(maxlen=c.risk_smoothing)
        self._mem: deque[tuple[int, float]] = deque(maxlen=MEM_POINTS)
        self._step_time = Ema(0.9)
        self._save_cost = Ema(0.5)
        self.train_time_s = 0.0
        self.blocking_s = 0.0
        self.last_save_step: int | None = None
        self.last_capture_step: int | None = None
        self.saves = 0
        self._edge_armed = True
        self._mem_armed = True
        self._preempt_done = False
        self._poisoned = False
        self._prev_nonfinite = False
        self._prev_beta = 0.0
        self._lr: deque[float] = deque(maxlen=c.stability_window)
        self._forecast: tuple[int | None, tuple[float, float] | None] = (None, None)
        self._pre_step: int | None = None
        self._suppressed: set[str] = set()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISION_HISTORY)

    # ------------------------------------------------------------------ statistics
    def assess(self, frame: SignalFrame) -> Assessment:
        """Risk components of `frame` against the running levels (does not update them)."""
        c = self.config
        a = Assessment()
        if frame.any_nonfinite:
            a.components["nonfinite"] = 1.0
        if frame.loss is not None and math.isfinite(frame.loss) and len(self._loss) >= MIN_HISTORY:
            a.loss_z = self._loss.robust_z(frame.loss, rel_floor=LOSS_REL_FLOOR)
            level = self._loss.median()
            if level:
                a.loss_ratio = frame.loss / abs(level)
            if a.loss_z is not None:
                a.components["loss_spike"] = ramp(a.loss_z, c.loss_spike_z / 2, c.loss_spike_z)
        if frame.grad_norm is not None and math.isfinite(frame.grad_norm) and len(self._grad) >= MIN_HISTORY:
            level = self._grad.median() or 0.0
            a.grad_ratio = frame.grad_norm / max(level, 1e-12)
            spread = MAD_TO_STD * (self._grad.mad() or 0.0) / max(level, 1e-12)  # ~ sd of log(grad norm)
            a.grad_excess = a.grad_ratio / math.exp(GRAD_SPREAD_K * spread)
            a.components["grad_surge"] = ramp(a.grad_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        if frame.lora_max_ratio is not None and math.isfinite(frame.lora_max_ratio):
            a.lora_ratio = frame.lora_max_ratio
            a.components["lora_surge"] = ramp(a.lora_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        lr_ref = max(self._lr, default=0.0)
        if frame.lr is not None and math.isfinite(frame.lr) and len(self._lr) >= MIN_HISTORY and lr_ref > 0:
            a.lr_ratio = frame.lr / lr_ref
            r = c.lr_surge_ratio
            a.components["lr_surge"] = ramp(a.lr_ratio, (1.0 + r) / 2.0, r)
        mem = frame.mem_frac
        if mem is None and self._mem:
            mem = self._mem[-1][1]  # memory is sampled every few steps: the last sample stands
        if mem is not None and math.isfinite(mem):
            a.mem = mem
            a.components["memory"] = ramp(mem, c.memory_threshold - 0.1, c.memory_threshold)
        return a

    @property
    def alpha(self) -> float:
        """Stability factor in [0.2, 1]: `stability_cv / cv`, cv = loss noise / loss level."""
        if len(self._loss) < MIN_HISTORY:
            return 1.0
        noise, level = self._loss.diff_noise(), self._loss.median()
        if not noise or not level:
            return 1.0
        cv = noise / abs(level)
        return min(1.0, max(MIN_ALPHA, self.config.stability_cv / cv))

    @property
    def risk(self) -> float:
        """Smoothed risk beta: mean over `risk_smoothing` steps of the debounced raw beta
        (`min` of this and the previous step's), so one-step blips do not count."""
        return sum(self._risk) / len(self._risk) if self._risk else 0.0

    @property
    def step_time_s(self) -> float | None:
        return self._step_time.value

    @property
    def save_cost_s(self) -> float | None:
        return self._save_cost.value

    def base_interval(self) -> float:
        """`T_base` in steps: `config.base_interval`, else Young/Daly from measured costs.

        Before any save cost or step time is known the base is `stability_window` steps (the
        first save then measures the cost). Clamped to `[min_interval, max_interval]`.
        """
        c = self.config
        if c.base_interval is not None:
            base = float(c.base_interval)
        elif self.save_cost_s is None or not self.step_time_s:
            base = float(c.stability_window)
        else:
            base = math.sqrt(2.0 * self.save_cost_s * c.mtbf_hours * 3600.0) / self.step_time_s
        return min(float(c.max_interval), max(float(c.min_interval), base))

    def budget_interval(self) -> float:
        """Fewest steps between saves that keeps blocking time within `overhead_budget`."""
        if self.save_cost_s is None or not self.step_time_s:
            return 0.0
        return self.save_cost_s / (self.config.overhead_budget * self.step_time_s)

    def interval(self) -> float:
        """Current regular interval in steps: `T_base * alpha / (1 + k * beta)`, widened by the
        budget, clamped to `[min_interval, max_interval]` (`max_interval` wins over the budget)."""
        c = self.config
        t = self.base_interval() * self.alpha / (1.0 + c.risk_gain * self.risk)
        t = max(t, self.budget_interval())
        return min(float(c.max_interval), max(float(c.min_interval), t))

    def _within_budget(self) -> bool:
        if self.save_cost_s is None or self.train_time_s <= 0.0:
            return True
        return (self.blocking_s + self.save_cost_s) <= self.config.overhead_budget * self.train_time_s

    def _memory_forecast(self) -> tuple[float, float] | None:
        """(current, predicted in `memory_lookahead` steps) from a line through recent samples."""
        key = self._mem[-1][0] if self._mem else None
        if self._forecast[0] != key:  # refit only when a new sample arrived
            self._forecast = (key, self._fit_memory())
        return self._forecast[1]

    def _fit_memory(self) -> tuple[float, float] | None:
        if len(self._mem) < 3:
            return None
        fit = linear_fit(list(self._mem))
        if fit is None:
            return None
        slope, intercept = fit
        step, current = self._mem[-1]
        predicted = slope * (step + self.config.memory_lookahead) + intercept
        return current, (predicted if slope > 0 else current)

    # ------------------------------------------------------------------ decisions
    def pre_update(self, frame: SignalFrame) -> Decision:
        """Check the step's gradients before `optimizer.step()`: capture the pre-update state?

        Called when gradients are complete and the weights are still those of step
        `frame.step - 1`. A non-finite value, a global or LoRA-layer grad-norm surge
        (`>= grad_surge_ratio` x running level), a learning-rate jump (`> lr_surge_ratio`
        x the highest rate of the last `stability_window` steps; `frame.lr` is the rate this update will use) or a
        loss spike (robust z >= `loss_spike_z`) asks to save that state now, pinned and healthy. Finite triggers
        have a cooldown of `capture_cooldown` steps (one capture per episode, no storms);
        non-finite ones fire on the first of a run of non-finite steps.

        Args:
            frame (`SignalFrame`): this step's loss and gradient signals (reduced across ranks).

        Returns:
            `Decision`: `save=True, pre_update=True, pin=True` with `step = frame.step - 1`,
            or no save; `skip_update` follows `skip_bad_update` for any bad update.
        """
        c = self.config
        self._pre_step = frame.step
        a = self.assess(frame)
        nonfinite = frame.any_nonfinite
        trigger = None
        r = c.grad_surge_ratio
        # Before CAPTURE_WARMUP values only an extreme jump captures (r^2 for the grad norm, a
        # doubled loss): early training moves the norms far more than later noise does.
        grad_bar = r if len(self._grad) >= CAPTURE_WARMUP else r * r
        if nonfinite:
            trigger = "nonfinite"
        elif a.grad_ratio is not None and a.grad_excess is not None and a.grad_excess >= grad_bar:
            trigger = f"grad_surge x{a.grad_ratio:.1f}"
        elif a.lora_ratio is not None and a.lora_ratio >= r:
            trigger = f"lora_surge x{a.lora_ratio:.1f} in {frame.lora_max_layer}"
        elif a.lr_ratio is not None and a.lr_ratio > c.lr_surge_ratio:
            trigger = f"lr_surge x{a.lr_ratio:.1f}"
        elif a.loss_z is not None and a.loss_z >= c.loss_spike_z and self._loss_confirmed(frame, a):
            trigger = f"loss_spike z={a.loss_z:.1f}"
        skip = c.skip_bad_update and trigger is not None
        was_nonfinite, self._prev_nonfinite = self._prev_nonfinite, nonfinite
        healthy = not self._poisoned
        if nonfinite and not skip:
            self._poisoned = True  # the NaN/inf update is about to be applied
        if trigger is None or not c.pre_anomaly_capture:
            return Decision(save=False, skip_update=skip, risk=self.risk) if skip else NO_SAVE
        suppressed = None
        if not healthy:
            suppressed = "state already unhealthy (a non-finite update was applied)"
        elif nonfinite and was_nonfinite:
            suppressed = "non-finite run already captured"
        elif not nonfinite and self.last_capture_step is not None and frame.step - self.last_capture_step < self.cooldown:
            suppressed = (f"capture cooldown ({frame.step - self.last_capture_step} of {self.cooldown} steps "
                          f"since the capture at step {self.last_capture_step})")
        if suppressed:
            self._suppress("capture", frame.step, f"pre-update capture ({trigger}) suppressed: {suppressed}")
            return Decision(save=False, skip_update=skip, reason=f"suppressed: {trigger}", risk=self.risk)
        self._suppressed.discard("capture")
        self.last_capture_step = frame.step
        decision = Decision(save=True, tiers=ALL_TIERS, reason=f"pre_update {trigger}", pin=True, pre_update=True,
                            skip_update=skip, risk=self.risk, step=frame.step - 1, healthy=True,
                            interval=self.interval(), kind=DecisionKind.CAPTURE)
        self._record(decision, frame.step)
        return decision

    def _loss_confirmed(self, frame: SignalFrame, a: Assessment) -> bool:
        """A loss spike is worth a pinned capture when it is large (>= `LOSS_JUMP_RATIO` x the
        level), or the gradients confirm it (global or LoRA ratio >= `GRAD_CONFIRM_RATIO`),
        or no gradient signal exists. One-step loss jumps with ordinary gradients (a hard
        batch) do not move the weights much and are only noise for the interval."""
        if a.loss_ratio is not None and a.loss_ratio >= LOSS_JUMP_RATIO:
            return True
        if len(self._loss) < CAPTURE_WARMUP:
            return False  # early: only a doubled loss counts
        if frame.grad_norm is None and frame.lora_max_ratio is None:
            return True
        return any(v is not None and v >= GRAD_CONFIRM_RATIO for v in (a.grad_ratio, a.lora_ratio))

    def decide(self, frame: SignalFrame) -> Decision:
        """Decide after the step's update whether to save the state of step `frame.step`.

        Also folds the frame into the running statistics (loss window, grad level, risk,
        memory trend, step time), so call it exactly once per optimizer step.

        Args:
            frame (`SignalFrame`): this step's signals (reduced across ranks).

        Returns:
            `Decision`: in priority order preemption (full, once), the rising edge of the
            smoothed risk, a memory ramp (minimal tiers), the regular interval; else no save.
        """
        step = frame.step
        if self.last_save_step is None:
            self.last_save_step = step - 1  # the state training started from counts as saved
        if frame.step_time_s is not None and math.isfinite(frame.step_time_s) and frame.step_time_s > 0:
            self._step_time.add(frame.step_time_s)
            self.train_time_s += frame.step_time_s
        a = self.assess(frame)
        # Debounce: a risk counts once seen on two consecutive steps. A one-step blip is
        # noise for the interval (pre_update already captured it if it was a real surge).
        self._risk.append(min(a.beta, self._prev_beta))
        self._prev_beta = a.beta
        if frame.any_nonfinite:
            if self._pre_step != step:
                self._poisoned = True  # no pre_update call saw it: the bad update went through
        elif frame.loss is not None or frame.grad_norm is not None:
            self._poisoned = False  # finite signals computed from the current weights: they are sane
        mem = frame.mem_frac
        if mem is not None and math.isfinite(mem):
            self._mem.append((step, mem))  # new samples only: the trend is fitted on real points
        decision = self._choose(frame, a)
        # Update the levels after judging the frame, so a spike is measured against the past.
        if frame.loss is not None:
            self._loss.add(frame.loss)
        if frame.grad_norm is not None:
            self._grad.add(frame.grad_norm)
        if frame.lr is not None and math.isfinite(frame.lr):
            self._lr.append(float(frame.lr))
        self.history.append({"step": step, "loss": _j(frame.loss), "grad_norm": _j(frame.grad_norm), "lr": _j(frame.lr),
                             "risk": round(self.risk, 6), "interval": round(decision.interval, 3),
                             "save": decision.save, "reason": decision.reason})
        if decision.save:
            self._record(decision, step)
        return decision

    def _choose(self, frame: SignalFrame, a: Assessment) -> Decision:
        c = self.config
        step = frame.step
        assert self.last_save_step is not None
        beta, interval = self.risk, self.interval()
        since = step - self.last_save_step
        healthy = not self._poisoned

        def save(reason: str, kind: DecisionKind, tiers: frozenset[Tier] = ALL_TIERS) -> Decision:
            return Decision(save=True, tiers=tiers, reason=reason, risk=beta, step=step, healthy=healthy, interval=interval,
                            kind=kind)

        if frame.preempt and not self._preempt_done:
            self._preempt_done = True
            return save("preemption", DecisionKind.PREEMPTION)
        if frame.preempt:
            self._suppress("preempt", step, "preemption flag still set: final save already taken")
        if self._poisoned:
            # Writing NaN weights would only push healthy restore points out of retention.
            self._suppress("poisoned", step, "saves paused: a non-finite update was applied (state unhealthy)")
            return Decision(save=False, risk=beta, interval=interval, healthy=False)
        self._suppressed.discard("poisoned")

        if beta < c.risk_release and not self._edge_armed:
            self._edge_armed = True
            self._suppressed.discard("edge")
        if self._edge_armed and beta >= c.risk_threshold:
            self._edge_armed = False
            detail = ", ".join(f"{k}={v:.2f}" for k, v in sorted(a.components.items()) if v > 0)
            reason = f"risk_edge beta={beta:.2f} ({detail or 'smoothed'})"
            tiers = MINIMAL_TIERS if a.driver == "memory" else ALL_TIERS
            if since < c.min_interval:
                self._suppress("edge", step, f"{reason} suppressed: {since} < min_interval {c.min_interval}")
            elif not self._within_budget():
                self._suppress("edge", step, f"{reason} suppressed: over overhead_budget {c.overhead_budget:.1%}")
            else:
                return save(reason, DecisionKind.RISK_EDGE, tiers)

        forecast = self._memory_forecast()
        if forecast is not None:
            current, predicted = forecast
            if self._mem_armed and current < c.memory_threshold <= predicted:
                self._mem_armed = False
                reason = f"memory_ramp {current:.1%} -> {predicted:.1%} within {c.memory_lookahead} steps"
                if since >= c.min_interval:
                    return save(reason, DecisionKind.MEMORY, MINIMAL_TIERS)
                self._suppress("memory", step, f"{reason} suppressed: {since} < min_interval {c.min_interval}")
            elif not self._mem_armed and predicted < c.memory_threshold - 0.05:
                self._mem_armed = True
                self._suppressed.discard("memory")

        if since >= round(interval):
            base = self.base_interval()
            return save(f"interval {round(interval)} (base {base:.0f}, alpha {self.alpha:.2f}, beta {beta:.2f})",
                        DecisionKind.INTERVAL)
        return Decision(save=False, risk=beta, interval=interval)

    def _suppress(self, key: str, step: int, message: str) -> None:
        if key not in self._suppressed:
            self._suppressed.add(key)
            logger.info("step %d: %s", step, message)

    def _record(self, decision: Decision, step: int) -> None:
        assert decision.step is not None
        self.last_save_step = decision.step if self.last_save_step is None else max(self.last_save_step, decision.step)
        self.saves += 1
        entry = {"at_step": step, **decision.to_dict()}
        self.decisions.append(entry)
        logger.info("step %d: save step %d (%s) tiers=%s%s", step, decision.step, decision.reason,
                    ",".join(entry["tiers"]), " pinned" if decision.pin else "")

    def record_save(self, step: int, blocking_s: float, tiers: frozenset[Tier] | None = None) -> None:
        """Feedback after a save: the time it blocked training (for Young/Daly and the budget).

        Args:
            step (`int`): the saved step.
            blocking_s (`float`): seconds training was stopped by the save (snapshot time for
                an asynchronous save, the whole write for a synchronous one).
            tiers (`frozenset[Tier]`, *optional*): what was saved (informative).
        """
        if blocking_s is None or not math.isfinite(blocking_s) or blocking_s < 0:
            logger.warning("record_save(step=%d): ignoring blocking_s=%r (expected seconds >= 0)", step, blocking_s)
            return
        self._save_cost.add(blocking_s)
        self.blocking_s += blocking_s

    def debug_info(self) -> list[dict[str, Any]]:
        """The last `DEBUG_INFO_STEPS` steps' loss, grad norm and learning rate (for the manifest)."""
        return [{k: h[k] for k in ("step", "loss", "grad_norm", "lr")} for h in list(self.history)[-DEBUG_INFO_STEPS:]]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Every running statistic as JSON-able data, so a resumed run decides the same."""
        return {
            "version": STATE_VERSION,
            "loss": self._loss.state_dict(),
            "grad": self._grad.state_dict(),
            "risk": list(self._risk),
            "mem": [list(p) for p in self._mem],
            "step_time": self._step_time.state_dict(),
            "save_cost": self._save_cost.state_dict(),
            "train_time_s": self.train_time_s,
            "blocking_s": self.blocking_s,
            "last_save_step": self.last_save_step,
            "last_capture_step": self.last_capture_step,
            "saves": self.saves,
            "edge_armed": self._edge_armed,
            "mem_armed": self._mem_armed,
            "preempt_done": self._preempt_done,
            "poisoned": self._poisoned,
            "prev_nonfinite": self._prev_nonfinite,
            "prev_beta": self._prev_beta,
            "lr": list(self._lr),
            "suppressed": sorted(self._suppressed),
            "history": list(self.history),
            "decisions": list(self.decisions),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (window sizes follow the current config)."""
        from ..errors import ConfigError

        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"policy state version={state.get('version')!r} is not supported: expected {STATE_VERSION}.")
        for window, key in ((self._loss, "loss"), (self._grad, "grad")):
            window.load_state_dict({"maxlen": window.maxlen, "values": state[key]["values"][-window.maxlen:]})
        self._risk = deque((float(v) for v in state["risk"]), maxlen=self.config.risk_smoothing)
        self._mem = deque(((int(s), float(m)) for s, m in state["mem"]), maxlen=MEM_POINTS)
        self._step_time.load_state_dict(state["step_time"])
        self._save_cost.load_state_dict(state["save_cost"])
        self.train_time_s = float(state["train_time_s"])
        self.blocking_s = float(state["blocking_s"])
        self.last_save_step = state["last_save_step"]
        self.last_capture_step = state["last_capture_step"]
        self.saves = int(state["saves"])
        self._edge_armed = bool(state["edge_armed"])
        self._mem_armed = bool(state["mem_armed"])
        self._preempt_done = bool(state["preempt_done"])
        self._poisoned = bool(state["poisoned"])
        self._prev_nonfinite = bool(state["prev_nonfinite"])
        self._prev_beta = float(state["prev_beta"])
        self._lr = deque((float(v) for v in state["lr"]), maxlen=self.config.stability_window)
        self._suppressed = set(state["suppressed"])
        self.history = deque(state["history"], maxlen=HISTORY_STEPS)
        self.decisions = deque(state["decisions"], maxlen=DECISION_HISTORY)


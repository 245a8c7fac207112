"""The rule policy: a dynamic save interval, risk-triggered saves and pre-anomaly capture.

Pure: input `SignalFrame`s, output `Decision`s. No I/O, no clock, no torch, so every
behaviour is a unit test on a list of numbers. The policy reads nothing but the frames and
its own state: under DDP every rank feeds it the same reduced frame and takes the same
decisions. See `docs/policy.md` for the formulas and every knob.

`RulePolicy` composes small parts, each with its own state dict: `Baselines` (the running
statistics), `Cadence` (interval, save cost, budget), `RiskSmoother`, and the triggers
(`CaptureTrigger`, `PreemptionTrigger`, `RiskEdgeTrigger`, `MemoryRampTrigger`, `Health`).
An optional `DoubleCheck` sits next to the rules: the learned model of `learned_model`
(`extras.learned`), or any object with its methods.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..config import SmartCkptConfig
from ..constants import ALL_TIERS, DEBUG_INFO_STEPS, Tier
from ..errors import ConfigError
from ..jsonutil import safe_float as _j
from ..signals.frame import SignalFrame
from . import triggers
from .baselines import Assessment, Baselines
from .cadence import Cadence, Interval
from .decision import MINIMAL_TIERS, NO_SAVE, Decision, DecisionKind

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: composed parts; 1: flat fields (an older release), loaded as a fresh warm-up
HISTORY_STEPS = 100
DECISION_HISTORY = 1000


class DoubleCheck(Protocol):
    """A second opinion next to the rules, with its own per-step state (part of the policy state).

    The rules stay the safety net: a double-check may veto a soft rule's capture or ask for an early
    save, never drop a hard one. `RulePolicy` calls `review` and `capture` in `pre_update`,
    `after_update` in `decide`, and saves its state under the key `"learned"`.
    """

    def review(self, frame: SignalFrame, rule: str | None, loss_baseline: float | None
               ) -> tuple[str | None, Any, str | None]:
        """The capture rule after a veto, an early-capture request to pass to `capture` (or None), a veto's log line."""

    def capture(self, frame: SignalFrame, early: Any, risk: float, interval: float, cooldown: int) -> Decision | None:
        """The pre-update capture `early` (from `review`) asks for, or None."""

    def after_update(self, frame: SignalFrame, decision: Decision, *, healthy: bool, last_save: int | None,
                     config: SmartCkptConfig) -> Decision:
        """The rules' decision after the update, kept or changed."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RulePolicy:
    """Decides when to save and what, from per-step signals.

    - Regular saves every `T = T_base * alpha / (1 + risk_gain * beta)` steps, where
      `T_base` is `config.base_interval` (kept as set) or Young/Daly `sqrt(2 * C * MTBF)`
      (C = blocking save cost from `SignalFrame.save_blocking_s`, converted to steps with the
      measured step time), `alpha` in [0.2, 1] shrinks it when the loss is noisy (scale-free),
      `beta` is the smoothed risk; clamped to `[min_interval, max_interval]`; a derived
      interval is widened to keep blocking time within `overhead_budget`.
    - An immediate save on the rising edge of the smoothed risk past `risk_threshold`
      (re-armed below `risk_release`); a minimal save (weights + state) when memory is
      predicted to cross `memory_threshold` within `memory_lookahead` steps.
    - `pre_update()`: a surge or non-finite gradient seen before the optimizer step asks
      for a pinned save of the still-healthy state (`pre_update=True`), from the first step.
    - A preemption flag asks for one full save, once.
    - A save taken while the training risk is high or the step's update was bad is `healthy=False`.

    Args:
        config (`SmartCkptConfig`, *optional*): knobs; defaults to `SmartCkptConfig()`.
        double_check (`Callable[[], DoubleCheck]`, *optional*): makes a fresh `DoubleCheck` (one per
            policy state); defaults to the learned model of `config.policy.learned_model`, or none when unset.

    Example:
        ```python
        >>> policy = RulePolicy(SmartCkptConfig(base_interval=4))
        >>> [policy.decide(SignalFrame(step=s, loss=2.0)).save for s in range(1, 9)]
        [False, False, False, True, False, False, False, True]
        ```
    """

    baselines: Baselines
    cadence: Cadence
    smoother: triggers.RiskSmoother
    capture: triggers.CaptureTrigger
    preemption: triggers.PreemptionTrigger
    edge: triggers.RiskEdgeTrigger
    memory: triggers.MemoryRampTrigger
    health: triggers.Health
    learned: DoubleCheck | None
    """The double-check (by default the learned model of `learned_model`); `None`: rules only."""
    history: deque[dict[str, Any]]
    decisions: deque[dict[str, Any]]
    _judged: tuple[tuple[Any, ...], Assessment, str | None] | None  # pre_update's assessment, for decide

    def __init__(self, config: SmartCkptConfig | None = None, *,
                 double_check: Callable[[], DoubleCheck] | None = None) -> None:
        self.config = config or SmartCkptConfig()
        c = self.config.policy
        self.cooldown = c.capture_cooldown if c.capture_cooldown is not None else c.stability_window
        if double_check is None and c.learned_model is not None:
            # The core's one import of `extras/` outside the CLI (tests/unit/test_import_rules.py names it): the
            # documented `learned_model` key names a model file, and only the learned double-check reads one.
            from ..extras.learned import check_factory

            double_check = check_factory(c.learned_model)
        self._new_check = double_check
        self._use(self._new_parts(), suppressed=(), history=(), decisions=())
        self._pre_step: int | None = None  # step whose pre_update ran (transient: within one step)
        self._skip_step: int | None = None  # step whose update pre_update asked to skip
        self.last_bad_update: str | None = None
        self.last_beta = 0.0
        """The raw (unsmoothed) risk of the step judged last: what the step log records beside the smoothed one."""
        """Why the update of the last `pre_update`'s step is bad (the capture rule that fired), or `None`."""

    # ------------------------------------------------------------------ views
    @property
    def alpha(self) -> float:
        """Stability factor in [0.2, 1]: `stability_cv / cv`, cv = loss noise / loss baseline."""
        return self.baselines.alpha()

    @property
    def risk(self) -> float:
        """Smoothed risk beta: mean over `risk_smoothing` steps of the debounced raw beta."""
        return self.smoother.risk

    def base_interval(self) -> float:
        """`T_base` in steps: `config.base_interval`, else Young/Daly from measured costs
        (`stability_window` before a save cost is known). Clamped to `[min_interval, max_interval]`."""
        return self.cadence.base()[0]

    def current_interval(self) -> Interval:
        """The current regular interval with its base and why it moved (shortened / widened)."""
        return self.cadence.interval(self.alpha, self.risk)

    def interval(self) -> float:
        """Current regular interval in steps (see `current_interval`)."""
        return self.current_interval().steps

    # ------------------------------------------------------------------ decisions
    def pre_update(self, frame: SignalFrame) -> Decision:
        """Check the step's gradients before `optimizer.step()`: capture the pre-update state?

        Called when gradients are complete and the weights are still those of step
        `frame.step - 1`. A rule of `triggers.capture_rule` (non-finite values; a global or
        LoRA-layer grad-norm surge; a learning-rate jump; a confirmed loss spike; and, while
        the windows are short, the early rules) asks to save that state now, pinned and
        healthy. Finite triggers have a cooldown of `capture_cooldown` steps (one capture per
        episode, no storms); non-finite ones fire on the first of a run of non-finite steps.

        Args:
            frame (`SignalFrame`): this step's loss and gradient signals (reduced across ranks).

        Returns:
            `Decision`: `save=True, pre_update=True, pin=True, kind=CAPTURE` with `step =
            frame.step - 1` and the rule in `reason`, or no save; `skip_update` follows
            `skip_bad_update` for any bad update.
        """
        c = self.config.policy
        self._pre_step = frame.step
        rule = self._judge(frame)[1]
        early = None
        if self.learned is not None:  # may veto a soft rule's capture, or ask for one the rules do not take
            rule, early, veto = self.learned.review(frame, rule, self.baselines.loss.median())
            if veto:
                logger.debug("step %d: %s", frame.step, veto)
        self.last_bad_update = rule
        nonfinite = frame.any_nonfinite
        skip = c.skip_bad_update and rule is not None
        self._skip_step = frame.step if skip else None
        was_nonfinite = self.capture.observe(nonfinite)
        healthy = not self.health.poisoned
        self.health.before_update(nonfinite, skip)
        if rule is None or not c.pre_anomaly_capture:
            if early is not None and c.pre_anomaly_capture and healthy and self.learned is not None and (
                    learned := self.learned.capture(frame, early, self.risk, self.interval(), self.cooldown)):
                self._record(learned, frame.step)
                return learned
            return Decision(save=False, skip_update=skip, risk=self.risk, healthy=healthy) if skip else NO_SAVE
        suppressed = self.capture.suppression(frame.step, nonfinite=nonfinite, was_nonfinite=was_nonfinite,
                                              healthy=healthy, cooldown=self.cooldown)
        if suppressed:
            self._suppress("capture", frame.step, f"pre-update capture ({rule}) suppressed: {suppressed}")
            return Decision(save=False, skip_update=skip, reason=f"suppressed: {rule}", risk=self.risk, healthy=healthy)
        self._suppressed.discard("capture")
        decision = Decision(save=True, tiers=ALL_TIERS, reason=f"pre_update {rule}", pin=True, pre_update=True,
                            skip_update=skip, risk=self.risk, step=frame.step - 1, healthy=True,
                            interval=self.interval(), kind=DecisionKind.CAPTURE)
        self._record(decision, frame.step)
        return decision

    def decide(self, frame: SignalFrame) -> Decision:
        """Decide after the step's update whether to save the state of step `frame.step`.

        Also folds the frame into the running statistics (loss window, grad baseline, risk,
        memory trend, step time, save cost), so call it exactly once per optimizer step.

        Args:
            frame (`SignalFrame`): this step's signals (reduced across ranks).

        Returns:
            `Decision`: in priority order preemption (full, once), the rising edge of the
            smoothed risk, a memory ramp (minimal tiers), the regular interval; else no save.
            `healthy=False` when the state is poisoned, the step's update was bad (a capture
            rule fired and the update was not skipped) or the training risk is high.
        """
        step = frame.step
        self.cadence.start(step)
        self.cadence.observe(frame)
        warning = self.cadence.over_budget_warning()
        if warning:
            logger.warning("step %d: %s", step, warning)
        a, rule = self._judge(frame)
        self.smoother.add(a)
        self.health.after_update(frame, seen_before_update=self._pre_step == step)
        self.baselines.observe_memory(frame)
        healthy, why = self._health(frame, rule)
        decision = self._choose(frame, a, healthy)
        if self.learned is not None:  # a cheaper tier set, or an early save under memory pressure
            decision = self.learned.after_update(frame, decision, healthy=healthy and not self.health.poisoned,
                                                 last_save=self.cadence.last_save_step, config=self.config)
        if decision.save and not healthy:
            logger.debug("step %d: the checkpoint of step %d is marked unhealthy (%s)", step, step, why)
        # Update the baselines after judging the frame, so a spike is measured against the past.
        self.baselines.fold(frame)
        self._judged = None
        self.history.append({"step": step, "loss": _j(frame.loss), "grad_norm": _j(frame.grad_norm), "lr": _j(frame.lr),
                             "risk": round(self.risk, 6), "interval": round(decision.interval, 3),
                             "save": decision.save, "reason": decision.reason})
        if decision.save:
            self._record(decision, step)
        return decision

    def _judge(self, frame: SignalFrame) -> tuple[Assessment, str | None]:
        """The frame's assessment and capture rule against the baselines; `decide` reuses what
        `pre_update` computed for the same frame (the baselines only change at the end of `decide`)."""
        key = (frame.step, frame.loss, frame.grad_norm, frame.lora_max_ratio, frame.lora_max_layer, frame.nonfinite,
               frame.lr, frame.device_mem_frac, frame.host_mem_frac, frame.clip_norm)
        if self._judged is not None and self._judged[0] == key:
            return self._judged[1], self._judged[2]
        a = self.baselines.assess(frame)
        rule = triggers.capture_rule(frame, a, self.baselines, self.config.policy)
        self._judged = (key, a, rule)
        self.last_beta = a.beta
        return a, rule

    def _health(self, frame: SignalFrame, rule: str | None) -> tuple[bool, str]:
        """Whether the state after this step's update is a sane restore point, and why not."""
        if self.health.poisoned:
            return False, "a non-finite update was applied"
        if rule is not None and self._skip_step != frame.step:  # a skipped update left the weights as they were
            return False, f"this step's update was bad: {rule}"
        if self.smoother.training_risk >= self.config.policy.risk_threshold:
            risk = self.smoother.training_risk
            return False, f"training risk {risk:.2f} >= risk_threshold {self.config.policy.risk_threshold}"
        return True, ""

    def _choose(self, frame: SignalFrame, a: Assessment, healthy: bool) -> Decision:
        c = self.config.policy
        step = frame.step
        last = self.cadence.last_save_step
        assert last is not None
        beta, interval = self.risk, self.current_interval()
        since = step - last

        def save(reason: str, kind: DecisionKind, tiers: frozenset[Tier] = ALL_TIERS) -> Decision:
            return Decision(save=True, tiers=tiers, reason=reason, risk=beta, step=step, healthy=healthy,
                            interval=interval.steps, kind=kind)

        if self.preemption.fire(frame):
            return save("preemption", DecisionKind.PREEMPTION)
        if frame.preempt:
            self._suppress("preempt", step, "preemption flag still set: final save already taken")
        if self.health.poisoned:
            # Writing NaN weights would only push healthy restore points out of retention.
            self._suppress("poisoned", step, "saves paused: a non-finite update was applied (state unhealthy)")
            return Decision(save=False, risk=beta, interval=interval.steps, healthy=False)
        self._suppressed.discard("poisoned")

        fired = self.edge.fire(beta, c)
        if self.edge.armed:
            self._suppressed.discard("edge")
        if fired:
            detail = ", ".join(f"{k}={v:.2f}" for k, v in sorted(a.components.items()) if v > 0)
            reason = f"risk_edge beta={beta:.2f} ({detail or 'smoothed'})"
            tiers = MINIMAL_TIERS if a.driver == "memory" else ALL_TIERS
            if since < c.min_interval:
                self._suppress("edge", step, f"{reason} suppressed: {since} < min_interval {c.min_interval}")
            elif not self.cadence.within_budget():
                self._suppress("edge", step, f"{reason} suppressed: over overhead_budget {c.overhead_budget:.1%}")
            else:
                return save(reason, DecisionKind.RISK_EDGE, tiers)

        ramp = self.memory.fire(self.baselines.memory_forecast(), c)
        if self.memory.armed:
            self._suppressed.discard("memory")
        if ramp is not None:
            if since >= c.min_interval:
                return save(ramp, DecisionKind.MEMORY, MINIMAL_TIERS)
            self._suppress("memory", step, f"{ramp} suppressed: {since} < min_interval {c.min_interval}")

        if since >= interval.due:
            return save(interval.reason(), DecisionKind.INTERVAL)
        return Decision(save=False, risk=beta, interval=interval.steps, healthy=healthy)

    def _suppress(self, key: str, step: int, message: str) -> None:
        if key not in self._suppressed:
            self._suppressed.add(key)
            logger.debug("step %d: %s", step, message)

    def _record(self, decision: Decision, step: int) -> None:
        assert decision.step is not None
        self.cadence.note_save(decision.step)
        entry = {"at_step": step, **decision.to_dict()}
        self.decisions.append(entry)
        logger.debug("step %d: save step %d (%s) tiers=%s%s%s", step, decision.step, decision.reason,
                     ",".join(entry["tiers"]), " pinned" if decision.pin else "",
                     "" if decision.healthy else " unhealthy")

    def debug_info(self) -> list[dict[str, Any]]:
        """The last `DEBUG_INFO_STEPS` steps' loss, grad norm and learning rate (for the manifest)."""
        return [{k: h[k] for k in ("step", "loss", "grad_norm", "lr")} for h in list(self.history)[-DEBUG_INFO_STEPS:]]

    # ------------------------------------------------------------------ persistence
    def _new_parts(self) -> dict[str, Any]:
        """Fresh stateful parts for this policy's config, under their state-dict keys."""
        c = self.config
        parts: dict[str, Any] = {
            # "levels" is the key the baselines have in every policy state saved so far (manifests on disk):
            # under another key a checkpoint saved before would not restore its statistics.
            "levels": Baselines(c), "cadence": Cadence(c), "smoother": triggers.RiskSmoother(c.policy.risk_smoothing),
            "capture": triggers.CaptureTrigger(), "preemption": triggers.PreemptionTrigger(),
            "edge": triggers.RiskEdgeTrigger(), "memory": triggers.MemoryRampTrigger(), "health": triggers.Health(),
        }
        if self._new_check is not None:
            parts["learned"] = self._new_check()
        return parts

    def _use(self, parts: dict[str, Any], *, suppressed: Iterable[str], history: Iterable[dict[str, Any]],
             decisions: Iterable[dict[str, Any]]) -> None:
        """Make `parts` (from `_new_parts`) and the histories this policy's state."""
        self._parts = parts
        self.baselines, self.cadence, self.smoother = parts["levels"], parts["cadence"], parts["smoother"]
        self.capture, self.preemption, self.edge = parts["capture"], parts["preemption"], parts["edge"]
        self.memory, self.health, self.learned = parts["memory"], parts["health"], parts.get("learned")
        self._suppressed = set(suppressed)
        self.history = deque(history, maxlen=HISTORY_STEPS)
        self.decisions = deque(decisions, maxlen=DECISION_HISTORY)
        self._judged = None

    def state_dict(self) -> dict[str, Any]:
        """Every part's state as strict JSON data, so a resumed run decides exactly the same."""
        return {"version": STATE_VERSION, **{name: part.state_dict() for name, part in self._parts.items()},
                "suppressed": sorted(self._suppressed), "history": list(self.history),
                "decisions": list(self.decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (window sizes follow the current config).

        A state of an older release's layout (version 1) cannot be mapped onto the parts: it is
        not restored, the policy warms up again from the next frame (logged), never an error.

        Raises:
            `ConfigError`: `state` is of an unknown version or malformed (nothing is changed then).
        """
        version = state.get("version")
        if version == 1:
            logger.warning("policy state version 1 (an older release) is not restored: the statistics warm up "
                           "again from the next step (early rules guard the first steps).")
            self._use(self._new_parts(), suppressed=(), history=(), decisions=())
            return
        if version != STATE_VERSION:
            raise ConfigError(f"policy state version={version!r} is not supported: expected {STATE_VERSION} (or 1, "
                              "which restarts the statistics).")
        parts = self._new_parts()
        try:
            for name, part in parts.items():
                if name != "learned" or name in state:  # saved without the model: the model starts afresh
                    part.load_state_dict(state[name])
            suppressed = [str(k) for k in state["suppressed"]]
            history, decisions = list(state["history"]), list(state["decisions"])
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"policy state is malformed ({type(e).__name__}: {e}); it was not written by "
                              "RulePolicy.state_dict() of this version: start without it.") from e
        self._use(parts, suppressed=suppressed, history=history, decisions=decisions)

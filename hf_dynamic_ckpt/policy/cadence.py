"""`Cadence`: when the next regular save is due (the interval, its base, save cost and budget).

The save cost comes only from the frames (`SignalFrame.save_blocking_s`, the MAX over
ranks once reduced), the step time likewise: every rank folds the same numbers and so
computes the same interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import SmartCkptConfig
from ..signals.frame import SignalFrame
from ..signals.stats import Ema

FROM_USER = "from base_interval"
FROM_YOUNG_DALY = "from Young/Daly"
FROM_BOOTSTRAP = "from stability_window until a save cost is measured"
BUDGET_WARN_AFTER = 2  # measured saves before an explicit interval is reported over budget (the first may be slow)


@dataclass(frozen=True)
class Interval:
    """The current regular interval and how it came about (for the save reason).

    Args:
        steps (`float`): the interval in steps (`round(steps)` steps between saves).
        base (`float`): `T_base` before stability and risk.
        source (`str`): where the base comes from (`FROM_USER`, `FROM_YOUNG_DALY`, `FROM_BOOTSTRAP`).
        alpha (`float`): stability factor in [0.2, 1].
        beta (`float`): smoothed risk in [0, 1].
        shortened (`bool`): stability or risk made it shorter than the base.
        widened (`bool`): the overhead budget made it longer (only an interval the library derived).
    """

    steps: float
    base: float
    source: str
    alpha: float
    beta: float
    shortened: bool = False
    widened: bool = False
    budget: float = 0.0

    @property
    def due(self) -> int:
        return round(self.steps)

    def reason(self) -> str:
        """`"interval 4 (base 4 from base_interval, alpha 1.00, beta 0.00)"`, with why it moved."""
        why = ""
        if self.shortened:
            why += ", shortened by risk"
        if self.widened:
            why += f", widened by overhead_budget {self.budget:.1%}"
        return (f"interval {self.due} (base {self.base:.0f} {self.source}{why}, alpha {self.alpha:.2f}, "
                f"beta {self.beta:.2f})")


class Cadence:
    """Regular-save bookkeeping: last save, measured step time and save cost, blocking budget.

    `T = T_base * alpha / (1 + risk_gain * beta)`; `T_base` is `config.base_interval` when
    the user set it, else Young/Daly `sqrt(2 * C * MTBF)` in steps (before a save cost is
    measured: `stability_window`). Only a derived interval is widened to keep the blocking
    time within `overhead_budget`; an explicit one is kept, with one warning when its
    measured overhead is above the budget (`over_budget_warning`).

    Args:
        config (`SmartCkptConfig`): the knobs.
    """

    def __init__(self, config: SmartCkptConfig) -> None:
        self.config = config
        self.step_time = Ema(0.9)
        self.save_cost = Ema(0.5)
        self.train_time_s = 0.0
        self.blocking_s = 0.0
        self.last_save_step: int | None = None
        self.saves = 0
        self.budget_warned = False

    def observe(self, frame: SignalFrame) -> None:
        """Fold the frame's step time and the blocking time of the saves since the previous frame."""
        t = frame.step_time_s
        if t is not None and math.isfinite(t) and t > 0:
            self.step_time.add(t)
            self.train_time_s += t
        b = frame.save_blocking_s
        if b is not None and math.isfinite(b) and b > 0:  # None or 0: no save since the previous frame
            self.save_cost.add(b)
            self.blocking_s += b

    def start(self, step: int) -> None:
        if self.last_save_step is None:
            self.last_save_step = step - 1  # the state training started from counts as saved

    def note_save(self, step: int) -> None:
        self.last_save_step = step if self.last_save_step is None else max(self.last_save_step, step)
        self.saves += 1

    def base(self) -> tuple[float, str]:
        """`(T_base in steps, where it comes from)`, clamped to `[min_interval, max_interval]`."""
        c = self.config
        cost, step = self.save_cost.value, self.step_time.value
        if c.base_interval is not None:
            base, source = float(c.base_interval), FROM_USER
        elif cost is None or not step:
            base, source = float(c.policy.stability_window), FROM_BOOTSTRAP
        else:
            base, source = math.sqrt(2.0 * cost * c.policy.mtbf_hours * 3600.0) / step, FROM_YOUNG_DALY
        return self._clamp(base), source

    def budget_interval(self) -> float:
        """Fewest steps between saves that keeps blocking time within `overhead_budget`."""
        cost, step = self.save_cost.value, self.step_time.value
        if cost is None or not step:
            return 0.0
        return cost / (self.config.policy.overhead_budget * step)

    def interval(self, alpha: float, beta: float) -> Interval:
        """The current regular interval: the base, shortened by stability and risk, widened by the
        budget when the library derived it, clamped (`max_interval` wins over the budget)."""
        c = self.config
        base, source = self.base()
        t = base * alpha / (1.0 + c.policy.risk_gain * beta)
        steps = self._clamp(t)
        shortened, widened = round(steps) < round(base), False
        if source != FROM_USER:  # an interval the user set is never widened (over_budget_warning says so once)
            wide = self._clamp(max(t, self.budget_interval()))
            widened, steps = round(wide) > round(steps), wide
        return Interval(steps=steps, base=base, source=source, alpha=alpha, beta=beta, shortened=shortened,
                        widened=widened, budget=c.policy.overhead_budget)

    def within_budget(self) -> bool:
        """Whether one more save keeps total blocking time within `overhead_budget` of training time."""
        cost = self.save_cost.value
        if cost is None or self.train_time_s <= 0.0:
            return True
        return (self.blocking_s + cost) <= self.config.policy.overhead_budget * self.train_time_s

    def over_budget_warning(self) -> str | None:
        """Once per run: the message for an explicit `base_interval` whose saves cost more than the budget."""
        c = self.config
        cost, step = self.save_cost.value, self.step_time.value
        if c.base_interval is None or self.budget_warned or self.save_cost.count < BUDGET_WARN_AFTER or not step:
            return None
        assert cost is not None
        overhead = cost / (c.base_interval * step)
        if overhead <= c.policy.overhead_budget:
            return None
        self.budget_warned = True
        return (f"base_interval={c.base_interval}: a save blocks training {cost:.3f} s every {c.base_interval} "
                f"steps of {step:.3f} s, {overhead:.1%} of training time, above "
                f"overhead_budget={c.policy.overhead_budget:.1%}. The interval "
                f"you set is kept; base_interval={math.ceil(self.budget_interval())} would stay within the budget "
                "(or raise policy.overhead_budget, or leave base_interval unset to let the library choose).")

    def _clamp(self, t: float) -> float:
        return min(float(self.config.policy.max_interval), max(float(self.config.policy.min_interval), t))

    def state_dict(self) -> dict[str, Any]:
        return {"step_time": self.step_time.state_dict(), "save_cost": self.save_cost.state_dict(),
                "train_time_s": self.train_time_s, "blocking_s": self.blocking_s,
                "last_save_step": self.last_save_step, "saves": self.saves, "budget_warned": self.budget_warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_time.load_state_dict(state["step_time"])
        self.save_cost.load_state_dict(state["save_cost"])
        self.train_time_s = float(state["train_time_s"])
        self.blocking_s = float(state["blocking_s"])
        last = state["last_save_step"]
        self.last_save_step = None if last is None else int(last)
        self.saves = int(state["saves"])
        self.budget_warned = bool(state["budget_warned"])

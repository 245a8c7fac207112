"""The running baselines a frame is judged against, and the risk assessment of one frame.

`Baselines` holds the recent loss, gradient-norm and learning-rate values and the memory
samples; `Baselines.assess(frame)` measures a frame against them *before* it is folded in
(`Baselines.fold`), so a spike is judged against the past and robust statistics (median /
MAD) keep one spike from moving the baseline. Everything here is read from the frames alone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import SmartCkptConfig
from ..signals.frame import SignalFrame
from ..signals.stats import MAD_TO_STD, RollingWindow, linear_fit, ramp

MIN_HISTORY = 8  # values a statistic needs before it may raise risk (the early rules cover the steps before)
GRAD_BASELINE_WINDOW = 50  # grad-norm steps whose median is the running baseline
GRAD_SPREAD_K = 3.0  # a grad surge must also clear exp(k * relative spread) x the baseline (noisy runs need more)
MEM_POINTS = 6  # memory samples in the trend fit
LOSS_REL_FLOOR = 0.01  # a loss z-score never uses a scale below 1 % of the loss baseline
MIN_ALPHA = 0.2  # the article's 1 - 0.8: stability can shorten the interval 5x at most
MEMORY = "memory"  # risk components that do not count for the weights' health: memory says nothing
NONFINITE = "nonfinite"  # about them, and a non-finite update is tracked exactly by `triggers.Health`


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
    def training_beta(self) -> float:
        """`beta` of the finite anomalies (no memory, no non-finite): the risk that the weights go bad."""
        return max((v for k, v in self.components.items() if k not in (MEMORY, NONFINITE)), default=0.0)

    @property
    def driver(self) -> str | None:
        if not self.components or self.beta <= 0.0:
            return None
        return max(self.components, key=lambda k: self.components[k])


class Baselines:
    """Recent loss, grad-norm and lr values and memory samples, with robust summaries.

    Args:
        config (`SmartCkptConfig`): window sizes (`stability_window`) and risk ramps.
    """

    def __init__(self, config: SmartCkptConfig) -> None:
        self.config = config
        self.loss = RollingWindow(config.policy.stability_window)
        self.grad = RollingWindow(min(config.policy.stability_window, GRAD_BASELINE_WINDOW))
        self.lr: deque[float] = deque(maxlen=config.policy.stability_window)
        self.mem: deque[tuple[int, float]] = deque(maxlen=MEM_POINTS)
        self._forecast: tuple[int | None, tuple[float, float] | None] = (None, None)

    def assess(self, frame: SignalFrame) -> Assessment:
        """Risk components of `frame` against the running baselines (does not update them)."""
        c = self.config.policy
        a = Assessment()
        if frame.any_nonfinite:
            a.components[NONFINITE] = 1.0
        if frame.loss is not None and math.isfinite(frame.loss) and len(self.loss) >= MIN_HISTORY:
            a.loss_z = self.loss.robust_z(frame.loss, rel_floor=LOSS_REL_FLOOR)
            baseline = self.loss.median()
            if baseline:
                a.loss_ratio = frame.loss / abs(baseline)
            if a.loss_z is not None:
                a.components["loss_spike"] = ramp(a.loss_z, c.loss_spike_z / 2, c.loss_spike_z)
        if frame.grad_norm is not None and math.isfinite(frame.grad_norm) and len(self.grad) >= MIN_HISTORY:
            baseline = self.grad.median() or 0.0
            a.grad_ratio = frame.grad_norm / max(baseline, 1e-12)
            spread = MAD_TO_STD * (self.grad.mad() or 0.0) / max(baseline, 1e-12)  # ~ sd of log(grad norm)
            a.grad_excess = a.grad_ratio / math.exp(GRAD_SPREAD_K * spread)
            a.components["grad_surge"] = ramp(a.grad_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        if frame.lora_max_ratio is not None and math.isfinite(frame.lora_max_ratio):
            a.lora_ratio = frame.lora_max_ratio
            a.components["lora_surge"] = ramp(a.lora_ratio, c.grad_surge_ratio / 2, c.grad_surge_ratio)
        lr_ref = max(self.lr, default=0.0)
        if frame.lr is not None and math.isfinite(frame.lr) and len(self.lr) >= MIN_HISTORY and lr_ref > 0:
            a.lr_ratio = frame.lr / lr_ref
            r = c.lr_surge_ratio
            a.components["lr_surge"] = ramp(a.lr_ratio, (1.0 + r) / 2.0, r)
        mem = frame.mem_frac
        if mem is None and self.mem:
            mem = self.mem[-1][1]  # memory is sampled every few steps: the last sample stands
        if mem is not None and math.isfinite(mem):
            a.mem = mem
            a.components[MEMORY] = ramp(mem, c.memory_threshold - 0.1, c.memory_threshold)
        return a

    def alpha(self) -> float:
        """Stability factor in [0.2, 1]: `stability_cv / cv`, cv = loss noise / loss baseline."""
        if len(self.loss) < MIN_HISTORY:
            return 1.0
        noise, baseline = self.loss.diff_noise(), self.loss.median()
        if not noise or not baseline:
            return 1.0
        cv = noise / abs(baseline)
        return min(1.0, max(MIN_ALPHA, self.config.policy.stability_cv / cv))

    def observe_memory(self, frame: SignalFrame) -> None:
        """Add the frame's memory sample (before deciding: the ramp forecast uses it)."""
        mem = frame.mem_frac
        if mem is not None and math.isfinite(mem):
            self.mem.append((frame.step, mem))  # new samples only: the trend is fitted on real points

    def fold(self, frame: SignalFrame) -> None:
        """Fold the frame into the loss / grad / lr baselines (after it was judged)."""
        if frame.loss is not None:
            self.loss.add(frame.loss)
        if frame.grad_norm is not None:
            self.grad.add(frame.grad_norm)
        if frame.lr is not None and math.isfinite(frame.lr):
            self.lr.append(float(frame.lr))

    def memory_forecast(self) -> tuple[float, float] | None:
        """(current, predicted in `memory_lookahead` steps) from a line through recent samples."""
        key = self.mem[-1][0] if self.mem else None
        if self._forecast[0] != key:  # refit only when a new sample arrived
            self._forecast = (key, self._fit_memory())
        return self._forecast[1]

    def _fit_memory(self) -> tuple[float, float] | None:
        if len(self.mem) < 3:
            return None
        fit = linear_fit(list(self.mem))
        if fit is None:
            return None
        slope, intercept = fit
        step, current = self.mem[-1]
        predicted = slope * (step + self.config.policy.memory_lookahead) + intercept
        return current, (predicted if slope > 0 else current)

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.values, "grad": self.grad.values, "lr": list(self.lr),
                "mem": [[s, m] for s, m in self.mem]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the values (window sizes follow the current config: the newest values are kept)."""
        for window, key in ((self.loss, "loss"), (self.grad, "grad")):
            window.load_state_dict({"maxlen": window.maxlen, "values": [float(v) for v in state[key]][-window.maxlen:]})
        self.lr = deque((float(v) for v in state["lr"]), maxlen=self.config.policy.stability_window)
        self.mem = deque(((int(s), float(m)) for s, m in state["mem"]), maxlen=MEM_POINTS)
        self._forecast = (None, None)

"""The learned model's 12 input features: scale-free numbers computed from the frames alone.

`FeatureExtractor.step(frame)` turns one reduced `SignalFrame` into 12 floats, measured
against the recent values *before* the frame is folded in (like `Baselines.assess`), so every
rank computes the same features from the same frames, and a resumed run continues from
the restored windows (`state_dict()`). No unit survives: losses, gradient norms, learning
rates and step times enter only as logs of ratios to their own recent baseline, memory as a
fraction of its limit. Each feature is clipped to a fixed range, so one absurd value (a
x1e6 loss) cannot push the network outside what it was trained on. Pure Python.

| # | name | definition (window = the last `FEATURE_WINDOW` = 20 finite values) |
|---|---|---|
| 0 | `loss_ratio` | log(loss / median loss of the window) |
| 1 | `loss_change` | (loss - previous loss) / median loss: the loss rate of change |
| 2 | `loss_noise` | log(relative step-to-step loss noise of the window): noise ~ 1/sqrt(batch size) |
| 3 | `grad_ratio` | log(pre-clip grad norm / median grad norm of the window) |
| 4 | `grad_vs_clip` | log(pre-clip grad norm / clip norm); 0 when the loop does not clip |
| 5 | `lora_ratio` | log(`lora_max_ratio`): the most unusual LoRA layer against its own ceiling; 0 without LoRA |
| 6 | `lr_ratio` | log(learning rate / highest rate of the window) |
| 7 | `mem_frac` | memory in use, fraction of the limit (the last sample; 0 before any) |
| 8 | `mem_trend` | the fraction the memory trend adds over the next 50 steps (line through the last 6 samples) |
| 9 | `step_time_ratio` | log(step time / median step time of the window) |
| 10 | `nonfinite` | 1 when the loss or a gradient is NaN or infinite, else 0 |
| 11 | `history` | min(1, steps seen / 50): how much history the ratios stand on |

A ratio without history (the first step) is 0; a non-finite value gives `nonfinite = 1`
and 0 for the ratios it would have entered. `loss_noise` is the frame's stand-in for the batch
size; `lora_ratio` is 0 too while the layers warm up.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from ..signals.frame import SignalFrame
from ..signals.stats import RollingWindow, linear_fit

FEATURE_NAMES: tuple[str, ...] = (
    "loss_ratio", "loss_change", "loss_noise", "grad_ratio", "grad_vs_clip", "lora_ratio",
    "lr_ratio", "mem_frac", "mem_trend", "step_time_ratio", "nonfinite", "history",
)
NUM_FEATURES = len(FEATURE_NAMES)
FEATURE_WINDOW = 20
MEM_POINTS = 6
MEM_HORIZON = 50  # steps ahead the memory trend is extrapolated
HISTORY_FULL = 50
# (low, high) of each feature, in FEATURE_NAMES order.
CLIP: tuple[tuple[float, float], ...] = (
    (-3.0, 8.0), (-4.0, 40.0), (-8.0, 2.0), (-5.0, 10.0), (-8.0, 10.0), (-3.0, 10.0),
    (-5.0, 5.0), (0.0, 1.5), (-0.5, 1.0), (-3.0, 3.0), (0.0, 1.0), (0.0, 1.0),
)
NOISE_FLOOR = 1e-4  # relative loss noise below this reads as this (log of 0 is -inf)


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _log_ratio(value: float | None, baseline: float | None) -> float:
    if not _finite(value) or baseline is None or not baseline > 0.0 or not value > 0.0:  # type: ignore[operator]
        return 0.0
    return math.log(value / baseline)  # type: ignore[operator]


class FeatureExtractor:
    """Streaming features of the frames, one call per optimizer step.

    Example:
        ```python
        >>> fx = FeatureExtractor()
        >>> fx.step(SignalFrame(step=1, loss=2.0, grad_norm=1.0, lr=1e-3))[FEATURE_NAMES.index("history")]
        0.0
        ```
    """

    def __init__(self) -> None:
        self.loss = RollingWindow(FEATURE_WINDOW)
        self.grad = RollingWindow(FEATURE_WINDOW)
        self.time = RollingWindow(FEATURE_WINDOW)
        self.lr: deque[float] = deque(maxlen=FEATURE_WINDOW)
        self.mem: deque[tuple[int, float]] = deque(maxlen=MEM_POINTS)
        self.prev_loss: float | None = None
        self.seen = 0
        self._mem_cache: tuple[int | None, tuple[float, float]] | None = None  # (last sample's step, its fit)

    def step(self, frame: SignalFrame) -> list[float]:
        """The frame's 12 features against the windows, then fold the frame into them."""
        out = self.features(frame)
        self.fold(frame)
        return out

    def features(self, frame: SignalFrame) -> list[float]:
        """The frame's features against the current windows (does not change them)."""
        loss, grad = frame.loss, frame.grad_norm
        baseline = self.loss.median()
        f = [0.0] * NUM_FEATURES
        f[0] = _log_ratio(loss, baseline)
        if _finite(loss) and _finite(self.prev_loss) and baseline:
            f[1] = (loss - self.prev_loss) / abs(baseline)  # type: ignore[operator]
        noise = self.loss.diff_noise()
        if noise is not None and baseline:
            f[2] = math.log(max(noise / abs(baseline), NOISE_FLOOR))
        f[3] = _log_ratio(grad, self.grad.median())
        f[4] = _log_ratio(grad, frame.clip_norm)
        f[5] = _log_ratio(frame.lora_max_ratio, 1.0)
        f[6] = _log_ratio(frame.lr, max(self.lr, default=None))
        f[7], f[8] = self._memory(frame)
        f[9] = _log_ratio(frame.step_time_s, self.time.median())
        f[10] = 1.0 if frame.any_nonfinite else 0.0
        f[11] = min(1.0, self.seen / HISTORY_FULL)
        return [min(hi, max(lo, v)) for v, (lo, hi) in zip(f, CLIP)]

    def _memory(self, frame: SignalFrame) -> tuple[float, float]:
        """(last memory sample, its trend over `MEM_HORIZON` steps); refitted only when a sample arrives."""
        mem = frame.mem_frac
        if not _finite(mem):
            key = self.mem[-1][0] if self.mem else None
            if self._mem_cache is None or self._mem_cache[0] != key:
                self._mem_cache = (key, self._fit(list(self.mem)))
            return self._mem_cache[1]
        return self._fit([*list(self.mem)[1 - MEM_POINTS:], (frame.step, float(mem))])  # type: ignore[arg-type]

    @staticmethod
    def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
        if not points:
            return 0.0, 0.0
        fit = linear_fit(points) if len(points) >= 3 else None
        return points[-1][1], (fit[0] * MEM_HORIZON if fit is not None else 0.0)

    def fold(self, frame: SignalFrame) -> None:
        """Add the frame's finite values to the windows."""
        if frame.loss is not None:
            self.loss.add(frame.loss)
        if frame.grad_norm is not None:
            self.grad.add(frame.grad_norm)
        if frame.step_time_s is not None:
            self.time.add(frame.step_time_s)
        if _finite(frame.lr):
            self.lr.append(float(frame.lr))  # type: ignore[arg-type]
        if _finite(frame.mem_frac):
            self.mem.append((frame.step, float(frame.mem_frac)))  # type: ignore[arg-type]
        self.prev_loss = frame.loss if _finite(frame.loss) else self.prev_loss
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.values, "grad": self.grad.values, "time": self.time.values, "lr": list(self.lr),
                "mem": [[s, m] for s, m in self.mem], "prev_loss": self.prev_loss, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fresh = FeatureExtractor()
        for name in ("loss", "grad", "time"):
            for v in state[name]:
                getattr(fresh, name).add(float(v))
        fresh.lr.extend(float(v) for v in state["lr"])
        fresh.mem.extend((int(s), float(m)) for s, m in state["mem"])
        prev = state["prev_loss"]
        fresh.prev_loss = None if prev is None else float(prev)
        fresh.seen = int(state["seen"])
        # All or nothing: a malformed state raised above, before anything of self changed.
        self.loss, self.grad, self.time, self.lr, self.mem = fresh.loss, fresh.grad, fresh.time, fresh.lr, fresh.mem
        self.prev_loss, self.seen, self._mem_cache = fresh.prev_loss, fresh.seen, None

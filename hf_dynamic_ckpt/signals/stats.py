"""Rolling and robust statistics for the policy, all JSON-serialisable for exact resume.

Robust statistics (median / MAD) are used instead of mean / std because the values
they summarise are exactly the ones that contain outliers (loss spikes, gradient
surges): a single spike must not move the baseline it is compared against.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

MAD_TO_STD = 1.4826
"""Scale factor turning a median absolute deviation into a normal standard deviation."""


class RollingWindow:
    """The last `maxlen` finite values with robust summaries.

    Args:
        maxlen (`int`): number of values kept.

    Example:
        ```python
        >>> w = RollingWindow(5)
        >>> for v in [1.0, 2.0, 3.0, 100.0]:
        ...     w.add(v)
        >>> w.median()
        2.5
        ```
    """

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} is invalid: expected an integer >= 1.")
        self.maxlen = maxlen
        self._values: deque[float] = deque(maxlen=maxlen)
        self._cache: dict[str, Any] = {}  # summaries of the current values; cleared on change

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> bool:
        """Append `value` if it is finite; returns whether it was kept."""
        if value is None or not math.isfinite(value):
            return False
        self._values.append(float(value))
        self._cache.clear()
        return True

    @property
    def values(self) -> list[float]:
        return list(self._values)

    # statistics.median (one C sort) beats numpy by ~6x on windows of ~100 values.
    def median(self) -> float | None:
        if "median" not in self._cache:
            self._cache["median"] = statistics.median(self._values) if self._values else None
        return self._cache["median"]  # type: ignore[no-any-return]

    def mad(self) -> float | None:
        """Median absolute deviation from the median (unscaled)."""
        if "mad" not in self._cache:
            med = self.median()
            self._cache["mad"] = None if med is None else statistics.median([abs(v - med) for v in self._values])
        return self._cache["mad"]  # type: ignore[no-any-return]

    def robust_z(self, value: float, *, rel_floor: float = 0.0) -> float | None:
        """How many robust standard deviations `value` lies above the window's median.

        The scale is `max(1.4826 * MAD, rel_floor * |median|)`, so a nearly constant
        series does not turn a tiny wobble into a huge z-score.
        """
        if len(self._values) < 2 or not math.isfinite(value):
            return None
        med = self.median()
        assert med is not None
        scale = max(MAD_TO_STD * (self.mad() or 0.0), rel_floor * abs(med), 1e-12)
        return (value - med) / scale

    def diff_noise(self) -> float | None:
        """Robust standard deviation of the step-to-step noise, ignoring a linear trend.

        Computed from first differences (MAD of the differences / sqrt(2)), so a loss that
        falls steadily is not mistaken for an unstable one.
        """
        if len(self._values) < 3:
            return None
        if "diff_noise" not in self._cache:
            vals = list(self._values)
            diffs = [b - a for a, b in itertools.pairwise(vals)]
            med = statistics.median(diffs)
            mad = statistics.median([abs(d - med) for d in diffs])
            self._cache["diff_noise"] = MAD_TO_STD * mad / math.sqrt(2.0)
        return self._cache["diff_noise"]  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, Any]:
        return {"maxlen": self.maxlen, "values": list(self._values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.maxlen = int(state["maxlen"])
        self._values = deque((float(v) for v in state["values"]), maxlen=self.maxlen)
        self._cache.clear()


class LayerBaselines:
    """Each LoRA layer's gradient norm judged against the layer's own recent history.

    Per layer, the logs of the last `window` non-zero norms are kept; once a layer has
    `warmup` of them, a new norm is compared with their median (a robust baseline, not a
    young EMA) and the result is discounted by the layer's own spread:

        excess = norm / exp(median(log norms) + spread_k * 1.4826 * MAD(log norms))

    so `excess >= 5` means "5x above the highest baseline this layer normally reaches", not
    5x its average. LoRA layers start with `lora_B = 0`: their gradient norms grow (and
    jitter) by orders of magnitude in the first steps, which a ratio to a young running
    baseline reads as surges. The warm-up counts only non-zero norms, and a layer whose norm
    swings widely needs a proportionally larger jump. Pure Python, JSON-serialisable.

    Args:
        window (`int`, *optional*, defaults to `50`): norms per layer in the robust baseline.
        warmup (`int`, *optional*, defaults to `30`): non-zero norms a layer needs before it is judged.
        spread_k (`float`, *optional*, defaults to `4.0`): robust standard deviations of the
            log-norm a layer may move without counting as a surge.

    Example:
        ```python
        >>> baselines = LayerBaselines(warmup=3)
        >>> for _ in range(3):
        ...     baselines.observe({"a": 1.0, "b": 1.0})
        >>> baselines.observe({"a": 1.0, "b": 10.0})
        (10.0, 'b')
        ```
    """

    def __init__(self, window: int = 50, warmup: int = 30, spread_k: float = 4.0) -> None:
        if warmup < 1 or window < warmup:
            raise ValueError(f"window={window}, warmup={warmup} are invalid: expected 1 <= warmup <= window.")
        if spread_k < 0:
            raise ValueError(f"spread_k={spread_k} is invalid: expected a number >= 0.")
        self.window, self.warmup, self.spread_k = window, warmup, spread_k
        self.logs: dict[str, RollingWindow] = {}

    def excess(self, name: str, norm: float) -> float | None:
        """`norm` over the layer's normal ceiling (see the class), `None` while warming up."""
        w = self.logs.get(name)
        if w is None or len(w) < self.warmup or not norm > 0.0:
            return None
        med, mad = w.median(), w.mad()
        assert med is not None and mad is not None
        return math.exp(math.log(norm) - med - self.spread_k * MAD_TO_STD * mad)

    def observe(self, norms: Mapping[str, float]) -> tuple[float | None, str | None]:
        """Judge this step's per-layer norms, then fold them into the baselines.

        Returns:
            `tuple`: `(max excess, layer)` over the warmed-up layers, `(None, None)` while
            none is; a non-finite norm gives `(inf, layer)` and leaves every baseline untouched.
        """
        for name, norm in norms.items():
            if not math.isfinite(norm):
                return math.inf, name
        best: tuple[float | None, str | None] = (None, None)
        for name, norm in norms.items():
            ratio = self.excess(name, norm)
            if ratio is not None and (best[0] is None or ratio > best[0]):
                best = (ratio, name)
            if norm > 0.0:  # a zero norm (lora_A before lora_B moved) is no baseline
                self.logs.setdefault(name, RollingWindow(self.window)).add(math.log(norm))
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "warmup": self.warmup, "spread_k": self.spread_k,
                "logs": {name: w.values for name, w in self.logs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.logs = {}
        for name, values in state.get("logs", {}).items():
            w = RollingWindow(self.window)
            for v in values[-self.window:]:
                w.add(float(v))
            self.logs[name] = w


class Ema:
    """Exponential moving average with bias correction (Adam style), JSON-serialisable.

    Args:
        decay (`float`): weight of the old value, in [0, 1).
    """

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid: expected 0 <= decay < 1.")
        self.decay = decay
        self._raw = 0.0
        self.count = 0

    def add(self, value: float | None) -> bool:
        """Fold in `value` if it is finite; returns whether it was used."""
        if value is None or not math.isfinite(value):
            return False
        self._raw = self.decay * self._raw + (1.0 - self.decay) * float(value)
        self.count += 1
        return True

    @property
    def value(self) -> float | None:
        if self.count == 0:
            return None
        return self._raw / (1.0 - self.decay**self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "raw": self._raw, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self._raw = float(state["raw"])
        self.count = int(state["count"])


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares line through `(x, y)` points: returns `(slope, intercept)`.

    `None` with fewer than two points or when all `x` are equal.
    """
    n = len(points)
    if n < 2:
        return None
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0.0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


def ramp(value: float, lo: float, hi: float) -> float:
    """0 at or below `lo`, 1 at or above `hi`, linear in between (`hi > lo`)."""
    if value <= lo:
        return 0.0
    if value >= hi:
        return 1.0
    return (value - lo) / (hi - lo)

"""Rolling and robust statistics of the signals, all JSON-serialisable so a resumed run continues exactly.

Robust statistics (median / MAD) rather than mean / std: the values they summarise are the ones that hold outliers
(loss spikes, gradient surges), and one spike must not move the baseline it is compared against.

`SignalFrame`: what the sensing layer measured in one optimizer step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..jsonutil import safe_float

MAD_TO_STD = 1.4826
"""Scale factor turning a median absolute deviation into a normal standard deviation."""


class RollingWindow:
    """The last `maxlen` finite values with robust summaries (cached until the next `add`)."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} is invalid: expected an integer >= 1.")
        self.maxlen = maxlen
        self._values: deque[float] = deque(maxlen=maxlen)
        self._cache: dict[str, float | None] = {}

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float | None) -> bool:
        """Append `value` if it is finite; returns whether it was kept."""
        if value is None or not math.isfinite(value):
            return False
        self._values.append(float(value))
        self._cache.clear()
        return True

    @property
    def values(self) -> list[float]:
        return list(self._values)

    def median(self) -> float | None:
        if "median" not in self._cache:  # statistics.median (one C sort) beats numpy ~6x on ~100 values
            self._cache["median"] = statistics.median(self._values) if self._values else None
        return self._cache["median"]

    def mad(self) -> float | None:
        """Median absolute deviation from the median (unscaled)."""
        if "mad" not in self._cache:
            med = self.median()
            self._cache["mad"] = None if med is None else statistics.median([abs(v - med) for v in self._values])
        return self._cache["mad"]

    def robust_z(self, value: float, *, rel_floor: float = 0.0) -> float | None:
        """Robust standard deviations `value` lies above the median; the scale is `max(1.4826 * MAD, rel_floor *
        |median|)`, so a nearly constant series does not turn a tiny wobble into a huge z-score."""
        if len(self._values) < 2 or not math.isfinite(value):
            return None
        med = self.median()
        assert med is not None
        return (value - med) / max(MAD_TO_STD * (self.mad() or 0.0), rel_floor * abs(med), 1e-12)

    def diff_noise(self) -> float | None:
        """Robust standard deviation of the step-to-step noise, `1.4826 * MAD(differences) / sqrt(2)`: a linear
        trend (a loss that falls steadily) is not noise."""
        if len(self._values) < 3:
            return None
        if "diff_noise" not in self._cache:
            diffs = [b - a for a, b in itertools.pairwise(self._values)]
            med = statistics.median(diffs)
            self._cache["diff_noise"] = MAD_TO_STD * statistics.median([abs(d - med) for d in diffs]) / math.sqrt(2.0)
        return self._cache["diff_noise"]

    def state_dict(self) -> dict[str, Any]:
        return {"maxlen": self.maxlen, "values": list(self._values)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.maxlen = int(state["maxlen"])
        self._values = deque((float(v) for v in state["values"]), maxlen=self.maxlen)
        self._cache.clear()


class LayerBaselines:
    """Each LoRA layer's gradient norm judged against the layer's own history (docs/policy.md, "Per-layer LoRA
    baselines"): `excess = norm / exp(median(log norms) + spread_k * 1.4826 * MAD(log norms))` over its last
    `window` non-zero norms, once it has `warmup` of them. LoRA layers start with `lora_B = 0`, so their early norms
    jump by orders of magnitude: a young baseline would read that as surges, and a swinging layer needs a larger jump.

    Args:
        window (`int`, *optional*, defaults to `50`): norms per layer in the robust baseline.
        warmup (`int`, *optional*, defaults to `30`): non-zero norms a layer needs before it is judged.
        spread_k (`float`, *optional*, defaults to `4.0`): robust standard deviations of the log-norm a layer may move
            without counting as a surge.
    """

    def __init__(self, window: int = 50, warmup: int = 30, spread_k: float = 4.0) -> None:
        if warmup < 1 or window < warmup or spread_k < 0:
            raise ValueError(f"window={window}, warmup={warmup}, spread_k={spread_k} are invalid: expected "
                             "1 <= warmup <= window and spread_k >= 0.")
        self.window, self.warmup, self.spread_k = window, warmup, spread_k
        self.logs: dict[str, RollingWindow] = {}

    def excess(self, name: str, norm: float) -> float | None:
        """`norm` over the layer's normal ceiling, `None` while the layer warms up."""
        w = self.logs.get(name)
        if w is None or len(w) < self.warmup or not norm > 0.0:
            return None
        med, mad = w.median(), w.mad()
        assert med is not None and mad is not None
        return math.exp(math.log(norm) - med - self.spread_k * MAD_TO_STD * mad)

    def observe(self, norms: Mapping[str, float]) -> tuple[float | None, str | None]:
        """Judge this step's per-layer norms, then fold them in: `(max excess, layer)` over the warmed-up layers,
        `(None, None)` while none is; a non-finite norm gives `(inf, layer)` and leaves every baseline untouched."""
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
            self.logs[name] = w = RollingWindow(self.window)
            for v in values[-self.window:]:
                w.add(float(v))


class Ema:
    """Exponential moving average with bias correction (Adam style); `decay` is the old value's weight, in [0, 1)."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid: expected 0 <= decay < 1.")
        self.decay, self.raw, self.count = decay, 0.0, 0

    def add(self, value: float | None) -> bool:
        """Fold in `value` if it is finite; returns whether it was used."""
        if value is None or not math.isfinite(value):
            return False
        self.raw = self.decay * self.raw + (1.0 - self.decay) * float(value)
        self.count += 1
        return True

    @property
    def value(self) -> float | None:
        return None if self.count == 0 else self.raw / (1.0 - self.decay**self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "raw": self.raw, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.decay, self.raw, self.count = float(state["decay"]), float(state["raw"]), int(state["count"])


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """`(slope, intercept)` of the least-squares line through `(x, y)` points; `None` with fewer than two points or
    when every `x` is equal."""
    n = len(points)
    if n < 2:
        return None
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0.0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


@dataclass
class SignalFrame:
    """Signals of one optimizer step, as the decision policy sees them (docs/policy.md section 1).

    Every field but `step` may be `None` (a probe not wired, a memory sample not due). Under DDP the frame is reduced
    across ranks (`distributed.reduce_frame`) before the policy sees it, so every rank decides on the same numbers.

    Args:
        step (`int`): optimizer steps completed after this step's update (Trainer's `global_step` once the step
            ends); in `RulePolicy.pre_update` the model still holds the state of `step - 1`.
        loss (`float`, *optional*): the step's loss, summed over its micro-batches (and ranks).
        grad_norm (`float`, *optional*): pre-clip global L2 norm of the gradients.
        lora_max_ratio (`float`, *optional*): max over LoRA layers of the layer's norm over its own baseline.
        lora_max_layer (`str`, *optional*): the layer reaching `lora_max_ratio`.
        nonfinite (`bool`, *optional*, defaults to `False`): a gradient or the loss is NaN/inf.
        device_mem_frac, host_mem_frac (`float`, *optional*): accelerator / host (or cgroup) memory in use.
        step_time_s (`float`, *optional*): wall time of the step.
        lr (`float`, *optional*): learning rate of the first parameter group, as used by this update.
        preempt (`bool`, *optional*, defaults to `False`): a preemption signal arrived.
        save_blocking_s (`float`, *optional*): seconds this rank was blocked by its saves since its previous frame
            (MAX over ranks once reduced): the policy's only view of the save cost; `None` or `0`: no save.
        clip_norm (`float`, *optional*): the norm the loop clips to (`max_grad_norm`): judges the very first step.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lora_max_ratio: float | None = None
    lora_max_layer: str | None = None
    nonfinite: bool = False
    device_mem_frac: float | None = None
    host_mem_frac: float | None = None
    step_time_s: float | None = None
    lr: float | None = None
    preempt: bool = False
    save_blocking_s: float | None = None
    clip_norm: float | None = None

    @property
    def mem_frac(self) -> float | None:
        """The larger of the device and host memory fractions, `None` when neither was sampled."""
        return max((v for v in (self.device_mem_frac, self.host_mem_frac) if v is not None), default=None)

    @property
    def any_nonfinite(self) -> bool:
        """`nonfinite`, or a loss / grad norm / LoRA ratio that is NaN or infinite."""
        return self.nonfinite or any(v is not None and not math.isfinite(v)
                                     for v in (self.loss, self.grad_norm, self.lora_max_ratio))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite floats as `"NaN"`, `"Infinity"`, `"-Infinity"`: `jsonutil.safe_float`)."""
        return {f.name: safe_float(v) if isinstance(v := getattr(self, f.name), float) else v
                for f in dataclasses.fields(self)}

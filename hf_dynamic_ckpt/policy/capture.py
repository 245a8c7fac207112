"""The pre-update capture: which rule says the update about to happen is bad.

`capture_rule` is pure (the frame against the baselines); `CaptureTrigger` keeps the state that
turns a rule into at most one capture per episode (cooldown, runs of non-finite steps).

From the first optimizer step: while a statistic has fewer than `MIN_HISTORY` values the
regular rules (robust z-scores, spread-discounted ratios) have nothing to stand on, so
*early rules* take over. They need no history and no unit: a value many times the median
of the values seen so far (the bars double below `EARLY_FLOOR` values, a baseline of one or
two samples being itself noisy), a learning rate far above the highest seen, and on the
very first step a gradient norm orders of magnitude above the clip norm. Calibrated on
calm first steps (`tests/data/traces/early/`: both tiny models, full and LoRA fine-tunes,
with and without warm-up): loss <= 1.02x, grad norm <= 6.1x their running medians in the
first 20 steps, learning rate <= 2x (linear warm-up), grad norm <= 0.84x the clip norm at step 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import PolicyParams
from ..signals.frame import SignalFrame
from ..signals.stats import RollingWindow
from .baselines import MIN_HISTORY, Assessment, Baselines
from .stateful import Stateful

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

"""Sensing: one `SignalFrame` per optimizer step, and the statistics the policy judges it with.

`SignalFrame` and the statistics are plain Python (the policy imports them without torch); the probes that measure a
step (`LossProbe`, `GradProbe`, `ClipNormRecorder`, `MemoryProbe`) need torch and live in `signals.probes`.
"""

from __future__ import annotations

from .stats import Ema, LayerBaselines, RollingWindow, SignalFrame, linear_fit

__all__ = ["Ema", "LayerBaselines", "RollingWindow", "SignalFrame", "linear_fit"]

"""Sensing: one `SignalFrame` per optimizer step from cheap probes.

`SignalFrame` and the statistics are plain Python; the probes (which need torch) load on
first attribute access, so the pure policy can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .frame import SignalFrame
from .stats import Ema, RollingWindow

if TYPE_CHECKING:
    from .probes import ClipNormRecorder, GradProbe, LossProbe, MemoryProbe, PreemptionFlag, find_lora_layers

_PROBES = {"ClipNormRecorder", "GradProbe", "LossProbe", "MemoryProbe", "PreemptionFlag", "find_lora_layers"}

__all__ = [
    "ClipNormRecorder",
    "Ema",
    "GradProbe",
    "LossProbe",
    "MemoryProbe",
    "PreemptionFlag",
    "RollingWindow",
    "SignalFrame",
    "find_lora_layers",
]


def __getattr__(name: str) -> Any:
    if name in _PROBES:
        return getattr(importlib.import_module(".probes", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

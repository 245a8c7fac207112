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
    from .memory import MemoryProbe
    from .probes import ClipNormRecorder, GradProbe, LossProbe, find_lora_layers

_PROBES = {"ClipNormRecorder": ".probes", "GradProbe": ".probes", "LossProbe": ".probes", "MemoryProbe": ".memory",
           "find_lora_layers": ".probes"}

__all__ = [
    "ClipNormRecorder",
    "Ema",
    "GradProbe",
    "LossProbe",
    "MemoryProbe",
    "RollingWindow",
    "SignalFrame",
    "find_lora_layers",
]


def __getattr__(name: str) -> Any:
    if name in _PROBES:
        return getattr(importlib.import_module(_PROBES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

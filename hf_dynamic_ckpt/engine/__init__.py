"""Save engine: snapshot (the only blocking part) + background writer + memory-aware staging."""

from .snapshot import StateSources
from .writer import OnBusy, SaveEngine, SaveHandle

__all__ = ["OnBusy", "SaveEngine", "SaveHandle", "StateSources"]

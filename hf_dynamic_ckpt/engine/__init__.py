"""Save engine: snapshot (the only blocking part) + background writer + memory-aware staging."""

from .engine import SaveEngine
from .writer import OnBusy, SaveHandle

__all__ = ["OnBusy", "SaveEngine", "SaveHandle"]

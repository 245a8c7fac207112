"""Save engine: snapshot (the only blocking part) + background writer + memory-aware staging."""

from ..state import CachedWeights, StateSources
from .engine import SaveEngine
from .writer import OnBusy, SaveHandle

__all__ = ["CachedWeights", "OnBusy", "SaveEngine", "SaveHandle", "StateSources"]

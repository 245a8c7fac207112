"""Tiered checkpoint store: formats, atomic commit, catalog."""

from __future__ import annotations

from .store import CheckpointStore
from .types import BlobRef, CheckpointInfo, CheckpointState, LoadedCheckpoint

__all__ = ["BlobRef", "CheckpointInfo", "CheckpointState", "CheckpointStore", "LoadedCheckpoint"]

"""Tiered checkpoint store: formats, atomic commit, catalog, timelines."""

from __future__ import annotations

from .spec import Codec, Lineage, SaveRequest, StoreSpec
from .store import CheckpointStore
from .types import BlobRef, CheckpointInfo, CheckpointState, GcReport, LoadedCheckpoint, Removal

__all__ = ["BlobRef", "CheckpointInfo", "CheckpointState", "CheckpointStore", "Codec", "GcReport", "Lineage",
           "LoadedCheckpoint", "Removal", "SaveRequest", "StoreSpec"]

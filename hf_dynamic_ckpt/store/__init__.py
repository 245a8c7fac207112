"""The checkpoint store: tier formats, atomic commit, catalog, timelines, writer lock, object-store roots."""

from __future__ import annotations

from .catalog import Catalog
from .manifest import (
    STATUS_CORRUPT,
    STATUS_OK,
    CheckpointInfo,
    CheckpointState,
    Lineage,
    LoadedCheckpoint,
    Removal,
    SaveRequest,
    check_frozen,
    frozen_record,
    is_url,
    new_session_id,
    parse_step_dir,
)
from .remote import (
    Remote,
    RemoteSpec,
    RemoteStorageError,
    check_public_options,
    check_url,
    default_cache_dir,
    redact,
)
from .store import CheckpointStore, find_root, task_dirs

__all__ = ["STATUS_CORRUPT", "STATUS_OK", "Catalog", "CheckpointInfo", "CheckpointState", "CheckpointStore", "Lineage",
           "LoadedCheckpoint", "Remote", "RemoteSpec", "RemoteStorageError", "Removal", "SaveRequest", "check_frozen",
           "check_public_options", "check_url", "default_cache_dir", "find_root", "frozen_record", "is_url",
           "new_session_id", "parse_step_dir", "redact", "task_dirs"]

"""The checkpoint store: tier formats, atomic commit, catalog, timelines, writer lock, object-store roots."""

from __future__ import annotations

from .catalog import Catalog
from .manifest import (
    STATUS_CORRUPT,
    STATUS_MISSING,
    STATUS_OK,
    CheckpointInfo,
    CheckpointState,
    Codec,
    GcReport,
    Lineage,
    LoadedCheckpoint,
    Removal,
    SaveRequest,
    StoreSpec,
    check_frozen,
    frozen_record,
    is_url,
    new_session_id,
    parse_step_dir,
    read_manifest,
)
from .optpack import usable_cpus
from .remote import (
    Remote,
    RemoteSpec,
    RemoteStorageError,
    check_public_options,
    check_url,
    default_cache_dir,
    redact,
)
from .store import NAMED_REFS, CheckpointStore, find_root, task_dirs

__all__ = ["NAMED_REFS", "STATUS_CORRUPT", "STATUS_MISSING", "STATUS_OK", "Catalog", "CheckpointInfo",
           "CheckpointState", "CheckpointStore", "Codec", "GcReport", "Lineage", "LoadedCheckpoint", "Remote",
           "RemoteSpec", "RemoteStorageError", "Removal", "SaveRequest", "StoreSpec", "check_frozen",
           "check_public_options", "check_url", "default_cache_dir", "find_root", "frozen_record", "is_url",
           "new_session_id", "parse_step_dir", "read_manifest", "redact", "task_dirs", "usable_cpus"]

"""hf_dynamic_ckpt: signal-driven, tiered, non-blocking checkpointing with exact resume.

Importing the package is cheap: the integrations (which import transformers/accelerate)
load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import SmartCkptArguments, SmartCkptConfig
from .constants import FORMAT_VERSION, Tier
from .constants import VERSION as __version__  # noqa: F401 - the package version
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    DynamicCkptError,
    FormatVersionError,
    IncompatibleStateError,
    SaveError,
)

_LAZY = {
    "CheckpointStore": "hf_dynamic_ckpt.store",
    "SmartCheckpointer": "hf_dynamic_ckpt.integrations.accelerate",
    "SmartCkptCallback": "hf_dynamic_ckpt.integrations.trainer",
    "resume_checkpoint": "hf_dynamic_ckpt.integrations.trainer",
}

if TYPE_CHECKING:
    from .integrations.accelerate import SmartCheckpointer
    from .integrations.trainer import SmartCkptCallback, resume_checkpoint
    from .store import CheckpointStore

__all__ = [
    "FORMAT_VERSION",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "DynamicCkptError",
    "FormatVersionError",
    "IncompatibleStateError",
    "SaveError",
    "SmartCheckpointer",
    "SmartCkptArguments",
    "SmartCkptCallback",
    "SmartCkptConfig",
    "Tier",
    "resume_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_dynamic_ckpt' has no attribute {name!r}")

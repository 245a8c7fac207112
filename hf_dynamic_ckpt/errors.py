"""Exception types. Each also inherits the builtin a caller would naturally catch."""

from __future__ import annotations


class DynamicCkptError(Exception):
    """Base class of every error raised by hf_dynamic_ckpt."""


class ConfigError(DynamicCkptError, ValueError):
    """A configuration value is out of range or of the wrong kind."""


class UnknownConfigKeyError(ConfigError, TypeError):
    """A configuration key no setting has (a keyword, a YAML or dict key); the message names the closest valid one.
    Also a `TypeError`, what Python raises for an unexpected keyword argument."""


class GlobalBatchError(ConfigError):
    """A resume on another number of processes cannot keep the checkpoint's global batch (per-device batch x
    processes x accumulation) with the settings given; the message names the settings that would."""


class CheckpointNotFoundError(DynamicCkptError, FileNotFoundError):
    """A path or reference does not name a committed checkpoint."""


class CorruptCheckpointError(DynamicCkptError, ValueError):
    """A checkpoint file is missing, truncated, or fails its checksum."""


class FormatVersionError(DynamicCkptError, ValueError):
    """A checkpoint was written by a newer, unknown version of the on-disk format."""


class IncompatibleStateError(DynamicCkptError, ValueError):
    """Saved weights or optimizer state do not fit the model (names or shapes differ)."""


class SaveError(DynamicCkptError, RuntimeError):
    """A save failed; the previous checkpoint stays the restore point."""


class DistributedError(DynamicCkptError, RuntimeError):
    """Ranks disagree (restore point, files, decisions) or a rank did not finish in time."""


class StoreLockedError(DynamicCkptError, RuntimeError):
    """Another live session writes the same task (the message names it: pid, host, session, since when)."""


class StoreNotWritableError(DynamicCkptError, PermissionError):
    """The store root cannot be written (a read-only mount, no permission): this run could not save there."""


class RollbackError(DynamicCkptError, RuntimeError):
    """A confirmed anomaly after `max_rollbacks` rollbacks within `rollback_window` steps (`on_rollbacks_exhausted:
    stop`): the run keeps failing at the same place; the message names the steps and what to change."""


class UnsafePathError(DynamicCkptError, PermissionError):
    """A path the store was about to change resolves outside the store root, or through a symbolic link."""


def weights_overwritten(held: str) -> str:
    """The sentence an error adds when a resume had read weights into the model before it failed (`held`: what the
    model's weights are now)."""
    return (f" The model's weights were overwritten by this resume's reads (they hold {held}): build the model "
            "again before training it.")

"""Exception types (each also inherits the builtin a caller would naturally catch), and the one test hook that
raises or kills on purpose (`fault`)."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path


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


# -- the documented test hook ---------------------------------------------------------------------------------------
FAULT_ENV = "HF_DYNAMIC_CKPT_FAULT"
"""Environment variable of the test hook `fault`: faults to inject at named points of the library."""

_faults: tuple[str, list[dict[str, str]]] = ("", [])
_hits: dict[int, int] = {}


def fault(point: str, **where: object) -> None:
    """The library's one test hook: inject the fault `HF_DYNAMIC_CKPT_FAULT` names for `point`, if any.

    The variable holds entries separated by ``;``, each ``POINT[@KEY=VALUE...]:ACTION[=ARG]``. An entry applies when
    its point is `point` and every ``KEY=VALUE`` filter equals what the call passes in `where` (``step``, ``rank``,
    ``name``, ``op``, ``path``, ``attempt``) and, for ``nth=K``, when this is the K-th call of the point that passes
    those filters since the variable took its value. Actions:
    ``kill`` (SIGKILL this process), ``raise=ERRNO`` (an `OSError` with that errno name, e.g. ``ENOSPC``, ``EIO``),
    ``sleep=MS``, ``gate=DIR`` (create ``DIR/<point>.reached``, then wait until ``DIR/<point>.go`` exists) and
    ``log=FILE`` (append one JSON line: the point and `where`). Points: ``snapshot`` (a save's copy, before it),
    ``overlap_copy`` (an overlapped snapshot's host copy beside the next step: `step`), ``write`` (each checkpoint
    file written: `step`, `rank`, `name`), ``commit`` (before a checkpoint's final rename: `step`), ``fs`` (each
    change on the store's disk: `op` mkdir, rename, replace, unlink, rmtree or fsync, `path`), ``read`` (each
    checkpoint file read or verified: `name`, `step`, `op` read or check: a checksum pass of its own),
    ``read_optimizer`` (a resume's optimizer-tier read), ``resume`` (a resume's listing of its candidates, on each
    rank: `rank`), ``remote`` (each object-store call: `op` put, get, stat,
    read, list or rm, `name` the key under the task, `attempt`) and ``export`` (each file of an export before it is
    synced, then its marker: `name`). Unset, it costs one lookup.

    Example:
        ```bash
        HF_DYNAMIC_CKPT_FAULT="write@step=4@name=weights.safetensors:raise=ENOSPC" python train.py
        ```
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    global _faults
    if _faults[0] != spec:
        _faults = (spec, [_parse_fault(entry) for entry in spec.split(";") if entry.strip()])
        _hits.clear()
    fired = []
    for k, entry in enumerate(_faults[1]):  # every matching entry counts this call, then they act in order
        if entry["point"] == point and all(str(where.get(key)) == value for key, value in entry.items()
                                           if key not in ("point", "action", "arg", "nth")):
            _hits[k] = count = _hits.get(k, 0) + 1
            fired += [entry] if entry.get("nth", str(count)) == str(count) else []
    for entry in fired:
        action, arg = entry["action"], entry.get("arg", "")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            code = getattr(errno, arg, errno.EIO)
            raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_ENV} at {point})")
        elif action == "sleep":
            time.sleep(float(arg) / 1e3)
        elif action == "gate":
            Path(arg, f"{point}.reached").touch()
            while not Path(arg, f"{point}.go").exists():
                time.sleep(0.01)
        elif action == "log":
            with open(arg, "a", encoding="utf-8") as f:
                f.write(json.dumps({"point": point, **{k: str(v) for k, v in where.items()}}) + "\n")


def _parse_fault(entry: str) -> dict[str, str]:
    head, _, action = entry.strip().rpartition(":")
    point, *filters = head.split("@")
    name, _, arg = action.partition("=")
    if not point or name not in ("kill", "raise", "sleep", "gate", "log"):
        raise ConfigError(f"{FAULT_ENV} entry {entry!r} is invalid: expected POINT[@KEY=VALUE...]:ACTION[=ARG] with "
                          "ACTION one of kill, raise=ERRNO, sleep=MS, gate=DIR, log=FILE.")
    return dict(f.split("=", 1) for f in filters if "=" in f) | {"point": point, "action": name, "arg": arg}

"""Validation helpers of `config`: range checks with messages that name the field, strict types,
"did you mean" for unknown keys and keywords (Trainer's names included), nested YAML keys named in errors,
a local store path that must be a directory."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError, UnknownConfigKeyError

_Cls = TypeVar("_Cls", bound=type)

_WARNED: set[str] = set()

# Trainer's names for the knobs users look for first.
HF_NAMES = {
    "save_steps": "base_interval",
    "save_total_limit": "keep_last",
    "save_strategy": "base_interval (the policy decides when to save; base_interval is the calm interval)",
    "save_on_each_node": "root (one store root per job; every rank writes its own files)",
    "save_only_model": "storage_levels (keep weights only with runtime.fallback_strategy: level_0_only)",
    "output_dir": "root",
    "resume_from_checkpoint": "resume_checkpoint(trainer, 'auto') / --resume_from_smart_checkpoint",
}
"""Trainer's checkpoint arguments, and what does their job here (named when one is passed as a key)."""

REMOVED = {
    "async_save": "engine='sync' writes on the training thread (async_save=false); background writes are the default",
}
"""Settings that were removed, and what replaces them (named when one is passed as a key)."""

MOVED: dict[str, str] = {}
"""Former top-level settings of `SmartCkptConfig` -> where each is now (``policy.min_interval``); filled by
`config` from its groups, named when one is passed at the top level."""

KEY_OF: dict[str, str] = {}
"""Config class name -> its key (``"PolicyParams"`` -> ``"policy"``, ``"SmartCkptConfig"`` -> ``""``); filled by
`config` with `MOVED`, so an unknown keyword of a group names the group a key belongs to."""


def warn_once(key: str) -> bool:
    """Whether to log a configuration warning: once per process, and only on rank 0 of a job."""
    if key in _WARNED or int(os.environ.get("RANK", "0") or 0) != 0:
        return False
    _WARNED.add(key)
    return True


def _did_you_mean(key: str, names: Iterable[str], *, where: str | None = None) -> str:
    if where is not None and key in MOVED and not MOVED[key].startswith(f"{where}."):
        group, name = MOVED[key].split(".", 1)
        if where:  # in another group
            return f" (it is {MOVED[key]})"
        return f" (it is {MOVED[key]} now: {group}={{{name!r}: ...}}, in YAML {group}: {{{name}: ...}})"
    if key in HF_NAMES:
        return f" (Trainer's {key!r} is {HF_NAMES[key]} here)"
    if key in REMOVED:
        return f" (removed: {REMOVED[key]})"
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(key: str, names: Iterable[str], *, prefix: str = "", keyword_of: str | None = None
                ) -> UnknownConfigKeyError:
    """The error for a key no setting has: names it as given (`prefix` + key, or a keyword of `keyword_of`), the
    closest valid name, and every allowed one."""
    names = sorted(names)
    what = f"{keyword_of}() got an unknown keyword {key!r}" if keyword_of else f"unknown config key {prefix}{key!r}"
    where = prefix.split(".")[0] if prefix else KEY_OF.get(keyword_of) if keyword_of else ""
    return UnknownConfigKeyError(f"{what}{_did_you_mean(key, names, where=where)}: allowed keys are "
                                 f"{', '.join(names)}.")


def named_keywords(cls: _Cls) -> _Cls:
    """Class decorator of a config dataclass: an unknown keyword raises `UnknownConfigKeyError` naming the closest
    valid one, as an unknown YAML / dict key does (the dataclass's own `__init__` gives a bare `TypeError`)."""
    init = vars(cls)["__init__"]
    names = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise unknown_key(unknown[0], names, keyword_of=cls.__name__)
        init(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)  # noqa: B010 - mypy refuses a direct assignment to a method
    return cls


def check_directory_path(name: str, path: str) -> None:
    """Refuse a local store path (`root`, or the `output_dir` it defaults under) that names an existing file or lies
    under one: the store is a folder, made when missing.

    Raises:
        `ConfigError`: names the key, the value, the file, and what to pass.
    """
    for where in (Path(path), *Path(path).parents):  # the nearest existing one decides
        if where.exists():
            if not where.is_dir():
                file = "it" if where == Path(path) else repr(os.fspath(where))
                fix = " (the store goes under <output_dir>/smart_ckpt)"
                if name == "root":
                    suggestion = os.path.join(os.path.dirname(where), "smart_ckpt")
                    fix = f", such as root={suggestion!r}, or leave root unset for <output_dir>/smart_ckpt"
                raise ConfigError(f"{name}={path!r} is invalid: {file} is a file, not a directory; the store is a "
                                  f"folder (catalog.db and one folder per task): pass a folder path, new or existing"
                                  f"{fix}.")
            return


def check(cond: bool, name: str, value: Any, allowed: str) -> None:
    """Raise `ConfigError("<name>=<value> is invalid: expected <allowed>.")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{name}={value!r} is invalid: expected {allowed}.")


def is_int(value: Any) -> bool:
    """An `int` and not a `bool` (YAML's `true` is no interval)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An `int` or `float`, not a `bool`, not NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def is_finite(value: Any) -> bool:
    """A number (`is_number`) that is not infinite."""
    return is_number(value) and math.isfinite(value)


def parse_enum(enum_cls: type[enum.Enum], name: str, value: Any) -> Any:
    """`enum_cls(value)`, or a `ConfigError` naming `name` and the allowed values."""
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)  # type: ignore[attr-defined]
        raise ConfigError(f"{name}={value!r} is invalid: expected one of {allowed}.") from None


def build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    """`cls(**data)` for a config dataclass; unknown keys and errors name the key as the YAML spells it
    (`where`: the nested key, e.g. `"storage_levels.level_1"`; `""` at the top level)."""
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - names)
    if unknown:
        raise unknown_key(unknown[0], names, prefix=prefix)
    try:
        return cls(**data)
    except ConfigError as e:
        text = str(e)
        name = text.split("=", 1)[0]
        if where and name in names and not text.startswith(prefix):  # name the nested key as the YAML spells it
            raise ConfigError(prefix + text) from e
        raise
    except TypeError as e:
        raise ConfigError(f"invalid config {where or cls.__name__}: {e}") from e



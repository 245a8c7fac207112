"""Configuration: frozen dataclasses validated on construction, loadable from YAML in the same shape (every setting:
docs/policy.md section 6). A bad value raises ``ConfigError("policy.stability_window=2 is invalid: expected an integer
>= 4.")``, an unknown key `UnknownConfigKeyError` naming the closest one (Trainer's included)."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import logging
import math
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, dataclass_transform

import yaml

from .constants import DEFAULT_TASK_ID
from .errors import ConfigError, UnknownConfigKeyError

logger = logging.getLogger(__name__)


# The string settings, each value and its effect in docs/policy.md section 6. Compression: the optimizer tier (L1) is
# `zstd` or `none` (`gzip`: the article's level_2 key, loaded and not applied); EngineMode: docs/engine.md; OnAnomaly:
# docs/rollback.md; OnSaveError: the previous checkpoint stays the restore point whichever is chosen.
Compression = enum.StrEnum("Compression", {"NONE": "none", "ZSTD": "zstd", "GZIP": "gzip"})
FallbackStrategy = enum.StrEnum("FallbackStrategy", {"FULL": "full", "LEVEL_0_1": "level_0_1",
                                                     "LEVEL_0_ONLY": "level_0_only"})
OnSaveError = enum.StrEnum("OnSaveError", {"WARN": "warn", "RAISE": "raise"})
OnAnomaly = enum.StrEnum("OnAnomaly", {"CAPTURE": "capture", "ROLLBACK": "rollback"})
RollbacksExhausted = enum.StrEnum("RollbacksExhausted", {"STOP": "stop", "CONTINUE": "continue"})
EngineMode = enum.StrEnum("EngineMode", {"PROCESS": "process", "SYNC": "sync"})


def _num(v: Any, *, finite: bool = False, integer: bool = False) -> bool:
    """An int (a float unless `integer`), never a bool (YAML's `true` is no interval), NaN or (`finite`) inf."""
    return isinstance(v, int if integer else int | float) and not isinstance(v, bool) and v == v and (
        not finite or math.isfinite(v))


def _int_ge(low: int, null: str | None = None) -> tuple[Callable[[Any, Any], bool], str]:
    """The rule "an integer >= `low`"; with `null` (the rest of the message) `None` is valid too."""
    return (lambda v, s: (null is not None and v is None) or (_num(v, integer=True) and v >= low)), \
        f"an integer >= {low}{null or ''}"


# A rule: `(ok(value, settings), allowed)`; `{name}` in `allowed` shows another setting's value.
_BOOL = (lambda v, s: isinstance(v, bool), "true or false (a YAML boolean, not a string)")
_UNIT = (lambda v, s: _num(v) and 0 < v <= 1, "0 < value <= 1")
_POSITIVE = (lambda v, s: _num(v) and v > 0, "a positive number")
_HOURS = (lambda v, s: _num(v, finite=True) and v > 0, "a positive number of hours")
_RATIO = (lambda v, s: _num(v) and v > 1, "a number > 1")
_SECONDS = (lambda v, s: _num(v, finite=True) and v >= 0, "a number of seconds >= 0")
_DAYS = (lambda v, s: v is None or (_num(v) and v > 0), "a positive number or null")


def _f(default: Any, ok: Callable[[Any, Any], bool] | None = None, allowed: str = "", *,
       convert: Callable[[Any], Any] | None = None) -> Any:
    """A setting with its rule; `convert` is applied to a valid value other than `None`."""
    return field(default=default, metadata={"ok": ok, "allowed": allowed, "convert": convert})


def _enum(cls: type[enum.Enum], name: str, value: Any) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is invalid: expected one of {', '.join(repr(m.value) for m in cls)}.") \
            from None


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(field,))
class _Settings:
    """A frozen, keyword-only dataclass validated field by field (enums parse their strings, the others follow their
    rule); an unknown keyword raises `UnknownConfigKeyError` naming the closest key, as an unknown YAML key does."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = dataclass(frozen=True, kw_only=True)(cls).__init__

        @functools.wraps(init)
        def __init__(self: Any, **values: Any) -> None:
            _check_keys(cls, values, None)
            init(self, **values)

        setattr(cls, "__init__", __init__)  # noqa: B010 - mypy refuses a direct assignment to a method

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, ok, convert = getattr(self, f.name), f.metadata.get("ok"), f.metadata.get("convert")
            if isinstance(f.default, enum.Enum):
                value = _enum(type(f.default), f.name, value)
            if ok is not None and not ok(value, self):
                allowed = f.metadata["allowed"].format(**vars(self))
                raise ConfigError(f"{f.name}={getattr(value, 'value', value)!r} is invalid: expected {allowed}.")
            object.__setattr__(self, f.name, convert(value) if convert is not None and value is not None else value)


class PolicyParams(_Settings):
    """The decision's constants (``policy:`` in YAML); the defaults are the tuned ones."""
    min_interval: int = _f(1, *_int_ge(1))
    max_interval: int = _f(2000, lambda v, s: _num(v, integer=True) and v >= s.min_interval,
                           "an integer >= min_interval ({min_interval})")
    mtbf_hours: float = _f(24.0, *_HOURS)
    node_mtbf_hours: float = _f(168.0, *_HOURS)
    overhead_budget: float = _f(0.02, *_UNIT)
    stability_window: int = _f(100, *_int_ge(4))
    stability_cv: float = _f(0.1, _POSITIVE[0], "a positive number (relative loss noise counted as calm, e.g. 0.1)")
    risk_threshold: float = _f(0.68, *_UNIT)
    risk_release: float = _f(0.2, lambda v, s: _num(v) and 0 <= v < s.risk_threshold,
                             "0 <= value < risk_threshold ({risk_threshold})")
    risk_smoothing: int = _f(10, *_int_ge(1))
    risk_gain: float = _f(4.0, lambda v, s: _num(v) and 0 < v <= 100, "0 < value <= 100")
    loss_spike_z: float = _f(6.0, *_POSITIVE)
    grad_surge_ratio: float = _f(5.0, *_RATIO)
    lr_surge_ratio: float = _f(2.0, *_RATIO)
    memory_threshold: float = _f(0.92, *_UNIT)
    memory_sample_every: int = _f(5, *_int_ge(1))
    memory_lookahead: int = _f(50, *_int_ge(1))
    pre_anomaly_capture: bool = _f(True, *_BOOL)
    skip_bad_update: bool = _f(False, *_BOOL)
    capture_cooldown: int | None = _f(None, *_int_ge(1, " or null (use stability_window)"))
    rollback_patience: int = _f(1, *_int_ge(1))
    rollback_window: int = _f(100, *_int_ge(1))
    max_rollbacks: int = _f(5, *_int_ge(1))
    on_rollbacks_exhausted: RollbacksExhausted = RollbacksExhausted.STOP
    rollback_skip_batches: int = _f(0, *_int_ge(0))
    keep_log_spaced: bool = _f(True, *_BOOL)
    learned_model: str | None = _f(None, lambda v, s: v is None or (isinstance(v, str | os.PathLike) and (
        os.fspath(v) == "builtin" or (os.fspath(v).endswith(".safetensors") and os.path.isfile(v)))),
        "'builtin', the path of an existing .safetensors decision model, or null (rules only)", convert=os.fspath)


class LevelConfig(_Settings):
    """Retention of the weights tier (``storage_levels.level_0``) or the state tier (``level_2``)."""
    retention_days: float | None = _f(None, *_DAYS)


class OptimizerLevelConfig(LevelConfig):
    """Storage of the optimizer tier (``storage_levels.level_1``): the one tier that is compressed."""
    compression: Compression = _f(Compression.ZSTD, lambda v, s: v != Compression.GZIP,
                                  "'zstd' or 'none' (gzip is not offered for L1: zstd level 1-3 is smaller and faster)")
    compression_level: int = _f(1, lambda v, s: _num(v, integer=True) and 1 <= v <= 19, "1 <= level <= 19")
    retention_days: float | None = _f(7, *_DAYS)


WARNED: set[str] = set()
"""The configuration notes logged in this process (each once, on rank 0 only); clear it to hear them again."""


def _note(key: str, level: int, message: str) -> None:
    if key not in WARNED and int(os.environ.get("RANK", "0") or 0) == 0:
        logger.log(level, message)
        WARNED.add(key)


class StorageLevels(_Settings):
    """Per-tier storage (``storage_levels:`` in YAML): each tier's retention and the optimizer tier's codec."""
    level_0: LevelConfig = field(default_factory=lambda: LevelConfig(retention_days=30))
    level_1: OptimizerLevelConfig = field(default_factory=OptimizerLevelConfig)
    level_2: LevelConfig = field(default_factory=lambda: LevelConfig(retention_days=90))

    def __post_init__(self) -> None:
        for name in ("level_0", "level_1", "level_2"):
            value = getattr(self, name)
            if isinstance(value, Mapping):  # the article's keys that load and have no effect: a log line each
                value = dict(value)
                device, codec = value.pop("device", None), value.pop("compression", None) if name != "level_1" else None
                if device is not None:
                    _note("device", logging.INFO, f"storage_levels.{name}.device={device!r} is not applied: every tier"
                          " is stored under root (the article's storage-class label loads, and has no effect)")
                if codec is not None and _enum(Compression, f"storage_levels.{name}.compression", codec) != "none":
                    if name == "level_0":
                        raise ConfigError(f"storage_levels.level_0.compression={codec!r} is invalid: expected 'none' "
                                          "(weights stay uncompressed so they can be memory-mapped).")
                    _note("level_2.compression", logging.WARNING, f"storage_levels.level_2.compression={codec!r} is "
                          "not applied: L2 (RNG, data position, metadata) is a few KB of plain JSON kept readable by "
                          "jq; set it to 'none' to silence this.")
            object.__setattr__(self, name, _build(
                OptimizerLevelConfig if name == "level_1" else LevelConfig, f"storage_levels.{name}", value,
                "a mapping such as {retention_days: 7} (leave the key out for the defaults)."))


def _public_options(options: Mapping[str, Any]) -> dict[str, Any]:
    from .store import check_public_options  # never credentials: the config is logged and saved

    return check_public_options(options, "remote.storage_options")


class RemoteParams(_Settings):
    """A URL root's object-store settings (``remote:`` in YAML, docs/storage.md)."""
    cache_dir: str | None = _f(None, lambda v, s: v is None or isinstance(v, str | os.PathLike),
                               "a directory path or null", convert=os.fspath)
    storage_options: Mapping[str, Any] | None = _f(None, convert=_public_options)
    retries: int = _f(5, *_int_ge(0))
    backoff_s: float = _f(0.5, *_SECONDS)


class RuntimeParams(_Settings):
    """How the checkpointer behaves in the training process (``runtime:`` in YAML)."""
    fallback_strategy: FallbackStrategy = FallbackStrategy.FULL
    recovery_timeout_ms: int = _f(5000, *_POSITIVE)
    preemption_signals: tuple[str, ...] = _f(("SIGTERM", "SIGUSR1"), lambda v, s: isinstance(v, str | list | tuple)
        and all(isinstance(getattr(signal, str(n), None), signal.Signals) for n in ([v] if isinstance(v, str) else v)),
        "a list of signal names of this platform such as ['SIGTERM', 'SIGUSR1'] (an empty list disables the handlers)",
        convert=lambda v: (v,) if isinstance(v, str) else tuple(v))
    preemption_grace_s: float = _f(30.0, _POSITIVE[0], "a positive number of seconds")
    preemption_exit_code: int | None = _f(None, lambda v, s: v is None or (_num(v, integer=True) and 0 <= v <= 255),
                                          "an integer 0..255 or null (128 + signal number)")
    memory_margin: float = _f(0.15, lambda v, s: _num(v) and 0 <= v < 1, "0 <= value < 1")
    overlap_snapshot: bool | None = _f(None, lambda v, s: v is None or isinstance(v, bool),
                                       "true, false or null (a YAML boolean, not a string)")
    lock_wait_s: float = _f(120.0, *_SECONDS)
    memory_tier: bool = _f(True, *_BOOL)
    memory_every: int | None = _f(None, *_int_ge(1, " or null (from the slot's measured cost)"))
    report_to_trainer: bool = _f(True, *_BOOL)
    keep_global_batch: bool = _f(True, *_BOOL)


# The nested settings objects of `SmartCkptConfig` by key, and the article's top-level keys that live in one of them.
GROUPS: dict[str, type[Any]] = {"policy": PolicyParams, "storage_levels": StorageLevels, "remote": RemoteParams,
                                "runtime": RuntimeParams}
SEED_KEYS = {"stability_window": "policy", "risk_threshold": "policy", "recovery_timeout_ms": "runtime",
             "fallback_strategy": "runtime"}
# Trainer's checkpoint arguments and the setting that does their job here; removed settings and what replaces them.
TRAINER_NAMES = {"save_steps": "base_interval", "save_total_limit": "keep_last", "output_dir": "root",
                 "save_strategy": "base_interval (the policy decides when to save; base_interval is the calm interval)",
                 "save_on_each_node": "root (one store root per job; every rank writes its own files)",
                 "save_only_model": "storage_levels (keep weights only with runtime.fallback_strategy: level_0_only)",
                 "resume_from_checkpoint": "resume_checkpoint(trainer, 'auto') / --resume_from_smart_checkpoint"}
REMOVED = {"async_save": "engine='sync' writes on the training thread (async_save=false); background writes are the "
                         "default"}


def _check_keys(cls: type, keys: Iterable[Any], prefix: str | None) -> None:
    """Refuse the first key `cls` has no setting for, given as a keyword (`prefix=None`) or as the YAML key
    `<prefix><key>`: the error names the closest valid key (or where the key lives now) and every allowed one."""
    names = sorted(f.name for f in dataclasses.fields(cls))
    if (key := min((str(k) for k in keys if k not in names), default=None)) is None:
        return
    moved = {f.name: f"{g}.{f.name}" for g, c in GROUPS.items() if g != "storage_levels" for f in dataclasses.fields(c)}
    moved |= {f"remote_{f.name}": f"remote.{f.name}" for f in dataclasses.fields(RemoteParams)}
    group = prefix.split(".")[0] if prefix is not None else (
        "" if cls is SmartCkptConfig else next((g for g, c in GROUPS.items() if c is cls), None))
    if group is not None and key in moved and not moved[key].startswith(f"{group}."):
        g, name = moved[key].split(".", 1)
        hint = f"it is {moved[key]}" + ("" if group else f" now: {g}={{{name!r}: ...}}, in YAML {g}: {{{name}: ...}}")
    elif key in TRAINER_NAMES or key in REMOVED:
        hint = f"Trainer's {key!r} is {TRAINER_NAMES[key]} here" if key in TRAINER_NAMES else f"removed: {REMOVED[key]}"
    else:
        hint = f"did you mean {c[0]!r}?" if (c := difflib.get_close_matches(key, names, n=1, cutoff=0.6)) else ""
    what = f"unknown config key {prefix}{key!r}" if prefix is not None else f"{cls.__name__}() got an unknown keyword "\
        f"{key!r}"
    raise UnknownConfigKeyError(f"{what}{f' ({hint})' if hint else ''}: allowed keys are {', '.join(names)}.")


def _build(cls: type, where: str, value: Any, expected: str = "") -> Any:
    """A settings object from itself or from a mapping at YAML key `where` (`""`: the top level); errors name the
    keys as YAML spells them."""
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        expected = expected or (f"a mapping with {' / '.join(names)}." if len(names) <= 4 else f"a mapping of "
                                f"{cls.__name__} settings such as {{{names[0]}: ...}} (leave the key out for the "
                                "defaults).")
        raise ConfigError(f"{where}={value!r} is invalid: expected {expected}")
    prefix = f"{where}." if where else ""
    _check_keys(cls, value, prefix)
    try:
        return cls(**value)
    except ConfigError as e:
        if where and str(e).split("=", 1)[0] in names:
            raise ConfigError(prefix + str(e)) from e
        raise


def _merge(current: Any, changes: Mapping[str, Any]) -> dict[str, Any]:
    """`current`'s settings with `changes`; a nested group's mapping changes only the keys it names."""
    data = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)}
    return data | {k: _merge(data[k], v) if isinstance(v, Mapping) and dataclasses.is_dataclass(data.get(k)) else v
                   for k, v in changes.items()}


class _StrictLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s plain data, refusing a key given twice in one mapping (`path`: for the message)."""
    path = ""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1  # type: ignore[no-untyped-call]
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"{self.path}: key {key!r} is given twice, on line {seen[key]} and line {line}; keep "
                                  "one (YAML would silently use the last).")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class SmartCkptConfig(_Settings):
    """Everything the checkpointer can be told; `SmartCkptConfig()` works as is: seven settings a run may set and
    four groups of rarely changed constants, each also given as a mapping as in YAML, e.g.
    ``SmartCkptConfig(base_interval=4, policy={"min_interval": 2})``."""
    root: str | None = _f(None, lambda v, s: v is None or isinstance(v, str | os.PathLike),
                          "a directory path (str) or null", convert=os.fspath)
    task_id: str = _f(DEFAULT_TASK_ID, lambda v, s: isinstance(v, str) and v != "" and "/" not in v
                      and not v.startswith("."), "a non-empty name without '/' that does not start with '.'")
    base_interval: int | None = _f(None, *_int_ge(1, " or null (derive it from the save cost)"))
    keep_last: int | None = _f(3, *_int_ge(1, ", or null to keep every checkpoint"))
    engine: EngineMode = EngineMode.PROCESS
    on_anomaly: OnAnomaly = OnAnomaly.CAPTURE
    on_save_error: OnSaveError = OnSaveError.WARN
    policy: PolicyParams = field(default_factory=PolicyParams)
    storage_levels: StorageLevels = field(default_factory=StorageLevels)
    remote: RemoteParams = field(default_factory=RemoteParams)
    runtime: RuntimeParams = field(default_factory=RuntimeParams)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            object.__setattr__(self, name, _build(cls, name, getattr(self, name)))
        super().__post_init__()
        if self.root is not None:
            self.resolve_root(None)
        if self.on_anomaly == OnAnomaly.ROLLBACK and not self.policy.pre_anomaly_capture:
            raise ConfigError("on_anomaly='rollback' needs policy.pre_anomaly_capture=true: a rollback returns to the "
                              "healthy state captured before the anomaly.")

    def resolve_root(self, output_dir: str | os.PathLike[str] | None) -> str:
        """The store directory: `root` when set, else `<output_dir>/smart_ckpt`. `ConfigError` when neither is given,
        a URL root names no fsspec protocol or bucket, or a local path is (or lies under) a file."""
        from .store import check_url, is_url  # URL roots: docs/storage.md

        if self.root is None and output_dir is None:
            raise ConfigError("root=None is invalid without an output_dir: set SmartCkptConfig(root=...).")
        name, path = ("root", self.root) if self.root is not None else ("output_dir", os.fspath(output_dir or ""))
        if name == "root" and "://" in path:
            if not is_url(path):
                raise ConfigError(f"root={path!r} is invalid: expected a directory path or a URL such as s3://bucket/run.")
            check_url(path)
        # The nearest existing folder or file on the way up decides.
        where = next((w for w in (() if is_url(path) else (Path(path), *Path(path).parents)) if w.exists()), None)
        if where is not None and not where.is_dir():
            fix = (" (the store goes under <output_dir>/smart_ckpt)" if name == "output_dir" else ", such as "
                   f"root={os.path.join(os.path.dirname(where), 'smart_ckpt')!r}, or leave root unset for "
                   "<output_dir>/smart_ckpt")
            raise ConfigError(f"{name}={path!r} is invalid: {'it' if where == Path(path) else repr(str(where))} is a "
                              "file, not a directory; the store is a folder (catalog.db and one folder per task): pass "
                              f"a folder path, new or existing{fix}.")
        return path if name == "root" else os.path.join(path, "smart_ckpt")

    def replace(self, **changes: Any) -> SmartCkptConfig:
        """A copy with `changes`; a group's mapping changes only the keys it names
        (``config.replace(policy={"min_interval": 5})`` keeps the other policy settings)."""
        return dataclasses.replace(self, **_merge(self, changes))  # type: ignore[type-var]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SmartCkptConfig:
        """Build from a mapping in the shape of `to_dict()`; the article's top-level keys (`SEED_KEYS`) load into
        their groups."""
        data = dict(data)
        for key, group in SEED_KEYS.items():
            nested = data.get(group) or {}
            if key in data and isinstance(nested, Mapping):  # a group that is no mapping: its own error names it
                if key in nested:
                    raise ConfigError(f"{key} is given twice, at the top level and as {group}.{key}; keep one.")
                data[group] = {**nested, key: data.pop(key)}
        return _build(cls, "", data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SmartCkptConfig:
        """Read a ``checkpoint_config.yaml`` (the shape of `to_dict()`). An unknown key is an error naming it, a key
        given twice in one mapping an error naming both lines (PyYAML would silently keep the last)."""
        loader = type("Loader", (_StrictLoader,), {"path": os.fspath(path)})
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.load(f, Loader=loader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{os.fspath(path)} is not valid YAML: {e}") from e
        if not isinstance(data, Mapping):
            raise ConfigError(f"{os.fspath(path)}: expected a mapping at the top level, got {type(data).__name__}.")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as their values, groups as mappings) that `from_dict` reads back to an equal config."""
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[call-overload, no-any-return]


@dataclass(kw_only=True)
class SmartCkptArguments:
    """Command-line arguments for scripts built on `transformers.HfArgumentParser`; `to_config()` makes the config."""
    resume_from_smart_checkpoint: str | None = field(default=None, metadata={"help": "Resume point: auto | best | "
                                                     "fastest | step:N | PATH (auto starts fresh on an empty store)."})
    smart_ckpt_config: str | None = field(default=None, metadata={"help": "Path of a checkpoint_config.yaml."})
    smart_ckpt_root: str | None = field(default=None, metadata={"help": "Store directory (default "
                                        "<output_dir>/smart_ckpt; overrides the YAML's root)."})
    smart_ckpt_on_anomaly: str | None = field(default=None, metadata={"help": "capture (save and pin the state before "
                                              "an anomaly) or rollback (also return to it in place and skip the bad "
                                              "data); overrides the YAML's on_anomaly."})

    def to_config(self) -> SmartCkptConfig:
        """The YAML of `smart_ckpt_config` (or the defaults) with the root and `on_anomaly` given here."""
        config = SmartCkptConfig.from_yaml(self.smart_ckpt_config) if self.smart_ckpt_config else SmartCkptConfig()
        given = {"root": self.smart_ckpt_root, "on_anomaly": self.smart_ckpt_on_anomaly}
        return config.replace(**{k: v for k, v in given.items() if v is not None})

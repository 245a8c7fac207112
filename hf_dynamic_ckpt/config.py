"""Configuration: frozen dataclasses, validated on construction, loadable from YAML.

`SmartCkptConfig` has the settings a run sets (root, intervals, retention, engine, what an anomaly or a
failed save does) at the top level and the rarely changed constants in four groups (`PolicyParams`,
`StorageLevels`, `RemoteParams`, `RuntimeParams`). The YAML file has the same shape; the article's
``checkpoint_config.yaml`` loads as written.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._config_checks import (
    KEY_OF,
    MOVED,
    build,
    check,
    check_directory_path,
    is_finite,
    is_int,
    is_number,
    named_keywords,
    parse_enum,
    unknown_key,
    warn_once,
)
from .constants import DEFAULT_TASK_ID
from .errors import ConfigError
from .store import Codec

logger = logging.getLogger(__name__)


class Compression(enum.StrEnum):
    NONE = "none"
    ZSTD = "zstd"
    GZIP = "gzip"


class FallbackStrategy(enum.StrEnum):
    """What a resume does when a tier of the chosen checkpoint cannot be loaded.

    - ``full``: load every tier; a broken L1 resumes from weights with a fresh optimizer
      (warning), a broken L0 falls back to the next older checkpoint.
    - ``level_0_1``: weights and optimizer must both load; a broken L1 moves to the next
      older checkpoint whose L1 is intact instead of resuming with a fresh optimizer.
    - ``level_0_only``: restore weights and L2 state only; the optimizer starts fresh.
    """

    FULL = "full"
    LEVEL_0_1 = "level_0_1"
    LEVEL_0_ONLY = "level_0_only"


class OnSaveError(enum.StrEnum):
    """What a failed save does to the training run (the previous checkpoint stays the restore point).

    - ``warn``: one WARNING naming the step and the cause, `smart_ckpt/failed_saves` counts it,
      training continues; the same for the first, a middle and the last save of a run.
    - ``raise``: the next policy step (or `finish()` for the last save) raises the `SaveError`.
    """

    WARN = "warn"
    RAISE = "raise"


class OnAnomaly(enum.StrEnum):
    """What a confirmed anomaly (a non-finite, surging or spiking update) does.

    - ``capture``: the still-healthy state before it is saved and pinned; training goes on.
    - ``rollback``: also, once `rollback_patience` bad steps in a row confirm it, the run is
      restored in place to a healthy restore point before it (model, optimizer, scheduler,
      scaler, RNG, the policy's statistics) and continues with the next data: the batches
      consumed since are not trained on again (docs/rollback.md).
    """

    CAPTURE = "capture"
    ROLLBACK = "rollback"


class RollbacksExhausted(enum.StrEnum):
    """What a confirmed anomaly does once `max_rollbacks` rollbacks were taken within `rollback_window` steps."""

    STOP = "stop"  # raise `RollbackError`: the run keeps failing where it is
    CONTINUE = "continue"  # train through it, as `on_anomaly: capture` does


class EngineMode(enum.StrEnum):
    THREAD = "thread"
    PROCESS = "process"
    SYNC = "sync"


def _group(cls: type[Any], name: str, value: Any) -> Any:
    """A nested settings object from itself or from a mapping (the YAML shape); errors name `name.<key>`."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return build(cls, value, name)
    names = [f.name for f in dataclasses.fields(cls)]
    expected = (f"a mapping with {' / '.join(names)}." if len(names) <= 4 else
                f"a mapping of {cls.__name__} settings such as {{{names[0]}: ...}} (leave the key out for the "
                "defaults).")
    raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")


@named_keywords
@dataclass(frozen=True, kw_only=True)
class PolicyParams:
    """The decision's constants (`SmartCkptConfig.policy`, ``policy:`` in YAML): when a save fires, what counts
    as an anomaly, what a rollback may do, which older checkpoints retention thins. The defaults are the tuned
    ones (docs/policy.md); most runs change none of them.

    Args:
        min_interval (`int`, *optional*, defaults to `1`): never two regular saves closer than this.
        max_interval (`int`, *optional*, defaults to `2000`): never a calm gap longer than this.
        mtbf_hours (`float`, *optional*, defaults to `24.0`): expected time between failures.
        overhead_budget (`float`, *optional*, defaults to `0.02`): blocking save time allowed as a
            fraction of training time.
        stability_window (`int`, *optional*, defaults to `100`): steps of loss history for stability.
        stability_cv (`float`, *optional*, defaults to `0.1`): loss noise relative to the loss level
            (scale-free) up to which training counts as calm (`alpha = 1`); above it the interval
            shrinks as `stability_cv / cv`, down to 0.2.
        risk_threshold (`float`, *optional*, defaults to `0.68`): smoothed risk above which an
            immediate save fires (on the rising edge only).
        risk_release (`float`, *optional*, defaults to `0.2`): smoothed risk below which the
            trigger re-arms (hysteresis).
        risk_smoothing (`int`, *optional*, defaults to `10`): steps of the risk moving average.
        risk_gain (`float`, *optional*, defaults to `4.0`): `k` in `T = T_base * alpha / (1 + k * beta)`;
            at full risk the interval is `1 + k` times shorter.
        loss_spike_z (`float`, *optional*, defaults to `6.0`): robust z-score of a loss spike.
        grad_surge_ratio (`float`, *optional*, defaults to `5.0`): grad-norm ratio to its running
            level that counts as a surge (global and per LoRA layer).
        lr_surge_ratio (`float`, *optional*, defaults to `2.0`): a learning rate above this multiple of
            the highest rate of the last `stability_window` steps is a surge (captured before the update it
            would drive). Linear warmup never more than doubles the rate from one step to the next.
        memory_threshold (`float`, *optional*, defaults to `0.92`): memory fraction counted as risk.
        memory_sample_every (`int`, *optional*, defaults to `5`): steps between memory samples.
        memory_lookahead (`int`, *optional*, defaults to `50`): a minimal save fires when the memory
            trend predicts crossing `memory_threshold` within this many steps.
        pre_anomaly_capture (`bool`, *optional*, defaults to `True`): save and pin the state from
            before an update whose gradients surge or are not finite.
        skip_bad_update (`bool`, *optional*, defaults to `False`): also skip that update.
        capture_cooldown (`int`, *optional*): steps after a pre-update capture during which another
            finite surge or spike is not captured again (non-finite values always are, once per run
            of them). `None` uses `stability_window`.
        rollback_patience (`int`, *optional*, defaults to `1`): bad steps in a row that confirm an anomaly
            (`on_anomaly: rollback`).
        rollback_window (`int`, *optional*, defaults to `100`): the oldest restore point a rollback may return to,
            in steps before the confirming one; also the span over which `max_rollbacks` counts.
        max_rollbacks (`int`, *optional*, defaults to `5`): rollbacks allowed within `rollback_window` steps (a
            shard of `k` bad batches costs about `k / rollback_patience` of them: each skips what it consumed).
        on_rollbacks_exhausted (`str`, *optional*, defaults to `"stop"`): `"stop"` (raise `RollbackError`) or
            `"continue"` (train through, as `capture` does); see `RollbacksExhausted`.
        rollback_skip_batches (`int`, *optional*, defaults to `0`): batches to skip after a rollback beyond those
            the anomaly consumed (custom loops; Trainer's loop fetches its batches itself and refuses a value > 0).
        keep_log_spaced (`bool`, *optional*, defaults to `True`): retention thins checkpoints older than the
            `keep_last` newest to log-spaced steps (`False`: removes them).
        learned_model (`str`, *optional*): the learned double-check next to the rules (which stay the
            default and the safety net): `"builtin"` (the packaged model), the path of a `.safetensors`
            model written by `scripts/train_decision_model.py`, or `None` (rules only). See
            `docs/decision_model.md`.
    """

    min_interval: int = 1
    max_interval: int = 2000
    mtbf_hours: float = 24.0
    overhead_budget: float = 0.02
    stability_window: int = 100
    stability_cv: float = 0.1
    risk_threshold: float = 0.68
    risk_release: float = 0.2
    risk_smoothing: int = 10
    risk_gain: float = 4.0
    loss_spike_z: float = 6.0
    grad_surge_ratio: float = 5.0
    lr_surge_ratio: float = 2.0
    memory_threshold: float = 0.92
    memory_sample_every: int = 5
    memory_lookahead: int = 50
    pre_anomaly_capture: bool = True
    skip_bad_update: bool = False
    capture_cooldown: int | None = None
    rollback_patience: int = 1
    rollback_window: int = 100
    max_rollbacks: int = 5
    on_rollbacks_exhausted: RollbacksExhausted = RollbacksExhausted.STOP
    rollback_skip_batches: int = 0
    keep_log_spaced: bool = True
    learned_model: str | None = None

    def __post_init__(self) -> None:
        for flag in ("pre_anomaly_capture", "skip_bad_update", "keep_log_spaced"):
            value = getattr(self, flag)
            check(isinstance(value, bool), flag, value, "true or false (a YAML boolean, not a string)")
        check(is_int(self.min_interval) and self.min_interval >= 1,
              "min_interval", self.min_interval, "an integer >= 1")
        check(is_int(self.max_interval) and self.max_interval >= self.min_interval, "max_interval",
              self.max_interval, f"an integer >= min_interval ({self.min_interval})")
        check(is_finite(self.mtbf_hours) and self.mtbf_hours > 0,
              "mtbf_hours", self.mtbf_hours, "a positive number of hours")
        check(is_number(self.overhead_budget) and 0.0 < self.overhead_budget <= 1.0,
              "overhead_budget", self.overhead_budget, "0 < value <= 1")
        check(is_int(self.stability_window) and self.stability_window >= 4, "stability_window",
              self.stability_window, "an integer >= 4")
        check(is_number(self.stability_cv) and self.stability_cv > 0, "stability_cv", self.stability_cv,
              "a positive number (relative loss noise counted as calm, e.g. 0.1)")
        check(is_number(self.risk_threshold) and 0.0 < self.risk_threshold <= 1.0,
              "risk_threshold", self.risk_threshold, "0 < value <= 1")
        check(is_number(self.risk_release) and 0.0 <= self.risk_release < self.risk_threshold,
              "risk_release", self.risk_release, f"0 <= value < risk_threshold ({self.risk_threshold})")
        check(is_int(self.risk_smoothing) and self.risk_smoothing >= 1, "risk_smoothing",
              self.risk_smoothing, "an integer >= 1")
        check(is_number(self.risk_gain) and 0 < self.risk_gain <= 100, "risk_gain", self.risk_gain, "0 < value <= 100")
        check(is_number(self.loss_spike_z) and self.loss_spike_z > 0,
              "loss_spike_z", self.loss_spike_z, "a positive number")
        check(is_number(self.grad_surge_ratio) and self.grad_surge_ratio > 1,
              "grad_surge_ratio", self.grad_surge_ratio, "a number > 1")
        check(is_number(self.lr_surge_ratio) and self.lr_surge_ratio > 1, "lr_surge_ratio", self.lr_surge_ratio,
              "a number > 1")
        check(is_number(self.memory_threshold) and 0.0 < self.memory_threshold <= 1.0,
              "memory_threshold", self.memory_threshold, "0 < value <= 1")
        check(is_int(self.memory_sample_every) and self.memory_sample_every >= 1, "memory_sample_every",
              self.memory_sample_every, "an integer >= 1")
        check(is_int(self.memory_lookahead) and self.memory_lookahead >= 1, "memory_lookahead",
              self.memory_lookahead, "an integer >= 1")
        if self.capture_cooldown is not None:
            check(is_int(self.capture_cooldown) and self.capture_cooldown >= 1, "capture_cooldown",
                  self.capture_cooldown, "an integer >= 1 or null (use stability_window)")
        for name in ("rollback_patience", "rollback_window", "max_rollbacks"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, getattr(self, name),
                  "an integer >= 1")
        object.__setattr__(self, "on_rollbacks_exhausted", parse_enum(RollbacksExhausted, "on_rollbacks_exhausted",
                                                                      self.on_rollbacks_exhausted))
        check(is_int(self.rollback_skip_batches) and self.rollback_skip_batches >= 0, "rollback_skip_batches",
              self.rollback_skip_batches, "an integer >= 0")
        if self.learned_model is not None:  # a model file is safetensors, never a pickle
            model = self.learned_model
            check(isinstance(model, str | os.PathLike) and (os.fspath(model) == "builtin" or (
                os.fspath(model).endswith(".safetensors") and os.path.isfile(model))), "learned_model", model,
                "'builtin', the path of an existing .safetensors decision model, or null (rules only)")
            object.__setattr__(self, "learned_model", os.fspath(model))


@named_keywords
@dataclass(frozen=True, kw_only=True)
class LevelConfig:
    """Retention of the weights tier (``storage_levels.level_0``) or the state tier (``level_2``).

    Args:
        retention_days (`float`, *optional*): files of this tier older than this are pruned
            (pinned checkpoints excepted). `None` keeps them.
    """

    retention_days: float | None = None

    def __post_init__(self) -> None:
        if self.retention_days is not None:
            check(is_number(self.retention_days) and self.retention_days > 0,
                  "retention_days", self.retention_days, "a positive number or null")


@named_keywords
@dataclass(frozen=True, kw_only=True)
class OptimizerLevelConfig(LevelConfig):
    """Storage of the optimizer tier (``storage_levels.level_1``): the one tier that is compressed.

    Args:
        compression (`str`, *optional*, defaults to `"zstd"`): `"zstd"` or `"none"`.
        compression_level (`int`, *optional*, defaults to `1`): zstd level, 1 to 19 (1 advised).
        pace_to_disk (`bool`, *optional*, defaults to `True`): zstd, local root: while the disk waits for the
            compressor, store slowly compressing parts raw (written at the disk's speed, a larger file on a
            disk faster than the CPUs); `false`: compress all that compresses (smallest).
        retention_days (`float`, *optional*, defaults to `7`): files of this tier older than this are pruned
            (pinned checkpoints excepted). `None` keeps them.
    """

    compression: Compression = Compression.ZSTD
    compression_level: int = 1
    pace_to_disk: bool = True
    retention_days: float | None = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "compression", parse_enum(Compression, "compression", self.compression))
        Codec.parse(self.compression.value, field="compression")  # the store's one vocabulary for the L1 codec
        check(is_int(self.compression_level) and 1 <= self.compression_level <= 19,
              "compression_level", self.compression_level, "1 <= level <= 19")
        check(isinstance(self.pace_to_disk, bool),
              "pace_to_disk", self.pace_to_disk, "true or false (a YAML boolean, not a string)")


def _seed_level(name: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """The article's keys that load without effect, taken out of a tier's mapping with the check or message each
    needs: ``device`` of any tier (a label: every tier goes under `root`), ``compression`` of level_0 (must be
    ``none``: the weights stay memory-mappable) and of level_2 (a few KB of plain JSON)."""
    data = dict(value)
    device = data.pop("device", None)  # the article's storage-class label
    if device is not None and warn_once("device"):
        logger.info("storage_levels.%s.device=%r is not applied: every tier is stored under root (the article's "
                    "storage-class label loads, and has no effect)", name, device)
    if name == "level_1" or "compression" not in data:
        return data
    compression = parse_enum(Compression, f"storage_levels.{name}.compression", data.pop("compression"))
    if name == "level_0":
        check(compression == Compression.NONE, "storage_levels.level_0.compression", compression.value,
              "'none' (weights stay uncompressed so they can be memory-mapped)")
    elif compression != Compression.NONE and warn_once("level_2.compression"):
        # Accepted so the article's checkpoint_config.yaml loads as written, but not applied.
        logger.warning(
            "storage_levels.level_2.compression=%r is not applied: L2 (RNG, data position, metadata) "
            "is a few KB of plain JSON kept readable by jq; set it to 'none' to silence this.", compression.value)
    return data


@named_keywords
@dataclass(frozen=True, kw_only=True)
class StorageLevels:
    """Per-tier storage (``storage_levels`` in YAML): retention of each tier and the optimizer tier's codec.

    The article's keys load as written: ``device`` of any tier and the ``compression`` of level_0 (must be
    ``none``) and level_2 (not applied, one warning) are accepted and have no effect.
    """

    level_0: LevelConfig = field(default_factory=lambda: LevelConfig(retention_days=30))
    level_1: OptimizerLevelConfig = field(default_factory=OptimizerLevelConfig)
    level_2: LevelConfig = field(default_factory=lambda: LevelConfig(retention_days=90))

    def __post_init__(self) -> None:
        for name in ("level_0", "level_1", "level_2"):
            cls = OptimizerLevelConfig if name == "level_1" else LevelConfig
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, build(cls, _seed_level(name, value), f"storage_levels.{name}"))
            elif not isinstance(value, cls):
                raise ConfigError(f"storage_levels.{name}={value!r} is invalid: expected a mapping such as "
                                  "{retention_days: 7} (leave the key out for the defaults).")


@named_keywords
@dataclass(frozen=True, kw_only=True)
class RemoteParams:
    """A URL root's object-store settings (`SmartCkptConfig.remote`, ``remote:`` in YAML; docs/storage.md).

    Args:
        cache_dir (`str`, *optional*): local cache of a URL root; each rank uses ``<cache_dir>/rank-<R>``
            (default ``~/.cache/hf_dynamic_ckpt/remote/<hash>/rank-<R>``).
        storage_options (`dict`, *optional*): fsspec options such as ``endpoint_url``; never credentials
            (refused: they come from the environment).
        retries (`int`, *optional*, defaults to `5`): retries of a failed object-store call.
        backoff_s (`float`, *optional*, defaults to `0.5`): first retry backoff (doubles, capped at 10 s).
    """

    cache_dir: str | None = None
    storage_options: Mapping[str, Any] | None = None
    retries: int = 5
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        from .store import check_public_options

        if self.cache_dir is not None:
            check(isinstance(self.cache_dir, str | os.PathLike), "cache_dir", self.cache_dir,
                  "a directory path or null")
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        check(is_int(self.retries) and self.retries >= 0, "retries", self.retries, "an integer >= 0")
        check(is_finite(self.backoff_s) and self.backoff_s >= 0, "backoff_s", self.backoff_s,
              "a number of seconds >= 0")
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options",
                               check_public_options(self.storage_options, "remote.storage_options"))


@named_keywords
@dataclass(frozen=True, kw_only=True)
class RuntimeParams:
    """How the checkpointer behaves in the training process (`SmartCkptConfig.runtime`, ``runtime:`` in YAML):
    preemption, the resume's fallback, host memory, the writer lock, Trainer's logs.

    Args:
        fallback_strategy (`str`, *optional*, defaults to `"full"`): what a resume does when a tier of the chosen
            checkpoint cannot be loaded; see `FallbackStrategy`.
        recovery_timeout_ms (`int`, *optional*, defaults to `5000`): a resume slower than this is logged.
        preemption_signals (`tuple[str]`, *optional*): signals that request a final save.
        preemption_grace_s (`float`, *optional*, defaults to `30.0`): deadline of that save.
        preemption_exit_code (`int`, *optional*): exit status of the process once the preemption
            save is committed and training stopped; `None` (default) is the conventional
            `128 + signal number` (143 for SIGTERM, 138 for SIGUSR1), so SLURM / Kubernetes /
            torchrun read the job as interrupted and requeue or restart it; `0` returns normally.
        memory_margin (`float`, *optional*, defaults to `0.15`): host memory fraction kept free;
            a snapshot that would cut into it is streamed synchronously instead.
        overlap_snapshot (`bool`, *optional*): copy the parameters and the optimizer state beside the next step's
            forward and backward instead of at the save; the next `optimizer.step()` waits for the copy
            (docs/engine.md, "Overlapped snapshot"). `None` (default): for CUDA parameters holding at least
            32 MiB (a full fine-tune on GPUs; a LoRA adapter is copied at the save; host parameters are not, since
            their copy competes with training for the same cores, docs/engine.md); `true` / `false`: always /
            never. A callback that changes parameters in place between a save and the next optimizer step calls
            `RunOrchestrator.wait_snapshot()` first.
        lock_wait_s (`float`, *optional*, defaults to `120.0`): how long a new run waits for the task's writer
            lock when its holder is on another host or container (its state cannot be told from here): long
            enough for a scheduler or elastic restart and an NFS lease to expire. A holder of this process is
            closed and replaced, a dead one of this host taken over, a live one of this host refused at once
            (docs/reliability.md).
        report_to_trainer (`bool`, *optional*, defaults to `True`): add `smart_ckpt/*` to Trainer logs.
        keep_global_batch (`bool`, *optional*, defaults to `True`): a resume whose per-device batch x processes x
            gradient accumulation differs from the checkpoint's sets the accumulation that gives the checkpoint's
            global batch (or refuses with `GlobalBatchError` where none does); `false` trains with the settings as
            given and warns what changes (docs/elastic.md).
    """

    fallback_strategy: FallbackStrategy = FallbackStrategy.FULL
    recovery_timeout_ms: int = 5000
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    preemption_grace_s: float = 30.0
    preemption_exit_code: int | None = None
    memory_margin: float = 0.15
    overlap_snapshot: bool | None = None
    lock_wait_s: float = 120.0
    report_to_trainer: bool = True
    keep_global_batch: bool = True

    def __post_init__(self) -> None:
        import signal as _signal

        object.__setattr__(self, "fallback_strategy",
                           parse_enum(FallbackStrategy, "fallback_strategy", self.fallback_strategy))
        check(is_number(self.recovery_timeout_ms) and self.recovery_timeout_ms > 0,
              "recovery_timeout_ms", self.recovery_timeout_ms, "a positive number")
        if isinstance(self.preemption_signals, str):
            object.__setattr__(self, "preemption_signals", (self.preemption_signals,))  # one name: a list of one
        elif not isinstance(self.preemption_signals, list | tuple):
            raise ConfigError(f"preemption_signals={self.preemption_signals!r} is invalid: expected a list of signal "
                              "names such as ['SIGTERM', 'SIGUSR1'] (an empty list disables the handlers).")
        object.__setattr__(self, "preemption_signals", tuple(self.preemption_signals))
        for name in self.preemption_signals:
            check(isinstance(getattr(_signal, str(name), None), _signal.Signals), "preemption_signals", name,
                  "names of signals of this platform such as 'SIGTERM'")
        check(is_number(self.preemption_grace_s) and self.preemption_grace_s > 0,
              "preemption_grace_s", self.preemption_grace_s, "a positive number of seconds")
        if self.preemption_exit_code is not None:
            check(is_int(self.preemption_exit_code) and 0 <= self.preemption_exit_code <= 255, "preemption_exit_code",
                  self.preemption_exit_code, "an integer 0..255 or null (128 + signal number)")
        check(is_number(self.memory_margin) and 0.0 <= self.memory_margin < 1.0,
              "memory_margin", self.memory_margin, "0 <= value < 1")
        check(self.overlap_snapshot is None or isinstance(self.overlap_snapshot, bool), "overlap_snapshot",
              self.overlap_snapshot, "true, false or null (a YAML boolean, not a string)")
        check(is_finite(self.lock_wait_s) and self.lock_wait_s >= 0, "lock_wait_s", self.lock_wait_s,
              "a number of seconds >= 0")
        check(isinstance(self.report_to_trainer, bool), "report_to_trainer", self.report_to_trainer,
              "true or false (a YAML boolean, not a string)")
        check(isinstance(self.keep_global_batch, bool), "keep_global_batch", self.keep_global_batch,
              "true or false (a YAML boolean, not a string)")


GROUPS: dict[str, type[Any]] = {"policy": PolicyParams, "storage_levels": StorageLevels, "remote": RemoteParams,
                                "runtime": RuntimeParams}
"""The nested settings objects of `SmartCkptConfig`, by key."""

SEED_KEYS = {"stability_window": "policy", "risk_threshold": "policy", "recovery_timeout_ms": "runtime",
             "fallback_strategy": "runtime"}
"""The article's top-level keys that now live in a group: `SmartCkptConfig.from_dict` / `from_yaml` put them
there, so its ``checkpoint_config.yaml`` loads as written."""

MOVED.update({f.name: f"{group}.{f.name}" for group, cls in GROUPS.items() if group != "storage_levels"
              for f in dataclasses.fields(cls)})
MOVED.update({f"remote_{f.name}": f"remote.{f.name}" for f in dataclasses.fields(RemoteParams)})
KEY_OF.update({cls.__name__: name for name, cls in GROUPS.items()}, SmartCkptConfig="")


@named_keywords
@dataclass(frozen=True, kw_only=True)
class SmartCkptConfig:
    """Everything the checkpointer can be told. `SmartCkptConfig()` works as is.

    Seven settings a run may set, and four groups of constants that are rarely changed:

    Args:
        root (`str`, *optional*): store directory, or an fsspec URL (``s3://bucket/run``, see
            docs/storage.md); defaults to `<output_dir>/smart_ckpt`.
        task_id (`str`, *optional*, defaults to `"default"`): sub-directory of one run's checkpoints.
        base_interval (`int`, *optional*): save every this many steps while training is calm.
            `None` derives it from the measured save cost (Young/Daly `sqrt(2 * C * MTBF)`).
        keep_last (`int`, *optional*, defaults to `3`): newest checkpoints always kept; `None` keeps every
            checkpoint (Trainer's `save_total_limit=None`; tiers still expire by `retention_days`, set those to
            `None` too to keep everything).
        engine (`str`, *optional*, defaults to `"process"`): background writer: `"process"`
            (lowest measured step-time inflation, see docs/engine.md), `"thread"` or `"sync"`.
        on_anomaly (`str`, *optional*, defaults to `"capture"`): `"capture"` or `"rollback"` (see `OnAnomaly`).
        on_save_error (`str`, *optional*, defaults to `"warn"`): `"warn"` (count, warn, continue) or
            `"raise"` (stop the run at the next step); see `OnSaveError`.
        policy (`PolicyParams`, *optional*): the decision's constants (intervals, risk, anomaly thresholds,
            rollback limits, log-spaced retention, the learned double-check).
        storage_levels (`StorageLevels`, *optional*): per-tier retention and the optimizer tier's compression.
        remote (`RemoteParams`, *optional*): a URL root's cache, fsspec options and retries.
        runtime (`RuntimeParams`, *optional*): preemption signals and exit code, the resume's fallback, host
            memory kept free, the writer lock's wait, Trainer logging.

    A group may be given as a mapping, as in YAML: ``SmartCkptConfig(policy={"stability_window": 50})``.

    Example:
        ```python
        >>> from hf_dynamic_ckpt import SmartCkptConfig
        >>> SmartCkptConfig(base_interval=4, policy={"min_interval": 2}).policy.min_interval
        2
        ```
    """

    root: str | None = None
    task_id: str = DEFAULT_TASK_ID
    base_interval: int | None = None
    keep_last: int | None = 3
    engine: EngineMode = EngineMode.PROCESS
    on_anomaly: OnAnomaly = OnAnomaly.CAPTURE
    on_save_error: OnSaveError = OnSaveError.WARN
    policy: PolicyParams = field(default_factory=PolicyParams)
    storage_levels: StorageLevels = field(default_factory=StorageLevels)
    remote: RemoteParams = field(default_factory=RemoteParams)
    runtime: RuntimeParams = field(default_factory=RuntimeParams)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name, cls in GROUPS.items():
            set_(self, name, _group(cls, name, getattr(self, name)))
        if self.root is not None:
            check(isinstance(self.root, str | os.PathLike), "root", self.root, "a directory path (str) or null")
            set_(self, "root", os.fspath(self.root))
            from .store import check_url, is_url  # URL root (docs/storage.md)

            if "://" in self.root:
                check(is_url(self.root), "root", self.root, "a directory path or a URL such as s3://bucket/run")
                check_url(self.root)
            else:
                check_directory_path("root", self.root)
        check(isinstance(self.task_id, str), "task_id", self.task_id, "a name (string)")
        check(bool(self.task_id) and "/" not in self.task_id and not self.task_id.startswith("."),
              "task_id", self.task_id, "a non-empty name without '/' that does not start with '.'")
        if self.base_interval is not None:
            check(is_int(self.base_interval) and self.base_interval >= 1, "base_interval",
                  self.base_interval, "an integer >= 1 or null (derive it from the save cost)")
        if self.keep_last is not None:
            check(is_int(self.keep_last) and self.keep_last >= 1, "keep_last", self.keep_last,
                  "an integer >= 1, or null to keep every checkpoint")
        set_(self, "engine", parse_enum(EngineMode, "engine", self.engine))
        set_(self, "on_anomaly", parse_enum(OnAnomaly, "on_anomaly", self.on_anomaly))
        set_(self, "on_save_error", parse_enum(OnSaveError, "on_save_error", self.on_save_error))
        if self.on_anomaly == OnAnomaly.ROLLBACK and not self.policy.pre_anomaly_capture:
            raise ConfigError("on_anomaly='rollback' needs policy.pre_anomaly_capture=true: a rollback returns to the "
                              "healthy state captured before the anomaly.")

    def resolve_root(self, output_dir: str | os.PathLike[str] | None) -> str:
        """The store directory: `root` when set, else `<output_dir>/smart_ckpt`.

        Raises:
            `ConfigError`: neither is given, or the local path is (or lies under) an existing file.
        """
        from .store import is_url

        if self.root is not None:
            name, given = "root", os.fspath(self.root)
        elif output_dir is None:
            raise ConfigError("root=None is invalid without an output_dir: set SmartCkptConfig(root=...).")
        else:
            name, given = "output_dir", os.fspath(output_dir)
        if not is_url(given):
            check_directory_path(name, given)
        return given if name == "root" else os.path.join(given, "smart_ckpt")

    def replace(self, **changes: Any) -> SmartCkptConfig:
        """A copy with `changes`; a group's mapping changes only the keys it names
        (``config.replace(policy={"min_interval": 5})`` keeps the other policy settings)."""
        for name in GROUPS:
            if isinstance(changes.get(name), Mapping):
                changes[name] = _merge(getattr(self, name), changes[name], name)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SmartCkptConfig:
        """Build from a mapping in the shape of `to_dict()`; the article's ``checkpoint_config.yaml`` keys
        (``stability_window``, ``risk_threshold``, ``recovery_timeout_ms``, ``fallback_strategy`` at the top
        level) load into their groups."""
        data = dict(data)
        for key, group in SEED_KEYS.items():
            if key in data:
                nested = data.get(group) or {}
                if not isinstance(nested, Mapping):
                    break  # the group's own error names it
                if key in nested:
                    raise ConfigError(f"{key} is given twice, at the top level and as {group}.{key}; keep one.")
                data[group] = {**nested, key: data.pop(key)}
        return build(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SmartCkptConfig:
        """Read a `checkpoint_config.yaml`. Unknown and duplicate keys are errors naming the key (and lines).

        Example:
            ```yaml
            base_interval: 2000
            keep_last: 3
            policy:
              stability_window: 100
              risk_threshold: 0.68
            storage_levels:
              level_1: {compression: zstd, compression_level: 1, retention_days: 7}
            runtime:
              fallback_strategy: level_0_only
            ```
        """
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f, name=os.fspath(path)) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{os.fspath(path)}: expected a mapping at the top level, got {type(data).__name__}.")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            if isinstance(v, enum.Enum):
                return v.value
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
            if isinstance(v, tuple):
                return [conv(x) for x in v]
            if isinstance(v, Mapping):
                return {k: conv(x) for k, x in v.items()}
            return v

        return conv(self)  # type: ignore[no-any-return]


def _merge(current: Any, changes: Mapping[str, Any], name: str) -> Any:
    """`current` (a group) with the keys of `changes` replaced, nested groups (`storage_levels.level_1`) merged."""
    names = {f.name for f in dataclasses.fields(current)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise unknown_key(unknown[0], names, prefix=f"{name}.")
    merged = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)}
    for key, value in changes.items():
        inner = merged[key]
        merged[key] = (_merge(inner, value, f"{name}.{key}") if isinstance(value, Mapping)
                       and dataclasses.is_dataclass(inner) else value)
    return build(type(current), merged, name)


def load_yaml(stream: Any, *, name: str = "<yaml>") -> Any:
    """`yaml.safe_load` that refuses a key given twice in one mapping (PyYAML keeps the last one silently).

    Raises:
        `ConfigError`: names the key and both lines, e.g. ``base_interval`` on lines 1 and 3.
    """
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"{name}: key {key!r} is given twice, on line {seen[key]} and line {line}; keep "
                                  "one (YAML would silently use the last).")
            if isinstance(key, str):
                seen[key] = line
        return loader.construct_mapping(node, deep=deep)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(stream, Loader=_Loader)  # a SafeLoader subclass: plain data only
    except yaml.YAMLError as e:
        raise ConfigError(f"{name} is not valid YAML: {e}") from e


@dataclass(kw_only=True)
class SmartCkptArguments:
    """Command-line arguments for scripts built on `transformers.HfArgumentParser`.

    Args:
        resume_from_smart_checkpoint (`str`, *optional*): `auto`, `best`, `fastest`, `step:N`
            or a checkpoint path. `auto` starts fresh when the store is empty.
        smart_ckpt_config (`str`, *optional*): path of a `checkpoint_config.yaml`.
        smart_ckpt_root (`str`, *optional*): store directory (overrides the YAML's `root`).
        smart_ckpt_on_anomaly (`str`, *optional*): `capture` or `rollback` (overrides the YAML's `on_anomaly`).
    """

    resume_from_smart_checkpoint: str | None = field(
        default=None,
        metadata={"help": "Resume point: auto | best | fastest | step:N | PATH (auto starts fresh on an empty store)."},
    )
    smart_ckpt_config: str | None = field(default=None, metadata={"help": "Path of a checkpoint_config.yaml."})
    smart_ckpt_root: str | None = field(default=None,
                                        metadata={"help": "Store directory (default <output_dir>/smart_ckpt)."})
    smart_ckpt_on_anomaly: str | None = field(
        default=None, metadata={"help": "What a confirmed anomaly does: capture (save and pin the state before it) or "
                                        "rollback (also return to it in place and skip the bad data)."})

    def to_config(self) -> SmartCkptConfig:
        config = SmartCkptConfig.from_yaml(self.smart_ckpt_config) if self.smart_ckpt_config else SmartCkptConfig()
        if self.smart_ckpt_root is not None:
            config = config.replace(root=self.smart_ckpt_root)
        if self.smart_ckpt_on_anomaly is not None:
            config = config.replace(on_anomaly=self.smart_ckpt_on_anomaly)
        return config

"""Configuration: frozen dataclasses, validated on construction, loadable from YAML.

The YAML shape is the article's ``checkpoint_config.yaml``; every top-level knob of
:class:`SmartCkptConfig` may also appear at the top level of the file.
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
    build,
    check,
    check_directory_path,
    is_finite,
    is_int,
    is_number,
    named_keywords,
    parse_enum,
    warn_once,
)
from .constants import DEFAULT_TASK_ID
from .errors import ConfigError
from .store.spec import Codec

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


@named_keywords
@dataclass(frozen=True, kw_only=True)
class LevelConfig:
    """Storage settings of one tier (``storage_levels.level_N`` in YAML).

    Args:
        compression (`str`, *optional*, defaults to `"none"`): `"none"`, `"zstd"` or `"gzip"`.
        compression_level (`int`, *optional*, defaults to `3`; `1` for `level_1`): zstd level, 1 to 19 (1 advised).
        device (`str`, *optional*): storage class label from the article (`ssd`, `nvme`); informative.
        pace_to_disk (`bool`, *optional*, defaults to `True`): `level_1`, zstd, local root: while the disk
            waits for the compressor, store slowly compressing parts raw (written at the disk's speed, a
            larger file on a disk faster than the CPUs); `false`: compress all that compresses (smallest).
        retention_days (`float`, *optional*): files of this tier older than this are pruned
            (pinned checkpoints excepted). `None` keeps them.
    """

    compression: Compression = Compression.NONE
    compression_level: int = 3
    device: str | None = None
    pace_to_disk: bool = True
    retention_days: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", parse_enum(Compression, "compression", self.compression))
        check(is_int(self.compression_level) and 1 <= self.compression_level <= 19,
              "compression_level", self.compression_level, "1 <= level <= 19")
        check(isinstance(self.pace_to_disk, bool),
              "pace_to_disk", self.pace_to_disk, "true or false (a YAML boolean, not a string)")
        if self.retention_days is not None:
            check(is_number(self.retention_days) and self.retention_days > 0,
                  "retention_days", self.retention_days, "a positive number or null")


@named_keywords
@dataclass(frozen=True, kw_only=True)
class StorageLevels:
    level_0: LevelConfig = field(default_factory=lambda: LevelConfig(device="ssd", retention_days=30))
    level_1: LevelConfig = field(
        default_factory=lambda: LevelConfig(compression=Compression.ZSTD, compression_level=1, device="nvme",
                                            retention_days=7)
    )
    level_2: LevelConfig = field(default_factory=lambda: LevelConfig(device="ssd", retention_days=90))

    def __post_init__(self) -> None:
        for name in ("level_0", "level_1", "level_2"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, build(LevelConfig, value, f"storage_levels.{name}"))
            elif not isinstance(value, LevelConfig):
                raise ConfigError(f"storage_levels.{name}={value!r} is invalid: expected a mapping such as "
                                  "{compression: zstd, compression_level: 3, retention_days: 7} (leave the key out "
                                  "for the defaults).")
        check(self.level_0.compression == Compression.NONE, "storage_levels.level_0.compression",
              self.level_0.compression.value, "'none' (weights stay uncompressed so they can be memory-mapped)")
        Codec.parse(self.level_1.compression.value)  # the store's one vocabulary for the L1 codec
        if self.level_2.compression != Compression.NONE and warn_once("level_2.compression"):
            # Accepted so the article's checkpoint_config.yaml loads as written, but not applied.
            logger.warning(
                "storage_levels.level_2.compression=%r is not applied: L2 (RNG, data position, metadata) "
                "is a few KB of plain JSON kept readable by jq; set it to 'none' to silence this.",
                self.level_2.compression.value,
            )


@named_keywords
@dataclass(frozen=True, kw_only=True)
class SmartCkptConfig:
    """Everything the checkpointer can be told. `SmartCkptConfig()` works as is.

    Args:
        root (`str`, *optional*): store directory, or an fsspec URL (``s3://bucket/run``, see
            docs/storage.md); defaults to `<output_dir>/smart_ckpt`.
        task_id (`str`, *optional*, defaults to `"default"`): sub-directory of one run's checkpoints.
        base_interval (`int`, *optional*): save every this many steps while training is calm.
            `None` derives it from the measured save cost (Young/Daly `sqrt(2 * C * MTBF)`).
        min_interval (`int`, *optional*, defaults to `1`): never two regular saves closer than this.
        max_interval (`int`, *optional*, defaults to `2000`): never a calm gap longer than this.
        mtbf_hours (`float`, *optional*, defaults to `24.0`): expected time between failures.
        stability_window (`int`, *optional*, defaults to `100`): steps of loss history for stability.
        risk_threshold (`float`, *optional*, defaults to `0.68`): smoothed risk above which an
            immediate save fires (on the rising edge only).
        risk_release (`float`, *optional*, defaults to `0.2`): smoothed risk below which the
            trigger re-arms (hysteresis).
        risk_smoothing (`int`, *optional*, defaults to `10`): steps of the risk moving average.
        loss_spike_z (`float`, *optional*, defaults to `6.0`): robust z-score of a loss spike.
        grad_surge_ratio (`float`, *optional*, defaults to `5.0`): grad-norm ratio to its running
            level that counts as a surge (global and per LoRA layer).
        memory_threshold (`float`, *optional*, defaults to `0.92`): memory fraction counted as risk.
        memory_sample_every (`int`, *optional*, defaults to `5`): steps between memory samples.
        overhead_budget (`float`, *optional*, defaults to `0.02`): blocking save time allowed as a
            fraction of training time.
        risk_gain (`float`, *optional*, defaults to `4.0`): `k` in `T = T_base * alpha / (1 + k * beta)`;
            at full risk the interval is `1 + k` times shorter.
        stability_cv (`float`, *optional*, defaults to `0.1`): loss noise relative to the loss level
            (scale-free) up to which training counts as calm (`alpha = 1`); above it the interval
            shrinks as `stability_cv / cv`, down to 0.2.
        capture_cooldown (`int`, *optional*): steps after a pre-update capture during which another
            finite surge or spike is not captured again (non-finite values always are, once per run
            of them). `None` uses `stability_window`.
        lr_surge_ratio (`float`, *optional*, defaults to `2.0`): a learning rate above this multiple of
            the highest rate of the last `stability_window` steps is a surge (captured before the update it
            would drive). Linear warmup never more than doubles the rate from one step to the next.
        memory_lookahead (`int`, *optional*, defaults to `50`): a minimal save fires when the memory
            trend predicts crossing `memory_threshold` within this many steps.
        pre_anomaly_capture (`bool`, *optional*, defaults to `True`): save and pin the state from
            before an update whose gradients surge or are not finite.
        skip_bad_update (`bool`, *optional*, defaults to `False`): also skip that update.
        keep_last (`int`, *optional*, defaults to `3`): newest checkpoints always kept; `None` keeps every
            checkpoint (Trainer's `save_total_limit=None`; tiers still expire by `retention_days`, set those to
            `None` too to keep everything).
        keep_log_spaced (`bool`, *optional*, defaults to `True`): thin older ones to log-spaced steps.
        engine (`str`, *optional*, defaults to `"process"`): background writer: `"process"`
            (lowest measured step-time inflation, see docs/engine.md), `"thread"` or `"sync"`.
        memory_margin (`float`, *optional*, defaults to `0.15`): host memory fraction kept free;
            a snapshot that would cut into it is streamed synchronously instead.
        preemption_signals (`tuple[str]`, *optional*): signals that request a final save.
        preemption_grace_s (`float`, *optional*, defaults to `30.0`): deadline of that save.
        preemption_exit_code (`int`, *optional*): exit status of the process once the preemption
            save is committed and training stopped; `None` (default) is the conventional
            `128 + signal number` (143 for SIGTERM, 138 for SIGUSR1), so SLURM / Kubernetes /
            torchrun read the job as interrupted and requeue or restart it; `0` returns normally.
        storage_levels (`StorageLevels`, *optional*): per-tier compression and retention.
        recovery_timeout_ms (`int`, *optional*, defaults to `5000`): a resume slower than this is logged.
        fallback_strategy (`str`, *optional*, defaults to `"full"`): see `FallbackStrategy`.
        learned_model (`str`, *optional*): the learned double-check next to the rules (which stay the
            default and the safety net): `"builtin"` (the packaged model), the path of a `.safetensors`
            model written by `scripts/train_decision_model.py`, or `None` (rules only). See
            `docs/decision_model.md`.
        report_to_trainer (`bool`, *optional*, defaults to `True`): add `smart_ckpt/*` to Trainer logs.
        on_save_error (`str`, *optional*, defaults to `"warn"`): `"warn"` (count, warn, continue) or
            `"raise"` (stop the run at the next step); see `OnSaveError`.
        remote_cache_dir (`str`, *optional*): local cache of a URL root; each rank uses
            ``<remote_cache_dir>/rank-<R>`` (default ``~/.cache/hf_dynamic_ckpt/remote/<hash>/rank-<R>``).
        remote_storage_options (`dict`, *optional*): fsspec options of a URL root such as
            ``endpoint_url``; never credentials (refused: they come from the environment).
        remote_retries (`int`, *optional*, defaults to `5`): retries of a failed object-store call.
        remote_backoff_s (`float`, *optional*, defaults to `0.5`): first retry backoff (doubles, capped at 10 s).
        on_anomaly (`str`, *optional*, defaults to `"capture"`): `"capture"` or `"rollback"` (see `OnAnomaly`).
        rollback_patience (`int`, *optional*, defaults to `1`): bad steps in a row that confirm an anomaly.
        rollback_window (`int`, *optional*, defaults to `100`): the oldest restore point a rollback may return to,
            in steps before the confirming one; also the span over which `max_rollbacks` counts.
        max_rollbacks (`int`, *optional*, defaults to `5`): rollbacks allowed within `rollback_window` steps (a
            shard of `k` bad batches costs about `k / rollback_patience` of them: each skips what it consumed).
        on_rollbacks_exhausted (`str`, *optional*, defaults to `"stop"`): `"stop"` (raise `RollbackError`) or
            `"continue"` (train through, as `capture` does); see `RollbacksExhausted`.
        rollback_skip_batches (`int`, *optional*, defaults to `0`): batches to skip after a rollback beyond those
            the anomaly consumed (custom loops; Trainer's loop fetches its batches itself and refuses a value > 0).
        lock_wait_s (`float`, *optional*, defaults to `120.0`): how long a new run waits for the task's writer
            lock when its holder is on another host or container (its state cannot be told from here): long
            enough for a scheduler or elastic restart and an NFS lease to expire. A holder of this process is
            closed and replaced, a dead one of this host taken over, a live one of this host refused at once
            (docs/reliability.md).

    Example:
        ```python
        >>> from hf_dynamic_ckpt import SmartCkptConfig
        >>> SmartCkptConfig(base_interval=4).base_interval
        4
        ```
    """

    root: str | None = None
    task_id: str = DEFAULT_TASK_ID
    base_interval: int | None = None
    min_interval: int = 1
    max_interval: int = 2000
    mtbf_hours: float = 24.0
    stability_window: int = 100
    risk_threshold: float = 0.68
    risk_release: float = 0.2
    risk_smoothing: int = 10
    loss_spike_z: float = 6.0
    grad_surge_ratio: float = 5.0
    memory_threshold: float = 0.92
    memory_sample_every: int = 5
    overhead_budget: float = 0.02
    risk_gain: float = 4.0
    stability_cv: float = 0.1
    capture_cooldown: int | None = None
    lr_surge_ratio: float = 2.0
    memory_lookahead: int = 50
    pre_anomaly_capture: bool = True
    skip_bad_update: bool = False
    keep_last: int | None = 3
    keep_log_spaced: bool = True
    engine: EngineMode = EngineMode.PROCESS
    memory_margin: float = 0.15
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    preemption_grace_s: float = 30.0
    preemption_exit_code: int | None = None
    storage_levels: StorageLevels = field(default_factory=StorageLevels)
    recovery_timeout_ms: int = 5000
    fallback_strategy: FallbackStrategy = FallbackStrategy.FULL
    learned_model: str | None = None
    report_to_trainer: bool = True
    on_save_error: OnSaveError = OnSaveError.WARN
    remote_cache_dir: str | None = None
    remote_storage_options: Mapping[str, Any] | None = None
    remote_retries: int = 5
    remote_backoff_s: float = 0.5
    on_anomaly: OnAnomaly = OnAnomaly.CAPTURE
    rollback_patience: int = 1
    rollback_window: int = 100
    max_rollbacks: int = 5
    on_rollbacks_exhausted: RollbacksExhausted = RollbacksExhausted.STOP
    rollback_skip_batches: int = 0
    lock_wait_s: float = 120.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.root is not None:
            check(isinstance(self.root, str | os.PathLike), "root", self.root, "a directory path (str) or null")
            set_(self, "root", os.fspath(self.root))
        from .store.remote import check_remote_config, is_url  # URL root, remote_* keys (docs/storage.md)

        set_(self, "remote_storage_options", check_remote_config(self))
        if self.root is not None and not is_url(self.root):
            check_directory_path("root", self.root)
        for flag in ("pre_anomaly_capture", "skip_bad_update", "keep_log_spaced", "report_to_trainer"):
            value = getattr(self, flag)
            check(isinstance(value, bool), flag, value, "true or false (a YAML boolean, not a string)")
        check(isinstance(self.task_id, str), "task_id", self.task_id, "a name (string)")
        if not isinstance(self.storage_levels, StorageLevels | Mapping):
            raise ConfigError(f"storage_levels={self.storage_levels!r} is invalid: expected a mapping with level_0 / "
                              "level_1 / level_2.")
        if isinstance(self.preemption_signals, str):
            set_(self, "preemption_signals", (self.preemption_signals,))  # one name: a list of one
        elif not isinstance(self.preemption_signals, list | tuple):
            raise ConfigError(f"preemption_signals={self.preemption_signals!r} is invalid: expected a list of signal "
                              "names such as ['SIGTERM', 'SIGUSR1'] (an empty list disables the handlers).")
        set_(self, "engine", parse_enum(EngineMode, "engine", self.engine))
        set_(self, "fallback_strategy", parse_enum(FallbackStrategy, "fallback_strategy", self.fallback_strategy))
        set_(self, "on_save_error", parse_enum(OnSaveError, "on_save_error", self.on_save_error))
        if isinstance(self.storage_levels, Mapping):
            set_(self, "storage_levels", build(StorageLevels, self.storage_levels, "storage_levels"))
        set_(self, "preemption_signals", tuple(self.preemption_signals))
        check(bool(self.task_id) and "/" not in self.task_id and not self.task_id.startswith("."),
              "task_id", self.task_id, "a non-empty name without '/' that does not start with '.'")
        if self.base_interval is not None:
            check(is_int(self.base_interval) and self.base_interval >= 1, "base_interval",
                  self.base_interval, "an integer >= 1 or null (derive it from the save cost)")
        check(is_int(self.min_interval) and self.min_interval >= 1,
              "min_interval", self.min_interval, "an integer >= 1")
        check(is_int(self.max_interval) and self.max_interval >= self.min_interval, "max_interval",
              self.max_interval, f"an integer >= min_interval ({self.min_interval})")
        check(is_finite(self.mtbf_hours) and self.mtbf_hours > 0,
              "mtbf_hours", self.mtbf_hours, "a positive number of hours")
        check(is_int(self.stability_window) and self.stability_window >= 4, "stability_window",
              self.stability_window, "an integer >= 4")
        check(is_number(self.risk_threshold) and 0.0 < self.risk_threshold <= 1.0,
              "risk_threshold", self.risk_threshold, "0 < value <= 1")
        check(is_number(self.risk_release) and 0.0 <= self.risk_release < self.risk_threshold,
              "risk_release", self.risk_release, f"0 <= value < risk_threshold ({self.risk_threshold})")
        check(is_int(self.risk_smoothing) and self.risk_smoothing >= 1, "risk_smoothing",
              self.risk_smoothing, "an integer >= 1")
        check(is_number(self.loss_spike_z) and self.loss_spike_z > 0,
              "loss_spike_z", self.loss_spike_z, "a positive number")
        check(is_number(self.grad_surge_ratio) and self.grad_surge_ratio > 1,
              "grad_surge_ratio", self.grad_surge_ratio, "a number > 1")
        check(is_number(self.memory_threshold) and 0.0 < self.memory_threshold <= 1.0,
              "memory_threshold", self.memory_threshold, "0 < value <= 1")
        check(is_int(self.memory_sample_every) and self.memory_sample_every >= 1, "memory_sample_every",
              self.memory_sample_every, "an integer >= 1")
        check(is_number(self.overhead_budget) and 0.0 < self.overhead_budget <= 1.0,
              "overhead_budget", self.overhead_budget, "0 < value <= 1")
        check(is_number(self.risk_gain) and 0 < self.risk_gain <= 100, "risk_gain", self.risk_gain, "0 < value <= 100")
        check(is_number(self.stability_cv) and self.stability_cv > 0, "stability_cv", self.stability_cv,
              "a positive number (relative loss noise counted as calm, e.g. 0.1)")
        if self.capture_cooldown is not None:
            check(is_int(self.capture_cooldown) and self.capture_cooldown >= 1, "capture_cooldown",
                  self.capture_cooldown, "an integer >= 1 or null (use stability_window)")
        check(is_number(self.lr_surge_ratio) and self.lr_surge_ratio > 1, "lr_surge_ratio", self.lr_surge_ratio,
              "a number > 1")
        check(is_int(self.memory_lookahead) and self.memory_lookahead >= 1, "memory_lookahead",
              self.memory_lookahead, "an integer >= 1")
        if self.keep_last is not None:
            check(is_int(self.keep_last) and self.keep_last >= 1, "keep_last", self.keep_last,
                  "an integer >= 1, or null to keep every checkpoint")
        if self.learned_model is not None:  # a model file is safetensors, never a pickle
            model = self.learned_model
            check(isinstance(model, str | os.PathLike) and (os.fspath(model) == "builtin" or (
                os.fspath(model).endswith(".safetensors") and os.path.isfile(model))), "learned_model", model,
                "'builtin', the path of an existing .safetensors decision model, or null (rules only)")
            set_(self, "learned_model", os.fspath(model))
        check(is_number(self.memory_margin) and 0.0 <= self.memory_margin < 1.0,
              "memory_margin", self.memory_margin, "0 <= value < 1")
        check(is_number(self.preemption_grace_s) and self.preemption_grace_s > 0,
              "preemption_grace_s", self.preemption_grace_s, "a positive number of seconds")
        if self.preemption_exit_code is not None:
            check(is_int(self.preemption_exit_code) and 0 <= self.preemption_exit_code <= 255, "preemption_exit_code",
                  self.preemption_exit_code, "an integer 0..255 or null (128 + signal number)")
        check(is_finite(self.lock_wait_s) and self.lock_wait_s >= 0, "lock_wait_s", self.lock_wait_s,
              "a number of seconds >= 0")
        set_(self, "on_anomaly", parse_enum(OnAnomaly, "on_anomaly", self.on_anomaly))
        set_(self, "on_rollbacks_exhausted", parse_enum(RollbacksExhausted, "on_rollbacks_exhausted",
                                                        self.on_rollbacks_exhausted))
        for name in ("rollback_patience", "rollback_window", "max_rollbacks"):
            check(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, getattr(self, name),
                  "an integer >= 1")
        check(is_int(self.rollback_skip_batches) and self.rollback_skip_batches >= 0, "rollback_skip_batches",
              self.rollback_skip_batches, "an integer >= 0")
        if self.on_anomaly == OnAnomaly.ROLLBACK and not self.pre_anomaly_capture:
            raise ConfigError("on_anomaly='rollback' needs pre_anomaly_capture=true: a rollback returns to the "
                              "healthy state captured before the anomaly.")
        check(is_number(self.recovery_timeout_ms) and self.recovery_timeout_ms > 0,
              "recovery_timeout_ms", self.recovery_timeout_ms, "a positive number")
        import signal as _signal

        for name in self.preemption_signals:
            check(isinstance(getattr(_signal, str(name), None), _signal.Signals), "preemption_signals", name,
                  "names of signals of this platform such as 'SIGTERM'")

    @property
    def compression_level(self) -> int:
        """zstd level of the optimizer tier (L1)."""
        return self.storage_levels.level_1.compression_level

    def resolve_root(self, output_dir: str | os.PathLike[str] | None) -> str:
        """The store directory: `root` when set, else `<output_dir>/smart_ckpt`.

        Raises:
            `ConfigError`: neither is given, or the local path is (or lies under) an existing file.
        """
        from .store.remote import is_url

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
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SmartCkptConfig:
        """Build from a mapping in the shape of the article's `checkpoint_config.yaml`."""
        return build(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SmartCkptConfig:
        """Read a `checkpoint_config.yaml`. Unknown and duplicate keys are errors naming the key (and lines).

        Example:
            ```yaml
            base_interval: 2000
            stability_window: 100
            risk_threshold: 0.68
            storage_levels:
              level_1: {compression: zstd, compression_level: 1, device: nvme, retention_days: 7}
            recovery_timeout_ms: 5000
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
            return v

        return conv(self)  # type: ignore[no-any-return]


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

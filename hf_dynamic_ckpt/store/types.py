"""Plain data passed between the engine, the store and the restore path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..constants import Tier
from .spec import Lineage

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BlobRef:
    """A tensor known to be stored already, content-addressed under `<task>/blobs/`.

    The engine passes one instead of a tensor when the tensor did not change since it was
    last stored (frozen weights), so it is neither copied nor written again.
    """

    digest: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class CheckpointState:
    """What one rank hands to `CheckpointStore.save`: CPU tensors and JSON-able data.

    Args:
        step (`int`): optimizer steps completed when this state was taken.
        epoch (`float`, *optional*): fractional epoch, as Trainer reports it.
        weights (`dict[str, torch.Tensor | BlobRef]`, *optional*): L0, model key names
            (PEFT key names for an adapter). Written by rank 0 only.
        dedup_keys (`frozenset[str]`): weight keys to store content-addressed (frozen).
        optimizer / scheduler / scaler (`dict`, *optional*): L1, the objects' `state_dict()`
            forms. Written by rank 0 only.
        rng (`dict`, *optional*): L2, this rank's RNG states (`state.rng.capture_rng_state`); in a
            snapshot, until its writer converts it, a `state.rng.RawRngState` (has `to_json()`).
        sampler (`dict`, *optional*): L2, data position (JSON-able), written by rank 0.
        extra (`dict`): JSON-able data that goes into the manifest's `extra` (e.g. the
            Trainer state needed to resume).
    """

    step: int
    epoch: float = 0.0
    weights: dict[str, torch.Tensor | BlobRef] | None = None
    dedup_keys: frozenset[str] = frozenset()
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | Any | None = None
    sampler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_blobs(self) -> bool:
        """Whether a save of this state writes or names blobs (`dedup_keys`, `BlobRef` weights)."""
        return self.weights is not None and (bool(self.dedup_keys)
                                             or any(isinstance(v, BlobRef) for v in self.weights.values()))

    @property
    def tiers(self) -> frozenset[Tier]:
        tiers = set()
        if self.weights is not None:
            tiers.add(Tier.WEIGHTS)
        if self.optimizer is not None or self.scheduler is not None or self.scaler is not None:
            tiers.add(Tier.OPTIMIZER)
        if self.rng is not None or self.sampler is not None:
            tiers.add(Tier.STATE)
        return frozenset(tiers)


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as the catalog and `CheckpointStore.list()` describe it.

    `blobs` is the manifest's blob table (weight key -> `{"digest", "dtype", "shape", "size"}`)
    of the deduplicated weights, so the engine learns what a commit stored without reading
    the manifest again. `abandoned` marks a checkpoint of a timeline a later run forked away
    from (never chosen by `auto`/`best`/`fastest`); `lineage` says which run wrote it.
    """

    task_id: str
    step: int
    path: str
    reason: str
    tiers: frozenset[Tier]
    bytes: int
    loss: float | None
    gpu_mem_percent: float | None
    save_time: float
    recovery_cost_ms: float | None
    healthy: bool
    pinned: bool
    status: str  # "ok" | "missing" | "corrupt"
    world_size: int = 1
    blobs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    abandoned: bool = False
    lineage: Lineage | None = None


class Removal(NamedTuple):
    """One entry of a retention plan (`policy.retention.plan_retention`, applied by `CheckpointStore.prune`)."""

    info: CheckpointInfo
    tiers: frozenset[Tier]
    """What goes: a set containing `Tier.WEIGHTS` (then `ALL_TIERS`) is the whole checkpoint."""
    rule: str = "a retention plan"
    """The rule that removes it, in words: recorded in the task's removals, named by `ls` and a resume."""


@dataclass
class LoadedCheckpoint:
    """Tensors and state read back (and verified) from one checkpoint."""

    info: CheckpointInfo
    manifest: dict[str, Any]
    weights: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | Any | None = None
    sampler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def tiers(self) -> frozenset[Tier]:
        tiers = set()
        if self.weights is not None:
            tiers.add(Tier.WEIGHTS)
        if self.optimizer is not None or self.scheduler is not None:
            tiers.add(Tier.OPTIMIZER)
        if self.rng is not None or self.sampler is not None:
            tiers.add(Tier.STATE)
        return frozenset(tiers)


@dataclass
class GcReport:
    """What `CheckpointStore.gc` or `CheckpointStore.prune` removed (or, with `dry_run`, would remove).

    Args:
        removed (`list[int]`): steps deleted whole (abandoned ones included).
        trimmed (`dict[int, list[str]]`): step -> tiers deleted from a checkpoint that stays.
        abandoned (`list[int]`): the steps of `removed` that were abandoned checkpoints.
        blobs (`list[str]`): blob files collected (no checkpoint referenced them).
        temp_dirs (`list[str]`): leftovers of interrupted saves or deletes that were removed.
        bytes_freed (`int`): bytes of everything above.
        kept (`list[str]`): why something a plan or the rules named was kept (one line each).
        dry_run (`bool`): nothing was removed.
    """

    removed: list[int] = field(default_factory=list)
    trimmed: dict[int, list[str]] = field(default_factory=dict)
    abandoned: list[int] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    temp_dirs: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: list[str] = field(default_factory=list)
    dry_run: bool = False

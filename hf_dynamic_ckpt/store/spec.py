"""What the store is (`StoreSpec`) and what one save asks of it (`SaveRequest`).

Both are frozen and made of plain values, so they cross thread and process boundaries
unchanged: the engine hands `store.spec` to a writer process, which opens an identical
store with `CheckpointStore.from_spec(spec, cleanup=False)`; a `SaveRequest` travels from
the policy's decision through the engine to `CheckpointStore.save` without being unpacked
and re-packed on the way.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..constants import ALL_TIERS, DEFAULT_TASK_ID, Tier
from ..errors import ConfigError

_SESSION_RE = re.compile(r"[A-Za-z0-9_-]+")


class Codec(enum.StrEnum):
    """Codec of the optimizer tier (L1). The one vocabulary for it: config, store and file format."""

    ZSTD = "zstd"  # independent zstd frames, byte-grouped floats (default)
    NONE = "none"  # raw, 64-byte aligned, memory-mapped on load

    @classmethod
    def parse(cls, value: Any, *, field: str = "storage_levels.level_1.compression") -> Codec:
        """`value` as a `Codec` (`None` means `"none"`).

        Raises:
            `ConfigError`: anything else, naming `field` and the allowed values.
        """
        if value is None:
            return cls.NONE
        try:
            return cls(getattr(value, "value", value))
        except ValueError:
            extra = " (gzip is not offered for L1: zstd level 1-3 is smaller and faster)" if value == "gzip" else ""
            raise ConfigError(f"{field}={value!r} is invalid: expected 'zstd' or 'none'{extra}.") from None


def new_session_id() -> str:
    """A fresh session id (12 hex digits). Under DDP rank 0 makes one and broadcasts it."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Everything that identifies and configures one rank's view of a store.

    Args:
        root (`str`): store directory (absolute once normalised by `CheckpointStore`).
        task_id (`str`, *optional*, defaults to `"default"`): the run's folder under `root`.
        rank (`int`, *optional*, defaults to `0`): this process's rank; rank 0 commits.
        world_size (`int`, *optional*, defaults to `1`): ranks that write each save.
        session_id (`str`): names this run's temporary directories; the same on every rank.
        codec (`Codec`, *optional*, defaults to `"zstd"`): L1 codec.
        compression_level (`int`, *optional*, defaults to `1`): zstd level of L1.
        compression_threads (`int`, *optional*, defaults to `0`): zstd threads (0: all CPUs).
        pace_to_disk (`bool`, *optional*, defaults to `True`): write L1 no faster than the disk and,
            while the disk waits, store slowly compressing parts raw (`write_tensor_file(paced=True)`);
            not applied under an object-store root, whose upload is the slow link.
        rank_timeout_s (`float`, *optional*, defaults to `600.0`): how long rank 0 waits for the
            other ranks' files of one save.
        remote (`RemoteSpec`, *optional*): the object store behind `root` (then a local cache).
    """

    root: str
    task_id: str = DEFAULT_TASK_ID
    rank: int = 0
    world_size: int = 1
    session_id: str = field(default_factory=new_session_id)
    codec: Codec = Codec.ZSTD
    compression_level: int = 1
    compression_threads: int = 0
    pace_to_disk: bool = True
    rank_timeout_s: float = 600.0
    remote: Any = None
    """`store.remote.RemoteSpec` when the root is a URL (`root` is then the local cache directory)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec.parse(self.codec, field="codec"))
        object.__setattr__(self, "root", str(self.root))
        if not isinstance(self.task_id, str) or not self.task_id or "/" in self.task_id or "\\" in self.task_id \
                or self.task_id.startswith(".") or self.task_id == "blobs":
            raise ConfigError(
                f"task_id={self.task_id!r} is invalid: expected a non-empty name without '/' that does not start "
                "with '.'."
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank}, world_size={self.world_size} is invalid: expected 0 <= rank < "
                              "world_size.")
        if not isinstance(self.session_id, str) or not _SESSION_RE.fullmatch(self.session_id):
            raise ConfigError(f"session_id={self.session_id!r} is invalid: use letters, digits, '_' or '-' only.")
        if not self.rank_timeout_s > 0:
            raise ConfigError(f"rank_timeout_s={self.rank_timeout_s!r} is invalid: expected a positive number of "
                              "seconds.")
        if not 1 <= int(self.compression_level) <= 22:
            raise ConfigError(f"compression_level={self.compression_level!r} is invalid: expected 1 <= level <= 22.")


@dataclass(frozen=True, kw_only=True)
class Lineage:
    """Where a checkpoint's run came from (recorded in its manifest).

    Args:
        session (`str`): the session (process group run) that wrote it.
        timeline (`str`): the timeline it belongs to. A run that starts fresh, or resumes
            from a checkpoint older than the newest of its timeline, starts a new timeline;
            checkpoints of other timelines newer than the fork point are *abandoned*.
        parent_step (`int`, *optional*): the checkpoint the run resumed from (`None`: fresh start).
        parent_timeline (`str`, *optional*): that checkpoint's timeline.
    """

    session: str
    timeline: str
    parent_step: int | None = None
    parent_timeline: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"session": self.session, "timeline": self.timeline, "parent_step": self.parent_step,
                "parent_timeline": self.parent_timeline}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        return cls(session=str(data["session"]), timeline=str(data["timeline"]),
                   parent_step=None if data.get("parent_step") is None else int(data["parent_step"]),
                   parent_timeline=None if data.get("parent_timeline") is None else str(data["parent_timeline"]))


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """What one save is and why: the metadata that goes into the manifest and the catalog.

    The state itself (tensors, RNG, data position) is a `CheckpointState`; `step` and `epoch`
    are repeated here because the engine needs them before any state exists.

    Args:
        step (`int`): optimizer steps completed in the saved state.
        epoch (`float`, *optional*, defaults to `0.0`): fractional epoch of the saved state.
        tiers (`frozenset[Tier]`, *optional*, defaults to all): tiers the decision asked for.
        reason (`str`): human-readable reason (logs, manifest, catalog).
        kind (`str`, *optional*, defaults to `"manual"`): machine-readable reason
            (`policy.decision.DecisionKind` value).
        pinned (`bool`, *optional*, defaults to `False`): retention never deletes it.
        healthy (`bool`, *optional*, defaults to `True`): a valid target for `auto` / `best`.
        signals (`Mapping`, *optional*): signals at save time (strict JSON after `json_safe`).
        debug_info (`tuple[Mapping, ...]`, *optional*): the last steps' signals.
        lineage (`Lineage`, *optional*): session / timeline / parent of the run.
    """

    step: int
    epoch: float = 0.0
    tiers: frozenset[Tier] = ALL_TIERS
    reason: str
    kind: str = "manual"
    pinned: bool = False
    healthy: bool = True
    signals: Mapping[str, Any] | None = None
    debug_info: tuple[Mapping[str, Any], ...] = ()
    lineage: Lineage | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", frozenset(Tier(t) for t in self.tiers))
        object.__setattr__(self, "debug_info", tuple(self.debug_info or ()))

"""The manifest of a checkpoint, the checksums it records, the small JSON files, and the plain values passed around.

The manifest is written last, into the temporary directory, before the atomic rename. It lists every file of the
checkpoint with its size, checksum (``"xxh3_128:<hex>"``; any algorithm a manifest names is verified with that
algorithm), tier and rank, and carries its own checksum (``manifest_checksum``: ``"sha256:"`` of the canonical JSON
of every other key), so a tampered or torn manifest is refused instead of trusted. It is indented strict JSON
(non-finite floats are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``), so ``jq`` reads it.

Frozen weights (parameters that never train) are not written: a manifest records each by checksum, dtype and shape
under ``frozen``, and the resume checks the model's own tensor against it (`check_frozen`). Such a manifest has
``format_version`` 2, which an older reader refuses (it would export the model without those weights); any other
is version 1. Checkpoints written before stored frozen weights once per task, content-addressed under
``<task>/blobs/`` (the manifest's ``blobs`` table): those are still read and verified.

Every path a manifest can make the store touch is a single name from an allowlist (`allowed_file_name`) in the
checkpoint's own directory, or a 64-hex-digit blob digest, checked before it becomes a path. Files are read without
following a link (``O_NOFOLLOW``) and within a size bound.
"""

from __future__ import annotations

import enum
import errno
import functools
import hashlib
import io
import json
import mmap
import os
import platform
import re
import stat
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..constants import (
    ALL_TIERS,
    CHECKPOINT_FILE_NAMES,
    CHECKSUM_ALGO,
    DEBUG_INFO_STEPS,
    DEFAULT_TASK_ID,
    FORMAT_VERSION,
    KEY_BLOBS,
    KEY_BYTES,
    KEY_CHECKSUM,
    KEY_CREATED_AT,
    KEY_DEBUG_INFO,
    KEY_EPOCH,
    KEY_EXTRA,
    KEY_FILES,
    KEY_FORMAT_VERSION,
    KEY_FROZEN,
    KEY_HEALTHY,
    KEY_KIND,
    KEY_LINEAGE,
    KEY_MANIFEST_CHECKSUM,
    KEY_PINNED,
    KEY_RANK,
    KEY_REASON,
    KEY_RECOVERY_COST,
    KEY_SESSION_ID,
    KEY_SIGNALS,
    KEY_SIZE,
    KEY_STEP,
    KEY_TASK_ID,
    KEY_TIER,
    KEY_TIERS,
    KEY_TIMINGS,
    KEY_VERSIONS,
    KEY_WORLD_SIZE,
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    PINNED_MARKER,
    STEP_DIR_PREFIX,
    Tier,
)
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, FormatVersionError, UnsafePathError
from ..jsonutil import as_float, json_safe, loads_bounded

if TYPE_CHECKING:
    import torch

STATUS_OK, STATUS_MISSING, STATUS_CORRUPT = "ok", "missing", "corrupt"
"""A checkpoint's status in the catalog: intact, its directory or manifest gone, or a file found damaged."""
PLAIN_FORMAT_VERSION = 1
"""What a manifest without frozen records says (`FORMAT_VERSION` is what one with them says)."""
FILE_CHECKSUM_ALGO = "xxh3_128"
"""Algorithm of new file checksums: ~12 GB/s on one core, ample against accidental damage (bit rot, torn writes)."""
HASH_CHUNK = 8 << 20
FileEntry = dict[str, Any]
"""``{"size", "checksum", "tier", "rank"}``: one file in a manifest."""

_RANK_FILE_RE = re.compile(r"(?:rng-rank(0|[1-9][0-9]{0,6})\.json|(?:weights|optimizer)-rank(0|[1-9][0-9]{0,6})"
                           r"\.safetensors)")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


# -- plain values -------------------------------------------------------------------------------------------------
class Codec(enum.StrEnum):
    """Codec of the optimizer tier (L1): config, store and file format share this vocabulary."""

    ZSTD = "zstd"  # independent zstd frames, byte-grouped floats (default)
    NONE = "none"  # raw bytes, 64-byte aligned

    @classmethod
    def parse(cls, value: Any, *, field: str = "storage_levels.level_1.compression") -> Codec:
        """`value` as a `Codec` (`None` means `"none"`); anything else is a `ConfigError` naming `field`."""
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
    """What identifies and configures one rank's view of a store; plain values, so a writer process can open the
    same store (`CheckpointStore.from_spec`). `CheckpointStore` documents the fields; `remote` is the object-store
    `RemoteSpec` of a URL root (`root` is then its local cache)."""

    root: str
    task_id: str = DEFAULT_TASK_ID
    rank: int = 0
    world_size: int = 1
    session_id: str = field(default_factory=new_session_id)
    codec: Codec | str = Codec.ZSTD
    compression_level: int = 1
    compression_threads: int = 0
    rank_timeout_s: float = 600.0
    remote: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec.parse(self.codec, field="compression"))
        object.__setattr__(self, "root", str(self.root))
        task = self.task_id
        if not isinstance(task, str) or not task or "/" in task or "\\" in task or task.startswith(".") \
                or task == "blobs":
            raise ConfigError(f"task_id={task!r} is invalid: expected a non-empty name without '/' that does not "
                              "start with '.'.")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank}, world_size={self.world_size} is invalid: expected 0 <= rank < "
                              "world_size.")
        if not isinstance(self.session_id, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", self.session_id):
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
        session (`str`): the session that wrote it.
        timeline (`str`): its timeline. A run that starts fresh, or resumes from a checkpoint older than the newest
            of its timeline, starts a new one; other timelines' checkpoints past the fork point are *abandoned*.
        parent_step (`int`, *optional*): the checkpoint the run resumed from (`None`: a fresh start).
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
    """What one save is and why: the metadata that reaches the manifest and the catalog as given.

    Args:
        step (`int`): optimizer steps completed in the saved state.
        epoch (`float`, *optional*, defaults to `0.0`): fractional epoch.
        tiers (`frozenset[Tier]`, *optional*, defaults to all): tiers the decision asked for.
        reason (`str`): human-readable reason (logs, manifest, catalog).
        kind (`str`, *optional*, defaults to `"manual"`): machine-readable reason (`DecisionKind` value).
        pinned (`bool`, *optional*, defaults to `False`): retention never deletes it.
        healthy (`bool`, *optional*, defaults to `True`): a valid target for `auto` / `best`.
        signals (`Mapping`, *optional*): signals at save time.
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


@dataclass(frozen=True)
class BlobRef:
    """A weight the engine names instead of passing it (the store records no such weight and refuses one; kept
    while the engine still imports it)."""

    digest: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class CheckpointState:
    """What one rank hands to `CheckpointStore.save`: CPU tensors and JSON-able data.

    Args:
        step (`int`): optimizer steps completed when this state was taken.
        epoch (`float`, *optional*): fractional epoch.
        weights (`dict[str, torch.Tensor]`, *optional*): L0 under the model's key names (PEFT key names for an
            adapter); tensors sharing storage (tied weights) are stored once. Written by rank 0.
        frozen (`Mapping[str, Mapping]`, *optional*): weights that never train, recorded by `frozen_record` instead
            of written (they must not be in `weights` too).
        dedup_keys (`frozenset[str]`): keys of `weights` to record as `frozen` (the store computes their records).
        optimizer / scheduler / scaler (`dict`, *optional*): L1, the objects' `state_dict()`. Written by rank 0.
        rng (`dict`, *optional*): L2, this rank's RNG state (or an object with `to_json()`).
        sampler (`dict`, *optional*): L2, the data position (JSON-able), written by rank 0.
        extra (`dict`): JSON-able data for the manifest's `extra` (e.g. the Trainer state).
    """

    step: int
    epoch: float = 0.0
    weights: dict[str, Any] | None = None
    frozen: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    dedup_keys: frozenset[str] = frozenset()
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | Any | None = None
    sampler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tiers(self) -> frozenset[Tier]:
        return _tiers(self.weights, (self.optimizer, self.scheduler, self.scaler), (self.rng, self.sampler))


def _tiers(weights: Any, l1: tuple[Any, ...], l2: tuple[Any, ...]) -> frozenset[Tier]:
    found = ((Tier.WEIGHTS, weights is not None), (Tier.OPTIMIZER, any(v is not None for v in l1)),
             (Tier.STATE, any(v is not None for v in l2)))
    return frozenset(t for t, present in found if present)


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as the catalog and `CheckpointStore.list()` describe it.

    `frozen` is the manifest's record of the frozen weights it did not write; `blobs` the blob table of a checkpoint
    written by an earlier version. `abandoned` marks a checkpoint of a timeline a later run forked away from (never
    chosen by `auto`/`best`/`fastest`); `lineage` says which run wrote it.
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
    frozen: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, repr=False)


class Removal(NamedTuple):
    """One entry of a retention plan (`policy.retention.plan_retention`, applied by `CheckpointStore.prune`)."""

    info: CheckpointInfo
    tiers: frozenset[Tier]
    """What goes: a set containing `Tier.WEIGHTS` is the whole checkpoint."""
    rule: str = "a retention plan"
    """The rule that removes it, in words: recorded in the task's removals, named by `ls` and a resume."""


@dataclass
class LoadedCheckpoint:
    """Tensors and state read back, verified, from one checkpoint; `frozen` are the records of the weights it did not
    write (`check_frozen` compares them with the model's own)."""

    info: CheckpointInfo
    manifest: dict[str, Any]
    weights: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | Any | None = None
    sampler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    frozen: dict[str, Any] = field(default_factory=dict)

    @property
    def tiers(self) -> frozenset[Tier]:
        return _tiers(self.weights, (self.optimizer, self.scheduler), (self.rng, self.sampler))


@dataclass
class GcReport:
    """What `CheckpointStore.gc` or `prune` removed (with `dry_run`: would remove).

    Args:
        removed (`list[int]`): steps deleted whole (abandoned ones included).
        trimmed (`dict[int, list[str]]`): step -> tiers deleted from a checkpoint that stays.
        abandoned (`list[int]`): the steps of `removed` that were abandoned checkpoints.
        blobs (`list[str]`): blob files of earlier versions collected (no checkpoint referenced them).
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


# -- reading without following links ------------------------------------------------------------------------------
def open_read(path: str | os.PathLike[str]) -> io.BufferedReader:
    """Open an existing file for reading; a symbolic link at `path` is refused (`UnsafePathError`)."""
    try:
        return open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; the store never reads through links.") from e
        raise


def read_bytes(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """A file's bytes, at most `limit` of them (a larger file is `CorruptCheckpointError`); never through a link."""
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{path} has {size} bytes, more than the {limit} a file of this kind may "
                                         "have; the checkpoint is damaged or was not written by hf_dynamic_ckpt.")
        return f.read(limit + 1)


def lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_kind(path: str | os.PathLike[str], kind: str) -> bool:
    """Whether `path` is a real ``"dir"``, ``"file"`` or ``"link"`` (a link to a directory is a link)."""
    st = lstat(path)
    test = {"dir": stat.S_ISDIR, "file": stat.S_ISREG, "link": stat.S_ISLNK}[kind]
    return st is not None and test(st.st_mode)


def listdir(path: str | os.PathLike[str]) -> list[str]:
    """Names in a real directory, sorted; `[]` when it is missing or a link."""
    try:
        return sorted(os.listdir(path)) if is_kind(path, "dir") else []
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_json(path: Path) -> Any:
    """Parse a JSON file of a checkpoint (bounded size and depth); anything wrong is `CorruptCheckpointError`."""
    try:
        return loads_bounded(read_bytes(path, limit=MAX_JSON_BYTES))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable or not JSON ({e}); the checkpoint is damaged.") from e


# -- checksums ----------------------------------------------------------------------------------------------------
def new_hasher(algo: str | None = None) -> Any:
    """A hash object (`update`, `hexdigest`) of `algo`: ``xxh3_128`` (default), ``xxh3_64``, ``xxh64``, ``xxh32`` or
    a `hashlib` name; `ValueError` for another."""
    algo = algo or FILE_CHECKSUM_ALGO
    if algo in ("xxh3_128", "xxh3_64", "xxh64", "xxh32"):
        import xxhash

        return getattr(xxhash, algo)()
    try:
        return hashlib.new(algo)
    except ValueError:
        raise ValueError(f"Unknown checksum algorithm {algo!r}; use {FILE_CHECKSUM_ALGO!r} or a hashlib name.") \
            from None


def file_checksum(path: str | os.PathLike[str], algo: str | None = None) -> str:
    """``"<algo>:<hex>"`` of a whole file (a read-only map for large files: no copy out of the page cache); never
    through a link. To verify a manifest entry pass its algorithm: ``algo=entry["checksum"].partition(":")[0]``."""
    hasher = new_hasher(algo)
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size >= 1 << 20:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                for start in range(0, size, HASH_CHUNK):
                    hasher.update(view[start : start + HASH_CHUNK])
        else:
            hasher.update(f.read())
    return f"{algo or FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}"


def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order (a view when contiguous)."""
    import torch

    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def frozen_record(t: torch.Tensor) -> dict[str, Any]:
    """The manifest record of a frozen weight: ``{"checksum": "xxh3_128:<hex>" of its bytes, "dtype", "shape"}``."""
    t = t.detach().cpu()
    hasher = new_hasher()
    hasher.update(raw_view(t))
    return {"checksum": f"{FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}", "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}


def check_frozen(loaded: LoadedCheckpoint, live: Mapping[str, Any]) -> None:
    """Check the model's own frozen weights against the records of `loaded`, and put them into `loaded.weights`.

    Args:
        loaded (`LoadedCheckpoint`): a checkpoint whose manifest records frozen weights (nothing to do otherwise).
        live (`Mapping[str, Tensor]`): the model's tensors by the same names (e.g. `expected_weights(model)`).

    Raises:
        `IncompatibleStateError`: a recorded weight is missing from `live` or holds other values (the model was not
            built from the weights the run trained on); the message names them.
    """
    from ..errors import IncompatibleStateError

    if not loaded.frozen:
        return
    bad = sorted(k for k, rec in loaded.frozen.items()
                 if live.get(k) is None or frozen_record(live[k]) != {**rec, "shape": list(rec["shape"])})
    if bad:
        raise IncompatibleStateError(
            f"the model's frozen weights differ from those step {loaded.info.step} was trained with (it records them "
            f"by checksum, not their values): {', '.join(bad[:10])}. Build the model from the same base weights.")
    if loaded.weights is not None:
        loaded.weights.update({k: live[k] for k in loaded.frozen})


# -- the manifest -------------------------------------------------------------------------------------------------
def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the sorted, compact JSON of every key but the checksum itself."""
    body = {k: v for k, v in manifest.items() if k != KEY_MANIFEST_CHECKSUM}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return f"{CHECKSUM_ALGO}:{hashlib.new(CHECKSUM_ALGO, data).hexdigest()}"


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose objects a checkpoint holds, for the manifest."""
    return dict(_library_versions())


@functools.lru_cache(maxsize=1)
def _library_versions() -> tuple[tuple[str, str], ...]:
    from importlib import metadata

    from .._version import VERSION

    versions = {"hf_dynamic_ckpt": VERSION, "python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "peft", "safetensors", "zstandard", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return tuple(versions.items())


def recovery_cost_ms(files: Mapping[str, Mapping[str, Any]], blobs: Mapping[str, Mapping[str, Any]]) -> float:
    """Estimated time to verify and load a checkpoint, from its bytes per tier: 2 ms per file, L0 at 500 MB/s, L1
    at 200 MB/s. It ranks checkpoints for ``resolve("fastest")``; it is not a measurement of this machine."""
    unique = {str(b.get("digest")): {KEY_SIZE: b.get("size", 0), KEY_TIER: Tier.WEIGHTS.value} for b in blobs.values()}
    rate = {Tier.WEIGHTS.value: 500_000.0, Tier.OPTIMIZER.value: 200_000.0}
    return round(sum(2.0 + float(e.get(KEY_SIZE, 0)) / rate.get(e.get(KEY_TIER, "weights"), float("inf"))
                     for e in [*files.values(), *unique.values()]), 1)


def build_manifest(*, task_id: str, step: int, epoch: float, reason: str, tiers: Collection[Tier], pinned: bool,
                   healthy: bool, world_size: int, files: Mapping[str, Mapping[str, Any]], session_id: str,
                   frozen: Mapping[str, Mapping[str, Any]] | None = None, kind: str | None = None,
                   lineage: Lineage | None = None, signals: Mapping[str, Any] | None = None,
                   debug_info: Collection[Mapping[str, Any]] = (), extra: Mapping[str, Any] | None = None,
                   timings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of what the ranks wrote, its checksum included (only the last `DEBUG_INFO_STEPS` records)."""
    manifest: dict[str, Any] = {
        KEY_FORMAT_VERSION: FORMAT_VERSION if frozen else PLAIN_FORMAT_VERSION, KEY_TASK_ID: task_id,
        KEY_STEP: int(step), KEY_EPOCH: float(epoch), KEY_REASON: reason, KEY_TIERS: sorted(t.value for t in tiers),
        KEY_PINNED: bool(pinned), KEY_HEALTHY: bool(healthy), KEY_WORLD_SIZE: int(world_size),
        KEY_CREATED_AT: time.time(), KEY_SESSION_ID: session_id,
        KEY_FILES: {n: dict(e) for n, e in sorted(files.items())}, KEY_BLOBS: {},
        KEY_BYTES: sum(int(e[KEY_SIZE]) for e in files.values()), KEY_RECOVERY_COST: recovery_cost_ms(files, {}),
        KEY_SIGNALS: dict(signals or {}), KEY_DEBUG_INFO: list(debug_info)[-DEBUG_INFO_STEPS:],
        KEY_EXTRA: dict(extra or {}), KEY_VERSIONS: library_versions(), KEY_TIMINGS: dict(timings or {}),
    }
    if frozen:
        manifest[KEY_FROZEN] = {k: dict(v) for k, v in sorted(frozen.items())}
    if kind is not None:
        manifest[KEY_KIND] = str(kind)
    if lineage is not None:
        manifest[KEY_LINEAGE] = lineage.to_dict()
    return with_changes(json_safe(manifest), {})


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"


def json_bytes(obj: Any) -> bytes:
    """The bytes of one of a checkpoint's small JSON files (RNG, sampler, `optimizer.json`, done files)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"


def entry_of(data: bytes, *, tier: Tier, rank: int | None) -> FileEntry:
    """The manifest entry of a file holding `data`."""
    hasher = new_hasher()
    hasher.update(data)
    return {KEY_SIZE: len(data), KEY_CHECKSUM: f"{FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}", KEY_TIER: tier.value,
            KEY_RANK: rank}


def allowed_file_name(name: Any, world_size: int) -> bool:
    """Whether a manifest may list `name`: the fixed allowlist, or a rank file of a rank below `world_size`."""
    if not isinstance(name, str):
        return False
    m = _RANK_FILE_RE.fullmatch(name)
    return name in CHECKPOINT_FILE_NAMES or (m is not None and int(m.group(1) or m.group(2)) < world_size)


def is_digest(value: Any) -> bool:
    """Whether `value` is a blob's content address (64 lowercase hex digits)."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def _count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_shape(m: dict[str, Any], where: str) -> None:
    """Types of every key the store turns into paths, sizes or decisions."""
    for key, kind in ((KEY_STEP, int), (KEY_FILES, dict), (KEY_TIERS, list), (KEY_TASK_ID, str)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise CorruptCheckpointError(f"{where}: manifest key {key!r} is missing or not a {kind.__name__}.")
    world = m.get(KEY_WORLD_SIZE, 1)
    if not _count(m[KEY_STEP]) or not _count(world, 1) or not all(isinstance(t, str) for t in m[KEY_TIERS]):
        raise CorruptCheckpointError(f"{where}: step={m[KEY_STEP]!r} / world_size={world!r} / tiers is invalid.")
    for name, entry in m[KEY_FILES].items():
        if not allowed_file_name(name, world):
            raise CorruptCheckpointError(
                f"{where}: manifest lists file {str(name)[:80]!r}, which is not an allowed file name of a checkpoint "
                f"({', '.join(sorted(CHECKPOINT_FILE_NAMES))}, rng-rank<R>.json, weights-rank<R>.safetensors, "
                "optimizer-rank<R>.safetensors); the manifest is damaged or hostile.")
        if not (isinstance(entry, dict) and _count(entry.get(KEY_SIZE)) and isinstance(entry.get(KEY_CHECKSUM), str)):
            raise CorruptCheckpointError(f"{where}: manifest entry of file {name!r} lacks an integer size or a "
                                         "checksum.")
    for table, needs in ((KEY_BLOBS, "digest"), (KEY_FROZEN, "checksum")):
        records = m.get(table) or {}
        if not isinstance(records, dict):
            raise CorruptCheckpointError(f"{where}: manifest key {table!r} is not an object.")
        for key, rec in records.items():
            ok = isinstance(rec, dict) and isinstance(rec.get("dtype"), str) and isinstance(rec.get("shape"), list) \
                and all(_count(d) for d in rec["shape"]) and _count(rec.get("size", 0)) \
                and (is_digest(rec.get("digest")) if needs == "digest" else isinstance(rec.get(needs), str))
            if not ok:
                what = "blob" if needs == "digest" else "frozen"
                raise CorruptCheckpointError(
                    f"{where}: {what} record of weight {str(key)[:80]!r} is malformed ({needs} must be "
                    f"{'64 hex digits' if needs == 'digest' else 'a checksum'}, dtype a name, shape a list of sizes); "
                    "the manifest is damaged or hostile.")
    lineage = m.get(KEY_LINEAGE)
    if lineage is not None and not (isinstance(lineage, dict) and isinstance(lineage.get("timeline"), str)
                                    and isinstance(lineage.get("session"), str)):
        raise CorruptCheckpointError(f"{where}: manifest key 'lineage' is malformed.")


def validate_manifest(manifest: Any, *, where: str) -> dict[str, Any]:
    """Check version, checksum and shape of a parsed manifest.

    Raises:
        `FormatVersionError`: written by a newer format than this library reads.
        `CorruptCheckpointError`: checksum mismatch, keys missing or of the wrong type, a file name outside the
            allowlist.
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{where}: the manifest is not a JSON object; the checkpoint is damaged.")
    version = manifest.get(KEY_FORMAT_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise FormatVersionError(f"{where}: format_version={version} is newer than the version this library reads "
                                 f"({FORMAT_VERSION}); upgrade hf_dynamic_ckpt to load it.")
    recorded = manifest.get(KEY_MANIFEST_CHECKSUM)
    try:
        actual = manifest_checksum(manifest)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the manifest cannot be re-encoded ({e}); the checkpoint is "
                                     "damaged.") from e
    if recorded != actual:
        raise CorruptCheckpointError(
            f"{where}: manifest checksum mismatch (recorded {recorded!r}, actual {actual!r}): the manifest was "
            "modified or damaged after the commit; restore from another checkpoint.")
    if not _count(version, 1):
        raise CorruptCheckpointError(f"{where}: format_version={version!r} is not a valid format version.")
    _check_shape(manifest, where)
    return manifest


def read_manifest(directory: str | os.PathLike[str], *, step: int | None = None,
                  task_id: str | None = None) -> dict[str, Any]:
    """Read and validate ``directory/manifest.json`` (never through a link, at most `MAX_JSON_BYTES`).

    Args:
        directory (`str` or `os.PathLike`): a committed checkpoint directory.
        step (`int`, *optional*): the step its directory name says; the manifest must agree.
        task_id (`str`, *optional*): the task its parent directory names; the manifest must agree.

    Raises:
        `CheckpointNotFoundError`: there is no manifest (not a committed checkpoint).
        `CorruptCheckpointError`: unreadable, not JSON, nested too deeply, checksum mismatch, a disallowed file name,
            or a step / task that differs from the directory's.
        `FormatVersionError`: written by a newer format version.
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = read_bytes(path, limit=MAX_JSON_BYTES)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"{directory}: no {MANIFEST_NAME}, so this is not a committed checkpoint (an "
                                      "interrupted save or another directory).") from e
    except OSError as e:  # a link (UnsafePathError), a directory, EIO, EACCES
        raise CorruptCheckpointError(f"{path}: the manifest cannot be read ({e}).") from e
    try:
        manifest = loads_bounded(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON ({e}); the checkpoint is damaged.") from e
    manifest = validate_manifest(manifest, where=str(path))
    if (step is not None and manifest[KEY_STEP] != step) or (task_id is not None and manifest[KEY_TASK_ID] != task_id):
        raise CorruptCheckpointError(
            f"{path}: the manifest says task {manifest[KEY_TASK_ID]!r} step {manifest[KEY_STEP]}, but it lives in "
            f"{task_id!r}/{STEP_DIR_PREFIX}{step}; the directory is the truth, so this checkpoint is refused (it was "
            "renamed or edited by hand).")
    return manifest


def tiers_of(manifest: Mapping[str, Any]) -> frozenset[Tier]:
    """The manifest's tiers as `Tier` members (unknown names are ignored)."""
    return frozenset(Tier(t) for t in manifest.get(KEY_TIERS, []) if t in Tier._value2member_map_)


def with_changes(manifest: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` with `changes` applied and its checksum recomputed."""
    new = {**{k: v for k, v in manifest.items() if k != KEY_MANIFEST_CHECKSUM}, **changes}
    new[KEY_MANIFEST_CHECKSUM] = manifest_checksum(new)
    return new


def without_tiers(manifest: Mapping[str, Any], tiers: Collection[Tier]) -> tuple[dict[str, Any], set[str]]:
    """A copy of `manifest` that no longer holds `tiers` (re-checksummed), and the file names dropped."""
    values = {Tier(t).value for t in tiers}
    drop = {n for n, e in manifest[KEY_FILES].items() if e.get(KEY_TIER) in values}
    files = {n: e for n, e in manifest[KEY_FILES].items() if n not in drop}
    blobs = {} if Tier.WEIGHTS.value in values else dict(manifest.get(KEY_BLOBS) or {})
    return with_changes(manifest, {KEY_FILES: files, KEY_BLOBS: blobs,
                                   KEY_TIERS: sorted(set(manifest[KEY_TIERS]) - values),
                                   KEY_BYTES: sum(int(e[KEY_SIZE]) for e in files.values()),
                                   KEY_RECOVERY_COST: recovery_cost_ms(files, blobs)}), drop


def info_from_manifest(manifest: Mapping[str, Any], path: Path, *, status: str = STATUS_OK,
                       abandoned: bool = False) -> CheckpointInfo:
    """The `CheckpointInfo` a valid manifest describes; the task is the directory's parent's name."""
    signals = manifest.get(KEY_SIGNALS)
    signals = signals if isinstance(signals, dict) else {}
    gpu = as_float(signals.get("gpu_mem_percent"))
    if gpu is None and as_float(signals.get("device_mem_frac")) is not None:
        gpu = 100.0 * float(as_float(signals.get("device_mem_frac")) or 0.0)
    loss = as_float(signals.get("loss"))
    lineage = manifest.get(KEY_LINEAGE)
    return CheckpointInfo(
        task_id=path.parent.name, step=int(manifest[KEY_STEP]), path=str(path),
        reason=str(manifest.get(KEY_REASON, "")),
        tiers=tiers_of(manifest), bytes=int(manifest.get(KEY_BYTES, 0)),
        loss=loss if loss is None or loss == loss else None,  # NaN is no loss to rank by
        gpu_mem_percent=gpu, save_time=float(manifest.get(KEY_CREATED_AT, 0.0)),
        recovery_cost_ms=as_float(manifest.get(KEY_RECOVERY_COST)), healthy=bool(manifest.get(KEY_HEALTHY, True)),
        pinned=bool(manifest.get(KEY_PINNED, False)) or is_kind(path / PINNED_MARKER, "file"), status=status,
        world_size=int(manifest.get(KEY_WORLD_SIZE, 1)), blobs=dict(manifest.get(KEY_BLOBS) or {}),
        abandoned=abandoned, lineage=Lineage.from_dict(lineage) if isinstance(lineage, dict) else None,
        frozen=dict(manifest.get(KEY_FROZEN) or {}))


def broken_info(task_id: str, step: int, path: Path, status: str) -> CheckpointInfo:
    """The catalog row of a directory whose manifest cannot be trusted."""
    st = lstat(path)
    return CheckpointInfo(task_id=task_id, step=step, path=str(path), reason="", tiers=frozenset(), bytes=0,
                          loss=None, gpu_mem_percent=None, save_time=st.st_mtime if st else 0.0, recovery_cost_ms=None,
                          healthy=False, pinned=is_kind(path / PINNED_MARKER, "file"), status=status)

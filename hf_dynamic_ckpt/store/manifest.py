"""A checkpoint's manifest, the checksums it records, its small JSON files, and the plain values passed around.

The manifest is written last (its format: docs/internals.md); its own checksum refuses a tampered or torn manifest, and
an entry naming another checksum algorithm than ``xxh3_128`` is verified with that one. A manifest can only make the
store touch allowlisted names in its own directory and 64-hex-digit blob digests; files are read without following a
link and within a size bound.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import hashlib
import io
import json
import os
import platform
import re
import stat
import uuid
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import constants as C
from .. import errors
from ..constants import Tier
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, FormatVersionError, UnsafePathError
from ..jsonutil import as_float, loads_bounded

if TYPE_CHECKING:
    import torch

STATUS_OK, STATUS_MISSING, STATUS_CORRUPT = "ok", "missing", "corrupt"
FILE_CHECKSUM_ALGO, HASH_CHUNK = "xxh3_128", 8 << 20
_RANK_FILE = re.compile(r"(?:rng-rank|weights-rank|optimizer-rank)(0|[1-9][0-9]{0,6})\.(?:json|safetensors)")


class Codec(enum.StrEnum):
    """Codec of the optimizer tier: independent zstd frames of byte-grouped floats, or raw bytes."""

    ZSTD = "zstd"
    NONE = "none"

    @classmethod
    def parse(cls, value: Any, *, field: str = "storage_levels.level_1.compression") -> Codec:
        """`value` as a `Codec` (`None`: ``"none"``); `ConfigError` naming `field` for anything else."""
        try:
            return cls.NONE if value is None else cls(getattr(value, "value", value))
        except ValueError:
            extra = " (gzip is not offered for L1: zstd level 1-3 is smaller and faster)" if value == "gzip" else ""
            raise ConfigError(f"{field}={value!r} is invalid: expected 'zstd' or 'none'{extra}.") from None


def step_dir_name(step: int) -> str:
    return f"{C.STEP_DIR_PREFIX}{int(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed directory name (``step-12`` -> 12), else `None`."""
    m = re.fullmatch(rf"{C.STEP_DIR_PREFIX}(0|[1-9][0-9]*)", name)
    return int(m.group(1)) if m else None


def new_session_id() -> str:
    """A fresh session id (12 hex digits). Under DDP rank 0 makes one and broadcasts it."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """What identifies and configures one rank's view of a store, in plain values (a writer process opens the same
    store with `CheckpointStore.from_spec`); `CheckpointStore` documents the fields; `remote` is a URL root's
    `RemoteSpec` (`root` is then its local cache)."""

    root: str
    task_id: str = C.DEFAULT_TASK_ID
    rank: int = 0
    world_size: int = 1
    session_id: str = field(default_factory=new_session_id)
    codec: Codec | str = Codec.ZSTD
    compression_level: int = 1
    compression_threads: int = 0
    rank_timeout_s: float = 600.0
    remote: Any = None
    last_commits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec.parse(self.codec, field="compression"))
        object.__setattr__(self, "root", str(self.root))
        task = self.task_id
        for ok, message in (
                (isinstance(task, str) and task and not {"/", "\\"} & set(task) and task[0] != "." and task != "blobs",
                 f"task_id={task!r} is invalid: expected a non-empty name without '/' that does not start with '.'."),
                (self.world_size >= 1 and 0 <= self.rank < self.world_size,
                 f"rank={self.rank}, world_size={self.world_size} is invalid: expected 0 <= rank < world_size."),
                (isinstance(self.session_id, str) and re.fullmatch(r"[A-Za-z0-9_-]+", self.session_id),
                 f"session_id={self.session_id!r} is invalid: use letters, digits, '_' or '-' only."),
                (self.rank_timeout_s > 0,
                 f"rank_timeout_s={self.rank_timeout_s!r} is invalid: expected a positive number of seconds."),
                (1 <= int(self.compression_level) <= 22,
                 f"compression_level={self.compression_level!r} is invalid: expected 1 <= level <= 22.")):
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class Lineage:
    """Which run wrote a checkpoint: its `session`, its `timeline` (a run that starts fresh, or resumes from a
    checkpoint older than its timeline's newest, starts a new one), and the checkpoint it resumed from
    (`parent_step` of `parent_timeline`; `None`: a fresh start)."""

    session: str
    timeline: str
    parent_step: int | None = None
    parent_timeline: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        step, timeline = data.get("parent_step"), data.get("parent_timeline")
        return cls(session=str(data["session"]), timeline=str(data["timeline"]),
                   parent_step=None if step is None else int(step), parent_timeline=None if timeline is None else
                   str(timeline))


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """What one save is and why; it reaches the manifest and the catalog as given.

    Args:
        step (`int`): optimizer steps completed in the saved state.
        epoch (`float`, *optional*, defaults to `0.0`): fractional epoch.
        tiers (`frozenset[Tier]`, *optional*, defaults to all): tiers the decision asked for.
        reason (`str`): human-readable reason; `kind` (defaults to `"manual"`): the machine-readable one.
        pinned (`bool`, *optional*, defaults to `False`): retention never deletes it.
        healthy (`bool`, *optional*, defaults to `True`): a valid target for ``auto`` / ``best``.
        signals (`Mapping`, *optional*) / debug_info (`tuple[Mapping, ...]`): the signals at save time and of the
            last steps. lineage (`Lineage`, *optional*): the run's session, timeline and parent.
    """

    step: int
    epoch: float = 0.0
    tiers: frozenset[Tier] = C.ALL_TIERS
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


def _tiers(weights: Any, l1: tuple[Any, ...], l2: tuple[Any, ...]) -> frozenset[Tier]:
    return frozenset(t for t, held in ((Tier.WEIGHTS, weights is not None), (Tier.OPTIMIZER, l1 != (None,) * len(l1)),
                                       (Tier.STATE, l2 != (None,) * len(l2))) if held)


@dataclass
class CheckpointState:
    """What one rank hands to `CheckpointStore.save`: CPU tensors and JSON-able data.

    Args:
        step (`int`) / epoch (`float`, *optional*): optimizer steps completed, fractional epoch.
        weights (`dict[str, torch.Tensor]`, *optional*): L0 under the model's keys (PEFT's for an adapter); tensors
            sharing storage (tied weights) are stored once. Written by rank 0.
        frozen (`Mapping[str, Mapping]`, *optional*): weights that never train, as `frozen_record`s, not written.
        dedup_keys (`frozenset[str]`): keys of `weights` to record as `frozen` instead (the store computes them).
        optimizer / scheduler / scaler (`dict`, *optional*): L1, the objects' `state_dict()`s. Written by rank 0.
        rng (`dict`, *optional*): L2, this rank's RNG state (or an object with `to_json()`).
        sampler (`dict`, *optional*): L2, the data position, written by rank 0.
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


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as the catalog and `CheckpointStore.list()` describe it; `abandoned`: of a timeline a
    later run forked away from (never chosen by ``auto``, ``best``, ``fastest``); `frozen`: the manifest's records of
    weights not written; `blobs`: the blob table of a checkpoint of an earlier version."""

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
    """One entry of a retention plan (`policy.retention.plan_retention`, applied by `CheckpointStore.prune`): the
    checkpoint, what goes (a set with `Tier.WEIGHTS`: all of it), and the rule, recorded and named by ``ls``."""

    info: CheckpointInfo
    tiers: frozenset[Tier]
    rule: str = "a retention plan"


@dataclass
class LoadedCheckpoint:
    """A checkpoint's tiers, read back verified; `frozen`: the records of the weights it did not write."""

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
    """What `CheckpointStore.gc` or `prune` removed (`dry_run`: would remove): whole steps (`removed`, those of
    abandoned timelines in `abandoned`), tiers of steps that stay (`trimmed`), unused blobs of an earlier version,
    leftovers of interrupted saves (`temp_dirs`), `bytes_freed`, and why planned removals were `kept`."""

    removed: list[int] = field(default_factory=list)
    trimmed: dict[int, list[str]] = field(default_factory=dict)
    abandoned: list[int] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    temp_dirs: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: list[str] = field(default_factory=list)
    dry_run: bool = False


# -- files read without following links ---------------------------------------------------------------------------
def open_read(path: str | os.PathLike[str]) -> io.BufferedReader:
    """An existing file opened for reading; a symbolic link at `path` is refused (`UnsafePathError`)."""
    try:
        return open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; the store never reads through links.") from e
        raise


def read_bytes(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """A file's bytes, at most `limit` of them (a larger file is `CorruptCheckpointError`)."""
    with open_read(path) as f:
        if (size := os.fstat(f.fileno()).st_size) > limit:
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
    return st is not None and {"dir": stat.S_ISDIR, "file": stat.S_ISREG, "link": stat.S_ISLNK}[kind](st.st_mode)


def listdir(path: str | os.PathLike[str]) -> list[str]:
    """Names in a real directory, sorted; `[]` when it is missing or a link."""
    try:
        return sorted(os.listdir(path)) if is_kind(path, "dir") else []
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint (bounded size and depth); anything wrong is `CorruptCheckpointError`."""
    try:
        return loads_bounded(read_bytes(path, limit=C.MAX_JSON_BYTES))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable or not JSON ({e}); the checkpoint is damaged.") from e


def json_bytes(obj: Any) -> bytes:
    """The bytes of one of a checkpoint's small JSON files (RNG, sampler, ``optimizer.json``, done files). Compact:
    an indent makes `json` use its pure-Python encoder, 4x slower (1 ms of every memory slot's RNG file)."""
    return json.dumps(obj, sort_keys=True).encode() + b"\n"


# -- checksums ----------------------------------------------------------------------------------------------------
def new_hasher(algo: str | None = None) -> Any:
    """A hash object of `algo`: ``xxh3_128`` (default), ``xxh3_64``, ``xxh64``, ``xxh32`` or a `hashlib` name."""
    if (algo := algo or FILE_CHECKSUM_ALGO) in ("xxh3_128", "xxh3_64", "xxh64", "xxh32"):
        import xxhash

        return getattr(xxhash, algo)()
    try:
        return hashlib.new(algo)
    except ValueError:
        raise ValueError(f"Unknown checksum algorithm {algo!r}; use {FILE_CHECKSUM_ALGO!r} or a hashlib name.") \
            from None


def file_checksum(path: str | os.PathLike[str], algo: str | None = None) -> str:
    """``"<algo>:<hex>"`` of a whole file, read without following a link."""
    with open_read(path) as f:
        return f"{algo or FILE_CHECKSUM_ALGO}:{hashlib.file_digest(f, lambda: new_hasher(algo)).hexdigest()}"


def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order (a view when contiguous)."""
    import torch

    return memoryview(b"") if t.numel() == 0 else \
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def frozen_record(t: torch.Tensor) -> dict[str, Any]:
    """The manifest record of a frozen weight: ``{"checksum": "xxh3_128:<hex>" of its bytes, "dtype", "shape"}``."""
    t = t.detach().cpu()
    (hasher := new_hasher()).update(raw_view(t))
    return {"checksum": f"{FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}", "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}


def check_frozen(loaded: LoadedCheckpoint, live: Mapping[str, Any]) -> None:
    """Check the model's own frozen weights (`live`: its tensors by the same names, e.g. `expected_weights(model)`)
    against the records of `loaded`, and put them into `loaded.weights`; `IncompatibleStateError` names each
    recorded weight missing from `live` or holding other values (the model was not built from the trained weights)."""
    from ..errors import IncompatibleStateError

    bad = sorted(k for k, rec in loaded.frozen.items() if live.get(k) is None or frozen_record(live[k]) != rec)
    if bad:
        raise IncompatibleStateError(
            f"the model's frozen weights differ from those step {loaded.info.step} was trained with (it records them "
            f"by checksum, not their values): {', '.join(bad[:10])}. Build the model from the same base weights.")
    if loaded.weights is not None:
        loaded.weights.update({k: live[k] for k in loaded.frozen})


# -- the manifest -------------------------------------------------------------------------------------------------
def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the sorted, compact JSON of every key but the checksum itself."""
    body = {k: v for k, v in manifest.items() if k != C.KEY_MANIFEST_CHECKSUM}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return f"{C.CHECKSUM_ALGO}:{hashlib.new(C.CHECKSUM_ALGO, data).hexdigest()}"


@functools.lru_cache(maxsize=1)
def library_versions() -> tuple[tuple[str, str], ...]:
    """Versions of the libraries whose objects a checkpoint holds, for the manifest (``dict()`` of it)."""
    from importlib import metadata

    from ..constants import VERSION

    found = {"hf_dynamic_ckpt": VERSION, "python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "peft", "safetensors", "zstandard", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return tuple(found.items())


def recovery_cost_ms(files: Mapping[str, Mapping[str, Any]], blobs: Mapping[str, Mapping[str, Any]]) -> float:
    """An estimate that ranks checkpoints for ``resolve("fastest")``: 2 ms per file, L0 at 500 MB/s, L1 at 200 MB/s."""
    unique = {str(b.get("digest")): {C.KEY_SIZE: b.get("size", 0)} for b in blobs.values()}
    rate = {Tier.WEIGHTS.value: 500_000.0, Tier.OPTIMIZER.value: 200_000.0}
    return round(sum(2.0 + float(e.get(C.KEY_SIZE, 0)) / rate.get(e.get(C.KEY_TIER, "weights"), float("inf"))
                     for e in [*files.values(), *unique.values()]), 1)


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """A manifest's bytes: compact, as `json_bytes` (`hf-dynamic-ckpt show` prints it readably)."""
    return json.dumps(manifest, sort_keys=True, allow_nan=False).encode() + b"\n"


def _count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def validate_manifest(m: Any, *, where: str) -> dict[str, Any]:
    """Check version (newer: `FormatVersionError`), checksum and the shape of every key the store turns into paths,
    sizes or decisions (a mismatch, a key missing or mistyped, a name off the allowlist: `CorruptCheckpointError`)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {why}")

    if not isinstance(m, dict):
        raise bad("the manifest is not a JSON object; the checkpoint is damaged.")
    if _count(version := m.get(C.KEY_FORMAT_VERSION)) and int(version or 0) > C.FORMAT_VERSION:
        raise FormatVersionError(f"{where}: format_version={version} is newer than the version this library reads "
                                 f"({C.FORMAT_VERSION}); upgrade hf_dynamic_ckpt to load it.")
    try:
        actual = manifest_checksum(m)
    except (TypeError, ValueError) as e:
        raise bad(f"the manifest cannot be re-encoded ({e}); the checkpoint is damaged.") from e
    if (recorded := m.get(C.KEY_MANIFEST_CHECKSUM)) != actual:
        raise bad(f"manifest checksum mismatch (recorded {recorded!r}, actual {actual!r}): the manifest was modified "
                  "or damaged after the commit; restore from another checkpoint.")
    world, lineage, tiers = m.get(C.KEY_WORLD_SIZE, 1), m.get(C.KEY_LINEAGE), m.get(C.KEY_TIERS)
    for key, ok in ((C.KEY_FORMAT_VERSION, _count(version, 1)), (C.KEY_STEP, _count(m.get(C.KEY_STEP))),
                    (C.KEY_WORLD_SIZE, _count(world, 1)), (C.KEY_TASK_ID, isinstance(m.get(C.KEY_TASK_ID), str)),
                    (C.KEY_FILES, isinstance(m.get(C.KEY_FILES), dict)),
                    (C.KEY_TIERS, isinstance(tiers, list) and all(isinstance(t, str) for t in tiers)),
                    *((table, isinstance(m.get(table) or {}, dict)) for table in (C.KEY_BLOBS, C.KEY_FROZEN)),
                    (C.KEY_LINEAGE, lineage is None or (isinstance(lineage, dict) and isinstance(
                        lineage.get("timeline"), str) and isinstance(lineage.get("session"), str)))):
        if not ok:
            raise bad(f"manifest key {key!r} is missing or malformed ({str(m.get(key))[:80]!r}).")
    for name, entry in m[C.KEY_FILES].items():
        rank_file = _RANK_FILE.fullmatch(name) if isinstance(name, str) else None  # a rank below world_size
        if name not in C.CHECKPOINT_FILE_NAMES and (rank_file is None or int(rank_file.group(1)) >= world):
            raise bad(f"manifest lists file {str(name)[:80]!r}, which is not an allowed file name of a checkpoint "
                      f"({', '.join(sorted(C.CHECKPOINT_FILE_NAMES))}, rng-rank<R>.json, weights-rank<R>.safetensors, "
                      "optimizer-rank<R>.safetensors); the manifest is damaged or hostile.")
        if not (isinstance(entry, dict) and _count(entry.get(C.KEY_SIZE)) and isinstance(entry.get(C.KEY_CHECKSUM),
                                                                                          str)):
            raise bad(f"manifest entry of file {name!r} lacks an integer size or a checksum.")
    for table, what, needs in ((C.KEY_BLOBS, "blob", "digest must be 64 hex digits"),
                               (C.KEY_FROZEN, "frozen", "checksum must be a string")):
        for key, r in (m.get(table) or {}).items():
            if not (isinstance(r, dict) and isinstance(r.get("dtype"), str) and isinstance(r.get("shape"), list)
                    and all(_count(d) for d in r["shape"]) and _count(r.get("size", 0)) and (
                        isinstance(r.get("digest"), str) and re.fullmatch("[0-9a-f]{64}", r["digest"]) is not None
                        if what == "blob" else isinstance(r.get("checksum"), str))):
                raise bad(f"{what} record of weight {str(key)[:80]!r} is malformed ({needs}, dtype a name, shape a "
                          "list of sizes); the manifest is damaged or hostile.")
    return m


def read_manifest(directory: str | os.PathLike[str], *, step: int | None = None,
                  task_id: str | None = None) -> dict[str, Any]:
    """Read and validate ``directory/manifest.json``; its step and task must be the directory's (`step`, `task_id`).
    No manifest: `CheckpointNotFoundError`; unreadable, not JSON, too deep, damaged, hostile, or another step or task:
    `CorruptCheckpointError`; a newer format: `FormatVersionError`."""
    path = Path(directory) / C.MANIFEST_NAME
    try:
        errors.fault("read", name=C.MANIFEST_NAME, step=step, op="read")  # a test hook
        manifest = validate_manifest(loads_bounded(read_bytes(path, limit=C.MAX_JSON_BYTES)), where=str(path))
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"{directory}: no {C.MANIFEST_NAME}, so this is not a committed checkpoint (an "
                                      "interrupted save or another directory).") from e
    except OSError as e:  # a link (UnsafePathError), a directory, EIO, EACCES
        raise CorruptCheckpointError(f"{path}: the manifest cannot be read ({e}).") from e
    except ValueError as e:
        if isinstance(e, CorruptCheckpointError | FormatVersionError):
            raise
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON ({e}); the checkpoint is damaged.") from e
    if (step is not None and manifest[C.KEY_STEP] != step) or (task_id is not None and manifest[C.KEY_TASK_ID] !=
                                                               task_id):
        raise CorruptCheckpointError(
            f"{path}: the manifest says task {manifest[C.KEY_TASK_ID]!r} step {manifest[C.KEY_STEP]}, but it lives in "
            f"{task_id!r}/{C.STEP_DIR_PREFIX}{step}; the directory is the truth, so this checkpoint is refused (it "
            "was renamed or edited by hand).")
    return manifest


def tiers_of(manifest: Mapping[str, Any]) -> frozenset[Tier]:
    return frozenset(Tier(t) for t in manifest.get(C.KEY_TIERS, []) if t in {t.value for t in Tier})


def with_changes(manifest: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` with `changes` applied and its checksum recomputed."""
    new = {**{k: v for k, v in manifest.items() if k != C.KEY_MANIFEST_CHECKSUM}, **changes}
    return {**new, C.KEY_MANIFEST_CHECKSUM: manifest_checksum(new)}


def without_tiers(manifest: Mapping[str, Any], tiers: Collection[Tier]) -> tuple[dict[str, Any], set[str]]:
    """A copy of `manifest` that no longer holds `tiers` (re-checksummed), and the file names dropped."""
    values = {Tier(t).value for t in tiers}
    drop = {n for n, e in manifest[C.KEY_FILES].items() if e.get(C.KEY_TIER) in values}
    files = {n: e for n, e in manifest[C.KEY_FILES].items() if n not in drop}
    blobs = {} if Tier.WEIGHTS.value in values else dict(manifest.get(C.KEY_BLOBS) or {})
    return with_changes(manifest, {C.KEY_FILES: files, C.KEY_BLOBS: blobs,
                                   C.KEY_TIERS: sorted(set(manifest[C.KEY_TIERS]) - values),
                                   C.KEY_BYTES: sum(int(e[C.KEY_SIZE]) for e in files.values()),
                                   C.KEY_RECOVERY_COST: recovery_cost_ms(files, blobs)}), drop


def info_from_manifest(manifest: Mapping[str, Any], path: Path) -> CheckpointInfo:
    """The `CheckpointInfo` a valid manifest describes; the task is the directory's parent's name."""
    signals = manifest.get(C.KEY_SIGNALS) if isinstance(manifest.get(C.KEY_SIGNALS), dict) else {}
    gpu, frac = as_float(signals.get("gpu_mem_percent")), as_float(signals.get("device_mem_frac"))  # type: ignore
    loss, lineage = as_float(signals.get("loss")), manifest.get(C.KEY_LINEAGE)  # type: ignore[union-attr]
    return CheckpointInfo(
        task_id=path.parent.name, step=int(manifest[C.KEY_STEP]), path=str(path), reason=str(manifest.get(
            C.KEY_REASON, "")), tiers=tiers_of(manifest), bytes=int(manifest.get(C.KEY_BYTES, 0)),
        loss=loss if loss is None or loss == loss else None,  # NaN is no loss to rank by
        gpu_mem_percent=gpu if gpu is not None or frac is None else 100.0 * frac,
        save_time=float(manifest.get(C.KEY_CREATED_AT, 0.0)), recovery_cost_ms=as_float(manifest.get(
            C.KEY_RECOVERY_COST)), healthy=bool(manifest.get(C.KEY_HEALTHY, True)),
        pinned=bool(manifest.get(C.KEY_PINNED, False)) or is_kind(path / C.PINNED_MARKER, "file"), status=STATUS_OK,
        world_size=int(manifest.get(C.KEY_WORLD_SIZE, 1)), blobs=dict(manifest.get(C.KEY_BLOBS) or {}),
        lineage=Lineage.from_dict(lineage) if isinstance(lineage, dict) else None,
        frozen=dict(manifest.get(C.KEY_FROZEN) or {}))


def is_sharded(manifest: Mapping[str, Any]) -> bool:
    """Whether the manifest is a sharded checkpoint's (FSDP2, ZeRO; `shard_files.sharded_table` validates it)."""
    extra = manifest.get(C.KEY_EXTRA)
    return isinstance(extra, dict) and C.KEY_SHARDED in extra


def is_url(root: object) -> bool:
    """Whether a store root is a URL (``scheme://...``) rather than a local directory."""
    return isinstance(root, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", root) is not None

"""The manifest: the one file that makes a checkpoint directory a committed checkpoint.

It is written last, into the temporary directory, before the atomic rename. It lists every
file of the checkpoint with its size, checksum, tier and rank, and carries its own checksum
(`manifest_checksum`, over the canonical JSON of every other key) so a tampered or torn
manifest is refused instead of trusted. The file itself is indented JSON with only finite
numbers (non-finite floats become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``),
so ``jq`` reads it: ``jq '.debug_info[] | select(.loss > 3)' manifest.json``.

The checkpoint's other small JSON files (RNG, sampler, ``optimizer.json``, the ranks' done files)
are written and read here too (`write_json`, `read_json`), and so is the `CheckpointInfo` (the
catalog row) a manifest describes (`info_from_manifest`; `broken_info` for a directory whose
manifest cannot be trusted).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..constants import (
    CHECKPOINT_FILE_NAMES,
    CHECKSUM_ALGO,
    DEBUG_INFO_STEPS,
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
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from ..jsonutil import as_float, json_safe, loads_bounded
from .blobs import is_digest
from .catalog import STATUS_OK
from .fs import create, is_file, lstat, read_bytes
from .hashing import FileEntry, format_checksum, new_hasher
from .spec import Lineage
from .types import CheckpointInfo

__all__ = ["KEY_BYTES", "KEY_RECOVERY_COST", "KEY_SESSION_ID", "broken_info", "build_manifest", "info_from_manifest",
           "read_json", "read_manifest", "tiers_of", "validate_manifest", "with_changes", "without_tiers",
           "write_json", "write_manifest"]

_RNG_NAME_RE = re.compile(r"rng-rank(0|[1-9][0-9]{0,6})\.json")
_SHARD_NAME_RE = re.compile(r"(?:weights|optimizer)-rank(0|[1-9][0-9]{0,6})\.safetensors")  # FSDP2 (`shard_files`)

# Throughputs of the recovery-cost model (bytes per millisecond). Loading a file means
# checksumming it first (sha256, ~0.5-1 GB/s on one core), then mapping (L0) or
# decompressing + rebuilding the state (L1, zstd ~0.3-1 GB/s, plus per-tensor work).
_L0_BYTES_PER_MS = 500_000.0
_L1_BYTES_PER_MS = 200_000.0
_PER_FILE_MS = 2.0


def canonical_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The bytes the manifest checksum covers: sorted, compact JSON without the checksum key."""
    body = {k: v for k, v in manifest.items() if k != KEY_MANIFEST_CHECKSUM}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def compute_manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"<algo>:<hex>"`` of `canonical_bytes(manifest)`."""
    return f"{CHECKSUM_ALGO}:{hashlib.new(CHECKSUM_ALGO, canonical_bytes(manifest)).hexdigest()}"


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose objects a checkpoint holds, for the manifest."""
    return dict(_library_versions())


@functools.lru_cache(maxsize=1)
def _library_versions() -> dict[str, str]:
    from importlib import metadata

    from .._version import VERSION

    versions = {"hf_dynamic_ckpt": VERSION, "python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "peft", "safetensors", "zstandard", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def estimate_recovery_cost_ms(files: Mapping[str, Mapping[str, Any]], blobs: Mapping[str, Mapping[str, Any]]) -> float:
    """Estimated time to verify and load a checkpoint, from its bytes per tier.

    The estimate is ``bytes / throughput`` per tier plus a fixed cost per file, with fixed
    throughputs (L0: 500 MB/s, checksum + memory map; L1: 200 MB/s, checksum + zstd +
    rebuilding the state; L2: per-file cost only). It ranks checkpoints for
    ``resolve("fastest")``; it is not a measurement of this machine.

    Args:
        files (`Mapping[str, Mapping]`): the manifest's file entries.
        blobs (`Mapping[str, Mapping]`): the manifest's blob records (``"size"`` each; read as L0).

    Returns:
        `float`: milliseconds, rounded to 0.1.
    """
    cost = 0.0
    unique_blobs = {str(b.get("digest")): {KEY_SIZE: b.get("size", 0), KEY_TIER: Tier.WEIGHTS.value}
                    for b in blobs.values()}
    for entry in list(files.values()) + list(unique_blobs.values()):
        size = float(entry.get(KEY_SIZE, 0))
        tier = entry.get(KEY_TIER, Tier.WEIGHTS.value)
        cost += _PER_FILE_MS
        if tier == Tier.WEIGHTS.value:
            cost += size / _L0_BYTES_PER_MS
        elif tier == Tier.OPTIMIZER.value:
            cost += size / _L1_BYTES_PER_MS
    return round(cost, 1)


def build_manifest(
    *,
    task_id: str,
    step: int,
    epoch: float,
    reason: str,
    tiers: frozenset[Tier] | set[Tier],
    pinned: bool,
    healthy: bool,
    world_size: int,
    files: Mapping[str, Mapping[str, Any]],
    blobs: Mapping[str, Mapping[str, Any]],
    session_id: str,
    kind: str | None = None,
    lineage: Mapping[str, Any] | None = None,
    signals: Mapping[str, Any] | None = None,
    debug_info: Collection[Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
    timings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a manifest (with its checksum) from what the ranks wrote.

    Args:
        files (`Mapping[str, FileEntry]`): every file in the checkpoint directory.
        blobs (`Mapping[str, dict]`): weight key -> ``{"digest", "dtype", "shape", "size"}`` of
            deduplicated tensors (their files live in ``<task>/blobs/`` and are checked by digest).
        kind (`str`, *optional*): machine-readable reason (`DecisionKind` value).
        lineage (`Mapping`, *optional*): `Lineage.to_dict()` of the run that wrote it.
        debug_info (`Collection[dict]`, *optional*): per-step records; only the last
            `DEBUG_INFO_STEPS` are kept.

    Returns:
        `dict`: the manifest, `manifest_checksum` included.
    """
    manifest: dict[str, Any] = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_TASK_ID: task_id,
        KEY_STEP: int(step),
        KEY_EPOCH: float(epoch),
        KEY_REASON: reason,
        KEY_TIERS: sorted(t.value for t in tiers),
        KEY_PINNED: bool(pinned),
        KEY_HEALTHY: bool(healthy),
        KEY_WORLD_SIZE: int(world_size),
        KEY_CREATED_AT: time.time(),
        KEY_SESSION_ID: session_id,
        KEY_FILES: {name: dict(entry) for name, entry in sorted(files.items())},
        KEY_BLOBS: {key: dict(meta) for key, meta in sorted(blobs.items())},
        KEY_BYTES: int(sum(int(e[KEY_SIZE]) for e in files.values())),
        KEY_RECOVERY_COST: estimate_recovery_cost_ms(files, blobs),
        KEY_SIGNALS: dict(signals or {}),
        KEY_DEBUG_INFO: list(debug_info or [])[-DEBUG_INFO_STEPS:],
        KEY_EXTRA: dict(extra or {}),
        KEY_VERSIONS: library_versions(),
        KEY_TIMINGS: dict(timings or {}),
    }
    if kind is not None:
        manifest[KEY_KIND] = str(kind)
    if lineage is not None:
        manifest[KEY_LINEAGE] = dict(lineage)
    manifest = json_safe(manifest)
    manifest[KEY_MANIFEST_CHECKSUM] = compute_manifest_checksum(manifest)
    return manifest


def write_manifest(directory: Path, manifest: Mapping[str, Any], *, name: str = MANIFEST_NAME) -> Path:
    """Write `manifest` as ``directory/name`` and fsync it (the caller renames the directory)."""
    path = Path(directory) / name
    _write_synced(path, json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode() + b"\n")
    return path


def _write_synced(path: Path, data: bytes) -> None:
    with create(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any, *, tier: Tier, rank: int | None) -> FileEntry:
    """Write one of the checkpoint's small JSON files, fsync it, and return its manifest entry (checksum of the
    bytes written)."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"
    hasher = new_hasher()
    hasher.update(data)
    _write_synced(path, data)
    return {KEY_SIZE: len(data), KEY_CHECKSUM: format_checksum(hasher), KEY_TIER: tier.value, KEY_RANK: rank}


def read_json(path: Path) -> Any:
    """Parse a JSON file of a checkpoint (bounded size and depth); anything wrong -> `CorruptCheckpointError`."""
    try:
        return loads_bounded(read_bytes(path, limit=MAX_JSON_BYTES))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable or not JSON ({e}); the checkpoint is damaged.") from e


def allowed_file_name(name: Any, world_size: int) -> bool:
    """Whether a manifest may list `name`: a fixed allowlist plus ``rng-rank<R>.json`` for R < world size.

    Only single path components from this list ever become paths, so a manifest can never
    make the store read, stat or delete anything outside the checkpoint's own directory.
    """
    if not isinstance(name, str):
        return False
    if name in CHECKPOINT_FILE_NAMES:
        return True
    m = _RNG_NAME_RE.fullmatch(name) or _SHARD_NAME_RE.fullmatch(name)
    return m is not None and int(m.group(1)) < world_size


def _is_int(value: Any, *, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_shape(manifest: dict[str, Any], where: str) -> None:
    """Types of every key the store turns into paths, sizes or decisions."""
    for key, kind in ((KEY_STEP, int), (KEY_FILES, dict), (KEY_TIERS, list), (KEY_TASK_ID, str)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise CorruptCheckpointError(f"{where}: manifest key {key!r} is missing or not a {kind.__name__}.")
    world_size = manifest.get(KEY_WORLD_SIZE, 1)
    if not _is_int(manifest[KEY_STEP]) or not _is_int(world_size, low=1):
        raise CorruptCheckpointError(f"{where}: step={manifest[KEY_STEP]!r} / world_size={world_size!r} is invalid.")
    if not all(isinstance(t, str) for t in manifest[KEY_TIERS]):
        raise CorruptCheckpointError(f"{where}: manifest key 'tiers' must be a list of names.")
    for name, entry in manifest[KEY_FILES].items():
        if not allowed_file_name(name, world_size):
            raise CorruptCheckpointError(
                f"{where}: manifest lists file {str(name)[:80]!r}, which is not an allowed file name of a checkpoint "
                f"({', '.join(sorted(CHECKPOINT_FILE_NAMES))}, rng-rank<R>.json, weights-rank<R>.safetensors, "
                "optimizer-rank<R>.safetensors); the manifest is damaged or hostile."
            )
        if not (isinstance(entry, dict) and _is_int(entry.get(KEY_SIZE)) and isinstance(entry.get(KEY_CHECKSUM), str)):
            raise CorruptCheckpointError(f"{where}: manifest entry of file {name!r} lacks an integer size or a "
                                         "checksum.")
    blobs = manifest.get(KEY_BLOBS) or {}
    if not isinstance(blobs, dict):
        raise CorruptCheckpointError(f"{where}: manifest key 'blobs' is not an object.")
    for key, rec in blobs.items():
        if not (isinstance(rec, dict) and is_digest(rec.get("digest")) and isinstance(rec.get("dtype"), str)
                and isinstance(rec.get("shape"), list) and all(_is_int(d) for d in rec["shape"])
                and _is_int(rec.get("size", 0))):
            raise CorruptCheckpointError(
                f"{where}: blob record of weight {str(key)[:80]!r} is malformed (digest must be 64 hex digits, "
                "dtype a name, shape a list of sizes); the manifest is damaged or hostile."
            )
    lineage = manifest.get(KEY_LINEAGE)
    if lineage is not None and not (isinstance(lineage, dict) and isinstance(lineage.get("timeline"), str)
                                    and isinstance(lineage.get("session"), str)):
        raise CorruptCheckpointError(f"{where}: manifest key 'lineage' is malformed.")


def validate_manifest(manifest: Any, *, where: str) -> dict[str, Any]:
    """Check version, checksum and shape of a parsed manifest.

    Raises:
        `FormatVersionError`: written by a newer on-disk format than this library reads.
        `CorruptCheckpointError`: checksum mismatch, keys missing / of the wrong type, or a
            file name outside the allowlist.
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{where}: the manifest is not a JSON object; the checkpoint is damaged.")
    version = manifest.get(KEY_FORMAT_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: format_version={version} is newer than the version this library reads "
            f"({FORMAT_VERSION}); upgrade hf_dynamic_ckpt to load it."
        )
    recorded = manifest.get(KEY_MANIFEST_CHECKSUM)
    try:
        actual = compute_manifest_checksum(manifest)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the manifest cannot be re-encoded ({e}); the checkpoint is "
                                     "damaged.") from e
    if recorded != actual:
        raise CorruptCheckpointError(
            f"{where}: manifest checksum mismatch (recorded {recorded!r}, actual {actual!r}): the manifest was "
            "modified or damaged after the commit; restore from another checkpoint."
        )
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
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

    Returns:
        `dict`: the manifest.

    Raises:
        `CheckpointNotFoundError`: there is no manifest (not a committed checkpoint).
        `CorruptCheckpointError`: unreadable, not JSON, nested too deeply, checksum mismatch,
            a disallowed file name, or a step / task that differs from the directory's.
        `FormatVersionError`: written by a newer format version.
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = read_bytes(path, limit=MAX_JSON_BYTES)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a committed checkpoint (an interrupted save "
            "or another directory)."
        ) from e
    except IsADirectoryError as e:
        raise CorruptCheckpointError(f"{path}: is a directory, expected the manifest file.") from e
    except OSError as e:  # a link (UnsafePathError), EIO, EACCES
        raise CorruptCheckpointError(f"{path}: the manifest cannot be read ({e}).") from e
    try:
        manifest = loads_bounded(raw)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON ({e}); the checkpoint is damaged.") from e
    manifest = validate_manifest(manifest, where=str(path))
    if (step is not None and manifest[KEY_STEP] != step) or (task_id is not None and manifest[KEY_TASK_ID] != task_id):
        raise CorruptCheckpointError(
            f"{path}: the manifest says task {manifest[KEY_TASK_ID]!r} step {manifest[KEY_STEP]}, but it lives in "
            f"{task_id!r}/{STEP_DIR_PREFIX}{step}; the directory is the truth, so this checkpoint is refused (it was "
            "renamed or edited by hand)."
        )
    return manifest


def tiers_of(manifest: Mapping[str, Any]) -> frozenset[Tier]:
    """The manifest's tiers as `Tier` members (unknown names are ignored)."""
    known = {t.value: t for t in Tier}
    return frozenset(known[t] for t in manifest.get(KEY_TIERS, []) if t in known)


def without_tiers(manifest: Mapping[str, Any], tiers: Collection[Tier]) -> tuple[dict[str, Any], set[str]]:
    """A copy of `manifest` that no longer holds `tiers` (re-checksummed), and the file names dropped."""
    values = {Tier(t).value for t in tiers}
    drop = {n for n, e in manifest[KEY_FILES].items() if e.get(KEY_TIER) in values}
    files = {n: e for n, e in manifest[KEY_FILES].items() if n not in drop}
    blobs = {} if Tier.WEIGHTS.value in values else dict(manifest.get(KEY_BLOBS) or {})
    new = with_changes(manifest, {KEY_FILES: files, KEY_BLOBS: blobs,
                                  KEY_TIERS: sorted(set(manifest[KEY_TIERS]) - values),
                                  KEY_BYTES: sum(int(e[KEY_SIZE]) for e in files.values()),
                                  KEY_RECOVERY_COST: estimate_recovery_cost_ms(files, blobs)})
    return new, drop


def with_changes(manifest: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` with `changes` applied, re-checksummed (what `unpin` and tier deletion rewrite)."""
    new = {k: v for k, v in manifest.items() if k != KEY_MANIFEST_CHECKSUM}
    new.update(changes)
    new[KEY_MANIFEST_CHECKSUM] = compute_manifest_checksum(new)
    return new


def info_from_manifest(manifest: Mapping[str, Any], path: Path, *, status: str = STATUS_OK,
                       abandoned: bool = False) -> CheckpointInfo:
    """The `CheckpointInfo` (catalog row) a valid manifest describes; the task is the directory's name."""
    signals = manifest.get(KEY_SIGNALS) or {}
    signals = signals if isinstance(signals, dict) else {}
    gpu = as_float(signals.get("gpu_mem_percent"))
    if gpu is None and as_float(signals.get("device_mem_frac")) is not None:
        gpu = 100.0 * float(as_float(signals.get("device_mem_frac")) or 0.0)
    loss = as_float(signals.get("loss"))
    lineage = manifest.get(KEY_LINEAGE)
    return CheckpointInfo(
        task_id=path.parent.name,
        step=int(manifest[KEY_STEP]),
        path=str(path),
        reason=str(manifest.get(KEY_REASON, "")),
        tiers=tiers_of(manifest),
        bytes=int(manifest.get(KEY_BYTES, 0)),
        loss=loss if loss is None or loss == loss else None,  # NaN is no loss to rank by
        gpu_mem_percent=gpu,
        save_time=float(manifest.get(KEY_CREATED_AT, 0.0)),
        recovery_cost_ms=as_float(manifest.get(KEY_RECOVERY_COST)),
        healthy=bool(manifest.get(KEY_HEALTHY, True)),
        pinned=bool(manifest.get(KEY_PINNED, False)) or is_file(path / PINNED_MARKER),
        status=status,
        world_size=int(manifest.get(KEY_WORLD_SIZE, 1)),
        blobs=dict(manifest.get(KEY_BLOBS) or {}),
        abandoned=abandoned,
        lineage=Lineage.from_dict(lineage) if isinstance(lineage, dict) else None,
    )


def broken_info(task_id: str, step: int, path: Path, status: str) -> CheckpointInfo:
    """Catalog row of a directory whose manifest cannot be trusted."""
    st = lstat(path)
    return CheckpointInfo(task_id=task_id, step=step, path=str(path), reason="", tiers=frozenset(), bytes=0,
                          loss=None, gpu_mem_percent=None, save_time=st.st_mtime if st else 0.0, recovery_cost_ms=None,
                          healthy=False, pinned=is_file(path / PINNED_MARKER), status=status)

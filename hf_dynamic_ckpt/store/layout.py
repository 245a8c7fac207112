"""One committed checkpoint directory: its small JSON files, its catalog description, and
the checks of its files against the manifest (presence, size, checksum, blob digests).

These are the pieces `CheckpointStore` uses to verify before it loads; they never trust a
file whose size or checksum differs from the manifest entry, never follow a symbolic link,
and only touch names the manifest validation allowed (`manifest.allowed_file_name`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..constants import (
    KEY_BLOBS,
    KEY_CHECKSUM,
    KEY_CREATED_AT,
    KEY_FILES,
    KEY_HEALTHY,
    KEY_LINEAGE,
    KEY_PINNED,
    KEY_RANK,
    KEY_REASON,
    KEY_SIGNALS,
    KEY_SIZE,
    KEY_STEP,
    KEY_TIER,
    KEY_WORLD_SIZE,
    MAX_JSON_BYTES,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    PINNED_MARKER,
    RNG_NAME_TEMPLATE,
    SAMPLER_NAME,
    WEIGHTS_NAME,
    Tier,
)
from ..errors import CorruptCheckpointError
from ..jsonutil import as_float, loads_bounded
from . import fs
from . import manifest as mf
from .blobs import BlobStore
from .catalog import STATUS_OK
from .hashing import FileEntry, checksum_algo, file_checksum, new_hasher
from .spec import Lineage
from .types import CheckpointInfo, LoadedCheckpoint

L1_PARTS = ("optimizer", "scheduler", "scaler")
"""Keys of the L1 structure (`optimizer.json`): `flatten_state({part: state_dict, ...})`."""


def write_json(path: Path, obj: Any, *, tier: Tier, rank: int | None) -> FileEntry:
    """Write JSON, fsync, and return its manifest entry (checksum of the bytes written)."""
    import os

    data = json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"
    hasher = new_hasher()
    hasher.update(data)
    with fs.create(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {KEY_SIZE: len(data), KEY_CHECKSUM: f"{hasher.name}:{hasher.hexdigest()}", KEY_TIER: tier.value,
            KEY_RANK: rank}


def read_json(path: Path) -> Any:
    """Parse a JSON file of a checkpoint (bounded size and depth); anything wrong -> `CorruptCheckpointError`."""
    try:
        return loads_bounded(fs.read_bytes(path, limit=MAX_JSON_BYTES))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable or not JSON ({e}); the checkpoint is damaged.") from e


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
        tiers=mf.tiers_of(manifest),
        bytes=int(manifest.get(mf.KEY_BYTES, 0)),
        loss=loss if loss is None or loss == loss else None,  # NaN is no loss to rank by
        gpu_mem_percent=gpu,
        save_time=float(manifest.get(KEY_CREATED_AT, 0.0)),
        recovery_cost_ms=as_float(manifest.get(mf.KEY_RECOVERY_COST)),
        healthy=bool(manifest.get(KEY_HEALTHY, True)),
        pinned=bool(manifest.get(KEY_PINNED, False)) or fs.is_file(path / PINNED_MARKER),
        status=status,
        world_size=int(manifest.get(KEY_WORLD_SIZE, 1)),
        blobs=dict(manifest.get(KEY_BLOBS) or {}),
        abandoned=abandoned,
        lineage=Lineage.from_dict(lineage) if isinstance(lineage, dict) else None,
    )


def broken_info(task_id: str, step: int, path: Path, status: str) -> CheckpointInfo:
    """Catalog row of a directory whose manifest cannot be trusted."""
    st = fs.lstat(path)
    return CheckpointInfo(task_id=task_id, step=step, path=str(path), reason="", tiers=frozenset(), bytes=0,
                          loss=None, gpu_mem_percent=None, save_time=st.st_mtime if st else 0.0, recovery_cost_ms=None,
                          healthy=False, pinned=fs.is_file(path / PINNED_MARKER), status=status)


HASHED_ON_READ = frozenset({OPTIMIZER_NAME})
"""Files `read_tiers` verifies against their manifest checksum while it reads them (one pass, not two)."""


def file_problems(directory: Path, manifest: Mapping[str, Any], names: Iterable[str],
                  hashed_on_read: Collection[str] = ()) -> list[str]:
    """Problems of the listed files: missing, a link, wrong size, wrong checksum (empty when all are good).

    `hashed_on_read`: files whose checksum the caller verifies while it reads them
    (`read_tiers`: the optimizer tensors, hashed as they decode); only their presence and size
    are checked here.
    """
    problems = []
    files = manifest[KEY_FILES]
    for name in names:
        entry = files[name]
        path = directory / name
        rank = entry.get(KEY_RANK)
        where = f"{name} (tier {entry.get(KEY_TIER)}" + (f", rank {rank})" if rank is not None else ")")
        st = fs.lstat(path)
        if st is None:
            problems.append(f"{where}: file is missing")
            continue
        if not fs.is_file(path):
            problems.append(f"{where}: not a regular file (a symbolic link or directory is refused)")
            continue
        if st.st_size != entry[KEY_SIZE]:
            problems.append(f"{where}: size {st.st_size} bytes, manifest says {entry[KEY_SIZE]} (truncated or "
                            "overwritten)")
            continue
        if name in hashed_on_read:
            continue
        try:  # verify with the algorithm the entry was written with
            actual = file_checksum(path, algo=checksum_algo(entry[KEY_CHECKSUM]))
        except FileNotFoundError:
            problems.append(f"{where}: file is missing")
            continue
        except (ValueError, OSError) as e:
            problems.append(f"{where}: {e}")
            continue
        if actual != entry[KEY_CHECKSUM]:
            problems.append(f"{where}: checksum mismatch ({actual} != {entry[KEY_CHECKSUM]}), the file is corrupt")
    return problems


def blob_problems(blobs: BlobStore, records: Mapping[str, Mapping[str, Any]]) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for key, rec in sorted(records.items()):
        if rec.get("digest") in seen:
            continue
        seen.add(str(rec.get("digest")))
        problems.extend(f"{p} (weight {key!r}, tier weights)" for p in blobs.verify(rec))
    return problems


def structure_problems(manifest: Mapping[str, Any]) -> list[str]:
    """Files the manifest should list but does not (per tier and per rank)."""
    files = manifest[KEY_FILES]
    tiers = mf.tiers_of(manifest)
    problems = []
    if Tier.WEIGHTS in tiers and WEIGHTS_NAME not in files:
        problems.append(f"tier weights is recorded but {WEIGHTS_NAME} is not listed")
    if Tier.OPTIMIZER in tiers and OPTIMIZER_META_NAME not in files:
        problems.append(f"tier optimizer is recorded but {OPTIMIZER_META_NAME} is not listed")
    rng_ranks = {e.get(KEY_RANK) for n, e in files.items() if n.startswith("rng-rank")}
    if rng_ranks:
        for r in range(int(manifest.get(KEY_WORLD_SIZE, 1))):
            if r not in rng_ranks:
                problems.append(f"{RNG_NAME_TEMPLATE.format(rank=r)} (tier state, rank {r}): rank file is not listed")
    return problems


def files_for(manifest: Mapping[str, Any], wanted: set[Tier], rank: int, warnings: list[str], *,
              step: int) -> list[str]:
    names = []
    rng_name = RNG_NAME_TEMPLATE.format(rank=rank)
    for name, entry in sorted(manifest[KEY_FILES].items()):
        tier = entry.get(KEY_TIER)
        if tier not in {t.value for t in wanted}:
            continue
        if name.startswith("rng-rank") and name != rng_name:
            continue
        names.append(name)
    if Tier.STATE in wanted and rng_name not in names and any(n.startswith("rng-rank") for n in manifest[KEY_FILES]):
        warnings.append(
            f"step {step} has no RNG state for rank {rank} (saved with world_size={manifest.get(KEY_WORLD_SIZE)}); "
            "this rank's random streams start fresh"
        )
    return names


def read_tiers(directory: Path, manifest: Mapping[str, Any], wanted: set[Tier], names: list[str],
               loaded: LoadedCheckpoint, *, rank: int, mmap: bool, blobs: BlobStore,
               l1_max_numel: int | None = None) -> None:
    """Read the files `names` of the `wanted` tiers into `loaded`, verified by `file_problems` before (those of
    `HASHED_ON_READ`: their size before, their checksum as they are read).

    Raises:
        `CorruptCheckpointError`: any file that does not parse (whatever the parser's complaint) or
            fails its checksum.
        `IncompatibleStateError`: an L1 tensor declares more than `l1_max_numel` elements.
    """
    from .statetree import unflatten_state
    from .tensorpack import read_tensor_file
    from .weights import load_weights

    if Tier.WEIGHTS in wanted:
        from .shard_files import placeholders, sharded_table

        table = sharded_table(manifest)  # FSDP2: global shapes only; DCP reads the shards (state.sharded_load)
        loaded.weights = placeholders(table) if table is not None else load_weights(
            directory, manifest.get(KEY_BLOBS) or {}, blobs_dir=blobs, mmap=mmap)
    if Tier.OPTIMIZER in wanted:
        structure = read_json(directory / OPTIMIZER_META_NAME)
        if not isinstance(structure, dict):
            raise CorruptCheckpointError(f"{directory / OPTIMIZER_META_NAME} is not a JSON object.")
        tensors = read_tensor_file(directory / OPTIMIZER_NAME, copy=not mmap, max_numel=l1_max_numel,
                                   checksum=manifest[KEY_FILES][OPTIMIZER_NAME][KEY_CHECKSUM]) \
            if OPTIMIZER_NAME in names else {}
        state = unflatten_state(structure, tensors)
        loaded.optimizer, loaded.scheduler, loaded.scaler = (state.get(p) for p in L1_PARTS)
    if Tier.STATE in wanted:
        rng_name = RNG_NAME_TEMPLATE.format(rank=rank)
        if rng_name in names:
            loaded.rng = _object(directory / rng_name)
        if SAMPLER_NAME in names:
            loaded.sampler = _object(directory / SAMPLER_NAME)


def _object(path: Path) -> dict[str, Any]:
    value = read_json(path)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object; the checkpoint is damaged.")
    return value

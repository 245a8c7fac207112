"""Reading checkpoints back: `load`, `load_scheduler_only` and `verify` of a resolved checkpoint of a `Task`.

Nothing is handed out before it is verified: the manifest (its checksum, its step and task
against the directory, an allowlist of file names), every file's size and checksum, every
blob's content digest. A failed check or read is retried once, so a transient I/O error
does not cost a checkpoint; after that the checkpoint is marked ``"corrupt"`` in the
catalog and `CorruptCheckpointError` lets the caller fall back to another one.

The checks (`file_problems`, `blob_problems`, `structure_problems`) never trust a file whose
size or checksum differs from the manifest entry, never follow a symbolic link, and only touch
names the manifest validation allowed (`manifest.allowed_file_name`); `read_tiers` reads the
verified files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..constants import (
    ALL_TIERS,
    BLOBS_DIR,
    KEY_BLOBS,
    KEY_CHECKSUM,
    KEY_EXTRA,
    KEY_FILES,
    KEY_RANK,
    KEY_SIZE,
    KEY_TIER,
    KEY_WORLD_SIZE,
    L1_PARTS,
    MANIFEST_NAME,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    RNG_NAME_TEMPLATE,
    SAMPLER_NAME,
    WEIGHTS_NAME,
    Tier,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, DynamicCkptError
from . import manifest as mf
from .blobs import BlobStore
from .catalog import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK
from .fs import LocalFS, is_file, lstat
from .hashing import checksum_algo, file_checksum
from .safetensors_io import read_into
from .shard_files import is_sharded
from .task import Task, parse_step_dir
from .types import CheckpointInfo, LoadedCheckpoint

logger = logging.getLogger(__name__)


def _blobs_of(task: Task, directory: Path) -> BlobStore:
    if task.owns(directory) is not None:
        return task.blobs
    return BlobStore(directory.parent / BLOBS_DIR, LocalFS(directory.parent))


def _manifest(task: Task, info: CheckpointInfo) -> dict[str, Any]:
    directory = Path(info.path)
    remote = task.remote
    if remote is not None and task.owns(directory) is not None and task.fs.is_dir(directory):
        from .remote_sync import materialize

        try:  # files of a checkpoint saved elsewhere come into the cache before they are verified
            materialize(task, remote, info.step)
        except OSError as e:
            raise CorruptCheckpointError(f"step {info.step} could not be downloaded from {remote.spec.shown}: "
                                         f"{e}") from e
    try:
        if task.owns(directory) is not None:
            return task.read_manifest(info.step)
        return mf.read_manifest(directory, step=parse_step_dir(directory.name))
    except CheckpointNotFoundError:
        _set_status(task, info, STATUS_MISSING)
        raise
    except CorruptCheckpointError:
        _set_status(task, info, STATUS_CORRUPT)
        raise


def _set_status(task: Task, info: CheckpointInfo, status: str) -> None:
    if task.owns(info.path) is not None:
        task.set_status(info.step, status)


def load(task: Task, info: CheckpointInfo, *, tiers: Collection[Tier] = ALL_TIERS, rank: int,
         mmap: bool = True, l1_max_numel: int | None = None, weights_checksum: bool = True) -> LoadedCheckpoint:
    """Verify, then read the requested tiers of `info` (`CheckpointStore.load` documents the arguments)."""
    directory = Path(info.path)
    manifest = _manifest(task, info)
    wanted = {Tier(t) for t in tiers}
    held = mf.tiers_of(manifest)
    loaded = LoadedCheckpoint(info=info, manifest=manifest, extra=dict(manifest.get(KEY_EXTRA) or {}))
    for tier in sorted(wanted - held):
        saved = ", ".join(sorted(t.value for t in held)) or "none"
        loaded.warnings.append(f"step {info.step} has no {tier.value} tier (saved tiers: {saved})")
    wanted &= held
    names = files_for(manifest, wanted, rank, loaded.warnings, step=info.step)
    blobs = _blobs_of(task, directory)

    hashed = HASHED_ON_READ if weights_checksum else HASHED_ON_READ | {WEIGHTS_NAME}

    def problems() -> list[str]:
        found = file_problems(directory, manifest, names, hashed_on_read=hashed)
        if Tier.WEIGHTS in wanted and not is_sharded(manifest):  # a sharded one: weights-rank<R> files
            if WEIGHTS_NAME not in manifest[KEY_FILES]:
                found.append(f"tier weights is recorded but {WEIGHTS_NAME} is not listed")
            found += blob_problems(blobs, manifest.get("blobs") or {})
        return found

    for attempt in (1, 2):
        found = problems()
        if not found:
            try:
                read_tiers(directory, manifest, wanted, names, loaded, rank=rank, mmap=mmap, blobs=blobs,
                           l1_max_numel=l1_max_numel)
                return loaded
            except (CorruptCheckpointError, OSError) as e:
                found = [str(e)]
                _forget_tiers(loaded)  # the retry (or the caller's fallback) must not hold this attempt's tensors
        if attempt == 1:
            logger.debug("step %d: %s; reading it once more before giving up", info.step, "; ".join(found))
    _set_status(task, info, STATUS_CORRUPT)
    raise CorruptCheckpointError(
        f"checkpoint {directory} failed verification, nothing was loaded: " + "; ".join(p.rstrip(".") for p in found)
        + ". Restore another checkpoint (a resume falls back automatically)."
    )


def read_weights_into(task: Task, loaded: LoadedCheckpoint, targets: Mapping[str, Any], *, verify: bool,
                      on_write: Callable[[], None] | None = None) -> set[str]:
    """`CheckpointStore.read_weights_into`: with `verify`, a read that fails (a checksum mismatch, a short file) is
    tried once more, and a second failure records the checkpoint as corrupt, as `load` does."""
    path = Path(loaded.info.path) / WEIGHTS_NAME
    checksum = str(loaded.manifest[KEY_FILES][WEIGHTS_NAME][KEY_CHECKSUM]) if verify else None
    try:
        return read_into(path, targets, what="Weights", checksum=checksum, on_write=on_write)
    except CorruptCheckpointError as e:
        if not verify:
            raise
        logger.debug("step %d: %s; reading it once more before giving up", loaded.info.step, e)
    try:
        return read_into(path, targets, what="Weights", checksum=checksum, on_write=on_write)
    except CorruptCheckpointError as e:
        _set_status(task, loaded.info, STATUS_CORRUPT)
        raise CorruptCheckpointError(f"checkpoint {loaded.info.path} failed verification: {str(e).rstrip('.')}. "
                                     "Restore another checkpoint (a resume falls back automatically).") from None


def _forget_tiers(loaded: LoadedCheckpoint) -> None:
    """Drop whatever tiers a failed read already put into `loaded`."""
    loaded.weights = loaded.optimizer = loaded.scheduler = loaded.scaler = loaded.rng = loaded.sampler = None


def load_scheduler_only(task: Task, info: CheckpointInfo) -> dict[str, Any] | None:
    """The LR-scheduler state of `info` from its verified `optimizer.json`, or `None` (never raises for damage)."""
    from .statetree import unflatten_state

    try:
        directory = Path(info.path)
        manifest = _manifest(task, info)
        if OPTIMIZER_META_NAME not in manifest[KEY_FILES] or file_problems(directory, manifest, [OPTIMIZER_META_NAME]):
            return None
        structure = mf.read_json(directory / OPTIMIZER_META_NAME)
        sched = unflatten_state(structure.get("scheduler"), {}) if isinstance(structure, dict) else None
    except (DynamicCkptError, OSError):
        return None
    return sched if isinstance(sched, dict) else None


def verify(task: Task, info: CheckpointInfo) -> list[str]:
    """Every problem of `info` (manifest, files, blobs), recorded in the catalog (`CheckpointStore.verify`).

    Raises:
        `CheckpointNotFoundError`: the checkpoint was deleted before or while it was verified.
    """
    directory = Path(info.path)
    gone = CheckpointNotFoundError(f"step {info.step} ({directory}) was deleted before or while it was verified "
                                   "(retention or gc removed it); nothing to verify.")
    try:
        manifest = _manifest(task, info)
    except CheckpointNotFoundError as e:
        if task.fs.lstat(directory) is None:
            raise gone from e
        return [f"{MANIFEST_NAME}: missing ({e})"]
    except (CorruptCheckpointError, ValueError) as e:
        return [f"{MANIFEST_NAME}: {e}"]
    blobs = _blobs_of(task, directory)
    for attempt in (1, 2):
        found = structure_problems(manifest) + file_problems(directory, manifest, sorted(manifest[KEY_FILES]))
        found += blob_problems(blobs, manifest.get("blobs") or {})
        if found and task.fs.lstat(directory / MANIFEST_NAME) is None:
            _set_status(task, info, STATUS_MISSING)
            raise gone
        if not found or attempt == 2:
            break
    _set_status(task, info, STATUS_CORRUPT if found else STATUS_OK)
    return found


# ---------------------------------------------------------------------------------- checks and reads
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
        st = lstat(path)
        if st is None:
            problems.append(f"{where}: file is missing")
            continue
        if not is_file(path):
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
    if is_sharded(manifest):  # FSDP2 / ZeRO: the ranks' weights-rank<R> files (the chunk table names them)
        if Tier.WEIGHTS in tiers and not any(n.startswith("weights-rank") for n in files):
            problems.append("tier weights is recorded but no weights-rank<R>.safetensors file is listed")
    elif Tier.WEIGHTS in tiers and WEIGHTS_NAME not in files:
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
        structure = mf.read_json(directory / OPTIMIZER_META_NAME)
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
    value = mf.read_json(path)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object; the checkpoint is damaged.")
    return value

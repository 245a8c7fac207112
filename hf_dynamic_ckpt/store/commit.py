"""The whole commit of one save: temp dir -> rank files -> done files -> manifest -> rename -> catalog row.

Every rank writes its files into ``step-<N>.tmp-<session_id>/``, fsyncs them and the
directory, then publishes ``done-rank<R>.json`` (its manifest entries) atomically (write +
fsync + rename). Rank 0 polls for all ranks' done files, merges them, writes the manifest
last, fsyncs, and renames the directory to ``step-<N>`` (the commit point), then writes
the catalog row. No collective is involved, so this runs in background threads of every
rank.

A save whose step is already committed:

- by the same timeline (the request's lineage, else the same session): nothing is
  written; rank 0 returns the existing checkpoint ("already committed").
- by another timeline, another session, or an abandoned checkpoint: it is replaced. The
  old copy is renamed aside (``.replaced``), the new one renamed in, then the old one
  removed. A crash between the two renames leaves the aside copy and the complete temp
  copy; the next rank-0 open puts the aside copy back (`maintenance.remove_leftovers`), so
  every phase keeps one committed copy of the step.

Every rank takes this decision from the same files (the existing manifest and the
timelines record), so no rank waits for files another rank decided not to write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..constants import (
    KEY_RANK,
    KEY_RANK_CHUNKS,
    KEY_SESSION_ID,
    KEY_SHARDED,
    KEY_TIER,
    L1_PARTS,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    RANK_DONE_TEMPLATE,
    RNG_NAME_TEMPLATE,
    SAMPLER_NAME,
    SHARDED_FORMAT,
    Tier,
)
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    FormatVersionError,
    SaveError,
)
from ..jsonutil import json_safe
from . import manifest as mf
from .blobs import BlobStore
from .hashing import FileEntry, make_file_entry
from .shard_files import write_shards
from .spec import Codec, SaveRequest
from .task import Task
from .tensorpack import PaceMemory
from .timelines import key_of
from .types import CheckpointInfo, CheckpointState

logger = logging.getLogger(__name__)

_POLL_S = 0.02


def write_rank_files(state: CheckpointState, tmp: Path, *, rank: int, blobs_dir: BlobStore | Path, level: int,
                     threads: int, compression: Codec | str = Codec.ZSTD,
                     paced: bool = False,
                     pace: PaceMemory | None = None) -> tuple[dict[str, FileEntry], dict[str, Any]]:
    """Write this rank's share of a checkpoint (rank 0: L0, L1, sampler; every rank: its RNG).

    `paced`: L1 written no faster than the disk, slowly compressing parts raw while it waits (`write_tensor_file`;
    `pace`: what the store's previous paced write learnt).

    Returns:
        `tuple[dict, dict]`: file entries by name, and the blob records of deduplicated weights.
    """
    from .statetree import flatten_state
    from .tensorpack import write_tensor_file
    from .weights import save_weights

    files: dict[str, FileEntry] = {}
    blobs: dict[str, Any] = {}
    if rank == 0:
        if state.weights is not None:
            record = save_weights(state.weights, tmp, blobs_dir=blobs_dir, dedup_keys=state.dedup_keys)
            files.update(record.files)
            blobs.update(record.blobs)
        parts = {name: getattr(state, name) for name in L1_PARTS}
        if any(v is not None for v in parts.values()):
            structure, tensors = flatten_state(parts)
            entry = write_tensor_file(tensors, tmp / OPTIMIZER_NAME, level=level, threads=threads,
                                      compression=compression, paced=paced, pace=pace)
            files[OPTIMIZER_NAME] = {**entry, KEY_TIER: Tier.OPTIMIZER.value, KEY_RANK: None}
            files[OPTIMIZER_META_NAME] = mf.write_json(tmp / OPTIMIZER_META_NAME, structure, tier=Tier.OPTIMIZER,
                                                       rank=None)
        if state.sampler is not None:
            files[SAMPLER_NAME] = mf.write_json(tmp / SAMPLER_NAME, json_safe(state.sampler), tier=Tier.STATE,
                                                rank=None)
    if state.rng is not None:
        name = RNG_NAME_TEMPLATE.format(rank=rank)
        rng = state.rng.to_json() if hasattr(state.rng, "to_json") else state.rng  # a snapshot's raw capture
        files[name] = mf.write_json(tmp / name, rng, tier=Tier.STATE, rank=rank)
    return files, blobs


def write_done(task: Task, tmp: Path, *, files: Mapping[str, FileEntry], blobs: Mapping[str, Any],
               tiers: Iterable[Tier], sharded: Mapping[str, Any] | None = None) -> None:
    """Publish this rank's entries atomically (write + fsync + rename), after its files are durable.

    `sharded`: this rank's chunk table of a sharded (FSDP2) save (`shard_files`), merged by rank 0.
    """
    rank = task.spec.rank
    task.fs.fsync_dir(tmp)
    done = tmp / RANK_DONE_TEMPLATE.format(rank=rank)
    part = done.with_name(done.name + ".part")
    own_tiers = sorted(t.value for t in tiers) if rank == 0 else ([Tier.STATE.value] if files else [])
    record = {"rank": rank, "session_id": task.spec.session_id, "files": dict(files), "blobs": dict(blobs),
              "tiers": own_tiers}
    if sharded is not None:
        record["sharded"] = dict(sharded)
    mf.write_json(part, record, tier=Tier.STATE, rank=rank)
    task.fs.replace(part, done)
    task.fs.fsync_dir(tmp)


def wait_for_ranks(task: Task, tmp: Path, *, step: int,
                   cancel: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """Rank 0: poll until every rank's done file is there; return their contents by rank.

    Raises:
        `DistributedError`: some rank did not publish within `rank_timeout_s`, or
            `CheckpointStore.abort` was called (the message names the missing ranks; the
            temporary directory is removed, nothing is committed), or a done file belongs to
            another session or is malformed.
    """
    spec = task.spec
    deadline = time.monotonic() + spec.rank_timeout_s
    names = [tmp / RANK_DONE_TEMPLATE.format(rank=r) for r in range(spec.world_size)]
    fetch = None
    if task.remote is not None and spec.world_size > 1:
        from .remote_sync import REMOTE_POLL_S, fetch_done

        remote = task.remote
        def fetch(r: int) -> bool:
            return fetch_done(task, remote, tmp, r)
    poll = _POLL_S if fetch is None else REMOTE_POLL_S
    while True:
        present = [r for r, p in enumerate(names) if task.fs.is_file(p) or (fetch is not None and fetch(r))]
        if len(present) == spec.world_size:
            break
        if task.abort_reason is not None or (cancel is not None and cancel()):
            missing = sorted(set(range(spec.world_size)) - set(present))
            _discard(task, tmp)
            raise DistributedError(
                f"step {step}: gave up waiting for rank(s) {missing} of {spec.world_size}: "
                f"{task.abort_reason or 'the save was aborted'} "
                "(CheckpointStore.abort); nothing was committed and the previous checkpoint stays the restore point."
            )
        if time.monotonic() >= deadline:
            missing = sorted(set(range(spec.world_size)) - set(present))
            task.fs.rmtree(tmp)
            raise DistributedError(
                f"step {step}: rank(s) {missing} of {spec.world_size} did not finish writing within "
                f"{spec.rank_timeout_s:g} s (rank_timeout_s); nothing was committed and the previous checkpoint "
                "stays the restore point. Check those ranks' logs, or raise rank_timeout_s for slow storage."
            )
        time.sleep(poll)
    parts = []
    for r, done in enumerate(names):
        try:
            part = mf.read_json(done)
            ok = (isinstance(part, dict) and part.get("rank") == r and isinstance(part.get("files"), dict)
                  and isinstance(part.get("blobs"), dict) and isinstance(part.get("tiers"), list))
        except CorruptCheckpointError as e:
            part, ok = {"error": str(e)}, False
        if not ok:
            raise DistributedError(f"{done} is malformed ({str(part)[:120]}); nothing was committed.")
        if part.get("session_id") != spec.session_id:
            raise DistributedError(f"{done} belongs to session {part.get('session_id')!r}, not {spec.session_id!r}; "
                                   "every rank must use the session_id broadcast by rank 0.")
        parts.append(part)
    return parts


def merge_rank_parts(task: Task, tmp: Path, parts: list[dict[str, Any]]
                     ) -> tuple[dict[str, FileEntry], dict[str, Any], set[Tier], dict[str, Any]]:
    """Union of the ranks' entries, and the chunk tables of a sharded (FSDP2) save by rank (`shard_files`;
    empty for an unsharded one); removes the done files, which have served their purpose."""
    files: dict[str, FileEntry] = {}
    blobs: dict[str, Any] = {}
    tiers: set[Tier] = set()
    chunks: dict[str, Any] = {}
    for part in parts:
        files.update(part["files"])
        blobs.update(part["blobs"])
        tiers.update(Tier(t) for t in part["tiers"])
        if isinstance(part.get("sharded"), dict):
            chunks[str(part["rank"])] = part["sharded"]
        task.fs.unlink(tmp / RANK_DONE_TEMPLATE.format(rank=int(part["rank"])))
    return files, blobs, tiers, chunks


def existing(task: Task, request: SaveRequest, *, replace: bool) -> CheckpointInfo | bool | None:
    """What is committed at the request's step: `None` (nothing), the info to return ("already
    committed"), or `True` (replace it). The same answer on every rank (read from disk only)."""
    path = task.step_dir(request.step)
    if task.fs.lstat(path) is None:
        return None
    try:
        manifest = task.read_manifest(request.step)
    except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError):
        return True  # a directory without a (usable) manifest never blocks a save
    info = mf.info_from_manifest(manifest, path)
    if replace or key_of(info) in task.timelines.abandoned():
        return True
    if request.lineage is not None and info.lineage is not None:
        return True if info.lineage.timeline != request.lineage.timeline else info
    return True if manifest.get(KEY_SESSION_ID) != task.spec.session_id else info


def commit_save(task: Task, state: CheckpointState, request: SaveRequest, *, timings: Mapping[str, Any] | None,
                replace: bool = False, cancel: Callable[[], bool] | None = None) -> tuple[CheckpointInfo | None, bool]:
    """Run one save to its end on this rank (see the module docstring).

    Returns:
        `tuple[CheckpointInfo | None, bool]`: the committed (or already committed) info on
        rank 0, `None` on other ranks; and whether a committed copy was replaced (its blobs
        may now be unreferenced).

    Raises:
        `DistributedError`: rank 0 waited `rank_timeout_s` for other ranks; nothing is committed.
        `SaveError`: writing failed; the previous checkpoints are untouched.
    """
    spec, step, fs = task.spec, request.step, task.fs
    if task.remote is not None and spec.rank != 0:  # this rank's cache has not seen rank 0's recent commits
        from .remote_sync import refresh_step

        task.remote.invalidate()
        try:
            refresh_step(task, task.remote, step)
        except OSError as e:
            raise SaveError(f"saving step {step} on rank {spec.rank}: reading the bucket failed: {e}; nothing was "
                            "written and the previous checkpoints are untouched.") from e
    found = existing(task, request, replace=replace)
    if isinstance(found, CheckpointInfo):
        if spec.rank == 0:
            logger.debug("step %d is already committed at %s by this timeline; not rewritten", step, found.path)
            task.record(found)
        return (found if spec.rank == 0 else None), False
    if not fs.is_dir(task.dir):  # a new task, or a root deleted mid-run (`CheckpointStore.ensure_root`)
        task.root.mkdir(parents=True, exist_ok=True)
        fs.mkdir(task.dir)
        fs.fsync_dir(task.root)  # the task folder's own entry must survive a power loss too
    tmp = task.tmp_dir(step)
    t0 = time.perf_counter()
    try:
        fs.mkdir(tmp)
        if KEY_RANK_CHUNKS in state.extra:  # FSDP2: this rank's shards first, what is left as usual
            plain, shard_files, shards = write_shards(state, tmp, rank=spec.rank)
        else:
            plain, shard_files, shards = state, {}, None
        files, blobs = write_rank_files(plain, tmp, rank=spec.rank, blobs_dir=task.blobs, level=spec.compression_level,
                                        threads=spec.compression_threads, compression=spec.codec,
                                        paced=spec.pace_to_disk and task.remote is None, pace=task.l1_pace)
        files.update((name, make_file_entry(tmp / name, tier=tier.value, rank=spec.rank))
                     for name, tier in shard_files.items())
        write_done(task, tmp, files=files, blobs=blobs, tiers=state.tiers, sharded=shards)
        if task.remote is not None and spec.rank != 0:  # no shared directory: rank 0 reads the object store
            from .remote_sync import publish_rank

            publish_rank(task, task.remote, tmp, step, files)
    except Exception as e:
        if spec.rank == 0:
            _discard(task, tmp)
        if isinstance(e, SaveError):
            raise
        raise SaveError(f"saving step {step} of task {spec.task_id!r} to {tmp} failed on rank {spec.rank}: {e}; "
                        "the previous checkpoints are untouched.") from e
    if spec.rank != 0:
        return None, False
    t_written = time.perf_counter()
    parts = wait_for_ranks(task, tmp, step=step, cancel=cancel)
    timings = {**dict(timings or {}), "write_ms": round(1000 * (t_written - t0), 2),
               "wait_ranks_ms": round(1000 * (time.perf_counter() - t_written), 2)}
    try:
        return _commit(task, tmp, state, request, parts, timings)
    except OSError as e:
        _discard(task, tmp)
        raise SaveError(f"committing step {step} to {task.step_dir(step)} failed: {e}; the previous checkpoints "
                        "are untouched.") from e


def _discard(task: Task, tmp: Path) -> None:
    try:
        task.fs.rmtree(tmp)
    except OSError as e:  # a file in the way, a link: left for the next open's cleanup
        logger.warning("could not remove %s: %s", tmp, e)


def _commit(task: Task, tmp: Path, state: CheckpointState, request: SaveRequest, parts: list[dict[str, Any]],
            timings: dict[str, Any]) -> tuple[CheckpointInfo, bool]:
    fs, step = task.fs, request.step
    files, blobs, tiers, chunks = merge_rank_parts(task, tmp, parts)
    extra = {k: v for k, v in state.extra.items() if k != KEY_RANK_CHUNKS}
    if chunks:  # FSDP2: every rank's chunk table, read back by `shard_files.sharded_table`
        extra[KEY_SHARDED] = {"format": SHARDED_FORMAT, "world_size": task.spec.world_size, "ranks": chunks}
    t0 = time.perf_counter()
    manifest = mf.build_manifest(
        task_id=task.task_id, step=step, epoch=state.epoch, reason=request.reason, kind=request.kind, tiers=tiers,
        pinned=request.pinned, healthy=request.healthy, world_size=task.spec.world_size, files=files, blobs=blobs,
        session_id=task.spec.session_id, lineage=request.lineage.to_dict() if request.lineage else None,
        signals=request.signals, debug_info=request.debug_info,
        extra=extra, timings=timings,
    )
    mf.write_manifest(tmp, manifest)
    fs.fsync_dir(tmp)
    if task.remote is not None:  # the object store's commit point (manifest uploaded last) comes first
        from .remote_sync import fetch_rank_files, publish

        fetch_rank_files(task, task.remote, tmp, step, files)
        publish(task, task.remote, tmp, step, manifest)
    final = task.step_dir(step)
    aside = None
    if fs.lstat(final) is not None:  # another timeline's copy, or a directory without a manifest
        aside = task.aside_dir(step)
        fs.rename(final, aside)
        fs.fsync_dir(task.dir)
    fs.rename(tmp, final)  # the commit point
    fs.fsync_dir(task.dir)
    if aside is not None:
        _discard(task, aside)
    info = mf.info_from_manifest(manifest, final)
    task.record(info)
    logger.debug("committed %s step %d (%s; tiers %s; %d bytes; commit %.1f ms)", task.task_id, step, request.reason,
                ",".join(manifest["tiers"]), info.bytes, 1000 * (time.perf_counter() - t0))
    return info, aside is not None

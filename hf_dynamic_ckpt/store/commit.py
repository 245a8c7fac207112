"""The multi-rank commit protocol, rank side: write files, publish, meet in the temp dir.

Every rank writes its files into ``step-<N>.tmp-<session_id>/``, fsyncs them and the
directory, then publishes ``done-rank<R>.json`` (its manifest entries) atomically
(write + fsync + rename). Rank 0 polls for all ranks' done files and merges them; the
store then writes the manifest and renames the directory. No collective is involved, so
this runs in background threads of every rank.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..constants import (
    KEY_RANK,
    KEY_TIER,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    RANK_DONE_TEMPLATE,
    RNG_NAME_TEMPLATE,
    SAMPLER_NAME,
    Tier,
)
from ..errors import DistributedError
from ..jsonutil import json_safe
from .checksum import FileEntry, fsync_dir
from .layout import L1_PARTS, read_json, write_json
from .types import CheckpointState

_POLL_S = 0.02


def write_rank_files(state: CheckpointState, tmp: Path, *, rank: int, blobs_dir: Path, level: int,
                     threads: int, compression: str = "zstd") -> tuple[dict[str, FileEntry], dict[str, Any]]:
    """Write this rank's share of a checkpoint (rank 0: L0, L1, sampler; every rank: its RNG).

    Returns:
        `tuple[dict, dict]`: file entries by name, and the blob records of deduplicated weights.
    """
    from .tensorpack import flatten_state, write_tensor_file
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
                                      compression=compression)
            files[OPTIMIZER_NAME] = {**entry, KEY_TIER: Tier.OPTIMIZER.value, KEY_RANK: None}
            files[OPTIMIZER_META_NAME] = write_json(tmp / OPTIMIZER_META_NAME, structure, tier=Tier.OPTIMIZER, rank=None)
        if state.sampler is not None:
            files[SAMPLER_NAME] = write_json(tmp / SAMPLER_NAME, json_safe(state.sampler), tier=Tier.STATE, rank=None)
    if state.rng is not None:
        name = RNG_NAME_TEMPLATE.format(rank=rank)
        files[name] = write_json(tmp / name, state.rng, tier=Tier.STATE, rank=rank)
    return files, blobs


def write_done(tmp: Path, *, rank: int, session_id: str, files: Mapping[str, FileEntry], blobs: Mapping[str, Any],
               tiers: Iterable[Tier]) -> None:
    """Publish this rank's entries atomically (write + fsync + rename), after its files are durable."""
    fsync_dir(tmp)
    done = tmp / RANK_DONE_TEMPLATE.format(rank=rank)
    part = done.with_name(done.name + ".part")
    own_tiers = sorted(t.value for t in tiers) if rank == 0 else ([Tier.STATE.value] if files else [])
    write_json(part, {"rank": rank, "session_id": session_id, "files": dict(files), "blobs": dict(blobs),
                      "tiers": own_tiers}, tier=Tier.STATE, rank=rank)
    os.replace(part, done)
    fsync_dir(tmp)


def wait_for_ranks(tmp: Path, *, step: int, world_size: int, session_id: str, timeout_s: float) -> list[dict[str, Any]]:
    """Rank 0: poll until every rank's done file is there; return their contents by rank.

    Raises:
        `DistributedError`: some rank did not publish within `timeout_s` (the message names
            them; the temporary directory is removed, nothing is committed), or a done file
            belongs to another session.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        present = [r for r in range(world_size) if (tmp / RANK_DONE_TEMPLATE.format(rank=r)).exists()]
        if len(present) == world_size:
            break
        if time.monotonic() >= deadline:
            missing = sorted(set(range(world_size)) - set(present))
            shutil.rmtree(tmp, ignore_errors=True)
            raise DistributedError(
                f"step {step}: rank(s) {missing} of {world_size} did not finish writing within "
                f"{timeout_s:g} s (rank_timeout_s); nothing was committed and the previous checkpoint "
                "stays the restore point. Check those ranks' logs, or raise rank_timeout_s for slow storage."
            )
        time.sleep(_POLL_S)
    parts = []
    for r in range(world_size):
        done = tmp / RANK_DONE_TEMPLATE.format(rank=r)
        part = read_json(done)
        if part.get("session_id") != session_id:
            raise DistributedError(f"{done} belongs to session {part.get('session_id')!r}, not {session_id!r}; "
                                   "every rank must use the session_id broadcast by rank 0.")
        parts.append(part)
    return parts


def merge_rank_parts(tmp: Path, parts: list[dict[str, Any]]) -> tuple[dict[str, FileEntry], dict[str, Any], set[Tier]]:
    """Union of the ranks' entries; removes the done files, which have served their purpose."""
    files: dict[str, FileEntry] = {}
    blobs: dict[str, Any] = {}
    tiers: set[Tier] = set()
    for part in parts:
        files.update(part["files"])
        blobs.update(part["blobs"])
        tiers.update(Tier(t) for t in part["tiers"])
        (tmp / RANK_DONE_TEMPLATE.format(rank=int(part["rank"]))).unlink(missing_ok=True)
    return files, blobs, tiers

"""Every file name, manifest key and format number of the on-disk layout, in one place; the library's version."""

from __future__ import annotations

import enum

VERSION = "0.2.0"
"""The library's version: `hf_dynamic_ckpt.__version__`, recorded in every manifest and export; setup.cfg reads it."""

FORMAT_VERSION = 2
"""Newest on-disk format version this library reads and writes (in every manifest; readers refuse newer ones). A
manifest that records frozen weights by checksum (`KEY_FROZEN`) is version 2; any other is still written as 1."""

# Store layout: <root>/<task_id>/step-<N>/...
CATALOG_NAME = "catalog.db"
BLOBS_DIR = "blobs"
STEP_DIR_PREFIX = "step-"
TMP_MARKER = ".tmp-"
PINNED_MARKER = "PINNED"
DEFAULT_TASK_ID = "default"

# Files of one checkpoint.
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.safetensors"
OPTIMIZER_NAME = "optimizer.tensors.zst"
OPTIMIZER_META_NAME = "optimizer.json"
L1_PARTS = ("optimizer", "scheduler", "scaler")
"""Keys of the L1 structure (`optimizer.json`): `flatten_state({part: state_dict, ...})`."""
RNG_NAME_TEMPLATE = "rng-rank{rank}.json"
SAMPLER_NAME = "sampler.json"
RANK_DONE_TEMPLATE = "done-rank{rank}.json"

# L0 names of a PEFT model with several adapters: "<adapter>::<PEFT key>" (one adapter: PEFT's keys).
ADAPTER_KEY_SEP = "::"

# Per-task files next to the step directories (written by rank 0 of the checkpointer).
TIMELINE_NAME = "timeline.jsonl"  # one JSON line per optimizer step (signals, risk, saves) + events
RESUME_DIR = ".resume"  # under the store root: Trainer-style folders materialised for a resume

# The Trainer resume folder (what `Trainer.train(resume_from_checkpoint=...)` reads) and the
# manifest `extra` key of the saved `TrainerState`.
TRAINER_STATE_NAME = "trainer_state.json"
TRAINER_WEIGHTS_NAME = "model.safetensors"
TRAINER_ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
KEY_TRAINER_STATE = "trainer_state"
KEY_RNG_AT = "rng_at"
"""Key of a checkpoint's data position (L2 sampler state) saying when its RNG was taken: `RNG_AT_STEP_BEGIN`, or
absent: at the end of its step."""
RNG_AT_STEP_BEGIN = "step_begin"
"""The RNG of a save is the one the next step starts from, taken once that step's batches were fetched."""

# Manifest keys.
KEY_FORMAT_VERSION = "format_version"
KEY_TASK_ID = "task_id"
KEY_STEP = "step"
KEY_EPOCH = "epoch"
KEY_REASON = "reason"
KEY_TIERS = "tiers"
KEY_PINNED = "pinned"
KEY_HEALTHY = "healthy"
KEY_WORLD_SIZE = "world_size"
KEY_CREATED_AT = "created_at"
KEY_FILES = "files"
KEY_BLOBS = "blobs"  # checkpoints of earlier versions: frozen weights stored once per task, content-addressed
KEY_FROZEN = "frozen"  # weights not written: {key: {"checksum", "dtype", "shape"}}, checked against the model
KEY_SIGNALS = "signals"
KEY_DEBUG_INFO = "debug_info"
KEY_EXTRA = "extra"
KEY_VERSIONS = "versions"
KEY_TIMINGS = "timings_ms"
KEY_MANIFEST_CHECKSUM = "manifest_checksum"
KEY_SIZE = "size"
KEY_CHECKSUM = "checksum"
KEY_TIER = "tier"
KEY_RANK = "rank"

CHECKSUM_ALGO = "sha256"
DEBUG_INFO_STEPS = 10


class Tier(enum.StrEnum):
    """What a checkpoint holds, by level of the article's tiered scheme: one concept, spelled `Tier.WEIGHTS` /
    `OPTIMIZER` / `STATE` in code, L0 / L1 / L2 in the docs and logs, ``storage_levels.level_0/1/2`` in the
    config (the article's keys)."""

    WEIGHTS = "weights"  # L0: trainable weights, safetensors, mmap-able, must be exact
    OPTIMIZER = "optimizer"  # L1: optimizer + scheduler + AMP scaler, zstd, no pickle
    STATE = "state"  # L2: RNG per rank, sampler position, step/epoch, metadata (JSON)


ALL_TIERS: frozenset[Tier] = frozenset(Tier)

# -- store area: timelines, locks, containment -----------------------------------------
TIMELINES_NAME = "timelines.json"  # per task: current timeline + abandoned checkpoints (one atomic record)
REMOVED_LOG_NAME = "removed.jsonl"  # per task: one line per checkpoint (or tiers) retention removed, with its rule
WRITER_LOCK_NAME = ".writer.lock"  # per task: POSIX record lock + holder (pid, host, session, since) of the one writer
ASIDE_SUFFIX = ".replaced"  # step-<N>.tmp-<sid>.replaced: committed copy set aside during a replace-commit
TRASH_INFIX = ".deleted-"  # step-<N>.tmp-<sid>.deleted-<rand>: a checkpoint being deleted
KEY_LINEAGE = "lineage"
KEY_KIND = "kind"
KEY_SESSION_ID = "session_id"
KEY_BYTES = "bytes"
KEY_RECOVERY_COST = "recovery_cost_ms"
MAX_JSON_BYTES = 64 << 20
"""Largest JSON file of a checkpoint the store parses (manifest, optimizer.json, L2); bigger is corrupt."""
CHECKPOINT_FILE_NAMES = frozenset({WEIGHTS_NAME, OPTIMIZER_NAME, OPTIMIZER_META_NAME, SAMPLER_NAME})
"""File names a manifest may list besides `RNG_NAME_TEMPLATE` names (the containment allowlist)."""

# -- fsdp area: sharded (FSDP2) tiers ---------------------------------------------------
KEY_SHARDED = "sharded"
"""Manifest `extra` key of a sharded checkpoint's chunk tables (`{"format", "world_size", "ranks"}`)."""
KEY_RANK_CHUNKS = "sharded_chunks"
"""Per-rank `extra` key of this rank's chunk table (taken out by the writer, merged by rank 0)."""
SHARDED_FORMAT = "hf_dynamic_ckpt.dcp-chunks/1"
SHARD_PART_WEIGHTS = "weights"
SHARD_PART_OPTIMIZER = "optimizer"
SHARD_FILE_TEMPLATE = "{part}-rank{rank}.safetensors"  # weights-rank<R> / optimizer-rank<R>
SHARD_OPTIMIZER_KEY = "state.{fqn}.{name}"
"""Key of one optimizer-state tensor: DCP's flattened name of `optim_state_dict["state"][fqn][name]`."""

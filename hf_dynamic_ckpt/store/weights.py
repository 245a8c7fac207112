"""Level 0: trainable weights as safetensors (uncompressed, memory-mappable, exact).

`weights.safetensors` is written by `safetensors_io.write_safetensors`, which produces
the same bytes as `safetensors.torch.save_file` (metadata `{"format": "pt"}`), so a LoRA
checkpoint's file is a drop-in `adapter_model.safetensors`; any safetensors reader reads
it. Reading validates the header fully and returns zero-copy views of a private memory
map (as fast as the package's `safe_open`: `safetensors_io`), with no code execution.

Two things safetensors cannot express on its own are handled here:

- Shared storage (tied weights, e.g. Qwen2 `embed_tokens.weight` / `lm_head.weight`):
  the tensor is stored once under its first key; the other keys are recorded in the
  header's `__metadata__` (`ALIASES_METADATA_KEY`) and point at the same tensor on load.
- Deduplication: tensors that did not change between checkpoints (frozen base weights)
  are stored content-addressed in the task's `BlobStore`, written once; the manifest
  records `{key: {"digest", "dtype", "shape", "size"}}`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..constants import WEIGHTS_NAME, Tier
from ..errors import CorruptCheckpointError, SaveError
from ..jsonutil import loads_bounded
from .blobs import BlobStore, tensor_digest
from .hashing import FileEntry, make_file_entry
from .safetensors_io import check_tensor, dtype_name, open_tensors, write_safetensors
from .types import BlobRef

logger = logging.getLogger(__name__)

__all__ = ["ALIASES_METADATA_KEY", "WeightsRecord", "load_weights", "save_weights"]

ALIASES_METADATA_KEY = "hf_dynamic_ckpt.aliases"
"""`__metadata__` entry holding `{alias_key: stored_key}` as a JSON string."""

_BASE_METADATA = {"format": "pt"}  # what transformers / PEFT write; keeps files interchangeable

BlobsArg = BlobStore | str | os.PathLike[str] | None


@dataclass
class WeightsRecord:
    """What `save_weights` wrote, for the manifest.

    Args:
        files (`dict[str, FileEntry]`): file name (relative to the checkpoint directory) ->
            size, checksum, tier, rank.
        blobs (`dict[str, dict]`): weight key -> `{"digest", "dtype", "shape", "size"}` for
            tensors stored content-addressed in the blob store.
        digests (`dict[str, BlobRef]`): weight key -> `BlobRef`, for every deduplicated key;
            pass these instead of the tensors next time the tensors are unchanged.
    """

    files: dict[str, FileEntry] = field(default_factory=dict)
    blobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    digests: dict[str, BlobRef] = field(default_factory=dict)


def _blob_store(blobs: BlobsArg) -> BlobStore | None:
    return blobs if isinstance(blobs, BlobStore) or blobs is None else BlobStore(Path(blobs))


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def save_weights(tensors: Mapping[str, torch.Tensor | BlobRef], directory: Path, *,
                 blobs_dir: BlobsArg, dedup_keys: Collection[str] = ()) -> WeightsRecord:
    """Writes the L0 tier: `directory/WEIGHTS_NAME` plus content-addressed blobs.

    Args:
        tensors (`Mapping[str, torch.Tensor | BlobRef]`): weights with their model key names
            (PEFT key names for an adapter). Non-contiguous tensors are made contiguous;
            tensors that alias the same storage (tied weights) are stored once.
        directory (`Path`): the checkpoint's (temporary) directory; must exist.
        blobs_dir (`BlobStore`, `str` or `os.PathLike`, *optional*): the task's blob store
            (or its directory). Required when `dedup_keys` or a `BlobRef` is given.
        dedup_keys (`Collection[str]`, *optional*, defaults to `()`): keys stored
            content-addressed in the blob store (written only if not there yet) instead of
            in the weights file.

    Returns:
        `WeightsRecord`: the file entry of `WEIGHTS_NAME`, the blob records and the
        `BlobRef`s of the deduplicated keys.

    Raises:
        `SaveError`: a value is not a tensor/BlobRef, has an unsupported dtype or layout,
        a `BlobRef` names a blob that does not exist, or `blobs_dir` is missing.

    Example:
    ```python
    >>> rec = save_weights(model.state_dict(), tmp_dir, blobs_dir=None)  # doctest: +SKIP
    >>> load_weights(tmp_dir, rec.blobs, blobs_dir=blobs)  # doctest: +SKIP
    ```
    """
    directory = Path(directory)
    blobs = _blob_store(blobs_dir)
    dedup = set(dedup_keys)
    unknown = dedup - set(tensors)
    if unknown:
        logger.debug("dedup_keys not among the weights, ignored: %s", sorted(unknown)[:5])
    needs_blobs = bool(dedup & set(tensors)) or any(isinstance(v, BlobRef) for v in tensors.values())
    if needs_blobs and blobs is None:
        raise SaveError("save_weights got dedup_keys or BlobRef values but blobs_dir=None; pass the task's blobs "
                        "directory.")

    record = WeightsRecord()
    in_file: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise SaveError(f"Weight key {key!r} is a {type(key).__name__}; safetensors keys must be str.")
        if isinstance(value, BlobRef):
            assert blobs is not None
            size = blobs.size(value.digest) if blobs.exists(value.digest) else None
            if size is None:
                raise SaveError(
                    f"Weight {key!r} was passed as BlobRef({value.digest[:12]}...) but {blobs.path(value.digest)} "
                    "does not exist; pass the tensor itself so it can be stored."
                )
            record.blobs[key] = {"digest": value.digest, "dtype": value.dtype, "shape": list(value.shape), "size": size}
            record.digests[key] = value
            continue
        t = check_tensor(key, value)
        ident = _alias_key(value)  # before any move to CPU, which would break the sharing
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        if key in dedup:
            assert blobs is not None
            t = t.contiguous()
            digest = tensor_digest(t)
            size = blobs.write(digest, t)
            ref = BlobRef(digest=digest, dtype=dtype_name(t.dtype), shape=tuple(t.shape))
            record.blobs[key] = {"digest": digest, "dtype": ref.dtype, "shape": list(ref.shape), "size": size}
            record.digests[key] = ref
        else:
            in_file[key] = t

    metadata = dict(_BASE_METADATA)
    if aliases:
        metadata[ALIASES_METADATA_KEY] = json.dumps(aliases, sort_keys=True)
    path = directory / WEIGHTS_NAME
    checksum = write_safetensors(in_file, path, metadata)
    record.files[WEIGHTS_NAME] = make_file_entry(path, tier=Tier.WEIGHTS.value, rank=None, checksum=checksum)
    logger.debug("L0: %d tensors in %s, %d blobs, %d aliases", len(in_file), path, len(record.blobs), len(aliases))
    return record


def load_weights(directory: Path, blobs: Mapping[str, Mapping[str, Any]], *, blobs_dir: BlobsArg,
                 mmap: bool = True) -> dict[str, torch.Tensor]:
    """Reads the L0 tier written by `save_weights`.

    Args:
        directory (`Path`): the checkpoint directory holding `WEIGHTS_NAME`.
        blobs (`Mapping[str, dict]`): `WeightsRecord.blobs` from the manifest.
        blobs_dir (`BlobStore`, `str` or `os.PathLike`): the task's blob store (or its directory).
        mmap (`bool`, *optional*, defaults to `True`): return tensors backed by a read-only
            memory map of the files (fast, lazy); `False` reads them into process memory.

    Returns:
        `dict[str, torch.Tensor]`: every key that was saved, aliases pointing at the same
        tensor object as their stored key.

    Raises:
        `CorruptCheckpointError`: a file or blob is missing or unreadable, a blob's dtype or
        shape differs from the record, or the alias map is inconsistent.
    """
    path = Path(directory) / WEIGHTS_NAME
    store = _blob_store(blobs_dir) or BlobStore(Path(directory).parent / "blobs")
    out, metadata = open_tensors(path, mmap=mmap, what="Weights")
    for key, rec in blobs.items():
        digest = str(rec.get("digest", ""))
        bpath = store.path(digest)
        if not store.exists(digest):
            raise CorruptCheckpointError(
                f"Weight {key!r} is stored in blob {bpath}, which is missing; the blob store of this "
                "task was pruned or damaged, restore from a checkpoint that does not reference it."
            )
        t = store.open(digest, mmap=mmap, what=f"Blob of weight {key!r}")
        if t is None or dtype_name(t.dtype) != rec.get("dtype") or list(t.shape) != list(rec.get("shape", [])):
            got = None if t is None else f"{dtype_name(t.dtype)}{list(t.shape)}"
            raise CorruptCheckpointError(
                f"Blob {bpath} of weight {key!r} holds {got}, but the manifest records "
                f"{rec.get('dtype')}{list(rec.get('shape', []))}; the blob is corrupt."
            )
        if key in out:
            raise CorruptCheckpointError(f"Weight {key!r} is both in {path} and in blob {bpath}; the manifest is "
                                         "inconsistent.")
        out[key] = t
    raw_aliases = metadata.get(ALIASES_METADATA_KEY)
    if raw_aliases:
        try:
            aliases = loads_bounded(raw_aliases)
        except ValueError as e:
            raise CorruptCheckpointError(f"Alias map in {path} is not JSON: {raw_aliases[:80]!r}.") from e
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            raise CorruptCheckpointError(f"Alias map in {path} is not a JSON object of key names: "
                                         f"{raw_aliases[:80]!r}.")

        for alias, target in aliases.items():
            if target not in out:
                raise CorruptCheckpointError(
                    f"Weight {alias!r} aliases {target!r}, which is not stored in {path} or its blobs."
                )
            out[alias] = out[target]
    return out

"""Sharded tiers on disk (FSDP2): one safetensors file per rank and tier, chunk tables in the manifest.

Layout of a sharded checkpoint ``step-<N>/`` (every name is in the manifest's file table with
its size, checksum, tier and rank; the manifest is written last, by rank 0, as for any save):

- ``weights-rank<R>.safetensors``: rank R's local shards of L0 (keys: parameter FQNs);
- ``optimizer-rank<R>.safetensors``: rank R's local shards of the optimizer state (keys:
  ``state.<fqn>.<name>``, DCP's flattened names);
- ``optimizer.tensors.zst`` / ``optimizer.json`` (rank 0): the optimizer's ``param_groups``
  (FQNs, hyper-parameters), the scheduler and the scaler, as in an unsharded checkpoint;
- ``rng-rank<R>.json``, ``sampler.json``: L2 as usual.

The manifest's ``extra["sharded"]`` is ``{"format", "world_size", "ranks": {"<R>": {"weights":
{key: chunk}, "optimizer": {key: chunk}}}}`` with ``chunk = {"shape": global shape, "offset",
"size", "dtype", "file"}``: DCP's metadata, in JSON. No pickle is written or read: DCP's own
``FileSystemWriter`` pickles its ``.metadata``, so this module gives DCP a `StorageReader` built
from the JSON table, and DCP's `DefaultLoadPlanner` maps the saved chunks onto the live
DTensors of any world size (resharding).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..constants import (
    KEY_RANK_CHUNKS,
    KEY_SHARDED,
    SHARD_FILE_TEMPLATE,
    SHARD_OPTIMIZER_KEY,
    SHARD_PART_OPTIMIZER,
    SHARD_PART_WEIGHTS,
    SHARDED_FORMAT,
    Tier,
)
from ..errors import CorruptCheckpointError
from .manifest import CheckpointState, file_checksum, open_read

PART_WEIGHTS, PART_OPTIMIZER = SHARD_PART_WEIGHTS, SHARD_PART_OPTIMIZER
SHARD_NAME_RE = re.compile(r"(weights|optimizer)-rank(0|[1-9][0-9]{0,6})\.safetensors")
"""Shard file names a manifest may list (rank < world size), besides the fixed allowlist."""
_TIER = {PART_WEIGHTS: Tier.WEIGHTS, PART_OPTIMIZER: Tier.OPTIMIZER}


def allowed_shard_name(name: str, world_size: int) -> bool:
    m = SHARD_NAME_RE.fullmatch(name)
    return m is not None and int(m.group(2)) < world_size


# ---------------------------------------------------------------------------------- write
def flatten_optimizer(optimizer: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a sharded optimizer state dict into its tensors (flat keys, `SHARD_OPTIMIZER_KEY`) and the rest."""
    tensors: dict[str, torch.Tensor] = {}
    for fqn, per in (optimizer.get("state") or {}).items():
        for name, value in per.items():
            tensors[SHARD_OPTIMIZER_KEY.format(fqn=fqn, name=name)] = value
    rest = {k: v for k, v in optimizer.items() if k != "state"}
    return tensors, rest


def write_shards(state: CheckpointState, tmp: Path, *, rank: int
                 ) -> tuple[CheckpointState, dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Write this rank's shard files of a sharded state; return what is left to write as usual.

    Returns:
        `tuple`: the state without its sharded tensors (rank 0 keeps the optimizer's
        `param_groups`, the scheduler and the scaler), the shard files' manifest entries, and
        this rank's chunk table for the commit (`None` for an unsharded state).
    """
    table = state.extra.get(KEY_RANK_CHUNKS)
    if not isinstance(table, dict):
        return state, {}, None
    extra = {k: v for k, v in state.extra.items() if k != KEY_RANK_CHUNKS}
    files: dict[str, dict[str, Any]] = {}
    part: dict[str, Any] = {PART_WEIGHTS: {}, PART_OPTIMIZER: {}}
    rest_optimizer = None
    sources: list[tuple[str, Mapping[str, Any]]] = []  # (part, tensors)
    if state.weights is not None:
        sources.append((PART_WEIGHTS, state.weights))
    if state.optimizer is not None:
        flat, rest_optimizer = flatten_optimizer(state.optimizer)
        sources.append((PART_OPTIMIZER, flat))
    for kind, tensors in sources:
        from safetensors.torch import save_file

        name = SHARD_FILE_TEMPLATE.format(part=kind, rank=rank)
        checked = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        missing = sorted(set(checked) - set(table.get(kind, {})))
        if missing:
            raise CorruptCheckpointError(f"rank {rank}: no chunk recorded for {kind} tensor(s) {missing[:5]}.")
        save_file(checked, tmp / name, {"format": "pt"})
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        files[name] = {"size": (tmp / name).stat().st_size, "checksum": file_checksum(tmp / name),
                       "tier": _TIER[kind].value, "rank": rank}
        part[kind] = {k: {**table[kind][k], "file": name} for k in checked}
    rest = dataclasses.replace(state, weights=None, optimizer=rest_optimizer if rank == 0 else None, extra=extra)
    return rest, files, part


# ---------------------------------------------------------------------------------- read
def sharded_table(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chunk tables of a sharded checkpoint, or `None` for an unsharded one.

    Raises:
        `CorruptCheckpointError`: the table is malformed or names a file that is not a shard.
    """
    extra = manifest.get("extra") or {}
    table = extra.get(KEY_SHARDED) if isinstance(extra, dict) else None
    if table is None:
        return None
    world = manifest.get("world_size", 1)
    ok = isinstance(table, dict) and table.get("format") == SHARDED_FORMAT and isinstance(table.get("ranks"), dict)
    if ok:
        for rank_table in table["ranks"].values():
            for kind in (PART_WEIGHTS, PART_OPTIMIZER):
                for key, chunk in (rank_table.get(kind) or {}).items():
                    ok = (ok and isinstance(key, str) and _valid_chunk(chunk)
                          and allowed_shard_name(chunk["file"], world))
    if not ok:
        raise CorruptCheckpointError(f"the manifest's extra[{KEY_SHARDED!r}] chunk table is malformed "
                                     f"({str(table)[:120]}); the checkpoint is damaged.")
    return table


def _valid_chunk(chunk: Any) -> bool:
    if not isinstance(chunk, dict) or not isinstance(chunk.get("file"), str) or not isinstance(chunk.get("dtype"), str):
        return False
    dims: list[list[int]] = [chunk.get(k) for k in ("shape", "offset", "size")]  # type: ignore[misc]
    if not all(isinstance(d, list) and all(isinstance(x, int) and x >= 0 for x in d) for d in dims):
        return False
    shape, offset, size = dims
    return len(shape) == len(offset) == len(size) and all(o + s <= n for n, o, s in zip(shape, offset, size))


def is_sharded(manifest: Mapping[str, Any]) -> bool:
    """Whether the manifest is a sharded checkpoint's (without validating the table)."""
    extra = manifest.get("extra")
    return isinstance(extra, dict) and KEY_SHARDED in extra


def is_flat(table: Mapping[str, Any]) -> bool:
    """Whether the chunks are runs of flattened tensors (DeepSpeed ZeRO, `state.zero`): each names its tensor's
    shape (`"tensor_shape"`) beside the flattened one; DCP's chunks (FSDP2) are blocks of the tensor itself."""
    return any("tensor_shape" in c for r in table["ranks"].values() for part in r.values() if isinstance(part, dict)
               for c in part.values() if isinstance(c, dict))


def placeholders(table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """L0 of a sharded checkpoint as `meta` tensors of the global shapes: what the model check reads
    (names, shapes) before the shards are read into the live model."""
    out: dict[str, torch.Tensor] = {}
    for r in table["ranks"].values():
        for key, c in (r.get(PART_WEIGHTS) or {}).items():
            dtype = getattr(torch, c["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"chunk {key!r} has an unknown dtype {c['dtype']!r}.")
            shape = c.get("tensor_shape", c["shape"])
            if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                raise CorruptCheckpointError(f"chunk {key!r} has a malformed tensor_shape {shape!r}.")
            out.setdefault(key, torch.empty(shape, dtype=dtype, device="meta"))
    return out


def gather_weights(directory: Path, table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded checkpoint (FSDP2 blocks or ZeRO runs), assembled from every rank's chunks
    on the CPU: what an export writes (no process group, no DCP, no DeepSpeed).

    Raises:
        `CorruptCheckpointError`: a chunk's file lacks its tensor, or the chunks leave part of a tensor uncovered.
    """
    files: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    meta = placeholders(table)
    for _, rank_table in sorted(table["ranks"].items(), key=lambda kv: int(kv[0])):
        for key, c in (rank_table.get(PART_WEIGHTS) or {}).items():
            if (key, tuple(c["offset"])) in seen:
                continue  # a replica of a chunk already placed
            seen.add((key, tuple(c["offset"])))
            if c["file"] not in files:
                files[c["file"]] = _load(directory / c["file"])
            data = files[c["file"]].get(key)
            if data is None:
                raise CorruptCheckpointError(f"{directory / c['file']} lacks tensor {key!r} named by the manifest.")
            full = out.get(key)
            if full is None:
                full = out[key] = torch.empty(meta[key].shape, dtype=meta[key].dtype)
            target = full.view(-1) if "tensor_shape" in c else full
            for dim, (start, length) in enumerate(zip(c["offset"], c["size"])):
                target = target.narrow(dim, start, length)
            target.copy_(data.reshape(target.shape))
            filled[key] = filled.get(key, 0) + target.numel()
    short = sorted(k for k, t in out.items() if filled.get(k, 0) < t.numel())
    if short:
        raise CorruptCheckpointError(f"the saved chunks leave part of {short[:5]} uncovered: a rank's shard is "
                                     "missing.")
    return out


class FlatReader:
    """Reads ranges of flattened tensors out of the shard files of a flat-chunk checkpoint (`is_flat`): the
    chunks of any ranks that cover `[start, stop)`, so another world size or ZeRO stage reads the same state.

    `read_into` reads each range with `pread` straight into the memory it belongs in (a ZeRO partition on the
    CPU: one copy from the page cache, no mapping of the file, no tensor in between); a device or other-dtype
    destination gets the range through one host tensor. Use it as a context manager (it keeps the files open).

    Args:
        directory (`Path`): the checkpoint's directory (its files verified by the caller).
        table (`Mapping`): its chunk table (`sharded_table`).
    """

    def __init__(self, directory: Path, table: Mapping[str, Any]) -> None:
        self._dir = Path(directory)
        self._files: dict[str, tuple[BinaryIO, dict[str, tuple[torch.dtype, int, int]]]] = {}
        self._chunks: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        for rank_table in table["ranks"].values():
            for part in (PART_WEIGHTS, PART_OPTIMIZER):
                for key, c in (rank_table.get(part) or {}).items():
                    if len(c["offset"]) != 1:
                        raise CorruptCheckpointError(f"chunk {key!r} is not a run of a flattened tensor.")
                    self._chunks.setdefault((part, key), []).append((c["offset"][0], c["size"][0], c["file"]))
        for chunks in self._chunks.values():
            chunks.sort()

    def __enter__(self) -> FlatReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files read so far (idempotent)."""
        for f, _ in self._files.values():
            f.close()
        self._files.clear()

    def keys(self, part: str) -> set[str]:
        return {key for p, key in self._chunks if p == part}

    def _entry(self, name: str, key: str) -> tuple[BinaryIO, torch.dtype, int, int]:
        """`(file, dtype, byte offset, number of elements)` of tensor `key` in shard file `name`."""
        if name not in self._files:
            path = self._dir / name
            try:
                f = open_read(path)
            except OSError as e:  # missing, a link, unreadable
                raise CorruptCheckpointError(f"shard file {path} cannot be read ({e}).") from e
            try:  # the header, validated by safetensors; the tensors lie in its key order, back to back
                loaded = _load(path)
                at = 8 + struct.unpack("<Q", f.read(8))[0]
            except (CorruptCheckpointError, struct.error) as e:
                f.close()
                raise CorruptCheckpointError(f"shard file {path} is not a valid safetensors file ({e}).") from e
            entries: dict[str, tuple[torch.dtype, int, int]] = {}
            for k, t in loaded.items():
                entries[k], at = (t.dtype, at, t.numel()), at + t.nbytes
            self._files[name] = (f, entries)
        handle, found_in = self._files[name]
        found = found_in.get(key)
        if found is None:
            raise CorruptCheckpointError(f"{self._dir / name} lacks tensor {key!r} named by the manifest.")
        return handle, *found

    def read_into(self, part: str, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Write the elements `[start, stop)` of the flattened `key` into the 1-D `out` (of `stop - start` elements).

        Raises:
            `CorruptCheckpointError`: the chunks do not cover the range (a missing rank's file, a malformed table),
                or a file holds less than its chunk.
            `KeyError`: no chunk of `key` was saved (the caller names what is missing).
        """
        chunks = self._chunks.get((part, key))
        if not chunks:
            raise KeyError(key)
        covered = start
        for offset, size, name in chunks:
            if offset > covered or covered >= stop:
                break
            hi = min(stop, offset + size)
            if hi <= covered:
                continue  # a replica, or a chunk before the range
            f, dtype, at, numel = self._entry(name, key)
            if hi - offset > numel:
                raise CorruptCheckpointError(f"{self._dir / name} holds {numel} elements of {key!r}, fewer than the "
                                             f"{size} its chunk names.")
            dest = out.narrow(0, covered - start, hi - covered)
            direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
            into = dest if direct else torch.empty(hi - covered, dtype=dtype)
            _pread(f, into.detach().view(torch.uint8).numpy().data, at + (covered - offset) * dtype.itemsize,
                   f"{self._dir / name} is truncated inside tensor {key!r}.")
            if not direct:
                dest.copy_(into)
            covered = hi
        if covered < stop:
            raise CorruptCheckpointError(f"the saved chunks of {key!r} cover its elements {start}..{covered} of "
                                         f"{start}..{stop}: a rank's shard is missing.")

    def read(self, part: str, key: str, start: int, stop: int) -> torch.Tensor:
        """The elements `[start, stop)` of the flattened `key`, as a new tensor of the saved dtype (`read_into`)."""
        chunks = self._chunks.get((part, key))
        if not chunks:
            raise KeyError(key)
        _, dtype, _, _ = self._entry(chunks[0][2], key)
        out = torch.empty(stop - start, dtype=dtype)
        self.read_into(part, key, start, stop, out)
        return out


def _load(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a verified shard file, in file order, as views of a private map of it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.offset_keys()}
    except Exception as e:  # SafetensorError, OSError: whatever the parser's complaint
        raise CorruptCheckpointError(f"shard file {path} cannot be read or is not a valid safetensors file ({e}).") \
            from e


def _pread(f: BinaryIO, buffer: memoryview, offset: int, short: str) -> None:
    """Fill `buffer` from `f` at `offset` (positional reads; `CorruptCheckpointError` with `short` at end of file)."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        try:
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
        except OSError as e:
            raise CorruptCheckpointError(f"{short[:-1]} ({e}).") from e
        if n == 0:
            raise CorruptCheckpointError(short)
        done += n


def dcp_metadata(table: Mapping[str, Any], prefixes: Mapping[str, str]) -> tuple[Any, dict[Any, tuple[str, str]]]:
    """DCP `Metadata` of the saved chunks (keys `prefixes[kind] + key`) and index -> (file, key)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    entries: dict[str, TensorStorageMetadata] = {}
    storage: dict[Any, tuple[str, str]] = {}
    for _, rank_table in sorted(table["ranks"].items(), key=lambda kv: int(kv[0])):
        for kind, prefix in prefixes.items():
            for key, c in (rank_table.get(kind) or {}).items():
                fqn = prefix + key
                dtype = getattr(torch, c["dtype"], None)
                if not isinstance(dtype, torch.dtype):
                    raise CorruptCheckpointError(f"chunk {fqn!r} has an unknown dtype {c['dtype']!r}.")
                md = entries.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                                   torch.Size(c["shape"]), []))
                index = MetadataIndex(fqn, torch.Size(c["offset"]))
                if index in storage or (0 in c["size"] and c["shape"] and 0 not in c["shape"]):
                    continue  # a replica of a chunk already listed (HSDP, plain tensors), or an empty shard
                md.chunks.append(ChunkStorageMetadata(torch.Size(c["offset"]), torch.Size(c["size"])))
                storage[index] = (c["file"], key)
    return Metadata(state_dict_metadata=dict(entries)), storage


def make_reader(directory: Path, table: Mapping[str, Any], prefixes: Mapping[str, str]) -> Any:
    """A DCP `StorageReader` over the shard files of `directory` (verified by the caller)."""
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import StorageReader

    metadata, storage = dcp_metadata(table, prefixes)

    class ShardReader(StorageReader):
        """Reads chunks out of ``<part>-rank<R>.safetensors`` (memory-mapped); metadata from JSON."""

        def reset(self, checkpoint_id: Any = None) -> None:
            self._files: dict[str, dict[str, torch.Tensor]] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.reset()

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Any:
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise CorruptCheckpointError(f"{req.storage_index.fqn}: sharded checkpoints hold tensors only.")
                name, key = storage[req.storage_index]
                if name not in self._files:
                    self._files[name] = _load(directory / name)
                tensor = self._files[name].get(key)
                if tensor is None:
                    raise CorruptCheckpointError(f"{directory / name} lacks tensor {key!r} named by the manifest.")
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(f"{key!r} in {name}: chunk of size {tuple(tensor.size())} for a "
                                                 f"target of size {tuple(target.size())}.")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            from torch.futures import Future

            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    reader = ShardReader()
    reader.reset()
    return reader

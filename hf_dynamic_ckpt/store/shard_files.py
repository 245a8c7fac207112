"""Sharded checkpoints on disk (FSDP2, DeepSpeed ZeRO): one safetensors file per rank and tier, chunk tables in JSON.

Layout of a sharded ``step-<N>/`` (every file is in the manifest's file table with its size, checksum, tier and
rank; rank 0 writes the manifest last, as for any save):

- ``weights-rank<R>.safetensors``: rank R's chunks of L0 (keys: parameter FQNs);
- ``optimizer-rank<R>.safetensors``: rank R's chunks of the optimizer state (keys ``state.<fqn>.<name>``, DCP's
  flattened names);
- ``optimizer.tensors.zst`` / ``optimizer.json`` (rank 0): ``param_groups``, scheduler, scaler, as unsharded;
- ``rng-rank<R>.json``, ``sampler.json``: L2 as usual.

The manifest's ``extra["sharded"]`` is ``{"format", "world_size", "ranks": {"<R>": {"weights": {key: chunk},
"optimizer": {key: chunk}}}}``, ``chunk = {"shape", "offset", "size", "dtype", "file"}``: DCP's
`ChunkStorageMetadata` (a block of the global tensor, FSDP2) in JSON, or under ZeRO a run of the flattened tensor
(1-D ``shape`` / ``offset`` / ``size``) with the tensor's own ``tensor_shape``. No pickle is written or read: DCP's
``FileSystemWriter`` pickles its ``.metadata``, so `dcp_reader` gives DCP a `StorageReader` built from the JSON
table, and `FlatReader` reads any range of a ZeRO run from whichever ranks' files hold it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

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

PARTS = {SHARD_PART_WEIGHTS: Tier.WEIGHTS, SHARD_PART_OPTIMIZER: Tier.OPTIMIZER}


def write_shards(state: Any, directory: Path, *, rank: int) -> tuple[Any, dict[str, Tier], dict[str, Any] | None]:
    """Write this rank's shard files of a sharded `CheckpointState` (one whose `extra` holds its chunk table) into
    `directory`, fsynced.

    Returns:
        `tuple`: the state left to write as usual (without its sharded tensors and chunk table; rank 0 keeps the
        optimizer's `param_groups`, the scheduler and the scaler), the files written with their tiers (the commit
        lists them with their size and checksum), and this rank's chunk table for the manifest (`None` and nothing
        written for an unsharded state).
    """
    table = state.extra.get(KEY_RANK_CHUNKS)
    if not isinstance(table, dict):
        return state, {}, None
    optimizer = dict(state.optimizer) if state.optimizer is not None else None
    tensors = {SHARD_PART_WEIGHTS: state.weights} if state.weights is not None else {}
    if optimizer is not None:
        tensors[SHARD_PART_OPTIMIZER] = {SHARD_OPTIMIZER_KEY.format(fqn=fqn, name=name): t
                                         for fqn, per in optimizer.pop("state", {}).items() for name, t in per.items()}
    files: dict[str, Tier] = {}
    chunks: dict[str, Any] = {SHARD_PART_WEIGHTS: {}, SHARD_PART_OPTIMIZER: {}}
    for part, named in tensors.items():
        name = SHARD_FILE_TEMPLATE.format(part=part, rank=rank)
        missing = sorted(set(named) - set(table.get(part, {})))
        if missing:
            raise CorruptCheckpointError(f"rank {rank}: no chunk recorded for {part} tensor(s) {missing[:5]}.")
        save_file({k: t.detach().contiguous() for k, t in named.items()}, directory / name, {"format": "pt"})
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        files[name] = PARTS[part]
        chunks[part] = {k: {**table[part][k], "file": name} for k in named}
    extra = {k: v for k, v in state.extra.items() if k != KEY_RANK_CHUNKS}
    rest = dataclasses.replace(state, weights=None, optimizer=optimizer if rank == 0 else None, extra=extra)
    return rest, files, chunks


def is_sharded(manifest: Mapping[str, Any]) -> bool:
    """Whether the manifest is a sharded checkpoint's (without validating the table)."""
    extra = manifest.get("extra")
    return isinstance(extra, dict) and KEY_SHARDED in extra


def sharded_table(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chunk tables of a sharded checkpoint, or `None` for an unsharded one.

    Raises:
        `CorruptCheckpointError`: the table is malformed, or names a file other than its rank's shard file.
    """
    if not is_sharded(manifest):
        return None
    table = manifest["extra"][KEY_SHARDED]
    world = manifest.get("world_size", 1)
    ok = isinstance(table, dict) and table.get("format") == SHARDED_FORMAT and isinstance(table.get("ranks"), dict) \
        and isinstance(world, int)
    for rank, parts in (table["ranks"] if ok else {}).items():
        ok = ok and isinstance(parts, dict) and str(rank).isdigit() and int(rank) < world
        for part in PARTS if ok else ():
            file = SHARD_FILE_TEMPLATE.format(part=part, rank=rank)
            ok = ok and all(isinstance(k, str) and _valid_chunk(c, file) for k, c in (parts.get(part) or {}).items())
    if not ok:
        raise CorruptCheckpointError(f"the manifest's extra[{KEY_SHARDED!r}] chunk table is malformed "
                                     f"({str(table)[:120]}); the checkpoint is damaged.")
    return table


def _valid_chunk(chunk: Any, file: str) -> bool:
    if not isinstance(chunk, dict) or chunk.get("file") != file or not isinstance(_dtype(chunk), torch.dtype):
        return False
    dims: list[Any] = [chunk.get(k) for k in ("shape", "offset", "size")] + [chunk.get("tensor_shape", [])]
    if not all(isinstance(d, list) and all(isinstance(x, int) and x >= 0 for x in d) for d in dims):
        return False
    shape, offset, size = dims[:3]
    return len(shape) == len(offset) == len(size) and all(o + s <= n for n, o, s in zip(shape, offset, size))


def _dtype(chunk: Mapping[str, Any]) -> Any:
    return getattr(torch, chunk["dtype"], None) if isinstance(chunk.get("dtype"), str) else None


def is_flat(table: Mapping[str, Any]) -> bool:
    """Whether the chunks are runs of flattened tensors (DeepSpeed ZeRO: each names its `tensor_shape`), not blocks
    of the tensors (FSDP2)."""
    return any("tensor_shape" in c for r in table["ranks"].values() if isinstance(r, dict)
               for part in r.values() if isinstance(part, dict) for c in part.values() if isinstance(c, dict))


def placeholders(table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """L0 of a sharded checkpoint as `meta` tensors of the global shapes: what the model check of a resume reads
    before the shards are read into the live model (table from `sharded_table`)."""
    return {key: torch.empty(c.get("tensor_shape", c["shape"]), dtype=_dtype(c), device="meta")
            for r in table["ranks"].values() for key, c in (r.get(SHARD_PART_WEIGHTS) or {}).items()}


def gather_weights(directory: Path, table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded checkpoint (FSDP2 blocks or ZeRO runs), assembled on the CPU from every rank's
    chunks: what an export writes (no process group, no DCP, no DeepSpeed).

    Raises:
        `CorruptCheckpointError`: a chunk's file lacks its tensor, or the chunks leave part of a tensor uncovered.
    """
    out = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in placeholders(table).items()}
    filled: dict[str, int] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    files: dict[str, dict[str, torch.Tensor]] = {}
    for _, parts in sorted(table["ranks"].items(), key=lambda kv: int(kv[0])):
        for key, c in (parts.get(SHARD_PART_WEIGHTS) or {}).items():
            if (key, tuple(c["offset"])) in seen:
                continue  # a replica of a chunk already placed
            seen.add((key, tuple(c["offset"])))
            if c["file"] not in files:
                try:
                    files[c["file"]] = load_file(directory / c["file"])
                except (SafetensorError, OSError) as e:
                    raise CorruptCheckpointError(f"shard file {directory / c['file']} cannot be read ({e}).") from e
            data = files[c["file"]].get(key)
            if data is None:
                raise CorruptCheckpointError(f"{directory / c['file']} lacks tensor {key!r} named by the manifest.")
            target = out[key].view(-1) if "tensor_shape" in c else out[key]
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
    """Reads ranges of flattened tensors from the shard files of a ZeRO checkpoint (`is_flat`): the chunks of any
    ranks that cover `[start, stop)`, so another world size or ZeRO stage reads the same state.

    `read_into` reads each range with `pread` straight into the memory it belongs in (a ZeRO partition on the CPU:
    one copy from the page cache, no mapping, no tensor in between); a device or other-dtype destination gets it
    through one host tensor. A context manager: it keeps the files open.

    Args:
        directory (`Path`): the checkpoint's directory (its files verified by the caller).
        table (`Mapping`): its chunk table (`sharded_table`).
    """

    def __init__(self, directory: Path, table: Mapping[str, Any]) -> None:
        self._dir = Path(directory)
        self._files: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}  # name -> (fd, {key: (begin, end)})
        self._chunks: dict[tuple[str, str], list[tuple[int, int, str, torch.dtype]]] = {}
        for parts in table["ranks"].values():
            for part in PARTS:
                for key, c in (parts.get(part) or {}).items():
                    if len(c["offset"]) != 1:
                        raise CorruptCheckpointError(f"chunk {key!r} is not a run of a flattened tensor.")
                    self._chunks.setdefault((part, key), []).append((c["offset"][0], c["size"][0], c["file"],
                                                                     _dtype(c)))
        for chunks in self._chunks.values():
            chunks.sort(key=lambda c: c[:2])

    def __enter__(self) -> FlatReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files read so far (idempotent)."""
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def keys(self, part: str) -> set[str]:
        """The tensors of `part` (`"weights"` / `"optimizer"`) that have chunks."""
        return {key for p, key in self._chunks if p == part}

    def _entry(self, name: str, key: str) -> tuple[int, int, int]:
        """`(fd, first byte, end byte)` of tensor `key` in shard file `name`, its header validated by safetensors."""
        if name not in self._files:
            path = self._dir / name
            try:
                with safe_open(path, framework="pt"):  # bounds, offsets and dtypes checked before anything is read
                    pass
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except (SafetensorError, OSError) as e:
                raise CorruptCheckpointError(f"shard file {path} is not a readable safetensors file ({e}).") from e
            n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
            header = json.loads(os.pread(fd, n, 8))
            self._files[name] = (fd, {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                                      for k, v in header.items() if k != "__metadata__"})
        fd, tensors = self._files[name]
        if key not in tensors:
            raise CorruptCheckpointError(f"{self._dir / name} lacks tensor {key!r} named by the manifest.")
        return fd, *tensors[key]

    def read_into(self, part: str, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Write the elements `[start, stop)` of the flattened `key` into the 1-D `out` (of `stop - start` elements).

        Raises:
            `CorruptCheckpointError`: the chunks do not cover the range (a missing rank's file), or a file holds less
                than its chunk.
            `KeyError`: no chunk of `key` was saved (the caller names what is missing).
        """
        chunks = self._chunks.get((part, key))
        if not chunks:
            raise KeyError(key)
        covered = start
        for offset, size, name, dtype in chunks:
            if offset > covered or covered >= stop:
                break
            hi = min(stop, offset + size)
            if hi <= covered:
                continue  # a replica, or a chunk before the range
            fd, begin, end = self._entry(name, key)
            if (end - begin) // dtype.itemsize < size:
                raise CorruptCheckpointError(f"{self._dir / name} holds {(end - begin) // dtype.itemsize} elements of "
                                             f"{key!r}, fewer than the {size} its chunk names.")
            dest = out.narrow(0, covered - start, hi - covered)
            direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
            into = dest if direct else torch.empty(hi - covered, dtype=dtype)
            view = memoryview(into.detach().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
            done, at = 0, begin + (covered - offset) * dtype.itemsize
            while done < len(view):
                n = os.preadv(fd, [view[done:]], at + done)
                if n == 0:
                    raise CorruptCheckpointError(f"{self._dir / name} is truncated inside tensor {key!r}.")
                done += n
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
        out = torch.empty(stop - start, dtype=chunks[0][3])
        self.read_into(part, key, start, stop, out)
        return out


def dcp_reader(directory: Path, table: Mapping[str, Any], prefixes: Mapping[str, str]) -> Any:
    """A DCP `StorageReader` over the shard files of `directory` (verified by the caller): the metadata from the JSON
    chunk table (the tensors of part `p` named `prefixes[p] + key`), the chunks read with `safe_open`."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    entries: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, tuple[str, str]] = {}
    for _, parts in sorted(table["ranks"].items(), key=lambda kv: int(kv[0])):
        for part, prefix in prefixes.items():
            for key, c in (parts.get(part) or {}).items():
                md = entries.setdefault(prefix + key, TensorStorageMetadata(TensorProperties(dtype=_dtype(c)),
                                                                            torch.Size(c["shape"]), []))
                index = MetadataIndex(prefix + key, torch.Size(c["offset"]))
                if index in storage or (0 in c["size"] and c["shape"] and 0 not in c["shape"]):
                    continue  # a replica of a chunk already listed (HSDP, plain tensors), or an empty shard
                md.chunks.append(ChunkStorageMetadata(torch.Size(c["offset"]), torch.Size(c["size"])))
                storage[index] = (c["file"], key)
    metadata = Metadata(state_dict_metadata=dict(entries))

    class ShardReader(StorageReader):
        """Reads chunks out of ``<part>-rank<R>.safetensors``; the metadata is the JSON table's."""

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Future[None]:
            files: dict[str, Any] = {}
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise CorruptCheckpointError(f"{req.storage_index.fqn}: sharded checkpoints hold tensors only.")
                name, key = storage[req.storage_index]
                try:
                    if name not in files:
                        files[name] = safe_open(directory / name, framework="pt")
                    if not req.lengths:  # a 0-d tensor (a step count)
                        tensor = files[name].get_tensor(key)
                    else:
                        tensor = files[name].get_slice(key)[tuple(slice(o, o + n) for o, n in
                                                                  zip(req.storage_offsets, req.lengths))]
                except (SafetensorError, OSError) as e:
                    raise CorruptCheckpointError(f"{directory / name}: tensor {key!r} cannot be read ({e}).") from e
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(f"{key!r} in {name}: chunk of size {tuple(tensor.size())} for a "
                                                 f"target of size {tuple(target.size())}.")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return ShardReader()

"""Sharded checkpoints on disk (FSDP2, DeepSpeed ZeRO): one safetensors file per rank and tier and the chunk tables
in the manifest's ``extra["sharded"]`` (docs/fsdp.md, docs/deepspeed.md); no pickle. `ChunkReader` reads any block
from whichever ranks' chunks hold it, so a resume reshards to any world size."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import constants as C
from ..constants import SHARD_PART_OPTIMIZER as OPTIMIZER
from ..constants import SHARD_PART_WEIGHTS as WEIGHTS
from ..errors import CorruptCheckpointError, IncompatibleStateError, fault
from .manifest import CheckpointState, file_checksum, is_sharded

PARTS = {WEIGHTS: C.Tier.WEIGHTS, OPTIMIZER: C.Tier.OPTIMIZER}


def write_shards(state: CheckpointState, directory: Path, *, rank: int
                 ) -> tuple[CheckpointState, dict[str, dict[str, Any]], dict[str, Any]]:
    """Write this rank's shard files of a sharded `CheckpointState` (its `extra` holds its chunk table) into
    `directory`, fsynced. Returns the state left to write as usual (rank 0 keeps the optimizer's `param_groups`, the
    scheduler and the scaler), the manifest entries of the files written, and this rank's chunk table."""
    table = state.extra[C.KEY_RANK_CHUNKS]
    optimizer = dict(state.optimizer) if state.optimizer is not None else None
    tensors = {WEIGHTS: state.weights} if state.weights is not None else {}
    if optimizer is not None:
        tensors[OPTIMIZER] = {C.SHARD_OPTIMIZER_KEY.format(fqn=fqn, name=name): t
                                         for fqn, per in optimizer.pop("state", {}).items() for name, t in per.items()}
    files: dict[str, dict[str, Any]] = {}
    chunks: dict[str, Any] = {WEIGHTS: {}, OPTIMIZER: {}}
    for part, named in tensors.items():
        path = directory / (name := C.SHARD_FILE_TEMPLATE.format(part=part, rank=rank))
        if missing := sorted(set(named) - set(table.get(part, {}))):
            raise CorruptCheckpointError(f"rank {rank}: no chunk recorded for {part} tensor(s) {missing[:5]}.")
        fault("write", step=state.step, rank=rank, name=name)
        save_file({k: t.detach().cpu().contiguous() for k, t in named.items()}, path, {"format": "pt"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[name] = {C.KEY_SIZE: path.stat().st_size, C.KEY_CHECKSUM: file_checksum(path),
                       C.KEY_TIER: PARTS[part].value, C.KEY_RANK: rank}
        chunks[part] = {k: {**table[part][k], "file": name} for k in named}
    extra = {k: v for k, v in state.extra.items() if k != C.KEY_RANK_CHUNKS}
    rest = dataclasses.replace(state, weights=None, optimizer=optimizer if rank == 0 else None, extra=extra)
    return rest, files, chunks


def sharded_table(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chunk tables of a sharded checkpoint, or `None` for an unsharded one; `CorruptCheckpointError` when it is
    malformed or names a file other than its rank's shard file."""
    if not is_sharded(manifest):
        return None
    table = manifest["extra"][C.KEY_SHARDED]
    world = manifest.get("world_size", 1)
    ok = isinstance(table, dict) and table.get("format") == C.SHARDED_FORMAT and isinstance(table.get("ranks"), dict) \
        and isinstance(world, int)
    for rank, parts in (table["ranks"] if ok else {}).items():
        ok = ok and isinstance(parts, dict) and str(rank).isdigit() and int(rank) < world
        for part in PARTS if ok else ():
            chunks, file = parts.get(part) or {}, C.SHARD_FILE_TEMPLATE.format(part=part, rank=rank)
            ok = ok and isinstance(chunks, dict) and all(_valid_chunk(c, file) for c in chunks.values())
    if not ok:
        raise CorruptCheckpointError(f"the manifest's extra[{C.KEY_SHARDED!r}] chunk table is malformed "
                                     f"({str(table)[:120]}); the checkpoint is damaged.")
    return table


def _valid_chunk(chunk: Any, file: str) -> bool:
    if not isinstance(chunk, dict) or chunk.get("file") != file or not isinstance(_dtype(chunk), torch.dtype):
        return False
    shape, offset, size, whole = dims = [chunk.get(k, []) for k in ("shape", "offset", "size", "tensor_shape")]
    if not all(isinstance(d, list) and all(isinstance(x, int) and x >= 0 for x in d) for d in dims):
        return False
    flat = "tensor_shape" not in chunk or (len(shape) == 1 and math.prod(whole) == shape[0])  # a ZeRO run's tensor
    return flat and len(shape) == len(offset) == len(size) and all(o + s <= n for n, o, s in zip(shape, offset, size))


def _dtype(chunk: Mapping[str, Any]) -> Any:
    return getattr(torch, chunk["dtype"], None) if isinstance(chunk.get("dtype"), str) else None


def is_flat(table: Mapping[str, Any]) -> bool:
    """Whether the chunks are runs of flattened tensors (DeepSpeed ZeRO: each names its `tensor_shape`), not blocks
    of the tensors (FSDP2)."""
    return any("tensor_shape" in c for r in table["ranks"].values() if isinstance(r, dict)
               for part in r.values() if isinstance(part, dict) for c in part.values() if isinstance(c, dict))


def placeholders(table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """L0 of a sharded checkpoint as `meta` tensors of the global shapes (for the model check of a resume)."""
    return {key: torch.empty(c.get("tensor_shape", c["shape"]), dtype=_dtype(c), device="meta")
            for r in table["ranks"].values() for key, c in (r.get(WEIGHTS) or {}).items()}


def gather_weights(directory: Path, table: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded checkpoint, assembled on the CPU from every rank's chunks (for an export)."""
    out = {key: torch.empty(t.shape, dtype=t.dtype) for key, t in placeholders(table).items()}
    with ChunkReader(directory, table) as reader:
        for key, t in out.items():
            reader.read_into(WEIGHTS, key, t.view(-1) if is_flat(table) else t)
    return out


class ChunkReader(contextlib.AbstractContextManager["ChunkReader"]):
    """Reads any block of a saved tensor from the chunks of whichever ranks hold it (`table` from `sharded_table`),
    without a collective, through safetensors' `get_slice`; a context manager (it keeps the files open)."""

    def __init__(self, directory: Path, table: Mapping[str, Any]) -> None:
        self._dir = Path(directory)
        self._files: dict[str, tuple[Any, set[str]]] = {}  # name: (open safetensors file, its keys)
        self._chunks: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for parts in table["ranks"].values():
            for part in PARTS:
                for key, chunk in (parts.get(part) or {}).items():
                    self._chunks.setdefault((part, key), []).append(chunk)

    def __exit__(self, *exc: object) -> None:
        for f, _ in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()

    def keys(self, part: str) -> set[str]:
        return {key for p, key in self._chunks if p == part}

    def read_into(self, part: str, key: str, out: torch.Tensor, offset: Sequence[int] | None = None) -> None:
        """Write the block of the saved `key` that starts at `offset` (`None`: 0) and has `out`'s shape into `out`
        (a ZeRO run: `key` flattened, `out` 1-D)."""
        chunks = self._chunks.get((part, key))
        if not chunks:
            raise IncompatibleStateError(f"{self._dir.name} holds no {part} tensor {key!r}, which this run has: it "
                                         "was saved from another model or optimizer.")
        at = list(offset) if offset is not None else [0] * out.dim()
        done, seen = 0, set()
        for c in chunks:
            if len(c["offset"]) != out.dim():
                raise CorruptCheckpointError(f"{key!r} was saved with {len(c['offset'])} dimensions, not {out.dim()}.")
            lo = [max(a, b) for a, b in zip(c["offset"], at)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(c["offset"], c["size"], at, out.shape)]
            if tuple(c["offset"]) in seen or any(h <= low for low, h in zip(lo, hi)):
                continue  # a replica of a chunk read already, or no overlap
            seen.add(tuple(c["offset"]))
            dest = out[tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, at))]
            self._copy(c, key, [low - o for low, o in zip(lo, c["offset"])], dest)
            done += dest.numel()
        if done < out.numel():
            raise CorruptCheckpointError(f"the saved chunks of {key!r} hold {done} of the {out.numel()} elements at "
                                         f"{at}: a rank's shard is missing.")

    def _copy(self, chunk: Mapping[str, Any], key: str, start: list[int], dest: torch.Tensor) -> None:
        """Copy the block of `chunk` at `start` (chunk coordinates) and of `dest`'s shape into `dest`."""
        name, size = chunk["file"], chunk["size"]
        if name not in self._files:  # safetensors checks the header's bounds, offsets and dtypes at the open
            try:
                if (self._dir / name).is_symlink():  # the store never reads through links
                    raise OSError("a symbolic link")
                f = safe_open(self._dir / name, framework="pt")
                self._files[name] = (f, set(f.keys()))
            except (SafetensorError, OSError) as e:
                raise CorruptCheckpointError(f"shard file {self._dir / name} is not a readable safetensors file "
                                             f"({e}).") from e
        if key not in (files := self._files[name])[1]:
            raise CorruptCheckpointError(f"{self._dir / name} lacks tensor {key!r} named by the manifest.")
        if (saved := files[0].get_slice(key)).get_shape() != size:
            n, wanted = math.prod(saved.get_shape()), math.prod(size)
            raise CorruptCheckpointError(f"{self._dir / name} holds {n} elements of {key!r}, "
                                         f"{'fewer than' if n < wanted else 'not'} the {wanted} its chunk names.")
        dest.copy_(saved[tuple(slice(a, a + n) for a, n in zip(start, dest.shape))])

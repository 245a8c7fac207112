"""The L1 container's uncompressed codec (`Codec.NONE`): the payload written and memory-mapped.

Tensors sit at 64-byte-aligned offsets with zero padding between them, hashed per frame of
`frame_bytes` like a compressed payload (`tensorpack_format.raw_frames`). `write_raw_payload`
writes them through a `HashingWriter`; `map_raw` returns them as views of a private
(copy-on-write) memory map, or copies, once every frame's xxh3 (and, when given, the whole
file's checksum) is checked.
"""

from __future__ import annotations

import mmap as mmap_mod
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError
from .filecheck import WholeFileCheck
from .fs import open_read
from .parallel import ordered_map
from .tensorpack_format import DTYPES, raw_frames


def write_raw_payload(f: Any, entries: list[dict[str, Any]], datas: list[np.ndarray], total: int, frame_bytes: int,
                      index: list[tuple[int, int]]) -> None:
    """Uncompressed payload (tensors at their aligned offsets, zero padding), hashed per frame."""
    bounds = raw_frames(total, frame_bytes)
    hasher, pos, k = xxhash.xxh3_64(), 0, 0

    def emit(data: Any) -> None:
        nonlocal hasher, pos, k
        mv = memoryview(data).cast("B")
        while mv.nbytes:
            take = min(mv.nbytes, bounds[k][1] - pos)
            f.write(mv[:take])
            hasher.update(mv[:take])
            pos += take
            mv = mv[take:]
            if pos == bounds[k][1]:
                index.append((bounds[k][1] - bounds[k][0], hasher.intdigest()))
                hasher, k = xxhash.xxh3_64(), k + 1

    for e, data in zip(entries, datas):
        if e["offset"] > pos:
            emit(bytes(e["offset"] - pos))
        if data.nbytes:
            emit(data)


def map_raw(path: Path, header: dict[str, Any], start: int, index: list[tuple[int, int, int]], workers: int,
            copy: bool, checksum: str | None) -> dict[str, torch.Tensor]:
    """Tensors of an uncompressed container as views of a private memory map (copies: `copy`), after hashing each
    frame (and the whole file against `checksum`, in the same pass)."""
    try:
        with open_read(path) as f:
            mm = mmap_mod.mmap(f.fileno(), 0, access=mmap_mod.ACCESS_COPY) if index else None
    except OSError as e:
        raise CorruptCheckpointError(f"Tensor file {path} is missing or unreadable ({e}).") from e
    if mm is None:
        WholeFileCheck.small(path, checksum, f"Tensor file {path}")
    else:
        view = memoryview(mm)
        check = None

        def frame_ok(k: int) -> bool:
            offset, length, digest = index[k]
            return xxhash.xxh3_64_intdigest(view[offset : offset + length]) == digest

        try:
            check = WholeFileCheck.start(view, checksum, f"Tensor file {path}")
            ks = range(len(index))
            bad = [k for k, ok in zip(ks, ordered_map(frame_ok, ks, workers if len(index) > 1 else 0)) if not ok]
            if bad:
                raise CorruptCheckpointError(f"Tensor file {path}: frame(s) {bad} fail their xxh3 checksum; the file is "
                                             "corrupt.")
            if check is not None:
                check.result()
        finally:
            if check is not None:
                check.cancel()  # joined: nothing reads the map once it is handed out
            view.release()
    out: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        dtype, shape, name = DTYPES[entry["dtype"]], entry["shape"], str(entry["name"])
        if entry["nbytes"] == 0 or mm is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(mm, dtype=torch.uint8, count=entry["nbytes"], offset=start + entry["offset"]).view(dtype)
        out[name] = t.view(shape).clone() if copy else t.view(shape)
    return out

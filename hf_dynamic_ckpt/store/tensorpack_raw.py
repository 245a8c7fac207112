"""The L1 container's uncompressed codec (`Codec.NONE`): the payload written and memory-mapped.

Tensors sit at 64-byte-aligned offsets with zero padding between them, hashed per frame of
`frame_bytes` like a compressed payload (`tensorpack_format.raw_frames`). `write_raw_payload`
writes them through a `HashingWriter`; `map_raw` returns them as views of a private
(copy-on-write) memory map, or copies, once every frame's xxh3 (and, when given, the whole
file's checksum) is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError
from .filecheck import MappedFile, WholeFileCheck
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
    frame (and the whole file against `checksum`, in the same pass). Copies hand each mapped page back once it is
    read (`filecheck.MappedFile`): a copying load holds the copies, not the file's pages too."""
    try:
        with open_read(path) as f:
            mapped = MappedFile(f.fileno(), private=True) if index else None
    except OSError as e:
        raise CorruptCheckpointError(f"Tensor file {path} is missing or unreadable ({e}).") from e
    release = mapped.release if mapped is not None and copy else None
    if mapped is None:
        WholeFileCheck.small(path, checksum, f"Tensor file {path}")
    else:
        view = memoryview(mapped.mm)  # type: ignore[arg-type]
        check = None

        def frame_ok(k: int) -> bool:
            offset, length, digest = index[k]
            ok = xxhash.xxh3_64_intdigest(view[offset : offset + length]) == digest
            if release is not None:
                release(offset, offset + length)
            return ok

        try:
            check = WholeFileCheck.start(view, checksum, f"Tensor file {path}", release=release)
            ks = range(len(index))
            bad = [k for k, ok in zip(ks, ordered_map(frame_ok, ks, workers if len(index) > 1 else 0)) if not ok]
            if bad:
                raise CorruptCheckpointError(f"Tensor file {path}: frame(s) {bad} fail their xxh3 checksum; the "
                                             "file is corrupt.")

            if check is not None:
                check.result()
        finally:
            if check is not None:
                check.cancel()  # joined: nothing reads the map once it is handed out
            view.release()
    out: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        dtype, shape, name = DTYPES[entry["dtype"]], entry["shape"], str(entry["name"])
        if entry["nbytes"] == 0 or mapped is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        at = start + entry["offset"]
        t = torch.frombuffer(mapped.mm, dtype=torch.uint8, count=entry["nbytes"], offset=at).view(dtype)  # type: ignore[call-overload]
        out[name] = t.view(shape).clone() if copy else t.view(shape)
        if release is not None:
            release(at, at + entry["nbytes"])
    return out

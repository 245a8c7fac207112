"""Version-2 L1 containers, written by hand: development builds of 0.2.0 wrote them; the library refuses them.

A version-2 zstd frame is one zstd frame (content size + checksum) of the frame's raw bytes: its
pieces, byte-grouped where the header says so (the layout in `tensorpack`'s docstring). The
header, frame plan, index and footer are those of version 3.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

import hf_dynamic_ckpt.store.tensorpack as tp
from hf_dynamic_ckpt.store.hashing import make_file_entry
from hf_dynamic_ckpt.store import (
    ALIGN,
    CRC,
    DTYPES,
    FORMAT_NAME,
    GROUPABLE,
    MAGIC,
    NAMES,
    PREFIX,
    frames,
    group,
    index_bytes,
    pieces,
    step_of,
)


def write_v2(tensors: dict[str, torch.Tensor], path: Path, *, level: int = 3, byte_group: bool = True,
             **_: Any) -> dict[str, Any]:
    """Write `tensors` as a version-2 zstd container (frame sizes: `tensorpack.FRAME_BYTES` and
    `GROUP_CHUNK_ELEMS` as they are now); returns its manifest entry. Other keywords (those of
    `write_tensor_file`) are accepted and ignored."""
    gce, frame_bytes = tp.GROUP_CHUNK_ELEMS, tp.FRAME_BYTES
    entries, datas, offset = [], [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        entries.append({"name": name, "dtype": NAMES[t.dtype], "shape": list(t.shape), "offset": offset,
                        "nbytes": data.nbytes, "byte_grouped": byte_group and t.dtype in GROUPABLE and t.numel() > 1})
        datas.append(data)
        offset += data.nbytes
    header = json.dumps({"format": FORMAT_NAME, "version": 2, "codec": "zstd", "level": level, "total_bytes": offset,
                         "group_chunk_elems": gce, "frame_bytes": frame_bytes, "tensors": entries},
                        separators=(",", ":")).encode()
    header += b" " * (-(PREFIX.size + len(header) + CRC.size) % ALIGN)
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    stored, index = [], []
    for frame in frames(entries, gce, frame_bytes):
        raw = b"".join(
            group(datas[i][lo:hi], DTYPES[entries[i]["dtype"]].itemsize).tobytes() if entries[i]["byte_grouped"]
            else datas[i][lo:hi].tobytes()
            for run in frame for i, lo, hi in pieces(run, step_of(entries[run[0]], gce)))
        stored.append(cctx.compress(raw))
        index.append((len(stored[-1]), xxhash.xxh3_64_intdigest(stored[-1])))
    payload = b"".join(stored)
    path.write_bytes(PREFIX.pack(MAGIC, len(header)) + header + CRC.pack(zlib.crc32(header)) + payload
                     + index_bytes(index, len(payload)))
    return make_file_entry(path, tier="optimizer")

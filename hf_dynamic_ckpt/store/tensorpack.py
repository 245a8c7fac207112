"""Level 1: the optimizer / scheduler / AMP-scaler tensors, in a verified container without pickle.

The state dicts are split by `statetree.flatten_state` into a JSON structure
(`optimizer.json`) and a flat `{name: tensor}` dict, which `write_tensor_file` stores in a
small binary container (version 3, the layout below) and `read_tensor_file` reads back,
verifying every frame before a tensor is returned. This module is the whole container: its
byte layout and header checks, the frame plan and byte planes, the parts, the writer that
checksums and paces itself to the disk (`HashingWriter`, which the L0 writer uses too), and
the parallel encoding and decoding.

Codec `Codec.ZSTD` (default): independent frames of byte-grouped pieces, each a table of
parts stored raw or zstd-compressed (`encode_parts` / `decode_parts`), encoded and decoded in parallel threads
(`ordered_map`; zstandard, xxhash and numpy release the GIL), decoded straight into the output
tensors (via one scratch buffer per thread when a frame must be un-grouped or holds several
tensors). Codec `Codec.NONE`: raw bytes at 64-byte-aligned offsets (`write_raw_payload`),
returned as views of a private memory map after every frame's xxh3 is checked (or copied,
`copy=True`; `map_raw`). Given the manifest's checksum, the whole file is verified in the same
pass (`hashing.WholeFileCheck`). Any truncation or flipped byte raises `CorruptCheckpointError`; a container
version other than 3 raises `FormatVersionError`.

Layout (version 3)::

    magic  b"HFDCTP01"                        8 bytes (file type; the layout version is in the header)
    header length (little-endian u64)         8 bytes
    header JSON (utf-8, space-padded so the payload starts 64-byte aligned): format,
        version (3), codec ("zstd" | "none"), level, total_bytes,
        group_chunk_elems, frame_bytes, tensors (name, dtype, shape, offset, nbytes, byte_grouped)
    header CRC32 (u32)                        4 bytes
    payload: N frames, one after another
    frame index: N x (stored length u64, xxh3_64 of the stored frame bytes u64)
    footer: payload length u64, N u64, CRC32 of index + those two u32, b"HFDCTEND"

codec "zstd": a frame holds one or more pieces of at most `group_chunk_elems` elements of a
tensor, packed in tensor order up to `frame_bytes` raw bytes (`frames`; reader and writer
derive the same plan from the header). Float pieces can be byte-grouped: the top byte of
every element (sign + exponent), then the second byte, then the remaining low mantissa
bytes (`group_into` / `ungroup_into`). The concatenated (grouped) pieces are the
frame's raw bytes; the frame's stored bytes are a part table and the parts::

    part count P (u32) | P x (kind u8, raw length u64, stored length u64) | the P parts

The parts cut the raw bytes into consecutive spans (the writer cuts at byte planes and
every `PART_BYTES`, `part_bounds`); kind `PART_RAW` (0) is the span
itself (raw length == stored length), kind `PART_ZSTD` (1) one zstd frame (content size
+ checksum) of it, whose raw length is at most `ZSTD_MAX_RATIO` x its stored length. The
reader needs no guessing: the table says which part is which (`parse_parts`).

Every frame stays independent (decoded in parallel) and its stored bytes, table included,
are covered by its xxh3_64 in the index.
codec "none": the tensors' raw bytes at 64-byte-aligned offsets (zero padding); frames are
`frame_bytes` slices of the payload, each with its xxh3_64.

Reading a header (`read_header`) validates everything before anything is allocated: the
declared sizes must be backed by the file (raw payload for "none"; at most
`ZSTD_MAX_RATIO` raw bytes per stored byte for "zstd", the format's own limit), and the
frame plan, computed run by run in O(frames + tensors) memory, must match the index. So a
hostile header (a 64 GiB tensor, `group_chunk_elems=1`) is refused in bounded memory; a
part table is checked against its frame's length and raw size before a part is decoded.

Writing (`HashingWriter`): every `WRITEBACK_BYTES` written, the kernel is asked to start writing
them to disk (`start_writeback`, libc's `sync_file_range`), so the final fsync waits for the
tail, not the whole file, and the dirty page cache (which a memory cgroup charges to the job)
stays small. A paced writer (`HashingWriter(paced=True)`, the L1 tier's default on a local root)
also waits until the bytes `PACE_WINDOW` behind its end are on disk (`wait_written`), so it goes
no faster than the disk, and tells from those waits who sets the pace (`disk_bound`,
`pace_verdict`): `encode_parts` stores slowly compressing parts raw while the disk waits. Where
`sync_file_range` is missing or fails, nothing is requested and nothing is paced.

Why parts (docs/benchmarks.md, "L1 codec"): on dense AdamW moments the second byte plane and
the low mantissa bytes do not compress at all (ratio 1.000), yet zstd spends ~0.7 ms per MiB
finding that out, and the exponent plane compresses to ~0.29 at ~150-250 MiB per CPU-second
with level 1's match finder. The writer cuts each frame at the byte planes of its grouped
pieces and every `PART_BYTES` (`part_bounds`), estimates each part's ratio from
`SAMPLE_SLICES` slices of `SAMPLE_SLICE` bytes spread over it, and compresses it only when
zstd makes it at most `KEEP_RATIO` of its size; the rest is stored raw (a memcpy to read).
Level 1 uses a smaller match finder (`compression_params`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
import xxhash

from ..constants import Tier
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompatibleStateError,
    SaveError,
)
from ..jsonutil import loads_bounded
from .fs import create, open_read, read_exact
from .hashing import FileEntry, WholeFileCheck, format_checksum, make_file_entry, new_hasher
from .spec import Codec

logger = logging.getLogger(__name__)

__all__ = ["FRAME_BYTES", "GROUP_CHUNK_ELEMS", "HashingWriter", "PaceMemory", "read_tensor_file", "resolve_threads",
           "usable_cpus", "write_tensor_file"]


# ---------------------------------------------------------------------------------- the byte layout
MAGIC = b"HFDCTP01"
FORMAT_NAME = "hf_dynamic_ckpt.tensorpack"
CONTAINER_VERSION = 3
"""The one layout version written and read (zstd frames as tables of raw and zstd parts). Version 2 (each zstd
frame one zstd frame) was written only by development builds of 0.2.0 before version 3, never by a release; version
1 changed its byte-grouping without a version bump. Both are refused (`FormatVersionError`)."""
PREFIX = struct.Struct("<8sQ")
CRC = struct.Struct("<I")
FRAME = struct.Struct("<QQ")
FOOTER_FIELDS = struct.Struct("<QQ")
FOOTER_MAGIC = b"HFDCTEND"
FOOTER_SIZE = FOOTER_FIELDS.size + CRC.size + len(FOOTER_MAGIC)
PART_COUNT = struct.Struct("<I")
PART = struct.Struct("<BQQ")
"""One entry of a frame's part table: kind, raw length, stored length."""
PART_RAW = 0
PART_ZSTD = 1
ALIGN = 64
"""Payload and (uncompressed codec) tensor alignment in bytes."""
MAX_HEADER = 256 << 20
ZSTD_MAX_RATIO = 1 << 15
"""Most raw bytes one stored byte of zstd can stand for (a 4-byte RLE block yields 128 KiB)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "complex64": torch.complex64, "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
GROUPABLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}

Piece = tuple[int, int, int]
"""(tensor index, first byte, end byte) of a tensor's raw bytes; a grouped piece is grouped on its own."""
Run = tuple[int, int, int]
"""(tensor index, first byte, end byte): consecutive pieces of one tensor inside one frame."""


def step_of(entry: dict[str, Any], group_chunk_elems: int) -> int:
    """Bytes of one full piece of a tensor."""
    return group_chunk_elems * DTYPES[entry["dtype"]].itemsize


def frames(entries: list[dict[str, Any]], group_chunk_elems: int, frame_bytes: int) -> Iterator[list[Run]]:
    """Frames of a zstd container as runs, packed in order (the plan, without listing pieces).

    A frame takes pieces (at most `group_chunk_elems` elements each) until the next piece
    would take it past `frame_bytes`; a piece larger than `frame_bytes` is a frame of its
    own. Consecutive pieces of one tensor in a frame form one run, so memory is
    O(runs) however small the pieces are.
    """
    cur: list[Run] = []
    size = 0
    for i, e in enumerate(entries):
        step, n, lo = step_of(e, group_chunk_elems), e["nbytes"], 0
        while lo < n:
            if size + n - lo <= frame_bytes:  # every remaining piece fits
                cur.append((i, lo, n))
                size += n - lo
                break
            k = (frame_bytes - size) // step  # whole pieces that fit
            if k == 0 and not cur:
                k = 1  # a piece larger than a frame is a frame of its own
            if k > 0:
                end = min(lo + k * step, n)
                cur.append((i, lo, end))
                lo = end
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def pieces(run: Run, step: int) -> Iterator[Piece]:
    """The pieces of one run."""
    i, lo, hi = run
    for p in range(lo, hi, step):
        yield i, p, min(p + step, hi)


def _frame_pieces(frame: list[Run], entries: list[dict[str, Any]], gce: int) -> Iterator[Piece]:
    """The pieces of one frame, in order (the writer packs them, the reader unpacks them)."""
    for run in frame:
        yield from pieces(run, step_of(entries[run[0]], gce))


def raw_frames(total: int, frame_bytes: int) -> list[tuple[int, int]]:
    """Frames of an uncompressed container: (start, end) slices of the payload, hashed separately."""
    return [(lo, min(lo + frame_bytes, total)) for lo in range(0, total, frame_bytes)]


def index_bytes(index: list[tuple[int, int]], payload_len: int) -> bytes:
    body = b"".join(FRAME.pack(n, h) for n, h in index)
    tail = FOOTER_FIELDS.pack(payload_len, len(index))
    return body + tail + CRC.pack(zlib.crc32(body + tail)) + FOOTER_MAGIC


def _frame_count(header: dict[str, Any], payload_len: int, limit: int) -> int:
    """Frames the header implies, counting no further than `limit + 1` (bounded work)."""
    if header["codec"] == Codec.NONE:
        return len(range(0, header["total_bytes"], header["frame_bytes"]))
    n = 0
    for _ in frames(header["tensors"], header["group_chunk_elems"], header["frame_bytes"]):
        n += 1
        if n > limit:
            break
    return n


def read_header(path: Path) -> tuple[dict[str, Any], int, list[tuple[int, int, int]]]:
    """Validates a container's header, version, declared sizes, frame index and footer.

    Returns:
        `tuple`: (header, payload offset, frames as `(file offset, length, xxh3_64)`).

    Raises:
        `FormatVersionError`: the header's container version is not the one this library reads (3).
        `CorruptCheckpointError`: anything else that does not add up.
    """
    path = Path(path)
    try:
        with open_read(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(PREFIX.size)
            if len(prefix) != PREFIX.size:
                raise CorruptCheckpointError(f"Tensor file {path} is truncated ({len(prefix)} bytes).")
            magic, hlen = PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise CorruptCheckpointError(f"{path} is not an hf_dynamic_ckpt tensor file (magic {magic!r}).")
            if hlen > min(MAX_HEADER, size):
                raise CorruptCheckpointError(f"Tensor file {path} declares a {hlen}-byte header in a {size}-byte file; "
                                             "the file is corrupt.")
            header_bytes = f.read(hlen)
            crc = f.read(CRC.size)
            start = PREFIX.size + hlen + CRC.size
            if len(header_bytes) != hlen or len(crc) != CRC.size:
                raise CorruptCheckpointError(f"Tensor file {path} is truncated inside its header.")
            if CRC.unpack(crc)[0] != zlib.crc32(header_bytes):
                raise CorruptCheckpointError(f"Tensor file {path} has a damaged header (CRC mismatch).")
            header = _parse_header(header_bytes, path)
            footer = b""
            if size >= start + FOOTER_SIZE:
                f.seek(size - FOOTER_SIZE)
                footer = f.read(FOOTER_SIZE)
            if len(footer) != FOOTER_SIZE or footer[-len(FOOTER_MAGIC) :] != FOOTER_MAGIC:
                raise CorruptCheckpointError(f"Tensor file {path} is truncated or has extra bytes ({size} bytes, no "
                                             "footer).")
            payload_len, n_frames = FOOTER_FIELDS.unpack_from(footer)
            index_len = n_frames * FRAME.size
            if start + payload_len + index_len + FOOTER_SIZE != size:
                raise CorruptCheckpointError(
                    f"Tensor file {path} is truncated or has extra bytes: {size} bytes on disk, footer "
                    f"declares {start + payload_len + index_len + FOOTER_SIZE}."
                )
            f.seek(start + payload_len)
            body = f.read(index_len)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"Tensor file {path} is missing.") from e
    except OSError as e:  # a link (UnsafePathError), EIO, ...
        raise CorruptCheckpointError(f"Tensor file {path} cannot be read ({e}).") from e
    (crc_value,) = CRC.unpack_from(footer, FOOTER_FIELDS.size)
    if zlib.crc32(body + footer[: FOOTER_FIELDS.size]) != crc_value:
        raise CorruptCheckpointError(f"Tensor file {path} has a damaged frame index (CRC mismatch).")
    total = header["total_bytes"]
    backed = payload_len if header["codec"] == Codec.NONE else payload_len * ZSTD_MAX_RATIO
    if total > backed:
        raise CorruptCheckpointError(
            f"Tensor file {path} declares {total} bytes of tensors but holds a {payload_len}-byte payload, which "
            f"cannot decode to more than {backed} bytes; the file is corrupt (nothing was allocated)."
        )
    frame_list: list[tuple[int, int, int]] = []
    pos = start
    for n, digest in FRAME.iter_unpack(body):
        frame_list.append((pos, n, digest))
        pos += n
    expected = _frame_count(header, payload_len, limit=len(frame_list))
    if pos != start + payload_len or len(frame_list) != expected or (
            header["codec"] == Codec.NONE and payload_len != total):
        shown = f"{expected}" if expected <= len(frame_list) else f"more than {len(frame_list)}"
        raise CorruptCheckpointError(
            f"Tensor file {path}: the frame index ({len(frame_list)} frames, {pos - start} bytes) does not match the "
            f"header ({shown} frames, {payload_len} payload bytes); the file is corrupt."
        )
    return header, start, frame_list


def _parse_header(header_bytes: bytes, path: Path) -> dict[str, Any]:
    try:
        h = loads_bounded(header_bytes)
        if h["format"] != FORMAT_NAME:
            raise ValueError(f"unknown format {h['format']!r}")
        version = h["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"Tensor file {path} has an invalid header: {e}") from e
    if isinstance(version, bool) or version != CONTAINER_VERSION:
        if isinstance(version, int) and version > CONTAINER_VERSION:
            why = "newer than this library; upgrade hf_dynamic_ckpt"
        elif version == 2:
            why = ("written by a development build of hf_dynamic_ckpt 0.2.0 from before container version 3, and read "
                   "only by such a build (no release wrote it); load it with that build and save again, or resume from "
                   "the weights only")
        else:
            why = ("an older layout this library no longer reads (its byte-grouping differs); re-save the optimizer "
                   "state with this version, or resume from the weights only")
        raise FormatVersionError(
            f"Tensor file {path} has container version {version!r}, this library reads version {CONTAINER_VERSION}: "
            f"{why}."
        )
    try:
        _validate_header(h)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"Tensor file {path} has an invalid header: {e}") from e
    return cast(dict[str, Any], h)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _validate_header(h: dict[str, Any]) -> None:
    if h["codec"] not in (Codec.ZSTD.value, Codec.NONE.value):
        raise ValueError(f"unknown codec {h['codec']!r}")
    for key in ("group_chunk_elems", "frame_bytes"):
        if not (_count(h[key]) and h[key] > 0):
            raise ValueError(f"bad {key} {h[key]!r}")
    if not (_count(h["total_bytes"]) and isinstance(h["tensors"], list)):
        raise ValueError("total_bytes or tensors missing or of the wrong type")
    end = 0
    for e in h["tensors"]:
        if not isinstance(e, dict) or not isinstance(e["name"], str) or not isinstance(e["byte_grouped"], bool):
            raise ValueError(f"malformed tensor entry {str(e)[:80]}")
        dtype = DTYPES[e["dtype"]]
        shape = e["shape"]
        if not isinstance(shape, list) or not all(_count(s) for s in shape):
            raise ValueError(f"bad shape {shape!r} for {e['name']!r}")
        if not (_count(e["offset"]) and _count(e["nbytes"])):
            raise ValueError(f"bad offset/size for {e['name']!r}")
        aligned = h["codec"] == Codec.NONE and e["offset"] % ALIGN == 0 and end <= e["offset"] < end + ALIGN
        if not (e["offset"] == end or aligned) or e["nbytes"] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"inconsistent offset/size for {e['name']!r}")
        if e["byte_grouped"] and (h["codec"] != Codec.ZSTD or dtype not in GROUPABLE):
            raise ValueError(f"{e['name']!r} cannot be byte-grouped")
        end = e["offset"] + e["nbytes"]
    if end != h["total_bytes"]:
        raise ValueError("tensor sizes do not add up to total_bytes")


def parse_parts(data: memoryview, want: int, where: str) -> list[tuple[int, int, int, int]]:
    """Validates a frame's part table against the frame's length and raw size.

    Args:
        data (`memoryview`): the frame's stored bytes (already checked against its xxh3).
        want (`int`): the raw bytes the header's plan gives this frame.
        where (`str`): "Tensor file <path>: frame <k>", the start of every error message.

    Returns:
        `list[tuple[int, int, int, int]]`: (kind, raw length, stored offset in `data`, stored
        length) per part, in order; their raw lengths add up to `want`.

    Raises:
        `CorruptCheckpointError`: a table that does not fit the frame, an unknown kind, a raw
        part whose two lengths differ, a zstd part claiming more than `ZSTD_MAX_RATIO` raw
        bytes per stored byte, or raw lengths that do not add up to `want`.
    """
    size = len(data)
    count = PART_COUNT.unpack_from(data)[0] if size >= PART_COUNT.size else -1
    pos = PART_COUNT.size + max(count, 0) * PART.size
    if count < 1 or count > want or pos > size:
        raise CorruptCheckpointError(f"{where} has a part table of {count} parts that does not fit its {size} bytes "
                                     f"and {want} raw bytes; the file is corrupt.")
    parts: list[tuple[int, int, int, int]] = []
    raw_total = 0
    table = bytes(data[PART_COUNT.size : PART_COUNT.size + count * PART.size])  # a copy: no export of the map
    for j, (kind, raw, stored) in enumerate(PART.iter_unpack(table)):
        limit = stored if kind == PART_RAW else stored * ZSTD_MAX_RATIO
        if (kind not in (PART_RAW, PART_ZSTD) or not 0 < raw <= limit or stored < 1
                or (kind == PART_RAW and raw != stored)):
            raise CorruptCheckpointError(
                f"{where}, part {j}: kind {kind}, {raw} raw bytes in {stored} stored bytes is not a valid part (raw "
                f"parts: equal lengths; zstd parts: at most {ZSTD_MAX_RATIO} raw bytes per stored byte); the file "
                "is corrupt.")
        parts.append((kind, raw, pos, stored))
        pos += stored
        raw_total += raw
    if pos != size or raw_total != want:
        raise CorruptCheckpointError(f"{where} declares {raw_total} bytes, the header {want} ({pos} of {size} "
                                     "stored bytes in its parts); the file is corrupt.")
    return parts


# ---------------------------------------------------------------------------------- byte planes
# A grouped piece of n elements of `itemsize` bytes (little-endian) is::
#
#     [top byte of every element][second byte of every element][the remaining low bytes, element by element]
#
# The two top bytes hold sign, exponent and the high mantissa bits (the compressible part of optimizer
# state); the low mantissa bytes are close to random and stay interleaved, which halves the cost of the
# shuffle for the same compression ratio on AdamW state. For 2-byte types this is the full byte transpose.

GROUP_BLOCK = 1 << 15
"""Elements per block of the strided copies of `group_into` / `ungroup_into` (source and planes stay in cache)."""
SHIFT_BLOCK = 1 << 18
"""Elements per block where `group_into` shifts whole words (4- and 2-byte types): fewer, longer numpy calls."""
_shift_scratch = threading.local()


def group_into(raw: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    """Writes `raw` (elements of `itemsize` bytes) into `out` as [top byte plane][second byte plane][remaining low
    bytes]."""
    n = raw.size // itemsize
    if itemsize in (2, 4):  # the planes as shifted words cast to bytes: ~1.7x the strided copies (6.5 vs 3.8 GiB/s)
        _group_words(raw, out, itemsize, n)
        return
    rest = itemsize - 2  # 8-byte types: strided copies
    for lo in range(0, n, GROUP_BLOCK):  # cache-sized blocks: ~1.4x faster than whole planes (3 strided passes)
        hi = min(lo + GROUP_BLOCK, n)
        block = raw[lo * itemsize : hi * itemsize]
        out[lo:hi] = block[itemsize - 1 :: itemsize]
        out[n + lo : n + hi] = block[itemsize - 2 :: itemsize]
        low = out[2 * n + rest * lo : 2 * n + rest * hi].reshape(hi - lo, rest)
        low[...] = block.reshape(hi - lo, itemsize)[:, :rest]


def _group_words(raw: np.ndarray, out: np.ndarray, itemsize: int, n: int) -> None:
    """`group_into` for 4- and 2-byte elements: the top byte is `word >> 8 * (itemsize - 1)`, the second
    `word >> 8 * (itemsize - 2)` cast to a byte, the low two bytes of a 4-byte word its cast to 16 bits."""
    words = raw.view("<u4" if itemsize == 4 else "<u2")  # the layout is little-endian on any host
    scratch = _scratch(itemsize, words.dtype)
    top = 8 * (itemsize - 1)
    for lo in range(0, n, SHIFT_BLOCK):
        hi = min(lo + SHIFT_BLOCK, n)
        block, tmp = words[lo:hi], scratch[: hi - lo]
        np.right_shift(block, top, out=tmp)
        out[lo:hi] = tmp
        if itemsize == 4:
            np.right_shift(block, 16, out=tmp)
            out[n + lo : n + hi] = tmp
            out[2 * n + 2 * lo : 2 * n + 2 * hi].view("<u2")[:] = block
        else:
            out[n + lo : n + hi] = block


def _scratch(itemsize: int, dtype: np.dtype) -> np.ndarray:
    """This thread's `SHIFT_BLOCK` words (the writer and reader group on several threads)."""
    scratch = getattr(_shift_scratch, f"u{itemsize}", None)
    if scratch is None or scratch.size < SHIFT_BLOCK:
        scratch = np.empty(SHIFT_BLOCK, dtype=dtype)
        setattr(_shift_scratch, f"u{itemsize}", scratch)
    return scratch


def group(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """`group_into` a new array."""
    out = np.empty(raw.size, dtype=np.uint8)
    group_into(raw, out, itemsize)
    return out


def ungroup_into(grouped: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    """The inverse of `group_into`: `grouped` planes back into elements in `out`."""
    n, rest = out.size // itemsize, itemsize - 2
    if itemsize in (2, 4):  # words assembled from shifted planes: ~1.4x the strided copies (5.3 vs 3.8 GiB/s)
        _ungroup_words(grouped, out, itemsize, n)
        return
    for lo in range(0, n, GROUP_BLOCK):  # cache-sized blocks, as `group_into`
        hi = min(lo + GROUP_BLOCK, n)
        block = out[lo * itemsize : hi * itemsize]
        block[itemsize - 1 :: itemsize] = grouped[lo:hi]
        block[itemsize - 2 :: itemsize] = grouped[n + lo : n + hi]
        low = grouped[2 * n + rest * lo : 2 * n + rest * hi].reshape(hi - lo, rest)
        block.reshape(hi - lo, itemsize)[:, :rest] = low


def _ungroup_words(grouped: np.ndarray, out: np.ndarray, itemsize: int, n: int) -> None:
    words = out.view("<u4" if itemsize == 4 else "<u2")
    tmp_all = _scratch(itemsize, words.dtype)
    top = 8 * (itemsize - 1)
    for lo in range(0, n, SHIFT_BLOCK):
        hi = min(lo + SHIFT_BLOCK, n)
        dst, tmp = words[lo:hi], tmp_all[: hi - lo]
        if itemsize == 4:
            dst[:] = grouped[2 * n + 2 * lo : 2 * n + 2 * hi].view("<u2")
            tmp[:] = grouped[n + lo : n + hi]
            np.left_shift(tmp, 16, out=tmp)
            np.bitwise_or(dst, tmp, out=dst)
        else:
            dst[:] = grouped[n + lo : n + hi]
        tmp[:] = grouped[lo:hi]
        np.left_shift(tmp, top, out=tmp)
        np.bitwise_or(dst, tmp, out=dst)


# ---------------------------------------------------------------------------------- the checksumming, paced writer
WRITEBACK_BYTES = 8 << 20
"""A `HashingWriter` asks the kernel to start writing its file back every this many bytes."""

_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4  # <linux/fs.h>
_sync_file_range: Any = None  # resolved on first use: the libc function, or False where there is none

PACE_WINDOW = 32 << 20
"""A paced `HashingWriter` keeps at most about this many bytes between what is written and what is on disk."""
DISK_BOUND_SHARE = 0.5
"""A paced writer is disk-bound while more than this share of its recent time went into waiting for the disk
(an average halved at each wait: one slow flush among fast ones does not flip it)."""
BLOCKED_S = 0.0002
"""A paced wait shorter than this did not block (the call on bytes already on disk takes ~10 us)."""


def _range_sync(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """libc's `sync_file_range` (Python's `os` has none); `False` where it does not exist or fails."""
    if not range_sync_available() or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, flags) == 0


def range_sync_available() -> bool:
    """Whether libc has `sync_file_range` (Linux): writeback requests and paced writes are possible."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes releases the GIL while it waits
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (AttributeError, OSError):  # not Linux / not glibc or musl
            pass
    return bool(_sync_file_range)


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing `nbytes` of `fd` at `offset` to disk, without waiting (Linux).

    The final `fsync` then waits only for what is still dirty instead of the whole file: the disk
    writes while the caller compresses or copies the next bytes, and the dirty page cache (which a
    memory cgroup charges to the job) stays small.

    Returns:
        `bool`: whether the request was made (`False` where the call does not exist or fails; the
        later `fsync` is what makes the file durable either way).
    """
    return _range_sync(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def wait_written(fd: int, offset: int, nbytes: int) -> bool:
    """Write `nbytes` of `fd` at `offset` to disk and wait until they are there (Linux).

    Neither the file's metadata nor the device's cache is flushed: that is the final `fsync`'s
    job. A paced writer calls this on the range `PACE_WINDOW` behind what it wrote, so that it
    goes no faster than the disk and can tell whether the disk was waiting for it.

    Returns:
        `bool`: whether the call was made (`False` where it does not exist or fails).
    """
    return _range_sync(fd, offset, nbytes,
                       _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)


class HashingWriter:
    """A write-only binary file wrapper that checksums every byte it writes.

    Saves a second pass over the file to compute its checksum. Only `write`, `tell`,
    `flush` and `fileno` are provided (what serialisers and zstd stream writers need).

    Args:
        raw (`BinaryIO`): the underlying file, opened for binary writing at position 0.
        defer (`bool`, *optional*, defaults to `False`): keep references to the written
            buffers and hash them in `fsync_and_checksum`, while the kernel flushes the
            file, which hides the hashing time behind the fsync. Only for buffers that do
            not change until then (e.g. tensor snapshots); transient buffers need `False`.
        paced (`bool`, *optional*, defaults to `False`): after each writeback request, wait
            until the bytes `PACE_WINDOW` behind the end are on disk (`wait_written`), so the
            writer goes at the disk's speed, and record in `disk_bound` whether the writer has
            lately spent most of its time waiting (the disk sets the pace) or not (the disk
            waits for the writer).

    Every `WRITEBACK_BYTES` written, the kernel is asked to start writing them to disk
    (`start_writeback`), so the final fsync waits for the tail, not the whole file.
    """

    def __init__(self, raw: BinaryIO, *, defer: bool = False, paced: bool = False) -> None:
        self._raw = raw
        self._hasher = new_hasher()
        self._size = 0
        self._pending: list[memoryview] | None = [] if defer else None
        self._written_back = 0  # bytes before this offset were handed to start_writeback
        self._paced = paced and range_sync_available()
        self._on_disk = 0  # paced: bytes before this offset are known to be on disk
        self._waiting_share = 0.0  # paced: recent share of time spent waiting for the disk
        self._waits = 0  # paced: waits for the disk made so far
        self._since = self._start = time.perf_counter()
        self.disk_wait_s = 0.0
        """Seconds spent in paced waits."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._pending is None:
            self._hasher.update(view)
        else:
            self._pending.append(view)
        self._raw.write(view)
        self._size += view.nbytes
        if self._size - self._written_back >= WRITEBACK_BYTES:
            self._write_back()
        return view.nbytes

    def _write_back(self) -> None:
        try:
            self._raw.flush()
            fd = self._raw.fileno()
            started = start_writeback(fd, self._written_back, self._size - self._written_back)
        except (OSError, ValueError):  # no descriptor (an in-memory file): nothing to write back
            started = False
        self._written_back = self._size if started else 1 << 62  # unsupported here: stop asking
        self._paced = self._paced and started  # without writeback requests nothing tells who sets the pace
        if self._paced and self._size - self._on_disk > PACE_WINDOW:
            upto = self._size - PACE_WINDOW
            start = time.perf_counter()
            if not wait_written(fd, self._on_disk, upto - self._on_disk):
                self._paced = False  # as above: behave as unpaced
                return
            end = time.perf_counter()
            self._on_disk = upto
            self.disk_wait_s += end - start
            share = (end - start) / (end - self._since) if end - start > BLOCKED_S else 0.0  # since the last wait
            self._waiting_share = 0.5 * self._waiting_share + 0.5 * share
            self._waits += 1
            self._since = end

    @property
    def disk_bound(self) -> bool:
        """Whether the disk sets the pace (see `paced`): `False` until a wait shows it (the first `PACE_WINDOW` go
        as fast as the writer can); `True` unpaced and where pacing is not possible."""
        return not self._paced or self._waiting_share > DISK_BOUND_SHARE

    @property
    def pace_verdict(self) -> bool | None:
        """Whether the disk held this write up so far: more than `DISK_BOUND_SHARE` of its time went into waiting
        for the disk, or pacing stopped working (or never could); `None` for a paced write too short to tell (under
        two waits: less than about `PACE_WINDOW` plus two writeback requests written)."""
        if not self._paced:
            return True
        if self._waits < 2:
            return None
        return self.disk_wait_s > DISK_BOUND_SHARE * (time.perf_counter() - self._start)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def _drain(self) -> None:
        if self._pending:
            for view in self._pending:
                self._hasher.update(view)
            self._pending.clear()

    def checksum(self) -> str:
        """`"<algo>:<hex>"` of everything written so far."""
        self._drain()
        return format_checksum(self._hasher.copy())

    def fsync_and_checksum(self) -> str:
        """Flushes and fsyncs the file while hashing deferred buffers; returns the checksum.

        Raises:
            `OSError`: the fsync failed (e.g. ENOSPC or EIO surfacing at flush time).
        """
        self.flush()
        if not self._pending:
            os.fsync(self.fileno())
            return self.checksum()
        error: list[BaseException] = []

        def sync() -> None:
            try:
                os.fsync(self.fileno())
            except BaseException as e:  # re-raised in the caller's thread
                error.append(e)

        worker = threading.Thread(target=sync, name="hf_dynamic_ckpt-fsync", daemon=True)
        worker.start()  # fsync releases the GIL: hashing below runs while the disk writes
        try:
            self._drain()
        finally:
            worker.join()
        if error:
            raise error[0]
        return self.checksum()


# ---------------------------------------------------------------------------------- writing and reading
FRAME_BYTES = 16 << 20
"""Target raw bytes per frame written: the unit of parallel (de)compression and of scratch memory."""
GROUP_CHUNK_ELEMS = 1 << 22
"""Byte-grouping works on runs of this many elements (16 MiB of fp32): bounded extra memory."""

PART_BYTES = 1 << 20
"""Largest part written: the unit of the raw-or-zstd choice (a dense and a zero region of one plane differ)."""
MIN_SEGMENT = 64 << 10
"""Spans (byte planes, small pieces) below this are merged with their neighbour before cutting parts."""
SAMPLE_SLICES = 4
SAMPLE_SLICE = 16 << 10
"""A part larger than `SAMPLE_SLICES * SAMPLE_SLICE` is judged by compressing that many slices of it."""
KEEP_RATIO = 0.9
"""A part is stored compressed only when zstd makes it at most this fraction of its size."""
HURRY_RATIO = 0.1
"""While the disk waits for the compressor (a paced write), only parts whose sample compresses to at most this
fraction are compressed: runs of zeros and the like, which zstd compresses faster than the disk writes them."""


class PaceMemory:
    """What the last paced L1 writes of a store learnt: whether to byte-group the next one (`group`).

    While the disk waits for the compressor, a paced write stores raw every part that does not
    shrink to `HURRY_RATIO`. The byte planes of AdamW moments do not (their exponent plane
    compresses to ~0.3); zeros do, grouped or not. So after a paced write the disk did not hold
    up (`HashingWriter.pace_verdict`), the next one groups only the tensors where it pays even
    then (`grouping_pays`): ~20 % less CPU for a file of the same size on AdamW state. After one
    it held up, or where pacing stopped working, every tensor is grouped again; a write too short
    to tell changes nothing. A store keeps one per task (`Task.l1_pace`); a new one groups.
    """

    def __init__(self) -> None:
        self.group = True

    def learn(self, held_up: bool | None) -> None:
        if held_up is not None:
            self.group = held_up


UNGROUPED_MIN_BYTES = 1 << 20
"""Tensors smaller than this stay byte-grouped whatever the disk: grouping them costs little."""
GROUP_SAMPLE_ELEMS = 1024
"""Elements per slice of the sample `grouping_pays` takes (`SAMPLE_SLICES` slices)."""


def grouping_pays(cctx: Any, data: np.ndarray, itemsize: int) -> bool:
    """Whether a hurried write (parts compressed only if they shrink to `HURRY_RATIO`) stores `data` (a tensor's
    bytes) in less than `KEEP_RATIO` of the space grouped than ungrouped, judged on a sample.

    True where a byte plane compresses that well only once grouped (constant exponents, small
    integers); false for AdamW-like moments (no plane does) and for zeros (they do either way).
    Tensors under `UNGROUPED_MIN_BYTES` answer `True` without a sample.
    """
    n = data.nbytes // itemsize
    if data.nbytes < UNGROUPED_MIN_BYTES:
        return True
    stride = (n - GROUP_SAMPLE_ELEMS) // (SAMPLE_SLICES - 1)
    sample = np.concatenate([data[j * stride * itemsize : (j * stride + GROUP_SAMPLE_ELEMS) * itemsize]
                             for j in range(SAMPLE_SLICES)])
    m = sample.nbytes // itemsize
    planes = group(sample, itemsize)

    def stored(part: np.ndarray) -> int:
        size = len(cctx.compress(part))
        return size if size <= HURRY_RATIO * part.nbytes else part.nbytes

    grouped = sum(stored(planes[lo:hi]) for lo, hi in ((0, m), (m, 2 * m), (2 * m, planes.nbytes)) if hi > lo)
    return grouped < KEEP_RATIO * stored(sample)


def compression_params(level: int) -> Any:
    """zstd parameters of a level; level 1 with a small match finder (min_match 7, 4 KiB tables).

    On the exponent plane of AdamW moments that is ~1.1x level 1's default speed for the same
    ratio (0.29): the plane is short-range, low-entropy bytes, where a cache-resident table
    finds the same matches.
    """
    import zstandard

    if level == 1:
        return zstandard.ZstdCompressionParameters.from_level(1, min_match=7, search_log=1, hash_log=12, chain_log=12,
                                                              write_checksum=1, write_content_size=1)
    return zstandard.ZstdCompressionParameters.from_level(level, write_checksum=1, write_content_size=1)


def part_bounds(frame: list[Run], entries: list[dict[str, Any]], gce: int) -> list[int]:
    """Where the writer cuts a frame's raw bytes into parts (0, ..., frame size).

    Spans: the byte planes of each grouped piece (top, second, rest), each ungrouped piece
    whole; a span under `MIN_SEGMENT` is merged with the next; then every span is cut into
    equal parts of at most `PART_BYTES`. The reader does not need this (the table says it).
    """
    spans: list[list[int]] = []
    pos = 0
    for i, lo, hi in _frame_pieces(frame, entries, gce):
        e = entries[i]
        n = (hi - lo) // DTYPES[e["dtype"]].itemsize
        cuts = [n, 2 * n, hi - lo] if e["byte_grouped"] else [hi - lo]
        for cut in dict.fromkeys(cuts):  # 2-byte types: the rest plane is empty
            if spans and spans[-1][1] - spans[-1][0] < MIN_SEGMENT:
                spans[-1][1] = pos + cut
            else:
                spans.append([spans[-1][1] if spans else 0, pos + cut])
        pos += hi - lo
    bounds = [0]
    for lo, hi in spans:
        k = -(-(hi - lo) // PART_BYTES)
        bounds += [lo + (hi - lo) * j // k for j in range(1, k + 1)]
    return bounds


def _worth_compressing(cctx: Any, part: np.ndarray, limit: float = KEEP_RATIO) -> bool:
    """Whether zstd is estimated to make `part` at most `limit` of its size (sampled)."""
    n = part.nbytes
    if n <= SAMPLE_SLICES * SAMPLE_SLICE:
        return True  # compressed whole; the result decides
    stride, budget, got = (n - SAMPLE_SLICE) // (SAMPLE_SLICES - 1), limit * SAMPLE_SLICES * SAMPLE_SLICE, 0
    for j in range(SAMPLE_SLICES):
        got += len(cctx.compress(part[j * stride : j * stride + SAMPLE_SLICE]))
        if got > budget:  # decided: the remaining slices cannot bring it back under (a paced write: often the 2nd)
            return False
    return True


def encode_parts(cctx: Any, data: np.ndarray, bounds: list[int],
                 hurry: Callable[[], bool] | None = None) -> tuple[list[Any], int, int]:
    """A frame: part table, then each part raw or compressed.

    `hurry`, asked before each part: `True` while the disk waits for the writer; then only
    parts sampled at most `HURRY_RATIO` are compressed (the rest raw, which costs no CPU).

    Returns:
        `tuple`: (chunks to write in order: bytes or views of `data`, stored length, xxh3_64).
    """
    table, chunks = [PART_COUNT.pack(len(bounds) - 1)], []
    for lo, hi in itertools.pairwise(bounds):
        part = data[lo:hi]
        stored: Any = part
        if _worth_compressing(cctx, part, HURRY_RATIO if hurry is not None and hurry() else KEEP_RATIO):
            co = cctx.compressobj(size=hi - lo)  # the streaming API: less CPU than one-shot `compress()` here
            packed = co.compress(part) + co.flush()
            if len(packed) <= KEEP_RATIO * (hi - lo):
                stored = packed
        table.append(PART.pack(PART_RAW if stored is part else PART_ZSTD, hi - lo, len(stored)))
        chunks.append(stored)
    chunks.insert(0, b"".join(table))
    return _sealed(chunks)


def _sealed(chunks: list[Any]) -> tuple[list[Any], int, int]:
    hasher = xxhash.xxh3_64()
    for chunk in chunks:
        hasher.update(chunk)
    return chunks, sum(memoryview(c).nbytes for c in chunks), hasher.intdigest()


def _zstd_into(dctx: Any, data: memoryview, out: np.ndarray, where: str) -> None:
    """Decompresses one zstd frame exactly filling `out` (its content size and checksum checked)."""
    import zstandard

    got = zstandard.frame_content_size(data)
    if got != out.nbytes:
        raise CorruptCheckpointError(f"{where} declares {got} bytes, the header {out.nbytes}; the file is corrupt.")
    with dctx.stream_reader(data, read_across_frames=False) as z:
        read_exact(z, out.data.cast("B"), f"{where} is truncated.")
        if z.read(1):  # also completes the frame, which verifies its checksum
            raise CorruptCheckpointError(f"{where} holds more data than its header declares.")


def decode_parts(dctx: Any, data: memoryview, out: np.ndarray, where: str) -> None:
    """Fills `out` (the frame's raw bytes) from a frame: raw parts copied, zstd parts decoded."""
    pos = 0
    for j, (kind, raw, at, stored) in enumerate(parse_parts(data, out.nbytes, where)):
        dst = out[pos : pos + raw]
        with data[at : at + stored] as part:  # released even on an error (the caller closes the map)
            if kind == PART_RAW:
                dst[:] = np.frombuffer(part, dtype=np.uint8)
            else:
                assert kind == PART_ZSTD
                _zstd_into(dctx, part, dst, f"{where}, part {j}")
        pos += raw


class FrameBuffers:
    """Reusable byte buffers for frames in flight (warm pages; raw parts are views into them until written)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype=np.uint8)
        return buf

    def give(self, buf: np.ndarray | None) -> None:
        if buf is not None:
            with self._lock:
                self._free.append(buf)


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int) -> int:
    """Maps the user-facing thread count to worker threads (`0`/`-1`: all usable CPUs; `0` returned: inline)."""
    if threads in (0, -1):
        n = usable_cpus()
        return n if n > 1 else 0
    if threads < -1:
        raise SaveError(f"threads={threads} is invalid; use 0 or -1 (auto), 1 (no workers) or N > 1.")
    return 0 if threads == 1 else threads


def ordered_map(fn: Any, items: Iterable[Any], workers: int) -> Iterator[Any]:
    """`map(fn, items)` in order, on `workers` threads (0: inline) with at most 2x`workers` results pending."""
    if workers <= 0:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="tensorpack") as pool:
        pending: deque[Future[Any]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()



def _check(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SaveError(f"Tensor {name!r} is a {type(t).__name__}, expected a torch.Tensor.")
    if t.dtype not in NAMES:
        raise SaveError(f"Tensor {name!r} has dtype {t.dtype}, which the L1 container does not support; "
                        f"supported: {', '.join(sorted(DTYPES))}. Cast it before saving.")
    if t.layout != torch.strided:
        raise SaveError(f"Tensor {name!r} has layout {t.layout}; convert it with `.to_dense()` first.")
    t = t.detach()
    return (t if t.device.type == "cpu" else t.to("cpu")).contiguous()


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """Row-major bytes of a contiguous CPU tensor as a uint8 array (a view, no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _codec(compression: Any) -> Codec:
    try:
        return Codec.parse(compression, field="compression")
    except ConfigError:
        raise SaveError(f"compression={compression!r} is not supported for the optimizer tier; use 'zstd' or 'none' "
                        "(memory-mapped).") from None


def _single(frame: list[Run], entries: list[dict[str, Any]]) -> bool:
    """Whether a frame is one run of an ungrouped tensor: its bytes are a slice of that tensor."""
    return len(frame) == 1 and not entries[frame[0][0]]["byte_grouped"]


def _frame_input(frame: list[Run], entries: list[dict[str, Any]], datas: list[np.ndarray], gce: int,
                 pool: FrameBuffers) -> tuple[np.ndarray, np.ndarray | None]:
    """A frame's raw bytes: a view when it is one ungrouped run, else a pooled buffer (returned second)."""
    if _single(frame, entries):
        i, lo, hi = frame[0]
        return datas[i][lo:hi], None
    size = sum(hi - lo for _, lo, hi in frame)
    scratch = pool.take(size)  # reused: no fresh pages per frame
    buf = scratch[:size]
    pos = 0
    for i, lo, hi in _frame_pieces(frame, entries, gce):
        dst = buf[pos : pos + hi - lo]
        if entries[i]["byte_grouped"]:
            group_into(datas[i][lo:hi], dst, DTYPES[entries[i]["dtype"]].itemsize)
        else:
            dst[:] = datas[i][lo:hi]
        pos += hi - lo
    return buf, scratch


def write_tensor_file(tensors: Mapping[str, torch.Tensor], path: Path, *, level: int = 3, threads: int = 0,
                      byte_group: bool = True, compression: Codec | str | None = Codec.ZSTD, paced: bool = False,
                      pace: PaceMemory | None = None) -> FileEntry:
    """Writes tensors to the L1 container (version 3: frames of raw and zstd parts, or uncompressed), fsynced.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): tensors by name (e.g. from `flatten_state`).
        path (`Path`): the file to create (overwritten if present; never through a link).
        level (`int`, *optional*, defaults to `3`): zstd compression level (1-22; <= 3 keeps
            up with a disk).
        threads (`int`, *optional*, defaults to `0`): frames compressed in parallel; `0` or
            `-1` use every CPU this process may run on, `1` compresses in the calling thread.
        byte_group (`bool`, *optional*, defaults to `True`): store float tensors as byte
            planes before compression (smaller output on optimizer state, see
            docs/benchmarks.md).
        compression (`Codec` or `str`, *optional*, defaults to `Codec.ZSTD`): or `Codec.NONE`
            (`"none"`/`None`) for an uncompressed file that `read_tensor_file` memory-maps
            (larger, faster to read); `level` and `byte_group` do not apply to it.
        paced (`bool`, *optional*, defaults to `False`): zstd: stay `PACE_WINDOW` bytes ahead of
            the disk at most; while the disk waits, slowly compressing parts are stored raw (docs/internals.md).
        pace (`PaceMemory`, *optional*): a paced write records in it whether the disk held it up; after one
            it did not, the next groups only the tensors where grouping pays anyway (`grouping_pays`).

    Returns:
        `FileEntry`: size and checksum of the written file (tier `"optimizer"`).

    Raises:
        `SaveError`: a tensor of an unsupported dtype or layout, or an unknown `compression`.

    Example:
    ```python
    >>> write_tensor_file({"exp_avg": torch.zeros(4)}, Path("t.bin"))  # doctest: +SKIP
    >>> read_tensor_file(Path("t.bin"))["exp_avg"]  # doctest: +SKIP
    tensor([0., 0., 0., 0.])
    ```
    """
    codec = _codec(compression)
    workers = resolve_threads(threads)
    paced = paced and codec == Codec.ZSTD
    pace = pace if paced else None  # only a paced write learns, or is taught
    checked = {name: _check(name, t) for name, t in tensors.items()}
    pays = _grouping_judge(level) if pace is not None and not pace.group else None
    gce, frame_bytes = GROUP_CHUNK_ELEMS, FRAME_BYTES
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, t in checked.items():
        nbytes = t.numel() * t.element_size()
        if codec == Codec.NONE:
            offset = -(-offset // ALIGN) * ALIGN  # every tensor starts aligned: memory-mapped views
        grouped = codec == Codec.ZSTD and byte_group and t.dtype in GROUPABLE and t.numel() > 1
        grouped = grouped and (pays is None or pays(_bytes_of(t), t.element_size()))
        entries.append({"name": name, "dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes, "byte_grouped": grouped})
        offset += nbytes
    header_obj = {"format": FORMAT_NAME, "version": CONTAINER_VERSION, "codec": codec.value,
                  "level": level if codec == Codec.ZSTD else None, "total_bytes": offset,
                  "group_chunk_elems": gce, "frame_bytes": frame_bytes, "tensors": entries}
    header = json.dumps(header_obj, separators=(",", ":")).encode("utf-8")
    header += b" " * (-(PREFIX.size + len(header) + CRC.size) % ALIGN)  # payload starts aligned
    datas = [_bytes_of(checked[str(e["name"])]) for e in entries]
    index: list[tuple[int, int]] = []
    with create(path) as raw:
        f = HashingWriter(raw, paced=paced)
        f.write(PREFIX.pack(MAGIC, len(header)))
        f.write(header)
        f.write(CRC.pack(zlib.crc32(header)))
        payload_start = f.size
        if codec == Codec.ZSTD:
            import zstandard

            local, pool = threading.local(), FrameBuffers()
            params = compression_params(level)
            hurry = (lambda: not f.disk_bound) if paced else None

            def compress(frame: list[Run]) -> tuple[list[Any], int, int, np.ndarray | None]:
                cctx = getattr(local, "cctx", None)
                if cctx is None:
                    cctx = local.cctx = zstandard.ZstdCompressor(compression_params=params)
                data, scratch = _frame_input(frame, entries, datas, gce, pool)
                return (*encode_parts(cctx, data, part_bounds(frame, entries, gce), hurry), scratch)

            plan = list(frames(entries, gce, frame_bytes))
            for chunks, length, digest, scratch in ordered_map(compress, plan, workers if len(plan) > 1 else 0):
                for chunk in chunks:
                    f.write(chunk)
                pool.give(scratch)  # written: its raw parts may be overwritten now
                index.append((length, digest))
        else:
            write_raw_payload(f, entries, datas, offset, frame_bytes, index)
        payload_len = f.size - payload_start
        verdict = f.pace_verdict  # before the final fsync, which any disk pays
        f.write(index_bytes(index, payload_len))
        checksum = f.fsync_and_checksum()
        if pace is not None:
            pace.learn(verdict)
    return make_file_entry(path, tier=Tier.OPTIMIZER.value, rank=None, checksum=checksum)


def _grouping_judge(level: int) -> Any:
    """`grouping_pays` with a compressor of `level`."""
    import zstandard

    cctx = zstandard.ZstdCompressor(compression_params=compression_params(level))
    return lambda data, itemsize: grouping_pays(cctx, data, itemsize)


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


class MappedFile:
    """A read-only memory map of a file whose pages are handed back once read (`release`).

    Decoding a mapped file into new tensors would otherwise hold both at the end: the file's
    pages stay mapped (counted in the process's resident memory) until the map closes. Released
    pages are dropped from this process only; the page cache keeps them, and a later read of
    the same range (the whole-file hash behind the decoders, or the other way round) maps them
    again at the cost of a minor fault.
    """

    def __init__(self, fileno: int, *, private: bool = False) -> None:
        import mmap

        self._mm = mmap.mmap(fileno, 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
        self._page = mmap.PAGESIZE
        self._dontneed = getattr(mmap, "MADV_DONTNEED", None)

    @property
    def mm(self) -> object:
        """The `mmap.mmap` object (for views and `torch.frombuffer`)."""
        return self._mm

    def release(self, start: int, end: int) -> None:
        """Drop the whole pages inside ``[start, end)`` from this process (a no-op where unsupported)."""
        lo = -(-start // self._page) * self._page
        hi = min(end, len(self._mm)) // self._page * self._page
        if self._dontneed is not None and hi > lo:
            # The map may be closing, or the platform may refuse: only memory is at stake.
            with contextlib.suppress(OSError, ValueError):
                self._mm.madvise(self._dontneed, lo, hi - lo)

    def close(self) -> None:
        self._mm.close()


def map_raw(path: Path, header: dict[str, Any], start: int, index: list[tuple[int, int, int]], workers: int,
            copy: bool, checksum: str | None) -> dict[str, torch.Tensor]:
    """Tensors of an uncompressed container as views of a private memory map (copies: `copy`), after hashing each
    frame (and the whole file against `checksum`, in the same pass). Copies hand each mapped page back once it is
    read (`MappedFile`): a copying load holds the copies, not the file's pages too."""
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


def _allocate(entries: list[dict[str, Any]], path: Path) -> list[torch.Tensor]:
    try:
        return [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in entries]
    except (RuntimeError, MemoryError) as e:  # sizes were checked against the file; this is memory
        total = sum(int(x["nbytes"]) for x in entries)
        raise CorruptCheckpointError(f"Tensor file {path}: its {total} bytes of tensors cannot be allocated "
                                     f"({e}).") from e


def read_tensor_file(path: Path, *, threads: int = 0, copy: bool = False, checksum: str | None = None,
                     max_numel: int | None = None) -> dict[str, torch.Tensor]:
    """Reads a container written by `write_tensor_file`, verifying it completely.

    Frames are checked (xxh3 of the stored frame; its part table; zstd content
    size and checksum) and decoded in parallel straight into the returned tensors' memory;
    an uncompressed container is memory-mapped (private copy-on-write pages: in-place
    updates never reach the file) after every frame's xxh3 is checked. The header is validated against the
    file's size before anything is allocated (`read_header`). With `checksum`, the whole
    file's checksum is verified too, on another thread in the same pass (`hashing.WholeFileCheck`).
    Decoding holds the output tensors and a bounded window of the file: the mapped pages of each
    frame are handed back once it is decoded and hashed (`MappedFile`), so a load peaks at
    about the size of what it returns, not twice that.

    Args:
        path (`Path`): the file.
        threads (`int`, *optional*, defaults to `0`): frames decoded in parallel; `0` or `-1`
            use every CPU this process may run on, `1` decodes in the calling thread.
        copy (`bool`, *optional*, defaults to `False`): an uncompressed container's tensors are
            copied into memory now instead of mapped (for state updated in place right after:
            mapped, each page's first write is a copy-on-write fault inside that update).
        checksum (`str`, *optional*): the file's expected checksum (`"<algo>:<hex>"`, its manifest
            entry's), verified before any tensor is returned.
        max_numel (`int`, *optional*): the most elements any tensor may declare (the caller knows what
            fits: `state.optimizer.state_numel_bound`); checked against the header before anything is
            allocated.

    Returns:
        `dict[str, torch.Tensor]`: the tensors, in the order they were written.

    Raises:
        `FormatVersionError`: the file's container version is not 3 (older or newer); with
            `checksum`, only a file that has that checksum (else it is `CorruptCheckpointError`).
        `CorruptCheckpointError`: missing, truncated, altered, or trailing data (before any tensor is returned).
        `IncompatibleStateError`: a tensor declares more than `max_numel` elements (nothing was allocated).
    """
    path = Path(path)
    what = f"Tensor file {path}"
    WholeFileCheck.check_algorithm(checksum, what)  # before anything is allocated
    try:
        header, start, index = read_header(path)
    except FormatVersionError:
        WholeFileCheck.small(path, checksum, what)  # not the file the manifest describes: corrupt, not newer
        raise
    if max_numel is not None:
        _check_sizes(path, header["tensors"], max_numel)
    workers = resolve_threads(threads)
    if header["codec"] == Codec.NONE:
        return map_raw(path, header, start, index, workers, copy, checksum)
    import zstandard

    entries = header["tensors"]
    gce = header["group_chunk_elems"]
    out = _allocate(entries, path)
    dests = [_bytes_of(t) for t in out]
    local = threading.local()

    def check_and_decode(item: tuple[int, list[Run]]) -> None:
        k, frame = item
        offset, length, digest = index[k]
        with view[offset : offset + length] as data:  # the page cache itself: no copy of the compressed bytes
            if xxhash.xxh3_64_intdigest(data) != digest:
                raise CorruptCheckpointError(f"Tensor file {path}: frame {k} fails its xxh3 checksum; the file is "
                                             "corrupt.")
            decode_frame(k, frame, data)
        mapped.release(offset, offset + length)

    def decode_frame(k: int, frame: list[Run], data: memoryview) -> None:
        want = sum(hi - lo for _, lo, hi in frame)
        i0, lo0, hi0 = frame[0]
        direct = _single(frame, entries)
        if direct:
            buf = dests[i0][lo0:hi0]
        else:
            scratch = getattr(local, "buf", None)
            if scratch is None or scratch.size < want:
                scratch = local.buf = np.empty(want, dtype=np.uint8)
            buf = scratch[:want]
        dctx = getattr(local, "dctx", None) or zstandard.ZstdDecompressor()
        local.dctx = dctx
        decode_parts(dctx, data, buf, f"Tensor file {path}: frame {k}")
        if direct:
            return
        pos = 0
        for i, lo, hi in _frame_pieces(frame, entries, gce):
            src = buf[pos : pos + hi - lo]
            if entries[i]["byte_grouped"]:
                ungroup_into(src, dests[i][lo:hi], DTYPES[entries[i]["dtype"]].itemsize)
            else:
                dests[i][lo:hi] = src
            pos += hi - lo

    if not index:
        WholeFileCheck.small(path, checksum, what)
        return {str(e["name"]): t for e, t in zip(entries, out)}
    try:
        with open_read(path) as f:
            mapped = MappedFile(f.fileno())
    except OSError as e:
        raise CorruptCheckpointError(f"Tensor file {path} is missing or unreadable ({e}).") from e
    view = memoryview(mapped.mm)  # type: ignore[arg-type]
    whole = None
    try:
        whole = WholeFileCheck.start(view, checksum, what, release=mapped.release)
        plan = enumerate(frames(entries, gce, header["frame_bytes"]))
        for _ in ordered_map(check_and_decode, plan, workers if len(index) > 1 else 0):
            pass
        if whole is not None:
            whole.result()
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(
            f"Tensor file {path} failed decompression or its checksum ({e}); the file is corrupt."
        ) from e
    finally:
        if whole is not None:
            whole.cancel()  # joined before the map goes
        view.release()
        mapped.close()
    return {str(e["name"]): t for e, t in zip(entries, out)}


def _check_sizes(path: Path, entries: list[dict[str, Any]], max_numel: int) -> None:
    for e in entries:
        numel = int(e["nbytes"]) // DTYPES[e["dtype"]].itemsize
        if numel > max_numel:
            raise IncompatibleStateError(
                f"Tensor file {path}: tensor {e['name']!r} declares shape {list(e['shape'])} ({numel} elements), more "
                f"than any state of this model's parameters holds ({max_numel}); this optimizer state does not belong "
                "to this model (nothing was allocated)."
            )

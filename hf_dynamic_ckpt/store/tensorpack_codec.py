"""How one zstd frame of the L1 container is stored and read back (container version 3; version 2 is read).

A frame's raw bytes are its pieces, byte-grouped where the header says so
(`tensorpack_format`). Version 3 stores them as a table of parts, each raw or zstd
(`encode_parts` / `decode_parts`); version 2 stored them as one zstd frame, which
`decode_whole` still reads so that older stores resume.

Why parts (docs/benchmarks.md, "L1 codec"): on dense AdamW
moments the second byte plane and the low mantissa bytes do not compress at all (ratio
1.000), yet zstd spends ~0.7 ms per MiB finding that out, and the exponent plane compresses
to ~0.29 at ~150-250 MiB per CPU-second with level 1's match finder. Version 3 cuts each
frame at the byte planes of its grouped pieces and every `PART_BYTES`, estimates each
part's ratio from `SAMPLE_SLICES` slices of `SAMPLE_SLICE` bytes spread over it, and
compresses it only when zstd makes it at most `KEEP_RATIO` of its size; the rest is stored
raw (a memcpy to read). Level 1 uses a smaller match finder (`compression_params`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptCheckpointError
from .byteplanes import group
from .fs import read_exact
from .tensorpack_format import (
    DTYPES,
    PART,
    PART_COUNT,
    PART_RAW,
    PART_ZSTD,
    Run,
    parse_parts,
    pieces,
    step_of,
)

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
    """Where a version-3 writer cuts a frame's raw bytes into parts (0, ..., frame size).

    Spans: the byte planes of each grouped piece (top, second, rest), each ungrouped piece
    whole; a span under `MIN_SEGMENT` is merged with the next; then every span is cut into
    equal parts of at most `PART_BYTES`. The reader does not need this (the table says it).
    """
    spans: list[list[int]] = []
    pos = 0
    for run in frame:
        e = entries[run[0]]
        item = DTYPES[e["dtype"]].itemsize
        for _, lo, hi in pieces(run, step_of(e, gce)):
            n = (hi - lo) // item
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
    """A version-3 frame: part table, then each part raw or compressed.

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
    """Fills `out` (the frame's raw bytes) from a version-3 frame: raw parts copied, zstd parts decoded."""
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


def decode_whole(dctx: Any, data: memoryview, out: np.ndarray, where: str) -> None:
    """Fills `out` from a version-2 frame (one zstd frame)."""
    _zstd_into(dctx, data, out, where)


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

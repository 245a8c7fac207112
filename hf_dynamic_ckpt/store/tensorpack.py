"""Level 1: the optimizer / scheduler / AMP-scaler tensors, in a verified container without pickle.

The state dicts are split by `statetree.flatten_state` into a JSON structure
(`optimizer.json`) and a flat `{name: tensor}` dict, which `write_tensor_file` stores in a
small binary container (layout, version 3, in `tensorpack_format`) and `read_tensor_file`
reads back, verifying every frame before a tensor is returned.

Codec `Codec.ZSTD` (default): independent frames of byte-grouped pieces, each a table of
parts stored raw or zstd-compressed (`encode_parts` / `decode_parts`), encoded and decoded in parallel threads
(`ordered_map`; zstandard, xxhash and numpy release the GIL), decoded straight into the output
tensors (via one scratch buffer per thread when a frame must be un-grouped or holds several
tensors). Codec `Codec.NONE`: raw bytes at 64-byte-aligned offsets (`write_raw_payload`),
returned as views of a private memory map after every frame's xxh3 is checked (or copied,
`copy=True`; `map_raw`). Given the manifest's checksum, the whole file is verified in the same
pass (`filecheck`). Any truncation or flipped byte raises `CorruptCheckpointError`; a container
version other than 3 raises `FormatVersionError`.

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

import itertools
import json
import logging
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
from .filecheck import MappedFile, WholeFileCheck
from .fs import create, fsync_file, open_read, read_exact
from .hashing import FileEntry, make_file_entry
from .paced_writer import HashingWriter
from .spec import Codec
from .tensorpack_format import (
    ALIGN,
    CONTAINER_VERSION,
    CRC,
    DTYPES,
    FORMAT_NAME,
    GROUPABLE,
    MAGIC,
    NAMES,
    PART,
    PART_COUNT,
    PART_RAW,
    PART_ZSTD,
    PREFIX,
    Piece,
    Run,
    frames,
    group,
    group_into,
    index_bytes,
    parse_parts,
    pieces,
    raw_frames,
    read_header,
    step_of,
    ungroup_into,
)

logger = logging.getLogger(__name__)

__all__ = ["FRAME_BYTES", "GROUP_CHUNK_ELEMS", "PaceMemory", "read_tensor_file", "resolve_threads", "usable_cpus",
           "write_tensor_file"]

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


def _frame_pieces(frame: list[Run], entries: list[dict[str, Any]], gce: int) -> Iterator[Piece]:
    for run in frame:
        yield from pieces(run, step_of(entries[run[0]], gce))


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
        paced (`bool`, *optional*, defaults to `False`): zstd: stay `paced_writer.PACE_WINDOW` bytes ahead of
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
        fsync_file(f)
        checksum = f.checksum()
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
    file's size before anything is allocated (`tensorpack_format.read_header`). With `checksum`, the whole
    file's checksum is verified too, on another thread in the same pass (`filecheck.WholeFileCheck`).
    Decoding holds the output tensors and a bounded window of the file: the mapped pages of each
    frame are handed back once it is decoded and hashed (`filecheck.MappedFile`), so a load peaks at
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

"""Level 1: the optimizer / scheduler / AMP-scaler tensors, in a verified container without pickle.

The state dicts are split by `statetree.flatten_state` into a JSON structure
(`optimizer.json`) and a flat `{name: tensor}` dict, which `write_tensor_file` stores in a
small binary container (layout, version 3, in `tensorpack_format`) and `read_tensor_file`
reads back (versions 3 and 2), verifying every frame before a tensor is returned.

Codec `Codec.ZSTD` (default): independent frames of byte-grouped pieces, each a table of
parts stored raw or zstd-compressed, whichever the part's sampled ratio favours
(`tensorpack_codec`), encoded and decoded in parallel threads (zstandard, xxhash and numpy
release the GIL), decoded straight into the output tensors (via one scratch buffer per
thread when a frame must be un-grouped or holds several tensors). Codec `Codec.NONE`
(`tensorpack_raw`): raw bytes at 64-byte-aligned offsets, returned as views of a private
memory map after every frame's xxh3 is checked (or copied, `copy=True`). Given the manifest's
checksum, the whole file is verified in the same pass (`filecheck`). Any truncation or
flipped byte raises `CorruptCheckpointError`; a container version other than 2 or 3 raises
`FormatVersionError`.
"""

from __future__ import annotations

import json
import logging
import threading
import zlib
from collections.abc import Iterator, Mapping
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
from . import tensorpack_codec as tpc
from .byteplanes import group_into, ungroup_into
from .filecheck import MappedFile, WholeFileCheck
from .fs import create, fsync_file, open_read
from .hashing import FileEntry, make_file_entry
from .paced_writer import HashingWriter
from .parallel import ordered_map, resolve_threads
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
    PREFIX,
    Piece,
    Run,
    frames,
    index_bytes,
    pieces,
    read_header,
    step_of,
)
from .tensorpack_raw import map_raw, write_raw_payload

logger = logging.getLogger(__name__)

__all__ = ["FRAME_BYTES", "GROUP_CHUNK_ELEMS", "read_tensor_file", "write_tensor_file"]

FRAME_BYTES = 16 << 20
"""Target raw bytes per frame written: the unit of parallel (de)compression and of scratch memory."""
GROUP_CHUNK_ELEMS = 1 << 22
"""Byte-grouping works on runs of this many elements (16 MiB of fp32): bounded extra memory."""


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
                 pool: tpc.FrameBuffers) -> tuple[np.ndarray, np.ndarray | None]:
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
                      pace: tpc.PaceMemory | None = None) -> FileEntry:
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

            local, pool = threading.local(), tpc.FrameBuffers()
            params = tpc.compression_params(level)
            hurry = (lambda: not f.disk_bound) if paced else None

            def compress(frame: list[Run]) -> tuple[list[Any], int, int, np.ndarray | None]:
                cctx = getattr(local, "cctx", None)
                if cctx is None:
                    cctx = local.cctx = zstandard.ZstdCompressor(compression_params=params)
                data, scratch = _frame_input(frame, entries, datas, gce, pool)
                return (*tpc.encode_parts(cctx, data, tpc.part_bounds(frame, entries, gce), hurry), scratch)

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
    """`tensorpack_codec.grouping_pays` with a compressor of `level`."""
    import zstandard

    cctx = zstandard.ZstdCompressor(compression_params=tpc.compression_params(level))
    return lambda data, itemsize: tpc.grouping_pays(cctx, data, itemsize)


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

    Frames are checked (xxh3 of the stored frame; version 3: its part table; zstd content
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
        `FormatVersionError`: the file's container version is neither 2 nor 3 (older or newer); with
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

    decode = tpc.decode_parts if header["version"] == 3 else tpc.decode_whole

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
        decode(dctx, data, buf, f"Tensor file {path}: frame {k}")
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

"""The optimizer tier (L1): state dicts as a JSON structure plus one verified tensor container, without pickle.

`flatten_state` splits the optimizer, scheduler and scaler `state_dict()`s into a JSON structure (``optimizer.json``)
and a flat ``{name: tensor}`` dict, which `write_tensors` stores in ``optimizer.tensors.zst``; `read_tensors` and
`unflatten_state` put them back exactly (int keys stay int, tuples tuples, ``inf``/``nan``/``-0.0`` survive, 0-dim
tensors stay tensors). A decoded structure or container that does not add up is `CorruptCheckpointError`, never
another exception, and nothing is allocated that the file's bytes do not back.

Container version 3 (the one layout written and read)::

    b"HFDCTP01" | header length u64 | header JSON (space-padded: the payload starts 64-byte aligned) | CRC32 u32
    | N frames | N x (stored length u64, xxh3_64 of the stored frame u64) | payload length u64 | N u64
    | CRC32 of the index and those two u32 | b"HFDCTEND"

The header holds ``format``, ``version`` (3), ``codec`` (``"zstd"`` | ``"none"``), ``level``, ``total_bytes``,
``group_chunk_elems``, ``frame_bytes`` and ``tensors`` (``name``, ``dtype``, ``shape``, ``offset``, ``nbytes``,
``byte_grouped``). Codec ``"zstd"``: a tensor's bytes are cut into pieces of at most ``group_chunk_elems`` elements,
packed in order into frames of up to ``frame_bytes`` raw bytes (a larger piece is a frame of its own; `frames`, which
the reader recomputes from the header). A byte-grouped piece of a float tensor is ``[a[:, -1] | a[:, -2] |
a[:, :-2].ravel()]`` of its bytes as an ``(elements, itemsize)`` array: the sign/exponent byte plane, the next plane,
then the low mantissa bytes, which leaves the compressible planes together. A stored frame is a part table and parts::

    part count P u32 | P x (kind u8, raw length u64, stored length u64) | the P parts

covering the frame's raw bytes in order: kind 0 is the bytes themselves, kind 1 one zstd frame of them with its
content size and checksum, at most `ZSTD_MAX_RATIO` raw bytes per stored byte. Codec ``"none"``: the tensors' raw
bytes at 64-byte-aligned offsets (zero padding), frames are ``frame_bytes`` slices of the payload.

Writing compresses each part (one byte plane, or one ungrouped piece) on worker threads and keeps it only where zstd
makes it at most `KEEP_RATIO` of its size. Reading goes through the file once, in order: it hashes every byte for the
manifest's checksum while worker threads check each frame's xxh3 and decode it straight into the output tensors, with
at most two frames per worker in flight, so a load peaks at about the size of what it returns.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError, FormatVersionError, IncompatibleStateError, SaveError
from ..jsonutil import loads_bounded
from .manifest import FILE_CHECKSUM_ALGO, Codec, new_hasher

MAGIC, FOOTER_MAGIC, FORMAT_NAME, VERSION = b"HFDCTP01", b"HFDCTEND", "hf_dynamic_ckpt.tensorpack", 3
PREFIX, CRC, FRAME, FOOTER = struct.Struct("<8sQ"), struct.Struct("<I"), struct.Struct("<QQ"), struct.Struct("<QQ")
PART_COUNT, PART = struct.Struct("<I"), struct.Struct("<BQQ")
FOOTER_SIZE = FOOTER.size + CRC.size + len(FOOTER_MAGIC)
ALIGN, MAX_HEADER = 64, 256 << 20
ZSTD_MAX_RATIO = 1 << 15
"""Most raw bytes one stored byte of zstd can stand for (a 4-byte RLE block yields 128 KiB)."""
FRAME_BYTES, GROUP_CHUNK_ELEMS = 16 << 20, 1 << 22
KEEP_RATIO = 0.9
"""A part is stored compressed only when zstd makes it at most this fraction of its size."""
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}
GROUPABLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
Run = tuple[int, int, int]
"""(tensor index, first byte, end byte): consecutive pieces of one tensor inside one frame."""


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _workers(threads: int) -> int:
    """Worker threads for `threads` (0 or -1: every usable CPU; 1: none, the calling thread does the work)."""
    if threads < -1:
        raise SaveError(f"threads={threads} is invalid; use 0 or -1 (auto), 1 (no workers) or N > 1.")
    n = usable_cpus() if threads in (0, -1) else threads
    return n if n > 1 else 0


def _ordered(pool: ThreadPoolExecutor | None, fn: Callable[..., Any], items: Iterator[Any], limit: int,
             done: Callable[[Any], None]) -> None:
    """`done(fn(item))` for each item in order, at most `limit` items in flight on `pool` (inline without one)."""
    pending: deque[Future[Any]] = deque()
    try:
        for item in items:
            if pool is None:
                done(fn(*item))
                continue
            pending.append(pool.submit(fn, *item))
            while len(pending) >= limit:
                done(pending.popleft().result())
        while pending:
            done(pending.popleft().result())
    finally:
        for fut in pending:
            fut.cancel()


# -- the frame plan -----------------------------------------------------------------------------------------------
def frames(entries: list[dict[str, Any]], gce: int, frame_bytes: int) -> Iterator[list[Run]]:
    """The frames of a zstd container as runs: pieces of at most `gce` elements packed in order until the next would
    pass `frame_bytes` (a larger piece is a frame of its own). Memory is O(runs), however small the pieces."""
    cur: list[Run] = []
    size = 0
    for i, e in enumerate(entries):
        step, n, lo = gce * DTYPES[e["dtype"]].itemsize, e["nbytes"], 0
        while lo < n:
            if size + n - lo <= frame_bytes:  # every remaining piece fits
                cur.append((i, lo, n))
                size += n - lo
                break
            k = (frame_bytes - size) // step or (0 if cur else 1)  # whole pieces that fit
            if k:
                cur.append((i, lo, min(lo + k * step, n)))
                lo = cur[-1][2]
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def _pieces(frame: list[Run], entries: list[dict[str, Any]], gce: int) -> Iterator[tuple[int, int, int]]:
    for i, lo, hi in frame:
        step = gce * DTYPES[entries[i]["dtype"]].itemsize
        for p in range(lo, hi, step):
            yield i, p, min(p + step, hi)


def _planes(data: np.ndarray, itemsize: int, grouped: bool) -> list[np.ndarray]:
    """A piece's raw bytes in stored order: its byte planes when `grouped`, else itself."""
    if not grouped:
        return [data]
    a = data.reshape(-1, itemsize)
    return [a[:, -1], a[:, -2], *([a[:, :-2]] if itemsize > 2 else [])]


# -- writing ------------------------------------------------------------------------------------------------------
def write_tensors(tensors: Mapping[str, torch.Tensor], f: BinaryIO, *, codec: Codec | str = Codec.ZSTD,
                  level: int = 1, threads: int = 0) -> tuple[int, str]:
    """Write `tensors` as a version-3 container into the open file `f` (the caller syncs and closes it).

    Args:
        tensors (`Mapping[str, torch.Tensor]`): tensors by name (`flatten_state`).
        f (`BinaryIO`): a new file, open for binary writing at position 0.
        codec (`Codec`, *optional*, defaults to `"zstd"`): or `"none"` (raw, aligned, larger, quicker to read).
        level (`int`, *optional*, defaults to `1`): zstd level.
        threads (`int`, *optional*, defaults to `0`): parts compressed in parallel (0: every usable CPU).

    Returns:
        `tuple[int, str]`: the file's size and checksum (``"xxh3_128:<hex>"``).

    Raises:
        `SaveError`: a value that is not a strided tensor of a supported dtype.
    """
    import zstandard

    codec = Codec(codec)
    checked: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES.values() or t.layout != torch.strided:
            raise SaveError(f"Tensor {name!r} ({type(t).__name__} {getattr(t, 'dtype', '')}) cannot go into the "
                            f"optimizer tier: expected a strided tensor of {', '.join(sorted(DTYPES))}.")
        checked[name] = t.detach().cpu().contiguous()
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, t in checked.items():
        offset = -(-offset // ALIGN) * ALIGN if codec == Codec.NONE else offset
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes,
                        "byte_grouped": codec == Codec.ZSTD and t.dtype in GROUPABLE and t.numel() > 1})
        offset += nbytes
    header = json.dumps({"format": FORMAT_NAME, "version": VERSION, "codec": codec.value,
                         "level": level if codec == Codec.ZSTD else None, "total_bytes": offset,
                         "group_chunk_elems": GROUP_CHUNK_ELEMS, "frame_bytes": FRAME_BYTES,
                         "tensors": entries}, separators=(",", ":")).encode()
    header += b" " * (-(PREFIX.size + len(header) + CRC.size) % ALIGN)  # the payload starts aligned
    datas = [t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8) for t in checked.values()]
    hasher, size, index, local = new_hasher(), 0, [], threading.local()

    def put(chunk: Any) -> None:
        nonlocal size
        hasher.update(chunk)
        f.write(chunk)
        size += memoryview(chunk).nbytes

    def encode(frame: list[Run]) -> list[Any]:
        cctx = getattr(local, "cctx", None) or zstandard.ZstdCompressor(level=level, write_checksum=True)
        local.cctx, table, parts = cctx, [], []
        for i, lo, hi in _pieces(frame, entries, GROUP_CHUNK_ELEMS):
            for plane in _planes(datas[i][lo:hi], checked[entries[i]["name"]].element_size(),
                                 entries[i]["byte_grouped"]):
                raw = np.ascontiguousarray(plane).reshape(-1)
                packed = cctx.compress(raw.data)
                keep = len(packed) <= KEEP_RATIO * raw.nbytes
                table.append(PART.pack(int(keep), raw.nbytes, len(packed) if keep else raw.nbytes))
                parts.append(packed if keep else raw)
        return [PART_COUNT.pack(len(table)) + b"".join(table), *parts]

    def sealed(chunks: list[Any]) -> None:
        digest = xxhash.xxh3_64()
        for chunk in chunks:
            digest.update(chunk)
            put(chunk)
        index.append(FRAME.pack(sum(memoryview(c).nbytes for c in chunks), digest.intdigest()))

    for chunk in (PREFIX.pack(MAGIC, len(header)), header, CRC.pack(zlib.crc32(header))):
        put(chunk)
    start = size
    if codec == Codec.ZSTD:
        workers = _workers(threads)
        with ThreadPoolExecutor(workers, thread_name_prefix="optpack") if workers else _NoPool() as pool:
            _ordered(pool, encode, ((fr,) for fr in frames(entries, GROUP_CHUNK_ELEMS, FRAME_BYTES)), 2 * workers,
                     sealed)
    else:  # codec "none": frame by frame, each a slice of the aligned payload
        for lo in range(0, offset, FRAME_BYTES):
            buf = bytearray(min(FRAME_BYTES, offset - lo))
            _copy_spans(entries, datas, lo, buf, into_frame=True)
            sealed([buf])
    body = b"".join(index) + FOOTER.pack(size - start, len(index))
    put(body + CRC.pack(zlib.crc32(body)) + FOOTER_MAGIC)
    f.flush()
    return size, f"{FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}"


def _copy_spans(entries: list[dict[str, Any]], datas: list[np.ndarray], lo: int, frame: Any, *,
                into_frame: bool) -> None:
    """Copy between the payload slice ``[lo, lo + len(frame))`` of a "none" container and the tensors it covers."""
    view = np.frombuffer(frame, np.uint8) if into_frame else frame
    for e, data in zip(entries, datas):
        a, b = max(lo, e["offset"]), min(lo + view.size, e["offset"] + e["nbytes"])
        if a < b and into_frame:
            view[a - lo : b - lo] = data[a - e["offset"] : b - e["offset"]]
        elif a < b:
            data[a - e["offset"] : b - e["offset"]] = view[a - lo : b - lo]


class _NoPool:
    """Stands for a thread pool where the calling thread does the work."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- reading ------------------------------------------------------------------------------------------------------
def _bad(path: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"Tensor file {path} {what}; the file is corrupt.")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _check_header(h: Any) -> None:
    """Raises `ValueError`/`KeyError`/`TypeError` for a header whose fields do not add up."""
    if h["codec"] not in ("zstd", "none") or not (_count(h["group_chunk_elems"]) and h["group_chunk_elems"] > 0
                                                    and _count(h["frame_bytes"]) and h["frame_bytes"] > 0):
        raise ValueError(f"codec {h['codec']!r}, group_chunk_elems or frame_bytes is invalid")
    end = 0
    for e in h["tensors"]:
        dtype, shape = DTYPES[e["dtype"]], e["shape"]
        if not (isinstance(e["name"], str) and isinstance(e["byte_grouped"], bool) and isinstance(shape, list)
                and all(_count(s) for s in shape) and _count(e["offset"]) and _count(e["nbytes"])):
            raise ValueError(f"malformed tensor entry {str(e)[:80]}")
        aligned = h["codec"] == "none" and e["offset"] % ALIGN == 0 and end <= e["offset"] < end + ALIGN
        if not (e["offset"] == end or aligned) or e["nbytes"] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"inconsistent offset/size for {e['name']!r}")
        if e["byte_grouped"] and (h["codec"] != "zstd" or dtype not in GROUPABLE):
            raise ValueError(f"{e['name']!r} cannot be byte-grouped")
        end = e["offset"] + e["nbytes"]
    if end != h["total_bytes"]:
        raise ValueError("tensor sizes do not add up to total_bytes")


def read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int, list[tuple[int, int]]]:
    """Validate a container's header, version, declared sizes, frame index and footer before anything is allocated.

    Returns:
        `tuple`: (header, payload offset, frames as ``(stored length, xxh3_64)``).

    Raises:
        `FormatVersionError`: a container version other than 3.
        `CorruptCheckpointError`: anything else that does not add up.
    """
    size = os.fstat(f.fileno()).st_size
    magic, hlen = PREFIX.unpack(f.read(PREFIX.size).ljust(PREFIX.size, b"\0"))
    if magic != MAGIC or hlen > min(MAX_HEADER, size):
        raise _bad(path, f"is not an hf_dynamic_ckpt tensor file or is truncated (magic {magic!r}, a {hlen}-byte "
                         f"header in {size} bytes)")
    raw, crc = f.read(hlen), f.read(CRC.size)
    if len(crc) != CRC.size or CRC.unpack(crc)[0] != zlib.crc32(raw):
        raise _bad(path, "has a truncated or damaged header (CRC mismatch)")
    try:
        h = loads_bounded(raw)
        if h["format"] != FORMAT_NAME or not _count(h["version"]):
            raise ValueError(f"format {h['format']!r}, version {h['version']!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise _bad(path, f"has an invalid header ({e})") from e
    if h["version"] != VERSION:
        why = "newer than this library: upgrade hf_dynamic_ckpt" if h["version"] > VERSION else \
            "a layout of development builds that no release wrote: resume from the weights only"
        raise FormatVersionError(f"Tensor file {path} has container version {h['version']}, this library reads "
                                 f"version {VERSION} ({why}).")
    try:
        _check_header(h)
    except (ValueError, KeyError, TypeError) as e:
        raise _bad(path, f"has an invalid header ({e})") from e
    start = PREFIX.size + hlen + CRC.size
    f.seek(max(start, size - FOOTER_SIZE))
    footer = f.read(FOOTER_SIZE)
    if len(footer) != FOOTER_SIZE or not footer.endswith(FOOTER_MAGIC):
        raise _bad(path, f"is truncated or has extra bytes ({size} bytes, no footer)")
    payload, n = FOOTER.unpack_from(footer)
    if start + payload + n * FRAME.size + FOOTER_SIZE != size:
        raise _bad(path, f"is truncated or has extra bytes: {size} bytes on disk, the footer declares "
                         f"{start + payload + n * FRAME.size + FOOTER_SIZE}")
    f.seek(start + payload)
    body = f.read(n * FRAME.size)
    if zlib.crc32(body + footer[: FOOTER.size]) != CRC.unpack_from(footer, FOOTER.size)[0]:
        raise _bad(path, "has a damaged frame index (CRC mismatch)")
    total, index = h["total_bytes"], list(FRAME.iter_unpack(body))
    backed = payload if h["codec"] == "none" else payload * ZSTD_MAX_RATIO
    if total > backed:
        raise _bad(path, f"declares {total} bytes of tensors but holds a {payload}-byte payload, which cannot decode "
                         f"to more than {backed} bytes (nothing was allocated)")
    if h["codec"] == "none":
        expected = len(range(0, total, h["frame_bytes"])) if payload == total else -1
    else:  # counted no further than one past the index: bounded work for a hostile plan
        expected = sum(1 for _, _ in zip(frames(h["tensors"], h["group_chunk_elems"], h["frame_bytes"]),
                                         range(len(index) + 1)))
    if sum(n for n, _ in index) != payload or expected != len(index):
        raise _bad(path, f"has a frame index ({len(index)} frames, {sum(n for n, _ in index)} bytes) that does not "
                         f"match its header ({payload} payload bytes)")
    return h, start, index


def _parts(data: memoryview, want: int, where: str) -> Iterator[tuple[int, int, memoryview]]:
    """A frame's parts as (kind, raw length, stored bytes), its table checked against its length and raw size first."""
    count = PART_COUNT.unpack_from(data)[0] if len(data) >= PART_COUNT.size else -1
    pos = PART_COUNT.size + max(count, 0) * PART.size
    if count < 1 or count > want or pos > len(data):
        raise CorruptCheckpointError(f"{where} has a part table of {count} parts that does not fit its {len(data)} "
                                     f"bytes and {want} raw bytes; the file is corrupt.")
    table, total = list(PART.iter_unpack(bytes(data[PART_COUNT.size : pos]))), 0
    for j, (kind, raw, stored) in enumerate(table):
        if kind not in (0, 1) or not 0 < raw <= (stored if kind == 0 else stored * ZSTD_MAX_RATIO) or \
                (kind == 0 and raw != stored):
            raise CorruptCheckpointError(
                f"{where}, part {j}: kind {kind}, {raw} raw bytes in {stored} stored bytes is not a valid part (raw "
                f"parts: equal lengths; zstd parts: at most {ZSTD_MAX_RATIO} raw bytes per stored byte); the file is "
                "corrupt.")
        total += raw
    if pos + sum(s for _, _, s in table) != len(data) or total != want:
        raise CorruptCheckpointError(f"{where} declares {total} bytes, the header {want}; the file is corrupt.")
    for kind, raw, stored in table:
        yield kind, raw, data[pos : pos + stored]
        pos += stored


def _unzstd(dctx: Any, part: memoryview, out: np.ndarray, where: str) -> None:
    """Decode one zstd part exactly into `out`, its declared content size checked before anything is decoded."""
    import zstandard

    declared = zstandard.frame_content_size(part)
    if declared != out.nbytes:
        raise CorruptCheckpointError(f"{where} declares {declared} bytes, the header {out.nbytes}; the file is "
                                     "corrupt.")
    with dctx.stream_reader(part, read_across_frames=False) as z:
        view, got = out.data.cast("B"), 0
        while got < out.nbytes and (n := z.readinto(view[got:])):
            got += n
        if got != out.nbytes or z.read(1):  # the extra read completes the frame: its checksum is verified
            raise CorruptCheckpointError(f"{where} does not hold the {out.nbytes} bytes it declares.")


def read_tensors(path: Path, f: io.BufferedReader, *, checksum: str | None = None, max_numel: int | None = None,
                 threads: int = 0) -> dict[str, torch.Tensor]:
    """Read and verify a container written by `write_tensors` (any codec) from the open file `f`.

    Args:
        path (`Path`): the file's path, for messages.
        f (`BinaryIO`): the file, open for binary reading.
        checksum (`str`, *optional*): the manifest's ``"<algo>:<hex>"`` of the whole file, verified in the same pass
            before any tensor is returned.
        max_numel (`int`, *optional*): the most elements a tensor may declare (`state.optimizer.state_numel_bound`).
        threads (`int`, *optional*, defaults to `0`): frames decoded in parallel (0: every usable CPU).

    Raises:
        `FormatVersionError`: another container version, in a file that has the manifest's checksum.
        `CorruptCheckpointError`: missing, truncated, altered, hostile or trailing data.
        `IncompatibleStateError`: a tensor declares more than `max_numel` elements (nothing was allocated).
    """
    import zstandard

    try:
        hasher = new_hasher(checksum.partition(":")[0]) if checksum else None
    except ValueError as e:
        raise CorruptCheckpointError(f"Tensor file {path}: {e}") from None
    try:
        h, start, index = read_header(f, path)
    except FormatVersionError:
        if checksum and hasher is not None:  # a flipped version byte is damage, not a newer file
            f.seek(0)
            while chunk := f.read(1 << 20):
                hasher.update(chunk)
            if f"{checksum.partition(':')[0]}:{hasher.hexdigest()}" != checksum:
                raise _bad(path, "fails its checksum") from None
        raise
    entries, gce = h["tensors"], h["group_chunk_elems"]
    for t in entries:
        if max_numel is not None and t["nbytes"] // DTYPES[t["dtype"]].itemsize > max_numel:
            raise IncompatibleStateError(
                f"Tensor file {path}: tensor {t['name']!r} declares shape {t['shape']} "
                f"({t['nbytes'] // DTYPES[t['dtype']].itemsize} elements), more than any state of this model's "
                f"parameters holds ({max_numel}); this optimizer state does not belong to this model (nothing was "
                "allocated).")
    out = [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in entries]
    dests = [t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8) for t in out]
    local = threading.local()

    def decode(k: int, data: bytearray, digest: int, frame: list[Run] | tuple[int, int]) -> None:
        where = f"Tensor file {path}: frame {k}"
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise CorruptCheckpointError(f"{where} fails its xxh3 checksum; the file is corrupt.")
        if isinstance(frame, tuple):  # codec "none": a slice of the payload
            _copy_spans(entries, dests, frame[0], np.frombuffer(data, np.uint8), into_frame=False)
            return
        want = sum(hi - lo for _, lo, hi in frame)
        i0, lo0, hi0 = frame[0]
        direct = len(frame) == 1 and not entries[i0]["byte_grouped"]
        if not direct and getattr(local, "buf", np.empty(0, np.uint8)).size < want:
            local.buf = np.empty(want, np.uint8)
        buf = dests[i0][lo0:hi0] if direct else local.buf[:want]
        dctx = getattr(local, "dctx", None) or zstandard.ZstdDecompressor()
        local.dctx, pos = dctx, 0
        for j, (kind, raw, part) in enumerate(_parts(memoryview(data), want, where)):
            if kind == 0:
                buf[pos : pos + raw] = np.frombuffer(part, np.uint8)
            else:
                _unzstd(dctx, part, buf[pos : pos + raw], f"{where}, part {j}")
            pos += raw
        if direct:
            return
        pos = 0
        for i, lo, hi in _pieces(frame, entries, gce):
            itemsize = DTYPES[entries[i]["dtype"]].itemsize
            for plane in _planes(dests[i][lo:hi], itemsize, entries[i]["byte_grouped"]):
                n = plane.size
                plane[...] = buf[pos : pos + n].reshape(plane.shape)
                pos += n

    plan: Iterator[Any] = iter([(lo, min(lo + h["frame_bytes"], h["total_bytes"]))
                                for lo in range(0, h["total_bytes"], h["frame_bytes"])]) if h["codec"] == "none" \
        else frames(entries, gce, h["frame_bytes"])

    def items() -> Iterator[tuple[Any, ...]]:
        f.seek(0)
        prefix = f.read(start)
        if hasher is not None:
            hasher.update(prefix)
        for k, ((n, digest), frame) in enumerate(zip(index, plan)):
            data = bytearray(n)
            if f.readinto(data) != n:
                raise _bad(path, "is shorter than its index says")
            if hasher is not None:
                hasher.update(data)
            yield k, data, digest, frame

    workers = _workers(threads) if len(index) > 1 else 0
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="optpack") if workers else _NoPool() as pool:
            _ordered(pool, decode, items(), 2 * workers, lambda _: None)
    except zstandard.ZstdError as e:
        raise _bad(path, f"failed decompression or its checksum ({e})") from e
    if hasher is not None:
        hasher.update(f.read())
        if f"{checksum.partition(':')[0]}:{hasher.hexdigest()}" != checksum:  # type: ignore[union-attr]
            raise CorruptCheckpointError(f"Tensor file {path}: checksum mismatch ({hasher.hexdigest()} != "
                                         f"{checksum}), the file is corrupt.")
    return {str(e["name"]): t for e, t in zip(entries, out)}


# -- the state tree -----------------------------------------------------------------------------------------------
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__npscalar__")


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples, scalars, tensors, arrays) into JSON and ``{path: tensor}``.

    Each tensor becomes ``{"__tensor__": "state/0/exp_avg"}`` (its `/`-joined path); what JSON cannot express is a
    one-key tagged object; dicts with plain `str` keys stay plain objects, so `jq` reads the structure.

    Raises:
        `SaveError`: a value that cannot be stored without pickle (the message names its path and type).
    """
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, [], tensors), tensors


# The walks are module functions, not closures: a recursive closure is a reference cycle that would keep the tensors
# it closes over alive until the garbage collector runs (a whole optimizer tier, after a failed decode).
def _encode(x: Any, path: list[str], tensors: dict[str, torch.Tensor]) -> Any:
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"__float__": repr(float(x))}
    if isinstance(x, torch.Tensor | np.ndarray):
        name, n = "/".join(path) or "tensor", 1
        while name in tensors:
            name, n = f"{'/'.join(path) or 'tensor'}#{n}", n + 1
        tensors[name] = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
        return {"__tensor__" if isinstance(x, torch.Tensor) else "__ndarray__": name}
    if isinstance(x, np.generic):
        return {"__npscalar__": [x.dtype.str, base64.b64encode(x.tobytes()).decode("ascii")]}
    if isinstance(x, torch.dtype):
        return {"__dtype__": str(x).removeprefix("torch.")}
    if isinstance(x, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(x)]
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, [*path, k], tensors) for k, v in x.items()}
        return {"__dict__": [[_encode(k, [*path, "key"], tensors), _encode(v, [*path, str(k)], tensors)]
                             for k, v in x.items()]}
    raise SaveError(f"State value at {'/'.join(path) or '<root>'!r} is a {type(x).__module__}.{type(x).__name__}, "
                    "which cannot be stored without pickle; keep only tensors, numbers, strings, None, lists, tuples "
                    "and dicts in the state dict (e.g. drop lambdas from the scheduler state).")


def unflatten_state(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`; a missing tensor or a malformed tag is `CorruptCheckpointError`."""
    return _decode(structure, tensors)


def _decode(x: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1 and next(iter(x)) in _TAGS:
        ((tag, val),) = x.items()
        try:
            return _decode_tag(tag, val, tensors)
        except CorruptCheckpointError:
            raise
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise CorruptCheckpointError(f"Malformed {tag} entry in the state structure: {val!r:.80}") from e
    return {k: _decode(v, tensors) for k, v in x.items()}


def _decode_tag(tag: str, val: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag in ("__tensor__", "__ndarray__"):
        if not isinstance(val, str) or val not in tensors:
            raise CorruptCheckpointError(f"State structure refers to tensor {val!r:.80}, which the tensor file does "
                                         "not hold.")
        return tensors[val] if tag == "__tensor__" else tensors[val].numpy()
    if tag == "__tuple__":
        return tuple(_decode(v, tensors) for v in val)
    if tag == "__dict__":
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in val}
    if tag == "__float__":
        return float({"inf": "inf", "-inf": "-inf", "nan": "nan"}[val])
    if tag == "__bytes__":
        return base64.b64decode(val, validate=True)
    if tag == "__dtype__":
        return DTYPES[val]
    return np.frombuffer(base64.b64decode(val[1], validate=True), dtype=np.dtype(val[0]))[0]


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k

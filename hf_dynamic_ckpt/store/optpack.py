"""The optimizer tier (L1): state dicts as a JSON structure plus one verified tensor container, without pickle.

`flatten_state` / `unflatten_state` round-trip the structure exactly, `write_tensors` / `read_tensors` the container
(version 3; layout and reader in docs/internals.md). A structure or container that does not add up is
`CorruptCheckpointError`, and nothing is allocated that the file's bytes do not back.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import mmap
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
PREFIX, CRC, FRAME, PART = struct.Struct("<8sQ"), struct.Struct("<I"), struct.Struct("<QQ"), struct.Struct("<BQQ")
FOOTER_SIZE, ALIGN, FRAME_BYTES, GROUP_CHUNK_ELEMS = FRAME.size + CRC.size + 8, 64, 16 << 20, 1 << 22
ZSTD_MAX_RATIO, KEEP_RATIO, PROBE = 1 << 15, 0.9, 16 << 10  # a 4-byte RLE block of zstd yields 128 KiB
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}
GROUPABLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
Run = tuple[int, int, int]
"""(tensor index, first byte, end byte): consecutive pieces of one tensor inside one frame."""


def usable_cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pipeline(fn: Callable[..., Any], items: Iterator[tuple[Any, ...]], threads: int,
              done: Callable[[Any], None] = lambda _: None) -> None:
    """`done(fn(*item))` for each item in order on `threads` threads (0, -1: every usable CPU), at most two per thread
    in flight (`items` is read as they finish: the bound on memory)."""
    if threads < -1:
        raise SaveError(f"threads={threads} is invalid; use 0 or -1 (auto), 1 (no workers) or N > 1.")
    workers, pending = max(1, usable_cpus() if threads <= 0 else threads), deque[Future[Any]]()
    with ThreadPoolExecutor(workers, thread_name_prefix="optpack") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, *item))
                while len(pending) >= 2 * workers:
                    done(pending.popleft().result())
            while pending:
                done(pending.popleft().result())
        finally:
            for fut in pending:
                fut.cancel()


def frames(entries: list[dict[str, Any]], gce: int, frame_bytes: int) -> Iterator[list[Run]]:
    """The frame plan of a zstd container (O(runs) memory, however small the pieces)."""
    cur: list[Run] = []
    size = 0
    for i, e in enumerate(entries):
        step, n, lo = gce * DTYPES[e["dtype"]].itemsize, e["nbytes"], 0
        while lo < n:
            if size + n - lo <= frame_bytes:  # every remaining piece fits
                cur.append((i, lo, n))
                size += n - lo
                break
            if k := (frame_bytes - size) // step or (0 if cur else 1):  # whole pieces that fit
                cur.append((i, lo, min(lo + k * step, n)))
                lo = cur[-1][2]
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def _pieces(frame: list[Run], entries: list[dict[str, Any]], gce: int,
            datas: list[np.ndarray]) -> Iterator[tuple[np.ndarray, int, bool]]:
    """The frame's pieces in stored order: (a view of the piece's bytes in `datas`, itemsize, byte grouped)."""
    for i, lo, hi in frame:
        size = DTYPES[entries[i]["dtype"]].itemsize
        for p in range(lo, hi, gce * size):
            yield datas[i][p : min(p + gce * size, hi)], size, entries[i]["byte_grouped"]


def _blocks(words: np.ndarray) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """``(lo, hi, words[lo:hi], scratch)`` over cache-sized blocks, one scratch array for all: whole-word shifts there
    are ~5x the strided byte copies."""
    scratch = np.empty(min(words.size, 1 << 16), words.dtype)
    for lo in range(0, words.size, 1 << 16):
        hi = min(lo + (1 << 16), words.size)
        yield lo, hi, words[lo:hi], scratch[: hi - lo]


def _planes(data: np.ndarray, size: int) -> list[np.ndarray]:
    """A grouped piece's planes ``a[:, -1], a[:, -2], a[:, :-2]`` of ``a = data.reshape(-1, size)``."""
    n, a = data.size // size, data.reshape(-1, size)
    if size not in (2, 4):
        return [np.ascontiguousarray(p).reshape(-1) for p in (a[:, -1], a[:, -2], a[:, :-2])]
    out = [np.empty(n, np.uint8), np.empty(n, np.uint8), *([np.empty(2 * n, np.uint8)] if size == 4 else [])]
    for lo, hi, w, tmp in _blocks(data.view(f"<u{size}")):
        for plane, shift in zip(out, (8 * size - 8, 8 * size - 16)):
            plane[lo:hi] = np.right_shift(w, shift, out=tmp)  # truncated to the byte
        if size == 4:
            out[2][2 * lo : 2 * hi].view("<u2")[:] = w
    return out


def _ungroup(src: np.ndarray, dst: np.ndarray, size: int) -> None:
    """A grouped piece's bytes `dst` from its planes `src` (the word-wise path is most of a read's speed)."""
    n, a = dst.size // size, dst.reshape(-1, size)
    if size not in (2, 4):
        a[:, -1], a[:, -2], a[:, :-2] = src[:n], src[n : 2 * n], src[2 * n :].reshape(n, size - 2)
        return
    for lo, hi, w, tmp in _blocks(dst.view(f"<u{size}")):
        w[:] = src[2 * n + 2 * lo : 2 * n + 2 * hi].view("<u2") if size == 4 else src[n + lo : n + hi]
        for plane, shift in ((src[n + lo : n + hi], 16), (src[lo:hi], 24)) if size == 4 else ((src[lo:hi], 8),):
            tmp[:] = plane
            w |= np.left_shift(tmp, shift, out=tmp)


def _spans(entries: list[dict[str, Any]], lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
    """(tensor index, its first and end byte, the frame's first byte) of payload ``[lo, hi)`` of a "none" container."""
    for i, e in enumerate(entries):
        if (a := max(lo, e["offset"])) < (b := min(hi, e["offset"] + e["nbytes"])):
            yield i, a - e["offset"], b - e["offset"], a - lo


def _bytes(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Each contiguous CPU tensor's bytes, a flat uint8 array sharing its memory."""
    return [t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8) for t in tensors]


def write_tensors(tensors: Mapping[str, torch.Tensor], f: BinaryIO, *, codec: Codec | str = Codec.ZSTD,
                  level: int = 1, threads: int = 0) -> tuple[int, str]:
    """Write `tensors` (`flatten_state`'s) as a container into the new file `f` (the caller syncs it): zstd at `level`
    on `threads` threads (`_pipeline`), or `codec="none"` raw and aligned. Returns the file's size and checksum
    (``"xxh3_128:<hex>"``); a value that is not a strided tensor of a supported dtype is a `SaveError`."""
    import zstandard

    codec, checked, entries, offset = Codec(codec), [], [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES.values() or t.layout != torch.strided:
            raise SaveError(f"Tensor {name!r} ({type(t).__name__} {getattr(t, 'dtype', '')}) cannot go into the "
                            f"optimizer tier: expected a strided tensor of {', '.join(sorted(DTYPES))}.")
        checked.append(t := t.detach().cpu().contiguous())
        offset = -(-offset // ALIGN) * ALIGN if codec == Codec.NONE else offset
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": t.nbytes,
                        "byte_grouped": codec == Codec.ZSTD and t.dtype in GROUPABLE and t.numel() > 1})
        offset += t.nbytes
    header = json.dumps({"format": FORMAT_NAME, "version": VERSION, "codec": codec.value, "level": level,
                         "total_bytes": offset, "group_chunk_elems": GROUP_CHUNK_ELEMS, "frame_bytes": FRAME_BYTES,
                         "tensors": entries}, separators=(",", ":")).encode()
    header += b" " * (-(PREFIX.size + len(header) + CRC.size) % ALIGN)
    datas, hasher, index, local = _bytes(checked), new_hasher(), [], threading.local()

    def put(*chunks: Any) -> int:
        digest = xxhash.xxh3_64()
        for chunk in chunks:
            hasher.update(chunk)
            digest.update(chunk)
            f.write(chunk)
        return digest.intdigest()

    def encode(frame: list[Run]) -> list[Any]:
        cctx = local.cctx = getattr(local, "cctx", None) or zstandard.ZstdCompressor(level=level, write_checksum=True)
        table, parts = [], []
        for data, size, grouped in _pieces(frame, entries, GROUP_CHUNK_ELEMS, datas):
            for raw in _planes(data, size) if grouped else [data]:
                # A large part is compressed only if four slices across it pay: the low mantissa bytes of trained
                # floats never compress, and compressing them whole would double the writer's CPU.
                step = (raw.nbytes - PROBE) // 3
                pays = raw.nbytes <= 16 * PROBE or sum(len(cctx.compress(raw[j * step : j * step + PROBE].data))
                                                       for j in range(4)) <= KEEP_RATIO * 4 * PROBE
                packed = cctx.compress(raw.data) if pays else raw
                keep = len(packed) <= KEEP_RATIO * raw.nbytes  # compressed only where it pays
                table.append(PART.pack(int(keep), raw.nbytes, len(packed) if keep else raw.nbytes))
                parts.append(packed if keep else raw)
        return [struct.pack("<I", len(table)) + b"".join(table), *parts]

    def sealed(chunks: list[Any]) -> None:
        index.append(FRAME.pack(sum(memoryview(c).nbytes for c in chunks), put(*chunks)))

    put(PREFIX.pack(MAGIC, len(header)), header, CRC.pack(zlib.crc32(header)))
    start = f.tell()
    if codec == Codec.ZSTD:
        _pipeline(encode, ((fr,) for fr in frames(entries, GROUP_CHUNK_ELEMS, FRAME_BYTES)), threads, sealed)
    for lo in range(0, offset, FRAME_BYTES) if codec == Codec.NONE else ():
        buf = np.zeros(min(FRAME_BYTES, offset - lo), np.uint8)  # a slice of the aligned payload, zero padded
        for i, a, b, at in _spans(entries, lo, lo + buf.size):
            buf[at : at + b - a] = datas[i][a:b]
        sealed([buf])
    body = b"".join(index) + FRAME.pack(f.tell() - start, len(index))
    put(body + CRC.pack(zlib.crc32(body)) + FOOTER_MAGIC)
    f.flush()
    return f.tell(), f"{FILE_CHECKSUM_ALGO}:{hasher.hexdigest()}"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int, list[tuple[int, int]]]:
    """A container's header, payload offset and frames (stored length, xxh3_64), all checked against each other and
    the file's size before anything is allocated: `FormatVersionError` for another version, else
    `CorruptCheckpointError`."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"Tensor file {path} {what}; the file is corrupt.")

    size = os.fstat(f.fileno()).st_size
    magic, hlen = PREFIX.unpack(f.read(PREFIX.size).ljust(PREFIX.size, b"\0"))
    if magic != MAGIC or hlen > min(256 << 20, size):
        raise bad(f"is not an hf_dynamic_ckpt tensor file or is truncated (magic {magic!r}, a {hlen}-byte header in "
                  f"{size} bytes)")
    raw, crc = f.read(hlen), f.read(CRC.size)
    if len(crc) != CRC.size or CRC.unpack(crc)[0] != zlib.crc32(raw):
        raise bad("has a truncated or damaged header (CRC mismatch)")
    try:
        h, end = loads_bounded(raw), 0
        if h["format"] != FORMAT_NAME or not _count(version := h["version"]):
            raise ValueError(f"format {h['format']!r}, version {h['version']!r}")
        if version != VERSION:
            raise FormatVersionError(f"Tensor file {path} has container version {version}, this library reads "
                                     f"version {VERSION} (" + ("newer than this library: upgrade hf_dynamic_ckpt" if
                                                              version > VERSION else "a layout of development builds "
                                                              "that no release wrote: resume from the weights only")
                                     + ").")
        if h["codec"] not in ("zstd", "none") or not all(_count(h[k]) and h[k] for k in ("group_chunk_elems",
                                                                                          "frame_bytes")):
            raise ValueError(f"codec {h['codec']!r}, group_chunk_elems or frame_bytes is invalid")
        for e in h["tensors"]:
            shape, dtype, aligned = e["shape"], DTYPES[e["dtype"]], h["codec"] == "none" and e["offset"] % ALIGN == 0
            if not (isinstance(e["name"], str) and isinstance(e["byte_grouped"], bool) and isinstance(shape, list)
                    and all(_count(s) for s in shape) and _count(e["offset"]) and _count(e["nbytes"])
                    and (e["offset"] == end or (aligned and end <= e["offset"] < end + ALIGN))
                    and e["nbytes"] == math.prod(shape) * dtype.itemsize
                    and (not e["byte_grouped"] or (h["codec"] == "zstd" and dtype in GROUPABLE))):
                raise ValueError(f"malformed or inconsistent tensor entry {str(e)[:80]}")
            end = e["offset"] + e["nbytes"]
        if end != h["total_bytes"]:
            raise ValueError("tensor sizes do not add up to total_bytes")
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, FormatVersionError):
            raise
        raise bad(f"has an invalid header ({e})") from e
    start = PREFIX.size + hlen + CRC.size
    f.seek(max(start, size - FOOTER_SIZE))
    if len(footer := f.read(FOOTER_SIZE)) != FOOTER_SIZE or not footer.endswith(FOOTER_MAGIC):
        raise bad(f"is truncated or has extra bytes ({size} bytes, no footer)")
    payload, n = FRAME.unpack_from(footer)
    if start + payload + n * FRAME.size + FOOTER_SIZE != size:
        raise bad(f"is truncated or has extra bytes: {size} bytes on disk, the footer declares "
                  f"{start + payload + n * FRAME.size + FOOTER_SIZE}")
    f.seek(start + payload)
    if zlib.crc32((body := f.read(n * FRAME.size)) + footer[: FRAME.size]) != CRC.unpack_from(footer, FRAME.size)[0]:
        raise bad("has a damaged frame index (CRC mismatch)")
    index, backed = list(FRAME.iter_unpack(body)), payload if h["codec"] == "none" else payload * ZSTD_MAX_RATIO
    if h["total_bytes"] > backed:
        raise bad(f"declares {h['total_bytes']} bytes of tensors but holds a {payload}-byte payload, which cannot "
                  f"decode to more than {backed} bytes (nothing was allocated)")
    if h["codec"] == "none":
        expected = len(range(0, payload, h["frame_bytes"])) if payload == h["total_bytes"] else -1
    else:  # counted no further than one past the index: bounded work for a hostile plan
        expected = sum(1 for _ in zip(frames(h["tensors"], h["group_chunk_elems"], h["frame_bytes"]),
                                      range(len(index) + 1)))
    if sum(k for k, _ in index) != payload or expected != len(index):
        raise bad(f"has a frame index ({len(index)} frames, {sum(k for k, _ in index)} bytes) that does not match "
                  f"its header ({payload} payload bytes)")
    return h, start, index


def _decode_parts(dctx: Any, data: memoryview, out: np.ndarray, where: str) -> None:
    """Fill `out` (a frame's raw bytes) from its stored bytes: the part table checked first against the frame's
    length and raw size, each zstd part's declared content size against the table before it is decoded."""
    import zstandard

    count = struct.unpack_from("<I", data)[0] if len(data) >= 4 else -1
    if count < 1 or count > out.nbytes or (pos := 4 + count * PART.size) > len(data):
        raise CorruptCheckpointError(f"{where} has a part table of {count} parts that does not fit its {len(data)} "
                                     f"bytes and {out.nbytes} raw bytes; the file is corrupt.")
    table = list(PART.iter_unpack(bytes(data[4:pos])))
    for j, (kind, raw, stored) in enumerate(table):
        if kind not in (0, 1) or not 0 < raw <= stored * (ZSTD_MAX_RATIO if kind else 1) or (not kind and raw < stored):
            raise CorruptCheckpointError(
                f"{where}, part {j}: kind {kind}, {raw} raw bytes in {stored} stored bytes is not a valid part (raw "
                f"parts: equal lengths; zstd parts: at most {ZSTD_MAX_RATIO} raw bytes per stored byte); the file is "
                "corrupt.")
    if pos + sum(s for _, _, s in table) != len(data) or (total := sum(r for _, r, _ in table)) != out.nbytes:
        raise CorruptCheckpointError(f"{where} declares {total} bytes, the header {out.nbytes}; the file is corrupt.")
    at = 0
    for j, (kind, raw, stored) in enumerate(table):
        part, dst = data[pos : pos + stored], out[at : at + raw]
        if not kind:
            dst[:] = np.frombuffer(part, np.uint8)
        elif (declared := zstandard.frame_content_size(part)) != raw:
            raise CorruptCheckpointError(f"{where}, part {j} declares {declared} bytes, the header {raw}; the file "
                                         "is corrupt.")
        else:
            with dctx.stream_reader(part, read_across_frames=False) as z:
                got = 0
                while got < raw and (k := z.readinto(dst.data[got:])):
                    got += k
                if got != raw or z.read(1):  # the extra read completes the frame: its checksum is verified
                    raise CorruptCheckpointError(f"{where}, part {j} does not hold the {raw} bytes it declares.")
        pos, at = pos + stored, at + raw


def read_tensors(path: Path, f: BinaryIO, *, checksum: str | None = None, max_numel: int | None = None,
                 threads: int = 0) -> dict[str, torch.Tensor]:
    """Read and verify a container from the open file `f` at `path`, decoding frames on `threads` threads; `checksum`
    (the manifest's ``"<algo>:<hex>"``) is verified in the same pass. `FormatVersionError`: another version in a file
    that has that checksum; `IncompatibleStateError`: a tensor of more than `max_numel` elements (nothing allocated);
    `CorruptCheckpointError`: missing, truncated, altered, hostile or trailing data."""
    import zstandard

    algo = (checksum or ":").partition(":")[0]
    try:
        hasher = new_hasher(algo)
    except ValueError as e:
        raise CorruptCheckpointError(f"Tensor file {path}: {e}") from None
    try:
        h, start, index = read_header(f, path)
    except FormatVersionError:
        f.seek(0)  # a flipped version byte is damage, not a newer file
        if checksum and f"{algo}:{hashlib.file_digest(f, lambda: hasher).hexdigest()}" != checksum:  # type: ignore[arg-type]
            raise CorruptCheckpointError(f"Tensor file {path} fails its checksum; the file is corrupt.") from None
        raise
    entries, gce = h["tensors"], h["group_chunk_elems"]
    for t in entries:
        if max_numel is not None and (numel := t["nbytes"] // DTYPES[t["dtype"]].itemsize) > max_numel:
            raise IncompatibleStateError(
                f"Tensor file {path}: tensor {t['name']!r} declares shape {t['shape']} ({numel} elements), more than "
                f"any state of this model's parameters holds ({max_numel}); this optimizer state does not belong to "
                "this model (nothing was allocated).")
    out = [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in entries]
    dests = _bytes(out)
    # Frames are decoded from a read-only map, each frame's pages handed back once decoded: the load holds its output.
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view, local = memoryview(mm), threading.local()

    def decode(k: int, at: int, n: int, expected: int, frame: Any) -> None:
        with view[at : at + n] as data:
            if xxhash.xxh3_64_intdigest(data) != expected:
                raise CorruptCheckpointError(f"Tensor file {path}: frame {k} fails its xxh3 checksum; the file is "
                                             "corrupt.")
            for i, a, b, pos in _spans(entries, *frame) if isinstance(frame, tuple) else ():  # codec "none"
                dests[i][a:b] = np.frombuffer(data, np.uint8, b - a, pos)
            if isinstance(frame, list):
                want, (i0, lo0, hi0) = sum(hi - lo for _, lo, hi in frame), frame[0]
                direct = len(frame) == 1 and not entries[i0]["byte_grouped"]  # the frame is a slice of the tensor
                if not direct and getattr(local, "buf", np.empty(0, np.uint8)).size < want:
                    local.buf = np.empty(want, np.uint8)
                local.dctx = getattr(local, "dctx", None) or zstandard.ZstdDecompressor()
                _decode_parts(local.dctx, data, buf := dests[i0][lo0:hi0] if direct else local.buf[:want],
                              f"Tensor file {path}: frame {k}")
                pos = 0
                for piece, size, grouped in () if direct else _pieces(frame, entries, gce, dests):
                    if grouped:
                        _ungroup(buf[pos : pos + piece.size], piece, size)
                    else:
                        piece[:] = buf[pos : pos + piece.size]
                    pos += piece.size
        if (lo := -(-at // mmap.PAGESIZE) * mmap.PAGESIZE) < (hi := (at + n) // mmap.PAGESIZE * mmap.PAGESIZE):
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def items() -> Iterator[tuple[Any, ...]]:
        hasher.update(view[:start])  # the header: checked by `read_header`
        total, fb, at = h["total_bytes"], h["frame_bytes"], start
        plan = [(lo, min(lo + fb, total)) for lo in range(0, total, fb)] if h["codec"] == "none" else \
            frames(entries, gce, fb)
        for k, ((n, expected), frame) in enumerate(zip(index, plan)):
            if hasattr(os, "posix_fadvise"):  # a cold cache: the disk reads ahead while these frames decode
                os.posix_fadvise(f.fileno(), at, 64 << 20, os.POSIX_FADV_WILLNEED)
            hasher.update(view[at : at + n])  # in file order, while earlier frames decode
            yield k, at, n, expected, frame
            at += n
        hasher.update(view[at:])

    try:
        _pipeline(decode, items(), threads if len(index) > 1 else 1)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"Tensor file {path} failed decompression or its checksum ({e}); the file is "
                                     "corrupt.") from e
    finally:
        view.release()
        with contextlib.suppress(BufferError):  # a traceback may still hold a frame's view: closed when it goes
            mm.close()
    if checksum and f"{algo}:{hasher.hexdigest()}" != checksum:
        raise CorruptCheckpointError(f"Tensor file {path}: checksum mismatch ({hasher.hexdigest()} != {checksum}), "
                                     "the file is corrupt.")
    return {str(e["name"]): t for e, t in zip(entries, out)}


# -- the state tree -----------------------------------------------------------------------------------------------
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__npscalar__")


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples, scalars, tensors, arrays) into JSON and ``{path: tensor}``: a tensor
    becomes ``{"__tensor__": "state/0/exp_avg"}``, what JSON cannot express a one-key tagged object, and dicts with
    plain `str` keys stay plain objects (`jq` reads them). `SaveError` names a value that would need pickle."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, [], tensors), tensors


# The walks are module functions, not closures: a recursive closure is a reference cycle, which would keep the tensors
# it closes over alive until the garbage collector runs (a whole optimizer tier, after a failed decode).
def _encode(x: Any, path: list[str], tensors: dict[str, torch.Tensor]) -> Any:
    if x is None or isinstance(x, bool | str | int):
        return x if not isinstance(x, int) or isinstance(x, bool) else int(x)
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
    if isinstance(x, torch.dtype | bytes | bytearray):
        return {"__dtype__": str(x).removeprefix("torch.")} if isinstance(x, torch.dtype) else \
            {"__bytes__": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, tuple | list):
        items = [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(x)]
        return {"__tuple__": items} if isinstance(x, tuple) else items
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
    if isinstance(structure, list):
        return [unflatten_state(v, tensors) for v in structure]
    if not isinstance(structure, dict):
        return structure
    if len(structure) != 1 or (tag := next(iter(structure))) not in _TAGS:
        return {k: unflatten_state(v, tensors) for k, v in structure.items()}
    val = structure[tag]
    try:
        if tag in ("__tensor__", "__ndarray__"):
            if not isinstance(val, str) or val not in tensors:
                raise CorruptCheckpointError(f"State structure refers to tensor {val!r:.80}, which the tensor file "
                                             "does not hold.")
            return tensors[val] if tag == "__tensor__" else tensors[val].numpy()
        if tag in ("__tuple__", "__dict__"):
            return tuple(unflatten_state(v, tensors) for v in val) if tag == "__tuple__" else {
                _hashable(unflatten_state(k, tensors)): unflatten_state(v, tensors) for k, v in val}
        return {"__float__": lambda: float({"inf": "inf", "-inf": "-inf", "nan": "nan"}[val]),
                "__bytes__": lambda: base64.b64decode(val, validate=True), "__dtype__": lambda: DTYPES[val],
                "__npscalar__": lambda: np.frombuffer(base64.b64decode(val[1], validate=True),
                                                      dtype=np.dtype(val[0]))[0]}[tag]()
    except CorruptCheckpointError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"Malformed {tag} entry in the state structure: {val!r:.80}") from e


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k

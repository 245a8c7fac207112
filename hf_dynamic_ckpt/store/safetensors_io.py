"""The safetensors file format, written and read without the `safetensors` package (L0, blobs, FSDP2 shards).

Writing: a small streaming serialiser that produces the same bytes as
`safetensors.torch.save_file` for the same tensors and metadata (one metadata entry), streams
them through a `HashingWriter` (writeback requested every 8 MiB) and hashes them while the final
fsync runs. Reading: the header is parsed and fully validated before anything is allocated
(types, dtypes, shapes, integer offsets that tile the data section exactly, so truncation
or appended bytes are caught), then zero-copy views of a private memory map are returned
(`MADV_WILLNEED` readahead), or tensors read into process memory. Memory used to reject a
hostile file is bounded by the file's size: nothing is allocated that its bytes do not back.

Why not the package (safetensors 0.8, `scripts/bench_safetensors_io.py`, 2 shared cores, best of
5-9 rounds, three runs): what the store needs from a write is the file fsynced and its checksum.
`save_file` + fsync + a checksum pass took 1.37-1.45x our time for a 240 MB fp32 L0, 1.20-1.28x for
the same in bf16 (120 MB) and 1.01-1.28x for a 28 MB LoRA adapter; without the checksum pass it was
still 1.05-1.15x on the full L0 (our writeback requests let the disk work while the bytes are still
coming), 0.83-1.11x on the adapter. For reading there is no speed reason: `load_file` and
`safe_open` took 0.66-1.40x our time with every byte touched (warm cache; the spread is the shared
machine's noise, both map the file). The reader stays for what the store promises beyond the format: errors that
name the tensor and the fault (the store's tests assert them), a symbolic link refused rather than
followed (`fs.open_read`), and the bound above on what a hostile header can allocate.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, SaveError
from ..jsonutil import loads_bounded
from .fs import create, open_read, read_exact
from .hashing import HASH_CHUNK, check_hasher, hasher_for
from .tensorpack import HashingWriter

# torch dtype -> (safetensors code, position in safetensors' dtype order). safetensors sorts
# tensors by descending dtype order, then by name; the order was read off safetensors 0.8
# output and is checked against `save_file` in tests/unit/test_weights.py.
DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 2),
    torch.float8_e5m2: ("F8_E5M2", 3),
    torch.float8_e4m3fn: ("F8_E4M3", 4),
    torch.int16: ("I16", 5),
    torch.uint16: ("U16", 6),
    torch.float16: ("F16", 7),
    torch.bfloat16: ("BF16", 8),
    torch.int32: ("I32", 9),
    torch.uint32: ("U32", 10),
    torch.float32: ("F32", 11),
    torch.complex64: ("C64", 12),
    torch.float64: ("F64", 13),
    torch.int64: ("I64", 14),
    torch.uint64: ("U64", 15),
}
_BY_CODE = {code: dtype for dtype, (code, _) in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit

Entry = tuple[str, torch.dtype, list[int], int, int]
"""(key, dtype, shape, begin, end) of one tensor in the data section."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def check_tensor(key: str, value: Any) -> torch.Tensor:
    """`value` as a detached CPU tensor safetensors can store, else `SaveError` naming `key`."""
    if not isinstance(value, torch.Tensor):
        raise SaveError(
            f"Weight {key!r} is a {type(value).__name__}, expected a torch.Tensor or BlobRef; "
            "pass the model's state_dict() (or the PEFT adapter dict)."
        )
    if value.layout != torch.strided:
        raise SaveError(f"Weight {key!r} has layout {value.layout}; convert it with `.to_dense()` first.")
    if value.dtype not in DTYPES:
        supported = ", ".join(sorted(dtype_name(d) for d in DTYPES))
        raise SaveError(
            f"Weight {key!r} has dtype {dtype_name(value.dtype)}, which safetensors cannot store; "
            f"cast it to one of: {supported}."
        )
    if value.device.type != "cpu":
        value = value.detach().to("cpu")
    return value.detach()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when already contiguous."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The safetensors header (padded to 8 bytes) and the key order of the data section."""
    import json

    order = sorted(tensors, key=lambda k: (-DTYPES[tensors[k].dtype][1], k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    buf = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    buf += b" " * ((8 - len(buf) % 8) % 8)
    return buf, order


def serialized_size(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """Bytes `write_safetensors(tensors, ..., metadata)` writes."""
    header, _ = _header(tensors, metadata)
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                      metadata: Mapping[str, str] | None = None) -> str:
    """Writes `tensors` to `path` in safetensors format, fsyncs it, returns its checksum.

    The bytes equal `safetensors.torch.save_file(tensors, path, metadata)` when `metadata`
    has at most one entry (safetensors orders several metadata entries by hash, randomly;
    here they are sorted). Tensors must be CPU, strided, of a safetensors dtype, and must
    not share storage (see `weights.save_weights`).
    """
    meta = dict(sorted((metadata or {}).items()))
    header, order = _header(tensors, meta)
    with create(path) as raw:
        f = HashingWriter(raw, defer=True)  # tensors do not change during the call
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for key in order:
            t = tensors[key]
            data = raw_bytes(t)
            if data.nbytes:
                f.write(data)
                if not t.is_contiguous():
                    f.checksum()  # hash now, so the contiguous temporary is freed at once
        return f.fsync_and_checksum()


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def parse_header(f: Any, size: int) -> tuple[int, list[Entry], dict[str, str]]:
    """Validates a safetensors header; returns (data start, entries sorted by offset, metadata).

    Raises:
        `ValueError`: anything that does not add up (the caller names the file).
    """
    if size < 8:
        raise ValueError(f"{size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(size - 8, _MAX_HEADER):
        raise ValueError(f"header length {n} does not fit a {size}-byte file")
    header = loads_bounded(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a str -> str map")
    entries: list[Entry] = []
    for key, info in header.items():
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise ValueError(f"tensor {key!r} has no dtype")
        dtype = _BY_CODE.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key!r} has unknown dtype {info['dtype']!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(_int(d) for d in shape)):
            raise ValueError(f"tensor {key!r} has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
            raise ValueError(f"tensor {key!r} has data_offsets {offsets!r}; expected two non-negative integers")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: offsets {begin}..{end} do not match {dtype_name(dtype)}{shape}")
        entries.append((key, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e[3], e[4]))
    expected = 0
    for key, _, _, begin, end in entries:
        if begin != expected:
            raise ValueError(f"tensor {key!r} starts at {begin}, expected {expected} (overlap or gap)")
        expected = end
    if 8 + n + expected != size:
        raise ValueError(f"data section ends at {8 + n + expected} but the file has {size} bytes (truncated or "
                         "extended)")
    return 8 + n, entries, metadata


def open_tensors(path: Path, *, mmap: bool, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Reads a safetensors file: zero-copy views of a private (copy-on-write) memory map,
    or tensors read into process memory. The header is fully validated first.

    Raises:
        `CorruptCheckpointError`: missing, a link, unreadable, or invalid.
    """
    import mmap as mmap_mod

    try:
        f = open_read(path)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"{what} file {path} is missing.") from e
    except OSError as e:  # UnsafePathError (a link), EIO, ...
        raise CorruptCheckpointError(f"{what} file {path} cannot be read ({e}).") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        try:
            base, entries, metadata = parse_header(f, size)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise CorruptCheckpointError(
                f"{what} file {path} is not a valid safetensors file ({e}); the checkpoint is corrupt, "
                "restore an older one."
            ) from e
        mm = None
        if mmap and size > base:
            mm = mmap_mod.mmap(f.fileno(), 0, access=mmap_mod.ACCESS_COPY)  # writes never reach the file
            if hasattr(mm, "madvise"):
                mm.madvise(mmap_mod.MADV_WILLNEED)  # start readahead; pages map without one fault each
        out: dict[str, torch.Tensor] = {}
        for key, dtype, shape, begin, end in entries:
            if end == begin:
                out[key] = torch.empty(shape, dtype=dtype)
            elif mm is not None:
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=base + begin)
                out[key] = raw.view(dtype).view(shape)
            else:
                t = torch.empty(shape, dtype=dtype)
                f.seek(base + begin)
                read_exact(f, t.reshape(-1).view(torch.uint8).numpy().data,
                           f"{what} file {path} is truncated inside tensor {key!r}.")
                out[key] = t
    return out, metadata


def read_into(path: Path, targets: Mapping[str, torch.Tensor], *, what: str, checksum: str | None = None,
              on_write: Callable[[], None] | None = None) -> set[str]:
    """Read the tensors of a safetensors file straight into `targets` (`read()` into their memory: no mapping of the
    file, no tensor in between); returns the keys read.

    A key is read where its target is a contiguous CPU tensor of the stored dtype and shape; the others are left
    to the caller. The file's header is validated as `open_tensors` does. With `checksum` (the manifest's
    ``"<algo>:<hex>"``) every byte of the file is hashed as it is read, each chunk right after it lands in its
    target (one pass over the file: the bytes no target takes go through a scratch buffer); without it the caller
    has verified the file. `on_write` is called once, right before the first byte goes into a target.

    Raises:
        `CorruptCheckpointError`: the file is missing, unreadable, invalid, shorter than its header says, or (with
            `checksum`) its checksum differs; the targets read before the fault hold the file's data, and after a
            checksum mismatch they hold the file's (corrupt) bytes.
    """
    try:
        f = open_read(path)
    except OSError as e:  # FileNotFoundError, UnsafePathError (a link), EIO, ...
        raise CorruptCheckpointError(f"{what} file {path} cannot be read ({e}).") from e
    hasher = None if checksum is None else hasher_for(checksum, f"{what} file {path}")
    scratch: memoryview | None = None
    read: set[str] = set()
    with f:
        size = os.fstat(f.fileno()).st_size
        try:
            base, entries, _ = parse_header(f, size)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise CorruptCheckpointError(f"{what} file {path} is not a valid safetensors file ({e}).") from e
        pos = 0  # with a hasher: every byte before `pos` is hashed, in file order

        def skip_to(offset: int) -> None:  # hash [pos, offset) through the scratch buffer
            nonlocal pos, scratch
            if hasher is None or offset <= pos:
                return
            if scratch is None:
                scratch = memoryview(bytearray(min(HASH_CHUNK, max(offset - pos, 1 << 16))))
            f.seek(pos)
            while pos < offset:
                part = scratch[: min(len(scratch), offset - pos)]
                read_exact(f, part, f"{what} file {path} is shorter than its header says.")
                hasher.update(part)
                pos += len(part)

        try:
            for key, dtype, shape, begin, end in entries:  # in file order: one sequential pass
                t = targets.get(key)
                if t is None or t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != shape \
                        or not t.is_contiguous():
                    continue
                if end > begin:
                    skip_to(base + begin)
                    f.seek(base + begin)
                    if on_write is not None:
                        on_write()
                        on_write = None
                    view = t.detach().reshape(-1).view(torch.uint8).numpy().data
                    for start in range(0, view.nbytes, HASH_CHUNK):
                        part = view[start : start + HASH_CHUNK]
                        read_exact(f, part, f"{what} file {path} is truncated inside tensor {key!r}.")
                        if hasher is not None:
                            hasher.update(part)  # the chunk just read: still in the CPU's caches
                    pos = base + end
                read.add(key)
            skip_to(size)
        except OSError as e:
            raise CorruptCheckpointError(f"{what} file {path} cannot be read ({e}).") from e
    if hasher is not None:
        assert checksum is not None
        check_hasher(hasher, checksum, f"{what} file {path}")
    return read

"""Level 1: optimizer / scheduler / AMP-scaler state without pickle.

Two halves:

- `flatten_state` / `unflatten_state` split any nested state dict into a JSON structure
  and a flat `{name: tensor}` dict, and put it back together exactly: int keys stay int,
  tuples stay tuples, `inf`/`nan`/`-0.0` survive, 0-dim tensors (AdamW's `step`) stay
  tensors. Tagged JSON objects carry what JSON cannot express (a one-key object whose key
  is in `_TAGS`); plain dicts with str keys stay plain objects, so `jq` reads them.
- `write_tensor_file` / `read_tensor_file`: a small binary container, compressed with
  zstandard. Layout::

      magic  b"HFDCTP01"                       8 bytes
      header length (little-endian u64)         8 bytes
      header JSON (utf-8)                       names, dtypes, shapes, offsets, flags
      header CRC32 (little-endian u32)          4 bytes
      one zstd frame (content size + xxhash64 content checksum) of the tensors' bytes
      footer: compressed frame length (u64) + b"HFDCTEND"   16 bytes

  Float tensors can be byte-grouped before compression: the top byte of every element
  (sign + exponent), then the second byte (exponent/high mantissa), then the remaining
  low mantissa bytes, which gives zstd long runs of similar exponent bytes (see `_group`).
  The file is written and read tensor by tensor, and grouped in runs of
  `GROUP_CHUNK_ELEMS` elements, so the extra memory is one 16-64 MiB buffer.
  Any truncation or flipped byte raises `CorruptCheckpointError`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..constants import Tier
from ..errors import CorruptCheckpointError, SaveError
from .checksum import FileEntry, HashingWriter, fsync_file, make_file_entry

logger = logging.getLogger(__name__)

MAGIC = b"HFDCTP01"
CONTAINER_VERSION = 1
_PREFIX = struct.Struct("<8sQ")
_CRC = struct.Struct("<I")
_FOOTER = struct.Struct("<Q8s")
FOOTER_MAGIC = b"HFDCTEND"
_MAX_HEADER = 256 << 20

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "complex64": torch.complex64, "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
GROUP_CHUNK_ELEMS = 1 << 22
"""Byte-grouping works on runs of this many elements (16 MiB of fp32): bounded extra memory."""
_GROUPABLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}

# ---------------------------------------------------------------------------------------
# flatten / unflatten

_T_TENSOR = "__tensor__"
_T_NDARRAY = "__ndarray__"
_T_TUPLE = "__tuple__"
_T_DICT = "__dict__"
_T_FLOAT = "__float__"
_T_BYTES = "__bytes__"
_T_DTYPE = "__dtype__"
_T_NPSCALAR = "__npscalar__"
_TAGS = {_T_TENSOR, _T_NDARRAY, _T_TUPLE, _T_DICT, _T_FLOAT, _T_BYTES, _T_DTYPE, _T_NPSCALAR}


def _is_plain_key(k: Any) -> bool:
    return isinstance(k, str) and not k.startswith("__")


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Splits a nested state (dict/list/tuple/scalars/tensors) into JSON and tensors.

    Args:
        obj (`Any`): e.g. `optimizer.state_dict()`, `scheduler.state_dict()`,
            `scaler.state_dict()`, or a dict of several of them.

    Returns:
        `tuple[Any, dict[str, torch.Tensor]]`: a JSON-serialisable structure in which each
        tensor is replaced by `{"__tensor__": name}`, and `{name: tensor}` (names are the
        `/`-joined paths, e.g. `"state/0/exp_avg"`).

    Raises:
        `SaveError`: a value of a type that cannot be stored without pickle (the message
        names its path and type).

    Example:
    ```python
    >>> structure, tensors = flatten_state(optimizer.state_dict())  # doctest: +SKIP
    >>> unflatten_state(structure, tensors)["param_groups"][0]["betas"]  # doctest: +SKIP
    (0.9, 0.999)
    ```
    """
    tensors: dict[str, torch.Tensor] = {}

    def name_for(path: list[str]) -> str:
        base = "/".join(path) or "tensor"
        name, n = base, 1
        while name in tensors:
            name, n = f"{base}#{n}", n + 1
        return name

    def enc(x: Any, path: list[str]) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)  # IntEnum and friends become plain ints
        if isinstance(x, float):
            if math.isfinite(x):
                return float(x)
            return {_T_FLOAT: repr(float(x))}  # 'inf', '-inf', 'nan'
        if isinstance(x, torch.Tensor):
            name = name_for(path)
            tensors[name] = x
            return {_T_TENSOR: name}
        if isinstance(x, np.ndarray):
            name = name_for(path)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
            return {_T_NDARRAY: name}
        if isinstance(x, np.generic):
            return {_T_NPSCALAR: [x.dtype.str, base64.b64encode(x.tobytes()).decode("ascii")]}
        if isinstance(x, torch.dtype):
            return {_T_DTYPE: _NAMES.get(x, str(x))}
        if isinstance(x, (bytes, bytearray)):
            return {_T_BYTES: base64.b64encode(bytes(x)).decode("ascii")}
        if isinstance(x, tuple):
            return {_T_TUPLE: [enc(v, [*path, str(i)]) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, [*path, str(i)]) for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(_is_plain_key(k) for k in x):
                return {k: enc(v, [*path, k]) for k, v in x.items()}
            return {_T_DICT: [[enc(k, [*path, "key"]), enc(v, [*path, str(k)])] for k, v in x.items()]}
        where = "/".join(path) or "<root>"
        raise SaveError(
            f"State value at {where!r} is a {type(x).__module__}.{type(x).__name__}, which cannot be "
            "stored without pickle; keep only tensors, numbers, strings, None, lists, tuples and "
            "dicts in the state dict (e.g. drop lambdas from the scheduler state)."
        )

    return enc(obj, []), tensors


def unflatten_state(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`.

    Args:
        structure (`Any`): the JSON structure from `flatten_state` (after a JSON round trip).
        tensors (`Mapping[str, torch.Tensor]`): the tensors by name.

    Returns:
        `Any`: the original object, with tensors taken from `tensors`.

    Raises:
        `CorruptCheckpointError`: the structure names a tensor that is missing, or holds a
        malformed tag.
    """

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if len(x) == 1:
            (tag, val), = x.items()
            if tag in _TAGS:
                try:
                    return _decode_tag(tag, val, dec, tensors)
                except CorruptCheckpointError:
                    raise
                except (KeyError, ValueError, TypeError, IndexError) as e:
                    raise CorruptCheckpointError(f"Malformed {tag} entry in the state structure: {val!r:.80}") from e
        return {k: dec(v) for k, v in x.items()}

    return dec(structure)


def _decode_tag(tag: str, val: Any, dec: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag in (_T_TENSOR, _T_NDARRAY):
        if val not in tensors:
            raise CorruptCheckpointError(f"State structure refers to tensor {val!r}, which the tensor file does not hold.")
        return tensors[val] if tag == _T_TENSOR else tensors[val].numpy()
    if tag == _T_TUPLE:
        return tuple(dec(v) for v in val)
    if tag == _T_DICT:
        return {_hashable(dec(k)): dec(v) for k, v in val}
    if tag == _T_FLOAT:
        if val not in ("inf", "-inf", "nan"):
            raise ValueError(val)
        return float(val)
    if tag == _T_BYTES:
        return base64.b64decode(val, validate=True)
    if tag == _T_DTYPE:
        return _DTYPES[val]
    if tag == _T_NPSCALAR:
        return np.frombuffer(base64.b64decode(val[1], validate=True), dtype=np.dtype(val[0]))[0]
    raise ValueError(tag)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


# ---------------------------------------------------------------------------------------
# tensor container


def _check(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SaveError(f"Tensor {name!r} is a {type(t).__name__}, expected a torch.Tensor.")
    if t.dtype not in _NAMES:
        raise SaveError(
            f"Tensor {name!r} has dtype {t.dtype}, which the L1 container does not support; "
            f"supported: {', '.join(sorted(_DTYPES))}. Cast it before saving."
        )
    if t.layout != torch.strided:
        raise SaveError(f"Tensor {name!r} has layout {t.layout}; convert it with `.to_dense()` first.")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """Row-major bytes of a contiguous CPU tensor as a uint8 array (a view, no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _group(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Splits elements into [top byte plane][second byte plane][remaining low bytes].

    The two top bytes hold sign, exponent and the high mantissa bits (the compressible
    part of optimizer state); the low mantissa bytes are close to random and stay
    interleaved, which halves the cost of the shuffle (about 1.2 GB/s vs 0.7 GB/s for
    a full byte transpose here) for the same compression ratio on AdamW state. For
    2-byte types this is the full byte transpose.
    """
    n = raw.size // itemsize
    out = np.empty(raw.size, dtype=np.uint8)
    out[:n] = raw[itemsize - 1 :: itemsize]
    out[n : 2 * n] = raw[itemsize - 2 :: itemsize]
    if itemsize == 4:
        out[2 * n :].view(np.uint16)[:] = raw.view(np.uint16)[0::2]
    elif itemsize > 2:
        out[2 * n :].reshape(n, itemsize - 2)[...] = raw.reshape(n, itemsize)[:, : itemsize - 2]
    return out


def _ungroup_into(grouped: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    n = out.size // itemsize
    out[itemsize - 1 :: itemsize] = grouped[:n]
    out[itemsize - 2 :: itemsize] = grouped[n : 2 * n]
    if itemsize == 4:
        out.view(np.uint16)[0::2] = grouped[2 * n :].view(np.uint16)
    elif itemsize > 2:
        out.reshape(n, itemsize)[:, : itemsize - 2] = grouped[2 * n :].reshape(n, itemsize - 2)


def resolve_threads(threads: int) -> int:
    """Maps the user-facing thread count to zstandard's (`0`/`-1`: all usable CPUs)."""
    if threads in (0, -1):
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            n = os.cpu_count() or 1
        return n if n > 1 else 0
    if threads < -1:
        raise SaveError(f"threads={threads} is invalid; use 0 or -1 (auto), 1 (no workers) or N > 1.")
    return 0 if threads == 1 else threads


def write_tensor_file(tensors: Mapping[str, torch.Tensor], path: Path, *, level: int = 3, threads: int = 0,
                      byte_group: bool = True) -> FileEntry:
    """Writes tensors to a zstd-compressed container and fsyncs it.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): tensors by name (e.g. from `flatten_state`).
        path (`Path`): the file to create (overwritten if present).
        level (`int`, *optional*, defaults to `3`): zstd compression level (1-22; <= 3 keeps
            up with a disk).
        threads (`int`, *optional*, defaults to `0`): compression threads; `0` or `-1` use
            every CPU this process may run on, `1` compresses in the calling thread.
        byte_group (`bool`, *optional*, defaults to `True`): store float tensors as byte
            planes before compression (smaller output on optimizer state, see
            docs/benchmarks.md).

    Returns:
        `FileEntry`: size and checksum of the written file (tier `"optimizer"`).

    Raises:
        `SaveError`: a tensor of an unsupported dtype or layout.
    """
    import zstandard

    checked = {name: _check(name, t) for name, t in tensors.items()}
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, t in checked.items():
        nbytes = t.numel() * t.element_size()
        grouped = byte_group and t.dtype in _GROUPABLE and t.numel() > 1
        entries.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes, "byte_grouped": grouped})
        offset += nbytes
    header = json.dumps({"format": "hf_dynamic_ckpt.tensorpack", "version": CONTAINER_VERSION,
                         "codec": "zstd", "level": level, "total_bytes": offset,
                         "group_chunk_elems": GROUP_CHUNK_ELEMS, "tensors": entries},
                        separators=(",", ":")).encode("utf-8")
    cctx = zstandard.ZstdCompressor(level=level, threads=resolve_threads(threads),
                                    write_checksum=True, write_content_size=True)
    with open(path, "wb") as raw:
        f = HashingWriter(raw)
        f.write(_PREFIX.pack(MAGIC, len(header)))
        f.write(header)
        f.write(_CRC.pack(zlib.crc32(header)))
        frame_start = f.size
        with cctx.stream_writer(cast(Any, f), size=offset, closefd=False, write_size=1 << 20) as z:
            for entry in entries:
                t = checked[str(entry["name"])]
                data = _bytes_of(t)
                if not entry["byte_grouped"]:
                    if data.nbytes:
                        z.write(data.data)
                    continue
                step = GROUP_CHUNK_ELEMS * t.element_size()  # bounded extra memory per tensor
                for lo in range(0, data.nbytes, step):
                    z.write(_group(data[lo : lo + step], t.element_size()).data)
        f.write(_FOOTER.pack(f.size - frame_start, FOOTER_MAGIC))
        fsync_file(f)
        checksum = f.checksum()
    return make_file_entry(path, tier=Tier.OPTIMIZER.value, rank=None, checksum=checksum)


def read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """Validates a container's header and footer; returns (header, frame offset, frame length)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                raise CorruptCheckpointError(f"Tensor file {path} is truncated ({len(prefix)} bytes).")
            magic, hlen = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise CorruptCheckpointError(f"{path} is not an hf_dynamic_ckpt tensor file (magic {magic!r}).")
            if hlen > _MAX_HEADER:
                raise CorruptCheckpointError(f"Tensor file {path} declares a {hlen}-byte header; the file is corrupt.")
            header_bytes = f.read(hlen)
            crc = f.read(_CRC.size)
            start = _PREFIX.size + hlen + _CRC.size
            footer = b""
            if size >= start + _FOOTER.size:
                f.seek(size - _FOOTER.size)
                footer = f.read(_FOOTER.size)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"Tensor file {path} is missing.") from e
    if len(header_bytes) != hlen or len(crc) != _CRC.size:
        raise CorruptCheckpointError(f"Tensor file {path} is truncated inside its header.")
    if _CRC.unpack(crc)[0] != zlib.crc32(header_bytes):
        raise CorruptCheckpointError(f"Tensor file {path} has a damaged header (CRC mismatch).")
    if len(footer) != _FOOTER.size:
        raise CorruptCheckpointError(f"Tensor file {path} is truncated ({size} bytes, no footer).")
    frame_len, end_magic = _FOOTER.unpack(footer)
    if end_magic != FOOTER_MAGIC or start + frame_len + _FOOTER.size != size:
        raise CorruptCheckpointError(
            f"Tensor file {path} is truncated or has extra bytes: {size} bytes on disk, footer "
            f"{end_magic!r} declares {start + frame_len + _FOOTER.size}."
        )
    try:
        header = json.loads(header_bytes)
        _validate_header(header)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"Tensor file {path} has an invalid header: {e}") from e
    return header, start, frame_len


def _validate_header(h: dict[str, Any]) -> None:
    if h["format"] != "hf_dynamic_ckpt.tensorpack" or h["codec"] != "zstd":
        raise ValueError(f"unknown format/codec {h['format']!r}/{h['codec']!r}")
    if h["version"] > CONTAINER_VERSION:
        raise ValueError(f"container version {h['version']} is newer than this library ({CONTAINER_VERSION}); upgrade hf_dynamic_ckpt")
    if not (isinstance(h["group_chunk_elems"], int) and h["group_chunk_elems"] > 0):
        raise ValueError(f"bad group_chunk_elems {h['group_chunk_elems']!r}")
    offset = 0
    for e in h["tensors"]:
        dtype = _DTYPES[e["dtype"]]
        shape = e["shape"]
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"bad shape {shape!r} for {e['name']!r}")
        if e["offset"] != offset or e["nbytes"] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"inconsistent offset/size for {e['name']!r}")
        offset += e["nbytes"]
    if offset != h["total_bytes"]:
        raise ValueError("tensor sizes do not add up to total_bytes")


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """Reads a container written by `write_tensor_file`, verifying it completely.

    Args:
        path (`Path`): the file.

    Returns:
        `dict[str, torch.Tensor]`: the tensors, in the order they were written.

    Raises:
        `CorruptCheckpointError`: missing, truncated, altered, or trailing data; raised
        before any tensor is returned.
    """
    import zstandard

    path = Path(path)
    header, start, frame_len = read_header(path)
    out: dict[str, torch.Tensor] = {}
    try:
        with open(path, "rb") as f:
            f.seek(start)
            params = zstandard.get_frame_parameters(f.read(min(frame_len, 18)))
            if params.content_size != header["total_bytes"]:
                raise CorruptCheckpointError(
                    f"Tensor file {path}: the compressed frame declares {params.content_size} bytes, "
                    f"the header {header['total_bytes']}; the file is corrupt."
                )
            f.seek(start)
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(cast(Any, _Bounded(f, frame_len)), read_across_frames=False, closefd=False) as z:
                for e in header["tensors"]:
                    dtype = _DTYPES[e["dtype"]]
                    t = torch.empty(e["shape"], dtype=dtype)
                    dest = _bytes_of(t)
                    if not e["byte_grouped"]:
                        _read_exact(z, dest, path, e["name"])
                    else:
                        step = header["group_chunk_elems"] * dtype.itemsize
                        chunk = np.empty(min(step, dest.size), dtype=np.uint8)
                        for lo in range(0, dest.size, step):
                            part = chunk[: min(step, dest.size - lo)]
                            _read_exact(z, part, path, e["name"])
                            _ungroup_into(part, dest[lo : lo + part.size], dtype.itemsize)
                    out[e["name"]] = t
                if z.read(1):  # also completes the frame, which verifies its checksum
                    raise CorruptCheckpointError(f"Tensor file {path} holds more data than its header declares.")
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(
            f"Tensor file {path} failed decompression or its checksum ({e}); the file is corrupt."
        ) from e
    return out


class _Bounded:
    """Read-only view of the next `limit` bytes of a file (keeps zstd off the footer)."""

    def __init__(self, f: Any, limit: int) -> None:
        self._f, self._left = f, limit

    def read(self, size: int = -1) -> bytes:
        size = self._left if size < 0 else min(size, self._left)
        data = self._f.read(size)
        self._left -= len(data)
        return data


def _read_exact(z: Any, buf: np.ndarray, path: Path, name: str) -> None:
    view = buf.data.cast("B")
    got = 0
    while got < view.nbytes:
        n = z.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError(f"Tensor file {path} is truncated inside tensor {name!r}.")
        got += n

"""Level 0: trainable weights as safetensors (uncompressed, memory-mappable, exact).

The file is written by a small streaming serialiser that produces the same bytes as
`safetensors.torch.save_file` for the same tensors and metadata (`{"format": "pt"}`), so a
LoRA checkpoint's `weights.safetensors` is a drop-in `adapter_model.safetensors`. Writing
it ourselves avoids the full in-memory copy `save_file` makes, and checksums the bytes on
their way to disk. Reading parses and fully validates the header (offsets must tile the
data section exactly, so truncation or appended bytes are caught) and returns zero-copy
views of a private memory map (`MADV_WILLNEED` readahead): about 15x faster than
`safe_open` on a warm page cache, and no code execution. Any safetensors reader (e.g.
`safetensors.torch.load_file`) reads the files too.

Two things safetensors cannot express on its own are handled here:

- Shared storage (tied weights, e.g. Qwen2 `embed_tokens.weight` / `lm_head.weight`):
  the tensor is stored once under its first key; the other keys are recorded in the
  header's `__metadata__` (`ALIASES_METADATA_KEY`) and point at the same tensor on load.
- Deduplication: tensors that did not change between checkpoints (frozen base weights)
  are stored content-addressed as `<blobs_dir>/<digest>.safetensors`, written once; the
  manifest records `{key: {"digest", "dtype", "shape", "size"}}`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..constants import TMP_MARKER, WEIGHTS_NAME, Tier
from ..errors import CorruptCheckpointError, SaveError
from .checksum import FileEntry, HashingWriter, fsync_dir, make_file_entry, new_hasher, read_exact
from .types import BlobRef

logger = logging.getLogger(__name__)

ALIASES_METADATA_KEY = "hf_dynamic_ckpt.aliases"
"""`__metadata__` entry holding `{alias_key: stored_key}` as a JSON string."""

BLOB_SUFFIX = ".safetensors"
BLOB_TENSOR_NAME = "tensor"
_BASE_METADATA = {"format": "pt"}  # what transformers / PEFT write; keeps files interchangeable

# torch dtype -> (safetensors code, position in safetensors' dtype order). safetensors sorts
# tensors by descending dtype order, then by name; the order was read off safetensors 0.8
# output and is checked against `save_file` in tests/unit/test_weights.py.
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
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
_BY_CODE = {code: dtype for dtype, (code, _) in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit
DIGEST_ALGO = "sha256"  # content addresses: collision resistance matters (see checksum.py)


@dataclass
class WeightsRecord:
    """What `save_weights` wrote, for the manifest.

    Args:
        files (`dict[str, FileEntry]`): file name (relative to the checkpoint directory) ->
            size, checksum, tier, rank.
        blobs (`dict[str, dict]`): weight key -> `{"digest", "dtype", "shape", "size"}` for
            tensors stored content-addressed under `blobs_dir`.
        digests (`dict[str, BlobRef]`): weight key -> `BlobRef`, for every deduplicated key;
            pass these instead of the tensors next time the tensors are unchanged.
    """

    files: dict[str, FileEntry] = field(default_factory=dict)
    blobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    digests: dict[str, BlobRef] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def _check_tensor(key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise SaveError(
            f"Weight {key!r} is a {type(value).__name__}, expected a torch.Tensor or BlobRef; "
            "pass the model's state_dict() (or the PEFT adapter dict)."
        )
    if value.layout != torch.strided:
        raise SaveError(f"Weight {key!r} has layout {value.layout}; convert it with `.to_dense()` first.")
    if value.dtype not in _DTYPES:
        supported = ", ".join(sorted(dtype_name(d) for d in _DTYPES))
        raise SaveError(
            f"Weight {key!r} has dtype {dtype_name(value.dtype)}, which safetensors cannot store; "
            f"cast it to one of: {supported}."
        )
    if value.device.type != "cpu":
        value = value.detach().to("cpu")
    return value.detach()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when already contiguous."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The safetensors header (padded to 8 bytes) and the key order of the data section."""
    order = sorted(tensors, key=lambda k: (-_DTYPES[tensors[k].dtype][1], k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": _DTYPES[t.dtype][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    buf = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    buf += b" " * ((8 - len(buf) % 8) % 8)
    return buf, order


def _serialized_size(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    header, _ = _header(tensors, metadata)
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                      metadata: Mapping[str, str] | None = None) -> str:
    """Writes `tensors` to `path` in safetensors format, fsyncs it, returns its checksum.

    The bytes equal `safetensors.torch.save_file(tensors, path, metadata)` when `metadata`
    has at most one entry (safetensors orders several metadata entries by hash, randomly;
    here they are sorted). Tensors must be CPU, strided, of a safetensors dtype, and must
    not share storage (see `save_weights`).
    """
    meta = dict(sorted((metadata or {}).items()))
    header, order = _header(tensors, meta)
    with open(path, "wb") as raw:
        f = HashingWriter(raw, defer=True)  # tensors do not change during the call
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for key in order:
            t = tensors[key]
            data = _raw_bytes(t)
            if data.nbytes:
                f.write(data)
                if not t.is_contiguous():
                    f.checksum()  # hash now, so the contiguous temporary is freed at once
        return f.fsync_and_checksum()


def tensor_digest(t: torch.Tensor) -> str:
    """Content hash of a tensor: SHA-256 over its dtype, shape and raw bytes (hex).

    Two tensors get the same digest exactly when they would be stored as the same bytes
    with the same dtype and shape, so the digest names a deduplicated blob file.

    Args:
        t (`torch.Tensor`): a strided tensor of a safetensors dtype (any device).

    Returns:
        `str`: 64 hexadecimal characters.
    """
    t = _check_tensor("<tensor>", t)
    hasher = new_hasher(DIGEST_ALGO)
    hasher.update(f"{dtype_name(t.dtype)}:{list(t.shape)}\n".encode())
    hasher.update(_raw_bytes(t))
    return hasher.hexdigest()


def blob_path(blobs_dir: Path, digest: str) -> Path:
    """Where the blob with content digest `digest` lives."""
    return Path(blobs_dir) / f"{digest}{BLOB_SUFFIX}"


def _write_blob(blobs_dir: Path, digest: str, t: torch.Tensor) -> int:
    """Writes one content-addressed blob (tmp + fsync + rename) unless already there."""
    blobs = {BLOB_TENSOR_NAME: t}
    size = _serialized_size(blobs, _BASE_METADATA)
    final = blob_path(blobs_dir, digest)
    if final.is_file() and final.stat().st_size == size:
        return size
    blobs_dir.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{TMP_MARKER}{uuid.uuid4().hex}")
    try:
        write_safetensors(blobs, tmp, _BASE_METADATA)
        os.replace(tmp, final)  # atomic; a reader holding the old file keeps its own inode
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(blobs_dir)
    return size


def save_weights(tensors: Mapping[str, torch.Tensor | BlobRef], directory: Path, *,
                 blobs_dir: Path | None, dedup_keys: Collection[str] = ()) -> WeightsRecord:
    """Writes the L0 tier: `directory/WEIGHTS_NAME` plus content-addressed blobs.

    Args:
        tensors (`Mapping[str, torch.Tensor | BlobRef]`): weights with their model key names
            (PEFT key names for an adapter). Non-contiguous tensors are made contiguous;
            tensors that alias the same storage (tied weights) are stored once.
        directory (`Path`): the checkpoint's (temporary) directory; must exist.
        blobs_dir (`Path`, *optional*): the task's blob directory. Required when
            `dedup_keys` or a `BlobRef` is given.
        dedup_keys (`Collection[str]`, *optional*, defaults to `()`): keys stored
            content-addressed in `blobs_dir` (written only if not there yet) instead of
            in the weights file.

    Returns:
        `WeightsRecord`: the file entry of `WEIGHTS_NAME`, the blob records and the
        `BlobRef`s of the deduplicated keys.

    Raises:
        `SaveError`: a value is not a tensor/BlobRef, has an unsupported dtype or layout,
        a `BlobRef` names a blob that does not exist, or `blobs_dir` is missing.

    Example:
    ```python
    >>> rec = save_weights(model.state_dict(), tmp_dir, blobs_dir=None)  # doctest: +SKIP
    >>> load_weights(tmp_dir, rec.blobs, blobs_dir=blobs)  # doctest: +SKIP
    ```
    """
    directory = Path(directory)
    dedup = set(dedup_keys)
    unknown = dedup - set(tensors)
    if unknown:
        logger.debug("dedup_keys not among the weights, ignored: %s", sorted(unknown)[:5])
    needs_blobs = bool(dedup & set(tensors)) or any(isinstance(v, BlobRef) for v in tensors.values())
    if needs_blobs and blobs_dir is None:
        raise SaveError("save_weights got dedup_keys or BlobRef values but blobs_dir=None; pass the task's blobs directory.")

    record = WeightsRecord()
    in_file: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise SaveError(f"Weight key {key!r} is a {type(key).__name__}; safetensors keys must be str.")
        if isinstance(value, BlobRef):
            assert blobs_dir is not None
            path = blob_path(blobs_dir, value.digest)
            if not path.is_file():
                raise SaveError(
                    f"Weight {key!r} was passed as BlobRef({value.digest[:12]}...) but {path} does not "
                    "exist; pass the tensor itself so it can be stored."
                )
            record.blobs[key] = {"digest": value.digest, "dtype": value.dtype,
                                 "shape": list(value.shape), "size": path.stat().st_size}
            record.digests[key] = value
            continue
        t = _check_tensor(key, value)
        ident = _alias_key(value)  # before any move to CPU, which would break the sharing
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        if key in dedup:
            assert blobs_dir is not None
            t = t.contiguous()
            digest = tensor_digest(t)
            size = _write_blob(Path(blobs_dir), digest, t)
            ref = BlobRef(digest=digest, dtype=dtype_name(t.dtype), shape=tuple(t.shape))
            record.blobs[key] = {"digest": digest, "dtype": ref.dtype, "shape": list(ref.shape), "size": size}
            record.digests[key] = ref
        else:
            in_file[key] = t

    metadata = dict(_BASE_METADATA)
    if aliases:
        metadata[ALIASES_METADATA_KEY] = json.dumps(aliases, sort_keys=True)
    path = directory / WEIGHTS_NAME
    checksum = write_safetensors(in_file, path, metadata)
    record.files[WEIGHTS_NAME] = make_file_entry(path, tier=Tier.WEIGHTS.value, rank=None, checksum=checksum)
    logger.debug("L0: %d tensors in %s, %d blobs, %d aliases", len(in_file), path, len(record.blobs), len(aliases))
    return record


def _parse_header(path: Path, f: Any, size: int) -> tuple[int, list[tuple[str, torch.dtype, list[int], int, int]], dict[str, str]]:
    """Validates a safetensors header; returns (data start, sorted entries, metadata)."""
    if size < 8:
        raise ValueError(f"{size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(size - 8, _MAX_HEADER):
        raise ValueError(f"header length {n} does not fit a {size}-byte file")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a str -> str map")
    entries = []
    for key, info in header.items():
        dtype = _BY_CODE[info["dtype"]]
        shape = info["shape"]
        begin, end = info["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {key!r} has shape {shape!r}")
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
        raise ValueError(f"data section ends at {8 + n + expected} but the file has {size} bytes (truncated or extended)")
    return 8 + n, entries, metadata


def _open_tensors(path: Path, *, mmap: bool, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Reads a safetensors file: zero-copy views of a private (copy-on-write) memory map,
    or tensors read into process memory. The header is fully validated first."""
    import mmap as mmap_mod

    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the mmap outlives it)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{what} file {path} is missing.") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        try:
            base, entries, metadata = _parse_header(path, f, size)
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
                out[key] = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=base + begin).view(dtype).view(shape)
            else:
                t = torch.empty(shape, dtype=dtype)
                f.seek(base + begin)
                read_exact(f, t.reshape(-1).view(torch.uint8).numpy().data,
                           f"{what} file {path} is truncated inside tensor {key!r}.")
                out[key] = t
    return out, metadata


def load_weights(directory: Path, blobs: Mapping[str, Mapping[str, Any]], *, blobs_dir: Path,
                 mmap: bool = True) -> dict[str, torch.Tensor]:
    """Reads the L0 tier written by `save_weights`.

    Args:
        directory (`Path`): the checkpoint directory holding `WEIGHTS_NAME`.
        blobs (`Mapping[str, dict]`): `WeightsRecord.blobs` from the manifest.
        blobs_dir (`Path`): the task's blob directory.
        mmap (`bool`, *optional*, defaults to `True`): return tensors backed by a read-only
            memory map of the files (fast, lazy); `False` reads them into process memory.

    Returns:
        `dict[str, torch.Tensor]`: every key that was saved, aliases pointing at the same
        tensor object as their stored key.

    Raises:
        `CorruptCheckpointError`: a file or blob is missing or unreadable, a blob's dtype or
        shape differs from the record, or the alias map is inconsistent.
    """
    path = Path(directory) / WEIGHTS_NAME
    out, metadata = _open_tensors(path, mmap=mmap, what="Weights")
    for key, rec in blobs.items():
        digest = str(rec.get("digest", ""))
        bpath = blob_path(Path(blobs_dir), digest)
        if not bpath.is_file():
            raise CorruptCheckpointError(
                f"Weight {key!r} is stored in blob {bpath}, which is missing; the blob store of this "
                "task was pruned or damaged, restore from a checkpoint that does not reference it."
            )
        tensors, _ = _open_tensors(bpath, mmap=mmap, what=f"Blob of weight {key!r}")
        t = tensors.get(BLOB_TENSOR_NAME)
        if t is None or dtype_name(t.dtype) != rec.get("dtype") or list(t.shape) != list(rec.get("shape", [])):
            got = None if t is None else f"{dtype_name(t.dtype)}{list(t.shape)}"
            raise CorruptCheckpointError(
                f"Blob {bpath} of weight {key!r} holds {got}, but the manifest records "
                f"{rec.get('dtype')}{list(rec.get('shape', []))}; the blob is corrupt."
            )
        if key in out:
            raise CorruptCheckpointError(f"Weight {key!r} is both in {path} and in blob {bpath}; the manifest is inconsistent.")
        out[key] = t
    raw_aliases = metadata.get(ALIASES_METADATA_KEY)
    if raw_aliases:
        try:
            aliases = json.loads(raw_aliases)
            assert isinstance(aliases, dict)
        except (ValueError, AssertionError) as e:
            raise CorruptCheckpointError(f"Alias map in {path} is not a JSON object: {raw_aliases[:80]!r}.") from e
        for alias, target in aliases.items():
            if target not in out:
                raise CorruptCheckpointError(
                    f"Weight {alias!r} aliases {target!r}, which is not stored in {path} or its blobs."
                )
            out[alias] = out[target]
    return out


def verify_blob(blobs_dir: Path, rec: Mapping[str, Any]) -> list[str]:
    """Checks one blob record against its file: present, size, and content digest.

    Returns:
        `list[str]`: problems found (empty when the blob is good).
    """
    digest = str(rec.get("digest", ""))
    path = blob_path(Path(blobs_dir), digest)
    if not path.is_file():
        return [f"blob {path} is missing"]
    if "size" in rec and path.stat().st_size != rec["size"]:
        return [f"blob {path} has {path.stat().st_size} bytes, expected {rec['size']}"]
    try:
        tensors, _ = _open_tensors(path, mmap=True, what="Blob")
        t = tensors[BLOB_TENSOR_NAME]
    except (CorruptCheckpointError, KeyError) as e:
        return [f"blob {path} is unreadable: {e}"]
    if tensor_digest(t) != digest:
        return [f"blob {path} content does not match its digest (corrupt)"]
    return []

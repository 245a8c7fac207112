"""L1: flatten/unflatten of optimizer-like state and the zstd tensor container."""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import save_state

import hf_dynamic_ckpt.store.tensorpack as tp
from examples import toy
from hf_dynamic_ckpt.errors import CorruptCheckpointError, FormatVersionError, SaveError
from hf_dynamic_ckpt.store.hashing import file_checksum
from hf_dynamic_ckpt.store.statetree import flatten_state, unflatten_state
from hf_dynamic_ckpt.store import (
    group,
    read_header,
    read_tensor_file,
    resolve_threads,
    ungroup_into,
    write_tensor_file,
)


def _plan(entries: list[dict[str, Any]], group_chunk_elems: int, frame_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Every frame's pieces, listed (the writer and reader only walk `frames`)."""
    return [[p for run in frame for p in tp.pieces(run, tp.step_of(entries[run[0]], group_chunk_elems))]
            for frame in tp.frames(entries, group_chunk_elems, frame_bytes)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Deep equality that also checks types (int vs bool vs float, tuple vs list) and NaN."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert _same(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key {k!r}"
            assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def _json_round_trip(structure: Any) -> Any:
    return json.loads(json.dumps(structure, allow_nan=False))  # strict JSON: jq can read it


def _round_trip(obj: Any, tmp_path: Path, **kw: Any) -> Any:
    structure, tensors = flatten_state(obj)
    write_tensor_file(tensors, tmp_path / "t.zst", **kw)
    return unflatten_state(_json_round_trip(structure), read_tensor_file(tmp_path / "t.zst"))


def test_flatten_round_trip_keeps_every_python_type(tmp_path: Path) -> None:
    obj = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}, 7: {}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                          "foreach": None, "params": [0, 7], "weird": [1, [2, (3, [4.5])]]}],
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1.0, 5e-324],
        "big": 2**70, "flag": True, "zero": 0,
        "__dunder__": "kept", ("tuple", 1): "tuple key", 2.5: "float key", None: "none key",
        "bytes": b"\x00\xff", "dtype": torch.bfloat16,
        "np_scalar": np.float32(1.5), "np_int": np.int64(-3), "np_array": np.arange(5, dtype=np.int16),
        "empty": {"list": [], "tuple": (), "dict": {}},
        "scalar_int": torch.tensor(7, dtype=torch.int64),
    }
    back = _round_trip(obj, tmp_path)
    assert_identical(obj, back)


def test_plain_str_dicts_stay_plain_json() -> None:
    structure, tensors = flatten_state({"lr": 0.1, "last_epoch": 3, "_last_lr": [0.1]})
    assert structure == {"lr": 0.1, "last_epoch": 3, "_last_lr": [0.1]} and tensors == {}
    structure, _ = flatten_state({0: "a"})
    assert structure == {"__dict__": [[0, "a"]]}


def test_tensor_names_are_paths_and_unique() -> None:
    _, tensors = flatten_state({"state": {0: {"exp_avg": torch.ones(1)}}, "a/b": torch.ones(1),
                                "a": {"b": torch.ones(1)}})
    assert list(tensors) == ["state/0/exp_avg", "a/b", "a/b#1"]


def test_unsupported_value_names_its_path() -> None:
    with pytest.raises(SaveError, match=r"State value at 'lr_lambdas/0' is a builtins.function"):
        flatten_state({"lr_lambdas": [lambda step: 1.0]})


def test_missing_tensor_or_bad_tag_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match=r"refers to tensor 'x'"):
        unflatten_state({"a": {"__tensor__": "x"}}, {})
    with pytest.raises(CorruptCheckpointError, match=r"Malformed __float__ entry"):
        unflatten_state({"__float__": "1.5"}, {})


def test_the_state_walks_free_their_tensors_without_the_garbage_collector() -> None:
    gc.disable()  # a failed decode is retried at once: its tensors must go by reference counting
    try:
        saved = torch.ones(4)
        ref = weakref.ref(saved)
        _, tensors = flatten_state({"state": {0: {"exp_avg": saved}}})
        del saved, tensors
        assert ref() is None
        decoded = {"state/0/exp_avg": torch.ones(4)}
        ref = weakref.ref(decoded["state/0/exp_avg"])
        with pytest.raises(CorruptCheckpointError, match=r"refers to tensor 'state/0/exp_avg_sq'"):
            unflatten_state({"state": {"__tensor__": "state/0/exp_avg_sq"}}, decoded)
        del decoded
        assert ref() is None
    finally:
        gc.enable()


def _trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = toy.tiny_qwen2(seed=0, hidden_size=32, num_layers=1, vocab_size=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, scaler


def test_real_adamw_scheduler_scaler_round_trip_bit_exact(tmp_path: Path) -> None:
    model, opt, sched, scaler = _trained_state()
    full = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "scaler": scaler.state_dict()}
    back = _round_trip(full, tmp_path)
    assert_identical(full, back)
    assert isinstance(back["optimizer"]["state"][0]["step"], torch.Tensor)
    assert back["optimizer"]["state"][0]["step"].dim() == 0

    # A fresh optimizer (empty state, same weights) loaded from it takes exactly the same next step.
    model2 = toy.tiny_qwen2(seed=5, hidden_size=32, num_layers=1, vocab_size=128)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    scaler2 = torch.amp.GradScaler("cpu")
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    scaler2.load_state_dict(back["scaler"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(9))
    for m, o, s in ((model, opt, scaler), (model2, opt2, scaler2)):
        s.scale(m(input_ids=ids, labels=ids).loss).backward()
        s.step(o)
        s.update()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert _same(p.detach(), p2.detach())


_DT = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
       torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
       torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _many_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    for dtype in _DT:
        base = torch.randn(7, 5, generator=g) * 20
        out[str(dtype)] = base.to(torch.complex64).to(dtype) if dtype.is_complex else base.to(dtype)
    out["empty"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    out["zero_dim"] = torch.tensor(4.0)
    out["one"] = torch.tensor([1.5], dtype=torch.float16)
    out["non_contiguous"] = torch.randn(6, 4, generator=g).t()
    out["special"] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    return out


@pytest.mark.parametrize(("byte_group", "threads", "level"), [(True, 0, 3), (False, 1, 3), (True, 1, 1), (True, 2, 19)])
def test_container_round_trip_every_dtype(tmp_path: Path, byte_group: bool, threads: int, level: int) -> None:
    tensors = _many_tensors()
    path = tmp_path / "t.zst"
    entry = write_tensor_file(tensors, path, byte_group=byte_group, threads=threads, level=level)
    assert entry == {"size": path.stat().st_size, "checksum": file_checksum(path), "tier": "optimizer", "rank": None}
    back = read_tensor_file(path)
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert _same(back[k], t.contiguous()), k
    header, _, _ = read_header(path)
    flags = {e["name"]: e["byte_grouped"] for e in header["tensors"]}
    grouped = {k for k, v in flags.items() if v}
    expected = {"torch.float32", "torch.float16", "torch.bfloat16", "torch.float64", "non_contiguous", "special"}
    assert grouped == (expected if byte_group else set())
    assert header["level"] == level


def test_byte_grouping_shrinks_real_adamw_state(tmp_path: Path) -> None:
    _, opt, _, _ = _trained_state()
    _, tensors = flatten_state(opt.state_dict())
    a = write_tensor_file(tensors, tmp_path / "g.zst", byte_group=True)
    b = write_tensor_file(tensors, tmp_path / "p.zst", byte_group=False)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    assert a["size"] < b["size"] < raw


def test_byte_group_layout_and_inverse() -> None:
    raw = np.arange(12, dtype=np.uint8)  # three 4-byte elements
    assert group(raw, 4).tolist() == [3, 7, 11, 2, 6, 10, 0, 1, 4, 5, 8, 9]
    assert group(np.arange(6, dtype=np.uint8), 2).tolist() == [1, 3, 5, 0, 2, 4]
    rng = np.random.default_rng(0)
    for itemsize in (2, 4, 8):
        data = rng.integers(0, 256, size=itemsize * 33, dtype=np.uint8)
        back = np.empty_like(data)
        ungroup_into(group(data, itemsize), back, itemsize)
        assert back.tobytes() == data.tobytes()


def test_unsupported_dtype_and_layout_rejected(tmp_path: Path) -> None:
    with pytest.raises(SaveError,
                       match=r"Tensor 'q' has dtype torch.float8_e4m3fnuz, which the L1 container does not support"):
        write_tensor_file({"q": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, tmp_path / "x")
    with pytest.raises(SaveError, match=r"Tensor 's' has layout torch.sparse_coo"):
        write_tensor_file({"s": torch.eye(2).to_sparse()}, tmp_path / "x")
    with pytest.raises(SaveError, match=r"threads=-2 is invalid"):
        write_tensor_file({"a": torch.ones(1)}, tmp_path / "x", threads=-2)


def test_resolve_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_dynamic_ckpt.store.tensorpack as tp

    assert resolve_threads(1) == 0
    assert resolve_threads(4) == 4
    monkeypatch.setattr(tp, "usable_cpus", lambda: 6)
    assert resolve_threads(0) == resolve_threads(-1) == 6  # auto: every CPU this process may use
    monkeypatch.setattr(tp, "usable_cpus", lambda: 1)
    assert resolve_threads(0) == resolve_threads(-1) == 0  # one CPU: no worker threads


def _small_file(tmp_path: Path, **kw: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tensors = {"exp_avg": torch.randn(40, generator=g), "step": torch.tensor(5.0),
               "ids": torch.arange(10), "half": torch.randn(16, generator=g).half()}
    path = tmp_path / "c.zst"
    write_tensor_file(tensors, path, threads=1, **kw)
    return path, tensors


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_every_flipped_byte_is_an_error(tmp_path: Path, compression: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_dynamic_ckpt.store.tensorpack as tp

    monkeypatch.setattr(tp, "FRAME_BYTES", 100)  # several frames, so the index has several entries
    path, _ = _small_file(tmp_path, compression=compression)
    assert len(read_header(path)[2]) > 1
    good = path.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x04
        path.write_bytes(bad)
        with pytest.raises((CorruptCheckpointError, FormatVersionError)):
            read_tensor_file(path, threads=2)  # frames decoded in parallel: the error still surfaces cleanly


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_truncation_extension_and_missing_file(tmp_path: Path, compression: str) -> None:
    path, _ = _small_file(tmp_path, compression=compression)
    good = path.read_bytes()
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(CorruptCheckpointError):
            read_tensor_file(path)
    path.write_bytes(good + b"\0")
    with pytest.raises(CorruptCheckpointError, match="truncated or has extra bytes"):
        read_tensor_file(path)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        read_tensor_file(path)


def _build(header: dict[str, Any], frames: list[bytes]) -> bytes:
    """A container with a valid header CRC, frame index (xxh3 per frame) and footer around anything."""
    import struct
    import zlib

    import xxhash

    h = json.dumps(header).encode()
    h += b" " * (-(20 + len(h)) % 64)
    body = b"".join(struct.pack("<QQ", len(f), xxhash.xxh3_64_intdigest(f)) for f in frames)
    tail = struct.pack("<QQ", sum(map(len, frames)), len(frames))
    return (b"HFDCTP01" + struct.pack("<Q", len(h)) + h + struct.pack("<I", zlib.crc32(h)) + b"".join(frames)
            + body + tail + struct.pack("<I", zlib.crc32(body + tail)) + b"HFDCTEND")


def _frame_raw_v3(frame: bytes) -> bytes:
    """A version-3 frame's raw bytes, decoded from the documented layout (part table, raw/zstd parts)."""
    import struct

    import zstandard

    (count,) = struct.unpack_from("<I", frame)
    pos, out = 4 + 17 * count, b""
    for kind, raw, stored in struct.iter_unpack("<BQQ", frame[4 : 4 + 17 * count]):
        part = frame[pos : pos + stored]
        out += part if kind == 0 else zstandard.ZstdDecompressor().decompress(part)
        assert kind in (0, 1) and len(out) >= raw
        pos += stored
    assert pos == len(frame)
    return out


def _parts(path: Path) -> tuple[dict[str, Any], list[bytes]]:
    header, _, frames = read_header(path)
    data = path.read_bytes()
    return header, [data[off : off + n] for off, n, _ in frames]


def test_specific_corruptions_give_specific_messages(tmp_path: Path) -> None:
    path, _ = _small_file(tmp_path)
    good = path.read_bytes()
    start = read_header(path)[1]
    cases = [(0, "is not an hf_dynamic_ckpt tensor file"), (30, r"damaged header \(CRC mismatch\)"),
             (start + 20, "frame 0 fails its xxh3 checksum"), (len(good) - 30, r"damaged frame index \(CRC mismatch\)"),
             (len(good) - 2, "truncated or has extra bytes")]
    for pos, message in cases:
        bad = bytearray(good)
        bad[pos] ^= 1
        path.write_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match=message):
            read_tensor_file(path)
    # A frame whose stored bytes match their xxh3 but not zstd's own content checksum.
    path.write_bytes(good)
    h, [frame] = _parts(path)
    broken = bytearray(frame)
    broken[-6] ^= 1  # inside the compressed block, after the frame header
    path.write_bytes(_build(h, [bytes(broken)]))
    with pytest.raises(CorruptCheckpointError, match="failed decompression or its checksum"):
        read_tensor_file(path)


def test_corrupted_frame_index_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_dynamic_ckpt.store.tensorpack as tp

    monkeypatch.setattr(tp, "FRAME_BYTES", 100)
    path, tensors = _small_file(tmp_path)
    header, frames = _parts(path)
    assert len(frames) == 3  # exp_avg (160 B) | step + ids (84 B) | half (32 B)
    assert _same(read_tensor_file(path)["exp_avg"], tensors["exp_avg"])
    path.write_bytes(_build(header, frames))  # the helper is faithful
    assert all(_same(read_tensor_file(path)[k], t) for k, t in tensors.items())
    # Index with a valid CRC that drops, merges or swaps frames: refused, never misread.
    for wrong in (frames[:2], [frames[0] + frames[1], frames[2]], [frames[1], frames[0], frames[2]]):
        path.write_bytes(_build(header, wrong))
        with pytest.raises(CorruptCheckpointError, match=r"frame index|declares \d+ bytes, the header"):
            read_tensor_file(path)
    # A stored length moved from one frame to the next (total unchanged), CRC recomputed.
    import struct
    import zlib

    data = bytearray(_build(header, frames))
    index_at = len(data) - 28 - 16 * 3
    n0, h0 = struct.unpack_from("<QQ", data, index_at)
    n1, h1 = struct.unpack_from("<QQ", data, index_at + 16)
    struct.pack_into("<QQQQ", data, index_at, n0 - 1, h0, n1 + 1, h1)
    struct.pack_into("<I", data, len(data) - 12, zlib.crc32(bytes(data[index_at : len(data) - 12])))
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="frame 0 fails its xxh3 checksum"):
        read_tensor_file(path)


def test_consistent_looking_but_wrong_containers_are_refused(tmp_path: Path) -> None:
    small, big = tmp_path / "small", tmp_path / "big"
    write_tensor_file({"a": torch.ones(10)}, small)
    write_tensor_file({"a": torch.ones(20)}, big)
    h_small, f_small = _parts(small)
    h_big, _ = _parts(big)
    assert read_tensor_file(tmp_path / "small")["a"].tolist() == [1.0] * 10
    bad = tmp_path / "bad"
    bad.write_bytes(_build(h_small, f_small))
    assert torch.equal(read_tensor_file(bad)["a"], torch.ones(10))  # the helper itself is faithful
    bad.write_bytes(_build(h_big, f_small))
    with pytest.raises(CorruptCheckpointError, match="frame 0 declares 40 bytes, the header 80"):
        read_tensor_file(bad)
    wrong_dtype = {**h_small, "tensors": [{**h_small["tensors"][0], "dtype": "float64"}]}
    bad.write_bytes(_build(wrong_dtype, f_small))
    with pytest.raises(CorruptCheckpointError, match="inconsistent offset/size for 'a'"):
        read_tensor_file(bad)
    bad.write_bytes(_build({**h_small, "codec": "gzip"}, f_small))
    with pytest.raises(CorruptCheckpointError, match="unknown codec 'gzip'"):
        read_tensor_file(bad)


def test_other_container_versions_are_refused(tmp_path: Path) -> None:
    small = tmp_path / "small"
    write_tensor_file({"a": torch.ones(10)}, small)
    header, frames = _parts(small)
    assert header["version"] == 3
    bad = tmp_path / "bad"
    bad.write_bytes(_build({**header, "version": 99}, frames))
    with pytest.raises(FormatVersionError,
                       match=r"has container version 99, this library reads version 3: newer than"):
        read_tensor_file(bad)
    # A version-1 file (one zstd frame, 16-byte footer):
    # its byte-grouping changed without a version bump, so it is refused, not guessed.
    import struct
    import zlib

    import zstandard

    h1 = json.dumps({"format": "hf_dynamic_ckpt.tensorpack", "version": 1, "codec": "zstd", "level": 3,
                     "total_bytes": 40, "group_chunk_elems": 4194304,
                     "tensors": [{"name": "a", "dtype": "float32", "shape": [10], "offset": 0, "nbytes": 40,
                                  "byte_grouped": True}]}).encode()
    planes = group(np.ones(10, np.float32).view(np.uint8), 4).tobytes()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(planes)
    bad.write_bytes(b"HFDCTP01" + struct.pack("<Q", len(h1)) + h1 + struct.pack("<I", zlib.crc32(h1)) + frame
                    + struct.pack("<Q", len(frame)) + b"HFDCTEND")
    with pytest.raises(FormatVersionError,
                       match=r"container version 1, this library reads version 3: an older layout"):
        read_tensor_file(bad)


def test_grouping_runs_in_chunks_read_back_by_the_header_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_dynamic_ckpt.store.tensorpack as tp

    g = torch.Generator().manual_seed(4)
    tensors = {"f32": torch.randn(101, generator=g), "bf16": torch.randn(3, 33, generator=g).bfloat16(),
               "f64": torch.randn(15, generator=g).double(), "exact": torch.randn(14, generator=g)}
    monkeypatch.setattr(tp, "GROUP_CHUNK_ELEMS", 7)
    monkeypatch.setattr(tp, "FRAME_BYTES", 64)
    write_tensor_file(tensors, tmp_path / "c.zst")
    monkeypatch.undo()  # the reader must follow the file's own chunk and frame sizes
    header, _, frames = read_header(tmp_path / "c.zst")
    assert (header["group_chunk_elems"], header["frame_bytes"]) == (7, 64)
    assert len(frames) == len(_plan(header["tensors"], 7, 64)) > 10
    for threads in (1, 2):
        back = read_tensor_file(tmp_path / "c.zst", threads=threads)
        for k, t in tensors.items():
            assert _same(back[k], t), k
    # Chunked layout: each run of 7 elements is grouped on its own; a frame packs whole runs.
    raw = torch.arange(9 * 4, dtype=torch.uint8).view(torch.float32)
    monkeypatch.setattr(tp, "GROUP_CHUNK_ELEMS", 7)
    write_tensor_file({"r": raw}, tmp_path / "r.zst", level=1)
    _, [frame] = _parts(tmp_path / "r.zst")

    payload = _frame_raw_v3(frame)
    raw_bytes = np.arange(36, dtype=np.uint8)
    assert payload == group(raw_bytes[:28], 4).tobytes() + group(raw_bytes[28:], 4).tobytes()


def test_frame_plan_packs_pieces_up_to_frame_bytes() -> None:
    entries = [{"dtype": "float32", "nbytes": 4 * n} for n in (10, 3, 0, 2, 25)]
    assert _plan(entries, 8, 40) == [[(0, 0, 32), (0, 32, 40)], [(1, 0, 12), (3, 0, 8)], [(4, 0, 32)],
                                     [(4, 32, 64)], [(4, 64, 96), (4, 96, 100)]]
    assert _plan([], 8, 40) == []


def test_uncompressed_container_is_memory_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_dynamic_ckpt.store.tensorpack as tp

    monkeypatch.setattr(tp, "FRAME_BYTES", 256)
    tensors = _many_tensors()
    path = tmp_path / "raw.bin"
    entry = write_tensor_file(tensors, path, compression=None)
    assert entry["size"] == path.stat().st_size and entry["checksum"] == file_checksum(path)
    header, start, frames = read_header(path)
    assert header["codec"] == "none" and header["level"] is None and start % 64 == 0 and len(frames) > 2
    assert all(e["offset"] % 64 == 0 and not e["byte_grouped"] for e in header["tensors"])
    data = path.read_bytes()
    for e in header["tensors"]:  # the bytes on disk are the tensors' own, at their offsets
        t = tensors[e["name"]].contiguous()
        expected = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert data[start + e["offset"] : start + e["offset"] + e["nbytes"]] == expected, e["name"]
    back = read_tensor_file(path)
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert _same(back[k], t.contiguous()), k
    back["torch.float32"].add_(1.0)  # private mapping: in-place updates never reach the file
    assert path.read_bytes() == data
    assert write_tensor_file({}, tmp_path / "empty", compression="none")["size"] == (tmp_path / "empty").stat().st_size
    assert read_tensor_file(tmp_path / "empty") == {}
    with pytest.raises(SaveError, match=r"compression='gzip' is not supported for the optimizer tier"):
        write_tensor_file(tensors, path, compression="gzip")


def _overwrite_tensor_bytes(path: Path) -> None:
    """Rewrites every tensor byte of an uncompressed container in place (same size)."""
    header, start, _ = read_header(path)
    with open(path, "r+b") as f:
        for e in header["tensors"]:
            f.seek(start + e["offset"])
            f.write(bytes([0x7F]) * e["nbytes"])


def test_uncompressed_container_read_with_copy_owns_its_memory(tmp_path: Path) -> None:
    # Linux: pages of a private map that were never written show later writes to the file;
    # a copied tensor does not. So an in-place rewrite of the file tells mapped from copied.
    tensors = {"m": torch.arange(4096, dtype=torch.float32), "v": torch.full((1024,), 2.0)}
    path = tmp_path / "raw.bin"
    write_tensor_file(tensors, path, compression="none")
    mapped, copied = read_tensor_file(path), read_tensor_file(path, copy=True)
    assert list(copied) == list(tensors) and all(_same(copied[k], t) for k, t in tensors.items())
    _overwrite_tensor_bytes(path)  # same size, every tensor byte changed
    assert all(_same(copied[k], t) for k, t in tensors.items())
    assert not _same(mapped["m"], tensors["m"])  # the control: a mapped tensor follows the file
    copied["m"].add_(1.0)
    assert copied["m"][0].item() == 1.0


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_store_writes_the_optimizer_tier_with_its_codec(tmp_path: Path, compression: str) -> None:
    from hf_dynamic_ckpt.constants import OPTIMIZER_NAME, Tier
    from hf_dynamic_ckpt.store import CheckpointStore
    from hf_dynamic_ckpt.store import CheckpointState

    model, opt, sched, scaler = _trained_state()
    store = CheckpointStore(tmp_path / "store", compression=compression)
    info = save_state(store, CheckpointState(step=3, weights=model.state_dict(), optimizer=opt.state_dict(),
                                      scheduler=sched.state_dict(), scaler=scaler.state_dict()), reason="test")
    assert read_header(Path(info.path) / OPTIMIZER_NAME)[0]["codec"] == compression
    loaded = store.load(info, tiers={Tier.OPTIMIZER})
    assert loaded.optimizer is not None and loaded.scheduler is not None
    assert_identical(_key_sorted(opt.state_dict()), _key_sorted(loaded.optimizer))  # the store's JSON sorts keys
    assert_identical(_key_sorted(sched.state_dict()), _key_sorted(loaded.scheduler))
    copied = store.load(info, tiers={Tier.OPTIMIZER}, mmap=False)  # what a resume's background read asks for
    if compression == "none":
        _overwrite_tensor_bytes(Path(info.path) / OPTIMIZER_NAME)  # a mapped tensor would show this (see above)
    assert_identical(_key_sorted(opt.state_dict()), _key_sorted(copied.optimizer))


def _key_sorted(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _key_sorted(x[k]) for k in sorted(x, key=repr)}
    if isinstance(x, (list, tuple)):
        return type(x)(_key_sorted(v) for v in x)
    return x


def test_store_refuses_an_unknown_optimizer_codec(tmp_path: Path) -> None:
    from hf_dynamic_ckpt.errors import ConfigError
    from hf_dynamic_ckpt.store import CheckpointStore

    with pytest.raises(ConfigError, match=r"compression='gzip' is invalid for the optimizer tier"):
        CheckpointStore(tmp_path / "store", compression="gzip")

"""L1 container version 3 (frames as tables of raw and zstd parts); version 2 is refused."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from helpers import save_state
from tensorpack_v2 import write_v2

import hf_dynamic_ckpt.store.tensorpack as tp
from hf_dynamic_ckpt.errors import CorruptCheckpointError, FormatVersionError
from hf_dynamic_ckpt.store import (
    group,
    group_into,
    read_header,
    read_tensor_file,
    ungroup_into,
    write_tensor_file,
)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_same(back: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert _bytes(back[k]) == _bytes(t), k


def _frames(path: Path) -> list[bytes]:
    _, _, index = read_header(path)
    data = path.read_bytes()
    return [data[off : off + n] for off, n, _ in index]


def _table(frame: bytes) -> list[tuple[int, int, int, bytes]]:
    """(kind, raw length, stored length, stored bytes) of each part, read by the documented layout."""
    (count,) = struct.unpack_from("<I", frame)
    pos, out = 4 + 17 * count, []
    for kind, raw, stored in struct.iter_unpack("<BQQ", frame[4 : 4 + 17 * count]):
        out.append((kind, raw, stored, frame[pos : pos + stored]))
        pos += stored
    assert pos == len(frame)
    return out


def _kinds(path: Path) -> list[int]:
    return [kind for frame in _frames(path) for kind, *_ in _table(frame)]


def _build(header: dict[str, Any], frames: list[bytes]) -> bytes:
    """A container with a valid header CRC, frame index (xxh3 per frame) and footer around anything."""
    h = json.dumps(header).encode()
    h += b" " * (-(20 + len(h)) % 64)
    body = b"".join(struct.pack("<QQ", len(f), xxhash.xxh3_64_intdigest(f)) for f in frames)
    tail = struct.pack("<QQ", sum(map(len, frames)), len(frames))
    return (b"HFDCTP01" + struct.pack("<Q", len(h)) + h + struct.pack("<I", zlib.crc32(h)) + b"".join(frames)
            + body + tail + struct.pack("<I", zlib.crc32(body + tail)) + b"HFDCTEND")


def _frame(parts: list[tuple[int, int, bytes]]) -> bytes:
    """A version-3 frame from (kind, raw length, stored bytes) triples."""
    return (struct.pack("<I", len(parts)) + b"".join(struct.pack("<BQQ", k, r, len(s)) for k, r, s in parts)
            + b"".join(s for _, _, s in parts))


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {
        "f32": torch.randn(70_000, generator=g), "bf16": torch.randn(90_000, generator=g).bfloat16(),
        "f16": torch.randn(90_000, generator=g).half(), "f64": torch.randn(40_000, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (5000,), generator=g), "i32": torch.arange(30_000, dtype=torch.int32),
        "i16": torch.randint(-300, 300, (7, 9), generator=g).short(),
        "i8": torch.randint(-100, 100, (33,), generator=g).to(torch.int8),
        "u8": torch.randint(0, 256, (100_000,), generator=g).to(torch.uint8),
        "bool": torch.rand(999, generator=g) > 0.5, "zero_dim": torch.tensor(3.5), "zero_dim_int": torch.tensor(7),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16), "empty_f32": torch.zeros(0), "zeros": torch.zeros(300_000),
        "special": torch.tensor([float("nan"), float("inf"), -0.0]),
        "non_contiguous": torch.randn(300, 200, generator=g).t(),
    }
    return out


@pytest.mark.parametrize(("threads", "level"), [(1, 1), (2, 1), (0, 3)])
def test_every_dtype_round_trips_with_raw_and_zstd_parts(tmp_path: Path, threads: int, level: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "FRAME_BYTES", 1 << 20)  # several frames
    tensors = _every_dtype()
    path = tmp_path / "t.bin"
    write_tensor_file(tensors, path, threads=threads, level=level)
    header, _, _ = read_header(path)
    assert header["version"] == 3 and header["codec"] == "zstd" and header["level"] == level
    kinds = _kinds(path)
    assert 0 in kinds and 1 in kinds  # random mantissa bytes stay raw, exponents and zeros are compressed
    for t in (1, 2):
        _assert_same(read_tensor_file(path, threads=t), tensors)


def test_raw_parts_are_the_grouped_bytes_themselves(tmp_path: Path) -> None:
    # 1M random fp32: the top (exponent) plane compresses, the second and low planes do not.
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "t.bin"
    write_tensor_file({"x": x}, path, threads=1)
    [frame] = _frames(path)
    parts = _table(frame)
    grouped = group(x.view(torch.uint8).numpy(), 4).tobytes()
    n = x.numel()
    assert [r for _, r, _, _ in parts] == [n, n, 2 * n]  # cut at the planes (each <= PART_BYTES)
    assert [k for k, _, _, _ in parts] == [1, 0, 0]
    assert parts[1][3] == grouped[n : 2 * n] and parts[2][3] == grouped[2 * n :]
    assert zstandard.ZstdDecompressor().decompress(parts[0][3]) == grouped[:n]
    assert len(parts[0][3]) <= 0.9 * n


def test_incompressible_input_is_stored_raw(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "t.bin"
    write_tensor_file({"u8": data, "i32": data.view(torch.int32)}, path)
    frames = _frames(path)
    assert all(k == 0 for f in frames for k, *_ in _table(f))
    assert b"".join(s for f in frames for *_, s in _table(f)) == _bytes(data) * 2  # the payload is the bytes themselves
    assert path.stat().st_size < 2 * data.numel() + 4096
    _assert_same(read_tensor_file(path), {"u8": data, "i32": data.view(torch.int32)})


def test_all_zero_input_uses_high_ratio_zstd_parts(tmp_path: Path) -> None:
    z = torch.zeros(8 << 20, dtype=torch.float32)  # 32 MiB: two frames of 16 parts of 1 MiB
    path = tmp_path / "t.bin"
    write_tensor_file({"z": z}, path)
    parts = [p for f in _frames(path) for p in _table(f)]
    assert len(parts) == 32 and all(k == 1 and r == 1 << 20 for k, r, _, _ in parts)
    assert all(r / s > 10_000 for _, r, s, _ in parts)  # far beyond any raw ratio, within the format's limit
    assert path.stat().st_size < 8192
    assert torch.equal(read_tensor_file(path)["z"], z)


def test_part_bounds_cut_planes_merge_small_spans_and_split_large_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "MIN_SEGMENT", 100)
    monkeypatch.setattr(tp, "PART_BYTES", 1000)
    entries = [{"dtype": "float32", "nbytes": 4 * 600, "byte_grouped": True},
               {"dtype": "int64", "nbytes": 8 * 5, "byte_grouped": False},
               {"dtype": "bfloat16", "nbytes": 2 * 20, "byte_grouped": True},
               {"dtype": "int8", "nbytes": 2500, "byte_grouped": False}]
    frame = [(0, 0, 2400), (1, 0, 40), (2, 0, 40), (3, 0, 2500)]
    # f32 planes 600 | 600 | 1200 (split in 2); the 40-byte int64 piece and the bf16 planes (20 + 20)
    # merge into one span, which takes the int8 piece too (2580 bytes: 3 parts).
    assert tp.part_bounds(frame, entries, 1 << 22) == [0, 600, 1200, 1800, 2400, 3260, 4120, 4980]


def test_every_flipped_byte_and_truncation_of_a_v3_file_is_an_error(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "MIN_SEGMENT", 16)
    monkeypatch.setattr(tp, "FRAME_BYTES", 400)
    g = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(150, generator=g), "z": torch.zeros(100), "h": torch.randn(40, generator=g).half()}
    path = tmp_path / "t.bin"
    write_tensor_file(tensors, path, threads=1)
    assert len(_frames(path)) > 1 and {0, 1} <= set(_kinds(path))
    good = path.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x10
        path.write_bytes(bad)
        with pytest.raises(CorruptCheckpointError):
            read_tensor_file(path, threads=2)
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(CorruptCheckpointError):
            read_tensor_file(path)


def _one_frame_file(tmp_path: Path) -> tuple[Path, dict[str, Any], bytes, torch.Tensor]:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "t.bin"
    write_tensor_file({"x": x}, path, threads=1)
    header, _, _ = read_header(path)
    [frame] = _frames(path)
    assert [k for k, *_ in _table(frame)] == [1, 0, 0]
    return path, header, frame, x


def test_flipped_byte_in_a_raw_or_zstd_part(tmp_path: Path) -> None:
    path, header, frame, x = _one_frame_file(tmp_path)
    good, (offset, _, _) = path.read_bytes(), read_header(path)[2][0]
    zstd_at = 4 + 17 * 3 + len(_table(frame)[0][3]) // 2
    raw_at = len(frame) - 100
    for at in (zstd_at, raw_at):  # the index's xxh3 catches both
        bad = bytearray(good)
        bad[offset + at] ^= 1
        path.write_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match="frame 0 fails its xxh3 checksum"):
            read_tensor_file(path)
    # With the xxh3 recomputed, a flipped zstd byte is still caught by zstd's own checksum.
    bad = bytearray(frame)
    bad[zstd_at] ^= 1
    path.write_bytes(_build(header, [bytes(bad)]))
    with pytest.raises(CorruptCheckpointError, match="failed decompression or its checksum"):
        read_tensor_file(path)
    path.write_bytes(_build(header, [frame]))  # the helper itself is faithful
    assert torch.equal(read_tensor_file(path)["x"], x)


@pytest.mark.parametrize(("parts", "message"), [
    ([(1, 32768 * 10 + 1, b"\x00" * 10)],
     r"frame 0, part 0: kind 1, 327681 raw bytes in 10 stored bytes is not a valid part"),
    ([(0, 11, b"\x00" * 10)], r"frame 0, part 0: kind 0, 11 raw bytes in 10 stored bytes is not a valid part"),
    ([(2, 10, b"\x00" * 10)], r"part 0: kind 2, 10 raw bytes"),
    ([(0, 16, b"\x00" * 16)], r"frame 0 declares 16 bytes, the header 400"),
])
def test_hostile_part_tables_are_refused_before_decoding(tmp_path: Path, parts: list[tuple[int, int, bytes]],
                                                          message: str) -> None:
    path, header, _, _ = _one_frame_file(tmp_path)
    header = {**header, "tensors": [{**header["tensors"][0], "shape": [100], "nbytes": 400}], "total_bytes": 400}
    path.write_bytes(_build(header, [_frame(parts)]))
    with pytest.raises(CorruptCheckpointError, match=message):
        read_tensor_file(path)


def test_part_table_larger_than_its_frame_is_refused(tmp_path: Path) -> None:
    path, header, frame, _ = _one_frame_file(tmp_path)
    for count in (0, 1 << 31):
        path.write_bytes(_build(header, [struct.pack("<I", count) + frame[4:]]))
        with pytest.raises(CorruptCheckpointError, match=rf"part table of {count} parts that does not fit"):
            read_tensor_file(path)


def test_zstd_part_whose_content_size_differs_from_its_table_entry(tmp_path: Path) -> None:
    path, header, _, _ = _one_frame_file(tmp_path)
    header = {**header, "tensors": [{**header["tensors"][0], "shape": [100], "nbytes": 400}], "total_bytes": 400}
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(300))
    path.write_bytes(_build(header, [_frame([(1, 400, packed)])]))
    with pytest.raises(CorruptCheckpointError, match=r"frame 0, part 0 declares 300 bytes, the header 400"):
        read_tensor_file(path)


V2_REFUSED = (r"container version 2, this library reads version 3: written by a development build of hf_dynamic_ckpt "
              r"0\.2\.0 from before container version 3, and read only by such a build \(no release wrote it\)")


def test_v2_file_is_refused_naming_the_build_that_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "v2.bin"
    write_v2(_every_dtype(), path, level=1)
    with pytest.raises(FormatVersionError, match=V2_REFUSED):
        read_header(path)
    with pytest.raises(FormatVersionError, match=V2_REFUSED):
        read_tensor_file(path)


def test_v2_fixture_made_by_code_is_refused(tmp_path: Path) -> None:
    """A tiny version-2 file built from the v2 layout itself (not by the writer)."""
    a = torch.arange(12, dtype=torch.float32) / 7
    ids = torch.arange(5, dtype=torch.int64)
    grouped = group(a.view(torch.uint8).numpy(), 4).tobytes() + _bytes(ids)
    header = {"format": "hf_dynamic_ckpt.tensorpack", "version": 2, "codec": "zstd", "level": 3, "total_bytes": 88,
              "group_chunk_elems": 1 << 22, "frame_bytes": 16 << 20,
              "tensors": [{"name": "a", "dtype": "float32", "shape": [3, 4], "offset": 0, "nbytes": 48,
                           "byte_grouped": True},
                          {"name": "ids", "dtype": "int64", "shape": [5], "offset": 48, "nbytes": 40,
                           "byte_grouped": False}]}

    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(grouped)
    path = tmp_path / "v2.bin"
    path.write_bytes(_build(header, [frame]))
    with pytest.raises(FormatVersionError, match=V2_REFUSED):
        read_tensor_file(path)
    # A v2 frame is never read as a part table.
    path.write_bytes(_build({**header, "version": 3}, [frame]))
    with pytest.raises(CorruptCheckpointError):
        read_tensor_file(path)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from examples import toy

    torch.manual_seed(0)
    model = toy.tiny_qwen2(seed=0, hidden_size=64, num_layers=2, vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("version", [2, 3])
def test_store_load_of_l1_is_bit_exact_for_v3_and_refuses_a_store_written_as_v2(
        tmp_path: Path, version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_dynamic_ckpt.constants import OPTIMIZER_NAME, Tier
    from hf_dynamic_ckpt.store import CheckpointStore
    from hf_dynamic_ckpt.store import CheckpointState

    model, opt = _trained()
    if version == 2:  # a store whose L1 files are version 2
        monkeypatch.setattr(tp, "write_tensor_file", write_v2)
    store = CheckpointStore(tmp_path / "store", session_id="a")
    state = CheckpointState(step=2, weights=model.state_dict(), optimizer=opt.state_dict())
    info = save_state(store, state, reason="test")

    store.close()
    monkeypatch.undo()
    store = CheckpointStore(tmp_path / "store", session_id="b")
    if version == 2:  # the file the manifest names, of version 2: refused as such, not as corrupt
        with pytest.raises(FormatVersionError, match=V2_REFUSED):
            store.load(store.resolve("auto"), tiers={Tier.OPTIMIZER})
        store.close()
        return
    assert read_header(Path(info.path) / OPTIMIZER_NAME)[0]["version"] == version
    loaded = store.load(store.resolve("auto"), tiers={Tier.OPTIMIZER})
    store.close()
    assert loaded.optimizer is not None
    want, got = opt.state_dict(), loaded.optimizer
    assert sorted(want["state"]) == sorted(got["state"])
    for k, st in want["state"].items():
        for name, t in st.items():
            assert got["state"][k][name].dtype == t.dtype and _bytes(got["state"][k][name]) == _bytes(t), (k, name)
    np.testing.assert_equal(json.loads(json.dumps(want["param_groups"])), json.loads(json.dumps(got["param_groups"])))


@pytest.mark.parametrize("block", [5, 1 << 15])
def test_blocked_grouping_gives_the_documented_planes(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "GROUP_BLOCK", block)
    monkeypatch.setattr(tp, "SHIFT_BLOCK", block + 2)  # the word-shift path of 2- and 4-byte types
    rng = np.random.default_rng(0)
    for itemsize in (2, 4, 8):
        for n in (1, 4, 5, 6, 23, (1 << 15) + 3):
            raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
            rows = raw.reshape(n, itemsize)
            want = np.concatenate([rows[:, -1], rows[:, -2], rows[:, :-2].reshape(-1)]).tobytes()
            assert group(raw, itemsize).tobytes() == want, (itemsize, n)
            back = np.empty_like(raw)
            ungroup_into(group(raw, itemsize), back, itemsize)
            assert back.tobytes() == raw.tobytes()


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_grouping_of_unaligned_slices(itemsize: int) -> None:
    # A piece of a frame starts wherever the previous piece ended (an odd offset after 33 int8 bytes).
    rng = np.random.default_rng(itemsize)
    for n in (1, 7, 300_001):
        raw = rng.integers(0, 256, size=n * itemsize + 3, dtype=np.uint8)[1 : 1 + n * itemsize]
        rows = raw.reshape(n, itemsize)
        want = np.concatenate([rows[:, -1], rows[:, -2], rows[:, :-2].reshape(-1)]).tobytes()
        out = np.zeros(n * itemsize + 5, np.uint8)[3 : 3 + n * itemsize]
        group_into(raw, out, itemsize)
        assert out.tobytes() == want
        back = np.zeros(n * itemsize + 5, np.uint8)[1 : 1 + n * itemsize]
        ungroup_into(out, back, itemsize)
        assert back.tobytes() == raw.tobytes()

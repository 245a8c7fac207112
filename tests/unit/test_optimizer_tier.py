"""The optimizer tier (L1) through the store: the no-pickle state tree, container version 3 as documented, and every
damaged or hostile file a `CorruptCheckpointError` (each vouched for by its manifest, so only the reader decides)."""

from __future__ import annotations

import json
import math
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
from store_helpers import read_manifest_json, replace_file, write_manifest_json

from examples import toy
from hf_dynamic_ckpt.constants import OPTIMIZER_META_NAME, OPTIMIZER_NAME, Tier
from hf_dynamic_ckpt.errors import CorruptCheckpointError, FormatVersionError, SaveError
from hf_dynamic_ckpt.run.resume import plan_resume
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore

L1 = {Tier.OPTIMIZER}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "root", task_id="run")
    yield s
    s.close()


def _round_trip(store: CheckpointStore, optimizer: Any, step: int = 1, **parts: Any) -> Any:
    save_state(store, CheckpointState(step=step, optimizer=optimizer, **parts), reason="r")
    return store.load(f"step:{step}", tiers=L1)


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Same types all the way down, tensors bit-exact, -0.0 and NaN included."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path  # optimizer.json is written with sorted keys
        for k in a:
            assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def test_the_state_tree_keeps_every_python_type_and_plain_dicts_stay_plain_json(store: CheckpointStore) -> None:
    obj = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}, 7: {}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                          "foreach": None, "params": [0, 7], "weird": [1, [2, (3, [4.5])]]}],
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1.0, 5e-324],
        "big": 2**70, "flag": True, "zero": 0,
        "__dunder__": "kept", ("tuple", 1): "tuple key", 2.5: "float key", None: "none key",
        "bytes": b"\x00\xff", "dtype": torch.bfloat16,
        "np_scalar": np.float32(1.5), "np_int": np.int64(-3), "np_array": np.arange(5, dtype=np.int16),
        "empty": {"list": [], "tuple": (), "dict": {}}, "scalar_int": torch.tensor(7, dtype=torch.int64),
    }
    assert_identical(obj, _round_trip(store, obj).optimizer)
    plain = {"state": {0: {"exp_avg": torch.ones(2)}}, "a/b": torch.ones(1), "a": {"b": torch.full((1,), 2.0)}}
    loaded = _round_trip(store, plain, step=2, scheduler={"lr": 0.1, "last_epoch": 3, "_last_lr": [0.1]})
    assert_identical(plain, loaded.optimizer)
    structure = json.loads((store.task_dir / "step-2" / OPTIMIZER_META_NAME).read_text())  # strict JSON: jq reads it
    assert structure["scheduler"] == {"lr": 0.1, "last_epoch": 3, "_last_lr": [0.1]}  # str keys: plain objects
    state = {"__dict__": [[0, {"exp_avg": {"__tensor__": "optimizer/state/0/exp_avg"}}]]}  # int keys, in order
    assert structure["optimizer"] == {"state": state, "a/b": {"__tensor__": "optimizer/a/b"},
                                      "a": {"b": {"__tensor__": "optimizer/a/b#1"}}}  # a path taken: unique names


def test_a_value_that_needs_pickle_names_its_path(store: CheckpointStore) -> None:
    with pytest.raises(SaveError, match=r"State value at 'scheduler/lr_lambdas/0' is a builtins.function, which "
                                        r"cannot be stored without pickle"):
        _round_trip(store, {"state": {}}, scheduler={"lr_lambdas": [lambda step: 1.0]})
    assert store.list(include_unhealthy=True) == []


def test_a_structure_naming_a_missing_tensor_or_holding_a_bad_tag_is_corrupt(store: CheckpointStore) -> None:
    _round_trip(store, {"state": {0: {"exp_avg": torch.ones(2)}}})
    directory = store.task_dir / "step-1"
    for structure, message in ((b'{"optimizer": {"a": {"__tensor__": "x"}}}', r"refers to tensor 'x'"),
                               (b'{"optimizer": {"__float__": "1.5"}}', r"Malformed __float__ entry")):
        replace_file(directory, OPTIMIZER_META_NAME, structure)
        with pytest.raises(CorruptCheckpointError, match=message):
            store.load("step:1", tiers=L1)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_real_adamw_scheduler_and_scaler_round_trip_bit_exactly(tmp_path: Path, codec: str) -> None:
    torch.manual_seed(0)
    model = toy.tiny_qwen2(seed=0, hidden_size=32, num_layers=1, vocab_size=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    with CheckpointStore(tmp_path, task_id="run", compression=codec) as store:
        loaded = _round_trip(store, opt.state_dict(), scheduler=sched.state_dict(), scaler=scaler.state_dict())
    assert_identical(opt.state_dict(), loaded.optimizer)
    assert_identical(sched.state_dict(), loaded.scheduler)
    assert_identical(scaler.state_dict(), loaded.scaler)
    if codec == "zstd":  # byte planes of trained moments compress
        raw = sum(t.numel() * t.element_size() for s in opt.state_dict()["state"].values() for t in s.values())
        assert (tmp_path / "run" / "step-1" / OPTIMIZER_NAME).stat().st_size < 0.9 * raw


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(70_000, generator=g), "bf16": torch.randn(90_000, generator=g).bfloat16(),
        "f16": torch.randn(90_000, generator=g).half(), "f64": torch.randn(40_000, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (5000,), generator=g), "i32": torch.arange(30_000, dtype=torch.int32),
        "i16": torch.randint(-300, 300, (7, 9), generator=g).short(),
        "i8": torch.randint(-100, 100, (33,), generator=g).to(torch.int8),
        "u8": torch.randint(0, 256, (100_000,), generator=g).to(torch.uint8),
        "bool": torch.rand(999, generator=g) > 0.5,
        "u16": torch.arange(50).to(torch.uint16), "c64": torch.randn(20, dtype=torch.complex64, generator=g),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn), "zero_dim": torch.tensor(3.5),
        "zero_dim_int": torch.tensor(7), "empty": torch.zeros(0, 4, dtype=torch.bfloat16), "empty_f32": torch.zeros(0),
        "zeros": torch.zeros(300_000), "special": torch.tensor([float("nan"), float("inf"), -0.0]),
        "non_contiguous": torch.randn(300, 200, generator=g).t(),
    }


@pytest.mark.parametrize(("codec", "threads", "level"), [("zstd", 1, 1), ("zstd", 2, 3), ("none", 2, 1)])
def test_every_dtype_round_trips(tmp_path: Path, codec: str, threads: int, level: int) -> None:
    tensors = _every_dtype()
    with CheckpointStore(tmp_path, compression=codec, compression_threads=threads, compression_level=level) as store:
        loaded = _round_trip(store, tensors)
        assert store.verify("step:1") == []
    assert_identical({k: t.contiguous() for k, t in tensors.items()}, loaded.optimizer)


# -- the documented layout ----------------------------------------------------------------------------------------
def _container(path: Path) -> tuple[dict[str, Any], list[bytes]]:
    """The header and stored frames of a container, read by the documented layout."""
    data = path.read_bytes()
    magic, hlen = struct.unpack_from("<8sQ", data)
    header = json.loads(data[16 : 16 + hlen])
    payload, n = struct.unpack_from("<QQ", data, len(data) - 28)
    assert magic == b"HFDCTP01" and data.endswith(b"HFDCTEND") and (16 + hlen + 4) % 64 == 0
    pos, frames = 16 + hlen + 4, []
    for k in range(n):
        length, digest = struct.unpack_from("<QQ", data, 16 + hlen + 4 + payload + 16 * k)
        frames.append(data[pos : pos + length])
        assert xxhash.xxh3_64_intdigest(frames[-1]) == digest
        pos += length
    return header, frames


def _parts(frame: bytes) -> list[tuple[int, int, bytes]]:
    """(kind, raw length, stored bytes) of each part of a stored frame."""
    (count,) = struct.unpack_from("<I", frame)
    pos, out = 4 + 17 * count, []
    for kind, raw, stored in struct.iter_unpack("<BQQ", frame[4 : 4 + 17 * count]):
        out.append((kind, raw, frame[pos : pos + stored]))
        pos += stored
    assert pos == len(frame)
    return out


def test_the_writer_follows_the_documented_layout(store: CheckpointStore) -> None:
    g = torch.Generator().manual_seed(3)
    n = 1 << 18  # planes large enough that the writer probes them before compressing them whole
    moments = torch.randn(n, generator=g) * 1e-3  # sign/exponent plane compresses, mantissa bytes do not
    _round_trip(store, {"m": moments, "z": torch.zeros(n), "ids": torch.arange(1000)})
    header, [frame] = _container(store.task_dir / "step-1" / OPTIMIZER_NAME)
    assert header["version"] == 3 and header["codec"] == "zstd" and header["frame_bytes"] == 16 << 20
    assert [(t["name"], t["byte_grouped"]) for t in header["tensors"]] == [
        ("optimizer/m", True), ("optimizer/z", True), ("optimizer/ids", False)]
    parts = _parts(frame)
    raw = b"".join(p if kind == 0 else zstandard.ZstdDecompressor().decompress(p) for kind, _, p in parts)
    a = moments.view(torch.uint8).numpy().reshape(-1, 4)
    planes = [a[:, 3].tobytes(), a[:, 2].tobytes(), a[:, :2].tobytes()]
    assert raw[: 4 * n] == b"".join(planes)  # [a[:, -1] | a[:, -2] | a[:, :-2].ravel()]
    assert [kind for kind, _, _ in parts] == [1, 0, 0, 1, 1, 1, 1]  # raw where zstd does not pay
    assert all(zstandard.frame_content_size(p) == n for kind, n, p in parts if kind == 1)
    assert raw[4 * n : 8 * n] == bytes(4 * n)


def _build(header: dict[str, Any], frames: list[bytes]) -> bytes:
    """A container with a valid header CRC, frame index (xxh3 per frame) and footer around anything."""
    h = json.dumps(header).encode()
    h += b" " * (-(20 + len(h)) % 64)
    body = b"".join(struct.pack("<QQ", len(f), xxhash.xxh3_64_intdigest(f)) for f in frames)
    tail = struct.pack("<QQ", sum(map(len, frames)), len(frames))
    return (b"HFDCTP01" + struct.pack("<Q", len(h)) + h + struct.pack("<I", zlib.crc32(h)) + b"".join(frames)
            + body + tail + struct.pack("<I", zlib.crc32(body + tail)) + b"HFDCTEND")


def _frame(parts: list[tuple[int, int, bytes]]) -> bytes:
    return (struct.pack("<I", len(parts)) + b"".join(struct.pack("<BQQ", k, r, len(s)) for k, r, s in parts)
            + b"".join(s for _, _, s in parts))


@pytest.fixture
def hundred(store: CheckpointStore) -> tuple[Path, dict[str, Any]]:
    """A committed step 1 with one float32[100] tensor (400 raw bytes), and its container's header."""
    _round_trip(store, {"x": torch.randn(100)})
    directory = store.task_dir / "step-1"
    return directory, _container(directory / OPTIMIZER_NAME)[0]


def _refused(store: CheckpointStore, directory: Path, data: bytes, message: str) -> None:
    replace_file(directory, OPTIMIZER_NAME, data)
    with pytest.raises(CorruptCheckpointError, match=message):
        store.load("step:1", tiers=L1)


@pytest.mark.parametrize(("parts", "message"), [
    ([(1, 32768 * 10 + 1, b"\x00" * 10)],
     r"frame 0, part 0: kind 1, 327681 raw bytes in 10 stored bytes is not a valid part"),
    ([(0, 11, b"\x00" * 10)], r"frame 0, part 0: kind 0, 11 raw bytes in 10 stored bytes is not a valid part"),
    ([(2, 10, b"\x00" * 10)], r"part 0: kind 2, 10 raw bytes"),
    ([(0, 16, b"\x00" * 16)], r"frame 0 declares 16 bytes, the header 400"),
    ([(1, 400, zstandard.ZstdCompressor(write_checksum=True).compress(bytes(300)))],
     r"frame 0, part 0 declares 300 bytes, the header 400"),  # checked before anything is decoded
])
def test_hostile_part_tables_are_refused_before_decoding(store: CheckpointStore, hundred: tuple[Path, dict[str, Any]],
                                                          parts: list[tuple[int, int, bytes]], message: str) -> None:
    directory, header = hundred
    _refused(store, directory, _build(header, [_frame(parts)]), message)
    for count in (0, 1 << 31):
        _refused(store, directory, _build(header, [struct.pack("<I", count) + bytes(20)]),
                 rf"part table of {count} parts that does not fit")


def test_a_flipped_zstd_byte_under_a_recomputed_index_is_caught_by_zstd(store: CheckpointStore,
                                                                         hundred: tuple[Path, dict[str, Any]]) -> None:
    directory, header = hundred
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(400))
    bad = bytearray(packed)
    bad[len(bad) // 2] ^= 1
    _refused(store, directory, _build(header, [_frame([(1, 400, bytes(bad))])]),
             r"failed decompression or its checksum|does not hold the 400 bytes")
    replace_file(directory, OPTIMIZER_NAME, _build(header, [_frame([(1, 400, packed)])]))  # the helper is faithful
    assert not store.load("step:1", tiers=L1).optimizer["x"].any()


def test_every_flipped_byte_and_every_truncation_is_an_error(store: CheckpointStore) -> None:
    g = torch.Generator().manual_seed(5)
    _round_trip(store, {"a": torch.randn(50, generator=g), "z": torch.zeros(40), "h": torch.randn(20).half()})
    directory = store.task_dir / "step-1"
    good = (directory / OPTIMIZER_NAME).read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x10
        _refused(store, directory, bytes(bad), "Tensor file")
    for n in range(0, len(good), 7):
        _refused(store, directory, good[:n], "Tensor file")


def test_other_container_versions_are_refused_only_when_they_are_the_file_the_manifest_names(
        store: CheckpointStore, hundred: tuple[Path, dict[str, Any]]) -> None:
    directory, header = hundred
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bytes(400))
    for version, why in ((2, "a layout of development builds that no release wrote"),
                         (4, "newer than this library: upgrade hf_dynamic_ckpt")):
        replace_file(directory, OPTIMIZER_NAME, _build({**header, "version": version}, [frame]))
        with pytest.raises(FormatVersionError, match=rf"container version {version}, this library reads version 3 "
                                                     rf"\({why}"):
            store.load("step:1", tiers=L1)
        manifest = read_manifest_json(directory)
        manifest["files"][OPTIMIZER_NAME]["checksum"] = "xxh3_128:" + "0" * 32  # same size, not these bytes
        write_manifest_json(directory, manifest)
        with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
            store.load("step:1", tiers=L1)


def test_a_header_that_declares_more_than_its_payload_can_hold_allocates_nothing(
        store: CheckpointStore, hundred: tuple[Path, dict[str, Any]]) -> None:
    directory, header = hundred
    tensor = {**header["tensors"][0], "shape": [1 << 34], "nbytes": 1 << 36}
    _refused(store, directory, _build({**header, "tensors": [tensor], "total_bytes": 1 << 36}, [b"x" * 64]),
             r"declares 68719476736 bytes of tensors but holds a 64-byte payload")
    _refused(store, directory, _build({**header, "group_chunk_elems": 0}, [b"x" * 64]), r"has an invalid header")


def test_a_manifest_checksum_the_file_does_not_have_fails_the_load_and_a_resume_keeps_the_weights(
        store: CheckpointStore) -> None:
    """Every frame is intact, only the whole-file checksum tells: the load refuses the file, twice."""
    save_state(store, CheckpointState(step=1, weights={"w": torch.ones(2)}, optimizer={"state": {
        0: {"exp_avg": torch.randn(300, 257)}}}, scheduler={"last_epoch": 1}), reason="r")
    directory = store.task_dir / "step-1"
    manifest = read_manifest_json(directory)
    actual, wrong = manifest["files"][OPTIMIZER_NAME]["checksum"], "xxh3_128:" + "0" * 32
    manifest["files"][OPTIMIZER_NAME]["checksum"] = wrong
    write_manifest_json(directory, manifest)
    with pytest.raises(CorruptCheckpointError) as e:
        store.load("step:1")
    assert str(e.value).startswith(f"checkpoint {directory} failed verification, nothing was loaded: ")
    assert f"Tensor file {directory / OPTIMIZER_NAME}: checksum mismatch ({actual.partition(':')[2]} != {wrong})" \
        in str(e.value)
    assert store.list(include_unhealthy=True)[0].status == "corrupt"
    assert store.load("step:1", tiers={Tier.WEIGHTS}).weights is not None  # the other tiers stay loadable
    plan = plan_resume(store, "step:1")
    assert plan is not None and plan.degraded
    assert plan.loaded.optimizer is None and plan.loaded.scheduler == {"last_epoch": 1}

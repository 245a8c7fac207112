"""The optimizer tier is verified against its manifest checksum in the pass that reads it.

`read_tensor_file(checksum=...)` hashes the whole file on another thread while it checks and
decodes the frames from the same map (`hashing.WholeFileCheck`); `CheckpointStore.load`
leaves that file's checksum to it (`reader.HASHED_ON_READ`) instead of hashing it first in a
separate pass. `verify` still hashes every file itself.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import save_state
from tensorpack_v2 import write_v2

import hf_dynamic_ckpt.store.hashing as hashing
import hf_dynamic_ckpt.store.reader as reader
import hf_dynamic_ckpt.store.tensorpack as tp
from hf_dynamic_ckpt.constants import MANIFEST_NAME, OPTIMIZER_NAME
from hf_dynamic_ckpt.errors import CorruptCheckpointError, FormatVersionError
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore
from hf_dynamic_ckpt.store.hashing import file_checksum
from hf_dynamic_ckpt.store import compute_manifest_checksum
from hf_dynamic_ckpt.store import read_header, read_tensor_file, write_tensor_file

WRONG = "xxh3_128:" + "0" * 32


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"exp_avg": torch.randn(300, 257, generator=g), "exp_avg_sq": torch.rand(300, 257, generator=g) * 1e-4,
            "step": torch.tensor(3.0), "empty": torch.zeros(0), "ids": torch.arange(1000)}


@pytest.fixture(autouse=True)
def _small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    # Several frames, so they are checked and decoded on threads beside the whole-file hash.
    monkeypatch.setattr(tp, "FRAME_BYTES", 64 << 10)


def _file(tmp_path: Path, compression: str, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path = tmp_path / f"t-{compression}.bin"
    write_tensor_file(_tensors() if tensors is None else tensors, path, compression=compression, threads=2)
    assert tensors is not None or len(read_header(path)[2]) >= 3
    return path


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_right_checksum_reads_the_same_tensors(tmp_path: Path, compression: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "HASH_CHUNK", 64 << 10)  # many hash updates, interleaved with the frames
    path = _file(tmp_path, compression)
    plain = read_tensor_file(path, copy=True, threads=2)
    checked = read_tensor_file(path, copy=True, threads=2, checksum=file_checksum(path))
    assert list(checked) == list(_tensors())
    for name, t in _tensors().items():
        assert torch.equal(checked[name], t) and torch.equal(plain[name], t)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_wrong_checksum_raises_before_any_tensor(tmp_path: Path, compression: str) -> None:
    path = _file(tmp_path, compression)
    actual = file_checksum(path)
    with pytest.raises(CorruptCheckpointError) as e:
        read_tensor_file(path, checksum=WRONG)
    assert str(e.value) == f"Tensor file {path}: checksum mismatch ({actual} != {WRONG}), the file is corrupt."


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_wrong_checksum_of_a_file_without_frames(tmp_path: Path, compression: str) -> None:
    path = _file(tmp_path, compression, {"empty": torch.zeros(0)})
    assert read_header(path)[2] == []
    assert read_tensor_file(path, checksum=file_checksum(path))["empty"].numel() == 0
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"Tensor file {path}: checksum mismatch (")):
        read_tensor_file(path, checksum=WRONG)


def test_unknown_checksum_algorithm_is_a_corrupt_file(tmp_path: Path) -> None:
    path = _file(tmp_path, "zstd")
    unknown = re.escape(f"Tensor file {path}: Unknown checksum algorithm 'rot13'")
    with pytest.raises(CorruptCheckpointError, match=unknown):
        read_tensor_file(path, checksum="rot13:abc")


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hf-dynamic-ckpt-file-check"]


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_corrupt_frame_is_reported_and_the_hash_thread_stopped(tmp_path: Path, compression: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, compression)
    good = file_checksum(path)
    data = bytearray(path.read_bytes())
    data[read_header(path)[2][0][0] + 5] ^= 0x10  # in the first frame: found while the whole-file hash still runs
    path.write_bytes(bytes(data))
    monkeypatch.setattr(hashing, "HASH_CHUNK", 4096)
    real = hashing.Hasher.update
    monkeypatch.setattr(hashing.Hasher, "update", lambda self, d: (time.sleep(0.001), real(self, d))[1])
    for copy in (False, True):
        with pytest.raises(CorruptCheckpointError, match=r"frame(\(s\))? \[?0\]? fails? (its|their) xxh3 checksum"):
            read_tensor_file(path, checksum=good, copy=copy, threads=2)
        assert _hash_threads() == []  # stopped and joined before the map was released


def test_a_version_2_container_is_refused_when_it_is_the_file_the_manifest_names_else_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "v2.bin"
    write_v2(_tensors(), path)
    with pytest.raises(FormatVersionError, match="container version 2, this library reads version 3"):
        read_tensor_file(path, checksum=file_checksum(path))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"Tensor file {path}: checksum mismatch (")):
        read_tensor_file(path, checksum=WRONG)


def test_a_valid_container_of_another_version_is_corrupt_unless_it_is_the_file_the_manifest_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "zstd")
    monkeypatch.setattr(tp, "read_header", lambda p: (_ for _ in ()).throw(FormatVersionError("container version 9")))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"Tensor file {path}: checksum mismatch (")):
        read_tensor_file(path, checksum=WRONG)  # a file swapped in: corrupt (retried, then a fallback)
    with pytest.raises(FormatVersionError, match="container version 9"):
        read_tensor_file(path, checksum=file_checksum(path))  # the file the manifest names: really newer


# ---------------------------------------------------------------------------------- the store


def _state(step: int) -> CheckpointState:
    g = torch.Generator().manual_seed(step)
    return CheckpointState(step=step, weights={"w": torch.randn(64, 32, generator=g)},
                           optimizer={"state": {0: {"exp_avg": torch.randn(64, 32, generator=g)}},
                                      "param_groups": [{"lr": 0.1, "params": [0]}]},
                           scheduler={"last_epoch": step}, rng={"seed": step}, sampler={"batches": step})


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "root", task_id="run")
    yield s
    s.close()


def test_load_hashes_the_optimizer_file_once_while_reading_it(store: CheckpointStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    info = save_state(store, _state(1), reason="r")
    entry = json.loads((Path(info.path) / MANIFEST_NAME).read_text())["files"][OPTIMIZER_NAME]
    hashed: list[str] = []
    compared: list[tuple[str, str, str]] = []
    real_checksum, real_compare = reader.file_checksum, hashing._compare
    monkeypatch.setattr(reader, "file_checksum", lambda path, algo=None: hashed.append(Path(path).name)
                        or real_checksum(path, algo=algo))
    monkeypatch.setattr(hashing, "_compare", lambda actual, expected, what: compared.append((actual, expected, what))
                        or real_compare(actual, expected, what))
    loaded = store.load("step:1")
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], _state(1).optimizer["state"][0]["exp_avg"])
    assert OPTIMIZER_NAME not in hashed and "weights.safetensors" in hashed  # the others: hashed before
    assert compared == [(entry["checksum"], entry["checksum"], f"Tensor file {Path(info.path) / OPTIMIZER_NAME}")]
    hashed.clear()
    assert store.verify("step:1") == []  # verify hashes every file itself
    assert OPTIMIZER_NAME in hashed


def test_a_manifest_checksum_the_file_does_not_have_fails_the_load(store: CheckpointStore) -> None:
    """Every frame is intact, only the whole-file checksum tells: the load must still refuse the file."""
    info = save_state(store, _state(1), reason="r")
    directory = Path(info.path)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    actual = manifest["files"][OPTIMIZER_NAME]["checksum"]
    manifest["files"][OPTIMIZER_NAME]["checksum"] = WRONG
    manifest["manifest_checksum"] = compute_manifest_checksum(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError) as e:
        store.load("step:1")
    assert (f"Tensor file {directory / OPTIMIZER_NAME}: checksum mismatch ({actual} != {WRONG}), the file is corrupt."
            in str(e.value))
    assert str(e.value).startswith(f"checkpoint {directory} failed verification, nothing was loaded: ")
    weights_only = store.load("step:1", tiers={"weights"})  # the other tiers stay loadable
    assert weights_only.optimizer is None and weights_only.weights is not None


def test_a_checksum_mismatch_is_read_twice_then_corrupt_and_resume_falls_back_to_weights(
        store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_dynamic_ckpt.run import resume

    info = save_state(store, _state(1), reason="r")
    directory = Path(info.path)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["files"][OPTIMIZER_NAME]["checksum"] = WRONG
    manifest["manifest_checksum"] = compute_manifest_checksum(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    calls: list[str | None] = []
    real = tp.read_tensor_file
    monkeypatch.setattr(tp, "read_tensor_file", lambda *a, **k: calls.append(k.get("checksum")) or real(*a, **k))
    with pytest.raises(CorruptCheckpointError, match=r"the file is corrupt\. Restore another checkpoint"):
        store.load("step:1", tiers={"optimizer"})
    assert calls == [WRONG, WRONG]  # a transient read error must not cost the checkpoint: read once more
    assert store.list(include_unhealthy=True)[0].status == "corrupt"
    assert _hash_threads() == []
    plan = resume.plan_resume(store, "step:1")
    assert plan is not None and plan.degraded
    loaded = plan.loaded
    assert loaded.optimizer is None and loaded.scheduler == {"last_epoch": 1} and loaded.weights is not None

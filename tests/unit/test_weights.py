"""L0 weights through the store: safetensors files, tied weights, hostile files, the one-pass read into a model."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import save_state
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from store_helpers import file_checksum, read_manifest_json, replace_file, write_manifest_json

from examples import toy
from hf_dynamic_ckpt.constants import WEIGHTS_NAME, Tier
from hf_dynamic_ckpt.errors import CorruptCheckpointError, SaveError
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, LoadedCheckpoint

ALIASES = "hf_dynamic_ckpt.aliases"
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16, torch.uint16,
          torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.complex64, torch.float64,
          torch.int64, torch.uint64]


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "root", task_id="run")
    yield s
    s.close()


def _save(store: CheckpointStore, weights: dict, step: int = 1) -> Path:
    return Path(save_state(store, CheckpointState(step=step, weights=weights), reason="r").path)


def _load(store: CheckpointStore, step: int = 1, mmap: bool = True) -> dict[str, torch.Tensor]:
    return store.load(f"step:{step}", tiers={Tier.WEIGHTS}, mmap=mmap).weights


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape, bytes), NaN-safe."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                         b.contiguous().reshape(-1).view(torch.uint8))


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        base = torch.randn(3, 5, generator=g) * 50
        out[f"layer.{i}.w"] = base.to(torch.complex64).to(dtype) if dtype.is_complex else base.to(dtype)
    out["b.empty"] = torch.zeros(0, 4)
    out["a.scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    out["z.nan_inf"] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    out["ü.non_ascii"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    return out


def test_every_dtype_is_a_plain_safetensors_file_read_back_bit_exactly(store: CheckpointStore, tmp_path: Path) -> None:
    tensors = _all_dtypes()
    directory = _save(store, tensors)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (directory / WEIGHTS_NAME).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    entry = read_manifest_json(directory)["files"][WEIGHTS_NAME]
    assert entry == {"size": (directory / WEIGHTS_NAME).stat().st_size, "checksum":
                     file_checksum(directory / WEIGHTS_NAME), "tier": "weights", "rank": None}
    for back in (_load(store), _load(store, mmap=False), load_file(str(directory / WEIGHTS_NAME))):
        assert back.keys() == tensors.keys() and all(_same(back[k], t) for k, t in tensors.items())
    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("mmap", [True, False])
def test_non_contiguous_round_trip_and_writes_never_reach_the_file(store: CheckpointStore, mmap: bool) -> None:
    base = torch.randn(4, 6)
    tensors = {"t": base.t(), "slice": base[:, ::2], "bf": base.to(torch.bfloat16).t()}
    _save(store, tensors)
    loaded = _load(store, mmap=mmap)
    assert all(_same(loaded[k], t.contiguous()) and loaded[k].is_contiguous() for k, t in tensors.items())
    loaded["t"].add_(1.0)  # copy-on-write pages, or owned memory
    assert _same(_load(store, mmap=mmap)["t"], tensors["t"].contiguous())
    assert store.verify("step:1") == []


def test_lora_adapter_is_a_drop_in_adapter_model_safetensors(store: CheckpointStore, tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict

    model = toy.lora(toy.tiny_qwen2(seed=1), r=4)
    with torch.no_grad():  # lora_B starts at zero; make every tensor distinct
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    adapter = get_peft_model_state_dict(model)
    directory = _save(store, adapter)
    model.save_pretrained(tmp_path / "peft")
    assert (directory / WEIGHTS_NAME).read_bytes() == (tmp_path / "peft" / "adapter_model.safetensors").read_bytes()


def test_tied_weights_are_stored_once_and_loaded_as_one_tensor(store: CheckpointStore) -> None:
    sd = toy.tiny_qwen2(seed=2, tie_word_embeddings=True).state_dict()
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    assert sd[emb].data_ptr() == sd[head].data_ptr()  # precondition: real shared storage
    header = _header(_save(store, sd) / WEIGHTS_NAME)
    assert emb in header and head not in header and json.loads(header["__metadata__"][ALIASES]) == {head: emb}
    loaded = _load(store)
    assert loaded.keys() == sd.keys() and loaded[head] is loaded[emb] and all(_same(loaded[k], t) for k, t in
                                                                              sd.items())
    fresh = toy.tiny_qwen2(seed=3, tie_word_embeddings=True)
    result = fresh.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_views_of_one_storage_that_differ_are_stored_separately(store: CheckpointStore) -> None:
    fused = torch.randn(6, 4)
    tensors = {"q": fused[:2], "k": fused[2:4], "whole": fused}
    assert ALIASES not in _header(_save(store, tensors) / WEIGHTS_NAME)["__metadata__"]
    assert all(_same(_load(store)[k], t) for k, t in tensors.items())


def test_save_errors_name_the_problem(store: CheckpointStore) -> None:
    for weights, message in (({"x": [1, 2]}, r"Weight 'x' is a list, expected a torch.Tensor"),
                             ({"s": torch.eye(2).to_sparse()}, r"Weight 's' has layout torch.sparse_coo"),
                             ({"c": torch.zeros(2, dtype=torch.complex128)}, r"cannot be written as safetensors")):
        with pytest.raises(SaveError, match=message):
            _save(store, weights)
    assert store.list(include_unhealthy=True) == []


def _raw_file(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("mmap", [True, False])
def test_a_damaged_or_hostile_weights_file_is_a_corrupt_checkpoint(store: CheckpointStore, mmap: bool) -> None:
    directory = _save(store, {"w": torch.randn(10, 10), "b": torch.randn(10)})
    good = (directory / WEIGHTS_NAME).read_bytes()
    cases = {  # each vouched for by the manifest (size and checksum): only the parser stands in the way
        "truncated data": good[:-7], "appended byte": good + b"\0", "truncated header": good[:20], "empty file": b"",
        "broken JSON": good[:9] + b"!" + good[10:],
        "unknown dtype": _raw_file({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "size mismatch": _raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),
        "overlap": _raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                              "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "gap": _raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
        "negative dim": _raw_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
        "bad metadata": _raw_file({"__metadata__": {"x": 1}}, b""),
    }
    for case, raw in cases.items():
        replace_file(directory, WEIGHTS_NAME, raw)
        with pytest.raises(CorruptCheckpointError, match=r"weights.safetensors is not a valid safetensors file \("):
            _load(store, mmap=mmap)
        assert store.verify("step:1") == [], case  # the bytes are the manifest's: only the parser can tell
    (directory / WEIGHTS_NAME).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"weights.safetensors \(tier weights\): file is missing"):
        _load(store, mmap=mmap)


def test_an_alias_to_an_unknown_key_is_corrupt(store: CheckpointStore, tmp_path: Path) -> None:
    directory = _save(store, {"a": torch.ones(2)})
    save_file({"a": torch.ones(2)}, str(tmp_path / "w"), metadata={"format": "pt", ALIASES: json.dumps({"b": "nope"})})
    replace_file(directory, WEIGHTS_NAME, (tmp_path / "w").read_bytes())
    with pytest.raises(CorruptCheckpointError, match=r"Weight 'b' aliases 'nope', which .* does not hold"):
        _load(store)


def test_mapped_tensors_outlive_the_store_and_the_file(store: CheckpointStore) -> None:
    w = torch.randn(64, 8)
    directory = _save(store, {"w": w})
    loaded = _load(store)["w"]
    store.delete("step:1")
    store.close()
    gc.collect()
    assert not directory.exists() and _same(loaded, w)


def _loaded(store: CheckpointStore, stored: dict[str, torch.Tensor]) -> LoadedCheckpoint:
    _save(store, stored)
    return store.load("step:1", tiers={Tier.WEIGHTS}, weights_checksum=False)


def test_read_into_fills_the_targets_that_fit_and_leaves_the_others(store: CheckpointStore) -> None:
    stored = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64), "c": torch.randn(2),
              "d": torch.randn(5), "empty": torch.zeros(0)}
    targets = {"a": torch.zeros(3, 4), "b": torch.zeros(6, dtype=torch.int64), "c": torch.zeros(2, dtype=torch.float64),
               "d": torch.zeros(10)[::2], "empty": torch.zeros(0)}
    a_memory = targets["a"].data_ptr()
    done = store.read_weights_into(_loaded(store, stored), targets)
    assert done == {"a", "b", "empty"}  # c: another dtype, d: not contiguous; neither touched
    assert targets["a"].data_ptr() == a_memory and torch.equal(targets["a"], stored["a"])
    assert torch.equal(targets["b"], stored["b"]) and not targets["c"].any() and not targets["d"].any()


def test_read_into_with_verify_hashes_every_byte_in_one_pass_and_a_second_failure_is_corrupt(
        store: CheckpointStore) -> None:
    stored = {"a": torch.randn(3000), "b": torch.randn(7), "c": torch.arange(5, dtype=torch.int64)}
    loaded = _loaded(store, stored)
    for keys in ({"a", "b", "c"}, {"b"}, set()):  # what no target takes is hashed through a scratch buffer
        targets = {k: torch.zeros_like(stored[k]) for k in keys}
        assert store.read_weights_into(loaded, targets, verify=True) == keys
        assert all(torch.equal(targets[k], stored[k]) for k in keys)
    path = Path(loaded.info.path) / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for where in (header + 4, len(data) - 4):  # inside a target; inside the last tensor (no target)
        damaged = bytearray(data)
        damaged[where] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match=r"failed verification: Weights file .* checksum mismatch"):
            store.read_weights_into(loaded, {"a": torch.zeros(3000)}, verify=True)
        assert store.list(include_unhealthy=True)[0].status == "corrupt"
    path.write_bytes(bytes(data[:-8]))
    with pytest.raises(CorruptCheckpointError, match=r"is not a valid safetensors file"):
        store.read_weights_into(loaded, {"a": torch.zeros(3000)}, verify=True)
    path.write_bytes(bytes(data))
    manifest = read_manifest_json(path.parent)
    manifest["files"][WEIGHTS_NAME]["checksum"] = "md0:00"
    write_manifest_json(path.parent, manifest)
    with pytest.raises(CorruptCheckpointError, match=r"Unknown checksum algorithm 'md0'"):
        store.read_weights_into(store.load("step:1", tiers={Tier.WEIGHTS}, weights_checksum=False), {}, verify=True)

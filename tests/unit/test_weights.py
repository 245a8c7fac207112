"""L0 weights: safetensors bytes, tied weights, dedup blobs, errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hf_dynamic_ckpt.store.blobs import BlobStore, tensor_digest
from hf_dynamic_ckpt.store.hashing import file_checksum
from hf_dynamic_ckpt.store.safetensors_io import DTYPES, read_into
from hf_dynamic_ckpt.store.weights import (
    ALIASES_METADATA_KEY,
    load_weights,
    save_weights,
)
from safetensors import safe_open
from safetensors.torch import save_file

from examples import toy
from hf_dynamic_ckpt.constants import WEIGHTS_NAME
from hf_dynamic_ckpt.errors import CorruptCheckpointError, SaveError
from hf_dynamic_ckpt.store import BlobRef


def verify_blob(blobs_dir: Path, rec: dict) -> list[str]:
    return BlobStore(blobs_dir).verify(rec)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape, bytes), NaN-safe."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


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


def test_bytes_equal_safetensors_save_file_for_every_dtype(tmp_path: Path) -> None:
    tensors = _all_dtypes()
    rec = save_weights(tensors, tmp_path, blobs_dir=None)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours = tmp_path / WEIGHTS_NAME
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    entry = rec.files[WEIGHTS_NAME]
    assert entry["size"] == ours.stat().st_size
    assert entry["checksum"] == file_checksum(ours)
    assert entry["tier"] == "weights"
    assert rec.blobs == {} and rec.digests == {}
    loaded = load_weights(tmp_path, {}, blobs_dir=tmp_path / "blobs")
    assert loaded.keys() == tensors.keys()
    for key, t in tensors.items():
        assert _same(loaded[key], t), key


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_mmap_modes_and_non_contiguous(tmp_path: Path, mmap: bool) -> None:
    base = torch.randn(4, 6)
    tensors = {"t": base.t(), "slice": base[:, ::2], "bf": base.to(torch.bfloat16).t()}
    assert not tensors["t"].is_contiguous()
    save_weights(tensors, tmp_path, blobs_dir=None)
    loaded = load_weights(tmp_path, {}, blobs_dir=tmp_path / "blobs", mmap=mmap)
    for key, t in tensors.items():
        assert _same(loaded[key], t.contiguous()), key
        assert loaded[key].is_contiguous()
    # Writing to a loaded tensor must never reach the file (copy-on-write or owned memory).
    loaded["t"].add_(1.0)
    again = load_weights(tmp_path, {}, blobs_dir=tmp_path / "blobs", mmap=mmap)
    assert _same(again["t"], tensors["t"].contiguous())


def test_lora_adapter_is_a_drop_in_adapter_model_safetensors(tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict

    model = toy.lora(toy.tiny_qwen2(seed=1), r=4)
    with torch.no_grad():  # lora_B starts at zero; make every tensor distinct
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    adapter = get_peft_model_state_dict(model)
    assert len(adapter) == 8 and all("lora_" in k for k in adapter)
    save_weights(adapter, tmp_path, blobs_dir=None)
    model.save_pretrained(tmp_path / "peft")
    assert (tmp_path / WEIGHTS_NAME).read_bytes() == (tmp_path / "peft" / "adapter_model.safetensors").read_bytes()


def test_tied_weights_stored_once_and_realiased(tmp_path: Path) -> None:
    model = toy.tiny_qwen2(seed=2, tie_word_embeddings=True)
    sd = model.state_dict()
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    assert sd[emb].data_ptr() == sd[head].data_ptr()  # precondition: real shared storage
    save_weights(sd, tmp_path, blobs_dir=None)
    header = _header(tmp_path / WEIGHTS_NAME)
    assert emb in header and head not in header
    assert json.loads(header["__metadata__"][ALIASES_METADATA_KEY]) == {head: emb}
    loaded = load_weights(tmp_path, {}, blobs_dir=tmp_path / "blobs")
    assert loaded.keys() == sd.keys()
    assert loaded[head] is loaded[emb]
    for key, t in sd.items():
        assert _same(loaded[key], t), key
    # Loads into a fresh tied model with nothing missing.
    fresh = toy.tiny_qwen2(seed=3, tie_word_embeddings=True)
    result = fresh.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert _same(fresh.lm_head.weight.detach(), sd[head])


def test_views_of_one_storage_that_differ_are_stored_separately(tmp_path: Path) -> None:
    fused = torch.randn(6, 4)
    tensors = {"q": fused[:2], "k": fused[2:4], "whole": fused}
    save_weights(tensors, tmp_path, blobs_dir=None)
    assert ALIASES_METADATA_KEY not in _header(tmp_path / WEIGHTS_NAME)["__metadata__"]
    loaded = load_weights(tmp_path, {}, blobs_dir=tmp_path)
    for key, t in tensors.items():
        assert _same(loaded[key], t), key


def test_dedup_writes_blob_once_and_blobref_writes_nothing(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    frozen = torch.randn(32, 16)
    live = torch.randn(4, 16)
    d1, d2, d3 = (tmp_path / f"s{i}" for i in range(3))
    for d in (d1, d2, d3):
        d.mkdir()
    rec1 = save_weights({"frozen": frozen, "live": live}, d1, blobs_dir=blobs, dedup_keys={"frozen"})
    digest = tensor_digest(frozen)
    assert rec1.blobs == {"frozen": {"digest": digest, "dtype": "float32", "shape": [32, 16],
                                     "size": BlobStore(blobs).path(digest).stat().st_size}}
    assert rec1.digests == {"frozen": BlobRef(digest, "float32", (32, 16))}
    assert set(_header(d1 / WEIGHTS_NAME)) == {"__metadata__", "live"}
    stat1 = BlobStore(blobs).path(digest).stat()

    # Same tensor again in dedup_keys: blob not rewritten. BlobRef: nothing written.
    rec2 = save_weights({"frozen": frozen.clone(), "live": live}, d2, blobs_dir=blobs, dedup_keys={"frozen"})
    rec3 = save_weights({"frozen": rec1.digests["frozen"], "live": live}, d3, blobs_dir=blobs)
    stat_after = BlobStore(blobs).path(digest).stat()
    assert (stat_after.st_ino, stat_after.st_mtime_ns) == (stat1.st_ino, stat1.st_mtime_ns)
    assert sorted(p.name for p in blobs.iterdir()) == [f"{digest}.safetensors"]
    assert rec2.blobs == rec1.blobs == rec3.blobs
    for d, rec in ((d1, rec1), (d2, rec2), (d3, rec3)):
        loaded = load_weights(d, rec.blobs, blobs_dir=blobs)
        assert _same(loaded["frozen"], frozen) and _same(loaded["live"], live)
    assert verify_blob(blobs, rec1.blobs["frozen"]) == []


def test_tied_and_frozen_embedding_goes_to_one_blob(tmp_path: Path) -> None:
    sd = toy.tiny_qwen2(seed=4, tie_word_embeddings=True).state_dict()
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    rec = save_weights(sd, tmp_path, blobs_dir=tmp_path / "blobs", dedup_keys={emb, head})
    assert list(rec.blobs) == [emb]
    assert len(list((tmp_path / "blobs").iterdir())) == 1
    loaded = load_weights(tmp_path, rec.blobs, blobs_dir=tmp_path / "blobs")
    assert loaded[head] is loaded[emb] and _same(loaded[head], sd[head])
    assert loaded.keys() == sd.keys()


def test_tensor_digest_depends_on_bytes_dtype_and_shape() -> None:
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) != tensor_digest(t.reshape(3, 4))
    assert tensor_digest(t) != tensor_digest(t.view(torch.int32))
    bumped = t.clone()
    bumped[7] = torch.nextafter(bumped[7], torch.tensor(100.0))
    assert tensor_digest(t) != tensor_digest(bumped)
    assert tensor_digest(t.reshape(3, 4).t()) == tensor_digest(t.reshape(3, 4).t().contiguous())


def test_missing_blob_on_load_names_key_and_path(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    rec = save_weights({"w": torch.ones(3)}, tmp_path, blobs_dir=blobs, dedup_keys={"w"})
    path = BlobStore(blobs).path(rec.blobs["w"]["digest"])
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"Weight 'w' is stored in blob .*missing") as exc:
        load_weights(tmp_path, rec.blobs, blobs_dir=blobs)
    assert str(path) in str(exc.value)
    assert verify_blob(blobs, rec.blobs["w"]) == [f"blob {path} is missing"]


def test_blob_with_wrong_content_is_caught(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    rec = save_weights({"w": torch.arange(64, dtype=torch.float32)}, tmp_path, blobs_dir=blobs, dedup_keys={"w"})
    path = BlobStore(blobs).path(rec.blobs["w"]["digest"])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(raw)
    assert verify_blob(blobs, rec.blobs["w"]) == [f"blob {path} content does not match its digest (corrupt)"]
    wrong_shape = {"w": {**rec.blobs["w"], "shape": [8, 8]}}
    with pytest.raises(CorruptCheckpointError, match=r"holds float32\[64\], but the manifest records float32\[8, 8\]"):
        load_weights(tmp_path, wrong_shape, blobs_dir=blobs)


def test_save_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(SaveError, match=r"Weight 'c' has dtype complex128, which safetensors cannot store"):
        save_weights({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path, blobs_dir=None)
    with pytest.raises(SaveError, match=r"Weight 'x' is a list, expected a torch.Tensor or BlobRef"):
        save_weights({"x": [1, 2]}, tmp_path, blobs_dir=None)  # type: ignore[dict-item]
    with pytest.raises(SaveError, match=r"blobs_dir=None"):
        save_weights({"x": torch.ones(1)}, tmp_path, blobs_dir=None, dedup_keys={"x"})
    ref = BlobRef("0" * 64, "float32", (1,))
    with pytest.raises(SaveError, match=r"Weight 'x' was passed as BlobRef\(000000000000...\) but .* does not exist"):
        save_weights({"x": ref}, tmp_path, blobs_dir=tmp_path / "blobs")
    with pytest.raises(SaveError, match=r"layout torch.sparse_coo"):
        save_weights({"s": torch.eye(2).to_sparse()}, tmp_path, blobs_dir=None)


def _raw_file(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("mmap", [True, False])
def test_corrupt_or_missing_weights_file_raises(tmp_path: Path, mmap: bool) -> None:
    def load() -> dict[str, torch.Tensor]:
        return load_weights(tmp_path, {}, blobs_dir=tmp_path, mmap=mmap)

    with pytest.raises(CorruptCheckpointError, match="is missing"):
        load()
    save_weights({"w": torch.randn(10, 10), "b": torch.randn(10)}, tmp_path, blobs_dir=None)
    path = tmp_path / WEIGHTS_NAME
    good = path.read_bytes()
    cases = {
        "truncated data": (good[:-7], r"truncated or extended"),
        "appended byte": (good + b"\0", r"truncated or extended"),
        "truncated header": (good[:20], r"does not fit a 20-byte file"),
        "empty file": (b"", r"shorter than the 8-byte header length"),
        "broken JSON": (good[:9] + b"!" + good[10:], r"not a valid safetensors file"),
        "unknown dtype": (_raw_file({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), r"'Q7'"),
        "size mismatch": (_raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),
                          r"offsets 0..4 do not match float32\[2\]"),
        "overlap": (_raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
                    r"starts at 0, expected 4 \(overlap or gap\)"),
        "gap": (_raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
                r"starts at 4, expected 0"),
        "negative dim": (_raw_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
                         r"has shape \[-1\]"),
        "bad metadata": (_raw_file({"__metadata__": {"x": 1}}, b""), r"__metadata__ is not a str -> str map"),
    }
    for raw, msg in cases.values():
        path.write_bytes(raw)
        with pytest.raises(CorruptCheckpointError, match=msg):
            load()


def test_mmap_tensors_outlive_the_loader_and_file(tmp_path: Path) -> None:
    import gc

    w = torch.randn(64, 8)
    save_weights({"w": w}, tmp_path, blobs_dir=None)
    loaded = load_weights(tmp_path, {}, blobs_dir=tmp_path, mmap=True)["w"]
    (tmp_path / WEIGHTS_NAME).unlink()
    gc.collect()
    assert _same(loaded, w)


def test_files_are_readable_by_safetensors_load_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = _all_dtypes()
    save_weights(tensors, tmp_path, blobs_dir=None)
    back = load_file(str(tmp_path / WEIGHTS_NAME))
    assert back.keys() == tensors.keys()
    for key, t in tensors.items():
        assert _same(back[key], t), key


def test_alias_to_unknown_key_is_corrupt(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / WEIGHTS_NAME),
              metadata={"format": "pt", ALIASES_METADATA_KEY: json.dumps({"b": "nope"})})
    with pytest.raises(CorruptCheckpointError, match=r"Weight 'b' aliases 'nope', which is not stored"):
        load_weights(tmp_path, {}, blobs_dir=tmp_path)


def test_written_file_is_readable_by_safe_open_with_metadata(tmp_path: Path) -> None:
    save_weights({"w": torch.ones(2, 2)}, tmp_path, blobs_dir=None)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == ["w"]


def test_read_into_fills_the_targets_that_fit_and_leaves_the_others(tmp_path: Path) -> None:
    stored = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64), "c": torch.randn(2),
              "d": torch.randn(5), "empty": torch.zeros(0)}
    save_file(stored, str(tmp_path / "w.safetensors"))
    targets = {"a": torch.zeros(3, 4), "b": torch.zeros(6, dtype=torch.int64), "c": torch.zeros(2, dtype=torch.float64),
               "d": torch.zeros(10)[::2], "empty": torch.zeros(0)}
    a_memory = targets["a"].data_ptr()
    done = read_into(tmp_path / "w.safetensors", targets, what="Weights")
    assert done == {"a", "b", "empty"}  # c: another dtype, d: not contiguous; neither touched
    assert targets["a"].data_ptr() == a_memory and torch.equal(targets["a"], stored["a"])
    assert torch.equal(targets["b"], stored["b"])
    assert not targets["c"].any() and not targets["d"].any()


def test_read_into_a_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64)}, str(path))
    with pytest.raises(CorruptCheckpointError, match=r"is not a valid safetensors file \(data section ends at"):
        path.write_bytes(path.read_bytes()[:-8])
        read_into(path, {"a": torch.zeros(64)}, what="Weights")
    with pytest.raises(CorruptCheckpointError, match=r"w\.safetensors cannot be read"):
        read_into(tmp_path / "missing" / "w.safetensors", {}, what="Weights")


def test_read_into_with_a_checksum_hashes_every_byte_of_the_file_in_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    stored = {"a": torch.randn(3000), "b": torch.randn(7), "c": torch.arange(5, dtype=torch.int64)}
    save_file(stored, str(path))
    checksum = file_checksum(path)
    for keys in ({"a", "b", "c"}, {"b"}, set()):  # what no target takes is hashed through a scratch buffer
        targets = {k: torch.zeros_like(stored[k]) for k in keys}
        assert read_into(path, targets, what="Weights", checksum=checksum) == keys
        assert all(torch.equal(targets[k], stored[k]) for k in keys)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    # inside a target, inside the last tensor (no target), inside the header
    for where, why in ((header + 4, "checksum mismatch"), (len(data) - 4, "checksum mismatch"),
                       (10, "checksum mismatch|not a valid safetensors file")):
        damaged = bytearray(data)
        damaged[where] ^= 0x01
        path.write_bytes(bytes(damaged))
        target = torch.zeros(3000)
        with pytest.raises(CorruptCheckpointError, match=why):
            read_into(path, {"a": target}, what="Weights", checksum=checksum)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"Unknown checksum algorithm 'md0'"):
        read_into(path, {}, what="Weights", checksum="md0:00")

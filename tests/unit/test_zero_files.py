"""Sharded checkpoints on disk: ZeRO runs and FSDP2 blocks read back across ranks, gathered whole, and the set-up check.

The 2-process runs are in tests/distributed/test_deepspeed.py and test_fsdp_resume.py; these pin the file-level pieces
they rely on: `ChunkReader` (a range or block from whichever ranks' chunks hold it), `gather_weights` (an export's
whole tensors), the chunk table's validation, and `check_sharding` (a ZeRO checkpoint resumes under ZeRO only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hf_dynamic_ckpt.errors import CorruptCheckpointError, IncompatibleStateError
from hf_dynamic_ckpt.sharded import ZeroExpected, check_sharding
from hf_dynamic_ckpt.store.shard_files import ChunkReader, gather_weights, is_flat, placeholders, sharded_table


def _run(shape: list[int], offset: int, size: int, file: str) -> dict[str, Any]:
    return {"shape": [int(torch.Size(shape).numel())], "offset": [offset], "size": [size], "dtype": "float32",
            "tensor_shape": shape, "file": file}


def _read(reader: ChunkReader, part: str, key: str, start: int, stop: int) -> torch.Tensor:
    out = torch.empty(stop - start)
    reader.read_into(part, key, out, [start])
    return out


@pytest.fixture
def two_ranks(tmp_path: Path) -> tuple[Path, dict[str, Any], torch.Tensor]:
    """A [3, 4] weight split 5 / 7 over two ranks (ZeRO stage 3 style), and its moment split the same way."""
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = full.reshape(-1)
    save_file({"w": flat[:5].clone()}, tmp_path / "weights-rank0.safetensors")
    save_file({"w": flat[5:].clone()}, tmp_path / "weights-rank1.safetensors")
    save_file({"state.w.exp_avg": -flat[:5].clone()}, tmp_path / "optimizer-rank0.safetensors")
    save_file({"state.w.exp_avg": -flat[5:].clone()}, tmp_path / "optimizer-rank1.safetensors")
    table = {"format": "hf_dynamic_ckpt.dcp-chunks/1", "world_size": 2, "ranks": {
        "0": {"weights": {"w": _run([3, 4], 0, 5, "weights-rank0.safetensors")},
              "optimizer": {"state.w.exp_avg": _run([3, 4], 0, 5, "optimizer-rank0.safetensors")}},
        "1": {"weights": {"w": _run([3, 4], 5, 7, "weights-rank1.safetensors")},
              "optimizer": {"state.w.exp_avg": _run([3, 4], 5, 7, "optimizer-rank1.safetensors")}}}}
    return tmp_path, table, full


def test_flat_reader_reads_any_range_from_the_ranks_that_hold_it(two_ranks) -> None:
    directory, table, full = two_ranks
    flat = full.reshape(-1)
    with ChunkReader(directory, table) as reader:
        assert torch.equal(_read(reader, "weights", "w", 0, 12), flat)  # one process reading two ranks' partitions
        assert torch.equal(_read(reader, "weights", "w", 3, 9), flat[3:9])  # a range across the boundary
        assert torch.equal(_read(reader, "weights", "w", 6, 8), flat[6:8])
        assert torch.equal(_read(reader, "optimizer", "state.w.exp_avg", 4, 6), -flat[4:6])
        assert reader.keys("optimizer") == {"state.w.exp_avg"}
        with pytest.raises(IncompatibleStateError, match=r"holds no optimizer tensor 'state\.w\.exp_avg_sq', which "
                                                         r"this run has: it was saved from another model or optimizer"):
            _read(reader, "optimizer", "state.w.exp_avg_sq", 0, 5)


def test_flat_reader_names_a_range_no_rank_holds(two_ranks) -> None:
    directory, table, _ = two_ranks
    del table["ranks"]["1"]
    with ChunkReader(directory, table) as reader, pytest.raises(
            CorruptCheckpointError, match=r"the saved chunks of 'w' hold 2 of the 6 elements at \[3\]: a rank's shard "
                                          r"is missing\."):
        _read(reader, "weights", "w", 3, 9)


def test_gather_weights_assembles_zero_runs_and_fsdp_blocks(two_ranks, tmp_path: Path) -> None:
    directory, table, full = two_ranks
    assert is_flat(table)
    assert placeholders(table)["w"].shape == (3, 4)  # the model check sees the parameter's shape
    gathered = gather_weights(directory, table)
    assert gathered.keys() == {"w"} and torch.equal(gathered["w"], full)
    # FSDP2: blocks of the tensor itself (rows 0-1 on rank 0, row 2 on rank 1), no tensor_shape.
    save_file({"w": full[:2].clone()}, tmp_path / "b0.safetensors")
    save_file({"w": full[2:].clone()}, tmp_path / "b1.safetensors")
    blocks = {"format": "hf_dynamic_ckpt.dcp-chunks/1", "world_size": 2, "ranks": {
        "0": {"weights": {"w": {"shape": [3, 4], "offset": [0, 0], "size": [2, 4], "dtype": "float32",
                                "file": "b0.safetensors"}}},
        "1": {"weights": {"w": {"shape": [3, 4], "offset": [2, 0], "size": [1, 4], "dtype": "float32",
                                "file": "b1.safetensors"}}}}}
    assert not is_flat(blocks)
    assert torch.equal(gather_weights(tmp_path, blocks)["w"], full)
    del blocks["ranks"]["1"]
    with pytest.raises(CorruptCheckpointError, match=r"the saved chunks of 'w' hold 8 of the 12 elements at \[0, 0\]"):
        gather_weights(tmp_path, blocks)


def test_a_chunk_table_naming_another_file_or_rank_is_corrupt(two_ranks) -> None:
    _, table, _ = two_ranks
    assert sharded_table({"world_size": 2, "extra": {"sharded": table}}) is table
    for bad in ("weights-rank1.safetensors", "../weights-rank0.safetensors", "optimizer-rank0.safetensors"):
        table["ranks"]["0"]["weights"]["w"]["file"] = bad  # only rank 0's own weights file may hold its weights
        with pytest.raises(CorruptCheckpointError, match=r"chunk table is malformed"):
            sharded_table({"world_size": 2, "extra": {"sharded": table}})
    table["ranks"]["0"]["weights"]["w"]["file"] = "weights-rank0.safetensors"
    with pytest.raises(CorruptCheckpointError, match=r"chunk table is malformed"):
        sharded_table({"world_size": 1, "extra": {"sharded": table}})  # rank 1 of a one-process save
    table["ranks"]["0"]["weights"]["w"]["tensor_shape"] = [4, 4]  # 16 elements for a run of 12
    with pytest.raises(CorruptCheckpointError, match=r"chunk table is malformed"):
        sharded_table({"world_size": 2, "extra": {"sharded": table}})


def test_a_zero_checkpoint_resumes_under_zero_only(two_ranks) -> None:
    _, table, _ = two_ranks
    zero_live = ZeroExpected(w=torch.empty(3, 4, device="meta"))
    plain_live = {"w": torch.empty(3, 4)}
    zero_saved = {"extra": {"sharded": table}}
    fsdp_saved = {"extra": {"sharded": {"format": table["format"], "world_size": 1, "ranks": {"0": {"weights": {
        "w": {"shape": [3, 4], "offset": [0, 0], "size": [3, 4], "dtype": "float32",
              "file": "weights-rank0.safetensors"}}}}}}}
    check_sharding(6, zero_saved, zero_live)  # no error
    with pytest.raises(IncompatibleStateError, match=r"^step 6 was saved under DeepSpeed ZeRO and this run does not: "
                                                     r"resume it in the set-up that saved it"):
        check_sharding(6, zero_saved, plain_live)
    with pytest.raises(IncompatibleStateError, match=r"^step 6 was saved without sharding and this run trains under "
                                                     r"ZeRO"):
        check_sharding(6, {"extra": {}}, zero_live)
    with pytest.raises(IncompatibleStateError, match=r"^step 6 was saved sharded by FSDP2 and this run trains under"):
        check_sharding(6, fsdp_saved, zero_live)


def test_flat_reader_reads_a_range_straight_into_its_destination(two_ranks) -> None:
    directory, table, full = two_ranks
    flat = full.reshape(-1)
    with ChunkReader(directory, table) as reader:
        partition = torch.full((10,), 99.0)
        reader.read_into("weights", "w", partition.narrow(0, 2, 6), [3])  # a view: the range lands in place
        assert torch.equal(partition[2:8], flat[3:9])
        assert torch.equal(partition[:2], torch.full((2,), 99.0)) and torch.equal(partition[8:], torch.full((2,), 99.0))
        wide = torch.zeros(6, dtype=torch.float64)  # another dtype: through one host tensor
        reader.read_into("optimizer", "state.w.exp_avg", wide, [3])
        assert torch.equal(wide, -flat[3:9].double())


def test_flat_reader_refuses_a_file_shorter_than_its_chunk(two_ranks) -> None:
    directory, table, _ = two_ranks
    save_file({"w": torch.zeros(4)}, directory / "weights-rank1.safetensors")  # 4 elements, the chunk says 7
    with ChunkReader(directory, table) as reader, pytest.raises(
            CorruptCheckpointError, match=r"weights-rank1\.safetensors holds 4 elements of 'w', fewer than the 7 its "
                                          r"chunk names\."):
        reader.read_into("weights", "w", torch.empty(12))


def test_flat_reader_refuses_a_file_that_is_not_safetensors(two_ranks) -> None:
    directory, table, _ = two_ranks
    (directory / "weights-rank1.safetensors").write_bytes(b"\xff" * 64)  # a header length far beyond the file
    with ChunkReader(directory, table) as reader, pytest.raises(
            CorruptCheckpointError, match=r"weights-rank1\.safetensors is not a readable safetensors file"):
        reader.read_into("weights", "w", torch.empty(12))


def test_chunk_reader_reads_any_block_of_fsdp_shards(tmp_path: Path) -> None:
    # Rows 0-1 on rank 0, row 2 on rank 1 (FSDP2's Shard(0)), and a step count every rank saved whole.
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": full[:2].clone(), "step": torch.tensor(7.0)}, tmp_path / "weights-rank0.safetensors")
    save_file({"w": full[2:].clone(), "step": torch.tensor(7.0)}, tmp_path / "weights-rank1.safetensors")
    step = {"shape": [], "offset": [], "size": [], "dtype": "float32"}
    table = {"format": "hf_dynamic_ckpt.dcp-chunks/1", "world_size": 2, "ranks": {
        str(r): {"weights": {"w": {"shape": [3, 4], "offset": [2 * r, 0], "size": [2 - r, 4], "dtype": "float32",
                                   "file": f"weights-rank{r}.safetensors"},
                             "step": {**step, "file": f"weights-rank{r}.safetensors"}}} for r in (0, 1)}}
    assert sharded_table({"world_size": 2, "extra": {"sharded": table}}) is table
    with ChunkReader(tmp_path, table) as reader:
        rows = torch.empty(2, 4)
        reader.read_into("weights", "w", rows, [1, 0])  # another world size's shard: rows 1-2, from both ranks
        assert torch.equal(rows, full[1:])
        columns = torch.empty(3, 2)
        reader.read_into("weights", "w", columns, [0, 1])  # a column block (Shard(1)): not one run of the files
        assert torch.equal(columns, full[:, 1:3])
        count = torch.tensor(0.0)
        reader.read_into("weights", "step", count)
        assert float(count) == 7.0

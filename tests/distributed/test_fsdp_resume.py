"""FSDP2 (`fully_shard`) with SmartCheckpointer on 2 CPU processes (gloo): sharded saves, kill, exact resume.

Every rank writes its own shards of L0 and L1 (`weights-rank<R>.safetensors`,
`optimizer-rank<R>.safetensors`); rank 0 commits them with the manifest, whose
`extra["sharded"]` records each tensor's global shape and each rank's chunk in JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_loss_log, torchrun_worker, traceback_tail
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "fsdp_loop.py"


def torchrun(tmp: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun_worker(WORKER, tmp, *args, nproc=nproc)


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    return read_loss_log(path, 'step')


def test_fsdp2_sharded_save_sigkill_resume_bit_exact(tmp_path: Path):
    # The disk format and its resume (the memory tier, off here, is tested in test_memory_tier_ddp.py: with it a
    # slot newer than the disk could be restored, or persisted by a writer process that outlived its rank).
    common = ["--max_steps", "8", "--base_interval", "3", "--memory_tier", "false"]
    # Every rank SIGKILLs itself after step 8 (the weights it reached written first): step 3 is committed,
    # step 6 too unless its background write was still running (then it must not be visible).
    crash = torchrun(tmp_path, 2, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "8",
                     "--final", "crashed.safetensors", *common)
    assert crash.returncode != 0 and ("Signal 9 (SIGKILL)" in crash.stderr or "exitcode  : -9" in crash.stderr), \
        traceback_tail(crash)
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed in ([3], [3, 6]), committed
    last = committed[-1]

    # On disk: each rank's shards, the chunk table in the JSON manifest, no pickle anywhere.
    step6 = store / f"step-{last}"
    names = {p.name for p in step6.iterdir()}
    assert names == {"manifest.json", "optimizer.json", "optimizer.tensors.zst", "sampler.json", "rng-rank0.json",
                     "rng-rank1.json", "weights-rank0.safetensors", "weights-rank1.safetensors",
                     "optimizer-rank0.safetensors", "optimizer-rank1.safetensors"}
    manifest = json.loads((step6 / "manifest.json").read_text())
    assert manifest["files"]["weights-rank1.safetensors"]["rank"] == 1
    assert manifest["files"]["optimizer-rank1.safetensors"]["tier"] == "optimizer"
    table = manifest["extra"]["sharded"]
    assert table["format"] == "hf_dynamic_ckpt.dcp-chunks/1" and table["world_size"] == 2
    r0, r1 = table["ranks"]["0"], table["ranks"]["1"]
    # 15 rows over 2 ranks: 8 + 7; the 1-row last layer: rank 1's chunk is empty.
    assert r0["weights"]["0.weight"] == {"shape": [15, 8], "offset": [0, 0], "size": [8, 8], "dtype": "float32",
                                         "file": "weights-rank0.safetensors"}
    assert r1["weights"]["0.weight"]["offset"] == [8, 0] and r1["weights"]["0.weight"]["size"] == [7, 8]
    assert r1["weights"]["5.weight"]["size"] == [0, 12]
    assert r1["optimizer"]["state.0.weight.exp_avg"] == {"shape": [15, 8], "offset": [8, 0], "size": [7, 8],
                                                         "dtype": "float32", "file": "optimizer-rank1.safetensors"}
    assert r1["optimizer"]["state.0.weight.step"]["shape"] == []
    w1 = load_file(step6 / "weights-rank1.safetensors")
    assert tuple(w1["0.weight"].shape) == (7, 8) and set(w1) == set(r1["weights"])
    opt1 = load_file(step6 / "optimizer-rank1.safetensors")
    assert set(opt1) == set(r1["optimizer"]) and torch.count_nonzero(opt1["state.0.weight.exp_avg_sq"]) > 0
    assert not [p for p in step6.iterdir() if p.suffix in {".pt", ".pth", ".bin", ".pkl", ".distcp"}]

    res = torchrun(tmp_path, 2, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                   "--final", "resumed.safetensors", *common)
    assert res.returncode == 0, traceback_tail(res)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, crashed = read_losses(tmp_path / "crash.jsonl")
    assert resumed_from == last and sorted(resumed) == list(range(last + 1, 9))
    for step, row in resumed.items():
        assert row["loss"] == crashed[step]["loss"], step  # float.hex: bit-equal
        assert row["grad_norm"] == crashed[step]["grad_norm"], step
    a, b = load_file(tmp_path / "crashed.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fsdp2_reshard_1_to_2_and_2_to_1_matches_native_dcp_resume(tmp_path: Path):
    """A checkpoint saved by 1 rank resumes on 2 and one saved by 2 resumes on 1 (DCP's load planner
    reshards the JSON-described chunks); the losses equal a run resumed natively by DCP (`dcp.save` /
    `dcp.load` with its default FileSystemWriter/Reader: the reference only) at that world size, which continues
    the scheduler's pace and a new rank's random streams as a smart resume does (rank 0's)."""

    def run(nproc: int, *args: str) -> None:
        proc = torchrun(tmp_path, nproc, *args)
        assert proc.returncode == 0, traceback_tail(proc)

    run(1, "--output_dir", "s", "--losses", "w1.jsonl", "--max_steps", "6", "--dcp_save_at", "6")
    table = json.loads((tmp_path / "s/smart_ckpt/default/step-6/manifest.json").read_text())["extra"]["sharded"]
    assert table["world_size"] == 1 and table["ranks"]["0"]["weights"]["0.weight"]["size"] == [15, 8]

    # 1 -> 2: the smart store's step 6 vs DCP's own dump of the same state.
    run(2, "--output_dir", "s", "--losses", "w2.jsonl", "--max_steps", "9", "--resume", "auto", "--dcp_save_at", "9")
    run(2, "--output_dir", "ref2", "--losses", "w2_ref.jsonl", "--max_steps", "9", "--dcp_resume", "dcp-6")
    got_from, got = read_losses(tmp_path / "w2.jsonl")
    ref_from, ref = read_losses(tmp_path / "w2_ref.jsonl")
    assert got_from == ref_from == 6 and sorted(got) == sorted(ref) == [7, 8, 9]
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in got]
    assert json.loads((tmp_path / "s/smart_ckpt/default/step-9/manifest.json").read_text())[
        "extra"]["sharded"]["world_size"] == 2

    # 2 -> 1: step 9, saved by the 2-rank run above, vs DCP's dump of that run at step 9.
    run(1, "--output_dir", "s", "--losses", "w1b.jsonl", "--max_steps", "12", "--resume", "auto")
    run(1, "--output_dir", "ref1", "--losses", "w1b_ref.jsonl", "--max_steps", "12", "--dcp_resume", "dcp-9")
    got_from, got = read_losses(tmp_path / "w1b.jsonl")
    ref_from, ref = read_losses(tmp_path / "w1b_ref.jsonl")
    assert got_from == ref_from == 9 and sorted(got) == sorted(ref) == [10, 11, 12]
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in got]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate's FSDP plugin needs CUDA (its CPU backend "
                                                           "ignores the plugin: no fully_shard on CPU)")
def test_accelerate_fsdp2_plugin_sigkill_resume_bit_exact(tmp_path: Path):
    """The same kill/resume through `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`:
    `prepare(model)` applies `fully_shard`; SmartCheckpointer sees DTensor parameters. Not run on CPU."""
    nproc = min(2, torch.cuda.device_count())
    common = ["--max_steps", "8", "--base_interval", "3", "--accelerate_fsdp"]
    crash = torchrun(tmp_path, nproc, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "8",
                     "--final", "crashed.safetensors", *common)
    assert crash.returncode != 0, traceback_tail(crash)
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed and committed[0] == 3
    manifest = json.loads((store / f"step-{committed[-1]}" / "manifest.json").read_text())
    assert manifest["extra"]["sharded"]["world_size"] == nproc
    res = torchrun(tmp_path, nproc, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                   "--final", "resumed.safetensors", *common)
    assert res.returncode == 0, traceback_tail(res)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, crashed = read_losses(tmp_path / "crash.jsonl")
    assert resumed_from == committed[-1]
    for step, row in resumed.items():
        assert row["loss"] == crashed[step]["loss"], step
    a, b = load_file(tmp_path / "crashed.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_and_unsharded_checkpoints_do_not_cross_and_nothing_is_abandoned(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "distributed" / "fsdp_mismatch_worker.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["into_plain"]["error"] == (
        "IncompatibleStateError: step 1 was saved sharded (FSDP2: one file of shards per rank) and this model is not "
        "sharded: resume it with the fully_shard-ed model through SmartCheckpointer or RunOrchestrator.attach + resume "
        "(Trainer's resume_checkpoint does not read sharded checkpoints yet).")
    assert out["into_sharded"]["error"] == (
        "IncompatibleStateError: step 1 was saved without sharding (one full copy by rank 0) and this model is "
        "sharded (fully_shard): resume it with the unsharded model it was saved from.")
    # Refused before the new timeline was recorded: step 2 is not set aside.
    assert out["into_plain"]["abandoned"] == out["into_sharded"]["abandoned"] == {"1": False, "2": False}

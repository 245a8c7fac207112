"""Elastic resume of custom Accelerate loops (`SmartCheckpointer`): the same command on another number of processes
continues the same run.

DDP (`tests/workers/accelerate_loop.py`: tiny LoRA Qwen2, dropout off, Accelerate's seedable sampler, 2 examples per
device, 32 examples) and FSDP2 (`tests/workers/fsdp_loop.py`: a `fully_shard`-ed MLP whose ranks all read the same
batches) are killed after a save and resumed by the same command on another number of processes: every resumed
step's loss within 1e-5 (relative) of an uninterrupted run on the number of processes that saved the checkpoint,
the DDP loop's final weights within 1e-5.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import run_worker
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
ACCELERATE = REPO / "tests" / "workers" / "accelerate_loop.py"
FSDP = REPO / "tests" / "workers" / "fsdp_loop.py"
DDP_ARGS = ("--max_steps", "10", "--examples", "32", "--base_interval", "3", "--dropout", "0",
            "--sampler", "seedable")
FSDP_ARGS = ("--max_steps", "12", "--base_interval", "2")


def run(worker: Path, tmp: Path, nproc: int, *args: str, killed: bool = False) -> subprocess.CompletedProcess[str]:
    return run_worker(worker, tmp, *args, nproc=nproc, killed=killed)


def last_committed(store: Path) -> int:
    steps = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert steps, f"nothing committed under {store}"
    return steps[-1]


def read(path: Path) -> tuple[dict, dict[int, float]]:
    """(the run's first line: where it resumed, its processes, ...; {step: loss})"""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], {d["step"]: float.fromhex(d["loss"]) for d in lines[1:] if "step" in d}


def assert_same_losses(resumed: dict[int, float], ref: dict[int, float], first: int, last: int) -> None:
    assert sorted(resumed) == list(range(first, last + 1))
    for step in resumed:
        assert abs(resumed[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, resumed[step], ref[step])


@pytest.mark.slow  # the default run's time: the Trainer (DDP) and DeepSpeed 2 -> 1 tests stay in it
def test_the_same_command_on_one_process_keeps_the_global_batch(tmp_path: Path) -> None:
    """2 processes x accumulation 2, killed after step 7, resumed by the same command on 1 process: accumulation 4,
    the same samples in every step, the scheduler at the pace of 2 processes."""
    two_to_one(tmp_path, load_state=False)


@pytest.mark.slow
def test_load_state_on_one_process_keeps_the_global_batch_too(tmp_path: Path) -> None:
    """The same, resumed with `accelerator.load_state(...)` of the folder `save_state` wrote at step 5, through the
    hooks."""
    two_to_one(tmp_path, load_state=True)


def two_to_one(tmp_path: Path, *, load_state: bool) -> None:
    common = (*DDP_ARGS, "--grad_accum", "2")
    run(ACCELERATE, tmp_path, 2, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.st", *common)
    saved_at = ("--save_state_at", "5") if load_state else ()
    run(ACCELERATE, tmp_path, 2, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *saved_at,
        *common, killed=True)
    store = tmp_path / "run" / "smart_ckpt" / "default"
    last = last_committed(store)
    sampler = json.loads((store / f"step-{last}" / "sampler.json").read_text())
    assert sampler["batch"] == {"per_device": 2, "world_size": 2, "accumulation": 2}
    assert sampler["dealt"] is True and sampler["draws_random"] is False

    if load_state:
        last = 5
    how = ("--load_state", str(tmp_path / "state-5")) if load_state else ("--resume", "auto")
    res = run(ACCELERATE, tmp_path, 1, "--output_dir", "run", "--losses", "res.jsonl", *how,
              "--final", "res.st", "--log_info", *common)
    head, resumed = read(tmp_path / "res.jsonl")
    assert head == {"resumed_from": last, "world_size": 1, "ga": 4}
    assert (f"smart_ckpt: step {last} was saved by 2 process(es) x 2 per device x 2 accumulation = 8 and is resumed "
            "by 1 process(es) x 2 per device x 4 accumulation = 8; gradient_accumulation_steps 2 -> 4: the same "
            "samples per optimizer step") in res.stderr
    assert "keeps the pace of the run it continues, 2 scheduler step(s) per optimizer step" in res.stderr
    assert "masks" not in res.stderr and "main random stream" not in res.stderr and "again" not in res.stderr
    _, ref = read(tmp_path / "ref.jsonl")
    assert_same_losses(resumed, ref, last + 1, 10)
    a, b = load_file(tmp_path / "ref.st"), load_file(tmp_path / "res.st")
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= 1e-5, k


@pytest.mark.slow
def test_one_process_to_two_with_a_dataloader_generator(tmp_path: Path) -> None:
    """1 process x accumulation 4 with `DataLoader(generator=...)`, resumed by the same command on 2 processes
    (accumulation 2): the generator's state at the epoch start orders the epoch alike."""
    common = (*DDP_ARGS[:-1], "generator", "--grad_accum", "4")
    run(ACCELERATE, tmp_path, 1, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.st", *common)
    run(ACCELERATE, tmp_path, 1, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *common,
        killed=True)
    last = last_committed(tmp_path / "run" / "smart_ckpt" / "default")
    res = run(ACCELERATE, tmp_path, 2, "--output_dir", "run", "--losses", "res.jsonl", "--resume", "auto",
              "--final", "res.st", *common)
    head, resumed = read(tmp_path / "res.jsonl")
    assert head == {"resumed_from": last, "world_size": 2, "ga": 2}
    assert "main random stream" not in res.stderr
    _, ref = read(tmp_path / "ref.jsonl")
    assert_same_losses(resumed, ref, last + 1, 10)
    a, b = load_file(tmp_path / "ref.st"), load_file(tmp_path / "res.st")
    assert all(float((a[k] - b[k]).abs().max()) <= 1e-5 for k in a)


@pytest.mark.slow
def test_a_shuffle_without_generator_and_dropout_are_said_to_differ(tmp_path: Path) -> None:
    """A plain `DataLoader(shuffle=True)` on 2 processes and dropout: resumed on 1, the order and the masks differ,
    and the resume says both."""
    common = ("--max_steps", "6", "--examples", "32", "--base_interval", "2", "--grad_accum", "2")
    run(ACCELERATE, tmp_path, 2, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "5", *common,
        killed=True)
    res = run(ACCELERATE, tmp_path, 1, "--output_dir", "run", "--losses", "res.jsonl", "--resume", "auto", *common)
    assert ("data position: saved by 2 process(es), resumed by 1, and the sampler draws the epoch's order from the "
            "main random stream") in res.stderr
    assert "its steps draw random numbers (dropout): each rank draws its own masks" in res.stderr
    assert read(tmp_path / "res.jsonl")[0]["ga"] == 4


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_fsdp2_training_continues_on_another_number_of_processes(tmp_path: Path, saved: int, resumed: int) -> None:
    """Weights and optimizer resharded by DCP, the data position and RNG of rank 0 for a rank the checkpoint had not,
    the scheduler at the saved run's pace: the losses of an uninterrupted run on `saved` processes."""
    run(FSDP, tmp_path, saved, "--output_dir", "ref", "--losses", "ref.jsonl", *FSDP_ARGS)
    run(FSDP, tmp_path, saved, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "5", *FSDP_ARGS,
        killed=True)
    last = last_committed(tmp_path / "run" / "smart_ckpt" / "default")
    res = run(FSDP, tmp_path, resumed, "--output_dir", "run", "--losses", "res.jsonl", "--resume", "auto",
              "--log_info", *FSDP_ARGS)
    head, got = read(tmp_path / "res.jsonl")
    assert head["resumed_from"] == last and head["world_size"] == resumed
    assert f"keeps the pace of the run it continues, {saved} scheduler step(s) per optimizer step" in res.stderr
    assert "masks" not in res.stderr  # every rank reads every batch: a new rank draws rank 0's masks
    _, ref = read(tmp_path / "ref.jsonl")
    assert_same_losses(got, ref, last + 1, 12)

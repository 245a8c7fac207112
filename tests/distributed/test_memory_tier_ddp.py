"""The memory tier on 2 DDP ranks (torchrun, gloo): one rank killed, the restart loses nothing.

Both ranks run `tests/integration/trainer_worker.py` with a slot every step and no disk save before the end
(`base_interval=100`): without the tier a crash would restart from scratch. Rank 1 SIGKILLs itself at the end of step
7, after every rank's writes finished (the newest slot, step 6 unless the writer was still busy, holds both ranks'
parts; step 7's is never taken: its logging never came); torchrun tears the job down.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, read_loss_log, torchrun_worker, traceback_tail, trainer_torchrun

from hf_dynamic_ckpt.cli import main as cli
from hf_dynamic_ckpt.store import CheckpointStore
from hf_dynamic_ckpt.store.slots import slots_dir

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

ARGS = ("--model", "full", "--max_steps", "9", "--ga", "1", "--examples", "48", "--base_interval", "100",
        "--memory_every", "1", "--wait_writer")


def _steps(root: Path) -> list[int]:
    with CheckpointStore(root, read_only=True) as store:
        return sorted(i.step for i in store.list(include_unhealthy=True))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("zero", [None, pytest.param(2, marks=SLOW), pytest.param(3, marks=SLOW)],
                         ids=["ddp", "zero2", "zero3"])
def test_one_rank_killed_resumes_both_ranks_from_the_slot_of_the_step_before(tmp_path: Path, zero: int | None) -> None:
    # Under DeepSpeed ZeRO every rank's part of a slot is its fragments of the master weights and moments.
    args = (*ARGS, *(("--deepspeed", str(zero)) if zero else ()))
    env = {"DS_ACCELERATOR": "cpu"} if zero else None
    ref = trainer_torchrun(tmp_path / "ref", "ref", *args, env=env, timeout=600)
    assert not slots_dir(tmp_path / "ref" / "run" / "smart_ckpt", "default").exists()  # a clean end removes them
    out = tmp_path / "crash"
    crash = trainer_torchrun(out, "crash", *args, "--kill_at", "7", expect_ok=False, env=env, timeout=600)
    assert all(c["killed"] for c in crash)
    root = out / "run" / "smart_ckpt"
    slots = CheckpointStore(slots_dir(root, "default"), read_only=True)
    newest = max(i.step for i in slots.list(include_unhealthy=True))
    slots.close()
    assert newest >= 5, newest
    slot = slots_dir(root, "default") / "default" / f"step-{newest}"
    assert sorted(p.name for p in slot.glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]
    if zero:  # each rank's fragments of the fp32 master weights and moments
        assert {"optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} <= {p.name for p in slot.iterdir()}
    # Where rank 0's writer process outlived its trainer it persisted the slot, and the restart would read that copy
    # from disk; removed here, the restart finds the slot newer than the disk store, as after a kill of every process.
    if newest in _steps(root):
        assert cli(["rm", str(root), f"step:{newest}"]) == 0
    assert _steps(root) == []
    resumed = trainer_torchrun(out, "resume", *args, "--resume", "auto", env=env, timeout=600)
    for r in range(2):
        assert resumed[r]["resumed_from"] == newest
        assert Path(resumed[r]["resumed_path"]) == slot  # read from host memory on both ranks
        assert resumed[r]["losses"] == ref[r]["losses"][newest:]  # bit-exact
    assert ref[0]["losses"] != ref[1]["losses"]  # the ranks saw different data
    assert newest in _steps(root)  # persisted by the restart
    assert not slots_dir(root, "default").exists()  # the resumed run's clean end removed the slots


def test_a_slot_write_failing_on_one_rank_turns_the_tier_off_on_every_rank_and_training_goes_on(tmp_path: Path) -> None:
    # Rank 1's part of the first slot finds /dev/shm full (the library's test hook): rank 1's tier goes off with
    # the WARNING, the next frame tells rank 0, and the ranks keep running the same collectives (the slot's `extra`
    # sums the flos across ranks): the job ends as the uninterrupted one does.
    ref = trainer_torchrun(tmp_path / "ref", "ref", *ARGS)
    fault = "write@rank=1@name=rng-rank1.json@nth=1:raise=ENOSPC"  # in rank 1's writer process: its first slot
    run = trainer_torchrun(tmp_path / "run", "run", *ARGS, env={"HF_DYNAMIC_CKPT_FAULT": fault})
    for r in range(2):
        assert run[r]["losses"] == ref[r]["losses"]
    stderr = run[0]["stderr"]
    assert stderr.count("memory tier off: writing a slot failed (memory slot of step ") == 1, stderr[-3000:]
    failed = int(stderr.split("memory tier off: writing a slot failed (memory slot of step ")[1].split()[0])
    assert "docker run --shm-size=" in stderr
    slots = CheckpointStore(slots_dir(tmp_path / "run" / "run" / "smart_ckpt", "default"), read_only=True) if \
        slots_dir(tmp_path / "run" / "run" / "smart_ckpt", "default").exists() else None
    assert slots is None or max((i.step for i in slots.list()), default=0) < failed  # none after the failure


@pytest.mark.slow  # the default run's time: the DDP kill above and FSDP2 from disk (test_fsdp_resume) stay in it
def test_fsdp2_killed_on_every_rank_resumes_each_ranks_shards_from_memory(tmp_path: Path) -> None:
    # A custom loop (SmartCheckpointer) over an FSDP2 model: a slot every step holds each rank's shards; every rank is
    # SIGKILLed right after step 7's `after_update` (its writer may finish that slot or not), and the restart reads
    # each rank's shards of the newest slot from host memory.
    worker = REPO / "tests" / "workers" / "fsdp_loop.py"
    common = ["--max_steps", "10", "--base_interval", "100", "--memory_every", "1", "--wait_writer"]
    crash = torchrun_worker(worker, tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7",
                            *common)
    assert crash.returncode != 0, traceback_tail(crash)
    root = tmp_path / "run" / "smart_ckpt"
    where = slots_dir(root, "default")
    with CheckpointStore(where, read_only=True) as slots:
        newest = max(i.step for i in slots.list(include_unhealthy=True))
    assert newest >= 5, newest
    names = {p.name for p in (where / "default" / f"step-{newest}").iterdir()}
    assert {"weights-rank0.safetensors", "weights-rank1.safetensors", "optimizer-rank1.safetensors"} <= names
    if newest in _steps(root):  # persisted by rank 0's writer process: removed, as if every process had been killed
        assert cli(["rm", str(root), f"step:{newest}"]) == 0
    ref = torchrun_worker(worker, tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", *common)
    assert ref.returncode == 0, traceback_tail(ref)
    res = torchrun_worker(worker, tmp_path, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                          *common)
    assert res.returncode == 0, traceback_tail(res)
    resumed_from, resumed = read_loss_log(tmp_path / "resume.jsonl")
    _, uninterrupted = read_loss_log(tmp_path / "ref.jsonl")
    first = json.loads((tmp_path / "resume.jsonl").read_text().splitlines()[0])
    assert resumed_from == newest and Path(first["resumed_path"]).parent.parent == where
    assert sorted(resumed) == list(range(newest + 1, 11))
    for step, row in resumed.items():
        assert row["loss"] == uninterrupted[step]["loss"], step  # float.hex: bit-equal
    assert newest in _steps(root)  # persisted by the restart

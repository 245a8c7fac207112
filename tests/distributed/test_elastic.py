"""Elastic resume under Trainer: the same command on another number of processes continues the same run.

A tiny Qwen2 (dropout off unless a test says otherwise) trains under `torchrun` with `use_cpu=True`, 4 examples
per device, 48 examples, 9 steps; saves every 3 steps; with --kill_at 7 the last rank SIGKILLs itself after
step 7 (steps 3 and 6 committed). The resume runs `resume_checkpoint(trainer, "auto")` on another number of
processes. Trainer's sampler draws its order independently of the world size, so with the global batch kept
every resumed step sees the samples of the uninterrupted run's step: losses and final weights agree up to float
reduction order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
ARGS = ("--model", "full", "--max_steps", "9", "--examples", "48", "--dropout", "0")


def torchrun(out: Path, tag: str, nproc: int, *args: str, rc: int | None = 0, info: bool = False) -> dict:
    """Run the worker on `nproc` processes; rank 0's result (with the job's stderr), or the stderr alone when no
    rank wrote one (a refused resume)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KILL_RANK": str(nproc - 1),
           "TOKENIZERS_PARALLELISM": "false", **({"TRANSFORMERS_VERBOSITY": "info"} if info else {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), "--out", str(out), "--tag", tag, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    if rc is not None:
        assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    path = out / f"{tag}-rank0.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result["stderr"] = proc.stderr
    return result


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def assert_same_run(resumed: dict, ref: dict, first: int, last: int, final: Path, ref_final: Path) -> None:
    """Steps `first..last` of the resumed run log the uninterrupted run's loss, gradient norm and learning rate
    within 1e-5 (relative), and every final weight within 1e-5."""
    for step in range(first, last + 1):
        got, want = resumed["log"][str(step)], ref["log"][str(step)]
        assert all(close(g, w) for g, w in zip(got, want)), (step, got, want)
    a, b = load_file(final), load_file(ref_final)
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= 1e-5, k


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An uninterrupted 2-process run (accumulation 2: 16 samples per step) and the same run killed after step 7."""
    base = tmp_path_factory.mktemp("elastic")
    ref = torchrun(base / "ref", "ref", 2, *ARGS, "--ga", "2", "--final", str(base / "ref.safetensors"))
    crash = torchrun(base / "crash", "crash", 2, *ARGS, "--ga", "2", "--kill_at", "7", rc=None)
    assert crash["killed"] and (base / "crash/run/smart_ckpt/default/step-6").is_dir()
    sampler = json.loads((base / "crash/run/smart_ckpt/default/step-6/sampler.json").read_text())
    assert sampler["batch"] == {"per_device": 4, "world_size": 2, "accumulation": 2}
    assert sampler["draws_random"] is False  # dropout off: no step drew a random number
    return base, ref


def resume_dir(base: Path, name: str) -> Path:
    out = base / name
    shutil.copytree(base / "crash", out)
    return out


def test_the_same_command_on_one_process_keeps_the_global_batch(two_ranks: tuple[Path, dict]) -> None:
    base, ref = two_ranks
    out = resume_dir(base, "one")
    resumed = torchrun(out, "res", 1, *ARGS, "--ga", "2", "--resume", "auto", "--final", str(out / "final.st"),
                       info=True)
    assert resumed["resumed_from"] == 6 and resumed["ga"] == 4 and resumed["global_step"] == 9
    assert ("smart_ckpt: step 6 was saved by 2 process(es) x 4 per device x 2 accumulation = 16 and is resumed by "
            "1 process(es) x 4 per device x 4 accumulation = 16; gradient_accumulation_steps 2 -> 4: the same "
            "samples per optimizer step") in resumed["stderr"]
    assert "masks" not in resumed["stderr"] and "differ" not in resumed["stderr"]
    assert_same_run(resumed, ref, 7, 9, out / "final.st", base / "ref.safetensors")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    listing = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", "ls", str(out / "run/smart_ckpt"), "--json"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert {c["step"]: c["world_size"] for c in json.loads(listing.stdout)} == {9: 1, 6: 2, 3: 2}


def test_a_batch_no_accumulation_keeps_is_refused_before_training(two_ranks: tuple[Path, dict]) -> None:
    base, _ = two_ranks
    out = resume_dir(base, "refused")
    before = sorted(p.name for p in (out / "run/smart_ckpt/default").iterdir())
    resumed = torchrun(out, "res", 1, *ARGS, "--ga", "2", "--per_device", "3", "--resume", "auto", rc=1)
    assert ("GlobalBatchError: step 6 was saved with a global batch of 2 process(es) x 4 per device x 2 "
            "accumulation = 16; with 1 process(es) x 3 per device no gradient accumulation gives 16 samples per "
            "step.") in resumed["stderr"]
    assert ("runtime.keep_global_batch=false. The model's weights were overwritten by this resume's reads (they "
            "hold the weights of step 6): build the model again before training it.") in resumed["stderr"]
    assert sorted(p.name for p in (out / "run/smart_ckpt/default").iterdir()) == before  # nothing saved or set aside


@pytest.mark.slow
def test_accepting_another_global_batch_keeps_the_schedule_in_steps(two_ranks: tuple[Path, dict]) -> None:
    base, ref = two_ranks
    out = resume_dir(base, "accept")
    resumed = torchrun(out, "res", 1, *ARGS, "--ga", "2", "--resume", "auto", "--accept_global_batch")
    assert resumed["resumed_from"] == 6 and resumed["ga"] == 2 and resumed["global_step"] == 9
    assert ("smart_ckpt: step 6 was saved with a global batch of 2 process(es) x 4 per device x 2 accumulation = 16 "
            "and is resumed with 1 process(es) x 4 per device x 2 accumulation = 8 (runtime.keep_global_batch=false)"
            ) in resumed["stderr"]
    # The learning-rate schedule continues at step 7 as the uninterrupted run's did; the data is another run's.
    assert [resumed["log"][str(s)][2] for s in (7, 8, 9)] == [ref["log"][str(s)][2] for s in (7, 8, 9)]
    assert not close(resumed["log"]["7"][0], ref["log"]["7"][0])
    # The data position stays in steps too: 6 steps of 8 samples are one epoch of 48, so step 7 starts the second.
    assert [round(resumed["log"][str(s)][3], 4) for s in (7, 8, 9)] == [1.1667, 1.3333, 1.5]
    assert "the data continues at sample 48 of its order (the interrupted run had read 96)" in resumed["stderr"]


@pytest.mark.slow
def test_one_process_to_two_and_four_to_two(tmp_path: Path) -> None:
    # 1 -> 2: one process with accumulation 4, resumed by the same command on two (accumulation 2).
    ref = torchrun(tmp_path / "ref1", "ref", 1, *ARGS, "--ga", "4", "--final", str(tmp_path / "ref1.st"))
    crash = torchrun(tmp_path / "up", "crash", 1, *ARGS, "--ga", "4", "--kill_at", "7", rc=None)
    assert crash["killed"]
    resumed = torchrun(tmp_path / "up", "res", 2, *ARGS, "--ga", "4", "--resume", "auto",
                       "--final", str(tmp_path / "up.st"))
    assert resumed["resumed_from"] == 6 and resumed["ga"] == 2
    assert_same_run(resumed, ref, 7, 9, tmp_path / "up.st", tmp_path / "ref1.st")
    # 4 -> 2: four processes of 2 examples each (8 per step), resumed on two with accumulation 2.
    small = (*ARGS, "--per_device", "2", "--ga", "1")
    ref = torchrun(tmp_path / "ref4", "ref", 4, *small, "--final", str(tmp_path / "ref4.st"))
    crash = torchrun(tmp_path / "down", "crash", 4, *small, "--kill_at", "7", rc=None)
    assert crash["killed"]
    resumed = torchrun(tmp_path / "down", "res", 2, *small, "--resume", "auto", "--final", str(tmp_path / "down.st"))
    assert resumed["resumed_from"] == 6 and resumed["ga"] == 2
    assert_same_run(resumed, ref, 7, 9, tmp_path / "down.st", tmp_path / "ref4.st")


@pytest.mark.slow
def test_dropout_makes_the_resume_say_that_masks_differ(tmp_path: Path) -> None:
    args = [a for a in ARGS if a not in ("--dropout", "0")]  # the worker's default dropout 0.1
    crash = torchrun(tmp_path / "c", "crash", 2, *args, "--ga", "2", "--kill_at", "7", rc=None)
    assert crash["killed"]
    assert json.loads((tmp_path / "c/run/smart_ckpt/default/step-6/sampler.json").read_text())["draws_random"]
    resumed = torchrun(tmp_path / "c", "res", 1, *args, "--ga", "2", "--resume", "auto")
    assert resumed["ga"] == 4
    assert ("smart_ckpt: step 6 was saved by 2 process(es), resumed by 1, and its steps draw random numbers "
            "(dropout): each rank draws its own masks") in resumed["stderr"]


@pytest.mark.slow
def test_a_rollback_after_an_elastic_resume_goes_back_and_stays_the_same_run(tmp_path: Path) -> None:
    """A 2-process run (96 examples: 6 steps per epoch, a save every 2 steps) is killed after step 5; resumed on one
    process, it meets a bad batch at step 5 (rank 0's first micro-batch: the same samples on any world size) and
    rolls back to step 4, a checkpoint saved by two processes; resumed on two, it does the same. The two continue
    alike to step 9."""
    common = (*ARGS[:-4], "--examples", "96", "--dropout", "0", "--on_anomaly", "rollback", "--poison", "5:grad@0",
              "--base_interval", "2")
    crash = torchrun(tmp_path / "crash", "crash", 2, *common, "--ga", "2", "--kill_at", "4", rc=None)
    assert crash["killed"]
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(tmp_path / "crash", one)
    shutil.copytree(tmp_path / "crash", two)
    a = torchrun(one, "res", 1, *common, "--ga", "4", "--resume", "auto", "--final", str(one / "f.st"))
    b = torchrun(two, "res", 2, *common, "--ga", "2", "--resume", "auto", "--final", str(two / "f.st"))
    assert a["resumed_from"] == b["resumed_from"] == 4
    assert [r[:2] for r in a["rollbacks"]] == [r[:2] for r in b["rollbacks"]] == [[5, 4]]
    assert a["global_step"] == b["global_step"] == 9
    assert_same_run(a, b, 5, 9, one / "f.st", two / "f.st")

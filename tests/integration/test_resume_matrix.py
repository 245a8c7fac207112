"""The exactness promise over the settings users run by default.

A resumed run is the uninterrupted run, bit for bit: the same batches, the same losses, the same final weights.
Checked with the settings users run without thinking about them: evaluation during training (every N steps, and
at the start), data-loader workers (persistent or not), a save at an epoch end and one right after, gradient
accumulation, LoRA and full fine-tunes, iterable datasets without a length, 2 ranks, a second run in the same
process, a clean exit followed by a restart, and a SIGKILL followed by the same command. With evaluation, the
resume points lie before and after the first evaluation. Trainer (`tests/workers/trainer_epochs.py`), the
Accelerate state hooks and `SmartCheckpointer` (`tests/workers/accelerate_epochs.py`). The default run keeps a
representative slice; `make test-all` runs all.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, torchrun_worker, traceback_tail

pytestmark = pytest.mark.integration

WORKERS = REPO / "tests" / "workers"
sys.path.insert(0, str(WORKERS))
import accelerate_epochs  # noqa: E402
import trainer_epochs  # noqa: E402

# ---------------------------------------------------------------------------------------------------- Trainer
# (model, gradient accumulation, data-loader workers, persistent workers, evaluation: off / every 5 steps / also at
# the start). The default run keeps the case users run most: LoRA, persistent workers, evaluation every N steps.
TRAINER_DEFAULT = ("lora", 2, 2, True, "steps")
TRAINER_CASES = [
    pytest.param(*case, id="-".join(map(str, case)), marks=() if case == TRAINER_DEFAULT else pytest.mark.slow)
    for case in itertools.product(("lora", "full"), (1, 2), (0, 2), (True, False), ("off", "steps", "start"))
    if not (case[2] == 0 and not case[3])  # workers=0: persistent or not is the same loader
]
BEFORE_FIRST_EVAL = 4  # a resume point before the first evaluation (step 5); 8, 12 and 16 come after it


def _run_trainer(out: Path, model: str, ga: int, workers: int, persistent: bool, *extra: str,
                 nproc: int = 1, evaluate: str = "off") -> list[dict[str, Any]]:
    args = ["--out", str(out), "--model", model, "--ga", str(ga), "--workers", str(workers), "--eval", evaluate,
            *extra]
    if persistent:
        args.append("--persistent")
    worker = WORKERS / "trainer_epochs.py"
    if nproc == 1:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([sys.executable, str(worker), *args], capture_output=True, text=True, timeout=900,
                              env=env)
    else:
        proc = torchrun_worker(worker, out, *args, nproc=nproc, timeout=900)
    assert proc.returncode == 0, traceback_tail(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _assert_trainer_exact(result: dict[str, Any], ga: int) -> None:
    reference = result["reference"]
    micro = reference["micro"]
    assert len(micro) == trainer_epochs.EPOCHS * trainer_epochs.STEPS_PER_EPOCH * ga
    for point, resumed in result["resumed"].items():
        step = int(point)
        assert resumed["resumed_from"] == step
        assert resumed["micro"] == micro[step * ga:], f"resumed from step {step}: losses or batches differ"
        assert resumed["weights"] == reference["weights"], f"resumed from step {step}: final weights differ"
    if "clean_exit" in result:
        first, again = result["clean_exit"]["first"], result["clean_exit"]["again"]
        assert first["global_step"] == trainer_epochs.STEPS_PER_EPOCH and again["resumed_from"] == first["global_step"]
        assert first["micro"] + again["micro"] == micro
        assert again["weights"] == reference["weights"]


@pytest.mark.parametrize("model,ga,workers,persistent,evaluate", TRAINER_CASES)
def test_trainer_resumes_exactly(tmp_path: Path, model: str, ga: int, workers: int, persistent: bool,
                                 evaluate: str) -> None:
    """Resumed mid-epoch, at the epoch boundary and in the next epoch (with evaluation, also before the first one),
    each in the same process as the run it continues; then a run that stops cleanly after the first epoch and the
    same command again."""
    points = [BEFORE_FIRST_EVAL, *trainer_epochs.RESUME_POINTS] if evaluate == "steps" else trainer_epochs.RESUME_POINTS
    [result] = _run_trainer(tmp_path, model, ga, workers, persistent, "--clean_exit", "--points",
                            ",".join(map(str, points)), evaluate=evaluate)
    assert sorted(map(int, result["resumed"])) == sorted(points)
    _assert_trainer_exact(result, ga)


@pytest.mark.parametrize("model,ga,workers,persistent,evaluate", [
    pytest.param(*TRAINER_DEFAULT, id="-".join(map(str, TRAINER_DEFAULT))),
    pytest.param("full", 1, 0, False, "off", id="full-1-0-off", marks=pytest.mark.slow)])
def test_trainer_resumes_exactly_on_an_iterable_dataset(tmp_path: Path, model: str, ga: int, workers: int,
                                                        persistent: bool, evaluate: str) -> None:
    """The same data as an iterable dataset without a length: Trainer counts its epochs as the data runs out, not
    from the step, so the data position is the epoch and the windows into it (the clean exit after the first epoch
    saves at that step's end: the resumed epoch runs out at once and the next one starts from the saved RNG)."""
    points = [BEFORE_FIRST_EVAL, *trainer_epochs.RESUME_POINTS] if evaluate == "steps" else trainer_epochs.RESUME_POINTS
    [result] = _run_trainer(tmp_path, model, ga, workers, persistent, "--iterable", "--clean_exit", "--points",
                            ",".join(map(str, points)), evaluate=evaluate)
    assert sorted(map(int, result["resumed"])) == sorted(points)
    _assert_trainer_exact(result, ga)


@pytest.mark.parametrize("model,ga,workers,persistent,evaluate", [
    pytest.param(*TRAINER_DEFAULT, id="-".join(map(str, TRAINER_DEFAULT))),
    pytest.param("full", 1, 0, False, "off", id="full-1-0-off", marks=pytest.mark.slow)])
def test_trainer_resumes_exactly_when_the_sampler_draws_from_the_global_generator(
        tmp_path: Path, model: str, ga: int, workers: int, persistent: bool, evaluate: str) -> None:
    """`train_sampling_strategy="group_by_length"`: Trainer's `LengthGroupedSampler` draws each epoch's order from the
    global torch generator when the epoch's iterator is created, after the steps before it have drawn from it. A
    resume at the epoch boundary or inside the second epoch reads that epoch in the order the uninterrupted run did."""
    points = [BEFORE_FIRST_EVAL, *trainer_epochs.RESUME_POINTS] if evaluate == "steps" else trainer_epochs.RESUME_POINTS
    [result] = _run_trainer(tmp_path, model, ga, workers, persistent, "--sampling", "group_by_length",
                            "--clean_exit", "--points", ",".join(map(str, points)), evaluate=evaluate)
    assert sorted(map(int, result["resumed"])) == sorted(points)
    _assert_trainer_exact(result, ga)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("data", ["map-style", "iterable", "group_by_length"])
def test_trainer_resumes_exactly_on_two_ranks_with_persistent_workers(tmp_path: Path, data: str) -> None:
    extra = {"map-style": [], "iterable": ["--iterable"], "group_by_length": ["--sampling", "group_by_length"]}[data]
    results = _run_trainer(tmp_path, "lora", 1, 2, True, "--points", "8,12,16", *extra, nproc=2, evaluate="steps")
    for result in results:
        _assert_trainer_exact(result, 1)


def _run_trainer_worker(tmp_path: Path, tag: str, *args: str) -> dict[str, Any]:
    """`tests/integration/trainer_worker.py` once, its rank 0's result. Output to a file, not a pipe: a killed run's
    orphaned data-loader workers would hold a pipe open."""
    worker = REPO / "tests" / "integration" / "trainer_worker.py"
    with open(tmp_path / f"{tag}.log", "w") as log:
        subprocess.run([sys.executable, str(worker), "--out", str(tmp_path / tag), "--tag", tag, *args],
                       stdout=log, stderr=subprocess.STDOUT, timeout=600, cwd=tmp_path)
    result = tmp_path / tag / f"{tag}-rank0.json"
    assert result.exists(), (tmp_path / f"{tag}.log").read_text()[-4000:]
    return json.loads(result.read_text())


@pytest.mark.slow  # the default run has this promise through a client script: tests/integration/test_trl_sft.py
def test_sigkill_after_an_evaluation_with_persistent_workers_then_the_same_command(tmp_path: Path) -> None:
    """A run that evaluates every 5 steps, killed a few steps into its second epoch (after two evaluations),
    restarted at once with `resume_checkpoint(trainer, "auto")`: it resumes from the memory tier's slot of the step
    before the one the kill came after (the disk's newest is the save at the epoch boundary, step 12), and every step
    after it,
    and every evaluation, is the uninterrupted run's."""
    common = ["--model", "lora", "--max_steps", "24", "--ga", "1", "--examples", "48", "--base_interval", "4",
              "--workers", "2", "--eval_steps", "5", "--memory_every", "1"]  # a slot every step, as at a real pace

    def run(tag: str, *args: str) -> dict[str, Any]:
        return _run_trainer_worker(tmp_path, tag, *common, *args)

    reference = run("reference")
    killed = run("run", "--kill_at", "15")
    assert killed["killed"]
    resumed = run("run", "--resume", "auto")
    assert resumed["resumed_from"] == 14  # the memory tier's slot of step 14 (the disk's newest: 12)
    assert resumed["losses"] == reference["losses"][14:]
    assert resumed["evals"] == reference["evals"] and set(reference["evals"]) == {"5", "10", "15", "20", "24"}
    assert resumed["trainable"] == reference["trainable"]


MEMORY_CASES = [  # (model, data-loader workers, evaluate every N steps or never, seed of the kill step)
    pytest.param(*case, id="-".join(map(str, case)), marks=pytest.mark.slow)
    for case in itertools.product(("lora", "full"), (0, 2), (None, 5), (1,))
]


@pytest.mark.parametrize("model,workers,eval_steps,seed", MEMORY_CASES)
def test_sigkill_at_a_seeded_step_resumes_from_the_memory_tier(tmp_path: Path, model: str, workers: int,
                                                                eval_steps: int | None, seed: int) -> None:
    """The memory-tier axis: a SIGKILL after a step drawn from `seed` (disk saves every 4 steps), the same command
    again: resumed from the slot of the step before (the killed step's own slot is taken after its end; a disk save of
    it, every 4th step, may be written already), and every later loss and evaluation is the uninterrupted run's."""
    import random

    kill = random.Random(f"{model}{workers}{eval_steps}{seed}").randint(6, 22)
    common = ["--model", model, "--max_steps", "24", "--ga", "1", "--examples", "48", "--base_interval", "4",
              "--workers", str(workers), "--memory_every", "1",
              *(["--eval_steps", str(eval_steps)] if eval_steps else [])]

    def run(tag: str, *args: str) -> dict[str, Any]:
        return _run_trainer_worker(tmp_path, tag, *common, *args)

    reference = run("reference")
    assert run("run", "--kill_at", str(kill))["killed"]
    resumed = run("run", "--resume", "auto")
    start = resumed["resumed_from"]  # the killed step's own state only where a disk save of it was already handed on
    assert start == kill - 1 or (start == kill and kill % 4 == 0), (kill, start)
    assert resumed["losses"] == reference["losses"][start:]
    assert resumed["evals"] == reference["evals"]
    assert resumed["trainable"] == reference["trainable"]


def test_sigkill_keeps_the_best_model_and_the_early_stop_step(tmp_path: Path) -> None:
    """`load_best_model_at_end` on the eval loss with `EarlyStoppingCallback(patience=2)`, killed after the third
    evaluation (its patience counter at 1) and restarted: the resumed run stops at the same step, with the same best
    checkpoint and the same final (best) weights. Trainer's own resume resets the counter
    (`restore_callback_states_from_checkpoint=False`) and would stop two evaluations later."""
    worker = REPO / "tests" / "integration" / "trainer_worker.py"
    common = ["--model", "lora", "--max_steps", "40", "--ga", "1", "--examples", "48", "--base_interval", "3",
              "--workers", "2", "--eval_steps", "2", "--best", "--early_stopping", "2"]

    def run(tag: str, *args: str) -> dict[str, Any]:
        with open(tmp_path / f"{tag}.log", "w") as log:
            subprocess.run([sys.executable, str(worker), "--out", str(tmp_path / tag), "--tag", tag, *common, *args],
                           stdout=log, stderr=subprocess.STDOUT, timeout=600, cwd=tmp_path)
        result = tmp_path / tag / f"{tag}-rank0.json"
        assert result.exists(), (tmp_path / f"{tag}.log").read_text()[-4000:]
        return json.loads(result.read_text())

    reference = run("reference")
    assert reference["global_step"] < 40, "the reference did not stop early: the test checks nothing"
    assert run("run", "--kill_at", "7")["killed"]
    resumed = run("run", "--resume", "auto")
    assert resumed["resumed_from"] == 6  # the disk's save of step 6 (the memory tier's newest slot: step 5)
    assert resumed["global_step"] == reference["global_step"]
    assert resumed["best"] == reference["best"]
    assert resumed["evals"] == reference["evals"]
    assert resumed["trainable"] == reference["trainable"]
    assert resumed["losses"] == reference["losses"][6:]


# ---------------------------------------------------------------------------------------------------- Accelerate
# (mode, data, data-loader workers, persistent workers, evaluation on a prepared eval loader). An iterable
# dataset's persistent workers keep the copy of the dataset they started with (its `set_epoch` never reaches them):
# such a run's order is not one a resume can reproduce, so iterable data runs with non-persistent workers.
ACCELERATE_DEFAULT = {("hooks", "map", 2, True, True), ("checkpointer", "iterable", 2, False, True)}
ACCELERATE_CASES = [
    pytest.param(*case, id="-".join(map(str, case)), marks=() if case in ACCELERATE_DEFAULT else pytest.mark.slow)
    for case in itertools.product(("hooks", "checkpointer"), ("map", "iterable"), (0, 2), (True, False),
                                  (False, True))
    if not (case[2] == 0 and not case[3]) and not (case[1] == "iterable" and case[2] and case[3])
]


def _assert_accelerate_exact(result: dict[str, Any]) -> None:
    reference = result["reference"]["steps"]
    assert len(reference) == accelerate_epochs.EPOCHS * accelerate_epochs.BATCHES
    assert set(result["saves"]) >= {"mid", "last-step", "after-loop"}
    for name, resumed in result["resumed"].items():
        step = result["saves"][name]
        # The loop `for epoch in range(source.epoch, EPOCHS)` starts where the uninterrupted run went on.
        expected_epoch = reference[step][0] if step < len(reference) else accelerate_epochs.EPOCHS
        assert resumed["start_epoch"] == expected_epoch, f"{name}: resumed into the wrong epoch"
        assert resumed["steps"] == reference[step:], f"{name} (step {step}): batches or losses differ"


@pytest.mark.parametrize("mode,data,workers,persistent,evaluate", ACCELERATE_CASES)
def test_accelerate_resumes_exactly(tmp_path: Path, mode: str, data: str, workers: int, persistent: bool,
                                    evaluate: bool) -> None:
    """`save_state` mid-epoch, right after an epoch's last step and after an epoch's loop ended (and, with
    `SmartCheckpointer`, the policy's saves at epoch ends); each resumed by a fresh model in this process. With
    evaluation the mid-epoch save comes before the first one, the others after it."""
    _assert_accelerate_exact(accelerate_epochs.run_case(mode, data, workers, tmp_path, persistent=persistent,
                                                        evaluate=evaluate))


@pytest.mark.distributed
@pytest.mark.parametrize("mode,data,workers,persistent", [
    pytest.param("checkpointer", "iterable", 0, False, id="checkpointer-iterable"),
    pytest.param("hooks", "map", 2, True, id="hooks-map-persistent-workers-evaluating", marks=pytest.mark.slow),
])
def test_accelerate_resumes_exactly_on_two_ranks(tmp_path: Path, mode: str, data: str, workers: int,
                                                 persistent: bool) -> None:
    args = ["--out", str(tmp_path), "--mode", mode, "--data", data, "--workers", str(workers)]
    proc = torchrun_worker(WORKERS / "accelerate_epochs.py", tmp_path, *args,
                           *([] if persistent else ["--not_persistent"]), *(["--evaluate"] if persistent else []),
                           timeout=900)
    assert proc.returncode == 0, traceback_tail(proc)
    for rank in (0, 1):
        _assert_accelerate_exact(json.loads((tmp_path / f"rank{rank}.json").read_text()))

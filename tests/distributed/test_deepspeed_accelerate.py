"""`SmartCheckpointer` in a custom Accelerate loop under DeepSpeed ZeRO (2 processes, gloo, `DS_ACCELERATOR=cpu`).

`tests/workers/accelerate_loop.py --deepspeed STAGE` (tiny LoRA Qwen2, a `DeepSpeedPlugin`, the user's torch AdamW
and LinearLR): the engine steps the optimizer inside `accelerator.backward`; every rank saves its fragments of the
partitioned state. Killed after step 7 and started again with `resume("auto")`, the run continues with the
uninterrupted run's losses and final adapter bit for bit; on one process it keeps the global batch. A gradient
surge is captured before the engine applies it (the policy decides inside the engine's step).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_loss_log, run_worker
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"
COMMON = ("--max_steps", "10", "--examples", "16", "--base_interval", "3")


def run(tmp: Path, *args: str, nproc: int = 2, killed: bool = False) -> subprocess.CompletedProcess[str]:
    return run_worker(WORKER, tmp, *args, nproc=nproc, killed=killed, env={"DS_ACCELERATOR": "cpu"})


def committed(store: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)


def kill_and_resume(tmp: Path, stage: int, *extra: str) -> None:
    args = (*COMMON, "--deepspeed", str(stage), *extra)
    run(tmp, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *args)
    run(tmp, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *args, killed=True)
    store = tmp / "run" / "smart_ckpt" / "default"
    steps = committed(store)
    assert steps and max(steps) < 7
    # Every rank's fragments, no pickle, no DeepSpeed checkpoint folder.
    files = {p.name for p in (store / f"step-{max(steps)}").iterdir()}
    assert {"optimizer-rank0.safetensors", "optimizer-rank1.safetensors", "rng-rank0.json", "rng-rank1.json"} <= files
    assert not [p for p in (tmp / "run").rglob("*") if p.suffix in (".pt", ".bin", ".pkl")]
    assert not list((tmp / "run").rglob("global_step*"))

    resumed = run(tmp, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                  "--final", "resumed.safetensors", *args)
    resumed_from, after = read_loss_log(tmp / "resume.jsonl")
    _, expected = read_loss_log(tmp / "ref.jsonl")
    assert resumed_from == max(steps), resumed.stderr[-3000:]
    assert sorted(after) == list(range(resumed_from + 1, 11))
    for step, row in after.items():  # the all-reduced step loss and rank 0's micro-batch losses
        assert row["loss"] == expected[step]["loss"] and row["micro"] == expected[step]["micro"], step
    a, b = load_file(tmp / "ref.safetensors"), load_file(tmp / "resumed.safetensors")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zero2_lora_loop_killed_resumes_bit_exactly(tmp_path: Path) -> None:
    kill_and_resume(tmp_path, 2)


@pytest.mark.slow
def test_zero3_lora_loop_killed_resumes_bit_exactly(tmp_path: Path) -> None:
    kill_and_resume(tmp_path, 3)


SURGE = ("--max_steps", "10", "--examples", "40", "--base_interval", "100", "--dropout", "0")


def test_a_capture_under_zero_is_the_state_before_the_bad_update(tmp_path: Path) -> None:
    # Step 8's loss is multiplied by 1e4. The engine updates inside accelerator.backward; the policy decides inside
    # the engine's step, before the first partition is updated, so the capture filed under step 7 is step 7's state:
    # resumed without the surge, it continues exactly as a run that never had one.
    surged = run(tmp_path, "--output_dir", "surge", "--losses", "surge.jsonl", "--surge_at_step", "8",
                 "--deepspeed", "2", *SURGE)
    _, rows = read_loss_log(tmp_path / "surge.jsonl")
    assert [c[:1] + c[2:] for c in rows[8]["captures"]] == [[7, True]], rows[8]  # step 7, pinned
    assert "cannot be captured" not in surged.stderr
    store = tmp_path / "surge" / "smart_ckpt" / "default"
    assert committed(store) == [7]
    run(tmp_path, "--output_dir", "clean", "--losses", "clean.jsonl", "--deepspeed", "2", *SURGE)
    run(tmp_path, "--output_dir", "surge", "--losses", "resume.jsonl", "--resume", "step:7", "--deepspeed", "2",
        *SURGE)
    resumed_from, after = read_loss_log(tmp_path / "resume.jsonl")
    _, clean = read_loss_log(tmp_path / "clean.jsonl")
    assert resumed_from == 7 and sorted(after) == [8, 9, 10]
    for step, row in after.items():
        assert row["loss"] == clean[step]["loss"] and row["micro"] == clean[step]["micro"], step


@pytest.mark.slow
def test_a_first_step_surge_under_zero_is_captured_as_the_state_before_any_update(tmp_path: Path) -> None:
    # The first update's gradient is 1e4 x: the first-step rule (against the engine's clipping threshold) captures
    # step 0, saved before the optimizer made any state; resumed, the optimizer starts fresh, as it did then.
    args = ("--max_steps", "6", "--examples", "40", "--base_interval", "100", "--dropout", "0", "--deepspeed", "2")
    run(tmp_path, "--output_dir", "surge", "--losses", "surge.jsonl", "--surge_at_step", "1", *args)
    _, rows = read_loss_log(tmp_path / "surge.jsonl")
    assert [c[0] for c in rows[1]["captures"]] == [0] and "first_step" in rows[1]["captures"][0][1]
    run(tmp_path, "--output_dir", "clean", "--losses", "clean.jsonl", *args)
    run(tmp_path, "--output_dir", "surge", "--losses", "resume.jsonl", "--resume", "step:0", *args)
    resumed_from, after = read_loss_log(tmp_path / "resume.jsonl")
    _, clean = read_loss_log(tmp_path / "clean.jsonl")
    assert resumed_from == 0 and sorted(after) == list(range(1, 7))
    for step, row in after.items():
        assert row["loss"] == clean[step]["loss"] and row["micro"] == clean[step]["micro"], step


@pytest.mark.slow
def test_with_two_partitions_the_capture_is_not_taken_and_says_why(tmp_path: Path) -> None:
    # Two optimizer groups: two flat partitions, whose per-layer norms are whole only after the first is updated.
    # No capture (it would hold step 8's update), one line, and the run goes on.
    surged = run(tmp_path, "--output_dir", "surge", "--losses", "surge.jsonl", "--surge_at_step", "8",
                 "--deepspeed", "2", "--two_groups", *SURGE)
    assert surged.stderr.count("the DeepSpeed engine applied the update before the step's signals were read here: "
                               "the state before it cannot be captured") == 1
    _, rows = read_loss_log(tmp_path / "surge.jsonl")
    assert sorted(rows) == list(range(1, 11)) and all(not r["captures"] for r in rows.values())
    assert committed(tmp_path / "surge" / "smart_ckpt" / "default") == []


@pytest.mark.slow
def test_rollback_under_zero_returns_to_the_capture_and_goes_on_exactly(tmp_path: Path) -> None:
    # The 8th batch of epoch 0 explodes the gradients: the run goes back to the capture of step 7 and skips that
    # batch, bit-equal to a resume of step 7 without it.
    args = ("--max_steps", "10", "--examples", "40", "--base_interval", "3", "--dropout", "0", "--deepspeed", "2")
    rolled = run(tmp_path, "--output_dir", "rb", "--losses", "rb.jsonl", "--on_anomaly", "rollback",
                 "--poison_batch", "8", *args)
    assert "rolled back from step 8 to step 7" in rolled.stderr and "skipped batches 8..8 of epoch 0" in rolled.stderr
    assert (tmp_path / "rb.jsonl").read_text().count('"rollback"') == 1
    store = tmp_path / "rb" / "smart_ckpt" / "default"
    ref = run(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--skip_batches", "8:8",
              "--resume", str(store / "step-7"), *args)
    _, after = read_loss_log(tmp_path / "rb.jsonl")
    resumed_from, expected = read_loss_log(tmp_path / "ref.jsonl")
    assert resumed_from == 7, ref.stderr[-3000:]
    for step in range(8, 11):  # the records after the rollback (a step's last record)
        assert after[step]["loss"] == expected[step]["loss"], step


@pytest.mark.slow
def test_zero2_loop_killed_on_two_processes_continues_on_one_with_the_same_global_batch(tmp_path: Path) -> None:
    # The engine's own accumulation follows the accelerator's (it scales the loss and reduces by it).
    args = ("--max_steps", "10", "--examples", "32", "--base_interval", "3", "--dropout", "0", "--sampler",
            "seedable", "--deepspeed", "2")
    run(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *args)
    run(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *args, killed=True)
    resumed = run(tmp_path, "--output_dir", "run", "--losses", "one.jsonl", "--resume", "auto", "--final",
                  "one.safetensors", "--log_info", *args, nproc=1)
    assert "gradient_accumulation_steps 1 -> 2" in resumed.stderr
    resumed_from, after = read_loss_log(tmp_path / "one.jsonl")
    _, expected = read_loss_log(tmp_path / "ref.jsonl")
    assert resumed_from is not None and sorted(after) == list(range(resumed_from + 1, 11))
    for step, row in after.items():
        ours, theirs = float.fromhex(row["loss"]), float.fromhex(expected[step]["loss"])
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, ours, theirs)
    a, b = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "one.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)

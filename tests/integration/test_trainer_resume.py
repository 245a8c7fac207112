"""Trainer + SmartCkptCallback: a SIGKILLed run resumed with `auto` continues bit-exactly.

Each case runs `trainer_worker.py` three times in subprocesses: an uninterrupted reference,
a run that SIGKILLs itself after step `kill_at` (once its last save has committed), and a
restart with `--resume auto`. Every training micro-batch loss is compared as a hex float.
40 examples / batch 4 = 10 micro-batches per epoch; with GA=2 that is 5 steps per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("trainer_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run_worker(out: Path, tag: str, *args: str, expect_rc: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), "--tag", tag, *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((out / f"{tag}-rank0.json").read_text())
    result["stderr"] = proc.stderr
    return result


def crash_and_resume(tmp_path: Path, *args: str, kill_at: int, ga: int = 2,
                     before_resume: Callable[[], None] = lambda: None) -> tuple[dict, dict, dict]:
    ref = run_worker(tmp_path / "ref", "ref", *args)
    crash = run_worker(tmp_path / "crash", "crash", *args, "--kill_at", str(kill_at), expect_rc=-signal.SIGKILL)
    before_resume()
    resumed = run_worker(tmp_path / "crash", "resume", *args, "--resume", "auto")
    return ref, crash, resumed


def assert_exact(ref: dict, crash: dict, resumed: dict, *, expect_step: int, ga: int) -> None:
    assert crash["killed"]
    n = len(crash["losses"])
    assert crash["losses"] == ref["losses"][:n]
    assert resumed["resumed_from"] == expect_step
    # The resumed run recomputes every step after the restore point, bit for bit.
    assert resumed["losses"] == ref["losses"][expect_step * ga:]
    assert len(resumed["losses"]) == len(ref["losses"]) - expect_step * ga > 0


def test_full_finetune_mid_epoch_ga2_dropout_tied_embeddings(tmp_path: Path) -> None:
    # saves at 3 and 6 (interval 3); killed at 7 -> resume at 6, mid-epoch 2 (steps 6..10).
    # Tied input/output embeddings: the store keeps the shared tensor once (aliased).
    # Another task of the store whose name starts like this one's keeps its resume folder (`default-step-3` is a
    # task id; this run's folders are `default-step-<N>`).
    other = tmp_path / "crash" / "run" / "smart_ckpt" / ".resume" / "default-step-3-step-2"
    ref, crash, resumed = crash_and_resume(tmp_path, "--model", "full", "--max_steps", "9", "--ga", "2", "--tie",
                                           kill_at=7, before_resume=lambda: (other.mkdir(parents=True),
                                                                             (other / "trainer_state.json").touch()))
    assert_exact(ref, crash, resumed, expect_step=6, ga=2)
    assert sorted(p.name for p in other.parent.iterdir()) == [other.name] and (other / "trainer_state.json").is_file()
    # Only the restore-point step and later saves come from the resumed run.
    assert [e["step"] for e in crash["events"]] == [3, 6]
    assert all(e["bytes"] and e["bytes"] > 0 for e in crash["events"])


@pytest.mark.slow  # test_resume_matrix.py resumes LoRA with GA 2 at an epoch boundary (workers on) in the default run
def test_lora_across_epoch_boundary_ga2(tmp_path: Path) -> None:
    # saves at 5 (the last step of epoch 1), killed at 6 -> resume at the epoch boundary.
    ref, crash, resumed = crash_and_resume(tmp_path, "--model", "lora", "--max_steps", "8", "--ga", "2",
                                           "--base_interval", "5", kill_at=6)
    assert_exact(ref, crash, resumed, expect_step=5, ga=2)
    ckpt = tmp_path / "crash" / "run" / "smart_ckpt" / "default" / "step-5"
    from safetensors import safe_open

    with safe_open(str(ckpt / "weights.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys), "LoRA checkpoints hold the adapter only"


@pytest.mark.slow  # the conformance suite resumes a plain module against Trainer's own checkpoints in the default run
def test_plain_module_next_to_trainers_own_saves(tmp_path: Path) -> None:
    # Trainer keeps saving checkpoint-2, -4, -6 itself; the two kinds of checkpoint do not interfere.
    args = ("--model", "plain", "--max_steps", "6", "--ga", "1", "--examples", "24", "--native_save_steps", "2")
    ref, crash, resumed = crash_and_resume(tmp_path, *args, kill_at=4)
    assert_exact(ref, crash, resumed, expect_step=3, ga=1)
    run = tmp_path / "crash" / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (run / "smart_ckpt" / ".resume").exists()  # the resume folder is gone after the first step
    # Probes and handlers are removed at train end; metrics reached the Trainer's logs.
    assert resumed["forward_hooks"] == 3  # the worker's own: spike, poisoned, the loss recorder
    assert resumed["sigterm_handler_restored"] is True
    assert {"smart_ckpt/saves", "smart_ckpt/last_save_step", "smart_ckpt/stall_ms", "smart_ckpt/risk"} <= set(
        resumed["log_keys"])


@pytest.mark.slow  # test_early_capture.py and test_demo_spike.py resume from pinned captures in the default run
def test_resume_from_a_pre_update_capture(tmp_path: Path) -> None:
    # Step 9's loss x1000: the surge is seen before the update, the state of step 8 is saved and
    # pinned (with the RNG of the end of step 8); resuming from it reproduces steps 9.. exactly.
    args = ("--model", "lora", "--max_steps", "12", "--ga", "2", "--base_interval", "100", "--spike_at", "9")
    ref, crash, resumed = crash_and_resume(tmp_path, *args, kill_at=10)
    captures = [e for e in crash["events"] if e["reason"].startswith("pre_update")]
    assert [(e["step"], e["at_step"], e["pinned"]) for e in captures] == [(8, 9, True)]
    assert [e["step"] for e in crash["events"]] == [8]
    assert_exact(ref, crash, resumed, expect_step=8, ga=2)

"""Capture from the first step, end to end: an explosion in the first steps of a Trainer run leaves a pinned
checkpoint of the step before it, and resuming from that checkpoint is bit-exact.

Uses `trainer_worker.py` (tiny LoRA Qwen2, `SmartCkptCallback`, every micro-batch loss as a
hex float): a clean reference run; runs whose loss is multiplied by 1000 at step k
(`--spike_at k`, k = 2, 5, 8: the statistics are still warming up; rules that need history
capture none of these); then each spiked run's store resumed with `step:k-1` and no spike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_resume import run_worker

pytestmark = pytest.mark.integration

ARGS = ("--model", "lora", "--max_steps", "10", "--ga", "1", "--base_interval", "50")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_worker(tmp_path_factory.mktemp("early-ref"), "ref", *ARGS)


# Onset 2 (the earliest) in the default run; 5 and 8 with the slow tests (`make test-all`).
@pytest.mark.parametrize("onset", [2, pytest.param(5, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_explosion_in_the_first_steps_is_captured_and_resumes_exactly(tmp_path: Path, reference: dict,
                                                                      onset: int) -> None:
    spiked = run_worker(tmp_path, "spiked", *ARGS, "--spike_at", str(onset))
    assert spiked["losses"][: onset - 1] == reference["losses"][: onset - 1]
    captures = [e for e in spiked["events"] if e["reason"].startswith("pre_update")]
    assert captures, spiked["events"]
    first = captures[0]
    assert (first["step"], first["at_step"], first["pinned"]) == (onset - 1, onset, True)
    assert first["reason"].startswith(("pre_update early_grad x", "pre_update early_loss x")), first["reason"]
    # The pre-onset checkpoint resumes the clean run bit for bit (no spike this time).
    resumed = run_worker(tmp_path, "resumed", *ARGS, "--resume", f"step:{onset - 1}")
    assert resumed["resumed_from"] == onset - 1
    assert resumed["losses"] == reference["losses"][onset - 1:]
    assert len(resumed["losses"]) == 10 - (onset - 1)

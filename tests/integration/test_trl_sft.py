"""A client script as most LoRA fine-tunes are written: TRL's `SFTTrainer` with `SmartCkptCallback()` (defaults);
and the same job as TRL's `DPOTrainer` (slow).

Evaluation during training, two data-loader workers, LoRA through `peft_config`: a SIGKILL of the whole job at the
end of step 7 loses one step (the restart reads step 6 from host memory) and the resumed run's micro-batch and
evaluation losses are bit-equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dynamic_ckpt.store.slots import slots_dir

WORKER = Path(__file__).with_name("sft_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, tag: str, *args: str, killed: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), "--tag", tag, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == (-9 if killed else 0), proc.stderr[-3000:]
    return json.loads((out / f"{tag}.json").read_text())


@pytest.mark.parametrize("packing", [pytest.param(False, id="padded"),
                                     pytest.param(True, id="packed", marks=pytest.mark.slow)])
def test_sfttrainer_killed_after_step_7_resumes_from_memory_bit_exact(tmp_path: Path, packing: bool) -> None:
    flags = ["--packing"] if packing else []
    reference = _run(tmp_path / "reference", "run", *flags)
    assert reference["resumed"] is None and len(reference["evals"]) == 4  # steps 3, 6, 9 and the end (10)
    killed = _run(tmp_path / "job", "killed", "--kill_at", "7", *flags, killed=True)
    assert killed["losses"] == reference["losses"][:len(killed["losses"])]
    slots = slots_dir(tmp_path / "job" / "run" / "smart_ckpt", "default")
    assert slots.is_dir()  # nothing outlived the job: the newest state is in host memory only
    resumed = _run(tmp_path / "job", "resumed", *flags)
    assert resumed["resumed"].endswith("default-step-6")  # step 7 (cut by the kill) is the one step lost
    assert Path(resumed["resumed_path"]).parent.parent == slots  # read from host memory
    assert resumed["losses"] == reference["losses"][-len(resumed["losses"]):]  # steps 7-10, bit-equal
    recomputed = len(killed["losses"]) + len(resumed["losses"]) - len(reference["losses"])
    assert 1 <= recomputed <= 2  # step 7's micro-batches (gradient accumulation 2) and nothing more
    assert resumed["evals"] == reference["evals"]
    assert not slots.exists()  # the clean end removed the slots


@pytest.mark.slow
def test_dpotrainer_killed_after_step_7_resumes_from_memory_bit_exact(tmp_path: Path) -> None:
    """The same job as a preference fine-tune (`DPOTrainer`, LoRA: its reference model is the base with the adapter
    off): one step lost, read from host memory, every micro-batch's DPO loss and every evaluation bit-equal."""
    reference = _run(tmp_path / "reference", "run", "--trainer", "dpo")
    assert reference["resumed"] is None and len(reference["losses"]) == 20 and len(reference["evals"]) == 4
    killed = _run(tmp_path / "job", "killed", "--kill_at", "7", "--trainer", "dpo", killed=True)
    assert killed["losses"] == reference["losses"][:14]  # steps 1-7, gradient accumulation 2
    slots = slots_dir(tmp_path / "job" / "run" / "smart_ckpt", "default")
    resumed = _run(tmp_path / "job", "resumed", "--trainer", "dpo")
    assert resumed["resumed"].endswith("default-step-6")
    assert Path(resumed["resumed_path"]).parent.parent == slots
    assert resumed["losses"] == reference["losses"][12:]  # steps 7-10
    assert resumed["evals"] == reference["evals"]
    assert not slots.exists()

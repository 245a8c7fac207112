"""On a GPU: Trainer runs killed with SIGKILL and resumed with `resume_checkpoint("auto")`, bit-exact.

The worker saves every 3 steps and kills itself at the end of step 5 once the save of step 3 is
committed; the resumed run recomputes steps 4 and 5. Their losses must equal the killed run's to
the bit: step 4 checks the weights, the data position and the RNG (dropout draws from the CUDA
generator), step 5 also the optimizer and scheduler state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RESTORE_STEP = 3
RECOMPUTED = ("4", "5")


def _kill_and_resume(out: Path, *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    common = ["--device", "cuda", "--max_steps", "8", "--base_interval", str(RESTORE_STEP), *flags]
    killed = worker(out, "killed", *common, "--kill_at", "5", killed=True)
    resumed = worker(out, "resumed", *common, "--resume", "auto")
    assert resumed["error"] is None, resumed["error"]
    assert resumed["resumed_from"] == RESTORE_STEP, resumed["resumed_from"]
    return killed, resumed


def _compare(killed: dict[str, Any], resumed: dict[str, Any], record_property: Any) -> None:
    pairs = {s: (killed["losses"].get(s), resumed["losses"].get(s)) for s in RECOMPUTED}
    equal = sum(a is not None and a == b for a, b in pairs.values())
    record_property("recomputed steps bit-equal", f"{equal}/{len(pairs)}")
    assert equal == len(pairs), f"losses (killed, resumed) per step differ: {pairs}"


def test_cuda_rng_is_stored_and_restored_for_an_exact_resume(tmp_path: Path, record_property: Any) -> None:
    killed, resumed = _kill_and_resume(tmp_path, "--mode", "lora", "--dropout", "0.1")
    rng = json.loads((tmp_path / "run" / "smart_ckpt" / "default" / f"step-{RESTORE_STEP}" / "rng-rank0.json")
                     .read_text())
    record_property("CUDA generators stored", len(rng["cuda"] or []))
    assert rng["cuda"], "the checkpoint holds no CUDA RNG state"
    _compare(killed, resumed, record_property)


def test_bf16_trainer_run_killed_and_resumed_bit_exact(tmp_path: Path, record_property: Any) -> None:
    killed, resumed = _kill_and_resume(tmp_path, "--mode", "lora", "--bf16", "--dropout", "0.1")
    blocking = [e["blocking_ms"] for e in killed["events"] if e["error"] is None]
    record_property("blocking ms per save", ", ".join(f"{b:.1f}" for b in blocking))
    _compare(killed, resumed, record_property)

"""2-process DDP LoRA with the trainable state consolidated (`state.flat`): DDP's gradients stay right after
`param.data` is re-pointed (the same losses per rank as a plain run), and a kill/resume is bit-exact."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import torchrun_worker, traceback_tail

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

WORKER = Path(__file__).resolve().parents[1] / "integration" / "trainer_worker.py"


def torchrun(out: Path, tag: str, *args: str, expect_ok: bool = True) -> list[dict]:
    os.environ["KILL_RANK"] = "1"
    try:
        proc = torchrun_worker(WORKER, out.parent, "--out", str(out), "--tag", tag, *args)
    finally:
        del os.environ["KILL_RANK"]
    assert (proc.returncode == 0) == expect_ok, f"rc={proc.returncode}\n{traceback_tail(proc)}"
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(2)]


def test_ddp_lora_with_consolidation_trains_and_resumes_exactly(tmp_path: Path) -> None:
    args = ("--model", "lora", "--max_steps", "7", "--ga", "1", "--examples", "48", "--base_interval", "3")
    ref = torchrun(tmp_path / "ref", "ref", *args, "--consolidate", "off")
    crash = torchrun(tmp_path / "crash", "crash", *args, "--consolidate", "on", "--kill_at", "5", expect_ok=False)
    for r in range(2):  # DDP's gradients stay right after param.data is re-pointed: the same losses per rank
        assert crash[r]["losses"] == ref[r]["losses"][:5]
        assert crash[r]["flat"] is not None and crash[r]["flat"]["moves"] == 1
    out = tmp_path / "resume"
    shutil.copytree(tmp_path / "crash", out)
    resumed = torchrun(out, "resume", *args, "--consolidate", "on", "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 3
        assert resumed[r]["losses"] == ref[r]["losses"][3:]
    assert ref[0]["losses"] != ref[1]["losses"]

"""2-process DDP (torchrun, gloo, `use_cpu=True`): a rollback is one agreed decision, exact on every rank.

Rank 0's 6th batch explodes its gradients (bad data; rank 1's batch is clean): the anomaly is in the
reduced frame both ranks judge, so both roll back from step 6 to the capture of step 5, skip the same
batch and go on. The reference resumes from that capture with the 6th batch of each rank removed from
its data stream; every later loss of every rank must equal it to the bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
ARGS = ("--model", "lora", "--ga", "1", "--max_steps", "10", "--examples", "96", "--base_interval", "3")


def torchrun(out: Path, tag: str, *args: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           "--out", str(out), "--tag", tag, *ARGS, *args]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{tag}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300).returncode
    assert rc == 0, (out / f"{tag}.log").read_text()[-6000:]
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(2)]


def test_ddp_rollback_is_agreed_and_exact(tmp_path: Path) -> None:
    rolled = torchrun(tmp_path / "rb", "rb", "--on_anomaly", "rollback", "--poison", "6:grad@0")
    for r in range(2):
        assert [x[:2] for x in rolled[r]["rollbacks"]] == [[6, 5]], r
        assert rolled[r]["global_step"] == 10
    log = (tmp_path / "rb" / "rb.log").read_text()
    assert log.count("rolled back from step 6 to step 5") == 1  # rank 0 announces it
    ref = torchrun(tmp_path / "ref", "ref", "--poison", "6:grad@0", "--reference_skip", "6:6", "--resume",
                   str(tmp_path / "rb" / "run" / "smart_ckpt" / "default" / "step-5"))
    for r in range(2):
        assert ref[r]["resumed_from"] == 5
        assert rolled[r]["losses"][6:] == ref[r]["losses"], r
    assert rolled[0]["losses"] != rolled[1]["losses"]  # the ranks saw different data

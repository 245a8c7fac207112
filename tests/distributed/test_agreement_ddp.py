"""2-process DDP (torchrun, gloo): every decision and every resume outcome is one agreed value.

- Default policy settings (only `base_interval` set) with rank 0's saves made slower on purpose:
  when the save cost was not part of the reduced frame, the overhead budget widened rank 0's
  interval from its own save cost while rank 1 kept saving every 4 steps, and rank 0's writer
  waited 600 s for files rank 1 never wrote. Now both ranks take the same saves, a kill and
  resume is bit-exact, and the job ends in normal time.
- A rank SIGKILLed right after handing a save to its writer: the other rank raises a clear
  error quickly (not after `rank_timeout_s`), and the restart resumes exactly.
- A corrupt optimizer tier: both ranks resume from the weights with a fresh optimizer (the
  same degraded outcome, the same warning), instead of one raising while the other waits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
LORA = ("--model", "lora", "--max_steps", "14", "--ga", "1", "--examples", "64", "--base_interval", "4",
        "--default_policy")


def torchrun(out: Path, tag: str, *args: str, kill_rank: int = 1, timeout: float = 300,
             expect_ok: bool = True) -> tuple[list[dict | None], subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KILL_RANK": str(kill_rank)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           "--out", str(out), "--tag", tag, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    elapsed = time.monotonic() - start
    detail = f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    if expect_ok:
        assert proc.returncode == 0, detail
    else:
        assert proc.returncode != 0, f"the job should have failed\n{detail}"
    results = []
    for r in range(2):
        f = out / f"{tag}-rank{r}.json"
        results.append(json.loads(f.read_text()) if f.is_file() else None)
    return results, proc, elapsed


def _saved_steps(result: dict) -> list[int]:
    return [e["step"] for e in result["events"] if e["error"] is None]


def test_default_policy_with_unequal_save_costs_agrees_and_resumes_exactly(tmp_path: Path) -> None:
    slow = ("--slow_snapshot_rank", "0", "--slow_ms", "400")
    ref, _, _ = torchrun(tmp_path / "ref", "ref", *LORA, *slow)
    assert ref[0] is not None and ref[1] is not None
    assert _saved_steps(ref[0]) == _saved_steps(ref[1])  # one decision per step, whatever each rank measured
    assert _saved_steps(ref[0])[:3] == [4, 8, 12]  # an explicit base_interval is the calm interval
    crash, _, _ = torchrun(tmp_path / "run", "crash", *LORA, *slow, "--kill_at", "9", kill_rank=0, expect_ok=False)
    assert crash[0] is not None and crash[0]["killed"]
    resumed, _, elapsed = torchrun(tmp_path / "run", "resume", *LORA, *slow, "--resume", "auto")
    for r in range(2):
        res = resumed[r]
        assert res is not None and res["resumed_from"] == 8
        assert res["losses"] == ref[r]["losses"][8:]  # type: ignore[index]
        assert _saved_steps(res) == [s for s in _saved_steps(ref[r]) if s > 8]  # type: ignore[arg-type]
    assert elapsed < 200, f"the resumed job took {elapsed:.0f} s"


def test_rank_killed_during_a_write_fails_fast_and_resume_is_exact(tmp_path: Path) -> None:
    args = ("--model", "full", "--max_steps", "10", "--ga", "1", "--examples", "48", "--base_interval", "3")
    ref, _, _ = torchrun(tmp_path / "ref", "ref", *args)
    _, proc, elapsed = torchrun(tmp_path / "run", "crash", *args, "--kill_after_save", "6", kill_rank=1,
                                expect_ok=False, timeout=400)
    # Rank 0 learns at its next exchange with rank 1 that rank 1 is gone (in the library's own
    # exchange, or in DDP's gradient all-reduce when that comes first) and stops: nowhere near the
    # 600 s a commit would wait for a missing rank's files. torchrun names the killed rank as the cause.
    assert elapsed < 150, f"the job took {elapsed:.0f} s to fail"
    root_cause = proc.stderr.rpartition("Root Cause")[2]
    assert "rank      : 1" in root_cause and "SIGKILL" in root_cause, proc.stderr[-3000:]
    resumed, _, _ = torchrun(tmp_path / "run", "resume", *args, "--resume", "auto")
    for r in range(2):
        res = resumed[r]
        assert res is not None
        start = res["resumed_from"]
        assert start in (3, 6)  # 6 when both ranks' files of step 6 were committed before the kill
        assert res["losses"] == ref[r]["losses"][start:]  # type: ignore[index]


def test_corrupt_optimizer_tier_gives_the_same_degraded_resume_on_every_rank(tmp_path: Path) -> None:
    args = ("--model", "full", "--max_steps", "8", "--ga", "1", "--examples", "48", "--base_interval", "3")
    torchrun(tmp_path / "run", "crash", *args, "--kill_at", "7", expect_ok=False)
    opt = tmp_path / "run" / "run" / "smart_ckpt" / "default" / "step-6" / "optimizer.tensors.zst"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt.write_bytes(bytes(data))
    resumed, _, _ = torchrun(tmp_path / "run", "resume", *args, "--resume", "auto")
    for r in range(2):
        res = resumed[r]
        assert res is not None and res["resumed_from"] == 6  # the weights are intact: no fallback to step 3
        lost = [w for w in res["warnings"] if "optimizer state of step 6 is lost" in w]
        assert lost, res["warnings"]
    assert resumed[0]["losses"][:1] != [] and len(resumed[0]["losses"]) == len(resumed[1]["losses"])  # type: ignore[index]
    shutil.rmtree(tmp_path / "run", ignore_errors=True)

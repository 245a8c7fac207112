"""Trainer resume when the newest checkpoint is damaged, and after a SIGTERM.

- L1 (optimizer) corrupt: resume from its weights with a fresh optimizer; the LR schedule
  continues at the right step; a warning says the optimizer state was lost.
- L0 (weights) corrupt: the next older checkpoint is used, bit-exactly, with a warning
  naming both steps.
- SIGTERM: a committed checkpoint, a clean exit (rc 0), and an exact continuation.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from test_trainer_resume import run_worker

pytestmark = pytest.mark.integration

ARGS = ("--model", "full", "--max_steps", "9", "--ga", "2")


def _timeline(out: Path) -> list[dict]:
    path = out / "run" / "smart_ckpt" / "default" / "timeline.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("fallback")
    ref = run_worker(base / "ref", "ref", *ARGS)
    run_worker(base / "crash", "crash", *ARGS, "--kill_at", "7", expect_rc=-signal.SIGKILL)
    return base, ref


def test_corrupt_optimizer_resumes_with_fresh_optimizer(crashed: tuple[Path, dict]) -> None:
    base, ref = crashed
    out = base / "l1"
    shutil.copytree(base / "crash", out)
    opt = out / "run" / "smart_ckpt" / "default" / "step-6" / "optimizer.tensors.zst"
    _flip_byte(opt, opt.stat().st_size // 2)
    resumed = run_worker(out, "resume", *ARGS, "--resume", "auto")
    assert resumed["resumed_from"] == 6
    lost = [w for w in resumed["warnings"] if "optimizer state of step 6 is lost" in w]
    assert lost, resumed["warnings"]
    assert "optimizer state (L1) not restored" in resumed["stderr"]
    # Step 7's forward uses the restored weights and RNG: identical; the update differs after.
    assert resumed["losses"][:2] == ref["losses"][12:14]
    assert resumed["losses"][2:] != ref["losses"][14:]
    # The learning rate of every resumed step is the reference's (the schedule is at step 6).
    ref_lr = {r["step"]: r["lr"] for r in _timeline(base / "ref") if "step" in r}
    after = [r for r in _timeline(out) if "step" in r][-3:]
    assert [r["step"] for r in after] == [7, 8, 9]
    assert [r["lr"] for r in after] == [ref_lr[7], ref_lr[8], ref_lr[9]]


def test_corrupt_weights_fall_back_to_older_checkpoint(crashed: tuple[Path, dict]) -> None:
    base, ref = crashed
    out = base / "l0"
    shutil.copytree(base / "crash", out)
    _flip_byte(out / "run" / "smart_ckpt" / "default" / "step-6" / "weights.safetensors", -5)
    resumed = run_worker(out, "resume", *ARGS, "--resume", "auto")
    assert resumed["resumed_from"] == 3
    assert any("weights of step 6 cannot be loaded" in w and "using step 3 instead" in w
               for w in resumed["warnings"]), resumed["warnings"]
    assert resumed["losses"] == ref["losses"][3 * 2:]


@pytest.mark.slow  # SIGTERM, exit 128 + signal and exact continuation: test_trainer_ddp.py in the default run
def test_sigterm_commits_exits_cleanly_and_continues_exactly(crashed: tuple[Path, dict], tmp_path: Path) -> None:
    _, ref = crashed
    # SIGTERM arrives after step 4; the flag is seen at step 5, which is saved synchronously.
    # ... and the process ends with 143 (128 + SIGTERM) so a scheduler requeues the job.
    stopped = run_worker(tmp_path, "term", *ARGS, "--base_interval", "100", "--sigterm_at", "4", expect_rc=143)
    assert stopped["exit_code"] == 143
    emergency = [e for e in stopped["events"] if e["reason"].startswith("emergency")]
    assert [e["step"] for e in emergency] == [5]
    assert "SIGTERM" in emergency[0]["reason"]
    assert len(stopped["losses"]) == 5 * 2  # training stopped right after the save
    manifest = json.loads((tmp_path / "run" / "smart_ckpt" / "default" / "step-5" / "manifest.json").read_text())
    assert manifest["step"] == 5
    resumed = run_worker(tmp_path, "resume", *ARGS, "--base_interval", "100", "--resume", "auto")
    assert resumed["resumed_from"] == 5
    assert resumed["losses"] == ref["losses"][5 * 2:]

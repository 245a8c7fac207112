"""Rollback past an anomaly, in-process and exact (`on_anomaly: rollback`, docs/rollback.md).

Every anomaly here is bad *data*: a marked example multiplies the loss of the batch that holds
it (x1000: a gradient explosion; NaN; x5: a loss spike), whatever step reads it, as a bad shard
would. The reference of a rollback is a run that resumed from the same restore point with the
skipped batches removed from its data stream (the original order otherwise: sequential sampling
over the original order, `--reference_skip`); every loss after the rollback must equal it to the
bit. The custom Accelerate loop is checked the same way (`tests/workers/accelerate_loop.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dynamic_ckpt.store import CheckpointStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
LOOP = REPO / "tests" / "workers" / "accelerate_loop.py"
ARGS = ("--model", "lora", "--ga", "1", "--max_steps", "12", "--examples", "64", "--base_interval", "3")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run(out: Path, tag: str, *args: str, rc: int = 0) -> tuple[dict, str]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{tag}.log"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, str(WORKER), "--out", str(out), "--tag", tag, *ARGS, *args],
                              stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=300).returncode
    text = log.read_text()
    assert code == rc, f"rc={code}\n{text[-5000:]}"
    result = out / f"{tag}-rank0.json"
    return (json.loads(result.read_text()) if result.is_file() else {}), text


def capture(out: Path, step: int) -> str:
    return str(out / "run" / "smart_ckpt" / "default" / f"step-{step}")


@pytest.fixture(scope="module")
def grad(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """A run whose 6th batch explodes its gradients: rolled back from step 6 to the capture of step 5."""
    out = tmp_path_factory.mktemp("grad")
    result, log = run(out, "rb", "--on_anomaly", "rollback", "--poison", "6:grad")
    return out, result, log


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, grad: tuple[Path, dict, str]) -> dict:
    """Resumed from that capture (step 5), with the 6th batch removed from the data stream."""
    out = tmp_path_factory.mktemp("reference")
    result, _ = run(out, "ref", "--poison", "6:grad", "--reference_skip", "6:6", "--resume", capture(grad[0], 5))
    assert result["resumed_from"] == 5 and len(result["losses"]) == 7
    return result


def test_a_gradient_explosion_is_rolled_back_exactly(grad: tuple[Path, dict, str], reference: dict) -> None:
    out, result, log = grad
    assert [r[:2] for r in result["rollbacks"]] == [[6, 5]]
    assert result["rollbacks"][0][2].startswith("early_grad x")
    assert float.fromhex(result["losses"][5]) > 100 * float.fromhex(result["losses"][4])  # the exploded batch
    assert result["losses"][6:] == reference["losses"]  # every later loss, bit for bit
    assert result["global_step"] == 12 and len(result["losses"]) == 13  # 12 updates applied, 13 batches read
    line = next(x for x in log.splitlines() if "rolled back" in x)
    assert line.endswith("smart_ckpt: rolled back from step 6 to step 5 (" + result["rollbacks"][0][2]
                         + "); skipped batches 6..6")
    assert "smart_ckpt/rollbacks" in result["log_keys"]
    # The step log records it; the saves after it continue the run's count (5 saves: 3, the capture 5, 8, 11, 12).
    steplog = (out / "run" / "smart_ckpt" / "default" / "timeline.jsonl").read_text().splitlines()
    events = [json.loads(x) for x in steplog if '"event": "rollback"' in x]
    assert [(e["from_step"], e["to_step"]) for e in events] == [(6, 5)]
    assert [e["step"] for e in result["events"]] == [3, 5, 8, 11, 12]
    assert result["saves_logged"][-1] == [12, 4]  # logged before the train-end save


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_a_nan_loss_and_a_loss_spike_are_rolled_back_exactly(kind: str, tmp_path: Path, reference: dict) -> None:
    result, _ = run(tmp_path, "rb", "--on_anomaly", "rollback", "--poison", f"6:{kind}")
    assert [r[:2] for r in result["rollbacks"]] == [[6, 5]]
    assert result["rollbacks"][0][2].startswith("nonfinite" if kind == "nan" else "early_loss x")
    assert result["losses"][6:] == reference["losses"]


def test_a_rollback_with_gradient_accumulation_skips_the_whole_window(tmp_path: Path) -> None:
    # Two micro-batches per update: the bad one is the first of window 6; both of its micro-batches are skipped.
    ga = ("--ga", "2", "--max_steps", "8", "--examples", "96")
    result, log = run(tmp_path, "rb", *ga, "--on_anomaly", "rollback", "--poison", "6:grad")
    assert [r[:2] for r in result["rollbacks"]] == [[6, 5]]
    assert "skipped batches 11..12" in log  # micro-batches: window 6 is the 11th and 12th
    assert result["global_step"] == 8 and len(result["losses"]) == 2 * 9  # a loss per micro-batch, 9 windows read
    ref, _ = run(tmp_path / "ref", "ref", *ga, "--poison", "6:grad", "--reference_skip", "6:6",
                 "--resume", capture(tmp_path, 5))
    assert ref["resumed_from"] == 5 and len(ref["losses"]) == 2 * 3
    assert result["losses"][2 * 6:] == ref["losses"]


def test_patience_rolls_back_past_several_bad_steps(tmp_path: Path) -> None:
    # Two bad batches in a row confirm it: the first one's update is applied, the second is not; both are skipped.
    result, log = run(tmp_path, "rb", "--on_anomaly", "rollback", "--rollback_patience", "2",
                      "--poison", "6:grad,7:grad")
    assert [r[:2] for r in result["rollbacks"]] == [[7, 5]]
    assert "skipped batches 6..7" in log
    ref, _ = run(tmp_path / "ref", "ref", "--poison", "6:grad,7:grad", "--reference_skip", "6:7",
                 "--resume", capture(tmp_path, 5))
    assert result["losses"][7:] == ref["losses"]


def test_the_steps_past_the_restore_point_become_an_abandoned_timeline(tmp_path: Path) -> None:
    # A save per step: the checkpoint of step 6 (its update applied before the anomaly was confirmed) is written,
    # then the rollback to step 5 sets it aside; the process is killed right after, before a new step 6 replaces it.
    crash, _ = run(tmp_path, "crash", "--on_anomaly", "rollback", "--rollback_patience", "2",
                   "--poison", "6:grad,7:grad", "--base_interval", "1", "--kill_after_rollback", rc=-9)
    assert [r[:2] for r in crash["rollbacks"]] == [[7, 5]]
    store = CheckpointStore(tmp_path / "run" / "smart_ckpt", cleanup=False)
    infos = {i.step: i for i in store.list(include_unhealthy=True, include_abandoned=True)}
    assert infos[6].abandoned and not infos[6].healthy and not infos[5].abandoned and infos[5].pinned
    assert store.resolve("auto").step == 5
    store.close()
    listing = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", "ls", str(tmp_path / "run"), "--all"],
                             capture_output=True, text=True, env=ENV, timeout=120)
    assert "rollbacks (the steps past each restore point were abandoned" in listing.stdout
    assert "  default: step 7 -> step 5 at " in listing.stdout


def test_a_calm_run_never_rolls_back(tmp_path: Path) -> None:
    calm, _ = run(tmp_path / "rollback", "calm", "--on_anomaly", "rollback")
    plain, _ = run(tmp_path / "capture", "plain")
    assert calm["rollbacks"] == [] and calm["losses"] == plain["losses"]
    assert [e["step"] for e in calm["events"]] == [e["step"] for e in plain["events"]]


def test_max_rollbacks_exhausted_stops_with_a_clear_error(tmp_path: Path, reference: dict) -> None:
    result, _ = run(tmp_path, "rb", "--on_anomaly", "rollback", "--max_rollbacks", "1", "--poison", "6:grad,8:grad",
                    rc=3)
    assert [r[:2] for r in result["rollbacks"]] == [[6, 5]]
    assert result["error"].startswith("step 7: an anomaly (early_grad x")
    assert result["error"].endswith(
        "and no rollback left; the run keeps failing here. Rollbacks were taken at steps 6. Lower the learning rate, "
        "look at the data of the failing steps, raise policy.max_rollbacks, or set "
        "policy.on_rollbacks_exhausted='continue' to train through it (the pre-anomaly captures stay pinned).")
    # Up to the stop, the same losses as the reference (whose 8th batch is clean): the 7th batch trained.
    assert result["losses"][6] == reference["losses"][0]
    assert result["global_step"] == 6  # the bad update of step 7 was never applied


def test_max_rollbacks_exhausted_can_train_through(tmp_path: Path) -> None:
    result, log = run(tmp_path, "rb", "--on_anomaly", "rollback", "--max_rollbacks", "1", "--exhausted", "continue",
                      "--poison", "6:grad,8:grad")
    assert [r[:2] for r in result["rollbacks"]] == [[6, 5]]
    assert "and no rollback left (on_rollbacks_exhausted=continue): training through it" in log
    assert result["global_step"] == 12 and len(result["losses"]) == 13


def test_a_crash_right_after_a_rollback_resumes_exactly(grad: tuple[Path, dict, str], tmp_path: Path) -> None:
    # The run rolls back at step 6, saves step 8 (its data position: 9 batches), and is killed. Trainer would
    # skip 8 batches from global_step alone; the stored position makes it skip 9.
    crash, _ = run(tmp_path, "crash", "--on_anomaly", "rollback", "--poison", "6:grad", "--kill_at", "8", rc=-9)
    assert [r[:2] for r in crash["rollbacks"]] == [[6, 5]]
    resumed, _ = run(tmp_path, "resume", "--on_anomaly", "rollback", "--poison", "6:grad", "--resume", "auto")
    assert resumed["resumed_from"] == 8
    assert resumed["losses"] == grad[1]["losses"][-4:]  # steps 9..12 of the uninterrupted rollback run
    assert resumed["global_step"] == 12


def _loop(cwd: Path, losses: str, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(LOOP), "--output_dir", "run", "--losses", losses, *args], cwd=cwd,
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(x) for x in (cwd / losses).read_text().splitlines()]


def test_a_custom_loop_rolls_back_exactly(tmp_path: Path) -> None:
    rows = _loop(tmp_path, "rb.jsonl", "--on_anomaly", "rollback", "--poison_batch", "6", "--rollback_skip_batches",
                 "1")
    assert [r["rollback"] for r in rows if "rollback" in r] == [[6, 5]]
    after = [r["micro"] for r in rows if "micro" in r][5:]  # the steps trained after the rollback
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = _loop(ref_dir, "ref.jsonl", "--skip_batches", "6:7", "--resume",
                str(tmp_path / "run" / "smart_ckpt" / "default" / "step-5"))
    assert ref[0] == {"resumed_from": 5, "world_size": 1, "ga": 1}
    assert after == [r["micro"] for r in ref if "micro" in r]
    assert len(after) == 7

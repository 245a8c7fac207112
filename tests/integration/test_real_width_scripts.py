"""The real-width measurement scripts run end to end on this machine, at toy widths.

`scripts/bench_real_width.py --smoke` runs the same code as the Qwen2-7B / Llama-3-8B measurement
(the trio of Trainer runs, the resume with its bit-equality check, tier bytes, memory sampling, the
goals) on a 2-layer toy model; `recipes/estimate_sizes.py --measured` reads its JSON; and
`scripts/gpu_check.py` tells "no GPU here" (77) from a failed check (1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.slow  # ~90 s: six Trainer runs in fresh processes (make test-all)
def test_bench_real_width_smoke_measures_every_figure_and_an_exact_resume(tmp_path: Path) -> None:
    out, result = tmp_path / "real_width", tmp_path / "smoke.json"
    proc = _run("scripts/bench_real_width.py", "--smoke", "--out", str(out), "--json", str(result), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(result.read_text())
    assert data["failed"] == {}
    (s,) = data["summaries"]
    assert (s["mode"], s["layers"]) == ("lora", 2)
    # 8 steps, a save every 3: Trainer's own at 3, 6 and its last step (8), every one counted although its
    # rotation keeps three folders; ours at 3 and 6 (the save at training end comes after `train_runtime`).
    assert s["saves"] == {"none": 0, "native": 3, "smart": 2}
    assert len(s["blocking_ms"]) == len(s["blocking_share"]) == 2
    assert all(ms > 0 for ms in s["blocking_ms"])
    assert s["staging"] and all(mode.split("/")[0] in ("buffered", "streaming") for mode in s["staging"])
    # Memory is sampled from /proc for the training process of every run and for the smart run's writer.
    for variant in ("none", "native", "smart"):
        (mem,) = s["memory"][variant]
        assert mem["train"]["VmHWM"] >= mem["train"]["private"] > 0
    # Resume: both resumed runs reproduce the preparation run's losses bit for bit, and the tiers hold bytes.
    r = s["resume"]
    assert r["exact"] == {"native_resume": [True], "ours_resume": [True]}
    assert r["bytes"]["ours"]["weights"] == r["bytes"]["native"]["weights"]  # the same adapter, uncompressed
    assert all(n > 0 for n in r["bytes"]["ours"].values())
    # Where each resume's time goes, timed inside the run: Trainer's own loading, ours' phases.
    assert set(r["phases"]["native_resume"]) == {
        "Trainer loads the weights", "Trainer loads optimizer + scheduler", "Trainer loads the RNG"}
    ours = r["phases"]["ours_resume"]
    assert {"resume_checkpoint: choose, read + verify L0, link", "L1 read + decode (background thread)",
            "wait for L1 + load it (before the first update)"} <= set(ours)
    assert "Trainer loads the weights" not in ours  # resume_checkpoint read them into the model; Trainer does not
    assert all(seconds > 0 for values in ours.values() for seconds in values)
    goals = [g["goal"] for g in data["goals"]]
    assert goals == [
        "lora: blocking per save < 1 % of a step (median save)",
        "lora: overhead per save <= 0.2x Trainer's (train time)",
        "lora: overhead per save <= 0.2x Trainer's (within-run excess)",
        "lora: writer private memory <= staging buffers + interpreter",
        "lora: resume to the first step <= 0.5x Trainer's (to its end, less a steady step)",
    ]
    assert "Goals (each a ratio measured in this run):" in proc.stdout
    assert "| lora | weights |" in proc.stdout

    # --report prints the same tables and goals from the JSON alone.
    again = _run("scripts/bench_real_width.py", "--report", str(result), timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    tables = proc.stdout[proc.stdout.index("| mode | layers |"):proc.stdout.index("\nwrote ")]
    assert tables in again.stdout

    est = _run("recipes/estimate_sizes.py", "--measured", str(result), timeout=300)
    assert est.returncode == 0, est.stdout[-4000:] + est.stderr[-4000:]
    scaled = [line for line in est.stdout.splitlines() if line.startswith("lora ")]
    assert len(scaled) == 1 and "2 -> 2" in scaled[0], est.stdout[-2000:]


def test_gpu_check_without_a_gpu_exits_77_and_runs_nothing() -> None:
    proc = _run("scripts/gpu_check.py", timeout=300)
    assert proc.returncode == 77, proc.stdout[-2000:] + proc.stderr[-2000:]

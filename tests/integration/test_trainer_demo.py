"""The demo end to end, shortened: anomaly, SIGKILL from the parent, resume, exact report, PNG."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dynamic_ckpt.run.record import read_step_log

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_resumes_exactly_and_draws_the_timeline(tmp_path: Path) -> None:
    out = tmp_path / "demo_out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "examples.demo", "--output_dir", str(out),
                           "--max_steps", "40", "--anomaly_at", "15", "--kill_at", "30"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = proc.stdout
    assert "killed (SIGKILL) after step" in report
    assert "Restore point chosen by 'auto': step" in report
    assert "-> EXACT (bit-identical)" in report
    # The injected explosion was captured before its update and pinned; the table marks the restore point.
    rows = [line for line in report.splitlines() if "pre_update loss_spike" in line]
    assert rows and rows[0].split()[:2] == ["14", "15"] and "pinned" in rows[0], report
    assert any("the restore point" in line for line in report.splitlines()), report
    # What the user sees from the library: one INFO line per save, and the resume line.
    assert "resumed from step" in proc.stderr, proc.stderr[-3000:]
    assert "{'loss'" not in report  # no Trainer log dicts between the demo's lines
    png = out / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # The step log (what the risk panel draws) has the explosion's own risk, not only the smoothed one.
    rows = [r for segment in read_step_log(out / "run" / "smart_ckpt") for r in segment if "step" in r]
    calm = [r["beta"] for r in rows if r["step"] < 15]
    assert max(r["beta"] for r in rows if r["step"] == 15) == 1.0 and max(calm) < 0.5, rows

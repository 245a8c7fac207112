"""A crash inside the anomaly window resumes, with `auto`, from before the anomaly.

The demo's run (tiny Qwen2 + LoRA on real text), training through its x30 loss injected at
steps 15-18 (`on_anomaly: capture`), is SIGKILLed after step 18, while the loss is still
exploding; the same command restarted with `--resume_from_smart_checkpoint auto` must resume
from the pinned pre-update capture of step 14, not from a save taken inside the explosion
(a `risk_edge` save of loss 178 marked healthy would let `auto` land in it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from examples import demo
from hf_dynamic_ckpt.store import CheckpointStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_crash_inside_the_anomaly_window_resumes_from_before_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run, store_dir = tmp_path / "run", tmp_path / "run" / "smart_ckpt"
    common = ["--max_steps", "22", "--anomaly_at", "15", "--smart_ckpt_on_anomaly", "capture"]
    killed_after = _kill_inside_the_window(demo._child_cmd(run, common), env, store_dir)
    assert killed_after is not None and 18 <= killed_after < 22, killed_after
    with CheckpointStore(store_dir, cleanup=False, read_only=True) as store:
        infos = {i.step: i for i in store.list(include_unhealthy=True)}
    assert 14 in infos and infos[14].pinned and infos[14].healthy, infos
    inside = [s for s in infos if 15 <= s <= killed_after]
    assert inside and not any(infos[s].healthy for s in inside), {s: infos[s].reason for s in inside}
    rc, _ = demo._run(demo._child_cmd(run, [*common, "--resume_from_smart_checkpoint", "auto"]), env)
    assert rc == 0
    resumes = [r["step"] for r in demo._timeline(store_dir) if r.get("event") == "resume"]
    assert resumes == [14], resumes


def _kill_inside_the_window(cmd: list[str], env: dict[str, str], store_dir: Path) -> int | None:
    """SIGKILL the child after step 18, once a save taken inside the window (step >= 15) is committed.

    On a loaded machine the writer (nice +10) may still be writing the window's save at step 18;
    killing then would leave nothing inside the window to check. Up to step 21 the kill waits for
    that commit; a run that has none by then is killed anyway (and fails below).
    """
    proc = subprocess.Popen(cmd, env=env)
    try:
        while proc.poll() is None:
            steps = [r["step"] for r in demo._timeline(store_dir) if "step" in r]
            if steps and steps[-1] >= 18:
                with CheckpointStore(store_dir, cleanup=False, read_only=True) as store:
                    committed = any(i.step >= 15 for i in store.list(include_unhealthy=True))
                if committed or steps[-1] >= 21:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return steps[-1]
            time.sleep(0.02)
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

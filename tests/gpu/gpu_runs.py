"""Shared by the GPU checks: the time budget `scripts/gpu_check.py` gives them, and child runs within it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trainer_gpu_worker.py")
DEADLINE_ENV = "GPU_CHECK_DEADLINE"
"""Wall-clock time (seconds since the epoch) by which `scripts/gpu_check.py` needs every check done."""


def seconds_left(wanted: float) -> float:
    """`wanted`, cut to what is left of the check's budget; fails the test once nothing useful is left."""
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline is None:
        return wanted
    left = float(deadline) - time.time()
    if left < 10:
        pytest.fail(f"the GPU check's time budget ({DEADLINE_ENV}) is spent: {left:.0f} s left")
    return min(wanted, left)


def run(cmd: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with this checkout's package first on the path, within the budget; a timeout fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    limit = seconds_left(timeout)
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd[:4])} ... did not finish within {limit:.0f} s")


def worker(out: Path, tag: str, *args: str, killed: bool = False, torchrun: bool = False,
           timeout: float = 120) -> dict[str, Any]:
    """Run `trainer_gpu_worker.py` once and return its record; `killed`: it must end by its own SIGKILL."""
    out.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun \
        else [sys.executable]
    proc = run([*launcher, str(WORKER), "--out", str(out), "--tag", tag, *args], cwd=out, timeout=timeout)
    if killed:
        assert proc.returncode != 0, f"{tag}: expected a SIGKILL, exited {proc.returncode}"
    else:
        assert proc.returncode == 0, f"{tag} failed ({proc.returncode}):\n{tail(proc)}"
    path = out / f"{tag}.json"
    assert path.exists(), f"{tag} wrote no record ({proc.returncode}):\n{tail(proc)}"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def tail(proc: subprocess.CompletedProcess[str]) -> str:
    """The first traceback of a child, else the end of its stderr."""
    err = proc.stderr
    at = err.find("Traceback")
    return err[at : at + 4000] if at >= 0 else err[-3000:]


def copy_ms(nbytes: int) -> float:
    """Device time of one device-to-host copy of `nbytes` into pinned memory (best of 3): what a snapshot moves."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return float(min(times))

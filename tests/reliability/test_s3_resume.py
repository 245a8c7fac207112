"""SmartCheckpointer training loop with ``root="s3://..."``: SIGKILL mid-run, resume on "another machine"
(an empty cache) from the bucket, losses bit-equal to an uninterrupted run with a local root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from s3_server import bucket_keys
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"
COMMON = ["--max_steps", "8", "--grad_accum", "2", "--examples", "16", "--base_interval", "3"]


def run_worker(tmp: Path, *args: str, expect_rc: int = 0) -> None:
    """Run the worker in its own session and return when every process of that session has ended: a killed
    worker's writer process outlives it and persists its newest memory slot into the bucket (the watcher)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(WORKER), *args], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == expect_rc, stderr[-3000:]
    deadline = time.monotonic() + 120
    while any(_in_session(p, proc.pid) for p in psutil.process_iter()):
        assert time.monotonic() < deadline, "the worker's writer process did not end"
        time.sleep(0.2)


def _in_session(process: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["resumed_from"], {d["step"]: d for d in lines[1:] if "loss" in d}


def test_sigkill_then_resume_from_the_bucket_on_an_empty_cache_is_bit_exact(s3_root, tmp_path):
    url, options = s3_root
    remote = ["--root", url, "--remote_options", json.dumps(options)]
    run_worker(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *COMMON)
    run_worker(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *COMMON, *remote,
               "--remote_cache_dir", "node-a", expect_rc=-9)
    committed = sorted({int(k.split("/")[2][5:]) for k in bucket_keys(url, options)
                        if k.endswith("/manifest.json") and k.split("/")[2].startswith("step-")})
    # Disk saves at 3 and 6; the memory tier (on by default) keeps the newest step in host memory, and the killed
    # worker's writer persists it into the bucket: step 7, or 6 when step 7's slot was skipped while 6 uploaded.
    assert committed and max(committed) in (6, 7), committed
    assert not (tmp_path / "run/smart_ckpt").exists()  # nothing went to a local folder named like the URL
    run_worker(tmp_path, "--output_dir", "run2", "--losses", "resume.jsonl", "--resume", "auto", "--final",
               "resumed.safetensors", *COMMON, *remote, "--remote_cache_dir", "node-b")
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, ref = read_losses(tmp_path / "ref.jsonl")
    assert resumed_from == max(committed)
    assert sorted(resumed) == list(range(resumed_from + 1, 9))
    for step, row in resumed.items():
        assert row["loss"] == ref[step]["loss"] and row["micro"] == ref[step]["micro"], step
    final_ref, final = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert final_ref.keys() == final.keys() and all(torch.equal(final_ref[k], final[k]) for k in final)

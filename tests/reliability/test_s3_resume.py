"""SmartCheckpointer training loop with ``root="s3://..."``: SIGKILL mid-run, resume on "another machine"
(an empty cache) from the bucket, losses bit-equal to an uninterrupted run with a local root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from s3_server import bucket_keys
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"
COMMON = ["--max_steps", "8", "--grad_accum", "2", "--examples", "16", "--base_interval", "3"]


def run_worker(tmp: Path, *args: str, expect_rc: int = 0) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(WORKER), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == expect_rc, proc.stderr[-3000:]


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
    assert committed and max(committed) < 7
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

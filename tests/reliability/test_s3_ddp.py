"""2-process DDP (torchrun, gloo, CPU) on an ``s3://`` root with one cache directory per rank (no shared
directory between the ranks: rank 1's files and done note reach rank 0 through the bucket): SIGKILL, resume
on fresh caches, losses bit-equal to an uninterrupted local-root run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_loss_log, torchrun_worker, traceback_tail
from s3_server import bucket_keys
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"
COMMON = ["--max_steps", "8", "--examples", "16", "--base_interval", "3"]


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun_worker(WORKER, tmp, *args, timeout=500)


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    return read_loss_log(path, 'loss')


def test_ddp_on_s3_with_per_rank_caches_sigkill_resume_bit_exact(s3_root, tmp_path):
    url, options = s3_root
    remote = ["--root", url, "--remote_options", json.dumps(options)]
    ref = torchrun(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *COMMON)
    assert ref.returncode == 0, traceback_tail(ref)
    crash = torchrun(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *COMMON,
                     *remote, "--remote_cache_dir", "caches-a")
    assert crash.returncode != 0 and ("Signal 9 (SIGKILL)" in crash.stderr or "exitcode  : -9" in crash.stderr), \
        traceback_tail(crash)
    keys = bucket_keys(url, options)
    committed = sorted({int(k.split("/")[2][5:]) for k in keys
                        if k.endswith("/manifest.json") and k.split("/")[2].startswith("step-")})
    assert committed and max(committed) < 7
    last = f"run/default/step-{max(committed)}/"
    assert {k[len(last):] for k in keys if k.startswith(last + "rng-rank")} == {"rng-rank0.json", "rng-rank1.json"}
    # Rank 1's cache never held a committed checkpoint's files: they went through the bucket.
    assert not list((tmp_path / "caches-a" / "rank-1").glob("default/step-*/rng-rank1.json"))
    res = torchrun(tmp_path, "--output_dir", "run2", "--losses", "resume.jsonl", "--resume", "auto", "--final",
                   "resumed.safetensors", *COMMON, *remote, "--remote_cache_dir", "caches-b")
    assert res.returncode == 0, traceback_tail(res)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, expected = read_losses(tmp_path / "ref.jsonl")
    assert resumed_from == max(committed)
    assert sorted(resumed) == list(range(resumed_from + 1, 9))
    for step, row in resumed.items():
        assert row["loss"] == expected[step]["loss"] and row["micro"] == expected[step]["micro"], step
    a, b = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

"""SmartCheckpointer under 2-process DDP (torchrun, Accelerator(cpu=True), gloo): crash, resume, exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*TORCHRUN, str(WORKER), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=400)


def tail(proc: subprocess.CompletedProcess[str]) -> str:
    """The first worker traceback (what torchrun's summary hides), else the end of stderr."""
    err = proc.stderr
    at = err.find("Traceback")
    return err[at : at + 4000] if at >= 0 else err[-3000:]


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["resumed_from"], {d["step"]: d for d in lines[1:]}


def test_ddp_sigkill_resume_bit_exact(tmp_path: Path):
    # 2 ranks x batch 2, 16 examples: 4 steps per epoch; 10 steps cross two epoch boundaries.
    common = ["--max_steps", "10", "--examples", "16", "--base_interval", "3"]
    ref = torchrun(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *common)
    assert ref.returncode == 0, tail(ref)
    crash = torchrun(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7",
                     "--save_state_at", "5", *common)
    assert crash.returncode != 0  # every rank SIGKILLed itself after step 7
    assert "Signal 9 (SIGKILL)" in crash.stderr or "exitcode  : -9" in crash.stderr, tail(crash)
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed and max(committed) < 7
    # Each committed checkpoint holds one RNG file per rank.
    assert {p.name for p in (store / f"step-{max(committed)}").glob("rng-rank*.json")} == {"rng-rank0.json",
                                                                                          "rng-rank1.json"}

    res = torchrun(tmp_path, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                   "--final", "resumed.safetensors", *common)
    assert res.returncode == 0, tail(res)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, expected = read_losses(tmp_path / "ref.jsonl")
    assert resumed_from == max(committed)
    assert sorted(resumed) == list(range(resumed_from + 1, 11))
    for step, row in resumed.items():  # the all-reduced step loss and rank 0's micro-batch losses
        assert row["loss"] == expected[step]["loss"] and row["micro"] == expected[step]["micro"], step
    a, b = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The hook pair under DDP: accelerator.save_state at step 5 (every rank), load_state in a new launch.
    state_dir = tmp_path / "state-5"
    assert not (state_dir / "model.safetensors").exists()
    pointer = json.loads((state_dir / "smart_ckpt.json").read_text())
    assert pointer["step"] == 5 and Path(pointer["path"]).name == "step-5"
    assert {p.name for p in Path(pointer["path"]).glob("rng-rank*.json")} == {"rng-rank0.json", "rng-rank1.json"}
    hooked = torchrun(tmp_path, "--output_dir", "run", "--losses", "hooks.jsonl", "--load_state", "state-5", *common)
    assert hooked.returncode == 0, tail(hooked)
    from_state, after_state = read_losses(tmp_path / "hooks.jsonl")
    assert from_state == 5 and sorted(after_state) == list(range(6, 11))
    for step, row in after_state.items():
        assert row["loss"] == expected[step]["loss"] and row["micro"] == expected[step]["micro"], step

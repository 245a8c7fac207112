"""SmartCheckpointer under 2-process DDP (torchrun, Accelerator(cpu=True), gloo): crash, resume, exact."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_loss_log, torchrun_worker, traceback_tail
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun_worker(WORKER, tmp, *args)


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    return read_loss_log(path, 'step')


def test_ddp_sigkill_resume_bit_exact(tmp_path: Path):
    # 2 ranks x batch 2, 16 examples: 4 steps per epoch; 10 steps cross two epoch boundaries.
    common = ["--max_steps", "10", "--examples", "16", "--base_interval", "3"]
    ref = torchrun(tmp_path, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *common)
    assert ref.returncode == 0, traceback_tail(ref)
    crash = torchrun(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7",
                     "--save_state_at", "5", *common)
    assert crash.returncode != 0  # every rank SIGKILLed itself after step 7
    assert "Signal 9 (SIGKILL)" in crash.stderr or "exitcode  : -9" in crash.stderr, traceback_tail(crash)
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed and max(committed) < 7
    # Each committed checkpoint holds one RNG file per rank.
    assert {p.name for p in (store / f"step-{max(committed)}").glob("rng-rank*.json")} == {"rng-rank0.json",
                                                                                          "rng-rank1.json"}

    res = torchrun(tmp_path, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
                   "--final", "resumed.safetensors", *common)
    assert res.returncode == 0, traceback_tail(res)
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
    assert hooked.returncode == 0, traceback_tail(hooked)
    from_state, after_state = read_losses(tmp_path / "hooks.jsonl")
    assert from_state == 5 and sorted(after_state) == list(range(6, 11))
    for step, row in after_state.items():
        assert row["loss"] == expected[step]["loss"] and row["micro"] == expected[step]["micro"], step

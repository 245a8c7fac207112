"""Each recipe's --tiny mode end to end under 2-process DDP: launch, SIGKILL, resume, exact continuation."""

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
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
MAX_STEPS, CRASH_AT = 9, 7

RECIPES = {
    "qwen2_7b_lora": ["--tiny", "--use_cpu", "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "2",
                      "--learning_rate", "5e-3", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
                      "--disable_tqdm", "true", "--tiny_examples", "32"],
    "llama3_8b_lora": ["--tiny", "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "2",
                       "--learning_rate", "5e-3", "--tiny_examples", "32"],
}


def launch(tmp: Path, recipe: str, out: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = REPO / "recipes" / recipe / "train.py"
    return subprocess.run([*TORCHRUN, str(script), *RECIPES[recipe], "--output_dir", out, *extra], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=500)


def tail(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr
    at = err.find("Traceback")
    return err[at : at + 4000] if at >= 0 else err[-3000:]


def losses(path: Path) -> dict[int, str]:
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_tiny_recipe_crash_resume_exact(tmp_path: Path, recipe: str):
    ref = launch(tmp_path, recipe, "ref", "--loss_log", "ref.jsonl")
    assert ref.returncode == 0, tail(ref)
    expected = losses(tmp_path / "ref.jsonl")
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    # 64 examples / (2 ranks x batch 2): 8 steps per epoch; the run crosses into epoch 2.

    crash = launch(tmp_path, recipe, "run", "--loss_log", "crash.jsonl", "--simulate_crash_at_step", str(CRASH_AT),
                   "--resume_from_smart_checkpoint", "auto")
    assert crash.returncode != 0 and ("Signal 9 (SIGKILL)" in crash.stderr or "exitcode  : -9" in crash.stderr), tail(crash)
    crashed = losses(tmp_path / "crash.jsonl")
    assert max(crashed) == CRASH_AT
    assert all(crashed[s] == expected[s] for s in crashed)  # same run up to the crash
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed and max(committed) < CRASH_AT

    res = launch(tmp_path, recipe, "run", "--loss_log", "resume.jsonl", "--resume_from_smart_checkpoint", "auto")
    assert res.returncode == 0, tail(res)
    resumed = losses(tmp_path / "resume.jsonl")
    assert sorted(resumed) == list(range(max(committed) + 1, MAX_STEPS + 1))
    assert all(resumed[s] == expected[s] for s in resumed), {s: (resumed[s], expected[s]) for s in resumed}
    a = load_file(tmp_path / "ref" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

"""Each recipe's --tiny mode end to end under 2-process DDP: launch, SIGKILL, resume, exact continuation."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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


ZERO2 = REPO / "recipes" / "qwen2_7b_lora"
ACCELERATE_ZERO2 = [sys.executable, "-m", "accelerate.commands.launch",
                    "--config_file", str(ZERO2 / "accelerate_config_zero2.yaml"),
                    "--deepspeed_config_file", str(ZERO2 / "ds_zero2.json"), "--num_processes", "2"]
"""The recipe's ZeRO-2 launch on 2 CPU processes (the config's relative ds_zero2.json path is the repo root's)."""


def launch(tmp: Path, recipe: str, out: str, *extra: str, launcher: list[str] = TORCHRUN
           ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "DS_ACCELERATOR": "cpu"}
    script = REPO / "recipes" / recipe / "train.py"
    return subprocess.run([*launcher, str(script), *RECIPES[recipe], "--output_dir", out, *extra], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=500)


def tail(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr
    at = err.find("Traceback")
    return err[at : at + 4000] if at >= 0 else err[-3000:]


def losses(path: Path) -> dict[int, str]:
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


@pytest.mark.distributed
# The LLaMA recipe's loop is SmartCheckpointer under DDP, which test_accelerate_ddp.py already
# kills and resumes in the default run; its copy runs with the slow tests (`make test-all`).
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r == "llama3_8b_lora" else r
                                    for r in sorted(RECIPES)])
def test_tiny_recipe_crash_resume_exact(tmp_path: Path, recipe: str):
    crash_resume_exact(tmp_path, recipe, TORCHRUN)


@pytest.mark.distributed
@pytest.mark.slow  # the default run's time: the recipe under torchrun and the ZeRO-2 loop stay in it
def test_tiny_qwen2_recipe_under_accelerate_launch_with_deepspeed_zero2_crash_resume_exact(tmp_path: Path):
    crash_resume_exact(tmp_path, "qwen2_7b_lora", ACCELERATE_ZERO2)
    step = next((tmp_path / "run" / "smart_ckpt" / "default").glob("step-*"))
    assert {"optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} <= {p.name for p in step.iterdir()}


def crash_resume_exact(tmp_path: Path, recipe: str, launcher: list[str]) -> None:
    run = functools.partial(launch, launcher=launcher)
    ref = run(tmp_path, recipe, "ref", "--loss_log", "ref.jsonl")
    assert ref.returncode == 0, tail(ref)
    expected = losses(tmp_path / "ref.jsonl")
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    # 64 examples / (2 ranks x batch 2): 8 steps per epoch; the run crosses into epoch 2.

    crash = run(tmp_path, recipe, "run", "--loss_log", "crash.jsonl", "--simulate_crash_at_step", str(CRASH_AT),
                "--resume_from_smart_checkpoint", "auto")
    assert crash.returncode != 0 and ("Signal 9 (SIGKILL)" in crash.stderr
                                      or "exitcode  : -9" in crash.stderr), tail(crash)
    crashed = losses(tmp_path / "crash.jsonl")
    assert max(crashed) == CRASH_AT
    assert all(crashed[s] == expected[s] for s in crashed)  # same run up to the crash
    store = tmp_path / "run" / "smart_ckpt" / "default"
    committed = sorted(int(p.name[5:]) for p in store.glob("step-*") if "." not in p.name)
    assert committed and max(committed) < CRASH_AT

    res = run(tmp_path, recipe, "run", "--loss_log", "resume.jsonl", "--resume_from_smart_checkpoint", "auto")
    assert res.returncode == 0, tail(res)
    resumed = losses(tmp_path / "resume.jsonl")
    assert sorted(resumed) == list(range(max(committed) + 1, MAX_STEPS + 1))
    assert all(resumed[s] == expected[s] for s in resumed), {s: (resumed[s], expected[s]) for s in resumed}
    a = load_file(tmp_path / "ref" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def local_model_and_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stand-ins for a Hub checkpoint and a JSONL dataset: saved with save_pretrained / as JSONL."""
    from examples import toy

    root = tmp_path_factory.mktemp("real")
    texts = toy.text_corpus(max_chars=30_000)
    tokenizer = toy.train_tokenizer(texts, vocab_size=320)
    paths = {"data": root / "train.jsonl"}
    paths["data"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for name, build in (("qwen2_7b_lora", toy.tiny_qwen2), ("llama3_8b_lora", toy.tiny_llama)):
        model = build(seed=0, vocab_size=len(tokenizer))
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.mark.integration
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_real_mode_path_with_local_model_and_jsonl(tmp_path: Path, recipe: str, local_model_and_data):
    """The non-tiny code path: AutoModel/AutoTokenizer from a path, JSONL through `datasets`, LoRA config."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--model_name_or_path", str(local_model_and_data[recipe]), "--dataset", str(local_model_and_data["data"]),
            "--max_seq_length", "32", "--lora_r", "2", "--max_steps", "4", "--per_device_train_batch_size", "2",
            "--output_dir", "out", "--loss_log", "losses.jsonl", "--resume_from_smart_checkpoint", "auto"]
    if recipe == "qwen2_7b_lora":
        args += ["--use_cpu", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
                 "--disable_tqdm", "true"]
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / recipe / "train.py"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, tail(proc)
    assert sorted(losses(tmp_path / "losses.jsonl")) == [1, 2, 3, 4]
    adapter = load_file(tmp_path / "out" / "final" / "adapter_model.safetensors")
    # r=2 on all seven projections of both layers: an A and a B matrix each.
    assert len(adapter) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert (tmp_path / "out" / "smart_ckpt" / "catalog.db").is_file()

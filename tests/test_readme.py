"""The README runs as written: the quick start, its command-line block and load_checkpoint on the store it
made; run again with more steps, it resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def quick_start_code() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no python block under '## Quick start'"
    return match.group(1)


def test_readme_quick_start_runs_and_resumes(tmp_path: Path) -> None:
    code = quick_start_code() + (
        "\nimport json, sys\n"
        "cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SmartCkptCallback))\n"
        "print(json.dumps({'global_step': trainer.state.global_step,"
        " 'resumed_from': cb.resumed_from.info.step if cb.resumed_from else None}))\n"
    )
    script = tmp_path / "quick_start.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def run() -> dict:
        proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        import json

        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run()
    assert first == {"global_step": 12, "resumed_from": None}
    store = tmp_path / "out" / "smart_ckpt" / "default"
    steps = sorted(int(p.name.split("-")[1]) for p in store.glob("step-*") if ".tmp-" not in p.name)
    assert steps and steps[-1] == 12, steps  # the final state is a restore point
    # base_interval=4: the first save comes at step 4. Later gaps may widen (the overhead budget
    # sees the measured save cost against ~10 ms toy steps), so they are not asserted here.
    assert steps[0] == 4, steps
    # The README's command line (ls, show, export peft/merged, pin, gc) and load_checkpoint, on this store.
    run_cli_block_and_load_checkpoint(tmp_path, env)
    # The same script, asked to train longer: it picks up the store and continues from step 12.
    script.write_text(script.read_text(encoding="utf-8").replace("max_steps=12", "max_steps=16"), encoding="utf-8")
    second = run()
    assert second == {"global_step": 16, "resumed_from": 12}


def _block(after: str, lang: str) -> str:
    section = (REPO / "README.md").read_text(encoding="utf-8").split(after, 1)[1]
    match = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert match, f"README has no {lang} block after {after!r}"
    return match.group(1)


def run_cli_block_and_load_checkpoint(tmp_path: Path, env: dict[str, str]) -> None:
    """The README's command-line block, line by line, and its `load_checkpoint` snippet, on the quick start's store."""

    def python(code: str) -> None:
        proc = subprocess.run([sys.executable, "-c", "import torch\ntorch.set_num_threads(1)\n" + code], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    # The merged export needs the base weights: the quick start's base model, saved where the README points.
    python("from examples import toy\ntoy.tiny_qwen2(seed=0).save_pretrained('path/to/base')")
    heading = "## Getting the model out, and the command line"
    for line in _block(heading, "bash").splitlines():
        for command in line.split("#", 1)[0].split(";"):
            if not command.strip():
                continue
            argv = command.split()
            assert argv[0] == "hf-dynamic-ckpt", command
            proc = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", *argv[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, env=env, timeout=300)
            assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "model" / "config.json").is_file()
    python("from examples import toy\nmodel = toy.lora(toy.tiny_qwen2(seed=0))\n"
           + _block(heading, "python") + "assert loaded.info.step == 12, loaded.info\n")

"""A resume that never trains changes nothing a user can see, and a process that ends normally leaves no trace.

A notebook that inspects what it would resume, or a script that checks the restore point, calls
`resume_checkpoint(trainer, ...)` (even twice, with different specs) and exits without `train()`: the store's
checkpoints, timelines and step log are byte for byte what they were, `auto` still picks the newest checkpoint,
the Trainer folder it prepared is gone, and the next start takes the writer lock silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.integration

WORKER = REPO / "tests" / "integration" / "trainer_worker.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
INDEX = ("catalog.db", "catalog.db-wal", "catalog.db-shm", ".writer.lock")  # the derived index and the lock record

LOOK_ONLY = """
import sys
sys.path.insert(0, {workers!r})
from transformers import Trainer, TrainingArguments
from trainer_worker import build_model
from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
from examples import toy

trainer = Trainer(model=build_model("lora"), train_dataset=toy.random_token_dataset(num_examples=8, seq_len=16,
                  vocab_size=128, seed=1), args=TrainingArguments(output_dir={out!r}, report_to=[], use_cpu=True,
                  save_strategy="no"), callbacks=[SmartCkptCallback(SmartCkptConfig())])
print("best:", resume_checkpoint(trainer, "best"))
print("step:8:", resume_checkpoint(trainer, "step:8"))
"""


def _files(root: Path) -> dict[str, str]:
    """Every file under the store but the index and the lock record: path -> sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in INDEX}


def _run(args: list[str], log: Path) -> str:
    with open(log, "w") as f:
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=300).returncode
    text = log.read_text()
    assert rc == 0, text[-4000:]
    return text


def test_resumes_that_never_train_change_nothing_and_the_next_start_is_silent(tmp_path: Path) -> None:
    common = ["--out", str(tmp_path), "--model", "lora", "--max_steps", "14", "--base_interval", "4"]
    _run([sys.executable, str(WORKER), "--tag", "first", *common], tmp_path / "first.log")
    store = tmp_path / "run" / "smart_ckpt"
    before = _files(store)
    assert {"default/step-8/manifest.json", "default/step-14/manifest.json"} <= set(before)

    text = _run([sys.executable, "-c", LOOK_ONLY.format(workers=str(WORKER.parent), out=str(tmp_path / "run"))],
                tmp_path / "look.log")
    assert f"step:8: {store.absolute() / '.resume' / 'default-step-8'}" in text
    assert _files(store) == before  # no checkpoint abandoned, no timeline fork, no step-log entry
    assert not (store / ".resume").exists()  # the folder prepared for Trainer went with the process
    shown = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", "show", str(tmp_path / "run"), "auto",
                            "--json"], capture_output=True, text=True, env=ENV, timeout=120)
    assert json.loads(shown.stdout)["step"] == 14, shown.stderr

    text = _run([sys.executable, str(WORKER), "--tag", "again", *common, "--max_steps", "16", "--resume", "auto"],
                tmp_path / "again.log")
    assert json.loads((tmp_path / "again-rank0.json").read_text())["resumed_from"] == 14
    assert "writer lock" not in text  # the look-only process ended normally: its lock was released, not taken over

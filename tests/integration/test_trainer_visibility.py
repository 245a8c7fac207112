"""What a Trainer user sees: one line per save at INFO through transformers' logging, a
`resumed from` line at WARNING, nothing else from the library at INFO, and the `smart_ckpt/*`
scalars in a real TensorBoard event file through `report_to`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import logging, sys
import transformers
from transformers import Trainer, TrainingArguments
from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
from examples import toy

out, resume, report = sys.argv[1], sys.argv[2], sys.argv[3]
if report == "none":
    transformers.logging.set_verbosity_info()      # what --log_level info does on the main process
else:
    logging.basicConfig(level=logging.INFO)         # the library's own loggers at INFO
model = toy.lora(toy.tiny_qwen2(seed=0), r=4)
args = TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=4, save_strategy="no",
                         report_to=[] if report == "none" else [report], logging_steps=1, use_cpu=True,
                         disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=toy.random_token_dataset(num_examples=32),
                  callbacks=[SmartCkptCallback(SmartCkptConfig(base_interval=2, engine="sync"))])
trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, None if resume == "no" else resume))
"""


def _run(out: Path, resume: str, report: str = "none") -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TENSORBOARD_LOGGING_DIR": str(out / "tb")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), resume, report], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_one_line_per_save_and_a_resume_line(tmp_path: Path) -> None:
    text = _run(tmp_path / "run", "no")
    saves = [line for line in text.splitlines() if "smart_ckpt: saved step" in line]
    assert [line.split("saved step ")[1].split(" ")[0] for line in saves] == ["2", "4", "6"], saves
    assert all("training blocked" in line and "KiB" in line for line in saves)
    assert not [line for line in text.splitlines() if "hf_dynamic_ckpt" in line and "INFO" in line]
    import shutil

    shutil.rmtree(tmp_path / "run" / "smart_ckpt" / "default" / "step-6")  # resume from 4
    again = _run(tmp_path / "run", "auto")
    resumed = [line for line in again.splitlines() if "smart_ckpt: resumed from step" in line]
    assert len(resumed) == 1 and "resumed from step 4 (" in resumed[0] and "tiers optimizer,state,weights" in resumed[0]


def test_library_info_logging_is_one_line_per_save(tmp_path: Path) -> None:
    # logging.basicConfig(INFO) used to print 3-4 lines per save (store, engine, policy, checkpointer).
    text = _run(tmp_path / "run", "no", report="tensorboard")
    lib = [line for line in text.splitlines() if line.startswith("INFO:hf_dynamic_ckpt")]
    assert lib == [], lib


def test_metrics_reach_a_real_tensorboard_event_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path / "run", "no", report="tensorboard")
    files = list((tmp_path / "run" / "tb").rglob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file written"
    tags: set[str] = set()
    values: dict[str, list[float]] = {}
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.add(tag)
            values.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    expected = {"train/smart_ckpt/saves", "train/smart_ckpt/last_save_step", "train/smart_ckpt/stall_ms",
                "train/smart_ckpt/risk", "train/smart_ckpt/failed_saves"}
    assert expected <= tags, sorted(tags)
    assert max(values["train/smart_ckpt/saves"]) >= 2 and max(values["train/smart_ckpt/last_save_step"]) >= 4

"""After `resume_checkpoint`, Trainer's first forward and backward run while the optimizer tier decodes
the state is applied at the first `on_pre_optimizer_step`, and the run stays bit-exact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration


def _trainer(root: Path, steps: int, record: dict | None = None, stop_at: int | None = None):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    model = toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32)
    data = toy.random_token_dataset(num_examples=16, seq_len=8, vocab_size=64, seed=1)
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", seed=0,
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, warmup_steps=2)
    smart = SmartCkptCallback(SmartCkptConfig(root=str(root / "ckpt"), base_interval=2, keep_last=10,
                                              policy={"overhead_budget": 1.0}))
    callbacks = [smart]
    if stop_at is not None:  # an interrupted run (same schedule as the full one)
        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                control.should_training_stop = state.global_step >= stop_at

        callbacks.append(Stop())
    if record is not None:
        class Probe(TrainerCallback):
            def on_step_begin(self, args, state, control, optimizer=None, **kw):
                if "begin_state" not in record:
                    record["begin_state"] = len(optimizer.state)  # nothing applied yet
                    record["read_done_at_begin"] = record["read_done"].is_set()
                    record["first_step_began"].set()  # lets the (held) optimizer-tier read finish

            def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
                record.setdefault("applied_lr", optimizer.param_groups[0]["lr"])

        callbacks.append(Probe())
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_the_first_step_overlaps_the_optimizer_tier_read_and_stays_exact(tmp_path, monkeypatch):
    from hf_dynamic_ckpt import resume_checkpoint
    from hf_dynamic_ckpt.run import resume as resume_module

    ref = _trainer(tmp_path / "ref", 4)
    ref.train()
    ref_weights = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    ref_lr = ref.lr_scheduler.get_last_lr()

    first = _trainer(tmp_path / "run", 4, stop_at=2)  # saves step 2: the restore point
    first.train()
    record = {"read_done": threading.Event(), "first_step_began": threading.Event()}
    read = resume_module.read_optimizer_tier

    def held_read(*args):  # the decode cannot finish before the first step has begun
        record["waited"] = record["first_step_began"].wait(60)
        try:
            return read(*args)
        finally:
            record["read_done"].set()

    monkeypatch.setattr(resume_module, "read_optimizer_tier", held_read)
    resumed = _trainer(tmp_path / "run", 4, record)
    path = resume_checkpoint(resumed, "step:2")
    resumed.train(resume_from_checkpoint=path)

    assert record["waited"]  # the read was still held when the first step began: no wait for it before
    assert record["begin_state"] == 0 and not record["read_done_at_begin"]
    assert record["read_done"].is_set()
    # The state was applied before the first update: the same weights and schedule as the uninterrupted run.
    assert resumed.state.global_step == 4
    weights = resumed.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in ref_weights.items())
    assert resumed.lr_scheduler.get_last_lr() == ref_lr
    assert len(resumed.optimizer.state) > 0

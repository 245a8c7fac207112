"""A Trainer resume reads the weights once: `resume_checkpoint` copies the verified weights into the model and
`Trainer.train` does not load the folder's file a second time, unless its model is not the one they went to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from examples import toy
from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
from hf_dynamic_ckpt.errors import FAULT_ENV

pytestmark = pytest.mark.integration

DATA = toy.random_token_dataset(num_examples=32, seq_len=16, seed=1)


def make_trainer(out: Path, max_steps: int, *, lora: bool = False, model_init: bool = False) -> Trainer:
    def build() -> Any:
        model = toy.tiny_qwen2(seed=0)
        return toy.lora(model) if lora else model

    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, seed=7,
                             disable_tqdm=True, logging_steps=1)
    callback = SmartCkptCallback(SmartCkptConfig(base_interval=2))
    if model_init:
        return Trainer(model_init=build, args=args, train_dataset=DATA, callbacks=[callback])
    return Trainer(model=build(), args=args, train_dataset=DATA, callbacks=[callback])


def stored_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "smart_ckpt" / "default" / f"step-{step}" / "weights.safetensors"))


def count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The folders Trainer's own weight load (`Trainer._load_from_checkpoint`) reads."""
    calls: list[str] = []
    real = Trainer._load_from_checkpoint

    def spy(self: Trainer, resume_from_checkpoint: str, model: Any = None) -> None:
        calls.append(resume_from_checkpoint)
        real(self, resume_from_checkpoint, model)

    monkeypatch.setattr(Trainer, "_load_from_checkpoint", spy)
    return calls


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_weights_are_in_the_model_before_train_and_trainer_does_not_load_them_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora: bool) -> None:
    make_trainer(tmp_path, 4, lora=lora).train()
    saved = stored_weights(tmp_path, 4)
    calls = count_loads(monkeypatch)
    log = tmp_path / "checked.jsonl"  # files hashed in a pass of their own (not as they are read)
    monkeypatch.setenv(FAULT_ENV, f"read@op=check:log={log}")
    trainer = make_trainer(tmp_path, 6, lora=lora)
    folder = resume_checkpoint(trainer, "auto")
    hashed = [json.loads(line)["name"] for line in log.read_text().splitlines()] if log.exists() else []
    assert ("weights.safetensors" in hashed) == lora  # a full model's file: read once, hashed as it is read
    file = "adapter_model.safetensors" if lora else "model.safetensors"
    assert folder is not None and Path(folder, file).is_file()  # for a Trainer that loads it anyway
    live = trainer.model.state_dict()
    if lora:
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(trainer.model)
    assert sorted(live) == sorted(saved) and all(torch.equal(live[k], saved[k]) for k in saved)
    if not lora:  # read straight into the parameters: what the resume holds is the model's memory, not a file map
        callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SmartCkptCallback))
        held = callback.resumed_from.weights
        assert all(held[k].data_ptr() == live[k].data_ptr() for k in saved)
    trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 6
    assert calls == []
    assert "_load_from_checkpoint" not in vars(trainer)  # the wrapper is gone once used


def test_a_model_init_trainer_builds_a_new_model_and_loads_the_folder_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_trainer(tmp_path, 4).train()
    saved = stored_weights(tmp_path, 4)
    calls = count_loads(monkeypatch)
    trainer = make_trainer(tmp_path, 4, model_init=True)  # max_steps 4: nothing left to train, the weights stay
    folder = resume_checkpoint(trainer, "auto")
    assert folder is not None
    trainer.train(resume_from_checkpoint=folder)
    assert calls == [folder]
    live = trainer.model.state_dict()
    assert all(torch.equal(live[k], saved[k]) for k in saved)

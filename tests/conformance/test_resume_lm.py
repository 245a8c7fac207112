"""Upstream's causal-LM resume tests, natively and through the library.

Ported from transformers' `tests/trainer/test_trainer_checkpointing.py` (commit
abee4b14abf32637fe72990d0c409eaba189b31a, see conformance_utils):

- `test_can_resume_training_lm`: 10 steps, batch 1, cosine schedule, a save and a log every
  step, resume from checkpoint 9, parameters and `TrainerState` equal to the uninterrupted
  run. Upstream trains GPT-2 in fp16 on a GPU and compares 1000 sampled parameters with
  `allclose`; here a tiny Llama built from config trains in fp32 on CPU and every parameter
  is compared bit for bit (a superset of upstream's check).
- `test_multiple_peft_adapters`: a LoRA model with adapters `adapter1` (active, trained) and
  `adapter2`; resume from checkpoint 5 of 10. Upstream re-uses the trained model object, so
  its parameter comparison compares a model with itself; here the resumed run starts from a
  fresh model whose `adapter2` was zeroed, so both adapters must come back by name from the
  checkpoint, and `adapter1` must stay the active adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_utils import (
    MODES,
    assert_params_equal,
    assert_same_across_modes,
    assert_states_equal,
    mode_args,
    mode_callbacks,
    params_of,
    resume_arg,
    state_of,
    store_root,
    store_steps,
)
from transformers import Trainer, TrainingArguments

from examples import toy

pytestmark = pytest.mark.integration

NATIVE_FILES = ("model.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                "config.json")


def lm_trainer(mode: str, out: Path, model: torch.nn.Module, interval: int, **args: Any) -> Trainer:
    data = toy.random_token_dataset(num_examples=24, seq_len=16, vocab_size=toy.DEFAULT_VOCAB_SIZE, seed=0)
    return Trainer(model, TrainingArguments(**mode_args(mode, out, interval, **args)), train_dataset=data,
                   callbacks=mode_callbacks(mode, out, interval))


# ---------------------------------------------------------------------- test_can_resume_training_lm
LM_ARGS = {"max_steps": 10, "per_device_train_batch_size": 1, "learning_rate": 1e-3, "lr_scheduler_type": "cosine",
           "logging_strategy": "steps", "logging_steps": 1}


def lm_scenario(mode: str, out: Path) -> dict[str, Any]:
    trainer = lm_trainer(mode, out, toy.tiny_llama(seed=0), 1, **LM_ARGS)
    trainer.train(resume_from_checkpoint=False)
    ref, state = params_of(trainer.model), state_of(trainer)
    # Upstream's check_saved_checkpoints(freq=1, total=11): a checkpoint for every step.
    if mode == "native":
        for step in range(1, 11):
            assert all((out / f"checkpoint-{step}" / name).is_file() for name in NATIVE_FILES), step
    else:
        assert store_steps(store_root(out)) == list(range(1, 11))
    trainer = lm_trainer(mode, out, toy.tiny_llama(seed=0), 1, **LM_ARGS)
    trainer.train(resume_from_checkpoint=resume_arg(mode, trainer, out, 9))
    assert_params_equal(ref, trainer.model)
    state1 = state_of(trainer)
    assert_states_equal(state, state1)
    return {"state": state, "resumed": state1}


@pytest.mark.parametrize("mode", MODES)
def test_can_resume_training_lm(mode: str, tmp_path: Path, native_run: Any) -> None:
    result = native_run("lm", lambda d: lm_scenario("native", d)) if mode == "native" else lm_scenario(mode, tmp_path)
    if mode == "library":
        native = native_run("lm", lambda d: lm_scenario("native", d))
        assert_same_across_modes(native["state"], result["state"])
        assert_same_across_modes(native["resumed"], result["resumed"])


# ---------------------------------------------------------------------- test_multiple_peft_adapters
ADAPTER_ARGS = {"per_device_train_batch_size": 1, "learning_rate": 1e-3, "logging_steps": 5, "max_steps": 10}


def two_adapter_model() -> torch.nn.Module:
    """Tiny Llama with LoRA adapters `adapter1` (active) and `adapter2`, both non-trivial."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(toy.tiny_llama(seed=0), config, "adapter1")
        model.add_adapter("adapter2", config)
        # lora_B starts at zero: give adapter2 values of its own, so restoring it is observable.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "adapter2" in name:
                    p.copy_(torch.randn_like(p))
    model.set_adapter("adapter1")
    return model


def adapters_scenario(mode: str, out: Path) -> dict[str, Any]:
    model = two_adapter_model()
    trainer = lm_trainer(mode, out, model, 5, **ADAPTER_ARGS)
    trainer.train()
    ref, state = params_of(model), state_of(trainer)
    initial = two_adapter_model().state_dict()
    assert any("adapter1" in k and not torch.equal(v, initial[k]) for k, v in ref.items()), "adapter1 trained"

    fresh = two_adapter_model()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if "adapter2" in name:
                p.zero_()
    trainer = lm_trainer(mode, out, fresh, 5, **ADAPTER_ARGS)
    trainer.train(resume_from_checkpoint=resume_arg(mode, trainer, out, 5))
    assert fresh.active_adapter == "adapter1"
    assert_params_equal(ref, fresh)
    state1 = state_of(trainer)
    assert_states_equal(state, state1)
    return {"state": state, "resumed": state1}


@pytest.mark.parametrize("mode", MODES)
def test_multiple_peft_adapters(mode: str, tmp_path: Path, native_run: Any) -> None:
    result = (native_run("adapters", lambda d: adapters_scenario("native", d)) if mode == "native"
              else adapters_scenario(mode, tmp_path))
    if mode == "library":
        native = native_run("adapters", lambda d: adapters_scenario("native", d))
        assert_same_across_modes(native["state"], result["state"])
        assert_same_across_modes(native["resumed"], result["resumed"])

"""Upstream's resume tests on the regression model, natively and through the library.

Ported from `TrainerResumeTrainingTest` of transformers' `tests/trainer/test_trainer_checkpointing.py`
(commit abee4b14abf32637fe72990d0c409eaba189b31a, see conformance_utils): `test_can_resume_training`
(PreTrainedModel and plain module, from checkpoint 5 and from checkpoint 15 across an epoch
boundary, and its two failure cases), `test_resume_training_with_gradient_accumulation`,
`_with_frozen_params`, `_with_shard_checkpoint`, `_with_different_batch_size` and
`_with_randomness` (skipped upstream for multi-GPU DataParallel ordering; on one CPU process
its assertions hold and are checked here).

Each test asserts what upstream asserts (parameters equal to the uninterrupted run's, the
same `TrainerState`), and the library-mode test also that the final `TrainerState` is the
one the native run ends with (`assert_same_across_modes`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conformance_utils import (
    MODES,
    RegressionConfig,
    RegressionDataset,
    RegressionRandomPreTrainedModel,
    assert_params_equal,
    assert_same_across_modes,
    assert_states_equal,
    convert_to_sharded_checkpoint,
    mode_args,
    mode_callbacks,
    native_trainer_state,
    params_of,
    regression_trainer,
    resume_arg,
    state_of,
    store_root,
    stored_trainer_state,
    stored_weights,
    writer_processes,
)
from transformers import Trainer, TrainingArguments

from hf_dynamic_ckpt import CheckpointNotFoundError, resume_checkpoint

pytestmark = pytest.mark.integration


def run_and_resume(mode: str, out: Path, steps: tuple[int, ...], *, freeze_a: bool = False,
                   **kwargs: Any) -> dict[str, Any]:
    """Train uninterrupted, then resume from each of `steps` in a fresh Trainer; assert as upstream."""
    writers_before = writer_processes()
    trainer = regression_trainer(mode, out, **kwargs)
    if freeze_a:
        trainer.model.a.requires_grad_(False)
    trainer.train()
    ref, state = params_of(trainer.model), state_of(trainer)
    finals = []
    for step in steps:
        trainer = regression_trainer(mode, out, **kwargs)
        if freeze_a:
            trainer.model.a.requires_grad_(False)
        trainer.train(resume_from_checkpoint=resume_arg(mode, trainer, out, step))
        if freeze_a:
            assert trainer.model.a.requires_grad is False
        assert_params_equal(ref, trainer.model)
        state1 = state_of(trainer)
        assert_states_equal(state, state1)
        finals.append(state1)
    # Every train() has returned: no background writer of these Trainers is left.
    assert writer_processes() - writers_before == set()
    return {"state": state, "resumed": finals}


def check_against_native(mode: str, native_run: Any, key: str, result: dict[str, Any], scenario: Any) -> None:
    if mode == "library":
        native = native_run(key, scenario)
        for lib_state, nat_state in zip([result["state"], *result["resumed"]], [native["state"], *native["resumed"]]):
            assert_same_across_modes(nat_state, lib_state)


# ---------------------------------------------------------------------- test_can_resume_training
CAN_RESUME = {
    # upstream: logging on for the PreTrainedModel, default logging for the plain module
    "pretrained": {"train_len": 128, "learning_rate": 0.1, "logging_steps": 5},
    "plain": {"train_len": 128, "learning_rate": 0.1, "pretrained": False},
}


@pytest.mark.parametrize("model_kind", sorted(CAN_RESUME))
@pytest.mark.parametrize("mode", MODES)
def test_can_resume_training(mode: str, model_kind: str, tmp_path: Path, native_run: Any) -> None:
    kwargs = dict(CAN_RESUME[model_kind])
    if mode == "library" and model_kind == "pretrained":
        kwargs["config"] = {"engine": "process"}  # the default writer, once in this suite

    def scenario(m: str, out: Path) -> dict[str, Any]:
        kw = {k: v for k, v in kwargs.items() if m == "library" or k != "config"}
        # 128 rows / batch 8 = 16 steps per epoch: step 15 is in epoch 1, the run spans 3 epochs.
        return run_and_resume(m, out, (5, 15), **kw)

    result = native_run(f"can_resume-{model_kind}", lambda d: scenario("native", d)) if mode == "native" \
        else scenario(mode, tmp_path)
    check_against_native(mode, native_run, f"can_resume-{model_kind}", result, lambda d: scenario("native", d))


@pytest.mark.parametrize("mode", MODES)
def test_can_resume_training_failures(mode: str, tmp_path: Path) -> None:
    # Upstream: a bogus checkpoint path, and resume_from_checkpoint=True with no checkpoint.
    trainer = regression_trainer(mode, tmp_path, max_steps=5)
    if mode == "native":
        with pytest.raises(Exception, match="Can't find a valid checkpoint at"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5-bogus"))
        trainer = regression_trainer(mode, tmp_path, max_steps=5)
        with pytest.raises(Exception, match=r"No valid checkpoint found in output directory"):
            trainer.train(resume_from_checkpoint=True)
        return
    # The library's counterparts: an explicit spec naming nothing raises and names the bad value;
    # `auto` on an empty store is a fresh start (documented in resume_checkpoint).
    assert resume_checkpoint(trainer, "auto") is None
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, "auto"))
    assert trainer.state.global_step == 5
    trainer = regression_trainer(mode, tmp_path, max_steps=5)
    with pytest.raises(CheckpointNotFoundError, match="999"):
        resume_checkpoint(trainer, "step:999")
    bogus = tmp_path / "checkpoint-5-bogus"
    with pytest.raises(CheckpointNotFoundError, match="checkpoint-5-bogus"):
        resume_checkpoint(trainer, bogus)


# ---------------------------------------------------------------------- GA, frozen params, shards
@pytest.mark.parametrize("mode", MODES)
def test_resume_training_with_gradient_accumulation(mode: str, tmp_path: Path, native_run: Any) -> None:
    kwargs = {"train_len": 128, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
              "learning_rate": 0.1}

    def scenario(m: str, out: Path) -> dict[str, Any]:
        return run_and_resume(m, out, (5,), **kwargs)

    result = native_run("ga", lambda d: scenario("native", d)) if mode == "native" else scenario(mode, tmp_path)
    check_against_native(mode, native_run, "ga", result, lambda d: scenario("native", d))


@pytest.mark.parametrize("mode", MODES)
def test_resume_training_with_frozen_params(mode: str, tmp_path: Path, native_run: Any) -> None:
    kwargs = {"train_len": 128, "per_device_train_batch_size": 4, "learning_rate": 0.1}

    def scenario(m: str, out: Path) -> dict[str, Any]:
        return run_and_resume(m, out, (5,), freeze_a=True, **kwargs)

    result = native_run("frozen", lambda d: scenario("native", d)) if mode == "native" else scenario(mode, tmp_path)
    check_against_native(mode, native_run, "frozen", result, lambda d: scenario("native", d))


@pytest.mark.parametrize("mode", MODES)
def test_resume_training_with_shard_checkpoint(mode: str, tmp_path: Path, native_run: Any) -> None:
    kwargs = {"train_len": 128, "learning_rate": 0.1}

    def scenario(m: str, out: Path) -> dict[str, Any]:
        trainer = regression_trainer(m, out, **kwargs)
        trainer.train()
        ref, state = params_of(trainer.model), state_of(trainer)
        if m == "native":
            convert_to_sharded_checkpoint(out / "checkpoint-5")
        else:
            # The store keeps one weights file per checkpoint: it must hold every key of the model.
            assert sorted(stored_weights(store_root(out), 5)) == sorted(trainer.model.state_dict())
        trainer = regression_trainer(m, out, **kwargs)
        trainer.train(resume_from_checkpoint=resume_arg(m, trainer, out, 5))
        assert_params_equal(ref, trainer.model)
        state1 = state_of(trainer)
        assert_states_equal(state, state1)
        return {"state": state, "resumed": [state1]}

    result = native_run("shard", lambda d: scenario("native", d)) if mode == "native" else scenario(mode, tmp_path)
    check_against_native(mode, native_run, "shard", result, lambda d: scenario("native", d))


# ---------------------------------------------------------------------- different batch size
@pytest.mark.parametrize("mode", MODES)
def test_resume_training_with_different_batch_size(mode: str, tmp_path: Path) -> None:
    # Upstream (transformers#43708): without auto_find_batch_size the new batch size is used.
    train = RegressionDataset(length=64)
    model = RegressionRandomPreTrainedModel(RegressionConfig(a=0, b=2))
    args = TrainingArguments(**mode_args(mode, tmp_path, 1, max_steps=2, per_device_train_batch_size=2,
                                         auto_find_batch_size=False))
    Trainer(model, args, train_dataset=train, callbacks=mode_callbacks(mode, tmp_path, 1)).train()
    # The checkpoint records the effective batch size of the run that wrote it.
    saved = (native_trainer_state(tmp_path / "checkpoint-1") if mode == "native"
             else stored_trainer_state(store_root(tmp_path), 1))
    assert saved["train_batch_size"] == args.train_batch_size == 2
    args2 = TrainingArguments(**mode_args(mode, tmp_path, 1, max_steps=4, per_device_train_batch_size=4,
                                          auto_find_batch_size=False))
    trainer2 = Trainer(model, args2, train_dataset=train, callbacks=mode_callbacks(mode, tmp_path, 1))
    trainer2.train(resume_from_checkpoint=resume_arg(mode, trainer2, tmp_path, 1))
    assert trainer2._train_batch_size == 4 * max(trainer2.args.n_gpu, 1)
    assert trainer2.state.global_step == 4


# ---------------------------------------------------------------------- randomness
@pytest.mark.parametrize("every", ["step", "epoch"])
@pytest.mark.parametrize("mode", MODES)
def test_resume_training_with_randomness(mode: str, every: str, tmp_path: Path) -> None:
    # Noise from torch, NumPy and `random` in every forward: only a restored RNG reproduces it.
    # 128 rows / batch 8: 16 steps per epoch. "step": save every 5, resume from 15; "epoch": save
    # at each epoch end, resume from the first (upstream picks the smallest checkpoint-N).
    train, evaluation = RegressionDataset(length=128), RegressionDataset()
    config = RegressionConfig(a=0, b=2, random_torch=True)
    interval, step = (5, 15) if every == "step" else (16, 16)
    extra = {"save_strategy": "epoch"} if (every == "epoch" and mode == "native") else {}

    def make() -> Trainer:
        args = TrainingArguments(**mode_args(mode, tmp_path, interval, learning_rate=0.1, **extra))
        return Trainer(RegressionRandomPreTrainedModel(config), args, train_dataset=train, eval_dataset=evaluation,
                       callbacks=mode_callbacks(mode, tmp_path, interval))

    trainer = make()
    trainer.train()
    a, b = trainer.model.a.item(), trainer.model.b.item()
    if mode == "native" and every == "epoch":
        assert sorted(int(p.split("-")[1]) for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == [16, 32, 48]
    trainer = make()
    trainer.train(resume_from_checkpoint=resume_arg(mode, trainer, tmp_path, step))
    assert trainer.model.a.item() == pytest.approx(a, abs=1e-5)
    assert trainer.model.b.item() == pytest.approx(b, abs=1e-5)

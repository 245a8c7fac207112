"""Checkpoint rotation next to the smart store, and best-model tracking across a resume.

Ported from transformers' `tests/trainer/test_trainer_checkpointing.py` (commit
abee4b14abf32637fe72990d0c409eaba189b31a, see conformance_utils):

- `TrainerCheckpointRotationTest.test_checkpoint_rotation`: `rotate_checkpoints` keeps the
  newest `save_total_limit` checkpoints, plus the best one with `load_best_model_at_end`.
  Here it runs on an output directory that also holds a library store with real
  checkpoints, which must come out untouched; then both kinds of saving run in one Trainer
  and each one's retention must leave the other's checkpoints alone.
- `TrainerBestModelTest` (`test_load_best_model_at_end`, `test_best_model_checkpoint_behavior`
  with scripted metrics as in its cases 5 and 6): evaluation at the save steps,
  `metric_for_best_model="accuracy"`, `load_best_model_at_end=True`, and a resume from the
  step whose evaluation is the best one. The resumed run must end with the same
  `best_metric`, `best_global_step` and `best_model_checkpoint` and load the same best model.
  In library mode Trainer still writes its own checkpoints (`load_best_model_at_end` needs
  them); the library's store must hold the best step with the same weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_utils import (
    MODES,
    assert_params_equal,
    assert_same_across_modes,
    assert_states_equal,
    native_weights,
    open_store,
    params_of,
    regression_trainer,
    resume_arg,
    smart_config,
    state_of,
    store_root,
    store_steps,
    stored_weights,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_dynamic_ckpt import SmartCkptCallback

pytestmark = pytest.mark.integration


def native_steps(out: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in os.listdir(out) if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", p)))


def store_snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the store, by relative path (the catalog and timeline included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def assert_store_intact(root: Path, steps: list[int]) -> None:
    assert store_steps(root) == steps
    store = open_store(root)
    try:
        assert {s: store.verify(f"step:{s}") for s in steps} == {s: [] for s in steps}
    finally:
        store.close()


# ---------------------------------------------------------------------- rotation
def test_rotate_checkpoints_leaves_the_smart_store_alone(tmp_path: Path) -> None:
    trainer = regression_trainer("library", tmp_path, max_steps=10)
    trainer.train()
    root = store_root(tmp_path)
    before = store_snapshot(root)
    assert store_steps(root) == [5, 10]

    def check_deletion(save_total_limit: int, best: int | None, expected: list[int]) -> None:
        # Upstream's check_checkpoint_deletion: fake checkpoints 5..25, rotate, compare.
        for n in (5, 10, 15, 20, 25):
            (tmp_path / f"{PREFIX_CHECKPOINT_DIR}-{n}").mkdir(exist_ok=True)
        best_dir = None if best is None else str(tmp_path / f"{PREFIX_CHECKPOINT_DIR}-{best}")
        rotate_checkpoints(output_dir=str(tmp_path), save_total_limit=save_total_limit, best_model_checkpoint=best_dir)
        assert native_steps(tmp_path) == expected
        assert store_snapshot(root) == before

    check_deletion(2, None, [20, 25])
    check_deletion(2, 5, [5, 25])
    check_deletion(1, 25, [25])
    check_deletion(1, 5, [5, 25])
    assert_store_intact(root, [5, 10])


def test_save_total_limit_and_store_retention_do_not_cross(tmp_path: Path) -> None:
    # Trainer rotates to 2 of its checkpoints; the store keeps all of its own.
    out = tmp_path / "trainer_rotates"
    kwargs = {"max_steps": 25, "learning_rate": 0.1, "logging_steps": 5}
    trainer = regression_trainer("native", out, save_total_limit=2, **kwargs,
                                 callbacks=[SmartCkptCallback(smart_config(store_root(out), 5))])
    trainer.train()
    ref = params_of(trainer.model)
    assert native_steps(out) == [20, 25]
    assert_store_intact(store_root(out), [5, 10, 15, 20, 25])
    # A step Trainer rotated away is still a restore point of the store, and resumes exactly.
    trainer = regression_trainer("library", out, **kwargs)
    trainer.train(resume_from_checkpoint=resume_arg("library", trainer, out, 5))
    assert_params_equal(ref, trainer.model)

    # The store's retention keeps 2; Trainer keeps every checkpoint of its own.
    out = tmp_path / "store_rotates"
    trainer = regression_trainer("native", out, **kwargs, callbacks=[
        SmartCkptCallback(smart_config(store_root(out), 5, keep_last=2, policy={"keep_log_spaced": False}))])
    trainer.train()
    assert native_steps(out) == [5, 10, 15, 20, 25]
    assert all((out / f"checkpoint-{s}" / "model.safetensors").is_file() for s in native_steps(out))
    assert_store_intact(store_root(out), [20, 25])


# ---------------------------------------------------------------------- best model
SCRIPTED_ACCURACY = {5: 0.8, 10: 0.9, 15: 0.7, 20: 0.6}  # the best evaluation is at step 10


class ScriptedAccuracy:
    """`compute_metrics` whose accuracy depends only on the step (as upstream's scripted `_evaluate`).

    Unlike patching `_evaluate`, Trainer still logs each evaluation into `log_history`.
    """

    def __init__(self) -> None:
        self.trainer: Any = None

    def __call__(self, eval_pred: Any) -> dict[str, float]:
        return {"accuracy": SCRIPTED_ACCURACY[self.trainer.state.global_step]}


BEST_ARGS = {"a": 1.5, "b": 2.5, "learning_rate": 0.1, "max_steps": 20, "logging_steps": 5, "eval_strategy": "steps",
             "eval_steps": 5, "save_strategy": "steps", "save_steps": 5, "load_best_model_at_end": True,
             "metric_for_best_model": "accuracy"}


def best_trainer(mode: str, out: Path) -> Any:
    metric = ScriptedAccuracy()
    callbacks = [SmartCkptCallback(smart_config(store_root(out), 5))] if mode == "library" else []
    trainer = regression_trainer("native", out, compute_metrics=metric, callbacks=callbacks, **BEST_ARGS)
    metric.trainer = trainer
    return trainer


def best_scenario(mode: str, out: Path) -> dict[str, Any]:
    trainer = best_trainer(mode, out)
    assert trainer.args.greater_is_better
    trainer.train()
    ref, state = params_of(trainer.model), state_of(trainer)
    best_dir = str(out / f"{PREFIX_CHECKPOINT_DIR}-10")
    assert (state["best_metric"], state["best_global_step"], state["best_model_checkpoint"]) == (0.9, 10, best_dir)
    # load_best_model_at_end loaded checkpoint-10.
    assert all(torch.equal(v, native_weights(out / "checkpoint-10")[k]) for k, v in trainer.model.state_dict().items())

    trainer = best_trainer(mode, out)
    trainer.train(resume_from_checkpoint=resume_arg(mode, trainer, out, 10))
    state1 = state_of(trainer)
    assert (state1["best_metric"], state1["best_global_step"], state1["best_model_checkpoint"]) == (0.9, 10, best_dir)
    assert_params_equal(ref, trainer.model)
    assert_states_equal(state, state1)
    if mode == "library":
        # The best step is a restore point of the store, holding the best model's weights.
        stored = stored_weights(store_root(out), 10)
        assert all(torch.equal(stored[k], v) for k, v in native_weights(out / "checkpoint-10").items())
    return {"state": state, "resumed": state1}


@pytest.mark.parametrize("mode", MODES)
def test_best_model_at_end_across_resume(mode: str, tmp_path: Path, native_run: Any) -> None:
    result = (native_run("best", lambda d: best_scenario("native", d)) if mode == "native"
              else best_scenario(mode, tmp_path))
    if mode == "library":
        native = native_run("best", lambda d: best_scenario("native", d))
        for key in ("state", "resumed"):
            assert_same_across_modes(native[key], result[key])
            assert (os.path.basename(result[key]["best_model_checkpoint"])
                    == os.path.basename(native[key]["best_model_checkpoint"]))


def test_best_metric_with_library_saves_only(tmp_path: Path, native_run: Any) -> None:
    # Without Trainer's own saves there is no best_model_checkpoint; the best checkpoint is a store
    # step: the resumed run must know the same best metric, evaluated at the step the native run
    # records as best_global_step, and the store must hold that step.
    args = {k: v for k, v in BEST_ARGS.items() if k not in ("save_strategy", "save_steps", "load_best_model_at_end")}
    metric = ScriptedAccuracy()
    trainer = regression_trainer("library", tmp_path, compute_metrics=metric, **args)
    metric.trainer = trainer
    trainer.train()
    state = state_of(trainer)

    metric = ScriptedAccuracy()
    trainer = regression_trainer("library", tmp_path, compute_metrics=metric, **args)
    metric.trainer = trainer
    trainer.train(resume_from_checkpoint=resume_arg("library", trainer, tmp_path, 10))
    state1 = state_of(trainer)
    assert_states_equal(state, state1)

    native = native_run("best", lambda d: best_scenario("native", d))["resumed"]
    assert state1["best_metric"] == native["best_metric"] == 0.9
    best_steps = [e["step"] for e in state1["log_history"] if e.get("eval_accuracy") == state1["best_metric"]]
    assert best_steps == [native["best_global_step"]] == [10]
    assert 10 in store_steps(store_root(tmp_path))

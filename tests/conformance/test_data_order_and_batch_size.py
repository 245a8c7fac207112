"""Upstream's data-order and batch-size resume tests, natively and through the library.

Ported from transformers' `tests/trainer/test_trainer_checkpointing.py` (commit
abee4b14abf32637fe72990d0c409eaba189b31a, see conformance_utils):

- `TrainerInterruptedTrainingTest.test_resume_batch_order`: a model that records the index of
  every example it sees in a growing buffer; 3 epochs of 5 steps, a save every step; a second
  run in its own output directory resumes from checkpoint 6 (mid epoch 2) and must end with
  the same record as the uninterrupted run. In library mode the second run resumes from the
  first run's store by checkpoint path (`resume_checkpoint(trainer, <path>)`), and the
  record is read from each store's checkpoint of the last step.
- `TrainerAutoBatchSizeTest.test_auto_batch_size_with_resume_from_checkpoint`: with
  `auto_find_batch_size=True`, a simulated CUDA OOM at the end of the first step at batch
  size 16 makes Trainer retry with a smaller batch; a new Trainer resuming from the last
  checkpoint must pick that smaller batch size up. In library mode the stored checkpoints
  must also be the retry's: same batch size in their `trainer_state`,
  same weights as Trainer's own checkpoint of that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_utils import (
    MODES,
    MockCudaOOMCallback,
    RegressionConfig,
    RegressionDataset,
    RegressionRandomPreTrainedModel,
    mode_args,
    mode_callbacks,
    native_trainer_state,
    native_weights,
    open_store,
    store_root,
    store_steps,
    stored_trainer_state,
    stored_weights,
)
from torch import nn
from transformers import Trainer, TrainingArguments

from hf_dynamic_ckpt import resume_checkpoint

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------- test_resume_batch_order
class IndexedDataset(torch.utils.data.Dataset):
    """`size` random rows whose first feature is the row index (the order becomes observable)."""

    def __init__(self, size: int = 10) -> None:
        gen = torch.Generator().manual_seed(42)
        self.data = torch.randn((size, 10), generator=gen)
        self.data[:, 0] = torch.arange(0, size)
        self.labels = torch.randint(0, 10, (size,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[idx], "labels": self.labels[idx]}


class OrderRecordingModel(nn.Module):
    """A linear layer plus a buffer that grows by the indices of every batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(42)
            self.fc = nn.Linear(10, 10, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        # The saved record is longer than a fresh model's empty one: take its size (as upstream).
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.fc(input_ids)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        self.data_order = torch.cat([self.data_order, input_ids[:, 0].int().detach().clone()])
        return {"loss": loss, "logits": logits}


ORDER_ARGS = {"seed": 42, "learning_rate": 0.1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
              "num_train_epochs": 3, "optim": "sgd", "dataloader_num_workers": 0}


def order_trainer(mode: str, out: Path) -> Trainer:
    args = TrainingArguments(**mode_args(mode, out, 1, **ORDER_ARGS))
    return Trainer(model=OrderRecordingModel(), args=args, train_dataset=IndexedDataset(10),
                   callbacks=mode_callbacks(mode, out, 1))


def final_order(mode: str, out: Path, step: int) -> torch.Tensor:
    weights = native_weights(out / f"checkpoint-{step}") if mode == "native" else stored_weights(store_root(out), step)
    return weights["data_order"]


@pytest.mark.parametrize("mode", MODES)
def test_resume_batch_order(mode: str, tmp_path: Path) -> None:
    baseline_dir, resume_dir = tmp_path / "baseline", tmp_path / "resume"
    order_trainer(mode, baseline_dir).train()
    last = 15  # 10 rows / batch 2 = 5 steps per epoch, 3 epochs
    baseline = final_order(mode, baseline_dir, last)
    assert len(baseline) == 30

    trainer = order_trainer(mode, resume_dir)
    if mode == "native":
        source = str(baseline_dir / "checkpoint-6")
    else:
        store = open_store(store_root(baseline_dir))
        try:
            path = store.resolve("step:6").path
        finally:
            store.close()
        source = resume_checkpoint(trainer, path)
    trainer.train(resume_from_checkpoint=source)
    resumed = final_order(mode, resume_dir, last)
    assert torch.equal(baseline, resumed), f"data order after resume: {resumed.tolist()} vs {baseline.tolist()}"


# ---------------------------------------------------------------------- auto batch size
def auto_batch_scenario(mode: str, out: Path) -> dict[str, Any]:
    train = RegressionDataset(length=128)
    model = RegressionRandomPreTrainedModel(RegressionConfig(a=0, b=2))
    args = TrainingArguments(**mode_args(mode, out, 1, max_steps=2, per_device_train_batch_size=16,
                                         auto_find_batch_size=True))
    trainer = Trainer(model, args, train_dataset=train,
                      callbacks=[*mode_callbacks(mode, out, 1), MockCudaOOMCallback()])
    trainer.train()
    previous = trainer._train_batch_size
    assert previous < 16  # depends on the device count upstream; the retry's size
    if mode == "native":
        saved = {s: native_trainer_state(out / f"checkpoint-{s}") for s in (1, 2)}
        weights1 = native_weights(out / "checkpoint-1")
    else:
        assert store_steps(store_root(out)) == [1, 2]
        saved = {s: stored_trainer_state(store_root(out), s) for s in (1, 2)}
        weights1 = stored_weights(store_root(out), 1)
    # Every checkpoint the run leaves is the retry's, not the OOM attempt's.
    assert {s: st["train_batch_size"] for s, st in saved.items()} == {1: previous, 2: previous}

    trainer = Trainer(model, args, train_dataset=train, callbacks=mode_callbacks(mode, out, 1))
    assert trainer._train_batch_size == 16 * max(trainer.args.n_gpu, 1)
    source = True if mode == "native" else resume_checkpoint(trainer, "auto")
    trainer.train(resume_from_checkpoint=source)
    assert trainer._train_batch_size == previous
    return {"batch_size": previous, "weights1": weights1}


@pytest.mark.parametrize("mode", MODES)
def test_auto_batch_size_with_resume_from_checkpoint(mode: str, tmp_path: Path, native_run: Any) -> None:
    result = (native_run("auto_batch", lambda d: auto_batch_scenario("native", d)) if mode == "native"
              else auto_batch_scenario(mode, tmp_path))
    if mode == "library":
        native = native_run("auto_batch", lambda d: auto_batch_scenario("native", d))
        assert result["batch_size"] == native["batch_size"]
        # The store's step 1 holds the weights Trainer's own checkpoint-1 holds (the retry's step 1).
        assert sorted(result["weights1"]) == sorted(native["weights1"])
        assert all(torch.equal(result["weights1"][k], native["weights1"][k]) for k in native["weights1"])

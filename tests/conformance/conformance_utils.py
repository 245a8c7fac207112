"""Shared pieces of the conformance suite: transformers' own resume scenarios, run twice.

Ported from transformers' test suite, `tests/trainer/test_trainer_checkpointing.py` and the
helpers of `tests/trainer/trainer_test_utils.py`, commit
`abee4b14abf32637fe72990d0c409eaba189b31a` of huggingface/transformers. That is the stored
version of `test_trainer_checkpointing.py` closest to the pinned release 5.23.0: it uses only
APIs the installed 5.23.0 has (`rotate_checkpoints`, `evaluate_side_effect_factory`,
`get_steps_per_epoch`, `trainer_jit_checkpoint`), while the newer stored version
(`22c22fa26f5f3352d243bc358f0947af05b1d61b`) also tests Hub buckets (`push_to_bucket`), which
5.23.0 does not have. The resume tests are the same in both. The helpers were read at
`2d754248977f8e25edd8cd4d6d272e86f362d4a5` of `trainer_test_utils.py`.

The models, datasets and checks below are re-implementations of upstream's, with the same
semantics: `RegressionDataset` (y = a x + b + noise, 64 rows by default), the regression
model with two scalar parameters `a` and `b` (a `PreTrainedModel` and a plain `nn.Module`),
its random variant (noise from torch, NumPy and `random` in the forward), `AlmostAccuracy`,
`MockCudaOOMCallback` (raises "CUDA out of memory." at the end of a step while the batch size
is >= 16) and `check_trainer_state_are_the_same` (here `assert_states_equal`).

Every scenario runs in two modes:

- `native`: Trainer's own checkpoints (`save_steps=k`, `resume_from_checkpoint=<output_dir>/checkpoint-N`);
- `library`: `callbacks=[SmartCkptCallback(SmartCkptConfig(base_interval=k, root=...))]` with
  `save_strategy="no"`, and `resume_from_checkpoint=resume_checkpoint(trainer, "step:N")`.

Two settings differ from `SmartCkptConfig()` in library mode, neither about what is compared:
`keep_last=1000`, the counterpart of Trainer's default `save_total_limit=None` (upstream resumes
from checkpoint-5 after the run that wrote checkpoint-45), and `engine="sync"` (one writer
process per Trainer would keep ~200 MiB alive per Trainer in this pytest process; the default
process engine is exercised by `test_can_resume_training`).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
from hf_dynamic_ckpt.store import CheckpointStore

MODES = ("native", "library")
UPSTREAM_COMMIT = "abee4b14abf32637fe72990d0c409eaba189b31a"
# Log keys that legitimately differ between an uninterrupted and a resumed run. The train_*
# ones are upstream's (check_trainer_state_are_the_same); the eval_* timings are the same kind
# of number for evaluation logs (upstream compares states only in tests without evaluation);
# `smart_ckpt/*` are the callback's own per-process metrics (saves taken by this process,
# blocking ms since the last log, current interval).
SKIP_LOG_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
                 "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
SMART_PREFIX = "smart_ckpt/"
# The TrainerState fields a resumed run must share with the uninterrupted run in either mode
# (save_steps and stateful_callbacks describe the arguments, which differ between the modes).
CROSS_MODE_FIELDS = ("global_step", "epoch", "max_steps", "num_train_epochs", "train_batch_size",
                     "logging_steps", "eval_steps", "total_flos", "num_input_tokens_seen",
                     "best_metric", "best_global_step")


# ---------------------------------------------------------------------- models and data
class RegressionConfig(PreTrainedConfig):
    model_type = "conformance-regression"

    def __init__(self, a: float = 0.0, b: float = 0.0, random_torch: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a, self.b, self.random_torch = a, b, random_torch
        self.hidden_size = 1


def _regression_loss(y: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


class RegressionPreTrainedModel(PreTrainedModel):
    """`y = a * x + b` as a `PreTrainedModel` (upstream's `RegressionPreTrainedModel`)."""

    config_class = RegressionConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.as_tensor(config.a).float())
        self.b = nn.Parameter(torch.as_tensor(config.b).float())
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return _regression_loss(input_x * self.a + self.b, labels)


class RegressionModel(nn.Module):
    """The same model as a plain `nn.Module` (upstream's `pretrained=False`)."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a).float())
        self.b = nn.Parameter(torch.tensor(b).float())
        self.config = None

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return _regression_loss(input_x * self.a + self.b, labels)


class RegressionRandomPreTrainedModel(RegressionPreTrainedModel):
    """Adds noise drawn from torch, NumPy and `random` to every forward (`_with_randomness`)."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        y = input_x * self.a + self.b
        if self.config.random_torch:
            y = y + 0.05 * torch.randn(1).squeeze()
        y = y + 0.05 * torch.tensor(np.random.rand() + random.random())
        return _regression_loss(y, labels)


class RegressionDataset:
    """`length` rows of `x ~ N(0, 1)`, `labels = a x + b + N(0, 0.1)`; depends only on its arguments."""

    def __init__(self, a: float = 2.0, b: float = 3.0, length: int = 64, seed: int = 42) -> None:
        rng = np.random.RandomState(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_x": self.x[i], "labels": self.y[i]}


class AlmostAccuracy:
    """Fraction of predictions within `thresh` of the label (upstream's metric)."""

    def __init__(self, thresh: float = 0.25) -> None:
        self.thresh = thresh

    def __call__(self, eval_pred: Any) -> dict[str, float]:
        predictions, labels = eval_pred
        return {"accuracy": float((np.abs(predictions - labels) <= self.thresh).astype(np.float32).mean())}


class MockCudaOOMCallback(TrainerCallback):
    """Raise the CUDA OOM message at the end of a step while the batch size is >= `limit`."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


# ---------------------------------------------------------------------- trainers per mode
def smart_config(root: Path, interval: int, **overrides: Any) -> SmartCkptConfig:
    """The library-mode config: `base_interval=interval` at `root` (see the module docstring)."""
    kw: dict[str, Any] = {"base_interval": interval, "root": str(root), "keep_last": 1000, "engine": "sync"}
    kw.update(overrides)
    return SmartCkptConfig(**kw)


def mode_args(mode: str, out: Path, interval: int, **args: Any) -> dict[str, Any]:
    """TrainingArguments keywords of `mode`: Trainer saves every `interval` steps, or the library does."""
    base: dict[str, Any] = {"output_dir": str(out), "use_cpu": True, "report_to": [], "disable_tqdm": True}
    if mode == "native":
        base["save_steps"] = interval
    else:
        base["save_strategy"] = "no"
    base.update(args)
    return base


def mode_callbacks(mode: str, out: Path, interval: int, **config: Any) -> list[TrainerCallback]:
    return [] if mode == "native" else [SmartCkptCallback(smart_config(store_root(out), interval, **config))]


def store_root(out: Path) -> Path:
    return Path(out) / "smart_ckpt"


def regression_trainer(mode: str, out: Path, *, interval: int = 5, a: float = 0.0, b: float = 0.0,
                       train_len: int = 64, eval_len: int = 64, pretrained: bool = True,
                       model: nn.Module | None = None, callbacks: Iterable[TrainerCallback] = (),
                       compute_metrics: Callable[..., dict[str, float]] | None = None,
                       config: dict[str, Any] | None = None, **args: Any) -> Trainer:
    """Upstream's `get_regression_trainer` for one mode (a fresh model unless `model` is given)."""
    if model is None:
        model = RegressionPreTrainedModel(RegressionConfig(a=a, b=b)) if pretrained else RegressionModel(a, b)
    trainer = Trainer(
        model, TrainingArguments(**mode_args(mode, out, interval, **args)),
        train_dataset=RegressionDataset(length=train_len), eval_dataset=RegressionDataset(length=eval_len),
        compute_metrics=compute_metrics,
        callbacks=[*mode_callbacks(mode, out, interval, **(config or {})), *callbacks],
    )
    trainer.model_accepts_loss_kwargs = False  # as upstream: the regression loss takes no item count
    return trainer


def resume_arg(mode: str, trainer: Trainer, out: Path, step: int) -> str | None:
    """What `trainer.train(resume_from_checkpoint=...)` gets to resume from `step` in `mode`."""
    if mode == "native":
        return os.path.join(out, f"checkpoint-{step}")
    return resume_checkpoint(trainer, f"step:{step}")


# ---------------------------------------------------------------------- state checks
def clean_logs(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Log entries without the keys that differ legitimately and without NaN values (as upstream)."""
    out = []
    for entry in log_history:
        kept = {k: v for k, v in entry.items()
                if k not in SKIP_LOG_KEYS and not k.startswith(SMART_PREFIX) and v == v}
        out.append(kept)
    return out


def assert_states_equal(state: dict[str, Any], state1: dict[str, Any]) -> None:
    """Upstream's `check_trainer_state_are_the_same`, with the same number of log entries required.

    Upstream zips the two histories; a missing entry there shifts the pairs and fails on the
    first shifted pair. Comparing the lists gives the same verdict with a readable diff.
    """
    rest = {k: v for k, v in state.items() if k != "log_history"}
    rest1 = {k: v for k, v in state1.items() if k != "log_history"}
    assert rest == rest1
    assert clean_logs(state["log_history"]) == clean_logs(state1["log_history"])


def assert_same_across_modes(native: dict[str, Any], library: dict[str, Any]) -> None:
    """The TrainerState a library run ends with is the one a native run ends with."""
    assert {k: library[k] for k in CROSS_MODE_FIELDS} == {k: native[k] for k in CROSS_MODE_FIELDS}
    assert clean_logs(library["log_history"]) == clean_logs(native["log_history"])


def state_of(trainer: Trainer) -> dict[str, Any]:
    return dataclasses.asdict(trainer.state)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_params_equal(expected: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Every named parameter bit-equal (upstream compares `a`/`b` with assertEqual on floats)."""
    got = params_of(model)
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert different == [], f"parameters differ after resume: {different}"


def writer_processes() -> set[int]:
    """Pids of the live child processes that are the library's background writers."""
    return {p.pid for p in multiprocessing.active_children() if p.name == "hf-dynamic-ckpt-writer" and p.pid}


# ---------------------------------------------------------------------- store access
def open_store(root: Path) -> CheckpointStore:
    """A reader of the library's store (no writer lock, no cleanup)."""
    return CheckpointStore(root, cleanup=False)


def store_steps(root: Path) -> list[int]:
    store = open_store(root)
    try:
        return sorted(i.step for i in store.list(include_unhealthy=True))
    finally:
        store.close()


def stored_trainer_state(root: Path, step: int) -> dict[str, Any]:
    """The `TrainerState` dict the library stored with checkpoint `step`."""
    store = open_store(root)
    try:
        loaded = store.load(f"step:{step}", tiers=[], rank=0)
        return dict(loaded.extra["trainer_state"])
    finally:
        store.close()


def stored_weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    from hf_dynamic_ckpt.constants import Tier

    store = open_store(root)
    try:
        weights = store.load(f"step:{step}", tiers=[Tier.WEIGHTS], rank=0).weights
        assert weights is not None
        return {k: v.clone() for k, v in weights.items()}
    finally:
        store.close()


def native_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(Path(checkpoint) / "model.safetensors"))


def native_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def convert_to_sharded_checkpoint(folder: Path) -> None:
    """Upstream's `convert_to_sharded_checkpoint`: one safetensors shard per key plus an index."""
    weights_file = Path(folder) / "model.safetensors"
    state_dict = safetensors.torch.load_file(str(weights_file))
    weights_file.unlink()
    keys = list(state_dict)
    shards = [f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors" for i in range(len(keys))]
    index = {"metadata": {}, "weight_map": dict(zip(keys, shards))}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for key, shard in zip(keys, shards):
        safetensors.torch.save_file({key: state_dict[key]}, str(Path(folder) / shard))

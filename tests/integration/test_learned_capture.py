"""The learned double-check end to end: an early save the model asks for is a pinned,
healthy checkpoint of the state *before* the step's update (with that boundary's RNG and data
position), and resuming from it replays the run bit for bit.

A hand-made model file (zero LSTM weights, save_score 0.9) asks for a save at every step; the
capture cooldown (3) spaces them: the states of steps 0, 3 and 6 are saved, at steps 1, 4, 7.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from examples import toy
from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig
from hf_dynamic_ckpt.policy.learned import FEATURE_NAMES, MODEL_FORMAT, MODEL_VERSION

pytestmark = pytest.mark.integration


def always_save(path: Path, score: float = 0.9) -> str:
    n, h = len(FEATURE_NAMES), 32
    t = {f"lstm.{kind}_l{i}": np.zeros(shape, np.float32) for i in range(2) for kind, shape in (
        ("weight_ih", (4 * h, n if i == 0 else h)), ("weight_hh", (4 * h, h)), ("bias_ih", (4 * h,)),
        ("bias_hh", (4 * h,)))}
    t |= {"score.weight": np.zeros((1, h), np.float32),
          "score.bias": np.full(1, math.log(score / (1 - score)), np.float32),
          "granularity.weight": np.zeros((4, h), np.float32), "granularity.bias": np.array([5, 0, 0, 0], np.float32),
          "features.mean": np.zeros(n, np.float32), "features.std": np.ones(n, np.float32)}
    save_file(t, str(path),
              metadata={"format": MODEL_FORMAT, "version": MODEL_VERSION, "features": ",".join(FEATURE_NAMES)})
    return str(path)


def train(root: Path, *, steps: int, learned: str | None = None, resume: str | None = None) -> dict[int, str]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32), r=2, dropout=0.1)
    data = toy.random_token_dataset(num_examples=16, seq_len=6, vocab_size=64, seed=2).with_format("torch")
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    config = SmartCkptConfig(root=str(root), base_interval=100, keep_last=50, engine="sync",
                             policy={"learned_model": learned, "capture_cooldown": 3})
    losses: dict[int, str] = {}
    with SmartCheckpointer(accelerator, model, opt, dataloader=dl, config=config) as ckpt:
        ckpt.resume(resume)
        while ckpt.step < steps:
            for batch in ckpt.loader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                ckpt.before_update()
                opt.step()
                opt.zero_grad()
                ckpt.after_update()
                losses[ckpt.step] = float(loss.detach()).hex()
                if ckpt.step >= steps:
                    break
    return losses


def test_a_learned_early_save_is_a_pre_update_capture_that_resumes_exactly(tmp_path: Path) -> None:
    reference = train(tmp_path / "ref", steps=9)
    learned = train(tmp_path / "run", steps=9, learned=always_save(tmp_path / "always.safetensors"))
    assert learned == reference  # the model only decides saves: training itself is untouched
    task = tmp_path / "run" / "default"
    manifests = {int(p.name[5:]): json.loads((p / "manifest.json").read_text()) for p in task.glob("step-*")
                 if "." not in p.name}
    assert sorted(manifests) == [0, 3, 6]  # the early saves; nothing else is due (base_interval 100)
    for step in (0, 3, 6):
        m = manifests[step]
        assert m["reason"] == "learned save_score 0.90, granularity everything", m["reason"]
        assert (m["pinned"], m["healthy"], sorted(m["tiers"])) == (True, True, ["optimizer", "state", "weights"])
    resumed = train(tmp_path / "run", steps=9, resume="step:3")
    assert resumed == {s: v for s, v in reference.items() if s > 3}

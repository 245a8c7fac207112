"""Trainer runs with the trainable state consolidated (`state.flat`): the same losses, the
same checkpoint content and a bit-exact kill/resume as without (2-process DDP: tests/distributed/test_flat_ddp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_resume import assert_exact, run_worker

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.store import CheckpointStore

pytestmark = pytest.mark.integration

LORA = ("--model", "lora", "--max_steps", "8", "--ga", "2", "--base_interval", "5")


def _store_content(run: Path, step: int, *, nested: bool = True) -> tuple[dict[str, torch.Tensor], list[torch.Tensor],
                                                                          bytes]:
    """Step `step`'s L0 tensors, L1 tensors (walk order) and L0 file bytes, from the store of a run."""
    from hf_dynamic_ckpt.engine.live import tensors_in

    root = run / "run" / "smart_ckpt" if nested else run
    with CheckpointStore(root, read_only=True) as store:
        loaded = store.load(f"step:{step}", tiers={Tier.WEIGHTS, Tier.OPTIMIZER})
    weights = (root / "default" / f"step-{step}" / "weights.safetensors").read_bytes()
    return dict(loaded.weights), tensors_in(loaded.optimizer, []), weights


def test_lora_kill_and_resume_with_consolidation_matches_a_plain_run(tmp_path: Path) -> None:
    ref = run_worker(tmp_path / "ref", "ref", *LORA, "--consolidate", "off")
    crash = run_worker(tmp_path / "crash", "crash", *LORA, "--consolidate", "on", "--kill_at", "6", expect_rc=-9)
    resumed = run_worker(tmp_path / "crash", "resume", *LORA, "--consolidate", "on", "--resume", "auto")
    # Consolidated runs train exactly as the plain one, and resume from step 5 bit for bit.
    assert_exact(ref, crash, resumed, expect_step=5, ga=2)
    assert ref["flat"] is None
    assert crash["flat"] == {"moves": 1, "intact": True, "params": 8, "state_tensors": 24}
    # The resume's optimizer.load_state_dict replaced the state: moved (once) after it, still in place at the end.
    assert resumed["flat"] == {"moves": 1, "intact": True, "params": 8, "state_tensors": 24}
    # The checkpoint of step 5 holds the same tensors, and the same L0 file bytes, as the plain run's.
    plain_w, plain_o, plain_file = _store_content(tmp_path / "ref", 5)
    flat_w, flat_o, flat_file = _store_content(tmp_path / "crash", 5)
    assert list(plain_w) == list(flat_w) and all(torch.equal(plain_w[k], flat_w[k]) for k in plain_w)
    assert len(plain_o) == len(flat_o) and all(torch.equal(a, b) for a, b in zip(plain_o, flat_o))
    assert plain_file == flat_file


def _accelerate_loop(root: Path, *, steps: int, consolidate: bool, resume: str | None = None):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from examples import toy
    from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32), r=2)
    data = toy.random_token_dataset(num_examples=12, seq_len=6, vocab_size=64, seed=2).with_format("torch")
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    config = SmartCkptConfig(root=str(root), base_interval=2, keep_last=50, engine="sync",
                             policy={"overhead_budget": 1.0})
    ckpt = SmartCheckpointer(accelerator, model, opt, dataloader=dl, config=config, consolidate=consolidate)
    ckpt.resume(resume)
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    while ckpt.step < steps:
        for batch in ckpt.loader:
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            ckpt.before_update()
            opt.step()
            opt.zero_grad()
            ckpt.after_update()
            adapters[ckpt.step] = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
            if ckpt.step >= steps:
                break
    flat = ckpt.flat.state
    moves = ckpt.flat.moves
    ckpt.close()
    return adapters, flat, moves


def test_accelerate_loop_with_consolidation_trains_and_resumes_like_a_plain_one(tmp_path: Path) -> None:
    plain, none, _ = _accelerate_loop(tmp_path / "plain", steps=6, consolidate=False)
    flat, state, moves = _accelerate_loop(tmp_path / "flat", steps=6, consolidate=True)
    assert none is None and state is not None and state.intact() and moves == 1
    assert all(torch.equal(flat[s][k], v) for s in plain for k, v in plain[s].items())
    # Resume from step 4 (optimizer.load_state_dict replaces the state): moved again, the same steps 5 and 6.
    resumed, state, moves = _accelerate_loop(tmp_path / "flat", steps=6, consolidate=True, resume="step:4")
    assert sorted(resumed) == [5, 6] and state is not None and state.intact() and moves == 1
    assert all(torch.equal(resumed[s][k], plain[s][k]) for s in (5, 6) for k in plain[s])
    for step in (2, 4, 6):  # the same checkpoint content
        a, b = (_store_content(tmp_path / "plain", step, nested=False),
                _store_content(tmp_path / "flat", step, nested=False))
        assert list(a[0]) == list(b[0]) and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
        assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert a[2] == b[2]

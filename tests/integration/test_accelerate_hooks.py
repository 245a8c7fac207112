"""The Accelerate state-hook pair: save_state/load_state through the tiered store, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from examples import toy
from hf_dynamic_ckpt import SmartCkptConfig
from hf_dynamic_ckpt.constants import WEIGHTS_NAME
from hf_dynamic_ckpt.errors import CorruptCheckpointError
from hf_dynamic_ckpt.integrations.accelerate import POINTER_NAME, SmartStateHooks

pytestmark = pytest.mark.integration

BATCHES_PER_EPOCH = 5  # 10 examples, batch size 2: saves and resumes cross epoch boundaries


def _setup(lora_seed: int = 0):
    """Accelerator + tiny LoRA Qwen2 with dropout; the base weights are fixed ("pretrained"),
    `lora_seed` changes the adapter's initialisation."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=96, hidden_size=32, dropout=0.1),
                     r=4, dropout=0.1, seed=lora_seed)
    data = toy.random_token_dataset(num_examples=2 * BATCHES_PER_EPOCH, seq_len=8, vocab_size=96, seed=1)
    loader = torch.utils.data.DataLoader(data.with_format("torch"), batch_size=2, shuffle=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=30)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def _stream(epoch_iterable):
    """Batches across epochs: one `iter()` of `epoch_iterable` per epoch."""
    while True:
        yield from epoch_iterable


def _train(accelerator, model, optimizer, scheduler, batches, steps: int) -> list[float]:
    """`steps` optimizer steps taking batches from the iterator `batches`; exact losses."""
    losses: list[float] = []
    for _ in range(steps):
        loss = model(**next(batches)).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _adapter(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


@pytest.mark.parametrize("save_at", [0, 3, BATCHES_PER_EPOCH])  # before any batch, mid-epoch, at an epoch end
def test_save_load_state_round_trip_is_bit_exact(tmp_path: Path, save_at: int):
    config = SmartCkptConfig(root=str(tmp_path / "store"))
    acc, model, opt, dl, sched = _setup()
    hooks = SmartStateHooks(acc, dl, config=config)
    hooks.register()
    batches = _stream(hooks.loader)
    _train(acc, model, opt, sched, batches, save_at)
    acc.save_state(str(tmp_path / "state"))
    saved_adapter = _adapter(model)
    expected = _train(acc, model, opt, sched, batches, 7)
    expected_adapter = _adapter(model)
    hooks.close()

    # Accelerate wrote no model file; the store holds a committed adapter-only checkpoint.
    state_dir = tmp_path / "state"
    assert not (state_dir / "model.safetensors").exists()
    pointer = json.loads((state_dir / POINTER_NAME).read_text())
    assert pointer["step"] == save_at
    step_dir = Path(pointer["path"])
    assert step_dir == tmp_path / "store" / "default" / f"step-{save_at}"
    with safe_open(step_dir / WEIGHTS_NAME, "pt") as f:
        keys = set(f.keys())
        assert keys and all("lora_" in k for k in keys)
        assert all(torch.equal(f.get_tensor(k), saved_adapter[k.replace(".weight", ".default.weight")]) for k in keys)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["reason"] == "save_state" and manifest["pinned"] is True
    assert [p.name for p in (tmp_path / "store" / "default").glob("step-*")] == [f"step-{save_at}"]
    sampler = json.loads((step_dir / "sampler.json").read_text())
    # A save right after an epoch's last batch is the next epoch's start (what the uninterrupted run goes on with).
    position = (0, save_at) if save_at < BATCHES_PER_EPOCH else (1, 0)
    assert (sampler["epoch"], sampler["batches_seen"]) == position

    # A fresh run with differently initialised weights continues exactly.
    acc2, model2, opt2, dl2, sched2 = _setup(lora_seed=5)
    assert not all(torch.equal(a, b) for a, b in zip(_adapter(model2).values(), saved_adapter.values()))
    hooks2 = SmartStateHooks(acc2, dl2, config=config)
    hooks2.register()
    acc2.load_state(str(state_dir))
    assert hooks2.last_loaded is not None and hooks2.last_loaded.info.step == save_at
    assert all(torch.equal(_adapter(model2)[k], v) for k, v in saved_adapter.items())
    resumed = _train(acc2, model2, opt2, sched2, _stream(hooks2.loader), 7)
    assert resumed == expected
    assert all(torch.equal(_adapter(model2)[k], v) for k, v in expected_adapter.items())
    hooks2.close()


def test_load_state_alone_does_not_continue_exactly(tmp_path: Path):
    """Why the hooks track the position: plain load_state + skip_first_batches diverges with dropout."""
    acc, model, opt, dl, sched = _setup()
    batches = _stream(dl)
    _train(acc, model, opt, sched, batches, 3)
    acc.save_state(str(tmp_path / "plain"))
    expected = _train(acc, model, opt, sched, batches, 4)

    acc2, model2, opt2, dl2, sched2 = _setup(lora_seed=5)
    acc2.load_state(str(tmp_path / "plain"))

    def resumed_batches():
        yield from acc2.skip_first_batches(dl2, 3)
        yield from _stream(dl2)

    resumed = _train(acc2, model2, opt2, sched2, resumed_batches(), 4)
    assert resumed != expected


def test_handles_remove_cleanly(tmp_path: Path):
    acc, model, opt, dl, sched = _setup()
    hooks = SmartStateHooks(acc, dl, config=SmartCkptConfig(root=str(tmp_path / "store")))
    save_handle, load_handle = hooks.register()
    assert list(acc._save_model_state_pre_hook) == [save_handle.id]
    assert list(acc._load_model_state_pre_hook) == [load_handle.id]
    batches = _stream(hooks.loader)
    _train(acc, model, opt, sched, batches, 2)
    acc.save_state(str(tmp_path / "with"))
    hooks.remove()
    hooks.remove()  # idempotent
    assert not acc._save_model_state_pre_hook and not acc._load_model_state_pre_hook
    _train(acc, model, opt, sched, batches, 1)
    acc.save_state(str(tmp_path / "without"))
    # Without the hooks Accelerate writes its own model file and the store gets nothing new.
    assert (tmp_path / "without" / "model.safetensors").is_file()
    assert not (tmp_path / "without" / POINTER_NAME).exists()
    assert [i.step for i in hooks.store.list()] == [2]
    acc.load_state(str(tmp_path / "without"))  # Accelerate's own path still works
    assert hooks.last_loaded is None
    hooks.close()


def test_corrupt_pointer_is_reported(tmp_path: Path):
    acc, model, opt, dl, sched = _setup()
    hooks = SmartStateHooks(acc, dl, config=SmartCkptConfig(root=str(tmp_path / "store")))
    hooks.register()
    _train(acc, model, opt, sched, _stream(hooks.loader), 1)
    acc.save_state(str(tmp_path / "state"))
    (tmp_path / "state" / POINTER_NAME).write_text('{"step": 1}')
    with pytest.raises(CorruptCheckpointError,
                       match=r"smart_ckpt\.json is not a valid pointer \(KeyError: 'root, task_id, path'\)"):
        acc.load_state(str(tmp_path / "state"))
    hooks.close()


def test_hooks_created_mid_run_file_the_right_step(tmp_path: Path):
    acc, model, opt, dl, sched = _setup()
    _train(acc, model, opt, sched, _stream(dl), 2)  # AdamW keeps its own step count
    hooks = SmartStateHooks(acc, config=SmartCkptConfig(root=str(tmp_path / "store")))
    hooks.register()
    acc.save_state(str(tmp_path / "state"))
    assert json.loads((tmp_path / "state" / POINTER_NAME).read_text())["step"] == 2
    hooks.close()


def test_two_optimizers_are_refused(tmp_path: Path):
    from accelerate import Accelerator

    from hf_dynamic_ckpt.errors import ConfigError

    acc = Accelerator(cpu=True)
    model = toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32)
    params = list(model.parameters())
    model, *_ = acc.prepare(model, torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1))
    with pytest.raises(ConfigError, match=r"accelerator prepared 2 optimizers: .* prepare a single one"):
        SmartStateHooks(acc, config=SmartCkptConfig(root=str(tmp_path)))
